-- moonshard.ops — tensor operations, functional forms (no autograd).
--
--   local F = require 'moonshard.ops'
--   local y = F.add(x, 1)                -- or x:add(1), or x + 1
--   local v, i = F.max(x, -1)            -- values and indices along the last dim
--   local p = F.softmax(logits, -1)
--   local c = F.matmul(a, b, false, true) -- a @ b^T without a copy
--
-- Every op is also a Tensor method (x:sum(2), x:matmul(w)), and add_, sub_,
-- mul_, div_ write into their first operand. The autograd layer wraps these.
--
-- Conventions: dims are 1-based (1 is the first, -1 the last); index values
-- (index_select, gather, argmax, ...) are 0-based ids, as in the C core and in
-- PyTorch. A Lua number may stand for either operand of a binary op. Errors
-- are raised with the C core's message, which names the op and the shapes,
-- dtypes and devices involved.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local C = T.C

local F = {}

local box_t = ffi.typeof('ms_tensor*[1]')
local tensor_list_t = ffi.typeof('ms_tensor*[?]')
local is_tensor, wrap = T.is_tensor, T.wrap
local ALL_DIMS = -1000
local NAN = 0 / 0

-- ----------------------------------------------------------------- helpers

-- error(msg) at the first caller outside lua/moonshard/ (the user's line,
-- also when a wrapper tail-called or the call came through an operator or
-- the autograd layer)
local function raise(msg)
  local level = 2
  while true do
    local info = debug.getinfo(level, 'S')
    if not info then level = 1; break end
    if info.what == 'C' or not info.source:find('moonshard/[%w_/]*%.lua$') then break end
    level = level + 1
  end
  error(msg, level)
end
-- (also for the modules whose errors point at the user's line the same way:
-- moonshard.flce, moonshard.jsd)
F.raise = raise

-- cfn(box, ...) into a new tensor; errors point at the caller of the op
local function run(cfn, ...)
  local box = box_t()
  if cfn(box, ...) ~= 0 then raise(ffi.string(C.ms_last_error())) end
  return wrap(box[0])
end

-- cfn(box, ...) with the box pre-set to `out` (in place); returns out
local function run_into(out, cfn, ...)
  local box = box_t()
  box[0] = out
  if cfn(box, ...) ~= 0 then raise(ffi.string(C.ms_last_error())) end
  return out
end

-- rc of an in-place C call
local function check(rc)
  if rc ~= 0 then raise(ffi.string(C.ms_last_error())) end
end

-- The C core names dims 0-based; for an op given the Lua dim d (C dim cd),
-- its message names the dim as the caller wrote it.
local function dim_error(cd, d)
  local msg = ffi.string(C.ms_last_error())
  msg = (msg .. ' '):gsub('dim ' .. cd .. '([^%d])', 'dim ' .. d .. '%1')
  return msg:sub(1, -2)
end

-- run() and check() for ops that take a dim
local function run_dim(cd, d, cfn, ...)
  local box = box_t()
  if cfn(box, ...) ~= 0 then raise(dim_error(cd, d)) end
  return wrap(box[0])
end
local function check_dim(cd, d, rc)
  if rc ~= 0 then raise(dim_error(cd, d)) end
end

local function need_tensor(name, x, what)
  if not is_tensor(x) then
    raise(('%s: expected a tensor for %s, got %s'):format(name, what or 'the input', type(x)))
  end
  return x
end

local function flag(b) return (b and b ~= 0) and 1 or 0 end

-- Lua dim (1-based, negatives from the end) -> C dim, naming the op on error
local function dim_of(name, t, d, ndim_plus)
  local n = t.ndim + (ndim_plus or 0)
  if type(d) ~= 'number' or d ~= math.floor(d) then
    raise(('%s: dim must be an integer, got %s'):format(name, tostring(d)))
  end
  if d > 0 and d <= n then return d - 1 end
  if d < 0 and d >= -n then return n + d end
  raise(('%s: dim %d out of range for a tensor of %d dims (use 1..%d or -%d..-1)'):format(name, d, t.ndim, n, n))
end

-- an index argument: a tensor of i64/i32 ids, or a Lua table of 0-based ids
local function index_arg(name, idx)
  if is_tensor(idx) then return idx end
  if type(idx) == 'table' then return T.tensor(idx, { dtype = 'i64' }) end
  raise(('%s: expected an index tensor or a table of ids, got %s'):format(name, type(idx)))
end

-- ------------------------------------------------------------------- unary

local unary_ops = {
  neg = C.MS_OP_NEG, exp = C.MS_OP_EXP, log = C.MS_OP_LOG, sqrt = C.MS_OP_SQRT,
  rsqrt = C.MS_OP_RSQRT, tanh = C.MS_OP_TANH, sigmoid = C.MS_OP_SIGMOID, relu = C.MS_OP_RELU,
  gelu = C.MS_OP_GELU, silu = C.MS_OP_SILU, abs = C.MS_OP_ABS, sin = C.MS_OP_SIN,
  cos = C.MS_OP_COS, square = C.MS_OP_SQUARE, reciprocal = C.MS_OP_RECIP, sign = C.MS_OP_SIGN,
}
for name, id in pairs(unary_ops) do
  F[name] = function(a)
    need_tensor(name, a)
    return run(C.ms_unary, id, a)
  end
end

-- ------------------------------------------------------------------ binary

local binary_ops = {
  add = C.MS_OP_ADD, sub = C.MS_OP_SUB, mul = C.MS_OP_MUL, div = C.MS_OP_DIV, pow = C.MS_OP_POW,
  maximum = C.MS_OP_MAXIMUM, minimum = C.MS_OP_MINIMUM,
  eq = C.MS_OP_EQ, ne = C.MS_OP_NE, lt = C.MS_OP_LT, le = C.MS_OP_LE, gt = C.MS_OP_GT, ge = C.MS_OP_GE,
}

local function scalar_of(name, x)
  if type(x) == 'number' then return x end
  if type(x) == 'boolean' then return x and 1 or 0 end
  raise(('%s: expected a tensor or a number, got %s'):format(name, type(x)))
end

-- a op b into a new tensor (out == nil) or into out
local function binary(name, id, a, b, out)
  local ta, tb = is_tensor(a), is_tensor(b)
  local box = box_t()
  box[0] = out
  local rc
  if ta and tb then rc = C.ms_binary(box, id, a, b)
  elseif ta then rc = C.ms_binary_scalar(box, id, a, scalar_of(name, b), 0)
  elseif tb then rc = C.ms_binary_scalar(box, id, b, scalar_of(name, a), 1)
  else
    raise(('%s: expected at least one tensor, got %s and %s'):format(name, type(a), type(b)))
  end
  if rc ~= 0 then
    local msg = ffi.string(C.ms_last_error())
    if out ~= nil then msg = msg:gsub('^%a+:', name .. ':') end -- name the in-place form
    raise(msg)
  end
  if out ~= nil then return out end
  return wrap(box[0])
end

for name, id in pairs(binary_ops) do
  F[name] = function(a, b) return binary(name, id, a, b, nil) end
end

