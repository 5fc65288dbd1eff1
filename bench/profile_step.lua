-- bench/profile_step.lua — where a training step's GPU time goes, by module
-- class, forward and backward, measured with CUDA events from the modules'
-- hooks (no profiler needed on the host).
--
--   luajit bench/profile_step.lua [models/gpt2.lua] [--preset gpt2-124m] [--batch 8]
--                                 [--seq 1024] [--precision bf16|bf16-master|f32] [--steps 3] [--hooks 0|1]
--                                 [--layers N] (fewer blocks, e.g. for ncu)
--                                 [--tp 1] (ms.tp.parallelize over the world: bin/train
--                                 --nproc-per-node N --device cuda bench/profile_step.lua ... --tp 1;
--                                 rank 0 prints)
--
-- Times of nested modules include their children (a Block contains its
-- attention and MLP); "step" is the whole step between two synchronisations,
-- "optimizer" the AdamW step, "outside modules" what is left (loss, casts,
-- gradient accumulation, the Lua GC).
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'

local opts = { model = 'models/gpt2.lua', preset = 'gpt2-124m', batch = 8, seq = 1024, precision = 'bf16', steps = 3, hooks = 1, layers = 0, tp = 0 }
local i = 1
while i <= #arg do
  local k = arg[i]:match('^%-%-(.+)$')
  if k then
    if opts[k] == nil then error('unknown option --' .. k) end
    opts[k] = tonumber(arg[i + 1]) or arg[i + 1]
    i = i + 2
  else
    opts.model = arg[i]
    i = i + 1
  end
end
assert(ms.cuda.is_available(), 'bench/profile_step.lua needs a CUDA device')

local M = dofile(opts.model)
local over = {}
if M.config.n_positions ~= nil then over.n_positions = opts.seq end
if M.config.max_position_embeddings ~= nil then over.max_position_embeddings = opts.seq end
if opts.preset == 'gpt2-124m' then over.vocab_size = 50304 end  -- llm.c's padded vocabulary
-- the PyTorch reference (../shared/bench/torch_gpt2.py) trains without dropout
for _, k in ipairs { 'resid_pdrop', 'embd_pdrop', 'attn_pdrop', 'attention_dropout', 'hidden_dropout' } do
  if M.config[k] ~= nil then over[k] = 0 end
end
if opts.layers > 0 then
  if M.config.n_layer ~= nil then over.n_layer = opts.layers else over.num_hidden_layers = opts.layers end
end
local rank = 0
if opts.tp ~= 0 then
  ms.dist.init { backend = 'nccl' }   -- (first: 'cuda' is then this rank's GPU)
  rank = ms.dist.rank()
end
local model = M.new(opts.preset, over)
model:to('cuda')
if opts.tp ~= 0 then ms.tp.parallelize(model) end
local print = rank == 0 and print or function() end
if opts.precision ~= 'f32' then
  local nnf = require 'moonshard.nn.functional'
  -- bf16-master: the weights in bf16, their f32 masters in AdamW (docs/precision.md)
  local master = opts.precision == 'bf16-master'
  model = nnf.set_precision(model, { compute = master and 'bf16' or opts.precision, weights = master and 'bf16' or nil })
end
model:train()
local opt = ms.optim.AdamW(model, { lr = 1e-4, master_weights = opts.precision == 'bf16-master' })
local V = model.config.vocab_size
local ids = (ms.rand({ opts.batch, opts.seq }, { seed = 1, device = 'cuda' }) * (V - 1)):long()
local tg = (ms.rand({ opts.batch, opts.seq }, { seed = 2, device = 'cuda' }) * (V - 1)):long()

-- event pairs per (class, phase)
local pending, totals, counts = {}, {}, {}
local recording = false
local function start(key, m)
  if not recording then return end
  local e = ms.cuda.event({ timing = true }):record()
  pending[m] = pending[m] or {}
  pending[m][key] = e
end
local function stop(key, m)
  if not recording then return end
  local s = pending[m] and pending[m][key]
  if not s then return end
  pending[m][key] = nil
  local e = ms.cuda.event({ timing = true }):record()
  local name = m:class_name() .. ' ' .. key
  totals[#totals + 1] = { name, s, e }
end
for _, m in model:named_modules() do
  if m ~= model and opts.hooks ~= 0 then
    m:register_forward_pre_hook(function(mod) start('forward', mod) end)
    m:register_forward_hook(function(mod) stop('forward', mod) end)
    m:register_backward_pre_hook(function(mod) start('backward', mod) end)
    m:register_backward_hook(function(mod) stop('backward', mod) end)
  end
end

local ffi = require 'ffi'
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } ms_prof_timespec;
int ms_prof_clock_gettime(int clk, ms_prof_timespec *t) asm("clock_gettime");
]]
local ts = ffi.new('ms_prof_timespec')
local function now_ms()
  ffi.C.ms_prof_clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1e3 + tonumber(ts.tv_nsec) * 1e-6
end
local host_issue, host_wall = 0, 0

local function step(rec)
  recording = rec
  local h0 = now_ms()
  local t0 = ms.cuda.event({ timing = true }):record()
  opt:zero_grad()
  local loss = model(ids, tg)
  loss:backward()
  local o0 = ms.cuda.event({ timing = true }):record()
  opt:step()
  local t1 = ms.cuda.event({ timing = true }):record()
  if rec then
    totals[#totals + 1] = { 'optimizer', o0, t1 }
    totals[#totals + 1] = { 'step', t0, t1 }
  end
  local h1 = now_ms()
  ms.cuda.synchronize()
  if rec then host_issue, host_wall = host_issue + (h1 - h0), host_wall + (now_ms() - h0) end
  recording = false
  return loss
end

step(false)
step(false)
for _ = 1, opts.steps do step(true) end
ms.cuda.synchronize()
local sum = {}
for _, r in ipairs(totals) do
  local name = r[1]
  sum[name] = (sum[name] or 0) + r[2]:elapsed_ms(r[3])
  counts[name] = (counts[name] or 0) + 1
end
local rows = {}
for k, v in pairs(sum) do rows[#rows + 1] = { k, v / opts.steps, counts[k] / opts.steps } end
table.sort(rows, function(a, b) return a[2] > b[2] end)
print(('%s %s, B=%d T=%d, %s; ms per step (of %d steps)'):format(opts.model, opts.preset, opts.batch, opts.seq,
  opts.precision, opts.steps))
print('| what | ms/step | calls/step |')
print('|---|---|---|')
for _, r in ipairs(rows) do print(('| %s | %.2f | %d |'):format(r[1], r[2], r[3])) end
-- when the host takes about as long to issue a step as the GPU takes to run
-- it, the step is bound by Lua and launch overhead, not by the kernels
print(('host: %.2f ms/step to issue the step (until opt:step() returns), %.2f ms/step wall with the sync')
  :format(host_issue / opts.steps, host_wall / opts.steps))
