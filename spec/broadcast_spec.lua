-- numpy broadcasting in the elementwise ops: hand-worked shapes, scalars and
-- 0-dim tensors, size-0 dims, expanded (stride 0), transposed and narrowed
-- inputs, in-place forms, and random shapes of up to 6 dims against a plain
-- Lua reference of the index mapping.
local T = require 'moonshard.tensor'
local F = require 'moonshard.ops'
local C = T.C

-- ------------------------------------------------------------------ helpers

local S = require 'spec.support'
local make, vals, numel_of = S.make, S.vals, S.numel_of

local function seq(n, start, step)
  local r = {}
  for i = 1, n do r[i] = (start or 1) + (i - 1) * (step or 1) end
  return r
end

local function randoms(n)
  local r = {}
  for i = 1, n do r[i] = math.random() * 4 - 2 end
  return r
end

local function assert_values(got, want, tol, what)
  what = what or 'values'
  if #got ~= #want then error(('%s: %d values, expected %d'):format(what, #got, #want), 2) end
  for i = 1, #want do
    if not (math.abs(got[i] - want[i]) <= (tol or 0) * math.max(1, math.abs(want[i]))) then
      error(('%s: element %d is %.17g, expected %.17g'):format(what, i, got[i], want[i]), 2)
    end
  end
end

local function expect_error(fn, needle)
  local ok, err = pcall(fn)
  assert.is_false(ok, 'expected an error containing: ' .. needle)
  if not tostring(err):find(needle, 1, true) then
    error(('error message %q does not contain %q'):format(tostring(err), needle), 2)
  end
end

