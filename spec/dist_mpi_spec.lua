-- Collectives over MPI on CPU tensors, run by every rank under mpirun
-- (tools/run_mpi_specs.sh runs this file with 1, 2, 3 and 4 ranks). Every
-- rank computes what every other rank holds from the same formula (or the
-- same seeds), so each checks its result against values it computed alone.
-- Sizes are odd (1, 7, 1001 elements per rank) so that nothing divides
-- evenly into vector widths, cache lines or the world size.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local S = require 'spec.support'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

local dtypes = { 'f32', 'bf16', 'f64', 'i64' }
local sizes = { 1, 7, 1001 }
local ops = { 'sum', 'avg', 'max', 'min' }

-- rank r's i-th value (i 0-based): small integers and halves, exact in every
-- dtype, and sums of four of them too
local val = S.collective_val

local function fill(n, dtype, f)
  local v = {}
  for i = 0, n - 1 do v[i + 1] = f(i) end
  return ms.tensor(v, { dtype = dtype })
end

local reduce = S.reduce_expect   -- i64 avg: C truncation, as NCCL

-- the value as the dtype stores it (bf16 rounds to nearest even)
local function as_dtype(v, dtype)
  if dtype == 'bf16' then return ms.tensor({ v }, { dtype = 'f32' }):bf16():float():item() end
  if dtype == 'f32' then return ms.tensor({ v }, { dtype = 'f32' }):item() end
  return v
end

