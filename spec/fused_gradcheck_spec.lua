-- Finite-difference gradient checks in float64 of the autograd nodes built
-- on the fused ops (nn.functional.layer_norm, rms_norm, apply_rotary; the
-- nn modules on them), as spec/gradcheck_spec.lua does for the rest:
-- random data, central differences, relative error < 1e-6.
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local nnf = nn.functional
local A = ms.autograd
local F = ms.raw

local TOL = 1e-6
local seed = 900
local function rnd(shape, scale)
  seed = seed + 1
  local t = ms.randn(shape, { dtype = 'f64', seed = seed })
  if scale then t = F.mul(t, scale) end
  return t:requires_grad_()
end

local function check(fn, tensors)
  local worst, reports = A.gradcheck(fn, tensors)
  for i, r in ipairs(reports) do
    assert(r.norm > 0 or r.rel == 0, 'input ' .. i .. ' got no gradient at all')
  end
  assert(worst < TOL, ('relative error %.3e'):format(worst))
end

describe('gradcheck: fused norms', function()
  it('layer_norm with weight and bias, weight only, neither', function()
    local x, w, b = rnd({ 3, 4, 9 }), rnd({ 9 }), rnd({ 9 })
    check(function() return nnf.layer_norm(x, w, b, 1e-5) end, { x, w, b })
    check(function() return nnf.layer_norm(x, w, nil, 1e-3) end, { x, w })
    check(function() return nnf.layer_norm(x, nil, b) end, { x, b })
    check(function() return nnf.layer_norm(x) end, { x })
  end)
  it('layer_norm of a non-contiguous input and of a 1-D input', function()
    local x, w = rnd({ 6, 5 }), rnd({ 6 })
    check(function() return nnf.layer_norm(x:t(), w) end, { x, w })
    local v = rnd({ 11 })
    check(function() return nnf.layer_norm(v) end, { v })
  end)
  it('layer_norm where only the parameters need gradients', function()
    local x = ms.randn({ 5, 7 }, { dtype = 'f64', seed = 3 })
    local w, b = rnd({ 7 }), rnd({ 7 })
    check(function() return nnf.layer_norm(x, w, b) end, { w, b })
  end)
  it('rms_norm with and without weight', function()
    local x, w = rnd({ 2, 5, 12 }), rnd({ 12 })
    check(function() return nnf.rms_norm(x, w, 1e-6) end, { x, w })
    check(function() return nnf.rms_norm(x) end, { x })
    check(function() return nnf.rms_norm(x:transpose(1, 2), w) end, { x, w })
  end)
  it('a norm used twice (the residual-stream pattern) sums its gradients', function()
    local x, w, b = rnd({ 4, 6 }), rnd({ 6 }), rnd({ 6 })
    check(function()
      local h = x + nnf.layer_norm(x, w, b)
      return h + nnf.rms_norm(h, w)
    end, { x, w, b })
  end)
  it('nn.LayerNorm and nn.RMSNorm modules', function()
    local ln = nn.LayerNorm(8):to('f64')
    local rms = nn.RMSNorm(8):to('f64')
    for _, p in ipairs({ ln.weight, ln.bias, rms.weight }) do
      ms.no_grad(function() F.add_(p, F.mul(ms.randn(p.shape, { dtype = 'f64', seed = 11 }), 0.3)) end)
    end
    local x = rnd({ 3, 8 })
    check(function() return rms(ln(x)) end, { x, ln.weight, ln.bias, rms.weight })
  end)
end)

describe('gradcheck: fused add + norm', function()
  -- x a leaf whose other gradient arrives after the norm's and before h's:
  -- the norm hands x and h the same dx; x's gradient, added into in place,
  -- must not be h's storage
  for _, which in ipairs({ 'add_rms_norm', 'add_layer_norm' }) do
    it(which .. ': res and y, x a leaf used again, h from an earlier op', function()
      local x, hh, w = rnd({ 4, 8 }), rnd({ 4, 8 }), rnd({ 8 })
      check(function()
        local h = hh * 2
        local s0 = x:square():sum()
        local res, y = nnf[which](x, h, w)
        return s0 + (res * 3):sum() + y:square():sum()
      end, { x, hh, w })
    end)
  end
end)

describe('gradcheck: fused rotary embedding', function()
  it('apply_rotary with a rope cache, contiguous and transposed inputs', function()
    local cos, sin = nnf.rope_cache(5, 8, 10000, 'f64')
    local x = rnd({ 2, 3, 5, 8 })
    check(function() return nnf.apply_rotary(x, cos, sin) end, { x })
    local y = rnd({ 2, 5, 3, 8 })
    check(function() return nnf.apply_rotary(y:transpose(2, 3), cos, sin) end, { y })
  end)
  it('apply_rotary with arbitrary (non-rotation) cos and sin', function()
    local cos, sin = ms.randn({ 4, 6 }, { dtype = 'f64', seed = 5 }), ms.randn({ 4, 6 }, { dtype = 'f64', seed = 6 })
    local x = rnd({ 3, 4, 6 })
    check(function() return nnf.apply_rotary(x, cos, sin) end, { x })
  end)
end)

describe('gradcheck: inside an autocast region', function()
  it('f64 tensors are not cast, so the checks hold in a region too', function()
    local x, w, b = rnd({ 3, 6 }), rnd({ 4, 6 }), rnd({ 4 })
    local lw = rnd({ 4 })
    check(function()
      return nnf.autocast('bf16', function()
        return nnf.layer_norm(nnf.linear(x, w, b), lw)
      end)
    end, { x, w, b, lw })
  end)
end)
