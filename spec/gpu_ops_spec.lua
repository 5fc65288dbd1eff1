-- GPU ops against the CPU reference, on random data, with dtype-aware
-- bounds: ‖gpu − cpu‖ / ‖cpu‖ ≤ 1e-5 (f32), 1e-2 (bf16). Run on a GPU host
-- with `make test-gpu`.
local ms = require 'moonshard'
local S = require 'spec.support'

local function relerr(got, want)
  local g, w = got:to('cpu'):double(), want:double()
  local num = ((g - w) * (g - w)):sum():item()
  local den = (w * w):sum():item()
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end

local bound = { f32 = 1e-5, bf16 = 1e-2, f16 = 2e-3, f64 = 1e-12 }

local seed = 1000
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed }):to(dtype or 'f32')
end

describe('cuda ops #gpu', function()
  setup(function()
    assert.is_true(ms.cuda.is_available(), 'no CUDA device')
  end)

  describe('elementwise', function()
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      for _, name in ipairs({ 'neg', 'exp', 'tanh', 'sigmoid', 'relu', 'gelu', 'silu', 'abs', 'square' }) do
        it(name .. ' ' .. dt, function()
          local x = randn({ 37, 129 }, dt)
          local want = ms[name](x)
          local got = ms[name](x:to('cuda'))
          assert.are.equal('cuda:0', got.device)
          assert.is_true(relerr(got, want) <= bound[dt], name .. ' ' .. relerr(got, want))
        end)
      end
      for _, name in ipairs({ 'add', 'sub', 'mul', 'div', 'maximum', 'minimum' }) do
        it(name .. ' ' .. dt .. ' with broadcasting and views', function()
          local a, b = randn({ 8, 1, 33 }, dt), randn({ 5, 33 }, dt)
          if name == 'div' then b = b:abs() + 0.5 end
          local want = ms[name](a, b)
          local got = ms[name](a:to('cuda'), b:to('cuda'))
          assert.is_true(relerr(got, want) <= bound[dt])
          -- contiguous same-shape fast path
          local c, d = randn({ 1000 }, dt), randn({ 1000 }, dt)
          if name == 'div' then d = d:abs() + 0.5 end
          assert.is_true(relerr(ms[name](c:cuda(), d:cuda()), ms[name](c, d)) <= bound[dt])
          -- transposed operand
          local e, f = randn({ 17, 9 }, dt), randn({ 9, 17 }, dt)
          if name == 'div' then f = f:abs() + 0.5 end
          assert.is_true(relerr(ms[name](e:cuda(), f:cuda():t()), ms[name](e, f:t())) <= bound[dt])
        end)
      end
    end
    it('scalar ops, clamp, where, comparisons', function()
      local x = randn({ 64, 65 })
      local g = x:cuda()
      assert.is_true(relerr(g * 3 + 1, x * 3 + 1) <= 1e-6)
      assert.is_true(relerr(2 - g, 2 - x) <= 1e-6)
      assert.is_true(relerr(ms.clamp(g, -0.5, 0.5), ms.clamp(x, -0.5, 0.5)) <= 1e-6)
      local m = ms.gt(x, 0)
      assert.are.same(ms.gt(g, 0):to('cpu'):totable(), m:totable())
      assert.is_true(relerr(ms.where(m:cuda(), g, g * 2), ms.where(m, x, x * 2)) <= 1e-6)
    end)
    it('activation backward helpers', function()
      local x, gr = randn({ 300 }), randn({ 300 })
      for _, name in ipairs({ 'gelu_backward', 'silu_backward', 'sigmoid_backward', 'tanh_backward' }) do
        assert.is_true(relerr(ms[name](x:cuda(), gr:cuda()), ms[name](x, gr)) <= 1e-5, name)
      end
    end)
    it('dtype conversion rounds like the CPU', function()
      local x = randn({ 4096 }) * 100
      assert.are.same(x:bf16():to('f32'):totable(), x:cuda():bf16():to('cpu'):to('f32'):totable())
      assert.are.same(x:half():to('f32'):totable(), x:cuda():half():to('cpu'):to('f32'):totable())
    end)
    it('strided float copies, casts and broadcasts take the 8-wide path and match the CPU', function()
      -- inner dims that are multiples of 8 go through ew_vec8_kernel; 12 and a
      -- misaligned narrow fall back to the general path; all must agree
      for _, dt in ipairs({ 'f32', 'bf16', 'f16' }) do
        for _, d in ipairs({ 64, 24, 12 }) do
          local x = randn({ 2, 5, 3, d }, dt)
          local want = x:transpose(2, 3):contiguous()
          local got = x:cuda():transpose(2, 3):contiguous()
          assert.are.same(want:to('f32'):totable(), got:to('cpu'):to('f32'):totable())
          -- a cast through a transpose, both directions
          local c = x:to('f32'):transpose(1, 2):bf16()
          assert.are.same(c:to('f32'):totable(), x:to('f32'):cuda():transpose(1, 2):bf16():to('cpu'):to('f32'):totable())
          -- unary, scalar and clamp on a view whose inner dim is contiguous
          local g = x:cuda()
          assert.is_true(relerr(ms.gelu(g:transpose(1, 2)), ms.gelu(x:transpose(1, 2))) <= bound[dt])
          assert.is_true(relerr(g:transpose(2, 3) * 3 + 1, x:transpose(2, 3) * 3 + 1) <= bound[dt])
          assert.is_true(relerr(ms.clamp(g:transpose(1, 2), -0.5, 0.5), ms.clamp(x:transpose(1, 2), -0.5, 0.5)) <= bound[dt])
        end
        -- bias-style broadcasts: (N, C) + (C), (C) + (N, C), and mixed dtypes
        local a, b = randn({ 37, 96 }, dt), randn({ 96 }, dt)
        assert.is_true(relerr(a:cuda() + b:cuda(), a + b) <= bound[dt])
        assert.is_true(relerr(b:cuda() - a:cuda(), b - a) <= bound[dt])
        local bf = randn({ 96 }, 'f32')
        assert.is_true(relerr(a:cuda() * bf:cuda(), a * bf) <= bound[dt])
        -- a narrow: aligned (start 9, 16 wide) and misaligned (start 2)
        local n = randn({ 6, 40 }, dt)
        for _, st in ipairs({ 9, 2 }) do
          local v, gv = n:narrow(2, st, 16), n:cuda():narrow(2, st, 16)
          assert.is_true(relerr(gv * 2 - 1, v * 2 - 1) <= bound[dt])
          local dst, gdst = ms.zeros({ 6, 40 }):to(dt), ms.zeros({ 6, 40 }):to(dt):cuda()
          dst:narrow(2, st, 16):copy_(v:exp())
          gdst:narrow(2, st, 16):copy_(gv:exp())
          assert.is_true(relerr(gdst, dst) <= bound[dt])
        end
      end
    end)
    it('random numbers equal the CPU stream', function()
      local a = ms.rand({ 1001 }, { seed = 7, offset = 3 })
      local b = ms.rand({ 1001 }, { seed = 7, offset = 3, device = 'cuda' })
      assert.is_true(relerr(b, a) <= 1e-6)
      local c = ms.randn({ 999 }, { seed = 9 })
      local d = ms.randn({ 999 }, { seed = 9, device = 'cuda' })
      assert.is_true(relerr(d, c) <= 1e-5)
    end)
  end)

  describe('reductions and softmax', function()
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      it('sum/mean/max/min/logsumexp over each dim ' .. dt, function()
        local x = randn({ 6, 70, 13 }, dt)
        local g = x:cuda()
        for _, name in ipairs({ 'sum', 'mean', 'logsumexp' }) do
          for d = 1, 3 do
            assert.is_true(relerr(ms[name](g, d), ms[name](x, d)) <= bound[dt], name .. d)
          end
          assert.is_true(relerr(ms[name](g), ms[name](x)) <= bound[dt], name)
        end
        for d = 1, 3 do
          local v1 = ms.max(g, d)
          local v2 = ms.max(x, d)
          assert.is_true(relerr(v1, v2) <= bound[dt])
          assert.are.same(ms.argmax(g, d):to('cpu'):totable(), ms.argmax(x, d):totable())
        end
      end)
      it('softmax and log_softmax forward/backward ' .. dt, function()
        local x, gr = randn({ 5, 300 }, dt), randn({ 5, 300 }, dt)
        for _, d in ipairs({ 1, 2 }) do
          local y, ly = ms.softmax(x, d), ms.log_softmax(x, d)
          assert.is_true(relerr(ms.softmax(x:cuda(), d), y) <= bound[dt])
          assert.is_true(relerr(ms.log_softmax(x:cuda(), d), ly) <= bound[dt])
          assert.is_true(relerr(ms.softmax_backward(y:cuda(), gr:cuda(), d, false),
            ms.softmax_backward(y, gr, d, false)) <= bound[dt])
          assert.is_true(relerr(ms.softmax_backward(ly:cuda(), gr:cuda(), d, true),
            ms.softmax_backward(ly, gr, d, true)) <= bound[dt])
        end
      end)
    end
  end)

  describe('matmul through cuBLASLt', function()
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      it('2-D, transposed, batched and broadcast ' .. dt, function()
        local a, b = randn({ 65, 33 }, dt), randn({ 33, 47 }, dt)
        assert.is_true(relerr(ms.matmul(a:cuda(), b:cuda()), ms.matmul(a, b)) <= bound[dt])
        local at, bt = randn({ 33, 65 }, dt), randn({ 47, 33 }, dt)
        assert.is_true(relerr(ms.matmul(at:cuda(), bt:cuda(), true, true), ms.matmul(at, bt, true, true)) <= bound[dt])
        assert.is_true(relerr(ms.matmul(at:cuda():t(), b:cuda()), ms.matmul(at:t(), b)) <= bound[dt])
        local x, w = randn({ 3, 4, 17, 24 }, dt), randn({ 3, 4, 24, 9 }, dt)
        assert.is_true(relerr(ms.matmul(x:cuda(), w:cuda()), ms.matmul(x, w)) <= bound[dt])
        local w2 = randn({ 24, 9 }, dt)
        assert.is_true(relerr(ms.matmul(x:cuda(), w2:cuda()), ms.matmul(x, w2)) <= bound[dt])
        local v = randn({ 24 }, dt)
        assert.is_true(relerr(ms.matmul(x:cuda(), v:cuda()), ms.matmul(x, v)) <= bound[dt])
      end)
    end
    -- the epilogues (ops.h MS_GEMM_*): bias in the forward GEMM, the bias
    -- gradient from the weight-gradient GEMM, every transpose; the CPU's two
    -- passes are the reference. A strided bias or f64 takes the two-pass
    -- path on the GPU too.
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      it('matmul_bias and matmul_bgrad (cuBLASLt epilogues) ' .. dt, function()
        local F = ms.raw
        local M, K, N = 70, 129, 48
        for _, ta in ipairs({ false, true }) do
          for _, tb in ipairs({ false, true }) do
            local a = randn(ta and { K, M } or { M, K }, dt)
            local b = randn(tb and { N, K } or { K, N }, dt)
            local bias = randn({ N }, dt)
            local want = F.matmul_bias(a, b, ta, tb, bias)
            local got = F.matmul_bias(a:cuda(), b:cuda(), ta, tb, bias:cuda())
            local what = ('%s ta=%s tb=%s'):format(dt, tostring(ta), tostring(tb))
            assert.is_true(relerr(got, want) <= bound[dt], 'bias ' .. what .. ' ' .. relerr(got, want))
            for _, side in ipairs({ 'a', 'b' }) do
              local w1, s1 = F.matmul_bgrad(a, b, ta, tb, side)
              local w2, s2 = F.matmul_bgrad(a:cuda(), b:cuda(), ta, tb, side)
              assert.are.same(s1.shape, s2.shape)
              assert.is_true(relerr(w2, w1) <= bound[dt], 'bgrad out ' .. what .. side .. ' ' .. relerr(w2, w1))
              assert.is_true(relerr(s2, s1) <= bound[dt], 'bgrad sum ' .. what .. side .. ' ' .. relerr(s2, s1))
            end
          end
        end
        -- the two-pass path on the GPU: a strided bias
        local a, b = randn({ 33, 20 }, dt), randn({ 20, 9 }, dt)
        local wide = randn({ 18 }, dt)
        local strided = wide:view(9, 2):select(2, 1)
        local want = F.matmul_bias(a, b, false, false, strided)
        local got = F.matmul_bias(a:cuda(), b:cuda(), false, false, wide:cuda():view(9, 2):select(2, 1))
        assert.is_true(relerr(got, want) <= bound[dt], 'strided bias ' .. relerr(got, want))
      end)
    end
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      it('matmul_gelu and matmul_dgelu (cuBLASLt GELU epilogues, and the separate passes) ' .. dt, function()
        local F = ms.raw
        local C = require('moonshard.tensor').C
        local M, K, N = 70, 96, 64
        -- every epilogue (DGELU's is off by default), then none
        for _, mask in ipairs({ C.MS_GEMM_EPI_ALL, 0 }) do
        local old = C.ms_cuda_gemm_set_epilogue(mask)
        for _, ta in ipairs({ false, true }) do
          for _, tb in ipairs({ false, true }) do
            local a = randn(ta and { K, M } or { M, K }, dt)
            local b = randn(tb and { N, K } or { K, N }, dt)
            local bias = randn({ N }, dt)
            local what = ('%s ta=%s tb=%s epilogues %d'):format(dt, tostring(ta), tostring(tb), mask)
            local o1, p1 = F.matmul_gelu(a, b, ta, tb, bias)
            local o2, p2 = F.matmul_gelu(a:cuda(), b:cuda(), ta, tb, bias:cuda())
            assert.is_true(relerr(p2, p1) <= bound[dt], 'pre ' .. what .. ' ' .. relerr(p2, p1))
            assert.is_true(relerr(o2, o1) <= bound[dt], 'gelu ' .. what .. ' ' .. relerr(o2, o1))
            local z = randn({ M, N }, dt)
            local d1, s1 = F.matmul_dgelu(a, b, ta, tb, z, true)
            local d2, s2 = F.matmul_dgelu(a:cuda(), b:cuda(), ta, tb, z:cuda(), true)
            assert.is_true(relerr(d2, d1) <= bound[dt], 'dgelu ' .. what .. ' ' .. relerr(d2, d1))
            assert.is_true(relerr(s2, s1) <= bound[dt], 'bias grad ' .. what .. ' ' .. relerr(s2, s1))
          end
        end
        C.ms_cuda_gemm_set_epilogue(old)
        end
      end)
    end
    it('GEMM tuning: tuned plans give the products, accumulate into out once (beta = 1), and epilogues', function()
      local F = ms.raw
      local old = ms.cuda.gemm_tune(true)
      local ok, err = pcall(function()
        local before = ms.cuda.gemm_tune_stats()
        -- shapes no other spec uses, so each is a new plan and is tuned here
        for _, dt in ipairs({ 'f32', 'bf16' }) do
          for _, sh in ipairs({ { 1536, 1040, 776 }, { 2064, 528, 1544 } }) do
            local M, N, K = sh[1], sh[2], sh[3]
            local a, b = randn({ M, K }, dt), randn({ N, K }, dt)
            assert.is_true(relerr(F.matmul(a:cuda(), b:cuda(), false, true), F.matmul(a, b, false, true)) <= bound[dt],
              dt .. ' matmul ' .. M)
            -- beta = 1 into an out of random values: the trials must not touch it
            local c = randn({ M, N }, dt)
            local want = F.gemm_(c:clone(), a, b, false, true, 0.5, 1)
            local got = F.gemm_(c:cuda(), a:cuda(), b:cuda(), false, true, 0.5, 1)
            assert.is_true(relerr(got, want) <= bound[dt], dt .. ' gemm_ beta 1 ' .. relerr(got, want))
            local bias = randn({ N }, dt)
            local o1 = F.matmul_bias(a, b, false, true, bias)
            local o2 = F.matmul_bias(a:cuda(), b:cuda(), false, true, bias:cuda())
            assert.is_true(relerr(o2, o1) <= bound[dt], dt .. ' matmul_bias')
            -- the same plan again (cached choice): the same bits
            local again = F.gemm_(c:cuda(), a:cuda(), b:cuda(), false, true, 0.5, 1)
            assert.are.equal(0, relerr(again, got:to('cpu')), 'cached plan')
          end
        end
        local after = ms.cuda.gemm_tune_stats()
        assert.is_true(after.tuned >= before.tuned + 8, 'plans tuned: ' .. before.tuned .. ' -> ' .. after.tuned)
        assert.is_true(after.host_ms > before.host_ms)
        -- off: no more plans tuned
        ms.cuda.gemm_tune(false)
        local a, b = randn({ 1000, 392 }, 'bf16'), randn({ 392, 776 }, 'bf16')
        assert.is_true(relerr(F.matmul(a:cuda(), b:cuda()), F.matmul(a, b)) <= bound.bf16)
        assert.are.equal(after.tuned, ms.cuda.gemm_tune_stats().tuned)
      end)
      ms.cuda.gemm_tune(old)
      assert(ok, err)
      assert.are.equal(old, ms.cuda.gemm_tune())
    end)

    it('GEMM tuning file: choices written, then taken from it untimed, the same bits', function()
      local F = ms.raw
      local path = os.tmpname()
      os.remove(path)
      local old = ms.cuda.gemm_tune(true)
      local ok, err = pcall(function()
        ms.cuda.gemm_tune_file(path)
        ms.cuda.gemm_clear_plans()
        local shapes = { { 3000, 1000, 520 }, { 1032, 2056, 3080 } }
        local ins, first = {}, {}
        local s0 = ms.cuda.gemm_tune_stats()
        for i, sh in ipairs(shapes) do
          ins[i] = { randn({ sh[1], sh[3] }, 'bf16'):cuda(), randn({ sh[3], sh[2] }, 'bf16'):cuda() }
          first[i] = F.matmul(ins[i][1], ins[i][2]):to('cpu')
        end
        local s1 = ms.cuda.gemm_tune_stats()
        local tuned = s1.tuned - s0.tuned
        assert.is_true(tuned >= 1, 'plans tuned: ' .. tuned)
        local lines = 0
        for l in io.lines(path) do
          assert.is_truthy(l:match('^ms%-gemm%-tune 1 %d+ %S+'), l)
          lines = lines + 1
        end
        assert.are.equal(tuned, lines, 'one record a tuned plan')
        -- the plans forgotten: made again from the file, nothing timed
        ms.cuda.gemm_clear_plans()
        for i = 1, #shapes do
          assert.are.equal(0, relerr(F.matmul(ins[i][1], ins[i][2]), first[i]), 'the recorded algorithm, shape ' .. i)
        end
        local s2 = ms.cuda.gemm_tune_stats()
        assert.are.equal(s1.tuned, s2.tuned, 'timed again')
        assert.are.equal(tuned, s2.from_file - s1.from_file)
        -- a path that cannot be written is an error naming it
        local bad = path .. '.missing-dir/tune.txt'
        local ok2, e2 = pcall(ms.cuda.gemm_tune_file, bad)
        assert.is_false(ok2)
        assert.is_truthy(tostring(e2):find(bad, 1, true), tostring(e2))
      end)
      ms.cuda.gemm_tune_file(nil)
      ms.cuda.gemm_tune(old)
      os.remove(path)
      assert(ok, err)
    end)

    it('GEMMs with an SM margin (cuBLASLt SM count target) give the same products; an empty sum with beta 0 writes zeros', function()
      local F = ms.raw
      local C = require('moonshard.tensor').C
      for _, margin in ipairs({ 16, 100 }) do
        local old = C.ms_cuda_gemm_set_sm_margin(margin)
        local ok, err = pcall(function()
          for _, dt in ipairs({ 'f32', 'bf16' }) do
            local a, b = randn({ 1000, 384 }, dt), randn({ 384, 2048 }, dt)
            local bias = randn({ 2048 }, dt)
            assert.is_true(relerr(F.matmul(a:cuda(), b:cuda()), F.matmul(a, b)) <= bound[dt], dt .. ' matmul')
            local o1 = F.matmul_bias(a, b, false, false, bias)
            local o2 = F.matmul_bias(a:cuda(), b:cuda(), false, false, bias:cuda())
            assert.is_true(relerr(o2, o1) <= bound[dt], dt .. ' matmul_bias')
          end
        end)
        assert.are.equal(margin, C.ms_cuda_gemm_set_sm_margin(old))
        assert(ok, err)
      end
      -- k = 0: the product is zeros whatever its memory held before (NaN
      -- here: the caching allocator hands the freed block back), not NaN * 0
      for _ = 1, 3 do
        ms.full({ 5, 7 }, 0 / 0, { device = 'cuda' }):free()
        local a, b = ms.empty({ 5, 0 }, { device = 'cuda' }), ms.empty({ 0, 7 }, { device = 'cuda' })
        assert.are.same(ms.zeros({ 5, 7 }):totable(), F.matmul(a, b):to('cpu'):totable())
      end
    end)
    it('matmul_dgelu without the epilogue: one pass for the gradient and its column sums, any row count', function()
      local F = ms.raw
      local C = require('moonshard.tensor').C
      local old = C.ms_cuda_gemm_set_epilogue(0)
      -- (M, N): many rows a block; N/8 not a multiple of 32; N not a multiple of 8 (the op and a sum apart)
      for _, mn in ipairs({ { 3001, 264 }, { 517, 3072 }, { 64, 20 } }) do
        for _, dt in ipairs({ 'f32', 'bf16' }) do
          local M, N, K = mn[1], mn[2], 24
          local a, b, z = randn({ M, K }, dt), randn({ K, N }, dt), randn({ M, N }, dt)
          local d1, s1 = F.matmul_dgelu(a, b, false, false, z, true)
          local d2, s2 = F.matmul_dgelu(a:cuda(), b:cuda(), false, false, z:cuda(), true)
          local d3 = F.matmul_dgelu(a:cuda(), b:cuda(), false, false, z:cuda())
          local what = ('%s M=%d N=%d'):format(dt, M, N)
          assert.is_true(relerr(d2, d1) <= bound[dt], 'dgelu ' .. what .. ' ' .. relerr(d2, d1))
          assert.is_true(relerr(d3, d1) <= bound[dt], 'dgelu, no bias ' .. what .. ' ' .. relerr(d3, d1))
          assert.is_true(relerr(s2, s1) <= bound[dt], 'bias grad ' .. what .. ' ' .. relerr(s2, s1))
        end
      end
      C.ms_cuda_gemm_set_epilogue(old)
    end)
    it('an MLP (gelu_mlp node) on cuda matches the CPU in f32 and bf16 autocast', function()
      local nn = ms.nn
      local m = nn.MLP { dim = 64, hidden = 256 }
      local x = randn({ 4, 33, 64 })
      local g = randn({ 4, 33, 64 })
      local function run(dev, bf16)
        local mm = dev == 'cuda' and m:to('cuda') or m
        mm:zero_grad()
        local xx = x:detach():to(dev):requires_grad_()   -- a leaf of its own on either device
        local y = bf16 and nn.functional.autocast('bf16', mm, xx) or mm(xx)
        y:backward(g:to(dev):to(y.dtype))
        -- copies: on the CPU :to('cpu') is the tensor itself, which the next
        -- run's zero_grad and m:to() reuse or free
        local out = { y = y:detach():to('cpu'):clone(), x = xx.grad:to('cpu'):clone() }
        for n, p in mm:named_parameters() do out[n] = p.grad:to('cpu'):clone() end
        if dev == 'cuda' then m:to('cpu') end
        return out
      end
      local ref = run('cpu', false)
      for _, bf16 in ipairs({ false, true }) do
        local got = run('cuda', bf16)
        local b = bf16 and 2e-2 or 1e-5
        for k, v in pairs(ref) do
          assert.is_true(relerr(got[k], v) <= b, k .. (bf16 and ' bf16 ' or ' f32 ') .. relerr(got[k], v))
        end
      end
    end)
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      it('swiglu (silu(gate) * up) and its backward ops ' .. dt, function()
        local F = ms.raw
        local g, u, d = randn({ 37, 130 }, dt), randn({ 37, 130 }, dt), randn({ 37, 130 }, dt)
        assert.is_true(relerr(F.swiglu(g:cuda(), u:cuda()), F.swiglu(g, u)) <= bound[dt])
        local y = ms.nn.functional.swiglu(g:cuda():requires_grad_(), u:cuda())
        assert.are.equal('cuda:0', y.device)
        assert.is_true(relerr(F.silu_backward(g:cuda(), d:cuda()), F.silu_backward(g, d)) <= bound[dt])
      end)
    end
    it('gemm_ accumulates with beta', function()
      local a, b = randn({ 20, 30 }), randn({ 30, 10 })
      local c = randn({ 20, 10 })
      local cg = c:cuda()
      ms.gemm_(cg, a:cuda(), b:cuda(), false, false, 0.5, 1.0)
      local cc = c:clone()
      ms.gemm_(cc, a, b, false, false, 0.5, 1.0)
      assert.is_true(relerr(cg, cc) <= 1e-5)
    end)
  end)

  describe('indexing', function()
    it('index_select, index_add (deterministic), gather, scatter_add', function()
      local w = randn({ 50, 16 })
      local ids = (ms.rand({ 200 }, { seed = 3 }) * 50):long()
      assert.is_true(relerr(ms.index_select(w:cuda(), 1, ids:cuda()), ms.index_select(w, 1, ids)) <= 1e-7)
      local src = randn({ 200, 16 })
      local d1, d2 = ms.zeros({ 50, 16 }), ms.zeros({ 50, 16 }, { device = 'cuda' })
      ms.index_add_(d1, 1, ids, src)
      ms.index_add_(d2, 1, ids:cuda(), src:cuda())
      assert.is_true(relerr(d2, d1) <= 1e-6)
      local d3 = ms.zeros({ 50, 16 }, { device = 'cuda' })
      ms.index_add_(d3, 1, ids:cuda(), src:cuda())
      assert.are.same(d2:to('cpu'):totable(), d3:to('cpu'):totable())
      local x = randn({ 8, 30 })
      local t = (ms.rand({ 8, 1 }, { seed = 4 }) * 30):long()
      assert.is_true(relerr(ms.gather(x:cuda(), 2, t:cuda()), ms.gather(x, 2, t)) <= 1e-7)
      local s1, s2 = ms.zeros({ 8, 30 }), ms.zeros({ 8, 30 }, { device = 'cuda' })
      local v = randn({ 8, 1 })
      ms.scatter_add_(s1, 2, t, v)
      ms.scatter_add_(s2, 2, t:cuda(), v:cuda())
      assert.is_true(relerr(s2, s1) <= 1e-7)
    end)
    it('an out-of-range id is a Lua error at the next sync, not a crash', function()
      local w = randn({ 10, 4 }):cuda()
      local ids = ms.tensor({ 1, 2, 99 }, { dtype = 'i64' }):cuda()
      local ok, err = pcall(function() return ms.index_select(w, 1, ids):to('cpu') end)
      assert.is_false(ok)
      assert.matches('99', tostring(err))
      -- the device stays usable
      assert.is_true(relerr(w * 2, w:to('cpu') * 2) <= 1e-7)
    end)
  end)

  describe('errors', function()
    it('mixing devices names both', function()
      local a, b = randn({ 3 }), randn({ 3 }):cuda()
      local ok, err = pcall(ms.add, a, b)
      assert.is_false(ok)
      assert.matches('cpu', err)
      assert.matches('cuda:0', err)
    end)
    it('out of memory is a Lua error and the process stays usable', function()
      local ok, err = pcall(ms.empty, { 1024 * 1024 * 1024 * 1024 }, { device = 'cuda', dtype = 'u8' })
      assert.is_false(ok)
      assert.matches('out of memory', err)
      local x = randn({ 4 }):cuda()
      assert.are.equal(4, x:numel())
    end)
  end)

  describe('allocator', function()
    it('reuses blocks: no cudaMalloc in a steady loop', function()
      local x = randn({ 256, 256 }):cuda()
      local function step()
        local y = ms.matmul(x, x)
        local a = y * 2
        local b = a + 1
        local z = b:sum()
        -- freed here, not by the Lua GC (whose timing would decide how many
        -- blocks are live at once): every step then needs the same blocks
        y:free(); a:free(); b:free(); z:free()
      end
      for _ = 1, 300 do step() end
      local before = ms.cuda.memory_stats().num_mallocs
      for _ = 1, 300 do step() end
      local after = ms.cuda.memory_stats()
      assert.are.equal(before, after.num_mallocs)
      assert.is_true(after.peak_allocated >= after.allocated)
    end)

    it('counts the copies that block the host (num_host_syncs), and only those', function()
      local x = randn({ 64, 64 }):cuda()
      local s0 = ms.cuda.memory_stats().num_host_syncs
      local y = ms.matmul(x, x) * 2 + 1          -- device work only
      local z = y:sum()
      assert.are.equal(s0, ms.cuda.memory_stats().num_host_syncs)
      z:item()                                    -- a read: one
      assert.are.equal(s0 + 1, ms.cuda.memory_stats().num_host_syncs)
      local h = randn({ 4 }):cuda()               -- a host tensor uploaded: one more
      y:to('cpu')                                 -- a download: one more
      assert.are.equal(s0 + 3, ms.cuda.memory_stats().num_host_syncs)
      assert.are.equal('cuda:0', h.device)
    end)

    it('adds the time a read waits for the device to host_sync_ms', function()
      local a = randn({ 2048, 2048 }):cuda()
      local y = a
      ms.cuda.synchronize()
      local t0 = ms.cuda.memory_stats().host_sync_ms
      for _ = 1, 20 do y = ms.matmul(y, a) * 1e-3 end   -- queued device work
      local w0 = require('moonshard.launch').now()
      y:sum():item()                                     -- waits for all of it
      local waited = (require('moonshard.launch').now() - w0) * 1e3
      local got = ms.cuda.memory_stats().host_sync_ms - t0
      assert.is_true(got > 0 and got <= waited + 0.01, ('host_sync_ms grew %g ms, the read took %g'):format(got, waited))
    end)

    it('copy_async_ through page-locked memory: both ways without a host sync, an event wait counted as one; '
      .. 'a pageable host tensor and mismatched sizes refused', function()
      local x = randn({ 1000, 37 })
      local d = x:cuda()
      local h = ms.cuda.pinned_empty({ 1000, 37 }, 'f32')
      local ev = ms.cuda.event()
      ms.cuda.synchronize()
      local s0 = ms.cuda.memory_stats().num_host_syncs
      local d2 = d * 2                                    -- queued work the copy waits for (stream order)
      ms.cuda.copy_async_(h, d2)
      ev:record()
      assert.are.equal(s0, ms.cuda.memory_stats().num_host_syncs)
      ev:synchronize()
      assert.are.equal(s0 + 1, ms.cuda.memory_stats().num_host_syncs)
      local want, got = S.vals(x), S.vals(h)
      for i = 1, #want do assert.are.equal(2 * want[i], got[i]) end
      local back = ms.empty({ 1000, 37 }, { device = 'cuda' })
      ms.cuda.copy_async_(back, h)
      assert.are.equal(s0 + 1, ms.cuda.memory_stats().num_host_syncs)
      local b2 = S.vals(back)
      for i = 1, #want do assert.are.equal(2 * want[i], b2[i]) end
      local ok, err = pcall(ms.cuda.copy_async_, x, d)
      assert.is_false(ok)
      assert.matches('copy_async: the host tensor is not page-locked', tostring(err), 1, true)
      ok, err = pcall(ms.cuda.copy_async_, ms.cuda.pinned_empty({ 10 }, 'f32'), d)
      assert.is_false(ok)
      assert.matches('copy_async: one host and one device tensor, contiguous, of the same bytes', tostring(err), 1, true)
    end)
  end)
end)

describe('cuda reductions on long and broadcast shapes #gpu', function()
  local function relerr(got, want)
    local g, w = got:to('cpu'):double(), want:double()
    local d = g - w
    return math.sqrt((d * d):sum():item() / (w * w):sum():item())
  end
  it('sums few long columns and whole big tensors in two deterministic passes', function()
    local x = ms.randn({ 8192, 48 }, { seed = 31 })
    local g = x:cuda()
    assert.is_true(relerr(ms.sum(g, 1), ms.sum(x, 1)) <= 1e-5)
    assert.are.same(ms.sum(g, 1):to('cpu'):totable(), ms.sum(g, 1):to('cpu'):totable())
    assert.are.same(ms.argmax(g, 1):to('cpu'):totable(), ms.argmax(x, 1):totable())
    assert.is_true(relerr(ms.logsumexp(g, 1), ms.logsumexp(x, 1)) <= 1e-5)
    local big = ms.randn({ 300000 }, { seed = 32 })
    assert.is_true(relerr(ms.sum(big:cuda()), ms.sum(big)) <= 1e-5)
    assert.is_true(relerr(ms.max(big:cuda()), ms.max(big)) <= 1e-7)
  end)
  it('few long rows (whole big tensors): every reduction matches the CPU, the same bits twice, first index on ties', function()
    -- (3, 200000) over dim 2 and all of 1.2M elements: the block-per-slice
    -- kernels (reduce_long_*); f32 and bf16
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      local x = ms.randn({ 3, 200000 }, { seed = 36 }):to(dt)
      local g = x:cuda()
      local tol = dt == 'f32' and 1e-6 or 4e-3   -- bf16: the result's one rounding (half an ulp, 2^-8)
      for _, name in ipairs({ 'sum', 'mean', 'logsumexp' }) do
        local want = ms[name](x:to('f64'), 2)
        local got = ms[name](g, 2)
        assert.is_true(relerr(got:to('f64'), want) <= tol, ('%s %s: %.3g'):format(name, dt, relerr(got:to('f64'), want)))
        assert.are.same(got:to('cpu'):to('f64'):totable(), ms[name](g, 2):to('cpu'):to('f64'):totable())
      end
      for _, name in ipairs({ 'max', 'min', 'argmax', 'argmin' }) do
        assert.are.same(ms[name](x, 2):to('f64'):totable(), ms[name](g, 2):to('cpu'):to('f64'):totable(), name)
      end
      local big = ms.randn({ 1200000 }, { seed = 37 }):to(dt)
      assert.is_true(relerr(ms.sum(big:cuda()):to('f64'), ms.sum(big:to('f64'))) <= tol)
      assert.are.equal(ms.sum(big:cuda()):item(), ms.sum(big:cuda()):item())
    end
    -- ties: the first index; a NaN wins max
    local t = ms.zeros({ 2, 100000 })
    t:narrow(2, 70001, 1):fill_(5); t:narrow(2, 90001, 1):fill_(5)
    t:narrow(1, 2, 1):narrow(2, 123, 1):fill_(0 / 0)
    local am = ms.argmax(t:cuda(), 2):to('cpu'):totable()
    assert.are.same(ms.argmax(t, 2):totable(), am)
    assert.are.equal(70000, am[1])
    local mx = ms.max(t:cuda(), 2):to('cpu'):totable()
    assert.are.equal(5, mx[1])
    assert.is_true(mx[2] ~= mx[2])
  end)
  it('column sums with a contiguous inner part (bias gradients) take the vector path and match the CPU', function()
    -- inner a multiple of 16 bytes and n >= 64: colsum_vec kernels; the
    -- others (inner 12 in bf16, n 40) the general one; all the same answers
    for _, dt in ipairs({ 'f32', 'bf16', 'f16' }) do
      for _, shape in ipairs({ { 8192, 96 }, { 3, 300, 64 }, { 1000, 2304 }, { 300, 12 }, { 40, 64 } }) do
        local x = ms.randn(shape, { seed = 35 }):to(dt)
        local d = #shape - 1
        local want = ms.sum(x:to('f64'), d)
        local got = ms.sum(x:cuda(), d)
        assert.is_true(relerr(got:to('f64'), want) <= (dt == 'f32' and 1e-6 or 1e-2), dt .. ' ' .. table.concat(shape, 'x'))
        assert.are.same(got:to('cpu'):to('f64'):totable(), ms.sum(x:cuda(), d):to('cpu'):to('f64'):totable())
        local m = ms.mean(x:cuda(), d)
        assert.is_true(relerr(m:to('f64'), ms.mean(x:to('f64'), d)) <= (dt == 'f32' and 1e-6 or 1e-2))
      end
    end
  end)
  it('bias-style broadcasts collapse to two dims and keep f32 results', function()
    local x, b = ms.randn({ 4, 33, 70 }, { seed = 33 }), ms.randn({ 70 }, { seed = 34 })
    assert.is_true(relerr(x:cuda() + b:cuda(), x + b) <= 1e-6)
    local i = ms.arange(0, 1000, { dtype = 'i32' }) * 40000
    assert.are.same((i:cuda() + 7):to('cpu'):totable(), (i + 7):totable())
  end)

  -- ops.gemm_ with an f32 out of bf16 operands (cuBLASLt: bf16 in, f32
  -- accumulated and kept), and the gradient sinks it serves
  -- (spec/grad_sink_spec.lua on the CPU)
  it('gemm_ f32 out of bf16 operands against the CPU (f32 bound), every transpose, beta 0 and 1', function()
    local F = require 'moonshard.ops'
    for _, tr in ipairs({ { false, false }, { true, false }, { false, true }, { true, true } }) do
      local M, K, N = 300, 517, 129
      local a = randn(tr[1] and { K, M } or { M, K }, 'bf16')
      local b = randn(tr[2] and { N, K } or { K, N }, 'bf16')
      local c0 = randn({ M, N })
      local want = c0:clone()
      F.gemm_(want, a, b, tr[1], tr[2], 1, 1)
      local got = c0:cuda()
      F.gemm_(got, a:cuda(), b:cuda(), tr[1], tr[2], 1, 1)
      assert.is_true(relerr(got, want) <= bound.f32, 'beta 1: ' .. relerr(got, want))
      local z = ms.empty({ M, N }, { device = 'cuda' }):fill_(0 / 0)   -- beta 0 never reads it
      F.gemm_(z, a:cuda(), b:cuda(), tr[1], tr[2], 1, 0)
      assert.is_true(relerr(z, want - c0) <= bound.f32, 'beta 0: ' .. relerr(z, want - c0))
    end
  end)

  it('a gradient sink on cuda: linear\'s weight gradient in f32 from its GEMM, as on the CPU', function()
    local A = require 'moonshard.autograd'
    local x, w0, gy = randn({ 4, 256, 384 }, 'bf16'), randn({ 512, 384 }, 'bf16'), randn({ 4, 256, 512 }, 'bf16')
    local function run(dev)
      local w = w0:to({ device = dev, copy = true }):requires_grad_()
      local s = { t = ms.empty({ 512, 384 }, { device = dev }), written = {}, i = 1 }
      A.set_grad_sink(w, s)
      ms.nn.functional.linear(x:to(dev), w):backward(gy:to(dev))
      assert.is_nil(w.grad)
      assert.is_true(s.written[1])
      return s.t
    end
    local g, c = run('cuda'), run('cpu')
    assert.is_true(relerr(g, c) <= bound.f32, relerr(g, c))
    -- and the bf16 gradient without the sink is that, rounded
    local w = w0:to({ device = 'cuda', copy = true }):requires_grad_()
    ms.nn.functional.linear(x:cuda(), w):backward(gy:cuda())
    assert.is_true(relerr(w.grad:float(), c) <= bound.bf16)
  end)
end)

-- ops.cast_flat's kernel (kernels/convert_many.cu) against the CPU copies:
-- 150 tensors (three launches of at most 64), sizes that leave tails of 1-3
-- elements, sources at offsets that break the 4-element vectors, and chunks
-- of 8192 elements split between blocks
describe('cuda cast_flat #gpu', function()
  local F = require 'moonshard.ops'
  for _, case in ipairs({ { 'f32', 'bf16' }, { 'f32', 'f16' }, { 'bf16', 'f32' }, { 'f16', 'bf16' }, { 'f32', 'f32' } }) do
    local from, to = case[1], case[2]
    it(('%s -> %s: 150 tensors in one call, as the CPU casts them'):format(from, to), function()
      local big = randn({ 40000 }, from):cuda()
      local list, cpu = {}, {}
      for i = 1, 150 do
        local t
        if i % 10 == 0 then
          t = big:narrow(1, i % 7 + 2, 8192 * (i % 3 + 1) + i % 5)   -- unaligned start, several chunks
        elseif i % 10 == 5 then
          t = big:narrow(1, 1, 16384)                                -- aligned, two whole chunks
        else
          t = randn({ i % 13 + 1, i % 7 + 3 }, from):cuda()          -- tails of 1-3 elements
        end
        list[i], cpu[i] = t, t:to('cpu')
      end
      local f = F.cast_flat(list, to)
      local want = F.cast_flat(cpu, to)
      assert.are.equal(want:numel(), f:numel())
      assert.are.equal('cuda', f.device:sub(1, 4))
      -- the same roundings: bit for bit
      assert.are.equal(0, (f:to('cpu'):to('f64') - want:to('f64')):abs():max():item())
    end)
  end
  it('a non-contiguous source takes the copy path, with the same answer', function()
    local a = randn({ 64, 48 }):cuda()
    local list = { a:t(), randn({ 5 }):cuda() }
    local f = F.cast_flat(list, 'bf16')
    local want = F.cast_flat({ list[1]:to('cpu'), list[2]:to('cpu') }, 'bf16')
    assert.are.equal(0, (f:to('cpu'):to('f64') - want:to('f64')):abs():max():item())
  end)
  it('refuses tensors on two devices, naming both', function()
    local ok, err = pcall(F.cast_flat, { randn({ 2 }):cuda(), randn({ 3 }) }, 'bf16')
    assert.is_false(ok)
    assert.matches('cast_flat: tensor 2 is', tostring(err), 1, true)
    assert.matches('on another device than tensor 1', tostring(err), 1, true)
  end)
end)

-- ops.split_flat_'s kernel (the way back) against the CPU copies: 150
-- destinations (three launches), tails of 1-3 elements, destinations at
-- offsets that break the vectors, several chunks a destination
describe('cuda split_flat_ #gpu', function()
  local F = require 'moonshard.ops'
  for _, case in ipairs({ { 'f32', 'f32' }, { 'bf16', 'bf16' }, { 'f32', 'bf16' }, { 'bf16', 'f32' } }) do
    local from, to = case[1], case[2]
    it(('%s -> %s: 150 destinations in one call, as the CPU writes them'):format(from, to), function()
      local big = ms.zeros({ 60000 }, { dtype = to }):cuda()
      local list, cpu, n = {}, {}, 0
      for i = 1, 150 do
        local t
        if i == 10 then
          t = big:narrow(1, 3, 8192 * 2 + 3)          -- unaligned start, several chunks
        elseif i == 20 then
          t = big:narrow(1, 20000, 8193)              -- (apart from the one above)
        else
          t = ms.zeros({ i % 13 + 1, i % 7 + 3 }, { dtype = to }):cuda()
        end
        list[i], n = t, n + t:numel()
        cpu[i] = ms.zeros(t.shape, { dtype = to })
      end
      local flat = randn({ n }, from)
      F.split_flat_(list, flat:cuda())
      F.split_flat_(cpu, flat)
      for i = 1, 150 do
        assert.are.equal(0, (list[i]:to('cpu'):to('f64') - cpu[i]:to('f64')):abs():max():item(), 'tensor ' .. i)
      end
      assert.is_true(cpu[150]:abs():max():item() > 0)
    end)
  end
end)
