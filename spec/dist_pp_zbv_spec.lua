-- The V-shaped zero-bubble schedule (zbv) and GPipe over chunks
-- (looped_bfs) on CPU ranks (#mpi, 2-4 ranks; one rank: the refusals):
-- a GPT-2 (tied head), a Llama, a tied Llama and a Llama whose head is
-- 3.6 blocks' work (the ranks' cut, pp.rank_balanced, its last chunk the
-- head alone) of 8 blocks, a Mixtral
-- with the load-balancing loss over every stage (output_router_logits)
-- and, at 2 ranks, DeepSeek-V3 with multi-token prediction, in f64: the
-- loss, every stage's gradients and the evaluation are one process's;
-- each rank runs the order pp_order gives it (its trace), and 1f1b and
-- zbh1 run the orders pp_order models them with; under zbv rank 0 holds
-- the embedding and the head (a tied weight once, no copy), zbv's weight
-- gradients run as separate jobs, at most 2S chunks open; AdamW steps,
-- the whole model's state and a one-process checkpoint resumed; a stage
-- under fully_shard (the weight gradients then in the backward); TP pairs
-- inside two stages (4 ranks, with and without sequence parallelism); bad
-- micro-batch counts and chunk counts are errors that name them.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local P = require 'spec.pp_support'
local dist = require 'moonshard.dist'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('zbv and looped BFS pipelines #mpi', function()
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

  -- 8 blocks: 2S virtual stages for S up to 4; the big head's case checks
  -- the ranks' cut (rank_cut)
  local cases, build, params_of = P.cases, P.build, P.params_of
  local function tied_name(case, name)
    return (case[1] == 'gpt2' and name:match('wte')) or (case[1] == 'llama tied' and name:match('embed_tokens'))
  end

  local runs = {
    { 'zbv', function(S) return { 2 * S - 1, 2 * S } end },
    { 'looped_bfs', function() return { 1, 3 } end, chunks = 2 },
  }

  for _, case in ipairs(cases) do
    for _, run in ipairs(runs) do
      it(('%s, %s: the whole model\'s loss, gradients and evaluation (f64); each rank runs pp_order\'s order'):format(
        case[1], run[1]), function()
        if W == 1 then pending('one rank: no pipeline') return end
        for _, M in ipairs(run[2](W)) do
          local what = ('%s, %s, %d micro-batches'):format(case[1], run[1], M)
          local x, y = FS.lcg_batch(60 + M, M, 8)
          local ref = build(case)
          local l0 = ref(x, y)
          l0:backward()
          local m = build(case)
          local pipe = pp.pipeline(m, { schedule = run[1], chunks = run.chunks, microbatches = M })
          assert.are.equal(run[1], pipe.schedule)
          assert.are.equal(2, pipe.chunks)
          if case.rank_cut then
            -- the ranks' cut, which the old one (the virtual stages balanced) is not
            local block_n, head = 0, 0
            for _, p in ipairs(ref:pipeline_parts().blocks[1]:parameters()) do block_n = block_n + p:numel() end
            head = pp.head_weight * 1000 * 24 / block_n
            local want = pp.rank_balanced(8, W, { chunks = 2, layout = O.layout(run[1]), last_cost = head,
              hold = O.holds(run[1], W, M, 2) })
            assert.are.same(want, pipe.layers, what)
            assert.are.equal(0, want[2 * W], what)
            assert.are_not.same(pp.balanced(8, 2 * W, head), pipe.layers, what)
          end
          pipe.trace = {}
          local l1 = pipe:step(x, y)
          assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12, what .. (': %.17g against %.17g'):format(l1:item(),
            l0:item()))
          P.same_order(O.order(run[1], W, R, M, 2), pipe.trace, what)
          local n = P.same_grads(m, ref, what)
          assert.is_true(n > 0)
          -- every parameter on one rank; a tied one on two, but for the V,
          -- which holds the embedding and the head on rank 0
          local counts = ms.tensor({ n })
          dist.all_reduce(counts, 'sum')
          local all, tied = 0, 0
          for name in ref:named_parameters() do
            all = all + 1
            if tied_name(case, name) then tied = tied + 1 end
          end
          assert.are.equal(all + (run[1] == 'zbv' and 0 or tied), counts:item(), what)
          if run[1] == 'zbv' then
            -- rank s holds virtual stages s and 2S - 1 - s
            P.holds_v(pipe, W, R, what)
            assert.is_nil(pipe.tied_group, what)
          end
          pipe.trace = nil
          local e1 = pipe:evaluate(x, y)
          assert.is_true(FS.rel(e1:item(), l0:item()) <= 1e-12, what .. ': evaluate')
          pipe:free()
        end
      end)
    end
  end

  it('zbv: the weight gradients run as their own jobs (none left by the backwards), at most 2S chunks open', function()
    if W == 1 then return end
    local case = cases[2]
    local M = 2 * W
    local x, y = FS.lcg_batch(71, M, 8)
    local m = build(case)
    local pipe = pp.pipeline(m, { schedule = 'zbv', microbatches = M })
    assert.is_true(pipe:splits_w())
    -- (every virtual stage but the first takes its weight gradients out of
    -- each backward: rank 0 for chunk 2 only)
    local most = P.split_w_step(pipe, x, y, M, R)
    assert.is_true(most <= 2 * W, ('%d chunks open on rank %d of %d'):format(most, R, W))
    pipe:free()
  end)

  it('1f1b and zbh1 run the orders pp_order models them with (the simulated bubbles\' orders)', function()
    if W == 1 then return end
    for _, sched in ipairs({ '1f1b', 'zbh1' }) do
      local m = build(cases[2])
      local pipe = pp.pipeline(m, { schedule = sched, microbatches = 2 * W })
      pipe.trace = {}
      pipe:step(FS.lcg_batch(72, 2 * W, 8))
      local want = {}
      for _, op in ipairs(O.order(sched, W, R, 2 * W)) do
        -- (1f1b's weight gradients run inside its backwards: not traced; the
        -- first stage's under zbh1 too)
        if op[1] ~= 'W' or sched == 'zbh1' and R > 0 then want[#want + 1] = op[1] .. op[2] end
      end
      local got = {}
      for _, e in ipairs(pipe.trace) do if not (R == 0 and e:sub(1, 1) == 'W') then got[#got + 1] = e end end
      assert.are.same(want, got, sched)
      pipe:free()
    end
  end)

  it('zbv: AdamW steps with clipping train as the whole model; the whole model\'s state and a one-process checkpoint, resumed', function()
    if W == 1 then return end
    -- (and the gathered optimizer state the whole model's AdamW's)
    for _, case in ipairs({ cases[1], cases[2] }) do P.trains_and_resumes(case, 'zbv', W, true) end
  end)

  it('a Mixtral\'s load-balancing loss over every stage under zbv and looped_bfs: one process accumulating the same micro-batches (f64)', function()
    if W == 1 then pending('one rank: no pipeline') return end
    local cfg = { vocab_size = 257, hidden_size = 24, intermediate_size = 20, num_hidden_layers = 8,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16, num_local_experts = 4,
      num_experts_per_tok = 2, output_router_logits = true, router_aux_loss_coef = 0.5,
      bos_token_id = hf.null, eos_token_id = hf.null }
    local function mixtral()
      ms.manual_seed(7)
      local m = require('models.mixtral').new(cfg):to('f64')
      m:train()
      return m
    end
    for _, run in ipairs({ { 'zbv', 2 * W - 1 }, { 'looped_bfs', 3, chunks = 2 } }) do
      local M = run[2]
      local what = ('mixtral, %s, %d micro-batches'):format(run[1], M)
      local x, y = FS.lcg_batch(91, M, 8)
      local ref, l0 = mixtral(), 0
      for i = 1, M do
        local l = ref(x:narrow(1, i, 1):contiguous(), y:narrow(1, i, 1):contiguous())
        l0 = l0 + l:item() / M
        local scaled = l * (1 / M)
        scaled:backward()
      end
      local m = mixtral()
      local pipe = pp.pipeline(m, { schedule = run[1], chunks = run.chunks, microbatches = M })
      local l1 = pipe:step(x, y)
      assert.is_true(FS.rel(l1:item(), l0) <= 1e-12, ('%s: %.17g against %.17g'):format(what, l1:item(), l0))
      P.same_grads(m, ref, what)
      local e1 = pipe:evaluate(x, y)
      local e0 = 0
      ms.no_grad(function()
        for i = 1, M do e0 = e0 + ref(x:narrow(1, i, 1):contiguous(), y:narrow(1, i, 1):contiguous()):item() / M end
      end)
      assert.is_true(FS.rel(e1:item(), e0) <= 1e-10, what .. ': evaluate')
      pipe:free()
    end
  end)

  it('DeepSeek-V3\'s multi-token prediction under zbv: the depths and the embedding on rank 0, no copy; one process\'s loss, depths and gradients (f64)', function()
    if W ~= 2 then pending('2 ranks') return end
    local cfg = { vocab_size = 257, hidden_size = 48, intermediate_size = 96, moe_intermediate_size = 24,
      num_hidden_layers = 4, num_attention_heads = 12, n_shared_experts = 1, n_routed_experts = 4,
      routed_scaling_factor = 1.5, kv_lora_rank = 16, q_lora_rank = 20, qk_rope_head_dim = 4, v_head_dim = 6,
      qk_nope_head_dim = 4, n_group = 2, topk_group = 1, num_experts_per_tok = 2, first_k_dense_replace = 1,
      max_position_embeddings = 32, bos_token_id = hf.null, eos_token_id = hf.null, mtp_loss_weight = 0.3,
      num_nextn_predict_layers = 2, aux_loss_alpha = 0.05 }
    local function dsv3()
      ms.manual_seed(7)
      local m = require('models.deepseek_v3').new(cfg):to('f64')
      m:train()
      return m
    end
    local x, y = FS.lcg_batch(93, 4, 16)
    local ref = dsv3()
    local l0 = ref(x, y)
    l0:backward()
    local d0 = {}
    for k, v in ipairs(ref:mtp_losses()) do d0[k] = v:item() end
    local m = dsv3()
    local pipe = pp.pipeline(m, { schedule = 'zbv', microbatches = 4 })
    local held = params_of(m)
    assert.are.equal(R == 0, held['model.embed_tokens.weight'] ~= nil)
    assert.are.equal(R == 0, held['model.mtp_layers.0.eh_proj.weight'] ~= nil)
    assert.are.equal(0, #pipe.tied)
    local l1 = pipe:step(x, y)
    assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12, ('%.17g against %.17g'):format(l1:item(), l0:item()))
    local dm = pipe:mtp_losses()
    assert.are.equal(2, #dm)
    for k = 1, #d0 do assert.is_true(FS.rel(dm[k], d0[k]) <= 1e-12, 'depth ' .. k) end
    local ref_p = params_of(ref)
    for name, p in m:named_parameters() do
      local e = FS.max_rel(p.grad, ref_p[name].grad)
      assert.is_true(e <= 1e-10, ('%s: %g'):format(name, e))
    end
    pipe:free()
  end)

  it('zbv and looped_bfs with each stage under fully_shard (2 stages x W / 2): the weight gradients in the backward, the whole model\'s loss, gradients and norm (f64)', function()
    if W ~= 2 and W ~= 4 then pending('2 or 4 ranks') return end
    for _, run in ipairs({ { 'zbv', 'FULL_SHARD' }, { 'zbv', 'SHARD_GRAD_OP' }, { 'looped_bfs', 'FULL_SHARD', chunks = 2 } }) do
      for _, case in ipairs({ cases[1], cases[2] }) do P.sharded_stages(case, run[1], run.chunks, run[2], W) end
    end
  end)

  it('zbv and looped_bfs with TP pairs inside two stages (2 x 2, with and without sequence parallelism): the whole model\'s loss and gradients (f64)', function()
    if W ~= 4 then pending('4 ranks') return end
    local mesh = dist.mesh { replicate = 2, shard = 2 }   -- shard: the TP pairs; replicate: the pipelines
    for _, run in ipairs({ { 'zbv', 3 }, { 'zbv', 4 }, { 'looped_bfs', 4, chunks = 2 } }) do
      for _, case in ipairs({ cases[1], cases[2] }) do
        for _, seq in ipairs({ false, true }) do
          local what = ('%s, %s, %d micro-batches%s'):format(case[1], run[1], run[2], seq and ', sequence parallel' or '')
          local ref = build(case)
          local m = build(case)
          ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = seq })
          local pipe = pp.pipeline(m, { group = mesh.replicate, schedule = run[1], chunks = run.chunks,
            microbatches = run[2] })
          local x, y = FS.lcg_batch(97, run[2], 8)
          local l0 = ref(x, y)
          l0:backward()
          local l1 = pipe:step(x, y)
          assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-11, ('%s: %.17g against %.17g'):format(what, l1:item(),
            l0:item()))
          local ref_p = params_of(ref)
          local n = 0
          for name, g in pairs(ms.tp.full_grads(m)) do
            assert.is_true(FS.max_rel(g, ref_p[name].grad) <= 1e-10, what .. ': ' .. name)
            n = n + 1
          end
          assert.is_true(n > 0)
          local e1 = pipe:evaluate(x, y)
          assert.is_true(FS.rel(e1:item(), l0:item()) <= 1e-11, what .. ': evaluate')
          pipe:free()
        end
      end
    end
    mesh.shard:free()
    mesh.replicate:free()
  end)

  it('bad micro-batch and chunk counts are errors that name them', function()
    local m = build(cases[2])
    if W == 1 then
      assert.has_error(function() pp.pipeline(m, { schedule = 'zbv' }) end,
        'pp.pipeline: 2 chunks a rank need at least 2 stages')
      return
    end
    assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = 'zbv', microbatches = 2 * W - 2 }) end,
      ('pp.pipeline: the zbv schedule needs at least 2 x %d - 1 = %d micro-batches over %d stages (the first rank\'s '
        .. 'warm-up runs that many forwards), got %d'):format(W, 2 * W - 1, W, 2 * W - 2))
    assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = 'zbv', chunks = 3, microbatches = 8 }) end,
      'pp.pipeline: the zbv schedule runs 2 chunks a rank, got chunks = 3')
    assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = 'looped_bfs' }) end,
      'pp.pipeline: the looped_bfs schedule runs over chunks > 1 a rank (with one chunk it is gpipe)')
    assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = 'zbv', overlap = false }) end,
      'pp.pipeline: the zbv schedule splits each backward at the stage\'s input (input_grad_first, with overlap); '
        .. 'got overlap = false, input_grad_first = true')
    assert.has_error(function() pp.pipeline(build(cases[2]), { schedule = '1f1b', chunks = 2 }) end,
      'pp.pipeline: 2 chunks a rank run the interleaved, looped_bfs, zbv or dualpipev schedule, not 1f1b')
    -- the default micro-batches under zbv: 2S
    local pipe = pp.pipeline(m, { schedule = 'zbv' })
    assert.are.equal(2 * W, pipe.microbatches)
    pipe:free()
  end)
end)
