-- The pipeline schedules' per-rank orders (moonshard.pp_order) and their
-- simulation with fixed costs: every forward, backward and weight-gradient
-- pass of every (micro-batch, chunk) once, the dependencies met in some
-- run of the ranks (no deadlock), the exchanges between two ranks taken in
-- the order they are sent; the simulator finds a deadlock, a missing op
-- and a crossed exchange in orders made wrong on purpose; ZBV's makespan
-- with unit costs below 1F1B's and ZB-H1's at 2S micro-batches, its
-- activations held at 1F1B's peak; the bubbles docs/pp.md lists.
local O = require 'moonshard.pp_order'

describe('pipeline schedule orders', function()
  local scheds = { { '1f1b' }, { 'zbh1' }, { 'gpipe' }, { 'interleaved', chunks = 2 }, { 'interleaved', chunks = 4 },
    { 'looped_bfs', chunks = 2 }, { 'looped_bfs', chunks = 3 }, { 'zbv' } }

  it('every schedule runs every op once, deadlock-free, its exchanges in order, for 2-8 stages and any allowed micro-batch count', function()
    local n = 0
    for S = 2, 8 do
      for _, sc in ipairs(scheds) do
        local lo, mult = O.microbatch_rule(sc[1], S)
        for M = lo, 3 * S + 1 do
          if M % mult == 0 then
            local r = O.simulate(sc[1], S, M, { chunks = sc.chunks })
            assert.is_true(r.makespan > 0)
            -- and the evaluation's forwards alone
            O.simulate(sc[1], S, M, { chunks = sc.chunks, forward_only = true })
            n = n + 1
          end
        end
      end
    end
    assert.is_true(n > 300)
  end)

  it('zbv: every rank holds virtual stages s and 2S - 1 - s; the first and the last on rank 0', function()
    for S = 2, 6 do
      local seen = {}
      for s = 0, S - 1 do
        for c = 1, 2 do
          local k = O.vstage('v', S, s, c)
          assert.is_nil(seen[k])
          seen[k] = true
          local r, cc = O.rank_of('v', S, k)
          assert.are.same({ s, c }, { r, cc })
        end
      end
      assert.are.equal(0, (O.rank_of('v', S, 0)))
      assert.are.equal(0, (O.rank_of('v', S, 2 * S - 1)))
      assert.are.equal(S - 1, (O.rank_of('v', S, S - 1)))
      assert.are.equal(S - 1, (O.rank_of('v', S, S)))
    end
  end)

  it('zbv\'s makespan (F = B = W a stage) is below 1F1B\'s and ZB-H1\'s at 2S micro-batches, at 1F1B\'s peak activations', function()
    for S = 2, 8 do
      local M = 2 * S
      local z = O.simulate('zbv', S, M)
      local f = O.simulate('1f1b', S, M)
      local ff = O.simulate('1f1b', S, M, { fused = true })
      local h = O.simulate('zbh1', S, M)
      assert.is_true(z.makespan < h.makespan, ('S = %d: zbv %g against zbh1 %g'):format(S, z.makespan, h.makespan))
      assert.is_true(h.makespan < f.makespan)
      assert.is_true(f.makespan < ff.makespan)
      -- 1F1B (the weight gradients in the backward): 3 (M + S - 1)
      assert.are.equal(3 * (M + S - 1), ff.makespan)
      -- ZB-H1: (S - 1)(F + B - W) over the 3M of work
      assert.are.equal(3 * M + (S - 1), h.makespan)
      -- zbv: only the start, rank s's first forward s half-slots late
      assert.are.equal(3 * M + (S - 1) / 2, z.makespan)
      for s = 1, S do
        assert.is_true(z.peak[s] <= S, ('S = %d rank %d: %g stages of activations'):format(S, s - 1, z.peak[s]))
      end
      assert.are.equal(S, z.peak[1])
      assert.are.equal(S, f.peak[1])
    end
    -- with the weight gradients dearer than the forwards the same order still beats 1F1B
    for S = 2, 6 do
      local c = { f = 1, b = 1.2, w = 0.8 }
      assert.is_true(O.simulate('zbv', S, 2 * S, c).makespan < O.simulate('1f1b', S, 2 * S, c).makespan)
    end
  end)

  it('the bubbles docs/pp.md lists (4 stages, 8 micro-batches, F = B = W)', function()
    local function b(name, opts) return math.floor(O.simulate(name, 4, 8, opts).bubble * 1000 + 0.5) / 1000 end
    assert.are.equal(0.273, b('1f1b', { fused = true }))
    assert.are.equal(0.2, b('1f1b'))
    assert.are.equal(0.111, b('zbh1'))
    assert.are.equal(0.111, b('interleaved', { chunks = 2 }))
    assert.are.equal(0.111, b('looped_bfs', { chunks = 2 }))
    assert.are.equal(0.2, b('gpipe'))
    assert.are.equal(0.059, b('zbv'))
  end)

  it('the simulator finds a deadlock, a missing or repeated op and a crossed exchange', function()
    local S, M = 3, 6
    local function orders()
      local r = {}
      for s = 0, S - 1 do r[s + 1] = O.order('zbv', S, s, M) end
      return r
    end
    -- rank 1 runs its first chunk-2 backward before that micro-batch's chunk-2 forward
    local o = orders()
    local ord = o[2]
    local fi, bi
    for n, op in ipairs(ord) do
      if op[1] == 'F' and op[2] == 1 and op[3] == 2 then fi = n end
      if op[1] == 'B' and op[2] == 1 and op[3] == 2 then bi = n end
    end
    ord[fi], ord[bi] = ord[bi], ord[fi]
    assert.has_error(function() O.simulate('zbv', S, M, { orders = o }) end,
      'pp_order: zbv deadlocks: rank 0 at F of micro-batch 1, chunk 2; rank 1 at B of micro-batch 1, chunk 2; '
        .. 'rank 2 at B of micro-batch 1, chunk 2')
    -- a W dropped, then a W run twice
    o = orders()
    for n, op in ipairs(o[3]) do if op[1] == 'W' then table.remove(o[3], n); break end end
    assert.has_error(function() O.simulate('zbv', S, M, { orders = o }) end,
      'pp_order: rank 2 never runs W of micro-batch 1, chunk 2')
    o = orders()
    table.insert(o[1], { 'W', 2, 1 })
    assert.has_error(function() O.simulate('zbv', S, M, { orders = o }) end,
      'pp_order: rank 0 runs W of micro-batch 2, chunk 1 twice')
    -- rank 1 takes chunk 1's forwards 2 and 3 the other way round: no
    -- deadlock, but its receives would take micro-batch 3's activation as 2's
    o = orders()
    local a, c
    for n, op in ipairs(o[2]) do
      if op[1] == 'F' and op[3] == 1 and op[2] == 2 then a = n end
      if op[1] == 'F' and op[3] == 1 and op[2] == 3 then c = n end
    end
    o[2][a], o[2][c] = o[2][c], o[2][a]
    assert.has_error(function() O.simulate('zbv', S, M, { orders = o }) end,
      'pp_order: zbv: exchange 2 on 0>1:F: sent 2/0, received as 3/0 (micro-batch/virtual stage)')
  end)

  it('micro-batch counts a schedule cannot run are errors that name them', function()
    assert.has_error(function() O.order('zbv', 4, 0, 6) end,
      'pp_order: zbv over 4 stages cannot run 6 micro-batches (at least 7)')
    assert.has_error(function() O.order('interleaved', 4, 0, 6, 2) end,
      'pp_order: interleaved over 4 stages cannot run 6 micro-batches (at least 4, a multiple of 4)')
    assert.has_error(function() O.order('nope', 2, 0, 4) end, 'pp_order: no schedule nope')
  end)

  it('draws an order as a table', function()
    assert.are.equal('| rank | order |\n| --- | --- |\n'
      .. "| 0 | F1 F2 F3 F1' B1' W1' F2' B2' W2' B1 W1 F3' B3' W3' B2 W2 B3 W3 |\n"
      .. "| 1 | F1 F1' F2 F2' B1' W1' F3 B1 W1 F3' B2' W2' B2 B3' B3 W2 W3' W3 |", O.table('zbv', 2, 3))
  end)
end)
