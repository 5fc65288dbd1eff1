-- moonshard.flce — fused linear cross-entropy (core/flce.h) with autograd:
-- the loss of x·Wᵀ (+ b) against class targets, without the logits.
--
--   local nnf = require 'moonshard.nn.functional'
--   local loss, z_loss, acc = nnf.fused_linear_cross_entropy(x, W, targets, {
--     bias = b,                  -- (V), optional
--     ignore_index = -100,
--     label_smoothing = 0.1,
--     lse_square_scale = 1e-4,   -- z-loss
--     softcap = 30,              -- logits = 30·tanh(logits / 30)
--     ce_weight = w,             -- (V) per-class weights, optional
--     reduction = 'mean',        -- 'mean' | 'sum' | 'none'
--     return_z_loss = true, return_accuracy = true,
--     chunk_size = nil,          -- rows per chunk (default: from memory_budget)
--     memory_budget = nil,       -- bytes for a chunk's logits (ms_flce_chunk_rows)
--     accum_dtype = nil,         -- grad_W/grad_bias accumulation: 'f32' (default) or W's dtype
--     group = nil,               -- vocabulary-parallel: a dist.Group (see below)
--     vocab_start = nil, vocab_size = nil,
--   })
--
-- x is (BT, H) or (..., H) with targets (...) (i64/i32 ids); W is (V, H).
-- loss is a scalar for 'mean'/'sum' and has targets' shape for 'none';
-- z_loss (same shape) and accuracy (a scalar) only when asked for, else nil,
-- and they carry no gradient. Semantics, chunking and precision: core/flce.h
-- and docs/flce.md. 'mean' with every target ignored is 0 (and so are the
-- gradients), not NaN.
--
-- Autograd: for 'mean' and 'sum' the forward computes the gradients of x, W
-- and bias (those that require grad) while it computes the loss, and keeps
-- only them; the backward multiplies them by the incoming gradient on the
-- device (ms_flce_scale_: nothing happens when it is 1, no host sync) and
-- hands them on without a copy. For 'none' the gradient of Σ g_i·loss_i
-- cannot be known before g, so the forward computes the loss alone and the
-- backward runs the fused pass once, with g as per-token weights.
-- Vocabulary-parallel (opts.group, a ms.dist group whose ranks hold the
-- same x and targets): W (and bias, ce_weight) are this rank's rows, the
-- classes [vocab_start, vocab_start + V) of vocab_size. The loss, z-loss and
-- accuracy are those of the full vocabulary (per-token statistics are
-- all-reduced), grad_W has W's shape, grad_x is complete on every rank
-- (opts.grad_x_partial = true: this rank's classes' part of it, for the
-- caller to sum: a sequence-parallel gather's reduce-scatter, moonshard.tp).
-- Without vocab_start, the split is the flat-parameter rule of
-- flce.vocab_shard(vocab_size, rank, size) when vocab_size is given, else
-- found by gathering every rank's row count (one more collective per call,
-- and a host sync on GPUs: pass vocab_size). Every rank must call (and run
-- backward) together.
--
-- The node is recorded with A.record_list (as nn.functional's ops are), not
-- A.Function: the Function layer treats a backward's results as borrowed
-- and copies them into .grad, which for an LM head's grad_W is a second
-- copy of the largest gradient in the model.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local A = require 'moonshard.autograd'

local C = T.C
local R = A.raw_views
local free = A.free
local needs = A.needs_grad
local is_tensor = T.is_tensor

local M = {}

local box_t = ffi.typeof('ms_tensor*[1]')
local opts_t = ffi.typeof('ms_flce_opts')
local reductions = { mean = C.MS_FLCE_MEAN, sum = C.MS_FLCE_SUM, none = C.MS_FLCE_NONE }
local NAME = 'fused_linear_cross_entropy'

local raise = require('moonshard.ops').raise   -- (errors at the user's line)

local function shape_str(s) return '(' .. table.concat(s, ',') .. ')' end

local function need_tensor(x, what)
  if not is_tensor(x) then raise(('%s: expected a tensor for %s, got %s'):format(NAME, what, type(x))) end
  if x.storage == nil then raise(('%s: %s was freed'):format(NAME, what)) end
end

local function number_opt(opts, k, default)
  local v = opts[k]
  if v == nil then return default end
  if type(v) ~= 'number' then raise(('%s: opts.%s must be a number, got %s'):format(NAME, k, type(v))) end
  return v
end

local function int_opt(opts, k, default)
  local v = number_opt(opts, k, default)
  if v ~= math.floor(v) then raise(('%s: opts.%s must be an integer, got %s'):format(NAME, k, tostring(v))) end
  return v
end

-- the C options from a Lua opts table
function M.options(opts)
  opts = opts or {}
  if type(opts) ~= 'table' then raise(('%s: opts must be a table, got %s'):format(NAME, type(opts))) end
  local o = opts_t()
  C.ms_flce_opts_init(o)
  local red = opts.reduction or 'mean'
  if reductions[red] == nil then
    raise(("%s: reduction must be 'mean', 'sum' or 'none', got %s"):format(NAME, tostring(red)))
  end
  o.reduction = reductions[red]
  o.ignore_index = int_opt(opts, 'ignore_index', -100)
  o.label_smoothing = number_opt(opts, 'label_smoothing', 0)
  o.lse_square_scale = number_opt(opts, 'lse_square_scale', 0)
  o.softcap = number_opt(opts, 'softcap', 0)
  o.chunk_size = int_opt(opts, 'chunk_size', 0)
  o.memory_budget = int_opt(opts, 'memory_budget', 0)
  if opts.accum_dtype ~= nil then o.accum_dtype = T.dtype_id(opts.accum_dtype, 3) end
  if opts.grad_dtype ~= nil then o.grad_dtype = T.dtype_id(opts.grad_dtype, 3) end
  if opts.grad_x_partial ~= nil then
    if type(opts.grad_x_partial) ~= 'boolean' then
      raise(('%s: opts.grad_x_partial must be a boolean, got %s'):format(NAME, type(opts.grad_x_partial)))
    end
    if opts.grad_x_partial and opts.group == nil then
      raise(('%s: opts.grad_x_partial needs the vocabulary-parallel mode (opts.group)'):format(NAME))
    end
    o.grad_x_partial = opts.grad_x_partial and 1 or 0
  end
  return o, red
end

-- the classes {start, rows} of a vocabulary of V held by group rank `rank`
-- of `size` (0-based rank): ceil(V / size) rows each, the last ranks fewer
function M.vocab_shard(V, rank, size)
  local a, n = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
  C.ms_flce_vocab_shard(V, rank, size, a, n)
  return tonumber(a[0]), tonumber(n[0])
end

-- (vocab_start, vocab_size) of this rank's V rows in `group`
local function vocab_layout(group, V, opts)
  if type(group) ~= 'table' or type(group.rank) ~= 'function' then
    raise(('%s: opts.group must be a ms.dist group, got %s'):format(NAME, type(group)))
  end
  if not group.p then raise(('%s: this rank is not a member of opts.group'):format(NAME)) end
  local rank, size = group:rank(), group:size()
  local v0, vt = opts.vocab_start, opts.vocab_size
  if v0 ~= nil then
    if vt == nil then raise(('%s: opts.vocab_start needs opts.vocab_size'):format(NAME)) end
    return v0, vt
  end
  if vt ~= nil then
    local a, n = M.vocab_shard(vt, rank, size)
    if n ~= V then
      raise(('%s: W has %d rows, but rank %d of %d holds %d classes [%d, %d) of a vocabulary of %d '
        .. '(flce.vocab_shard); pass opts.vocab_start for another split'):format(NAME, V, rank, size, n, a, a + n, vt))
    end
    return a, vt
  end
  -- neither given: every rank's row count, gathered (a collective and, on
  -- GPUs, a host sync per call; nothing that differs between ranks could
  -- key a cache of it safely)
  local dist = require 'moonshard.dist'
  local dev = dist.device()
  local mine = T.full({ 1 }, V, { dtype = 'i64', device = dev })
  local all = T.empty({ size }, { dtype = 'i64', device = dev })
  dist.all_gather_into(all, mine, { group = group })
  local c = all:totable()
  mine:free()
  all:free()
  local a, total = 0, 0
  for r = 1, size do
    if r - 1 < rank then a = a + c[r] end
    total = total + c[r]
  end
  return a, total
end

-- rows per chunk the C core picks for x (BT, H), W (V, H) with these opts
function M.chunk_rows(x, W, opts)
  local o = M.options(opts)
  local bt = math.floor(x:numel() / math.max(1, x.shape[x.ndim]))
  return tonumber(C.ms_flce_chunk_rows(o, bt, x.shape[x.ndim], W.shape[1], x.dtype_id, x.device_id))
end

-- one call of ms_flce; want: which outputs (loss, z, acc, gx, gw, gb) to
-- make; into: tensors to write outputs into (by position; not returned)
local function run(o, x2, W, t1, bias, cew, gs, want, into)
  local slots = {}
  for k = 1, 6 do
    if want[k] then
      slots[k] = box_t()
      if into and into[k] then slots[k][0] = into[k] end
    end
  end
  local rc = C.ms_flce(o, x2, W, t1, bias, cew, gs, slots[1], slots[2], slots[3], slots[4], slots[5], slots[6])
  if rc ~= 0 then raise(ffi.string(C.ms_last_error())) end
  local r = {}
  for k = 1, 6 do if slots[k] and not (into and into[k]) then r[k] = T.wrap(slots[k][0]) end end
  return r
end

-- The weight's gradient sink (autograd.set_grad_sink: FSDP's f32 region of
-- the unsharded gradient buffer) when grad_W can be accumulated there in
-- the forward: the sink empty (written[i] nil: a gradient already there
-- would be scaled with this one by the backward), in the accumulator's
-- dtype (f32; f64 for f64 W), on W's device, accumulation not forced to W's
-- dtype. The sink is then marked with a token until this loss's backward
-- has scaled it (written[i] = true): a token left at the owner's collect
-- (FSDP: the unit's backward end) is a forward whose backward never ran,
-- and its region counts as unwritten; other writers leave a marked sink
-- alone (nn.functional's weight_grad). MS_FLCE_SINK=0 turns this off.
local use_sinks = os.getenv('MS_FLCE_SINK') ~= '0'   -- MS_FLCE_SINK=0: never (to compare)
local function sink_for(wt, W, o)
  if not use_sinks then return nil end
  local sink = A.leaf_sink(wt)
  if sink == nil or sink.written[sink.i] ~= nil then return nil end
  local acc = W.dtype_id == T.dtype_id('f64') and T.dtype_id('f64') or T.dtype_id('f32')
  if sink.t.dtype_id ~= acc or sink.t.device_id ~= W.device_id or sink.t.storage == nil then return nil end
  if o.accum_dtype ~= -1 and o.accum_dtype ~= acc then return nil end
  if o.grad_dtype ~= -1 and o.grad_dtype ~= acc then return nil end
  return sink
end

-- x (..., H) -> (BT, H), targets (...) -> (BT): views when possible
local function flatten(x, targets)
  local H = x.shape[x.ndim]
  local x2, t1 = x, targets
  if x.ndim ~= 2 then
    if x.ndim < 1 then raise(('%s: x must have a hidden dim, got a scalar'):format(NAME)) end
    local lead = {}
    for i = 1, x.ndim - 1 do lead[i] = x.shape[i] end
    if shape_str(lead) ~= shape_str(targets.shape) then
      raise(('%s: targets %s must have the shape of x %s without its last (hidden) dim'):format(
        NAME, shape_str(targets.shape), shape_str(x.shape)))
    end
    x2 = R.reshape(x, { -1, H })
  end
  if targets.ndim ~= 1 then t1 = R.reshape(targets, { -1 }) end
  return x2, t1
end

-- backward of 'mean'/'sum': the gradients were computed in the forward
local function bwd_reduced(node, g)
  local s = node.saved
  local sk = s.sink
  if sk then   -- grad_W is in the sink (sink_for): scaled there, nothing returned
    if sk.written[sk.i] ~= sk.token or sk.t.storage == nil then
      error(('%s: the forward wrote W\'s gradient %s into its gradient sink, and that buffer was released or '
        .. 'reset before this backward (a zero_grad between the forward and the backward?): the gradient is lost')
        :format(NAME, sk.shape), 0)
    end
    if C.ms_flce_scale_(sk.t, g) ~= 0 then error(ffi.string(C.ms_last_error()), 0) end
    sk.written[sk.i] = true
  end
  local out = {}
  for k, t in pairs({ s.gx, s.gw, s.gb }) do
    if C.ms_flce_scale_(t, g) ~= 0 then error(ffi.string(C.ms_last_error()), 0) end
    -- a new handle on the same storage: node.own releases the saved one
    -- right after this returns, so the walk can take the storage as .grad
    out[k] = (k == 1 and s.xshape) and R.view(t, s.xshape) or R.alias(t)
  end
  return out[1], out[2], out[3]
end

-- backward of 'none': one fused pass with g as per-token weights
local function bwd_none(node, g)
  local s = node.saved
  local g1 = g.ndim == 1 and g or R.reshape(g, { -1 })
  local need = node.need
  local r = run(s.o, s.x2, s.W, s.t1, s.bias, s.cew, g1,
    { false, false, false, need[1], need[2], s.bias ~= nil and need[3] })
  if g1 ~= g then free(g1) end
  local gx = r[4]
  if gx and s.xshape then
    local v = R.view(gx, s.xshape)
    free(gx)
    gx = v
  end
  return gx, r[5], r[6]
end

-- the vocabulary-parallel call's collectives (core/flce.c issues them
-- itself), noted in ms.dist's trace when it is on: D and the weights' sum
-- (2 f64), per chunk the rows' maxima, sums and best class (7 values a
-- row), and grad_x summed over the group
local function trace_vp(o, x2, W, group, gx)
  local dist = package.loaded['moonshard.dist']
  if not (dist and dist.tracing()) then return end
  local bt, H = x2.shape[1], x2.shape[2]
  local rows = tonumber(C.ms_flce_chunk_rows(o, bt, H, W.shape[1], x2.dtype_id, x2.device_id))
  local chunks = rows > 0 and math.ceil(bt / rows) or 1
  local es = x2.device_id >= 0 and 4 or 8   -- (the statistics: f32 on GPUs, f64 on the CPU)
  dist.trace_note('all_reduce (flce: D, sum w)', group, 16)
  for c = 1, chunks do
    local n = math.min(rows > 0 and rows or bt, bt - (c - 1) * rows)
    dist.trace_note('all_reduce (flce: row stats)', group, 7 * n * es)
  end
  if gx and o.grad_x_partial == 0 then
    dist.trace_note('all_reduce (flce: grad_x)', group, bt * H * C.ms_dtype_size(x2.dtype_id))
  end
