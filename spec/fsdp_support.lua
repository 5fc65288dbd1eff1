-- spec/fsdp_support.lua — what the fsdp runtime specs share: the tiny
-- fixture models, token rows from a fixed generator, and the relative
-- differences they compare with; and the dist_ep_tp specs' MoE model, its
-- split, and their checks against one process (gradients, clipped steps,
-- states, units).
local T = require 'moonshard.tensor'
local luassert = require 'luassert'   -- busted's assert (a spec's global)

local S = {}

S.fixtures = T.root .. '/../shared/fixtures'

-- is the fixture model `name` (gpt2-tiny, llama-tiny) there?
function S.have_fixture(name)
  local f = io.open(S.fixtures .. '/' .. (name or 'gpt2-tiny') .. '/model.safetensors', 'rb')
  if f then f:close() end
  return f ~= nil
end

-- the fixture model `name` in f32 (gpt2-tiny by default)
function S.load_model(name)
  name = name or 'gpt2-tiny'
  local M = require(name:match('^llama') and 'models.llama' or 'models.gpt2')
  return M.from_pretrained(S.fixtures .. '/' .. name, { dtype = 'f32' })
end

-- the dist_ep_tp specs' tiny MoE model of case = { what, module, config }:
-- built under seed 7 (then in dtype, where given), its routing biases
-- (where it has them) set to choose differently from zeros
function S.moe_model(case, dtype)
  local ms = require 'moonshard'
  ms.manual_seed(7)
  local m = case[2].new('tiny', case[3])
  if dtype then m = m:to(dtype) end
  for _, l in ipairs(ms.nn.moe.layers(m)) do
    local b = l:routing_bias()
    if b then b:copy_(ms.randn(b.shape, { seed = 4 }):to(b.dtype) * 0.01) end
  end
  return m
end

-- model m split for `--tp 2 --ep M` over W ranks (the dist_ep_tp specs):
-- TP groups of 2 consecutive ranks, the expert groups of M consecutive
-- ranks (M = 2: the TP group, with its W / 2 copies; else the world)
-- -> m, the mesh { replicate = W / 2, shard = 2 }
function S.split_ep_tp(m, W, M, sp)
  local ms, dist = require 'moonshard', require 'moonshard.dist'
  local mesh = dist.mesh { replicate = W / 2, shard = 2 }
  if M == 2 then
    ms.ep.parallelize(m, { group = mesh.shard, replicate = W > 2 and mesh.replicate or nil })
  else
    ms.ep.parallelize(m, { group = dist.world_group })
  end
  ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = sp })
  return m, mesh
end

-- n rows of `seq` token ids in [0, 256) and their next-token targets, from
-- the LCG x -> (1103515245 x + 12345) mod 2^31 started at `seed` (Lua tables)
function S.lcg_rows(seed, n, seq)
  local ids, tg = {}, {}
  for i = 1, n do
    ids[i], tg[i] = {}, {}
    for j = 1, seq + 1 do
      seed = (seed * 1103515245 + 12345) % 2147483648
      local v = math.floor(seed / 65536) % 256
      if j <= seq then ids[i][j] = v end
      if j > 1 then tg[i][j - 1] = v end
    end
  end
  return ids, tg
end

-- the same rows as i64 tensors
function S.lcg_batch(seed, n, seq)
  local ids, tg = S.lcg_rows(seed, n, seq)
  return T.tensor(ids, { dtype = 'i64' }), T.tensor(tg, { dtype = 'i64' })
end

-- ||a − b|| / ||b|| of tensors, in f64 (DESIGN.md's measure for dtype bounds)
function S.norm_rel(a, b)
  local a64, b64 = a:to('f64'), b:to('f64')
  return math.sqrt((a64 - b64):square():sum():item()) / math.max(math.sqrt(b64:square():sum():item()), 1e-30)
end

-- norm_rel of the two tensors' copies on the host (from a GPU)
function S.host_norm_rel(a, b) return S.norm_rel(a:to('cpu'), b:to('cpu')) end

-- the losses of `steps` steps of model m on (x, y) under bf16 autocast,
-- optimizer opt stepping each
function S.autocast_losses(m, opt, x, y, steps)
  local r = {}
  for k = 1, steps do
    local l = require('moonshard').nn.functional.autocast('bf16', m, x, y)
    l:backward(); r[k] = l:item(); opt:step(); opt:zero_grad()
  end
  return r
end

-- |a − b| / |b| of numbers
function S.rel(a, b) return math.abs(a - b) / math.max(math.abs(b), 1e-30) end

-- max |a − b| / max |b| of tensors
function S.max_rel(a, b)
  local d = (a:to('f64') - b:to('f64')):abs():max():item()
  local s = b:to('f64'):abs():max():item()
  return d / math.max(s, 1e-30)
end

-- the split MoE model m's gradients (ms.tp.full_grads: the slices
-- gathered, the experts this rank holds under their global names) against
-- one process's (ref's), each within `bound` (norm_rel), only the experts
-- held elsewhere missing; then the unclipped norms (ep.clip_grad_norm_,
-- optim.clip_grad_norm) within `norm_bound`. what: the messages' prefix (or
-- nil) -> how many gradients were compared, how many m has
function S.same_moe_grads(m, ref, bound, norm_bound, what)
  local ms = require 'moonshard'
  local at = what and what .. ', ' or ''
  local full = ms.tp.full_grads(m)
  local n = 0
  for name, p in ref:named_parameters() do
    local g = full[name]
    if g ~= nil then
      n = n + 1
      local e = S.norm_rel(g, p.grad)
      luassert.is_true(e <= bound, ('%s%s: %.3g from one process\'s gradient'):format(at, name, e))
    else
      -- (only the experts held elsewhere are missing)
      luassert.is_truthy(name:find('.experts.', 1, true), name)
    end
  end
  local held = 0
  for _ in pairs(full) do held = held + 1 end
  local nm = ms.ep.clip_grad_norm_(m, math.huge)
  local nr = ms.optim.clip_grad_norm(ref, math.huge)
  luassert.is_true(S.rel(nm, nr) <= norm_bound, ('%snorm %.17g, one process %.17g'):format(what and what .. ': ' or '',
    nm, nr))
  return n, held
