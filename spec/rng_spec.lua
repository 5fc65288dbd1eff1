-- Random numbers (core/rng.c): Philox4x32-10 against the Random123 known
-- answers and an independent Lua implementation; rand_/randn_ element by
-- element against the documented mapping; streams continue across offsets;
-- results do not depend on threads or layout; moments on 1e5 samples.
local T = require 'moonshard.tensor'
require 'moonshard.ops'
local ffi = require 'ffi'
local bit = require 'bit'
local C = T.C

-- ------------------------------------------------------------------ helpers

local function vals(t)
  local h = T.empty(t.shape, { dtype = 'f64' })
  T.check(C.ms_tensor_copy_(h, t))
  local p = ffi.cast('double*', C.ms_tensor_data(h))
  local r = {}
  for i = 1, t:numel() do r[i] = p[i - 1] end
  return r
end

local function rand_(t, seed, offset, lo, hi)
  T.check(C.ms_rand_(t, seed, offset, lo or 0, hi or 1))
  return t
end
local function randn_(t, seed, offset, mean, std)
  T.check(C.ms_randn_(t, seed, offset, mean or 0, std or 1))
  return t
end

local function expect_error(fn, needle)
  local ok, err = pcall(fn)
  assert.is_false(ok, 'expected an error containing: ' .. needle)
  if not tostring(err):find(needle, 1, true) then
    error(('error message %q does not contain %q'):format(tostring(err), needle), 2)
  end
end

