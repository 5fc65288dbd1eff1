-- bench/gpt2_124m.lua — GPT-2 124M training throughput on one GPU.
--
--   luajit bench/gpt2_124m.lua [--batch 32] [--seq 1024] [--dtype bf16|bf16-master|bf16-pure|f32]
--                              [--steps 30] [--warmup 5] [--ac none|full|op|N]
--
-- --ac checkpoints the blocks' activations (nn.apply_activation_checkpointing:
-- every block, or every N-th; op: every block, keeping its attention
-- outputs and every other linear product, docs/nn.md): the forward of those
-- blocks runs again in backward. Model TFLOP/s and MFU count the model's flops only (6·N plus
-- attention per token), not the recompute, as llm.c and torchtitan do.
--
-- --dtype bf16 (the default) is mixed precision: f32 master weights and f32
-- AdamW state, the model's forward in a bf16 autocast region
-- (nn.functional.set_precision, docs/precision.md). bf16-master is the same
-- arithmetic with the Linear/Conv1D weights stored in bf16 and their f32
-- masters in AdamW (set_precision's weights = 'bf16', AdamW's
-- master_weights): no weight casts forward, no gradient casts backward, the
-- same losses step for step (spec/amp_spec.lua). bf16-pure is the whole
-- model in bf16 (weights, grads, activations; AdamW moments still f32);
-- f32 is f32 throughout.
--
-- The model of models/gpt2.lua (12 layers, 12 heads, 768 wide, vocab 50304,
-- T=1024, tied embeddings), random tokens, AdamW. Prints tokens/s (median of
-- the timed steps), model TFLOP/s (6·N·tokens plus attention's
-- 6·L·T·C per token, llm.c's count) and MFU against the bf16 matmul rate
-- measured here with the production GEMM, and the allocator's peak memory.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ffi = require 'ffi'
local ms = require 'moonshard'
local gpt2 = require 'models.gpt2'

local opts = { batch = 32, seq = 1024, dtype = 'bf16', steps = 30, warmup = 5, ablate = 0, phases = 0,
  variants = 'all', ['ablate-steps'] = 10, ac = 'none' }
local i = 1
while i <= #arg do
  local k = arg[i]:match('^%-%-(.+)$')
  if not k or opts[k] == nil then error('usage: bench/gpt2_124m.lua [--batch N] [--seq T] [--dtype bf16|bf16-master|bf16-pure|f32] [--steps N] [--warmup N] [--ablate R] [--variants 1,2,..] [--ablate-steps N] [--phases 0|1] [--ac none|full|op|N]') end
  opts[k] = tonumber(arg[i + 1]) or arg[i + 1]
  i = i + 2
end
if opts.dtype ~= 'bf16' and opts.dtype ~= 'bf16-master' and opts.dtype ~= 'bf16-pure' and opts.dtype ~= 'f32' then
  error(('bench/gpt2_124m.lua: --dtype must be bf16, bf16-master, bf16-pure or f32, got %s'):format(tostring(opts.dtype)))
end

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } ms_bench_timespec;
int clock_gettime(int clk, ms_bench_timespec *ts);
]]
local ts = ffi.new('ms_bench_timespec')
local function now()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

assert(ms.cuda.is_available(), 'bench/gpt2_124m.lua needs a CUDA device')
local dev = ms.cuda.get_device_name(0)

-- the measured bf16 matmul ceiling, through the same GEMM the model uses
local function matmul_rate()
  local n = 8192
  local a = ms.randn({ n, n }, { seed = 1, device = 'cuda' }):bf16()
  local b = ms.randn({ n, n }, { seed = 2, device = 'cuda' }):bf16()
  local c = ms.matmul(a, b)
  ms.cuda.synchronize()
  local reps = 20
  local t0 = now()
  for _ = 1, reps do c = ms.matmul(a, b) end
  ms.cuda.synchronize()
  local dt = (now() - t0) / reps
  return 2 * n ^ 3 / dt / 1e12
end
local peak = matmul_rate()

ms.manual_seed(0)
-- no dropout, as ../shared/bench/torch_gpt2.py
local model = gpt2.new('gpt2-124m', { vocab_size = 50304, n_positions = opts.seq,
                                      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0 })
local nparams = 0
for _, p in model:named_parameters() do nparams = nparams + p:numel() end
model:to('cuda')
if opts.dtype == 'bf16-pure' then model:to('bf16')
elseif opts.dtype == 'bf16' then ms.nn.functional.set_precision(model, { compute = 'bf16' })
elseif opts.dtype == 'bf16-master' then ms.nn.functional.set_precision(model, { compute = 'bf16', weights = 'bf16' }) end
model:train()
local ac_blocks = 0
if opts.ac ~= 'none' then
  local every = (opts.ac == 'full' or opts.ac == 'op') and 1 or tonumber(opts.ac)
  assert(every and every >= 1, 'bench/gpt2_124m.lua: --ac must be none, full, op or N >= 1')
  ac_blocks = #ms.nn.apply_activation_checkpointing(model, { class = 'GPT2Block', every = every,
    policy = opts.ac == 'op' and 'op' or nil })
