-- moonshard.fsdp — fully sharded data parallel: the flat parameter
-- (core/fsdp/flat.h) and its three collective steps, and on top of them
-- the fully_shard runtime (units by policy, an untied LM head a unit of its
-- own; FULL_SHARD, SHARD_GRAD_OP,
-- NO_SHARD, HYBRID_SHARD; prefetch with a limit; mixed precision; no_sync;
-- clip_grad_norm; fsdp.AdamW / fsdp.SGD / fsdp.optimizer over the master shards),
-- the same code for CPU tensors over MPI and CUDA tensors over NCCL
-- (docs/fsdp.md).
--
--   local ms = require 'moonshard'
--   ms.dist.init{ backend = 'mpi' }
--   local fp = ms.fsdp.FlatParam.new({ w1, b1, w2 })      -- the group: the world
--   fp.shard                          -- this rank's f32 master shard (the optimizer's view)
--   local views = fp:unshard()        -- all-gather: every parameter, original shapes
--   ...                               -- compute with views[i]
--   local g, gviews = fp:grad_buffer()   -- zeroed unsharded gradient, views into it
--   ...                               -- accumulate into gviews[i]
--   local gs = fp:reduce_scatter(g, 'avg')  -- this rank's f32 gradient shard
--   fp:reshard()                      -- frees the unsharded buffer, keeps the shard
--
-- Layout rules (flat.h): each parameter starts at a multiple of `align` bytes
-- (16), the padding between them and at the end is zero, the total is a
-- multiple of the group size, and rank r's shard is elements
-- [r * shard_numel, (r + 1) * shard_numel) of the flat buffer. Parameter
-- indices are 1-based (Lua lists); ranks, offsets and starts are 0-based
-- element counts, as in the C API.
local ffi = require 'ffi'
-- the units by the address of their unsharded buffer's storage (its views
-- share it): fsdp.releases_after_forward; weak values, a dropped model's
-- units go
local flat_units = setmetatable({}, { __mode = 'v' })
local function storage_key(t) return tonumber(ffi.cast('intptr_t', t.storage)) end
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local C = T.C
-- the engine's writes into its own buffers (unsharded parameters, gradient
-- buffers, shards) leave the storages' versions alone (docs/autograd.md)
local raw_copy = T.raw_copy_
local function no_grad(fn) return require('moonshard.autograd').no_grad(fn) end

local fsdp = {}

local function check(rc, level)
  if rc ~= 0 then error(ffi.string(C.ms_last_error()), (level or 1) + 1) end
end
local function raw_zero(t) check(C.ms_fill_(t, 0), 2) end

-- ------------------------------------------------------------------ layout

local Layout = {}
Layout.__index = Layout
fsdp.Layout = Layout

-- fsdp.layout(numels, { group_size =, elem_size = 4, align = 16 }) -> Layout
function fsdp.layout(numels, opts)
  opts = opts or {}
  if type(numels) ~= 'table' then error('fsdp.layout: numels must be a list of numbers', 2) end
  local n = #numels
  local arr = ffi.new('int64_t[?]', math.max(n, 1))
  for i = 1, n do
    local v = numels[i]
    if type(v) ~= 'number' or v < 0 or v ~= math.floor(v) then
      error(('fsdp.layout: parameter %d has numel %s (must be an integer >= 0)'):format(i, tostring(v)), 2)
    end
    arr[i - 1] = numels[i]
  end
  local box = ffi.new('ms_flat_layout*[1]')
  check(C.ms_flat_layout_new(box, n, arr, opts.elem_size or 4, opts.group_size or 1, opts.align or 16), 2)
  local p = ffi.gc(box[0], C.ms_flat_layout_free)
  local l = setmetatable({
    p = p, nparams = n, group_size = C.ms_flat_layout_group_size(p),
    elem_size = tonumber(C.ms_flat_layout_elem_size(p)), align = tonumber(C.ms_flat_layout_align(p)),
    used = tonumber(C.ms_flat_layout_used(p)), total = tonumber(C.ms_flat_layout_total(p)),
    shard_numel = tonumber(C.ms_flat_layout_shard_numel(p)),
    offsets = {}, numels = {},
  }, Layout)
  for i = 1, n do
    l.offsets[i] = tonumber(C.ms_flat_layout_offset(p, i - 1))
    l.numels[i] = tonumber(C.ms_flat_layout_numel(p, i - 1))
  end
  return l
end

-- the part of parameter i (1-based) in rank's shard (0-based):
-- { param_start =, numel =, shard_offset = } (numel 0: none)
function Layout:slice(rank, i)
  local s = ffi.new('ms_flat_slice')
  check(C.ms_flat_layout_slice(self.p, rank, (i or 0) - 1, s), 2)
  return { param_start = tonumber(s.param_start), numel = tonumber(s.numel), shard_offset = tonumber(s.shard_offset) }
end

-- every parameter's slice for one rank, a list
function Layout:slices(rank)
  local r = {}
  for i = 1, self.nparams do r[i] = self:slice(rank, i) end
  return r
end

function Layout:__tostring()
  return ('fsdp.Layout(%d parameters, used %d, total %d = %d x %d, align %d elements of %d bytes)'):format(
    self.nparams, self.used, self.total, self.group_size, self.shard_numel, self.align, self.elem_size)
end

-- -------------------------------------------------------------- FlatParam

local FlatParam = {}
FlatParam.__index = FlatParam
fsdp.FlatParam = FlatParam

