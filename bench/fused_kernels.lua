-- bench/fused_kernels.lua — the fused norm, RoPE, AdamW and grad-norm
-- kernels (kernels/norm.cu, rope.cu, adamw.cu) on one GPU: time, GB/s
-- against the measured copy bandwidth, and the composed raw-op path they
-- replace where there is one.
--
--   luajit bench/fused_kernels.lua [--iters 20] [--warmup 3]
--   luajit bench/fused_kernels.lua --only masters --adam-m 1200 --adam-n 17
--
-- The last rows: AdamW over --adam-m million elements in --adam-n tensors
-- (200 in 8) with f32 masters and bf16 parameters (fsdp.AdamW writing the
-- low-precision shard copies in its step) against the f32 step followed by
-- a cast (the refresh pass it replaced), with a clip coefficient; --only
-- masters runs only those.
-- Shapes: GPT-2 124M at B=32, T=1024 (norms over (32768, 768), AdamW and
-- the grad norm over its 148 parameter tensors) and a Llama-8B-like layer
-- (RMSNorm over (8192, 4096), RoPE on q (8, 32, 1024, 128) read through the
-- (B, H, T, D) view of a (B, T, H, D) projection). Each kernel is checked
-- against its CPU reference on the first rows before it is timed. Time: CUDA
-- events, median of the runs, L2 flushed (a 256 MiB fill) before each.
-- Bytes: what the kernel must move (each input read once, each output
-- written once); the ceiling is a device-to-device copy of 1 GiB (read +
-- write) measured here.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local F = ms.raw
local nnf = ms.nn.functional

local B = require 'bench.common'

local opts = B.parse_args({ iters = 20, warmup = 3, ['adam-m'] = 200, ['adam-n'] = 8, only = '' },
  'usage: luajit bench/fused_kernels.lua [--iters N] [--warmup N] [--adam-m M] [--adam-n N] [--only masters]')
assert(ms.cuda.is_available(), 'bench/fused_kernels.lua needs a CUDA device')

local timed = B.timer(opts)   -- median ms of fn() (its results freed after each run)
local relerr = B.relerr
local function check(name, got, want, bound)
  local e = relerr(got, want)
  if e > bound then error(('%s: %.3e from the CPU reference (bound %.0e)'):format(name, e, bound)) end
  return e
end
local function bytes(t) return t:numel() * ({ f64 = 8, f32 = 4, bf16 = 2, f16 = 2 })[t.dtype] end

-- the ceiling: a 1 GiB device copy moves 2 GiB
local big = ms.empty({ 2 ^ 28 }, { device = 'cuda' })
local big2 = ms.empty({ 2 ^ 28 }, { device = 'cuda' })
local copy_ms = timed(function() big2:copy_(big) end)
local ceiling = 2 * 2 ^ 30 / (copy_ms * 1e-3) / 1e9
big:free(); big2:free()

print(('device: %s; copy bandwidth %.0f GB/s'):format(ms.cuda.get_device_name(0), ceiling))
print('| kernel | shape | dtypes | ms | GB/s | % of copy | composed ms | rel. err vs CPU |')
print('|---|---|---|---|---|---|---|---|')
local function row(name, shape, dts, ms_, nbytes, composed_ms, err)
  local gbs = nbytes / (ms_ * 1e-3) / 1e9
  print(('| %s | %s | %s | %.3f | %.0f | %.0f%% | %s | %s |'):format(name, shape, dts, ms_, gbs,
    100 * gbs / ceiling, composed_ms and ('%.3f'):format(composed_ms) or '-', err and ('%.1e'):format(err) or '-'))
end

local seed = 1
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed, device = 'cuda' }):to(dtype or 'f32')
end

-- the composed LayerNorm forward the fused op replaced (raw ops, f32 math)
local function composed_layer_norm(x, w, b)
  local xf = x.dtype == 'f32' and x or x:to('f32')
  local mu = F.mean(xf, -1, true)
  local xc = F.sub(xf, mu)
  local var = F.mean(F.square(xc), -1, true)
  F.add_(var, 1e-5)
  local rstd = F.rsqrt(var)
  local y = F.add(F.mul(F.mul(xc, rstd), w), b)
  return y:to(x.dtype)
