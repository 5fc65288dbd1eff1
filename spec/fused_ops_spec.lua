-- The fused ops of core/ops.h on the CPU (core/norm_cpu.c, adamw_cpu.c,
-- rope_cpu.c) against independent computations: the composed raw ops in
-- f64, plain Lua loops, and the old composed autograd path; plus their
-- dtype rules, their errors, and thread-count independence.
local ms = require 'moonshard'
local F = ms.raw
local A = ms.autograd
local nnf = ms.nn.functional

local function relerr(got, want)
  local g, w = got:to('f64'), want:to('f64')
  local d = F.sub(g, w)
  local num = F.sum(F.mul(d, d)):item()
  local den = F.sum(F.mul(w, w)):item()
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end

local seed = 500
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed, dtype = 'f64' }):to(dtype or 'f64')
end

local function flat(t) return t:to('f64'):contiguous():view(-1):totable() end

-- the composed references, in f64 on f64 copies
local function ref_layer_norm(x, w, b, eps)
  x = x:to('f64')
  local mu = F.mean(x, -1, true)
  local xc = F.sub(x, mu)
  local var = F.mean(F.mul(xc, xc), -1, true)
  local rstd = F.rsqrt(F.add(var, eps))
  local y = F.mul(xc, rstd)
  if w then y = F.mul(y, w:to('f64')) end
  if b then y = F.add(y, b:to('f64')) end
  return y, mu, rstd
end
local function ref_rms_norm(x, w, eps)
  local x64 = x:to('f64')
  local rstd = F.rsqrt(F.add(F.mean(F.mul(x64, x64), -1, true), eps))
  local y = F.mul(x64, rstd)
  if x.dtype ~= 'f64' then y = y:to(x.dtype):to('f64') end -- Hugging Face's rounding
  if w then y = F.mul(y, w:to('f64')) end
  return y, rstd
end
local function rotate_half(x)
  local D = x.shape[x.ndim]
  local h = D / 2
  return F.cat({ F.neg(x:narrow(-1, h + 1, h)), x:narrow(-1, 1, h) }, -1)
end

