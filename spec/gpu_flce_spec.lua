-- Fused linear cross-entropy on CUDA (kernels/flce.cu through core/flce.c):
-- the fixtures of ../shared/fixtures/flce in f32 (≤ 1e-4) and with bf16
-- inputs (≤ 2e-2), agreement with the CPU reference on random shapes (V
-- prime and V a multiple of 8: the scalar and the vectorised row pass;
-- chunks that do not divide BT), both grad_W accumulations, 'none' with a
-- random grad_output, all targets ignored, bad targets raised at the next
-- sync with position and value, and memory: no (BT, V) logits, no growth and
-- no cudaMalloc over steps. Run on a GPU host: `make test-gpu`.
local ffi = require 'ffi'
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local S = require 'spec.support'

local F = ms.raw
local FLCE = ms.nn.functional.fused_linear_cross_entropy
local fixtures = T.root .. '/../shared/fixtures'

local values, relerr, finite = S.values, S.relerr, S.finite

-- does kernels/gemm.cu take an f32 out with bf16 operands (f32 grad_W
-- accumulation without operand copies)?
pcall(ffi.cdef, 'int ms_cuda_gemm_mixed_ok(void);')
local mixed_gemm = pcall(function() return T.C.ms_cuda_gemm_mixed_ok end)

local seed = 9000
local function randn(shape, scale)
  seed = seed + 1
  local t = ms.randn(shape, { seed = seed })
  return scale and F.mul(t, scale) or t
end
local function targets(n, V, ignored)
  seed = seed + 1
  local ids = F.mul(ms.rand({ n }, { dtype = 'f64', seed = seed }), V):to('i64')
  local drop = F.lt(ms.rand({ n }, { dtype = 'f64', seed = seed + 7 }), ignored or 0)
  return F.where(drop, ms.full({ n }, -100, { dtype = 'i64' }), ids)
end

-- loss, z, acc and the grads of x, W, bias for inputs placed on `device`
-- in `dtype` (ce_weight stays f32)
local function run(x, W, t, o, device, dtype, g)
  local function leaf(v) return v and v:to({ dtype = dtype, device = device, copy = true }):requires_grad_() end
  local xd, Wd = leaf(x), leaf(W)
  local od = {}
  for k, v in pairs(o) do od[k] = v end
  od.bias = leaf(o.bias)
  if o.ce_weight then od.ce_weight = o.ce_weight:to(device) end
  od.return_z_loss, od.return_accuracy = true, true
  local loss, z, acc = FLCE(xd, Wd, t:to(device), od)
  loss:backward(g and g:to({ device = device }) or nil)
  return { loss = loss, z = z, acc = acc:item(), gx = xd.grad, gW = Wd.grad, gb = od.bias and od.bias.grad }
end

local function compare(a, b, bound, what)
  for _, k in ipairs({ 'loss', 'z', 'gx', 'gW', 'gb' }) do
    if b[k] ~= nil then
      local e = relerr(a[k], b[k])
      assert.is_true(e <= bound, ('%s %s: relative error %.3g > %g'):format(what, k, e, bound))
    end
  end
end