end

-- ------------------------------------------------------------ norms
for _, c in ipairs({ { 'bf16', 'bf16' }, { 'f32', 'bf16' }, { 'f32', 'f32' } }) do
  local xdt, ydt = c[1], c[2]
  local N, Cn = 32768, 768
  local x, g = randn({ N, Cn }, xdt), randn({ N, Cn }, ydt)
  local w, b = randn({ Cn }), randn({ Cn })
  local y, mean, rstd = F.native_layer_norm(x, w, b, 1e-5, ydt)
  local xs, gs = x:narrow(1, 1, 64):to('cpu'), g:narrow(1, 1, 64):to('cpu')
  local ref, rmean, rrstd = F.native_layer_norm(xs, w:to('cpu'), b:to('cpu'), 1e-5, ydt)
  local bound = ydt == 'bf16' and 1e-2 or 1e-5
  local e = check('layer_norm', y:narrow(1, 1, 64), ref, bound)
  local t = timed(function() F.native_layer_norm(x, w, b, 1e-5, ydt) end)
  local tc = ydt == xdt and timed(function() composed_layer_norm(x, w, b) end) or nil
  row('layer_norm fwd', '32768x768', xdt .. '->' .. ydt, t, bytes(x) + bytes(y), tc, e)
  local dx, dw = F.native_layer_norm_backward(g, x, mean, rstd, w)
  local rdx = F.native_layer_norm_backward(gs, xs, rmean, rrstd, w:to('cpu'))
  e = check('layer_norm_backward', dx:narrow(1, 1, 64), rdx, xdt == 'bf16' and 1e-2 or 1e-5)
  t = timed(function() F.native_layer_norm_backward(g, x, mean, rstd, w) end)
  row('layer_norm bwd', '32768x768', 'g ' .. ydt .. ', x ' .. xdt, t, bytes(g) + bytes(x) + bytes(dx), nil, e)
  dw:free()
end
-- GPT-2's residual add + LayerNorm forward: res = x (f32) + h (bf16), y =
-- LayerNorm(res) in bf16
if opts.only == '' then
  local N, Cn = 32768, 768
  local x, h = randn({ N, Cn }, 'f32'), randn({ N, Cn }, 'bf16')
  local w, b = randn({ Cn }), randn({ Cn })
  local res, y = F.native_add_layer_norm(x, h, w, b, 1e-5, 'bf16')
  local _, ry = F.native_add_layer_norm(x:narrow(1, 1, 64):to('cpu'), h:narrow(1, 1, 64):to('cpu'), w:to('cpu'),
    b:to('cpu'), 1e-5, 'bf16')
  local e = check('add_layer_norm', y:narrow(1, 1, 64), ry, 1e-2)
  local t = timed(function() return F.native_add_layer_norm(x, h, w, b, 1e-5, 'bf16') end)
  row('add+layer_norm fwd (GPT-2)', '32768x768', 'x f32 + h bf16 -> res f32, y bf16', t,
    bytes(x) + bytes(h) + bytes(res) + bytes(y), nil, e)
end
-- GPT-2's backward of the residual add + LayerNorm (f32 residual stream, bf16
-- branch): dx (+ the stream's gradient gres, f32), dw, db, dxl (dx in bf16,
-- the branch's gradient) and its column sums (the branch's bias gradient)
if opts.only == '' then
  local N, Cn = 32768, 768
  local x, g, gres = randn({ N, Cn }, 'f32'), randn({ N, Cn }, 'bf16'), randn({ N, Cn }, 'f32')
  local w, b = randn({ Cn }), randn({ Cn })
  local _, mean, rstd = F.native_layer_norm(x, w, b, 1e-5, 'bf16')
  local want = { dxl = true, dxl_sum = true }
  local dx, dw, db, dxl, dls = F.native_layer_norm_backward_add(g, x, mean, rstd, w, gres, want)
  local rdx = F.native_layer_norm_backward_add(g:narrow(1, 1, 64):to('cpu'), x:narrow(1, 1, 64):to('cpu'),
    mean:narrow(1, 1, 64):to('cpu'), rstd:narrow(1, 1, 64):to('cpu'), w:to('cpu'), gres:narrow(1, 1, 64):to('cpu'))
  local e = check('layer_norm_backward_add', dx:narrow(1, 1, 64), rdx, 1e-5)
  local t = timed(function() return F.native_layer_norm_backward_add(g, x, mean, rstd, w, gres, want) end)
  row('add+layer_norm bwd (GPT-2)', '32768x768', 'g bf16, x/gres/dx f32, dxl bf16 + sums', t,
    bytes(g) + bytes(x) + bytes(gres) + bytes(dx) + bytes(dxl), nil, e)
  for _, v in ipairs({ dx, dw, db, dxl, dls }) do v:free() end
