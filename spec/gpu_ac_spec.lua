-- Activation checkpointing, saved-tensor versions and deferred
-- initialisation on the GPU: the fixture
-- models on cuda with every block checkpointed match the PyTorch float64
-- gradients as the plain model does (f32, 1e-4) and the plain model's own
-- gradients (f32: 1e-6; bf16 autocast: 2e-2), also under selective
-- checkpointing (policy op), the allocator's peak falls (op's between), and
-- an in-place write to a saved cuda tensor is caught, and a model built
-- under nn.deferred_init and moved to cuda gets, materialized or sharded,
-- the eager build's values.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'

local fixtures = T.root .. '/../shared/fixtures'

-- ‖got − want‖ / ‖want‖ on the host, in f64
local function relerr(got, want) return require('spec.fsdp_support').norm_rel(got:to('cpu'), want:to('cpu')) end

describe('activation checkpointing, versions and deferred init on cuda #gpu', function()
  for _, case in ipairs({ { 'gpt2-tiny', 'GPT2Block' }, { 'llama-tiny', 'LlamaDecoderLayer' } }) do
    local name, block = case[1], case[2]
    local M = require(name:match('^gpt2') and 'models.gpt2' or 'models.llama')
    local dir = fixtures .. '/' .. name

    it(name .. ': every block checkpointed, f32 and bf16 autocast: the gradients of the reference and of the plain model', function()
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      local ids, tg = exp.input_ids:to('cuda'), exp.targets:to('cuda')
      local function grads(ac, bf16)
        local model = M.from_pretrained(dir):to('cuda')
        model:eval()
        if bf16 then ms.nn.functional.set_precision(model, { compute = 'bf16' }) end
        if ac then
          assert.are.equal(2, #ms.nn.apply_activation_checkpointing(model, { class = block,
            policy = ac == 'op' and 'op' or nil }))
        end
        local loss = model(ids, tg)
        loss:backward()
        local g = {}
        for pname, p in model:named_parameters() do g[pname] = p.grad end
        return g, loss:item()
      end
      local g0, l0 = grads(false)
      local g1, l1 = grads(true)
      assert.is_true(math.abs(l1 - l0) <= 1e-6 * math.abs(l0))
      for pname, g in pairs(g1) do
        local e = relerr(g, exp['grad.' .. pname])
        assert.is_true(e <= 1e-4, pname .. ' against the reference ' .. e)
        local e0 = relerr(g, g0[pname])
        assert.is_true(e0 <= 1e-6, pname .. ' against the plain model ' .. e0)
      end
      local b0 = grads(false, true)
      local b1 = grads(true, true)
      for pname, g in pairs(b1) do
        local e = relerr(g, b0[pname])
        assert.is_true(e <= 2e-2, pname .. ' bf16 against the plain model ' .. e)
      end
      -- selective (policy op): the kept outputs reused by the recompute
      -- (GPT-2's MLP: the GELU of the kept pre-activation run again by the
      -- elementwise kernel, not the GEMM's epilogue: f32 within 1e-5)
      ms.autograd.sac_stats(true)
      local s1, sl = grads('op')
      local st = ms.autograd.sac_stats(true)
      assert.is_true(st.kept > 0 and st.reused == st.kept, ('kept %d, reused %d'):format(st.kept, st.reused))
      assert.is_true(math.abs(sl - l0) <= 1e-6 * math.abs(l0))
      for pname, g in pairs(s1) do
        local e0 = relerr(g, g0[pname])
        assert.is_true(e0 <= 1e-5, pname .. ' policy op against the plain model ' .. e0)
      end
      local s2 = grads('op', true)
      for pname, g in pairs(s2) do
        local e = relerr(g, b0[pname])
        assert.is_true(e <= 2e-2, pname .. ' policy op, bf16, against the plain model ' .. e)
      end
    end)
  end

  it('gpt2 (4 layers, B=8, T=256): the allocator peak with every block checkpointed is below the plain one', function()
    local gpt2 = require 'models.gpt2'
    local function peak(ac)
      ms.manual_seed(0)
      local model = gpt2.new('gpt2-124m', { n_layer = 4, vocab_size = 4096, n_positions = 256,
        resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0 }):to('cuda')
      if ac then ms.nn.apply_activation_checkpointing(model, { class = 'GPT2Block', policy = ac == 'op' and 'op' or nil }) end
      local ids = (ms.rand({ 8, 256 }, { seed = 3, device = 'cuda' }) * 4096):long()
      for _ = 1, 4 do collectgarbage() end
      ms.cuda.synchronize()
      local base = ms.cuda.memory_stats().allocated
      ms.cuda.reset_peak_memory_stats()
      local loss = model(ids, ids)
      loss:backward()
      ms.cuda.synchronize()
      local p = ms.cuda.memory_stats().peak_allocated - base
      local l = loss:item()
      model = nil
      for _ = 1, 4 do collectgarbage() end
      return p, l
    end
    local p0, l0 = peak(false)
    local p1, l1 = peak(true)
    assert.is_true(math.abs(l1 - l0) <= 1e-5 * math.abs(l0))
    assert.is_true(p1 < 0.8 * p0, ('peak above the start: %d bytes plain, %d checkpointed'):format(p0, p1))
    -- selective checkpointing holds more than full, less than none
    local p2, l2 = peak('op')
    assert.is_true(math.abs(l2 - l0) <= 1e-5 * math.abs(l0))
    assert.is_true(p1 < p2 and p2 < p0, ('peak above the start: plain %d, full %d, op %d'):format(p0, p1, p2))
  end)

  it('an in-place write to a cuda tensor a node saved: backward raises and names it', function()
    local w = ms.randn({ 64, 32 }, { device = 'cuda' }):requires_grad_()
    local x = ms.randn({ 16, 64 }, { device = 'cuda' })
    local y = ms.matmul(x, w):sum()
    x:mul_(2)
    local ok, err = pcall(function() y:backward() end)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('shape (16, 64), f32 on cuda:0', 1, true), tostring(err))
    assert.is_nil(w.grad)
  end)

  it('deferred init moved to cuda: materialized and fully_shard-ed, the eager build\'s values', function()
    local gpt2 = require 'models.gpt2'
    local cfg = { n_layer = 2, n_embd = 64, n_head = 4, vocab_size = 256, n_positions = 64 }
    ms.manual_seed(5)
    local eager = gpt2.new(cfg):to('cuda')
    local pe = {}
    for n, p in eager:named_parameters() do pe[n] = p end
    ms.manual_seed(5)
    local m = ms.nn.deferred_init(gpt2.new, cfg):to('cuda')
    assert.is_true(ms.nn.is_deferred(m))
    ms.nn.materialize(m)
    for n, p in m:named_parameters() do
      assert.are.equal('cuda:0', p.device)
      local d = ms.no_grad(function() return (p - pe[n]):abs():max():item() end)
      assert.are.equal(0, d, n)
    end
    ms.manual_seed(5)
    local s = ms.nn.deferred_init(gpt2.new, cfg):to('cuda')
    ms.fsdp.fully_shard(s, { policy = ms.fsdp.policy.by_class { 'GPT2Block' } })
    ms.fsdp.unshard(s)
    for n, p in s:named_parameters() do
      local d = ms.no_grad(function() return (p - pe[n]):abs():max():item() end)
      assert.are.equal(0, d, n)
    end
  end)

  it('from_pretrained{deferred = true} moved to cuda, fully_shard-ed with bf16 parameters: the eager load\'s values', function()
    for _, case in ipairs({ { 'gpt2-tiny', 'models.gpt2', 'GPT2Block' }, { 'llama-tiny', 'models.llama', 'LlamaDecoderLayer' } }) do
      local M = require(case[2])
      local dir = fixtures .. '/' .. case[1]
      local function load(deferred)
        local m = M.from_pretrained(dir, { deferred = deferred }):to('cuda')
        ms.fsdp.fully_shard(m, { policy = ms.fsdp.policy.by_class { case[3] }, mixed_precision = { param = 'bf16' } })
        return m
      end
      local a, b = load(false), load(true)
      local ua, ub = ms.fsdp.units(a), ms.fsdp.units(b)
      for k = 1, #ua do
        assert.are.equal('cuda:0', ub[k].fp.shard.device)
        local d = ms.no_grad(function() return (ua[k].fp.shard - ub[k].fp.shard):abs():max():item() end)
        assert.are.equal(0, d, case[1] .. ' ' .. ua[k].label)
      end
    end
  end)

  it('LoRA on cuda under bf16 autocast: the output unchanged at first, adapters alone trained, merged saves', function()
    local FS = require 'spec.fsdp_support'
    local M = require 'models.llama'
    local dir = fixtures .. '/llama-tiny'
    local x, y = FS.lcg_batch(5, 2, 16)
    x, y = x:cuda(), y:cuda()
    local base = M.from_pretrained(dir):to('cuda')
    ms.nn.functional.set_precision(base, { compute = 'bf16' })
    local m = M.from_pretrained(dir):to('cuda')
    ms.nn.functional.set_precision(m, { compute = 'bf16' })
    assert.are.equal(14, #ms.nn.apply_lora(m, { r = 4, alpha = 8 }))
    for n, p in m:named_parameters() do
      if n:match('lora_') then assert.are.equal('cuda:0', p.device) end
    end
    assert.are.equal(ms.no_grad(function() return base(x, y):item() end), ms.no_grad(function() return m(x, y):item() end))
    local opt = ms.optim.AdamW(m, { lr = 1e-2 })
    local first, last
    for k = 1, 4 do
      local l = m(x, y); l:backward(); opt:step(); opt:zero_grad()
      if k == 1 then first = l:item() end
      last = l:item()
    end
    assert.is_true(last < first)
    local plain = M.from_pretrained(dir):to('cuda')
    ms.nn.functional.set_precision(plain, { compute = 'bf16' })
    plain:load_state_dict(ms.nn.lora_merged(m, m:state_dict()))
    local la = ms.no_grad(function() return m(x, y):item() end)
    local lb = ms.no_grad(function() return plain(x, y):item() end)
    assert.is_true(math.abs(la - lb) <= 2e-2 * la, ('merged %.6g, adapted %.6g'):format(lb, la))
  end)
end)
