-- moonshard.nn — modules: parameters, children, hooks, state dicts.
--
--   local nn = require 'moonshard.nn'          -- also ms.nn
--   local Block = nn.Module:extend('Block')
--   function Block:init(dim)
--     self:register_module('ln', nn.LayerNorm(dim))
--     self:register_module('fc', nn.Linear(dim, dim))
--   end
--   function Block:forward(x) return x + self.fc(self.ln(x)) end
--   local b = Block(8)
--   for name, p in b:named_parameters() do print(name, p.shape) end
--   local y = b(ms.randn({2, 8}))             -- __call: hooks + forward
--
-- Registration is explicit and ordered: register_parameter(name, t) (sets
-- requires_grad, stores self[name]), register_buffer(name, t, persistent),
-- register_module(name, child). The field self[name] is the source of truth:
-- assigning self.weight = other after registration replaces the parameter
-- everywhere (named_parameters, state_dict), which is how the sharding layer
-- swaps in views of its flat buffers. Names match the Hugging Face checkpoints
-- of the same model, so state dicts load without a renaming table.
--
-- Hooks (docs/autograd.md):
--   m:register_forward_pre_hook(fn(m, inputs) -> inputs?)  inputs = {n=, ...}
--   m:register_forward_hook(fn(m, inputs, output) -> output?)
--   m:register_backward_pre_hook(fn(m))  about to run backward of m
--   m:register_backward_hook(fn(m))      backward of m done, its grads final
-- each returns a handle with :remove().
local T = require 'moonshard.tensor'
local A = require 'moonshard.autograd'
local amp = require 'moonshard.amp'
local nnf = require 'moonshard.nn.functional'
local ffi = require 'ffi'

local R = A.raw_views
local F = require 'moonshard.ops'
local is_tensor = T.is_tensor
local unpack = unpack or table.unpack
local pack = function(...) return { n = select('#', ...), ... } end

local nn = {}
nn.functional = nnf
nn.F = nnf

local function shape_str(s) return '(' .. table.concat(s, ', ') .. ')' end

-- ------------------------------------------------------------------ Module
local Module = {}
Module.__index = Module
Module.__name = 'Module'
nn.Module = Module

local function construct(cls, ...)
  local o = setmetatable({}, cls)
  rawset(o, '_param_names', {})
  rawset(o, '_buffer_names', {})
  rawset(o, '_buffer_persistent', {})
  rawset(o, '_module_names', {})
  rawset(o, 'training', true)
  o:init(...)
  return o
end

local class_mt = {
  __call = construct,
  __tostring = function(cls) return 'class ' .. rawget(cls, '__name') end,
}

-- local Block = nn.Module:extend('Block'); Block(...) builds one (init(...))
function Module:extend(name)
  if type(name) ~= 'string' then error('extend: a class needs a name (a string)', 2) end
  local cls = {}
  for k, v in pairs(self) do
    if type(k) == 'string' and k:sub(1, 2) == '__' and k ~= '__index' and k ~= '__name' then
      cls[k] = v
    end
  end
  cls.__index = cls
  cls.__name = name
  cls.super = self
  return setmetatable(cls, {
    __index = self,
    __call = construct,
    __tostring = class_mt.__tostring,
  })
end
setmetatable(Module, class_mt)

function Module:init() end
function Module:forward()
  error(('%s: forward is not implemented'):format(self:class_name()), 2)
end
function Module:class_name() return rawget(getmetatable(self), '__name') or 'Module' end

local function check_name(kind, name)
  if type(name) == 'number' then name = tostring(name) end
  if type(name) ~= 'string' or name == '' or name:find('.', 1, true) then
    error(('%s: name must be a non-empty string without dots, got %s'):format(kind, tostring(name)), 3)
  end
  return name