-- in place: a op= b (a keeps its shape and dtype)
for _, name in ipairs({ 'add', 'sub', 'mul', 'div' }) do
  local id = binary_ops[name]
  F[name .. '_'] = function(a, b)
    need_tensor(name .. '_', a, 'the destination')
    return binary(name .. '_', id, a, b, a)
  end
end

-- activation backward helpers: grad * f'(x)
local backward_ops = {
  gelu_backward = C.MS_OP_GELU_BWD, silu_backward = C.MS_OP_SILU_BWD,
  sigmoid_backward = C.MS_OP_SIGMOID_BWD, tanh_backward = C.MS_OP_TANH_BWD,
  relu_backward = C.MS_OP_RELU_BWD,
}
for name, id in pairs(backward_ops) do
  F[name] = function(x, g)
    need_tensor(name, x, 'x')
    need_tensor(name, g, 'the gradient')
    return run(C.ms_binary, id, x, g)
  end
end

-- swiglu(gate, up) = silu(gate) * up in one pass (broadcasting as mul)
function F.swiglu(gate, up)
  need_tensor('swiglu', gate, 'the gate')
  need_tensor('swiglu', up, 'up')
  return run(C.ms_binary, C.MS_OP_SWIGLU, gate, up)
end

-- clamp(a, lo, hi): a missing bound is no bound
function F.clamp(a, lo, hi)
  need_tensor('clamp', a)
  return run(C.ms_clamp, a, lo == nil and NAN or lo, hi == nil and NAN or hi)
end

-- where(cond, a, b): a and b may be numbers
function F.where(cond, a, b)
  need_tensor('where', cond, 'the condition')
  local ref = is_tensor(a) and a or (is_tensor(b) and b or nil)
  local function as_tensor(x)
    if is_tensor(x) then return x end
    local v = scalar_of('where', x)
    return T.full({}, v, { dtype = ref and ref.dtype_id or 'f32', device = cond.device_id })
  end
  return run(C.ms_where, cond, as_tensor(a), as_tensor(b))
end

-- -------------------------------------------------------------- reductions

local function reduce(name, id, a, dim, keepdim)
  need_tensor(name, a)
  if dim == nil then return run(C.ms_reduce, id, a, ALL_DIMS, flag(keepdim)) end
  local cd = a.ndim == 0 and -1 or dim_of(name, a, dim)
  return run_dim(cd, dim, C.ms_reduce, id, a, cd, flag(keepdim))
end

local reduce_ops = {
  sum = C.MS_RED_SUM, mean = C.MS_RED_MEAN, argmax = C.MS_RED_ARGMAX, argmin = C.MS_RED_ARGMIN,
  logsumexp = C.MS_RED_LOGSUMEXP, prod = C.MS_RED_PROD,
}
for name, id in pairs(reduce_ops) do
  F[name] = function(a, dim, keepdim) return reduce(name, id, a, dim, keepdim) end
end

-- max(a) -> value; max(a, dim[, keepdim]) -> values, indices; max(a, b) -> maximum
local function extremum(name, vid, iid, pair)
  return function(a, dim, keepdim)
    if is_tensor(dim) then return binary(name, pair, a, dim, nil) end
    if dim == nil then return reduce(name, vid, a, nil, keepdim) end
    return reduce(name, vid, a, dim, keepdim), reduce(name, iid, a, dim, keepdim)
  end
end
F.max = extremum('max', C.MS_RED_MAX, C.MS_RED_ARGMAX, C.MS_OP_MAXIMUM)
F.min = extremum('min', C.MS_RED_MIN, C.MS_RED_ARGMIN, C.MS_OP_MINIMUM)

-- softmax(a, dim = -1), log_softmax(a, dim = -1)
function F.softmax(a, dim)
  need_tensor('softmax', a)
  local d = a.ndim == 0 and -1 or dim_of('softmax', a, dim or -1)
  return run(C.ms_softmax, a, d, 0)
end
function F.log_softmax(a, dim)
  need_tensor('log_softmax', a)
  local d = a.ndim == 0 and -1 or dim_of('log_softmax', a, dim or -1)
  return run(C.ms_softmax, a, d, 1)
end
-- gradient wrt the input of softmax (log = false) or log_softmax (log = true),
-- from its output y and the incoming gradient g
function F.softmax_backward(y, g, dim, log)
  need_tensor('softmax_backward', y, 'the output')
  need_tensor('softmax_backward', g, 'the gradient')
  local d = y.ndim == 0 and -1 or dim_of('softmax_backward', y, dim or -1)
  return run(C.ms_softmax_backward, y, g, d, flag(log))
end

-- ------------------------------------------------------------------ matmul

-- matmul(a, b, transa, transb): numpy.matmul of op(a), op(b), where trans
-- swaps the last two dims (read in place: no copy)
function F.matmul(a, b, transa, transb)
  need_tensor('matmul', a, 'a')
  need_tensor('matmul', b, 'b')
  return run(C.ms_matmul, a, b, flag(transa), flag(transb))
end

-- matmul_bias(a, b, transa, transb, bias): 2-D op(a) @ op(b) + bias (N) on
-- every row, in the GEMM's epilogue on CUDA when cuBLASLt has one
function F.matmul_bias(a, b, transa, transb, bias)
  need_tensor('matmul_bias', a, 'a')
  need_tensor('matmul_bias', b, 'b')
  need_tensor('matmul_bias', bias, 'bias')
  local bb = box_t()
  bb[0] = bias
  return run(C.ms_matmul_epilogue, a, b, flag(transa), flag(transb), bb, C.MS_GEMM_BIAS)
end

-- matmul_gelu(a, b, transa, transb, bias?): 2-D gelu(op(a) @ op(b) + bias)
-- (the tanh form) and the pre-activation; returns out, pre
function F.matmul_gelu(a, b, transa, transb, bias)
  need_tensor('matmul_gelu', a, 'a')
  need_tensor('matmul_gelu', b, 'b')
  if bias ~= nil then need_tensor('matmul_gelu', bias, 'bias') end
  local ob, pb = box_t(), box_t()
  if C.ms_matmul_gelu(ob, pb, a, b, flag(transa), flag(transb), bias) ~= 0 then raise(ffi.string(C.ms_last_error())) end
  return wrap(ob[0]), wrap(pb[0])
end

-- matmul_dgelu(a, b, transa, transb, pre, bias_grad?): 2-D (op(a) @ op(b)) *
-- gelu'(pre), and with bias_grad true the column sums of that; returns out,
-- bias_grad (or nil)
function F.matmul_dgelu(a, b, transa, transb, pre, bias_grad)
  need_tensor('matmul_dgelu', a, 'a')
  need_tensor('matmul_dgelu', b, 'b')
  need_tensor('matmul_dgelu', pre, 'pre')
  local ob, gb = box_t(), box_t()
  if C.ms_matmul_dgelu(ob, bias_grad and gb or nil, a, b, flag(transa), flag(transb), pre) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  return wrap(ob[0]), bias_grad and wrap(gb[0]) or nil
end

