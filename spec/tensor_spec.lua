-- The tensor layer (core/tensor.c, lua/moonshard/tensor.lua): constructors,
-- properties, views writing through to their base, copies, conversions,
-- host access, printing and memory.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local ffi = require 'ffi'

-- random values, never zero, exactly representable in f32
local function rnd()
  local v = math.random(1, 2 ^ 12) / 2 ^ 6
  return math.random() < 0.5 and -v or v
end
local function rand_table(shape, d)
  d = d or 1
  local r = {}
  for i = 1, shape[d] do
    if d == #shape then r[i] = rnd() else r[i] = rand_table(shape, d + 1) end
  end
  return r
end
local function deepcopy(t)
  if type(t) ~= 'table' then return t end
  local r = {}
  for k, v in pairs(t) do r[k] = deepcopy(v) end
  return r
end
local function errmsg(f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, 'expected an error')
  return tostring(err)
end

describe('tensor', function()
  math.randomseed(42)

  describe('constructors', function()
    it('ms.tensor from a nested table: shape, f32 by default, values', function()
      local data = rand_table({ 2, 3, 4 })
      local t = ms.tensor(data)
      assert.are.same({ 2, 3, 4 }, t.shape)
      assert.are.equal('f32', t.dtype)
      assert.are.equal('cpu', t.device)
      assert.are.equal(24, t:numel())
      assert.are.equal(3, t:dim())
      assert.are.same(data, t:totable())
      assert.are.equal(data[2][3][4], t:get(2, 3, 4))
    end)

    it('ms.tensor from a number or a boolean is 0-d', function()
      local t = ms.tensor(2.5)
      assert.are.same({}, t.shape)
      assert.are.equal(0, t:dim())
      assert.are.equal(1, t:numel())
      assert.are.equal(2.5, t:item())
      local b = ms.tensor(true)
      assert.are.equal('bool', b.dtype)
      assert.are.equal(true, b:item())
    end)

    it('ms.tensor of booleans is a bool tensor', function()
      local t = ms.tensor({ { true, false }, { false, true } })
      assert.are.equal('bool', t.dtype)
      assert.are.same({ { true, false }, { false, true } }, t:totable())
    end)

    it('ms.tensor honours dtype (names and aliases) and rounds to the dtype', function()
      local cases = {
        { 'f64', 0.1, 0.1 },
        { 'float64', 0.1, 0.1 },
        { 'f32', 0.1, tonumber(ffi.new('float', 0.1)) },
        { 'float', 0.1, tonumber(ffi.new('float', 0.1)) },
        { 'bf16', 1 + 2 ^ -7, 1 + 2 ^ -7 },
        { 'bf16', 1 + 2 ^ -9, 1 },
        { 'half', 1 + 2 ^ -10, 1 + 2 ^ -10 },
        { 'f16', 1 + 2 ^ -12, 1 },
        { 'i64', 2 ^ 40 + 3, 2 ^ 40 + 3 },
        { 'long', -7, -7 },
        { 'i32', -123456, -123456 },
        { 'u8', 200, 200 },
        { 'bool', 3, true },
      }
      for _, c in ipairs(cases) do
        local t = ms.tensor({ c[2] }, { dtype = c[1] })
        assert.are.equal(c[3], t:totable()[1], c[1])
      end
      assert.are.equal('f64', ms.tensor({ 1 }, { dtype = 'double' }).dtype)
      assert.are.equal('i32', ms.tensor({ 1 }, { dtype = 'int' }).dtype)
      assert.are.equal('u8', ms.tensor({ 1 }, { dtype = 'byte' }).dtype)
    end)

    it('ms.tensor of a tensor is an independent copy, optionally converted', function()
      local a = ms.tensor({ 1.5, -2.5 })
      local b = ms.tensor(a)
      local c = ms.tensor(a, { dtype = 'f64' })
      a:set(1, 9)
      assert.are.same({ 1.5, -2.5 }, b:totable())
      assert.are.equal('f64', c.dtype)
      assert.are.same({ 1.5, -2.5 }, c:totable())
    end)

    it('ms.tensor with device = "cpu"', function()
      assert.are.equal('cpu', ms.tensor({ 1, 2 }, { device = 'cpu' }).device)
    end)

    it('ragged nested tables are errors that say where', function()
      local e = errmsg(ms.tensor, { { 1, 2 }, { 3 } })
      assert.matches('ragged', e, 1, true)
      assert.matches('data[2]', e, 1, true)
      e = errmsg(ms.tensor, { { 1, 2 }, 3 })
      assert.matches('ragged', e, 1, true)
      e = errmsg(ms.tensor, { 1, { 2 } })
      assert.matches('ragged', e, 1, true)
      e = errmsg(ms.tensor, { { 1, 'x' } })
      assert.matches('data[1][2] is a string', e, 1, true)
      e = errmsg(ms.tensor, 'abc')
      assert.matches('expected a number, boolean or nested table', e, 1, true)
    end)

    it('zeros, ones, full: shape, dtype, device, values', function()
      local z = ms.zeros({ 2, 3 })
      assert.are.same({ 2, 3 }, z.shape)
      assert.are.equal('f32', z.dtype)
      assert.are.same({ { 0, 0, 0 }, { 0, 0, 0 } }, z:totable())
      local o = ms.ones({ 4 }, { dtype = 'i32' })
      assert.are.equal('i32', o.dtype)
      assert.are.same({ 1, 1, 1, 1 }, o:totable())
      local f = ms.full({ 2, 2 }, -3.25, { dtype = 'f64', device = 'cpu' })
      assert.are.same({ { -3.25, -3.25 }, { -3.25, -3.25 } }, f:totable())
      assert.are.equal('cpu', f.device)
      local b = ms.full({ 3 }, 1, { dtype = 'bool' })
      assert.are.same({ true, true, true }, b:totable())
      local bf = ms.full({ 2 }, 1 + 2 ^ -9, { dtype = 'bf16' })  -- rounds to even
      assert.are.same({ 1, 1 }, bf:totable())
      local s = ms.zeros({})
      assert.are.same({}, s.shape)
      assert.are.equal(1, s:numel())
      local e = ms.zeros({ 3, 0 })
      assert.are.equal(0, e:numel())
      assert.are.same({ {}, {}, {} }, e:totable())
    end)

    it('zeros_like / ones_like / empty_like keep shape, dtype and device', function()
      local a = ms.tensor({ { 1, 2, 3 } }, { dtype = 'f64' })
      local z, o, e = ms.zeros_like(a), ms.ones_like(a), ms.empty_like(a)
      for _, t in ipairs({ z, o, e }) do
        assert.are.same({ 1, 3 }, t.shape)
        assert.are.equal('f64', t.dtype)
      end
      assert.are.same({ { 0, 0, 0 } }, z:totable())
      assert.are.same({ { 1, 1, 1 } }, o:totable())
      assert.are.equal('i64', ms.zeros_like(a, { dtype = 'i64' }).dtype)
    end)

    it('arange: stop / start, stop / start, stop, step; integer steps give i64', function()
      local a = ms.arange(5)
      assert.are.equal('i64', a.dtype)
      assert.are.same({ 0, 1, 2, 3, 4 }, a:totable())
      assert.are.same({ 2, 4, 6 }, ms.arange(2, 8, 2):totable())
      assert.are.same({ 2, 4, 6, 8 }, ms.arange(2, 9, 2):totable())
      assert.are.same({ 3, 2, 1 }, ms.arange(3, 0, -1):totable())
      local f = ms.arange(0, 1, 0.25)
      assert.are.equal('f32', f.dtype)
      assert.are.same({ 0, 0.25, 0.5, 0.75 }, f:totable())
      local d = ms.arange(4, { dtype = 'f64' })
      assert.are.equal('f64', d.dtype)
      assert.are.same({ 0, 1, 2, 3 }, d:totable())
      assert.are.same({ 5, 6 }, ms.arange(5, 7, { dtype = 'i32' }):totable())
      assert.are.equal(0, ms.arange(3, 3):numel())
      assert.are.equal(0, ms.arange(3, 1):numel())
    end)

    it('empty: shape and dtype (contents unspecified)', function()
      local e = ms.empty({ 3, 2 }, { dtype = 'u8' })
      assert.are.same({ 3, 2 }, e.shape)
      assert.are.equal('u8', e.dtype)
      assert.are.equal(1, e:element_size())
      assert.are.equal(8, ms.empty({ 1 }, { dtype = 'f64' }):element_size())
    end)

    it('shape is a fresh Lua table; size(d), stride, #t, is_contiguous', function()
      local t = ms.zeros({ 2, 3, 4 })
      local s = t.shape
      s[1] = 99
      assert.are.same({ 2, 3, 4 }, t.shape)
      assert.are.equal(3, t:size(2))
      assert.are.equal(4, t:size(-1))
      assert.are.same({ 12, 4, 1 }, t:stride())
      assert.are.equal(4, t:stride(2))
      assert.are.equal(2, #t)
      assert.is_true(t:is_contiguous())
      assert.is_false(t:transpose(1, 3):is_contiguous())
      -- no element: contiguous whatever the strides (as torch)
      assert.is_true(ms.zeros({ 4, 5 }):narrow(2, 3, 0):is_contiguous())
      assert.is_true(ms.zeros({ 4, 5 }):transpose(1, 2):narrow(1, 1, 0):is_contiguous())
      assert.is_true(t:is_floating_point())
      assert.is_false(ms.zeros({ 1 }, { dtype = 'i32' }):is_floating_point())
    end)
  end)

  describe('views write through to the base', function()
    local base_data, base
    before_each(function()
      base_data = rand_table({ 4, 6 })
      base = ms.tensor(base_data)
    end)

    it('view: same storage, row-major reinterpretation', function()
      local v = base:view(3, 8)
      assert.are.same({ 3, 8 }, v.shape)
      -- element (2, 3) of the (3,8) view is flat index 8 + 2 = 10 -> base (2, 5)
      assert.are.equal(base_data[2][5], v:get(2, 3))
      v:set(2, 3, 77.5)
      assert.are.equal(77.5, base:get(2, 5))
      local w = base:view({ -1, 4 })
      assert.are.same({ 6, 4 }, w.shape)
      w:set(6, 4, -1.25)
      assert.are.equal(-1.25, base:get(4, 6))
      base:set(1, 1, 3.5)
      assert.are.equal(3.5, v:get(1, 1))
      assert.are.equal(3.5, w:get(1, 1))
    end)

    it('reshape of a contiguous tensor is a view; of a transposed one a copy', function()
      local r = base:reshape(2, 12)
      r:set(2, 1, 11.5)
      assert.are.equal(11.5, base:get(3, 1))
      local tr = base:t()
      local c = tr:reshape(24)
      -- row-major order of the transpose: base column 1, then column 2, ...
      local want = {}
      for j = 1, 6 do for i = 1, 4 do want[#want + 1] = base:get(i, j) end end
      assert.are.same(want, c:totable())
      c:fill_(0)
      assert.are.equal(11.5, base:get(3, 1))  -- the copy does not write through
    end)

    it('reshape of a transposed tensor that can be a view is one', function()
      -- (4,6) -> t (6,4) -> split the leading dim: (2,3,4) is viewable
      local v = base:t():reshape(2, 3, 4)
      v:set(2, 1, 3, 5.5)  -- t row 4, col 3 -> base (3, 4)
      assert.are.equal(5.5, base:get(3, 4))
    end)

    it('narrow: a window of rows or columns, with copy_ and fill writing through', function()
      local n = base:narrow(1, 2, 2)
      assert.are.same({ 2, 6 }, n.shape)
      assert.are.same({ base_data[2], base_data[3] }, n:totable())
      n:copy_(ms.tensor({ { 1, 2, 3, 4, 5, 6 }, { 7, 8, 9, 10, 11, 12 } }))
      local want = deepcopy(base_data)
      want[2] = { 1, 2, 3, 4, 5, 6 }
      want[3] = { 7, 8, 9, 10, 11, 12 }
      assert.are.same(want, base:totable())
      local c = base:narrow(2, -2, 2)  -- the last two columns
      c:fill_(-4)
      for i = 1, 4 do
        want[i][5], want[i][6] = -4, -4
      end
      assert.are.same(want, base:totable())
      assert.are.same({ 4, 0 }, base:narrow(2, 3, 0).shape)
    end)

    it('select: a row or a column, one dim fewer', function()
      local row = base:select(1, 3)
      assert.are.same({ 6 }, row.shape)
      assert.are.same(base_data[3], row:totable())
      local col = base:select(2, -1)
      assert.are.same({ 4 }, col.shape)
      col:copy_(ms.tensor({ 1, 2, 3, 4 }))
      for i = 1, 4 do assert.are.equal(i, base:get(i, 6)) end
      row:copy_(9)  -- a number fills
      for j = 1, 6 do assert.are.equal(9, base:get(3, j)) end
    end)

    it('transpose and t(): swapped strides over the same storage', function()
      local tr = base:transpose(1, 2)
      assert.are.same({ 6, 4 }, tr.shape)
      assert.are.same({ 1, 6 }, tr:stride())
      for i = 1, 4 do for j = 1, 6 do assert.are.equal(base_data[i][j], tr:get(j, i)) end end
      tr:set(5, 2, 123)
      assert.are.equal(123, base:get(2, 5))
      local tt = base:t():t()
      assert.are.same(base:totable(), tt:totable())
      assert.are.same(base:transpose(-1, -2):totable(), tr:totable())
    end)

    it('permute: dims reordered, writes land at the permuted place', function()
      local d = rand_table({ 2, 3, 4 })
      local x = ms.tensor(d)
      local p = x:permute(3, 1, 2)
      assert.are.same({ 4, 2, 3 }, p.shape)
      for i = 1, 2 do for j = 1, 3 do for k = 1, 4 do
        assert.are.equal(d[i][j][k], p:get(k, i, j))
      end end end
      p:set(4, 2, 1, 0.75)
      assert.are.equal(0.75, x:get(2, 1, 4))
      assert.are.same(x:permute({ 3, 1, 2 }):totable(), p:totable())
    end)

    it('expand: a size-1 dim repeats with stride 0; a write shows in every repeat', function()
      local r = ms.tensor({ { 1.5, -2, 3 } })
      local e = r:expand(4, 3)
      assert.are.same({ 4, 3 }, e.shape)
      assert.are.same({ 0, 1 }, e:stride())
      for i = 1, 4 do assert.are.same({ 1.5, -2, 3 }, e:totable()[i]) end
      e:set(3, 2, 8)
      assert.are.equal(8, r:get(1, 2))
      assert.are.equal(8, e:get(1, 2))
      assert.are.equal(8, e:get(4, 2))
      -- new leading dims and -1 (keep)
      local e2 = r:expand(2, -1, 3)
      assert.are.same({ 2, 1, 3 }, e2.shape)
      assert.are.same(e2:totable()[1], e2:totable()[2])
      assert.are.same({ 4, 3 }, r:expand_as(ms.zeros({ 4, 3 })).shape)
    end)

    it('squeeze / unsqueeze', function()
      local x = ms.tensor({ { { 1.5, 2, 3, 4 } }, { { 5, 6, 7, 8 } }, { { 9, 10, 11, 12 } } })  -- (3,1,4)
      assert.are.same({ 3, 4 }, x:squeeze().shape)
      assert.are.same({ 3, 4 }, x:squeeze(2).shape)
      assert.are.same({ 3, 1, 4 }, x:squeeze(1).shape)  -- not size 1: unchanged
      assert.are.same({ 1, 3, 1, 4 }, x:unsqueeze(1).shape)
      assert.are.same({ 3, 1, 4, 1 }, x:unsqueeze(-1).shape)
      assert.are.same({ 3, 1, 1, 4 }, x:unsqueeze(3).shape)
      local s = x:squeeze()
      s:set(2, 3, -6)
      assert.are.equal(-6, x:get(2, 1, 3))
      local u = x:unsqueeze(1)
      u:set(1, 3, 1, 4, 42)
      assert.are.equal(42, x:get(3, 1, 4))
      assert.are.same({}, ms.tensor({ { 5 } }):squeeze().shape)
    end)

    it('flatten: all dims or a range; a view when possible', function()
      local d = rand_table({ 2, 3, 4 })
      local x = ms.tensor(d)
      local f = x:flatten()
      assert.are.same({ 24 }, f.shape)
      f:set(24, 0.5)
      assert.are.equal(0.5, x:get(2, 3, 4))
      local g = x:flatten(2, 3)
      assert.are.same({ 2, 12 }, g.shape)
      g:set(2, 5, -0.5)  -- (2, 2, 1)
      assert.are.equal(-0.5, x:get(2, 2, 1))
      assert.are.same({ 6, 4 }, x:flatten(1, 2).shape)
      assert.are.same({ 1 }, ms.tensor(3):flatten().shape)
      -- of a permuted tensor: values in the permuted order
      local p = x:permute(3, 2, 1):flatten()
      local want = {}
      for k = 1, 4 do for j = 1, 3 do for i = 1, 2 do want[#want + 1] = d[i][j][k] end end end
      want[24] = 0.5  -- written above through f
      want[(1 - 1) * 6 + (2 - 1) * 2 + 2] = -0.5  -- x(2, 2, 1), written through g
      assert.are.same(want, p:totable())
    end)

    it('views of views keep the storage offset right', function()
      local v = base:narrow(1, 2, 3):narrow(2, 3, 3):t()  -- base rows 2..4, cols 3..5, transposed
      assert.are.same({ 3, 3 }, v.shape)
      assert.are.equal(base_data[4][3], v:get(1, 3))
      v:set(3, 1, 6.5)  -- base (2, 5)
      assert.are.equal(6.5, base:get(2, 5))
      assert.are.equal(1 * 6 + 2, base:narrow(1, 2, 3):narrow(2, 3, 3):storage_offset())
    end)
  end)

  describe('copies', function()
    it('contiguous of a contiguous tensor is the tensor itself; of a view, an independent copy', function()
      local x = ms.tensor(rand_table({ 3, 4 }))
      assert.is_true(rawequal(x, x:contiguous()))
      local tr = x:t()
      local c = tr:contiguous()
      assert.is_true(c:is_contiguous())
      assert.are.same({ 3, 1 }, c:stride())
      assert.are.same(tr:totable(), c:totable())
      c:set(1, 1, 1000)
      assert.are_not.equal(1000, x:get(1, 1))
    end)

    it('clone is independent in both directions', function()
      local d = rand_table({ 2, 5 })
      local x = ms.tensor(d)
      local c = x:clone()
      assert.are.same(d, c:totable())
      c:set(1, 1, 55)
      x:set(2, 2, 66)
      assert.are.equal(d[1][1], x:get(1, 1))
      assert.are.equal(d[2][2], c:get(2, 2))
      local cv = x:narrow(2, 2, 3):clone()
      assert.are.same({ 2, 3 }, cv.shape)
      assert.is_true(cv:is_contiguous())
      assert.are.equal(0, cv:storage_offset())
    end)

    it('copy_ broadcasts and converts dtypes', function()
      local dst = ms.zeros({ 3, 2 }, { dtype = 'f64' })
      dst:copy_(ms.tensor({ 1.5, -2 }))
      assert.are.same({ { 1.5, -2 }, { 1.5, -2 }, { 1.5, -2 } }, dst:totable())
      local di = ms.zeros({ 2 }, { dtype = 'i32' })
      di:copy_(ms.tensor({ 2.75, -2.75 }))
      assert.are.same({ 2, -2 }, di:totable())
    end)

    it('to(dtype): conversions truncate to integers, test nonzero for bool', function()
      local x = ms.tensor({ 2.75, -2.75, 0.5, 0 })
      assert.are.same({ 2, -2, 0, 0 }, x:to('i64'):totable())
      assert.are.same({ 2, -2, 0, 0 }, x:to('i32'):totable())
      assert.are.same({ true, true, true, false }, x:to('bool'):totable())
      assert.are.same({ 2.75, -2.75, 0.5, 0 }, x:to('f64'):totable())
      assert.are.same({ 255, 1 }, ms.tensor({ 255, 1 }):to('u8'):totable())
      local i = ms.tensor({ 3, -4 }, { dtype = 'i32' })
      assert.are.same({ 3, -4 }, i:to('f32'):totable())
      assert.are.same({ 1, 0, 1 }, ms.tensor({ true, false, true }):to('f32'):totable())
      -- f64 values that f32 cannot hold are rounded
      assert.are.equal(tonumber(ffi.new('float', 0.1)), ms.tensor({ 0.1 }, { dtype = 'f64' }):to('f32'):item())
    end)

    it('to() forms: same dtype/device returns the tensor, copy = true a new one', function()
      local x = ms.tensor({ 1, 2 })
      assert.is_true(rawequal(x, x:to('f32')))
      assert.is_true(rawequal(x, x:to('cpu')))
      local c = x:to({ dtype = 'f32', copy = true })
      assert.is_false(rawequal(x, c))
      c:set(1, 5)
      assert.are.equal(1, x:get(1))
      local y = x:to({ dtype = 'f64', device = 'cpu' })
      assert.are.equal('f64', y.dtype)
      assert.are.equal('f64', x:to('cpu', 'f64').dtype)
      assert.are.equal('f64', x:double().dtype)
      assert.are.equal('f32', x:double():float().dtype)
      assert.are.equal('bf16', x:bf16().dtype)
      assert.are.equal('f16', x:half().dtype)
      assert.are.equal('i64', x:long().dtype)
      assert.are.equal('i32', x:int().dtype)
      assert.are.equal('bool', x:bool().dtype)
      assert.are.equal('cpu', x:cpu().device)
      assert.are.equal('i32', x:type_as(ms.zeros({ 1 }, { dtype = 'i32' })).dtype)
      -- a converted view reads the view's elements
      local m = ms.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
      assert.are.same({ { 1, 4 }, { 2, 5 }, { 3, 6 } }, m:t():to('f64'):totable())
    end)
  end)

  describe('host access', function()
    it('item returns a number (a boolean for bool) for one element of any dtype', function()
      for _, d in ipairs({ 'f64', 'f32', 'bf16', 'f16', 'i64', 'i32', 'u8' }) do
        local v = ms.tensor({ { 3 } }, { dtype = d }):item()
        assert.are.equal('number', type(v))
        assert.are.equal(3, v)
      end
      assert.are.equal(false, ms.tensor({ false }):item())
      assert.are.equal(-1.5, ms.tensor(-1.5):item())
      assert.are.equal(2 ^ 40 + 1, ms.tensor({ 2 ^ 40 + 1 }, { dtype = 'i64' }):item())
    end)

    it('totable nests by shape; a 0-d tensor gives a number', function()
      local d = rand_table({ 2, 2, 3 })
      assert.are.same(d, ms.tensor(d):totable())
      assert.are.equal(4.5, ms.tensor(4.5):totable())
      assert.are.same({}, ms.zeros({ 0 }):totable())
    end)

    it('get / set with 1-based and negative indices', function()
      local x = ms.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
      assert.are.equal(6, x:get(-1, -1))
      assert.are.equal(4, x:get(2, 1))
      x:set(-1, 2, 50)
      assert.are.equal(50, x:get(2, 2))
      assert.are.equal(7, ms.tensor(7):get())
    end)
  end)

  describe('tostring', function()
    it('small floats with 4 decimals, aligned', function()
      assert.are.equal('tensor([[ 1.5000, -2.2500],\n        [ 3.1250,  4.0000]])',
        tostring(ms.tensor({ { 1.5, -2.25 }, { 3.125, 4 } })))
    end)

    it('integer-valued floats print with a trailing dot', function()
      assert.are.equal('tensor([ 1.,  2., -3., 10.])', tostring(ms.tensor({ 1, 2, -3, 10 })))
      assert.are.equal('tensor([[0., 0., 0.],\n        [0., 0., 0.]])', tostring(ms.zeros({ 2, 3 })))
    end)

    it('scientific when values span more than 1e3, exceed 1e8 or go below 1e-4', function()
      assert.are.equal('tensor([1.0000e-05, 1.0000e+00, 1.0000e+03])', tostring(ms.tensor({ 1e-5, 1, 1000 })))
      assert.are.equal('tensor([5.0000e-01, 1.2346e+08])', tostring(ms.tensor({ 0.5, 123456789 })))
      assert.are.equal('tensor([1.0000e+00, 2.0000e+00, 1.0010e+03])', tostring(ms.tensor({ 1, 2, 1001 })))
      assert.are.equal('tensor([   1.,    2., 1000.])', tostring(ms.tensor({ 1, 2, 1000 })))
    end)

    it('0-d tensors print bare values', function()
      assert.are.equal('tensor(3.5000)', tostring(ms.tensor(3.5)))
      assert.are.equal('tensor(7, dtype=i64)', tostring(ms.tensor(7, { dtype = 'i64' })))
    end)

    it('nan and inf', function()
      assert.are.equal('tensor([   nan,    inf,   -inf, 1.5000])', tostring(ms.tensor({ 0 / 0, 1 / 0, -1 / 0, 1.5 })))
    end)

    it('bool and integer dtypes, with the dtype suffix for everything but f32', function()
      assert.are.equal('tensor([ true, false], dtype=bool)', tostring(ms.tensor({ true, false })))
      assert.are.equal('tensor([[ 1, -2],\n        [30,  4]], dtype=i32)',
        tostring(ms.tensor({ { 1, -2 }, { 30, 4 } }, { dtype = 'i32' })))
      assert.are.equal('tensor([1099511627776,            -3], dtype=i64)',
        tostring(ms.tensor({ 2 ^ 40, -3 }, { dtype = 'i64' })))
      assert.are.equal('tensor([ 1.5000, -2.2500], dtype=f64)', tostring(ms.tensor({ 1.5, -2.25 }, { dtype = 'f64' })))
      assert.are.equal('tensor([ 1.5000, -2.2500], dtype=bf16)', tostring(ms.tensor({ 1.5, -2.25 }, { dtype = 'bf16' })))
    end)

    it('3-d tensors separate blocks with a blank line', function()
      assert.are.equal('tensor([[[1., 2.],\n         [3., 4.]],\n\n        [[5., 6.],\n         [7., 8.]]])',
        tostring(ms.tensor({ { { 1, 2 }, { 3, 4 } }, { { 5, 6 }, { 7, 8 } } })))
    end)

    it('more than 1000 elements are summarised with ... and the shape', function()
      local s = tostring(ms.arange(2000, { dtype = 'i32' }))
      assert.are.equal('tensor([   0,    1,    2, ..., 1997, 1998, 1999], shape=(2000), dtype=i32)', s)
      local m = tostring(ms.ones({ 40, 40 }))
      local lines = {}
      for l in m:gmatch('[^\n]+') do lines[#lines + 1] = l end
      assert.are.equal(7, #lines)  -- 3 rows, '...', 3 rows
      assert.are.equal('        ...,', lines[4])
      assert.are.equal('tensor([[1., 1., 1., ..., 1., 1., 1.],', lines[1])
      assert.matches('shape=(40, 40))', lines[7], 1, true)
      -- exactly 1000 elements are printed in full
      local full = tostring(ms.zeros({ 1000 }))
      assert.is_nil(full:find('...', 1, true))
    end)

    it('the summary shows the first and last values of a view', function()
      local x = ms.arange(1000, 4000, { dtype = 'f64' }):view(3, 1000):t()  -- (1000, 3)
      local want = 'tensor([[1000., 2000., 3000.],\n'
      for _, r in ipairs({ 1001, 1002, false, 1997, 1998, 1999 }) do
        if r then want = want .. ('        [%d., %d., %d.]'):format(r, r + 1000, r + 2000)
        else want = want .. '        ...' end
        want = want .. (r == 1999 and ']' or ',\n')
      end
      assert.are.equal(want .. ', shape=(1000, 3), dtype=f64)', tostring(x))
    end)

    it('empty and freed tensors', function()
      assert.are.equal('tensor([], shape=(0))', tostring(ms.zeros({ 0 })))
      local x = ms.zeros({ 2 })
      x:free()
      assert.are.equal('tensor(<freed>)', tostring(x))
    end)
  end)

  describe('handles', function()
    it('+ and - with numbers and tensors are tensor ops, never pointer arithmetic', function()
      -- a handle that were a plain ms_tensor* would make x + 1 the address of
      -- the next struct and x - y a pointer difference
      local x = ms.tensor({ 1.5, -2 })
      local y = ms.tensor({ 10, 20 })
      assert.are.same({ 2.5, -1 }, (x + 1):totable())
      assert.are.same({ 2.5, -1 }, (1 + x):totable())
      assert.are.same({ 0.5, -3 }, (x - 1):totable())
      assert.are.same({ -0.5, 3 }, (1 - x):totable())
      assert.are.same({ -8.5, -22 }, (x - y):totable())
      assert.are.same({ 11.5, 18 }, (x + y):totable())
      assert.are.same({ 3, -4 }, (x * 2):totable())
      assert.are.same({ -1.5, 2 }, (-x):totable())
      assert.is_true(ms.is_tensor(x - y))
    end)

    it('a handle is a tensor for is_tensor and compares equal only to itself', function()
      local x = ms.tensor({ 1 })
      assert.is_true(ms.is_tensor(x))
      assert.is_false(ms.is_tensor({}))
      assert.is_false(ms.is_tensor(T.ffi.new('int[1]')))
      assert.is_true(rawequal(x, x))
      assert.is_false(rawequal(x, x:alias()))
    end)
  end)

  describe('memory', function()
    it('free() twice is safe; a freed tensor errors when used', function()
      local x = ms.tensor({ 1, 2, 3 })
      x:free()
      x:free()
      assert.is_true(x:is_freed())
      for _, f in ipairs({
        function() return x:item() end,
        function() return x:totable() end,
        function() return x:view(3) end,
        function() return x:narrow(1, 1, 1) end,
        function() return x:clone() end,
        function() return x:to('f64') end,
        function() return x:copy_(ms.tensor({ 1, 2, 3 })) end,
        function() return ms.zeros({ 3 }):copy_(x) end,
        function() return x:set(1, 5) end,
      }) do
        local e = errmsg(f)
        assert.matches('freed', e, 1, true)
      end
    end)

    it('a view keeps the storage alive after its base is freed', function()
      collectgarbage(); collectgarbage()  -- no earlier garbage left to be freed mid-test
      local base0 = ms.live_storages()
      local x = ms.tensor({ { 1.5, 2.5 }, { 3.5, 4.5 } })
      local v = x:t()
      assert.are.equal(base0 + 1, ms.live_storages())  -- one storage for both
      x:free()
      assert.are.equal(base0 + 1, ms.live_storages())
      assert.are.same({ { 1.5, 3.5 }, { 2.5, 4.5 } }, v:totable())
      v:free()
      assert.are.equal(base0, ms.live_storages())
    end)

    it('free() returns the bytes at once', function()
      collectgarbage()
      collectgarbage()
      local b0 = ms.live_bytes()
      local x = ms.empty({ 1000, 1000 })
      assert.are.equal(b0 + 4e6, ms.live_bytes())
      x:free()
      assert.are.equal(b0, ms.live_bytes())
    end)

    it('the live storage count returns to its baseline once tensors are dropped and collected', function()
      collectgarbage()
      collectgarbage()
      local s0, b0 = ms.live_storages(), ms.live_bytes()
      do
        local keep = {}
        for i = 1, 200 do
          local t = ms.tensor(rand_table({ 3, 4 }))
          local v = t:t():narrow(1, 2, 2)
          keep[#keep + 1] = (i % 2 == 0) and v or t:clone()
          ms.zeros({ 16 }):to('bf16')
        end
        assert.is_true(ms.live_storages() >= s0 + 200)
        keep = nil
      end
      collectgarbage()
      collectgarbage()
      assert.are.equal(s0, ms.live_storages())
      assert.are.equal(b0, ms.live_bytes())
    end)
  end)

  -- T.meta (autograd's grad, grad_fn, ...) is keyed by the handle's id; a
  -- handle is freed by C when collected, or by the Lua finalizer that drops
  -- its entry once it has one (tensor.lua, T.new_meta). The tensors are
  -- made in functions that return only ids, so no stack slot keeps them.
  describe('metadata and collection', function()
    local function entries()
      local n = 0
      for _ in pairs(T.meta) do n = n + 1 end
      return n
    end
    local function settle()
      for _ = 1, 3 do collectgarbage() end
    end

    it("a grad set on a tensor lives while the tensor does, and its entry goes with it", function()
      settle()
      local n0, b0 = entries(), ms.live_bytes()
      local keep = {}
      local function make()
        local x = ms.tensor({ { 1, 2 }, { 3, 4 } })
        x.grad = ms.tensor({ { 5, 6 }, { 7, 8 } })
        keep.x = x
        return tonumber(x.id)
      end
      local id = make()
      settle()
      assert.is_table(T.meta[id])
      assert.are.same({ { 5, 6 }, { 7, 8 } }, keep.x.grad:totable())
      assert.are.same({ { 1, 2 }, { 3, 4 } }, keep.x:totable())
      keep.x = nil
      settle()
      assert.is_nil(T.meta[id])
      assert.are.equal(n0, entries())
      assert.are.equal(b0, ms.live_bytes())
    end)

    it('a recorded output keeps its grad_fn while referenced and loses its entry once collected', function()
      settle()
      local n0, s0, b0 = entries(), ms.live_storages(), ms.live_bytes()
      local keep = {}
      local function make()
        local w = ms.tensor({ 1, 2, 3 }):requires_grad_()
        local y = (w * 2):sum()
        keep.w, keep.y = w, y
        return tonumber(y.id), tonumber(w.id)
      end
      local yid = make()
      settle()
      assert.is_not_nil(T.meta[yid] and T.meta[yid].grad_fn)
      assert.is_not_nil(keep.y.grad_fn)
      keep.y:backward()
      settle()
      assert.are.same({ 2, 2, 2 }, keep.w.grad:totable())
      keep.w, keep.y = nil, nil
      settle()
      assert.is_nil(T.meta[yid])
      assert.are.equal(n0, entries())
      assert.are.equal(s0, ms.live_storages())
      assert.are.equal(b0, ms.live_bytes())
    end)

    it('dropped tensors with and without entries, views among them, return their memory when collected', function()
      settle()
      local n0, s0, b0 = entries(), ms.live_storages(), ms.live_bytes()
      local ids = {}
      local function make()
        local keep = {}
        for i = 1, 300 do
          local x = ms.randn({ 8, 8 })
          local v = x:t():narrow(1, 1, 4)
          if i % 3 == 0 then v.grad = ms.zeros({ 4, 8 }) end
          if i % 5 == 0 then   -- (backward consumes the tape, which holds what it recorded)
            x:requires_grad_()
            local y = (x * 3):sum()
            y:backward()
            keep[#keep + 1] = y
          end
          keep[#keep + 1] = v
          ids[#ids + 1] = tonumber(v.id)
        end
        assert.is_true(ms.live_storages() >= s0 + 300)
        return #keep
      end
      make()
      settle()
      for _, id in ipairs(ids) do assert.is_nil(T.meta[id]) end
      assert.are.equal(n0, entries())
      assert.are.equal(s0, ms.live_storages())
      assert.are.equal(b0, ms.live_bytes())
    end)

    it('free() drops the entry at once; an entry made after it still goes with the tensor', function()
      settle()
      local n0 = entries()
      local keep = {}
      local function make()
        local x = ms.zeros({ 2 })
        x.grad = ms.ones({ 2 })
        x:free()
        keep.id = tonumber(x.id)
        assert.is_nil(T.meta[keep.id])
        x.grad = ms.ones({ 2 })
        keep.x = x
      end
      make()
      settle()
      assert.is_table(T.meta[keep.id])
      keep.x = nil
      settle()
      assert.is_nil(T.meta[keep.id])
      assert.are.equal(n0, entries())
    end)

    it('refuses metadata on an ms_tensor* read from C, whose finalizer would free the handle twice', function()
      local x = ms.zeros({ 2 })
      local p = ffi.cast('ms_tensor *', x)
      local e = errmsg(function() p.grad = ms.ones({ 2 }) end)
      assert.matches('not an ms_tensor* read from C', e, 1, true)
      assert.is_nil(T.meta[tonumber(x.id)])
      x.grad = ms.ones({ 2 })
      assert.are.same({ 1, 1 }, x.grad:totable())
    end)
  end)
end)