-- FlatParam.new(params, { group =, dtype =, master_dtype =, align = 16, rank =,
-- world_size = })
-- params: a list of tensors (any shapes) on one device (CPU: MPI; CUDA: NCCL). group: a dist group (default:
-- the world when dist is initialised, else one rank); rank/world_size
-- override it for layouts without collectives. dtype: the unsharded buffer's,
-- the one all-gathered (default: the first parameter's). master_dtype: the
-- shard's (default f32, f64 when dtype is f64). The shard is filled from
-- `params`.
function FlatParam.new(params, opts)
  opts = opts or {}
  if type(params) ~= 'table' or #params == 0 then
    error('FlatParam.new: params must be a non-empty list of tensors', 2)
  end
  local group = opts.group
  if group == nil and opts.world_size == nil and dist.is_initialized() then group = dist.world_group end
  local world_size = opts.world_size or (group and group:size()) or 1
  local rank = opts.rank or (group and group:rank()) or 0
  if rank < 0 or rank >= world_size then
    error(('FlatParam.new: rank %d out of range for a group of %d'):format(rank, world_size), 2)
  end
  local dtype = opts.dtype or params[1].dtype
  local shapes, numels = {}, {}
  for i, p in ipairs(params) do
    if not T.is_tensor(p) then error(('FlatParam.new: parameter %d is a %s, not a tensor'):format(i, type(p)), 2) end
    if p.device_id ~= params[1].device_id then
      error(('FlatParam.new: parameter %d is on %s, parameter 1 on %s (one device per flat parameter)'):format(
        i, p.device, params[1].device), 2)
    end
    shapes[i], numels[i] = p.shape, p:numel()
  end
  local elem = T.empty({ 0 }, { dtype = dtype }):element_size()
  local ok, layout = pcall(fsdp.layout, numels, { group_size = world_size, elem_size = elem, align = opts.align or 16 })
  if not ok then error('FlatParam.new: ' .. tostring(layout), 2) end
  local self = setmetatable({
    layout = layout, group = group, rank = rank, world_size = world_size, dtype = dtype,
    master_dtype = opts.master_dtype or (dtype == 'f64' and 'f64' or 'f32'),
    shapes = shapes, numels = numels, nparams = #params, device = params[1].device_id,
    shard_numel = layout.shard_numel, total = layout.total,
  }, FlatParam)
  -- no recording: the parameters may require grad (a reshape would put
  -- them on the tape and keep them alive)
  local deferred = false
  for _, p in ipairs(params) do if T.is_deferred(p) then deferred = true; break end end
  no_grad(function()
    if deferred then
      -- (nn.deferred_init) only this rank's shard is made: each parameter's
      -- part of it written from its record (a file's bytes, a draw, a fill)
      self.shard = self:shard_of(params)
      return
    end
    local flat = self:flatten(params, self.master_dtype)
    local mine = self:local_shard(flat)
    self.shard = mine:clone()
    mine:free()
    flat:free()
  end)
  return self
end

-- a new zero-padded flat tensor (layout.total elements, dtype: self.dtype
-- unless given) holding `params`
function FlatParam:flatten(params, dtype)
  if #params ~= self.nparams then
    error(('flatten: %d tensors for a flat parameter of %d'):format(#params, self.nparams), 2)
  end
  local flat = T.zeros({ self.total }, { dtype = dtype or self.dtype, device = self.device })
  for i, p in ipairs(params) do
    if p:numel() ~= self.numels[i] then
      error(('flatten: parameter %d has %d elements, the layout %d'):format(i, p:numel(), self.numels[i]), 2)
    end
    if self.numels[i] > 0 and T.is_deferred(p) then
      -- made under nn.deferred_init: its recorded values, written here
      local dst = flat:narrow(1, self.layout.offsets[i] + 1, self.numels[i])
      T.replay(p, dst)
      dst:free()
    elseif self.numels[i] > 0 then
      local dst, src = flat:narrow(1, self.layout.offsets[i] + 1, self.numels[i]), p:reshape(self.numels[i])
      raw_copy(dst, src)
      dst:free(); src:free()
    end
  end
  return flat
end

-- this rank's shard (master dtype, zero-padded) of `params`, written part by
-- part: a deferred parameter's part from its record (T.replay from the
-- element where the shard starts in it), another's copied
function FlatParam:shard_of(params)
  local S = self.shard_numel
  local s0 = self.rank * S
  local shard = T.zeros({ S }, { dtype = self.master_dtype, device = self.device })
  for i, p in ipairs(params) do
    local o, n = self.layout.offsets[i], self.numels[i]
    local a, b = math.max(o, s0), math.min(o + n, s0 + S)
    if b > a then
      local dst = shard:narrow(1, a - s0 + 1, b - a)
      if T.is_deferred(p) then
        T.replay(p, dst, a - o)
      else
        local src = p:reshape(n)
        local part = src:narrow(1, a - o + 1, b - a)
        raw_copy(dst, part)
        part:free(); src:free()
      end
      dst:free()
    end
  end
  return shard
end

-- each parameter as a view of `flat` (a tensor of layout.total elements), in
-- its original shape. (Every handle on a view holds the buffer's storage:
-- an intermediate left to the collector would keep a freed gradient buffer
-- allocated until it ran, so each is released here.)
function FlatParam:views(flat)
  if not T.is_tensor(flat) or flat:numel() ~= self.total or flat:dim() ~= 1 then
    error(('views: need a 1-d flat tensor of %d elements'):format(self.total), 2)
  end
  local r = {}
  for i = 1, self.nparams do
    local n = flat:narrow(1, self.layout.offsets[i] + 1, self.numels[i])
    r[i] = n:view(self.shapes[i])
    n:free()
  end
  return r
end

-- this rank's shard of a flat tensor: a view (narrow), no copy
function FlatParam:local_shard(flat, rank)
  rank = rank or self.rank
  return flat:narrow(1, rank * self.shard_numel + 1, self.shard_numel)
end

-- the slices of every parameter in a rank's shard (Layout:slice)
function FlatParam:slices(rank) return self.layout:slices(rank or self.rank) end

local function gather(self, out, inp)
  if self.world_size == 1 then raw_copy(out, inp); return end
  if not self.group then error('unshard: no process group (dist not initialised?)', 3) end
  dist.all_gather_into(out, inp, { group = self.group })
end

-- all-gather every rank's shard, cast to self.dtype (the low-precision copy,
-- made here on each call), into the unsharded flat buffer (self.flat) and
-- return the parameter views (also self.param_views). A second call while
-- unsharded returns the same views.
function FlatParam:unshard()
  if self.flat then return self.param_views end
  local flat = T.empty({ self.total }, { dtype = self.dtype, device = self.device })
  local src = self.shard.dtype == self.dtype and self.shard or self.shard:to(self.dtype)
  gather(self, flat, src)
  self.flat = flat
  self.param_views = self:views(flat)
  return self.param_views
end

function FlatParam:is_unsharded() return self.flat ~= nil end

-- free the unsharded buffer and its views; the shard stays
function FlatParam:reshard()
  if self.param_views then
    for _, v in ipairs(self.param_views) do v:free() end
    self.param_views = nil
  end
  if self.flat then self.flat:free(); self.flat = nil end
end

-- a zeroed unsharded gradient buffer (dtype: self.dtype unless given) and
-- views of it in the parameters' shapes; the padding stays zero
function FlatParam:grad_buffer(dtype)
  local g = T.zeros({ self.total }, { dtype = dtype or self.dtype, device = self.device })
  return g, self:views(g)
end

-- reduce-scatter an unsharded gradient buffer (layout.total elements) into
-- this rank's f32 gradient shard (self.grad_shard, returned); op 'sum' or 'avg'
function FlatParam:reduce_scatter(grad_flat, op)
  op = op or 'avg'
  if op ~= 'sum' and op ~= 'avg' then
    error(("reduce_scatter: op %s (use 'sum' or 'avg')"):format(tostring(op)), 2)
  end
  if not T.is_tensor(grad_flat) or grad_flat:numel() ~= self.total then
    error(('reduce_scatter: need a flat gradient of %d elements'):format(self.total), 2)
  end
  local src = grad_flat.dtype == 'f32' and grad_flat or grad_flat:to('f32')
  src = src:contiguous()
  local out = self.grad_shard or T.empty({ self.shard_numel }, { dtype = 'f32', device = self.device })
  if self.world_size == 1 then
    raw_copy(out, src)
  else
    if not self.group then error('reduce_scatter: no process group (dist not initialised?)', 2) end
    dist.reduce_scatter(out, src, op, { group = self.group })
  end
  self.grad_shard = out
  return out
end

-- ------------------------------------------------------------ fully_shard
-- fsdp.fully_shard(model, opts) -> model. Every module the policy picks (and
-- the root, taking the parameters no unit took and every parameter shared
-- between units) becomes a unit with one FlatParam. The modules' parameters
-- are replaced by views of the unit's unsharded buffer (leaves,
-- requires_grad), so model:named_parameters() keeps the names and shapes.
-- The runtime lives in module hooks (docs/autograd.md): unshard before a
-- unit's forward and backward, reshard per strategy, reduce the gradients
-- when a unit's backward ends. docs/fsdp.md describes the options.
fsdp.policy = {}

local function is_instance(m, cls)
  if type(cls) == 'string' then return m:class_name() == cls end
  local mt = getmetatable(m)
  while mt do
    if mt == cls then return true end
    mt = rawget(mt, 'super')
  end
  return false
end

-- fsdp.policy.by_class{ Class or 'ClassName', ... } -> function(module, name) -> bool
function fsdp.policy.by_class(classes)
  if type(classes) ~= 'table' then error('policy.by_class: need a list of classes', 2) end
  if #classes == 0 then error('policy.by_class: the list of classes is empty (a nil class in it?)', 2) end
  return function(m)
    for _, c in ipairs(classes) do if is_instance(m, c) then return true end end
    return false
  end
end

-- fsdp.policy.by_size(n): a module (not the root) becomes a unit when the
-- numel of the parameters in its subtree that no nested unit took is >= n;
-- children are decided first (PyTorch's size_based_auto_wrap_policy). A
-- tensor reached twice (tied) counts once.
local SizePolicy = {}
SizePolicy.__index = SizePolicy
SizePolicy.__call = function(self, m) return self.picked ~= nil and self.picked[m] == true end
function fsdp.policy.by_size(n)
  if type(n) ~= 'number' or n < 1 then
    error(('policy.by_size: min numel must be a number >= 1, got %s'):format(tostring(n)), 2)
  end
  return setmetatable({ min_numel = n }, SizePolicy)
end

-- the set of modules a size policy picks in `model`
local function size_pick(model, n)
  local picked, taken, seen = {}, {}, {}
  local function visit(m)
    local ids = {}
    if seen[m] then return ids end
    seen[m] = true
    for _, cn in ipairs(m._module_names) do
      local c = rawget(m, cn)
      if c ~= nil then for id, k in pairs(visit(c)) do ids[id] = k end end
    end
    for _, pn in ipairs(m._param_names) do
      local t = rawget(m, pn)
      if t ~= nil then ids[tonumber(t.id)] = t:numel() end
    end
    local total = 0
    for id, k in pairs(ids) do if not taken[id] then total = total + k end end
    if m ~= model and total >= n then
      picked[m] = true
      for id in pairs(ids) do taken[id] = true end
      return {}
    end
    return ids
  end
  visit(model)
  return picked
end

local STRATEGIES = { FULL_SHARD = true, SHARD_GRAD_OP = true, NO_SHARD = true, HYBRID_SHARD = true }

-- the pre-divide factor of a reduction over n ranks: the largest power of 2
-- <= sqrt(n); the gradient is divided by it before the reduction and by
-- n / factor after (overflow and underflow stay away from bf16's ends)
function fsdp.predivide_factor(n)
  local f = 1
  while (2 * f) * (2 * f) <= n do f = 2 * f end
  return f
end

local function pack(...) return { n = select('#', ...), ... } end
local function A() return require('moonshard.autograd') end
local function F() return require('moonshard.ops') end

local Unit = {}
Unit.__index = Unit
fsdp.Unit = Unit

local function trace(st, what, u)
  local tr = st.trace
  if tr then tr[#tr + 1] = what .. ' ' .. u.label end
end

local function storage_check(rc, what, u)
  if rc ~= 0 then error(('fsdp unit %s: %s: %s'):format(u.label, what, ffi.string(C.ms_last_error())), 3) end
end

-- ------------------------------------------------------------- offload
-- offload = true keeps the f32 master shard, its gradient and the
-- optimizer's moments in host memory. Host buffers the device reads or
-- writes are page-locked (ms_cuda_host_alloc) when the model is on CUDA and
-- plain CPU tensors in a CPU run, where every "host <-> device" copy below
-- is a copy between CPU tensors: the same code path.

-- a 1-d host tensor of n elements; page-locked (ms.cuda.pinned_empty) when
-- device >= 0
local function host_empty(n, dtype, device)
  if device < 0 or n == 0 then return T.empty({ n }, { dtype = dtype }) end
  return require('moonshard.cuda').pinned_empty({ n }, dtype)
end

-- dst:copy_(src) where one of them is on the host and the other on the
-- device (or both on the CPU: a plain copy). On CUDA the copy runs on the
-- runtime's copy stream: it waits (event) for the work queued so far on the
-- compute stream (the producer of a device source, the last reader of a
-- device destination), and the compute stream waits (event) for the copy.
-- The core's host <-> device copy (kernels/runtime.cu, cuda_copy) waits on
-- the host for the stream it runs on: here the copy stream, so the host
-- waits for the copy and what it waited for (docs/fsdp.md, "Offload").
local function host_copy(st, dst, src)
  if dst.device_id < 0 and src.device_id < 0 then
    no_grad(function() raw_copy(dst, src) end)
    return
  end
  local cuda = require 'moonshard.cuda'
  local dev = dst.device_id >= 0 and dst.device_id or src.device_id
  if st.copy_stream == nil then
    st.copy_stream = cuda.stream { device = dev }
    st.copy_before, st.copy_after = cuda.event { device = dev }, cuda.event { device = dev }
  end
  check(C.ms_cuda_event_record(st.copy_before.p, nil), 2)            -- on the compute stream
  st.copy_stream:wait(st.copy_before)
  cuda.with_stream(st.copy_stream, function() no_grad(function() raw_copy(dst, src) end) end)
  st.copy_after:record(st.copy_stream)
  check(C.ms_cuda_stream_wait_event(C.ms_cuda_current_stream(dev), st.copy_after.p), 2)
  cuda.record_stream(dst.device_id >= 0 and dst or src, st.copy_stream)
end

-- the tensor the all-gather reads: the low-precision copy of the shard
-- (refreshed after each optimizer step) or the f32 master shard itself
function Unit:gather_source()
  if self.lp == nil then return self.fp.shard end
  if self.lp_stale then self:refresh_lp() end
  return self.lp
end

-- the low-precision copy from the master shard: a cast on the device; with
-- offload, a cast on the host (into a pinned buffer in the parameters'
-- dtype, unless f32) and an upload
function Unit:refresh_lp()
  local shard = self.fp.shard
  self.st.src_gen = self.st.src_gen + 1   -- the next copy-engine gather fences first
  if self.st.offload then
    local src = shard
    if self.lp.dtype ~= shard.dtype then
      self.host_lp = self.host_lp or host_empty(shard:numel(), self.lp.dtype, self.fp.device)
      no_grad(function() raw_copy(self.host_lp, shard) end)
      src = self.host_lp
    end
    host_copy(self.st, self.lp, src)
  else
    no_grad(function() raw_copy(self.lp, shard) end)
  end
  self.lp_stale = false
end

-- with offload: a reduced gradient shard (on the device, f32) into the
-- master shard's gradient on the host (the first one of a step is copied
-- into the unit's pinned gradient buffer, later ones added); out is freed
function Unit:offload_grad(out)
  local shard, n = self.fp.shard, self.fp.shard_numel
  if shard.grad == nil then
    self.host_grad = self.host_grad or host_empty(n, self.gdtype, self.fp.device)
    host_copy(self.st, self.host_grad, out)
    shard.grad = self.host_grad:narrow(1, 1, n)     -- a handle of its own (zero_grad frees it)
  else
    self.host_stage = self.host_stage or host_empty(n, self.gdtype, self.fp.device)
    host_copy(self.st, self.host_stage, out)
    no_grad(function() F().add_(shard.grad, self.host_stage) end)
  end
  out:free()
end

-- A fence on a group: an all_reduce of one float on its communication
-- stream (so after the copies issued before it, and before those issued
-- after it, on every member); with wait the compute stream waits for it.
-- Traced as 'fence X' (X: the unit whose gather needed it, or after_step).
local function copy_fence(st, group, wait, label)
  if st.fence_t == nil then st.fence_t = T.zeros({ 1 }, { dtype = 'f32', device = st.units[1].fp.device }) end
  local w = dist.all_reduce(st.fence_t, 'max', { group = group, async = true })
  if wait then w:wait() end
  w:free()
  if st.trace then st.trace[#st.trace + 1] = 'fence ' .. label end
end

-- copy_gather = 'emulate' (specs): the registration's bookkeeping (fences,
-- their order, the reads in flight) on any backend, the copy itself an
-- all_gather_into of the source
local function emulated_reg(src, group)
  return {
    gather_into = function(_, out) return dist.all_gather_into(out, src, { group = group, async = true }) end,
    free = function() end,
  }
end

-- The copy-engine registration of the unit's gather source (dist.copy_register,
-- collective: every rank reaches a unit's first gather in the same order), or
-- false where there is none: only a low-precision copy (written by
-- refresh_lp alone, in after_step) on a CUDA device of an NCCL group.
function Unit:copy_reg(src)
  if self.creg_src == src then return self.creg end
  if self.creg then self.creg:free() end
  local reg = false
  if self.st.copy_gather == 'emulate' and self.lp ~= nil and src == self.lp then
    reg = emulated_reg(src, self.fp.group)
  elseif self.st.copy_gather and self.lp ~= nil and src == self.lp and src.device_id >= 0
     and dist.backend() == 'nccl' then
    reg = dist.copy_register(src, { group = self.fp.group }) or false
  end
  self.creg, self.creg_src = reg, src
  return reg
end

-- ------------------------------------------------- float8 all-gathers
-- fully_shard{ float8_all_gather = true } (torchao's
-- enable_fsdp_float8_all_gather with precompute_float8_dynamic_scale_for_fsdp;
-- docs/fsdp.md, "Float8 all-gathers"): a unit's weights of tensorwise
-- and blockwise float8 layers travel as f8 bytes. Once a step (at the end
-- of the optimizer step, fsdp.after_step; else at the first gather that
-- finds the shards changed), every unit's local amax of each such weight's
-- part of the shard (blockwise: of the part's elements in each 128 x 128
-- block of the weight, a block the shards cut holding a part on each rank
-- that has one), one all_reduce(max) over the shard group for the whole
-- model (one a vector: the tensorwise amaxes, the blockwise grids), and
-- each part cast with its weight's scale (its blocks' scales) into the
-- unit's f8 shard; the gather moves that (one byte an element) into the
-- f8 buffer, whose views are the f8 weights float8.linear takes
-- (fsdp.float8_weight, with the scales). The unit's other parameters
-- (norms, biases) travel in the same gather: their elements, packed in the
-- unit's dtype, take Pb bytes inserted into each rank's f8 bytes at a point
-- no f8 weight spans (q[r], so every f8 weight stays contiguous in the
-- gathered bytes), and one launch copies them to their places; where a
-- rank's part lies inside one f8 weight (no such point) they go through a
-- second, small gather instead. The blockwise weights' maxima, scales and
-- casts are one launch each for the whole model (the many-piece ops), the
-- tensorwise weights' amaxes and casts (their scales computed in it) too,
-- the packing one more. The cast of the shard is the cast of the
-- gathered weight (the same global amax, or the same block maxima, and an
-- element-wise cast given the scale): the same bits as gathering in bf16
-- and casting after, 1/W of the casting work and half the bytes on the
-- wire.
-- The f8 weights' regions of the unit's bf16 buffer are not written by
-- these gathers (fsdp.unshard(model) gathers them in full precision;
-- fsdp.float8_materialize(w) writes one from its f8 copy).

-- the gather plan of unit u, or nil when it has no float8 weight: f8 =
-- { ks (the weights' indices), by_off (flat offset -> k), cfg, blk[k] (a
-- blockwise weight's { R, C, nbr, nbc }: its shape and block grid), piece[k]
-- (this rank's part: off in the shard, n, woff its first element's index
-- in the weight), hp (the packed gather's pieces over all ranks: { r, pk,
-- dst, n }), mine (this rank's: { src, pk, n }), P, es (the unit's dtype's
-- bytes), joint (the packed elements ride in the f8 gather: Pb bytes of
-- them at q[r] in rank r's part; else Pb = 0 and a gather of their own) };
-- slot[k] (the weight's place in its amax vector) is set by fully_shard
-- the other parameters in the f8 gather where the layout allows (false:
-- always a gather of their own; specs compare the two)
fsdp.f8_joint_gather = true
-- the tensorwise weights' amaxes and casts one launch each for the whole
-- model (the many-piece ops; false: a launch or two a weight, Unit:f8_cast;
-- specs compare the bytes)
fsdp.f8_many_tensorwise = true

local function f8_plan(u)
  local f8mod = package.loaded['moonshard.float8']
  if f8mod == nil then return nil end
  local fp = u.fp
  local cfg_of, bad, tpg = {}, {}, {}
  for _, slot in ipairs(u.slots) do
    local cfg = f8mod.converted(slot.m)
    -- (blockwise: 2-D with both dims multiples of 128, as float8.convert
    -- leaves them; its TP shards are cut at blocks, their scales their own)
    local sh = fp.shapes[slot.k]
    local blk_ok = cfg and cfg.blockwise and #sh == 2 and sh[1] % 128 == 0 and sh[2] % 128 == 0
    if cfg and slot.pn == 'weight' and not cfg.axiswise and (blk_ok or not cfg.blockwise) and not u.frozen[slot.k] then
      if cfg_of[slot.k] == nil then cfg_of[slot.k] = cfg end
      -- (a tensor-parallel shard: its scale over the TP group, or its own)
      local tsh = rawget(slot.m, '_tp_shard')
      if tsh ~= nil and tsh.group:size() > 1 and not cfg.blockwise then
        tpg[slot.k] = { group = tsh.group, shared = cfg.tp_scales == 'group' }
      end
    else bad[slot.k] = true end
  end
  local ks, dtype8 = {}, nil
  for k = 1, fp.nparams do
    local cfg = cfg_of[k]
    if cfg and not bad[k] and fp.numels[k] > 0 then
      dtype8 = dtype8 or cfg.weight
      if cfg.weight == dtype8 then ks[#ks + 1] = k else cfg_of[k] = nil end
    else cfg_of[k] = nil end
  end
  if #ks == 0 then return nil end
  local is8 = {}
  for _, k in ipairs(ks) do is8[k] = true end
  local S, W = fp.shard_numel, fp.world_size
  local plan = { ks = ks, cfg = cfg_of, dtype8 = dtype8, by_off = {}, blk = {}, piece = {}, hp = {}, mine = {}, tp = {},
    slot = {} }
  for _, k in ipairs(ks) do plan.tp[k] = tpg[k] end
  for _, k in ipairs(ks) do plan.by_off[fp.layout.offsets[k]] = k end
  for _, k in ipairs(ks) do
    if cfg_of[k].blockwise then
      local R, C = fp.shapes[k][1], fp.shapes[k][2]
      plan.blk[k] = { R = R, C = C, nbr = math.ceil(R / 128), nbc = math.ceil(C / 128) }
    end
  end
  local s0 = fp.rank * S
  for _, k in ipairs(ks) do
    local o, n = fp.layout.offsets[k], fp.numels[k]
    local a, b = math.max(o, s0), math.min(o + n, s0 + S)
    if b > a then plan.piece[k] = { off = a - s0, n = b - a, woff = a - o } end
  end
  local P = 0
  for r = 0, W - 1 do
    local pk = 0
    for k = 1, fp.nparams do
      if not is8[k] then
        local o, n = fp.layout.offsets[k], fp.numels[k]
        local a, b = math.max(o, r * S), math.min(o + n, (r + 1) * S)
        if b > a then
          plan.hp[#plan.hp + 1] = { r = r, pk = pk, dst = a, n = b - a }
          if r == fp.rank then plan.mine[#plan.mine + 1] = { src = a - r * S, pk = pk, n = b - a } end
          pk = pk + (b - a)
        end
      end
    end
    P = math.max(P, pk)
  end
  plan.P = P
  -- the point of each rank's part where its Pb bytes go: the part's start
  -- unless an f8 weight spans it, else that weight's end (none: the part
  -- lies inside one f8 weight, and the unit takes two gathers)
  plan.es = C.ms_dtype_size(T.dtype_id(fp.dtype))
  plan.q, plan.joint = {}, P > 0 and fsdp.f8_joint_gather
  for r = 0, W - 1 do
    if not plan.joint then break end
    local e = r * S
    for _, k in ipairs(ks) do
      local o = fp.layout.offsets[k]
      if o < e and e < o + fp.numels[k] then e = o + fp.numels[k] end
    end
    if e > (r + 1) * S then plan.joint = false else plan.q[r] = e - r * S end
  end
  plan.joint = plan.joint or false
  plan.Pb = plan.joint and math.ceil(P * plan.es / 16) * 16 or 0   -- (a multiple of 16: the weights keep their alignment)
  return plan
end

-- byte of the gathered f8 buffer holding element e of the unit's flat
-- buffer (an f8 weight's; each rank's part is S + Pb bytes there)
local function f8_pos(fp, f8, e)
  local S = fp.shard_numel
  local r = math.floor(e / S)
  local l = e - r * S
  return r * (S + f8.Pb) + l + ((f8.joint and l >= f8.q[r]) and f8.Pb or 0)
end

-- byte of this rank's f8 shard (S + Pb bytes) holding its element l
local function f8_local(fp, f8, l)
  return l + ((f8.joint and l >= f8.q[fp.rank]) and f8.Pb or 0)
end

-- a list of byte copies ({ dst, dst byte, src, src byte, bytes }) as the
-- arrays ms_copy_bytes_many takes (refs: the tensors, kept alive)
local function f8_copies(list)
  local n = #list
  local c = { n = n, d = ffi.new('ms_tensor*[?]', math.max(n, 1)), s = ffi.new('ms_tensor*[?]', math.max(n, 1)),
    spec = ffi.new('int64_t[?]', math.max(3 * n, 1)), refs = list }
  for i, e in ipairs(list) do
    c.d[i - 1], c.s[i - 1] = e[1], e[3]
    c.spec[3 * i - 3], c.spec[3 * i - 2], c.spec[3 * i - 1] = e[2], e[4], e[5]
  end
  return c
end

-- the f8 state of a unit with a plan: the f8 shard, the unsharded f8 buffer
-- (its data released with the unit's), the weights' f8 views, their amax
-- (tensorwise: 0-dim views of st.f8_amax at slot[k]; blockwise: (nbr, nbc)
-- views of st.f8_bamax) and inverse scales (tensorwise 0-dim; blockwise
-- inv and inv_t in float8_cast_blockwise's layouts of the weight and its
-- transpose, and the blocks' scales), the packed source and destination of
-- the other parameters and their views
function Unit:f8_init()
  local fp, f8 = self.fp, self.f8
  local S, W, dev = fp.shard_numel, fp.world_size, fp.device
  -- (the other parameters' elements: never read; joint: their packed
  -- elements at q in the Pb bytes after)
  -- (joint: zeros where nothing is cast or packed, so that what
  -- set_skip_comm's slots of the other members read there is zeros, never
  -- stale bytes; an 8-bit tensor takes no fill: a converted one)
  if f8.joint then
    local z = T.zeros({ S + f8.Pb }, { dtype = 'bf16', device = dev })
    f8.shard8 = z:to(f8.dtype8)
    z:free()
  else
    f8.shard8 = T.empty({ S + f8.Pb }, { dtype = f8.dtype8, device = dev })
  end
  f8.flat8 = T.empty({ W * (S + f8.Pb) }, { dtype = f8.dtype8, device = dev })
  f8.views8, f8.amax, f8.inv, f8.part8 = {}, {}, {}, {}
  f8.inv_t, f8.scale, f8.out8 = {}, {}, {}
  for _, k in ipairs(f8.ks) do
    local n = f8.flat8:narrow(1, f8_pos(fp, f8, fp.layout.offsets[k]) + 1, fp.numels[k])
    f8.views8[k] = n:view(fp.shapes[k])
    n:free()
    local b, pc = f8.blk[k], f8.piece[k]
    if b then
      local a = self.st.f8_bamax:narrow(1, f8.slot[k] + 1, b.nbr * b.nbc)
      f8.amax[k] = a:view({ b.nbr, b.nbc })
      a:free()
      f8.scale[k] = T.empty({ b.nbr, b.nbc }, { dtype = 'f32', device = dev })
      f8.inv[k] = T.empty({ b.nbr, 4 * math.ceil(b.nbc / 4) }, { dtype = 'f32', device = dev })
      f8.inv_t[k] = T.empty({ b.nbc, 4 * math.ceil(b.nbr / 4) }, { dtype = 'f32', device = dev })
      if pc then f8.out8[k] = f8.shard8:narrow(1, f8_local(fp, f8, pc.off) + 1, pc.n) end
      pc = nil   -- (one piece, cast whole: no tiles)
    else
      local a = self.st.f8_amax:narrow(1, f8.slot[k] + 1, 1)
      f8.amax[k] = a:view({})
      a:free()
      f8.inv[k] = T.empty({}, { dtype = 'f32', device = dev })
      -- (the part's bytes whole, for the many-piece cast; its tiles below
      -- for the cast a weight at a time)
      if pc then f8.out8[k] = f8.shard8:narrow(1, f8_local(fp, f8, pc.off) + 1, pc.n) end
    end
    -- this rank's part cast as (n / 64, 64) rows (the cast's 64 x 64 tiles
    -- full) and the rest as one row: { off, rows, cols, out }
    if pc then
      local segs, main = {}, pc.n - pc.n % 64
      local function seg(off, rows, cols)
        local d = f8.shard8:narrow(1, f8_local(fp, f8, pc.off) + off + 1, rows * cols)
        segs[#segs + 1] = { off = pc.off + off, rows = rows, cols = cols, out = d:view({ rows, cols }) }
        d:free()
      end
      if main > 0 then seg(0, main / 64, 64) end
      if pc.n > main then seg(main, 1, pc.n - main) end
      f8.part8[k] = segs
    end
  end
  if f8.P > 0 and not f8.joint then
    f8.hp_src = T.zeros({ f8.P }, { dtype = fp.dtype, device = dev })
    f8.hp_all = T.zeros({ W * f8.P }, { dtype = fp.dtype, device = dev })
  end
  -- the unpacking copies ({ dst, dst byte, src, src byte, bytes } each, as
  -- copy_bytes_many takes them): from the gathered bytes into the unit's
  -- buffer (flat8 and flat: kept across their data's release)
  local es, Sb, P = f8.es, S + f8.Pb, f8.P
  f8.unpack = {}
  for i, h in ipairs(f8.hp) do
    local sb = f8.joint and h.r * Sb + f8.q[h.r] + h.pk * es or (h.r * P + h.pk) * es
    f8.unpack[i] = { self.flat, h.dst * es, f8.joint and f8.flat8 or f8.hp_all, sb, h.n * es }
  end
  f8.unpack_c = f8_copies(f8.unpack)
  if self.free_data then storage_check(C.ms_storage_free_data(f8.flat8), 'releasing the f8 buffer', self) end
end

-- the precompute's tables over every float8 unit, made again when a
-- unit's source views change: by f8 dtype (blk[dtype]), the blockwise
-- weights' pieces (n, x, geom), grids (amax, scale, inv, inv_t, pow2) and
-- the pieces this rank casts (nc, cx, cgeom, cscale, cout), as the
-- many-piece ops take them; by f8 dtype (tw[dtype]), the tensorwise
-- weights' parts (n, x: none where this rank has no part), amaxes, inverse
-- scales, pow2 and f8 bytes (out); pack: the copies of the other
-- parameters' elements into the f8 shards (or their own sources). refs
-- keeps the tensors alive.
local function f8_tables(st)
  local svs = {}
  for i, u in ipairs(st.f8_units) do svs[i] = u:f8_src_views() end
  local tab = st.f8_tab
  if tab then
    local same = true
    for i, sv in ipairs(svs) do if tab.svs[i] ~= sv then same = false end end
    if same then return tab end
  end
  local lists, tws, pack = {}, {}, {}
  for i, u in ipairs(st.f8_units) do
    local f8, sv = u.f8, svs[i]
    for _, k in ipairs(f8.ks) do
      local b, pc = f8.blk[k], f8.piece[k]
      if not b then
        local l = tws[f8.dtype8] or { x = {}, amax = {}, inv = {}, out = {}, pow2 = {} }
        tws[f8.dtype8] = l
        local j = #l.amax + 1
        l.x[j], l.amax[j], l.inv[j], l.out[j] = sv.part[k] or false, f8.amax[k], f8.inv[k], f8.out8[k] or false
        l.pow2[j] = f8.cfg[k].pow2 and 1 or 0
      else
        local l = lists[f8.dtype8] or { x = {}, geom = {}, amax = {}, scale = {}, inv = {}, inv_t = {}, pow2 = {},
          cx = {}, cgeom = {}, cscale = {}, cout = {} }
        lists[f8.dtype8] = l
        local g = { b.R, b.C, pc and pc.woff or 0 }
        local j = #l.amax + 1
        l.x[j], l.geom[j], l.amax[j], l.scale[j] = sv.part[k] or false, g, f8.amax[k], f8.scale[k]
        l.inv[j], l.inv_t[j], l.pow2[j] = f8.inv[k], f8.inv_t[k], f8.cfg[k].pow2 and 1 or 0
        if f8.out8[k] then
          local c = #l.cx + 1
          l.cx[c], l.cgeom[c], l.cscale[c], l.cout[c] = sv.part[k], g, f8.scale[k], f8.out8[k]
        end
      end
    end
    for _, m in ipairs(f8.mine) do
      local es = f8.es
      pack[#pack + 1] = f8.joint and { f8.shard8, f8.q[u.fp.rank] + m.pk * es, sv.src, m.src * es, m.n * es }
        or { f8.hp_src, m.pk * es, sv.src, m.src * es, m.n * es }
    end
  end
  local function arr(list, n)
    local a = ffi.new('ms_tensor*[?]', math.max(n, 1))
    for i = 1, n do if list[i] then a[i - 1] = list[i] end end
    return a
  end
  local function geoms(list, n)
    local a = ffi.new('int64_t[?]', math.max(3 * n, 1))
    for i = 1, n do for j = 1, 3 do a[3 * (i - 1) + j - 1] = list[i][j] end end
    return a
  end
  local function ints(list, n)
    local a = ffi.new('int[?]', math.max(n, 1))
    for i = 1, n do a[i - 1] = list[i] end
    return a
  end
  tab = { svs = svs, blk = {}, tw = {}, pack = f8_copies(pack), refs = { lists, tws } }
  for dt, l in pairs(tws) do
    local n = #l.amax
    tab.tw[#tab.tw + 1] = { dtype = T.dtype_id(dt), n = n, x = arr(l.x, n), amax = arr(l.amax, n), inv = arr(l.inv, n),
      out = arr(l.out, n), pow2 = ints(l.pow2, n) }
  end
  for dt, l in pairs(lists) do
    local n, nc = #l.amax, #l.cx
    tab.blk[#tab.blk + 1] = { dtype = T.dtype_id(dt), n = n, x = arr(l.x, n), geom = geoms(l.geom, n),
      amax = arr(l.amax, n), scale = arr(l.scale, n), inv = arr(l.inv, n), inv_t = arr(l.inv_t, n), pow2 = ints(l.pow2, n),
      nc = nc, cx = arr(l.cx, nc), cgeom = geoms(l.cgeom, nc), cscale = arr(l.cscale, nc), cout = arr(l.cout, nc) }
  end
  st.f8_tab = tab
  return tab
end

-- once a step, every float8 unit's local amaxes (one launch for the
-- tensorwise weights, one for the blockwise ones), one all_reduce(max) a
-- vector, and the casts (the tensorwise ones one launch, their scales
-- computed in it; the blockwise scales and casts one launch each) and the
-- packing (one launch): the f8 shards are then sources a copy-engine
-- gather may read (a new src_gen: the next such gather fences).
-- fsdp.f8_many_tensorwise = false: the tensorwise ones a weight at a time
local function f8_precompute(st)
  st.f8_stale = false
  local tab = f8_tables(st)
  local many = fsdp.f8_many_tensorwise
  if many then
    for _, g in ipairs(tab.tw) do check(C.ms_float8_amax_many(g.amax, g.x, g.n), 2) end
  else
    for _, u in ipairs(st.f8_units) do
      local f8, sv = u.f8, u.f8.sv
      for _, k in ipairs(f8.ks) do
        if f8.blk[k] then   -- (below)
        elseif sv.part[k] then
          st.box[0] = f8.amax[k]
          check(C.ms_amax(st.box, sv.part[k]), 2)
        else
          raw_zero(f8.amax[k])
        end
      end
    end
  end
  for _, g in ipairs(tab.blk) do check(C.ms_float8_amax_blockwise_many(g.amax, g.x, g.geom, g.n), 2) end
  if st.f8_group and st.f8_group:size() > 1 and not st.skip_comm then
    if st.f8_amax then dist.all_reduce(st.f8_amax, 'max', { group = st.f8_group }) end
    if st.f8_bamax then dist.all_reduce(st.f8_bamax, 'max', { group = st.f8_group }) end
  end
  -- (the tensorwise amaxes only: a blockwise TP shard's blocks are its own)
  if st.f8_tp_group then require('moonshard.tp').all_reduce_max(st.f8_amax, st.f8_tp_group) end
  -- the blocks' scales (every rank: the layers read them), the parts cast
  for _, g in ipairs(tab.blk) do
    check(C.ms_float8_scales_blockwise_many(g.scale, g.inv, g.inv_t, g.amax, g.pow2, g.n, g.dtype), 2)
    if g.nc > 0 then check(C.ms_float8_cast_blockwise_many(g.cout, g.cx, g.cscale, g.cgeom, g.nc, g.dtype), 2) end
  end
  if many then
    for _, g in ipairs(tab.tw) do check(C.ms_float8_cast_many(g.out, g.inv, g.x, g.amax, g.pow2, g.n, g.dtype), 2) end
  else
    for _, u in ipairs(st.f8_units) do u:f8_cast() end
  end
  if tab.pack.n > 0 then check(C.ms_copy_bytes_many(tab.pack.d, tab.pack.s, tab.pack.spec, tab.pack.n), 2) end
  st.src_gen = st.src_gen + 1
  st.f8_gen = st.src_gen
end

-- fsdp.float8_precompute(model): the once-a-step work of float8_all_gather
-- (amaxes, their all-reduce, scales, casts, packing) now, queued on the
-- current stream (bench/fsdp.lua --f8-precompute times it); after_step
-- does it by itself
function fsdp.float8_precompute(model)
  local st = type(model) == 'table' and rawget(model, '_fsdp')
  if not st then error('fsdp.float8_precompute: model was not passed to fsdp.fully_shard', 2) end
  if not st.f8_units then error('fsdp.float8_precompute: the model is not sharded with float8_all_gather', 2) end
  f8_precompute(st)
end

-- the copy-engine registrations of the unit's f8 shard and packed source
-- ({ f8 =, hp = }: hp only with a gather of its own), or false (as
-- Unit:copy_reg: NCCL on CUDA, or 'emulate')
function Unit:f8_copy_reg()
  if self.f8reg ~= nil then return self.f8reg end
  local st, f8, g = self.st, self.f8, self.fp.group
  local hp = f8.hp_src ~= nil
  local reg = false
  if st.copy_gather == 'emulate' then
    reg = { f8 = emulated_reg(f8.shard8, g), hp = hp and emulated_reg(f8.hp_src, g) or nil }
  elseif st.copy_gather and f8.shard8.device_id >= 0 and dist.backend() == 'nccl' then
    local r8 = dist.copy_register(f8.shard8, { group = g })
    local rh = r8 and hp and dist.copy_register(f8.hp_src, { group = g }) or nil
    if r8 and (not hp or rh) then reg = { f8 = r8, hp = rh }
    else
      if r8 then r8:free() end
      if rh then rh:free() end
    end
  end
  self.f8reg = reg
  return reg
end

-- the views of the gather source the f8 steps read, made once (the source
-- is the unit's low-precision copy or its master shard, kept across steps):
-- part[k] (1-d), seg[k][i] (the tensorwise cast's 2-d pieces), empty (a
-- (0, 0) for a weight with no part here)
function Unit:f8_src_views()
  local f8 = self.f8
  local src = self:gather_source()   -- (refreshes the low-precision copy when stale)
  local sv = f8.sv
  if sv and sv.src == src then return sv end
  if T.dtype_id(src.dtype) ~= T.dtype_id(self.fp.dtype) then
    -- (the packing copies bytes: the source is in the unit's dtype)
    error(('fully_shard: float8_all_gather: unit %s gathers %s from a %s source'):format(self.label,
      T.dtype_name(T.dtype_id(self.fp.dtype)), src.dtype), 2)
  end
  sv = { src = src, part = {}, seg = {} }
  sv.empty = T.empty({ 0, 0 }, { dtype = src.dtype, device = src.device_id })
  for _, k in ipairs(f8.ks) do
    local pc = f8.piece[k]
    if pc then
      sv.part[k] = src:narrow(1, pc.off + 1, pc.n)
      sv.seg[k] = {}
      for i, sg in ipairs(f8.part8[k] or {}) do
        local n = src:narrow(1, sg.off + 1, sg.rows * sg.cols)
        sv.seg[k][i] = n:view({ sg.rows, sg.cols })
        n:free()
      end
    end
  end
  f8.sv = sv
  return sv
end

-- the unit's tensorwise parts cast with their weights' scales into the f8
-- shard, a weight at a time (fsdp.f8_many_tensorwise = false; else, and
-- for the blockwise ones: f8_precompute, for the whole model at once)
function Unit:f8_cast()
  local st, f8 = self.st, self.f8
  local sv = self:f8_src_views()
  for _, k in ipairs(f8.ks) do
    local dt, p2 = T.dtype_id(f8.dtype8), f8.cfg[k].pow2 and 1 or 0
    local segs = f8.part8[k]
    if f8.blk[k] then   -- (f8_precompute)
    elseif segs == nil then   -- (no part here: the scale alone)
      st.box2[0] = f8.inv[k]
      check(C.ms_float8_cast(nil, nil, st.box2, sv.empty, f8.amax[k], dt, p2), 2)
    else
      for i, sg in ipairs(segs) do
        -- (the weight's scale once: the parts share it)
        st.box[0], st.box2[0] = sg.out, f8.inv[k]
        check(C.ms_float8_cast(st.box, nil, i == 1 and st.box2 or nil, sv.seg[k][i], f8.amax[k], dt, p2), 2)
      end
    end
  end
end

-- the f8 path of gather_start (the unit's bf16 buffer allocated already):
-- one gather of the f8 shards (S + Pb bytes a rank), and with P > 0 but
-- not joint one of the packed other parameters
function Unit:f8_gather_start()
  local st, fp, f8 = self.st, self.fp, self.f8
  if st.f8_stale or st.f8_gen ~= st.src_gen then f8_precompute(st) end
  if self.free_data then storage_check(C.ms_storage_alloc_data(f8.flat8), 'allocating the f8 buffer', self) end
  local hp = f8.hp_src ~= nil
  if fp.world_size == 1 or st.skip_comm then
    -- (set_skip_comm: every member's slot gets this rank's own shard, as in
    -- the bf16 path; joint: laid out as member r's, this rank's f8
    -- elements around its packed bytes put at q[r], where r's go, so that
    -- no packed byte is read as an f8 code nor an f8 byte as one of the
    -- other parameters' elements)
    local S, Pb = fp.shard_numel, f8.Pb
    local n, qo = S + Pb, f8.joint and f8.q[fp.rank] or 0
    local function put(off, src_off, len)
      if len <= 0 then return end
      local d, sr = f8.flat8:narrow(1, off + 1, len), f8.shard8:narrow(1, src_off + 1, len)
      raw_copy(d, sr)
      d:free(); sr:free()
    end
    -- this rank's f8 elements [e0, e1) to byte off of the buffer
    local function elems(off, e0, e1)
      local cut = math.min(math.max(qo, e0), e1)
      put(off, e0, cut - e0)
      put(off + cut - e0, cut + Pb, e1 - cut)
    end
    no_grad(function()
      for r = 0, fp.world_size - 1 do
        if f8.joint then
          local q = f8.q[r]
          elems(r * n, 0, q)
          put(r * n + q, qo, Pb)
          elems(r * n + q + Pb, q, S)
        else
          put(r * n, 0, n)
        end
        if hp then
          local h = f8.hp_all:narrow(1, r * f8.P + 1, f8.P)
          raw_copy(h, f8.hp_src)
          h:free()
        end
      end
    end)
  else
    local reg = self:f8_copy_reg()
    if reg then
      -- (as the bf16 path's copy gathers: a fence after the sources changed)
      if st.copy_fenced[fp.group] ~= st.src_gen then
        copy_fence(st, fp.group, false, self.label)
        st.copy_fenced[fp.group] = st.src_gen
      end
      self.work8 = reg.f8:gather_into(f8.flat8)
      if hp then self.work = reg.hp:gather_into(f8.hp_all) end
      st.copy_seq = st.copy_seq + 1
      st.copy_dirty[fp.group] = st.copy_seq
    else
      self.work8 = dist.all_gather_into(f8.flat8, f8.shard8, { group = fp.group, async = true })
      if hp then self.work = dist.all_gather_into(f8.hp_all, f8.hp_src, { group = fp.group, async = true }) end
    end
  end
  self.f8_live = true
end

-- after the f8 gathers: the other parameters' elements into their places
-- (one launch)
function Unit:f8_finish()
  local c = self.f8.unpack_c
  if self.work8 then self.work8:wait(); self.work8:free(); self.work8 = nil end
  if c.n > 0 then check(C.ms_copy_bytes_many(c.d, c.s, c.spec, c.n), 2) end
end

-- issue the all-gather (async) into the unsharded buffer; no-op unless sharded
function Unit:gather_start()
  if self.status ~= 'sharded' then return end
  local st, fp = self.st, self.fp
  if self.free_data then storage_check(C.ms_storage_alloc_data(self.flat), 'allocating the unsharded buffer', self) end
  local src = self:gather_source()
  if self.aliased then
    -- the buffer is the shard
  elseif self.f8 and not st.f8_hp then
    self:f8_gather_start()
  elseif fp.world_size == 1 then
    no_grad(function() raw_copy(self.flat, src) end)
  elseif st.skip_comm then
    -- set_skip_comm: the buffer is allocated and the source made (cast or
    -- uploaded), the collective is not issued; every member's slot gets this
    -- rank's own shard (a local copy), so the step computes on values of the
    -- real kind: a buffer left as its memory was (NaN, zeros) made the GPU's
    -- math draw less power and run faster than on real data (docs/fsdp.md)
    local n = fp.shard_numel
    no_grad(function()
      for r = 0, fp.world_size - 1 do
        local dst = self.flat:narrow(1, r * n + 1, n)
        raw_copy(dst, src)
        dst:free()
      end
    end)
  else
    local reg = self:copy_reg(src)
    if reg then
      -- the peers' copies changed since the last fence: fence first (the
      -- copies then read what every member's refresh wrote)
      if st.copy_fenced[fp.group] ~= st.src_gen then
        copy_fence(st, fp.group, false, self.label)
        st.copy_fenced[fp.group] = st.src_gen
      end
      self.work = reg:gather_into(self.flat)
      st.copy_seq = st.copy_seq + 1
      st.copy_dirty[fp.group] = st.copy_seq
    else
      self.work = dist.all_gather_into(self.flat, src, { group = fp.group, async = true })
    end
  end
  self.status, self.unsharded = 'gathering', true
  if self.reshards then
    st.inflight = st.inflight + 1
    if st.inflight > st.max_inflight then st.max_inflight = st.inflight end
  end
  if not st.skip_comm then trace(st, 'all_gather', self) end   -- (at one rank: the local copy)
end

-- the unit's parameters usable now (waits for its all-gather: on CUDA the
-- current stream waits, the host does not)
function Unit:unshard()
  if self.status == 'unsharded' then return end
  if self.status == 'sharded' then self:gather_start() end
  if self.work then self.work:wait(); self.work:free(); self.work = nil end
  if self.f8_live then self:f8_finish() end
  self.status = 'unsharded'
  trace(self.st, 'unshard', self)
end

-- back to the shard: the unsharded buffer's data is released (free_data),
-- the storage and the views on it stay
function Unit:reshard()
  if self.status == 'sharded' then return end
  if self.work then self.work:wait(); self.work:free(); self.work = nil end
  if self.work8 then self.work8:wait(); self.work8:free(); self.work8 = nil end
  if self.free_data then storage_check(C.ms_storage_free_data(self.flat), 'releasing the unsharded buffer', self) end
  if self.f8 then
    if self.f8_live and self.free_data then
      storage_check(C.ms_storage_free_data(self.f8.flat8), 'releasing the f8 buffer', self)
    end
    self.f8_live = false
  end
  self.status, self.unsharded = 'sharded', false
  if self.reshards then self.st.inflight = self.st.inflight - 1 end
  trace(self.st, 'reshard', self)
end

-- the unsharded gradient buffer (f32, f64 for an f64 model; zeroed on creation; kept across the
-- backwards of no_sync) and, when the parameters are f32, the views' .grad
-- pointed into it so autograd accumulates there with no copy
function Unit:prepare_grads()
  local fp = self.fp
  self:note_sp_mode()
  if self.gbuf == nil then
    if self.grad_direct then
      -- autograd accumulates into the views: zeros
      self.gbuf = T.zeros({ fp.total }, { dtype = self.gdtype, device = fp.device })
    else
      -- every parameter's region is written by collect_grads (its first
      -- gradient, or zeros when it got none); only the padding is zeroed here
      self.gbuf = T.empty({ fp.total }, { dtype = self.gdtype, device = fp.device })
      local lay, pos = fp.layout, 0
      for i = 1, fp.nparams do
        local off = lay.offsets[i]
        if off > pos then local z = self.gbuf:narrow(1, pos + 1, off - pos); raw_zero(z); z:free() end
        pos = off + lay.numels[i]
      end
      if fp.total > pos then local z = self.gbuf:narrow(1, pos + 1, fp.total - pos); raw_zero(z); z:free() end
    end
    self.gviews = fp:views(self.gbuf)
    self.gwritten = {}   -- views collect_grads wrote since the buffer was made
  else
    for i, gv in ipairs(self.gviews) do
      if gv.storage == nil then self.gviews = fp:views(self.gbuf); break end   -- a zero_grad freed a view
    end
  end
  if self.grad_direct then
    for i, v in ipairs(self.views) do v.grad = self.gviews[i] end
  elseif self.st.grad_sinks then
    -- the ops that can (the affine layers' weight GEMMs) write a view's
    -- gradient into its f32 region of the buffer themselves (A.set_grad_sink),
    -- marking it in gwritten as collect_grads' copies do
    for i, v in ipairs(self.views) do
      if self.gviews[i].device_id == v.device_id then
        A().set_grad_sink(v, { t = self.gviews[i], written = self.gwritten, i = i })
      end
    end
  end
end

-- drop the views into the unsharded gradient buffer: their handles are
-- released now, so the buffer's memory goes when the buffer's own handle
-- does, not when the collector reaches the views (which held it for as long
-- as the Lua heap took to grow enough: gigabytes at the Llama's peak)
function Unit:drop_gviews()
  for i, v in ipairs(self.gviews or {}) do
    A().set_grad_sink(self.views[i], nil)   -- (collect_grads did; a backward cut short did not)
    if v.storage ~= nil then v:free() end
  end
  self.gviews = nil
end

-- gradients autograd left in the views' .grad (low-precision parameters)
-- into the f32 buffer; the views drop their .grad
function Unit:collect_grads()
  for i, v in ipairs(self.views) do
    if not self.grad_direct then A().set_grad_sink(v, nil) end
    -- a fused linear cross-entropy's mark (moonshard.flce): its forward
    -- wrote the region, its backward did not run (a forward without
    -- backward before this one): what is there is no gradient of this pass
    if type(self.gwritten and self.gwritten[i]) == 'table' then self.gwritten[i] = nil end
    local g = v.grad
    if g ~= nil then
      v.grad = nil
      if not self.grad_direct and self.gbuf ~= nil then
        -- the first gradient into the buffer is a converting copy (6 bytes a
        -- parameter moved, not a zero fill, a cast into a temporary and an
        -- add: 22); later ones (no_sync's micro-batches) a mixed-dtype add
        if self.gwritten[i] then F().add_(self.gviews[i], g)
        else raw_copy(self.gviews[i], g); self.gwritten[i] = true end
        g:free()
      end
    elseif not self.grad_direct and self.gbuf ~= nil and not self.gwritten[i] then
      raw_zero(self.gviews[i])   -- no gradient: its region of the buffer made zero once
      self.gwritten[i] = true
    end
  end
end

-- sequence parallelism (a model split by tp.parallelize with
-- sequence_parallel): the regions of the unsharded gradient whose
-- parameters ran on this TP rank's tokens (u.sp_ks) summed over the TP
-- group, packed into one all-reduce, before the unit's own reduction over
-- the data-parallel group. The buffer holds every backward's gradient
-- since the last reduction (no_sync's micro-batches added up), so one sum
-- serves them all; a backward whose forward ran replicated (a B·T that
-- does not divide over the group) made whole gradients, which are not
-- summed, and the two kinds cannot share a buffer.
function Unit:note_sp_mode()
  local sp = self.st.tp_sp
  if not (sp and self.sp_ks) then return end
  local mode = sp.active and 'split' or 'whole'
  if self.sp_mode == nil then self.sp_mode = mode
  elseif self.sp_mode ~= mode then
    error(('fsdp unit %s: a backward of a sequence-parallel forward and one of a replicated forward (B*T not a '
      .. 'multiple of the %d TP ranks) into one gradient buffer (no_sync): their norms\' gradients cannot be summed '
      .. 'alike; reduce between them'):format(self.label, sp.size), 0)
  end
end

function Unit:sum_sp_partial(g)
  local sp, ks = self.st.tp_sp, self.sp_ks
  local mode = self.sp_mode
  self.sp_mode = nil
  if not (sp and ks) or mode ~= 'split' then return end
  local lay = self.fp.layout
  local regions = {}
  for i, k in ipairs(ks) do regions[i] = g:narrow(1, lay.offsets[k] + 1, lay.numels[k]) end
  local tp = require 'moonshard.tp'
  if #regions == 1 then
    tp.sum_partial(regions[1], sp)
  else
    local flat = F().cat(regions, 1)
    tp.sum_partial(flat, sp)
    local off = 0
    for _, r in ipairs(regions) do
      local n = r:numel()
      local part = flat:narrow(1, off + 1, n)
      raw_copy(r, part)
      part:free()
      off = off + n
    end
    flat:free()
  end
  for _, r in ipairs(regions) do r:free() end
end

-- reduce the unsharded gradient: in the reduce dtype, divided by the
-- pre-divide factor, reduce-scatter 'sum' over the shard group (all-reduce
-- over the replicate group for NO_SHARD), async; finish_reductions completes it
function Unit:reduce_grads()
  local st, fp = self.st, self.fp
  local g = self.gbuf
  if g == nil then return end
  self:sum_sp_partial(g)
  -- (fsdp.set_before_reduce: the unsharded gradient, in its views, before
  -- it goes)
  if st.before_reduce then st.before_reduce(self) end
  self:drop_gviews()
  self.gbuf = nil
  local src = g
  if st.dp_size > 1 then
    if st.reduce_dtype ~= 'f32' and g.dtype == 'f32' then src = g:to(st.reduce_dtype); g:free() end
    if st.predivide > 1 then F().div_(src, st.predivide) end
  end
  local pend = { unit = self, src = src }
  if self.strategy == 'NO_SHARD' then
    pend.out = src
    if not st.skip_comm then
      if st.replicate_group and st.replicate_group:size() > 1 then
        pend.work = dist.all_reduce(src, 'sum', { group = st.replicate_group, async = true })
      end
      trace(st, 'all_reduce', self)
    end
  else
    if fp.world_size == 1 then
      pend.out = src
      if not st.skip_comm then trace(st, 'reduce_scatter', self) end
    elseif st.skip_comm then
      -- set_skip_comm: the output buffer is made and filled with this
      -- rank's own part of the input (a copy, so the gradient stays
      -- finite), no collective
      pend.out = T.empty({ fp.shard_numel }, { dtype = src.dtype, device = fp.device })
      no_grad(function()
        local mine = fp:local_shard(src)
        raw_copy(pend.out, mine)
        mine:free()
      end)
    else
      pend.out = T.empty({ fp.shard_numel }, { dtype = src.dtype, device = fp.device })
      -- f32, no pre-divide (n <= 3) and the shard group is every data-parallel
      -- rank: the collective averages (NCCL's avg: no post-divide pass)
      local op = 'sum'
      if st.reduce_dtype == 'f32' and st.predivide == 1 and fp.world_size == st.dp_size then
        op, pend.averaged = 'avg', true
      end
      pend.work = dist.reduce_scatter(pend.out, src, op, { group = fp.group, async = true })
      pend.copy_seq = st.copy_seq   -- after every copy-engine gather issued so far
      trace(st, 'reduce_scatter', self)
    end
  end
  st.pending[#st.pending + 1] = pend
end

-- wait for the reductions in flight; HYBRID_SHARD all-reduces each shard
-- over the replicate group; post-divide; add into shard.grad (f32)
local function finish_reductions(st)
  local pend = st.pending
  st.pending = {}
  for _, p in ipairs(pend) do
    local u = p.unit
    if p.work then
      p.work:wait(); p.work:free()
      -- every member's copies issued before this reduce-scatter (on the same
      -- stream) are done: its sources may be written again
      local g = u.fp.group
      if p.copy_seq and st.copy_dirty[g] and st.copy_dirty[g] <= p.copy_seq then st.copy_dirty[g] = nil end
    end
    if p.src ~= p.out then p.src:free() end
    local out = p.out
    if u.strategy == 'HYBRID_SHARD' and st.replicate_group:size() > 1 and not st.skip_comm then
      dist.all_reduce(out, 'sum', { group = st.replicate_group })
      trace(st, 'all_reduce', u)
    end
    if out.dtype ~= u.gdtype then local o = out:to(u.gdtype); out:free(); out = o end
    if st.dp_size > 1 and not p.averaged then
      local post = st.dp_size / st.predivide
      if post ~= 1 then F().div_(out, post) end
    end
    local shard = u.fp.shard
    if st.offload then
      u:offload_grad(out)             -- the host waits here (offload's sync)
    else
      local cur = shard.grad
      if cur == nil then shard.grad = out
      else F().add_(cur, out); out:free() end
    end
    u.fp.grad_shard = shard.grad
  end
end

-- the next unit to prefetch after u in an order (a list and its positions)
local function next_in(order, pos, u)
  local i = pos and pos[u]
  return i and order[i + 1] or nil
end

local function prefetch(st, u)
  if u == nil or u.status ~= 'sharded' then return end
  -- (held units, fsdp.set_hold, are gathered by design: not counted)
  if st.inflight >= st.limit and not st.hold then
    trace(st, 'limit', u)
    return
  end
  u:gather_start()
end

local function index_of(list)
  local pos = {}
  for i, u in ipairs(list) do if pos[u] == nil then pos[u] = i end end
  return pos
end

local function on_backward_end(st)
  finish_reductions(st)
  st.in_backward = false
  for _, u in ipairs(st.units) do
    if u.reshards and u.status ~= 'sharded' and not st.hold then u:reshard() end
    if u.work then u.work:wait(); u.work:free(); u.work = nil end
  end
end

local function install_hooks(st, u)
  local m = u.module
  local Ad = A()
  m:register_forward_pre_hook(function()
    if not st.in_backward then
      local cur = st.cur_fwd
      if not st.cur_fwd_pos[u] then cur[#cur + 1] = u; st.cur_fwd_pos[u] = #cur end
    end
    trace(st, 'forward', u)
    u:gather_start()
    if st.forward_prefetch and not st.in_backward then prefetch(st, next_in(st.prev_fwd, st.prev_fwd_pos, u)) end
    u:unshard()
    -- the LM head's forward is the fused linear cross-entropy, which makes
    -- the head weight's gradient there: its sink (the f32 buffer) is
    -- registered now, so grad_W accumulates there with no f32 accumulator
    -- and no bf16 gradient of its own (docs/fsdp.md, "Mixed precision")
    if u.head and st.grad_sinks and not u.grad_direct and not st.in_backward and Ad.is_grad_enabled() then
      u:prepare_grads()
    end
  end, true)   -- passive: the unit's inputs and outputs pass untouched
  m:register_forward_hook(function()
    if st.in_backward then return end        -- a checkpointed region's recompute
    local e = st.cur_end
    e[#e + 1] = u
    if not u.reshards then return end
    local grad = Ad.is_grad_enabled()
    if grad and st.hold then return end      -- (fsdp.set_hold)
    -- no backward will come: reshard; otherwise per strategy (the root and
    -- the head unit stay unsharded under FULL_SHARD/HYBRID: their backwards
    -- come first, the head's reshards when its backward ends)
    if not grad or (u.strategy ~= 'SHARD_GRAD_OP' and u.module ~= st.root and not u.head) then u:reshard() end
  end, true)
  m:register_backward_pre_hook(function()
    if not st.in_backward then
      st.in_backward = true
      local order = {}
      for i = #st.cur_end, 1, -1 do order[#order + 1] = st.cur_end[i] end
      st.bwd_order, st.bwd_pos = order, index_of(order)
      -- (also when the backward fails: the collectives in flight are
      -- waited for and the units resharded, so the next forward starts
      -- clean; the gradients are then partial, as a failed backward
      -- leaves them anywhere)
      Ad.queue_callback(function() on_backward_end(st) end, { always = true })
    end
    trace(st, 'backward', u)
    u:gather_start()
    if st.backward_prefetch then prefetch(st, next_in(st.bwd_order, st.bwd_pos, u)) end
    u:unshard()
    u:prepare_grads()
  end)
  m:register_backward_hook(function()
    u:collect_grads()
    local sync = st.sync
    if sync == true or (sync and sync(u)) then u:reduce_grads() end
    if u.reshards and not st.hold then u:reshard() end
  end)
end

-- opts: policy, strategy ('FULL_SHARD'|'SHARD_GRAD_OP'|'NO_SHARD'|'HYBRID_SHARD'),
-- group, mesh / shard_size (HYBRID_SHARD), mixed_precision = {param=, reduce=},
-- limit_all_gathers (3), forward_prefetch (true), backward_prefetch (true),
-- free_unsharded (true), trace (true), dtype (the unsharded dtype without
-- mixed precision), offload (false: master shards, gradients and optimizer
-- state in host memory, the optimizer on the CPU), head_unit (nil: the
-- model's untied nn.LMHead, model:head_module(), is a unit of its own;
-- false: it stays in the root; true: it must be one), prefetch_root
-- (false: true issues the root's all-gather for the next step at the end of
-- the optimizer step, fsdp.after_step), expert_shard (HYBRID_SHARD of a
-- model split by ms.ep.parallelize: the ranks of this rank's shard group
-- that hold its experts, for a layout whose expert and shard groups are
-- not runs of consecutive world ranks, bin/train's --pp --ep; nil: made
-- from the world's layout, below)
function fsdp.fully_shard(model, opts)
  opts = opts or {}
  local nn = require 'moonshard.nn'
  local optim = require 'moonshard.optim'
  if not nn.is_module(model) then error('fully_shard: model must be a module', 2) end
  if rawget(model, '_fsdp') then error('fully_shard: model is already sharded', 2) end
  -- a model split by tp.parallelize with sequence_parallel: its norms' and
  -- row-parallel biases' gradients are this TP rank's tokens' part (its
  -- hooks on the parameters, which sum them, never see the units'
  -- gradient buffers): each unit sums their regions over the TP group
  -- before its own reduction (Unit:sum_sp_partial)
  local tpi = rawget(model, '_tp')
  local tp_sp = tpi and tpi.sp and tpi.sp_partial and tpi.sp or nil
  local strategy = opts.strategy or 'FULL_SHARD'
  if not STRATEGIES[strategy] then
    error(("fully_shard: strategy %s (use 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' or 'HYBRID_SHARD')")
      :format(tostring(strategy)), 2)
  end
  local policy = opts.policy or function() return false end
  if getmetatable(policy) == SizePolicy then
    local picked = size_pick(model, policy.min_numel)
    policy = function(m) return picked[m] == true end
  elseif type(policy) ~= 'function' and not (type(policy) == 'table' and getmetatable(policy) and getmetatable(policy).__call) then
    error('fully_shard: policy must be a function(module, name) -> bool or fsdp.policy.by_size(n)', 2)
  end
  local mp = opts.mixed_precision or {}
  if type(mp) ~= 'table' then error('fully_shard: mixed_precision must be a table {param =, reduce =}', 2) end
  for k, v in pairs(mp) do
    -- (the collectives carry f32, bf16, f64 and i64: no f16)
    if (k ~= 'param' and k ~= 'reduce') or (v ~= 'f32' and v ~= 'bf16') then
      error(('fully_shard: mixed_precision.%s = %s (param and reduce: f32 or bf16)'):format(tostring(k), tostring(v)), 2)
    end
  end
  if opts.head_unit ~= nil and type(opts.head_unit) ~= 'boolean' then
    error(('fully_shard: head_unit must be true, false or nil, got %s'):format(tostring(opts.head_unit)), 2)
  end
  local limit = opts.limit_all_gathers or 3
  if type(limit) ~= 'number' or limit < 1 then
    error(('fully_shard: limit_all_gathers must be a number >= 1, got %s'):format(tostring(limit)), 2)
  end
  if opts.float8_all_gather and (strategy == 'NO_SHARD' or opts.offload) then
    error('fully_shard: float8_all_gather needs a sharding strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD) '
      .. 'without offload', 2)
  end
  if opts.copy_gather ~= nil and type(opts.copy_gather) ~= 'boolean' and opts.copy_gather ~= 'emulate' then
    error(('fully_shard: copy_gather must be true, false or \'emulate\', got %s'):format(tostring(opts.copy_gather)), 2)
  end

  -- groups: the shard group (the layout's) and the replicate group
  local group, shard_group, replicate_group, mesh = opts.group, nil, nil, nil
  if group == nil and dist.is_initialized() then group = dist.world_group end
  if group ~= nil and (type(group) ~= 'table' or type(group.is_member) ~= 'function' or not group:is_member()) then
    error(('fully_shard: group %s is not a process group this rank belongs to'):format(tostring(group)), 2)
  end
  if strategy == 'HYBRID_SHARD' then
    if opts.group ~= nil then error('fully_shard: HYBRID_SHARD takes mesh = or shard_size =, not group =', 2) end
    if not dist.is_initialized() then error('fully_shard: HYBRID_SHARD needs ms.dist.init first', 2) end
    mesh = opts.mesh
    if mesh == nil then
      local S = opts.shard_size or dist.local_world_size()
      local W = dist.world_size()
      if type(S) ~= 'number' or S < 1 or W % S ~= 0 then
        error(('fully_shard: shard_size %s does not divide the world size %d'):format(tostring(S), W), 2)
      end
      mesh = dist.mesh { replicate = W / S, shard = S }
    elseif type(mesh) ~= 'table' or mesh.shard == nil or mesh.replicate == nil then
      error('fully_shard: mesh must come from ms.dist.mesh{replicate =, shard =} or be { shard = group, replicate = group }', 2)
    end
    shard_group, replicate_group = mesh.shard, mesh.replicate
  elseif strategy == 'NO_SHARD' then
    replicate_group = group
  else
    shard_group = group
  end
  local shard_size = shard_group and shard_group:size() or 1
  local dp_size = shard_size * (replicate_group and replicate_group:size() or 1)
  -- expert parallelism (ms.ep.parallelize): each MoE layer's local experts
  -- are a unit of their own, sharded over the ranks that hold the same
  -- experts (ep.replicate; none: whole on each rank); the rest over
  -- `group`, which must be every data-parallel rank (docs/moe.md)
  -- With HYBRID_SHARD the expert groups must lie inside the shard groups:
  -- an expert unit is then sharded over the ranks of this rank's shard
  -- group that hold the same experts (expert_shard) and replicated, as every
  -- unit, over the mesh's replicate group (the same place in the other
  -- shard groups holds the same experts); the norm's sum over the shard
  -- group counts every expert element once.
  local epi = rawget(model, '_ep_train')
  local expert_shard
  if epi then
    if strategy ~= 'FULL_SHARD' and strategy ~= 'SHARD_GRAD_OP' and strategy ~= 'HYBRID_SHARD' then
      error(('fully_shard: an expert-parallel model takes FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, not %s'):format(
        strategy), 2)
    end
    local R = epi.replicate and epi.replicate:size() or 1
    -- (tensor-parallel too, ep.parallelize then tp.parallelize: the expert
    -- groups hold whole TP groups; `group` is the ranks that hold the same
    -- slices, one of each TP group: FSDP x TP x EP, docs/moe.md)
    local N = tpi and tpi.size or 1
    -- (HYBRID_SHARD too, given the shard groups of the ranks that hold
    -- the same slices and expert_shard: bin/train's --tp --ep --fsdp
    -- HYBRID_SHARD)
    if N > 1 and strategy == 'HYBRID_SHARD' and (opts.mesh == nil or opts.expert_shard == nil) then
      error('fully_shard: HYBRID_SHARD of a model split by both expert and tensor parallelism takes mesh = (shard '
        .. 'groups of the ranks that hold the same slices) and expert_shard = (the ranks of this rank\'s shard '
        .. 'group that hold its experts)', 2)
    end
    if N > 1 and dp_size * N ~= epi.size * R then
      error(('fully_shard: the expert-parallel model\'s experts are split over %d ranks with %d copies (%d ranks) and '
        .. 'it is %d-way tensor parallel: shard it over the %d ranks that hold the same slices (the tensor-parallel '
        .. 'mesh\'s replicate axis), not a group of %d'):format(epi.size, R, epi.size * R, N, epi.size * R / N,
        dp_size), 2)
    elseif dp_size ~= epi.size * R and N == 1 then
      error(('fully_shard: the expert-parallel model\'s experts are split over %d ranks with %d copies (%d ranks); '
        .. 'shard it over all of them, not a group of %d'):format(epi.size, R, epi.size * R, dp_size), 2)
    end
    if opts.float8_all_gather or opts.offload then
      error('fully_shard: an expert-parallel model with ' .. (opts.offload and 'offload' or 'float8_all_gather')
        .. ': not supported', 2)
    end
    if strategy == 'HYBRID_SHARD' and opts.expert_shard ~= nil then
      -- (given: the caller's layout; its ranks must lie in the shard group
      -- and hold this rank's experts, which the reduction relies on)
      local es = opts.expert_shard
      if type(es) ~= 'table' or type(es.is_member) ~= 'function' or not es:is_member() then
        error(('fully_shard: expert_shard %s is not a process group this rank belongs to'):format(tostring(es)), 2)
      end
      local in_shard = {}
      for _, r in ipairs(shard_group:ranks()) do in_shard[r] = true end
      for _, r in ipairs(es:ranks()) do
        if not in_shard[r] then
          error(('fully_shard: expert_shard holds rank %d, which is not in this rank\'s shard group (%s)'):format(r,
            table.concat(shard_group:ranks(), ',')), 2)
        end
      end
      -- (tensor-parallel too: the shard group holds one rank of each of
      -- its TP groups, whose N ranks hold other experts)
      if es:size() * epi.size ~= shard_group:size() * N then
        error(('fully_shard: expert_shard of %d ranks with experts split over %d: the shard group of %d ranks%s must '
          .. 'be their product'):format(es:size(), epi.size, shard_group:size(),
          N > 1 and (' x %d-way tensor parallel'):format(N) or ''), 2)
      end
      expert_shard = es
    elseif strategy == 'HYBRID_SHARD' then
      local N, S, W = epi.size, shard_group:size(), dist.world_size()
      local sr, er = shard_group:ranks(), epi.group:ranks()
      -- (the layout bin/train makes: expert groups of N consecutive ranks
      -- from a multiple of N, shard groups of S consecutive ones)
      local inside = S % N == 0 and er[1] % N == 0 and er[1] >= sr[1] and er[#er] <= sr[#sr]
      for i = 2, #er do inside = inside and er[i] == er[i - 1] + 1 end
      if not inside then
        error(('fully_shard: HYBRID_SHARD with expert parallelism needs each expert group (%d consecutive ranks, here '
          .. '%s) inside a shard group (here %s)'):format(N, table.concat(er, ','), table.concat(sr, ',')), 2)
      end
      -- every rank creates every such group (a collective), keeping its own
      for row = 0, W / S - 1 do
        for k = 0, N - 1 do
          local ranks = {}
          for d = 0, S / N - 1 do ranks[#ranks + 1] = row * S + d * N + k end
          local g = dist.new_group(ranks)
          if g:is_member() then expert_shard = g else g:free() end
        end
      end
    end
  end

  -- the first name model:named_parameters() gives each tensor
  local first_name = {}
  for name, p in model:named_parameters() do
    local id = tonumber(p.id)
    if first_name[id] == nil then first_name[id] = name end
  end

  -- units in forward-declaration order; the root first. Each slot is
  -- (module, parameter name, full name); a tensor used by two units goes to the root.
  local units = { { module = model, name = '', slots = {} } }
  local slot_unit, tensor_units, order = {}, {}, {}
  local seen_m = {}
  local function walk(m, name, unit, in_moe)
    if seen_m[m] then return end
    seen_m[m] = true
    if m ~= model and policy(m, name) then
      if in_moe then
        -- (each rank's tokens choose the experts it runs: a unit inside
        -- one would gather on some ranks and not on others)
        error(('fully_shard: the unit %s is inside the mixture of experts %s, whose experts run only on the ranks '
          .. 'whose tokens chose them; make units of the modules that hold the MoE layers (docs/moe.md)'):format(name,
          in_moe), 0)
      end
      unit = { module = m, name = name, slots = {} }
      units[#units + 1] = unit
    end
    for _, pn in ipairs(m._param_names) do
      local t = rawget(m, pn)
      if t ~= nil then
        local slot = { m = m, pn = pn, name = (name == '' and pn or name .. '.' .. pn), t = t }
        local id = tonumber(t.id)
        if not tensor_units[id] then tensor_units[id] = {}; order[#order + 1] = id end
        tensor_units[id][unit] = true
        slot.unit, slot.id = unit, id
        slot_unit[#slot_unit + 1] = slot
      end
    end
    -- an expert-parallel MoE layer's experts: a unit of their own, its
    -- hooks on the layer (whose forward reads the experts' weights)
    local eunit
    if getmetatable(m) == nn.MoE and rawget(m, '_ep') then
      if not epi then
        error(('fully_shard: %s is expert-parallel (nn.moe.expert_parallel): its experts differ from rank to rank; '
          .. 'split it with ms.ep.parallelize, which says which ranks hold the same experts'):format(
          name == '' and 'the model' or name), 0)
      end
      local en = name == '' and 'experts' or name .. '.experts'
      eunit = { module = m, name = en, slots = {}, experts = true }
      units[#units + 1] = eunit
    end
    local moe = in_moe or (getmetatable(m) == nn.MoE and (name == '' and '(the model)' or name)) or nil
    for _, cn in ipairs(m._module_names) do
      local c = rawget(m, cn)
      if c ~= nil then
        walk(c, name == '' and cn or (name .. '.' .. cn), (eunit and cn == 'experts') and eunit or unit, moe)
      end
    end
  end
  walk(model, '', units[1])
  -- The LM head (docs/fsdp.md, "The LM head"; spec/dist_fsdp_rt_head_spec.lua).
  -- A model whose head_module() is an nn.LMHead (the final norm and the
  -- head weight, whose forward is the FLCE loss) gets it as a unit of its
  -- own when the head is untied (Llama's lm_head; opts.head_unit = false
  -- keeps it in the root): its tensors go to that unit whatever the policy
  -- picked around them. A tied head (GPT-2's wte), or none with
  -- head_unit = false, and a model's head_weight() without a head module,
  -- go to the root: it is used by the root's forward after every unit's,
  -- and the root stays gathered from its forward to the end of its
  -- backward, so the head is all-gathered once per step.
  local hm = type(model.head_module) == 'function' and model:head_module() or nil
  if hm ~= nil and not (nn.is_module(hm) and type(hm.params) == 'function') then
    error('fully_shard: model:head_module() must return an nn.LMHead (a module with params())', 2)
  end
  local head_ids = {}
  if hm then
    for _, ref in ipairs(hm:params()) do
      local t = rawget(ref[1], ref[2])
      local id = T.is_tensor(t) and tonumber(t.id)
      if id then
        if not tensor_units[id] then
          error(('fully_shard: the LM head uses a %s.%s that is not a parameter of the model'):format(
            ref[1]:class_name(), ref[2]), 2)
        end
        head_ids[#head_ids + 1] = id
      end
    end
  end
  local want_head = opts.head_unit
  if want_head == nil then want_head = hm ~= nil and not hm.tied end
  if want_head and (hm == nil or hm.tied) then
    error('fully_shard: head_unit = true needs an untied LM head (model:head_module(), not tied)', 2)
  end
  local head_unit = nil
  if want_head then
    head_unit = { module = hm, name = hm.name or 'lm_head', slots = {}, head = true }
    units[#units + 1] = head_unit
  else
    for _, id in ipairs(head_ids) do tensor_units[id][units[1]] = true end
    if type(model.head_weight) == 'function' then
      local ok, hw = pcall(model.head_weight, model)
      local id = ok and T.is_tensor(hw) and tonumber(hw.id)
      if id and tensor_units[id] then tensor_units[id][units[1]] = true end
    end
  end
  local owner = {}
  for _, id in ipairs(order) do
    local n, u1 = 0, nil
    for u in pairs(tensor_units[id]) do n = n + 1; u1 = u end   -- only counted: order-free
    owner[id] = n == 1 and u1 or units[1]
  end
  if head_unit then for _, id in ipairs(head_ids) do owner[id] = head_unit end end
  for _, slot in ipairs(slot_unit) do table.insert(owner[slot.id].slots, slot) end

  local st = {
    units = {}, strategy = strategy, group = group, shard_group = shard_group,
    replicate_group = replicate_group, mesh = mesh, dp_size = dp_size,
    predivide = fsdp.predivide_factor(dp_size), reduce_dtype = mp.reduce or 'f32',
    param_dtype = mp.param, limit = limit, inflight = 0, max_inflight = 0,
    forward_prefetch = opts.forward_prefetch ~= false, backward_prefetch = opts.backward_prefetch ~= false,
    sync = true, in_backward = false, pending = {}, root = model, tp_sp = tp_sp,
    cur_fwd = {}, cur_fwd_pos = {}, prev_fwd = {}, prev_fwd_pos = {}, cur_end = {},
    trace = opts.trace ~= false and {} or nil, offload = opts.offload == true,
    prefetch_root = opts.prefetch_root == true,
    -- copy-engine all-gathers (docs/fsdp.md "Copy-engine gathers")
    copy_gather = opts.copy_gather == 'emulate' and 'emulate'
      or (opts.copy_gather ~= false and os.getenv('MS_FSDP_COPY_GATHER') ~= '0'),
    src_gen = 1, copy_fenced = {}, copy_seq = 0, copy_dirty = {},
    -- low-precision parameters' gradients written by their GEMMs straight
    -- into the f32 unsharded buffer (docs/fsdp.md "Mixed precision")
    grad_sinks = opts.grad_sinks ~= false and os.getenv('MS_FSDP_GRAD_SINK') ~= '0',
  }
  -- step bookkeeping first (hooks run in registration order): a forward of
  -- the root outside backward starts a step
  model:register_forward_pre_hook(function()
    if st.in_backward then return end
    if #st.cur_fwd > 0 then st.prev_fwd, st.prev_fwd_pos = st.cur_fwd, st.cur_fwd_pos end
    st.cur_fwd, st.cur_fwd_pos, st.cur_end = {}, {}, {}
    -- (a root all-gather issued by after_step for this step, prefetch_root,
    -- opens its trace)
    if st.trace then st.trace = st.trace_carry or {} end
    st.trace_carry = nil
  end, true)
  for _, u in ipairs(units) do
    -- distinct tensors of the unit: the decayed ones (optim.no_decay says
    -- no) first, then the other trainable ones, then the frozen ones
    -- (requires_grad off: they keep it, get no gradient, and the
    -- optimizers leave their part of the shard alone), each group in
    -- first-use order
    local decay, nodecay, frozen, index = {}, {}, {}, {}
    for _, slot in ipairs(u.slots) do
      if not index[slot.id] then
        index[slot.id] = true
        local name = first_name[slot.id] or slot.name
        local e = { t = slot.t, id = slot.id, name = name }
        if not slot.t.requires_grad then frozen[#frozen + 1] = e
        elseif optim.no_decay(name, slot.t) then nodecay[#nodecay + 1] = e
        else decay[#decay + 1] = e end
      end
    end
    local tensors, names, k_of, is_frozen = {}, {}, {}, {}
    for li, list in ipairs({ decay, nodecay, frozen }) do
      for _, e in ipairs(list) do
        tensors[#tensors + 1] = e.t; names[#tensors] = e.name; k_of[e.id] = #tensors
        is_frozen[#tensors] = li == 3
      end
    end
    for _, slot in ipairs(u.slots) do slot.k = k_of[slot.id] end
    -- (the parameters whose gradients are sequence-parallel parts, by index)
    local sp_ks = nil
    if tp_sp then
      for id, k in pairs(k_of) do
        if tpi.sp_partial[id] and not is_frozen[k] then sp_ks = sp_ks or {}; sp_ks[#sp_ks + 1] = k end
      end
      if sp_ks then table.sort(sp_ks) end
    end
    if #tensors > 0 then
      local dtype = mp.param or opts.dtype or tensors[1].dtype
      local fopts = { dtype = dtype }
      -- (an expert unit over its copies: its gradient summed there and
      -- divided by every data-parallel rank, dp_size, as the others')
      local sg = shard_group
      if u.experts then sg = expert_shard or epi.replicate end
      if sg then fopts.group = sg else fopts.world_size, fopts.rank = 1, 0 end
      local ok, fp = pcall(FlatParam.new, tensors, fopts)
      if not ok then error('fully_shard: unit ' .. (u.name == '' and 'root' or u.name) .. ': ' .. tostring(fp), 2) end
      local gdtype = fp.shard.dtype == 'f64' and 'f64' or 'f32'
      local unit = setmetatable({
        module = u.module, name = u.name, label = u.name == '' and 'root' or u.name, fp = fp, st = st,
        head = u.head == true, experts = u.experts == true,
        strategy = strategy, group = fp.group, slots = u.slots, param_names = names,
        reshards = strategy ~= 'NO_SHARD', status = 'sharded', unsharded = false,
        -- the gradients' dtype: f32, f64 for an f64 master (an f64 model)
        gdtype = gdtype,
        grad_direct = dtype == gdtype,
        -- flat offsets: [0, decay_end) decayed, [decay_end, train_end) the
        -- other trainable tensors, [train_end, total) the frozen ones
        decay_end = #decay < #tensors and fp.layout.offsets[#decay + 1] or fp.total,
        train_end = #decay + #nodecay < #tensors and fp.layout.offsets[#decay + #nodecay + 1] or fp.total,
        frozen = is_frozen, sp_ks = sp_ks,
      }, Unit)
      fp.names = names        -- the same list as unit.param_names
      unit.free_data = unit.reshards and opts.free_unsharded ~= false
      if st.offload then
        -- the master shard moves to the host; the device keeps only the
        -- copy the all-gather reads (unit.lp, in the parameters' dtype,
        -- f32 included)
        local dev_shard = fp.shard
        local host = host_empty(fp.shard_numel, dev_shard.dtype, fp.device)
        host_copy(st, host, dev_shard)
        fp.shard = host
        if dtype == dev_shard.dtype then unit.lp = dev_shard
        else unit.lp = dev_shard:to(dtype); dev_shard:free() end
      elseif fp.shard.dtype ~= dtype then unit.lp = fp.shard:to(dtype) end
      if not unit.reshards and fp.shard.dtype == dtype and not st.offload then
        -- NO_SHARD without mixed precision: the master shard is the whole
        -- flat parameter, so the parameters are views of it (no second copy;
        -- the optimizer's in-place step is what they see)
        unit.flat, unit.aliased = fp.shard, true
      else
        unit.flat = T.empty({ fp.total }, { dtype = dtype, device = fp.device })
      end
      unit.views = fp:views(unit.flat)
      flat_units[storage_key(unit.flat)] = unit
      for k, v in ipairs(unit.views) do v.requires_grad = not is_frozen[k] end
      -- the original tensors are released now (the flat shard holds their
      -- values): left to the collector, a model's worth of memory stayed
      -- allocated for as many steps as it took to run (the Llama 1.25B:
      -- 4.65 GiB for 8 steps on one H100). A handle on one kept from before
      -- the wrapping is then released too, as PyTorch FSDP frees the
      -- original parameters' storage: use model:named_parameters().
      local released = {}
      for _, slot in ipairs(u.slots) do
        rawset(slot.m, slot.pn, unit.views[slot.k])
        local t = slot.t
        slot.t = nil     -- the original tensor: no reference kept
        if t ~= nil and not released[t] and t.storage ~= nil then
          released[t] = true
          if T.is_deferred(t) then T.init_records[t.storage.init_id] = nil end   -- (replayed into the shard)
          t:free()
        end
      end
      if unit.free_data then storage_check(C.ms_storage_free_data(unit.flat), 'releasing the unsharded buffer', unit) end
      st.units[#st.units + 1] = unit
      install_hooks(st, unit)
    end
  end
  if opts.float8_all_gather then
    -- the float8 units' plans, one amax vector for all (docs/fsdp.md)
    st.f8_units, st.f8_stale, st.f8_group = {}, true, shard_group
    st.box, st.box2 = ffi.new('ms_tensor*[1]'), ffi.new('ms_tensor*[1]')
    -- (n8: tensorwise amaxes, one a weight; nb: blockwise grids' entries)
    local n8, nb = 0, 0
    for _, unit in ipairs(st.units) do
      unit.f8 = f8_plan(unit)
      if unit.f8 then
        st.f8_units[#st.f8_units + 1] = unit
        for _, k in ipairs(unit.f8.ks) do
          local b = unit.f8.blk[k]
          if b then unit.f8.slot[k] = nb; nb = nb + b.nbr * b.nbc
          else unit.f8.slot[k] = n8; n8 = n8 + 1 end
        end
      end
    end
    if n8 + nb == 0 then
      error('fully_shard: float8_all_gather found no weight of a tensorwise or blockwise float8 layer (float8.convert '
        .. 'the model first)', 2)
    end
    -- tensor-parallel shards with tp_scales = 'group': the amax vector is
    -- all-reduced over the TP group too (a replicated weight's amax is the
    -- same on every rank of it); shards scaled alone cannot share it
    local shared, alone
    for _, unit in ipairs(st.f8_units) do
      for _, k in ipairs(unit.f8.ks) do
        local t = unit.f8.tp[k]
        if t and t.shared then
          if shared ~= nil and shared ~= t.group then
            error('fully_shard: float8_all_gather over weights of two tensor-parallel groups', 2)
          end
          shared = t.group
        elseif t then alone = alone or unit.param_names[k] end
      end
    end
    if shared ~= nil and alone ~= nil then
      error(("fully_shard: float8_all_gather: %s is a tensor-parallel shard scaled alone (tp_scales = 'shard') "
        .. "beside layers with tp_scales = 'group'; convert every layer with one tp_scales"):format(alone), 2)
    end
    st.f8_tp_group = shared
    local dev = st.units[1].fp.device
    st.f8_amax = n8 > 0 and T.zeros({ n8 }, { dtype = 'f32', device = dev }) or nil
    st.f8_bamax = nb > 0 and T.zeros({ nb }, { dtype = 'f32', device = dev }) or nil
    for _, unit in ipairs(st.f8_units) do unit:f8_init() end
  end
  for _, unit in ipairs(st.units) do
    if not unit.reshards then unit:unshard() end
  end
  -- after the root's forward (its own units' hooks ran first): without grad
  -- no backward will come, so nothing stays gathered (a prefetch that was
  -- not used included)
  model:register_forward_hook(function()
    if st.in_backward or A().is_grad_enabled() then return end
    for _, u in ipairs(st.units) do if u.reshards then u:reshard() end end
  end, true)
  if st.trace then st.trace = {} end
  rawset(model, '_fsdp', st)
  rawset(model, 'no_sync', function(self, fn, ...) return fsdp.no_sync(self, fn, ...) end)
  return model
end

local function state_of(model, fname)
  local st = type(model) == 'table' and rawget(model, '_fsdp')
  if not st then error(fname .. ': model was not passed to fsdp.fully_shard', 3) end
  return st
end
fsdp.state_of = function(model) return state_of(model, 'fsdp.state_of') end

-- the units (each: .fp the FlatParam, .module, .name, .views, .param_names)
function fsdp.units(model) return state_of(model, 'fsdp.units').units end

-- fsdp.releases_after_forward(t) -> true when t is a parameter of a unit
-- whose unsharded buffer is released when its forward ends and gathered
-- again for its backward (FULL_SHARD and HYBRID_SHARD, but for the root and
-- the head unit): what an op saves of it for backward is then memory the
-- resharding meant to free (moonshard.float8 casts such a weight again in
-- the backward instead of keeping its f8 copy)
function fsdp.releases_after_forward(t)
  local u = t.storage ~= nil and flat_units[storage_key(t)] or nil
  if u == nil or not u.reshards or not u.free_data or u.strategy == 'SHARD_GRAD_OP' or u.head then return false end
  return u.module ~= u.st.root
end

-- fsdp.manages(t) -> true when t is a view of a unit's unsharded buffer
-- (a parameter FSDP gathers and whose gradient it collects): nn.GatedMLP
-- reads gate's and up's side by side there (no copy of what resharding
-- frees) and writes their gradients into the unit's f32 sinks at once
function fsdp.manages(t)
  return t.storage ~= nil and flat_units[storage_key(t)] ~= nil
end

-- the debug trace of the last step (forward and backward): a list of
-- 'forward X', 'all_gather X', 'unshard X', 'reshard X', 'backward X',
-- 'reduce_scatter X' / 'all_reduce X', 'limit X' (a prefetch the limit held
-- back); X is the unit's name ('root' for the root)
function fsdp.trace(model) return state_of(model, 'fsdp.trace').trace or {} end

-- the most units unsharded or being gathered at once since fully_shard
-- (NO_SHARD units, never resharded, do not count)
function fsdp.max_inflight(model) return state_of(model, 'fsdp.max_inflight').max_inflight end

-- all-gather every unit (after an optimizer step, before reading
-- model:named_parameters() outside forward)
function fsdp.unshard(model)
  local st = state_of(model, 'fsdp.unshard')
  -- (float8_all_gather: every parameter in full precision, a unit gathered
  -- in f8 gathered again)
  st.f8_hp = true
  local ok, err = pcall(function()
    for _, u in ipairs(st.units) do
      if u.f8_live and u.reshards then u:reshard() end
      u:unshard()
    end
  end)
  st.f8_hp = false
  if not ok then error(err, 0) end
  return model
end

-- float8_all_gather: the f8 copy of a float8 layer's weight t (a view of
-- its gathered f8 buffer, t's shape, the recipe's weight dtype) and its
-- inverse scale (tensorwise: 0-dim f32; blockwise: the 128 x 128 blocks'
-- in float8_cast_blockwise's layout for t, and a third value, those for
-- t's transpose), while t's unit is gathered in f8; else nil.
-- moonshard.float8 takes it instead of casting t.
function fsdp.float8_weight(t)
  local u = T.is_tensor(t) and t.storage ~= nil and flat_units[storage_key(t)] or nil
  if u == nil or not u.f8_live or u.status ~= 'unsharded' then return nil end
  local k = u.f8.by_off[tonumber(t.offset)]
  if k == nil or t:numel() ~= u.fp.numels[k] or not t:is_contiguous() then return nil end
  return u.f8.views8[k], u.f8.inv[k], u.f8.inv_t[k]
end

-- whether t is (a view of) an FSDP unit's parameters: written by its
-- gathers, not by in-place ops (no version bump)
function fsdp.manages(t)
  return T.is_tensor(t) and t.storage ~= nil and flat_units[storage_key(t)] ~= nil
end

-- whether weight t's gathered f8 copy is scaled over TP group g (the
-- float8 config's tp_scales = 'group')
function fsdp.float8_group_scaled(t, g)
  local u = T.is_tensor(t) and t.storage ~= nil and flat_units[storage_key(t)] or nil
  return u ~= nil and u.st.f8_tp_group == g
end

-- float8_all_gather: write weight t's values from its f8 copy (what the
-- FP8 products see) into its region of the unit's buffer, which the f8
-- gather leaves unwritten; true when it did (a plain linear then reads t)
function fsdp.float8_materialize(t)
  local w8, inv, inv_t = fsdp.float8_weight(t)
  if w8 == nil then return false end
  no_grad(function()
    local F = require 'moonshard.ops'
    local w = w8:to('f32')
    local d
    if inv_t ~= nil then
      -- blockwise: each 128 x 128 block by its inverse scale (the grid
      -- without its padding, spread over the blocks' elements)
      local R, C = w8.shape[1], w8.shape[2]
      local nbr, nbc = R / 128, C / 128
      local n = inv:narrow(2, 1, nbc)
      local c = n:contiguous()
      local v = c:view({ nbr, 1, nbc, 1 })
      local g = v:expand({ nbr, 128, nbc, 128 })
      local gc = g:contiguous()
      local e = gc:view({ R, C })
      d = F.mul(w, e)
      for _, t2 in ipairs({ e, gc, g, v, c, n }) do t2:free() end
    else
      d = F.mul(w, inv)
    end
    raw_copy(t, d)
    w:free(); d:free()
  end)
  return true
end

-- release every unit's unsharded buffer (NO_SHARD units keep theirs)
function fsdp.reshard(model)
  for _, u in ipairs(state_of(model, 'fsdp.reshard').units) do
    if u.reshards then u:reshard() end
  end
  return model
end

-- every unit's master shard with its gradient (shard.grad), a list
function fsdp.shards(model)
  local r = {}
  for i, u in ipairs(state_of(model, 'fsdp.shards').units) do r[i] = u.fp.shard end
  return r
end

-- fsdp.no_sync(model, fn, ...) (also model:no_sync(fn, ...)): the backwards
-- inside fn keep their gradients unsharded (f32, summed over the backwards)
-- and communicate nothing; the first backward after it reduces the sum.
-- Returns fn's results.
function fsdp.no_sync(model, fn, ...)
  local st = state_of(model, 'fsdp.no_sync')
  if type(fn) ~= 'function' then error('fsdp.no_sync: need a function', 2) end
  local prev = st.sync
  st.sync = false
  local r = pack(pcall(fn, ...))
  st.sync = prev
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

-- fsdp.reduce_grads(model): the unsharded gradients that backwards under
-- no_sync kept, reduced now (each unit holding one, in the order of the
-- last backward: NO_SHARD's all-reduce, the others' reduce-scatter, with
-- the strategy's dtype and divides) and waited for, as the first backward
-- after no_sync does at its end: every gradient shard (shard.grad) is then
-- complete. With every backward of a step under no_sync, this is the
-- reduction after the whole backward (no overlap with it: Megatron's DDP
-- without overlap_grad_reduce), which a CUDA graph of the backward needs
-- (bin/train --cuda-graphs with several processes). Nothing held: a no-op.
function fsdp.reduce_grads(model)
  local st = state_of(model, 'fsdp.reduce_grads')
  if st.in_backward then error('fsdp.reduce_grads: not inside a backward', 2) end
  for _, list in ipairs({ st.bwd_order or {}, st.units }) do
    for _, u in ipairs(list) do if u.gbuf ~= nil then u:reduce_grads() end end
  end
  finish_reductions(st)
end

-- fsdp.grad_buffers(model) -> list (one entry a unit, fsdp.units' order):
-- a handle of its own on each unit's unsharded gradient buffer (false where
-- a unit holds none), and fsdp.set_grad_buffers(model, list): each unit's
-- buffer made a new handle on list's again, as if its backwards had just
-- written it (views dropped; every region counted as written). A CUDA graph
-- of the backwards (under no_sync) writes the buffers its capture made at
-- each replay, which the Lua side does not see: bin/train --cuda-graphs
-- keeps them with grad_buffers after the capture and hands them back after
-- each replay, before fsdp.reduce_grads. The caller frees list's handles.
function fsdp.grad_buffers(model)
  local r = {}
  for i, u in ipairs(state_of(model, 'fsdp.grad_buffers').units) do
    r[i] = u.gbuf ~= nil and u.gbuf:alias() or false
  end
  return r
end

function fsdp.set_grad_buffers(model, list)
  local st = state_of(model, 'fsdp.set_grad_buffers')
  if st.in_backward then error('fsdp.set_grad_buffers: not inside a backward', 2) end
  if type(list) ~= 'table' or #list ~= #st.units then
    error(('fsdp.set_grad_buffers: need a list of %d entries (fsdp.grad_buffers), got %s'):format(#st.units,
      type(list) == 'table' and #list .. ' entries' or type(list)), 2)
  end
  for i, u in ipairs(st.units) do
    local b = list[i]
    if u.gbuf then u:drop_gviews(); u.gbuf:free(); u.gbuf = nil end
    if b then
      if b:numel() ~= u.fp.total then
        error(('fsdp.set_grad_buffers: entry %d has %d elements, unit %s\'s buffer %d'):format(i, b:numel(), u.label,
          u.fp.total), 2)
      end
      u.gbuf = b:alias()
      u.gwritten = {}
      for k = 1, u.fp.nparams do u.gwritten[k] = true end
    end
    u.sp_mode = nil
  end
end

-- fsdp.grad_shards(model) -> list (one entry a unit, fsdp.units' order):
-- a handle of its own on each unit's gradient shard (shard.grad, f32: the
-- reduced gradient the optimizer reads; false where a unit has none), and
-- fsdp.set_grad_shards(model, list): each unit's gradient shard made a new
-- handle on list's again, as if fsdp.reduce_grads had just written it (the
-- unsharded buffers dropped). A CUDA graph that holds the reduction too
-- (bin/train --cuda-graphs, data parallel with --graph-collectives on)
-- writes the shards its capture made at each replay, unseen by Lua: the
-- loop keeps them with grad_shards after the capture and hands them back
-- after each replay. The caller frees list's handles.
function fsdp.grad_shards(model)
  local r = {}
  for i, u in ipairs(state_of(model, 'fsdp.grad_shards').units) do
    local g = u.fp.shard.grad
    r[i] = g ~= nil and g:alias() or false
  end
  return r
end

function fsdp.set_grad_shards(model, list)
  local st = state_of(model, 'fsdp.set_grad_shards')
  if st.in_backward then error('fsdp.set_grad_shards: not inside a backward', 2) end
  if type(list) ~= 'table' or #list ~= #st.units then
    error(('fsdp.set_grad_shards: need a list of %d entries (fsdp.grad_shards), got %s'):format(#st.units,
      type(list) == 'table' and #list .. ' entries' or type(list)), 2)
  end
  for i, u in ipairs(st.units) do
    local b = list[i]
    if b and b:numel() ~= u.fp.shard_numel then
      error(('fsdp.set_grad_shards: entry %d has %d elements, unit %s\'s shard %d'):format(i, b:numel(), u.label,
        u.fp.shard_numel), 2)
    end
  end
  for i, u in ipairs(st.units) do
    local b = list[i]
    if u.gbuf then u:drop_gviews(); u.gbuf:free(); u.gbuf = nil end
    u.sp_mode = nil
    local cur = u.fp.shard.grad
    if cur ~= nil then cur:free() end
    u.fp.shard.grad = b and b:alias() or nil
    u.fp.grad_shard = u.fp.shard.grad
  end
end

-- fsdp.grad_pieces(unit) -> list of { k, view }: the unit's gradient
-- shard (fp.shard.grad) cut at its parameters' bounds, each view the part
-- of parameter k (unit.param_names[k], unit.views[k]) this rank holds
-- (the caller frees the views); empty without a gradient
function fsdp.grad_pieces(u)
  local fp, g, r = u.fp, u.fp.shard.grad, {}
  if g == nil then return r end
  local a0, n = fp.rank * fp.shard_numel, fp.shard_numel
  for k = 1, fp.nparams do
    local o = fp.layout.offsets[k]
    local lo, hi = math.max(o, a0), math.min(o + fp.layout.numels[k], a0 + n)
    if hi > lo then r[#r + 1] = { k, g:narrow(1, lo - a0 + 1, hi - lo) } end
  end
  return r
end

-- fsdp.set_sync(model, on) -> previous: whether the backwards reduce
-- their gradients (fsdp.no_sync is it around a function); on may be a
-- function(unit) -> bool, asked at each unit's backward end. A pipeline's
-- step (moonshard.pp) turns it off for every micro-batch's backward but
-- each unit's last of the step, which reduces the sum.
function fsdp.set_sync(model, on)
  local st = state_of(model, 'fsdp.set_sync')
  local prev = st.sync
  if type(on) == 'function' then st.sync = on else st.sync = on and true or false end
  return prev
end

-- fsdp.set_hold(model, on) -> previous: while on, a unit once gathered
-- stays gathered (its forward and backward end, and the backward's, leave
-- it unsharded; a forward without grad still reshards): a pipeline's step
-- under SHARD_GRAD_OP gathers each unit once for all its micro-batches,
-- as torchtitan's FSDP x PP does. Turning it off reshards the units it held.
function fsdp.set_hold(model, on)
  local st = state_of(model, 'fsdp.set_hold')
  if st.in_backward then error('fsdp.set_hold: not inside a backward', 2) end
  local prev = st.hold == true
  st.hold = on and true or false
  if prev and not st.hold then
    for _, u in ipairs(st.units) do
      if u.reshards and u.status ~= 'sharded' then u:reshard() end
    end
  end
  return prev
end

-- fsdp.set_before_reduce(model, fn) -> previous: fn(unit) runs just before
-- a unit's unsharded gradient (f32; f64 for an f64 model) is reduced,
-- while unit.gviews (views of
-- it in the parameters' shapes, unit.views' order) can still change it (a
-- pipeline sums a tied weight's gradient between its first and last
-- stage there); nil removes it
function fsdp.set_before_reduce(model, fn)
  local st = state_of(model, 'fsdp.set_before_reduce')
  if fn ~= nil and type(fn) ~= 'function' then error('fsdp.set_before_reduce: need a function or nil', 2) end
  local prev = st.before_reduce
  st.before_reduce = fn
  return prev
end

-- fsdp.set_skip_comm(model, on): while on, the runtime issues no collective
-- (no all-gather, reduce-scatter, all-reduce of NO_SHARD / HYBRID_SHARD, nor
-- the all-reduce of clip_grad_norm); everything else runs as usual (buffers,
-- casts, copies, kernels), so the step time without communication can be
-- subtracted from the real one (bench/fsdp.lua: exposed communication).
-- The numerics are meaningless while on: an unsharded buffer of a sharded
-- unit holds this rank's shard in every member's slot (a local copy), a
-- reduce-scatter's output is this rank's own part of its local gradient,
-- NO_SHARD's gradient is the local one, the norm is the local one. An optimizer step while on changes the master
-- shards by those gradients. Turning it off (between steps) drops every
-- unsharded buffer, so the next forward gathers the master shards again.
-- Returns the previous setting.
function fsdp.set_skip_comm(model, on)
  local st = state_of(model, 'fsdp.set_skip_comm')
  if st.in_backward then error('fsdp.set_skip_comm: not inside a backward', 2) end
  local prev = st.skip_comm == true
  st.skip_comm = on and true or false
  if prev and not st.skip_comm then
    for _, u in ipairs(st.units) do
      if u.work then u.work:wait(); u.work:free(); u.work = nil end
      if u.reshards then u:reshard()
      elseif not u.aliased then u.status = 'sharded'; u:unshard() end
    end
  end
  return prev
end

-- drop every gradient: the sharded ones, the unsharded ones no_sync kept,
-- and the reductions a step cut short left in flight (an error between a
-- unit's reduction and finish_reductions: a CUDA graph capture aborted
-- inside fsdp.reduce_grads, say), their handles freed unwaited (a wait
-- after an aborted capture has nothing to wait for; the allocator keeps
-- their memory until the communication stream is done with it)
function fsdp.zero_grad(model)
  local st = state_of(model, 'fsdp.zero_grad')
  local pend = st.pending or {}
  st.pending = {}
  for _, p in ipairs(pend) do
    if p.work then p.work:free() end
    if p.src ~= p.out and p.src.storage ~= nil then p.src:free() end
    if p.out.storage ~= nil then p.out:free() end
  end
  for _, u in ipairs(st.units) do
    u.fp.shard:zero_grad()
    u.fp.grad_shard = nil
    for _, v in ipairs(u.views) do v.grad = nil end
    if u.gbuf then u:drop_gviews(); u.gbuf:free(); u.gbuf = nil end
    u.sp_mode = nil
  end
end

-- after an optimizer stepped the master shards: refresh each unit's
-- low-precision copy, and make every unsharded copy stale (the next
-- unshard gathers the new values). With prefetch_root the root's
-- all-gather for the next step is issued as soon as its copy is refreshed,
-- ahead of the other units' refreshes and of whatever the caller does
-- before the next forward (its trace event opens the next step's trace).
-- copy-engine gathers since the last reduction (a forward without a
-- backward): the peers may still read the copies about to be rewritten,
-- so fence first (once)
local function fence_dirty_copies(st, label)
  for g in pairs(st.copy_dirty) do copy_fence(st, g, true, label) end
  st.copy_dirty = {}
end

function fsdp.after_step(model)
  local st = state_of(model, 'fsdp.after_step')
  fence_dirty_copies(st, 'after_step')
  st.f8_stale = true   -- (float8_all_gather: the f8 shards are cast again)
  for _, u in ipairs(st.units) do
    if u.lp_written then
      -- the optimizer's step wrote it (fsdp.optimizer's mirrors): what
      -- refresh_lp does besides the cast
      u.lp_written = nil
      st.src_gen = st.src_gen + 1
      u.lp_stale = false
    elseif u.lp then
      u:refresh_lp()   -- with offload: the upload (copy stream)
    end
    if u.reshards then
      u:reshard()
      if st.prefetch_root and u.module == st.root then
        local tr = st.trace
        if tr then st.trace = {} end
        u:gather_start()
        if tr then st.trace_carry, st.trace = st.trace, tr end
      end
    else u.status = 'sharded'; u:unshard() end
  end
  -- float8_all_gather: the next step's scales and f8 shards now, queued
  -- behind the optimizer's kernels (not at the next step's first gather,
  -- which would wait for them)
  if st.f8_units and (st.f8_stale or st.f8_gen ~= st.src_gen) then f8_precompute(st) end
end

-- fsdp.clip_grad_norm(model, max_norm) -> the total 2-norm of the gradient
-- (a 0-dim f64 tensor, on the model's device; no host read), after scaling
-- every gradient shard by min(1, max_norm / (norm + 1e-6)) as
-- ms.optim.clip_grad_norm does. The sum of squares of the local shards
-- (padding is zero) is all-reduced over the shard group only, so replicas
-- (NO_SHARD, HYBRID_SHARD's replicate group) are not counted twice.
-- opts.defer = the fsdp.AdamW: the shards are not scaled here; its next step
-- applies the coefficient on the way in (AdamW:defer_grad_scale; not with
-- offload, whose gradients live on the host).
function fsdp.clip_grad_norm(model, max_norm, opts)
  local st = state_of(model, 'fsdp.clip_grad_norm')
  if type(max_norm) ~= 'number' or max_norm <= 0 then
    error(('fsdp.clip_grad_norm: max_norm must be a number > 0, got %s'):format(tostring(max_norm)), 2)
  end
  if opts and opts.norm_type and opts.norm_type ~= 2 then error('fsdp.clip_grad_norm: only norm_type 2', 2) end
  local Fo = F()
  local grads = {}
  for _, u in ipairs(st.units) do
    local g = u.fp.shard.grad
    if g ~= nil then grads[#grads + 1] = g end
  end
  local device = st.units[1] and st.units[1].fp.device or -1
  local sq
  if #grads > 0 then
    local s0 = Fo.sum_squares(grads)
    sq = s0:reshape({ 1 })
    s0:free()
  else sq = T.zeros({ 1 }, { dtype = 'f64', device = device }) end
  if sq.device_id ~= device then
    -- offload: the host's sum of squares goes to the device (the
    -- all-reduce's and the result's)
    local d = sq:to({ device = device }); sq:free(); sq = d
  end
  if st.shard_group and st.shard_group:size() > 1 and not st.skip_comm then
    dist.all_reduce(sq, 'sum', { group = st.shard_group })
    if st.trace then st.trace[#st.trace + 1] = 'all_reduce clip_grad_norm' end
  end
  local total = Fo.sqrt(sq)
  sq:free()
  local defer = opts and opts.defer
  if defer ~= nil and (type(defer) ~= 'table' or type(defer.defer_grad_scale) ~= 'function') then
    error('fsdp.clip_grad_norm: defer must be an optimizer with defer_grad_scale (fsdp.AdamW)', 2)
  end
  if #grads > 0 and defer ~= nil and grads[1].device_id == total.device_id then
    -- the optimizer's next step applies the coefficient (no pass here)
    local denom = Fo.add(total, 1e-6)
    local coef = Fo.div(max_norm, denom)
    denom:free()
    local c1 = Fo.clamp(coef, nil, 1.0)
    coef:free()
    defer:defer_grad_scale(c1:reshape({ 1 }))
    c1:free()
  elseif #grads > 0 then
    local denom = Fo.add(total, 1e-6)
    local coef = Fo.div(max_norm, denom)
    denom:free()
    local c1 = Fo.clamp(coef, nil, 1.0)
    coef:free()
    -- (in the gradients' dtype: f32, or f64 for an f64 master; an f64
    -- model's coefficient rounded to f32 moved its update by ~1e-8)
    local c32 = c1.dtype == grads[1].dtype and c1 or c1:to(grads[1].dtype)
    if c32 ~= c1 then c1:free() end
    if grads[1].device_id ~= c32.device_id then
      -- offload: the coefficient read to the host (clipping's host sync)
      local h = c32:to({ device = grads[1].device_id }); c32:free(); c32 = h
    end
    no_grad(function() for _, g in ipairs(grads) do Fo.mul_(g, c32) end end)
    c32:free()
  end
  local r = total:reshape({})
  total:free()
  return r
end

-- Optimizers over the master shards. Each unit's flat layout puts the
-- decayed parameters first, so this rank's shard splits into at most one
-- decayed range and one no-decay range; the optimizer has two groups of
-- such ranges (narrow views of the shards, weight_decay = opts.weight_decay
-- and 0) and steps each group in one fused call (AdamW). opt:zero_grad() is
-- fsdp.zero_grad(model); after each step the next unshard gathers the new
-- values.
--
-- fsdp.optimizer(model, cls, opts, split_decay): optimizer class `cls`
-- (ms.optim.AdamW, ms.optim.SGD, or any built by optim.new_optimizer) over
-- the units' flat f32 shards, one parameter group per decay kind. With
-- split_decay (AdamW's default, as for a whole model) the decayed part of
-- each shard (the 2-D weights, laid out first) gets opts.weight_decay and
-- the rest none; without it every element decays (SGD's default, as
-- optim.SGD(model) does). step() hands each piece its slice of the shard's
-- gradient, steps, then refreshes the low-precision copies and unsharded
-- buffers (fsdp.after_step); zero_grad() clears the units' gradients.
function fsdp.optimizer(model, cls, opts, split_decay)
  local st = state_of(model, 'fsdp.optimizer')
  if type(cls) ~= 'table' or getmetatable(cls) == nil then
    error('fsdp.optimizer: cls must be an optimizer class (ms.optim.AdamW, ms.optim.SGD, ...)', 2)
  end
  opts = opts or {}
  local wd = opts.weight_decay
  if wd == nil then wd = cls == require('moonshard.optim').AdamW and 0.01 or 0 end
  local decay, nodecay, pieces = {}, {}, {}
  for _, u in ipairs(st.units) do
    local fp = u.fp
    local S = fp.shard_numel
    -- this shard's trainable elements (the frozen ones, laid out last, get
    -- no piece: nothing steps them), the decayed ones first
    local nt = math.max(0, math.min(S, u.train_end - fp.rank * S))
    local nd = nt
    if split_decay then nd = math.max(0, math.min(nt, u.decay_end - fp.rank * S)) end
    local function piece(off, n, list)
      local p = fp.shard:narrow(1, off + 1, n)
      pieces[#pieces + 1] = { p = p, unit = u, off = off, n = n, decay = list == decay }
      list[#list + 1] = p
    end
    if nd > 0 then piece(0, nd, decay) end
    if nt - nd > 0 then piece(nd, nt - nd, nodecay) end
  end
  local groups, kinds = {}, {}
  if #decay > 0 then groups[#groups + 1] = { params = decay, weight_decay = wd }; kinds[#groups] = true end
  if #nodecay > 0 then groups[#groups + 1] = { params = nodecay, weight_decay = 0 }; kinds[#groups] = false end
  if #groups == 0 then
    -- nothing trainable in this rank's shards: an error only when the
    -- model has nothing trainable at all (the layout is every rank's);
    -- else the rank's optimizer has an empty group (a small trainable part,
    -- LoRA adapters say, laid out first, may all lie in other ranks' shards)
    local any = false
    for _, u in ipairs(st.units) do if u.train_end > 0 then any = true end end
    if not any then error('fsdp.optimizer: the model has no trainable parameters', 2) end
    groups[1] = { params = {}, weight_decay = wd }
    kinds[1] = true
  end
  local opt = cls(groups, opts)
  rawset(opt, 'fsdp_pieces', pieces)
  -- whether each group is the decayed one (a rank's shards may hold only
  -- one kind: the groups' indices are not the whole model's)
  rawset(opt, 'fsdp_group_decays', kinds)
  -- an optimizer that can (AdamW: set_mirrors) writes each piece's
  -- low-precision copy in its own pass, and after_step skips that unit's
  -- refresh (a cast of the whole shard) when every piece of it was written
  -- or not stepped. MS_FSDP_STEP_LP=0: the refresh as before (to compare).
  local mirrors = nil
  if opt.set_mirrors and not st.offload and os.getenv('MS_FSDP_STEP_LP') ~= '0' then
    mirrors = {}
    for _, pc in ipairs(pieces) do
      local lp = pc.unit.lp
      if lp ~= nil and lp.device_id == pc.p.device_id then pc.lp = lp:narrow(1, pc.off + 1, pc.n); mirrors[pc.p] = pc.lp end
    end
    opt:set_mirrors(mirrors)
  end
  local step = opt.step
  rawset(opt, 'step', function(self, ...)
    for _, pc in ipairs(pieces) do
      local g = pc.unit.fp.shard.grad
      pc.p.grad = g ~= nil and g:narrow(1, pc.off + 1, pc.n) or nil
    end
    -- the copies are written in the step: peers' reads of them done first
    if mirrors then fence_dirty_copies(st, 'step') end
    local stepped = {}
    for _, pc in ipairs(pieces) do stepped[pc] = pc.p.grad ~= nil end
    local ok, err = pcall(step, self, ...)
    for _, pc in ipairs(pieces) do
      local g = pc.p.grad
      if g ~= nil then pc.p.grad = nil; g:free() end
    end
    if not ok then error(err, 0) end
    if mirrors then
      local fresh = {}
      for _, pc in ipairs(pieces) do
        local u = pc.unit
        if fresh[u] == nil then fresh[u] = u.lp ~= nil and not u.lp_stale end
        if stepped[pc] and not (pc.lp and self.mirrored and self.mirrored[pc.p]) then fresh[u] = false end
      end
      for u, f in pairs(fresh) do if f then u.lp_written = true end end
    end
    fsdp.after_step(model)
  end)
  rawset(opt, 'zero_grad', function() fsdp.zero_grad(model) end)
  return opt
end

-- the fused AdamW over the shards, decay split as optim.AdamW(model)
function fsdp.AdamW(model, opts)
  return fsdp.optimizer(model, require('moonshard.optim').AdamW, opts, true)
end

-- SGD (momentum, nesterov, L2 weight decay) over the shards, every element
-- decayed as optim.SGD(model)
function fsdp.SGD(model, opts)
  return fsdp.optimizer(model, require('moonshard.optim').SGD, opts, false)
end

function FlatParam:__tostring()
  return ('fsdp.FlatParam(%d parameters, %s, rank %d of %d, shard %d of %d elements%s)'):format(
    self.nparams, self.dtype, self.rank, self.world_size, self.shard_numel, self.total,
    self.flat and ', unsharded' or '')
end

-- ms.fsdp.checkpoint: sharded and full checkpoints of sharded models
-- (moonshard.fsdp_checkpoint, docs/fsdp-checkpoints.md), loaded on first use
setmetatable(fsdp, { __index = function(t, k)
  if k == 'checkpoint' then
    local m = require 'moonshard.fsdp_checkpoint'
    rawset(t, k, m)
    return m
  end
end })

return fsdp
