-- spec/pp_support.lua — what the two-chunk pipeline specs on CPU ranks
-- (dist_pp_zbv_spec, dist_pp_dualpipev_spec: #mpi, f64) share: their tiny
-- models of 8 blocks, the checks of a pipeline against one process (the
-- order each rank ran, every gradient, the V's placement), the count of
-- the weight-gradient jobs and of the chunks open, and two whole runs
-- against one process (AdamW steps with clipping and a one-process
-- checkpoint resumed; the stages under fully_shard). dist_pp_aux_spec
-- takes its gradient check (same_grads).
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local FS = require 'spec.fsdp_support'
local hf = require 'models.hf'
local luassert = require 'luassert'   -- busted's assert (a spec's global)

local P = {}

-- 8 blocks: 2S virtual stages for S up to 4. { what, module, config }
P.cases = {
  { 'gpt2', require 'models.gpt2', { vocab_size = 259, n_positions = 16, n_embd = 24, n_layer = 8, n_head = 4,
    resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
  { 'llama', require 'models.llama', { vocab_size = 257, hidden_size = 24, intermediate_size = 40,
    num_hidden_layers = 8, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16 } },
  { 'llama tied', require 'models.llama', { vocab_size = 257, hidden_size = 24, intermediate_size = 40,
    num_hidden_layers = 8, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16,
    tie_word_embeddings = true } },
  -- a head of 3.6 blocks' work: zbv's default cut balances the ranks
  -- (pp.rank_balanced), the last chunk the head alone (rank_cut: zbv's
  -- spec checks that cut)
  { 'llama big head', require 'models.llama', { vocab_size = 1000, hidden_size = 24, intermediate_size = 40,
    num_hidden_layers = 8, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16 },
    rank_cut = true },
}

-- case's model under seed `seed` (7 unless given), in f64
function P.build(case, seed)
  ms.manual_seed(seed or 7)
  local cfg = {}
  for k, v in pairs(case[3]) do cfg[k] = v end
  return case[2].new(cfg):to('f64')
end

-- name -> parameter of model m
function P.params_of(m)
  local r = {}
  for name, p in m:named_parameters() do r[name] = p end
  return r
end

-- the trace of run_order against pp_order's list `want`: each op whole, or
-- (`kind_only`) its kind, micro-batch and chunk (dualpipev's ops carry
-- their overlap too)
function P.same_order(want, trace, what, kind_only)
  luassert.are.equal(#want, #trace, what .. ': ops run')
  for n, op in ipairs(want) do
    luassert.are.same(kind_only and { op[1], op[2], op[3] } or op, trace[n], ('%s: op %d'):format(what, n))
  end
end

-- every parameter m holds has a gradient within 1e-10 (max_rel) of one
-- process's (ref's) -> how many m holds
function P.same_grads(m, ref, what)
  local ref_p = P.params_of(ref)
  local n = 0
  for name, p in m:named_parameters() do
    luassert.is_not_nil(p.grad, what .. ': no gradient for ' .. name)
    local e = FS.max_rel(p.grad, ref_p[name].grad)
    luassert.is_true(e <= 1e-10, ('%s: %s: %g'):format(what, name, e))
    n = n + 1
  end
  return n
end

-- the V's placement (zbv, dualpipev) on rank R of W: rank 0 the first and
-- the last stage, no tied copy; rank s holds virtual stages s and 2S - 1 - s
function P.holds_v(pipe, W, R, what)
  luassert.are.equal(R == 0, pipe.first, what)
  luassert.are.equal(R == 0, pipe.last, what)
  luassert.are.equal(0, #pipe.tied, what)
  local L = pipe.layers
  local starts = { 1 }
  for k = 1, #L do starts[k + 1] = starts[k] + L[k] end
  luassert.are.same({ starts[R + 1], starts[R + 2] - 1 }, pipe.ranges[1], what)
  luassert.are.same({ starts[2 * W - R], starts[2 * W - R + 1] - 1 }, pipe.ranges[2], what)
end

-- pipe:step(x, y) (M micro-batches, traced) on rank R of a V (zbv,
-- dualpipev): every virtual stage but the first takes its weight gradients
-- out of each backward as a job (rank 0: M, for chunk 2 only; the others
-- 2M), each of them run, every chunk closed at the end -> the most chunks
-- open at once
function P.split_w_step(pipe, x, y, M, R)
  pipe.trace = {}
  local took, ran = P.step_counting_jobs(pipe, x, y)
  luassert.are.equal(R == 0 and M or 2 * M, took)
  luassert.are.equal(took, ran)
  local open, most = P.chunks_open(pipe.trace)
  luassert.are.equal(0, open)
  return most
end

-- pipe:step(x, y) counting the weight-gradient jobs the backwards take out
-- (autograd.take_deferred wrapped, put back after) and those run -> took, ran
function P.step_counting_jobs(pipe, x, y)
  local took, ran = 0, 0
  local A = ms.autograd
  local take = A.take_deferred
  A.take_deferred = function()
    local job = take()
    if job then
      took = took + 1
      local run = job.run
      job.run = function(j, ...) ran = ran + 1; return run(j, ...) end
    end
    return job
  end
  local ok, err = pcall(pipe.step, pipe, x, y)
  A.take_deferred = take
  assert(ok, err)
  return took, ran
end

-- a trace's chunks open (a forward opens one, its weight gradients close
-- it) -> open at the end, the most at once
function P.chunks_open(trace)
  local open, most = 0, 0
  for _, op in ipairs(trace) do
    if op[1] == 'F' then open = open + 1 elseif op[1] == 'W' then open = open - 1 end
    most = math.max(most, open)
  end
  return open, most
end

-- case under `schedule` (2W micro-batches) against one process: 3 AdamW
-- steps clipped at 0.5 (losses within 1e-11, norms 1e-10), the weights
-- and the whole model's state dict within 1e-10, (`optimizer_state`) the
-- gathered optimizer state the one process's; that checkpoint loaded into
-- a fresh pipeline (seed 99) steps as the one process does
function P.trains_and_resumes(case, schedule, W, optimizer_state)
  local pp = ms.pp
  local ref = P.build(case)
  local m = P.build(case)
  local M = 2 * W
  local pipe = pp.pipeline(m, { schedule = schedule, microbatches = M })
  local hyper = { lr = 1e-2, weight_decay = 0.1, betas = { 0.9, 0.95 }, eps = 1e-8 }
  local o0, o1 = ms.optim.AdamW(ref, hyper), ms.optim.AdamW(m, hyper)
  for step = 1, 3 do
    local x, y = FS.lcg_batch(80 + step, M, 8)
    local l0 = ref(x, y)
    l0:backward()
    local n0 = ms.optim.clip_grad_norm(ref, 0.5)
    o0:step(); o0:zero_grad()
    local l1 = pipe:step(x, y)
    local n1 = pp.clip_grad_norm_(m, 0.5)
    o1:step(); o1:zero_grad()
    luassert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-11, ('%s step %d: %.17g against %.17g'):format(case[1], step,
      l1:item(), l0:item()))
    luassert.is_true(FS.rel(n1, n0) <= 1e-10, ('%s step %d: norm %.17g against %.17g'):format(case[1], step, n1, n0))
  end
  local ref_p = P.params_of(ref)
  for name, p in m:named_parameters() do luassert.is_true(FS.max_rel(p, ref_p[name]) <= 1e-10, name) end
  local sd = pp.full_state_dict(m)
  for name, t in pairs(ref:state_dict()) do
    luassert.is_not_nil(sd[name], name)
    luassert.is_true(FS.max_rel(sd[name], t) <= 1e-10, name)
  end
  local msd, osd = pp.full_checkpoint(m, o1, hyper)
  if optimizer_state then
    for key, t in pairs(o0:state_dict().tensors) do
      luassert.is_not_nil(osd.tensors[key], key)
      luassert.is_true(FS.max_rel(osd.tensors[key], t) <= 1e-10, key)
    end
  end
  -- into a fresh pipeline of the schedule (another seed): the next step is the whole model's
  local m2 = P.build(case, 99)
  local pipe2 = pp.pipeline(m2, { schedule = schedule, microbatches = M })
  pp.load_full_state_dict(m2, msd)
  local o2 = ms.optim.AdamW(m2, { lr = 1 })
  pp.load_full_optimizer_state(m2, o2, osd)
  local x2, y2 = FS.lcg_batch(89, M, 8)
  local l0 = ref(x2, y2)
  l0:backward()
  o0:step()
  local l2 = pipe2:step(x2, y2)
  o2:step()
  luassert.is_true(FS.rel(l2:item(), l0:item()) <= 1e-11, case[1] .. ': the resumed step')
  for name, p in m2:named_parameters() do
    luassert.is_true(FS.max_rel(p, ref_p[name]) <= 1e-10, case[1] .. ': after the resumed step: ' .. name)
  end
  pipe:free(); pipe2:free()
end

-- case under `schedule` (`chunks` where given, 4 micro-batches) over 2
-- stages x W / 2, each stage's ranks under fully_shard (strategy; a unit
-- each block): no weight gradients split off; the loss (within 1e-12), the
-- units sharded after the step, every whole gradient (1e-10) and the norm
-- (1e-11) one process's over the 4W / 2 rows
function P.sharded_stages(case, schedule, chunks, strategy, W)
  local pp = ms.pp
  local what = ('%s, %s, %s'):format(case[1], schedule, strategy)
  local D = W / 2
  local x, y = FS.lcg_batch(95, 4 * D, 8)
  local ref = P.build(case)
  local l0 = ref(x, y)
  l0:backward()
  local n0 = ms.optim.clip_grad_norm(ref, math.huge)
  local mesh = dist.mesh { replicate = D, shard = 2 }
  local d = mesh.coord[1]
  local m = P.build(case)
  local pipe = pp.pipeline(m, { group = mesh.shard, schedule = schedule, chunks = chunks, microbatches = 4 })
  ms.fsdp.fully_shard(m, { group = mesh.replicate, strategy = strategy,
    policy = ms.fsdp.policy.by_class { case[1] == 'gpt2' and 'GPT2Block' or 'LlamaDecoderLayer' } })
  luassert.is_false(pipe:splits_w())
  local l1 = pipe:step(x:narrow(1, d * 4 + 1, 4):contiguous(), y:narrow(1, d * 4 + 1, 4):contiguous())
  dist.all_reduce(l1, 'avg', { group = mesh.replicate })
  luassert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12, ('%s: %.17g against %.17g'):format(what, l1:item(),
    l0:item()))
  for _, u in ipairs(ms.fsdp.units(m)) do luassert.are.equal('sharded', u.status, what .. ' ' .. u.label) end
  local ref_p = P.params_of(ref)
  local n = 0
  for name, g in pairs(FS.whole_grads(m)) do
    local e = FS.max_rel(g:view(ref_p[name].shape), ref_p[name].grad)
    luassert.is_true(e <= 1e-10, ('%s: %s: %g'):format(what, name, e))
    n = n + 1
  end
  luassert.is_true(n > 0)
  local n1 = pp.clip_grad_norm_(m, math.huge)
  luassert.is_true(FS.rel(n1, n0) <= 1e-11, ('%s: norm %.17g against %.17g'):format(what, n1, n0))
  pipe:free()
  mesh.shard:free(); mesh.replicate:free()
end

return P
