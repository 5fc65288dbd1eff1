-- bench/cp.lua — ring attention (moonshard.cp, docs/cp.md) against the
-- whole sequence's attention on one GPU.
--
--   bin/train --nproc-per-node N --device cuda bench/cp.lua [--batch 1] [--seq 8192] [--heads 32]
--             [--kv-heads 8] [--dim 64] [--iters 20] [--warmup 3] [--contiguous]
--
-- Every rank first times the fused attention kernel over the whole of
-- --batch sequences of --seq tokens (causal, bf16, the Llama 1.25B's heads
-- by default), forward and forward + backward, alone; then the N ranks
-- time cp.attention over the same sequences split N ways (each rank its
-- --seq / N tokens in load-balanced chunks, or contiguous ones). Ideal ring
-- time = whole time / N; the efficiency printed is that over the ring's.
-- Also printed: one ring step's key/value exchange alone (a dist.batch_p2p
-- of the packed message), and the host's wall time to issue the ring's
-- forward + backward (no sync inside).
-- Time: CUDA events around each call, median of --iters, after --warmup;
-- the backward is the autograd backward from a fixed gradient of the
-- output, minus the forward. q, k, v are (B, H, T, D) views of (B, T, H, D)
-- tensors, as the models make them.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'

local opts = { batch = 1, seq = 8192, heads = 32, ['kv-heads'] = 8, dim = 64, iters = 20, warmup = 3 }
local flags = { contiguous = false }
do
  local i = 1
  while i <= #arg do
    local k = arg[i]:match('^%-%-(.+)$')
    if k and flags[k] ~= nil then flags[k] = true; i = i + 1
    elseif k and opts[k] ~= nil then opts[k] = tonumber(arg[i + 1]); i = i + 2
    else error('usage: bench/cp.lua [--batch B] [--seq T] [--heads H] [--kv-heads Hkv] [--dim D] [--iters N] '
      .. '[--warmup N] [--contiguous]; got ' .. tostring(arg[i])) end
  end
end
assert(ms.cuda.is_available(), 'bench/cp.lua needs a CUDA device')
ms.dist.init { backend = 'nccl' }
local N, rank = ms.dist.world_size(), ms.dist.rank()
local function say(...) if rank == 0 then print(string.format(...)) end; io.stdout:flush() end

local B, Tn, H, Hkv, D = opts.batch, opts.seq, opts.heads, opts['kv-heads'], opts.dim
-- (B, H, T, D) views of (B, T, H, D) buffers, as the models' projections give them
local function heads(h, seed)
  ms.manual_seed(seed)
  return ms.randn({ B, Tn, h, D }, { device = 'cuda' }):to('bf16'):transpose(2, 3)
end
local qd, kd, vd, gy = heads(H, 1), heads(Hkv, 2), heads(Hkv, 3), heads(H, 4)
local q, k, v = qd:detach():requires_grad_(true), kd:detach():requires_grad_(true), vd:detach():requires_grad_(true)

