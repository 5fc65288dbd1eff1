-- Mixed precision (moonshard.amp, docs/precision.md) on the CPU: the
-- autocast region's rules (what is cast, what stays f32, how the region is
-- entered and left), gradients landing in f32 parameters in f32, and the
-- fixture models in a bf16 region within bf16 bounds of their f32 runs.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local amp = require 'moonshard.amp'
local nn = ms.nn
local nnf = nn.functional
local A = ms.autograd
local F = ms.raw

local fixtures = T.root .. '/../shared/fixtures'

local function relerr(got, want)
  local g, w = got:to('f64'), want:to('f64')
  local d = F.sub(g, w)
  return math.sqrt(F.sum(F.mul(d, d)):item() / F.sum(F.mul(w, w)):item())
end

local seed = 700
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed }):to(dtype or 'f32')
end

describe('autocast region', function()
  before_each(function() A.clear_tape() end)

  it('sets the compute dtype while fn runs and returns its results', function()
    assert.is_nil(amp.dtype())
    local a, b = nnf.autocast('bf16', function(x, y)
      assert.are.equal('bf16', amp.dtype_name())
      return x + 1, y
    end, 1, 'two')
    assert.are.equal(2, a)
    assert.are.equal('two', b)
    assert.is_nil(amp.dtype())
  end)

  it('is left on an error, and nests (false leaves the region for a part)', function()
    local ok, err = pcall(nnf.autocast, 'bf16', function() error('boom') end)
    assert.is_false(ok)
    assert.matches('boom', err)
    assert.is_nil(amp.dtype())
    nnf.autocast('bf16', function()
      nnf.autocast(false, function() assert.is_nil(amp.dtype()) end)
      nnf.autocast('f16', function() assert.are.equal('f16', amp.dtype_name()) end)
      assert.are.equal('bf16', amp.dtype_name())
    end)
  end)

  it('refuses a compute dtype that is not a low-precision float', function()
    local ok, err = pcall(nnf.autocast, 'i64', function() end)
    assert.is_false(ok)
    assert.matches("must be 'bf16' or 'f16'", err)
    ok, err = pcall(nnf.autocast, 'bf16', 42)
    assert.is_false(ok)
    assert.matches('expected a function', err)
  end)

  it('linear computes in bf16 and its f32 parameters get f32 gradients', function()
    local x = randn({ 6, 16 }):requires_grad_()
    local w, b = randn({ 8, 16 }):requires_grad_(), randn({ 8 }):requires_grad_()
    local y = nnf.autocast('bf16', nnf.linear, x, w, b)
    assert.are.equal('bf16', y.dtype)
    y:to('f32'):sum():backward()
    assert.are.equal('f32', w.grad.dtype)
    assert.are.equal('f32', b.grad.dtype)
    assert.are.equal('f32', x.grad.dtype)
    assert.are.equal('f32', w.dtype)
    -- the same as the f32 computation within bf16 bounds
    local gw, gx = w.grad:clone(), x.grad:clone()
    w:zero_grad(); x:zero_grad(); b:zero_grad()
    local y32 = nnf.linear(x, w, b)
    y32:sum():backward()
    assert.is_true(relerr(y, y32) <= 1e-2)
    assert.is_true(relerr(gw, w.grad) <= 1e-2)
    assert.is_true(relerr(gx, x.grad) <= 1e-2)
  end)

  it('norms compute in f32 and emit the region dtype; f64 is never cast', function()
    local x = randn({ 4, 32 }):requires_grad_()
    local w = randn({ 32 }):requires_grad_()
    local y = nnf.autocast('bf16', nnf.layer_norm, x, w, w)
    assert.are.equal('bf16', y.dtype)
    assert.are.same(nnf.layer_norm(x, w, w):to('bf16'):to('f64'):totable(), y:to('f64'):totable())
    assert.are.equal('bf16', nnf.autocast('bf16', nnf.rms_norm, x, w).dtype)
    y:to('f32'):sum():backward()
    assert.are.equal('f32', x.grad.dtype)
    assert.are.equal('f32', w.grad.dtype)
    local x64, w64 = randn({ 3, 8 }, 'f64'), randn({ 5, 8 }, 'f64')
    nnf.autocast('bf16', function()
      assert.are.equal('f64', nnf.linear(x64, w64).dtype)
      assert.are.equal('f64', nnf.layer_norm(x64).dtype)
    end)
  end)

  it('attention and the LM loss take bf16 inputs in a region', function()
    local q, k, v = randn({ 1, 2, 5, 8 }), randn({ 1, 2, 5, 8 }), randn({ 1, 2, 5, 8 })
    local y = nnf.autocast('bf16', nnf.scaled_dot_product_attention, q, k, v)
    assert.are.equal('bf16', y.dtype)
    assert.is_true(relerr(y, nnf.scaled_dot_product_attention(q, k, v)) <= 2e-2)
    local h, W = randn({ 2, 3, 8 }):requires_grad_(), randn({ 11, 8 }):requires_grad_()
    local tg = ms.tensor({ { 1, 2, 3 }, { 4, 5, 10 } }, { dtype = 'i64' })
    local loss = nnf.autocast('bf16', nnf.lm_loss, h, W, tg)
    assert.are.equal('f32', loss.dtype)
    assert.is_true(math.abs(loss:item() - nnf.lm_loss(h, W, tg):item()) <= 1e-2 * loss:item())
    loss:backward()
    assert.are.equal('f32', W.grad.dtype)
    assert.are.equal('f32', h.grad.dtype)
  end)

  it('the fused LM loss gives an f32 head weight its gradient in f32, not through a bf16 round trip', function()
    local h0, W0 = randn({ 2, 5, 16 }), randn({ 37, 16 })
    local tg = (ms.rand({ 2, 5 }, { seed = 77 }) * 36):long()
    -- the master-weight path (what autocast does now)
    local h1, W1 = h0:clone():requires_grad_(), W0:clone():requires_grad_()
    local l1 = nnf.autocast('bf16', nnf.lm_loss, h1, W1, tg)
    l1:backward()
    -- the recorded-cast path: grad_W made in bf16, cast back to f32
    local h2, W2 = h0:clone():requires_grad_(), W0:clone():requires_grad_()
    local l2 = nnf.lm_loss(h2:to('bf16'), W2:to('bf16'), tg)
    l2:backward()
    -- the exact gradient, f64 throughout, of the same bf16-rounded inputs
    local h3 = h0:to('bf16'):to('f64'):requires_grad_()
    local W3 = W0:to('bf16'):to('f64'):requires_grad_()
    local l3 = nnf.lm_loss(h3, W3, tg)
    l3:backward()
    assert.are.equal('f32', W1.grad.dtype)
    assert.are.equal(l2:item(), l1:item())
    assert.is_true(relerr(h1.grad, h2.grad) <= 1e-6)
    local e1, e2 = relerr(W1.grad, W3.grad), relerr(W2.grad, W3.grad)
    assert.is_true(e1 <= 1e-5, 'f32 gradient error ' .. e1)
    assert.is_true(e2 > 1e-4, 'the bf16 round trip should show: ' .. e2)
    -- the plain path, a bias, reduction 'none' and a given master keep the recorded cast
    local W4 = W0:clone():requires_grad_()
    local l4 = nnf.autocast('bf16', nnf.lm_loss, h0, W4, tg, { fused = false })
    l4:backward()
    assert.are.equal('f32', W4.grad.dtype)
    assert.is_true(relerr(W4.grad, W3.grad) <= 1e-2)
    -- a master weight of another shape is an error naming both
    local e = select(2, pcall(ms.nn.functional.fused_linear_cross_entropy, h0:view(10, 16), W0,
      tg:view(10), { master_weight = randn({ 36, 16 }) }))
    assert.matches('master_weight has shape (36, 16), W (37, 16)', tostring(e), 1, true)
  end)

  for _, name in ipairs({ 'gpt2-tiny', 'llama-tiny' }) do
    it(name .. ': loss, logits and every gradient within bf16 bounds of f32; grads f32', function()
      local M = require(name:match('^gpt2') and 'models.gpt2' or 'models.llama')
      local dir = fixtures .. '/' .. name
      local model = M.from_pretrained(dir)
      model:eval()
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      model:zero_grad()
      local l32 = model(exp.input_ids, exp.targets)
      l32:backward()
      local g32 = {}
      for pname, p in model:named_parameters() do g32[pname] = p.grad:clone() end
      model:zero_grad()
      local loss = nnf.autocast('bf16', model, exp.input_ids, exp.targets)
      assert.are.equal('f32', loss.dtype)
      local el = math.abs(loss:item() - l32:item()) / l32:item()
      assert.is_true(el <= 1e-2, 'loss ' .. el)
      loss:backward()
      for pname, p in model:named_parameters() do
        assert.are.equal('f32', p.dtype, pname)
        assert.are.equal('f32', p.grad.dtype, pname)
        local e = relerr(p.grad, g32[pname])
        assert.is_true(e <= 3e-2, pname .. ' ' .. e)
      end
      local logits = ms.no_grad(function() return nnf.autocast('bf16', model, exp.input_ids) end)
      assert.are.equal('bf16', logits.dtype)
      assert.is_true(relerr(logits, exp.logits) <= 2e-2, 'logits ' .. relerr(logits, exp.logits))
    end)
  end

  it('keeps the residual stream in f32 (GPT-2 blocks return f32)', function()
    local gpt2 = require 'models.gpt2'
    local model = gpt2.from_pretrained(fixtures .. '/gpt2-tiny')
    local ids = ms.tensor({ { 1, 2, 3, 4 } }, { dtype = 'i64' })
    nnf.autocast('bf16', function()
      local tr = model.transformer
      local x = tr.wte(ids) + tr.wpe(ms.arange(4, { dtype = 'i64' }))
      assert.are.equal('f32', x.dtype)
      assert.are.equal('f32', tr.h[1](x).dtype)
      assert.are.equal('bf16', tr.ln_f(x).dtype)
    end)
  end)
end)

