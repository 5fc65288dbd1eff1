-- moonshard.nn.moe — mixture-of-experts feed-forward layers (docs/moe.md).
--
-- nn.MoE: token-choice top-k routing (Shazeer et al. 2017; Switch and
-- GShard's load-balancing loss; Mixtral's and Qwen-MoE's layers), dropless:
-- every token goes to its k experts, however many pick the same one. The
-- experts are SwiGLU MLPs with parameters of their own (Hugging Face's
-- names), so FSDP, checkpoints and optimizers see ordinary parameters.
--
-- One forward, N tokens of width H, E experts:
--   1. router logits x Wgᵀ (N, E), in f32; scores softmax (or sigmoid);
--   2. the k best experts of each token (k passes of argmax: ties go to the
--      lower expert), their scores (renormalised to sum 1 when norm_topk);
--   3. the N·k (token, expert) slots sorted by expert, stable, on the
--      rows' device (on the CPU ms_moe_sort_slots, on GPUs ms_moe_sort:
--      kernels/moe.cu), each expert's run padded to 128 rows on GPUs; one
--      small host read a layer, the experts' counts and padded rows (they
--      size the GEMMs): on GPUs through page-locked memory with no stream
--      sync, the shared expert queued before the wait (moe.routing_read);
--   4. the tokens' rows gathered in that order (ms_moe_gather_rows), each
--      expert's run through its MLP (ms_moe_experts_forward: the loop in C);
--   5. each token's k rows weighted by their routing weights and summed
--      (ms_moe_combine); a shared expert (Qwen-MoE, DeepSeek) adds its
--      dense MLP.
-- Three autograd nodes carry the rows (Dispatch, Experts, Combine), each
-- with its backward in C and CUDA; the router and the weights are
-- ordinary autograd ops. An expert no token chose still gets a gradient
-- (zeros), so that every rank's parameters have one and data-parallel
-- reductions stay in step. Two auxiliary losses read a forward's routing:
-- Switch / GShard's load-balancing loss (moe.aux_loss, and the models'
-- sessions, moe.aux_begin / aux_end) and DeepSeek's sequence-wise balance
-- loss (moe.seq_aux_loss; sessions moe.seq_aux_begin / seq_aux_end). The
-- sessions give a checkpointed layer its gradient in the recompute.
-- (moonshard itself when first used: this file loads while it does)
local ms = setmetatable({}, { __index = function(_, k) return require('moonshard')[k] end })
local A = require 'moonshard.autograd'
local T = require 'moonshard.tensor'
local amp = require 'moonshard.amp'
local F = require 'moonshard.ops'

local moe = {}

-- rows each expert's run is padded to (moe.sort_slots): on GPUs 128, so
-- that the experts' GEMM shapes recur from step to step and their cuBLASLt
-- plans are reused; on the CPU none (cpu_align: specs pad there too)
moe.align, moe.cpu_align = 128, 1

-- the experts' GEMMs take cuBLASLt's first choice: their shapes follow the
-- routing, and timing the candidates of each new one (GEMM tuning) would
-- cost more than it saves
local function untuned(dev, fn, ...)
  if dev == 'cpu' then return fn(...) end
  local cuda = ms.cuda
  local prev = cuda.gemm_tune(false)
  local ok, a, b = pcall(fn, ...)
  cuda.gemm_tune(prev)
  if not ok then error(a, 0) end
  return a, b
end

-- an expert: down(silu(gate(x)) * up(x)), its linears named as the model's
-- checkpoints name them (Mixtral: w1, w3, w2; Qwen-MoE: gate_proj, up_proj,
-- down_proj)
local function expert_class(nn, nnf)
  local Expert = nn.Module:extend('MoEExpert')
  function Expert:init(cfg)
    local names = cfg.names
    self.dim, self.hidden, self.names = cfg.dim, cfg.hidden, names
    local o = { bias = false, dtype = cfg.dtype, device = cfg.device }
    self:register_module(names[1], nn.Linear(cfg.dim, cfg.hidden, o))
    self:register_module(names[2], nn.Linear(cfg.dim, cfg.hidden, o))
    self:register_module(names[3], nn.Linear(cfg.hidden, cfg.dim, o))
  end
  function Expert:forward(x)
    local n = self.names
    return self[n[3]](nnf.swiglu(self[n[1]](x), self[n[2]](x)))
  end
  function Expert:extra_repr() return ('dim=%d, hidden=%d'):format(self.dim, self.hidden) end
  return Expert
end

-- The rows' moves (core/moe.c, kernels/moe.cu: one pass each, one block a
-- row on CUDA):
local function check(rc) T.check(rc, 3) end
-- rows of x by idx (M): zeros where idx[r] is x's row count (ms_moe_gather_rows)
local function gather(x, idx)
  local xc = x:contiguous()
  local out = T.empty({ idx.shape[1], x.shape[2] }, { dtype = x.dtype, device = x.device })
  check(T.C.ms_moe_gather_rows(out, xc, idx))
  if xc ~= x then xc:free() end
  return out
end
-- Dispatch(x2 (N, H), tok, inv, k) -> xs (M, H): row r the token tok[r]
-- (zeros at the padding between the experts' runs); backward: each
-- token's k rows (inv: slot -> row) summed.
local Dispatch = A.Function {
  name = 'moe_dispatch',
  owns_results = true,
  forward = function(ctx, x2, tok, inv, k)
    ctx.inv, ctx.k = inv, k
    return gather(x2, tok)
  end,
  backward = function(ctx, g)
    local gc = g:contiguous()
    local N = ctx.inv.shape[1] / ctx.k
    local gx = T.empty({ N, g.shape[2] }, { dtype = g.dtype, device = g.device })
    check(T.C.ms_moe_combine(gx, gc, ctx.inv, nil, ctx.k))
    if gc ~= g then gc:free() end
    return gx, nil, nil, nil
  end,
}
-- Combine(ys (M, H), w (N·k), inv, back, k) -> (N, H): each token's k rows
-- weighted by its routing weights and summed; backward: each row the
-- token's gradient times its weight (zeros at the padding), and each
-- weight's gradient (the token's gradient . the row)
local Combine = A.Function {
  name = 'moe_combine',
  owns_results = true,
  forward = function(ctx, ys, w, inv, back, k)
    local N = inv.shape[1] / k
    local wc = w:contiguous()
    ctx.ys, ctx.w, ctx.back, ctx.k = ys, wc, back, k
    local out = T.empty({ N, ys.shape[2] }, { dtype = ys.dtype, device = ys.device })
    check(T.C.ms_moe_combine(out, ys, inv, wc, k))
    return out
  end,
  backward = function(ctx, g)
    local gc = g.dtype == ctx.ys.dtype and g:contiguous() or g:to(ctx.ys.dtype)
    local gys = T.empty(ctx.ys.shape, { dtype = ctx.ys.dtype, device = ctx.ys.device })
    local gw = ctx.w and T.empty(ctx.w.shape, { dtype = ctx.w.dtype, device = ctx.w.device }) or nil
    check(T.C.ms_moe_combine_backward(gys, gw, gc, ctx.ys, ctx.back, ctx.w, ctx.k))
    if gc ~= g then gc:free() end
    ctx.ys, ctx.w = nil, nil
    return gys, gw, nil, nil, nil
  end,
}

-- Collect(ys (M, H), inv, tok, k) -> (N, H): each token's k rows summed as
-- they are (scale_input: the routing weights were applied to the experts'
-- inputs); backward: each row the token's gradient (zeros at the padding),
-- the rows gathered as Dispatch gathers them. Dispatch's adjoint.
local Collect = A.Function {
  name = 'moe_collect',
  owns_results = true,
  forward = function(ctx, ys, inv, tok, k)
    local N = inv.shape[1] / k
    ctx.tok = tok
    local out = T.empty({ N, ys.shape[2] }, { dtype = ys.dtype, device = ys.device })
    check(T.C.ms_moe_combine(out, ys, inv, nil, k))
    return out
  end,
  backward = function(ctx, g) return gather(g, ctx.tok), nil, nil, nil end,
}

-- scale_input's rows (N·k, H): slot j of token n is x2's row n times w[n][j]
-- (w (N, k) in x2's dtype, as transformers' Llama 4 casts its scores)
local function scaled_slots(x2, w, k)
  local N, H = x2.shape[1], x2.shape[2]
  if w.dtype ~= x2.dtype then w = w:to(x2.dtype) end
  if k == 1 then return x2 * w end
  return (x2:reshape({ N, 1, H }) * w:reshape({ N, k, 1 })):reshape({ N * k, H })
end

