-- The flash-style attention kernels (kernels/attention.cu) against the CPU
-- reference (core/attention_cpu.c): forward output, lse and dq/dk/dv on
-- random data, f32 ≤ 1e-5 and bf16/f16 ≤ 1e-2 relative, lse ≤ 1e-5, for
-- every implementation (wgmma, mma, wmma, simt: ms_cuda_attention_set_impl), head
-- dims 64 and 128 (and 32, which only wmma/simt take; 192, and q/k 192 with v
-- 128 (DeepSeek-V3's MLA), mma and wgmma only: at 192 wgmma's forward, the
-- backward on mma), lengths 1 to 1024
-- across the tile edges, causal or not, Tq != Tk (bottom-right causal, rows
-- that see no key), grouped-query heads and strided (B, T, H, D) views; and
-- the wgmma forwards (MS_ATTENTION_WG_FWD=ovl, base, ovlq: wgmma_ovl,
-- wgmma_base, wgmma_ovlq; plain wgmma runs the default, ws) at head dim 128
-- and q/k 192 with v 128.
local ms = require 'moonshard'
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local C = T.C

local function relerr(got, want)
  local g, w = got:to('cpu'):double(), want:to('cpu'):double()
  local d = g - w
  local num, den = (d * d):sum():item(), (w * w):sum():item()
  -- one visible key: the softmax is constant, dq and dk are exactly zero;
  -- then the error is the RMS of what came out
  if den == 0 then return math.sqrt(num / math.max(1, w:numel())) end
  return math.sqrt(num / den)
end

local function flat(t, acc)
  acc = acc or {}
  if type(t) ~= 'table' then acc[#acc + 1] = t return acc end
  for _, x in ipairs(t) do flat(x, acc) end
  return acc
end
-- lse: relative error over the finite entries; a row without keys must be
-- -inf in both
local function lse_err(got, want)
  local g, w = flat(got:to('cpu'):double():totable()), flat(want:to('cpu'):double():totable())
  local num, den = 0, 0
  for i = 1, #w do
    if w[i] == -math.huge or g[i] == -math.huge then
      if w[i] ~= g[i] then return math.huge end
    else
      num, den = num + (g[i] - w[i]) ^ 2, den + w[i] ^ 2
    end
  end
  return den > 0 and math.sqrt(num / den) or math.sqrt(num)
end

local box = ffi.typeof('ms_tensor*[1]')
local function attention(q, k, v, scale, causal)
  local o, l = box(), box()
  T.check(C.ms_attention(o, l, q, k, v, scale, causal and 1 or 0))
  return T.wrap(o[0]), T.wrap(l[0])
end
local function attention_backward(q, k, v, o, l, g, scale, causal)
  local a, b, c = box(), box(), box()
  T.check(C.ms_attention_backward(a, b, c, q, k, v, o, l, g, scale, causal and 1 or 0))
  return T.wrap(a[0]), T.wrap(b[0]), T.wrap(c[0])
end

-- mma1: mma with the one-pass backward (ms_cuda_attention_set_onepass);
-- wgmma1: wgmma with its one-pass backward (ms_cuda_attention_set_wg_onepass);
-- wgmma0: wgmma with the delta kernel (ms_cuda_attention_set_fused_delta(0);
-- plain wgmma computes Delta in its dq kernel); wgmma_ovl, wgmma_base,
-- wgmma_ovlq: wgmma with MS_ATTENTION_WG_FWD=ovl, base, ovlq (attention.cu
-- reads it at every call; at q/k 128 or 192 with v 128 the default is ws,
-- elsewhere fwd_kernel runs whatever it says)
local impl_ids = { mma = C.MS_ATTENTION_MMA, mma1 = C.MS_ATTENTION_MMA, wmma = C.MS_ATTENTION_WMMA,
  simt = C.MS_ATTENTION_SIMT, wgmma = C.MS_ATTENTION_WGMMA, wgmma1 = C.MS_ATTENTION_WGMMA,
  wgmma0 = C.MS_ATTENTION_WGMMA, wgmma_ovl = C.MS_ATTENTION_WGMMA, wgmma_base = C.MS_ATTENTION_WGMMA,
  wgmma_ovlq = C.MS_ATTENTION_WGMMA, auto = C.MS_ATTENTION_AUTO }
local wg_fwd_env = { wgmma_ovl = 'ovl', wgmma_base = 'base', wgmma_ovlq = 'ovlq' }
pcall(ffi.cdef, 'int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);')
-- MS_ATTENTION_WG_FWD set to value (nil: unset)
local function set_wg_fwd(value)
  if value then ffi.C.setenv('MS_ATTENTION_WG_FWD', value, 1) else ffi.C.unsetenv('MS_ATTENTION_WG_FWD') end
end
local impl_names = { [C.MS_ATTENTION_MMA] = 'mma', [C.MS_ATTENTION_WMMA] = 'wmma', [C.MS_ATTENTION_SIMT] = 'simt',
  [C.MS_ATTENTION_WGMMA] = 'wgmma' }
-- wgmma runs on Hopper (compute capability 9.x) only
local hopper = ms.cuda.is_available() and ms.cuda.get_device_capability(0) == 9
-- fn() with `impl` forced, back to auto afterwards even on error
local function with_impl(impl, fn)
  T.check(C.ms_cuda_attention_set_impl(impl_ids[impl]))
  local prev = C.ms_cuda_attention_set_onepass(impl == 'mma1' and 1 or 0)
  local prev_wg = C.ms_cuda_attention_set_wg_onepass(impl == 'wgmma1' and 1 or 0)
  local prev_fd = C.ms_cuda_attention_set_fused_delta(impl == 'wgmma0' and 0 or 1)
  local prev_fwd = os.getenv('MS_ATTENTION_WG_FWD')
  if wg_fwd_env[impl] then set_wg_fwd(wg_fwd_env[impl]) end
  local ok, err = pcall(fn)
  set_wg_fwd(prev_fwd)
  C.ms_cuda_attention_set_fused_delta(prev_fd)
  C.ms_cuda_attention_set_wg_onepass(prev_wg)
  C.ms_cuda_attention_set_onepass(prev)
  C.ms_cuda_attention_set_impl(C.MS_ATTENTION_AUTO)
  if not ok then error(err, 0) end
end
-- the (q/k, v) head widths the wgmma kernels take (attention.cu's wg_dims):
-- 64, 128, q/k 192 with v 128, and q/k/v 192 in the forward only
local function wg_dims(D, Dv, backward)
  return ((D == 64 or D == 128) and Dv == D) or (D == 192 and (Dv == 128 or (Dv == 192 and not backward)))
end
-- what wgmma runs by default (auto) on Hopper: every pair it takes
local wg_default = wg_dims
-- what a call with `impl` forced should run (falls back wgmma -> mma -> wmma
-- -> simt); Dv: v's head width (D when nil), backward: the backward's call
local function expected_impl(impl, dt, D, Dv, backward)
  Dv = Dv or D
  if dt == 'f32' or impl == 'simt' then return 'simt' end
  local wg = impl:match('^wgmma') ~= nil
  if wg and wg_dims(D, Dv, backward) and hopper then return 'wgmma' end
  if wg then impl = 'mma' end
  if (impl == 'mma' or impl == 'mma1') and (D == 64 or D == 128 or D == 192) then return 'mma' end
  if D == 16 or D == 32 or D == 64 or D == 128 then return 'wmma' end
  return 'simt'
end
local function last_impl() return impl_names[tonumber(C.ms_cuda_attention_last_impl())] end

local cases = {}
-- every length across the tile edges, both head dims, causal or not; GQA on
-- every other case
for _, D in ipairs({ 64, 128 }) do
  for _, Tn in ipairs({ 1, 17, 64, 130, 1024 }) do
    for _, causal in ipairs({ true, false }) do
      local gqa = #cases % 2 == 0
      cases[#cases + 1] = { B = Tn >= 1024 and 1 or 2, H = 2, Hkv = gqa and 1 or 2, Tq = Tn, Tk = Tn, D = D,
        causal = causal }
    end
  end
end
for _, c in ipairs({
  -- Tq != Tk: queries are the last Tq positions (decode-like), or Tq > Tk
  -- with causal rows that see no key (zero output, lse = -inf)
  { B = 1, H = 4, Hkv = 2, Tq = 20, Tk = 150, D = 64, causal = true },
  { B = 2, H = 2, Hkv = 2, Tq = 37, Tk = 91, D = 64, causal = false },
  { B = 1, H = 2, Hkv = 1, Tq = 150, Tk = 70, D = 64, causal = true },
  { B = 1, H = 2, Hkv = 2, Tq = 1, Tk = 130, D = 64, causal = true },
  { B = 1, H = 4, Hkv = 1, Tq = 70, Tk = 200, D = 128, causal = true },
  { B = 1, H = 2, Hkv = 2, Tq = 200, Tk = 70, D = 128, causal = false },
  { B = 1, H = 2, Hkv = 1, Tq = 200, Tk = 130, D = 128, causal = true },
  -- sharp: q times 1 + sharp and key t times 1 + sharp*t/64, so that rows'
  -- maxima climb far from tile to tile (the wgmma forward's rescaling of O
  -- runs, and is skipped, within a row)
  { B = 1, H = 2, Hkv = 1, Tq = 300, Tk = 300, D = 64, causal = true, sharp = 3 },
  { B = 1, H = 2, Hkv = 2, Tq = 90, Tk = 200, D = 64, causal = false, sharp = 3 },
  { B = 1, H = 2, Hkv = 1, Tq = 300, Tk = 300, D = 128, causal = true, sharp = 3 },
  -- the older set (head dim 32: wmma and simt only)
  { B = 2, H = 4, Hkv = 4, Tq = 100, Tk = 100, D = 64, causal = true },
  { B = 1, H = 8, Hkv = 2, Tq = 130, Tk = 130, D = 32, causal = true },
}) do cases[#cases + 1] = c end

-- the reference (f64, from the inputs rounded to dt) once per case and dtype;
-- its backward takes the reference output rounded to dt, as a kernel's is
-- (c.Dv: v's head width, c.D when not given)
local function reference(c, dt, seed)
  local Dv = c.Dv or c.D
  local q = ms.randn({ c.B, c.H, c.Tq, c.D }, { seed = seed }):to(dt)
  local k = ms.randn({ c.B, c.Hkv, c.Tk, c.D }, { seed = seed + 1 }):to(dt)
  local v = ms.randn({ c.B, c.Hkv, c.Tk, Dv }, { seed = seed + 2 }):to(dt)
  local g = ms.randn({ c.B, c.H, c.Tq, Dv }, { seed = seed + 3 }):to(dt)
  if c.sharp then
    local ramp = (ms.arange(c.Tk):double() * (c.sharp / 64) + 1):reshape({ 1, 1, c.Tk, 1 })
    q = (q:double() * (1 + c.sharp)):to(dt)
    k = (k:double() * ramp):to(dt)
  end
  local scale = 1 / math.sqrt(c.D)
  local o1, l1 = attention(q:double(), k:double(), v:double(), scale, c.causal)
  local dq1, dk1, dv1 = attention_backward(q:double(), k:double(), v:double(), o1:to(dt):double(), l1, g:double(),
    scale, c.causal)
  return { q = q, k = k, v = v, g = g, scale = scale, o = o1, l = l1, dq = dq1, dk = dk1, dv = dv1 }
end

local function check_case(c, dt, ref, impl)
  -- (f32 with sharp scores, up to ~60 in size: an f32 score's rounding
  -- error, 60 x 6e-8, reaches the exponentials; 1.7e-5 measured in simt)
  local bound = dt == 'f32' and (c.sharp and 1e-4 or 1e-5) or 1e-2
  local want = expected_impl(impl, dt, c.D, c.Dv)
  local qg, kg, vg = ref.q:cuda(), ref.k:cuda(), ref.v:cuda()
  local o2, l2
  with_impl(impl, function() o2, l2 = attention(qg, kg, vg, ref.scale, c.causal) end)
  assert.are.equal(want, last_impl(), 'forward ran ' .. tostring(last_impl()))
  want = expected_impl(impl, dt, c.D, c.Dv, true)
  assert.is_true(relerr(o2, ref.o) <= bound, 'out ' .. relerr(o2, ref.o))
  assert.is_true(lse_err(l2, ref.l) <= 1e-5, 'lse ' .. lse_err(l2, ref.l))
  local dq2, dk2, dv2
  with_impl(impl, function()
    dq2, dk2, dv2 = attention_backward(qg, kg, vg, o2, l2, ref.g:cuda(), ref.scale, c.causal)
  end)
  assert.are.equal(want, last_impl(), 'backward ran ' .. tostring(last_impl()))
  assert.is_true(relerr(dq2, ref.dq) <= bound, 'dq ' .. relerr(dq2, ref.dq))
  assert.is_true(relerr(dk2, ref.dk) <= bound, 'dk ' .. relerr(dk2, ref.dk))
  assert.is_true(relerr(dv2, ref.dv) <= bound, 'dv ' .. relerr(dv2, ref.dv))
end

-- cases only the mma and wgmma kernels take (head dim 192; q/k 192 with v
-- 128): mma, two-pass and one-pass, and wgmma (on Hopper: the forward at
-- both, the backward at (192, 128); else mma), with Delta in its dq kernel
-- and from the delta kernel, in bf16 and f16
local function check_wide(cs, seed)
  for _, c in ipairs(cs) do
    for _, dt in ipairs({ 'bf16', 'f16' }) do
      seed = seed + 10
      local ref = reference(c, dt, seed)
      check_case(c, dt, ref, 'mma')
      check_case(c, dt, ref, 'mma1')
      check_case(c, dt, ref, 'wgmma')
      check_case(c, dt, ref, 'wgmma0')
      check_case(c, dt, ref, 'wgmma_ovl')
      check_case(c, dt, ref, 'wgmma_base')
      check_case(c, dt, ref, 'wgmma_ovlq')
    end
  end
end

describe('fused attention on cuda #gpu', function()
  local seed = 900
  for n, c in ipairs(cases) do
    for _, dt in ipairs({ 'bf16', 'f16', 'f32' }) do
      local name = ('B=%d H=%d Hkv=%d Tq=%d Tk=%d D=%d%s%s'):format(c.B, c.H, c.Hkv, c.Tq, c.Tk, c.D,
        c.causal and ' causal' or '', c.sharp and ' sharp' or '')
      -- f32 runs simt whatever is asked: once, on the shorter cases
      local impls = dt == 'f32' and (c.Tq < 1024 and { 'simt' } or {}) or { 'wgmma', 'wgmma1', 'wgmma0', 'mma', 'mma1', 'wmma', 'simt' }
      -- (the other forwards at head dim 128 only here; 192 x 128 in check_wide)
      if dt ~= 'f32' and c.D == 128 then
        impls[#impls + 1] = 'wgmma_ovl'
        impls[#impls + 1] = 'wgmma_base'
        impls[#impls + 1] = 'wgmma_ovlq'
      end
      local ref
      seed = seed + 10
      local case_seed = seed
      for _, impl in ipairs(impls) do
        it(('case %d (%s) in %s with %s matches the CPU reference'):format(n, name, dt, impl), function()
          ref = ref or reference(c, dt, case_seed)
          check_case(c, dt, ref, impl)
        end)
      end
    end
  end

  for _, impl in ipairs({ 'wgmma', 'wgmma1', 'wgmma0', 'wgmma_ovl', 'wgmma_base', 'wgmma_ovlq', 'mma', 'wmma', 'simt' }) do
    it(('transposed (B, T, H, D) views work without copies and give the same result (%s)'):format(impl), function()
      for _, c in ipairs({ { 'f32', 32 }, { 'bf16', 32 }, { 'bf16', 64 }, { 'f16', 128 } }) do
        local dt, D = c[1], c[2]
        local x = ms.randn({ 2, 70, 3, 3 * D }, { seed = 77 }):to(dt):cuda()
        local q = x:narrow(4, 1, D):transpose(2, 3)
        local k = x:narrow(4, D + 1, D):transpose(2, 3)
        local v = x:narrow(4, 2 * D + 1, D):transpose(2, 3)
        local o1, o2
        with_impl(impl, function()
          o1 = attention(q, k, v, 0.2, true)
          assert.are.equal(expected_impl(impl, dt, D), last_impl())
          o2 = attention(q:contiguous(), k:contiguous(), v:contiguous(), 0.2, true)
        end)
        assert.is_true(relerr(o1, o2) <= 1e-7)
      end
    end)

    it(('takes q, k and v in different layouts (k contiguous, v a transposed view, GQA; %s)'):format(impl), function()
      for _, c in ipairs({ { dt = 'f32', D = 16, bound = 1e-5 }, { dt = 'bf16', D = 64, bound = 1e-2 },
        { dt = 'f16', D = 128, bound = 1e-2 } }) do
        local D = c.D
        local q = ms.randn({ 2, 32, 4, D }, { seed = 41 }):to(c.dt):transpose(2, 3)
        local k = ms.randn({ 2, 2, 32, D }, { seed = 42 }):to(c.dt)
        local v = ms.randn({ 2, 32, 2, D }, { seed = 43 }):to(c.dt):transpose(2, 3)
        local g = ms.randn({ 2, 4, 32, D }, { seed = 44 }):to(c.dt)
        local s = 1 / math.sqrt(D)
        local o1, l1 = attention(q:double(), k:double(), v:double(), s, true)
        local a1, b1, c1 = attention_backward(q:double(), k:double(), v:double(), o1:to(c.dt):double(), l1,
          g:double(), s, true)
        local o2, l2, a2, b2, c2
        with_impl(impl, function()
          o2, l2 = attention(q:cuda(), k:cuda(), v:cuda(), s, true)
          a2, b2, c2 = attention_backward(q:cuda(), k:cuda(), v:cuda(), o2, l2,
            g:cuda():transpose(3, 4):contiguous():transpose(3, 4), s, true)
        end)
        assert.is_true(relerr(o2, o1) <= c.bound, c.dt .. ' out ' .. relerr(o2, o1))
        assert.is_true(relerr(a2, a1) <= c.bound and relerr(b2, b1) <= c.bound and relerr(c2, c1) <= c.bound,
          ('%s dq %g dk %g dv %g'):format(c.dt, relerr(a2, a1), relerr(b2, b1), relerr(c2, c1)))
      end
    end)

    it(('is deterministic: the same gradients bit for bit (%s)'):format(impl), function()
      for _, dt in ipairs({ 'f32', 'bf16' }) do
        local q = ms.randn({ 1, 4, 200, 64 }, { seed = 5, device = 'cuda' }):to(dt)
        local k = ms.randn({ 1, 2, 200, 64 }, { seed = 6, device = 'cuda' }):to(dt)
        local v = ms.randn({ 1, 2, 200, 64 }, { seed = 7, device = 'cuda' }):to(dt)
        local g = ms.randn({ 1, 4, 200, 64 }, { seed = 8, device = 'cuda' }):to(dt)
        with_impl(impl, function()
          local o, l = attention(q, k, v, 0.125, true)
          local a1, b1, c1 = attention_backward(q, k, v, o, l, g, 0.125, true)
          local a2, b2, c2 = attention_backward(q, k, v, o, l, g, 0.125, true)
          assert.are.same(a1:to('cpu'):double():totable(), a2:to('cpu'):double():totable())
          assert.are.same(b1:to('cpu'):double():totable(), b2:to('cpu'):double():totable())
          assert.are.same(c1:to('cpu'):double():totable(), c2:to('cpu'):double():totable())
        end)
      end
    end)
  end

  it('refuses an MS_ATTENTION_WG_FWD it does not know, naming it, when the wgmma forward runs', function()
    if not hopper then
      pending('wgmma runs on compute capability 9.x only')
      return
    end
    local q = ms.randn({ 1, 2, 40, 128 }, { seed = 3, device = 'cuda' }):to('bf16')
    local prev = os.getenv('MS_ATTENTION_WG_FWD')
    set_wg_fwd('ovlx')
    local ok, err = pcall(with_impl, 'wgmma', function() return attention(q, q, q, 0.1, true) end)
    set_wg_fwd(prev)
    assert.is_false(ok)
    assert.matches('MS_ATTENTION_WG_FWD=ovlx: the wgmma forwards are base, ovl, ovlq and ws', tostring(err), 1, true)
  end)

  it('head dim 192 (DeepSeek-V3\'s q/k heads): mma, two-pass and one-pass, and wgmma (its forward) in bf16 and '
    .. 'f16 match the CPU reference across tile edges, causal or not, GQA, Tq ~= Tk, climbing maxima; f32, wmma '
    .. 'and simt are refused by name', function()
    check_wide({ { B = 1, H = 2, Hkv = 1, Tq = 130, Tk = 130, D = 192, causal = true },
      { B = 2, H = 2, Hkv = 2, Tq = 17, Tk = 17, D = 192, causal = false },
      { B = 1, H = 4, Hkv = 2, Tq = 20, Tk = 150, D = 192, causal = true },
      { B = 1, H = 2, Hkv = 2, Tq = 200, Tk = 70, D = 192, causal = false },
      { B = 1, H = 2, Hkv = 1, Tq = 1024, Tk = 1024, D = 192, causal = true },
      { B = 1, H = 2, Hkv = 1, Tq = 300, Tk = 300, D = 192, causal = true, sharp = 3 } }, 5000)
    local q = ms.randn({ 1, 2, 40, 192 }, { seed = 3, device = 'cuda' })
    local ok, err = pcall(attention, q, q, q, 0.1, true)
    assert.is_false(ok)
    assert.matches('no CUDA kernel takes q f32 (1,2,40,192)', tostring(err), 1, true)
    local qb = q:to('bf16')
    for _, impl in ipairs({ 'wmma', 'simt' }) do
      local ok2, err2 = pcall(with_impl, impl, function() return attention(qb, qb, qb, 0.1, true) end)
      assert.is_false(ok2)
      assert.matches('head dim 192 with v\'s 192 runs on the mma kernels only', tostring(err2), 1, true)
    end
  end)

  it('q/k 192 with v 128 (DeepSeek-V3\'s MLA): mma, two-pass and one-pass, and wgmma in bf16 and f16 match the '
    .. 'CPU reference across tile edges, causal or not, GQA, Tq ~= Tk, climbing maxima; f32, wmma, simt and other '
    .. 'pairs refused by name', function()
    check_wide({ { B = 1, H = 2, Hkv = 1, Tq = 130, Tk = 130, D = 192, Dv = 128, causal = true },
      { B = 2, H = 2, Hkv = 2, Tq = 17, Tk = 17, D = 192, Dv = 128, causal = false },
      { B = 1, H = 4, Hkv = 2, Tq = 20, Tk = 150, D = 192, Dv = 128, causal = true },
      { B = 1, H = 2, Hkv = 2, Tq = 200, Tk = 70, D = 192, Dv = 128, causal = false },
      { B = 1, H = 2, Hkv = 1, Tq = 1024, Tk = 1024, D = 192, Dv = 128, causal = true },
      { B = 1, H = 2, Hkv = 1, Tq = 300, Tk = 300, D = 192, Dv = 128, causal = true, sharp = 3 },
      { B = 1, H = 2, Hkv = 2, Tq = 90, Tk = 200, D = 192, Dv = 128, causal = false, sharp = 3 } }, 6000)
    -- (B, T, H, D) views of one projection, as MLAttention's v (a view of
    -- kv_b_proj's output), here at an odd offset: copied, not refused
    local kv = ms.randn({ 2, 70, 3, 1 + 128 + 128 }, { seed = 77 }):to('bf16'):cuda()
    local qv = ms.randn({ 2, 70, 3, 192 }, { seed = 78 }):to('bf16'):cuda():transpose(2, 3)
    local kk = ms.randn({ 2, 70, 3, 192 }, { seed = 79 }):to('bf16'):cuda():transpose(2, 3)
    local vv = kv:narrow(4, 130, 128):transpose(2, 3)
    local ov = attention(qv, kk, vv, 0.1, true)
    local oc = attention(qv:contiguous(), kk:contiguous(), vv:contiguous(), 0.1, true)
    assert.are.equal(0, relerr(ov, oc))
    local q = ms.randn({ 1, 2, 40, 192 }, { seed = 3, device = 'cuda' })
    local v = ms.randn({ 1, 2, 40, 128 }, { seed = 4, device = 'cuda' })
    local ok, err = pcall(attention, q, q, v, 0.1, true)
    assert.is_false(ok)
    assert.matches('no CUDA kernel takes q f32 (1,2,40,192) cuda:', tostring(err), 1, true)
    assert.matches('v f32 (1,2,40,128) cuda:', tostring(err), 1, true)
    local qb, vb = q:to('bf16'), v:to('bf16')
    for _, impl in ipairs({ 'wmma', 'simt' }) do
      local ok2, err2 = pcall(with_impl, impl, function() return attention(qb, qb, vb, 0.1, true) end)
      assert.is_false(ok2)
      assert.matches('head dim 192 with v\'s 128 runs on the mma kernels only', tostring(err2), 1, true)
    end
    -- a pair no kernel has (v 64 with q/k 192): refused, naming the shapes
    local ok3, err3 = pcall(attention, qb, qb, vb:narrow(4, 1, 64):contiguous(), 0.1, true)
    assert.is_false(ok3)
    assert.matches('v bf16 (1,2,40,64)', tostring(err3), 1, true)
    -- by default the (192, 128) pair runs wgmma on Hopper, else mma
    if not os.getenv('MS_ATTENTION_IMPL') and not os.getenv('MS_ATTENTION_SIMT') then
      attention(qb, qb, vb, 0.1, true)
      assert.are.equal(hopper and 'wgmma' or 'mma', last_impl())
    end
  end)

  it('gives the head widths its kernels run (D, Dv) at (nn.functional.attention_widths)', function()
    local nnf = require 'moonshard.nn.functional'
    local function widths(dt, D, Dv)
      local q = ms.empty({ 1, 1, 1, 1 }, { dtype = dt, device = 'cuda' })
      local a, b = nnf.attention_widths(q, D, Dv)
      return { a, b }
    end
    assert.are.same({ 192, 128 }, widths('bf16', 192, 128))
    assert.are.same({ 192, 128 }, widths('f16', 150, 100))
    assert.are.same({ 64, 64 }, widths('bf16', 64, 32))
    assert.are.same({ 192, 192 }, widths('bf16', 128, 192))
    assert.are.same({ 128, 128 }, widths('f32', 128, 96))
    assert.are.same({ 40, 40 }, widths('f32', 40, 40))
    local a, why = nnf.attention_widths(ms.empty({ 1 }, { dtype = 'f32', device = 'cuda' }), 192, 128)
    assert.is_nil(a)
    assert.matches('q/k head width 192 with v\'s 128 in f32', why, 1, true)
    assert.is_nil((nnf.attention_widths(ms.empty({ 1 }, { dtype = 'bf16', device = 'cuda' }), 256, 128)))
  end)

  it('scaled_dot_product_attention takes any widths on the GPU: the kernel, padded, or unfused, as the CPU', function()
    local nnf = require 'moonshard.nn.functional'
    -- (dtype, D, Dv, bound): (192, 128) on its kernel; 160/100 padded to it;
    -- 48/80 padded to 80; f32 at 192/128 unfused
    for i, c in ipairs({ { 'bf16', 192, 128, 1e-2 }, { 'bf16', 160, 100, 1e-2 }, { 'f16', 48, 80, 1e-2 },
      { 'f32', 192, 128, 1e-5 } }) do
      local dt, D, Dv, bound = c[1], c[2], c[3], c[4]
      local q = ms.randn({ 2, 4, 70, D }, { seed = 100 + i }):to(dt)
      local k = ms.randn({ 2, 2, 70, D }, { seed = 200 + i }):to(dt)
      local v = ms.randn({ 2, 2, 70, Dv }, { seed = 300 + i }):to(dt)
      local g = ms.randn({ 2, 4, 70, Dv }, { seed = 400 + i }):to(dt)
      local function run(dev, cast)
        local qq, kk, vv = q:to(dev):to(cast), k:to(dev):to(cast), v:to(dev):to(cast)
        for _, t in ipairs({ qq, kk, vv }) do t:requires_grad_() end
        local y = nnf.scaled_dot_product_attention(qq, kk, vv, { causal = true })
        ms.sum(y:double() * g:to(dev):double()):backward()
        return { y:detach(), qq.grad, kk.grad, vv.grad }
      end
      local want = run('cpu', 'f64')
      local got = run('cuda', dt)
      assert.are.same({ 2, 4, 70, Dv }, got[1].shape)
      for j, name in ipairs({ 'out', 'dq', 'dk', 'dv' }) do
        local e = relerr(got[j], want[j])
        assert.is_true(e <= bound, ('%s D %d Dv %d: %s %g'):format(dt, D, Dv, name, e))
      end
    end
  end)

  it('falls back from mma to wmma for rows that are not 16-byte aligned, with the same result', function()
    local x = ms.randn({ 2, 70, 3, 3 * 64 + 1 }, { seed = 78 }):to('bf16'):cuda()
    local q = x:narrow(4, 2, 64):transpose(2, 3)  -- odd element offset and strides
    local k = x:narrow(4, 66, 64):transpose(2, 3)
    local v = x:narrow(4, 130, 64):transpose(2, 3)
    local o1, o2
    with_impl('mma', function()
      o1 = attention(q, k, v, 0.2, true)
      assert.are.equal('wmma', last_impl())
      o2 = attention(q:contiguous(), k:contiguous(), v:contiguous(), 0.2, true)
      assert.are.equal('mma', last_impl())
    end)
    assert.is_true(relerr(o1, o2) <= 1e-2)
  end)

  it('runs wgmma (Hopper) or mma by default for bf16/f16 at head dims 64 and 128 (mma at q/k 192, wgmma there only '
    .. 'when asked for), and rejects an unknown implementation', function()
    -- (MS_ATTENTION_IMPL / MS_ATTENTION_SIMT in the environment change the default)
    local default = not os.getenv('MS_ATTENTION_IMPL') and not os.getenv('MS_ATTENTION_SIMT')
    for _, w in ipairs({ { 64, 64 }, { 128, 128 }, { 192, 128 }, { 192, 192 } }) do
      local D, Dv = w[1], w[2]
      for _, dt in ipairs({ 'bf16', 'f16' }) do
        local q = ms.randn({ 1, 2, 40, D }, { seed = 3, device = 'cuda' }):to(dt)
        local v = ms.randn({ 1, 2, 40, Dv }, { seed = 4, device = 'cuda' }):to(dt)
        local o, l = attention(q, q, v, 0.125, true)
        if default then assert.are.equal((hopper and wg_default(D, Dv)) and 'wgmma' or 'mma', last_impl()) end
        attention_backward(q, q, v, o, l, o, 0.125, true)
        if default then assert.are.equal((hopper and wg_default(D, Dv, true)) and 'wgmma' or 'mma', last_impl()) end
      end
    end
    local q = ms.randn({ 1, 2, 40, 32 }, { seed = 3, device = 'cuda' }):to('bf16')
    attention(q, q, q, 0.125, true)
    if default then assert.are.equal('wmma', last_impl()) end
    assert.are.equal(-1, C.ms_cuda_attention_set_impl(7))
    assert.are.equal(C.MS_ATTENTION_AUTO, C.ms_cuda_attention_get_impl())
  end)
end)

describe('nnf.qkv_attention on cuda #gpu', function()
  local nnf = require 'moonshard.nn.functional'
  -- the GPT-2 layout: q, k, v read in place from (B, T, 3*H*D), the output
  -- written (B, T, H, D), dq/dk/dv straight into one (B, T, 3*H*D) gradient
  for _, c in ipairs({ { dt = 'bf16', D = 64, bound = 1e-2 }, { dt = 'f16', D = 128, bound = 1e-2 },
    { dt = 'f32', D = 32, bound = 1e-5 } }) do
    it(('%s, head dim %d: output and dqkv match the CPU f64 reference'):format(c.dt, c.D), function()
      local B, Tn, H = 2, 130, 3
      local x = ms.randn({ B, Tn, 3 * H * c.D }, { seed = 41 }):to(c.dt)
      local g = ms.randn({ B, Tn, H * c.D }, { seed = 42 }):to(c.dt)
      local function run(dev, dt)
        local qkv = x:to({ dtype = dt, device = dev, copy = true }):requires_grad_()
        local y = nnf.qkv_attention(qkv, H)
        assert.is_true(y:is_contiguous())
        y:backward(g:to({ dtype = dt, device = dev }))
        return y:detach():double(), qkv.grad:double()
      end
      local y1, d1 = run('cpu', 'f64')
      local y2, d2 = run('cuda', c.dt)
      assert.is_true(relerr(y2, y1) <= c.bound, 'out ' .. relerr(y2, y1))
      assert.is_true(relerr(d2, d1) <= c.bound, 'dqkv ' .. relerr(d2, d1))
    end)
  end
end)

-- ms_attention_backward_sum: the column sums of dq, dk, dv as stored (a fused
-- qkv projection's bias gradient), from the wgmma kernels' epilogues on
-- Hopper at head dims 64 and 128 and q/k 192 with v 128 (at q/k/v 192 the
-- mma backward runs: not summed), against the sums of the kernels' own outputs
describe('attention_backward_sum on cuda #gpu', function()
  local function colsums(t)   -- (B, H, T, D) -> H*D f64 values, h major
    local x = t:to('cpu'):double():transpose(2, 3):contiguous()   -- (B, T, H, D)
    local s = x:sum(1):sum(1)                                      -- (H, D)... as (1, 1, H, D)
    return s:reshape({ -1 })
  end
  for _, c in ipairs({ { B = 2, H = 4, Hkv = 4, Tq = 200, Tk = 200, causal = true, D = 64 },
                       { B = 1, H = 4, Hkv = 2, Tq = 130, Tk = 130, causal = true, D = 64 },
                       { B = 2, H = 2, Hkv = 2, Tq = 37, Tk = 91, causal = false, D = 64 },
                       { B = 1, H = 4, Hkv = 2, Tq = 130, Tk = 130, causal = true, D = 128 },
                       { B = 2, H = 2, Hkv = 2, Tq = 37, Tk = 91, causal = false, D = 128 },
                       { B = 1, H = 4, Hkv = 2, Tq = 130, Tk = 130, causal = true, D = 192, Dv = 128 },
                       { B = 2, H = 2, Hkv = 2, Tq = 37, Tk = 91, causal = false, D = 192, Dv = 128 },
                       { B = 1, H = 2, Hkv = 1, Tq = 70, Tk = 70, causal = true, D = 192 } }) do
    local Dv = c.Dv or c.D
    it(('B=%d H=%d Hkv=%d Tq=%d Tk=%d D=%d Dv=%d: the sums of dq, dk, dv (1e-5 of the outputs\' own sums)%s'):format(
      c.B, c.H, c.Hkv, c.Tq, c.Tk, c.D, Dv, c.D == 192 and ', wgmma asked for' or ''), function()
      -- (at 192 wgmma runs only when asked for: asked for here)
      with_impl(c.D == 192 and 'wgmma' or 'auto', function()
      local D = c.D
      local q = ms.randn({ c.B, c.H, c.Tq, D }, { seed = 11 }):to('bf16'):cuda()
      local k = ms.randn({ c.B, c.Hkv, c.Tk, D }, { seed = 12 }):to('bf16'):cuda()
      local v = ms.randn({ c.B, c.Hkv, c.Tk, Dv }, { seed = 13 }):to('bf16'):cuda()
      local g = ms.randn({ c.B, c.H, c.Tq, Dv }, { seed = 14 }):to('bf16'):cuda()
      local scale = 1 / math.sqrt(D)
      local o, l = attention(q, k, v, scale, c.causal)
      local a, b, cc = box(), box(), box()
      local ds = ms.empty({ (c.H + c.Hkv) * D + c.Hkv * Dv }, { dtype = 'f32', device = 'cuda' })
      ds:fill_(0 / 0)
      local r = C.ms_attention_backward_sum(a, b, cc, q, k, v, o, l, g, scale, c.causal and 1 or 0, ds)
      assert.is_true(r >= 0, ffi.string(C.ms_last_error()))
      local dq, dk, dv = T.wrap(a[0]), T.wrap(b[0]), T.wrap(cc[0])
      if not (hopper and wg_dims(D, Dv, true)) then
        assert.are.equal(0, r)   -- only the wgmma kernels sum them
        return
      end
      assert.are.equal(1, r)
      local want = ms.cat({ colsums(dq), colsums(dk), colsums(dv) }, 1)
      local e = relerr(ds, want)
      assert.is_true(e <= 1e-5, ('column sums: relative error %.3g'):format(e))
      end)
    end)
  end
end)

-- moonshard.cp's block merge on CUDA against the CPU reference
-- (core/attention_cpu.c) on random data: f32 accumulators, f32/bf16/f16
-- blocks, strided views, rows with -inf; the block's gradient share in
-- each dtype (bf16/f16 within one rounding, 1e-2)
describe('attention block merge on cuda #gpu', function()
  local box = ffi.typeof('ms_tensor*[1]')
  for _, dt in ipairs({ 'f32', 'bf16', 'f16' }) do
    it('merge and block gradient match the CPU (' .. dt .. ')', function()
      ms.manual_seed(77)
      local acc = ms.randn({ 2, 37, 3, 64 }):transpose(2, 3)       -- strided, as the ring's rows
      local al = ms.randn({ 2, 3, 37 })
      local o = ms.randn({ 2, 3, 37, 64 }):to(dt)
      local l = ms.randn({ 2, 3, 37 })
      al:narrow(2, 1, 1):narrow(3, 5, 1):fill_(-math.huge)
      local ga, gl = acc:cuda(), al:cuda()
      for _, first in ipairs({ 1, 0 }) do
        local ca, cl = acc:clone(), al:clone()
        local xa, xl = ga:clone(), gl:clone()
        T.check(C.ms_attention_merge_(ca, cl, o, l, first))
        T.check(C.ms_attention_merge_(xa, xl, o:cuda(), l:cuda(), first))
        assert.is_true(relerr(xa, ca) <= 1e-5, ('merge %s first=%d: %.3g'):format(dt, first, relerr(xa, ca)))
        assert.is_true(lse_err(xl, cl) <= 1e-5)
      end
      local g = ms.randn({ 2, 37, 3, 64 }):to(dt):transpose(2, 3)
      local b1, b2 = box(), box()
      T.check(C.ms_attention_block_grad(b1, g, l, al:clone():fill_(0.25), T.dtype_id(dt)))
      T.check(C.ms_attention_block_grad(b2, g:cuda(), l:cuda(), al:cuda():fill_(0.25), T.dtype_id(dt)))
      local e = relerr(T.wrap(b2[0]), T.wrap(b1[0]))
      assert.is_true(e <= (dt == 'f32' and 1e-5 or 1e-2), ('block grad %s: %.3g'):format(dt, e))
    end)
  end
end)
