-- Float8 layers under FSDP (#mpi, 1-4 ranks): a model converted by
-- float8.convert and then sharded trains as the converted plain model does
-- on the same batch (the gathered weight is the plain one, so its amax and
-- casts are too; the weight gradient goes from the FP8 GEMM into the unit's
-- gradient sink with bf16 parameters), for GPT-2 (Conv1D) and Llama
-- (Linear, untied head unit), FULL_SHARD (the weight's f8 copy made again in
-- the backward, after the unit's gather) and SHARD_GRAD_OP (kept).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('fsdp with float8 layers #mpi', function()
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

  for _, c in ipairs({ { 'gpt2-tiny', 'GPT2Block' }, { 'llama-tiny', 'LlamaDecoderLayer' } }) do
    for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP' }) do
      for _, mp in ipairs({ false, { param = 'bf16', reduce = 'f32' } }) do
        it(('%s, %s%s: trains as the converted plain model'):format(c[1], strategy, mp and ', bf16 parameters' or ''),
          function()
            local x, y = FS.lcg_batch(91, 2, 16)   -- every rank the same batch
            local function losses(m, opt)
              local r = {}
              for k = 1, 3 do
                local l = mp and ms.nn.functional.autocast('bf16', m, x, y) or m(x, y)
                l:backward(); r[k] = l:item(); opt:step(); opt:zero_grad()
              end
              return r
            end
            -- the plain model; with bf16 parameters its weights are rounded to
            -- bf16 first, as FSDP's gathered copies are, then cast to f8
            local plain = FS.load_model(c[1])
            local names = ms.float8.convert(plain)
            assert.is_true(#names >= 8)
            if mp then
              for _, mod in plain:named_modules() do
                if ms.float8.converted(mod) then
                  ms.no_grad(function() mod.weight:copy_(mod.weight:to('bf16')) end)
                end
              end
            end
            local pl = losses(plain, ms.optim.AdamW(plain, { lr = 1e-3 }))
            local m = FS.load_model(c[1])
            assert.are.same(names, ms.float8.convert(m))
            fsdp.fully_shard(m, { policy = fsdp.policy.by_class { c[2] }, strategy = strategy, mixed_precision = mp or nil })
            -- a block's weights are released after its forward under FULL_SHARD
            -- only (float8 then casts them again in the backward)
            local blk = c[1]:match('^llama') and m.model.layers[1].mlp.up_proj or m.transformer.h[1].mlp.c_fc
            assert.are.equal(strategy == 'FULL_SHARD', fsdp.releases_after_forward(blk.weight))
            local before = ms.float8.stats().input_casts
            local fl = losses(m, fsdp.optimizer(m, ms.optim.AdamW, { lr = 1e-3 }))
            assert.is_true(ms.float8.stats().input_casts > before, 'the FP8 path ran')
            assert.is_true(fl[3] < fl[1])
            -- step 1 is the same computation; later steps differ by the
            -- optimizers' rounding (and bf16 parameters by their updates)
            local tol = mp and { 1e-2, 3e-2, 3e-2 } or { 1e-5, 5e-4, 5e-4 }
            for k = 1, 3 do
              assert.is_true(FS.rel(fl[k], pl[k]) <= tol[k], ('step %d: %.9g, plain %.9g'):format(k, fl[k], pl[k]))
            end
          end)
      end
    end
  end
end)