-- Regroup(x (R, H), fwd, bwd) -> (M, H): row r = x row fwd[r] (zeros where
-- fwd[r] == R); backward: row j of the input's gradient = the gradient's
-- row bwd[j] (zeros where bwd[j] == M). A bijection between the real rows
-- (expert parallelism's reorder of the rows it received), both ways a gather.
local Regroup = A.Function {
  name = 'moe_regroup',
  owns_results = true,
  forward = function(ctx, x, fwd, bwd)
    ctx.bwd = bwd
    return gather(x, fwd)
  end,
  backward = function(ctx, g) return gather(g, ctx.bwd), nil, nil end,
}

-- expert parallelism's exchange (moe.expert_parallel): x's rows in blocks
-- of send[p] for group rank p - 1 in turn; returns the blocks received,
-- recv[p] rows from each, in rank order (dist.batch_p2p over the group; a
-- rank's own block copied)
local function exchange_rows(x, send, recv, ep)
  local xc = x:contiguous()
  local H = x.shape[2]
  -- (a receive into a buffer of its own a peer: batch_p2p takes no two
  -- operations on one storage when one receives)
  local ops, views, parts, so = {}, {}, {}, 0
  for p = 1, ep.size do
    local ns, nr = send[p], recv[p]
    if p - 1 == ep.rank then
      if nr > 0 then parts[p] = xc:narrow(1, so + 1, ns); views[#views + 1] = parts[p] end
    else
      if ns > 0 then views[#views + 1] = xc:narrow(1, so + 1, ns); ops[#ops + 1] = { 'send', views[#views], ep.ranks[p] } end
      if nr > 0 then
        parts[p] = T.empty({ nr, H }, { dtype = x.dtype, device = x.device })
        ops[#ops + 1] = { 'recv', parts[p], ep.ranks[p] }
      end
    end
    so = so + ns
  end
  if #ops > 0 then ms.dist.batch_p2p(ops, { group = ep.group }) end
  local list = {}
  for p = 1, ep.size do if parts[p] then list[#list + 1] = parts[p] end end
  local out
  if #list == 0 then out = T.empty({ 0, H }, { dtype = x.dtype, device = x.device })
  else out = require('moonshard.ops').cat(list, 1) end
  for p = 1, ep.size do if parts[p] and p - 1 ~= ep.rank then parts[p]:free() end end
  for _, v in ipairs(views) do v:free() end
  if xc ~= x then xc:free() end
  return out
end
local Exchange = A.Function {
  name = 'moe_exchange',
  owns_results = true,
  forward = function(ctx, x, send, recv, ep)
    ctx.send, ctx.recv, ctx.ep = send, recv, ep
    return exchange_rows(x, send, recv, ep)
  end,
  backward = function(ctx, g) return exchange_rows(g, ctx.recv, ctx.send, ctx.ep), nil, nil, nil end,
}

-- Experts(xs (M, H), rows, w...) -> (M, H): each expert's run of rows
-- (rows[e] of them, in order) through its SwiGLU MLP, w the E experts'
-- (gate, up, down) weights in turn. One node for all of them, its work in
-- C (ms_moe_experts_forward / _backward, core/moe.c: grouped GEMMs over
-- the experts and one activation pass over all the rows), so a layer
-- costs the host a few FFI calls instead of a dozen autograd ops an
-- expert. The weights are cast (or copied) into one flat tensor of the
-- rows' dtype (bf16 under autocast) in one kernel (ops.cast_flat), kept
-- for the backward when they were cast and made again there when they were
-- only copied; each expert's gate and up sit next to each other there, so
-- they are one product. The backward
-- writes every expert's weight gradients (zeros for an expert with no
-- rows, so every rank's parameters have a gradient) in the weights' dtype
-- (an f32 GEMM output from bf16 operands: no cast pass), each a tensor of
-- its own (views of one flat tensor would share a storage, and autograd
-- would copy each into its parameter's .grad), or, under FSDP's bf16
-- parameters, straight into the unit's f32 gradient buffer (the weights'
-- gradient sinks: no bf16 gradient, no converting copy).
local function experts_forward(ctx, xs, rows, ...)
  local ws = { ... }
  local E = #rows
  local M = xs.shape[1]
  local dt, dev = xs.dtype, xs.device
  local I = ws[1].shape[1]
  local wf = F.cast_flat(ws, dt)
  local ys = T.empty({ M, xs.shape[2] }, { dtype = dt, device = dev })
  local gu = T.empty({ M, 2 * I }, { dtype = dt, device = dev })
  local r = ms.ffi.new('int64_t[?]', E)
  for e = 1, E do r[e - 1] = rows[e] end
  T.check(T.C.ms_moe_experts_forward(ys, gu, xs, wf, r, E), 3)
  local keep = false
  for _, n in ipairs(ctx.needs_input_grad) do keep = keep or n end
  if keep then
    ctx.xs, ctx.gu, ctx.rows, ctx.ws = xs, gu, rows, ws
    -- the casts are kept for the backward, as autocast keeps a cast weight;
    -- weights already in the rows' dtype (FSDP's bf16 parameters, f32
    -- training) are copied again there instead: a copy held from here to
    -- the backward would be one more copy of every layer's experts
    local cast = false
    for _, w in ipairs(ws) do cast = cast or w.dtype ~= dt end
    if cast then ctx.wf = wf else wf:free() end
  else
    -- (no backward will come)
    gu:free(); wf:free()
  end
  return ys
end
local function tensor_array(list, n, from, step)
  local a = ms.ffi.new('ms_tensor*[?]', n)
  for i = 0, n - 1 do a[i] = list[from + i * step] end
  return a
end
-- A weight's gradient sink (autograd.set_grad_sink: FSDP's f32 unsharded
-- gradient of its bf16 parameters) when the grouped GEMM can write it
-- there: empty so far (no accumulation: the GEMM overwrites), and f32 or
-- the rows' dtype. Else nil, and the gradient is a tensor of its own.
local function expert_sink(w, dt)
  local sink = A.leaf_sink(w)
  if not sink or sink.written[sink.i] then return nil end
  local sd = sink.t.dtype
  if sd ~= dt and not (sd == 'f32' and (dt == 'bf16' or dt == 'f16')) then return nil end
  return sink
end
local function experts_backward(ctx, gy)
  local xs, ws = ctx.xs, ctx.ws
  local E = #ctx.rows
  local dt = xs.dtype
  local gc = gy.dtype == dt and gy:contiguous() or gy:to(dt)
  local dxs = T.empty(xs.shape, { dtype = dt, device = xs.device })
  -- each weight's gradient: into its sink (f32, no bf16 gradient and no
  -- converting copy under FSDP; nil handed back) or a tensor of its own
  local grads, sinks = {}, {}
  for i, w in ipairs(ws) do
    sinks[i] = expert_sink(w, dt)
    grads[i] = sinks[i] and sinks[i].t or T.empty(w.shape, { dtype = w.dtype, device = w.device })
  end
  local r = ms.ffi.new('int64_t[?]', E)
  for e = 1, E do r[e - 1] = ctx.rows[e] end
  local wf = ctx.wf or F.cast_flat(ws, dt)
  T.check(T.C.ms_moe_experts_backward(dxs, tensor_array(grads, E, 1, 3), tensor_array(grads, E, 2, 3),
    tensor_array(grads, E, 3, 3), gc, xs, ctx.gu, wf, r, E), 3)
  if gc ~= gy then gc:free() end
  ctx.gu:free(); wf:free()
  ctx.gu, ctx.wf, ctx.xs, ctx.ws = nil, nil, nil, nil
  for i, sk in pairs(sinks) do
    sk.written[sk.i] = true
    grads[i] = nil   -- (the sink holds it)
  end
  grads.n = #ws
  return dxs, grads
end
local Experts = A.Function {
  name = 'moe_experts',
  owns_results = true,
  forward = function(ctx, xs, rows, ...) return untuned(xs.device, experts_forward, ctx, xs, rows, ...) end,
  backward = function(ctx, gy)
    local dxs, grads = untuned(ctx.xs.device, experts_backward, ctx, gy)
    return dxs, nil, unpack(grads, 1, grads.n)
  end,
}

-- moe.sort_slots(ids (N, k) i64, E, align) -> a table: the N·k slots
-- (0-based row-major indices into ids) sorted by expert, stable (slot
-- order within an expert), each expert's run of rows padded to a multiple
-- of align (default 1: none; the GPU pads to 128 so that the experts'
-- GEMM shapes recur from step to step and their plans are reused):
--   order (N·k) the sorted slots; inv (N·k) slot -> its row;
--   tok (M) row -> its token, N at padding; back (M) row -> its slot, N·k
--   at padding (i64 host tensors); counts and rows (Lua lists of E: the
--   slots and the padded rows of each expert); M; pads (whether any).
-- Ids outside [0, E) are an error naming the slot.
-- buf (optional): host i64 tensors order, inv (n), tok, back (cap or more)
-- to write into (moe.routing_read's page-locked ones), ids then already on
-- the host.
function moe.sort_slots(ids, E, align, buf)
  align = align or 1
  local ffi = ms.ffi
  local k = ids.ndim == 2 and ids.shape[2] or 1
  local h = ids:to('cpu'):contiguous()
  local n = h:numel()
  local cap = n + E * (align - 1)
  local order, inv, tok, back
  if buf then
    order, inv, tok, back = buf.order, buf.inv, buf.tok, buf.back
  else
    order, inv = ms.empty({ n }, { dtype = 'i64' }), ms.empty({ n }, { dtype = 'i64' })
    tok, back = ms.empty({ cap }, { dtype = 'i64' }), ms.empty({ cap }, { dtype = 'i64' })
  end
  local counts, rows, M = ffi.new('int64_t[?]', E), ffi.new('int64_t[?]', E), ffi.new('int64_t[1]')
  local i64 = 'int64_t *'
  local rc = T.C.ms_moe_sort_slots(ffi.cast(i64, h:data_ptr()), n, k, E, align, cap, ffi.cast(i64, order:data_ptr()),
    ffi.cast(i64, inv:data_ptr()), ffi.cast(i64, tok:data_ptr()), ffi.cast(i64, back:data_ptr()), counts, rows, M)
  if h ~= ids then h:free() end
  T.check(rc, 2)
  local m = tonumber(M[0])
  if buf then order, inv = order:narrow(1, 1, n), inv:narrow(1, 1, n) end
  if m < tok.shape[1] then tok, back = tok:narrow(1, 1, m), back:narrow(1, 1, m) end
  local c, r = {}, {}
  for e = 1, E do c[e], r[e] = tonumber(counts[e - 1]), tonumber(rows[e - 1]) end
  return { order = order, inv = inv, tok = tok, back = back, counts = c, rows = r, M = m, pads = m > n }
end

-- moe.sort_queue(ids (N, k) i64, E, align) -> the same sort queued as one
-- op on the ids' device (ms_moe_sort; kernels/moe.cu on a GPU): a table of
-- order, inv (N·k), tok, back (N·k + E (align - 1): the rows, then room)
-- and info (2 E + 3: counts, rows, M, the first bad slot or -1, its id),
-- i64 tensors on that device, written when the stream gets there; nothing
-- read on the host. moe.sort_read turns it into sort_slots' table.
function moe.sort_queue(ids, E, align)
  align = align or 1
  local n = ids:numel()
  local k = ids.ndim == 2 and ids.shape[2] or 1
  local cap = n + E * (align - 1)
  local o = { dtype = 'i64', device = ids.device }
  local q = { n = n, k = k, E = E, order = T.empty({ n }, o), inv = T.empty({ n }, o), tok = T.empty({ cap }, o),
    back = T.empty({ cap }, o), info = T.empty({ 2 * E + 3 }, o) }
  local idc = ids:contiguous()
  local rc = T.C.ms_moe_sort(idc, k, E, align, q.order, q.inv, q.tok, q.back, q.info)
  if idc ~= ids then idc:free() end   -- (stream-ordered: the sort has it)
  T.check(rc, 2)
  return q
end

-- moe.sort_read(q, info) -> sort_slots' table from a queued sort (moe.sort_queue)
-- and `info`, a host i64 tensor holding q.info's values (copied once the
-- sort is done): order, inv, tok and back stay on q's device (tok and
-- back narrowed to the M rows). An id outside [0, E) is the error
-- sort_slots raises, naming the slot.
function moe.sort_read(q, info)
  local E = q.E
  local p = ms.ffi.cast('int64_t *', info:data_ptr())
  local bad = tonumber(p[2 * E + 1])
  if bad >= 0 then
    for _, t in ipairs({ q.order, q.inv, q.tok, q.back }) do t:free() end
    error(('moe: expert id %d at slot %d is outside [0, %d)'):format(tonumber(p[2 * E + 2]), bad, E), 2)
  end
  local c, r = {}, {}
  for e = 1, E do c[e], r[e] = tonumber(p[e - 1]), tonumber(p[E + e - 1]) end
  local m = tonumber(p[2 * E])
  local tok, back = q.tok, q.back
  if m < tok.shape[1] then tok, back = tok:narrow(1, 1, m), back:narrow(1, 1, m) end
  return { order = q.order, inv = q.inv, tok = tok, back = back, counts = c, rows = r, M = m, pads = m > q.n }
end

-- moe.sort_slots_on(ids (N, k) i64, E, align) -> sort_slots' table, the
-- sort done on the ids' device (moe.sort_queue, then info read: a host
-- sync on a GPU), order, inv, tok, back left there
function moe.sort_slots_on(ids, E, align)
  local q = moe.sort_queue(ids, E, align)
  local h = q.info:to('cpu')
  local st = moe.sort_read(q, h)
  if h ~= q.info then q.info:free() end
  return st
end

-- MS_MOE_HOST_SORT=1: moe.routing_read sorts on the host (the ids read,
-- sorted by ms_moe_sort_slots, the index vectors uploaded), as before the
-- device sort; for A/B timing. Experts past MS_MOE_SORT_MAX_E sort there too.
moe.host_sort = os.getenv('MS_MOE_HOST_SORT') == '1'

-- moe.routing_read(m, ids (N, k) on a GPU, E, align, during) -> the slot
-- sort's table (moe.sort_slots) with order, inv, tok, back on the GPU: the
-- GPU path of a layer's one host read, without a stream sync. The slots
-- are sorted on the device (moe.sort_queue), and only info (2 E + 3 i64:
-- the experts' counts and rows, which size their GEMMs, and the bad-id
-- flag) goes to page-locked memory by an asynchronous copy; `during()` is
-- queued behind it (the shared expert: the GPU runs it while the host
-- waits); the host waits for the copy alone (an event). With
-- moe.host_sort (MS_MOE_HOST_SORT=1) the ids go to the host instead, are
-- sorted there into page-locked buffers and the index vectors uploaded
-- asynchronously (routing_read_host). Returns the table and during()'s
-- result.
local function routing_read_host(m, ids, E, align, during)
  local cuda = ms.cuda
  local n, k = ids:numel(), ids.shape[2]
  local cap = n + E * (align - 1)
  local dev = ids.device_id
  local b = rawget(m, '_pin')
  -- (the last upload from them is long done: waited for only if not)
  if b and not b.up_done:query() then b.up_done:synchronize() end
  if not b or b.n < n or b.cap < cap or b.device ~= dev then
    b = { n = n, cap = cap, device = dev, ids = cuda.pinned_empty({ n }, 'i64'), order = cuda.pinned_empty({ n }, 'i64'),
      inv = cuda.pinned_empty({ n }, 'i64'), tok = cuda.pinned_empty({ cap }, 'i64'),
      back = cuda.pinned_empty({ cap }, 'i64'), got = cuda.event { device = dev }, up_done = cuda.event { device = dev } }
    rawset(m, '_pin', b)
  end
  local idc = ids:contiguous()
  local hid = b.ids:narrow(1, 1, n)
  cuda.copy_async_(hid, idc:reshape({ n }))
  b.got:record()
  local extra = during and during() or nil
  b.got:synchronize()
  if idc ~= ids then idc:free() end
  local st = moe.sort_slots(hid:reshape({ n / k, k }), E, align, b)
  local function up(h)
    local d = T.empty(h.shape, { dtype = 'i64', device = ids.device })
    cuda.copy_async_(d, h)
    return d
  end
  st.tok, st.inv, st.back = up(st.tok), up(st.inv), up(st.back)
  b.up_done:record()
  return st, extra
end

function moe.routing_read(m, ids, E, align, during)
  if moe.host_sort or E > T.C.MS_MOE_SORT_MAX_E then return routing_read_host(m, ids, E, align, during) end
  local cuda = ms.cuda
  local dev = ids.device_id
  local b = rawget(m, '_pin_info')
  -- (the host read the last copy into it before that forward went on)
  if not b or b.E < E or b.device ~= dev then
    b = { E = E, device = dev, info = cuda.pinned_empty({ 2 * E + 3 }, 'i64'), got = cuda.event { device = dev } }
    rawset(m, '_pin_info', b)
  end
  local q = moe.sort_queue(ids, E, align)
  local h = b.info:narrow(1, 1, 2 * E + 3)
  cuda.copy_async_(h, q.info)
  b.got:record()
  local extra = during and during() or nil
  b.got:synchronize()
  q.info:free()
  return moe.sort_read(q, h), extra
end

-- moe.topk(scores (N, E), k) -> ids (N, k) i64: each row's k largest, in
-- descending order, ties to the lower index (k passes of argmax on a copy;
-- no gradient)
function moe.topk(scores, k)
  return A.no_grad(function()
    local s = scores:detach():clone()
    local N = s.shape[1]
    local cols = {}
    local ninf = k > 1 and ms.full({ N, 1 }, -math.huge, { dtype = s.dtype, device = s.device }) or nil
    for j = 1, k do
      local _, a = s:max(2, true)
      cols[j] = a
      if j < k then s:scatter_add_(2, a, ninf) end
    end
    local ids = k == 1 and cols[1] or ms.cat(cols, 2)
    return ids
  end)
end

-- moe.group_limit(choice (N, E), G, TG, how) -> (N, E): the choice scores
-- of each token's TG best groups of E / G experts, -inf elsewhere (as
-- transformers' DeepSeek-V3 router masks them: an expert outside the
-- groups is never chosen, however low the scores inside them); a group's
-- score is the sum of its two best ('top2') or its best ('max') (no gradient)
function moe.group_limit(choice, G, TG, how)
  return A.no_grad(function()
    local N, E = choice.shape[1], choice.shape[2]
    local per = E / G
    local c3 = choice:contiguous():reshape({ N * G, per })
    local gscore
    if how == 'max' then
      gscore = c3:max(2, true)
    else
      gscore = c3:gather(2, moe.topk(c3, 2)):sum(2, true)
    end
    gscore = gscore:reshape({ N, G })
    local mask = ms.zeros({ N, G }, { dtype = choice.dtype, device = choice.device })
    mask:scatter_add_(2, moe.topk(gscore, TG), ms.ones({ N, TG }, { dtype = choice.dtype, device = choice.device }))
    local keep = mask:reshape({ N, G, 1 }):expand({ N, G, per }):to('bool')
    return F.where(keep, choice:reshape({ N, G, per }):contiguous(), -math.huge):reshape({ N, E })
  end)
