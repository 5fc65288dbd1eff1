-- Fused attention (ms_attention, core/attention_cpu.c) against the composed
-- path (matmul, mask, softmax, matmul) and float64 finite differences.
local ms = require 'moonshard'
local nnf = require 'moonshard.nn.functional'

local function relerr(a, b)
  local d = (a:double() - b:double())
  local n = (b:double() * b:double()):sum():item()
  return math.sqrt((d * d):sum():item() / n)
end

local seed = 500
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed }):to(dtype or 'f64')
end

local cases = {
  { B = 2, H = 4, Hkv = 4, T = 13, Tk = 13, D = 8, causal = true },
  { B = 1, H = 6, Hkv = 2, T = 70, Tk = 70, D = 16, causal = true },   -- GQA, T past one 64-tile
  { B = 2, H = 2, Hkv = 1, T = 5, Tk = 9, D = 4, causal = false },     -- Tq != Tk
  { B = 1, H = 3, Hkv = 3, T = 4, Tk = 9, D = 6, causal = true },      -- the last 4 of 9 positions (KV cache)
}

describe('fused attention', function()
  for n, c in ipairs(cases) do
    it(('matches the composed path, forward and backward (case %d)'):format(n), function()
      local q = randn({ c.B, c.H, c.T, c.D }):requires_grad_()
      local k = randn({ c.B, c.Hkv, c.Tk, c.D }):requires_grad_()
      local v = randn({ c.B, c.Hkv, c.Tk, c.D }):requires_grad_()
      local g = randn({ c.B, c.H, c.T, c.D })
      local y1 = nnf.scaled_dot_product_attention(q, k, v, { causal = c.causal })
      ms.sum(y1 * g):backward()
      local gq, gk, gv = q.grad:clone(), k.grad:clone(), v.grad:clone()
      q.grad, k.grad, v.grad = nil, nil, nil
      local y2 = nnf.scaled_dot_product_attention(q, k, v, { causal = c.causal, unfused = true })
      ms.sum(y2 * g):backward()
      assert.is_true(relerr(y1, y2) < 1e-12, 'out ' .. relerr(y1, y2))
      assert.is_true(relerr(gq, q.grad) < 1e-12, 'dq ' .. relerr(gq, q.grad))
      assert.is_true(relerr(gk, k.grad) < 1e-12, 'dk ' .. relerr(gk, k.grad))
      assert.is_true(relerr(gv, v.grad) < 1e-12, 'dv ' .. relerr(gv, v.grad))
    end)
  end

  it('passes a float64 finite-difference check', function()
    local q = randn({ 1, 2, 6, 4 }):requires_grad_()
    local k, v = randn({ 1, 1, 6, 4 }):requires_grad_(), randn({ 1, 1, 6, 4 }):requires_grad_()
    local worst = ms.autograd.gradcheck(function()
      return nnf.scaled_dot_product_attention(q, k, v, { causal = true })
    end, { q, k, v })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('keeps f32 and bf16 within their bounds of the f64 result', function()
    local q, k, v = randn({ 2, 2, 20, 8 }), randn({ 2, 2, 20, 8 }), randn({ 2, 2, 20, 8 })
    local ref = ms.no_grad(nnf.scaled_dot_product_attention, q, k, v)
    for dt, bound in pairs({ f32 = 1e-6, bf16 = 1e-2 }) do
      local y = ms.no_grad(nnf.scaled_dot_product_attention, q:to(dt), k:to(dt), v:to(dt))
      assert.are.equal(dt, y.dtype)
      assert.is_true(relerr(y, ref) < bound, dt .. ' ' .. relerr(y, ref))
    end
  end)

  it('rejects shapes that do not fit, naming them', function()
    local ok, err = pcall(function()
      return nnf.scaled_dot_product_attention(randn({ 1, 3, 4, 8 }), randn({ 1, 2, 4, 8 }), randn({ 1, 2, 4, 8 }))
    end)
    assert.is_false(ok)
    assert.matches('%(1, 3, 4, 8%)', err)
  end)

  it('rejects an option it does not know, naming it (PyTorch\'s is_causal = false gave causal attention)', function()
    local q, k, v = randn({ 1, 1, 3, 4 }), randn({ 1, 1, 3, 4 }), randn({ 1, 1, 3, 4 })
    local ok, err = pcall(nnf.scaled_dot_product_attention, q, k, v, { is_causal = false })
    assert.is_false(ok)
    assert.matches("unknown option is_causal (options: causal, scale, mask, unfused; PyTorch's is_causal is causal here",
      err, 1, true)
    ok, err = pcall(nnf.scaled_dot_product_attention, q, k, v, { causal = false, dropout_p = 0.1 })
    assert.is_false(ok)
    assert.matches('unknown option dropout_p', err, 1, true)
    -- the options it knows still work
    local y = nnf.scaled_dot_product_attention(q, k, v, { causal = false, scale = 0.5, unfused = true })
    assert.is_true(relerr(y, nnf.scaled_dot_product_attention(q, k, v, { causal = false, scale = 0.5 })) < 1e-12)
  end)
end)

describe('qkv_attention (GPT-2 fused projection, one node)', function()
  -- the chain it replaces: narrow, view, transpose, attention, merge
  local function chain(qkv, H, causal)
    local B, T, C = qkv.shape[1], qkv.shape[2], qkv.shape[3] / 3
    local function head(i)
      return qkv:narrow(3, (i - 1) * C + 1, C):view(B, T, H, C / H):transpose(2, 3)
    end
    local y = nnf.scaled_dot_product_attention(head(1), head(2), head(3), { causal = causal, unfused = true })
    return y:transpose(2, 3):reshape(B, T, C)
  end

  for _, c in ipairs({ { B = 2, T = 13, H = 3, D = 4, causal = true }, { B = 1, T = 70, H = 2, D = 8, causal = false } }) do
    it(('equals the chain forward and backward (B=%d T=%d H=%d D=%d)'):format(c.B, c.T, c.H, c.D), function()
      local qkv = randn({ c.B, c.T, 3 * c.H * c.D }):requires_grad_()
      local g = randn({ c.B, c.T, c.H * c.D })
      local y1 = nnf.qkv_attention(qkv, c.H, { causal = c.causal })
      assert.are.same({ c.B, c.T, c.H * c.D }, y1.shape)
      assert.is_true(y1:is_contiguous())
      ms.sum(y1 * g):backward()
      local g1 = qkv.grad:clone()
      qkv.grad = nil
      local y2 = chain(qkv, c.H, c.causal)
      ms.sum(y2 * g):backward()
      assert.is_true(relerr(y1, y2) < 1e-12, 'out ' .. relerr(y1, y2))
      assert.is_true(relerr(g1, qkv.grad) < 1e-12, 'dqkv ' .. relerr(g1, qkv.grad))
    end)
  end

  it('passes a float64 finite-difference check', function()
    local qkv = randn({ 2, 5, 3 * 2 * 3 }):requires_grad_()
    local worst = ms.autograd.gradcheck(function() return nnf.qkv_attention(qkv, 2) end, { qkv })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('keeps f32 and bf16 within their bounds of the f64 result', function()
    local qkv = randn({ 2, 20, 3 * 2 * 8 })
    local ref = ms.no_grad(nnf.qkv_attention, qkv, 2)
    for dt, bound in pairs({ f32 = 1e-6, bf16 = 1e-2 }) do
      local y = ms.no_grad(nnf.qkv_attention, qkv:to(dt), 2)
      assert.are.equal(dt, y.dtype)
      assert.is_true(relerr(y, ref) < bound, dt .. ' ' .. relerr(y, ref))
    end
  end)

  it('rejects a width that is not 3 * n_head * head_dim, naming the shape', function()
    local ok, err = pcall(nnf.qkv_attention, randn({ 1, 4, 20 }), 3)
    assert.is_false(ok)
    assert.matches('%(1, 4, 20%)', err)
    assert.matches('n_head 3', err, 1, true)
  end)
end)

-- moonshard.cp's block merge (ms_attention_merge_, ms_attention_block_grad)
-- on the CPU: against the formula in f64 ops, and as the exact split of an
-- attention over two key blocks
describe('attention over key blocks merged by their log-sum-exp', function()
  local T = require 'moonshard.tensor'
  local ffi = require 'ffi'
  local box = ffi.typeof('ms_tensor*[1]')
  local function attn(q, k, v, causal)
    local o, l = box(), box()
    T.check(T.C.ms_attention(o, l, q, k, v, 1 / math.sqrt(q.shape[4]), causal and 1 or 0))
    return T.wrap(o[0]), T.wrap(l[0])
  end

  it('merging the attention of two key blocks gives the whole attention (f64), from any first block', function()
    local q, k, v = randn({ 2, 4, 6, 8 }), randn({ 2, 2, 10, 8 }), randn({ 2, 2, 10, 8 })
    local o0, l0 = attn(q, k, v, false)
    for _, cut in ipairs({ 1, 4, 9 }) do
      local o1, l1 = attn(q, k:narrow(3, 1, cut), v:narrow(3, 1, cut), false)
      local o2, l2 = attn(q, k:narrow(3, cut + 1, 10 - cut), v:narrow(3, cut + 1, 10 - cut), false)
      -- the accumulator as a strided view (the heads' rows of a (B, T, H, D) buffer)
      local acc = ms.empty({ 2, 6, 4, 8 }, { dtype = 'f64' }):transpose(2, 3)
      local al = ms.empty({ 2, 4, 6 }, { dtype = 'f64' })
      T.check(T.C.ms_attention_merge_(acc, al, o2, l2, 1))
      T.check(T.C.ms_attention_merge_(acc, al, o1, l1, 0))
      assert.is_true(relerr(acc, o0) < 1e-14, 'out ' .. relerr(acc, o0))
      assert.is_true(relerr(al, l0) < 1e-14, 'lse ' .. relerr(al, l0))
    end
  end)

  it('matches the formula on random data (f32 accumulator, bf16 and f32 blocks, rows with -inf)', function()
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      local acc, al = randn({ 2, 3, 5, 16 }, 'f32'), randn({ 2, 3, 5 }, 'f32')
      local o, l = randn({ 2, 3, 5, 16 }, dt), randn({ 2, 3, 5 }, 'f32')
      al:narrow(2, 1, 1):narrow(3, 2, 1):fill_(-math.huge)   -- the block's alone
      l:narrow(2, 2, 1):narrow(3, 3, 1):fill_(-math.huge)    -- the accumulator's alone
      local a64, l64, o64, b64 = acc:double(), al:double(), o:double(), l:double()
      local m = ms.maximum(l64, b64)
      local wa, wb = (l64 - m):exp(), (b64 - m):exp()
      local s = wa + wb
      local want = (a64 * (wa / s):unsqueeze(4) + o64 * (wb / s):unsqueeze(4))
      local want_l = m + s:log()
      T.check(T.C.ms_attention_merge_(acc, al, o, l, 0))
      assert.is_true(relerr(acc, want) < 1e-6, dt .. ' ' .. relerr(acc, want))
      assert.is_true(relerr(al, want_l) < 1e-6)
      -- the block's share of a gradient, rounded once into the dtype asked for
      local g = randn({ 2, 5, 3, 16 }, dt):transpose(2, 3)   -- a (B, T, H, D) buffer's view
      local lb, lm = randn({ 2, 3, 5 }, 'f32'), randn({ 2, 3, 5 }, 'f32')
      local b = box()
      T.check(T.C.ms_attention_block_grad(b, g, lb, lm, T.dtype_id(dt)))
      local got = T.wrap(b[0])
      local gw = (g:double() * (lb:double() - lm:double()):exp():unsqueeze(4)):to(dt)
      assert.are.equal(dt, got.dtype)
      assert.is_true(relerr(got, gw) < (dt == 'f32' and 1e-6 or 4e-3), dt .. ' grad ' .. relerr(got, gw))
    end
  end)

  it('refuses mismatched shapes and dtypes, naming them', function()
    local acc, al = ms.zeros({ 1, 2, 3, 4 }), ms.zeros({ 1, 2, 3 })
    local o, l = ms.zeros({ 1, 2, 4, 4 }), ms.zeros({ 1, 2, 3 })
    assert.are_not.equal(0, T.C.ms_attention_merge_(acc, al, o, l, 0))
    assert.matches('o is .*%(1, ?2, ?4, ?4%)', ffi.string(T.C.ms_last_error()))
    assert.are_not.equal(0, T.C.ms_attention_merge_(ms.zeros({ 1, 2, 3, 4 }, { dtype = 'bf16' }), al, acc, l, 0))
    assert.matches('f32 or f64', ffi.string(T.C.ms_last_error()))
  end)
end)
