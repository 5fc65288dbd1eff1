-- Expert parallelism with tensor parallelism on GPUs over NCCL (#multi:
-- tools/run_multi_specs.sh 2 or 4 on a host with that many GPUs; other
-- worlds are pending). spec/dist_ep_tp_spec.lua (#mpi) holds the exact
-- f32/f64 checks; this file runs ms.ep.parallelize then ms.tp.parallelize
-- with CUDA tensors: TP groups of 2 consecutive ranks, the experts whole
-- over expert groups of 2 (the TP group: --tp 2 --ep 2, 2 GPUs, and with
-- 2 copies of each expert on 4) or 4 (two TP groups: --tp 2 --ep 4, 4
-- GPUs), with and without sequence parallelism. A tiny Mixtral (the
-- load-balancing loss on) and a tiny DeepSeek-V3 (a split shared expert,
-- MLA, group-limited routing with biases, the sequence-wise balance loss)
-- against one process on the same GPU over every TP group's batch:
--   - f32 (autocast off): each group's loss (1e-5), every gradient (the
--     slices gathered, the experts under their global names; 1e-4 each)
--     and the gradient norm (1e-4);
--   - bf16 autocast: the loss (1e-2), the norm (3e-2), every gradient
--     taken together (1e-1: bf16's 8 bits of mantissa, the TP partial
--     sums rounded before they are added, on the CPU ranks DeepSeek-V3's
--     layers 5e-2 off one process's under --tp 2 alone; with room for a
--     token whose nearly tied experts the roundings order differently),
--     and each gradient outside the experts no farther from one process's
--     than --tp 2 alone's on the same mesh, by 1.5 and 2e-2;
--   - under fully_shard FULL_SHARD over the ranks that hold the same slices
--     (FSDP x TP x EP), f32: two clipped AdamW steps' losses (1e-5) and
--     norms (1e-4), and the whole model after them (ep.full_state_dict, on
--     the host; 1e-3).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'

local launched = os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda'

