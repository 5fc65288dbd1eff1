-- Sequence parallelism under fully_shard (#mpi, 2 and 4 CPU ranks): a
-- model split by ms.tp.parallelize with sequence_parallel over the mesh's
-- shard axis and sharded by fully_shard over its replicate axis (FSDP x
-- TP, "2-D") trains as one process does, in f64: the losses, every
-- gradient taken from the units' shards, clipped AdamW steps and the
-- weights after them (GPT-2, Llama, Qwen3's q/k norms, DeepSeek-V3's
-- latent attention); with FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, and
-- with two micro-batches accumulated under no_sync. The norms' and the
-- row-parallel biases' gradients are each TP rank's tokens' part, which
-- the units sum over the TP group before their own reduction.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('sequence parallelism with fully_shard #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  if W < 2 then
    it('needs two or more ranks', function() pending('one rank: no TP group to split over') end)
    return
  end
  local tp, fsdp = ms.tp, ms.fsdp

  local cases = {
    { 'gpt2', require 'models.gpt2', 'GPT2Block', { vocab_size = 259, n_positions = 32, n_embd = 48, n_layer = 2,
      n_head = 12, resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null,
      eos_token_id = hf.null } },
    { 'llama', require 'models.llama', 'LlamaDecoderLayer', { vocab_size = 257, hidden_size = 48,
      intermediate_size = 96, num_hidden_layers = 2, num_attention_heads = 24, num_key_value_heads = 12,
      max_position_embeddings = 32 } },
    -- (per-head q/k norms: each rank norms its heads, on its rows)
    { 'qwen3', require 'models.qwen3', 'LlamaDecoderLayer', { vocab_size = 257, hidden_size = 48,
      intermediate_size = 96, num_hidden_layers = 2, num_attention_heads = 24, num_key_value_heads = 12, head_dim = 8,
      max_position_embeddings = 32 } },
    -- (latent attention with q_lora_rank: its latent layers run on this
    -- rank's rows, their weights' gradients parts too)
    { 'deepseek_v3', require 'models.deepseek_v3', 'LlamaDecoderLayer', { vocab_size = 257, hidden_size = 48,
      intermediate_size = 96, moe_intermediate_size = 24, num_hidden_layers = 2, num_attention_heads = 12,
      n_shared_experts = 1, n_routed_experts = 4, routed_scaling_factor = 1.5, kv_lora_rank = 16, q_lora_rank = 20,
      qk_rope_head_dim = 4, v_head_dim = 6, qk_nope_head_dim = 4, n_group = 2, topk_group = 1,
      num_experts_per_tok = 2, first_k_dense_replace = 1, max_position_embeddings = 32, bos_token_id = hf.null,
      eos_token_id = hf.null } },
  }
  local function build(case, seed)
    ms.manual_seed(seed or 7)
    local m = case[2].new(case[4])
    m:to('f64')
    return m
  end

  -- the layouts of the world: TP 2 over FSDP W / 2, and TP W alone
  local layouts = {}
  if W % 2 == 0 then layouts[#layouts + 1] = { W / 2, 2 } end
  if W > 2 and 12 % W == 0 then layouts[#layouts + 1] = { 1, W } end

  -- name -> this rank's gradient (its TP piece), from the units' shards
  local function shard_grads(m)
    local out = {}
    for _, u in ipairs(fsdp.units(m)) do
      local fp = u.fp
      local g = fp.shard.grad
      assert.is_not_nil(g, u.label)
      local full = g
      if g:numel() ~= fp.total then
        full = ms.empty({ fp.total }, { dtype = g.dtype })
        dist.all_gather_into(full, g, { group = fp.group })
      end
      for k, v in ipairs(fp:views(full)) do out[u.param_names[k]] = v end
    end
    return out
  end

  -- the reference's gradients, this rank's pieces, against the shards'
  local function same_grads(ref, m, what)
    local got = shard_grads(m)
    local n = 0
    for name, p in ref:named_parameters() do
      local g = got[name]
      assert.is_not_nil(g, what .. name)
      local want = tp.local_piece(m, name, p.grad)
      local e = FS.max_rel(g:view(want.shape), want)
      assert.is_true(e <= 1e-10, ('%s%s: %g'):format(what, name, e))
      n = n + 1
    end
    assert.is_true(n >= 10)
  end

  for _, case in ipairs(cases) do
    for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }) do
      it(('%s, %s: losses, gradients and clipped AdamW steps are one process\'s (f64)'):format(case[1], strategy),
        function()
        for _, rs in ipairs(layouts) do
          local R, S = rs[1], rs[2]
          local what = ('%s %s, FSDP %d x TP %d: '):format(case[1], strategy, R, S)
          local mesh = dist.mesh { replicate = R, shard = S }
          local ref = build(case)
          local m = tp.parallelize(build(case), { group = mesh.shard, sequence_parallel = true })
          fsdp.fully_shard(m, { policy = fsdp.policy.by_class { case[3] }, group = mesh.replicate,
            strategy = strategy })
          local o0 = ms.optim.AdamW(ref, { lr = 1e-2, weight_decay = 0.1 })
          local o1 = fsdp.AdamW(m, { lr = 1e-2, weight_decay = 0.1 })
          local r = mesh.coord[1]
          for step = 1, 3 do
            -- two micro-batches of 2 sequences a data-parallel rank, the
            -- first under no_sync (its gradient kept unsharded)
            local x, y = FS.lcg_batch(70 + step, 4 * R, 12)
            local l0 = ref(x, y); l0:backward()
            local sum = 0
            for mb = 0, 1 do
              local a = 4 * r + 2 * mb + 1
              local xl, yl = x:narrow(1, a, 2):contiguous(), y:narrow(1, a, 2):contiguous()
              local function run()
                local l = m(xl, yl) * 0.5
                l:backward()
                sum = sum + l:item()
              end
              if mb == 0 then fsdp.no_sync(m, run) else run() end
            end
            local lt = ms.tensor({ sum }, { dtype = 'f64' })
            dist.all_reduce(lt, 'avg', { group = mesh.replicate })
            assert.is_true(FS.rel(lt:item(), l0:item()) <= 1e-10, ('%sstep %d: %.17g against %.17g'):format(what,
              step, lt:item(), l0:item()))
            if step == 1 then same_grads(ref, m, what) end
            local n0 = ms.optim.clip_grad_norm(ref, 0.05)
            local n1 = tp.clip_grad_norm_(m, 0.05, { defer = step == 2 and o1 or nil })
            assert.is_true(n0 > 0.05)
            assert.is_true(FS.rel(n1, n0) <= 1e-10, ('%sstep %d: norm %.17g against %.17g'):format(what, step, n1, n0))
            o0:step(); o0:zero_grad()
            o1:step(); o1:zero_grad()
          end
          local msd = tp.full_checkpoint(m)
          for name, t in pairs(ref:state_dict()) do
            local e = FS.max_rel(msd[name], t)
            assert.is_true(e <= 1e-9, ('%s%s after 3 steps: %g'):format(what, name, e))
          end
        end
      end)
    end
  end

  -- bf16 parameters, f32 gradient buffers: the layers' gradient sinks
  -- write the norms' parts into the f32 buffer, which the unit sums
  it('bf16 parameters with f32 reduction (the gradient sinks): the norms\' gradients are the unsplit model\'s '
    .. 'within bf16 rounding', function()
    if W % 2 ~= 0 then pending('an odd world: no TP 2 layout'); return end
    for _, case in ipairs({ cases[1], cases[2] }) do
      local R = W / 2
      local mesh = dist.mesh { replicate = R, shard = 2 }
      ms.manual_seed(7)
      local ref = case[2].new(case[4])
      ms.nn.functional.set_precision(ref, { compute = 'bf16' })
      ms.manual_seed(7)
      local m = tp.parallelize(case[2].new(case[4]), { group = mesh.shard, sequence_parallel = true })
      fsdp.fully_shard(m, { policy = fsdp.policy.by_class { case[3] }, group = mesh.replicate,
        mixed_precision = { param = 'bf16', reduce = 'f32' } })
      local x, y = FS.lcg_batch(91, 2 * R, 12)
      local r = mesh.coord[1]
      ref(x, y):backward()
      m(x:narrow(1, 2 * r + 1, 2):contiguous(), y:narrow(1, 2 * r + 1, 2):contiguous()):backward()
      local got = shard_grads(m)
      local n = 0
      for name, p in ref:named_parameters() do
        if name:find('norm') or name:find('ln_') then
          assert.are.equal('f32', got[name].dtype)
          local e = FS.norm_rel(got[name]:view(p.shape), p.grad:to('f32'))
          assert.is_true(e <= 3e-2, ('%s %s: %g'):format(case[1], name, e))
          n = n + 1
        end
      end
      assert.is_true(n >= 3)
    end
  end)

  it('a backward of a replicated forward (B*T not a multiple of the TP ranks) gives whole gradients; mixed with a '
    .. 'split one under no_sync it is an error', function()
    if W % 2 ~= 0 then pending('an odd world: no TP 2 layout'); return end
    local case = cases[2]
    local mesh = dist.mesh { replicate = W / 2, shard = 2 }
    local ref = build(case)
    local m = tp.parallelize(build(case), { group = mesh.shard, sequence_parallel = true })
    fsdp.fully_shard(m, { policy = fsdp.policy.by_class { case[3] }, group = mesh.replicate })
    -- B·T = 5 on every data-parallel rank: the same batch, so the mean is one process's
    local x, y = FS.lcg_batch(81, 1, 5)
    ref(x, y):backward()
    m(x, y):backward()
    same_grads(ref, m, 'odd B*T: ')
    fsdp.zero_grad(m)
    local x2, y2 = FS.lcg_batch(82, 2, 12)
    fsdp.no_sync(m, function() m(x2, y2):backward() end)
    local ok, err = pcall(function() m(x, y):backward() end)
    assert.is_false(ok)
    assert.matches('sequence%-parallel forward and one of a replicated forward', tostring(err))
    assert.matches('2 TP ranks', tostring(err))
  end)
end)
