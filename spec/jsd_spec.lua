-- The fused linear JSD on the CPU (lua/moonshard/jsd.lua): PyTorch's
-- float64 cases of TRL's generalized JSD (spec/fixtures/jsd, made by
-- tools/make_jsd_fixture.py) in f64 (1e-10) and f32 (1e-5), chunk-size
-- independence, finite differences in f64, the grad_output scale, leading
-- dims, all tokens ignored, bf16 autocast, the teacher kept constant, and
-- the errors.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local S = require 'spec.support'
local json = require 'dkjson'

local nnf = ms.nn.functional
local JSD = nnf.fused_linear_jsd
local values, relerr, finite, errmsg = S.values, S.relerr, S.finite, S.errmsg
local dir = T.root .. '/spec/fixtures/jsd'

local function cases()
  local f = assert(io.open(dir .. '/cases.json'))
  local meta = json.decode(f:read('*a'))
  f:close()
  return meta.cases
end

-- the case's tensors (in dtype) and options
local function load(name, c, dtype)
  local t = ms.load_safetensors(dir .. '/' .. name .. '.safetensors')
  local function as(x) return dtype == 'f64' and x or x:to(dtype) end
  local o = { beta = c.beta, temperature = c.temperature, reduction = c.reduction, labels = t.labels }
  return as(t.xs), as(t.Ws), as(t.xt), as(t.Wt), o, t
end

local function run(xs, Ws, xt, Wt, o)
  xs, Ws = xs:clone():requires_grad_(), Ws:clone():requires_grad_()
  local loss = JSD(xs, Ws, xt, Wt, o)
  loss:backward()
  return loss, xs.grad, Ws.grad
end

