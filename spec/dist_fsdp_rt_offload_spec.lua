-- fully_shard{ offload = true } (#mpi; tools/run_mpi_specs.sh runs it with
-- 1-4 ranks). In a CPU run offload changes no value but goes through the
-- same code path as on CUDA (the master shard, its gradient and the
-- optimizer state in host tensors, the low-precision copy "uploaded" after
-- each step, the reduced gradient "downloaded" into a host buffer: copies
-- between CPU tensors here). So: gpt2-tiny, 10 AdamW steps with clipping
-- under FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and (even world sizes)
-- HYBRID_SHARD, with offload, equal the same steps without it; so do bf16
-- mixed precision (the host cast before the upload) and no_sync with two
-- synced backwards (the host-side accumulation); the host buffers are made
-- once; and a sharded checkpoint of an offloaded model round-trips
-- (parameters, moments, the next step) into an offloaded and a plain
-- fully_shard model.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil
local fixtures = T.root .. '/../shared/fixtures'
local have_fixture = io.open(fixtures .. '/gpt2-tiny/model.safetensors', 'rb')
if have_fixture then have_fixture:close() end

local STEPS = 10
local ROWS, SEQ = 2, 16
local OPTS = { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 }

local function load_model()
  return require('models.gpt2').from_pretrained(fixtures .. '/gpt2-tiny', { dtype = 'f32' })
end

-- rank r's rows of step s (vocab 256)
local function batch(r, s)
  local seed = 777 + 7919 * r + 104729 * s
  return FS.lcg_batch(seed, ROWS, SEQ)
end

local function max_abs(a, b) return (a:to('f64') - b:to('f64')):abs():max():item() end