-- matmul_bgrad(a, b, transa, transb, side): 2-D op(a) @ op(b) and the sum
-- over k of op(a) (side 'a': M values) or of op(b) (side 'b': N values), a
-- layer's weight gradient and its bias gradient in one GEMM on CUDA when
-- cuBLASLt has the epilogue; returns out, bias_grad
function F.matmul_bgrad(a, b, transa, transb, side)
  need_tensor('matmul_bgrad', a, 'a')
  need_tensor('matmul_bgrad', b, 'b')
  if side ~= 'a' and side ~= 'b' then
    raise(('matmul_bgrad: side must be \'a\' or \'b\', got %s'):format(tostring(side)))
  end
  local bb = box_t()
  local out = run(C.ms_matmul_epilogue, a, b, flag(transa), flag(transb), bb,
    side == 'a' and C.MS_GEMM_BGRAD_A or C.MS_GEMM_BGRAD_B)
  return out, wrap(bb[0])
end

-- gemm_(out, a, b, transa, transb, alpha = 1, beta = 1):
-- out = beta * out + alpha * op(a) @ op(b), 2-D; accumulates by default
function F.gemm_(out, a, b, transa, transb, alpha, beta)
  need_tensor('gemm_', out, 'out')
  need_tensor('gemm_', a, 'a')
  need_tensor('gemm_', b, 'b')
  check(C.ms_gemm_(out, a, b, flag(transa), flag(transb), alpha or 1, beta or 1))
  return out
end