describe('fused layer_norm (CPU)', function()
  for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
    it('forward equals the composed ops, with and without weight and bias (' .. dt .. ')', function()
      local bound = ({ f64 = 1e-13, f32 = 1e-6, bf16 = 1e-2 })[dt]
      local x = randn({ 3, 5, 37 }, dt)
      local w, b = randn({ 37 }, dt), randn({ 37 }, dt)
      for _, wb in ipairs({ { w, b }, { w, nil }, { nil, nil } }) do
        local y, mean, rstd = F.native_layer_norm(x, wb[1], wb[2], 1e-5)
        local ry, rmu, rrs = ref_layer_norm(x, wb[1], wb[2], 1e-5)
        assert.are.equal(dt, y.dtype)
        assert.are.same({ 3, 5, 37 }, y.shape)
        assert.are.same({ 15 }, mean.shape)
        assert.are.equal(dt == 'f64' and 'f64' or 'f32', rstd.dtype)
        assert.is_true(relerr(y, ry) <= bound, dt .. ' y ' .. relerr(y, ry))
        assert.is_true(relerr(mean, rmu:view(-1)) <= (dt == 'bf16' and 1e-6 or bound))
        assert.is_true(relerr(rstd, rrs:view(-1)) <= (dt == 'bf16' and 1e-6 or bound))
      end
    end)
  end

  it('reads any layout and emits the dtype asked for (rounded once)', function()
    local x = randn({ 6, 40 }, 'f32')
    local xt = randn({ 40, 6 }, 'f32'):t()          -- non-contiguous
    local w, b = randn({ 40 }, 'f32'), randn({ 40 }, 'f32')
    assert.is_true(relerr(F.native_layer_norm(xt, w, b), (ref_layer_norm(xt, w, b, 1e-5))) <= 1e-6)
    local y32 = F.native_layer_norm(x, w, b)
    local y16 = F.native_layer_norm(x, w, b, 1e-5, 'bf16')
    assert.are.equal('bf16', y16.dtype)
    assert.are.same(flat(y32:to('bf16')), flat(y16))
    -- bf16 weights with an f32 input: the weights are read in f32
    local yb = F.native_layer_norm(x, w:to('bf16'), b:to('bf16'))
    assert.are.equal('f32', yb.dtype)
    assert.is_true(relerr(yb, (ref_layer_norm(x, w:to('bf16'), b:to('bf16'), 1e-5))) <= 1e-6)
  end)

  it('a constant row normalises to the bias (no NaN)', function()
    local x = ms.full({ 2, 8 }, 3.5, { dtype = 'f64' })
    local b = randn({ 8 })
    local y = F.native_layer_norm(x, nil, b)
    assert.is_true(relerr(y, F.add(F.mul(x, 0), b)) <= 1e-12)
  end)

  for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
    it('backward equals the composed autograd path (' .. dt .. ')', function()
      local bound = ({ f64 = 1e-12, f32 = 1e-5, bf16 = 1e-2 })[dt]
      local x, w, b, g = randn({ 4, 3, 29 }, dt), randn({ 29 }, dt), randn({ 29 }, dt), randn({ 4, 3, 29 }, dt)
      local _, mean, rstd = F.native_layer_norm(x, w, b)
      local dx, dw, db = F.native_layer_norm_backward(g, x, mean, rstd, w)
      assert.are.equal(dt, dx.dtype)
      assert.are.equal(dt, dw.dtype)
      assert.are.equal(dt, db.dtype)
      -- reference: the composed ops with autograd, in f64
      local x64 = x:to('f64'):requires_grad_()
      local w64 = w:to('f64'):requires_grad_()
      local b64 = b:to('f64'):requires_grad_()
      local mu = x64:mean(-1, true)
      local xc = x64 - mu
      local y = xc / ((xc * xc):mean(-1, true) + 1e-5):sqrt() * w64 + b64
      y:backward(g:to('f64'))
      assert.is_true(relerr(dx, x64.grad) <= bound, 'dx ' .. relerr(dx, x64.grad))
      assert.is_true(relerr(dw, w64.grad) <= bound, 'dw ' .. relerr(dw, w64.grad))
      assert.is_true(relerr(db, b64.grad) <= bound, 'db ' .. relerr(db, b64.grad))
      -- slots not wanted are neither computed nor returned
      local dx2, dw2, db2 = F.native_layer_norm_backward(g, x, mean, rstd, w, { dx = false, db = false })
      assert.is_nil(dx2)
      assert.is_nil(db2)
      assert.are.same(flat(dw), flat(dw2))
    end)
  end

  it('dw and db do not depend on the number of threads', function()
    local n0 = ms.get_num_threads()
    local x, w, g = randn({ 300, 130 }, 'f32'), randn({ 130 }, 'f32'), randn({ 300, 130 }, 'f32')
    local _, mean, rstd = F.native_layer_norm(x, w, nil)
    ms.set_num_threads(1)
    local dx1, dw1, db1 = F.native_layer_norm_backward(g, x, mean, rstd, w)
    ms.set_num_threads(3)
    local dx3, dw3, db3 = F.native_layer_norm_backward(g, x, mean, rstd, w)
    ms.set_num_threads(n0)
    assert.are.same(flat(dx1), flat(dx3))
    assert.are.same(flat(dw1), flat(dw3))
    assert.are.same(flat(db1), flat(db3))
  end)

  it('names the shapes and dtypes of bad arguments', function()
    local x = randn({ 4, 8 }, 'f32')
    local ok, err = pcall(F.native_layer_norm, x, randn({ 7 }, 'f32'))
    assert.is_false(ok)
    assert.matches('layer_norm: weight f32 %(7%)', err)
    ok, err = pcall(F.native_layer_norm, ms.zeros({ 4, 8 }, { dtype = 'i64' }))
    assert.is_false(ok)
    assert.matches('needs a float tensor', err)
    ok, err = pcall(F.native_layer_norm, x, nil, nil, 1e-5, 'i32')
    assert.is_false(ok)
    assert.matches('out_dtype', err)
    local _, mean, rstd = F.native_layer_norm(x)
    ok, err = pcall(F.native_layer_norm_backward, randn({ 4, 9 }, 'f32'), x, mean, rstd)
    assert.is_false(ok)
    assert.matches('gradient f32 %(4,9%).*differ in shape', err)
    ok, err = pcall(F.native_layer_norm_backward, x, x, randn({ 3 }, 'f32'), rstd)
    assert.is_false(ok)
    assert.matches('saved mean', err)
  end)
end)

