-- Float8 on the CPU (core/fp8.h, core/float8.c, lua/moonshard/float8.lua):
-- the two formats against a decoder and a nearest-even rounding written here
-- from the formats' definitions (every code, ties, saturation, overflow,
-- subnormals, f64 sources), amax, the scaled cast in both layouts, the
-- scaled product against an f64 product of the decoded operands, the FP8
-- linear layer (Linear and Conv1D layouts, bias, 3-D input, the f32
-- sink) against the same products written out here, its gradients against
-- the f64 finite differences of the linear map it approximates, the shared
-- input cast, float8.convert on the models and through bin/train, and the
-- errors; the rowwise recipes; the blockwise recipe (DeepSeek-V3's 1 x 128 /
-- 128 x 128 casts and their scales' layouts against an f64 reference, the
-- block-scaled product, the layer against its products written out, the
-- bf16 layer and the finite differences, convert, checkpointing, training).
-- The GPU side is spec/gpu_float8_spec.lua.
local ffi = require 'ffi'
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local S = require 'spec.support'

local F = ms.raw
local float8 = ms.float8
local nnf = ms.nn.functional
local values, relerr = S.values, S.relerr

-- ---------------------------------------------------- the formats, written out
local f32buf = ffi.new('float[1]')
local function f32(v) f32buf[0] = v; return f32buf[0] end

local fmt = {
  f8e4m3 = { e5 = false, max = 448, max_code = 0x7e },
  f8e5m2 = { e5 = true, max = 57344, max_code = 0x7b },
}

-- the value of code c (0..255) from the format's definition
local function decode(c, name)
  local neg = c >= 128
  c = c % 128
  local v
  if name == 'f8e4m3' then
    local e, m = math.floor(c / 8), c % 8
    if e == 15 and m == 7 then return 0 / 0 end
    v = e == 0 and m * 2 ^ -9 or (1 + m / 8) * 2 ^ (e - 7)
  else
    local e, m = math.floor(c / 4), c % 4
    if e == 31 then return m == 0 and (neg and -math.huge or math.huge) or 0 / 0 end
    v = e == 0 and m * 2 ^ -16 or (1 + m / 4) * 2 ^ (e - 15)
  end
  return neg and -v or v
end

-- the positive values by code, 0 .. max_code, and one step past the largest
-- (e4m3: 480, whose code 0x7f is NaN; e5m2: 65536, the infinity 0x7c)
local tables = {}
for name, f in pairs(fmt) do
  local t = {}
  for c = 0, f.max_code do t[c] = decode(c, name) end
  t[f.max_code + 1] = name == 'f8e4m3' and 480 or 65536
  tables[name] = t
end

-- x rounded to the nearest value of the format, ties to the even code;
-- sat: beyond the largest finite value, that value
local function round8(x, name, sat)
  if x ~= x then return 0 / 0 end
  local f, t = fmt[name], tables[name]
  local a = math.abs(x)
  local r
  if sat and a >= f.max then r = f.max
  else
    local lo, hi = 0, f.max_code + 1
    if a >= t[hi] then r = t[hi]
    else
      while hi - lo > 1 do
        local mid = math.floor((lo + hi) / 2)
        if t[mid] <= a then lo = mid else hi = mid end
      end
      local dl, dh = a - t[lo], t[hi] - a
      local c = (dl < dh or (dl == dh and lo % 2 == 0)) and lo or hi
      r = t[c]
    end
    if r > f.max then r = f.e5 and math.huge or 0 / 0 end   -- past the largest: inf (e5m2), NaN (e4m3)
  end
  if x < 0 or (x == 0 and 1 / x < 0) then r = -r end
  return r
end

local function same(a, b)   -- equal values, NaN equal to NaN, -0 and 0 apart
  if a ~= a then return b ~= b end
  if a == 0 and b == 0 then return 1 / a == 1 / b end
  return a == b
end

local seed = 7100
local function randn(shape, scale, dtype)
  seed = seed + 1
  local t = ms.randn(shape, { seed = seed })
  if scale then t = F.mul(t, scale) end
  return dtype and dtype ~= 'f32' and t:to(dtype) or t
end

