-- bench/comm_interference.lua — does communication slow the GEMMs beside it?
--
--   bin/train --nproc-per-node 2 --device cuda bench/comm_interference.lua [--work gemm|norm]
--
-- One measurement: 13 times, a communication op issued on its own stream and
-- then 15 GEMMs of 32768 x 3072 x 768 (GPT-2's MLP, B=32) on the compute
-- stream; it reads the GEMM stream's time (CUDA events). Rank 0 prints the
-- median of 7 measurements of each mode (the modes interleaved, after one
-- warm-up each) against 'none'. Modes: none; nccl (a
-- reduce-scatter of 7.3M f32, a GPT-2 block's gradient, as FSDP issues after
-- each unit's backward); ce (a copy-engine gather of the same bytes,
-- dist.copy_register); add (two adds of a shard-sized f32 tensor on a side
-- stream, what a copy-engine reduce-scatter would add); ce+add.
-- The data are meaningless (no fences): only the GEMMs' time is read.
-- --work norm: instead of the GEMMs, 4 backwards of GPT-2's residual add +
-- LayerNorm (32768 x 768, ~0.15 ms each: a memory-bound kernel whose grid
-- is two blocks an SM, one wave) after each op, to see whether kernels
-- sized to the SM count lose more to NCCL's blocks than the GEMMs do.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local F = ms.raw
ms.dist.init { backend = 'nccl' }
local rank, world = ms.dist.rank(), ms.dist.world_size()
local work = 'gemm'
for i = 1, #arg - 1 do if arg[i] == '--work' then work = arg[i + 1] end end
assert(work == 'gemm' or work == 'norm', 'bench/comm_interference.lua: --work gemm|norm')
local a = ms.randn({ 32768, 768 }, { device = 'cuda', seed = 1 }):bf16()
local w = ms.randn({ 3072, 768 }, { device = 'cuda', seed = 2 }):bf16()
local n = 7 * 2 ^ 20
local src = ms.randn({ n }, { device = 'cuda' })
local out = ms.empty({ n / world }, { device = 'cuda' })
local half = ms.randn({ n / world }, { device = 'cuda' })
local acc = ms.randn({ n / world }, { device = 'cuda' })
local reg = ms.dist.copy_register(half)
assert(reg, 'no copy-engine registration')
local gout = ms.empty({ n }, { device = 'cuda' })
local side = ms.cuda.stream()
local e0, e1 = ms.cuda.event({ timing = true }), ms.cuda.event({ timing = true })
local function gemms(k) for _ = 1, k do local y = F.matmul(a, w, false, true); y:free() end end
local nx, ng, ngres, nw, nb = ms.randn({ 32768, 768 }, { device = 'cuda', seed = 3 }),
  ms.randn({ 32768, 768 }, { device = 'cuda', seed = 4 }):bf16(), ms.randn({ 32768, 768 }, { device = 'cuda', seed = 5 }),
  ms.randn({ 768 }, { device = 'cuda', seed = 6 }), ms.randn({ 768 }, { device = 'cuda', seed = 7 })
local _, nmean, nrstd = F.native_layer_norm(nx, nw, nb, 1e-5, 'bf16')
local function norms(k)
  for _ = 1, k do
    local dx, dw, db, dxl, dls = F.native_layer_norm_backward_add(ng, nx, nmean, nrstd, nw, ngres,
      { dxl = true, dxl_sum = true })
    for _, v in ipairs({ dx, dw, db, dxl, dls }) do v:free() end
  end
end
local function run(mode)
  ms.dist.barrier()
  ms.cuda.synchronize()
  local works = {}
  e0:record()
  for _ = 1, 13 do
    if mode == 'nccl' then
      works[#works + 1] = ms.dist.reduce_scatter(out, src, 'sum', { async = true })
    elseif mode == 'ce' or mode == 'ce+add' then
      works[#works + 1] = reg:gather_into(gout)
    end
    if mode == 'add' or mode == 'ce+add' then
      ms.cuda.with_stream(side, function() F.add_(acc, half); F.add_(acc, half) end)
    end
    if work == 'gemm' then gemms(15) else norms(4) end
  end
  e1:record()
  e1:synchronize()
  for _, wk in ipairs(works) do wk:wait(); wk:free() end
  ms.cuda.synchronize()
  return e0:elapsed_ms(e1)
end
local modes = { 'none', 'nccl', 'ce', 'add', 'ce+add' }
local res = {}
for _, m in ipairs(modes) do res[m] = {}; run(m) end
for _ = 1, 7 do for _, m in ipairs(modes) do table.insert(res[m], run(m)) end end
local function med(t) table.sort(t); return t[math.floor((#t + 1) / 2)] end
if rank == 0 then
  local base = med(res.none)
  for _, m in ipairs(modes) do
    local v = med(res[m])
    print(('%-7s ' .. work .. ' stream %.2f ms (+%.3f ms, +%.3f ms per op)'):format(m, v, v - base, (v - base) / 13))
  end
end
