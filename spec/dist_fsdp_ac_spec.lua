-- FSDP with activation checkpointing on several ranks (#mpi, 1-4 ranks):
-- FULL_SHARD and SHARD_GRAD_OP units whose blocks are checkpointed gather
-- their parameters again before the recompute and train as the same units
-- without checkpointing do (f32: equal losses; bf16 parameters: within bf16
-- rounding), for gpt2-tiny and llama-tiny; selective checkpointing (policy
-- op) gives the same losses, every kept output reused.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('fsdp with activation checkpointing #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not FS.have_fixture('gpt2-tiny') or not FS.have_fixture('llama-tiny') then
    it('needs the gpt2-tiny and llama-tiny fixtures', function() pending('no ' .. FS.fixtures) end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))

  local function losses(name, block, strategy, ac, mp)
    local m = FS.load_model(name)
    local names = ac and ms.nn.apply_activation_checkpointing(m, { class = block,
      policy = ac == 'op' and 'op' or nil }) or {}
    fsdp.fully_shard(m, { policy = fsdp.policy.by_class { block }, strategy = strategy, mixed_precision = mp })
    local opt = fsdp.optimizer(m, ms.optim.AdamW, { lr = 1e-2 })
    local out = {}
    for k = 1, 3 do
      local x, y = FS.lcg_batch(100 + R, 2, 16)   -- each rank its own rows, the same each step
      local loss = m(x, y)
      loss:backward()
      local l = ms.tensor({ loss:item() }, { dtype = 'f64' })
      dist.all_reduce(l, 'sum')
      out[k] = l:item()
      opt:step()
      opt:zero_grad()
    end
    return out, #names
  end

  for _, case in ipairs({ { 'gpt2-tiny', 'GPT2Block' }, { 'llama-tiny', 'LlamaDecoderLayer' } }) do
    for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP' }) do
      it(('%s, %s: checkpointed blocks train as the plain ones (f32 equal, bf16 within 1e-3)'):format(case[1], strategy), function()
        local a = losses(case[1], case[2], strategy, false)
        local b, n = losses(case[1], case[2], strategy, true)
        assert.are.equal(2, n)
        assert.are.same(a, b)
        -- selective (policy op): what the units' recompute takes is what their forward made
        ms.autograd.sac_stats(true)
        assert.are.same(a, (losses(case[1], case[2], strategy, 'op')))
        local st = ms.autograd.sac_stats(true)
        assert.is_true(st.kept > 0 and st.reused == st.kept, ('kept %d, reused %d'):format(st.kept, st.reused))
        assert.is_true(a[3] < a[1])
        local bf16 = { param = 'bf16', reduce = 'f32' }
        local c = losses(case[1], case[2], strategy, false, bf16)
        local d = losses(case[1], case[2], strategy, true, bf16)
        for k = 1, 3 do
          assert.is_true(FS.rel(d[k], c[k]) <= 1e-3, ('step %d: %.9g against %.9g'):format(k, d[k], c[k]))
        end
      end)
    end
  end
end)