describe('fused_linear_cross_entropy on cuda #gpu', function()
  setup(function()
    assert.is_true(ms.cuda.is_available(), 'no CUDA device')
    print(('\n  grad_W f32 accumulation: %s'):format(mixed_gemm and 'mixed-dtype cuBLASLt GEMM'
      or 'f32 operand copies (kernels/gemm.cu has no ms_cuda_gemm_mixed_ok yet: slow)'))
  end)

  describe('fixtures', function()
    local cases, names = S.json_cases(fixtures .. '/flce/cases.json')
    for _, dtype in ipairs({ 'f32', 'bf16' }) do
      local bound = dtype == 'f32' and 1e-4 or 2e-2
      for _, name in ipairs(names) do
        it(('%s in %s within %g'):format(name, dtype, bound), function()
          local c = cases[name]
          local st = ms.load_safetensors(fixtures .. '/flce/' .. name .. '.safetensors')
          local o = { reduction = c.reduction, ignore_index = c.ignore_index, label_smoothing = c.label_smoothing,
            lse_square_scale = c.lse_square_scale, softcap = c.softcap }
          if c.bias then o.bias = st.bias end
          if c.ce_weight then o.ce_weight = st.ce_weight end
          local g = c.reduction == 'none' and st.grad_output or st.grad_output:reshape({})
          local r = run(st.x, st.W, st.targets, o, 'cuda', dtype, g)
          assert.are.equal('cuda:0', r.loss.device)
          compare(r, { loss = st.loss, z = st.z_loss, gx = st.grad_x, gW = st.grad_W,
            gb = c.bias and st.grad_bias or nil }, bound, name .. ' ' .. dtype)
          local nvalid = F.sum(F.ne(st.targets, -100):to('f64')):item()
          assert.is_true(math.abs(r.acc - st.accuracy:item()) <= (dtype == 'f32' and 1e-6 or 1 / nvalid + 1e-6))
        end)
      end
    end
  end)

  describe('against the CPU reference', function()
    -- (V = 60000: a row does not fit the row pass's shared-memory copy, so
    -- pass 2 reads it again from memory; the others use the copy)
    for _, shape in ipairs({ { 300, 64, 1009 }, { 257, 96, 4096 }, { 1, 32, 777 }, { 64, 48, 2000 }, { 48, 32, 60000 } }) do
      local BT, H, V = shape[1], shape[2], shape[3]
      it(('BT=%d H=%d V=%d: every option, chunks not dividing BT, f32 ≤ 1e-4, bf16 ≤ 2e-2'):format(BT, H, V), function()
        local x, W = randn({ BT, H }), randn({ V, H }, 0.3)
        local t = targets(BT, V, 0.1)
        local bias, cw = randn({ V }, 0.2), F.add(F.abs(randn({ V })), 0.1)
        for _, o in ipairs({
          {},
          { reduction = 'sum', chunk_size = 37 },
          { bias = bias, softcap = 5, label_smoothing = 0.1, lse_square_scale = 1e-3, ce_weight = cw, chunk_size = 100 },
          { reduction = 'none', softcap = 3, lse_square_scale = 1e-3, chunk_size = 64 },
        }) do
          local g = o.reduction == 'none' and randn({ BT }) or nil
          local cpu = run(x, W, t, o, 'cpu', 'f32', g)
          compare(run(x, W, t, o, 'cuda', 'f32', g), cpu, 1e-4, 'f32')
          compare(run(x, W, t, o, 'cuda', 'bf16', g), cpu, 2e-2, 'bf16')
          -- f16 only unscaled: 'mean' puts dlogits (~p/N) into f16's subnormals
          if o.reduction then compare(run(x, W, t, o, 'cuda', 'f16', g), cpu, 1e-2, 'f16') end
          local ob = {}
          for k, v in pairs(o) do ob[k] = v end
          ob.accum_dtype = 'bf16'   -- grad_W / grad_bias accumulated in bf16, in the output
          compare(run(x, W, t, ob, 'cuda', 'bf16', g), cpu, 2e-2, 'bf16 accumulation')
        end
      end)
    end

    it('accuracy takes the first of tied maxima (the plain and the general row pass)', function()
      -- W rows 100 and 2500 the same and the largest logit of every token:
      -- a tie; torch.argmax (and accuracy) takes 100. Half the targets are
      -- 100, half 2500, so accuracy is exactly 0.5; with a zero bias the
      -- general pass runs, without it the plain one.
      local BT, H, V = 64, 16, 3000
      local x = F.add(F.abs(randn({ BT, H })), 0.1)
      local W = randn({ V, H }, 0.05)
      local big = F.add(F.abs(randn({ 1, H })), 1)
      W:narrow(1, 101, 1):copy_(big)
      W:narrow(1, 2501, 1):copy_(big)
      local tt = {}
      for k = 1, BT do tt[k] = k % 2 == 0 and 100 or 2500 end
      local t = ms.tensor(tt, { dtype = 'i64' })
      for _, dt in ipairs({ 'f32', 'bf16' }) do
        for _, o in ipairs({ {}, { bias = ms.zeros({ V }) } }) do
          local r = run(x, W, t, o, 'cuda', dt)
          assert.are.equal(0.5, r.acc, dt .. (o.bias and ' general' or ' plain'))
          local c = run(x, W, t, o, 'cpu', 'f32')
          assert.are.equal(0.5, c.acc)
          -- (the loss only: the tied rows' gradients cancel to near zero)
          assert.is_true(relerr(r.loss, c.loss) <= (dt == 'f32' and 1e-4 or 2e-2), dt .. ' loss')
        end
      end
    end)

    it('the plain row pass gives the same bits with 4 packs a thread in flight and with 1, and with the cached row copied first or not (V = 50304 and 3001)', function()
      for _, V in ipairs({ 50304, 3001 }) do
        local x, W, t = randn({ 64, 64 }), randn({ V, 64 }, 0.3), targets(64, V, 0.1)
        local prev, prevp = T.C.ms_cuda_flce_set_row_unroll(1), T.C.ms_cuda_flce_set_row_prefetch(1)
        local ok, a = pcall(run, x, W, t, {}, 'cuda', 'bf16')
        T.C.ms_cuda_flce_set_row_unroll(4)
        local ok2, b = pcall(run, x, W, t, {}, 'cuda', 'bf16')
        T.C.ms_cuda_flce_set_row_unroll(1)
        T.C.ms_cuda_flce_set_row_prefetch(0)
        local ok3, c = pcall(run, x, W, t, {}, 'cuda', 'bf16')
        T.C.ms_cuda_flce_set_row_unroll(prev)
        T.C.ms_cuda_flce_set_row_prefetch(prevp)
        assert(ok, a)
        assert(ok2, b)
        assert(ok3, c)
        for _, k in ipairs({ 'loss', 'gx', 'gW' }) do
          assert.are.equal(0, relerr(a[k], b[k]), k .. ' at V = ' .. V)
          assert.are.equal(0, relerr(a[k], c[k]), k .. ' without the copy at V = ' .. V)
        end
      end
    end)

    it('gives the same bits on every run, and results independent of the chunk size', function()
      local x, W, t = randn({ 200, 64 }), randn({ 3001, 64 }, 0.3), targets(200, 3001, 0.1)
      local a = run(x, W, t, { chunk_size = 50 }, 'cuda', 'bf16')
      local b = run(x, W, t, { chunk_size = 50 }, 'cuda', 'bf16')
      for _, k in ipairs({ 'loss', 'gx', 'gW' }) do assert.are.equal(0, relerr(a[k], b[k]), k) end
      local c = run(x, W, t, { chunk_size = 77 }, 'cuda', 'f32')
      local d = run(x, W, t, { chunk_size = 200 }, 'cuda', 'f32')
      compare(c, d, 1e-6, 'chunk 77 vs 200')
    end)
  end)

  describe('edge cases', function()
    it('all targets ignored: 0 for mean and sum, zero gradients, no NaN', function()
      local x, W = randn({ 16, 32 }), randn({ 100, 32 })
      local t = ms.full({ 16 }, -100, { dtype = 'i64' })
      for _, red in ipairs({ 'mean', 'sum' }) do
        local r = run(x, W, t, { reduction = red, lse_square_scale = 1e-2 }, 'cuda', 'bf16')
        assert.is_true(finite(r.loss) and finite(r.gW))
        assert.are.equal(0, r.loss:item())
        assert.are.equal(0, F.sum(F.abs(r.gW:float())):item())
        assert.are.equal(0, r.acc)
      end
    end)

    it('raises a bad target at the next sync, naming position and value', function()
      local x, W = randn({ 8, 16 }):cuda(), randn({ 50, 16 }):cuda()
      local t = ms.tensor({ 1, 2, 3, 4, 77, 6, -100, 8 }, { dtype = 'i64' }):cuda()
      local loss = FLCE(x, W, t)   -- queued: no sync, no error yet
      local ok, err = pcall(function() return loss:item() end)
      assert.is_false(ok)
      assert.matches('index 77 at position 4 is out of range %[0, 50%)', tostring(err))
      -- the flag was cleared: the device goes on working
      assert.is_true(finite(FLCE(x, W, ms.tensor({ 1, 2, 3, 4, 5, 6, -100, 8 }, { dtype = 'i64' }):cuda())))
    end)
  end)

  describe('memory', function()
    it("lm_loss on the GPU gives its chunks set_lm_loss_budget's bytes (1 GiB) unless the options say", function()
      local flce = require 'moonshard.flce'
      local seen = {}
      local real = flce.fused_linear_cross_entropy
      flce.fused_linear_cross_entropy = function(x, W, t, o) seen[#seen + 1] = o or {}; return real(x, W, t, o) end
      local h = randn({ 2, 300, 64 }, 0.5):to({ device = 'cuda', dtype = 'bf16' })
      local W = randn({ 1001, 64 }, 0.5):to({ device = 'cuda', dtype = 'bf16' })
      local t = targets(600, 1001, 0.1):view({ 2, 300 }):to('cuda')
      local ok, la, lb, lc = pcall(function()
        local a = flce.lm_loss(h, W, t)
        local b = flce.lm_loss(h, W, t, { chunk_size = 128 })
        local prev = flce.set_lm_loss_budget(0)
        local c = flce.lm_loss(h, W, t)
        flce.set_lm_loss_budget(prev)
        return a:item(), b:item(), c:item()
      end)
      flce.fused_linear_cross_entropy = real
      assert(ok, la)
      -- the loss sums its rows in order: the same bits for any chunk size
      assert.are.equal(la, lb)
      assert.are.equal(la, lc)
      assert.are.equal(2 ^ 30, seen[1].memory_budget)
      assert.is_nil(seen[2].memory_budget)
      assert.are.equal(128, seen[2].chunk_size)
      assert.is_nil(seen[3].memory_budget)
    end)

    it('keeps no (BT, V) logits: peak above the inputs within grads + f32 grad_W + one chunk', function()
      local BT, H, V = 4096, 512, 50000
      local x = randn({ BT, H }):cuda():bf16():requires_grad_()
      local W = randn({ V, H }, 0.02):cuda():bf16():requires_grad_()
      local t = targets(BT, V, 0):cuda()
      local rows = 512
      local step = function()
        x.grad, W.grad = nil, nil
        FLCE(x, W, t, { chunk_size = rows }):backward()
      end
      step()
      x.grad, W.grad = nil, nil
      collectgarbage(); collectgarbage()
      ms.cuda.synchronize()
      local base = ms.cuda.memory_allocated()
      ms.cuda.reset_peak_memory_stats()
      step()
      ms.cuda.synchronize()
      local peak = ms.cuda.memory_stats().peak_allocated - base
      -- grads, the f32 grad_W accumulator, one chunk, 16 MiB of small
      -- buffers; 1.25×: the allocator's size classes (core/cuda.h)
      local allowed = (BT * H + V * H) * 2 + V * H * 4 + rows * V * 2 + (16 * 2 ^ 20)
      if not mixed_gemm then allowed = allowed + (rows * V + rows * H) * 4 end -- f32 operand copies
      allowed = allowed * 1.25
      print(('\n  peak above inputs %.1f MiB (allowed %.1f; logits would be %.1f)'):format(
        peak / 2 ^ 20, allowed / 2 ^ 20, BT * V * 2 / 2 ^ 20))
      assert.is_true(peak <= allowed)
      -- steady: no growth, no cudaMalloc from here on
      for _ = 1, 3 do step() end
      S.settle()
      local s0 = ms.cuda.memory_stats()
      for _ = 1, 10 do step() end
      S.settle()
      local s1 = ms.cuda.memory_stats()
      assert.are.equal(s0.num_mallocs, s1.num_mallocs)
      assert.are.equal(s0.allocated, s1.allocated)
    end)
  end)
end)

describe('fused_linear_cross_entropy into a gradient sink on cuda #gpu', function()
  it('bf16 W with an f32 sink: grad_W accumulated there in the forward; its rounding is the bf16 gradient', function()
    local BT, H, V = 700, 256, 1999
    local x0, W0, t = randn({ BT, H }, 0.5):to('bf16'), randn({ V, H }, 0.05):to('bf16'), targets(BT, V, 0.1)
    local function go(with_sink, g)
      local x = x0:to({ device = 'cuda', copy = true }):requires_grad_()
      local W = W0:to({ device = 'cuda', copy = true }):requires_grad_()
      return S.flce_sink_run(x, W, t:cuda(), { chunk_size = 256 },
        with_sink and ms.empty({ V, H }, { device = 'cuda' }) or nil, g)
    end
    for _, g in ipairs({ false, 0.75 }) do
      local sw, sx = go(true, g or nil)
      local bw, bx = go(false, g or nil)
      assert.are.equal(0, (sx:float() - bx:float()):abs():max():item())
      assert.is_true(finite(sw))
      if not g then
        -- (scaled, the bf16 gradient is rounded twice: before and after the scale)
        assert.are.equal(0, (sw:to('bf16'):float() - bw:float()):abs():max():item())
      end
      assert.is_true(relerr(sw, bw:float()) <= 1e-2, relerr(sw, bw:float()))
    end
  end)
end)

-- The fused linear JSD on CUDA (kernels/jsd.cu through lua/moonshard/jsd.lua):
-- PyTorch's float64 cases (spec/fixtures/jsd) in f32 (≤ 1e-4) and with bf16
-- inputs (≤ 2e-2), and the row pass against the CPU reference on random
-- logits (V prime and a large V, bf16 and f32 gradients, labels).
describe('fused_linear_jsd on cuda #gpu', function()
  local json = require 'dkjson'
  local JSD = ms.nn.functional.fused_linear_jsd
  local dir = T.root .. '/spec/fixtures/jsd'
  local function cases()
    local f = assert(io.open(dir .. '/cases.json'))
    local c = json.decode(f:read('*a')).cases
    f:close()
    return c
  end

  it('matches PyTorch\'s float64 cases: f32 within 1e-4, bf16 inputs within 2e-2', function()
    local n = 0
    for name, c in pairs(cases()) do
      local t = ms.load_safetensors(dir .. '/' .. name .. '.safetensors')
      for _, dt in ipairs({ 'f32', 'bf16' }) do
        local bound = dt == 'f32' and 1e-4 or 2e-2
        local xs = t.xs:to(dt):to('cuda'):requires_grad_()
        local Ws = t.Ws:to(dt):to('cuda'):requires_grad_()
        local xt, Wt = t.xt:to(dt):to('cuda'), t.Wt:to(dt):to('cuda')
        local loss = JSD(xs, Ws, xt, Wt, { beta = c.beta, temperature = c.temperature, reduction = c.reduction,
          labels = t.labels and t.labels:to('cuda') or nil, chunk_size = 4 })
        loss:backward()
        local want = t.loss:item()
        assert.is_true(math.abs(loss:item() - want) <= bound * math.abs(want), ('%s %s: loss %.9g, reference %.9g')
          :format(name, dt, loss:item(), want))
        assert.is_true(relerr(xs.grad:float():cpu(), t.grad_xs) <= bound, name .. ' ' .. dt .. ' grad_xs')
        assert.is_true(relerr(Ws.grad:float():cpu(), t.grad_Ws) <= bound, name .. ' ' .. dt .. ' grad_Ws')
        n = n + 1
      end
    end
    assert.are.equal(10, n)
  end)

  it('the row pass: the CPU reference\'s loss and gradient on random logits (f32 1e-5, bf16 gradients 1e-2)', function()
    for _, c in ipairs({ { 5, 37, 0 }, { 3, 50021, 0.5 }, { 4, 1000, 1 }, { 6, 4099, 0.25 } }) do
      local n, V, beta = c[1], c[2], c[3]
      local s = randn({ n, V }, 3)
      local t = randn({ n, V }, 3)
      local labels = ms.tensor({ 1, -100, 3, 0, 2, 7 }, { dtype = 'i64' }):narrow(1, 1, n):contiguous()
      local function rows(dev, gdt)
        local g = ms.empty({ n, V }, { dtype = gdt, device = dev })
        local l = ms.empty({ n }, { device = dev })
        T.check(T.C.ms_jsd_rows(g, l, s:to(dev), t:to(dev), labels:to(dev), -100, beta, 0.7))
        return l:float():cpu(), g:float():cpu()
      end
      local lc, gc = rows('cpu', 'f32')
      local lg, gg = rows('cuda', 'f32')
      assert.is_true(finite(lg) and finite(gg))
      assert.is_true(relerr(lg, lc) <= 1e-5, ('V %d beta %g: loss %.3e'):format(V, beta, relerr(lg, lc)))
      assert.is_true(relerr(gg, gc) <= 1e-5, ('V %d beta %g: gradient %.3e'):format(V, beta, relerr(gg, gc)))
      assert.are.equal(0, values(lg)[2])
      -- the loss alone (no gradient: at beta 0 the other sweep order) is
      -- the same bits
      local l0 = ms.empty({ n }, { device = 'cuda' })
      T.check(T.C.ms_jsd_rows(nil, l0, s:to('cuda'), t:to('cuda'), labels:to('cuda'), -100, beta, 0.7))
      assert.are.same(values(lg), values(l0:cpu()))
      local _, gb = rows('cuda', 'bf16')
      assert.is_true(relerr(gb, gc) <= 1e-2, ('V %d beta %g: bf16 gradient %.3e'):format(V, beta, relerr(gb, gc)))
      -- bf16 / f16 logits (what the chunks hold for 16-bit inputs; V 1000
      -- in 16-byte packs, the odd V one element at a time): the CPU
      -- reference on the same values, the gradient in place of s too
      for _, dt in ipairs({ 'bf16', 'f16' }) do
        local s16, t16 = s:to(dt), t:to(dt)
        local lr, gr = ms.empty({ n }), ms.empty({ n, V })
        T.check(T.C.ms_jsd_rows(gr, lr, s16:float(), t16:float(), labels, -100, beta, 0.7))
        local sd, td = s16:to('cuda'), t16:to('cuda')
        local l16, g32 = ms.empty({ n }, { device = 'cuda' }), ms.empty({ n, V }, { device = 'cuda' })
        T.check(T.C.ms_jsd_rows(g32, l16, sd, td, labels:to('cuda'), -100, beta, 0.7))
        assert.is_true(relerr(l16:cpu(), lr) <= 1e-5, ('%s V %d beta %g: loss %.3e'):format(dt, V, beta,
          relerr(l16:cpu(), lr)))
        assert.is_true(relerr(g32:cpu(), gr) <= 1e-5, ('%s V %d beta %g: f32 gradient %.3e'):format(dt, V, beta,
          relerr(g32:cpu(), gr)))
        T.check(T.C.ms_jsd_rows(sd, l16, sd, td, labels:to('cuda'), -100, beta, 0.7))
        assert.is_true(relerr(sd:float():cpu(), gr) <= 1e-2, ('%s V %d beta %g: in-place gradient %.3e'):format(dt,
          V, beta, relerr(sd:float():cpu(), gr)))
        assert.is_true(relerr(l16:cpu(), lr) <= 1e-5)
      end
    end
  end)
end)
