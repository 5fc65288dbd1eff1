-- bench/common.lua — what the GPU benchmarks share: their command line,
-- the timing (CUDA events, median of the runs, L2 flushed before each) and
-- the comparison with a reference.
--
--   local B = require 'bench.common'
--   local opts = B.parse_args({ iters = 20, warmup = 3 },
--     'usage: luajit bench/x.lua [--iters N] [--warmup N]')
--   local timed = B.timer(opts)        -- after checking for a CUDA device
--   local ms_ = timed(function() ... end)
local ms = require 'moonshard'
local F = ms.raw

local B = {}

-- `--name value` pairs of argv (default: the script's arg) over a copy of
-- defaults; an unknown name raises `usage`. Numbers are converted.
function B.parse_args(defaults, usage, argv)
  argv = argv or arg
  local opts = {}
  for k, v in pairs(defaults) do opts[k] = v end
  local i = 1
  while i <= #argv do
    local k = argv[i]:match('^%-%-(.+)$')
    if not k or opts[k] == nil then error(usage) end
    opts[k] = tonumber(argv[i + 1]) or argv[i + 1]
    i = i + 2
  end
  return opts
end

function B.median(t)
  table.sort(t)
  return t[math.floor((#t + 1) / 2)]
end

-- now() -> seconds on the monotonic clock (wall time, not CPU time): the
-- training loop's clock
B.now = require('moonshard.train').now

-- timer(opts) -> timed(fn): the median ms of opts.iters runs of fn() after
-- opts.warmup, each timed by CUDA events after an L2 flush (a 256 MiB fill
-- of a buffer allocated here); a GC step after each run frees its results
function B.timer(opts)
  local flush_buf = ms.empty({ 64 * 2 ^ 20 }, { device = 'cuda' })
  local function flush_l2() F.fill_(flush_buf, 0) end
  return function(fn)
    for _ = 1, opts.warmup do fn() end
    ms.cuda.synchronize()
    local e0, e1 = ms.cuda.event({ timing = true }), ms.cuda.event({ timing = true })
    local ts = {}
    for k = 1, opts.iters do
      flush_l2()
      e0:record()
      fn()
      e1:record()
      e1:synchronize()
      ts[k] = e0:elapsed_ms(e1)
      collectgarbage('step')
    end
    return B.median(ts)
  end
end

-- ‖got − want‖ / ‖want‖, computed on the CPU in f64
function B.relerr(got, want)
  local g, w = got:to('cpu'):to('f64'), want:to('cpu'):to('f64')
  local d = F.sub(g, w)
  return math.sqrt(F.sum(F.mul(d, d)):item() / F.sum(F.mul(w, w)):item())
end

return B
