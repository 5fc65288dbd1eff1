-- Expert parallelism with tensor and context parallelism (#mpi, 4 and 8
-- ranks; ms.ep.parallelize, ms.tp.parallelize, then ms.cp.apply; docs/moe.md,
-- "Expert, tensor and context parallelism"): TP groups of 2 consecutive
-- ranks, context-parallel pairs of them (rank = (d * 2 + c) * 2 + t), the
-- experts of every MoE layer whole over expert groups of 2 (a TP group:
-- the experts' copies on the other context-parallel rank and the other
-- data-parallel groups) or 4 (both TP groups of a context-parallel pair),
-- with and without sequence parallelism; each context-parallel pair its own
-- sequences, each rank its load-balanced chunks of them; Mixtral-tiny (no
-- load-balancing loss: under --cp it is each rank's tokens') and
-- DeepSeek-V3-tiny (a split shared expert, MLA, group-limited routing
-- with biases, the sequence-wise balance loss, whose counts and score sums
-- are all-reduced over the context-parallel group; also with a
-- multi-token-prediction depth) against one process over the whole
-- sequences, f64:
--   - the mean loss, every gradient (the experts' under their global
--     names, the slices gathered) after ep.all_reduce_grads over the ranks
--     of the same TP index, the gradient norm (ep.clip_grad_norm_);
--   - two clipped AdamW steps, and ep.full_state_dict the one-process model's;
--   - under fsdp.fully_shard over the ranks of the same TP index (FULL_SHARD
--     and SHARD_GRAD_OP): three clipped AdamW steps' losses and norms, and
--     ep.full_checkpoint the one-process model's.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local cp = require 'moonshard.cp'
local FS = require 'spec.fsdp_support'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('expert, tensor and context parallelism #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  if W ~= 4 and W ~= 8 then
    it('runs at 4 and 8 ranks', function() pending(('a world of %d ranks: TP 2 x CP 2 needs 4 or 8'):format(W)) end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local cases = {
    { 'mixtral-tiny', require 'models.mixtral', { num_hidden_layers = 2, output_router_logits = false } },
    { 'deepseek-v3-tiny', require 'models.deepseek_v3', { num_hidden_layers = 2, aux_loss_alpha = 0.01 } },
    { 'deepseek-v3-tiny with MTP', require 'models.deepseek_v3', { num_hidden_layers = 2, aux_loss_alpha = 0.01,
      mtp_loss_weight = 0.3 } },
  }
  local function build(case) return FS.moe_model(case, 'f64') end

  local C, TP = 2, 2
  local D = W / (C * TP)
  local rank = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))   -- (dist.rank() once setup has joined)
  local t, c, d = rank % TP, math.floor(rank / TP) % C, math.floor(rank / (TP * C))
  -- every rank makes every group (a collective each) and keeps its own
  local function mine(lists)
    local kept
    for _, ranks in ipairs(lists) do
      local g = dist.new_group(ranks)
      if g:is_member() then kept = g else g:free() end
    end
    return kept
  end
  local function at(dd, cc, tt) return (dd * C + cc) * TP + tt end

  -- the split model: ep.parallelize over expert groups of M consecutive
  -- ranks (M / 2 TP groups), tp.parallelize over the TP pairs, cp.apply over
  -- the context-parallel pairs -> model, mesh (shard: the TP group,
  -- replicate: the ranks of the same TP index), cp context, groups to free
  local function split(case, M, sp)
    local m = build(case)
    local mesh = dist.mesh { replicate = W / TP, shard = TP }
    local eg, rep
    if M == W then
      eg = dist.world_group
    else
      local gl, rl = {}, {}
      for g = 0, W / M - 1 do
        local r = {}
        for k = 0, M - 1 do r[#r + 1] = g * M + k end
        gl[#gl + 1] = r
      end
      for k = 0, M - 1 do
        local r = {}
        for g = 0, W / M - 1 do r[#r + 1] = g * M + k end
        rl[#rl + 1] = r
      end
      eg, rep = mine(gl), mine(rl)
    end
    ms.ep.parallelize(m, { group = eg, replicate = rep })
    ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = sp })
    local cl = {}
    for dd = 0, D - 1 do
      for tt = 0, TP - 1 do cl[#cl + 1] = { at(dd, 0, tt), at(dd, 1, tt) } end
    end
    local cg = mine(cl)
    local ctx = cp.apply(m, cg)
    return m, mesh, ctx, { cg, eg ~= dist.world_group and eg or nil, rep }
  end
  local function free(mesh, groups)
    for _, g in pairs(groups) do g:free() end
    mesh.shard:free(); mesh.replicate:free()
  end

  -- data-parallel group dd's sequences of a step (each context-parallel
  -- pair's; its ranks take their chunks)
  local function batch(dd, step, B) return FS.lcg_batch(100 * step + dd, B or 2, 12) end
  -- one process: the mean of the data-parallel groups' losses -> the mean
  local function ref_backward(ref, step, B)
    local sum = 0
    for dd = 0, D - 1 do
      local x, y = batch(dd, step, B)
      local l = ref(x, y)
      sum = sum + l:item()
      l = l * (1 / D)
      l:backward()
    end
    return sum / D
  end
  -- this rank's chunks; the gradients reduced -> the loss averaged over the
  -- ranks of this TP index (every sequence's every chunk once)
  local function split_loss(m, ctx, mesh, step, B)
    local x, y = batch(d, step, B)
    return FS.cp_loss(m, ctx, x, y, mesh.replicate)
  end

  local hyper = { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
  local layouts = { { 2, 'a TP group, its copies over the context-parallel pair' },
    { 4, 'the context-parallel pair\'s two TP groups' } }

  for _, case in ipairs(cases) do
    for _, lay in ipairs(layouts) do
      for _, sp in ipairs({ false, true }) do
        local what = ('%s, --tp 2 --ep %d --cp 2 on %d ranks (%s)%s'):format(case[1], lay[1], W, lay[2],
          sp and ', sequence parallel' or '')
        it(what .. ': the loss, every gradient and the norm, two clipped AdamW steps and the whole state are one '
          .. 'process\'s (f64)', function()
          local ref = build(case)
          local ropt = ms.optim.AdamW(ref, hyper)
          local m, mesh, ctx, groups = split(case, lay[1], sp)
          local opt = ms.optim.AdamW(m, hyper)
          local E = ms.nn.moe.layers(ref)[1].n_experts
          -- (each expert whole: E / M of them a rank)
          assert.are.equal(E / lay[1], #ms.nn.moe.layers(m)[1].experts:parameters() / 3)
          for step = 1, 3 do
            local B = step == 1 and 1 or 2
            local lr = ref_backward(ref, step, B)
            local l = split_loss(m, ctx, mesh, step, B)
            ms.ep.all_reduce_grads(m, mesh.replicate)
            assert.is_true(FS.rel(l, lr) <= 1e-12, ('step %d: loss %.17g, one process %.17g'):format(step, l, lr))
            if step == 1 then
              local n, held = FS.same_moe_grads(m, ref, 1e-9, 1e-10)
              assert.are.equal(n, held)
              m:zero_grad(); ref:zero_grad()
            else
              FS.clipped_moe_step(ref, ropt, m, opt, step, 1e-10)
            end
          end
          cp.remove(m)
          FS.same_state(ms.ep.full_state_dict(m), ref:state_dict(), 1e-9)
          free(mesh, groups)
        end)
      end
    end
  end

  -- FSDP x TP x EP x CP: fully_shard over the ranks of the same TP index
  -- (the data-parallel and context-parallel ones): the slices sharded over
  -- them, each layer's experts (a unit of their own) over their copies
  for _, case in ipairs({ cases[1], cases[2] }) do
    for _, lay in ipairs(layouts) do
      for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP' }) do
        local sp = strategy == 'FULL_SHARD'
        local what = ('%s, --tp 2 --ep %d --cp 2 on %d ranks%s, fully_shard %s'):format(case[1], lay[1], W,
          sp and ', sequence parallel' or '', strategy)
        it(what .. ': three clipped AdamW steps of two micro-batches and the whole checkpoint are one process\'s (f64)',
          function()
          local ref = build(case)
          local ropt = ms.optim.AdamW(ref, hyper)
          local m, mesh, ctx, groups = split(case, lay[1], sp)
          local opt = FS.shard_layers(m, mesh.replicate, strategy, hyper)
          FS.moe_unit_sizes(m, W / lay[1], W / TP, #ms.nn.moe.layers(ref))
          for step = 1, 3 do
            -- (two micro-batches of one sequence, the first under no_sync)
            local lr = 0
            for mb = 1, 2 do
              for dd = 0, D - 1 do
                local x, y = batch(dd, 20 + step)
                local l = ref(x:narrow(1, mb, 1):contiguous(), y:narrow(1, mb, 1):contiguous()) * (0.5 / D)
                lr = lr + l:item()
                l:backward()
              end
            end
            local x, y = batch(d, 20 + step)
            local l = 0
            for mb = 1, 2 do
              local function run()
                l = l + FS.cp_loss(m, ctx, x:narrow(1, mb, 1):contiguous(), y:narrow(1, mb, 1):contiguous(),
                  mesh.replicate, 0.5)
              end
              if mb == 1 then ms.fsdp.no_sync(m, run) else run() end
            end
            assert.is_true(FS.rel(l, lr) <= 1e-12, ('step %d: loss %.17g, one process %.17g'):format(step, l, lr))
            FS.clipped_moe_step(ref, ropt, m, opt, step, 1e-10, step == 2)
          end
          FS.same_state((ms.ep.full_checkpoint(m, opt, hyper)), ref:state_dict(), 1e-9)
          free(mesh, groups)
        end)
      end
    end
  end
end)
