-- moonshard.nn.functional — the differentiable building blocks of nn modules.
--
--   local nnf = require 'moonshard.nn.functional'   -- also nn.functional
--   local y = nnf.linear(x, w, b)                    -- x @ w^T + b, w (out, in)
--   local loss = nnf.cross_entropy(logits, targets)  -- mean over non-ignored
--
-- Each function here is one autograd node built from a few raw ops (forward
-- and backward written together), not a long chain of recorded ops: fewer
-- nodes, fewer saved tensors, fewer intermediate gradients. Where the GPU
-- later gets a fused kernel (norms, attention, the LM loss), the function
-- here is the single place to swap it in.
--
--   linear(x, w, b)                 x @ w^T + b       w: (out, in)  (torch)
--   conv1d_linear(x, w, b)          x @ w + b         w: (in, out)  (GPT-2 Conv1D)
--   embedding(ids, w)               w[ids]            ids: i64, 0-based
--   layer_norm(x, w, b, eps)        over the last dim
--   rms_norm(x, w, eps)             over the last dim, computed in f32 (HF Llama)
--   dropout(x, p, training, {seed=, offset=})
--   gelu(x) (tanh form), silu(x), swiglu(gate, up), softmax(x, dim), log_softmax(x, dim)
--   cross_entropy(logits (N, V), targets (N), {ignore_index = -100,
--                 reduction = 'mean'|'sum'|'none', label_smoothing = 0})
--   scaled_dot_product_attention(q (B,H,Tq,D), k (B,Hkv,Tk,D), v (B,Hkv,Tk,Dv), {causal = true, scale =})
--   attention_widths(q, D, Dv) -> the head widths the fused kernel runs them at (nil: none)
--   qkv_attention(qkv (B,T,3*H*D), H, {causal = true, scale =}) -> (B,T,H*D)
--   gelu_mlp(x, w1, b1, w2, b2, wt): affine(gelu(affine(x, w1, b1)), w2, b2) as one node
--   add_layer_norm(x, h, w?, b?, eps) -> x + h, layer_norm(x + h): one node, two outputs
--   add_rms_norm(x, h, w?, eps) -> x + h, rms_norm(x + h): the same
--   apply_rotary(x (..., T, D), cos (T, D), sin (T, D))   (HF rotate_half)
--   rope_cache(T, head_dim, theta, dtype, device, as?) -> cos, sin (cached; as: cast to that dtype, cached too)
--   lm_loss(hidden (B,T,C), weight (V,C), targets (B,T), opts)
--
-- Low-precision inputs (bf16/f16) of the norms, softmax-based losses and
-- attention are computed in f32 here and the result cast back where the
-- output is an activation (losses stay f32).
--
-- Mixed precision (moonshard.amp, docs/precision.md): inside
-- nnf.autocast('bf16', fn, ...) the matmul-like functions (linear,
-- conv1d_linear, scaled_dot_product_attention, lm_loss) cast their float
-- inputs to bf16 with a recorded cast (f32 parameters get f32 gradients),
-- and the norms emit bf16 from f32 math; nnf.set_precision(model,
-- {compute = 'bf16'}) puts every call of a model in such a region.
--
-- lm_loss is looked up at call time (models call nn.functional.lm_loss), so a
-- model's loss can be replaced. By default it is the fused linear
-- cross-entropy (moonshard.flce, also nnf.fused_linear_cross_entropy): no
-- logits in memory; nnf.use_fused_lm_loss(false) or opts.fused = false
-- take the plain path (linear, then cross_entropy).
local T = require 'moonshard.tensor'
local F = require 'moonshard.ops'
local A = require 'moonshard.autograd'
local flce = require 'moonshard.flce'
local amp = require 'moonshard.amp'

local R = A.raw_views
local W = A.W
local record1 = A.record1
local want = A.want
local free = A.free
local is_tensor = T.is_tensor
local shape_of = A.shape_of

local nnf = {}
local fused_attention -- defined before scaled_dot_product_attention

local function shape_str(s) return '(' .. table.concat(s, ', ') .. ')' end
local function dims(t) return shape_str(shape_of(t)) end
local function lowp(t) return t.dtype_id == 2 or t.dtype_id == 3 end

local function need_tensor(fname, x, what)
  if not is_tensor(x) then
    error(('%s: expected a tensor for %s, got %s'):format(fname, what, type(x)), 3)
  end
end

