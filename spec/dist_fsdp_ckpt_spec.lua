-- FSDP checkpoints at one world size (#mpi; tools/run_mpi_specs.sh runs it
-- with 1, 2, 3 and 4 ranks): gpt2-tiny from the shared fixtures, sharded
-- by gpt2.Block, 2 AdamW steps, then a sharded save loaded into FULL_SHARD,
-- NO_SHARD, another wrapping policy and a plain model; a full save in the
-- Hugging Face names; and every error the loader must name. Loading into
-- other world sizes: spec/fsdp_ckpt_reshard_spec.lua
-- (tools/run_fsdp_ckpt_specs.sh saves at 4 ranks, loads at 2, 3 and 1).
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local S = require 'moonshard.safetensors'
local ck = require 'moonshard.fsdp_checkpoint'
local H = require 'spec.fsdp_ckpt_helpers'

describe('fsdp checkpoints at one world size #mpi', function()
  if not H.under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not H.have_fixture then
    it('needs the gpt2-tiny fixture', function() pending('no ' .. H.fixture) end)
    return
  end

  local D
  setup(function()
    dist.init { backend = 'mpi', timeout = 120 }
    D = H.shared_tmpdir()
  end)
  teardown(function()
    ck._inject_failure = nil
    dist.barrier()
    if dist.rank() == 0 and D and D:match('fsdp%-ckpt$') then os.execute("rm -rf '" .. D .. "'") end
    dist.destroy()
  end)

  -- the run that saves after 2 steps and then goes on without reloading
  local ref
  local function reference()
    if ref then return ref end
    ref = {}
    local model, opt = H.build('full')
    H.train(model, opt, 2)
    ck.save_sharded(model, D .. '/a', { optimizer = opt, extra = { note = 'two steps', data = { 1, 2 } } })
    ck.save_full(model, D .. '/full.safetensors')
    ref.params, ref.state = ck.gather(model, { optimizer = opt })
    ref.logits = H.logits(model)
    ref.loss3 = H.train(model, opt, 1)[1]
    ref.after = ck.gather(model)
    ref.model, ref.opt = model, opt
    return ref
  end

  -- the loaded model holds exactly the saved parameters and moments
  local function same_state(model, opt, what)
    local r = reference()
    local params, state = ck.gather(model, { optimizer = opt })
    assert.are.equal(#r.params, #params)
    for i, e in ipairs(params) do
      assert.are.equal(r.params[i].name, e.name)
      assert.are.equal(0, H.max_abs(e.tensor, r.params[i].tensor), what .. ': ' .. e.name)
      if opt then
        local s, rs = state[e.name], r.state[e.name]
        assert.is_not_nil(s, what .. ': no optimizer state for ' .. e.name)
        assert.are.equal(rs.step, s.step)
        assert.are.equal(0, H.max_abs(s.exp_avg, rs.exp_avg), what .. ': exp_avg of ' .. e.name)
        assert.are.equal(0, H.max_abs(s.exp_avg_sq, rs.exp_avg_sq), what .. ': exp_avg_sq of ' .. e.name)
      end
    end
  end

  -- the step after the load matches the run that never saved
  local function continues(model, opt, what, tol)
    local r = reference()
    local loss3 = H.train(model, opt, 1)[1]
    assert.is_true(loss3 == r.loss3, ('%s: loss %.9g, never saved %.9g'):format(what, loss3, r.loss3))
    local after = ck.gather(model)
    for i, e in ipairs(after) do
      local d = H.max_rel(e.tensor, r.after[i].tensor)
      assert.is_true(d <= tol, ('%s: %s differs by %.3g after the next step'):format(what, e.name, d))
    end
  end

  local cases = {
    { 'full', 'FULL_SHARD by Block (the same layout)', 0 },
    { 'noshard', 'NO_SHARD by Block', 1e-6 },
    { 'root', 'FULL_SHARD with one unit (another policy)', 1e-6 },
    { 'plain', 'a plain model and optimizer (no FSDP)', 1e-6 },
  }
  if H.more_strategies then
    cases[#cases + 1] = { 'grad_op', 'SHARD_GRAD_OP by Block', 1e-6 }
    cases[#cases + 1] = { 'hybrid', 'HYBRID_SHARD by Block', 1e-6 }
  end
  for _, c in ipairs(cases) do
    it(('a sharded save after 2 steps loads into %s: identical parameters, moments and logits; the next step matches'):format(c[2]),
      function()
        local r = reference()
        local model, opt = H.build(c[1])
        local info = ck.load_sharded(model, D .. '/a', { optimizer = opt })
        assert.are.equal(2, info.step)
        assert.are.equal(dist.world_size(), info.world_size)
        assert.are.equal('two steps', info.extra.note)
        assert.are.same({ 1, 2 }, info.extra.data)
        same_state(model, opt, c[1])
        assert.are.equal(0, H.max_abs(H.logits(model), r.logits), c[1] .. ': logits')
        continues(model, opt, c[1], c[3])
      end)
  end

  -- SGD with momentum (and nesterov): its momentum buffers are saved as
  -- 'momentum_buffer:<name>:<start>' pieces and loaded into FULL_SHARD and
  -- into a plain model: the steps after the load are those of the run that
  -- never saved
  for _, nesterov in ipairs({ false, true }) do
    it(('SGD with momentum%s: the momentum buffers saved and loaded (FULL_SHARD, plain); the next steps match')
      :format(nesterov and ' (nesterov)' or ''), function()
      local SO = { lr = 1e-2, momentum = 0.9, nesterov = nesterov, weight_decay = 0.01 }
      local function sgd(kind)
        local model = H.load_model()
        if kind == 'plain' then return model, ms.optim.SGD(model, SO) end
        ms.fsdp.fully_shard(model, { policy = ms.fsdp.policy.by_class { H.gpt2().Block } })
        return model, ms.fsdp.SGD(model, SO)
      end
      local dir = D .. '/sgd' .. (nesterov and 'n' or '')
      local model, opt = sgd('full')
      H.train(model, opt, 2)
      ck.save_sharded(model, dir, { optimizer = opt, step = 2 })
      local want = H.train(model, opt, 2)
      local idx = ck.read_index(dir)
      local any = false
      for _, list in pairs(idx.pieces) do
        for _, pc in ipairs(list) do if pc.momentum_buffer then any = true end end
      end
      assert.is_true(any, 'momentum pieces in the index')
      assert.are.equal(0.9, idx.optimizer.groups[1].momentum)
      for _, kind in ipairs({ 'full', 'plain' }) do
        local m2, o2 = sgd(kind)
        ck.load_sharded(m2, dir, { optimizer = o2 })
        local got = H.train(m2, o2, 2)
        assert.are.same(want, got, kind)
      end
      local e = H.error_of(function() ck.gather(model, { optimizer = opt }) end)
      assert.is_truthy(e:find('keeps momentum_buffer', 1, true), e)
    end)
  end

  it('a bf16 mixed-precision model loads the f32 masters and its all-gathered bf16 copy is refreshed', function()
    if not H.more_strategies then pending('fsdp without mixed precision'); return end
    local model, opt = H.build('bf16')
    ck.load_sharded(model, D .. '/a', { optimizer = opt })
    same_state(model, opt, 'bf16')
    for _, u in ipairs(ms.fsdp.units(model)) do
      if u.lp then assert.are.equal(0, H.max_abs(u.lp, u.fp.shard:to('bf16')), 'the bf16 copy of ' .. u.name) end
    end
    local other = H.build('bf16')
    ck.load_full(other, D .. '/full.safetensors')
    local a, b = H.logits(model), H.logits(other)
    assert.are.equal(0, H.max_abs(a, b))
    local d = H.max_rel(a, reference().logits)
    assert.is_true(d < 2e-2, ('bf16 logits differ from the f32 ones by %.3g'):format(d))
  end)

  it('every rank writes its own file; the index lists the parameters, files and pieces by name and element range', function()
    reference()
    local W = dist.world_size()
    local index = ck.read_index(D .. '/a')
    assert.are.equal(W, index.world_size)
    assert.are.equal('FULL_SHARD', index.strategy)
    assert.are.equal(W, #index.files)
    local names = {}
    for name, p in ref.model:named_parameters() do names[#names + 1] = { name, p.shape } end
    assert.are.equal(#names, #index.params)
    for i, p in ipairs(index.params) do
      assert.are.equal(names[i][1], p.name)
      assert.are.same(names[i][2], p.shape)
      -- the pieces of each parameter cover it exactly once, in order
      local at = 0
      for _, pc in ipairs(index.pieces[p.name]) do
        assert.are.equal(at, pc.start)
        at = at + pc.numel
      end
      assert.are.equal(p.numel, at)
    end
    -- a rank file describes its own pieces
    local path = D .. '/a/' .. ck.rank_file(dist.rank(), W)
    local _, meta = S.header(path)
    local desc = require('dkjson').decode(meta['moonshard.fsdp'])
    assert.are.equal(dist.rank(), desc.rank)
    local t = S.load(path)
    for _, pc in ipairs(desc.pieces) do
      assert.are.equal(pc.numel, t[pc.tensor]:numel())
      assert.are.equal(pc.numel, t[pc.exp_avg]:numel())
    end
  end)

  it('a full save holds the Hugging Face names of the fixture (the tied head once) and the gathered values', function()
    local r = reference()
    local path = D .. '/full.safetensors'
    local hdr, meta = S.header(path)
    local want = S.header(H.fixture .. '/model.safetensors')
    local n = 0
    for name, e in pairs(want) do
      assert.is_not_nil(hdr[name], 'missing ' .. name)
      assert.are.same(e.shape, hdr[name].shape)
      n = n + 1
    end
    for name in pairs(hdr) do assert.is_not_nil(want[name], 'unexpected ' .. name) end
    assert.is_nil(hdr['lm_head.weight'])
    assert.are.equal('pt', meta.format)
    local t = ms.load_safetensors(path)
    for _, e in ipairs(r.params) do assert.are.equal(0, H.max_abs(t[e.name], e.tensor), e.name) end
    -- bf16 on request
    local p16 = D .. '/full-bf16.safetensors'
    ck.save_full(r.model, p16, { dtype = 'bf16' })
    for name, e in pairs(S.header(p16)) do
      assert.are.equal('bf16', e.dtype, name)
      assert.are.same(want[name].shape, e.shape)
    end
    -- and it loads into a plain model as a state dict would
    local plain = H.load_model()
    plain:load_state_dict(t, { strict = true })
    assert.are.equal(0, H.max_abs(H.logits(plain), r.logits))
  end)

  it('a full save streams: a rank holds one unit\'s gathered parameters at a time, not the model\'s', function()
    local r = reference()
    local S_ = require 'moonshard.safetensors'
    local keep = S_.stream_bytes
    S_.stream_bytes = 0   -- (rank 0 keeps only the newest host copy)
    collectgarbage(); collectgarbage()
    local base, most = ms.live_bytes(-1), 0
    local unit_bytes, model_bytes = 0, 0
    for _, u in ipairs(ms.fsdp.units(r.model)) do
      unit_bytes = math.max(unit_bytes, u.fp.total * 4)
      model_bytes = model_bytes + u.fp.total * 4
    end
    local calls = 0
    ck._on_unit_saved = function() calls = calls + 1; most = math.max(most, ms.live_bytes(-1) - base) end
    local ok, err = pcall(ck.save_full, r.model, D .. '/streamed.safetensors')
    ck._on_unit_saved, S_.stream_bytes = nil, keep
    assert.is_true(ok, tostring(err))
    assert.are.equal(#ms.fsdp.units(r.model), calls, 'a unit at a time')
    -- (the gathered buffer is freed before the hook; what remains is the
    -- newest host copy and passing temporaries: under one unit)
    assert.is_true(most <= unit_bytes, ('%d bytes held beyond the shards, one unit is %d, the model %d'):format(most,
      unit_bytes, model_bytes))
    assert.is_true(unit_bytes < model_bytes / 2)
    -- the values: the model's now (reference() took a step after its own save)
    if dist.rank() == 0 then
      local a = ms.load_safetensors(D .. '/streamed.safetensors')
      local b = S_.header(D .. '/full.safetensors')
      for name in pairs(b) do assert.is_not_nil(a[name], name) end
      for name in pairs(a) do assert.is_not_nil(b[name], name) end
      for _, e in ipairs(r.after) do assert.are.equal(0, H.max_abs(a[e.name], e.tensor), e.name) end
      assert.is_true(#r.after > 0)
    end
  end)

  it('load_full reads a full save into a sharded model (each rank its slices) and into a plain one', function()
    local r = reference()
    for _, kind in ipairs({ 'full', 'root', 'plain' }) do
      local model = H.build(kind)
      ck.load_full(model, D .. '/full.safetensors')
      assert.are.equal(0, H.max_abs(H.logits(model), r.logits), kind)
      same_state(model, nil, kind)
    end
    -- the fixture file itself (as Hugging Face wrote it)
    local model = H.build('full')
    local plain = H.load_model()
    ck.load_full(model, H.fixture .. '/model.safetensors')
    assert.are.equal(0, H.max_abs(H.logits(model), H.logits(plain)))
  end)

  it('a save that fails part way leaves the previous checkpoint as it was', function()
    local r = reference()
    local W = dist.world_size()
    local before = ck.read_index(D .. '/a')
    -- ('disk': the rank's file fails in the writer's thread, ENOSPC)
    for _, stage in ipairs({ 'rank_file', 'after_rank_file', 'disk', 'index' }) do
      ck._inject_failure = { stage = stage, rank = stage == 'index' and 0 or W - 1 }
      local err = H.error_of(function() ck.save_sharded(r.model, D .. '/a', { optimizer = r.opt }) end)
      ck._inject_failure = nil
      if stage == 'disk' and dist.rank() == W - 1 then
        assert.matches('checkpoint: writer: cannot write ' .. D .. '/a.tmp/rank-', err, 1, true)
        assert.matches('No space left on device', err, 1, true)
      elseif (stage == 'index' and dist.rank() == 0) or
         (stage ~= 'index' and dist.rank() == W - 1) then
        assert.matches('injected failure at ' .. stage, err, 1, true)
      elseif stage == 'index' then
        assert.matches('failed on another rank', err, 1, true)
      else
        assert.matches(('rank(s) %d could not write their files'):format(W - 1), err, 1, true)
      end
      dist.barrier()
      assert.is_nil(io.open(D .. '/a.tmp/index.json'))
      local idx = ck.read_index(D .. '/a')
      assert.are.same(before.files, idx.files)
      local model, opt = H.build('full')
      ck.load_sharded(model, D .. '/a', { optimizer = opt })
      same_state(model, opt, 'after a failed save at ' .. stage)
    end
    -- and a save that completes replaces it
    local d2 = D .. '/b'
    ck.save_sharded(r.model, d2, { optimizer = r.opt })
    ck.save_sharded(r.model, d2, { optimizer = r.opt, step = 3 })
    assert.are.equal(3, ck.read_index(d2).step)
    assert.is_nil(io.open(d2 .. '.tmp/index.json'))
  end)

  it('llama-tiny: a sharded save loads back into NO_SHARD, and the full save has the names of the fixture (untied lm_head)', function()
    local llama = require 'models.llama'
    local dir = H.fixture:gsub('gpt2%-tiny$', 'llama-tiny')
    local function build(strategy)
      local m = llama.from_pretrained(dir, { dtype = 'f32' })
      ms.fsdp.fully_shard(m, { policy = ms.fsdp.policy.by_class { llama.Layer }, strategy = strategy })
      return m, ms.fsdp.AdamW(m, H.OPTS)
    end
    local ex = ms.load_safetensors(dir .. '/expected.safetensors')
    local m, opt = build('FULL_SHARD')
    for _ = 1, 2 do
      local loss = m(ex.input_ids, ex.targets); loss:backward(); opt:step(); opt:zero_grad()
    end
    ck.save_sharded(m, D .. '/llama', { optimizer = opt })
    ck.save_full(m, D .. '/llama.safetensors')
    local want = S.header(dir .. '/model.safetensors')
    local have = S.header(D .. '/llama.safetensors')
    for name, e in pairs(want) do
      assert.is_not_nil(have[name], 'missing ' .. name)
      assert.are.same(e.shape, have[name].shape)
    end
    for name in pairs(have) do assert.is_not_nil(want[name], 'unexpected ' .. name) end
    assert.is_not_nil(have['lm_head.weight'])
    local m2, opt2 = build('NO_SHARD')
    ck.load_sharded(m2, D .. '/llama', { optimizer = opt2 })
    local a, b = ck.gather(m, { optimizer = opt }), nil
    b = ck.gather(m2)
    for i, e in ipairs(a) do assert.are.equal(0, H.max_abs(e.tensor, b[i].tensor), e.name) end
    local la, lb
    ms.no_grad(function() la = m(ex.input_ids):clone(); lb = m2(ex.input_ids):clone() end)
    assert.are.equal(0, H.max_abs(la, lb))
  end)

  describe('errors name the file and the parameter', function()
    local function copy(name)
      local d = D .. '/' .. name
      H.on_rank0(function() H.sh("rm -rf '" .. d .. "' && cp -r '" .. D .. "/a' '" .. d .. "'") end)
      return d
    end

    it('a checkpoint without index.json is incomplete', function()
      reference()
      local d = copy('noindex')
      H.on_rank0(function() os.remove(d .. '/index.json') end)
      local model, opt = H.build('full')
      local err = H.error_of(function() ck.load_sharded(model, d, { optimizer = opt }) end)
      assert.matches(d .. '/index.json is missing', err, 1, true)
      assert.matches('incomplete', err, 1, true)
      err = H.error_of(function() ck.load_sharded(model, D .. '/nothing-here') end)
      assert.matches('no such checkpoint folder', err, 1, true)
    end)

    it('a missing rank file', function()
      reference()
      local W = dist.world_size()
      local d = copy('norank')
      local name = ck.rank_file(W - 1, W)
      H.on_rank0(function() os.remove(d .. '/' .. name) end)
      local model = H.build('full')
      local err = H.error_of(function() ck.load_sharded(model, d) end)
      assert.matches(d .. '/' .. name .. ' is missing', err, 1, true)
    end)

    it('a truncated rank file', function()
      reference()
      local d = copy('truncated')
      local path = d .. '/' .. ck.rank_file(0, dist.world_size())
      H.on_rank0(function() H.sh("truncate -s 1000 '" .. path .. "'") end)
      local model = H.build('full')
      local err = H.error_of(function() ck.load_sharded(model, d) end)
      assert.matches(path .. ' has 1000 bytes, the index says', err, 1, true)
      assert.matches('truncated', err, 1, true)
      -- a truncated full file: the safetensors reader names it
      local full = D .. '/full-truncated.safetensors'
      H.on_rank0(function()
        H.sh("cp '" .. D .. "/full.safetensors' '" .. full .. "' && truncate -s 5000 '" .. full .. "'")
      end)
      err = H.error_of(function() ck.load_full(model, full) end)
      assert.matches(full, err, 1, true)
      assert.matches('truncated', err, 1, true)
    end)

    it('a corrupt rank file of the right size fails verify = true', function()
      reference()
      local d = copy('corrupt')
      local path = d .. '/' .. ck.rank_file(0, dist.world_size())
      H.on_rank0(function()
        local f = assert(io.open(path, 'r+b'))
        local n = f:seek('end')
        f:seek('set', n - 4)
        f:write('\255\255\127\127')
        f:close()
      end)
      local model = H.build('full')
      local err = H.error_of(function() ck.load_sharded(model, d, { verify = true }) end)
      -- rank 0 checks every file; the others the files they read
      if dist.rank() == 0 or not err:find('another rank', 1, true) then
        assert.matches(path .. ': checksum mismatch', err, 1, true)
      end
      ck.load_sharded(model, D .. '/a', { verify = true })
    end)

    it('a parameter of another shape, a missing parameter, one the model lacks', function()
      reference()
      local d = D .. '/a'
      local m1 = H.build('full', { n_positions = 32 })
      local err = H.error_of(function() ck.load_sharded(m1, d) end)
      assert.matches('parameter transformer.wpe.weight has shape (64, 64) in ' .. d .. ', (32, 64) in the model', err, 1, true)
      err = H.error_of(function() ck.load_full(m1, D .. '/full.safetensors') end)
      assert.matches('parameter transformer.wpe.weight has shape (64, 64) in ' .. D .. '/full.safetensors', err, 1, true)
      local m3 = H.build('full', { n_layer = 3 })
      err = H.error_of(function() ck.load_sharded(m3, d) end)
      assert.matches(d .. ' has no parameter transformer.h.2.', err, 1, true)
      local m1l = H.build('full', { n_layer = 1 })
      err = H.error_of(function() ck.load_sharded(m1l, d) end)
      assert.matches('has parameter transformer.h.1.', err, 1, true)
      assert.matches('which the model does not have', err, 1, true)
      -- strict = false loads the parameters the model has
      ck.load_sharded(m1l, d, { strict = false })
    end)

    it('asking for optimizer state a checkpoint does not hold', function()
      local r = reference()
      ck.save_sharded(r.model, D .. '/noopt')
      local model, opt = H.build('full')
      local err = H.error_of(function() ck.load_sharded(model, D .. '/noopt', { optimizer = opt }) end)
      assert.matches('holds no optimizer state', err, 1, true)
    end)
  end)
end)