end

-- a step of the one-process reference (ref, its AdamW ropt) and the split
-- MoE model (m, opt) after their backwards: both clipped at 0.05
-- (ep.clip_grad_norm_ deferred into opt when `defer`), the clip biting and
-- the norms within `bound`; then both optimizers step and zero the grads
function S.clipped_moe_step(ref, ropt, m, opt, step, bound, defer)
  local ms = require 'moonshard'
  local nr = ms.optim.clip_grad_norm(ref, 0.05)
  local nm = ms.ep.clip_grad_norm_(m, 0.05, { defer = defer and opt or nil })
  luassert.is_true(nr > 0.05, 'the clip bites')
  luassert.is_true(S.rel(nm, nr) <= bound, ('step %d: norm %.17g, one process %.17g'):format(step, nm, nr))
  ropt:step(); ropt:zero_grad()
  opt:step(); opt:zero_grad()
end

-- every tensor of the state `want` (name -> tensor) in `got`, within `bound`
-- by measure (max_rel unless given; what: after the name in the messages)
function S.same_state(got, want, bound, measure, what)
  measure = measure or S.max_rel
  for name, t in pairs(want) do
    luassert.is_truthy(got[name], name)
    local e = measure(got[name], t)
    luassert.is_true(e <= bound, ('%s%s: %.3g'):format(name, what or '', e))
  end
end

-- fully_shard m over `group` (strategy, a unit each LlamaDecoderLayer) ->
-- fsdp.AdamW(m, hyper)
function S.shard_layers(m, group, strategy, hyper)
  local ms = require 'moonshard'
  ms.fsdp.fully_shard(m, { strategy = strategy, group = group,
    policy = ms.fsdp.policy.by_class({ 'LlamaDecoderLayer' }) })
  return ms.fsdp.AdamW(m, hyper)
end

-- fully_shard's units of a split MoE model: each of its n_moe layers'
-- experts a unit over `experts` ranks (their copies), every other unit
-- over `others`
function S.moe_unit_sizes(m, experts, others, n_moe)
  local ms = require 'moonshard'
  local ne = 0
  for _, u in ipairs(ms.fsdp.units(m)) do
    if u.experts then
      ne = ne + 1
      luassert.are.equal(experts, u.fp.world_size, u.label)
    else
      luassert.are.equal(others, u.fp.world_size, u.label)
    end
  end
  luassert.are.equal(n_moe, ne)
end

-- model m (cp.apply'd, context ctx) on this rank's context-parallel chunks
-- of (x, y), the loss times `scale` (where given), its backward -> the loss
-- averaged over `group`
function S.cp_loss(m, ctx, x, y, group, scale)
  local cp, dist = require 'moonshard.cp', require 'moonshard.dist'
  local l = m(cp.shard(x, ctx), cp.shard(y, ctx))
  if scale then l = l * scale end
  l:backward()
  local lt = l:detach():clone()
  dist.all_reduce(lt, 'avg', { group = group })
  return lt:item()
end

-- name -> the whole gradient (flat), from fully_shard's units' gradient
-- shards (a collective over each unit's group)
function S.whole_grads(m)
  local fsdp, dist = require 'moonshard.fsdp', require 'moonshard.dist'
  local r = {}
  for _, u in ipairs(fsdp.units(m)) do
    local fp = u.fp
    local g = fp.shard.grad
    assert(g ~= nil, u.label .. ' has no gradient shard')
    local flat = T.empty({ fp.total }, { dtype = g.dtype, device = g.device })
    if fp.world_size == 1 then flat:copy_(g) else dist.all_gather_into(flat, g, { group = fp.group }) end
    for i = 1, fp.nparams do
      r[u.param_names[i]] = flat:narrow(1, fp.layout.offsets[i] + 1, fp.layout.numels[i]):clone()
    end
    flat:free()
  end
  return r
end

return S
