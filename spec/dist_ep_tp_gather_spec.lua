-- Expert and tensor parallelism's routing gathers, counted (#mpi, 2 and 4
-- ranks; docs/moe.md, "Expert and tensor parallelism"): MoE:forward_ep_tp
-- all-gathers the TP group's router scores (N·E f32) and chosen experts
-- (N·k i64), two all-gathers a MoE layer a forward, only when the forward
-- has a reader of them (MoE:reads_routing). dist.trace over one step
-- (forward, backward, ep.all_reduce_grads) of a model split by
-- ep.parallelize then tp.parallelize (TP groups of 2, --ep 2, and --ep 4
-- at 4 ranks; with and without sequence parallelism), f32, in three runs:
--   - no reader (Mixtral without output_router_logits, DeepSeek-V3 with
--     aux_loss_alpha = 0 and its routing biases): the TP group's
--     all-gathers are those of the run with the gathers (nn.moe.keep_stats)
--     less exactly two a MoE layer and their N·E·4 + N·k·8 bytes; a
--     multi-token-prediction depth's layer keeps its two (its bias counts
--     read the ids, its filler positions left out); the loss and every
--     gradient are bit for bit the run's with the gathers, and one
--     process's; the routing-bias counts are one process's; last_stats,
--     moe.aux_loss and moe.seq_aux_loss refuse the forward, naming
--     keep_stats, whose run's last_stats are one process's;
--   - a balance loss on (output_router_logits, aux_loss_alpha > 0): the
--     same all-gathers as the run with keep_stats.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local FS = require 'spec.fsdp_support'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('expert and tensor parallelism\'s routing gathers, counted #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local D = W / 2
  local moe = ms.nn.moe
  -- { name, module, config without a balance loss, the same with one }
  local cases = {
    { 'mixtral-tiny', require 'models.mixtral', { num_hidden_layers = 2, output_router_logits = false },
      { output_router_logits = true } },
    { 'deepseek-v3-tiny', require 'models.deepseek_v3', { num_hidden_layers = 2, aux_loss_alpha = 0 },
      { aux_loss_alpha = 0.01 } },
    { 'deepseek-v3-tiny with MTP', require 'models.deepseek_v3', { num_hidden_layers = 2, aux_loss_alpha = 0,
      mtp_loss_weight = 0.3 }, { aux_loss_alpha = 0.01 } },
  }
  local function build(case, on)
    ms.manual_seed(7)
    local cfg = {}
    for k, v in pairs(case[3]) do cfg[k] = v end
    if on then for k, v in pairs(case[4]) do cfg[k] = v end end
    local m = case[2].new('tiny', cfg)
    -- (routing biases that choose differently from zeros)
    for _, l in ipairs(moe.layers(m)) do
      local b = l:routing_bias()
      if b then b:copy_(ms.randn(b.shape, { seed = 4 }):to(b.dtype) * 0.01) end
    end
    return m
  end
  local function layouts()
    if W == 2 then return { 2 } end
    if W == 4 then return { 2, 4 } end
    return {}
  end
  local function split(case, on, M, sp)
    local m = build(case, on)
    return FS.split_ep_tp(m, W, M, sp)
  end
  local B, Tn = 2, 12
  local function batch(d) return FS.lcg_batch(100 + d, B, Tn) end

  -- one traced step of the split model -> its loss, the TP group's
  -- all-gathers { calls, bytes }
  local function step(m, mesh)
    local x, y = batch(mesh.coord[1])
    dist.trace(true)
    local l = m(x, y)
    l:backward()
    ms.ep.all_reduce_grads(m, mesh.replicate)
    local rows = dist.trace_rows()
    dist.trace(false)
    local key = table.concat(mesh.shard:ranks(), ',')
    local ag = { calls = 0, bytes = 0 }
    for _, r in ipairs(rows) do
      if r.kind == 'all_gather' and r.ranks == key then
        ag.calls, ag.bytes = ag.calls + r.calls, ag.bytes + r.calls * r.bytes
      end
    end
    return l:item(), ag
  end

  for _, case in ipairs(cases) do
    for _, M in ipairs(layouts()) do
      for _, sp in ipairs({ false, true }) do
        local what = ('%s, --tp 2 --ep %d%s'):format(case[1], M, sp and ', sequence parallel' or '')
        it(what .. ': no reader, two all-gathers a MoE layer fewer, the same loss and gradients; a balance loss '
          .. 'keeps them', function()
          local skip, mesh = split(case, false, M, sp)
          local ls, as = step(skip, mesh)
          -- one process over every TP group's batch (the gradients averaged)
          local ref = build(case, false)
          local lr
          for d = 0, D - 1 do
            local x, y = batch(d)
            local l = ref(x, y)
            if d == mesh.coord[1] then lr = l:item() end
            l = l * (1 / D)
            l:backward()
          end
          local keep = split(case, false, M, sp)
          assert.are.equal(#moe.layers(keep), moe.keep_stats(moe.layers(keep), true))
          local lk, ak = step(keep, mesh)
          local on = split(case, true, M, sp)
          local _, ao = step(on, mesh)

          -- the all-gathers: the gathered layers' two fewer without a reader
          local N, drop, bytes = B * Tn, 0, 0
          for _, l in ipairs(moe.layers(skip)) do
            if rawget(l, '_pad') == nil then
              drop, bytes = drop + 2, bytes + N * l.n_experts * 4 + N * l.top_k * 8
            end
          end
          assert.is_true(drop >= 2)
          assert.are.equal(ak.calls - drop, as.calls, 'the all-gathers without a reader')
          assert.are.equal(ak.bytes - bytes, as.bytes, 'their bytes')
          assert.are.same(ak, ao, 'a balance loss keeps the gathers')

          -- the loss and the gradients: the run's with the gathers, bit for bit, and one process's
          assert.are.equal(lk, ls)
          assert.is_true(FS.rel(ls, lr) <= 1e-6, ('loss %.9g, one process %.9g'):format(ls, lr))
          local gs, gk = ms.tp.full_grads(skip), ms.tp.full_grads(keep)
          local n = 0
          for name, p in ref:named_parameters() do
            local g = gs[name]
            if g ~= nil then
              n = n + 1
              assert.are.equal(0, FS.max_rel(g, gk[name]), name)
              local e = FS.norm_rel(g, p.grad)
              assert.is_true(e <= 1e-5, ('%s: %.3g from one process\'s gradient'):format(name, e))
            else
              assert.is_truthy(name:find('.experts.', 1, true), name)
            end
          end
          assert.is_true(n > 0)

          -- the routing-bias counts: one process's over the group's batch
          local x, y = batch(mesh.coord[1])
          moe.reset_counts(ref)
          ref(x, y)
          local lr_ = moe.layers(ref)
          for k, l in ipairs(moe.layers(skip)) do
            if l:routing_bias() ~= nil then
              assert.are.same(lr_[k]:routing_counts(), l:routing_counts(), ('layer %d\'s counts'):format(k))
              assert.are.same(moe.layers(keep)[k]:routing_counts(), l:routing_counts())
            end
          end

          -- the statistics: refused without the gathers, one process's with
          local sl = moe.layers(skip)
          local ok, err = pcall(sl[1].last_stats, sl[1])
          assert.is_false(ok)
          assert.matches('MoE:last_stats: the last forward ran under expert and tensor parallelism with no balance '
            .. 'loss reading its router scores, which were not gathered over the tensor-parallel group: call '
            .. 'nn.moe.keep_stats(layers, true) before the forward', tostring(err), 1, true)
          ok, err = pcall(moe.aux_loss, sl)
          assert.is_false(ok)
          assert.matches('moe.aux_loss: the last forward ran under expert', tostring(err), 1, true)
          ok, err = pcall(moe.seq_aux_loss, sl, 0.01)
          assert.is_false(ok)
          assert.matches('moe.seq_aux_loss: the last forward ran under expert', tostring(err), 1, true)
          ms.autograd.no_grad(function() ref(x, y) end)
          for k, l in ipairs(moe.layers(keep)) do
            if rawget(l, '_pad') == nil then
              local c, p, nt = lr_[k]:last_stats()
              local ck, pk, ntk = l:last_stats()
              assert.are.same(c, ck)
              assert.are.equal(nt, ntk)
              assert.is_true(FS.max_rel(pk, p) <= 1e-6, 'the mean scores')
            end
          end
        end)
      end
    end
  end

  it('keep_stats refuses bad input', function()
    local ok, err = pcall(moe.keep_stats, {}, 1)
    assert.is_false(ok)
    assert.matches('moe.keep_stats: on must be a boolean, got 1', tostring(err), 1, true)
    ok, err = pcall(moe.keep_stats, 'x', true)
    assert.is_false(ok)
    assert.matches('moe.keep_stats: layers must be a list of MoE layers, got string', tostring(err), 1, true)
    ok, err = pcall(moe.keep_stats, { {} }, true)
    assert.is_false(ok)
    assert.matches('moe.keep_stats: layers[1] is not an MoE layer', tostring(err), 1, true)
  end)
end)
