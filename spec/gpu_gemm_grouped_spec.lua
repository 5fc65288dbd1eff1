-- The grouped GEMM kernels (kernels/grouped_gemm.cu, #gpu: wgmma on Hopper
-- and mma.sync) against the CPU:
-- random bf16 and f16 groups in the three layouts the experts use, C in the
-- operands' dtype (2e-2) or f32 (1e-5 of the CPU's f32 product of the same
-- operands), beta 0 (C starts as NaNs) and 1, rows straddling the 128-row
-- tiles and groups without rows, more groups than one launch takes, and row
-- strides wider than the rows (column views); the kernel and the loop of
-- cuBLASLt GEMMs (gemm_grouped_kernel('loop')) agree; 'auto' is right on
-- small and large groups; shapes outside the
-- kernel's rules fall back to the loop and are still right.
local ms = require 'moonshard'
local F = require 'moonshard.ops'

local function relerr(got, want)
  local g, w = got:to('cpu'):double(), want:to('cpu'):double()
  local num = ((g - w) * (g - w)):sum():item()
  local den = (w * w):sum():item()
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end

local seed = 9100
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed }):to(dtype)
end

describe('ops.gemm_grouped_ on CUDA #gpu', function()
  setup(function() assert.is_true(ms.cuda.is_available(), 'no CUDA device') end)

  -- groups (rows, inner) of C = op(A) op(B) (+ C), N columns
  local function run(dt, out_dt, tr, beta, rows, inner, N, widen)
    local as, bs, cs, want = {}, {}, {}, {}
    for g = 1, #rows do
      local M, K = rows[g], inner[g]
      local a = randn(tr[1] and { K, M + widen } or { M, K + widen }, dt)
      local b = randn(tr[2] and { N, K + widen } or { K, N + widen }, dt)
      -- column views: the row stride wider than the row
      as[g] = a:narrow(2, 1, tr[1] and M or K)
      bs[g] = b:narrow(2, 1, tr[2] and K or N)
      local c0 = randn({ M, N }, out_dt)
      cs[g] = beta == 1 and c0:cuda() or ms.empty({ M, N }, { dtype = out_dt, device = 'cuda' }):fill_(0 / 0)
      want[g] = c0:to('f32'):clone()   -- (an f32 c0 would be returned as it is)
      F.gemm_(want[g], as[g]:to('f32'), bs[g]:to('f32'), tr[1], tr[2], 1, beta)
    end
    local ga, gb = {}, {}
    for g = 1, #rows do ga[g], gb[g] = as[g]:cuda(), bs[g]:cuda() end
    F.gemm_grouped_(cs, ga, gb, tr[1], tr[2], beta)
    return cs, want, ga, gb
  end

  local layouts = { { false, true, 'forward' }, { false, false, 'input gradient' }, { true, false, 'weight gradient' } }
  -- the kernel (wgmma on Hopper) and the mma.sync one, wherever they apply
  for _, kind in ipairs({ 'kernel', 'mma' }) do
  for _, dt in ipairs({ 'bf16', 'f16' }) do
    for _, out_dt in ipairs({ dt, 'f32' }) do
      for _, tr in ipairs(layouts) do
        for _, beta in ipairs({ 0, 1 }) do
          it(('%s, %s operands, %s C, the %s layout, beta %d, against the CPU'):format(
            kind, dt, out_dt, tr[3], beta), function()
            local was = F.gemm_grouped_kernel(kind)
            finally(function() F.gemm_grouped_kernel(was) end)
            local bound = out_dt == 'f32' and 1e-5 or 2e-2
            -- weight gradients: the groups' row counts are the inner dimension
            local rows, inner, N
            if tr[1] then rows, inner, N = { 136, 136, 136, 136 }, { 0, 5, 300, 129 }, 264
            else rows, inner, N = { 300, 0, 1, 129, 64 }, { 136, 136, 136, 136, 136 }, 200 end
            for _, widen in ipairs({ 0, 24 }) do
              local cs, want = run(dt, out_dt, tr, beta, rows, inner, N, widen)
              for g = 1, #rows do
                if rows[g] > 0 then
                  local e = relerr(cs[g], want[g])
                  assert.is_true(e <= bound, ('group %d (widen %d): %g'):format(g, widen, e))
                end
              end
            end
          end)
        end
      end
    end
  end
  end

  it('the kernel and the loop of cuBLASLt GEMMs agree; 150 groups (three launches)', function()
    local rows, inner = {}, {}
    for g = 1, 150 do rows[g], inner[g] = (g * 37) % 200, 64 end
    local was = F.gemm_grouped_kernel('kernel')
    local cs, want, ga, gb = run('bf16', 'f32', { false, true }, 0, rows, inner, 48, 0)
    F.gemm_grouped_kernel('loop')
    local loop = {}
    for g = 1, #rows do loop[g] = ms.empty({ rows[g], 48 }, { device = 'cuda' }) end
    F.gemm_grouped_(loop, ga, gb, false, true, 0)
    F.gemm_grouped_kernel(was)
    for g = 1, #rows do
      if rows[g] > 0 then
        assert.is_true(relerr(cs[g], want[g]) <= 1e-5, 'kernel, group ' .. g)
        assert.is_true(relerr(cs[g], loop[g]) <= 1e-5, 'loop, group ' .. g)
      end
    end
  end)

  it("'auto' on small groups (the kernel) and large ones (the loop) is right", function()
    for _, shape in ipairs({ { 8, 1024, 352 }, { 4, 2048, 2048 } }) do
      local E, R, K = shape[1], shape[2], shape[3]
      local rows, inner = {}, {}
      for g = 1, E do rows[g], inner[g] = R, K end
      local cs, want = run('bf16', 'f32', { false, true }, 0, rows, inner, 512, 0)
      for g = 1, E do
        assert.is_true(relerr(cs[g], want[g]) <= 1e-5, ('%d x %d, group %d'):format(E, R, g))
      end
    end
  end)

  it('outside the kernel\'s rules (a row length not a multiple of 8, both transposed, f32) the loop answers', function()
    for _, case in ipairs({ { 'bf16', { false, true }, 36 }, { 'bf16', { true, true }, 40 }, { 'f32', { false, false }, 40 } }) do
      local dt, tr, K = case[1], case[2], case[3]
      local cs, want = run(dt, dt, tr, 1, { 70, 9 }, { K, K }, 24, 0)
      for g = 1, 2 do
        local e = relerr(cs[g], want[g])
        assert.is_true(e <= (dt == 'f32' and 1e-5 or 2e-2), ('%s K=%d group %d: %g'):format(dt, K, g, e))
      end
    end
  end)
end)
