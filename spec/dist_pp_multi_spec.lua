-- Point-to-point and pipeline parallelism on GPUs over NCCL (#multi:
-- tools/run_multi_specs.sh on a host with 2 or more GPUs). The CPU specs
-- over MPI (spec/dist_p2p_spec.lua, spec/dist_pp_spec.lua, #mpi) hold the
-- exact checks; this file runs the same code with CUDA tensors: batches of
-- sends and receives as one NCCL group, the three schedules against the whole
-- model on the same GPU (f32 within 1e-4: the micro-batches' GEMMs may take
-- other algorithms than the batch's), bf16 autocast with one micro-batch
-- (the same kernels: the same bits), TP pairs inside two stages on 4 GPUs,
-- FSDP inside the stages (2 x 2 on 4 GPUs: the gradients gathered from the
-- shards), and a step's allocated memory flat from step 2.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local S = require 'spec.support'
local dist = require 'moonshard.dist'
local gpt2 = require 'models.gpt2'
local llama = require 'models.llama'
local hf = require 'models.hf'

local launched = os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda'

local function val(r, i, k) return ((r * 7 + i * 3 + k * 5) % 23) - 11 end

describe('point-to-point and pipelines on GPUs (NCCL) #multi', function()
  if not launched then
    it('runs under the launcher on GPUs (tools/run_multi_specs.sh)', function() pending('not launched with --device cuda') end)
    return
  end
  setup(function() dist.init { timeout = tonumber(os.getenv('MS_MULTI_TIMEOUT') or 300) } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('WORLD_SIZE'))
  local R = tonumber(os.getenv('RANK'))

  it('passes a ring of messages and exchanges both ways in one batch (f32, bf16, f8 bytes)', function()
    local nxt, prev = (R + 1) % W, (R - 1 + W) % W
    for k, dtype in ipairs({ 'f32', 'bf16', 'f8e4m3' }) do
      for _, n in ipairs({ 1, 1001, 1048576 }) do
        local v = {}
        for i = 0, n - 1 do v[i + 1] = val(R, i % 97, k) end
        local out = ms.tensor(v, { dtype = 'f32' }):cuda():to(dtype)
        local inb = ms.empty({ n }, { dtype = dtype, device = 'cuda' })
        local back = ms.empty({ n }, { dtype = dtype, device = 'cuda' })
        -- to the next rank and back from it at once: a send and a receive between the same ranks in one group
        dist.batch_p2p({ { 'send', out, nxt }, { 'send', out, prev }, { 'recv', inb, prev }, { 'recv', back, nxt } })
        local got, got2 = inb:to('f32'):cpu():totable(), back:to('f32'):cpu():totable()
        for i = 1, math.min(n, 200) do
          assert.are.equal(val(prev, (i - 1) % 97, k), got[i], ('%s x %d element %d from rank %d'):format(dtype, n, i, prev))
          assert.are.equal(val(nxt, (i - 1) % 97, k), got2[i], ('%s x %d element %d from rank %d'):format(dtype, n, i, nxt))
        end
      end
    end
  end)

  local cases = {
    { 'gpt2', gpt2, { vocab_size = 515, n_positions = 64, n_embd = 64, n_layer = 4, n_head = 4,
      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
    { 'llama', llama, { vocab_size = 515, hidden_size = 64, intermediate_size = 128, num_hidden_layers = 4,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64 } },
  }
  local function build(case)
    ms.manual_seed(5)
    return case[2].new(case[3])
  end
  local function batch(seed)
    local x, y = FS.lcg_batch(seed, 8, 48)
    return x:cuda(), y:cuda()
  end

  for _, case in ipairs(cases) do
    for _, sched in ipairs({ '1f1b', 'gpipe', 'zbh1' }) do
      it(('%s, %s, 4 micro-batches: the whole model\'s loss and gradients (f32)'):format(case[1], sched), function()
        local x, y = batch(3)
        local ref = build(case):to('cuda')
        local l0 = ref(x, y)
        l0:backward()
        local m = build(case)
        local pipe = ms.pp.pipeline(m, { microbatches = 4, schedule = sched })
        m:to('cuda')
        local l1 = pipe:step(x, y)
        assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-5, ('%.9g against %.9g'):format(l1:item(), l0:item()))
        local ref_p = {}
        for name, p in ref:named_parameters() do ref_p[name] = p end
        for name, p in m:named_parameters() do
          local e = FS.norm_rel(p.grad, ref_p[name].grad)
          assert.is_true(e <= 1e-4, ('%s: %g'):format(name, e))
        end
        pipe:free()
      end)
    end
  end

  it('interleaved 1F1B, 2 chunks a rank (a ring over NCCL): the whole model\'s loss and gradients (f32)', function()
    for _, case in ipairs(cases) do
      local cfg = {}
      for k, v in pairs(case[3]) do cfg[k] = v end
      if cfg.n_layer then cfg.n_layer = 8 else cfg.num_hidden_layers = 8 end
      local c8 = { case[1], case[2], cfg }
      local x, y = batch(7)
      local ref = build(c8):to('cuda')
      local l0 = ref(x, y)
      l0:backward()
      local m = build(c8)
      local pipe = ms.pp.pipeline(m, { chunks = 2, microbatches = 8 })
      m:to('cuda')
      local l1 = pipe:step(x, y)
      assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-5, ('%s: %.9g against %.9g'):format(case[1], l1:item(), l0:item()))
      local ref_p = {}
      for name, p in ref:named_parameters() do ref_p[name] = p end
      for name, p in m:named_parameters() do
        local e = FS.norm_rel(p.grad, ref_p[name].grad)
        assert.is_true(e <= 1e-4, ('%s %s: %g'):format(case[1], name, e))
      end
      pipe:free()
    end
  end)

  -- (with sequence parallelism the stages exchange each TP rank's rows)
  it('TP pairs inside two stages (4 GPUs), with and without sequence parallelism: the whole model\'s loss and '
    .. 'gathered gradients (f32)', function()
    if W ~= 4 then return end
    local mesh = dist.mesh { replicate = 2, shard = 2 }
    local runs = {}
    for _, on in ipairs({ false, true }) do
      for _, c in ipairs(cases) do runs[#runs + 1] = { c, on } end
    end
    for _, run in ipairs(runs) do
      local case, seq = run[1], run[2]
      local x, y = batch(5)
      local ref = build(case):to('cuda')
      local l0 = ref(x, y)
      l0:backward()
      local m = build(case)
      ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = seq })
      local pipe = ms.pp.pipeline(m, { group = mesh.replicate, microbatches = 4 })
      m:to('cuda')
      local l1 = pipe:step(x, y)
      assert.are.equal(seq and 2 or 3, #pipe:act_shape())
      assert.is_true(FS.rel(l1:item(), l0:item()) <= 1e-5, ('%s: %.9g against %.9g'):format(case[1], l1:item(), l0:item()))
      local ref_p = {}
      for name, p in ref:named_parameters() do ref_p[name] = p end
      for name, g in pairs(ms.tp.full_grads(m)) do
        local e = FS.norm_rel(g, ref_p[name].grad)
        assert.is_true(e <= 1e-4, ('%s %s: %g'):format(case[1], name, e))
      end
      pipe:free()
    end
    mesh.shard:free()
    mesh.replicate:free()
  end)

  it('FSDP inside the stages (2 stages; 2 x 2 on 4 GPUs): the whole model\'s loss and gradients from the shards (f32; '
    .. 'bf16 parameters within 2e-2)', function()
    -- (on 2 GPUs the pipeline's groups are split from a mesh row that has
    -- the world's members: this test found the NCCL store keys naming a
    -- parent by its members, core/dist/nccl.cu)
    local S = 2
    local D = W / S
    local mesh = dist.mesh { replicate = D, shard = S }   -- shard: the pipelines; replicate: each stage's FSDP group
    local d = mesh.coord[1]
    local function rows(t) local n = t.shape[1] / D; return t:narrow(1, d * n + 1, n):contiguous() end
    for _, case in ipairs(cases) do
      for _, run in ipairs({ { 'FULL_SHARD', '1f1b' }, { 'SHARD_GRAD_OP', 'gpipe' }, { 'FULL_SHARD', 'interleaved' },
        { 'FULL_SHARD', '1f1b', 'bf16' } }) do
        local what = ('%s %s %s%s'):format(case[1], run[1], run[2], run[3] and ' bf16' or '')
        local x, y = batch(9)
        local ref = build(case):to('cuda')
        local l0 = ref(x, y)
        l0:backward()
        local m = build(case)
        local pipe = ms.pp.pipeline(m, { group = mesh.shard, microbatches = 4, chunks = run[2] == 'interleaved' and 2 or nil,
          schedule = run[2] ~= 'interleaved' and run[2] or nil })
        m:to('cuda')
        ms.fsdp.fully_shard(m, { group = mesh.replicate, strategy = run[1],
          policy = ms.fsdp.policy.by_class { case[1] == 'gpt2' and 'GPT2Block' or 'LlamaDecoderLayer' },
          mixed_precision = run[3] and { param = 'bf16', reduce = 'f32' } or nil })
        local l1 = pipe:step(rows(x), rows(y))
        dist.all_reduce(l1, 'avg', { group = mesh.replicate })
        local tol = run[3] and 2e-2 or 1e-4
        assert.is_true(FS.rel(l1:item(), l0:item()) <= (run[3] and 1e-2 or 1e-5), ('%s: %.9g against %.9g'):format(what, l1:item(), l0:item()))
        local ref_p = {}
        for name, p in ref:named_parameters() do ref_p[name] = p end
        local n = 0
        for _, u in ipairs(ms.fsdp.units(m)) do
          local fp = u.fp
          local flat = ms.empty({ fp.total }, { dtype = 'f32', device = 'cuda' })
          if fp.world_size == 1 then flat:copy_(fp.shard.grad) else dist.all_gather_into(flat, fp.shard.grad, { group = fp.group }) end
          for i = 1, fp.nparams do
            local name = u.param_names[i]
            local g = flat:narrow(1, fp.layout.offsets[i] + 1, fp.layout.numels[i]):view(ref_p[name].shape)
            local e = FS.norm_rel(g, ref_p[name].grad)
            assert.is_true(e <= tol, ('%s %s: %g'):format(what, name, e))
            n = n + 1
          end
          flat:free()
        end
        assert.is_true(n > 0)
        local n0 = ms.optim.clip_grad_norm(ref, math.huge)
        local n1 = ms.pp.clip_grad_norm_(m, math.huge)
        assert.is_true(FS.rel(n1, n0) <= tol, ('%s: norm %.9g against %.9g'):format(what, n1, n0))
        pipe:free()
      end
    end
    mesh.shard:free()
    mesh.replicate:free()
  end)

  it('bf16 autocast, one micro-batch: the whole model\'s loss and gradients, bit for bit', function()
    local case = cases[2]
    local x, y = batch(4)
    local ref = ms.nn.functional.set_precision(build(case):to('cuda'), { compute = 'bf16' })
    local l0 = ref(x, y)
    l0:backward()
    local m = build(case)
    local pipe = ms.pp.pipeline(m, { microbatches = 1 })
    m:to('cuda')
    ms.nn.functional.set_precision(m, { compute = 'bf16' })
    local l1 = pipe:step(x, y)
    assert.are.equal(l0:item(), l1:item())
    local ref_p = {}
    for name, p in ref:named_parameters() do ref_p[name] = p end
    for name, p in m:named_parameters() do assert.are.equal(0, FS.max_rel(p.grad, ref_p[name].grad), name) end
    pipe:free()
  end)

  it('AdamW steps: allocated memory flat from step 2 on, the pool near it; the loss goes down', function()
    local case = cases[1]
    local m = build(case)
    local pipe = ms.pp.pipeline(m, { microbatches = 4 })
    m:to('cuda')
    ms.nn.functional.set_precision(m, { compute = 'bf16' })
    local opt = ms.optim.AdamW(m, { lr = 3e-3 })
    local x, y = batch(6)
    local mem, losses, s2 = {}, {}, nil
    for step = 1, 8 do
      opt:zero_grad()
      local l = pipe:step(x, y)
      ms.pp.clip_grad_norm_(m, 1.0, { tensor = true, defer = opt })
      opt:step()
      losses[step] = l:item()
      l:free()
      S.settle()
      mem[step] = ms.cuda.memory_stats().allocated
      if step == 2 then s2 = ms.cuda.memory_stats() end
    end
    for step = 3, 8 do assert.are.equal(mem[2], mem[step], 'allocated bytes after step ' .. step) end
    -- (a send's buffer is reusable only once the send has run on the GPU; when
    -- the host is further ahead than in the steps before, the pool takes a
    -- block more: a few at most, never one a step)
    local more = ms.cuda.memory_stats().num_mallocs - s2.num_mallocs
    assert.is_true(more <= 4, ('%d cudaMalloc in steps 3-8'):format(more))
    assert.is_true(losses[8] < losses[1], ('%g -> %g'):format(losses[1], losses[8]))
    pipe:free()
  end)
end)
