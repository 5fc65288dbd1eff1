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

  -- take_deferred: a Function between the layers takes the queue in its
  -- backward; the walk ends without the first layer's weight gradients
  local function take_run(dtype, autocast)
    local job
    local Take = A.Function {
      name = 'take_here',
      forward = function(_, x) return x:clone() end,
      backward = function(_, g)
        job = A.take_deferred()
        return g
      end,
    }
    local m = net(3, dtype)
    local x = ms.randn({ 4, 6 }, { dtype = dtype, seed = 11 })
    local prev = nnf.defer_weight_grads(true)
    local ok, loss = pcall(function()
      local function f()
        local y = m[3](m[2](Take(m[1](x))))
        return (y * y):sum()
      end
      return autocast and nnf.autocast('bf16', f) or f()
    end)
    nnf.defer_weight_grads(prev)
    assert(ok, loss)
    loss:backward()
    return m, job
  end

  it('take_deferred: the queue leaves the walk as a job; run later, it gives the same bits', function()
    for _, ac in ipairs({ false, true }) do
      local dtype = ac and 'f32' or 'f64'
      local g0 = ac and nnf.autocast('bf16', function() return run(false, 'f32') end) or run(false, 'f64')
      local m, job = take_run(dtype, ac)
      assert.is_not_nil(job)
      -- the second layer's GEMMs were queued before the take and left with
      -- the job; the first's, queued after it, ran at the walk's end
      assert.is_nil(m[3].weight.grad)
      assert.is_nil(m[3].bias.grad)
      assert.is_not_nil(m[1].weight.grad)
      assert.is_true(job:run())
      assert.is_false(job:run())
      assert.is_false(job:drop())
      for name, p in m:named_parameters() do
        assert.are.equal(0, (p.grad:to('f64') - g0[name]):abs():max():item(), name)
      end
    end
  end)

  it('take_deferred: a dropped job frees what it held; nothing queued gives nil', function()
    local S_ = require 'spec.support'
    local function settle() S_.settled(function() return ms.live_bytes(-1) end) end
    -- warm up the allocator's paths once
    local _, j0 = take_run('f64')
    j0:drop()
    j0 = nil
    settle()
    local b0 = ms.live_bytes(-1)
    local m, job = take_run('f64')
    m = nil
    settle()
    local b1 = ms.live_bytes(-1)
    assert.is_true(job:drop())
    assert.is_false(job:run())
    job = nil
    settle()
    -- (comparisons a free of older garbage inside the window cannot fail:
    -- the drop released what the job held, and nothing of the run is left)
    local b2 = ms.live_bytes(-1)
    assert.is_true(b2 < b1, ('the drop released nothing: %d bytes before, %d after'):format(b1, b2))
    assert.is_true(b2 <= b0, ('%d bytes live after the drop, %d before the run'):format(b2, b0))
    -- outside a walk, and in a walk with nothing deferred
    assert.is_nil(A.take_deferred())
    local seen = 'unset'
    local Take = A.Function {
      name = 'take_nothing',
      forward = function(_, x) return x:clone() end,
      backward = function(_, g) seen = A.take_deferred(); return g end,
    }
    local x = ms.randn({ 3 }, { dtype = 'f64', seed = 2 }):requires_grad_()
    ;(Take(x) * 2):sum():backward()
    assert.is_nil(seen)
  end)

  it('take_deferred: a node of the walk that needs a taken gradient runs the job first; run inside a backward is an error',
    function()
    -- w is made from p by a node recorded before the take, so the walk
    -- reaches it after the take, waiting for the weight gradient
    local function build(defer)
      ms.manual_seed(5)
      local p = ms.randn({ 5, 6 }, { dtype = 'f64', seed = 3 }):requires_grad_()
      local x = ms.randn({ 4, 6 }, { dtype = 'f64', seed = 4 }):requires_grad_()
      local job
      local Take = A.Function {
        name = 'take_mid',
        forward = function(_, t) return t:clone() end,
        backward = function(_, g) job = A.take_deferred(); return g end,
      }
      local w = p * 3
      local prev = nnf.defer_weight_grads(defer)
      local y = nnf.linear(Take(x), w)
      nnf.defer_weight_grads(prev)
      ;(y * y):sum():backward()
      return p, x, job
    end
    local p0, x0 = build(false)
    local p1, x1, job = build(true)
    assert.is_not_nil(job)
    assert.is_false(job:run(), 'the walk ran it')
    assert.are.equal(0, (p1.grad - p0.grad):abs():max():item())
    assert.are.equal(0, (x1.grad - x0.grad):abs():max():item())
    -- a job run from inside another backward
    local _, job2 = take_run('f64')
    local Inner = A.Function {
      name = 'run_inside',
      forward = function(_, t) return t:clone() end,
      backward = function(_, g) job2:run(); return g end,
    }
    local z = ms.randn({ 2 }, { dtype = 'f64', seed = 9 }):requires_grad_()
    local ok, err = pcall(function() (Inner(z) * 1):sum():backward() end)
    assert.is_false(ok)
    assert.matches('after the backward it came from', tostring(err))
    assert.is_true(job2:run())
  end)
end)