describe('set_precision', function()
  it('runs every call of the model in a region and can be undone', function()
    local gpt2 = require 'models.gpt2'
    local dir = fixtures .. '/gpt2-tiny'
    local model = gpt2.from_pretrained(dir)
    model:eval()
    local exp = ms.load_safetensors(dir .. '/expected.safetensors')
    local want = nnf.autocast('bf16', model, exp.input_ids, exp.targets):item()
    assert.are.equal(model, nnf.set_precision(model, { compute = 'bf16' }))
    assert.are.equal('bf16', amp.precision(model))
    assert.are.equal(want, model(exp.input_ids, exp.targets):item())
    assert.is_nil(amp.dtype())
    nnf.set_precision(model, { compute = 'f32' })
    assert.is_nil(amp.precision(model))
    local l32 = model(exp.input_ids, exp.targets)
    assert.is_true(math.abs(l32:item() - exp.loss:item()) <= 1e-5 * exp.loss:item())
  end)

  it('trains with f32 master weights and f32 AdamW state', function()
    local gpt2 = require 'models.gpt2'
    local dir = fixtures .. '/gpt2-tiny'
    local model = nnf.set_precision(gpt2.from_pretrained(dir), { compute = 'bf16' })
    model:train()
    local exp = ms.load_safetensors(dir .. '/expected.safetensors')
    local opt = ms.optim.AdamW(model, { lr = 1e-3 })
    local first, last
    for step = 1, 5 do
      opt:zero_grad()
      local loss = model(exp.input_ids, exp.targets)
      loss:backward()
      opt:step()
      if step == 1 then first = loss:item() end
      last = loss:item()
    end
    assert.is_true(last < first)
    for pname, p in model:named_parameters() do
      assert.are.equal('f32', p.dtype, pname)
      local st = opt.state[tonumber(p.id)]
      assert.are.equal('f32', st.exp_avg.dtype)
      assert.are.equal('f32', st.exp_avg_sq.dtype)
    end
  end)

  it('bf16 weights with f32 masters in AdamW train step for step as f32 weights in the region', function()
    -- the region casts f32 weights to bf16 for the GEMMs and their bf16
    -- gradients back to f32; bf16 Linear/Conv1D weights with AdamW's f32
    -- masters skip both casts and give the same numbers: the same losses,
    -- the masters equal to the f32 weights, the weights their rounding
    for _, fam in ipairs({ 'gpt2', 'llama' }) do
      local M = require('models.' .. fam)
      local dir = fixtures .. '/' .. fam .. '-tiny'
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      local a = nnf.set_precision(M.from_pretrained(dir), { compute = 'bf16' })
      local b = nnf.set_precision(M.from_pretrained(dir), { compute = 'bf16', weights = 'bf16' })
      local oa = ms.optim.AdamW(a, { lr = 1e-3 })
      local ob = ms.optim.AdamW(b, { lr = 1e-3, master_weights = true })
      for step = 1, 4 do
        for _, pair in ipairs({ { a, oa }, { b, ob } }) do
          pair[2]:zero_grad()
          pair.loss = pair[1](exp.input_ids, exp.targets)
          pair.loss:backward()
          pair[2]:step()
        end
      end
      local pb = {}
      for n, p in b:named_parameters() do pb[n] = p end
      local lowered = 0
      for n, p in a:named_parameters() do
        local q = pb[n]
        if q.dtype == 'bf16' then
          lowered = lowered + 1
          local st = ob.state[tonumber(q.id)]
          assert.are.equal('f32', st.master.dtype, n)
          assert.are.equal(0, relerr(st.master, p), n .. ' master')
          assert.are.equal(0, relerr(q, p:to('bf16')), n .. ' weight')
        else
          assert.are.equal('f32', q.dtype, n)
          assert.are.equal(0, relerr(q, p), n)
        end
      end
      assert.is_true(lowered > 0, fam)
      local la, lb = a(exp.input_ids, exp.targets):item(), b(exp.input_ids, exp.targets):item()
      assert.are.equal(la, lb, fam .. ' loss after 4 steps')
    end
  end)

  it('takes weights only as the compute dtype, and master copies survive a state round trip', function()
    local gpt2 = require 'models.gpt2'
    local dir = fixtures .. '/gpt2-tiny'
    local ok, err = pcall(nnf.set_precision, gpt2.from_pretrained(dir), { compute = 'bf16', weights = 'f16' })
    assert.is_false(ok)
    assert.matches("needs compute = 'f16'", err, 1, true)
    ok, err = pcall(ms.optim.AdamW, gpt2.from_pretrained(dir), { master_weights = 1 })
    assert.is_false(ok)
    assert.matches('master_weights must be true or false', err, 1, true)
    local m = nnf.set_precision(gpt2.from_pretrained(dir), { compute = 'bf16', weights = 'bf16' })
    local exp = ms.load_safetensors(dir .. '/expected.safetensors')
    local o = ms.optim.AdamW(m, { lr = 1e-2, master_weights = true })
    m(exp.input_ids, exp.targets):backward()
    o:step()
    local sd = o:state_dict()
    local w = m.transformer.h[1].mlp.c_fc.weight
    local keep = w:to({ dtype = 'f32', copy = true })
    w:copy_(F.mul(w, 0))                      -- the weight lost, its master kept in the state
    local o2 = ms.optim.AdamW(m, { lr = 1e-2, master_weights = true })
    o2:load_state_dict(sd)
    assert.are.equal(0, relerr(w, keep))   -- written back from the loaded master
    local st = o2.state[tonumber(w.id)]
    assert.are.equal('f32', st.master.dtype)
  end)

  it('refuses what is not a module', function()
    local ok, err = pcall(nnf.set_precision, 42, { compute = 'bf16' })
    assert.is_false(ok)
    assert.matches('expected a module', err)
  end)
end)
