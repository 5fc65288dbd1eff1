-- moonshard.optim.adamw — AdamW (Loshchilov & Hutter), as torch.optim.AdamW:
--
--   p   <- p * (1 - lr * weight_decay)          (decoupled decay)
--   m   <- beta1 * m + (1 - beta1) * g
--   v   <- beta2 * v + (1 - beta2) * g^2
--   p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
--
-- ms.optim.AdamW(params, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8,
-- weight_decay = 0.01}). Given a module, two groups: decay (2-D+ weights) and
-- no decay (norms, biases, embeddings; optim.no_decay decides). Moments are
-- f32 (f64 for f64 parameters); a bf16/f16 parameter is updated in f32 and
-- rounded once. This file returns a builder: require('moonshard.optim').AdamW
-- is the class.
--
-- master_weights = true: each bf16/f16 parameter gets an f32 master copy in
-- its state (`master`, made from the parameter at its first step and saved
-- with the state): the update runs on the master and the parameter becomes
-- its rounding (Megatron's fp32 main parameters; with bf16 weights the
-- forward needs no weight casts and the gradients stay bf16, see
-- nn.functional.set_precision's `weights`). load_state_dict writes the
-- loaded masters back into the parameters.
--
-- The step is the fused op F.adamw_ (core/adamw_cpu.c, kernels/adamw.cu):
-- the parameters of a group that share a device and a step count are
-- updated in one call — one launch on CUDA, one pass over p, g, m, v — with
-- the math in f64 on the CPU and f32 on the GPU (f64 for f64 parameters).
-- A non-contiguous parameter or gradient takes the composed path instead
-- (a dozen raw ops, the same math).
--
-- Under a CUDA graph capture (ms.cuda.graph, docs/cuda-graphs.md) a fused
-- step reads its constants (lr, weight decay and the bias corrections of
-- its step count) from a small device tensor that a replay hook fills
-- before each replay, with the step counts advanced on the host: each
-- replay is the next step, with the bits of an eager one, and the group's
-- lr may change between replays (betas and eps are captured as they were).
-- The composed path and a first step (state not made yet) are refused there.
local F = require 'moonshard.ops'
local A = require 'moonshard.autograd'
local T = require 'moonshard.tensor'
local cuda = require 'moonshard.cuda'

local free = A.free

return function(optim)
  local AdamW = setmetatable({}, { __index = optim.Optimizer })
  AdamW.__index = AdamW
  AdamW.__tostring = optim.Optimizer.__tostring

  local defaults = { lr = 1e-3, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.01, master_weights = false }

  local function new(params, opts)
    opts = opts or {}
    local d = {}
    for k, v in pairs(defaults) do d[k] = v end
    for k, v in pairs(opts) do d[k] = v end
    if type(d.lr) ~= 'number' or d.lr < 0 then error(('AdamW: lr must be a number >= 0, got %s'):format(tostring(d.lr)), 2) end
    if type(d.betas) ~= 'table' or #d.betas ~= 2 then error('AdamW: betas must be a table {beta1, beta2}', 2) end
    if type(d.master_weights) ~= 'boolean' then
      error(('AdamW: master_weights must be true or false, got %s'):format(tostring(d.master_weights)), 2)
    end
    local self = optim.new_optimizer(AdamW, 'AdamW', params, d, true)
    self.master_weights = d.master_weights
    return self
  end
  setmetatable(AdamW, { __index = optim.Optimizer, __call = function(_, ...) return new(...) end })

  local function init_state(p)
    local dt = optim.state_dtype(p)
    local o = { dtype = dt, device = p.device_id }
    local T = require 'moonshard.tensor'
    return { step = 0, exp_avg = T.zeros(p.shape, o), exp_avg_sq = T.zeros(p.shape, o) }
  end
  -- bf16 and f16 parameters (the ones a master helps)
  local function wants_master(p) return p.dtype_id == 2 or p.dtype_id == 3 end
  -- the master: the f32 values set_precision{weights} kept for p, else p's own
  local function new_master(p)
    local w = require('moonshard.amp').take_master(p)
    if w ~= nil and w:numel() == p:numel() and w.device_id == p.device_id then return w:contiguous() end
    return p:to({ dtype = 'f32', copy = true }):contiguous()
  end
  local function init_state_master(p)
    local st = init_state(p)
    if wants_master(p) then st.master = new_master(p) end
    return st
  end

  -- the fused op takes contiguous tensors of one numel (and on CUDA f64
  -- gradients for f64 parameters only)
  local function fusable(p, g, st)
    return p:is_contiguous() and g:is_contiguous() and g:numel() == p:numel()
      and g.device_id == p.device_id and st.exp_avg:is_contiguous() and st.exp_avg_sq:is_contiguous()
      and (p.device_id < 0 or (p.dtype_id == 0) == (g.dtype_id == 0))
      and (st.master == nil or st.master:is_contiguous())
  end

  -- opt:defer_grad_scale(t): the next step multiplies every gradient by t
  -- (one f64 element, on the gradients' device) on the way in, instead of a
  -- pass scaling them first: clip_grad_norm's { defer = opt }. The
  -- gradients themselves stay unscaled; the step consumes (and frees) t.
  function AdamW:defer_grad_scale(t)
    if type(t) ~= 'cdata' or t.dtype ~= 'f64' or t:numel() ~= 1 then
      error(('AdamW:defer_grad_scale: needs a one-element f64 tensor, got %s'):format(
        type(t) == 'cdata' and (t.dtype .. ' of ' .. t:numel() .. ' elements') or type(t)), 2)
    end
    if self._grad_scale ~= nil then free(self._grad_scale) end
    self._grad_scale = t
  end

  -- opt:set_mirrors(map) (map: parameter -> tensor, or nil): each step also
  -- writes a mapped f32 parameter's bf16/f16 rounding into its mirror, in
  -- the same fused pass (the parameter as the master, the mirror as the
  -- parameter the op rounds into: FSDP's low-precision shard copies, with
  -- no refresh pass after the step). opt.mirrored: the parameters whose
  -- mirror the last step wrote; a parameter stepped by the composed path
  -- (a layout the fused op does not take) is not among them.
  function AdamW:set_mirrors(map) self._mirrors = map end
  local function mirror_fits(mr, p, st)
    return mr ~= nil and st.master == nil and p.dtype_id == 1 and (mr.dtype_id == 2 or mr.dtype_id == 3)
      and mr:is_contiguous() and mr:numel() == p:numel() and mr.device_id == p.device_id
  end

  -- the gradient scale sc.gs on device dev, copied there once a step
  -- (sc.on[dev]); nil without one. (The step's state goes through sc, not
  -- closures: a trace specialised on a closure made in a step keeps its
  -- upvalues, this step's tensors, alive; docs/tensors.md.)
  local function scale_on(sc, dev)
    local gs = sc.gs
    if gs == nil then return nil end
    local s = sc.on[dev]
    if s == nil then
      s = tonumber(gs.device_id) == dev and gs or gs:to({ device = dev })
      sc.on[dev] = s
    end
    return s
  end

  function AdamW:step()
    local gs = self._grad_scale
    self._grad_scale = nil
    local mirrors, mirrored = self._mirrors, {}
    self.mirrored = mirrored
    local sc = { gs = gs, on = {} }   -- (on: the scale on each device the gradients use)
    A.no_grad(self._step_groups, self, sc, mirrors, mirrored, cuda.is_capturing())
    for _, s in pairs(sc.on) do if s ~= gs then free(s) end end
    if gs ~= nil then free(gs) end
  end

  -- step's work over the groups, gradient mode off
  function AdamW:_step_groups(sc, mirrors, mirrored, capturing)
    local gs = sc.gs
    for _, group in ipairs(self.param_groups) do
      local lr, eps, wd = group.lr, group.eps, group.weight_decay or 0
      local b1, b2 = group.betas[1], group.betas[2]
      local batches, order = {}, {}   -- (device, step) -> lists for F.adamw_
      for _, p in ipairs(group.params) do
        local g = p.grad
        if g ~= nil then
          local st = self:state_of(p, self.master_weights and init_state_master or init_state)
          if self.master_weights and st.master == nil and wants_master(p) then   -- (a state loaded without one)
            st.master = new_master(p)
          end
          st.step = st.step + 1
          A.bump_version(p)   -- p is written in place below (autograd's saved-tensor check)
          if fusable(p, g, st) then
            scale_on(sc, tonumber(p.device_id))
            local mr = mirrors and mirrors[p]
            if not mirror_fits(mr, p, st) then mr = nil end
            -- (with a mirror the op updates p as the master and rounds into it)
            local pp, w = mr or p, mr and p or st.master
            -- one fused call per (device, step, dtypes): a launch takes one
            -- parameter and one gradient dtype, so mixing them in one list
            -- (f32 norms between bf16 weights) would cut it into many
            local key = p.device_id .. ':' .. st.step .. ':' .. pp.dtype_id .. ':' .. g.dtype_id
            local b = batches[key]
            if b == nil then
              b = { step = st.step, p = {}, g = {}, m = {}, v = {}, w = {}, any_w = false }
              batches[key] = b
              order[#order + 1] = key
            end
            local k = #b.p + 1
            b.p[k], b.g[k], b.m[k], b.v[k] = pp, g, st.exp_avg, st.exp_avg_sq
            b.w[k] = w or false
            if w then b.any_w = true end
            if mr then mirrored[p] = true end
            b.states = b.states or {}
            b.states[k] = st
          else
            if capturing then
              error(('AdamW:step during CUDA graph capture: a parameter %s (or its gradient) is not contiguous, '
                .. 'and the composed update would keep this step\'s count in the graph'):format(
                T.shape_str(p.shape)), 0)
            end
            local gsc = g
            if gs ~= nil then   -- the same bits as the fused op: g times the scale in g's dtype
              local c = scale_on(sc, tonumber(g.device_id)):to(g.dtype)
              gsc = F.mul(g, c)
              free(c)
            end
            self:_composed_update(p, gsc, st, lr, b1, b2, eps, wd)
            if gsc ~= g then free(gsc) end
          end
        end
      end
      for _, key in ipairs(order) do
        local b = batches[key]
        local k = capturing and self:_graph_constants(group, b) or nil
        F.adamw_(b.p, b.g, b.m, b.v, lr, b1, b2, eps, wd, b.step, b.any_w and b.w or nil,
          scale_on(sc, tonumber(b.p[1].device_id)), k)
      end
    end
  end

  -- a captured step's constants: a device tensor (in the graph's memory)
  -- that a replay hook writes for the next step before each replay, its
  -- states' step counts advanced then (the capture itself takes no step)
  function AdamW:_graph_constants(group, b)
    -- (written by the hook before each replay: a block no captured work
    -- reuses, cuda.host_written)
    local k = cuda.host_written(function() return T.empty({ 3 }, { dtype = 'f64', device = b.p[1].device_id }) end)
    local states = b.states
    for _, st in ipairs(states) do st.step = st.step - 1 end
    local b1, b2 = group.betas[1], group.betas[2]
    cuda.on_replay(function()
      for _, st in ipairs(states) do st.step = st.step + 1 end
      F.adamw_constants_(k, group.lr, b1, b2, group.weight_decay or 0, states[1].step)
    end)
    return k
  end

  -- the same update with raw ops (any layout)
  function AdamW:_composed_update(p, g, st, lr, b1, b2, eps, wd)
    local m, v = st.exp_avg, st.exp_avg_sq
    local gf = g
    if g.dtype_id ~= m.dtype_id then gf = g:to({ dtype = m.dtype_id }) end
    -- m = b1 m + (1 - b1) g
    F.mul_(m, b1)
    local t = F.mul(gf, 1 - b1)
    F.add_(m, t)
    free(t)
    -- v = b2 v + (1 - b2) g^2
    F.mul_(v, b2)
    t = F.square(gf)
    F.mul_(t, 1 - b2)
    F.add_(v, t)
    free(t)
    if gf ~= g then free(gf) end
    local bc1 = 1 - b1 ^ st.step
    local bc2 = 1 - b2 ^ st.step
    local denom = F.sqrt(v)
    F.div_(denom, math.sqrt(bc2))
    F.add_(denom, eps)
    local upd = F.div(m, denom)
    free(denom)
    F.mul_(upd, lr / bc1)
    local pw = st.master or p   -- with a master: the update runs there, p gets its rounding
    if pw.dtype_id ~= m.dtype_id then pw = p:to({ dtype = m.dtype_id }) end
    if wd ~= 0 then F.mul_(pw, 1 - lr * wd) end
    F.sub_(pw, upd)
    free(upd)
    if pw ~= p then
      p:copy_(pw)
      if pw ~= st.master then free(pw) end
    end
  end

  -- the base load, then the loaded masters written into their parameters
  function AdamW:load_state_dict(sd)
    optim.Optimizer.load_state_dict(self, sd)
    A.no_grad(function()
      for _, group in ipairs(self.param_groups) do
        for _, p in ipairs(group.params) do
          local st = self.state[tonumber(p.id)]
          if st and st.master then p:copy_(st.master) end
        end
      end
    end)
  end

  return AdamW
end