end

function M.fused_linear_cross_entropy(x, W, targets, opts)
  need_tensor(x, 'x')
  need_tensor(W, 'W')
  need_tensor(targets, 'targets')
  opts = opts or {}
  local o, red = M.options(opts)
  local bias, cew = opts.bias, opts.ce_weight
  if bias ~= nil then need_tensor(bias, 'opts.bias') end
  if cew ~= nil then need_tensor(cew, 'opts.ce_weight') end
  local x2, t1 = flatten(x, targets)
  if opts.group ~= nil then
    local v0, vt = vocab_layout(opts.group, W.shape[1], opts)
    o.group, o.vocab_start, o.vocab_size = opts.group.p, v0, vt
  end
  -- opts.master_weight: W is a low-precision copy of this tensor (autocast's
  -- cast of an f32 weight); the W gradient is computed in its dtype and
  -- belongs to it (no bf16 gradient, no cast back)
  local wt = W
  if opts.master_weight ~= nil then
    wt = opts.master_weight
    need_tensor(wt, 'opts.master_weight')
    if wt.ndim ~= 2 or wt.shape[1] ~= W.shape[1] or wt.shape[2] ~= W.shape[2] then
      raise(('%s: opts.master_weight has shape (%s), W (%s)'):format(NAME, table.concat(wt.shape, ', '),
        table.concat(W.shape, ', ')))
    end
    if bias ~= nil and bias.dtype ~= wt.dtype then
      raise(('%s: with opts.master_weight (%s) the bias must have its dtype, got %s'):format(NAME, wt.dtype, bias.dtype))
    end
    o.grad_dtype = wt.dtype_id
  end
  local record = A.want(x, wt, bias)
  local grads = record and red ~= 'none'
  local sink = grads and needs(wt) and sink_for(wt, W, o) or nil
  local into = nil
  if sink then
    o.grad_dtype = sink.t.dtype_id
    into = { [5] = sink.t }
  end
  local r = run(o, x2, W, t1, bias, cew, nil, {
    true, opts.return_z_loss and true or false, opts.return_accuracy and true or false,
    grads and needs(x), grads and needs(wt), grads and bias ~= nil and needs(bias) }, into)
  if opts.group ~= nil then trace_vp(o, x2, W, opts.group, grads and needs(x)) end
  local sk = nil
  if sink then
    sk = { t = sink.t, written = sink.written, i = sink.i, token = {}, shape = shape_str(W.shape) }
    sink.written[sink.i] = sk.token
  end
  local loss, z, acc = r[1], r[2], r[3]
  if red == 'none' and targets.ndim ~= 1 then
    local l = R.view(loss, targets.shape)
    free(loss)
    loss = l
    if z then
      local zz = R.view(z, targets.shape)
      free(z)
      z = zz
    end
  end
  local xshape = x.ndim ~= 2 and x.shape or nil
  if record then
    local list = bias ~= nil and { x, wt, bias } or { x, wt }
    if red == 'none' then
      local own = {}
      if x2 ~= x then own[#own + 1] = x2 end
      if t1 ~= targets then own[#own + 1] = t1 end
      A.record_list(NAME, loss, bwd_none, { o = o, x2 = x2, W = W, t1 = t1, bias = bias, cew = cew,
        xshape = xshape, group = opts.group }, own, list)
      return loss, z, acc
    end
    local own = {}
    for k = 4, 6 do if r[k] then own[#own + 1] = r[k] end end
    A.record_list(NAME, loss, bwd_reduced, { gx = r[4], gw = r[5], gb = r[6], xshape = xshape, sink = sk }, own, list)
  end
  if x2 ~= x then free(x2) end
  if t1 ~= targets then free(t1) end
  return loss, z, acc
end

-- nn.functional.lm_loss's fused form: hidden (B, T, C), weight (V, C),
-- targets (B, T); opts as cross_entropy's (ignore_index, reduction,
-- label_smoothing) plus the options above. On a GPU, without chunk_size or
-- memory_budget, the chunk's logits get lm_loss_budget bytes (1 GiB; the
-- function's own default is 512 MiB): a model's loss is one call a step
-- beside activations of many GiB, and each chunk pays a read and a write of
-- the f32 grad_W accumulator (GPT-2 124M on an H100: 0.9-1.4% a step faster,
-- 0.37 GiB more at the peak; docs/flce.md)
local lm_loss_budget = 2 ^ 30
-- set_lm_loss_budget(bytes) -> the previous one (0: the function's default)
function M.set_lm_loss_budget(bytes)
  local prev = lm_loss_budget
  if bytes ~= nil then
    if type(bytes) ~= 'number' or bytes < 0 or bytes ~= math.floor(bytes) then
      error(('flce.set_lm_loss_budget: bytes must be an integer >= 0, got %s'):format(tostring(bytes)), 2)
    end
    lm_loss_budget = bytes
  end
  return prev
end
function M.lm_loss(hidden, weight, targets, opts)
  if lm_loss_budget > 0 and is_tensor(hidden) and hidden.device_id >= 0
    and not (opts and (opts.chunk_size or opts.memory_budget)) then
    local o = { memory_budget = lm_loss_budget }
    for k, v in pairs(opts or {}) do o[k] = v end
    opts = o
  end
  return (M.fused_linear_cross_entropy(hidden, weight, targets, opts))
end

return M
