-- moonshard.fsdp — fully sharded data parallel: the flat parameter
-- (core/fsdp/flat.h) and its three collective steps, and on top of them
-- fully_shard (units by policy, FULL_SHARD / NO_SHARD, CPU) with
-- fsdp.AdamW over the master shards. Prefetch, the GPU buffers and the
-- other strategies are still to come (docs/fsdp.md).
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
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local C = T.C
local function no_grad(fn) return require('moonshard.autograd').no_grad(fn) end

local fsdp = {}

local function check(rc, level)
  if rc ~= 0 then error(ffi.string(C.ms_last_error()), (level or 1) + 1) end
end

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
-- params: a list of CPU tensors (any shapes). group: a dist group (default:
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
    if p.device ~= 'cpu' then
      error(('FlatParam.new: parameter %d is on %s (only CPU flat parameters so far)'):format(i, p.device), 2)
    end
    shapes[i], numels[i] = p.shape, p:numel()
  end
  local elem = T.empty({ 0 }, { dtype = dtype }):element_size()
  local ok, layout = pcall(fsdp.layout, numels, { group_size = world_size, elem_size = elem, align = opts.align or 16 })
  if not ok then error('FlatParam.new: ' .. tostring(layout), 2) end
  local self = setmetatable({
    layout = layout, group = group, rank = rank, world_size = world_size, dtype = dtype,
    master_dtype = opts.master_dtype or (dtype == 'f64' and 'f64' or 'f32'),
    shapes = shapes, numels = numels, nparams = #params,
    shard_numel = layout.shard_numel, total = layout.total,
  }, FlatParam)
  local flat = self:flatten(params, self.master_dtype)
  self.shard = self:local_shard(flat):clone()
  flat:free()
  return self
end

-- a new zero-padded flat tensor (layout.total elements, dtype: self.dtype
-- unless given) holding `params`
function FlatParam:flatten(params, dtype)
  if #params ~= self.nparams then
    error(('flatten: %d tensors for a flat parameter of %d'):format(#params, self.nparams), 2)
  end
  local flat = T.zeros({ self.total }, { dtype = dtype or self.dtype })
  for i, p in ipairs(params) do
    if p:numel() ~= self.numels[i] then
      error(('flatten: parameter %d has %d elements, the layout %d'):format(i, p:numel(), self.numels[i]), 2)
    end
    if self.numels[i] > 0 then
      flat:narrow(1, self.layout.offsets[i] + 1, self.numels[i]):copy_(p:reshape(self.numels[i]))
    end
  end
  return flat
end

-- each parameter as a view of `flat` (a tensor of layout.total elements), in
-- its original shape
function FlatParam:views(flat)
  if not T.is_tensor(flat) or flat:numel() ~= self.total or flat:dim() ~= 1 then
    error(('views: need a 1-d flat tensor of %d elements'):format(self.total), 2)
  end
  local r = {}
  for i = 1, self.nparams do
    r[i] = flat:narrow(1, self.layout.offsets[i] + 1, self.numels[i]):view(self.shapes[i])
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
  if self.world_size == 1 then out:copy_(inp); return end
  if not self.group then error('unshard: no process group (dist not initialised?)', 3) end
  dist.all_gather_into(out, inp, { group = self.group })
end

-- all-gather every rank's shard, cast to self.dtype (the low-precision copy,
-- made here on each call), into the unsharded flat buffer (self.flat) and
-- return the parameter views (also self.param_views). A second call while
-- unsharded returns the same views.
function FlatParam:unshard()
  if self.flat then return self.param_views end
  local flat = T.empty({ self.total }, { dtype = self.dtype })
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
  local g = T.zeros({ self.total }, { dtype = dtype or self.dtype })
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
  local out = self.grad_shard or T.empty({ self.shard_numel }, { dtype = 'f32' })
  if self.world_size == 1 then
    out:copy_(src)
  else
    if not self.group then error('reduce_scatter: no process group (dist not initialised?)', 2) end
    dist.reduce_scatter(out, src, op, { group = self.group })
  end
  self.grad_shard = out
  return out
end

-- ------------------------------------------------------------ fully_shard
-- fsdp.fully_shard(model, { policy =, strategy = 'FULL_SHARD'|'NO_SHARD',
-- group =, dtype = }) -> model. Every module the policy picks (and the root,
-- taking the parameters no unit took and every parameter shared between
-- units) becomes a unit with one FlatParam. The module's parameters are
-- replaced by views of the unit's unsharded buffer (leaves, requires_grad),
-- so model:named_parameters() keeps the names and shapes. On CPU the
-- unsharded buffer stays allocated (the tape keeps the views it saved);
-- "reshard" marks the unit sharded and the next unshard all-gathers again.
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
  return function(m)
    for _, c in ipairs(classes) do if is_instance(m, c) then return true end end
    return false
  end
end

local Unit = {}
Unit.__index = Unit

function Unit:unshard()
  if self.unsharded then return end
  local fp = self.fp
  local src = fp.shard.dtype == fp.dtype and fp.shard or fp.shard:to(fp.dtype)
  no_grad(function()
    if fp.world_size == 1 then self.flat:copy_(src)
    else dist.all_gather_into(self.flat, src, { group = fp.group }) end
  end)
  self.unsharded = true
end

function Unit:reshard() self.unsharded = false end

-- every view's .grad into a zeroed f32 buffer, then reduce-scatter 'avg'
-- (FULL_SHARD) or all-reduce 'avg' (NO_SHARD); shard.grad is the result
function Unit:reduce_grads()
  local fp = self.fp
  local g, gviews = fp:grad_buffer('f32')
  local any = false
  for i, v in ipairs(self.views) do
    local pg = v.grad
    if pg ~= nil then
      gviews[i]:copy_(pg)
      any = true
      v.grad = nil
    end
  end
  if self.strategy == 'NO_SHARD' then
    if self.group and self.group:size() > 1 then dist.all_reduce(g, 'avg', { group = self.group }) end
    fp.shard.grad = g
  else
    fp.shard.grad = fp:reduce_scatter(g, 'avg')
  end
  self.has_grad = any
end

function fsdp.fully_shard(model, opts)
  opts = opts or {}
  local nn = require 'moonshard.nn'
  if not nn.is_module(model) then error('fully_shard: model must be a module', 2) end
  if rawget(model, '_fsdp') then error('fully_shard: model is already sharded', 2) end
  local strategy = opts.strategy or 'FULL_SHARD'
  if strategy ~= 'FULL_SHARD' and strategy ~= 'NO_SHARD' then
    error(("fully_shard: strategy %s (use 'FULL_SHARD' or 'NO_SHARD')"):format(tostring(strategy)), 2)
  end
  local policy = opts.policy or function() return false end
  if type(policy) ~= 'function' then error('fully_shard: policy must be a function(module, name) -> bool', 2) end
  local group = opts.group
  if group == nil and dist.is_initialized() then group = dist.world_group end

  -- units in forward-declaration order; the root first. Each slot is
  -- (module, parameter name, full name); a tensor used by two units goes to the root.
  local units = { { module = model, name = '', slots = {} } }
  local slot_unit, tensor_units, order = {}, {}, {}
  local seen_m = {}
  local function walk(m, name, unit)
    if seen_m[m] then return end
    seen_m[m] = true
    if m ~= model and policy(m, name) then
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
    for _, cn in ipairs(m._module_names) do
      local c = rawget(m, cn)
      if c ~= nil then walk(c, name == '' and cn or (name .. '.' .. cn), unit) end
    end
  end
  walk(model, '', units[1])
  local owner = {}
  for _, id in ipairs(order) do
    local n, u1 = 0, nil
    for u in pairs(tensor_units[id]) do n = n + 1; u1 = u end   -- only counted: order-free
    owner[id] = n == 1 and u1 or units[1]
  end
  for _, slot in ipairs(slot_unit) do table.insert(owner[slot.id].slots, slot) end

  local state = { units = {}, strategy = strategy, group = group }
  for _, u in ipairs(units) do
    -- distinct tensors of the unit, in first-use order
    local tensors, index = {}, {}
    for _, slot in ipairs(u.slots) do
      if not index[slot.id] then tensors[#tensors + 1] = slot.t; index[slot.id] = #tensors end
      slot.k = index[slot.id]
    end
    if #tensors > 0 then
      local fopts = { dtype = opts.dtype or tensors[1].dtype }
      if strategy == 'NO_SHARD' then fopts.world_size, fopts.rank = 1, 0 else fopts.group = group end
      local fp = FlatParam.new(tensors, fopts)
      local unit = setmetatable({ module = u.module, name = u.name, fp = fp, strategy = strategy,
        group = group, slots = u.slots, unsharded = false }, Unit)
      unit.flat = T.empty({ fp.total }, { dtype = fp.dtype })
      unit.views = fp:views(unit.flat)
      for _, v in ipairs(unit.views) do v.requires_grad = true end
      for _, slot in ipairs(u.slots) do rawset(slot.m, slot.pn, unit.views[slot.k]) end
      unit:unshard()
      if strategy == 'FULL_SHARD' then unit:reshard() end
      local m = u.module
      m:register_forward_pre_hook(function() unit:unshard() end)
      m:register_forward_hook(function() if strategy == 'FULL_SHARD' then unit:reshard() end end)
      m:register_backward_pre_hook(function() unit:unshard() end)
      m:register_backward_hook(function()
        unit:reduce_grads()
        if strategy == 'FULL_SHARD' then unit:reshard() end
      end)
      state.units[#state.units + 1] = unit
    end
  end
  rawset(model, '_fsdp', state)
  return model
end

local function state_of(model, fname)
  local st = type(model) == 'table' and rawget(model, '_fsdp')
  if not st then error(fname .. ': model was not passed to fsdp.fully_shard', 3) end
  return st
end

-- the units (each: .fp the FlatParam, .module, .name, .views)
function fsdp.units(model) return state_of(model, 'fsdp.units').units end

-- all-gather every unit (after an optimizer step, before reading
-- model:named_parameters() outside forward)
function fsdp.unshard(model)
  for _, u in ipairs(state_of(model, 'fsdp.unshard').units) do u:reshard(); u:unshard() end
  return model
end

-- every unit's master shard with its gradient (shard.grad), a list
function fsdp.shards(model)
  local r = {}
  for i, u in ipairs(state_of(model, 'fsdp.shards').units) do r[i] = u.fp.shard end
  return r
end

-- fsdp.AdamW(model, opts): ms.optim.AdamW over the master shards (one group:
-- weight decay applies to every element; per-parameter no-decay groups are
-- still to come). The next unshard all-gathers the updated shards.
function fsdp.AdamW(model, opts)
  local optim = require 'moonshard.optim'
  local units = state_of(model, 'fsdp.AdamW').units
  local opt = optim.AdamW(fsdp.shards(model), opts)
  -- after a step every unit's unsharded copy is stale: the next forward
  -- (or fsdp.unshard) gathers the new shards (NO_SHARD keeps its buffer
  -- unsharded between steps, so it must be told too)
  local step = opt.step
  rawset(opt, 'step', function(self, ...)
    local r = step(self, ...)
    for _, u in ipairs(units) do u:reshard() end
    return r
  end)
  return opt
end

function FlatParam:__tostring()
  return ('fsdp.FlatParam(%d parameters, %s, rank %d of %d, shard %d of %d elements%s)'):format(
    self.nparams, self.dtype, self.rank, self.world_size, self.shard_numel, self.total,
    self.flat and ', unsharded' or '')
end

return fsdp
