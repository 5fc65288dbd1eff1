-- Tensor ops on the CPU (core/ops.c, core/ops_cpu.c, lua/moonshard/ops.lua):
-- every op against values computed independently in plain Lua (float64) on
-- random data, hand-worked small cases, each dtype class, non-contiguous
-- inputs, thread-count independence and the error paths.
local T = require 'moonshard.tensor'
local F = require 'moonshard.ops'
local ffi = require 'ffi'
local C = T.C

-- ------------------------------------------------------------------ helpers

-- make(shape, vals, dtype): a tensor of `shape` holding the row-major
-- values `vals`; vals(t): the row-major values of any tensor as Lua numbers
local S = require 'spec.support'
local make, vals, numel_of = S.make, S.vals, S.numel_of

-- n uniform values in [lo, hi), never exactly 0
local function randoms(n, lo, hi)
  lo, hi = lo or -2, hi or 2
  local r = {}
  for i = 1, n do
    local v = lo + (hi - lo) * math.random()
    if v == 0 then v = 0.5 end
    r[i] = v
  end
  return r
end

-- a random tensor and its stored values (after rounding to dtype)
local function rand_tensor(shape, dtype, lo, hi)
  local t = make(shape, randoms(numel_of(shape), lo, hi), dtype)
  return t, vals(t)
end

-- the same logical tensor laid out non-contiguously (dims reversed in memory)
local function noncontig(t)
  local n = t.ndim
  local rshape, perm = {}, {}
  for i = 1, n do rshape[i] = t.shape[n + 1 - i]; perm[i] = n + 1 - i end
  local base = T.empty(rshape, { dtype = t.dtype })
  local v = base:permute(perm)
  v:copy_(t)
  return v
end

local tolerances = {
  f64 = { 1e-12, 1e-14 }, f32 = { 4e-6, 1e-6 }, bf16 = { 2 ^ -8, 1e-3 }, f16 = { 2 ^ -10, 1e-4 },
  i64 = { 0, 0 }, i32 = { 0, 0 }, u8 = { 0, 0 }, bool = { 0, 0 },
}

local function assert_close(got, want, rtol, atol, what)
  what = what or 'values'
  if #got ~= #want then error(('%s: %d values, expected %d'):format(what, #got, #want), 2) end
  for i = 1, #want do
    local g, w = got[i], want[i]
    local bad
    if w ~= w then bad = g == g
    elseif w == math.huge or w == -math.huge then bad = g ~= w
    else bad = not (math.abs(g - w) <= atol + rtol * math.abs(w)) end
    if bad then error(('%s: element %d is %.17g, expected %.17g'):format(what, i, g, w), 2) end
  end
end

local function assert_equal_values(got, want, what)
  assert_close(got, want, 0, 0, what)
end

local function expect_error(fn, needle)
  local ok, err = pcall(fn)
  assert.is_false(ok, 'expected an error containing: ' .. needle)
  err = tostring(err)
  if not err:find(needle, 1, true) then
    error(('error message %q does not contain %q'):format(err, needle), 2)
  end
  return err
end

local function shape_str(t) return '(' .. table.concat(t.shape, ',') .. ')' end

local float_dtypes = { 'f64', 'f32', 'bf16', 'f16' }

-- ------------------------------------------------------ Lua references

local SQ2PI = math.sqrt(2 / math.pi)
local function gelu(x) return 0.5 * x * (1 + math.tanh(SQ2PI * (x + 0.044715 * x ^ 3))) end
local function sigmoid(x) return 1 / (1 + math.exp(-x)) end
local function sign(x) return x > 0 and 1 or (x < 0 and -1 or x) end

local unary_ref = {
  neg = function(x) return -x end, exp = math.exp, log = math.log, sqrt = math.sqrt,
  rsqrt = function(x) return 1 / math.sqrt(x) end, tanh = math.tanh, sigmoid = sigmoid,
  relu = function(x) return x < 0 and 0 or x end, gelu = gelu,
  silu = function(x) return x * sigmoid(x) end, abs = math.abs, sin = math.sin, cos = math.cos,
  square = function(x) return x * x end, reciprocal = function(x) return 1 / x end, sign = sign,
}
local positive_only = { log = true, sqrt = true, rsqrt = true }

local binary_ref = {
  add = function(a, b) return a + b end, sub = function(a, b) return a - b end,
  mul = function(a, b) return a * b end, div = function(a, b) return a / b end,
  pow = function(a, b) return a ^ b end,
  maximum = function(a, b) return (a ~= a or a > b) and a or b end,
  minimum = function(a, b) return (a ~= a or a < b) and a or b end,
  eq = function(a, b) return a == b and 1 or 0 end, ne = function(a, b) return a ~= b and 1 or 0 end,
  lt = function(a, b) return a < b and 1 or 0 end, le = function(a, b) return a <= b and 1 or 0 end,
  gt = function(a, b) return a > b and 1 or 0 end, ge = function(a, b) return a >= b and 1 or 0 end,
}
local comparisons = { eq = true, ne = true, lt = true, le = true, gt = true, ge = true }

-- exact derivatives, written independently of the C code
local function gelu_grad(x)
  local u = SQ2PI * (x + 0.044715 * x ^ 3)
  local t = math.tanh(u)
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * SQ2PI * (1 + 3 * 0.044715 * x * x)
end
local backward_ref = {
  gelu_backward = gelu_grad,
  silu_backward = function(x) local s = sigmoid(x); return s * (1 + x * (1 - s)) end,
  sigmoid_backward = function(x) local s = sigmoid(x); return s * (1 - s) end,
  tanh_backward = function(x) local t = math.tanh(x); return 1 - t * t end,
  relu_backward = function(x) return x > 0 and 1 or 0 end,
}
local forward_of = {
  gelu_backward = gelu, silu_backward = unary_ref.silu, sigmoid_backward = sigmoid,
  tanh_backward = math.tanh, relu_backward = unary_ref.relu,
}