end

-- moe.select(scores (N, E), bias (E) | nil, G, TG, how, k) -> ids (N, k)
-- i64: the experts a layer's routing chooses, in one pass (ms_moe_select:
-- core/moe.c, kernels/moe.cu, one thread a token): each token's choice
-- scores (scores + bias), only the TG best of its G groups' experts (how:
-- 'top2' or 'max', as moe.group_limit), the k best of them, best first, ties
-- to the lower expert: what moe.topk(moe.group_limit(scores + bias, ...), k)
-- computes in some 25 ops (which remain the reference, and the path where
-- G or k is above 64). No gradient.
-- (the composed selection: a function of its own, as a closure made in
-- moe.select would keep select from being compiled: FNEW and UCLO end a
-- trace in LuaJIT)
local function select_composed(scores, bias, G, TG, how, k)
  local choice = scores:detach()
  if bias ~= nil then choice = choice + (bias.dtype == choice.dtype and bias or bias:to(choice.dtype)) end
  if G > 1 then choice = moe.group_limit(choice, G, TG, how) end
  return moe.topk(choice, k)
end
function moe.select(scores, bias, G, TG, how, k)
  G, TG = G or 1, TG or G or 1
  local big = G > T.C.MS_MOE_SELECT_MAX or k > T.C.MS_MOE_SELECT_MAX
  if big or (scores.dtype ~= 'f32' and scores.dtype ~= 'f64') then
    return A.no_grad(select_composed, scores, bias, G, TG, how, k)
  end
  local s = scores:detach():contiguous()
  local b = bias
  if b ~= nil then
    if b.dtype ~= s.dtype then b = b:to(s.dtype) end
    b = b:contiguous()
  end
  local ids = T.empty({ s.shape[1], k }, { dtype = 'i64', device = s.device })
  T.check(T.C.ms_moe_select(ids, s, b, G, TG, how == 'max' and 1 or 0, k), 2)
  return ids
end

