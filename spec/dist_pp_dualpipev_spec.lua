-- DualPipeV (DeepSeek's DualPipe cut in half, torch's ScheduleDualPipeV)
-- on CPU ranks (#mpi, 2-4 ranks; one rank: the refusals), f64: a GPT-2
-- (tied head), a Llama, a tied Llama and a Llama whose head is 3.6
-- blocks' work, 8 blocks, at 2S, 2S + 1 and 3S micro-batches: the loss,
-- every stage's gradients and the evaluation are one process's; each rank
-- runs pp_order's order (its trace); rank 0 holds the embedding and the
-- head; the weight gradients split off run as their own jobs, at most
-- 2S + 1 chunks open (and that many reached); every overlapped pair's
-- gradient that comes over the network is received during its forward
-- (the early receive); AdamW steps with clipping, the whole model's state
-- and a one-process checkpoint resumed; a Mixtral's load-balancing loss;
-- the stages under fully_shard (the weight gradients in the backward);
-- bad micro-batch and chunk counts are errors that name them.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local gpt2 = require 'models.gpt2'
local llama = require 'models.llama'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('dualpipev pipelines #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))
  local pp = ms.pp
  local O = pp.order

  local cases = {
    { 'gpt2', gpt2, { vocab_size = 259, n_positions = 16, n_embd = 24, n_layer = 8, n_head = 4,
      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
    { 'llama', llama, { vocab_size = 257, hidden_size = 24, intermediate_size = 40, num_hidden_layers = 8,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16 } },
    { 'llama tied', llama, { vocab_size = 257, hidden_size = 24, intermediate_size = 40, num_hidden_layers = 8,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16, tie_word_embeddings = true } },
    { 'llama big head', llama, { vocab_size = 1000, hidden_size = 24, intermediate_size = 40, num_hidden_layers = 8,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16 } },
  }
  local function build(case, seed)
    ms.manual_seed(seed or 7)
    local cfg = {}
    for k, v in pairs(case[3]) do cfg[k] = v end
    return case[2].new(cfg):to('f64')
  end
  local function params_of(m)
    local r = {}
    for name, p in m:named_parameters() do r[name] = p end
    return r
  end
  -- the trace of run_order against pp_order's list (kind, micro-batch, chunk)
  local function same_order(want, trace, what)
    assert.are.equal(#want, #trace, what .. ': ops run')
    for n, op in ipairs(want) do
      assert.are.same({ op[1], op[2], op[3] }, trace[n], ('%s: op %d'):format(what, n))
    end
  end

  for _, case in ipairs(cases) do
    it(('%s: the whole model\'s loss, gradients and evaluation (f64); each rank runs pp_order\'s order'):format(case[1]),
      function()
        if W == 1 then pending('one rank: no pipeline') return end
        for _, M in ipairs({ 2 * W, 2 * W + 1, 3 * W }) do
          local what = ('%s, dualpipev, %d micro-batches'):format(case[1], M)
          local x, y = FS.lcg_batch(60 + M, M, 8)
          local ref = build(case)
          local l0 = ref(x, y)
          l0:backward()
          local m = build(case)
          local pipe = pp.pipeline(m, { schedule = 'dualpipev', microbatches = M })
          assert.are.equal('dualpipev', pipe.schedule)
          assert.are.equal(2, pipe.chunks)
          pipe.trace = {}
          local l1 = pipe:step(x, y)
          assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12, what .. (': %.17g against %.17g'):format(l1:item(),
            l0:item()))
          same_order(O.order('dualpipev', W, R, M), pipe.trace, what)
          local ref_p = params_of(ref)
          local n = 0
          for name, p in m:named_parameters() do
            assert.is_not_nil(p.grad, what .. ': no gradient for ' .. name)
            local e = FS.max_rel(p.grad, ref_p[name].grad)
            assert.is_true(e <= 1e-10, ('%s: %s: %g'):format(what, name, e))
            n = n + 1
          end
          assert.is_true(n > 0)
          -- every parameter on one rank, a tied one too (rank 0 holds the
          -- embedding and the head)
          local counts = ms.tensor({ n })
          dist.all_reduce(counts, 'sum')
          local all = 0
          for _ in ref:named_parameters() do all = all + 1 end
          assert.are.equal(all, counts:item(), what)
          assert.are.equal(R == 0, pipe.first, what)
          assert.are.equal(R == 0, pipe.last, what)
          assert.are.equal(0, #pipe.tied, what)
          local L = pipe.layers
          local starts = { 1 }
          for k = 1, #L do starts[k + 1] = starts[k] + L[k] end
          assert.are.same({ starts[R + 1], starts[R + 2] - 1 }, pipe.ranges[1], what)
          assert.are.same({ starts[2 * W - R], starts[2 * W - R + 1] - 1 }, pipe.ranges[2], what)
          pipe.trace = nil
          local e1 = pipe:evaluate(x, y)
          assert.is_true(FS.rel(e1:item(), l0:item()) <= 1e-12, what .. ': evaluate')
          pipe:free()
        end
      end)
  end

  it('the weight gradients run as their own jobs, at most 2S + 1 chunks open; the pairs\' gradients received early', function()
    if W == 1 then return end
    local M = 2 * W + 2
    local x, y = FS.lcg_batch(71, M, 8)
    local m = build(cases[2])
    local pipe = pp.pipeline(m, { schedule = 'dualpipev', microbatches = M })
    assert.is_true(pipe:splits_w())
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
    -- (count the receives posted early)
    local early = 0
    local crecv = pipe.crecv_backward
    pipe.crecv_backward = function(self, rec, e)
      local g, work = crecv(self, rec, e)
      if e and work then early = early + 1 end
      return g, work
    end
    pipe.trace = {}
    local ok, err = pcall(pipe.step, pipe, x, y)
    A.take_deferred = take
    assert(ok, err)
    -- every virtual stage but the first takes its weight gradients out
    assert.are.equal(R == 0 and M or 2 * M, took)
    assert.are.equal(took, ran)
    local open, most = 0, 0
    for _, op in ipairs(pipe.trace) do
      if op[1] == 'F' then open = open + 1 elseif op[1] == 'W' then open = open - 1 end
      most = math.max(most, open)
    end
    assert.are.equal(0, open)
    assert.are.equal(2 * W + 1, most, ('chunks open on rank %d of %d'):format(R, W))
    -- the pairs whose backward's gradient comes from another rank: every
    -- one of them received early (chunk 2's on ranks > 0: rank 0's chunk 2
    -- is the last virtual stage; chunk 1's but on the last rank, the turn)
    local want = 0
    local ops = O.order('dualpipev', W, R, M)
    for n, op in ipairs(ops) do
      if op.overlap then
        local b = ops[n + 1]
        if (b[3] == 2 and R > 0) or (b[3] == 1 and R < W - 1) then want = want + 1 end
      end
    end
    assert.is_true(want > 0)
    assert.are.equal(want, early)
    assert.is_nil(pipe.early)
    pipe:free()
  end)

  it('AdamW steps with clipping train as the whole model; the whole model\'s state and a one-process checkpoint, resumed', function()
    if W == 1 then return end
    for _, case in ipairs({ cases[1], cases[2] }) do
      local ref = build(case)
      local m = build(case)
      local M = 2 * W
      local pipe = pp.pipeline(m, { schedule = 'dualpipev', microbatches = M })
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
        assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-11, ('%s step %d: %.17g against %.17g'):format(case[1], step,
          l1:item(), l0:item()))
        assert.is_true(FS.rel(n1, n0) <= 1e-10, ('%s step %d: norm %.17g against %.17g'):format(case[1], step, n1, n0))
      end
      local ref_p = params_of(ref)
      for name, p in m:named_parameters() do assert.is_true(FS.max_rel(p, ref_p[name]) <= 1e-10, name) end
      local sd = pp.full_state_dict(m)
      for name, t in pairs(ref:state_dict()) do
        assert.is_not_nil(sd[name], name)
        assert.is_true(FS.max_rel(sd[name], t) <= 1e-10, name)
      end
      local msd, osd = pp.full_checkpoint(m, o1, hyper)
      -- into a fresh dualpipev pipeline (another seed): the next step is the whole model's
      local m2 = build(case, 99)
      local pipe2 = pp.pipeline(m2, { schedule = 'dualpipev', microbatches = M })
      pp.load_full_state_dict(m2, msd)
      local o2 = ms.optim.AdamW(m2, { lr = 1 })
      pp.load_full_optimizer_state(m2, o2, osd)
      local x2, y2 = FS.lcg_batch(89, M, 8)
      local l0 = ref(x2, y2)
      l0:backward()
      o0:step()
      local l2 = pipe2:step(x2, y2)
      o2:step()
      assert.is_true(FS.rel(l2:item(), l0:item()) <= 1e-11, case[1] .. ': the resumed step')
      for name, p in m2:named_parameters() do
        assert.is_true(FS.max_rel(p, ref_p[name]) <= 1e-10, case[1] .. ': after the resumed step: ' .. name)
      end
      pipe:free(); pipe2:free()
    end
  end)

  it('with each stage under fully_shard (2 stages x W / 2): the weight gradients in the backward, the whole model\'s loss, gradients and norm (f64)', function()
    if W ~= 2 and W ~= 4 then pending('2 or 4 ranks') return end
    for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP' }) do
      local case = cases[2]
      local what = ('%s, dualpipev, %s'):format(case[1], strategy)
      local D = W / 2
      local x, y = FS.lcg_batch(95, 4 * D, 8)
      local ref = build(case)
      local l0 = ref(x, y)
      l0:backward()
      local n0 = ms.optim.clip_grad_norm(ref, math.huge)
      local mesh = dist.mesh { replicate = D, shard = 2 }
      local d = mesh.coord[1]
      local m = build(case)
      local pipe = pp.pipeline(m, { group = mesh.shard, schedule = 'dualpipev', microbatches = 4 })
      ms.fsdp.fully_shard(m, { group = mesh.replicate, strategy = strategy,
        policy = ms.fsdp.policy.by_class { 'LlamaDecoderLayer' } })
      assert.is_false(pipe:splits_w())
      local l1 = pipe:step(x:narrow(1, d * 4 + 1, 4):contiguous(), y:narrow(1, d * 4 + 1, 4):contiguous())
      dist.all_reduce(l1, 'avg', { group = mesh.replicate })
      assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12, ('%s: %.17g against %.17g'):format(what, l1:item(),
        l0:item()))
      for _, u in ipairs(ms.fsdp.units(m)) do assert.are.equal('sharded', u.status, what .. ' ' .. u.label) end
      local ref_p = params_of(ref)
      local n = 0
      for name, g in pairs(FS.whole_grads(m)) do
        local e = FS.max_rel(g:view(ref_p[name].shape), ref_p[name].grad)
        assert.is_true(e <= 1e-10, ('%s: %s: %g'):format(what, name, e))
        n = n + 1
      end
      assert.is_true(n > 0)
      local n1 = pp.clip_grad_norm_(m, math.huge)
      assert.is_true(FS.rel(n1, n0) <= 1e-11, ('%s: norm %.17g against %.17g'):format(what, n1, n0))
      pipe:free()
      mesh.shard:free(); mesh.replicate:free()
    end
  end)

  it('bad micro-batch and chunk counts are errors that name them', function()
    if W == 1 then
      assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = 'dualpipev' }) end,
        'pp.pipeline: 2 chunks a rank need at least 2 stages')
      return
    end
    assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = 'dualpipev', microbatches = 2 * W - 1 }) end,
      ('pp.pipeline: the dualpipev schedule needs at least 2 x %d = %d micro-batches over %d stages (the last rank\'s '
        .. 'first overlapped pair comes after every rank\'s 2 x %d warm-up forwards), got %d'):format(W, 2 * W, W, W,
        2 * W - 1))
    assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = 'dualpipev', chunks = 3, microbatches = 8 }) end,
      'pp.pipeline: the dualpipev schedule runs 2 chunks a rank, got chunks = 3')
    assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = 'dualpipev', input_grad_first = false }) end,
      'pp.pipeline: the dualpipev schedule splits each backward at the stage\'s input (input_grad_first, with '
        .. 'overlap); got overlap = true, input_grad_first = false')
    -- the default micro-batches: 2S
    local pipe = pp.pipeline(build(cases[2]), { schedule = 'dualpipev' })
    assert.are.equal(2 * W, pipe.microbatches)
    pipe:free()
  end)
end)
