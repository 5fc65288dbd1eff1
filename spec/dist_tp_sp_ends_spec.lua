-- Sequence parallelism's two ends on CPU ranks (#mpi, 1-4 ranks; docs/tp.md,
-- "Sequence parallelism"): the vocabulary-parallel embedding's partial sums
-- reduce-scattered to each rank's rows (sp.embed; backward: the rows'
-- gradients all-gathered), and the loss's grad_x left partial by the fused
-- loss and reduce-scattered by the head's gather (sp.gather_for_loss),
-- Megatron-LM's layout, against the layout before (reduce_scatter_ends =
-- false: the embedding all-reduced and split, grad_x all-reduced by the
-- loss and this rank's rows kept). GPT-2 (dropout on, its position
-- embeddings added on the rows, wpe's gradient then a part), a Llama and
-- DeepSeek-V3 with two multi-token-prediction depths (each depth's
-- embedding and loss too), f64:
--   the losses and every local gradient of three clipped AdamW steps equal
--     the old layout's bit for bit (the embedding's sum has one nonzero
--     term a row; grad_x's partial sums add in the same order in Open MPI's
--     reduce-scatter as in its all-reduce at 2-4 ranks, measured; another
--     MPI could order three or four differently), but DeepSeek-V3's
--     embedding with its depths, within 1e-12 (its three lookups'
--     gradients accumulate in another order); and the one-process model's
--     (losses 1e-12, gradients 1e-10, as spec/dist_tp_spec.lua);
--   the TP group's collectives of a step: the old layout's, an all-reduce
--     of S (B·T·C bytes) a loss's embedding and the loss's grad_x all-
--     reduce of S gone, a reduce-scatter of S in their place each (forward,
--     backward), nothing else (GPT-2: its partial-gradient all-reduce
--     carries wpe too, one call as before).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local SU = require 'spec.support'
local dist = require 'moonshard.dist'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

local tp = ms.tp

-- vocabularies of 259 and 257: uneven over 2-4 ranks
local cases = {
  { 'gpt2', require 'models.gpt2', { vocab_size = 259, n_positions = 32, n_embd = 48, n_layer = 2, n_head = 12,
    resid_pdrop = 0.2, embd_pdrop = 0.1, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null }, 0 },
  { 'llama', require 'models.llama', { vocab_size = 257, hidden_size = 48, intermediate_size = 96,
    num_hidden_layers = 2, num_attention_heads = 24, num_key_value_heads = 12, max_position_embeddings = 32 }, 0 },
  { 'deepseek_v3', require 'models.deepseek_v3', { vocab_size = 257, hidden_size = 48, intermediate_size = 96,
    moe_intermediate_size = 24, num_hidden_layers = 2, num_attention_heads = 12, n_shared_experts = 1,
    n_routed_experts = 4, routed_scaling_factor = 1.5, kv_lora_rank = 16, q_lora_rank = 20, qk_rope_head_dim = 4,
    v_head_dim = 6, qk_nope_head_dim = 4, n_group = 2, topk_group = 1, num_experts_per_tok = 2,
    first_k_dense_replace = 1, max_position_embeddings = 32, bos_token_id = hf.null, eos_token_id = hf.null,
    mtp_loss_weight = 0.3, num_nextn_predict_layers = 2 }, 2 },
}
-- (DeepSeek-V3 without the depths: one lookup of the embedding, its
-- gradient the same bits too)
local plain = {}
for k, v in pairs(cases[3][3]) do plain[k] = v end
plain.mtp_loss_weight, plain.num_nextn_predict_layers = nil, nil
table.insert(cases, 3, { 'deepseek_v3 without MTP', cases[3][2], plain, 0 })
local function build(case, device, dtype)
  ms.manual_seed(7)
  local m = case[2].new(case[3])
  if device then m:to(device) end
  return m:to(dtype or 'f64')
end
-- the trace's rows on the world group -> { [kind .. ' ' .. phase] = { calls =, bytes = } }
local function tally(rows) return (SU.tally(rows, dist.get_world_group())) end
local add, same = SU.tally_add, SU.same_tally

