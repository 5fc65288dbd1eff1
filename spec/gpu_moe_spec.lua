-- Mixture-of-experts layers on the GPU (#gpu, `make test-gpu`) against the
-- same layer on the CPU: routing decided on the device (the same experts
-- chosen: f32 scores), the output and every gradient within 1e-4 (f32),
-- the bf16-autocast layer within 2e-2 of the f32 CPU one; the tiny
-- Mixtral's and Qwen3-MoE's loss and gradients on the GPU as on the CPU.
local ms = require 'moonshard'
local A = ms.autograd
local nn = ms.nn

local S_values = require('spec.support').values

local function relerr(got, want)
  local g, w = got:to('cpu'):double(), want:to('cpu'):double()
  local num = ((g - w) * (g - w)):sum():item()
  local den = (w * w):sum():item()
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end

-- every parameter's gradient of the GPU model against the CPU one's (1e-4)
local function same_grads(gpu, cpu)
  local pc = cpu:parameters()
  for i, p in ipairs(gpu:parameters()) do
    local e = relerr(p.grad, pc[i].grad)
    assert.is_true(e <= 1e-4, ('parameter %d: %g'):format(i, e))
  end
end

describe('nn.MoE on CUDA #gpu', function()
  setup(function() assert.is_true(ms.cuda.is_available(), 'no CUDA device') end)
  before_each(function() A.clear_tape() end)

  local function pair(cfg)
    ms.manual_seed(11)
    local cpu = nn.MoE(cfg)
    for _, p in ipairs(cpu:parameters()) do ms.normal_(p, 0, 0.3) end
    ms.manual_seed(11)
    local gpu = nn.MoE(cfg)
    for i, p in ipairs(gpu:parameters()) do p:copy_(cpu:parameters()[i]) end
    gpu:to('cuda')
    return cpu, gpu
  end

  it('the row moves (gather with padding, weighted combine, its backward) against the CPU, f32 and bf16', function()
    local T = require 'moonshard.tensor'
    local N, k, H = 37, 3, 96
    -- a layout as moe.sort_slots makes it: 5 experts, runs padded to 8
    local ids = {}
    for n = 1, N do ids[n] = { (n * 7) % 5, (n * 3 + 1) % 5, (n * 11 + 2) % 5 } end
    local st = nn.moe.sort_slots(ms.tensor(ids, { dtype = 'i64' }), 5, 8)
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      local bound = dt == 'f32' and 1e-6 or 1e-2
      local x = ms.randn({ N, H }, { seed = 21 }):to(dt)
      local ys = ms.randn({ st.M, H }, { seed = 22 }):to(dt)
      local w = ms.randn({ N * k }, { seed = 23 }):to(dt)
      local g = ms.randn({ N, H }, { seed = 24 }):to(dt)
      local function run(dev)
        local function on(t) return t:to(dev) end
        local xs = T.empty({ st.M, H }, { dtype = dt, device = dev })
        T.check(T.C.ms_moe_gather_rows(xs, on(x), on(st.tok)))
        local y = T.empty({ N, H }, { dtype = dt, device = dev })
        T.check(T.C.ms_moe_combine(y, on(ys), on(st.inv), on(w), k))
        local y1 = T.empty({ N, H }, { dtype = dt, device = dev })
        T.check(T.C.ms_moe_combine(y1, on(ys), on(st.inv), nil, k))
        local gys = T.empty({ st.M, H }, { dtype = dt, device = dev })
        local gw = T.empty({ N * k }, { dtype = dt, device = dev })
        T.check(T.C.ms_moe_combine_backward(gys, gw, on(g), on(ys), on(st.back), on(w), k))
        return { xs = xs, y = y, y1 = y1, gys = gys, gw = gw }
      end
      local c, d = run('cpu'), run('cuda')
      for name, t in pairs(c) do
        local e = relerr(d[name], t)
        assert.is_true(e <= bound, ('%s %s: %g'):format(dt, name, e))
      end
      -- the padding rows are zeros
      local pad = 0
      for r, tk in ipairs(S_values(st.tok)) do
        if tk == N then pad = pad + 1; assert.are.equal(0, d.xs:narrow(1, r, 1):abs():sum():item()) end
      end
      assert.is_true(pad > 0)
    end
  end)

  for _, c in ipairs({
    { 'top-2 of 8, softmax', { dim = 64, hidden = 96, experts = 8, top_k = 2 } },
    { 'top-4 of 16, sigmoid, a shared expert', { dim = 64, hidden = 64, experts = 16, top_k = 4, score = 'sigmoid',
      shared_hidden = 128 } },
  }) do
    it(c[1] .. ': f32 output and gradients as the CPU layer (1e-4)', function()
      local cpu, gpu = pair(c[2])
      local x = ms.randn({ 4, 33, 64 }, { seed = 5 })
      local g = ms.randn({ 4, 33, 64 }, { seed = 6 })
      -- (one tape: each layer's forward and backward in turn)
      local xc, xg = x:clone():requires_grad_(), x:cuda():requires_grad_()
      local yc = cpu(xc)
      yc:backward(g)
      local yg = gpu(xg)
      yg:backward(g:cuda())
      local cc, cg = cpu:last_stats(), gpu:last_stats()
      assert.are.same(cc, cg, 'the same experts chosen')
      assert.is_true(relerr(yg, yc) <= 1e-4, 'output ' .. relerr(yg, yc))
      assert.is_true(relerr(xg.grad, xc.grad) <= 1e-4, 'input gradient ' .. relerr(xg.grad, xc.grad))
      same_grads(gpu, cpu)
    end)
  end

  it('the routing choice in one kernel (moe.select) as on the CPU: ties, biases, groups, f32 and f64, 64 experts, '
    .. '20000 tokens', function()
    local n = 0
    for _, c in ipairs({ { 8, 1, 1, 2 }, { 16, 4, 2, 4 }, { 12, 3, 1, 3 }, { 64, 8, 4, 8 }, { 256, 8, 4, 8 } }) do
      local E, G, TG, k = c[1], c[2], c[3], c[4]
      for _, dtype in ipairs({ 'f32', 'f64' }) do
        for _, how in ipairs({ 'top2', 'max' }) do
          n = n + 1
          -- (a grid of eighths: ties everywhere)
          local sc = (ms.rand({ 20000, E }, { seed = n }) * 8):to('i64'):to(dtype) / 8
          local b = (ms.rand({ E }, { seed = 50 + n }) * 4):to('i64'):to(dtype) / 16
          for _, bias in ipairs({ false, true }) do
            local cpu = nn.moe.select(sc, bias and b or nil, G, TG, how, k)
            local gpu = nn.moe.select(sc:to('cuda'), bias and b:to('cuda') or nil, G, TG, how, k)
            assert.are.equal('cuda:0', gpu.device)
            local cv, gv, diff = S_values(cpu), S_values(gpu), 0
            for i = 1, #cv do if cv[i] ~= gv[i] then diff = diff + 1 end end
            assert.are.equal(#cv, #gv)
            assert.are.equal(0, diff, ('E %d G %d TG %d k %d %s %s bias %s'):format(E, G, TG, k, dtype, how,
              tostring(bias)))
          end
        end
      end
    end
  end)

  it('the slots\' sort on the device (ms_moe_sort, kernels/moe.cu) as the host\'s (ms_moe_sort_slots): random ids, '
    .. 'align 1 and 128, an expert with no slots, every slot to one expert, 2^20 slots, 1024 experts; a bad id named',
    function()
      local ffi = ms.ffi
      local seed = 4242
      -- (N, k) ids in [0, E) from an LCG; `skip` never chosen, or all `one`
      local function ids_of(N, k, E, skip, one)
        local t = ms.empty({ N, k }, { dtype = 'i64' })
        local p = ffi.cast('int64_t *', t:data_ptr())
        for i = 0, N * k - 1 do
          seed = seed * 16807 % 2147483647   -- (exact in doubles)
          local e = seed % E
          if one then e = one elseif e == skip then e = (e + 1) % E end
          p[i] = e
        end
        return t
      end
      local function same(want, got, what)
        local g = got:to('cpu')
        assert.are.same(want.shape, g.shape, what)
        local a, b = ffi.cast('int64_t *', want:data_ptr()), ffi.cast('int64_t *', g:data_ptr())
        for i = 0, want:numel() - 1 do
          if a[i] ~= b[i] then
            error(('%s[%d]: %d on the device, %d on the host'):format(what, i, tonumber(b[i]), tonumber(a[i])))
          end
        end
      end
      local cases = {
        { 37, 3, 5, 1 }, { 37, 3, 5, 128 }, { 1000, 8, 64, 128, 17 }, { 4096, 6, 160, 128, nil, 42 },
        { 4096, 2, 8, 1, nil, 7 }, { 1, 1, 1, 1 }, { 3001, 8, 256, 128, 0 }, { 131072, 8, 256, 128, 255 },
        { 65536, 4, 1024, 128 }, { 50000, 2, 3, 1 },
      }
      for _, c in ipairs(cases) do
        local N, k, E, align = c[1], c[2], c[3], c[4]
        local what = ('N %d, k %d, E %d, align %d'):format(N, k, E, align)
        local ids = ids_of(N, k, E, c[5], c[6])
        local want = nn.moe.sort_slots(ids, E, align)
        local got = nn.moe.sort_slots_on(ids:to('cuda'), E, align)
        assert.are.equal('cuda', got.order.device:sub(1, 4), what)
        for _, f in ipairs({ 'order', 'inv', 'tok', 'back' }) do same(want[f], got[f], what .. ': ' .. f) end
        assert.are.same(want.counts, got.counts, what)
        assert.are.same(want.rows, got.rows, what)
        assert.are.equal(want.M, got.M, what)
        assert.are.equal(want.pads, got.pads, what)
        if c[5] then assert.are.equal(0, got.counts[c[5] + 1], what) end
        if c[6] then assert.are.equal(N * k, got.counts[c[6] + 1], what) end
      end
      -- bad ids: the lowest slot named, with its id (negative and past E; one in a later chunk too)
      local ids = ids_of(70000, 4, 16)
      local p = ffi.cast('int64_t *', ids:data_ptr())
      p[250001], p[123457], p[200000] = 16, -2, 99
      local ok, err = pcall(nn.moe.sort_slots_on, ids:to('cuda'), 16, 128)
      assert.is_false(ok)
      assert.matches('moe: expert id -2 at slot 123457 is outside [0, 16)', tostring(err), 1, true)
      ok, err = pcall(nn.moe.sort_slots_on, ms.tensor({ { 0, 4 } }, { dtype = 'i64' }):to('cuda'), 4)
      assert.is_false(ok)
      assert.matches('moe: expert id 4 at slot 1 is outside [0, 4)', tostring(err), 1, true)
      -- what the CUDA sort does not take, named
      ok, err = pcall(nn.moe.sort_slots_on, ids_of(4, 2, 8):to('cuda'), 1025)
      assert.is_false(ok)
      assert.matches('the CUDA sort takes 1024 experts', tostring(err), 1, true)
    end)

  it('a forward reads its routing once without a stream sync (the slots sorted on the device, the experts\' counts '
    .. 'through page-locked memory; with moe.host_sort the ids, sorted on the host, the index vectors uploaded '
    .. 'asynchronously), with a shared expert queued before the wait; output and gradients as the CPU',
    function()
      ms.manual_seed(6)
      local cpu = nn.MoE { dim = 32, hidden = 16, experts = 8, top_k = 2, shared_hidden = 24 }
      local gpu = nn.MoE { dim = 32, hidden = 16, experts = 8, top_k = 2, shared_hidden = 24 }:to('cuda')
      gpu:load_state_dict(cpu:state_dict())
      local x = ms.randn({ 3, 50, 32 }, { seed = 8 })
      local host_sort = nn.moe.host_sort
      finally(function() nn.moe.host_sort = host_sort end)
      for pass = 1, 6 do   -- (the layer's page-locked buffers reused, then grown; the device sort, then the host's)
        nn.moe.host_sort = pass > 3
        local xs = pass % 3 ~= 0 and x or ms.randn({ 5, 70, 32 }, { seed = 9 })
        local xg = xs:to('cuda'):requires_grad_()
        local xc = xs:clone():requires_grad_()
        ms.cuda.synchronize()
        local s0 = ms.cuda.memory_stats().num_host_syncs
        gpu:zero_grad(); cpu:zero_grad()
        local yg = gpu(xg)
        assert.are.equal(s0 + 1, ms.cuda.memory_stats().num_host_syncs, 'host syncs of a forward')
        yg:sum():backward()   -- (one graph at a time: a backward takes the tape)
        local yc = cpu(xc)
        yc:sum():backward()
        assert.is_true(relerr(yg, yc) <= 1e-4, 'y ' .. relerr(yg, yc))
        assert.is_true(relerr(xg.grad, xc.grad) <= 1e-4, 'dx ' .. relerr(xg.grad, xc.grad))
        same_grads(gpu, cpu)
      end
    end)

  it('the experts\' SwiGLU kernels (forward, backward) against the CPU, f32 and bf16', function()
    local T = require 'moonshard.tensor'
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      for _, shp in ipairs({ { 300, 352 }, { 37, 5 } }) do
        local M, I = shp[1], shp[2]
        local gu = (ms.randn({ M, 2 * I }, { seed = 51 }) * 3):to(dt)
        local dh = ms.randn({ M, I }, { seed = 52 }):to(dt)
        local h, d13 = ms.empty({ M, I }, { dtype = dt }), ms.empty({ M, 2 * I }, { dtype = dt })
        T.check(T.C.ms_moe_swiglu(h, gu))
        T.check(T.C.ms_moe_swiglu_backward(d13, gu, dh))
        local hc, dc = ms.empty({ M, I }, { dtype = dt, device = 'cuda' }), ms.empty({ M, 2 * I }, { dtype = dt, device = 'cuda' })
        T.check(T.C.ms_moe_swiglu(hc, gu:cuda()))
        T.check(T.C.ms_moe_swiglu_backward(dc, gu:cuda(), dh:cuda()))
        local tol = dt == 'f32' and 1e-5 or 1e-2
        assert.is_true(relerr(hc, h) < tol, dt .. ' h ' .. relerr(hc, h))
        assert.is_true(relerr(dc, d13) < tol, dt .. ' d13 ' .. relerr(dc, d13))
      end
    end
  end)

  it('the SwiGLU kernels past 2^32 elements (64-bit offsets): the last rows as the CPU computes them', function()
    local T = require 'moonshard.tensor'
    local M, I = 2200000, 1024          -- gu: 4.5e9 bf16 elements (past 2^32), 26 GB in all
    local gu = ms.randn({ M, 2 * I }, { seed = 53, device = 'cuda', dtype = 'bf16' })
    local dh = ms.randn({ M, I }, { seed = 54, device = 'cuda', dtype = 'bf16' })
    local h = ms.empty({ M, I }, { dtype = 'bf16', device = 'cuda' })
    local d13 = ms.empty({ M, 2 * I }, { dtype = 'bf16', device = 'cuda' })
    T.check(T.C.ms_moe_swiglu(h, gu))
    T.check(T.C.ms_moe_swiglu_backward(d13, gu, dh))
    local r0, n = M - 7, 8
    local gc, dc = gu:narrow(1, r0, n):to('cpu'):contiguous(), dh:narrow(1, r0, n):to('cpu'):contiguous()
    local hc, d13c = ms.empty({ n, I }, { dtype = 'bf16' }), ms.empty({ n, 2 * I }, { dtype = 'bf16' })
    T.check(T.C.ms_moe_swiglu(hc, gc))
    T.check(T.C.ms_moe_swiglu_backward(d13c, gc, dc))
    assert.is_true(relerr(h:narrow(1, r0, n), hc) < 1e-2)
    assert.is_true(relerr(d13:narrow(1, r0, n), d13c) < 1e-2)
    gu:free(); dh:free(); h:free(); d13:free()
  end)

  it('bf16 autocast on the GPU: within 2e-2 of the f32 CPU layer; the aux loss as the CPU\'s (1e-4)', function()
    local cpu, gpu = pair({ dim = 64, hidden = 96, experts = 8, top_k = 2 })
    local x = ms.randn({ 2, 64, 64 }, { seed = 7 })
    local yc = cpu(x)
    local auxc = nn.moe.aux_loss({ cpu })
    local yg = nn.functional.autocast('bf16', function() return gpu(x:cuda()) end)
    assert.are.equal('bf16', yg.dtype)
    assert.is_true(relerr(yg, yc) <= 2e-2, 'output ' .. relerr(yg, yc))
    -- (the router's scores in f32 from bf16 logits: the experts may differ at near ties, the aux loss barely)
    local auxg = nn.moe.aux_loss({ gpu })
    assert.is_true(relerr(auxg, auxc) <= 2e-2, 'aux ' .. relerr(auxg, auxc))
  end)

  it('the sequence-wise balance loss (seq_aux_loss, and a session\'s value and gradients) as on the CPU (f32, '
    .. '1e-4)', function()
    local cfg = { dim = 32, hidden = 48, experts = 16, top_k = 4, score = 'sigmoid', n_group = 4, topk_group = 2,
      router_bias = true }
    local cpu, gpu = pair(cfg)
    local b = ms.randn({ 16 }, { seed = 3 }) * 0.2
    cpu.gate.e_score_correction_bias:copy_(b)
    gpu.gate.e_score_correction_bias:copy_(b:cuda())
    local x = ms.randn({ 3, 40, 32 }, { seed = 7 })
    local function run(m, xi)
      xi = xi:clone():requires_grad_()
      local box = nn.moe.seq_aux_begin({ m }, { alpha = 0.5, choice = 'scores' })
      local y = m(xi)
      local direct = nn.moe.seq_aux_loss({ m }, 0.5, { choice = 'routing' }):to('cpu')
      local loss = nn.moe.seq_aux_end((y * y):mean():reshape({ 1 }), box)
      loss:backward()
      nn.moe.seq_aux_begin({ m }, nil)
      return direct, loss:to('cpu'), xi.grad
    end
    local dc, lc, gc = run(cpu, x)
    local dg, lg, gg = run(gpu, x:cuda())
    assert.is_true(relerr(dg, dc) <= 1e-4, 'seq_aux_loss ' .. relerr(dg, dc))
    assert.is_true(relerr(lg, lc) <= 1e-4, 'loss ' .. relerr(lg, lc))
    assert.is_true(relerr(gg, gc) <= 1e-4, 'input ' .. relerr(gg, gc))
    same_grads(gpu, cpu)
  end)

  it('the load-balancing loss\'s session (aux_begin / aux_end) over two layers, checkpointed and not: the value '
    .. 'and every gradient as on the CPU (f32, 1e-4)', function()
    local cfg = { dim = 32, hidden = 48, experts = 8, top_k = 2 }
    local c1, g1 = pair(cfg)
    local c2, g2 = pair(cfg)
    local x = ms.randn({ 3, 40, 32 }, { seed = 7 })
    local function run(m1, m2, xi, ckpt)
      for _, m in ipairs({ m1, m2 }) do for _, p in ipairs(m:parameters()) do p.grad = nil end end
      xi = xi:clone():requires_grad_()
      local box = nn.moe.aux_begin({ m1, m2 }, { coef = 0.5 })
      local y = ckpt and A.checkpoint(function(h) return m2(m1(h)) end, xi) or m2(m1(xi))
      local loss = nn.moe.aux_end((y * y):mean():reshape({ 1 }), box)
      loss:backward()
      nn.moe.aux_begin({ m1, m2 }, nil)
      A.clear_tape()
      return loss:to('cpu'), xi.grad
    end
    for _, ckpt in ipairs({ false, true }) do
      local lc, gc = run(c1, c2, x, ckpt)
      local lg, gg = run(g1, g2, x:cuda(), ckpt)
      assert.is_true(relerr(lg, lc) <= 1e-4, 'loss ' .. relerr(lg, lc))
      assert.is_true(relerr(gg, gc) <= 1e-4, 'input ' .. relerr(gg, gc))
      same_grads(g1, c1)
      same_grads(g2, c2)
    end
  end)

  it('bf16 autocast, 70 experts: the grouped GEMM kernel as the loop of cuBLASLt GEMMs and the f32 CPU layer', function()
    local F = require 'moonshard.ops'
    local cfg = { dim = 64, hidden = 96, experts = 70, top_k = 2 }
    local cpu, gpu = pair(cfg)
    local x = ms.randn({ 2, 64, 64 }, { seed = 8 })
    local g = ms.randn({ 2, 64, 64 }, { seed = 9 })
    local xc = x:clone():requires_grad_()
    cpu(xc):backward(g)
    local function run(kernel)
      local was = F.gemm_grouped_kernel(kernel)
      for _, p in ipairs(gpu:parameters()) do p.grad = nil end
      local xg = x:cuda():requires_grad_()
      local y = nn.functional.autocast('bf16', function() return gpu(xg) end)
      y:backward(g:cuda():to('bf16'))
      F.gemm_grouped_kernel(was)
      local grads = {}
      for i, p in ipairs(gpu:parameters()) do grads[i] = p.grad end
      return y, xg.grad, grads
    end
    local yk, dxk, gk = run('kernel')
    local yl, dxl, gl = run('loop')
    assert.is_true(relerr(yk, yl) <= 1e-2, 'output ' .. relerr(yk, yl))
    assert.is_true(relerr(dxk, dxl) <= 1e-2, 'input gradient ' .. relerr(dxk, dxl))
    -- (against f32: the gradient is rounded to bf16 at every step, the loop's as much)
    assert.is_true(relerr(dxk, xc.grad) <= 5e-2, 'input gradient against the CPU ' .. relerr(dxk, xc.grad))
    -- (against the CPU: all the parameters' gradients as one vector; a
    -- rarely chosen expert's own is mostly bf16 rounding)
    local pc, idle, num, den = cpu:parameters(), 0, 0, 0
    for i = 1, #gk do
      assert.is_true(relerr(gk[i], gl[i]) <= 1e-2, ('parameter %d: %g'):format(i, relerr(gk[i], gl[i])))
      local d = gk[i]:to('cpu'):double() - pc[i].grad:double()
      num = num + (d * d):sum():item()
      den = den + (pc[i].grad:double() * pc[i].grad:double()):sum():item()
      if gk[i]:abs():max():item() == 0 then idle = idle + 1 end
    end
    assert.is_true(math.sqrt(num / den) <= 5e-2, 'the gradients against the CPU: ' .. math.sqrt(num / den))
    assert.is_true(idle < #gk / 2, 'most experts got tokens')
  end)

  for _, fam in ipairs({ 'mixtral', 'qwen3_moe', 'qwen2_moe' }) do
  it(('the tiny %s: loss and gradients on the GPU as on the CPU (f32, 1e-4)'):format(fam), function()
    local M = require('models.' .. fam)
    ms.manual_seed(3)
    local cpu = M.new('tiny', { num_hidden_layers = 2 })
    ms.manual_seed(3)
    local gpu = M.new('tiny', { num_hidden_layers = 2 })
    for i, p in ipairs(gpu:parameters()) do p:copy_(cpu:parameters()[i]) end
    gpu:to('cuda')
    local x = ms.tensor({ { 1, 50, 99, 130, 7, 8, 200, 3 }, { 4, 5, 6, 250, 9, 10, 11, 12 } }, { dtype = 'i64' })
    local y = ms.tensor({ { 50, 99, 130, 7, 8, 200, 3, 1 }, { 5, 6, 250, 9, 10, 11, 12, 4 } }, { dtype = 'i64' })
    local lc = cpu(x, y)
    lc:backward()
    local lg = gpu(x:cuda(), y:cuda())
    lg:backward()
    assert.is_true(relerr(lg, lc) <= 1e-5, ('%.9g against %.9g'):format(lg:item(), lc:item()))
    same_grads(gpu, cpu)
  end)
  end
end)
