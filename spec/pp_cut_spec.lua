-- The default cut of a pipeline's blocks (ms.pp): pp.rank_balanced against
-- every cut of small cases (its most loaded rank as light as any cut's,
-- the ranks' work as even as any cut's, each rank's virtual stages as
-- even as its blocks allow); with one chunk a rank the same most loaded
-- rank as pp.balanced (or a lighter one, the head alone on the last); the simulator's per-virtual-stage costs (a one
-- micro-batch 1F1B against its critical path); pp.default_cut never
-- simulates slower than pp.balanced's cut, and on the 1.25B Llama of
-- bench/fsdp.lua under zbv and the interleaved 1F1B it is faster.
local pp = require('moonshard').pp
local O = pp.order

-- every cut of n blocks into V virtual stages, stage k holding at least lo[k]
local function cuts(n, V, lo, f, c)
  c = c or {}
  local k = #c + 1
  if k == V then
    if n >= lo[k] then c[k] = n; f(c); c[k] = nil end
    return
  end
  for m = lo[k], n do
    c[k] = m
    cuts(n - m, V, lo, f, c)
  end
  c[k] = nil
end

-- the works of a cut: per rank (sorted, most loaded first) and per virtual stage
local function works(cut, S, layout, last, first)
  local V, rank, stage = #cut, {}, {}
  for r = 1, S do rank[r] = 0 end
  for k = 1, V do
    stage[k] = cut[k] + (k == V and last or 0) + (k == 1 and first or 0)
    local r = O.rank_of(layout, S, k - 1) + 1
    rank[r] = rank[r] + stage[k]
  end
  local sorted = {}
  for r = 1, S do sorted[r] = rank[r] end
  table.sort(sorted, function(a, b) return a > b end)
  return sorted, stage, rank
end

-- a before b in the leximin order (the most loaded first), to 1e-9
local function lex_less(a, b)
  for i = 1, #a do
    if math.abs(a[i] - b[i]) > 1e-9 then return a[i] < b[i] end
  end
  return false
end

