-- Deferred gradients (ms.autograd.defer, docs/autograd.md): affine layers
-- recorded under nnf.defer_weight_grads(true) leave their weight and bias
-- gradients in the walk's queue; the walk postpones the nodes that wait
-- for them (an autocast cast of the weight), runs the queue when asked
-- (flush_deferred), before a module marker and at its end, and drops it
-- when a backward fails. The gradients are those of the plain backward.
local ms = require 'moonshard'
local A = ms.autograd
local nnf = ms.nn.functional

local function net(seed, dtype)
  ms.manual_seed(seed)
  local m = ms.nn.Sequential(ms.nn.Linear(6, 8, { dtype = dtype }), ms.nn.GELU(),
    ms.nn.Linear(8, 5, { dtype = dtype }))
  return m
end

-- the model's loss and parameter gradients, the products recorded with
-- deferral on or off; hook(x) may act in the middle of the backward
local function run(defer, dtype, mid)
  local m = net(3, dtype)
  local x = ms.randn({ 4, 6 }, { dtype = dtype, seed = 11 })
  local prev = nnf.defer_weight_grads(defer)
  local ok, loss = pcall(function()
    local h = m[1](x)
    if mid then h = mid(h) end
    local y = m[3](m[2](h))
    return (y * y):sum()
  end)
  nnf.defer_weight_grads(prev)
  assert(ok, loss)
  local c0 = A.defer_counts()
  loss:backward()
  local c1 = A.defer_counts()
  local grads = {}
  for name, p in m:named_parameters() do grads[name] = p.grad:to('f64') end
  return grads, { deferred = c1.deferred - c0.deferred, postponed = c1.postponed - c0.postponed,
    flushes = c1.flushes - c0.flushes }
end

describe('autograd: deferred gradients', function()
  before_each(function() A.clear_tape() end)

  it('weight and bias gradients deferred to the end of the walk equal the plain ones, bitwise (f64)', function()
    local g0, c0 = run(false, 'f64')
    local g1, c1 = run(true, 'f64')
    for name, g in pairs(g0) do
      assert.are.equal(0, (g1[name] - g):abs():max():item(), name)
    end
    assert.are.same({ deferred = 0, postponed = 0, flushes = 0 }, c0)
    assert.are.same({ deferred = 2, postponed = 0, flushes = 1 }, c1)
  end)

  it('under autocast the weights\' casts wait with their GEMMs (postponed), and the f32 .grad is the plain one', function()
    local function ac(defer)
      return nnf.autocast('bf16', function() return run(defer, 'f32') end)
    end
    local g0 = ac(false)
    local g1, c1 = ac(true)
    for name, g in pairs(g0) do
      assert.are.equal(0, (g1[name] - g):abs():max():item(), name)
    end
    assert.are.equal(2, c1.deferred)
    -- the two weights' and two biases' casts
    assert.are.equal(4, c1.postponed)
  end)

  it('flush_deferred runs the queue where it is called: a Function between the layers flushes in its backward', function()
    local seen = {}
    local Flush = A.Function {
      name = 'flush_here',
      forward = function(_, x) return x:clone() end,
      backward = function(_, g)
        local before = A.defer_counts().flushes
        A.flush_deferred()
        seen[#seen + 1] = A.defer_counts().flushes - before
        return g
      end,
    }
    local g0 = run(false, 'f64', function(h) return Flush(h) end)
    local g1, c1 = run(true, 'f64', function(h) return Flush(h) end)
    for name, g in pairs(g0) do
      assert.are.equal(0, (g1[name] - g):abs():max():item(), name)
    end
    -- off: nothing to run; on: the second layer's GEMM ran in the middle,
    -- the first's at the end
    assert.are.same({ 0, 1 }, seen)
    assert.are.same({ deferred = 2, postponed = 0, flushes = 2 }, c1)
  end)

  it('A.set_deferral(false) computes at once; a failed backward drops the queue and the next one works', function()
    local prev = A.set_deferral(false)
    local _, c = run(true, 'f64')
    A.set_deferral(prev)
    assert.are.same({ deferred = 0, postponed = 0, flushes = 0 }, c)
    local Boom = A.Function {
      name = 'boom',
      forward = function(_, x) return x:clone() end,
      backward = function() error('boom in backward') end,
    }
    assert.has_error(function() run(true, 'f64', function(h) return Boom(h) end) end)
    local g0 = run(false, 'f64')
    local g1 = run(true, 'f64')
    for name, g in pairs(g0) do
      assert.are.equal(0, (g1[name] - g):abs():max():item(), name)
    end
  end)
end)
