-- Autograd rules: the tape, the gradient rule (leaf grads accumulate,
-- intermediate grads overwrite), shared tensors, grad mode, detach, custom
-- Functions, checkpointing, and the errors a user can run into.
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local A = ms.autograd
local F = ms.raw

local function leaf(shape, s)
  return ms.randn(shape, { dtype = 'f64', seed = s or 1 }):requires_grad_()
end
local function close(a, b, tol)
  tol = tol or 1e-12
  local d = F.sub(a, b)
  local n = F.sum(F.square(d)):item()
  local r = F.sum(F.square(b)):item()
  return math.sqrt(n) <= tol * math.max(math.sqrt(r), 1e-300), math.sqrt(n)
end
local function assert_close(a, b, tol)
  local ok, err = close(a, b, tol)
  assert(ok, ('tensors differ by %.3e'):format(err))
end

describe('autograd tape', function()
  before_each(function() A.clear_tape() end)

  it('records nodes in execution order and is empty after backward', function()
    local x = leaf({ 3 })
    local y = x * 2
    local z = y:exp():sum()
    assert.are.equal(3, A.tape_size())
    assert.are.equal('sum', z.grad_fn.name)
    assert.is_false(z.is_leaf)
    assert.is_true(x.is_leaf)
    z:backward()
    assert.are.equal(0, A.tape_size())
    assert_close(x.grad, F.mul(F.exp(F.mul(x, 2)), 2))
  end)

  it('records nothing when no input requires grad', function()
    local x = ms.randn({ 3 }, { dtype = 'f64' })
    local y = (x * 2):sum()
    assert.are.equal(0, A.tape_size())
    assert.is_false(y.requires_grad)
  end)

  it('accumulates leaf gradients across two backward calls (+=)', function()
    local x = leaf({ 4 })
    local function loss() return (x * x):sum() end
    loss():backward()
    local g1 = x.grad:clone()
    loss():backward()
    assert_close(x.grad, F.mul(g1, 2))
    x:zero_grad()
    assert.is_nil(x.grad)
  end)

  it('overwrites a retained intermediate gradient on each backward (=)', function()
    local x = leaf({ 4 })
    local h1 = (x * 3):retain_grad()
    h1:square():sum():backward()
    local first = h1.grad:clone()
    assert_close(first, F.mul(F.mul(x, 3), 2))
    local h2 = (x * 3):retain_grad()
    h2:square():sum():backward()
    assert_close(h2.grad, first)     -- not 2 * first
    assert_close(h1.grad, first)     -- h1's graph is gone: its .grad kept, not summed
  end)

  it('sums the gradients of a tensor used twice', function()
    local x = leaf({ 5 })
    local y = x * x + x            -- dy/dx = 2x + 1
    y:sum():backward()
    assert_close(x.grad, F.add(F.mul(x, 2), 1))
  end)

  it('handles a diamond and a residual stream', function()
    local x = leaf({ 2, 3 })
    local a = x:tanh()
    local b = a * 2
    local c = a:exp()
    local h = x + b + c            -- x feeds h directly and through a
    ;(h * h):sum():backward()
    local g = F.mul(F.add(F.add(x, F.mul(F.tanh(x), 2)), F.exp(F.tanh(x))), 2)
    local da = F.add(F.mul(g, 2), F.mul(g, F.exp(F.tanh(x))))
    local want = F.add(g, F.mul(da, F.sub(1, F.square(F.tanh(x)))))
    assert_close(x.grad, want, 1e-12)
  end)

  it('gives one tensor used by two ops both contributions (tied weights)', function()
    local w = leaf({ 3, 3 })
    local x = ms.randn({ 2, 3 }, { dtype = 'f64', seed = 3 })
    local h = ms.matmul(x, w)
    local y = ms.matmul(h, w, false, true)
    y:sum():backward()
    -- reference: the same computation with two separate copies of w
    local w1 = w:detach():clone():requires_grad_()
    local w2 = w:detach():clone():requires_grad_()
    ms.matmul(ms.matmul(x, w1), w2, false, true):sum():backward()
    assert_close(w.grad, F.add(w1.grad, w2.grad))
  end)

  it('takes an explicit gradient for a non-scalar output', function()
    local x = leaf({ 2, 2 })
    local g = ms.randn({ 2, 2 }, { dtype = 'f64', seed = 9 })
    local y = x * 3
    y:backward(g)
    assert_close(x.grad, F.mul(g, 3))
    assert.is_false(g.requires_grad)
    assert.are.equal(g:sum():item(), g:sum():item()) -- g was not freed by backward
  end)

  it('keeps gradient dtypes equal to the leaves', function()
    local w = ms.randn({ 3 }):requires_grad_()      -- f32
    local x = ms.randn({ 4, 3 }, { dtype = 'f64' })
    local y = x * w                                 -- promotes to f64
    assert.are.equal('f64', y.dtype)
    y:sum():backward()
    assert.are.equal('f32', w.grad.dtype)
  end)
end)

