-- bench/host_cost.lua — the host's cost of a training step, per op: tiny
-- models on one CPU thread, where the kernels take next to nothing and the
-- time is the op-issue path (Lua, the FFI, the autograd's bookkeeping, the
-- optimizer's loop). What a GPU step of small kernels waits on.
--
--   luajit bench/host_cost.lua [--steps 30] [--warmup 5] [--threads 1]
--                              [--model all|llama|deepseek] [--seq 16] [--clock cpu|wall]
--
-- For each model: the median ms of `steps` steps of forward (the loss),
-- backward, and optimizer (AdamW's step and zero_grad), and the op count of
-- forward and backward (ms.profile, from one extra step: the counter is off
-- while timing), so us per op = phase ms / phase ops; the optimizer's cost
-- is given per parameter (its fused step writes in place, not counted). The models: a 16-layer
-- Llama of hidden 64 and a 4-layer DeepSeek-V3 (MLA, 8 routed experts and
-- a shared one, the first layer dense) at tiny widths; batch 1, f32.
-- --clock cpu (the default) times the thread's CPU time, which other jobs
-- on the machine disturb less than the wall clock (--clock wall).
-- Then the Lua heap's allocation a step: --alloc-steps more steps (default
-- 20) with the collector stopped, each phase's collectgarbage('count')
-- delta (KB allocated: nothing is freed while it is stopped; a step the
-- allocator's nudge collected in is dropped), median; and KB an op.
-- --gc-steps N (default 0: off), run after the warm-up and before the
-- above, counts what their medians leave out, the allocator's full
-- collections (T.wrap's gc_nudge): over N steps with the collector as a
-- run has it, the steps' wall and CPU ms, the collections' number and ms
-- (timed by --clock, through a wrapped collectgarbage), the CPU bytes live
-- just before each (the peak between collections), the tensor handles a
-- step (one finalizer each once dead) and how many got Lua metadata
-- (T.meta); then what one step's garbage costs the collector, and a full
-- collection of the live heap alone (gc_window, below), median of
-- max(5, N / 5) steps. With --steps 0 only this table is printed.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local B = require 'bench.common'
local prof = ms.profile

local opts = B.parse_args({ steps = 30, warmup = 5, threads = 1, model = 'all', seq = 16, clock = 'cpu',
    ['alloc-steps'] = 20, ['gc-steps'] = 0 },
  'usage: luajit bench/host_cost.lua [--steps N] [--warmup N] [--threads N] [--model all|llama|deepseek] [--seq T]'
    .. ' [--clock cpu|wall] [--alloc-steps N] [--gc-steps N]')
ms.set_num_threads(opts.threads)

local ffi = require 'ffi'
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } ms_host_cost_timespec;
int ms_host_cost_clock_gettime(int clk, ms_host_cost_timespec *t) asm("clock_gettime");
]]
local wall_now = B.now
local ts = ffi.new('ms_host_cost_timespec')
local function cpu_now()
  ffi.C.ms_host_cost_clock_gettime(3, ts)   -- CLOCK_THREAD_CPUTIME_ID
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end
local now = wall_now
if opts.clock == 'cpu' then
  now = cpu_now
elseif opts.clock ~= 'wall' then
  error('--clock cpu or wall')
end
local T = require 'moonshard.tensor'
local C = T.C

local cases = B.tiny_models
local alloc_rows, gc_rows = {}, {}

-- the id the next tensor handle gets (ids count up from 1, one a handle)
local function next_id() return tonumber(T.empty({ 0 }).id) + 1 end