local function same(a, b, what)
  assert.are.equal(#a, #b, what)
  for i = 1, #a do
    if a[i] ~= b[i] then error(('%s: element %d is %.17g, expected %.17g'):format(what, i, a[i], b[i]), 2) end
  end
end

-- ------------------------------------------- an independent Philox in Lua

local TWO32 = 2 ^ 32
local function u32(x) return x % TWO32 end

-- Random123's philox4x32 with R = 10: ctr {4 words}, key {2 words}
local function philox_ref(ctr, key)
  local c0, c1, c2, c3 = ctr[1], ctr[2], ctr[3], ctr[4]
  local k0, k1 = key[1], key[2]
  for r = 1, 10 do
    if r > 1 then k0 = u32(k0 + 0x9E3779B9); k1 = u32(k1 + 0xBB67AE85) end
    local p0 = 0xD2511F53ULL * c0
    local p1 = 0xCD9E8D57ULL * c2
    local hi0, lo0 = tonumber(p0 / 0x100000000ULL), tonumber(p0 % 0x100000000ULL)
    local hi1, lo1 = tonumber(p1 / 0x100000000ULL), tonumber(p1 % 0x100000000ULL)
    c0, c1, c2, c3 = u32(bit.bxor(hi1, c1, k0)), lo1, u32(bit.bxor(hi0, c3, k1)), lo0
  end
  return { c0, c1, c2, c3 }
end

-- 64-bit numbers as (lo, hi) words; Lua numbers are exact below 2^53
local function words(x)
  if type(x) == 'cdata' then
    return tonumber(x % 0x100000000ULL), tonumber(x / 0x100000000ULL)
  end
  return x % TWO32, math.floor(x / TWO32)
end

-- the 4 words of ms_philox(seed, counter) by the reference
local function philox_of(seed, counter)
  local clo, chi = words(counter)
  local klo, khi = words(seed)
  return philox_ref({ clo, chi, 0, 0 }, { klo, khi })
end

local function uniform(x) return (math.floor(x / 256) + 0.5) * 2 ^ -24 end

-- element i (0-based) of a fill at (seed, offset): uniform or Box-Muller normal
local function ref_value(seed, offset, i, normal)
  local e = offset + i
  local counter, lane = math.floor(e / 4), e % 4
  local w = philox_of(seed, counter)
  if not normal then return uniform(w[lane + 1]) end
  local pair = lane - lane % 2
  local u1, u2 = uniform(w[pair + 1]), uniform(w[pair + 2])
  local r, theta = math.sqrt(-2 * math.log(u1)), 2 * math.pi * u2
  return lane % 2 == 0 and r * math.cos(theta) or r * math.sin(theta)
end

-- ======================================================================
describe('philox', function()
  it('the Lua reference reproduces the Random123 known answers', function()
    same(philox_ref({ 0, 0, 0, 0 }, { 0, 0 }), { 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8 }, 'zeros')
    same(philox_ref({ 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff }, { 0xffffffff, 0xffffffff }),
      { 0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd }, 'ones')
    same(philox_ref({ 0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344 }, { 0xa4093822, 0x299f31d0 }),
      { 0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1 }, 'pi')
  end)

  it('ms_philox matches the known answer and the reference for 64-bit seeds and counters', function()
    local out = ffi.new('uint32_t[4]')
    C.ms_philox(0, 0, out)
    same({ out[0], out[1], out[2], out[3] }, { 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8 }, 'zeros')
    local cases = {
      { 1, 0 }, { 0, 1 }, { 42, 7 }, { 0xffffffff, 0xffffffff }, { 2 ^ 32, 2 ^ 32 + 5 },
      { 0xDEADBEEFCAFEBABEULL, 0x0123456789ABCDEFULL }, { 0xFFFFFFFFFFFFFFFFULL, 0xFFFFFFFFFFFFFFFFULL },
    }
    for _, c in ipairs(cases) do
      C.ms_philox(c[1], c[2], out)
      same({ out[0], out[1], out[2], out[3] }, philox_of(c[1], c[2]), 'seed ' .. tostring(c[1]))
    end
  end)
end)

-- ======================================================================
describe('rand_ and randn_', function()
  it('give element i the documented value of (seed, offset + i)', function()
    for _, offset in ipairs({ 0, 1, 6, 2 ^ 33 + 3 }) do
      local t = rand_(T.empty({ 3, 5 }, { dtype = 'f64' }), 1234, offset)
      local v = vals(t)
      for i = 1, 15 do
        assert.are.equal(ref_value(1234, offset, i - 1, false), v[i], 'uniform ' .. i .. ' at offset ' .. offset)
      end
      local n = randn_(T.empty({ 15 }, { dtype = 'f64' }), 99, offset)
      local nv = vals(n)
      for i = 1, 15 do
        local want = ref_value(99, offset, i - 1, true)
        assert(math.abs(nv[i] - want) <= 1e-12 * math.max(1, math.abs(want)),
          ('normal %d at offset %d: %.17g vs %.17g'):format(i, offset, nv[i], want))
      end
    end
  end)

  it('scale to [lo, hi) and to mean/std', function()
    local u = vals(rand_(T.empty({ 8 }, { dtype = 'f64' }), 5, 0))
    local s = vals(rand_(T.empty({ 8 }, { dtype = 'f64' }), 5, 0, -3, 5))
    for i = 1, 8 do assert(math.abs(s[i] - (-3 + 8 * u[i])) < 1e-15) end
    local z = vals(randn_(T.empty({ 8 }, { dtype = 'f64' }), 5, 0))
    local g = vals(randn_(T.empty({ 8 }, { dtype = 'f64' }), 5, 0, 2, 0.5))
    for i = 1, 8 do assert(math.abs(g[i] - (2 + 0.5 * z[i])) < 1e-15) end
  end)

  it('repeat for the same seed and offset and differ for another seed', function()
    local a = vals(rand_(T.empty({ 100 }), 7, 3))
    local b = vals(rand_(T.empty({ 100 }), 7, 3))
    local c = vals(rand_(T.empty({ 100 }), 8, 3))
    same(a, b, 'same seed')
    local differ = 0
    for i = 1, 100 do if a[i] ~= c[i] then differ = differ + 1 end end
    assert.is_true(differ > 95)
  end)

  it('continue one stream across offsets', function()
    local a = vals(rand_(T.empty({ 10 }, { dtype = 'f64' }), 11, 0))
    local b = vals(rand_(T.empty({ 6 }, { dtype = 'f64' }), 11, 4))
    same({ a[5], a[6], a[7], a[8], a[9], a[10] }, b, 'uniform continuation')
    local c = vals(rand_(T.empty({ 7 }, { dtype = 'f64' }), 11, 3))
    same({ a[4], a[5], a[6], a[7], a[8], a[9], a[10] }, c, 'unaligned offset')
    local n = vals(randn_(T.empty({ 10 }, { dtype = 'f64' }), 11, 0))
    local m = vals(randn_(T.empty({ 5 }, { dtype = 'f64' }), 11, 5))
    same({ n[6], n[7], n[8], n[9], n[10] }, m, 'normal continuation')
  end)

  it('do not depend on the number of threads', function()
    local n0 = C.ms_get_num_threads()
    local results = {}
    for _, threads in ipairs({ 1, 2, 4 }) do
      C.ms_set_num_threads(threads)
      results[threads] = {
        vals(rand_(T.empty({ 100003 }, { dtype = 'f32' }), 3, 1)),
        vals(randn_(T.empty({ 317, 319 }, { dtype = 'f32' }), 3, 9)),
        vals(randn_(T.empty({ 50001 }, { dtype = 'bf16' }), 4, 2)),
      }
    end
    C.ms_set_num_threads(n0)
    for k = 1, 3 do
      same(results[1][k], results[2][k], 'tensor ' .. k .. ', 1 vs 2 threads')
      same(results[1][k], results[4][k], 'tensor ' .. k .. ', 1 vs 4 threads')
    end
  end)

  it('fill non-contiguous views in their row-major order', function()
    local base = T.zeros({ 4, 6 }, { dtype = 'f64' })
    local view = base:t():narrow(1, 2, 3) -- (3, 4), strided
    rand_(view, 21, 2)
    local want = vals(rand_(T.empty({ 3, 4 }, { dtype = 'f64' }), 21, 2))
    same(vals(view), want, 'strided view')
    -- elements outside the view stay 0
    local bv = vals(base)
    for i = 0, 3 do
      assert.are.equal(0, bv[i * 6 + 1])
      for j = 4, 5 do assert.are.equal(0, bv[i * 6 + j + 1]) end
    end
  end)

  it('round into bf16/f16/f32 once from the f64 values', function()
    local ref = rand_(T.empty({ 64 }, { dtype = 'f64' }), 31, 0)
    for _, dt in ipairs({ 'f32', 'bf16', 'f16' }) do
      same(vals(rand_(T.empty({ 64 }, { dtype = dt }), 31, 0)), vals(ref:to(dt)), dt)
    end
    local nref = randn_(T.empty({ 64 }, { dtype = 'f64' }), 31, 0)
    same(vals(randn_(T.empty({ 64 }, { dtype = 'bf16' }), 31, 0)), vals(nref:to('bf16')), 'bf16 normal')
  end)

  it('have the right moments on 1e5 samples', function()
    local n = 100000
    local u = vals(rand_(T.empty({ n }, { dtype = 'f64' }), 2024, 0))
    local s, s2, lo, hi = 0, 0, 1, 0
    for i = 1, n do
      local v = u[i]
      s = s + v; s2 = s2 + v * v
      if v < lo then lo = v end
      if v > hi then hi = v end
    end
    local mean = s / n
    assert(math.abs(mean - 0.5) < 0.005, 'uniform mean ' .. mean)
    assert(math.abs(s2 / n - mean * mean - 1 / 12) < 0.002, 'uniform variance')
    assert(lo > 0 and hi < 1, 'uniform values in (0, 1)')
    local z = vals(randn_(T.empty({ n }, { dtype = 'f32' }), 2024, 0))
    s, s2 = 0, 0
    local within1 = 0
    for i = 1, n do
      s = s + z[i]; s2 = s2 + z[i] * z[i]
      if math.abs(z[i]) < 1 then within1 = within1 + 1 end
    end
    local zm = s / n
    local sd = math.sqrt(s2 / n - zm * zm)
    assert(math.abs(zm) < 0.01, 'normal mean ' .. zm)
    assert(math.abs(sd - 1) < 0.01, 'normal std ' .. sd)
    assert(math.abs(within1 / n - 0.6827) < 0.005, 'normal mass within one std')
    local g = vals(randn_(T.empty({ n }, { dtype = 'f64' }), 7, 0, 3, 2))
    s, s2 = 0, 0
    for i = 1, n do s = s + g[i]; s2 = s2 + g[i] * g[i] end
    local gm = s / n
    assert(math.abs(gm - 3) < 0.03, 'mean 3: ' .. gm)
    assert(math.abs(math.sqrt(s2 / n - gm * gm) - 2) < 0.02, 'std 2')
  end)

  it('raise readable errors', function()
    expect_error(function() rand_(T.empty({ 3 }, { dtype = 'i64' }), 1, 0) end, 'rand_: needs a float tensor, got i64 (3) cpu')
    expect_error(function() randn_(T.empty({ 3 }, { dtype = 'bool' }), 1, 0) end, 'randn_: needs a float tensor, got bool (3) cpu')
    local t = T.empty({ 3 })
    t:free()
    expect_error(function() rand_(t, 1, 0) end, 'rand_: tensor was freed')
  end)
end)