describe('grad mode', function()
  before_each(function() A.clear_tape() end)

  it('no_grad runs fn without recording and returns its results', function()
    local x = leaf({ 3 })
    local a, b = ms.no_grad(function(k) return x * k, 'tag' end, 2)
    assert.are.equal('tag', b)
    assert.is_false(a.requires_grad)
    assert.are.equal(0, A.tape_size())
    assert.is_true(ms.is_grad_enabled())
  end)

  it('enable_grad inside no_grad records again; errors restore the mode', function()
    local x = leaf({ 3 })
    ms.no_grad(function()
      assert.is_false(ms.is_grad_enabled())
      local y = ms.enable_grad(function() return x * 2 end)
      assert.is_true(y.requires_grad)
    end)
    assert.is_true(ms.is_grad_enabled())
    assert.has_error(function() ms.no_grad(function() error('boom') end) end)
    assert.is_true(ms.is_grad_enabled())
    A.clear_tape()
  end)

  it('detach cuts the graph but shares storage', function()
    local x = leaf({ 3 })
    local d = x:detach()
    assert.is_false(d.requires_grad)
    local y = (x * d):sum()
    y:backward()
    assert_close(x.grad, x)            -- d is a constant: dy/dx = d = x
    ms.no_grad(function() F.add_(d, 1) end)
    assert.are.equal(x:get(1), d:get(1))
  end)
end)

describe('errors', function()
  before_each(function() A.clear_tape() end)

  it('backward of a tensor that does not require grad', function()
    local x = ms.randn({ 2 })
    assert.has_error(function() x:sum():backward() end)
  end)
  it('backward of a non-scalar without a gradient names the shape', function()
    local x = leaf({ 2, 3 })
    local ok, err = pcall(function() (x * 2):backward() end)
    assert.is_false(ok)
    assert.matches('%(2, 3%)', err)
    A.clear_tape()
  end)
  it('backward twice through the same graph', function()
    local x = leaf({ 2 })
    local y = (x * x):sum()
    y:backward()
    local ok, err = pcall(function() y:backward() end)
    assert.is_false(ok)
    assert.matches('already consumed', err)
  end)
  it('in-place update of a tensor that requires grad in grad mode', function()
    local x = leaf({ 2 })
    assert.has_error(function() x:add_(1) end)
    ms.no_grad(function() x:add_(1) end)
  end)
  it('requires_grad on an integer tensor', function()
    local i = ms.tensor({ 1, 2 }, { dtype = 'i64' })
    assert.has_error(function() i:requires_grad_() end)
  end)
  it('a grad of the wrong shape', function()
    local x = leaf({ 2 })
    assert.has_error(function() x.grad = ms.zeros({ 3 }, { dtype = 'f64' }) end)
  end)
end)

