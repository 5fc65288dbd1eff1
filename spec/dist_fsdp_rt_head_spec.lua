-- The LM head under fully_shard (#mpi; tools/run_mpi_specs.sh runs it with
-- 1-4 ranks). The models call the final norm and the head through a module
-- (nn.LMHead, model:head_module()) whose forward is the FLCE loss.
-- - Llama's untied head (lm_head.weight with model.norm.weight) is a unit
--   of its own, 'lm_head', the last unit: gathered by the forward prefetch
--   while the last block's forward runs, kept unsharded after its forward
--   (its backward is the first of the backward: the FLCE's gradient scaled
--   by the incoming one, then the norm's backward), its gradient
--   reduce-scattered as soon as that backward ends, before any block's
--   backward starts, and resharded then. So it is all-gathered once per
--   step, never in the backward.
-- - GPT-2's tied head (wte) and ln_f stay in the root, as does Llama's head
--   with head_unit = false: the root is gathered when its forward starts
--   and stays unsharded until its backward ends.
-- The all-gathers of one step, counted from the trace: FULL_SHARD and
-- HYBRID_SHARD gather the root once, every block twice (forward and
-- backward) and the head unit once; SHARD_GRAD_OP every unit once; NO_SHARD
-- every unit once, a local refresh after the optimizer step (its layout is
-- one rank: no collective); offload changes none of these.
-- Then the head unit's numbers: 4 micro-batches with the loss scaled
-- (1/4, and 3/4: a loss scale that is not a power of two), under no_sync and
-- accumulated into the shards, under every strategy, against one process
-- that runs every rank's micro-batches with the same scale: every
-- gradient within 1e-5 of its largest magnitude, and training with the
-- head unit equal to training with the head in the root.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

local FAMILIES = {
  { name = 'gpt2-tiny', unit = 'GPT2Block', head = 'transformer.wte.weight', norm = 'transformer.ln_f.weight',
    head_unit = false },
  { name = 'llama-tiny', unit = 'LlamaDecoderLayer', head = 'lm_head.weight', norm = 'model.norm.weight',
    head_unit = true },
  { name = 'llama-tiny', unit = 'LlamaDecoderLayer', head = 'lm_head.weight', norm = 'model.norm.weight',
    head_unit = false, opt_out = true },
}

local function batch(r)
  local seed = 31337 + 7919 * r
  return FS.lcg_batch(seed, 2, 16)
end

-- the labels of the all-gathers in a trace, counted
local function gathers(trace)
  local count = {}
  for _, ev in ipairs(trace) do
    local label = ev:match('^all_gather (.*)$')
    if label then count[label] = (count[label] or 0) + 1 end
  end
  return count
end

local function index_of(trace, ev)
  for i, e in ipairs(trace) do if e == ev then return i end end
  return nil
end

describe('fsdp: the LM head #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not FS.have_fixture('gpt2-tiny') or not FS.have_fixture('llama-tiny') then
    it('needs the fixtures', function() pending('no ' .. FS.fixtures) end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))
  local cases = { { 'FULL_SHARD' }, { 'SHARD_GRAD_OP' }, { 'NO_SHARD' }, { 'FULL_SHARD', true } }
  if W % 2 == 0 then cases[#cases + 1] = { 'HYBRID_SHARD' } end
  local report = {}

  for _, fam in ipairs(FAMILIES) do
    for _, c in ipairs(cases) do
      local strategy, offload = c[1], c[2]
      it(('%s, %s%s: the all-gathers of a step, the head %s'):format(fam.name, strategy,
        offload and ' with offload' or '', fam.head_unit and 'a unit of its own'
          or (fam.opt_out and 'in the root (head_unit = false)' or 'in the root (tied)')), function()
        local model = FS.load_model(fam.name)
        local o = { policy = fsdp.policy.by_class { fam.unit }, strategy = strategy, offload = offload }
        if fam.opt_out then o.head_unit = false end
        if strategy == 'HYBRID_SHARD' then o.shard_size = W / 2 end
        fsdp.fully_shard(model, o)
        local units = fsdp.units(model)
        local root = units[1]
        assert.are.equal('root', root.label)
        local head = units[#units]
        local holder = fam.head_unit and head or root
        if fam.head_unit then
          assert.are.equal('lm_head', head.label)
          assert.is_true(head.head)
          assert.are.equal(model:head_module(), head.module)
          -- the decayed weight first, then the norm
          assert.are.same({ fam.head, fam.norm }, head.param_names)
        else
          for _, u in ipairs(units) do assert.is_false(u.head) end
        end
        local names = {}
        for _, n in ipairs(holder.param_names) do names[n] = true end
        assert.is_true(names[fam.head], fam.head .. ' is not in unit ' .. holder.label)
        assert.is_true(names[fam.norm], fam.norm .. ' is not in unit ' .. holder.label)
        for _, u in ipairs(units) do
          if u ~= holder then
            for _, n in ipairs(u.param_names) do
              assert.are_not.equal(fam.head, n)
              assert.are_not.equal(fam.norm, n)
            end
          end
        end
        local last_block = units[#units - (fam.head_unit and 1 or 0)]
        local hw_seen
        if fam.head_unit then
          -- when the last block's backward starts, the head unit's backward
          -- is over: resharded (but NO_SHARD), its gradient reduction issued
          last_block.module:register_backward_pre_hook(function()
            hw_seen = head.status
          end)
        end
        local opt = fsdp.AdamW(model, { lr = 1e-3 })
        local x, y = batch(R)
        for step = 1, 2 do
          local loss = model(x, y)
          -- between the forward and the backward the root and the head stay gathered
          assert.are.equal('unsharded', root.status)
          assert.are.equal('unsharded', holder.status)
          loss:backward()
          local tr = fsdp.trace(model)
          if fam.head_unit then
            assert.are.equal(strategy == 'NO_SHARD' and 'unsharded' or 'sharded', hw_seen)
            -- the head's reduction is issued right after its backward,
            -- before the last block's backward starts
            local kind = strategy == 'NO_SHARD' and 'all_reduce' or 'reduce_scatter'
            local rs = index_of(tr, kind .. ' lm_head')
            local bb = index_of(tr, 'backward ' .. last_block.label)
            local hb = index_of(tr, 'backward lm_head')
            assert.is_not_nil(rs, kind .. ' lm_head')
            assert.is_true(hb < rs and rs < bb, table.concat(tr, ', '))
            if strategy == 'FULL_SHARD' or strategy == 'HYBRID_SHARD' then
              -- resharded there; no all-gather of the head in the backward
              assert.is_true(index_of(tr, 'reshard lm_head') < bb)
              for i = index_of(tr, 'backward root'), #tr do assert.are_not.equal('all_gather lm_head', tr[i]) end
              if step == 2 and not offload then
                -- the forward prefetch: the head is gathered while the
                -- last block's forward runs
                local ag = index_of(tr, 'all_gather lm_head')
                assert.is_true(index_of(tr, 'forward ' .. last_block.label) < ag
                  and ag < index_of(tr, 'forward lm_head'), table.concat(tr, ', '))
              end
            end
          end
          opt:step()
          opt:zero_grad()
          local count = gathers(fsdp.trace(model))
          for k, u in ipairs(units) do
            local want
            -- (NO_SHARD: the refresh after the optimizer step, a local
            -- one: its layout is one rank)
            if strategy == 'SHARD_GRAD_OP' or strategy == 'NO_SHARD' or k == 1 or u.head then want = 1
            else want = 2 end
            assert.are.equal(want, count[u.label], ('step %d: all-gathers of %s'):format(step, u.label))
          end
        end
        -- the limit (3: the root, the head or a block, and the next one)
        -- holds; SHARD_GRAD_OP passes it by design (every unit kept until
        -- the backward)
        if strategy ~= 'SHARD_GRAD_OP' then assert.is_true(fsdp.max_inflight(model) <= 3) end
      end)
    end
  end

  it('head_unit = true needs an untied head; a bad value is an error', function()
    local ok, e = pcall(fsdp.fully_shard, FS.load_model('gpt2-tiny'), { head_unit = true })
    assert.is_false(ok)
    assert.matches('untied LM head', tostring(e))
    ok, e = pcall(fsdp.fully_shard, FS.load_model('llama-tiny'), { head_unit = 'yes' })
    assert.is_false(ok)
    assert.matches('head_unit must be', tostring(e))
    local m = fsdp.fully_shard(FS.load_model('llama-tiny'), { head_unit = true })
    assert.is_true(fsdp.units(m)[#fsdp.units(m)].head)
  end)

  -- accumulation and loss scales: each rank's micro-batch k (one row)
  local function micro(r, k) return FS.lcg_batch(4242 + 7919 * (100 * r + k), 1, 16) end
  -- the one-process gradients of every rank's 4 micro-batches, each
  -- backward of loss * scale / W (the mean over ranks FSDP's reduction takes)
  local refs = {}
  local function reference(scale)
    if refs[scale] then return refs[scale] end
    local m = FS.load_model('llama-tiny')
    for r = 0, W - 1 do
      for k = 1, 4 do
        local x, y = micro(r, k)
        local l = m(x, y) * (scale / W)
        l:backward()
      end
    end
    local g = {}
    for name, p in m:named_parameters() do g[name] = p.grad end
    refs[scale] = g
    return g
  end
  -- every parameter's gradient gathered from the shards, by name
  local function gathered_grads(model)
    local r = {}
    for _, u in ipairs(fsdp.units(model)) do
      local fp = u.fp
      local full = T.zeros({ fp.total }, { dtype = 'f32' })
      assert.is_not_nil(fp.shard.grad, u.label)
      if fp.world_size > 1 then dist.all_gather_into(full, fp.shard.grad, { group = fp.group })
      else full:copy_(fp.shard.grad) end
      for i, v in ipairs(fp:views(full)) do r[u.param_names[i]] = v end
    end
    return r
  end

  local strategies = { 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }
  if W % 2 == 0 then strategies[#strategies + 1] = 'HYBRID_SHARD' end
  for _, strategy in ipairs(strategies) do
    for _, use_no_sync in ipairs({ true, false }) do
      for _, scale in ipairs({ 0.25, 0.75 }) do
        it(('llama-tiny, %s: 4 micro-batches (loss x %g) %s equal one process, the head a unit'):format(
          strategy, scale, use_no_sync and 'under no_sync' or 'accumulated into the shards'), function()
          local ref = reference(scale)
          local o = { policy = fsdp.policy.by_class { 'LlamaDecoderLayer' }, strategy = strategy }
          if strategy == 'HYBRID_SHARD' then o.shard_size = W / 2 end
          local model = fsdp.fully_shard(FS.load_model('llama-tiny'), o)
          local units = fsdp.units(model)
          local head = units[#units]
          assert.is_true(head.head)
          for k = 1, 4 do
            local x, y = micro(R, k)
            local function step()
              local l = model(x, y) * scale
              l:backward()
            end
            if use_no_sync and k < 4 then
              model:no_sync(step)
              -- the head unit keeps its unsharded f32 gradient, nothing sharded
              assert.is_nil(head.fp.shard.grad)
              assert.are.equal('f32', head.gbuf.dtype)
            else
              step()
              assert.is_not_nil(head.fp.shard.grad)
              assert.is_nil(head.gbuf)
            end
          end
          local got = gathered_grads(model)
          local worst, wname, n = 0, '', 0
          for name, b in pairs(ref) do
            n = n + 1
            local e = FS.max_rel(got[name], b)
            if e > worst then worst, wname = e, name end
          end
          assert.are.equal(21, n)
          report[#report + 1] = ('%s no_sync=%s scale=%g W=%d: %.2g (%s)'):format(
            strategy, tostring(use_no_sync), scale, W, worst, wname)
          assert.is_true(worst < 1e-5, ('%s: gradient relative difference %.3g'):format(wname, worst))
        end)
      end
    end
  end

  it('llama-tiny: 5 AdamW steps with the head unit equal those with the head in the root (clipping)', function()
    local function run(head_unit)
      local model = fsdp.fully_shard(FS.load_model('llama-tiny'), {
        policy = fsdp.policy.by_class { 'LlamaDecoderLayer' }, head_unit = head_unit })
      local opt = fsdp.AdamW(model, { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 })
      local x, y = batch(R)
      local losses = {}
      for s = 1, 5 do
        local loss = model(x, y)
        losses[s] = loss:item()
        loss:backward()
        fsdp.clip_grad_norm(model, 0.5)
        opt:step()
        opt:zero_grad()
      end
      fsdp.unshard(model)
      local params = {}
      for name, p in model:named_parameters() do params[#params + 1] = { name, p:clone() } end
      return losses, params
    end
    local la, pa = run(nil)
    local lb, pb = run(false)
    for s = 1, 5 do assert.are.equal(lb[s], la[s]) end
    assert.are.equal(#pb, #pa)
    for i = 1, #pa do
      assert.are.equal(pb[i][1], pa[i][1])
      -- the same reductions of the same values: equal, not merely close
      assert.are.equal(0, (pa[i][2] - pb[i][2]):abs():max():item(), pa[i][1])
    end
  end)

  -- prefetch_root: the root's all-gather of the next step issued at the end
  -- of the optimizer step (fsdp.after_step)
  local pcases = { { 'FULL_SHARD' }, { 'SHARD_GRAD_OP' }, { 'FULL_SHARD', true } }
  if W % 2 == 0 then pcases[#pcases + 1] = { 'HYBRID_SHARD' } end
  for _, name in ipairs({ 'gpt2-tiny', 'llama-tiny' }) do
    for _, c in ipairs(pcases) do
      local strategy, offload = c[1], c[2]
      it(('%s, %s%s, prefetch_root: the root gathered at the optimizer step\'s end, the same numbers'):format(
        name, strategy, offload and ' with offload' or ''), function()
        local function run(prefetch_root)
          local o = { policy = fsdp.policy.by_class { name:match('^llama') and 'LlamaDecoderLayer' or 'GPT2Block' },
                      strategy = strategy, offload = offload, prefetch_root = prefetch_root }
          if strategy == 'HYBRID_SHARD' then o.shard_size = W / 2 end
          local model = fsdp.fully_shard(FS.load_model(name), o)
          local root = fsdp.units(model)[1]
          local opt = fsdp.AdamW(model, { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 })
          local x, y = batch(R)
          local losses = {}
          for s = 1, 4 do
            local loss = model(x, y)
            losses[s] = loss:item()
            loss:backward()
            opt:step()
            opt:zero_grad()
            if prefetch_root then
              -- issued, its event kept for the next step's trace
              assert.are.equal('gathering', root.status)
              if s > 1 then
                local tr = fsdp.trace(model)
                assert.are.equal('all_gather root', tr[1], table.concat(tr, ', '))
                assert.is_true(index_of(tr, 'forward root') > 1)
              end
            else
              assert.are.equal('sharded', root.status)
            end
            assert.are.equal(1, gathers(fsdp.trace(model)).root, ('step %d'):format(s))
          end
          fsdp.unshard(model)
          local params = {}
          for pn, p in model:named_parameters() do params[#params + 1] = { pn, p:clone() } end
          fsdp.reshard(model)
          return losses, params
        end
        local la, pa = run(true)
        local lb, pb = run(false)
        for s = 1, 4 do assert.are.equal(lb[s], la[s]) end
        for i = 1, #pa do
          assert.are.equal(pb[i][1], pa[i][1])
          assert.are.equal(0, (pa[i][2] - pb[i][2]):abs():max():item(), pa[i][1])
        end
      end)
    end
  end

  it('reports the measured differences (rank 0, MS_FSDP_REPORT=1)', function()
    if R == 0 and os.getenv('MS_FSDP_REPORT') == '1' then io.stderr:write('\n' .. table.concat(report, '\n') .. '\n') end
  end)
end)