-- gemm_grouped_(outs, as, bs, transa, transb, beta = 0): outs[g] = beta *
-- outs[g] + op(as[g]) @ op(bs[g]) for every g (lists of 2-D tensors; beta 0
-- or 1); on CUDA one grouped-kernel launch where its rules hold (core/ops.h
-- ms_gemm_grouped_), else gemm_ a group. Returns outs.
function F.gemm_grouped_(outs, as, bs, transa, transb, beta)
  local G = #outs
  if #as ~= G or #bs ~= G then
    raise(('gemm_grouped_: %d outs, %d as and %d bs'):format(G, #as, #bs))
  end
  local c, a, b = ffi.new('ms_tensor*[?]', G + 1), ffi.new('ms_tensor*[?]', G + 1), ffi.new('ms_tensor*[?]', G + 1)
  for g = 1, G do
    need_tensor('gemm_grouped_', outs[g], ('outs[%d]'):format(g))
    need_tensor('gemm_grouped_', as[g], ('as[%d]'):format(g))
    need_tensor('gemm_grouped_', bs[g], ('bs[%d]'):format(g))
    c[g - 1], a[g - 1], b[g - 1] = outs[g], as[g], bs[g]
  end
  check(C.ms_gemm_grouped_(c, a, b, G, flag(transa), flag(transb), beta or 0))
  return outs
end

-- gemm_grouped_kernel([mode]) -> the previous mode: how CUDA's
-- gemm_grouped_ runs. 'auto' (the default): the grouped kernel (wgmma on
-- Hopper, mma.sync elsewhere) where it applies and the groups are small
-- enough for it to beat a cuBLASLt GEMM a group; 'kernel': wherever it
-- applies; 'mma': the same with the mma.sync kernel on Hopper too; 'loop':
-- a gemm_ a group. No argument: only reads it.
local grouped_modes = { loop = C.MS_GROUPED_LOOP, auto = C.MS_GROUPED_AUTO, kernel = C.MS_GROUPED_KERNEL,
  mma = C.MS_GROUPED_MMA }
local grouped_names = {}
for name, m in pairs(grouped_modes) do grouped_names[m] = name end
function F.gemm_grouped_kernel(mode)
  local m = -1
  if mode ~= nil then
    m = grouped_modes[mode]
    if not m then
      raise(("gemm_grouped_kernel: 'auto', 'kernel', 'mma' or 'loop', got %s"):format(tostring(mode)))
    end
  end
  return grouped_names[C.ms_gemm_grouped_set_kernel(m)]
end

-- cast_flat(list, dtype) -> one contiguous 1-D tensor of dtype holding the
-- tensors of list in turn, converted (each in row-major order; all on one
-- device): on CUDA one kernel a 64 tensors where they are contiguous and of
-- one float dtype (core/ops.h ms_cast_flat). A MoE layer casts its experts'
-- weights to the compute dtype with it, once a forward.
function F.cast_flat(list, dtype)
  local n = #list
  if n == 0 then raise('cast_flat: an empty list') end
  local a = ffi.new('ms_tensor*[?]', n)
  for i = 1, n do
    need_tensor('cast_flat', list[i], ('list[%d]'):format(i))
    a[i - 1] = list[i]
  end
  return run(C.ms_cast_flat, a, n, T.dtype_id(dtype or list[1].dtype_id, 2))
end

-- split_flat_(list, flat) -> list: the way back, each tensor of list
-- written with flat's next elements (row-major, converted); flat
-- contiguous, holding exactly their elements, on their device: on CUDA one
-- kernel a 64 tensors where they are contiguous and of one float dtype
-- (core/ops.h ms_split_flat_). dist.all_reduce_coalesced copies a packed
-- bucket back into its gradients with it.
function F.split_flat_(list, flat)
  local n = #list
  if n == 0 then raise('split_flat_: an empty list') end
  need_tensor('split_flat_', flat, 'flat')
  local a = ffi.new('ms_tensor*[?]', n)
  for i = 1, n do
    need_tensor('split_flat_', list[i], ('list[%d]'):format(i))
    a[i - 1] = list[i]
  end
  if C.ms_split_flat_(a, n, flat) ~= 0 then raise(ffi.string(C.ms_last_error())) end
  return list
end

-- ------------------------------------------------------------------ float8
-- (core/ops.h has the contracts; moonshard.float8 the training layer)

-- amax(x [, out]) -> 0-dim f32 = max |x| (NaN when x holds one), no host
-- sync; into out (one f32 element on x's device: a slot of a vector) when
-- given
function F.amax(x, out)
  need_tensor('amax', x)
  if out ~= nil then
    need_tensor('amax', out, 'out')
    return run_into(out, C.ms_amax, x)
  end
  return run(C.ms_amax, x)
end

-- the slots of a cast (opts: rows = true, cols = false, inv = true, amax =
-- false) filled by cfn(out, out_t, inv, [amax,] ...), wrapped or nil
local function cast_op(cfn, opts, with_amax, ...)
  local want = { opts.rows ~= false, opts.cols and true or false, opts.inv ~= false, with_amax and opts.amax and true }
  local boxes = {}
  for i = 1, 4 do boxes[i] = want[i] and box_t() or nil end
  local rc
  if with_amax then rc = cfn(boxes[1], boxes[2], boxes[3], boxes[4], ...)
  else rc = cfn(boxes[1], boxes[2], boxes[3], ...) end
  if rc ~= 0 then raise(ffi.string(C.ms_last_error())) end
  local r = {}
  for i = 1, 4 do r[i] = want[i] and wrap(boxes[i][0]) or nil end
  return r[1], r[2], r[3], r[4]
end

-- float8_cast(x (R, C), amax, dtype, {rows = true, cols = false, inv = true,
-- pow2 = false}) -> out (R, C) or nil, out_t (C, R) or nil, inv or nil:
-- x * scale saturated and rounded into dtype ('f8e4m3' | 'f8e5m2') with
-- scale = fmax / max(amax, 1e-12); out_t the transposed copy; inv = 1/scale
function F.float8_cast(x, amax, dtype, opts)
  need_tensor('float8_cast', x, 'x')
  need_tensor('float8_cast', amax, 'amax')
  opts = opts or {}
  local r, c, i = cast_op(C.ms_float8_cast, opts, false, x, amax, T.dtype_id(dtype or 'f8e4m3', 3),
    opts.pow2 and 1 or 0)
  return r, c, i
end

-- float8_cast_dynamic(x (R, C), dtype, {rows, cols, inv, pow2 as above,
-- amax = false}) -> out, out_t, inv, amax: the same with x's own amax (one
-- kernel on CUDA), returned when opts.amax
function F.float8_cast_dynamic(x, dtype, opts)
  need_tensor('float8_cast', x, 'x')
  opts = opts or {}
  return cast_op(C.ms_float8_cast_dynamic, opts, true, x, T.dtype_id(dtype or 'f8e4m3', 3), opts.pow2 and 1 or 0)
end

-- float8_cast_axiswise(x (R, C), dtype, {rows = true, cols = false, inv =
-- true, pow2 = false}) -> out (R, C), out_t (C, R), inv_rows (R), inv_cols
-- (C) (each nil when not asked): torchao's axiswise (rowwise) scaling, out's
-- row i scaled by fmax / amax(x[i, :]), out_t's row j by fmax / amax(x[:, j])
-- opts.row_amax (R) / opts.col_amax (C): the amaxes to scale by instead of
-- x's own (F.float8_amax_axiswise's, all-reduced over a tensor-parallel
-- group: the unsplit tensor's), one for each layout asked
function F.float8_cast_axiswise(x, dtype, opts)
  need_tensor('float8_cast_axiswise', x, 'x')
  opts = opts or {}
  local rows, cols, inv = opts.rows ~= false, opts.cols and true or false, opts.inv ~= false
  local want = { rows, cols, rows and inv, cols and inv }
  local boxes = {}
  for i = 1, 4 do boxes[i] = want[i] and box_t() or nil end
  if opts.row_amax ~= nil then need_tensor('float8_cast_axiswise', opts.row_amax, 'row_amax') end
  if opts.col_amax ~= nil then need_tensor('float8_cast_axiswise', opts.col_amax, 'col_amax') end
  if C.ms_float8_cast_axiswise(boxes[1], boxes[2], boxes[3], boxes[4], x, opts.row_amax, opts.col_amax,
      T.dtype_id(dtype or 'f8e4m3', 3), opts.pow2 and 1 or 0) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  local r = {}
  for i = 1, 4 do r[i] = want[i] and wrap(boxes[i][0]) or nil end
  return r[1], r[2], r[3], r[4]
end

-- float8_amax_axiswise(x (R, C), {rows = true, cols = false, row_out =,
-- col_out =}) -> row_amax (R), col_amax (C) f32 (each nil when not asked):
-- max |x| along each row and down each column (NaN when one holds a NaN),
-- what float8_cast_axiswise scales by; written into row_out / col_out
-- (contiguous f32 vectors on x's device: slots of a larger one) when given
function F.float8_amax_axiswise(x, opts)
  need_tensor('float8_amax_axiswise', x, 'x')
  opts = opts or {}
  local rb = opts.rows ~= false and box_t() or nil
  local cb = opts.cols and box_t() or nil
  if rb and opts.row_out ~= nil then need_tensor('float8_amax_axiswise', opts.row_out, 'row_out'); rb[0] = opts.row_out end
  if cb and opts.col_out ~= nil then need_tensor('float8_amax_axiswise', opts.col_out, 'col_out'); cb[0] = opts.col_out end
  if C.ms_float8_amax_axiswise(rb, cb, x) ~= 0 then raise(ffi.string(C.ms_last_error())) end
  local r = rb and (opts.row_out or wrap(rb[0])) or nil
  return r, cb and (opts.col_out or wrap(cb[0])) or nil
end

-- the block kinds of the blockwise casts and products
local BLOCKS = { ['1x128'] = 1, ['128x128'] = 2 }
local function blocks_id(name, what, v)
  local id = BLOCKS[v]
  if id == nil then
    raise(("%s: %s must be '1x128' or '128x128', got %s"):format(name, what, tostring(v)))
  end
  return id
end

-- float8_cast_blockwise(x (R, C), dtype, {blocks = '1x128', rows = true,
-- cols = false, inv = true, pow2 = false}) -> out (R, C), out_t (C, R), inv,
-- inv_t (each nil when not asked): DeepSeek-V3's blockwise scaling, one
-- scale a block along each layout's K: '1x128' out's rows by 128 columns,
-- out_t's rows (x's columns) by 128 rows of x; '128x128' the 128 x 128
-- tiles (both layouts the same bytes). inv / inv_t the inverse scales in
-- cuBLASLt's layout (core/ops.h): 1x128 (ceil(K/128), rows), 128x128
-- (ceil(rows/128), ceil(K/128) rounded up to 4)
function F.float8_cast_blockwise(x, dtype, opts)
  need_tensor('float8_cast_blockwise', x, 'x')
  opts = opts or {}
  local blocks = blocks_id('float8_cast_blockwise', 'blocks', opts.blocks or '1x128')
  local rows, cols, inv = opts.rows ~= false, opts.cols and true or false, opts.inv ~= false
  local want = { rows, cols, rows and inv, cols and inv }
  local boxes = {}
  for i = 1, 4 do boxes[i] = want[i] and box_t() or nil end
  if C.ms_float8_cast_blockwise(boxes[1], boxes[2], boxes[3], boxes[4], x, blocks, T.dtype_id(dtype or 'f8e4m3', 3),
      opts.pow2 and 1 or 0) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  local r = {}
  for i = 1, 4 do r[i] = want[i] and wrap(boxes[i][0]) or nil end
  return r[1], r[2], r[3], r[4]
end

-- A flat piece x (n) of a row-major (R, C) matrix, its elements [offset,
-- offset + n) (an FSDP shard's part of a blockwise weight: fsdp's
-- float8_all_gather; core/ops.h has the contracts):
-- float8_amax_blockwise_piece(x, R, C, offset, {out =}) -> (ceil(R/128),
-- ceil(C/128)) f32: the piece's max |x| in each 128 x 128 block (0 where it
-- has none), into out (a contiguous f32 grid: a slot of a vector) when given
function F.float8_amax_blockwise_piece(x, rows, cols, offset, opts)
  need_tensor('float8_amax_blockwise_piece', x, 'x')
  opts = opts or {}
  if opts.out ~= nil then
    need_tensor('float8_amax_blockwise_piece', opts.out, 'out')
    return run_into(opts.out, C.ms_float8_amax_blockwise_piece, x, rows, cols, offset or 0)
  end
  return run(C.ms_float8_amax_blockwise_piece, x, rows, cols, offset or 0)
end

-- float8_scales_blockwise(amax (nbr, nbc), dtype, {pow2 = false, scale =,
-- inv =, inv_t =}) -> scale (nbr, nbc), inv, inv_t: the blocks' scales and
-- inverse scales in float8_cast_blockwise's 128x128 layouts (of the matrix
-- and of its transpose); written into the tensors given
function F.float8_scales_blockwise(amax, dtype, opts)
  need_tensor('float8_scales_blockwise', amax, 'amax')
  opts = opts or {}
  local boxes = {}
  for i, k in ipairs({ 'scale', 'inv', 'inv_t' }) do
    boxes[i] = box_t()
    if opts[k] ~= nil then
      need_tensor('float8_scales_blockwise', opts[k], k)
      boxes[i][0] = opts[k]
    end
  end
  if C.ms_float8_scales_blockwise(boxes[1], boxes[2], boxes[3], amax, T.dtype_id(dtype or 'f8e4m3', 3),
      opts.pow2 and 1 or 0) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  return opts.scale or wrap(boxes[1][0]), opts.inv or wrap(boxes[2][0]), opts.inv_t or wrap(boxes[3][0])