-- ------------------------------------------- the sequence-wise balance loss
-- DeepSeek-V2/V3's auxiliary loss (the V3 report's eq. 17-20; DeepSeek-V2's
-- MoEGate with seq_aux): for each sequence of T tokens and each layer,
--   L = alpha Σ_i f_i P_i,  f_i = E / (k T) Σ_t 1[token t counts for expert i],
--   P_i = 1/T Σ_t s'_{i,t},
-- s' a token's scores normalised to sum 1 over the E experts (sigmoid
-- scores divided by their sum; softmax scores as they are), averaged over
-- the sequences (per_sequence false: every token of the forward one group, the
-- batch-wise loss of DeepSeek's seq_aux = false). The f_i are constants;
-- the loss is differentiable through the scores.

-- The sums of one layer's forward: probs (N, E) its scores, ids (N, k) the
-- experts each token counts for, Tl the tokens of a sequence on this rank,
-- cp its context-parallel context (the rest of each sequence on the other
-- ranks of cp.group: the counts and score sums all-reduced over it, one
-- collective of 2 B E numbers) or nil. -> { c (B, E) the counts, psum
-- (B, E) this rank's sums of s' (differentiable), pg (B, E) every rank's
-- (constant), T the tokens of a group, B the groups, n the ranks }.
-- pad: the layer's _pad (a multi-token-prediction depth run on whole
-- sequences, models/deepseek_v3.lua): { mask (N) 1 for the tokens that
-- count, 0 for the k filler positions at the end of each sequence, k }:
-- the sums over the tokens that count, T less k a sequence
-- seq_aux_sums' counts (B, E) of the experts each group's tokens count for
-- (mask: the tokens that count, or nil) and psum's values, both summed over
-- cp's ranks when there is one. (A function of its own, not a closure made
-- at each forward: a trace specialised on one keeps its upvalues, that
-- forward's tensors, alive; docs/tensors.md.)
local function seq_aux_counts(probs, ids, mask, psum, cp, B, E, N, Tg, k)
  local opts = { dtype = probs.dtype, device = probs.device }
  local z = T.zeros({ B, E }, opts)
  local ones = mask and mask:expand({ N, k }):contiguous():reshape({ B, Tg * k }) or T.ones({ B, Tg * k }, opts)
  z:scatter_add_(2, ids:contiguous():reshape({ B, Tg * k }), ones)
  if cp == nil or cp.size == 1 then return z, psum:detach() end
  local both = F.cat({ z:reshape({ 1, B, E }), psum:detach():reshape({ 1, B, E }) }, 1)
  ms.dist.all_reduce(both, 'sum', { group = cp.group })
  return both:select(1, 1), both:select(1, 2)
end
local function seq_aux_sums(probs, ids, Tl, sigmoid, per_seq, cp, pad)
  local N, E, k = probs.shape[1], probs.shape[2], ids.shape[2]
  local Tg = per_seq and Tl or N
  if Tg < 1 or N % Tg ~= 0 then
    error(('moe: the sequence-wise balance loss needs the tokens in sequences of %d, got %d tokens'):format(Tg, N), 3)
  end
  local B = N / Tg
  local sn = sigmoid and probs / probs:sum(2, true) or probs
  local mask = pad and pad.mask:to(probs.dtype):reshape({ N, 1 })
  if mask then sn = sn * mask end
  local psum = sn:reshape({ B, Tg, E }):sum(2)
  local n = cp and cp.size or 1
  local c, pg = A.no_grad(seq_aux_counts, probs, ids, mask, psum, cp, B, E, N, Tg, k)
  -- (with pad: a group of Tg / Tl sequences has k filler tokens in each)
  local Tc = Tg * n - (pad and (Tg / Tl) * pad.k or 0)
  return { c = c, psum = psum, pg = pg, T = Tc, B = B, n = n, E = E, k = k }
end

