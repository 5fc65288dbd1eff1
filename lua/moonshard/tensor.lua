-- moonshard.tensor — the Tensor type of the Lua face.
--
-- A Tensor *is* the C struct ms_tensor (core/tensor.h) with an ffi.metatype:
-- C functions take it as it is, and methods live in T.methods. Handles come
-- from C and are owned through ffi.gc (the C refcount is dropped by __gc or by
-- an explicit t:free(), which releases the storage at once and is safe to call
-- twice; a freed tensor raises "tensor was freed" when used).
--
--   local T = require 'moonshard.tensor'
--   local x = T.randn({2, 3}, {seed = 1})
--   print(x.shape[2], x.dtype, x.device, x:numel())
--
-- Dims are 1-based in Lua (as in Lua and Torch7) and may be negative (-1 is
-- the last); token ids and the C core are 0-based.
local ffi = require 'ffi'
local bit = require 'bit'

local T = {}

-- The JIT's room: a training step runs through more code than LuaJIT's
-- defaults hold (512 KiB of machine code, 1000 traces); when the area
-- fills, every trace is flushed and the step runs interpreted while they
-- are recorded again. (Set once, at the first require; a program may
-- set its own after.)
if jit and jit.opt then jit.opt.start('maxmcode=16384', 'maxtrace=8000') end

-- ------------------------------------------------------------- the library
local function repo_root()
  local src = debug.getinfo(1, 'S').source
  src = src:sub(1, 1) == '@' and src:sub(2) or src
  local dir = src:match('^(.*)/lua/moonshard/[^/]*$') or src:match('^(.*)/[^/]*/[^/]*/[^/]*$')
  return dir or '.'
end
T.root = repo_root()
local build = os.getenv('MS_BUILD') or 'build'
if build:sub(1, 1) ~= '/' then build = T.root .. '/' .. build end
T.build_dir = build

local defs = dofile(build .. '/ffi_cdef.lua')
T.cdef = defs
ffi.cdef(defs.cdef)
local okC, C = pcall(ffi.load, build .. '/libmoonshard.so')
if not okC then
  error('moonshard: cannot load ' .. build .. '/libmoonshard.so (run `make` in ' .. T.root .. '): ' .. tostring(C))
end
T.C = C
T.ffi = ffi

-- ------------------------------------------------------------------ errors
function T.check(rc, level)
  if rc ~= 0 then error(ffi.string(C.ms_last_error()), (level or 1) + 1) end
end

