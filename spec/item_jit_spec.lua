-- t:item() in compiled code: the value comes back from C by value. (It was
-- read through a pointer into a host copy freed right after; LuaJIT may fuse
-- such a load into the instruction that uses the value, after the free, and
-- the product then read freed memory: float8_spec's reference products came
-- out as garbage about once in fifty runs.)
local ms = require 'moonshard'

describe('item() in compiled traces', function()
  it('a product of item() values in a hot loop is right every time (it was wrong 97% of the time once compiled)', function()
    local ai = ms.tensor({ 0.25 })
    local bi = ms.tensor({ 3 }, { dtype = 'f64' })
    local bad, first = 0, nil
    for i = 1, 20000 do
      local v = ai:item() * bi:item()
      if v ~= 0.75 then
        bad = bad + 1
        first = first or ('iteration %d: %.17g, expected 0.75'):format(i, v)
      end
    end
    assert.are.equal(0, bad, first)
    -- with tensors made and freed around it, and a bf16 value
    local ci = ms.tensor({ 5 }, { dtype = 'bf16' })
    for i = 1, 20000 do
      local m = ms.tensor({ i % 97 + 1 })
      local v = m:sum():item() * (ai:item() * bi:item()) + ci:item()
      local want = (i % 97 + 1) * 0.75 + 5
      if v ~= want then
        bad = bad + 1
        first = first or ('iteration %d: %.17g, expected %.17g'):format(i, v, want)
      end
      m:free()
    end
    assert.are.equal(0, bad, first)
  end)

  it('item() of a freed tensor and of several elements are still errors', function()
    local t = ms.tensor({ 1, 2 })
    assert.has_error(function() t:item() end)
    local u = ms.tensor({ 1 })
    u:free()
    assert.has_error(function() u:item() end)
  end)
end)