describe('fsdp offload #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not have_fixture then
    it('needs the fixtures', function() pending('no ' .. fixtures) end)
    return
  end
  local ck = require 'moonshard.fsdp_checkpoint'
  local H = require 'spec.fsdp_ckpt_helpers'
  local D
  setup(function()
    dist.init { backend = 'mpi', timeout = 300 }
    D = H.shared_tmpdir()
  end)
  teardown(function()
    dist.barrier()
    if dist.rank() == 0 and D and D:match('fsdp%-ckpt$') then os.execute("rm -rf '" .. D .. "'") end
    dist.destroy()
  end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))
  local strategies = { 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }
  if W % 2 == 0 then strategies[#strategies + 1] = 'HYBRID_SHARD' end

  local function build(strategy, offload, mp)
    local model = load_model()
    local o = { policy = fsdp.policy.by_class { 'GPT2Block' }, strategy = strategy, offload = offload,
                mixed_precision = mp }
    if strategy == 'HYBRID_SHARD' then o.shard_size = W / 2 end
    fsdp.fully_shard(model, o)
    return model, fsdp.AdamW(model, OPTS)
  end

  -- n steps from step `from`: the losses (mean over ranks) and the norms
  local function train(model, opt, from, n, check)
    local losses, norms = {}, {}
    for s = from, from + n - 1 do
      local x, y = batch(R, s)
      local loss = model(x, y)
      local l = loss:detach():reshape({ 1 }):clone()
      dist.all_reduce(l, 'avg')
      losses[#losses + 1] = l:item()
      loss:backward()
      norms[#norms + 1] = fsdp.clip_grad_norm(model, 0.5):item()
      if check then check() end
      opt:step()
      opt:zero_grad()
    end
    return losses, norms
  end

  local function params(model)
    fsdp.unshard(model)
    local r = {}
    for name, p in model:named_parameters() do r[#r + 1] = { name, p:clone() } end
    fsdp.reshard(model)
    return r
  end

  local function same(a, b, what, tol)
    assert.are.equal(#a, #b)
    for i = 1, #a do
      assert.are.equal(a[i][1], b[i][1])
      local d = max_abs(a[i][2], b[i][2])
      assert.is_true(d <= tol, ('%s: %s differs by %.3g'):format(what, a[i][1], d))
    end
  end

  for _, strategy in ipairs(strategies) do
    it(('%s: 10 steps with offload equal 10 steps without'):format(strategy), function()
      local ref, ropt = build(strategy, false)
      local rl, rn = train(ref, ropt, 1, STEPS)
      local model, opt = build(strategy, true)
      local units = fsdp.units(model)
      for _, u in ipairs(units) do
        assert.are.equal(-1, u.fp.shard.device_id)
        assert.is_not_nil(u.lp)        -- the device's copy, gathered from
        assert.are_not.equal(u.lp, u.fp.shard)
        assert.is_nil(u.aliased)        -- NO_SHARD too: its parameters are not views of the host shard
      end
      local grad_storage = {}
      local l, n = train(model, opt, 1, STEPS, function()
        for i, u in ipairs(units) do
          -- the reduced gradient arrived in the unit's host buffer, made once
          local g = u.fp.shard.grad
          assert.are.equal(-1, g.device_id)
          local key = tostring(T.ffi.cast('void *', g.storage.data))
          grad_storage[i] = grad_storage[i] or key
          assert.are.equal(grad_storage[i], key)
        end
      end)
      for s = 1, STEPS do
        assert.is_true(l[s] == rl[s], ('step %d: loss %.9g, without offload %.9g'):format(s, l[s], rl[s]))
        assert.is_true(n[s] == rn[s], ('step %d: norm %.9g, without offload %.9g'):format(s, n[s], rn[s]))
      end
      -- the copy the all-gather reads is the stepped master shard
      for _, u in ipairs(units) do assert.are.equal(0, max_abs(u.lp, u.fp.shard)) end
      -- the optimizer's moments are host tensors
      for _, g in ipairs(opt.param_groups) do
        for _, p in ipairs(g.params) do
          local s = opt.state[tonumber(p.id)]
          assert.are.equal(-1, s.exp_avg.device_id)
          assert.are.equal(-1, s.exp_avg_sq.device_id)
        end
      end
      same(params(model), params(ref), strategy, 0)
    end)
  end

  it('bf16 mixed precision (the host cast before the upload): 5 steps equal those without offload', function()
    local mp = { param = 'bf16', reduce = 'f32' }
    local ref, ropt = build('FULL_SHARD', false, mp)
    local rl = train(ref, ropt, 1, 5)
    local model, opt = build('FULL_SHARD', true, mp)
    local l = train(model, opt, 1, 5)
    for s = 1, 5 do assert.is_true(l[s] == rl[s], ('step %d: %.9g vs %.9g'):format(s, l[s], rl[s])) end
    for _, u in ipairs(fsdp.units(model)) do
      assert.are.equal('bf16', u.lp.dtype)
      assert.are.equal('f32', u.fp.shard.dtype)
      assert.are.equal(0, max_abs(u.lp, u.fp.shard:to('bf16')))
    end
    same(params(model), params(ref), 'bf16', 0)
  end)

  it('no_sync, then two synced backwards (the second added on the host): the gradients of the run without offload', function()
    local function grads(offload)
      local model = build('FULL_SHARD', offload)
      model:no_sync(function() local x, y = batch(R, 1); (model(x, y) / 4):backward() end)
      for k = 2, 3 do local x, y = batch(R, k); (model(x, y) / 4):backward() end
      local r = {}
      for i, u in ipairs(fsdp.units(model)) do r[i] = { u.label, u.fp.shard.grad:clone() } end
      return r
    end
    local a, b = grads(true), grads(false)
    same(a, b, 'accumulated gradient', 0)
    local nz = 0
    for _, e in ipairs(a) do nz = nz + e[2]:abs():sum():item() end
    assert.is_true(nz > 0)
  end)

  it('a sharded checkpoint of an offloaded model round-trips into offloaded and plain fully_shard models', function()
    local model, opt = build('FULL_SHARD', true)
    train(model, opt, 1, 2)
    ck.save_sharded(model, D .. '/offload', { optimizer = opt })
    local p0, s0 = ck.gather(model, { optimizer = opt })
    local l3 = train(model, opt, 3, 1)[1]
    local after = params(model)
    for _, offload in ipairs({ true, false }) do
      local m2, o2 = build('FULL_SHARD', offload)
      local info = ck.load_sharded(m2, D .. '/offload', { optimizer = o2 })
      assert.are.equal(2, info.step)
      local p1, s1 = ck.gather(m2, { optimizer = o2 })
      assert.are.equal(#p0, #p1)
      for i, e in ipairs(p1) do
        assert.are.equal(p0[i].name, e.name)
        assert.are.equal(0, max_abs(e.tensor, p0[i].tensor), e.name)
        assert.are.equal(0, max_abs(s1[e.name].exp_avg, s0[e.name].exp_avg), 'exp_avg of ' .. e.name)
        assert.are.equal(0, max_abs(s1[e.name].exp_avg_sq, s0[e.name].exp_avg_sq), 'exp_avg_sq of ' .. e.name)
      end
      -- the loaded shards reached the device's copy: the next step continues
      local l = train(m2, o2, 3, 1)[1]
      assert.is_true(l == l3, ('offload %s: loss %.9g after the load, %.9g'):format(tostring(offload), l, l3))
      same(params(m2), after, 'after the load', 0)
    end
  end)
end)
