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
local P = require 'spec.pp_support'
local dist = require 'moonshard.dist'

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

  local cases, build = P.cases, P.build

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
          -- (the trace of run_order against pp_order's list: kind, micro-batch, chunk)
          P.same_order(O.order('dualpipev', W, R, M), pipe.trace, what, true)
          local n = P.same_grads(m, ref, what)
          assert.is_true(n > 0)
          -- every parameter on one rank, a tied one too (rank 0 holds the
          -- embedding and the head)
          local counts = ms.tensor({ n })
          dist.all_reduce(counts, 'sum')
          local all = 0
          for _ in ref:named_parameters() do all = all + 1 end
          assert.are.equal(all, counts:item(), what)
          P.holds_v(pipe, W, R, what)
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
    -- (count the receives posted early)
    local early = 0
    local crecv = pipe.crecv_backward
    pipe.crecv_backward = function(self, rec, e)
      local g, work = crecv(self, rec, e)
      if e and work then early = early + 1 end
      return g, work
    end
    -- (every virtual stage but the first takes its weight gradients out)
    local most = P.split_w_step(pipe, x, y, M, R)
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
    for _, case in ipairs({ cases[1], cases[2] }) do P.trains_and_resumes(case, 'dualpipev', W) end
  end)

  it('with each stage under fully_shard (2 stages x W / 2): the weight gradients in the backward, the whole model\'s loss, gradients and norm (f64)', function()
    if W ~= 2 and W ~= 4 then pending('2 or 4 ranks') return end
    for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP' }) do
      P.sharded_stages(cases[2], 'dualpipev', nil, strategy, W)
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
