-- bench/collectives.lua — all_gather and reduce_scatter bandwidth over NCCL,
-- through moonshard's own communicator (core/dist), one GPU per rank.
--
--   bin/train --nproc-per-node 2 --device cuda bench/collectives.lua \
--             [--dtype bf16|f32] [--min 1M] [--max 1G] [--iters 20] [--warmup 5]
--
-- Conventions of nccl-tests (and of ../shared/bench/torch_collectives.py, the
-- PyTorch reference to run beside it): the size is the all_gather output
-- (each rank gives size / world) and the reduce_scatter input (each rank
-- gets size / world); algbw = size / time; busbw = algbw * (world - 1) /
-- world. Time: CUDA events on the current stream around one call — the
-- call's full cost (ordering events, the communication stream waiting on the
-- compute stream and back); median of `iters` after `warmup`. The last
-- column is the host time the call took to enqueue (median). Each size's
-- result is checked first (all_gather: rank r's chunk holds r + 1;
-- reduce_scatter of rank + 1 everywhere: every element is the sum).
-- No L2 flush: nccl-tests does none, and these sizes stream from HBM.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local now = require('moonshard.launch').now

local function parse_size(s)
  local n, u = tostring(s):match('^(%d+)([KMG]?)i?B?$')
  if not n then error('bench/collectives.lua: sizes are like 1M, 64M, 1G; got ' .. tostring(s)) end
  return tonumber(n) * ({ [''] = 1, K = 2 ^ 10, M = 2 ^ 20, G = 2 ^ 30 })[u]
end

local opts = { dtype = 'bf16', min = '1M', max = '1G', iters = 20, warmup = 5 }
local args = { ... }
local i = 1
while i <= #args do
  local k = args[i]:match('^%-%-(.+)$')
  if not k or opts[k] == nil then
    error('usage: bench/collectives.lua [--dtype bf16|f32] [--min 1M] [--max 1G] [--iters 20] [--warmup 5]')
  end
  opts[k] = args[i + 1]
  i = i + 2
end
local lo, hi = parse_size(opts.min), parse_size(opts.max)
local iters, warmup = tonumber(opts.iters), tonumber(opts.warmup)

assert(ms.cuda.is_available(), 'bench/collectives.lua needs CUDA devices (bin/train --device cuda)')
dist.init { backend = 'nccl' }
local R, W = dist.rank(), dist.world_size()
local esize = ({ bf16 = 2, f32 = 4 })[opts.dtype] or error('--dtype is bf16 or f32')

local function median(t)
  table.sort(t)
  local n = #t
  return n % 2 == 1 and t[(n + 1) / 2] or (t[n / 2] + t[n / 2 + 1]) / 2
end

-- GPU time of one call (CUDA events) and the host time its enqueue took
local function time_ms(fn)
  for _ = 1, warmup do fn() end
  local ts, hs = {}, {}
  local a, b = ms.cuda.event { timing = true }, ms.cuda.event { timing = true }
  for k = 1, iters do
    a:record()
    local h0 = now()
    fn()
    hs[k] = (now() - h0) * 1e6
    b:record()
    b:synchronize()
    ts[k] = a:elapsed_ms(b)
  end
  return median(ts), median(hs)
end

-- a few elements of each rank's chunk, on the host
local function chunk_values(t, n_per)
  local h = {}
  for r = 0, W - 1 do
    for _, off in ipairs({ 0, n_per - 1 }) do
      h[#h + 1] = { r, t:narrow(1, r * n_per + off + 1, 1):float():item() }
    end
  end
  return h
end

local dev = ms.cuda.get_device_name(dist.local_rank())
if R == 0 then
  print(('# moonshard collectives: %d ranks, %s, %s; median of %d after %d warm-ups'):format(W, dev, opts.dtype,
    iters, warmup))
  print(('%12s %15s %9s %11s %11s %11s'):format('bytes', 'op', 'ms', 'algbw GB/s', 'busbw GB/s', 'enqueue us'))
end

local size = lo
while size <= hi do
  local n = math.floor(size / esize)
  n = n - n % W
  local bytes = n * esize
  local full = ms.empty({ n }, { dtype = opts.dtype, device = 'cuda' })
  local part = ms.full({ n / W }, R + 1, { dtype = opts.dtype, device = 'cuda' })
  -- check, then time
  dist.all_gather_into(full, part)
  for _, rv in ipairs(chunk_values(full, n / W)) do
    assert(rv[2] == rv[1] + 1, ('all_gather at %d bytes: rank %d\'s chunk holds %s'):format(bytes, rv[1], rv[2]))
  end
  local t_ag, h_ag = time_ms(function() dist.all_gather_into(full, part) end)
  full:fill_(R + 1)
  dist.reduce_scatter(part, full, 'sum')
  local want = W * (W + 1) / 2
  assert(part:narrow(1, 1, 1):float():item() == want and part:narrow(1, n / W, 1):float():item() == want,
    ('reduce_scatter at %d bytes: wrong sum'):format(bytes))
  local t_rs, h_rs = time_ms(function() dist.reduce_scatter(part, full, 'sum') end)
  if R == 0 then
    for _, row in ipairs({ { 'all_gather', t_ag, h_ag }, { 'reduce_scatter', t_rs, h_rs } }) do
      local algbw = bytes / (row[2] * 1e-3) / 1e9
      print(('%12d %15s %9.3f %11.1f %11.1f %11.1f'):format(bytes, row[1], row[2], algbw, algbw * (W - 1) / W, row[3]))
    end
    io.stdout:flush()
  end
  full:free()
  part:free()
  size = size * 2
end
dist.destroy()