end
local function add_name(list, name)
  for i = 1, #list do if list[i] == name then return end end
  list[#list + 1] = name
end

function Module:register_parameter(name, t)
  name = check_name('register_parameter', name)
  if t ~= nil then
    if not is_tensor(t) then
      error(('register_parameter: %s must be a tensor or nil, got %s'):format(name, type(t)), 2)
    end
    if t.dtype_id <= 3 then t.requires_grad = true end
  end
  add_name(self._param_names, name)
  rawset(self, name, t)
  return t
end

function Module:register_buffer(name, t, persistent)
  name = check_name('register_buffer', name)
  if t ~= nil and not is_tensor(t) then
    error(('register_buffer: %s must be a tensor or nil, got %s'):format(name, type(t)), 2)
  end
  add_name(self._buffer_names, name)
  self._buffer_persistent[name] = persistent ~= false
  rawset(self, name, t)
  return t
end

function Module:register_module(name, child)
  name = check_name('register_module', name)
  if child ~= nil and not nn.is_module(child) then
    error(('register_module: %s must be a module, got %s'):format(name, type(child)), 2)
  end
  add_name(self._module_names, name)
  rawset(self, name, child)
  return child
end

function nn.is_module(x)
  if type(x) ~= 'table' then return false end
  local mt = getmetatable(x)
  while mt do
    if mt == Module then return true end
    local parent = rawget(mt, 'super')
    if parent == nil then return false end
    mt = parent
  end
  return false
end

-- ------------------------------------------------------------- traversal
-- (No closures here: every iterator is a plain function over a state table,
-- and the walks are plain recursive functions. LuaJIT specialises a trace
-- on the closure it calls, while the closure's prototype has made fewer
-- than three, and keeps it, with the lists its upvalues hold, as long as
-- the trace lives: an early named_parameters() loop (bin/train's setup,
-- before tensor parallelism slices the model) then kept the whole model's
-- first parameters alive for the run. docs/tensors.md, "Compiled traces
-- keep what they were specialised on".)

-- a list of {name, value} pairs as a (name, value) iterator: named_modules,
-- and the collect() lists of named_parameters and named_buffers
local function pair_step(st)
  local i = st.i + 1
  st.i = i
  local e = st.list[i]
  if e then return e[1], e[2] end
end
local function pairs_of(list) return pair_step, { list = list, i = 0 } end

-- named_modules: (dotted name, module) depth first, self first as '', each
-- module object once
local function walk_modules(list, seen, m, name)
  if seen[m] then return end
  seen[m] = true
  list[#list + 1] = { name, m }
  for _, cn in ipairs(m._module_names) do
    local c = rawget(m, cn)
    if c ~= nil then walk_modules(list, seen, c, name == '' and cn or (name .. '.' .. cn)) end
  end
end
function Module:named_modules(prefix)
  local list = {}
  walk_modules(list, {}, self, prefix or '')
  return pairs_of(list)
end
-- the values of a (name, value) iterator f(s)
local function value_step(st)
  local _, v = st.f(st.s)
  return v
end
local function values_of(f, s) return value_step, { f = f, s = s } end
function Module:modules() return values_of(self:named_modules()) end
local function child_step(st)
  local m, names = st.m, st.m._module_names
  while true do
    local i = st.i + 1
    st.i = i
    local n = names[i]
    if n == nil then return nil end
    local c = rawget(m, n)
    if c ~= nil then return n, c end
  end
end
function Module:named_children() return child_step, { m = self, i = 0 } end
function Module:children() return values_of(self:named_children()) end

-- the parameters (kind 'param') or buffers of m and, unless recurse is
-- false, its children into list as { dotted name, tensor, module, name },
-- each tensor once (seen: by id)
local function collect_into(list, seen, kind, recurse, m, pre, mseen)
  if mseen[m] then return end
  mseen[m] = true
  local names = kind == 'param' and m._param_names or m._buffer_names
  for _, n in ipairs(names) do
    local t = rawget(m, n)
    if t ~= nil then
      local id = tonumber(t.id)
      if not seen[id] then
        seen[id] = true
        list[#list + 1] = { pre .. n, t, m, n }
      end
    end
  end
  if recurse ~= false then
    for _, cn in ipairs(m._module_names) do
      local c = rawget(m, cn)
      if c ~= nil then collect_into(list, seen, kind, recurse, c, pre .. cn .. '.', mseen) end
    end
  end
end
local function collect(self, kind, prefix, recurse)
  local list = {}
  collect_into(list, {}, kind, recurse, self, (prefix and prefix ~= '') and (prefix .. '.') or '', {})
  return list
end

-- the tensors of a collect() list as a list
local function tensors_of(list)
  local r = {}
  for i = 1, #list do r[i] = list[i][2] end
  return r
end
-- for name, p in m:named_parameters() do ... end: dotted names in
-- registration order (own parameters first, then children), each tensor once
function Module:named_parameters(prefix, recurse) return pairs_of(collect(self, 'param', prefix, recurse)) end
function Module:parameters(recurse) return tensors_of(collect(self, 'param', nil, recurse)) end
function Module:named_buffers(prefix, recurse) return pairs_of(collect(self, 'buffer', prefix, recurse)) end
function Module:buffers(recurse) return tensors_of(collect(self, 'buffer', nil, recurse)) end
function Module:num_parameters()
  local n = 0
  for _, p in ipairs(self:parameters()) do n = n + p:numel() end
  return n
end

-- fn(m) for every module, children before parents (as torch)
function Module:apply(fn)
  for _, c in ipairs(self._module_names) do
    local m = rawget(self, c)
    if m ~= nil then m:apply(fn) end
  end
  fn(self)
  return self
end

function Module:train(mode)
  if mode == nil then mode = true end
  for m in self:modules() do rawset(m, 'training', mode and true or false) end
  return self
end
function Module:eval() return self:train(false) end

-- drops every parameter's .grad (freed at once); {set_to_none = false}
-- zeroes them in place instead
function Module:zero_grad(opts)
  local keep = opts and opts.set_to_none == false
  for _, p in ipairs(self:parameters()) do
    if keep then
      local g = p.grad
      if g ~= nil then A.F.fill_(g, 0) end
    else
      p:zero_grad()
    end
  end
end

-- ------------------------------------------------------------ state dict
-- every (name, tensor) of parameters and persistent buffers, including every
-- name of a shared tensor (as torch); returns the table and the names in order
function Module:state_dict(prefix)
  local sd, keys = {}, {}
  local function walk(m, pre, mseen)
    if mseen[m] then return end
    mseen[m] = true
    for _, n in ipairs(m._param_names) do
      local t = rawget(m, n)
      if t ~= nil then sd[pre .. n] = t; keys[#keys + 1] = pre .. n end
    end
    for _, n in ipairs(m._buffer_names) do
      local t = rawget(m, n)
      if t ~= nil and m._buffer_persistent[n] then sd[pre .. n] = t; keys[#keys + 1] = pre .. n end
    end
    for _, cn in ipairs(m._module_names) do
      local c = rawget(m, cn)
      if c ~= nil then walk(c, pre .. cn .. '.', mseen) end
    end
  end
  walk(self, (prefix and prefix ~= '') and (prefix .. '.') or '', {})
  return sd, keys
end

-- Copies sd's tensors into the module's (converting dtype/device). Checks
-- everything before copying anything; strict (the default) reports missing,
-- unexpected and mis-shaped keys all together in one error. A name missing
-- from sd is fine when the same tensor is loaded under another name (tied
-- weights). Mis-shaped keys are an error even when not strict.
-- Returns {missing = {...}, unexpected = {...}}.
function Module:load_state_dict(sd, opts)
  opts = opts or {}
  local strict = opts.strict ~= false
  if type(sd) ~= 'table' then error('load_state_dict: expected a table of name -> tensor', 2) end
  local own, keys = self:state_dict()
  local missing, unexpected, misshaped = {}, {}, {}
  local loaded = {}
  local todo = {}
  for _, k in ipairs(keys) do
    local dst, src = own[k], sd[k]
    if src == nil then
      missing[#missing + 1] = k
    elseif not is_tensor(src) then
      misshaped[#misshaped + 1] = ('%s: expected a tensor, got %s'):format(k, type(src))
    else
      local a, b = dst.shape, src.shape
      local same = #a == #b
      if same then for i = 1, #a do if a[i] ~= b[i] then same = false; break end end end
      if not same then
        misshaped[#misshaped + 1] = ('%s: checkpoint %s, model %s'):format(k, shape_str(b), shape_str(a))
      else
        todo[#todo + 1] = { dst, src }
        loaded[tonumber(dst.id)] = true
      end
    end
  end
  local m2 = {}
  for _, k in ipairs(missing) do
    if not loaded[tonumber(own[k].id)] then m2[#m2 + 1] = k end
  end
  missing = m2
  for k in pairs(sd) do
    if own[k] == nil then unexpected[#unexpected + 1] = tostring(k) end
  end
  table.sort(unexpected)
  if #misshaped > 0 or (strict and (#missing > 0 or #unexpected > 0)) then
    local parts = { ('load_state_dict: %s does not match the checkpoint'):format(self:class_name()) }
    if #missing > 0 then
      parts[#parts + 1] = ('  missing keys (%d): %s'):format(#missing, table.concat(missing, ', '))
    end
    if #unexpected > 0 then
      parts[#parts + 1] = ('  unexpected keys (%d): %s'):format(#unexpected, table.concat(unexpected, ', '))
    end
    if #misshaped > 0 then
      parts[#parts + 1] = ('  mis-shaped keys (%d): %s'):format(#misshaped, table.concat(misshaped, '; '))
    end
    error(table.concat(parts, '\n'), 2)
  end
  A.no_grad(function()
    for _, e in ipairs(todo) do
      if e[1] ~= e[2] then e[1]:copy_(e[2]) end
    end
  end)
  return { missing = missing, unexpected = unexpected }
end

-- ------------------------------------------------------------- dtype/device
-- Exchange the views of two handles: a keeps its identity (id, flags, Lua
-- metadata) and takes b's storage, shape, dtype and device; b gets a's.
local function swap_contents(a, b)
  a.storage, b.storage = b.storage, a.storage
  a.offset, b.offset = b.offset, a.offset
  for i = 0, 7 do
    a.sizes[i], b.sizes[i] = b.sizes[i], a.sizes[i]
    a.strides[i], b.strides[i] = b.strides[i], a.strides[i]
  end
  a.ndim, b.ndim = b.ndim, a.ndim
  a.dtype_id, b.dtype_id = b.dtype_id, a.dtype_id
  a.device_id, b.device_id = b.device_id, a.device_id
end
nn.swap_contents = swap_contents

-- converts t in place (same handle) to dtype/device `spec` (as t:to(spec))
local function to_in_place(t, spec)
  local n = R.to(t, spec)
  if n == t then return end
  swap_contents(t, n)
  -- (a deferred tensor moved: the old storage's init record goes with it)
  if T.is_deferred(n) then T.init_records[n.storage.init_id] = nil end
  n:free()
end
nn.to_in_place = to_in_place

-- m:to('bf16') / m:to('cuda') / m:to{dtype=, device=}: moves parameters,
-- their grads and buffers in place, so tensors held elsewhere stay valid.
-- Integer buffers keep their dtype on a dtype change.
function Module:to(spec)
  local dtype_only = type(spec) == 'string' and pcall(T.dtype_id, spec)
  for _, p in ipairs(self:parameters()) do
    to_in_place(p, spec)
    local g = p.grad
    if g ~= nil then to_in_place(g, spec) end
  end
  for _, b in ipairs(self:buffers()) do
    local is_float = b.dtype_id <= 3
    if is_float or not dtype_only then
      if is_float or type(spec) ~= 'table' then to_in_place(b, spec)
      else to_in_place(b, { device = spec.device }) end
    end
  end
  return self
end

-- ------------------------------------------------------------- forward
local function hook_list(self, key)
  local l = rawget(self, key)
  if l == nil then l = {}; rawset(self, key, l) end
  return l
end
-- passive = true: the hook neither replaces the inputs or the output nor
-- reads them (FSDP's gather and release); a module whose forward hooks are
-- all passive may be called with a different signature (the models'
-- deferred residual adds, nn.passive_hooks_only)
function Module:register_forward_pre_hook(fn, passive)
  return A.hook_handle(hook_list(self, '_forward_pre_hooks'), { fn = fn, passive = passive == true })
end
function Module:register_forward_hook(fn, passive)
  return A.hook_handle(hook_list(self, '_forward_hooks'), { fn = fn, passive = passive == true })
end
-- true when every forward (pre-)hook of m was registered passive
function nn.passive_hooks_only(m)
  for _, key in ipairs({ '_forward_pre_hooks', '_forward_hooks' }) do
    local l = rawget(m, key)
    if l then
      for i = 1, #l do
        if l[i] and not l[i].passive then return false end
      end
    end
  end
  return true
end
function Module:register_backward_pre_hook(fn)
  return A.hook_handle(hook_list(self, '_backward_pre_hooks'), { fn = fn })
end
function Module:register_backward_hook(fn)
  return A.hook_handle(hook_list(self, '_backward_hooks'), { fn = fn })
end

-- Activation checkpointing: m:set_checkpointing(true) makes every call of m
-- under grad mode run m's forward through ms.checkpoint (no activation of it
-- kept; backward re-runs it). The hooks and backward marks stay outside, so
-- FSDP's unit hooks gather before the forward and again before the
-- recompute. m:set_checkpointing(true, { policy = P }) keeps what the
-- policy P chooses of the forward's op outputs instead (selective
-- checkpointing, A.checkpoint_policy: 'op' keeps every attention's output
-- and every other linear layer's, torchtitan's op mode; or a
-- function(kind, n) -> bool). nn.apply_activation_checkpointing picks the
-- modules.
function Module:set_checkpointing(on, opts)
  if on == false then
    rawset(self, '_checkpoint', nil)
    rawset(self, '_checkpoint_policy', nil)
  else
    local policy = opts and opts.policy
    if type(policy) == 'string' and A.sac_policies[policy] == nil then
      error(('set_checkpointing: no policy %q (op, or a function(kind, n) -> bool)'):format(policy), 2)
    elseif policy ~= nil and type(policy) ~= 'string' and type(policy) ~= 'function' then
      error(('set_checkpointing: policy must be a name or a function, got %s'):format(type(policy)), 2)
    end
    local m = self
    rawset(self, '_checkpoint', function(...) return m:forward(...) end)
    rawset(self, '_checkpoint_policy', policy)
  end
  return self
end
function Module:is_checkpointing() return rawget(self, '_checkpoint') ~= nil end
local function run_forward(self, ...)
  local ck = rawget(self, '_checkpoint')
  if ck ~= nil and A.is_grad_enabled() then
    local policy = rawget(self, '_checkpoint_policy')
    if policy ~= nil then return A.checkpoint_policy(policy, ck, ...) end
    return A.checkpoint(ck, ...)
  end
  return self:forward(...)
end

-- the call of module self: its forward hooks and backward marks around
-- fwd(self, ...) (run_forward for a plain call)
local function hooked_call(self, fwd, ...)
  local pre, post = rawget(self, '_forward_pre_hooks'), rawget(self, '_forward_hooks')
  local mark = A.should_mark(self)
  if not mark and (pre == nil or #pre == 0) and (post == nil or #post == 0) then
    return fwd(self, ...)
  end
  local inputs = pack(...)
  if pre then
    for i = 1, #pre do
      local h = pre[i]
      if h then
        local r = h.fn(self, inputs)
        if r ~= nil then
          if type(r) ~= 'table' or is_tensor(r) then
            error('forward pre-hook: return nil or a table {n = k, ...} of new inputs', 2)
          end
          inputs = r
          inputs.n = inputs.n or #r
        end
      end
    end
  end
  if mark then A.mark_module_begin(self) end
  local out = pack(fwd(self, unpack(inputs, 1, inputs.n)))
  if mark then A.mark_module_end(self) end
  if post then
    for i = 1, #post do
      local h = post[i]
      if h then
        local r = h.fn(self, inputs, out[1])
        if r ~= nil then out[1] = r end
      end
    end
  end
  return unpack(out, 1, out.n)
end

function Module:__call(...) return hooked_call(self, run_forward, ...) end

-- m:call_as(fn, ...) -> fn(...)'s results, run as a call of m: m's forward
-- (pre-)hooks and backward marks around fn in place of m's forward (a
-- pipeline stage's part of the model runs as the model's call, so the
-- hooks fully_shard put on the root run for each micro-batch; docs/pp.md)
function Module:call_as(fn, ...)
  if type(fn) ~= 'function' then error('call_as: need a function', 2) end
  return hooked_call(self, function(_, ...) return fn(...) end, ...)
end

-- -------------------------------------------------------------- printing
local function fmt_count(n)
  if n >= 1e9 then return ('%.2fB'):format(n / 1e9) end
  if n >= 1e6 then return ('%.2fM'):format(n / 1e6) end
  if n >= 1e3 then return ('%.1fK'):format(n / 1e3) end
  return tostring(n)
end
nn.format_count = fmt_count

function Module:extra_repr() return '' end

function Module:__tostring()
  local lines = {}
  local function line(m, name, depth)
    local ind = ('  '):rep(depth)
    local extra = m:extra_repr()
    local n = m:num_parameters()
    local head = ind .. (name and (name .. ': ') or '') .. m:class_name()
    if extra ~= '' then head = head .. '(' .. extra .. ')' end
    if n > 0 then head = head .. '  ' .. fmt_count(n) .. (depth == 0 and ' parameters' or '') end
    lines[#lines + 1] = head
    -- runs of children of one class with the same count print once
    local names = {}
    for cn, c in m:named_children() do names[#names + 1] = { cn, c } end
    local i = 1
    while i <= #names do
      local cn, c = names[i][1], names[i][2]
      local j = i
      while j < #names and names[j + 1][2]:class_name() == c:class_name()
          and names[j + 1][2]:num_parameters() == c:num_parameters() and tonumber(names[j + 1][1]) do
        j = j + 1
      end
      if j - i >= 2 and tonumber(cn) then
        line(c, cn .. '..' .. names[j][1], depth + 1)
        lines[#lines] = lines[#lines] .. ('  (x%d)'):format(j - i + 1)
        i = j + 1
      else
        line(c, cn, depth + 1)
        i = i + 1
      end
    end
  end
  line(self, nil, 0)
  return table.concat(lines, '\n')
end
Module.summary = Module.__tostring

-- --------------------------------------------------------------- helpers
local function opt(o, k, d)
  if o == nil or o[k] == nil then return d end
  return o[k]
end
local function topts(o)
  return { dtype = opt(o, 'dtype', 'f32'), device = opt(o, 'device', nil) }
end
-- the bias parameter: make() when opts.bias (default true), else nil
local function register_bias(self, opts, make)
  self:register_parameter('bias', opt(opts, 'bias', true) and make() or nil)
end
-- errors at the caller of the constructor: level 3 from an init, 4 from a
-- helper an init calls
local function check_int(cls, what, v, level)
  if type(v) ~= 'number' or v ~= math.floor(v) or v <= 0 then
    error(('%s: %s must be a positive integer, got %s'):format(cls, what, tostring(v)), level or 3)
  end
end

-- the two sizes of a Linear-like module, checked and kept
local function init_features(self, cls, in_features, out_features)
  check_int(cls, 'in_features', in_features, 4)
  check_int(cls, 'out_features', out_features, 4)
  self.in_features, self.out_features = in_features, out_features
end

-- ---------------------------------------------------------------- Linear
-- y = x @ weight^T + bias; weight (out, in) as torch.nn.Linear, both drawn
-- from U(-1/sqrt(in), 1/sqrt(in))
local Linear = Module:extend('Linear')
nn.Linear = Linear
function Linear:init(in_features, out_features, opts)
  init_features(self, 'Linear', in_features, out_features)
  local k = 1 / math.sqrt(in_features)
  local w = T.empty({ out_features, in_features }, topts(opts))
  T.uniform_(w, -k, k)
  self:register_parameter('weight', w)
  register_bias(self, opts, function()
    local b = T.empty({ out_features }, topts(opts))
    T.uniform_(b, -k, k)
    return b
  end)
end
function Linear:forward(x) return nnf.linear(x, self.weight, self.bias) end
function Linear:extra_repr()
  return ('%d, %d%s'):format(self.in_features, self.out_features, self.bias == nil and ', bias=false' or '')
end

-- ---------------------------------------------------------------- Conv1D
-- GPT-2's Conv1D: y = x @ weight + bias, weight (in, out) ~ N(0, 0.02), bias 0
local Conv1D = Module:extend('Conv1D')
nn.Conv1D = Conv1D
function Conv1D:init(in_features, out_features, opts)
  init_features(self, 'Conv1D', in_features, out_features)
  local w = T.empty({ in_features, out_features }, topts(opts))
  T.normal_(w, 0, opt(opts, 'std', 0.02))
  self:register_parameter('weight', w)
  register_bias(self, opts, function() return T.zeros({ out_features }, topts(opts)) end)
end
function Conv1D:forward(x) return nnf.conv1d_linear(x, self.weight, self.bias) end
function Conv1D:extra_repr() return ('%d, %d'):format(self.in_features, self.out_features) end

-- ------------------------------------------------------------- Embedding
-- weight (num_embeddings, dim) ~ N(0, std = 1)
local Embedding = Module:extend('Embedding')
nn.Embedding = Embedding
function Embedding:init(num_embeddings, dim, opts)
  check_int('Embedding', 'num_embeddings', num_embeddings)
  check_int('Embedding', 'embedding_dim', dim)
  self.num_embeddings, self.embedding_dim = num_embeddings, dim
  local w = T.empty({ num_embeddings, dim }, topts(opts))
  T.normal_(w, 0, opt(opts, 'std', 1))
  self:register_parameter('weight', w)
end
function Embedding:forward(ids) return nnf.embedding(ids, self.weight) end
function Embedding:extra_repr() return ('%d, %d'):format(self.num_embeddings, self.embedding_dim) end

-- ------------------------------------------------------------- LayerNorm
local LayerNorm = Module:extend('LayerNorm')
nn.LayerNorm = LayerNorm
function LayerNorm:init(dim, opts)
  check_int('LayerNorm', 'dim', dim)
  self.dim, self.eps = dim, opt(opts, 'eps', 1e-5)
  self:register_parameter('weight', T.ones({ dim }, topts(opts)))
  register_bias(self, opts, function() return T.zeros({ dim }, topts(opts)) end)
end
function LayerNorm:forward(x) return nnf.layer_norm(x, self.weight, self.bias, self.eps) end
function LayerNorm:extra_repr() return ('%d, eps=%g'):format(self.dim, self.eps) end

-- --------------------------------------------------------------- RMSNorm
local RMSNorm = Module:extend('RMSNorm')
nn.RMSNorm = RMSNorm
function RMSNorm:init(dim, opts)
  check_int('RMSNorm', 'dim', dim)
  self.dim, self.eps = dim, opt(opts, 'eps', 1e-6)
  self:register_parameter('weight', T.ones({ dim }, topts(opts)))
end
function RMSNorm:forward(x) return nnf.rms_norm(x, self.weight, self.eps) end
function RMSNorm:extra_repr() return ('%d, eps=%g'):format(self.dim, self.eps) end

-- ---------------------------------------------------- Dropout, GELU, SiLU
local Dropout = Module:extend('Dropout')
nn.Dropout = Dropout
function Dropout:init(p) self.p = p or 0.5 end
function Dropout:forward(x) return nnf.dropout(x, self.p, self.training) end
function Dropout:extra_repr() return ('p=%g'):format(self.p) end

local GELU = Module:extend('GELU')
nn.GELU = GELU
function GELU:init(opts)
  self.approximate = opt(opts, 'approximate', 'tanh')
  if self.approximate ~= 'tanh' then
    error(("GELU: only approximate = 'tanh' is implemented, got %s"):format(tostring(self.approximate)), 3)
  end
end
function GELU:forward(x) return nnf.gelu(x) end
function GELU:extra_repr() return "approximate='tanh'" end

local SiLU = Module:extend('SiLU')
nn.SiLU = SiLU
function SiLU:forward(x) return nnf.silu(x) end

-- ---------------------------------------------------- ModuleList, Sequential
local ModuleList = Module:extend('ModuleList')
nn.ModuleList = ModuleList
-- children named '0', '1', ... (as torch); list[i] (1-based) also works
function ModuleList:init(list)
  for _, m in ipairs(list or {}) do self:append(m) end
end
function ModuleList:append(m)
  local i = #self._module_names
  self:register_module(tostring(i), m)
  rawset(self, i + 1, m)
  return self
end
function ModuleList:forward()
  error('ModuleList: has no forward (iterate over it: for i, m in ipairs(list) do ... end)', 2)
end

local Sequential = Module:extend('Sequential')
nn.Sequential = Sequential
function Sequential:init(...)
  local list = { ... }
  if #list == 1 and type(list[1]) == 'table' and not nn.is_module(list[1]) then list = list[1] end
  for i, m in ipairs(list) do
    self:register_module(tostring(i - 1), m)
    rawset(self, i, m)
  end
end
function Sequential:forward(x, ...)
  local n = #self._module_names
  for i = 1, n do
    local m = rawget(self, self._module_names[i])
    if i == 1 then x = m(x, ...) else x = m(x) end
  end
  return x
end

-- --------------------------------------------------------------- MLPs
-- GPT-2's MLP: c_proj(gelu_tanh(c_fc(x))), Conv1D layers (Linear with conv1d = false)
local MLP = Module:extend('MLP')
nn.MLP = MLP
function MLP:init(cfg)
  cfg = cfg or {}
  check_int('MLP', 'dim', cfg.dim)
  local hidden = cfg.hidden or 4 * cfg.dim
  self.dim, self.hidden = cfg.dim, hidden
  local L = cfg.conv1d == false and Linear or Conv1D
  local o = { dtype = cfg.dtype, device = cfg.device, bias = cfg.bias }
  self:register_module('c_fc', L(cfg.dim, hidden, o))
  self:register_module('c_proj', L(hidden, cfg.dim, o))
end
-- nn.plain(m): m's call is its bare forward (no hooks, no backward marks),
-- so a caller may fuse it with its neighbours (nnf.gelu_mlp,
-- nnf.add_layer_norm) without anyone noticing
local function plain(m)
  local pre, post = rawget(m, '_forward_pre_hooks'), rawget(m, '_forward_hooks')
  return (pre == nil or #pre == 0) and (post == nil or #post == 0) and not A.should_mark(m)
    and rawget(m, '_checkpoint') == nil and rawget(m, 'forward') == nil   -- (LoRA's forward)
end
nn.plain = plain
function MLP:forward(x)
  local fc, pr = self.c_fc, self.c_proj
  local tp = rawget(self, '_tp')
  if tp ~= nil then x = tp.enter(x) end   -- (moonshard.tp: c_fc column-, c_proj row-parallel)
  -- one node with the bias and GELU in the GEMMs' epilogues (nnf.gelu_mlp)
  -- when nothing watches the two layers; else the modules one by one
  -- (exactly Linear or Conv1D: a subclass may have a forward of its own)
  local cls = getmetatable(fc)
  if (cls == Conv1D or cls == Linear) and getmetatable(pr) == cls and fc.bias ~= nil and pr.bias ~= nil
      and plain(fc) and plain(pr) then
    return nnf.gelu_mlp(x, fc.weight, fc.bias, pr.weight, pr.bias, cls == Linear)
  end
  return pr(nnf.gelu(fc(x)))
end
function MLP:extra_repr() return ('dim=%d, hidden=%d'):format(self.dim, self.hidden) end

-- Llama's SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x))
local GatedMLP = Module:extend('GatedMLP')
nn.GatedMLP = GatedMLP
function GatedMLP:init(cfg)
  cfg = cfg or {}
  check_int('GatedMLP', 'dim', cfg.dim)
  check_int('GatedMLP', 'hidden', cfg.hidden)
  self.dim, self.hidden = cfg.dim, cfg.hidden
  local o = { bias = cfg.bias or false, dtype = cfg.dtype, device = cfg.device }
  self:register_module('gate_proj', Linear(cfg.dim, cfg.hidden, o))
  self:register_module('up_proj', Linear(cfg.dim, cfg.hidden, o))
  self:register_module('down_proj', Linear(cfg.hidden, cfg.dim, o))
end
-- (nn.set_fuse_gate_up(false) or MS_FUSE_GATE_UP=0: gate and up as two
-- products, as before)
local fuse_gate_up = os.getenv('MS_FUSE_GATE_UP') ~= '0'
function nn.set_fuse_gate_up(on)
  local prev = fuse_gate_up
  fuse_gate_up = on and true or false
  return prev
end
function GatedMLP:forward(x)
  local tp = rawget(self, '_tp')
  if tp ~= nil then x = tp.enter(x) end   -- (moonshard.tp)
  local g, u = self.gate_proj, self.up_proj
  -- one product of gate and up side by side when nothing watches the two
  -- layers: their weights copied side by side (nnf.swiglu_gate_up), or,
  -- FSDP's, read where they lie (below); else the modules one by one
  -- (exactly Linear: a subclass may have a forward of its own)
  if fuse_gate_up and getmetatable(g) == Linear and getmetatable(u) == Linear and g.bias == nil
      and u.bias == nil and plain(g) and plain(u) then
    local wg, wu = g.weight, u.weight
    local fs = package.loaded['moonshard.fsdp']
    if not (fs and (fs.manages(wg) or fs.manages(wu))) then
      if A.leaf_sink(wg) == nil and A.leaf_sink(wu) == nil then
        return self.down_proj(nnf.swiglu_gate_up(x, wg, wu))
      end
    elseif fs.manages(wg) and fs.manages(wu) and x.dtype_id == wg.dtype_id
        and (amp.dtype() == nil or amp.dtype() == wg.dtype_id)
        and not A.defers_readers(x) and not nnf.weight_grads_deferred()
        and nnf.side_by_side(wg, wu) then
      -- FSDP's gathered weights, side by side in the unit's buffer: their
      -- joint view, no copy, and their gradients into the unit's f32 sinks
      -- by one GEMM (nnf.swiglu_gate_up_joined)
      return self.down_proj(nnf.swiglu_gate_up_joined(x, wg, wu))
    end
  end
  return self.down_proj(nnf.swiglu(g(x), u(x)))
end
function GatedMLP:extra_repr() return ('dim=%d, hidden=%d'):format(self.dim, self.hidden) end

-- ------------------------------------------------------ CausalSelfAttention
-- nn.CausalSelfAttention{dim=, n_head=, n_kv_head=n_head, head_dim=dim/n_head,
--   bias=false, o_bias=bias, rope_theta=nil, fused_qkv=false}
-- fused_qkv = false: Llama's q_proj, k_proj, v_proj, o_proj (Linear; bias on
--   q/k/v when bias, on o_proj when o_bias);
-- fused_qkv = true: GPT-2's c_attn (Conv1D dim -> 3*dim) and c_proj (Conv1D),
--   both with bias.
-- RoPE (rope_theta: a theta, or a table of nnf.llama3_rope / linear_rope /
-- yarn_rope) as Hugging Face Llama; GQA repeats the kv heads. rotary_dim
-- (even, <= head_dim; default head_dim): RoPE on each head's first
-- rotary_dim features only, the rest passed through (GLM-4.5's
-- partial_rotary_factor; the tables then made for rotary_dim). window
-- (Mistral's sliding_window): each query sees itself and the window - 1
-- keys before it; a sequence longer than the window runs the unfused path
-- with that mask (the fused kernels take no window), a shorter one is
-- plain causal attention.
local Attention = Module:extend('CausalSelfAttention')
nn.CausalSelfAttention = Attention
function Attention:init(cfg)
  cfg = cfg or {}
  check_int('CausalSelfAttention', 'dim', cfg.dim)
  check_int('CausalSelfAttention', 'n_head', cfg.n_head)
  local n_kv = cfg.n_kv_head or cfg.n_head
  check_int('CausalSelfAttention', 'n_kv_head', n_kv)
  if cfg.n_head % n_kv ~= 0 then
    error(('CausalSelfAttention: n_head %d is not a multiple of n_kv_head %d'):format(cfg.n_head, n_kv), 3)
  end
  local hd = cfg.head_dim or cfg.dim / cfg.n_head
  check_int('CausalSelfAttention', 'head_dim', hd)
  self.dim, self.n_head, self.n_kv_head, self.head_dim = cfg.dim, cfg.n_head, n_kv, hd
  self.rope_theta = cfg.rope_theta
  self.fused_qkv = cfg.fused_qkv and true or false
  if self.rope_theta and hd % 2 ~= 0 then
    error(('CausalSelfAttention: RoPE needs an even head_dim, got %d'):format(hd), 3)
  end
  if cfg.window ~= nil then
    check_int('CausalSelfAttention', 'window', cfg.window)
    self.window = cfg.window
  end
  if cfg.rotary_dim ~= nil and cfg.rotary_dim ~= hd then
    local rd = cfg.rotary_dim
    if type(rd) ~= 'number' or rd < 2 or rd > hd or rd % 2 ~= 0 then
      error(('CausalSelfAttention: rotary_dim must be an even number from 2 to head_dim %d, got %s'):format(hd,
        tostring(rd)), 3)
    end
    self.rotary_dim = rd
  end
  local dt = { dtype = cfg.dtype, device = cfg.device }
  if self.fused_qkv then
    if n_kv ~= cfg.n_head or hd * cfg.n_head ~= cfg.dim then
      error('CausalSelfAttention: fused_qkv (GPT-2 layout) needs n_kv_head = n_head and head_dim = dim / n_head', 3)
    end
    self:register_module('c_attn', Conv1D(cfg.dim, 3 * cfg.dim, dt))
    self:register_module('c_proj', Conv1D(cfg.dim, cfg.dim, dt))
  else
    local bias = cfg.bias or false
    local o_bias = cfg.o_bias
    if o_bias == nil then o_bias = bias end
    local function L(i, o, b) return Linear(i, o, { bias = b, dtype = dt.dtype, device = dt.device }) end
    self:register_module('q_proj', L(cfg.dim, cfg.n_head * hd, bias))
    self:register_module('k_proj', L(cfg.dim, n_kv * hd, bias))
    self:register_module('v_proj', L(cfg.dim, n_kv * hd, bias))
    self:register_module('o_proj', L(cfg.n_head * hd, cfg.dim, o_bias))
  end
  -- qk_norm_eps (Qwen3): an RMSNorm over each head's hd features of q and
  -- of k, after the projections and before RoPE (q_norm, k_norm)
  if cfg.qk_norm_eps then
    if self.fused_qkv then error('CausalSelfAttention: qk_norm_eps with fused_qkv is not supported', 3) end
    self:register_module('q_norm', RMSNorm(hd, { eps = cfg.qk_norm_eps, dtype = dt.dtype, device = dt.device }))
    self:register_module('k_norm', RMSNorm(hd, { eps = cfg.qk_norm_eps, dtype = dt.dtype, device = dt.device }))
  end
end

-- t (B, H, T, hd) with its first rd features rotated, the others as they
-- are (a function apart: a closure inside forward would close its upvalues
-- at each return, which LuaJIT does not compile)
local function rotary_part(t, rd, hd, cos, sin)
  return A.W.cat({ nnf.apply_rotary(t:narrow(4, 1, rd), cos, sin), t:narrow(4, rd + 1, hd - rd) }, 4)
end
function Attention:forward(x)
  local H, Hkv, hd = self.n_head, self.n_kv_head, self.head_dim
  -- tensor parallelism (moonshard.tp): this rank's heads; the input's
  -- gradient is summed over the group (with sequence parallelism the input
  -- is this rank's tokens, gathered here)
  local tp = rawget(self, '_tp')
  if tp ~= nil then
    H, Hkv = tp.n_head, tp.n_kv_head
    x = tp.enter(x)
  end
  if x.ndim ~= 3 or x.shape[3] ~= self.dim then
    error(('CausalSelfAttention: expected x of shape (B, T, %d), got (%s)'):format(
      self.dim, table.concat(x.shape, ', ')), 2)
  end
  local s = x.shape
  local B, Tn = s[1], s[2]
  local q, k, v
  -- context parallelism (moonshard.cp): x is this rank's tokens of each
  -- sequence; RoPE at their positions, attention a ring over the group
  local cpc = rawget(self, '_cp')
  if self.fused_qkv and not self.rope_theta and Hkv == H and cpc == nil then
    -- one node: q, k, v read in place from c_attn's output, dq, dk, dv
    -- written into one gradient (nnf.qkv_attention)
    return self.c_proj(nnf.qkv_attention(self.c_attn(x), H, { causal = true }))
  end
  if self.fused_qkv then
    local qkv = self.c_attn(x)
    local C = H * hd
    q, k, v = qkv:narrow(3, 1, C), qkv:narrow(3, C + 1, C), qkv:narrow(3, 2 * C + 1, C)
  else
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
  end
  q, k = q:view(B, Tn, H, hd), k:view(B, Tn, Hkv, hd)
  local qn = rawget(self, 'q_norm')
  if qn and tp ~= nil and tp.qk_sum then
    -- (tensor parallel: this rank's heads; the weights' gradient parts summed, moonshard.tp)
    local kn = self.k_norm
    q, k = nnf.rms_norm(q, tp.qk_sum(qn.weight), qn.eps), nnf.rms_norm(k, tp.qk_sum(kn.weight), kn.eps)
  elseif qn then q, k = qn(q), self.k_norm(k) end
  q = q:transpose(2, 3)     -- (B, H, T, hd)
  k = k:transpose(2, 3)     -- (B, Hkv, T, hd)
  v = v:view(B, Tn, Hkv, hd):transpose(2, 3)
  if self.rope_theta then
    local cdt = (q.dtype == 'f64') and 'f64' or 'f32'
    local rd = rawget(self, 'rotary_dim') or hd
    local cos, sin
    if cpc then cos, sin = cpc:rope(Tn, rd, self.rope_theta, cdt, q.device_id, q.dtype)
    else cos, sin = nnf.rope_cache(Tn, rd, self.rope_theta, cdt, q.device_id, q.dtype) end
    if rd == hd then
      q = nnf.apply_rotary(q, cos, sin)
      k = nnf.apply_rotary(k, cos, sin)
    else
      q, k = rotary_part(q, rd, hd, cos, sin), rotary_part(k, rd, hd, cos, sin)
    end
  end
  local y
  local win = rawget(self, 'window')
  if win and (cpc or Tn > win) then
    if cpc then
      error(('CausalSelfAttention: context parallelism does not ring sliding-window attention (window %d)'):format(
        win), 2)
    end
    y = nnf.scaled_dot_product_attention(q, k, v, { causal = true, mask = nnf.window_mask(Tn, win, q.dtype == 'f64'
      and 'f64' or 'f32', q.device_id) })
  elseif cpc then y = require('moonshard.cp').attention(q, k, v, cpc)
  else y = nnf.scaled_dot_product_attention(q, k, v, { causal = true }) end
  y = y:transpose(2, 3):reshape(B, Tn, H * hd)
  if self.fused_qkv then return self.c_proj(y) end
  return self.o_proj(y)
end
function Attention:extra_repr()
  return ('dim=%d, n_head=%d, n_kv_head=%d, head_dim=%d%s%s%s%s'):format(self.dim, self.n_head, self.n_kv_head,
    self.head_dim, self.rope_theta and (type(self.rope_theta) == 'table' and (', rope ' .. self.rope_theta.key)
      or (', rope_theta=%g'):format(self.rope_theta)) or '',
    rawget(self, 'rotary_dim') and (', rotary_dim=%d'):format(self.rotary_dim) or '',
    rawget(self, 'window') and (', window=%d'):format(self.window) or '',
    self.fused_qkv and ', fused_qkv' or '')
end

-- ------------------------------------------------------------------ LMHead
-- nn.LMHead{proj = m, norm = m?, tied = false, name = 'lm_head'}: the end of
-- a causal LM, the final norm and the LM head, called as one module:
--   head(x, pending, targets) -> nnf.lm_loss(h, proj.weight, targets)
--   head(x, pending)          -> logits h @ proj.weightᵀ
-- with h = norm(x + pending) (pending may be nil: h = norm(x); no norm:
-- h = x + pending). A plain LayerNorm / RMSNorm takes the add in its own
-- pass (nnf.add_layer_norm / add_rms_norm), as the models' deferred
-- residual adds do. lm_loss is the fused linear cross-entropy (looked up at
-- each call: autocast and use_fused_lm_loss still apply).
-- The head owns no parameters: `norm` and `proj` (a module whose .weight is
-- (V, C): a Linear, or the tied Embedding) stay registered where the model
-- put them, so named_parameters, state dicts and checkpoints keep their
-- names; the head refers to the modules and reads their .weight at each
-- call (fully_shard swaps the tensors inside the modules). The model keeps
-- it as a plain field, not a child (a child would add its names), and
-- hands it out with model:head_module(). `tied`: proj.weight is also used
-- elsewhere (the token embedding). head:params() lists its tensors'
-- places, {module, parameter name}, the norm's first. fully_shard makes an
-- untied head a unit of its own (docs/fsdp.md, "The LM head unit").
local LMHead = Module:extend('LMHead')
nn.LMHead = LMHead
function LMHead:init(cfg)
  cfg = cfg or {}
  if not nn.is_module(cfg.proj) then error('LMHead: proj must be a module with a (V, C) weight', 3) end
  if cfg.norm ~= nil and not nn.is_module(cfg.norm) then error('LMHead: norm must be a module or nil', 3) end
  if rawget(cfg.proj, 'bias') ~= nil then error('LMHead: proj has a bias (the head takes a weight only)', 3) end
  -- plain fields, not register_module: the modules stay the model's
  rawset(self, 'proj', cfg.proj)
  rawset(self, 'norm', cfg.norm)
  self.tied = cfg.tied == true
  self.name = cfg.name or 'lm_head'
end

-- {module, parameter name} of every tensor the head uses: the norm's
-- (weight, bias) first, then the projection's weight
function LMHead:params()
  local r = {}
  local norm = rawget(self, 'norm')
  if norm ~= nil then
    for _, pn in ipairs(norm._param_names) do
      if rawget(norm, pn) ~= nil then r[#r + 1] = { norm, pn } end
    end
  end
  r[#r + 1] = { rawget(self, 'proj'), 'weight' }
  return r
end

function LMHead:forward(x, pending, targets)
  local norm, h = rawget(self, 'norm'), nil
  if norm == nil then
    h = pending ~= nil and x + pending or x
  elseif pending ~= nil then
    local cls = getmetatable(norm)
    if cls == RMSNorm and plain(norm) then
      local _, y = nnf.add_rms_norm(x, pending, norm.weight, norm.eps)
      h = y
    elseif cls == LayerNorm and plain(norm) then
      local _, y = nnf.add_layer_norm(x, pending, norm.weight, norm.bias, norm.eps)
      h = y
    else
      h = norm(x + pending)
    end
  else
    h = norm(x)
  end
  local tp = rawget(self, '_tp')
  if targets ~= nil then
    local w = rawget(self, 'proj').weight
    if tp ~= nil then
      -- moonshard.tp: this rank's rows of the vocabulary; the fused loss is
      -- the whole vocabulary's (its grad of h summed over the group: by the
      -- loss, or under sequence parallelism by the gather's reduce-scatter,
      -- the loss leaving it partial)
      local part = false
      if tp.sp then h, part = tp.sp.gather_for_loss(h) end
      return nn.functional.lm_loss(h, w, targets, { group = tp.group, vocab_size = tp.total, grad_x_partial = part })
    end
    return nn.functional.lm_loss(h, w, targets)
  end
  if tp ~= nil and tp.sp then h = tp.sp.gather(h) end   -- (sequence parallel: the whole stream)
  return self:logits(h)
end
-- head:logits(h) -> h @ proj.weightᵀ, (..., V): the projection without the
-- norm (under moonshard.tp each rank's columns, gathered)
function LMHead:logits(h)
  local w = rawget(self, 'proj').weight
  local tp = rawget(self, '_tp')
  if tp ~= nil then
    return require('moonshard.tp').gather_last(nnf.linear(tp.enter(h), w), tp.group, tp.total)
  end
  return nnf.linear(h, w)
end
function LMHead:extra_repr()
  return ('%s%s'):format(self.name, self.tied and ', tied' or '')
end

-- ---------------------------------------------------------- deferred init
-- nn.deferred_init(fn, ...) -> fn(...)'s results: fn builds a model (or
-- anything) whose new tensors get no memory; their initialisation is
-- recorded (docs/nn.md "Deferred initialisation"), the global generator
-- advancing exactly as an eager build would. nn.materialize(model) then
-- gives every parameter and buffer its data with the values the eager
-- build would have had; fsdp.fully_shard writes each rank's shards
-- straight from the records, so no rank ever holds the whole model.
function nn.deferred_init(fn, ...)
  if type(fn) ~= 'function' then error('deferred_init: expected a function that builds the model', 2) end
  local d = T.defer
  if d.on then return fn(...) end
  d.on = true
  local r = pack(pcall(fn, ...))
  d.on = false
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

-- nn.is_deferred(model | tensor): a tensor without data yet, or a module
-- with one among its parameters and buffers
function nn.is_deferred(x)
  if is_tensor(x) then return T.is_deferred(x) end
  if not nn.is_module(x) then error('is_deferred: expected a module or a tensor', 2) end
  for _, p in ipairs(x:parameters()) do if T.is_deferred(p) then return true end end
  for _, b in ipairs(x:buffers()) do if T.is_deferred(b) then return true end end
  return false
end

-- nn.materialize(model) -> model: every deferred parameter and buffer gets
-- its data and its recorded values, in place (handles keep their identity;
-- move the model first, model:to('cuda'), to make them there)
function nn.materialize(model)
  if not nn.is_module(model) then error('materialize: expected a module', 2) end
  for _, p in ipairs(model:parameters()) do T.materialize(p) end
  for _, b in ipairs(model:buffers()) do T.materialize(b) end
  return model
end

-- ------------------------------------------------------------------- LoRA
-- nn.apply_lora(model, {r = 8, alpha = r, dropout = 0, targets = {'attn%.',
-- 'mlp%.'}, freeze = true}) -> names: every nn.Linear / nn.Conv1D whose
-- qualified name matches one of the Lua patterns `targets` (the LM head
-- and embeddings never: they are not Linear/Conv1D calls) gets two
-- parameters, lora_A (r, in) ~ U(+-1/sqrt(in)) and lora_B (out, r) = 0
-- (PEFT's initialisation, so the model's output is unchanged at first),
-- and computes y = base(x) + (alpha / r) * lora_B(lora_A(dropout(x))).
-- With freeze (the default) every other parameter is frozen
-- (requires_grad off; FSDP keeps them out of the steps). Returns the
-- qualified names of the adapted modules, and those of the matching
-- linears it left alone: a mixture of experts' routed experts, whose
-- weights the layer's fused experts read directly (an adapter there would
-- never be used). Targets that match only those are an error.
local function lora_forward(self, x)
  local lo = rawget(self, '_lora')
  local y = getmetatable(self).forward(self, x)   -- the layer's own forward
  local h = x
  if lo.dropout > 0 and self.training then h = nnf.dropout(x, lo.dropout, true) end
  local d = nnf.linear(nnf.linear(h, self.lora_A), self.lora_B)
  return y + d * lo.scale
end

function nn.apply_lora(model, opts)
  opts = opts or {}
  if not nn.is_module(model) then error('apply_lora: model must be a module', 2) end
  local r = opts.r or 8
  if type(r) ~= 'number' or r < 1 or r % 1 ~= 0 then
    error(('apply_lora: r must be a positive integer, got %s'):format(tostring(r)), 2)
  end
  local alpha = opts.alpha or r
  local p = opts.dropout or 0
  local targets = opts.targets or { 'attn%.', 'mlp%.' }
  if type(targets) == 'string' then targets = { targets } end
  -- the routed experts' modules (nn.MoE's experts list)
  local routed = {}
  for _, m in model:named_modules() do
    if nn.MoE and getmetatable(m) == nn.MoE then
      for _, e in m.experts:named_modules() do routed[e] = true end
    end
  end
  local names, skipped = {}, {}
  for name, m in model:named_modules() do
    local cls = getmetatable(m)
    local hit = false
    if (cls == nn.Linear or cls == nn.Conv1D) and rawget(m, '_lora') == nil then
      for _, pat in ipairs(targets) do
        local ok, f = pcall(string.find, name, pat)
        if not ok then error(('apply_lora: bad target pattern %s: %s'):format(tostring(pat), tostring(f)), 2) end
        if f then hit = true; break end
      end
    end
    if hit and routed[m] then
      skipped[#skipped + 1] = name
    elseif hit then
      local w = m.weight
      local in_f, out_f
      if cls == nn.Linear then out_f, in_f = w.shape[1], w.shape[2] else in_f, out_f = w.shape[1], w.shape[2] end
      local o = { dtype = w.dtype, device = w.device }
      local a = T.empty({ r, in_f }, o)
      T.uniform_(a, -1 / math.sqrt(in_f), 1 / math.sqrt(in_f))
      m:register_parameter('lora_A', a)
      m:register_parameter('lora_B', T.zeros({ out_f, r }, o))
      rawset(m, '_lora', { r = r, alpha = alpha, scale = alpha / r, dropout = p, conv1d = cls == nn.Conv1D })
      rawset(m, 'forward', lora_forward)
      names[#names + 1] = name
    end
  end
  if #names == 0 and #skipped > 0 then
    error(('apply_lora: the targets %s match only routed experts\' linears (%s%s), whose weights the mixture of '
      .. 'experts reads directly: adapters there would never be used; target the attention, dense MLPs or shared '
      .. 'experts'):format(table.concat(targets, ', '), skipped[1], #skipped > 1 and (' and %d more'):format(#skipped - 1)
      or ''), 2)
  end
  if #names == 0 then
    error(('apply_lora: no nn.Linear or nn.Conv1D of the model matches the targets %s'):format(
      table.concat(targets, ', ')), 2)
  end
  if opts.freeze ~= false then
    for n, t in model:named_parameters() do
      if not (n:match('%.lora_A$') or n:match('%.lora_B$')) then t.requires_grad = false end
    end
  end
  return names, skipped
end

-- nn.lora_merged(model, tensors) -> table, made: `tensors` (name -> tensor,
-- whole: a state_dict, or what fsdp_checkpoint gathers) with every adapted
-- module's weight replaced by weight + scale * lora_B @ lora_A (transposed
-- for a Conv1D's (in, out) weight) and its lora_A / lora_B left out: the
-- plain model's tensors (save_pretrained writes these). `made` lists the
-- new tensors (the caller frees them once written).
-- w + scale * b @ a (transposed for a Conv1D's (in, out) weight), in w's
-- dtype, computed in f32: an adapter folded into its weight (a new tensor)
local function lora_fold(lo, w, a, b)
  return A.no_grad(function()
    local a32, b32, w32 = a:to('f32'), b:to('f32'), w:to('f32')
    local d = F.matmul(b32, a32)                     -- (out, in)
    if lo.conv1d then local dt = d:t():contiguous(); d:free(); d = dt end
    F.mul_(d, lo.scale)
    F.add_(d, w32)
    local merged = d:to(w.dtype)
    for _, t in ipairs({ a32, b32, w32, d }) do
      if t ~= merged and t ~= a and t ~= b and t ~= w then t:free() end
    end
    return merged
  end)
end

function nn.lora_merged(model, tensors)
  local out, made = {}, {}
  for k, v in pairs(tensors) do out[k] = v end
  for name, m in model:named_modules() do
    local lo = rawget(m, '_lora')
    if lo then
      local pre = name == '' and '' or name .. '.'
      local w, a, b = tensors[pre .. 'weight'], tensors[pre .. 'lora_A'], tensors[pre .. 'lora_B']
      if w and a and b then
        local merged = lora_fold(lo, w, a, b)
        out[pre .. 'weight'] = merged
        made[#made + 1] = merged
        out[pre .. 'lora_A'], out[pre .. 'lora_B'] = nil, nil
      end
    end
  end
  return out, made
end

-- nn.merge_lora(model) -> model: in place, each adapter folded into its
-- weight and removed (the module is a plain Linear / Conv1D again; its
-- weight keeps its handle and its requires_grad). Not for a model under
-- fully_shard (its weights are views of shards): save it, merged, instead.
function nn.merge_lora(model)
  if rawget(model, '_fsdp') then
    error('merge_lora: the model is sharded (fully_shard): save it (merged) and load the folder instead', 2)
  end
  for _, m in model:named_modules() do
    local lo = rawget(m, '_lora')
    if lo then
      local w = m.weight
      local merged = lora_fold(lo, w, m.lora_A, m.lora_B)
      T.raw_copy_(w, merged)
      A.bump_version(w)
      merged:free()
      for _, k in ipairs({ 'lora_A', 'lora_B' }) do
        local names = rawget(m, '_param_names')
        for i = #names, 1, -1 do if names[i] == k then table.remove(names, i) end end
        rawset(m, k, nil)
      end
      rawset(m, '_lora', nil)
      rawset(m, 'forward', nil)
    end
  end
  return model
end

-- true when apply_lora adapted some module of model
function nn.has_lora(model)
  for _, m in model:named_modules() do if rawget(m, '_lora') then return true end end
  return false
end

-- ------------------------------------------------- activation checkpointing
-- nn.apply_activation_checkpointing(model, opts) -> names: sets
-- m:set_checkpointing(true) on model's modules chosen by opts.class (a class
-- or its name, or a list of them) or opts.check_fn(m, name) -> bool, in
-- named_modules order; opts.every = N keeps every N-th of them (N, 2N, ...;
-- 1: all, torchtitan's full mode; N > 1 its per-layer selective mode);
-- opts.policy (Module:set_checkpointing: 'op', torchtitan's op-level
-- selective mode) keeps some op outputs of each. A module inside one
-- already chosen is skipped (its activations are not kept anyway). Returns
-- the qualified names chosen.
function nn.apply_activation_checkpointing(model, opts)
  opts = opts or {}
  if not nn.is_module(model) then error('apply_activation_checkpointing: model must be a module', 2) end
  local policy = opts.policy
  if policy ~= nil and not (type(policy) == 'function' or A.sac_policies[policy] ~= nil) then
    error(('apply_activation_checkpointing: policy must be op or a function(kind, n) -> bool, got %s'):format(
      tostring(policy)), 2)
  end
  local every = opts.every or 1
  if type(every) ~= 'number' or every < 1 or every % 1 ~= 0 then
    error(('apply_activation_checkpointing: every must be a positive integer, got %s'):format(tostring(every)), 2)
  end
  local pick = opts.check_fn
  if pick == nil then
    local cls = opts.class
    if cls == nil then error('apply_activation_checkpointing: give opts.class or opts.check_fn', 2) end
    local want = {}
    -- class names, or the classes themselves (as fsdp.policy.by_class takes)
    local list = (type(cls) == 'table' and rawget(cls, '__name') == nil) and cls or { cls }
    for _, c in ipairs(list) do
      if type(c) == 'table' then c = rawget(c, '__name') end
      if type(c) ~= 'string' then error('apply_activation_checkpointing: class must be a class or a class name', 2) end
      want[c] = true
    end
    pick = function(m) return want[m:class_name()] == true end
  elseif type(pick) ~= 'function' then
    error('apply_activation_checkpointing: check_fn must be a function', 2)
  end
  local names, k, chosen = {}, 0, {}
  for name, m in model:named_modules() do
    local inside = false
    for _, c in ipairs(chosen) do
      if c == '' or name:sub(1, #c + 1) == c .. '.' then inside = true; break end
    end
    if not inside and pick(m, name) then
      k = k + 1
      if k % every == 0 then
        m:set_checkpointing(true, { policy = policy })
        names[#names + 1] = name
        chosen[#chosen + 1] = name
      end
    end
  end
  return names
end

-- mixture-of-experts layers (nn.MoE, nn.MoEExpert; moonshard.nn.moe, docs/moe.md)
nn.moe = require 'moonshard.nn.moe'
nn.moe.install(nn, nnf)
-- multi-head latent attention (nn.MLAttention; moonshard.nn.mla, DeepSeek-V3)
nn.mla = require 'moonshard.nn.mla'
nn.mla.install(nn, nnf)

return nn
