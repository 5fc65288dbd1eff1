-- The V-shaped zero-bubble pipeline schedule (zbv) on GPUs over NCCL
-- (#multi: tools/run_multi_specs.sh 2 or 4 on a host with that many GPUs;
-- other worlds are pending). spec/dist_pp_zbv_spec.lua (#mpi) holds the
-- exact f64 checks and the orders; this file runs the schedule with CUDA
-- tensors, 2 chunks a rank in a V (rank 0 holding the embedding and the
-- head), its weight gradients as jobs of their own: --pp 2 on 2 GPUs, and
-- on 4 both --pp 4 and two pipelines of --pp 2 (consecutive ranks). A
-- GPT-2 (tied head) and a Llama of 8 blocks against one process on the
-- same GPU over the same micro-batches:
--   - f32: the loss (1e-5) and every stage's gradients (1e-4), with 2S - 1
--     and 2S micro-batches;
--   - bf16 autocast: the loss (1e-3) and the gradients (2e-2; one process
--     runs the same micro-batches, so the GEMMs have the same shapes and
--     only the sums' order differs);
--   - three clipped AdamW steps (f32): the norms (1e-4) and the weights
--     after them (1e-3).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local gpt2 = require 'models.gpt2'
local llama = require 'models.llama'
local hf = require 'models.hf'

local launched = os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda'

describe('the zbv pipeline schedule on GPUs (NCCL) #multi', function()
  if not launched then
    it('runs under the launcher on GPUs (tools/run_multi_specs.sh)', function() pending('not launched with --device cuda') end)
    return
  end
  local W = tonumber(os.getenv('WORLD_SIZE'))
  if W ~= 2 and W ~= 4 then
    it('runs on 2 or 4 GPUs', function()
      pending(('a world of %d GPUs: --pp 2 runs on 2 (or 4: two pipelines), --pp 4 on 4 (8 blocks: 2 x 4 virtual '
        .. 'stages)'):format(W))
    end)
    return
  end
  setup(function() dist.init { timeout = tonumber(os.getenv('MS_MULTI_TIMEOUT') or 300) } end)
  teardown(function() dist.destroy() end)

  local cases = {
    { 'gpt2', gpt2, { vocab_size = 515, n_positions = 64, n_embd = 64, n_layer = 8, n_head = 4,
      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
    { 'llama', llama, { vocab_size = 515, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 8,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64 } },
  }
  local function build(case)
    ms.manual_seed(5)
    return case[2].new(case[3])
  end
  -- the pipelines at this world size: { stages, what }
  local layouts = W == 2 and { { 2, '--pp 2' } } or { { 4, '--pp 4' }, { 2, 'two pipelines of --pp 2' } }
  -- model (on the GPU, its stage), the pipeline
  local function pipeline(case, S, M)
    local m = build(case)
    local group = nil
    if S < W then group = dist.mesh { replicate = W / S, shard = S }.shard end
    local pipe = ms.pp.pipeline(m, { group = group, schedule = 'zbv', microbatches = M })
    m:to('cuda')
    return m, pipe
  end
  local function run(bf16, fn) if bf16 then return ms.nn.functional.autocast('bf16', fn) end return fn() end
  -- one process over the same M micro-batches of (x, y): the mean loss
  local function ref_backward(ref, x, y, M, bf16)
    local B, sum = x.shape[1] / M, 0
    for k = 0, M - 1 do
      local xk, yk = x:narrow(1, k * B + 1, B):contiguous(), y:narrow(1, k * B + 1, B):contiguous()
      local l = run(bf16, function() return ref(xk, yk) end) * (1 / M)
      l:backward()
      sum = sum + l:item()
    end
    return sum
  end
  local function batch(seed, n)
    local x, y = FS.lcg_batch(seed, n, 48)
    return x:cuda(), y:cuda()
  end

  for _, case in ipairs(cases) do
    for _, lay in ipairs(layouts) do
      local S = lay[1]
      for _, bf16 in ipairs({ false, true }) do
        it(('%s, %s, zbv, %s: the loss and every stage\'s gradients are one process\'s on the same GPU'):format(case[1],
          lay[2], bf16 and 'bf16 autocast' or 'f32'), function()
          for _, M in ipairs({ 2 * S - 1, 2 * S }) do
            local what = ('%s, %s, %d micro-batches'):format(case[1], lay[2], M)
            local x, y = batch(30 + M, 2 * M)
            local ref = build(case):to('cuda')
            local l0 = ref_backward(ref, x, y, M, bf16)
            local m, pipe = pipeline(case, S, M)
            assert.are.equal('zbv', pipe.schedule)
            local l1 = run(bf16, function() return pipe:step(x, y) end):item()
            assert.is_true(FS.rel(l1, l0) <= (bf16 and 1e-3 or 1e-5), ('%s: loss %.9g, one process %.9g'):format(what,
              l1, l0))
            local rp = {}
            for name, p in ref:named_parameters() do rp[name] = p end
            local n = 0
            for name, p in m:named_parameters() do
              assert.is_not_nil(p.grad, what .. ': no gradient for ' .. name)
              local e = FS.norm_rel(p.grad, rp[name].grad)
              assert.is_true(e <= (bf16 and 2e-2 or 1e-4), ('%s: %s: %.3g'):format(what, name, e))
              n = n + 1
            end
            assert.is_true(n > 0, what .. ': a stage without parameters')
            pipe:free()
          end
        end)
      end

      it(('%s, %s, zbv: three clipped AdamW steps train as one process (f32)'):format(case[1], lay[2]), function()
        local M = 2 * S
        local hyper = { lr = 1e-2, weight_decay = 0.1, betas = { 0.9, 0.95 }, eps = 1e-8 }
        local ref = build(case):to('cuda')
        local m, pipe = pipeline(case, S, M)
        local o0, o1 = ms.optim.AdamW(ref, hyper), ms.optim.AdamW(m, hyper)
        for step = 1, 3 do
          local x, y = batch(80 + step, 2 * M)
          ref_backward(ref, x, y, M, false)
          local n0 = ms.optim.clip_grad_norm(ref, 0.5)
          o0:step(); o0:zero_grad()
          pipe:step(x, y)
          local n1 = ms.pp.clip_grad_norm_(m, 0.5)
          o1:step(); o1:zero_grad()
          assert.is_true(FS.rel(n1, n0) <= 1e-4, ('step %d: norm %.9g, one process %.9g'):format(step, n1, n0))
        end
        local rp = {}
        for name, p in ref:named_parameters() do rp[name] = p end
        -- (1e-3: AdamW's update of an element whose gradient is near its
        -- eps turns on the gradient's last bits)
        for name, p in m:named_parameters() do
          local e = FS.norm_rel(p, rp[name])
          assert.is_true(e <= 1e-3, ('%s after 3 steps: %.3g'):format(name, e))
        end
        pipe:free()
      end)
    end
  end
end)
