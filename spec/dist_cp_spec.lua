-- Context parallelism (#mpi, 1-4 ranks; moonshard.cp, docs/cp.md): the
-- sequence split over the ranks, attention as a ring. Against the whole
-- sequence in one process, in f64: ring attention's output and its
-- gradients (load-balanced and contiguous layouts, grouped-query heads, a
-- sub-group of the world), a finite-difference check through shard and
-- unshard, f32 against f64, and GPT-2 and Llama trained with their tokens
-- split: the loss, every gradient, AdamW steps; the refusals.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local gpt2 = require 'models.gpt2'
local llama = require 'models.llama'
local hf = require 'models.hf'
local A = require 'moonshard.autograd'
local FS = require 'spec.fsdp_support'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('context parallelism #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local cp, nnf = ms.cp, ms.nn.functional

  local function maxrel(a, b)
    local d = (a - b):abs():max():item()
    local s = b:abs():max():item()
    return d / math.max(s, 1e-30)
  end

  -- q, k, v of the whole sequence, the same on every rank
  local function qkv(B, H, Hkv, Tn, D, dtype, seed)
    ms.manual_seed(seed or 11)
    local q = ms.randn({ B, H, Tn, D }, { dtype = 'f64' })
    local k = ms.randn({ B, Hkv, Tn, D }, { dtype = 'f64' })
    local v = ms.randn({ B, Hkv, Tn, D }, { dtype = 'f64' })
    if dtype ~= 'f64' then q, k, v = q:to(dtype), k:to(dtype), v:to(dtype) end
    for _, t in ipairs({ q, k, v }) do t:requires_grad_(true) end
    return q, k, v
  end

  -- y and the gradients of sum(y * r) over the whole sequence: with the ring
  -- (shard, cp.attention, unshard) and without it
  local function run(ctx, q, k, v, r)
    local y
    if ctx then
      y = cp.unshard(cp.attention(cp.shard(q, ctx, 3), cp.shard(k, ctx, 3), cp.shard(v, ctx, 3), ctx), ctx, 3)
    else
      y = nnf.scaled_dot_product_attention(q, k, v, { causal = true })
    end
    local l = (y * r):sum()
    l:backward()
    local g = { q.grad:clone(), k.grad:clone(), v.grad:clone() }
    for _, t in ipairs({ q, k, v }) do t:zero_grad() end
    return y:detach(), g
  end

  for _, lb in ipairs({ true, false }) do
    for _, heads in ipairs({ { 4, 4 }, { 4, 2 } }) do
      it(('ring attention equals the whole sequence\'s: output and gradients (f64, %s, H %d / Hkv %d)'):format(
        lb and 'load-balanced' or 'contiguous', heads[1], heads[2]), function()
        local ctx = cp.context(dist.get_world_group(), { load_balance = lb })
        local Tn = 24
        local q, k, v = qkv(2, heads[1], heads[2], Tn, 8, 'f64')
        ms.manual_seed(5)
        local r = ms.randn({ 2, heads[1], Tn, 8 }, { dtype = 'f64' })
        local y1, g1 = run(ctx, q, k, v, r)
        local y0, g0 = run(nil, q, k, v, r)
        assert.is_true(maxrel(y1, y0) < 1e-12, 'out ' .. maxrel(y1, y0))
        for i = 1, 3 do
          assert.is_true(maxrel(g1[i], g0[i]) < 1e-11, ({ 'dq', 'dk', 'dv' })[i] .. ' ' .. maxrel(g1[i], g0[i]))
        end
      end)
    end
  end

  it('each rank holds its chunks: positions, shard and unshard round trip', function()
    local ctx = cp.context(nil)
    local pos = ctx:positions(24 / W)
    local c = 24 / (2 * W)
    local want = {}
    for i = 0, c - 1 do want[#want + 1] = dist.rank() * c + i end
    for i = 0, c - 1 do want[#want + 1] = (2 * W - 1 - dist.rank()) * c + i end
    assert.are.same(want, pos:totable())
    local ids = ms.arange(2 * 24, { dtype = 'i64' }):view(2, 24)
    local mine = cp.shard(ids, ctx)
    assert.are.same({ 2, 24 / W }, mine.shape)
    assert.are.same(ids:totable(), cp.unshard(mine, ctx):totable())
    local p24 = ctx:positions(24 / W):totable()
    for b = 1, 2 do
      for j = 1, 24 / W do assert.are.equal((b - 1) * 24 + p24[j], mine:totable()[b][j]) end
    end
  end)

  it('a finite-difference check through shard, the ring and unshard (f64)', function()
    local ctx = cp.context(nil)
    local q, k, v = qkv(1, 2, 1, 2 * W * 2, 4, 'f64', 3)
    local worst = A.gradcheck(function()
      return cp.unshard(cp.attention(cp.shard(q, ctx, 3), cp.shard(k, ctx, 3), cp.shard(v, ctx, 3), ctx), ctx, 3)
    end, { q, k, v })
    assert.is_true(worst < 1e-7, 'gradcheck ' .. worst)
  end)

  it('f32 ring attention against the f64 whole sequence (1e-5)', function()
    local ctx = cp.context(nil)
    local q, k, v = qkv(2, 4, 2, 8 * W, 16, 'f64', 21)
    ms.manual_seed(6)
    local r = ms.randn({ 2, 4, 8 * W, 16 }, { dtype = 'f64' })
    local y0, g0 = run(nil, q, k, v, r)
    local qf, kf, vf = q:detach():to('f32'), k:detach():to('f32'), v:detach():to('f32')
    for _, t in ipairs({ qf, kf, vf }) do t:requires_grad_(true) end
    local y1, g1 = run(ctx, qf, kf, vf, r:to('f32'))
    assert.is_true(maxrel(y1:to('f64'), y0) < 1e-5, 'out ' .. maxrel(y1:to('f64'), y0))
    for i = 1, 3 do assert.is_true(maxrel(g1[i]:to('f64'), g0[i]) < 1e-5, 'grad ' .. i) end
  end)

  it('a sub-group: two context-parallel pairs side by side, each its own sequence', function()
    if W % 2 ~= 0 then return end
    local mesh = dist.mesh { replicate = W / 2, shard = 2 }
    local ctx = cp.context(mesh.shard)
    local q, k, v = qkv(1, 2, 2, 16, 8, 'f64', 40 + mesh.coord[1])
    ms.manual_seed(7)
    local r = ms.randn({ 1, 2, 16, 8 }, { dtype = 'f64' })
    local y1, g1 = run(ctx, q, k, v, r)
    local y0, g0 = run(nil, q, k, v, r)
    assert.is_true(maxrel(y1, y0) < 1e-12)
    for i = 1, 3 do assert.is_true(maxrel(g1[i], g0[i]) < 1e-11) end
    mesh.shard:free(); mesh.replicate:free()
  end)

  local cases = {
    { 'gpt2', gpt2, { vocab_size = 259, n_positions = 48, n_embd = 24, n_layer = 2, n_head = 4,
      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
    { 'llama', llama, { vocab_size = 257, hidden_size = 24, intermediate_size = 40, num_hidden_layers = 2,
      num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 48 } },
  }
  local function build(case)
    ms.manual_seed(7)
    local cfg = {}
    for kk, vv in pairs(case[3]) do cfg[kk] = vv end
    return case[2].new(cfg):to('f64')
  end
  local function batch(Tn) return FS.lcg_batch(99, 2, Tn) end
  -- the gradients averaged over the group (each rank's loss is its tokens' mean)
  local function averaged(model)
    local g = {}
    for name, p in model:named_parameters() do
      local t = p.grad:clone()
      dist.all_reduce(t, 'sum')
      g[name] = t / W
    end
    return g
  end

  for _, case in ipairs(cases) do
    for _, lb in ipairs({ true, false }) do
      it(('%s with its tokens split: the loss and every gradient (f64, %s)'):format(case[1],
        lb and 'load-balanced' or 'contiguous'), function()
        local Tn = 24
        local ids, tgt = batch(Tn)
        local ref = build(case)
        local l0 = ref(ids, tgt)
        l0:backward()
        local m = build(case)
        local ctx = cp.apply(m, nil, { load_balance = lb })
        local l = m(cp.shard(ids, ctx), cp.shard(tgt, ctx))
        l:backward()
        local lt = l:detach():clone()
        dist.all_reduce(lt, 'sum')
        assert.is_true(math.abs(lt:item() / W - l0:item()) < 1e-12 * math.abs(l0:item()))
        local g = averaged(m)
        for name, p in ref:named_parameters() do
          local e = maxrel(g[name], p.grad)
          assert.is_true(e < 1e-10, name .. ' ' .. e)
        end
        cp.remove(m)
        assert.is_nil(cp.of(m.lm_head or m))
      end)
    end

    it(case[1] .. ': three AdamW steps, the same parameters as the whole model', function()
      local Tn = 12 * 2
      local ids, tgt = batch(Tn)
      local ref, m = build(case), build(case)
      local ctx = cp.apply(m, nil)
      local o0 = ms.optim.AdamW(ref:parameters(), { lr = 1e-2 })
      local o1 = ms.optim.AdamW(m:parameters(), { lr = 1e-2 })
      local mi, mt = cp.shard(ids, ctx), cp.shard(tgt, ctx)
      for _ = 1, 3 do
        o0:zero_grad(); o1:zero_grad()
        ref(ids, tgt):backward()
        m(mi, mt):backward()
        for _, p in ipairs(m:parameters()) do
          dist.all_reduce(p.grad, 'sum')
          p.grad:div_(W)
        end
        o0:step(); o1:step()
      end
      local pr = {}
      for name, p in ref:named_parameters() do pr[name] = p end
      for name, p in m:named_parameters() do
        assert.is_true(maxrel(p:detach(), pr[name]:detach()) < 1e-10, name)
      end
    end)
  end

  it('under fully_shard over the group: the loss and the gradients from the shards (f64)', function()
    local case = cases[2]
    local ids, tgt = batch(24)
    local ref = build(case)
    local l0 = ref(ids, tgt)
    l0:backward()
    local m = build(case)
    ms.fsdp.fully_shard(m, { policy = ms.fsdp.policy.by_class { llama.Layer } })
    local ctx = cp.apply(m, nil)
    local l = m(cp.shard(ids, ctx), cp.shard(tgt, ctx))
    l:backward()
    local lt = l:detach():clone()
    dist.all_reduce(lt, 'sum')
    assert.is_true(math.abs(lt:item() / W - l0:item()) < 1e-12 * math.abs(l0:item()))
    local full = FS.whole_grads(m)
    for name, p in ref:named_parameters() do
      local e = maxrel(full[name], p.grad:reshape(-1))
      assert.is_true(e < 1e-10, name .. ' ' .. e)
    end
  end)

  it('with activation checkpointing: the ring runs again in the backward, the same gradients (f64)', function()
    local case = cases[2]
    local ids, tgt = batch(24)
    local ref = build(case)
    ref(ids, tgt):backward()
    local m = build(case)
    ms.nn.apply_activation_checkpointing(m, { class = llama.Layer })
    local ctx = cp.apply(m, nil)
    m(cp.shard(ids, ctx), cp.shard(tgt, ctx)):backward()
    local g = averaged(m)
    for name, p in ref:named_parameters() do
      assert.is_true(maxrel(g[name], p.grad) < 1e-10, name)
    end
  end)

  it('with tensor parallelism (2 x 2: TP pairs, CP across them): the loss and every gradient (f64)', function()
    if W ~= 4 then return end
    local mesh = dist.mesh { replicate = 2, shard = 2 }   -- shard: the TP pair; replicate: the CP group
    for _, case in ipairs(cases) do
      for _, sp in ipairs({ false, true }) do
        local ids, tgt = batch(24)
        local ref = build(case)
        local l0 = ref(ids, tgt)
        l0:backward()
        local m = ms.tp.parallelize(build(case), { group = mesh.shard, sequence_parallel = sp })
        local ctx = cp.apply(m, mesh.replicate)
        local l = m(cp.shard(ids, ctx), cp.shard(tgt, ctx))
        l:backward()
        ms.tp.all_reduce_grads(m, mesh.replicate, 'avg')
        local lt = l:detach():clone()
        dist.all_reduce(lt, 'avg', { group = mesh.replicate })
        assert.is_true(math.abs(lt:item() - l0:item()) < 1e-12 * math.abs(l0:item()))
        local full = ms.tp.full_grads(m)
        for name, p in ref:named_parameters() do
          local e = maxrel(full[name], p.grad)
          assert.is_true(e < 1e-10, ('%s sp=%s %s %g'):format(case[1], tostring(sp), name, e))
        end
      end
    end
    mesh.shard:free(); mesh.replicate:free()
  end)

  it('refuses a sequence it cannot split, and mismatched shapes, by name', function()
    local ctx = cp.context(nil)
    if W > 1 then
      local ids = ms.zeros({ 2, 2 * W + 1 }, { dtype = 'i64' })
      local ok, err = pcall(cp.shard, ids, ctx)
      assert.is_false(ok)
      assert.matches(('not a multiple of %d'):format(2 * W), err)
    end
    local q = ms.randn({ 1, 4, 2, 8 }, { dtype = 'f64' })
    local k = ms.randn({ 1, 3, 2, 8 }, { dtype = 'f64' })
    local ok, err = pcall(cp.attention, q, k, k, ctx)
    assert.is_false(ok)
    assert.matches('do not fit', err)
    ok, err = pcall(cp.attention, q, q, q, 'nope')
    assert.is_false(ok)
    assert.matches('expects a cp context', err)
    local m = build(cases[1])
    cp.apply(m, nil)
    if W > 1 then
      local ids = ms.zeros({ 1, 48 / W * 2 }, { dtype = 'i64' })   -- 2x n_positions in all
      ok, err = pcall(m, ids)
      assert.is_false(ok)
      assert.matches('n_positions 48', err)
    end
  end)
end)
