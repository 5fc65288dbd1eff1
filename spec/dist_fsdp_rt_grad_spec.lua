-- fsdp runtime over MPI (#mpi, 1-4 ranks): gradient accumulation (no_sync
-- and accumulation into the sharded gradient), clip_grad_norm over shards,
-- policy.by_size, opts.group, and argument errors. gpt2-tiny from the
-- shared fixtures; each rank has rows of its own and the one-process
-- references see every rank's rows.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil
local dir = T.root .. '/../shared/fixtures/gpt2-tiny'
local have_fixture = io.open(dir .. '/model.safetensors', 'rb')
if have_fixture then have_fixture:close() end

local SEQ = 16
local function load_model()
  return require('models.gpt2').from_pretrained(dir, { dtype = 'f32' })
end

-- `n` rows of token ids and targets from a fixed LCG, keyed by `key`
local function rows(key, n)
  local seed = 4242 + 7919 * key
  local ids, tg = FS.lcg_rows(seed, n, SEQ)
  return ids, tg
end
local function tensors(ids, tg) return ms.tensor(ids, { dtype = 'i64' }), ms.tensor(tg, { dtype = 'i64' }) end
-- micro-batch k (1-4) of rank r: one row
local function micro(r, k) return tensors(rows(100 * r + k, 1)) end

local rel = FS.rel

-- every parameter's full gradient (gathered from the shards), by name
local function gathered_grads(model)
  local r = {}
  for _, u in ipairs(fsdp.units(model)) do
    local fp = u.fp
    local full = T.zeros({ fp.total }, { dtype = 'f32' })
    local g = fp.shard.grad
    assert.is_not_nil(g)
    if fp.world_size > 1 then dist.all_gather_into(full, g, { group = fp.group }) else full:copy_(g) end
    for i, v in ipairs(fp:views(full)) do r[u.param_names[i]] = v end
  end
  return r
end

