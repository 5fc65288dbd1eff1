-- moonshard.pp_order — the pipeline schedules as lists: each rank's order
-- of forwards, backwards and weight-gradient passes, where the virtual
-- stages sit, and a simulator that runs the orders against each other with
-- fixed costs (the makespan, the bubble, the activations held, and a
-- deadlock or a mismatched exchange found before any rank runs).
-- ms.pp runs the looped BFS, ZBV and DualPipeV orders from here
-- (Pipeline:run_order);
-- the 1F1B, ZB-H1, GPipe and interleaved orders model the loops of
-- Pipeline:run_schedule and run_interleaved (the spec checks the traces
-- against them). docs/pp.md has the orders drawn.
--
--   local O = require 'moonshard.pp_order'
--   O.order('zbv', 4, 1, 8)        -- rank 1 of 4, 8 micro-batches: { {'F', 1, 1}, ... }
--   O.simulate('zbv', 4, 8)        -- { makespan =, bubble =, peak = {...}, orders = {...} }
--   O.simulate('zbv', 4, 8, { cost = O.stage_costs({ 1, 2, 2, 2, 2, 3, 3, 1 }, 4, 4.1) })  -- a cut's
--   O.simulate('dualpipev', 4, 8, { comm_f = 1, comm_b = 1, overlap = true })  -- DeepSeek's F&B pairs
--
-- An op is { kind, i, c }: kind 'F' (forward), 'B' (the backward: the
-- input's gradient, sent on), 'W' (the weight gradients), micro-batch i and
-- the rank's chunk c (1-based). Every schedule lists a W for every B; in
-- those that do not split the backward (all but zbh1, zbv and dualpipev)
-- it follows its B at once (the weight gradients after the input's send:
-- input_grad_first). DualPipeV's overlapped pairs are a forward marked
-- `overlap = true` followed by the backward of another micro-batch on the
-- other chunk and its W: { 'F', i, c, overlap = true }, { 'B', j, c' },
-- { 'W', j, c' } (DeepSeek runs the three as one unit, the one's
-- communication under the other's compute; ms.pp runs them in turn).
local O = {}

-- the schedules on the V (two chunks a rank)
local function vshaped(schedule) return schedule == 'zbv' or schedule == 'dualpipev' end
O.vshaped = vshaped

-- the chunks a rank holds under schedule (v where the schedule takes any)
function O.chunks(schedule, v) return vshaped(schedule) and 2 or (v or 1) end

-- the placements: 'ring' (chunk c of rank s is virtual stage (c - 1) S + s:
-- one chunk a rank, and the interleaved and looped BFS schedules) and 'v'
-- (zbv, dualpipev: chunk 1 of rank s is virtual stage s, chunk 2 virtual
-- stage 2S - 1 - s, so rank 0 holds the first and the last)
function O.layout(schedule) return vshaped(schedule) and 'v' or 'ring' end

-- the virtual stage (0-based) of chunk c on rank s
function O.vstage(layout, S, s, c)
  if layout == 'v' then return c == 1 and s or 2 * S - 1 - s end
  return (c - 1) * S + s
end

-- the rank of virtual stage k, and its chunk there
function O.rank_of(layout, S, k)
  if layout == 'v' then
    if k < S then return k, 1 end
    return 2 * S - 1 - k, 2
  end
  return k % S, math.floor(k / S) + 1
end

-- the fewest micro-batches a schedule runs with S stages (nil: any number),
-- and the multiple they must be of
function O.microbatch_rule(schedule, S)
  if schedule == 'zbv' then return 2 * S - 1, 1 end
  if schedule == 'dualpipev' then return 2 * S, 1 end
  if schedule == 'interleaved' then return S, S end
  return 1, 1
end

local function list()
  local r = {}
  return r, function(kind, i, c) r[#r + 1] = { kind, i, c } end
end

-- 1F1B (Megatron-LM's): min(S - s - 1, M) warm-up forwards, then a forward
-- and the oldest backward in turn, then the remaining backwards; zbh1
-- (ZB-H1): each micro-batch's W waits until s later backwards have run,
-- the rest after the last backward
local function one_f_one_b(S, s, M, delay)
  local r, add = list()
  local pending = {}
  local function back(i)
    add('B', i, 1)
    pending[#pending + 1] = i
    while #pending > delay do add('W', table.remove(pending, 1), 1) end
  end
  local warm = math.min(S - s - 1, M)
  for i = 1, warm do add('F', i, 1) end
  for k = 1, M - warm do
    add('F', warm + k, 1)
    back(k)
  end
  for k = M - warm + 1, M do back(k) end
  for _, i in ipairs(pending) do add('W', i, 1) end
  return r
end

-- the interleaved 1F1B's k-th forward (backward) on a rank, 0-based ->
-- micro-batch, chunk (Pipeline:interleaved_at)
local function interleaved_at(S, v, k, backward)
  local c = math.floor(k / S) % v
  if backward then c = v - 1 - c end
  return math.floor(k / (S * v)) * S + k % S + 1, c + 1
end

local function interleaved(S, s, M, v)
  local r, add = list()
  local total = M * v
  local function F(k) add('F', interleaved_at(S, v, k, false)) end
  local function B(k)
    local i, c = interleaved_at(S, v, k, true)
    add('B', i, c); add('W', i, c)
  end
  local warm = math.min((S - s - 1) * 2 + (v - 1) * S, total)
  for k = 0, warm - 1 do F(k) end
  for k = 0, total - warm - 1 do F(warm + k); B(k) end
  for k = total - warm, total - 1 do B(k) end
  return r
end

-- GPipe over the chunks (looped BFS): every micro-batch through chunk 1,
-- then chunk 2, ...; then the backwards, the last chunk first
local function looped_bfs(M, v)
  local r, add = list()
  for c = 1, v do for i = 1, M do add('F', i, c) end end
  for c = v, 1, -1 do for i = 1, M do add('B', i, c); add('W', i, c) end end
  return r
end

-- ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism"): chunk 1 down the
-- ranks, chunk 2 back up. Rank s's first forward of chunk 2 comes
-- 2(S - s) - 1 forward slots after its first of chunk 1, which it fills
-- with chunk 1's; then chunk 2's forwards alternate with chunk 1's until
-- the first backward reaches it (s pairs); then chunk 2's forward,
-- backward and W until the backward reaches chunk 1 (S - s triples). In
-- the steady state each chunk's forward, backward and W in turn (chunk 1's
-- forward while any are left), and in the cool-down the backwards first
-- (s pairs of the two chunks', then chunk 1's each with a W), the W left
-- over at the end. At most 2S chunks begun and not through their W on
-- every rank: S micro-batches of a whole stage's activations, 1F1B's peak
-- on its first stage. Needs M >= 2S - 1 (rank 0's warm-up).
local function zbv(S, s, M)
  local r, add = list()
  local nf, nb, nw = { 0, 0 }, { 0, 0 }, { 0, 0 }
  local function F(c) nf[c] = nf[c] + 1; add('F', nf[c], c) end
  local function B(c) nb[c] = nb[c] + 1; add('B', nb[c], c) end
  local function W(c) nw[c] = nw[c] + 1; add('W', nw[c], c) end
  for _ = 1, 2 * (S - s) - 1 do F(1) end
  for _ = 1, s do F(2); F(1) end
  for _ = 1, S - s do F(2); B(2); W(2) end
  while nf[2] < M do
    if nf[1] < M then F(1) end
    B(1); W(1); F(2); B(2); W(2)
  end
  for _ = 1, s do B(1); B(2) end
  for _ = 1, S - s do B(1); W(1) end
  while nw[2] < nb[2] do W(2) end
  while nw[1] < nb[1] do W(1) end
  return r
end

-- DualPipeV (DeepSeek's DualPipe cut in half: the DualPipe repository's
-- dualpipev.py, torch.distributed.pipelining's ScheduleDualPipeV), on ZB-V's
-- placement. DualPipe's phase 0 is our chunk 1 (down the ranks), phase 1
-- chunk 2 (back up, the loss on rank 0). Rank s of S, M >= 2S micro-batches
-- (each chunk's forwards and backwards in the micro-batches' order; a B
-- "split" leaves its W in a FIFO queue, a full one runs its W at once):
--   1. 2(S - 1 - s) forwards of chunk 1;
--   2. s + 1 pairs: chunk 1's forward, chunk 2's forward;
--   3. S - 1 - s triples: chunk 2's split B, the oldest W, chunk 2's F;
--   4. M - 2S + s + 1 times the overlapped pairs F1&B2 then F2&B1 (the
--      last rank's first F1, B2 not paired: its F1 feeds its own F2);
--   5. S - 1 - s times: chunk 2's B, then the pair F2&B1;
--   6. s + 1 pairs of backwards, chunk 2's then chunk 1's, split from the
--      middle on (the (s+1)//2-th pair: both split on odd ranks, only
--      chunk 1's on even ones), full before;
--   7. S - 1 - s times: the oldest W, chunk 1's split B;
--   8. the s + 1 W left.
-- 2S chunk-activations are held after step 2 and a pair's forward runs
-- before its backward frees one: at most 2S + 1 chunks begun and not
-- through their W on every rank (S + 1/2 stages' activations: DualPipe's
-- "PP + 1" of its 2S stages), one chunk more than ZB-V.
local function dualpipev(S, s, M)
  local r, add = list()
  local nf, nb = { 0, 0 }, { 0, 0 }
  local waiting, head, tail = {}, 1, 0   -- the split B's W: { i, c }, oldest first
  local function F(c, pair)
    nf[c] = nf[c] + 1
    add('F', nf[c], c)
    if pair then r[#r].overlap = true end
  end
  local function B(c, split)
    nb[c] = nb[c] + 1
    add('B', nb[c], c)
    if split then
      tail = tail + 1
      waiting[tail] = { nb[c], c }
    else
      add('W', nb[c], c)
    end
  end
  local function W()
    local w = waiting[head]
    waiting[head], head = nil, head + 1
    add('W', w[1], w[2])
  end
  for _ = 1, 2 * (S - 1 - s) do F(1) end
  for _ = 1, s + 1 do F(1); F(2) end
  for _ = 1, S - 1 - s do B(2, true); W(); F(2) end
  for k = 1, M - 2 * S + s + 1 do
    F(1, not (k == 1 and s == S - 1)); B(2)
    F(2, true); B(1)
  end
  for _ = 1, S - 1 - s do B(2); F(2, true); B(1) end
  local split, mid = false, math.floor((s + 1) / 2)
  for k = 0, s do
    if k == mid and s % 2 == 1 then split = true end
    B(2, split)
    if k == mid and s % 2 == 0 then split = true end
    B(1, split)
  end
  for _ = 1, S - 1 - s do W(); B(1, true) end
  for _ = 1, s + 1 do W() end
  return r
end

-- O.order(schedule, S, s, M, v, forward_only) -> rank s's list of ops.
-- schedule: '1f1b', 'zbh1', 'gpipe', 'interleaved' (v chunks),
-- 'looped_bfs' (v chunks), 'zbv', 'dualpipev'; forward_only: the evaluation's order
-- (every micro-batch through chunk 1, then chunk 2, ...: any placement)
function O.order(schedule, S, s, M, v, forward_only)
  v = O.chunks(schedule, v)
  local lo, mult = O.microbatch_rule(schedule, S)
  if M < lo or M % mult ~= 0 then
    error(('pp_order: %s over %d stages cannot run %d micro-batches (at least %d%s)'):format(schedule, S, M, lo,
      mult > 1 and (', a multiple of ' .. mult) or ''), 2)
  end
  if forward_only then
    local r, add = list()
    for c = 1, v do for i = 1, M do add('F', i, c) end end
    return r
  end
  if schedule == '1f1b' then return one_f_one_b(S, s, M, 0) end
  if schedule == 'zbh1' then return one_f_one_b(S, s, M, s) end
  if schedule == 'gpipe' or schedule == 'looped_bfs' then return looped_bfs(M, v) end
  if schedule == 'interleaved' then return interleaved(S, s, M, v) end
  if schedule == 'zbv' then return zbv(S, s, M) end
  if schedule == 'dualpipev' then return dualpipev(S, s, M) end
  error(('pp_order: no schedule %s'):format(tostring(schedule)), 2)
end

-- O.simulate(schedule, S, M, opts) -> { makespan, bubble, peak, held, orders }:
-- every rank runs its order, an op starting when the rank is free and its
-- inputs are there (F: the previous virtual stage's F; B: its F and the
-- next virtual stage's B, or its W too with opts.fused: the gradient sent
-- after the weight gradients; W: its B), exchanges taking no time.
-- opts: chunks (v), f, b, w (a whole stage's costs, default 1 each; a
-- chunk's are 1/v of them), cost (virtual stage k's share of a stage's
-- work at cost[k + 1], in place of 1/v each: O.stage_costs makes it from a
-- cut), act (act[k + 1]: a micro-batch's activations on virtual stage k,
-- say its blocks: held[s + 1] is then the most rank s holds at once),
-- fused, forward_only, orders (rank -> list, in place of the schedule's),
-- comm_f, comm_b (a whole stage's communication inside its F and B, an
-- MoE layer's all-to-all: added to the op's time, exposed; default 0),
-- overlap (dualpipev's pairs run as DeepSeek runs them: the F, the B and
-- its W of a pair one unit, starting when both inputs are there and
-- taking the longer of their compute and their communication summed,
-- each's hidden under the other's; without it they run in turn, as ms.pp
-- runs them).
-- Errors on a deadlock (naming the ops the ranks
-- wait at), an op missing or run twice, and an exchange between two ranks
-- whose receiver takes the messages in another order than the sender sends
-- them (a channel: sender, receiver, direction). bubble: the share of the
-- makespan on every rank not spent on compute (exposed communication
-- counts as lost); peak[s + 1]: the most stage-activations
-- (chunks begun and not through their W, over v) rank s held.
function O.simulate(schedule, S, M, opts)
  opts = opts or {}
  local v = O.chunks(schedule, opts.chunks)
  local layout = O.layout(schedule)
  local V = S * v
  local f, b, w = opts.f or 1, opts.b or 1, opts.w or 1
  local comm_f, comm_b = opts.comm_f or 0, opts.comm_b or 0
  local cost = opts.cost
  if cost == nil then
    cost = {}
    for k = 1, V do cost[k] = 1 / v end
  elseif #cost ~= V then
    error(('pp_order: cost lists %d virtual stages, %s over %d stages has %d'):format(#cost, schedule, S, V), 2)
  end
  local orders = opts.orders or {}
  for s = 0, S - 1 do orders[s + 1] = orders[s + 1] or O.order(schedule, S, s, M, v, opts.forward_only) end
  local done = { F = {}, B = {}, W = {} }   -- kind -> key (i, k) -> finish time
  local function key(i, k) return (i - 1) * V + k end
  -- every op once
  for s = 0, S - 1 do
    local seen = {}
    for _, op in ipairs(orders[s + 1]) do
      local kind, i, c = op[1], op[2], op[3]
      local id = kind .. ':' .. i .. ':' .. c
      if seen[id] then error(('pp_order: rank %d runs %s of micro-batch %d, chunk %d twice'):format(s, kind, i, c), 2) end
      seen[id] = true
    end
    for c = 1, v do
      for i = 1, M do
        for _, kind in ipairs(opts.forward_only and { 'F' } or { 'F', 'B', 'W' }) do
          if not seen[kind .. ':' .. i .. ':' .. c] then
            error(('pp_order: rank %d never runs %s of micro-batch %d, chunk %d'):format(s, kind, i, c), 2)
          end
        end
      end
    end
  end
  local pos, free_at, open, peak, held, most = {}, {}, {}, {}, {}, {}
  local act = opts.act or {}
  local sent, got = {}, {}   -- channel -> list of (i, k) in the sender's, the receiver's order
  for s = 0, S - 1 do pos[s + 1], free_at[s + 1], open[s + 1], peak[s + 1], held[s + 1], most[s + 1] = 1, 0, 0, 0, 0, 0 end
  local function push(t, ch, what) t[ch] = t[ch] or {}; table.insert(t[ch], what) end
  local left = 0
  for s = 1, S do left = left + #orders[s] end
  while left > 0 do
    local moved = false
    for s = 0, S - 1 do
      local ord = orders[s + 1]
      while pos[s + 1] <= #ord do
        local op = ord[pos[s + 1]]
        -- (an overlapped pair, with opts.overlap: its F, B and W as one unit)
        local unit = { op }
        if op.overlap and opts.overlap then
          local b_, w_ = ord[pos[s + 1] + 1], ord[pos[s + 1] + 2]
          if not (b_ and w_ and b_[1] == 'B' and w_[1] == 'W' and w_[2] == b_[2] and w_[3] == b_[3]) then
            error(('pp_order: rank %d pairs the forward of micro-batch %d, chunk %d with no backward and its W after it'):format(
              s, op[2], op[3]), 2)
          end
          unit = { op, b_, w_ }
        end
        local ready, ks = 0, {}
        for u = 1, #unit == 3 and 2 or 1 do
          local kind, i, c = unit[u][1], unit[u][2], unit[u][3]
          local k = O.vstage(layout, S, s, c)
          ks[u] = k
          local r
          if kind == 'F' then
            r = k == 0 and 0 or done.F[key(i, k - 1)]
          elseif kind == 'B' then
            local up = k == V - 1 and 0 or (opts.fused and done.W or done.B)[key(i, k + 1)]
            local own = done.F[key(i, k)]
            r = up and own and math.max(up, own)
          else
            r = done.B[key(i, k)]
          end
          ready = r and ready and math.max(ready, r)
        end
        if ready == nil then break end
        local t0 = math.max(free_at[s + 1], ready)
        local t1
        if #unit == 3 then
          ks[3] = ks[2]
          local kf, kb = ks[1] + 1, ks[2] + 1
          t1 = t0 + math.max(cost[kf] * f + cost[kb] * (b + w), cost[kf] * comm_f + cost[kb] * comm_b)
        else
          local kind, k = op[1], ks[1]
          t1 = t0 + cost[k + 1] * (kind == 'F' and f + comm_f or kind == 'B' and b + comm_b or w)
        end
        free_at[s + 1] = t1
        for u, uop in ipairs(unit) do
          local kind, i, k = uop[1], uop[2], ks[u]
          done[kind][key(i, k)] = t1
          -- the exchanges: a forward's output to the next virtual stage, a
          -- backward's input gradient to the previous, when on another rank
          if kind == 'F' then
            if k > 0 and O.rank_of(layout, S, k - 1) ~= s then push(got, O.rank_of(layout, S, k - 1) .. '>' .. s .. ':F', i .. '/' .. (k - 1)) end
            if k < V - 1 and O.rank_of(layout, S, k + 1) ~= s then push(sent, s .. '>' .. O.rank_of(layout, S, k + 1) .. ':F', i .. '/' .. k) end
            open[s + 1] = open[s + 1] + 1
            peak[s + 1] = math.max(peak[s + 1], open[s + 1])
            held[s + 1] = held[s + 1] + (act[k + 1] or 0)
            most[s + 1] = math.max(most[s + 1], held[s + 1])
          elseif kind == 'B' then
            if k < V - 1 and O.rank_of(layout, S, k + 1) ~= s then push(got, O.rank_of(layout, S, k + 1) .. '>' .. s .. ':B', i .. '/' .. (k + 1)) end
            if k > 0 and O.rank_of(layout, S, k - 1) ~= s then push(sent, s .. '>' .. O.rank_of(layout, S, k - 1) .. ':B', i .. '/' .. k) end
          else
            open[s + 1] = open[s + 1] - 1
            held[s + 1] = held[s + 1] - (act[k + 1] or 0)
          end
        end
        pos[s + 1] = pos[s + 1] + #unit
        left = left - #unit
        moved = true
      end
    end
    if not moved then
      local waits = {}
      for s = 0, S - 1 do
        local op = orders[s + 1][pos[s + 1]]
        if op then waits[#waits + 1] = ('rank %d at %s of micro-batch %d, chunk %d'):format(s, op[1], op[2], op[3]) end
      end
      error('pp_order: ' .. schedule .. ' deadlocks: ' .. table.concat(waits, '; '), 2)
    end
  end
  local channels = {}
  for ch in pairs(sent) do channels[#channels + 1] = ch end
  for ch in pairs(got) do if not sent[ch] then channels[#channels + 1] = ch end end
  table.sort(channels)
  for _, ch in ipairs(channels) do
    local l, g = sent[ch] or {}, got[ch] or {}
    for n = 1, math.max(#l, #g) do
      if l[n] ~= g[n] then
        error(('pp_order: %s: exchange %d on %s: sent %s, received as %s (micro-batch/virtual stage)'):format(schedule,
          n, ch, tostring(l[n]), tostring(g[n])), 2)
      end
    end
  end
  local makespan = 0
  for s = 1, S do makespan = math.max(makespan, free_at[s]) end
  -- the work every rank runs, against S makespans
  local busy = 0
  for k = 1, V do busy = busy + cost[k] end
  busy = busy * M * (opts.forward_only and f or f + b + w)
  for s = 1, S do peak[s] = peak[s] / v end
  return { makespan = makespan, bubble = 1 - busy / (S * makespan), peak = peak, held = opts.act and most or nil,
    orders = orders }
end

-- O.stage_costs(layers, last_cost, first_cost) -> a virtual stage's work
-- (O.simulate's cost) for a cut: its blocks, the head's last_cost blocks on
-- the last, the embedding's first_cost on the first, over the mean of a
-- rank's (the whole model's work over S: a stage of 1F1B's uniform cut is 1)
function O.stage_costs(layers, S, last_cost, first_cost)
  local c, total = {}, 0
  for k, n in ipairs(layers) do c[k] = n; total = total + n end
  c[1] = c[1] + (first_cost or 0)
  c[#c] = c[#c] + (last_cost or 0)
  total = total + (first_cost or 0) + (last_cost or 0)
  for k = 1, #c do c[k] = c[k] * S / total end
  return c
end

-- O.holds(schedule, S, M, v) -> hold[k + 1]: the most micro-batches whose
-- activations virtual stage k holds at once (its forward run, its W not
-- yet) in its rank's order: 1F1B's stage s holds min(S - s, M)
function O.holds(schedule, S, M, v)
  v = O.chunks(schedule, v)
  local layout, hold = O.layout(schedule), {}
  for s = 0, S - 1 do
    local open, most = {}, {}
    for c = 1, v do open[c], most[c] = 0, 0 end
    for _, op in ipairs(O.order(schedule, S, s, M, v)) do
      local c = op[3]
      if op[1] == 'F' then open[c] = open[c] + 1 elseif op[1] == 'W' then open[c] = open[c] - 1 end
      most[c] = math.max(most[c], open[c])
    end
    for c = 1, v do hold[O.vstage(layout, S, s, c) + 1] = most[c] end
  end
  return hold
end

-- O.table(schedule, S, M, v) -> a markdown table of the ranks' orders
-- (docs/pp.md): one row a rank, F3 the forward of micro-batch 3 (F3' of
-- its chunk 2, F3'' of chunk 3, ...)
function O.table(schedule, S, M, v)
  local lines = {}
  for s = 0, S - 1 do
    local cells = {}
    for _, op in ipairs(O.order(schedule, S, s, M, v)) do
      cells[#cells + 1] = op[1] .. op[2] .. string.rep("'", op[3] - 1)
    end
    lines[#lines + 1] = ('| %d | %s |'):format(s, table.concat(cells, ' '))
  end
  return '| rank | order |\n| --- | --- |\n' .. table.concat(lines, '\n')
end

return O
