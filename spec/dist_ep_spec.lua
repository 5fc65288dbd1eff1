-- Expert parallelism in training (#mpi, 1-4 ranks; moonshard.ep,
-- docs/moe.md): a Mixtral whose experts are split over the ranks (at 4
-- ranks also 2-way with 2 copies of each expert), each rank its own batch,
-- against one process over every rank's batch, in f64:
--   - after ep.all_reduce_grads every gradient is the one-process model's
--     (the mean over the ranks' losses), an expert's under its global name;
--   - ep.clip_grad_norm_ is the one-process norm and clips alike;
--   - ep.full_checkpoint after two AdamW steps is the one-process model's
--     state dict and optimizer state dict (the same indices, groups, names
--     and moments);
--   - a one-process state loaded with ep.load_full_state_dict and
--     ep.load_full_optimizer_state takes the next step as one process does;
--   - under fsdp.fully_shard (FULL_SHARD, the experts a unit of their own
--     sharded over their copies): the same norms, checkpoint and loaded
--     steps; a sharded checkpoint (fsdp_checkpoint.save_sharded) lists
--     every expert in the whole model's order and loads into the same
--     layout, into FSDP without expert parallelism and into a plain model,
--     weights and moments; a full save (fsdp_checkpoint.save_full) streams
--     every expert, a unit at a time;
--   - the refusals.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local FS = require 'spec.fsdp_support'
local S = require 'spec.support'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('moonshard.ep #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))
  local mixtral = require 'models.mixtral'
  local cfg = { vocab_size = 40, hidden_size = 8, intermediate_size = 12, num_hidden_layers = 2,
    num_attention_heads = 2, num_key_value_heads = 1, max_position_embeddings = 16, num_local_experts = 4,
    num_experts_per_tok = 2, output_router_logits = false, bos_token_id = require('models.hf').null,
    eos_token_id = require('models.hf').null }
  local function make()
    ms.manual_seed(4)
    local m = mixtral.new(cfg):to('f64')
    for name, p in m:named_parameters() do if not name:match('norm') then ms.normal_(p, 0, 0.4) end end
    return m
  end
  local hyper = { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
  local function adamw(m) return ms.optim.AdamW(m, hyper) end
  local function batch(p, step) return S.token_batch(2, 6, 40, 11 + p + 10 * step) end

  -- one process: the mean of the ranks' losses (each over its batch)
  local function ref_step(ref, opt, step, clip)
    opt:zero_grad()
    for p = 0, W - 1 do
      local x, y = batch(p, step)
      local l = ref(x, y) * (1 / W)
      l:backward()
    end
    local n = ms.optim.clip_grad_norm(ref, clip or math.huge)
    opt:step()
    return n
  end
  -- the layouts: the experts over every rank, and at 4 ranks over pairs
  -- with two copies (rank = copy * 2 + index)
  local function layouts()
    local list = { { 'over all ranks', function() return { group = dist.world_group } end } }
    if W == 4 then
      list[#list + 1] = { '2-way, 2 copies', function()
        local mesh = dist.mesh { replicate = 2, shard = 2 }
        return { group = mesh.shard, replicate = mesh.replicate }
      end }
    end
    return list
  end
  local function ep_step(m, opt, step, clip)
    opt:zero_grad()
    local x, y = batch(R, step)
    m(x, y):backward()
    if not rawget(m, '_fsdp') then ms.ep.all_reduce_grads(m) end
    local n = ms.ep.clip_grad_norm_(m, clip or math.huge)
    opt:step()
    return n
  end
  -- steps `from`..`to` of both runs: the same norms (1e-12); with `clip`
  -- below them, clipped
  local function same_steps(ref, ropt, m, opt, from, to, clip)
    for step = from, to do
      local nr = ref_step(ref, ropt, step, clip)
      local nm = ep_step(m, opt, step, clip)
      if clip then assert.is_true(nr > clip, 'the clip bites') end
      assert.is_true(FS.rel(nm, nr) <= 1e-12, ('step %d: norm %.17g, one process %.17g'):format(step, nm, nr))
    end
  end
  -- fully_shard over every rank, the decoder layers as units
  local function shard(m, strategy)
    ms.fsdp.fully_shard(m, { strategy = strategy or 'FULL_SHARD',
      policy = ms.fsdp.policy.by_class({ 'LlamaDecoderLayer' }) })
    return ms.fsdp.AdamW(m, hyper)
  end
  local function same_checkpoint(m, opt, ref, ropt, tol)
    tol = tol or 1e-10
    local msd, osd = ms.ep.full_checkpoint(m, opt, hyper)
    local rsd, rosd = ref:state_dict(), ropt:state_dict()
    for name, t in pairs(rsd) do
      assert.is_truthy(msd[name], name)
      assert.is_true(FS.max_rel(msd[name], t) <= tol, name)
    end
    for name in pairs(msd) do assert.is_truthy(rsd[name], 'not the model\'s: ' .. name) end
    assert.are.same(rosd.meta.groups, osd.meta.groups)
    table.sort(rosd.meta.state, function(a, b) return a.index < b.index end)
    table.sort(osd.meta.state, function(a, b) return a.index < b.index end)
    assert.are.same(rosd.meta.state, osd.meta.state)
    for name, t in pairs(rosd.tensors) do
      assert.is_truthy(osd.tensors[name], name)
      assert.is_true(FS.max_rel(osd.tensors[name], t) <= tol, name)
    end
  end

  for _, lay in ipairs(layouts()) do
    it(('%s: the gradients, the norm, two clipped steps and the one-process checkpoint are one process\'s'):format(
      lay[1]), function()
      if 4 % W ~= 0 then return end
      local ref = make()
      local ropt = adamw(ref)
      local m = make()
      ms.ep.parallelize(m, lay[2]())
      local opt = adamw(m)
      -- before any step: no optimizer state, as one process has none
      local _, osd0 = ms.ep.full_checkpoint(m, opt, hyper)
      assert.are.same({}, osd0.meta.state)
      assert.are.same(ropt:state_dict().meta.groups, osd0.meta.groups)
      -- the gradients of the first step
      do
        local x, y = batch(R, 1)
        m(x, y):backward()
        ms.ep.all_reduce_grads(m)
        for p = 0, W - 1 do
          local xr, yr = batch(p, 1)
          local l = ref(xr, yr) * (1 / W)
          l:backward()
        end
        local rp = {}
        for name, p in ref:named_parameters() do rp[name] = p end
        local n = 0
        for name, p in m:named_parameters() do
          n = n + 1
          local err = FS.max_rel(p.grad, rp[name].grad)
          assert.is_true(err <= 1e-10, ('%s: %g'):format(name, err))
        end
        assert.is_true(n > 0)
        local nm, nr = ms.ep.clip_grad_norm_(m, math.huge), ms.optim.clip_grad_norm(ref, math.huge)
        assert.is_true(FS.rel(nm, nr) <= 1e-12, ('norm %.17g, one process %.17g'):format(nm, nr))
        opt:zero_grad(); ropt:zero_grad()
      end
      -- two steps clipped below the norm
      same_steps(ref, ropt, m, opt, 1, 2, 0.05)
      same_checkpoint(m, opt, ref, ropt)
      -- the one-process groups' names
      assert.are.same(ropt:state_dict().meta.groups[1].names, ms.ep.full_groups(m)[1].names)
    end)

    for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP' }) do
      it(('%s, fully_shard %s: two clipped steps, the one-process checkpoint, and a one-process state loaded takes '
        .. 'the next steps as one process'):format(lay[1], strategy), function()
        if 4 % W ~= 0 then return end
        local ref = make()
        local ropt = adamw(ref)
        local m = make()
        ms.ep.parallelize(m, lay[2]())
        local opt = shard(m, strategy)
        local units = ms.fsdp.units(m)
        local ne = 0
        for _, u in ipairs(units) do if u.experts then ne = ne + 1 end end
        assert.are.equal(2, ne, 'an expert unit a layer')
        same_steps(ref, ropt, m, opt, 1, 2, 0.05)
        same_checkpoint(m, opt, ref, ropt)
        -- the one-process state after 2 steps into a fresh sharded model
        local sd, osd = {}, ropt:state_dict()
        for name, t in pairs(ref:state_dict()) do sd[name] = t:clone() end
        local m2 = make()
        ms.ep.parallelize(m2, lay[2]())
        ms.ep.load_full_state_dict(m2, sd)
        local opt2 = shard(m2, strategy)
        ms.ep.load_full_optimizer_state(m2, opt2, osd)
        same_steps(ref, ropt, m2, opt2, 3, 4)
        same_checkpoint(m2, opt2, ref, ropt)
      end)
    end

    it(('%s: a one-process state loaded takes the next steps as one process'):format(lay[1]), function()
      if 4 % W ~= 0 then return end
      local ref = make()
      local ropt = adamw(ref)
      ref_step(ref, ropt, 1)
      -- the state as a checkpoint holds it (copies), loaded into a fresh split model
      local sd, osd = {}, ropt:state_dict()
      for name, t in pairs(ref:state_dict()) do sd[name] = t:clone() end
      local m = make()
      for _, p in ipairs(m:parameters()) do ms.normal_(p, 0, 1) end   -- (overwritten by the load)
      ms.ep.parallelize(m, lay[2]())
      local opt = adamw(m)
      ms.ep.load_full_state_dict(m, sd)
      ms.ep.load_full_optimizer_state(m, opt, osd)
      same_steps(ref, ropt, m, opt, 2, 3)
      local rp = ref:state_dict()
      for name, t in pairs(m:state_dict()) do
        assert.is_true(FS.max_rel(t, rp[name]) <= 1e-10, name)
      end
    end)
  end

  for _, lay in ipairs(layouts()) do
    it(('%s, fully_shard: a sharded checkpoint lists every expert and loads into the same layout, into FSDP without '
      .. 'expert parallelism and into a plain model'):format(lay[1]), function()
      if 4 % W ~= 0 then return end
      local ck = require 'moonshard.fsdp_checkpoint'
      local ref = make()
      local ropt = adamw(ref)
      local m = make()
      ms.ep.parallelize(m, lay[2]())
      local opt = shard(m)
      same_steps(ref, ropt, m, opt, 1, 2, 0.05)
      local dir = ('%s/ep_sharded_%d'):format(os.getenv('MS_SPEC_TMP') or '/tmp', W)
      ck.save_sharded(m, dir, { optimizer = opt })
      local names = {}
      for name in ref:named_parameters() do names[#names + 1] = name end
      local listed = {}
      for _, e in ipairs(ck.read_index(dir).params) do listed[#listed + 1] = e.name end
      assert.are.same(names, listed)
      local function against_ref(model, o)
        local rsd = ref:state_dict()
        local rstate = {}
        for name, p in ref:named_parameters() do rstate[name] = ropt.state[tonumber(p.id)] end
        local params, st = ck.gather(model, { optimizer = o })
        for _, e in ipairs(params) do
          assert.is_true(FS.max_rel(e.tensor, rsd[e.name]) <= 1e-12, e.name)
          assert.is_true(FS.max_rel(st[e.name].exp_avg, rstate[e.name].exp_avg) <= 1e-12, e.name)
          assert.is_true(FS.max_rel(st[e.name].exp_avg_sq, rstate[e.name].exp_avg_sq) <= 1e-12, e.name)
          assert.are.equal(rstate[e.name].step, st[e.name].step, e.name)
        end
        return #params
      end
      -- the same layout
      local m2 = make()
      ms.ep.parallelize(m2, lay[2]())
      local opt2 = shard(m2)
      ck.load_sharded(m2, dir, { optimizer = opt2 })
      same_checkpoint(m2, opt2, ref, ropt)
      -- FSDP over every rank without expert parallelism
      local m3 = make()
      local opt3 = shard(m3)
      ck.load_sharded(m3, dir, { optimizer = opt3 })
      assert.are.equal(#names, against_ref(m3, opt3))
      -- a plain model on every rank
      local m4 = make()
      local opt4 = adamw(m4)
      ck.load_sharded(m4, dir, { optimizer = opt4 })
      assert.are.equal(#names, against_ref(m4, opt4))
      -- the full save streams every expert, a unit at a time
      local calls = 0
      ck._on_unit_saved = function() calls = calls + 1 end
      local okf, errf = pcall(ck.save_full, m, dir .. '.full.safetensors')
      ck._on_unit_saved = nil
      assert.is_true(okf, tostring(errf))
      assert.are.equal(#ms.fsdp.units(m), calls)
      if R == 0 then
        local full = ms.load_safetensors(dir .. '.full.safetensors')
        local rsd = ref:state_dict()
        for name, t in pairs(rsd) do
          assert.is_truthy(full[name], name)
          assert.is_true(FS.max_rel(full[name], t) <= 1e-12, name)
        end
        for name in pairs(full) do assert.is_truthy(rsd[name], 'not the model\'s: ' .. name) end
        os.remove(dir .. '.full.safetensors')
      end
      dist.barrier()
      if R == 0 then os.execute('rm -rf ' .. dir) end
    end)
  end

  -- bf16 parameters: the experts' weight gradients go from the grouped
  -- GEMM straight into the unit's f32 gradient buffer (their sinks) instead
  -- of a bf16 gradient and a converting copy; against grad_sinks = false
  for _, split in ipairs({ false, true }) do
    if not split or 4 % W == 0 then
      it(('bf16 parameters%s: the experts\' gradients into the f32 buffer; the shards as with the copies'):format(
        split and ', experts split over every rank' or ''), function()
        local function run(sinks)
          local m = make():to('f32')
          if split then ms.ep.parallelize(m, { group = dist.world_group }) end
          ms.fsdp.fully_shard(m, { policy = ms.fsdp.policy.by_class({ 'LlamaDecoderLayer' }),
            mixed_precision = { param = 'bf16' }, grad_sinks = sinks })
          local x, y = batch(R, 0)
          local loss = m(x, y)
          loss:backward()
          local out, names, regions = {}, {}, {}
          for k, u in ipairs(ms.fsdp.units(m)) do
            out[k] = u.fp.shard.grad:clone()
            names[k] = u.label
            -- (one rank: the shard is the whole flat parameter) the experts' regions
            regions[k] = {}
            for i, n in ipairs(u.param_names) do
              if n:find('.experts.', 1, true) then
                regions[k][#regions[k] + 1] = { u.fp.layout.offsets[i], u.fp.layout.numels[i] }
              end
            end
          end
          return out, names, loss:item(), regions
        end
        local new, names, l1, regions = run(nil)
        local old, _, l2 = run(false)
        assert.are.equal(l2, l1)
        local experts = 0
        for k = 1, #old do
          if W == 1 then
            -- one rank: the f32 products, rounded, are the bf16 ones
            local d = (new[k]:to('bf16'):to('f32') - old[k]):abs():max():item()
            assert.are.equal(0, d, ('%s: bf16(new) - old = %g'):format(names[k], d))
          else
            local e = FS.norm_rel(new[k], old[k])
            assert.is_true(e < 1e-2, ('%s: %.3e from the copies\' gradient'):format(names[k], e))
          end
          -- one rank: every expert weight's gradient holds values bf16 does
          -- not (the f32 products), where the copies' are all bf16 values
          if W == 1 then
            for _, r in ipairs(regions[k]) do
              local g, g0 = new[k]:narrow(1, r[1] + 1, r[2]), old[k]:narrow(1, r[1] + 1, r[2])
              assert.is_true((g:to('bf16'):to('f32') - g):abs():max():item() > 0, names[k] .. ': a bf16 expert gradient')
              assert.are.equal(0, (g0:to('bf16'):to('f32') - g0):abs():max():item())
              experts = experts + 1
            end
          end
        end
        if W == 1 then assert.are.equal(2 * 4 * 3, experts, 'the expert weights seen') end
      end)
    end
  end

  it('refuses a model that is not split, a group of the wrong size, and states that do not fit', function()
    if 4 % W ~= 0 then return end
    local m = make()
    assert.has_error(function() ms.ep.all_reduce_grads(m) end,
      'ep.all_reduce_grads: the model is not expert-parallel (ep.parallelize)')
    assert.has_error(function() ms.ep.parallelize(ms.nn.Linear(2, 2)) end, 'ep.parallelize: the model has no MoE layers')
    ms.ep.parallelize(m)
    assert.has_error(function() ms.ep.parallelize(m) end, 'ep.parallelize: the model is already expert-parallel')
    if W > 1 then
      local self_group
      for p = 0, W - 1 do
        local g = dist.new_group({ p })
        if p == R then self_group = g else g:free() end
      end
      local ok, err = pcall(ms.ep.all_reduce_grads, m, self_group)
      assert.is_false(ok)
      assert.matches(('ep.all_reduce_grads: a data-parallel group of 1 ranks, but the experts split over %d ranks '
        .. 'with 1 copies (%d)'):format(W, W), tostring(err), 1, true)
    end
    local sd = {}
    for name, t in pairs(make():state_dict()) do sd[name] = t end
    local key = 'model.layers.0.block_sparse_moe.experts.0.w1.weight'
    local keep = sd[key]
    sd[key] = nil
    if R == 0 then
      local ok, err = pcall(ms.ep.load_full_state_dict, m, sd)
      assert.is_false(ok)
      assert.matches('ep.load_full_state_dict: ' .. key .. ' is missing', tostring(err), 1, true)
    end
    sd[key] = keep
    sd['model.layers.0.block_sparse_moe.experts.4.w1.weight'] = keep
    local ok, err = pcall(ms.ep.load_full_state_dict, m, sd)
    assert.is_false(ok)
    assert.matches('the file holds model.layers.0.block_sparse_moe.experts.4.w1.weight, the model has 4 experts there',
      tostring(err), 1, true)
    -- fully_shard: FULL_SHARD or SHARD_GRAD_OP over every rank; the rest of fsdp refuses
    local m3 = make()
    ms.nn.moe.expert_parallel(m3)
    ok, err = pcall(ms.fsdp.fully_shard, m3)
    assert.is_false(ok)
    assert.matches('is expert-parallel (nn.moe.expert_parallel): its experts differ from rank to rank; split it with '
      .. 'ms.ep.parallelize', tostring(err), 1, true)
    local m4 = make()
    ms.ep.parallelize(m4)
    ok, err = pcall(ms.fsdp.fully_shard, m4, { strategy = 'NO_SHARD' })
    assert.is_false(ok)
    assert.matches('fully_shard: an expert-parallel model takes FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, not NO_SHARD',
      tostring(err), 1, true)
    if W == 4 then
      -- HYBRID_SHARD: the expert group (the world's 4 ranks) is not inside a shard group of 2
      ok, err = pcall(ms.fsdp.fully_shard, m4, { strategy = 'HYBRID_SHARD', shard_size = 2 })
      assert.is_false(ok)
      assert.matches('fully_shard: HYBRID_SHARD with expert parallelism needs each expert group (4 consecutive ranks, '
        .. 'here 0,1,2,3) inside a shard group', tostring(err), 1, true)
    end
    if W > 1 then
      local own
      for p = 0, W - 1 do
        local g = dist.new_group({ p })
        if p == R then own = g else g:free() end
      end
      ok, err = pcall(ms.fsdp.fully_shard, m4, { group = own })
      assert.is_false(ok)
      assert.matches(('split over %d ranks with 1 copies (%d ranks); shard it over all of them, not a group of 1'):format(
        W, W), tostring(err), 1, true)
    end
    if W == 4 then
      -- a replicate group of ranks at different places in their groups
      local mesh = dist.mesh { replicate = 2, shard = 2 }
      ok, err = pcall(ms.ep.parallelize, make(), { group = mesh.shard, replicate = mesh.shard })
      assert.is_false(ok)
      assert.matches('a replicate group joins the ranks that hold the same experts', tostring(err), 1, true)
    end
    ms.nn.apply_lora(m4, { r = 2, targets = { 'self_attn%.q_proj' } })
    ms.fsdp.fully_shard(m4, { policy = ms.fsdp.policy.by_class({ 'LlamaDecoderLayer' }) })
    ok, err = pcall(require('moonshard.fsdp_checkpoint').save_full, m4, '/tmp/never-written.safetensors')
    assert.is_false(ok)
    assert.matches('an expert-parallel model (ms.ep) with LoRA adapters to merge: not supported', tostring(err), 1, true)
    ok, err = pcall(ms.ep.all_reduce_grads, m4)
    assert.is_false(ok)
    assert.matches('under fully_shard, whose units reduce the gradients', tostring(err), 1, true)
    ok, err = pcall(ms.ep.load_full_state_dict, m4, sd)
    assert.is_false(ok)
    assert.matches('load the weights before fully_shard', tostring(err), 1, true)
  end)
end)