-- ------------------------------------------------------------------ dtypes
-- f8e4m3 and f8e5m2 (torch's float8_e4m3fn, float8_e5m2) are storage
-- formats: copies, views and moonshard.float8's ops take them (core/fp8.h)
local dtype_names = { [0] = 'f64', 'f32', 'bf16', 'f16', 'i64', 'i32', 'u8', 'bool', 'f8e4m3', 'f8e5m2' }
local dtype_ids = {}
for id = 0, 9 do dtype_ids[dtype_names[id]] = id end
local aliases = {
  float64 = 'f64', double = 'f64', float32 = 'f32', float = 'f32', bfloat16 = 'bf16',
  float16 = 'f16', half = 'f16', int64 = 'i64', long = 'i64', int32 = 'i32', int = 'i32',
  uint8 = 'u8', byte = 'u8', boolean = 'bool', float8_e4m3fn = 'f8e4m3', float8_e5m2 = 'f8e5m2',
  e4m3 = 'f8e4m3', e5m2 = 'f8e5m2',
}
for k, v in pairs(aliases) do dtype_ids[k] = dtype_ids[v] end
T.dtype_names = dtype_names

function T.dtype_id(d, level)
  if d == nil then return 1 end
  if type(d) == 'number' and dtype_names[d] then return d end
  local id = dtype_ids[d]
  if not id then error(('unknown dtype %s (use f64, f32, bf16, f16, i64, i32, u8, bool, f8e4m3 or f8e5m2)'):format(tostring(d)), (level or 1) + 1) end
  return id
end
function T.dtype_name(id) return dtype_names[id] end
function T.is_float_dtype(id) return id <= 3 end

-- ----------------------------------------------------------------- devices
T.default_device = -1
function T.device_id(d, level)
  if d == nil then return T.default_device end
  if type(d) == 'number' then return d end
  if d == 'cpu' then return -1 end
  if d == 'cuda' then return T.current_cuda_device or 0 end
  local n = type(d) == 'string' and d:match('^cuda:(%d+)$')
  if n then return tonumber(n) end
  error(('unknown device %s (use cpu, cuda or cuda:N)'):format(tostring(d)), (level or 1) + 1)
end
function T.device_name(id) return id < 0 and 'cpu' or ('cuda:' .. id) end

-- ----------------------------------------------------------------- handles
local tensor_ct = ffi.typeof('ms_tensor')
local box_t = ffi.typeof('ms_tensor*[1]')
local i64_arr = ffi.typeof('int64_t[?]')
local int_arr = ffi.typeof('int[?]')

-- Lua-side metadata (autograd's grad, node, ...), keyed by the handle's id
-- (ids count up in C and are never reused) and dropped when the handle is
-- collected or freed. Entries are made by T.new_meta only.
T.meta = {}
local meta = T.meta

-- Finalizers. A handle has one owner, the cdata T.wrap returned: every
-- tensor the Lua face hands out is one, and no code makes a second cdata
-- of a handle but the ms_tensor* written into the boxes and arrays C calls
-- take. The collector frees a handle that never got an entry in T.meta
-- with ms_tensor_free itself, no Lua call (most handles: a step drops
-- thousands, and the Lua finalizer, interpreted, cost about 200 ns more a
-- handle; docs/perf-notes.md, thirty-eighth session). T.new_meta switches
-- the handle to free_handle, which drops the entry with it, so no entry
-- outlives its tensor.
local tensor_free = C.ms_tensor_free
local function free_handle(t)
  meta[tonumber(t.id)] = nil
  tensor_free(t)
end
local ptr_ct = ffi.typeof('ms_tensor *')

-- a new metadata table for t, meta[id] (id = tonumber(t.id), which has
-- none yet)
function T.new_meta(t, id)
  if ffi.istype(ptr_ct, t) then   -- (a borrowed pointer: its finalizer would free the handle twice)
    error('tensor metadata (grad, grad_fn, hooks) needs a tensor of the Lua face, not an ms_tensor* read from C', 0)
  end
  local m = {}
  meta[id] = m
  ffi.gc(t, free_handle)
  return m
end

-- Memory the GC cannot see: LuaJIT's collector counts a tensor handle as a
-- few bytes, whatever its storage holds. So the allocator's own counters
-- drive it, the way Lua's GC pause works: a full collection runs once the
-- bytes allocated since the last one exceed what was live after it (at
-- least 64 MiB). Memory then stays within about twice the live set, and
-- a steady loop reaches a steady cache (no new cudaMalloc) after one cycle.
local gc_min = 64 * 2 ^ 20
local next_gc = gc_min
local function gc_nudge()
  local total = tonumber(C.ms_bytes_allocated_total())
  if total > next_gc then
    collectgarbage()
    local live = tonumber(C.ms_live_bytes(-1)) + tonumber(C.ms_live_bytes(0))
    next_gc = tonumber(C.ms_bytes_allocated_total()) + math.max(gc_min, live)
  end
end

function T.wrap(p)
  if p == nil then error('moonshard: a C call returned no tensor', 2) end
  gc_nudge()
  -- (not `return ffi.gc(...)`: a tail call of a built-in makes LuaJIT's
  -- traces starting here abort in the caller, and once it blacklists this
  -- function every trace through an op aborts; docs/perf-notes.md, "Host
  -- cost per op")
  local t = ffi.gc(p[0], tensor_free)
  return t
end
local wrap = T.wrap

function T.is_tensor(x) return type(x) == 'cdata' and ffi.istype(tensor_ct, x) end
-- '(2, 3)' for a shape table: how error messages name shapes
function T.shape_str(s) return '(' .. table.concat(s, ', ') .. ')' end
local is_tensor = T.is_tensor

-- Calls cfn(box, ...) and returns the new tensor it put in the box.
function T.op(cfn, ...)
  local box = box_t()
  if cfn(box, ...) ~= 0 then error(ffi.string(C.ms_last_error()), 2) end
  return wrap(box[0])
end
local op = T.op

-- Calls cfn(box, ...) with box pre-set to `out` (in-place / out= forms).
function T.op_into(out, cfn, ...)
  local box = box_t()
  box[0] = out
  if cfn(box, ...) ~= 0 then error(ffi.string(C.ms_last_error()), 2) end
  return out
end

-- "name: " of the method or function that called the caller of this helper
-- (looked up by identity, so tail calls and wrappers such as autograd's do
-- not hide it; T.op_names is filled with the methods at the end of this file)
local op_names = setmetatable({}, { __mode = 'k' })
T.op_names = op_names
local function caller_op()
  local info = debug.getinfo(3, 'fn')
  if not info then return '' end
  local name = op_names[info.func]
  if not name then
    for k, v in pairs(T.methods or {}) do if v == info.func then name = k; break end end
  end
  name = name or info.name
  return name and (name .. ': ') or ''
end

-- Lua dim (1-based, negatives from the end) -> C dim (0-based); range checked.
function T.cdim(t, d, ndim_plus)
  local n = t.ndim + (ndim_plus or 0)
  if type(d) ~= 'number' or d ~= math.floor(d) then
    error(('%sdim must be an integer, got %s'):format(caller_op(), tostring(d)), 3)
  end
  if d > 0 and d <= n then return d - 1 end
  if d < 0 and d >= -n then return n + d end
  error(('%sdim %d out of range for a tensor of %d dims (use 1..%d or -%d..-1)'):format(caller_op(), d, t.ndim, n, n), 3)
end
local cdim = T.cdim

-- shape from a table or varargs: f({2,3}) or f(2,3)
local function shape_args(...)
  local a = ...
  if type(a) == 'table' then return a end
  return { ... }
end
T.shape_args = shape_args

local function shape_arr(shape, op_name)
  local n = #shape
  if n > 8 then error(('%s: %d dims requested, at most 8 are supported'):format(op_name, n), 3) end
  local arr = i64_arr(math.max(n, 1))
  for i = 1, n do
    local s = shape[i]
    if type(s) ~= 'number' or s ~= math.floor(s) then
      error(('%s: shape entries must be integers, got %s at position %d'):format(op_name, tostring(s), i), 3)
    end
    arr[i - 1] = s
  end
  return arr, n
end
T.shape_arr = shape_arr

local function ptr(t, op_name)
  if not is_tensor(t) then
    error(('%s: expected a tensor, got %s'):format(op_name or 'op', type(t)), 3)
  end
  return t
end
T.ptr = ptr

-- ------------------------------------------------------------ constructors
local function opts_of(o) return o or {} end

-- ------------------------------------------------------ deferred init
-- While defer.on (nn.deferred_init), the constructors below (empty, zeros,
-- ones, full, rand, randn and their _like forms) make tensors whose storage
-- has no data (ms_set_defer_alloc) and an init record, T.init_records[id]
-- with id in storage.init_id: {kind = 'empty'}, {kind = 'fill', value},
-- {kind = 'normal' | 'uniform', seed, offset, a, b}. The in-place
-- initialisers (fill_, copy_ of a number, zero_, normal_, uniform_) on such
-- a tensor replace its record instead of writing, and draw from the global
-- generator exactly as they would have; T.replay(t, dst) writes t's values
-- into dst later, on any device, element for element what the eager
-- construction would have written (Philox values depend only on seed and
-- offset + index). Anything else on such a tensor is an error naming it.
local defer = { on = false, next_id = 1, file_bytes = 0 }
T.defer = defer
T.init_records = {}
local function is_deferred(t)
  local st = t.storage
  return st ~= nil and st.init_id ~= 0 and st.data == nil and st.nbytes > 0
end
T.is_deferred = is_deferred
local function new_deferred(n, arr, dtype, device, rec)
  C.ms_set_defer_alloc(1)
  local box = box_t()
  local rc = C.ms_tensor_empty(box, n, arr, dtype, device)
  C.ms_set_defer_alloc(0)
  if rc ~= 0 then error(ffi.string(C.ms_last_error()), 3) end
  local t = wrap(box[0])
  if rec.dtype == nil then rec.dtype = dtype end   -- the dtype its values are made in
  if t.storage.nbytes > 0 then
    local id = defer.next_id
    defer.next_id = id + 1
    t.storage.init_id = id
    T.init_records[id] = rec
  end
  return t
end
-- the record of a deferred t, which must be the whole of its storage (an
-- initialiser on part of one cannot be replayed)
local function record_of(t, what)
  if t.offset ~= 0 or C.ms_tensor_is_contiguous(t) == 0
      or T.methods.numel(t) * C.ms_dtype_size(t.dtype_id) ~= t.storage.nbytes then
    error(('%s: a tensor made under nn.deferred_init can only be initialised whole, not through a view'):format(what), 3)
  end
  return T.init_records[t.storage.init_id]
end
local function set_record(t, rec, what)
  record_of(t, what)
  if rec.dtype == nil then rec.dtype = t.dtype_id end
  T.init_records[t.storage.init_id] = rec
end
T.set_init_record = set_record

local function raw_empty(shape, opts, name)
  local arr, n = shape_arr(shape, name or 'empty')
  return op(C.ms_tensor_empty, n, arr, T.dtype_id(opts.dtype, 3), T.device_id(opts.device, 3))
end

function T.empty(shape, opts)
  opts = opts_of(opts)
  if defer.on then
    local arr, n = shape_arr(shape, 'empty')
    return new_deferred(n, arr, T.dtype_id(opts.dtype, 2), T.device_id(opts.device, 2), { kind = 'empty' })
  end
  return raw_empty(shape, opts)
end

function T.full(shape, value, opts)
  if defer.on then
    opts = opts_of(opts)
    local arr, n = shape_arr(shape, 'full')
    if type(value) == 'boolean' then value = value and 1 or 0 end
    return new_deferred(n, arr, T.dtype_id(opts.dtype, 2), T.device_id(opts.device, 2), { kind = 'fill', value = value })
  end
  local t = T.empty(shape, opts)
  T.check(C.ms_fill_(t, value), 2)
  return t
end
function T.zeros(shape, opts) return T.full(shape, 0, opts) end
function T.ones(shape, opts) return T.full(shape, 1, opts) end
function T.zeros_like(t, opts)
  opts = opts or {}
  return T.full(t.shape, 0, { dtype = opts.dtype or t.dtype_id, device = opts.device or t.device_id })
end
function T.ones_like(t, opts)
  opts = opts or {}
  return T.full(t.shape, 1, { dtype = opts.dtype or t.dtype_id, device = opts.device or t.device_id })
end
function T.empty_like(t, opts)
  opts = opts or {}
  return T.empty(t.shape, { dtype = opts.dtype or t.dtype_id, device = opts.device or t.device_id })
end

-- arange(stop) / arange(start, stop[, step]) [, opts]; end exclusive
function T.arange(a, b, c, d)
  local start, stop, step, opts
  if type(b) ~= 'number' then start, stop, step, opts = 0, a, 1, b
  elseif type(c) ~= 'number' then start, stop, step, opts = a, b, 1, c
  else start, stop, step, opts = a, b, c, d end
  if step == 0 then error('arange: step must not be 0', 2) end
  local n = math.max(0, math.ceil((stop - start) / step))
  opts = opts or {}
  local dtype = opts.dtype
  if dtype == nil then
    dtype = (start % 1 == 0 and step % 1 == 0) and 'i64' or 'f32'
  end
  local t = raw_empty({ n }, { dtype = dtype, device = opts.device }, 'arange')
  T.check(C.ms_arange_(t, start, step), 2)
  return t
end

-- Global generator: a seed plus an offset that advances with every draw, so
-- consecutive draws continue one Philox stream. opts.seed (with opts.offset)
-- draws from an explicit stream and leaves the global one alone.
local rng = { seed = 0, offset = 0 }
T.rng = rng
function T.manual_seed(seed)
  rng.seed, rng.offset = seed, 0
end
function T.rng_state() return { seed = rng.seed, offset = rng.offset } end
function T.set_rng_state(s) rng.seed, rng.offset = s.seed, s.offset end

local function draw(shape, opts, fn, p1, p2)
  opts = opts_of(opts)
  local t = T.empty(shape, opts)
  local seed, offset = opts.seed, opts.offset or 0
  if seed == nil then
    seed, offset = rng.seed, rng.offset
    local n = t:numel()
    rng.offset = rng.offset + math.ceil(n / 4) * 4
  end
  if is_deferred(t) then
    T.init_records[t.storage.init_id] = { kind = fn == C.ms_randn_ and 'normal' or 'uniform', seed = seed,
      offset = offset, a = p1, b = p2, dtype = t.dtype_id }
    return t
  end
  T.check(fn(t, seed, offset, p1, p2), 3)
  return t
end
function T.rand(shape, opts) return draw(shape, opts, C.ms_rand_, 0, 1) end
function T.randn(shape, opts) return draw(shape, opts, C.ms_randn_, 0, 1) end
function T.uniform_(t, lo, hi, opts)
  opts = opts or {}
  local seed, offset = opts.seed, opts.offset or 0
  if seed == nil then
    seed, offset = rng.seed, rng.offset
    rng.offset = rng.offset + math.ceil(t:numel() / 4) * 4
  end
  if is_deferred(t) then
    set_record(t, { kind = 'uniform', seed = seed, offset = offset, a = lo, b = hi }, 'uniform_')
    return t
  end
  T.check(C.ms_rand_(t, seed, offset, lo, hi), 2)
  return t
end
function T.normal_(t, mean, std, opts)
  opts = opts or {}
  local seed, offset = opts.seed, opts.offset or 0
  if seed == nil then
    seed, offset = rng.seed, rng.offset
    rng.offset = rng.offset + math.ceil(t:numel() / 4) * 4
  end
  if is_deferred(t) then
    set_record(t, { kind = 'normal', seed = seed, offset = offset, a = mean, b = std }, 'normal_')
    return t
  end
  T.check(C.ms_randn_(t, seed, offset, mean, std), 2)
  return t
end

-- T.replay(t, dst, first = 0): writes elements first .. first + #dst - 1
-- (row-major) of the values deferred t's record gives into dst (a tensor
-- with data, any dtype, device and layout; values made in the record's
-- dtype, then converted). A 'file' record ({kind = 'file', path, offset,
-- dtype}: a tensor of a safetensors file, S.load_deferred) reads just those
-- elements' bytes; an 'fn' record (T.deferred_fn) has its function make them.
function T.replay(t, dst, first)
  local rec = T.init_records[t.storage.init_id]
  if rec == nil then error('replay: the tensor has no deferred-init record', 2) end
  first = first or 0
  local n = T.methods.numel(dst)
  if first < 0 or first + n > T.methods.numel(t) then
    error(('replay: elements [%d, %d) of a tensor of %d'):format(first, first + n, T.methods.numel(t)), 2)
  end
  if rec.kind == 'fn' then
    -- (T.deferred_fn: the function makes the elements, a host tensor of n)
    local host = rec.fn(first, n)
    local v = T.methods.view(host, dst.shape)
    T.check(C.ms_tensor_copy_(dst, v), 2)
    v:free()
    return dst
  end
  if rec.kind == 'file' then
    local esz = C.ms_dtype_size(rec.dtype)
    local host = raw_empty({ n }, { dtype = rec.dtype })
    T.check(C.ms_file_read_into(rec.path, rec.offset + first * esz, n * esz, host), 2)
    defer.file_bytes = defer.file_bytes + n * esz   -- (read from files by replays, for the specs)
    local v = T.methods.view(host, dst.shape)
    T.check(C.ms_tensor_copy_(dst, v), 2)
    v:free(); host:free()
    return dst
  end
  -- made in the dtype the record was made in (a deferred tensor moved with
  -- to('f64') has the values the eager f32 draw, then converted, would have)
  local mk = rec.dtype or t.dtype_id
  local tmp = dst
  if dst.dtype_id ~= mk then tmp = raw_empty({ n }, { dtype = mk, device = dst.device_id }) end
  if rec.kind == 'normal' then T.check(C.ms_randn_(tmp, rec.seed, rec.offset + first, rec.a, rec.b), 2)
  elseif rec.kind == 'uniform' then T.check(C.ms_rand_(tmp, rec.seed, rec.offset + first, rec.a, rec.b), 2)
  else T.check(C.ms_fill_(tmp, rec.kind == 'fill' and rec.value or 0), 2) end
  if tmp ~= dst then
    local v = T.methods.view(tmp, dst.shape)
    T.check(C.ms_tensor_copy_(dst, v), 2)
    v:free(); tmp:free()
  end
  return dst
end

-- T.deferred_file(path, offset, dtype, shape): a deferred tensor whose
-- values are the bytes at `offset` of the file (a safetensors entry)
function T.deferred_file(path, offset, dtype, shape)
  local arr, n = shape_arr(shape, 'deferred_file')
  local id = T.dtype_id(dtype, 2)
  return new_deferred(n, arr, id, -1, { kind = 'file', path = path, offset = offset, dtype = id })
end

-- T.deferred_fn(shape, dtype, fn): a deferred tensor whose values fn makes
-- on demand: fn(first, n) -> a contiguous host tensor of n elements (any
-- shape), elements first .. first + n - 1 (row-major) of the whole (a
-- checkpoint's tensor converted as it is read: each FSDP rank asks for its
-- shard's range only)
function T.deferred_fn(shape, dtype, fn)
  local arr, n = shape_arr(shape, 'deferred_fn')
  local id = T.dtype_id(dtype, 2)
  return new_deferred(n, arr, id, -1, { kind = 'fn', fn = fn, dtype = id })
end

-- T.materialize(t): gives deferred t's storage its data and writes its
-- values (every view of the storage sees them); false when t was not deferred
function T.materialize(t)
  if not is_deferred(t) then return false end
  record_of(t, 'materialize')
  T.check(C.ms_storage_alloc_data(t), 2)
  T.replay(t, t)
  T.init_records[t.storage.init_id] = nil
  return true
end

-- ms.tensor(nested table | number | boolean | tensor, opts)
function T.tensor(data, opts)
  opts = opts_of(opts)
  if is_tensor(data) then
    return data:to({ dtype = opts.dtype or data.dtype_id, device = opts.device or data.device_id, copy = true })
  end
  local shape = {}
  if type(data) == 'table' then
    local v = data
    while type(v) == 'table' do shape[#shape + 1] = #v; v = v[1] end
  elseif type(data) ~= 'number' and type(data) ~= 'boolean' then
    error(('tensor: expected a number, boolean or nested table, got %s'):format(type(data)), 2)
  end
  -- every leaf must sit at the same depth
  local ndim = #shape
  local flat, k, isbool = {}, 0, false
  local function walk(v, depth, path)
    if type(v) == 'table' then
      if depth > ndim then error(('tensor: ragged nested table at %s'):format(path), 4) end
      if #v ~= shape[depth] then
        error(('tensor: ragged nested table: %s has %d elements where %d were expected'):format(path, #v, shape[depth]), 4)
      end
      for i = 1, #v do walk(v[i], depth + 1, path .. '[' .. i .. ']') end
    else
      if depth <= ndim then error(('tensor: ragged nested table: %s is a scalar at depth %d of %d'):format(path, depth - 1, ndim), 4) end
      if type(v) ~= 'number' and type(v) ~= 'boolean' then
        error(('tensor: %s is a %s, expected a number or boolean'):format(path, type(v)), 4)
      end
      k = k + 1
      if type(v) == 'boolean' then isbool = true; v = v and 1 or 0 end
      flat[k] = v
    end
  end
  walk(data, 1, 'data')
  local dtype = opts.dtype or (isbool and 'bool' or 'f32')
  local device = T.device_id(opts.device, 2)
  local host = raw_empty(shape, { dtype = 'f64' }, 'tensor')   -- (filled here: never deferred)
  local p = ffi.cast('double*', C.ms_tensor_data(host))
  for i = 1, k do p[i - 1] = flat[i] end
  local id = T.dtype_id(dtype, 2)
  if id == 0 and device < 0 then return host end
  local out = raw_empty(shape, { dtype = id, device = device }, 'tensor')
  T.check(C.ms_tensor_copy_(out, host), 2)
  host:free()
  return out
end

-- ----------------------------------------------------------------- methods
local M = {}
T.methods = M

local function live(t, name)
  if t.storage == nil then error((name or 'op') .. ': tensor was freed', 3) end
end
T.live = live

function M.numel(t) return tonumber(C.ms_tensor_numel(t)) end
function M.dim(t) return t.ndim end
function M.size(t, d)
  if d == nil then return t.shape end
  return tonumber(t.sizes[cdim(t, d)])
end
function M.stride(t, d)
  if d == nil then
    local s = {}
    for i = 0, t.ndim - 1 do s[i + 1] = tonumber(t.strides[i]) end
    return s
  end
  return tonumber(t.strides[cdim(t, d)])
end
function M.storage_offset(t) return tonumber(t.offset) end
function M.is_contiguous(t) return C.ms_tensor_is_contiguous(t) ~= 0 end
function M.data_ptr(t)
  T.check(C.ms_tensor_check_live(t, 'data_ptr'), 2)   -- freed, released or deferred: an error, not NULL
  return C.ms_tensor_data(t)
end
function M.is_floating_point(t) return t.dtype_id <= 3 or t.dtype_id >= 8 end
function M.is_freed(t) return t.storage == nil end
function M.free(t)
  C.ms_tensor_release(t)
  meta[tonumber(t.id)] = nil
end
function M.element_size(t) return C.ms_dtype_size(t.dtype_id) end

-- views (share storage with t)
function M.view(t, ...)
  local arr, n = shape_arr(shape_args(...), 'view')
  return op(C.ms_tensor_view, t, n, arr)
end
function M.reshape(t, ...)
  local arr, n = shape_arr(shape_args(...), 'reshape')
  return op(C.ms_tensor_reshape, t, n, arr)
end
function M.view_as(t, other) return M.view(t, other.shape) end
function M.flatten(t, d0, d1)
  d0, d1 = d0 or 1, d1 or -1
  if t.ndim == 0 then return M.reshape(t, { 1 }) end
  local a, b = cdim(t, d0) + 1, cdim(t, d1) + 1
  local shape, s = {}, t.shape
  for i = 1, a - 1 do shape[#shape + 1] = s[i] end
  local m = 1
  for i = a, b do m = m * s[i] end
  shape[#shape + 1] = m
  for i = b + 1, #s do shape[#shape + 1] = s[i] end
  return M.reshape(t, shape)
end
-- narrow(dim, start, length): start is 1-based
function M.narrow(t, d, start, length)
  live(t, 'narrow')
  local n = tonumber(t.sizes[cdim(t, d)])
  local given = start
  if start < 0 then start = n + start + 1 end
  if start < 1 or length < 0 or start - 1 + length > n then  -- 1-based in the message too, as given
    error(('narrow: start %d length %d out of range for dim %d of size %d (shape (%s))'):format(
      given, length, d, n, table.concat(t.shape, ',')), 2)
  end
  return op(C.ms_tensor_narrow, t, cdim(t, d), start - 1, length)
end
function M.select(t, d, i)
  local cd = cdim(t, d)
  local n = tonumber(t.sizes[cd])
  local given = i
  if i < 0 then i = n + i + 1 end
  if i < 1 or i > n then  -- the index as given (1-based, or negative from the end)
    error(('select: index %d out of range for dim %d of size %d'):format(given, d, n), 2)
  end
  local v = op(C.ms_tensor_narrow, t, cd, i - 1, 1)
  return op(C.ms_tensor_squeeze, v, cd)
end
function M.transpose(t, d0, d1) return op(C.ms_tensor_transpose, t, cdim(t, d0), cdim(t, d1)) end
function M.t(t)
  if t.ndim ~= 2 then error(('t: expects a 2-D tensor, got %d dims'):format(t.ndim), 2) end
  return op(C.ms_tensor_transpose, t, 0, 1)
end
function M.permute(t, ...)
  local p = shape_args(...)
  local arr = int_arr(math.max(#p, 1))
  local seen = {}
  for i = 1, #p do
    arr[i - 1] = cdim(t, p[i])
    -- (named here as given: the core's message counts dims from 0)
    if seen[arr[i - 1]] then
      error(('permute: dim %d repeated in (%s)'):format(p[i], table.concat(p, ',')), 2)
    end
    seen[arr[i - 1]] = true
  end
  return op(C.ms_tensor_permute, t, #p, arr)
end
function M.expand(t, ...)
  local arr, n = shape_arr(shape_args(...), 'expand')
  return op(C.ms_tensor_expand, t, n, arr)
end
function M.expand_as(t, other) return M.expand(t, other.shape) end
function M.squeeze(t, d)
  if d == nil then return op(C.ms_tensor_squeeze, t, -1000) end
  return op(C.ms_tensor_squeeze, t, cdim(t, d))
end
function M.unsqueeze(t, d) return op(C.ms_tensor_unsqueeze, t, cdim(t, d, 1)) end
function M.alias(t) return op(C.ms_tensor_alias, t) end

-- copies
function M.contiguous(t)
  live(t, 'contiguous')
  if C.ms_tensor_is_contiguous(t) ~= 0 then return t end
  return op(C.ms_tensor_contiguous, t)   -- (named so in the op count)
end
function M.clone(t) return op(C.ms_tensor_clone, t) end
function M.copy_(t, src)
  if is_deferred(t) then
    if is_tensor(src) then
      if not is_deferred(src) or M.numel(src) ~= M.numel(t) then
        error('copy_: a tensor made under nn.deferred_init takes only a number or another such tensor of its size '
          .. '(materialize it first: nn.materialize)', 2)
      end
      set_record(t, T.init_records[src.storage.init_id], 'copy_')
    else
      set_record(t, { kind = 'fill', value = type(src) == 'boolean' and (src and 1 or 0) or src }, 'copy_')
    end
    return t
  end
  if not is_tensor(src) then
    T.check(C.ms_fill_(t, src), 2)
  else
    T.check(C.ms_tensor_copy_(t, src), 2)
  end
  return t
end
-- the same copy, kept unversioned when autograd wraps copy_ (the engine's
-- own buffers: FSDP's gathers)
T.raw_copy_ = M.copy_
-- to('bf16') / to('cuda') / to('cuda:1') / to{dtype=, device=, copy=}
-- (one argument of to() applied to (dtype, device, copy); a function of its
-- own, not a closure made each call, so that traces compile through to())
local function to_arg(x, dtype, device, copy)
  if x == nil then return dtype, device, copy end
  if type(x) == 'table' then
    if x.dtype then dtype = T.dtype_id(x.dtype, 4) end
    if x.device then device = T.device_id(x.device, 4) end
    copy = x.copy or copy
  elseif dtype_ids[x] then dtype = dtype_ids[x]
  elseif type(x) == 'string' and x ~= 'cpu' and not x:match('^cuda') then
    error(('to: unknown dtype or device %s (dtypes: f64, f32, bf16, f16, i64, i32, u8, bool, f8e4m3, f8e5m2; '
      .. 'devices: cpu, cuda, cuda:N)'):format(x), 4)
  else device = T.device_id(x, 4) end
  return dtype, device, copy
end
function M.to(t, a, b)
  local dtype, device, copy = to_arg(a, t.dtype_id, t.device_id, false)
  dtype, device, copy = to_arg(b, dtype, device, copy)
  if not copy and dtype == t.dtype_id and device == t.device_id then return t end
  if is_deferred(t) then
    -- still deferred, on the new device / in the new dtype, the same record
    local arr, n = shape_arr(t.shape, 'to')
    return new_deferred(n, arr, dtype, device, record_of(t, 'to'))
  end
  return op(C.ms_tensor_to, t, dtype, device)
end
function M.float(t) return M.to(t, 'f32') end
function M.double(t) return M.to(t, 'f64') end
function M.bf16(t) return M.to(t, 'bf16') end
function M.half(t) return M.to(t, 'f16') end
function M.long(t) return M.to(t, 'i64') end
function M.int(t) return M.to(t, 'i32') end
function M.bool(t) return M.to(t, 'bool') end
function M.cpu(t) return M.to(t, 'cpu') end
function M.cuda(t, n) return M.to(t, n and ('cuda:' .. n) or 'cuda') end
function M.type_as(t, o) return M.to(t, { dtype = o.dtype_id }) end

-- host values
local function host_f64(t)
  live(t, 'read')
  local h = op(C.ms_tensor_to, t, 0, -1)
  return h, ffi.cast('double*', C.ms_tensor_data(h))
end
local item_err = ffi.new('int[1]')
function M.item(t)
  live(t, 'item')
  local n = M.numel(t)
  if n ~= 1 then
    error(('item: a tensor of shape (%s) with %d elements cannot be converted to a number'):format(
      table.concat(t.shape, ','), n), 2)
  end
  -- the value comes back from C in a register: a load through a pointer
  -- into a host copy freed here may be fused (by the JIT) into the caller's
  -- use of v, after the free (a + b * x:item() then reads freed memory)
  local v = C.ms_tensor_item(t, item_err)
  if item_err[0] ~= 0 then error(ffi.string(C.ms_last_error()), 2) end
  if t.dtype_id == 7 then return v ~= 0 end
  return v
end
function M.totable(t)
  local h, p = host_f64(t)
  local shape = t.shape
  local isbool = t.dtype_id == 7
  local k = 0
  local function build(d)
    if d > #shape then
      local v = p[k]; k = k + 1
      if isbool then return v ~= 0 end
      return v
    end
    local r = {}
    for i = 1, shape[d] do r[i] = build(d + 1) end
    return r
  end
  local r = build(1)
  h:free()
  return r
end
-- element access with 1-based indices: t:get(i, j), t:set(i, j, v)
function M.get(t, ...)
  local idx = { ... }
  if #idx ~= t.ndim then error(('get: %d indices for a tensor of %d dims'):format(#idx, t.ndim), 2) end
  local v = t
  for i = #idx, 1, -1 do v = M.select(v, i, idx[i]) end
  return M.item(v)
end
function M.set(t, ...)
  local n = select('#', ...)
  local idx = { ... }
  local value = idx[n]
  if n - 1 ~= t.ndim then error(('set: %d indices for a tensor of %d dims'):format(n - 1, t.ndim), 2) end
  local v = t
  for i = n - 1, 1, -1 do v = M.select(v, i, idx[i]) end
  T.check(C.ms_fill_(v, value), 2)
  return t
end

-- ---------------------------------------------------------------- printing
local function fmt_number(v, spec)
  if v ~= v then return 'nan' end
  if v == math.huge then return 'inf' end
  if v == -math.huge then return '-inf' end
  return spec:format(v)
end

-- choose one format for all printed values, as PyTorch does
local function choose_format(vals, dtype_id)
  if dtype_id == 7 then return function(v) return v ~= 0 and 'true' or 'false' end end
  if dtype_id >= 4 and dtype_id <= 6 then return function(v) return ('%d'):format(v) end end
  local all_int, maxabs, minabs = true, 0, math.huge
  for _, v in ipairs(vals) do
    if v == v and v ~= math.huge and v ~= -math.huge then
      if v ~= math.floor(v) then all_int = false end
      local a = math.abs(v)
      if a > maxabs then maxabs = a end
      if a > 0 and a < minabs then minabs = a end
    end
  end
  local wide = minabs ~= math.huge and maxabs / minabs > 1e3
  if all_int and maxabs < 1e8 and not wide then return function(v) return fmt_number(v, '%.0f.') end end
  if maxabs >= 1e8 or (minabs < 1e-4) or wide then
    return function(v) return fmt_number(v, '%.4e') end
  end
  return function(v) return fmt_number(v, '%.4f') end
end

function T.format(t, name)
  name = name or 'tensor'
  if t.storage == nil then return name .. '(<freed>)' end
  local shape = t.shape
  local n = M.numel(t)
  local summarize = n > 1000
  local edge = 3
  local h, p = host_f64(t)
  -- gather printed values (skipping the middle of long dims when summarising)
  local function index_list(size)
    if summarize and size > 2 * edge then
      local l = {}
      for i = 1, edge do l[#l + 1] = i end
      l[#l + 1] = false
      for i = size - edge + 1, size do l[#l + 1] = i end
      return l
    end
    local l = {}
    for i = 1, size do l[i] = i end
    return l
  end
  local strides = {}
  do
    local s = 1
    for d = #shape, 1, -1 do strides[d] = s; s = s * shape[d] end
  end
  local vals = {}
  local function collect(d, off)
    if d > #shape then vals[#vals + 1] = p[off]; return end
    for _, i in ipairs(index_list(shape[d])) do
      if i then collect(d + 1, off + (i - 1) * strides[d]) end
    end
  end
  if n > 0 then collect(1, 0) end
  local f = choose_format(vals, t.dtype_id)
  local width = 0
  for _, v in ipairs(vals) do width = math.max(width, #f(v)) end
  local indent = #name + 1
  local function render(d, off)
    if d > #shape then
      local s = f(p[off])
      return (' '):rep(width - #s) .. s
    end
    local parts = {}
    for _, i in ipairs(index_list(shape[d])) do
      if i then parts[#parts + 1] = render(d + 1, off + (i - 1) * strides[d])
      else parts[#parts + 1] = '...' end
    end
    if d == #shape then return '[' .. table.concat(parts, ', ') .. ']' end
    local sep = ',' .. ('\n'):rep(#shape - d) .. (' '):rep(indent + d)
    return '[' .. table.concat(parts, sep) .. ']'
  end
  local body
  if n == 0 then body = '[]' elseif #shape == 0 then body = f(p[0]) else body = render(1, 0) end
  h:free()
  local extra = {}
  if summarize or n == 0 then extra[#extra + 1] = 'shape=(' .. table.concat(shape, ', ') .. ')' end
  if t.device_id >= 0 then extra[#extra + 1] = "device='" .. T.device_name(t.device_id) .. "'" end
  if t.dtype_id ~= 1 then extra[#extra + 1] = 'dtype=' .. dtype_names[t.dtype_id] end
  if T.format_extra then
    local e = T.format_extra(t)
    if e then extra[#extra + 1] = e end
  end
  if #extra > 0 then body = body .. ', ' .. table.concat(extra, ', ') end
  return name .. '(' .. body .. ')'
end

-- ---------------------------------------------------------------- metatype
-- properties computed on access
local props = {
  shape = function(t)
    local s = {}
    for i = 0, t.ndim - 1 do s[i + 1] = tonumber(t.sizes[i]) end
    return s
  end,
  dtype = function(t) return dtype_names[t.dtype_id] end,
  device = function(t) return T.device_name(t.device_id) end,
  is_cuda = function(t) return t.device_id >= 0 end,
  -- the storage's version: bumped by each in-place write of the Lua face
  -- (autograd checks the tensors a node saved against it)
  _version = function(t) return t.storage ~= nil and tonumber(t.storage.version) or 0 end,
}
T.props = props

local mt = {
  __index = function(t, k)
    local m = M[k]
    if m ~= nil then return m end
    local p = props[k]
    if p then return p(t) end
    return nil
  end,
  __newindex = function(t, k, v)
    local set = T.setters and T.setters[k]
    if set then return set(t, v) end
    error(('tensor: cannot set field %s'):format(tostring(k)), 2)
  end,
  __tostring = function(t) return T.format(t) end,
  __add = function(a, b) return M.add(a, b) end,
  __sub = function(a, b) return M.sub(a, b) end,
  __mul = function(a, b) return M.mul(a, b) end,
  __div = function(a, b) return M.div(a, b) end,
  __pow = function(a, b) return M.pow(a, b) end,
  __unm = function(a) return M.neg(a) end,
  __len = function(t) return t.ndim > 0 and tonumber(t.sizes[0]) or 0 end,
}
T.mt = mt
ffi.metatype(tensor_ct, mt)
for k, f in pairs(M) do op_names[f] = k end
for k, f in pairs(T) do if type(f) == 'function' then op_names[f] = op_names[f] or k end end

-- flags bits shared with other layers
T.FLAG_REQUIRES_GRAD = 1
T.bit = bit

return T
