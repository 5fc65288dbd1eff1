-- ops.cast_flat (core/ops.c ms_cast_flat): many tensors converted into one
-- flat tensor, one after the other. On the CPU a copy each; the CUDA kernel
-- (kernels/convert_many.cu) is compared with this by gpu_ops_spec.lua
-- (#gpu). A MoE layer casts its experts' weights with it.
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
