-- bench/moe.lua — a mixture-of-experts layer's forward + backward on the
-- GPU (nn.MoE, docs/moe.md) beside the dense SwiGLU MLP of the same
-- FLOPs a token (hidden = top_k x the expert's), under bf16 autocast with
-- f32 weights: median ms (CUDA events), the experts' GEMM TFLOP/s, and the
-- routing's share (the MoE's time over the dense MLP's).
--
--   luajit bench/moe.lua [--tokens 8192] [--dim 2048] [--iters 20] [--warmup 3]
-- Cases: 8 experts of 1408, top-2 (Mixtral's shape, scaled); 64 experts
-- of 352, top-8 (fine-grained, as Qwen3-MoE and DeepSeek); 16 of 704,
-- top-4.
local ms = require 'moonshard'
local B = require 'bench.common'
local nn = ms.nn

local opts = B.parse_args({ tokens = 8192, dim = 2048, iters = 20, warmup = 3 },
  'usage: luajit bench/moe.lua [--tokens N] [--dim H] [--iters N] [--warmup N]')
assert(ms.cuda.is_available(), 'bench/moe.lua: no CUDA device')
local timed = B.timer(opts)
local N, H = opts.tokens, opts.dim

local function step_time(m, x, g)
  local params = m:parameters()
  return timed(function()
    local y = nn.functional.autocast('bf16', function() return m(x) end)
    y:backward(g)
    for _, p in ipairs(params) do p.grad = nil end
  end)
end

print(('| experts | top-k | expert hidden | tokens | H | MoE ms | dense ms (hidden %s) | MoE / dense | expert GEMM TFLOP/s |')
  :format('k x'))
print('|---|---|---|---|---|---|---|---|---|')
for _, c in ipairs({ { 8, 2, 1408 }, { 16, 4, 704 }, { 64, 8, 352 } }) do
  local E, k, I = c[1], c[2], c[3]
  ms.manual_seed(1)
  local m = nn.MoE { dim = H, hidden = I, experts = E, top_k = k }
  for _, p in ipairs(m:parameters()) do ms.normal_(p, 0, 0.02) end
  m:to('cuda')
  local d = nn.GatedMLP { dim = H, hidden = k * I }
  for _, p in ipairs(d:parameters()) do ms.normal_(p, 0, 0.02) end
  d:to('cuda')
  local x = ms.randn({ N, H }, { seed = 3 }):cuda():requires_grad_()
  local g = ms.randn({ N, H }, { seed = 4 }):cuda():to('bf16')
  local tm = step_time(m, x, g)
  local td = step_time(d, x, g)
  -- forward + backward of the experts' three GEMMs a slot: 3 x 2 x 3 x H x I flops
  local flops = 18 * N * k * H * I
  print(('| %d | %d | %d | %d | %d | %.2f | %.2f | %.2f | %.0f |'):format(E, k, I, N, H, tm, td, tm / td,
    flops / (tm * 1e-3) / 1e12))
  m:to('cpu'); d:to('cpu')
  collectgarbage(); collectgarbage()
end
