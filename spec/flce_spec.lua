-- Fused linear cross-entropy on the CPU (core/flce.c, lua/moonshard/flce.lua):
-- the fixtures of ../shared/fixtures/flce within 1e-5 (f32), random shapes
-- against the unfused path (nn.functional.cross_entropy of x·Wᵀ, and a
-- reference composed of recorded ops for the options cross_entropy lacks),
-- chunk-size and thread-count independence, the edge cases, autograd (f64
-- finite differences, scaling, accumulation, memory), lm_loss through the
-- golden models on both paths, and the errors.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local nn = require 'moonshard.nn'
local flce = require 'moonshard.flce'
local S = require 'spec.support'

local nnf = nn.functional
local F = ms.raw
local FLCE = nnf.fused_linear_cross_entropy

local fixtures = T.root .. '/../shared/fixtures'

-- values(t): host copy as a flat Lua list of doubles; relerr(got, want):
-- ‖got − want‖ / ‖want‖ (‖got‖ when want is all zeros); finite(t)
local values, relerr, finite = S.values, S.relerr, S.finite

local function bitwise_equal(a, b)
  local x, y = values(a), values(b)
  if #x ~= #y then return false end
  for i = 1, #x do if x[i] ~= y[i] then return false end end
  return true
end

local errmsg = S.errmsg   -- the message of the error fn() raises

local seed = 500
local function randn(shape, dtype, scale)
  seed = seed + 1
  local t = ms.randn(shape, { dtype = 'f64', seed = seed })
  if scale then t = F.mul(t, scale) end
  return dtype and dtype ~= 'f64' and t:to(dtype) or t
end

-- targets in [0, V) with about `ignored` of them set to ignore_index
local function targets(n, V, ignored, ignore_index)
  seed = seed + 1
  local u = ms.rand({ n }, { dtype = 'f64', seed = seed })
  local ids = F.mul(u, V):to('i64')
  local r = ms.rand({ n }, { dtype = 'f64', seed = seed + 1000 })
  local drop = F.lt(r, ignored or 0)
  return F.where(drop, ms.full({ n }, ignore_index or -100, { dtype = 'i64' }), ids)
end

-- The unfused loss from recorded ops (f64 autograd gives its gradients):
-- logits = x Wᵀ + b, softcap, then torch's cross_entropy with weight,
-- ignore_index and label smoothing, plus the z-loss on valid tokens.
local function reference(x, W, t, o)
  o = o or {}
  local N, V = x.shape[1], W.shape[1]
  local logits = ms.matmul(x, W, false, true)
  if o.bias then logits = logits + o.bias end
  if o.softcap and o.softcap > 0 then logits = ms.tanh(logits / o.softcap) * o.softcap end
  local lsm = ms.log_softmax(logits, -1)
  local lse = ms.logsumexp(logits, -1)
  local valid = F.ne(t, o.ignore_index or -100)
  local vf = valid:to(x.dtype)
  local tcl = F.mul(t, valid:to('i64'))
  local picked = ms.gather(lsm, 2, tcl:view(N, 1)):view(N)
  local wy, smooth
  if o.ce_weight then
    local cw = o.ce_weight:to(x.dtype)
    wy = F.index_select(cw, 1, tcl)
    smooth = -(lsm * cw):sum(-1)
  else
    wy = ms.ones({ N }, { dtype = x.dtype })
    smooth = -lsm:sum(-1)
  end
  local eps = o.label_smoothing or 0
  local ce = ((-(picked * wy)) * (1 - eps) + smooth * (eps / V)) * vf
  local z = lse * lse * (o.lse_square_scale or 0) * vf
  local red = o.reduction or 'mean'
  if red == 'none' then return ce + z, z end
  if red == 'sum' then return ce:sum() + z:sum(), z:sum() end
  local D, n = F.sum(F.mul(wy, vf)):item(), F.sum(vf):item()
  local cm = D > 0 and ce:sum() / D or ce:sum() * 0
  local zm = n > 0 and z:sum() / n or z:sum() * 0
  return cm + zm, zm
end

