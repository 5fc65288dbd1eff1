-- Releasing a storage's data but keeping the storage (core/tensor.h,
-- ms_storage_free_data / ms_storage_alloc_data): what FSDP's reshard and
-- unshard do to a unit's unsharded buffer, whose views the tape keeps.
local ffi = require 'ffi'
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local C = T.C

local function live()
  for _ = 1, 4 do collectgarbage('collect') end
  return ms.live_bytes(-1)
end

describe('storage data release', function()
  it('frees the bytes, keeps the handles and views, and gives the same storage new data', function()
    local t = ms.randn({ 64, 4 })
    local v = t:narrow(1, 3, 10)          -- a view, as the tape saves
    local L0 = live()
    assert.are.equal(1, C.ms_storage_has_data(t))
    assert.are.equal(0, C.ms_storage_free_data(t))
    assert.are.equal(0, C.ms_storage_has_data(v))
    assert.are.equal(L0 - 64 * 4 * 4, live())
    assert.are.equal(0, C.ms_storage_free_data(v))     -- twice: nothing to do
    assert.are.equal(L0 - 64 * 4 * 4, live())
    assert.are.equal(0, C.ms_storage_alloc_data(v))    -- through any tensor of the storage
    assert.are.equal(1, C.ms_storage_has_data(t))
    assert.are.equal(L0, live())
    assert.are.equal(0, C.ms_storage_alloc_data(t))    -- twice: nothing to do
    assert.are.equal(L0, live())
    t:fill_(2)
    assert.are.equal(2 * 10 * 4, v:sum():item())       -- the view sees the new data
  end)

  it('a use of released data is a Lua error naming it, never a crash', function()
    local w = ms.randn({ 8, 8 })
    local v = w:t()
    assert.are.equal(0, C.ms_storage_free_data(w))
    local uses = {
      function() return w + 1 end, function() return v:sum() end, function() return w:item() end,
      function() return ms.matmul(w, w) end, function() return tostring(w) end,
      function() return w:clone() end, function() return ms.zeros({ 8, 8 }):copy_(w) end,
      function() w:fill_(0) end, function() return w:to('bf16') end, function() return w:narrow(1, 1, 2) end,
      function() return ms.nn.functional.linear(ms.randn({ 2, 8 }), w) end,
    }
    for i, f in ipairs(uses) do
      local ok, e = pcall(f)
      assert.is_false(ok, 'use ' .. i)
      e = tostring(e)
      assert.is_truthy(e:find('released by ms_storage_free_data', 1, true) or e:find('cannot be converted', 1, true),
        'use ' .. i .. ': ' .. e)
    end
    assert.are.equal(0, C.ms_storage_alloc_data(w))
    w:fill_(1)
    assert.are.equal(64, w:sum():item())
  end)

  it('a storage released while its data is gone frees its header only', function()
    local L0 = live()
    local n0 = ms.live_storages()
    local t = ms.zeros({ 1000 })
    assert.are.equal(0, C.ms_storage_free_data(t))
    t:free()
    assert.are.equal(L0, live())
    assert.are.equal(n0, ms.live_storages())
    -- a freed handle is an error, not a crash
    assert.are.equal(-1, C.ms_storage_free_data(t))
    assert.matches('tensor was freed', ffi.string(C.ms_last_error()))
    assert.are.equal(-1, C.ms_storage_alloc_data(t))
  end)
end)
