-- Flat parameters over MPI (moonshard.fsdp), run by every rank under mpirun
-- (tools/run_mpi_specs.sh runs it with 1, 2, 3 and 4 ranks). Every rank
-- builds the same parameters from the same seeds, so each checks the
-- collectives' results against values it computed alone: unshard gives back
-- every parameter exactly, and reduce_scatter of per-rank gradients equals
-- the sum (or mean) over ranks of this rank's slice of every parameter.
-- Sizes are uneven so that parameters straddle shard boundaries and, at 4
-- ranks with the small list, trailing ranks hold only padding.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

-- a list, not a map: every rank must run the specs in the same order
local shape_lists = {
  { 'uneven', { { 3, 5 }, { 7 }, { 2, 1, 3 }, { 1 }, { 13, 3 }, { 5 } } },
  { 'small', { { 1 }, { 2 } } },
  { 'one', { { 101 } } },
}
local uneven = shape_lists[1][2]

local function make_params(shapes, seed)
  local ps = {}
  for i, s in ipairs(shapes) do ps[i] = ms.randn(s, { seed = seed + i }) end
  return ps
end

-- rank r's gradient of parameter i: distinct per rank and per element, and
-- exact in f32 (multiples of 1/8 under 2^10), so sums over ranks are exact
local function grad_value(r, i, k) return ((r * 31 + i * 17 + k * 7) % 41 - 20) / 8 end

local function grads_for(shapes, r)
  local gs = {}
  for i, s in ipairs(shapes) do
    local n = 1
    for _, d in ipairs(s) do n = n * d end
    local v = {}
    for k = 0, n - 1 do v[k + 1] = grad_value(r, i, k) end
    gs[i] = ms.tensor(v):view(s)
  end
  return gs
end

local function numel_of(shape) local n = 1 for _, d in ipairs(shape) do n = n * d end return n end

describe('flat parameters over MPI #mpi', function()
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

  for _, case in ipairs(shape_lists) do
    local name, shapes = case[1], case[2]
    for _, dtype in ipairs({ 'f32', 'f64' }) do
      it(('unshard gives back every parameter exactly on every rank (%s, %s)'):format(name, dtype), function()
        local ps = make_params(shapes, 100)
        for i, p in ipairs(ps) do ps[i] = p:to(dtype) end
        local fp = fsdp.FlatParam.new(ps, { dtype = dtype })
        assert.are.equal(W, fp.world_size)
        assert.are.equal(R, fp.rank)
        assert.are.equal(fp.total, W * fp.shard_numel)
        -- this rank's shard holds only its slices (the rest is padding, zero)
        local sh, covered = fp.shard:totable(), {}
        for i, s in ipairs(fp:slices()) do
          local pt = ps[i]:reshape(ps[i]:numel()):totable()
          for k = 0, s.numel - 1 do
            assert.are.equal(pt[s.param_start + k + 1], sh[s.shard_offset + k + 1])
            covered[s.shard_offset + k] = true
          end
        end
        for k = 0, fp.shard_numel - 1 do if not covered[k] then assert.are.equal(0, sh[k + 1]) end end
        -- unshard twice around a reshard: the same values each time
        for _ = 1, 2 do
          local vs = fp:unshard()
          for i, p in ipairs(ps) do
            assert.are.same(p.shape, vs[i].shape)
            assert.are.same(p:totable(), vs[i]:totable())
          end
          fp:reshard()
          assert.is_false(fp:is_unsharded())
          assert.are.equal(fp.shard_numel, fp.shard:numel())
        end
      end)
    end

    for _, op in ipairs({ 'sum', 'avg' }) do
      it(('reduce_scatter of per-rank gradients gives this rank\'s slice of the %s (%s)'):format(op, name), function()
        local ps = make_params(shapes, 200)
        local fp = fsdp.FlatParam.new(ps)
        local g, gv = fp:grad_buffer()
        for i, gi in ipairs(grads_for(shapes, R)) do gv[i]:copy_(gi) end
        local gs = fp:reduce_scatter(g, op)
        assert.are.equal('f32', gs.dtype)
        assert.are.equal(fp.shard_numel, gs:numel())
        local got = gs:totable()
        -- the expectation, computed alone: for each parameter, the elements of
        -- this rank's slice summed over every rank's gradient formula
        local expect = {}
        for k = 1, fp.shard_numel do expect[k] = 0 end
        for i, s in ipairs(fp:slices()) do
          assert.is_true(s.numel <= numel_of(shapes[i]))
          for k = 0, s.numel - 1 do
            local acc = 0
            for r = 0, W - 1 do acc = acc + grad_value(r, i, s.param_start + k) end
            if op == 'avg' then acc = acc / W end
            expect[s.shard_offset + k + 1] = acc
          end
        end
        for k = 1, fp.shard_numel do
          assert(math.abs(got[k] - expect[k]) <= 1e-6 * math.max(1, math.abs(expect[k])),
            ('%s: shard element %d is %s, expected %s'):format(op, k - 1, got[k], expect[k]))
        end
      end)
    end
  end

  it('all-gathers the bf16 copy of the f32 master shards', function()
    local ps = make_params(uneven, 500)
    local fp = fsdp.FlatParam.new(ps, { dtype = 'bf16' })
    assert.are.equal('f32', fp.shard.dtype)
    local vs = fp:unshard()
    for i, p in ipairs(ps) do
      assert.are.equal('bf16', vs[i].dtype)
      assert.are.same(p:bf16():totable(), vs[i]:totable())
    end
    fp:reshard()
  end)

  it('reduce-scatters a bf16 gradient buffer into the f32 shard', function()
    local shapes = uneven
    local fp = fsdp.FlatParam.new(make_params(shapes, 300))
    local g, gv = fp:grad_buffer('bf16')
    assert.are.equal('bf16', g.dtype)
    for i, gi in ipairs(grads_for(shapes, R)) do gv[i]:copy_(gi) end
    local gs = fp:reduce_scatter(g, 'sum')
    assert.are.equal('f32', gs.dtype)
    local got = gs:totable()
    for i, s in ipairs(fp:slices()) do
      for k = 0, s.numel - 1 do
        local acc = 0
        for r = 0, W - 1 do acc = acc + grad_value(r, i, s.param_start + k) end
        assert.are.equal(acc, got[s.shard_offset + k + 1])
      end
    end
  end)

  it('every rank holds a shard of the same length, and together they hold everything', function()
    local shapes = uneven
    local fp = fsdp.FlatParam.new(make_params(shapes, 400))
    local len = ms.tensor({ fp.shard_numel }, { dtype = 'i64' })
    local all = ms.empty({ W }, { dtype = 'i64' })
    dist.all_gather_into(all, len)
    for _, v in ipairs(all:totable()) do assert.are.equal(fp.shard_numel, v) end
    local held = ms.tensor({ (function() local n = 0 for _, s in ipairs(fp:slices()) do n = n + s.numel end return n end)() },
      { dtype = 'i64' })
    dist.all_reduce(held, 'sum')
    local want = 0
    for _, s in ipairs(shapes) do want = want + numel_of(s) end
    assert.are.equal(want, held:item())
  end)
end)
