-- The LM head unit's gradient sink (#mpi, 1-4 ranks): with bf16 parameters
-- the fused linear cross-entropy accumulates the head weight's gradient in
-- its forward straight into the unit's f32 unsharded gradient buffer
-- (moonshard.flce sink_for; fsdp's head unit registers its sinks before its
-- forward). Against grad_sinks = false (the FLCE's own f32 accumulator, a
-- bf16 gradient, a converting copy): on one rank the bf16 rounding of the
-- new gradient shard is the old shard bit for bit, on several within bf16
-- bounds; a scaled loss under no_sync; a forward whose backward never ran
-- leaves nothing in the next gradient; a zero_grad between a forward and its
-- backward is an error that says the gradient is lost.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

local function batch(r, k)
  return FS.lcg_batch(4242 + 7919 * r + 101 * (k or 0), 2, 16)
end

local norm_rel = FS.norm_rel

describe('fsdp: the LM head unit\'s gradient sink #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not FS.have_fixture('llama-tiny') then
    it('needs the fixtures', function() pending('no ' .. FS.fixtures) end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))

  local function wrap(sinks, strategy, offload)
    local model = FS.load_model('llama-tiny')
    local o = { policy = fsdp.policy.by_class { 'LlamaDecoderLayer' }, strategy = strategy or 'FULL_SHARD',
                mixed_precision = { param = 'bf16' }, grad_sinks = sinks, offload = offload }
    if strategy == 'HYBRID_SHARD' then o.shard_size = W / 2 end
    fsdp.fully_shard(model, o)
    local units = fsdp.units(model)
    local head = units[#units]
    assert.is_true(head.head)
    return model, units, head
  end
  -- every unit's f32 gradient shard
  local function grads(units)
    local out = {}
    for k, u in ipairs(units) do
      local g = u.fp.shard.grad
      out[k] = g and g:clone() or nil
    end
    return out
  end
  -- the new shards against the old: bf16(new) == old on one rank (the
  -- head's region: the FLCE's f32 sums against their rounding; the rest
  -- equal), within bf16 bounds on several
  local function compare(new, old, what, bound)
    for k = 1, #old do
      assert.is_not_nil(new[k], what .. ': unit ' .. k .. ' got no gradient')
      if W == 1 and not bound then
        local d = (new[k]:to('bf16'):to('f32') - old[k]):abs():max():item()
        assert.are.equal(0, d, ('%s: unit %d: bf16(new) - old = %g'):format(what, k, d))
      else
        local e = norm_rel(new[k], old[k])
        assert.is_true(e < (bound or 1e-2), ('%s: unit %d: %.3e from the copies\' gradient'):format(what, k, e))
      end
    end
  end
  -- the head weight's view index in the head unit
  local function head_index(head)
    for i, n in ipairs(head.param_names) do if n == 'lm_head.weight' then return i end end
    error('no lm_head.weight in the head unit')
  end

  local cases = { { 'FULL_SHARD' }, { 'SHARD_GRAD_OP' }, { 'NO_SHARD' }, { 'FULL_SHARD', true } }
  if W % 2 == 0 then cases[#cases + 1] = { 'HYBRID_SHARD' } end
  for _, c in ipairs(cases) do
    local strategy, offload = c[1], c[2]
    it(strategy .. (offload and ' with offload' or '') .. ': the head weight\'s gradient goes into the f32 buffer in the forward; the shards as with the copies', function()
      local function run(sinks)
        local model, units, head = wrap(sinks, strategy, offload)
        local x, y = batch(R)
        local loss = model(x, y)
        local hi = head_index(head)
        local mark = head.gwritten and head.gwritten[hi]
        if sinks ~= false then
          -- marked by the loss until its backward: no bf16 gradient on the view
          assert.are.equal('table', type(mark))
          assert.is_nil(head.views[hi].grad)
        else
          assert.is_nil(mark)
        end
        loss:backward()
        return grads(units), loss:item()
      end
      local new, l1 = run(nil)
      local old, l2 = run(false)
      assert.are.equal(l2, l1)
      compare(new, old, strategy)
    end)
  end

  it('no_sync with a loss scale of 3/4: the first micro-batch into the sink, the next ones added as before', function()
    local function run(sinks)
      local model, units = wrap(sinks)
      model:no_sync(function()
        for k = 1, 2 do (model(batch(R, k)) * 0.75):backward() end
      end)
      local loss = model(batch(R, 3)) * 0.75
      loss:backward()
      return grads(units)
    end
    local new, old = run(nil), run(false)
    compare(new, old, 'no_sync', 1e-2)
  end)

  it('a forward whose backward never ran leaves nothing in the next gradient', function()
    local function run(extra)
      local model, units = wrap(nil)
      if extra then
        local l0 = model(batch(R, 7))   -- no backward: its gradient must not count
        l0 = nil
        ms.autograd.clear_tape()
      end
      local loss = model(batch(R))
      loss:backward()
      return grads(units)
    end
    local clean, after = run(false), run(true)
    -- (the second forward's loss finds the sink marked: its gradient comes
    -- as a bf16 tensor, copied in as before the sinks; the blocks' are the
    -- same sums)
    for k = 1, #clean do
      if W == 1 then
        assert.are.equal(0, (clean[k]:to('bf16'):to('f32') - after[k]:to('bf16'):to('f32')):abs():max():item(), 'unit ' .. k)
        if k < #clean then assert.are.equal(0, (clean[k] - after[k]):abs():max():item(), 'unit ' .. k) end
      else
        local e = norm_rel(after[k], clean[k])
        assert.is_true(e < 1e-2, ('unit %d: %.3e'):format(k, e))
      end
    end
  end)

  it('a zero_grad between the forward and the backward is an error that says the gradient is lost', function()
    local model = wrap(nil)
    local loss = model(batch(R))
    fsdp.zero_grad(model)
    local ok, e = pcall(function() loss:backward() end)
    assert.is_false(ok)
    assert.matches('fused_linear_cross_entropy', tostring(e))
    assert.matches('gradient is lost', tostring(e))
    ms.autograd.clear_tape()
  end)
end)
