-- moonshard.cp — context parallelism: the sequence split over a group of
-- ranks, attention as a ring (docs/cp.md).
--
--   local cp = ms.cp
--   local ctx = cp.apply(model, group)             -- the model's attention rings over `group`
--   local ids = cp.shard(input_ids, ctx)           -- (B, T) -> (B, T / N): this rank's tokens
--   local loss = model(ids, cp.shard(targets, ctx)) -- the mean over this rank's tokens
--   loss:backward()                                -- then average the gradients over the group
--                                                  -- (fully_shard over it, or all_reduce)
--
-- Every rank holds T / N of each sequence's tokens. Everything but attention
-- is per token; attention passes the keys and values around the group (a
-- ring of N - 1 point-to-point steps, each overlapped with the attention of
-- the block in hand) and merges the blocks' partial results by their
-- log-sum-exp, as Ring Attention (Liu et al. 2023) and torchtitan's
-- context parallelism do. The backward passes the keys and values again,
-- with their gradients' partial sums travelling beside them; the sums come
-- home after N steps.
--
-- Load balancing (causal attention, the default): the sequence is cut in 2N
-- chunks and rank r holds chunks r and 2N-1-r, so every rank does the same
-- attention work (the "head-tail" order). With load_balance = false rank r
-- holds chunk r of N (rank N-1 then does N times rank 0's attention).
--
-- The whole-sequence result, exactly: each block's attention is the fused
-- kernel's (ms_attention) over the visible keys; outputs merge by
--   lse = log(e^lse_a + e^lse_b),  out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)
-- (f32, f64 for f64 inputs). Backward gives each block the gradient
-- dout e^(lse_j - lse) with the merged output, which is the whole
-- attention's gradient restricted to the block's keys.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local F = require 'moonshard.ops'
local A = require 'moonshard.autograd'
local dist = require 'moonshard.dist'
local R = A.raw_views
local W = A.W
local free = A.free

local cp = {}

-- ------------------------------------------------------------- the context
local Ctx = {}
Ctx.__index = Ctx
cp.Context = Ctx

-- cp.context(group, {load_balance = true}) -> ctx: the layout of a
-- sequence over `group` (a dist group; nil: the world)
function cp.context(group, opts)
  opts = opts or {}
  group = group or dist.get_world_group()
  if type(group) ~= 'table' or type(group.size) ~= 'function' then
    error('cp.context: expects a dist group (ms.dist.new_group / a mesh axis), got ' .. type(group), 2)
  end
  if not group:is_member() then error('cp.context: this rank is not a member of the group', 2) end
  local lb = opts.load_balance
  if lb == nil then lb = true end
  local ranks = group:ranks()
  local n, r = group:size(), group:rank()
  return setmetatable({
    group = group, size = n, rank = r, ranks = ranks,
    next = ranks[(r + 1) % n + 1], prev = ranks[(r - 1) % n + 1],
    load_balance = lb and true or false,
    cache = {},
  }, Ctx)
end

function Ctx:__tostring()
  return ('cp.Context(rank %d of %d, %s)'):format(self.rank, self.size, self.load_balance and 'load-balanced' or 'contiguous')
end

-- the number of chunks a sequence is cut into (2N balanced, N contiguous)
function Ctx:chunks() return self.load_balance and 2 * self.size or self.size end

-- group rank r's (this rank's by default) pieces of a sequence of T
-- tokens: { {start0, len}, ... } (0-based starts, in local order)
function Ctx:pieces(Tn, what, r)
  r = r or self.rank
  local nc = self:chunks()
  if Tn % nc ~= 0 then
    error(('cp: %s has %d tokens, not a multiple of %d (%s over a group of %d)'):format(what or 'the sequence', Tn, nc,
      self.load_balance and '2 chunks a rank, load-balanced' or 'a chunk a rank', self.size), 3)
  end
  local c = Tn / nc
  if self.load_balance then
    return { { r * c, c }, { (nc - 1 - r) * c, c } }
  end
  return { { r * c, c } }
end