-- values of every kind: each representable value, the midpoints between
-- neighbours (ties), values just around them, the overflow thresholds,
-- zeros, infinities, NaN, f32 subnormals and random magnitudes from 2^-24 to 2^17
local function probe_values(name)
  local t, f = tables[name], fmt[name]
  local v = { 0, -0.0, math.huge, -math.huge, 0 / 0, 1e-45, -1e-45, 1e-40, 3e38, -3e38 }
  for c = 0, f.max_code do
    local a, b = t[c], t[c + 1]
    local mid = (a + b) / 2
    for _, x in ipairs({ a, mid, f32(mid * (1 + 2 ^ -20)), f32(mid * (1 - 2 ^ -20)) }) do
      v[#v + 1] = f32(x)
      v[#v + 1] = -f32(x)
    end
  end
  for _, x in ipairs({ 448, 460, 464, 465, 479, 480, 500, 57344, 61439, 61440, 61441, 65536, 1e5 }) do
    v[#v + 1] = x
    v[#v + 1] = -x
  end
  local r = ms.rand({ 600 }, { dtype = 'f64', seed = 77 })
  local u = ms.rand({ 600 }, { dtype = 'f64', seed = 78 })
  local rv, uv = values(r), values(u)
  for i = 1, 600 do v[#v + 1] = f32((uv[i] < 0.5 and -1 or 1) * 2 ^ (rv[i] * 41 - 24)) end
  return v
end

describe('float8 formats', function()
  it('every code decodes to the value the format defines (both formats, all 256 codes)', function()
    for name, f in pairs(fmt) do
      local e5 = f.e5 and 1 or 0
      for c = 0, 255 do
        local want = decode(c, name)
        local got = T.C.ms_f8_to_f32(c, e5)
        assert.is_true(same(want, got), ('%s code 0x%02x: %s, want %s'):format(name, c, got, want))
      end
    end
  end)

  it('f32 -> f8 rounds to nearest even (ties, overflow to NaN / inf, subnormals); back to f32 exactly', function()
    for name in pairs(fmt) do
      local v = probe_values(name)
      local x = S.make({ #v }, v, 'f32')
      local got = values(x:to(name))
      local xs = values(x)
      local bad = 0
      for i = 1, #v do
        local want = round8(xs[i], name, false)
        if not same(want, got[i]) then
          bad = bad + 1
          if bad <= 5 then print(('%s: %.9g -> %.9g, want %.9g'):format(name, xs[i], got[i], want)) end
        end
      end
      assert.are.equal(0, bad, name .. ': values rounded wrongly')
      -- the representable values go there and back unchanged, bit for bit
      local reps = {}
      for c = 0, 255 do
        local d = decode(c, name)
        if d == d then reps[#reps + 1] = d end
      end
      local back = values(S.make({ #reps }, reps, 'f32'):to(name):to('f32'))
      for i = 1, #reps do assert.is_true(same(reps[i], back[i]), name .. ' round trip of ' .. reps[i]) end
    end
  end)

  it('the codes themselves: NaN 0x7f with the sign, infinities, signed zeros, the largest values', function()
    local x = S.make({ 8 }, { 0 / 0, 500, -500, -0.0, 448, 57344, 1e6, -1e6 }, 'f32')
    local function codes(t)
      local p = ffi.cast('uint8_t*', t:data_ptr())
      local r = {}
      for i = 0, t:numel() - 1 do r[i + 1] = p[i] end
      return r
    end
    local c4, c5 = codes(x:to('f8e4m3')), codes(x:to('f8e5m2'))
    assert.are.equal(0x7f, c4[1] % 128)
    assert.are.same({ 0x7f, 0xff, 0x80, 0x7e }, { c4[2], c4[3], c4[4], c4[5] })
    assert.are.same({ 0x80, 0x7b, 0x7c, 0xfc }, { c5[4], c5[6], c5[7], c5[8] })
  end)

  it('f64 -> f8 rounds once (not through a rounded f32)', function()
    -- just above the tie between 1 and 1.125 in e4m3: f32 would round it onto the tie (then to 1)
    local x = 1.0625 + 2 ^ -40
    local t = S.make({ 2 }, { x, -x }, 'f64')
    assert.are.same({ 1.125, -1.125 }, values(t:to('f8e4m3')))
    assert.are.same({ 1, -1 }, values(S.make({ 2 }, { x, -x }, 'f32'):to('f8e4m3')))
  end)

  it('views, clones, cat and safetensors carry f8 tensors; printing shows their values', function()
    local x = randn({ 6, 8 }, 10):to('f8e5m2')
    assert.are.equal('f8e5m2', x.dtype)
    assert.are.equal(1, x:element_size())
    local tt = x:t():contiguous()
    assert.are.same(values(x:t()), values(tt))
    local c = ms.cat({ x, x:narrow(1, 1, 2) }, 1)
    assert.are.same({ 8, 8 }, c.shape)
    local dir = S.tmpdir()
    ms.save_safetensors(dir .. '/f8.safetensors', { a = x, b = x:to('f32'):to('f8e4m3') })
    local back = ms.load_safetensors(dir .. '/f8.safetensors')
    assert.are.equal('f8e5m2', back.a.dtype)
    assert.are.equal('f8e4m3', back.b.dtype)
    assert.are.same(values(x), values(back.a))
    local f = io.open(dir .. '/f8.safetensors', 'rb')
    local head = f:read(400)
    f:close()
    assert.is_truthy(head:find('"F8_E5M2"', 1, true) and head:find('"F8_E4M3"', 1, true))
    assert.is_truthy(tostring(S.make({ 2 }, { 1.5, -0.25 }):to('f8e4m3')):find('dtype=f8e4m3', 1, true))
    assert.are.equal(ms.float8 ~= nil, true)
  end)

  it('ops refuse f8 tensors with a message naming the tensor; requires_grad and collectives too', function()
    local x = randn({ 4, 16 }):to('f8e4m3')
    for _, fn in ipairs({
      function() return x + 1 end, function() return x:sum() end,
      function() return ms.matmul(x, x:t()) end, function() return ms.exp(x) end,
      function() return x:fill_(0) end }) do
      local e = S.errmsg(fn)
      assert.is_truthy(e:find('f8e4m3 (4,16) cpu is an 8-bit float tensor', 1, true), e)
    end
    assert.is_truthy(S.errmsg(function() x.requires_grad = true end):find('floating point', 1, true))
    assert.is_truthy(S.errmsg(function() return F.amax(x) end):find('amax: needs a float tensor', 1, true))
  end)
end)

-- the cast written out: amax, the scale (f64 division rounded to f32, pow2
-- rounded down), x * scale in f32, saturated nearest-even rounding
local function ref_scale(amax, name, pow2)
  local s = f32(fmt[name].max / math.max(amax, 1e-12))
  if pow2 then
    local _, e = math.frexp(s)
    s = 2 ^ (e - 1)
  end
  return s
end

describe('float8 amax and cast', function()
  it('amax is max |x| for every float dtype and layout, NaN when x holds one, 0 when empty', function()
    for _, dt in ipairs({ 'f32', 'bf16', 'f16', 'f64' }) do
      local x = randn({ 37, 23 }, 3, dt)
      local want = 0
      for _, v in ipairs(values(x)) do want = math.max(want, math.abs(v)) end
      assert.are.equal(f32(want), F.amax(x):item(), dt)
      local xt = x:t()   -- a transposed view
      assert.are.equal(f32(want), F.amax(xt):item(), dt .. ' view')
      assert.are.same({}, F.amax(x).shape)
      assert.are.equal('f32', F.amax(x).dtype)
    end
    local v = values(randn({ 50 }))
    v[17] = 0 / 0
    local a = F.amax(S.make({ 50 }, v, 'f32')):item()
    assert.is_true(a ~= a)
    assert.are.equal(0, F.amax(ms.zeros({ 0, 3 })):item())
  end)

  it('the cast is the scaled, saturated nearest-even rounding, in both layouts, for both formats and pow2', function()
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      for name in pairs(fmt) do
        for _, pow2 in ipairs({ false, true }) do
          local x = randn({ 19, 45 }, 2.5, dt)
          local xv = values(x)
          -- an amax below the true one: the largest values saturate
          local am = S.make({}, { f32(2.5) }, 'f32')
          local r, c, inv = F.float8_cast(x, am, name, { cols = true, pow2 = pow2 })
          assert.are.equal(name, r.dtype)
          assert.are.same({ 19, 45 }, r.shape)
          assert.are.same({ 45, 19 }, c.shape)
          local s = ref_scale(2.5, name, pow2)
          assert.are.equal(f32(1 / s), inv:item())
          local rv, cv = values(r), values(c)
          local sat = 0
          for i = 0, 18 do
            for j = 0, 44 do
              local want = round8(f32(f32(xv[i * 45 + j + 1]) * s), name, true)
              if math.abs(want) == fmt[name].max then sat = sat + 1 end
              assert.is_true(same(want, rv[i * 45 + j + 1]), ('%s %s (%d, %d)'):format(dt, name, i, j))
              assert.is_true(same(want, cv[j * 19 + i + 1]), ('%s %s transposed (%d, %d)'):format(dt, name, i, j))
            end
          end
          assert.is_true(sat > 0, 'some values saturate')
        end
      end
    end
  end)

  it('the dynamic cast is amax then the cast, and hands the amax back when asked', function()
    for _, dt in ipairs({ 'f32', 'bf16', 'f64' }) do
      local x = randn({ 13, 70 }, 6, dt)
      local am = F.amax(x)
      local r, c, inv = F.float8_cast(x, am, 'f8e5m2', { cols = true })
      local r2, c2, inv2, am2 = F.float8_cast_dynamic(x, 'f8e5m2', { cols = true, amax = true })
      assert.are.same(values(r), values(r2))
      assert.are.same(values(c), values(c2))
      assert.are.equal(inv:item(), inv2:item())
      assert.are.equal(am:item(), am2:item())
      local r3, c3, i3, a3 = F.float8_cast_dynamic(x, 'f8e4m3')
      assert.are.same({ 13, 70 }, r3.shape)
      assert.is_nil(c3); assert.is_nil(a3)
      assert.are.equal(f32(1 / ref_scale(am:item(), 'f8e4m3', false)), i3:item())
    end
  end)

  it('rows, cols and inv are each optional; outputs given are checked; bad arguments are errors', function()
    local x = randn({ 8, 16 })
    local am = F.amax(x)
    local r, c, inv = F.float8_cast(x, am, 'f8e4m3', { rows = false, cols = true, inv = false })
    assert.is_nil(r); assert.is_nil(inv)
    assert.are.same({ 16, 8 }, c.shape)
    assert.is_truthy(S.errmsg(function() F.float8_cast(x, am, 'bf16') end):find('f8e4m3 or f8e5m2', 1, true))
    assert.is_truthy(S.errmsg(function() F.float8_cast(x:view(128), am, 'f8e4m3') end):find('2-D float', 1, true))
    assert.is_truthy(S.errmsg(function() F.float8_cast(x, am:to('f64'), 'f8e4m3') end)
      :find('amax must be one f32 element on cpu', 1, true))
    local out = ms.empty({ 8, 16 }, { dtype = 'f8e5m2' })
    local e = S.errmsg(function() T.check(T.C.ms_float8_cast(ffi.new('ms_tensor*[1]', out), nil, nil, x, am, 8, 0)) end)
    assert.is_truthy(e:find('out is f8e5m2 (8,16) cpu, expected f8e4m3 (8,16) cpu', 1, true), e)
  end)
end)

-- the product written out: the operands decoded to f64, multiplied in f64
local function ref_mm(a, b, ainv, binv)
  return ms.matmul(a:to('f64'), b:to('f64'), false, true) * (ainv:item() * binv:item())
end

local function cast_of(x, name)
  local r, _, inv = F.float8_cast(x, F.amax(x), name)
  return r, inv
end

describe('float8 scaled_matmul', function()
  it('equals the f64 product of the decoded operands times the scales (f32 out to 1e-6, bf16 to its rounding)', function()
    for _, pair in ipairs({ { 'f8e4m3', 'f8e4m3' }, { 'f8e5m2', 'f8e4m3' }, { 'f8e4m3', 'f8e5m2' } }) do
      local a, ai = cast_of(randn({ 33, 40 }, 3), pair[1])
      local b, bi = cast_of(randn({ 21, 40 }, 0.1), pair[2])
      local want = ref_mm(a, b, ai, bi)
      local y = F.scaled_matmul(a, b, ai, bi, { out_dtype = 'f32' })
      assert.are.same({ 33, 21 }, y.shape)
      assert.is_true(relerr(y, want) < 1e-6, pair[1] .. ' x ' .. pair[2])
      local yb = F.scaled_matmul(a, b, ai, bi)
      assert.are.equal('bf16', yb.dtype)
      assert.is_true(relerr(yb, want) < 4e-3)
      assert.is_true(relerr(yb, want) > 0)
    end
  end)

  it('adds a bias, accumulates into a given f32 output with beta, and takes an empty K', function()
    local a, ai = cast_of(randn({ 16, 32 }), 'f8e4m3')
    local b, bi = cast_of(randn({ 24, 32 }), 'f8e4m3')
    local bias = randn({ 24 })
    local want = ref_mm(a, b, ai, bi) + bias:to('f64')
    assert.is_true(relerr(F.scaled_matmul(a, b, ai, bi, { out_dtype = 'f32', bias = bias }), want) < 1e-6)
    local acc = randn({ 16, 24 })
    local want2 = ref_mm(a, b, ai, bi) + acc:to('f64')
    F.scaled_matmul(a, b, ai, bi, { out = acc, beta = 1 })
    assert.is_true(relerr(acc, want2) < 1e-6)
    local z = F.scaled_matmul(ms.empty({ 4, 0 }, { dtype = 'f8e4m3' }), ms.empty({ 5, 0 }, { dtype = 'f8e4m3' }), ai, bi,
      { out_dtype = 'f32' })
    assert.are.same({ 0, 0, 0, 0, 0 }, values(z:narrow(1, 1, 1)))
  end)

  it('refuses two e5m2 operands, transposed views, mismatched K, a missing out for beta and bad scales', function()
    local a, ai = cast_of(randn({ 16, 32 }), 'f8e5m2')
    local b, bi = cast_of(randn({ 16, 32 }), 'f8e4m3')
    local function err(fn, pat)
      local e = S.errmsg(fn)
      assert.is_truthy(e:find(pat, 1, true), e)
    end
    err(function() F.scaled_matmul(a, a, ai, ai) end, 'both f8e5m2')
    err(function() F.scaled_matmul(b, b:t(), bi, bi) end, 'must have contiguous rows')
    err(function() F.scaled_matmul(b, b:narrow(2, 1, 16):contiguous(), bi, bi) end, 'must share their last dim K')
    err(function() F.scaled_matmul(b, b, bi, bi, { beta = 1 }) end, 'the output must be given')
    err(function() F.scaled_matmul(b, b, bi:to('f64'), bi) end, 'ainv and binv must both be one f32 element')
    err(function() F.scaled_matmul(b, b, bi, bi, { out_dtype = 'f64' }) end, 'f32, bf16 or f16')
    err(function() F.scaled_matmul(b, b, bi, bi, { bias = ms.zeros({ 16 }) }) end, 'bias must be (16) bf16')
    err(function() F.scaled_matmul(randn({ 16, 32 }), b, bi, bi) end, '2-D f8e4m3 or f8e5m2')
  end)
end)

-- the FP8 linear written out: quantise x, w (e4m3) and g (e5m2) as the
-- recipe says, multiply the decoded values in f64 and rescale
local function q(x, name)
  local am = 0
  for _, v in ipairs(values(x)) do am = math.max(am, math.abs(v)) end
  local s = ref_scale(f32(am), name, false)
  local xv = values(x)
  local out = {}
  for i = 1, #xv do out[i] = round8(f32(f32(xv[i]) * s), name, true) / s end
  return S.make(x.shape, out, 'f64')
end

-- ||grad - the central differences of L over t's elements|| / ||those||
-- (t 2-D f64, changed in place and restored)
local function fd_rel(t, grad, L)
  local num, den, h = 0, 0, 1e-6
  for i = 1, t.shape[1] do
    for j = 1, t.shape[2] do
      local v = t:get(i, j)
      t:set(i, j, v + h)
      local up = L()
      t:set(i, j, v - h)
      local dn = L()
      t:set(i, j, v)
      local d = (up - dn) / (2 * h)
      num, den = num + (grad:get(i, j) - d) ^ 2, den + d * d
    end
  end
  return math.sqrt(num / den)
end

describe('float8.linear', function()
  it('forward and backward are the FP8 products of the tensorwise recipe (Linear and Conv1D layouts, bias, 3-D x)', function()
    for _, wt in ipairs({ true, false }) do
      for _, with_bias in ipairs({ true, false }) do
        local x = randn({ 3, 5, 32 }):requires_grad_()
        local w = (wt and randn({ 48, 32 }, 0.2) or randn({ 32, 48 }, 0.2)):requires_grad_()
        local b = with_bias and randn({ 48 }):requires_grad_() or nil
        local y = float8.linear(x, w, b, { wt = wt })
        assert.are.same({ 3, 5, 48 }, y.shape)
        assert.are.equal('f32', y.dtype)
        local g = randn({ 3, 5, 48 })
        y:backward(g)
        -- the same in f64 from the quantised operands
        local x2, g2 = x:detach():view(15, 32), g:view(15, 48)
        local xq, gq = q(x2, 'f8e4m3'), q(g2, 'f8e5m2')
        local wo = wt and w:detach() or w:detach():t()   -- (out, in)
        local wq = q(wo, 'f8e4m3')
        local want = ms.matmul(xq, wq, false, true)
        if b then want = want + b:detach():to('f64') end
        assert.is_true(relerr(y:view(15, 48), want) < 1e-6, 'forward')
        assert.is_true(relerr(x.grad:view(15, 32), ms.matmul(gq, wq)) < 1e-6, 'dx')
        local dw = ms.matmul(gq, xq, true, false)   -- (out, in)
        assert.is_true(relerr(wt and w.grad or w.grad:t(), dw) < 1e-6, 'dw')
        if b then assert.is_true(relerr(b.grad, g2:sum(1)) < 1e-6, 'db') end
      end
    end
  end)

  it('its gradients match the f64 finite differences of the linear map it approximates, within FP8 rounding', function()
    local x = randn({ 6, 16 }, 1, 'f64'):requires_grad_()
    local w = randn({ 16, 16 }, 0.3, 'f64'):requires_grad_()
    local b = randn({ 16 }, 0.1, 'f64'):requires_grad_()
    local g = randn({ 6, 16 }, 1, 'f64')
    local y = float8.linear(x, w, b)
    assert.are.equal('f64', y.dtype)
    y:backward(g)
    -- the f64 linear map's loss sum(g * (x w^T + b)) and its central differences
    local xd, wd, bd = x:detach(), w:detach(), b:detach()
    local function L() return (ms.matmul(xd, wd, false, true) + bd):mul(g):sum():item() end
    local ex, ew = fd_rel(xd, x.grad, L), fd_rel(wd, w.grad, L)
    assert.is_true(ex < 0.1 and ew < 0.1, ('dx %.3g, dw %.3g'):format(ex, ew))
    assert.is_true(ex > 1e-4 and ew > 1e-4, 'the FP8 rounding is there')
    assert.is_true(relerr(b.grad, g:sum(1)) < 1e-12)
  end)

  it('writes the weight gradient into an f32 sink (accumulating), as FSDP registers one', function()
    local x = randn({ 16, 32 }, 1, 'bf16'):requires_grad_()
    local w = randn({ 16, 32 }, 0.2, 'bf16'):requires_grad_()
    local sink = { t = ms.zeros({ 16, 32 }), written = {}, i = 1 }
    ms.autograd.set_grad_sink(w, sink)
    local g = randn({ 16, 16 }, 1, 'bf16')
    float8.linear(x, w):backward(g)
    assert.is_nil(w.grad)
    assert.is_true(sink.written[1])
    local want = ms.matmul(q(g:to('f32'), 'f8e5m2'), q(x:detach():to('f32'), 'f8e4m3'), true, false)
    assert.is_true(relerr(sink.t, want) < 1e-6)
    float8.linear(x, w):backward(g)
    assert.is_true(relerr(sink.t, want * 2) < 1e-6)
    ms.autograd.set_grad_sink(w, nil)
  end)

  it('inside autocast the output is bf16 and an f32 weight gets an f32 gradient; q/k/v share one input cast each way', function()
    local x = randn({ 32, 64 }):requires_grad_()
    local ws = { randn({ 64, 64 }, 0.1):requires_grad_(), randn({ 32, 64 }, 0.1):requires_grad_(),
      randn({ 32, 64 }, 0.1):requires_grad_() }
    local before, bbefore = float8.stats().input_casts, float8.stats().backward_casts
    local ys = nnf.autocast('bf16', function()
      local r = {}
      for i, w in ipairs(ws) do r[i] = float8.linear(x, w) end
      return r
    end)
    assert.are.equal(1, float8.stats().input_casts - before)
    assert.are.equal('bf16', ys[1].dtype)
    local loss = ys[1]:sum() + ys[2]:sum() + ys[3]:sum()
    loss:backward()
    assert.are.equal(1, float8.stats().backward_casts - bbefore, 'one transposed cast of x for the three')
    assert.are.equal('f32', ws[2].grad.dtype)
    assert.are.equal('f32', x.grad.dtype)
    -- an in-place write to x between two layers makes a new cast
    local before2 = float8.stats().input_casts
    ms.no_grad(function()
      float8.linear(x, ws[1])
      x:add_(1)
      float8.linear(x, ws[1])
    end)
    assert.are.equal(2, float8.stats().input_casts - before2)
  end)

  it('recompute_weight casts the weight again in the backward: the same gradients, one f8 copy fewer kept', function()
    local function run(rw)
      local x = randn({ 32, 48 }, 1)
      x.requires_grad = true
      local w = randn({ 64, 48 }, 0.2):requires_grad_()
      local g = randn({ 32, 64 })
      float8.clear_cache()
      -- (the collector run first: earlier code's garbage freed inside the
      -- measurement would count against the kept bytes)
      collectgarbage('collect')
      local base = ms.live_bytes(-1)
      local y = float8.linear(x, w, nil, { recompute_weight = rw })
      float8.clear_cache()
      local kept = ms.live_bytes(-1) - base
      y:backward(g)
      return x.grad, w.grad, kept
    end
    seed = seed + 100
    local s0 = seed
    local dx1, dw1, k1 = run(false)
    seed = s0
    local dx2, dw2, k2 = run(true)
    assert.are.same(values(dx1), values(dx2))
    assert.are.same(values(dw1), values(dw2))
    assert.are.equal(48 * 64 - 4, k1 - k2, ("k1 %d k2 %d"):format(k1, k2))   -- the kept (in, out) f8 copy, against the weight's amax (one f32)
    assert.is_truthy(S.errmsg(function() float8.config { recompute_weight = 'x' } end):find("true, false or 'auto'", 1, true))
  end)

  it('without a backward (evaluation), a new input of the same shape is cast anew, never read from the cache', function()
    local w = randn({ 32, 48 }, 0.2)
    ms.no_grad(function()
      for _ = 1, 6 do
        local x = randn({ 16, 48 })
        local y = float8.linear(x, w)
        local want = ms.matmul(q(x, 'f8e4m3'), q(w, 'f8e4m3'), false, true)
        assert.is_true(relerr(y, want) < 1e-6)
        y:free(); x:free()   -- the next x may take its memory (and its storage's address)
      end
    end)
  end)

  it('refuses bad inputs with the shapes named', function()
    local function err(fn, pat)
      local e = S.errmsg(fn)
      assert.is_truthy(e:find(pat, 1, true), e)
    end
    err(function() float8.linear(randn({ 4, 8 }), randn({ 16, 32 })) end, 'input of shape (4, 8) does not end in in_features = 32')
    err(function() float8.linear(randn({ 4, 32 }), randn({ 16, 32 }), randn({ 8 })) end, 'bias of shape (8)')
    err(function() float8.linear(randn({ 4, 32 }), randn({ 32 })) end, 'weight must be 2-D')
    err(function() float8.linear(randn({ 4, 32 }):long(), randn({ 16, 32 })) end, 'must be float tensors')
    err(function() float8.linear(randn({ 4, 32 }), randn({ 16, 32 }), nil, { recipe = 'colwise' }) end,
      'unknown recipe colwise (recipes: blockwise, rowwise, rowwise_with_gw_hp, tensorwise)')
    err(function() float8.config { input = 'f8e5m2', weight = 'f8e5m2' } end, 'cannot both be f8e5m2')
  end)
end)

-- axiswise scaling written out: x (R, C) quantised with one scale a row
-- (axis 'row': amax along the row) or a column ('col'), as f64 values
-- (q_parts: the codes' values in x's layout and the f32 inverse scales)
local function q_parts(x, name, axis, pow2)
  local R, Cc = x.shape[1], x.shape[2]
  local xv = values(x)
  local am, inv, codes, deq = {}, {}, {}, {}
  for i = 0, R - 1 do
    for j = 0, Cc - 1 do
      local k = axis == 'row' and i or j
      am[k] = math.max(am[k] or 0, math.abs(xv[i * Cc + j + 1]))
    end
  end
  for k, a in pairs(am) do inv[k + 1] = f32(1 / ref_scale(f32(a), name, pow2)) end
  for i = 0, R - 1 do
    for j = 0, Cc - 1 do
      local sc = ref_scale(f32(am[axis == 'row' and i or j]), name, pow2)
      local c = round8(f32(f32(xv[i * Cc + j + 1]) * sc), name, true)
      codes[i * Cc + j + 1], deq[i * Cc + j + 1] = c, c / sc
    end
  end
  return codes, inv, S.make(x.shape, deq, 'f64')
end
local function q_axis(x, name, axis, pow2)
  local _, _, d = q_parts(x, name, axis, pow2)
  return d
end

describe('float8 axiswise (rowwise) scaling', function()
  it('the cast scales each row of out by its row amax, each row of out_t by its column amax (formats, pow2, dtypes)', function()
    for _, dt in ipairs({ 'f32', 'bf16', 'f64' }) do
      for name in pairs(fmt) do
        for _, pow2 in ipairs({ false, true }) do
          -- rows and columns of very different magnitudes
          local xv = values(randn({ 19, 45 }, 1, 'f64'))
          local sr, sc = values(ms.rand({ 19 }, { seed = seed })), values(ms.rand({ 45 }, { seed = seed + 1 }))
          for i = 0, 18 do
            for j = 0, 44 do xv[i * 45 + j + 1] = xv[i * 45 + j + 1] * 10 ^ (6 * sr[i + 1] - 3) * 10 ^ (6 * sc[j + 1] - 3) end
          end
          local x = S.make({ 19, 45 }, xv, dt)
          local r, c, ir, ic = F.float8_cast_axiswise(x, name, { cols = true, pow2 = pow2 })
          assert.are.same({ 19, 45 }, r.shape)
          assert.are.same({ 45, 19 }, c.shape)
          assert.are.same({ 19 }, ir.shape)
          assert.are.same({ 45 }, ic.shape)
          local xf = x:to('f32')
          local cr, ivr = q_parts(xf, name, 'row', pow2)
          local cc, ivc = q_parts(xf, name, 'col', pow2)
          assert.are.same(cr, values(r), dt .. ' ' .. name .. ' rows')
          assert.are.same(cc, values(c:t()), dt .. ' ' .. name .. ' cols')
          assert.are.same(ivr, values(ir), dt .. ' ' .. name .. ' row scales')
          assert.are.same(ivc, values(ic), dt .. ' ' .. name .. ' column scales')
          -- each row's largest value takes the format's largest code (not pow2)
          if not pow2 then
            local m = values(F.amax(r:to('f32'):narrow(1, 3, 1)))
            assert.are.equal(fmt[name].max, m[1])
          end
        end
      end
    end
  end)

  it('a NaN or a zero row touches its own row only; slots are optional; empty dims; bad arguments are errors', function()
    local v = values(randn({ 6, 16 }))
    v[2 * 16 + 5] = 0 / 0
    for j = 1, 16 do v[4 * 16 + j] = 0 end
    local x = S.make({ 6, 16 }, v, 'f32')
    local r, _, ir = F.float8_cast_axiswise(x, 'f8e4m3')
    local irv, rv = values(ir), values(r)
    assert.is_true(irv[3] ~= irv[3], 'the NaN row has a NaN scale')
    assert.are.equal(f32(1 / ref_scale(0, 'f8e4m3', false)), irv[5])
    for j = 1, 16 do assert.are.equal(0, rv[4 * 16 + j]) end
    for _, i in ipairs({ 1, 2, 4, 6 }) do assert.is_true(irv[i] == irv[i] and irv[i] > 0) end
    local a, b, c, d = F.float8_cast_axiswise(x, 'f8e4m3', { rows = false, cols = true, inv = false })
    assert.is_nil(a); assert.is_nil(c); assert.is_nil(d)
    assert.are.same({ 16, 6 }, b.shape)
    local _, ct, _, ict = F.float8_cast_axiswise(ms.zeros({ 0, 5 }), 'f8e4m3', { cols = true })
    assert.are.same({ 5, 0 }, ct.shape)
    assert.are.same({ 5 }, ict.shape)
    assert.is_truthy(S.errmsg(function() F.float8_cast_axiswise(x, 'f32') end):find('f8e4m3 or f8e5m2', 1, true))
    assert.is_truthy(S.errmsg(function() F.float8_cast_axiswise(x:view(96), 'f8e4m3') end):find('2-D float', 1, true))
    local e = S.errmsg(function()
      T.check(T.C.ms_float8_cast_axiswise(nil, nil, ffi.new('ms_tensor*[1]'), nil, x, nil, nil, 8, 0))
    end)
    assert.is_truthy(e:find('inv_rows is the scale of out', 1, true), e)
  end)

  -- the amaxes apart (F.float8_amax_axiswise) and given back to the cast:
  -- what a tensor-parallel layer does with the group's (tp_scales = 'group')
  it('amax_axiswise gives the amaxes the cast scales by (into given slots); given back, the same bits (each layout, or one); halves with the max of both give the whole', function()
    -- (values with NaN as a string: are.same would find NaN ~= NaN)
    local function vals(t)
      local r = values(t)
      for i, e in ipairs(r) do if e ~= e then r[i] = 'NaN' end end
      return r
    end
    for _, dt in ipairs({ 'f32', 'bf16', 'f64' }) do
      local v = values(randn({ 12, 40 }, 2, 'f64'))
      v[3 * 40 + 7] = 0 / 0
      for j = 1, 40 do v[5 * 40 + j] = 0 end
      local x = S.make({ 12, 40 }, v, dt)
      local ra, ca = F.float8_amax_axiswise(x, { cols = true })
      assert.are.same({ 12 }, ra.shape); assert.are.same({ 40 }, ca.shape)
      assert.are.equal('f32', ra.dtype)
      local xf = values(x:to('f32'))
      for i = 0, 11 do
        local m = 0
        for j = 0, 39 do
          local a = math.abs(xf[i * 40 + j + 1])
          if a ~= a or m ~= m then m = 0 / 0 elseif a > m then m = a end
        end
        local got = values(ra)[i + 1]
        if m ~= m then assert.is_true(got ~= got, 'NaN row') else assert.are.equal(m, got, dt .. ' row ' .. i) end
      end
      local col = values(F.amax(x:narrow(2, 9, 1)))
      assert.are.equal(col[1], values(ca)[9])
      assert.is_nil((F.float8_amax_axiswise(x, { rows = false })))
      local r0, c0 = F.float8_amax_axiswise(x, { rows = false, cols = true })
      assert.is_nil(r0); assert.are.same(vals(ca), vals(c0))
      for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
        local r, c, ir, ic = F.float8_cast_axiswise(x, name, { cols = true })
        local r2, c2, ir2, ic2 = F.float8_cast_axiswise(x, name, { cols = true, row_amax = ra, col_amax = ca })
        assert.are.same(vals(r), vals(r2)); assert.are.same(vals(c), vals(c2))
        assert.are.same(vals(ir), vals(ir2)); assert.are.same(vals(ic), vals(ic2))
      end
    end
    -- x split by columns (a row-parallel layer's input): each half's row
    -- amaxes, their max, and each half cast with it give the whole cast's
    -- columns and its row scales; split by rows, the column amaxes the same
    local x = randn({ 16, 48 }, 3)
    local function vmax(p, q) return F.where(p:gt(q), p, q) end   -- (the all-reduce's max, for two ranks)
    for _, pow2 in ipairs({ false, true }) do
      local r, c, ir, ic = F.float8_cast_axiswise(x, 'f8e4m3', { cols = true, pow2 = pow2 })
      local a, b = x:narrow(2, 1, 20):contiguous(), x:narrow(2, 21, 28):contiguous()
      local m = vmax(F.float8_amax_axiswise(a), (F.float8_amax_axiswise(b)))
      local ra_, _, ira = F.float8_cast_axiswise(a, 'f8e4m3', { row_amax = m, pow2 = pow2 })
      local rb_, _, irb = F.float8_cast_axiswise(b, 'f8e4m3', { row_amax = m, pow2 = pow2 })
      assert.are.same(values(r:narrow(2, 1, 20)), values(ra_))
      assert.are.same(values(r:narrow(2, 21, 28)), values(rb_))
      assert.are.same(values(ir), values(ira)); assert.are.same(values(ir), values(irb))
      local u, d = x:narrow(1, 1, 7):contiguous(), x:narrow(1, 8, 9):contiguous()
      local _, cu = F.float8_amax_axiswise(u, { rows = false, cols = true })
      local _, cd = F.float8_amax_axiswise(d, { rows = false, cols = true })
      local cm = vmax(cu, cd)
      local _, ctu, _, icu = F.float8_cast_axiswise(u, 'f8e4m3', { rows = false, cols = true, col_amax = cm, pow2 = pow2 })
      assert.are.same(values(c:narrow(2, 1, 7)), values(ctu))
      assert.are.same(values(ic), values(icu))
    end
    -- given amaxes are checked: each layout asked needs its own, f32
    -- vectors of its length on x's device
    local ra, ca = F.float8_amax_axiswise(x, { cols = true })
    local function err(fn) return S.errmsg(fn) end
    -- one layout's amaxes given, the other's x's own; into given slots
    local r, c = F.float8_cast_axiswise(x, 'f8e4m3', { cols = true })
    for _, g in ipairs({ { row_amax = ra }, { col_amax = ca } }) do
      local r2, c2 = F.float8_cast_axiswise(x, 'f8e4m3', { cols = true, row_amax = g.row_amax, col_amax = g.col_amax })
      assert.are.same(values(r), values(r2)); assert.are.same(values(c), values(c2))
    end
    local slots = ms.zeros({ 70 })
    F.float8_amax_axiswise(x, { row_out = slots:narrow(1, 3, 16) })
    F.float8_amax_axiswise(x, { rows = false, cols = true, col_out = slots:narrow(1, 20, 48) })
    assert.are.same(values(ra), values(slots:narrow(1, 3, 16)))
    assert.are.same(values(ca), values(slots:narrow(1, 20, 48)))
    assert.are.same({ 0, 0 }, values(slots:narrow(1, 1, 2)))
    assert.is_truthy(err(function() F.float8_cast_axiswise(x, 'f8e4m3', { row_amax = ca }) end)
      :find('row_amax must be a contiguous f32 vector of 16 on x\'s device (x f32 (16,48) cpu), got f32 (48) cpu', 1,
        true))
    assert.is_truthy(err(function() F.float8_cast_axiswise(x, 'f8e4m3', { row_amax = ra:to('f64') }) end)
      :find('row_amax must be a contiguous f32 vector of 16', 1, true))
    assert.is_truthy(err(function() F.float8_amax_axiswise(x:view(768)) end):find('2-D float', 1, true))
  end)

  it('float8_transpose gives the bytes transposed (views too); other dtypes are refused', function()
    for _, sh in ipairs({ { 5, 7 }, { 64, 130 }, { 1, 16 }, { 0, 3 } }) do
      local x = randn(sh, 4):to('f8e5m2')
      local t = F.float8_transpose(x)
      assert.are.same({ sh[2], sh[1] }, t.shape)
      assert.are.equal('f8e5m2', t.dtype)
      assert.are.same(values(x:t():contiguous()), values(t))
    end
    local x = randn({ 6, 10 }):to('f8e4m3')
    assert.are.same(values(x), values(F.float8_transpose(x:t())))
    local e = S.errmsg(function() F.float8_transpose(randn({ 4, 4 })) end)
    assert.is_truthy(e:find('2-D f8e4m3 or f8e5m2', 1, true), e)
  end)

  it('scaled_matmul with vector scales multiplies element (i, j) by ainv[i] * binv[j] (bias, beta); mixed or wrong scales are refused', function()
    local a, _, ai = F.float8_cast_axiswise(randn({ 33, 40 }, 3), 'f8e4m3', { pow2 = true })
    local b, _, bi = F.float8_cast_axiswise(randn({ 21, 40 }, 0.1), 'f8e4m3', { pow2 = true })
    local want = ms.matmul(a:to('f64') * ai:to('f64'):view(33, 1), b:to('f64') * bi:to('f64'):view(21, 1), false, true)
    local y = F.scaled_matmul(a, b, ai, bi, { out_dtype = 'f32' })
    assert.is_true(relerr(y, want) < 1e-6)
    local bias, acc = randn({ 21 }), randn({ 33, 21 })
    assert.is_true(relerr(F.scaled_matmul(a, b, ai, bi, { out_dtype = 'f32', bias = bias }), want + bias:to('f64')) < 1e-6)
    local want2 = want + acc:to('f64')
    F.scaled_matmul(a, b, ai, bi, { out = acc, beta = 1 })
    assert.is_true(relerr(acc, want2) < 1e-6)
    local function err(fn, pat)
      local e = S.errmsg(fn)
      assert.is_truthy(e:find(pat, 1, true), e)
    end
    local one = F.amax(randn({ 4 }))
    err(function() F.scaled_matmul(a, b, ai, one) end, 'contiguous f32 vectors of (33) and (21)')
    err(function() F.scaled_matmul(a, b, bi, ai) end, 'ainv and binv must both be')
    err(function() F.scaled_matmul(a, b, ai:to('f64'), bi) end, 'f64 (33)')
  end)

  local function lin_ref(x2, w, g2, wt, recipe)
    -- the products of the recipe, written out (w as (out, in))
    local wo = wt and w or w:t():contiguous()
    local xq, wq = q_axis(x2, 'f8e4m3', 'row', true), q_axis(wo, 'f8e4m3', 'row', true)
    local y = ms.matmul(xq, wq, false, true)
    local dx = ms.matmul(q_axis(g2, 'f8e4m3', 'row', true), q_axis(wo, 'f8e4m3', 'col', true))
    local dw
    if recipe == 'rowwise' then
      dw = ms.matmul(q_axis(g2, 'f8e4m3', 'col', true), q_axis(x2, 'f8e4m3', 'col', true), true, false)
    else
      dw = ms.matmul(g2:to('f64'), x2:to('f64'), true, false)
    end
    return y, dx, dw
  end

  it('float8.linear with rowwise and rowwise_with_gw_hp computes the products written out (Linear, Conv1D, bias)', function()
    for _, recipe in ipairs({ 'rowwise', 'rowwise_with_gw_hp' }) do
      for _, wt in ipairs({ true, false }) do
        local x = randn({ 3, 5, 32 }):requires_grad_()
        local w = (wt and randn({ 48, 32 }, 0.2) or randn({ 32, 48 }, 0.2)):requires_grad_()
        local b = randn({ 48 }):requires_grad_()
        local y = float8.linear(x, w, b, { wt = wt, recipe = recipe })
        local g = randn({ 3, 5, 48 })
        y:backward(g)
        local x2, g2 = x:detach():view(15, 32), g:view(15, 48)
        local wy, wdx, wdw = lin_ref(x2, w:detach(), g2, wt, recipe)
        local tag = recipe .. (wt and ' Linear' or ' Conv1D')
        assert.is_true(relerr(y:view(15, 48), wy + b:detach():to('f64')) < 1e-6, tag .. ' forward')
        assert.is_true(relerr(x.grad:view(15, 32), wdx) < 1e-6, tag .. ' dx')
        assert.is_true(relerr(wt and w.grad or w.grad:t(), wdw) < 1e-6, tag .. ' dw')
        assert.is_true(relerr(b.grad, g2:sum(1)) < 1e-6, tag .. ' db')
      end
    end
  end)

  it('rowwise gradients match the f64 finite differences of the linear map within FP8 rounding', function()
    for _, recipe in ipairs({ 'rowwise', 'rowwise_with_gw_hp' }) do
      local x = randn({ 6, 16 }, 1, 'f64'):requires_grad_()
      local w = randn({ 16, 16 }, 0.3, 'f64'):requires_grad_()
      local g = randn({ 6, 16 }, 1, 'f64')
      float8.linear(x, w, nil, { recipe = recipe }):backward(g)
      local xd, wd = x:detach(), w:detach()
      local function L() return ms.matmul(xd, wd, false, true):mul(g):sum():item() end
      local ex, ew = fd_rel(xd, x.grad, L), fd_rel(wd, w.grad, L)
      assert.is_true(ex < 0.1 and ew < 0.1, ('%s dx %.3g, dw %.3g'):format(recipe, ex, ew))
      assert.is_true(ex > 1e-4, 'the FP8 rounding is there')
      if recipe == 'rowwise' then assert.is_true(ew > 1e-4) else assert.is_true(ew < 1e-6, 'dw in high precision') end
    end
  end)

  it('one outlier token costs its own row only: rowwise keeps the other rows that tensorwise loses', function()
    local v = values(randn({ 32, 64 }, 1e-3))
    for j = 1, 64 do v[j] = v[j] * 1e6 end   -- token 1 is 1e6 times the others
    local x = S.make({ 32, 64 }, v, 'f32')
    local w = randn({ 16, 64 }, 0.2)
    local exact = ms.matmul(x:to('f64'), w:to('f64'), false, true)
    local function rest_err(recipe)
      local y = ms.no_grad(function() return float8.linear(x, w, nil, { recipe = recipe }) end)
      return relerr(y:narrow(1, 2, 31), exact:narrow(1, 2, 31))
    end
    local et, er = rest_err('tensorwise'), rest_err('rowwise')
    assert.is_true(er < 0.1, ('rowwise %.3g'):format(er))
    assert.is_true(et > 0.5, ('tensorwise %.3g: the small rows underflow'):format(et))
  end)

  it('rowwise: the f32 sink (FP8 and high-precision dW), recompute_weight, and a q/k/v input cast shared', function()
    for _, recipe in ipairs({ 'rowwise', 'rowwise_with_gw_hp' }) do
      local x = randn({ 16, 32 }, 1, 'bf16'):requires_grad_()
      local w = randn({ 16, 32 }, 0.2, 'bf16'):requires_grad_()
      local sink = { t = ms.zeros({ 16, 32 }), written = {}, i = 1 }
      ms.autograd.set_grad_sink(w, sink)
      local g = randn({ 16, 16 }, 1, 'bf16')
      float8.linear(x, w, nil, { recipe = recipe }):backward(g)
      assert.is_nil(w.grad)
      local _, _, want = lin_ref(x:detach():to('f32'), w:detach():to('f32'), g:to('f32'), true, recipe)
      assert.is_true(relerr(sink.t, want) < 1e-6, recipe .. ' sink')
      float8.linear(x, w, nil, { recipe = recipe }):backward(g)
      assert.is_true(relerr(sink.t, want * 2) < 1e-6, recipe .. ' accumulated')
      ms.autograd.set_grad_sink(w, nil)
    end
    local function run(rw)
      seed = 9000
      local x = randn({ 32, 48 }):requires_grad_()
      local w = randn({ 64, 48 }, 0.2):requires_grad_()
      float8.linear(x, w, nil, { recipe = 'rowwise', recompute_weight = rw }):backward(randn({ 32, 64 }))
      return values(x.grad), values(w.grad)
    end
    local a1, b1 = run(false)
    local a2, b2 = run(true)
    assert.are.same(a1, a2)
    assert.are.same(b1, b2)
    local x = randn({ 32, 64 }):requires_grad_()
    local before, bb = float8.stats().input_casts, float8.stats().backward_casts
    local loss
    for i = 1, 3 do
      local y = float8.linear(x, randn({ 32, 64 }, 0.1):requires_grad_(), nil, { recipe = 'rowwise' }):sum()
      loss = loss and loss + y or y
    end
    assert.are.equal(1, float8.stats().input_casts - before)
    loss:backward()
    assert.are.equal(1, float8.stats().backward_casts - bb)
  end)
end)

describe('float8.convert', function()
  local llama = require 'models.llama'
  local gpt2 = require 'models.gpt2'

  it('converts every Linear / Conv1D but the LM head and odd widths; revert undoes it', function()
    ms.manual_seed(3)
    local m = llama.new('tiny')
    local names = float8.convert(m)
    assert.are.equal(4 * 7, #names)
    for _, n in ipairs(names) do assert.is_falsy(n:find('lm_head', 1, true)) end
    assert.is_truthy(float8.converted(m.model.layers[1].mlp.up_proj))
    assert.are.equal(28, #float8.revert(m))
    assert.is_nil(float8.converted(m.model.layers[1].mlp.up_proj))
    local g = gpt2.new('tiny')
    local gn = float8.convert(g, { skip = { 'c_proj' } })
    for _, n in ipairs(gn) do assert.is_falsy(n:find('c_proj', 1, true)) end
    assert.is_true(#gn > 0)
    local odd = llama.new('tiny', { intermediate_size = 100 })
    local on = float8.convert(odd)
    for _, n in ipairs(on) do assert.is_falsy(n:find('mlp', 1, true)) end
    local e = S.errmsg(function() float8.convert(llama.new('tiny'), { filter = function() return false end }) end)
    assert.is_truthy(e:find('no nn.Linear or nn.Conv1D', 1, true), e)
  end)

  it('a converted tiny Llama and GPT-2 follow their f32 losses over training steps', function()
    for _, M in ipairs({ llama, gpt2 }) do
      local function run(f8)
        ms.manual_seed(11)
        local m = M.new('tiny')
        if f8 then float8.convert(m) end
        local ids = (ms.rand({ 4, 33 }, { seed = 5 }) * 255):long()
        return S.adamw_losses(m, ids:narrow(2, 1, 32):contiguous(), ids:narrow(2, 2, 32):contiguous(), 6, 3e-3)
      end
      local a, b = run(false), run(true)
      assert.is_true(b[6] < b[1] - 0.3, 'float8 trains')
      for k = 1, 6 do
        assert.is_true(math.abs(a[k] - b[k]) < 0.05 * a[k], ('%s step %d: %g against %g'):format(M.name, k, b[k], a[k]))
      end
      assert.is_true(a[1] ~= b[1], 'the FP8 path ran')
    end
  end)

  it('a tiny Llama converted with rowwise and rowwise_with_gw_hp follows its f32 losses', function()
    local function run(recipe)
      ms.manual_seed(11)
      local m = llama.new('tiny')
      if recipe then float8.convert(m, { recipe = recipe }) end
      local ids = (ms.rand({ 4, 33 }, { seed = 5 }) * 255):long()
      return S.adamw_losses(m, ids:narrow(2, 1, 32):contiguous(), ids:narrow(2, 2, 32):contiguous(), 6, 3e-3)
    end
    local a = run(nil)
    for _, recipe in ipairs({ 'rowwise', 'rowwise_with_gw_hp' }) do
      local b = run(recipe)
      assert.is_true(b[6] < b[1] - 0.3, recipe .. ' trains')
      for k = 1, 6 do
        assert.is_true(math.abs(a[k] - b[k]) < 0.05 * a[k], ('%s step %d: %g against %g'):format(recipe, k, b[k], a[k]))
      end
      assert.is_true(a[1] ~= b[1], 'the FP8 path ran')
    end
  end)

  it('bin/train --float8 trains and logs the converted layers', function()
    local dir = S.tmpdir()
    local status, out = S.bin_train(('models/llama.lua --steps 6 --batch-size 4 --seq-len 32 --eval-every 0 '
      .. '--sample-tokens 0 --log-every 3 --float8 --out %s/run'):format(dir))
    assert.are.equal(0, status, out)
    assert.is_truthy(out:find('float8: tensorwise, 28 of 29 linear layers', 1, true), out)
    local losses = S.run_losses(dir .. '/run')
    assert.are.equal(6, #losses)
    local st3, out3 = S.bin_train(('models/llama.lua --steps 2 --batch-size 4 --seq-len 32 --eval-every 0 '
      .. '--sample-tokens 0 --log-every 1 --float8 rowwise --out %s/run2'):format(dir))
    assert.are.equal(0, st3, out3)
    assert.is_truthy(out3:find('float8: rowwise, 28 of 29 linear layers', 1, true), out3)
    local st4, e4 = S.bin_train('models/llama.lua --steps 1 --float8 --float8-all-gather')
    assert.are_not.equal(0, st4)
    assert.is_truthy(e4:find('--float8-all-gather needs --float8 tensorwise or blockwise and --fsdp', 1, true), e4)
    local st2, e = S.bin_train('models/llama.lua --steps 1 --float8 colwise')
    assert.are_not.equal(0, st2)
    assert.is_truthy(e:find('float8 must be off, tensorwise, rowwise, rowwise_with_gw_hp or blockwise, got', 1, true) and e:find('colwise', 1, true), e)
  end)
end)

-- ------------------------------------------------ blockwise (DeepSeek-V3's)
-- blockwise scaling written out: x (R, C) quantised in blocks 'rows' (1 x
-- 128 of a row: out's layout of the 1x128 cast), 'cols' (128 x 1 of a
-- column: out_t's) or 'tile' (128 x 128); returns the codes' values in x's
-- layout, the dequantised values (f64: code * f32(1 / scale), what the
-- product reads) and inv(bi, bj), the f32 inverse scale of block (bi, bj)
-- (0-based: a block's row and column in the block grid)
local function q_blk(x, name, kind, pow2)
  local R, Cc = x.shape[1], x.shape[2]
  local xv = values(x:to('f32'))
  local function key(i, j)
    if kind == 'rows' then return i * 4096 + math.floor(j / 128) end
    if kind == 'cols' then return math.floor(i / 128) * 1e6 + j end
    return math.floor(i / 128) * 4096 + math.floor(j / 128)
  end
  local am = {}
  for i = 0, R - 1 do
    for j = 0, Cc - 1 do
      local k = key(i, j)
      am[k] = math.max(am[k] or 0, math.abs(xv[i * Cc + j + 1]))
    end
  end
  local sc = {}
  for k, a in pairs(am) do sc[k] = ref_scale(f32(a), name, pow2) end
  local codes, deq = {}, {}
  for i = 0, R - 1 do
    for j = 0, Cc - 1 do
      local s = sc[key(i, j)]
      local c = round8(f32(xv[i * Cc + j + 1] * s), name, true)
      codes[i * Cc + j + 1], deq[i * Cc + j + 1] = c, c * f32(1 / s)
    end
  end
  local function inv(bi, bj)
    local k
    if kind == 'rows' then k = bi * 4096 + bj elseif kind == 'cols' then k = bi * 1e6 + bj else k = bi * 4096 + bj end
    return f32(1 / sc[k])
  end
  return codes, S.make(x.shape, deq, 'f64'), inv
end
local function cdiv(a, b) return math.floor((a + b - 1) / b) end
local function pad4(n) return cdiv(n, 4) * 4 end
-- the transposed copy of a Lua array holding an (R, C) matrix
local function transposed(v, R, Cc)
  local t = {}
  for i = 0, R - 1 do for j = 0, Cc - 1 do t[j * R + i + 1] = v[i * Cc + j + 1] end end
  return t
end
-- x (R, C) whose blocks differ by orders of magnitude (rows and columns scaled)
local function ragged(R, Cc, dt)
  local xv = values(randn({ R, Cc }, 1, 'f64'))
  local sr, sc = values(ms.rand({ R }, { seed = seed })), values(ms.rand({ Cc }, { seed = seed + 1 }))
  for i = 0, R - 1 do
    for j = 0, Cc - 1 do xv[i * Cc + j + 1] = xv[i * Cc + j + 1] * 10 ^ (4 * sr[i + 1] - 2) * 10 ^ (4 * sc[j + 1] - 2) end
  end
  return S.make({ R, Cc }, xv, dt or 'f32')
end

describe('float8 blockwise (DeepSeek-V3) scaling', function()
  it('the 1x128 cast scales each 128 columns of a row (out) and each 128 rows of a column (out_t) by their amax; scales in cuBLASLt\'s layout (edge blocks, formats, pow2, dtypes)', function()
    for _, dt in ipairs({ 'f32', 'bf16', 'f64' }) do
      for name in pairs(fmt) do
        for _, pow2 in ipairs({ false, true }) do
          local R, Cc = 200, 300   -- (edge blocks of 72 rows and 44 columns)
          local x = ragged(R, Cc, dt)
          local r, c, ir, ic = F.float8_cast_blockwise(x, name, { cols = true, pow2 = pow2 })
          assert.are.same({ R, Cc }, r.shape); assert.are.same({ Cc, R }, c.shape)
          assert.are.same({ 3, R }, ir.shape); assert.are.same({ 2, Cc }, ic.shape)
          local cr, _, invr = q_blk(x, name, 'rows', pow2)
          local cc, _, invc = q_blk(x, name, 'cols', pow2)
          local tag = dt .. ' ' .. name .. (pow2 and ' pow2' or '')
          assert.are.same(cr, values(r), tag .. ' out')
          assert.are.same(transposed(cc, R, Cc), values(c), tag .. ' out_t')
          local wi, wic = {}, {}
          for kb = 0, 2 do for i = 0, R - 1 do wi[kb * R + i + 1] = invr(i, kb) end end
          for rb = 0, 1 do for j = 0, Cc - 1 do wic[rb * Cc + j + 1] = invc(rb, j) end end
          assert.are.same(wi, values(ir), tag .. ' inv (ceil(C/128), R)')
          assert.are.same(wic, values(ic), tag .. ' inv_t (ceil(R/128), C)')
          if not pow2 then   -- a block's largest value takes the format's largest code
            assert.are.equal(fmt[name].max, values(F.amax(r:narrow(1, 5, 1):narrow(2, 129, 128):to('f32')))[1])
          end
        end
      end
    end
  end)

  it('the 128x128 cast scales each tile by its amax, the same bytes in both layouts; scales padded to 4 columns', function()
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      for _, pow2 in ipairs({ false, true }) do
        local R, Cc = 300, 200
        local x = ragged(R, Cc, dt)
        local r, c, ir, ic = F.float8_cast_blockwise(x, 'f8e4m3', { blocks = '128x128', cols = true, pow2 = pow2 })
        local ct, _, inv = q_blk(x, 'f8e4m3', 'tile', pow2)
        assert.are.same(ct, values(r))
        assert.are.same(transposed(ct, R, Cc), values(c))
        assert.are.same({ 3, 4 }, ir.shape); assert.are.same({ 2, 4 }, ic.shape)
        local wi, wic = {}, {}
        for rb = 0, 2 do for cb = 0, 3 do wi[rb * 4 + cb + 1] = cb < 2 and inv(rb, cb) or 0 end end
        for cb = 0, 1 do for rb = 0, 3 do wic[cb * 4 + rb + 1] = rb < 3 and inv(rb, cb) or 0 end end
        assert.are.same(wi, values(ir), dt .. ' inv (ceil(R/128), 4)')
        assert.are.same(wic, values(ic), dt .. ' inv_t (ceil(C/128), 4)')
      end
    end
  end)

  it('a NaN poisons its own block only, a zero block gets the 1e-12 floor; slots optional; bad arguments are errors', function()
    local v = values(randn({ 130, 256 }))
    v[3 * 256 + 200] = 0 / 0            -- row 3, column block 1
    for j = 1, 128 do v[5 * 256 + j] = 0 end
    local x = S.make({ 130, 256 }, v, 'f32')
    local r, _, ir = F.float8_cast_blockwise(x, 'f8e4m3')
    local irv, rv = values(ir), values(r)
    assert.is_true(irv[1 * 130 + 4] ~= irv[1 * 130 + 4], 'the NaN block has a NaN scale')
    assert.is_true(irv[0 * 130 + 4] == irv[0 * 130 + 4], 'the same row\'s other block does not')
    assert.is_true(rv[3 * 256 + 1] == rv[3 * 256 + 1])
    assert.are.equal(f32(1 / ref_scale(0, 'f8e4m3', false)), irv[0 * 130 + 6])
    local _, _, it = F.float8_cast_blockwise(x, 'f8e4m3', { blocks = '128x128' })
    local itv = values(it)
    assert.is_true(itv[2] ~= itv[2], 'the tile holding the NaN')
    assert.is_true(itv[1] == itv[1] and itv[5] == itv[5], 'the other tiles')
    local a, b, c, d = F.float8_cast_blockwise(x, 'f8e4m3', { rows = false, cols = true, inv = false })
    assert.is_nil(a); assert.is_nil(c); assert.is_nil(d)
    assert.are.same({ 256, 130 }, b.shape)
    local _, ct, _, ict = F.float8_cast_blockwise(ms.zeros({ 0, 5 }), 'f8e4m3', { cols = true })
    assert.are.same({ 5, 0 }, ct.shape); assert.are.same({ 0, 5 }, ict.shape)
    local function err(fn, want)
      local e = S.errmsg(fn)
      assert.is_truthy(e:find(want, 1, true), e)
    end
    err(function() F.float8_cast_blockwise(x, 'f32') end, 'f8e4m3 or f8e5m2')
    err(function() F.float8_cast_blockwise(x:view(130 * 256), 'f8e4m3') end, '2-D float')
    err(function() F.float8_cast_blockwise(x, 'f8e4m3', { blocks = '1x64' }) end, "blocks must be '1x128' or '128x128'")
    err(function() T.check(T.C.ms_float8_cast_blockwise(nil, nil, ffi.new('ms_tensor*[1]'), nil, x, 1, 8, 0)) end,
      'inv is the scale of out')
    err(function() T.check(T.C.ms_float8_cast_blockwise(ffi.new('ms_tensor*[1]'), nil, nil, nil, x, 3, 8, 0)) end,
      'MS_FLOAT8_1X128 (1) or MS_FLOAT8_128X128 (2), got 3')
  end)

  -- FSDP's float8 all-gathers of blockwise weights (docs/fsdp.md): each
  -- rank's flat piece of a weight, cut at any element
  it('pieces of a matrix cut anywhere (FSDP shards): each piece\'s block maxima, all-reduced, give the scales, and the pieces\' casts the bytes, of the 128x128 cast of the whole, bit for bit (edge blocks, dtypes, formats, pow2)', function()
    local function vmax(p, q) return F.where(p:gt(q), p, q) end   -- (the all-reduce's max)
    for _, c in ipairs({ { 300, 200, 'f32' }, { 300, 200, 'bf16' }, { 300, 200, 'f64' }, { 256, 384, 'bf16' } }) do
      local R, Cc, dt = c[1], c[2], c[3]
      local nbr, nbc = cdiv(R, 128), cdiv(Cc, 128)
      local x = ragged(R, Cc, dt)
      local xv = values(x:to('f32'))
      local flat = x:contiguous():view(R * Cc)
      -- cuts inside blocks and rows, at a row's end, one piece inside one
      -- row of one block, one spanning block rows
      local cuts = { 0, 77, 128 * Cc + 5, 128 * Cc + 60, 200 * Cc, 251 * Cc + Cc - 1, R * Cc }
      local grid
      for p = 1, #cuts - 1 do
        local off, n = cuts[p], cuts[p + 1] - cuts[p]
        local a = F.float8_amax_blockwise_piece(flat:narrow(1, off + 1, n), R, Cc, off)
        assert.are.same({ nbr, nbc }, a.shape)
        local want = {}
        for b = 1, nbr * nbc do want[b] = 0 end
        for e = off, off + n - 1 do
          local i, j = math.floor(e / Cc), e % Cc
          local b = math.floor(i / 128) * nbc + math.floor(j / 128) + 1
          want[b] = math.max(want[b], math.abs(xv[e + 1]))
        end
        assert.are.same(want, values(a), ('%s (%d, %d) piece %d'):format(dt, R, Cc, p))
        grid = grid and vmax(grid, a) or a
      end
      for name in pairs(fmt) do
        for _, pow2 in ipairs({ false, true }) do
          local tag = ('%s (%d, %d) %s%s'):format(dt, R, Cc, name, pow2 and ' pow2' or '')
          local r, ct, ir, ic = F.float8_cast_blockwise(x, name, { blocks = '128x128', cols = true, pow2 = pow2 })
          local sc, inv, inv_t = F.float8_scales_blockwise(grid, name, { pow2 = pow2 })
          assert.are.same(values(ir), values(inv), tag .. ' inv')
          assert.are.same(values(ic), values(inv_t), tag .. ' inv_t')
          local gv, sv = values(grid), values(sc)
          for b = 1, nbr * nbc do assert.are.equal(ref_scale(f32(gv[b]), name, pow2), sv[b], tag .. ' scale') end
          local rv = values(r:view(R * Cc))
          for p = 1, #cuts - 1 do
            local off, n = cuts[p], cuts[p + 1] - cuts[p]
            local q8 = F.float8_cast_blockwise_piece(flat:narrow(1, off + 1, n), sc, R, Cc, off, name)
            assert.are.equal(name, q8.dtype)
            local qv = values(q8)
            for e = 1, n do
              if not same(rv[off + e], qv[e]) then
                error(('%s piece %d element %d: %s, the whole\'s %s'):format(tag, p, e, qv[e], rv[off + e]))
              end
            end
          end
          ct:free()
        end
      end
    end
  end)

  it('pieces: a NaN poisons its block only, an empty piece gives zeros, outputs given are written; bad arguments are errors', function()
    local v = values(randn({ 130, 256 }))
    v[2 * 256 + 200] = 0 / 0            -- row 2, column 199: block (0, 1)
    local flat = S.make({ 130 * 256 }, v, 'f32')
    local piece = flat:narrow(1, 2 * 256 + 1, 300)   -- row 2 and row 3's first 44 columns
    local a = F.float8_amax_blockwise_piece(piece, 130, 256, 2 * 256)
    local av = values(a)
    assert.is_true(av[2] ~= av[2], 'the NaN block')
    assert.is_true(av[1] > 0 and av[3] == 0 and av[4] == 0, 'the other blocks: the piece\'s max, or 0')
    assert.are.same({ 0, 0, 0, 0 }, values(F.float8_amax_blockwise_piece(ms.zeros({ 0 }), 130, 256, 17)))
    -- into given tensors (slots of the FSDP unit's vectors)
    local vec = ms.zeros({ 6 })
    local slot = vec:narrow(1, 3, 4):view({ 2, 2 })
    F.float8_amax_blockwise_piece(piece, 130, 256, 2 * 256, { out = slot })
    local vv = values(vec)
    assert.are.equal(0, vv[1]); assert.are.equal(0, vv[2]); assert.are.equal(av[1], vv[3])
    local sc0, inv0, it0 = ms.zeros({ 2, 2 }), ms.zeros({ 2, 4 }), ms.zeros({ 2, 4 })
    F.float8_scales_blockwise(a, 'f8e4m3', { scale = sc0, inv = inv0, inv_t = it0 })
    local iv, tv = values(inv0), values(it0)
    assert.is_true(iv[2] ~= iv[2] and tv[5] ~= tv[5], 'the NaN block\'s inverse scale, in both layouts')
    assert.are.equal(0, iv[3]); assert.are.equal(0, tv[4])
    local out = ms.empty({ 300 }, { dtype = 'f8e4m3' })
    F.float8_cast_blockwise_piece(piece, sc0, 130, 256, 2 * 256, 'f8e4m3', { out = out })
    local ov = values(out)
    assert.is_true(ov[1] == ov[1] and ov[128] == ov[128] and ov[257] == ov[257] and ov[300] == ov[300], 'block (0, 0)')
    assert.is_true(ov[129] ~= ov[129] and ov[256] ~= ov[256], 'block (0, 1)')
    local function err(fn, want)
      local e = S.errmsg(fn)
      assert.is_truthy(e:find(want, 1, true), e)
    end
    err(function() F.float8_amax_blockwise_piece(flat:view({ 130, 256 }), 130, 256, 0) end, '1-D float')
    err(function() F.float8_amax_blockwise_piece(piece, 130, 256, 130 * 256 - 100) end,
      'at offset 33180 is not inside a (130, 256) matrix')
    err(function() F.float8_amax_blockwise_piece(piece, 130, 256, -1) end, 'is not inside')
    err(function() F.float8_amax_blockwise_piece(piece, 130, 256, 0, { out = ms.zeros({ 2, 3 }) }) end, 'expected f32 (2,2)')
    err(function() F.float8_scales_blockwise(a:to('bf16'), 'f8e4m3') end, 'amax must be a contiguous f32')
    err(function() F.float8_scales_blockwise(a, 'f32') end, 'f8e4m3 or f8e5m2')
    err(function() F.float8_cast_blockwise_piece(piece, ms.zeros({ 2, 3 }), 130, 256, 0, 'f8e4m3') end,
      'scale must be a contiguous f32 (2, 2)')
    err(function() F.float8_cast_blockwise_piece(piece, sc0, 130, 256, 0, 'bf16') end, 'f8e4m3 or f8e5m2')
    err(function() F.float8_cast_blockwise_piece(piece, sc0, 130, 256, 0, 'f8e4m3', { out = ms.empty({ 299 }, { dtype = 'f8e4m3' }) }) end,
      'float8_cast_blockwise_piece')
  end)

  -- the many-piece forms (FSDP's precompute: every weight of a model in
  -- one launch each) against the per-piece ops, byte for byte
  local function bits(t)
    local c = t:contiguous()
    local n = c:numel() * c:element_size()
    local p = n > 0 and ffi.cast('uint8_t *', c:data_ptr()) or nil
    local r = {}
    for i = 0, n - 1 do r[i + 1] = p[i] end
    return r
  end
  -- weights of different shapes and dtypes laid out one after the other
  -- (16-element starts) and cut into W equal shards, as fully_shard does:
  -- pieces[r][i] is rank r's piece of weight i ({ x = nil } where it has none)
  local function sharded(shapes, W)
    local ws, off = {}, 0
    for i, sh in ipairs(shapes) do
      local x = ragged(sh[1], sh[2], sh[3])
      ws[i] = { R = sh[1], C = sh[2], x = x, flat = x:contiguous():view(sh[1] * sh[2]), o = off }
      off = cdiv(off + sh[1] * sh[2], 16) * 16
    end
    local Sn, pieces = cdiv(off, W), {}
    for r = 0, W - 1 do
      pieces[r] = {}
      for i, w in ipairs(ws) do
        local a, b = math.max(w.o, r * Sn), math.min(w.o + w.R * w.C, (r + 1) * Sn)
        pieces[r][i] = b > a and { x = w.flat:narrow(1, a - w.o + 1, b - a), R = w.R, C = w.C, offset = a - w.o }
          or { R = w.R, C = w.C, offset = 0 }
      end
    end
    return ws, pieces
  end

  it('many pieces at once: the bits of the per-piece ops (weights of different shapes and dtypes, shards cutting blocks, empty pieces, e4m3 and e5m2, pow2 on, off and mixed)', function()
    local function vmax(p, q) return F.where(p:gt(q), p, q) end
    local shapes = { { 300, 200, 'f32' }, { 256, 384, 'bf16' }, { 130, 256, 'f64' }, { 128, 128, 'f16' },
      { 5, 7, 'bf16' }, { 1, 300, 'f32' }, { 257, 129, 'bf16' } }
    local W = 3
    local ws, pieces = sharded(shapes, W)
    local nw, cut, empty = #ws, false, false
    -- the grids: views of one vector (fully_shard's), filled with noise first
    local slot, nb = {}, 0
    for i, w in ipairs(ws) do slot[i] = nb; nb = nb + cdiv(w.R, 128) * cdiv(w.C, 128) end
    local glob = {}
    for r = 0, W - 1 do
      local vec = ms.rand({ nb + 3 }, { seed = 40 + r })
      local tail = bits(vec:narrow(1, nb + 1, 3))
      local grids = {}
      for i, w in ipairs(ws) do grids[i] = vec:narrow(1, slot[i] + 1, cdiv(w.R, 128) * cdiv(w.C, 128)):view({ cdiv(w.R, 128), cdiv(w.C, 128) }) end
      assert.are.equal(grids, F.float8_amax_blockwise_many(pieces[r], grids))
      for i, p in ipairs(pieces[r]) do
        local want = F.float8_amax_blockwise_piece(p.x or ms.zeros({ 0 }), p.R, p.C, p.offset)
        assert.are.same(bits(want), bits(grids[i]), ('rank %d weight %d'):format(r, i))
        glob[i] = glob[i] and vmax(glob[i], want) or want
        if p.x == nil then empty = true end
        if p.x and (p.offset % (128 * p.C) ~= 0 or (p.offset + p.x:numel()) % (128 * p.C) ~= 0) and p.offset + p.x:numel() < p.R * p.C then cut = true end
      end
      assert.are.same(tail, bits(vec:narrow(1, nb + 1, 3)), 'the vector past the grids untouched')
    end
    assert.is_true(cut and empty, 'a block cut by the shards, an empty piece')
    for name in pairs(fmt) do
      for _, pow2 in ipairs({ false, true, 'mixed' }) do
        local tag = ('%s%s'):format(name, pow2 and ' pow2 ' .. tostring(pow2) or '')
        local p2, sc, inv, inv_t = {}, {}, {}, {}
        for i, w in ipairs(ws) do
          local nbr, nbc = cdiv(w.R, 128), cdiv(w.C, 128)
          p2[i] = pow2 == 'mixed' and i % 2 == 0 or pow2 == true
          sc[i] = ms.rand({ nbr, nbc }, { seed = i })
          inv[i] = ms.rand({ nbr, pad4(nbc) }, { seed = 10 + i })         -- (noise: the padding is written)
          inv_t[i] = i ~= 2 and ms.rand({ nbc, pad4(nbr) }, { seed = 20 + i }) or nil   -- (one not wanted)
        end
        F.float8_scales_blockwise_many(glob, name, { pow2 = p2, scale = sc, inv = inv, inv_t = inv_t })
        for i = 1, nw do
          local s1, i1, t1 = F.float8_scales_blockwise(glob[i], name, { pow2 = p2[i] })
          assert.are.same(bits(s1), bits(sc[i]), tag .. ' scale ' .. i)
          assert.are.same(bits(i1), bits(inv[i]), tag .. ' inv ' .. i)
          if inv_t[i] then assert.are.same(bits(t1), bits(inv_t[i]), tag .. ' inv_t ' .. i) end
        end
        for r = 0, W - 1 do
          local out = {}
          for i, p in ipairs(pieces[r]) do out[i] = p.x and ms.empty({ p.x:numel() }, { dtype = name }) or nil end
          F.float8_cast_blockwise_many(pieces[r], sc, name, out)
          for i, p in ipairs(pieces[r]) do
            if p.x then
              local want = F.float8_cast_blockwise_piece(p.x, sc[i], p.R, p.C, p.offset, name)
              assert.are.same(bits(want), bits(out[i]), ('%s rank %d weight %d'):format(tag, r, i))
            end
          end
        end
      end
    end
  end)

  it('many pieces: more than a launch\'s table (150 pieces), and none', function()
    local shapes = {}
    for i = 1, 150 do shapes[i] = { 1 + i % 7, 3 + i % 11, i % 2 == 0 and 'bf16' or 'f32' } end
    local ws, pieces = sharded(shapes, 1)
    local grids, sc, out = {}, {}, {}
    for i, w in ipairs(ws) do grids[i] = ms.rand({ 1, 1 }, { seed = i }); sc[i] = ms.zeros({ 1, 1 }) end
    F.float8_amax_blockwise_many(pieces[0], grids)
    F.float8_scales_blockwise_many(grids, 'f8e4m3', { scale = sc })
    for i, p in ipairs(pieces[0]) do out[i] = ms.empty({ p.x:numel() }, { dtype = 'f8e4m3' }) end
    F.float8_cast_blockwise_many(pieces[0], sc, 'f8e4m3', out)
    for i, p in ipairs(pieces[0]) do
      local a = F.float8_amax_blockwise_piece(p.x, p.R, p.C, 0)
      assert.are.same(bits(a), bits(grids[i]), i)
      assert.are.same(bits(F.float8_cast_blockwise_piece(p.x, F.float8_scales_blockwise(a, 'f8e4m3'), p.R, p.C, 0, 'f8e4m3')), bits(out[i]), i)
    end
    F.float8_amax_blockwise_many({}, {})
    F.float8_scales_blockwise_many({}, 'f8e4m3', {})
    F.float8_cast_blockwise_many({}, {}, 'f8e4m3', {})
  end)

  it('many pieces read their own elements only (huge values just outside each piece)', function()
    local v = values(randn({ 130 * 256 }))
    local cuts = { 0, 100, 300, 128 * 256 + 7, 130 * 256 }
    for k = 2, #cuts - 1 do v[cuts[k]] = 1e30; v[cuts[k] + 1] = -1e30 end
    local flat = S.make({ 130 * 256 }, v, 'f32')
    local pieces, grids, out, sc = {}, {}, {}, {}
    for k = 1, #cuts - 1 do
      pieces[k] = { x = flat:narrow(1, cuts[k] + 1, cuts[k + 1] - cuts[k]), R = 130, C = 256, offset = cuts[k] }
      grids[k], sc[k] = ms.zeros({ 2, 2 }), ms.rand({ 2, 2 }, { seed = k })
      out[k] = ms.empty({ cuts[k + 1] - cuts[k] }, { dtype = 'f8e4m3' })
    end
    F.float8_amax_blockwise_many(pieces, grids)
    F.float8_cast_blockwise_many(pieces, sc, 'f8e4m3', out)
    for k, p in ipairs(pieces) do
      assert.are.same(values(F.float8_amax_blockwise_piece(p.x, 130, 256, p.offset)), values(grids[k]), k)
      assert.are.same(values(F.float8_cast_blockwise_piece(p.x, sc[k], 130, 256, p.offset, 'f8e4m3')), values(out[k]), k)
    end
  end)

  it('many pieces: bad arguments are errors naming the piece', function()
    local flat = randn({ 130 * 256 })
    local piece = flat:narrow(1, 1, 300)
    local function err(fn, want)
      local e = S.errmsg(fn)
      assert.is_truthy(e:find(want, 1, true), e)
    end
    local g = function() return ms.zeros({ 2, 2 }) end
    local p = { x = piece, R = 130, C = 256, offset = 0 }
    err(function() F.float8_amax_blockwise_many({ p, p }, { g(), ms.zeros({ 2, 3 }) }) end,
      'float8_amax_blockwise_many (piece 2): amax must be a contiguous f32 (2, 2)')
    err(function() F.float8_amax_blockwise_many({ p, { R = 130, C = 256, offset = 130 * 256 + 1 } }, { g(), g() }) end,
      '(piece 2): an empty piece at offset 33281 is not inside a (130, 256) matrix')
    err(function() F.float8_amax_blockwise_many({ { x = piece, R = 130, C = 256, offset = 130 * 256 - 10 } }, { g() }) end,
      '(piece 1): x')
    err(function() F.float8_amax_blockwise_many({ { x = ms.randn({ 10, 3 }):select(2, 1), R = 130, C = 256 } }, { g() }) end,
      'x must be contiguous')
    local v = ms.zeros({ 6 })
    err(function() F.float8_amax_blockwise_many({ p, p }, { v:narrow(1, 1, 4):view({ 2, 2 }), v:narrow(1, 3, 4):view({ 2, 2 }) }) end,
      'amax[1] overlaps amax[2]')
    err(function() F.float8_amax_blockwise_many({ p }, nil) end, 'amax must be a list of tensors')
    err(function() F.float8_amax_blockwise_many({ { x = piece, C = 256 } }, { g() }) end, 'pieces[1].R must be a number')
    local sc = F.float8_scales_blockwise(F.float8_amax_blockwise_piece(piece, 130, 256, 0), 'f8e4m3')
    local o = ms.empty({ 300 }, { dtype = 'f8e4m3' })
    err(function() F.float8_cast_blockwise_many({ p }, { sc }, 'bf16', { o }) end, 'f8e4m3 or f8e5m2')
    err(function() F.float8_cast_blockwise_many({ p }, { sc }, 'f8e4m3', { ms.empty({ 299 }, { dtype = 'f8e4m3' }) }) end,
      '(piece 1): out must be a contiguous f8e4m3 (300)')
    err(function() F.float8_cast_blockwise_many({ p }, { sc }, 'f8e5m2', { o }) end, 'out must be a contiguous f8e5m2 (300)')
    err(function() F.float8_cast_blockwise_many({ p }, { ms.zeros({ 3, 2 }) }, 'f8e4m3', { o }) end,
      '(piece 1): scale must be a contiguous f32 (2, 2)')
    err(function() F.float8_cast_blockwise_many({ p, { R = 130, C = 256 } }, { sc }, 'f8e4m3', { o, o }) end,
      "(piece 2): an empty piece's out must be NULL or empty")
    err(function() F.float8_cast_blockwise_many({ p, p }, { sc, sc }, 'f8e4m3', { o, o }) end, 'out[1] overlaps out[2]')
    err(function() F.float8_cast_blockwise_many({ p }, { sc }, 'f8e4m3', {}) end, '(piece 1): out is missing')
    err(function() F.float8_scales_blockwise_many({ g(), ms.zeros({ 2, 2 }, { dtype = 'bf16' }) }, 'f8e4m3') end,
      '(grid 2): amax must be a contiguous f32')
    err(function() F.float8_scales_blockwise_many({ g() }, 'f8e4m3', { inv = { ms.zeros({ 2, 2 }) } }) end,
      '(grid 1): inv must be a contiguous f32 (2, 4)')
    err(function() F.float8_scales_blockwise_many({ g() }, 'f8e4m3', { inv_t = { ms.zeros({ 2, 3 }) } }) end,
      '(grid 1): inv_t must be a contiguous f32 (2, 4)')
    local a = g()
    err(function() F.float8_scales_blockwise_many({ a }, 'f8e4m3', { scale = { a } }) end, 'scale[1] overlaps amax[1]')
    err(function() F.float8_scales_blockwise_many({ a }, 'f32') end, 'f8e4m3 or f8e5m2')
  end)

  it('scaled_matmul with block scales sums each K block\'s product times its blocks\' scales (1x128 x 1x128 / 128x128, either side; bias, beta)', function()
    local M, N, K = 40, 150, 300
    local xa, xb = ragged(M, K), ragged(N, K)
    for _, pair in ipairs({ { '1x128', '128x128' }, { '1x128', '1x128' }, { '128x128', '1x128' } }) do
      local function cast(x, blocks)
        local r, _, inv = F.float8_cast_blockwise(x, 'f8e4m3', { blocks = blocks })
        local _, dq = q_blk(x, 'f8e4m3', blocks == '1x128' and 'rows' or 'tile', false)
        return r, inv, dq
      end
      local a, ai, ad = cast(xa, pair[1])
      local b, bi, bd = cast(xb, pair[2])
      local want = ms.matmul(ad, bd, false, true)
      local o = { a_blocks = pair[1], b_blocks = pair[2] }
      local y = F.scaled_matmul(a, b, ai, bi, { a_blocks = o.a_blocks, b_blocks = o.b_blocks, out_dtype = 'f32' })
      assert.is_true(relerr(y, want) < 1e-6, pair[1] .. ' x ' .. pair[2])
      local yb = F.scaled_matmul(a, b, ai, bi, { a_blocks = o.a_blocks, b_blocks = o.b_blocks })
      assert.are.equal('bf16', yb.dtype)
      assert.is_true(relerr(yb, want) < 4e-3)
      local bias = randn({ N })
      local acc = randn({ M, N })
      local acc0 = acc:to('f64')
      F.scaled_matmul(a, b, ai, bi, { a_blocks = o.a_blocks, b_blocks = o.b_blocks, out = acc, beta = 1, bias = bias })
      assert.is_true(relerr(acc, want + acc0 + bias:to('f64')) < 1e-6, 'bias and beta')
    end
  end)

  it('scaled_matmul refuses two 128x128 operands, e5m2, scales of another layout, fast accumulation, one kind missing', function()
    local x = randn({ 32, 256 })
    local a, _, ai = F.float8_cast_blockwise(x, 'f8e4m3')
    local t, _, ti = F.float8_cast_blockwise(x, 'f8e4m3', { blocks = '128x128' })
    local e5, _, e5i = F.float8_cast_blockwise(x, 'f8e5m2')
    local function err(fn, want)
      local e = S.errmsg(fn)
      assert.is_truthy(e:find(want, 1, true), e)
    end
    err(function() F.scaled_matmul(t, t, ti, ti, { a_blocks = '128x128', b_blocks = '128x128' }) end,
      'both with 128x128 blocks')
    err(function() F.scaled_matmul(a, e5, ai, e5i, { a_blocks = '1x128', b_blocks = '1x128' }) end,
      'blockwise products take f8e4m3 operands')
    err(function() F.scaled_matmul(a, a, ai, ti, { a_blocks = '1x128', b_blocks = '1x128' }) end,
      'binv (1x128 scales of a (32, 256) operand) must be a contiguous f32 (2, 32)')
    err(function() F.scaled_matmul(a, a, ai, ai, { a_blocks = '1x128', b_blocks = '1x128', fast_accum = true }) end,
      'no fast accumulation')
    err(function() F.scaled_matmul(a, a, ai, ai, { a_blocks = '1x128' }) end, "b_blocks must be '1x128' or '128x128'")
    err(function() F.scaled_matmul(a, a:narrow(2, 1, 128):contiguous(), ai, ai, { a_blocks = '1x128', b_blocks = '1x128' }) end,
      'must share their last dim K')
  end)

  -- the blockwise layer's three products written out in f64 (w as (out, in)):
  -- y = x 1x128 @ w 128x128^T, dx = g 1x128 @ w 128x128, dw = g 128x1^T @ x 128x1
  local function blk_ref(x2, w, g2, wt)
    local wo = wt and w or w:t():contiguous()
    local _, xq = q_blk(x2, 'f8e4m3', 'rows', false)
    local _, wq = q_blk(wo, 'f8e4m3', 'tile', false)
    local _, gq = q_blk(g2, 'f8e4m3', 'rows', false)
    local _, gc = q_blk(g2, 'f8e4m3', 'cols', false)
    local _, xc = q_blk(x2, 'f8e4m3', 'cols', false)
    return ms.matmul(xq, wq, false, true), ms.matmul(gq, wq), ms.matmul(gc, xc, true, false)
  end

  it('float8.linear with blockwise computes those products (Linear, Conv1D, bias, 3-D x, a token count not a multiple of 128)', function()
    for _, wt in ipairs({ true, false }) do
      local x = randn({ 3, 50, 256 }):requires_grad_()
      local w = (wt and randn({ 384, 256 }, 0.2) or randn({ 256, 384 }, 0.2)):requires_grad_()
      local b = randn({ 384 }):requires_grad_()
      local y = float8.linear(x, w, b, { wt = wt, recipe = 'blockwise' })
      assert.are.same({ 3, 50, 384 }, y.shape)
      local g = randn({ 3, 50, 384 })
      y:backward(g)
      local x2, g2 = x:detach():view(150, 256), g:view(150, 384)
      local wy, wdx, wdw = blk_ref(x2, w:detach(), g2, wt)
      local tag = wt and 'Linear' or 'Conv1D'
      assert.is_true(relerr(y:view(150, 384), wy + b:detach():to('f64')) < 1e-6, tag .. ' forward')
      assert.is_true(relerr(x.grad:view(150, 256), wdx) < 1e-6, tag .. ' dx')
      assert.is_true(relerr(wt and w.grad or w.grad:t(), wdw) < 1e-6, tag .. ' dw')
      assert.is_true(relerr(b.grad, g2:sum(1)) < 1e-6, tag .. ' db')
    end
  end)

  -- e4m3 keeps 3 mantissa bits: a value's rounding is at most 2^-4 of it
  -- (half a step), about 2^-4 / sqrt(12) ~ 1.8% of it on average for
  -- uniform mantissas; each product's two operands are rounded apart, so
  -- the products' relative error is ~2.5-4% on random data. Bound: 6%
  it('matches the bf16 layer within FP8 rounding (forward and gradients within 6%, and the rounding is there)', function()
    local x = randn({ 256, 256 }, 1, 'bf16'):requires_grad_()
    local w = randn({ 384, 256 }, 0.1, 'bf16'):requires_grad_()
    local g = randn({ 256, 384 }, 1, 'bf16')
    local y = float8.linear(x, w, nil, { recipe = 'blockwise' })
    assert.are.equal('bf16', y.dtype)
    y:backward(g)
    local x0, w0 = x:detach():requires_grad_(), w:detach():requires_grad_()
    local y0 = nnf.linear(x0, w0)
    y0:backward(g)
    for _, p in ipairs({ { y, y0, 'y' }, { x.grad, x0.grad, 'dx' }, { w.grad, w0.grad, 'dw' } }) do
      local e = relerr(p[1]:to('f64'), p[2]:to('f64'))
      assert.is_true(e < 0.06 and e > 0.005, ('%s %.3g'):format(p[3], e))
    end
  end)

  it('blockwise gradients match the f64 finite differences of the linear map within FP8 rounding', function()
    local x = randn({ 4, 128 }, 1, 'f64'):requires_grad_()
    local w = randn({ 128, 128 }, 0.3, 'f64'):requires_grad_()
    local g = randn({ 4, 128 }, 1, 'f64')
    float8.linear(x, w, nil, { recipe = 'blockwise' }):backward(g)
    assert.are.equal('f64', x.grad.dtype)
    local xd, wd = x:detach(), w:detach()
    local function L() return ms.matmul(xd, wd, false, true):mul(g):sum():item() end
    local ex, ew = fd_rel(xd, x.grad, L), fd_rel(wd, w.grad, L)
    assert.is_true(ex < 0.1 and ew < 0.1, ('dx %.3g, dw %.3g'):format(ex, ew))
    assert.is_true(ex > 1e-4 and ew > 1e-4, 'the FP8 rounding is there')
  end)

  it('one outlier token costs its own blocks only: blockwise keeps the other rows that tensorwise loses', function()
    local v = values(randn({ 32, 128 }, 1e-3))
    for j = 1, 128 do v[j] = v[j] * 1e6 end
    local x = S.make({ 32, 128 }, v, 'f32')
    local w = randn({ 128, 128 }, 0.2)
    local exact = ms.matmul(x:to('f64'), w:to('f64'), false, true)
    local y = ms.no_grad(function() return float8.linear(x, w, nil, { recipe = 'blockwise' }) end)
    local e = relerr(y:narrow(1, 2, 31), exact:narrow(1, 2, 31))
    assert.is_true(e < 0.1, ('blockwise %.3g'):format(e))
  end)

  it('the f32 sink accumulates dW; recompute_weight gives the same gradients; q/k/v share the input casts; features not multiples of 128 are refused', function()
    local x = randn({ 64, 128 }, 1, 'bf16'):requires_grad_()
    local w = randn({ 256, 128 }, 0.2, 'bf16'):requires_grad_()
    local sink = { t = ms.zeros({ 256, 128 }), written = {}, i = 1 }
    ms.autograd.set_grad_sink(w, sink)
    local g = randn({ 64, 256 }, 1, 'bf16')
    float8.linear(x, w, nil, { recipe = 'blockwise' }):backward(g)
    assert.is_nil(w.grad)
    local _, _, want = blk_ref(x:detach():to('f32'), w:detach():to('f32'), g:to('f32'), true)
    assert.is_true(relerr(sink.t, want) < 1e-6, 'sink')
    float8.linear(x, w, nil, { recipe = 'blockwise' }):backward(g)
    assert.is_true(relerr(sink.t, want * 2) < 1e-6, 'accumulated')
    ms.autograd.set_grad_sink(w, nil)
    local function run(rw)
      seed = 9100
      local xx = randn({ 32, 128 }):requires_grad_()
      local ww = randn({ 128, 128 }, 0.2):requires_grad_()
      local before = float8.stats().weight_casts
      float8.linear(xx, ww, nil, { recipe = 'blockwise', recompute_weight = rw }):backward(randn({ 32, 128 }))
      return values(xx.grad), values(ww.grad), float8.stats().weight_casts - before
    end
    local a1, b1, n1 = run(false)
    local a2, b2, n2 = run(true)
    assert.are.same(a1, a2); assert.are.same(b1, b2)
    assert.are.equal(1, n1); assert.are.equal(2, n2)
    -- q/k/v: one input cast each way for the three layers
    local xs = randn({ 32, 128 }):requires_grad_()
    local before, bb = float8.stats().input_casts, float8.stats().backward_casts
    local loss
    for _ = 1, 3 do
      local y = float8.linear(xs, randn({ 128, 128 }, 0.1):requires_grad_(), nil, { recipe = 'blockwise' }):sum()
      loss = loss and loss + y or y
    end
    assert.are.equal(1, float8.stats().input_casts - before)
    loss:backward()
    assert.are.equal(1, float8.stats().backward_casts - bb)
    local e = S.errmsg(function() float8.linear(randn({ 8, 128 }), randn({ 96, 128 }), nil, { recipe = 'blockwise' }) end)
    assert.is_truthy(e:find('multiples of 128', 1, true) and e:find('(96, 128)', 1, true), e)
    local e2 = S.errmsg(function() float8.config { recipe = 'blockwise', grad_output = 'f8e5m2' } end)
    assert.is_truthy(e2:find('blockwise recipe takes f8e4m3 for every operand', 1, true), e2)
  end)

  local llama = require 'models.llama'
  -- a tiny Llama whose every projection is a multiple of 128 wide
  local wide = { intermediate_size = 256, num_key_value_heads = 4 }

  it('convert takes the layers 128-wide both ways (the tiny Llama\'s q/o, all of a wider one); revert; checkpointing composes', function()
    ms.manual_seed(3)
    local names = float8.convert(llama.new('tiny'), { recipe = 'blockwise' })
    assert.are.equal(4 * 2, #names)
    for _, n in ipairs(names) do assert.is_truthy(n:find('q_proj', 1, true) or n:find('o_proj', 1, true), n) end
    local m = llama.new('tiny', wide)
    assert.are.equal(28, #float8.convert(m, { recipe = 'blockwise' }))
    assert.are.equal('blockwise', float8.converted(m.model.layers[1].mlp.up_proj).recipe)
    assert.are.equal(28, #float8.revert(m))
    local e = S.errmsg(function() float8.convert(llama.new('tiny', { hidden_size = 64, num_attention_heads = 2,
      num_key_value_heads = 1, intermediate_size = 96 }), { recipe = 'blockwise' }) end)
    assert.is_truthy(e:find('features multiples of 128', 1, true), e)
    -- every block checkpointed: the same loss and gradients as without
    local function grads(ckpt)
      ms.manual_seed(4)
      local mm = llama.new('tiny', wide)
      float8.convert(mm, { recipe = 'blockwise' })
      if ckpt then ms.nn.apply_activation_checkpointing(mm, { class = 'LlamaDecoderLayer' }) end
      local ids = (ms.rand({ 2, 33 }, { seed = 6 }) * 255):long()
      local loss = mm(ids:narrow(2, 1, 32):contiguous(), ids:narrow(2, 2, 32):contiguous())
      loss:backward()
      return loss:item(), values(mm.model.layers[2].mlp.down_proj.weight.grad)
    end
    local l1, g1 = grads(false)
    local l2, g2 = grads(true)
    assert.are.equal(l1, l2)
    assert.are.same(g1, g2)
  end)

  it('a tiny Llama converted with blockwise follows its f32 losses', function()
    local function run(recipe)
      ms.manual_seed(11)
      local m = llama.new('tiny', wide)
      if recipe then float8.convert(m, { recipe = recipe }) end
      local ids = (ms.rand({ 4, 33 }, { seed = 5 }) * 255):long()
      return S.adamw_losses(m, ids:narrow(2, 1, 32):contiguous(), ids:narrow(2, 2, 32):contiguous(), 6, 3e-3)
    end
    local a, b = run(nil), run('blockwise')
    assert.is_true(b[6] < b[1] - 0.3, 'blockwise trains')
    for k = 1, 6 do
      assert.is_true(math.abs(a[k] - b[k]) < 0.05 * a[k], ('step %d: %g against %g'):format(k, b[k], a[k]))
    end
    assert.is_true(a[1] ~= b[1], 'the FP8 path ran')
  end)

  it('bin/train --float8 blockwise converts the 128-wide layers and trains', function()
    local dir = S.tmpdir()
    local status, out = S.bin_train(('models/llama.lua --steps 2 --batch-size 4 --seq-len 32 --eval-every 0 '
      .. '--sample-tokens 0 --log-every 1 --float8 blockwise --out %s/run'):format(dir))
    assert.are.equal(0, status, out)
    assert.is_truthy(out:find('float8: blockwise, 8 of 29 linear layers', 1, true), out)
    assert.are.equal(2, #S.run_losses(dir .. '/run'))
  end)
end)

-- the tensorwise casts of many pieces at once (FSDP's precompute of every
-- tensorwise weight's shard part: core/ops.h ms_float8_amax_many,
-- ms_float8_cast_many) against amax and float8_cast piece by piece, byte
-- for byte
describe('float8 tensorwise casts of many pieces', function()
  local function bits(t)
    local c = t:contiguous()
    local n = c:numel() * c:element_size()
    local p = n > 0 and ffi.cast('uint8_t *', c:data_ptr()) or nil
    local r = {}
    for i = 0, n - 1 do r[i + 1] = p[i] end
    return r
  end
  -- pieces of the float dtypes, odd lengths and magnitudes apart, one empty,
  -- one absent (false), one of a single value repeated, one with a NaN
  local function pieces()
    local xs = {
      randn({ 333 }, 3, 'bf16'), randn({ 7 }, 1e-3, 'f32'), ms.zeros({ 0 }, { dtype = 'bf16' }), false,
      randn({ 1001 }, 40, 'f64'), ms.full({ 77 }, -2.5, { dtype = 'bf16' }), randn({ 1 }, 1, 'f16'),
      randn({ 4099 }, 1e4, 'f32'), randn({ 129 }, 0.5, 'bf16'),
    }
    local v = values(randn({ 65 }, 2))
    v[31] = 0 / 0
    xs[#xs + 1] = S.make({ 65 }, v, 'f32')
    return xs
  end

  it('amax and the cast of every piece in one call: the bits of amax and float8_cast (dtypes mixed, odd lengths, an empty piece, an absent one, all-equal values, a NaN; e4m3 and e5m2, pow2 on, off and mixed; into one packed buffer)', function()
    local xs = pieces()
    local n = #xs
    -- the amaxes: slots of one vector filled with noise first (fully_shard's)
    local vec = ms.rand({ n + 3 }, { seed = 90 })
    local tail = bits(vec:narrow(1, n + 1, 3))
    local amax = {}
    for i = 1, n do amax[i] = vec:narrow(1, i, 1):view({}) end
    assert.are.equal(amax, F.float8_amax_many(xs, amax))
    for i, x in ipairs(xs) do
      local want = x and F.amax(x) or ms.zeros({})
      assert.are.same(bits(want), bits(amax[i]), 'amax of piece ' .. i)
    end
    assert.are.same(tail, bits(vec:narrow(1, n + 1, 3)), 'the vector past the amaxes untouched')
    assert.are.equal(0, amax[3]:item(), 'an empty piece: 0')
    assert.are.equal(2.5, amax[6]:item())
    assert.is_true(amax[n]:item() ~= amax[n]:item(), 'a NaN wins')
    -- cast with amaxes below the pieces' own for some (saturation)
    local am = {}
    for i = 1, n do am[i] = F.mul(amax[i], i % 3 == 0 and 0.25 or 1) end
    for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
      for _, pow2 in ipairs({ false, true, 'mixed' }) do
        local tag = ('%s pow2 %s'):format(name, tostring(pow2))
        local p2 = {}
        for i = 1, n do p2[i] = pow2 == 'mixed' and i % 2 == 0 or pow2 == true end
        -- the outputs: views of one byte buffer at odd offsets, noise between
        local total = 0
        for _, x in ipairs(xs) do total = total + (x and x:numel() or 0) + 3 end
        local buf = F.mul(ms.rand({ total }, { seed = 91 }), 200):to(name)
        local out, inv, at, off = {}, {}, {}, 1
        for i, x in ipairs(xs) do
          off = off + 3
          if x and x:numel() > 0 then out[i] = buf:narrow(1, off, x:numel()); off = off + x:numel() end
          at[i] = off
          inv[i] = ms.rand({ 1 }, { seed = 100 + i })
        end
        local before = bits(buf)
        assert.are.equal(out, F.float8_cast_many(xs, am, name, { pow2 = p2, out = out, inv = inv }))
        local after, o = bits(buf), 1
        for i, x in ipairs(xs) do
          for k = o, o + 2 do assert.are.equal(before[k], after[k], tag .. ' a byte between the pieces') end
          local m = x and x:numel() or 0
          local src = x and x:view({ 1, m }) or ms.zeros({ 0, 0 })
          local w, _, winv = F.float8_cast(src, am[i], name, { pow2 = p2[i] })
          if m > 0 then assert.are.same(bits(w), bits(out[i]), tag .. ' piece ' .. i) end
          assert.are.same(bits(winv), bits(inv[i]), tag .. ' inv ' .. i)
          o = o + 3 + m
          assert.are.equal(at[i], o)
        end
      end
    end
    -- inv not wanted
    local out = {}
    for i, x in ipairs(xs) do out[i] = x and x:numel() > 0 and ms.empty({ x:numel() }, { dtype = 'f8e4m3' }) or nil end
    F.float8_cast_many(xs, am, 'f8e4m3', { out = out })
    assert.are.same(bits(F.float8_cast(xs[1]:view({ 1, 333 }), am[1], 'f8e4m3')), bits(out[1]))
  end)

  it('more than a launch\'s table (150 pieces), and none', function()
    local xs, amax, out, inv = {}, {}, {}, {}
    for i = 1, 150 do
      xs[i] = randn({ 1 + (i * 37) % 301 }, 10 ^ (i % 5 - 2), i % 2 == 0 and 'bf16' or 'f32')
      amax[i], inv[i] = ms.rand({ 1 }, { seed = i }), ms.zeros({ 1 })
      out[i] = ms.empty({ xs[i]:numel() }, { dtype = 'f8e4m3' })
    end
    F.float8_amax_many(xs, amax)
    F.float8_cast_many(xs, amax, 'f8e4m3', { out = out, inv = inv })
    for i, x in ipairs(xs) do
      local a = F.amax(x)
      assert.are.same(bits(a), bits(amax[i]), i)
      local w, _, wi = F.float8_cast(x:view({ 1, x:numel() }), a, 'f8e4m3')
      assert.are.same(bits(w), bits(out[i]), i)
      assert.are.same(bits(wi), bits(inv[i]), i)
    end
    F.float8_amax_many({}, {})
    F.float8_cast_many({}, {}, 'f8e4m3', {})
  end)

  it('each piece reads its own elements only (huge values just outside each)', function()
    local v = values(randn({ 1000 }))
    local cuts = { 0, 100, 301, 304, 777, 1000 }
    for k = 2, #cuts - 1 do v[cuts[k]] = 1e30; v[cuts[k] + 1] = -1e30 end
    local flat = S.make({ 1000 }, v, 'f32')
    local xs, amax, out = {}, {}, {}
    for k = 1, #cuts - 1 do
      local m = cuts[k + 1] - cuts[k] - 2
      xs[k] = flat:narrow(1, cuts[k] + 2, m)
      amax[k], out[k] = ms.zeros({}), ms.empty({ m }, { dtype = 'f8e4m3' })
    end
    F.float8_amax_many(xs, amax)
    F.float8_cast_many(xs, amax, 'f8e4m3', { out = out })
    for k, x in ipairs(xs) do
      assert.is_true(amax[k]:item() < 100, k)
      assert.are.same(bits(F.amax(x)), bits(amax[k]), k)
      assert.are.same(bits(F.float8_cast(x:view({ 1, x:numel() }), amax[k], 'f8e4m3')), bits(out[k]), k)
    end
  end)

  it('bad arguments are errors naming the piece', function()
    local function err(fn, want)
      local e = S.errmsg(fn)
      assert.is_truthy(e:find(want, 1, true), e)
    end
    local x = randn({ 300 })
    local a, o = ms.zeros({}), ms.empty({ 300 }, { dtype = 'f8e4m3' })
    err(function() F.float8_amax_many({ x, x }, { a, ms.zeros({ 2 }) }) end,
      'float8_amax_many (piece 2): amax must be one f32 element on cpu')
    err(function() F.float8_amax_many({ x }, { ms.zeros({}, { dtype = 'bf16' }) }) end, 'amax must be one f32 element')
    err(function() F.float8_amax_many({ x:view({ 3, 100 }) }, { a }) end,
      'float8_amax_many (piece 1): x must be a contiguous 1-D float tensor')
    err(function() F.float8_amax_many({ randn({ 10, 3 }):select(2, 1) }, { a }) end, 'x must be a contiguous 1-D')
    err(function() F.float8_amax_many({ ms.zeros({ 4 }, { dtype = 'i32' }) }, { a }) end, 'x must be a contiguous 1-D float')
    err(function() F.float8_amax_many({ x }, {}) end, '(piece 1): amax is missing')
    err(function() F.float8_amax_many({ x }, nil) end, 'amax must be a list of tensors')
    err(function() F.float8_amax_many(x, { a }) end, 'xs must be a list')
    err(function() F.float8_amax_many({ x, x }, { a, a }) end, 'amax[1] overlaps amax[2]')
    local v = ms.zeros({ 4 })
    err(function() F.float8_amax_many({ v:narrow(1, 2, 3) }, { v:narrow(1, 2, 1) }) end, 'amax[1] overlaps x[1]')
    err(function() F.float8_cast_many({ x }, { a }, 'bf16', { out = { o } }) end, 'f8e4m3 or f8e5m2')
    err(function() F.float8_cast_many({ x }, { a }, 'f8e4m3', { out = { ms.empty({ 299 }, { dtype = 'f8e4m3' }) } }) end,
      'float8_cast_many (piece 1): out must be a contiguous f8e4m3 (300) on cpu')
    err(function() F.float8_cast_many({ x }, { a }, 'f8e5m2', { out = { o } }) end, 'out must be a contiguous f8e5m2 (300)')
    err(function() F.float8_cast_many({ x }, { a }, 'f8e4m3', {}) end, '(piece 1): out is missing')
    err(function() F.float8_cast_many({ x, false }, { a, ms.zeros({}) }, 'f8e4m3', { out = { o, o } }) end,
      "(piece 2): an empty piece's out must be NULL or empty")
    err(function() F.float8_cast_many({ x, x }, { a, a }, 'f8e4m3', { out = { o, o } }) end, 'out[1] overlaps out[2]')
    err(function() F.float8_cast_many({ x }, { a }, 'f8e4m3', { out = { o }, inv = { ms.zeros({ 2 }) } }) end,
      '(piece 1): inv must be one f32 element')
    err(function() F.float8_cast_many({ x }, { a }, 'f8e4m3', { out = { o }, inv = { a } }) end, 'inv[1] overlaps amax[1]')
  end)
end)
