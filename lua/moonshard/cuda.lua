-- moonshard.cuda — devices, memory statistics, streams and events.
--
--   local ms = require 'moonshard'
--   if ms.cuda.is_available() then
--     local x = ms.randn({1024, 1024}, {device = 'cuda'})
--     print(ms.cuda.memory_stats())          -- allocated, reserved, peak, mallocs...
--     local s, ev = ms.cuda.stream(), ms.cuda.event()
--     ev:record()                             -- on the current (compute) stream
--     s:wait(ev)                              -- s waits for it, the host does not
--     local g = ms.cuda.graph(step, {warmup = 3})   -- a step captured once...
--     g:replay()                              -- ...and run again with one launch
--   end
--
-- The contract (caching allocator, stream-ordered reuse, out-of-memory as a
-- Lua error) is in core/cuda.h.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local C = T.C
local check = T.check

local cuda = {}

function cuda.is_available() return C.ms_cuda_available() ~= 0 end
function cuda.device_count() return C.ms_cuda_device_count() end
function cuda.set_device(d)
  check(C.ms_cuda_set_device(d), 2)
  T.current_cuda_device = d
end
function cuda.current_device() return T.current_cuda_device or 0 end
function cuda.get_device_name(d)
  local buf = ffi.new('char[256]')
  check(C.ms_cuda_device_name(d or cuda.current_device(), buf, 256), 2)
  return ffi.string(buf)
end
-- (major, minor): 9, 0 on Hopper, 8, 0 on an A100
function cuda.get_device_capability(d)
  local a, b = ffi.new('int[1]'), ffi.new('int[1]')
  check(C.ms_cuda_device_capability(d or cuda.current_device(), a, b), 2)
  return a[0], b[0]
end
function cuda.synchronize(d) check(C.ms_cuda_synchronize(d or cuda.current_device()), 2) end
function cuda.empty_cache(d) check(C.ms_cuda_empty_cache(d or cuda.current_device()), 2) end
function cuda.reset_peak_memory_stats(d) check(C.ms_cuda_reset_peak_stats(d or cuda.current_device()), 2) end

local stats_t = ffi.typeof('ms_cuda_memory_stats')
function cuda.memory_stats(d)
  local s = stats_t()
  check(C.ms_cuda_get_memory_stats(d or cuda.current_device(), s), 2)
  return {
    allocated = tonumber(s.allocated), requested = tonumber(s.requested), reserved = tonumber(s.reserved),
    peak_allocated = tonumber(s.peak_allocated), peak_reserved = tonumber(s.peak_reserved),
    num_mallocs = tonumber(s.num_mallocs), num_frees = tonumber(s.num_frees),
    num_allocs = tonumber(s.num_allocs), num_ooms = tonumber(s.num_ooms),
    num_host_syncs = tonumber(s.num_host_syncs), host_sync_ms = tonumber(s.host_sync_ns) * 1e-6,
    graph_pool = tonumber(s.graph_pool),
  }
end
-- cuda.pinned_empty(shape, dtype) -> a host tensor in page-locked memory
-- (ms_cuda_host_alloc; freed with the tensor's last reference: keep it, not
-- only views of it, while they are used), for cuda.copy_async_
local pinned_keep = setmetatable({}, { __mode = 'k' })
function cuda.pinned_empty(shape, dtype)
  local t = T.empty(shape, { dtype = dtype })
  if t:numel() == 0 then return t end
  check(C.ms_storage_free_data(t), 2)       -- the CPU allocator's data
  local box = ffi.new('void *[1]')
  check(C.ms_cuda_host_alloc(box, t.storage.nbytes), 2)
  local ptr = ffi.gc(box[0], C.ms_cuda_host_free)
  t.storage.data, t.storage.external = ptr, 1   -- not the allocator's to free
  pinned_keep[t] = ptr                          -- (lives as long as t)
  return t
end
-- cuda.copy_async_(dst, src) -> dst: a host (page-locked) <-> device copy
-- queued on the device's current stream; the host does not wait for it
-- (ms_cuda_copy_async: keep the host side alive and untouched until an
-- event recorded after it has been waited for)
function cuda.copy_async_(dst, src)
  check(C.ms_cuda_copy_async(dst, src), 2)
  return dst
end

function cuda.max_memory_allocated(d) return cuda.memory_stats(d).peak_allocated end
function cuda.memory_allocated(d) return cuda.memory_stats(d).allocated end

-- streams and events: handles freed by __gc or :free()
local Stream = {}
Stream.__index = Stream
function cuda.stream(opts)
  opts = opts or {}
  local box = ffi.new('ms_cuda_stream*[1]')
  check(C.ms_cuda_stream_new(box, opts.device or cuda.current_device(), opts.priority or 0), 2)
  return setmetatable({ p = ffi.gc(box[0], C.ms_cuda_stream_free) }, Stream)