-- --gc-steps: `n` steps of step_fn with the allocator's collections
-- counted; then `n / 5` steps (at least 5) one at a time with the collector
-- stopped, each followed by three full collections: the first runs the
-- step's dead handles' finalizers, the second frees their cdata (a
-- finalized object goes in the next cycle), the third only marks and
-- sweeps the live heap: the first two less twice the third is what the
-- step's garbage costs
local function gc_window(name, n, step_fn)
  local raw_collect = collectgarbage
  local meta = T.meta
  -- one step with the collector stopped, the nudge's collections skipped
  -- too -> the first and one past the last id of its handles
  local function stopped_step()
    raw_collect('stop')
    _G.collectgarbage = function(what, ...)
      if what ~= nil and what ~= 'collect' then return raw_collect(what, ...) end
      return 0
    end
    local id0 = next_id()
    local ok, err = pcall(step_fn)
    local id1 = next_id()
    _G.collectgarbage = raw_collect
    raw_collect('restart')
    if not ok then error(err, 0) end
    return id0, id1
  end

  raw_collect()
  local count, secs, each, peak = 0, 0, {}, 0
  _G.collectgarbage = function(what, ...)
    if what ~= nil and what ~= 'collect' then return raw_collect(what, ...) end
    peak = math.max(peak, tonumber(C.ms_live_bytes(-1)))
    local t0 = now()
    raw_collect()
    local dt = now() - t0
    count, secs = count + 1, secs + dt
    each[count] = dt
    return 0
  end
  local id0 = next_id()
  local w0, c0 = wall_now(), cpu_now()
  local ok, err = pcall(function() for _ = 1, n do step_fn() end end)
  local w1, c1 = wall_now(), cpu_now()
  _G.collectgarbage = raw_collect
  if not ok then error(err, 0) end
  local made = (next_id() - id0 - 1) / n

  -- the handles of one step that got metadata (none finalized yet)
  raw_collect()
  local a, b = stopped_step()
  local with_meta = 0
  for id in pairs(meta) do if id >= a and id < b then with_meta = with_meta + 1 end end
  local garbage, live = {}, {}
  for k = 1, math.max(5, math.floor(n / 5)) do
    raw_collect()
    stopped_step()
    local t0 = now()
    raw_collect()
    raw_collect()
    local t1 = now()
    raw_collect()
    local t2 = now()
    garbage[k], live[k] = (t1 - t0) - 2 * (t2 - t1), t2 - t1
  end
  local g_ms = B.median(garbage) * 1e3
  gc_rows[#gc_rows + 1] = ('| %s | %d | %.2f | %.2f | %d | %.1f (%.1f each, %.1f%% of CPU) | %.1f | %.0f (%d with meta) | %.2f (%.0f ns a handle) | %.2f |'):format(
    name, n, (w1 - w0) * 1e3 / n, (c1 - c0) * 1e3 / n, count, secs * 1e3,
    count > 0 and B.median(each) * 1e3 or 0, secs / (c1 - c0) * 100, peak / 2 ^ 20, made, with_meta,
    g_ms, g_ms * 1e6 / made, B.median(live) * 1e3)
end