-- the experts a token counts for in f_i: the routing's (choice
-- 'routing', DeepSeek-V2's code: its greedy or group-limited top k), or
-- ('scores', the V3 report's eq. 18) the k best plain scores: no routing
-- bias, no group limit (the same as the routing's for a layer without
-- either)
local function aux_ids(m, probs, ids, choice)
  if choice == 'scores' and (m:routing_bias() ~= nil or m.n_group > 1) then
    return moe.select(probs, nil, 1, 1, 'top2', m.top_k)
  end
  return ids
end

local function check_alpha(alpha, what)
  if type(alpha) ~= 'number' or alpha < 0 or alpha ~= alpha or alpha == math.huge then
    error(('%s: alpha must be a non-negative number, got %s'):format(what, tostring(alpha)), 3)
  end
end
local function check_opts(opts, what)
  if opts.choice ~= nil and opts.choice ~= 'routing' and opts.choice ~= 'scores' then
    error(('%s: choice must be routing or scores, got %s'):format(what, tostring(opts.choice)), 3)
  end
  if opts.per_sequence ~= nil and type(opts.per_sequence) ~= 'boolean' then
    error(('%s: per_sequence must be a boolean, got %s'):format(what, tostring(opts.per_sequence)), 3)
  end
end

-- seq_aux_term(m, probs, ids, Tl, alpha, opts) -> { value (1) layer m's
-- term (constant), gamma (B, E) its gradient with respect to each token's
-- s' (times the context-parallel ranks: their gradients are averaged as
-- the data-parallel ones), B }; opts: a session's choice, per_sequence
local function seq_aux_term(m, probs, ids, Tl, alpha, opts)
  -- (no graph: the gradient is SeqAuxGrad's)
  local s = A.no_grad(seq_aux_sums, probs, aux_ids(m, probs, ids, opts.choice), Tl, m.score == 'sigmoid',
    opts.per_sequence ~= false, rawget(m, '_cp'), rawget(m, '_pad'))
  return A.no_grad(function()
    -- f = c E / (k T); L = alpha / B Σ_b Σ_i f_bi pg_bi / T
    local f = s.c * (s.E / (s.k * s.T))
    local value = (f * s.pg):sum():reshape({ 1 }) * (alpha / (s.B * s.T))
    return { value = value, gamma = f * (alpha * s.n / (s.B * s.T)), B = s.B }
  end)
end

-- SeqAuxGrad(y, probs (N, E), gamma (B, E), sigmoid, box, mask) -> y (an
-- alias); backward: y's gradient as it is, and the scores' gradient of the
-- layer's term times the session's loss gradient (box.scale): gamma for
-- each token of sequence b (times mask (N), the tokens that count, when
-- given), through the normalisation s' = s / Σ s for sigmoid scores
-- ((gamma - Σ_i gamma_i s'_i) / Σ s)
local SeqAuxGrad = A.Function {
  name = 'moe_seq_aux',
  owns_results = true,
  forward = function(ctx, y, probs, gamma, sigmoid, box, mask)
    ctx.probs, ctx.gamma, ctx.sigmoid, ctx.box, ctx.mask = probs, gamma, sigmoid, box, mask
    return A.raw_views.alias(y)
  end,
  backward = function(ctx, g)
    local box, p, gamma = ctx.box, ctx.probs, ctx.gamma
    ctx.probs, ctx.gamma = nil, nil
    local sc = box.scale
    if sc == nil then
      error('moe: the sequence-wise balance loss\'s session (moe.seq_aux_begin) got no gradient at its loss '
        .. '(moe.seq_aux_end) before a layer\'s backward: take the backward of the loss seq_aux_end returned', 0)
    end
    local N, E, B = p.shape[1], p.shape[2], gamma.shape[1]
    local gp = gamma:reshape({ B, 1, E }):expand({ B, N / B, E }):contiguous():reshape({ N, E })
    if ctx.mask then gp = gp * ctx.mask:to(gp.dtype):reshape({ N, 1 }) end
    if ctx.sigmoid then
      local S = p:sum(2, true)
      gp = (gp - (gp * p):sum(2, true) / S) / S
    end
    if type(sc) == 'number' then
      if sc ~= 1 then gp = gp * sc end
    else
      if sc.dtype ~= gp.dtype then sc = sc:to(gp.dtype) end
      gp = gp * sc
    end
    return g, gp, nil, nil, nil, nil
  end,
}

-- SeqAuxAdd(loss, extra, box) -> loss + extra (extra: the session's value,
-- a constant shaped as loss); backward: the loss's gradient as it is, kept
-- as box.scale for the layers' SeqAuxGrad nodes (which the tape runs after)
local SeqAuxAdd = A.Function {
  name = 'moe_seq_aux_add',
  owns_results = true,
  forward = function(ctx, loss, extra, box)
    ctx.box = box
    return loss + extra
  end,
  backward = function(ctx, g)
    ctx.box.scale = g:contiguous():reshape({ g:numel() }):clone()
    return g, nil, nil
  end,
}

-- moe.seq_aux_begin(layers, opts) -> a session (nil with opts nil): until
-- the next call, the forwards of `layers` (nn.MoE) add their
-- sequence-wise balance loss to it and, under grad, attach its gradient
-- (MoE:seq_aux). opts: alpha (>= 0), choice ('routing' (default) or
-- 'scores': the experts f_i counts, above), per_sequence (default true;
-- false: each forward's tokens as one group), scale (a number: the
-- gradient of the objective with respect to the session's value, for a
-- caller that never calls seq_aux_end: a pipeline stage; default: what
-- seq_aux_end's backward finds). seq_aux_begin(layers, nil) ends any
-- session on them.
function moe.seq_aux_begin(layers, opts)
  local box
  if opts ~= nil then
    check_alpha(opts.alpha, 'moe.seq_aux_begin')
    check_opts(opts, 'moe.seq_aux_begin')
    box = { alpha = opts.alpha, choice = opts.choice or 'routing', per_sequence = opts.per_sequence ~= false,
            scale = opts.scale, values = {}, done = setmetatable({}, { __mode = 'k' }) }
  end
  for _, m in ipairs(layers) do rawset(m, '_seq_aux', box) end
  return box
end

-- moe.seq_aux_value(box) -> the session's value so far (a (1) tensor, the
-- sum of its layers' terms; no gradient), nil before any layer's forward
function moe.seq_aux_value(box)
  local v
  for _, t in ipairs(box.values) do v = v and v + t or t end
  return v
end

-- moe.seq_aux_end(loss, box) -> loss + the session's value (shaped as
-- loss); its backward's incoming gradient scales the layers' (the
-- session's loss counts in the objective as loss does)
function moe.seq_aux_end(loss, box)
  local v = moe.seq_aux_value(box)
  if v == nil then error('moe.seq_aux_end: no MoE layer of the session ran a forward', 2) end
  if v.dtype ~= loss.dtype then v = v:to(loss.dtype) end
  return SeqAuxAdd(loss, v:reshape(loss.shape), box)
end

-- --------------------------------------- the load-balancing loss's sessions
-- Switch / GShard's load-balancing loss (moe.aux_loss) is one product of
-- means over every layer's tokens: the gradient of layer l's score of
-- expert e for one of its N tokens is E f̄_e / (L N), f̄ the share of all
-- the L layers' slots, known only once the whole forward has run. A
-- model's training loss takes it through a session (moe.aux_begin before
-- the forward, moe.aux_end after), which activation checkpointing and
-- released activations take as they are:
--   - each layer's first forward in the session adds its counts and
--     scores (MoE:switch_aux); moe.aux_end makes the value of them as
--     moe.aux_loss does, bit for bit;
--   - a forward under grad leaves the loss differentiable through its
--     mean scores, as moe.aux_loss does (the same graph, bit for bit);
--   - a forward without (a checkpoint's first forward records nothing)
--     is left to the same layer's next forward under grad, the
--     recompute: its output comes back through a node (AuxGrad) whose
--     backward gives the scores E f̄_e / (L N) times the gradient of the
--     objective with respect to the loss, which aux_end's result keeps
--     (AuxScale) for the layers, whose backwards the tape runs after.

-- the load-balancing loss of `list` (the layers' { counts (a Lua list of
-- E), mean (E) scores, n tokens }, in order), E experts -> the loss (1)
-- (differentiable through the means) and f̄ (E)
local function switch_loss(list, E)
  local total, probs, counts = 0, nil, {}
  for _, s in ipairs(list) do
    for e = 1, E do counts[e] = (counts[e] or 0) + s.counts[e] end
    total = total + s.n
    probs = probs and (probs + s.mean) or s.mean
  end
  local f = ms.tensor(counts, { dtype = probs.dtype }):to(probs.device)
  -- f̄ = counts / (layers · N) (each layer's N tokens; its k slots a token
  -- counted in full, as the one-hot over the top-k is summed over k there)
  local fbar = f / total
  local pbar = probs / #list
  return (fbar * pbar):sum():reshape({ 1 }) * E, fbar
end

-- AuxGrad(y, probs (N, E), box) -> y (an alias); backward: y's gradient as
-- it is, and the scores' gradient of the session's loss: for each token,
-- coef E f̄_e / (L N) times the objective's gradient with respect to
-- aux_end's result (box.scale), in the order autograd takes it through
-- moe.aux_loss's graph (the product's, the layers' mean's, the mean's)
local AuxGrad = A.Function {
  name = 'moe_aux',
  owns_results = true,
  forward = function(ctx, y, probs, box)
    ctx.box, ctx.shape, ctx.dtype = box, probs.shape, probs.dtype
    return A.raw_views.alias(y)
  end,
  backward = function(ctx, g)
    local box = ctx.box
    local sc = box.scale
    if sc == nil or box.fbar == nil then
      error('moe: the load-balancing loss\'s session (moe.aux_begin) got no gradient at its loss (moe.aux_end) '
        .. 'before a layer\'s backward: take the backward of the loss aux_end returned', 0)
    end
    local N, E = ctx.shape[1], ctx.shape[2]
    if sc.dtype ~= ctx.dtype then sc = sc:to(ctx.dtype) end
    local ge = (sc * box.coef) * E * box.fbar / box.L
    local gp = ge:reshape({ 1, E }):expand({ N, E }) / N
    return g, gp, nil
  end,
}

-- AuxScale(loss, box) -> loss (an alias); backward: the loss's gradient
-- as it is, kept as box.scale for the layers' AuxGrad nodes
local AuxScale = A.Function {
  name = 'moe_aux_scale',
  owns_results = true,
  forward = function(ctx, loss, box)
    ctx.box = box
    return A.raw_views.alias(loss)
  end,
  backward = function(ctx, g)
    ctx.box.scale = g:contiguous():reshape({ g:numel() }):clone()
    return g, nil
  end,
}

-- moe.aux_begin(layers, opts) -> a session (nil with opts nil): until the
-- next call, the forwards of `layers` (nn.MoE, in the order the loss sums
-- them) add their routing to the session's load-balancing loss and, under
-- grad when their first forward had none, attach its gradient
-- (MoE:switch_aux). opts: coef (>= 0, default 1), the loss's weight in
-- aux_end's result. aux_begin(layers, nil) ends any session on them.
function moe.aux_begin(layers, opts)
  local box
  if opts ~= nil then
    local coef = opts.coef == nil and 1 or opts.coef
    if type(coef) ~= 'number' or coef < 0 or coef ~= coef or coef == math.huge then
      error(('moe.aux_begin: coef must be a non-negative number, got %s'):format(tostring(coef)), 2)
    end
    local list = {}
    for i, m in ipairs(layers) do list[i] = m end
    box = { coef = coef, list = list, seen = setmetatable({}, { __mode = 'k' }) }
  end
  for _, m in ipairs(layers) do rawset(m, '_aux', box) end
  return box
end

-- moe.aux_value(box) -> the session's load-balancing loss (a (1) tensor,
-- without coef: moe.aux_loss's value over the layers' first forwards of
-- the session, differentiable through those that ran under grad), f̄ (E)
-- and the layers that ran; nil before any layer's forward
function moe.aux_value(box)
  local list, E = {}, nil
  for _, m in ipairs(box.list) do
    local s = box.seen[m]
    if s then
      if s.mean == nil then
        if s.probs.storage == nil then
          error('moe.aux_value: the first forward\'s router scores were released by its backward '
            .. '(autograd.release_activations): take the loss between the forward and the backward', 2)
        end
        s.mean = s.probs:mean(1)
        s.probs = nil
      end
      list[#list + 1] = s
      E = m.n_experts
    end
  end
  if #list == 0 then return nil end
  local aux, fbar = switch_loss(list, E)
  return aux, fbar, #list
end

-- moe.aux_end(loss, box) -> loss + coef · the session's load-balancing
-- loss (shaped as loss); the objective's gradient with respect to it
-- scales the layers' whose forward had no graph (the session's loss
-- counts in the objective as loss does)
function moe.aux_end(loss, box)
  local aux, fbar, L = moe.aux_value(box)
  if aux == nil then error('moe.aux_end: no MoE layer of the session ran a forward', 2) end
  -- (a layer whose first forward kept no graph: its gradient is AuxGrad's)
  local late = false
  for _, s in pairs(box.seen) do late = late or not s.graph end
  if late then box.fbar, box.L = fbar, L end
  aux = aux * box.coef
  if aux.dtype ~= loss.dtype then aux = aux:to(loss.dtype) end
  local out = loss + aux:reshape(loss.shape)
  if late then out = AuxScale(out, box) end
  return out
end

-- ------------------------------------------------ the last forward's stats
-- Under expert and tensor parallelism together (MoE:forward_ep_tp) the
-- tensor-parallel group's scores and choices are gathered only for a
-- reader of the forward (MoE:reads_routing): without a balance-loss
-- session, the statistics keep the counts and the tokens (what the
-- routing biases read) and last_stats, moe.aux_loss and moe.seq_aux_loss
-- refuse them. moe.keep_stats(layers, on) -> the layers' count: on
-- (true), their forwards gather the scores for those readers anyway;
-- false, only when a session reads them.
function moe.keep_stats(layers, on)
  if type(on) ~= 'boolean' then
    error(('moe.keep_stats: on must be a boolean, got %s'):format(tostring(on)), 2)
  end
  if type(layers) ~= 'table' then
    error(('moe.keep_stats: layers must be a list of MoE layers, got %s'):format(type(layers)), 2)
  end
  for i, m in ipairs(layers) do
    if type(m) ~= 'table' or m.n_experts == nil then
      error(('moe.keep_stats: layers[%d] is not an MoE layer (nn.moe.layers(model))'):format(i), 2)
    end
  end
  for _, m in ipairs(layers) do rawset(m, '_keep_stats', on or nil) end
  return #layers
end

-- the refusal of a forward's statistics not gathered (moe.keep_stats)
local function ungathered(who)
  return who .. ': the last forward ran under expert and tensor parallelism with no balance loss reading its router '
    .. 'scores, which were not gathered over the tensor-parallel group: call nn.moe.keep_stats(layers, true) '
    .. 'before the forward'
end

function moe.install(nn, nnf)
  local Expert = expert_class(nn, nnf)
  nn.MoEExpert = Expert

  -- nn.MoE{dim, hidden, experts, top_k, score = 'softmax'|'sigmoid',
  --   norm_topk = true, route_scale = 1, shared_hidden = nil,
  --   names = {'gate_proj', 'up_proj', 'down_proj'}, router = 'gate',
  --   shared = 'shared_expert', shared_gate = nil, n_group = 1,
  --   topk_group = n_group, group_score = 'top2', router_bias = false, scale_input = false,
  --   dtype, device}
  -- shared_gate names a Linear(dim, 1) without bias that gates the shared
  -- expert per token: y = routed + sigmoid(x · g) * shared(x) (Qwen2-MoE's
  -- shared_expert_gate). n_group > 1: group-limited routing (DeepSeek-V2/V3):
  -- the E experts in n_group groups of E / n_group; each token picks its
  -- topk_group groups by a group score, the sum of the group's two best
  -- choice scores ('top2', DeepSeek-V3's) or the best ('max', V2's), and
  -- its top_k experts among theirs (the others never chosen).
  -- router_bias: the routing bias (below, moe.enable_bias) made at build,
  -- zeros, as the router's buffer e_score_correction_bias (DeepSeek-V3's
  -- name: checkpoints carry it); without it moe.enable_bias adds one to the
  -- layer as expert_bias when asked.
  -- scale_input (Llama 4): each slot's routing weight scales the expert's
  -- input row instead of its output, y = Σ_j expert_j(w_j x) (+ shared(x));
  -- with score = 'sigmoid' and norm_topk = false, Llama 4's router (the
  -- sigmoid of each chosen logit).
  -- x (..., dim) -> (..., dim). After each forward, moe:last_stats() ->
  -- counts (E, a Lua list), mean_probs (E) (the router's mean score of
  -- each expert over the tokens; differentiable under grad), tokens: what
  -- the load-balancing loss is made of (moe.aux_loss); moe:clear_stats().
  -- (Under expert and tensor parallelism together: only after a forward
  -- that gathered them, moe.keep_stats)
  local MoE = nn.Module:extend('MoE')
  nn.MoE = MoE
  function MoE:init(cfg)
    cfg = cfg or {}
    for _, f in ipairs({ 'dim', 'hidden', 'experts', 'top_k' }) do
      local v = cfg[f]
      if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
        error(('MoE: %s must be a positive integer, got %s'):format(f, tostring(v)), 3)
      end
    end
    if cfg.top_k > cfg.experts then
      error(('MoE: top_k %d is more than the %d experts'):format(cfg.top_k, cfg.experts), 3)
    end
    local score = cfg.score or 'softmax'
    if score ~= 'softmax' and score ~= 'sigmoid' then
      error(('MoE: score must be softmax or sigmoid, got %s'):format(tostring(score)), 3)
    end
    self.dim, self.hidden, self.n_experts, self.top_k = cfg.dim, cfg.hidden, cfg.experts, cfg.top_k
    self.score = score
    local G = cfg.n_group or 1
    local TG = cfg.topk_group or G
    local gs = cfg.group_score or 'top2'
    for _, fv in ipairs({ { 'n_group', G }, { 'topk_group', TG } }) do
      local v = fv[2]
      if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
        error(('MoE: %s must be a positive integer, got %s'):format(fv[1], tostring(v)), 3)
      end
    end
    if G > 1 then
      if cfg.experts % G ~= 0 then
        error(('MoE: %d experts do not split into n_group = %d groups'):format(cfg.experts, G), 3)
      end
      if gs ~= 'top2' and gs ~= 'max' then
        error(('MoE: group_score must be top2 or max, got %s'):format(tostring(gs)), 3)
      end
      if gs == 'top2' and cfg.experts / G < 2 then
        error(('MoE: group_score top2 needs groups of 2 experts or more, n_group = %d leaves %d'):format(G,
          cfg.experts / G), 3)
      end
      if TG > G then error(('MoE: topk_group %d is more than n_group %d'):format(TG, G), 3) end
      if cfg.top_k > TG * cfg.experts / G then
        error(('MoE: top_k %d is more than the %d experts of topk_group = %d groups'):format(cfg.top_k,
          TG * cfg.experts / G, TG), 3)
      end
    end
    self.n_group, self.topk_group, self.group_score = G, TG, gs
    self.norm_topk = cfg.norm_topk ~= false
    self.route_scale = cfg.route_scale or 1
    if cfg.scale_input ~= nil and type(cfg.scale_input) ~= 'boolean' then
      error(('MoE: scale_input must be a boolean, got %s'):format(tostring(cfg.scale_input)), 3)
    end
    self.scale_input = cfg.scale_input == true
    local names = cfg.names or { 'gate_proj', 'up_proj', 'down_proj' }
    self.router_name = cfg.router or 'gate'
    local o = { bias = false, dtype = cfg.dtype, device = cfg.device }
    self:register_module(self.router_name, nn.Linear(cfg.dim, cfg.experts, o))
    local list = {}
    for e = 1, cfg.experts do
      list[e] = Expert { dim = cfg.dim, hidden = cfg.hidden, names = names, dtype = cfg.dtype, device = cfg.device }
    end
    self:register_module('experts', nn.ModuleList(list))
    if cfg.shared_hidden then
      self.shared_name = cfg.shared or 'shared_expert'
      self:register_module(self.shared_name, Expert { dim = cfg.dim, hidden = cfg.shared_hidden, names = names,
        dtype = cfg.dtype, device = cfg.device })
    end
    if cfg.shared_gate ~= nil then
      if not cfg.shared_hidden then error('MoE: shared_gate needs a shared expert (shared_hidden)', 3) end
      if type(cfg.shared_gate) ~= 'string' then
        error(('MoE: shared_gate must be a module name, got %s'):format(tostring(cfg.shared_gate)), 3)
      end
      self.shared_gate_name = cfg.shared_gate
      self:register_module(cfg.shared_gate, nn.Linear(cfg.dim, 1, o))
    end
    if cfg.router_bias then
      self.router_bias = true
      self[self.router_name]:register_buffer('e_score_correction_bias',
        T.zeros({ cfg.experts }, { dtype = 'f32', device = cfg.device }))
    end
  end

  -- the routing bias (E) added to the scores that choose the experts, nil
  -- when none: the router's e_score_correction_bias (router_bias) or the
  -- layer's expert_bias (moe.enable_bias)
  function MoE:routing_bias()
    if self.router_bias then return rawget(self[self.router_name], 'e_score_correction_bias') end
    return rawget(self, 'expert_bias')
  end

  -- the shared expert's output for x2 (N, H), gated when it has a gate.
  -- (Under tensor parallelism (moonshard.tp) xe is x2 entering the split
  -- expert, the gate reads x2 itself, and its gradient is the sum of the
  -- ranks' parts: tp_sum.)
  function MoE:shared_out(x2, xe, tp_sum)
    local s = self[self.shared_name](xe or x2)
    local g = self.shared_gate_name and self[self.shared_gate_name]
    if g == nil then return s end
    local gate = nnf.sigmoid(g(x2))
    if gate.dtype ~= s.dtype then gate = gate:to(s.dtype) end
    if tp_sum then gate = tp_sum(gate) end
    return s * gate
  end

  function MoE:extra_repr()
    return ('dim=%d, hidden=%d, experts=%d, top_k=%d, %s%s%s'):format(self.dim, self.hidden, self.n_experts,
      self.top_k, self.score, self.norm_topk and ', norm_topk' or '',
      self.shared_name and (', shared ' .. self[self.shared_name].hidden .. (self.shared_gate_name and ', gated' or ''))
        or '') .. (self.n_group > 1 and (', %d of %d groups (%s)'):format(self.topk_group, self.n_group,
        self.group_score) or '') .. (self.scale_input and ', scale_input' or '')
  end

  -- the routing of x2 (N, H): probs (N, E) f32 (differentiable), ids (N, k).
  -- With a routing bias (MoE:routing_bias: DeepSeek-V3's balancing
  -- without an auxiliary loss) the experts are chosen by probs + bias; the
  -- routing weights stay the probs'.
  -- (wsum: the router's weight through it first; tensor and expert
  -- parallelism together sum its gradient over the tensor-parallel group,
  -- each rank routing its own rows: forward_ep_tp)
  function MoE:route(x2, wsum)
    local r = self[self.router_name]
    local logits = wsum and nnf.linear(x2, wsum(r.weight), rawget(r, 'bias')) or r(x2)
    -- (f32 at least: the softmax of bf16 logits would round the scores)
    local lf = (logits.dtype == 'f32' or logits.dtype == 'f64') and logits or logits:to('f32')
    local probs = self.score == 'softmax' and nnf.softmax(lf, -1) or nnf.sigmoid(lf)
    -- (the choice in one op: moe.select)
    return probs, moe.select(probs, self:routing_bias(), self.n_group, self.topk_group, self.group_score, self.top_k)
  end

  function MoE:forward(x)
    local H, E, k = self.dim, self.n_experts, self.top_k
    if not T.is_tensor(x) or x.shape[x.ndim] ~= H then
      error(('MoE: input of shape (%s) does not end in dim = %d'):format(
        T.is_tensor(x) and table.concat(x.shape, ', ') or type(x), H), 2)
    end
    local shape = x.shape
    -- expert parallelism over a group holding the tensor-parallel group
    local ep = rawget(self, '_ep')
    if ep and rawget(self, '_tp') then return self:forward_ep_tp(x, ep, rawget(self, '_tp')) end
    -- tensor parallelism (moonshard.tp): every rank routes every token
    -- (the router replicated), its experts hold a slice of the hidden
    -- features each, and the layer's output is the sum of the ranks' parts
    -- (tp.moe_enter / moe_exit: under sequence parallelism x and the
    -- output are this rank's rows of the stream, every token gathered
    -- between); the routing weights, and a shared gate, that scale the
    -- parts get the sum of the ranks' gradient parts in backward
    local tpi = rawget(self, '_tp')
    local tp_sum, xe
    if tpi then
      local tpm = require 'moonshard.tp'
      local xr
      xr, xe = tpm.moe_enter(x, tpi)
      x = xr
      tp_sum = function(t) return tpm.copy_to(t, tpi.group) end
    end
    local N = x:numel() / H
    -- (the tokens of a sequence: x (B, T, H) holds B of T; a 2-D x is one
    -- sequence; the sequence-wise balance loss groups by them)
    local Tl = x.ndim >= 3 and x.shape[x.ndim - 1] or N
    local x2 = x:reshape({ N, H })
    xe = xe and xe:reshape({ N, H }) or x2
    local probs, ids = self:route(x2)
    -- the routing weights of the chosen experts (N, k)
    local w = probs:gather(2, ids)
    if self.norm_topk then w = w / w:sum(2, true) end
    if self.route_scale ~= 1 then w = w * self.route_scale end
    if tp_sum then w = tp_sum(w) end
    local dev = x.device
    if ep then
      local y = self:forward_ep(x2, ids, w, probs, ep, Tl)
      y = self:seq_aux(y, probs, ids, Tl)
      y = self:switch_aux(y)
      if self.shared_name then y = y + self:shared_out(x2) end
      return y:reshape(shape)
    end
    -- the slots sorted by expert (one host read a layer: the experts'
    -- counts); the shared expert is queued first, so that on a GPU it runs
    -- while the host waits for them (moe.routing_read)
    local shared_of = self.shared_name and function() return self:shared_out(x2, xe, tp_sum) end or nil
    local st, shared
    if dev == 'cpu' then
      shared = shared_of and shared_of() or nil
      st = moe.sort_slots(ids, E, moe.cpu_align)
    else
      st, shared = moe.routing_read(self, ids, E, moe.align, shared_of)
    end
    local counts = st.counts
    local tok, inv, back = st.tok, st.inv, st.back
    local xs = self:dispatch(xe, w, k, tok, inv, back)
    local ys = Experts(xs, st.rows, self:expert_weights(E))
    local y = self:combine(ys, w, k, tok, inv, back)
    y = self:seq_aux(y, probs, ids, Tl)
    if shared then y = y + shared end
    self:record_stats(counts, probs, N, ids, Tl)
    y = self:switch_aux(y)
    if tpi then return require('moonshard.tp').moe_exit(y, tpi):reshape(shape) end
    return y:reshape(shape)
  end

  -- the rows the experts take (M, H), in the slot sort's order (tok: row
  -- -> token, inv: slot -> row, back: row -> slot): each slot's token row
  -- (in the compute dtype under autocast: the experts' linears would cast
  -- it anyway), or with scale_input that row times the slot's routing
  -- weight w (N, k), the slots gathered by `back` as rows of their own
  function MoE:dispatch(x2, w, k, tok, inv, back)
    local xc = amp.cast(x2)
    if self.scale_input then return Dispatch(scaled_slots(xc, w, k), back, inv, 1) end
    return Dispatch(xc, tok, inv, k)
  end
  -- the experts' output rows ys (M, H) back to the tokens (N, H): each
  -- token's k rows weighted by w (in the rows' dtype: bf16 under autocast,
  -- as the dense MLP's) and summed, or with scale_input (the weights
  -- already on the inputs) summed as they are
  function MoE:combine(ys, w, k, tok, inv, back)
    if self.scale_input then return Collect(ys, inv, tok, k) end
    if w.dtype ~= ys.dtype then w = w:to(ys.dtype) end
    return Combine(ys, w:reshape({ w.shape[1] * k }), inv, back, k)
  end

  -- the first n experts' (gate, up, down) weights in turn
  function MoE:expert_weights(n)
    local wl = {}
    for j = 1, n do
      local ex = self.experts[j]
      local nm = ex.names
      wl[3 * j - 2], wl[3 * j - 1], wl[3 * j] = ex[nm[1]].weight, ex[nm[2]].weight, ex[nm[3]].weight
    end
    return unpack(wl, 1, 3 * n)
  end

  -- (a function of its own: record_stats runs for every layer and
  -- micro-batch, and a function making a closure is not compiled)
  local function count_unpadded(self, ids, N, pad)
    local k = ids.shape[2]
    local z = rawget(self, '_tokens_dev') or T.zeros({ self.n_experts }, { dtype = 'f32', device = ids.device })
    z:scatter_add_(1, ids:contiguous():reshape({ N * k }),   -- (exact to 2^24 slots)
      pad.mask:to('f32'):reshape({ N, 1 }):expand({ N, k }):contiguous():reshape({ N * k }))
    rawset(self, '_tokens_dev', z)
  end
  -- what the load-balancing loss and the routing biases read of a forward
  -- (ids (N, k) the experts chosen, Tl the tokens a sequence: what the
  -- sequence-wise balance loss reads, moe.seq_aux_loss)
  -- (probs and ids nil: not gathered, forward_ep_tp; the counts and the
  -- tokens kept, the rest refused, MoE:last_stats)
  function MoE:record_stats(counts, probs, N, ids, Tl)
    rawset(self, '_stats', { counts = counts, probs = probs, n = N, ids = ids, seq = Tl, ungathered = probs == nil })
    -- (the slots each expert got since the last moe.update_bias, while training)
    if self:routing_bias() ~= nil and A.is_grad_enabled() then
      local pad = rawget(self, '_pad')
      if pad ~= nil then
        -- (a multi-token-prediction depth on whole sequences: its filler
        -- positions left out, models/deepseek_v3.lua; counted on the
        -- device, read by moe.update_bias with the others: no host read
        -- here)
        A.no_grad(count_unpadded, self, ids, N, pad)
        return
      end
      local acc = rawget(self, '_tokens') or {}
      for e = 1, self.n_experts do acc[e] = (acc[e] or 0) + counts[e] end
      rawset(self, '_tokens', acc)
    end
  end

  -- the slots each expert got since the last moe.update_bias (a Lua list
  -- of E; nil when none were counted): what update_bias sums, read here
  -- from the device where they are kept there
  function MoE:routing_counts()
    local acc, z = rawget(self, '_tokens'), rawget(self, '_tokens_dev')
    if z == nil then return acc end
    local v = z:to('cpu'):totable()
    if acc then for e = 1, self.n_experts do v[e] = v[e] + acc[e] end end
    return v
  end

  -- the routed part of the forward under expert parallelism (moe.expert_parallel):
  -- this rank's N·k slots sorted by expert, each block of experts sent to
  -- the rank that holds it (the counts all-gathered first: one host read),
  -- the rows received regrouped by local expert (padded as without EP),
  -- through the local experts, back the same way, combined with the
  -- routing weights. (Counting on the device and reading the counts with
  -- the ids in one copy, and uploading the index vectors as one, were both
  -- slower on GPUs: docs/perf-notes.md, twenty-eighth session)
  -- (tp_rows: the expert group's places of the tensor-parallel group's
  -- ranks (forward_ep_tp): the stats are left to the caller, and the
  -- counts returned are those ranks' summed, the group's tokens')
  function MoE:forward_ep(x2, ids, w, probs, ep, Tl, tp_rows)
    local N, H, E, k = x2.shape[1], self.dim, self.n_experts, self.top_k
    local P, me, El = ep.size, ep.rank, ep.local_experts
    local dev = x2.device
    local st = moe.sort_slots(ids, E, 1)
    local counts = st.counts
    -- every rank's counts (P x E)
    local mine = T.tensor(counts, { dtype = 'f64' }):to(dev)
    local all = T.empty({ P * E }, { dtype = 'f64', device = dev })
    ms.dist.all_gather_into(all, mine, { group = ep.group })
    local host = all:to('cpu')
    local cp = ms.ffi.cast('double *', host:data_ptr())
    local function c(p, e) return math.floor(cp[p * E + e] + 0.5) end   -- rank p (0-based), expert e (0-based)
    local send, recv = {}, {}
    for q = 0, P - 1 do
      local ns, nr = 0, 0
      for j = 0, El - 1 do ns = ns + c(me, q * El + j); nr = nr + c(q, me * El + j) end
      send[q + 1], recv[q + 1] = ns, nr
    end
    -- the received rows (R): by sender, then by expert; the local layout:
    -- by expert, then by sender, each expert's run padded to align (the
    -- received rows' local expert ids sorted as a layer's slots are)
    local R = 0
    for _, n in ipairs(recv) do R = R + n end
    local lid = T.empty({ R }, { dtype = 'i64' })
    local lp, at = ms.ffi.cast('int64_t *', lid:data_ptr()), 0
    for p = 0, P - 1 do
      for j = 0, El - 1 do
        for _ = 1, c(p, me * El + j) do lp[at] = j; at = at + 1 end
      end
    end
    local sl = moe.sort_slots(lid, El, dev == 'cpu' and moe.cpu_align or moe.align)
    local fwd, bwd, rows = sl.back, sl.inv, sl.rows
    if dev ~= 'cpu' then fwd, bwd = fwd:to(dev), bwd:to(dev) end
    local inv, back = st.inv, st.back
    if dev ~= 'cpu' then inv, back = inv:to(dev), back:to(dev) end
    local tok = st.tok:to(dev)
    local xs = self:dispatch(x2, w, k, tok, inv, back)
    local xr = Exchange(xs, send, recv, ep)
    local xl = Regroup(xr, fwd, bwd)
    local yl = Experts(xl, rows, self:expert_weights(El))
    local yr = Regroup(yl, bwd, fwd)
    local ys = Exchange(yr, recv, send, ep)
    local y = self:combine(ys, w, k, tok, inv, back)
    if tp_rows then
      local sum = {}
      for e = 0, E - 1 do
        local v = 0
        for _, p in ipairs(tp_rows) do v = v + c(p, e) end
        sum[e + 1] = v
      end
      return y, sum
    end
    self:record_stats(counts, probs, N, ids, Tl or N)
    return y
  end

  -- the forward under expert parallelism over a group that holds the
  -- tensor-parallel group (tp.parallelize after ep.parallelize; docs/moe.md,
  -- "Expert and tensor parallelism"): each rank of the tensor-parallel
  -- group routes its own rows of the group's tokens (tp.moe_rows: its
  -- sequence-parallel rows, or its share of the replicated stream) and
  -- sends them over the expert group (forward_ep), the experts whole; the
  -- router's weight gradient (its rows') summed over the tensor-parallel
  -- group. The counts are summed from the exchange's, and the group's
  -- scores and choices gathered (tp.moe_gather) when this forward has a
  -- reader of them (MoE:reads_routing), so the balancing losses, the
  -- statistics and the bias counts are those of the layer under --tp
  -- alone; without one the statistics keep the counts and the tokens only
  -- (last_stats refuses, moe.keep_stats). A shared expert
  -- stays split by its hidden features over every token (tp.moe_enter),
  -- its partial sums summed with the routed rows (tp.moe_join).
  function MoE:forward_ep_tp(x, ep, tpi)
    local tpm = require 'moonshard.tp'
    local shape = x.shape
    local xo, ctx = tpm.moe_rows(x, tpi, self.shared_name ~= nil)
    local function tp_sum(t) return tpm.copy_to(t, tpi.group) end
    local probs, ids = self:route(xo, tp_sum)
    local w = probs:gather(2, ids)
    if self.norm_topk then w = w / w:sum(2, true) end
    if self.route_scale ~= 1 then w = w * self.route_scale end
    -- (the shared expert first: on a GPU it runs while the host reads the counts)
    local s = self.shared_name and self:shared_out(ctx.xr, ctx.xe, tp_sum) or nil
    local y, counts = self:forward_ep(xo, ids, w, probs, ep, nil, tpi.ep_rows)
    if self:reads_routing() then
      local pa, ia = tpm.moe_gather(probs, ctx, tpi), tpm.moe_gather(ids, ctx, tpi)
      y = self:seq_aux(y, pa, ia, ctx.T)
      self:record_stats(counts, pa, ctx.N, ia, ctx.T)
      y = self:switch_aux(y)
    else
      self:record_stats(counts, nil, ctx.N, nil, ctx.T)
    end
    return tpm.moe_join(y, s, ctx, tpi):reshape(shape)
  end

  -- whether this forward's scores and choices have a reader, which
  -- forward_ep_tp gathers them for: a balance-loss session (seq_aux,
  -- switch_aux), moe.keep_stats (last_stats, moe.aux_loss,
  -- moe.seq_aux_loss), or a multi-token-prediction depth's bias counts
  -- (record_stats: its filler positions left out by the ids)
  function MoE:reads_routing()
    return rawget(self, '_seq_aux') ~= nil or rawget(self, '_aux') ~= nil or rawget(self, '_keep_stats') ~= nil
      or (rawget(self, '_pad') ~= nil and self:routing_bias() ~= nil and A.is_grad_enabled())
  end

  -- counts (a Lua list of E), mean_probs (E, differentiable) and the
  -- tokens of the last forward (nil before one, or after clear_stats).
  -- mean_probs is nil once a backward under autograd.release_activations
  -- has released that forward's scores (read it before the backward); the
  -- counts and the tokens stay.
  function MoE:last_stats()
    local s = rawget(self, '_stats')
    if not s then return nil end
    if s.ungathered then error(ungathered('MoE:last_stats'), 2) end
    if s.mean == nil and s.probs.storage ~= nil then s.mean = s.probs:mean(1) end
    return s.counts, s.mean, s.n
  end
  function MoE:clear_stats() rawset(self, '_stats', nil) end

  -- y, or when a load-balancing loss session is on (moe.aux_begin: a
  -- model's training forward with output_router_logits) and this is the
  -- layer's next forward under grad after a first one without (a
  -- checkpointed block's recompute), y through AuxGrad, which gives the
  -- router's scores their gradient of the session's loss. The first
  -- forward in the session adds its routing (the last forward's stats,
  -- record_stats) to the session.
  function MoE:switch_aux(y)
    local box = rawget(self, '_aux')
    if box == nil then return y end
    local st = rawget(self, '_stats')
    local grad = A.is_grad_enabled() and A.needs_grad(st.probs)
    local s = box.seen[self]
    if s == nil then
      box.seen[self] = { counts = st.counts, probs = st.probs, n = st.n, graph = grad }
      return y
    end
    if grad and not s.graph then return AuxGrad(y, st.probs, box) end
    return y
  end

  -- y with this forward's sequence-wise balance loss attached, when a
  -- session is on (moe.seq_aux_begin: a DeepSeek model's training forward):
  -- the layer's term joins the session's value once (a checkpointed
  -- block's recompute adds it no second time), and under grad y comes
  -- back through a node whose backward gives the router's scores the
  -- term's gradient, times the gradient the session's loss got
  -- (moe.seq_aux_end). So the term needs no graph from the forward to the
  -- loss: activation checkpointing (whose first forward keeps none) and
  -- released activations take it as they are.
  function MoE:seq_aux(y, probs, ids, Tl)
    local box = rawget(self, '_seq_aux')
    if box == nil then return y end
    local fresh = not box.done[self]
    local grad = A.is_grad_enabled() and A.needs_grad(probs)
    if not fresh and not grad then return y end
    local t = seq_aux_term(self, probs, ids, Tl, box.alpha, box)
    if fresh then
      box.done[self] = true
      box.values[#box.values + 1] = t.value
    end
    if grad then
      local pad = rawget(self, '_pad')
      return SeqAuxGrad(y, probs, t.gamma, self.score == 'sigmoid', box, pad and pad.mask)
    end
    return y
  end
end

-- Balancing without an auxiliary loss (DeepSeek-V3; torchtitan's
-- load_balance_coeff): each MoE layer gets a buffer expert_bias (E, f32,
-- zeros), added to the scores when the experts are chosen (not to the
-- routing weights). After each optimizer step moe.update_bias moves every
-- expert's bias by rate towards balance: + rate for an expert that got
-- fewer slots than the mean since the last update, - rate for one that got
-- more (sign(mean - count)), with the counts summed over `group` first
-- (the data-parallel ranks: every rank then moves the same way).
-- moe.enable_bias(model) -> layers given a bias (those without one: a
-- layer built with router_bias has its own)
function moe.enable_bias(model)
  local n = 0
  for _, m in ipairs(moe.layers(model)) do
    if m:routing_bias() == nil then
      local w = m[m.router_name].weight
      m:register_buffer('expert_bias', T.zeros({ m.n_experts }, { dtype = 'f32', device = w.device }))
      n = n + 1
    end
  end
  return n
end
-- each layer of list's bias moved by rate against its counts (its slice of
-- c), its counts dropped. (A function of its own, not a closure made at each
-- update: a trace specialised on one keeps its upvalues, that step's
-- counts, alive; docs/tensors.md.)
local function step_biases(list, c, rate)
  local off = 0
  for _, m in ipairs(list) do
    local cm = c:narrow(1, off + 1, m.n_experts)
    m:routing_bias():add_((cm:mean() - cm):sign() * rate)
    off = off + m.n_experts
    rawset(m, '_tokens', nil)
  end
end
-- moe.update_bias(model, rate, group) -> the layers updated (those with a
-- bias that ran forwards under grad since the last update); group: the
-- counts' all-reduce (nil: none). A no-op for a layer without counts.
function moe.update_bias(model, rate, group)
  local list = {}
  for _, m in ipairs(moe.layers(model)) do
    if m:routing_bias() ~= nil then list[#list + 1] = m end
  end
  if #list == 0 then return 0 end
  -- every layer's counts in one tensor: one all-reduce a step
  local flat = {}
  for _, m in ipairs(list) do
    local acc = rawget(m, '_tokens') or {}
    for e = 1, m.n_experts do flat[#flat + 1] = acc[e] or 0 end
  end
  local dev = list[1]:routing_bias().device
  local c = ms.tensor(flat, { dtype = 'f32' }):to(dev)
  -- (the counts kept on the device: a multi-token-prediction depth's, its
  -- filler positions left out, MoE:record_stats)
  local off = 0
  for _, m in ipairs(list) do
    local z = rawget(m, '_tokens_dev')
    if z ~= nil then
      c:narrow(1, off + 1, m.n_experts):add_(z:to(dev))
      rawset(m, '_tokens_dev', nil)
    end
    off = off + m.n_experts
  end
  if group ~= nil and group:size() > 1 then ms.dist.all_reduce(c, 'sum', { group = group }) end
  A.no_grad(step_biases, list, c, rate)
  return #list
end
-- moe.reset_counts(model): the counts since the last update dropped (a
-- skipped step)
function moe.reset_counts(model)
  for _, m in ipairs(moe.layers(model)) do rawset(m, '_tokens', nil); rawset(m, '_tokens_dev', nil) end
end

-- moe.expert_parallel(model, group) -> layers: expert parallelism over
-- `group` (default: the world). Every MoE layer of E experts keeps the
-- E / P experts of its block (group rank r: experts r E/P .. (r+1) E/P - 1,
-- their names unchanged) and drops the others; its forward sends each
-- token's rows to the ranks that hold its experts and takes the outputs
-- back (dist.batch_p2p over the group, twice each way a layer). Every rank
-- of the group calls each layer's forward and backward together, each
-- with its own tokens; the router and everything outside the experts stay
-- whole on every rank (their gradients are this rank's tokens': sum or
-- average them over the group as data parallelism does, and leave the
-- experts' alone: each rank's are its own).
function moe.expert_parallel(model, group)
  group = group or ms.dist.world_group
  if group == nil then error('moe.expert_parallel: dist is not initialised (ms.dist.init) and no group given', 2) end
  local P, r = group:size(), group:rank()
  local list = moe.layers(model)
  if #list == 0 then error('moe.expert_parallel: the model has no MoE layers', 2) end
  local nn = require 'moonshard.nn'
  for _, m in ipairs(list) do
    if rawget(m, '_ep') then error('moe.expert_parallel: the model is already expert-parallel', 2) end
    local E = m.n_experts
    if E % P ~= 0 then
      error(('moe.expert_parallel: %d experts do not split over %d ranks'):format(E, P), 2)
    end
  end
  for _, m in ipairs(list) do
    local E = m.n_experts
    local El = E / P
    local keep = nn.ModuleList()
    for j = 1, El do
      local e = r * El + j
      keep:register_module(tostring(e - 1), m.experts[e])
      rawset(keep, j, m.experts[e])
    end
    m:register_module('experts', keep)
    rawset(m, '_ep', { group = group, size = P, rank = r, ranks = group:ranks(), local_experts = El })
  end
  return list
end

-- moe.layers(model) -> the model's MoE modules, in order
function moe.layers(model)
  local nn = require 'moonshard.nn'
  local r = {}
  for _, m in model:named_modules() do
    if getmetatable(m) == nn.MoE then r[#r + 1] = m end
  end
  return r
end

-- moe.aux_loss(layers, top_k) -> E · Σ_e f̄_e · P̄_e (Switch / GShard's
-- load-balancing loss, as transformers' load_balancing_loss_func: over
-- every layer's tokens at once), f̄_e the share of all the layers' N·k
-- slots that went to expert e, P̄_e the router's mean score of e over every
-- layer's tokens; a (1)-tensor, differentiable through the scores; nil when
-- no layer has statistics (no forward since clear_stats)
function moe.aux_loss(layers)
  local list, E = {}, nil
  for _, m in ipairs(layers) do
    local st = rawget(m, '_stats')
    if st and st.ungathered then error(ungathered('moe.aux_loss'), 2) end
    local c, p, n = m:last_stats()
    if c and p == nil then
      error('moe.aux_loss: the last forward\'s router scores were released by its backward '
        .. '(autograd.release_activations): take the loss between the forward and the backward', 2)
    end
    if c then
      list[#list + 1] = { counts = c, mean = p, n = n }
      E = m.n_experts
    end
  end
  if #list == 0 then return nil end
  return (switch_loss(list, E))
end

-- moe.seq_aux_loss(layers, alpha, opts) -> Σ over the layers of their
-- last forward's sequence-wise balance loss (above: alpha Σ_i f_i P_i a
-- sequence, averaged over the sequences), a (1)-tensor differentiable
-- through the scores; nil when no layer has statistics. opts: choice
-- ('routing' or 'scores'), per_sequence (true). Under context parallelism
-- (the layers' cp context) the counts and score sums are every rank's of
-- each sequence: the value is the whole sequences' on every rank, and a
-- rank's gradient the group's size times its tokens' share (the ranks'
-- gradients are averaged). Take it between the forward and the backward
-- (the backward releases the scores under autograd.release_activations);
-- a model's training loss adds it through seq_aux_begin / seq_aux_end
-- instead, which activation checkpointing takes too.
function moe.seq_aux_loss(layers, alpha, opts)
  check_alpha(alpha, 'moe.seq_aux_loss')
  opts = opts or {}
  check_opts(opts, 'moe.seq_aux_loss')
  local per_seq = opts.per_sequence ~= false
  local total
  for _, m in ipairs(layers) do
    local st = rawget(m, '_stats')
    if st then
      if st.ungathered then error(ungathered('moe.seq_aux_loss'), 2) end
      if st.probs.storage == nil then
        error('moe.seq_aux_loss: the last forward\'s router scores were released by its backward '
          .. '(autograd.release_activations): take the loss between the forward and the backward', 2)
      end
      local s = seq_aux_sums(st.probs, aux_ids(m, st.probs, st.ids, opts.choice), st.seq, m.score == 'sigmoid',
        per_seq, rawget(m, '_cp'), rawget(m, '_pad'))
      local f = s.c * (s.E / (s.k * s.T))
      -- (P: every rank's sums, the gradient through this rank's n times)
      local P = s.n == 1 and s.psum or s.psum * s.n + (s.pg - s.psum:detach() * s.n)
      local term = (f * P):sum():reshape({ 1 }) * (alpha / (s.B * s.T))
      total = total and total + term or term
    end
  end
  return total
end

return moe
