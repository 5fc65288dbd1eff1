-- moonshard.optim — optimizers, learning-rate schedules, gradient clipping.
--
--   local optim = require 'moonshard.optim'    -- also ms.optim
--   local opt = optim.AdamW(model, { lr = 3e-4, weight_decay = 0.1 })
--   local lr_at = optim.schedule.cosine{ lr = 3e-4, warmup = 100, total = 5000, min_lr = 3e-5 }
--   for step = 0, 4999 do
--     local loss = model(x, y)
--     loss:backward()
--     local norm = optim.clip_grad_norm(model, 1.0)
--     for _, g in ipairs(opt.param_groups) do g.lr = lr_at(step) end
--     opt:step()
--     opt:zero_grad()
--   end
--
-- Optimizers take a module (AdamW then builds a decay and a no-decay group:
-- see optim.no_decay), a list of tensors, or a list of groups
-- {params = {...}, lr =, weight_decay =, ...} whose missing fields come from
-- the defaults. opt.param_groups[i].lr (and the other fields) may be changed
-- between steps. The math runs on whole tensors with raw ops (no per-element
-- Lua), its state in f32 for f32/bf16/f16 parameters (f64 for f64).
--
-- opt:state_dict() returns {tensors = {name -> tensor}, meta = plain table}:
-- save the tensors with ms.save_safetensors and the meta as JSON (or Lua);
-- opt:load_state_dict(sd) takes the same (tensors are copied in).
local T = require 'moonshard.tensor'
local C = T.C
local F = require 'moonshard.ops'
local A = require 'moonshard.autograd'

local is_tensor = T.is_tensor
local free = A.free

local optim = {}

-- ---------------------------------------------------------- param groups
-- A parameter name (dotted, lower case) that gets no weight decay, or ndim < 2
local no_decay_patterns = { 'wte', 'wpe', 'embed', 'norm', 'ln_', 'bias' }
optim.no_decay_patterns = no_decay_patterns
function optim.no_decay(name, p)
  if p.ndim < 2 then return true end
  local n = name:lower()
  for _, pat in ipairs(no_decay_patterns) do
    if n:find(pat, 1, true) then return true end
  end
  return false
end

local function is_module(x)
  return type(x) == 'table' and type(x.named_parameters) == 'function' and not is_tensor(x)
end

