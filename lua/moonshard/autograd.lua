-- moonshard.autograd — a linear tape of recorded ops, walked in reverse.
--
--   local ms = require 'moonshard'
--   local w = ms.randn({3, 2}):requires_grad_()
--   local loss = (ms.randn({4, 3}) @ w):sum()   -- or ms.matmul(x, w):sum()
--   loss:backward()
--   print(w.grad)
--
-- While grad mode is on, every differentiable op whose inputs require grad
-- appends one node to the tape (a Lua array, in execution order). A node holds
-- the ids and shapes of its inputs, the tensors its backward needs (saved),
-- and its backward function. `loss:backward(grad?)` walks the tape from the
-- end: the gradient of each node's outputs is looked up by tensor id in a
-- table of intermediate gradients, the node's backward turns it into input
-- gradients, and those are either added to that table (non-leaf inputs) or
-- delivered to a leaf's .grad. A node's saved tensors are released as soon as
-- its backward has run (tensors the node made itself are freed with :free(),
-- the others are dropped); intermediate gradients are freed once consumed.
-- After backward the tape is empty: backward consumes every node recorded
-- since the last backward, including nodes that do not lead to the loss.
--
-- THE GRADIENT RULE (written down once, here; the kernels follow it too):
--   * parameter (leaf) gradients ACCUMULATE: each backward adds into .grad
--     (+=), so two backward calls without zero_grad give the sum;
--   * activation (intermediate) gradients OVERWRITE: an intermediate's
--     gradient is computed afresh by each backward (=), and a retained
--     intermediate .grad (t:retain_grad()) is replaced, never summed across
--     backward calls. Within one backward, contributions from several uses of
--     a tensor are summed, as the chain rule says (the residual stream is the
--     usual case).
--
-- Ops are wrapped here: the raw functional layer (require 'moonshard.ops',
-- the table F) never records; autograd installs recording versions as tensor
-- methods and as A.ops (ms.<op> in moonshard/init.lua). A recording version
-- runs the raw op and, only when grad mode is on and a tensor input requires
-- grad, records a node. Views (view, reshape, narrow, select, transpose,
-- permute, expand, squeeze, unsqueeze, flatten, contiguous, clone, to) are
-- differentiable too. In-place arithmetic (add_, mul_, ...) is not recorded:
-- it raises an error when grad mode is on and its target requires grad (use
-- ms.no_grad, as optimizers do).
--
-- Versions: every in-place write of the Lua face (add_, copy_, fill_, set,
-- normal_, an optimizer's step, ...) bumps its storage's version
-- (t._version, shared by all views of the storage). A node notes the version
-- of each tensor it saved; backward checks them before it starts and again
-- before each node's backward, and raises an error naming the op and the
-- tensor when one was changed in place since it was saved (PyTorch's "modified
-- by an inplace operation"), instead of computing a silently wrong gradient.
-- The raw layer (F, ms.raw) does not bump: the engine's own writes into
-- buffers it manages (FSDP's gathers, gradient buffers) are not user edits.
--
-- Grad mode: ms.no_grad(fn, ...) / ms.enable_grad(fn, ...) run fn with
-- recording off / on and return fn's results; ms.is_grad_enabled().
-- Custom ops: A.Function{forward = function(ctx, ...) end, backward =
-- function(ctx, grad_out...) return grad_in... end}; ctx:save_for_backward(...)
-- then ctx.saved_tensors; ctx.needs_input_grad[i].
-- Checkpointing: ms.checkpoint(fn, ...) runs fn without recording and records
-- one node whose backward re-runs fn (RNG state restored, so dropout matches)
-- on a nested tape and walks that tape.
--
-- Hooks (docs/autograd.md has the contract the sharding layer relies on):
--   A.mark_module_begin(m) / A.mark_module_end(m) record markers; in the
--   reverse walk the end marker fires m's backward pre-hooks ("about to run
--   backward of m") and the begin marker fires m's backward hooks ("backward
--   of m done, all its parameter grads final"). nn.Module records them around
--   forward when the module has backward hooks.
--   A.tape_modules() lists marked modules in forward order.
--   A.register_hook(event, fn) for 'backward_begin', 'backward_end',
--   'module_pre_backward', 'module_post_backward'; A.queue_callback(fn, opts) runs
--   fn once when the current backward ends (opts.always: also when it fails).
--   t:register_hook(fn(grad) -> grad?) on any tensor that requires grad.
local T = require 'moonshard.tensor'
local F = require 'moonshard.ops'
local bit = require 'bit'
local ffi = require 'ffi'

local band, bor, bxor = bit.band, bit.bor, bit.bxor
local RG = T.FLAG_REQUIRES_GRAD
local meta = T.meta
local is_tensor = T.is_tensor
local M = T.methods
local C = T.C

local A = {}
A.F = F                    -- the raw layer
A.ops = {}                 -- recording functional ops (ms.<name>)

-- ------------------------------------------------------------------ raw views
-- Captured before the recording versions replace them.
local R = {}
for _, k in ipairs({ 'view', 'reshape', 'narrow', 'select', 'transpose', 't', 'permute',
  'expand', 'squeeze', 'unsqueeze', 'alias', 'contiguous', 'clone', 'to', 'flatten' }) do
  R[k] = M[k]
end
A.raw_views = R

-- ------------------------------------------------------------------- state
local enabled = true
A.tape = {}                 -- the tape ops record into now
local active = nil          -- the tape being walked by the outermost backward
local collect = nil         -- modules seen while a checkpoint runs fn unrecorded
local queued = {}           -- callbacks for the end of the current backward
local hooks = { backward_begin = {}, backward_end = {}, module_pre_backward = {},
  module_post_backward = {} }
local module_hook_count = 0 -- global module hooks registered (mark every module)

local function needs(x)
  return is_tensor(x) and band(x.flags, RG) ~= 0
end
A.needs_grad = needs

local new_meta = T.new_meta
local function getmeta(t)
  local id = tonumber(t.id)
  local m = meta[id]
  if not m then m = new_meta(t, id) end
  return m
end
local function peekmeta(t) return meta[tonumber(t.id)] end

-- (tables made at their final size: the per-op path makes several a node,
-- and a table grown one element at a time is reallocated as it grows)
local tnew = require 'table.new'

local function shape_of(t)
  local n = t.ndim
  local s = tnew(n, 0)
  for i = 0, n - 1 do s[i + 1] = tonumber(t.sizes[i]) end
  return s
end
local shape_str = T.shape_str
local function same_shape(t, s)
  if t.ndim ~= #s then return false end
  for i = 1, #s do if tonumber(t.sizes[i - 1]) ~= s[i] then return false end end
  return true
end
A.shape_of = shape_of

local pack = function(...) return { n = select('#', ...), ... } end
local unpack = unpack or table.unpack

-- ---------------------------------------------------------------- versions
-- t's storage version, bumped by each in-place write of the Lua face
local function bump(t)
  local st = t.storage
  if st ~= nil then st.version = (st.version + 1) % 4294967296 end
  return t
end
A.bump_version = bump

-- the versions of the tensors in `saved` (a node's saved table, a
-- Function's saved_tensors, a checkpoint's arguments), as a flat list
-- key, tensor, version, ...; nil when none
local function snap(saved, into)
  if saved == nil then return into end
  for k, x in pairs(saved) do
    if is_tensor(x) then
      local st = x.storage
      if st ~= nil then
        into = into or {}
        local n = #into
        into[n + 1], into[n + 2], into[n + 3] = k, x, st.version
      end
    end
  end
  return into
end

-- raises when a tensor a node saved was written in place since
local function check_versions(node)
  local v = node.vers
  if v == nil then return end
  for j = 1, #v, 3 do
    local x = v[j + 1]
    local st = x.storage
    if st ~= nil and st.version ~= v[j + 2] then
      local k = v[j]
      error(('autograd: a tensor that the backward of %s needs (%s, shape %s, %s on %s) was '
        .. 'modified by an in-place operation after the forward saved it: its storage is at '
        .. 'version %d, saved at version %d. Change a clone instead (x:clone()), or make the '
        .. 'change after backward'):format(node.name, type(k) == 'number' and ('saved tensor ' .. k)
          or ('saved ' .. tostring(k)), shape_str(shape_of(x)), T.dtype_name(x.dtype_id),
          T.device_name(x.device_id), st.version, v[j + 2]), 0)
    end
  end
end
A.check_versions = check_versions

-- ----------------------------------------------------------------- grad mode
function A.is_grad_enabled() return enabled end
function A.set_grad_enabled(on)
  local prev = enabled
  enabled = on and true or false
  return prev
end

local function with_mode(on, fn, ...)
  local prev = enabled
  enabled = on
  local r = pack(pcall(fn, ...))
  enabled = prev
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end
function A.no_grad(fn, ...) return with_mode(false, fn, ...) end
function A.enable_grad(fn, ...) return with_mode(true, fn, ...) end

-- ------------------------------------------------------------------ record
-- Recording a node: `ins` is the list of the op's inputs (tensors or not, in
-- the positions the backward returns grads for), `out` the output tensor (or
-- a list of outputs with outs.n), `bwd(node, g)` returns input grads.
-- Returns nil (and records nothing) when no input requires grad.
local function want(a, b, c)
  if not enabled then return false end
  return needs(a) or needs(b) or needs(c)
end
A.want = want

-- A.release_activations = true (opt-in): once backward has consumed a node,
-- the storages of its outputs are freed at once (t:free()) instead of when
-- Lua collects their handles, so memory does not wait for the GC. Every
-- intermediate tensor of the consumed tape is then unusable (except the
-- tensor backward was called on and tensors marked retain_grad): do not
-- keep activations (e.g. logits) across backward with this on.
A.release_activations = false
local weak_v = { __mode = 'v' }

local function mark_output(t, node)
  t.flags = bor(t.flags, RG)
  getmeta(t).grad_fn = node
  if A.release_activations then
    local o = node.outs
    if o == nil then o = setmetatable({}, weak_v); node.outs = o end
    o[#o + 1] = t
  end
end

local function release_outputs(node, root)
  local o = node.outs
  if o == nil then return end
  node.outs = nil
  for i = 1, table.maxn(o) do
    local t = o[i]
    if t ~= nil then
      local id = tonumber(t.id)
      local m = meta[id]
      if id ~= root and not (m and m.retain) then M.free(t) end
    end
  end
end

-- node fields: name, bwd, nin, need[i], leaf[i] (handle of a leaf input or
-- false), iid[i] (id of a non-leaf input), ishape[i], idtype[i], idev[i];
-- oid (single output id) or oids (list), saved (anything the backward reads),
-- own (tensors the node made and frees after its backward).
local function new_node_of(name, bwd, nin)
  return { name = name, bwd = bwd, nin = nin, need = tnew(nin, 0), leaf = tnew(nin, 0), iid = tnew(nin, 0),
    ishape = tnew(nin, 0), idtype = tnew(nin, 0), idev = tnew(nin, 0) }
end
-- input i of node is x
local function set_input(node, i, x)
  if needs(x) then
    node.need[i] = true
    local m = peekmeta(x)
    if m and m.grad_fn then
      node.leaf[i] = false
      node.iid[i] = tonumber(x.id)
    else
      node.leaf[i] = x
    end
    node.ishape[i] = shape_of(x)
    node.idtype[i] = x.dtype_id
    node.idev[i] = x.device_id
  else
    node.need[i] = false
  end
end
local function new_node(name, bwd, ins, nin)
  local node = new_node_of(name, bwd, nin)
  for i = 1, nin do set_input(node, i, ins[i]) end
  return node
end

local function push(node)
  local tape = A.tape
  tape[#tape + 1] = node
end

-- node's saved tensors and its one output; pushed; returns out
local function finish_out(node, out, saved, own)
  node.saved, node.own = saved, own
  node.vers = snap(saved)
  node.oid = tonumber(out.id)
  mark_output(out, node)
  push(node)
  return out
end

-- record an op with the inputs ins[1..nin] and one output; returns out
local function record_out(name, out, bwd, saved, own, ins, nin)
  return finish_out(new_node(name, bwd, ins, nin), out, saved, own)
end

-- record a one-output op of up to three inputs; returns out
local function record1(name, out, bwd, saved, own, a, b, c)
  if out.dtype_id > 3 then return out end -- integer/bool outputs carry no grad
  local nin = c ~= nil and 3 or (b ~= nil and 2 or 1)
  local node = new_node_of(name, bwd, nin)
  set_input(node, 1, a)
  if nin > 1 then set_input(node, 2, b) end
  if nin > 2 then set_input(node, 3, c) end
  return finish_out(node, out, saved, own)
end
A.record1 = record1

-- record an op with a list of inputs and one output
local function record_list(name, out, bwd, saved, own, list)
  return record_out(name, out, bwd, saved, own, list, #list)
end
A.record_list = record_list

-- --------------------------------------------------------------- helpers
local function free(t) if t ~= nil then M.free(t) end end
A.free = free

-- sum g over broadcast dims so it has `shape`
local function unbroadcast(g, shape)
  if same_shape(g, shape) then return g end
  local cur = g
  local lead = cur.ndim - #shape
  for _ = 1, lead do
    local s = F.sum(cur, 1, false)
    if cur ~= g then free(cur) end
    cur = s
  end
  for i = 1, #shape do
    if shape[i] == 1 and tonumber(cur.sizes[i - 1]) ~= 1 then
      local s = F.sum(cur, i, true)
      if cur ~= g then free(cur) end
      cur = s
    end
  end
  if cur.ndim ~= #shape then
    local r = R.reshape(cur, shape)
    if cur ~= g then free(cur) end
    cur = r
  end
  return cur
end
A.unbroadcast = unbroadcast

-- unbroadcast a temporary: t is freed when the result is another tensor
local function unbroadcast_tmp(t, shape)
  local r = unbroadcast(t, shape)
  if r ~= t then free(t) end
  return r
end

-- float mask (dtype of `like`) from a bool tensor; frees the bool
local function maskf(b, dtype_id)
  local m = R.to(b, { dtype = dtype_id })
  free(b)
  return m
end

-- 1-based positive dim
local function pdim(t, d)
  if d < 0 then return t.ndim + d + 1 end
  return d
end

-- expand a reduced gradient g back over `shape` (reduction over dim d, or all
-- dims when d is nil), materialised contiguous
local function expand_back(g, shape, d, keepdim)
  local gg = g
  if d == nil then
    local ones = {}
    for i = 1, #shape do ones[i] = 1 end
    gg = R.reshape(g, ones)
  elseif not keepdim then
    gg = R.unsqueeze(g, d)
  end
  local e = R.expand(gg, shape)
  local c = R.clone(e)
  free(e)
  if gg ~= g then free(gg) end
  return c
end

-- ------------------------------------------------------------------ engine
local function errorf(fmt, ...) error(fmt:format(...), 3) end

local function run_hooks(list, ...)
  for i = 1, #list do
    local h = list[i]
    if h then h.fn(...) end
  end
end

-- tensor hooks: fn(grad) may return a replacement
-- A leaf's hook may return A.CONSUMED: it has taken the gradient (copied
-- what it needs; it must not keep g itself), nothing is accumulated into
-- .grad and the later hooks do not run (tp's sequence-parallel partial
-- gradients, summed over the group at the backward's or the step's end:
-- without it each micro-batch filled a zero gradient and added it to .grad)
local CONSUMED = setmetatable({}, { __tostring = function() return 'autograd.CONSUMED' end })
A.CONSUMED = CONSUMED
local function apply_tensor_hooks(m, g, borrowed, leaf)
  for i = 1, #m.hooks do
    local h = m.hooks[i]
    if h then
      local r = h.fn(g)
      if r == CONSUMED then
        if not leaf then error('autograd: a tensor hook returned autograd.CONSUMED for a non-leaf tensor', 0) end
        return nil
      end
      if r ~= nil and r ~= g then
        borrowed[tonumber(r.id)] = true
        g = r
      end
    end
  end
  return g
end

-- The gradient a backward function may add its gradient for input i into
-- in place instead of returning one (nn.functional.embedding: a scatter-add
-- into the tied weight's gradient the LM head has already left there, with
-- no zero-filled table and no add): the leaf's current .grad, when input i
-- is a leaf without tensor hooks or post-accumulate hooks (they see every
-- gradient handed over) whose grad is there, contiguous, and of the input's
-- shape, dtype and device; else nil (return the gradient as usual).
-- (g when it is contiguous and of input i's shape, dtype and device)
local function as_input(node, i, g)
  if g.dtype_id ~= node.idtype[i] or g.device_id ~= node.idev[i] or not same_shape(g, node.ishape[i])
      or not M.is_contiguous(g) then
    return nil
  end
  return g
end
function A.inplace_leaf_grad(node, i)
  local leaf = node.leaf and node.leaf[i]
  if not leaf or not node.need[i] then return nil end
  local m = peekmeta(leaf)
  if not m or m.hooks or m.post_hooks then return nil end
  local g = m.grad
  if g == nil or g.storage == nil then return nil end
  return as_input(node, i, g)
end

-- The walk whose node's backward is running (run_node sets it around each
-- backward function): what A.pending_grad reads
local pend_state = nil

-- The gradient input i of node (a non-leaf) has received so far from its
-- other consumers, for a backward function to add its own into in place
-- (nn.functional's linear: its input GEMM with beta = 1, where a tensor
-- read by several products, Llama's q/k/v or gate/up, had its gradients
-- summed by an add a reader) and return nil for that input: the walk's sum
-- when the walk owns it alone (not borrowed, no other view of its storage),
-- contiguous, of the input's shape, dtype and device; else nil (return the
-- gradient as usual). MS_PENDING_GRAD=0 or A.set_pending_grad(false): nil.
local pending_on = os.getenv('MS_PENDING_GRAD') ~= '0'
function A.set_pending_grad(on)
  local prev = pending_on
  pending_on = on and true or false
  return prev
end
function A.pending_grad(node, i)
  local w = pend_state
  if w == nil or not pending_on or node.leaf[i] ~= false or not node.need[i] then return nil end
  local g = w.grads[node.iid[i]]
  if g == nil then return nil end
  local gid = tonumber(g.id)
  if not w.taken[gid] or w.borrowed[gid] or g.storage == nil or g.storage.refcount ~= 1 then return nil end
  return as_input(node, i, g)
end

-- Gradient sinks: a wider buffer a leaf's gradient may be written into
-- straight from the op that makes it (FSDP's f32 unsharded gradient of a
-- bf16 parameter: the weight GEMM writes f32, with no bf16 gradient, no
-- converting copy). A.set_grad_sink(leaf, sink) with sink = { t = tensor of
-- the leaf's shape (contiguous, on its device), written = table, i = key }:
-- written[i] says the sink holds a gradient (a writer accumulates into it
-- then, else overwrites it, and sets it); nil clears it. Gradients the ops
-- return as usual still go to .grad: the sink's owner adds those itself.
function A.set_grad_sink(leaf, sink)
  if sink == nil then
    local m = peekmeta(leaf)
    if m then m.sink = nil end
    return
  end
  local t = sink.t
  if not M.is_contiguous(t) or t.device_id ~= leaf.device_id or not same_shape(t, shape_of(leaf)) then
    error(('set_grad_sink: the sink must be contiguous and of the leaf\'s shape %s on its device %s, got %s %s%s on %s')
      :format(shape_str(shape_of(leaf)), leaf.device, t.dtype, shape_str(shape_of(t)),
        M.is_contiguous(t) and '' or ' (not contiguous)', t.device), 2)
  end
  getmeta(leaf).sink = sink
end

-- The sink of input i of node (see set_grad_sink) when it is a leaf that
-- needs its gradient and has no tensor or post-accumulate hooks (they see
-- every gradient handed over); else nil. A backward function that writes
-- there returns nil for that input.
function A.grad_sink(node, i)
  local leaf = node.leaf and node.leaf[i]
  if not leaf or not node.need[i] then return nil end
  local m = peekmeta(leaf)
  if not m or not m.sink or m.hooks or m.post_hooks then return nil end
  return m.sink
end

-- The sink of a leaf tensor t (set_grad_sink) when t needs its gradient
-- and has no hooks; else nil. For ops that make a weight's gradient in
-- their forward (the fused linear cross-entropy).
function A.leaf_sink(t)
  if not needs(t) then return nil end
  local m = peekmeta(t)
  if not m or not m.sink or m.hooks or m.post_hooks or m.grad_fn then return nil end
  return m.sink
end

-- Deferred gradients (A.defer): a backward function may leave some of its
-- inputs' gradients to be computed later in the same walk, as a closure.
-- The point is overlap: a tensor-parallel layer's weight gradient (a GEMM
-- that nothing near needs) waits until the collective of the input's
-- gradient has been launched (tp's entry calls A.flush_deferred() after
-- starting it), so the GEMMs run while the collective does. Correctness
-- never depends on that call: the walk keeps the ids whose gradients are
-- still to come; a node producing one of them is postponed with the
-- deferred work (its own inputs' ids become pending in turn: the weight's
-- cast under autocast), up to MAX_POSTPONED nodes, after which the queue
-- is run first; the queue is also run before every module marker (hooks see
-- complete gradients) and at the walk's end. A backward function called
-- while the queue runs computes at once (A.defer returns false).
local MAX_POSTPONED = 64
local DeferredJob          -- (A.take_deferred's jobs)
local deferring = {}          -- stack of the active walks' queues
local defer_on = os.getenv('MS_DEFER_GRADS') ~= '0'

-- A.defer(node, idx, fn, drop, arg) -> true when queued: fn(arg) returns
-- the gradients of node's inputs idx[1], idx[2], ... (nil for one written
-- elsewhere, e.g. a sink), to be delivered as if the backward had returned
-- them; drop(arg) releases what fn holds if the walk ends without running
-- it (a failed backward). false: nothing queued (no walk, deferral off, or
-- the queue running), compute now. (arg: the state of plain functions, so
-- a backward function queueing work need not make closures, which keep it
-- from being compiled.)
-- A.deferrable(): whether A.defer would queue now (asked before making
-- what a closure would hold)
function A.deferrable()
  local q = deferring[#deferring]
  return q ~= nil and not q.running and defer_on
end
function A.defer(node, idx, fn, drop, arg)
  if not A.deferrable() then return false end
  deferring[#deferring].add(node, idx, fn, drop, arg)
  return true
end
-- runs the current walk's deferred work now (no-op outside a walk)
function A.flush_deferred()
  local q = deferring[#deferring]
  if q ~= nil then q.flush() end
end

-- A.take_deferred() -> job or nil: the current walk's deferred work taken
-- out of it, to run after the walk has ended (a pipeline's zero-bubble
-- schedule runs a micro-batch's weight gradients after later micro-batches'
-- input gradients; docs/autograd.md "Deferred gradients"). nil when nothing
-- is queued (or outside a walk). The gradients are the same bits as a
-- flush's. job:run() -> true (false when it ran or was dropped already):
-- its closures run, delivering into the leaves' .grad (and through the
-- nodes postponed with them: an autocast cast of the weight); a node of
-- the walk that needs one of its gradients runs it first. job:drop()
-- releases what it holds instead (a step cut short). A job never run
-- keeps its operands (a layer's input and output gradient) alive.
DeferredJob = {}
DeferredJob.__index = DeferredJob
function DeferredJob:run()
  if self.done then return false end
  if active ~= nil then
    -- (its backward functions would queue into that walk)
    error('autograd: a taken job of deferred gradients is run after the backward it came from, '
      .. 'not inside a backward', 2)
  end
  local prev = enabled
  enabled = false
  local ok, r = pcall(self.run_fn, self)
  enabled = prev
  if not ok then error(r, 0) end
  return r
end
function DeferredJob:drop()
  if self.done then return false end
  return self.drop_fn(self)
end
function A.take_deferred()
  local q = deferring[#deferring]
  if q == nil or q.take == nil then return nil end
  return q.take()
end
-- A.set_deferral(on) -> previous (also MS_DEFER_GRADS=0): off, every
-- backward function computes at once
function A.set_deferral(on)
  local prev = defer_on
  defer_on = on and true or false
  return prev
end
-- tags: t's readers may defer their weight gradients (the producer of t
-- runs the queue after starting its collective); A.defers_readers(t)
function A.set_defer_readers(t) getmeta(t).defer_readers = true; return t end
function A.defers_readers(t)
  local m = peekmeta(t)
  return m ~= nil and m.defer_readers == true
end
-- (for specs) how many deferred entries and postponed nodes ran so far
local defer_counts = { deferred = 0, postponed = 0, flushes = 0 }
function A.defer_counts() return { deferred = defer_counts.deferred, postponed = defer_counts.postponed,
  flushes = defer_counts.flushes } end

-- Walk `tape` in reverse. grads: id -> gradient (owned by the walk unless
-- borrowed[id]). Leaves up to the caller: clearing the tape.
local function walk(tape, grads, borrowed, root)
  local taken = {}
  local wstate = { grads = grads, taken = taken, borrowed = borrowed }   -- (A.pending_grad)
  -- hand g to input i of node; g is owned by this walk unless borrowed
  local function deliver(node, i, g)
    local shape = node.ishape[i]
    if not same_shape(g, shape) then
      error(('autograd: backward of %s returned a gradient of shape %s for input %d of shape %s')
        :format(node.name, shape_str(shape_of(g)), i, shape_str(shape)), 0)
    end
    local conv = nil -- a converted copy made here (freed here unless kept)
    if g.dtype_id ~= node.idtype[i] or g.device_id ~= node.idev[i] then
      conv = R.to(g, { dtype = node.idtype[i], device = node.idev[i] })
      g = conv
    end
    local gid = tonumber(g.id)
    local leaf = node.leaf[i]
    if leaf then
      local m = getmeta(leaf)
      local h = g
      if m.hooks then h = apply_tensor_hooks(m, g, borrowed, true) end
      local cur = m.grad
      if h == nil then
        -- (taken by a hook: A.CONSUMED)
        if conv and not borrowed[gid] then free(conv) end
      elseif h ~= g then
        g = h; gid = tonumber(g.id)
      end
      if h == nil then   -- (nothing to accumulate)
      elseif cur == nil or cur.storage == nil then
        if not taken[gid] and not borrowed[gid] and g.storage.refcount == 1
            and M.is_contiguous(g) then
          taken[gid] = true
          m.grad = g
        else
          m.grad = R.clone(g)
        end
      else
        F.add_(cur, g)
        if conv and not borrowed[gid] then free(conv) end
      end
      if m.post_hooks then run_hooks(m.post_hooks, leaf) end
    else
      local id = node.iid[i]
      local cur = grads[id]
      if cur == nil then
        if taken[gid] or borrowed[gid] then
          g = R.alias(g)
          gid = tonumber(g.id)
        end
        taken[gid] = true
        grads[id] = g
      else
        local s = F.add(cur, g)
        if not borrowed[tonumber(cur.id)] then free(cur) end
        taken[tonumber(cur.id)] = nil
        grads[id] = s
        taken[tonumber(s.id)] = true
        if conv then free(conv) end
      end
    end
  end

  local run_node
  -- one node's backward: its output gradients gathered, its inputs' delivered
  -- (gl: the output gradients' list, one table a nesting depth: a node's
  -- backward may run the deferred queue, and with it other nodes)
  local gls, depth = {}, 0
  run_node = function(node)
    depth = depth + 1
    local gl = gls[depth]
    if gl == nil then gl = {}; gls[depth] = gl end
    -- gather output grads
    local any = false
    local nout
    if node.oid then
      nout = 1
      local g = grads[node.oid]
      grads[node.oid] = nil
      gl[1] = g
      if g ~= nil then any = true; taken[tonumber(g.id)] = nil end
    else
      nout = #node.oids
      for j = 1, nout do
        local g = grads[node.oids[j]]
        grads[node.oids[j]] = nil
        gl[j] = g
        if g ~= nil then any = true; taken[tonumber(g.id)] = nil end
      end
    end
    if any then
      -- retained grads and tensor hooks of the outputs
      for j = 1, nout do
        local g = gl[j]
        if g ~= nil then
          local m = meta[node.oid or node.oids[j]]
          if m then
            if m.hooks then
              local h = apply_tensor_hooks(m, g, borrowed)
              if h ~= g then
                local gid = tonumber(g.id)
                if not borrowed[gid] and not taken[gid] then free(g) end
                g = h
                gl[j] = h
              end
            end
            if m.retain then m.grad = R.clone(g) end
          end
        end
      end
      if node.multi_zero then
        for j = 1, nout do
          if gl[j] == nil then
            local s = node.oshapes[j]
            gl[j] = T.zeros(s, { dtype = node.odtypes[j], device = node.odevs[j] })
          end
        end
      end
      check_versions(node)
      local outer = pend_state
      pend_state = wstate
      local r = pack(node.bwd(node, unpack(gl, 1, nout)))
      pend_state = outer
      -- release what the node saved
      local own = node.own
      if own then for j = 1, #own do free(own[j]) end end
      node.own, node.saved, node.vers = nil, nil, nil
      local results_borrowed = node.borrow_results
      for i = 1, node.nin do
        local g = r[i]
        if g ~= nil and node.need[i] then
          if results_borrowed then borrowed[tonumber(g.id)] = true end
          deliver(node, i, g)
        end
      end
      -- free what was not handed on
      for i = 1, node.nin do
        local g = r[i]
        if is_tensor(g) then
          local gid = tonumber(g.id)
          if not taken[gid] and not borrowed[gid] then free(g) end
        end
      end
      for j = 1, nout do
        local g = gl[j]
        if g ~= nil then
          local gid = tonumber(g.id)
          if not taken[gid] and not borrowed[gid] then free(g) end
        end
        gl[j] = nil
      end
    else
      local own = node.own
      if own then for j = 1, #own do free(own[j]) end end
      node.own, node.saved, node.vers = nil, nil, nil
    end
    node.done = true
    node.leaf = nil   -- a consumed node holds no tensor handle
    if node.outs then release_outputs(node, root) end
    depth = depth - 1
  end
  -- the deferred work of this walk (A.defer): entries { node, idx, fn, drop }
  -- or { node, run = true } (a postponed node); pending: ids whose gradient
  -- (or part of it) is still to come from the queue
  local q = { list = {}, pending = {}, npost = 0, running = false }
  function q.add(node, idx, fn, drop, arg)
    -- (leaf: the node's leaf handles, which the walk drops once it is done)
    q.list[#q.list + 1] = { node = node, idx = idx, fn = fn, drop = drop, arg = arg, leaf = node.leaf }
    for _, i in ipairs(idx) do
      if node.need[i] and not node.leaf[i] then q.pending[node.iid[i]] = true end
    end
    defer_counts.deferred = defer_counts.deferred + 1
  end
  -- runs a list of deferred entries in order (the queue's, or a taken job's)
  local function run_entries(list)
    local k = 1
    while k <= #list do
      local e = list[k]
      list[k] = false
      k = k + 1
      if e.run then
        run_node(e.node)
      else
        e.drop = nil
        local r = pack(e.fn(e.arg))
        local nd = e.node
        local was = nd.leaf
        nd.leaf = e.leaf
        for j, i in ipairs(e.idx) do
          local g = r[j]
          if g ~= nil and nd.need[i] then
            deliver(nd, i, g)
            local gid = tonumber(g.id)
            if not taken[gid] and not borrowed[gid] then free(g) end
          end
        end
        nd.leaf = was
      end
    end
  end
  function q.flush()
    if q.running or #q.list == 0 then return end
    q.running = true
    defer_counts.flushes = defer_counts.flushes + 1
    local ok, err = pcall(run_entries, q.list)
    q.list, q.pending, q.npost, q.running = {}, {}, 0, false
    if not ok then error(err, 0) end
  end
  -- the jobs taken out of this walk (A.take_deferred) and not yet run or dropped
  local jobs, walking = {}, true
  -- frees the gradients this walk still holds for ids a job was to complete
  local function free_pending(pending)
    for id in pairs(pending) do
      local g = grads[id]
      if g ~= nil then
        grads[id] = nil
        if not borrowed[tonumber(g.id)] then free(g) end
      end
    end
  end
  -- runs a taken job: inside its walk (a node there waits for it) or after
  -- it (the caller's schedule), every backward function computing at once
  local function run_job(job)
    if job.done then return false end
    job.done = true
    jobs[job] = nil
    local running = q.running
    q.running = true
    deferring[#deferring + 1] = q
    defer_counts.flushes = defer_counts.flushes + 1
    local ok, err = pcall(run_entries, job.list)
    deferring[#deferring] = nil
    q.running = running
    if not ok then
      for _, e in ipairs(job.list) do
        if e and e.drop then pcall(e.drop, e.arg) end
      end
    end
    -- (inside the walk its nodes take what the job delivered; after it,
    -- whatever is left had no consumer)
    if not walking then free_pending(job.pending) end
    job.list, job.pending, job.run_fn, job.drop_fn = nil, nil, nil, nil
    if not ok then error(err, 0) end
    return true
  end
  local function drop_job(job)
    if job.done then return false end
    job.done = true
    jobs[job] = nil
    for _, e in ipairs(job.list) do
      if e and e.drop then pcall(e.drop, e.arg) end
    end
    free_pending(job.pending)
    job.list, job.pending, job.run_fn, job.drop_fn = nil, nil, nil, nil
    return true
  end
  -- hands the queue to a job to be run later (A.take_deferred)
  function q.take()
    if q.running or #q.list == 0 then return nil end
    local job = { list = q.list, pending = q.pending, done = false }
    q.list, q.pending, q.npost = {}, {}, 0
    jobs[job] = true
    job.run_fn, job.drop_fn = run_job, drop_job
    return setmetatable(job, DeferredJob)
  end
  -- releases what queued closures hold (a walk that failed)
  function q.drop()
    for _, e in ipairs(q.list) do
      if e and e.drop then pcall(e.drop, e.arg) end
    end
    q.list, q.pending = {}, {}
  end
  -- whether node makes a gradient still to come from the queue (or p)
  local function has_pending(node, p)
    p = p or q.pending
    if next(p) == nil then return false end
    if node.oid then return p[node.oid] == true end
    if node.oids then
      for j = 1, #node.oids do if p[node.oids[j]] then return true end end
    end
    return false
  end
  deferring[#deferring + 1] = q
  local ok, err = pcall(function()
  for k = #tape, 1, -1 do
    local node = tape[k]
    tape[k] = nil
    if node.marker then
      q.flush()
      local m = node.module
      if node.marker == 'end' then
        run_hooks(hooks.module_pre_backward, m)
        local hs = rawget(m, '_backward_pre_hooks')
        if hs then run_hooks(hs, m) end
      else
        local hs = rawget(m, '_backward_hooks')
        if hs then run_hooks(hs, m) end
        run_hooks(hooks.module_post_backward, m)
      end
    elseif not node.done then
      if next(jobs) ~= nil then
        -- a node waiting for a taken job's gradients: the job runs first
        for job in pairs(jobs) do
          if has_pending(node, job.pending) then run_job(job) end
        end
      end
      if has_pending(node) then
        if q.npost < MAX_POSTPONED then
          -- postponed behind the work it waits for
          q.list[#q.list + 1] = { node = node, run = true }
          q.npost = q.npost + 1
          defer_counts.postponed = defer_counts.postponed + 1
          for i = 1, node.nin do
            if node.need[i] and not node.leaf[i] then q.pending[node.iid[i]] = true end
          end
        else
          q.flush()
          run_node(node)
        end
      else
        run_node(node)
      end
    end
  end
  q.flush()
  end)
  deferring[#deferring] = nil
  walking = false
  if not ok then
    q.drop()
    for job in pairs(jobs) do drop_job(job) end
    error(err, 0)
  end
  -- gradients that reached no node (intermediates of earlier, consumed
  -- tapes), but those a taken job is still to complete
  local keep = {}
  for job in pairs(jobs) do
    for id in pairs(job.pending) do keep[id] = true end
  end
  for id, g in pairs(grads) do
    if not keep[id] then
      if not borrowed[tonumber(g.id)] then free(g) end
      grads[id] = nil
    end
  end
end


-- backward's walk of the tape from t (gradient grad): a function of its own,
-- not a closure made at each backward (a trace specialised on one keeps its
-- upvalues, that step's loss and gradient, alive; docs/tensors.md)
local function backward_walk(tape, t, grad, borrowed)
  -- every saved tensor as the forward left it, before any gradient lands
  for k = 1, #tape do check_versions(tape[k]) end
  run_hooks(hooks.backward_begin, tape)
  walk(tape, { [tonumber(t.id)] = grad }, borrowed, tonumber(t.id))
end

-- the backward_end hooks, then the callbacks queued in the backward
local function backward_end()
  run_hooks(hooks.backward_end)
  local q = queued
  queued = {}
  for i = 1, #q do q[i].fn() end
end

-- Nodes are recorded in A.tape; t:backward() walks it and leaves it empty.
local function backward(t, grad)
  if not is_tensor(t) then error('backward: expected a tensor', 2) end
  T.live(t, 'backward')
  if not needs(t) then
    error('backward: the tensor does not require grad (no input of the ops that made it requires grad, '
      .. 'or it was computed under ms.no_grad)', 2)
  end
  local borrowed = {}
  if grad == nil then
    if M.numel(t) ~= 1 then
      error(('backward: a gradient can be created implicitly only for a tensor of one element; '
        .. 'this one has shape %s: pass grad'):format(shape_str(shape_of(t))), 2)
    end
    grad = T.ones(shape_of(t), { dtype = t.dtype_id, device = t.device_id })
  else
    if not is_tensor(grad) then error('backward: grad must be a tensor', 2) end
    if not same_shape(grad, shape_of(t)) then
      error(('backward: grad of shape %s for a tensor of shape %s'):format(
        shape_str(shape_of(grad)), shape_str(shape_of(t))), 2)
    end
    borrowed[tonumber(grad.id)] = true
  end
  local m = peekmeta(t)
  local node = m and m.grad_fn
  if node == nil then
    -- a leaf: its gradient is grad itself
    local lm = getmeta(t)
    if lm.grad == nil then lm.grad = R.clone(grad) else F.add_(lm.grad, grad) end
    return
  end
  if node.done then
    error('backward: the graph of this tensor was already consumed by an earlier backward '
      .. '(the tape is emptied by each backward; run the forward again)', 2)
  end
  local tape = A.tape
  if active ~= nil then
    error('backward: called while another backward is running (use the nested form inside hooks)', 2)
  end
  A.tape = {}
  active = tape
  local prev = enabled
  enabled = false
  local ok, err = pcall(backward_walk, tape, t, grad, borrowed)
  -- whatever happened, the tape is consumed
  for k = #tape, 1, -1 do
    local n = tape[k]
    tape[k] = nil
    if n.own then for j = 1, #n.own do free(n.own[j]) end end
    n.own, n.saved, n.vers, n.done, n.leaf = nil, nil, nil, true, nil
    if n.outs then release_outputs(n, tonumber(t.id)) end
  end
  active = nil
  pend_state = nil   -- (left set by a backward function that raised)
  local ok2, err2 = true, nil
  if ok then
    ok2, err2 = pcall(backward_end)
  else
    -- a backward cut short: only the callbacks queued with always (their
    -- own errors dropped: the first error is the one raised)
    local q = queued
    queued = {}
    for i = 1, #q do if q[i].always then pcall(q[i].fn) end end
  end
  enabled = prev
  if not ok then error(err, 0) end
  if not ok2 then error(err2, 0) end
end
A.backward = backward

-- Drops every recorded node (a forward whose backward will never run).
function A.clear_tape()
  local tape = A.tape
  for k = #tape, 1, -1 do
    local n = tape[k]
    tape[k] = nil
    if n.own then for j = 1, #n.own do free(n.own[j]) end end
    n.own, n.saved, n.vers, n.done, n.leaf = nil, nil, nil, true, nil
    if n.outs then release_outputs(n) end
  end
end
function A.tape_size() return #A.tape end

-- ------------------------------------------------------------------- hooks
local function handle(list, entry)
  list[#list + 1] = entry
  return {
    remove = function()
      for i = 1, #list do
        if list[i] == entry then
          table.remove(list, i)
          return true
        end
      end
      return false
    end,
  }
end
A.hook_handle = handle

function A.register_hook(event, fn)
  local list = hooks[event]
  if not list then
    error(('register_hook: unknown event %s (backward_begin, backward_end, module_pre_backward, '
      .. 'module_post_backward)'):format(tostring(event)), 2)
  end
  if type(fn) ~= 'function' then error('register_hook: fn must be a function', 2) end
  local mod = event == 'module_pre_backward' or event == 'module_post_backward'
  if mod then module_hook_count = module_hook_count + 1 end
  local h = handle(list, { fn = fn })
  local remove = h.remove
  h.remove = function()
    local r = remove()
    if r and mod then module_hook_count = module_hook_count - 1 end
    return r
  end
  return h
end

function A.queue_callback(fn, opts)
  if active == nil then error('queue_callback: no backward is running', 2) end
  if type(fn) ~= 'function' then error('queue_callback: fn must be a function', 2) end
  queued[#queued + 1] = { fn = fn, always = opts ~= nil and opts.always == true }
end

-- true when a module's forward should be bracketed by markers
function A.should_mark(m)
  if not enabled and not collect then return false end
  if module_hook_count > 0 then return true end
  local a, b = rawget(m, '_backward_pre_hooks'), rawget(m, '_backward_hooks')
  return (a ~= nil and #a > 0) or (b ~= nil and #b > 0)
end

function A.mark_module_begin(m)
  if collect then collect[#collect + 1] = m; return end
  if not enabled then return end
  push({ marker = 'begin', module = m })
end
function A.mark_module_end(m)
  if collect or not enabled then return end
  push({ marker = 'end', module = m })
end

-- Modules marked on a tape, in forward order (a module called twice appears
-- twice). Default: the tape being walked by a running backward, else the
-- tape the next backward will walk.
function A.tape_modules(tape)
  tape = tape or active or A.tape
  local r = {}
  for i = 1, #tape do
    local n = tape[i]
    if n.marker == 'begin' then r[#r + 1] = n.module
    elseif n.modules then
      for j = 1, #n.modules do r[#r + 1] = n.modules[j] end
    end
  end
  return r
end

-- ------------------------------------------------------- tensor properties
local props, setters = T.props, T.setters or {}
T.setters = setters

props.requires_grad = function(t) return band(t.flags, RG) ~= 0 end
props.grad_fn = function(t)
  local m = peekmeta(t)
  return m and m.grad_fn or nil
end
props.is_leaf = function(t)
  local m = peekmeta(t)
  return not (m and m.grad_fn)
end
props.grad = function(t)
  local m = peekmeta(t)
  local g = m and m.grad
  if g ~= nil and g.storage == nil then m.grad = nil; return nil end
  return g
end

setters.grad = function(t, g)
  if g ~= nil then
    if not is_tensor(g) then error('grad: expected a tensor or nil', 3) end
    if not same_shape(g, shape_of(t)) then
      error(('grad: a gradient of shape %s for a tensor of shape %s'):format(
        shape_str(shape_of(g)), shape_str(shape_of(t))), 3)
    end
    getmeta(t).grad = g
  else
    local m = peekmeta(t)
    if m then m.grad = nil end
  end
end
setters.requires_grad = function(t, v)
  if v then
    if t.dtype_id > 3 then
      error(('requires_grad: only floating point tensors can require grad (this one is %s)')
        :format(T.dtype_name(t.dtype_id)), 3)
    end
    t.flags = bor(t.flags, RG)
  else
    local m = peekmeta(t)
    if m and m.grad_fn then
      error('requires_grad: cannot turn off requires_grad of a non-leaf tensor (use detach)', 3)
    end
    t.flags = band(t.flags, bit.bnot(RG))
  end
end

function M.requires_grad_(t, v)
  if v == nil then v = true end
  setters.requires_grad(t, v)
  return t
end
function M.detach(t)
  local d = R.alias(t)
  d.flags = band(d.flags, bit.bnot(RG))
  return d
end
function M.detach_(t)
  local m = peekmeta(t)
  if m then m.grad_fn = nil end
  t.flags = band(t.flags, bit.bnot(RG))
  return t
end
function M.retain_grad(t)
  if not needs(t) then error('retain_grad: the tensor does not require grad', 2) end
  getmeta(t).retain = true
  return t
end
-- fn(grad) -> grad? ; called with the gradient of t when it is computed
-- (for a leaf: before it is accumulated into .grad)
function M.register_hook(t, fn)
  if not needs(t) then error('register_hook: the tensor does not require grad', 2) end
  local m = getmeta(t)
  m.hooks = m.hooks or {}
  return handle(m.hooks, { fn = fn })
end
-- fn(t) after a gradient was accumulated into the leaf t's .grad
function M.register_post_accumulate_grad_hook(t, fn)
  local m = getmeta(t)
  if m.grad_fn then error('register_post_accumulate_grad_hook: only for leaf tensors', 2) end
  m.post_hooks = m.post_hooks or {}
  return handle(m.post_hooks, { fn = fn })
end
M.backward = backward
function M.zero_grad(t)
  local m = peekmeta(t)
  if m and m.grad ~= nil then free(m.grad); m.grad = nil end
end

local prev_extra = T.format_extra
T.format_extra = function(t)
  local e = prev_extra and prev_extra(t)
  local m = peekmeta(t)
  local s
  if m and m.grad_fn then s = 'grad_fn=' .. m.grad_fn.name
  elseif band(t.flags, RG) ~= 0 then s = 'requires_grad=true' end
  if e and s then return e .. ', ' .. s end
  return s or e
end

-- ------------------------------------------------------ recording wrappers
local W = {}   -- recording versions, by name
A.W = W

local function num(x) return type(x) == 'number' end

-- -- binary arithmetic (numbers allowed on either side)
local function bwd_add(node, g)
  local r1, r2
  if node.need[1] then r1 = unbroadcast(g, node.ishape[1]) end
  if node.need[2] then r2 = unbroadcast(g, node.ishape[2]) end
  return r1, r2
end
function W.add(a, b)
  local out = F.add(a, b)
  if want(a, b) then record1('add', out, bwd_add, nil, nil, a, b) end
  return out
end

local function bwd_sub(node, g)
  local r1, r2
  if node.need[1] then r1 = unbroadcast(g, node.ishape[1]) end
  if node.need[2] then
    local n = F.neg(g)
    r2 = unbroadcast_tmp(n, node.ishape[2])
  end
  return r1, r2
end
function W.sub(a, b)
  local out = F.sub(a, b)
  if want(a, b) then record1('sub', out, bwd_sub, nil, nil, a, b) end
  return out
end

local function bwd_mul(node, g)
  local a, b = node.saved[1], node.saved[2]
  local r1, r2
  if node.need[1] then
    local t = F.mul(g, b)
    r1 = unbroadcast_tmp(t, node.ishape[1])
  end
  if node.need[2] then
    local t = F.mul(g, a)
    r2 = unbroadcast_tmp(t, node.ishape[2])
  end
  return r1, r2
end
function W.mul(a, b)
  local out = F.mul(a, b)
  if want(a, b) then
    -- save only what the other side's gradient needs
    local sa = needs(b) and a or 0
    local sb = needs(a) and b or 0
    record1('mul', out, bwd_mul, { sa, sb }, nil, a, b)
  end
  return out
end

local function bwd_div(node, g)
  local b, y = node.saved[1], node.saved[2]
  local r1, r2
  if node.need[1] then
    local t = F.div(g, b)
    r1 = unbroadcast_tmp(t, node.ishape[1])
  end
  if node.need[2] then
    -- d(a/b)/db = -a/b^2 = -y/b
    local t1 = F.mul(g, y)
    local t2 = F.div(t1, b)
    free(t1)
    local t3 = F.neg(t2)
    free(t2)
    r2 = unbroadcast_tmp(t3, node.ishape[2])
  end
  return r1, r2
end
function W.div(a, b)
  local out = F.div(a, b)
  if want(a, b) then
    record1('div', out, bwd_div, { b, needs(b) and out or nil }, nil, a, b)
  end
  return out
end

local function bwd_pow(node, g)
  local a, b, y = node.saved[1], node.saved[2], node.saved[3]
  local r1, r2
  if node.need[1] then
    -- b * a^(b-1) * g
    local t
    if num(b) then
      local p = F.pow(a, b - 1)
      t = F.mul(p, b)
      free(p)
    else
      local bm1 = F.sub(b, 1)
      local p = F.pow(a, bm1)
      free(bm1)
      t = F.mul(p, b)
      free(p)
    end
    local t2 = F.mul(t, g)
    free(t)
    r1 = unbroadcast_tmp(t2, node.ishape[1])
  end
  if node.need[2] then
    -- y * log(a) * g
    local la
    if num(a) then la = math.log(a) else la = F.log(a) end
    local t = F.mul(y, la)
    if not num(la) then free(la) end
    local t2 = F.mul(t, g)
    free(t)
    r2 = unbroadcast_tmp(t2, node.ishape[2])
  end
  return r1, r2
end
function W.pow(a, b)
  local out = F.pow(a, b)
  if want(a, b) then
    record1('pow', out, bwd_pow, { a, b, needs(b) and out or nil }, nil, a, b)
  end
  return out
end

local function bwd_maxmin(node, g)
  -- ties split the gradient evenly, as torch.maximum does
  local a, b = node.saved[1], node.saved[2]
  local sel = node.name == 'maximum' and F.gt or F.lt
  local r1, r2
  local eq = maskf(F.eq(a, b), g.dtype_id)
  local half = F.mul(eq, 0.5)
  free(eq)
  -- g * (1[x sel y] + 0.5 * 1[x == y]), summed to x's shape
  local function grad_of(x, y, shape)
    local m = maskf(sel(x, y), g.dtype_id)
    local w = F.add(m, half)
    free(m)
    local t = F.mul(g, w)
    free(w)
    return unbroadcast_tmp(t, shape)
  end
  if node.need[1] then r1 = grad_of(a, b, node.ishape[1]) end
  if node.need[2] then r2 = grad_of(b, a, node.ishape[2]) end
  free(half)
  return r1, r2
end
function W.maximum(a, b)
  local out = F.maximum(a, b)
  if want(a, b) then record1('maximum', out, bwd_maxmin, { a, b }, nil, a, b) end
  return out
end
function W.minimum(a, b)
  local out = F.minimum(a, b)
  if want(a, b) then record1('minimum', out, bwd_maxmin, { a, b }, nil, a, b) end
  return out
end

-- -- unary
-- each entry: name -> function(node, g) using node.saved[1] (x) / [2] (y)
local unary = {}
-- g * t for a temporary t, which is freed
local function mul_tmp(g, t)
  local r = F.mul(g, t)
  free(t)
  return r
end
unary.neg = { function(node, g) return F.neg(g) end }
unary.exp = { function(node, g) return F.mul(g, node.saved[2]) end, y = true }
unary.log = { function(node, g) return F.div(g, node.saved[1]) end, x = true }
unary.sqrt = { function(node, g)
  local t = F.div(g, node.saved[2])
  local r = F.mul(t, 0.5)
  free(t)
  return r
end, y = true }
unary.rsqrt = { function(node, g)
  -- d x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
  local y = node.saved[2]
  local y3 = F.pow(y, 3)
  local t = F.mul(y3, -0.5)
  free(y3)
  local r = F.mul(t, g)
  free(t)
  return r
end, y = true }
unary.tanh = { function(node, g) return F.tanh_backward(node.saved[1], g) end, x = true }
unary.sigmoid = { function(node, g) return F.sigmoid_backward(node.saved[1], g) end, x = true }
unary.relu = { function(node, g) return F.relu_backward(node.saved[1], g) end, x = true }
unary.gelu = { function(node, g) return F.gelu_backward(node.saved[1], g) end, x = true }
unary.silu = { function(node, g) return F.silu_backward(node.saved[1], g) end, x = true }
unary.abs = { function(node, g) return mul_tmp(g, F.sign(node.saved[1])) end, x = true }
unary.sin = { function(node, g) return mul_tmp(g, F.cos(node.saved[1])) end, x = true }
unary.cos = { function(node, g)
  local s = F.sin(node.saved[1])
  local t = F.mul(g, s)
  free(s)
  local r = F.neg(t)
  free(t)
  return r
end, x = true }
unary.square = { function(node, g) return mul_tmp(g, F.mul(node.saved[1], 2)) end, x = true }
unary.reciprocal = { function(node, g)
  -- -y^2 g
  local y = node.saved[2]
  local t = F.mul(y, y)
  local t2 = F.mul(t, g)
  free(t)
  local r = F.neg(t2)
  free(t2)
  return r
end, y = true }
unary.sign = { function(node, g) return nil end }

for name, spec in pairs(unary) do
  local raw = F[name]
  local bwd = spec[1]
  local sx, sy = spec.x, spec.y
  if raw then
    W[name] = function(a)
      local out = raw(a)
      if enabled and needs(a) then
        record1(name, out, bwd, { sx and a or nil, sy and out or nil }, nil, a)
      end
      return out
    end
  end
end

local function bwd_clamp(node, g)
  -- pass the gradient where the input was inside [lo, hi]
  local x, y = node.saved[1], node.saved[2]
  local m = maskf(F.eq(x, y), g.dtype_id)
  local r = F.mul(g, m)
  free(m)
  return r
end
function W.clamp(a, lo, hi)
  local out = F.clamp(a, lo, hi)
  if enabled and needs(a) then record1('clamp', out, bwd_clamp, { a, out }, nil, a) end
  return out
end

local function bwd_where(node, g)
  local m = node.saved[1]
  local r2, r3
  if node.need[2] then
    local mf = R.to(m, { dtype = g.dtype_id })
    local t = F.mul(g, mf)
    free(mf)
    r2 = unbroadcast_tmp(t, node.ishape[2])
  end
  if node.need[3] then
    local mf = R.to(m, { dtype = g.dtype_id })
    local inv = F.sub(1, mf)
    free(mf)
    local t = F.mul(g, inv)
    free(inv)
    r3 = unbroadcast_tmp(t, node.ishape[3])
  end
  return nil, r2, r3
end
function W.where(cond, a, b)
  local out = F.where(cond, a, b)
  if want(a, b) then record1('where', out, bwd_where, { cond }, nil, cond, a, b) end
  return out
end

-- -- reductions (1-based dim, nil = all)
-- t expanded back over the input of a reduction node
local function expand_input(node, t)
  return expand_back(t, node.ishape[1], node.saved.dim, node.saved.keepdim)
end
local function bwd_sum(node, g)
  return expand_input(node, g)
end
local function bwd_mean(node, g)
  local e = expand_input(node, g)
  F.div_(e, node.saved.n)
  return e
end
local function bwd_maxred(node, g)
  -- ties share the gradient evenly
  local x, y = node.saved[1], node.saved[2]
  local s = node.saved
  local ye = expand_input(node, y)
  local m = maskf(F.eq(x, ye), g.dtype_id)
  free(ye)
  local cnt = F.sum(m, s.dim, true)
  local ge = expand_input(node, g)
  local t = F.mul(ge, m)
  free(ge); free(m)
  local r = F.div(t, cnt)
  free(t); free(cnt)
  return r
end
local function bwd_lse(node, g)
  local x, y = node.saved[1], node.saved[2]
  local ye = expand_input(node, y)
  local d = F.sub(x, ye)
  free(ye)
  local p = F.exp(d)
  free(d)
  local ge = expand_input(node, g)
  local r = F.mul(ge, p)
  free(ge); free(p)
  return r
end
-- d prod / d x_i = the product of the other entries of x_i's slice, zeros
-- included: with p' the product of the slice's nonzero entries and c its
-- count of zeros, that is p' / x_i when c = 0, p' at the zero when c = 1, and
-- 0 otherwise (never y / x, which is NaN at a zero)
local function bwd_prod(node, g)
  local x, s = node.saved[1], node.saved
  local dt = x.dtype_id
  local z = maskf(F.eq(x, 0), dt)              -- 1 at the zeros
  local x1 = F.add(x, z)                        -- the zeros made 1
  local p1 = F.prod(x1, s.dim, s.keepdim)       -- y's shape
  local c = F.sum(z, s.dim, s.keepdim)
  local gp = F.mul(g, p1)
  free(p1)
  local gpe = expand_input(node, gp)
  free(gp)
  local ce = expand_input(node, c)
  free(c)
  local none = maskf(F.eq(ce, 0), dt)
  local one = maskf(F.eq(ce, 1), dt)
  free(ce)
  local r = F.div(gpe, x1)
  F.mul_(r, none)
  F.mul_(one, z)                                -- the zero of a slice with one zero
  F.mul_(one, gpe)
  F.add_(r, one)
  free(z); free(x1); free(gpe); free(none); free(one)
  return r
end

local function reduction(name, bwd, save_x, save_y)
  local raw = F[name]
  if not raw then return end
  local pair = (name == 'max' and 'maximum') or (name == 'min' and 'minimum') or nil
  W[name] = function(a, dim, keepdim)
    if pair and is_tensor(dim) then return W[pair](a, dim) end -- max(a, b)
    local out, extra = raw(a, dim, keepdim)
    if enabled and needs(a) and is_tensor(out) then
      local d = dim and pdim(a, dim) or nil
      local n = 1
      if d then n = tonumber(a.sizes[d - 1]) else n = M.numel(a) end
      record1(name, out, bwd, { save_x and a or nil, save_y and out or nil,
        dim = d, keepdim = keepdim and true or false, n = n }, nil, a)
    end
    if extra == nil then return out end -- one value for sum/mean/...: a REPL prints what is returned
    return out, extra
  end
end
reduction('sum', bwd_sum)
reduction('mean', bwd_mean)
reduction('max', bwd_maxred, true, true)
reduction('min', bwd_maxred, true, true)
reduction('logsumexp', bwd_lse, true, true)
reduction('prod', bwd_prod, true, false)

-- -- softmax
local function bwd_softmax(node, g)
  return F.softmax_backward(node.saved[1], g, node.saved.dim, node.saved.log)
end
for name, log in pairs({ softmax = false, log_softmax = true }) do
  local raw = F[name]
  W[name] = function(a, dim)
    local out = raw(a, dim)
    if enabled and needs(a) then
      record1(name, out, bwd_softmax, { out, dim = dim, log = log }, nil, a)
    end
    return out
  end
end

-- -- matmul: out = op(a) @ op(b), batched and broadcast
local function prod_of(s, i, j)
  local n = 1
  for k = i, j do n = n * s[k] end
  return n
end
local function bwd_matmul(node, g)
  local a, b = node.saved[1], node.saved[2]
  local ta, tb = node.saved.ta, node.saved.tb
  local r1, r2
  if node.need[1] then
    local t
    if not ta then t = F.matmul(g, b, false, not tb)
    else t = F.matmul(b, g, tb, true) end
    r1 = unbroadcast_tmp(t, node.ishape[1])
  end
  if node.need[2] then
    local bs = node.ishape[2]
    if #bs == 2 and a.ndim > 2 and not ta then
      -- the Linear case: fold a's batch dims into its rows, one GEMM
      local as = shape_of(a)
      local K = as[#as]
      local a2 = R.reshape(a, { prod_of(as, 1, #as - 1), K })
      local gs = shape_of(g)
      local g2 = R.reshape(g, { prod_of(gs, 1, #gs - 1), gs[#gs] })
      if not tb then r2 = F.matmul(a2, g2, true, false)
      else r2 = F.matmul(g2, a2, true, false) end
      free(a2); free(g2)
    else
      local t
      if not tb then t = F.matmul(a, g, not ta, false)
      else t = F.matmul(g, a, true, ta) end
      r2 = unbroadcast_tmp(t, bs)
    end
  end
  return r1, r2
end
function W.matmul(a, b, ta, tb)
  if not want(a, b) then return F.matmul(a, b, ta, tb) end
  if not is_tensor(a) or not is_tensor(b) then
    error('matmul: expected two tensors', 2)
  end
  -- 1-D operands as in numpy: promote, multiply, squeeze (recorded views)
  if a.ndim == 1 or b.ndim == 1 then
    local a2 = a.ndim == 1 and W.unsqueeze(a, 1) or a
    local b2 = b.ndim == 1 and W.unsqueeze(b, 2) or b
    local o = W.matmul(a2, b2, a.ndim > 1 and ta or false, b.ndim > 1 and tb or false)
    if a.ndim == 1 then o = W.squeeze(o, -2) end
    if b.ndim == 1 then o = W.squeeze(o, -1) end
    return o
  end
  local out = F.matmul(a, b, ta, tb)
  record1('matmul', out, bwd_matmul, { needs(b) and a or nil, needs(a) and b or nil,
    ta = ta and true or false, tb = tb and true or false }, nil, a, b)
  return out
end

-- -- indexing
-- index_select and gather: the backward adds g back at the indices into
-- zeros of the input's shape (index_add_ / scatter_add_ respectively)
local function indexing(name, add_back)
  local function bwd(node, g)
    local z = T.zeros(node.ishape[1], { dtype = g.dtype_id, device = g.device_id })
    add_back(z, node.saved.dim, node.saved[1], g)
    return z
  end
  W[name] = function(a, dim, idx)
    local out = F[name](a, dim, idx)
    if enabled and needs(a) then record1(name, out, bwd, { idx, dim = dim }, nil, a) end
    return out
  end
end
indexing('index_select', function(...) return F.index_add_(...) end)
indexing('gather', function(...) return F.scatter_add_(...) end)

local function bwd_cat(node, g)
  local d = node.saved.dim
  local r = {}
  local off = 1
  for i = 1, node.nin do
    local n = node.saved.sizes[i]
    if node.need[i] then r[i] = R.narrow(g, d, off, n) end
    off = off + n
  end
  return unpack(r, 1, node.nin)
end
function W.cat(list, dim)
  dim = dim or 1
  local out = F.cat(list, dim)
  if enabled then
    local any = false
    for i = 1, #list do if needs(list[i]) then any = true; break end end
    if any then
      local d = pdim(list[1], dim)
      local sizes = {}
      for i = 1, #list do sizes[i] = tonumber(list[i].sizes[d - 1]) end
      record_list('cat', out, bwd_cat, { dim = d, sizes = sizes }, nil, list)
    end
  end
  return out
end

-- stack and split are compositions of recorded ops
function W.stack(list, dim)
  dim = dim or 1
  local u = {}
  for i = 1, #list do
    local x = list[i]
    local d = dim < 0 and x.ndim + 2 + dim or dim
    u[i] = W.unsqueeze(x, d)
  end
  return W.cat(u, dim)
end
-- split(a, size | {sizes}, dim) -> list of views
function W.split(a, size, dim)
  dim = dim or 1
  local n = tonumber(a.sizes[T.cdim(a, dim)])
  local r = {}
  local off = 1
  if type(size) == 'table' then
    local tot = 0
    for i = 1, #size do tot = tot + size[i] end
    if tot ~= n then
      error(('split: sizes add up to %d, but dim %d has size %d'):format(tot, dim, n), 2)
    end
    for i = 1, #size do r[i] = W.narrow(a, dim, off, size[i]); off = off + size[i] end
  else
    if size <= 0 then error('split: size must be positive', 2) end
    while off <= n do
      local len = math.min(size, n - off + 1)
      r[#r + 1] = W.narrow(a, dim, off, len)
      off = off + len
    end
  end
  return r
end
function W.chunk(a, k, dim)
  dim = dim or 1
  local n = tonumber(a.sizes[T.cdim(a, dim)])
  return W.split(a, math.ceil(n / k), dim)
end

-- -- views
local function bwd_reshape(node, g) return R.reshape(g, node.ishape[1]) end
for _, k in ipairs({ 'view', 'reshape', 'squeeze', 'unsqueeze' }) do
  local raw = R[k]
  W[k] = function(t, ...)
    local out = raw(t, ...)
    if enabled and needs(t) and out ~= t then record1(k, out, bwd_reshape, nil, nil, t) end
    return out
  end
end
local function bwd_narrow(node, g)
  local z = T.zeros(node.ishape[1], { dtype = g.dtype_id, device = g.device_id })
  local s = node.saved
  if s.select then
    local v = R.narrow(z, s.dim, s.start, 1)
    local gu = R.unsqueeze(g, s.dim)
    M.copy_(v, gu)
    free(v); free(gu)
  else
    local v = R.narrow(z, s.dim, s.start, s.len)
    M.copy_(v, g)
    free(v)
  end
  return z
end
function W.narrow(t, d, start, length)
  local out = R.narrow(t, d, start, length)
  if enabled and needs(t) then
    local n = tonumber(t.sizes[T.cdim(t, d)])
    if start < 0 then start = n + start + 1 end
    record1('narrow', out, bwd_narrow, { dim = d, start = start, len = length }, nil, t)
  end
  return out
end
function W.select(t, d, i)
  local out = R.select(t, d, i)
  if enabled and needs(t) then
    local n = tonumber(t.sizes[T.cdim(t, d)])
    if i < 0 then i = n + i + 1 end
    record1('select', out, bwd_narrow, { dim = d, start = i, select = true }, nil, t)
  end
  return out
end
local function bwd_transpose(node, g) return R.transpose(g, node.saved.d0, node.saved.d1) end
function W.transpose(t, d0, d1)
  local out = R.transpose(t, d0, d1)
  if enabled and needs(t) then record1('transpose', out, bwd_transpose, { d0 = d0, d1 = d1 }, nil, t) end
  return out
end
function W.t(t)
  local out = R.t(t)
  if enabled and needs(t) then record1('t', out, bwd_transpose, { d0 = 1, d1 = 2 }, nil, t) end
  return out
end
local function bwd_permute(node, g) return R.permute(g, node.saved.inv) end
function W.permute(t, ...)
  local p = T.shape_args(...)
  local out = R.permute(t, p)
  if enabled and needs(t) then
    local inv = {}
    for i = 1, #p do inv[pdim(t, p[i])] = i end
    record1('permute', out, bwd_permute, { inv = inv }, nil, t)
  end
  return out
end
local function bwd_expand(node, g) return unbroadcast(g, node.ishape[1]) end
function W.expand(t, ...)
  local out = R.expand(t, ...)
  if enabled and needs(t) then record1('expand', out, bwd_expand, nil, nil, t) end
  return out
end
local function bwd_ident(node, g) return g end
function W.alias(t)
  local out = R.alias(t)
  if enabled and needs(t) then record1('alias', out, bwd_ident, nil, nil, t) end
  return out
end
function W.contiguous(t)
  local out = R.contiguous(t)
  if out ~= t and enabled and needs(t) then record1('contiguous', out, bwd_ident, nil, nil, t) end
  return out
end
function W.clone(t)
  local out = R.clone(t)
  if enabled and needs(t) then record1('clone', out, bwd_ident, nil, nil, t) end
  return out
end
local function bwd_to(node, g) return R.to(g, { dtype = node.idtype[1], device = node.idev[1] }) end
function W.to(t, a, b)
  local out = R.to(t, a, b)
  if out ~= t and enabled and needs(t) then record1('to', out, bwd_to, nil, nil, t) end
  return out
end

-- ---------------------------------------------------------- in-place guard
-- In-place arithmetic on a tensor that requires grad is an error in grad
-- mode; every in-place write of the Lua face bumps the target's version.
local inplace = {}
for _, k in ipairs({ 'add_', 'sub_', 'mul_', 'div_', 'index_add_', 'scatter_add_' }) do
  local raw = M[k] or F[k]
  if raw then
    inplace[k] = function(t, ...)
      if enabled and needs(t) then
        error(('%s: in-place update of a tensor that requires grad while grad mode is on '
          .. '(wrap it in ms.no_grad, or work on t:detach())'):format(k), 2)
      end
      local r = raw(t, ...)
      bump(t)
      return r
    end
  end
end
-- writes whose target is their first argument (copy_, fill_, gemm_'s out,
-- set) or, for adamw_, every tensor of the list of parameters
for _, k in ipairs({ 'copy_', 'fill_', 'gemm_', 'set' }) do
  local raw = M[k] or F[k]
  if raw then
    inplace[k] = function(t, ...)
      local r = raw(t, ...)
      if is_tensor(t) then bump(t) end
      return r
    end
  end
end
if F.adamw_ then
  local raw = F.adamw_
  inplace.adamw_ = function(params, ...)
    local r = raw(params, ...)
    if type(params) == 'table' then for i = 1, #params do bump(params[i]) end end
    return r
  end
end
A.raw_inplace = {}          -- the unversioned writes, for the engine's own buffers
for k, f in pairs(inplace) do
  A.raw_inplace[k] = M[k] or F[k]
  M[k] = f
  if F[k] then A.ops[k] = f end
end
-- the module-level initialisers (ms.normal_, ms.uniform_) and their methods
for _, k in ipairs({ 'normal_', 'uniform_' }) do
  local raw = T[k]
  local f = function(t, ...)
    local r = raw(t, ...)
    if is_tensor(t) then bump(t) end
    return r
  end
  T[k] = f
  M[k] = f
  A.ops[k] = f
end
-- t:zero_(): fill_ with 0
function M.zero_(t) return M.fill_(t, 0) end

-- ------------------------------------------------------------------ Function
-- Custom differentiable op:
--   local Square = A.Function{
--     forward = function(ctx, x) ctx:save_for_backward(x); return x * x end,
--     backward = function(ctx, g) local x = ctx.saved_tensors[1]; return g * x * 2 end,
--   }
--   local y = Square(x)            -- or Square:apply(x)
-- forward runs without recording; backward returns one gradient per argument
-- of forward (nil for arguments that need none). Several outputs are allowed
-- (backward then receives one gradient per output; a missing one is zeros).
local Ctx = {}
Ctx.__index = Ctx
function Ctx:save_for_backward(...)
  self.saved_tensors = pack(...)
end
function Ctx:mark_dirty() end

-- Marks the float tensor outputs (outs, with outs.n) of a node with several
-- outputs (a Function, a checkpoint); an output that is one of the inputs
-- (args) gets a fresh handle. A missing output gradient is zeros.
local function record_outputs(node, outs, args)
  local oids, oshapes, odtypes, odevs = {}, {}, {}, {}
  for j = 1, outs.n do
    local o = outs[j]
    if is_tensor(o) and o.dtype_id <= 3 then
      for i = 1, args.n do
        if rawequal(o, args[i]) then o = R.alias(o); outs[j] = o; break end
      end
      oids[#oids + 1] = tonumber(o.id)
      oshapes[#oshapes + 1] = shape_of(o)
      odtypes[#odtypes + 1] = o.dtype_id
      odevs[#odevs + 1] = o.device_id
      mark_output(o, node)
    end
  end
  node.oids, node.oshapes, node.odtypes, node.odevs = oids, oshapes, odtypes, odevs
  node.multi_zero = true
end

local function fn_bwd(node, ...)
  local ctx = node.saved.ctx
  local def = node.saved.def
  return def.backward(ctx, ...)
end

local FunctionMT = {}
FunctionMT.__index = FunctionMT
function FunctionMT:apply(...)
  local args = pack(...)
  local ctx = setmetatable({ needs_input_grad = {} }, Ctx)
  local anyneed = false
  for i = 1, args.n do
    ctx.needs_input_grad[i] = enabled and needs(args[i]) or false
    if ctx.needs_input_grad[i] then anyneed = true end
  end
  -- (the arguments from args, not `...`: LuaJIT does not compile a vararg
  -- read in a trace that starts at the loop above)
  local outs
  if anyneed then
    outs = pack(with_mode(false, self.forward, ctx, unpack(args, 1, args.n)))
  else
    outs = pack(self.forward(ctx, unpack(args, 1, args.n)))
  end
  if not anyneed then return unpack(outs, 1, outs.n) end
  local node = new_node(self.name or 'Function', fn_bwd, args, args.n)
  record_outputs(node, outs, args)
  node.borrow_results = not self.owns_results
  node.saved = { ctx = ctx, def = self }
  node.vers = snap(ctx.saved_tensors)
  push(node)
  return unpack(outs, 1, outs.n)
end
FunctionMT.__call = function(self, ...) return self:apply(...) end

function A.Function(def)
  if type(def) ~= 'table' or type(def.forward) ~= 'function' or type(def.backward) ~= 'function' then
    error('Function: expected a table with forward(ctx, ...) and backward(ctx, grad) functions', 2)
  end
  return setmetatable({ forward = def.forward, backward = def.backward, name = def.name,
                        owns_results = def.owns_results == true }, FunctionMT)
end

-- ------------------------------------------ selective activation checkpointing
-- A checkpoint under a policy (A.checkpoint_policy) keeps the outputs of
-- some ops of its forward, and the recompute in backward takes them instead
-- of computing them again: torchtitan's op-level selective checkpointing
-- (its "op" mode keeps every attention's output and every other matmul's).
-- An op that can be kept asks, in the forward and in the recompute alike,
-- slot = A.sac_on() and A.sac_slot(kind, sig) (nil outside such a
-- checkpoint); the n-th op
-- of a kind in one forward is the n-th in its recompute, and sig (shapes,
-- dtypes) must match as well. In the forward slot.keep says the policy
-- keeps it: the op hands its outputs to A.sac_keep(slot, ...) (aliases
-- held by the checkpoint's node); in the recompute slot.outs holds them
-- (new aliases) when they were kept and not written in place since.
local sac = nil        -- the active state: { replay =, counts =, kept =, policy =, own = }
local sac_counts = { kept = 0, reused = 0 }
-- whether a selective checkpoint is running: the ops ask A.sac_slot only
-- then (their signature strings cost nothing otherwise)
function A.sac_on() return sac ~= nil end
function A.sac_slot(kind, sig)
  local s = sac
  if s == nil then return nil end
  local n = (s.counts[kind] or 0) + 1
  s.counts[kind] = n
  local key = kind .. '#' .. n
  if s.replay then
    local e = s.kept[key]
    if e == nil then return nil end
    s.kept[key] = nil
    if e.sig ~= sig then return nil end
    for j = 1, #e.t do
      local st = e.t[j].storage
      if st == nil or st.version ~= e.v[j] then return nil end   -- written since: computed again
    end
    local outs = {}
    for j = 1, #e.t do outs[j] = R.alias(e.t[j]) end
    sac_counts.reused = sac_counts.reused + 1
    return { outs = outs }
  end
  if s.policy(kind, n) then return { keep = true, key = key, sig = sig } end
  return nil
end
function A.sac_keep(slot, ...)
  local s = sac
  local e = { t = {}, v = {}, sig = slot.sig }
  for j = 1, select('#', ...) do
    local t = select(j, ...)
    local a = R.alias(t)
    e.t[j], e.v[j] = a, t.storage and t.storage.version
    s.own[#s.own + 1] = a
  end
  s.kept[slot.key] = e
  sac_counts.kept = sac_counts.kept + 1
end
-- the ops kept and reused so far (a copy), or after A.sac_stats(true) reset
function A.sac_stats(reset)
  local r = { kept = sac_counts.kept, reused = sac_counts.reused }
  if reset then sac_counts.kept, sac_counts.reused = 0, 0 end
  return r
end
-- the policies by name: 'op' keeps every attention output and the odd-numbered
-- linear layers' (the 1st, 3rd, ... of a forward), as torchtitan's op SAC
A.sac_policies = {
  op = function(kind, n) return kind == 'attention' or (kind == 'linear' and n % 2 == 1) end,
}

-- --------------------------------------------------------------- checkpoint
-- ms.checkpoint(fn, ...): fn's activations are not kept; backward re-runs fn.
local function ckpt_bwd(node, ...)
  local gouts = pack(...)
  local s = node.saved
  local rng_now = T.rng_state()
  T.set_rng_state(s.rng)
  -- the forward's autocast region (moonshard.amp) for the recompute
  local amp = package.loaded['moonshard.amp']
  local amp_now = amp and amp.state()
  if amp then amp.set_state(s.amp) end
  local outer = A.tape
  local nested = {}
  A.tape = nested
  local args = {}
  for i = 1, s.args.n do
    local a = s.args[i]
    if is_tensor(a) then
      local d = R.alias(a)
      d.flags = band(d.flags, bit.bnot(RG))
      if node.need[i] then d.flags = bor(d.flags, RG) end
      args[i] = d
    else
      args[i] = a
    end
  end
  local prev = enabled
  enabled = true
  local prev_sac = sac
  sac = s.sac and { replay = true, counts = {}, kept = s.sac } or nil
  local ok, outs = pcall(function() return pack(s.fn(unpack(args, 1, s.args.n))) end)
  sac = prev_sac
  enabled = prev
  A.tape = outer
  T.set_rng_state(rng_now)
  if amp then amp.set_state(amp_now) end
  if not ok then error(outs, 0) end
  local grads, borrowed = {}, {}
  local k = 0
  for j = 1, outs.n do
    local o = outs[j]
    if is_tensor(o) and o.dtype_id <= 3 then
      k = k + 1
      local g = gouts[k]
      if g ~= nil and needs(o) then
        local id = tonumber(o.id)
        if grads[id] == nil then
          grads[id] = g
          borrowed[tonumber(g.id)] = true
        else
          grads[id] = F.add(grads[id], g)
        end
      end
    end
  end
  walk(nested, grads, borrowed)
  local r = {}
  for i = 1, s.args.n do
    local d = args[i]
    if is_tensor(d) then
      if node.need[i] then
        local m = peekmeta(d)
        r[i] = m and m.grad or nil
        if m then m.grad = nil end
      end
      free(d)
    end
  end
  return unpack(r, 1, s.args.n)
end

local function checkpoint(policy, fn, ...)
  if type(fn) ~= 'function' and not (type(fn) == 'table' and getmetatable(fn)
      and getmetatable(fn).__call) then
    -- (level 2: A.checkpoint and A.checkpoint_policy tail-call this)
    error('checkpoint: expected a function (or callable module) first', 2)
  end
  if not enabled then return fn(...) end
  local args = pack(...)
  local rng = T.rng_state()
  local amp = package.loaded['moonshard.amp']
  local amp_state = amp and amp.state()
  local prev_collect = collect
  local mods = {}
  collect = mods
  enabled = false
  local prev_sac = sac
  local st = policy and { counts = {}, kept = {}, policy = policy, own = {} } or nil
  sac = st
  local ok, outs = pcall(function() return pack(fn(unpack(args, 1, args.n))) end)
  sac = prev_sac
  enabled = true
  collect = prev_collect
  if not ok then
    if st then for _, a in ipairs(st.own) do free(a) end end
    error(outs, 0)
  end
  if prev_collect then
    for i = 1, #mods do prev_collect[#prev_collect + 1] = mods[i] end
  end
  local node = new_node('checkpoint', ckpt_bwd, args, args.n)
  record_outputs(node, outs, args)
  node.modules = mods
  node.saved = { fn = fn, args = args, rng = rng, amp = amp_state, sac = st and next(st.kept) and st.kept or nil }
  -- (the kept outputs are freed with the node, after its backward)
  if st and #st.own > 0 then node.own = st.own end
  node.vers = snap(args)
  push(node)
  return unpack(outs, 1, outs.n)
end
function A.checkpoint(fn, ...) return checkpoint(nil, fn, ...) end
-- A.checkpoint_policy(policy, fn, ...): A.checkpoint keeping what policy
-- (a name of A.sac_policies or a function(kind, n) -> bool: keep the n-th
-- op of `kind`, 'linear' or 'attention', of the forward) chooses
function A.checkpoint_policy(policy, fn, ...)
  if type(policy) == 'string' then
    local p = A.sac_policies[policy]
    if p == nil then error(('checkpoint_policy: no policy %q (op, or a function)'):format(policy), 2) end
    policy = p
  elseif type(policy) ~= 'function' then
    error(('checkpoint_policy: policy must be a name or a function, got %s'):format(type(policy)), 2)
  end
  return checkpoint(policy, fn, ...)
end

-- ---------------------------------------------------------------- gradcheck
-- Compares the gradients autograd gives with central finite differences.
-- fn() returns a tensor y (it closes over its inputs); `tensors` are the leaf
-- tensors to check (contiguous f64 on the CPU, requires_grad set). The
-- scalar checked is L = sum(y * r) for a fixed random r, so every element of
-- y matters. Returns the largest relative error ‖analytic − numeric‖ /
-- max(‖numeric‖, 1e-12) over the tensors, and a list of per-tensor reports.
function A.gradcheck(fn, tensors, opts)
  opts = opts or {}
  local eps = opts.eps or 1e-6
  for i, t in ipairs(tensors) do
    if t.dtype_id ~= 0 or t.device_id ~= -1 or not M.is_contiguous(t) then
      error(('gradcheck: tensor %d must be contiguous f64 on the CPU'):format(i), 2)
    end
    if not needs(t) then error(('gradcheck: tensor %d does not require grad'):format(i), 2) end
  end
  local r
  local function loss_value()
    return A.no_grad(function()
      local y = fn()
      if r == nil then r = T.randn(shape_of(y), { dtype = 'f64', seed = opts.seed or 1234 }) end
      local p = F.mul(y, r)
      local s = F.sum(p)
      local v = M.item(s)
      free(p); free(s)
      return v
    end)
  end
  loss_value() -- draws r
  for _, t in ipairs(tensors) do M.zero_grad(t) end
  A.enable_grad(function()
    local y = fn()
    local l = W.sum(W.mul(y, r))
    backward(l)
  end)
  local worst, reports = 0, {}
  for i, t in ipairs(tensors) do
    local p = ffi.cast('double*', C.ms_tensor_data(t))
    local g = props.grad(t)
    -- (the contiguous copy held in a local while gp points into it: an
    -- unreferenced handle could be collected, and its storage freed)
    local gc = g and R.contiguous(g)
    local gp = gc and ffi.cast('double*', C.ms_tensor_data(gc))
    local n = M.numel(t)
    local diff2, num2, maxabs = 0, 0, 0
    for j = 0, n - 1 do
      local x0 = p[j]
      p[j] = x0 + eps
      local lp = loss_value()
      p[j] = x0 - eps
      local lm = loss_value()
      p[j] = x0
      local num = (lp - lm) / (2 * eps)
      local ana = gp and gp[j] or 0
      diff2 = diff2 + (ana - num) ^ 2
      num2 = num2 + num ^ 2
      maxabs = math.max(maxabs, math.abs(ana - num))
    end
    if gc ~= nil and gc ~= g then free(gc) end
    local rel = math.sqrt(diff2) / math.max(math.sqrt(num2), 1e-12)
    reports[i] = { rel = rel, max_abs = maxabs, norm = math.sqrt(num2) }
    if rel > worst then worst = rel end
  end
  return worst, reports
end

-- ------------------------------------------------------------------ install
-- recording versions become the tensor methods and the functional ops
for k, f in pairs(W) do
  M[k] = f
  A.ops[k] = f
end
-- flatten/view_as/expand_as/float/... call M.* at call time, so they record
for _, k in ipairs({ 'flatten', 'view_as', 'expand_as' }) do A.ops[k] = M[k] end

-- differentiable ops that only exist as raw functions in this build are
-- passed through (their backward is missing: recording them is an error)
for k, f in pairs(F) do
  if A.ops[k] == nil then A.ops[k] = f end
end

A.no_grad_fn = A.no_grad
return A