end

-- float8_cast_blockwise_piece(x, scale, R, C, offset, dtype, {out =}) ->
-- (n) dtype: each element cast with its block's scale (scale the
-- (ceil(R/128), ceil(C/128)) grid of float8_scales_blockwise), into out
-- when given
function F.float8_cast_blockwise_piece(x, scale, rows, cols, offset, dtype, opts)
  need_tensor('float8_cast_blockwise_piece', x, 'x')
  need_tensor('float8_cast_blockwise_piece', scale, 'scale')
  opts = opts or {}
  local dt = T.dtype_id(dtype or 'f8e4m3', 3)
  if opts.out ~= nil then
    need_tensor('float8_cast_blockwise_piece', opts.out, 'out')
    return run_into(opts.out, C.ms_float8_cast_blockwise_piece, x, scale, rows, cols, offset or 0, dt)
  end
  return run(C.ms_float8_cast_blockwise_piece, x, scale, rows, cols, offset or 0, dt)
end

-- The same for many pieces at once (one launch each on CUDA, up to 128
-- pieces a launch; the bits of the per-piece ops; core/ops.h). pieces: a
-- list of { x = (a contiguous 1-D float tensor, or nil: no element here),
-- R =, C =, offset = }; every output given.
-- float8_amax_blockwise_many(pieces, amax) -> amax: amax[i] (a contiguous
-- f32 grid each) = float8_amax_blockwise_piece of pieces[i]
local function piece_arrays(name, pieces)
  if type(pieces) ~= 'table' then raise(('%s: pieces must be a list, got %s'):format(name, type(pieces))) end
  local n = #pieces
  local x, geom = ffi.new('ms_tensor*[?]', math.max(n, 1)), ffi.new('int64_t[?]', math.max(3 * n, 1))
  for i, p in ipairs(pieces) do
    if p.x ~= nil then need_tensor(name, p.x, ('pieces[%d].x'):format(i)); x[i - 1] = p.x end
    for j, k in ipairs({ 'R', 'C', 'offset' }) do
      local v = k == 'offset' and (p.offset or 0) or p[k]
      if type(v) ~= 'number' then raise(('%s: pieces[%d].%s must be a number, got %s'):format(name, i, k, type(v))) end
      geom[3 * (i - 1) + j - 1] = v
    end
  end
  return n, x, geom
end

local function tensor_array(name, list, n, what, optional)
  if list == nil and optional then return nil end
  if type(list) ~= 'table' then raise(('%s: %s must be a list of tensors, got %s'):format(name, what, type(list))) end
  local a = ffi.new('ms_tensor*[?]', math.max(n, 1))
  for i = 1, n do
    if list[i] ~= nil then need_tensor(name, list[i], ('%s[%d]'):format(what, i)); a[i - 1] = list[i] end
  end
  return a
end

function F.float8_amax_blockwise_many(pieces, amax)
  local n, x, geom = piece_arrays('float8_amax_blockwise_many', pieces)
  check(C.ms_float8_amax_blockwise_many(tensor_array('float8_amax_blockwise_many', amax, n, 'amax'), x, geom, n))
  return amax
end

-- float8_scales_blockwise_many(amax, dtype, {pow2 = (a bool, or a list of
-- them), scale =, inv =, inv_t = (lists of tensors)}): what
-- float8_scales_blockwise writes for each grid amax[i], into the tensors given
function F.float8_scales_blockwise_many(amax, dtype, opts)
  local name = 'float8_scales_blockwise_many'
  opts = opts or {}
  if type(amax) ~= 'table' then raise(('%s: amax must be a list of tensors, got %s'):format(name, type(amax))) end
  local n = #amax
  local p2 = ffi.new('int[?]', math.max(n, 1))
  for i = 1, n do
    local v = opts.pow2
    if type(v) == 'table' then v = v[i] end
    p2[i - 1] = v and 1 or 0
  end
  check(C.ms_float8_scales_blockwise_many(tensor_array(name, opts.scale, n, 'scale', true),
    tensor_array(name, opts.inv, n, 'inv', true), tensor_array(name, opts.inv_t, n, 'inv_t', true),
    tensor_array(name, amax, n, 'amax'), p2, n, T.dtype_id(dtype or 'f8e4m3', 3)))
end

-- float8_cast_blockwise_many(pieces, scale, dtype, out) -> out: out[i]
-- (the piece's elements, dtype) = float8_cast_blockwise_piece(pieces[i].x,
-- scale[i], ...); nil entries for empty pieces
function F.float8_cast_blockwise_many(pieces, scale, dtype, out)
  local name = 'float8_cast_blockwise_many'
  local n, x, geom = piece_arrays(name, pieces)
  check(C.ms_float8_cast_blockwise_many(tensor_array(name, out, n, 'out'), x, tensor_array(name, scale, n, 'scale'),
    geom, n, T.dtype_id(dtype or 'f8e4m3', 3)))
  return out
end

-- The tensorwise casts of many pieces at once (one launch each on CUDA,
-- up to 128 pieces a launch; the bits of amax and float8_cast; core/ops.h):
-- xs a list of contiguous 1-D float tensors (false: no element here).
-- float8_amax_many(xs, amax) -> amax: amax[i] (one f32 element each: slots
-- of a vector) = amax(xs[i]) (0 for false)
local function piece_list(name, xs)
  if type(xs) ~= 'table' then raise(('%s: xs must be a list, got %s'):format(name, type(xs))) end
  local n = 0
  for i in pairs(xs) do if type(i) == 'number' and i > n then n = i end end
  local a = ffi.new('ms_tensor*[?]', math.max(n, 1))
  for i = 1, n do
    if xs[i] then need_tensor(name, xs[i], ('xs[%d]'):format(i)); a[i - 1] = xs[i] end
  end
  return n, a
end

function F.float8_amax_many(xs, amax)
  local name = 'float8_amax_many'
  local n, x = piece_list(name, xs)
  check(C.ms_float8_amax_many(tensor_array(name, amax, n, 'amax'), x, n))
  return amax
end

-- float8_cast_many(xs, amax, dtype, {pow2 = (a bool, or a list of them),
-- out = (a list: each piece's f8 elements, nil for a false one), inv = (a
-- list of one-element f32 tensors, optional)}): float8_cast of each piece
-- with its amax, into the tensors given; inv written for false pieces too
function F.float8_cast_many(xs, amax, dtype, opts)
  local name = 'float8_cast_many'
  opts = opts or {}
  local n, x = piece_list(name, xs)
  local p2 = ffi.new('int[?]', math.max(n, 1))
  for i = 1, n do
    local v = opts.pow2
    if type(v) == 'table' then v = v[i] end
    p2[i - 1] = v and 1 or 0
  end
  check(C.ms_float8_cast_many(tensor_array(name, opts.out or {}, n, 'out'), tensor_array(name, opts.inv, n, 'inv', true),
    x, tensor_array(name, amax, n, 'amax'), p2, n, T.dtype_id(dtype or 'f8e4m3', 3)))
  return opts.out