end
function cuda.current_stream(d)
  local p = C.ms_cuda_current_stream(d or cuda.current_device())
  if p == nil then error(ffi.string(C.ms_last_error()), 2) end
  return setmetatable({ p = ffi.gc(p, C.ms_cuda_stream_free) }, Stream)
end
function Stream:wait(ev) check(C.ms_cuda_stream_wait_event(self.p, ev.p), 2); return self end
function Stream:synchronize() check(C.ms_cuda_stream_synchronize(self.p), 2) end
function Stream:free()
  if self.p ~= nil then C.ms_cuda_stream_free(ffi.gc(self.p, nil)); self.p = nil end
end
local function pack(...) return { n = select('#', ...), ... } end
-- run fn with s as the current stream: kernels launched inside go to s
function cuda.with_stream(s, fn, ...)
  check(C.ms_cuda_set_current_stream(s.p), 2)
  local res = pack(pcall(fn, ...))
  C.ms_cuda_set_current_stream(nil)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, res.n)
end
function cuda.record_stream(t, s) check(C.ms_cuda_record_stream(t, s.p), 2) end

local Event = {}
Event.__index = Event
function cuda.event(opts)
  opts = opts or {}
  local box = ffi.new('ms_cuda_event*[1]')
  check(C.ms_cuda_event_new(box, opts.device or cuda.current_device(), opts.timing and 1 or 0), 2)
  return setmetatable({ p = ffi.gc(box[0], C.ms_cuda_event_free) }, Event)
end
function Event:record(s) check(C.ms_cuda_event_record(self.p, s and s.p or nil), 2); return self end
function Event:synchronize() check(C.ms_cuda_event_synchronize(self.p), 2) end
function Event:query()
  local r = C.ms_cuda_event_query(self.p)
  if r < 0 then error(ffi.string(C.ms_last_error()), 2) end
  return r == 1
end
function Event:elapsed_ms(later)
  local f = ffi.new('float[1]')
  check(C.ms_cuda_event_elapsed_ms(self.p, later.p, f), 2)
  return f[0]
end

-- GEMM tuning (core/cuda.h, docs/tensors.md): the first GEMM of each new
-- shape times cuBLASLt's candidates and keeps the fastest. gemm_tune(true
-- | false | 'default') sets it and returns the previous setting;
-- gemm_tune() only reads it. gemm_tune_stats() -> {tuned =, moved =,
-- host_ms =, from_file =}: plans timed, those not on the heuristic's
-- first, host time, plans whose choice came from the tuning file.
function cuda.gemm_tune(on)
  if on == nil then
    local prev = C.ms_cuda_gemm_set_tune(1)
    C.ms_cuda_gemm_set_tune(prev)
    return prev ~= 0
  end
  local v = on == 'default' and -1 or (on and 1 or 0)
  return C.ms_cuda_gemm_set_tune(v) ~= 0
end
function cuda.gemm_tune_stats()
  local s = ffi.new('int64_t[4]')
  C.ms_cuda_gemm_tune_stats(s)
  return { tuned = tonumber(s[0]), moved = tonumber(s[1]), host_ms = tonumber(s[2]) / 1000,
    from_file = tonumber(s[3]) }
end
-- gemm_tune_file(path | nil): tuned choices are appended to path and read
-- back by later runs and other ranks, which take them untimed (nil: no
-- file; MS_GEMM_TUNE_FILE sets the first). gemm_clear_plans(): forget every
-- GEMM plan (the next GEMM of each shape makes it again).
function cuda.gemm_tune_file(path)
  check(C.ms_cuda_gemm_set_tune_file(path), 2)
end
function cuda.gemm_clear_plans() C.ms_cuda_gemm_clear_plans() end

-- CUDA graphs (docs/cuda-graphs.md; the C side in core/cuda.h).
--
--   local g = cuda.graph(fn, {warmup = 3})   -- fn() 3 times eagerly, then one call captured
--   x:copy_(next_batch); g:replay()          -- all of fn's kernels again, one launch
--   print(g.outputs[1]:item())               -- what fn returned: overwritten by each replay
--   g:free()                                 -- its memory back to the cache (also on __gc)
--
-- Inputs and outputs are static: fn reads tensors made before the capture
-- (copy new data into them before replay) and its results live in the
-- graph's memory. Inside the capture, a host sync (item(), a copy to or
-- from the host, synchronize), a CPU tensor op, a random draw (dropout with
-- p > 0) and a GEMM shape not yet tuned are refused with an error naming
-- the op; the capture is then discarded and the process goes on eagerly.
local capture = nil   -- the capture going on: { hooks = {...} }

