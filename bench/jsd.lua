-- bench/jsd.lua — the fused linear JSD (nn.functional.fused_linear_jsd),
-- forward + backward, on one GPU, beside bench/torch_jsd.py (PyTorch eager
-- and torch.compile of TRL's generalized JSD on materialised logits).
--
--   luajit bench/jsd.lua [--iters 10] [--warmup 2] [--shapes 8192x2048x4096x128256] [--beta 0.5]
--                        [--temperature 1] [--budget 0]
--
-- A shape is BT x Hs x Ht x V: the student's hidden states xs (BT, Hs) and
-- head Ws (V, Hs), both bf16 requiring grad; the teacher's xt (BT, Ht) and
-- Wt (V, Ht), bf16 constants (the default: a Llama-3.2-1B student under a
-- Llama-3.1-8B teacher, 8192 tokens). Values ~ N(0, 1) for the hidden
-- states, N(0, 0.02) for the heads; labels uniform, none ignored. Time:
-- CUDA events around loss = f(...); loss:backward() with the grads cleared
-- before, the median of --iters after --warmup, L2 flushed before each
-- (bench/common.lua). Memory: the peak of one step above what is allocated
-- once the inputs exist. Floor: the four GEMMs' 2·BT·V·(3·Hs + Ht) flops
-- (student logits, teacher logits, grad_xs, grad_Ws) at the bf16 matmul
-- rate measured here (8192³). --budget MiB sets the chunk's memory budget
-- (0: the function's 1 GiB).
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local B = require 'bench.common'
local F = ms.raw

local opts = B.parse_args({ iters = 10, warmup = 2, shapes = '8192x2048x4096x128256', beta = 0.5, temperature = 1,
  budget = 0 }, 'usage: luajit bench/jsd.lua [--iters N] [--warmup N] [--shapes BTxHsxHtxV,...] [--beta B] '
  .. '[--temperature T] [--budget MiB]')
assert(ms.cuda.is_available(), 'bench/jsd.lua needs a CUDA device')
local timed = B.timer(opts)
local JSD = ms.nn.functional.fused_linear_jsd

local function matmul_rate()
  local n = 8192
  local a = ms.randn({ n, n }, { seed = 11, device = 'cuda' }):bf16()
  local b = ms.randn({ n, n }, { seed = 12, device = 'cuda' }):bf16()
  local out = ms.empty({ n, n }, { dtype = 'bf16', device = 'cuda' })
  local t = B.timer({ iters = 20, warmup = 5 })(function() F.gemm_(out, a, b, false, false, 1, 0) end)
  a:free(); b:free(); out:free()
  return 2 * n ^ 3 / (t * 1e-3) / 1e12
end

local rate = matmul_rate()
print(('device: %s; bf16 matmul %.0f TFLOP/s; beta %g, temperature %g'):format(ms.cuda.get_device_name(0), rate,
  opts.beta, opts.temperature))
print('| BT x Hs x Ht x V | ms (fwd+bwd) | x floor | floor ms | peak above inputs GiB | loss |')
print('|---|---|---|---|---|---|')
for shape in tostring(opts.shapes):gmatch('[^,]+') do
  local BT, Hs, Ht, V = shape:match('^(%d+)x(%d+)x(%d+)x(%d+)$')
  BT, Hs, Ht, V = tonumber(BT), tonumber(Hs), tonumber(Ht), tonumber(V)
  assert(BT, 'bench/jsd.lua: a shape is BTxHsxHtxV, got ' .. shape)
  local xs = ms.randn({ BT, Hs }, { seed = 1, device = 'cuda' }):bf16():requires_grad_()
  local Ws = (ms.randn({ V, Hs }, { seed = 2, device = 'cuda' }) * 0.02):bf16():requires_grad_()
  local xt = ms.randn({ BT, Ht }, { seed = 3, device = 'cuda' }):bf16()
  local Wt = (ms.randn({ V, Ht }, { seed = 4, device = 'cuda' }) * 0.02):bf16()
  local labels = (ms.rand({ BT }, { seed = 5, device = 'cuda' }) * (V - 1)):long()
  local o = { beta = opts.beta, temperature = opts.temperature, labels = labels,
    memory_budget = opts.budget > 0 and opts.budget * 2 ^ 20 or nil }
  local loss_v
  local function step()
    xs.grad, Ws.grad = nil, nil
    local loss = JSD(xs, Ws, xt, Wt, o)
    loss:backward()
    loss_v = loss
  end
  step()
  xs.grad, Ws.grad = nil, nil
  loss_v = nil
  for _ = 1, 3 do collectgarbage() end
  ms.cuda.synchronize()
  local base = ms.cuda.memory_stats().allocated
  ms.cuda.reset_peak_memory_stats()
  step()
  ms.cuda.synchronize()
  local peak = (ms.cuda.memory_stats().peak_allocated - base) / 2 ^ 30
  local t = timed(step)
  local floor = 2 * BT * V * (3 * Hs + Ht) / (rate * 1e12) * 1e3
  print(('| %s | %.2f | %.3f | %.2f | %.2f | %.5f |'):format(shape, t, t / floor, floor, peak, loss_v:item()))
  xs, Ws, xt, Wt, labels, loss_v = nil, nil, nil, nil, nil, nil
  for _ = 1, 3 do collectgarbage() end
end
