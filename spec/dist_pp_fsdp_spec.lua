-- FSDP inside pipeline stages (#mpi, 1-4 ranks; torchtitan's FSDP x PP):
-- a GPT-2 (tied head), a Llama (untied head: a head unit of its own) and a
-- tied Llama cut into stages by ms.pp.pipeline, each stage then given to
-- fsdp.fully_shard over the data-parallel ranks that hold the same stage.
-- Against the whole model in one process, in f64: the loss, the gradients gathered
-- from the shards, the clipped norm, under FULL_SHARD, SHARD_GRAD_OP,
-- NO_SHARD and HYBRID_SHARD (each stage's replicas as a mesh), 1F1B, GPipe and the interleaved schedule, one or four
-- micro-batches, reduced once a step or every micro-batch; three AdamW
-- steps with clipping; the one-process checkpoint and its resume;
-- gradient accumulation; tensor-parallel pairs inside the sharded stages.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local gpt2 = require 'models.gpt2'
local llama = require 'models.llama'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('FSDP inside pipeline stages #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local pp, fsdp = ms.pp, ms.fsdp

  local cases = {
    { 'gpt2', gpt2, { vocab_size = 259, n_positions = 16, n_embd = 24, n_layer = 5, n_head = 4,
      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null },
      'GPT2Block' },
    { 'llama', llama, { vocab_size = 257, hidden_size = 24, intermediate_size = 40, num_hidden_layers = 5,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16 }, 'LlamaDecoderLayer' },
    { 'llama tied', llama, { vocab_size = 257, hidden_size = 24, intermediate_size = 40, num_hidden_layers = 5,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16, tie_word_embeddings = true },
      'LlamaDecoderLayer' },
  }
  local function build(case, seed)
    ms.manual_seed(seed or 7)
    local cfg = {}
    for k, v in pairs(case[3]) do cfg[k] = v end
    return case[2].new(cfg):to('f64')
  end

  -- the ways to lay W ranks out: { stages, data-parallel ranks }
  local layouts = {}
  for S = 1, W do if W % S == 0 then layouts[#layouts + 1] = { S, W / S } end end

  -- consecutive ranks form a pipeline; the ranks of one stage across the
  -- pipelines are its FSDP group
  local function groups(S)
    local mesh = dist.mesh { replicate = W / S, shard = S }
    return mesh, mesh.shard, mesh.replicate, mesh.coord[1]
  end

  -- the batch's rows of data-parallel rank d of D
  local function rows(x, d, D)
    local n = x.shape[1] / D
    return x:narrow(1, d * n + 1, n):contiguous()
  end

  local whole_grads = FS.whole_grads

  local function ref_params(ref)
    local r = {}
    for name, p in ref:named_parameters() do r[name] = p end
    return r
  end

  -- HYBRID_SHARD over each stage's D data-parallel ranks (rank d * S +
  -- stage): shard groups of D / 2 (1 for D = 2), replicated across them;
  -- every rank makes every group
  local function hybrid(S, D)
    local Sh = math.max(1, math.floor(D / 2))
    local mine, all = {}, {}
    local function make(list)
      local g = dist.new_group(list)
      all[#all + 1] = g
      return g
    end
    for p = 0, S - 1 do
      for j = 0, D / Sh - 1 do
        local l = {}
        for k = 0, Sh - 1 do l[#l + 1] = (j * Sh + k) * S + p end
        local g = make(l)
        if g:is_member() then mine.shard = g end
      end
      for k = 0, Sh - 1 do
        local l = {}
        for j = 0, D / Sh - 1 do l[#l + 1] = (j * Sh + k) * S + p end
        local g = make(l)
        if g:is_member() then mine.replicate = g end
      end
    end
    mine.free = function() for _, g in ipairs(all) do g:free() end end
    return mine
  end

  local function shard(case, m, dp_group, strategy, mesh)
    fsdp.fully_shard(m, { group = not mesh and dp_group or nil, mesh = mesh,
      policy = fsdp.policy.by_class { case[4] }, strategy = strategy })
  end

  for _, lay in ipairs(layouts) do
    local S, D = lay[1], lay[2]
    for _, case in ipairs(cases) do
      local strategies = { 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }
      if D > 1 then strategies[#strategies + 1] = 'HYBRID_SHARD' end
      for _, strategy in ipairs(strategies) do
        local scheds = { { '1f1b', 1, 'step' }, { '1f1b', 4, 'step' }, { 'gpipe', 4, 'microbatch' } }
        if S > 1 and 2 * S <= 5 then scheds[#scheds + 1] = { 'interleaved', 2 * S, 'step' } end
        for _, sc in ipairs(scheds) do
          it(('%d stages x %d data-parallel, %s, %s, %s, %d micro-batches, reduced every %s: the whole model\'s '
            .. 'loss, gradients and norm'):format(S, D, case[1], strategy, sc[1], sc[2], sc[3]), function()
            local x, y = FS.lcg_batch(3, 4 * D, 10)
            local ref = build(case)
            local l0 = ref(x, y)
            l0:backward()
            local n0 = ms.optim.clip_grad_norm(ref, math.huge)
            local mesh, pg, dg, d = groups(S)
            local m = build(case)
            local pipe = pp.pipeline(m, { group = pg, microbatches = sc[2], chunks = sc[1] == 'interleaved' and 2 or nil,
              schedule = sc[1] ~= 'interleaved' and sc[1] or nil, fsdp_reduce = sc[3] })
            local hy = strategy == 'HYBRID_SHARD' and hybrid(S, D) or nil
            shard(case, m, dg, strategy, hy)
            local l1 = pipe:step(rows(x, d, D), rows(y, d, D))
            dist.all_reduce(l1, 'avg', { group = dg })
            assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12, ('loss %.17g against %.17g'):format(l1:item(), l0:item()))
            -- nothing left gathered after the step, but NO_SHARD's
            for _, u in ipairs(fsdp.units(m)) do
              assert.are.equal(strategy == 'NO_SHARD' and 'unsharded' or 'sharded', u.status, u.label)
            end
            local rp = ref_params(ref)
            local n = 0
            for name, g in pairs(whole_grads(m)) do
              local e = FS.max_rel(g:view(rp[name].shape), rp[name].grad)
              assert.is_true(e <= 1e-10, ('%s: %g'):format(name, e))
              n = n + 1
            end
            assert.is_true(n > 0 or S > 1)
            local n1 = pp.clip_grad_norm_(m, math.huge)
            assert.is_true(FS.rel(n1, n0) <= 1e-11, ('norm %.17g against %.17g'):format(n1, n0))
            pipe:free()
            if hy then hy.free() end
            mesh.shard:free(); mesh.replicate:free()
          end)
        end
      end
    end
  end

  for _, lay in ipairs(layouts) do
    local S, D = lay[1], lay[2]
    for _, case in ipairs(cases) do
      it(('%d stages x %d data-parallel, %s: fsdp.AdamW steps with clipping train as the whole model; the '
        .. 'one-process checkpoint resumes'):format(S, D, case[1]), function()
        local hyper = { lr = 1e-2, weight_decay = 0.1, betas = { 0.9, 0.95 }, eps = 1e-6 }
        local ref = build(case)
        local o0 = ms.optim.AdamW(ref, hyper)
        local mesh, pg, dg, d = groups(S)
        local function make(seed)
          local m = build(case, seed)
          local pipe = pp.pipeline(m, { group = pg, microbatches = 2 })
          shard(case, m, dg, 'FULL_SHARD')
          return m, pipe, fsdp.AdamW(m, hyper)
        end
        local m, pipe, o1 = make()
        for step = 1, 3 do
          local x, y = FS.lcg_batch(3 + step, 2 * D, 8)
          local l0 = ref(x, y)
          l0:backward()
          local n0 = ms.optim.clip_grad_norm(ref, 0.5)
          o0:step(); o0:zero_grad()
          local l1 = pipe:step(rows(x, d, D), rows(y, d, D))
          dist.all_reduce(l1, 'avg', { group = dg })
          local n1 = pp.clip_grad_norm_(m, 0.5, { defer = o1 })
          o1:step(); o1:zero_grad()
          assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-11, ('step %d: loss %.17g against %.17g'):format(step,
            l1:item(), l0:item()))
          assert.is_true(FS.rel(n1, n0) <= 1e-11, ('step %d: norm %.17g against %.17g'):format(step, n1, n0))
        end
        local x, y = FS.lcg_batch(9, 2 * D, 8)
        local e0 = ms.no_grad(function() return ref(x, y) end)
        local e1 = pipe:evaluate(rows(x, d, D), rows(y, d, D))
        dist.all_reduce(e1, 'avg', { group = dg })
        assert.is_true(FS.rel(e1:item(), e0:item()) <= 1e-11, ('eval %.17g against %.17g'):format(e1:item(), e0:item()))
        local msd, osd = pp.full_checkpoint(m, o1, hyper)
        for name, t in pairs(ref:state_dict()) do
          assert.is_not_nil(msd[name], name)
          assert.is_true(FS.max_rel(msd[name], t) <= 1e-10, name)
        end
        local ref_osd = o0:state_dict()
        local nt = 0
        for key, t in pairs(ref_osd.tensors) do
          assert.is_not_nil(osd.tensors[key], key)
          assert.is_true(FS.max_rel(osd.tensors[key], t) <= 1e-10, key)
          nt = nt + 1
        end
        assert.are.equal(#ref_osd.meta.state, #osd.meta.state)
        assert.is_true(nt > 0)
        -- the state dict alone, the same
        local sd = pp.full_state_dict(m)
        for name, t in pairs(msd) do assert.is_true(FS.max_rel(sd[name], t) == 0, name) end
        -- loaded into a fresh sharded pipeline (another seed; weights before
        -- fully_shard, the moments after): the next step is the whole model's
        local m2 = build(case, 99)
        local pipe2 = pp.pipeline(m2, { group = pg, microbatches = 1 })
        pp.load_full_state_dict(m2, msd)
        shard(case, m2, dg, 'SHARD_GRAD_OP')
        local o2 = fsdp.AdamW(m2, { lr = 1 })
        pp.load_full_optimizer_state(m2, o2, osd)
        local x2, y2 = FS.lcg_batch(11, 2 * D, 8)
        local l0 = ref(x2, y2)
        l0:backward()
        o0:step()
        local l2 = pipe2:step(rows(x2, d, D), rows(y2, d, D))
        o2:step()
        dist.all_reduce(l2, 'avg', { group = dg })
        assert.is_true(FS.rel(l2:item(), l0:item()) <= 1e-11)
        local sd2 = pp.full_state_dict(m2)
        for name, t in pairs(ref:state_dict()) do
          assert.is_true(FS.max_rel(sd2[name], t) <= 1e-10, 'after the resumed step: ' .. name)
        end
        pipe:free(); pipe2:free()
        mesh.shard:free(); mesh.replicate:free()
      end)
    end
  end

  it('gradient accumulation: two steps of half the batch (the first without sync) give the batch\'s gradients, tied ones too',
    function()
    local S = W >= 2 and 2 or 1
    if W % S ~= 0 then S = 1 end
    local D = W / S
    for _, case in ipairs({ cases[1], cases[3] }) do
      local x, y = FS.lcg_batch(5, 4 * D, 8)
      local ref = build(case)
      ref(x, y):backward()
      local mesh, pg, dg, d = groups(S)
      local m = build(case)
      local pipe = pp.pipeline(m, { group = pg, microbatches = 2 })
      shard(case, m, dg, 'FULL_SHARD')
      local xs, ys = rows(x, d, D), rows(y, d, D)
      -- half the rows a step, each step's loss scaled by 1/2
      local a1, b1 = xs:narrow(1, 1, 2):contiguous(), ys:narrow(1, 1, 2):contiguous()
      local a2, b2 = xs:narrow(1, 3, 2):contiguous(), ys:narrow(1, 3, 2):contiguous()
      fsdp.no_sync(m, function() pipe:step(a1, b1, { scale = 0.5, sync = false }) end)
      for _, u in ipairs(fsdp.units(m)) do assert.is_nil(u.fp.shard.grad, 'reduced before the last step: ' .. u.label) end
      pipe:step(a2, b2, { scale = 0.5 })
      local rp = ref_params(ref)
      for name, g in pairs(whole_grads(m)) do
        local e = FS.max_rel(g:view(rp[name].shape), rp[name].grad)
        assert.is_true(e <= 1e-10, ('%s %s: %g'):format(case[1], name, e))
      end
      pipe:free()
      mesh.shard:free(); mesh.replicate:free()
    end
  end)

  it('SHARD_GRAD_OP gathers each unit once a step, FULL_SHARD for every micro-batch\'s forward and backward', function()
    local case = cases[2]
    local counts = {}
    for _, strategy in ipairs({ 'SHARD_GRAD_OP', 'FULL_SHARD' }) do
      local mesh, pg, dg, d = groups(1)
      local m = build(case)
      local pipe = pp.pipeline(m, { group = pg, microbatches = 4 })
      shard(case, m, dg, strategy)
      local x, y = FS.lcg_batch(5, 4 * W, 8)
      pipe:step(rows(x, d, W), rows(y, d, W))
      local n, rs = 0, 0
      for _, e in ipairs(fsdp.trace(m)) do
        if e:match('^all_gather') then n = n + 1 end
        if e:match('^reduce_scatter') then rs = rs + 1 end
      end
      counts[strategy] = n
      -- the trace holds the last micro-batch's forward and backward: one
      -- reduce-scatter a unit, in the step's last backward
      assert.are.equal(#fsdp.units(m), rs, strategy)
      pipe:free()
      mesh.shard:free(); mesh.replicate:free()
    end
    -- (the trace restarts at each micro-batch's forward: SHARD_GRAD_OP's
    -- last one gathers nothing, FULL_SHARD's gathers the blocks twice)
    assert.are.equal(0, counts.SHARD_GRAD_OP)
    assert.is_true(counts.FULL_SHARD >= 2 * case[3].num_hidden_layers, tostring(counts.FULL_SHARD))
  end)

  -- (with sequence parallelism: the stages exchange each TP rank's rows,
  -- and the units sum the norms' gradient parts over the TP pair)
  it('with tensor parallelism inside the sharded stages (4 ranks: TP pairs, 2 stages), with and without sequence '
    .. 'parallelism: the whole model\'s training and checkpoint', function()
    if W ~= 4 then return end
    local mesh = dist.mesh { replicate = 2, shard = 2 }   -- shard: the TP pairs; replicate: the pipelines
    local solo = dist.new_group({ dist.rank() })            -- FSDP over one rank (the layout all the same)
    local runs = {}
    for _, on in ipairs({ false, true }) do
      for _, c in ipairs(cases) do runs[#runs + 1] = { c, on } end
    end
    for _, run in ipairs(runs) do
      local case, seq = run[1], run[2]
      local hyper = { lr = 1e-2, weight_decay = 0.1, betas = { 0.9, 0.95 }, eps = 1e-6 }
      local function make(seed)
        local m = build(case, seed)
        ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = seq })
        local pipe = pp.pipeline(m, { group = mesh.replicate, microbatches = 2 })
        return m, pipe
      end
      local ref = build(case)
      local o0 = ms.optim.AdamW(ref, hyper)
      local m, pipe = make()
      shard(case, m, solo, 'FULL_SHARD')
      local o1 = fsdp.AdamW(m, hyper)
      for step = 1, 2 do
        local x, y = FS.lcg_batch(20 + step, 4, 8)
        local l0 = ref(x, y)
        l0:backward()
        local l1 = pipe:step(x, y)
        if step == 1 then assert.are.equal(seq and 2 or 3, #pipe:act_shape()) end
        local n0 = ms.optim.clip_grad_norm(ref, 0.5)
        local n1 = pp.clip_grad_norm_(m, 0.5, { defer = o1 })
        assert.is_true(FS.rel(n1, n0) <= 1e-11, ('%s step %d: norm %.17g against %.17g'):format(case[1], step, n1, n0))
        assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-11, case[1] .. ' loss')
        o0:step(); o0:zero_grad()
        o1:step(); o1:zero_grad()
      end
      local msd, osd = pp.full_checkpoint(m, o1, hyper)
      for name, t in pairs(ref:state_dict()) do
        assert.is_true(FS.max_rel(msd[name], t) <= 1e-10, case[1] .. ' weight ' .. name)
      end
      for key, t in pairs(o0:state_dict().tensors) do
        assert.is_true(FS.max_rel(osd.tensors[key], t) <= 1e-10, case[1] .. ' moment ' .. key)
      end
      local m2, pipe2 = make(99)
      pp.load_full_state_dict(m2, msd)
      shard(case, m2, solo, 'SHARD_GRAD_OP')
      local o2 = fsdp.AdamW(m2, { lr = 1 })
      pp.load_full_optimizer_state(m2, o2, osd)
      local x, y = FS.lcg_batch(31, 4, 8)
      local l0 = ref(x, y)
      l0:backward()
      o0:step()
      local l2 = pipe2:step(x, y)
      o2:step()
      assert.is_true(FS.rel(l2:item(), l0:item()) <= 1e-11, case[1] .. ' resumed loss')
      local sd2 = pp.full_state_dict(m2)
      for name, t in pairs(ref:state_dict()) do
        assert.is_true(FS.max_rel(sd2[name], t) <= 1e-10, case[1] .. ' after the resumed step: ' .. name)
      end
      pipe:free(); pipe2:free()
    end
    solo:free()
    mesh.shard:free(); mesh.replicate:free()
  end)

  it('a step that fails part-way (one rank) leaves the FSDP settings as they were and nothing held; after zero_grad '
    .. 'the next step is right', function()
    if W ~= 1 then return end
    local case = cases[2]
    for _, strategy in ipairs({ 'SHARD_GRAD_OP', 'FULL_SHARD' }) do
      local x, y = FS.lcg_batch(3, 4, 10)
      local mesh, pg, dg = groups(1)
      local m = build(case)
      local pipe = pp.pipeline(m, { group = pg, microbatches = 4 })
      shard(case, m, dg, strategy)
      local st = fsdp.state_of(m)
      local n = 0
      local ok, err = pcall(function()
        pipe:step(x, y, { loss_hook = function(l)
          n = n + 1
          if n == 3 then error('the third micro-batch fails') end
          return l
        end })
      end)
      assert.is_false(ok)
      assert.matches('the third micro-batch fails', tostring(err), 1, true)
      assert.are.equal(true, st.sync, strategy)
      assert.is_falsy(st.hold, strategy)
      assert.is_false(st.in_backward, strategy)
      assert.are.equal(0, ms.autograd.tape_size())
      fsdp.zero_grad(m)
      local ref = build(case)
      ref(x, y):backward()
      pipe:step(x, y)
      local rp = ref_params(ref)
      for name, g in pairs(whole_grads(m)) do
        local e = FS.max_rel(g:view(rp[name].shape), rp[name].grad)
        assert.is_true(e <= 1e-10, ('%s %s: %g'):format(strategy, name, e))
      end
      pipe:free()
      mesh.shard:free(); mesh.replicate:free()
    end
  end)

  it('refuses a model already sharded, and a load into a sharded stage', function()
    local case = cases[2]
    local m = build(case)
    local mesh, pg, dg = groups(1)
    shard(case, m, dg, 'FULL_SHARD')
    assert.has_error(function() pp.pipeline(m, { group = pg }) end,
      'pp.pipeline: the model is under fsdp.fully_shard; cut it first, then shard its stage (docs/pp.md, "FSDP")')
    local m2 = build(case)
    local pipe = pp.pipeline(m2, { group = pg, fsdp_reduce = 'step' })
    local sd = m2:state_dict()
    shard(case, m2, dg, 'FULL_SHARD')
    assert.has_error(function() pp.load_full_state_dict(m2, sd) end)
    assert.has_error(function() pp.pipeline(build(case), { group = pg, fsdp_reduce = 'never' }) end,
      'pp.pipeline: fsdp_reduce must be step or microbatch, got never')
    local m3 = build(case)
    local pipe3 = pp.pipeline(m3, { group = pg })
    fsdp.fully_shard(m3, { group = dg, policy = fsdp.policy.by_class { case[4] }, offload = true })
    local x, y = FS.lcg_batch(3, 2, 8)
    assert.has_error(function() pipe3:step(x, y) end, 'pp: a stage under fully_shard with offload = true is not supported')
    pipe3:free()
    local m4 = build(case)
    local pipe4 = pp.pipeline(m4, { group = pg, schedule = 'zbh1' })
    shard(case, m4, dg, 'FULL_SHARD')
    assert.has_error(function() pipe4:step(x, y) end, 'pp: the zbh1 schedule cannot run a stage under '
      .. 'fsdp.fully_shard (its units reduce at the end of each backward, before the weight gradients zbh1 runs '
      .. 'later); use 1f1b')
    pipe4:free()
    pipe:free()
    mesh.shard:free(); mesh.replicate:free()
  end)
end)