local function ref_accuracy(x, W, t, o)
  local logits = F.matmul(x:double(), W:double(), false, true)
  if o and o.bias then logits = F.add(logits, o.bias:double()) end
  local _, am = F.max(logits, -1)
  local valid = F.ne(t, (o and o.ignore_index) or -100)
  local hit = F.sum(F.mul(F.eq(am, t):to('f64'), valid:to('f64'))):item()
  local n = F.sum(valid:to('f64')):item()
  return n > 0 and hit / n or 0
end

-- fused and reference losses and gradients (x, W, bias) for one setting
local function both(x, W, t, o, dtype)
  local function leaf(v) return v and v:to({ dtype = dtype, copy = true }):requires_grad_() or nil end
  local xf, Wf = leaf(x), leaf(W)
  local of = {}
  for k, v in pairs(o) do of[k] = v end
  if o.bias then of.bias = leaf(o.bias) end
  if o.ce_weight then of.ce_weight = o.ce_weight:to(dtype) end
  of.return_z_loss, of.return_accuracy = true, true
  local loss, z, acc = FLCE(xf, Wf, t, of)
  local g = (o.reduction == 'none') and randn({ t:numel() }, loss.dtype) or nil
  loss:backward(g)
  local xr, Wr = x:to({ dtype = 'f64', copy = true }):requires_grad_(), W:to({ dtype = 'f64', copy = true }):requires_grad_()
  local orf = {}
  for k, v in pairs(o) do orf[k] = v end
  if o.bias then orf.bias = o.bias:to({ dtype = 'f64', copy = true }):requires_grad_() end
  local lr, zr = reference(xr, Wr, t, orf)
  lr:backward(g and g:double() or nil)
  return {
    loss = { loss, lr }, z = { z, zr }, acc = { acc:item(), ref_accuracy(x, W, t, o) },
    gx = { xf.grad, xr.grad }, gW = { Wf.grad, Wr.grad },
    gb = o.bias and { of.bias.grad, orf.bias.grad } or nil,
  }
end

local function assert_close(r, bound, what)
  for _, k in ipairs({ 'loss', 'z', 'gx', 'gW', 'gb' }) do
    local pair = r[k]
    if pair then
      assert(pair[1] ~= nil and pair[2] ~= nil, (what or '') .. ' ' .. k .. ': missing')
      local e = relerr(pair[1], pair[2])
      assert.is_true(e <= bound, ('%s %s: relative error %.3g > %g'):format(what or '', k, e, bound))
    end
  end
  assert.is_true(math.abs(r.acc[1] - r.acc[2]) < 1e-6, ('accuracy %g vs %g'):format(r.acc[1], r.acc[2]))
end