describe('expert and tensor parallelism on GPUs (NCCL) #multi', function()
  if not launched then
    it('runs under the launcher on GPUs (tools/run_multi_specs.sh)', function() pending('not launched with --device cuda') end)
    return
  end
  local W, R = tonumber(os.getenv('WORLD_SIZE')), tonumber(os.getenv('RANK'))
  if W ~= 2 and W ~= 4 then
    it('runs on 2 or 4 GPUs', function()
      pending(('a world of %d GPUs: --tp 2 --ep 2 runs on 2 (or 4: two copies of each expert), --tp 2 --ep 4 on 4')
        :format(W))
    end)
    return
  end
  setup(function() dist.init { timeout = tonumber(os.getenv('MS_MULTI_TIMEOUT') or 300) } end)
  teardown(function() dist.destroy() end)

  local cases = {
    { 'mixtral-tiny', require 'models.mixtral', { num_hidden_layers = 2 } },
    { 'deepseek-v3-tiny', require 'models.deepseek_v3', { num_hidden_layers = 2, aux_loss_alpha = 0.01 } },
  }
  local build = FS.moe_model   -- (case)
  -- { --ep, what } at this world size
  local layouts = W == 2 and { { 2, 'the TP group' } } or { { 2, 'the TP group, 2 copies' }, { 4, 'two TP groups' } }
  local D = W / 2
  -- TP groups of 2 consecutive ranks, expert groups of M: model (on the GPU), mesh
  local function split(case, M, sp)
    local m, mesh = FS.split_ep_tp(build(case), W, M, sp)
    return m:to('cuda'), mesh
  end
  local function batch(d, step)
    local x, y = FS.lcg_batch(100 * step + d, 2, 32)
    return x:cuda(), y:cuda()
  end
  local function run(bf16, fn) if bf16 then return ms.nn.functional.autocast('bf16', fn) end return fn() end
  -- one process: the mean of the TP groups' losses -> each group's loss
  local function ref_backward(ref, step, bf16)
    local ls = {}
    for d = 0, D - 1 do
      local x, y = batch(d, step)
      local l = run(bf16, function() return ref(x, y) end)
      ls[d] = l:item()
      l = l * (1 / D)
      l:backward()
    end
    return ls
  end
  local function split_loss(m, mesh, step, bf16)
    local x, y = batch(mesh.coord[1], step)
    local l = run(bf16, function() return m(x, y) end)
    l:backward()
    return l:item()
  end

  for _, case in ipairs(cases) do
    for _, lay in ipairs(layouts) do
      for _, sp in ipairs({ false, true }) do
        for _, bf16 in ipairs({ false, true }) do
          local what = ('%s, --tp 2 --ep %d (%s)%s, %s'):format(case[1], lay[1], lay[2],
            sp and ', sequence parallel' or '', bf16 and 'bf16 autocast' or 'f32')
          it(what .. ': the loss, every gradient and the norm are one process\'s on the same GPU', function()
            local ref = build(case):to('cuda')
            local m, mesh = split(case, lay[1], sp)
            local ls = ref_backward(ref, 1, bf16)
            -- (bf16: the same layout under tensor parallelism alone, the
            -- experts split by features, every rank routing every token:
            -- the scale of the TP partial sums' bf16 rounding)
            local tpg = {}
            if bf16 then
              local t = build(case)
              ms.tp.parallelize(t, { group = mesh.shard, sequence_parallel = sp })
              t = t:to('cuda')
              split_loss(t, mesh, 1, true)
              ms.tp.all_reduce_grads(t, mesh.replicate, 'avg')
              tpg = ms.tp.full_grads(t)
            end
            local l = split_loss(m, mesh, 1, bf16)
            ms.ep.all_reduce_grads(m, mesh.replicate)
            local lr = ls[mesh.coord[1]]
            assert.is_true(FS.rel(l, lr) <= (bf16 and 1e-2 or 1e-5), ('loss %.9g, one process %.9g'):format(l, lr))
            local full = ms.tp.full_grads(m)
            local n, num, den = 0, 0, 0
            for name, p in ref:named_parameters() do
              local g = full[name]
              if g ~= nil then
                n = n + 1
                local a, b = g:to('f64'), p.grad:to('f64')
                local dd, bb = (a - b):square():sum():item(), b:square():sum():item()
                num, den = num + dd, den + bb
                local e = math.sqrt(dd) / math.max(math.sqrt(bb), 1e-30)
                local expert = name:find('.experts.', 1, true) ~= nil
                if not bf16 then
                  assert.is_true(e <= 1e-4, ('%s: %.3g from one process\'s gradient'):format(name, e))
                elseif not expert then
                  -- (no farther than --tp 2 alone's, by 1.5 and 2e-2: the
                  -- experts' exchange and each rank's routing of its own
                  -- rows lose nothing more)
                  local et = FS.norm_rel(tpg[name], p.grad)
                  assert.is_true(e <= 1.5 * et + 2e-2, ('%s: %.3g from one process\'s gradient, --tp 2 alone\'s '
                    .. '%.3g'):format(name, e, et))
                end
              else
                -- (only the experts held elsewhere are missing)
                assert.is_truthy(name:find('.experts.', 1, true), name)
              end
            end
            assert.is_true(n > 10)
            local all = math.sqrt(num / den)
            assert.is_true(all <= (bf16 and 1e-1 or 1e-4), ('every gradient together: %.3g'):format(all))
            local nm = ms.ep.clip_grad_norm_(m, math.huge)
            local nr = ms.optim.clip_grad_norm(ref, math.huge)
            assert.is_true(FS.rel(nm, nr) <= (bf16 and 3e-2 or 1e-4), ('norm %.9g, one process %.9g'):format(nm, nr))
          end)
        end
      end

      it(('%s, --tp 2 --ep %d (%s), sequence parallel, fully_shard FULL_SHARD: two clipped AdamW steps and the whole '
        .. 'model after them are one process\'s (f32)'):format(case[1], lay[1], lay[2]), function()
        local hyper = { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
        local ref = build(case):to('cuda')
        local ropt = ms.optim.AdamW(ref, hyper)
        local m, mesh = split(case, lay[1], true)
        local opt = FS.shard_layers(m, mesh.replicate, 'FULL_SHARD', hyper)
        for step = 1, 2 do
          local ls = ref_backward(ref, 10 + step, false)
          local l = split_loss(m, mesh, 10 + step, false)
          local lr = ls[mesh.coord[1]]
          assert.is_true(FS.rel(l, lr) <= 1e-5, ('step %d: loss %.9g, one process %.9g'):format(step, l, lr))
          FS.clipped_moe_step(ref, ropt, m, opt, step, 1e-4, step == 2)
        end
        -- (1e-3: AdamW's update of an element whose gradient is near its
        -- eps turns on the gradient's last bits)
        FS.same_state(ms.ep.full_state_dict(m, { host = true }), ref:state_dict(), 1e-3, FS.host_norm_rel,
          ' after 2 steps')
      end)
    end
  end
end)