end

-- copy_bytes_many_(copies): each { dst, dst_byte, src, src_byte, nbytes }
-- (contiguous tensors of any dtypes, one device) copied, bytes as they
-- are; one kernel on CUDA (core/ops.h ms_copy_bytes_many)
function F.copy_bytes_many_(copies)
  local name = 'copy_bytes_many_'
  if type(copies) ~= 'table' then raise(('%s: copies must be a list, got %s'):format(name, type(copies))) end
  local n = #copies
  local d, s = ffi.new('ms_tensor*[?]', math.max(n, 1)), ffi.new('ms_tensor*[?]', math.max(n, 1))
  local spec = ffi.new('int64_t[?]', math.max(3 * n, 1))
  for i, c in ipairs(copies) do
    d[i - 1] = need_tensor(name, c[1], ('copies[%d] dst'):format(i))
    s[i - 1] = need_tensor(name, c[3], ('copies[%d] src'):format(i))
    for j, k in ipairs({ 2, 4, 5 }) do
      local v = c[k]
      if type(v) ~= 'number' then raise(('%s: copies[%d] needs byte offsets and a count, got %s'):format(name, i, type(v))) end
      spec[3 * (i - 1) + j - 1] = v
    end
  end
  check(C.ms_copy_bytes_many(d, s, spec, n))
  return copies
end

-- float8_transpose(x (R, C) 8-bit float) -> (C, R) contiguous, the same bytes
function F.float8_transpose(x)
  need_tensor('float8_transpose', x, 'x')
  return run(C.ms_float8_transpose, x)
end

