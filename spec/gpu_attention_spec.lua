-- The flash-style attention kernels (kernels/attention.cu) against the CPU
-- reference (core/attention_cpu.c): forward output, lse and dq/dk/dv on
-- random data, f32 ≤ 1e-5 and bf16 ≤ 1e-2 relative, for tile-straddling
-- lengths, grouped-query heads, head dims 32/64/128 and Tq != Tk.
local ms = require 'moonshard'
local ffi = require 'ffi'
local T = require 'moonshard.tensor'

local function relerr(got, want)
  local g, w = got:to('cpu'):double(), want:to('cpu'):double()
  local d = g - w
  return math.sqrt((d * d):sum():item() / (w * w):sum():item())
end

local box = ffi.typeof('ms_tensor*[1]')
local function attention(q, k, v, scale, causal)
  local o, l = box(), box()
  T.check(T.C.ms_attention(o, l, q, k, v, scale, causal and 1 or 0))
  return T.wrap(o[0]), T.wrap(l[0])
end
local function attention_backward(q, k, v, o, l, g, scale, causal)
  local a, b, c = box(), box(), box()
  T.check(T.C.ms_attention_backward(a, b, c, q, k, v, o, l, g, scale, causal and 1 or 0))
  return T.wrap(a[0]), T.wrap(b[0]), T.wrap(c[0])
end

local cases = {
  { B = 2, H = 4, Hkv = 4, Tq = 100, Tk = 100, D = 64, causal = true },
  { B = 1, H = 8, Hkv = 2, Tq = 130, Tk = 130, D = 32, causal = true },
  { B = 1, H = 2, Hkv = 1, Tq = 64, Tk = 64, D = 128, causal = true },
  { B = 2, H = 2, Hkv = 2, Tq = 37, Tk = 91, D = 64, causal = false },
  { B = 1, H = 4, Hkv = 2, Tq = 20, Tk = 150, D = 64, causal = true },
}

describe('fused attention on cuda #gpu', function()
  local seed = 900
  for n, c in ipairs(cases) do
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      it(('case %d in %s matches the CPU reference'):format(n, dt), function()
        local bound = dt == 'f32' and 1e-5 or 1e-2
        seed = seed + 10
        local q = ms.randn({ c.B, c.H, c.Tq, c.D }, { seed = seed }):to(dt)
        local k = ms.randn({ c.B, c.Hkv, c.Tk, c.D }, { seed = seed + 1 }):to(dt)
        local v = ms.randn({ c.B, c.Hkv, c.Tk, c.D }, { seed = seed + 2 }):to(dt)
        local g = ms.randn({ c.B, c.H, c.Tq, c.D }, { seed = seed + 3 }):to(dt)
        local scale = 1 / math.sqrt(c.D)
        -- the reference in f64 from the same (rounded) inputs
        local o1, l1 = attention(q:double(), k:double(), v:double(), scale, c.causal)
        local qg, kg, vg = q:cuda(), k:cuda(), v:cuda()
        local o2, l2 = attention(qg, kg, vg, scale, c.causal)
        assert.is_true(relerr(o2, o1) <= bound, 'out ' .. relerr(o2, o1))
        assert.is_true(relerr(l2, l1) <= 1e-5, 'lse ' .. relerr(l2, l1))
        local dq1, dk1, dv1 = attention_backward(q:double(), k:double(), v:double(), o2:to('cpu'):double(),
          l1, g:double(), scale, c.causal)
        local dq2, dk2, dv2 = attention_backward(qg, kg, vg, o2, l2, g:cuda(), scale, c.causal)
        assert.is_true(relerr(dq2, dq1) <= bound, 'dq ' .. relerr(dq2, dq1))
        assert.is_true(relerr(dk2, dk1) <= bound, 'dk ' .. relerr(dk2, dk1))
        assert.is_true(relerr(dv2, dv1) <= bound, 'dv ' .. relerr(dv2, dv1))
      end)
    end
  end

  it('transposed (B, T, H, D) views work without copies and give the same result', function()
    local x = ms.randn({ 2, 70, 3, 3 * 32 }, { seed = 77 }):cuda()
    local q = x:narrow(4, 1, 32):transpose(2, 3)
    local k = x:narrow(4, 33, 32):transpose(2, 3)
    local v = x:narrow(4, 65, 32):transpose(2, 3)
    local o1 = attention(q, k, v, 0.2, true)
    local o2 = attention(q:contiguous(), k:contiguous(), v:contiguous(), 0.2, true)
    assert.is_true(relerr(o1, o2) <= 1e-7)
  end)

  it('takes q, k and v in different layouts (k contiguous, v a transposed view, GQA)', function()
    local q = ms.randn({ 2, 32, 4, 16 }, { seed = 41 }):transpose(2, 3)
    local k = ms.randn({ 2, 2, 32, 16 }, { seed = 42 })
    local v = ms.randn({ 2, 32, 2, 16 }, { seed = 43 }):transpose(2, 3)
    local g = ms.randn({ 2, 4, 32, 16 }, { seed = 44 })
    local o1, l1 = attention(q:double(), k:double(), v:double(), 0.25, true)
    local o2, l2 = attention(q:cuda(), k:cuda(), v:cuda(), 0.25, true)
    assert.is_true(relerr(o2, o1) <= 1e-5, 'out ' .. relerr(o2, o1))
    local a1, b1, c1 = attention_backward(q:double(), k:double(), v:double(), o1, l1, g:double(), 0.25, true)
    local a2, b2, c2 = attention_backward(q:cuda(), k:cuda(), v:cuda(), o2, l2, g:cuda():transpose(3, 4):contiguous():transpose(3, 4), 0.25, true)
    assert.is_true(relerr(a2, a1) <= 1e-5 and relerr(b2, b1) <= 1e-5 and relerr(c2, c1) <= 1e-5)
  end)

  it('is deterministic: the same gradients bit for bit', function()
    local q = ms.randn({ 1, 4, 200, 64 }, { seed = 5, device = 'cuda' })
    local k = ms.randn({ 1, 4, 200, 64 }, { seed = 6, device = 'cuda' })
    local v = ms.randn({ 1, 4, 200, 64 }, { seed = 7, device = 'cuda' })
    local g = ms.randn({ 1, 4, 200, 64 }, { seed = 8, device = 'cuda' })
    local o, l = attention(q, k, v, 0.125, true)
    local a1, b1 = attention_backward(q, k, v, o, l, g, 0.125, true)
    local a2, b2 = attention_backward(q, k, v, o, l, g, 0.125, true)
    assert.are.same(a1:to('cpu'):totable(), a2:to('cpu'):totable())
    assert.are.same(b1:to('cpu'):totable(), b2:to('cpu'):totable())
  end)
end)