describe('custom Function', function()
  before_each(function() A.clear_tape() end)

  it('runs forward unrecorded and uses its backward', function()
    local calls = 0
    local Square = A.Function {
      name = 'Square',
      forward = function(ctx, x, k)
        assert.is_false(ms.is_grad_enabled())
        ctx:save_for_backward(x)
        ctx.k = k
        return F.mul(F.square(x), k)
      end,
      backward = function(ctx, g)
        calls = calls + 1
        assert.is_true(ctx.needs_input_grad[1])
        assert.is_false(ctx.needs_input_grad[2])
        local x = ctx.saved_tensors[1]
        return F.mul(F.mul(x, 2 * ctx.k), g), nil
      end,
    }
    local x = leaf({ 3 })
    local y = Square(x, 5)
    assert.are.equal('Square', y.grad_fn.name)
    assert.are.equal(1, A.tape_size())
    y:sum():backward()
    assert.are.equal(1, calls)
    assert_close(x.grad, F.mul(x, 10))
  end)

  it('supports several outputs (a missing output gradient is zeros)', function()
    local SinCos = A.Function {
      forward = function(ctx, x)
        ctx:save_for_backward(x)
        return F.sin(x), F.cos(x)
      end,
      backward = function(ctx, gs, gc)
        local x = ctx.saved_tensors[1]
        return F.sub(F.mul(gs, F.cos(x)), F.mul(gc, F.sin(x)))
      end,
    }
    local x = leaf({ 4 })
    local s, c = SinCos(x)
    ;(s * 2):sum():backward()
    assert_close(x.grad, F.mul(F.cos(x), 2))
    x:zero_grad()
    local s2, c2 = SinCos:apply(x)
    ;(s2 + c2):sum():backward()
    assert_close(x.grad, F.sub(F.cos(x), F.sin(x)))
  end)

  it('validates its definition', function()
    assert.has_error(function() A.Function { forward = function() end } end)
  end)
end)

describe('checkpoint', function()
  before_each(function() A.clear_tape() end)

  local function block()
    local m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.3), nn.Linear(8, 4))
    m:to('f64')
    return m
  end

  it('gives the same gradients as the plain forward (dropout replayed)', function()
    ms.manual_seed(1)
    local m = block()
    local x = leaf({ 3, 4 }, 5)
    ms.manual_seed(42)
    local y1 = m(x)
    local l1 = (y1 * y1):sum()
    l1:backward()
    local gx = x.grad:clone()
    local gw = {}
    for i, p in ipairs(m:parameters()) do gw[i] = p.grad:clone() end
    m:zero_grad(); x:zero_grad()

    ms.manual_seed(42)
    local y2 = ms.checkpoint(m, x)
    assert.are.equal(1, A.tape_size())    -- one node for the whole region
    assert_close(y2, y1)
    local l2 = (y2 * y2):sum()
    -- something else draws random numbers before backward: the replay must not care
    ms.randn({ 7 })
    l2:backward()
    assert_close(x.grad, gx)
    for i, p in ipairs(m:parameters()) do assert_close(p.grad, gw[i]) end
  end)

  it('works with several tensor arguments and non-tensor ones', function()
    local a, b = leaf({ 2, 2 }, 1), leaf({ 2, 2 }, 2)
    local y = ms.checkpoint(function(u, v, k) return (u * v):tanh() * k, u + v end, a, b, 3)
    y:sum():backward()
    local a2, b2 = a:detach():clone():requires_grad_(), b:detach():clone():requires_grad_()
    ;((a2 * b2):tanh() * 3):sum():backward()
    assert_close(a.grad, a2.grad)
    assert_close(b.grad, b2.grad)
  end)

  it('runs fn directly under no_grad', function()
    local x = leaf({ 2 })
    local y = ms.no_grad(function() return ms.checkpoint(function(u) return u * 2 end, x) end)
    assert.is_false(y.requires_grad)
  end)
end)

