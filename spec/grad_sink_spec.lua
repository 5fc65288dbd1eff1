-- Gradient sinks (autograd.set_grad_sink, docs/autograd.md): a leaf's
-- gradient written straight into a wider buffer by the op that makes it,
-- FSDP's f32 unsharded gradient of a bf16 parameter; and the GEMM under it,
-- ops.gemm_ with an f32 out of bf16/f16 operands. CPU; the CUDA GEMM is in
-- gpu_ops_spec.lua.
local ms = require 'moonshard'
local A = require 'moonshard.autograd'
local F = require 'moonshard.ops'
local S = require 'spec.support'
local nnf = ms.nn.functional

local seed = 4200
local function randn(shape, dtype, scale)
  seed = seed + 1
  local t = ms.randn(shape, { seed = seed })
  if scale then t = t * scale end
  return t:to(dtype or 'f32')
end
local function maxdiff(a, b) return (a:to('f64') - b:to('f64')):abs():max():item() end

describe('ops.gemm_ with an f32 out of bf16/f16 operands', function()
  for _, dt in ipairs({ 'bf16', 'f16' }) do
    for _, tr in ipairs({ { false, false }, { true, false }, { false, true }, { true, true } }) do
      it(('%s, transa %s, transb %s: the product of the widened operands (f32 rounding); beta accumulates'):format(
        dt, tostring(tr[1]), tostring(tr[2])), function()
        local M, K, N = 37, 53, 29
        local a = randn(tr[1] and { K, M } or { M, K }, dt)
        local b = randn(tr[2] and { N, K } or { K, N }, dt)
        local out = ms.empty({ M, N })
        F.gemm_(out, a, b, tr[1], tr[2], 1, 0)
        -- (f32 sums: the widened copies are contiguous, the reference reads
        -- a transposed view, so BLAS may add in another order)
        local want = F.matmul(a:to('f32'), b:to('f32'), tr[1], tr[2])
        assert.is_true(S.relerr(out, want) < 1e-6)
        assert.is_true(want:abs():max():item() > 0)
        -- accumulated, with alpha
        local c0 = randn({ M, N })
        local acc = c0:clone()
        F.gemm_(acc, a, b, tr[1], tr[2], 0.5, 1)
        assert.is_true(S.relerr(acc, c0 + want * 0.5) < 1e-6)
      end)
    end
  end

  it('other dtype mixes are an error naming the dtypes', function()
    local a, b = randn({ 4, 4 }, 'bf16'), randn({ 4, 4 }, 'f16')
    local e = S.errmsg(function() F.gemm_(ms.empty({ 4, 4 }), a, b, false, false, 1, 0) end)
    assert.is_truthy(e:find('dtypes differ', 1, true), e)
    assert.is_truthy(e:find('bf16', 1, true) and e:find('f16', 1, true), e)
    e = S.errmsg(function() F.gemm_(ms.empty({ 4, 4 }, { dtype = 'f16' }), a, a, false, false, 1, 0) end)
    assert.is_truthy(e:find('an f32 out takes bf16 or f16 operands', 1, true), e)
    e = S.errmsg(function() F.gemm_(ms.empty({ 4, 4 }, { dtype = 'f64' }), a, a, false, false, 1, 0) end)
    assert.is_truthy(e:find('dtypes differ', 1, true), e)
  end)
end)