local function run(name, path, cfg)
  local model, opt, ids, tg = B.tiny_setup(path, cfg, opts.seq)

  -- one step -> the seconds of its three phases
  local function step()
    local t0 = now()
    local loss = model(ids, tg)
    local t1 = now()
    loss:backward()
    local t2 = now()
    opt:step()
    opt:zero_grad()
    local t3 = now()
    return t1 - t0, t2 - t1, t3 - t2
  end

  for _ = 1, opts.warmup do step() end
  if opts['gc-steps'] > 0 then gc_window(name, opts['gc-steps'], step) end
  if opts.steps == 0 then return end
  -- the op count of a phase (the counter costs a lock a call: counted apart)
  local function count(fn)
    prof.ops(true)
    fn()
    local _, totals = prof.ops_rows(true)
    prof.ops(false)
    return totals.calls
  end
  local loss
  local n_fwd = count(function() loss = model(ids, tg) end)
  local n_bwd = count(function() loss:backward() end)
  count(function() opt:step(); opt:zero_grad() end)
  local n_opt = 0   -- (the fused AdamW writes in place, uncounted: per parameter instead)
  for _ in model:named_parameters() do n_opt = n_opt + 1 end
  loss = nil
  local f, b, o = {}, {}, {}
  for k = 1, opts.steps do
    f[k], b[k], o[k] = step()
  end
  local tot = {}
  for k = 1, opts.steps do tot[k] = f[k] + b[k] + o[k] end
  local mf, mb, mo, mt = B.median(f) * 1e3, B.median(b) * 1e3, B.median(o) * 1e3, B.median(tot) * 1e3
  -- the spread: the middle half of the steps' totals
  table.sort(tot)
  local q1, q3 = tot[math.max(1, math.floor(#tot / 4))] * 1e3, tot[math.ceil(#tot * 3 / 4)] * 1e3
  -- the heap's allocation a step, the collector stopped (after the timed
  -- steps: the timing runs with the collector as a run has it)
  local fa, ba, oa = {}, {}, {}
  collectgarbage()
  collectgarbage('stop')
  for _ = 1, opts['alloc-steps'] do
    local k0 = collectgarbage('count')
    local l = model(ids, tg)
    local k1 = collectgarbage('count')
    l:backward()
    l = nil
    local k2 = collectgarbage('count')
    opt:step()
    opt:zero_grad()
    local k3 = collectgarbage('count')
    if k1 >= k0 and k2 >= k1 and k3 >= k2 then   -- (else the nudge collected)
      fa[#fa + 1], ba[#ba + 1], oa[#oa + 1] = k1 - k0, k2 - k1, k3 - k2
    end
    if k3 - k0 > 64 * 1024 then collectgarbage('restart'); collectgarbage(); collectgarbage('stop') end
  end
  collectgarbage('restart')
  local af, ab, ao = B.median(fa), B.median(ba), B.median(oa)
  alloc_rows[#alloc_rows + 1] = ('| %s | %.1f (%.2f an op) | %.1f (%.2f) | %.1f | %.1f | %d |'):format(
    name, af, af / n_fwd, ab, ab / n_bwd, ao, af + ab + ao, #fa)
  print(('| %s | %.2f (%d ops, %.1f us) | %.2f (%d, %.1f) | %.2f (%d params, %.1f us) | %.2f (%.2f-%.2f) | %.1f |'):format(
    name, mf, n_fwd, mf * 1e3 / n_fwd, mb, n_bwd, mb * 1e3 / n_bwd, mo, n_opt, mo * 1e3 / n_opt,
    mt, q1, q3, (mf + mb) * 1e3 / (n_fwd + n_bwd)))
end

if opts.steps > 0 then
  print(('host ms a step (%s time), median of %d (T = %d, batch 1, f32, %d CPU thread(s)); ops from ms.profile, us an op')
    :format(opts.clock == 'cpu' and 'CPU' or 'wall', opts.steps, opts.seq, opts.threads))
  print('| model | forward | backward | optimizer | step (middle half) | fwd+bwd us/op |')
  print('|---|---|---|---|---|---|')
end
for _, c in ipairs(cases) do
  if opts.model == 'all' or opts.model == c[1] then run(c[1], c[2], c[3]) end
end
if opts.steps > 0 then
  print()
  print(('Lua heap KB allocated a step (collector stopped), median of the steps kept of %d'):format(opts['alloc-steps']))
  print('| model | forward (KB an op) | backward (KB an op) | optimizer | step | steps kept |')
  print('|---|---|---|---|---|---|')
  for _, r in ipairs(alloc_rows) do print(r) end
end
if #gc_rows > 0 then
  print()
  print(('the allocator\'s collections (gc_nudge) over --gc-steps steps; collections timed by the %s clock')
    :format(opts.clock == 'cpu' and 'CPU' or 'wall'))
  print('| model | steps | wall ms a step | CPU ms a step | collections | their ms | CPU MiB live at a collection (max) '
    .. '| handles a step | ms to collect a step\'s garbage | ms to collect the live heap |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  for _, r in ipairs(gc_rows) do print(r) end
end
