-- Pipeline parallelism on CPU ranks (#mpi, 1-4 ranks): a GPT-2 (tied head)
-- and a Llama (untied, and tied) cut into stages by ms.pp.pipeline compute
-- the whole model's loss and gradients under both schedules, in f64; AdamW
-- steps train as the whole model; a 2 x 2 mesh adds data parallelism;
-- evaluation matches; bad inputs are errors that name the shapes.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local gpt2 = require 'models.gpt2'
local llama = require 'models.llama'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('pipeline parallelism #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 60 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))
  local pp = ms.pp

  -- 5 blocks: uneven over 2-4 stages
  local cases = {
    { 'gpt2', gpt2, { vocab_size = 259, n_positions = 16, n_embd = 24, n_layer = 5, n_head = 4,
      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
    { 'llama', llama, { vocab_size = 257, hidden_size = 24, intermediate_size = 40, num_hidden_layers = 5,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16 } },
    { 'llama tied', llama, { vocab_size = 257, hidden_size = 24, intermediate_size = 40, num_hidden_layers = 5,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16, tie_word_embeddings = true } },
  }
  local function build(case, seed)
    ms.manual_seed(seed or 7)
    local cfg = {}
    for k, v in pairs(case[3]) do cfg[k] = v end
    return case[2].new(cfg):to('f64')
  end

  for _, case in ipairs(cases) do
    for _, sched in ipairs({ '1f1b', 'gpipe', '1f1b, no overlap', 'zbh1' }) do
      for _, M in ipairs({ 1, 4 }) do
        it(('%s, %s, %d micro-batches: loss and this stage\'s gradients are the whole model\'s (f64)'):format(
          case[1], sched, M), function()
          local x, y = FS.lcg_batch(3, 4, 10)
          local ref = build(case)
          local l0 = ref(x, y)
          l0:backward()
          local m = build(case)
          local pipe = pp.pipeline(m, { microbatches = M, schedule = sched:match('^%w+'),
            overlap = not sched:find('no overlap', 1, true) })
          local l1 = pipe:step(x, y)
          -- every micro-batch has the same number of targets: the mean of
          -- their means is the batch's mean
          assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12, ('%.17g against %.17g'):format(l1:item(), l0:item()))
          local ref_p = {}
          for name, p in ref:named_parameters() do ref_p[name] = p end
          local n = 0
          for name, p in m:named_parameters() do
            assert.is_not_nil(p.grad, name)
            local e = FS.max_rel(p.grad, ref_p[name].grad)
            assert.is_true(e <= 1e-10, ('%s: %g'):format(name, e))
            n = n + 1
          end
          assert.is_true(n > 0)
          -- every parameter is on exactly one stage, the tied ones on two
          local counts = ms.tensor({ n })
          dist.all_reduce(counts, 'sum')
          local all, tied = 0, 0
          for name in ref:named_parameters() do
            all = all + 1
            if case[1] ~= 'llama' and name:match('embed_tokens') or name:match('wte') then tied = tied + 1 end
          end
          assert.are.equal(all + (W > 1 and tied or 0), counts:item())
          pipe:free()
        end)
      end
    end

    it(case[1] .. ': AdamW steps with clipping train as the whole model, evaluation included (f64)', function()
      local ref = build(case)
      local m = build(case)
      local pipe = pp.pipeline(m, { microbatches = 2 })
      local hyper = { lr = 1e-2, weight_decay = 0.1, betas = { 0.9, 0.95 }, eps = 1e-8 }
      local o0 = ms.optim.AdamW(ref, hyper)
      local o1 = ms.optim.AdamW(m, hyper)
      for step = 1, 3 do
        local x, y = FS.lcg_batch(3 + step, 4, 8)
        local l0 = ref(x, y)
        l0:backward()
        ms.optim.clip_grad_norm(ref, 0.5)
        o0:step()
        o0:zero_grad()
        local l1 = pipe:step(x, y)
        pp.clip_grad_norm_(m, 0.5)
        o1:step()
        o1:zero_grad()
        assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-11, ('step %d: %.17g against %.17g'):format(step,
          l1:item(), l0:item()))
      end
      local x, y = FS.lcg_batch(9, 4, 8)
      local e0 = ms.no_grad(function() return ref(x, y) end)
      local e1 = pipe:evaluate(x, y)
      assert.is_true(FS.rel(e1:item(), e0:item()) <= 1e-11, ('eval %.17g against %.17g'):format(e1:item(), e0:item()))
      local ref_p = {}
      for name, p in ref:named_parameters() do ref_p[name] = p end
      for name, p in m:named_parameters() do
        assert.is_true(FS.max_rel(p, ref_p[name]) <= 1e-10, name)
      end
      -- the whole model's state dict gathered on every stage
      local sd = pp.full_state_dict(m)
      for name, t in pairs(ref:state_dict()) do
        assert.is_not_nil(sd[name], name)
        assert.is_true(FS.max_rel(sd[name], t) <= 1e-10, name)
      end
      -- a one-process checkpoint: the whole model's optimizer state, as the
      -- whole model's AdamW holds it, index for index
      local msd, osd = pp.full_checkpoint(m, o1, hyper)
      local ref_osd = o0:state_dict()
      local nt = 0
      for key, t in pairs(ref_osd.tensors) do
        assert.is_not_nil(osd.tensors[key], key)
        assert.is_true(FS.max_rel(osd.tensors[key], t) <= 1e-10, key)
        nt = nt + 1
      end
      assert.are.equal(#ref_osd.meta.state, #osd.meta.state)
      assert.is_true(nt > 0)
      -- loaded into a fresh pipeline (another seed): the next step is the whole model's
      local m2 = build(case, 99)
      local pipe2 = pp.pipeline(m2, { microbatches = 4 })
      pp.load_full_state_dict(m2, msd)
      local o2 = ms.optim.AdamW(m2, { lr = 1 })
      pp.load_full_optimizer_state(m2, o2, osd)
      local x2, y2 = FS.lcg_batch(11, 4, 8)
      local l0 = ref(x2, y2)
      l0:backward()
      o0:step()
      local l2 = pipe2:step(x2, y2)
      o2:step()
      assert.is_true(FS.rel(l2:item(), l0:item()) <= 1e-11)
      for name, p in m2:named_parameters() do
        assert.is_true(FS.max_rel(p, ref_p[name]) <= 1e-10, 'after the resumed step: ' .. name)
      end
      pipe:free()
      pipe2:free()
    end)
  end

  it('interleaved 1F1B (2 and 4 chunks a rank): the whole model\'s loss, gradients and evaluation (f64)', function()
    if W == 1 then
      assert.has_error(function() pp.pipeline(build(cases[1]), { chunks = 2 }) end,
        'pp.pipeline: 2 chunks a rank need at least 2 stages')
      return
    end
    for _, case in ipairs(cases) do
      for _, v in ipairs({ 2, 4 }) do
        if W * v <= 8 then
          local function build8(seed)
            ms.manual_seed(seed or 7)
            local cfg = {}
            for k, val in pairs(case[3]) do cfg[k] = val end
            if cfg.n_layer then cfg.n_layer = 8 else cfg.num_hidden_layers = 8 end
            return case[2].new(cfg):to('f64')
          end
          for _, M in ipairs({ W, 2 * W }) do
            local x, y = FS.lcg_batch(40 + M, 2 * W, 8)
            local ref = build8()
            local l0 = ref(x, y)
            l0:backward()
            local m = build8()
            local pipe = pp.pipeline(m, { chunks = v, microbatches = M })
            assert.are.equal('interleaved', pipe.schedule)
            assert.are.equal(v, #pipe.ranges)
            local l1 = pipe:step(x, y)
            local what = ('%s, %d chunks, %d micro-batches'):format(case[1], v, M)
            assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12, what .. (': %.17g against %.17g'):format(l1:item(), l0:item()))
            local ref_p = {}
            for name, p in ref:named_parameters() do ref_p[name] = p end
            for name, p in m:named_parameters() do
              assert.is_true(FS.max_rel(p.grad, ref_p[name].grad) <= 1e-10, what .. ': ' .. name)
            end
            local e1 = pipe:evaluate(x, y)
            assert.is_true(FS.rel(e1:item(), l0:item()) <= 1e-12, what .. ': evaluate')
            pipe:free()
          end
        end
      end
    end
    assert.has_error(function() pp.pipeline(build(cases[1]), { chunks = 2, microbatches = W + 1 }) end,
      ('pp.pipeline: the interleaved schedule needs micro-batches in multiples of the %d stages, got %d'):format(W, W + 1))
    assert.has_error(function() pp.pipeline(build(cases[1]), { chunks = 2, schedule = 'gpipe' }) end,
      'pp.pipeline: 2 chunks a rank run the interleaved, looped_bfs, zbv or dualpipev schedule, not gpipe')
  end)

  it('input_grad_first: the stages after the first defer their weight gradients past the input\'s send; the same bits', function()
    if W == 1 then return end
    for _, case in ipairs(cases) do
      local x, y = FS.lcg_batch(51, 4, 8)
      local grads, counts = {}, {}
      for k, on in ipairs({ true, false }) do
        local m = build(case)
        local pipe = pp.pipeline(m, { microbatches = 2, input_grad_first = on })
        local c0 = ms.autograd.defer_counts().deferred
        pipe:step(x, y)
        counts[k] = ms.autograd.defer_counts().deferred - c0
        grads[k] = {}
        for name, p in m:named_parameters() do grads[k][name] = p.grad end
        pipe:free()
      end
      if R == 0 then assert.are.equal(0, counts[1], case[1]) else assert.is_true(counts[1] > 0, case[1]) end
      assert.are.equal(0, counts[2], case[1])
      for name, g in pairs(grads[1]) do assert.are.equal(0, FS.max_rel(g, grads[2][name]), case[1] .. ' ' .. name) end
    end
  end)

  -- ZB-H1's order on stage s, from 1F1B's trace: after each backward the
  -- weight gradients of the oldest backwards run until s are left, the rest
  -- after the last backward (the first stage takes no weight gradients out)
  local function zbh1_order(trace_1f1b, s, first)
    local r, pending = {}, {}
    for _, e in ipairs(trace_1f1b) do
      r[#r + 1] = e
      if e:sub(1, 1) == 'B' and not first then
        pending[#pending + 1] = 'W' .. e:sub(2)
        while #pending > s do r[#r + 1] = table.remove(pending, 1) end
      end
    end
    for _, w in ipairs(pending) do r[#r + 1] = w end
    return r
  end

  it('zbh1: 1F1B\'s forwards and backwards, each micro-batch\'s weight gradients `stage` backwards later; the same bits as 1f1b',
    function()
    if W == 1 then return end
    for _, case in ipairs(cases) do
      for _, ac in ipairs({ false, true }) do
        local x, y = FS.lcg_batch(52, 6, 8)
        local grads, traces, losses = {}, {}, {}
        for k, sched in ipairs({ '1f1b', 'zbh1' }) do
          local m = build(case)
          if ac then m = m:to('f32'); ms.nn.functional.set_precision(m, { compute = 'bf16' }) end
          local pipe = pp.pipeline(m, { microbatches = 6, schedule = sched })
          pipe.trace = {}
          losses[k] = pipe:step(x, y):item()
          traces[k] = pipe.trace
          grads[k] = {}
          for name, p in m:named_parameters() do grads[k][name] = p.grad end
          pipe:free()
        end
        local what = case[1] .. (ac and ', bf16 autocast' or '')
        assert.are.equal(losses[1], losses[2], what)
        assert.are.same(zbh1_order(traces[1], R, R == 0), traces[2], what)
        if R > 0 then
          local nw = 0
          for _, e in ipairs(traces[2]) do if e:sub(1, 1) == 'W' then nw = nw + 1 end end
          assert.are.equal(6, nw, what)
        end
        -- begun and not through the weight gradients: at most the stages
        local open, most = 0, 0
        for _, e in ipairs(traces[2]) do
          local c = e:sub(1, 1)
          if c == 'F' then open = open + 1 elseif c == 'W' or (c == 'B' and R == 0) then open = open - 1 end
          most = math.max(most, open)
        end
        assert.is_true(most <= W, ('%s: %d micro-batches open on stage %d of %d'):format(what, most, R, W))
        for name, g in pairs(grads[1]) do assert.are.equal(0, FS.max_rel(g, grads[2][name]), what .. ' ' .. name) end
      end
    end
  end)

  it('gradient accumulation: two steps of half the batch (the first with sync = false) give the batch\'s gradients, tied ones too', function()
    local case = cases[1]
    local x, y = FS.lcg_batch(13, 8, 10)
    local ref = build(case)
    ref(x, y):backward()
    local m = build(case)
    local pipe = pp.pipeline(m, { microbatches = 2 })
    local l1 = pipe:step(x:narrow(1, 1, 4):contiguous(), y:narrow(1, 1, 4):contiguous(), { scale = 0.5, sync = false })
    local l2 = pipe:step(x:narrow(1, 5, 4):contiguous(), y:narrow(1, 5, 4):contiguous(), { scale = 0.5 })
    assert.is_true(l1:item() > 0 and l2:item() > 0)
    local ref_p = {}
    for name, p in ref:named_parameters() do ref_p[name] = p end
    for name, p in m:named_parameters() do
      assert.is_true(FS.max_rel(p.grad, ref_p[name].grad) <= 1e-10, name)
    end
    pipe:free()
  end)

  it('the model\'s precision (set_precision bf16) holds in every stage: the whole model\'s autocast loss and gradients', function()
    local case = cases[2]
    local x, y = FS.lcg_batch(17, 4, 10)
    local ref = ms.nn.functional.set_precision(build(case):to('f32'), { compute = 'bf16' })
    local l0 = ref(x, y)
    l0:backward()
    local m = build(case):to('f32')
    local pipe = pp.pipeline(m, { microbatches = 1 })
    ms.nn.functional.set_precision(m, { compute = 'bf16' })
    local l1 = pipe:step(x, y)
    -- one micro-batch: the same products in the same order, so the same bits
    assert.are.equal(l0:item(), l1:item())
    local ref_p = {}
    for name, p in ref:named_parameters() do ref_p[name] = p end
    for name, p in m:named_parameters() do assert.are.equal(0, FS.max_rel(p.grad, ref_p[name].grad), name) end
    pipe:free()
  end)

  it('a 2 x 2 mesh: two pipelines of two stages, data parallel across them (f64)', function()
    if W ~= 4 then return end
    local case = cases[1]
    local mesh = dist.mesh { replicate = 2, shard = 2 }
    local ref = build(case)
    local x, y = FS.lcg_batch(5, 8, 10)
    local l0 = ref(x, y)
    l0:backward()
    local m = build(case)
    local pipe = pp.pipeline(m, { group = mesh.shard, microbatches = 2 })
    -- this pipeline's half of the batch
    local half = mesh.coord[1]
    local xs, ys = x:narrow(1, half * 4 + 1, 4):contiguous(), y:narrow(1, half * 4 + 1, 4):contiguous()
    local l1 = pipe:step(xs, ys)
    dist.all_reduce(l1, 'avg', { group = mesh.replicate })
    for _, p in ipairs(m:parameters()) do dist.all_reduce(p.grad, 'avg', { group = mesh.replicate }) end
    assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12)
    local ref_p = {}
    for name, p in ref:named_parameters() do ref_p[name] = p end
    for name, p in m:named_parameters() do
      assert.is_true(FS.max_rel(p.grad, ref_p[name].grad) <= 1e-10, name)
    end
    pipe:free()
    mesh.shard:free()
    mesh.replicate:free()
  end)

  -- every case without and with sequence parallelism: { case, on }
  local function with_sp(list)
    local out = {}
    for _, on in ipairs({ false, true }) do
      for _, c in ipairs(list) do out[#out + 1] = { c, on } end
    end
    return out
  end

  -- (with sequence parallelism the stages exchange each TP rank's rows of
  -- the stream: (mb·T / 2, C))
  it('with tensor parallelism inside the stages (2 x 2: TP pairs, 2 stages), with and without sequence parallelism: '
    .. 'the whole model\'s training and checkpoints (f64)', function()
    if W ~= 4 then return end
    local mesh = dist.mesh { replicate = 2, shard = 2 }   -- shard: the TP pairs; replicate: the pipelines
    for _, cs in ipairs(with_sp(cases)) do
      local case, seq = cs[1], cs[2]
      local function make(seed)
        local m = build(case, seed)
        ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = seq })
        local pipe = pp.pipeline(m, { group = mesh.replicate, microbatches = 2 })
        return m, pipe
      end
      local hyper = { lr = 1e-2, weight_decay = 0.1, betas = { 0.9, 0.95 }, eps = 1e-8 }
      local ref = build(case)
      local m, pipe = make()
      local o0, o1 = ms.optim.AdamW(ref, hyper), ms.optim.AdamW(m, hyper)
      local ref_p = {}
      for name, p in ref:named_parameters() do ref_p[name] = p end
      for step = 1, 2 do
        local x, y = FS.lcg_batch(20 + step, 4, 8)
        local l0 = ref(x, y)
        l0:backward()
        local l1 = pipe:step(x, y)
        if step == 1 then
          assert.are.same(seq and { 2 * 8 / 2, m.config.n_embd or m.config.hidden_size }
            or { 2, 8, m.config.n_embd or m.config.hidden_size }, pipe:act_shape())
          -- the gradients, gathered over the TP pair, are the whole model's
          for name, g in pairs(ms.tp.full_grads(m)) do
            assert.is_true(FS.max_rel(g, ref_p[name].grad) <= 1e-10, case[1] .. ' gradient ' .. name)
          end
        end
        local n0 = ms.optim.clip_grad_norm(ref, 0.5)
        local n1 = pp.clip_grad_norm_(m, 0.5)
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
      -- loaded into a fresh 2 x 2 model (another seed): the next step is the whole model's
      local m2, pipe2 = make(99)
      pp.load_full_state_dict(m2, msd)
      local o2 = ms.optim.AdamW(m2, { lr = 1 })
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
      pipe:free()
      pipe2:free()
    end
    mesh.shard:free()
    mesh.replicate:free()
  end)

  it('zbh1 with TP pairs inside two stages (2 x 2, with and without sequence parallelism): the TP entries run the '
    .. 'weight gradients beside their collectives, in the walk; the whole model\'s loss and gradients (f64)', function()
    if W ~= 4 then return end
    local mesh = dist.mesh { replicate = 2, shard = 2 }
    for _, cs in ipairs(with_sp(cases)) do
      local case, seq = cs[1], cs[2]
      local ref = build(case)
      local m = build(case)
      ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = seq })
      local pipe = pp.pipeline(m, { group = mesh.replicate, microbatches = 4, schedule = 'zbh1' })
      pipe.trace = {}
      local x, y = FS.lcg_batch(41, 4, 8)
      local l0 = ref(x, y)
      l0:backward()
      local l1 = pipe:step(x, y)
      assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-11, case[1] .. ' loss')
      local ref_p = {}
      for name, p in ref:named_parameters() do ref_p[name] = p end
      for name, g in pairs(ms.tp.full_grads(m)) do
        assert.is_true(FS.max_rel(g, ref_p[name].grad) <= 1e-10, case[1] .. ' gradient ' .. name)
      end
      -- (the first block's entry ran the queue: nothing was left for the stage input to take)
      local nw = 0
      for _, e in ipairs(pipe.trace) do if e:sub(1, 1) == 'W' then nw = nw + 1 end end
      assert.are.equal(0, nw, case[1])
      pipe:free()
    end
    mesh.shard:free()
    mesh.replicate:free()
  end)

  it('a model built under deferred_init makes only this stage\'s parameters', function()
    local case = cases[2]
    ms.manual_seed(7)
    local cfg = {}
    for k, v in pairs(case[3]) do cfg[k] = v end
    local m = ms.nn.deferred_init(function() return case[2].new(cfg) end)
    local pipe = pp.pipeline(m)
    ms.nn.materialize(m)
    m:to('f64')
    local ref = build(case)
    local ref_p = {}
    for name, p in ref:named_parameters() do ref_p[name] = p end
    local mine = 0
    for name, p in m:named_parameters() do
      assert.are.equal(0, FS.max_rel(p, ref_p[name]), name)
      mine = mine + p:numel()
    end
    local all = 0
    for _, p in ipairs(ref:parameters()) do all = all + p:numel() end
    if W > 1 then assert.is_true(mine < all) else assert.are.equal(all, mine) end
    local x, y = FS.lcg_batch(3, 12, 6)
    local l0 = ref(x, y)
    assert.is_true(FS.rel(pipe:step(x, y):item(), l0:item()) <= 1e-12)
    pipe:free()
  end)

  it('a step that fails part-way drops what its micro-batches recorded; the next step is right (one rank)', function()
    if W ~= 1 then return end
    local case = cases[2]
    local x, y = FS.lcg_batch(3, 4, 10)
    local m = build(case)
    local pipe = pp.pipeline(m, { microbatches = 4 })
    ms.autograd.clear_tape()   -- (what earlier tests' forwards left)
    collectgarbage()
    local before = ms.live_storages()
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
    assert.are.equal(0, ms.autograd.tape_size())
    m:zero_grad()
    collectgarbage()
    assert.is_true(ms.live_storages() <= before + 2, ('%d storages live, %d before'):format(ms.live_storages(), before))
    local ref = build(case)
    local l0 = ref(x, y)
    l0:backward()
    local l1 = pipe:step(x, y)
    assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-12)
    local ref_p = {}
    for name, p in ref:named_parameters() do ref_p[name] = p end
    for name, p in m:named_parameters() do assert.is_true(FS.max_rel(p.grad, ref_p[name].grad) <= 1e-10, name) end
    pipe:free()
  end)

  it('refuses what it cannot cut or run, naming the numbers', function()
    local case = cases[1]
    if W > 1 then
      assert.has_error(function() pp.pipeline(build(case), { layers = { 5 } }) end,
        ('pp.pipeline: layers must list the blocks of each of the %d stages, got 1 entries'):format(W))
    end
    if W == 1 then
      assert.has_error(function() pp.pipeline(build(case), { layers = { 4 } }) end,
        'pp.pipeline: layers {4} add up to 4 blocks but the model has 5')
    end
    assert.has_error(function() pp.pipeline(build(case), { schedule = 'zb' }) end,
      'pp.pipeline: schedule must be 1f1b, zbh1 or gpipe (or interleaved, with chunks > 1), got zb')
    assert.has_error(function() pp.pipeline(build(case), { schedule = 'zbh1', overlap = false }) end,
      'pp.pipeline: the zbh1 schedule splits each backward at the stage\'s input (input_grad_first, with overlap); '
      .. 'got overlap = false, input_grad_first = true')
    assert.has_error(function() pp.pipeline({}) end,
      'pp.pipeline: the model has no pipeline_parts() (GPT-2 and Llama have it; docs/pp.md says what it returns)')
    local m = build(case)
    local pipe = pp.pipeline(m, { microbatches = 2 })
    assert.has_error(function() pp.pipeline(m) end, 'pp.pipeline: the model is already cut into stages')
    local okl, errl = pcall(pp.load_full_state_dict, m, {})
    assert.is_false(okl)
    assert.matches('pp.load_full_state_dict: missing from the state dict', tostring(errl), 1, true)
    local x, y = FS.lcg_batch(3, 3, 6)
    assert.has_error(function() pipe:step(x, y) end, 'pp step: the batch of 3 sequences does not split into 2 micro-batches')
    assert.has_error(function() pipe:step(nil, y) end,
      'pp step: every stage needs the batch\'s input_ids, a (B, T) tensor (its shape sets the activations\' shape), got nil')
    if pipe.last then
      local x2, y2 = FS.lcg_batch(3, 2, 6)
      assert.has_error(function() pipe:step(x2, y2:narrow(2, 1, 5)) end,
        'pp step: the last stage needs targets of shape (2, 6) like input_ids, got shape (2, 5)')
    end
    pipe:free()
  end)
end)
