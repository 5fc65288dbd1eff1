-- Float8 on CUDA (kernels/float8.cu, the FP8 GEMM of kernels/gemm.cu)
-- against the CPU reference (core/float8.c): conversions and casts bit for
-- bit (every layout path: whole 64 x 64 tiles, partial tiles, unaligned
-- views), amax exactly, the scaled products within the FP8 GEMMs'
-- accumulation, the FP8 linear forward and backward, a converted tiny
-- Llama's training against the CPU's, the fallback for token counts that
-- are not multiples of 16, and no host sync in a step; the axiswise and the
-- blockwise casts bit for bit, their products (cuBLASLt's outer-vector and
-- VEC128 / BLK128x128 scaling) and layers. Run on a GPU host:
-- `make test-gpu`.
local ms = require 'moonshard'
local S = require 'spec.support'

local F = ms.raw
local float8 = ms.float8
local values, relerr = S.values, S.relerr

local seed = 8800
local function randn(shape, scale, dtype)
  seed = seed + 1
  local t = ms.randn(shape, { seed = seed })
  if scale then t = F.mul(t, scale) end
  return dtype and dtype ~= 'f32' and t:to(dtype) or t
end

-- bitwise equal values (NaN equal to NaN), with the first difference named
local function same_values(a, b, what)
  local x, y = values(a), values(b)
  assert.are.equal(#x, #y, what)
  for i = 1, #x do
    local ok = (x[i] ~= x[i] and y[i] ~= y[i]) or x[i] == y[i]
    if not ok then error(('%s: element %d is %.9g on cuda, %.9g on the cpu'):format(what, i, x[i], y[i]), 2) end
  end
end

-- the FP8 GEMMs run on compute capability 8.9 and newer
local function fp8_device()
  local ffi = require 'ffi'
  local maj, min = ffi.new('int[1]'), ffi.new('int[1]')
  ms.C.ms_cuda_device_capability(0, maj, min)
  return maj[0] * 10 + min[0] >= 89
end

-- one float8.linear forward and backward (bf16 autocast, x (4, 64, 128),
-- 192 outputs, a bias) on the CPU and on CUDA: the CUDA results, and the
-- relative errors of y, dx, dw, db against the CPU's
local function linear_cpu_cuda(wt, recipe)
  local x = randn({ 4, 64, 128 })
  local w = wt and randn({ 192, 128 }, 0.05) or randn({ 128, 192 }, 0.05)
  local b = randn({ 192 }, 0.1)
  local g = randn({ 4, 64, 192 })
  local function run(dev)
    local function leaf(t) return t:to({ device = dev, copy = true }):requires_grad_() end
    local xx, ww, bb = leaf(x), leaf(w), leaf(b)
    local y = ms.nn.functional.autocast('bf16', function()
      return float8.linear(xx, ww, bb, { wt = wt, recipe = recipe })
    end)
    y:backward(g:to(dev):to('bf16'))
    return { y, xx.grad, ww.grad, bb.grad }
  end
  local c, r = run('cpu'), run('cuda')
  local e = {}
  for i = 1, 4 do e[i] = relerr(r[i], c[i]) end
  print(('\nfloat8.linear %s %s, cuda against cpu: y %.2e, dx %.2e, dw %.2e, db %.2e'):format(recipe or 'tensorwise',
    wt and 'Linear' or 'Conv1D', e[1], e[2], e[3], e[4]))
  return r, e
end

-- a converted tiny Llama's losses over 8 AdamW steps on dev
local function llama_losses(dev, recipe)
  ms.manual_seed(21)
  local m = require('models.llama').new('tiny'):to(dev)
  float8.convert(m, { recipe = recipe })
  local ids = (ms.rand({ 8, 65 }, { seed = 3 }) * 255):long():to(dev)
  return S.adamw_losses(m, ids:narrow(2, 1, 64):contiguous(), ids:narrow(2, 2, 64):contiguous(), 8, 2e-3)
end

describe('float8 on cuda #gpu', function()
  it('has a device', function() assert.is_true(ms.cuda.is_available(), 'no CUDA device') end)

  it('conversions to and from both formats give the CPU bits (ties, overflow, subnormals, f64 sources)', function()
    local v = {}
    for e = -24, 17 do
      for _, m in ipairs({ 1, 1.0625, 1.125, 1.1875, 1.5, 1.75, 1.875, 1.9375 }) do
        v[#v + 1] = m * 2 ^ e
        v[#v + 1] = -m * 2 ^ e
      end
    end
    for _, x in ipairs({ 0, -0.0, 1 / 0, -1 / 0, 0 / 0, 464, 465, 480, 61439, 61440, 1e-45 }) do v[#v + 1] = x end
    local r = values(randn({ 4000 }, 300))
    for i = 1, #r do v[#v + 1] = r[i] end
    for _, src in ipairs({ 'f32', 'f64', 'bf16' }) do
      local x = S.make({ #v }, v, src)
      for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
        same_values(x:cuda():to(name), x:to(name), src .. ' -> ' .. name)
        local c8 = x:to(name)
        same_values(c8:cuda():to('f32'), c8:to('f32'), name .. ' -> f32')
        same_values(c8:cuda():to('bf16'), c8:to('bf16'), name .. ' -> bf16')
      end
    end
  end)

  it('amax equals the CPU for every float dtype, odd sizes, unaligned views and NaN', function()
    for _, dt in ipairs({ 'f32', 'bf16', 'f16', 'f64' }) do
      for _, n in ipairs({ 1, 7, 1000, 2 ^ 20, 2 ^ 20 + 3 }) do
        local x = randn({ n }, 5, dt)
        assert.are.equal(F.amax(x):item(), F.amax(x:cuda()):item(), dt .. ' ' .. n)
        if n > 1 then
          local v = x:narrow(1, 2, n - 1)   -- an unaligned start
          assert.are.equal(F.amax(v):item(), F.amax(v:cuda()):item(), dt .. ' view ' .. n)
        end
      end
    end
    local v = values(randn({ 999 }))
    v[500] = 0 / 0
    local a = F.amax(S.make({ 999 }, v, 'f32'):cuda()):item()
    assert.is_true(a ~= a)
  end)

  it('the scaled cast gives the CPU bits in both layouts (whole and partial tiles, unaligned, pow2)', function()
    -- whole 128 x 128 tiles (the fast path), edges of 64 x 64 quarters, both
    local shapes = { { 128, 256 }, { 64, 64 }, { 100, 37 }, { 1, 16 }, { 333, 190 }, { 2048, 48 }, { 384, 512 },
      { 256, 208 }, { 144, 128 } }
    for _, sh in ipairs(shapes) do
      for _, dt in ipairs({ 'f32', 'bf16', 'f16' }) do
        for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
          for _, pow2 in ipairs({ false, true }) do
            local x = randn(sh, 3, dt)
            local am = S.make({}, { 2 }, 'f32')   -- below the true amax: some values saturate
            local r, c, inv = F.float8_cast(x, am, name, { cols = true, pow2 = pow2 })
            local rg, cg, ig = F.float8_cast(x:cuda(), am:cuda(), name, { cols = true, pow2 = pow2 })
            local what = ('%s %s %s pow2=%s'):format(table.concat(sh, 'x'), dt, name, tostring(pow2))
            same_values(rg, r, what)
            same_values(cg, c, what .. ' transposed')
            assert.are.equal(inv:item(), ig:item(), what .. ' inv')
          end
        end
      end
    end
    -- an unaligned source (a view one element in): the element-by-element path
    local big = randn({ 64 * 65 + 1 }, 2, 'bf16')
    local x = big:narrow(1, 2, 64 * 65):view(64, 65)
    local am = F.amax(x)
    local r, c = F.float8_cast(x, am, 'f8e4m3', { cols = true })
    local rg, cg = F.float8_cast(big:cuda():narrow(1, 2, 64 * 65):view(64, 65), am:cuda(), 'f8e4m3', { cols = true })
    same_values(rg, r, 'unaligned')
    same_values(cg, c, 'unaligned transposed')
  end)

  it('the dynamic cast (amax found in the same launch) gives the CPU bits, fused or not, and the same amax', function()
    local prev = ms.C.ms_cuda_float8_set_fused(-1)
    for _, sh in ipairs({ { 8192, 2048 }, { 100, 37 }, { 1, 16 }, { 4096, 5632 }, { 3, 100000 } }) do
      for _, dt in ipairs({ 'bf16', 'f32' }) do
        for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
          local x = randn(sh, 4, dt)
          local r, c, inv, am = F.float8_cast_dynamic(x, name, { cols = true, amax = true })
          local xg = x:cuda()
          for _, fused in ipairs({ 1, 0 }) do
            ms.C.ms_cuda_float8_set_fused(fused)
            local rg, cg, ig, ag = F.float8_cast_dynamic(xg, name, { cols = true, amax = true })
            local what = ('%s %s %s fused=%d'):format(table.concat(sh, 'x'), dt, name, fused)
            assert.are.equal(am:item(), ag:item(), what .. ' amax')
            assert.are.equal(inv:item(), ig:item(), what .. ' inv')
            same_values(rg, r, what)
            same_values(cg, c, what .. ' transposed')
          end
        end
      end
    end
    ms.C.ms_cuda_float8_set_fused(prev)
  end)

  it('scaled_matmul matches the CPU within the FP8 GEMMs\' accumulation (f32 and bf16 out, bias, beta, e5m2)', function()
    if not fp8_device() then pending('FP8 GEMMs need compute capability 8.9+') return end
    local worst = {}
    for _, sh in ipairs({ { 256, 512, 1024 }, { 16, 16, 16 }, { 1024, 2048, 4096 }, { 48, 80, 112 } }) do
      local M, N, K = sh[1], sh[2], sh[3]
      for _, pair in ipairs({ { 'f8e4m3', 'f8e4m3' }, { 'f8e5m2', 'f8e4m3' }, { 'f8e4m3', 'f8e5m2' } }) do
        local xa, xb = randn({ M, K }, 2), randn({ N, K }, 0.05)
        local a, _, ai = F.float8_cast(xa, F.amax(xa), pair[1])
        local b, _, bi = F.float8_cast(xb, F.amax(xb), pair[2])
        local ag, bg, aig, big = a:cuda(), b:cuda(), ai:cuda(), bi:cuda()
        local ref = F.scaled_matmul(a, b, ai, bi, { out_dtype = 'f32' })
        for _, fast in ipairs({ false, true }) do
          local e = relerr(F.scaled_matmul(ag, bg, aig, big, { out_dtype = 'f32', fast_accum = fast }), ref)
          local key = fast and 'f32 fast' or 'f32'
          worst[key] = math.max(worst[key] or 0, e)
          -- (Hopper's FP8 MMA accumulates in fewer bits than f32; cuBLASLt adds
          -- the partial sums into f32 every few steps unless fast_accum)
          assert.is_true(e < (fast and 5e-3 or 1e-3), ('%dx%dx%d %s x %s fast=%s: %.3g'):format(M, N, K, pair[1],
            pair[2], tostring(fast), e))
        end
        local eb = relerr(F.scaled_matmul(ag, bg, aig, big, { out_dtype = 'bf16' }), ref)
        worst.bf16 = math.max(worst.bf16 or 0, eb)
        assert.is_true(eb < 1e-2, 'bf16 out ' .. eb)
      end
      -- bias in the epilogue, and beta accumulating into f32
      local xa, xb = randn({ M, K }), randn({ N, K })
      local a, _, ai = F.float8_cast(xa, F.amax(xa), 'f8e4m3')
      local b, _, bi = F.float8_cast(xb, F.amax(xb), 'f8e4m3')
      local bias = randn({ N }, 1, 'bf16')
      local ref = F.scaled_matmul(a, b, ai, bi, { bias = bias })
      local got = F.scaled_matmul(a:cuda(), b:cuda(), ai:cuda(), bi:cuda(), { bias = bias:cuda() })
      assert.is_true(relerr(got, ref) < 1e-2, 'bias')
      local acc = randn({ M, N })
      local accg = acc:cuda()
      F.scaled_matmul(a, b, ai, bi, { out = acc, beta = 1 })
      F.scaled_matmul(a:cuda(), b:cuda(), ai:cuda(), bi:cuda(), { out = accg, beta = 1 })
      assert.is_true(relerr(accg, acc) < 1e-3, 'beta')
    end
    print(('\nscaled_matmul against the CPU, worst ||d||/||ref||: f32 %.2e, f32 fast accumulation %.2e, bf16 %.2e')
      :format(worst.f32, worst['f32 fast'], worst.bf16))
  end)

  it('scaled_matmul names what cuBLASLt cannot take (dims not multiples of 16)', function()
    if not fp8_device() then pending('FP8 GEMMs need compute capability 8.9+') return end
    local x = randn({ 24, 40 })
    local a, _, ai = F.float8_cast(x:cuda(), F.amax(x:cuda()), 'f8e4m3')
    local e = S.errmsg(function() F.scaled_matmul(a, a, ai, ai) end)
    assert.is_truthy(e:find('multiples of 16', 1, true), e)
  end)

  it('float8.linear forward and backward match the CPU (Linear and Conv1D, bias, bf16 autocast, f32 sink)', function()
    if not fp8_device() then pending('FP8 GEMMs need compute capability 8.9+') return end
    for _, wt in ipairs({ true, false }) do
      local r, e = linear_cpu_cuda(wt)
      assert.are.equal('bf16', r[1].dtype)
      assert.are.equal('f32', r[3].dtype)
      assert.is_true(e[1] < 1e-2, 'forward')
      assert.is_true(e[2] < 1e-2, 'dx')
      assert.is_true(e[3] < 1e-3, 'dw')
      assert.is_true(e[4] < 1e-2, 'db')
    end
  end)

  it('token counts that are not multiples of 16 run the plain linear; a step makes no host sync', function()
    local x = randn({ 3, 7, 64 }):cuda()
    local w = randn({ 32, 64 }, 0.1):cuda()
    local a = float8.linear(x, w)
    local want = ms.nn.functional.linear(x, w)
    assert.are.same(values(want), values(a))
    if not fp8_device() then return end
    local llama = require 'models.llama'
    ms.manual_seed(4)
    local m = llama.new('tiny'):to('cuda')
    float8.convert(m)
    local opt = ms.optim.AdamW(m, { lr = 1e-3 })
    local ids = (ms.rand({ 4, 33 }, { seed = 9 }) * 255):long():cuda()
    local xi, yi = ids:narrow(2, 1, 32):contiguous(), ids:narrow(2, 2, 32):contiguous()
    local function step()
      opt:zero_grad()
      local loss = ms.nn.functional.autocast('bf16', m, xi, yi)
      loss:backward()
      opt:step()
      return loss
    end
    step(); step()
    ms.cuda.synchronize()
    local s0 = ms.cuda.memory_stats().num_host_syncs
    step()
    assert.are.equal(s0, ms.cuda.memory_stats().num_host_syncs)
  end)

  it('a converted tiny Llama trains on the GPU as on the CPU', function()
    if not fp8_device() then pending('FP8 GEMMs need compute capability 8.9+') return end
    local c, g = llama_losses('cpu'), llama_losses('cuda')
    assert.is_true(g[8] < g[1] - 0.5, 'it trains')
    for k = 1, 8 do
      assert.is_true(math.abs(c[k] - g[k]) < 0.02 * c[k], ('step %d: cuda %g, cpu %g'):format(k, g[k], c[k]))
    end
  end)

  it('the axiswise cast gives the CPU bits and scales (rows and columns; whole, partial and unaligned tiles)', function()
    local shapes = { { 128, 256 }, { 64, 64 }, { 100, 37 }, { 1, 16 }, { 333, 190 }, { 2048, 48 }, { 8192, 4096 },
      { 300, 1000 }, { 16, 14336 } }
    for _, sh in ipairs(shapes) do
      for _, dt in ipairs({ 'f32', 'bf16', 'f16', 'f64' }) do
        for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
          if dt == 'bf16' or sh[1] * sh[2] <= 2 ^ 20 then
            local pow2 = name == 'f8e4m3'
            local x = randn(sh, 3, dt)
            local r, c, ir, ic = F.float8_cast_axiswise(x, name, { cols = true, pow2 = pow2 })
            local xg = x:cuda()
            -- both layouts (the fused passes, and apart: MS_FLOAT8_FUSED=0),
            -- each alone
            for _, fused in ipairs({ 1, 0 }) do
              local prev = ms.C.ms_cuda_float8_set_fused(fused)
              local rg, cg, irg, icg = F.float8_cast_axiswise(xg, name, { cols = true, pow2 = pow2 })
              ms.C.ms_cuda_float8_set_fused(prev)
              local what = ('%s %s %s fused=%d'):format(table.concat(sh, 'x'), dt, name, fused)
              same_values(rg, r, what .. ' rows')
              same_values(cg, c, what .. ' cols')
              same_values(irg, ir, what .. ' row scales')
              same_values(icg, ic, what .. ' column scales')
            end
            local what = ('%s %s %s'):format(table.concat(sh, 'x'), dt, name)
            local r1, _, ir1 = F.float8_cast_axiswise(xg, name, { pow2 = pow2 })
            same_values(r1, r, what .. ' rows alone'); same_values(ir1, ir, what .. ' row scales alone')
            local _, c1, _, ic1 = F.float8_cast_axiswise(xg, name, { rows = false, cols = true, pow2 = pow2 })
            same_values(c1, c, what .. ' cols alone'); same_values(ic1, ic, what .. ' column scales alone')
          end
        end
      end
    end
    -- a NaN poisons its row's and its column's scale only; a zero row
    do
      local v = values(randn({ 96, 80 }, 2))
      v[2 * 80 + 6] = 0 / 0
      for j = 1, 80 do v[7 * 80 + j] = 0 end
      local x = S.make({ 96, 80 }, v, 'bf16')
      local r, c, ir, ic = F.float8_cast_axiswise(x, 'f8e4m3', { cols = true })
      local rg, cg, irg, icg = F.float8_cast_axiswise(x:cuda(), 'f8e4m3', { cols = true })
      same_values(rg, r, 'NaN rows'); same_values(cg, c, 'NaN cols')
      same_values(irg, ir, 'NaN row scales'); same_values(icg, ic, 'NaN column scales')
    end
    local big = randn({ 64 * 65 + 1 }, 2, 'bf16')
    local x = big:narrow(1, 2, 64 * 65):view(64, 65)
    local r, c, ir, ic = F.float8_cast_axiswise(x, 'f8e4m3', { cols = true })
    local rg, cg, irg, icg = F.float8_cast_axiswise(big:cuda():narrow(1, 2, 64 * 65):view(64, 65), 'f8e4m3',
      { cols = true })
    same_values(rg, r, 'unaligned rows'); same_values(cg, c, 'unaligned cols')
    same_values(irg, ir, 'unaligned row scales'); same_values(icg, ic, 'unaligned column scales')
    local _, ct, _, ict = F.float8_cast_axiswise(ms.zeros({ 0, 40 }):cuda(), 'f8e4m3', { cols = true })
    assert.are.same({ 40, 0 }, ct.shape)
    local _, _, _, icc = F.float8_cast_axiswise(ms.zeros({ 0, 40 }), 'f8e4m3', { rows = false, cols = true })
    same_values(ict, icc, 'empty scales')
  end)

  -- the amaxes apart and given back (tp_scales = 'group': the group's):
  -- the row kernel's amax-only and given passes, the tile kernels' column
  -- and two-layout passes with given amaxes
  it('amax_axiswise gives the CPU amaxes; the cast with given amaxes gives the CPU bits (each layout, fused and apart)', function()
    for _, sh in ipairs({ { 128, 256 }, { 100, 37 }, { 1, 16 }, { 333, 190 }, { 2048, 5632 }, { 16, 14336 } }) do
      for _, dt in ipairs({ 'bf16', 'f32' }) do
        local v = values(randn(sh, 2))
        v[math.min(#v, 7)] = 0 / 0   -- (a NaN: its row's and column's amax)
        local x = S.make(sh, v, dt)
        local xg = x:cuda()
        local what = ('%s %s'):format(table.concat(sh, 'x'), dt)
        local ra, ca = F.float8_amax_axiswise(x, { cols = true })
        local rg, cg = F.float8_amax_axiswise(xg, { cols = true })
        same_values(rg, ra, what .. ' row amaxes'); same_values(cg, ca, what .. ' column amaxes')
        same_values((F.float8_amax_axiswise(xg)), ra, what .. ' row amaxes alone')
        local _, c1 = F.float8_amax_axiswise(xg, { rows = false, cols = true })
        same_values(c1, ca, what .. ' column amaxes alone')
        local r, c, ir, ic = F.float8_cast_axiswise(x, 'f8e4m3', { cols = true, pow2 = true })
        local rag, cag = ra:cuda(), ca:cuda()
        for _, fused in ipairs({ 1, 0 }) do
          local prev = ms.C.ms_cuda_float8_set_fused(fused)
          local r2, c2, ir2, ic2 = F.float8_cast_axiswise(xg, 'f8e4m3', { cols = true, pow2 = true, row_amax = rag,
            col_amax = cag })
          ms.C.ms_cuda_float8_set_fused(prev)
          local w = what .. ' given, fused=' .. fused
          same_values(r2, r, w .. ' rows'); same_values(c2, c, w .. ' cols')
          same_values(ir2, ir, w .. ' row scales'); same_values(ic2, ic, w .. ' column scales')
        end
        -- one layout's given, the other's found (the rows' by the row
        -- kernel, the columns' by the column pass)
        for _, g in ipairs({ { row_amax = rag }, { col_amax = cag } }) do
          local r2, c2, ir2, ic2 = F.float8_cast_axiswise(xg, 'f8e4m3', { cols = true, pow2 = true,
            row_amax = g.row_amax, col_amax = g.col_amax })
          local w = what .. (g.row_amax and ' rows given' or ' cols given')
          same_values(r2, r, w .. ': rows'); same_values(c2, c, w .. ': cols')
          same_values(ir2, ir, w .. ': row scales'); same_values(ic2, ic, w .. ': column scales')
        end
        local slots = ms.zeros({ sh[1] + sh[2] + 2 }):cuda()
        F.float8_amax_axiswise(xg, { row_out = slots:narrow(1, 2, sh[1]) })
        F.float8_amax_axiswise(xg, { rows = false, cols = true, col_out = slots:narrow(1, sh[1] + 2, sh[2]) })
        same_values(slots:narrow(1, 2, sh[1]), ra, what .. ' row amaxes into a slot')
        same_values(slots:narrow(1, sh[1] + 2, sh[2]), ca, what .. ' column amaxes into a slot')
        local r3, _, ir3 = F.float8_cast_axiswise(xg, 'f8e4m3', { pow2 = true, row_amax = rag })
        same_values(r3, r, what .. ' given, rows alone'); same_values(ir3, ir, what .. ' given, row scales alone')
        local _, c3, _, ic3 = F.float8_cast_axiswise(xg, 'f8e4m3', { rows = false, cols = true, pow2 = true,
          col_amax = cag })
        same_values(c3, c, what .. ' given, cols alone'); same_values(ic3, ic, what .. ' given, column scales alone')
        -- larger given amaxes (a group's): the CPU's bits with them too
        local r4, c4 = F.float8_cast_axiswise(x, 'f8e5m2', { cols = true, row_amax = F.mul(ra, 3), col_amax = F.mul(ca, 2) })
        local r5, c5 = F.float8_cast_axiswise(xg, 'f8e5m2', { cols = true, row_amax = F.mul(rag, 3),
          col_amax = F.mul(cag, 2) })
        same_values(r5, r4, what .. ' group rows'); same_values(c5, c4, what .. ' group cols')
      end
    end
    local e = S.errmsg(function()
      F.float8_cast_axiswise(ms.randn({ 4, 16 }):cuda(), 'f8e4m3', { row_amax = ms.ones({ 4 }) })
    end)
    assert.is_truthy(e:find("row_amax must be a contiguous f32 vector of 4 on x's device", 1, true), e)
  end)

  it('float8_transpose gives the CPU bytes (whole, partial and unaligned tiles)', function()
    for _, sh in ipairs({ { 2048, 5632 }, { 100, 37 }, { 1, 16 }, { 64, 64 }, { 333, 190 } }) do
      local x = randn(sh, 4):to('f8e4m3')
      same_values(F.float8_transpose(x:cuda()), F.float8_transpose(x), table.concat(sh, 'x'))
    end
    local big = randn({ 64 * 65 + 1 }, 2):to('f8e4m3')
    local v = big:narrow(1, 2, 64 * 65):view(64, 65)
    same_values(F.float8_transpose(big:cuda():narrow(1, 2, 64 * 65):view(64, 65)), F.float8_transpose(v), 'unaligned')
  end)

  it('scaled_matmul with vector scales (cuBLASLt outer-vector scaling) matches the CPU (bias, beta, fast accumulation)', function()
    if not fp8_device() then pending('FP8 GEMMs need compute capability 8.9+') return end
    local ffi = require 'ffi'
    local maj, min = ffi.new('int[1]'), ffi.new('int[1]')
    ms.C.ms_cuda_device_capability(0, maj, min)
    local worst = 0
    for _, sh in ipairs({ { 256, 512, 1024 }, { 16, 16, 16 }, { 1024, 2048, 4096 }, { 48, 80, 112 } }) do
      local M, N, K = sh[1], sh[2], sh[3]
      local a, _, ai = F.float8_cast_axiswise(randn({ M, K }, 2), 'f8e4m3', { pow2 = true })
      local b, _, bi = F.float8_cast_axiswise(randn({ N, K }, 0.05), 'f8e4m3', { pow2 = true })
      if maj[0] < 9 then
        local e = S.errmsg(function() F.scaled_matmul(a:cuda(), b:cuda(), ai:cuda(), bi:cuda()) end)
        assert.is_truthy(e:find('compute capability 9.0', 1, true), e)
        return
      end
      local ref = F.scaled_matmul(a, b, ai, bi, { out_dtype = 'f32' })
      local ag, bg, aig, big = a:cuda(), b:cuda(), ai:cuda(), bi:cuda()
      for _, fast in ipairs({ false, true }) do
        local e = relerr(F.scaled_matmul(ag, bg, aig, big, { out_dtype = 'f32', fast_accum = fast }), ref)
        worst = math.max(worst, e)
        assert.is_true(e < (fast and 5e-3 or 1e-3), ('%dx%dx%d fast=%s: %.3g'):format(M, N, K, tostring(fast), e))
      end
      assert.is_true(relerr(F.scaled_matmul(ag, bg, aig, big, { out_dtype = 'bf16' }), ref) < 1e-2, 'bf16 out')
      local bias = randn({ N }, 1, 'bf16')
      local rb = F.scaled_matmul(a, b, ai, bi, { bias = bias })
      assert.is_true(relerr(F.scaled_matmul(ag, bg, aig, big, { bias = bias:cuda() }), rb) < 1e-2, 'bias')
      local acc = randn({ M, N })
      local accg = acc:cuda()
      F.scaled_matmul(a, b, ai, bi, { out = acc, beta = 1 })
      F.scaled_matmul(ag, bg, aig, big, { out = accg, beta = 1 })
      assert.is_true(relerr(accg, acc) < 1e-3, 'beta')
    end
    print(('\nscaled_matmul with vector scales against the CPU, worst ||d||/||ref||: %.2e'):format(worst))
  end)

  it('float8.linear rowwise and rowwise_with_gw_hp match the CPU; a converted tiny Llama trains as on the CPU', function()
    if not fp8_device() then pending('FP8 GEMMs need compute capability 8.9+') return end
    for _, recipe in ipairs({ 'rowwise', 'rowwise_with_gw_hp' }) do
      for _, wt in ipairs({ true, false }) do
        local _, e = linear_cpu_cuda(wt, recipe)
        assert.is_true(e[1] < 1e-2 and e[2] < 1e-2 and e[3] < 1e-2 and e[4] < 1e-2, recipe)
      end
    end
    local c, gl = llama_losses('cpu', 'rowwise'), llama_losses('cuda', 'rowwise')
    assert.is_true(gl[8] < gl[1] - 0.5, 'it trains')
    for k = 1, 8 do
      assert.is_true(math.abs(c[k] - gl[k]) < 0.02 * c[k], ('rowwise step %d: cuda %g, cpu %g'):format(k, gl[k], c[k]))
    end
  end)
end)

-- the blockwise recipe (DeepSeek-V3's 1x128 / 128x128 scaling)
local function hopper()
  local ffi = require 'ffi'
  local maj, min = ffi.new('int[1]'), ffi.new('int[1]')
  ms.C.ms_cuda_device_capability(0, maj, min)
  return maj[0] == 9
end

describe('float8 blockwise on cuda #gpu', function()
  -- x on the CPU and x on CUDA (or a CUDA view of its own), cast alike: the same bits and scales
  local function same_blockwise(x, xg, name, o, tag)
    local c = { F.float8_cast_blockwise(x, name, o) }
    local g = { F.float8_cast_blockwise(xg, name, o) }
    for i, what in ipairs({ ' out', ' out_t', ' inv', ' inv_t' }) do
      if c[i] then same_values(g[i], c[i], tag .. what) else assert.is_nil(g[i], tag .. what) end
    end
  end

  -- (shapes: whole tiles; edge tiles on the element-wise paths (C % 8, R % 16
  -- not 0) and on the vector paths (272 x 392: R % 16 == 0, C % 8 == 0);
  -- tiles smaller than a thread's 8 x 8 square)
  it('the blockwise casts give the CPU bits and scales (1x128 and 128x128; whole, edge and tiny tiles; dtypes, formats, pow2; NaN, infinities, zero and subnormal tiles; one layout alone; unaligned views)', function()
    for _, sh in ipairs({ { 256, 384 }, { 200, 300 }, { 5, 7 }, { 130, 1000 }, { 272, 392 }, { 129, 136 } }) do
      for _, dt in ipairs({ 'f32', 'bf16', 'f16', 'f64' }) do
        for _, blocks in ipairs({ '1x128', '128x128' }) do
          for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
            for _, pow2 in ipairs({ false, true }) do
              local x = randn(sh, 3, dt)
              same_blockwise(x, x:cuda(), name, { blocks = blocks, cols = true, pow2 = pow2 },
                ('%dx%d %s %s %s pow2=%s'):format(sh[1], sh[2], dt, blocks, name, tostring(pow2)))
            end
          end
        end
      end
    end
    -- NaN, infinities, a zero tile, a tile of f32 subnormals, -0: each
    -- touches its own blocks only, as on the CPU
    do
      local R, C = 272, 392
      local v = values(randn({ R, C }, 3))
      v[3 * C + 200] = 0 / 0                                   -- row 3, column block 1
      v[140 * C + 10] = math.huge                              -- row 140, column block 0
      v[150 * C + 300] = -math.huge                            -- row 150, column block 2
      v[260 * C + 390] = 0 / 0                                 -- the corner tile
      v[7 * C + 7] = -0.0
      for i = 0, 127 do for j = 257, 384 do v[i * C + j] = 0 end end
      for i = 128, 255 do for j = 129, 256 do v[i * C + j] = v[i * C + j] * 1e-41 end end
      local x32 = S.make({ R, C }, v, 'f32')
      for _, dt in ipairs({ 'f32', 'bf16', 'f16', 'f64' }) do
        local x = x32:to(dt)
        for _, blocks in ipairs({ '1x128', '128x128' }) do
          for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
            for _, pow2 in ipairs({ false, true }) do
              same_blockwise(x, x:cuda(), name, { blocks = blocks, cols = true, pow2 = pow2 },
                ('special values %s %s %s pow2=%s'):format(dt, blocks, name, tostring(pow2)))
            end
          end
        end
      end
    end
    -- one layout alone, and a view (made contiguous first)
    local x = randn({ 300, 520 })
    local v = x:narrow(2, 3, 400)
    for _, blocks in ipairs({ '1x128', '128x128' }) do
      same_blockwise(v, v:cuda(), 'f8e4m3', { blocks = blocks }, 'view, rows alone ' .. blocks)
      same_blockwise(v, v:cuda(), 'f8e4m3', { blocks = blocks, rows = false, cols = true }, 'view, columns alone ' .. blocks)
    end
    -- a CUDA view that is contiguous but starts off a 16-byte boundary (the
    -- element-wise loads with C % 8 == 0), every dtype
    for _, dt in ipairs({ 'f32', 'bf16', 'f16', 'f64' }) do
      local big = randn({ 272 * 392 + 3 }, 3, dt)
      local xc, xg = big:narrow(1, 4, 272 * 392):view(272, 392), big:cuda():narrow(1, 4, 272 * 392):view(272, 392)
      for _, blocks in ipairs({ '1x128', '128x128' }) do
        same_blockwise(xc, xg, 'f8e4m3', { blocks = blocks, cols = true }, 'unaligned view ' .. dt .. ' ' .. blocks)
      end
    end
  end)

  -- FSDP's float8 all-gathers of blockwise weights: a flat piece of a
  -- weight cut at any element (docs/fsdp.md, "Float8 all-gathers")
  it('the blockwise pieces (block maxima, scales, the piece\'s cast) give the CPU bits, and with the whole matrix\'s maxima the bytes of its 128x128 cast (cuts inside blocks, edge blocks, dtypes, formats, pow2, NaN)', function()
    -- (the maxima of two pieces, a NaN kept from either side, as the
    -- whole matrix's cast keeps it)
    local function vmax(p, q) return F.where(p:ne(p), p, F.where(p:gt(q), p, q)) end
    for _, sh in ipairs({ { 300, 200 }, { 256, 384 }, { 5, 7 }, { 1000, 130 } }) do
      local R, C = sh[1], sh[2]
      for _, dt in ipairs({ 'f32', 'bf16', 'f16', 'f64' }) do
        local x = randn({ R, C }, 3, dt)
        if R >= 256 then   -- (a NaN in block (1, 0))
          local v = values(x:to('f32'))
          v[200 * C + 3] = 0 / 0
          x = S.make({ R, C }, v, 'f32'):to(dt)
        end
        local flat = x:contiguous():view(R * C)
        local flatg = flat:cuda()
        -- cuts: inside blocks and rows, an odd offset (the piece's first
        -- element off any alignment), a piece inside one row of one block
        local n = R * C
        local cuts = { 0, math.floor(n / 7) + 1, math.floor(n / 3), math.floor(n / 3) + 5, math.floor(n * 0.8) + 3, n }
        local grid, gridg
        for p = 1, #cuts - 1 do
          local off, len = cuts[p], cuts[p + 1] - cuts[p]
          local tag = ('%dx%d %s piece %d'):format(R, C, dt, p)
          local a = F.float8_amax_blockwise_piece(flat:narrow(1, off + 1, len), R, C, off)
          local ag = F.float8_amax_blockwise_piece(flatg:narrow(1, off + 1, len), R, C, off)
          same_values(ag, a, tag .. ' amax')
          grid = grid and vmax(grid, a) or a
          gridg = gridg and vmax(gridg, ag) or ag
        end
        for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
          for _, pow2 in ipairs({ false, true }) do
            local tag = ('%dx%d %s %s pow2=%s'):format(R, C, dt, name, tostring(pow2))
            local sc, inv, inv_t = F.float8_scales_blockwise(grid, name, { pow2 = pow2 })
            local scg, invg, inv_tg = F.float8_scales_blockwise(gridg, name, { pow2 = pow2 })
            same_values(scg, sc, tag .. ' scale')
            same_values(invg, inv, tag .. ' inv')
            same_values(inv_tg, inv_t, tag .. ' inv_t')
            -- the whole matrix's cast on the GPU: the same scales
            local r, _, ir, ic = F.float8_cast_blockwise(x:cuda(), name, { blocks = '128x128', cols = true, pow2 = pow2 })
            same_values(invg, ir, tag .. ' inv against the whole cast')
            same_values(inv_tg, ic, tag .. ' inv_t against the whole cast')
            local rf = r:view(R * C)
            for p = 1, #cuts - 1 do
              local off, len = cuts[p], cuts[p + 1] - cuts[p]
              local q = F.float8_cast_blockwise_piece(flat:narrow(1, off + 1, len), sc, R, C, off, name)
              local qg = F.float8_cast_blockwise_piece(flatg:narrow(1, off + 1, len), scg, R, C, off, name)
              same_values(qg, q, tag .. ' piece ' .. p)
              same_values(qg, rf:narrow(1, off + 1, len), tag .. ' piece ' .. p .. ' against the whole cast')
            end
          end
        end
      end
    end
  end)

  -- the many-piece forms (FSDP's precompute: kernels/float8.cu's
  -- blk_piece_many_kernel and blk_scales_many_kernel, a table of up to 128
  -- pieces a launch) against the CUDA per-piece ops and the CPU many-ops,
  -- byte for byte
  local function bytes(t)
    local ffi = require 'ffi'
    local c = t:to({ device = 'cpu', copy = true }):contiguous()
    local n = c:numel() * c:element_size()
    local p = n > 0 and ffi.cast('uint8_t *', c:data_ptr()) or nil
    local r = {}
    for i = 0, n - 1 do r[i + 1] = p[i] end
    return r
  end
  local function same_bytes(a, b, what)
    local x, y = bytes(a), bytes(b)
    assert.are.equal(#x, #y, what)
    for i = 1, #x do
      if x[i] ~= y[i] then error(('%s: byte %d is %d on cuda, %d in the reference'):format(what, i, x[i], y[i]), 2) end
    end
  end
  local function cdiv(a, b) return math.floor((a + b - 1) / b) end

  it('many blockwise pieces at once: the bytes of the CUDA per-piece ops and of the CPU (shapes and dtypes mixed in a launch, shards cutting blocks, empty pieces, 150 pieces: two launches, formats, pow2 mixed)', function()
    local shapes = { { 300, 200, 'f32' }, { 256, 384, 'bf16' }, { 130, 256, 'f64' }, { 128, 128, 'f16' },
      { 5, 7, 'bf16' }, { 1, 300, 'f32' }, { 257, 129, 'bf16' }, { 1000, 130, 'bf16' } }
    for i = 1, 142 do shapes[#shapes + 1] = { 1 + i % 9, 3 + i % 13, i % 2 == 0 and 'bf16' or 'f32' } end
    -- laid out one after the other (16-element starts), cut into 3 shards
    local ws, off = {}, 0
    for i, sh in ipairs(shapes) do
      local x = randn({ sh[1], sh[2] }, 10 ^ (i % 5 - 2), sh[3])
      ws[i] = { R = sh[1], C = sh[2], flat = x:contiguous():view(sh[1] * sh[2]), o = off }
      ws[i].flatg = ws[i].flat:cuda()
      off = cdiv(off + sh[1] * sh[2], 16) * 16
    end
    local W = 3
    local Sn = cdiv(off, W)
    local nb = 0
    for _, w in ipairs(ws) do w.slot = nb; nb = nb + cdiv(w.R, 128) * cdiv(w.C, 128) end
    local glob, globg = {}, {}
    local function vmax(p, q) return F.where(p:gt(q), p, q) end
    local pieces = {}
    for r = 0, W - 1 do
      local pc, pg = {}, {}
      for i, w in ipairs(ws) do
        local a, b = math.max(w.o, r * Sn), math.min(w.o + w.R * w.C, (r + 1) * Sn)
        if b > a then
          pc[i] = { x = w.flat:narrow(1, a - w.o + 1, b - a), R = w.R, C = w.C, offset = a - w.o }
          pg[i] = { x = w.flatg:narrow(1, a - w.o + 1, b - a), R = w.R, C = w.C, offset = a - w.o }
        else
          pc[i], pg[i] = { R = w.R, C = w.C, offset = 0 }, { R = w.R, C = w.C, offset = 0 }
        end
      end
      pieces[r] = { pc, pg }
      -- the grids: views of one vector, noise first
      local vec, vecg = ms.rand({ nb }, { seed = r }), ms.rand({ nb }, { seed = 9 + r }):cuda()
      local gc, gg = {}, {}
      for i, w in ipairs(ws) do
        local nbr, nbc = cdiv(w.R, 128), cdiv(w.C, 128)
        gc[i] = vec:narrow(1, w.slot + 1, nbr * nbc):view({ nbr, nbc })
        gg[i] = vecg:narrow(1, w.slot + 1, nbr * nbc):view({ nbr, nbc })
      end
      F.float8_amax_blockwise_many(pc, gc)
      F.float8_amax_blockwise_many(pg, gg)
      same_bytes(vecg, vec, ('rank %d: the grids against the CPU'):format(r))
      for i, p in ipairs(pg) do
        local one = F.float8_amax_blockwise_piece(p.x or ms.zeros({ 0 }):cuda(), p.R, p.C, p.offset)
        same_bytes(gg[i], one, ('rank %d weight %d against the per-piece op'):format(r, i))
        glob[i] = glob[i] and vmax(glob[i], gc[i]) or gc[i]:clone()
        globg[i] = globg[i] and vmax(globg[i], gg[i]) or gg[i]:clone()
      end
    end
    for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
      local p2, sc, scg, inv, invg, it, itg = {}, {}, {}, {}, {}, {}, {}
      for i, w in ipairs(ws) do
        local nbr, nbc = cdiv(w.R, 128), cdiv(w.C, 128)
        p2[i] = i % 3 == 0
        sc[i], scg[i] = ms.zeros({ nbr, nbc }), ms.rand({ nbr, nbc }, { seed = i }):cuda()
        inv[i], invg[i] = ms.zeros({ nbr, 4 * cdiv(nbc, 4) }), ms.rand({ nbr, 4 * cdiv(nbc, 4) }, { seed = i }):cuda()
        it[i], itg[i] = ms.zeros({ nbc, 4 * cdiv(nbr, 4) }), ms.rand({ nbc, 4 * cdiv(nbr, 4) }, { seed = i }):cuda()
      end
      F.float8_scales_blockwise_many(glob, name, { pow2 = p2, scale = sc, inv = inv, inv_t = it })
      F.float8_scales_blockwise_many(globg, name, { pow2 = p2, scale = scg, inv = invg, inv_t = itg })
      for i = 1, #ws do
        local tag = ('%s grid %d'):format(name, i)
        local s1, i1, t1 = F.float8_scales_blockwise(globg[i], name, { pow2 = p2[i] })
        same_bytes(scg[i], s1, tag .. ' scale'); same_bytes(scg[i], sc[i], tag .. ' scale, cpu')
        same_bytes(invg[i], i1, tag .. ' inv'); same_bytes(invg[i], inv[i], tag .. ' inv, cpu')
        same_bytes(itg[i], t1, tag .. ' inv_t'); same_bytes(itg[i], it[i], tag .. ' inv_t, cpu')
      end
      for r = 0, W - 1 do
        local pc, pg = pieces[r][1], pieces[r][2]
        local oc, og = {}, {}
        for i, p in ipairs(pc) do
          if p.x then
            oc[i] = ms.empty({ p.x:numel() }, { dtype = name })
            og[i] = ms.empty({ p.x:numel() }, { dtype = name, device = 'cuda' })
          end
        end
        F.float8_cast_blockwise_many(pc, sc, name, oc)
        F.float8_cast_blockwise_many(pg, scg, name, og)
        for i, p in ipairs(pg) do
          if p.x then
            local tag = ('%s rank %d weight %d'):format(name, r, i)
            same_bytes(og[i], F.float8_cast_blockwise_piece(p.x, scg[i], p.R, p.C, p.offset, name), tag)
            same_bytes(og[i], oc[i], tag .. ', cpu')
          end
        end
      end
    end
  end)

  -- the tensorwise forms (FSDP's precompute of the tensorwise weights:
  -- kernels/float8.cu's tw_amax_many_kernel and tw_cast_many_kernel, a
  -- block a 16384-element chunk) against the CUDA per-weight amax and
  -- float8_cast and the CPU many-ops, byte for byte
  it('many tensorwise pieces at once: the bytes of the CUDA amax / float8_cast and of the CPU (dtypes mixed, odd lengths, several chunks, unaligned sources and outputs, an empty piece, an absent one, all-equal values, 150 pieces: two launches, formats, pow2 mixed; inverse scales alone)', function()
    -- a flat bf16 source whose pieces start at odd elements (unaligned
    -- loads), beside pieces of their own of the other dtypes
    local flat = randn({ 90000 }, 2, 'bf16')
    local xs = { flat:narrow(1, 1, 50001), flat:narrow(1, 50004, 333), randn({ 7 }, 1e-3, 'f32'),
      ms.zeros({ 0 }, { dtype = 'bf16' }), false, randn({ 20001 }, 40, 'f64'), ms.full({ 77 }, -2.5, { dtype = 'bf16' }),
      randn({ 1 }, 1, 'f16'), randn({ 4099 }, 1e4, 'f32'), flat:narrow(1, 60000, 17000) }
    for i = 1, 140 do xs[#xs + 1] = randn({ 1 + (i * 37) % 301 }, 10 ^ (i % 5 - 2), i % 2 == 0 and 'bf16' or 'f32') end
    local n = #xs
    local xg = {}
    for i, x in ipairs(xs) do xg[i] = x and x:cuda() end
    local flatg = flat:cuda()
    xg[1], xg[2], xg[10] = flatg:narrow(1, 1, 50001), flatg:narrow(1, 50004, 333), flatg:narrow(1, 60000, 17000)
    local vec, vecg = ms.rand({ n }, { seed = 3 }), ms.rand({ n }, { seed = 4 }):cuda()
    local am, amg = {}, {}
    for i = 1, n do am[i], amg[i] = vec:narrow(1, i, 1):view({}), vecg:narrow(1, i, 1):view({}) end
    F.float8_amax_many(xs, am)
    F.float8_amax_many(xg, amg)
    same_bytes(vecg, vec, 'the amaxes against the CPU')
    for i = 1, n do
      same_bytes(amg[i], xg[i] and F.amax(xg[i]) or ms.zeros({}), 'amax ' .. i .. ' against amax')
    end
    -- (a third of them below the pieces' own: saturation)
    for i = 3, n, 3 do am[i], amg[i] = F.mul(am[i], 0.25), F.mul(amg[i], 0.25) end
    for _, name in ipairs({ 'f8e4m3', 'f8e5m2' }) do
      local p2 = {}
      for i = 1, n do p2[i] = i % 2 == 0 end
      -- the outputs: views of one byte buffer, every other at an odd byte
      local total = 0
      for _, x in ipairs(xs) do total = total + (x and x:numel() or 0) + 1 end
      local buf = ms.zeros({ total }):to(name)
      local bufg = F.mul(ms.rand({ total }, { seed = 5 }), 100):to(name):cuda()
      local out, outg, inv, invg, off = {}, {}, {}, {}, 1
      for i, x in ipairs(xs) do
        off = off + i % 2
        local m = x and x:numel() or 0
        if m > 0 then out[i], outg[i] = buf:narrow(1, off, m), bufg:narrow(1, off, m); off = off + m end
        inv[i], invg[i] = ms.zeros({ 1 }), ms.rand({ 1 }, { seed = i }):cuda()
      end
      F.float8_cast_many(xs, am, name, { pow2 = p2, out = out, inv = inv })
      F.float8_cast_many(xg, amg, name, { pow2 = p2, out = outg, inv = invg })
      for i = 1, n do
        local tag = ('%s piece %d'):format(name, i)
        local src = xg[i] and xg[i]:view({ 1, xg[i]:numel() }) or ms.zeros({ 0, 0 }):cuda()
        local w, _, wi = F.float8_cast(src, amg[i], name, { pow2 = p2[i] })
        if outg[i] then
          same_bytes(outg[i], w, tag .. ' against float8_cast')
          same_bytes(outg[i], out[i], tag .. ', cpu')
        end
        same_bytes(invg[i], wi, tag .. ' inv against float8_cast')
        same_bytes(invg[i], inv[i], tag .. ' inv, cpu')
      end
    end
    -- no element anywhere: the inverse scales alone
    local iv = { ms.zeros({ 1 }):cuda(), ms.zeros({ 1 }):cuda() }
    F.float8_cast_many({ false, ms.zeros({ 0 }):cuda() }, { amg[1], amg[3] }, 'f8e4m3', { inv = iv })
    same_bytes(iv[1], select(3, F.float8_cast(ms.zeros({ 0, 0 }):cuda(), amg[1], 'f8e4m3')), 'inv alone 1')
    same_bytes(iv[2], select(3, F.float8_cast(ms.zeros({ 0, 0 }):cuda(), amg[3], 'f8e4m3')), 'inv alone 2')
  end)

  it('copy_bytes_many_ (kernels/convert_many.cu): the CPU\'s bytes (aligned and not, longer than a block\'s chunk, 150 copies: two launches)', function()
    local src = { randn({ 50000 }, 1, 'bf16'), randn({ 3001 }), ms.rand({ 999 }):to('u8') }
    local dst = { randn({ 40000 }), randn({ 70001 }, 1, 'bf16') }
    local copies, at = {}, { 0, 0 }
    local function add(d, s, soff, n)
      copies[#copies + 1] = { dst[d], at[d], src[s], soff, n }
      at[d] = at[d] + n + (#copies % 3)
    end
    add(1, 1, 0, 64000)           -- (16-byte aligned both ends, several chunks)
    add(2, 1, 3, 33333)           -- (odd offsets)
    for i = 1, 148 do add(i % 2 + 1, i % 3 + 1, i, 5 + i) end
    local cg = {}
    for i, c in ipairs(copies) do
      cg[i] = { c[1]:cuda(), c[2], c[3]:cuda(), c[4], c[5] }
    end
    -- (a tensor's CUDA copy once: the same tensor in several copies)
    local seen = {}
    for i, c in ipairs(copies) do
      seen[c[1]] = seen[c[1]] or cg[i][1]; cg[i][1] = seen[c[1]]
      seen[c[3]] = seen[c[3]] or cg[i][3]; cg[i][3] = seen[c[3]]
    end
    F.copy_bytes_many_(copies)
    F.copy_bytes_many_(cg)
    for _, t in ipairs(dst) do same_bytes(seen[t], t, 'dst ' .. t.dtype) end
  end)

  it('scaled_matmul with block scales (cuBLASLt VEC128_32F / BLK128x128_32F) matches the CPU (each pair, bias, beta), or names what it cannot take', function()
    if not hopper() then
      local a, _, ai = F.float8_cast_blockwise(randn({ 128, 128 }):cuda(), 'f8e4m3')
      local e = S.errmsg(function() F.scaled_matmul(a, a, ai, ai, { a_blocks = '1x128', b_blocks = '1x128' }) end)
      assert.is_truthy(e:find('compute capability 9.x', 1, true), e)
      return
    end
    local worst = {}
    for _, sh in ipairs({ { 256, 512, 1024 }, { 128, 128, 128 }, { 48, 80, 256 }, { 1024, 2048, 4096 } }) do
      local M, N, K = sh[1], sh[2], sh[3]
      for _, pair in ipairs({ { '1x128', '128x128' }, { '1x128', '1x128' }, { '128x128', '1x128' } }) do
        local a, _, ai = F.float8_cast_blockwise(randn({ M, K }, 2), 'f8e4m3', { blocks = pair[1] })
        local b, _, bi = F.float8_cast_blockwise(randn({ N, K }, 0.05), 'f8e4m3', { blocks = pair[2] })
        local o = { a_blocks = pair[1], b_blocks = pair[2] }
        local ag, bg, aig, big = a:cuda(), b:cuda(), ai:cuda(), bi:cuda()
        local ref = F.scaled_matmul(a, b, ai, bi, { a_blocks = o.a_blocks, b_blocks = o.b_blocks, out_dtype = 'f32' })
        local key = pair[1] .. ' x ' .. pair[2]
        local e = relerr(F.scaled_matmul(ag, bg, aig, big, { a_blocks = o.a_blocks, b_blocks = o.b_blocks,
          out_dtype = 'f32' }), ref)
        worst[key] = math.max(worst[key] or 0, e)
        -- (each K block's partial sums are promoted into f32 with its scales)
        assert.is_true(e < 1e-3, ('%dx%dx%d %s: %.3g'):format(M, N, K, key, e))
        local eb = relerr(F.scaled_matmul(ag, bg, aig, big, { a_blocks = o.a_blocks, b_blocks = o.b_blocks }), ref)
        assert.is_true(eb < 1e-2, key .. ' bf16 out ' .. eb)
        local bias = randn({ N }, 1, 'bf16')
        local rb = F.scaled_matmul(a, b, ai, bi, { a_blocks = o.a_blocks, b_blocks = o.b_blocks, bias = bias })
        local gb = F.scaled_matmul(ag, bg, aig, big, { a_blocks = o.a_blocks, b_blocks = o.b_blocks, bias = bias:cuda() })
        assert.is_true(relerr(gb, rb) < 1e-2, key .. ' bias')
        local acc = randn({ M, N })
        local accg = acc:cuda()
        F.scaled_matmul(a, b, ai, bi, { a_blocks = o.a_blocks, b_blocks = o.b_blocks, out = acc, beta = 1 })
        F.scaled_matmul(ag, bg, aig, big, { a_blocks = o.a_blocks, b_blocks = o.b_blocks, out = accg, beta = 1 })
        assert.is_true(relerr(accg, acc) < 1e-3, key .. ' beta')
      end
    end
    for k, e in pairs(worst) do print(('\nscaled_matmul %s against the CPU, worst ||d||/||ref||: %.2e'):format(k, e)) end
    local a, _, ai = F.float8_cast_blockwise(randn({ 32, 192 }):cuda(), 'f8e4m3')
    local e = S.errmsg(function() F.scaled_matmul(a, a, ai, ai, { a_blocks = '1x128', b_blocks = '1x128' }) end)
    assert.is_truthy(e:find('K of 128', 1, true) and e:find('(32, 192) 1x128', 1, true), e)
  end)

  it('float8.linear blockwise matches the CPU (Linear and Conv1D, bias, bf16 autocast, f32 master); other token counts run the plain linear', function()
    if not hopper() then pending('cuBLASLt block scaling needs compute capability 9.x') return end
    for _, wt in ipairs({ true, false }) do
      local x = randn({ 4, 64, 256 })
      local w = wt and randn({ 384, 256 }, 0.05) or randn({ 256, 384 }, 0.05)
      local b = randn({ 384 }, 0.1)
      local g = randn({ 4, 64, 384 })
      local function run(dev)
        local function leaf(t) return t:to({ device = dev, copy = true }):requires_grad_() end
        local xx, ww, bb = leaf(x), leaf(w), leaf(b)
        local y = ms.nn.functional.autocast('bf16', function()
          return float8.linear(xx, ww, bb, { wt = wt, recipe = 'blockwise' })
        end)
        y:backward(g:to(dev):to('bf16'))
        return { y, xx.grad, ww.grad, bb.grad }
      end
      local c, r = run('cpu'), run('cuda')
      local e = {}
      for i = 1, 4 do e[i] = relerr(r[i], c[i]) end
      print(('\nfloat8.linear blockwise %s, cuda against cpu: y %.2e, dx %.2e, dw %.2e, db %.2e'):format(
        wt and 'Linear' or 'Conv1D', e[1], e[2], e[3], e[4]))
      assert.are.equal('bf16', r[1].dtype)
      assert.are.equal('f32', r[3].dtype)
      assert.is_true(e[1] < 1e-2 and e[2] < 1e-2 and e[4] < 1e-2, 'y, dx, db')
      assert.is_true(e[3] < 1e-3, 'dw')
    end
    local x = randn({ 3, 7, 128 }):cuda()
    local w = randn({ 128, 128 }, 0.1):cuda()
    assert.are.same(values(ms.nn.functional.linear(x, w)), values(float8.linear(x, w, nil, { recipe = 'blockwise' })))
  end)

  it('a tiny Llama (every projection 128-wide) converted blockwise trains on the GPU as on the CPU', function()
    if not hopper() then pending('cuBLASLt block scaling needs compute capability 9.x') return end
    local function losses(dev)
      ms.manual_seed(21)
      local m = require('models.llama').new('tiny', { intermediate_size = 256, num_key_value_heads = 4 }):to(dev)
      assert.are.equal(28, #float8.convert(m, { recipe = 'blockwise' }))
      local ids = (ms.rand({ 8, 65 }, { seed = 3 }) * 255):long():to(dev)
      return S.adamw_losses(m, ids:narrow(2, 1, 64):contiguous(), ids:narrow(2, 2, 64):contiguous(), 8, 2e-3)
    end
    local c, gl = losses('cpu'), losses('cuda')
    assert.is_true(gl[8] < gl[1] - 0.5, 'it trains')
    for k = 1, 8 do
      assert.is_true(math.abs(c[k] - gl[k]) < 0.02 * c[k], ('blockwise step %d: cuda %g, cpu %g'):format(k, gl[k], c[k]))
    end
  end)
end)