-- max over parameters of max|a - b| / max|b| (b: the reference's gradients),
-- and the parameter where it is reached
local function compare_grads(got, model_ref)
  local worst, wname, n = 0, '', 0
  for name, p in model_ref:named_parameters() do
    n = n + 1
    local a, b = got[name], p.grad
    assert.is_not_nil(a, name)
    local d = (a:to('f64') - b:to('f64')):abs():max():item()
    local s = b:to('f64'):abs():max():item()
    local e = d / math.max(s, 1e-30)
    if e > worst then worst, wname = e, name end
  end
  return worst, wname, n
end

describe('fsdp runtime: gradients #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not have_fixture then
    it('needs the gpt2-tiny fixture', function() pending('no ' .. dir) end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))
  local policy = function() return fsdp.policy.by_class { 'GPT2Block' } end
  local strategies = { 'FULL_SHARD', 'NO_SHARD' }
  if W % 2 == 0 then strategies[#strategies + 1] = 'HYBRID_SHARD' end
  -- 'HYBRID_SHARD': shard_size W / 2; 'HYBRID_SHARD RxS': opts.mesh = dist.mesh{replicate = R, shard = S}
  local function shard_opts(strategy)
    local R_, S_ = strategy:match('^HYBRID_SHARD (%d+)x(%d+)$')
    local o = { policy = policy(), strategy = R_ and 'HYBRID_SHARD' or strategy }
    if R_ then o.mesh = dist.mesh { replicate = tonumber(R_), shard = tonumber(S_) }
    elseif strategy == 'HYBRID_SHARD' then o.shard_size = W / 2 end
    return o
  end
  local report = {}

  -- the big batch: every rank's 4 micro-batches as one forward, its mean loss
  local big_ref
  local function big_reference()
    if big_ref then return big_ref end
    local ids, tg = {}, {}
    for r = 0, W - 1 do
      for k = 1, 4 do
        local a, b = rows(100 * r + k, 1)
        ids[#ids + 1] = a[1]; tg[#tg + 1] = b[1]
      end
    end
    big_ref = load_model()
    local loss = big_ref(tensors(ids, tg))
    loss:backward()
    return big_ref
  end

  for _, strategy in ipairs(strategies) do
    for _, use_no_sync in ipairs({ true, false }) do
      it(('%s: 4 micro-batches (loss / 4) %s equal one big batch'):format(
        strategy, use_no_sync and 'under no_sync' or 'accumulated into the shards'), function()
        local ref = big_reference()
        local model = fsdp.fully_shard(load_model(), shard_opts(strategy))
        local units = fsdp.units(model)
        local function micro_step(k)
          local x, y = micro(R, k)
          local loss = model(x, y) / 4
          loss:backward()
        end
        for k = 1, 3 do
          if use_no_sync then
            model:no_sync(function() micro_step(k) end)
            -- nothing communicated, nothing sharded yet: the unsharded f32
            -- gradients are kept
            for _, ev in ipairs(fsdp.trace(model)) do
              assert.is_nil(ev:match('^reduce_scatter') or ev:match('^all_reduce'), ev)
            end
            for _, u in ipairs(units) do
              assert.is_nil(u.fp.shard.grad)
              assert.are.equal('f32', u.gbuf.dtype)
            end
          else
            micro_step(k)
            for _, u in ipairs(units) do assert.is_not_nil(u.fp.shard.grad); assert.is_nil(u.gbuf) end
          end
        end
        micro_step(4)
        for _, u in ipairs(units) do assert.is_nil(u.gbuf) end
        local worst, wname, n = compare_grads(gathered_grads(model), ref)
        report[#report + 1] = ('accumulation %s no_sync=%s W=%d: %.2g (%s)'):format(
          strategy, tostring(use_no_sync), W, worst, wname)
        assert.is_true(n > 10)
        assert.is_true(worst < 1e-5, ('%s: gradient relative difference %.3g'):format(wname, worst))
        -- zero_grad clears the sharded gradients: the next backward starts afresh
        fsdp.zero_grad(model)
        for _, u in ipairs(units) do assert.is_nil(u.fp.shard.grad) end
      end)
    end
  end

  -- fsdp.reduce_grads: every backward under no_sync, then one reduction
  -- (bin/train --no-overlap-grad-reduce, and --cuda-graphs with several
  -- processes): the shards of the last backward's own reduction, bit for
  -- bit; grad_buffers / set_grad_buffers hand a kept buffer back
  for _, strategy in ipairs(strategies) do
    it(('%s: fsdp.reduce_grads after backwards under no_sync gives the synced backward\'s shards, bit for bit; '
      .. 'set_grad_buffers hands kept buffers back'):format(strategy), function()
      local function run(after, handback)
        local model = fsdp.fully_shard(load_model(), shard_opts(strategy))
        for k = 1, 2 do
          local function mb()
            local x, y = micro(R, k)
            local loss = model(x, y) / 2
            loss:backward()
          end
          if k == 1 or after then model:no_sync(mb) else mb() end
        end
        if handback then
          -- the buffers kept, the units' own let go (as a graph's replay
          -- leaves them: written, unseen by Lua), then handed back
          local kept = fsdp.grad_buffers(model)
          for i, u in ipairs(fsdp.units(model)) do
            assert.is_not_false(kept[i], u.label)
            assert.are.equal(u.fp.total, kept[i]:numel())
          end
          fsdp.zero_grad(model)
          for _, u in ipairs(fsdp.units(model)) do assert.is_nil(u.gbuf) end
          fsdp.set_grad_buffers(model, kept)
          for _, t in ipairs(kept) do t:free() end
        end
        if after then
          for _, u in ipairs(fsdp.units(model)) do assert.is_nil(u.fp.shard.grad); assert.is_not_nil(u.gbuf) end
          fsdp.reduce_grads(model)
        end
        local r = {}
        for i, u in ipairs(fsdp.units(model)) do
          assert.is_nil(u.gbuf)
          r[i] = u.fp.shard.grad:to('f64')
        end
        fsdp.reduce_grads(model)   -- (nothing held: a no-op)
        return r, model
      end
      local want = run(false)
      for _, handback in ipairs({ false, true }) do
        local got = run(true, handback)
        for i = 1, #want do
          assert.are.equal(0, (got[i] - want[i]):abs():max():item(), ('unit %d, handback %s'):format(i,
            tostring(handback)))
        end
      end
      -- a list that does not fit the units
      local _, model = run(false)
      local n = #fsdp.units(model)
      local ok, err = pcall(fsdp.set_grad_buffers, model, {})
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find(('need a list of %d entries'):format(n), 1, true), tostring(err))
      local bad = {}
      for i = 1, n do bad[i] = false end
      bad[1] = T.zeros({ 3 }, { dtype = 'f32' })
      ok, err = pcall(fsdp.set_grad_buffers, model, bad)
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find('entry 1 has 3 elements', 1, true), tostring(err))
    end)
  end

  -- fsdp.grad_shards / set_grad_shards (bin/train --cuda-graphs with the
  -- all-reduce in the graph: the reduced shards a replay wrote, handed back
  -- to the units), and fsdp.zero_grad dropping a reduction left in flight
  -- (a capture aborted inside fsdp.reduce_grads)
  for _, strategy in ipairs(strategies) do
    it(('%s: set_grad_shards hands kept gradient shards back; zero_grad drops a reduction left in flight'):format(
      strategy), function()
      local model = fsdp.fully_shard(load_model(), shard_opts(strategy))
      local units = fsdp.units(model)
      local function step()
        for k = 1, 2 do
          model:no_sync(function()
            local x, y = micro(R, k)
            local loss = model(x, y) / 2
            loss:backward()
          end)
        end
      end
      local function same(want, what)
        for i, u in ipairs(units) do
          assert.is_nil(u.gbuf, what)
          assert.are.equal(u.fp.shard.grad, u.fp.grad_shard, what)
          assert.are.equal(0, (u.fp.shard.grad:to('f64') - want[i]):abs():max():item(), ('%s: unit %d'):format(what, i))
        end
      end
      step()
      fsdp.reduce_grads(model)
      local want = {}
      for i, u in ipairs(units) do want[i] = u.fp.shard.grad:to('f64') end
      local kept = fsdp.grad_shards(model)
      for i, u in ipairs(units) do assert.are.equal(u.fp.shard_numel, kept[i]:numel(), u.label) end
      fsdp.zero_grad(model)
      for _, u in ipairs(units) do assert.is_nil(u.fp.shard.grad) end
      -- (a later backward's unsharded buffers are dropped by the hand-back)
      step()
      fsdp.set_grad_shards(model, kept)
      same(want, 'handed back')
      fsdp.set_grad_shards(model, kept)   -- (twice: the same)
      same(want, 'handed back twice')
      for _, t in ipairs(kept) do t:free() end
      -- one unit's reduction issued, the step cut short before it finished
      fsdp.zero_grad(model)
      step()
      units[1]:reduce_grads()
      assert.are.equal(1, #units[1].st.pending)
      fsdp.zero_grad(model)
      assert.are.equal(0, #units[1].st.pending)
      for _, u in ipairs(units) do
        assert.is_nil(u.gbuf)
        assert.is_nil(u.fp.shard.grad)
      end
      -- the next step as the first
      step()
      fsdp.reduce_grads(model)
      same(want, 'after the dropped reduction')
      -- lists that do not fit the units
      local ok, err = pcall(fsdp.set_grad_shards, model, {})
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find(('need a list of %d entries'):format(#units), 1, true), tostring(err))
      local bad = {}
      for i = 1, #units do bad[i] = false end
      bad[1] = T.zeros({ 3 }, { dtype = 'f32' })
      ok, err = pcall(fsdp.set_grad_shards, model, bad)
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find('entry 1 has 3 elements', 1, true), tostring(err))
      same(want, 'after a refused list')   -- (nothing changed)
    end)
  end

  -- clip_grad_norm: the reference runs each rank's rows as a forward of its own
  local clip_ref
  local function clip_reference()
    if clip_ref then return clip_ref end
    local m = load_model()
    local loss
    for r = 0, W - 1 do
      local x, y = tensors(rows(500 + r, 2))
      local l = m(x, y)
      loss = loss and loss + l or l
    end
    (loss / W):backward()
    local unclipped = ms.optim.clip_grad_norm(m, 1e9)
    local norm = ms.optim.clip_grad_norm(m, 0.25 * unclipped)
    clip_ref = { model = m, norm = norm, max_norm = 0.25 * unclipped }
    return clip_ref
  end
  local clip_strategies = { 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }
  if W % 2 == 0 then clip_strategies[#clip_strategies + 1] = 'HYBRID_SHARD' end
  -- the two degenerate meshes: all replicas (like NO_SHARD), one shard group (like FULL_SHARD)
  clip_strategies[#clip_strategies + 1] = ('HYBRID_SHARD %dx1'):format(W)
  if W > 1 then clip_strategies[#clip_strategies + 1] = ('HYBRID_SHARD 1x%d'):format(W) end
  for _, strategy in ipairs(clip_strategies) do
    it(('clip_grad_norm under %s: the unsharded norm (1e-6) and the clipped gradients'):format(strategy), function()
      local ref = clip_reference()
      local model = fsdp.fully_shard(load_model(), shard_opts(strategy))
      local x, y = tensors(rows(500 + R, 2))
      model(x, y):backward()
      local norm = fsdp.clip_grad_norm(model, ref.max_norm)
      assert.is_true(T.is_tensor(norm))
      local e = rel(norm:item(), ref.norm)
      report[#report + 1] = ('clip %s W=%d: norm %.9g vs %.9g, rel %.2g'):format(strategy, W, norm:item(), ref.norm, e)
      assert.is_true(e < 1e-6, ('norm %.9g, unsharded %.9g'):format(norm:item(), ref.norm))
      local worst, wname = compare_grads(gathered_grads(model), ref.model)
      assert.is_true(worst < 1e-5, ('%s: clipped gradient relative difference %.3g'):format(wname, worst))
      -- clipped: the norm of the scaled gradients is max_norm
      local again = fsdp.clip_grad_norm(model, 1e9):item()
      assert.is_true(rel(again, ref.max_norm) < 1e-5, ('%.9g after clipping, max_norm %.9g'):format(again, ref.max_norm))
    end)
  end

  it('clip_grad_norm { defer = the fsdp.AdamW }: the same steps as clipping the shards first, bit for bit', function()
    local function run(defer)
      local model = fsdp.fully_shard(load_model(), shard_opts('FULL_SHARD'))
      local opt = fsdp.AdamW(model, { lr = 1e-2 })
      for s = 1, 3 do
        opt:zero_grad()
        local x, y = tensors(rows(700 + 10 * s + R, 2))
        model(x, y):backward()
        fsdp.clip_grad_norm(model, 0.01, { defer = defer and opt or nil })
        opt:step()
      end
      local out = {}
      for i, u in ipairs(fsdp.units(model)) do out[i] = u.fp.shard:to('f64'):totable() end
      return out
    end
    assert.are.same(run(false), run(true))
    local model = fsdp.fully_shard(load_model(), shard_opts('FULL_SHARD'))
    local ok, err = pcall(fsdp.clip_grad_norm, model, 1.0, { defer = {} })
    assert.is_false(ok)
    assert.matches('defer must be an optimizer with defer_grad_scale', err, 1, true)
  end)

  it('policy.by_size: children first; a tied tensor stays in the root; training matches one process', function()
    local function unit_names(n)
      local m = fsdp.fully_shard(load_model(), { policy = fsdp.policy.by_size(n) })
      local r = {}
      for i, u in ipairs(fsdp.units(m)) do r[i] = u.name end
      return r, m
    end
    -- gpt2-tiny: mlp 33088 parameters, attn 16640, the two LayerNorms of a
    -- block 256, wte 16384 (the LM head's weight: the root's), wpe 4096,
    -- ln_f 128. 30000: each mlp; then h holds 2 x (16640 + 256) >= 30000.
    assert.are.same({ '', 'transformer.h', 'transformer.h.0.mlp', 'transformer.h.1.mlp' }, (unit_names(30000)))
    -- 20000: the mlps, h (33792 left), then transformer (wte + wpe + ln_f =
    -- 20608 >= 20000; wte goes on to the root as the head's weight)
    assert.are.same({ '', 'transformer', 'transformer.h', 'transformer.h.0.mlp', 'transformer.h.1.mlp' },
      (unit_names(20000)))
    -- 10000: c_attn (12480), c_fc (16640) and mlp.c_proj (16448) of each
    -- block first; then transformer (wte + wpe + ln_f + the blocks' rest),
    -- whose wte the root takes
    local names, m = unit_names(10000)
    assert.are.same({ '', 'transformer', 'transformer.h.0.attn.c_attn', 'transformer.h.0.mlp.c_fc',
      'transformer.h.0.mlp.c_proj', 'transformer.h.1.attn.c_attn', 'transformer.h.1.mlp.c_fc',
      'transformer.h.1.mlp.c_proj' }, names)
    assert.are.same({ 'transformer.wte.weight' }, fsdp.units(m)[1].param_names)
    -- nested units (a function policy): a block unit holds what its mlp unit did not take
    local nested = {}
    local mm = fsdp.fully_shard(load_model(), { policy = function(mod, name)
      return mod:class_name() == 'GPT2Block' or name:match('%.mlp$') ~= nil end })
    for i, u in ipairs(fsdp.units(mm)) do nested[i] = u.name end
    assert.are.same({ '', 'transformer.h.0', 'transformer.h.0.mlp', 'transformer.h.1', 'transformer.h.1.mlp' }, nested)
    assert.are.same({ 'transformer.h.0.attn.c_attn.weight', 'transformer.h.0.attn.c_proj.weight',
      'transformer.h.0.ln_1.weight', 'transformer.h.0.ln_1.bias', 'transformer.h.0.attn.c_attn.bias',
      'transformer.h.0.attn.c_proj.bias', 'transformer.h.0.ln_2.weight', 'transformer.h.0.ln_2.bias' },
      fsdp.units(mm)[2].param_names)   -- decayed (2-d, not norm/bias) first
    local opts = { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 }
    local ref = load_model()
    local ropt = ms.optim.AdamW(ref, opts)
    local x, y = tensors(rows(900, 2))
    local opt = fsdp.AdamW(m, opts)
    for s = 1, 3 do
      -- one tape: each model's forward and backward together
      local lr = ref(x, y); local vr = lr:item(); lr:backward(); ropt:step(); ropt:zero_grad()
      local l = m(x, y)
      assert.is_true(rel(l:item(), vr) < 1e-5, ('step %d: %.9g vs %.9g'):format(s, l:item(), vr))
      l:backward(); opt:step(); opt:zero_grad()
    end
  end)

  it('fsdp.SGD (momentum, nesterov, L2 decay on every element) matches optim.SGD in one process', function()
    local opts = { lr = 0.05, momentum = 0.9, nesterov = true, weight_decay = 0.01 }
    local ref = load_model()
    local ropt = ms.optim.SGD(ref, opts)
    local m = fsdp.fully_shard(load_model(), shard_opts('FULL_SHARD'))
    local opt = fsdp.SGD(m, opts)
    local x, y = tensors(rows(800, 2))
    for s = 1, 4 do
      local lr = ref(x, y); local vr = lr:item(); lr:backward(); ropt:step(); ropt:zero_grad()
      local l = m(x, y)
      assert.is_true(rel(l:item(), vr) < 1e-5, ('step %d: %.9g vs %.9g'):format(s, l:item(), vr))
      l:backward(); opt:step(); opt:zero_grad()
    end
    local ok, err = pcall(fsdp.optimizer, m, 'AdamW', {})
    assert.is_false(ok)
    assert.matches('optimizer class', err, 1, true)
  end)

  it('opts.group: FULL_SHARD within pairs of ranks, each pair trains alone', function()
    local groups = {}
    for a = 0, W - 1, 2 do
      local ranks = { a }
      if a + 1 < W then ranks[2] = a + 1 end
      groups[#groups + 1] = dist.new_group(ranks)
    end
    local mine
    for _, g in ipairs(groups) do if g:is_member() then mine = g end end
    local model = fsdp.fully_shard(load_model(), { policy = policy(), group = mine })
    for _, u in ipairs(fsdp.units(model)) do
      assert.are.equal(mine:size(), u.fp.world_size)
      assert.are.equal(mine, u.fp.group)
    end
    local opts = { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 }
    local ref = load_model()
    local ropt = ms.optim.AdamW(ref, opts)
    local opt = fsdp.AdamW(model, opts)
    local x, y = tensors(rows(700, 2))      -- the same rows on every rank
    for s = 1, 3 do
      local lr = ref(x, y); local vr = lr:item(); lr:backward(); ropt:step(); ropt:zero_grad()
      local l = model(x, y)
      assert.is_true(rel(l:item(), vr) < 1e-5, ('step %d: %.9g vs %.9g'):format(s, l:item(), vr))
      l:backward(); opt:step(); opt:zero_grad()
    end
  end)

  it('bad options are errors naming them', function()
    local function err(o)
      local ok, e = pcall(fsdp.fully_shard, load_model(), o)
      assert.is_false(ok)
      return tostring(e)
    end
    assert.matches("strategy ZERO", err { strategy = 'ZERO' })
    assert.matches('not group', err { strategy = 'HYBRID_SHARD', group = dist.world_group })
    if W > 1 then assert.matches('shard_size 7 does not divide', err { strategy = 'HYBRID_SHARD', shard_size = 7 }) end
    assert.matches('mixed_precision.param = int8', err { mixed_precision = { param = 'int8' } })
    assert.matches('limit_all_gathers', err { limit_all_gathers = 0 })
    assert.matches('not a process group', err { group = 'world' })
    assert.matches('policy must be', err { policy = 42 })
    local ok, e = pcall(fsdp.clip_grad_norm, load_model(), 1.0)
    assert.is_false(ok)
    assert.matches('not passed to fsdp.fully_shard', tostring(e))
    local m = fsdp.fully_shard(load_model())
    assert.matches('already sharded', select(2, pcall(fsdp.fully_shard, m)))
    assert.matches('max_norm', select(2, pcall(fsdp.clip_grad_norm, m, -1)))
  end)

  it('reports the measured differences (rank 0, MS_FSDP_REPORT=1)', function()
    if R == 0 and os.getenv('MS_FSDP_REPORT') == '1' then io.stderr:write('\n' .. table.concat(report, '\n') .. '\n') end
  end)
end)
