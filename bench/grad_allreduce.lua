-- bench/grad_allreduce.lua — the gradient all-reduce of plain data
-- parallelism (--tp / --pp / --ep without FSDP): one all_reduce a tensor
-- against dist.all_reduce_coalesced (flat buckets), over a model's
-- parameter shapes.
--
--   bin/train --nproc-per-node 2 --device cuda bench/grad_allreduce.lua [--model models/mixtral.lua]
--             [--preset tiny] [--dtype f32] [--iters 10] [--bucket-mb 25]
--   bin/train --nproc-per-node 2 --device cpu bench/grad_allreduce.lua    (MPI)
--
-- The tensors are the model's parameters' shapes (built under deferred
-- initialisation: nothing of the model is made), filled with ones; after
-- each way the first element is checked (the average of ones is one).
-- The coalesced way packs on the CPU too (pack = true; its default there
-- is one call a tensor).
-- Time: wall clock around the whole list, the device synchronised; the
-- median of `iters` after 2 warm-up rounds. Prints the tensors, their MB,
-- the milliseconds of each way and their ratio.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local now = require('moonshard.launch').now

local opts = { model = 'models/mixtral.lua', preset = 'tiny', dtype = 'f32', iters = 10, ['bucket-mb'] = 25 }
local args = { ... }
local i = 1
while i <= #args do
  local k = args[i]:match('^%-%-(.+)$')
  if not k or opts[k] == nil then
    error('usage: bench/grad_allreduce.lua [--model FILE] [--preset P] [--dtype f32|bf16] [--iters 10] [--bucket-mb 25]')
  end
  opts[k] = args[i + 1]
  i = i + 2
end
local dev = os.getenv('MS_DEVICE') or 'cpu'
dist.init { backend = dev == 'cpu' and 'mpi' or 'nccl', device = dev ~= 'cpu' and dev or nil }
local device = dist.device()
local M = require('moonshard.train').load_model(opts.model)
local model = ms.nn.deferred_init(M.new, opts.preset ~= 'none' and opts.preset or nil)
local grads, bytes = {}, 0
for _, p in ipairs(model:parameters()) do
  local g = ms.ones(p.shape, { dtype = opts.dtype, device = device })
  grads[#grads + 1] = g
  bytes = bytes + g:numel() * g:element_size()
end
local function sync() if device ~= 'cpu' then ms.cuda.synchronize() end end
local function timed(fn)
  local t = {}
  for k = 1, tonumber(opts.iters) + 2 do
    sync()
    dist.barrier()
    local t0 = now()
    fn()
    sync()
    if k > 2 then t[#t + 1] = now() - t0 end
  end
  table.sort(t)
  return t[math.floor((#t + 1) / 2)] * 1e3
end
local function check(what)
  local v = grads[1]:reshape({ grads[1]:numel() }):narrow(1, 1, 1):to('cpu'):to('f64'):item()
  if math.abs(v - 1) > 1e-3 then error(('%s: the average of ones is %g'):format(what, v)) end
end
local each = timed(function() for _, g in ipairs(grads) do dist.all_reduce(g, 'avg') end end)
check('one a tensor')
local bucket = tonumber(opts['bucket-mb']) * 2 ^ 20
local coalesced = timed(function() dist.all_reduce_coalesced(grads, 'avg', { bucket_bytes = bucket, pack = true }) end)
check('coalesced')
if dist.rank() == 0 then
  print(('%s %s on %s x %d, %s'):format(opts.model, opts.preset, device:match('^%a+'), dist.world_size(), opts.dtype))
  print(('%8s %10s %14s %14s %8s'):format('tensors', 'MB', 'each (ms)', 'coalesced (ms)', 'ratio'))
  print(('%8d %10.2f %14.3f %14.3f %8.2f'):format(#grads, bytes / 2 ^ 20, each, coalesced, each / coalesced))
end
dist.destroy()
