-- moonshard.dist — collectives between ranks: NCCL for CUDA tensors, MPI for
-- CPU tensors, process groups and the rendezvous store (core/dist/comm.h).
--
--   local ms = require 'moonshard'
--   local dist = ms.dist
--   dist.init{ backend = 'nccl', timeout = 600 }     -- ranks from RANK/WORLD_SIZE/...
--   local g = ms.ones({1000}, { device = 'cuda' })
--   dist.all_reduce(g, 'avg')                        -- stream-ordered, the host does not wait
--   local full = ms.empty({ 4 * 250 }, { device = 'cuda', dtype = 'bf16' })
--   local w = dist.all_gather_into(full, shard, { async = true })
--   ...                                               -- compute meanwhile
--   w:wait()                                          -- the current stream waits, not the host
--   local mesh = dist.mesh{ replicate = 2, shard = 4 } -- hybrid sharding: mesh.shard, mesh.replicate
--   dist.destroy()
--
-- Ranks are 0-based world ranks, as in the environment (RANK=0 is the first).
-- Reductions are named 'sum', 'avg', 'max', 'min'. Every operation takes an
-- optional table: group = a group (default: the world), async = true to get
-- a Work back (w:wait(), w:is_done()). Tensors are contiguous f32, bf16, f64
-- or i64 on the backend's device; all_gather_into(out, in) needs
-- out:numel() == group size * in:numel() (rank i's input lands at offset
-- i * in:numel()), reduce_scatter(out, in, op) the reverse. broadcast's root
-- is a world rank.
--
-- dist.init raises on failure (a rank that cannot join has nothing else to
-- do, and the message names the ranks that never arrived); the store's
-- get/wait/barrier return nil, err on a time-out.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local C = T.C

local dist = {}

local function cerr() return ffi.string(C.ms_last_error()) end
local function check(rc, level)
  if rc ~= 0 then error(cerr(), (level or 1) + 1) end
end

local backend_ids = { mpi = 0, nccl = 1 }
local backend_names = { [0] = 'mpi', [1] = 'nccl' }
local op_ids = { sum = 0, avg = 1, max = 2, min = 3 }

local function op_id(name, fname)
  local id = op_ids[name]
  if not id then
    error(('%s: unknown reduction %s (use \'sum\', \'avg\', \'max\' or \'min\')'):format(fname, tostring(name)), 3)
  end
  return id
end

-- ------------------------------------------------------------ environment

-- the run's shape as the environment gives it (no init needed)
function dist.env()
  local e = ffi.new('ms_dist_env')
  check(C.ms_dist_read_env(e), 2)
  return {
    rank = e.rank, world_size = e.world_size, local_rank = e.local_rank,
    local_world_size = e.local_world_size, source = ffi.string(e.source),
    master_addr = e.has_master ~= 0 and ffi.string(e.master_addr) or nil,
    master_port = e.has_master ~= 0 and e.master_port or nil,
  }
end

function dist.is_available(backend)
  return C.ms_dist_backend_available(backend_ids[backend or 'mpi'] or -1) ~= 0
end

-- ----------------------------------------------------------------- groups

local Group = {}
Group.__index = Group
dist.Group = Group

local function wrap_group(p, ranks)
  local g = setmetatable({ ranks_ = ranks }, Group)
  if p ~= nil then g.p = ffi.gc(p, C.ms_comm_free) end
  return g
end

local function live(g, fname)
  if not g.p then
    if g.ranks_ then
      error(('%s: this rank (%d) is not a member of the group [%s]'):format(fname, dist.rank(),
        table.concat(g.ranks_, ',')), 3)
    end
    error(fname .. ': the group was freed', 3)
  end
  return g.p
end

function Group:is_member() return self.p ~= nil end
function Group:rank() return self.p and C.ms_comm_rank(self.p) or -1 end
function Group:size()
  if self.p then return C.ms_comm_size(self.p) end
  return #self.ranks_
