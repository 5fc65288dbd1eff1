-- bench/float8.lua — one linear layer's forward + backward in bf16 against
-- FP8 (moonshard.float8, tensorwise), at the Llama shapes of the benches:
--
--   luajit bench/float8.lua [--tokens 8192] [--iters 50] [--shapes 2048x3072,...] [--casts]
--                           [--recipe tensorwise|rowwise|rowwise_with_gw_hp|blockwise]
--   luajit bench/float8.lua --pieces W [--shapes ...] [--iters 50]
--
-- Per shape (tokens x in -> out), forward+backward calls (x and the weight
-- bf16, both needing their gradient; the weight's gradient made anew each
-- call), --iters of them back to back between two CUDA events, the best of
-- three rounds (the GPU's ms a call; the host's ms to queue one is the last
-- column: where it is the larger, the GPU waited on the host):
--   bf16      nn.functional.linear (three cuBLASLt bf16 GEMMs)
--   float8    float8.linear: amax and cast of x, w and the output gradient
--             (both layouts), three FP8 GEMMs
--   gemms     the three FP8 GEMMs alone, on operands cast once
--   casts     float8 less gemms: what the scaling costs
--   amax + cast of x   x's two passes alone (both layouts)
-- and TFLOP/s as 6 * tokens * in * out over the time. With an axiswise
-- recipe (rowwise) the casts are the axiswise ones and the GEMMs take
-- vector scales (rowwise_with_gw_hp: the weight gradient's a bf16 GEMM); with
-- blockwise (DeepSeek-V3's) the casts are the 1x128 / 128x128 ones and the
-- GEMMs cuBLASLt's block-scaled ones (Hopper; no fast accumulation). The default shapes
-- are the 1.25B Llama's projections (hidden 2048, kv 512, MLP 5632) and
-- an 8B one's (4096 -> 14336).
--
-- --pieces W: the blockwise recipe's f8 all-gather work on one rank of W
-- (docs/fsdp.md, "Float8 all-gathers"): for each weight (out, in) bf16, the
-- piece of rank 0 (its n / W elements, the cut inside a block) -- its
-- blocks' maxima (float8_amax_blockwise_piece), the scales from the grid
-- (float8_scales_blockwise) and its cast (float8_cast_blockwise_piece) --
-- against the 128 x 128 cast of the whole gathered weight (both layouts)
-- that a layer makes with bf16 gathers, each forward (and again in the
-- backward under FULL_SHARD). The piece's bytes are checked against the
-- whole cast's. GB/s count the bytes read and written (the piece is read
-- twice: once for the maxima, once for the cast); L2 is not flushed
-- between calls (the production order reads each piece twice in a row too).
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local F = ms.raw
local float8 = ms.float8
local nnf = ms.nn.functional

local opts = { tokens = 8192, iters = 50, recipe = 'tensorwise',
  shapes = '2048x2048,2048x512,2048x5632,5632x2048,4096x14336,14336x4096' }
local casts_only, pieces = false, nil
do
  local i = 1
  while i <= #arg do
    local k = arg[i]:match('^%-%-(.+)$')
    if k == 'casts' then
      casts_only = true
      i = i + 1
    elseif k == 'pieces' and tonumber(arg[i + 1]) then
      pieces = tonumber(arg[i + 1])
      i = i + 2
    elseif k and opts[k] ~= nil and arg[i + 1] then
      opts[k] = tonumber(arg[i + 1]) or arg[i + 1]
      i = i + 2
    else
      error('usage: bench/float8.lua [--tokens N] [--iters N] [--shapes INxOUT,...] [--recipe R] [--casts] '
        .. '[--pieces W]; got '
        .. tostring(arg[i]))
    end
  end
end
assert(ms.cuda.is_available(), 'bench/float8.lua needs a CUDA device')

-- --casts: only the casts of a layer's inputs (tokens x in, bf16), three of
-- each: the forward's (amax found, the row-major copy) and the backward's
-- (the transposed copy with a given amax) -- for a profiler's kernel
-- times (ncu --metrics gpu__time_duration.sum), which the host cannot skew
if casts_only then
  for sh in opts.shapes:gmatch('[^,]+') do
    local in_f = tonumber(sh:match('^(%d+)x'))
    local x = ms.randn({ opts.tokens, in_f }, { seed = 1, device = 'cuda' }):to('bf16')
    for _ = 1, 3 do
      local r, _, i, am = F.float8_cast_dynamic(x, 'f8e4m3', { amax = true })
      local _, c, i2 = F.float8_cast(x, am, 'f8e4m3', { rows = false, cols = true })
      r:free(); i:free(); am:free(); c:free(); i2:free()
    end
  end
  ms.cuda.synchronize()
  print('casts done')
  os.exit(0)
end

local ffi = require 'ffi'
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } ms_f8b_timespec;
int ms_f8b_clock_gettime(int clk, ms_f8b_timespec *t) asm("clock_gettime");
]]
local tsp = ffi.new('ms_f8b_timespec')
local function now()
  ffi.C.ms_f8b_clock_gettime(1, tsp)
  return tonumber(tsp.tv_sec) + tonumber(tsp.tv_nsec) * 1e-9