-- -> list of groups {params = {...}, names = {...} or nil, <hyper-parameters>}
function optim.build_groups(params, defaults, split_decay)
  local groups = {}
  if is_module(params) then
    if split_decay then
      local d, nd = { params = {}, names = {} }, { params = {}, names = {}, weight_decay = 0 }
      for name, p in params:named_parameters() do
        local g = optim.no_decay(name, p) and nd or d
        g.params[#g.params + 1] = p
        g.names[#g.names + 1] = name
      end
      if #d.params > 0 then groups[#groups + 1] = d end
      if #nd.params > 0 then groups[#groups + 1] = nd end
    else
      local g = { params = {}, names = {} }
      for name, p in params:named_parameters() do
        g.params[#g.params + 1] = p
        g.names[#g.names + 1] = name
      end
      groups[1] = g
    end
  elseif is_tensor(params) then
    groups[1] = { params = { params } }
  elseif type(params) == 'function' then
    local g = { params = {}, names = {} }
    for a, b in params do
      if is_tensor(a) then g.params[#g.params + 1] = a; g.names = nil
      else g.params[#g.params + 1] = b; if g.names then g.names[#g.names + 1] = a end end
    end
    groups[1] = g
  elseif type(params) == 'table' then
    if #params > 0 and type(params[1]) == 'table' and not is_tensor(params[1]) then
      for i, g in ipairs(params) do
        if type(g.params) ~= 'table' then
          error(('optimizer: group %d has no params list'):format(i), 3)
        end
        local c = {}
        for k, v in pairs(g) do c[k] = v end
        c.params = {}
        for j, p in ipairs(g.params) do c.params[j] = p end
        groups[#groups + 1] = c
      end
    else
      groups[1] = { params = params }
    end
  else
    error(('optimizer: expected a module, a list of tensors or a list of groups, got %s'):format(type(params)), 3)
  end
  local seen = {}
  for gi, g in ipairs(groups) do
    for k, v in pairs(defaults) do
      if g[k] == nil then
        if type(v) == 'table' then
          local c = {}
          for i, x in ipairs(v) do c[i] = x end
          g[k] = c
        else
          g[k] = v
        end
      end
    end
    for j, p in ipairs(g.params) do
      if not is_tensor(p) then
        error(('optimizer: group %d, parameter %d is a %s, not a tensor'):format(gi, j, type(p)), 3)
      end
      local id = tonumber(p.id)
      if seen[id] then error(('optimizer: a parameter appears twice (group %d, position %d)'):format(gi, j), 3) end
      seen[id] = true
    end
  end
  return groups
end

-- ------------------------------------------------------------ Optimizer
local Optimizer = {}
Optimizer.__index = Optimizer
optim.Optimizer = Optimizer

function Optimizer:all_params()
  local r = {}
  for _, g in ipairs(self.param_groups) do
    for _, p in ipairs(g.params) do r[#r + 1] = p end
  end
  return r
end

-- drops every parameter's .grad (freed at once); {set_to_none = false}
-- zeroes them instead
function Optimizer:zero_grad(opts)
  local keep = opts and opts.set_to_none == false
  for _, p in ipairs(self:all_params()) do
    if keep then
      local g = p.grad
      if g ~= nil then F.fill_(g, 0) end
    else
      p:zero_grad()
    end
  end
end

function Optimizer:set_lr(lr)
  for _, g in ipairs(self.param_groups) do g.lr = lr end
end

-- the refusal of a first step inside a CUDA graph capture: the state made
-- there (zeroed moments) would be made again by every replay
function optim.refuse_new_state(name, p)
  if C.ms_cuda_capturing() >= 0 then
    error(('%s:step during CUDA graph capture: a parameter %s has no optimizer state yet, and every replay would '
      .. 'start it again; take a step eagerly first (cuda.graph\'s warmup >= 1)'):format(name,
      T.shape_str(p.shape) .. ' ' .. tostring(p.dtype)), 3)
  end
end

-- state of parameter p (a table), created by init(p) on first use
function Optimizer:state_of(p, init)
  local id = tonumber(p.id)
  local st = self.state[id]
  if st == nil then
    optim.refuse_new_state(self.type or 'optimizer', p)
    st = init(p)
    self.state[id] = st
  end
  return st
end

-- dtype the optimizer state and math use for parameter p
function optim.state_dtype(p)
  if p.dtype_id == 0 then return 'f64' end
  return 'f32'
end

local hyper_keys = { 'lr', 'betas', 'eps', 'weight_decay', 'momentum', 'dampening', 'nesterov' }

-- {tensors = {'<i>.<field>' -> tensor}, meta = {type, groups = {{lr=, ..., params = {i...},
-- names = {...}}}, state = {{index = i, step = n}, ...}}}; i counts
-- parameters over the groups in order, from 1
function Optimizer:state_dict()
  local tensors, meta = {}, { type = self.type, groups = {}, state = {} }
  local i = 0
  for _, g in ipairs(self.param_groups) do
    local mg = { params = {} }
    for _, k in ipairs(hyper_keys) do
      if g[k] ~= nil then mg[k] = g[k] end
    end
    if g.names then mg.names = g.names end
    for _, p in ipairs(g.params) do
      i = i + 1
      mg.params[#mg.params + 1] = i
      local st = self.state[tonumber(p.id)]
      if st then
        local e = { index = i }
        for k, v in pairs(st) do
          if is_tensor(v) then tensors[i .. '.' .. k] = v
          elseif type(v) == 'number' or type(v) == 'boolean' then e[k] = v end
        end
        meta.state[#meta.state + 1] = e
      end
    end
    meta.groups[#meta.groups + 1] = mg
  end
  return { tensors = tensors, meta = meta }
end

function Optimizer:load_state_dict(sd)
  if type(sd) ~= 'table' or type(sd.meta) ~= 'table' then
    error('load_state_dict: expected {tensors = ..., meta = ...} (from opt:state_dict())', 2)
  end
  local meta, tensors = sd.meta, sd.tensors or {}
  if meta.type and meta.type ~= self.type then
    error(('load_state_dict: state of a %s optimizer given to a %s'):format(meta.type, self.type), 2)
  end
  if #meta.groups ~= #self.param_groups then
    error(('load_state_dict: %d parameter groups in the state, %d in the optimizer'):format(
      #meta.groups, #self.param_groups), 2)
  end
  local params = {}
  for gi, g in ipairs(self.param_groups) do
    local mg = meta.groups[gi]
    if #mg.params ~= #g.params then
      error(('load_state_dict: group %d has %d parameters in the state, %d in the optimizer'):format(
        gi, #mg.params, #g.params), 2)
    end
    for _, p in ipairs(g.params) do params[#params + 1] = p end
  end
  -- check every tensor before changing anything
  local new = {}
  for _, e in ipairs(meta.state) do
    local p = params[e.index]
    if p == nil then error(('load_state_dict: state for parameter %s, which does not exist'):format(tostring(e.index)), 2) end
    local st = {}
    for k, v in pairs(e) do if k ~= 'index' then st[k] = v end end
    local prefix = e.index .. '.'
    for name, t in pairs(tensors) do
      if name:sub(1, #prefix) == prefix then
        local field = name:sub(#prefix + 1)
        local ps, ts = p.shape, t.shape
        local same = #ps == #ts
        if same then for d = 1, #ps do if ps[d] ~= ts[d] then same = false end end end
        if not same then
          error(('load_state_dict: %s has shape (%s), parameter %d has shape (%s)'):format(
            name, table.concat(ts, ', '), e.index, table.concat(ps, ', ')), 2)
        end
        st[field] = t:to({ dtype = optim.state_dtype(p), device = p.device_id, copy = true })
      end
    end
    new[tonumber(p.id)] = st
  end
  for gi, g in ipairs(self.param_groups) do
    local mg = meta.groups[gi]
    for _, k in ipairs(hyper_keys) do
      if mg[k] ~= nil then g[k] = mg[k] end
    end
  end
  for id, st in pairs(self.state) do
    for _, v in pairs(st) do if is_tensor(v) then free(v) end end
    self.state[id] = nil
  end
  for id, st in pairs(new) do self.state[id] = st end
end

function Optimizer:__tostring()
  local parts = {}
  for i, g in ipairs(self.param_groups) do
    local n = 0
    for _, p in ipairs(g.params) do n = n + p:numel() end
    local hp = {}
    for _, k in ipairs(hyper_keys) do
      local v = g[k]
      if type(v) == 'table' then v = '{' .. table.concat(v, ', ') .. '}' end
      if v ~= nil then hp[#hp + 1] = k .. '=' .. tostring(v) end
    end
    parts[#parts + 1] = ('  group %d: %d tensors, %d elements, %s'):format(i, #g.params, n, table.concat(hp, ', '))
  end
  return self.type .. '\n' .. table.concat(parts, '\n')
end

function optim.new_optimizer(cls, typename, params, defaults, split_decay)
  local self = setmetatable({}, cls)
  self.type = typename
  self.state = {}
  self.param_groups = optim.build_groups(params, defaults, split_decay)
  return self
end

-- ---------------------------------------------------------- clip_grad_norm
-- Scales the gradients of params (a module, a list or one tensor) so that
-- their joint norm is at most max_norm; returns the norm before clipping as
-- a Lua number (one host read), or with opts.tensor = true as a 0-dim f64
-- tensor on the gradients' device (no host read: the step stays
-- asynchronous). opts.norm_type: 2 (default) or math.huge. The 2-norm is
-- one fused sum of squares over every gradient (ms.sum_squares, f64
-- accumulation) and the scaling a multiply by a device scalar, so nothing
-- but the optional read leaves the device. opts.defer = opt (an AdamW):
-- the gradients are not scaled here; the coefficient goes to
-- opt:defer_grad_scale and its next step applies it on the way in (one pass
-- over the gradients fewer, the same update bits).
function optim.clip_grad_norm(params, max_norm, opts)
  local list
  if is_module(params) then list = params:parameters()
  elseif is_tensor(params) then list = { params }
  else list = params end
  local norm_type = (opts and opts.norm_type) or 2
  local grads = {}
  for _, p in ipairs(list) do
    local g = p.grad
    if g ~= nil then grads[#grads + 1] = g end
  end
  if #grads == 0 then return 0 end
  local total_t
  if norm_type == math.huge then
    for _, g in ipairs(grads) do
      local a = F.abs(g)
      local s = F.max(a)
      free(a)
      if s.dtype_id ~= 0 then local s64 = s:to('f64'); free(s); s = s64 end
      if total_t == nil then total_t = s
      else local n = F.maximum(total_t, s); free(total_t); free(s); total_t = n end
    end
  else
    -- one device per call of the fused kernel: group the gradients by device
    local by_dev, order = {}, {}
    for _, g in ipairs(grads) do
      local d = tonumber(g.device_id)
      if not by_dev[d] then by_dev[d] = {}; order[#order + 1] = d end
      local l = by_dev[d]
      l[#l + 1] = g
    end
    local sq
    for _, d in ipairs(order) do
      local s = F.sum_squares(by_dev[d])
      if sq == nil then sq = s
      else
        local s2 = s:to(sq.device)
        free(s)
        local n = F.add(sq, s2)
        free(sq); free(s2)
        sq = n
      end
    end
    total_t = F.sqrt(sq)
    free(sq)
  end
  return optim.clip_with_norm(grads, total_t, max_norm, opts, 'clip_grad_norm')
end

-- optim.sum_squares(list, device) -> the gradients' sum of squares as an
-- f64 (1) tensor on `device` (zeros for an empty list): the piece sharded
-- models' norms add up over ranks (moonshard.tp, moonshard.pp)
function optim.sum_squares(list, device)
  if #list == 0 then return T.zeros({ 1 }, { dtype = 'f64', device = device }) end
  local s = F.sum_squares(list)
  local s1 = s:reshape({ 1 }):contiguous()
  if s1 ~= s then free(s) end
  return s1
end

-- optim.clip_with_norm(grads, total_t, max_norm, opts, fname): the second
-- half of clip_grad_norm, for callers that found the norm themselves (a
-- sharded model's gradients, summed over ranks: moonshard.pp): total_t is
-- the norm as a device tensor (consumed); the gradients are scaled by
-- min(1, max_norm / (norm + 1e-6)) (or opts.defer's next step applies it);
-- returns the norm as clip_grad_norm does
function optim.clip_with_norm(grads, total_t, max_norm, opts, fname)
  local defer = opts and opts.defer
  if defer ~= nil and (type(defer) ~= 'table' or type(defer.defer_grad_scale) ~= 'function') then
    error((fname or 'clip_grad_norm') .. ': defer must be an optimizer with defer_grad_scale (ms.optim.AdamW)', 3)
  end
  if max_norm ~= nil and defer ~= nil then
    local denom = F.add(total_t, 1e-6)
    local coef = F.div(max_norm, denom)
    free(denom)
    local c1 = F.clamp(coef, nil, 1.0)
    free(coef)
    if c1.dtype ~= 'f64' then local c = c1:to('f64'); free(c1); c1 = c end
    defer:defer_grad_scale(c1:reshape({ 1 }))
    if opts and opts.tensor then return total_t end
    local total = total_t:item()
    free(total_t)
    return total
  elseif max_norm ~= nil then
    local denom = F.add(total_t, 1e-6)
    local coef = F.div(max_norm, denom)
    free(denom)
    local c1 = F.clamp(coef, nil, 1.0)
    free(coef)
    local cast = {}   -- the factor in each gradient's dtype and device
    for _, g in ipairs(grads) do
      local key = tostring(g.dtype_id) .. '@' .. tostring(g.device_id)
      local c = cast[key]
      if not c then
        c = c1:to(g.device):to(g.dtype)
        cast[key] = c
      end
      F.mul_(g, c)
    end
    for _, c in pairs(cast) do if c ~= c1 then free(c) end end
    free(c1)
  end
  if opts and opts.tensor then return total_t end
  local total = total_t:item()
  free(total_t)
  return total
end

-- optim.one_process_state(groups, by_name, hyper) -> the state dict
-- opt:state_dict() of ms.optim.AdamW over a whole model would give: groups
-- as build_groups(model, {}, true) makes them (decayed, then not: lists of
-- names, weight_decay 0 for the second), by_name = name -> { exp_avg =,
-- exp_avg_sq =, step = } (whole tensors), hyper-parameters from `hyper`
-- ({ lr, betas, eps, weight_decay }). A sharded model's one-process
-- checkpoint (moonshard.tp, moonshard.pp) writes it.
function optim.one_process_state(groups, by_name, hyper)
  local tensors, meta = {}, { type = 'AdamW', groups = {}, state = {} }
  local i = 0
  for gi, g in ipairs(groups) do
    local mg = { params = {}, names = g.names, lr = hyper.lr, betas = hyper.betas, eps = hyper.eps,
      weight_decay = g.weight_decay == 0 and 0 or hyper.weight_decay }
    for k, name in ipairs(g.names) do
      i = i + 1
      mg.params[k] = i
      local e = by_name[name]
      if e then
        tensors[i .. '.exp_avg'], tensors[i .. '.exp_avg_sq'] = e.exp_avg, e.exp_avg_sq
        meta.state[#meta.state + 1] = { index = i, step = e.step }
      end
    end
    meta.groups[gi] = mg
  end
  return { tensors = tensors, meta = meta }
end

-- each optimizer file returns a builder taking this table (its base class)
optim.AdamW = require('moonshard.optim.adamw')(optim)
optim.SGD = require('moonshard.optim.sgd')(optim)
optim.schedule = require 'moonshard.optim.schedule'

return optim