end
if opts.only == '' then
  local N, Cn = 8192, 4096
  local x, g, w = randn({ N, Cn }, 'bf16'), randn({ N, Cn }, 'bf16'), randn({ Cn }, 'bf16')
  local y, rstd = F.native_rms_norm(x, w, 1e-6)
  local xs = x:narrow(1, 1, 16):to('cpu')
  local e = check('rms_norm', y:narrow(1, 1, 16), (F.native_rms_norm(xs, w:to('cpu'), 1e-6)), 1e-2)
  row('rms_norm fwd', '8192x4096', 'bf16', timed(function() F.native_rms_norm(x, w, 1e-6) end), 2 * bytes(x), nil, e)
  local dx = F.native_rms_norm_backward(g, x, rstd, w)
  local _, rrs = F.native_rms_norm(xs, w:to('cpu'), 1e-6)
  e = check('rms_norm_backward', dx:narrow(1, 1, 16),
    (F.native_rms_norm_backward(g:narrow(1, 1, 16):to('cpu'), xs, rrs, w:to('cpu'))), 1e-2)
  row('rms_norm bwd', '8192x4096', 'bf16', timed(function() F.native_rms_norm_backward(g, x, rstd, w) end),
    3 * bytes(x), nil, e)
  dx:free()
end

-- ------------------------------------------------------------- RoPE
if opts.only == '' then
  local q = randn({ 8, 1024, 32, 128 }, 'bf16')            -- (B, T, H, D)
  local qt = q:transpose(2, 3)                             -- (B, H, T, D) view
  local cos, sin = nnf.rope_cache(1024, 128, 500000, 'f32', q.device_id)
  local y = F.rope(qt, cos, sin)
  local qs = q:narrow(1, 1, 1):to('cpu'):transpose(2, 3)
  local e = check('rope', y:narrow(1, 1, 1), F.rope(qs, cos:to('cpu'), sin:to('cpu')), 1e-2)
  local composed = function()
    local h = 64
    local r = F.cat({ F.neg(qt:narrow(-1, h + 1, h)), qt:narrow(-1, 1, h) }, -1)
    return F.add(F.mul(qt, cos:to('bf16')), F.mul(r, sin:to('bf16')))
  end
  row('rope fwd', '8x32x1024x128 (view)', 'bf16', timed(function() F.rope(qt, cos, sin) end), 2 * bytes(q),
    timed(composed), e)
  e = check('rope_backward', F.rope_backward(y, cos, sin):narrow(1, 1, 1),
    F.rope_backward(y:narrow(1, 1, 1):to('cpu'), cos:to('cpu'), sin:to('cpu')), 1e-2)
  row('rope bwd', '8x32x1024x128', 'bf16', timed(function() F.rope_backward(y, cos, sin) end), 2 * bytes(q), nil, e)
end

