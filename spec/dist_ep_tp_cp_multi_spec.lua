-- Expert parallelism with tensor and context parallelism on GPUs over NCCL
-- (#multi: tools/run_multi_specs.sh 4 on a host with 4 GPUs; other worlds
-- are pending). spec/dist_ep_tp_cp_spec.lua (#mpi) holds the exact f64
-- checks; this file runs ms.ep.parallelize, ms.tp.parallelize and
-- ms.cp.apply with CUDA tensors: TP groups of 2 consecutive ranks, a
-- context-parallel pair of them (rank = c * 2 + t), the experts whole over
-- expert groups of 2 (the TP group, copied across the ring: --tp 2 --ep 2
-- --cp 2) or 4 (both TP groups of the ring: --tp 2 --ep 4 --cp 2), with
-- and without sequence parallelism. A tiny Mixtral (no load-balancing
-- loss: under --cp it is each rank's tokens') and a tiny DeepSeek-V3 (a
-- split shared expert, MLA, group-limited routing with biases, the
-- sequence-wise balance loss, summed over the ring) against one process on
-- the same GPU over the whole sequences, f32 (autocast off):
--   - the loss averaged over the ring (1e-5), every gradient (the slices
--     gathered, the experts under their global names; 1e-4 each) and the
--     gradient norm (1e-4);
--   - under fully_shard FULL_SHARD over the ranks of the same TP index:
--     two clipped AdamW steps' losses (1e-5) and norms (1e-4), and the
--     whole model after them (ep.full_state_dict, on the host; 1e-3).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local cp = require 'moonshard.cp'

local launched = os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda'

describe('expert, tensor and context parallelism on GPUs (NCCL) #multi', function()
  if not launched then
    it('runs under the launcher on GPUs (tools/run_multi_specs.sh)', function() pending('not launched with --device cuda') end)
    return
  end
  local W = tonumber(os.getenv('WORLD_SIZE'))
  if W ~= 4 then
    it('runs on 4 GPUs', function()
      pending(('a world of %d GPUs: --tp 2 --cp 2 needs 4'):format(W))
    end)
    return
  end
  setup(function() dist.init { timeout = tonumber(os.getenv('MS_MULTI_TIMEOUT') or 300) } end)
  teardown(function() dist.destroy() end)

  local cases = {
    { 'mixtral-tiny', require 'models.mixtral', { num_hidden_layers = 2, output_router_logits = false } },
    { 'deepseek-v3-tiny', require 'models.deepseek_v3', { num_hidden_layers = 2, aux_loss_alpha = 0.01 } },
  }
  local build = FS.moe_model   -- (case)
  -- TP pairs {0, 1} {2, 3}, rings {0, 2} {1, 3} (the mesh's replicate axis),
  -- expert groups of M consecutive ranks -> model (on the GPU), mesh, cp context
  local function split(case, M, sp)
    local m, mesh = FS.split_ep_tp(build(case), W, M, sp)
    m = m:to('cuda')
    return m, mesh, cp.apply(m, mesh.replicate)
  end
  local function batch(step)
    local x, y = FS.lcg_batch(100 * step, 2, 32)
    return x:cuda(), y:cuda()
  end
  -- this rank's chunks' loss, backward, averaged over the ring
  local function split_loss(m, mesh, ctx, step)
    local x, y = batch(step)
    return FS.cp_loss(m, ctx, x, y, mesh.replicate)
  end
  local layouts = { { 2, 'a TP group, copied across the ring' }, { 4, 'both TP groups of the ring' } }

  for _, case in ipairs(cases) do
    for _, lay in ipairs(layouts) do
      for _, sp in ipairs({ false, true }) do
        local what = ('%s, --tp 2 --ep %d --cp 2 (%s)%s, f32'):format(case[1], lay[1], lay[2],
          sp and ', sequence parallel' or '')
        it(what .. ': the loss, every gradient and the norm are one process\'s on the same GPU', function()
          local ref = build(case):to('cuda')
          local x, y = batch(1)
          local lref = ref(x, y)
          lref:backward()
          local m, mesh, ctx = split(case, lay[1], sp)
          local l = split_loss(m, mesh, ctx, 1)
          ms.ep.all_reduce_grads(m, mesh.replicate)
          assert.is_true(FS.rel(l, lref:item()) <= 1e-5, ('loss %.9g, one process %.9g'):format(l, lref:item()))
          local n = FS.same_moe_grads(m, ref, 1e-4, 1e-4)
          assert.is_true(n > 10)
          mesh.shard:free(); mesh.replicate:free()
        end)
      end
    end

    for _, lay in ipairs(layouts) do
      it(('%s, --tp 2 --ep %d --cp 2, sequence parallel, fully_shard FULL_SHARD: two clipped AdamW steps and the whole '
        .. 'model after them are one process\'s (f32)'):format(case[1], lay[1]), function()
        local hyper = { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
        local ref = build(case):to('cuda')
        local ropt = ms.optim.AdamW(ref, hyper)
        local m, mesh, ctx = split(case, lay[1], true)
        local opt = FS.shard_layers(m, mesh.replicate, 'FULL_SHARD', hyper)
        for step = 1, 2 do
          local x, y = batch(10 + step)
          local lref = ref(x, y)
          lref:backward()
          local l = split_loss(m, mesh, ctx, 10 + step)
          assert.is_true(FS.rel(l, lref:item()) <= 1e-5, ('step %d: loss %.9g, one process %.9g'):format(step, l,
            lref:item()))
          FS.clipped_moe_step(ref, ropt, m, opt, step, 1e-4, step == 2)
        end
        -- (1e-3: AdamW's update of an element whose gradient is near its
        -- eps turns on the gradient's last bits)
        FS.same_state(ms.ep.full_state_dict(m, { host = true }), ref:state_dict(), 1e-3, FS.host_norm_rel,
          ' after 2 steps')
        mesh.shard:free(); mesh.replicate:free()
      end)
    end
  end
end)
