-- ms.cuda.graph without a GPU: its arguments and refusals, and the piece of
-- AdamW a captured step stands on (constants read from a tensor give the
-- bits of the step's own). The captures themselves: spec/gpu_graph_spec.lua.
local ms = require 'moonshard'
local F = require 'moonshard.ops'

local function same_bits(a, b)
  assert.are.same(a.shape, b.shape)
  return (a:double() - b:double()):abs():max():item() == 0
end

describe('cuda.graph', function()
  it('refuses a function it cannot capture: not a function, bad options', function()
    assert.has_error(function() ms.cuda.graph(3) end, 'cuda.graph: expected a function, got number')
    assert.has_error(function() ms.cuda.graph(function() end, { warmup = -1 }) end,
      'cuda.graph: warmup must be an integer >= 0, got -1')
    assert.has_error(function() ms.cuda.graph(function() end, { warmup = 1.5 }) end,
      'cuda.graph: warmup must be an integer >= 0, got 1.5')
    assert.has_error(function() ms.cuda.graph(function() end, { warmups = 1 }) end,
      'cuda.graph: unknown option warmups (warmup, device)')
    assert.has_error(function() ms.cuda.graph(function() end, 5) end, 'cuda.graph: options must be a table, got number')
  end)

  it('needs a CUDA device, and says so without running fn', function()
    if ms.cuda.is_available() then pending('a CUDA device is present') return end
    local ran = 0
    local ok, err = pcall(ms.cuda.graph, function() ran = ran + 1 end, { warmup = 2 })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('CUDA graphs need a CUDA device', 1, true), err)
    assert.are.equal(0, ran)
  end)

  it('is not capturing outside a capture; on_replay outside one is an error', function()
    assert.is_false(ms.cuda.is_capturing())
    assert.has_error(function() ms.cuda.on_replay(function() end) end, 'cuda.on_replay: no cuda.graph capture is going on')
    -- CPU work and random draws are refused only inside a capture
    local x = ms.randn({ 3, 4 }, { seed = 1 })
    assert.is_true(((x + 1) * 2):sum():item() == ((x + 1) * 2):sum():item())
  end)
end)

describe('adamw_ with the step constants on a tensor', function()
  for _, case in ipairs({ { 'f32', nil }, { 'bf16', 'master' } }) do
    it('gives the bits of the step form over steps with a changing lr (' .. case[1] .. ')', function()
      local shape = { 37, 29 }
      local p1 = ms.randn(shape, { seed = 1 }):to(case[1])
      local p2 = p1:clone()
      local w1 = case[2] and p1:to('f32') or nil
      local w2 = w1 and w1:clone() or nil
      local m1, v1 = ms.zeros(shape), ms.zeros(shape)
      local m2, v2 = m1:clone(), v1:clone()
      local k = ms.empty({ 3 }, { dtype = 'f64' })
      for step = 1, 4 do
        local g = ms.randn(shape, { seed = 10 + step }):to(case[1])
        local lr = 1e-2 / step
        F.adamw_(p1, g, m1, v1, lr, 0.9, 0.99, 1e-8, 0.1, step, w1 and { w1 } or nil)
        F.adamw_constants_(k, lr, 0.9, 0.99, 0.1, step)
        -- (lr, weight_decay and step given here are ignored: the constants rule)
        F.adamw_(p2, g, m2, v2, 5, 0.9, 0.99, 1e-8, 7, 1, w2 and { w2 } or nil, nil, k)
      end
      assert.is_true(same_bits(p1, p2))
      assert.is_true(same_bits(m1, m2) and same_bits(v1, v2))
      if w1 then assert.is_true(same_bits(w1, w2)) end
      -- and the update moved the parameter (the comparison is not of two no-ops)
      assert.is_false(same_bits(p1, ms.randn(shape, { seed = 1 }):to(case[1])))
    end)
  end

  it('writes the constants of a step: 1 - lr wd, lr / (1 - b1^t), sqrt(1 - b2^t)', function()
    local k = ms.empty({ 3 }, { dtype = 'f64' })
    F.adamw_constants_(k, 1e-3, 0.9, 0.95, 0.1, 3)
    local v = k:totable()
    assert.is_true(math.abs(v[1] - (1 - 1e-4)) < 1e-15)
    assert.is_true(math.abs(v[2] - 1e-3 / (1 - 0.9 ^ 3)) < 1e-15)
    assert.is_true(math.abs(v[3] - math.sqrt(1 - 0.95 ^ 3)) < 1e-15)
  end)

  it('refuses constants that are not 3 f64 on the parameters\' device, and a step below 1', function()
    local p, g = ms.randn({ 4 }, { seed = 2 }), ms.randn({ 4 }, { seed = 3 })
    local m, v = ms.zeros({ 4 }), ms.zeros({ 4 })
    assert.has_error(function() F.adamw_(p, g, m, v, 1e-3, 0.9, 0.99, 1e-8, 0, 1, nil, nil, ms.zeros({ 3 })) end,
      "adamw_: the step's constants must be 3 contiguous f64 elements on the parameters' device (f32 (4) cpu), "
      .. 'got f32 (3) cpu')
    assert.has_error(function()
      F.adamw_(p, g, m, v, 1e-3, 0.9, 0.99, 1e-8, 0, 1, nil, nil, ms.zeros({ 4 }, { dtype = 'f64' }))
    end)
    assert.has_error(function() F.adamw_constants_(ms.zeros({ 3 }, { dtype = 'f64' }), 1e-3, 0.9, 0.99, 0, 0) end,
      'adamw_constants_: step must be >= 1 (the count including this update), got 0')
    assert.has_error(function() F.adamw_(p, g, m, v, 1e-3, 0.9, 0.99, 1e-8, 0, 1, nil, nil, 'k') end,
      'adamw_: constants must be a tensor (3 f64 elements), got string')
  end)
end)
