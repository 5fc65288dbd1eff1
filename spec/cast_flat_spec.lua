-- ops.cast_flat (core/ops.c ms_cast_flat): many tensors converted into one
-- flat tensor, one after the other, and ops.split_flat_, the way back. On
-- the CPU a copy each; the CUDA kernels (kernels/convert_many.cu) are
-- compared with this by gpu_ops_spec.lua (#gpu). A MoE layer casts its
-- experts' weights with cast_flat; dist.all_reduce_coalesced packs a
-- bucket with it and copies it back with split_flat_.
local ms = require 'moonshard'
local F = require 'moonshard.ops'

local seed = 7300
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed }):to(dtype or 'f32')
end

-- the tensors flattened in row-major order and joined, in dtype
local function joined(list, dtype)
  local parts = {}
  for i, t in ipairs(list) do parts[i] = t:contiguous():reshape({ t:numel() }):to(dtype) end
  return ms.cat(parts)
end

describe('ops.cast_flat', function()
  for _, case in ipairs({ { 'f32', 'bf16' }, { 'f32', 'f16' }, { 'bf16', 'f32' }, { 'f32', 'f32' },
    { 'f64', 'f32' }, { 'f32', 'f64' } }) do
    local from, to = case[1], case[2]
    it(('%s -> %s: every tensor in turn, bit for bit as :to'):format(from, to), function()
      local list = { randn({ 3, 5 }, from), randn({ 7 }, from), randn({ 2, 3, 4 }, from), randn({ 1 }, from) }
      local f = F.cast_flat(list, to)
      assert.are.same({ 15 + 7 + 24 + 1 }, f.shape)
      assert.are.equal(to, f.dtype)
      assert.is_true(f:is_contiguous())
      local want = joined(list, to)
      assert.are.equal(0, (f:to('f64') - want:to('f64')):abs():max():item())
    end)
  end

  it('views with offsets and strides, empty tensors, and mixed dtypes', function()
    local base = randn({ 6, 8 })
    local list = { base:t(), base:narrow(1, 2, 3), ms.empty({ 0, 4 }), randn({ 4 }, 'bf16'), base:narrow(2, 3, 5) }
    local f = F.cast_flat(list, 'f32')
    local want = joined(list, 'f32')
    assert.are.equal(48 + 24 + 0 + 4 + 30, f:numel())
    assert.are.equal(0, (f - want):abs():max():item())
  end)

  it('the dtype defaults to the first tensor\'s', function()
    local f = F.cast_flat({ randn({ 2 }, 'bf16'), randn({ 3 }) })
    assert.are.equal('bf16', f.dtype)
    assert.are.equal(5, f:numel())
  end)

  it('a copy: writing the flat tensor leaves the sources alone', function()
    local a = randn({ 4 })
    local keep = a:clone()
    local f = F.cast_flat({ a }, 'f32')
    f:fill_(3)
    assert.are.equal(0, (a - keep):abs():max():item())
  end)

  it('refuses an empty list, a non-tensor and a freed tensor, naming them', function()
    assert.has_error(function() F.cast_flat({}, 'f32') end, 'cast_flat: an empty list')
    local ok, err = pcall(F.cast_flat, { randn({ 2 }), 3 }, 'f32')
    assert.is_false(ok)
    assert.matches('cast_flat', tostring(err), 1, true)
    assert.matches('list[2]', tostring(err), 1, true)
    local t = randn({ 2 })
    t:free()
    local ok2, err2 = pcall(F.cast_flat, { randn({ 2 }), t }, 'f32')
    assert.is_false(ok2)
    assert.matches('cast_flat', tostring(err2), 1, true)
  end)
end)