-- scaled_matmul(a (M, K), b (N, K), ainv, binv, {bias =, out_dtype = 'bf16',
-- out =, beta = 0, fast_accum = false}) -> out (M, N) = ainv * binv * a @ b^T
-- (+ bias) (+ beta * out): 8-bit float operands with contiguous rows; ainv
-- and binv one f32 each, or (M) and (N) vectors (axiswise scaling), or
-- with opts.a_blocks and opts.b_blocks ('1x128' / '128x128') the blockwise
-- scales float8_cast_blockwise writes (each K block's partial product
-- scaled by its blocks' scales; no fast accumulation)
function F.scaled_matmul(a, b, ainv, binv, opts)
  need_tensor('scaled_matmul', a, 'a')
  need_tensor('scaled_matmul', b, 'b')
  need_tensor('scaled_matmul', ainv, 'ainv')
  need_tensor('scaled_matmul', binv, 'binv')
  opts = opts or {}
  if opts.bias ~= nil then need_tensor('scaled_matmul', opts.bias, 'bias') end
  local box = box_t()
  if opts.out ~= nil then
    need_tensor('scaled_matmul', opts.out, 'out')
    box[0] = opts.out
  end
  local od = opts.out ~= nil and opts.out.dtype_id or T.dtype_id(opts.out_dtype or 'bf16', 3)
  if opts.a_blocks ~= nil or opts.b_blocks ~= nil then
    local ab = blocks_id('scaled_matmul', 'a_blocks', opts.a_blocks)
    local bb = blocks_id('scaled_matmul', 'b_blocks', opts.b_blocks)
    if opts.fast_accum then
      raise('scaled_matmul: blockwise scales take no fast accumulation (cuBLASLt promotes every K block into f32)')
    end
    if C.ms_scaled_matmul_blockwise(box, a, b, ainv, ab, binv, bb, opts.bias, od, opts.beta or 0) ~= 0 then
      raise(ffi.string(C.ms_last_error()))
    end
    return opts.out or wrap(box[0])
  end
  if C.ms_scaled_matmul(box, a, b, ainv, binv, opts.bias, od, opts.beta or 0, opts.fast_accum and 1 or 0) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  return opts.out or wrap(box[0])
end

-- ---------------------------------------------------------------- indexing

-- the op function(a, dim, idx) -> out = cfn(a, dim, idx)
local function index_op(name, cfn)
  return function(a, dim, idx)
    need_tensor(name, a)
    idx = index_arg(name, idx)
    local cd = dim_of(name, a, dim)
    return run_dim(cd, dim, cfn, a, cd, idx)
  end
end

-- the in-place op function(dst, dim, idx, src) -> dst, by cfn(dst, dim, idx, src)
local function index_op_(name, cfn)
  return function(dst, dim, idx, src)
    need_tensor(name, dst, 'the destination')
    need_tensor(name, src, 'the source')
    idx = index_arg(name, idx)
    local cd = dim_of(name, dst, dim)
    check_dim(cd, dim, cfn(dst, cd, idx, src))
    return dst
  end
end

-- index_select(a, dim, idx): the slices idx[i] of a along dim
F.index_select = index_op('index_select', C.ms_index_select)
-- gather(a, dim, idx): out[...i...] = a[...idx[...i...]...] along dim
F.gather = index_op('gather', C.ms_gather)
-- dst:index_add_(dim, idx, src): dst.narrow(dim, idx[i]) += src.narrow(dim, i)
F.index_add_ = index_op_('index_add_', C.ms_index_add_)
-- dst:scatter_add_(dim, idx, src): dst[...idx[...i...]...] += src[...i...] along dim
F.scatter_add_ = index_op_('scatter_add_', C.ms_scatter_add_)

-- ------------------------------------------------------ joining, splitting

-- cat({a, b, ...}, dim = 1)
function F.cat(list, dim)
  if is_tensor(list) then raise('cat: expected a list of tensors, got a tensor') end
  if type(list) ~= 'table' or #list == 0 then raise('cat: expected a non-empty list of tensors') end
  local n = #list
  local arr = tensor_list_t(n)
  for i = 1, n do
    if not is_tensor(list[i]) then
      raise(('cat: element %d of the list is a %s, not a tensor'):format(i, type(list[i])))
    end
    arr[i - 1] = list[i]
  end
  local d = dim_of('cat', list[1], dim or 1)
  return run_dim(d, dim or 1, C.ms_cat, n, arr, d)
end

-- stack({a, b, ...}, dim = 1): a new dim of size #list
function F.stack(list, dim)
  if type(list) ~= 'table' or is_tensor(list) or #list == 0 then
    raise('stack: expected a non-empty list of tensors')
  end
  local first = need_tensor('stack', list[1], 'element 1')
  local d = dim_of('stack', first, dim or 1, 1)
  local shape0 = table.concat(first.shape, ',')
  local parts = {}
  for i = 1, #list do
    local t = need_tensor('stack', list[i], 'element ' .. i)
    local shape = table.concat(t.shape, ',')
    if shape ~= shape0 then
      raise(('stack: shapes (%s) and (%s) (element %d) differ'):format(shape0, shape, i))
    end
    parts[i] = run(C.ms_tensor_unsqueeze, t, d)
  end
  local arr = tensor_list_t(#parts)
  for i = 1, #parts do arr[i - 1] = parts[i] end
  return run(C.ms_cat, #parts, arr, d)
end

-- split(t, size, dim = 1): views of `size` along dim (the last may be
-- shorter); split(t, {s1, s2, ...}, dim): views of those sizes
function F.split(t, sizes, dim)
  need_tensor('split', t)
  local d = dim_of('split', t, dim or 1)
  local n = tonumber(t.sizes[d])
  local list = {}
  if type(sizes) == 'number' then
    if sizes <= 0 or sizes ~= math.floor(sizes) then
      raise(('split: size must be a positive integer, got %s'):format(tostring(sizes)))
    end
    for s = 0, n - 1, sizes do list[#list + 1] = math.min(sizes, n - s) end
    if n == 0 then list[1] = 0 end
  elseif type(sizes) == 'table' then
    local total = 0
    for i, s in ipairs(sizes) do
      if type(s) ~= 'number' or s < 0 or s ~= math.floor(s) then
        raise(('split: size %d must be a non-negative integer, got %s'):format(i, tostring(s)))
      end
      list[i] = s
      total = total + s
    end
    if total ~= n then
      raise(('split: sizes {%s} sum to %d but dim %d of shape (%s) has size %d'):format(
        table.concat(sizes, ','), total, dim or 1, table.concat(t.shape, ','), n))
    end
  else
    raise(('split: expected a size or a table of sizes, got %s'):format(type(sizes)))
  end
  local out, at = {}, 0
  for i, s in ipairs(list) do
    out[i] = run(C.ms_tensor_narrow, t, d, at, s)
    at = at + s
  end
  return out
end

-- ------------------------------------------------------------------- fills

function F.fill_(t, v)
  need_tensor('fill_', t)
  if type(v) == 'boolean' then v = v and 1 or 0 end
  if T.is_deferred(t) then   -- made under nn.deferred_init: its record changes
    T.set_init_record(t, { kind = 'fill', value = v }, 'fill_')
    return t
  end
  check(C.ms_fill_(t, v))
  return t
end

-- --------------------------------------------------------------- fused ops
-- Norms, AdamW, the sum of squares of a gradient list, rotary embeddings
-- (contracts in core/ops.h). No autograd here: nn.functional.layer_norm,
-- rms_norm and apply_rotary are the differentiable forms built on these.

local function opt_tensor(name, t, what)
  if t ~= nil then need_tensor(name, t, what) end
  return t
end
local function out_dtype_of(d)
  if d == nil then return -1 end
  return T.dtype_id(d, 4)
end
local function wrap_opt(box) return box[0] ~= nil and wrap(box[0]) or nil end

-- native_layer_norm(x, w?, b?, eps = 1e-5, out_dtype?) -> y, mean, rstd
-- over the last dim; mean/rstd (N rows) f32 (f64 for f64 x); y in out_dtype
-- (default x's dtype)
function F.native_layer_norm(x, w, b, eps, out_dtype)
  need_tensor('layer_norm', x)
  opt_tensor('layer_norm', w, 'the weight')
  opt_tensor('layer_norm', b, 'the bias')
  local y, m, r = box_t(), box_t(), box_t()
  if C.ms_layer_norm(y, m, r, x, w, b, eps or 1e-5, out_dtype_of(out_dtype)) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  return wrap(y[0]), wrap(m[0]), wrap(r[0])
end

-- native_add_layer_norm(x, h, w?, b?, eps = 1e-5, out_dtype?) -> res, y,
-- mean, rstd: res = x + h and y = layer_norm(res), one pass on CUDA when
-- res has x's dtype and h out_dtype's (ms_add_layer_norm)
function F.native_add_layer_norm(x, h, w, b, eps, out_dtype)
  need_tensor('add_layer_norm', x, 'x')
  need_tensor('add_layer_norm', h, 'h')
  opt_tensor('add_layer_norm', w, 'the weight')
  opt_tensor('add_layer_norm', b, 'the bias')
  local s, y, m, r = box_t(), box_t(), box_t(), box_t()
  if C.ms_add_layer_norm(s, y, m, r, x, h, w, b, eps or 1e-5, out_dtype_of(out_dtype)) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  return wrap(s[0]), wrap(y[0]), wrap(m[0]), wrap(r[0])
end

-- native_layer_norm_backward_add(g, x, mean, rstd, w?, gres, {dx=, dw=, db=, dxl=, dxl_sum=})
-- -> dx (+ gres, in the same pass on CUDA), dw, db, and with dxl = true dx
-- once more in g's dtype (from the same pass on CUDA); with dxl_sum = true
-- (needs dxl) also dxl's column sums (C) in g's dtype, the last value
-- returned (from the same pass on CUDA where the warp-per-row kernel runs)
function F.native_layer_norm_backward_add(g, x, mean, rstd, w, gres, want)
  need_tensor('layer_norm_backward', g, 'the gradient')
  need_tensor('layer_norm_backward', x, 'x')
  need_tensor('layer_norm_backward', mean, 'the saved mean')
  need_tensor('layer_norm_backward', rstd, 'the saved rstd')
  opt_tensor('layer_norm_backward', w, 'the weight')
  opt_tensor('layer_norm_backward', gres, 'the residual gradient')
  want = want or {}
  local dx = want.dx ~= false and box_t() or nil
  local dw = want.dw ~= false and box_t() or nil
  local db = want.db ~= false and box_t() or nil
  local dxl = want.dxl and box_t() or nil
  local dls = want.dxl_sum and box_t() or nil
  if C.ms_layer_norm_backward_add(dx, dw, db, g, x, mean, rstd, w, gres, dxl, dls) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  if dls then
    return dx and wrap_opt(dx), dw and wrap_opt(dw), db and wrap_opt(db), dxl and wrap_opt(dxl), wrap_opt(dls)
  end
  return dx and wrap_opt(dx), dw and wrap_opt(dw), db and wrap_opt(db), dxl and wrap_opt(dxl)
end

-- native_layer_norm_backward(g, x, mean, rstd, w?, {dx=, dw=, db=}) -> dx, dw, db
-- (each true by default; a false one is not computed and comes back nil)
function F.native_layer_norm_backward(g, x, mean, rstd, w, want)
  return F.native_layer_norm_backward_add(g, x, mean, rstd, w, nil, want)
end

-- native_rms_norm(x, w?, eps = 1e-6, out_dtype?) -> y, rstd
function F.native_rms_norm(x, w, eps, out_dtype)
  need_tensor('rms_norm', x)
  opt_tensor('rms_norm', w, 'the weight')
  local y, r = box_t(), box_t()
  if C.ms_rms_norm(y, r, x, w, eps or 1e-6, out_dtype_of(out_dtype)) ~= 0 then raise(ffi.string(C.ms_last_error())) end
  return wrap(y[0]), wrap(r[0])
end

-- native_add_rms_norm(x, h, w?, eps = 1e-6, out_dtype?) -> res, y, rstd:
-- res = x + h and y = rms_norm(res) (ms_add_rms_norm)
function F.native_add_rms_norm(x, h, w, eps, out_dtype)
  need_tensor('add_rms_norm', x, 'x')
  need_tensor('add_rms_norm', h, 'h')
  opt_tensor('add_rms_norm', w, 'the weight')
  local s, y, r = box_t(), box_t(), box_t()
  if C.ms_add_rms_norm(s, y, r, x, h, w, eps or 1e-6, out_dtype_of(out_dtype)) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  return wrap(s[0]), wrap(y[0]), wrap(r[0])
end

-- native_rms_norm_backward_add(g, x, rstd, w?, gres, {dx=, dw=, dxl=, dxl_sum=}) -> dx (+ gres), dw, dxl,
-- and with dxl_sum = true dxl's column sums (as native_layer_norm_backward_add)
function F.native_rms_norm_backward_add(g, x, rstd, w, gres, want)
  need_tensor('rms_norm_backward', g, 'the gradient')
  need_tensor('rms_norm_backward', x, 'x')
  need_tensor('rms_norm_backward', rstd, 'the saved rstd')
  opt_tensor('rms_norm_backward', w, 'the weight')
  opt_tensor('rms_norm_backward', gres, 'the residual gradient')
  want = want or {}
  local dx = want.dx ~= false and box_t() or nil
  local dw = want.dw ~= false and box_t() or nil
  local dxl = want.dxl and box_t() or nil
  local dls = want.dxl_sum and box_t() or nil
  if C.ms_rms_norm_backward_add(dx, dw, g, x, rstd, w, gres, dxl, dls) ~= 0 then
    raise(ffi.string(C.ms_last_error()))
  end
  if dls then return dx and wrap_opt(dx), dw and wrap_opt(dw), dxl and wrap_opt(dxl), wrap_opt(dls) end
  return dx and wrap_opt(dx), dw and wrap_opt(dw), dxl and wrap_opt(dxl)
end

-- native_rms_norm_backward(g, x, rstd, w?, {dx=, dw=}) -> dx, dw
function F.native_rms_norm_backward(g, x, rstd, w, want)
  return F.native_rms_norm_backward_add(g, x, rstd, w, nil, want)
end

-- a tensor or a list of tensors -> a C array and its length
local function tensor_array(name, what, list)
  if is_tensor(list) then list = { list } end
  if type(list) ~= 'table' or #list == 0 then
    raise(('%s: expected a tensor or a non-empty list of tensors for %s'):format(name, what))
  end
  local arr = tensor_list_t(#list)
  for i = 1, #list do
    if not is_tensor(list[i]) then
      raise(('%s: element %d of %s is a %s, not a tensor'):format(name, i, what, type(list[i])))
    end
    arr[i - 1] = list[i]
  end
  return arr, #list, list
end

-- adamw_(params, grads, exp_avg, exp_avg_sq, lr, beta1, beta2, eps,
-- weight_decay, step, masters?): one AdamW step in place (torch.optim.AdamW's
-- math; step counts this update, from 1). Each of the first four is a tensor
-- or a list of tensors (one launch on CUDA for the whole list); the arrays
-- keep their tensors alive until the call returns. masters: a list of the
-- same length whose entries are false or the f32 master of a bf16/f16
-- parameter (updated in its place; the parameter gets its rounding).
-- grad_scale: nil, or a one-element f64 tensor on the parameters' device
-- every gradient is multiplied by on the way in (the same bits as scaling
-- the gradients first; clip_grad_norm's `defer` coefficient). constants:
-- nil, or 3 f64 on the parameters' device holding the step's {1 - lr·wd,
-- lr/(1-beta1^step), sqrt(1-beta2^step)}, which the kernel then reads in
-- place of lr, weight_decay and step (a step captured in a CUDA graph;
-- adamw_constants_ writes them, with the same bits).
function F.adamw_(params, grads, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, masters, grad_scale,
                  constants)
  local pa, n = tensor_array('adamw_', 'the parameters', params)
  local ga, ng = tensor_array('adamw_', 'the gradients', grads)
  local ma, nm = tensor_array('adamw_', 'exp_avg', exp_avg)
  local va, nv = tensor_array('adamw_', 'exp_avg_sq', exp_avg_sq)
  if ng ~= n or nm ~= n or nv ~= n then
    raise(('adamw_: %d parameters, %d gradients, %d exp_avg and %d exp_avg_sq'):format(n, ng, nm, nv))
  end
  for k, v in pairs({ lr = lr, beta1 = beta1, beta2 = beta2, eps = eps, weight_decay = weight_decay, step = step }) do
    if type(v) ~= 'number' then raise(('adamw_: %s must be a number, got %s'):format(k, type(v))) end
  end
  local wa = nil
  if masters ~= nil then
    if is_tensor(masters) then masters = { masters } end
    if type(masters) ~= 'table' then raise('adamw_: masters must be a list (false where a parameter has none)') end
    wa = tensor_list_t(n)
    for i = 1, n do
      local w = masters[i]
      if w and not is_tensor(w) then raise(('adamw_: master %d is a %s, not a tensor or false'):format(i, type(w))) end
      wa[i - 1] = w or nil
    end
  end
  if grad_scale ~= nil and not is_tensor(grad_scale) then
    raise(('adamw_: grad_scale must be a tensor (one f64 element), got %s'):format(type(grad_scale)))
  end
  if constants ~= nil and not is_tensor(constants) then
    raise(('adamw_: constants must be a tensor (3 f64 elements), got %s'):format(type(constants)))
  end
  check(C.ms_adamw_multi_(n, pa, ga, ma, va, lr, beta1, beta2, eps, weight_decay, step, wa, grad_scale, constants))
  return params
end

-- adamw_constants_(t, lr, beta1, beta2, weight_decay, step) -> t: the
-- constants of that step (see adamw_) written into t (3 f64, any device;
-- on CUDA a kernel on the current stream, no host sync)
function F.adamw_constants_(t, lr, beta1, beta2, weight_decay, step)
  if not is_tensor(t) then raise(('adamw_constants_: expected a tensor, got %s'):format(type(t))) end
  for k, v in pairs({ lr = lr, beta1 = beta1, beta2 = beta2, weight_decay = weight_decay, step = step }) do
    if type(v) ~= 'number' then raise(('adamw_constants_: %s must be a number, got %s'):format(k, type(v))) end
  end
  check(C.ms_adamw_constants_(t, lr, beta1, beta2, weight_decay, step))
  return t
end

-- sum_squares(t | {t1, t2, ...}) -> 0-dim f64 tensor Σ t_ij² (on the
-- tensors' device; the global grad norm is its square root)
function F.sum_squares(list)
  local arr, n = tensor_array('sum_squares', 'the tensors', list)
  return run(C.ms_sum_squares, n, arr)
end

-- rope(x (..., T, D), cos (T, D), sin (T, D)): x·cos + rotate_half(x)·sin
-- (Hugging Face's convention); rope_backward(g, cos, sin): its transpose
local function rope_op(name, what, backward)
  return function(x, cos, sin)
    need_tensor(name, x, what)
    need_tensor(name, cos, 'cos')
    need_tensor(name, sin, 'sin')
    return run(C.ms_rope, x, cos, sin, backward)
  end
end
F.rope = rope_op('rope', 'x', 0)
F.rope_backward = rope_op('rope_backward', 'the gradient', 1)

-- --------------------------------------------------------------- as methods

for k, f in pairs(F) do T.methods[k] = f end

return F
