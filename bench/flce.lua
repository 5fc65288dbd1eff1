-- bench/flce.lua — fused linear cross-entropy vs our unfused path (GEMM +
-- cross_entropy), forward + backward, on one GPU.
--
--   luajit bench/flce.lua [--iters 20] [--warmup 3] [--chunk 0]
--                         [--shapes 8192x4096x128256,8192x2560x151936]
--                         [--methods fused,fused_master,fused_bf16acc,unfused,gemms] [--json out.json]
--                         [--sustained 700]
--
-- The methodology of ../shared/bench/torch_flce.py, so the rows sit beside
-- its output: x (BT, H) ~ N(0, 1) bf16 and W (V, H) ~ N(0, 0.02) bf16, both
-- requiring grad, targets uniform in [0, V), reduction mean. Time: x.grad and
-- W.grad cleared, then loss = f(x, W, y); loss:backward(); CUDA events around
-- it, 3 warm-up runs, the median of 20, L2 flushed (a 256 MiB fill) before
-- each. Memory: allocated after the inputs exist (no grads) is the base; the
-- peak of one step minus the base is "peak above inputs" (it includes the
-- bf16 grads of x and W that every method must produce); "peak − grads" is
-- that peak less what the step leaves allocated (the gradients as the
-- caching allocator holds them, size-class rounding included: the peak is
-- read in the same allocated bytes), the step's transient memory.
-- Floor: 6·BT·H·V flops (logits, grad_x, grad_W) at the bf16 matmul rate
-- measured here with the production GEMM (8192³, as ../shared/bench/ceilings.py:
-- the median of 20 runs after 5, ~35 ms of work). "× sustained floor" puts
-- the same flops at the rate that product keeps up for ~1 s back to back
-- (--sustained N runs, the last quarter timed; 0 leaves it out): a GPU at
-- its power limit runs long GEMM work slower than a 35 ms burst.
-- Accuracy: loss and gradients against an f32 reference (f32 GEMMs, TF32
-- off: the unfused path in f32) as relative errors ‖a − ref‖ / ‖ref‖.
--
-- Methods: fused = nn.functional.fused_linear_cross_entropy (grad_W
-- accumulated in f32 across chunks, the default); fused_master = the same
-- with W the bf16 copy of an f32 master weight whose f32 gradient the loss
-- writes directly (autocast's lm_loss; "grads" are then bf16 grad_x and the
-- f32 grad_W, the master an input); fused_bf16acc = the same
-- with accum_dtype = 'bf16' (accumulated in the bf16 output: no f32 copy of
-- grad_W); unfused = ms.matmul(x, W, false, true) then
-- nn.functional.cross_entropy (f32 softmax of the bf16 logits), the path
-- lm_loss takes with use_fused_lm_loss(false); gemms = fused_bf16acc's
-- three GEMMs alone, chunk by chunk, with no row pass and no loss: what
-- the fused path would take if everything between its GEMMs were free.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ffi = require 'ffi'
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local flce = require 'moonshard.flce'

local nnf = ms.nn.functional
local F = ms.raw

local opts = { iters = 20, warmup = 3, chunk = 0, shapes = '8192x4096x128256,8192x2560x151936',
  methods = 'fused,fused_master,fused_bf16acc,unfused,gemms', json = '', ['tune-ab'] = 0, sustained = 700 }
local i = 1
while i <= #arg do
  local k = arg[i]:match('^%-%-(.+)$')
  if not k or opts[k] == nil then
    error('usage: luajit bench/flce.lua [--iters N] [--warmup N] [--chunk ROWS] [--shapes BTxHxV,...] '
      .. '[--methods fused,fused_master,fused_bf16acc,unfused,gemms] [--json FILE] [--tune-ab R] [--sustained N]')
  end
  opts[k] = tonumber(arg[i + 1]) or arg[i + 1]
  i = i + 2
end

assert(ms.cuda.is_available(), 'bench/flce.lua needs a CUDA device')
local dev = ms.cuda.get_device_name(0)
pcall(ffi.cdef, 'int ms_cuda_gemm_mixed_ok(void);')
local mixed_gemm = pcall(function() return T.C.ms_cuda_gemm_mixed_ok end)

local flush_buf = ms.empty({ 64 * 2 ^ 20 }, { device = 'cuda' })   -- 256 MiB of f32
local function flush_l2() F.fill_(flush_buf, 0) end