describe('ops.split_flat_ (the way back)', function()
  for _, case in ipairs({ { 'f32', 'f32' }, { 'f32', 'bf16' }, { 'bf16', 'f32' }, { 'f64', 'f32' }, { 'f32', 'f64' } }) do
    local from, to = case[1], case[2]
    it(('%s -> %s: each tensor gets its elements of the flat one, as :to would make them'):format(from, to), function()
      local list = { ms.zeros({ 3, 5 }, { dtype = to }), ms.zeros({ 7 }, { dtype = to }),
        ms.zeros({ 2, 3, 4 }, { dtype = to }), ms.zeros({ 1 }, { dtype = to }) }
      local flat = randn({ 15 + 7 + 24 + 1 }, from)
      assert.are.equal(list, F.split_flat_(list, flat))
      local off = 0
      for i, t in ipairs(list) do
        local want = flat:narrow(1, off + 1, t:numel()):reshape(t.shape):to(to)
        assert.are.equal(0, (t:to('f64') - want:to('f64')):abs():max():item(), 'tensor ' .. i)
        assert.is_true(t:abs():max():item() > 0)
        off = off + t:numel()
      end
    end)
  end

  it('inverts cast_flat, into views with offsets and strides and mixed dtypes', function()
    local base = randn({ 6, 8 })
    local list = { base:t(), base:narrow(1, 2, 3), ms.empty({ 0, 4 }), randn({ 4 }, 'bf16'), randn({ 5 }) }
    local flat = F.cast_flat(list, 'f32')
    local keep = {}
    for i, t in ipairs(list) do keep[i] = t:clone() end
    base:fill_(0)
    list[4]:fill_(0)
    list[5]:fill_(0)
    F.split_flat_(list, flat)
    for i, t in ipairs(list) do
      if t:numel() > 0 then
        assert.are.equal(0, (t:to('f64') - keep[i]:to('f64')):abs():max():item(), 'tensor ' .. i)
      end
    end
  end)

  it('refuses a flat tensor of another size, a strided one, and an empty list, naming them', function()
    local ok, err = pcall(F.split_flat_, { ms.zeros({ 2, 3 }), ms.zeros({ 4 }) }, randn({ 9 }))
    assert.is_false(ok)
    assert.matches('split_flat_: the 2 tensors hold 10 elements, the flat tensor', tostring(err), 1, true)
    assert.matches('9', tostring(err), 1, true)
    ok, err = pcall(F.split_flat_, { ms.zeros({ 2 }) }, randn({ 2, 2 }):t():narrow(1, 1, 1))
    assert.is_false(ok)
    assert.matches('not contiguous', tostring(err), 1, true)
    assert.has_error(function() F.split_flat_({}, randn({ 1 })) end, 'split_flat_: an empty list')
    local f = randn({ 6 })
    ok, err = pcall(F.split_flat_, { ms.zeros({ 3 }), f:narrow(1, 4, 3) }, f)
    assert.is_false(ok)
    assert.matches('split_flat_: tensor 2 %(.*%) shares the flat tensor\'s storage', tostring(err))
    ok, err = pcall(F.split_flat_, { ms.zeros({ 2 }), 5 }, randn({ 3 }))
    assert.is_false(ok)
    assert.matches('list[2]', tostring(err), 1, true)
  end)
end)

-- ops.copy_bytes_many_ (core/ops.c ms_copy_bytes_many): many byte copies at
-- once between contiguous tensors of any dtypes (fsdp's f8 gathers pack a
-- unit's other parameters into the f8 shard's bytes with it, and unpack
-- them from the gathered bytes); the CUDA kernel is compared with this by
-- gpu_float8_spec.lua (#gpu)
local ffi = require 'ffi'
local function bytes(t)
  local n = t:numel() * t:element_size()
  local p = ffi.cast('uint8_t *', t:data_ptr())
  local r = {}
  for i = 0, n - 1 do r[i + 1] = p[i] end
  return r
end

describe('ops.copy_bytes_many_', function()
  it('copies each range\'s bytes as they are (dtypes, offsets, unaligned, empty, a tensor written by several)', function()
    local buf = randn({ 100 }):to('u8')                        -- (100 bytes: the f8 shard's kind)
    local f32, bf = randn({ 37 }), randn({ 41 }, 'bf16')
    local out = randn({ 30 }, 'bf16')
    local copies = {
      { buf, 3, bf, 4, 21 },           -- (odd: a bf16 split in half)
      { buf, 40, f32, 0, 48 },
      { out, 2, buf, 90, 10 },
      { out, 20, f32, 100, 0 },        -- (none)
      { out, 30, bf, 60, 22 },
    }
    local want = { buf = bytes(buf), out = bytes(out) }
    local src = { [bf] = bytes(bf), [f32] = bytes(f32) }
    -- (in order: copy 3 reads buf's bytes 90.. which copies 1 and 2 leave)
    for _, c in ipairs(copies) do
      local d = c[1] == buf and want.buf or want.out
      local s = src[c[3]] or bytes(c[3])
      for k = 0, c[5] - 1 do d[c[2] + k + 1] = s[c[4] + k + 1] end
    end
    assert.are.equal(copies, F.copy_bytes_many_(copies))
    assert.are.same(want.buf, bytes(buf))
    assert.are.same(want.out, bytes(out))
    F.copy_bytes_many_({})
  end)

  it('refuses ranges outside their tensors, overlapping writes, a write over a read, strided tensors, naming the copy', function()
    local a, b = ms.zeros({ 8 }), ms.zeros({ 8 })
    local function err(copies, want)
      local ok, e = pcall(F.copy_bytes_many_, copies)
      assert.is_false(ok)
      assert.matches(want, tostring(e), 1, true)
    end
    err({ { a, 0, b, 0, 4 }, { a, 30, b, 0, 4 } }, 'copy_bytes_many (copy 2): 4 bytes from byte 0 of src')
    err({ { a, 0, b, 30, 4 } }, 'do not fit')
    err({ { a, 0, b, 0, -1 } }, 'do not fit')
    err({ { a, 0, b, 0, 8 }, { a, 4, b, 16, 8 } }, 'copy 1 writes bytes that copy 2 writes')
    err({ { a, 0, b, 0, 8 }, { b, 4, a, 16, 8 } }, 'copy 2 writes bytes that copy 1 reads')
    err({ { a, 0, a, 2, 8 } }, 'copy 1 writes bytes that copy 1 reads')
    err({ { ms.zeros({ 4, 2 }):t(), 0, b, 0, 4 } }, 'must be contiguous')
    err({ { a, 0, b } }, 'copies[1] needs byte offsets and a count')
    err({ { a, 0, 5, 0, 1 } }, 'copies[1] src')
  end)
end)