-- a step of the split model on (device, dtype of es bytes), sequence
-- parallel, its ends reduce-scattered against all-reduced: the TP group's
-- collectives the old layout's, each end's all-reduce of S a reduce-
-- scatter of S (the embeddings' in the forward, the losses' grad_x in the
-- backward), as many calls
local function check_counts(case, device, dtype, es)
  local B, Tn = 2, 12
  local x, y = FS.lcg_batch(70, B, Tn)
  if device then x, y = x:to(device), y:to(device) end
  local got = {}
  for _, ends in ipairs({ true, false }) do
    local m = tp.parallelize(build(case, device, dtype), { sequence_parallel = true, reduce_scatter_ends = ends })
    m:train()
    ms.manual_seed(5)
    m(x, y):backward()   -- (a first step: whatever is made once)
    m:zero_grad()
    dist.trace(true)
    ms.manual_seed(5)
    local ok, err = pcall(function() m(x, y):backward() end)
    local rows = dist.trace_rows()
    dist.trace(false)
    assert(ok, err)
    got[ends] = tally(rows)
  end
  local C = case[3].n_embd or case[3].hidden_size
  local S = B * Tn * C * es
  local losses = 1 + case[4]   -- (the main loss and each depth's: an embedding and a loss each)
  local want = {}
  for k, e in pairs(got[false]) do want[k] = { calls = e.calls, bytes = e.bytes } end
  add(want, 'all_reduce fwd', -losses, S)                  -- (the embeddings' sums ...)
  add(want, 'reduce_scatter fwd', losses, S)               -- (... reduce-scattered)
  add(want, 'all_reduce (flce: grad_x) fwd', -losses, S)   -- (the losses' grad_x ...)
  add(want, 'reduce_scatter bwd', losses, S)               -- (... reduce-scattered by the gathers)
  if case[1] == 'gpt2' then
    -- (wpe's gradient, a part now, in the one all-reduce of the parts)
    local e = want['all_reduce bwd']
    assert.is_not_nil(e, 'the old layout\'s all-reduce of the parts')
    e.bytes = e.bytes + case[3].n_positions * C * es
  end
  same(want, got[true], case[1])
  -- (and the collectives a step are as many: each end's all-reduce a reduce-scatter)
  local function calls(t) local c = 0 for _, e in pairs(t) do c = c + e.calls end return c end
  assert.are.equal(calls(got[false]), calls(got[true]))
end

describe('sequence parallelism\'s ends reduce-scattered #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  -- (a bound on |a - b| / max|b|: the same bits, but where the depths'
  -- embeddings add their gradients to the main one's in another order, the
  -- graph's nodes being others: rounding, measured <= 4.6e-16 at 2-4 ranks)
  local function bound_of(case) return case[4] == 0 and 0 or 1e-12 end

  for _, case in ipairs(cases) do
    it(case[1] .. ': three clipped AdamW steps (dropout, uneven vocabulary): losses and gradients as the old layout\'s '
      .. 'and one process\'s (f64)', function()
      local bound = bound_of(case)
      local ref = build(case)
      local new = tp.parallelize(build(case), { sequence_parallel = true })
      local old = tp.parallelize(build(case), { sequence_parallel = true, reduce_scatter_ends = false })
      local models = { ref, new, old }
      local opts = {}
      for i, m in ipairs(models) do
        m:train()
        opts[i] = ms.optim.AdamW(m:parameters(), { lr = 1e-2, weight_decay = 0.1 })
      end
      for step = 1, 3 do
        local x, y = FS.lcg_batch(60 + step, 2, 12)   -- (B·T = 24: the rows of 1-4 ranks)
        local l = {}
        for i, m in ipairs(models) do
          ms.manual_seed(100 + step)   -- (the same dropout masks)
          local loss = m(x, y)
          loss:backward()
          l[i] = loss:item()
        end
        assert.is_true(FS.rel(l[2], l[1]) <= 1e-12, ('step %d: %.17g against one process\'s %.17g'):format(step, l[2],
          l[1]))
        assert.is_true(math.abs(l[2] - l[3]) <= bound * math.abs(l[3]), ('step %d: %.17g against the old layout\'s '
          .. '%.17g'):format(step, l[2], l[3]))
        local og = {}
        for name, p in old:named_parameters() do og[name] = p.grad end
        local n = 0
        for name, p in new:named_parameters() do
          assert.is_not_nil(p.grad, name)
          local e = FS.max_rel(p.grad, og[name])
          assert.is_true(e <= bound, ('step %d: %s: %g from the old layout\'s'):format(step, name, e))
          n = n + 1
        end
        assert.is_true(n >= 10)
        if step == 1 then
          local full = tp.full_grads(new)
          for name, p in ref:named_parameters() do
            local e = FS.max_rel(full[name], p.grad)
            assert.is_true(e <= 1e-10, ('%s: %g from one process\'s'):format(name, e))
          end
        end
        local n0 = ms.optim.clip_grad_norm(ref, 0.05)
        for i = 2, 3 do
          local ni = tp.clip_grad_norm_(models[i], 0.05)
          assert.is_true(FS.rel(ni, n0) <= 1e-10, ('step %d: norm %.17g against %.17g'):format(step, ni, n0))
        end
        for _, o in ipairs(opts) do o:step(); o:zero_grad() end
      end
      local sd = tp.full_state_dict(new)
      for name, t in pairs(ref:state_dict()) do
        local e = FS.max_rel(sd[name], t)
        assert.is_true(e <= 1e-9, ('%s after the steps: %g'):format(name, e))
      end
    end)

    it(case[1] .. ': a step\'s collectives are the old layout\'s with each end\'s all-reduce a reduce-scatter', function()
      if W > 1 then check_counts(case, nil, 'f64', 8) end   -- (one rank: no collectives)
    end)
  end

  it('the fused loss\'s grad_x_partial: each rank\'s classes\' part of grad_x, summing to the whole (f64, uneven V)',
    function()
    local flce = require 'moonshard.flce'
    local g = dist.get_world_group()
    local V, BT, H = 11, 6, 8
    local x0 = ms.randn({ BT, H }, { dtype = 'f64', seed = 1 })
    local Wf = ms.randn({ V, H }, { dtype = 'f64', seed = 2 })
    local t = ms.tensor({ 0, 3, 10, 5, 7, 1 }, { dtype = 'i64' })
    local a, n = flce.vocab_shard(V, g:rank(), g:size())
    local grads = {}
    for _, part in ipairs({ false, true }) do
      local x = x0:clone()
      x.requires_grad = true
      local w = n > 0 and Wf:narrow(1, a + 1, n):contiguous() or ms.zeros({ 0, H }, { dtype = 'f64' })
      local loss = ms.nn.functional.fused_linear_cross_entropy(x, w, t, { group = g, vocab_size = V,
        grad_x_partial = part })
      loss:backward()
      grads[part] = x.grad
    end
    -- the parts summed over the group: the whole (the same two collectives' sums)
    local s = grads[true]:clone()
    dist.all_reduce(s, 'sum', { group = g })
    assert.are.equal(0, FS.max_rel(s, grads[false]))
    -- and at 2 ranks or more a part is not the whole
    if W > 1 then assert.is_true(FS.max_rel(grads[true], grads[false]) > 1e-3) end
  end)

  it('bad options are errors that name them', function()
    local m = build(cases[2])
    local ok, err = pcall(tp.parallelize, m, { sequence_parallel = true, reduce_scatter_ends = 'yes' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('reduce_scatter_ends must be a boolean, got string', 1, true))
    local x = ms.randn({ 4, 8 }, { dtype = 'f64' })
    local w = ms.randn({ 5, 8 }, { dtype = 'f64' })
    local t = ms.tensor({ 0, 1, 2, 3 }, { dtype = 'i64' })
    ok, err = pcall(ms.nn.functional.fused_linear_cross_entropy, x, w, t, { grad_x_partial = true })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('grad_x_partial needs the vocabulary-parallel mode', 1, true))
    ok, err = pcall(ms.nn.functional.fused_linear_cross_entropy, x, w, t, { grad_x_partial = 1 })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('grad_x_partial must be a boolean, got number', 1, true))
  end)
end)

-- the same on GPUs (NCCL), f32: the two layouts' losses and gradients of
-- three AdamW steps within f32 rounding (NCCL may sum a reduce-scatter's
-- parts in another order than an all-reduce's: 1e-6 on the losses, 1e-5 on
-- a gradient, relative), and a step's collectives as on the CPU
describe('sequence parallelism\'s ends reduce-scattered over NCCL #multi', function()
  if not (os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda') then
    it('runs under the launcher with one GPU per rank', function() pending('not launched on GPUs') end)
    return
  end
  setup(function() dist.init { backend = 'nccl', timeout = 60 } end)
  teardown(function() dist.destroy() end)
  for _, case in ipairs(cases) do
    it(case[1] .. ', f32: three AdamW steps as the old layout\'s; a step\'s collectives', function()
      local W = dist.world_size()   -- (once setup has initialised dist)
      local new = tp.parallelize(build(case, 'cuda', 'f32'), { sequence_parallel = true })
      local old = tp.parallelize(build(case, 'cuda', 'f32'), { sequence_parallel = true, reduce_scatter_ends = false })
      local o1 = ms.optim.AdamW(new:parameters(), { lr = 1e-3 })
      local o2 = ms.optim.AdamW(old:parameters(), { lr = 1e-3 })
      new:train(); old:train()
      for step = 1, 3 do
        local x, y = FS.lcg_batch(80 + step, 2, 32)
        x, y = x:to('cuda'), y:to('cuda')
        ms.manual_seed(200 + step)
        local l1 = new(x, y); l1:backward()
        ms.manual_seed(200 + step)
        local l2 = old(x, y); l2:backward()
        assert.is_true(FS.rel(l1:item(), l2:item()) <= 1e-6, ('step %d: %.9g against %.9g'):format(step, l1:item(),
          l2:item()))
        local og = {}
        for name, p in old:named_parameters() do og[name] = p.grad end
        for name, p in new:named_parameters() do
          local e = FS.max_rel(p.grad:to('cpu'), og[name]:to('cpu'))
          assert.is_true(e <= 1e-5, ('step %d: %s: %g'):format(step, name, e))
        end
        o1:step(); o1:zero_grad()
        o2:step(); o2:zero_grad()
      end
      if W > 1 then check_counts(case, 'cuda', 'f32', 4) end
    end)
  end
end)
