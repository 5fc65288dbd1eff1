-- fsdp runtime over MPI (#mpi, 1-4 ranks): the sharded AdamW's decay split,
-- mixed precision, memory released at reshard (read from the allocator's
-- byte counter), and prefetch with its limit (read from the debug trace).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local S = require 'spec.support'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local F = require 'moonshard.ops'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil
local dir = T.root .. '/../shared/fixtures/gpt2-tiny'
local have_fixture = io.open(dir .. '/model.safetensors', 'rb')
if have_fixture then have_fixture:close() end

local SEQ = 16
local function load_model()
  return require('models.gpt2').from_pretrained(dir, { dtype = 'f32' })
end
local function rows(key, n)
  local seed = 777 + 7919 * key
  return FS.lcg_batch(seed, n, SEQ)
end
local rel = FS.rel
local max_rel = FS.max_rel
local norm_rel = FS.norm_rel
-- the CPU bytes of live storages once the collector has nothing more to
-- free (S.settled)
local function live()
  ms.autograd.clear_tape()     -- a forward without backward keeps its tape
  return S.settled(function() return ms.live_bytes(-1) end)
end

-- n training steps on one batch (no handle on the loss kept after each)
local function train_steps(model, opt, x, y, n)
  for _ = 1, n do
    local loss = model(x, y)
    loss:backward()
    opt:step()
    opt:zero_grad()
  end
end

-- run fn() (it returns a list of failed checks) up to 3 times, all ranks
-- together, until no rank fails: an allocator reading counts every CPU
-- storage of the process, so garbage of earlier specs that the collector
-- only reaches later can spoil one attempt
local function measured(fn)
  local fails
  for _ = 1, 3 do
    fails = fn()
    local f = ms.tensor({ #fails }, { dtype = 'f64' })
    dist.all_reduce(f, 'max')
    if f:item() == 0 then return fails end
  end
  return fails
end

-- a small model with four blocks (units) and the root's own layers
local function toy()
  local nn = ms.nn
  local Blk = nn.Module:extend('FsdpRtBlock')
  function Blk:init(d) self:register_module('fc', nn.Linear(d, d)) end
  function Blk:forward(x) return self.fc(x):tanh() + x end
  local Toy = nn.Module:extend('FsdpRtToy')
  function Toy:init(d, n)
    self:register_module('inp', nn.Linear(d, d))
    local b = {}
    for i = 1, n do b[i] = Blk(d) end
    self:register_module('blocks', nn.ModuleList(b))
    self:register_module('out', nn.Linear(d, 1))
  end
  function Toy:forward(x)
    local h = self.inp(x)
    for _, blk in ipairs(self.blocks) do h = blk(h) end
    return self.out(h):square():mean()
  end
  local m = Toy(12, 4)
  ms.no_grad(function()
    for i, p in ipairs(m:parameters()) do p:copy_(ms.randn(p.shape, { seed = 31 + i }) * 0.3) end
  end)
  return m, Blk
end

describe('fsdp runtime: optimizer, mixed precision, memory, prefetch #mpi', function()
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
  local report = {}
  local block_policy = function() return fsdp.policy.by_class { 'GPT2Block' } end

  it('fsdp.AdamW: decayed parameters first in every layout, at most two ranges per shard, one fused call per group', function()
    local optim = ms.optim
    local model = fsdp.fully_shard(load_model(), { policy = block_policy() })
    for _, u in ipairs(fsdp.units(model)) do
      local seen_nodecay = false
      for i, name in ipairs(u.param_names) do
        local nd = optim.no_decay(name, u.views[i])
        if seen_nodecay then assert.is_true(nd, name .. ' (decayed) after a no-decay parameter') end
        seen_nodecay = seen_nodecay or nd
      end
    end
    local opt = fsdp.AdamW(model, { lr = 1e-3, weight_decay = 0.1 })
    assert.is_true(#opt.param_groups <= 2)
    local per_unit = {}
    for _, pc in ipairs(opt.fsdp_pieces) do
      per_unit[pc.unit] = (per_unit[pc.unit] or 0) + 1
      -- a decayed range covers only decayed parameters' elements (and padding)
      local lo = pc.unit.fp.rank * pc.unit.fp.shard_numel + pc.off
      if pc.decay then assert.is_true(lo + pc.n <= pc.unit.decay_end)
      else assert.is_true(lo >= pc.unit.decay_end) end
    end
    for _, u in ipairs(fsdp.units(model)) do assert.is_true(per_unit[u] >= 1 and per_unit[u] <= 2) end
    for _, g in ipairs(opt.param_groups) do
      assert.are.equal(g.params[1] == opt.fsdp_pieces[1].p and (opt.fsdp_pieces[1].decay and 0.1 or 0) or g.weight_decay,
        g.weight_decay)
    end
    -- count the fused calls of one step
    local calls, orig = 0, F.adamw_
    F.adamw_ = function(...) calls = calls + 1; return orig(...) end
    local x, y = rows(10 + R, 2)
    model(x, y):backward()
    local ok, err = pcall(opt.step, opt)
    F.adamw_ = orig
    assert.is_true(ok, tostring(err))
    assert.are.equal(#opt.param_groups, calls)
    opt:zero_grad()
  end)

  it('predivide_factor is the largest power of 2 <= sqrt(n)', function()
    local want = { [1] = 1, [2] = 1, [3] = 1, [4] = 2, [8] = 2, [9] = 2, [15] = 2, [16] = 4, [64] = 8, [100] = 8 }
    for n, f in pairs(want) do assert.are.equal(f, fsdp.predivide_factor(n), 'n = ' .. n) end
  end)

  local STEPS = 5
  local f32_run
  local function run(mp, strategy)
    local model = fsdp.fully_shard(load_model(), { policy = block_policy(), mixed_precision = mp,
      strategy = strategy or 'FULL_SHARD' })
    local opt = fsdp.AdamW(model, { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 })
    local x, y = rows(40 + R, 2)
    local losses = {}
    for s = 1, STEPS do
      local loss = model(x, y)
      local l = loss:detach():reshape({ 1 }):to('f32')
      dist.all_reduce(l, 'avg')
      losses[s] = l:item()
      loss:backward()
      opt:step()
      opt:zero_grad()
    end
    fsdp.unshard(model)
    local params = {}
    for name, p in model:named_parameters() do params[#params + 1] = { name, p:to('f32'):clone() } end
    fsdp.reshard(model)
    return { losses = losses, params = params, model = model }
  end

  for _, reduce in ipairs({ 'f32', 'bf16' }) do
    it(('mixed precision {param = bf16, reduce = %s}: within bf16 bounds (1e-2) of the f32 run; f32 master shards'):format(reduce), function()
      f32_run = f32_run or run(nil)
      -- the reductions run in the reduce dtype
      local seen, orig = {}, dist.reduce_scatter
      dist.reduce_scatter = function(out, inp, op, o) seen[inp.dtype] = true; return orig(out, inp, op, o) end
      local ok, got = pcall(run, { param = 'bf16', reduce = reduce })
      dist.reduce_scatter = orig
      assert.is_true(ok, tostring(got))
      if W > 1 then assert.are.same({ [reduce] = true }, seen) end
      local wl = 0
      for s = 1, STEPS do wl = math.max(wl, rel(got.losses[s], f32_run.losses[s])) end
      -- every parameter as one vector: ||bf16 run - f32 run|| / ||f32 run||
      -- (one tensor alone can be noise: the attention key bias's gradient is
      -- rounding noise, and Adam steps it by +-lr whatever its size)
      local d2, r2 = 0, 0
      for k, e in ipairs(got.params) do
        assert.are.equal(f32_run.params[k][1], e[1])
        local a, b = e[2]:to('f64'), f32_run.params[k][2]:to('f64')
        d2 = d2 + (a - b):square():sum():item()
        r2 = r2 + b:square():sum():item()
      end
      local wp = math.sqrt(d2 / r2)
      report[#report + 1] = ('mixed precision reduce=%s W=%d: loss %.2g, parameters %.2g'):format(reduce, W, wl, wp)
      assert.is_true(wl < 1e-2, ('loss relative difference %.3g'):format(wl))
      assert.is_true(wp < 1e-2, ('parameter relative difference %.3g'):format(wp))
      assert.is_true(wl > 0)        -- bf16 did change something
      for _, u in ipairs(fsdp.units(got.model)) do
        assert.are.equal('f32', u.fp.shard.dtype)
        assert.are.equal('bf16', u.flat.dtype)
        assert.are.equal('bf16', u.lp.dtype)
        -- the low-precision copy was refreshed after the last step
        assert.are.equal(0, (u.lp:to('f32') - u.fp.shard:to('bf16'):to('f32')):abs():max():item())
        assert.is_false(u.lp_stale == true)
      end
    end)
  end

  -- copy-engine gathers (docs/fsdp.md): the copy itself needs CUDA IPC, its
  -- bookkeeping ('emulate': the same fences, the copy an all_gather_into)
  -- runs here
  it('copy_gather: a fence before the first gather after every refresh, and before a refresh that copies may still read; the steps equal the plain gathers', function()
    local function fences(tr)
      local out = {}
      for _, ev in ipairs(tr) do if ev:match('^fence ') then out[#out + 1] = ev end end
      return out
    end
    local function steps(cg, forward_only_at)
      local model = fsdp.fully_shard(load_model(), { policy = block_policy(), mixed_precision = { param = 'bf16' },
        copy_gather = cg })
      local opt = fsdp.AdamW(model, { lr = 1e-3, eps = 1e-6 })
      local x, y = rows(60 + R, 2)
      local losses, fl = {}, {}
      for s = 1, 3 do
        local loss = model(x, y)
        losses[s] = loss:item()
        if s == forward_only_at then
          fsdp.after_step(model)          -- no backward: the copies the forward read are still in flight
        else
          loss:backward()
          opt:step()
          opt:zero_grad()
        end
        fl[s] = fences(fsdp.trace(model))
      end
      fsdp.unshard(model)
      local params = {}
      for name, p in model:named_parameters() do params[#params + 1] = { name, p:to('f32'):clone() } end
      fsdp.reshard(model)
      return losses, params, fl
    end
    local l0, p0 = steps(false)
    local l1, p1, f1 = steps('emulate')
    local l2, _, f2 = steps('emulate', 2)
    for s = 1, 3 do assert.are.equal(l0[s], l1[s]) end
    for k = 1, #p0 do assert.are.equal(0, (p0[k][2] - p1[k][2]):abs():max():item(), p0[k][1]) end
    if W == 1 then
      -- one rank gathers nothing: no registration, no fence
      for s = 1, 3 do assert.are.same({}, f1[s]) end
      return
    end
    -- one fence per step, at the root's gather (the first after the refresh);
    -- the reduce-scatters made the before-refresh fence unnecessary
    for s = 1, 3 do assert.are.same({ 'fence root' }, f1[s], table.concat(f1[s], ', ')) end
    -- a forward without a backward: after_step fences (and waits) before the refresh
    assert.are.same({ 'fence root', 'fence after_step' }, f2[2], table.concat(f2[2], ', '))
    assert.are.same({ 'fence root' }, f2[3])
    assert.are.equal(l1[1], l2[1])
    local ok, err = pcall(fsdp.fully_shard, load_model(), { policy = block_policy(), copy_gather = 'yes' })
    assert.is_false(ok)
    assert.matches("copy_gather must be true, false or 'emulate'", err, 1, true)
  end)

  it('mixed precision: the unsharded gradient buffer is written by the gradients and zeros, its padding reduced as zero', function()
    local model = fsdp.fully_shard(load_model(), { policy = block_policy(), mixed_precision = { param = 'bf16' } })
    local x, y = rows(9 + R, 2)
    for _ = 1, 2 do   -- the second backward adds into the sharded gradient
      model(x, y):backward()
    end
    for _, u in ipairs(fsdp.units(model)) do
      local fp, lay = u.fp, u.fp.layout
      local g = u.fp.shard.grad:to('f64'):totable()
      local lo = fp.rank * fp.shard_numel
      local covered = {}
      for i = 1, fp.nparams do
        for k = math.max(lay.offsets[i], lo), math.min(lay.offsets[i] + lay.numels[i], lo + fp.shard_numel) - 1 do
          covered[k - lo + 1] = true
        end
      end
      local pad, nonzero = 0, 0
      for k = 1, fp.shard_numel do
        if not covered[k] then
          pad = pad + 1
          assert.are.equal(0, g[k], ('unit %s: padding element %d of the shard'):format(u.label, k))
        elseif g[k] ~= 0 then nonzero = nonzero + 1 end
      end
      assert.is_true(nonzero > 0, u.label)
    end
  end)

  it('an unshard gathers the kept low-precision copy: no cast of the shard per unshard', function()
    local model = fsdp.fully_shard(load_model(), { policy = block_policy(), mixed_precision = { param = 'bf16' } })
    local casts, orig = 0, T.methods.to
    local shards = {}
    for _, u in ipairs(fsdp.units(model)) do shards[tonumber(u.fp.shard.id)] = true end
    T.methods.to = function(t, ...) if shards[tonumber(t.id)] then casts = casts + 1 end; return orig(t, ...) end
    local ok, err = pcall(function()
      local x, y = rows(3, 1)
      for _ = 1, 2 do model(x, y):backward() end
    end)
    T.methods.to = orig
    assert.is_true(ok, tostring(err))
    assert.are.equal(0, casts)
  end)

  it('memory: per-rank parameter bytes are total / world, plus the unsharded units in flight', function()
    -- checks are collected and asserted at the end: a rank failing early
    -- would leave the others in a collective
    local fails
    local function eq(want, got, what)
      if want ~= got then fails[#fails + 1] = ('%s: %s, expected %s'):format(what, tostring(got), tostring(want)) end
    end
    measured(function()
    fails = {}
    local L0 = live()
    local model = fsdp.fully_shard(load_model(), { policy = block_policy() })
    local units = fsdp.units(model)
    local shard_bytes, flat_bytes, total_bytes = 0, {}, 0
    for i, u in ipairs(units) do
      shard_bytes = shard_bytes + u.fp.shard_numel * 4
      total_bytes = total_bytes + u.fp.total * 4
      flat_bytes[i] = u.fp.total * u.flat:element_size()
      eq(0, T.C.ms_storage_has_data(u.flat), 'data of a unit after fully_shard')
    end
    eq(total_bytes / W, shard_bytes, 'shard bytes')
    local L1 = live()
    report[#report + 1] = ('memory W=%d: %d parameter bytes after fully_shard, total %d'):format(W, L1 - L0, total_bytes)
    eq(shard_bytes, L1 - L0, 'bytes after fully_shard')
    -- unshard units one by one: each adds its unsharded buffer
    local extra = 0
    for i, u in ipairs(units) do
      u:unshard()
      extra = extra + flat_bytes[i]
      eq(shard_bytes + extra, live() - L0, 'bytes with units 1..' .. i .. ' unsharded')
    end
    fsdp.reshard(model)
    eq(shard_bytes, live() - L0, 'bytes after reshard')
    -- during a forward at most the root, the running block and the prefetched one hold data
    local during = {}
    for k, u in ipairs(units) do
      if k > 1 then
        u.module:register_forward_pre_hook(function()
          local n = 0
          for _, v in ipairs(units) do n = n + T.C.ms_storage_has_data(v.flat) end
          during[#during + 1] = n
        end)
      end
    end
    local opt = fsdp.AdamW(model, { lr = 1e-3 })
    local x, y = rows(20 + R, 2)
    train_steps(model, opt, x, y, 2)
    for _, n in ipairs(during) do eq(true, n >= 2 and n <= 3, 'units with data in forward: ' .. n) end
    -- after the steps: master shards + AdamW's two moments (and the batch),
    -- nothing unsharded
    ms.autograd.clear_tape()
    eq(3 * shard_bytes + 8 * (x:numel() + y:numel()), live() - L0, 'bytes after two steps')
    -- a released parameter is an error naming the release, not a crash
    local w = model.transformer.h[1].attn.c_attn.weight
    for _, f in ipairs({ function() return w:sum() end, function() return w + 1 end,
      function() return tostring(w) end, function() return ms.matmul(w, w:t()) end }) do
      local ok, e = pcall(f)
      eq(false, ok, 'use of a released parameter')
      eq(true, tostring(e):find('released by ms_storage_free_data', 1, true) ~= nil, tostring(e))
    end
    fsdp.unshard(model)
    eq(true, w:sum():item() == w:sum():item(), 'usable again')
    fsdp.reshard(model)
    opt = nil
    return fails
    end)
    assert.are.same({}, fails)
  end)

  it('memory: NO_SHARD keeps every unit unsharded, its parameters views of the whole-model f32 shard (total bytes once)', function()
    local fails = measured(function()
      local L0 = live()
      local model = fsdp.fully_shard(load_model(), { policy = block_policy(), strategy = 'NO_SHARD' })
      local total, r = 0, {}
      for _, u in ipairs(fsdp.units(model)) do
        total = total + u.fp.total * 4
        if T.C.ms_storage_has_data(u.flat) ~= 1 then r[#r + 1] = u.label .. ' has no data' end
      end
      local got = live() - L0
      if got ~= total then r[#r + 1] = ('%d bytes, expected %d'):format(got, total) end
      return r
    end)
    assert.are.same({}, fails)
  end)

  -- prefetch: the toy model's units are the root and four blocks
  local function toy_trace(o)
    local m, Blk = toy()
    o.policy = fsdp.policy.by_class { Blk }
    fsdp.fully_shard(m, o)
    local x = ms.randn({ 3, 12 }, { seed = 5 + R })
    local opt = fsdp.AdamW(m, { lr = 1e-2 })
    local losses = {}
    for s = 1, 3 do
      local l = m(x)
      local v = l:detach():reshape({ 1 }):clone()
      dist.all_reduce(v, 'avg')
      losses[s] = v:item()
      l:backward(); opt:step(); opt:zero_grad()
    end
    return fsdp.trace(m), losses, m
  end
  local function pos(tr, ev)
    for i, e in ipairs(tr) do if e == ev then return i end end
    return nil
  end
  -- the most units gathered or being gathered at once, replayed from a trace
  local function replay_max(tr)
    local n, mx, held = 0, 0, {}
    for _, e in ipairs(tr) do
      local what, name = e:match('^(%S+) (.+)$')
      if what == 'all_gather' then held[name] = true; n = n + 1
      elseif what == 'reshard' and held[name] then held[name] = nil; n = n - 1 end
      mx = math.max(mx, n)
    end
    return mx
  end

  it('forward and backward prefetch follow the recorded order; the limit holds', function()
    local tr, losses, m = toy_trace { limit_all_gathers = 3 }
    local blocks = {}
    for i = 0, 3 do blocks[i] = 'blocks.' .. i end
    -- forward: block k+1 is gathered when block k's forward starts, before its own forward
    for k = 1, 3 do
      local g, f = pos(tr, 'all_gather ' .. blocks[k]), pos(tr, 'forward ' .. blocks[k])
      assert.is_truthy(g); assert.is_truthy(f)
      assert.is_true(g < f, blocks[k] .. ' was not prefetched in forward')
      assert.is_true(pos(tr, 'forward ' .. blocks[k - 1]) < g)
    end
    -- backward order is the reverse; block k-1 gathered before its backward starts
    local bw = {}
    for _, e in ipairs(tr) do local n = e:match('^backward (.+)$'); if n then bw[#bw + 1] = n end end
    assert.are.same({ 'root', blocks[3], blocks[2], blocks[1], blocks[0] }, bw)
    for k = 2, 0, -1 do
      local b = pos(tr, 'backward ' .. blocks[k])
      local g
      for i = b, 1, -1 do if tr[i] == 'all_gather ' .. blocks[k] then g = i; break end end
      assert.is_truthy(g)
      assert.is_true(g > pos(tr, 'backward ' .. blocks[k + 1]), 'gathered in backward after the block before it started')
    end
    local rs = {}
    for _, e in ipairs(tr) do local n = e:match('^reduce_scatter (.+)$'); if n then rs[#rs + 1] = n end end
    assert.are.same({ blocks[3], blocks[2], blocks[1], blocks[0], 'root' }, rs)
    assert.is_true(replay_max(tr) <= 3)
    assert.is_true(fsdp.max_inflight(m) <= 3)
    -- the same losses without prefetch, and the gathers then follow the forwards
    local tr0, losses0 = toy_trace { forward_prefetch = false, backward_prefetch = false }
    for s = 1, 3 do assert.are.equal(losses0[s], losses[s]) end
    for k = 1, 3 do assert.is_true(pos(tr0, 'all_gather ' .. blocks[k]) > pos(tr0, 'forward ' .. blocks[k])) end
    assert.is_nil(pos(tr0, 'limit ' .. blocks[1]))
    -- limit 2: the root and the running block; every prefetch is held back
    local tr2, losses2, m2 = toy_trace { limit_all_gathers = 2 }
    for s = 1, 3 do assert.are.equal(losses2[s], losses[s]) end
    assert.are.equal(2, replay_max(tr2))
    assert.are.equal(2, fsdp.max_inflight(m2))
    assert.is_truthy(pos(tr2, 'limit ' .. blocks[1]))
    report[#report + 1] = ('prefetch W=%d: trace of %d events, at most %d units gathered (limit 3), %d (limit 2)'):format(
      W, #tr, replay_max(tr), replay_max(tr2))
  end)

  it('activation checkpointing inside units matches one process; a forward under no_grad leaves every unit sharded', function()
    local x, y = rows(60, 2)      -- the same rows on every rank
    local ref = load_model()
    local m = fsdp.fully_shard(load_model(), { policy = block_policy() })
    for _, blk in ipairs(m.transformer.h) do
      local f = blk.forward
      blk.forward = function(self, h) return ms.checkpoint(function(v) return f(self, v) end, h) end
    end
    local o = { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 }
    local ropt, opt = ms.optim.AdamW(ref, o), fsdp.AdamW(m, o)
    for s = 1, 3 do
      local lr = ref(x, y); local a = lr:item(); lr:backward(); ropt:step(); ropt:zero_grad()
      local l = m(x, y); local b = l:item(); l:backward(); opt:step(); opt:zero_grad()
      assert.is_true(rel(b, a) < 1e-5, ('step %d: %.9g vs %.9g'):format(s, b, a))
    end
    local v = ms.no_grad(function() return m(x, y) end)
    local rv = ms.no_grad(function() return ref(x, y) end)
    assert.is_true(rel(v:item(), rv:item()) < 1e-5)
    for _, u in ipairs(fsdp.units(m)) do
      assert.are.equal('sharded', u.status)
      assert.are.equal(0, T.C.ms_storage_has_data(u.flat))
    end
  end)

  -- docs/fsdp.md "Mixed precision": with bf16 parameters the affine layers'
  -- weight GEMMs write their gradient in f32 straight into the unit's f32
  -- unsharded buffer (A.set_grad_sink), where before a bf16 gradient was
  -- made and copied in. The same gradients, unrounded.
  local sink_strategies = { 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }
  if W % 2 == 0 then sink_strategies[#sink_strategies + 1] = 'HYBRID_SHARD' end
  for _, strategy in ipairs(sink_strategies) do
    it(strategy .. ', grad sinks: the weight GEMMs write f32 gradients into the unsharded buffer; one backward\'s gradient shards are those of the bf16 gradients, unrounded (on one rank: equal once rounded to bf16)', function()
      local function grads(sinks)
        local model = fsdp.fully_shard(load_model(), { policy = block_policy(), mixed_precision = { param = 'bf16' },
          grad_sinks = sinks, strategy = strategy, shard_size = strategy == 'HYBRID_SHARD' and W / 2 or nil })
        local x, y = rows(90 + R, 2)
        local n, orig = 0, F.gemm_
        F.gemm_ = function(out, ...) if out.dtype == 'f32' then n = n + 1 end; return orig(out, ...) end
        local ok, err = pcall(function() model(x, y):backward() end)
        F.gemm_ = orig
        assert(ok, err)
        local out = {}
        for _, u in ipairs(fsdp.units(model)) do
          out[#out + 1] = u.fp.shard.grad:clone()
          -- no view keeps a sink after its unit's backward
          for _, v in ipairs(u.views) do assert.is_nil(v.grad) end
        end
        return out, n
      end
      local a, na = grads(true)
      local b, nb = grads(false)
      -- GPT-2 block: c_attn, attn c_proj, c_fc, mlp c_proj; some rank's
      -- shard may hold only the root's rows, but every rank ran every GEMM
      assert.is_true(na >= 4 * 2, 'weight GEMMs into sinks: ' .. na)
      assert.are.equal(0, nb)
      local differ = 0
      for k = 1, #a do
        assert.is_true(norm_rel(a[k], b[k]) < 1e-2, ('unit %d: %.3g'):format(k, norm_rel(a[k], b[k])))
        if W == 1 then
          -- one rank: no sum across ranks, so the bf16 gradient is exactly
          -- the sink's rounded
          assert.are.equal(0, (a[k]:to('bf16'):to('f32') - b[k]):abs():max():item(), 'unit ' .. k)
        end
        differ = math.max(differ, (a[k] - b[k]):abs():max():item())
      end
      assert.is_true(differ > 0)   -- the sinks' gradients were not rounded
    end)
  end

  it('grad sinks under no_sync: the later micro-batches add into the f32 buffer (beta 1); the accumulated shards as the copies\' within bf16 bounds', function()
    local function grads(sinks)
      local model = fsdp.fully_shard(load_model(), { policy = block_policy(), mixed_precision = { param = 'bf16' },
        grad_sinks = sinks })
      local adds, orig = 0, F.gemm_
      F.gemm_ = function(out, a, b, ta, tb, alpha, beta)
        if out.dtype == 'f32' and beta == 1 then adds = adds + 1 end
        return orig(out, a, b, ta, tb, alpha, beta)
      end
      local ok, err = pcall(function()
        for k = 1, 3 do
          local x, y = rows(120 + 10 * R + k, 2)
          if k < 3 then model:no_sync(function() (model(x, y) / 3):backward() end)
          else (model(x, y) / 3):backward() end
        end
      end)
      F.gemm_ = orig
      assert(ok, err)
      local out = {}
      for _, u in ipairs(fsdp.units(model)) do out[#out + 1] = u.fp.shard.grad:clone() end
      return out, adds
    end
    local a, na = grads(true)
    local b, nb = grads(false)
    assert.is_true(na >= 2 * 4 * 2, 'accumulating GEMMs into sinks: ' .. na)   -- 2 later micro-batches x 4 weights x 2 blocks
    assert.are.equal(0, nb)
    for k = 1, #a do
      assert.is_true(norm_rel(a[k], b[k]) < 1e-2, ('unit %d: %.3g'):format(k, norm_rel(a[k], b[k])))
    end
  end)

  -- docs/fsdp.md "Clipping and the optimizer": fsdp.AdamW writes each
  -- unit's low-precision copy in its fused step (the f32 shard as the
  -- master), so after_step casts nothing
  it('fsdp.AdamW writes the bf16 shard copies in its step: no refresh pass, the same parameters and copies as with it, bit for bit', function()
    local ffi = require 'ffi'
    pcall(ffi.cdef, 'int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);')
    local function train(step_lp)
      if step_lp then ffi.C.unsetenv('MS_FSDP_STEP_LP') else ffi.C.setenv('MS_FSDP_STEP_LP', '0', 1) end
      local ok, res = pcall(function()
        local model = fsdp.fully_shard(load_model(), { policy = block_policy(), mixed_precision = { param = 'bf16' } })
        local opt = fsdp.AdamW(model, { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 })
        local refreshes = 0
        for _, u in ipairs(fsdp.units(model)) do
          local f = u.refresh_lp
          u.refresh_lp = function(self) refreshes = refreshes + 1; return f(self) end
        end
        local x, y = rows(140 + R, 2)
        train_steps(model, opt, x, y, 3)
        local out = {}
        for _, u in ipairs(fsdp.units(model)) do
          out[#out + 1] = { u.fp.shard:clone(), u.lp:clone() }
          assert.is_false(u.lp_stale == true)
          assert.is_nil(u.lp_written)
        end
        return { out = out, refreshes = refreshes }
      end)
      ffi.C.unsetenv('MS_FSDP_STEP_LP')
      assert(ok, res)
      return res
    end
    local a, b = train(true), train(false)
    assert.are.equal(0, a.refreshes)
    assert.are.equal(3 * #b.out, b.refreshes)
    for k = 1, #a.out do
      assert.are.equal(0, (a.out[k][1] - b.out[k][1]):abs():max():item(), 'master shard ' .. k)
      assert.are.equal(0, (a.out[k][2]:to('f32') - b.out[k][2]:to('f32')):abs():max():item(), 'bf16 copy ' .. k)
      -- and the copy is the shard's rounding
      assert.are.equal(0, (a.out[k][2]:to('f32') - a.out[k][1]:to('bf16'):to('f32')):abs():max():item())
    end
  end)

  it('release_activations under FSDP (bf16, sinks): the same shards as with the collector freeing them, bit for bit', function()
    local function train(release)
      local prev = ms.autograd.release_activations
      ms.autograd.release_activations = release
      local ok, res = pcall(function()
        local model = fsdp.fully_shard(load_model(), { policy = block_policy(), mixed_precision = { param = 'bf16' } })
        local opt = fsdp.AdamW(model, { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 })
        local x, y = rows(150 + R, 2)
        local losses = {}
        for k = 1, 3 do
          local loss = model(x, y)
          loss:backward()
          losses[k] = loss:item()   -- the root stays usable after backward
          opt:step()
          opt:zero_grad()
        end
        local out = {}
        for _, u in ipairs(fsdp.units(model)) do out[#out + 1] = u.fp.shard:clone() end
        return { out = out, losses = losses }
      end)
      ms.autograd.release_activations = prev
      assert(ok, res)
      return res
    end
    local a, b = train(true), train(false)
    for k = 1, 3 do assert.are.equal(b.losses[k], a.losses[k], 'loss ' .. k) end
    assert.is_true(a.losses[3] < a.losses[1])
    for k = 1, #a.out do
      assert.are.equal(0, (a.out[k] - b.out[k]):abs():max():item(), 'master shard ' .. k)
    end
  end)

  it('fully_shard releases the original parameters at once (not when the collector runs); a handle kept from before is an error to use', function()
    collectgarbage(); collectgarbage()
    local model = load_model()
    local kept = model.transformer.h[1].attn.c_attn.weight
    local base = live()
    local total = 0
    for _, p in model:named_parameters() do total = total + p:numel() * 4 end
    collectgarbage('stop')
    local ok, err = pcall(function()
      fsdp.fully_shard(model, { policy = block_policy() })
      -- with the collector stopped: the originals gone, the shards (total /
      -- world, padded) in their place, not a second copy of every parameter
      local now = ms.live_bytes(-1)
      assert.is_true(now - base < total / 2, ('%d bytes live, %d before, %d of parameters'):format(now, base, total))
    end)
    collectgarbage('restart')
    assert(ok, err)
    assert.is_true(kept.storage == nil)
    local e = S.errmsg(function() return kept + 1 end)
    assert.is_truthy(e:find('freed', 1, true), e)
  end)

  it('with release_activations a step frees everything it made without the collector (gpt2-tiny, llama-tiny; bf16)', function()
    local FSS = require 'spec.fsdp_support'
    for _, fam in ipairs({ { 'gpt2-tiny', 'GPT2Block' }, { 'llama-tiny', 'LlamaDecoderLayer' } }) do
      local prev = ms.autograd.release_activations
      ms.autograd.release_activations = true
      local ok, err = pcall(function()
        local model = fsdp.fully_shard(FSS.load_model(fam[1]), { policy = fsdp.policy.by_class { fam[2] },
                                                                 mixed_precision = { param = 'bf16' } })
        local opt = fsdp.AdamW(model, { lr = 1e-3 })
        local x, y = rows(160 + R, 2)
        local function step()
          opt:zero_grad()
          local loss = model(x, y)
          loss:backward()
          fsdp.clip_grad_norm(model, 1.0, { defer = opt }):free()
          opt:step()
          loss:free()
          opt:zero_grad()
        end
        step(); step()   -- the optimizer's state made
        -- every earlier handle collected, chains of finalizers included (the
        -- allocator's GC nudge runs a full collection inside a step when its
        -- byte count trips, whatever the collector's state: garbage left from
        -- before the base would be freed there and read as a step shrinking)
        S.settled(function() return ms.live_bytes(-1) end)
        collectgarbage('stop')
        local base = ms.live_bytes(-1)
        local grew = {}
        for k = 1, 4 do
          step()
          grew[k] = ms.live_bytes(-1) - base
        end
        collectgarbage('restart')
        for k = 1, 4 do
          assert.are.equal(0, grew[k], ('%s: %d bytes more after step %d, with the collector stopped'):format(fam[1], grew[k], k))
        end
      end)
      collectgarbage('restart')
      ms.autograd.release_activations = prev
      assert(ok, err)
    end
  end)

  it('reports the measured figures (rank 0, MS_FSDP_REPORT=1)', function()
    if R == 0 and os.getenv('MS_FSDP_REPORT') == '1' then io.stderr:write('\n' .. table.concat(report, '\n') .. '\n') end
  end)
end)