end

-- ms a call on the GPU: `iters` calls back to back between two events (the
-- host queues ahead while it can), the best of 3 rounds; and the host's ms
-- a call to queue them (when that is the larger, the GPU waited on the host)
local function timed(fn, iters)
  for _ = 1, 5 do fn() end
  ms.cuda.synchronize()
  local e0, e1 = ms.cuda.event { timing = true }, ms.cuda.event { timing = true }
  local best, host = math.huge, math.huge
  for _ = 1, 3 do
    local t0 = now()
    e0:record()
    for _ = 1, iters do fn() end
    e1:record()
    local h = (now() - t0) * 1e3 / iters
    e1:synchronize()
    best = math.min(best, e0:elapsed_ms(e1) / iters)
    host = math.min(host, h)
  end
  return best, host
end

if pieces then
  local W = pieces
  print(('| weight (out, in) | W | piece elements | maxima ms | scales ms | piece cast ms | piece total ms | GB/s '
    .. '| whole 128x128 cast ms | whole GB/s |'))
  print('|---|---|---|---|---|---|---|---|---|---|')
  for sh in opts.shapes:gmatch('[^,]+') do
    local in_f, out_f = sh:match('^(%d+)x(%d+)$')
    in_f, out_f = tonumber(in_f), tonumber(out_f)
    local R, C, n = out_f, in_f, out_f * in_f
    local w = ms.randn({ R, C }, { seed = 3, device = 'cuda' }):to('bf16')
    local flat = w:view(n)
    -- the pieces of W ranks (the flat parameter's even split), rank 0's
    -- ending inside a block unless the split falls on a block row's end
    local S = math.ceil(n / W)
    local grid
    for r = 0, W - 1 do
      local off, len = r * S, math.min(S, n - r * S)
      if len > 0 then
        local a = F.float8_amax_blockwise_piece(flat:narrow(1, off + 1, len), R, C, off)
        if grid then
          local m = grid:gt(a)
          local g = F.where(m, grid, a)
          m:free(); grid:free(); a:free()
          grid = g
        else grid = a end
      end
    end
    local piece = flat:narrow(1, 1, S)
    local sc, inv, inv_t = F.float8_scales_blockwise(grid, 'f8e4m3')
    local out = F.float8_cast_blockwise_piece(piece, sc, R, C, 0, 'f8e4m3')
    -- against the whole cast (bytes and scales)
    local r8, c8, ir, ic = F.float8_cast_blockwise(w, 'f8e4m3', { blocks = '128x128', cols = true })
    local d = F.sub(out:to('f32'), r8:view(n):narrow(1, 1, S):to('f32')):abs():max():item()
    local di = F.sub(inv, ir):abs():max():item() + F.sub(inv_t, ic):abs():max():item()
    assert(d == 0 and di == 0, ('%s: the pieces differ from the whole cast (%g, scales %g)'):format(sh, d, di))
    r8:free(); c8:free(); ir:free(); ic:free()
    local am = ms.empty({ math.ceil(R / 128), math.ceil(C / 128) }, { device = 'cuda' })
    local ta = timed(function() F.float8_amax_blockwise_piece(piece, R, C, 0, { out = am }) end, opts.iters)
    local ts = timed(function() F.float8_scales_blockwise(grid, 'f8e4m3', { scale = sc, inv = inv, inv_t = inv_t }) end,
      opts.iters)
    local tc = timed(function() F.float8_cast_blockwise_piece(piece, sc, R, C, 0, 'f8e4m3', { out = out }) end, opts.iters)
    local tw = timed(function()
      local a, b, c, e = F.float8_cast_blockwise(w, 'f8e4m3', { blocks = '128x128', cols = true })
      a:free(); b:free(); c:free(); e:free()
    end, opts.iters)
    local tot = ta + ts + tc
    print(('| (%d, %d) | %d | %d | %.4f | %.4f | %.4f | %.4f | %.0f | %.4f | %.0f |'):format(R, C, W, S, ta, ts, tc, tot,
      5 * S / (tot * 1e6), tw, 4 * n / (tw * 1e6)))
  end
  os.exit(0)
end

print(('| tokens x in -> out | bf16 ms | float8 ms | speedup | FP8 GEMMs ms | casts ms | amax + cast of x ms | '
  .. 'bf16 TFLOP/s | float8 TFLOP/s | host ms a float8 call |'))
print('|---|---|---|---|---|---|---|---|---|---|')
local N = opts.tokens
local host = {}
for sh in opts.shapes:gmatch('[^,]+') do
  local in_f, out_f = sh:match('^(%d+)x(%d+)$')
  in_f, out_f = tonumber(in_f), tonumber(out_f)
  local x = ms.randn({ N, in_f }, { seed = 1, device = 'cuda' }):to('bf16'):requires_grad_()
  local w = (ms.randn({ out_f, in_f }, { seed = 2, device = 'cuda' }) * 0.02):to('bf16'):requires_grad_()
  local g = ms.randn({ N, out_f }, { seed = 3, device = 'cuda' }):to('bf16')
  local function layer(fn)
    return function()
      x.grad, w.grad = nil, nil
      local y = fn(x, w)
      y:backward(g)
      y:free()
    end
  end
  local t16 = timed(layer(function(a, b) return nnf.linear(a, b) end), opts.iters)
  local cfg = float8.config { recipe = opts.recipe }
  local t8, h8 = timed(layer(function(a, b) return float8.linear(a, b, nil, { config = cfg }) end), opts.iters)
  -- the three FP8 GEMMs on operands cast once
  local x8, x8t, xi, xit, w8, w8t, wi, wit, g8, g8t, gi, git
  -- (the products' scale kinds: blockwise ones, else none)
  local fwd_o, dx_o, dw_o = { fast_accum = true }, {}, { out_dtype = 'f32' }
  if cfg.blockwise then
    x8, x8t, xi, xit = F.float8_cast_blockwise(x:detach(), 'f8e4m3', { cols = true })
    w8, w8t, wi, wit = F.float8_cast_blockwise(w:detach(), 'f8e4m3', { blocks = '128x128', cols = true })
    g8, g8t, gi, git = F.float8_cast_blockwise(g, 'f8e4m3', { cols = true })
    fwd_o = { a_blocks = '1x128', b_blocks = '128x128' }
    dx_o = { a_blocks = '1x128', b_blocks = '128x128' }
    dw_o = { out_dtype = 'f32', a_blocks = '1x128', b_blocks = '1x128' }
  elseif cfg.axiswise then
    x8, x8t, xi, xit = F.float8_cast_axiswise(x:detach(), 'f8e4m3', { cols = true, pow2 = true })
    w8, w8t, wi, wit = F.float8_cast_axiswise(w:detach(), 'f8e4m3', { cols = true, pow2 = true })
    g8, g8t, gi, git = F.float8_cast_axiswise(g, cfg.grad_output, { cols = true, pow2 = true })
  else
    x8, x8t, xi = F.float8_cast(x:detach(), F.amax(x:detach()), 'f8e4m3', { cols = true })
    w8, w8t, wi = F.float8_cast(w:detach(), F.amax(w:detach()), 'f8e4m3', { cols = true })
    g8, g8t, gi = F.float8_cast(g, F.amax(g), 'f8e5m2', { cols = true })
    xit, wit, git = xi, wi, gi
  end
  local tg = timed(function()
    F.scaled_matmul(x8, w8, xi, wi, fwd_o):free()
    F.scaled_matmul(g8, w8t, gi, wit, dx_o):free()
    if cfg.gw_hp then F.matmul(g, x:detach(), true, false):free()
    else F.scaled_matmul(g8t, x8t, git, xit, dw_o):free() end
  end, opts.iters)
  local xd = x:detach()
  local tc, hc = timed(function()
    if cfg.blockwise then
      local r, c, i, ic = F.float8_cast_blockwise(xd, 'f8e4m3', { cols = true })
      r:free(); c:free(); i:free(); ic:free()
    elseif cfg.axiswise then
      local r, c, i, ic = F.float8_cast_axiswise(xd, 'f8e4m3', { cols = true, pow2 = true })
      r:free(); c:free(); i:free(); ic:free()
    else
      local r, c, i = F.float8_cast_dynamic(xd, 'f8e4m3', { cols = true })
      r:free(); c:free(); i:free()
    end
  end, opts.iters)
  local prev = ms.C.ms_cuda_float8_set_fused(0)
  local tu = timed(function()
    local r, c, i = F.float8_cast_dynamic(xd, 'f8e4m3', { cols = true })
    r:free(); c:free(); i:free()
  end, opts.iters)
  ms.C.ms_cuda_float8_set_fused(prev)
  local _, hg = timed(function() F.scaled_matmul(x8, w8, xi, wi, fwd_o):free() end, opts.iters)
  local _, hf = timed(function() float8.linear(xd, w:detach(), nil, { config = cfg }):free() end, opts.iters)
  local _, hl = timed(function() nnf.linear(xd, w:detach()):free() end, opts.iters)
  host[#host + 1] = ('| %d x %d -> %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.3f | %.3f |'):format(N, in_f, out_f,
    h8 * 1e3, hf * 1e3, hl * 1e3, hc * 1e3, hg * 1e3, tc, tu)
  local fl = 6 * N * in_f * out_f
  print(('| %d x %d -> %d | %.3f | %.3f | %.2fx | %.3f | %.3f | %.3f | %.0f | %.0f | %.3f |'):format(N, in_f, out_f,
    t16, t8, t16 / t8, tg, t8 - tg, tc, fl / t16 / 1e9, fl / t8 / 1e9, h8))
  io.stdout:flush()
end
print()
print('| tokens x in -> out | host us: float8 fwd+bwd | float8 fwd | bf16 fwd | dynamic cast | one FP8 GEMM | GPU ms: cast of x, fused | not fused |')
print('|---|---|---|---|---|---|---|---|')
for _, l in ipairs(host) do print(l) end