-- positions(Tl, device) -> (Tl) i64: the global positions of this rank's
-- Tl tokens (cached; do not free)
function Ctx:positions(Tl, device)
  device = device or -1
  local key = 'pos:' .. Tl .. ':' .. tostring(device)
  local p = self.cache[key]
  if p and p.storage ~= nil then return p end
  local ids = {}
  for _, pc in ipairs(self:pieces(Tl * self.size)) do
    for i = 0, pc[2] - 1 do ids[#ids + 1] = pc[1] + i end
  end
  p = T.tensor(ids, { dtype = 'i64', device = device })
  self.cache[key] = p
  return p
end

-- rope(Tl, head_dim, theta, dtype, device, as) -> cos, sin (Tl, head_dim):
-- the rotary tables' rows at this rank's positions (cached)
function Ctx:rope(Tl, hd, theta, dtype, device, as)
  local key = table.concat({ 'rope', Tl, hd, type(theta) == 'table' and theta.key or theta, tostring(dtype),
    tostring(device), tostring(as) }, ':')
  local c = self.cache[key]
  if c and c[1].storage ~= nil then return c[1], c[2] end
  local nnf = require('moonshard.nn').functional
  local cs, sn = nnf.rope_cache(Tl * self.size, hd, theta, dtype, device, as)
  local pos = self:positions(Tl, device)
  c = { F.index_select(cs, 1, pos), F.index_select(sn, 1, pos) }
  self.cache[key] = c
  return c[1], c[2]
end

local function ctx_of(x, fname)
  if getmetatable(x) == Ctx then return x end
  error(('cp.%s: expects a cp context (cp.context(group) or cp.apply\'s result), got %s'):format(fname, type(x)), 3)
end

-- ------------------------------------------------- sharding the sequence
-- this rank's pieces of t along dim, as one new tensor
local function take(t, ctx, dim)
  local ps = ctx:pieces(t.shape[dim], ('dim %d of a %s tensor'):format(dim, table.concat(t.shape, 'x')))
  if #ps == 1 then
    -- (a copy: the result is the node's own, never a view of t)
    local a = R.narrow(t, dim, ps[1][1] + 1, ps[1][2])
    local y = R.clone(a)
    free(a)
    return y
  end
  local a, b = R.narrow(t, dim, ps[1][1] + 1, ps[1][2]), R.narrow(t, dim, ps[2][1] + 1, ps[2][2])
  local y = F.cat({ a, b }, dim)
  free(a); free(b)
  return y
end

-- every rank's pieces along dim -> the whole (in sequence order)
local function gather(t, ctx, dim)
  local n, nc = ctx.size, ctx:chunks()
  local xc = R.contiguous(t)
  local s = {}
  for i, v in ipairs(t.shape) do s[i] = v end
  local all = T.empty({ n, t:numel() }, { dtype = t.dtype, device = t.device })
  local flat = R.view(xc, { t:numel() })
  dist.all_gather_into(all, flat, { group = ctx.group })
  free(flat)
  if xc ~= t then free(xc) end
  local Tl = s[dim]
  local c = Tl / (nc / n)
  -- rank i's block viewed with its sequence dim; its pieces go to their chunks
  local out_shape = {}
  for i, v in ipairs(s) do out_shape[i] = v end
  out_shape[dim] = Tl * n
  local out = T.empty(out_shape, { dtype = t.dtype, device = t.device })
  for i = 0, n - 1 do
    local row = R.narrow(all, 1, i + 1, 1)
    local blk = R.view(row, s)
    local off = 0
    for _, pc in ipairs(ctx:pieces(Tl * n, nil, i)) do
      local dst, src = R.narrow(out, dim, pc[1] + 1, c), R.narrow(blk, dim, off + 1, c)
      dst:copy_(src)
      free(dst); free(src)
      off = off + c
    end
    free(blk); free(row)
  end
  free(all)
  return out
end

local Shard = A.Function {
  name = 'cp_shard',
  owns_results = true,
  forward = function(c, x, ctx, dim)
    c.ctx, c.dim = ctx, dim
    return take(x, ctx, dim)
  end,
  -- every rank's part of the gradient put back in place (the rank's input
  -- was the same whole tensor on every rank, so each rank's gradient of it
  -- is the sum of the parts' gradients over the group: the gathered whole)
  backward = function(c, g) return gather(g, c.ctx, c.dim), nil, nil end,
}

local Unshard = A.Function {
  name = 'cp_unshard',
  owns_results = true,
  forward = function(c, x, ctx, dim)
    c.ctx, c.dim = ctx, dim
    return gather(x, ctx, dim)
  end,
  backward = function(c, g) return take(g, c.ctx, c.dim), nil, nil end,
}

local function dim_arg(t, dim, fname)
  dim = dim or 2
  if dim < 0 then dim = t.ndim + 1 + dim end
  if dim < 1 or dim > t.ndim then
    error(('cp.%s: dim %s is out of range for a %d-d tensor'):format(fname, tostring(dim), t.ndim), 3)
  end
  return dim
end

-- (the shard / unshard entry: the checks, then fn over the context)
local function along_seq(fname, fn, t, ctx, dim)
  ctx = ctx_of(ctx, fname)
  if not T.is_tensor(t) then error(('cp.%s: expects a tensor, got %s'):format(fname, type(t)), 2) end
  dim = dim_arg(t, dim, fname)
  if ctx.size == 1 then return t end
  return fn(t, ctx, dim)
end

-- cp.shard(t, ctx, dim = 2) -> this rank's tokens of t (the same t on every
-- rank of the group), a new tensor; differentiable (the gradient of the
-- whole is every rank's part's, gathered)
function cp.shard(t, ctx, dim) return along_seq('shard', Shard, t, ctx, dim) end

-- cp.unshard(t, ctx, dim = 2) -> the whole sequence from every rank's
-- part (an all-gather in sequence order); differentiable
function cp.unshard(t, ctx, dim) return along_seq('unshard', Unshard, t, ctx, dim) end

-- ------------------------------------------------------- ring attention
local box = ffi.typeof('ms_tensor*[1]')

local function attn(q, k, v, scale, causal)
  local o, l = box(), box()
  T.check(T.C.ms_attention(o, l, q, k, v, scale, causal and 1 or 0), 3)
  return T.wrap(o[0]), T.wrap(l[0])
end

local function attn_backward(q, k, v, out, lse, dout, scale, causal)
  local dq, dk, dv = box(), box(), box()
  T.check(T.C.ms_attention_backward(dq, dk, dv, q, k, v, out, lse, dout, scale, causal and 1 or 0), 3)
  return T.wrap(dq[0]), T.wrap(dk[0]), T.wrap(dv[0])
end

-- The block of step i: this rank's queries against the keys of group rank
-- s = (rank - i) mod N. -> rows (1-based start, count) of the queries,
-- keys (start, count) of the block, causal; nil when no query sees a key.
local function block(ctx, i, Tl)
  local r, s = ctx.rank, (ctx.rank - i) % ctx.size
  if s == r then return 1, Tl, 1, Tl, true end
  if ctx.load_balance then
    local c = Tl / 2
    -- an earlier rank: every query sees its first chunk (its second comes later)
    if s < r then return 1, Tl, 1, c, false end
    -- a later rank: only the second chunk's queries see it, all of it
    return c + 1, c, 1, Tl, false
  end
  if s < r then return 1, Tl, 1, Tl, false end
  return nil
end

-- k (B, Hkv, Tl, D) and v (B, Hkv, Tl, Dv) packed into one flat buffer, k
-- first, for one message each step (v's head width Dv its own: DeepSeek's
-- MLA). kv_views(buf, ks, vs) -> the (B, Hkv, Tl, D) and (B, Hkv, Tl, Dv)
-- views of such a buffer (the caller frees them).
local function numel_of(s)
  local n = 1
  for _, x in ipairs(s) do n = n * x end
  return n
end

local function kv_views(buf, ks, vs)
  local nk = numel_of(ks)
  local a, b = R.narrow(buf, 1, 1, nk), R.narrow(buf, 1, nk + 1, numel_of(vs))
  local kk, vv = R.view(a, ks), R.view(b, vs)
  free(a); free(b)
  return kk, vv
end

local function pack_kv(k, v)
  local kv = T.empty({ numel_of(k.shape) + numel_of(v.shape) }, { dtype = k.dtype, device = k.device })
  local a, b = kv_views(kv, k.shape, v.shape)
  a:copy_(k); b:copy_(v)
  free(a); free(b)
  return kv
end

local function exchange(ctx, send, recv)
  return dist.batch_p2p({ { 'send', send, ctx.next }, { 'recv', recv, ctx.prev } }, { group = ctx.group, async = true })
end

-- out_acc/lse_acc rows updated with a block's (o, l): the merge above, one
-- pass (ms_attention_merge_)
local function merge(oa, la, o, l, first)
  T.check(T.C.ms_attention_merge_(oa, la, o, l, first and 1 or 0), 3)
end

-- the part of the output's gradient g that a block with log-sum-exp l sees,
-- in dtype (ms_attention_block_grad)
local function block_grad(g, l, lse, dtype)
  local b = box()
  T.check(T.C.ms_attention_block_grad(b, g, l, lse, T.dtype_id(dtype)), 3)
  return T.wrap(b[0])
end

local Ring = A.Function {
  name = 'cp_ring_attention',
  owns_results = true,
  forward = function(c, q, k, v, ctx, scale)
    local qs, ks, vs = q.shape, k.shape, v.shape
    local B, H, Tl, Dv = qs[1], qs[2], qs[3], vs[4]
    local acc = q.dtype == 'f64' and 'f64' or 'f32'
    local dev = q.device
    -- the accumulator in the blocks' layout (contiguous (B, H, Tl, Dv): the
    -- merge's passes run on like layouts); the output laid out (B, Tl, H, Dv)
    -- and returned as its (B, H, Tl, Dv) view, as the fused kernel's
    local oa = T.empty({ B, H, Tl, Dv }, { dtype = acc, device = dev })
    local la = T.empty({ B, H, Tl }, { dtype = acc, device = dev })
    local kv = pack_kv(k, v)
    local nxt = ctx.size > 1 and T.empty(kv.shape, { dtype = kv.dtype, device = dev }) or nil
    local lses = {}
    for i = 0, ctx.size - 1 do
      local w = i < ctx.size - 1 and exchange(ctx, kv, nxt) or nil
      local r0, rn, k0, kn, causal = block(ctx, i, Tl)
      if r0 then
        local kk, vv = kv_views(kv, ks, vs)
        local qb = rn == Tl and q or R.narrow(q, 3, r0, rn)
        local kb = kn == Tl and kk or R.narrow(kk, 3, k0, kn)
        local vb = kn == Tl and vv or R.narrow(vv, 3, k0, kn)
        local o, l = attn(qb, kb, vb, scale, causal)
        local orows, lrows = R.narrow(oa, 3, r0, rn), R.narrow(la, 3, r0, rn)
        merge(orows, lrows, o, l, i == 0)   -- (step 0 covers every row: its own keys)
        free(o); free(orows); free(lrows)
        if qb ~= q then free(qb) end
        if kb ~= kk then free(kb); free(vb) end
        free(kk); free(vv)
        lses[i] = l
      end
      if w then
        w:wait(); w:free()
        kv, nxt = nxt, kv
      end
    end
    free(kv)
    if nxt then free(nxt) end
    local yb = T.empty({ B, Tl, H, Dv }, { dtype = q.dtype, device = dev })
    local y = R.transpose(yb, 2, 3)
    free(yb)
    y:copy_(oa)
    free(oa)
    c:save_for_backward(q, k, v, y)
    c.lses, c.lse, c.ctx, c.scale = lses, la, ctx, scale
    return y
  end,
  backward = function(c, g)
    local q, k, v, y = c.saved_tensors[1], c.saved_tensors[2], c.saved_tensors[3], c.saved_tensors[4]
    local ctx, scale = c.ctx, c.scale
    local qs, ks, vs = q.shape, k.shape, v.shape
    local B, H, Tl, D = qs[1], qs[2], qs[3], qs[4]
    local acc = q.dtype == 'f64' and 'f64' or 'f32'
    local dev = q.device
    local gq = g.dtype == q.dtype and g or R.to(g, { dtype = q.dtype })
    local dq = T.zeros({ B, H, Tl, D }, { dtype = acc, device = dev })
    local kv = pack_kv(k, v)
    local nxt = ctx.size > 1 and T.empty(kv.shape, { dtype = kv.dtype, device = dev }) or nil
    local dkv = T.zeros(kv.shape, { dtype = acc, device = dev })
    local dnxt = ctx.size > 1 and T.empty(dkv.shape, { dtype = acc, device = dev }) or nil
    local dw -- the exchange of the gradient sums, started at the end of a step
    for i = 0, ctx.size - 1 do
      local w = i < ctx.size - 1 and exchange(ctx, kv, nxt) or nil
      local r0, rn, k0, kn, causal = block(ctx, i, Tl)
      local pdk, pdv
      if r0 then
        local kk, vv = kv_views(kv, ks, vs)
        local whole = rn == Tl
        local qb = whole and q or R.narrow(q, 3, r0, rn)
        local kb = kn == Tl and kk or R.narrow(kk, 3, k0, kn)
        local vb = kn == Tl and vv or R.narrow(vv, 3, k0, kn)
        local yb = whole and y or R.narrow(y, 3, r0, rn)
        local gb = whole and gq or R.narrow(gq, 3, r0, rn)
        local lb = whole and c.lse or R.narrow(c.lse, 3, r0, rn)
        -- the block's share of the gradient: dout e^(lse_j - lse)
        local gsc = block_grad(gb, c.lses[i], lb, q.dtype)
        local bq, bk, bv = attn_backward(qb, kb, vb, yb, c.lses[i], gsc, scale, causal)
        local dqr = whole and dq or R.narrow(dq, 3, r0, rn)
        F.add_(dqr, bq)
        if dqr ~= dq then free(dqr) end
        pdk, pdv = bk, bv
        free(bq); free(gsc)
        if qb ~= q then free(qb) end
        if yb ~= y then free(yb); free(gb); free(lb) end
        if kb ~= kk then free(kb); free(vb) end
        free(kk); free(vv)
      end
      -- this block's sums arrived from the previous rank: add this rank's part
      if dw then
        dw:wait(); dw:free(); dw = nil
        dkv, dnxt = dnxt, dkv
      end
      if pdk then
        local a, b = kv_views(dkv, ks, vs)
        local ar = kn == Tl and a or R.narrow(a, 3, k0, kn)
        local br = kn == Tl and b or R.narrow(b, 3, k0, kn)
        F.add_(ar, pdk); F.add_(br, pdv)
        if ar ~= a then free(ar); free(br) end
        free(a); free(b); free(pdk); free(pdv)
      end
      if ctx.size > 1 then dw = exchange(ctx, dkv, dnxt) end
      if w then
        w:wait(); w:free()
        kv, nxt = nxt, kv
      end
    end
    if dw then
      dw:wait(); dw:free()
      dkv, dnxt = dnxt, dkv
    end
    free(kv)
    if nxt then free(nxt) end
    if dnxt then free(dnxt) end
    if gq ~= g then free(gq) end
    local function out(t, dt)
      if t.dtype == dt then return t end
      local r = R.to(t, { dtype = dt })
      free(t)
      return r
    end
    local a, b = kv_views(dkv, ks, vs)
    local dk, dv = out(R.contiguous(a), k.dtype), out(R.contiguous(b), v.dtype)
    if dk == a then dk = R.clone(a) end
    if dv == b then dv = R.clone(b) end
    free(a); free(b); free(dkv)
    for _, l in pairs(c.lses) do free(l) end
    free(c.lse)
    c.lses, c.lse = nil, nil
    return out(dq, q.dtype), dk, dv, nil, nil
  end,
}

-- cp.attention(q, k, v, ctx, {scale =}) -> (B, H, Tl, Dv): causal attention
-- of this rank's queries over the whole sequence's keys (every rank's
-- q (B, H, Tl, D), k (B, Hkv, Tl, D) and v (B, Hkv, Tl, Dv) in the context's
-- layout; v's head width its own, as DeepSeek's MLA); differentiable. Every
-- rank of the group must call it together. On a GPU whose kernels lack the
-- widths, q/k and v are padded with zeros to widths they take (as
-- nn.functional.scaled_dot_product_attention does; the output's extra
-- columns dropped); where none takes them (f32 above 128) it is an error.
function cp.attention(q, k, v, ctx, opts)
  ctx = ctx_of(ctx, 'attention')
  for _, p in ipairs({ { q, 'q' }, { k, 'k' }, { v, 'v' } }) do
    if not T.is_tensor(p[1]) or p[1].ndim ~= 4 then
      error(('cp.attention: %s must be a (B, H, T, D) tensor, got %s'):format(p[2],
        T.is_tensor(p[1]) and table.concat(p[1].shape, 'x') or type(p[1])), 2)
    end
  end
  local qs, ks, vs = q.shape, k.shape, v.shape
  if ks[1] ~= qs[1] or ks[3] ~= qs[3] or ks[4] ~= qs[4] or vs[1] ~= ks[1] or vs[2] ~= ks[2] or vs[3] ~= ks[3]
      or qs[2] % ks[2] ~= 0 then
    error(('cp.attention: shapes q %s, k %s, v %s do not fit (this rank\'s tokens of q (B, H, Tl, D), '
      .. 'k (B, Hkv, Tl, D) and v (B, Hkv, Tl, Dv), H a multiple of Hkv)'):format(table.concat(qs, 'x'),
      table.concat(ks, 'x'), table.concat(vs, 'x')), 2)
  end
  if q.dtype ~= k.dtype or q.dtype ~= v.dtype or q.device ~= k.device or q.device ~= v.device then
    error(('cp.attention: q, k, v need one dtype and device, got %s/%s, %s/%s, %s/%s'):format(q.dtype, q.device,
      k.dtype, k.device, v.dtype, v.device), 2)
  end
  ctx:pieces(qs[3] * ctx.size, ('the local sequence of %d tokens x %d ranks'):format(qs[3], ctx.size))
  local scale = (opts and opts.scale) or 1 / math.sqrt(qs[4])
  local nnf = require('moonshard.nn').functional
  if ctx.size == 1 then
    return nnf.scaled_dot_product_attention(q, k, v, { causal = true, scale = scale })
  end
  local D, Dv = qs[4], vs[4]
  local wq, wv = nnf.attention_widths(q, D, Dv)
  if not wq then
    error(('cp.attention: ring attention runs the fused attention kernel, which takes none of q %s, k %s, v %s '
      .. '(%s on %s): %s'):format(table.concat(qs, 'x'), table.concat(ks, 'x'), table.concat(vs, 'x'), q.dtype,
      q.device, wv), 2)
  end
  if wq == D and wv == Dv then return Ring(q, k, v, ctx, scale) end
  -- zero columns: q.kᵀ unchanged, v's extra output columns dropped
  local function pad(t, w)
    local s = t.shape
    if s[4] == w then return t end
    return W.cat({ t, T.zeros({ s[1], s[2], s[3], w - s[4] }, { dtype = t.dtype, device = t.device }) }, 4)
  end
  local y = Ring(pad(q, wq), pad(k, wq), pad(v, wv), ctx, scale)
  return W.narrow(y, 4, 1, Dv)
end

-- ------------------------------------------------------------ the models
-- cp.apply(model, group | ctx, opts) -> ctx: the model's attention modules
-- (nn.CausalSelfAttention, nn.MLAttention) ring over the group, and its positions (GPT-2's
-- learned ones, RoPE's tables) are this rank's; the model is then called
-- with this rank's tokens (cp.shard). opts: load_balance (true),
-- need_attention (true: a model without attention is an error; false for a
-- pipeline stage that may hold none).
-- cp.remove(model) undoes it.
function cp.apply(model, group, opts)
  local nn = require 'moonshard.nn'
  if not nn.is_module(model) then error('cp.apply: expects a module, got ' .. type(model), 2) end
  local ctx = getmetatable(group) == Ctx and group or cp.context(group, opts)
  local n = 0
  for _, m in model:named_modules() do
    local cls = getmetatable(m)
    if cls == nn.CausalSelfAttention or cls == nn.MLAttention then n = n + 1 end
  end
  if n == 0 and not (opts and opts.need_attention == false) then
    error('cp.apply: the model has no nn.CausalSelfAttention or nn.MLAttention to ring', 2)
  end
  -- every module: the attention reads it, the embeddings' owner (GPT-2's
  -- learned positions) too
  for _, m in model:named_modules() do rawset(m, '_cp', ctx) end
  rawset(model, '_cp', ctx)
  return ctx
end

function cp.remove(model)
  for _, m in model:named_modules() do rawset(m, '_cp', nil) end
  rawset(model, '_cp', nil)
end

-- the context a module was given (nil when none)
function cp.of(m) return rawget(m, '_cp') end

return cp
