-- Attention whose v head width Dv is not q/k's D (DeepSeek's MLA: q/k 192,
-- v 128): ms_attention and its backward (core/attention_cpu.c) with v at its
-- own width, through nnf.scaled_dot_product_attention against the unfused
-- path (f64 and f32), float64 finite differences, the block merge that
-- context parallelism uses, the padded path sdpa takes where a GPU's kernels
-- lack the widths (run here on the CPU with the widths stubbed), and the
-- refusals. The GPU kernels' (192, 128) runs in spec/gpu_attention_spec.lua
-- (#gpu) and in the emulator (spec/attention_mma_emu_spec.lua).
local ms = require 'moonshard'
local nnf = require 'moonshard.nn.functional'
local T = require 'moonshard.tensor'
local ffi = require 'ffi'

local function relerr(a, b)
  local d = (a:double() - b:double())
  local n = (b:double() * b:double()):sum():item()
  return math.sqrt((d * d):sum():item() / n)
end

local seed = 900
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed }):to(dtype or 'f64')
end

-- y and the gradients of sum(y * g) (the tape run before the next graph)
local function fwd_bwd(q, k, v, g, opts)
  local y = nnf.scaled_dot_product_attention(q, k, v, opts)
  ms.sum(y * g):backward()
  local r = { y:detach():clone(), q.grad:clone(), k.grad:clone(), v.grad:clone() }
  q.grad, k.grad, v.grad = nil, nil, nil
  return r
end

local cases = {
  { B = 2, H = 4, Hkv = 4, T = 13, Tk = 13, D = 12, Dv = 8, causal = true },    -- v narrower
  { B = 1, H = 6, Hkv = 2, T = 70, Tk = 70, D = 24, Dv = 16, causal = true },   -- GQA, past a 64-tile
  { B = 2, H = 2, Hkv = 1, T = 5, Tk = 9, D = 4, Dv = 10, causal = false },     -- v wider, Tq != Tk, GQA
  { B = 1, H = 3, Hkv = 3, T = 4, Tk = 9, D = 6, Dv = 2, causal = true },       -- the last 4 of 9 (KV cache)
  { B = 1, H = 4, Hkv = 1, T = 7, Tk = 7, D = 8, Dv = 12, causal = false },     -- v wider, one kv head
}