local function median(t)
  local s = {}
  for k, v in ipairs(t) do s[k] = v end
  table.sort(s)
  return s[math.floor((#s + 1) / 2)]
end

-- median ms of fn() over iters runs after warmup, CUDA events, L2 flushed
local function timed(fn, warmup, iters)
  for _ = 1, warmup do fn() end
  ms.cuda.synchronize()
  local ts = {}
  local e0, e1 = ms.cuda.event({ timing = true }), ms.cuda.event({ timing = true })
  for k = 1, iters do
    flush_l2()
    e0:record()
    fn()
    e1:record()
    e1:synchronize()
    ts[k] = e0:elapsed_ms(e1)
  end
  return median(ts), ts
end

-- the bf16 matmul rate through the production GEMM (8192³, 3 operand pairs)
-- and sustained: the same product back to back for ~1 s (sust runs), timed
-- over the last quarter, when the GPU has settled at its power limit
local function matmul_rate(sust)
  local n = 8192
  local pairs_ = {}
  for k = 1, 3 do
    pairs_[k] = { ms.randn({ n, n }, { seed = 10 + k, device = 'cuda' }):bf16(),
      ms.randn({ n, n }, { seed = 20 + k, device = 'cuda' }):bf16() }
  end
  local out = ms.empty({ n, n }, { dtype = 'bf16', device = 'cuda' })
  local k = 0
  local function one()
    k = k + 1
    local p = pairs_[k % 3 + 1]
    F.gemm_(out, p[1], p[2], false, false, 1, 0)
  end
  local med = timed(one, 5, 20)
  local sustained
  if sust > 0 then
    local e0, e1 = ms.cuda.event({ timing = true }), ms.cuda.event({ timing = true })
    local last = math.max(1, math.floor(sust / 4))
    for _ = 1, sust - last do one() end
    e0:record()
    for _ = 1, last do one() end
    e1:record()
    e1:synchronize()
    sustained = 2 * n ^ 3 * last / (e0:elapsed_ms(e1) * 1e-3) / 1e12
  end
  for _, p in ipairs(pairs_) do p[1]:free(); p[2]:free() end
  out:free()
  return 2 * n ^ 3 / (med * 1e-3) / 1e12, sustained
end

local function relerr(a, b)
  local d = F.sub(a:float(), b:float())
  local num = F.sum(F.mul(d, d)):item()
  local bf = b:float()
  local den = F.sum(F.mul(bf, bf)):item()
  return math.sqrt(num / den)
end

-- with the cuBLASLt heuristic's first algorithm (not tuned): at 8192³ the
-- candidates are within ~3% of each other, below what short timings on a
-- GPU that heats up can rank, and a rate that moves with the choice would
-- move the floor
local rate, rate_sust
do
  local prev = ms.cuda.gemm_tune(false)
  rate, rate_sust = matmul_rate(opts.sustained)
  ms.cuda.gemm_tune(prev)
end
print(('device: %s; bf16 matmul rate %.0f TFLOP/s (8192^3, production GEMM; median of 20, as ceilings.py)')
  :format(dev, rate))
if rate_sust then
  print(('sustained: %.0f TFLOP/s (the last %d of %d back-to-back products, ~%.1f s at the burst rate)')
    :format(rate_sust, math.max(1, math.floor(opts.sustained / 4)), opts.sustained,
      opts.sustained * 2 * 8192 ^ 3 / (rate * 1e12)))
end
print(('grad_W f32 accumulation: %s'):format(mixed_gemm and 'mixed-dtype cuBLASLt GEMM (bf16 in, f32 out)'
  or 'f32 operand copies: kernels/gemm.cu lacks ms_cuda_gemm_mixed_ok (fused rows are not representative)'))
print(('GEMM tuning: %s (MS_GEMM_TUNE=0 turns it off)'):format(ms.cuda.gemm_tune() and 'on' or 'off'))

local methods = {}
for m in opts.methods:gmatch('[^,]+') do methods[#methods + 1] = m end
local rows = {}
for spec in opts.shapes:gmatch('[^,]+') do
  local BT, H, V = spec:match('^(%d+)x(%d+)x(%d+)$')
  BT, H, V = tonumber(BT), tonumber(H), tonumber(V)
  assert(BT and H and V, 'bad shape ' .. spec .. ' (use BTxHxV)')
  local x = ms.randn({ BT, H }, { seed = 1, device = 'cuda' }):bf16():requires_grad_()
  local W = F.mul(ms.randn({ V, H }, { seed = 2, device = 'cuda' }), 0.02):bf16():requires_grad_()
  local y = F.mul(ms.rand({ BT }, { seed = 3, device = 'cuda' }), V):long()
  local floor_ms = 6 * BT * H * V / (rate * 1e12) * 1e3
  local grads_bytes = (BT * H + V * H) * 2

  -- the f32 reference (unfused, f32 GEMMs)
  local ref
  do
    local xr, Wr = x:detach():float():requires_grad_(), W:detach():float():requires_grad_()
    local lr = nnf.cross_entropy(ms.matmul(xr, Wr, false, true), y)
    lr:backward()
    ref = { loss = lr:detach(), gx = xr.grad, gW = Wr.grad }
    xr:free(); Wr:free()
    collectgarbage(); collectgarbage()
    ms.cuda.empty_cache()
  end

  for _, name in ipairs(methods) do
    local fo = { chunk_size = opts.chunk > 0 and opts.chunk or nil }
    if name == 'fused_bf16acc' then fo.accum_dtype = 'bf16' end
    local fn
    -- fused_master: W (bf16) is the copy of an f32 master weight (autocast's
    -- case) whose f32 gradient the loss writes directly; the master is an
    -- input (allocated before the peak is read) and grad_W is f32
    local Wm, gbytes, row_chunk = nil, grads_bytes, nil
    if name == 'fused_master' then
      Wm = W:detach():float():requires_grad_()
      fo.master_weight = Wm
      gbytes = BT * H * 2 + V * H * 4
    end
    if name == 'fused' or name == 'fused_bf16acc' or name == 'fused_master' then
      fn = function(a, b, t) return nnf.fused_linear_cross_entropy(a, b, t, fo) end
    elseif name == 'unfused' then
      fn = function(a, b, t) return nnf.cross_entropy(ms.matmul(a, b, false, true), t) end
    elseif name == 'gemms' then
      -- the fused path's three GEMMs alone, chunk by chunk as fused_bf16acc
      -- runs them (grad_W accumulated in bf16), no row pass: the floor that
      -- cuBLASLt sustains for these shapes (the loss is not computed)
      local crow = flce.chunk_rows(x, W, { accum_dtype = 'bf16', chunk_size = fo.chunk_size })
      local lbuf
      fn = function(a, b)
        local xa, Wa = a:detach(), b:detach()
        local gx = ms.empty(xa.shape, { dtype = 'bf16', device = 'cuda' })
        local gW = ms.empty(Wa.shape, { dtype = 'bf16', device = 'cuda' })
        lbuf = lbuf or ms.empty({ crow, V }, { dtype = 'bf16', device = 'cuda' })
        for r0 = 0, BT - 1, crow do
          local n = math.min(crow, BT - r0)
          local xc, lg = xa:narrow(1, r0 + 1, n), lbuf:narrow(1, 1, n)
          F.gemm_(lg, xc, Wa, false, true, 1, 0)                       -- logits
          F.gemm_(gx:narrow(1, r0 + 1, n), lg, Wa, false, false, 1, 0)  -- grad_x
          F.gemm_(gW, lg, xc, true, false, 1, r0 == 0 and 0 or 1)        -- grad_W +=
        end
        a.grad, b.grad = gx, gW
        return nil
      end
      row_chunk = crow
    else
      error('unknown method ' .. name)
    end
    local loss
    local function step()
      x.grad, W.grad = nil, nil
      if Wm then Wm.grad = nil end
      loss = fn(x, W, y)
      if loss then loss:backward() end
    end
    local row = { BT = BT, H = H, V = V, method = name }
    local ok, err = pcall(function()
      local med, ts = timed(step, opts.warmup, opts.iters)
      -- --tune-ab R: the step again with GEMM tuning off and on, in R
      -- interleaved rounds of 10 runs each (one process, one GPU: the plans
      -- of both settings are kept side by side)
      if opts['tune-ab'] > 0 then
        local prev = ms.cuda.gemm_tune()
        local off, on = {}, {}
        for _ = 1, opts['tune-ab'] do
          ms.cuda.gemm_tune(false)
          off[#off + 1] = timed(step, 2, 10)
          ms.cuda.gemm_tune(true)
          on[#on + 1] = timed(step, 2, 10)
        end
        ms.cuda.gemm_tune(prev)
        print(('tune A/B %dx%dx%d %s: off %.2f ms, on %.2f (medians of %d rounds)')
          :format(BT, H, V, name, median(off), median(on), opts['tune-ab']))
      end
      x.grad, W.grad = nil, nil
      if Wm then Wm.grad = nil end
      loss = nil
      collectgarbage(); collectgarbage()
      ms.cuda.synchronize()
      ms.cuda.empty_cache()
      local base = ms.cuda.memory_allocated()
      ms.cuda.reset_peak_memory_stats()
      step()
      ms.cuda.synchronize()
      local peak = ms.cuda.memory_stats().peak_allocated - base
      local held = ms.cuda.memory_allocated() - base   -- the gradients (and the loss)
      row.ms_median, row.ms_min = med, math.min(unpack(ts))
      row.x_floor = med / floor_ms
      row.tflops_3gemm = 6 * BT * H * V / (med * 1e-3) / 1e12
      row.peak_above_inputs_GiB = peak / 2 ^ 30
      row.peak_minus_grads_GiB = (peak - held) / 2 ^ 30
      row.grads_held_GiB, row.grads_exact_GiB = held / 2 ^ 30, gbytes / 2 ^ 30
      row.x_floor_sustained = rate_sust and med / (6 * BT * H * V / (rate_sust * 1e12) * 1e3) or nil
      if loss then
        row.loss = loss:item()
        row.loss_rel_vs_fp32 = math.abs(row.loss - ref.loss:item()) / math.abs(ref.loss:item())
        row.dx_rel_vs_fp32 = relerr(x.grad, ref.gx)
        row.dW_rel_vs_fp32 = relerr(Wm and Wm.grad or W.grad, ref.gW)
      end
      if name ~= 'unfused' then row.chunk_rows = row_chunk or flce.chunk_rows(x, W, fo) end
    end)
    if not ok then row.error = tostring(err):sub(1, 300) end
    x.grad, W.grad, loss = nil, nil, nil
    if Wm then Wm:free(); fo.master_weight = nil end
    collectgarbage(); collectgarbage()
    ms.cuda.empty_cache()
    rows[#rows + 1] = row
    row.floor_ms = floor_ms
    io.write('.'); io.flush()
  end
  x:free(); W:free(); y:free()
  ref.gx:free(); ref.gW:free()
  collectgarbage(); collectgarbage()
  ms.cuda.empty_cache()
end
print()

print(('| BT | H | V | method | chunk | ms (median) | floor ms | × floor | × sustained floor | TFLOP/s | '
  .. 'peak above inputs GiB | grads held (exact) GiB | peak − grads GiB | loss | loss rel f32 | dx rel f32 | dW rel f32 |'))
print('|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|')
local function fmt(f, v) return v and f:format(v) or '-' end
for _, r in ipairs(rows) do
  if r.error then
    print(('| %d | %d | %d | %s | | ERROR: %s |'):format(r.BT, r.H, r.V, r.method, r.error))
  else
    print(('| %d | %d | %d | %s | %s | %.2f | %.2f | %.3f | %s | %.0f | %.2f | %.3f (%.3f) | %.3f | %s | %s | %s | %s |'):format(
      r.BT, r.H, r.V, r.method, r.chunk_rows and tostring(r.chunk_rows) or '-', r.ms_median, r.floor_ms, r.x_floor,
      fmt('%.3f', r.x_floor_sustained), r.tflops_3gemm, r.peak_above_inputs_GiB, r.grads_held_GiB, r.grads_exact_GiB,
      r.peak_minus_grads_GiB, fmt('%.4f', r.loss), fmt('%.1e', r.loss_rel_vs_fp32), fmt('%.1e', r.dx_rel_vs_fp32),
      fmt('%.1e', r.dW_rel_vs_fp32)))
  end
end
if opts.json ~= '' then
  local json = require 'dkjson'
  local f = assert(io.open(opts.json, 'w'))
  f:write(json.encode({ device = dev, matmul_tflops = rate, matmul_tflops_sustained = rate_sust, mixed_gemm = mixed_gemm, rows = rows }, { indent = true }))
  f:close()
end
do
  local ts = ms.cuda.gemm_tune_stats()
  print(('GEMM tuning: %d plans timed, %d not on the heuristic\'s first, %.0f ms of host time, %d from the tuning file')
    :format(ts.tuned, ts.moved, ts.host_ms, ts.from_file))
end
