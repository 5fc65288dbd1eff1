-- ops.gemm_grouped_ (core/gemm_grouped.c): many GEMMs in one call, the
-- experts' products of a mixture-of-experts layer. On the CPU each group is
-- gemm_, so this checks the call's rules: every layout against gemm_ a
-- group, beta, empty groups, and the errors. The CUDA kernel is run on the
-- CPU by the emulator (attention_mma_emu_spec.lua, --gemm) and on the GPU
-- by gpu_gemm_grouped_spec.lua (#gpu).
local ms = require 'moonshard'
local F = require 'moonshard.ops'
local S = require 'spec.support'

local seed = 7100
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed }):to(dtype or 'f32')
end

describe('ops.gemm_grouped_', function()
  for _, tr in ipairs({ { false, true }, { false, false }, { true, false }, { true, true } }) do
    for _, beta in ipairs({ 0, 1 }) do
      it(('transa %s, transb %s, beta %d: each group as gemm_, rows from 0 to 37'):format(
        tostring(tr[1]), tostring(tr[2]), beta), function()
        local N = 24
        local ms_, ks = { 5, 0, 37, 1 }, { 16, 9, 3, 40 }
        local outs, as, bs, want = {}, {}, {}, {}
        for g = 1, #ms_ do
          local M, K = ms_[g], ks[g]
          as[g] = randn(tr[1] and { K, M } or { M, K })
          bs[g] = randn(tr[2] and { N, K } or { K, N })
          outs[g] = randn({ M, N })
          want[g] = outs[g]:clone()
          F.gemm_(want[g], as[g], bs[g], tr[1], tr[2], 1, beta)
        end
        assert.are.equal(outs, F.gemm_grouped_(outs, as, bs, tr[1], tr[2], beta))
        for g = 1, #ms_ do
          assert.are.same(want[g].shape, outs[g].shape)
          if ms_[g] > 0 then
            assert.is_true(S.relerr(outs[g], want[g]) < 1e-6, 'group ' .. g)
            assert.is_true(want[g]:abs():max():item() > 0)
          end
        end
      end)
    end
  end

  it('an empty inner dimension: zeros with beta 0, untouched with beta 1', function()
    local a, b = ms.empty({ 0, 6 }), ms.empty({ 0, 4 })   -- transa: (6 x 0) . (0 x 4)
    local c = randn({ 6, 4 })
    local c0 = c:clone()
    F.gemm_grouped_({ c }, { a }, { b }, true, false, 1)
    assert.are.same(c0:totable(), c:totable())
    F.gemm_grouped_({ c }, { a }, { b }, true, false, 0)
    assert.are.equal(0, c:abs():max():item())
  end)

  it('bf16 operands with an f32 out, as the experts\' weight gradients', function()
    local a, b = randn({ 33, 16 }, 'bf16'), randn({ 33, 24 }, 'bf16')
    local c = ms.empty({ 16, 24 })
    F.gemm_grouped_({ c }, { a }, { b }, true, false)
    assert.is_true(S.relerr(c, F.matmul(a:to('f32'), b:to('f32'), true, false)) < 1e-6)
  end)

  it('errors name the group and the shapes; beta other than 0 or 1 and uneven lists are refused', function()
    local a, b = randn({ 4, 8 }), randn({ 8, 3 })
    local e = S.errmsg(function() F.gemm_grouped_({ ms.empty({ 4, 3 }), ms.empty({ 4, 3 }) }, { a, randn({ 4, 7 }) },
      { b, b }, false, false) end)
    assert.is_truthy(e:find('group 1 of 2', 1, true), e)
    assert.is_truthy(e:find('7', 1, true), e)
    e = S.errmsg(function() F.gemm_grouped_({ ms.empty({ 4, 3 }) }, { a }, { b }, false, false, 0.5) end)
    assert.is_truthy(e:find('beta must be 0 or 1', 1, true), e)
    e = S.errmsg(function() F.gemm_grouped_({ ms.empty({ 4, 3 }) }, { a, a }, { b }, false, false) end)
    assert.is_truthy(e:find('1 outs, 2 as and 1 bs', 1, true), e)
    e = S.errmsg(function() F.gemm_grouped_({ ms.empty({ 4, 3 }) }, { a }, { 3 }, false, false) end)
    assert.is_truthy(e:find('bs[1]', 1, true), e)
  end)

  it('gemm_grouped_kernel switches and reports the CUDA path', function()
    local was = F.gemm_grouped_kernel()
    assert.are.equal('auto', was)
    assert.are.equal('auto', F.gemm_grouped_kernel('loop'))
    assert.are.equal('loop', F.gemm_grouped_kernel('mma'))
    assert.are.equal('mma', F.gemm_grouped_kernel('kernel'))
    assert.are.equal('kernel', F.gemm_grouped_kernel())
    local e = S.errmsg(function() F.gemm_grouped_kernel(true) end)
    assert.is_truthy(e:find("'auto', 'kernel', 'mma' or 'loop', got true", 1, true), e)
    F.gemm_grouped_kernel(was)
    assert.are.equal('auto', F.gemm_grouped_kernel())
  end)
end)
