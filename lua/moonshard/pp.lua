-- moonshard.pp — pipeline parallelism: the model's blocks cut into stages,
-- one stage a rank (or several chunks a rank), micro-batches flowing through
-- them: GPipe, 1F1B and the interleaved 1F1B (torchtitan's ScheduleGPipe,
-- Schedule1F1B and Interleaved1F1B; Megatron-LM's orders), the zero-bubble
-- ZB-H1 and ZB-V, and GPipe over chunks (looped BFS); the orders of the last
-- two come from moonshard.pp_order. docs/pp.md has the whole story.
--
--   local pipe = ms.pp.pipeline(model, { group = g, microbatches = 8, schedule = '1f1b' })
--   model:to('cuda')                     -- (only this stage's parameters are left in it)
--   local opt = ms.optim.AdamW(model:parameters(), { lr = 3e-4 })
--   local loss = pipe:step(ids, targets) -- forward and backward of every micro-batch
--   opt:step(); opt:zero_grad()          -- loss: the batch's mean loss, on every stage
--
-- The model says how it is cut (model:pipeline_parts(): GPT-2 and Llama have
-- it): the first stage's embeddings, the list of blocks, the last stage's
-- final norm and head, and parameter name prefixes for each. pp.pipeline
-- keeps in the model only the parameters of this rank's stage (the others
-- are dropped from their modules, or never made when the model was built
-- under nn.deferred_init), so model:parameters(), model:to(),
-- model:state_dict() and an optimizer all see the stage alone, under the
-- whole model's names. A weight used by the first and the last stage (GPT-2's
-- tied wte and head) lives on both, and its gradient is summed between them
-- at the end of each step (Megatron-LM's tied embeddings), so the two copies
-- stay equal under any optimizer that is deterministic.
--
-- Each micro-batch's forward records into a tape of its own (the autograd
-- tape is linear), so backward runs per micro-batch in the schedule's
-- order. Activations move between neighbouring stages with dist.batch_p2p,
-- sends left running beside the compute and receives waited for, on groups
-- arranged so that no schedule deadlocks on NCCL or MPI (Pipeline:p2p).
local A = require 'moonshard.autograd'
local dist = require 'moonshard.dist'
local amp = require 'moonshard.amp'
local T = require 'moonshard.tensor'
local F = require 'moonshard.ops'
local optim = require 'moonshard.optim'
local order = require 'moonshard.pp_order'
-- (moonshard.nn when first used: it loads after this file)
local function nn_moe() return require('moonshard.nn').moe end

local pp = {}
pp.order = order

local Pipeline = {}
Pipeline.__index = Pipeline
pp.Pipeline = Pipeline

local function has_prefix(name, list)
  for _, p in ipairs(list) do if name:sub(1, #p) == p then return true end end
  return false
end

-- The head's work per element of its weight, against a block's per
-- parameter: a block also runs attention and a dozen memory-bound passes
-- its parameter count does not show, the fused loss's GEMMs run near the
-- GEMM rate. Measured: the 1.25B Llama's 2-stage pipeline on two H200s
-- (16 one-sequence micro-batches) ran 392 / 385 / 417 / 448 ms a step at
-- 9+7 / 10+6 / 11+5 / 12+4 blocks; its head is 5.8 blocks of parameters,
-- so 0.7 of them puts it at 4.1, the 10+6 split.
pp.head_weight = 0.7

-- pp.balanced(n_blocks, n_stages, last_cost) -> blocks per stage when
-- none are given: the last stage also carries the final norm and the head,
-- worth last_cost blocks of work (pp.pipeline counts it as pp.head_weight
-- times the head's weight over a block's parameters: ~4 blocks for a
-- Llama-3 vocabulary's head on a 1B model); the last stage gets the number of blocks that makes
-- the most loaded stage lightest (more when that ties: the earlier stages
-- hold more micro-batches' activations under 1F1B), the others share the
-- rest evenly, the extra ones first. Every stage gets a block when there are
-- enough.
function pp.balanced(n_blocks, n_stages, last_cost)
  last_cost = last_cost or 0
  if n_stages == 1 then return { n_blocks } end
  local lo = n_blocks >= n_stages and 1 or 0
  local best_k, best = lo, math.huge
  for k = lo, n_blocks - lo * (n_stages - 1) do
    local worst = math.max(math.ceil((n_blocks - k) / (n_stages - 1)), k + last_cost)
    if worst <= best then best_k, best = k, worst end
  end
  local rest, r = n_blocks - best_k, {}
  local base, extra = math.floor(rest / (n_stages - 1)), rest % (n_stages - 1)
  for s = 1, n_stages - 1 do r[s] = base + (s <= extra and 1 or 0) end
  r[n_stages] = best_k
  return r
end

-- pp.rank_balanced(n_blocks, n_stages, opts) -> blocks per virtual stage
-- for a pipeline of several chunks a rank, balancing the RANKS' work (a
-- rank runs all its chunks: balancing the virtual stages, as pp.balanced
-- does, leaves zbv's rank 0 with the embedding's chunk, the last chunk and
-- the head). opts: chunks (v, default 1), layout (pp_order's: 'ring',
-- virtual stage k on rank k % S, or 'v', zbv's), last_cost (the head's
-- work in blocks, on the last virtual stage), first_cost (the
-- embedding's, on the first), hold (hold[k + 1]: the most micro-batches'
-- activations virtual stage k holds at once, pp_order.holds; default
-- equal). Every virtual stage gets a block when there are enough, but for
-- one whose fixed work is a block's or more (the last may hold the head
-- alone: a block beside a 4-block head on zbv's rank 0 is a block too
-- many). Each further block goes where its rank's work is least (water
-- filling: the most loaded rank as light as it can be, the others as even
-- as they can be), then where the virtual stage's work is least, then
-- where it holds the fewest micro-batches' activations (zbv's early
-- stages hold up to M, its late ones few; 1F1B's first stage the most),
-- then on the later stage.
function pp.rank_balanced(n_blocks, n_stages, opts)
  opts = opts or {}
  local S, v = n_stages, opts.chunks or 1
  local V, layout, hold = S * v, opts.layout or 'ring', opts.hold or {}
  local fixed = function(k) return (k == 1 and opts.first_cost or 0) + (k == V and opts.last_cost or 0) end
  -- a block for every virtual stage that has no block's work without one
  local need = 0
  for k = 1, V do if fixed(k) < 1 then need = need + 1 end end
  local lo = n_blocks >= need and 1 or 0
  local n, work, rank, load = {}, {}, {}, {}   -- per virtual stage, per rank
  for r = 1, S do load[r] = 0 end
  local left = n_blocks
  for k = 1, V do
    n[k], rank[k] = fixed(k) < 1 and lo or 0, order.rank_of(layout, S, k - 1) + 1
    work[k] = n[k] + fixed(k)
    load[rank[k]] = load[rank[k]] + work[k]
    left = left - n[k]
  end
  local eps = 1e-9   -- (equal works summed in another order)
  local function before(a, b)
    local ra, rb = load[rank[a]], load[rank[b]]
    if math.abs(ra - rb) > eps then return ra < rb end
    if math.abs(work[a] - work[b]) > eps then return work[a] < work[b] end
    if (hold[a] or 0) ~= (hold[b] or 0) then return (hold[a] or 0) < (hold[b] or 0) end
    return a > b
  end
  for _ = 1, left do
    local best = 1
    for k = 2, V do if before(k, best) then best = k end end
    n[best], work[best] = n[best] + 1, work[best] + 1
    load[rank[best]] = load[rank[best]] + 1
  end
  return n
end

-- pp.default_cut(n_blocks, S, v, schedule, M, last_cost) -> the blocks per
-- virtual stage pp.pipeline takes when none are given: pp.balanced's with
-- one chunk a rank; with several, pp.rank_balanced's, unless pp.balanced's
-- runs faster in pp_order's simulation of the schedule (F = B = W, each
-- virtual stage's proportional to its work: where the ranks' work ties,
-- rank_balanced's memory-first choice can cost a few per cent of a short
-- step)
function pp.default_cut(n_blocks, S, v, schedule, M, last_cost)
  local stages = pp.balanced(n_blocks, S * v, last_cost)
  if v == 1 or n_blocks == 0 then return stages end
  local ranks = pp.rank_balanced(n_blocks, S, { chunks = v, layout = order.layout(schedule), last_cost = last_cost,
    hold = order.holds(schedule, S, M, v) })
  local function time(cut)
    return order.simulate(schedule, S, M, { chunks = v, cost = order.stage_costs(cut, S, last_cost) }).makespan
  end
  return time(ranks) <= time(stages) + 1e-9 and ranks or stages
end

