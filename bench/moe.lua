-- bench/moe.lua — a mixture-of-experts layer's forward + backward on the
-- GPU (nn.MoE, docs/moe.md) beside the dense SwiGLU MLP of the same
-- FLOPs a token (hidden = top_k x the expert's), under bf16 autocast with
-- f32 weights: median ms (CUDA events), the experts' GEMM TFLOP/s, and the
-- routing's share (the MoE's time over the dense MLP's); the layer again
-- with the experts' products always on the grouped kernel, and always a
-- loop of cuBLASLt GEMMs (ops.gemm_grouped_kernel 'kernel' and 'loop'; the
-- default 'auto' chooses between them by the groups' size). Then the experts'
-- products alone, the three layouts of the grouped GEMM with balanced
-- experts (tokens x top-k / experts rows each), grouped kernel against the
-- loop and against one dense cuBLASLt GEMM of all the rows. Between them,
-- the layer's step on its own: wall time synced each step, the host's
-- issue time, and the peak allocated above the start. Last, a layer's
-- routing read (moe.routing_read) with the slots sorted on the device and
-- on the host (MS_MOE_HOST_SORT=1's path), at up to 16 x tokens x 8 slots.
--
--   luajit bench/moe.lua [--tokens 8192] [--dim 2048] [--iters 20] [--warmup 3]
-- Cases: 8 experts of 1408, top-2 (Mixtral's shape, scaled); 64 experts
-- of 352, top-8 (fine-grained, as Qwen3-MoE and DeepSeek); 16 of 704,
-- top-4.
local ms = require 'moonshard'
local B = require 'bench.common'
local nn = ms.nn

local opts = B.parse_args({ tokens = 8192, dim = 2048, iters = 20, warmup = 3 },
  'usage: luajit bench/moe.lua [--tokens N] [--dim H] [--iters N] [--warmup N]')
assert(ms.cuda.is_available(), 'bench/moe.lua: no CUDA device')
local timed = B.timer(opts)
local N, H = opts.tokens, opts.dim

local function step_time(m, x, g)
  local params = m:parameters()
  return timed(function()
    local y = nn.functional.autocast('bf16', function() return m(x) end)
    y:backward(g)
    for _, p in ipairs(params) do p.grad = nil end
  end)
end

-- each step on its own: the wall time of a step synced before and after,
-- the host's time to issue it (until the step returns, unsynced), and the
-- peak allocated during the steps above what was allocated before them
-- (medians of opts.iters steps after opts.warmup)
local function step_alone(m, x, g)
  local params = m:parameters()
  local function step()
    local y = nn.functional.autocast('bf16', function() return m(x) end)
    y:backward(g)
    for _, p in ipairs(params) do p.grad = nil end
  end
  for _ = 1, opts.warmup do step() end
  ms.cuda.synchronize()
  local base = ms.cuda.memory_stats().allocated
  ms.cuda.reset_peak_memory_stats()
  local walls, issues = {}, {}
  for i = 1, opts.iters do
    local t0 = B.now()
    step()
    local t1 = B.now()
    ms.cuda.synchronize()
    walls[i], issues[i] = (B.now() - t0) * 1e3, (t1 - t0) * 1e3
  end
  local peak = tonumber(ms.cuda.memory_stats().peak_allocated - base)
  return B.median(walls), B.median(issues), peak / 2 ^ 20
end

local F = require 'moonshard.ops'
local alone = {}
print(('| experts | top-k | expert hidden | tokens | H | MoE ms | dense ms (hidden %s) | MoE / dense | expert GEMM TFLOP/s | MoE ms, grouped kernel | MoE ms, GEMM loop |')
  :format('k x'))
print('|---|---|---|---|---|---|---|---|---|---|---|')
for _, c in ipairs({ { 8, 2, 1408 }, { 16, 4, 704 }, { 64, 8, 352 } }) do
  local E, k, I = c[1], c[2], c[3]
  ms.manual_seed(1)
  local m = nn.MoE { dim = H, hidden = I, experts = E, top_k = k }
  for _, p in ipairs(m:parameters()) do ms.normal_(p, 0, 0.02) end
  m:to('cuda')
  local d = nn.GatedMLP { dim = H, hidden = k * I }
  for _, p in ipairs(d:parameters()) do ms.normal_(p, 0, 0.02) end
  d:to('cuda')
  local x = ms.randn({ N, H }, { seed = 3 }):cuda():requires_grad_()
  local g = ms.randn({ N, H }, { seed = 4 }):cuda():to('bf16')
  local td = step_time(d, x, g)
  local was = F.gemm_grouped_kernel('kernel')
  local tk = step_time(m, x, g)
  F.gemm_grouped_kernel('loop')
  local tl = step_time(m, x, g)
  F.gemm_grouped_kernel(was)
  local tm = step_time(m, x, g)
  -- forward + backward of the experts' three GEMMs a slot: 3 x 2 x 3 x H x I flops
  local flops = 18 * N * k * H * I
  print(('| %d | %d | %d | %d | %d | %.2f | %.2f | %.2f | %.0f | %.2f | %.2f |'):format(E, k, I, N, H, tm, td, tm / td,
    flops / (tm * 1e-3) / 1e12, tk, tl))
  local wall, issue, peak = step_alone(m, x, g)
  alone[#alone + 1] = ('| %d | %d | %d | %.2f | %.2f | %.0f |'):format(E, k, I, wall, issue, peak)
  m:to('cpu'); d:to('cpu')
  collectgarbage(); collectgarbage()
end

-- the layer's steps on their own ('auto')
print()
print('| experts | top-k | expert hidden | step alone, synced ms | host issue ms | peak allocated above the start MiB |')
print('|---|---|---|---|---|---|')
for _, line in ipairs(alone) do print(line) end

-- the experts' products alone: E groups of R = N k / E rows (balanced)
print()
print('| experts | rows each | product | grouped kernel ms | TFLOP/s | mma.sync kernel ms | loop ms | one dense GEMM ms |')
print('|---|---|---|---|---|---|---|---|')
for _, c in ipairs({ { 8, 2, 1408 }, { 16, 4, 704 }, { 64, 8, 352 } }) do
  local E, k, I = c[1], c[2], c[3]
  local R = math.floor(N * k / E)
  local xs = ms.randn({ R * E, H }, { seed = 5 }):cuda():to('bf16')
  local hs = ms.randn({ R * E, I }, { seed = 6 }):cuda():to('bf16')
  local w1 = ms.randn({ I, H }, { seed = 7 }):cuda():to('bf16')
  local gs = ms.empty({ R * E, I }, { dtype = 'bf16', device = 'cuda' })
  local ys = ms.empty({ R * E, H }, { dtype = 'bf16', device = 'cuda' })
  local dw = ms.empty({ I, H }, { device = 'cuda' })
  local function rows(t, e) return t:narrow(1, (e - 1) * R + 1, R) end
  -- name, outs, as, bs, transa, transb, the dense GEMM's (out, a, b, transa, transb)
  local cases = {
    { 'x W1^T (forward)', function(e) return rows(gs, e), rows(xs, e), w1 end, false, true,
      { gs, xs, w1, false, true } },
    { 'h W1 (input gradient)', function(e) return rows(ys, e), rows(hs, e), w1 end, false, false,
      { ys, hs, w1, false, false } },
    { 'h^T x (weight gradient, f32)', function(e) return dw:clone(), rows(hs, e), rows(xs, e) end, true, false,
      { ms.empty({ I, H }, { device = 'cuda' }), hs, xs, true, false } },
  }
  for _, cs in ipairs(cases) do
    local outs, as, bs = {}, {}, {}
    for e = 1, E do outs[e], as[e], bs[e] = cs[2](e) end
    local was = F.gemm_grouped_kernel('kernel')
    local tg = timed(function() F.gemm_grouped_(outs, as, bs, cs[3], cs[4], 0) end)
    F.gemm_grouped_kernel('mma')
    local tm = timed(function() F.gemm_grouped_(outs, as, bs, cs[3], cs[4], 0) end)
    F.gemm_grouped_kernel('loop')
    local tl = timed(function() F.gemm_grouped_(outs, as, bs, cs[3], cs[4], 0) end)
    F.gemm_grouped_kernel(was)
    local d = cs[5]
    local td = timed(function() F.gemm_(d[1], d[2], d[3], d[4], d[5], 1, 0) end)
    local flops = 2 * R * E * H * I
    print(('| %d | %d | %s | %.3f | %.0f | %.3f | %.3f | %.3f |'):format(E, R, cs[1], tg, flops / (tg * 1e-3) / 1e12,
      tm, tl, td))
  end
  collectgarbage(); collectgarbage()
end

-- a layer's routing read (moe.routing_read) with the slots sorted on the
-- device (the default) and on the host (moe.host_sort, MS_MOE_HOST_SORT=1):
-- median wall ms of the read with its wait (synced before each, nothing
-- queued behind it), the device sort's GPU ms alone (CUDA events), and a
-- check that both give the host sort's layout
print()
print('| slots (tokens x top-k) | experts | device sort: read ms | its kernels ms | host sort: read ms |')
print('|---|---|---|---|---|')
local moe = nn.moe
for _, c in ipairs({ { N, 8, 256 }, { 4 * N, 8, 256 }, { 16 * N, 8, 256 }, { N, 2, 8 } }) do
  local n, k, E = c[1], c[2], c[3]
  local ids = (ms.rand({ n, k }, { seed = 9 }) * E):to('i64'):cuda()
  local want = moe.sort_slots(ids, E, moe.align)
  local function read_ms(host)
    local was, layer, ts = moe.host_sort, {}, {}
    moe.host_sort = host
    for i = 1, opts.warmup + opts.iters do
      ms.cuda.synchronize()
      local t0 = B.now()
      local st = moe.routing_read(layer, ids, E, moe.align)
      if i > opts.warmup then ts[#ts + 1] = (B.now() - t0) * 1e3 end
      if i == 1 then
        assert(st.M == want.M and B.relerr(st.back, want.back) == 0 and B.relerr(st.inv, want.inv) == 0,
          'bench/moe.lua: the routing read\'s layout is not the host sort\'s')
      end
    end
    moe.host_sort = was
    return B.median(ts)
  end
  local td, th = read_ms(false), read_ms(true)
  local tk = timed(function() moe.sort_queue(ids, E, moe.align) end)
  print(('| %d x %d | %d | %.3f | %.3f | %.3f |'):format(n, k, E, td, tk, th))
  collectgarbage(); collectgarbage()
end
