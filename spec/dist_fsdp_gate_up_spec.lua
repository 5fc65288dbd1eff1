-- nn.GatedMLP under FSDP (#mpi, 1-4 ranks): gate and up stay two products
-- (fsdp.manages): the one-product path would copy the gathered weights side
-- by side and keep the copy for the backward, and the two products write
-- the unit's f32 gradient sinks themselves. Without FSDP the same model
-- takes the one product (nnf.swiglu_gate_up).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp
local A = ms.autograd

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('fsdp: nn.GatedMLP keeps gate and up apart #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not FS.have_fixture('llama-tiny') then
    it('needs the fixtures', function() pending('no ' .. FS.fixtures) end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)

  -- the names of the nodes one forward records
  local function recorded(m)
    local x, y = FS.lcg_batch(11 + dist.rank(), 2, 16)
    A.clear_tape()
    local loss = m(x, y)
    local names = {}
    for _, n in ipairs(A.tape) do
      if n.name then names[n.name] = (names[n.name] or 0) + 1 end
    end
    loss:backward()
    return names
  end

  it('one product without FSDP, two under each strategy', function()
    local plain = FS.load_model('llama-tiny')
    local L = plain.config.num_hidden_layers
    assert.are.equal(L, recorded(plain).swiglu_cat)
    assert.is_false(fsdp.manages(plain.model.layers[1].mlp.gate_proj.weight))
    for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }) do
      local m = FS.load_model('llama-tiny')
      fsdp.fully_shard(m, { strategy = strategy, policy = fsdp.policy.by_class({ 'LlamaDecoderLayer' }),
        mixed_precision = { param = 'bf16', reduce = 'f32' } })
      local names = recorded(m)
      assert.is_nil(names.swiglu_cat, strategy)
      assert.are.equal(L, names.swiglu, strategy)
      assert.is_true(fsdp.manages(m.model.layers[1].mlp.gate_proj.weight), strategy)
    end
  end)
end)
