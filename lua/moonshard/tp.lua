-- moonshard.tp — tensor parallelism: Megatron-LM's layout of a transformer
-- over a group of ranks that hold the same tokens (docs/tp.md).
--
--   ms.dist.init{}
--   local model = gpt2.new('gpt2-124m')            -- the same weights on every rank (same seed)
--   local mesh = ms.dist.mesh{ replicate = 2, shard = 4 } -- 8 ranks: 2 data-parallel x 4-way TP
--   ms.tp.parallelize(model, { group = mesh.shard })
--   local loss = model(x, y)                        -- x, y the same on the ranks of mesh.shard
--   loss:backward()
--   ms.tp.all_reduce_grads(model, mesh.replicate)   -- data parallelism across the other axis
--   ms.tp.clip_grad_norm_(model, 1.0)
--
-- What is split (Megatron-LM; torchtitan's plan for Llama):
--   attention  q, k, v column-parallel by heads (GPT-2's fused c_attn: each
--              rank its heads' columns of the q, k and v sections), the
--              output projection row-parallel: a partial sum all-reduced,
--              then its bias;
--   MLPs       the up (and gate) projections column-parallel, the down
--              projection row-parallel;
--   vocabulary the token embedding and the LM head by rows
--              (flce.vocab_shard's split, uneven V allowed): an embedding
--              lookup is masked to the rank's rows and all-reduced, and the
--              loss is the vocabulary-parallel fused cross-entropy, exact;
--   the rest   norms, position embeddings and the row-parallel biases are
--              replicated, with the same gradient on every rank.
-- The residual stream is replicated: an attention or MLP block all-reduces
-- its input's gradient in backward (Megatron's f) and its output in forward
-- (g): two all-reduces of (B, T, C) a block each way. With
-- sequence_parallel it is each rank's tokens instead (all-gather and
-- reduce-scatter in their place; the embedding's sums reduce-scattered to
-- the rank's tokens, the loss's grad_x by the head's gather: sp.embed,
-- sp.gather_for_loss). opts.plan splits modules by name; a
-- model split here can then be given to fsdp.fully_shard over the other
-- mesh axis (FSDP x TP).
--
-- Contents: the differentiable collectives (copy_to, reduce_from,
-- gather_last, the sequence-parallel four), slicing, the styles' forwards,
-- parallelize, clipping and data parallelism, whole state dicts and
-- checkpoints (also of a model under fully_shard).
local T = require 'moonshard.tensor'
local A = require 'moonshard.autograd'
local dist = require 'moonshard.dist'
local flce = require 'moonshard.flce'
local ops = A.ops
local F = require 'moonshard.ops'

local tp = {}

local shape_str = T.shape_str

local function check_group(g, fname)
  if type(g) ~= 'table' or type(g.rank) ~= 'function' or type(g.size) ~= 'function' then
    error(('%s: opts.group must be a ms.dist group (ms.dist.get_world_group(), a mesh axis), got %s'):format(
      fname, type(g)), 3)
  end
  if not g:is_member() then error(('%s: this rank is not a member of the group'):format(fname), 3) end
  return g
end

-- ------------------------------------------------- differentiable collectives

local skip_comm = false

-- Overlap (tp.parallelize's opts.overlap, on by default): an entry's
-- output is tagged (A.set_defer_readers), so the split layers reading it
-- leave their weight gradients in the backward's deferred queue, as the
-- row-parallel layers do (nnf.defer_weight_grads); the entry's backward
-- begins its collective (async) and hands the Work to run_beside: the
-- queue runs (those GEMMs beside the collective), then the compute stream
-- waits for it
local function run_beside(w)
  A.flush_deferred()
  w:wait()
  w:free()
end

-- copy_to(x, group): x in forward; the gradient all-reduced (summed) over
-- the group in backward (Megatron's f: a replicated input of a split layer)
local function reduce_input_grad(s, group, overlap)
  if skip_comm then return end
  if overlap then run_beside(dist.all_reduce(s, 'sum', { group = group, async = true }))
  else dist.all_reduce(s, 'sum', { group = group }) end
end

local CopyTo = A.Function {
  name = 'tp_copy_to',
  owns_results = true,
  forward = function(ctx, x, group, overlap)
    ctx.group, ctx.overlap = group, overlap
    return x
  end,
  backward = function(ctx, g)
    local s = g:clone()
    reduce_input_grad(s, ctx.group, ctx.overlap)
    return s, nil, nil
  end,
}
-- copy_to(x, group, overlap)
function tp.copy_to(x, group, overlap)
  if group:size() == 1 then return x end
  local y = CopyTo(x, group, overlap == true)
  if overlap and A.needs_grad(y) then A.set_defer_readers(y) end
  return y
end

-- reduce_from(x, group): the sum of every rank's x in forward, a new
-- tensor; the gradient as it comes in backward (Megatron's g: the partial
-- sums of a row-parallel layer)
-- (inplace: x is a temporary of the caller's, summed where it is)
local ReduceFrom = A.Function {
  name = 'tp_reduce_from',
  forward = function(_, x, group, inplace)
    local y = (inplace and x:is_contiguous()) and x or x:clone()
    if not skip_comm then dist.all_reduce(y, 'sum', { group = group }) end
    return y
  end,
  backward = function(_, g) return g, nil, nil end,
}
function tp.reduce_from(x, group, inplace)
  if group:size() == 1 then return x end
  return ReduceFrom(x, group, inplace)
end

-- all_reduce_max(t, group): t (a float8 amax) replaced by its maximum over
-- the group, in place (float8's tp_scales = 'group'; skipped with skip_comm)
function tp.all_reduce_max(t, group)
  if not skip_comm and group:size() > 1 then dist.all_reduce(t, 'max', { group = group }) end
  return t
end

-- all_reduce_max_async(t, group) -> a Work (w:wait() makes the current
-- stream wait; w:free()) or nil (nothing to wait for): as all_reduce_max,
-- begun, for work to go on beside it
function tp.all_reduce_max_async(t, group)
  if skip_comm or group:size() == 1 then return nil end
  return dist.all_reduce(t, 'max', { group = group, async = true })
end

-- tp.set_skip_comm(on) -> the previous setting: every collective of the
-- split layers skipped (benchmarks: the step without its communication;
-- the numbers are then wrong)
function tp.set_skip_comm(on)
  local prev = skip_comm
  skip_comm = on and true or false
  return prev
end

-- gather_last(x, group, total): x (..., n_r) holds columns [start_r,
-- start_r + n_r) of a last dimension of `total` split by flce.vocab_shard;
-- the whole (..., total) on every rank. Backward: the rank's own columns.
local GatherLast = A.Function {
  name = 'tp_gather_last',
  owns_results = true,
  forward = function(ctx, x, group, total)
    local size, rank = group:size(), group:rank()
    local per = math.ceil(total / size)
    local nd = x.ndim
    local s = {}
    for i = 1, nd - 1 do s[i] = x.shape[i] end
    -- every rank's columns padded to `per`, as a leading dimension of the buffer
    local padded = T.zeros({ per, x:numel() / math.max(1, x.shape[nd]) }, { dtype = x.dtype, device = x.device })
    local n = x.shape[nd]
    if n > 0 then
      local xt = x:reshape({ -1, n }):t()
      padded:narrow(1, 1, n):copy_(xt)
    end
    local all = T.empty({ size * per, padded.shape[2] }, { dtype = x.dtype, device = x.device })
    dist.all_gather_into(all, padded, { group = group })
    padded:free()
    local full = all:narrow(1, 1, total):t():contiguous()
    all:free()
    s[nd] = total
    local y = full:view(s)
    ctx.start, ctx.n = math.min(rank * per, total), n
    return y
  end,
  backward = function(ctx, g)
    return g:narrow(g.ndim, ctx.start + 1, ctx.n):contiguous():clone(), nil, nil
  end,
}
function tp.gather_last(x, group, total)
  if group:size() == 1 then return x end
  return GatherLast(x, group, total)
end

-- ------------------------------------------------ sequence parallelism
-- The residual stream between the split layers held as each rank's rows of
-- the flattened tokens: (B·T, C) viewed as N chunks of n = B·T/N rows (a
-- shard is 2-D, (n, C); the whole stream 3-D, (B, T, C)). Megatron-LM's
-- sequence parallelism: the norms, residual adds and dropout run on 1/N of
-- the tokens, an all-gather of the shards replaces the split layers'
-- input copy and a reduce-scatter their output all-reduce (the same bytes).

-- every rank's rows (n, C) -> the whole stream (B, T, C) (skip_comm: this
-- rank's rows, zeros elsewhere)
local function seq_all_gather(x, sp)
  local C = x.shape[x.ndim]
  local all = T.empty({ sp.B * sp.T, C }, { dtype = x.dtype, device = x.device })
  local xc = x:contiguous()
  if skip_comm then
    all:zero_()
    local mine = all:narrow(1, sp.rank * sp.n + 1, sp.n)
    mine:copy_(xc)
    mine:free()
  else
    dist.all_gather_into(all, xc, { group = sp.group })
  end
  if xc ~= x then xc:free() end
  -- (the 2-D handle let go here: the view alone holds the storage, which
  -- then goes when the view's consumer frees it, not when the GC runs)
  local v = all:view({ sp.B, sp.T, C })
  all:free()
  return v
end

-- the whole stream (B, T, C) -> this rank's rows (n, C): summed over the
-- group (reduce) or as they are
-- (overlap: the reduce-scatter started, the backward's deferred work run
-- beside it, then waited for: SeqGather's backward)
local function seq_rows(x, sp, reduce, overlap)
  local C = x.shape[x.ndim]
  local xc = x:contiguous()
  local out
  if reduce and not skip_comm then
    out = T.empty({ sp.n, C }, { dtype = x.dtype, device = x.device })
    if overlap then run_beside(dist.reduce_scatter(out, xc, 'sum', { group = sp.group, async = true }))
    else dist.reduce_scatter(out, xc, 'sum', { group = sp.group }) end
  else
    local v = xc:view({ sp.B * sp.T, C })
    local mine = v:narrow(1, sp.rank * sp.n + 1, sp.n)
    out = mine:clone()
    mine:free(); v:free()   -- (not left to the GC: they hold the whole x)
  end
  if xc ~= x then xc:free() end
  return out
end

local function seq_function(name, fwd, bwd)
  return A.Function {
    name = name,
    owns_results = true,
    forward = function(ctx, x, sp)
      ctx.sp = sp
      return fwd(x, sp)
    end,
    backward = function(ctx, g) return bwd(g, ctx.sp), nil end,
  }
end
local function reduced_rows(x, sp) return seq_rows(x, sp, true) end
local function own_rows(x, sp) return seq_rows(x, sp, false) end

-- a split layer's input: every rank's rows gathered; backward: the
-- gradient summed over the group (each rank's split layers give a partial
-- gradient of the whole input), this rank's rows
local SeqGather = seq_function('tp_seq_gather', seq_all_gather,
  function(g, sp) return seq_rows(g, sp, true, sp.overlap) end)
-- a split layer's partial sums (B, T, C), summed over the group: this
-- rank's rows; backward: every rank's gradient rows gathered
local SeqReduceScatter = seq_function('tp_seq_reduce_scatter', reduced_rows, seq_all_gather)
-- the replicated stream -> this rank's rows; backward: every rank's
-- gradient rows gathered (the stream before is replicated)
local SeqSplit = seq_function('tp_seq_split', own_rows, seq_all_gather)
-- this rank's rows -> the whole stream, for what follows the split layers
-- (the LM head, the model's output); backward: this rank's rows of the
-- gradient, the same on every rank there (the vocabulary-parallel loss and
-- the head's input copy sum it over the group)
local SeqUnsplit = seq_function('tp_seq_unsplit', seq_all_gather, own_rows)
-- this rank's rows -> the whole stream, for a loss whose gradient comes
-- back partial on each rank (the vocabulary-parallel loss's grad_x, each
-- rank's classes' part); backward: summed over the group, this rank's rows
-- (as SeqGather's, with nothing run beside it)
local SeqGatherSum = seq_function('tp_seq_gather_sum', seq_all_gather, reduced_rows)

-- the sequence-parallel state of a model: on for a forward whose B·T
-- divides over the group (set by scatter at the decoder's start); the
-- split layers, dropout and the head read it
local function new_sp(group)
  local sp = { group = group, size = group:size(), rank = group:rank(), active = false }
  -- (B, T, C) replicated -> this rank's rows, when B·T divides; else the
  -- forward runs replicated, as without sequence parallelism
  function sp.scatter(x)
    if x.ndim ~= 3 then sp.active = false; return x end
    if not sp.expect(x.shape[1], x.shape[2]) then return x end
    return SeqSplit(x, sp)
  end
  -- the state of a forward over (B, T) tokens that comes in as this
  -- rank's rows already (a pipeline stage after the first, pp.lua): on
  -- when B·T divides over the group -> whether it is on
  function sp.expect(B, Tn)
    sp.active = (B * Tn) % sp.size == 0 and sp.size > 1
    if sp.active then sp.B, sp.T, sp.n = B, Tn, B * Tn / sp.size end
    return sp.active
  end
  -- sp.embed(emb, ids) -> the token embedding of ids (B, T) as the
  -- decoder's input: this rank's rows (n, C) when B·T divides, else the
  -- whole (B, T, C) (sp.scatter's rule). A vocabulary-parallel embedding
  -- (tp.parallelize's) hands its masked lookup's partial sums to one
  -- reduce-scatter along the tokens (backward: the rows' gradients all-
  -- gathered), Megatron-LM's; not an all-reduce of the whole stream and
  -- then this rank's rows (sp.ends_rs false: that path, to compare). emb
  -- must be the module whose output is the stream as it is (GPT-2 adds its
  -- position embeddings after wte: not this). Exact: each token's row is
  -- nonzero on the one rank that holds it, so any order sums it alike
  function sp.embed(emb, ids)
    local t = rawget(emb, '_tp')
    if sp.ends_rs and t ~= nil and t.total ~= nil and ids.ndim == 2 and sp.expect(ids.shape[1], ids.shape[2]) then
      t.rows_to = sp
      local ok, y = pcall(emb, ids)
      t.rows_to = nil
      if not ok then error(y, 0) end
      if y.ndim == 2 then return y end
      return sp.scatter(y)
    end
    return sp.scatter(emb(ids))
  end
  -- sp.gather_for_loss(x) -> x, partial: the normed rows (n, C) gathered
  -- to the whole (B, T, C) for the vocabulary-parallel loss, and whether
  -- the loss must leave its grad_x as this rank's classes' part (flce's
  -- opts.grad_x_partial): the gather's backward then reduce-scatters it
  -- to this rank's rows, Megatron-LM's, where the loss would all-reduce
  -- the whole and the gather keep this rank's rows (sp.ends_rs false).
  -- A whole tensor as it is (partial false)
  function sp.gather_for_loss(x)
    if not sp.active or x.ndim ~= 2 then return x, false end
    if not sp.ends_rs then return SeqUnsplit(x, sp), false end
    return SeqGatherSum(x, sp), true
  end
  -- a shard back to the whole (B, T, C); a whole tensor as it is
  function sp.gather(x)
    if not sp.active or x.ndim ~= 2 then return x end
    return SeqUnsplit(x, sp)
  end
  -- a split layer's input: the shard gathered (its gradient reduce-
  -- scattered), or the replicated input copied (its gradient all-reduced)
  function sp.enter(x)
    if sp.active and x.ndim == 2 then
      local y = SeqGather(x, sp)
      if sp.overlap and A.needs_grad(y) then A.set_defer_readers(y) end
      return y
    end
    return tp.copy_to(x, group, sp.overlap)
  end
  return sp
end

-- x itself (an alias), its gradient divided by n: a replicated consumer of
-- a gathered tensor whose gradient is the same on every rank, beside split
-- ones whose partial gradients the gather's reduce-scatter sums: the sum
-- then holds the replicated part once
local GradShare = A.Function {
  name = 'tp_grad_share',
  owns_results = true,
  forward = function(ctx, x, n)
    ctx.n = n
    return A.raw_views.alias(x)
  end,
  backward = function(ctx, g) return F.mul(g, 1 / ctx.n), nil end,
}

-- An nn.MoE layer under tp.parallelize (its _tp: info): moe_enter(x) ->
-- xr, xe: every token for the router (replicated; its gradient the same on
-- every rank) and for the split experts (their gradients partial: summed
-- over the group). Under sequence parallelism both are one all-gather of
-- this rank's rows: xe the gathered rows, xr the same with its gradient
-- divided by the group's size (GradShare), so the gather's reduce-scatter
-- adds the router's gradient once to the experts' summed ones.
-- moe_exit(y): the experts' partial sums summed over the group (this
-- rank's rows under sequence parallelism)
function tp.moe_enter(x, info)
  local sp = info.sp
  if sp and sp.active and x.ndim == 2 then
    local xe = SeqGather(x, sp)
    return GradShare(xe, sp.size), xe
  end
  return x, tp.copy_to(x, info.group)
end
-- a layer that computes on every token replicated (nn.MLAttention's
-- latents): x itself, or under sequence parallelism every rank's rows
-- gathered (its gradient this rank's rows: the same on every rank)
function tp.gathered(x, info)
  local sp = info.sp
  if sp and sp.active and x.ndim == 2 then return SeqUnsplit(x, sp) end
  return x
end
function tp.moe_exit(y, info)
  local sp = info.sp
  if sp and sp.active then return SeqReduceScatter(y:reshape({ sp.B, sp.T, y.shape[y.ndim] }), sp) end
  -- (y is the layer's own sum of its routed and shared parts, which no
  -- backward reads: summed in place, no copy a layer)
  return tp.reduce_from(y, info.group, true)
end

-- An nn.MoE layer split by expert parallelism over a group that holds the
-- tensor-parallel group (ep.parallelize, then tp.parallelize; docs/moe.md,
-- "Expert and tensor parallelism"): each rank routes its own rows of the
-- group's tokens and sends them over the expert group (its experts whole),
-- so the tokens each rank holds must differ. moe_rows(x, info, shared) ->
-- xo (n, H) this rank's rows, and the layer's context for moe_gather and
-- moe_join:
--   sequence parallel ('sp'): x is this rank's rows already; a shared
--     expert reads every row gathered (moe_enter);
--   replicated x, no shared expert, rows that divide ('gather'): this
--     rank's rows (SeqSplit: the input's gradient rows all-gathered), the
--     outputs all-gathered (SeqUnsplit): one all-gather each way, half
--     an all-reduce's bytes;
--   replicated x otherwise ('sum'): ranks r N/n .. (r+1) N/n - 1 (floors),
--     from x through copy_to, so the input's gradient (this rank's rows,
--     zeros elsewhere, plus the split shared expert's partial one) is one
--     all-reduce; the outputs zero-filled, added to the shared expert's
--     partial sums and summed in one all-reduce (the sum a shared expert
--     needs anyway; adding zeros is exact).
-- The router runs on this rank's rows: its weight enters through copy_to
-- (MoE:forward_ep_tp), its gradient summed over the group.
local GatherRows, PlaceRows

-- every rank's rows counted: rank r's start and count among N rows
local function row_split(N, size, r)
  local a, b = math.floor(r * N / size), math.floor((r + 1) * N / size)
  return a, b - a
end

function tp.moe_rows(x, info, shared)
  local sp = info.sp
  local H = x.shape[x.ndim]
  local g, size, rank = info.group, info.size, info.rank
  if sp and sp.active and x.ndim == 2 then
    local ctx = { mode = 'sp', N = sp.B * sp.T, T = sp.T, start = sp.rank * sp.n, n = sp.n, sp = sp }
    if shared then
      local xr, xe = tp.moe_enter(x, info)
      ctx.xr, ctx.xe = xr:reshape({ ctx.N, H }), xe:reshape({ ctx.N, H })
    end
    return x, ctx
  end
  local N = x:numel() / H
  local Tl = x.ndim >= 3 and x.shape[x.ndim - 1] or N
  local x2 = x:reshape({ N, H })
  local a, n = row_split(N, size, rank)
  local ctx = { N = N, T = Tl, start = a, n = n }
  if not shared and N % size == 0 and size > 1 then
    ctx.mode = 'gather'
    ctx.sp = { group = g, size = size, rank = rank, B = N / Tl, T = Tl, n = N / size, active = true }
    return SeqSplit(x2:view({ N / Tl, Tl, H }), ctx.sp), ctx
  end
  ctx.mode = 'sum'
  local xc = tp.copy_to(x2, g)
  if shared then ctx.xr, ctx.xe = x2, xc end
  return xc:narrow(1, a + 1, n), ctx
end

-- moe_gather(t, ctx, info) -> every rank's rows of t (n, C) in rank order,
-- (N, C) on every rank of the group: the group's routing (scores,
-- differentiable: the gradient's own rows in backward; or the experts'
-- ids), what the balancing losses and the bias counts read under --tp alone
function tp.moe_gather(t, ctx, info)
  if info.size == 1 then return t end
  return GatherRows(t, ctx, info.group)
end

-- moe_join(y (n, H) this rank's rows' routed output, s (N, H) the split
-- shared expert's partial sums or nil, ctx, info) -> the layer's output
-- (the rows x held: this rank's under sequence parallelism, else every row)
function tp.moe_join(y, s, ctx, info)
  local H = y.shape[y.ndim]
  if ctx.mode == 'sp' then
    if s == nil then return y end
    return SeqReduceScatter(s:reshape({ ctx.sp.B, ctx.sp.T, H }), ctx.sp) + y
  elseif ctx.mode == 'gather' then
    return SeqUnsplit(y, ctx.sp):reshape({ ctx.N, H })
  end
  local z = PlaceRows(y, ctx)
  if s ~= nil then z = z + s end
  return tp.reduce_from(z, info.group, true)
end

-- (the raw gather: ranks' counts of rows from row_split or equal, padded
-- to the largest for the all-gather)
local function gather_rows(t, ctx, group)
  local size = group:size()
  local C = t.shape[2]
  local per, even = 0, true
  local counts = {}
  for r = 0, size - 1 do
    local n
    if ctx.mode == 'sp' or ctx.mode == 'gather' then n = ctx.n else local _; _, n = row_split(ctx.N, size, r) end
    counts[r + 1] = n
    per = math.max(per, n)
    if n ~= counts[1] then even = false end
  end
  local tc = t:contiguous()
  local src = tc
  if not even and tc.shape[1] < per then
    src = T.zeros({ per, C }, { dtype = t.dtype, device = t.device })
    if tc.shape[1] > 0 then src:narrow(1, 1, tc.shape[1]):copy_(tc) end
  end
  local all = T.empty({ size * per, C }, { dtype = t.dtype, device = t.device })
  dist.all_gather_into(all, src, { group = group })
  if src ~= tc then src:free() end
  if tc ~= t then tc:free() end
  if even then return all end
  local parts = {}
  for r = 0, size - 1 do
    if counts[r + 1] > 0 then parts[#parts + 1] = all:narrow(1, r * per + 1, counts[r + 1]) end
  end
  local out = F.cat(parts, 1)
  all:free()
  return out
end

GatherRows = A.Function {
  name = 'tp_gather_rows',
  owns_results = true,
  forward = function(c, t, ctx, group)
    c.start, c.n = ctx.start, ctx.n
    return gather_rows(t, ctx, group)
  end,
  backward = function(c, g) return g:narrow(1, c.start + 1, c.n):contiguous():clone(), nil, nil end,
}

-- PlaceRows(y (n, C), ctx) -> (N, C): y at rows start .. start + n - 1,
-- zeros elsewhere; backward: those rows of the gradient
PlaceRows = A.Function {
  name = 'tp_place_rows',
  owns_results = true,
  forward = function(c, y, ctx)
    c.start, c.n = ctx.start, ctx.n
    local z = T.zeros({ ctx.N, y.shape[2] }, { dtype = y.dtype, device = y.device })
    if ctx.n > 0 then z:narrow(1, ctx.start + 1, ctx.n):copy_(y) end
    return z
  end,
  backward = function(c, g) return g:narrow(1, c.start + 1, c.n):contiguous():clone(), nil end,
}

-- dropout on a shard: the mask the unsplit model draws for the whole
-- stream, this rank's rows of it (Philox: an element's value depends only
-- on seed and offset + index), the generator advanced past the whole
local function sp_dropout_forward(self, x)
  local sp = rawget(self, '_sp')
  local nnf = require 'moonshard.nn.functional'
  if not (sp.active and x.ndim == 2 and self.training and self.p > 0) then
    return getmetatable(self).forward(self, x)
  end
  local st = T.rng_state()
  local C = x.shape[2]
  local y = nnf.dropout(x, self.p, true, { seed = st.seed, offset = st.offset + sp.rank * sp.n * C })
  local total = sp.B * sp.T * C
  T.set_rng_state({ seed = st.seed, offset = st.offset + math.ceil(total / 4) * 4 })
  return y
end

-- -------------------------------------------------------------- slicing

-- this rank's piece of a parameter: along `dim` (1-based), `sections`
-- equal parts (GPT-2's q|k|v), each split evenly over `size` ranks
local function split_even(t, dim, size, rank, sections, what)
  sections = sections or 1
  local n = t.shape[dim]
  if n % (sections * size) ~= 0 then
    error(('tp.parallelize: %s %s: dim %d (%d%s) does not split over %d ranks'):format(what, shape_str(t.shape),
      dim, n, sections > 1 and (' in %d sections'):format(sections) or '', size), 4)
  end
  local sec, piece = n / sections, n / (sections * size)
  local parts = {}
  for s = 0, sections - 1 do parts[#parts + 1] = t:narrow(dim, s * sec + rank * piece + 1, piece) end
  if #parts == 1 then return parts[1]:contiguous():clone() end
  return F.cat(parts, dim)
end

-- rows [a, a + n) of the vocabulary split (flce.vocab_shard)
local function split_vocab(t, size, rank)
  local a, n = flce.vocab_shard(t.shape[1], rank, size)
  if n == 0 then return T.empty({ 0, t.shape[2] }, { dtype = t.dtype, device = t.device }), a, n end
  return t:narrow(1, a + 1, n):contiguous():clone(), a, n
end

-- replaces m[name] by its slice, a new leaf with the old one's requires_grad
local function replace(m, name, fn, prefix, info, how)
  local p = rawget(m, name)
  if p == nil then return end
  if T.is_deferred(p) then T.materialize(p) end
  local s = A.no_grad(fn, p)
  s.requires_grad = p.requires_grad
  rawset(m, name, s)
  info.split[prefix .. name] = how
end

-- ------------------------------------------------------------ the styles

-- a row-parallel Linear / Conv1D: the local product's partial sum, summed
-- over the group, then the (replicated) bias
-- the local product of a split layer: float8.linear when float8.convert
-- took the layer (scales of this rank's shards), else the plain one
local function local_linear(self, x, b, conv1d)
  local f8 = rawget(self, '_float8')
  if f8 ~= nil then
    return require('moonshard.float8').linear(x, self.weight, b,
      { config = f8.config, wt = f8.wt, tp = rawget(self, '_tp_shard') })
  end
  local nnf = require 'moonshard.nn.functional'
  return conv1d and nnf.conv1d_linear(x, self.weight, b) or nnf.linear(x, self.weight, b)
end

local function rowwise_forward(self, x)
  local t = rawget(self, '_tp')
  local nnf = require 'moonshard.nn.functional'
  -- (overlap: this layer's weight gradient waits for the next entry's
  -- collective in the backward, and runs beside it)
  local prev = nnf.defer_weight_grads(t.overlap)
  local ok, y = pcall(local_linear, self, x, nil, t.conv1d)
  nnf.defer_weight_grads(prev)
  if not ok then error(y, 0) end
  local sp = t.sp
  if sp and sp.active and y.ndim == 3 then
    y = SeqReduceScatter(y, sp)            -- (sequence parallel: this rank's rows)
  else
    y = tp.reduce_from(y, t.group, true)   -- (y is ours: summed in place)
  end
  if self.bias ~= nil then
    -- in an autocast region the bias in the region's dtype, as the unsplit
    -- layer's epilogue adds it
    local yb, b = require('moonshard.amp').cast(y, self.bias)
    y = ops.add(yb, b)
  end
  return y
end

-- a column-parallel Linear / Conv1D of a plan (tp.parallelize's opts.plan):
-- the input's gradient summed over the group, the output this rank's
-- features
local function colwise_forward(self, x)
  local t = rawget(self, '_tp')
  x = tp.copy_to(x, t.group, t.overlap)
  if rawget(self, '_float8') ~= nil then return local_linear(self, x, self.bias, false) end
  return getmetatable(self).forward(self, x)
end

-- a vocabulary-parallel embedding: rows [start, start + rows) here; other
-- ids give zeros, and the ranks' lookups are summed
local function vocab_embedding_forward(self, ids)
  local t = rawget(self, '_tp')
  local nnf = require 'moonshard.nn.functional'
  local w = self.weight
  local y
  if t.rows == 0 then
    local s = {}
    for i = 1, ids.ndim do s[i] = ids.shape[i] end
    s[#s + 1] = w.shape[2]
    y = T.zeros(s, { dtype = w.dtype, device = w.device })
  else
    -- row (id - start) mod rows: other ranks' ids land on rows spread as
    -- the ids are (masked to zero below), not all on one row, whose sum in
    -- the backward (index_add: one block a row) would then take 4096
    -- tokens in a row (9 ms a step on the 1.25B Llama)
    local rel = ids - t.start
    local shift = t.rows * (math.floor(t.total / t.rows) + 1)   -- > start: rel + shift >= 0
    local r = rel + shift
    local r64 = r:to('f64')
    local qf = r64 / t.rows
    local q = qf:to('i64')                                       -- floor (r >= 0)
    local qr = q * t.rows
    local li = r - qr
    local inside = li:eq(rel)
    for _, u in ipairs({ rel, r, r64, qf, q, qr }) do u:free() end
    local e = nnf.embedding(li, w)
    local mask = ops.where(inside, 1, 0):to(w.dtype):unsqueeze(ids.ndim + 1)
    y = ops.mul(e, mask)
    li:free(); inside:free()
  end
  -- (sp.embed: the decoder's input as this rank's rows, the partial sums
  -- reduce-scattered along the tokens: half an all-reduce's bytes)
  local sp = t.rows_to
  if sp ~= nil and sp.active and ids.ndim == 2 and ids.shape[1] == sp.B and ids.shape[2] == sp.T then
    return SeqReduceScatter(y, sp)
  end
  return tp.reduce_from(y, t.group, true)
end

local function enter(group, overlap) return function(x) return tp.copy_to(x, group, overlap) end end

local function info_of(model)
  local i = rawget(model, '_tp')
  if i == nil then error('tp: the model was not given to tp.parallelize', 3) end
  return i
end

-- tp.parallelize(model, { group =, plan =, sequence_parallel = }) -> model, in place. Every rank
-- of the group must hold the same parameters (build the model with the same
-- seed, or load the same file; a deferred model is materialized one tensor
-- at a time, so no rank holds more than one whole tensor beyond its slices).
-- The module classes of moonshard.nn are split by the layout above; the
-- token embedding is model:token_embedding() when the model has it
-- (gpt2, llama). opts.plan (name pattern -> 'colwise' | 'rowwise' |
-- 'vocab') splits only the modules it names instead (docs/tp.md, "Plans").
-- The generator's state is made the group's first rank's,
-- so dropout on the replicated stream draws the same masks everywhere.
function tp.parallelize(model, opts)
  local nn = require 'moonshard.nn'
  opts = opts or {}
  if not nn.is_module(model) then error('tp.parallelize: model must be a module', 2) end
  if rawget(model, '_tp') ~= nil then error('tp.parallelize: the model is already tensor-parallel', 2) end
  local g = check_group(opts.group or dist.get_world_group(), 'tp.parallelize')
  local size, rank = g:size(), g:rank()
  -- an MoE layer split by expert parallelism (ep.parallelize first): its
  -- experts stay whole, the expert group must hold this group's ranks (each
  -- rank routes its own rows: moe_rows); ep_rows: this group's ranks' places
  -- in the expert group (0-based, in this group's order)
  local ep_rows = {}
  for name, m in model:named_modules() do
    local e = getmetatable(m) == nn.MoE and rawget(m, '_ep') or nil
    if e ~= nil then
      local at = {}
      for i, r in ipairs(e.ranks) do at[r] = i - 1 end
      local idx = {}
      for _, r in ipairs(g:ranks()) do
        if at[r] == nil then
          error(('tp.parallelize: %s is split by expert parallelism over ranks %s, which do not hold the '
            .. 'tensor-parallel group\'s ranks %s (the expert groups must be made of whole tensor-parallel groups)')
            :format(name, table.concat(e.ranks, ','), table.concat(g:ranks(), ',')), 2)
        end
        idx[#idx + 1] = at[r]
      end
      ep_rows[m] = idx
    end
  end
  -- opts.overlap (default true): the split layers' weight gradients run
  -- beside the entries' collectives in the backward (A.defer)
  local overlap = opts.overlap ~= false
  local info = { group = g, size = size, rank = rank, split = {}, vocab = {}, overlap = overlap }
  -- opts.sequence_parallel: the decoder's residual stream split by tokens
  -- (the model's decoder() reads _sp: gpt2, llama)
  local sp = nil
  if opts.sequence_parallel then
    if opts.plan ~= nil then error('tp.parallelize: sequence_parallel takes the layout by class, not a plan', 2) end
    local dec = model.decoder and model:decoder() or nil
    if dec == nil then
      error('tp.parallelize: sequence_parallel needs a model with decoder() (the module whose forward scatters and '
        .. 'gathers the stream: gpt2, llama)', 2)
    end
    sp = new_sp(g)
    sp.overlap = overlap
    -- (opts.reduce_scatter_ends, default true: the stream's two ends
    -- reduce-scattered, sp.embed and sp.gather_for_loss; false, or
    -- MS_TP_SP_ENDS_RS=0 when the model is parallelized, all-reduces there
    -- and keeps this rank's rows, the layout before, to compare)
    local ends = opts.reduce_scatter_ends
    if ends ~= nil and type(ends) ~= 'boolean' then
      error(('tp.parallelize: opts.reduce_scatter_ends must be a boolean, got %s'):format(type(ends)), 2)
    end
    if ends == nil then ends = os.getenv('MS_TP_SP_ENDS_RS') ~= '0' end
    sp.ends_rs = ends
    info.sp = sp
  end
  local function entry(grp) return sp and sp.enter or enter(grp, overlap) end
  -- (a model whose head_module() is nil for FSDP's units, DeepSeek-V3's
  -- with multi-token prediction, names its head with tp_head_module())
  local head = (model.tp_head_module and model:tp_head_module()) or (model.head_module and model:head_module()) or nil
  local emb = model.token_embedding and model:token_embedding() or nil
  local names = {}
  for name, m in model:named_modules() do names[m] = name end

  local function pre(m) local n = names[m]; return (n == nil or n == '') and '' or n .. '.' end
  -- opts.plan: module name patterns -> 'colwise' | 'rowwise' | 'vocab', in
  -- place of the layout by class (models of one's own)
  local plan = opts.plan
  local assign = nil
  if plan ~= nil then
    if type(plan) ~= 'table' then error('tp.parallelize: opts.plan must be a table of name pattern -> style', 2) end
    assign = {}
    local styles = { colwise = true, rowwise = true, vocab = true }
    local pats = {}
    for pat in pairs(plan) do pats[#pats + 1] = pat end
    table.sort(pats)
    for _, pat in ipairs(pats) do
      local style = plan[pat]
      if type(pat) ~= 'string' or not styles[style] then
        error(("tp.parallelize: plan[%s] = %s: the style must be 'colwise', 'rowwise' or 'vocab'"):format(
          tostring(pat), tostring(style)), 2)
      end
      local hits = 0
      for name, m in model:named_modules() do
        local okf, f = pcall(string.find, name, pat)
        if not okf then error(('tp.parallelize: bad plan pattern %s: %s'):format(pat, tostring(f)), 2) end
        if f and name ~= '' then
          hits = hits + 1
          local cls = getmetatable(m)
          local linear = cls == nn.Linear or cls == nn.Conv1D
          if (style ~= 'vocab' and not linear) or (style == 'vocab' and not (linear or cls == nn.Embedding)) then
            error(('tp.parallelize: plan %s: %s is a %s; %s takes %s'):format(pat, name, m:class_name(), style,
              style == 'vocab' and 'an nn.Embedding or an LM head\'s nn.Linear' or 'an nn.Linear or nn.Conv1D'), 2)
          end
          if assign[m] and assign[m] ~= style then
            error(('tp.parallelize: %s is both %s and %s in the plan'):format(name, assign[m], style), 2)
          end
          assign[m] = style
          -- the split dimension must divide (checked before anything changes)
          local w = m.weight
          local dim
          if style == 'colwise' then dim = cls == nn.Conv1D and 2 or 1
          elseif style == 'rowwise' then dim = cls == nn.Conv1D and 1 or 2 end
          if dim and w.shape[dim] % size ~= 0 then
            error(('tp.parallelize: plan %s: %s.weight %s: dim %d (%d) does not split over %d ranks'):format(pat, name,
              shape_str(w.shape), dim, w.shape[dim], size), 2)
          end
        end
      end
      if hits == 0 then error(('tp.parallelize: plan pattern %s matches no module of the model'):format(pat), 2) end
    end
  end
  -- checks first, so that a model that cannot be split is left whole
  for _, m in model:named_modules() do
    local cls = getmetatable(m)
    if assign then cls = nil end   -- (a plan: only its modules are split)
    if cls == nn.CausalSelfAttention or (cls and rawget(cls, 'tp_heads')) then
      if m.n_head % size ~= 0 or m.n_kv_head % size ~= 0 then
        error(('tp.parallelize: %s has %d heads and %d kv heads; both must be multiples of the group size %d'):format(
          names[m], m.n_head, m.n_kv_head, size), 2)
      end
    elseif cls == nn.MLP or cls == nn.GatedMLP then
      if m.hidden % size ~= 0 then
        error(('tp.parallelize: %s has a hidden size of %d, not a multiple of the group size %d'):format(
          names[m], m.hidden, size), 2)
      end
    elseif cls == nn.MLAttention then
      if m.n_head % size ~= 0 then
        error(('tp.parallelize: %s has %d heads, not a multiple of the group size %d'):format(names[m], m.n_head,
          size), 2)
      end
    elseif cls == nn.MoE then
      local exs = {}
      if not ep_rows[m] then exs[1] = m.experts[1] end   -- (expert-parallel: the experts whole)
      if m.shared_name then exs[#exs + 1] = m[m.shared_name] end
      for _, ex in ipairs(exs) do
        if ex.hidden % size ~= 0 then
          error(('tp.parallelize: %s has experts of hidden size %d, not a multiple of the group size %d'):format(
            names[ex], ex.hidden, size), 2)
        end
        if rawget(ex[ex.names[3]], 'bias') ~= nil then
          error(('tp.parallelize: %s.%s has a bias, which the split experts do not take'):format(names[ex],
            ex.names[3]), 2)
        end
      end
    end
    if rawget(m, '_lora') ~= nil then
      error(('tp.parallelize: %s has LoRA adapters; merge them (nn.merge_lora) or apply them after'):format(names[m]), 2)
    end
  end
  if rawget(model, '_fsdp') ~= nil then
    error('tp.parallelize: the model is already sharded by fully_shard (split it first, then fully_shard over the '
      .. 'other mesh axis)', 2)
  end

  -- the split layers in one order on every rank of the group: float8's
  -- tp_scales = 'group' takes their weights' amaxes in one all-reduce a
  -- step (float8.lua, group_weight_amax)
  local f8reg = { group = g, mods = {} }
  local function shard_of(m, t)
    rawset(m, '_tp_shard', t)
    f8reg.mods[#f8reg.mods + 1] = m
  end
  local function column(m, sections)
    local cls = getmetatable(m)
    local dim = cls == nn.Conv1D and 2 or 1
    local p = pre(m)
    replace(m, 'weight', function(w) return split_even(w, dim, size, rank, sections, p .. 'weight') end, p, info,
      { dim = dim, sections = sections or 1 })
    replace(m, 'bias', function(b) return split_even(b, 1, size, rank, sections, p .. 'bias') end, p, info,
      { dim = 1, sections = sections or 1 })
    -- (for float8's tp_scales: which of the layer's tensors are shards)
    if size > 1 then shard_of(m, { group = g, output = true, reg = f8reg }) end
  end
  local function row(m)
    local cls = getmetatable(m)
    local dim = cls == nn.Conv1D and 1 or 2
    local p = pre(m)
    replace(m, 'weight', function(w) return split_even(w, dim, size, rank, 1, p .. 'weight') end, p, info,
      { dim = dim, sections = 1 })
    if size > 1 then
      rawset(m, '_tp', { group = g, conv1d = cls == nn.Conv1D, sp = sp, overlap = overlap })
      shard_of(m, { group = g, input = true, reg = f8reg })
      rawset(m, 'forward', rowwise_forward)
    end
  end
  -- an expert's (gate, up, down) split as a GatedMLP's (by the hidden
  -- features) with no collective of its own: the MoE layer sums its
  -- routed and shared outputs over the group once (MoE:forward)
  local function expert(ex)
    local nm = ex.names
    for i = 1, 3 do
      local lin = ex[nm[i]]
      local p = pre(lin)
      local dim = i < 3 and 1 or 2
      replace(lin, 'weight', function(w) return split_even(w, dim, size, rank, 1, p .. 'weight') end, p, info,
        { dim = dim, sections = 1 })
      if i < 3 then
        replace(lin, 'bias', function(b) return split_even(b, 1, size, rank, 1, p .. 'bias') end, p, info,
          { dim = 1, sections = 1 })
      end
      -- (a shared expert that float8.convert makes float8 scales its shard
      -- as the split layers do)
      if size > 1 then shard_of(lin, i < 3 and { group = g, output = true, reg = f8reg }
        or { group = g, input = true, reg = f8reg }) end
    end
  end
  local function vocab(m)
    -- (a pipeline's stage that holds no copy of it: pp.pipeline before
    -- this, under --pp --tp --ep)
    if info.vocab[m] or rawget(m, 'weight') == nil then return end
    local p = pre(m)
    local V = m.weight.shape[1]
    local a, n
    replace(m, 'weight', function(w)
      local s
      s, a, n = split_vocab(w, size, rank)
      return s
    end, p, info, { dim = 1, vocab = V })
    info.vocab[m] = { start = a, rows = n, total = V }
    rawset(m, '_tp', { group = g, start = a, rows = n, total = V })
  end

  A.no_grad(function()
    if assign then
      for _, m in model:named_modules() do
        local style = assign[m]
        if style == 'colwise' then
          column(m)
          if size > 1 then
            rawset(m, '_tp', { group = g, overlap = overlap })
            rawset(m, 'forward', colwise_forward)
          end
        elseif style == 'rowwise' then
          row(m)
        elseif style == 'vocab' then
          vocab(m)
          if getmetatable(m) == nn.Embedding then rawset(m, 'forward', vocab_embedding_forward) end
        end
      end
      if head ~= nil and info.vocab[rawget(head, 'proj')] then
        local v = info.vocab[rawget(head, 'proj')]
        rawset(head, '_tp', { group = g, total = v.total, enter = enter(g) })
      end
      return
    end
    for _, m in model:named_modules() do
      local cls = getmetatable(m)
      -- (a model's own attention class with tp_heads = true is split as
      -- this one: q/k/v_proj by heads, o_proj by rows; its forward reads
      -- _tp's n_head, n_kv_head and enter: Llama 4's)
      if cls == nn.CausalSelfAttention or rawget(cls or {}, 'tp_heads') then
        if m.fused_qkv then column(m.c_attn, 3); row(m.c_proj)
        else column(m.q_proj); column(m.k_proj); column(m.v_proj); row(m.o_proj) end
        -- (Qwen3's per-head q/k norms: one weight for every head, each rank
        -- norms its own heads, so its gradient is a part: the weight enters
        -- through copy_to, its gradient summed over the group in the graph
        -- (FSDP's gradient buffers see the sum); under sequence
        -- parallelism the norms' hooks below sum it, in a forward that ran
        -- sequence parallel (one whose B·T does not divide runs
        -- replicated: copy_to sums it there too)
        rawset(m, '_tp', { n_head = m.n_head / size, n_kv_head = m.n_kv_head / size, enter = entry(g),
          qk_sum = (rawget(m, 'q_norm') and size > 1) and function(w)
            if sp and sp.active then return w end
            return tp.copy_to(w, g)
          end or nil })
      elseif cls == nn.MLAttention then
        -- multi-head latent attention by heads: q_b_proj (or q_proj) and
        -- kv_b_proj by their heads' rows, o_proj by rows; the latents
        -- (q_a_proj, kv_a_proj_with_mqa and their norms) and the shared
        -- rotary key replicated, their gradient parts summed where they
        -- enter the split layers (MLA:forward reads _tp.sum)
        -- (latent_gather: under sequence parallelism with q_lora_rank, the
        -- latents of this rank's rows gathered, MLA:forward;
        -- MS_TP_MLA_LATENT_GATHER=0 gathers the rows instead, to compare)
        column(m.q_lora_rank and m.q_b_proj or m.q_proj); column(m.kv_b_proj); row(m.o_proj)
        rawset(m, '_tp', { n_head = m.n_head / size, sp = sp,
          latent_gather = sp ~= nil and m.q_lora_rank ~= nil and os.getenv('MS_TP_MLA_LATENT_GATHER') ~= '0',
          sum = function(t) return tp.copy_to(t, g) end })
      elseif cls == nn.MoE then
        -- every expert (and the shared one) split by its hidden features;
        -- the router, and the shared expert's gate, replicated. Split by
        -- expert parallelism over a group holding this one: the routed
        -- experts whole (each rank routes its own rows, MoE:forward_ep_tp),
        -- the shared expert split as here
        if not ep_rows[m] then
          for j = 1, m.n_experts do expert(m.experts[j]) end
        end
        if m.shared_name then expert(m[m.shared_name]) end
        rawset(m, '_tp', { group = g, sp = sp, size = size, rank = rank, ep_rows = ep_rows[m] })
      elseif cls == nn.MLP then
        column(m.c_fc); row(m.c_proj)
        rawset(m, '_tp', { enter = entry(g) })
      elseif cls == nn.GatedMLP then
        column(m.gate_proj); column(m.up_proj); row(m.down_proj)
        rawset(m, '_tp', { enter = entry(g) })
      elseif cls == nn.Dropout and sp and size > 1 then
        rawset(m, '_sp', sp)
        rawset(m, 'forward', sp_dropout_forward)
      end
    end
    if sp then
      rawset(model:decoder(), '_sp', sp)
      -- the parameters used on this rank's tokens (the norms, the
      -- row-parallel biases) get a partial gradient: summed over the group
      -- as it arrives (before it is accumulated: micro-batches add up as
      -- usual), when the forward ran sequence parallel
      if size > 1 then
        -- each partial gradient is kept (the hook takes it: A.CONSUMED,
        -- nothing accumulated in its place), and at the end of the backward they are summed over the
        -- group in one all-reduce of their concatenation and added to the
        -- parameters' .grad (one small all-reduce per parameter cost ~1-2
        -- ms a step)
        local pending = {}
        -- (a pipeline's step, sp.hold_partial: each parameter's parts summed
        -- over the step's backwards here, one all-reduce at its end)
        local held = nil
        local function flush(list)
          if #list == 0 then return end
          local flats = {}
          for i, e in ipairs(list) do flats[i] = e.g:view({ e.g:numel() }) end
          local flat = #flats == 1 and flats[1] or F.cat(flats, 1)
          if not skip_comm then dist.all_reduce(flat, 'sum', { group = g }) end
          local off = 0
          for _, e in ipairs(list) do
            local n = e.g:numel()
            local part = flat:narrow(1, off + 1, n):view(e.t.shape)
            off = off + n
            -- (the hook took the parts, A.CONSUMED: .grad is made here when
            -- no other gradient made it)
            local cur = e.t.grad
            if cur ~= nil and cur.storage ~= nil then F.add_(cur, part)
            elseif part.dtype == e.dtype then e.t.grad = part:clone()
            else e.t.grad = part:to(e.dtype) end
            part:free()
            e.g:free()
          end
          if flat ~= flats[1] then flat:free() end
          for _, f in ipairs(flats) do f:free() end
        end
        local function flush_pending()
          local list = pending
          pending = {}
          flush(list)
        end
        -- a part kept (in the first part's dtype: one flat all-reduce)
        local function keep(list, grad)
          local c = grad:clone()
          if #list > 0 and c.dtype ~= list[1].g.dtype then
            local c2 = c:to(list[1].g.dtype)
            c:free()
            c = c2
          end
          return c
        end
        local function hook_for(t)
          return function(grad)
            if not sp.active then return nil end
            if held then
              local e = held.by[t]
              if e then
                local gg = grad.dtype ~= e.g.dtype and grad:to(e.g.dtype) or grad
                F.add_(e.g, gg)
                if gg ~= grad then gg:free() end
              else
                e = { t = t, g = keep(held.list, grad), dtype = grad.dtype }
                held.by[t] = e
                held.list[#held.list + 1] = e
              end
              return A.CONSUMED
            end
            if #pending == 0 then A.queue_callback(flush_pending) end
            pending[#pending + 1] = { t = t, g = keep(pending, grad), dtype = grad.dtype }
            return A.CONSUMED
          end
        end
        -- sp.hold_partial(true): from now on the parts are summed over the
        -- backwards until sp.hold_partial(false), which all-reduces their
        -- sum once and adds it to the parameters' .grad (a pipeline's step:
        -- one all-reduce a step instead of one a micro-batch; exact, the
        -- sum is linear); sp.drop_partial(): what is held let go (a step
        -- cut short)
        function sp.hold_partial(on)
          if on then
            held = held or { by = {}, list = {} }
            return
          end
          local h = held
          held = nil
          if h then flush(h.list) end
        end
        function sp.drop_partial()
          local h = held
          held = nil
          for _, e in ipairs(h and h.list or {}) do e.g:free() end
        end
        -- (info.sp_partial: the same tensors by id, for fully_shard, whose
        -- units' gradient buffers these hooks never see: the unit sums
        -- their regions over the group before its own reduction, fsdp.lua)
        local seen = {}
        info.sp_partial = seen
        local function partial(t)
          if t ~= nil and t.requires_grad and not seen[tonumber(t.id)] then
            seen[tonumber(t.id)] = true
            t:register_hook(hook_for(t))
          end
        end
        -- (the latent attention's latent layers run on this rank's rows
        -- when it has q_lora_rank (MLA:forward gathers the latents), their
        -- weight gradients partial; without it on every token gathered,
        -- their gradients whole on every rank)
        local whole = {}
        for _, m in model:named_modules() do
          if getmetatable(m) == nn.MLAttention then
            if m._tp.latent_gather then
              for _, l in ipairs({ m.q_a_proj, m.kv_a_proj_with_mqa }) do
                partial(l.weight); partial(rawget(l, 'bias'))
              end
            else
              whole[m.kv_a_layernorm] = true
              local qn = rawget(m, 'q_a_layernorm')
              if qn then whole[qn] = true end
            end
          end
        end
        for _, m in model:named_modules() do
          local cls = getmetatable(m)
          if (cls == nn.LayerNorm or cls == nn.RMSNorm) and not whole[m] then
            partial(m.weight); partial(rawget(m, 'bias'))
          elseif rawget(m, 'forward') == rowwise_forward then partial(rawget(m, 'bias')) end
          -- (a module's own replicated layers that run on this rank's rows:
          -- its class's tp_sp_partial names them, DeepSeek-V3's MTP eh_proj)
          for _, cn in ipairs(cls and rawget(cls, 'tp_sp_partial') or {}) do
            local c = m[cn]
            partial(c.weight); partial(rawget(c, 'bias'))
          end
          -- (and those that do when the stream's ends are reduce-scattered,
          -- sp.ends_rs: GPT-2's position embeddings)
          for _, cn in ipairs(sp.ends_rs and cls and rawget(cls, 'tp_sp_partial_ends') or {}) do
            local c = m[cn]
            partial(c.weight); partial(rawget(c, 'bias'))
          end
        end
      end
    end
    if emb ~= nil then
      vocab(emb)
      rawset(emb, 'forward', vocab_embedding_forward)
    end
    if head ~= nil then
      local proj = rawget(head, 'proj')
      vocab(proj)
      local v = info.vocab[proj]
      if v then rawset(head, '_tp', { group = g, total = v.total, enter = enter(g), sp = sp }) end
    end
  end)
  -- the group's generator: the first rank's state everywhere
  if size > 1 then
    local s = T.rng_state()
    local st = T.tensor({ s.seed, s.offset }, { dtype = 'f64' })
    local dev = dist.device()
    if dev ~= 'cpu' then st = st:to(dev) end
    dist.broadcast(st, g:ranks()[1], { group = g })
    local v = st:to('cpu'):totable()
    T.set_rng_state({ seed = v[1], offset = v[2] })
  end
  rawset(model, '_tp', info)
  return model
end

function tp.is_parallel(model) return rawget(model, '_tp') ~= nil end

-- tp.sum_partial(flat, sp): flat (a unit's packed regions of the
-- parameters that run on this rank's tokens, sequence parallel) summed
-- over the group in place (skipped with set_skip_comm)
function tp.sum_partial(flat, sp)
  if skip_comm or sp.size == 1 then return end
  dist.all_reduce(flat, 'sum', { group = sp.group })
end
-- the group a parallelized model is split over
function tp.group_of(model) return info_of(model).group end

-- how parameter `name` is split: nil (replicated) or { dim =, sections =,
-- vocab = V (rows by flce.vocab_shard) }
function tp.placement(model, name) return info_of(model).split[name] end

-- tp.boxes(model, name, shape) -> where this rank's slice (of local shape
-- `shape`) of parameter `name` lies in the whole parameter: nil when it
-- is the whole (replicated, a group of one, or a model that is not
-- tensor-parallel), else { shape = (the whole parameter's), dim = d,
-- segs = { { l =, g =, n = }, ... } }: local indices [l, l + n) of dim d
-- are the whole parameter's [g, g + n), every other dim whole; one seg a
-- section (GPT-2's fused q|k|v: three), one for a vocabulary's rows
-- (possibly n = 0). The sharded checkpoints' boxes (fsdp_checkpoint).
function tp.boxes(model, name, shape)
  local info = rawget(model, '_tp')
  local how = info and info.split[name]
  if how == nil or info.size == 1 then return nil end
  local whole = {}
  for i = 1, #shape do whole[i] = shape[i] end
  if how.vocab then
    local a, n = flce.vocab_shard(how.vocab, info.rank, info.size)
    whole[1] = how.vocab
    return { shape = whole, dim = 1, segs = { { l = 0, g = a, n = n } } }
  end
  local d, S = how.dim, how.sections or 1
  local piece = shape[d] / S
  whole[d] = shape[d] * info.size
  local segs = {}
  for s = 0, S - 1 do segs[#segs + 1] = { l = s * piece, g = s * (whole[d] / S) + info.rank * piece, n = piece } end
  return { shape = whole, dim = d, segs = segs }
end

-- ------------------------------------------------------------- training

-- tp.clip_grad_norm_(model, max_norm, opts) -> the total 2-norm before
-- (max_norm nil or math.huge: the norm only, nothing scaled; opts.defer =
-- an AdamW: the scale applied by its next step instead, as
-- ms.optim.clip_grad_norm's defer)
-- clipping, of the whole (unsplit) model's gradient: the split gradients'
-- sum of squares (ms.sum_squares, f64) all-reduced over the group, the
-- replicated ones' added once; the gradients scaled in place by
-- min(1, max_norm / (norm + 1e-6)) on the device. A Lua number (one host
-- read), or with opts.tensor = true a 0-dim f64 tensor on the gradients'
-- device (no host read).
function tp.clip_grad_norm_(model, max_norm, opts)
  local info = info_of(model)
  if max_norm ~= nil and (type(max_norm) ~= 'number' or max_norm <= 0) then
    error(('tp.clip_grad_norm_: max_norm must be a positive number, got %s'):format(tostring(max_norm)), 2)
  end
  local split, rep, all, views = {}, {}, {}, {}
  local dev
  local st = rawget(model, '_fsdp')
  if st then
    -- composed with fully_shard over the other axis: each unit's gradient
    -- shard, cut at its parameters' bounds (the layout's offsets). An
    -- expert unit (ms.ep under --tp --ep: experts whole, split over the
    -- expert group and sharded over their copies) holds each element on
    -- one rank of the world, as a TP slice's shard does: counted with them
    for _, u in ipairs(st.units) do
      local fp = u.fp
      local g = fp.shard.grad
      if g ~= nil then
        dev = dev or g.device
        all[#all + 1] = g
        if u.experts then
          split[#split + 1] = g
        else
          for _, pc in ipairs(require('moonshard.fsdp').grad_pieces(u)) do
            local v = pc[2]
            views[#views + 1] = v
            if info.split[u.param_names[pc[1]]] then split[#split + 1] = v else rep[#rep + 1] = v end
          end
        end
      end
    end
  else
    for name, p in model:named_parameters() do
      local g = p.grad
      if g ~= nil then
        dev = dev or g.device
        if g.device ~= dev then
          error(('tp.clip_grad_norm_: gradients on %s and %s'):format(dev, g.device), 2)
        end
        all[#all + 1] = g
        if info.split[name] then split[#split + 1] = g else rep[#rep + 1] = g end
      end
    end
  end
  dev = dev or dist.device()
  -- every rank calls the all-reduces, with or without gradients
  local optim = require 'moonshard.optim'
  local s1, r = optim.sum_squares(split, dev), optim.sum_squares(rep, dev)
  if st then
    -- the replicated parameters' sum once over the TP group (each rank
    -- holds the same values), then over the FSDP group's shards
    F.mul_(r, 1 / info.size)
    F.add_(s1, r)
    dist.all_reduce(s1, 'sum', { group = info.group })
    if st.shard_group and st.shard_group:size() > 1 then dist.all_reduce(s1, 'sum', { group = st.shard_group }) end
  else
    dist.all_reduce(s1, 'sum', { group = info.group })
    F.add_(s1, r)
  end
  r:free()
  for _, v in ipairs(views) do v:free() end
  local total_t = F.sqrt(s1)
  s1:free()
  if max_norm == nil or max_norm == math.huge then   -- the norm only
    if opts and opts.tensor then return total_t end
    local v = total_t:item()
    total_t:free()
    return v
  end
  local denom = F.add(total_t, 1e-6)
  local coef = F.div(max_norm, denom)
  denom:free()
  local c1 = F.clamp(coef, nil, 1.0)
  coef:free()
  local defer = opts and opts.defer
  if defer ~= nil then
    -- the coefficient goes to the optimizer's next step (ms.optim.AdamW's
    -- defer_grad_scale): no pass over the gradients here
    if type(defer) ~= 'table' or type(defer.defer_grad_scale) ~= 'function' then
      error('tp.clip_grad_norm_: defer must be an optimizer with defer_grad_scale (ms.optim.AdamW)', 2)
    end
    if c1.dtype ~= 'f64' then local c = c1:to('f64'); c1:free(); c1 = c end
    defer:defer_grad_scale(c1:reshape({ 1 }))
    if opts.tensor then return total_t end
    local v = total_t:item()
    total_t:free()
    return v
  end
  local cast = {}
  for _, g in ipairs(all) do
    local c = cast[g.dtype]
    if c == nil then c = c1:to(g.dtype); cast[g.dtype] = c end
    F.mul_(g, c)
  end
  for _, c in pairs(cast) do if c ~= c1 then c:free() end end
  c1:free()
  if opts and opts.tensor then return total_t end
  local v = total_t:item()
  total_t:free()
  return v
end

-- tp.all_reduce_grads(model, group, op = 'avg'): data parallelism over the
-- other mesh axis: every gradient reduced over `group` (ranks holding the
-- same slices)
function tp.all_reduce_grads(model, group, op)
  check_group(group, 'tp.all_reduce_grads')
  if group:size() == 1 then return end
  local grads = {}
  for _, p in ipairs(model:parameters()) do
    if p.grad ~= nil then grads[#grads + 1] = p.grad end
  end
  -- (in buckets: dist.all_reduce_coalesced)
  dist.all_reduce_coalesced(grads, op or 'avg', { group = group })
end

-- the whole of tensor t, split as `how` says, on every rank of the group
local function gather(info, how, t)
  local g, size = info.group, info.size
  if how.vocab then
    local per = math.ceil(how.vocab / size)
    local C_ = t.shape[2]
    local pad = T.zeros({ per, C_ }, { dtype = t.dtype, device = t.device })
    if t.shape[1] > 0 then pad:narrow(1, 1, t.shape[1]):copy_(t) end
    local all = T.empty({ per * size, C_ }, { dtype = t.dtype, device = t.device })
    dist.all_gather_into(all, pad, { group = g })
    pad:free()
    local out = all:narrow(1, 1, how.vocab):contiguous():clone()
    all:free()
    return out
  end
  -- along dim: moved first, gathered (rank-major), put back in section order
  local d, sec = how.dim, how.sections
  local src = d ~= 1 and t:transpose(1, d):contiguous() or t:contiguous()
  local shape = { size * src.shape[1] }
  for i = 2, src.ndim do shape[i] = src.shape[i] end
  local all = T.empty(shape, { dtype = t.dtype, device = t.device })
  dist.all_gather_into(all, src, { group = g })
  local piece = src.shape[1] / sec
  local parts = {}
  for s = 0, sec - 1 do
    for r = 0, size - 1 do parts[#parts + 1] = all:narrow(1, (r * sec + s) * piece + 1, piece) end
  end
  local whole = #parts == 1 and all:clone() or F.cat(parts, 1)
  all:free()
  if src ~= t then src:free() end
  if d ~= 1 then
    local w = whole:transpose(1, d):contiguous():clone()
    whole:free()
    whole = w
  end
  return whole
end

local function sorted_keys(tbl)
  local names = {}
  for name in pairs(tbl) do names[#names + 1] = name end
  table.sort(names)   -- the same order of collectives on every rank
  return names
end

-- name -> whole tensor for name -> this rank's tensor (the replicated ones
-- as they are), gathered in name order on every rank
local function gather_all(info, tbl)
  local out = {}
  for _, name in ipairs(sorted_keys(tbl)) do
    local how = info.split[name]
    out[name] = (how == nil or info.size == 1) and tbl[name] or gather(info, how, tbl[name])
  end
  return out
end

-- this rank's piece of whole tensor t of parameter `name` (t itself when
-- the parameter is replicated), and whether it is a new tensor
local function piece_of(info, name, t)
  local how = info.split[name]
  if how == nil or info.size == 1 then return t, false end
  if how.vocab then return (split_vocab(t, info.size, info.rank)), true end
  return split_even(t, how.dim, info.size, info.rank, how.sections, name), true
end

-- tp.full_state_dict(model) -> name -> whole tensor, on every rank of the
-- group (new tensors for the split ones, the model's own for the others):
-- what save_pretrained and the checkpoints write
function tp.full_state_dict(model) return gather_all(info_of(model), model:state_dict()) end

-- tp.gather_named(model, tbl) -> name -> whole tensor for tbl's name ->
-- this rank's tensor of that parameter (an optimizer moment), as
-- full_state_dict gathers (a collective over the group; ep.full_tensors)
function tp.gather_named(model, tbl) return gather_all(info_of(model), tbl) end

-- tp.full_grads(model) -> name -> the whole gradient (of the parameters
-- that have one), as full_state_dict
function tp.full_grads(model)
  local gr = {}
  for name, p in model:named_parameters() do if p.grad ~= nil then gr[name] = p.grad end end
  return gather_all(info_of(model), gr)
end

-- tp.load_full_state_dict(model, sd): the whole tensors of a full state
-- dict (every rank holds them: a file read on every rank) copied into the
-- model's slices
function tp.load_full_state_dict(model, sd)
  local info = info_of(model)
  local params = model:state_dict()
  A.no_grad(function()
    for name, dst in pairs(params) do
      local src = sd[name]
      if src == nil then error(('tp.load_full_state_dict: %s is missing'):format(name), 3) end
      local piece, made = piece_of(info, name, src)
      if piece:numel() ~= dst:numel() then
        error(('tp.load_full_state_dict: %s is %s in the file, this rank holds %s'):format(name,
          shape_str(src.shape), shape_str(dst.shape)), 3)
      end
      if dst:numel() > 0 then T.raw_copy_(dst, piece:view(dst.shape)) end
      if made then piece:free() end
    end
  end)
  return model
end

-- parameter index of opt:state_dict() (over its groups, from 1) -> how
-- the parameter is split (nil: replicated)
local function index_placements(model, opt, info)
  local name_of = {}
  for name, p in model:named_parameters() do name_of[tonumber(p.id)] = name end
  local how, i = {}, 0
  for _, g in ipairs(opt.param_groups) do
    for _, p in ipairs(g.params) do
      i = i + 1
      local n = name_of[tonumber(p.id)]
      if n == nil then error('tp: the optimizer holds a tensor that is not a parameter of the model', 3) end
      how[i] = { how = info.split[n], p = p, name = n }
    end
  end
  return how
end

-- tp.full_optimizer_state(model, opt) -> opt:state_dict() with the state
-- of every split parameter gathered to the whole parameter's shape: the
-- state the same optimizer over the unsplit model would have (every rank
-- of the group gets it; a one-process checkpoint's optimizer part)
function tp.full_optimizer_state(model, opt)
  local info = info_of(model)
  local sd = opt:state_dict()
  if info.size == 1 then return sd end
  local how = index_placements(model, opt, info)
  for _, name in ipairs(sorted_keys(sd.tensors)) do
    local i = tonumber(name:match('^(%d+)%.'))
    local e = i and how[i]
    local t = sd.tensors[name]
    if e and e.how and t:numel() == e.p:numel() and t.ndim == e.p.ndim then
      sd.tensors[name] = gather(info, e.how, t)
    end
  end
  return sd
end

-- tp.load_full_optimizer_state(model, opt, sd): the inverse: a state dict
-- of the unsplit model's optimizer (a one-process checkpoint's) sliced to
-- this rank's parameters and loaded
function tp.load_full_optimizer_state(model, opt, sd)
  local info = info_of(model)
  local how = index_placements(model, opt, info)
  local tensors, made = {}, {}
  for name, t in pairs(sd.tensors or {}) do
    local i = tonumber(name:match('^(%d+)%.'))
    local e = i and how[i]
    if e and e.how and info.size > 1 and t.ndim == e.p.ndim then
      local piece = piece_of(info, e.name, t)
      tensors[name] = piece
      made[#made + 1] = piece
    else
      tensors[name] = t
    end
  end
  opt:load_state_dict({ tensors = tensors, meta = sd.meta })
  for _, t in ipairs(made) do t:free() end
  return opt
end


-- ------------------------------------------- with fully_shard (FSDP x TP)

-- tp.full_checkpoint(model, opt, hyper) -> model state dict, optimizer
-- state dict: a one-process checkpoint's two parts, whole tensors, on every
-- rank (a collective over both axes). Also for a model under fully_shard
-- over the other axis (fsdp.AdamW; `hyper` = its { lr, betas, eps,
-- weight_decay }): the units' f32 master shards and AdamW moments are
-- gathered (fsdp_checkpoint.gather), then the TP slices.
function tp.full_checkpoint(model, opt, hyper)
  if rawget(model, '_fsdp') == nil then
    return tp.full_state_dict(model), opt and tp.full_optimizer_state(model, opt) or nil
  end
  local msd, st = tp.fsdp_full_tensors(model, opt)
  if not opt then return msd, nil end
  return msd, require('moonshard.optim').one_process_state(require('moonshard.optim').build_groups(model, {}, true), st,
    hyper or {})
end

-- tp.fsdp_full_tensors(model, opt) -> name -> whole tensor (the state
-- dict), and with an optimizer name -> { exp_avg =, exp_avg_sq =, step = }
-- (whole tensors): a split model under fully_shard, gathered over both
-- axes (every rank gets them; a collective)
function tp.fsdp_full_tensors(model, opt)
  local info = info_of(model)
  local fck = require 'moonshard.fsdp_checkpoint'
  local params, state = fck.gather(model, { optimizer = opt })
  local by = {}
  for _, e in ipairs(params) do by[e.name] = e.tensor end
  local function whole(name, t)
    local how = info.split[name]
    if how == nil or info.size == 1 then return t end
    local w = gather(info, how, t)
    t:free()
    return w
  end
  local msd = {}
  for _, name in ipairs(sorted_keys(by)) do msd[name] = whole(name, by[name]) end
  -- buffers (not in FSDP's flat parameters): the model's own
  for name, t in pairs(model:state_dict()) do if msd[name] == nil and by[name] == nil then msd[name] = t end end
  if not opt then return msd, nil end
  local st = {}
  for _, name in ipairs(sorted_keys(state or {})) do
    local e = state[name]
    st[name] = { exp_avg = whole(name, e.exp_avg), exp_avg_sq = whole(name, e.exp_avg_sq), step = e.step }
  end
  return msd, st
end

-- tp.load_fsdp_optimizer_state(model, opt, sd): a one-process optimizer
-- state dict (opt:state_dict() of ms.optim.AdamW over the unsplit model,
-- as a checkpoint holds it) into fsdp.AdamW `opt` of a split model under
-- fully_shard: each of its pieces of a unit's shard gets the moments of the
-- elements it holds (the padding zeros) and the step
function tp.load_fsdp_optimizer_state(model, opt, sd)
  local info = info_of(model)
  if rawget(model, '_fsdp') == nil then error('tp.load_fsdp_optimizer_state: the model is not under fully_shard', 2) end
  if type(opt.fsdp_pieces) ~= 'table' then error('tp.load_fsdp_optimizer_state: opt is not an fsdp optimizer', 2) end
  -- the one-process indices -> names (build_groups' order, as the saver's)
  local optim = require 'moonshard.optim'
  local name_of, i = {}, 0
  local layout = optim.build_groups(model, {}, true)
  for _, g in ipairs(layout) do
    for _, name in ipairs(g.names) do i = i + 1; name_of[i] = name end
  end
  local by_name = {}
  for _, e in ipairs(sd.meta.state or {}) do
    local name = name_of[e.index]
    if name == nil then error(('tp.load_fsdp_optimizer_state: state for parameter %s, which the model does not have'):format(
      tostring(e.index)), 2) end
    local ea, eq = sd.tensors[e.index .. '.exp_avg'], sd.tensors[e.index .. '.exp_avg_sq']
    if ea and eq then by_name[name] = { exp_avg = ea, exp_avg_sq = eq, step = e.step } end
  end
  local fck = require 'moonshard.fsdp_checkpoint'
  fck.load_moments(model, opt, by_name, fck.tag_groups(layout, sd.meta.groups),
    function(name, t) return piece_of(info, name, t) end)
  return opt
end

-- tp.local_piece(model, name, t) -> this rank's piece of whole tensor t of
-- parameter `name` (t itself when replicated), and whether it is new
function tp.local_piece(model, name, t) return piece_of(info_of(model), name, t) end

return tp