local function median(t)
  table.sort(t)
  return t[math.floor((#t + 1) / 2)]
end

-- ms of fn(), CUDA events, median (every rank in step: a barrier first)
local e0, e1 = ms.cuda.event { timing = true }, ms.cuda.event { timing = true }
local function time(fn)
  local ts = {}
  for i = 1, opts.warmup + opts.iters do
    ms.cuda.synchronize()
    ms.dist.barrier()
    e0:record()
    fn()
    e1:record()
    e1:synchronize()
    if i > opts.warmup then ts[#ts + 1] = e0:elapsed_ms(e1) end
    collectgarbage()
  end
  return median(ts)
end

local function zero() for _, t in ipairs({ q, k, v }) do t:zero_grad() end end

-- the whole sequences on this GPU
local nnf = ms.nn.functional
local whole_f = time(function() ms.no_grad(function() nnf.scaled_dot_product_attention(qd, kd, vd, { causal = true }) end) end)
local whole_fb = time(function()
  zero()
  nnf.scaled_dot_product_attention(q, k, v, { causal = true }):backward(gy)
end)

-- the ring: this rank's tokens
local ctx = ms.cp.context(nil, { load_balance = not flags.contiguous })
local function mine(t) return ms.cp.shard(t, ctx, 3):transpose(2, 3):contiguous():transpose(2, 3) end
local ql, kl, vl, gl = mine(qd), mine(kd), mine(vd), mine(gy)
for _, t in ipairs({ ql, kl, vl }) do t:requires_grad_(true) end
local ring_f = time(function() ms.no_grad(function() ms.cp.attention(ql, kl, vl, ctx) end) end)
local ring_fb = time(function()
  for _, t in ipairs({ ql, kl, vl }) do t:zero_grad() end
  ms.cp.attention(ql, kl, vl, ctx):backward(gl)
end)

-- one ring step's key/value exchange alone (the packed message each step sends)
local kvbuf = ms.empty({ 2, B, Hkv, Tn / N, D }, { dtype = 'bf16', device = 'cuda' })
local kvin = ms.empty({ 2, B, Hkv, Tn / N, D }, { dtype = 'bf16', device = 'cuda' })
local nxt, prv = (rank + 1) % N, (rank - 1 + N) % N
local xchg = time(function()
  ms.dist.batch_p2p({ { 'send', kvbuf, nxt }, { 'recv', kvin, prv } })
end)
-- the host's wall time to issue a forward + backward (no sync inside;
-- the GPU still busy with the previous ones, so this is the issue path)
local ffi = require 'ffi'
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } ms_cpb_timespec;
int ms_cpb_clock_gettime(int clk, ms_cpb_timespec *t) asm("clock_gettime");
]]
local tsp = ffi.new('ms_cpb_timespec')
local function now()
  ffi.C.ms_cpb_clock_gettime(1, tsp)
  return tonumber(tsp.tv_sec) + tonumber(tsp.tv_nsec) * 1e-9
end
local hs = {}
for _ = 1, 7 do
  ms.cuda.synchronize()
  local t0 = now()
  for _, t in ipairs({ ql, kl, vl }) do t:zero_grad() end
  ms.cp.attention(ql, kl, vl, ctx):backward(gl)
  hs[#hs + 1] = (now() - t0) * 1e3
end
local host_fb = median(hs)
ms.cuda.synchronize()

-- the slowest rank's
local function slowest(x)
  local t = ms.tensor({ x }, { dtype = 'f32', device = 'cuda' })
  ms.dist.all_reduce(t, 'max')
  return t:item()
end
ring_f, ring_fb = slowest(ring_f), slowest(ring_fb)

say('ring attention over %d GPUs (%s), B %d, T %d, heads %d / %d kv, D %d, bf16, causal',
  N, flags.contiguous and 'contiguous chunks' or 'load-balanced chunks', B, Tn, H, Hkv, D)
say('| | forward ms | backward ms | forward + backward ms |')
say('|---|---|---|---|')
say('| whole sequence, one GPU | %.3f | %.3f | %.3f |', whole_f, whole_fb - whole_f, whole_fb)
say('| whole / %d (ideal) | %.3f | %.3f | %.3f |', N, whole_f / N, (whole_fb - whole_f) / N, whole_fb / N)
say('| ring, %d GPUs (slowest rank) | %.3f | %.3f | %.3f |', N, ring_f, ring_fb - ring_f, ring_fb)
say('efficiency (ideal / ring): forward %.1f%%, forward + backward %.1f%%', 100 * whole_f / N / ring_f,
  100 * whole_fb / N / ring_fb)
say('one key/value exchange alone: %.3f ms (%d MiB each way, %.0f GB/s); host wall time to issue the ring\'s forward + '
  .. 'backward (median of 7): %.3f ms', xchg, kvbuf:numel() * 2 / 2 ^ 20, kvbuf:numel() * 2 / xchg / 1e6, host_fb)
ms.dist.destroy()