-- name -> stage set of a parameter: 'first', 'last', a block index, or nil
local function classify(parts, name)
  local pre = parts.blocks_prefix
  if name:sub(1, #pre) == pre then
    local i = name:match('^(%d+)%.', #pre + 1)
    if i then return 'block', tonumber(i) + 1 end
  end
  local f, l = has_prefix(name, parts.first), has_prefix(name, parts.last)
  if f or l then return f and l and 'both' or (f and 'first' or 'last') end
  return nil
end

-- pp.pipeline(model, opts) -> Pipeline. opts:
--   group         the pipeline's ranks, stage = group rank (default: the world)
--   microbatches  micro-batches a step (default: the number of stages); the
--                 batch size must be a multiple of it
--   schedule      '1f1b' (default: at most stages - stage micro-batches'
--                 activations held), 'zbh1' (1F1B's order with each
--                 micro-batch's weight gradients run `stage` backwards
--                 later: the zero-bubble paper's ZB-H1, a third of 1F1B's
--                 bubble at 1F1B's peak memory) or 'gpipe' (every forward,
--                 then every backward); with chunks > 1: 'interleaved'
--                 (the default) or 'looped_bfs' (GPipe over the chunks:
--                 every micro-batch through chunk 1, then chunk 2, ...,
--                 then the backwards, the last chunk first); 'zbv': two
--                 chunks a rank in a V (chunk 1 of rank s is virtual stage
--                 s, chunk 2 virtual stage 2S - 1 - s: the embedding and the
--                 head both on rank 0, the turn a local hand-over on rank
--                 S - 1), the zero-bubble paper's ZB-V order
--                 (pp_order.lua), microbatches >= 2S - 1; 'dualpipev':
--                 DeepSeek's DualPipeV on the same V (2 chunks), its
--                 overlapped forward-backward pairs run in turn, the
--                 pair's gradient received during its forward,
--                 microbatches >= 2S
--   layers        blocks per (virtual) stage, a list summing to the
--                 model's blocks, 0s allowed (default pp.default_cut, the
--                 head counted as 0.7 of its weight over a block's
--                 parameters, pp.head_weight: the stages balanced with one
--                 chunk a rank, the ranks' work with several)
--   dtype         of the activations sent between stages (default: the
--                 stage's parameters' dtype, which the residual stream has)
--   overlap       (default true) sends left running beside the compute:
--                 gradients on a second group (below); false: every
--                 exchange waited for, a send and a receive in one batch
--   input_grad_first (default true, with overlap) a stage's backward sends
--                 its input's gradient before the weight gradients run
--                 (StageInput below)
--   chunks        model chunks a rank holds (default 1): with v > 1 the
--                 blocks are cut into stages x v virtual stages, virtual
--                 stage k on rank k % stages, and the schedule is the
--                 interleaved 1F1B (Megatron-LM's virtual pipeline,
--                 torchtitan's Interleaved1F1B): a bubble v times smaller;
--                 microbatches must be a multiple of the stages (looped_bfs:
--                 any number; zbv, dualpipev: 2, the default there)
--   fsdp_reduce   with the stage under fsdp.fully_shard (after the cut):
--                 'step' (default) reduces the gradients once, in the
--                 stage's last backward of the step (the others keep them
--                 unsharded, as no_sync does); 'microbatch' reduces each
--                 micro-batch's (less memory, M times the traffic)
function pp.pipeline(model, opts)
  opts = opts or {}
  if type(model) ~= 'table' or type(model.pipeline_parts) ~= 'function' then
    error('pp.pipeline: the model has no pipeline_parts() (GPT-2 and Llama have it; docs/pp.md says what it returns)', 2)
  end
  if rawget(model, '_pp') then error('pp.pipeline: the model is already cut into stages', 2) end
  for name, m in model:named_modules() do
    if rawget(m, '_ep') then
      error(('pp.pipeline: %s is expert-parallel (nn.moe.expert_parallel); cut the model first, then split each '
        .. 'stage\'s experts (ms.ep.parallelize after pp.pipeline, docs/moe.md)'):format(name), 2)
    end
  end
  if rawget(model, '_fsdp') then
    error('pp.pipeline: the model is under fsdp.fully_shard; cut it first, then shard its stage (docs/pp.md, "FSDP")', 2)
  end
  local group = opts.group
  if group == nil then
    if not dist.is_initialized() then error('pp.pipeline: dist is not initialised (ms.dist.init) and no group given', 2) end
    group = dist.world_group
  end
  if not group:is_member() then error('pp.pipeline: this rank is not a member of the group', 2) end
  local S, s = group:size(), group:rank()
  local vshaped = order.vshaped(opts.schedule)   -- zbv, dualpipev
  local v = opts.chunks or (vshaped and 2 or 1)
  if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
    error(('pp.pipeline: chunks must be a positive integer, got %s'):format(tostring(v)), 2)
  end
  if vshaped and v ~= 2 then
    error(('pp.pipeline: the %s schedule runs 2 chunks a rank, got chunks = %d'):format(opts.schedule, v), 2)
  end
  if opts.schedule == 'looped_bfs' and v == 1 then
    error('pp.pipeline: the looped_bfs schedule runs over chunks > 1 a rank (with one chunk it is gpipe)', 2)
  end
  if v > 1 and S == 1 then error(('pp.pipeline: %d chunks a rank need at least 2 stages'):format(v), 2) end
  local V = S * v   -- virtual stages
  local M = opts.microbatches or (vshaped and 2 * S or S)
  if type(M) ~= 'number' or M < 1 or M ~= math.floor(M) then
    error(('pp.pipeline: microbatches must be a positive integer, got %s'):format(tostring(M)), 2)
  end
  local schedule = opts.schedule or (v > 1 and 'interleaved' or '1f1b')
  local fsdp_reduce = opts.fsdp_reduce or 'step'
  if fsdp_reduce ~= 'step' and fsdp_reduce ~= 'microbatch' then
    error(('pp.pipeline: fsdp_reduce must be step or microbatch, got %s'):format(tostring(fsdp_reduce)), 2)
  end
  if v > 1 then
    if schedule ~= 'interleaved' and schedule ~= 'looped_bfs' and not vshaped then
      error(('pp.pipeline: %d chunks a rank run the interleaved, looped_bfs, zbv or dualpipev schedule, not %s'):format(v,
        tostring(schedule)), 2)
    end
    if schedule == 'interleaved' and M % S ~= 0 then
      error(('pp.pipeline: the interleaved schedule needs micro-batches in multiples of the %d stages, got %d'):format(
        S, M), 2)
    end
    if schedule == 'zbv' and M < 2 * S - 1 then
      error(('pp.pipeline: the zbv schedule needs at least 2 x %d - 1 = %d micro-batches over %d stages (the first '
        .. 'rank\'s warm-up runs that many forwards), got %d'):format(S, 2 * S - 1, S, M), 2)
    end
    if schedule == 'dualpipev' and M < 2 * S then
      error(('pp.pipeline: the dualpipev schedule needs at least 2 x %d = %d micro-batches over %d stages (the last '
        .. 'rank\'s first overlapped pair comes after every rank\'s 2 x %d warm-up forwards), got %d'):format(S, 2 * S, S,
        S, M), 2)
    end
  elseif schedule ~= '1f1b' and schedule ~= 'gpipe' and schedule ~= 'zbh1' then
    error(('pp.pipeline: schedule must be 1f1b, zbh1 or gpipe (or interleaved, with chunks > 1), got %s'):format(
      tostring(schedule)), 2)
  end
  if (schedule == 'zbh1' or vshaped) and (opts.overlap == false or opts.input_grad_first == false) then
    error(('pp.pipeline: the ' .. schedule .. ' schedule splits each backward at the stage\'s input (input_grad_first, with '
      .. 'overlap); got overlap = %s, input_grad_first = %s'):format(tostring(opts.overlap ~= false),
      tostring(opts.input_grad_first ~= false)), 2)
  end
  local parts = model:pipeline_parts()
  local L = #parts.blocks
  local layers = opts.layers
  if layers == nil then
    -- the head's work in blocks: its matrices' elements over a block's parameters
    local block_n, head_n = 0, 0
    if L > 0 then for _, p in ipairs(parts.blocks[1]:parameters()) do block_n = block_n + p:numel() end end
    for name, p in model:named_parameters() do
      local kind = classify(parts, name)
      if (kind == 'last' or kind == 'both') and p.ndim == 2 then head_n = head_n + p:numel() end
    end
    layers = pp.default_cut(L, S, v, schedule, M, block_n > 0 and pp.head_weight * head_n / block_n or 0)
  end
  if type(layers) ~= 'table' or #layers ~= V then
    error(('pp.pipeline: layers must list the blocks of each of the %d %sstages, got %s'):format(V,
      v > 1 and 'virtual ' or '', type(layers) == 'table' and (#layers .. ' entries') or tostring(layers)), 2)
  end
  local total = 0
  for i, n in ipairs(layers) do
    if type(n) ~= 'number' or n < 0 or n ~= math.floor(n) then
      error(('pp.pipeline: layers[%d] is %s, not a count of blocks'):format(i, tostring(n)), 2)
    end
    total = total + n
  end
  if total ~= L then
    error(('pp.pipeline: layers {%s} add up to %d blocks but the model has %d'):format(table.concat(layers, ', '),
      total, L), 2)
  end
  if V > 1 and L < V and not opts.layers then
    error(('pp.pipeline: %d blocks cannot fill %d %sstages (give opts.layers to leave stages without blocks)'):format(L,
      V, v > 1 and 'virtual ' or ''), 2)
  end
  -- virtual stage k (0-based) holds blocks starts[k + 1] .. starts[k + 2] - 1,
  -- on rank k % S (zbv: k < S on rank k, the others on rank 2S - 1 - k)
  local layout = order.layout(schedule)
  local function rank_of(k) return (order.rank_of(layout, S, k)) end
  local starts = { 1 }
  for k = 1, V do starts[k + 1] = starts[k] + layers[k] end
  local ranges, vstage_of = {}, {}
  for c = 1, v do
    local k = order.vstage(layout, S, s, c)
    ranges[c] = { starts[k + 1], starts[k + 2] - 1 }
  end
  for k = 0, V - 1 do for i = starts[k + 1], starts[k + 2] - 1 do vstage_of[i] = k end end
  -- first: this rank holds the embeddings (virtual stage 0), last: the head
  -- (virtual stage V - 1; rank 0 too under zbv, which then holds a tied
  -- weight once)
  local head_rank = rank_of(V - 1)
  local first, last = s == 0, s == head_rank


  -- the whole model's optimizer groups (a one-process checkpoint's layout)
  local full_groups = {}
  for _, g in ipairs(optim.build_groups(model, {}, true)) do
    full_groups[#full_groups + 1] = { names = g.names, weight_decay = g.weight_decay }
  end
  -- keep this stage's parameters, drop the others from their modules
  local tied, kept, n_both, names = {}, 0, 0, {}
  for mname, m in model:named_modules() do
    for _, pn in ipairs(m._param_names) do
      local t = rawget(m, pn)
      if t ~= nil then
        local full = (mname ~= '' and mname .. '.' or '') .. pn
        local kind, i = classify(parts, full)
        if kind == nil then
          error(('pp.pipeline: parameter %s belongs to no stage (not a block\'s, not in the model\'s first or last '
            .. 'prefixes)'):format(full), 2)
        end
        if kind == 'both' then n_both = n_both + 1 end
        -- the stage that holds it (the first of two for a tied weight)
        local owner = 0
        if kind == 'last' then owner = head_rank
        elseif kind == 'block' then owner = rank_of(vstage_of[i]) end
        names[#names + 1] = { full, owner }
        local keep = (kind == 'block' and owner == s) or ((kind == 'first' or kind == 'both') and first)
          or ((kind == 'last' or kind == 'both') and last)
        if keep then
          kept = kept + 1
          if kind == 'both' and head_rank ~= 0 then tied[#tied + 1] = { m, pn, full } end
        else
          rawset(m, pn, nil)
        end
      end
    end
  end

  -- the persistent buffers (an MoE layer's expert_bias under
  -- --moe-bias-rate), each with the stage whose forwards update it: every
  -- stage keeps every buffer, only the holder's is current, and a whole
  -- model's state takes the holder's (whole_model)
  local buffers = {}
  for mname, m in model:named_modules() do
    for _, bn in ipairs(m._buffer_names) do
      if rawget(m, bn) ~= nil and m._buffer_persistent[bn] then
        local full = (mname ~= '' and mname .. '.' or '') .. bn
        local kind, i = classify(parts, full)
        local owner = 0
        if kind == 'last' then owner = head_rank
        elseif kind == 'block' then owner = rank_of(vstage_of[i]) end
        buffers[#buffers + 1] = { full, owner }
      end
    end
  end
  table.sort(buffers, function(x, y) return x[1] < y[1] end)

  local ranks = group:ranks()
  local self = setmetatable({
    model = model, parts = parts, group = group, stage = s, n_stages = S, first = first, last = last,
    ranges = ranges, chunks = v, layers = layers, microbatches = M, schedule = schedule,
    opt_dtype = opts.dtype,
    prev = (not first) and ranks[s] or nil, next = (not last) and ranks[s + 2] or nil,
    tied = tied, n_params = kept, names = names, buffers = buffers, full_groups = full_groups,
    fsdp_reduce = fsdp_reduce, vshape = layout == 'v' or nil,
  }, Pipeline)
  -- a model split by tp.parallelize with sequence_parallel: the stages
  -- exchange each TP rank's rows of the residual stream (act_shape)
  local tpi = rawget(model, '_tp')
  self.sp = tpi and tpi.sp or nil
  -- the routers' load-balancing loss over every layer (parts.aux: Mixtral's
  -- output_router_logits): its statistics travel with the activations
  -- (Pipeline:aux_forward, aux_backward)
  if parts.aux then
    self.aux = { coef = parts.aux.coef, E = parts.aux.experts }
    self.stats_of = setmetatable({}, { __mode = 'k' })
  end
  -- gradients go back on a group of their own (overlap; collective over the group)
  self.overlap = (opts.overlap ~= false or v > 1) and S > 1
  self.sends, self.live = {}, {}
  self.input_grad_first = self.overlap and opts.input_grad_first ~= false
  if layout == 'v' then
    -- the V: chunk 1's activations and chunk 2's gradients go down the ranks
    -- (s to s + 1), chunk 2's activations and chunk 1's gradients up; each
    -- of the four kinds has groups of its own by the sender's parity, so on
    -- every group a rank only sends, to one peer, or only receives, from one
    -- (Pipeline:zgroup)
    self.zgroups, self.ranks = {}, ranks
    for _, kind in ipairs({ 'f1', 'f2', 'b1', 'b2' }) do
      self.zgroups[kind] = {}
      for c = 1, 2 do self.zgroups[kind][c] = dist.new_group(ranks, { group = group }) end
    end
  elseif v > 1 then
    -- a ring (the last rank feeds the first's next chunk): each direction's
    -- edges get groups of their own by the sender (2 colours, 3 for an odd
    -- ring), so that on every group's stream a rank only sends or only
    -- receives, and no send waits behind a receive that waits on it
    self.ncolors = S % 2 == 1 and 3 or 2
    self.fwd_groups, self.bwd_groups = {}, {}
    for c = 1, self.ncolors do self.fwd_groups[c] = dist.new_group(ranks, { group = group }) end
    for c = 1, self.ncolors do self.bwd_groups[c] = dist.new_group(ranks, { group = group }) end
    self.ranks = ranks
  elseif self.overlap then self.bwd_group = dist.new_group(ranks, { group = group }) else self.bwd_group = group end
  -- the first and last stages share the tied weights' gradient (collective over the group)
  if head_rank ~= 0 and n_both > 0 then
    self.tied_group = dist.new_group({ ranks[1], ranks[S] }, { group = group })
    if not self.tied_group:is_member() then self.tied_group:free(); self.tied_group = nil end
  end
  rawset(model, '_pp', self)
  return self
end

-- the model a pipeline was made from: its Pipeline, or nil
function pp.of(model) return type(model) == 'table' and rawget(model, '_pp') or nil end

function Pipeline:__tostring()
  local r = {}
  for c, g in ipairs(self.ranges) do r[c] = g[2] < g[1] and 'none' or ('%d-%d'):format(g[1], g[2]) end
  return ('Pipeline(stage %d of %d, blocks %s, %d micro-batches, %s%s)'):format(self.stage, self.n_stages,
    table.concat(r, ', '), self.microbatches, self.schedule,
    #self.tied > 0 and ', tied weights shared with the ' .. (self.first and 'last' or 'first') .. ' stage' or '')
end

-- where the stage's parameters live (after model:to()), and the dtype of
-- the activations between stages: opts.dtype, else the parameters' (the
-- residual stream's dtype, under autocast too)
function Pipeline:device()
  local p = self.model:parameters()[1]
  return p and p.device or 'cpu', self.opt_dtype or (p and p.dtype) or 'f32'
end

-- ------------------------------------------------------------ one micro-batch

-- runs fn with the autograd tape `tape` (each micro-batch records its own)
local function on_tape(tape, fn, ...)
  local saved = A.tape
  A.tape = tape
  local ok, r = pcall(fn, ...)
  A.tape = saved
  if not ok then error(r, 0) end
  return r
end

local function rows(t, i, n) return t:narrow(1, (i - 1) * n + 1, n):contiguous() end

-- The stage's input in the backward (input_grad_first): its gradient goes
-- to the previous stage as soon as the walk has it, and only then do the
-- weight gradients the stage's layers left in the walk's queue
-- (nnf.defer_weight_grads during the forward) run, beside the send; the
-- previous stage starts its backward that much earlier (the input/weight
-- split of zero-bubble schedules, inside one backward)
-- StageInput(x, pipe, rec, split): pipe the Pipeline, rec the micro-batch's
-- record; split (zbh1, zbv): the weight gradients taken for later (rec.w).
-- (The pipeline and the record as arguments, not closures made for each
-- micro-batch: a function making closures ends every trace through it,
-- FNEW and UCLO being unimplemented in LuaJIT's JIT, and a trace
-- specialised on a closure keeps its upvalues alive; docs/tensors.md.)
local function send_input_grad(self, rec, g)
  local gx = g:clone()
  rec.sent = true
  if self.aux and rec.bstats then self.stats_of[gx] = rec.bstats end
  if self.chunks > 1 then self:csend_backward(rec, gx) else self:send_backward(gx) end
end
local StageInput = A.Function {
  name = 'pp_stage_input',
  owns_results = true,
  forward = function(ctx, x, pipe, rec, split)
    ctx.pipe, ctx.rec, ctx.split = pipe, rec, split
    return x
  end,
  backward = function(ctx, g)
    local rec = ctx.rec
    send_input_grad(ctx.pipe, rec, g)
    -- (zbh1: the stage's weight gradients are taken for later)
    if ctx.split then rec.w = A.take_deferred() else A.flush_deferred() end
    return nil, nil, nil, nil
  end,
}

-- the value of the micro-batch's sequence-wise balance loss (box: its
-- nn.moe seq_aux session, or nil) added to the stage's loss sum. (Functions
-- of their own, not closures made in each forward: a trace specialised on
-- one keeps its upvalues, that micro-batch's tensors, alive;
-- docs/tensors.md.)
local function add_f64(sum, v) sum:add_(v:to('f64'):reshape({ 1 })) end
local function add_seq_aux(self, box)
  local v = box and nn_moe().seq_aux_value(box)
  if v then A.no_grad(add_f64, self.loss_sum, v) end
end

-- the last stage's per-micro-batch sums (functions of their own, as above)
local function add_mtp(self)
  for k, v in ipairs(self.model:mtp_losses()) do
    self.mtp_sum:narrow(1, k, 1):add_(v:detach():reshape({ 1 }):to('f64'))
  end
end
local function add_loss(self, loss)
  local l = loss:detach():reshape({ 1 })
  local l64 = l:to('f64')
  self.loss_sum:add_(l64)
  if l64 ~= l then l64:free() end
end

-- the stage's part of micro-batch rec's forward (rec.x its input, nil on
-- the first stage; early: the input's gradient sent as soon as the
-- backward has it, StageInput) -> the activation to send, or the loss
local function stage_forward(self, rec, ids, targets, grad, early)
  local x, i, c, firstv, lastv = rec.x, rec.i, rec.c, rec.firstv, rec.lastv
  local range, parts, mb, sp = self.ranges[c], self.parts, self.mb, self.sp
  local blocks = parts.blocks
  local h = x
  if early then h = StageInput(x, self, rec, self:splits_w()) end
  if firstv then
    -- (sequence parallelism: this TP rank's rows from here on, the
    -- embedding's sums reduce-scattered to them when the model's parts
    -- say how, parts.embed_rows; the head gathers them after the final
    -- norm, nn.LMHead)
    if sp and parts.embed_rows then h = parts.embed_rows(rows(ids, i, mb), sp)
    else
      h = parts.embed(rows(ids, i, mb))
      if sp then h = sp.scatter(h) end
    end
  end
  -- DeepSeek's sequence-wise balance loss (nn.moe.seq_aux_begin): each
  -- stage's MoE layers add their terms to the micro-batch's loss (the
  -- stages' sums are summed: finish_loss), their gradients scaled as the
  -- loss's backward is
  -- (on the last stage the session spans the head too: a model's
  -- multi-token-prediction depths run there, parts.last_moe)
  local box = self:seq_aux_begin(c, grad)
  if self.aux then
    local layers = self:chunk_moe(c)
    rec.abox = #layers > 0 and nn_moe().aux_begin(layers, { coef = 1 }) or nil
  end
  for j = range[1], range[2] do h = blocks[j](h) end
  if self.aux then h = self:aux_forward(rec, h, x, grad) end
  if not lastv then add_seq_aux(self, box); return h end
  -- (parts.head_ids: the head reads the micro-batch's ids, DeepSeek-V3's
  -- multi-token prediction)
  local loss = parts.head(h, rows(targets, i, mb), parts.head_ids and rows(ids, i, mb) or nil)
  if rec.aux_loss then
    local a = rec.aux_loss
    rec.aux_loss = nil
    if a.dtype ~= loss.dtype then a = a:to(loss.dtype) end
    loss = loss + a:reshape(loss.shape)
  end
  add_seq_aux(self, box)
  if self.mtp_sum then
    -- each depth's loss of the micro-batch (model:mtp_losses()), summed
    -- over the step's micro-batches (finish_loss)
    A.no_grad(add_mtp, self)
  end
  local hook = self.step_opts and self.step_opts.loss_hook
  if hook then loss = hook(loss) end
  A.no_grad(add_loss, self, loss)
  if grad then return loss * (self.grad_scale / self.microbatches) end
  return loss
end
-- under fully_shard the stage's part runs as the model's call: the hooks
-- on the root (its unit's gather, the step's bookkeeping) and its backward
-- marks run for each micro-batch
local function stage_call(self, ...)
  if rawget(self.model, '_fsdp') then return self.model:call_as(stage_forward, self, ...) end
  return stage_forward(self, ...)
end
-- the model's precision (nn.functional.set_precision: its forward in an
-- autocast region) holds for the stage's part of the forward too
local function stage_run(compute, ...)
  if compute then return amp.autocast(compute, stage_call, ...) end
  return stage_call(...)
end

-- the forward of micro-batch i: x (received, or nil on the first stage) ->
-- a record {tape, x, out}; out is the activation to send, or the scaled loss
function Pipeline:forward_one(i, x, ids, targets, grad, c)
  c = c or 1
  local firstv, lastv = self.first and c == 1, self.last and c == self.chunks
  local rec = { tape = {}, x = x, i = i, c = c, firstv = firstv, lastv = lastv }
  if grad then self.live[rec] = true end
  -- (sequence parallelism: the stage's blocks see this TP rank's rows)
  local sp = self.sp
  if sp then sp.expect(self.mb, self.seq) end
  local early = grad and self.input_grad_first and not firstv
  local nnf = early and require('moonshard.nn').functional or nil
  local prev_defer = early and nnf.defer_weight_grads(true)
  local ok, out = pcall(on_tape, rec.tape, stage_run, amp.precision(self.model), self, rec, ids, targets, grad,
    early)
  if early then nnf.defer_weight_grads(prev_defer) end
  if not ok then error(out, 0) end
  rec.out = out
  if not lastv then
    local o = rec.out
    local want = self:act_shape()
    local same = o.ndim == #want and o.dtype == self.dtype
    for d = 1, #want do same = same and o.shape[d] == want[d] end
    if not same then
      error(('pp: stage %d made an activation of shape (%s) %s, but the next stage expects (%s) %s'):format(
        self.stage, table.concat(o.shape, ', '), o.dtype, table.concat(want, ', '), self.dtype), 0)
    end
    if not o:is_contiguous() then rec.out = o:contiguous() end
  end
  return rec
end

-- zbh1, zbv and dualpipev take each backward's weight gradients out for
-- later (not under fully_shard: zbv and dualpipev then run them in the
-- backward, as 1f1b does)
function Pipeline:splits_w()
  return self.schedule == 'zbh1' or (order.vshaped(self.schedule) and not rawget(self.model, '_fsdp'))
end

-- the MoE layers of chunk c's blocks (found once), and a balance-loss
-- session on them for a micro-batch's forward when the model asks for one
-- (model:seq_aux_options: DeepSeek's aux_loss_alpha in training mode; the
-- gradient of the step's objective with respect to a micro-batch's loss:
-- grad_scale / microbatches), ending the last one otherwise
function Pipeline:seq_aux_begin(c, grad)
  local model = self.model
  if type(model.seq_aux_options) ~= 'function' then return nil end
  local layers = self:chunk_moe(c)
  if #layers == 0 then return nil end
  local o = model:seq_aux_options(true)
  if o then o.scale = grad and self.grad_scale / self.microbatches or 1 end
  return nn_moe().seq_aux_begin(layers, o)
end

-- the MoE layers of chunk c's blocks (and, on the last, parts.last_moe),
-- in order; found once
function Pipeline:chunk_moe(c)
  self.moe_chunks = self.moe_chunks or {}
  local layers = self.moe_chunks[c]
  if layers == nil then
    layers = {}
    local range, blocks = self.ranges[c], self.parts.blocks
    for j = range[1], range[2] do
      for _, m in ipairs(nn_moe().layers(blocks[j])) do layers[#layers + 1] = m end
    end
    if self.last and c == self.chunks then
      for _, m in ipairs(self.parts.last_moe or {}) do layers[#layers + 1] = m end
    end
    self.moe_chunks[c] = layers
  end
  return layers
end

-- ------------------------------------------------ the load-balancing loss
-- Switch's loss E Σ_e f̄_e P̄_e (moe.aux_loss) is one product of means over
-- every layer's tokens: f̄ the share of all the layers' slots, P̄ the mean
-- score. A pipeline carries each micro-batch's sums forward with its
-- activation: [the slots' counts (E), the layers' mean scores summed (E),
-- the layers, their tokens], each stage adding its layers' in order, so
-- the last stage has the whole model's and makes the loss (added to the
-- micro-batch's, its own layers' gradient through autograd). The gradient
-- of a layer's scores, E f̄_e / (L N) times the objective's gradient with
-- respect to the loss, needs f̄ and L, known only there: they go back with
-- the activation's gradient, [f̄ (E), L, that gradient x coef], and each
-- stage gives its layers' summed means the gradient (AuxInject on its
-- output), or a checkpointed layer's recompute its own (moe's AuxGrad,
-- through the micro-batch's session).

-- AuxInject(y, acc, rec) -> y (an alias); backward: y's gradient as it is,
-- and acc's (the stage's running sum of mean scores) rec.ginj
local AuxInject = A.Function {
  name = 'pp_aux_inject',
  owns_results = true,
  forward = function(ctx, y, acc, rec)
    ctx.rec, ctx.dtype = rec, acc.dtype
    return A.raw_views.alias(y)
  end,
  backward = function(ctx, g)
    local gi = ctx.rec.ginj
    ctx.rec.ginj = nil
    if gi ~= nil and gi.dtype ~= ctx.dtype then gi = gi:to(ctx.dtype) end
    return g, gi, nil
  end,
}

-- the statistics' dtype: the router scores' (f32, f64 in an f64 model)
function Pipeline:aux_dtype() return self.dtype == 'f64' and 'f64' or 'f32' end

-- a buffer for the statistics going forward (2E + 2) or back (E + 2)
function Pipeline:aux_buffer(back)
  local E = self.aux.E
  return T.empty({ back and E + 2 or 2 * E + 2 }, { dtype = self:aux_dtype(), device = self.dev })
end

-- after a micro-batch's blocks on this stage: h (its output), x (its
-- input, nil on the first stage) -> h; rec.stats the sums to send on, or
-- (last stage) the loss term to add, rec.aux_loss
function Pipeline:aux_forward(rec, h, x, grad)
  local E, box = self.aux.E, rec.abox
  local prev = x and self.stats_of[x] or nil
  local counts, L, N, acc = {}, 0, 0, nil
  for e = 1, E do counts[e] = 0 end
  if prev then
    local v = prev:to('cpu'):totable()
    for e = 1, E do counts[e] = v[e] end
    L, N = v[2 * E + 1], v[2 * E + 2]
    if L > 0 then acc = prev:narrow(1, E + 1, E) end
  end
  local mine = 0
  for _, m in ipairs(box and box.list or {}) do
    local st = box.seen[m]
    if st then
      for e = 1, E do counts[e] = counts[e] + st.counts[e] end
      local mean = st.probs:mean(1)
      st.probs = nil
      if acc and acc.dtype ~= mean.dtype then acc = acc:to(mean.dtype) end
      acc = acc and acc + mean or mean
      L, N, mine = L + 1, st.n, mine + 1
    end
  end
  if not rec.lastv then
    local out = self:aux_buffer(false)
    A.no_grad(function()
      local c = T.tensor(counts, { dtype = out.dtype }):to(out.device)
      T.raw_copy_(out:narrow(1, 1, E), c)
      if acc then T.raw_copy_(out:narrow(1, E + 1, E), acc:detach()) else out:narrow(1, E + 1, E):zero_() end
      T.raw_copy_(out:narrow(1, 2 * E + 1, 2), T.tensor({ L, N }, { dtype = out.dtype }):to(out.device))
    end)
    rec.stats = out
    -- (the stage's layers' gradient comes back with the activation's)
    if grad and mine > 0 and A.needs_grad(acc) then h = AuxInject(h, acc, rec) end
    return h
  end
  if L == 0 then return h end
  -- the last stage: the loss over every layer, as moe.aux_loss
  local f = T.tensor(counts, { dtype = acc.dtype }):to(acc.device)
  local fbar = f / (L * N)
  local aux = (fbar * (acc / L)):sum():reshape({ 1 }) * E
  rec.aux_loss = aux * self.aux.coef
  -- what goes back: f̄, L and the objective's gradient x coef
  local sc = (grad and self.grad_scale / self.microbatches or 1) * self.aux.coef
  local b = self:aux_buffer(true)
  A.no_grad(function()
    T.raw_copy_(b:narrow(1, 1, E), fbar:detach())
    T.raw_copy_(b:narrow(1, E + 1, 2), T.tensor({ L, sc }, { dtype = b.dtype }):to(b.device))
  end)
  rec.bstats = b
  return h
end

-- before a micro-batch's backward on this stage: its layers' session back
-- on them (a checkpointed layer's recompute finds it) with f̄, L and the
-- scale, and the gradient of the stage's summed means (rec.ginj)
function Pipeline:aux_backward(rec, gy)
  local info = rec.lastv and rec.bstats or self.stats_of[gy]
  rec.bstats = info
  local box = rec.abox
  if info == nil or box == nil then return end
  local E = self.aux.E
  local v = info:narrow(1, E + 1, 2):to('cpu'):totable()
  local L, sc = v[1], v[2]
  if L == 0 then return end
  local fbar = info:narrow(1, 1, E)
  for _, m in ipairs(box.list) do rawset(m, '_aux', box) end
  box.fbar, box.L, box.coef = fbar, L, 1
  box.scale = T.full({ 1 }, sc, { dtype = fbar.dtype, device = fbar.device })
  if not rec.lastv then rec.ginj = (box.scale * E) * fbar / L end
end

-- (functions of their own: a function making a closure is not compiled)
local function record_backward(rec, gy)
  if rec.lastv then rec.out:backward() else rec.out:backward(gy) end
end
local function not_root_sync(root) return function(u) return u.module ~= root end end

-- the backward of a record, with gy the gradient of its output (nil on the
-- last stage): returns the gradient of its input (nil on the first stage)
function Pipeline:backward_one(rec, gy)
  local fs = self.fs
  if fs then
    -- FSDP: each unit reduces in its last backward of the step ('step'),
    -- or in each ('microbatch'); none when the step does not sync. The
    -- last micro-batch's backward is a unit's last, but for the
    -- interleaved schedule's root unit: the root's hooks run in every
    -- chunk's walk, its last is the stage's last backward (a chunk's own
    -- units run in its walks only)
    fs.nb = fs.nb + 1
    local sync = fs.final and (self.fsdp_reduce == 'microbatch' or fs.nb == fs.total)
    if fs.final and not sync and self.chunks > 1 and rec.i == self.microbatches then
      sync = not_root_sync(self.model)
    end
    fs.fsdp.set_sync(self.model, sync)
  end
  if self.aux then self:aux_backward(rec, gy) end
  on_tape(rec.tape, record_backward, rec, gy)
  if gy ~= nil then gy:free() end
  local gx
  if not rec.firstv then
    if not rec.sent then
      gx = rec.x.grad
      if gx == nil then gx = T.zeros(self:act_shape(), { dtype = self.dtype, device = self.dev }) end
    end
    rec.x.grad = nil
    rec.x:free()
  end
  if gx ~= nil and self.aux and rec.bstats then self.stats_of[gx] = rec.bstats end
  rec.out:free()
  rec.tape, rec.x, rec.out, rec.abox, rec.bstats, rec.stats = nil, nil, nil, nil, nil, nil
  self.live[rec] = nil
  return gx
end

-- ------------------------------------------------------------ communication

-- the shape of the activations between the stages: (mb, T, C), or under
-- sequence parallelism this TP rank's rows of them, (mb·T / M, C) (1/M of
-- the bytes), when mb·T divides over the M ranks of the TP group
function Pipeline:act_shape()
  local sp = self.sp
  if sp and sp.size > 1 and (self.mb * self.seq) % sp.size == 0 then
    return { self.mb * self.seq / sp.size, self.parts.hidden }
  end
  return { self.mb, self.seq, self.parts.hidden }
end

function Pipeline:act_buffer()
  return T.empty(self:act_shape(), { dtype = self.dtype, device = self.dev })
end

-- runs a batch of point-to-point operations (a no-op when empty) on `group`
-- (default: the pipeline's); async: the Work is kept until the step's end
function Pipeline:p2p(ops, group, async)
  if #ops == 0 then return end
  local w = dist.batch_p2p(ops, { group = group or self.group, async = async })
  if w then self.sends[#self.sends + 1] = w end
end

-- Two ways to move the tensors. With overlap (the default) activations go
-- forward on the pipeline's group and gradients backward on a second
-- group (its own communicator and stream): on each, a rank only sends to
-- one neighbour and receives from the other, in the order both sides run
-- the schedule, so a send can be left running (async: the compute stream
-- goes on at once) and only a receive is waited for. Without overlap,
-- every exchange is one batch on one group that the compute stream waits
-- for, a send and a receive between the same ranks paired in one batch
-- (Megatron-LM's send_forward_recv_backward).

-- receive the next micro-batch's input from the previous stage (nil on the first)
-- (with the load-balancing loss each exchange carries the statistics
-- beside the tensor, in the same batch: ops_recv / ops_send)

-- adds to ops the receive of t from peer, with its statistics (back: the
-- gradient's) when the pipeline carries them
function Pipeline:ops_recv(ops, t, peer, back)
  ops[#ops + 1] = { 'recv', t, peer }
  if self.aux then
    local sb = self:aux_buffer(back)
    self.stats_of[t] = sb
    ops[#ops + 1] = { 'recv', sb, peer }
  end
  return ops
end

-- adds to ops the send of t to peer, with stats (the statistics that go with it)
function Pipeline:ops_send(ops, t, peer, stats)
  ops[#ops + 1] = { 'send', t, peer }
  if self.aux then
    if stats == nil then error('pp: the load-balancing loss\'s statistics are missing for a send', 0) end
    ops[#ops + 1] = { 'send', stats, peer }
  end
  return ops
end

-- receive the next micro-batch's input from the previous stage (nil on the first)
function Pipeline:recv_forward(grad)
  if self.first then return nil end
  local x = self:act_buffer()
  self:p2p(self:ops_recv({}, x, self.prev))
  if grad then x:requires_grad_() end
  return x
end

function Pipeline:send_forward(rec)
  if not self.last then self:p2p(self:ops_send({}, rec.out, self.next, rec.stats), nil, self.overlap) end
end

function Pipeline:recv_backward()
  if self.last then return nil end
  local g = self:act_buffer()
  self:p2p(self:ops_recv({}, g, self.next, true), self.bwd_group)
  return g
end

function Pipeline:send_backward(gx)
  if gx ~= nil then
    self:p2p(self:ops_send({}, gx, self.prev, self.stats_of and self.stats_of[gx]), self.bwd_group, self.overlap)
    gx:free()
  end
end

-- 1F1B's steady state: send this output forward and take the output
-- gradient of the oldest micro-batch back
function Pipeline:send_forward_recv_backward(rec)
  if self.last then return nil end
  if self.overlap then
    self:send_forward(rec)
    return self:recv_backward()
  end
  local g = self:act_buffer()
  self:p2p(self:ops_recv(self:ops_send({}, rec.out, self.next, rec.stats), g, self.next, true))
  return g
end

-- send an input gradient back and take the next micro-batch's input
function Pipeline:send_backward_recv_forward(gx)
  if self.first then return nil end
  if self.overlap then
    self:send_backward(gx)
    return self:recv_forward(true)
  end
  local x = self:act_buffer()
  self:p2p(self:ops_recv(self:ops_send({}, gx, self.prev, self.stats_of and self.stats_of[gx]), x, self.prev))
  gx:free()
  x:requires_grad_()
  return x
end

-- The interleaved schedule's exchanges: virtual stage k on rank k % S
-- feeds k + 1 on the next rank (the last rank the first one's next chunk),
-- on the group of the sender's colour in each direction.
local function colour(S, sender, wrap_sender)
  if S % 2 == 1 and sender == wrap_sender then return 3 end
  return sender % 2 + 1
end

function Pipeline:vrecv_forward(c, grad)
  if self.first and c == 1 then return nil end
  local S = self.n_stages
  local prev = (self.stage - 1 + S) % S
  local x = self:act_buffer()
  self:p2p(self:ops_recv({}, x, self.ranks[prev + 1]), self.fwd_groups[colour(S, prev, S - 1)])
  if grad then x:requires_grad_() end
  return x
end

function Pipeline:vsend_forward(rec)
  if rec.lastv then return end
  local S, s = self.n_stages, self.stage
  self:p2p(self:ops_send({}, rec.out, self.ranks[(s + 1) % S + 1], rec.stats), self.fwd_groups[colour(S, s, S - 1)],
    true)
end

function Pipeline:vrecv_backward(rec)
  if rec.lastv then return nil end
  local S = self.n_stages
  local nxt = (self.stage + 1) % S
  local g = self:act_buffer()
  self:p2p(self:ops_recv({}, g, self.ranks[nxt + 1], true), self.bwd_groups[colour(S, nxt, 0)])
  return g
end

function Pipeline:vsend_backward(gx)
  if gx == nil then return end
  local S, s = self.n_stages, self.stage
  self:p2p(self:ops_send({}, gx, self.ranks[(s - 1 + S) % S + 1], self.stats_of and self.stats_of[gx]),
    self.bwd_groups[colour(S, s, 0)], true)
  gx:free()
end

-- the k-th forward (or backward) of a rank under the interleaved schedule
-- (0-based): micro-batches in groups of S, each group through every chunk
-- (the backwards through the chunks in reverse) -> micro-batch, chunk (1-based)
function Pipeline:interleaved_at(k, backward)
  local S, v = self.n_stages, self.chunks
  local c = math.floor(k / S) % v
  if backward then c = v - 1 - c end
  return math.floor(k / (S * v)) * S + k % S + 1, c + 1
end

-- Megatron-LM's interleaved 1F1B: (S - s - 1) x 2 + (v - 1) x S warm-up
-- forwards, then one forward and one backward in turn, then the rest
function Pipeline:run_interleaved(ids, targets, grad)
  local S, s, v, M = self.n_stages, self.stage, self.chunks, self.microbatches
  local total = M * v
  local recs = {}
  local function F(k)
    local i, c = self:interleaved_at(k, false)
    local rec = self:forward_one(i, self:vrecv_forward(c, grad), ids, targets, grad, c)
    self:vsend_forward(rec)
    if grad then
      recs[(i - 1) * v + c] = rec
    else
      if rec.x then rec.x:free() end
      if not rec.lastv then rec.out:free() end
    end
  end
  local function B(k)
    local i, c = self:interleaved_at(k, true)
    local key = (i - 1) * v + c
    local rec = recs[key]
    recs[key] = nil
    self:vsend_backward(self:backward_one(rec, self:vrecv_backward(rec)))
  end
  if not grad then
    for k = 0, total - 1 do F(k) end
    return
  end
  local warm = math.min((S - s - 1) * 2 + (v - 1) * S, total)
  for k = 0, warm - 1 do F(k) end
  for i = 0, total - warm - 1 do
    F(warm + i)
    B(i)
  end
  for i = total - warm, total - 1 do B(i) end
end

-- The exchanges of the schedules that run a list of ops (run_order): the
-- ring's (above), or the V's (zbv). Under the V chunk 1 of rank s is
-- virtual stage s and chunk 2 is 2S - 1 - s: chunk 1's activations go from
-- s to s + 1 (kind f1), chunk 2's from s to s - 1 (f2), chunk 2's input
-- gradients from s to s + 1 (b2), chunk 1's from s to s - 1 (b1). Each kind
-- has two groups, the senders of each parity on their own, so on every
-- group a rank only sends to one peer or only receives from one, in the
-- micro-batches' order on both sides (every rank runs each chunk's
-- forwards, and its backwards, in the micro-batches' order): a send left
-- running never holds up a receive behind it. The turn at the bottom, rank
-- S - 1's chunk 1 to its chunk 2 and the gradient back, is a hand-over of
-- a tensor on the rank (turn_f, turn_b by micro-batch).
function Pipeline:zgroup(kind, sender) return self.zgroups[kind][sender % 2 + 1] end

-- the input of micro-batch i's chunk c (nil on the first virtual stage)
function Pipeline:crecv_forward(c, i, grad)
  if not self.vshape then return self:vrecv_forward(c, grad) end
  local S, s = self.n_stages, self.stage
  local x
  if c == 1 then
    if s == 0 then return nil end
    x = self:act_buffer()
    self:p2p(self:ops_recv({}, x, self.ranks[s]), self:zgroup('f1', s - 1))
  elseif s == S - 1 then
    x = self.turn_f[i]
    self.turn_f[i] = nil
  else
    x = self:act_buffer()
    self:p2p(self:ops_recv({}, x, self.ranks[s + 2]), self:zgroup('f2', s + 1))
  end
  if grad then x:requires_grad_() end
  return x
end

function Pipeline:csend_forward(rec)
  if not self.vshape then return self:vsend_forward(rec) end
  if rec.lastv then return end
  local S, s = self.n_stages, self.stage
  if rec.c == 2 then
    self:p2p(self:ops_send({}, rec.out, self.ranks[s], rec.stats), self:zgroup('f2', s), true)
  elseif s < S - 1 then
    self:p2p(self:ops_send({}, rec.out, self.ranks[s + 2], rec.stats), self:zgroup('f1', s), true)
  else
    -- (the turn: a copy, the record keeps its output for its backward)
    local x = self:act_buffer()
    A.no_grad(function() T.raw_copy_(x, rec.out) end)
    if self.aux then self.stats_of[x] = rec.stats end
    self.turn_f[rec.i] = x
  end
end

-- the gradient of rec's output (nil on the last virtual stage). early
-- (the V only): the receive is posted and not waited for; returns the
-- buffer and the Work to wait on before the backward reads it (nil when
-- nothing comes over the network: the last virtual stage, the turn)
function Pipeline:crecv_backward(rec, early)
  if not self.vshape then return self:vrecv_backward(rec) end
  if rec.lastv then return nil end
  local S, s = self.n_stages, self.stage
  local g, peer, grp
  if rec.c == 2 then
    peer, grp = self.ranks[s], self:zgroup('b2', s - 1)
  elseif s == S - 1 then
    if early then return nil end
    g = self.turn_b[rec.i]
    self.turn_b[rec.i] = nil
    return g
  else
    peer, grp = self.ranks[s + 2], self:zgroup('b1', s + 1)
  end
  g = self:act_buffer()
  local ops = self:ops_recv({}, g, peer, true)
  if early then return g, dist.batch_p2p(ops, { group = grp, async = true }) end
  self:p2p(ops, grp)
  return g
end

-- the gradient of rec's input, sent on (or handed over at the turn)
function Pipeline:csend_backward(rec, gx)
  if gx == nil then return end
  if not self.vshape then return self:vsend_backward(gx) end
  local S, s = self.n_stages, self.stage
  local stats = self.stats_of and self.stats_of[gx]
  if rec.c == 2 then
    if s == S - 1 then self.turn_b[rec.i] = gx; return end
    self:p2p(self:ops_send({}, gx, self.ranks[s + 2], stats), self:zgroup('b2', s), true)
  else
    self:p2p(self:ops_send({}, gx, self.ranks[s], stats), self:zgroup('b1', s), true)
  end
  gx:free()
end

-- runs a list of ops (pp_order: { 'F' | 'B' | 'W', micro-batch, chunk }):
-- looped_bfs, zbv and dualpipev, and the evaluation of every schedule over
-- chunks but the interleaved one. W runs the weight gradients a B took out
-- (zbv, dualpipev; none in the other schedules, whose backwards run their
-- own). DualPipeV's overlapped pair (an F marked overlap, then a B and its
-- W) runs in turn, F then B, on the one stream; the B's output gradient
-- is received while the F runs: its receive is posted before the F's
-- input is taken and waited for only before the B (self.early)
function Pipeline:run_order(ops, ids, targets, grad)
  local v = self.chunks
  local recs, trace = {}, self.trace
  self.wjobs, self.turn_f, self.turn_b = {}, {}, {}
  local wjobs = self.wjobs
  for n, op in ipairs(ops) do
    local kind, i, c = op[1], op[2], op[3]
    local key = (i - 1) * v + c
    if kind == 'F' then
      if grad and op.overlap and self.vshape then
        local b = ops[n + 1]
        local g, work = self:crecv_backward(recs[(b[2] - 1) * v + b[3]], true)
        if work then self.early = { key = (b[2] - 1) * v + b[3], g = g, work = work } end
      end
      local rec = self:forward_one(i, self:crecv_forward(c, i, grad), ids, targets, grad, c)
      self:csend_forward(rec)
      if grad then
        recs[key] = rec
      else
        if rec.x then rec.x:free() end
        if not rec.lastv then rec.out:free() end
      end
    elseif kind == 'B' then
      local rec = recs[key]
      recs[key] = nil
      local gy, early = nil, self.early
      if early and early.key == key then
        self.early = nil
        early.work:wait()
        early.work:free()
        gy = early.g
      else
        gy = self:crecv_backward(rec)
      end
      self:csend_backward(rec, self:backward_one(rec, gy))
      if rec.w then wjobs[key] = rec.w; rec.w = nil end
    else
      local job = wjobs[key]
      wjobs[key] = nil
      if job then job:run() end
    end
    if trace then trace[#trace + 1] = { kind, i, c } end
  end
  self.wjobs, self.turn_f, self.turn_b = nil, nil, nil
end

-- the sends left running, waited for (the compute stream, on NCCL) and freed
function Pipeline:finish_sends()
  for i, w in ipairs(self.sends) do
    w:wait()
    w:free()
    self.sends[i] = nil
  end
end

-- ------------------------------------------------------------ steps

function Pipeline:prepare(ids, targets, what)
  if not T.is_tensor(ids) or ids.ndim ~= 2 then
    error(('pp %s: every stage needs the batch\'s input_ids, a (B, T) tensor (its shape sets the activations\''
      .. ' shape), got %s'):format(what, T.is_tensor(ids) and ('shape (' .. table.concat(ids.shape, ', ') .. ')')
      or type(ids)), 3)
  end
  local B, Tn = ids.shape[1], ids.shape[2]
  if B % self.microbatches ~= 0 then
    error(('pp %s: the batch of %d sequences does not split into %d micro-batches'):format(what, B,
      self.microbatches), 3)
  end
  if self.last then
    if not T.is_tensor(targets) or targets.ndim ~= 2 or targets.shape[1] ~= B or targets.shape[2] ~= Tn then
      error(('pp %s: the last stage needs targets of shape (%d, %d) like input_ids, got %s'):format(what, B, Tn,
        T.is_tensor(targets) and ('shape (' .. table.concat(targets.shape, ', ') .. ')') or type(targets)), 3)
    end
  end
  if self.first and self.parts.check then self.parts.check(ids, self.last and targets or nil) end
  self.mb, self.seq = B / self.microbatches, Tn
  self.dev, self.dtype = self:device()
  self.loss_sum = T.zeros({ 1 }, { dtype = 'f64', device = self.dev })
  -- (multi-token prediction: each depth's loss, parts.mtp_depths)
  local D = self.parts.mtp_depths or 0
  self.mtp_sum = D > 0 and T.zeros({ D }, { dtype = 'f64', device = self.dev }) or nil
end

-- the mean of the micro-batches' losses, on every stage (summed from the
-- last); with multi-token prediction each depth's too (pipe:mtp_losses())
function Pipeline:finish_loss()
  local l = self.loss_sum
  self.loss_sum = nil
  if self.mtp_sum then
    -- (one all-reduce: the loss and the depths' in one tensor)
    local D = self.mtp_sum:numel()
    local both = T.zeros({ 1 + D }, { dtype = 'f64', device = self.dev })
    T.raw_copy_(both:narrow(1, 1, 1), l)
    T.raw_copy_(both:narrow(1, 2, D), self.mtp_sum)
    l:free(); self.mtp_sum:free(); self.mtp_sum = nil
    if self.n_stages > 1 then dist.all_reduce(both, 'sum', { group = self.group }) end
    both:mul_(1 / self.microbatches)
    local v = both:to('cpu'):totable()
    self.mtp = {}
    for k = 1, D do self.mtp[k] = v[1 + k] end
    l = both:narrow(1, 1, 1):clone()
    both:free()
    return l
  end
  if self.n_stages > 1 then dist.all_reduce(l, 'sum', { group = self.group }) end
  l:mul_(1 / self.microbatches)
  return l
end

-- pipe:mtp_losses() -> the last step's (or evaluation's) loss of each
-- multi-token-prediction depth, the mean over its micro-batches, on every
-- stage (numbers; empty when the model has none)
function Pipeline:mtp_losses() return self.mtp or {} end

-- pipe:step(ids, targets) -> loss: the forward and backward of every
-- micro-batch of the batch, gradients accumulated into this stage's
-- parameters (.grad, as loss:backward() of the batch's mean loss would: each
-- micro-batch's loss counts 1/microbatches). Every stage passes the batch's
-- input_ids (B, T); the last needs its targets. The returned loss (f64, (1),
-- on the stage's device) is the mean of the micro-batches' losses, on every
-- stage. opts.scale multiplies the gradients (1 / the steps of gradient
-- accumulation); opts.sync = false leaves the tied weights' gradients
-- unsummed between the first and last stage (every step of a gradient
-- accumulation but the last, as FSDP's no_sync: the last sums what they
-- hold, so a sum taken earlier would be counted again);
-- opts.loss_hook(loss) -> loss transforms each micro-batch's loss on the
-- last stage before its backward.
function Pipeline:step(ids, targets, opts)
  local st = rawget(self.model, '_fsdp')
  if st and st.offload then
    -- (the host's gradient shards would meet the pipeline's NCCL all-reduces)
    error('pp: a stage under fully_shard with offload = true is not supported', 2)
  end
  self:prepare(ids, targets, 'step')
  self.step_opts, self.grad_scale = opts, (opts and opts.scale) or 1
  self:fsdp_begin(opts)
  -- (sequence parallelism: the parameters that run on this TP rank's rows
  -- get parts of their gradients, summed over the TP group once at the
  -- step's end, not at each micro-batch's backward: tp's hold_partial)
  local sp = self.sp
  local hold = sp and sp.hold_partial
  if hold then sp.hold_partial(true) end
  local ok, err = pcall(self.run_schedule, self, ids, targets)
  self:fsdp_end()
  if not ok then
    -- a step cut short: what its micro-batches recorded and hold goes now
    -- (the gradients accumulated so far stay: zero_grad before the next)
    if hold then sp.drop_partial() end
    self:drop_live()
    self.step_opts = nil
    error(err, 0)
  end
  self:finish_sends()
  if hold then sp.hold_partial(false) end
  if not (opts and opts.sync == false) and not rawget(self.model, '_fsdp') then self:sync_tied() end
  self.step_opts = nil
  return self:finish_loss()
end

-- A stage under fsdp.fully_shard (docs/pp.md, "FSDP"): the step's
-- backwards but the last keep their gradients unsharded (fsdp_reduce =
-- 'step'); SHARD_GRAD_OP holds every unit gathered from its first use to
-- the step's end (one all-gather a unit a step), FULL_SHARD gathers for
-- each micro-batch's forward and backward; a tied weight's unsharded
-- gradient is summed between the first and last stage just before its
-- unit reduces it.
-- (made once, in a function of its own: fsdp_begin runs each step, and a
-- function making a closure is not compiled)
local function tied_reduce_hook(self, st)
  local tg = self.tied_group
  local at = {}   -- unit -> indices of its tied views
  for _, e in ipairs(self.tied) do
    local id = tonumber(rawget(e[1], e[2]).id)
    for _, u in ipairs(st.units) do
      for k, v in ipairs(u.views) do
        if tonumber(v.id) == id then at[u] = at[u] or {}; table.insert(at[u], k) end
      end
    end
  end
  return function(u)
    for _, k in ipairs(at[u] or {}) do dist.all_reduce(u.gviews[k], 'sum', { group = tg }) end
  end
end
function Pipeline:fsdp_begin(opts)
  local st = rawget(self.model, '_fsdp')
  if not st then self.fs = nil; return end
  if self.schedule == 'zbh1' then
    -- (a unit reduces its gradients at the end of its last backward's walk,
    -- before the weight gradients zbh1 leaves for later)
    error('pp: the zbh1 schedule cannot run a stage under fsdp.fully_shard (its units reduce at the end of '
      .. 'each backward, before the weight gradients zbh1 runs later); use 1f1b', 3)
  end
  local fsdp = require 'moonshard.fsdp'
  if self.tied_group and not self.tied_hooked then
    local prev = fsdp.set_before_reduce(self.model, tied_reduce_hook(self, st))
    if prev ~= nil then error('pp: the model\'s fsdp before_reduce hook is taken', 3) end
    self.tied_hooked = true
  end
  self.fs = {
    fsdp = fsdp, nb = 0, total = self.microbatches * self.chunks,
    sync = st.sync, final = st.sync and not (opts and opts.sync == false),
    hold = fsdp.set_hold(self.model, st.strategy == 'SHARD_GRAD_OP'),
  }
end

-- the FSDP settings of before the step back (the units held, resharded)
function Pipeline:fsdp_end()
  local fs = self.fs
  if not fs then return end
  self.fs = nil
  fs.fsdp.set_sync(self.model, fs.sync)
  fs.fsdp.set_hold(self.model, fs.hold)
end

-- the micro-batches' records not yet through their backward, dropped: their
-- tapes cleared, their tensors freed, the sends in flight let go
function Pipeline:drop_live()
  for rec in pairs(self.live) do
    local saved = A.tape
    A.tape = rec.tape
    A.clear_tape()
    A.tape = saved
    if rec.x then rec.x:free() end
    if rec.out then rec.out:free() end
    if rec.w then rec.w:drop(); rec.w = nil end
  end
  self.live = {}
  -- (zbh1, zbv: the weight gradients taken and not yet run; zbv's turn)
  local wq = self.wq
  if wq then
    for k = wq.head, wq.tail do if wq[k] then wq[k].job:drop() end end
    self.wq = nil
  end
  for _, job in pairs(self.wjobs or {}) do job:drop() end
  if self.early then self.early.work:free(); self.early.g:free(); self.early = nil end
  for _, list in ipairs({ self.turn_f or {}, self.turn_b or {} }) do for _, t in pairs(list) do t:free() end end
  self.wjobs, self.turn_f, self.turn_b = nil, nil, nil
  for i, w in ipairs(self.sends) do w:free(); self.sends[i] = nil end
  if self.loss_sum then self.loss_sum:free(); self.loss_sum = nil end
  if self.mtp_sum then self.mtp_sum:free(); self.mtp_sum = nil end
end

function Pipeline:run_schedule(ids, targets)
  local M = self.microbatches
  local queue, head, tail = {}, 1, 0
  if self.schedule == 'interleaved' then
    self:run_interleaved(ids, targets, true)
  elseif self.chunks > 1 then
    self:run_order(order.order(self.schedule, self.n_stages, self.stage, M, self.chunks), ids, targets, true)
  elseif self.schedule == 'gpipe' then
    for i = 1, M do
      local rec = self:forward_one(i, self:recv_forward(true), ids, targets, true)
      self:send_forward(rec)
      queue[i] = rec
    end
    for i = 1, M do
      local gy = self:recv_backward()
      self:send_backward(self:backward_one(queue[i], gy))
      queue[i] = nil
    end
  else
    -- 1F1B (Megatron-LM's order): warm-up forwards, then one forward and one
    -- backward in turn, then the remaining backwards. zbh1 (ZB-H1): the same
    -- order, each backward's weight gradients (the job its stage input took,
    -- rec.w) left until `stage` later backwards have run (the first stage's
    -- at once, the last's S - 1 later; every stage then holds S
    -- micro-batches begun and not through their weight gradients, 1F1B's
    -- peak on the first stage), the rest after the last backward: the input
    -- gradients travel up at the pace of their own passes, and the weight
    -- gradients fill the cool-down's waits
    local zb = self.schedule == 'zbh1'
    local trace = self.trace
    local wq = { head = 1, tail = 0 }
    self.wq = wq
    local function W(limit)
      while wq.tail - wq.head + 1 > limit do
        local job = wq[wq.head]
        wq[wq.head] = nil
        wq.head = wq.head + 1
        if job then job.job:run(); if trace then trace[#trace + 1] = 'W' .. job.i end end
      end
    end
    local function B(rec, gy)
      local gx = self:backward_one(rec, gy)
      if trace then trace[#trace + 1] = 'B' .. rec.i end
      if zb then
        wq.tail = wq.tail + 1
        wq[wq.tail] = rec.w and { job = rec.w, i = rec.i } or false
        rec.w = nil
      end
      return gx
    end
    local function Fw(i, x)
      local rec = self:forward_one(i, x, ids, targets, true)
      if trace then trace[#trace + 1] = 'F' .. i end
      return rec
    end
    local warm = math.min(self.n_stages - self.stage - 1, M)
    local rest = M - warm
    local i = 0
    for _ = 1, warm do
      i = i + 1
      local rec = Fw(i, self:recv_forward(true))
      self:send_forward(rec)
      tail = tail + 1
      queue[tail] = rec
    end
    local x = rest > 0 and self:recv_forward(true) or nil
    for k = 1, rest do
      i = i + 1
      local rec = Fw(i, x)
      tail = tail + 1
      queue[tail] = rec
      local gy = self:send_forward_recv_backward(rec)
      local oldest = queue[head]
      queue[head] = nil
      head = head + 1
      local gx = B(oldest, gy)
      if k == rest then
        x = nil
        self:send_backward(gx)
        if zb then W(self.stage) end
      elseif zb then
        -- (the weight gradients before the wait for the next input)
        self:send_backward(gx)
        W(self.stage)
        x = self:recv_forward(true)
      else
        x = self:send_backward_recv_forward(gx)
      end
    end
    for _ = 1, warm do
      local gy = self:recv_backward()
      local oldest = queue[head]
      queue[head] = nil
      head = head + 1
      self:send_backward(B(oldest, gy))
      if zb then W(self.stage) end
    end
    if zb then W(0) end
    self.wq = nil
  end
end

-- the tied weights' gradients summed between the first and the last stage
function Pipeline:sync_tied()
  if not self.tied_group then return end
  for _, e in ipairs(self.tied) do
    local p = rawget(e[1], e[2])
    if p.grad == nil then p.grad = T.zeros(p.shape, { dtype = p.dtype, device = p.device }) end
    dist.all_reduce(p.grad, 'sum', { group = self.tied_group })
  end
end

-- pipe:evaluate(ids, targets) -> loss: the forward alone (no gradients), the
-- mean of the micro-batches' losses on every stage
function Pipeline:evaluate(ids, targets)
  self:prepare(ids, targets, 'evaluate')
  A.no_grad(function()
    if self.schedule == 'interleaved' then return self:run_interleaved(ids, targets, false) end
    if self.chunks > 1 then
      return self:run_order(order.order(self.schedule, self.n_stages, self.stage, self.microbatches, self.chunks,
        true), ids, targets, false)
    end
    for i = 1, self.microbatches do
      local rec = self:forward_one(i, self:recv_forward(false), ids, targets, false)
      if rec.x then rec.x:free() end
      self:send_forward(rec)
      if not self.last then rec.out:free() end
    end
  end)
  self:finish_sends()
  return self:finish_loss()
end

-- ------------------------------------------------------------ the whole model

local function pipe_of(model, fname)
  local p = pp.of(model)
  if not p then error(('pp.%s: the model is not cut into stages (pp.pipeline)'):format(fname), 3) end
  return p
end

-- clip_grad_norm_'s sorting of one gradient g (parameter name, id) into
-- acc's lists: skipped (a tied copy), an expert's, a tensor-parallel
-- slice's, or counted once. (A function of its own: a closure made at each
-- call, specialised on by a trace, keeps that step's gradients alive;
-- docs/tensors.md.)
local function clip_add(acc, name, id, g)
  if acc.skip[id] then return end
  if acc.ex[id] then acc.experts[#acc.experts + 1] = g
  elseif acc.split_by and acc.split_by.placement(acc.model, name) then acc.split[#acc.split + 1] = g
  else acc.counted[#acc.counted + 1] = g end
end

-- pp.clip_grad_norm_(model, max_norm, opts) -> the whole model's gradient
-- 2-norm before clipping: each stage's sum of squares (a tied weight
-- counted once, on the first stage) all-reduced over the pipeline, the
-- gradients scaled by min(1, max_norm / (norm + 1e-6)) on the device.
-- opts as ms.optim.clip_grad_norm's (tensor = true: no host read; defer =
-- an AdamW). Every stage calls it.
function pp.clip_grad_norm_(model, max_norm, opts)
  local pipe = pipe_of(model, 'clip_grad_norm_')
  if max_norm ~= nil and (type(max_norm) ~= 'number' or max_norm <= 0) then
    error(('pp.clip_grad_norm_: max_norm must be a positive number, got %s'):format(tostring(max_norm)), 2)
  end
  local skip = {}
  if not pipe.first then for _, e in ipairs(pipe.tied) do skip[tonumber(rawget(e[1], e[2]).id)] = true end end
  -- under tensor parallelism (tp.parallelize before the cut) the split
  -- gradients' squares are summed over the TP group first, the replicated
  -- ones counted once
  local tpm = package.loaded['moonshard.tp']
  local split_by = tpm and tpm.is_parallel(model) and tpm or nil
  local grads, counted, split, views = {}, {}, {}, {}
  local st = rawget(model, '_fsdp')
  -- an expert-parallel stage (ep.parallelize after the cut): its experts'
  -- squares summed over the expert group, each expert counted once (under
  -- fully_shard the sum over the stage's data-parallel ranks below does
  -- it: every element of every shard is held by one of them)
  local epi = not st and rawget(model, '_ep_train')
  local experts, ex = {}, {}
  if epi then
    for _, L in ipairs(epi.layers) do
      for _, p in ipairs(L.module.experts:parameters()) do ex[tonumber(p.id)] = true end
    end
  end
  local acc = { skip = skip, ex = ex, experts = experts, split_by = split_by, model = model, split = split,
    counted = counted }
  if st then
    -- under fully_shard: each unit's gradient shard, cut at its
    -- parameters' bounds (the layout's offsets)
    for _, u in ipairs(st.units) do
      if u.fp.shard.grad ~= nil then grads[#grads + 1] = u.fp.shard.grad end
      -- (an expert unit of a tensor-parallel stage, --pp --tp --ep: each
      -- TP rank holds other experts, so its shard is summed over the TP
      -- group as a slice's is, not counted once as a replicated one's)
      if u.experts and split_by and u.fp.shard.grad ~= nil then split[#split + 1] = u.fp.shard.grad end
      for _, pc in ipairs(u.experts and split_by and {} or require('moonshard.fsdp').grad_pieces(u)) do
        views[#views + 1] = pc[2]
        clip_add(acc, u.param_names[pc[1]], tonumber(u.views[pc[1]].id), pc[2])
      end
    end
  else
    for name, p in model:named_parameters() do
      if p.grad ~= nil then
        grads[#grads + 1] = p.grad
        clip_add(acc, name, tonumber(p.id), p.grad)
      end
    end
  end
  local dev = grads[1] and grads[1].device or pipe:device()
  local sq = optim.sum_squares(counted, dev)
  if epi then
    local es = optim.sum_squares(experts, dev)
    if epi.size > 1 then dist.all_reduce(es, 'sum', { group = epi.group }) end
    F.add_(sq, es)
    es:free()
  end
  if split_by then
    local ss = optim.sum_squares(split, dev)
    local g = split_by.group_of(model)
    if st then
      -- the replicated shards once over the TP group (each rank of it holds
      -- the same values), then the FSDP group's shards
      F.mul_(sq, 1 / g:size())
      F.add_(sq, ss)
      if g:size() > 1 then dist.all_reduce(sq, 'sum', { group = g }) end
    else
      if g:size() > 1 then dist.all_reduce(ss, 'sum', { group = g }) end
      F.add_(sq, ss)
    end
    ss:free()
  end
  if st and st.shard_group and st.shard_group:size() > 1 then dist.all_reduce(sq, 'sum', { group = st.shard_group }) end
  for _, v in ipairs(views) do v:free() end
  if pipe.n_stages > 1 then dist.all_reduce(sq, 'sum', { group = pipe.group }) end
  local total_t = F.sqrt(sq)
  sq:free()
  if max_norm == nil or max_norm == math.huge then
    if opts and opts.tensor then return total_t end
    local v = total_t:item()
    total_t:free()
    return v
  end
  return optim.clip_with_norm(grads, total_t, max_norm, opts, 'pp.clip_grad_norm_')
end

-- broadcasts a small header (integers) from `owner` over the pipeline
local function header(pipe, owner, values, n)
  local h = T.zeros({ n }, { dtype = 'i64', device = pipe:device() })
  if values then
    local v = {}
    for k = 1, n do v[k] = values[k] or 0 end
    T.raw_copy_(h, T.tensor(v, { dtype = 'i64' }):to(h.device))
  end
  dist.broadcast(h, pipe.group:ranks()[owner + 1], { group = pipe.group })
  local r = h:to('cpu'):totable()
  h:free()
  return r
end

-- this stage's whole tensors: sd (its state dict: parameters and buffers),
-- mine (name -> parameter) and with an optimizer moments (name -> {
-- exp_avg =, exp_avg_sq =, step = }, nil for a parameter without state):
-- gathered over the TP group and the FSDP group when the stage is split or
-- sharded (a collective over them)
local function stage_tensors(pipe, model, opt)
  local tpm = package.loaded['moonshard.tp']
  local split = tpm and tpm.is_parallel(model)
  local sd, mine, moments = {}, {}, nil
  if rawget(model, '_ep_train') then
    -- an expert-parallel stage (ep.parallelize after the cut): its experts
    -- gathered over the expert group (of its units first, under fully_shard)
    sd, moments = require('moonshard.ep').full_tensors(model, opt)
    return sd, sd, moments
  end
  if rawget(model, '_fsdp') then
    -- the units' f32 master shards (and AdamW moments) gathered
    local state
    if split then
      sd, state = tpm.fsdp_full_tensors(model, opt)
      for name in model:named_parameters() do mine[name] = sd[name] end
    else
      local params
      params, state = require('moonshard.fsdp_checkpoint').gather(model, { optimizer = opt })
      for _, e in ipairs(params) do mine[e.name] = e.tensor end
      -- the buffers (the parameters come from every stage below)
      local pnames = {}
      for _, e in ipairs(pipe.names) do pnames[e[1]] = true end
      for name, t in pairs(model:state_dict()) do if not pnames[name] then sd[name] = t end end
    end
    moments = state
  elseif split then
    sd = tpm.full_state_dict(model)
    for name in model:named_parameters() do mine[name] = sd[name] end
  else
    sd = model:state_dict()
    for name, p in model:named_parameters() do mine[name] = p end
  end
  if opt and not moments then
    moments = {}
    if split then
      -- this stage's moments as whole tensors (gathered over the TP group), by name
      local osd = tpm.full_optimizer_state(model, opt)
      local name_of, k = {}, 0
      local pname = {}
      for name, p in model:named_parameters() do pname[tonumber(p.id)] = name end
      for _, g in ipairs(opt.param_groups) do
        for _, p in ipairs(g.params) do k = k + 1; name_of[k] = pname[tonumber(p.id)] end
      end
      for _, e in ipairs(osd.meta.state or {}) do
        local name = name_of[e.index]
        local ea, eq = osd.tensors[e.index .. '.exp_avg'], osd.tensors[e.index .. '.exp_avg_sq']
        if name and ea and eq then moments[name] = { exp_avg = ea, exp_avg_sq = eq, step = e.step } end
      end
    else
      for name, p in model:named_parameters() do
        local st = opt.state[tonumber(p.id)]
        if st and st.exp_avg then moments[name] = st end
      end
    end
  end
  return sd, mine, moments
end

-- the stage's state dict completed with every stage's parameters, and its
-- persistent buffers replaced by the stages' that hold their layers
local function whole_model(pipe, sd, mine)
  local ranks = pipe.group:ranks()
  local dev = pipe:device()
  local list = {}
  for _, e in ipairs(pipe.names) do list[#list + 1] = { e[1], e[2], mine } end
  for _, e in ipairs(pipe.buffers or {}) do list[#list + 1] = { e[1], e[2], sd } end
  for _, e in ipairs(list) do
    local name, owner, mine = e[1], e[2], e[3]
    if pipe.n_stages > 1 then
      -- the holder's dtype and shape first, then the values
      local t = owner == pipe.stage and mine[name] or nil
      local v
      if t then
        v = { t.dtype_id, t.ndim }
        for d = 1, t.ndim do v[2 + d] = t.shape[d] end
      end
      local h = header(pipe, owner, v, 9)
      if not t then
        local shape = {}
        for d = 1, h[2] do shape[d] = h[2 + d] end
        t = T.empty(shape, { dtype = T.dtype_name(h[1]), device = dev })
      end
      local c = t:is_contiguous() and t or t:contiguous()
      dist.broadcast(c, ranks[owner + 1], { group = pipe.group })
      sd[name] = c
    else
      sd[name] = mine[name]
    end
  end
  return sd
end

-- pp.full_state_dict(model) -> name -> tensor: the whole model's parameters
-- (each broadcast over the pipeline by the stage that holds it) and this
-- stage's buffers, on every stage. Every stage calls it.
function pp.full_state_dict(model)
  local pipe = pipe_of(model, 'full_state_dict')
  return whole_model(pipe, stage_tensors(pipe, model))
end

-- pp.load_full_state_dict(model, sd): this stage's parameters (and buffers)
-- copied from a whole model's state dict (a file every stage reads)
function pp.load_full_state_dict(model, sd)
  pipe_of(model, 'load_full_state_dict')
  if rawget(model, '_fsdp') then
    error('pp.load_full_state_dict: the stage is under fsdp.fully_shard; load the weights between pp.pipeline and '
      .. 'fully_shard (the optimizer\'s moments after it: pp.load_full_optimizer_state)', 2)
  end
  local tpm = package.loaded['moonshard.tp']
  if tpm and tpm.is_parallel(model) then return tpm.load_full_state_dict(model, sd) end   -- (sliced for this rank)
  -- the other stages' tensors are the file's extra keys; this stage's must all be there
  local r = model:load_state_dict(sd, { strict = false })
  if #r.missing > 0 then
    error(('pp.load_full_state_dict: missing from the state dict (%d): %s'):format(#r.missing,
      table.concat(r.missing, ', ')), 2)
  end
  return model
end

-- pp.full_checkpoint(model, opt, hyper) -> model state dict, optimizer
-- state dict: a one-process checkpoint's two parts (the whole model, and
-- ms.optim.AdamW's state over it with `hyper`'s { lr, betas, eps,
-- weight_decay }), on every stage. Every stage calls it.
function pp.full_checkpoint(model, opt, hyper)
  local pipe = pipe_of(model, 'full_checkpoint')
  if not opt then return pp.full_state_dict(model), nil end
  local sd, own, mine = stage_tensors(pipe, model, opt)
  local msd = whole_model(pipe, sd, own)
  local by = {}
  for _, e in ipairs(pipe.names) do
    local name, owner = e[1], e[2]
    local st = mine[name]
    if pipe.n_stages == 1 then
      by[name] = st
    else
      local own = owner == pipe.stage
      local h = header(pipe, owner, own and (st and { 1, st.step, st.exp_avg.dtype_id } or { 0 }) or nil, 3)
      if h[1] == 1 then
        local ea = own and st.exp_avg:contiguous() or T.empty(msd[name].shape, { dtype = T.dtype_name(h[3]),
          device = pipe:device() })
        local eq = own and st.exp_avg_sq:contiguous() or T.empty(msd[name].shape, { dtype = T.dtype_name(h[3]),
          device = pipe:device() })
        dist.broadcast(ea, pipe.group:ranks()[owner + 1], { group = pipe.group })
        dist.broadcast(eq, pipe.group:ranks()[owner + 1], { group = pipe.group })
        by[name] = { exp_avg = ea, exp_avg_sq = eq, step = h[2] }
      end
    end
  end
  return msd, optim.one_process_state(pipe.full_groups, by, hyper or {})
end

-- pp.load_full_optimizer_state(model, opt, sd): a one-process optimizer
-- state dict (ms.optim.AdamW over the whole model, as full_checkpoint and a
-- one-process run write it) loaded into `opt` over this stage's parameters
function pp.load_full_optimizer_state(model, opt, sd)
  local pipe = pipe_of(model, 'load_full_optimizer_state')
  local name_of, group_of, i = {}, {}, 0
  for gi, g in ipairs(pipe.full_groups) do
    for _, n in ipairs(g.names) do i = i + 1; name_of[i] = n; group_of[n] = gi end
  end
  local pid, here = {}, {}
  for name, p in model:named_parameters() do pid[tonumber(p.id)] = name; here[name] = true end
  local tpm = package.loaded['moonshard.tp']
  local split = tpm and tpm.is_parallel(model)
  -- the saved state's entries, each with its parameter's name
  local saved = {}
  for _, e in ipairs(sd.meta and sd.meta.state or {}) do
    local name = name_of[e.index]
    if name == nil then
      error(('pp.load_full_optimizer_state: state for parameter %s, which the model does not have'):format(
        tostring(e.index)), 2)
    end
    saved[#saved + 1] = { e, name }
  end
  if rawget(model, '_fsdp') then
    -- fsdp.AdamW: each piece of a unit's shard takes its elements' moments
    local by_name = {}
    for _, se in ipairs(saved) do
      local e, name = se[1], se[2]
      local ea, eq = sd.tensors[e.index .. '.exp_avg'], sd.tensors[e.index .. '.exp_avg_sq']
      if here[name] and ea and eq then by_name[name] = { exp_avg = ea, exp_avg_sq = eq, step = e.step } end
    end
    local fck = require 'moonshard.fsdp_checkpoint'
    fck.load_moments(model, opt, by_name, fck.tag_groups(pipe.full_groups, sd.meta and sd.meta.groups),
      split and function(name, t) return tpm.local_piece(model, name, t) end or nil)
    return opt
  end
  local idx, meta, k = {}, { type = sd.meta and sd.meta.type, groups = {}, state = {} }, 0
  for gi, g in ipairs(opt.param_groups) do
    local mg = { params = {} }
    for j, p in ipairs(g.params) do
      k = k + 1
      mg.params[j] = k
      local name = pid[tonumber(p.id)]
      if name == nil then error('pp.load_full_optimizer_state: the optimizer holds a tensor that is not a parameter of the model', 2) end
      idx[name] = k
      -- the hyper-parameters of the whole model's group this parameter was in
      local sg = sd.meta and sd.meta.groups and sd.meta.groups[group_of[name]]
      if sg and j == 1 then for key, v in pairs(sg) do if key ~= 'params' and key ~= 'names' then mg[key] = v end end end
    end
    meta.groups[gi] = mg
  end
  local tensors = {}
  for _, se in ipairs(saved) do
    local e, name = se[1], se[2]
    local j = idx[name]
    if j then
      local st = { index = j }
      for key, v in pairs(e) do if key ~= 'index' then st[key] = v end end
      meta.state[#meta.state + 1] = st
      for _, f in ipairs({ 'exp_avg', 'exp_avg_sq' }) do
        local t = sd.tensors[e.index .. '.' .. f]
        if t then tensors[j .. '.' .. f] = t end
      end
    end
  end
  if split then
    tpm.load_full_optimizer_state(model, opt, { tensors = tensors, meta = meta })   -- (sliced for this rank)
  else
    opt:load_state_dict({ tensors = tensors, meta = meta })
  end
  return opt
end

-- pipe:free(): the pipeline's group for the tied weights
function Pipeline:free()
  if self.tied_group then self.tied_group:free(); self.tied_group = nil end
  if self.chunks == 1 and self.overlap and self.bwd_group then self.bwd_group:free(); self.bwd_group = nil end
  for _, kind in pairs(self.zgroups or {}) do
    for c, g in pairs(kind) do g:free(); kind[c] = nil end
  end
  for _, list in ipairs({ self.fwd_groups or {}, self.bwd_groups or {} }) do
    for c, g in pairs(list) do g:free(); list[c] = nil end
  end
end

return pp