-- the broadcast shape of two shapes (nil when they do not broadcast)
local function broadcast_shape(a, b)
  local n = math.max(#a, #b)
  local out = {}
  for i = 1, n do
    local x = a[#a - n + i] or 1
    local y = b[#b - n + i] or 1
    if x ~= y and x ~= 1 and y ~= 1 then return nil end
    out[i] = x == 1 and y or x
  end
  return out
end

-- the row-major position in an input of `ishape` that feeds element k
-- (0-based, row-major) of the broadcast result `oshape`
local function source_index(oshape, ishape, k)
  local idx = {}
  for d = #oshape, 1, -1 do
    idx[d] = k % oshape[d]
    k = math.floor(k / oshape[d])
  end
  local pos, stride = 0, 1
  for d = #ishape, 1, -1 do
    local od = #oshape - #ishape + d
    local i = ishape[d] == 1 and 0 or idx[od]
    pos = pos + i * stride
    stride = stride * ishape[d]
  end
  return pos
end

local function ref_binary(av, ashape, bv, bshape, fn)
  local oshape = broadcast_shape(ashape, bshape)
  local out = {}
  for k = 0, numel_of(oshape) - 1 do
    out[k + 1] = fn(av[source_index(oshape, ashape, k) + 1], bv[source_index(oshape, bshape, k) + 1])
  end
  return out, oshape
end

-- the same logical tensor with its dims reversed in memory
local function noncontig(t)
  local n = t.ndim
  if n < 2 then return t end
  local rshape, perm = {}, {}
  for i = 1, n do rshape[i] = t.shape[n + 1 - i]; perm[i] = n + 1 - i end
  local v = T.empty(rshape, { dtype = t.dtype }):permute(perm)
  v:copy_(t)
  return v
end

-- ======================================================================
describe('broadcasting', function()
  it('(3,1) with (1,4) gives (3,4)', function()
    local a = make({ 3, 1 }, { 1, 2, 3 })
    local b = make({ 1, 4 }, { 10, 20, 30, 40 })
    local y = F.add(a, b)
    assert.are.same({ 3, 4 }, y.shape)
    assert_values(vals(y), { 11, 21, 31, 41, 12, 22, 32, 42, 13, 23, 33, 43 })
    local z = F.mul(b, a)
    assert_values(vals(z), { 10, 20, 30, 40, 20, 40, 60, 80, 30, 60, 90, 120 })
  end)

  it('aligns missing leading dims: (4) with (2,3,4)', function()
    local a = make({ 2, 3, 4 }, seq(24))
    local b = make({ 4 }, { 100, 200, 300, 400 })
    local y = F.sub(a, b)
    assert.are.same({ 2, 3, 4 }, y.shape)
    local want = {}
    for i = 1, 24 do want[i] = i - 100 * ((i - 1) % 4 + 1) end
    assert_values(vals(y), want)
  end)

  it('treats 0-dim tensors and Lua numbers as scalars', function()
    local s = T.full({}, 2, { dtype = 'f64' })
    local a = make({ 2, 3 }, seq(6))
    assert.are.same({ 2, 3 }, F.mul(s, a).shape)
    assert_values(vals(F.mul(s, a)), { 2, 4, 6, 8, 10, 12 })
    assert_values(vals(F.div(a, s)), { 0.5, 1, 1.5, 2, 2.5, 3 })
    local ss = F.add(s, T.full({}, 5, { dtype = 'f64' }))
    assert.are.same({}, ss.shape)
    assert_values(vals(ss), { 7 })
    assert_values(vals(F.pow(s, 3)), { 8 })
    assert.are.same({}, F.gt(s, 1).shape)
    assert_values(vals(F.sub(1, s)), { -1 })
  end)

  it('handles size-0 dims', function()
    local e = T.empty({ 0, 3 }, { dtype = 'f32' })
    local r = make({ 1, 3 }, { 1, 2, 3 }, 'f32')
    local y = F.add(e, r)
    assert.are.same({ 0, 3 }, y.shape)
    assert.are.same({ 0, 3 }, F.add(r, e).shape)
    assert.are.same({ 0 }, F.mul(T.empty({ 0 }), make({ 1 }, { 5 }, 'f32')).shape)
    assert.are.same({ 2, 0 }, F.add(T.empty({ 2, 1 }), T.empty({ 0 })).shape)
    assert.are.same({ 0, 3 }, F.exp(e).shape)
    assert.are.same({ 0, 3 }, F.add(e, 1).shape)
    expect_error(function() F.add(e, make({ 2, 3 }, seq(6), 'f32')) end, 'add: shapes (0,3) and (2,3) cannot be broadcast')
  end)

  it('reads expanded inputs (stride 0) on either side', function()
    local col = make({ 3, 1 }, { 1, 2, 3 })
    local ex = col:expand(3, 4)
    assert.are.equal(0, ex:stride(2))
    local row = make({ 4 }, { 1, 10, 100, 1000 }):expand(3, 4)
    local y = F.mul(ex, row)
    assert_values(vals(y), { 1, 10, 100, 1000, 2, 20, 200, 2000, 3, 30, 300, 3000 })
    local z = F.add(ex, make({ 1 }, { 0.5 }))
    assert_values(vals(z), { 1.5, 1.5, 1.5, 1.5, 2.5, 2.5, 2.5, 2.5, 3.5, 3.5, 3.5, 3.5 })
    local s = T.full({}, 7, { dtype = 'f64' }):expand(2, 2)
    assert_values(vals(F.sub(s, make({ 2, 2 }, { 1, 2, 3, 4 }))), { 6, 5, 4, 3 })
  end)

  it('reads transposed and narrowed inputs', function()
    local base = make({ 4, 5 }, seq(20))
    local tr = base:t()                       -- (5,4)
    local nar = base:narrow(2, 2, 3)          -- (4,3), row stride 5
    local y = F.add(tr, make({ 4 }, { 0, 100, 200, 300 }))
    local want = {}
    for i = 0, 4 do for j = 0, 3 do want[#want + 1] = (j * 5 + i + 1) + 100 * j end end
    assert_values(vals(y), want, 0, 'transposed')
    local z = F.mul(nar, make({ 4, 1 }, { 1, -1, 1, -1 }))
    local want2 = {}
    for i = 0, 3 do for j = 1, 3 do want2[#want2 + 1] = (i * 5 + j + 1) * (i % 2 == 0 and 1 or -1) end end
    assert_values(vals(z), want2, 0, 'narrowed')
    local w = F.maximum(nar:t(), tr:narrow(1, 2, 3))  -- both strided, (3,4)
    local bw, want3 = vals(base), {}
    for i = 0, 2 do for j = 0, 3 do
      want3[#want3 + 1] = math.max(bw[j * 5 + i + 2], bw[j * 5 + i + 2])
    end end
    assert_values(vals(w), want3, 0, 'both strided')
  end)

  it('writes in place into the larger operand only', function()
    local a = make({ 2, 3 }, seq(6))
    a:add_(make({ 3 }, { 10, 20, 30 }))
    assert_values(vals(a), { 11, 22, 33, 14, 25, 36 })
    a:mul_(make({ 2, 1 }, { 2, 0 }))
    assert_values(vals(a), { 22, 44, 66, 0, 0, 0 })
    -- into a transposed view of a bigger tensor
    local base = T.zeros({ 3, 2 }, { dtype = 'f64' })
    base:t():add_(make({ 3 }, { 1, 2, 3 }))
    assert_values(vals(base), { 1, 1, 2, 2, 3, 3 })
    expect_error(function() make({ 3 }, { 1, 2, 3 }):add_(make({ 2, 3 }, seq(6))) end,
      'add_: out is f64 (3) cpu, expected f64 (2,3) cpu')
  end)

  it('broadcasts comparisons, where and the backward helpers', function()
    local a = make({ 3, 1 }, { 1, 2, 3 })
    local b = make({ 3 }, { 2, 2, 2 })
    local lt = F.lt(a, b)
    assert.are.equal('bool', lt.dtype)
    assert.are.same({ 3, 3 }, lt.shape)
    assert_values(vals(lt), { 1, 1, 1, 0, 0, 0, 0, 0, 0 })
    local w = F.where(lt, make({ 1 }, { -1 }), make({ 3, 1 }, { 7, 8, 9 }))
    assert_values(vals(w), { -1, -1, -1, 8, 8, 8, 9, 9, 9 })
    local g = F.relu_backward(make({ 2, 1 }, { -1, 1 }), make({ 3 }, { 5, 6, 7 }))
    assert_values(vals(g), { 0, 0, 0, 5, 6, 7 })
  end)

  it('broadcasts low-precision operands with the same rounding as contiguous ones', function()
    math.randomseed(5)
    local a = make({ 4, 1, 3 }, randoms(12), 'bf16')
    local b = make({ 5, 1 }, randoms(5), 'bf16')
    local y = F.mul(a, b)
    assert.are.equal('bf16', y.dtype)
    local full_a = a:expand(4, 5, 3):contiguous()
    local full_b = b:expand(4, 5, 3):contiguous()
    assert_values(vals(y), vals(F.mul(full_a, full_b)), 0, 'bf16 broadcast vs materialised')
    local h = F.add(make({ 3 }, { 1, 2, 3 }, 'f16'), make({ 2, 1 }, { 0.5, 0.25 }, 'bf16'))
    assert.are.equal('f32', h.dtype)
    assert_values(vals(h), { 1.5, 2.5, 3.5, 1.25, 2.25, 3.25 })
  end)

  it('matches the Lua reference on random shapes of up to 6 dims', function()
    math.randomseed(77)
    local fns = {
      add = function(x, y) return x + y end, mul = function(x, y) return x * y end,
      maximum = function(x, y) return math.max(x, y) end, ge = function(x, y) return x >= y and 1 or 0 end,
      sub = function(x, y) return x - y end,
    }
    for trial = 1, 60 do
      local nd = math.random(0, 6)
      local full = {}
      for d = 1, nd do full[d] = math.random(1, 4) end
      local function variant()
        local drop = math.random(0, nd)
        local s = {}
        for d = drop + 1, nd do s[#s + 1] = (math.random() < 0.4) and 1 or full[d] end
        return s
      end
      local sa, sb = variant(), variant()
      local av, bv = randoms(numel_of(sa)), randoms(numel_of(sb))
      local a, b = make(sa, av), make(sb, bv)
      if trial % 2 == 0 then a = noncontig(a) end
      if trial % 3 == 0 then b = noncontig(b) end
      for name, fn in pairs(fns) do
        local want, oshape = ref_binary(av, sa, bv, sb, fn)
        local y = F[name](a, b)
        assert.are.same(oshape, y.shape, name .. ' shape')
        assert_values(vals(y), want, 0,
          ('%s (%s) with (%s)'):format(name, table.concat(sa, ','), table.concat(sb, ',')))
      end
      -- the same with f32 operands (exact for these ops up to one rounding)
      local y32 = F.add(a:to('f32'), b:to('f32'))
      local want32 = ref_binary(vals(a:to('f32')), sa, vals(b:to('f32')), sb, fns.add)
      assert_values(vals(y32), want32, 2 ^ -23, 'f32 add')
    end
  end)

  it('is large enough to use several threads and still agree with the reference', function()
    math.randomseed(78)
    local av, bv = randoms(300 * 1), randoms(1 * 400)
    local a, b = make({ 300, 1 }, av, 'f32'), make({ 1, 400 }, bv, 'f32')
    local y = F.add(a, b)
    local got, av32, bv32 = vals(y), vals(a), vals(b)
    for i = 0, 299, 37 do
      for j = 0, 399, 41 do
        local want = av32[i + 1] + bv32[j + 1]
        assert(math.abs(got[i * 400 + j + 1] - want) <= 2 ^ -22 * math.abs(want) + 1e-7)
      end
    end
  end)

  it('names the op and both shapes when shapes do not broadcast', function()
    expect_error(function() F.mul(make({ 2, 3 }, seq(6)), make({ 4, 3 }, seq(12))) end,
      'mul: shapes (2,3) and (4,3) cannot be broadcast')
    expect_error(function() F.where(F.gt(make({ 2 }, { 1, 2 }), 1), make({ 3 }, seq(3)), 0) end,
      'where: shapes (2) and (3) cannot be broadcast')
    expect_error(function() F.maximum(make({ 5 }, seq(5)), make({ 2, 4 }, seq(8))) end,
      'maximum: shapes (5) and (2,4) cannot be broadcast')
  end)
end)