describe('the pipeline\'s default cut', function()
  local cases = {   -- blocks, stages, chunks, layout, head, embedding
    { 9, 3, 1, 'ring', 0, 0 }, { 10, 4, 1, 'ring', 2.5, 0 }, { 7, 2, 1, 'ring', 0.7, 0 },
    { 12, 3, 2, 'ring', 1.5, 0 }, { 16, 4, 2, 'ring', 4.08, 0 }, { 9, 2, 3, 'ring', 0.3, 0.2 },
    { 16, 4, 2, 'v', 4.08, 0 }, { 12, 3, 2, 'v', 0, 0 }, { 11, 3, 2, 'v', 2.2, 0.5 }, { 6, 2, 2, 'v', 1, 0 },
    { 10, 3, 2, 'v', 0.4, 1.2 }, { 13, 2, 2, 'v', 7.3, 0.1 }, { 3, 2, 2, 'v', 0, 0 }, { 5, 2, 3, 'ring', 0.5, 0 },
  }

  it('pp.rank_balanced: against every cut, the most loaded rank, the ranks\' work and each rank\'s stages', function()
    for _, cs in ipairs(cases) do
      local L, S, v, layout, last, first = cs[1], cs[2], cs[3], cs[4], cs[5], cs[6]
      local V = S * v
      local what = ('%d blocks, %d stages x %d chunks (%s), head %g, embedding %g'):format(L, S, v, layout, last, first)
      -- random holds: the tie-breaks must not cost balance
      local hold = {}
      for k = 1, V do hold[k] = math.random(1, 8) end
      local got = pp.rank_balanced(L, S, { chunks = v, layout = layout, last_cost = last, first_cost = first,
        hold = hold })
      assert.are.equal(V, #got, what)
      local sum = 0
      for _, m in ipairs(got) do sum = sum + m end
      assert.are.equal(L, sum, what)
      -- the lower bounds: a block a virtual stage when there are enough,
      -- none needed where the fixed work is a block's
      local lo, need = {}, 0
      for k = 1, V do
        local fixed = (k == V and last or 0) + (k == 1 and first or 0)
        lo[k] = fixed < 1 and 1 or 0
        need = need + lo[k]
      end
      if L < need then for k = 1, V do lo[k] = 0 end end
      for k = 1, V do assert.is_true(got[k] >= lo[k], what .. ': stage ' .. k) end
      local g_sorted, g_stage, g_rank = works(got, S, layout, last, first)
      local best, n = nil, 0
      cuts(L, V, lo, function(c)
        n = n + 1
        local s = works(c, S, layout, last, first)
        if best == nil or lex_less(s, best) then best = { unpack(s) } end
      end)
      assert.is_true(n > 1, what)
      -- the most loaded rank, then the next, ... as light as any cut's
      for i = 1, S do
        assert.is_true(math.abs(g_sorted[i] - best[i]) <= 1e-9,
          ('%s: rank work %d: %g, every cut\'s best %g'):format(what, i, g_sorted[i], best[i]))
      end
      -- within each rank, no block moved between its stages makes its
      -- heaviest stage lighter
      for r = 0, S - 1 do
        local ks = {}
        for k = 1, V do if O.rank_of(layout, S, k - 1) == r then ks[#ks + 1] = k end end
        local heavy, blocks, lo_r = -math.huge, 0, {}
        for i, k in ipairs(ks) do
          heavy, blocks, lo_r[i] = math.max(heavy, g_stage[k]), blocks + got[k], lo[k]
        end
        cuts(blocks, #ks, lo_r, function(c)
          local h = -math.huge
          for i, k in ipairs(ks) do h = math.max(h, g_stage[k] - got[k] + c[i]) end
          assert.is_true(h >= heavy - 1e-9, ('%s: rank %d\'s stages could be %g at most, not %g'):format(what, r, h, heavy))
        end)
      end
    end
  end)

  it('with one chunk a rank its most loaded stage is pp.balanced\'s (no heavier with a head of a block or more)', function()
    for S = 2, 6 do
      for L = S, 3 * S + 2 do
        for _, last in ipairs({ 0, 0.4, 1, 2.7, 5.8 }) do
          local a = works(pp.balanced(L, S, last), S, 'ring', last, 0)
          local b = works(pp.rank_balanced(L, S, { last_cost = last, hold = O.holds('1f1b', S, 2 * S) }), S, 'ring',
            last, 0)
          -- (the same when every stage needs a block; a head of a block's
          -- work or more may stand alone, which pp.balanced never lets it)
          local what = ('%d blocks, %d stages, head %g: %g against %g'):format(L, S, last, b[1], a[1])
          if last < 1 then assert.is_true(math.abs(a[1] - b[1]) <= 1e-9, what)
          else assert.is_true(b[1] <= a[1] + 1e-9, what) end
        end
      end
    end
    -- and pp.default_cut is pp.balanced there
    assert.are.same(pp.balanced(16, 4, 4.08), pp.default_cut(16, 4, 1, '1f1b', 8, 4.08))
  end)

  it('holds: 1F1B\'s stage s min(S - s, M) micro-batches; zbv\'s chunk 1 on rank 0 the most', function()
    for S = 2, 5 do
      for _, M in ipairs({ 1, S - 1, 2 * S }) do
        if M >= 1 then
          local h = O.holds('1f1b', S, M)
          for s = 0, S - 1 do assert.are.equal(math.min(S - s, M), h[s + 1]) end
        end
      end
      local h = O.holds('zbv', S, 2 * S)
      for k = 2, 2 * S do assert.is_true(h[1] >= h[k], ('zbv, %d stages: stage %d'):format(S, k - 1)) end
    end
  end)

  it('the simulator\'s costs a virtual stage: one micro-batch through 1F1B is its critical path', function()
    for S = 2, 6 do
      local cost, sum = {}, 0
      for k = 1, S do cost[k] = 0.25 + math.random(); sum = sum + cost[k] end
      local f, b, w = 1 + math.random(), 1 + math.random(), 0.5 + math.random()
      local r = O.simulate('1f1b', S, 1, { cost = cost, f = f, b = b, w = w })
      -- every forward, then the backwards down the stages, each stage's W
      -- after its B: the last to end is some stage's W
      local want, back = 0, 0
      for k = S, 1, -1 do
        back = back + cost[k] * b
        want = math.max(want, sum * f + back + cost[k] * w)
      end
      assert.is_true(math.abs(r.makespan - want) <= 1e-9 * want, ('%d stages: %g against %g'):format(S, r.makespan, want))
      assert.is_true(math.abs(r.bubble - (1 - sum * (f + b + w) / (S * r.makespan))) <= 1e-12)
      -- a uniform cut's costs are the default's
      local u = O.stage_costs({ 3, 3, 3, 3 }, 2, 0)
      local a, d = O.simulate('interleaved', 2, 4, { chunks = 2, cost = u }), O.simulate('interleaved', 2, 4, { chunks = 2 })
      assert.is_true(math.abs(a.makespan - d.makespan) <= 1e-12 and math.abs(a.bubble - d.bubble) <= 1e-12)
    end
    assert.has_error(function() O.simulate('zbv', 2, 4, { cost = { 1, 1, 1 } }) end,
      'pp_order: cost lists 3 virtual stages, zbv over 2 stages has 4')
  end)

  it('pp.default_cut never simulates slower than pp.balanced\'s cut', function()
    local n, faster = 0, 0
    for _, sc in ipairs({ { 'zbv', 2 }, { 'interleaved', 2 }, { 'interleaved', 3 }, { 'looped_bfs', 2 } }) do
      local name, v = sc[1], sc[2]
      for S = 2, 5 do
        local lo, mult = O.microbatch_rule(name, S)
        for _, M in ipairs({ lo, 2 * S }) do
          if M % mult == 0 then
            for _, L in ipairs({ S * v, 2 * S * v - 1, 16 }) do
              for _, last in ipairs({ 0, 0.3, 2.5, 4.08 }) do
                if L >= S * v then
                  local function time(cut)
                    return O.simulate(name, S, M, { chunks = v, cost = O.stage_costs(cut, S, last) }).makespan
                  end
                  local a, b = time(pp.balanced(L, S * v, last)), time(pp.default_cut(L, S, v, name, M, last))
                  assert.is_true(b <= a + 1e-9, ('%s, %d stages, %d micro-batches, %d blocks, head %g: %g against %g'):format(
                    name, S, M, L, last, b, a))
                  n = n + 1
                  if b < a - 1e-9 then faster = faster + 1 end
                end
              end
            end
          end
        end
      end
    end
    assert.is_true(n > 100 and faster > n / 4, ('%d of %d faster'):format(faster, n))
  end)

  it('the 1.25B Llama (16 blocks, a 128256 x 2048 head) on 4 stages, 8 micro-batches: zbv and interleaved faster', function()
    -- a block: q, o 2048^2, k, v 2048 x 512, the MLP 3 x 2048 x 5632, two norms
    local block = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632 + 2 * 2048
    local head = pp.head_weight * 128256 * 2048 / block
    for _, name in ipairs({ 'zbv', 'interleaved' }) do
      local old, new = pp.balanced(16, 8, head), pp.default_cut(16, 4, 2, name, 8, head)
      local a = O.simulate(name, 4, 8, { chunks = 2, cost = O.stage_costs(old, 4, head) })
      local b = O.simulate(name, 4, 8, { chunks = 2, cost = O.stage_costs(new, 4, head) })
      assert.is_true(b.makespan < 0.9 * a.makespan, ('%s: {%s} %g against {%s} %g'):format(name, table.concat(new, ','),
        b.makespan, table.concat(old, ','), a.makespan))
    end
  end)
end)
