-- Expert parallelism on GPUs over NCCL (#multi: tools/run_multi_specs.sh
-- on a host with 2 or more GPUs). spec/dist_moe_spec.lua (#mpi) holds the
-- exact f64 checks; this file runs the exchange with CUDA tensors and the
-- padded runs: each rank's output and gradients against the whole layer
-- on every rank's tokens on the same GPU (f32, 1e-4), and under bf16
-- autocast (2e-2); and a Mixtral under ms.ep (the training loop's
-- reductions, norm and one-process checkpoint gathered to the host),
-- plain and under fully_shard (the experts a unit of their own), against
-- one process over every rank's batch (f32, 1e-4).
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

  for _, sharded in ipairs({ false, true }) do
    it(('ms.ep%s: a Mixtral\'s gradients, norm, two clipped steps and one-process checkpoint (on the host) are one '
      .. 'process\'s on every rank\'s batch (f32, 1e-4)'):format(sharded and ' under fully_shard' or ''), function()
      if 8 % W ~= 0 then return end
      local mixtral = require 'models.mixtral'
      local S = require 'spec.support'
      local cfg = { vocab_size = 64, hidden_size = 64, intermediate_size = 96, num_hidden_layers = 2,
        num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 32, num_local_experts = 8,
        num_experts_per_tok = 2, output_router_logits = false, bos_token_id = require('models.hf').null,
        eos_token_id = require('models.hf').null }
      local function make()
        ms.manual_seed(4)
        local m = mixtral.new(cfg)
        for name, p in m:named_parameters() do if not name:match('norm') then ms.normal_(p, 0, 0.1) end end
        return m:to('cuda')
      end
      local hyper = { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
      local function batch(p, step)
        local x, y = S.token_batch(2, 16, 64, 11 + p + 10 * step)
        return x:cuda(), y:cuda()
      end
      local ref, m = make(), make()
      ms.ep.parallelize(m)
      local ropt, opt = ms.optim.AdamW(ref, hyper), nil
      if sharded then
        ms.fsdp.fully_shard(m, { policy = ms.fsdp.policy.by_class({ 'LlamaDecoderLayer' }) })
        opt = ms.fsdp.AdamW(m, hyper)
      else
        opt = ms.optim.AdamW(m, hyper)
      end
      for step = 1, 2 do
        ropt:zero_grad(); opt:zero_grad()
        for p = 0, W - 1 do
          local x, y = batch(p, step)
          local l = ref(x, y) * (1 / W)
          l:backward()
        end
        local x, y = batch(R, step)
        m(x, y):backward()
        if not sharded then ms.ep.all_reduce_grads(m) end
        if step == 1 and not sharded then
          local rp = {}
          for name, p in ref:named_parameters() do rp[name] = p end
          for name, p in m:named_parameters() do
            local err = FS.norm_rel(p.grad, rp[name].grad)
            assert.is_true(err <= 1e-4, ('%s: %g'):format(name, err))
          end
        end
        local nr = ms.optim.clip_grad_norm(ref, 0.05)
        local nm = ms.ep.clip_grad_norm_(m, 0.05)
        assert.is_true(nr > 0.05 and FS.rel(nm, nr) <= 1e-4, ('step %d: norm %.9g, one process %.9g'):format(step, nm, nr))
        ropt:step(); opt:step()
      end
      local msd, osd = ms.ep.full_checkpoint(m, opt, hyper, { host = true })
      local rsd, rosd = ref:state_dict(), ropt:state_dict()
      for name, t in pairs(rsd) do
        assert.is_truthy(msd[name], name)
        -- (the experts gathered on the host; the rest the model's own tensors)
        if name:match('%.experts%.') then assert.are.equal('cpu', msd[name].device, name) end
        assert.is_true(FS.norm_rel(msd[name]:to('cpu'), t:to('cpu')) <= 1e-4, name)
      end
      assert.are.same(rosd.meta.groups, osd.meta.groups)
      for name, t in pairs(rosd.tensors) do
        assert.is_truthy(osd.tensors[name], name)
        assert.is_true(FS.norm_rel(osd.tensors[name]:to('cpu'), t:to('cpu')) <= 1e-3, name)
      end
    end)
  end
end)