local function assert_values(t, expect, what)
  local got = t:to('f64'):totable()
  assert.are.equal(#expect, #got, what .. ': length')
  for i = 1, #expect do
    if got[i] ~= expect[i] then
      error(('%s: element %d is %s, expected %s'):format(what, i, tostring(got[i]), tostring(expect[i])), 2)
    end
  end
end

describe('dist over MPI #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end

  local R, W
  setup(function()
    dist.init { backend = 'mpi', timeout = 60 }
    R, W = dist.rank(), dist.world_size()
  end)
  teardown(function() dist.destroy() end)

  it('knows its rank from the Open MPI environment', function()
    assert.is_true(dist.is_initialized())
    assert.are.equal(dist, ms.dist)
    assert.are.equal(tonumber(os.getenv('OMPI_COMM_WORLD_RANK')), R)
    assert.are.equal(tonumber(os.getenv('OMPI_COMM_WORLD_SIZE')), W)
    assert.are.equal(tonumber(os.getenv('OMPI_COMM_WORLD_LOCAL_RANK')), dist.local_rank())
    assert.are.equal('mpi', dist.backend())
    assert.are.equal('cpu', dist.device())
    assert.are.equal(W, dist.get_world_group():size())
  end)

  for _, dtype in ipairs(dtypes) do
    for _, n in ipairs(sizes) do
      it(('all_gather_into %s, %d per rank'):format(dtype, n), function()
        local inp = fill(n, dtype, function(i) return val(R, i, dtype) end)
        local out = ms.empty({ n * W }, { dtype = dtype })
        dist.all_gather_into(out, inp)
        local expect = {}
        for r = 0, W - 1 do
          for i = 0, n - 1 do expect[#expect + 1] = val(r, i, dtype) end
        end
        assert_values(out, expect, 'all_gather_into')
      end)

      for _, op in ipairs(ops) do
        it(('reduce_scatter %s %s, %d per rank'):format(op, dtype, n), function()
          local inp = fill(n * W, dtype, function(i) return val(R, i, dtype) end)
          local out = ms.empty({ n }, { dtype = dtype })
          dist.reduce_scatter(out, inp, op)
          local expect = {}
          for i = 0, n - 1 do
            local vals = {}
            for r = 0, W - 1 do vals[#vals + 1] = val(r, R * n + i, dtype) end
            expect[#expect + 1] = as_dtype(reduce(op, vals, dtype), dtype)
          end
          assert_values(out, expect, 'reduce_scatter ' .. op)
        end)

        it(('all_reduce %s %s, %d elements'):format(op, dtype, n), function()
          local t = fill(n, dtype, function(i) return val(R, i, dtype) end)
          dist.all_reduce(t, op)
          local expect = {}
          for i = 0, n - 1 do
            local vals = {}
            for r = 0, W - 1 do vals[#vals + 1] = val(r, i, dtype) end
            expect[#expect + 1] = as_dtype(reduce(op, vals, dtype), dtype)
          end
          assert_values(t, expect, 'all_reduce ' .. op)
        end)
      end

      it(('broadcast %s, %d elements, from the first and the last rank'):format(dtype, n), function()
        for _, root in ipairs({ 0, W - 1 }) do
          local t = fill(n, dtype, function(i) return val(R, i, dtype) end)
          dist.broadcast(t, root)
          local expect = {}
          for i = 0, n - 1 do expect[#expect + 1] = val(root, i, dtype) end
          assert_values(t, expect, 'broadcast from ' .. root)
        end
      end)
    end
  end

  it('all_reduce_coalesced: the values all_reduce gives each tensor (f32, f64, bf16 and i64, 2-D, empty; buckets of '
    .. 'every size, packed as on CUDA), with sum and avg; unpacked, the CPU\'s default, too', function()
    local specs = { { { 3, 4 }, 'f32' }, { { 5 }, 'f64' }, { { 2, 3 }, 'bf16' }, { { 0 }, 'f32' }, { { 4 }, 'i64' },
      { { 7 }, 'f32' }, { { 1 }, 'f64' }, { { 6, 2 }, 'f32' } }
    local function make(r) return S.coalesced_list(r, specs) end
    for _, op in ipairs({ 'sum', 'avg' }) do
      for _, cap in ipairs({ 1, 40, 2 ^ 30 }) do
        local got, want = make(R), make(R)
        dist.all_reduce_coalesced(got, op, { bucket_bytes = cap, pack = true })
        for k, t in ipairs(want) do
          if t:numel() > 0 then dist.all_reduce(t, op) end
          assert.are.same(t.shape, got[k].shape)
          assert.are.equal(t.dtype, got[k].dtype)
          assert.are.same(t:to('f64'):reshape({ t:numel() }):totable(), got[k]:to('f64'):reshape({ t:numel() }):totable(),
            ('tensor %d (%s), %s, buckets of %d bytes'):format(k, t.dtype, op, cap))
        end
      end
    end
    local got, want = make(R), make(R)
    dist.all_reduce_coalesced(got, 'sum')
    for k, t in ipairs(want) do
      if t:numel() > 0 then dist.all_reduce(t, 'sum') end
      assert.are.same(t:to('f64'):reshape({ t:numel() }):totable(), got[k]:to('f64'):reshape({ t:numel() }):totable())
    end
    -- what all_reduce refuses it refuses, naming the tensor
    local ok, err = pcall(dist.all_reduce_coalesced, { ms.zeros({ 3 }), ms.zeros({ 3, 4 }):t() }, 'sum', { pack = true })
    assert.is_false(ok)
    assert.matches('contiguous', tostring(err))
    ok, err = pcall(dist.all_reduce_coalesced, { ms.zeros({ 3 }), 7 }, 'sum')
    assert.is_false(ok)
    assert.matches('all_reduce_coalesced: list[2] must be a tensor, got number', tostring(err), 1, true)
  end)

  it('reduces random data within the dtype bound (every rank draws every rank\'s seed)', function()
    local n = 999
    for _, dtype in ipairs({ 'f32', 'bf16', 'f64' }) do
      local mine = ms.randn({ n }, { seed = 100 + R }):to(dtype)
      local t = mine:clone()
      dist.all_reduce(t, 'sum')
      local ref = ms.zeros({ n }, { dtype = 'f64' })
      for r = 0, W - 1 do ref = ref + ms.randn({ n }, { seed = 100 + r }):to(dtype):to('f64') end
      local err = ((t:to('f64') - ref):square():sum():sqrt() / ref:square():sum():sqrt()):item()
      local bound = ({ f32 = 1e-6, bf16 = 1e-2, f64 = 1e-14 })[dtype]
      assert.is_true(err <= bound, ('%s: relative error %g > %g'):format(dtype, err, bound))
    end
  end)

  it('gathers multi-dimensional tensors along the first dim', function()
    local inp = ms.full({ 2, 3 }, R, { dtype = 'f32' })
    local out = ms.empty({ 2 * W, 3 }, { dtype = 'f32' })
    dist.all_gather_into(out, inp)
    for r = 0, W - 1 do
      assert.are.same({ { r, r, r }, { r, r, r } }, out:narrow(1, 2 * r + 1, 2):totable())
    end
  end)

  it('works in place: the input is this rank\'s chunk of the output (all_gather) or the reverse', function()
    local n = 5
    local out = ms.zeros({ n * W }, { dtype = 'f64' })
    out:narrow(1, R * n + 1, n):copy_(fill(n, 'f64', function(i) return val(R, i, 'f64') end))
    dist.all_gather_into(out, out:narrow(1, R * n + 1, n))
    local expect = {}
    for r = 0, W - 1 do for i = 0, n - 1 do expect[#expect + 1] = val(r, i, 'f64') end end
    assert_values(out, expect, 'in-place all_gather_into')

    local inp = fill(n * W, 'f32', function(i) return val(R, i, 'f32') end)
    dist.reduce_scatter(inp:narrow(1, R * n + 1, n), inp, 'sum')
    local want = {}
    for i = 0, n - 1 do
      local s = 0
      for r = 0, W - 1 do s = s + val(r, R * n + i, 'f32') end
      want[#want + 1] = s
    end
    assert_values(inp:narrow(1, R * n + 1, n), want, 'in-place reduce_scatter')
  end)

  it('runs asynchronously: works complete in any order of waiting, is_done never blocks', function()
    local a = fill(1001, 'f32', function(i) return val(R, i, 'f32') end)
    local b = ms.empty({ 7 * W }, { dtype = 'i64' })
    local c = fill(7, 'i64', function(i) return val(R, i, 'i64') end)
    local wa = dist.all_reduce(a, 'max', { async = true })
    local wb = dist.all_gather_into(b, c, { async = true })
    local polls = 0
    while not wb:is_done() do polls = polls + 1 end
    wb:wait()
    wa:wait()
    assert.is_true(wa:is_done())
    wa:wait()   -- a second wait is a no-op
    local ea, eb = {}, {}
    for i = 0, 1000 do
      local vals = {}
      for r = 0, W - 1 do vals[#vals + 1] = val(r, i, 'f32') end
      ea[#ea + 1] = reduce('max', vals, 'f32')
    end
    for r = 0, W - 1 do for i = 0, 6 do eb[#eb + 1] = val(r, i, 'i64') end end
    assert_values(a, ea, 'async all_reduce')
    assert_values(b, eb, 'async all_gather')
  end)

  -- the Lua side of collectives under a CUDA graph capture (the capture
  -- stubbed: ms.cuda.is_capturing says yes; the C side, which asks the
  -- runtime, runs them as usual on the CPU): check_joined names the async
  -- collectives issued in it and not waited for, and forgets them
  it('check_joined names the async collectives a capture issued and did not wait for, then forgets them', function()
    local cuda = require 'moonshard.cuda'
    local real = cuda.is_capturing
    local ok, err = pcall(function()
      cuda.is_capturing = function() return true end
      local a = ms.full({ 7 }, R, { dtype = 'f32' })
      local b = ms.full({ 5 }, R, { dtype = 'f64' })
      local wa = dist.all_reduce(a, 'sum', { async = true })
      local wb = dist.broadcast(b, 0, { async = true })
      local wc = dist.all_reduce(ms.zeros({ 1 }, { dtype = 'f32' }), 'sum', { async = true })
      wa:wait()
      dist.all_reduce(ms.zeros({ 3 }, { dtype = 'f32' }), 'sum')   -- (waited by the call itself)
      wc:free()   -- (freed unwaited inside the capture: still open)
      local ok2, e2 = pcall(dist.check_joined, 'the step')
      assert.is_false(ok2)
      local msg = tostring(e2)
      for _, w in ipairs({ 'the step: 2 collectives issued in the CUDA graph capture and not waited for',
        '(all_reduce, broadcast)', 'join' }) do
        assert.is_truthy(msg:find(w, 1, true), msg)
      end
      dist.check_joined('again')   -- (forgotten)
      wb:wait()
      local wd = dist.all_reduce(ms.zeros({ 1 }, { dtype = 'f32' }), 'sum', { async = true })
      cuda.is_capturing = real
      wd:free()   -- (freed once the capture is over: forgotten)
      dist.check_joined('after')
      assert.are.equal(W * (W - 1) / 2, a:get(1))
      -- join_captured: the open ones waited for (a capture abandoned)
      cuda.is_capturing = function() return true end
      local we = dist.all_reduce(ms.full({ 2 }, 1, { dtype = 'f32' }), 'sum', { async = true })
      local wf = dist.all_reduce(ms.full({ 3 }, 1, { dtype = 'f64' }), 'max', { async = true })
      wf:wait()
      assert.are.equal(1, dist.join_captured())
      assert.are.equal(0, dist.join_captured())
      dist.check_joined('joined')
      cuda.is_capturing = real
      we:wait()   -- (a second wait is a no-op)
    end)
    cuda.is_capturing = real
    assert(ok, err)
  end)

  it('keeps the buffers of a work alive when the tensors are freed, and finishes it when the work is freed', function()
    local t = ms.full({ 100 }, R + 1, { dtype = 'f64' })
    local w = dist.all_reduce(t, 'sum', { async = true })
    local keep = t:alias()
    t:free()
    w:free()   -- waits, since MPI still writes into the buffer
    assert.are.equal(W * (W + 1) / 2, keep:get(1))
    w:free()   -- twice is fine
  end)

  it('refuses bad arguments with messages that name them', function()
    local inp = ms.zeros({ 3 }, { dtype = 'f32' })
    local ok, err = pcall(dist.all_gather_into, ms.zeros({ 3 * W + 1 }, { dtype = 'f32' }), inp)
    assert.is_false(ok)
    assert.matches('must hold ' .. W .. ' x 3', err, 1, true)
    ok, err = pcall(dist.reduce_scatter, ms.zeros({ 2 }), ms.zeros({ 2 * W + 1 }), 'sum')
    assert.is_false(ok)
    assert.matches('pad the input', err, 1, true)
    ok, err = pcall(dist.all_reduce, ms.zeros({ 3 }, { dtype = 'f16' }), 'sum')
    assert.is_false(ok)
    assert.matches('f32, bf16, f64 or i64', err, 1, true)
    ok, err = pcall(dist.all_reduce, ms.zeros({ 3, 4 }):t(), 'sum')
    assert.is_false(ok)
    assert.matches('not contiguous', err, 1, true)
    ok, err = pcall(dist.all_reduce, inp, 'prod')
    assert.is_false(ok)
    assert.matches("unknown reduction prod", err, 1, true)
    ok, err = pcall(dist.all_gather_into, ms.zeros({ 3 * W }, { dtype = 'f64' }), inp)
    assert.is_false(ok)
    assert.matches('same dtype', err, 1, true)
    ok, err = pcall(dist.broadcast, inp, W)
    assert.is_false(ok)
    assert.matches('root ' .. W .. ' is not a rank of the group', err, 1, true)
    ok, err = pcall(dist.new_group, { 0, 0 })
    assert.is_false(ok)
    assert.matches('listed twice', err, 1, true)
    ok, err = pcall(dist.mesh, { replicate = W + 1, shard = 1 })
    assert.is_false(ok)
    assert.matches('must equal the world size', err, 1, true)
    -- the world still works after all of these
    local t = ms.ones({ 4 })
    dist.all_reduce(t, 'sum')
    assert.are.same({ W, W, W, W }, t:totable())
  end)

  it('makes sub-groups: members reduce among themselves, others are told they are not members', function()
    local evens, odds = {}, {}
    for r = 0, W - 1 do
      if r % 2 == 0 then evens[#evens + 1] = r else odds[#odds + 1] = r end
    end
    local ge = dist.new_group(evens)
    local go = #odds > 0 and dist.new_group(odds) or nil
    local mine, other = ge, go
    if R % 2 == 1 then mine, other = go, ge end
    assert.is_true(mine:is_member())
    assert.are.same(R % 2 == 0 and evens or odds, mine:ranks())
    local t = ms.full({ 7 }, R, { dtype = 'i64' })
    mine:all_reduce(t, 'sum')
    local s = 0
    for _, r in ipairs(mine:ranks()) do s = s + r end
    assert.are.same({ s, s, s, s, s, s, s }, t:totable())
    -- all_gather inside the group, group-rank order
    local out = ms.empty({ mine:size() }, { dtype = 'f64' })
    mine:all_gather_into(out, ms.full({ 1 }, R, { dtype = 'f64' }))
    assert.are.same(mine:ranks(), out:totable())
    -- broadcast from a world rank of the group
    local b = ms.full({ 3 }, R, { dtype = 'f32' })
    local root = mine:ranks()[#mine:ranks()]
    mine:broadcast(b, root)
    assert.are.same({ root, root, root }, b:totable())
    if other then
      assert.is_false(other:is_member())
      local ok, err = pcall(other.all_reduce, other, t, 'sum')
      assert.is_false(ok)
      assert.matches('not a member', err, 1, true)
    end
    -- a group listed out of order is ordered by world rank
    local rev = {}
    for r = W - 1, 0, -1 do rev[#rev + 1] = r end
    local gr = dist.new_group(rev)
    assert.are.equal(R, gr:rank())
    gr:barrier()
  end)

  it('builds every replicate x shard mesh of the world; HSDP reduction equals a world reduce_scatter', function()
    for S = 1, W do
      if W % S == 0 then
        local Rn = W / S
        local m = dist.mesh { replicate = Rn, shard = S }
        local row, col = math.floor(R / S), R % S
        assert.are.same({ Rn, S }, m.shape)
        assert.are.same({ row, col }, m.coord)
        local rowr, colr = {}, {}
        for j = 0, S - 1 do rowr[#rowr + 1] = row * S + j end
        for i = 0, Rn - 1 do colr[#colr + 1] = i * S + col end
        assert.are.same(rowr, m.shard:ranks())
        assert.are.same(colr, m.replicate:ranks())
        assert.are.equal(col, m.shard:rank())
        assert.are.equal(row, m.replicate:rank())
        -- hybrid sharding's gradient path: reduce_scatter inside the shard
        -- group, then all_reduce across replicas == reduce over the world
        local n = 3
        local g = fill(n * S, 'f64', function(i) return val(R, i, 'f64') end)
        local part = ms.empty({ n }, { dtype = 'f64' })
        m.shard:reduce_scatter(part, g, 'sum')
        m.replicate:all_reduce(part, 'sum')
        local expect = {}
        for i = 0, n - 1 do
          local s = 0
          for r = 0, W - 1 do s = s + val(r, col * n + i, 'f64') end
          expect[#expect + 1] = s
        end
        assert_values(part, expect, ('mesh %dx%d'):format(Rn, S))
        m.shard:free()
        m.replicate:free()
      end
    end
  end)

  it('meets at a barrier', function()
    dist.barrier()
    dist.get_world_group():barrier()
  end)

  it('times out a collective that a peer never joins, names it, and the rest of the world carries on', function()
    if W < 2 then return end
    local g = dist.new_group({ 0, 1 })
    if R == 0 then
      g:set_timeout(0.5)
      local t = ms.ones({ 5 })
      local t0 = os.clock()
      local ok, err = pcall(g.all_reduce, g, t, 'sum')
      assert.is_false(ok)
      assert.matches('all_reduce sum of f32 %(5%) cpu on group %[0,1%] did not complete within 0.5 s', err)
      assert.is_true(g:is_broken())
      ok, err = pcall(g.all_reduce, g, t, 'sum')
      assert.is_false(ok)
      assert.matches('is broken', err, 1, true)
    end
    dist.barrier()
    if R == 1 then
      -- joins late: rank 0's abandoned request completes, so MPI ends cleanly
      local t = ms.ones({ 5 })
      g:all_reduce(t, 'sum')
      assert.are.same({ 2, 2, 2, 2, 2 }, t:totable())
    end
    local t = ms.ones({ 2 })
    dist.all_reduce(t, 'sum')
    assert.are.same({ W, W }, t:totable())
  end)
end)

describe('dist over MPI, initialised again after destroy #mpi', function()
  if not under_mpi then return end
  it('runs collectives in a second init of the same process (MPI stays up until exit)', function()
    assert.is_false(dist.is_initialized())
    dist.init { backend = 'mpi', timeout = 60 }
    local W = dist.world_size()
    local t = ms.full({ 7 }, dist.rank(), { dtype = 'i64' })
    dist.all_reduce(t, 'sum')
    assert.are.equal(W * (W - 1) / 2, t:get(7))
    dist.destroy()
    assert.is_false(dist.is_initialized())
  end)
end)
