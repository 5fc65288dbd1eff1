-- The pipeline schedules' per-rank orders (moonshard.pp_order) and their
-- simulation with fixed costs: every forward, backward and weight-gradient
-- pass of every (micro-batch, chunk) once, the dependencies met in some
-- run of the ranks (no deadlock), the exchanges between two ranks taken in
-- the order they are sent; the simulator finds a deadlock, a missing op
-- and a crossed exchange in orders made wrong on purpose; ZBV's makespan
-- with unit costs below 1F1B's and ZB-H1's at 2S micro-batches, its
-- activations held at 1F1B's peak; DualPipeV's phases, its 2S + 1 chunks
-- open, its makespans (in turn: ZB-V's; overlapped: DeepSeek's bubble) and
-- the all-to-all its pairs hide; the bubbles docs/pp.md lists.
local O = require 'moonshard.pp_order'

describe('pipeline schedule orders', function()
  local scheds = { { '1f1b' }, { 'zbh1' }, { 'gpipe' }, { 'interleaved', chunks = 2 }, { 'interleaved', chunks = 4 },
    { 'looped_bfs', chunks = 2 }, { 'looped_bfs', chunks = 3 }, { 'zbv' }, { 'dualpipev' },
    { 'dualpipev', overlap = true } }

  it('every schedule runs every op once, deadlock-free, its exchanges in order, for 2-8 stages and any allowed micro-batch count', function()
    local n = 0
    for S = 2, 8 do
      for _, sc in ipairs(scheds) do
        local lo, mult = O.microbatch_rule(sc[1], S)
        for M = lo, 3 * S + 1 do
          if M % mult == 0 then
            local r = O.simulate(sc[1], S, M, { chunks = sc.chunks, overlap = sc.overlap })
            assert.is_true(r.makespan > 0)
            -- and the evaluation's forwards alone
            O.simulate(sc[1], S, M, { chunks = sc.chunks, forward_only = true })
            n = n + 1
          end
        end
      end
    end
    assert.is_true(n > 400)
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

  it('dualpipev: DualPipeV\'s phases on every rank (counts as functions of S, s, M), each pair a forward and the other chunk\'s backward', function()
    for S = 2, 8 do
      for M = 2 * S, 2 * S + 7 do
        for s = 0, S - 1 do
          local ops = O.order('dualpipev', S, s, M)
          local what = ('S = %d, s = %d, M = %d'):format(S, s, M)
          -- each chunk's forwards, backwards and W in the micro-batches' order
          local n = { F = { 0, 0 }, B = { 0, 0 }, W = { 0, 0 } }
          for _, op in ipairs(ops) do
            n[op[1]][op[3]] = n[op[1]][op[3]] + 1
            assert.are.equal(n[op[1]][op[3]], op[2], what)
          end
          for _, k in ipairs({ 'F', 'B', 'W' }) do assert.are.same({ M, M }, n[k], what) end
          -- the warm-up: 2(S - 1 - s) + 1 forwards of chunk 1 before chunk 2's
          -- first, 2S forwards before the first backward (the last rank's
          -- first F1 of step 4 too), s + 1 of them chunk 2's
          local f1, first_b, f2 = 0, nil, 0
          for k, op in ipairs(ops) do
            if op[1] == 'B' then first_b = k; break end
            if op[3] == 2 then f2 = f2 + 1 elseif f2 == 0 then f1 = f1 + 1 end
          end
          assert.are.equal(2 * (S - 1 - s) + 1, f1, what)
          assert.are.equal(2 * S + 1 + (s == S - 1 and 1 or 0), first_b, what)
          assert.are.equal(s + 1, f2, what)
          -- the overlapped pairs: M - 2S + s + 1 of (F1, B2) but the last
          -- rank's first, M - S of (F2, B1); each a forward, then a backward
          -- of the other chunk and its W
          local pairs_ = { 0, 0 }
          for k, op in ipairs(ops) do
            if op.overlap then
              local b, w = ops[k + 1], ops[k + 2]
              assert.are.equal('F', op[1], what)
              assert.are.same({ 'B', 'W', 3 - op[3], 3 - op[3], b[2] }, { b[1], w[1], b[3], w[3], w[2] }, what)
              pairs_[op[3]] = pairs_[op[3]] + 1
            end
          end
          assert.are.same({ M - 2 * S + s + 1 - (s == S - 1 and 1 or 0), M - S }, pairs_, what)
          -- the cool-down: the last s + 1 ops are the W's left over
          for k = #ops - s, #ops do assert.are.equal('W', ops[k][1], what) end
        end
      end
    end
  end)

  it('dualpipev: 2S + 1 chunks open on every rank (S + 1/2 stages, zbv\'s S plus a chunk); zbv\'s step with the pairs in turn, DeepSeek\'s bubble (S - 1)(F&B + B - 3W) with them overlapped', function()
    for S = 2, 8 do
      for _, M in ipairs({ 2 * S, 2 * S + 1, 3 * S, 4 * S }) do
        local d = O.simulate('dualpipev', S, M)
        local z = O.simulate('zbv', S, M)
        local dv = O.simulate('dualpipev', S, M, { overlap = true })
        for s = 1, S do
          assert.are.equal(S + 0.5, d.peak[s])
          assert.are.equal(S + 0.5, dv.peak[s])
          assert.are.equal(z.peak[1] + 0.5, d.peak[s])
        end
        for k, h in ipairs(O.holds('dualpipev', S, M)) do
          -- (per virtual stage: the first chunk's warm-up holds 2S - k of
          -- its micro-batches' activations, plus the pair's forward)
          assert.is_true(h >= 1 and h <= 2 * S, ('S = %d, M = %d, virtual stage %d holds %d'):format(S, M, k - 1, h))
        end
        -- F = B = W (a chunk's: 1/2 each): in turn, ZB-V's makespan
        assert.are.equal(3 * M + (S - 1) / 2, d.makespan)
        assert.are.equal(z.makespan, d.makespan)
        -- overlapped (no communication to hide): a pair waits for both
        -- inputs; the idle time per rank is DualPipe's (PP/2 - 1)(F&B + B -
        -- 3W) with PP = 2S chunks, F&B = F + B + W, B the full backward:
        -- (S - 1)(1.5 + 1 - 1.5) = S - 1
        local F, B, Wc = 0.5, 1, 0.5
        assert.are.equal(3 * M + (S - 1) * ((F + B) + B - 3 * Wc), dv.makespan)
      end
    end
    -- MoE-like (an all-to-all of a forward's time inside each F and B):
    -- the overlapped pairs hide it, DualPipeV's point
    for S = 2, 6 do
      for _, M in ipairs({ 2 * S, 4 * S }) do
        local c = { comm_f = 1, comm_b = 1 }
        local dv = O.simulate('dualpipev', S, M, { comm_f = 1, comm_b = 1, overlap = true })
        local z = O.simulate('zbv', S, M, c)
        local d = O.simulate('dualpipev', S, M, c)
        assert.is_true(dv.makespan < z.makespan, ('S = %d M = %d: %g against zbv %g'):format(S, M, dv.makespan, z.makespan))
        assert.is_true(dv.makespan < d.makespan)
        assert.is_true(z.makespan < O.simulate('1f1b', S, M, c).makespan)
      end
    end
    -- a pair spoilt (its backward moved away) is an error under overlap
    local o = {}
    for s = 0, 2 do o[s + 1] = O.order('dualpipev', 3, s, 6) end
    local f
    for k, op in ipairs(o[1]) do
      if op.overlap then
        f = op
        local w = table.remove(o[1], k + 2)
        table.insert(o[1], w)
        break
      end
    end
    assert.has_error(function() O.simulate('dualpipev', 3, 6, { orders = o, overlap = true }) end,
      ('pp_order: rank 0 pairs the forward of micro-batch %d, chunk %d with no backward and its W after it'):format(f[2],
        f[3]))
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
    assert.are.equal(0.059, b('dualpipev'))
    assert.are.equal(0.111, b('dualpipev', { overlap = true }))
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
    assert.has_error(function() O.order('dualpipev', 4, 0, 7) end,
      'pp_order: dualpipev over 4 stages cannot run 7 micro-batches (at least 8)')
    assert.has_error(function() O.order('nope', 2, 0, 4) end, 'pp_order: no schedule nope')
  end)

  it('draws an order as a table', function()
    assert.are.equal('| rank | order |\n| --- | --- |\n'
      .. "| 0 | F1 F2 F3 F1' B1' W1' F2' B2' W2' B1 W1 F3' B3' W3' B2 W2 B3 W3 |\n"
      .. "| 1 | F1 F1' F2 F2' B1' W1' F3 B1 W1 F3' B2' W2' B2 B3' B3 W2 W3' W3 |", O.table('zbv', 2, 3))
    -- dualpipev (DualPipeV's phases, S = 2, M = 4; the pairs F4 B2' W2', ...)
    assert.are.equal('| rank | order |\n| --- | --- |\n'
      .. "| 0 | F1 F2 F3 F1' B1' W1' F2' F4 B2' W2' F3' B1 W1 B3' W3' F4' B2 W2 B4' W4' B3 W3 B4 W4 |\n"
      .. "| 1 | F1 F1' F2 F2' F3 B1' W1' F3' B1 W1 F4 B2' W2' F4' B2 W2 B3' W3' B3 W3 B4' B4 W4' W4 |",
      O.table('dualpipev', 2, 4))
  end)
end)