describe('autograd.set_grad_sink', function()
  -- a leaf's sink: the f32 buffer, its written flags
  local function sink_for(w, dtype)
    local s = { t = ms.empty(w.shape, { dtype = dtype or 'f32' }), written = {}, i = 1 }
    A.set_grad_sink(w, s)
    return s
  end

  for _, case in ipairs({ { 'linear', true }, { 'conv1d_linear', false } }) do
    local name, wt = case[1], case[2]
    it(name .. ' (bf16): the weight GEMM writes its f32 gradient into the sink, no .grad; it rounds to the bf16 gradient; a second backward adds', function()
      local x = randn({ 6, 5, 24 }, 'bf16')
      local w0 = randn(wt and { 16, 24 } or { 24, 16 }, 'bf16', 0.2)
      local b0 = randn({ 16 }, 'bf16')
      local gy = randn({ 6, 5, 16 }, 'bf16')
      -- the bias a constant (its gradient wanted, see below)
      local function run(with_sink)
        local w = w0:clone():requires_grad_()
        local s = with_sink and sink_for(w) or nil
        nnf[name](x, w, b0):backward(gy)
        return w, s
      end
      local w1 = run(false)
      local w2, s = run(true)
      assert.is_nil(w2.grad)
      assert.is_true(s.written[1])
      -- the sink holds the f32 product; rounded, the bf16 gradient
      assert.are.equal(0, maxdiff(s.t:to('bf16'), w1.grad))
      local x2, g2 = x:reshape({ 30, 24 }):to('f32'), gy:reshape({ 30, 16 }):to('f32')
      local want = wt and F.matmul(g2, x2, true, false) or F.matmul(x2, g2, true, false)
      assert.is_true(S.relerr(s.t, want) < 1e-6)
      assert.is_true(want:abs():max():item() > 0)
      -- a second backward accumulates into it
      local first = s.t:clone()
      nnf[name](x, w2, b0):backward(gy)
      assert.is_nil(w2.grad)
      assert.are.equal(0, maxdiff(s.t, first * 2))
      -- cleared: the next backward returns .grad again
      A.set_grad_sink(w2, nil)
      nnf[name](x, w2, b0):backward(gy)
      assert.are.equal(0, maxdiff(w2.grad, w1.grad))
      -- a bias whose gradient nobody gave: the weight and bias gradients
      -- come from one GEMM (its BGRAD epilogue on CUDA), in the operands'
      -- dtype, and the sink is left alone (a separate column sum over the
      -- rows would cost more than the copy it saves)
      local w3, b3 = w0:clone():requires_grad_(), b0:clone():requires_grad_()
      local s3 = sink_for(w3)
      nnf[name](x, w3, b3):backward(gy)
      assert.are.equal(0, maxdiff(w3.grad, w1.grad))
      assert.is_not_nil(b3.grad)
      assert.is_nil(s3.written[1])
    end)
  end

  it('gelu_mlp (bf16): both weights into their sinks; the rest of the gradients unchanged', function()
    local x = randn({ 12, 16 }, 'bf16')
    local p0 = { randn({ 16, 32 }, 'bf16', 0.2), randn({ 32 }, 'bf16'), randn({ 32, 16 }, 'bf16', 0.2), randn({ 16 }, 'bf16') }
    local gy = randn({ 12, 16 }, 'bf16')
    local function run(with_sink)
      local xx = x:clone():requires_grad_()
      local p, s = {}, {}
      for k, t in ipairs(p0) do p[k] = t:clone():requires_grad_() end
      p[4]:requires_grad_(false)   -- b2 a constant: w2's gradient alone (see the linear case)
      if with_sink then s[1], s[3] = sink_for(p[1]), sink_for(p[3]) end
      nnf.gelu_mlp(xx, p[1], p[2], p[3], p[4], false):backward(gy)
      return xx, p, s
    end
    local x1, p1 = run(false)
    local x2, p2, s = run(true)
    assert.is_nil(p2[1].grad)
    assert.is_nil(p2[3].grad)
    assert.are.equal(0, maxdiff(x2.grad, x1.grad))
    assert.are.equal(0, maxdiff(p2[2].grad, p1[2].grad))
    assert.is_nil(p2[4].grad)
    assert.are.equal(0, maxdiff(s[1].t:to('bf16'), p1[1].grad))
    assert.are.equal(0, maxdiff(s[3].t:to('bf16'), p1[3].grad))
  end)

  it('f64: the sink holds the gradient autograd returns (finite-difference checked in gradcheck_spec)', function()
    local x = randn({ 7, 9 }, 'f64')
    local w = randn({ 5, 9 }, 'f64'):requires_grad_()
    local ref = w:detach():clone():requires_grad_()
    local gy = randn({ 7, 5 }, 'f64')
    nnf.linear(x, ref):backward(gy)
    local s = sink_for(w, 'f64')
    nnf.linear(x, w):backward(gy)
    assert.is_nil(w.grad)
    assert.is_true(maxdiff(s.t, ref.grad) < 1e-12)
  end)

  it('a leaf with hooks keeps its ordinary gradient (hooks see every gradient)', function()
    local x = randn({ 4, 8 }, 'bf16')
    local w = randn({ 3, 8 }, 'bf16'):requires_grad_()
    local seen = 0
    w:register_hook(function(g) seen = seen + 1; return g end)
    local s = sink_for(w)
    nnf.linear(x, w):backward(randn({ 4, 3 }, 'bf16'))
    assert.are.equal(1, seen)
    assert.is_not_nil(w.grad)
    assert.is_nil(s.written[1])
  end)

  it('a sink of the wrong shape or layout is an error naming the shapes', function()
    local w = randn({ 3, 8 }, 'bf16'):requires_grad_()
    local e = S.errmsg(function() A.set_grad_sink(w, { t = ms.empty({ 8, 3 }), written = {}, i = 1 }) end)
    assert.is_truthy(e:find('(3, 8)', 1, true), e)
    e = S.errmsg(function() A.set_grad_sink(w, { t = ms.empty({ 8, 3 }):t(), written = {}, i = 1 }) end)
    assert.is_truthy(e:find('contiguous', 1, true), e)
  end)
end)

