-- bench/attention.lua — the fused attention kernels (kernels/attention.cu) on
-- one GPU, each implementation (mma: attention_mma.cuh, wmma:
-- attention_tc.cuh, simt) forced in turn through ms_cuda_attention_set_impl,
-- at GPT-2 124M's attention (B=8, H=12, T=1024, D=64) and a longer one
-- (B=4, H=32, T=2048, D=64), causal, or the shapes --shapes names (BxHxT
-- at D = 64, or BxHxTxD: D 128, or 192 for DeepSeek-V3's q/k heads, which
-- only mma and mma1 take; or BxHxTxDxDv with v's head width Dv its own:
-- 192x128 is DeepSeek-V3's MLA, mma and mma1 only; 32x12x1024 is the GPT-2
-- bench's B = 32). wgmma_base, wgmma_ovl, wgmma_ovlq: wgmma with
-- MS_ATTENTION_WG_FWD=base (no overlap), ovl, ovlq (the overlapped forward,
-- Q in registers: plain wgmma's default; q/k 128 or 192 with v 128, else
-- the same as wgmma); wgmma_ws: MS_ATTENTION_WG_FWD=ws (two consumer
-- warpgroups a block sharing each K/V tile, a producer warpgroup copying
-- them), e.g. --shapes 2x16x4096x128,2x16x4096x192x128
-- --impls wgmma_base,wgmma_ovl,wgmma_ovlq,wgmma_ws.
--
--   luajit bench/attention.lua [--iters 20] [--warmup 3] [--dtype bf16] [--impls wgmma,mma,wmma,simt]
--                              [--shapes 8x12x1024,4x32x2048,2x16x4096x192,2x16x4096x192x128]
--
-- Before timing, each implementation's out, lse and dq/dk/dv on the first
-- (b, two heads) are checked against the CPU reference (f64, bound 1e-2).
-- Time: CUDA events, median of the runs, L2 flushed (a 256 MiB fill) before
-- each; the backward includes its delta pre-pass. Flops (causal, FA2's
-- count): forward 2·B·H·T²·(D + Dv) / 2 (S over D, P·V over Dv), backward
-- 2·B·H·T²·(3D + 2Dv) / 2 (S, dQ, dK over D; dP, dV over Dv: 2.5x the
-- forward at Dv = D); TFLOP/s against the bf16 matmul rate measured here
-- (8192³ through ms.matmul, cuBLASLt).
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local C = T.C
local F = ms.raw

local opts = { iters = 20, warmup = 3, dtype = 'bf16', impls = 'wgmma,wgmma0,mma,mma1,wmma,simt',
  shapes = '8x12x1024,4x32x2048' }
local i = 1
while i <= #arg do
  local k = arg[i]:match('^%-%-(.+)$')
  if not k or opts[k] == nil then
    error('usage: luajit bench/attention.lua [--iters N] [--warmup N] [--dtype bf16|f16] [--impls wgmma,mma,wmma,simt]'
      .. ' [--shapes BxHxT[xD[xDv]],...]')
  end
  opts[k] = tonumber(arg[i + 1]) or arg[i + 1]
  i = i + 2
end
assert(ms.cuda.is_available(), 'bench/attention.lua needs a CUDA device')

local flush_buf = ms.empty({ 64 * 2 ^ 20 }, { device = 'cuda' })
local function flush_l2() F.fill_(flush_buf, 0) end
local function median(t)
  table.sort(t)
  return t[math.floor((#t + 1) / 2)]
end
-- median ms of fn() (its results freed after each run)
local function timed(fn)
  for _ = 1, opts.warmup do fn() end
  ms.cuda.synchronize()
  local e0, e1 = ms.cuda.event({ timing = true }), ms.cuda.event({ timing = true })
  local ts = {}
  for k = 1, opts.iters do
    flush_l2()
    e0:record()
    fn()
    e1:record()
    e1:synchronize()
    ts[k] = e0:elapsed_ms(e1)
    collectgarbage('step')
  end
  return median(ts)
end
local function relerr(got, want)
  local g, w = got:to('cpu'):to('f64'), want:to('cpu'):to('f64')
  local d = F.sub(g, w)
  return math.sqrt(F.sum(F.mul(d, d)):item() / F.sum(F.mul(w, w)):item())
end

local box = ffi.typeof('ms_tensor*[1]')
local function attention(q, k, v, scale)
  local o, l = box(), box()
  T.check(C.ms_attention(o, l, q, k, v, scale, 1))
  return T.wrap(o[0]), T.wrap(l[0])
end
local function attention_backward(q, k, v, o, l, g, scale)
  local a, b, c = box(), box(), box()
  T.check(C.ms_attention_backward(a, b, c, q, k, v, o, l, g, scale, 1))
  return T.wrap(a[0]), T.wrap(b[0]), T.wrap(c[0])
end
pcall(ffi.cdef, 'int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);')
-- MS_ATTENTION_WG_FWD (read by attention.cu at every call) set to value, nil: unset
local function set_wg_fwd(value)
  if value then ffi.C.setenv('MS_ATTENTION_WG_FWD', value, 1) else ffi.C.unsetenv('MS_ATTENTION_WG_FWD') end
end
local wg_fwd_env = { wgmma_ovl = 'ovl', wgmma_ovlq = 'ovlq', wgmma_base = 'base', wgmma_ws = 'ws' }
local impl_ids = { mma = C.MS_ATTENTION_MMA, wmma = C.MS_ATTENTION_WMMA, simt = C.MS_ATTENTION_SIMT,
  wgmma = C.MS_ATTENTION_WGMMA }
local impl_names = { [C.MS_ATTENTION_MMA] = 'mma', [C.MS_ATTENTION_WMMA] = 'wmma', [C.MS_ATTENTION_SIMT] = 'simt',
  [C.MS_ATTENTION_WGMMA] = 'wgmma' }

-- the bf16 matmul ceiling through the production GEMM
local function matmul_rate()
  local n = 8192
  local a = ms.randn({ n, n }, { seed = 1, device = 'cuda' }):bf16()
  local b = ms.randn({ n, n }, { seed = 2, device = 'cuda' }):bf16()
  local t = timed(function() ms.matmul(a, b) end)
  return 2 * n ^ 3 / (t * 1e-3) / 1e12
end
local peak = matmul_rate()

print(('device: %s; bf16 matmul %.0f TFLOP/s; %s, causal'):format(ms.cuda.get_device_name(0), peak, opts.dtype))
print('| impl | B x H x T x D (x Dv) | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd % of matmul | rel. err (out, dq, dk, dv) |')
print('|---|---|---|---|---|---|---|---|')
local seed = 10
local shapes = {}
for spec in tostring(opts.shapes):gmatch('[^,]+') do
  local b, h, t, d, dv = spec:match('^(%d+)x(%d+)x(%d+)x?(%d*)x?(%d*)$')
  assert(b, '--shapes: ' .. spec .. ' is not BxHxT, BxHxTxD or BxHxTxDxDv')
  local D = tonumber(d) or 64
  shapes[#shapes + 1] = { B = tonumber(b), H = tonumber(h), T = tonumber(t), D = D, Dv = tonumber(dv) or D }
end
assert(#shapes > 0, '--shapes: a list of BxHxT, e.g. 8x12x1024,4x32x2048 (got ' .. tostring(opts.shapes) .. ')')
for _, s in ipairs(shapes) do
  local shape, vshape = { s.B, s.H, s.T, s.D }, { s.B, s.H, s.T, s.Dv }
  local function randn(sh)
    seed = seed + 1
    return ms.randn(sh, { seed = seed, device = 'cuda' }):to(opts.dtype)
  end
  local q, k, v, g = randn(shape), randn(shape), randn(vshape), randn(vshape)
  local scale = 1 / math.sqrt(s.D)
  -- the reference on (b = 1, heads 1-2): those rows' gradients depend on them alone
  local function part(x) return x:narrow(1, 1, 1):narrow(2, 1, 2) end
  local qs, ks, vs, gs = part(q):to('cpu'):to('f64'), part(k):to('cpu'):to('f64'), part(v):to('cpu'):to('f64'),
    part(g):to('cpu'):to('f64')
  local o_ref, l_ref = attention(qs, ks, vs, scale)
  local dq_ref, dk_ref, dv_ref = attention_backward(qs, ks, vs, o_ref:to(opts.dtype):to('f64'), l_ref, gs, scale)
  local fwd_flops = 2 * s.B * s.H * s.T * s.T * (s.D + s.Dv) / 2
  local bwd_flops = 2 * s.B * s.H * s.T * s.T * (3 * s.D + 2 * s.Dv) / 2
  for impl in opts.impls:gmatch('[^,]+') do
    -- mma1: mma with the one-pass backward (dq through f32 atomics); wgmma1:
    -- wgmma with its one-pass backward (dq added in a fixed order); wgmma0:
    -- wgmma with Delta by its own kernel (plain wgmma: in the dq kernel)
    -- wgmma_base, wgmma_ovl, wgmma_ovlq, wgmma_ws: wgmma with MS_ATTENTION_WG_FWD=base, ovl, ovlq, ws
    local base = (impl == 'mma1' and 'mma') or (impl:match('^wgmma.') and 'wgmma') or impl
    local prev_fwd = os.getenv('MS_ATTENTION_WG_FWD')
    if wg_fwd_env[impl] then set_wg_fwd(wg_fwd_env[impl]) end
    T.check(C.ms_cuda_attention_set_impl((assert(impl_ids[base], 'unknown implementation ' .. impl))))
    local prev_onepass = C.ms_cuda_attention_set_onepass(impl == 'mma1' and 1 or 0)
    local prev_wg1 = C.ms_cuda_attention_set_wg_onepass(impl == 'wgmma1' and 1 or 0)
    local prev_fd = C.ms_cuda_attention_set_fused_delta(impl == 'wgmma0' and 0 or 1)
    local o, l = attention(q, k, v, scale)
    local ran = impl_names[tonumber(C.ms_cuda_attention_last_impl())]
    local dq, dk, dv = attention_backward(q, k, v, o, l, g, scale)
    local errs = { relerr(part(o), o_ref), relerr(part(dq), dq_ref), relerr(part(dk), dk_ref),
      relerr(part(dv), dv_ref) }
    for n, e in ipairs(errs) do
      if not (e <= 1e-2) then
        error(('%s: %s is %.3e from the CPU reference'):format(impl, ({ 'out', 'dq', 'dk', 'dv' })[n], e))
      end
    end
    dq:free(); dk:free(); dv:free()
    local tf = timed(function() attention(q, k, v, scale) end)
    local tb = timed(function() attention_backward(q, k, v, o, l, g, scale) end)
    local ff, fb = fwd_flops / (tf * 1e-3) / 1e12, bwd_flops / (tb * 1e-3) / 1e12
    C.ms_cuda_attention_set_onepass(prev_onepass)
    C.ms_cuda_attention_set_wg_onepass(prev_wg1)
    C.ms_cuda_attention_set_fused_delta(prev_fd)
    set_wg_fwd(prev_fwd)
    print(('| %s%s | %dx%dx%dx%d%s | %.3f | %.1f | %.3f | %.1f | %.1f%% | %.1e, %.1e, %.1e, %.1e |'):format(
      ({ mma1 = 'mma, one-pass backward', wgmma1 = 'wgmma, one-pass backward', wgmma0 = 'wgmma, delta kernel',
        wgmma_ovl = 'wgmma, overlapped forward', wgmma_ovlq = 'wgmma, overlapped forward, Q in registers',
        wgmma_base = 'wgmma, forward without overlap', wgmma_ws = 'wgmma, two consumer warpgroups' })[impl] or impl, ran ~= base and (' (ran ' .. tostring(ran) .. ')') or '', s.B, s.H, s.T, s.D,
      s.Dv ~= s.D and ('x' .. s.Dv) or '', tf, ff, tb, fb,
      100 * (fwd_flops + bwd_flops) / ((tf + tb) * 1e-3) / 1e12 / peak, errs[1], errs[2], errs[3], errs[4]))
    o:free(); l:free()
  end
  T.check(C.ms_cuda_attention_set_impl(C.MS_ATTENTION_AUTO))
end