describe('fused_linear_jsd', function()
  it('matches PyTorch\'s float64 generalized JSD (TRL\'s) at beta 0, 0.3, 0.5, 0.8, 1, temperatures, labels, '
    .. 'mean and sum: f64 within 1e-10, f32 within 1e-5', function()
    local n = 0
    for name, c in pairs(cases()) do
      n = n + 1
      for _, dt in ipairs({ 'f64', 'f32' }) do
        local xs, Ws, xt, Wt, o, ref = load(name, c, dt)
        local bound = dt == 'f64' and 1e-10 or 1e-5
        local loss, gx, gw = run(xs, Ws, xt, Wt, o)
        assert.are.equal(dt, loss.dtype)
        local e = math.abs(loss:item() - ref.loss:item()) / math.abs(ref.loss:item())
        assert.is_true(e <= bound, ('%s %s: loss %.17g, reference %.17g'):format(name, dt, loss:item(), ref.loss:item()))
        assert.is_true(relerr(gx, ref.grad_xs) <= bound, ('%s %s grad_xs %.3e'):format(name, dt, relerr(gx, ref.grad_xs)))
        assert.is_true(relerr(gw, ref.grad_Ws) <= bound, ('%s %s grad_Ws %.3e'):format(name, dt, relerr(gw, ref.grad_Ws)))
        assert.are.equal(dt, gx.dtype)
      end
    end
    assert.are.equal(5, n)
  end)

  it('gives the same loss and gradients whatever the chunk (1 row, 4 rows, all, a tiny memory budget)', function()
    local c = cases()['beta0.3_temp2_labels']
    local xs, Ws, xt, Wt, o = load('beta0.3_temp2_labels', c, 'f64')
    local l0, gx0, gw0 = run(xs, Ws, xt, Wt, o)
    for _, extra in ipairs({ { chunk_size = 1 }, { chunk_size = 4 }, { chunk_size = 11 }, { memory_budget = 1000 } }) do
      local oo = {}
      for k, v in pairs(o) do oo[k] = v end
      for k, v in pairs(extra) do oo[k] = v end
      local l, gx, gw = run(xs, Ws, xt, Wt, oo)
      assert.is_true(math.abs(l:item() - l0:item()) <= 1e-13 * math.abs(l0:item()))
      assert.is_true(relerr(gx, gx0) <= 1e-13 and relerr(gw, gw0) <= 1e-13)
    end
  end)

  it('finite differences (f64): the gradients of xs and Ws at beta 0, 0.4 and 1 with labels and a temperature',
    function()
    for _, beta in ipairs({ 0, 0.4, 1 }) do
      local xs = ms.randn({ 5, 6 }, { dtype = 'f64', seed = 31 }):requires_grad_()
      local Ws = (ms.randn({ 9, 6 }, { dtype = 'f64', seed = 32 }) * 0.8):requires_grad_()
      local xt = ms.randn({ 5, 4 }, { dtype = 'f64', seed = 33 })
      local Wt = ms.randn({ 9, 4 }, { dtype = 'f64', seed = 34 })
      local labels = ms.tensor({ 3, -100, 0, 8, 5 }, { dtype = 'i64' })
      local worst = ms.autograd.gradcheck(function()
        return JSD(xs, Ws, xt, Wt, { beta = beta, temperature = 1.3, labels = labels, chunk_size = 2 })
      end, { xs, Ws })
      assert.is_true(worst <= 1e-6, ('beta %g: worst relative error %.3e'):format(beta, worst))
    end
  end)

  it('scales the gradients by grad_output; (B, T, H) inputs give a gradient of xs\'s shape', function()
    local c = cases()['beta0.5']
    local xs, Ws, xt, Wt, o = load('beta0.5', c, 'f64')
    local _, gx0, gw0 = run(xs, Ws, xt, Wt, o)
    local x3 = xs:clone():reshape({ 1, 7, 12 }):requires_grad_()
    local w = Ws:clone():requires_grad_()
    local loss = JSD(x3, w, xt:reshape({ 7, 1, 20 }), Wt, o)
    assert.are.same({}, loss.shape)
    local scaled = loss * 2.5
    scaled:backward()
    assert.are.same({ 1, 7, 12 }, x3.grad.shape)
    assert.is_true(relerr(x3.grad:reshape({ 7, 12 }), gx0 * 2.5) <= 1e-14)
    assert.is_true(relerr(w.grad, gw0 * 2.5) <= 1e-14)
  end)

  it('every token ignored: mean 0 and sum 0, zero gradients, no NaN', function()
    local xs = ms.randn({ 4, 5 }, { dtype = 'f32', seed = 41 })
    local Ws = ms.randn({ 7, 5 }, { dtype = 'f32', seed = 42 })
    local xt, Wt = ms.randn({ 4, 3 }, { dtype = 'f32', seed = 43 }), ms.randn({ 7, 3 }, { dtype = 'f32', seed = 44 })
    local labels = ms.full({ 4 }, -100, { dtype = 'i64' })
    for _, red in ipairs({ 'mean', 'sum' }) do
      local loss, gx, gw = run(xs, Ws, xt, Wt, { labels = labels, reduction = red })
      assert.are.equal(0, loss:item())
      assert.is_true(finite(gx) and finite(gw))
      for _, v in ipairs(values(gx)) do assert.are.equal(0, v) end
      for _, v in ipairs(values(gw)) do assert.are.equal(0, v) end
    end
  end)

  it('under bf16 autocast: the GEMMs in bf16, the f32 result within 2e-2; the teacher gets no gradient', function()
    local c = cases()['beta0.3_temp2_labels']
    local xs, Ws, xt, Wt, o, ref = load('beta0.3_temp2_labels', c, 'f32')
    xs, Ws = xs:requires_grad_(), Ws:requires_grad_()
    xt, Wt = xt:requires_grad_(), Wt:requires_grad_()
    local loss = require('moonshard.amp').autocast('bf16', JSD, xs, Ws, xt, Wt, o)
    loss:backward()
    assert.are.equal('f32', Ws.grad.dtype)
    assert.is_true(math.abs(loss:item() - ref.loss:item()) <= 2e-2 * math.abs(ref.loss:item()))
    assert.is_true(relerr(xs.grad, ref.grad_xs) <= 2e-2, relerr(xs.grad, ref.grad_xs))
    assert.is_true(relerr(Ws.grad, ref.grad_Ws) <= 2e-2, relerr(Ws.grad, ref.grad_Ws))
    assert.is_nil(xt.grad)
    assert.is_nil(Wt.grad)
  end)

  it('the row pass takes bf16/f16 logits (the same values as f32 give the same loss and gradient) and writes the '
    .. 'gradient over s in place; it refuses g sharing t', function()
    local C = T.C
    local n, V = 5, 301
    local labels = ms.tensor({ 3, -100, 0, 7, 300 }, { dtype = 'i64' })
    for _, dt in ipairs({ 'bf16', 'f16' }) do
      for _, beta in ipairs({ 0, 0.35, 1 }) do
        local s = (ms.randn({ n, V }, { seed = 11 }) * 3):to(dt)
        local t = (ms.randn({ n, V }, { seed = 12 }) * 3):to(dt)
        local function rows(sl, tl, g)
          local l = ms.empty({ n })
          T.check(C.ms_jsd_rows(g, l, sl, tl, labels, -100, beta, 0.7))
          return l
        end
        local gf = ms.empty({ n, V })
        local lf = rows(s:float(), t:float(), gf)
        local g16 = ms.empty({ n, V }, { dtype = dt })
        local l16 = rows(s, t, g16)
        assert.are.same(values(lf), values(l16))
        assert.are.same(values(gf:to(dt)), values(g16))
        assert.is_true(values(lf)[1] > 0 and values(lf)[2] == 0)
        -- in place: g is s
        local s2 = s:clone()
        local l2 = rows(s2, t, s2)
        assert.are.same(values(l16), values(l2))
        assert.are.same(values(g16), values(s2))
      end
    end
    local s, t = ms.randn({ 2, 9 }, { seed = 1 }), ms.randn({ 2, 9 }, { seed = 2 })
    local rc = C.ms_jsd_rows(t, ms.empty({ 2 }), s, t, nil, -100, 0.5, 1)
    assert.are.equal(-1, rc)
    assert.matches('g f32 (2,9) cpu may only be s itself', require('ffi').string(C.ms_last_error()), 1, true)
  end)

  it('says what is wrong with bad arguments', function()
    local xs, Ws = ms.randn({ 4, 5 }, { seed = 1 }), ms.randn({ 7, 5 }, { seed = 2 })
    local xt, Wt = ms.randn({ 4, 3 }, { seed = 3 }), ms.randn({ 7, 3 }, { seed = 4 })
    for _, c in ipairs({
      { function() JSD(xs, Ws, xt, Wt, { beta = 1.5 }) end, 'beta must be a number in [0, 1], got 1.5' },
      { function() JSD(xs, Ws, xt, Wt, { temperature = 0 }) end, 'temperature must be a positive number, got 0' },
      { function() JSD(xs, Ws, xt, Wt, { reduction = 'none' }) end, 'reduction must be \'mean\' or \'sum\', got none' },
      { function() JSD(xs, Ws, xt, ms.randn({ 6, 3 }), {}) end, 'shapes do not fit: xs (4, 5) with Ws (7, 5) (V, Hs), '
        .. 'xt (4, 3) with Wt (6, 3)' },
      { function() JSD(xs, Ws, ms.randn({ 5, 3 }), Wt, {}) end, 'shapes do not fit' },
      { function() JSD(xs, Ws:to('f64'), xt, Wt, {}) end, 'dtypes xs f32, Ws f64, xt f32, Wt f32' },
      { function() JSD(xs, Ws, xt, Wt, { labels = ms.tensor({ 1, 2 }, { dtype = 'i64' }) }) end,
        'labels must be 4 integer ids on cpu, got i64 (2)' },
      { function() JSD(xs, Ws, xt, Wt, { chunk_size = 0 }) end, 'chunk_size must be a positive integer, got 0' },
      { function() JSD(xs, 'W', xt, Wt) end, 'Ws (the student\'s head) must be a tensor, got string' },
    }) do
      local msg = errmsg(c[1])
      assert.is_truthy(msg:find(c[2], 1, true), msg)
    end
  end)
end)