describe('fused rms_norm (CPU)', function()
  for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
    it('forward equals the composed ops with Hugging Face rounding (' .. dt .. ')', function()
      local bound = ({ f64 = 1e-13, f32 = 1e-6, bf16 = 1e-2 })[dt]
      local x, w = randn({ 2, 7, 48 }, dt), randn({ 48 }, dt)
      for _, ww in ipairs({ w, false }) do
        local y, rstd = F.native_rms_norm(x, ww or nil, 1e-6)
        local ry, rrs = ref_rms_norm(x, ww or nil, 1e-6)
        assert.are.equal(dt, y.dtype)
        assert.are.same({ 14 }, rstd.shape)
        assert.is_true(relerr(y, ry) <= bound, dt .. ' ' .. relerr(y, ry))
        assert.is_true(relerr(rstd, rrs:view(-1)) <= (dt == 'bf16' and 1e-6 or bound))
      end
    end)
  end

  it('bf16: the normalised x is rounded to bf16 before the weight (as LlamaRMSNorm)', function()
    local x, w = randn({ 5, 64 }, 'bf16'), randn({ 64 }, 'bf16')
    local y = F.native_rms_norm(x, w, 1e-6)
    -- the old composed path: xhat in f32, cast to bf16, times w (one bf16 rounding)
    local xf = x:to('f32')
    local xhat = F.mul(xf, F.rsqrt(F.add(F.mean(F.mul(xf, xf), -1, true), 1e-6))):to('bf16')
    assert.is_true(relerr(y, F.mul(xhat, w)) <= 1e-2)
    local diff = 0
    local a, b = flat(y), flat(F.mul(xhat, w))
    for i = 1, #a do if a[i] ~= b[i] then diff = diff + 1 end end
    assert.is_true(diff <= #a / 50, diff .. ' of ' .. #a .. ' elements differ')
  end)

  for _, dt in ipairs({ 'f64', 'f32' }) do
    it('backward equals the composed autograd path (' .. dt .. ')', function()
      local bound = ({ f64 = 1e-12, f32 = 1e-5 })[dt]
      local x, w, g = randn({ 3, 33 }, dt), randn({ 33 }, dt), randn({ 3, 33 }, dt)
      local _, rstd = F.native_rms_norm(x, w)
      local dx, dw = F.native_rms_norm_backward(g, x, rstd, w)
      local x64 = x:to('f64'):requires_grad_()
      local w64 = w:to('f64'):requires_grad_()
      local y = x64 / ((x64 * x64):mean(-1, true) + 1e-6):sqrt() * w64
      y:backward(g:to('f64'))
      assert.is_true(relerr(dx, x64.grad) <= bound, 'dx ' .. relerr(dx, x64.grad))
      assert.is_true(relerr(dw, w64.grad) <= bound, 'dw ' .. relerr(dw, w64.grad))
    end)
  end
end)

describe('nn.functional norms on the fused ops', function()
  it('are one node each and save no (N, C) copy', function()
    A.clear_tape()
    local x = randn({ 16, 32 }, 'f32'):requires_grad_()
    local w = randn({ 32 }, 'f32'):requires_grad_()
    local before = ms.live_bytes()
    local y = nnf.layer_norm(x, w, nil)
    assert.are.equal(1, A.tape_size())
    -- y plus two (16) statistics: no saved xhat
    assert.is_true(ms.live_bytes() - before <= 16 * 32 * 4 + 2 * 16 * 4 + 512)
    local z = nnf.rms_norm(y, w)
    assert.are.equal(2, A.tape_size())
    z:sum():backward()
    assert.are.equal('f32', x.grad.dtype)
    assert.are.same({ 32 }, w.grad.shape)
  end)
  it('keep the dtype rules of the composed versions', function()
    local x, w = randn({ 4, 8 }, 'bf16'), randn({ 8 }, 'f32')
    assert.are.equal('bf16', nnf.layer_norm(x, w, w).dtype)   -- x's dtype
    assert.are.equal('f32', nnf.rms_norm(x, w).dtype)         -- x * w promotes
    assert.are.equal('bf16', nnf.rms_norm(x, w:to('bf16')).dtype)
    assert.are.equal('f64', nnf.rms_norm(randn({ 4, 8 }), nil).dtype)
  end)
end)

describe('fused adamw_ (CPU)', function()
  -- element-by-element torch.optim.AdamW in Lua numbers
  local function lua_adamw(p, g, m, v, lr, b1, b2, eps, wd, step)
    for i = 1, #p do
      p[i] = p[i] * (1 - lr * wd)
      m[i] = b1 * m[i] + (1 - b1) * g[i]
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
      p[i] = p[i] - lr / (1 - b1 ^ step) * m[i] / (math.sqrt(v[i]) / math.sqrt(1 - b2 ^ step) + eps)
    end
  end

  it('equals a Lua recomputation over several steps (f64, a list of tensors)', function()
    local ps = { randn({ 3, 4 }), randn({ 7 }) }
    local ms_, vs = { ms.zeros({ 3, 4 }, { dtype = 'f64' }), ms.zeros({ 7 }, { dtype = 'f64' }) },
      { ms.zeros({ 3, 4 }, { dtype = 'f64' }), ms.zeros({ 7 }, { dtype = 'f64' }) }
    local ref = {}
    for i = 1, 2 do ref[i] = { p = flat(ps[i]), m = flat(ms_[i]), v = flat(vs[i]) } end
    for step = 1, 5 do
      local gs = { randn({ 3, 4 }), randn({ 7 }) }
      F.adamw_(ps, gs, ms_, vs, 0.01, 0.9, 0.95, 1e-8, 0.1, step)
      for i = 1, 2 do
        lua_adamw(ref[i].p, flat(gs[i]), ref[i].m, ref[i].v, 0.01, 0.9, 0.95, 1e-8, 0.1, step)
        local got = flat(ps[i])
        for k = 1, #got do assert.is_true(math.abs(got[k] - ref[i].p[k]) <= 1e-14 * math.max(1, math.abs(got[k]))) end
        local gm, gv = flat(ms_[i]), flat(vs[i])
        for k = 1, #gm do
          assert.is_true(math.abs(gm[k] - ref[i].m[k]) <= 1e-15)
          assert.is_true(math.abs(gv[k] - ref[i].v[k]) <= 1e-15)
        end
      end
    end
  end)

  -- grad_scale: the step equals scaling the gradients first (by the scale
  -- in their dtype), bit for bit
  for _, gd in ipairs({ 'f32', 'bf16', 'f64' }) do
    it(('grad_scale with %s gradients: the same bits as scaling the gradients first'):format(gd), function()
      local pd = gd == 'f64' and 'f64' or 'f32'
      local n = { 1000, 7 }
      local p1, p2, m1, m2, v1, v2, gs = {}, {}, {}, {}, {}, {}, {}
      for i, k in ipairs(n) do
        p1[i] = randn({ k }):to(pd); p2[i] = p1[i]:clone()
        m1[i], m2[i] = ms.zeros({ k }, { dtype = pd }), ms.zeros({ k }, { dtype = pd })
        v1[i], v2[i] = ms.zeros({ k }, { dtype = pd }), ms.zeros({ k }, { dtype = pd })
      end
      for step = 1, 3 do
        local scale = ms.tensor({ 0.3 + 0.17 * step }, { dtype = 'f64' })
        local g1, g2 = {}, {}
        for i, k in ipairs(n) do
          g1[i] = (randn({ k }) * 3):to(gd)
          g2[i] = g1[i]:clone()
          F.mul_(g2[i], scale:to(gd))       -- what clip_grad_norm does to the gradients
        end
        F.adamw_(p1, g1, m1, v1, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, nil, scale)
        F.adamw_(p2, g2, m2, v2, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
        assert.is_true(math.abs(flat(g1[1])[1] - flat(g2[1])[1]) > 0)   -- the gradients themselves stay unscaled
      end
      for i = 1, #n do
        assert.are.same(flat(p2[i]), flat(p1[i]))
        assert.are.same(flat(m2[i]), flat(m1[i]))
        assert.are.same(flat(v2[i]), flat(v1[i]))
      end
    end)
  end

  it('grad_scale must be one f64 element', function()
    local p, g, m, v = randn({ 4 }):to('f32'), randn({ 4 }):to('f32'), ms.zeros({ 4 }), ms.zeros({ 4 })
    for _, bad in ipairs({ ms.tensor({ 0.5 }), ms.tensor({ 0.5, 0.5 }, { dtype = 'f64' }) }) do
      local ok, err = pcall(F.adamw_, p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0, 1, nil, bad)
      assert.is_false(ok)
      assert.matches('grad_scale must be one f64 element', err, 1, true)
    end
    local ok, err = pcall(F.adamw_, p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0, 1, nil, 0.5)
    assert.is_false(ok)
    assert.matches('grad_scale must be a tensor', err, 1, true)
  end)

  for _, c in ipairs({ { 'f32', 'f32' }, { 'f32', 'bf16' }, { 'bf16', 'f32' }, { 'bf16', 'bf16' } }) do
    it(('%s parameters with %s gradients and f32 moments, rounded once'):format(c[1], c[2]), function()
      local p = randn({ 1000 }, c[1])
      local g = randn({ 1000 }, c[2])
      local m, v = randn({ 1000 }, 'f32'), F.abs(randn({ 1000 }, 'f32'))
      local rp, rm, rv = flat(p), flat(m), flat(v)
      F.adamw_(p, g, m, v, 1e-2, 0.8, 0.99, 1e-6, 0.05, 3)
      lua_adamw(rp, flat(g), rm, rv, 1e-2, 0.8, 0.99, 1e-6, 0.05, 3)
      local want = ms.tensor(rp, { dtype = 'f64' }):to(c[1])
      assert.are.same(flat(want), flat(p))   -- f64 math, one rounding
      assert.is_true(relerr(m, ms.tensor(rm, { dtype = 'f64' })) <= 1e-7)
      assert.is_true(relerr(v, ms.tensor(rv, { dtype = 'f64' })) <= 1e-7)
    end)
  end

  it('with f32 masters of bf16 parameters: the master takes the f32 update, the parameter its rounding', function()
    local f = randn({ 1000 }, 'f32')
    local p, w = f:to('bf16'), f:clone()
    local q = f:clone()                               -- an f32 parameter stepped alongside
    local m, v = ms.zeros({ 1000 }), ms.zeros({ 1000 })
    local m2, v2 = ms.zeros({ 1000 }), ms.zeros({ 1000 })
    local p0 = p:clone()
    for step = 1, 3 do
      local g = randn({ 1000 }, 'bf16')
      F.adamw_({ p, p0 }, { g, g }, { m, m2:clone() }, { v, v2:clone() }, 1e-2, 0.8, 0.99, 1e-6, 0.05, step,
        { w, false })
      F.adamw_(q, g:to('f32'), m2, v2, 1e-2, 0.8, 0.99, 1e-6, 0.05, step)
    end
    assert.are.same(flat(q), flat(w))                 -- the same f32 values step for step
    assert.are.same(flat(w:to('bf16')), flat(p))      -- p is the rounded master
    local ok, err = pcall(F.adamw_, p, randn({ 1000 }, 'bf16'), m, v, 1e-2, 0.9, 0.99, 1e-8, 0, 4, { f:to('bf16') })
    assert.is_false(ok)
    assert.matches('the master of parameter', err, 1, true)
    ok, err = pcall(F.adamw_, q, randn({ 1000 }, 'f32'), m2, v2, 1e-2, 0.9, 0.99, 1e-8, 0, 4, { w })
    assert.is_false(ok)
    assert.matches('for a bf16/f16 parameter', err, 1, true)
  end)

  it('takes the moments as views of one flat buffer', function()
    local p, g = randn({ 6 }, 'f32'), randn({ 6 }, 'f32')
    local state = ms.zeros({ 2, 6 })
    local p2, m2, v2 = p:clone(), ms.zeros({ 6 }), ms.zeros({ 6 })
    F.adamw_(p, g, state:select(1, 1), state:select(1, 2), 1e-2, 0.9, 0.99, 1e-8, 0, 1)
    F.adamw_(p2, g, m2, v2, 1e-2, 0.9, 0.99, 1e-8, 0, 1)
    assert.are.same(flat(p2), flat(p))
    assert.are.same(flat(v2), flat(state:select(1, 2)))
  end)

  it('refuses bad arguments with a message', function()
    local p, g = randn({ 4 }, 'f32'), randn({ 4 }, 'f32')
    local m, v = ms.zeros({ 4 }), ms.zeros({ 4 })
    local function fails(pat, ...)
      local ok, err = pcall(F.adamw_, ...)
      assert.is_false(ok)
      assert.matches(pat, err)
    end
    fails('step must be >= 1', p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0, 0)
    fails('differ in size', p, randn({ 5 }, 'f32'), m, v, 1e-3, 0.9, 0.999, 1e-8, 0, 1)
    fails('moments must be f32', p, g, m:to('bf16'), v, 1e-3, 0.9, 0.999, 1e-8, 0, 1)
    fails('must be contiguous', randn({ 4, 4 }, 'f32'):t(), randn({ 16 }, 'f32'), ms.zeros({ 16 }), ms.zeros({ 16 }),
      1e-3, 0.9, 0.999, 1e-8, 0, 1)
    fails('must not overlap', p, g, m, m, 1e-3, 0.9, 0.999, 1e-8, 0, 1)
    fails('2 parameters, 1 gradients', { p, p }, { g }, { m, m }, { v, v }, 1e-3, 0.9, 0.999, 1e-8, 0, 1)
    fails('betas must be in', p, g, m, v, 1e-3, 1.0, 0.999, 1e-8, 0, 1)
  end)
end)

describe('sum_squares (CPU)', function()
  it('adds the squares of a list of tensors of any float dtype', function()
    local ts = { randn({ 70000 }, 'f32'), randn({ 3, 5 }, 'bf16'), randn({ 9 }), randn({ 4, 6 }, 'f32'):t() }
    local want = 0
    for _, t in ipairs(ts) do for _, x in ipairs(flat(t)) do want = want + x * x end end
    local s = F.sum_squares(ts)
    assert.are.equal('f64', s.dtype)
    assert.are.equal(0, s.ndim)
    assert.is_true(math.abs(s:item() - want) <= 1e-12 * want)
    assert.is_true(math.abs(F.sum_squares(ts[3]):item() - F.sum(F.mul(ts[3], ts[3])):item()) <= 1e-12)
  end)
  it('does not depend on the number of threads', function()
    local n0 = ms.get_num_threads()
    local t = randn({ 300000 }, 'f32')
    ms.set_num_threads(1)
    local a = F.sum_squares(t):item()
    ms.set_num_threads(3)
    local b = F.sum_squares(t):item()
    ms.set_num_threads(n0)
    assert.are.equal(a, b)
  end)
  it('refuses integer tensors and empty lists', function()
    local ok, err = pcall(F.sum_squares, { randn({ 2 }), ms.zeros({ 2 }, { dtype = 'i64' }) })
    assert.is_false(ok)
    assert.matches('tensor 1 i64 %(2%) cpu is not a float tensor', err)
    ok, err = pcall(F.sum_squares, {})
    assert.is_false(ok)
    assert.matches('non%-empty list', err)
  end)
end)

describe('fused rope (CPU)', function()
  for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
    it('equals x·cos + rotate_half(x)·sin (' .. dt .. ')', function()
      local bound = ({ f64 = 1e-14, f32 = 1e-6, bf16 = 1e-2 })[dt]
      local x = randn({ 2, 3, 5, 8 }, dt)
      local cos, sin = nnf.rope_cache(5, 8, 10000, dt == 'f64' and 'f64' or 'f32')
      local y = F.rope(x, cos, sin)
      assert.are.equal(dt, y.dtype)
      local x64 = x:to('f64')
      local want = F.add(F.mul(x64, cos:to('f64')), F.mul(rotate_half(x64), sin:to('f64')))
      assert.is_true(relerr(y, want) <= bound, relerr(y, want))
    end)
  end
  it('backward is the transpose: <rope(x), g> = <x, rope_backward(g)>', function()
    local x, g = randn({ 3, 6, 16 }), randn({ 3, 6, 16 })
    local cos, sin = randn({ 6, 16 }), randn({ 6, 16 })   -- any constants, not just rotations
    local lhs = F.sum(F.mul(F.rope(x, cos, sin), g)):item()
    local rhs = F.sum(F.mul(x, F.rope_backward(g, cos, sin))):item()
    assert.is_true(math.abs(lhs - rhs) <= 1e-12 * math.abs(lhs))
  end)
  it('reads a transposed (B, H, T, D) view like its contiguous copy', function()
    local q = randn({ 2, 5, 3, 8 }, 'f32')                -- (B, T, H, D)
    local qt = q:transpose(2, 3)                          -- (B, H, T, D) view
    local cos, sin = nnf.rope_cache(5, 8, 500, 'f32')
    assert.are.same(flat(F.rope(qt:contiguous(), cos, sin)), flat(F.rope(qt, cos, sin)))
  end)
  it('names bad shapes', function()
    local ok, err = pcall(F.rope, randn({ 2, 4, 7 }), randn({ 4, 7 }), randn({ 4, 7 }))
    assert.is_false(ok)
    assert.matches('even D', err)
    ok, err = pcall(F.rope, randn({ 2, 4, 8 }), randn({ 5, 8 }), randn({ 5, 8 }))
    assert.is_false(ok)
    assert.matches('must be %(T, D%) = %(4, 8%)', err)
  end)
  it('apply_rotary takes the fused op for (T, D) cos/sin and the composed path otherwise', function()
    local x = randn({ 2, 2, 4, 8 })
    local cos, sin = nnf.rope_cache(4, 8, 10000, 'f64')
    local fused = nnf.apply_rotary(x, cos, sin)
    local composed = nnf.apply_rotary(x, cos:view(1, 1, 4, 8), sin:view(1, 1, 4, 8))
    assert.is_true(relerr(fused, composed) <= 1e-14)
  end)
end)