describe('attention with v narrower or wider than q/k (Dv != D)', function()
  for n, c in ipairs(cases) do
    local what = ('D %d, Dv %d, H %d/Hkv %d, Tq %d, Tk %d, %s'):format(c.D, c.Dv, c.H, c.Hkv, c.T, c.Tk,
      c.causal and 'causal' or 'full')
    it(('fused equals the unfused path, forward and backward, f64 (%s)'):format(what), function()
      local q = randn({ c.B, c.H, c.T, c.D }):requires_grad_()
      local k = randn({ c.B, c.Hkv, c.Tk, c.D }):requires_grad_()
      local v = randn({ c.B, c.Hkv, c.Tk, c.Dv }):requires_grad_()
      local g = randn({ c.B, c.H, c.T, c.Dv })
      local a = fwd_bwd(q, k, v, g, { causal = c.causal })
      local b = fwd_bwd(q, k, v, g, { causal = c.causal, unfused = true })
      assert.are.same({ c.B, c.H, c.T, c.Dv }, a[1].shape)
      assert.are.same({ c.B, c.Hkv, c.Tk, c.Dv }, a[4].shape)
      for i, name in ipairs({ 'out', 'dq', 'dk', 'dv' }) do
        assert.is_true(relerr(a[i], b[i]) < 1e-12, name .. ' ' .. relerr(a[i], b[i]))
      end
    end)

    it(('f32 within 1e-5 of the f64 result, forward and backward (%s)'):format(what), function()
      local q = randn({ c.B, c.H, c.T, c.D }):requires_grad_()
      local k = randn({ c.B, c.Hkv, c.Tk, c.D }):requires_grad_()
      local v = randn({ c.B, c.Hkv, c.Tk, c.Dv }):requires_grad_()
      local g = randn({ c.B, c.H, c.T, c.Dv })
      local ref = fwd_bwd(q, k, v, g, { causal = c.causal, unfused = true })
      local qf, kf, vf = q:detach():to('f32'), k:detach():to('f32'), v:detach():to('f32')
      for _, t in ipairs({ qf, kf, vf }) do t:requires_grad_() end
      local got = fwd_bwd(qf, kf, vf, g:to('f32'), { causal = c.causal })
      assert.are.equal('f32', got[1].dtype)
      for i, name in ipairs({ 'out', 'dq', 'dk', 'dv' }) do
        assert.is_true(relerr(got[i], ref[i]) < 1e-5, name .. ' ' .. relerr(got[i], ref[i]))
      end
    end)
  end

  it('passes a float64 finite-difference check (v narrower, and wider, GQA)', function()
    for _, w in ipairs({ { 6, 4 }, { 4, 6 } }) do
      local q = randn({ 1, 2, 6, w[1] }):requires_grad_()
      local k, v = randn({ 1, 1, 6, w[1] }):requires_grad_(), randn({ 1, 1, 6, w[2] }):requires_grad_()
      local worst = ms.autograd.gradcheck(function()
        return nnf.scaled_dot_product_attention(q, k, v, { causal = true })
      end, { q, k, v })
      assert.is_true(worst < 1e-6, ('D %d, Dv %d: relative error %g'):format(w[1], w[2], worst))
    end
  end)

  it('ms_attention_backward_sum: dsum of H·D + Hkv·D + Hkv·Dv, the column sums of dq, dk, dv', function()
    local q, k, v = randn({ 2, 4, 5, 6 }), randn({ 2, 2, 5, 6 }), randn({ 2, 2, 5, 3 })
    local box = ffi.typeof('ms_tensor*[1]')
    local o, l = box(), box()
    T.check(T.C.ms_attention(o, l, q, k, v, 0.4, 1))
    local out, lse = T.wrap(o[0]), T.wrap(l[0])
    assert.are.same({ 2, 4, 5, 3 }, out.shape)
    local g = randn({ 2, 4, 5, 3 })
    local dq, dk, dv = box(), box(), box()
    local ds = ms.zeros({ 4 * 6 + 2 * 6 + 2 * 3 }, { dtype = 'f32' })
    assert.are.equal(1, T.C.ms_attention_backward_sum(dq, dk, dv, q, k, v, out, lse, g, 0.4, 1, ds))
    dq, dk, dv = T.wrap(dq[0]), T.wrap(dk[0]), T.wrap(dv[0])
    assert.are.same({ 2, 2, 5, 3 }, dv.shape)
    local want = ms.cat({ dq:sum(1):sum(2):reshape(-1), dk:sum(1):sum(2):reshape(-1), dv:sum(1):sum(2):reshape(-1) }, 1)
    assert.is_true(relerr(ds, want) < 1e-6, 'dsum ' .. relerr(ds, want))
    local bad = ms.zeros({ (4 + 2 * 2) * 6 }, { dtype = 'f32' })   -- sized as if Dv were D
    assert.are.equal(-1, T.C.ms_attention_backward_sum(box(), box(), box(), q, k, v, out, lse, g, 0.4, 1, bad))
    assert.matches('H·D %+ Hkv·D %+ Hkv·Dv', ffi.string(T.C.ms_last_error()))
  end)

  it('merging the attention of two key blocks gives the whole attention at v\'s width (f64)', function()
    local q, k, v = randn({ 1, 2, 6, 5 }), randn({ 1, 2, 10, 5 }), randn({ 1, 2, 10, 3 })
    local box = ffi.typeof('ms_tensor*[1]')
    local function attn(kk, vv)
      local o, l = box(), box()
      T.check(T.C.ms_attention(o, l, q, kk, vv, 0.5, 0))
      return T.wrap(o[0]), T.wrap(l[0])
    end
    local whole = attn(k, v)
    local o1, l1 = attn(k:narrow(3, 1, 4):contiguous(), v:narrow(3, 1, 4):contiguous())
    local o2, l2 = attn(k:narrow(3, 5, 6):contiguous(), v:narrow(3, 5, 6):contiguous())
    local acc, al = ms.empty({ 1, 2, 6, 3 }, { dtype = 'f64' }), ms.empty({ 1, 2, 6 }, { dtype = 'f64' })
    T.check(T.C.ms_attention_merge_(acc, al, o1, l1, 1))
    T.check(T.C.ms_attention_merge_(acc, al, o2, l2, 0))
    assert.is_true(relerr(acc, whole) < 1e-13, 'merged ' .. relerr(acc, whole))
    -- a block's gradient share at v's width
    local b = box()
    T.check(T.C.ms_attention_block_grad(b, whole, l1, al, T.dtype_id('f64')))
    assert.are.same({ 1, 2, 6, 3 }, T.wrap(b[0]).shape)
  end)

  it('gives the head widths it runs at: its own on the CPU', function()
    local wq, wv = nnf.attention_widths(randn({ 1, 1, 2, 192 }), 192, 128)
    assert.are.same({ 192, 128 }, { wq, wv })
    wq, wv = nnf.attention_widths(randn({ 1, 1, 2, 40 }, 'bf16'), 40, 300)
    assert.are.same({ 40, 300 }, { wq, wv })
  end)

  describe('padded to the widths a GPU\'s kernels take (the widths stubbed, run on the CPU)', function()
    local real = nnf.attention_widths
    after_each(function() nnf.attention_widths = real end)
    -- as a GPU's: one width up to 16 here, else q/k 24 with v 16
    local function stub(_, D, Dv)
      local w = math.max(D, Dv)
      if w <= 16 then return w, w end
      if D <= 24 and Dv <= 16 then return 24, 16 end
      return nil, 'none'
    end

    for _, w in ipairs({ { 12, 8 }, { 6, 10 }, { 20, 7 }, { 24, 10 } }) do
      it(('q/k %d, v %d: the result and gradients of the unpadded attention (f64, GQA)'):format(w[1], w[2]), function()
        local q = randn({ 2, 4, 9, w[1] }):requires_grad_()
        local k = randn({ 2, 2, 11, w[1] }):requires_grad_()
        local v = randn({ 2, 2, 11, w[2] }):requires_grad_()
        local g = randn({ 2, 4, 9, w[2] })
        local want = fwd_bwd(q, k, v, g, { causal = true, unfused = true })
        nnf.attention_widths = stub
        local got = fwd_bwd(q, k, v, g, { causal = true, scale = 1 / math.sqrt(w[1]) })
        nnf.attention_widths = real
        assert.are.same({ 2, 4, 9, w[2] }, got[1].shape)
        assert.are.same(v.shape, got[4].shape)
        for i, name in ipairs({ 'out', 'dq', 'dk', 'dv' }) do
          assert.is_true(relerr(got[i], want[i]) < 1e-12, name .. ' ' .. relerr(got[i], want[i]))
        end
      end)
    end

    it('passes a float64 finite-difference check padded', function()
      local q = randn({ 1, 2, 5, 6 }):requires_grad_()
      local k, v = randn({ 1, 1, 5, 6 }):requires_grad_(), randn({ 1, 1, 5, 3 }):requires_grad_()
      nnf.attention_widths = function() return 8, 8 end
      local worst = ms.autograd.gradcheck(function()
        return nnf.scaled_dot_product_attention(q, k, v, { causal = true })
      end, { q, k, v })
      assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    end)

    it('falls back to the unfused path where no width fits', function()
      local q = randn({ 1, 2, 5, 30 }):requires_grad_()
      local k, v = randn({ 1, 2, 5, 30 }):requires_grad_(), randn({ 1, 2, 5, 20 }):requires_grad_()
      local g = randn({ 1, 2, 5, 20 })
      local want = fwd_bwd(q, k, v, g, { causal = false, unfused = true })
      nnf.attention_widths = stub
      local got = fwd_bwd(q, k, v, g, { causal = false })
      for i = 1, 4 do assert.is_true(relerr(got[i], want[i]) < 1e-12) end
    end)
  end)

  it('refuses shapes that do not fit, naming them', function()
    local ok, err = pcall(nnf.scaled_dot_product_attention, randn({ 1, 2, 4, 8 }), randn({ 1, 2, 4, 8 }),
      randn({ 1, 2, 5, 6 }))
    assert.is_false(ok)
    assert.matches('%(1, 2, 5, 6%)', err)
    assert.matches('v %(B, Hkv, Tk, Dv%)', err)
    local box = ffi.typeof('ms_tensor*[1]')
    local q, k, v = randn({ 1, 2, 4, 8 }), randn({ 1, 2, 4, 8 }), randn({ 1, 2, 4, 6 })
    local o, l = box(), box()
    T.check(T.C.ms_attention(o, l, q, k, v, 0.3, 1))
    local out, lse = T.wrap(o[0]), T.wrap(l[0])
    local dq, dk, dv = box(), box(), box()
    -- a dout of q's width where v's is expected
    ok, err = pcall(function()
      T.check(T.C.ms_attention_backward(dq, dk, dv, q, k, v, out, lse, randn({ 1, 2, 4, 8 }), 0.3, 1))
    end)
    assert.is_false(ok)
    assert.matches('dout is .*%(1, ?2, ?4, ?8%).*expected %(1,2,4,6%)', err)
    -- an out buffer of q's width
    local o2 = box()
    o2[0] = ms.empty({ 1, 2, 4, 8 }, { dtype = 'f64' })
    local l2 = box()
    ok, err = pcall(function() T.check(T.C.ms_attention(o2, l2, q, k, v, 0.3, 1)) end)
    assert.is_false(ok)
    assert.matches('attention: out is', err)
  end)
end)
