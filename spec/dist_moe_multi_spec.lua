-- Expert parallelism on GPUs over NCCL (#multi: tools/run_multi_specs.sh
-- on a host with 2 or more GPUs). spec/dist_moe_spec.lua (#mpi) holds the
-- exact f64 checks; this file runs the exchange with CUDA tensors and the
-- padded runs: each rank's output and gradients against the whole layer
-- on every rank's tokens on the same GPU (f32, 1e-4), and under bf16
-- autocast (2e-2).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local nn = ms.nn

local launched = os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda'

describe('expert parallelism on GPUs (NCCL) #multi', function()
  if not launched then
    it('runs under the launcher on GPUs (tools/run_multi_specs.sh)', function() pending('not launched with --device cuda') end)
    return
  end
  setup(function() dist.init { timeout = tonumber(os.getenv('MS_MULTI_TIMEOUT') or 300) } end)
  teardown(function() dist.destroy() end)

  local W, R = tonumber(os.getenv('WORLD_SIZE')), tonumber(os.getenv('RANK'))

  local function build()
    ms.manual_seed(9)
    local m = nn.MoE { dim = 128, hidden = 96, experts = 8, top_k = 2 }
    for _, p in ipairs(m:parameters()) do ms.normal_(p, 0, 0.1) end
    return m:to('cuda')
  end
  local function tokens(p) return ms.randn({ 300 + 50 * p, 128 }, { seed = 100 + p }):cuda() end
  local function probe(p) return ms.randn({ 300 + 50 * p, 128 }, { seed = 200 + p }):cuda() end

  for _, prec in ipairs({ { 'f32', 1e-4 }, { 'bf16', 2e-2 } }) do
    it(('%s: each rank\'s output and gradients are the whole layer\'s on every rank\'s tokens (%g)'):format(prec[1],
      prec[2]), function()
      local function run(fn) if prec[1] == 'bf16' then return nn.functional.autocast('bf16', fn) end return fn() end
      local ref = build()
      local xs, gs, off = {}, {}, 0
      for p = 0, W - 1 do
        xs[p + 1], gs[p + 1] = tokens(p), probe(p)
        if p < R then off = off + 300 + 50 * p end
      end
      local xa = ms.cat(xs, 1):requires_grad_()
      local ya = run(function() return ref(xa) end)
      ya:backward(ms.cat(gs, 1):to(ya.dtype))
      local m = build()
      nn.moe.expert_parallel(m)
      local x = tokens(R):requires_grad_()
      local y = run(function() return m(x) end)
      y:backward(probe(R):to(y.dtype))
      local n = 300 + 50 * R
      local e1 = FS.norm_rel(y:detach(), ya:detach():narrow(1, off + 1, n))
      assert.is_true(e1 <= prec[2], 'output ' .. e1)
      local e2 = FS.norm_rel(x.grad, xa.grad:narrow(1, off + 1, n))
      assert.is_true(e2 <= prec[2], 'input gradient ' .. e2)
      local El = 8 / W
      for j = 1, El do
        for _, nm in ipairs(m.experts[j].names) do
          local err = FS.norm_rel(m.experts[j][nm].weight.grad, ref.experts[R * El + j][nm].weight.grad)
          assert.is_true(err <= prec[2], ('expert %d %s: %g'):format(R * El + j, nm, err))
        end
      end
      local gg = m.gate.weight.grad:clone()
      dist.all_reduce(gg, 'sum')
      assert.is_true(FS.norm_rel(gg, ref.gate.weight.grad) <= prec[2])
    end)
  end
end)