describe('tensor hooks', function()
  before_each(function() A.clear_tape() end)

  it('register_hook sees (and may replace) a gradient; remove() stops it', function()
    local x = leaf({ 3 })
    local h = x * 2
    local seen
    local handle = h:register_hook(function(g) seen = g:clone(); return F.mul(g, 10) end)
    h:sum():backward()
    assert_close(seen, ms.ones({ 3 }, { dtype = 'f64' }))
    assert_close(x.grad, ms.full({ 3 }, 20, { dtype = 'f64' }))
    handle.remove()
    x:zero_grad()
    local h2 = x * 2
    h2:sum():backward()
    assert_close(x.grad, ms.full({ 3 }, 2, { dtype = 'f64' }))
  end)

  it('post-accumulate hooks run once the leaf grad is updated', function()
    local w = leaf({ 2 })
    local seen = {}
    w:register_post_accumulate_grad_hook(function(p) seen[#seen + 1] = p.grad:clone() end)
    ;((w * 3) + (w * 4)):sum():backward()
    assert.are.equal(2, #seen)
    assert_close(seen[2], ms.full({ 2 }, 7, { dtype = 'f64' }))
  end)
end)

-- A.pending_grad: a linear's input gradient added into the sum its input's
-- other readers gave (a GEMM with beta = 1) instead of returned and added
describe('pending sums', function()
  local nnf = ms.nn.functional
  local P = ms.profile
  -- loss and the leaves' gradients of fn(a, b), pending sums on or off,
  -- and the adds the backward ran
  local function run(fn, on)
    local prev = A.set_pending_grad(on)
    local a, b = leaf({ 3, 5, 4 }, 1), leaf({ 3, 5, 4 }, 2)
    local loss = fn(a, b)
    P.ops_rows(true)
    local was = P.counting()
    P.ops(true)
    loss:backward()
    P.ops(was)
    local adds = 0
    for _, r in ipairs(P.ops_rows(true)) do if r.op == 'add' then adds = adds + r.calls end end
    A.set_pending_grad(prev)
    return loss:item(), a.grad, b.grad, adds
  end
  local W1, W2, W3 = ms.randn({ 6, 4 }, { dtype = 'f64', seed = 3 }), ms.randn({ 2, 4 }, { dtype = 'f64', seed = 4 }),
    ms.randn({ 2, 4 }, { dtype = 'f64', seed = 5 })
  local c = ms.randn({ 3, 5, 4 }, { dtype = 'f64', seed = 6 })
  local function same(fn, fewer)
    local l0, ga0, gb0, adds0 = run(fn, false)
    local l1, ga1, gb1, adds1 = run(fn, true)
    assert.are.equal(l0, l1)
    assert_close(ga1, ga0, 1e-14)
    if gb0 then assert_close(gb1, gb0, 1e-14) end
    return adds0 - adds1
  end

  it('three products of one input (q, k, v): their input gradient with no add', function()
    local saved = 0
    saved = same(function(a)
      local x = a * 2
      local q, k, v = nnf.linear(x, W1), nnf.linear(x, W2), nnf.linear(x, W3)
      return (q * q):sum() + (k * 3):sum() + (v * v * v):sum()
    end)
    assert.are.equal(2, saved)
  end)

  it('a sum shared with another tensor is not written into', function()
    -- z = x + r hands the same gradient to x and (a view) to r; r's
    -- producer runs after the linear's backward, so r's view is alive
    -- then: the linear must not add into x's gradient in place
    local saved = same(function(a, b)
      local x = a * 2
      local r = b * 3
      local y = nnf.linear(x, W1)
      local z = x + r
      return (z * c):sum() + (y * y):sum()
    end)
    assert.are.equal(0, saved)
    -- and once r's producer has run first, x's sum is the walk's alone
    saved = same(function(a, b)
      local x = a * 2
      local y = nnf.linear(x, W1)
      local r = b * 3
      local z = x + r
      return (z * c):sum() + (y * y):sum()
    end)
    assert.are.equal(1, saved)
  end)

  it('a leaf input and a reader with hooks take the usual path', function()
    local saved = same(function(a)
      return (nnf.linear(a, W1) * 2):sum() + nnf.linear(a, W2):sum()
    end)
    assert.are.equal(0, saved)
    local seen = 0
    saved = same(function(a)
      local x = a * 2
      local y1 = nnf.linear(x, W1)
      x:register_hook(function(g) seen = seen + 1 end)
      return (y1 * y1):sum() + nnf.linear(x, W2):sum()
    end)
    assert.are.equal(2, seen)   -- (once a run: on and off)
  end)

  it('bf16: the sum rounded once, within bf16 bounds of the f64 sum', function()
    local a = ms.randn({ 16, 32 }, { seed = 7 }):bf16()
    local Ws = { ms.randn({ 24, 32 }, { seed = 8 }):bf16(), ms.randn({ 24, 32 }, { seed = 9 }):bf16() }
    local function grad(on, dt)
      local prev = A.set_pending_grad(on)
      local x0 = a:to('f64'):to(dt):requires_grad_()   -- (a copy: a itself is bf16)
      local x = x0 * 1
      local s = nil
      for i, W in ipairs(Ws) do
        local y = nnf.linear(x, W:to(dt))
        local t = (y * (i + 1)):sum()
        s = s and (s + t) or t
      end
      s:backward()
      A.set_pending_grad(prev)
      return x0.grad:to('f64')
    end
    local ref = grad(false, 'f64')
    local on, off = grad(true, 'bf16'), grad(false, 'bf16')
    assert.is_true(close(on, ref, 1e-2))
    assert.is_true(close(off, ref, 1e-2))
  end)
end)