-- ------------------------------------------------- AdamW, grad norm
if opts.only == '' then
  local gpt2 = require 'models.gpt2'
  local model = gpt2.new('gpt2-124m', { vocab_size = 50304, n_positions = 1024 })
  for _, gdt in ipairs({ 'f32', 'bf16' }) do
    local ps, gs, m, v = {}, {}, {}, {}
    local nbytes, n = 0, 0
    for _, p in ipairs(model:parameters()) do
      local k = #ps + 1
      ps[k] = p:detach():to('cuda', { copy = true })
      gs[k] = randn(p.shape, gdt)
      m[k], v[k] = ms.zeros(p.shape, { device = 'cuda' }), ms.zeros(p.shape, { device = 'cuda' })
      nbytes = nbytes + 2 * bytes(ps[k]) + bytes(gs[k]) + 2 * (bytes(m[k]) + bytes(v[k]))
      n = n + p:numel()
    end
    -- correctness on the first tensor against the CPU reference
    local p0, g0 = ps[1]:to('cpu'), gs[1]:to('cpu')
    local m0, v0 = ms.zeros(p0.shape), ms.zeros(p0.shape)
    F.adamw_(p0, g0, m0, v0, 6e-4, 0.9, 0.95, 1e-8, 0.1, 1)
    F.adamw_(ps, gs, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, 1)
    local e = check('adamw_', ps[1], p0, 1e-5)
    local step = 1
    local t = timed(function()
      step = step + 1
      F.adamw_(ps, gs, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, step)
    end)
    row('adamw_', ('%d tensors, %.1fM'):format(#ps, n / 1e6), 'p f32, g ' .. gdt, t, nbytes, nil, e)
    local sq = F.sum_squares(gs)
    local want = 0
    for _, gg in ipairs(gs) do want = want + F.sum_squares(gg:to('cpu')):item() end
    e = math.abs(sq:item() - want) / want
    local gb = 0
    for _, gg in ipairs(gs) do gb = gb + bytes(gg) end
    local composed = function()
      local acc
      for _, gg in ipairs(gs) do
        local s = F.sum(F.square(gg:to('f32')))
        acc = acc and F.add(acc, s) or s
      end
      return acc
    end
    row('sum_squares', ('%d tensors'):format(#gs), gdt, timed(function() F.sum_squares(gs) end), gb,
      timed(composed), e)
  end
end

-- ------------------------------------------------- AdamW with f32 masters
-- fsdp.AdamW's flat shards (docs/fsdp.md "Clipping and the optimizer"):
-- f32 shard ranges and gradients, each range's bf16 copy (the all-gather's
-- source) either written by the step (the bf16 parameter with its f32
-- master) or refreshed after it by a cast (the composed form)
do
  local ps, lps, gs, m, v = {}, {}, {}, {}, {}
  local n = 0
  local nt = opts['adam-n']
  for k = 1, nt do
    local len = math.floor(opts['adam-m'] * 1e6 / nt) + 4096 * k   -- --adam-m M elements in --adam-n tensors
    ps[k] = randn({ len })
    lps[k] = ps[k]:to('bf16')
    gs[k] = randn({ len })
    m[k], v[k] = ms.zeros({ len }, { device = 'cuda' }), ms.zeros({ len }, { device = 'cuda' })
    n = n + len
  end
  local ref = ps[1]:narrow(1, 1, 4096):to('cpu')
  local g0 = gs[1]:narrow(1, 1, 4096):to('cpu')
  F.adamw_(ref, g0, ms.zeros({ 4096 }), ms.zeros({ 4096 }), 6e-4, 0.9, 0.95, 1e-8, 0.1, 1)
  F.adamw_(lps, gs, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, 1, ps)
  local e = check('adamw_ master', ps[1]:narrow(1, 1, 4096), ref, 1e-5)
  local step = 1
  -- with a clip coefficient, as fsdp.AdamW after clip_grad_norm{defer}
  local sc = ms.full({ 1 }, 0.5, { dtype = 'f64', device = 'cuda' })
  local written = timed(function()
    step = step + 1
    F.adamw_(lps, gs, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, step, ps, sc)
  end)
  local composed = timed(function()
    step = step + 1
    F.adamw_(ps, gs, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, step, nil, sc)
    for k = 1, #ps do lps[k]:copy_(ps[k]) end
  end)
  local plain = timed(function()
    step = step + 1
    F.adamw_(ps, gs, m, v, 6e-4, 0.9, 0.95, 1e-8, 0.1, step, nil, sc)
  end)
  row('adamw_ (f32 masters)', (nt .. ' tensors, %.0fM'):format(n / 1e6), 'p bf16 + w f32, g f32', written, n * (4 + 2 + 8 + 8 + 4 + 2),
    composed, e)
  row('adamw_ (no copies)', (nt .. ' tensors, %.0fM'):format(n / 1e6), 'p f32, g f32', plain, n * (4 + 4 + 8 + 8 + 4), nil, nil)
end