-- rows(x): x as (N, last) (a view when possible) and N
local function rows(x)
  local s = shape_of(x)
  local last = s[#s]
  local n = 1
  for i = 1, #s - 1 do n = n * s[i] end
  if x.ndim == 2 then return x, n end
  return R.reshape(x, { n, last }), n
end

-- y2 (n, out_f), the rows of an affine map of x (..., in): viewed as
-- (..., out_f) when x is not 2-D (y2 freed, the view returned)
local function unrows(y2, x, out_f)
  if x.ndim == 2 then return y2 end
  local sh = shape_of(x)
  sh[#sh] = out_f
  local y = R.view(y2, sh)
  free(y2)
  return y
end

-- --------------------------------------------------------------- linear
-- linear and conv1d_linear differ only in the weight's layout: wt = true,
-- w is (out, in) (nn.Linear); wt = false, w is (in, out) (GPT-2's Conv1D)
-- Bias gradients from the norm backward. An affine layer's bias gradient is
-- the column sum of its output gradient. When that output h went into
-- add_layer_norm / add_rms_norm (a deferred residual add), h's gradient is
-- the norm backward's dxl, whose kernel can sum its columns in the pass
-- that writes it (ms_layer_norm_backward_add's dxl_sum): the affine
-- backward then takes that sum instead of cuBLASLt's BGRAD epilogue (a
-- second read of the gradient). The norm backward publishes the sum in a
-- one-slot pending entry; the affine backward takes it only when it is
-- provably the sum of the gradient it received: its own output is the h
-- the norm saw (node.oid == hid), and g is that very gradient, the tensor
-- the norm returned or an alias of it over the same storage and view
-- (autograd hands a Function's results on as aliases; a gradient summed
-- from several consumers or converted to another dtype is a new tensor and
-- does not match). The entry holds its own alias, so the storage cannot be
-- freed and reused while it waits; it is dropped when replaced, when
-- taken, and at the end of every backward. MS_NORM_BIAS_SUM=0 (read once)
-- or nnf.set_norm_bias_sum(false): never asked for (to compare).
local norm_bias_sum_on = os.getenv('MS_NORM_BIAS_SUM') ~= '0'
local norm_bias_sum_taken = 0   -- pending sums consumed (for specs)
local pending_sum = nil         -- { hid =, g = alias of h's gradient, sum = (C) }

local function drop_pending_sum()
  local p = pending_sum
  if p == nil then return end
  pending_sum = nil
  free(p.g)
  free(p.sum)
end
A.register_hook('backward_end', drop_pending_sum)

-- nnf.set_norm_bias_sum(on) -> the previous setting
function nnf.set_norm_bias_sum(on)
  local prev = norm_bias_sum_on
  norm_bias_sum_on = on and true or false
  if not norm_bias_sum_on then drop_pending_sum() end
  return prev
end
-- how many bias gradients came from a norm backward so far
function nnf.norm_bias_sum_count() return norm_bias_sum_taken end

local function publish_pending_sum(hid, gh, sum)
  drop_pending_sum()
  pending_sum = { hid = hid, g = R.alias(gh), sum = sum }
end

-- g and t the same elements: one handle, or handles of one view of one storage
local function same_view(g, t)
  if rawequal(g, t) or g.id == t.id then return true end
  if g.storage == nil or g.storage ~= t.storage or g.offset ~= t.offset or g.ndim ~= t.ndim
      or g.dtype_id ~= t.dtype_id or g.device_id ~= t.device_id then
    return false
  end
  for d = 0, g.ndim - 1 do
    if g.sizes[d] ~= t.sizes[d] or g.strides[d] ~= t.strides[d] then return false end
  end
  return true
end

-- the pending column sums of g when they are g's (node: the affine node that
-- made h, receiving g), taken out of the slot; else nil
local function take_pending_sum(node, g)
  local p = pending_sum
  if p == nil or p.hid ~= node.oid or not same_view(g, p.g) then return nil end
  pending_sum = nil
  free(p.g)
  norm_bias_sum_taken = norm_bias_sum_taken + 1
  return p.sum
end

-- whether the weight's gradient can go straight into sink (A.grad_sink):
-- operands of one dtype, the sink in theirs or f32 of bf16/f16 ones, and
-- the sink not held by a fused linear cross-entropy whose backward is still
-- to scale it (a table in written: moonshard.flce)
local function sink_fits(sink, a, b)
  if not sink or a.dtype_id ~= b.dtype_id or a.device_id ~= sink.t.device_id then return false end
  if type(sink.written[sink.i]) == 'table' then return false end
  local sd, d = sink.t.dtype_id, a.dtype_id
  return sd == d or (sd == 1 and (d == 2 or d == 3))
end

-- the weight's gradient: (out, in) = g2ᵀ x2 for wt, else (in, out) = x2ᵀ g2;
-- into sink when it fits (accumulated when it holds one already; nothing
-- returned), else a new tensor
local function weight_grad(x2, g2, wt, sink)
  local a, b = g2, x2
  if not wt then a, b = x2, g2 end
  if sink_fits(sink, a, b) then
    F.gemm_(sink.t, a, b, true, false, 1, sink.written[sink.i] and 1 or 0)
    sink.written[sink.i] = true
    return nil
  end
  return F.matmul(a, b, true, false)
end

-- an affine layer's weight and bias gradients from its input rows x2 and
-- output gradient rows g2 (each when wanted): both from one GEMM when both
-- are (the bias gradient in its epilogue on CUDA). db_given: the bias
-- gradient already known (a norm backward's column sums): the weight's
-- from a plain GEMM, into sink when there is one (dw then nil, see
-- weight_grad; not with the BGRAD GEMM: a separate sum over the rows for
-- the bias would cost more than the copy the sink saves)
-- (also moonshard.float8's weight gradient in high precision)
nnf.weight_grad = weight_grad

local function weight_bias_grads(x2, g2, wt, want_w, want_b, db_given, sink)
  if db_given ~= nil then
    return want_w and weight_grad(x2, g2, wt, sink) or nil, db_given
  end
  if want_w and want_b and g2.dtype_id == x2.dtype_id then
    if wt then return F.matmul_bgrad(g2, x2, true, false, 'a') end
    return F.matmul_bgrad(x2, g2, true, false, 'b')
  end
  local dw, db
  if want_w then dw = weight_grad(x2, g2, wt, sink) end
  if want_b then db = F.sum(g2, 1) end
  return dw, db
end

local WB = { 2, 3 }
local defer_wgrad = false   -- (nnf.defer_weight_grads)

-- the weight's (and bias's) gradient later in this backward, after the
-- collective it may run beside (A.defer; moonshard.tp): the operands held
-- by aliases until then. (A function of its own: a closure made inside
-- bwd_affine would close its upvalues at each return, which LuaJIT does
-- not compile, and every linear's backward would run interpreted.)
-- (Nor closures here: the deferred work is two plain functions over a
-- state table, A.defer's arg.)
local function deferred_weight_bias(d)
  local dw, db = weight_bias_grads(d.xa, d.ga, d.wt, d.n2, d.n3, d.dbs, d.sink)
  free(d.xa); free(d.ga)
  return dw, db
end
local function dropped_weight_bias(d) free(d.xa); free(d.ga); free(d.dbs) end
local function defer_weight_bias(node, x2, g2, wt, dbs, sink)
  local d = { xa = R.alias(x2), ga = R.alias(g2), wt = wt, n2 = node.need[2], n3 = node.need[3], dbs = dbs,
    sink = sink }
  A.defer(node, WB, deferred_weight_bias, dropped_weight_bias, d)
end

-- input 1's gradient g2 (N, out) times w (transposed when tw) in input
-- 1's shape; or added into the gradient its other readers gave already,
-- when the walk hands it over (A.pending_grad: no add, no second tensor),
-- and nil
local function input_grad(node, g2, w, tw)
  local into = A.pending_grad(node, 1)
  if into and into.dtype_id == g2.dtype_id and w.dtype_id == g2.dtype_id then
    local i2 = rows(into)
    F.gemm_(i2, g2, w, false, tw, 1, 1)
    if i2 ~= into then free(i2) end
    return nil
  end
  local d2 = F.matmul(g2, w, false, tw) -- (N, in)
  local dx = R.reshape(d2, node.ishape[1])
  if dx ~= d2 then free(d2) end
  return dx
end

local function bwd_affine(node, g)
  local x2, w, wt = node.saved[1], node.saved[2], node.saved.wt
  local g2 = rows(g)
  local dx
  if node.need[1] then dx = input_grad(node, g2, w, not wt) end
  -- the bias gradient from the norm backward when it made g (delivered in
  -- the bias's dtype by the autograd, as any gradient)
  local dbs = node.need[3] and take_pending_sum(node, g) or nil
  local sink = A.grad_sink(node, 2)
  if node.saved.defer and (node.need[2] or node.need[3]) and A.deferrable() then
    defer_weight_bias(node, x2, g2, wt, dbs, sink)
    if g2 ~= g then free(g2) end
    return dx, nil, nil
  end
  local dw, db = weight_bias_grads(x2, g2, wt, node.need[2], node.need[3], dbs, sink)
  if g2 ~= g then free(g2) end
  return dx, dw, db
end

-- y = x (..., in) times w + b (out), recorded as `name`; errors are raised
-- at the caller of nnf.linear / nnf.conv1d_linear (level 3: affine is called,
-- not tail-called, from the function affine_fn makes)
local function affine(name, x, w, b, wt)
  if w.ndim ~= 2 then
    error(('%s: weight must be 2-D %s, got %s'):format(name, wt and '(out, in)' or '(in, out)', dims(w)), 3)
  end
  local in_f, out_f = tonumber(w.sizes[wt and 1 or 0]), tonumber(w.sizes[wt and 0 or 1])
  if x.ndim < 1 or tonumber(x.sizes[x.ndim - 1]) ~= in_f then
    error(('%s: input of shape %s does not end in in_features = %d (weight %s)'):format(
      name, dims(x), in_f, dims(w)), 3)
  end
  if b ~= nil and (b.ndim ~= 1 or tonumber(b.sizes[0]) ~= out_f) then
    error(('%s: bias of shape %s for out_features = %d'):format(name, dims(b), out_f), 3)
  end
  local x2 = rows(x)
  local y2
  -- (selective checkpointing: the product kept from the forward, or taken in its recompute)
  local slot = A.sac_on() and A.sac_slot('linear', ('%s %d %d %d %d'):format(name, tonumber(x2.sizes[0]), in_f, out_f,
    x2.dtype_id)) or nil
  if slot and slot.outs then
    y2 = slot.outs[1]
  elseif b ~= nil and b.dtype_id == x2.dtype_id and b.dtype_id == w.dtype_id and b.device_id == x2.device_id then
    y2 = F.matmul_bias(x2, w, false, wt, b)   -- the bias in the GEMM's epilogue on CUDA
  else
    y2 = F.matmul(x2, w, false, wt)
    if b ~= nil then F.add_(y2, b) end
  end
  if slot and slot.keep then A.sac_keep(slot, y2) end
  local y = unrows(y2, x, out_f)
  if want(x, w, b) then
    local own = nil
    if x2 ~= x then own = { x2 } end
    record1(name, y, bwd_affine,
      { A.needs_grad(w) and x2 or nil, A.needs_grad(x) and w or nil, wt = wt,
        defer = defer_wgrad or A.defers_readers(x) }, own, x, w, b)
  elseif x2 ~= x then
    free(x2)
  end
  return y
end

-- nnf.defer_weight_grads(on) -> previous: while on, the affine ops
-- recorded let their weight and bias gradients wait in the backward until
-- the walk runs its deferred work (A.defer; tensor parallelism's
-- row-parallel layers set it around their product, so those GEMMs run
-- beside the next collective). Also on for an input tagged by
-- A.set_defer_readers (a tensor-parallel entry's output).
function nnf.defer_weight_grads(on)
  local prev = defer_wgrad
  defer_wgrad = on and true or false
  return prev
end
function nnf.weight_grads_deferred() return defer_wgrad end

-- the public function(x, w, b) of affine `name`
local function affine_fn(name, wt)
  return function(x, w, b)
    need_tensor(name, x, 'the input')
    need_tensor(name, w, 'the weight')
    x, w, b = amp.cast(x, w, b)     -- autocast region: bf16 compute, recorded casts
    local y = affine(name, x, w, b, wt)
    return y
  end
end

-- x (..., in) @ w^T (in, out) + b (out)
nnf.linear = affine_fn('linear', true)

-- x (..., in) @ w (in, out) + b (out): Hugging Face's GPT-2 Conv1D
nnf.conv1d_linear = affine_fn('conv1d_linear', false)

-- gelu_mlp(x, w1, b1, w2, b2, wt): GPT-2's MLP, affine2(gelu(affine1(x))),
-- as one node whose GEMMs carry the rest in their cuBLASLt epilogues on
-- CUDA: the first GEMM adds b1, applies the (tanh) GELU and keeps the
-- pre-activation; the second adds b2; in the backward the gradient of the
-- hidden layer comes out of its GEMM already multiplied by gelu'(pre), with
-- b1's gradient, and b2's gradient comes with w2's. wt as in affine: false
-- for Conv1D weights (in, out), true for Linear's (out, in). The CPU runs
-- the same passes apart (ms_matmul_gelu / _dgelu / _epilogue). Biases are
-- required; mixed dtypes take the plain chain.
local function bwd_gelu_mlp(node, g)
  local s, need = node.saved, node.need
  local x2, w1, pre, h, w2, wt = s[1], s[2], s[3], s[4], s[5], s.wt
  local gc = g
  if g.dtype_id ~= h.dtype_id then gc = R.to(g, { dtype = h.dtype_id }) end
  local g2 = rows(gc)
  local dx, dw1, db1
  local dbs = need[5] and gc == g and take_pending_sum(node, g) or nil
  local dw2, db2 = weight_bias_grads(h, g2, wt, need[4], need[5], dbs, A.grad_sink(node, 4))
  if need[1] or need[2] or need[3] then
    local dpre
    dpre, db1 = F.matmul_dgelu(g2, w2, false, not wt, pre, need[3])
    dw1 = weight_bias_grads(x2, dpre, wt, need[2], false, nil, A.grad_sink(node, 2))
    if need[1] then
      local d2 = F.matmul(dpre, w1, false, not wt)
      dx = R.reshape(d2, node.ishape[1])
      if dx ~= d2 then free(d2) end
    end
    free(dpre)
  end
  if g2 ~= gc then free(g2) end
  if gc ~= g then free(gc) end
  return dx, dw1, db1, dw2, db2
end

function nnf.gelu_mlp(x, w1, b1, w2, b2, wt)
  local name = 'gelu_mlp'
  need_tensor(name, x, 'the input')
  for i, t in ipairs({ w1, b1, w2, b2 }) do need_tensor(name, t, ({ 'w1', 'b1', 'w2', 'b2' })[i]) end
  x, w1, b1, w2, b2 = amp.cast(x, w1, b1, w2, b2)
  local dt = x.dtype_id
  if w1.dtype_id ~= dt or b1.dtype_id ~= dt or w2.dtype_id ~= dt or b2.dtype_id ~= dt then
    local lin = wt and nnf.linear or nnf.conv1d_linear
    return lin(nnf.gelu(lin(x, w1, b1)), w2, b2)
  end
  if w1.ndim ~= 2 or w2.ndim ~= 2 then
    error(('%s: weights must be 2-D, got %s and %s'):format(name, dims(w1), dims(w2)), 2)
  end
  local in_f = tonumber(w1.sizes[wt and 1 or 0])
  local hid = tonumber(w1.sizes[wt and 0 or 1])
  local out_f = tonumber(w2.sizes[wt and 0 or 1])
  if x.ndim < 1 or tonumber(x.sizes[x.ndim - 1]) ~= in_f or tonumber(w2.sizes[wt and 1 or 0]) ~= hid
      or b1.ndim ~= 1 or tonumber(b1.sizes[0]) ~= hid or b2.ndim ~= 1 or tonumber(b2.sizes[0]) ~= out_f then
    error(('%s: shapes do not chain: x %s, w1 %s, b1 %s, w2 %s, b2 %s'):format(name, dims(x), dims(w1), dims(b1),
      dims(w2), dims(b2)), 2)
  end
  local x2 = rows(x)
  -- (selective checkpointing: each product a linear layer's, as in the plain chain)
  local N = tonumber(x2.sizes[0])
  local s1 = A.sac_on() and A.sac_slot('linear', ('gelu_mlp1 %d %d %d %d'):format(N, in_f, hid, dt)) or nil
  local h, pre
  if s1 and s1.outs then
    pre = s1.outs[1]      -- (the pre-activation kept: the GELU, elementwise, again)
    h = F.gelu(pre)
  elseif s1 and s1.keep then
    -- (kept: the GELU apart from the GEMM here too, so that the forward's
    -- hidden layer is the recompute's bit for bit; the epilogue's GELU
    -- would read the f32 accumulator, the recompute only the kept bf16)
    pre = F.matmul_bias(x2, w1, false, wt, b1)
    h = F.gelu(pre)
    A.sac_keep(s1, pre)
  else
    h, pre = F.matmul_gelu(x2, w1, false, wt, b1)
  end
  local s2 = A.sac_on() and A.sac_slot('linear', ('gelu_mlp2 %d %d %d %d'):format(N, hid, out_f, dt)) or nil
  local y2
  if s2 and s2.outs then y2 = s2.outs[1]
  else
    y2 = F.matmul_bias(h, w2, false, wt, b2)
    if s2 and s2.keep then A.sac_keep(s2, y2) end
  end
  local y = unrows(y2, x, out_f)
  if want(x, w1, b1) or want(w2, b2) then
    local own = { pre, h }
    if x2 ~= x then own[3] = x2 end
    A.record_list(name, y, bwd_gelu_mlp, { x2, w1, pre, h, w2, wt = wt }, own, { x, w1, b1, w2, b2 })
  else
    free(pre); free(h)
    if x2 ~= x then free(x2) end
  end
  return y
end

-- ------------------------------------------------------------ embedding
local function bwd_embedding(node, g)
  local flat = node.saved[1]
  local g2 = rows(g)
  -- the weight's gradient already there (a tied LM head's, or an earlier
  -- micro-batch's): the rows added into it, nothing returned
  local into = A.inplace_leaf_grad(node, 2)
  if into and into.dtype_id == g2.dtype_id then
    F.index_add_(into, 1, flat, g2)
    if g2 ~= g then free(g2) end
    return nil, nil
  end
  local z = T.zeros(node.ishape[2], { dtype = g.dtype_id, device = g.device_id })
  F.index_add_(z, 1, flat, g2)
  if g2 ~= g then free(g2) end
  return nil, z
end

-- ids (any shape, i64/i32, 0-based) -> (ids..., dim)
function nnf.embedding(ids, w)
  need_tensor('embedding', ids, 'the token ids')
  need_tensor('embedding', w, 'the weight')
  if ids.dtype_id ~= 4 and ids.dtype_id ~= 5 then
    error(('embedding: token ids must be i64 or i32, got %s %s'):format(ids.dtype, dims(ids)), 2)
  end
  if w.ndim ~= 2 then error(('embedding: weight must be 2-D (vocab, dim), got %s'):format(dims(w)), 2) end
  local vocab = tonumber(w.sizes[0])
  local flat = ids.ndim == 1 and ids or R.reshape(ids, { -1 })
  local ok, y2 = pcall(F.index_select, w, 1, flat)
  if not ok then
    local id, pos = tostring(y2):match('index (%-?%d+) at position (%S+) is out of range')
    if id then
      error(('embedding: token id %s (at flat position %s of ids %s) is out of range for a vocabulary '
        .. 'of %d (ids must be in 0..%d)'):format(id, pos, dims(ids), vocab, vocab - 1), 2)
    end
    error(y2, 0)
  end
  local s = shape_of(ids)
  s[#s + 1] = tonumber(w.sizes[1])
  local y = y2
  if ids.ndim ~= 1 then
    y = R.view(y2, s)
    free(y2)
  end
  if want(w) then
    -- the node's own handle on the ids, so the caller may free theirs
    local saved = flat ~= ids and flat or R.alias(ids)
    record1('embedding', y, bwd_embedding, { saved }, { saved }, ids, w)
  elseif flat ~= ids then
    free(flat)
  end
  return y
end

-- ----------------------------------------------------------------- norms
-- One node each on the fused ops (F.native_layer_norm / native_rms_norm:
-- core/norm_cpu.c, kernels/norm.cu): math in f32 (f64 for f64 x), the
-- forward saves x and the per-row mean/rstd only, the backward is one op
-- giving dx, dw and db. Inside an autocast region the output is the
-- region's dtype (computed in f32, rounded once).
local function bwd_layer_norm(node, g)
  local s = node.saved
  return F.native_layer_norm_backward(g, s[1], s[2], s[3], s[4],
    { dx = node.need[1] == true, dw = node.need[2] == true, db = node.need[3] == true })
end

-- a norm's weight or bias p: nil or (C), C = x's last dim; the error is
-- raised at the caller of the norm (level 3)
local function norm_param(fname, what, p, x, C)
  if p ~= nil and (p.ndim ~= 1 or tonumber(p.sizes[0]) ~= C) then
    error(('%s: %s %s for an input %s (normalized dim %d)'):format(fname, what, dims(p), dims(x), C), 3)
  end
end

-- y = (x - mean) / sqrt(var + eps) * w + b over the last dim (biased var);
-- y in x's dtype (the region's inside autocast)
function nnf.layer_norm(x, w, b, eps)
  need_tensor('layer_norm', x, 'the input')
  eps = eps or 1e-5
  local C = tonumber(x.sizes[x.ndim - 1])
  norm_param('layer_norm', 'weight', w, x, C)
  norm_param('layer_norm', 'bias', b, x, C)
  local y, mean, rstd = F.native_layer_norm(x, w, b, eps, amp.norm_out_dtype(x))
  if want(x, w, b) then
    record1('layer_norm', y, bwd_layer_norm, { x, mean, rstd, w }, { mean, rstd }, x, w, b)
  else
    free(mean); free(rstd)
  end
  return y
end

local function bwd_rms_norm(node, g)
  local s = node.saved
  return F.native_rms_norm_backward(g, s[1], s[2], s[3], { dx = node.need[1] == true, dw = node.need[2] == true })
end

-- the dtype a * b has (both float): the wider, f32 for bf16 with f16
local function promote_float(a, b)
  if a == b then return a end
  if a == 0 or b == 0 then return 0 end
  return 1
end

-- y = x / sqrt(mean(x^2) + eps) * w over the last dim, in f32 at least (as
-- Hugging Face's LlamaRMSNorm: the normalised x is rounded to x's dtype
-- before the weight multiplies it); y in the dtype of x * w (the region's
-- inside autocast)
function nnf.rms_norm(x, w, eps)
  need_tensor('rms_norm', x, 'the input')
  eps = eps or 1e-6
  local C = tonumber(x.sizes[x.ndim - 1])
  norm_param('rms_norm', 'weight', w, x, C)
  local odt = amp.norm_out_dtype(x, w ~= nil and promote_float(x.dtype_id, w.dtype_id) or nil)
  local y, rstd = F.native_rms_norm(x, w, eps, odt)
  if want(x, w) then
    record1('rms_norm', y, bwd_rms_norm, { x, rstd, w }, { rstd }, x, w)
  else
    free(rstd)
  end
  return y
end

-- add_layer_norm(x, h, w?, b?, eps) -> res, y: the residual add and the
-- LayerNorm after it (a pre-norm block's x + branch, then the next norm),
-- one node of two outputs: res = x + h, y = layer_norm(res). On CUDA one
-- pass reads x and h and writes res and y; the backward adds res's own
-- gradient (the residual stream's) into dx in the norm's pass.
-- the two norms' shared backward bookkeeping. h's gradient comes from the
-- norm's pass in h's own dtype (dxl) when h is a low-precision branch
-- output beside a wider residual stream and the incoming gradient already
-- has h's dtype: no separate cast of dx.
local function wants_low(ctx, res, g_y)
  return ctx.needs_input_grad[2] and ctx.hdt ~= res.dtype_id and ctx.hdt == g_y.dtype_id
end
-- the gradients of x and h from dx (and dxl): dx freed when only h needs one;
-- when both get dx, h gets a handle of its own (the Functions own their
-- results: one storage under two handles is never taken as a leaf's .grad,
-- which backward may add into in place)
local function add_norm_grads(need, dx, dxl)
  if dxl and not need[1] then free(dx) end
  if need[1] and need[2] and not dxl then return dx, R.alias(dx) end
  return need[1] and dx or nil, need[2] and (dxl or dx) or nil
end
-- the backward nodes of affine layers with a bias, and the bias's input
-- index: their output's gradient may come with its column sums (above)
local bias_input = { [bwd_affine] = 3, [bwd_gelu_mlp] = 5 }
-- forward: whether h is the output of an affine layer whose bias needs a
-- gradient (its id then, else nil)
local function affine_with_bias(h)
  local node = h.grad_fn
  local bi = node and bias_input[node.bwd]
  if bi and node.need[bi] and node.oid == tonumber(h.id) then return node.oid end
  return nil
end
local function biased_branch(h)
  if not norm_bias_sum_on then return nil end
  return affine_with_bias(h)
end

-- The same for GPT-2's c_attn, whose output qkv_attention reads: its bias
-- gradient is the column sums of dq, dk, dv, which the wgmma backward
-- kernels add in their epilogues (ms_attention_backward_sum; the CPU sums
-- its outputs). On by default (a GPT-2 step on an H100 0.2% faster than
-- cuBLASLt's BGRAD pass, docs/perf-notes.md): MS_ATTENTION_BIAS_SUM=0 or
-- nnf.set_attention_bias_sum(false) for BGRAD.
local attn_bias_sum_on = os.getenv('MS_ATTENTION_BIAS_SUM') ~= '0'
-- nnf.set_attention_bias_sum(on) -> the previous setting
function nnf.set_attention_bias_sum(on)
  local prev = attn_bias_sum_on
  attn_bias_sum_on = on and true or false
  return prev
end
-- backward: ask for dxl's column sums when h came from such a layer and its
-- gradient (dxl, in g_y's dtype) reaches it unconverted
local function wants_sum(ctx, g_y)
  return norm_bias_sum_on and ctx.hid ~= nil and ctx.needs_input_grad[2] and ctx.hdt == g_y.dtype_id
end
-- after the backward: gh's column sums published for the affine backward
local function publish_sum(ctx, gh, sum)
  if sum == nil then return end
  if gh == nil then free(sum); return end
  publish_pending_sum(ctx.hid, gh, sum)
end

-- (owns_results: the backward's gradients are new tensors the walk frees
-- once handed on, and the saved statistics are freed at its end: nothing of
-- a step waits for the Lua collector)
local AddLayerNorm = A.Function {
  name = 'add_layer_norm',
  owns_results = true,
  forward = function(ctx, x, h, w, b, eps)
    local odt = amp.norm_out_dtype(x, promote_float(x.dtype_id, h.dtype_id))   -- the sum's, as layer_norm(x + h)
    local res, y, mean, rstd = F.native_add_layer_norm(x, h, w, b, eps, odt)
    ctx:save_for_backward(res, mean, rstd, w)
    ctx.hdt = h.dtype_id
    ctx.hid = biased_branch(h)
    return res, y
  end,
  backward = function(ctx, g_res, g_y)
    local st = ctx.saved_tensors
    local need = ctx.needs_input_grad
    -- with the column sums, dxl is wanted even in h's dtype = res's (f32):
    -- the sums are those of the tensor handed on as h's gradient
    local sum = wants_sum(ctx, g_y)
    local dx, dw, db, dxl, dls = F.native_layer_norm_backward_add(g_y, st[1], st[2], st[3], st[4], g_res,
      { dx = need[1] or need[2], dw = need[3] == true, db = need[4] == true,
        dxl = sum or wants_low(ctx, st[1], g_y), dxl_sum = sum })
    free(st[2]); free(st[3])   -- mean, rstd: made by the forward for this alone
    local gx, gh = add_norm_grads(need, dx, dxl)
    publish_sum(ctx, gh, dls)
    return gx, gh, dw, db
  end,
}
function nnf.add_layer_norm(x, h, w, b, eps)
  need_tensor('add_layer_norm', x, 'x')
  need_tensor('add_layer_norm', h, 'h')
  return AddLayerNorm(x, h, w, b, eps or 1e-5)
end

-- add_rms_norm(x, h, w?, eps) -> res, y: the same before an RMSNorm
-- (Llama's residual add and post_attention_layernorm)
local AddRMSNorm = A.Function {
  name = 'add_rms_norm',
  owns_results = true,
  forward = function(ctx, x, h, w, eps)
    local sdt = promote_float(x.dtype_id, h.dtype_id)
    local odt = amp.norm_out_dtype(x, w ~= nil and promote_float(sdt, w.dtype_id) or sdt)
    local res, y, rstd = F.native_add_rms_norm(x, h, w, eps, odt)
    ctx:save_for_backward(res, rstd, w)
    ctx.hdt = h.dtype_id
    ctx.hid = biased_branch(h)
    return res, y
  end,
  backward = function(ctx, g_res, g_y)
    local st = ctx.saved_tensors
    local need = ctx.needs_input_grad
    local sum = wants_sum(ctx, g_y)
    local dx, dw, dxl, dls = F.native_rms_norm_backward_add(g_y, st[1], st[2], st[3], g_res,
      { dx = need[1] or need[2], dw = need[3] == true, dxl = sum or wants_low(ctx, st[1], g_y), dxl_sum = sum })
    free(st[2])   -- rstd: made by the forward for this alone
    local gx, gh = add_norm_grads(need, dx, dxl)
    publish_sum(ctx, gh, dls)
    return gx, gh, dw
  end,
}
function nnf.add_rms_norm(x, h, w, eps)
  need_tensor('add_rms_norm', x, 'x')
  need_tensor('add_rms_norm', h, 'h')
  return AddRMSNorm(x, h, w, eps or 1e-6)
end

-- -------------------------------------------------------------- dropout
local function bwd_dropout(node, g) return F.mul(g, node.saved[1]) end

-- zeroes each element with probability p and scales the rest by 1/(1-p);
-- identity when not training or p == 0. The mask draws from the global RNG
-- (ms.manual_seed) unless opts.seed is given.
function nnf.dropout(x, p, training, opts)
  need_tensor('dropout', x, 'the input')
  p = p or 0.5
  if p < 0 or p > 1 then error(('dropout: p must be in [0, 1], got %s'):format(tostring(p)), 2) end
  if training == false or p == 0 then return x end
  local mask
  if p == 1 then
    mask = T.zeros(shape_of(x), { dtype = x.dtype_id, device = x.device_id })
  else
    local u = T.rand(shape_of(x), { dtype = lowp(x) and 'f32' or x.dtype_id, device = x.device_id,
      seed = opts and opts.seed, offset = opts and opts.offset })
    local keep = F.ge(u, p)
    free(u)
    local kf = R.to(keep, { dtype = x.dtype_id })
    free(keep)
    mask = F.mul(kf, 1 / (1 - p))
    free(kf)
  end
  local y = F.mul(x, mask)
  if want(x) then
    record1('dropout', y, bwd_dropout, { mask }, { mask }, x)
  else
    free(mask)
  end
  return y
end

-- ---------------------------------------------------------- activations
function nnf.gelu(x, approximate)
  if approximate ~= nil and approximate ~= 'tanh' then
    error(("gelu: only approximate = 'tanh' is implemented (got %s)"):format(tostring(approximate)), 2)
  end
  return W.gelu(x)
end
function nnf.silu(x) return W.silu(x) end

-- swiglu(gate, up) = silu(gate) * up, Llama's gated activation, as one node
-- of one pass (F.swiglu): silu(gate) is neither stored nor saved; the
-- backward gives d up = silu(gate) * g (one pass) and d gate =
-- silu'(gate) * g * up (two). Same shapes; gate and up may differ in dtype
-- as for mul.
local function bwd_swiglu(node, g)
  local gate, up = node.saved[1], node.saved[2]
  local dgate, dup
  if node.need[2] then dup = F.swiglu(gate, g) end
  if node.need[1] then
    local t = F.mul(g, up)
    dgate = F.silu_backward(gate, t)
    free(t)
  end
  return dgate, dup
end
function nnf.swiglu(gate, up)
  need_tensor('swiglu', gate, 'the gate')
  need_tensor('swiglu', up, 'up')
  if dims(gate) ~= dims(up) then
    error(('swiglu: gate %s and up %s must have one shape'):format(dims(gate), dims(up)), 2)
  end
  local y = F.swiglu(gate, up)
  if want(gate, up) then record1('swiglu', y, bwd_swiglu, { gate, up }, nil, gate, up) end
  return y
end
function nnf.relu(x) return W.relu(x) end

-- swiglu_cat(gu (..., 2I)) = silu(gu[..., :I]) * gu[..., I:]: the SwiGLU of
-- one product of gate and up laid side by side, one pass each way
-- (ms_moe_swiglu / _backward: silu(gate) neither stored nor saved; the
-- backward's d gate and d up in one pass into one (..., 2I) gradient, the
-- gradient of that product)
-- h2 (N, I) = the SwiGLU of gu2 (N, 2I), contiguous
local function swiglu_rows(gu2)
  local h2 = T.empty({ tonumber(gu2.sizes[0]), tonumber(gu2.sizes[1]) / 2 },
    { dtype = gu2.dtype_id, device = gu2.device_id })
  T.check(T.C.ms_moe_swiglu(h2, gu2), 3)
  return h2
end
-- d13 (N, 2I) = the gradient of gu2 (N, 2I) from g (..., I), any layout
local function swiglu_grad_rows(gu2, g)
  local gc = R.contiguous(g)
  local g2 = rows(gc)
  local d13 = T.empty(shape_of(gu2), { dtype = gu2.dtype_id, device = gu2.device_id })
  T.check(T.C.ms_moe_swiglu_backward(d13, gu2, g2))
  if g2 ~= gc then free(g2) end
  if gc ~= g then free(gc) end
  return d13
end
local function bwd_swiglu_cat(node, g)
  local gu = node.saved[1]
  local gu2 = rows(gu)
  local d2 = swiglu_grad_rows(gu2, g)
  if gu2 ~= gu then free(gu2) end
  local d = R.reshape(d2, shape_of(gu))
  if d ~= d2 then free(d2) end
  return d
end
function nnf.swiglu_cat(gu)
  need_tensor('swiglu_cat', gu, 'gu')
  local s = shape_of(gu)
  if gu.ndim < 1 or s[#s] % 2 ~= 0 then
    error(('swiglu_cat: gu must end in an even dimension (2 I), got %s'):format(dims(gu)), 2)
  end
  local c = R.contiguous(gu)
  local c2 = rows(c)
  local h = unrows(swiglu_rows(c2), c, s[#s] / 2)
  if c2 ~= c then free(c2) end
  if want(gu) then
    record1('swiglu_cat', h, bwd_swiglu_cat, { c }, c ~= gu and { c } or nil, gu)
  elseif c ~= gu then
    free(c)
  end
  return h
end

-- swiglu_gate_up(x, w_gate, w_up) = swiglu(linear(x, w_gate), linear(x,
-- w_up)) with one GEMM over the two weights side by side ((2I, H), their
-- copy in the compute dtype: under autocast the casts write it) and
-- swiglu_cat: one product and one GEMM for each gradient instead of two,
-- one pass for the activation's gradient instead of three, the weights'
-- gradients rows of one (2I, H) product. nn.GatedMLP's forward when its
-- two layers are plain Linears without bias (nn.set_fuse_gate_up).
function nnf.swiglu_gate_up(x, wg, wu)
  need_tensor('swiglu_gate_up', x, 'the input')
  need_tensor('swiglu_gate_up', wg, 'the gate weight')
  need_tensor('swiglu_gate_up', wu, 'the up weight')
  if wg.ndim ~= 2 or dims(wg) ~= dims(wu) or wg.dtype_id ~= wu.dtype_id or wg.device_id ~= wu.device_id then
    error(('swiglu_gate_up: the gate weight %s %s on %s and the up weight %s %s on %s must be alike (I, H)')
      :format(dims(wg), wg.dtype, wg.device, dims(wu), wu.dtype, wu.device), 2)
  end
  local a, b = amp.cast(wg, wu)
  local w = W.cat({ a, b }, 1)
  if a ~= wg then free(a) end   -- (the casts' outputs: only the cat read them)
  if b ~= wu then free(b) end
  return nnf.swiglu_cat(nnf.linear(x, w))
end

-- The (ra + rb, c) view of the storage a and b share when b's elements
-- follow a's: two contiguous (r, c) tensors of one dtype (FSDP's gathered
-- weights and their gradient regions, laid out in registration order and
-- aligned to 16 elements: gate's and up's are side by side); else nil.
local i64_2 = require('ffi').typeof('int64_t[2]')
local function side_by_side(a, b)
  if a.ndim ~= 2 or b.ndim ~= 2 or a.storage == nil or a.storage ~= b.storage or a.dtype_id ~= b.dtype_id then
    return false
  end
  local c, ra = tonumber(a.sizes[1]), tonumber(a.sizes[0])
  return tonumber(b.sizes[1]) == c and tonumber(a.strides[0]) == c and tonumber(a.strides[1]) == 1
    and tonumber(b.strides[0]) == c and tonumber(b.strides[1]) == 1
    and tonumber(b.offset) == tonumber(a.offset) + ra * c
end
nnf.side_by_side = side_by_side
local function joined_rows(a, b)
  if not side_by_side(a, b) then return nil end
  local c = tonumber(a.sizes[1])
  return T.op(T.C.ms_tensor_as_strided, a, 2, i64_2(tonumber(a.sizes[0]) + tonumber(b.sizes[0]), c),
    i64_2(c, 1), a.offset)
end
nnf.joined_rows = joined_rows

-- swiglu_gate_up over weights side by side in one storage (joined_rows:
-- FSDP's): the product with their joint view, no copy; one node of inputs
-- (x, w_gate, w_up), whose backward writes both weights' gradients with one
-- GEMM into their sinks when those are side by side too (the unit's f32
-- buffer), else returns them as rows of one product
local function bwd_swiglu_gate_up(node, g)
  local s = node.saved
  local x2, w, gu2 = s[1], s[2], s[3]
  local d13 = swiglu_grad_rows(gu2, g)
  local dx, dwg, dwu
  if node.need[1] then dx = input_grad(node, d13, w, false) end
  if node.need[2] or node.need[3] then
    local sg, su = A.grad_sink(node, 2), A.grad_sink(node, 3)
    local joint = nil
    if sg and su and sg.written == su.written and sink_fits(sg, d13, x2)
        and type(su.written[su.i]) ~= 'table' and not sg.written[sg.i] == not su.written[su.i] then
      joint = joined_rows(sg.t, su.t)
    end
    local into = nil
    if not joint and not sg and not su and node.need[2] and node.need[3] then
      -- (their .grad side by side, the dtype of the product: FSDP's
      -- gradients straight into its buffer, grad_direct) added into at once
      local a, b = A.inplace_leaf_grad(node, 2), A.inplace_leaf_grad(node, 3)
      if a and b and a.dtype_id == d13.dtype_id then into = joined_rows(a, b) end
    end
    if joint then
      F.gemm_(joint, d13, x2, true, false, 1, sg.written[sg.i] and 1 or 0)
      free(joint)
      sg.written[sg.i], su.written[su.i] = true, true
    elseif into then
      F.gemm_(into, d13, x2, true, false, 1, 1)
      free(into)
    else
      local dw = F.matmul(d13, x2, true, false)   -- (2I, H): gate's rows, then up's
      local I = tonumber(dw.sizes[0]) / 2
      if node.need[2] then dwg = R.narrow(dw, 1, 1, I) end
      if node.need[3] then dwu = R.narrow(dw, 1, I + 1, I) end
      free(dw)
    end
  end
  free(d13)
  return dx, dwg, dwu
end
function nnf.swiglu_gate_up_joined(x, wg, wu)
  local w = joined_rows(wg, wu)
  if w == nil or x.dtype_id ~= wg.dtype_id or x.device_id ~= wg.device_id then
    error(('swiglu_gate_up_joined: the gate weight %s and the up weight %s must be side by side in one storage, '
      .. 'and the input %s %s of their dtype %s and device'):format(dims(wg), dims(wu), dims(x), x.dtype, wg.dtype), 2)
  end
  local x2 = rows(x)
  local gu2 = F.matmul(x2, w, false, true)   -- (N, 2I)
  local h = unrows(swiglu_rows(gu2), x, tonumber(wg.sizes[0]))
  if want(x, wg, wu) then
    local keep_x = A.needs_grad(wg) or A.needs_grad(wu)
    local keep_w = A.needs_grad(x)
    local own = { gu2 }
    if x2 ~= x then if keep_x then own[#own + 1] = x2 else free(x2) end end
    if keep_w then own[#own + 1] = w else free(w) end
    record1('swiglu_gate_up', h, bwd_swiglu_gate_up, { keep_x and x2 or nil, keep_w and w or nil, gu2 }, own,
      x, wg, wu)
  else
    if x2 ~= x then free(x2) end
    free(w); free(gu2)
  end
  return h
end

function nnf.tanh(x) return W.tanh(x) end
function nnf.sigmoid(x) return W.sigmoid(x) end
function nnf.softmax(x, dim) return W.softmax(x, dim or -1) end
function nnf.log_softmax(x, dim) return W.log_softmax(x, dim or -1) end

-- ------------------------------------------------------- cross entropy
local function bwd_cross_entropy(node, g)
  local s = node.saved
  local lsm, tcol, vf, cnt = s[1], s[2], s[3], s[4]
  local p = F.exp(lsm)                           -- softmax (N, V)
  local N = tonumber(lsm.sizes[0])
  local hit = T.full({ N, 1 }, -(1 - s.ls), { dtype = p.dtype_id, device = p.device_id })
  F.scatter_add_(p, 2, tcol, hit)                -- p - (1-ls) * onehot
  free(hit)
  if s.ls > 0 then F.sub_(p, s.ls / s.V) end     -- - ls / V
  -- per-row weight: valid * g (/ count for the mean)
  local gf = g
  if g.dtype_id ~= p.dtype_id then gf = R.to(g, { dtype = p.dtype_id }) end
  local wrow = F.mul(vf, gf)                     -- (N)
  if gf ~= g then free(gf) end
  if s.reduction == 'mean' then F.div_(wrow, cnt) end
  local wcol = R.view(wrow, { N, 1 })
  free(wrow)
  F.mul_(p, wcol)
  free(wcol)
  local d = p
  if s.shape then d = R.view(p, s.shape); free(p) end
  return d
end

-- logits (N, V) or (..., V); targets (N) or (...) integer class ids
function nnf.cross_entropy(logits, targets, opts)
  opts = opts or {}
  need_tensor('cross_entropy', logits, 'the logits')
  need_tensor('cross_entropy', targets, 'the targets')
  local ignore = opts.ignore_index or -100
  local reduction = opts.reduction or 'mean'
  local ls = opts.label_smoothing or 0
  if reduction ~= 'mean' and reduction ~= 'sum' and reduction ~= 'none' then
    error(("cross_entropy: reduction must be 'mean', 'sum' or 'none', got %s"):format(tostring(reduction)), 2)
  end
  if targets.dtype_id ~= 4 and targets.dtype_id ~= 5 then
    error(('cross_entropy: targets must be i64 or i32 class ids, got %s %s'):format(targets.dtype, dims(targets)), 2)
  end
  if logits.ndim < 1 then error('cross_entropy: logits must have a class dim', 2) end
  local V = tonumber(logits.sizes[logits.ndim - 1])
  local N = math.floor(logits:numel() / math.max(V, 1))
  local ts = shape_of(targets)
  local tn = 1
  for i = 1, #ts do tn = tn * ts[i] end
  if targets.ndim ~= logits.ndim - 1 or tn ~= N then
    error(('cross_entropy: logits %s and targets %s: targets must have the logits\' shape without '
      .. 'the class dim'):format(dims(logits), dims(targets)), 2)
  end
  local l2 = rows(logits)
  local lf = lowp(l2) and R.to(l2, 'f32') or l2
  local lsm = F.log_softmax(lf, -1)
  if lf ~= l2 then free(lf) end
  if l2 ~= logits then free(l2) end
  local t1 = targets.ndim == 1 and targets or R.reshape(targets, { -1 })
  local valid = F.ne(t1, ignore)
  local vi = R.to(valid, { dtype = t1.dtype_id })
  local tcl = F.mul(t1, vi)                          -- ignored targets -> class 0
  free(vi)
  if t1 ~= targets then free(t1) end
  local tcol = R.view(tcl, { N, 1 })
  free(tcl)
  local ok, picked = pcall(F.gather, lsm, 2, tcol)
  if not ok then
    local id = tostring(picked):match('index (%-?%d+) at position')
    free(lsm); free(tcol); free(valid)
    if id then
      error(('cross_entropy: target %s is out of range for %d classes (and is not ignore_index = %d)')
        :format(id, V, ignore), 2)
    end
    error(picked, 0)
  end
  local vf = R.to(valid, { dtype = lsm.dtype_id })
  free(valid)
  local loss_i = F.mul(picked, -(1 - ls))            -- (N, 1)
  free(picked)
  if ls > 0 then
    local m = F.mean(lsm, -1, true)                  -- (N, 1)
    F.mul_(m, -ls)
    F.add_(loss_i, m)
    free(m)
  end
  local li = R.view(loss_i, { N })
  free(loss_i)
  F.mul_(li, vf)
  local out, cnt
  if reduction == 'none' then
    out = li
    if targets.ndim ~= 1 then out = R.view(li, ts); free(li) end
  else
    out = F.sum(li)
    free(li)
    if reduction == 'mean' then
      local c = F.sum(vf)
      cnt = F.clamp(c, 1, nil)                       -- all ignored: 0 / 1 = 0
      free(c)
      F.div_(out, cnt)
    end
  end
  if want(logits) then
    local shape = logits.ndim ~= 2 and shape_of(logits) or nil
    record1('cross_entropy', out, bwd_cross_entropy,
      { lsm, tcol, vf, cnt, ls = ls, V = V, reduction = reduction, shape = shape },
      { lsm, tcol, vf, cnt }, logits)
  else
    free(lsm); free(tcol); free(vf); free(cnt)
  end
  return out
end

-- hidden (B, T, C) @ weight^T (V, C) -> logits -> cross entropy with targets
-- (B, T). Fused by default (see the top of this file); on the plain path the
-- logits are freed before returning (nothing keeps them), so the loss costs
-- one (B*T, V) log-softmax of memory until backward.
nnf.fused_linear_cross_entropy = flce.fused_linear_cross_entropy
-- the distillation loss between a student's and a teacher's heads, fused the
-- same way (moonshard.jsd: Liger's fused linear JSD, TRL's generalized JSD)
nnf.fused_linear_jsd = function(...) return require('moonshard.jsd').fused_linear_jsd(...) end
local fused_lm_loss = true
-- use_fused_lm_loss(on): set the default (on ~= nil); returns the previous one
function nnf.use_fused_lm_loss(on)
  local prev = fused_lm_loss
  if on ~= nil then fused_lm_loss = on and true or false end
  return prev
end
function nnf.lm_loss(hidden, weight, targets, opts)
  need_tensor('lm_loss', hidden, 'the hidden states')
  if fused_lm_loss and not (opts and opts.fused == false) then
    return flce.lm_loss(hidden, weight, targets, opts)
  end
  if opts and opts.group ~= nil then
    error(('lm_loss: a vocabulary-parallel head (opts.group: this rank holds %s of the vocabulary rows) needs '
      .. 'the fused loss; nn.functional.use_fused_lm_loss(false) or opts.fused = false cannot compute it'):format(
      is_tensor(weight) and tostring(weight.shape[1]) or '?'), 2)
  end
  local logits = nnf.linear(hidden, weight)
  local loss = nnf.cross_entropy(logits, targets, opts)
  free(logits)
  return loss
end

-- ------------------------------------------------------------ attention
local mask_cache = {}
-- an additive (Tq, Tk) mask, cached under key: -inf where the key's column
-- c and the query's row r (0-based) have c > r + shift (upper) or
-- c < r + shift (not upper), 0 elsewhere
local function band_mask(key, Tq, Tk, shift, upper, dtype, device)
  local m = mask_cache[key]
  if m and m.storage ~= nil then return m end
  local r = T.arange(Tq, { dtype = 'f64', device = device })
  local rv = R.view(r, { Tq, 1 })
  local c = T.arange(Tk, { dtype = 'f64', device = device })
  local cv = R.view(c, { 1, Tk })
  local shifted = F.add(rv, shift)
  local off = upper and F.gt(cv, shifted) or F.gt(shifted, cv)
  m = F.where(off, -math.huge, 0)
  if m.dtype_id ~= T.dtype_id(dtype) then
    local mc = R.to(m, dtype)
    free(m)
    m = mc
  end
  for _, t in ipairs({ r, rv, c, cv, shifted, off }) do free(t) end
  mask_cache[key] = m
  return m
end
-- additive causal mask (Tq, Tk): 0 where key j <= query i + (Tk - Tq), -inf above
function nnf.causal_mask(Tq, Tk, dtype, device)
  return band_mask(Tq .. ':' .. Tk .. ':' .. dtype .. ':' .. device, Tq, Tk, Tk - Tq, true, dtype, device)
end
-- (T, T) additive mask of a sliding window of W (Mistral's): -inf where
-- key j is W or more places before query i (j <= i - W), 0 elsewhere; the
-- causal part is the attention's own
function nnf.window_mask(Tn, W, dtype, device)
  return band_mask('window:' .. Tn .. ':' .. W .. ':' .. dtype .. ':' .. device, Tn, Tn, 1 - W, false, dtype, device)
end
function nnf.clear_caches()
  for k, m in pairs(mask_cache) do free(m); mask_cache[k] = nil end
  nnf.clear_rope_cache()
end

-- repeat kv heads: (B, Hkv, T, D) -> (B, Hkv*rep, T, D), a fresh tensor
local function repeat_kv(k, rep)
  local s = shape_of(k)
  local k5 = R.view(k, { s[1], s[2], 1, s[3], s[4] })
  local e = R.expand(k5, { s[1], s[2], rep, s[3], s[4] })
  local r = R.reshape(e, { s[1], s[2] * rep, s[3], s[4] })
  if r.storage == k.storage then
    -- rep == 1 gives a view: make a handle the node may free
    local c = R.clone(r)
    free(r)
    r = c
  end
  free(k5); free(e)
  return r
end

-- (B, H, T, D) -> (B, Hkv, T, D): sum the gradients of repeated kv heads
local function fold_heads(t, s)
  if s.rep == 1 then return t end
  local k5 = s.kv5   -- (B, Hkv, rep, Tk), then t's own head width (dk: D, dv: Dv)
  local v5 = R.view(t, { k5[1], k5[2], k5[3], k5[4], tonumber(t.sizes[3]) })
  local r = F.sum(v5, 3)
  free(v5); free(t)
  return r
end

local function bwd_sdpa(node, g)
  local s = node.saved
  local q, k, v, att = s[1], s[2], s[3], s[4]
  local gf = g
  if g.dtype_id ~= att.dtype_id then gf = R.to(g, { dtype = att.dtype_id }) end
  local dq, dk, dv
  local gc = R.contiguous(gf)
  if node.need[3] then
    dv = fold_heads(F.matmul(att, gc, true, false), s)  -- (B, Hkv, Tk, Dv)
  end
  if node.need[1] or node.need[2] then
    local datt = F.matmul(gc, v, false, true)       -- (B, H, Tq, Tk)
    local ds = F.softmax_backward(att, datt, -1, false)
    free(datt)
    F.mul_(ds, s.scale)
    if node.need[1] then dq = F.matmul(ds, k) end    -- (B, H, Tq, D)
    if node.need[2] then
      dk = fold_heads(F.matmul(ds, q, true, false), s) -- (B, Hkv, Tk, D)
    end
    free(ds)
  end
  if gc ~= gf then free(gc) end
  if gf ~= g then free(gf) end
  local function back(t, i)
    if t == nil then return nil end
    if t.dtype_id ~= node.idtype[i] then
      local c = R.to(t, { dtype = node.idtype[i] })
      free(t)
      return c
    end
    return t
  end
  return back(dq, 1), back(dk, 2), back(dv, 3)
end

-- The fused path (ms_attention: core/attention_cpu.c on the CPU, the
-- flash-style kernels of kernels/attention.cu on the GPU): one node that
-- saves q, k, v (aliases of the inputs), the output and the per-row
-- log-sum-exp; no (Tq, Tk) matrix is kept for backward.
local attn_box = T.ffi.typeof('ms_tensor*[1]')
local function bwd_fused_attention(node, g)
  local s = node.saved
  if g.dtype_id ~= s.q.dtype_id then g = R.to(g, { dtype = s.q.dtype_id }) end
  local dq, dk, dv = attn_box(), attn_box(), attn_box()
  T.check(T.C.ms_attention_backward(dq, dk, dv, s.q, s.k, s.v, s.out, s.lse, g, s.scale, s.causal and 1 or 0))
  dq, dk, dv = T.wrap(dq[0]), T.wrap(dk[0]), T.wrap(dv[0])
  if not node.need[1] then free(dq); dq = nil end
  if not node.need[2] then free(dk); dk = nil end
  if not node.need[3] then free(dv); dv = nil end
  return dq, dk, dv
end

-- The output's memory is laid out (B, Tq, H, Dv) and y is its (B, H, Tq, Dv)
-- transposed view (as torch's flash attention returns it): the heads merge
-- back into (B, Tq, H*Dv) with a transpose and a view, no copy. (Dv: v's
-- head width, q's when not given.)
local function out_bthd(q, Dv)
  local s = shape_of(q)
  local buf = T.empty({ s[1], s[3], s[2], Dv or s[4] }, { dtype = q.dtype_id, device = q.device_id })
  local y = R.transpose(buf, 2, 3)
  free(buf)
  return y
end

-- the selective-checkpointing signature of an attention call (A.sac_slot)
local function attn_sig(q, k, v, scale, causal)
  return ('%s %s %s %d %.17g %s'):format(table.concat(shape_of(q), 'x'), table.concat(shape_of(k), 'x'),
    table.concat(shape_of(v), 'x'), q.dtype_id, scale, tostring(causal))
end

-- the fused kernel's output y (B, H, Tq, Dv) (out_bthd's view) and its
-- per-row log-sum-exp for q (B, H, Tq, D), k, v (Dv: v's width, or the
-- padded one), or what a selective checkpoint kept of them (A.sac_slot);
-- nil, nil and the status when the kernel refuses (y freed)
local function attention_out(q, k, v, Dv, scale, causal)
  local slot = A.sac_on() and A.sac_slot('attention', attn_sig(q, k, v, scale, causal)) or nil
  if slot and slot.outs then return slot.outs[1], slot.outs[2], 0 end
  local out, lse = attn_box(), attn_box()
  local y = out_bthd(q, Dv)
  out[0] = y
  local rc = T.C.ms_attention(out, lse, q, k, v, scale, causal and 1 or 0)
  if rc ~= 0 then free(y); return nil, nil, rc end
  local l = T.wrap(lse[0])
  if slot and slot.keep then A.sac_keep(slot, y, l) end
  return y, l, 0
end

fused_attention = function(q, k, v, scale, causal)
  local y, l, rc = attention_out(q, k, v, tonumber(v.sizes[3]), scale, causal)
  T.check(rc, 3)
  if want(q, k, v) then
    local qa, ka, va, ya = R.alias(q), R.alias(k), R.alias(v), R.alias(y)
    record1('scaled_dot_product_attention', y, bwd_fused_attention,
      { q = qa, k = ka, v = va, out = ya, lse = l, scale = scale, causal = causal },
      { qa, ka, va, ya, l }, q, k, v)
  else
    free(l)
  end
  return y
end

-- attention_widths(q, D, Dv) -> wq, wv: the head widths the fused kernel
-- runs q/k width D and v width Dv at on q's device and dtype (D and Dv on
-- the CPU; on CUDA the narrowest pair its kernels take: ms_attention_widths,
-- core/ops.h), or nil and the reason when none does (f32 above 128, widths
-- above 192).
local widths_box = T.ffi.typeof('int64_t[2]')
function nnf.attention_widths(q, D, Dv)
  if q.device_id < 0 then return D, Dv end
  local w = widths_box()
  if T.C.ms_attention_widths(q.device_id, q.dtype_id, D, Dv, w, w + 1) ~= 0 then
    return nil, T.ffi.string(T.C.ms_last_error())
  end
  return tonumber(w[0]), tonumber(w[1])
end

-- x (B, H, T, d) copied into a new contiguous (B, H, T, w) tensor whose
-- columns past d are zeros (x itself, aliased, when w == d)
local function pad_heads(x, w)
  local s = shape_of(x)
  if s[4] == w then return R.alias(x) end
  local p = T.zeros({ s[1], s[2], s[3], w }, { dtype = x.dtype_id, device = x.device_id })
  local dst = R.narrow(p, 4, 1, s[4])
  T.raw_copy_(dst, x)
  free(dst)
  return p
end

-- the first d columns of t (B, H, T, w) as a new contiguous tensor; t freed
local function cut_heads(t, d)
  if tonumber(t.sizes[3]) == d then return t end
  local n = R.narrow(t, 4, 1, d)
  local c = R.clone(n)
  free(n); free(t)
  return c
end

-- Fused attention at widths the kernel takes (wq >= D, wv >= Dv), for widths
-- it does not: q and k padded with zero columns (q.kᵀ, and so the softmax,
-- unchanged), v too (the output's extra columns, zeros, dropped). One node:
-- backward pads the output's gradient with zeros, runs the kernel's backward
-- on the padded tensors and keeps the gradients' first D (dv: Dv) columns.
local function bwd_padded_attention(node, g)
  local s = node.saved
  if g.dtype_id ~= s.q.dtype_id then g = R.to(g, { dtype = s.q.dtype_id }) end
  local gp = pad_heads(g, s.wv)
  local dq, dk, dv = attn_box(), attn_box(), attn_box()
  local rc = T.C.ms_attention_backward(dq, dk, dv, s.q, s.k, s.v, s.out, s.lse, gp, s.scale, s.causal and 1 or 0)
  free(gp)
  T.check(rc)
  dq, dk, dv = T.wrap(dq[0]), T.wrap(dk[0]), T.wrap(dv[0])
  if node.need[1] then dq = cut_heads(dq, s.D) else free(dq); dq = nil end
  if node.need[2] then dk = cut_heads(dk, s.D) else free(dk); dk = nil end
  if node.need[3] then dv = cut_heads(dv, s.Dv) else free(dv); dv = nil end
  return dq, dk, dv
end

local function padded_attention(q, k, v, wq, wv, scale, causal)
  local D, Dv = tonumber(q.sizes[3]), tonumber(v.sizes[3])
  local qp, kp, vp = pad_heads(q, wq), pad_heads(k, wq), pad_heads(v, wv)
  local yp, l, rc = attention_out(qp, kp, vp, wv, scale, causal)
  if rc ~= 0 then free(qp); free(kp); free(vp) end
  T.check(rc, 3)
  local y = R.narrow(yp, 4, 1, Dv)   -- (B, H, Tq, Dv), a view
  if want(q, k, v) then
    record1('scaled_dot_product_attention', y, bwd_padded_attention,
      { q = qp, k = kp, v = vp, out = yp, lse = l, scale = scale, causal = causal, D = D, Dv = Dv, wv = wv },
      { qp, kp, vp, yp, l }, q, k, v)
  else
    free(qp); free(kp); free(vp); free(yp); free(l)
  end
  return y
end

-- softmax(q k^T * scale + causal mask) v, heads of k/v repeated for GQA.
-- q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) with H a multiple
-- of Hkv; v's head width its own (DeepSeek's MLA: D 192, Dv 128). Out
-- (B, H, Tq, Dv). The fused kernel where it takes the widths; on a GPU whose
-- kernels lack them, padded to widths they take (padded_attention), else
-- (f32 above 128 on a GPU, widths above 192) the unfused path.
-- the composed attention's operand: t in cdt, its heads repeated r times,
-- contiguous, a handle of its own (a function apart: see defer_weight_bias)
local function sdpa_prep(t, r, cdt)
  local x = t
  if t.dtype ~= cdt then x = R.to(t, cdt) end
  if r > 1 then
    local e = repeat_kv(x, r)
    if x ~= t then free(x) end
    return e
  end
  local c = R.contiguous(x)
  if c == t then c = R.alias(t) end      -- a handle the node owns
  if x ~= t and x ~= c then free(x) end
  return c
end
local sdpa_options = { causal = true, scale = true, mask = true, unfused = true }
function nnf.scaled_dot_product_attention(q, k, v, opts)
  opts = opts or {}
  -- an option it does not know would be ignored: PyTorch's is_causal = false
  -- gave causal attention (causal is on unless causal = false)
  for key in pairs(opts) do
    if not sdpa_options[key] then
      error(('scaled_dot_product_attention: unknown option %s (options: causal, scale, mask, unfused%s)'):format(
        tostring(key), key == 'is_causal' and "; PyTorch's is_causal is causal here, true unless causal = false" or ''), 2)
    end
  end
  need_tensor('scaled_dot_product_attention', q, 'q')
  need_tensor('scaled_dot_product_attention', k, 'k')
  need_tensor('scaled_dot_product_attention', v, 'v')
  if q.ndim ~= 4 or k.ndim ~= 4 or v.ndim ~= 4 then
    error(('scaled_dot_product_attention: q, k, v must be (B, H, T, D), got %s, %s, %s'):format(
      dims(q), dims(k), dims(v)), 2)
  end
  local qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
  local B, H, Tq, D = qs[1], qs[2], qs[3], qs[4]
  local Hkv, Tk, Dv = ks[2], ks[3], vs[4]
  if ks[1] ~= B or vs[1] ~= B or ks[4] ~= D or vs[2] ~= Hkv or vs[3] ~= Tk or H % Hkv ~= 0 then
    error(('scaled_dot_product_attention: shapes q %s, k %s, v %s do not fit (q (B, H, Tq, D), k (B, Hkv, Tk, D), '
      .. 'v (B, Hkv, Tk, Dv) with H a multiple of Hkv)'):format(dims(q), dims(k), dims(v)), 2)
  end
  local rep = H / Hkv
  local scale = opts.scale or 1 / math.sqrt(D)
  local causal = opts.causal ~= false
  if opts.mask == nil and not opts.unfused and q.dtype_id == k.dtype_id and q.dtype_id == v.dtype_id
      and q.device_id == k.device_id and q.device_id == v.device_id then
    local wq, wv = nnf.attention_widths(q, D, Dv)
    if wq == D and wv == Dv then return fused_attention(q, k, v, scale, causal) end
    if wq then return padded_attention(q, k, v, wq, wv, scale, causal) end
  elseif opts.mask == nil and not opts.unfused then
    return fused_attention(q, k, v, scale, causal)   -- (which names the mismatch)
  end
  local cdt = lowp(q) and 'f32' or q.dtype
  local qc, ke, ve = sdpa_prep(q, 1, cdt), sdpa_prep(k, rep, cdt), sdpa_prep(v, rep, cdt)
  local sc = F.matmul(qc, ke, false, true)  -- (B, H, Tq, Tk)
  F.mul_(sc, scale)
  if causal then F.add_(sc, nnf.causal_mask(Tq, Tk, cdt, q.device_id)) end
  if opts.mask ~= nil then F.add_(sc, opts.mask) end
  local att = F.softmax(sc, -1)
  free(sc)
  local y = F.matmul(att, ve)               -- (B, H, Tq, Dv)
  if y.dtype_id ~= q.dtype_id then
    local yc = R.to(y, { dtype = q.dtype_id })
    free(y)
    y = yc
  end
  if want(q, k, v) then
    record1('scaled_dot_product_attention', y, bwd_sdpa,
      { qc, ke, ve, att, scale = scale, rep = rep, kv5 = { B, Hkv, rep, Tk } },
      { qc, ke, ve, att }, q, k, v)
  else
    free(qc); free(ke); free(ve); free(att)
  end
  return y
end

-- qkv_attention(qkv (B, T, 3*H*D), n_head, {causal = true, scale =}) ->
-- (B, T, H*D): GPT-2's fused projection split into q, k, v heads, causal
-- attention, heads merged, as one node. q, k and v are views of qkv read
-- in place; the output is written in (B, T, H, D) order, so the merge is
-- a view; the backward writes dq, dk and dv straight into their columns of
-- one (B, T, 3*H*D) gradient. The same result as the narrow / view /
-- transpose / scaled_dot_product_attention chain, whose backward pays for
-- three zero-filled (B, T, 3*H*D) gradients, the copies into them, their
-- sum and a copy per head split.
local function qkv_views(t, H)
  local s = shape_of(t)
  local B, Tn, C = s[1], s[2], s[3] / 3
  local D = C / H
  local vs = {}
  for i = 1, 3 do
    local n = R.narrow(t, 3, (i - 1) * C + 1, C)
    local v4 = R.view(n, { B, Tn, H, D })
    vs[i] = R.transpose(v4, 2, 3)             -- (B, H, T, D), strides of t
    free(n); free(v4)
  end
  return vs[1], vs[2], vs[3]
end

local function bwd_qkv_attention(node, g)
  local s = node.saved
  local y4 = s.y4
  local gc = g
  if g.dtype_id ~= y4.dtype_id then gc = R.to(g, { dtype = y4.dtype_id }) end
  local gs = shape_of(y4)                      -- (B, H, T, D)
  local g4 = R.reshape(gc, { gs[1], gs[3], gs[2], gs[4] })
  local gt = R.transpose(g4, 2, 3)
  local dqkv = T.empty(shape_of(s.qkv), { dtype = s.qkv.dtype_id, device = s.qkv.device_id })
  local dq, dk, dv = qkv_views(dqkv, gs[2])
  local bq, bk, bv = attn_box(), attn_box(), attn_box()
  bq[0], bk[0], bv[0] = dq, dk, dv
  local q, k, v = qkv_views(s.qkv, gs[2])
  local sum
  if s.hid and attn_bias_sum_on and s.qkv.dtype_id ~= 0 then
    -- c_attn's bias gradient: the column sums of dq, dk, dv (q, k, v heads),
    -- summed in f64 and stored in f32 (an f64 model's sums stay f64: its
    -- bias gradient takes the plain column sum of dqkv)
    local ds = T.empty({ 3 * gs[2] * gs[4] }, { dtype = 'f32', device = s.qkv.device_id })
    local r = T.C.ms_attention_backward_sum(bq, bk, bv, q, k, v, y4, s.lse, gt, s.scale, s.causal and 1 or 0, ds)
    if r < 0 then free(ds); T.check(r) end
    if r == 1 then sum = R.to(ds, { dtype = dqkv.dtype_id }) end
    if sum ~= ds then free(ds) end
  else
    T.check(T.C.ms_attention_backward(bq, bk, bv, q, k, v, y4, s.lse, gt, s.scale, s.causal and 1 or 0))
  end
  free(q); free(k); free(v); free(dq); free(dk); free(dv); free(g4); free(gt)
  if gc ~= g then free(gc) end
  if sum ~= nil then publish_pending_sum(s.hid, dqkv, sum) end
  return dqkv
end

function nnf.qkv_attention(qkv, n_head, opts)
  opts = opts or {}
  need_tensor('qkv_attention', qkv, 'qkv')
  local s = shape_of(qkv)
  if qkv.ndim ~= 3 or type(n_head) ~= 'number' or n_head < 1 or n_head % 1 ~= 0 or s[3] % (3 * n_head) ~= 0 then
    error(('qkv_attention: qkv must be (B, T, 3 * n_head * head_dim), got %s with n_head %s'):format(
      dims(qkv), tostring(n_head)), 2)
  end
  local B, Tn, C = s[1], s[2], s[3] / 3
  local scale = opts.scale or 1 / math.sqrt(C / n_head)
  local causal = opts.causal ~= false
  local q, k, v = qkv_views(qkv, n_head)
  local y4, l, rc = attention_out(q, k, v, C / n_head, scale, causal)
  free(q); free(k); free(v)
  T.check(rc, 2)
  local yt = R.transpose(y4, 2, 3)             -- (B, T, H, D), contiguous
  local y = R.view(yt, { B, Tn, C })
  free(yt)
  if want(qkv) then
    local qa, ya = R.alias(qkv), R.alias(y4)
    record1('qkv_attention', y, bwd_qkv_attention,
      { qkv = qa, y4 = ya, lse = l, scale = scale, causal = causal, hid = attn_bias_sum_on and affine_with_bias(qkv) or nil },
      { qa, ya, l }, qkv)
  else
    free(l)
  end
  free(y4)
  return y
end

-- ----------------------------------------------------------------- RoPE
-- rotate_half(x) = cat(-x2, x1) with x1, x2 the halves of the last dim
local function rotate_half(x, sign)
  local D = tonumber(x.sizes[x.ndim - 1])
  local h = D / 2
  local x1 = R.narrow(x, -1, 1, h)
  local x2 = R.narrow(x, -1, h + 1, h)
  local r
  if sign > 0 then
    local n2 = F.neg(x2)
    r = F.cat({ n2, x1 }, -1)            -- R x  = (-x2, x1)
    free(n2)
  else
    local n1 = F.neg(x1)
    r = F.cat({ x2, n1 }, -1)            -- R^T u = (u2, -u1)
    free(n1)
  end
  free(x1); free(x2)
  return r
end

local function bwd_rotary(node, g)
  local cos, sin = node.saved[1], node.saved[2]
  local a = F.mul(g, cos)
  local u = F.mul(g, sin)
  local ru = rotate_half(u, -1)
  free(u)
  F.add_(a, ru)
  free(ru)
  return a
end

local function bwd_rope(node, g) return F.rope_backward(g, node.saved[1], node.saved[2]) end

-- cos and sin fit the fused op: (T, D) for x (..., T, D), on x's device
local function rope_fits(x, cos, sin)
  if not (is_tensor(cos) and is_tensor(sin)) or x.ndim < 2 or cos.ndim ~= 2 or sin.ndim ~= 2 then return false end
  local T_, D = x.sizes[x.ndim - 2], x.sizes[x.ndim - 1]
  return cos.sizes[0] == T_ and cos.sizes[1] == D and sin.sizes[0] == T_ and sin.sizes[1] == D
    and cos.device_id == x.device_id and sin.device_id == x.device_id
end

-- nnf.pairs_to_halves(x (..., d)) -> x's last dimension from (x0, x1),
-- (x2, x3), ... pairs (the interleaved RoPE of DeepSeek's and Meta's
-- checkpoints) to (x0, x2, ... | x1, x3, ...) halves (a copy), so that the
-- rotation is the rotate-half one of nnf.apply_rotary. The same permutation
-- of q's and k's features leaves q . k (and an L2 norm) as they are: the
-- attention never needs them put back.
function nnf.pairs_to_halves(x)
  local s = x.shape
  local n = #s
  local s5 = {}
  for i = 1, n - 1 do s5[i] = s[i] end
  s5[n], s5[n + 1] = s[n] / 2, 2
  return x:reshape(s5):transpose(n, n + 1):reshape(s)
end

-- x * cos + rotate_half(x) * sin (Hugging Face Llama's apply_rotary_pos_emb);
-- cos and sin (T, D) broadcast over x (..., T, D) and are constants. With
-- (T, D) cos/sin this is the fused op (F.rope: core/rope_cpu.c,
-- kernels/rope.cu; x read in place in any layout on the GPU, y in x's
-- dtype); other shapes of cos/sin take the composed path.
function nnf.apply_rotary(x, cos, sin)
  need_tensor('apply_rotary', x, 'x')
  local D = tonumber(x.sizes[x.ndim - 1])
  if D % 2 ~= 0 then error(('apply_rotary: the last dim of x %s must be even'):format(dims(x)), 2) end
  if rope_fits(x, cos, sin) then
    local y = F.rope(x, cos, sin)
    if want(x) then record1('apply_rotary', y, bwd_rope, { cos, sin }, nil, x) end
    return y
  end
  local rh = rotate_half(x, 1)
  local y = F.mul(x, cos)
  local t = F.mul(rh, sin)
  free(rh)
  F.add_(y, t)
  free(t)
  if want(x) then record1('apply_rotary', y, bwd_rotary, { cos, sin }, nil, x) end
  return y
end

-- cos, sin (T, head_dim) for positions 0..T-1: inv_freq = theta^(-2i/d),
-- emb = cat(freqs, freqs) as Hugging Face builds it; computed in f64 and
-- cast to dtype; cached. theta may also be a table made by nnf.yarn_rope
-- (or any { key =, inv = { head_dim / 2 frequencies }, factor = the
-- tables' multiplier }).
local rope_cache = {}

-- nnf.llama3_rope(theta, head_dim, p) -> the RoPE of rope_type 'llama3'
-- (Llama 3.1's context extension, Meta's apply_scaling): each frequency f of
-- wavelength 2 pi / f is kept when the wavelength is below L / high_freq_factor
-- (L = original_max_position_embeddings), divided by factor when above
-- L / low_freq_factor, and in between blended: (1 - s) f / factor + s f with
-- s = (L / wavelength - low) / (high - low). A table for nnf.rope_cache's theta.
-- nnf.linear_rope(theta, head_dim, p): rope_type 'linear', every frequency
-- divided by p.factor (positions interpolated).
local function rope_need(kind, p, names)
  for _, k in ipairs(names) do
    if type(p[k]) ~= 'number' or p[k] <= 0 then
      error(('%s_rope: %s must be a positive number, got %s'):format(kind, k, tostring(p[k])), 3)
    end
  end
end
function nnf.llama3_rope(theta, head_dim, p)
  rope_need('llama3', p, { 'factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings' })
  local factor, lo, hi, L = p.factor, p.low_freq_factor, p.high_freq_factor, p.original_max_position_embeddings
  if hi < lo then
    error(('llama3_rope: high_freq_factor (%g) must not be below low_freq_factor (%g)'):format(hi, lo), 2)
  end
  local inv = {}
  for i = 0, head_dim / 2 - 1 do
    local f = 1 / theta ^ (2 * i / head_dim)
    local wl = 2 * math.pi / f
    if wl < L / hi then inv[i + 1] = f
    elseif wl > L / lo then inv[i + 1] = f / factor
    elseif hi == lo then inv[i + 1] = f   -- (no blended band: the edge itself kept)
    else
      local sm = (L / wl - lo) / (hi - lo)
      inv[i + 1] = (1 - sm) * f / factor + sm * f
    end
  end
  return { key = ('llama3:%.17g:%d:%.17g:%.17g:%.17g:%.17g'):format(theta, head_dim, factor, lo, hi, L), inv = inv,
    factor = 1 }
end
function nnf.linear_rope(theta, head_dim, p)
  rope_need('linear', p, { 'factor' })
  local inv = {}
  for i = 0, head_dim / 2 - 1 do inv[i + 1] = 1 / theta ^ (2 * i / head_dim) / p.factor end
  return { key = ('linear:%.17g:%d:%.17g'):format(theta, head_dim, p.factor), inv = inv, factor = 1 }
end

-- nnf.yarn_rope(theta, head_dim, p) -> the RoPE of rope_type 'yarn' (Peng
-- et al. 2023, "YaRN"), with the frequencies and the attention factor
-- Hugging Face's modeling_rope_utils computes from rope_parameters p:
-- factor, original_max_position_embeddings, beta_fast (32), beta_slow (1),
-- mscale, mscale_all_dim, attention_factor, truncate (true). Each
-- frequency blends theta^(-2i/d) (extrapolation) and that over factor
-- (interpolation) by a ramp between the dimensions that turn beta_fast and
-- beta_slow times over the original context; cos and sin are scaled by the
-- attention factor (0.1 ln(factor) + 1 by default; with both mscales the
-- ratio of their two such terms). A table for nnf.rope_cache's theta.
function nnf.yarn_rope(theta, head_dim, p)
  local factor, orig = p.factor, p.original_max_position_embeddings
  if type(factor) ~= 'number' or factor <= 0 then
    error(('yarn_rope: factor must be a positive number, got %s'):format(tostring(factor)), 2)
  end
  if type(orig) ~= 'number' or orig <= 0 then
    error(('yarn_rope: original_max_position_embeddings must be a positive number, got %s'):format(tostring(orig)), 2)
  end
  local function mscale(scale, m)
    if scale <= 1 then return 1 end
    return 0.1 * (m or 1) * math.log(scale) + 1
  end
  local af = p.attention_factor
  if af == nil then
    if p.mscale and p.mscale ~= 0 and p.mscale_all_dim and p.mscale_all_dim ~= 0 then
      af = mscale(factor, p.mscale) / mscale(factor, p.mscale_all_dim)
    else
      af = mscale(factor)
    end
  end
  local fast, slow = p.beta_fast or 32, p.beta_slow or 1
  if fast == 0 then fast = 32 end
  if slow == 0 then slow = 1 end
  local d = head_dim
  -- the dimension that turns n times over the original context
  local function dim_of(n) return d * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(theta)) end
  local lo, hi = dim_of(fast), dim_of(slow)
  if p.truncate ~= false then lo, hi = math.floor(lo), math.ceil(hi) end
  lo, hi = math.max(lo, 0), math.min(hi, d - 1)
  if lo == hi then hi = hi + 0.001 end
  local inv = {}
  for i = 0, d / 2 - 1 do
    local pf = theta ^ (2 * i / d)
    local ramp = math.min(math.max((i - lo) / (hi - lo), 0), 1)
    local ex = 1 - ramp   -- the share of extrapolation
    inv[i + 1] = (1 / (factor * pf)) * (1 - ex) + (1 / pf) * ex
  end
  local key = ('yarn:%.17g:%d:%.17g:%.17g:%.17g:%.17g:%.17g:%s'):format(theta, d, factor, orig, fast, slow, af,
    tostring(p.truncate ~= false))
  return { key = key, inv = inv, factor = af }
end
-- as: a dtype the tables are then cast to (from dtype's, cached too: the
-- bf16 tables of a bf16 model, rounded from the f32 ones, not made again
-- each forward)
-- t (f64) in dtype on device (t freed when copied)
local function rope_fin(t, dtype, device)
  local r = R.to(t, { dtype = dtype, device = device })
  if r ~= t then free(t) end
  return r
end
function nnf.rope_cache(T_, head_dim, theta, dtype, device, as)
  dtype = dtype or 'f32'
  device = device or -1
  local tkey = type(theta) == 'table' and theta.key or theta
  if as ~= nil and as ~= dtype then
    local key = T_ .. ':' .. head_dim .. ':' .. tkey .. ':' .. tostring(dtype) .. ':' .. tostring(device) .. ':as:' .. tostring(as)
    local c = rope_cache[key]
    if c and c[1].storage ~= nil then return c[1], c[2] end
    local cs, sn = nnf.rope_cache(T_, head_dim, theta, dtype, device)
    c = { R.to(cs, { dtype = as }), R.to(sn, { dtype = as }) }
    rope_cache[key] = c
    return c[1], c[2]
  end
  local key = T_ .. ':' .. head_dim .. ':' .. tkey .. ':' .. tostring(dtype) .. ':' .. tostring(device)
  local c = rope_cache[key]
  if c and c[1].storage ~= nil then return c[1], c[2] end
  local h = head_dim / 2
  local inv, mult = {}, 1
  if type(theta) == 'table' then
    if #theta.inv ~= h then
      error(('rope_cache: %d frequencies for head_dim %d (%d expected)'):format(#theta.inv, head_dim, h), 2)
    end
    for i = 1, h do inv[i] = theta.inv[i] end
    mult = theta.factor or 1
  else
    for i = 0, h - 1 do inv[i + 1] = 1 / theta ^ (2 * i / head_dim) end
  end
  local pos = T.arange(T_, { dtype = 'f64' })
  local pv = R.view(pos, { T_, 1 })
  local iv = T.tensor({ inv }, { dtype = 'f64' })        -- (1, h)
  local fr = F.mul(pv, iv)                               -- (T, h)
  local emb = F.cat({ fr, fr }, -1)                      -- (T, d)
  local cs, sn = F.cos(emb), F.sin(emb)
  if mult ~= 1 then F.mul_(cs, mult); F.mul_(sn, mult) end
  for _, t in ipairs({ pos, pv, iv, fr, emb }) do free(t) end
  cs, sn = rope_fin(cs, dtype, device), rope_fin(sn, dtype, device)
  rope_cache[key] = { cs, sn }
  return cs, sn
end
function nnf.clear_rope_cache()
  for k, c in pairs(rope_cache) do free(c[1]); free(c[2]); rope_cache[k] = nil end
end

-- ------------------------------------------------------------- autocast
-- (moonshard.amp) linear and conv1d_linear cast their own inputs; the
-- other matmul-like entry points are wrapped here, so they cast whatever
-- their definitions above become. lm_loss stays looked up at call time.
nnf.autocast, nnf.set_precision = amp.autocast, amp.set_precision
do
  local sdpa = nnf.scaled_dot_product_attention
  function nnf.scaled_dot_product_attention(q, k, v, opts)
    if amp.dtype() ~= nil then q, k, v = amp.cast(q, k, v) end
    return sdpa(q, k, v, opts)
  end
  local qkv_attention = nnf.qkv_attention
  function nnf.qkv_attention(qkv, n_head, opts)
    if amp.dtype() ~= nil then qkv = amp.cast(qkv) end
    return qkv_attention(qkv, n_head, opts)
  end
  local lm_loss = nnf.lm_loss
  function nnf.lm_loss(hidden, weight, targets, opts)
    local region = amp.dtype()
    if region ~= nil then
      hidden = amp.cast(hidden)
      -- the fused loss of an f32 weight: compute with an unrecorded bf16
      -- copy and give the f32 gradient straight to the weight
      -- (opts.master_weight): no bf16 grad_W, no cast back, and with f32
      -- accumulation the accumulator is the gradient itself
      if is_tensor(weight) and weight.dtype_id == 1 and fused_lm_loss and not (opts and (opts.fused == false
          or opts.master_weight ~= nil or opts.group ~= nil or opts.reduction == 'none' or opts.bias ~= nil)) then
        local wl = R.to(weight, { dtype = region })
        local o = { master_weight = weight }
        for k, v in pairs(opts or {}) do o[k] = v end
        local loss = lm_loss(hidden, wl, targets, o)
        free(wl)   -- the fused loss keeps no reference to W (its gradients are made in the forward)
        return loss
      end
      weight = amp.cast(weight)
    end
    return lm_loss(hidden, weight, targets, opts)
  end
end

return nnf
