-- nn.GatedMLP under FSDP (#mpi, 1-4 ranks): gate's and up's gathered
-- weights lie side by side in the unit's unsharded buffer, and the one
-- product of the two (nnf.swiglu_gate_up_joined) reads their joint view,
-- no copy, and writes both weights' gradients into the unit's f32 sinks
-- with one GEMM. The same sharded gradients as the two products, under each
-- strategy, with bf16 parameters (f32 reduce) and with f32 ones.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp
local A = ms.autograd

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('fsdp: nn.GatedMLP\'s gate and up as one product of the gathered weights #mpi', function()
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

  -- one forward and backward of the fixture model under fully_shard: the
  -- names of the recorded nodes, the whole gradients, the model
  local function run(strategy, param, fuse)
    local prev = ms.nn.set_fuse_gate_up(fuse)
    local m = FS.load_model('llama-tiny')
    fsdp.fully_shard(m, { strategy = strategy, policy = fsdp.policy.by_class({ 'LlamaDecoderLayer' }),
      mixed_precision = param and { param = param, reduce = 'f32' } or nil })
    local x, y = FS.lcg_batch(11 + dist.rank(), 2, 16)
    A.clear_tape()
    local loss = m(x, y)
    local names, saved_view = {}, nil
    for _, n in ipairs(A.tape) do
      if n.name then names[n.name] = (names[n.name] or 0) + 1 end
      if n.name == 'swiglu_gate_up' and saved_view == nil then saved_view = n.saved[2] end
    end
    local unit_storage = m.model.layers[1].mlp.gate_proj.weight.storage
    local shares = saved_view ~= nil and saved_view.storage == unit_storage
    loss:backward()
    ms.nn.set_fuse_gate_up(prev)
    return names, FS.whole_grads(m), m, shares
  end

  it('without FSDP the weights are copied side by side (swiglu_gate_up)', function()
    local plain = FS.load_model('llama-tiny')
    assert.is_false(fsdp.manages(plain.model.layers[1].mlp.gate_proj.weight))
    local x, y = FS.lcg_batch(11, 2, 16)
    A.clear_tape()
    plain(x, y)
    local cats = 0
    for _, n in ipairs(A.tape) do if n.name == 'swiglu_cat' then cats = cats + 1 end end
    A.clear_tape()
    assert.are.equal(plain.config.num_hidden_layers, cats)
  end)

  for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }) do
    for _, param in ipairs({ 'bf16', false }) do
      it(('%s, %s parameters: one product of the joint view; the gradients of the two products'):format(
        strategy, param or 'f32'), function()
        local n1, g1, m1, shares = run(strategy, param, true)
        local n0, g0 = run(strategy, param, false)
        local L = m1.config.num_hidden_layers
        assert.are.equal(L, n1.swiglu_gate_up)
        assert.is_nil(n1.cat)
        assert.is_nil(n1.swiglu)
        assert.is_true(shares, 'the node reads the unit\'s buffer')
        assert.is_nil(n0.swiglu_gate_up)
        assert.are.equal(L, n0.swiglu)
        assert.is_true(fsdp.manages(m1.model.layers[1].mlp.gate_proj.weight))
        local n = 0
        for name, g in pairs(g0) do
          local e = FS.norm_rel(g1[name], g)
          -- (f32: the same sums in other GEMMs' orders; bf16: the gate/up
          -- products' bf16 rounding of the activations they pass on)
          assert.is_true(e <= (param and 2e-2 or 1e-5), ('%s: %.3g'):format(name, e))
          n = n + 1
        end
        assert.is_true(n >= 10)
      end)
    end
  end
end)
