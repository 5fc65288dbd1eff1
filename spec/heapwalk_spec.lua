-- tools/heapwalk.lua: the shortest path to a tensor something still holds,
-- and nothing for one that nothing holds.
local ms = require 'moonshard'
local HW = dofile('tools/heapwalk.lua')

describe('tools/heapwalk.lua', function()
  it('finds the path to a tensor held in a global table and in a closure, not one dropped', function()
    local t1, t2, t3 = ms.randn({ 3 }), ms.randn({ 4 }), ms.randn({ 5 })
    local set = HW.tensors_from({ { a = { t1 } }, function() return t2, t3 end }, ms.is_tensor)
    local n = 0
    for _ in pairs(set) do n = n + 1 end
    assert.are.equal(3, n)
    rawset(_G, 'heapwalk_spec_holder', { inner = { t1 } })
    local keep
    do
      local held = t2
      keep = function() return held end
    end
    t1, t2, t3 = nil, nil, nil
    jit.flush()
    collectgarbage(); collectgarbage()
    local paths, found = HW.paths(function(x) return set[x] end, { [set] = true })
    assert.are.equal(2, found)
    local joined = table.concat(paths, '\n')
    assert.matches('_G / heapwalk_spec_holder / inner / 1', joined, 1, true)
    assert.matches('.keep{fn@spec/heapwalk_spec.lua:', joined, 1, true)
    assert.matches('} / ^held', joined, 1, true)
    rawset(_G, 'heapwalk_spec_holder', nil)
    keep = nil
    jit.flush()
    collectgarbage(); collectgarbage()
    local _, after = HW.paths(function(x) return set[x] end, { [set] = true })
    assert.are.equal(0, after)
  end)
end)
