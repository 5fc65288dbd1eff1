-- moonshard.amp — mixed precision: bf16 compute, f32 master weights.
--
--   local amp = require 'moonshard.amp'      -- also nn.functional.autocast
--   local loss = amp.autocast('bf16', model, ids, targets)   -- fn(...) in a region
--   loss:backward()                           -- grads land in the f32 params, in f32
--   amp.set_precision(model, { compute = 'bf16' })  -- every model(...) call in a region
--
-- Inside an autocast region the matmul-like functions of nn.functional
-- (linear, conv1d_linear, scaled_dot_product_attention, lm_loss) cast their
-- float inputs to the region's dtype first, with a recorded cast: the
-- backward of the cast turns the bf16 gradient back into the input's dtype,
-- so an f32 parameter gets an f32 .grad and the optimizer keeps f32 master
-- weights and f32 moments. Everything else keeps its dtype: embeddings and
-- the residual stream stay f32 (x + bf16 promotes to f32), norms compute in
-- f32 and emit the region's dtype (the cast the next matmul would make,
-- fused into the norm), softmax and losses compute in f32. f64 tensors are
-- never cast (as in torch.autocast), so gradchecks work inside a region.
-- docs/precision.md has the whole design.
--
-- The region is dynamic (a flag set while fn runs, restored on return or
-- error) and applies to the forward only: backward runs on what the
-- forward recorded.
local T = require 'moonshard.tensor'

local amp = {}

local region = nil   -- dtype id of the current region (2 bf16, 3 f16), or nil

local pack = function(...) return { n = select('#', ...), ... } end
local unpack = unpack or table.unpack

local function region_dtype(dtype, level)
  if dtype == nil or dtype == false or dtype == 'f32' or dtype == 'float32' then return nil end
  local id = T.dtype_id(dtype, level + 1)
  if id ~= 2 and id ~= 3 then
    error(("autocast: the compute dtype must be 'bf16' or 'f16' (or false/'f32' for none), got %s")
      :format(tostring(dtype)), level + 1)
  end
  return id
end

-- autocast(dtype, fn, ...) -> fn(...)'s results, run with the region's
-- compute dtype set ('bf16', 'f16'; false, nil or 'f32' run fn outside any
-- region, e.g. to leave one for a part of the model)
function amp.autocast(dtype, fn, ...)
  local id = region_dtype(dtype, 2)
  if type(fn) ~= 'function' and not (type(fn) == 'table' and getmetatable(fn) and getmetatable(fn).__call) then
    error('autocast: expected a function (or callable module) after the dtype', 2)
  end
  local prev = region
  region = id
  local r = pack(pcall(fn, ...))
  region = prev
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

-- the current region's compute dtype id (2 bf16, 3 f16), or nil outside
function amp.dtype() return region end
function amp.dtype_name() return region and T.dtype_name(region) or nil end

-- state for code that re-runs a forward later (activation checkpointing):
-- local s = amp.state(); ...; amp.set_state(s)
function amp.state() return region end
function amp.set_state(s) region = s end

-- t cast to the region's dtype when inside one and t is a float tensor of
-- another dtype other than f64 (recorded: its gradient flows back in t's
-- dtype); anything else unchanged. Several tensors in, as many out.
local function cast1(t)
  if region == nil or not T.is_tensor(t) then return t end
  local d = t.dtype_id
  if d == region or d == 0 or d > 3 then return t end
  return t:to(T.dtype_name(region))
end
function amp.cast(a, b, c, d, e)
  if region == nil then return a, b, c, d, e end
  return cast1(a), cast1(b), cast1(c), cast1(d), cast1(e)
end

-- the dtype a norm emits for input x: the region's for f32/f16/bf16 input
-- inside a region, else `default` (x's dtype when nil)
function amp.norm_out_dtype(x, default)
  if region ~= nil and x.dtype_id ~= 0 and x.dtype_id <= 3 then return region end
  return default or x.dtype_id
end

-- f32 copies of the weights set_precision lowered, until an optimizer takes
-- them as its master copies (weak keys: a parameter dropped drops its copy)
local pending_masters = setmetatable({}, { __mode = 'k' })

-- amp.take_master(p) -> the f32 values p had before set_precision{weights}
-- lowered it (once; nil when there are none): AdamW{master_weights} starts
-- its master there, so the masters hold what the f32 weights held
function amp.take_master(p)
  local w = pending_masters[p]
  pending_masters[p] = nil
  return w
end

-- set_precision(model, {compute = 'bf16'}): every call of model (its
-- forward) runs in an autocast region; {compute = 'f32'} (or nil) undoes
-- it. Without opts.weights the parameters are not touched: keep them f32
-- (the master weights). Returns model.
--
-- opts.weights = 'bf16' (or 'f16', with compute): the weights and biases of
-- every Linear and Conv1D are converted to that dtype in place, so the
-- region casts none of them (no cast kernels forward, and their gradients
-- come out of the GEMMs in that dtype, no cast back). The values the GEMMs
-- see are the same as the region's casts give; pair it with
-- ms.optim.AdamW{master_weights = true} so the updates run on f32 master
-- copies. Embeddings, norms and the model's LM head (head_weight()) stay
-- f32 (the residual stream too).
function amp.set_precision(model, opts)
  if type(model) ~= 'table' or type(model.forward) ~= 'function' then
    error('set_precision: expected a module (a table with forward)', 2)
  end
  local compute = opts and opts.compute
  local id = region_dtype(compute, 2)
  local weights = opts and opts.weights
  if weights ~= nil then
    if weights ~= 'bf16' and weights ~= 'f16' then
      error(("set_precision: weights must be 'bf16' or 'f16', got %s"):format(tostring(weights)), 2)
    end
    if id == nil or T.dtype_name(id) ~= weights then
      error(("set_precision: weights = '%s' needs compute = '%s'"):format(weights, weights), 2)
    end
    local nn = require 'moonshard.nn'
    -- the LM head stays f32: the fused LM loss accumulates an f32 weight's
    -- gradient in f32 over its chunks (a bf16 one would be rounded there)
    local head = type(model.head_weight) == 'function' and model:head_weight() or nil
    for _, m in model:named_modules() do
      local cls = getmetatable(m)
      if (cls == nn.Linear or cls == nn.Conv1D) and (head == nil or rawget(m, 'weight') ~= head) then
        -- the f32 values, for the optimizer's masters (amp.take_master)
        for _, p in ipairs(m:parameters()) do
          if p.dtype_id == 1 then pending_masters[p] = p:to({ dtype = 'f32', copy = true }) end
        end
        m:to(weights)
      end
    end
  end
  rawset(model, 'forward', nil)          -- back to the class's forward
  if id ~= nil then
    local fwd = model.forward
    local name = T.dtype_name(id)
    rawset(model, 'forward', function(self, ...) return amp.autocast(name, fwd, self, ...) end)
  end
  rawset(model, '_compute_dtype', id and T.dtype_name(id) or nil)
  return model
end

-- the compute dtype set on a model with set_precision, or nil
function amp.precision(model) return rawget(model, '_compute_dtype') end

return amp