describe('fused_linear_cross_entropy into a gradient sink', function()
  local FLCE = nnf.fused_linear_cross_entropy
  local BT, H, V = 37, 16, 53
  local function tg()
    seed = seed + 1
    return (ms.rand({ BT }, { seed = seed, dtype = 'f64' }) * V):to('i64')
  end

  for _, c in ipairs({ { 'bf16', 'f32' }, { 'f32', 'f32' }, { 'f64', 'f64' } }) do
    local wdt, sdt = c[1], c[2]
    it(('%s W, %s sink: grad_W accumulated there in the forward, marked until the backward scales it'):format(wdt, sdt), function()
      local x0, W0, t = randn({ BT, H }, wdt), randn({ V, H }, wdt, 0.3), tg()
      local function go(with_sink, g)
        local x, W = x0:clone():requires_grad_(), W0:clone():requires_grad_()
        return S.flce_sink_run(x, W, t, { chunk_size = 10 }, with_sink and ms.empty({ V, H }, { dtype = sdt }) or nil, g)
      end
      for _, g in ipairs({ false, 0.75 }) do
        local sw, sx = go(true, g or nil)
        local bw, bx = go(false, g or nil)
        assert.are.equal(0, maxdiff(sx, bx))
        if not g or wdt ~= 'bf16' then
          -- the same f32 (f64) sums; bf16: the gradient is their rounding
          assert.are.equal(0, maxdiff(sw:to(wdt), bw))
        else
          assert.is_true(maxdiff(sw, bw) <= 1e-2 * bw:abs():max():item())
        end
      end
    end)
  end

  it('a linear using the weight after the loss leaves the marked sink alone: its gradient goes to .grad', function()
    local x, W0, t = randn({ BT, H }, 'bf16'), randn({ V, H }, 'bf16', 0.3), tg()
    local function go(with_linear)
      local W = W0:clone():requires_grad_()
      local s = { t = ms.empty({ V, H }), written = {}, i = 1 }
      A.set_grad_sink(W, s)
      local loss = FLCE(x, W, t)
      if with_linear then loss = loss + nnf.linear(x, W):sum() end   -- its backward runs before the loss's
      loss:backward()
      assert.is_true(s.written[1])
      return s.t, W.grad
    end
    local s1, g1 = go(true)
    local s0, g0 = go(false)
    assert.is_nil(g0)
    assert.are.equal(0, maxdiff(s1, s0))
    assert.are.equal(0, maxdiff(g1, F.matmul(ms.ones({ BT, V }, { dtype = 'bf16' }), x, true, false)))
  end)

  it('a sink already holding a gradient, or of another dtype, is not used: the gradient goes to .grad', function()
    for _, case in ipairs({ { written = true, dt = 'f32' }, { dt = 'bf16' } }) do
      local x, W = randn({ BT, H }, 'bf16'), randn({ V, H }, 'bf16', 0.3):requires_grad_()
      local s = { t = ms.zeros({ V, H }, { dtype = case.dt }), written = { case.written }, i = 1 }
      A.set_grad_sink(W, s)
      FLCE(x, W, tg()):backward()
      assert.is_not_nil(W.grad)
      assert.are.equal(case.written, s.written[1])
      assert.are.equal(0, s.t:abs():max():item())
    end
  end)

  it('a sink released between the forward and the backward is an error that says the gradient is lost', function()
    local x, W = randn({ BT, H }, 'bf16'), randn({ V, H }, 'bf16', 0.3):requires_grad_()
    local s = { t = ms.empty({ V, H }), written = {}, i = 1 }
    A.set_grad_sink(W, s)
    local loss = FLCE(x, W, tg())
    s.written[1] = nil   -- (as an owner's reset would)
    local e = S.errmsg(function() loss:backward() end)
    assert.is_truthy(e:find('gradient is lost', 1, true), e)
  end)
end)