describe('fused_linear_cross_entropy', function()
  describe('fixtures (../shared/fixtures/flce)', function()
    local cases, names = S.json_cases(fixtures .. '/flce/cases.json')
    it('are all there', function() assert.is_true(#names >= 9, 'missing ' .. fixtures .. '/flce/cases.json') end)
    for _, name in ipairs(names) do
      it(name .. ': loss, z_loss, accuracy, grad_x, grad_W, grad_bias within 1e-5', function()
        local c = cases[name]
        local st = ms.load_safetensors(fixtures .. '/flce/' .. name .. '.safetensors')
        local x, W = st.x:clone():requires_grad_(), st.W:clone():requires_grad_()
        local o = {
          reduction = c.reduction, ignore_index = c.ignore_index, label_smoothing = c.label_smoothing,
          lse_square_scale = c.lse_square_scale, softcap = c.softcap,
          return_z_loss = true, return_accuracy = true,
        }
        if c.bias then o.bias = st.bias:clone():requires_grad_() end
        if c.ce_weight then o.ce_weight = st.ce_weight end
        local loss, z, acc = FLCE(x, W, st.targets, o)
        assert.is_true(relerr(loss, st.loss) <= 1e-5, 'loss ' .. relerr(loss, st.loss))
        assert.is_true(relerr(z, st.z_loss) <= 1e-5, 'z_loss ' .. relerr(z, st.z_loss))
        assert.is_true(math.abs(acc:item() - st.accuracy:item()) <= 1e-6)
        loss:backward(st.grad_output:reshape(loss.shape))
        assert.is_true(relerr(x.grad, st.grad_x) <= 1e-5, 'grad_x ' .. relerr(x.grad, st.grad_x))
        assert.is_true(relerr(W.grad, st.grad_W) <= 1e-5, 'grad_W ' .. relerr(W.grad, st.grad_W))
        if c.bias then
          assert.is_true(relerr(o.bias.grad, st.grad_bias) <= 1e-5, 'grad_bias ' .. relerr(o.bias.grad, st.grad_bias))
        end
        -- and in f64, closer still
        local x64, W64 = st.x:double():requires_grad_(), st.W:double():requires_grad_()
        if c.bias then o.bias = st.bias:double():requires_grad_() end
        local l64 = FLCE(x64, W64, st.targets, o)
        l64:backward(st.grad_output:double():reshape(l64.shape))
        assert.is_true(relerr(l64, st.loss) <= 1e-6)
        assert.is_true(relerr(W64.grad, st.grad_W) <= 1e-6)
      end)
    end
  end)

  describe('against the unfused path', function()
    it('equals nn.functional.cross_entropy of x·Wᵀ (mean, sum, none, label smoothing, ignore_index)', function()
      local x, W = randn({ 29, 16 }), randn({ 211, 16 }, nil, 0.5)
      local t = targets(29, 211, 0.2)
      for _, o in ipairs({
        {}, { reduction = 'sum' }, { reduction = 'none' }, { label_smoothing = 0.2 },
        { reduction = 'sum', label_smoothing = 0.05 }, { ignore_index = 3 },
      }) do
        for _, dt in ipairs({ 'f32', 'f64' }) do
          local function leaf(v) return v:to({ dtype = dt, copy = true }):requires_grad_() end
          local xf, Wf, xp, Wp = leaf(x), leaf(W), leaf(x), leaf(W)
          local g = o.reduction == 'none' and randn({ 29 }, dt) or nil
          local tt = o.ignore_index and F.where(F.eq(t, -100), ms.full({ 29 }, o.ignore_index, { dtype = 'i64' }), t) or t
          local lf = FLCE(xf, Wf, tt, o)
          lf:backward(g)
          local lp = nnf.cross_entropy(ms.matmul(xp, Wp, false, true), tt, o)
          lp:backward(g)
          local b = dt == 'f32' and 1e-5 or 1e-12
          assert.is_true(relerr(lf, lp) <= b, 'loss ' .. relerr(lf, lp))
          assert.is_true(relerr(xf.grad, xp.grad) <= b, 'grad_x ' .. relerr(xf.grad, xp.grad))
          assert.is_true(relerr(Wf.grad, Wp.grad) <= b, 'grad_W ' .. relerr(Wf.grad, Wp.grad))
        end
      end
    end)

    it('equals the composed reference with every option, random shapes, V prime, in f32 and f64', function()
      for _, shape in ipairs({ { 37, 13, 997 }, { 64, 32, 500 }, { 5, 7, 3 }, { 1, 9, 101 } }) do
        local BT, H, V = shape[1], shape[2], shape[3]
        local x, W = randn({ BT, H }), randn({ V, H }, nil, 0.4)
        local t = targets(BT, V, 0.15)
        local bias = randn({ V }, nil, 0.3)
        local cw = F.add(F.abs(randn({ V })), 0.1)
        for _, o in ipairs({
          { bias = bias },
          { softcap = 2.5, reduction = 'sum' },
          { lse_square_scale = 1e-3, reduction = 'none' },
          { ce_weight = cw },
          { ce_weight = cw, label_smoothing = 0.1, reduction = 'sum' },
          { bias = bias, softcap = 4, label_smoothing = 0.05, lse_square_scale = 1e-3, ce_weight = cw },
          { bias = bias, softcap = 4, label_smoothing = 0.05, lse_square_scale = 1e-3, reduction = 'none', chunk_size = 3 },
        }) do
          assert_close(both(x, W, t, o, 'f32'), 2e-5, ('f32 %dx%dx%d'):format(BT, H, V))
          assert_close(both(x, W, t, o, 'f64'), 1e-11, ('f64 %dx%dx%d'):format(BT, H, V))
        end
      end
    end)

    it('takes BT of 1 (a valid and an ignored target)', function()
      local x, W = randn({ 1, 8 }), randn({ 33, 8 })
      assert_close(both(x, W, ms.tensor({ 7 }, { dtype = 'i64' }), {}, 'f32'), 1e-5, 'BT=1')
      assert_close(both(x, W, ms.tensor({ 7 }, { dtype = 'i64' }), { reduction = 'none', softcap = 3 }, 'f32'), 1e-5)
      local r = both(x, W, ms.tensor({ -100 }, { dtype = 'i64' }), {}, 'f32')
      assert.are.equal(0, r.loss[1]:item())
      assert.are.equal(0, relerr(r.gW[1], r.gW[2]))
    end)

    it('computes bf16 and f16 inputs in f32 (within 1e-2 of the f32 result)', function()
      local x, W = randn({ 24, 16 }), randn({ 150, 16 }, nil, 0.5)
      local t = targets(24, 150, 0.1)
      for _, dt in ipairs({ 'bf16', 'f16' }) do
        local xb, Wb = x:to(dt):requires_grad_(), W:to(dt):requires_grad_()
        local lb = FLCE(xb, Wb, t, { softcap = 3 })
        assert.are.equal('f32', lb.dtype)
        lb:backward()
        assert.are.equal(dt, xb.grad.dtype)
        assert.are.equal(dt, Wb.grad.dtype)
        local x32, W32 = xb:detach():float():requires_grad_(), Wb:detach():float():requires_grad_()
        local l32 = FLCE(x32, W32, t, { softcap = 3 })
        l32:backward()
        assert.is_true(relerr(lb, l32) <= 1e-5)
        assert.is_true(relerr(xb.grad, x32.grad) <= 1e-2)
        assert.is_true(relerr(Wb.grad, W32.grad) <= 1e-2)
      end
    end)
  end)

  describe('chunking', function()
    local x, W = randn({ 53, 12 }), randn({ 389, 12 })
    local t = targets(53, 389, 0.1)
    local b = randn({ 389 }, nil, 0.2)
    local function run(o)
      local xf, Wf, bf = x:float():requires_grad_(), W:float():requires_grad_(), b:float():requires_grad_()
      o.bias = bf
      local loss = FLCE(xf, Wf, t, o)
      loss:backward()
      return loss, xf.grad, Wf.grad, bf.grad
    end

    it('does not change the result: chunk sizes that do not divide BT', function()
      local l0, gx0, gW0, gb0 = run({ chunk_size = 53 })
      for _, c in ipairs({ 1, 2, 7, 16, 52, 100 }) do
        local l, gx, gW, gb = run({ chunk_size = c })
        assert.is_true(bitwise_equal(l, l0), 'loss with chunk ' .. c)        -- rows summed in order
        assert.is_true(relerr(gx, gx0) <= 1e-6, 'grad_x with chunk ' .. c)
        assert.is_true(relerr(gW, gW0) <= 1e-6, 'grad_W with chunk ' .. c)
        assert.is_true(relerr(gb, gb0) <= 1e-6, 'grad_bias with chunk ' .. c)
      end
      local l, gx = run({ memory_budget = 389 * 4 * 5 })   -- 5 rows of f32 logits
      assert.is_true(bitwise_equal(l, l0) and relerr(gx, gx0) <= 1e-6)
    end)

    it('gives the same bits for any number of threads, and on every run', function()
      -- big enough for the row pass, the bias sums and the GEMMs to go parallel
      x, W, t, b = randn({ 300, 24 }), randn({ 1201, 24 }), targets(300, 1201, 0.1), randn({ 1201 }, nil, 0.2)
      local n0 = ms.get_num_threads()
      ms.set_num_threads(1)
      local a = { run({ chunk_size = 128 }) }
      ms.set_num_threads(4)
      local b2 = { run({ chunk_size = 128 }) }
      local c = { run({ chunk_size = 128 }) }
      ms.set_num_threads(n0)
      for i = 1, 4 do
        assert.is_true(bitwise_equal(a[i], b2[i]), 'output ' .. i .. ' differs between 1 and 4 threads')
        assert.is_true(bitwise_equal(b2[i], c[i]), 'output ' .. i .. ' differs between runs')
      end
    end)

    it('picks rows from a budget of BT·H elements by default; chunk_size and memory_budget override', function()
      local xx, WW = ms.empty({ 1000, 64 }), ms.empty({ 3000, 64 })
      assert.are.equal(21, flce.chunk_rows(xx, WW))                       -- 1000·64/3000
      assert.are.equal(100, flce.chunk_rows(xx, WW, { chunk_size = 100 }))
      assert.are.equal(1000, flce.chunk_rows(xx, WW, { chunk_size = 5000 }))
      assert.are.equal(10, flce.chunk_rows(xx, WW, { memory_budget = 3000 * 4 * 10 }))
      assert.are.equal(1, flce.chunk_rows(xx, ms.empty({ 10 ^ 6, 64 })))
    end)

    it('on the GPU: equal chunks of a multiple of 128 rows within 512 MiB of bf16 logits', function()
      -- the arithmetic of ms_flce_chunk_rows for device 0 (no GPU needed)
      local bf16 = ms.empty({ 1 }, { dtype = 'bf16' }).dtype_id
      local function rows(bt, h, v) return tonumber(ms.C.ms_flce_chunk_rows(nil, bt, h, v, bf16, 0)) end
      for _, c in ipairs({ { 8192, 4096, 128256, 2048 }, { 8192, 2560, 151936, 1664 }, { 8192, 768, 50304, 4096 },
                           { 1000, 64, 3000, 1000 }, { 8192, 4096, 10 ^ 7, 26 } }) do
        local bt, h, v, want = c[1], c[2], c[3], c[4]
        local r = rows(bt, h, v)
        assert.are.equal(want, r, ('BT=%d V=%d'):format(bt, v))
        if r < bt and r > 128 then
          assert.are.equal(0, r % 128)
          assert.is_true(r * v * 2 <= 512 * 2 ^ 20)
          local n = math.ceil(bt / r)
          assert.is_true(bt - (n - 1) * r >= r - 128 * n, 'the last chunk is about as long as the others')
        end
      end
    end)
  end)

  describe('edge cases', function()
    it('all targets ignored: 0 for sum and for mean (not NaN), zero gradients', function()
      local x, W = randn({ 6, 5 }):float(), randn({ 11, 5 }):float()
      local t = ms.full({ 6 }, -100, { dtype = 'i64' })
      for _, red in ipairs({ 'mean', 'sum', 'none' }) do
        local xf, Wf = x:clone():requires_grad_(), W:clone():requires_grad_()
        local loss, z, acc = FLCE(xf, Wf, t, { reduction = red, lse_square_scale = 1e-2, label_smoothing = 0.1,
          return_z_loss = true, return_accuracy = true })
        assert.is_true(finite(loss) and finite(z))
        assert.are.equal(0, F.sum(F.abs(loss)):item())
        assert.are.equal(0, acc:item())
        loss:backward(red == 'none' and ms.ones({ 6 }) or nil)
        assert.are.equal(0, F.sum(F.abs(xf.grad)):item())
        assert.are.equal(0, F.sum(F.abs(Wf.grad)):item())
      end
    end)

    it('counts ignore_index inside [0, V) as ignored', function()
      local x, W = randn({ 8, 4 }), randn({ 9, 4 })
      local t = ms.tensor({ 0, 1, 2, 0, 4, 5, 0, 8 }, { dtype = 'i64' })
      assert_close(both(x, W, t, { ignore_index = 0 }, 'f64'), 1e-11)
    end)

    it('takes i32 targets', function()
      local x, W = randn({ 8, 4 }), randn({ 9, 4 })
      local t = targets(8, 9, 0.2)
      assert.is_true(bitwise_equal(FLCE(x, W, t:to('i32')), FLCE(x, W, t)))
    end)
  end)

  describe('autograd', function()
    it('passes f64 finite differences for every option and reduction', function()
      local function leaf(t) return t:requires_grad_() end
      local x, W, b = leaf(randn({ 7, 5 })), leaf(randn({ 13, 5 })), leaf(randn({ 13 }, nil, 0.3))
      local t = ms.tensor({ 3, -100, 0, 12, 5, 5, 1 }, { dtype = 'i64' })
      local cw = F.add(F.abs(randn({ 13 })), 0.2)
      for _, o in ipairs({
        {}, { reduction = 'sum' }, { reduction = 'none' }, { label_smoothing = 0.2 },
        { softcap = 1.5 }, { lse_square_scale = 0.05 }, { ce_weight = cw, label_smoothing = 0.1 },
        { bias = b, softcap = 2, label_smoothing = 0.1, lse_square_scale = 0.01, ce_weight = cw, reduction = 'none' },
        { bias = b, softcap = 2, lse_square_scale = 0.01, ce_weight = cw, chunk_size = 3 },
      }) do
        local list = o.bias and { x, W, b } or { x, W }
        local worst = ms.autograd.gradcheck(function() return FLCE(x, W, t, o) end, list)
        assert.is_true(worst < 1e-6, ('relative error %.3g'):format(worst))
      end
    end)

    it('scales the forward\'s gradients by the incoming one; parameter gradients accumulate', function()
      local x, W = randn({ 10, 6 }):requires_grad_(), randn({ 20, 6 }):requires_grad_()
      local t = targets(10, 20, 0.1)
      FLCE(x, W, t):backward()
      local gx1, gW1 = x.grad:clone(), W.grad:clone()
      x.grad, W.grad = nil, nil
      ;(FLCE(x, W, t) * 3):backward()
      assert.is_true(relerr(x.grad, F.mul(gx1, 3)) < 1e-14)
      assert.is_true(relerr(W.grad, F.mul(gW1, 3)) < 1e-14)
      FLCE(x, W, t, { reduction = 'sum' }):backward(ms.tensor(0.5, { dtype = 'f64' }))
      local n = F.sum(F.ne(t, -100):to('f64')):item()
      assert.is_true(relerr(W.grad, F.mul(gW1, 3 + 0.5 * n)) < 1e-12)
    end)

    it('differentiates only the inputs that require grad; under no_grad nothing is recorded', function()
      local x, W = randn({ 10, 6 }), randn({ 20, 6 }):requires_grad_()
      local t = targets(10, 20, 0.1)
      local loss = FLCE(x, W, t)
      loss:backward()
      assert.is_nil(x.grad)
      assert.is_not_nil(W.grad)
      local n = #ms.autograd.tape
      ms.no_grad(function() FLCE(x, W, t) end)
      assert.are.equal(n, #ms.autograd.tape)
    end)

    it('returns z_loss and accuracy without gradients, only when asked', function()
      local x, W = randn({ 30, 6 }):requires_grad_(), randn({ 7, 6 }):requires_grad_()
      local t = targets(30, 7, 0.1)
      local loss, z, acc = FLCE(x, W, t)
      assert.is_nil(z)
      assert.is_nil(acc)
      loss, z, acc = FLCE(x, W, t, { lse_square_scale = 1e-2, return_z_loss = true, return_accuracy = true })
      assert.is_false(z.requires_grad)
      assert.is_false(acc.requires_grad)
      assert.are.same({}, acc.shape)
      assert.is_true(math.abs(acc:item() - ref_accuracy(x, W, t)) < 1e-12)
      assert.is_true(acc:item() > 0)
      loss:backward()
    end)

    it('takes x (B, T, H) with targets (B, T); none keeps the targets\' shape', function()
      local x, W = randn({ 3, 4, 5 }):requires_grad_(), randn({ 9, 5 }):requires_grad_()
      local t = targets(12, 9, 0.1):view(3, 4)
      local loss = FLCE(x, W, t, { reduction = 'none' })
      assert.are.same({ 3, 4 }, loss.shape)
      loss:backward(ms.ones({ 3, 4 }, { dtype = 'f64' }))
      assert.are.same({ 3, 4, 5 }, x.grad.shape)
      local x2, W2 = x:detach():view(12, 5):requires_grad_(), W:detach():requires_grad_()
      FLCE(x2, W2, t:view(12), { reduction = 'sum' }):backward()
      assert.is_true(relerr(x.grad, x2.grad) < 1e-14)
      assert.is_true(relerr(W.grad, W2.grad) < 1e-14)
    end)

    it('keeps the number of live storages flat over steps and leaves the tape empty', function()
      local x0, W = randn({ 16, 8 }):float(), randn({ 40, 8 }):float():requires_grad_()
      local t = targets(16, 40, 0.1)
      local function step()
        local x = x0:clone():requires_grad_()
        local h = x * 2
        local loss, z, acc = FLCE(h, W, t, { return_z_loss = true, return_accuracy = true, chunk_size = 5 })
        loss:backward()
        W.grad = nil
        return loss, z, acc
      end
      -- collect until the count settles: finalizers can free more on a
      -- later pass, and garbage of earlier specs must not count here
      local function settle()
        local last = -1
        for _ = 1, 10 do
          collectgarbage()
          local n = ms.live_storages()
          if n == last then return n end
          last = n
        end
        return last
      end
      for _ = 1, 3 do step() end
      local n0 = settle()
      for _ = 1, 20 do step() end
      local n1 = settle()
      assert.is_true(n1 <= n0, ('live storages grew from %d to %d over 20 steps'):format(n0, n1))
      assert.are.equal(0, #ms.autograd.tape)
    end)
  end)

  describe('as nn.functional.lm_loss', function()
    it('is the default, and use_fused_lm_loss(false) or opts.fused = false take the plain path', function()
      local h, w = randn({ 2, 3, 4 }):requires_grad_(), randn({ 5, 4 }):requires_grad_()
      local t = ms.tensor({ { 1, 2, 3 }, { 4, 0, -100 } }, { dtype = 'i64' })
      assert.is_true(nnf.use_fused_lm_loss())
      local lf = nnf.lm_loss(h, w, t)
      assert.are.equal('fused_linear_cross_entropy', ms.autograd.tape[#ms.autograd.tape].name)
      lf:backward()
      local gh, gw = h.grad, w.grad
      h.grad, w.grad = nil, nil
      local lp = nnf.lm_loss(h, w, t, { fused = false })
      assert.are_not.equal('fused_linear_cross_entropy', ms.autograd.tape[#ms.autograd.tape].name)
      lp:backward()
      assert.is_true(math.abs(lf:item() - lp:item()) < 1e-12)
      assert.is_true(relerr(gh, h.grad) < 1e-12 and relerr(gw, w.grad) < 1e-12)
      assert.is_true(nnf.use_fused_lm_loss(false))
      nnf.lm_loss(h, w, t)
      assert.are_not.equal('fused_linear_cross_entropy', ms.autograd.tape[#ms.autograd.tape].name)
      ms.autograd.tape = {}
      assert.is_false(nnf.use_fused_lm_loss(true))
    end)

    it('set_lm_loss_budget: 1 GiB by default, returns the previous one, rejects bad values; CPU inputs keep their own budget', function()
      local flce = require 'moonshard.flce'
      assert.are.equal(2 ^ 30, flce.set_lm_loss_budget())
      assert.are.equal(2 ^ 30, flce.set_lm_loss_budget(4096))
      assert.are.equal(4096, flce.set_lm_loss_budget(2 ^ 30))
      for _, bad in ipairs({ -1, 1.5, 'x' }) do
        local ok, err = pcall(flce.set_lm_loss_budget, bad)
        assert.is_false(ok)
        assert.truthy(tostring(err):find('set_lm_loss_budget: bytes must be an integer >= 0', 1, true))
      end
      -- on the CPU the options reach the function as given
      local seen
      local real = flce.fused_linear_cross_entropy
      flce.fused_linear_cross_entropy = function(x, W, t, o) seen = o; return real(x, W, t, o) end
      local h, w = randn({ 2, 3, 4 }), randn({ 5, 4 })
      local t = ms.tensor({ { 1, 2, 3 }, { 4, 0, -100 } }, { dtype = 'i64' })
      local ok, err = pcall(flce.lm_loss, h, w, t, { reduction = 'sum' })
      flce.fused_linear_cross_entropy = real
      assert(ok, err)
      assert.are.equal('sum', seen.reduction)
      assert.is_nil(seen.memory_budget)
    end)

    local have = io.open(fixtures .. '/gpt2-tiny/model.safetensors', 'rb')
    if have then have:close() end
    for _, fam in ipairs({ { 'gpt2-tiny', 'models.gpt2' }, { 'llama-tiny', 'models.llama' } }) do
      it(fam[1] .. ': golden loss and gradients on the fused and the plain path (1e-5)', function()
        assert.is_truthy(have, 'no model fixtures')
        local M = require(fam[2])
        local dir = fixtures .. '/' .. fam[1]
        local exp = ms.load_safetensors(dir .. '/expected.safetensors')
        local grads = {}
        for _, fused in ipairs({ true, false }) do
          local prev = nnf.use_fused_lm_loss(fused)
          local model = M.from_pretrained(dir)
          model:eval()
          local loss = model(exp.input_ids, exp.targets)
          local el = math.abs(loss:item() - exp.loss:item()) / math.abs(exp.loss:item())
          assert.is_true(el < 1e-5, ('fused=%s loss %.9g vs %.9g'):format(tostring(fused), loss:item(), exp.loss:item()))
          loss:backward()
          nnf.use_fused_lm_loss(prev)
          grads[fused] = {}
          for name, p in model:named_parameters() do
            local e = relerr(p.grad, exp['grad.' .. name])
            assert.is_true(e < 1e-5, ('fused=%s grad.%s: %.3g'):format(tostring(fused), name, e))
            grads[fused][name] = p.grad
          end
        end
        for name, g in pairs(grads[true]) do
          assert.is_true(relerr(g, grads[false][name]) < 1e-5, name)
        end
      end)
    end
  end)

  describe('errors', function()
    local x, W = randn({ 4, 3 }):float(), randn({ 10, 3 }):float()
    local t = ms.tensor({ 1, 2, -100, 9 }, { dtype = 'i64' })

    it('names the position and value of an out-of-range target', function()
      local bad = ms.tensor({ 1, 10, -100, 9 }, { dtype = 'i64' })
      assert.matches('target 10 at position 1 is out of range for 10 classes %(and is not ignore_index = %-100%)',
        errmsg(function() FLCE(x, W, bad) end))
      assert.matches('target %-3 at position 2', errmsg(function()
        FLCE(x, W, ms.tensor({ 1, 2, -3, 9 }, { dtype = 'i64' }))
      end))
      -- and through lm_loss
      assert.matches('target 10 at position 1', errmsg(function()
        nnf.lm_loss(x:view(1, 4, 3), W, bad:view(1, 4))
      end))
    end)

    it('names shapes and dtypes that do not fit', function()
      assert.matches('differ in the hidden size', errmsg(function() FLCE(x, randn({ 10, 4 }):float(), t) end))
      assert.matches('x f32 %(4,3%) cpu and W f64 %(10,3%) cpu differ in dtype', errmsg(function()
        FLCE(x, W:double(), t)
      end))
      assert.matches('targets must be i64 or i32', errmsg(function() FLCE(x, W, t:float()) end))
      assert.matches('one id per row of x', errmsg(function()
        FLCE(x, W, ms.tensor({ 1, 2 }, { dtype = 'i64' }))
      end))
      assert.matches('targets %(3%) must have the shape of x %(1,4,3%)', errmsg(function()
        FLCE(x:view(1, 4, 3), W, ms.tensor({ 1, 2, 3 }, { dtype = 'i64' }))
      end))
      assert.matches('bias .* must be %(10%)', errmsg(function() FLCE(x, W, t, { bias = ms.zeros({ 9 }) }) end))
      assert.matches('ce_weight .* one weight per class', errmsg(function()
        FLCE(x, W, t, { ce_weight = ms.ones({ 3 }) })
      end))
      assert.matches('x must be a float tensor', errmsg(function() FLCE(x:long(), W:long(), t) end))
      assert.matches('expected a tensor for W', errmsg(function() FLCE(x, nil, t) end))
    end)

    it('names bad options', function()
      assert.matches("reduction must be 'mean', 'sum' or 'none', got max", errmsg(function()
        FLCE(x, W, t, { reduction = 'max' })
      end))
      assert.matches('label_smoothing must be in %[0, 1%]', errmsg(function()
        FLCE(x, W, t, { label_smoothing = 1.5 })
      end))
      assert.matches('softcap must be', errmsg(function() FLCE(x, W, t, { softcap = -1 }) end))
      assert.matches('chunk_size must be an integer', errmsg(function() FLCE(x, W, t, { chunk_size = 2.5 }) end))
      assert.matches('accum_dtype must be f32 or W', errmsg(function() FLCE(x, W, t, { accum_dtype = 'bf16' }) end))
    end)
  end)
end)