end
-- world ranks of the members, in group-rank order
function Group:ranks()
  if not self.p then return { unpack(self.ranks_) } end
  local r = {}
  for i = 0, C.ms_comm_size(self.p) - 1 do r[#r + 1] = C.ms_comm_world_rank(self.p, i) end
  return r
end
function Group:is_broken() return self.p ~= nil and C.ms_comm_is_broken(self.p) ~= 0 end
function Group:set_timeout(s) check(C.ms_comm_set_timeout(live(self, 'set_timeout'), s), 2) end
-- gives the group up at once (NCCL: ncclCommAbort); later calls on it fail
function Group:abort() check(C.ms_comm_abort(live(self, 'abort')), 2) end
function Group:free()
  if self.p then C.ms_comm_free(ffi.gc(self.p, nil)); self.p = nil end
end
function Group:__tostring()
  return ('dist.Group(ranks [%s]%s)'):format(table.concat(self:ranks(), ','), self.p and '' or ', not a member')
end

-- ------------------------------------------------------------------- work

local Work = {}
Work.__index = Work
dist.Work = Work

-- the handles issued during this thread's CUDA graph capture and not yet
-- waited for (dist.check_joined), with their op's name
local open_captured = setmetatable({}, { __mode = 'k' })
local function capturing() return require('moonshard.cuda').is_capturing() end

function Work:wait()
  if not self.p then return true end
  check(C.ms_work_wait(self.p), 2)
  open_captured[self] = nil
  return true
end
function Work:is_done()
  if not self.p then return true end
  local r = C.ms_work_is_done(self.p)
  if r < 0 then error(cerr(), 2) end
  return r == 1
end
function Work:free()
  -- (freed during the capture unwaited, it stays open: dist.check_joined)
  if not capturing() then open_captured[self] = nil end
  if self.p then C.ms_work_free(ffi.gc(self.p, nil)); self.p = nil end
  self.tensors = nil
end

local work_box = ffi.typeof('ms_work*[1]')

-- run a collective: `fn(box_or_nil, comm, ...)`; async returns a Work that
-- also keeps the tensors' handles alive until it is freed
local trace = nil   -- the collective trace when on (dist.trace below), else nil
local function run(fname, opts, fn, tensors, ...)
  opts = opts or {}
  local g = opts.group or dist.world_group
  if not g then error(fname .. ': dist is not initialised (call ms.dist.init first)', 3) end
  local p = live(g, fname)
  local row = nil
  if trace then
    row = fname == 'batch_p2p' and trace.p2p_row or trace.note(fname, g, tensors)
    if trace.times then return trace.timed(row, p, fn, opts.async, tensors, ...) end
  end
  if opts.async then
    local box = work_box()
    if fn(box, p, ...) ~= 0 then error(cerr(), 3) end
    local w = setmetatable({ p = ffi.gc(box[0], C.ms_work_free), tensors = tensors }, Work)
    if capturing() then open_captured[w] = fname end
    return w
  end
  if fn(nil, p, ...) ~= 0 then error(cerr(), 3) end
  return nil
end

local function tensor_arg(t, fname, what)
  if not T.is_tensor(t) then error(('%s: %s must be a tensor, got %s'):format(fname, what, type(t)), 3) end
  return t
end

-- out = concatenation of every rank's `inp` (group-rank order)
function dist.all_gather_into(out, inp, opts)
  tensor_arg(out, 'all_gather_into', 'out'); tensor_arg(inp, 'all_gather_into', 'in')
  return run('all_gather_into', opts, C.ms_comm_all_gather_into, { out, inp }, out, inp)
end

-- out = reduction over ranks of chunk `group rank` of `inp`
function dist.reduce_scatter(out, inp, op, opts)
  tensor_arg(out, 'reduce_scatter', 'out'); tensor_arg(inp, 'reduce_scatter', 'in')
  return run('reduce_scatter', opts, C.ms_comm_reduce_scatter, { out, inp }, out, inp, op_id(op or 'sum', 'reduce_scatter'))
end

function dist.all_reduce(t, op, opts)
  tensor_arg(t, 'all_reduce', 'the tensor')
  return run('all_reduce', opts, C.ms_comm_all_reduce, { t }, t, op_id(op or 'sum', 'all_reduce'))
end

-- all_reduce_coalesced(list, op, opts): every tensor of `list` reduced in
-- place, as all_reduce each would, in few collectives: the contiguous ones
-- of one dtype and device packed into flat buckets of at most
-- opts.bucket_bytes (25 MiB, PyTorch DDP's default) by ops.cast_flat (one
-- kernel a bucket on CUDA), each bucket all-reduced once and copied back
-- by ops.split_flat_ (one kernel a bucket).
-- A gradient list of many small tensors (norms, biases) costs a few
-- collectives instead of one each. Packed by default for CUDA tensors only
-- (opts.pack = true / false decides): on the CPU a bucket is a fresh
-- allocation whose first touch costs more than MPI's per-call overhead
-- (bench/grad_allreduce.lua: the tiny Mixtral's 79 tensors over 2 ranks,
-- 14 ms one by one, 27 ms packed). opts.group as all_reduce's; not async.
function dist.all_reduce_coalesced(list, op, opts)
  if type(list) ~= 'table' then error('all_reduce_coalesced: list must be a table of tensors', 2) end
  opts = opts or {}
  if opts.async then error('all_reduce_coalesced: not async', 2) end
  local cap = opts.bucket_bytes or 25 * 2 ^ 20
  if type(cap) ~= 'number' or cap <= 0 then
    error(('all_reduce_coalesced: bucket_bytes must be a positive number, got %s'):format(tostring(cap)), 2)
  end
  local F = require 'moonshard.ops'
  local copts = { group = opts.group }
  local packable = { f32 = true, f64 = true, bf16 = true, f16 = true }   -- (ops.cast_flat's dtypes)
  local pack = opts.pack
  -- (dtype, device) -> the current bucket { list =, bytes = }; flushed when full
  local open, order = {}, {}
  local function flush(key)
    local b = open[key]
    open[key] = nil
    if not b or #b.list == 0 then return end
    if #b.list == 1 then dist.all_reduce(b.list[1], op, copts); return end
    local flat = F.cast_flat(b.list, b.list[1].dtype)
    dist.all_reduce(flat, op, copts)
    F.split_flat_(b.list, flat)
    flat:free()
  end
  for i, t in ipairs(list) do
    tensor_arg(t, 'all_reduce_coalesced', ('list[%d]'):format(i))
    if t:numel() > 0 then
      if not t:is_contiguous() or not packable[t.dtype] or not (pack or (pack == nil and t.device ~= 'cpu')) then
        dist.all_reduce(t, op, copts)
      else
        local key = t.dtype .. '@' .. t.device
        local bytes = t:numel() * t:element_size()
        local b = open[key]
        if b and b.bytes + bytes > cap then flush(key); b = nil end
        if not b then
          b = { list = {}, bytes = 0 }
          open[key] = b
          order[#order + 1] = key
        end
        b.list[#b.list + 1] = t
        b.bytes = b.bytes + bytes
      end
    end
  end
  for _, key in ipairs(order) do flush(key) end
end

function dist.broadcast(t, root, opts)
  tensor_arg(t, 'broadcast', 'the tensor')
  if type(root) ~= 'number' then error('broadcast: root must be a world rank (a number)', 2) end
  return run('broadcast', opts, C.ms_comm_broadcast, { t }, t, root)
end

function dist.barrier(opts)
  opts = opts or {}
  local g = opts.group or dist.world_group
  if not g then error('barrier: dist is not initialised (call ms.dist.init first)', 2) end
  local p = live(g, 'barrier')
  if trace then trace.note('barrier', g, {}) end
  check(C.ms_comm_barrier(p), 2)
end

-- CUDA graphs (docs/cuda-graphs.md). On NCCL a collective issued during a
-- capture (ms.cuda.graph) is recorded into the graph and run by each
-- replay; its wait (w:wait(), or the call's own without async) joins the
-- communication stream back into the captured one, which must happen
-- before the capture ends. Refused during a capture, naming the op: the
-- MPI backend, barrier, w:is_done(), new groups, copy registrations, and a
-- wait across the capture's border.
--
-- dist.check_joined(what): inside the capture, before it ends: an error
-- naming the async collectives issued in it and not waited for (their
-- stream not joined back: cudaStreamEndCapture would fail), what naming
-- the caller, after waiting for them (so that the capture, aborted by the
-- error, ends with every stream joined); forgets them either way.
function dist.check_joined(what)
  local names = {}
  for w, fname in pairs(open_captured) do
    names[#names + 1] = fname
    if w.p then pcall(w.wait, w) end
  end
  for w in pairs(open_captured) do open_captured[w] = nil end
  if #names > 0 then
    table.sort(names)
    error(('%s: %d collective%s issued in the CUDA graph capture and not waited for (%s): wait for each before the '
      .. 'capture ends (the communication stream must join the captured one)'):format(what or 'dist.check_joined',
      #names, #names == 1 and '' or 's', table.concat(names, ', ')), 2)
  end
end

-- dist.join_captured() -> n: inside a capture about to be abandoned (an
-- error after some collectives were recorded): waits for each async one
-- issued in it and not yet waited for (a stream wait: the communication
-- stream joined back, so the capture ends with no stream of it left
-- capturing), n of them; they are forgotten.
function dist.join_captured()
  local n = 0
  for w in pairs(open_captured) do
    if w.p then w:wait(); n = n + 1 end
    open_captured[w] = nil
  end
  return n
end

-- dist.watch(desc, opts): after a graph's replay that holds collectives
-- of the group (opts.group, default the world), the work queued on the
-- current stream is watched as one of its collectives: not done within
-- the group's time-out, the communicator is aborted and the group broken,
-- as a hung eager collective is (the watchdog cannot see the collectives
-- inside a graph). A no-op on MPI; refused during a capture.
function dist.watch(desc, opts)
  opts = opts or {}
  local g = opts.group or dist.world_group
  if not g then error('watch: dist is not initialised (call ms.dist.init first)', 2) end
  if desc ~= nil and type(desc) ~= 'string' then error(('watch: desc must be a string, got %s'):format(type(desc)), 2) end
  check(C.ms_comm_watch(live(g, 'watch'), desc), 2)
end

-- Point-to-point (pipeline parallelism; core/dist/comm.h, ms_comm_p2p).
-- dist.batch_p2p(ops, opts) runs a list of sends and receives as one
-- batch: ops[i] = { 'send', t, dst } or { 'recv', t, src } with world
-- ranks of the group (opts.group, default the world) other than this one.
-- On NCCL the batch is one group call, so a send to a peer and a receive
-- from it never deadlock; on MPI the messages are posted together and
-- completed together. Messages from one rank to another match in the
-- order they were posted; a receive's tensor must have the numel and
-- dtype of the send it matches. dist.send(t, dst, opts) and
-- dist.recv(t, src, opts) are batches of one. opts.async: a Work back.
local p2p_cache = {}
function dist.batch_p2p(ops, opts)
  if type(ops) ~= 'table' or #ops == 0 then error('batch_p2p: expects a list of {"send"|"recv", tensor, peer}', 2) end
  local n = #ops
  local c = p2p_cache[n]
  if not c then
    c = { recv = ffi.new('int[?]', n), t = ffi.new('ms_tensor*[?]', n), peer = ffi.new('int[?]', n) }
    p2p_cache[n] = c
  end
  local keep = {}
  for i, op in ipairs(ops) do
    local kind, t, peer = op[1], op[2], op[3]
    if kind ~= 'send' and kind ~= 'recv' then
      error(('batch_p2p: operation %d is %s, not "send" or "recv"'):format(i, tostring(kind)), 2)
    end
    if not T.is_tensor(t) then error(('batch_p2p: operation %d (%s) needs a tensor, got %s'):format(i, kind, type(t)), 2) end
    if type(peer) ~= 'number' or peer ~= math.floor(peer) then
      error(('batch_p2p: operation %d (%s) needs a peer world rank, got %s'):format(i, kind, tostring(peer)), 2)
    end
    c.recv[i - 1] = kind == 'recv' and 1 or 0
    c.t[i - 1] = t
    c.peer[i - 1] = peer
    keep[i] = t
  end
  if trace then trace.p2p_row = trace.note_p2p(ops, opts and opts.group or dist.world_group) end
  local r = run('batch_p2p', opts, C.ms_comm_p2p, keep, n, c.recv, c.t, c.peer)
  for i = 0, n - 1 do c.t[i] = nil end
  return r
end
function dist.send(t, dst, opts) return dist.batch_p2p({ { 'send', t, dst } }, opts) end
function dist.recv(t, src, opts) return dist.batch_p2p({ { 'recv', t, src } }, opts) end

-- the same operations as methods of a group
for _, name in ipairs({ 'all_gather_into', 'reduce_scatter', 'all_reduce', 'broadcast' }) do
  local f = dist[name]
  local nargs = (name == 'all_reduce' or name == 'broadcast') and 2 or (name == 'reduce_scatter' and 3 or 2)
  Group[name] = function(self, a, b, c, d)
    local args = { a, b, c, d }
    local opts = {}
    for k, v in pairs(args[nargs + 1] or {}) do opts[k] = v end
    opts.group = self
    args[nargs + 1] = opts
    return f(unpack(args, 1, nargs + 1))
  end
end
function Group:barrier() return dist.barrier({ group = self }) end
function Group:batch_p2p(ops, opts)
  local o = {}
  for k, v in pairs(opts or {}) do o[k] = v end
  o.group = self
  return dist.batch_p2p(ops, o)
end

-- Copy-engine all-gathers (NCCL groups on one host; core/dist/comm.h):
-- dist.copy_register(t, opts) — collective over opts.group (the world by
-- default) — makes t readable by every member's copy engines and returns a
-- registration, or nil on every member when one of them cannot (another
-- host, no peer access): then use dist.all_gather_into. t must stay
-- allocated and in place (the registration keeps its handle); every member
-- registers the same numel and dtype. reg:gather_into(out) -> an async Work:
-- out = every member's t, member r's at r·numel, copied on the group's
-- communication stream with no SM. It reads the peers' tensors as they are
-- when the copy runs: after a member writes its t, a collective on the group
-- (a fence, e.g. an all_reduce) must complete before the copy reads it, and
-- every copy that read it before the member writes it again.
local CopyReg = {}
CopyReg.__index = CopyReg
dist.CopyReg = CopyReg
function dist.copy_register(t, opts)
  tensor_arg(t, 'copy_register', 'the tensor')
  opts = opts or {}
  local g = opts.group or dist.world_group
  if not g then error('copy_register: dist is not initialised (call ms.dist.init first)', 2) end
  local box = ffi.new('ms_copy_buf*[1]')
  local rc = C.ms_comm_copy_register(box, live(g, 'copy_register'), t)
  if rc < 0 then error(cerr(), 2) end
  if rc == 1 then return nil end
  return setmetatable({ p = ffi.gc(box[0], C.ms_copy_buf_free), t = t, group = g }, CopyReg)
end
function CopyReg:gather_into(out)
  if not self.p then error('copy_gather: the registration was freed', 2) end
  tensor_arg(out, 'copy_gather', 'out')
  local box = work_box()
  if C.ms_comm_copy_gather(box, self.p, out) ~= 0 then error(cerr(), 2) end
  return setmetatable({ p = ffi.gc(box[0], C.ms_work_free), tensors = { out, self.t } }, Work)
end
function CopyReg:free()
  if self.p then C.ms_copy_buf_free(ffi.gc(self.p, nil)); self.p = nil end
  self.t = nil
end

-- The collective timeline (benchmarks; NCCL only, core/dist/comm.h):
-- dist.timing(true) clears the log and times every later collective;
-- dist.timing(false) stops. dist.timeline(ref) after a synchronize: one
-- table per collective, in issue order, { desc, issued, start, stop, wait,
-- resumed } in ms after `ref` (a timed cuda.event recorded on the same device
-- before them): issued where the compute stream called it, start/stop on its
-- communication stream, wait/resumed around its first wait on the compute
-- stream (nil when never waited for; resumed - wait is the time the compute
-- stream stood still for it).
function dist.timing(on) check(C.ms_dist_timing(on and 1 or 0), 2) end
function dist.timeline(ref)
  if type(ref) ~= 'table' or ref.p == nil then error('dist.timeline: need a timed cuda.event as the reference', 2) end
  local n = C.ms_dist_timing_count()
  local buf, t, out = ffi.new('char[160]'), ffi.new('double[5]'), {}
  for i = 0, n - 1 do
    check(C.ms_dist_timing_entry(i, ref.p, buf, 160, t), 2)
    local w = t[3] == t[3] and t[3] or nil
    out[#out + 1] = { desc = ffi.string(buf), issued = t[0], start = t[1], stop = t[2], wait = w,
                      resumed = w and t[4] or nil }
  end
  return out
end

-- ------------------------------------------------------------------ trace
-- A debug count of the communication (docs/dist.md, "Counting the
-- collectives"): dist.trace(true) clears the log and records every later
-- collective and point-to-point batch of this module (kind, group size,
-- bytes, the code that called it, forward or backward), and the host
-- reads (t:item(), t:totable(): a host sync each on a GPU; counted on the
-- CPU too, where they cost nothing, so a CPU run shows what a GPU run
-- would wait on); dist.trace(false) stops. MS_DIST_COUNT=1 turns it on at
-- load, and bin/train then prints each step's table (dist.trace_step).
-- Off, the cost is one nil test a call. Collectives the C core issues
-- itself (the vocabulary-parallel fused loss's, core/flce.c) are not seen
-- here; flce.lua notes them (dist.trace_note).
--   dist.trace(true); ...a step...; local rows = dist.trace_rows(); print(dist.trace_report())
-- rows: one per (kind, group size, bytes, site, phase, group's world
-- ranks as 'a,b,..'), with calls = how many; bytes is the collective's size as nccl-tests counts it (an
-- all-gather's output, a reduce-scatter's input, an all-reduce's tensor, a
-- p2p batch's sent bytes), bus the bytes this rank moves over the links
-- ((N-1)/N of it, 2(N-1)/N for an all-reduce, a send's own). The live
-- bytes (ms.live_bytes, CPU and CUDA) are sampled at every call:
-- peak_live is their maximum since dist.trace(true) or the last
-- trace_rows(true).

-- in a backward: a frame of autograd.lua's backward() or walk() on the
-- stack (their lines found once in the file)
local bwd_lines = nil
local function in_backward(level)
  if bwd_lines == nil then
    bwd_lines = {}
    local path = package.searchpath('moonshard.autograd', package.path)
    local f = path and io.open(path)
    if f then
      local n = 0
      for line in f:lines() do
        n = n + 1
        if line:find('^local function walk%(') or line:find('^local function backward%(') then bwd_lines[n] = true end
      end
      f:close()
    end
  end
  for l = level, level + 80 do
    local info = debug.getinfo(l, 'S')
    if not info then return false end
    if bwd_lines[info.linedefined] and info.short_src:find('moonshard/autograd%.lua$') then return true end
  end
  return false
end

-- where: the first frames outside dist.lua and the autograd, up to and
-- including the first outside moonshard/tp.lua (tp's helpers name little)
local function site_of(level)
  local parts = {}
  for l = level, level + 20 do
    local info = debug.getinfo(l, 'Sl')
    if not info then break end
    local src = info.short_src or '?'
    if not (src:find('moonshard/dist%.lua$') or src:find('moonshard/autograd%.lua$') or info.what == 'C') then
      local file = src:match('([^/]+/[^/]+)$') or src
      parts[#parts + 1] = ('%s:%d'):format(file, info.currentline)
      if not src:find('moonshard/tp%.lua$') or #parts >= 3 then break end
    end
  end
  return table.concat(parts, ' < ')
end

local function tensor_bytes(t) return T.methods.numel(t) * C.ms_dtype_size(t.dtype_id) end

local function new_trace(times)
  local tr = { rows = {}, order = {}, peak = 0, reads = 0 }
  local function sample()
    local b = tonumber(C.ms_live_bytes(-1)) + tonumber(C.ms_live_bytes(0))
    if b > tr.peak then tr.peak = b end
  end
  local function add(kind, size, bytes, bus, site, ranks)
    local phase = in_backward(3) and 'bwd' or 'fwd'
    ranks = ranks or ''
    local key = kind .. '|' .. size .. '|' .. bytes .. '|' .. site .. '|' .. phase .. '|' .. ranks
    local r = tr.rows[key]
    if not r then
      r = { kind = kind, size = size, bytes = bytes, bus = bus, site = site, phase = phase, ranks = ranks, calls = 0 }
      tr.rows[key] = r
      tr.order[#tr.order + 1] = key
    end
    r.calls = r.calls + 1
    sample()
    return r
  end
  tr.add = add
  function tr.note(fname, g, tensors)
    local N = g:size()
    local kind, bytes, bus = fname, 0, 0
    if fname == 'all_gather_into' then
      kind, bytes = 'all_gather', tensor_bytes(tensors[1]); bus = bytes * (N - 1) / N
    elseif fname == 'reduce_scatter' then
      bytes = tensor_bytes(tensors[2]); bus = bytes * (N - 1) / N
    elseif fname == 'all_reduce' then
      bytes = tensor_bytes(tensors[1]); bus = 2 * bytes * (N - 1) / N
    elseif fname == 'broadcast' then
      bytes = tensor_bytes(tensors[1]); bus = bytes
    end
    return add(kind, N, bytes, bus, site_of(4), table.concat(g:ranks(), ','))
  end
  function tr.note_p2p(ops, g)
    local sent, recvd = 0, 0
    for _, op in ipairs(ops) do
      if op[1] == 'send' then sent = sent + tensor_bytes(op[2]) else recvd = recvd + tensor_bytes(op[2]) end
    end
    local kind = sent > 0 and recvd > 0 and 'p2p send+recv' or (sent > 0 and 'p2p send' or 'p2p recv')
    return add(kind, g and g:size() or 0, sent > 0 and sent or recvd, sent, site_of(4),
      g and table.concat(g:ranks(), ',') or '')
  end
  -- the times (dist.trace(true, { times = true }), MS_DIST_COUNT=2): on a
  -- CUDA group the collective goes into the C core's timeline
  -- (dist.timing), its entry noted against its row and read at the step's
  -- end (trace_rows); on the CPU (MPI) the host's wall time of the call
  -- (an async call's: only its start)
  tr.times = times
  tr.pending = {}
  function tr.timed(row, p, fn, async, tensors, ...)
    local box = async and work_box() or nil
    local rc
    if C.ms_comm_device(p) >= 0 then
      if not tr.ref then
        check(C.ms_dist_timing(1), 3)   -- (clears the log)
        tr.dev = C.ms_comm_device(p)
        tr.ref = require('moonshard.cuda').event { device = tr.dev, timing = true }:record()
      end
      local idx = C.ms_dist_timing_count()
      rc = fn(box, p, ...)
      if rc == 0 and C.ms_dist_timing_count() > idx then tr.pending[#tr.pending + 1] = { row = row, idx = idx } end
    else
      local now = require('moonshard.launch').now
      local t0 = now()
      rc = fn(box, p, ...)
      row.ms = (row.ms or 0) + (now() - t0) * 1e3
    end
    if rc ~= 0 then error(cerr(), 3) end
    if async then return setmetatable({ p = ffi.gc(box[0], C.ms_work_free), tensors = tensors }, Work) end
    return nil
  end
  -- the GPU times of the noted entries added to their rows (after a
  -- synchronize: the step's end), the timeline stopped
  function tr.read_times()
    if not tr.ref then return end
    require('moonshard.cuda').synchronize(tr.dev)
    local buf, t = ffi.new('char[160]'), ffi.new('double[5]')
    for _, e in ipairs(tr.pending) do
      check(C.ms_dist_timing_entry(e.idx, tr.ref.p, buf, 160, t), 3)
      e.row.ms = (e.row.ms or 0) + (t[2] - t[1])
    end
    tr.pending, tr.ref = {}, nil
    check(C.ms_dist_timing(0), 3)
  end
  return tr
end

-- the host reads, counted while the trace is on (T.methods' item and
-- totable wrapped, put back when it goes off)
local reads_orig = nil
local function wrap_reads(on)
  local M = T.methods
  if on and not reads_orig then
    reads_orig = { item = M.item, totable = M.totable }
    for name, f in pairs(reads_orig) do
      M[name] = function(t, ...)
        if trace then trace.add('host read (' .. name .. ')', 1, tensor_bytes(t), 0, site_of(3)) end
        return f(t, ...)
      end
    end
  elseif not on and reads_orig then
    for name, f in pairs(reads_orig) do M[name] = f end
    reads_orig = nil
  end
end

-- dist.trace(on, opts) -> the previous setting; on: a fresh, empty log;
-- opts.times: each row also sums its calls' times (GPU ms on CUDA groups,
-- the host's on the CPU; MS_DIST_COUNT=2)
function dist.trace(on, opts)
  local prev = trace ~= nil
  if trace then trace.read_times() end   -- (stops the timeline)
  trace = on and new_trace(opts and opts.times or false) or nil
  wrap_reads(on and true or false)
  return prev
end
function dist.tracing() return trace ~= nil end

-- dist.trace_note(kind, group, bytes, bus) for a collective the C core
-- issues (kind e.g. 'all_reduce'; group a dist group or its size): counted
-- as this module's are, when the trace is on
function dist.trace_note(kind, group, bytes, bus)
  if not trace then return end
  local N = type(group) == 'number' and group or group:size()
  if bus == nil then bus = (kind:find('^all_reduce') and 2 or 1) * bytes * (N - 1) / N end
  trace.add(kind, N, bytes, bus, site_of(3), type(group) == 'table' and table.concat(group:ranks(), ',') or '')
end

-- dist.trace_rows(reset) -> the log's rows in first-call order (each {
-- kind, size, bytes, bus, site, phase, ranks, calls }) and the totals:
-- totals[kind] = { calls, bytes, bus } (the host reads' kinds too),
-- totals.all the communication's (reads not counted), totals.peak_live;
-- reset: the log cleared after (one step's rows at a time)
function dist.trace_rows(reset)
  if not trace then return {}, { all = { calls = 0, bytes = 0, bus = 0 } } end
  trace.read_times()
  local rows, totals = {}, { all = { calls = 0, bytes = 0, bus = 0 } }
  for _, key in ipairs(trace.order) do
    local r = trace.rows[key]
    rows[#rows + 1] = r
    local t = totals[r.kind] or { calls = 0, bytes = 0, bus = 0 }
    totals[r.kind] = t
    if trace.times then r.ms = r.ms or 0 end
    for _, x in ipairs({ t, r.kind:find('^host read') and {} or totals.all }) do
      x.calls = (x.calls or 0) + r.calls
      x.bytes = (x.bytes or 0) + r.calls * r.bytes
      x.bus = (x.bus or 0) + r.calls * r.bus
      if r.ms then x.ms = (x.ms or 0) + r.ms end
    end
  end
  totals.peak_live = trace.peak
  if reset then trace = new_trace(trace.times) end
  return rows, totals
end

-- dist.trace_report(title, reset) -> the log as a text table (rows sorted
-- by kind, then site), the totals by kind last
function dist.trace_report(title, reset)
  local rows, totals = dist.trace_rows(reset)
  local sorted = {}
  for i, r in ipairs(rows) do sorted[i] = r end
  table.sort(sorted, function(a, b)
    if a.kind ~= b.kind then return a.kind < b.kind end
    if a.site ~= b.site then return a.site < b.site end
    if a.phase ~= b.phase then return a.phase > b.phase end
    return a.bytes < b.bytes
  end)
  -- (with times: a column of the calls' summed milliseconds, GPU ms on
  -- CUDA groups, the host's on the CPU)
  local timed = totals.all.ms ~= nil
  local function ms(x) return timed and ('%10.3f'):format(x.ms or 0) or '' end
  local out = { ('%s (rank %d)'):format(title or 'dist trace', dist.is_initialized() and dist.rank() or 0),
    ('  %-28s %-9s %5s %12s %14s%s  %-3s  %s'):format('kind', 'ranks', 'calls', 'bytes each', 'bytes in all',
      timed and ('%10s'):format('ms') or '', 'dir', 'where') }
  for _, r in ipairs(sorted) do
    out[#out + 1] = ('  %-28s %-9s %5d %12d %14d%s  %-3s  %s'):format(r.kind, r.ranks, r.calls, r.bytes,
      r.calls * r.bytes, ms(r), r.phase, r.site)
  end
  local kinds = {}
  for k in pairs(totals) do if k ~= 'all' and k ~= 'peak_live' then kinds[#kinds + 1] = k end end
  table.sort(kinds)
  for _, k in ipairs(kinds) do
    local t = totals[k]
    out[#out + 1] = ('  total %-20s %9d calls %14d bytes %14d on the links%s'):format(k, t.calls, t.bytes, t.bus,
      timed and (', %.3f ms'):format(t.ms or 0) or '')
  end
  out[#out + 1] = ('  total communication %13d calls %14d bytes %14d on the links%s; peak live bytes at a call %d'):format(
    totals.all.calls, totals.all.bytes, totals.all.bus, timed and (', %.3f ms'):format(totals.all.ms or 0) or '',
    totals.peak_live or 0)
  return table.concat(out, '\n')
end

-- bin/train's step end: with the trace on, step k's table on stderr and
-- the log cleared
function dist.trace_step(k)
  if not trace then return end
  io.stderr:write(dist.trace_report(('dist trace, step %s'):format(tostring(k)), true), '\n')
end

-- -------------------------------------------------------------- lifetime

local state = nil   -- { backend, device, rank, world_size, local_rank, local_world_size }

local function default_backend(opts)
  local dev = opts.device or os.getenv('MS_DEVICE')
  if type(dev) == 'string' then
    if dev:match('^cuda') then return 'nccl' end
    if dev == 'cpu' then return 'mpi' end
  end
  if type(dev) == 'number' then return dev >= 0 and 'nccl' or 'mpi' end
  return C.ms_cuda_available() ~= 0 and 'nccl' or 'mpi'
end

-- dist.init{ backend = 'nccl'|'mpi', timeout = seconds, rendezvous_timeout =
-- seconds, device = 'cuda:N' } -> the world group. The backend defaults
-- from `device`, then MS_DEVICE (bin/train --device), then whether a GPU is
-- present; NCCL's GPU is cuda:LOCAL_RANK unless `device` names one.
function dist.init(opts)
  opts = opts or {}
  if state then error('dist.init: already initialised (call dist.destroy first)', 2) end
  local bname = opts.backend or default_backend(opts)
  local bid = backend_ids[bname]
  if not bid then error(("dist.init: unknown backend %s (use 'nccl' or 'mpi')"):format(tostring(bname)), 2) end
  local o = ffi.new('ms_dist_options')
  C.ms_dist_options_default(o)
  o.backend = bid
  if opts.timeout ~= nil then
    if type(opts.timeout) ~= 'number' or opts.timeout <= 0 then
      error('dist.init: timeout must be a number of seconds > 0', 2)
    end
    o.timeout_s = opts.timeout
    o.rendezvous_timeout_s = math.min(opts.timeout, 300)
  end
  if opts.rendezvous_timeout ~= nil then
    if type(opts.rendezvous_timeout) ~= 'number' or opts.rendezvous_timeout <= 0 then
      error('dist.init: rendezvous_timeout must be a number of seconds > 0', 2)
    end
    o.rendezvous_timeout_s = opts.rendezvous_timeout
  end
  if bid == 1 and opts.device ~= nil and opts.device ~= 'cuda' then o.device = T.device_id(opts.device, 2) end
  local box = ffi.new('ms_comm*[1]')
  check(C.ms_dist_init(box, o), 2)
  local env = dist.env()
  local world = wrap_group(box[0])
  state = {
    backend = bname, rank = world:rank(), world_size = world:size(), local_rank = env.local_rank,
    local_world_size = env.local_world_size, device = C.ms_comm_device(box[0]),
  }
  if state.device >= 0 then
    C.ms_cuda_set_device(state.device)
    T.current_cuda_device = state.device
  end
  dist.world_group = world
  return world
end

function dist.is_initialized() return state ~= nil end

local function need(fname)
  if not state then error(fname .. ': dist is not initialised (call ms.dist.init first)', 3) end
  return state
end

function dist.rank() return need('rank').rank end
function dist.world_size() return need('world_size').world_size end
-- local_rank works before init too (it picks the GPU)
function dist.local_rank() return state and state.local_rank or dist.env().local_rank end
function dist.local_world_size() return state and state.local_world_size or dist.env().local_world_size end
function dist.backend() return need('backend').backend end
function dist.device() return T.device_name(need('device').device) end
function dist.get_world_group() need('get_world_group'); return dist.world_group end

-- frees every group's backend state (MPI: MPI_Finalize; NCCL: the
-- communicators and the watchdog) and stops the store; group handles still
-- held answer "destroyed"
function dist.destroy()
  if not state then return end
  check(C.ms_dist_destroy(), 2)
  state = nil
  if dist.world_group then dist.world_group:free() end
  dist.world_group = nil
  collectgarbage()
end

-- a group of the given world ranks; every rank of the world calls it (ranks
-- outside get a group whose is_member() is false)
function dist.new_group(ranks, opts)
  need('new_group')
  if type(ranks) ~= 'table' or #ranks == 0 then error('new_group: expects a list of world ranks', 2) end
  local parent = (opts and opts.group) or dist.world_group
  local arr = ffi.new('int[?]', #ranks)
  for i, r in ipairs(ranks) do
    if type(r) ~= 'number' or r ~= math.floor(r) then error('new_group: ranks must be integers', 2) end
    arr[i - 1] = r
  end
  local box = ffi.new('ms_comm*[1]')
  check(C.ms_comm_new_group(box, live(parent, 'new_group'), #ranks, arr), 2)
  local sorted = { unpack(ranks) }
  table.sort(sorted)
  return wrap_group(box[0] ~= nil and box[0] or nil, sorted)
end

-- the 2-D mesh of hybrid sharding: world rank r at (r // shard, r % shard).
-- mesh.shard: the `shard` ranks of r's row (parameters are sharded among
-- them); mesh.replicate: the `replicate` ranks of r's column (they hold the
-- same shard; gradients are all-reduced among them).
function dist.mesh(opts)
  need('mesh')
  opts = opts or {}
  local W = dist.world_size()
  local R, S = opts.replicate, opts.shard
  if R == nil and S ~= nil and S > 0 then R = W / S end
  if S == nil and R ~= nil and R > 0 then S = W / R end
  if type(R) ~= 'number' or type(S) ~= 'number' or R ~= math.floor(R) or S ~= math.floor(S) or R * S ~= W then
    error(('mesh: replicate (%s) x shard (%s) must equal the world size %d'):format(tostring(R), tostring(S), W), 2)
  end
  local rb, sb = ffi.new('ms_comm*[1]'), ffi.new('ms_comm*[1]')
  check(C.ms_comm_mesh(rb, sb, live(dist.world_group, 'mesh'), R, S), 2)
  local r = dist.rank()
  return {
    replicate = wrap_group(rb[0]), shard = wrap_group(sb[0]),
    shape = { R, S }, coord = { math.floor(r / S), r % S },
  }
end

-- ------------------------------------------------------------------ store

local Store = {}
Store.__index = Store
dist.Store = Store

local function store_p(s, fname)
  if s.p == nil then error(fname .. ': the store connection was closed', 3) end
  return s.p
end

function Store:set(key, value)
  value = tostring(value)
  check(C.ms_store_set(store_p(self, 'set'), key, value, #value), 2)
end
-- the value (waits up to timeout seconds for the key), or nil, err
function Store:get(key, timeout)
  local p = store_p(self, 'get')
  local n = ffi.new('int64_t[1]')
  local cap = 4096
  for _ = 1, 2 do
    local buf = ffi.new('char[?]', cap)
    if C.ms_store_get(p, key, buf, cap, n, timeout or 300) ~= 0 then return nil, cerr() end
    if tonumber(n[0]) <= cap then return ffi.string(buf, tonumber(n[0])) end
    cap = tonumber(n[0])
  end
  return nil, 'get: the value changed size while it was read'
end
function Store:add(key, delta)
  local r = ffi.new('int64_t[1]')
  check(C.ms_store_add(store_p(self, 'add'), key, delta or 1, r), 2)
  return tonumber(r[0])
end
-- true, or nil, err naming the missing keys
function Store:wait(keys, timeout)
  local arr = ffi.new('const char*[?]', #keys)
  for i, k in ipairs(keys) do arr[i - 1] = k end
  if C.ms_store_wait(store_p(self, 'wait'), #keys, arr, timeout or 300) ~= 0 then return nil, cerr() end
  return true
end
-- true, or nil, err naming the ranks that never arrived
function Store:barrier(name, rank, world_size, timeout)
  if C.ms_store_barrier(store_p(self, 'barrier'), name, rank, world_size, timeout or 300) ~= 0 then
    return nil, cerr()
  end
  return true
end
-- every key this client names from now on gets `prefix` first ('' for none;
-- at most 23 bytes): a namespace of keys on a store shared with others
function Store:set_prefix(prefix)
  check(C.ms_store_set_prefix(store_p(self, 'set_prefix'), prefix or ''), 2)
  return self
end
function Store:ping()
  if C.ms_store_ping(store_p(self, 'ping')) ~= 0 then return nil, cerr() end
  return true
end
function Store:close()
  if self.owned and self.p ~= nil then C.ms_store_free(ffi.gc(self.p, nil)) end
  self.p = nil
end

-- the run's rendezvous store (nil when the run has none: one rank, or MPI
-- started by mpirun without MASTER_ADDR)
function dist.store()
  local p = C.ms_dist_store()
  if p == nil then return nil end
  return setmetatable({ p = p, owned = false }, Store)
end

-- a client of a store: { host=, port=, token=, rank=, timeout= } -> Store or nil, err
function dist.store_connect(o)
  local box = ffi.new('ms_store_client*[1]')
  if C.ms_store_connect(box, o.host or '127.0.0.1', o.port, o.token or os.getenv('MS_DIST_TOKEN'), o.rank or -1,
      o.timeout or 30) ~= 0 then
    return nil, cerr()
  end
  return setmetatable({ p = ffi.gc(box[0], C.ms_store_free), owned = true }, Store)
end

local Server = {}
Server.__index = Server
dist.StoreServer = Server

-- a store served by this process: { host=, port= (0: any free one), token= }
function dist.store_server(o)
  local box = ffi.new('ms_store_server*[1]')
  check(C.ms_store_server_start(box, o.host or '127.0.0.1', o.port or 0, o.token or os.getenv('MS_DIST_TOKEN')), 2)
  return setmetatable({ p = ffi.gc(box[0], C.ms_store_server_stop) }, Server)
end
function Server:port() return C.ms_store_server_port(self.p) end
function Server:stats()
  local s = ffi.new('ms_store_stats')
  check(C.ms_store_server_stats(self.p, s), 2)
  local r = {}
  for _, k in ipairs({ 'connections', 'authenticated', 'requests', 'rejected_auth', 'rejected_oversize',
    'rejected_malformed', 'truncated', 'timed_out', 'keys', 'bytes', 'open' }) do
    r[k] = tonumber(s[k])
  end
  return r
end
function Server:stop()
  if self.p ~= nil then C.ms_store_server_stop(ffi.gc(self.p, nil)); self.p = nil end
end

dist.backend_names = backend_names
-- (MS_DIST_COUNT=2: with each row's times)
local count_env = os.getenv('MS_DIST_COUNT')
if count_env == '1' or count_env == '2' then dist.trace(true, { times = count_env == '2' }) end
return dist
