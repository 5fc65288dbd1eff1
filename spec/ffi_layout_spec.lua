-- The FFI sees the structs through text generated from the C headers
-- (tools/gen_ffi.lua); this spec checks that LuaJIT lays them out exactly as
-- the C compiler does, using the compiled probe build/ffi_probe.
local T = require 'moonshard.tensor'
local ffi = require 'ffi'

local defs = T.cdef
local probe = T.build_dir .. '/ffi_probe'

-- "name size" and "name.field offset" lines from the probe
local function run_probe()
  local p = assert(io.popen(probe .. ' 2>&1'))
  local out = p:read('*a')
  local ok, _, code = p:close()
  local layout, lines = {}, 0
  for name, n in out:gmatch('([%w_%.]+) (%d+)\n') do
    layout[name] = tonumber(n)
    lines = lines + 1
  end
  return layout, lines, out, ok, code
end

describe('FFI layout', function()
  local layout, lines, out = run_probe()

  it('the probe runs and reports every struct and field the generator found', function()
    local want = 0
    for _, s in ipairs(defs.structs) do want = want + 1 + #s.fields end
    assert.is_true(#defs.structs >= 2, 'the generator found no structs')
    assert.are.equal(want, lines, out)
  end)

  it('covers the structs the Lua face uses (ms_tensor, ms_storage)', function()
    local names = {}
    for _, s in ipairs(defs.structs) do names[s.name] = true end
    assert.is_true(names.ms_tensor)
    assert.is_true(names.ms_storage)
  end)

  for _, s in ipairs(defs.structs) do
    it(('%s: sizeof and every field offset match C'):format(s.name), function()
      assert.is_not_nil(layout[s.name], 'probe has no size for ' .. s.name)
      assert.are.equal(layout[s.name], ffi.sizeof(s.name), 'sizeof ' .. s.name)
      for _, f in ipairs(s.fields) do
        local key = s.name .. '.' .. f
        assert.is_not_nil(layout[key], 'probe has no offset for ' .. key)
        assert.are.equal(layout[key], ffi.offsetof(s.name, f), 'offsetof ' .. key)
      end
    end)
  end

  it('fields come in declaration order at increasing offsets', function()
    for _, s in ipairs(defs.structs) do
      for i = 2, #s.fields do
        assert.is_true(ffi.offsetof(s.name, s.fields[i]) > ffi.offsetof(s.name, s.fields[i - 1]),
          s.name .. '.' .. s.fields[i])
      end
    end
  end)

  it('the tensor struct holds 8 dims of sizes and strides, as MS_MAX_DIMS says', function()
    assert.are.equal(8 * 8, ffi.offsetof('ms_tensor', 'strides') - ffi.offsetof('ms_tensor', 'sizes'))
    assert.are.equal(ffi.sizeof('int64_t[8]'), ffi.sizeof(ffi.new('ms_tensor').sizes))
  end)

  it('enum values seen by the FFI match the dtype table of the core', function()
    local C = T.C
    local names = { 'f64', 'f32', 'bf16', 'f16', 'i64', 'i32', 'u8', 'bool', 'f8e4m3', 'f8e5m2' }
    local sizes = { 8, 4, 2, 2, 8, 4, 1, 1, 1, 1 }
    for i, n in ipairs(names) do
      assert.are.equal(n, ffi.string(C.ms_dtype_name(i - 1)))
      assert.are.equal(sizes[i], C.ms_dtype_size(i - 1))
      assert.are.equal(n, T.dtype_names[i - 1])
    end
    assert.are.equal(10, C.MS_NUM_DTYPES)
    assert.are.equal(0, C.MS_F64)
    assert.are.equal(7, C.MS_BOOL)
    assert.are.equal(8, C.MS_F8E4M3)
    assert.are.equal(9, C.MS_F8E5M2)
  end)

  it('every function declared to the FFI exists in libmoonshard.so', function()
    local missing = {}
    local n = 0
    for name in defs.cdef:gmatch('([%w_]+)%s*%(') do
      if name:match('^ms_') then
        n = n + 1
        local ok = pcall(function() return T.C[name] end)
        if not ok then missing[#missing + 1] = name end
      end
    end
    assert.is_true(n > 20)
    assert.are.same({}, missing)
  end)

  it('the cdef text carries no preprocessor lines', function()
    assert.is_nil(defs.cdef:find('\n%s*#'))
  end)
end)