-- ======================================================================
describe('unary ops', function()
  it('match the Lua reference for every op and float dtype', function()
    math.randomseed(11)
    for name, ref in pairs(unary_ref) do
      for _, dt in ipairs(float_dtypes) do
        local lo = positive_only[name] and 0.05 or -3
        local x, xv = rand_tensor({ 7, 9 }, dt, lo, 3)
        local y = F[name](x)
        assert.are.equal(dt, y.dtype)
        assert.are.same({ 7, 9 }, y.shape)
        local want = {}
        for i, v in ipairs(xv) do want[i] = ref(v) end
        local tol = tolerances[dt]
        assert_close(vals(y), want, tol[1], tol[2], name .. ' ' .. dt)
      end
    end
  end)

  it('work on non-contiguous inputs', function()
    math.randomseed(12)
    for name, ref in pairs(unary_ref) do
      local lo = positive_only[name] and 0.05 or -3
      local x, xv = rand_tensor({ 5, 6 }, 'f32', lo, 3)
      local xt = x:t()                     -- (6, 5) transposed view
      local y = F[name](xt)
      local want = {}
      for i = 1, 6 do for j = 1, 5 do want[#want + 1] = ref(xv[(j - 1) * 6 + i]) end end
      assert_close(vals(y), want, 4e-6, 1e-6, name .. ' transposed')
    end
  end)

  it('give hand-worked values', function()
    local x = make({ 5 }, { -2, -1, 0, 1, 2 })
    assert_close(vals(F.gelu(x)), { -0.04540230591222, -0.15880800939172324, 0, 0.8411919906082768, 1.9545976940877752 },
      1e-12, 1e-14, 'gelu')
    assert_equal_values(vals(F.relu(x)), { 0, 0, 0, 1, 2 }, 'relu')
    assert_equal_values(vals(F.sign(x)), { -1, -1, 0, 1, 1 }, 'sign')
    assert_equal_values(vals(F.square(x)), { 4, 1, 0, 1, 4 }, 'square')
    assert_close(vals(F.sigmoid(x)), { 0.11920292202211755, 0.2689414213699951, 0.5, 0.7310585786300049,
      0.8807970779778823 }, 1e-15, 0, 'sigmoid')
  end)

  it('keep integer dtypes for neg/abs/square/sign/relu and give f32 otherwise', function()
    local x = make({ 4 }, { -3, -1, 0, 5 }, 'i64')
    local n = F.neg(x)
    assert.are.equal('i64', n.dtype)
    assert_equal_values(vals(n), { 3, 1, 0, -5 })
    assert_equal_values(vals(F.abs(x)), { 3, 1, 0, 5 })
    assert_equal_values(vals(F.relu(make({ 3 }, { -2, 0, 7 }, 'i32'))), { 0, 0, 7 })
    local e = F.exp(x)
    assert.are.equal('f32', e.dtype)
    assert_close(vals(e), { math.exp(-3), math.exp(-1), 1, math.exp(5) }, 4e-7, 0, 'exp of i64')
  end)

  it('propagate NaN and handle infinities', function()
    local x = make({ 4 }, { 0 / 0, math.huge, -math.huge, -0.0 }, 'f32')
    local r = vals(F.relu(x))
    assert.is_true(r[1] ~= r[1])
    assert.are.equal(math.huge, r[2])
    assert.are.equal(0, r[3])
    local s = vals(F.sigmoid(x))
    assert.are.equal(1, s[2]); assert.are.equal(0, s[3])
    local t = vals(F.tanh(x))
    assert.are.equal(1, t[2]); assert.are.equal(-1, t[3])
  end)

  it('are methods and the unary minus operator', function()
    local x = make({ 3 }, { 1, -2, 3 })
    assert_equal_values(vals(x:neg()), { -1, 2, -3 })
    assert_equal_values(vals(-x), { -1, 2, -3 })
    assert_close(vals(x:exp()), { math.exp(1), math.exp(-2), math.exp(3) }, 1e-15, 0)
  end)

  it('reject non-tensors and freed tensors with the op name', function()
    expect_error(function() F.exp({ 1, 2 }) end, 'exp: expected a tensor')
    local x = make({ 2 }, { 1, 2 })
    x:free()
    expect_error(function() F.exp(x) end, 'exp: tensor was freed')
  end)
end)

-- ======================================================================
describe('binary ops', function()
  it('match the Lua reference for every op and float dtype', function()
    math.randomseed(21)
    for name, ref in pairs(binary_ref) do
      for _, dt in ipairs(float_dtypes) do
        local a, av = rand_tensor({ 4, 5 }, dt, name == 'pow' and 0.1 or -2, 2)
        local b, bv = rand_tensor({ 4, 5 }, dt, -2, 2)
        if comparisons[name] then -- make some pairs equal
          b = a:clone(); bv = vals(b)
          local p = T.empty({ 4, 5 }, { dtype = dt })
          T.check(C.ms_tensor_copy_(p, make({ 4, 5 }, randoms(20), 'f64')))
          b:narrow(1, 1, 2):copy_(p:narrow(1, 1, 2))
          bv = vals(b)
        end
        local y = F[name](a, b)
        local tol = tolerances[dt]
        local want = {}
        for i = 1, #av do want[i] = ref(av[i], bv[i]) end
        if comparisons[name] then
          assert.are.equal('bool', y.dtype)
          assert_equal_values(vals(y), want, name .. ' ' .. dt)
        else
          assert.are.equal(dt, y.dtype)
          assert_close(vals(y), want, tol[1], tol[2], name .. ' ' .. dt)
        end
      end
    end
  end)

  it('promote dtypes: float beats int, wider float wins, bf16 with f16 gives f32', function()
    local cases = {
      { 'f32', 'f64', 'f64' }, { 'bf16', 'f32', 'f32' }, { 'bf16', 'f16', 'f32' }, { 'i64', 'f32', 'f32' },
      { 'i32', 'i64', 'i64' }, { 'u8', 'i32', 'i32' }, { 'bf16', 'i64', 'bf16' }, { 'bool', 'u8', 'u8' },
    }
    for _, c in ipairs(cases) do
      local a, b = make({ 2 }, { 1, 2 }, c[1]), make({ 2 }, { 3, 4 }, c[2])
      local y = F.add(a, b)
      assert.are.equal(c[3], y.dtype, c[1] .. '+' .. c[2])
      local av, bv = vals(a), vals(b)
      assert_equal_values(vals(y), { av[1] + bv[1], av[2] + bv[2] })
    end
  end)

  it('compute integers exactly and divide integers into f32', function()
    local a = make({ 3 }, { 7, -7, 100000 }, 'i64')
    local b = make({ 3 }, { 2, 2, 3 }, 'i64')
    assert_equal_values(vals(F.mul(a, b)), { 14, -14, 300000 })
    assert_equal_values(vals(F.sub(a, b)), { 5, -9, 99997 })
    local q = F.div(a, b)
    assert.are.equal('f32', q.dtype)
    assert_close(vals(q), { 3.5, -3.5, 100000 / 3 }, 1e-7, 0)
    assert_equal_values(vals(F.pow(b, b)), { 4, 4, 27 })
  end)

  it('propagate NaN through maximum/minimum', function()
    local a = make({ 3 }, { 0 / 0, 1, 2 }, 'f32')
    local b = make({ 3 }, { 1, 0 / 0, 1 }, 'f32')
    local mx, mn = vals(F.maximum(a, b)), vals(F.minimum(a, b))
    assert.is_true(mx[1] ~= mx[1] and mx[2] ~= mx[2] and mn[1] ~= mn[1] and mn[2] ~= mn[2])
    assert.are.equal(2, mx[3]); assert.are.equal(1, mn[3])
    local m = F.max(a, b)  -- max(tensor, tensor) is maximum
    assert.is_true(vals(m)[1] ~= vals(m)[1])
  end)

  it('take a Lua number on either side', function()
    local a = make({ 3 }, { 1, 2, 4 }, 'f32')
    assert_equal_values(vals(F.add(a, 2)), { 3, 4, 6 })
    assert_equal_values(vals(F.sub(10, a)), { 9, 8, 6 })
    assert_equal_values(vals(F.div(8, a)), { 8, 4, 2 })
    assert_equal_values(vals(F.div(a, 2)), { 0.5, 1, 2 })
    assert_equal_values(vals(F.pow(a, 2)), { 1, 4, 16 })
    assert_equal_values(vals(F.pow(2, a)), { 2, 4, 16 })
    assert_equal_values(vals(F.gt(a, 1.5)), { 0, 1, 1 })
    assert_equal_values(vals(F.lt(3, a)), { 0, 0, 1 })
    assert_equal_values(vals(a * 3), { 3, 6, 12 })
    assert_equal_values(vals(3 - a), { 2, 1, -1 })
    assert_equal_values(vals(a / a), { 1, 1, 1 })
    assert_equal_values(vals(a ^ 2), { 1, 4, 16 })
    assert.are.equal('f32', F.add(a, 2).dtype)
    assert.are.equal('bool', F.eq(a, 2).dtype)
  end)

  it('keep integer dtypes with integer scalars and give f32 otherwise', function()
    local a = make({ 3 }, { 1, 2, 3 }, 'i64')
    local y = F.add(a, 1)
    assert.are.equal('i64', y.dtype)
    assert_equal_values(vals(y), { 2, 3, 4 })
    local z = F.add(a, 0.5)
    assert.are.equal('f32', z.dtype)
    assert_equal_values(vals(z), { 1.5, 2.5, 3.5 })
    assert.are.equal('f32', F.div(a, 2).dtype)
    assert_equal_values(vals(F.gt(a, 1.5)), { 0, 1, 1 })
    local h = make({ 2 }, { 1.5, 2 }, 'bf16')
    assert.are.equal('bf16', F.mul(h, 3).dtype)
    assert_equal_values(vals(F.mul(h, 3)), { 4.5, 6 })
  end)

  it('round bf16/f16 results once from f32', function()
    -- 1 + 2^-8 is halfway between two bf16 values: RNE gives 1
    local a = make({ 2 }, { 1, 1 + 2 ^ -7 }, 'bf16')
    local b = make({ 2 }, { 2 ^ -8, 2 ^ -8 }, 'bf16')
    assert_equal_values(vals(F.add(a, b)), { 1, 1 + 2 ^ -6 })
    local c = make({ 1 }, { 1 }, 'f16')
    local d = make({ 1 }, { 2 ^ -11 }, 'f16')
    assert_equal_values(vals(F.add(c, d)), { 1 })
  end)

  it('write in place with add_, sub_, mul_, div_', function()
    local a = make({ 2, 3 }, { 1, 2, 3, 4, 5, 6 }, 'f32')
    local b = make({ 3 }, { 1, 1, 2 }, 'f32')
    local r = a:add_(b)
    assert.are.equal(a, r)
    assert_equal_values(vals(a), { 2, 3, 5, 5, 6, 8 })
    a:sub_(1); assert_equal_values(vals(a), { 1, 2, 4, 4, 5, 7 })
    a:mul_(b); assert_equal_values(vals(a), { 1, 2, 8, 4, 5, 14 })
    a:div_(2); assert_equal_values(vals(a), { 0.5, 1, 4, 2, 2.5, 7 })
    -- through a non-contiguous view: only the view changes
    local base = make({ 3, 4 }, { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 }, 'f64')
    local v = base:narrow(2, 2, 2):t()
    v:add_(100)
    assert_equal_values(vals(base), { 0, 101, 102, 3, 4, 105, 106, 7, 8, 109, 110, 11 })
  end)

  it('reject in-place results that would change the destination', function()
    local a = make({ 1, 3 }, { 1, 2, 3 }, 'f32')
    local b = make({ 2, 3 }, { 1, 2, 3, 4, 5, 6 }, 'f32')
    expect_error(function() a:add_(b) end, 'add_: out is f32 (1,3) cpu, expected f32 (2,3) cpu')
    local h = make({ 3 }, { 1, 2, 3 }, 'bf16')
    expect_error(function() h:mul_(make({ 3 }, { 1, 2, 3 }, 'f32')) end, 'expected f32 (3) cpu')
    assert_equal_values(vals(a), { 1, 2, 3 })
  end)

  it('refuse in-place writes over an input in another layout, allow the same view and disjoint views', function()
    local x = make({ 3, 3 }, { 1, 2, 3, 4, 5, 6, 7, 8, 9 })
    expect_error(function() x:add_(x:t()) end, 'add_: the output f64 (3,3) cpu overlaps an input f64 (3,3) cpu in another layout')
    expect_error(function() x:mul_(x:select(1, 2)) end, 'mul_: the output f64 (3,3) cpu overlaps an input f64 (3) cpu')
    assert_equal_values(vals(x), { 1, 2, 3, 4, 5, 6, 7, 8, 9 }, 'untouched after the errors')
    x:add_(x)
    assert_equal_values(vals(x), { 2, 4, 6, 8, 10, 12, 14, 16, 18 }, 'x += x')
    x:narrow(1, 1, 1):sub_(x:narrow(1, 3, 1)) -- disjoint rows of one storage
    assert_equal_values(vals(x), { -12, -12, -12, 8, 10, 12, 14, 16, 18 }, 'disjoint rows')
    local w = make({ 3, 3 }, { 1, 0, 0, 0, 1, 0, 0, 0, 1 })
    expect_error(function() F.gemm_(w, w, make({ 3, 3 }, randoms(9))) end, 'gemm_: the output f64 (3,3) cpu overlaps')
    local e = T.zeros({ 4, 2 }, { dtype = 'f64' })
    expect_error(function() F.index_add_(e, 1, { 0, 1 }, e:narrow(1, 3, 2)) end, 'index_add_: the output f64 (4,2) cpu overlaps')
    local b = make({ 2 }, { true and 1, 0 }, 'bool')
    local bi = F.add(b, 2)
    assert.are.equal('i64', bi.dtype)
    assert_equal_values(vals(bi), { 3, 2 })
  end)

  it('name the op and both shapes when shapes do not broadcast', function()
    local a, b = make({ 2, 3 }, randoms(6)), make({ 4, 3 }, randoms(12))
    expect_error(function() F.add(a, b) end, 'add: shapes (2,3) and (4,3) cannot be broadcast')
    expect_error(function() F.ge(a, b) end, 'ge: shapes (2,3) and (4,3) cannot be broadcast')
    expect_error(function() F.add(1, 2) end, 'add: expected at least one tensor')
    expect_error(function() F.add(a, 'x') end, 'add: expected a tensor or a number, got string')
  end)

  it('name both devices when they differ', function()
    local a = make({ 2 }, { 1, 2 }, 'f32')
    local fake = a:alias()
    fake.device_id = 0 -- a handle claiming cuda:0, checked before any kernel runs
    local ok, err = pcall(F.add, a, fake)
    fake.device_id = -1
    assert.is_false(ok)
    assert.truthy(err:find('add: tensors on different devices: f32 (2) cpu and f32 (2) cuda:0', 1, true), err)
  end)
end)

-- ======================================================================
describe('activation backward helpers', function()
  it('give grad * f\'(x) with the exact derivative', function()
    math.randomseed(31)
    for name, dref in pairs(backward_ref) do
      for _, dt in ipairs(float_dtypes) do
        local x, xv = rand_tensor({ 3, 7 }, dt, -4, 4)
        local g, gv = rand_tensor({ 3, 7 }, dt, -2, 2)
        local y = F[name](x, g)
        local want = {}
        for i = 1, #xv do want[i] = gv[i] * dref(xv[i]) end
        local tol = tolerances[dt]
        assert_close(vals(y), want, tol[1], tol[2] * 4, name .. ' ' .. dt)
      end
    end
  end)

  it('agree with central finite differences of the forward op in f64', function()
    math.randomseed(32)
    local xs = randoms(50, -4, 4)
    for name, fwd in pairs(forward_of) do
      local x = make({ 50 }, xs)
      local g = make({ 50 }, (function() local o = {} for i = 1, 50 do o[i] = 1 end return o end)())
      local d = vals(F[name](x, g))
      for i, v in ipairs(xs) do
        if not (name == 'relu_backward' and math.abs(v) < 1e-3) then
          local h = 1e-6
          local fd = (fwd(v + h) - fwd(v - h)) / (2 * h)
          assert(math.abs(d[i] - fd) < 1e-6, ('%s at %g: %g vs finite difference %g'):format(name, v, d[i], fd))
        end
      end
    end
  end)
end)

-- ======================================================================
describe('clamp and where', function()
  it('clamp to bounds; a missing bound is none; NaN stays NaN', function()
    local x = make({ 5 }, { -3, -1, 0 / 0, 1, 3 }, 'f32')
    local r = vals(F.clamp(x, -2, 2))
    assert.are.equal(-2, r[1]); assert.are.equal(-1, r[2]); assert.is_true(r[3] ~= r[3])
    assert.are.equal(1, r[4]); assert.are.equal(2, r[5])
    local lo = vals(F.clamp(x, 0))
    assert.are.equal(0, lo[1]); assert.are.equal(3, lo[5])
    local hi = vals(F.clamp(x, nil, 0))
    assert.are.equal(-3, hi[1]); assert.are.equal(0, hi[5])
    local xi = make({ 3 }, { -5, 5, 50 }, 'i64')
    local ci = F.clamp(xi, 0, 10)
    assert.are.equal('i64', ci.dtype)
    assert_equal_values(vals(ci), { 0, 5, 10 })
  end)

  it('where picks from a or b by the condition, broadcasting all three', function()
    math.randomseed(41)
    local a, av = rand_tensor({ 2, 3 }, 'f32')
    local b, bv = rand_tensor({ 3 }, 'f64')
    local cond = F.gt(make({ 2, 1 }, { 1, -1 }), 0)
    local y = F.where(cond, a, b)
    assert.are.equal('f64', y.dtype)
    assert.are.same({ 2, 3 }, y.shape)
    assert_equal_values(vals(y), { av[1], av[2], av[3], bv[1], bv[2], bv[3] })
    local z = F.where(cond, a, 0)
    assert.are.equal('f32', z.dtype)
    assert_equal_values(vals(z), { av[1], av[2], av[3], 0, 0, 0 })
    expect_error(function() F.where(a, a, b) end, 'where: condition must be bool or u8, got f32 (2,3) cpu')
  end)
end)

-- ======================================================================
-- reference reduction over one dim (0-based c dim) of a row-major list
local function ref_reduce(xv, shape, cd, fn)
  local outer, n, inner = 1, shape[cd + 1], 1
  for i = 1, cd do outer = outer * shape[i] end
  for i = cd + 2, #shape do inner = inner * shape[i] end
  local out = {}
  for o = 0, outer - 1 do
    for k = 0, inner - 1 do
      local fiber = {}
      for r = 0, n - 1 do fiber[r + 1] = xv[(o * n + r) * inner + k + 1] end
      out[#out + 1] = fn(fiber)
    end
  end
  return out
end

local reduce_ref = {
  sum = function(f) local s = 0 for _, v in ipairs(f) do s = s + v end return s end,
  mean = function(f) local s = 0 for _, v in ipairs(f) do s = s + v end return s / #f end,
  prod = function(f) local s = 1 for _, v in ipairs(f) do s = s * v end return s end,
  max = function(f) local m = -math.huge for _, v in ipairs(f) do if v > m then m = v end end return m end,
  min = function(f) local m = math.huge for _, v in ipairs(f) do if v < m then m = v end end return m end,
  argmax = function(f) local m, k = -math.huge, 0 for i, v in ipairs(f) do if v > m then m, k = v, i - 1 end end return k end,
  argmin = function(f) local m, k = math.huge, 0 for i, v in ipairs(f) do if v < m then m, k = v, i - 1 end end return k end,
  logsumexp = function(f)
    local m = -math.huge for _, v in ipairs(f) do if v > m then m = v end end
    local s = 0 for _, v in ipairs(f) do s = s + math.exp(v - m) end
    return m + math.log(s)
  end,
}

describe('reductions', function()
  it('match the Lua reference over every dim, with and without keepdim', function()
    math.randomseed(51)
    local shape = { 3, 4, 5 }
    for _, dt in ipairs(float_dtypes) do
      local x, xv = rand_tensor(shape, dt, -2, 2)
      for name, fn in pairs(reduce_ref) do
        for d = 1, 3 do
          local want = ref_reduce(xv, shape, d - 1, fn)
          for _, keep in ipairs({ false, true }) do
            local y
            if name == 'max' or name == 'min' then y = F[name](x, d, keep) -- (values, indices)
            else y = F[name](x, d, keep) end
            local eshape = { 3, 4, 5 }
            if keep then eshape[d] = 1 else table.remove(eshape, d) end
            assert.are.same(eshape, y.shape, name .. ' dim ' .. d)
            local tol = tolerances[dt]
            if name == 'argmax' or name == 'argmin' then
              assert.are.equal('i64', y.dtype)
              assert_equal_values(vals(y), want, name .. ' ' .. dt .. ' dim ' .. d)
            else
              assert.are.equal(dt, y.dtype)
              assert_close(vals(y), want, tol[1] * 2, tol[2] * 8, name .. ' ' .. dt .. ' dim ' .. d)
            end
          end
        end
        -- all elements
        local all = fn(xv)
        local y = F[name](x)
        assert.are.same({}, y.shape)
        local tol = tolerances[dt]
        assert_close(vals(y), { all }, tol[1] * 2, tol[2] * 8, name .. ' all ' .. dt)
        local yk = F[name](x, nil, true)
        assert.are.same({ 1, 1, 1 }, yk.shape)
      end
    end
  end)

  it('return values and indices from max/min with a dim', function()
    local x = make({ 2, 3 }, { 1, 5, 5, 7, 2, 7 }, 'f32')
    local v, i = F.max(x, 2)
    assert_equal_values(vals(v), { 5, 7 })
    assert_equal_values(vals(i), { 1, 0 })  -- first occurrence, 0-based
    local v2, i2 = x:min(1, true)
    assert.are.same({ 1, 3 }, v2.shape)
    assert_equal_values(vals(v2), { 1, 2, 5 })
    assert_equal_values(vals(i2), { 0, 1, 0 })
    assert_equal_values(vals(F.argmax(x)), { 3 })
  end)

  it('work on non-contiguous inputs and reduce leading dims of wide tensors', function()
    math.randomseed(52)
    local x, xv = rand_tensor({ 37, 300 }, 'f32')
    local xt = noncontig(x)
    for _, name in ipairs({ 'sum', 'mean', 'prod', 'max', 'argmin', 'logsumexp' }) do
      for d = 1, 2 do
        local want = ref_reduce(xv, { 37, 300 }, d - 1, reduce_ref[name])
        local rtol = name == 'prod' and 1e-5 or 4e-6
        assert_close(vals(F[name](x, d)), want, rtol, 1e-5, name .. ' contiguous dim ' .. d)
        assert_close(vals(F[name](xt, d)), want, rtol, 1e-5, name .. ' strided dim ' .. d)
      end
    end
    -- a transposed view reduced over its last dim
    local s = F.sum(x:t(), 2)
    assert_close(vals(s), ref_reduce(xv, { 37, 300 }, 0, reduce_ref.sum), 4e-6, 1e-5, 'sum of transpose')
  end)

  it('accumulate f32 sums in double', function()
    -- 2^24 + 1 + 1 + ... is not representable step by step in f32
    local n = 1001
    local v = { 2 ^ 24 }
    for i = 2, n do v[i] = 1 end
    local x = make({ n }, v, 'f32')
    assert_equal_values(vals(F.sum(x)), { 2 ^ 24 + 1000 })
    assert_equal_values(vals(F.sum(x, 1)), { 2 ^ 24 + 1000 })
    assert_close(vals(F.mean(make({ 3 }, { 1, 2, 4 }, 'f32'))), { 7 / 3 }, 1e-7, 0, 'mean')
  end)

  it('reduce large tensors over all elements in fixed blocks', function()
    local n = 200003
    local x = T.empty({ n }, { dtype = 'f64' })
    T.check(C.ms_arange_(x, 1, 1))
    assert_equal_values(vals(F.sum(x)), { n * (n + 1) / 2 })
    assert_equal_values(vals(F.max(x)), { n })
    assert_equal_values(vals(F.argmax(x)), { n - 1 })
    assert_equal_values(vals(F.argmin(x)), { 0 })
    assert_close(vals(F.logsumexp(x)), { n + math.log(1 / (1 - math.exp(-1))) }, 1e-12, 0, 'logsumexp')
    -- a maximum repeated in a later block: the first one wins
    local y = make({ 3 }, { 5, 9, 9 }, 'f32')
    assert_equal_values(vals(F.argmax(y)), { 1 })
    local z = T.zeros({ n }, { dtype = 'f32' })
    z:narrow(1, 70000, 1):fill_(3)
    z:narrow(1, 150000, 1):fill_(3)
    assert_equal_values(vals(F.argmax(z)), { 69999 })
    assert_equal_values(vals(F.sum(z)), { 6 })
  end)

  it('sum integers into i64 and keep the dtype of max/min', function()
    local x = make({ 2, 2 }, { 100, -3, 7, 2 }, 'i32')
    local s = F.sum(x)
    assert.are.equal('i64', s.dtype)
    assert_equal_values(vals(s), { 106 })
    assert.are.equal('i64', F.sum(F.gt(x, 0)).dtype)
    assert_equal_values(vals(F.sum(F.gt(x, 0))), { 3 })
    assert.are.equal('i32', F.max(x).dtype)
    assert_equal_values(vals(F.max(x, 1)), { 100, 2 })
    assert.are.equal('i64', F.prod(x).dtype)
    assert_equal_values(vals(F.prod(x)), { -4200 })
  end)

  it('propagate NaN through max/min/argmax and stay stable in logsumexp', function()
    local x = make({ 4 }, { 1, 0 / 0, 3, 0 / 0 }, 'f32')
    local m = vals(F.max(x))[1]
    assert.is_true(m ~= m)
    assert_equal_values(vals(F.argmax(x)), { 1 })
    assert_equal_values(vals(F.argmin(x)), { 1 })
    local big = make({ 2 }, { 1000, 1000 }, 'f32')
    assert_close(vals(F.logsumexp(big)), { 1000 + math.log(2) }, 1e-6, 0, 'logsumexp')
    local ninf = make({ 2 }, { -math.huge, -math.huge }, 'f32')
    assert_equal_values(vals(F.logsumexp(ninf)), { -math.huge })
    local pinf = make({ 2 }, { math.huge, 1 }, 'f32')
    assert_equal_values(vals(F.logsumexp(pinf)), { math.huge })
  end)

  it('handle empty dims: sum 0, prod 1, and an error for max', function()
    local x = T.empty({ 2, 0 }, { dtype = 'f32' })
    assert_equal_values(vals(F.sum(x, 2)), { 0, 0 })
    assert_equal_values(vals(F.prod(x, 2)), { 1, 1 })
    assert.are.same({ 0 }, F.sum(x, 1).shape)
    assert_equal_values(vals(F.sum(x)), { 0 })
    expect_error(function() F.max(x, 2) end, 'max: cannot reduce over dim 2 of size 0 (shape (2,0))')
    expect_error(function() F.argmax(x) end, 'argmax: cannot reduce an empty tensor f32 (2,0) cpu')
  end)

  it('treat a 0-dim tensor as its own reduction', function()
    local s = T.full({}, 4, { dtype = 'f32' })
    assert_equal_values(vals(F.sum(s)), { 4 })
    assert_equal_values(vals(F.sum(s, 1)), { 4 })
  end)

  it('name the op for bad dims and dtypes', function()
    local x = make({ 2, 3 }, randoms(6))
    expect_error(function() F.sum(x, 3) end, 'sum: dim 3 out of range')
    expect_error(function() F.mean(make({ 2 }, { 1, 2 }, 'i64')) end, 'mean: needs a float tensor, got i64 (2) cpu')
    expect_error(function() F.logsumexp(make({ 2 }, { 1, 2 }, 'i32'), 1) end, 'logsumexp: needs a float tensor')
  end)
end)

-- ======================================================================
describe('softmax', function()
  local function ref_softmax(xv, shape, cd, log)
    local out = {}
    local outer, n, inner = 1, shape[cd + 1], 1
    for i = 1, cd do outer = outer * shape[i] end
    for i = cd + 2, #shape do inner = inner * shape[i] end
    for o = 0, outer - 1 do
      for k = 0, inner - 1 do
        local m = -math.huge
        for r = 0, n - 1 do m = math.max(m, xv[(o * n + r) * inner + k + 1]) end
        local s = 0
        for r = 0, n - 1 do s = s + math.exp(xv[(o * n + r) * inner + k + 1] - m) end
        for r = 0, n - 1 do
          local i = (o * n + r) * inner + k + 1
          out[i] = log and (xv[i] - m - math.log(s)) or math.exp(xv[i] - m) / s
        end
      end
    end
    return out
  end

  it('softmax and log_softmax match the reference over each dim and dtype', function()
    math.randomseed(61)
    local shape = { 3, 4, 6 }
    for _, dt in ipairs(float_dtypes) do
      local x, xv = rand_tensor(shape, dt, -5, 5)
      for d = 1, 3 do
        for _, log in ipairs({ false, true }) do
          local y = log and F.log_softmax(x, d) or F.softmax(x, d)
          assert.are.equal(dt, y.dtype)
          local tol = tolerances[dt]
          assert_close(vals(y), ref_softmax(xv, shape, d - 1, log), tol[1], tol[2], 'softmax ' .. dt .. ' dim ' .. d)
        end
      end
      local nc = noncontig(x)
      assert_close(vals(F.softmax(nc, 2)), ref_softmax(xv, shape, 1, false), tolerances[dt][1], tolerances[dt][2],
        'softmax of a strided view ' .. dt)
    end
  end)

  it('is stable for large logits and defaults to the last dim', function()
    local x = make({ 1, 3 }, { 1000, 1001, 1002 }, 'f32')
    local y = vals(F.softmax(x))
    local e = { math.exp(-2), math.exp(-1), 1 }
    local s = e[1] + e[2] + e[3]
    assert_close(y, { e[1] / s, e[2] / s, e[3] / s }, 1e-6, 0, 'large logits')
    local ly = vals(F.log_softmax(x))
    assert_close(ly, { -2 - math.log(s), -1 - math.log(s), -math.log(s) }, 1e-6, 0, 'log_softmax')
  end)

  it('backward matches the analytic Jacobian and finite differences', function()
    math.randomseed(62)
    local shape = { 4, 5 }
    local x, xv = rand_tensor(shape, 'f64', -3, 3)
    local g, gv = rand_tensor(shape, 'f64', -1, 1)
    for _, log in ipairs({ false, true }) do
      local y = log and F.log_softmax(x, 2) or F.softmax(x, 2)
      local gx = vals(F.softmax_backward(y, g, 2, log))
      -- finite differences of L = sum(g * f(x)) in f64
      for i = 1, #xv do
        local h = 1e-6
        local xp, xm = {}, {}
        for j = 1, #xv do xp[j] = xv[j]; xm[j] = xv[j] end
        xp[i] = xp[i] + h; xm[i] = xm[i] - h
        local fp, fm = ref_softmax(xp, shape, 1, log), ref_softmax(xm, shape, 1, log)
        local lp, lm = 0, 0
        for j = 1, #xv do lp = lp + gv[j] * fp[j]; lm = lm + gv[j] * fm[j] end
        local fd = (lp - lm) / (2 * h)
        assert(math.abs(gx[i] - fd) < 1e-7, ('softmax_backward log=%s element %d: %g vs %g'):format(tostring(log), i, gx[i], fd))
      end
    end
    -- over dim 1 of a transposed layout too
    local y1 = F.softmax(x, 1)
    local gx1 = vals(F.softmax_backward(noncontig(y1), g, 1))
    local yv = vals(y1)
    for j = 0, 4 do
      local s = 0
      for i = 0, 3 do s = s + gv[i * 5 + j + 1] * yv[i * 5 + j + 1] end
      for i = 0, 3 do
        local k = i * 5 + j + 1
        assert(math.abs(gx1[k] - yv[k] * (gv[k] - s)) < 1e-14)
      end
    end
  end)

  it('backward in f32 (the contiguous-row path) agrees with f64', function()
    math.randomseed(63)
    local x = rand_tensor({ 6, 33 }, 'f32', -4, 4)
    local g = rand_tensor({ 6, 33 }, 'f32', -1, 1)
    for _, log in ipairs({ false, true }) do
      local y32 = log and F.log_softmax(x, 2) or F.softmax(x, 2)
      local y64 = log and F.log_softmax(x:to('f64'), 2) or F.softmax(x:to('f64'), 2)
      assert_close(vals(y32), vals(y64), 2e-6, 1e-7, 'forward f32 log=' .. tostring(log))
      local g32 = F.softmax_backward(y32, g, 2, log)
      local g64 = F.softmax_backward(y64, g:to('f64'), 2, log)
      assert.are.equal('f32', g32.dtype)
      assert_close(vals(g32), vals(g64), 1e-5, 1e-6, 'backward f32 log=' .. tostring(log))
    end
  end)

  it('gives NaN rows for NaN inputs and all -inf rows, in f32 and f64', function()
    for _, dt in ipairs({ 'f32', 'f64' }) do
      local x = make({ 3, 3 }, { 1, 0 / 0, 2, -math.huge, -math.huge, -math.huge, -math.huge, 0, 1 }, dt)
      for _, log in ipairs({ false, true }) do
        local y = vals(log and F.log_softmax(x, 2) or F.softmax(x, 2))
        for i = 1, 6 do assert.is_true(y[i] ~= y[i], dt .. ' element ' .. i .. ' should be NaN') end
        local e1, e2 = math.exp(-1), 1
        local want = log and { -math.huge, -1 - math.log(e1 + e2), -math.log(e1 + e2) } or { 0, e1 / (e1 + e2), e2 / (e1 + e2) }
        assert_close({ y[7], y[8], y[9] }, want, 1e-6, 0, dt .. ' row with -inf')
      end
    end
  end)

  it('names the op on errors', function()
    expect_error(function() F.softmax(make({ 2 }, { 1, 2 }, 'i64')) end, 'softmax: needs a float tensor')
    expect_error(function() F.log_softmax(make({ 2, 2 }, { 1, 2, 3, 4 }), 3) end, 'log_softmax: dim 3 out of range')
    expect_error(function() F.softmax_backward(make({ 2 }, { 1, 2 }), make({ 3 }, { 1, 2, 3 }), 1) end,
      'softmax_backward: output (2) and gradient (3) differ in shape')
  end)
end)

-- ======================================================================
-- numpy.matmul in plain Lua on row-major lists: shapes with batch dims
local function ref_matmul(av, ashape, bv, bshape)
  local a1, b1 = #ashape == 1, #bshape == 1
  local as = a1 and { 1, ashape[1] } or ashape
  local bs = b1 and { bshape[1], 1 } or bshape
  local M, K, N = as[#as - 1], as[#as], bs[#bs]
  local ab, bb = {}, {}
  for i = 1, #as - 2 do ab[i] = as[i] end
  for i = 1, #bs - 2 do bb[i] = bs[i] end
  local nb = math.max(#ab, #bb)
  local batch = {}
  for i = 1, nb do
    local x = ab[#ab - nb + i] or 1
    local y = bb[#bb - nb + i] or 1
    batch[i] = math.max(x, y)
  end
  local nbatch = numel_of(batch)
  local out = {}
  for bi = 0, nbatch - 1 do
    -- batch index -> offsets in a and b (broadcast)
    local rem, aoff, boff, astr, bstr = bi, 0, 0, M * K, K * N
    local idx = {}
    for d = nb, 1, -1 do idx[d] = rem % batch[d]; rem = math.floor(rem / batch[d]) end
    for d = nb, 1, -1 do
      local da = ab[#ab - nb + d]
      if da then aoff = aoff + (da == 1 and 0 or idx[d]) * astr; astr = astr * da end
      local db = bb[#bb - nb + d]
      if db then boff = boff + (db == 1 and 0 or idx[d]) * bstr; bstr = bstr * db end
    end
    for i = 0, M - 1 do
      for j = 0, N - 1 do
        local s = 0
        for k = 0, K - 1 do s = s + av[aoff + i * K + k + 1] * bv[boff + k * N + j + 1] end
        out[#out + 1] = s
      end
    end
  end
  local oshape = {}
  for _, s in ipairs(batch) do oshape[#oshape + 1] = s end
  if not a1 then oshape[#oshape + 1] = M end
  if not b1 then oshape[#oshape + 1] = N end
  return out, oshape
end

-- the transpose of the last two dims of a row-major list
local function transpose_last(v, shape)
  local n = #shape
  local R, Cc = shape[n - 1], shape[n]
  local nb = #v / (R * Cc)
  local out, oshape = {}, {}
  for i = 1, n do oshape[i] = shape[i] end
  oshape[n - 1], oshape[n] = Cc, R
  for b = 0, nb - 1 do
    for j = 0, Cc - 1 do
      for i = 0, R - 1 do out[#out + 1] = v[b * R * Cc + i * Cc + j + 1] end
    end
  end
  return out, oshape
end

describe('matmul', function()
  local cases = {
    { { 2, 3 }, { 3, 4 } }, { { 5, 1 }, { 1, 6 } }, { { 2, 4, 3 }, { 3, 5 } }, { { 3, 2 }, { 4, 2, 5 } },
    { { 2, 1, 3, 4 }, { 3, 4, 2 } }, { { 4 }, { 4, 3 } }, { { 2, 3, 4 }, { 4 } }, { { 6 }, { 6 } },
    { { 7 }, { 2, 7, 3 } }, { { 1, 3, 2 }, { 2, 2, 1 } }, { { 3, 0 }, { 0, 4 } }, { { 0, 3 }, { 3, 2 } },
  }

  it('follows numpy.matmul for 2-D, batched, broadcast and 1-D operands', function()
    math.randomseed(71)
    for _, c in ipairs(cases) do
      for _, dt in ipairs({ 'f64', 'f32' }) do
        local a, av = rand_tensor(c[1], dt)
        local b, bv = rand_tensor(c[2], dt)
        local want, wshape = ref_matmul(av, c[1], bv, c[2])
        local y = F.matmul(a, b)
        local what = ('matmul %s (%s) @ (%s)'):format(dt, table.concat(c[1], ','), table.concat(c[2], ','))
        assert.are.same(wshape, y.shape, what)
        assert.are.equal(dt, y.dtype)
        local tol = dt == 'f64' and 1e-13 or 2e-6
        assert_close(vals(y), want, tol, tol * 4, what)
        -- the same through non-contiguous layouts of both operands
        local y2 = F.matmul(noncontig(a), noncontig(b))
        assert_close(vals(y2), want, tol, tol * 4, what .. ' strided')
      end
    end
  end)

  it('transposes the last two dims with transa/transb, without copies', function()
    math.randomseed(72)
    local shapes = { { { 2, 4, 3 }, { 2, 5, 4 } }, { { 3, 2 }, { 5, 3 } }, { { 4, 3 }, { 2, 5, 4 } } }
    for _, s in ipairs(shapes) do
      local a, av = rand_tensor(s[1], 'f32')
      local b, bv = rand_tensor(s[2], 'f32')
      local at, atshape = transpose_last(av, s[1])
      local bt, btshape = transpose_last(bv, s[2])
      -- transa: a^T @ b^T needs (K,M) (N,K) shapes: use a as (.., K, M) and b as (.., N, K)
      local want, wshape = ref_matmul(at, atshape, bt, btshape)
      local y = F.matmul(a, b, true, true)
      assert.are.same(wshape, y.shape)
      assert_close(vals(y), want, 2e-6, 1e-5, 'transa transb')
    end
    -- a @ b^T, the linear-layer form
    local x, xv = rand_tensor({ 2, 3, 4 }, 'f32')
    local w, wv = rand_tensor({ 5, 4 }, 'f32')
    local wt, wtshape = transpose_last(wv, { 5, 4 })
    local want = ref_matmul(xv, { 2, 3, 4 }, wt, wtshape)
    assert_close(vals(F.matmul(x, w, false, true)), want, 2e-6, 1e-5, 'x @ w^T')
    assert_close(vals(F.matmul(x, w:t())), want, 2e-6, 1e-5, 'x @ w:t()')
    -- a^T @ b for a weight gradient
    local g, gv = rand_tensor({ 3, 5 }, 'f32')
    local x2 = x:select(1, 1)
    assert_close(vals(F.matmul(g, x2, true, false)), ref_matmul(transpose_last(gv, { 3, 5 }), { 5, 3 }, vals(x2), { 3, 4 }),
      2e-6, 1e-5, 'g^T @ x')
  end)

  it('reads expanded (stride 0) and narrowed operands', function()
    math.randomseed(73)
    local a, av = rand_tensor({ 1, 3, 4 }, 'f32')
    local ae = a:expand(5, 3, 4)
    local b, bv = rand_tensor({ 5, 4, 2 }, 'f32')
    local rep = {}
    for _ = 1, 5 do for _, v in ipairs(av) do rep[#rep + 1] = v end end
    assert_close(vals(F.matmul(ae, b)), ref_matmul(rep, { 5, 3, 4 }, bv, { 5, 4, 2 }), 2e-6, 1e-5, 'expanded a')
    local big, bigv = rand_tensor({ 6, 8 }, 'f64')
    local n = big:narrow(1, 2, 3):narrow(2, 3, 4) -- (3,4) with row stride 8
    local nv = {}
    for i = 1, 3 do for j = 1, 4 do nv[#nv + 1] = bigv[(i) * 8 + (j + 2)] end end
    local c, cv = rand_tensor({ 4, 2 }, 'f64')
    assert_close(vals(F.matmul(n, c)), ref_matmul(nv, { 3, 4 }, cv, { 4, 2 }), 1e-13, 1e-13, 'narrowed a')
    -- a (K,) vector with stride 2
    local v = big:select(2, 1):narrow(1, 1, 4) -- (4,) stride 8
    local vv = { bigv[1], bigv[9], bigv[17], bigv[25] }
    assert_close(vals(F.matmul(v, c)), ref_matmul(vv, { 4 }, cv, { 4, 2 }), 1e-13, 1e-13, 'strided vector')
  end)

  it('computes bf16/f16 in f32 and rounds once', function()
    math.randomseed(74)
    for _, dt in ipairs({ 'bf16', 'f16' }) do
      local a, av = rand_tensor({ 2, 3, 16 }, dt)
      local b, bv = rand_tensor({ 16, 5 }, dt)
      local want = ref_matmul(av, { 2, 3, 16 }, bv, { 16, 5 })
      local y = F.matmul(a, b)
      assert.are.equal(dt, y.dtype)
      local got = vals(y)
      local num, den = 0, 0
      for i = 1, #want do num = num + (got[i] - want[i]) ^ 2; den = den + want[i] ^ 2 end
      local bound = dt == 'bf16' and 2 ^ -8 or 2 ^ -10
      assert(math.sqrt(num / den) < bound, dt .. ' relative error ' .. math.sqrt(num / den))
      for i = 1, #want do
        -- each element is the f32 result rounded once: within half an ulp (+ f32 noise)
        assert(math.abs(got[i] - want[i]) <= bound * math.abs(want[i]) + 1e-5, dt .. ' element ' .. i)
      end
    end
  end)

  it('gives zeros for K = 0 and empty results for M = 0', function()
    local y = F.matmul(T.empty({ 3, 0 }, { dtype = 'f32' }), T.empty({ 0, 2 }, { dtype = 'f32' }))
    assert.are.same({ 3, 2 }, y.shape)
    assert_equal_values(vals(y), { 0, 0, 0, 0, 0, 0 })
  end)

  it('names the op and the shapes on errors', function()
    local a, b = make({ 2, 3 }, randoms(6)), make({ 4, 5 }, randoms(20))
    expect_error(function() F.matmul(a, b) end, 'matmul: shapes (2,3) and (4,5) do not match')
    expect_error(function() F.matmul(a, b, true, false) end, 'matmul: shapes (2,3) and (4,5) do not match (transa=1, transb=0)')
    expect_error(function() F.matmul(make({ 2, 2, 3 }, randoms(12)), make({ 3, 3, 1 }, randoms(9))) end,
      'matmul: batch dims of shapes (2,2,3) and (3,3,1) cannot be broadcast')
    expect_error(function() F.matmul(a, make({ 3, 2 }, randoms(6), 'f32')) end, 'matmul: dtypes differ: f64 (2,3) cpu and f32 (3,2) cpu')
    expect_error(function() F.matmul(make({ 2, 2 }, { 1, 2, 3, 4 }, 'i64'), make({ 2, 2 }, { 1, 2, 3, 4 }, 'i64')) end,
      'matmul: integer tensors are not supported')
    expect_error(function() F.matmul(T.full({}, 1), a) end, 'matmul: 0-dim operands are not supported')
  end)
end)

describe('gemm_', function()
  it('accumulates beta * out + alpha * op(a) @ op(b)', function()
    math.randomseed(81)
    for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
      local a, av = rand_tensor({ 4, 3 }, dt)
      local b, bv = rand_tensor({ 5, 3 }, dt)
      local c, cv = rand_tensor({ 4, 5 }, dt)
      local p = ref_matmul(av, { 4, 3 }, transpose_last(bv, { 5, 3 }), { 3, 5 })
      local want = {}
      for i = 1, #p do want[i] = 0.5 * cv[i] + 2 * p[i] end
      local r = F.gemm_(c, a, b, false, true, 2, 0.5)
      assert.are.equal(c, r)
      local tol = dt == 'bf16' and 2 ^ -7 or (dt == 'f32' and 2e-6 or 1e-13)
      assert_close(vals(c), want, tol, tol * 4, 'gemm_ ' .. dt)
    end
  end)

  it('writes into transposed and strided outputs and ignores out when beta = 0', function()
    math.randomseed(82)
    local a, av = rand_tensor({ 3, 4 }, 'f32')
    local b, bv = rand_tensor({ 4, 2 }, 'f32')
    local p = ref_matmul(av, { 3, 4 }, bv, { 4, 2 })
    -- column-major out: a transposed (2,3) buffer seen as (3,2)
    local buf = T.full({ 2, 3 }, 0 / 0, { dtype = 'f32' })
    F.gemm_(buf:t(), a, b, false, false, 1, 0)
    assert_close(vals(buf:t()), p, 2e-6, 1e-6, 'column-major out')
    -- out with a column stride of 2: computed through a temporary
    local wide = T.zeros({ 3, 4 }, { dtype = 'f32' })
    local strided = T.op(C.ms_tensor_as_strided, wide, 2, ffi.new('int64_t[2]', { 3, 2 }), ffi.new('int64_t[2]', { 4, 2 }), 0)
    F.gemm_(strided, a, b, false, false, 1, 1)
    assert_close(vals(strided), p, 2e-6, 1e-6, 'strided out')
    assert_equal_values({ vals(wide)[2], vals(wide)[4] }, { 0, 0 }, 'untouched gaps')
  end)

  it('names the op on errors', function()
    local a, b = make({ 2, 3 }, randoms(6)), make({ 3, 4 }, randoms(12))
    expect_error(function() F.gemm_(T.zeros({ 2, 5 }, { dtype = 'f64' }), a, b) end,
      'gemm_: out is f64 (2,5) cpu, expected f64 (2,4) cpu')
    expect_error(function() F.gemm_(T.zeros({ 2, 4 }, { dtype = 'f64' }), a, a) end, 'gemm_: shapes (2,3) and (2,3) do not match')
    expect_error(function() F.gemm_(T.zeros({ 2, 4 }, { dtype = 'f32' }), a, b) end, 'gemm_: dtypes differ')
    expect_error(function() F.gemm_(T.zeros({ 4 }, { dtype = 'f64' }):expand(2, 4), a, b) end,
      'gemm_: destination f64 (2,4) cpu has overlapping elements')
  end)
end)

describe('GEMM tuning choice (ms_gemm_tune_pick)', function()
  local function pick(t, margin)
    return C.ms_gemm_tune_pick(ffi.new('double[?]', #t, t), #t, margin or 0.02)
  end
  it('keeps the heuristic first unless another candidate beats it by the margin', function()
    assert.are.equal(0, pick({ 1.0, 1.1, 1.2 }))
    assert.are.equal(2, pick({ 1.0, 0.99, 0.90, 0.95 }))
    assert.are.equal(0, pick({ 1.0, 0.985 }), '1.5% is inside the 2% margin')
    assert.are.equal(1, pick({ 1.0, 0.985 }, 0.01))
    assert.are.equal(0, pick({ 1.0 }))
  end)
  it('tuning records: written, read back for their library version and device only, malformed lines named', function()
    local path = os.tmpname()
    os.remove(path)
    local recs, n = ffi.new('ms_gemm_tune_rec *[1]'), ffi.new('int[1]')
    local function read(version, device)
      local rc = C.ms_gemm_tune_read(path, version, device, recs, n)
      if rc ~= 0 then return nil, ffi.string(C.ms_last_error()) end
      local out = {}
      for i = 0, n[0] - 1 do
        local r = recs[0][i]
        out[#out + 1] = { key1 = tonumber(r.key[1]), key21 = tonumber(r.key[21]), pick = r.pick, found = r.found }
      end
      C.ms_gemm_tune_free(recs[0])
      return out
    end
    assert.are.same({}, read(130100, 'NVIDIA H100 80GB HBM3'), 'a missing file has no records')
    local buf = ffi.new('char[1024]')
    local function add(version, device, k1, k21, pick, found)
      local key = ffi.new('int64_t[22]')
      for i = 0, 21 do key[i] = 100 + i end
      key[1], key[21] = k1, k21
      assert.are.equal(0, C.ms_gemm_tune_format(buf, 1024, version, device, key, pick, found))
      assert.are.equal(0, C.ms_gemm_tune_append(path, buf))
      return ffi.string(buf)
    end
    local line = add(130100, 'NVIDIA H100 80GB HBM3', 7, -3, 2, 8)
    assert.is_truthy(line:match('^ms%-gemm%-tune 1 130100 NVIDIA_H100_80GB_HBM3 100 7 102 103 '), line)
    assert.is_truthy(line:match(' 120 %-3 2 8\n$'), line)
    add(130100, 'NVIDIA H200', 9, 1, 1, 8)          -- another GPU
    add(120900, 'NVIDIA H100 80GB HBM3', 9, 1, 1, 8) -- another library
    local f = assert(io.open(path, 'a'))
    f:write('# a comment\n\n')
    f:close()
    add(130100, 'NVIDIA H100 80GB HBM3', 5, 4294967296, 0, 3)
    local got = read(130100, 'NVIDIA H100 80GB HBM3')
    assert.are.same({ { key1 = 7, key21 = -3, pick = 2, found = 8 }, { key1 = 5, key21 = 4294967296, pick = 0, found = 3 } }, got)
    assert.are.equal(1, #read(130100, 'NVIDIA H200'))
    -- a broken line: an error naming the file and the line
    f = assert(io.open(path, 'a'))
    f:write('ms-gemm-tune 1 130100 NVIDIA_H100_80GB_HBM3 1 2 3\n')
    f:close()
    local none, err = read(130100, 'NVIDIA H100 80GB HBM3')
    assert.is_nil(none)
    assert.is_truthy(err:find(path .. ' line 7', 1, true), err)
    os.remove(path)
    f = assert(io.open(path, 'w'))
    f:write((line:gsub(' 2 8\n$', ' 8 8\n')))   -- pick out of range
    f:write('something else\n')
    f:close()
    none, err = read(130100, 'NVIDIA H100 80GB HBM3')
    assert.is_truthy(err:find(path .. ' line 1: a record needs 22 key integers, then 0 <= pick < found', 1, true), err)
    os.remove(path)
  end)
  it('skips candidates that did not run, and takes the fastest that did when the first did not', function()
    assert.are.equal(0, pick({ 1.0, -1, -1 }))
    assert.are.equal(3, pick({ 1.0, -1, 0.7, 0.5 }))
    assert.are.equal(2, pick({ -1, 0.9, 0.8 }))
    assert.are.equal(0, pick({ -1, -1 }))
    assert.are.equal(0, C.ms_gemm_tune_pick(nil, 0, 0.02))
  end)
end)

-- ======================================================================
describe('index ops', function()
  it('index_select picks slices along any dim with i64 or i32 ids', function()
    math.randomseed(91)
    local x, xv = rand_tensor({ 4, 3, 5 }, 'f32')
    for _, idt in ipairs({ 'i64', 'i32' }) do
      local ids = make({ 5 }, { 3, 0, 0, 2, 1 }, idt)
      local y = F.index_select(x, 1, ids)
      assert.are.same({ 5, 3, 5 }, y.shape)
      local want = {}
      for _, r in ipairs({ 3, 0, 0, 2, 1 }) do for k = 1, 15 do want[#want + 1] = xv[r * 15 + k] end end
      assert_equal_values(vals(y), want, 'index_select dim 1 ' .. idt)
      local z = F.index_select(noncontig(x), -1, make({ 2 }, { 4, 1 }, idt))
      local want2 = {}
      for i = 0, 3 do for j = 0, 2 do
        want2[#want2 + 1] = xv[i * 15 + j * 5 + 5]; want2[#want2 + 1] = xv[i * 15 + j * 5 + 2]
      end end
      assert_equal_values(vals(z), want2, 'index_select dim -1 ' .. idt)
    end
    -- ids as a Lua table, and an embedding lookup of bf16 rows
    local e, ev = rand_tensor({ 6, 4 }, 'bf16')
    local r = F.index_select(e, 1, { 5, 5, 0 })
    assert.are.equal('bf16', r.dtype)
    assert_equal_values(vals(r), { ev[21], ev[22], ev[23], ev[24], ev[21], ev[22], ev[23], ev[24], ev[1], ev[2], ev[3], ev[4] })
  end)

  it('index_add_ accumulates repeated ids in order', function()
    local dst = T.zeros({ 3, 2 }, { dtype = 'f32' })
    local src = make({ 4, 2 }, { 1, 2, 3, 4, 5, 6, 7, 8 }, 'f32')
    F.index_add_(dst, 1, make({ 4 }, { 2, 0, 2, 2 }, 'i64'), src)
    assert_equal_values(vals(dst), { 3, 4, 0, 0, 13, 16 })
    local d2 = T.zeros({ 2, 3 }, { dtype = 'f64' })
    d2:index_add_(2, make({ 2 }, { 1, 1 }, 'i32'), make({ 2, 2 }, { 1, 2, 3, 4 }))
    assert_equal_values(vals(d2), { 0, 3, 0, 0, 7, 0 })
    -- a large embedding gradient against a Lua loop
    math.randomseed(92)
    local V, N, D = 17, 300, 40
    local g, gv = rand_tensor({ N, D }, 'f32')
    local idv = {}
    for i = 1, N do idv[i] = math.random(0, V - 1) end
    local acc = T.zeros({ V, D }, { dtype = 'f32' })
    F.index_add_(acc, 1, make({ N }, idv, 'i64'), g)
    local want = {}
    for i = 1, V * D do want[i] = 0 end
    for i = 1, N do for k = 1, D do
      local j = idv[i] * D + k
      want[j] = want[j] + gv[(i - 1) * D + k]
    end end
    assert_close(vals(acc), want, 1e-5, 1e-5, 'embedding gradient')
  end)

  it('gather and scatter_add_ follow torch along each dim', function()
    local x = make({ 2, 3 }, { 1, 2, 3, 4, 5, 6 }, 'f32')
    local idx = make({ 2, 2 }, { 2, 0, 1, 1 }, 'i64')
    assert_equal_values(vals(F.gather(x, 2, idx)), { 3, 1, 5, 5 })
    assert_equal_values(vals(F.gather(x, 1, make({ 1, 3 }, { 1, 0, 1 }, 'i32'))), { 4, 2, 6 })
    local dst = T.zeros({ 2, 3 }, { dtype = 'f32' })
    F.scatter_add_(dst, 2, idx, make({ 2, 2 }, { 10, 20, 30, 40 }, 'f32'))
    assert_equal_values(vals(dst), { 20, 0, 10, 0, 70, 0 })
    local d1 = T.zeros({ 3, 2 }, { dtype = 'f64' })
    d1:scatter_add_(1, make({ 2, 2 }, { 2, 2, 2, 0 }, 'i64'), make({ 2, 2 }, { 1, 2, 3, 4 }))
    assert_equal_values(vals(d1), { 0, 4, 0, 0, 4, 2 })
    -- cross-entropy style: pick the target logit of each row of a strided view
    math.randomseed(93)
    local logits, lv = rand_tensor({ 5, 7 }, 'f64')
    local t = { 6, 0, 3, 3, 1 }
    local picked = F.gather(noncontig(logits), 2, make({ 5, 1 }, t, 'i64'))
    local want = {}
    for i = 1, 5 do want[i] = lv[(i - 1) * 7 + t[i] + 1] end
    assert_equal_values(vals(picked), want, 'target logits')
    local grad = T.zeros({ 5, 7 }, { dtype = 'f64' })
    F.scatter_add_(grad, 2, make({ 5, 1 }, t, 'i64'), T.full({ 5, 1 }, -1, { dtype = 'f64' }))
    local gvv = vals(grad)
    for i = 1, 5 do for j = 0, 6 do
      assert.are.equal(j == t[i] and -1 or 0, gvv[(i - 1) * 7 + j + 1])
    end end
  end)

  it('reject out-of-range ids, naming the value, position and size, before writing', function()
    local x = make({ 4, 3 }, randoms(12), 'f32')
    expect_error(function() F.index_select(x, 1, make({ 3 }, { 1, 4, 0 }, 'i64')) end,
      'index_select: index 4 at position 1 is out of range for dim 1 of size 4')
    expect_error(function() F.index_select(x, 2, make({ 2 }, { -1, 0 }, 'i32')) end,
      'index_select: index -1 at position 0 is out of range for dim 2 of size 3')
    expect_error(function() F.gather(x, 2, make({ 2, 2 }, { 0, 1, 2, 3 }, 'i64')) end,
      'gather: index 3 at position (1,1) is out of range for dim 2 of size 3')
    local dst = T.zeros({ 3, 2 }, { dtype = 'f32' })
    expect_error(function()
      F.index_add_(dst, 1, make({ 3 }, { 0, 1, 7 }, 'i64'), T.ones({ 3, 2 }, { dtype = 'f32' }))
    end, 'index_add_: index 7 at position 2 is out of range for dim 1 of size 3')
    assert_equal_values(vals(dst), { 0, 0, 0, 0, 0, 0 }, 'nothing written')
    expect_error(function()
      F.scatter_add_(dst, 1, make({ 2, 1 }, { 0, 3 }, 'i64'), T.ones({ 2, 1 }, { dtype = 'f32' }))
    end, 'scatter_add_: index 3 at position (1,0) is out of range for dim 1 of size 3')
    assert_equal_values(vals(dst), { 0, 0, 0, 0, 0, 0 }, 'nothing written')
  end)

  it('reject bad index dtypes and shapes with readable messages', function()
    local x = make({ 4, 3 }, randoms(12), 'f32')
    expect_error(function() F.index_select(x, 1, make({ 2 }, { 0, 1 }, 'f32')) end,
      'index_select: indices must be i64 or i32, got f32 (2) cpu')
    expect_error(function() F.index_select(x, 1, make({ 1, 2 }, { 0, 1 }, 'i64')) end,
      'index_select: indices must be 1-D, got i64 (1,2) cpu')
    expect_error(function() F.index_select(x, 3, { 0 }) end, 'index_select: dim 3 out of range')
    expect_error(function() F.gather(x, 1, make({ 2, 4 }, { 0, 0, 0, 0, 0, 0, 0, 0 }, 'i64')) end,
      'gather: index shape (2,4) does not fit input shape (4,3) along dim 1')
    expect_error(function() F.index_add_(T.zeros({ 3, 2 }), 1, { 0 }, T.ones({ 2, 2 })) end,
      'index_add_: source shape (2,2) does not fit destination (3,2) with 1 indices along dim 1')
    expect_error(function() F.index_add_(T.zeros({ 3, 2 }), 1, { 0 }, T.ones({ 1, 2 }, { dtype = 'f64' })) end,
      'index_add_: dtypes differ: destination f32 (3,2) cpu, source f64 (1,2) cpu')
    expect_error(function() F.scatter_add_(T.zeros({ 3 }), 1, { 0, 1 }, T.ones({ 1 })) end,
      'scatter_add_: index shape (2) does not fit source (1) and destination (3) along dim 1')
  end)
end)

-- ======================================================================
describe('cat, split, stack', function()
  it('cat joins along any dim, including non-contiguous parts', function()
    local a = make({ 2, 2 }, { 1, 2, 3, 4 }, 'f32')
    local b = make({ 2, 3 }, { 5, 6, 7, 8, 9, 10 }, 'f32')
    local y = F.cat({ a, b }, 2)
    assert.are.same({ 2, 5 }, y.shape)
    assert_equal_values(vals(y), { 1, 2, 5, 6, 7, 3, 4, 8, 9, 10 })
    local z = F.cat({ a, a:t(), T.empty({ 0, 2 }, { dtype = 'f32' }) }, 1)
    assert.are.same({ 4, 2 }, z.shape)
    assert_equal_values(vals(z), { 1, 2, 3, 4, 1, 3, 2, 4 })
    assert_equal_values(vals(F.cat({ a }, -1)), { 1, 2, 3, 4 })
  end)

  it('cat names the shapes, dtypes and dims that do not fit', function()
    local a = make({ 2, 2 }, { 1, 2, 3, 4 }, 'f32')
    expect_error(function() F.cat({ a, make({ 3, 3 }, randoms(9), 'f32') }, 1) end,
      'cat: shapes (2,2) and (3,3) differ outside dim 1')
    expect_error(function() F.cat({ a, make({ 2, 2 }, randoms(4), 'f64') }, 1) end,
      'cat: dtypes differ: f32 (2,2) cpu and f64 (2,2) cpu')
    expect_error(function() F.cat({ a, make({ 2 }, { 1, 2 }, 'f32') }, 1) end, 'cat: shapes (2,2) and (2) differ outside dim 1')
    expect_error(function() F.cat({}, 1) end, 'cat: expected a non-empty list')
    expect_error(function() F.cat({ a, 3 }, 1) end, 'cat: element 2 of the list is a number')
    expect_error(function() F.cat({ a }, 3) end, 'cat: dim 3 out of range')
  end)

  it('split gives views by size or by sizes', function()
    local x = T.arange(10)
    local parts = F.split(x, 4)
    assert.are.equal(3, #parts)
    assert_equal_values(vals(parts[3]), { 8, 9 })
    parts[1]:fill_(-1)
    assert.are.equal(-1, vals(x)[1]) -- a view: writes show in x
    local m = make({ 2, 5 }, { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 })
    local p2 = m:split({ 1, 4 }, 2)
    assert.are.same({ 2, 1 }, p2[1].shape)
    assert_equal_values(vals(p2[2]), { 1, 2, 3, 4, 6, 7, 8, 9 })
    expect_error(function() F.split(m, { 2, 2 }, 2) end, 'split: sizes {2,2} sum to 4 but dim 2 of shape (2,5) has size 5')
    expect_error(function() F.split(m, 0) end, 'split: size must be a positive integer')
  end)

  it('stack adds a new dim', function()
    local a = make({ 2 }, { 1, 2 })
    local b = make({ 2 }, { 3, 4 })
    local s1 = F.stack({ a, b })
    assert.are.same({ 2, 2 }, s1.shape)
    assert_equal_values(vals(s1), { 1, 2, 3, 4 })
    local s2 = F.stack({ a, b }, 2)
    assert_equal_values(vals(s2), { 1, 3, 2, 4 })
    local s3 = F.stack({ a, b }, -1)
    assert.are.same({ 2, 2 }, s3.shape)
    assert_equal_values(vals(s3), { 1, 3, 2, 4 })
    expect_error(function() F.stack({ a, make({ 3 }, { 1, 2, 3 }) }) end, 'stack: shapes (2) and (3) (element 2) differ')
  end)
end)

-- ======================================================================
describe('fills', function()
  it('fill_ writes every element of any dtype and only the view', function()
    for _, dt in ipairs({ 'f64', 'f32', 'bf16', 'f16', 'i64', 'i32', 'u8', 'bool' }) do
      local t = T.zeros({ 3, 4 }, { dtype = dt })
      F.fill_(t:narrow(2, 2, 2), dt == 'bool' and true or 3)
      local want = {}
      for i = 0, 2 do for j = 0, 3 do want[#want + 1] = (j == 1 or j == 2) and (dt == 'bool' and 1 or 3) or 0 end end
      assert_equal_values(vals(t), want, 'fill_ ' .. dt)
    end
    local big = T.empty({ 100000 }, { dtype = 'f32' })
    big:fill_(0.25)
    assert_equal_values(vals(F.sum(big)), { 25000 })
  end)

  it('arange_ writes start + i * step in row-major order of the view', function()
    local t = T.zeros({ 3, 2 }, { dtype = 'f64' })
    T.check(C.ms_arange_(t:t(), 10, 0.5))
    -- the transposed view (2,3) got 10, 10.5, 11 / 11.5, 12, 12.5 in its row-major order
    assert_equal_values(vals(t), { 10, 11.5, 10.5, 12, 11, 12.5 })
    local i = T.empty({ 4 }, { dtype = 'i32' })
    T.check(C.ms_arange_(i, -2, 3))
    assert_equal_values(vals(i), { -2, 1, 4, 7 })
  end)
end)

-- ======================================================================
describe('threads', function()
  local function bits_equal(a, b)
    local va, vb = vals(a), vals(b)
    if #va ~= #vb then return false end
    for i = 1, #va do
      if va[i] ~= vb[i] and not (va[i] ~= va[i] and vb[i] ~= vb[i]) then return false end
    end
    return true
  end

  it('do not change any result', function()
    math.randomseed(101)
    local x = rand_tensor({ 300, 400 }, 'f32')
    local w = rand_tensor({ 400, 50 }, 'f32')
    local ids = make({ 1000 }, (function() local r = {} for i = 1, 1000 do r[i] = math.random(0, 299) end return r end)(), 'i64')
    local function run_all()
      return {
        F.sum(x), F.sum(x, 1), F.sum(x, 2), F.mean(noncontig(x), 1), F.logsumexp(x, 2), F.max(x),
        F.softmax(x, 2), F.softmax(x, 1), F.gelu(x), F.mul(x, F.sigmoid(x)), F.matmul(x, w),
        F.index_add_(T.zeros({ 300, 400 }, { dtype = 'f32' }), 1, ids, F.index_select(x, 1, ids)),
      }
    end
    local n0 = C.ms_get_num_threads()
    C.ms_set_num_threads(1)
    local one = run_all()
    C.ms_set_num_threads(2)
    local two = run_all()
    C.ms_set_num_threads(3)
    local three = run_all()
    C.ms_set_num_threads(n0)
    for i = 1, #one do
      assert.is_true(bits_equal(one[i], two[i]), 'result ' .. i .. ' differs between 1 and 2 threads')
      assert.is_true(bits_equal(one[i], three[i]), 'result ' .. i .. ' differs between 1 and 3 threads')
    end
  end)

  it('can be set and read back', function()
    local n0 = C.ms_get_num_threads()
    C.ms_set_num_threads(2)
    assert.are.equal(2, C.ms_get_num_threads())
    C.ms_set_num_threads(0)
    assert.is_true(C.ms_get_num_threads() >= 1)
    C.ms_set_num_threads(n0)
  end)
end)

describe('matmul_bias and matmul_bgrad (the GEMM epilogues)', function()
  local seed = 7300
  local function rnd(shape, dt)
    seed = seed + 1
    return T.randn(shape, { seed = seed }):to(dt or 'f64')
  end
  local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end

  for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
    it('equal the product plus the bias, and the product with its sums over k (' .. dt .. ')', function()
      local tol = ({ f64 = 1e-12, f32 = 1e-4, bf16 = 0.1 })[dt]
      local M, K, N = 9, 13, 6
      for _, ta in ipairs({ false, true }) do
        for _, tb in ipairs({ false, true }) do
          local a = rnd(ta and { K, M } or { M, K }, dt)
          local b = rnd(tb and { N, K } or { K, N }, dt)
          local bias = rnd({ N }, dt)
          local p = F.matmul(a, b, ta, tb)
          local y = F.matmul_bias(a, b, ta, tb, bias)
          assert.are.same({ M, N }, y.shape)
          assert.is_true(maxdiff(y, p:double() + bias:double():view(1, N)) <= tol)
          local opa = ta and a:t() or a       -- (M, K)
          local opb = tb and b:t() or b       -- (K, N)
          local w1, sa = F.matmul_bgrad(a, b, ta, tb, 'a')
          local w2, sb = F.matmul_bgrad(a, b, ta, tb, 'b')
          assert.is_true(maxdiff(w1, p) == 0 and maxdiff(w2, p) == 0)
          assert.are.same({ M }, sa.shape)
          assert.are.same({ N }, sb.shape)
          assert.are.equal(dt, sa.dtype)
          assert.is_true(maxdiff(sa, opa:double():sum(2)) <= tol, 'sum of op(a)')
          assert.is_true(maxdiff(sb, opb:double():sum(1)) <= tol, 'sum of op(b)')
        end
      end
    end)
  end

  it('rejects a bias that does not fit and an unknown side, naming them', function()
    local a, b = rnd({ 4, 3 }), rnd({ 3, 5 })
    local ok, err = pcall(F.matmul_bias, a, b, false, false, rnd({ 4 }))
    assert.is_false(ok)
    assert.matches('vector of 5', err, 1, true)
    assert.matches('(4)', err, 1, true)
    ok, err = pcall(F.matmul_bias, a, b, false, false, rnd({ 5 }, 'f32'))
    assert.is_false(ok)
    assert.matches('f64 vector', err, 1, true)
    ok, err = pcall(F.matmul_bgrad, a, b, false, false, 'c')
    assert.is_false(ok)
    assert.matches("side must be 'a' or 'b'", err, 1, true)
    ok, err = pcall(F.matmul_bias, rnd({ 2, 4, 3 }), b, false, false, rnd({ 5 }))
    assert.is_false(ok)
    assert.matches('2-D operands', err, 1, true)
  end)
end)

describe('matmul_gelu and matmul_dgelu (the GELU epilogues)', function()
  local seed = 7400
  local function rnd(shape, dt)
    seed = seed + 1
    return T.randn(shape, { seed = seed }):to(dt or 'f64')
  end
  local function maxdiff(a, b) return (a:double() - b:double()):abs():max():item() end

  for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
    it('equal the product, bias and tanh GELU, and the product times gelu\' (' .. dt .. ')', function()
      local tol = ({ f64 = 1e-12, f32 = 1e-4, bf16 = 0.1 })[dt]
      local M, K, N = 7, 11, 16
      for _, ta in ipairs({ false, true }) do
        for _, tb in ipairs({ false, true }) do
          local a = rnd(ta and { K, M } or { M, K }, dt)
          local b = rnd(tb and { N, K } or { K, N }, dt)
          local bias = rnd({ N }, dt)
          local p = F.matmul(a, b, ta, tb)
          local want_pre = F.add(p, bias)
          local out, pre = F.matmul_gelu(a, b, ta, tb, bias)
          assert.is_true(maxdiff(pre, want_pre) <= tol, 'pre')
          assert.is_true(maxdiff(out, F.gelu(want_pre)) <= tol, 'gelu')
          local out0, pre0 = F.matmul_gelu(a, b, ta, tb)
          assert.is_true(maxdiff(pre0, p) == 0 and maxdiff(out0, F.gelu(p)) <= tol, 'no bias')
          -- backward: (a b) * gelu'(pre) and its column sums
          local z = rnd({ M, N }, dt)
          local d, bg = F.matmul_dgelu(a, b, ta, tb, z, true)
          -- gelu' by a central difference in f64
          local gp = F.mul(p:double(), F.sub(F.gelu(F.add(z:double(), 1e-6)), F.gelu(F.sub(z:double(), 1e-6))) / 2e-6)
          assert.is_true(maxdiff(d, gp) <= (dt == 'f64' and 1e-6 or tol), 'dgelu ' .. maxdiff(d, gp))
          assert.is_true(maxdiff(bg, d:double():sum(1)) <= tol, 'bias grad')
          local d2, none = F.matmul_dgelu(a, b, ta, tb, z)
          assert.is_nil(none)
          assert.is_true(maxdiff(d2, d) == 0)
        end
      end
    end)
  end

  it('rejects a pre-activation or bias that does not fit, naming them', function()
    local a, b = rnd({ 4, 3 }), rnd({ 3, 5 })
    local ok, err = pcall(F.matmul_dgelu, a, b, false, false, rnd({ 5, 4 }))
    assert.is_false(ok)
    assert.matches('pre-activation must be f64 (4, 5)', err, 1, true)
    ok, err = pcall(F.matmul_gelu, a, b, false, false, rnd({ 3 }))
    assert.is_false(ok)
    assert.matches('vector of 5', err, 1, true)
  end)
end)

describe('swiglu (silu(gate) * up in one pass)', function()
  it('equals silu(gate) * up in f64, f32 and bf16, with broadcasting', function()
    for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
      local g = T.randn({ 5, 7 }, { seed = 7501 }):to(dt)
      local u = T.randn({ 5, 7 }, { seed = 7502 }):to(dt)
      local want = F.mul(F.silu(g:to('f64')), u:to('f64'))
      local got = F.swiglu(g, u)
      assert.are.equal(dt, got.dtype)
      local tol = ({ f64 = 1e-14, f32 = 1e-6, bf16 = 2e-2 })[dt]
      assert.is_true(F.sub(got:to('f64'), want):abs():max():item() <= tol, dt)
      local row = T.randn({ 7 }, { seed = 7503 }):to(dt)
      local b = F.swiglu(g, row)
      assert.are.same({ 5, 7 }, b.shape)
    end
  end)
end)

describe('native_add_layer_norm and native_layer_norm_backward_add (the residual add fused in)', function()
  local function maxdiff(a, b) return F.sub(a:to('f64'), b:to('f64')):abs():max():item() end
  it('equal the add and the norm apart, and the backward plus the residual gradient', function()
    for _, c in ipairs({ { 'f64', 'f64', nil, 1e-12 }, { 'f32', 'f32', nil, 1e-5 }, { 'f32', 'bf16', 'bf16', 2e-2 } }) do
      local x = T.randn({ 6, 24 }, { seed = 7601 }):to(c[1])
      local h = T.randn({ 6, 24 }, { seed = 7602 }):to(c[2])
      local w = T.randn({ 24 }, { seed = 7603 }):to(c[1])
      local b = T.randn({ 24 }, { seed = 7604 }):to(c[1])
      local res, y, mean, rstd = F.native_add_layer_norm(x, h, w, b, 1e-5, c[3])
      local r2 = F.add(x, h)
      local y2, m2, s2 = F.native_layer_norm(r2, w, b, 1e-5, c[3])
      assert.are.equal(r2.dtype, res.dtype)
      assert.are.equal(y2.dtype, y.dtype)
      assert.is_true(maxdiff(res, r2) == 0 and maxdiff(mean, m2) == 0 and maxdiff(rstd, s2) == 0, c[1])
      assert.is_true(maxdiff(y, y2) == 0, c[1])
      local g = T.randn({ 6, 24 }, { seed = 7605 }):to(c[3] or c[1])
      local gres = T.randn({ 6, 24 }, { seed = 7606 }):to(res.dtype)
      local dx, dw, db, none = F.native_layer_norm_backward_add(g, res, mean, rstd, w, gres)
      assert.is_nil(none)
      local dx2, dw2, db2 = F.native_layer_norm_backward(g, res, mean, rstd, w)
      assert.is_true(maxdiff(dx, F.add(dx2, gres)) <= c[4] * 10, c[1] .. ' dx')
      assert.is_true(maxdiff(dw, dw2) == 0 and maxdiff(db, db2) == 0)
      -- dxl: dx once more in g's dtype (h's gradient when h has g's dtype)
      local dx3, _, _, dxl = F.native_layer_norm_backward_add(g, res, mean, rstd, w, gres, { dxl = true })
      assert.are.equal(g.dtype, dxl.dtype)
      assert.is_true(maxdiff(dx3, dx) == 0 and maxdiff(dxl, dx:to(g.dtype)) == 0, c[1] .. ' dxl')
    end
  end)
  it('name shapes that do not fit', function()
    local ok, err = pcall(F.native_add_layer_norm, T.randn({ 2, 4 }), T.randn({ 2, 5 }))
    assert.is_false(ok)
    assert.matches('one shape', err, 1, true)
    local x = T.randn({ 2, 4 })
    local _, _, m, r = F.native_add_layer_norm(x, x)
    ok, err = pcall(F.native_layer_norm_backward_add, x, x, m, r, nil, T.randn({ 4, 2 }))
    assert.is_false(ok)
    assert.matches('residual gradient', err, 1, true)
  end)
end)

describe('native_add_rms_norm and native_rms_norm_backward_add', function()
  local function maxdiff(a, b) return F.sub(a:to('f64'), b:to('f64')):abs():max():item() end
  it('equal the add and the RMSNorm apart, and the backward plus the residual gradient', function()
    for _, c in ipairs({ { 'f64', 'f64', nil, 1e-12 }, { 'f32', 'f32', nil, 1e-5 }, { 'f32', 'bf16', 'bf16', 2e-2 } }) do
      local x = T.randn({ 5, 16 }, { seed = 7701 }):to(c[1])
      local h = T.randn({ 5, 16 }, { seed = 7702 }):to(c[2])
      local w = T.randn({ 16 }, { seed = 7703 }):to(c[1])
      local res, y, rstd = F.native_add_rms_norm(x, h, w, 1e-6, c[3])
      local r2 = F.add(x, h)
      local y2, s2 = F.native_rms_norm(r2, w, 1e-6, c[3])
      assert.is_true(maxdiff(res, r2) == 0 and maxdiff(rstd, s2) == 0 and maxdiff(y, y2) == 0, c[1])
      local g = T.randn({ 5, 16 }, { seed = 7704 }):to(c[3] or c[1])
      local gres = T.randn({ 5, 16 }, { seed = 7705 }):to(res.dtype)
      local dx, dw = F.native_rms_norm_backward_add(g, res, rstd, w, gres)
      local dx2, dw2 = F.native_rms_norm_backward(g, res, rstd, w)
      assert.is_true(maxdiff(dx, F.add(dx2, gres)) <= c[4] * 10, c[1] .. ' dx')
      assert.is_true(maxdiff(dw, dw2) == 0)
      local _, _, dxl = F.native_rms_norm_backward_add(g, res, rstd, w, gres, { dxl = true })
      assert.are.equal(g.dtype, dxl.dtype)
      assert.is_true(maxdiff(dxl, dx:to(g.dtype)) == 0, c[1] .. ' dxl')
    end
  end)
end)

describe('the column sums of dxl from the norm backward (dxl_sum: a bias gradient)', function()
  -- the f64 column sums of dxl's stored values; |got - want| within the
  -- output dtype's rounding of the sum plus f32 accumulation over the rows
  local function check(dls, dxl, what)
    local C = dxl.shape[#dxl.shape]
    local n = numel_of(dxl.shape) / C
    assert.are.same({ C }, dls.shape)
    assert.are.equal(dxl.dtype, dls.dtype, what)
    local v, got = vals(dxl), vals(dls)
    local rel = dls.dtype == 'f32' and 2 ^ -24 or 2 ^ -8
    local nonzero = 0
    for c = 1, C do
      local want, mag = 0, 0
      for r = 0, n - 1 do
        want = want + v[r * C + c]
        mag = mag + math.abs(v[r * C + c])
      end
      local tol = rel * math.abs(want) + 1e-6 * mag
      assert.is_true(math.abs(got[c] - want) <= tol,
        ('%s: column %d: %.9g vs %.9g (tolerance %.3g)'):format(what, c, got[c], want, tol))
      if got[c] ~= 0 then nonzero = nonzero + 1 end
    end
    assert.is_true(nonzero == C, what .. ': a zero column sum')
  end
  it('are the f64 column sums of dxl (LayerNorm, RMSNorm; f32 and bf16 g)', function()
    for _, c in ipairs({ { 'f32', 'f32' }, { 'f32', 'bf16' }, { 'bf16', 'bf16' }, { 'f64', 'f64' } }) do
      local sh = { 3, 13, 40 }
      local x = T.randn(sh, { seed = 7801 }):to(c[1])
      local h = T.randn(sh, { seed = 7802 }):to(c[1])
      local w = T.randn({ 40 }, { seed = 7803 }):to(c[1])
      local b = T.randn({ 40 }, { seed = 7804 }):to(c[1])
      local g = T.randn(sh, { seed = 7805 }):to(c[2])
      local gres = T.randn(sh, { seed = 7806 }):to(c[1])
      local what = c[1] .. ' x, ' .. c[2] .. ' g'
      local res, _, mean, rstd = F.native_add_layer_norm(x, h, w, b, 1e-5)
      local dx, dw, db, dxl, dls = F.native_layer_norm_backward_add(g, res, mean, rstd, w, gres,
        { dxl = true, dxl_sum = true })
      check(dls, dxl, 'layer_norm, ' .. what)
      -- the other outputs as without the sums
      local dx2, dw2, db2, dxl2 = F.native_layer_norm_backward_add(g, res, mean, rstd, w, gres, { dxl = true })
      assert.are.same(vals(dx2), vals(dx))
      assert.are.same(vals(dw2), vals(dw))
      assert.are.same(vals(db2), vals(db))
      assert.are.same(vals(dxl2), vals(dxl))
      local rres, _, rrstd = F.native_add_rms_norm(x, h, w, 1e-6)
      local _, _, rdxl, rdls = F.native_rms_norm_backward_add(g, rres, rrstd, w, gres, { dxl = true, dxl_sum = true })
      check(rdls, rdxl, 'rms_norm, ' .. what)
      -- without a residual gradient too
      local _, _, _, dxl3, dls3 = F.native_layer_norm_backward_add(g, res, mean, rstd, w, nil,
        { dxl = true, dxl_sum = true })
      check(dls3, dxl3, 'layer_norm without gres, ' .. what)
    end
  end)
  it('fill a given output, and are refused without dxl', function()
    local x, g = T.randn({ 4, 8 }, { seed = 7811 }), T.randn({ 4, 8 }, { seed = 7812 })
    local res, _, m, r = F.native_add_layer_norm(x, x)
    local ok, err = pcall(F.native_layer_norm_backward_add, g, res, m, r, nil, x, { dxl_sum = true })
    assert.is_false(ok)
    assert.matches('without that dx', err, 1, true)
    local box = ffi.new('ms_tensor*[1]')
    local out = T.zeros({ 8 }, { dtype = 'bf16' })
    box[0] = out
    local dxl = ffi.new('ms_tensor*[1]')
    assert.are.equal(-1, C.ms_layer_norm_backward_add(nil, nil, nil, g, res, m, r, nil, x, dxl, box))
    assert.matches('without dx', ffi.string(C.ms_last_error()), 1, true)
    local dx = ffi.new('ms_tensor*[1]')
    -- g f32: a bf16 box is the wrong dtype
    assert.are.equal(-1, C.ms_layer_norm_backward_add(dx, nil, nil, g, res, m, r, nil, x, dxl, box))
    local good = T.zeros({ 8 })
    box[0] = good
    assert.are.equal(0, C.ms_layer_norm_backward_add(dx, nil, nil, g, res, m, r, nil, x, dxl, box))
    T.wrap(dx[0]):free()
    check(good, T.wrap(dxl[0]), 'a given output')
  end)
end)
