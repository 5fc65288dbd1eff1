-- bench/checkpoint.lua — what a checkpoint costs the training, written at
-- once (checkpoint.save) and in the background (checkpoint.save_async,
-- bin/train --async-checkpoint; docs/checkpoints.md):
--
--   luajit bench/checkpoint.lua --device cuda                 the 1.25B Llama, f32 weights + AdamW
--   luajit bench/checkpoint.lua --device cuda --layers 4      a smaller one
--   luajit bench/checkpoint.lua --device cpu --layers 2 --hidden 256 --vocab 4096
--
-- Options: --device cuda|cpu, --layers (16), --hidden (2048), --vocab
-- (128256), --seq (1024) and --batch (1) of the training steps, --steps
-- (steps timed without a save: 10), --out (a folder on the disk to measure:
-- /tmp/ms-bench-ckpt; emptied before and after).
--
-- The model is bench/fsdp.lua's Llama (hidden 2048, 16 layers, 32 heads /
-- 8 kv, MLP 2.75x, vocab 128256 untied) in f32 with AdamW's two moments:
-- 12 bytes a parameter. Prints: the checkpoint's size; a synchronous save
-- (the step stands still for all of it); the background saves: the staging
-- copy (the first one allocates the page-locked buffers, the second reuses
-- them), how long the thread took to write the files, and the training
-- steps that ran meanwhile, against the same steps with no save (the
-- steps' median; the host's copy and the disk compete with nothing on the
-- GPU, so the difference is what the writer costs the steps).
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local ckpt = require 'moonshard.checkpoint'
local B = require 'bench.common'

local opts = B.parse_args({ device = 'cuda', layers = 16, hidden = 2048, vocab = 128256, seq = 1024, batch = 1,
  steps = 10, out = '/tmp/ms-bench-ckpt' },
  'usage: luajit bench/checkpoint.lua [--device cuda|cpu] [--layers N] [--hidden N] [--vocab N] [--seq T] '
  .. '[--batch B] [--steps N] [--out DIR]')
local on_gpu = opts.device ~= 'cpu'
if on_gpu and not ms.cuda.is_available() then error('bench/checkpoint.lua: no CUDA device (--device cpu?)') end
local function sync() if on_gpu then ms.cuda.synchronize() end end
local function now() return ms.clock and ms.clock() or os.clock() end
do
  local ffi = require 'ffi'
  pcall(ffi.cdef, 'typedef struct { long tv_sec; long tv_nsec; } ms_bench_ts; int clock_gettime(int, ms_bench_ts *);')
  local ts = ffi.new('ms_bench_ts')
  now = function() ffi.C.clock_gettime(1, ts); return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9 end
end

local M = require 'models.llama'
local H = opts.hidden
local heads = math.max(1, math.floor(H / 64))
ms.manual_seed(1)
local model = M.new({ vocab_size = opts.vocab, hidden_size = H, intermediate_size = math.floor(H * 2.75),
  num_hidden_layers = opts.layers, num_attention_heads = heads, num_key_value_heads = math.min(8, heads),
  max_position_embeddings = opts.seq, rope_parameters = { rope_type = 'default', rope_theta = 500000.0 },
  tie_word_embeddings = false, rms_norm_eps = 1e-5 })
if on_gpu then model:to('cuda') end
local opt = ms.optim.AdamW(model, { lr = 1e-5 })
local nparams = 0
for _, p in model:named_parameters() do nparams = nparams + p:numel() end

local x = (ms.rand({ opts.batch, opts.seq + 1 }, { seed = 7, device = on_gpu and 'cuda' or 'cpu' }) * (opts.vocab - 1)):long()
local inp, tgt = x:narrow(2, 1, opts.seq):contiguous(), x:narrow(2, 2, opts.seq):contiguous()
local function step()
  opt:zero_grad()
  local loss = require('moonshard.amp').autocast(on_gpu and 'bf16' or false, model, inp, tgt)
  loss:backward()
  opt:step()
  local v = loss:item()
  loss:free()
  return v
end
-- timed steps (median ms), each run with `during()` called after it (the
-- loop's step boundary); stops early when during() says so
local function steps(n, during)
  local ts = {}
  for k = 1, n do
    sync()
    local t0 = now()
    step()
    sync()
    ts[k] = (now() - t0) * 1e3
    if during and during(k) then break end
  end
  local c = {}
  for i, t in ipairs(ts) do c[i] = t end
  return B.median(c), #ts
end

os.execute("rm -rf '" .. opts.out .. "' && mkdir -p '" .. opts.out .. "'")
step(); step()   -- moments, kernels, plans
local base = steps(opts.steps)

local parts = { model = model, optimizer = opt, state = { note = 'bench' } }
local t0 = now()
local path = ckpt.save(opts.out, 1, parts, { keep = 1 })
local sync_s = now() - t0
local bytes = 0
for _, name in ipairs({ 'model.safetensors', 'optimizer.safetensors' }) do
  local f = assert(io.open(path .. '/' .. name, 'rb'))
  bytes = bytes + f:seek('end')
  f:close()
end
local gb = bytes / 1e9

local w = ckpt.writer()
local rows = {}
for k = 1, 2 do
  local ts = now()
  local p = ckpt.save_async(opts.out, k + 1, parts, { keep = 1, writer = w })
  local staged = now() - ts
  local written
  local med, n = steps(10000, function()
    if p:ready() then written = now() - ts; return true end
  end)
  p:finish()
  rows[k] = { staged = staged, written = written, steps = n, med = med }
end
w:close()
os.execute("rm -rf '" .. opts.out .. "'")

print(('checkpoint of %.1fM parameters (f32 weights + AdamW moments): %.2f GB on %s, model on %s'):format(nparams / 1e6,
  gb, opts.out, on_gpu and 'cuda' or 'cpu'))
print(('training step alone (B=%d, T=%d%s): %.1f ms (median of %d)'):format(opts.batch, opts.seq,
  on_gpu and ', bf16 autocast' or '', base, opts.steps))
print(('synchronous save: %.2f s (%.2f GB/s): the training stands still for all of it'):format(sync_s, gb / sync_s))
print('| background save | staged (step stands still) | written by the thread | steps meanwhile | their median ms |')
print('|---|---|---|---|---|')
for k, r in ipairs(rows) do
  print(('| %s | %.2f s (%.1f GB/s) | %.2f s (%.2f GB/s) | %d | %.1f (%+.1f%%) |'):format(
    k == 1 and 'first (buffers allocated)' or 'second (buffers reused)', r.staged, gb / r.staged, r.written,
    gb / r.written, r.steps, r.med, 100 * (r.med / base - 1)))
end
