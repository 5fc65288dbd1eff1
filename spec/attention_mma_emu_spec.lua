-- The mma.sync and wgmma attention kernels (kernels/attention_mma.cuh,
-- attention_wgmma.cuh) on any machine: kernels/attention_mma_emu.cpp
-- compiles them with g++, with the PTX wrappers (ldmatrix, mma.m16n8k16,
-- wgmma.mma_async through its descriptors and the 128-byte swizzle, cp.async
-- groups) replaced by CPU stand-ins of the same semantics, runs each block as
-- 128 fibers (ws: 384), and checks out, lse, dq, dk and dv against a double-precision
-- reference at head dims 64, 128 and 192, and q/k 192 with v 128 (DeepSeek's
-- MLA: v's width its own) (wgmma: 64, 128, q/k 192 with v 128, and the
-- forward at 192 with its backward on mma, as attention.cu runs them) with tile-straddling
-- lengths, Tq != Tk, GQA, (B, T, H, D) views, and the overlapped wgmma
-- forward (MS_ATTENTION_WG_FWD=ovl, ovlq) and the forward of two consumer
-- warpgroups and a producer (ws: 384-thread blocks, named barriers) at 128
-- and q/k 192 with v 128. Its
-- wgmma products run when waited for, reading shared memory then; a run
-- with --warps --eager lets each warp run ahead to its next block barrier
-- and cp.async land at once, so a missing barrier or wait shows. The GPU runs the real thing
-- in spec/gpu_attention_spec.lua (#gpu). The same emulator runs the grouped
-- GEMM of the experts (kernels/grouped_gemm.cuh, --gemm) against a double
-- reference; gpu_gemm_grouped_spec.lua runs it on the GPU.
local function sh(cmd)
  local rc = os.execute(cmd)
  return rc == 0 or rc == true
end

-- the emulator built once (g++), or nil when there is no g++
local bin
local function emulator()
  if bin then return bin end
  if not sh('command -v g++ >/dev/null 2>&1') then return nil end
  local b, log = os.tmpname(), os.tmpname()
  local ok = sh(('g++ -std=c++17 -O2 -Wall -Wno-unknown-pragmas -o %s kernels/attention_mma_emu.cpp > %s 2>&1')
    :format(b, log))
  local f = io.open(log)
  local out = f:read('*a')
  f:close()
  os.remove(log)
  assert.is_true(ok, 'g++ failed:\n' .. out)
  bin = b
  return bin
end

-- each flag set's output, asserting that it ends in '0 failed'
local function run(flag_sets)
  local outs = {}
  for _, flags in ipairs(flag_sets) do
    local p = io.popen(('%s %s 2>&1'):format(bin, flags))
    local out = p:read('*a')
    p:close()
    assert.is_truthy(out:match('\n0 failed\n$'), flags .. ':\n' .. out)
    outs[#outs + 1] = out
  end
  return outs
end

describe('mma.sync and wgmma attention kernels emulated on the CPU #noasan', function()
  teardown(function() if bin then os.remove(bin) end end)

  it('match the reference: out, lse, dq, dk, dv at head dims 64, 128, 192 and q/k 192 with v 128 (wgmma: 64, 128, '
    .. 'q/k 192 with v 128 or 192)',
    function()
    if not emulator() then
      pending('no g++')
      return
    end
    for _, out in ipairs(run({ '--quick', '--quick --reverse', '--quick --warps --eager --reverse' })) do
      -- every quick shape ran the (192, 128) kernels too, forward and backward
      local n = 0
      for _ in out:gmatch('ok   mma   D=192 Dv=128 ') do n = n + 1 end
      assert.are.equal(6, n, out)
      -- and the wgmma kernels at head dim 128, plain and with climbing maxima
      n = 0
      for _ in out:gmatch('ok   wgmma D=128 ') do n = n + 1 end
      assert.are.equal(12, n, out)
      -- and at q/k 192 with v 128 (forward, dq and 32-query dk/dv steps, with
      -- the fused Delta and the column sums), plain and with climbing maxima
      n = 0
      for _ in out:gmatch('ok   wgmma D=192 Dv=128 ') do n = n + 1 end
      assert.are.equal(12, n, out)
      -- and the forward at q/k/v 192 (its backward on the mma kernels)
      n = 0
      for _ in out:gmatch('ok   wgmma D=192 %[') do n = n + 1 end
      assert.are.equal(12, n, out)
      -- and the overlapped forward, Q from shared memory (ovl) or registers
      -- (ovlq), at 128 and at q/k 192 with v 128, plain and with climbing maxima
      for _, pat in ipairs({ 'ok   wgmma ovl D=128 ', 'ok   wgmma ovlq D=128 ', 'ok   wgmma ovl D=192 Dv=128 ',
        'ok   wgmma ovlq D=192 Dv=128 ' }) do
        n = 0
        for _ in out:gmatch(pat) do n = n + 1 end
        assert.are.equal(12, n, pat .. '\n' .. out)
      end
      -- and the forward of two consumer warpgroups and a producer, on the
      -- quick shapes, two longer ones (its three stages come round) and
      -- causal blocks with no key (Tq = 300, Tk = 40)
      for _, pat in ipairs({ 'ok   wgmma ws D=128 ', 'ok   wgmma ws D=192 Dv=128 ' }) do
        n = 0
        for _ in out:gmatch(pat) do n = n + 1 end
        assert.are.equal(18, n, pat .. '\n' .. out)
      end
    end
  end)

  it('the grouped GEMM (kernels/grouped_gemm.cuh): its three layouts, bf16 and f32 C, beta, empty groups, two launches', function()
    if not emulator() then
      pending('no g++')
      return
    end
    for _, out in ipairs(run({ '--gemm', '--gemm --reverse' })) do
      local n = 0
      for _ in out:gmatch('ok   grouped gemm') do n = n + 1 end
      assert.are.equal(21, n, out)
    end
  end)
end)