end
local opt = ms.optim.AdamW(model, { lr = 6e-4, betas = { 0.9, 0.95 }, weight_decay = 0.1,
                                    master_weights = opts.dtype == 'bf16-master' })

local B, Tn = opts.batch, opts.seq
local ids = (ms.rand({ B, Tn }, { seed = 3, device = 'cuda' }) * 50257):long()
local tg = (ms.rand({ B, Tn }, { seed = 4, device = 'cuda' }) * 50257):long()

ms.cuda.reset_peak_memory_stats()
local loss
-- the median step time of `opts.steps` steps after `opts.warmup`
-- (and the host syncs a timed step made: copies between host and device
-- that blocked the host, ms.cuda.memory_stats().num_host_syncs; should be 0)
local host_syncs, mallocs = 0, 0
-- clip_grad_norm's coefficient applied by AdamW's step (defer; --ablate 1 turns it off)
local defer_clip = true
local function measure(nsteps, nwarm)
  nsteps, nwarm = nsteps or opts.steps, nwarm or opts.warmup
  local times = {}
  host_syncs, mallocs = 0, 0
  for step = 1, nwarm + nsteps do
    ms.cuda.synchronize()
    local st0 = ms.cuda.memory_stats()
    local s0, a0 = st0.num_host_syncs, st0.num_mallocs
    local t0 = now()
    opt:zero_grad()
    loss = model(ids, tg)
    loss:backward()
    -- as torch_gpt2.py (no host read); the coefficient applied by AdamW's step
    ms.optim.clip_grad_norm(model, 1.0, { tensor = true, defer = defer_clip and opt or nil })
    opt:step()
    ms.cuda.synchronize()
    if step > nwarm then
      times[#times + 1] = now() - t0
      local st1 = ms.cuda.memory_stats()
      host_syncs = host_syncs + st1.num_host_syncs - s0
      mallocs = mallocs + st1.num_mallocs - a0
    end
  end
  host_syncs, mallocs = host_syncs / nsteps, mallocs / nsteps
  table.sort(times)
  return times[math.floor((#times + 1) / 2)]
end
local med = measure()
local tokens = B * Tn
local cfg = model.config
local flops_per_token = 6 * nparams + 6 * cfg.n_layer * Tn * cfg.n_embd
local tflops = flops_per_token * tokens / med / 1e12
local st = ms.cuda.memory_stats()
print(('device: %s'):format(dev))
local precision = ({ bf16 = 'bf16 compute, f32 master weights',
  ['bf16-master'] = 'bf16 compute, bf16 weights with f32 masters in AdamW', ['bf16-pure'] = 'bf16 weights and compute',
  f32 = 'f32' })[opts.dtype]
print(('GPT-2 124M (%d params), B=%d T=%d %s, AdamW%s'):format(nparams, B, Tn, precision,
  ac_blocks > 0 and (', activation checkpointing of %d of %d blocks'):format(ac_blocks, cfg.n_layer) or ''))
print(('| tokens/s | step ms | model TFLOP/s | MFU (vs %.0f TFLOP/s bf16 matmul) | peak allocated GiB | peak reserved GiB | loss |'):format(peak))
print('|---|---|---|---|---|---|---|')
print(('| %.0f | %.1f | %.1f | %.1f%% | %.2f | %.2f | %.3f |'):format(tokens / med, med * 1e3, tflops,
  100 * tflops / peak, st.peak_allocated / 2 ^ 30, st.peak_reserved / 2 ^ 30, loss:item()))
print(('host syncs in a timed step: %g; cudaMalloc calls: %g'):format(host_syncs, mallocs))
do
  local ts = ms.cuda.gemm_tune_stats()
  print(('GEMM tuning (%s): %d plans timed, %d of them not on the heuristic\'s first, %.0f ms of host time, %d from the tuning file'):format(
    ms.cuda.gemm_tune() and 'on' or 'off', ts.tuned, ts.moved, ts.host_ms, ts.from_file))
end

-- --phases 1: where a step's time goes between host and GPU: CUDA events at
-- the phase boundaries (GPU time of forward, backward, clip + optimizer)
-- beside the host's time to issue each phase; a phase whose GPU time is
-- about its host time is bound by the host's issue rate
if opts.phases == 1 then
  local ev = {}
  for k = 1, 4 do ev[k] = ms.cuda.event({ timing = true }) end
  local gpu, host, wall = { 0, 0, 0 }, { 0, 0, 0 }, 0
  local n = 10
  for _ = 1, n do
    ms.cuda.synchronize()
    local t = { now() }
    ev[1]:record()
    opt:zero_grad()
    loss = model(ids, tg)
    ev[2]:record(); t[2] = now()
    loss:backward()
    ev[3]:record(); t[3] = now()
    ms.optim.clip_grad_norm(model, 1.0, { tensor = true, defer = defer_clip and opt or nil })
    opt:step()
    ev[4]:record(); t[4] = now()
    ms.cuda.synchronize()
    wall = wall + now() - t[1]
    for k = 1, 3 do
      gpu[k] = gpu[k] + ev[k]:elapsed_ms(ev[k + 1])
      host[k] = host[k] + (t[k + 1] - t[k]) * 1e3
    end
  end
  print('')
  print('| phase | GPU ms (events) | host issue ms |')
  print('|---|---|---|')
  for k, name in ipairs({ 'forward + loss', 'backward', 'clip + AdamW' }) do
    print(('| %s | %.1f | %.1f |'):format(name, gpu[k] / n, host[k] / n))
  end
  print(('| step (wall, synced) | %.1f | |'):format(wall / n * 1e3))
end

-- --ablate R: the same training continued with one switch flipped at a
-- time (the rows below; --variants "1,6" picks some), each measured in R
-- interleaved pairs (default, then the variant: --ablate-steps steps after 3
-- warm-up steps each), so that drifts of the clock during the run fall on
-- both sides; "vs default" is the median of the pairs' ratios (the
-- default's ms over the variant's), with the pairs' lowest and highest, and
-- the peak is the variant's allocator peak
if opts.ablate >= 1 then
  local C = require('moonshard.tensor').C
  local pick
  if opts.variants ~= 'all' then
    pick = {}
    for n in tostring(opts.variants):gmatch('%d+') do pick[tonumber(n)] = true end
  end
  print('')
  print(('%d interleaved pairs of %d steps a variant'):format(opts.ablate, opts['ablate-steps']))
  print('| # | variant | default ms | variant ms | vs default (median) | lowest | highest | peak allocated GiB |')
  print('|---|---|---|---|---|---|---|---|')
  -- the LM loss's chunk budget for the variant, back to the default after
  local function lm_budget(bytes)
    local flce, prev = require('moonshard.flce'), nil
    return function(on)
      if on then prev = flce.set_lm_loss_budget(bytes) else flce.set_lm_loss_budget(prev) end
    end
  end
  for vi, v in ipairs({
    { 'cuBLASLt epilogues off', function(on) return C.ms_cuda_gemm_set_epilogue(on and 0 or -1) end },
    { 'cuBLASLt DGELU epilogue on too', function(on) return C.ms_cuda_gemm_set_epilogue(on and C.MS_GEMM_EPI_ALL or -1) end },
    { 'one-pass attention backward (mma.sync path only)', function(on) return C.ms_cuda_attention_set_onepass(on and 1 or 0) end },
    { 'clip as a pass over the gradients', function(on) defer_clip = not on end },
    { 'bias gradients by BGRAD (no norm sums)', function(on) require('moonshard.nn.functional').set_norm_bias_sum(not on) end },
    { "c_attn's bias gradient by BGRAD (default: from the attention backward)", function(on)
      require('moonshard.nn.functional').set_attention_bias_sum(not on) end },
    { "LM loss chunks of 512 MiB of logits (lm_loss's default: 1 GiB)", lm_budget(2 ^ 29) },
    { 'LM loss chunks of 2 GiB of logits', lm_budget(2 ^ 31) },
    { 'FLCE row pass with 4 packs in flight (default here: 1, the row cached)', function(on) C.ms_cuda_flce_set_row_unroll(on and 4 or 0) end },
    { 'one-pass wgmma attention backward', function(on) C.ms_cuda_attention_set_wg_onepass(on and 1 or 0) end },
    { "GEMM tuning off (cuBLASLt heuristic's first)", function(on) ms.cuda.gemm_tune(not on) end },
    { 'attention Delta by its own kernel (default: in the wgmma dq kernel)', function(on)
      C.ms_cuda_attention_set_fused_delta(on and 0 or 1) end },
  }) do
    if not pick or pick[vi] then
      local da, va, ra, peak_v = {}, {}, {}, 0
      for _ = 1, opts.ablate do
        local a = measure(opts['ablate-steps'], 3)
        ms.cuda.reset_peak_memory_stats()
        v[2](true)
        local b = measure(opts['ablate-steps'], 3)
        peak_v = math.max(peak_v, ms.cuda.memory_stats().peak_allocated / 2 ^ 30)
        v[2](false)
        da[#da + 1], va[#va + 1], ra[#ra + 1] = a, b, a / b
      end
      local function median(t)
        local c = {}
        for i2, x in ipairs(t) do c[i2] = x end
        table.sort(c)
        local n = #c
        return n % 2 == 1 and c[(n + 1) / 2] or (c[n / 2] + c[n / 2 + 1]) / 2
      end
      local lo, hi = math.huge, -math.huge
      for _, r in ipairs(ra) do lo, hi = math.min(lo, r), math.max(hi, r) end
      print(('| %d | %s | %.2f | %.2f | %.3f | %.3f | %.3f | %.2f |'):format(vi, v[1], median(da) * 1e3,
        median(va) * 1e3, median(ra), lo, hi, peak_v))
    end
  end
end