-- true while this thread captures a graph (on any device)
function cuda.is_capturing() return C.ms_cuda_capturing() >= 0 end

-- cuda.host_written(fn) -> fn()'s results, its tensors' memory made during
-- a capture in blocks that no captured work uses: for a tensor the host
-- writes between replays (a replay hook's), which a block freed earlier in
-- the capture would not keep (the replay reruns the work that used it)
function cuda.host_written(fn)
  local prev = C.ms_cuda_capture_fresh(1)
  local res = pack(pcall(fn))
  C.ms_cuda_capture_fresh(prev)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, res.n)
end

-- cuda.on_replay(fn), during a capture: fn() runs on the host before each
-- replay of the graph being captured, for host state that each replay must
-- advance (AdamW's step counts, and its constants written to the device)
function cuda.on_replay(fn)
  if capture == nil then error('cuda.on_replay: no cuda.graph capture is going on', 2) end
  if type(fn) ~= 'function' then error(('cuda.on_replay: expected a function, got %s'):format(type(fn)), 2) end
  capture.hooks[#capture.hooks + 1] = fn
end

local Graph = {}
Graph.__index = Graph

-- cuda.graph(fn, {warmup = 3, device = current}) -> a Graph: fn() is run
-- `warmup` times eagerly (GEMM plans tuned, lazy buffers and optimizer
-- state made: a warm-up is a real call, a training step takes its step),
-- then once under capture (nothing runs: its kernels are recorded). fn
-- takes no arguments; g.outputs is the list of what it returned.
function cuda.graph(fn, opts)
  if type(fn) ~= 'function' then error(('cuda.graph: expected a function, got %s'):format(type(fn)), 2) end
  opts = opts or {}
  if type(opts) ~= 'table' then error(('cuda.graph: options must be a table, got %s'):format(type(opts)), 2) end
  for k in pairs(opts) do
    if k ~= 'warmup' and k ~= 'device' then
      error(('cuda.graph: unknown option %s (warmup, device)'):format(tostring(k)), 2)
    end
  end
  local warmup = opts.warmup == nil and 3 or opts.warmup
  if type(warmup) ~= 'number' or warmup < 0 or warmup % 1 ~= 0 then
    error(('cuda.graph: warmup must be an integer >= 0, got %s'):format(tostring(warmup)), 2)
  end
  if not cuda.is_available() then
    error('cuda.graph: CUDA graphs need a CUDA device, and ' .. (C.ms_cuda_device_count() == 0 and
      'none is present (or moonshard was built without CUDA)' or 'none is usable'), 2)
  end
  if capture ~= nil or cuda.is_capturing() then
    error('cuda.graph: called inside a capture (captures do not nest)', 2)
  end
  local dev = opts.device or cuda.current_device()
  for _ = 1, warmup do fn() end
  local box = ffi.new('ms_cuda_graph*[1]')
  check(C.ms_cuda_graph_begin(box, dev), 2)
  local g = ffi.gc(box[0], C.ms_cuda_graph_free)
  capture = { hooks = {} }
  local res = pack(pcall(fn))
  local hooks = capture.hooks
  capture = nil
  if not res[1] then
    C.ms_cuda_graph_end(g, 0)
    C.ms_cuda_graph_free(ffi.gc(g, nil))
    error('cuda.graph: the capture was aborted and discarded (eager work goes on): ' .. tostring(res[2]), 2)
  end
  if C.ms_cuda_graph_end(g, 1) ~= 0 then
    local msg = ffi.string(C.ms_last_error())
    C.ms_cuda_graph_free(ffi.gc(g, nil))
    error('cuda.graph: ' .. msg, 2)
  end
  return setmetatable({ p = g, device = dev, outputs = { unpack(res, 2, res.n) }, hooks = hooks }, Graph)
end

-- g:replay() -> g.outputs' values: the replay hooks (cuda.on_replay), then
-- the whole graph with one launch on the compute stream (the host does not
-- wait for it)
function Graph:replay()
  if self.p == nil then error('graph:replay: the graph was freed', 2) end
  for _, h in ipairs(self.hooks) do h() end
  check(C.ms_cuda_graph_replay(self.p), 2)
  return unpack(self.outputs)
end

-- g:free(): waits for its last replay and gives its memory pool back to
-- the cache; the outputs stay readable (plain tensors from then on). Safe
-- to call twice.
function Graph:free()
  if self.p ~= nil then
    C.ms_cuda_graph_free(ffi.gc(self.p, nil))
    self.p, self.hooks = nil, {}
  end
end

return cuda
