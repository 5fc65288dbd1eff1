-- bench/trace_pins.lua — tensor bytes that LuaJIT's compiled traces keep
-- alive across training steps (moonshard.trace_pins; docs/tensors.md,
-- "Compiled traces keep what they were specialised on"). The tiny Llama and
-- DeepSeek-V3 of bench/host_cost.lua, on one CPU thread:
--
--   luajit bench/trace_pins.lua [--steps 12] [--model all|llama|deepseek]
--                               [--flush 0|1] [--mcode 0|KiB] [--sites 8]
--
-- After each step (forward, backward, AdamW, zero_grad, the loss dropped):
-- the live bytes (CPU + CUDA, ms.live_bytes) after two full collections,
-- and the tensors and their storage bytes that only the live traces keep
-- (moonshard.trace_pins' pins()). At the end, the live bytes a jit.flush() gives back: what the
-- traces pinned. --flush 1 flushes the traces at each step's end (the
-- baseline: nothing survives a step in a trace); --mcode sets LuaJIT's
-- machine-code area in KiB (0: the one tensor.lua sets; 512 is LuaJIT's
-- default). --sites N prints the N closure definition sites the traces
-- hold the most objects of (a site with many is a closure made per call).
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local B = require 'bench.common'
local TP = require 'moonshard.trace_pins'

local opts = B.parse_args({ steps = 12, model = 'all', flush = 0, mcode = 0, sites = 8, seq = 16, threads = 1 },
  'usage: luajit bench/trace_pins.lua [--steps N] [--model all|llama|deepseek] [--flush 0|1] [--mcode KiB]'
    .. ' [--sites N] [--seq T]')
ms.set_num_threads(opts.threads)
if opts.mcode > 0 then
  jit.flush()
  jit.opt.start('maxmcode=' .. opts.mcode)
end

local function run(name, path, cfg)
  local model, opt, ids, tg = B.tiny_setup(path, cfg, opts.seq)
  local live = {}
  for k = 1, opts.steps do
    local loss = model(ids, tg)
    loss:backward()
    opt:step()
    opt:zero_grad()
    loss = nil   -- luacheck: ignore
    if opts.flush == 1 then jit.flush() end
    live[k] = TP.live()
    local _, n, bytes = TP.pins()
    print(('%s step %2d: live %9d bytes; %4d traces; traces alone keep %4d tensors, %8d bytes'):format(
      name, k, live[k], TP.scan().traces, n, bytes))
  end
  local r = TP.scan()
  if opts.sites > 0 then
    local rows = {}
    for loc, e in pairs(r.closures) do rows[#rows + 1] = { loc, e.n } end
    table.sort(rows, function(a, b) return a[2] > b[2] or (a[2] == b[2] and a[1] < b[1]) end)
    for i = 1, math.min(opts.sites, #rows) do
      print(('  %5d closures of %s'):format(rows[i][2], rows[i][1]))
    end
  end
  local pinned, before, after = TP.pinned_bytes()
  local lo, hi = math.huge, 0
  for k = 2, #live do lo, hi = math.min(lo, live[k]), math.max(hi, live[k]) end
  print(('%s: live after steps 2-%d %d-%d bytes; a jit.flush() at the end gives back %d (%d -> %d)'):format(
    name, opts.steps, lo, hi, pinned, before, after))
  return model, opt
end

print(('mcode %s KiB, flush at each step: %s'):format(opts.mcode > 0 and opts.mcode or 'tensor.lua\'s', opts.flush == 1))
for _, c in ipairs(B.tiny_models) do
  if opts.model == 'all' or opts.model == c[1] then
    local model, opt = run(c[1], c[2], c[3])   -- luacheck: ignore (kept until the next model's run)
    model, opt = nil, nil   -- luacheck: ignore
    jit.flush()
    TP.live()
  end
end
