-- bf16 and f16 conversion: round to nearest even on hand-picked bit
-- patterns, exhaustive round trips, f64 -> bf16/f16 rounding once, and a
-- comparison against an independent Lua implementation on random f32 values.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local ffi = require 'ffi'
local bit = require 'bit'
local C = T.C

-- f32 bits <-> number
local u32buf = ffi.new('uint32_t[1]')
local f32view = ffi.cast('float*', u32buf)
local function f32_of_bits(u) u32buf[0] = u; return f32view[0] end
local function bits_of_f32(x) f32view[0] = x; return tonumber(u32buf[0]) end
local function hex(v) return ('0x%04x'):format(v) end

-- a 1-D tensor whose f32 bit patterns are `bits`
local function f32_tensor(bits)
  local t = T.empty({ #bits }, { dtype = 'f32' })
  local p = ffi.cast('uint32_t*', t:data_ptr())
  for i = 1, #bits do p[i - 1] = bits[i] end
  return t
end
-- the same values as a non-contiguous (stride 2) view, for the strided copy path
local function f32_strided(bits)
  local b = {}
  for i, u in ipairs(bits) do b[2 * i - 1] = u; b[2 * i] = 0x3f800000 end
  local v = f32_tensor(b):view(#bits, 2):select(2, 1)
  assert(not v:is_contiguous())
  return v
end
local function u16_of(t)
  assert(t:is_contiguous())
  local p = ffi.cast('uint16_t*', t:data_ptr())
  local r = {}
  for i = 1, t:numel() do r[i] = p[i - 1] end
  return r
end
local function u16_tensor(bits, dtype)
  local t = T.empty({ #bits }, { dtype = dtype })
  local p = ffi.cast('uint16_t*', t:data_ptr())
  for i = 1, #bits do p[i - 1] = bits[i] end
  return t
end

-- ---------------------------------------------------------------- references
-- Round the non-negative integer m to a multiple of 2^s, nearest even;
-- returns m / 2^s rounded. All in exact double arithmetic (m < 2^53).
local function rne_shift(m, s)
  if s <= 0 then return m * 2 ^ -s end
  local q = math.floor(m / 2 ^ s)
  local rem = m - q * 2 ^ s
  local half = 2 ^ (s - 1)
  if rem > half or (rem == half and q % 2 == 1) then q = q + 1 end
  return q
end

-- f32 bits -> bf16 bits, from the fields of the f32 (bit ops only)
local function ref_bf16(u)
  local sign = bit.rshift(u, 31)
  local e = bit.band(bit.rshift(u, 23), 0xff)
  local mant = bit.band(u, 0x7fffff)
  if e == 0xff then
    if mant ~= 0 then return 'nan' end
    return sign * 0x8000 + 0x7f80
  end
  -- the 16 low bits go: round the magnitude (as an integer) at bit 16
  local mag = e * 2 ^ 23 + mant
  local r = rne_shift(mag, 16)   -- carries into the exponent naturally; 0x7f80 is inf
  return sign * 0x8000 + r
end

-- f32 bits -> f16 bits (bit ops for the fields, exact integer rounding)
local function ref_f16(u)
  local sign = bit.rshift(u, 31) * 0x8000
  local e = bit.band(bit.rshift(u, 23), 0xff)
  local mant = bit.band(u, 0x7fffff)
  if e == 0xff then
    if mant ~= 0 then return 'nan' end
    return sign + 0x7c00
  end
  if e == 0 then return sign end                 -- f32 subnormals are far below 2^-25
  local m = mant + 2 ^ 23                        -- 24-bit significand, value m * 2^(E-23)
  local E = e - 127
  if E >= -14 then                               -- f16 normal range: keep 11 bits
    local r = rne_shift(m, 13)
    if r == 2 ^ 11 then r = 2 ^ 10; E = E + 1 end
    if E + 15 >= 31 then return sign + 0x7c00 end
    return sign + (E + 15) * 1024 + (r - 1024)
  end
  -- subnormal: value = k * 2^-24, k = m * 2^(E+1)
  local k = rne_shift(m, -(E + 1))
  return sign + k                                -- k == 1024 is the smallest normal, as bits
end

-- an exact double -> nearest format value (p significand bits, smallest
-- normal exponent emin, largest finite maxf), nearest even; double arithmetic
local function ref_round(x, p, emin, maxf)
  if x ~= x then return x end
  local s = x < 0 and -1 or 1
  local a = math.abs(x)
  if a == 0 then return x end
  local _, ex = math.frexp(a)                    -- a = f * 2^ex, f in [0.5, 1)
  local E = math.max(ex - 1, emin)               -- exponent of the leading bit (clamped: subnormals)
  local ulp = 2 ^ (E - p + 1)
  local q = math.floor(a / ulp)
  local rem = a / ulp - q
  if rem > 0.5 or (rem == 0.5 and q % 2 == 1) then q = q + 1 end
  local r = q * ulp
  -- overflow: from halfway between maxf and the next (unrepresentable) value
  local _, mex = math.frexp(maxf)
  local half_over = maxf + 2 ^ (mex - 1 - p + 1) / 2
  if r > maxf or a >= half_over then return s * math.huge end
  return s * r
end
local BF16 = { p = 8, emin = -126, maxf = f32_of_bits(0x7f7f0000) }
local F16 = { p = 11, emin = -14, maxf = 65504 }

local function bf16_value(h) return C.ms_bf16_to_f32(h) end
local function f16_value(h) return C.ms_f16_to_f32(h) end
local function is_nan16(h, expmask) return bit.band(h, expmask) == expmask and bit.band(h, bit.bnot(expmask), 0x7fff) ~= 0 end

describe('dtype conversion', function()
  -- f32 bits, expected bf16 bits, what it shows
  local bf16_cases = {
    { 0x3f800000, 0x3f80, '1.0 is exact' },
    { 0x3f808000, 0x3f80, 'tie with an even lower neighbour stays' },
    { 0x3f818000, 0x3f82, 'tie with an odd lower neighbour rounds up' },
    { 0x3f808001, 0x3f81, 'just above the tie rounds up' },
    { 0x3f807fff, 0x3f80, 'just below the tie rounds down' },
    { 0xbf818000, 0xbf82, 'negative tie rounds to even magnitude' },
    { 0xbf808000, 0xbf80, 'negative tie, even' },
    { 0x3fffffff, 0x4000, 'rounding carries into the exponent' },
    { 0x7f7f7fff, 0x7f7f, 'largest finite bf16 stays finite' },
    { 0x7f7f8000, 0x7f80, 'tie above the largest finite bf16 overflows to inf' },
    { 0x7f7fffff, 0x7f80, 'FLT_MAX overflows to inf' },
    { 0xff7fffff, 0xff80, '-FLT_MAX overflows to -inf' },
    { 0x7f800000, 0x7f80, 'inf stays inf' },
    { 0xff800000, 0xff80, '-inf stays -inf' },
    { 0x80000000, 0x8000, '-0 stays -0' },
    { 0x00000000, 0x0000, '+0 stays +0' },
    { 0x00000001, 0x0000, 'smallest f32 subnormal rounds to 0' },
    { 0x00008000, 0x0000, 'subnormal tie rounds to even (0)' },
    { 0x00018000, 0x0002, 'subnormal tie rounds to even (2)' },
    { 0x00008001, 0x0001, 'subnormal above the tie' },
    { 0x807fffff, 0x8080, 'largest negative subnormal rounds up to the smallest normal' },
    { 0x00400000, 0x0040, 'subnormal exact' },
  }
  local nan_bits = { 0x7fc00000, 0xffc00000, 0x7f800001, 0x7fffffff, 0xff800001, 0x7f810000 }

  describe('f32 -> bf16', function()
    for _, c in ipairs(bf16_cases) do
      it(('%s: %s -> %s'):format(c[3], ('0x%08x'):format(c[1]), hex(c[2])), function()
        assert.are.equal(c[2], C.ms_f32_to_bf16(f32_of_bits(c[1])))
        assert.are.equal(c[2], ref_bf16(c[1]))  -- the reference agrees with the hand value
        -- through tensors: the contiguous fast path and the strided path
        local t = f32_tensor({ c[1], c[1] })
        assert.are.same({ c[2], c[2] }, u16_of(t:to('bf16')))
        local dst = T.empty({ 2 }, { dtype = 'bf16' })
        dst:copy_(f32_strided({ c[1], c[1] }))
        assert.are.same({ c[2], c[2] }, u16_of(dst))
      end)
    end

    it('NaN stays NaN (quiet and signalling payloads, both signs)', function()
      for _, u in ipairs(nan_bits) do
        local h = C.ms_f32_to_bf16(f32_of_bits(u))
        assert.is_true(is_nan16(h, 0x7f80), ('0x%08x -> %s'):format(u, hex(h)))
        local v = f32_tensor({ u }):to('bf16'):item()
        assert.is_true(v ~= v)
      end
    end)

    it('bf16 -> f32 is exact: the top 16 bits', function()
      for _, h in ipairs({ 0x3f80, 0xbf82, 0x0001, 0x8001, 0x7f7f, 0x4049, 0x0080 }) do
        assert.are.equal(f32_of_bits(h * 65536), C.ms_bf16_to_f32(h))
      end
      assert.are.equal(math.huge, C.ms_bf16_to_f32(0x7f80))
      assert.are.equal(-math.huge, C.ms_bf16_to_f32(0xff80))
      assert.are.equal(-math.huge, 1 / C.ms_bf16_to_f32(0x8000))
    end)

    it('every one of the 65536 bf16 values survives bf16 -> f32 -> bf16 (NaN stays NaN)', function()
      local all = {}
      for h = 0, 65535 do all[h + 1] = h end
      local back = u16_of(u16_tensor(all, 'bf16'):to('f32'):to('bf16'))
      local bad = 0
      for h = 0, 65535 do
        local g = back[h + 1]
        if is_nan16(h, 0x7f80) then
          if not is_nan16(g, 0x7f80) then bad = bad + 1 end
        elseif g ~= h then bad = bad + 1 end
      end
      assert.are.equal(0, bad)
    end)
  end)

  -- f32 value, expected f16 bits, what it shows
  local f16_cases = {
    { 1.0, 0x3c00, '1.0 is exact' },
    { 1 + 2 ^ -11, 0x3c00, 'tie with an even lower neighbour stays' },
    { 1 + 3 * 2 ^ -11, 0x3c02, 'tie with an odd lower neighbour rounds up' },
    { 1 + 2 ^ -11 + 2 ^ -23, 0x3c01, 'just above the tie rounds up' },
    { 1 + 2 ^ -11 - 2 ^ -23, 0x3c00, 'just below the tie rounds down' },
    { -(1 + 3 * 2 ^ -11), 0xbc02, 'negative tie rounds to even magnitude' },
    { 65504, 0x7bff, 'largest finite f16' },
    { 65519.99609375, 0x7bff, 'just below the overflow tie stays finite' },
    { 65520, 0x7c00, 'the overflow tie (65520) goes to inf' },
    { 1e6, 0x7c00, 'overflow to inf' },
    { -1e6, 0xfc00, 'overflow to -inf' },
    { math.huge, 0x7c00, 'inf stays inf' },
    { -math.huge, 0xfc00, '-inf stays -inf' },
    { 2 ^ -14, 0x0400, 'smallest normal' },
    { 2 ^ -14 - 2 ^ -25, 0x0400, 'tie between the largest subnormal and the smallest normal goes to even' },
    { 1023 * 2 ^ -24, 0x03ff, 'largest subnormal' },
    { 2 ^ -24, 0x0001, 'smallest subnormal' },
    { 2 ^ -25, 0x0000, 'half the smallest subnormal is a tie: rounds to 0 (even)' },
    { 2 ^ -25 + 2 ^ -48, 0x0001, 'just above that tie rounds up' },
    { 3 * 2 ^ -25, 0x0002, 'subnormal tie between 1 and 2 goes to 2' },
    { 5 * 2 ^ -25, 0x0002, 'subnormal tie between 2 and 3 goes to 2' },
    { 2 ^ -26, 0x0000, 'far below: 0' },
    { -(2 ^ -24), 0x8001, 'negative subnormal' },
    { -(2 ^ -26), 0x8000, 'negative underflow keeps the sign: -0' },
    { 0.1, 0x2e66, '0.1' },
    { 1 / 3, 0x3555, '1/3' },
  }

  describe('f32 -> f16', function()
    for _, c in ipairs(f16_cases) do
      it(('%s: %.10g -> %s'):format(c[3], c[1], hex(c[2])), function()
        local f = f32_of_bits(bits_of_f32(c[1]))  -- the case as an f32
        assert.are.equal(c[2], C.ms_f32_to_f16(f))
        assert.are.equal(c[2], ref_f16(bits_of_f32(c[1])))
        local t = f32_tensor({ bits_of_f32(c[1]), bits_of_f32(c[1]) })
        assert.are.same({ c[2], c[2] }, u16_of(t:to('f16')))
        local dst = T.empty({ 2 }, { dtype = 'f16' })
        dst:copy_(f32_strided({ bits_of_f32(c[1]), bits_of_f32(c[1]) }))
        assert.are.same({ c[2], c[2] }, u16_of(dst))
      end)
    end

    it('-0 stays -0', function()
      local h = C.ms_f32_to_f16(f32_of_bits(0x80000000))
      assert.are.equal(0x8000, h)
      assert.are.equal(-math.huge, 1 / C.ms_f16_to_f32(h))
    end)

    it('NaN stays NaN', function()
      for _, u in ipairs(nan_bits) do
        local h = C.ms_f32_to_f16(f32_of_bits(u))
        assert.is_true(is_nan16(h, 0x7c00), ('0x%08x -> %s'):format(u, hex(h)))
      end
    end)

    it('f16 -> f32 decodes subnormals, normals, inf and NaN exactly', function()
      local cases = { { 0x0001, 2 ^ -24 }, { 0x03ff, 1023 * 2 ^ -24 }, { 0x0400, 2 ^ -14 }, { 0x7bff, 65504 },
        { 0x3c00, 1 }, { 0xc000, -2 }, { 0x3555, 0.333251953125 }, { 0x8001, -(2 ^ -24) },
        { 0x7c00, math.huge }, { 0xfc00, -math.huge } }
      for _, c in ipairs(cases) do assert.are.equal(c[2], C.ms_f16_to_f32(c[1]), hex(c[1])) end
      local n = C.ms_f16_to_f32(0x7e00)
      assert.is_true(n ~= n)
      n = C.ms_f16_to_f32(0x7c01)
      assert.is_true(n ~= n)
    end)

    it('every one of the 65536 f16 values survives f16 -> f32 -> f16 and f16 -> f64 -> f16', function()
      local all = {}
      for h = 0, 65535 do all[h + 1] = h end
      local src = u16_tensor(all, 'f16')
      for _, via in ipairs({ 'f32', 'f64' }) do
        local back = u16_of(src:to(via):to('f16'))
        local bad = 0
        for h = 0, 65535 do
          local g = back[h + 1]
          if is_nan16(h, 0x7c00) then
            if not is_nan16(g, 0x7c00) then bad = bad + 1 end
          elseif g ~= h then bad = bad + 1 end
        end
        assert.are.equal(0, bad, via)
      end
    end)
  end)

  describe('against an independent Lua implementation on random f32 values', function()
    math.randomseed(20240601)
    local function random_bits(n, emin, emax)
      local r = {}
      while #r < n do
        local sign = math.random(0, 1)
        local e = math.random(emin, emax)
        local mant = math.random(0, 2 ^ 23 - 1)
        -- a quarter of the draws sit on or next to a rounding tie
        local k = math.random(4)
        if k == 1 then mant = mant - mant % 2 ^ 13 + 2 ^ 12 end          -- f16 tie
        if k == 2 then mant = mant - mant % 2 ^ 16 + 2 ^ 15 + math.random(-1, 1) end -- bf16 tie +-1
        if k == 3 then mant = mant - mant % 2 ^ 16 + 2 ^ 15 end
        mant = math.max(0, math.min(2 ^ 23 - 1, mant))
        local u = sign * 2 ^ 31 + e * 2 ^ 23 + mant
        if u % 2 ^ 31 ~= 0 then r[#r + 1] = u end                        -- never zero
      end
      return r
    end

    it('f32 -> bf16 matches on 20000 values over the whole range (exponent fields 0..254)', function()
      local bits = random_bits(20000, 0, 254)
      local got = u16_of(f32_tensor(bits):to('bf16'))
      local bad, first = 0, nil
      for i, u in ipairs(bits) do
        local want = ref_bf16(bit.tobit(u))
        if got[i] ~= want then bad = bad + 1; first = first or ('0x%08x: got %s want %s'):format(u, hex(got[i]), hex(want)) end
      end
      assert.are.equal(0, bad, first)
    end)

    it('f32 -> f16 matches on 20000 values around the f16 range (subnormal to overflow)', function()
      local bits = random_bits(20000, 127 - 27, 127 + 17)
      local got = u16_of(f32_tensor(bits):to('f16'))
      local bad, first = 0, nil
      for i, u in ipairs(bits) do
        local want = ref_f16(bit.tobit(u))
        if got[i] ~= want then bad = bad + 1; first = first or ('0x%08x: got %s want %s'):format(u, hex(got[i]), hex(want)) end
      end
      assert.are.equal(0, bad, first)
    end)

    it('the references agree with exact rounding of the value (a check on the checkers)', function()
      for _, u in ipairs(random_bits(3000, 127 - 27, 127 + 17)) do
        local x = f32_of_bits(u)
        local hb, hf = ref_bf16(bit.tobit(u)), ref_f16(bit.tobit(u))
        assert.are.equal(ref_round(x, BF16.p, BF16.emin, BF16.maxf), bf16_value(hb))
        assert.are.equal(ref_round(x, F16.p, F16.emin, F16.maxf), f16_value(hf))
      end
    end)
  end)

  describe('f64 -> bf16 / f16 rounds once', function()
    it('a value just above a bf16 tie, whose f32 rounding lands on the tie, rounds up', function()
      -- 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7; f32 would round the
      -- extra 2^-30 away and the tie would then go to even (1): double rounding
      local v = 1 + 2 ^ -8 + 2 ^ -30
      local t = ms.tensor({ v, -v, 1 + 2 ^ -8, 1 + 2 ^ -8 - 2 ^ -30 }, { dtype = 'f64' })
      assert.are.same({ 1 + 2 ^ -7, -(1 + 2 ^ -7), 1, 1 }, t:to('bf16'):totable())
      -- the same through ms.tensor(..., {dtype = 'bf16'}) and a strided copy
      assert.are.same({ 1 + 2 ^ -7 }, ms.tensor({ v }, { dtype = 'bf16' }):totable())
      local dst = T.empty({ 4 }, { dtype = 'bf16' })
      local src = t:view(4, 1):expand(4, 3):transpose(1, 2):select(1, 2)  -- stride 1 of an expand
      dst:copy_(ms.tensor({ t:totable(), t:totable() }, { dtype = 'f64' }):t():select(2, 2))
      assert.are.same({ 1 + 2 ^ -7, -(1 + 2 ^ -7), 1, 1 }, dst:totable())
      dst:copy_(src)
      assert.are.same({ 1 + 2 ^ -7, -(1 + 2 ^ -7), 1, 1 }, dst:totable())
    end)

    it('the same for f16: 1 + 2^-11 + 2^-30 rounds up to 1 + 2^-10', function()
      local v = 1 + 2 ^ -11 + 2 ^ -30
      local t = ms.tensor({ v, -v, 1 + 2 ^ -11 }, { dtype = 'f64' })
      assert.are.same({ 1 + 2 ^ -10, -(1 + 2 ^ -10), 1 }, t:to('f16'):totable())
    end)

    it('f64 above the f32 range still overflows to inf; tiny values keep their sign', function()
      local t = ms.tensor({ 1e300, -1e300, 1e-300, -1e-300 }, { dtype = 'f64' })
      for _, d in ipairs({ 'bf16', 'f16' }) do
        local r = t:to(d):totable()
        assert.are.equal(math.huge, r[1])
        assert.are.equal(-math.huge, r[2])
        assert.are.equal(0, r[3])
        assert.are.equal(math.huge, 1 / r[3])
        assert.are.equal(-math.huge, 1 / r[4])
      end
    end)

    it('matches exact rounding on 5000 random f64 values near ties', function()
      math.randomseed(99)
      local vals = {}
      for i = 1, 5000 do
        -- a value on a bf16 or f16 tie, nudged by less than an f32 ulp
        local e = math.random(-20, 14)
        local p = (i % 2 == 0) and 8 or 11
        local k = math.random(2 ^ (p - 1), 2 ^ p - 1)
        local tie = (k + 0.5) * 2 ^ (e - p + 1)
        local nudge = (math.random() - 0.5) * 2 ^ (e - 30)
        local v = tie + nudge
        if math.random() < 0.5 then v = -v end
        vals[i] = v
      end
      local t = ms.tensor(vals, { dtype = 'f64' })
      for _, spec in ipairs({ { 'bf16', BF16 }, { 'f16', F16 } }) do
        local got = t:to(spec[1]):totable()
        local bad, first = 0, nil
        for i, v in ipairs(vals) do
          local want = ref_round(v, spec[2].p, spec[2].emin, spec[2].maxf)
          if got[i] ~= want then
            bad = bad + 1
            first = first or ('%s: %.17g -> %.17g, want %.17g'):format(spec[1], v, got[i], want)
          end
        end
        assert.are.equal(0, bad, first)
      end
    end)
  end)

  describe('between low-precision types', function()
    it('bf16 -> f16 and f16 -> bf16 round once from the exact value', function()
      math.randomseed(7)
      local bits = {}
      for i = 1, 4000 do bits[i] = math.random(0x0001, 0x7bff) + (i % 2) * 0x8000 end
      local src = u16_tensor(bits, 'f16')
      local got = src:to('bf16'):totable()
      for i, h in ipairs(bits) do
        local x = f16_value(h)
        assert.are.equal(ref_round(x, BF16.p, BF16.emin, BF16.maxf), got[i])
      end
      local bb = {}
      for i = 1, 4000 do bb[i] = math.random(0x3000, 0x4800) + (i % 2) * 0x8000 end -- around the f16 range
      local got2 = u16_tensor(bb, 'bf16'):to('f16'):totable()
      for i, h in ipairs(bb) do
        assert.are.equal(ref_round(bf16_value(h), F16.p, F16.emin, F16.maxf), got2[i])
      end
    end)
  end)
end)
