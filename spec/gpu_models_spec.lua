-- The fixture models on the GPU: gpt2-tiny and llama-tiny moved with
-- model:to('cuda') match the PyTorch float64 reference in f32 (logits, loss
-- and every gradient ≤ 1e-4 relative) and in bf16 (loss ≤ 3e-2); and a
-- 200-step training loop keeps the allocator's memory flat from step 2 on.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local S = require 'spec.support'

local fixtures = T.root .. '/../shared/fixtures'

-- (a zero reference, an expert no token chose: the error is the norm)
local function relerr(got, want)
  local g, w = got:to('cpu'):double(), want:to('cpu'):double()
  local d = g - w
  local den = (w * w):sum():item()
  if den == 0 then return math.sqrt((d * d):sum():item()) end
  return math.sqrt((d * d):sum():item() / den)
end

-- A transformers fixture folder of spec/fixtures (M's) on the GPU: in f32
-- logits, loss and every gradient within 1e-4 (the expected gradients
-- through map(grads, config) first when given: Llama 4's fused experts;
-- a gradient zero in exact arithmetic, rounding noise in the file, taken
-- as zero), in bf16 the loss within 3e-2.
local function fixture_on_cuda(M, dir, map)
  local exp = ms.load_safetensors(dir .. '/expected.safetensors')
  local ids, tg = exp.input_ids:to('cuda'), exp.targets:to('cuda')
  local model = M.from_pretrained(dir):to('cuda')
  model:eval()
  local logits = ms.no_grad(function() return model(ids) end)
  assert.is_true(relerr(logits, exp.logits) <= 1e-4, 'logits ' .. relerr(logits, exp.logits))
  local loss = model(ids, tg)
  local el = math.abs(loss:item() - exp.loss:item()) / exp.loss:item()
  assert.is_true(el <= 1e-4, 'loss ' .. el)
  loss:backward()
  local grads = {}
  for k, g in pairs(exp) do
    local n = k:match('^grad%.(.*)$')
    if n then grads[n] = g end
  end
  if map then grads = map(grads, model.config) end
  for pname, p in model:named_parameters() do
    local w = grads[pname]
    if (w:double() * w:double()):sum():item() < 1e-24 then w = w * 0 end
    local e = relerr(p.grad, w)
    assert.is_true(e <= 1e-4, pname .. ' ' .. e)
  end
  local mb = M.from_pretrained(dir):to('cuda'):to('bf16')
  local lb = mb(ids, tg)
  el = math.abs(lb:item() - exp.loss:item()) / exp.loss:item()
  assert.is_true(el <= 3e-2, 'bf16 loss ' .. el)
  lb:backward()
end

-- M's tiny preset, 30 AdamW steps on one (4, Tn) batch on cuda under bf16
-- autocast: the loss falls below 0.7 of its first value
local function tiny_trains_on_cuda(M, Tn)
  ms.manual_seed(4)
  local model = ms.nn.functional.set_precision(M.new('tiny'):to('cuda'), { compute = 'bf16' })
  local opt = ms.optim.AdamW(model, { lr = 3e-3 })
  local x, y = S.token_batch(4, Tn, 256, 9)
  x, y = x:to('cuda'), y:to('cuda')
  local first, last
  for step = 1, 30 do
    opt:zero_grad()
    local loss = model(x, y)
    loss:backward()
    opt:step()
    if step == 1 then first = loss:item() end
    last = loss:item()
  end
  assert.is_true(last < 0.7 * first, ('%g -> %g'):format(first, last))
end

describe('fixture models on cuda #gpu', function()
  for _, name in ipairs({ 'gpt2-tiny', 'llama-tiny' }) do
    local M = require(name:match('^gpt2') and 'models.gpt2' or 'models.llama')
    local dir = fixtures .. '/' .. name

    it(name .. ' in f32 matches logits, loss and every gradient (1e-4)', function()
      local model = M.from_pretrained(dir):to('cuda')
      model:eval()
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      local ids, tg = exp.input_ids:to('cuda'), exp.targets:to('cuda')
      local logits = ms.no_grad(function() return model(ids) end)
      assert.are.equal('cuda:0', logits.device)
      assert.is_true(relerr(logits, exp.logits) <= 1e-4, 'logits ' .. relerr(logits, exp.logits))
      model:zero_grad()
      local loss = model(ids, tg)
      local el = math.abs(loss:item() - exp.loss:item()) / exp.loss:item()
      assert.is_true(el <= 1e-4, 'loss ' .. el)
      loss:backward()
      for pname, p in model:named_parameters() do
        local e = relerr(p.grad, exp['grad.' .. pname])
        assert.is_true(e <= 1e-4, pname .. ' ' .. e)
      end
    end)

    it(name .. ' in bf16 matches the loss (3e-2)', function()
      local model = M.from_pretrained(dir):to('cuda'):to('bf16')
      model:eval()
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      local loss = model(exp.input_ids:to('cuda'), exp.targets:to('cuda'))
      local el = math.abs(loss:item() - exp.loss:item()) / exp.loss:item()
      assert.is_true(el <= 3e-2, 'loss ' .. el)
      loss:backward()
    end)
  end

  it('bf16 weights with AdamW f32 masters train as the bf16 region with f32 weights (gpt2-tiny, llama-tiny)', function()
    local nnf = ms.nn.functional
    for _, fam in ipairs({ 'gpt2', 'llama' }) do
      local M = require('models.' .. fam)
      local dir = fixtures .. '/' .. fam .. '-tiny'
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      local ids, tg = exp.input_ids:to('cuda'), exp.targets:to('cuda')
      local a = nnf.set_precision(M.from_pretrained(dir):to('cuda'), { compute = 'bf16' })
      local b = nnf.set_precision(M.from_pretrained(dir):to('cuda'), { compute = 'bf16', weights = 'bf16' })
      local oa = ms.optim.AdamW(a, { lr = 1e-3 })
      local ob = ms.optim.AdamW(b, { lr = 1e-3, master_weights = true })
      for step = 1, 3 do
        local l = {}
        for k, pair in ipairs({ { a, oa }, { b, ob } }) do
          pair[2]:zero_grad()
          local loss = pair[1](ids, tg)
          loss:backward()
          pair[2]:step()
          l[k] = loss:item()
        end
        assert.is_true(math.abs(l[1] - l[2]) <= 1e-6 * math.abs(l[1]), ('%s step %d: %.9g vs %.9g'):format(fam, step, l[1], l[2]))
      end
      local pb = {}
      for n, p in b:named_parameters() do pb[n] = p end
      for n, p in a:named_parameters() do
        local st = ob.state[tonumber(pb[n].id)]
        local got = st.master or pb[n]
        assert.is_true(relerr(got, p) <= 1e-6, fam .. ' ' .. n .. ' ' .. relerr(got, p))
      end
    end
  end)

  it('a 200-step AdamW run: allocated memory never grows past step 2, no cudaMalloc after warm-up', function()
    local M = require 'models.gpt2'
    local model = M.from_pretrained(fixtures .. '/gpt2-tiny'):to('cuda')
    model:train()
    local exp = ms.load_safetensors(fixtures .. '/gpt2-tiny/expected.safetensors')
    local ids, tg = exp.input_ids:to('cuda'), exp.targets:to('cuda')
    local opt = ms.optim.AdamW(model, { lr = 1e-3 })
    local after = {}
    local first, last, mallocs
    for step = 1, 200 do
      opt:zero_grad()
      local loss = model(ids, tg)
      loss:backward()
      opt:step()
      if step == 1 then first = loss:item() end
      if step == 200 then last = loss:item() end
      S.settle()
      local st = ms.cuda.memory_stats()
      after[step] = st.allocated
      if step == 100 then mallocs = st.num_mallocs end
      if step == 200 then assert.are.equal(mallocs, st.num_mallocs, 'cudaMalloc after warm-up') end
    end
    for step = 3, 200 do
      assert.is_true(after[step] <= after[2], ('allocated grew at step %d: %d > %d'):format(step, after[step], after[2]))
    end
    assert.is_true(last < first)
  end)
end)

describe('gpt2-tiny c_proj bias gradients from the norm backward on cuda #gpu', function()
  it('a bf16 autocast step gives the gradients of the bias epilogue, 2 sums taken a block', function()
    local nnf = ms.nn.functional
    local M = require 'models.gpt2'
    local dir = fixtures .. '/gpt2-tiny'
    local exp = ms.load_safetensors(dir .. '/expected.safetensors')
    local ids, tg = exp.input_ids:to('cuda'), exp.targets:to('cuda')
    local function step(on)
      local prev = nnf.set_norm_bias_sum(on)
      local model = nnf.set_precision(M.from_pretrained(dir):to('cuda'), { compute = 'bf16' })
      model:eval()
      local before = nnf.norm_bias_sum_count()
      local ok, err = pcall(function() model(ids, tg):backward() end)
      nnf.set_norm_bias_sum(prev)
      assert(ok, err)
      local grads = {}
      for n, p in model:named_parameters() do grads[n] = p.grad:to('cpu'):to('f64') end
      return grads, nnf.norm_bias_sum_count() - before, #model.transformer.h
    end
    local on, taken, nl = step(true)
    local off, none = step(false)
    assert.are.equal(2 * nl, taken)
    assert.are.equal(0, none)
    local nb = 0
    for n, g in pairs(off) do
      local e = relerr(on[n], g)
      assert.is_true(e <= 1e-2, n .. ' ' .. e)
      if n:match('c_proj%.bias$') then nb = nb + 1 end
    end
    assert.are.equal(2 * nl, nb)
  end)
end)

-- DeepSeek-V3 (models/deepseek_v3.lua) on the GPU: the transformers
-- fixtures of spec/fixtures in f32 (logits, loss, every gradient ≤ 1e-4)
-- and bf16 (loss ≤ 3e-2); the latent attention at DeepSeek-V3's head widths
-- (q/k 192, v 128: the fused mma kernels at those widths; and the unfused
-- path) in bf16 against the CPU in f64 (≤ 2e-2); AdamW steps under bf16
-- autocast lower the loss.
describe('DeepSeek-V3 on cuda #gpu', function()
  local ds = require 'models.deepseek_v3'
  local dsdir = T.root .. '/spec/fixtures'
  for _, case in ipairs({ 'deepseek-v3-tiny', 'deepseek-v3-tiny-qproj', 'deepseek-v3-tiny-yarn' }) do
    it(case .. ' in f32 matches logits, loss and every gradient (1e-4); bf16 the loss (3e-2)', function()
      fixture_on_cuda(ds, dsdir .. '/' .. case)
    end)
  end

  it('latent attention at q/k 192, v 128 (fused, v at its own width; and unfused) in bf16 against the CPU in f64 (2e-2)',
    function()
    ms.manual_seed(3)
    local cfg = { dim = 256, n_head = 4, q_lora_rank = 96, kv_lora_rank = 128, qk_nope_head_dim = 128,
      qk_rope_head_dim = 64, v_head_dim = 128 }
    local ref = ms.nn.MLAttention(cfg):to('f64')
    for name, p in ref:named_parameters() do
      if name:match('norm') then ms.normal_(p, 1, 0.1) else ms.normal_(p, 0, 0.05) end
    end
    local gpu = ms.nn.MLAttention(cfg):to('cuda'):to('bf16')
    gpu:load_state_dict(ref:state_dict())
    local x = ms.randn({ 2, 96, 256 }, { dtype = 'f64', seed = 5 })
    local g = ms.randn({ 2, 96, 256 }, { dtype = 'f64', seed = 6 })
    local xr = x:clone():requires_grad_()
    local yr = ref(xr)
    local lr = (yr * g):sum()
    lr:backward()
    for _, unfused in ipairs({ false, true }) do
      gpu.unfused = unfused or nil
      gpu:zero_grad()
      local xg = x:to('cuda'):to('bf16'):requires_grad_()
      local yg = gpu(xg)
      local lg = (yg * g:to('cuda'):to('bf16')):sum()
      lg:backward()
      if not unfused then
        -- (the last attention call, the backward's, ran at 192 on the wgmma
        -- kernels on Hopper, else on mma)
        local hopper = ms.cuda.get_device_capability(0) == 9
        assert.are.equal(tonumber(hopper and T.C.MS_ATTENTION_WGMMA or T.C.MS_ATTENTION_MMA),
          tonumber(T.C.ms_cuda_attention_last_impl()))
      end
      local how = unfused and 'unfused ' or 'fused '
      assert.is_true(relerr(yg, yr) <= 2e-2, how .. 'y ' .. relerr(yg, yr))
      assert.is_true(relerr(xg.grad, xr.grad) <= 2e-2, how .. 'dx ' .. relerr(xg.grad, xr.grad))
      for _, n in ipairs({ 'kv_b_proj', 'q_b_proj', 'o_proj', 'kv_a_proj_with_mqa' }) do
        local e = relerr(gpu[n].weight.grad, ref[n].weight.grad)
        assert.is_true(e <= 2e-2, how .. n .. ' ' .. e)
      end
    end
  end)

  it('the tiny preset trains on cuda under bf16 autocast (AdamW, 30 steps on one batch)', function()
    tiny_trains_on_cuda(ds, 64)
  end)
end)

-- Llama 4 (models/llama4.lua) on the GPU: the transformers fixtures of
-- spec/fixtures in f32 (logits, loss, every gradient ≤ 1e-4; the expected
-- gradients' fused experts mapped as the weights are) and bf16 (loss ≤
-- 3e-2); chunked attention at Llama 4's head width (128) over several
-- chunks, the last padded, in bf16 against the CPU in f64 (≤ 2e-2); AdamW
-- steps of the tiny preset under bf16 autocast lower the loss.
describe('Llama 4 on cuda #gpu', function()
  local llama4 = require 'models.llama4'
  local l4dir = T.root .. '/spec/fixtures'
  for _, case in ipairs({ 'llama4-tiny', 'llama4-tiny-step2', 'llama4-tiny-scout' }) do
    it(case .. ' in f32 matches logits, loss and every gradient (1e-4); bf16 the loss (3e-2)', function()
      fixture_on_cuda(llama4, l4dir .. '/' .. case, llama4.fix_state_dict)
    end)
  end

  it('chunked attention (head width 128, chunks of 128 over 300 positions, GQA) in bf16 against the CPU in f64 (2e-2)',
    function()
    local q = ms.randn({ 2, 4, 300, 128 }, { dtype = 'f64', seed = 1 })
    local k = ms.randn({ 2, 2, 300, 128 }, { dtype = 'f64', seed = 2 })
    local v = ms.randn({ 2, 2, 300, 128 }, { dtype = 'f64', seed = 3 })
    local g = ms.randn({ 2, 4, 300, 128 }, { dtype = 'f64', seed = 4 })
    local function run(dev, dt)
      local qq = q:to({ device = dev, dtype = dt, copy = true }):detach():requires_grad_()
      local kk = k:to({ device = dev, dtype = dt, copy = true }):detach():requires_grad_()
      local vv = v:to({ device = dev, dtype = dt, copy = true }):detach():requires_grad_()
      local y = llama4.chunked_attention(qq, kk, vv, 128)
      local l = (y * g:to({ device = dev, dtype = dt })):sum()
      l:backward()
      return y, qq.grad, kk.grad, vv.grad
    end
    local ref = { run('cpu', 'f64') }
    local got = { run('cuda', 'bf16') }
    for i, what in ipairs({ 'y', 'dq', 'dk', 'dv' }) do
      local e = relerr(got[i], ref[i])
      assert.is_true(e <= 2e-2, what .. ' ' .. e)
    end
  end)

  it('the tiny preset trains on cuda under bf16 autocast (AdamW, 30 steps of 160 tokens: three chunks)', function()
    tiny_trains_on_cuda(llama4, 160)
  end)
end)

-- The other transformers fixtures of spec/fixtures on the GPU (f32: logits,
-- loss, every gradient ≤ 1e-4; bf16: the loss ≤ 3e-2): DeepSeek-V2's two
-- routers; Llama with Llama 3.1's, linear and YaRN RoPE; Qwen2 and Qwen3;
-- GLM-4.5's partial RoPE.
-- DeepSeek-V2's and DeepSeek-V3-with-MTP's tiny presets train under bf16
-- autocast.
describe('DeepSeek-V2, multi-token prediction and the dense decoders on cuda #gpu', function()
  local dir = T.root .. '/spec/fixtures'
  for _, c in ipairs({ { 'models.deepseek_v2', 'deepseek-v2-tiny' }, { 'models.deepseek_v2', 'deepseek-v2-tiny-lite' },
    { 'models.llama', 'llama-tiny-llama3rope' }, { 'models.llama', 'llama-tiny-linear' },
    { 'models.llama', 'llama-tiny-yarn' }, { 'models.qwen2', 'qwen2-tiny' }, { 'models.qwen3', 'qwen3-tiny' },
    { 'models.glm4_moe', 'glm4-moe-tiny' }, { 'models.glm4_moe', 'glm4-moe-tiny-quarter' } }) do
    it(c[2] .. ' in f32 matches logits, loss and every gradient (1e-4); bf16 the loss (3e-2)', function()
      fixture_on_cuda(require(c[1]), dir .. '/' .. c[2])
    end)
  end

  it('DeepSeek-V2\'s tiny preset trains on cuda under bf16 autocast', function()
    tiny_trains_on_cuda(require 'models.deepseek_v2', 64)
  end)

  it('DeepSeek-V3 with two MTP depths: the loss and its depths on cuda in f32 as on the CPU (1e-4); bf16 '
    .. 'autocast trains', function()
    local ds = require 'models.deepseek_v3'
    ms.manual_seed(5)
    local cpu = ds.new('tiny', { mtp_loss_weight = 0.3, num_nextn_predict_layers = 2 })
    local gpu = ds.new('tiny', { mtp_loss_weight = 0.3, num_nextn_predict_layers = 2 }):to('cuda')
    gpu:load_state_dict(cpu:state_dict())
    local x, y = S.token_batch(2, 48, 256, 7)
    -- one tape: each forward is followed by its own backward
    local lc = cpu(x, y)
    local dc = cpu:mtp_losses()
    lc:backward()
    local lg = gpu(x:to('cuda'), y:to('cuda'))
    local dg = gpu:mtp_losses()
    lg:backward()
    assert.is_true(math.abs(lg:item() - lc:item()) <= 1e-4 * lc:item(), ('%g vs %g'):format(lg:item(), lc:item()))
    for k = 1, 2 do
      assert.is_true(math.abs(dg[k]:item() - dc[k]:item()) <= 1e-4 * dc[k]:item(), 'depth ' .. k)
    end
    local pc = {}
    for name, p in cpu:named_parameters() do pc[name] = p end
    for name, p in gpu:named_parameters() do
      if name:match('mtp_layers') or name:match('embed') then
        local e = relerr(p.grad, pc[name].grad)
        assert.is_true(e <= 1e-4, name .. ' ' .. e)
      end
    end
    local m = ds
    tiny_trains_on_cuda({ new = function(p) return m.new(p, { mtp_loss_weight = 0.3 }) end }, 64)
  end)
end)
