-- moonshard.float8 — float8 training of linear layers (torchao's
-- convert_to_float8_training: tensorwise and rowwise dynamic scaling; and
-- DeepSeek-V3's blockwise recipe, float8.recipes.blockwise).
--
--   local float8 = require 'moonshard.float8'        -- also ms.float8
--   local names = float8.convert(model)               -- every Linear / Conv1D but the LM head
--   local y = float8.linear(x, w, b)                  -- one layer, x @ w^T + b through FP8 GEMMs
--   float8.revert(model)                              -- back to bf16 / f32 GEMMs
--
-- A converted layer computes its three products in FP8 on the tensor cores
-- (docs/float8.md):
--   forward        y  = x8 @ w8^T        x, w in f8e4m3  (fast accumulation)
--   input grad     dx = g8 @ w8          g in f8e5m2
--   weight grad    dw = g8^T @ x8
-- Each operand is scaled by its own dynamic scale, fmax / amax(tensor),
-- computed on the device from the tensor's absolute maximum (no host sync),
-- and the products are rescaled by the inverse scales in the GEMM. The
-- gradients are the straight-through ones (the products' gradients taken
-- as if the casts were the identity), as in torchao. The weight keeps its
-- dtype (an f32 master's gradient comes out of the FP8 GEMM in f32, or goes
-- into an FSDP unit's f32 gradient sink); the output has the autocast
-- region's dtype (else x's). Saved for backward: the input itself (as the
-- plain linear saves it: its transposed f8 copy is made in the backward with
-- the forward's amax, the same bits), and the weight's transposed f8 copy
-- (or, when FSDP releases the weight after the forward, its amax: the copy
-- is made again from the gathered weight).
--
-- Two layers reading the same input tensor (q/k/v, gate/up) share its cast,
-- in the forward and in the backward: the last cast is kept, keyed by the
-- tensor's storage, view and version, and dropped when a backward begins
-- and ends.
--
-- CUDA needs compute capability 8.9+ (H100: sm_90) and every dim of the
-- three products a multiple of 16: a call with a token count that is not
-- (generation, an odd batch) runs the plain linear instead, as does any call
-- outside grad-enabled float work that cannot take FP8 (f64 on a GPU). On
-- the CPU every shape runs (the FP8 values are exact in f32: the CPU
-- reference widens them and multiplies in f32).
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local F = require 'moonshard.ops'
local A = require 'moonshard.autograd'
local amp = require 'moonshard.amp'

local R = A.raw_views
local free = A.free
local shape_of = A.shape_of
local is_tensor = T.is_tensor

local float8 = {}

-- ---------------------------------------------------------------- recipes
-- tensorwise: torchao's default Float8LinearConfig (e4m3 input and weight,
-- e5m2 output gradient, fast accumulation in the forward product only).
-- pow2 rounds every scale down to a power of two (torchao's
-- round_scales_to_power_of_2; then x * scale is exact).
-- rowwise: torchao's ROWWISE (axiswise scaling: every operand of a product
-- scaled per row along K, the contraction dim, so one outlier token or
-- channel costs the precision of its own row only; e4m3 everywhere, scales
-- rounded to powers of two; cuBLASLt's outer-vector scaling, Hopper).
-- rowwise_with_gw_hp: the same with the weight gradient in high precision
-- (the activations' dtype, f32 accumulation; torchao's ROWWISE_WITH_GW_HP).
-- blockwise: DeepSeek-V3's recipe (torchao's prototype blockwise fp8
-- training): e4m3 everywhere, activations and output gradients scaled per
-- 1 x 128 block along each product's K, weights per 128 x 128 block; exact
-- f32 scales (amax / 448, not rounded to powers of two, as DeepSeek and
-- torchao do; pow2 = true is Transformer Engine's choice); cuBLASLt's
-- VEC128 / BLK128x128 block scaling (Hopper), no fast accumulation. Layers
-- with features multiples of 128 only (docs/float8.md, "Blockwise").
float8.recipes = {
  tensorwise = { input = 'f8e4m3', weight = 'f8e4m3', grad_output = 'f8e5m2', pow2 = false,
                 fast_accum_output = true, fast_accum_grads = false, recompute_weight = 'auto',
                 axiswise = false, gw_hp = false, tp_scales = 'shard', blockwise = false },
  rowwise = { input = 'f8e4m3', weight = 'f8e4m3', grad_output = 'f8e4m3', pow2 = true,
              fast_accum_output = true, fast_accum_grads = false, recompute_weight = 'auto',
              axiswise = true, gw_hp = false, tp_scales = 'shard', blockwise = false },
  rowwise_with_gw_hp = { input = 'f8e4m3', weight = 'f8e4m3', grad_output = 'f8e4m3', pow2 = true,
                         fast_accum_output = true, fast_accum_grads = false, recompute_weight = 'auto',
                         axiswise = true, gw_hp = true, tp_scales = 'shard', blockwise = false },
  blockwise = { input = 'f8e4m3', weight = 'f8e4m3', grad_output = 'f8e4m3', pow2 = false,
                fast_accum_output = false, fast_accum_grads = false, recompute_weight = 'auto',
                axiswise = false, gw_hp = false, tp_scales = 'shard', blockwise = true },
}
-- (the features a converted layer's weight must divide into: the FP8
-- GEMMs' 16, the blockwise recipe's 128 x 128 blocks)
local function feature_multiple(cfg) return cfg.blockwise and 128 or 16 end
-- recompute_weight: the weight's f8 copy for the input gradient made again
-- in the backward (true) rather than kept from the forward (false); 'auto':
-- when FSDP releases the weight after the forward (FULL_SHARD), so the f8
-- copy would keep a byte a parameter of every unit alive until its backward
-- tp_scales: under tensor parallelism, 'shard' scales each rank's shards by
-- their own amax (no collective); 'group' all-reduces the amax of every
-- sharded operand over the TP group first (torchao's DTensor behaviour: the
-- scales, hence the f8 bits, of the unsplit layer; axiswise, the amaxes of
-- the rows or columns that run along the split dim)

local function recipe_of(opts, level)
  opts = opts or {}
  local name = opts.recipe or 'tensorwise'
  local base = float8.recipes[name]
  if base == nil then
    local names = {}
    for k in pairs(float8.recipes) do names[#names + 1] = k end
    table.sort(names)
    error(('float8: unknown recipe %s (recipes: %s)'):format(tostring(name), table.concat(names, ', ')), level + 1)
  end
  local cfg = {}
  for k, v in pairs(base) do cfg[k] = v end
  for _, k in ipairs({ 'input', 'weight', 'grad_output' }) do
    if opts[k] ~= nil then
      local id = T.dtype_id(opts[k], level + 1)
      if id ~= 8 and id ~= 9 then
        error(('float8: %s must be f8e4m3 or f8e5m2, got %s'):format(k, tostring(opts[k])), level + 1)
      end
      cfg[k] = T.dtype_name(id)
    end
  end
  if opts.pow2 ~= nil then cfg.pow2 = opts.pow2 and true or false end
  if opts.recompute_weight ~= nil then
    local r = opts.recompute_weight
    if r ~= 'auto' and r ~= true and r ~= false then
      error(("float8: recompute_weight must be true, false or 'auto', got %s"):format(tostring(r)), level + 1)
    end
    cfg.recompute_weight = r
  end
  if opts.tp_scales ~= nil then
    if opts.tp_scales ~= 'group' and opts.tp_scales ~= 'shard' then
      error(("float8: tp_scales must be 'group' or 'shard', got %s"):format(tostring(opts.tp_scales)), level + 1)
    end
    cfg.tp_scales = opts.tp_scales
  end
  if cfg.blockwise and (cfg.input ~= 'f8e4m3' or cfg.weight ~= 'f8e4m3' or cfg.grad_output ~= 'f8e4m3') then
    error(('float8: the blockwise recipe takes f8e4m3 for every operand (cuBLASLt\'s block scaling), got input %s, '
      .. 'weight %s, grad_output %s'):format(cfg.input, cfg.weight, cfg.grad_output), level + 1)
  end
  if cfg.input == 'f8e5m2' and cfg.weight == 'f8e5m2' then
    error('float8: input and weight cannot both be f8e5m2 (no FP8 GEMM takes two e5m2 operands)', level + 1)
  end
  if cfg.grad_output == 'f8e5m2' and (cfg.input == 'f8e5m2' or cfg.weight == 'f8e5m2') then
    error('float8: grad_output f8e5m2 needs input and weight in f8e4m3 (its products take one e4m3 operand)',
      level + 1)
  end
  cfg.recipe = name
  return cfg
end
float8.config = function(opts) return recipe_of(opts, 2) end

-- ------------------------------------------------------------- the casts
-- x2's amax and the cast into the layouts wanted (one kernel on CUDA):
-- x2 (R, C) -> rows (R, C) and/or cols (C, R), inv, and the amax when asked
local function cast(x2, dtype, pow2, rows, cols, want_amax)
  return F.float8_cast_dynamic(x2, dtype, { rows = rows, cols = cols, pow2 = pow2, amax = want_amax })
end
-- the axiswise cast: rows (R, C) scaled per row, cols (C, R) per column of
-- x2: rows, cols, inv_rows (R), inv_cols (C)
local function cast_ax(x2, dtype, pow2, rows, cols)
  return F.float8_cast_axiswise(x2, dtype, { rows = rows, cols = cols, pow2 = pow2 })
end

-- the axiswise cast of x2 (as cast_ax) whose dim sdim (1 or 2; nil: none)
-- is split over group grp: the rows' amaxes (sdim 2) or the columns' (sdim
-- 1) all-reduced first, when that layout is asked
local function cast_ax_group(x2, dtype, pow2, rows, cols, grp, sdim)
  if grp == nil or not (sdim == 2 and rows or sdim == 1 and cols) then return cast_ax(x2, dtype, pow2, rows, cols) end
  local ra, ca = F.float8_amax_axiswise(x2, { rows = rows, cols = cols })
  local tpm = require 'moonshard.tp'
  if sdim == 2 then tpm.all_reduce_max(ra, grp) else tpm.all_reduce_max(ca, grp) end
  local r, c, ir, ic = F.float8_cast_axiswise(x2, dtype, { rows = rows, cols = cols, pow2 = pow2, row_amax = ra,
    col_amax = ca })
  free(ra); free(ca)
  return r, c, ir, ic
end
-- the group amax of x2 begun: tensorwise its amax, axiswise (rows) its
-- rows' amaxes, all-reduced over group beside the work that follows;
-- finish() waits for it (the current stream, not the host) and returns it
local function group_amax_begin(x2, group, rows)
  local a = rows and F.float8_amax_axiswise(x2) or F.amax(x2)
  local w = require('moonshard.tp').all_reduce_max_async(a, group)
  return { amax = a, work = w }
end
local function group_amax_finish(p)
  if p.work then p.work:wait(); p.work:free() end
  return p.amax
end
-- the tensorwise cast of x2 with its group's amax (the unsplit tensor's,
-- tp_scales = 'group'; a weight FSDP gathers): as cast()
local function cast_group(x2, dtype, pow2, rows, cols, want_amax, group)
  local a = F.amax(x2)
  require('moonshard.tp').all_reduce_max(a, group)
  local r, c, i = F.float8_cast(x2, a, dtype, { rows = rows, cols = cols, pow2 = pow2 })
  if not want_amax then free(a); a = nil end
  return r, c, i, a
end

-- counters for specs and benches: input casts made (a shared one counts
-- once) in the forward and again in the backward, and weights cast in the
-- forward or taken as gathered f8 (FSDP's float8_all_gather)
local stats = { input_casts = 0, backward_casts = 0, weight_casts = 0, gathered_weights = 0,
  weight_amax_reductions = 0 }
function float8.stats()
  return { input_casts = stats.input_casts, backward_casts = stats.backward_casts, weight_casts = stats.weight_casts,
    gathered_weights = stats.gathered_weights, weight_amax_reductions = stats.weight_amax_reductions }
end

-- tp_scales = 'group', the weights of a split model: tp.parallelize's
-- registry (reg: its split layers, in one order on every rank of the group)
-- keeps the amaxes of every group-scaled weight in one vector (tensorwise
-- one slot, axiswise the vector of the rows' or columns' amaxes that run
-- along the split dim), each local amax written into its slots and the
-- vector all-reduced once, again when a weight moved (its version: the
-- optimizer's step bumps them all, so the first layer of the next forward
-- refreshes the lot; a weight replaced, e.g. by :to(), too). FSDP's
-- gathered weights are written without a version bump: their layers take a
-- collective each (or the f8 gathers' reduced scales).
-- (the weight's split dim: the output features' for a column-parallel
-- layer, the input features' for a row-parallel one; Conv1D's weight is
-- (in, out))
local function split_dim(sh, wt)
  if sh.output then return wt and 1 or 2 end
  return wt and 2 or 1
end
local function group_weights(reg)
  local fs = package.loaded['moonshard.fsdp']
  local list = {}
  for _, m in ipairs(reg.mods) do
    local f, sh, w = rawget(m, '_float8'), rawget(m, '_tp_shard'), rawget(m, 'weight')
    if f ~= nil and sh ~= nil and f.config.tp_scales == 'group' and is_tensor(w) and w.ndim == 2
        and not (fs ~= nil and fs.manages(w)) then
      local e = { sh = sh, w = w, n = 1 }
      if f.config.axiswise then
        e.sdim = split_dim(sh, f.wt)
        e.n = tonumber(w.sizes[e.sdim == 2 and 0 or 1])   -- (rows reduced along dim 2, columns along dim 1)
      end
      list[#list + 1] = e
    end
  end
  return list
end
local function refresh_weight_amaxes(reg)
  local list = group_weights(reg)
  local st = reg.f8 or {}
  reg.f8 = st
  st.of = {}
  if #list == 0 then return end
  local dev, n = list[1].w.device_id, 0
  for _, e in ipairs(list) do
    if e.w.device_id ~= dev then return end   -- (no shared vector: a collective a layer)
    e.off = n
    n = n + e.n
  end
  if st.vec == nil or st.n ~= n or st.vec.device_id ~= dev then
    st.n = n
    st.vec = T.empty({ n }, { dtype = 'f32', device = list[1].w.device })
    st.views = {}
  end
  for _, e in ipairs(list) do
    -- (the slot views, made once per vector and layout)
    local key = e.off .. ':' .. e.n .. ':' .. tostring(e.sdim)
    local v = st.views[key]
    if v == nil then
      v = st.vec:narrow(1, e.off + 1, e.n)
      if not e.sdim then v = v:view({}) end
      st.views[key] = v
    end
    if e.sdim == nil then F.amax(e.w, v)
    elseif e.sdim == 2 then F.float8_amax_axiswise(e.w, { row_out = v })
    else F.float8_amax_axiswise(e.w, { rows = false, cols = true, col_out = v }) end
    st.of[e.sh] = { w = e.w, ver = e.w._version, amax = v, sdim = e.sdim }
  end
  require('moonshard.tp').all_reduce_max(st.vec, reg.group)
  stats.weight_amax_reductions = stats.weight_amax_reductions + 1
end
-- the group amaxes of weight w of the split layer whose _tp_shard is sh:
-- tensorwise the amax, axiswise the rows' (sdim 2) or columns' (sdim 1)
-- vector (an alias), and sdim; or nil (a collective of its own then)
local function group_weight_amax(sh, w)
  local reg = sh.reg
  if reg == nil then return nil end
  local e = reg.f8 and reg.f8.of[sh]
  if e == nil or not rawequal(e.w, w) or e.ver ~= w._version then
    refresh_weight_amaxes(reg)
    e = reg.f8.of[sh]
    if e == nil or not rawequal(e.w, w) then return nil end
  end
  return R.alias(e.amax), e.sdim
end

-- One cast of a tensor several layers read (q/k/v, gate/up): the last one
-- made, keyed by the tensor's storage, view and version (so another handle
-- of the same view finds it, and an in-place write misses it). The forward
-- keeps { rows, inv, amax } of the last input, the backward { cols, inv }
-- of the last saved input; both are dropped when a backward begins and ends.
local intptr = ffi.typeof('intptr_t')
-- the cache entry's fields for t (numbers: no string is built per call)
local function same_view(e, t, dtype, pow2, ax, grp)
  if e == nil or e.dtype ~= dtype or e.pow2 ~= pow2 or e.ax ~= ax or e.grp ~= grp or e.st ~= tonumber(ffi.cast(intptr, t.storage))
      or e.off ~= tonumber(t.offset) or e.ver ~= t._version or e.nd ~= t.ndim then
    return false
  end
  for d = 0, t.ndim - 1 do
    if e.sz[d] ~= tonumber(t.sizes[d]) or e.sd[d] ~= tonumber(t.strides[d]) then return false end
  end
  return true
end
-- (the entry holds an alias of t: its storage, whose address is in the key,
-- cannot be freed and the address reused by another tensor while cached)
local function view_entry(t, dtype, pow2, ax, grp)
  local e = { dtype = dtype, pow2 = pow2, ax = ax, grp = grp, st = tonumber(ffi.cast(intptr, t.storage)), off = tonumber(t.offset),
    ver = t._version, nd = t.ndim, sz = {}, sd = {}, src = R.alias(t) }
  for d = 0, t.ndim - 1 do e.sz[d], e.sd[d] = tonumber(t.sizes[d]), tonumber(t.strides[d]) end
  return e
end
local fwd_last, bwd_last = nil, nil
local function drop(e)
  if e == nil then return end
  for _, k in ipairs({ 'rows', 'cols', 'inv', 'amax', 'src' }) do free(e[k]) end
end
local function drop_caches()
  drop(fwd_last); drop(bwd_last)
  fwd_last, bwd_last = nil, nil
end
A.register_hook('backward_begin', drop_caches)
A.register_hook('backward_end', drop_caches)
float8.clear_cache = drop_caches

local function alias(t) return t ~= nil and R.alias(t) or nil end
-- an f8 weight's other layout (a tiled transpose kernel on CUDA)
local transposed = F.float8_transpose

-- the forward's cast of input rows x2: rows, inv, amax (aliases the caller
-- owns; axiswise: inv a vector, no amax); grp: the TP group whose amax
-- scales it (x2 a shard of the input), else nil, and pre that amax begun
-- (group_amax_begin) by the caller when the cache missed
local function cast_input(x2, cfg, grp, pre)
  local l, _ = fwd_last, nil
  if not same_view(l, x2, cfg.input, cfg.pow2, cfg.axiswise, grp) then
    drop(l)
    stats.input_casts = stats.input_casts + 1
    l = view_entry(x2, cfg.input, cfg.pow2, cfg.axiswise, grp)
    if pre and cfg.axiswise then
      local ra = group_amax_finish(pre)
      l.rows, _, l.inv = F.float8_cast_axiswise(x2, cfg.input, { pow2 = cfg.pow2, row_amax = ra })
      free(ra)
    elseif pre then
      l.amax = group_amax_finish(pre)
      l.rows, _, l.inv = F.float8_cast(x2, l.amax, cfg.input, { pow2 = cfg.pow2 })
    elseif cfg.axiswise then l.rows, _, l.inv = cast_ax(x2, cfg.input, cfg.pow2, true, false)
    else l.rows, _, l.inv, l.amax = cast(x2, cfg.input, cfg.pow2, true, false, true) end
    fwd_last = l
  end
  return alias(l.rows), alias(l.inv), alias(l.amax)
end

-- the backward's transposed cast of the saved input rows x2: cols, inv.
-- Tensorwise with the forward's amax (so the bits are the forward's);
-- axiswise scaled per column (per input feature: K is the token dim)
local function input_cols(x2, amax, cfg, grp)
  local l, _ = bwd_last, nil
  if not same_view(l, x2, cfg.input, cfg.pow2, cfg.axiswise, grp) then
    drop(l)
    stats.backward_casts = stats.backward_casts + 1
    l = view_entry(x2, cfg.input, cfg.pow2, cfg.axiswise, grp)
    if cfg.axiswise then _, l.cols, _, l.inv = cast_ax(x2, cfg.input, cfg.pow2, false, true)
    else _, l.cols, l.inv = F.float8_cast(x2, amax, cfg.input, { rows = false, cols = true, pow2 = cfg.pow2 }) end
    bwd_last = l
  end
  return alias(l.cols), alias(l.inv)
end

-- -------------------------------------------------------------- the layer
local function dims(t) return '(' .. table.concat(shape_of(t), ', ') .. ')' end

-- x as (N, last) and N
local function rows_of(x)
  local s = shape_of(x)
  local n = 1
  for i = 1, #s - 1 do n = n * s[i] end
  if x.ndim == 2 then return x, n end
  return R.reshape(x, { n, s[#s] }), n
end

local function low_or_f32(id) return id == 1 or id == 2 or id == 3 end

-- whether the FP8 path takes this call (else the plain linear runs)
local function fp8_fits(x, w, n, in_f, out_f)
  if x.device_id < 0 then return true end
  if x.dtype_id == 0 or w.dtype_id == 0 then return false end
  return n % 16 == 0 and in_f % 16 == 0 and out_f % 16 == 0
end

-- the weight gradient into its sink when the sink takes it (f32 or w's
-- dtype, on w's device, not held by a fused loss whose backward is due)
local function sink_of(node, w)
  local sink = A.grad_sink(node, 2)
  if not sink or type(sink.written[sink.i]) == 'table' then return nil end
  local sd = sink.t.dtype_id
  if sink.t.device_id ~= w.device_id or not (sd == 1 or sd == w.dtype_id) then return nil end
  return sink
end

-- the weight gradient in high precision (rowwise_with_gw_hp): g2ᵀ x2 (or
-- x2ᵀ g2 for Conv1D) in the output gradient's dtype with f32 accumulation,
-- as the plain linear makes it (into the weight's sink when it takes it);
-- else returned in w's dtype
local function weight_grad_hp(x2, g2, wt, sink, wdtype)
  local xc = x2.dtype_id == g2.dtype_id and x2 or R.to(x2, { dtype = g2.dtype_id })
  local dw = require('moonshard.nn.functional').weight_grad(xc, g2, wt, sink)
  if xc ~= x2 then free(xc) end
  if dw ~= nil and dw.dtype_id ~= wdtype then
    local c = R.to(dw, { dtype = wdtype })
    free(dw)
    dw = c
  end
  return dw
end

-- the weight gradient through an FP8 GEMM: (out, in) = g8t (out, N) @ x8t
-- (in, N)^T (Conv1D's (in, out) the other way), x8t the saved input's
-- transposed cast (input_cols) unless given; into sink when there is one
-- (nil returned), else in w's dtype (wd). Frees x8t and xinv.
local function weight_grad_f8(x2, xamax, xgrp, cfg, wt, g8t, ginv_t, x8t, xinv, sink, wd)
  if x8t == nil then x8t, xinv = input_cols(x2, xamax, cfg, xgrp) end
  local a, b, ainv, binv = g8t, x8t, ginv_t, xinv
  if not wt then a, b, ainv, binv = x8t, g8t, xinv, ginv_t end
  local dw
  if sink then
    F.scaled_matmul(a, b, ainv, binv, { out = sink.t, beta = sink.written[sink.i] and 1 or 0,
      fast_accum = cfg.fast_accum_grads })
    sink.written[sink.i] = true
  else
    dw = F.scaled_matmul(a, b, ainv, binv, { out_dtype = T.dtype_name(wd), fast_accum = cfg.fast_accum_grads })
  end
  free(x8t); free(xinv)
  return dw
end

local WONLY = { 2 }
-- whether nn.functional's affine layers defer now (nnf.defer_weight_grads:
-- tensor parallelism's row-parallel layers)
local function nnf_defers()
  local nnf = package.loaded['moonshard.nn.functional']
  return nnf ~= nil and nnf.weight_grads_deferred()
end

local function bwd_float8(node, g)
  local s, need = node.saved, node.need
  local cfg = s.cfg
  local g2 = rows_of(g)
  local want_w = need[2]
  local w8 = want_w and not cfg.gw_hp   -- (the weight gradient through an FP8 GEMM)
  local g8, g8t, ginv, ginv_t
  -- (a column-parallel layer's output gradient under the group's scales:
  -- its amax begun, and the saved input's transposed cast for dW made
  -- beside the all-reduce; axiswise only the rows, dx's, are split)
  local gpre, x8t, xinv
  if s.ggrp and (need[1] or w8) and (need[1] or not cfg.axiswise) then
    gpre = group_amax_begin(g2, s.ggrp, cfg.axiswise)
    if w8 then x8t, xinv = input_cols(s.x2, s.xamax, cfg, s.xgrp) end
  end
  if gpre and cfg.axiswise then
    local ra = group_amax_finish(gpre)
    g8, g8t, ginv, ginv_t = F.float8_cast_axiswise(g2, cfg.grad_output, { rows = need[1], cols = w8, pow2 = cfg.pow2,
      row_amax = ra })
    free(ra)
  elseif gpre then
    local a = group_amax_finish(gpre)
    g8, g8t, ginv = F.float8_cast(g2, a, cfg.grad_output, { rows = need[1], cols = w8, pow2 = cfg.pow2 })
    ginv_t = ginv
    free(a)
  elseif need[1] or w8 then   -- (nothing split along what is asked)
    if cfg.axiswise then g8, g8t, ginv, ginv_t = cast_ax(g2, cfg.grad_output, cfg.pow2, need[1], w8)
    else g8, g8t, ginv = cast(g2, cfg.grad_output, cfg.pow2, need[1], w8); ginv_t = ginv end
  end
  local dx, dw, db
  if need[1] then
    -- dx (N, in) = g8 (N, out) @ w8 [w8t (in, out) as b]; w8t cast again
    -- from the weight (tensorwise with its forward amax: the same bits;
    -- FSDP gathered it for this backward) when not kept
    local w_in, winv = s.w_in, s.winv_in
    local fs = package.loaded['moonshard.fsdp']
    local wg8, wg8inv
    if w_in == nil and s.f8g and fs ~= nil then wg8, wg8inv = fs.float8_weight(s.w) end
    if wg8 ~= nil then
      -- gathered again in f8 for this backward: the forward's bits
      w_in, winv = s.wt and transposed(wg8) or R.alias(wg8), R.alias(wg8inv)
    elseif w_in == nil and s.f8g then
      -- (the unit was gathered in full precision since: a cast of its own)
      local r, c, i
      if s.wgrp then r, c, i = cast_group(s.w, cfg.weight, cfg.pow2, not s.wt, s.wt, false, s.wgrp)
      else r, c, i = cast(s.w, cfg.weight, cfg.pow2, not s.wt, s.wt, false) end
      w_in, winv = s.wt and c or r, i
    elseif w_in == nil then
      if cfg.axiswise then
        local r, c, ir, ic = cast_ax_group(s.w, cfg.weight, cfg.pow2, not s.wt, s.wt, s.wgrp, s.wdim)
        w_in, winv = s.wt and c or r, s.wt and ic or ir
      else
        local r, c, i = F.float8_cast(s.w, s.wamax, cfg.weight, { rows = not s.wt, cols = s.wt, pow2 = cfg.pow2 })
        w_in, winv = s.wt and c or r, i
      end
    end
    local d2 = F.scaled_matmul(g8, w_in, ginv, winv,
      { out_dtype = T.dtype_name(s.dx_dtype), fast_accum = cfg.fast_accum_grads })
    if w_in ~= s.w_in then free(w_in); free(winv) end
    dx = R.reshape(d2, node.ishape[1])
    if dx ~= d2 then free(d2) end
  end
  if need[3] then db = F.sum(g2, 1) end
  if want_w then
    local sink = cfg.gw_hp and A.grad_sink(node, 2) or sink_of(node, s.w)
    local wd = s.w.dtype_id == 0 and 1 or s.w.dtype_id
    local wt, xgrp, hp, wdt = s.wt, s.xgrp, cfg.gw_hp, s.w.dtype_id
    if s.defer and A.deferrable() then
      -- the weight gradient later in this backward, beside the collective
      -- (A.defer; moonshard.tp): the closure owns what it reads (aliases
      -- of the saved input, the output gradient's cast for dW)
      local xa = R.alias(s.x2)
      local aa = s.xamax ~= nil and R.alias(s.xamax) or nil
      local ga = hp and R.alias(g2) or nil
      local ct, ci, xt, xi = nil, nil, x8t, xinv
      if not hp then
        ct, ci = g8t, ginv_t
        if ginv_t == ginv then ginv = nil end
        g8t, ginv_t = nil, nil
      end
      x8t, xinv = nil, nil
      A.defer(node, WONLY, function()
        local r
        if hp then r = weight_grad_hp(xa, ga, wt, sink, wdt)
        else r = weight_grad_f8(xa, aa, xgrp, cfg, wt, ct, ci, xt, xi, sink, wd) end
        free(xa); free(aa); free(ga); free(ct); free(ci)
        xt, xi = nil, nil
        return r
      end, function() free(xa); free(aa); free(ga); free(ct); free(ci); free(xt); free(xi) end)
    elseif hp then
      dw = weight_grad_hp(s.x2, g2, wt, sink, wdt)
    else
      dw = weight_grad_f8(s.x2, s.xamax, xgrp, cfg, wt, g8t, ginv_t, x8t, xinv, sink, wd)
    end
  end
  free(g8); free(g8t)
  if ginv_t ~= ginv then free(ginv_t) end
  free(ginv)
  if g2 ~= g then free(g2) end
  return dx, dw, db
end

-- ------------------------------------------------------- blockwise recipe
-- DeepSeek-V3's three products (docs/float8.md, "Blockwise"), each operand
-- scaled per block along its product's K:
--   y  (N, out) = x8 (N, in) 1x128       @ w8 (out, in) 128x128 ^T
--   dx (N, in)  = g8 (N, out) 1x128      @ w8t (in, out) 128x128 ^T
--   dw (out, in) = g8t (out, N) 1x128    @ x8t (in, N) 1x128 ^T
-- (x8t, g8t: the transposed layouts, blocks of 128 tokens: x's and g's
-- 128 x 1 blocks). The weight's 128 x 128 blocks are the same in both its
-- layouts (w8t is w8's bytes transposed, its scale grid transposed). The
-- forward saves the input (its transposed cast is made in the backward)
-- and w8t unless the weight is gathered again for the backward (FSDP
-- FULL_SHARD: recompute_weight 'auto'). Under FSDP's float8_all_gather
-- the weight's bytes and its blocks' inverse scales (of w8 and of w8t)
-- come gathered (fsdp.float8_weight): w8t is a transpose of the bytes,
-- nothing is cast from the weight. Layers reading one input share its
-- casts, each way (the cache of the other recipes).
local BLK = 128

-- the input's casts, shared by the layers reading one tensor (q/k/v,
-- gate/up) as the other recipes' are: the forward's 1x128 rows (x8, its
-- scales), the backward's transposed layout blocked along the tokens
local function blk_input_rows(x2, cfg)
  local l, _ = fwd_last, nil
  if not same_view(l, x2, cfg.input, cfg.pow2, 'blockwise', nil) then
    drop(l)
    stats.input_casts = stats.input_casts + 1
    l = view_entry(x2, cfg.input, cfg.pow2, 'blockwise', nil)
    l.rows, _, l.inv = F.float8_cast_blockwise(x2, cfg.input, { blocks = '1x128', pow2 = cfg.pow2 })
    fwd_last = l
  end
  return alias(l.rows), alias(l.inv)
end
local function blk_input_cols(x2, cfg)
  local l, _ = bwd_last, nil
  if not same_view(l, x2, cfg.input, cfg.pow2, 'blockwise', nil) then
    drop(l)
    stats.backward_casts = stats.backward_casts + 1
    l = view_entry(x2, cfg.input, cfg.pow2, 'blockwise', nil)
    _, l.cols, _, l.inv = F.float8_cast_blockwise(x2, cfg.input, { blocks = '1x128', rows = false, cols = true,
      pow2 = cfg.pow2 })
    bwd_last = l
  end
  return alias(l.cols), alias(l.inv)
end

local function bwd_blockwise(node, g)
  local s, need = node.saved, node.need
  local cfg = s.cfg
  local g2 = rows_of(g)
  local want_w = need[2]
  local g8, g8t, ginv, ginv_t
  if need[1] or want_w then
    g8, g8t, ginv, ginv_t = F.float8_cast_blockwise(g2, cfg.grad_output,
      { blocks = '1x128', rows = need[1], cols = want_w, pow2 = cfg.pow2 })
  end
  local dx, dw, db
  if need[1] then
    local w_in, winv = s.w_in, s.winv_in
    local fs = package.loaded['moonshard.fsdp']
    local wg8, wgi, wgit
    if w_in == nil and fs ~= nil then wg8, wgi, wgit = fs.float8_weight(s.w) end
    if wg8 ~= nil and wgit ~= nil and wg8.dtype == cfg.weight then
      -- gathered again in f8 for this backward (float8_all_gather): the
      -- forward's bytes, transposed, and the transposed scale grid
      stats.gathered_weights = stats.gathered_weights + 1
      if s.wt then w_in, winv = transposed(wg8), R.alias(wgit) else w_in, winv = R.alias(wg8), R.alias(wgi) end
    elseif w_in == nil then   -- (made again from the weight FSDP gathered for this backward)
      stats.weight_casts = stats.weight_casts + 1
      local r, c, ir, ic = F.float8_cast_blockwise(s.w, cfg.weight,
        { blocks = '128x128', rows = not s.wt, cols = s.wt, pow2 = cfg.pow2 })
      if s.wt then w_in, winv = c, ic else w_in, winv = r, ir end
    end
    local d2 = F.scaled_matmul(g8, w_in, ginv, winv, { out_dtype = T.dtype_name(s.dx_dtype), a_blocks = '1x128',
      b_blocks = '128x128' })
    if w_in ~= s.w_in then free(w_in); free(winv) end
    dx = R.reshape(d2, node.ishape[1])
    if dx ~= d2 then free(d2) end
  end
  if need[3] then db = F.sum(g2, 1) end
  if want_w then
    local x8t, xinv_t = blk_input_cols(s.x2, cfg)
    local a, bm, ainv, binv = g8t, x8t, ginv_t, xinv_t
    if not s.wt then a, bm, ainv, binv = x8t, g8t, xinv_t, ginv_t end   -- (Conv1D's (in, out))
    local sink = sink_of(node, s.w)
    if sink then
      F.scaled_matmul(a, bm, ainv, binv, { out = sink.t, beta = sink.written[sink.i] and 1 or 0, a_blocks = '1x128',
        b_blocks = '1x128' })
      sink.written[sink.i] = true
    else
      local wd = s.w.dtype_id == 0 and 1 or s.w.dtype_id
      dw = F.scaled_matmul(a, bm, ainv, binv, { out_dtype = T.dtype_name(wd), a_blocks = '1x128', b_blocks = '1x128' })
    end
    free(x8t); free(xinv_t)
  end
  free(g8); free(g8t); free(ginv); free(ginv_t)
  if g2 ~= g then free(g2) end
  return dx, dw, db
end

-- the blockwise layer (float8.linear with a blockwise config; its checks
-- done): y, or the plain linear's where the FP8 path cannot take the call

-- a float8 product's output: y2 (rows, out_f) of dtype od, with the bias b
-- added when the GEMM did not take it (bias nil), in f64 for an f64 x (the
-- CPU's f64 models: f32 math, f64 out), viewed with x's leading dims
local function product_out(y2, x, b, bias, od, out_f)
  if b ~= nil and bias == nil then
    local bc = R.to(b, { dtype = od, device = x.device_id })
    F.add_(y2, bc)
    if bc ~= b then free(bc) end
  end
  if x.dtype_id == 0 then
    local y64 = R.to(y2, { dtype = 'f64' })
    free(y2)
    y2 = y64
  end
  if x.ndim == 2 then return y2 end
  local sh = shape_of(x)
  sh[#sh] = out_f
  local y = R.view(y2, sh)
  free(y2)
  return y
end
local function linear_blockwise(x, w, b, cfg, wt, in_f, out_f, name)
  if in_f % BLK ~= 0 or out_f % BLK ~= 0 then
    error(("%s: the blockwise recipe needs in and out features multiples of 128 (the weight's 128 x 128 blocks), "
      .. "got weight %s %s, input %s"):format(name, dims(w), wt and '(out, in)' or '(in, out)', dims(x)), 3)
  end
  local x2, n = rows_of(x)
  local fs = package.loaded['moonshard.fsdp']
  -- on CUDA the token count must be a multiple of 128 too (the weight
  -- gradient's K), and f64 has no FP8 path: the plain linear then
  if x.device_id >= 0 and (n % BLK ~= 0 or x.dtype_id == 0 or w.dtype_id == 0) then
    if x2 ~= x then free(x2) end
    -- (a weight gathered in f8 only: its values written from the f8 copy)
    if fs ~= nil then fs.float8_materialize(w) end
    local nnf = require 'moonshard.nn.functional'
    return (wt and nnf.linear or nnf.conv1d_linear)(x, w, b)
  end
  local od = amp.dtype() or x.dtype_id
  if od == 0 then od = 1 end
  local grad = A.want(x, w, b)
  local need_x = grad and A.needs_grad(x)
  local recompute = cfg.recompute_weight
  if recompute == 'auto' then recompute = fs ~= nil and fs.releases_after_forward(w) end
  local keep = need_x and not recompute
  -- FSDP's float8 all-gather: the weight's f8 bytes and its blocks' scales
  -- (of w and of its transpose) came gathered
  local g8, g8inv, g8inv_t
  if fs ~= nil then g8, g8inv, g8inv_t = fs.float8_weight(w) end
  if g8 ~= nil and (g8inv_t == nil or g8.dtype ~= cfg.weight) then g8 = nil end
  local w_out, winv, w_in, winv_in
  if g8 ~= nil then
    stats.gathered_weights = stats.gathered_weights + 1
    if wt then
      w_out, winv = R.alias(g8), R.alias(g8inv)
      if keep then w_in, winv_in = transposed(g8), R.alias(g8inv_t) end
    else
      w_out, winv = transposed(g8), R.alias(g8inv_t)
      -- (the gathered buffer may be released before the backward)
      if keep then w_in, winv_in = R.clone(g8), R.alias(g8inv) end
    end
  else
    -- the weight's 128 x 128 blocks: (out, in) for y, (in, out) for dx
    stats.weight_casts = stats.weight_casts + 1
    local r, c, ir, ic = F.float8_cast_blockwise(w, cfg.weight,
      { blocks = '128x128', rows = wt or keep, cols = not wt or keep, pow2 = cfg.pow2 })
    if wt then w_out, winv, w_in, winv_in = r, ir, c, ic else w_out, winv, w_in, winv_in = c, ic, r, ir end
  end
  local x8, xinv = blk_input_rows(x2, cfg)
  local bias = (b ~= nil and b.dtype_id == od and b.device_id == x.device_id) and b or nil
  local y2 = F.scaled_matmul(x8, w_out, xinv, winv, { out_dtype = T.dtype_name(od), bias = bias, a_blocks = '1x128',
    b_blocks = '128x128' })
  free(x8); free(xinv); free(w_out); free(winv)
  local y = product_out(y2, x, b, bias, od, out_f)
  if grad then
    local xs = x2
    if x2 == x then xs = R.alias(x) end
    local own = { xs }
    if w_in ~= nil then own[#own + 1] = w_in; own[#own + 1] = winv_in end
    A.record_list(name, y, bwd_blockwise, { x2 = xs, w_in = w_in, winv_in = winv_in, w = w, wt = wt, cfg = cfg,
      dx_dtype = x.dtype_id == 0 and 1 or x.dtype_id }, own, { x, w, b })
  else
    if x2 ~= x then free(x2) end
    free(w_in); free(winv_in)
  end
  return y
end

-- float8.linear(x (..., in), w, b?, opts?) -> y (..., out): x @ w^T + b
-- with w (out, in), or x @ w + b with opts.wt == false (w (in, out), GPT-2's
-- Conv1D); opts: a recipe's fields (float8.config), or opts.config made by
-- it; opts.tp = { group =, input = bool, output = bool }: w is a shard of a
-- tensor-parallel layer (x too when input, the output's features when
-- output), whose amaxes (axiswise: those along the split dim) the config's
-- tp_scales = 'group' takes over the group; opts.tp.reg, tp.parallelize's
-- registry of the split layers, lets the weights' be reduced once a step
function float8.linear(x, w, b, opts)
  opts = opts or {}
  local cfg = opts.config or recipe_of(opts, 2)
  local wt = opts.wt ~= false
  local name = 'float8_linear'
  if not is_tensor(x) or not is_tensor(w) then
    error(('%s: expected tensors for the input and the weight, got %s and %s'):format(name, type(x), type(w)), 2)
  end
  if w.ndim ~= 2 then
    error(('%s: weight must be 2-D %s, got %s'):format(name, wt and '(out, in)' or '(in, out)', dims(w)), 2)
  end
  local in_f, out_f = tonumber(w.sizes[wt and 1 or 0]), tonumber(w.sizes[wt and 0 or 1])
  if x.ndim < 1 or tonumber(x.sizes[x.ndim - 1]) ~= in_f then
    error(('%s: input of shape %s does not end in in_features = %d (weight %s)'):format(name, dims(x), in_f, dims(w)),
      2)
  end
  if b ~= nil and (not is_tensor(b) or b.ndim ~= 1 or tonumber(b.sizes[0]) ~= out_f) then
    error(('%s: bias of shape %s for out_features = %d'):format(name, is_tensor(b) and dims(b) or type(b), out_f), 2)
  end
  if not low_or_f32(x.dtype_id) and x.dtype_id ~= 0 or not low_or_f32(w.dtype_id) and w.dtype_id ~= 0 then
    error(('%s: input and weight must be float tensors, got %s and %s'):format(name, x.dtype, w.dtype), 2)
  end
  if x.device_id ~= w.device_id then
    error(('%s: input on %s, weight on %s'):format(name, x.device, w.device), 2)
  end
  if cfg.blockwise then
    local y = linear_blockwise(x, w, b, cfg, wt, in_f, out_f, name)
    return y
  end
  local x2, n = rows_of(x)
  local fs = package.loaded['moonshard.fsdp']
  if not fp8_fits(x, w, n, in_f, out_f) then
    if x2 ~= x then free(x2) end
    -- (a weight gathered in f8 only: its values written from the f8 copy)
    if fs ~= nil and not cfg.axiswise then fs.float8_materialize(w) end
    local nnf = require 'moonshard.nn.functional'
    return (wt and nnf.linear or nnf.conv1d_linear)(x, w, b)
  end
  -- the output's dtype: the region's, else x's (f64 computes in f32)
  local od = amp.dtype() or x.dtype_id
  if od == 0 then od = 1 end
  local grad = A.want(x, w, b)
  local need_x = grad and A.needs_grad(x)
  -- tp_scales = 'group': the groups over which the shards' amaxes are taken
  local tpo = opts.tp
  local wgrp, xgrp, ggrp, wdim
  if tpo ~= nil and cfg.tp_scales == 'group' and tpo.group ~= nil and tpo.group:size() > 1 then
    wgrp = tpo.group
    xgrp = tpo.input and wgrp or nil
    ggrp = tpo.output and wgrp or nil
    wdim = split_dim(tpo, wt)
  end
  -- (the input's group amax begun here, its all-reduce beside the weight's
  -- cast, when the cache misses)
  local xpre
  if xgrp and not same_view(fwd_last, x2, cfg.input, cfg.pow2, cfg.axiswise, xgrp) then
    xpre = group_amax_begin(x2, xgrp, cfg.axiswise)
  end
  -- w's two layouts: (out, in) for the forward, (in, out) for dx (kept,
  -- or made again in the backward: recompute_weight)
  local recompute = cfg.recompute_weight
  if recompute == 'auto' then recompute = fs ~= nil and fs.releases_after_forward(w) end
  local keep = need_x and not recompute
  local w_out, w_in, winv, winv_in, wamax
  -- FSDP's float8 all-gather: the weight's f8 copy and scale came gathered
  local g8, g8inv
  if fs ~= nil and not cfg.axiswise then g8, g8inv = fs.float8_weight(w) end
  if g8 ~= nil and g8.dtype ~= cfg.weight then g8 = nil end
  if g8 ~= nil and wgrp ~= nil and not fs.float8_group_scaled(w, wgrp) then
    error(("%s: the weight %s came gathered in f8 with scales of its TP shard, the config asks tp_scales = 'group' "
      .. "(convert before fully_shard)"):format(name, dims(w)), 2)
  end
  if g8 ~= nil then
    stats.gathered_weights = stats.gathered_weights + 1
    if wt then
      w_out = R.alias(g8)
      if keep then w_in = transposed(g8) end
    else
      w_out = transposed(g8)
      if keep then w_in = R.clone(g8) end   -- (the gathered buffer may be released before the backward)
    end
    winv = R.alias(g8inv)
    winv_in = winv
  elseif cfg.axiswise then
    stats.weight_casts = stats.weight_casts + 1
    -- the forward's layout scaled per output feature, dx's per input one
    -- (each along its product's K); made again in the backward when not kept
    local ir, ic
    -- (tp_scales = 'group': the split dim's amaxes from the model's vector,
    -- reduced once a step, else a collective of this layer's own)
    local wa, sdim
    if wgrp then wa, sdim = group_weight_amax(tpo, w) end
    if wa ~= nil then
      local rows, cols = wt or keep, not wt or keep
      local r, c
      r, c, ir, ic = F.float8_cast_axiswise(w, cfg.weight, { rows = rows, cols = cols, pow2 = cfg.pow2,
        row_amax = sdim == 2 and wa or nil, col_amax = sdim == 1 and wa or nil })
      free(wa)
      if wt then w_out, w_in, winv, winv_in = r, c, ir, ic else w_in, w_out, winv, winv_in = r, c, ic, ir end
    elseif wt then w_out, w_in, ir, ic = cast_ax_group(w, cfg.weight, cfg.pow2, true, keep, wgrp, wdim); winv, winv_in = ir, ic
    else w_in, w_out, ir, ic = cast_ax_group(w, cfg.weight, cfg.pow2, keep, true, wgrp, wdim); winv, winv_in = ic, ir end
  else
    stats.weight_casts = stats.weight_casts + 1
    local want_amax = need_x and recompute   -- (to make the copy again in the backward)
    -- (tp_scales = 'group': the split model's weight amaxes, reduced once a
    -- step, else a collective of this layer's own)
    local wa = wgrp and group_weight_amax(tpo, w) or nil
    if wa ~= nil then
      local r, c
      r, c, winv = F.float8_cast(w, wa, cfg.weight, { rows = wt or keep, cols = not wt or keep, pow2 = cfg.pow2 })
      if wt then w_out, w_in = r, c else w_in, w_out = r, c end
      if want_amax then wamax = R.clone(wa) end   -- (the vector is rewritten after the next step)
      free(wa)
    elseif wgrp then
      if wt then w_out, w_in, winv, wamax = cast_group(w, cfg.weight, cfg.pow2, true, keep, want_amax, wgrp)
      else w_in, w_out, winv, wamax = cast_group(w, cfg.weight, cfg.pow2, keep, true, want_amax, wgrp) end
    elseif wt then w_out, w_in, winv, wamax = cast(w, cfg.weight, cfg.pow2, true, keep, want_amax)
    else w_in, w_out, winv, wamax = cast(w, cfg.weight, cfg.pow2, keep, true, want_amax) end
    winv_in = winv
  end
  local x8, xinv, xamax = cast_input(x2, cfg, xgrp, xpre)
  local bias = (b ~= nil and b.dtype_id == od and b.device_id == x.device_id) and b or nil
  local y2 = F.scaled_matmul(x8, w_out, xinv, winv, { out_dtype = T.dtype_name(od), bias = bias,
    fast_accum = cfg.fast_accum_output })
  free(x8); free(w_out)
  local y = product_out(y2, x, b, bias, od, out_f)
  if grad then
    -- saved: the input itself (its transposed f8 copy is made in the
    -- backward, with this amax: the tensor is kept for the backward anyway,
    -- so an f8 copy beside it would be memory on top), the weight's f8 copy
    -- for dx (or its amax to make it again), the scales
    local own = { xinv, winv }
    if xamax ~= nil then own[#own + 1] = xamax end
    if winv_in ~= winv then own[#own + 1] = winv_in end
    local xs = x2
    if x2 == x then xs = R.alias(x) end
    own[#own + 1] = xs
    if w_in ~= nil then own[#own + 1] = w_in end
    if wamax ~= nil then own[#own + 1] = wamax end
    local saved = { x2 = xs, xamax = xamax, w_in = w_in, winv_in = w_in ~= nil and winv_in or nil, wamax = wamax,
      w = w, wt = wt, cfg = cfg, dx_dtype = x.dtype_id == 0 and 1 or x.dtype_id, f8g = g8 ~= nil,
      xgrp = xgrp, ggrp = ggrp, wgrp = wgrp, wdim = wdim,
      defer = nnf_defers() or A.defers_readers(x) }
    A.record_list(name, y, bwd_float8, saved, own, { x, w, b })
  else
    if x2 ~= x then free(x2) end
    free(xinv); free(xamax); free(w_in); free(winv); free(wamax)
    if winv_in ~= winv then free(winv_in) end
  end
  return y
end

-- ------------------------------------------------------------- conversion
local function layer_forward(self, x)
  local f = rawget(self, '_float8')
  return float8.linear(x, self.weight, self.bias, { config = f.config, wt = f.wt, tp = rawget(self, '_tp_shard') })
end

local function matches(name, pats)
  for _, p in ipairs(pats) do
    local ok, hit = pcall(string.find, name, p)
    if not ok then error(('float8.convert: bad pattern %s: %s'):format(tostring(p), tostring(hit)), 4) end
    if hit then return true end
  end
  return false
end

-- float8.convert(model, opts?) -> names: every nn.Linear / nn.Conv1D of the
-- model computes in FP8 (float8.linear) except
--   * the LM head (the module holding model:head_weight(): the fused
--     cross-entropy reads that weight itself; torchtitan keeps the output
--     layer in bf16 too),
--   * layers whose in or out features are not multiples of 16 (the FP8
--     GEMMs' rule; 128 for blockwise, its weight blocks; a tensor-parallel
--     layer's own shard's), and modules with
--     a forward of their own (LoRA; not tensor parallelism's, which take the
--     FP8 product: tp.parallelize before or after convert),
--   * names matching opts.skip (Lua patterns), or for which
--     opts.filter(name, module) returns false.
-- opts also takes a recipe's fields (recipe = 'tensorwise', input, weight,
-- grad_output, pow2, recompute_weight, tp_scales). Returns the qualified names converted; an error when
-- there are none. Parameters are not touched (float8.revert undoes it).
function float8.convert(model, opts)
  opts = opts or {}
  local nn = require 'moonshard.nn'
  if not nn.is_module(model) then error('float8.convert: model must be a module', 2) end
  local cfg = recipe_of(opts, 2)
  local skip = opts.skip or {}
  if type(skip) == 'string' then skip = { skip } end
  local head = type(model.head_weight) == 'function' and model:head_weight() or nil
  local names = {}
  -- (a mixture of experts' routed experts run in its own loop, which reads
  -- their weights and computes in the compute dtype; its router keeps full
  -- precision: neither converted)
  local moe_prefix = {}
  for name, m in model:named_modules() do
    if nn.MoE and getmetatable(m) == nn.MoE then
      local pre = name == '' and '' or name .. '.'
      moe_prefix[#moe_prefix + 1] = pre .. 'experts.'
      moe_prefix[#moe_prefix + 1] = pre .. m.router_name
    end
  end
  local function in_moe(name)
    for _, p in ipairs(moe_prefix) do if name:sub(1, #p) == p then return true end end
    return false
  end
  for name, m in model:named_modules() do
    local cls = getmetatable(m)
    if (cls == nn.Linear or cls == nn.Conv1D) and rawget(m, '_float8') == nil and not in_moe(name) then
      local w = m.weight
      -- (the weight's own dims: a tensor-parallel layer's are its shard's)
      local ws = w.shape
      -- a tensor-parallel layer (tp.parallelize's forward, which calls
      -- float8.linear for its local product) keeps its forward
      local tpf = rawget(m, '_tp') ~= nil and rawget(m, 'forward') ~= nil
      local ok = (rawget(m, 'forward') == nil or tpf) and (head == nil or not rawequal(w, head))
        and #ws == 2 and ws[1] % feature_multiple(cfg) == 0 and ws[2] % feature_multiple(cfg) == 0
        and not matches(name, skip)
      if ok and opts.filter then ok = opts.filter(name, m) and true or false end
      if ok then
        rawset(m, '_float8', { config = cfg, wt = cls == nn.Linear, own_forward = not tpf })
        if not tpf then rawset(m, 'forward', layer_forward) end
        names[#names + 1] = name
      end
    end
  end
  if #names == 0 then
    error(('float8.convert: no nn.Linear or nn.Conv1D of the model can be converted (features multiples of %d, '
      .. 'not the LM head, not skipped or filtered out)'):format(feature_multiple(cfg)), 2)
  end
  return names
end

-- float8.revert(model) -> names: the converted layers compute in their own
-- dtype again
function float8.revert(model)
  local names = {}
  for name, m in model:named_modules() do
    local f = rawget(m, '_float8')
    if f ~= nil then
      rawset(m, '_float8', nil)
      if rawget(m, 'forward') == layer_forward then rawset(m, 'forward', nil) end
      names[#names + 1] = name
    end
  end
  drop_caches()
  return names
end

-- float8.converted(module) -> its recipe config, or nil
function float8.converted(m) return rawget(m, '_float8') and rawget(m, '_float8').config or nil end

return float8
