-- Multi-token prediction split over CPU ranks (#mpi, 1-4 ranks;
-- models/deepseek_v3.lua's MTP depths, GLM-4.5's through with_mtp): under
-- tensor parallelism (with and without sequence parallelism), context
-- parallelism, both (2 x 2), and pipelines of 2 stages (data parallel
-- across them at 4 ranks), in f64 against one process on the whole
-- batch: the loss, each depth's loss (model:mtp_losses()), every gradient,
-- the routing biases' counts of every MoE layer (the depths' filler
-- positions left out) and, for DeepSeek-V3, the sequence-wise balance
-- loss of every MoE layer, the depths' included; under tensor parallelism
-- two clipped AdamW steps with the routing biases moved, as one process.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local hf = require 'models.hf'
local FS = require 'spec.fsdp_support'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('multi-token prediction, split #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local tp, cp = ms.tp, ms.cp

  -- 12 heads, experts of 24 hidden features: split over 1-4 ranks; the
  -- MTP depths' blocks are MoE layers (first_k_dense_replace 1)
  local cases = {
    { 'deepseek_v3', require 'models.deepseek_v3', { vocab_size = 257, hidden_size = 48, intermediate_size = 96,
      moe_intermediate_size = 24, num_hidden_layers = 2, num_attention_heads = 12, n_shared_experts = 1,
      n_routed_experts = 4, routed_scaling_factor = 1.5, kv_lora_rank = 16, q_lora_rank = 20, qk_rope_head_dim = 4,
      v_head_dim = 6, qk_nope_head_dim = 4, n_group = 2, topk_group = 1, num_experts_per_tok = 2,
      first_k_dense_replace = 1, max_position_embeddings = 32, bos_token_id = hf.null, eos_token_id = hf.null,
      mtp_loss_weight = 0.3, num_nextn_predict_layers = 2, aux_loss_alpha = 0.05 } },
    { 'glm4_moe', require 'models.glm4_moe', { vocab_size = 257, hidden_size = 48, intermediate_size = 96,
      moe_intermediate_size = 24, num_hidden_layers = 2, num_attention_heads = 12, num_key_value_heads = 12,
      head_dim = 8, n_routed_experts = 4, n_group = 2, topk_group = 1, num_experts_per_tok = 2,
      routed_scaling_factor = 1.5, use_qk_norm = true, max_position_embeddings = 32,
      mtp_loss_weight = 0.3, num_nextn_predict_layers = 1 } },
  }
  local function build(case)
    ms.manual_seed(7)
    local m = case[2].new(case[3]):to('f64')
    -- (routing biases that choose differently from zero)
    for _, l in ipairs(ms.nn.moe.layers(m)) do
      local b = l:routing_bias()
      if b then b:copy_(ms.randn(b.shape, { seed = 4 }):to(b.dtype) * 0.01) end
    end
    m:train()
    return m
  end
  local Tn = 16   -- (a multiple of 2 N for N = 1, 2, 4; B·T of 2 N for N = 3 too)

  -- the reference: one process, the whole batch
  local function reference(case, seed)
    local ref = build(case)
    local x, y = FS.lcg_batch(seed, 2, Tn)
    local l0 = ref(x, y)
    l0:backward()
    local d0 = {}
    for k, v in ipairs(ref:mtp_losses()) do d0[k] = v:item() end
    assert.are.equal(case[3].num_nextn_predict_layers, #d0)
    return ref, x, y, l0:item(), d0
  end

  -- every MoE layer's routing-bias counts (summed over `group`, nil: as
  -- they are) against the reference's
  local function same_counts(ref, m, group, what)
    local lr, lm = ms.nn.moe.layers(ref), ms.nn.moe.layers(m)
    assert.are.equal(#lr, #lm)
    for i = 1, #lr do
      local a, b = lr[i]:routing_counts(), lm[i]:routing_counts()
      assert.is_not_nil(b, what)
      local t = ms.tensor(b, { dtype = 'f64' })
      if group then dist.all_reduce(t, 'sum', { group = group }) end
      assert.are.same(a, t:totable(), ('%s: layer %d\'s counts'):format(what, i))
    end
  end

  local function same_depths(d0, m, what)
    local d1 = m:mtp_losses()
    assert.are.equal(#d0, #d1)
    for k = 1, #d0 do
      assert.is_true(FS.rel(d1[k]:item(), d0[k]) <= 1e-12, ('%s: depth %d: %.17g against %.17g'):format(what, k,
        d1[k]:item(), d0[k]))
    end
  end

  for _, case in ipairs(cases) do
    for _, sp in ipairs({ false, true }) do
      it(('%s, tensor parallel%s: the loss, each depth\'s, every gradient and the routing counts are one '
        .. 'process\'s (f64); the head vocabulary-parallel'):format(case[1], sp and ', sequence parallel' or ''),
        function()
        local what = case[1] .. (sp and ' sp' or '')
        local ref, x, y, l0, d0 = reference(case, 3)
        local m = tp.parallelize(build(case), { sequence_parallel = sp })
        local l1 = m(x, y)
        l1:backward()
        assert.is_true(FS.rel(l1:item(), l0) <= 1e-12, ('%s: %.17g against %.17g'):format(what, l1:item(), l0))
        same_depths(d0, m, what)
        local full = tp.full_grads(m)
        local n = 0
        for name, p in ref:named_parameters() do
          assert.is_not_nil(full[name], what .. ' ' .. name)
          local e = FS.max_rel(full[name], p.grad)
          assert.is_true(e <= 1e-10, ('%s: %s: %g'):format(what, name, e))
          n = n + 1
        end
        assert.is_true(n >= 40)
        same_counts(ref, m, nil, what)
        -- two clipped AdamW steps (eh_proj's whole gradient counted once in
        -- the norm), then the routing biases moved by the counts
        local o0 = ms.optim.AdamW(ref:parameters(), { lr = 1e-2 })
        local o1 = ms.optim.AdamW(m:parameters(), { lr = 1e-2 })
        for step = 1, 2 do
          if step > 1 then
            local a, b = FS.lcg_batch(3 + step, 2, Tn)
            ref(a, b):backward(); m(a, b):backward()
          end
          local n0, n1 = ms.optim.clip_grad_norm(ref, 0.05), tp.clip_grad_norm_(m, 0.05)
          assert.is_true(FS.rel(n1, n0) <= 1e-10, ('%s: norm %.17g against %.17g'):format(what, n1, n0))
          o0:step(); o0:zero_grad(); o1:step(); o1:zero_grad()
          ms.nn.moe.update_bias(ref, 0.01); ms.nn.moe.update_bias(m, 0.01)
        end
        local a, b = FS.lcg_batch(9, 2, Tn)
        local la, lb = ref(a, b):item(), m(a, b):item()
        assert.is_true(FS.rel(lb, la) <= 1e-10, ('%s: after the steps %.17g against %.17g'):format(what, lb, la))
        if W > 1 then
          -- the depths' blocks split as the decoder's: heads, experts' hidden
          -- features; the head by vocabulary rows; eh_proj whole
          local L = m.model.mtp_layers[1]
          assert.are.equal(case[3].moe_intermediate_size / W, L.mlp.experts[1].gate_proj.weight.shape[1])
          assert.is_true(m.lm_head.weight.shape[1] < case[3].vocab_size)
          assert.are.same({ 48, 96 }, L.eh_proj.weight.shape)
          assert.is_nil(tp.placement(m, 'model.mtp_layers.0.eh_proj.weight'))
        end
      end)
    end

    for _, lb in ipairs({ true, false }) do
      it(('%s, context parallel (%s): the mean loss, each depth\'s (the whole batch\'s on every rank), the '
        .. 'averaged gradients and the summed routing counts are one process\'s (f64)'):format(case[1],
        lb and 'load-balanced' or 'contiguous'), function()
        if 2 * W > Tn or Tn % (2 * W) ~= 0 then pending('16 tokens do not split into 2 x ' .. W .. ' chunks') return end
        local ref, x, y, l0, d0 = reference(case, 5)
        local m = build(case)
        local ctx = cp.apply(m, nil, { load_balance = lb })
        local l = m(cp.shard(x, ctx), cp.shard(y, ctx))
        l:backward()
        local lt = l:detach():clone()
        dist.all_reduce(lt, 'avg')
        assert.is_true(FS.rel(lt:item(), l0) <= 1e-12, ('%.17g against %.17g'):format(lt:item(), l0))
        same_depths(d0, m, case[1] .. ' cp')
        local mine = {}
        for name, p in m:named_parameters() do mine[name] = p end
        for name, p in ref:named_parameters() do
          local g = mine[name].grad:clone()
          dist.all_reduce(g, 'avg')
          local e = FS.max_rel(g, p.grad)
          assert.is_true(e <= 1e-10, ('cp: %s: %g'):format(name, e))
        end
        same_counts(ref, m, dist.get_world_group(), case[1] .. ' cp')
        cp.remove(m)
      end)
    end
  end

  for _, case in ipairs(cases) do
    it(('%s, pipeline of 2 stages (the depths on the last, a copy of the embedding there), data parallel across '
      .. 'the pipelines: the loss, each depth\'s (the whole batch\'s), every gradient and the routing counts are one '
      .. 'process\'s, and two clipped AdamW steps keep the embedding\'s copies equal (f64)'):format(case[1]), function()
      if W % 2 ~= 0 then pending('pipelines of 2 stages need an even number of ranks') return end
      if W > 4 then pending('the batch of 2 sequences feeds at most 2 pipelines') return end
      local what = case[1] .. ' pp'
      local ref, x, y, l0, d0 = reference(case, 11)
      local m = build(case)
      local mesh = dist.mesh { replicate = W / 2, shard = 2 }
      local P = W / 2                          -- pipelines, each a sequence of the batch (W = 4) or both (W = 2)
      local d = mesh.coord[1]
      local rows = 2 / P
      local function mine(t) return t:narrow(1, d * rows + 1, rows):contiguous() end
      local pipe = ms.pp.pipeline(m, { group = mesh.shard, microbatches = rows })
      -- the depths and the final norm on the last stage, the embedding on both
      local held = {}
      for name in m:named_parameters() do held[name] = true end
      assert.is_truthy(held['model.embed_tokens.weight'])
      assert.are.equal(pipe.last, held['model.mtp_layers.0.eh_proj.weight'] == true)
      assert.are.equal(pipe.last, held['model.norm.weight'] == true)
      assert.are.equal(1, #pipe.tied)
      local l = pipe:step(mine(x), mine(y))
      dist.all_reduce(l, 'avg', { group = mesh.replicate })
      assert.is_true(FS.rel(l:item(), l0) <= 1e-12, ('%s: %.17g against %.17g'):format(what, l:item(), l0))
      -- each depth's loss, on every stage, averaged over the pipelines: the batch's
      local dm = pipe:mtp_losses()
      assert.are.equal(#d0, #dm)
      local t = ms.tensor(dm, { dtype = 'f64' })
      dist.all_reduce(t, 'avg', { group = mesh.replicate })
      for k, v in ipairs(t:totable()) do
        assert.is_true(FS.rel(v, d0[k]) <= 1e-12, ('%s: depth %d: %.17g against %.17g'):format(what, k, v, d0[k]))
      end
      ms.tp.all_reduce_grads(m, mesh.replicate, 'avg')
      local ok_grad = 0
      local refp = {}
      for name, p in ref:named_parameters() do refp[name] = p end
      for name, p in m:named_parameters() do
        local e = FS.max_rel(p.grad, refp[name].grad)
        assert.is_true(e <= 1e-10, ('%s: %s: %g'):format(what, name, e))
        ok_grad = ok_grad + 1
      end
      assert.is_true(ok_grad >= 10)
      -- the held MoE layers' counts, summed over the pipelines
      local lr, lm = ms.nn.moe.layers(ref), ms.nn.moe.layers(m)
      local counted = 0
      for i = 1, #lr do
        local b = lm[i]:routing_counts()
        if b then
          local c = ms.tensor(b, { dtype = 'f64' })
          dist.all_reduce(c, 'sum', { group = mesh.replicate })
          assert.are.same(lr[i]:routing_counts(), c:totable(), ('%s: layer %d\'s counts'):format(what, i))
          counted = counted + 1
        end
      end
      -- (the first stage's layer is dense: first_k_dense_replace 1)
      if pipe.last then assert.is_true(counted >= 1, what .. ': no MoE layer counted on the last stage') end
      -- two clipped AdamW steps, the routing biases moved: the same model
      local o0 = ms.optim.AdamW(ref:parameters(), { lr = 1e-2 })
      local o1 = ms.optim.AdamW(m:parameters(), { lr = 1e-2 })
      for step = 1, 2 do
        if step > 1 then
          local a, b = FS.lcg_batch(11 + step, 2, Tn)
          ref(a, b):backward()
          pipe:step(mine(a), mine(b)):free()
          ms.tp.all_reduce_grads(m, mesh.replicate, 'avg')
        end
        local n0, n1 = ms.optim.clip_grad_norm(ref, 0.05), ms.pp.clip_grad_norm_(m, 0.05)
        assert.is_true(FS.rel(n1, n0) <= 1e-10, ('%s: norm %.17g against %.17g'):format(what, n1, n0))
        o0:step(); o0:zero_grad(); o1:step(); o1:zero_grad()
        ms.nn.moe.update_bias(ref, 0.01); ms.nn.moe.update_bias(m, 0.01, mesh.replicate)
      end
      local a, b = FS.lcg_batch(19, 2, Tn)
      local la = ref(a, b):item()
      local lb = pipe:evaluate(mine(a), mine(b))
      dist.all_reduce(lb, 'avg', { group = mesh.replicate })
      assert.is_true(FS.rel(lb:item(), la) <= 1e-10, ('%s: after the steps %.17g against %.17g'):format(what,
        lb:item(), la))
      -- the first stage's embedding and the last's copy: bit for bit
      local e = m.model.embed_tokens.weight
      local hi = e:clone()
      dist.all_reduce(hi, 'max', { group = mesh.shard })
      local lo = e:clone()
      dist.all_reduce(lo, 'min', { group = mesh.shard })
      assert.are.equal(0, (hi - lo):abs():max():item(), what .. ': the embedding\'s copies differ')
      pipe:free()
      mesh.shard:free(); mesh.replicate:free()
    end)
  end

  it('deepseek_v3 with tensor and context parallelism (2 x 2: TP pairs, CP across them, with and without '
    .. 'sequence parallelism): the loss, each depth\'s and every gradient (f64)', function()
    if W ~= 4 then pending('needs 4 ranks') return end
    local case = cases[1]
    local mesh = dist.mesh { replicate = 2, shard = 2 }
    for _, sp in ipairs({ false, true }) do
      local ref, x, y, l0, d0 = reference(case, 9)
      local m = tp.parallelize(build(case), { group = mesh.shard, sequence_parallel = sp })
      local ctx = cp.apply(m, mesh.replicate)
      local l = m(cp.shard(x, ctx), cp.shard(y, ctx))
      l:backward()
      tp.all_reduce_grads(m, mesh.replicate, 'avg')
      local lt = l:detach():clone()
      dist.all_reduce(lt, 'avg', { group = mesh.replicate })
      assert.is_true(FS.rel(lt:item(), l0) <= 1e-12)
      same_depths(d0, m, 'tp x cp')
      local full = tp.full_grads(m)
      for name, p in ref:named_parameters() do
        local e = FS.max_rel(full[name], p.grad)
        assert.is_true(e <= 1e-10, ('sp=%s %s %g'):format(tostring(sp), name, e))
      end
      same_counts(ref, m, mesh.replicate, 'tp x cp')
    end
    mesh.shard:free(); mesh.replicate:free()
  end)
end)
