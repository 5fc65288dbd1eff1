-- Expert parallelism together with tensor parallelism (#mpi, 2 and 4
-- ranks; ms.ep.parallelize, then ms.tp.parallelize; docs/moe.md, "Expert
-- and tensor parallelism"): TP groups of 2 consecutive ranks, the experts
-- of every MoE layer whole and split over an expert group of 2 (the TP
-- group: at 4 ranks two copies of each expert) or 4 (the world: two TP
-- groups), each TP group its own batch, with and without sequence
-- parallelism; Mixtral-tiny (the load-balancing loss on, no shared
-- expert) and DeepSeek-V3-tiny (a split shared expert, MLA, group-limited
-- routing with biases, the sequence-wise balance loss; also with a
-- multi-token-prediction depth, f32) against one process
-- over every TP group's batch:
--   - f32: the losses, every gradient (the experts' under their global
--     names, the slices gathered) after ep.all_reduce_grads, the gradient
--     norm (ep.clip_grad_norm_) and the layers' routing counts are one
--     process's, also on a batch whose rows do not split evenly;
--   - f64: two clipped AdamW steps as one process, and ep.full_checkpoint
--     is the one-process model's state dict and optimizer state; loaded
--     into a fresh split model (ep.load_full_state_dict /
--     ep.load_full_optimizer_state) it takes the next step as one process;
--   - under fsdp.fully_shard over the ranks that hold the same slices
--     (FSDP x TP x EP: FULL_SHARD and SHARD_GRAD_OP, with and without
--     sequence parallelism; the experts' units over their 2 copies, or
--     whole with one), f64: the losses, every gradient read from the
--     units' shards, three clipped AdamW steps of two micro-batches (the
--     first under no_sync), ep.full_checkpoint, and a one-process state
--     loaded into a fresh sharded model stepping on as one process;
--   - the refusals.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local FS = require 'spec.fsdp_support'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

-- ms.ep.full_checkpoint of the split model against the one-process
-- reference's state (1e-9) and optimizer state (the same groups and
-- per-parameter state, moments within 1e-9): the reference's state dicts
local function same_checkpoint(m, opt, hyper, ref, ropt)
  local msd, osd = ms.ep.full_checkpoint(m, opt, hyper)
  local rsd, rosd = ref:state_dict(), ropt:state_dict()
  FS.same_state(msd, rsd, 1e-9)
  for name in pairs(msd) do assert.is_truthy(rsd[name], 'not the model\'s: ' .. name) end
  assert.are.same(rosd.meta.groups, osd.meta.groups)
  table.sort(rosd.meta.state, function(a, b) return a.index < b.index end)
  table.sort(osd.meta.state, function(a, b) return a.index < b.index end)
  assert.are.same(rosd.meta.state, osd.meta.state)
  FS.same_state(osd.tensors, rosd.tensors, 1e-9)
  return rsd, rosd
end

describe('expert and tensor parallelism #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local cases = {
    { 'mixtral-tiny', require 'models.mixtral', { num_hidden_layers = 2 } },
    { 'deepseek-v3-tiny', require 'models.deepseek_v3', { num_hidden_layers = 2, aux_loss_alpha = 0.01 } },
    -- (with a multi-token-prediction depth: under --tp it runs on whole
    -- sequences, its filler positions masked; f32 only)
    { 'deepseek-v3-tiny with MTP', require 'models.deepseek_v3', { num_hidden_layers = 2, aux_loss_alpha = 0.01,
      mtp_loss_weight = 0.3 }, f32_only = true },
  }
  local build = FS.moe_model   -- (case, dtype)
  -- the layouts: { ep size, what } at this world size
  local function layouts()
    if W == 2 then return { { 2, 'the TP group' } } end
    if W == 4 then return { { 2, 'the TP group, 2 copies' }, { 4, 'two TP groups' } } end
    return {}
  end
  -- the split model: TP groups of 2 consecutive ranks, the expert groups of
  -- M consecutive ranks -> model, mesh
  local function split(case, dtype, M, sp)
    local m = build(case, dtype)
    return FS.split_ep_tp(m, W, M, sp)
  end
  local D = W / 2
  -- TP group d's batch of a step
  local function batch(d, step, B, Tn) return FS.lcg_batch(100 * step + d, B or 2, Tn or 12) end
  -- one process: the mean of the TP groups' losses -> each group's loss
  local function ref_backward(ref, step, B, Tn)
    local ls = {}
    for d = 0, D - 1 do
      local x, y = batch(d, step, B, Tn)
      local l = ref(x, y)
      ls[d] = l:item()
      l = l * (1 / D)
      l:backward()
    end
    return ls
  end
  local function split_backward(m, mesh, step, B, Tn)
    local x, y = batch(mesh.coord[1], step, B, Tn)
    local l = m(x, y)
    l:backward()
    ms.ep.all_reduce_grads(m, mesh.replicate)
    return l:item()
  end

  for _, case in ipairs(cases) do
    for _, lay in ipairs(layouts()) do
      for _, sp in ipairs({ false, true }) do
        local what = ('%s, --tp 2 --ep %d (%s)%s'):format(case[1], lay[1], lay[2],
          sp and ', sequence parallel' or '')
        it(what .. ': the losses, every gradient, the norm and the routing counts are one process\'s (f32)', function()
          local ref = build(case, 'f32')
          local m, mesh = split(case, 'f32', lay[1], sp)
          local E = ms.nn.moe.layers(ref)[1].n_experts
          local ml = ms.nn.moe.layers(m)
          -- (each expert whole: E / M of them a rank)
          assert.are.equal(E / lay[1], #ml[1].experts:parameters() / 3)
          local ex = ml[1].experts[1]
          assert.are.equal(ex.hidden, ex[ex.names[1]].weight.shape[1])
          -- (B, T): rows that split evenly, then 11 that do not
          for round, bt in ipairs({ { 2, 12 }, { 1, 11 } }) do
            local ls = ref_backward(ref, round, bt[1], bt[2])
            local l = split_backward(m, mesh, round, bt[1], bt[2])
            local lr = ls[mesh.coord[1]]
            assert.is_true(FS.rel(l, lr) <= 1e-6, ('round %d: loss %.9g, one process %.9g'):format(round, l, lr))
            local n, held = FS.same_moe_grads(m, ref, 1e-5, 1e-5, ('round %d'):format(round))
            assert.are.equal(n, held)
            m:zero_grad(); ref:zero_grad()
          end
          -- the statistics of the last forward: the TP group's batch, as
          -- one process's forward over it
          local x, y = batch(mesh.coord[1], 2, 1, 11)
          ms.autograd.no_grad(function() ref(x, y) end)
          local seen = 0
          for k, l in ipairs(ms.nn.moe.layers(ref)) do
            -- (an MTP depth's layer: one process runs it on the T - 1
            -- positions, --tp on all T, its counts taking the filler too)
            if rawget(ml[k], '_pad') == nil then
              local c, p, nt = l:last_stats()
              local cm, pm, ntm = ml[k]:last_stats()
              assert.are.same(c, cm)
              assert.are.equal(nt, ntm)
              assert.is_true(FS.max_rel(pm, p) <= 1e-6, 'the mean scores')
              seen = seen + 1
            end
          end
          assert.is_true(seen >= 1)
        end)

        if not case.f32_only then it(what .. ': two clipped AdamW steps and the whole checkpoint are one process\'s; '
          .. 'loaded, it steps on as one process (f64)', function()
          local hyper = { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
          local ref = build(case, 'f64')
          local ropt = ms.optim.AdamW(ref, hyper)
          local m, mesh = split(case, 'f64', lay[1], sp)
          local opt = ms.optim.AdamW(m, hyper)
          local function steps(mm, o, from, to)
            for step = from, to do
              ref_backward(ref, 10 + step)
              split_backward(mm, mesh, 10 + step)
              FS.clipped_moe_step(ref, ropt, mm, o, step, 1e-10)
            end
          end
          steps(m, opt, 1, 2)
          local rsd, rosd = same_checkpoint(m, opt, hyper, ref, ropt)
          -- the one-process state into a fresh split model: the next step as one process
          local sd = {}
          for name, t in pairs(rsd) do sd[name] = t:clone() end
          local m2 = split(case, 'f64', lay[1], sp)
          local opt2 = ms.optim.AdamW(m2, hyper)
          ms.ep.load_full_state_dict(m2, sd)
          ms.ep.load_full_optimizer_state(m2, opt2, rosd)
          steps(m2, opt2, 3, 3)
          FS.same_state(ms.ep.full_state_dict(m2), ref:state_dict(), 1e-9)
        end) end
      end
    end
  end

  -- FSDP x TP x EP: fully_shard over the ranks that hold the same slices
  -- (mesh.replicate): the units shard each rank's slices over them, each
  -- layer's experts (a unit of their own) over their copies (ep.replicate:
  -- the same ranks with --ep 2 at 4 ranks; none with --ep 4, whole)
  local hyper = { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
  local function shard(m, mesh, strategy) return FS.shard_layers(m, mesh.replicate, strategy, hyper) end
  -- name -> this rank's gradient (its TP slice, its experts whole), from
  -- the units' shards
  local function shard_grads(m)
    local out = {}
    for _, u in ipairs(ms.fsdp.units(m)) do
      local fp = u.fp
      local g = fp.shard.grad
      assert.is_not_nil(g, u.label)
      local full = g
      if g:numel() ~= fp.total then
        full = ms.empty({ fp.total }, { dtype = g.dtype })
        dist.all_gather_into(full, g, { group = fp.group })
      end
      for k, v in ipairs(fp:views(full)) do out[u.param_names[k]] = v end
    end
    return out
  end
  -- a step of two micro-batches of one sequence a TP group, the first under
  -- no_sync (its gradient kept unsharded); one process the same
  -- micro-batches of every group (the load-balancing loss is the
  -- micro-batch's)
  local function fsdp_backward(m, mesh, step)
    local x, y = batch(mesh.coord[1], step)
    local sum = 0
    for mb = 1, 2 do
      local function run()
        local l = m(x:narrow(1, mb, 1):contiguous(), y:narrow(1, mb, 1):contiguous()) * 0.5
        l:backward()
        sum = sum + l:item()
      end
      if mb == 1 then ms.fsdp.no_sync(m, run) else run() end
    end
    return sum
  end
  local function ref_micro_backward(ref, step)
    local ls = {}
    for d = 0, D - 1 do
      local x, y = batch(d, step)
      ls[d] = 0
      for mb = 1, 2 do
        local l = ref(x:narrow(1, mb, 1):contiguous(), y:narrow(1, mb, 1):contiguous()) * 0.5
        ls[d] = ls[d] + l:item()
        l = l * (1 / D)
        l:backward()
      end
    end
    return ls
  end

  for _, case in ipairs(cases) do
    if not case.f32_only then
      for _, lay in ipairs(layouts()) do
        for _, sp in ipairs({ false, true }) do
          for _, strategy in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP' }) do
            local what = ('%s, --tp 2 --ep %d (%s)%s, fully_shard %s'):format(case[1], lay[1], lay[2],
              sp and ', sequence parallel' or '', strategy)
            it(what .. ': the losses, the gradients in the shards, three clipped AdamW steps and the whole checkpoint '
              .. 'are one process\'s; loaded, it steps on as one process (f64)', function()
              local ref = build(case, 'f64')
              local ropt = ms.optim.AdamW(ref, hyper)
              local m, mesh = split(case, 'f64', lay[1], sp)
              local opt = shard(m, mesh, strategy)
              -- an expert unit a layer: over its 2 copies (--ep 2 at 4
              -- ranks) or whole on its rank (one copy)
              FS.moe_unit_sizes(m, W / lay[1], D, #ms.nn.moe.layers(ref))
              local function steps(mm, o, from, to)
                for step = from, to do
                  local ls = ref_micro_backward(ref, 20 + step)
                  local l = fsdp_backward(mm, mesh, 20 + step)
                  local lr = ls[mesh.coord[1]]
                  assert.is_true(FS.rel(l, lr) <= 1e-10, ('step %d: loss %.17g, one process %.17g'):format(step, l, lr))
                  if step == from then
                    -- this rank's pieces of one process's gradients
                    local got = shard_grads(mm)
                    local n = 0
                    for name, p in ref:named_parameters() do
                      local g = got[name]
                      if g ~= nil then
                        local want = ms.tp.local_piece(mm, name, p.grad)
                        local e = FS.max_rel(g:view(want.shape), want)
                        assert.is_true(e <= 1e-10, ('step %d, %s: %g'):format(step, name, e))
                        n = n + 1
                      else
                        assert.is_truthy(name:find('.experts.', 1, true), name)
                      end
                    end
                    local held = 0
                    for _ in pairs(got) do held = held + 1 end
                    assert.are.equal(n, held)
                  end
                  FS.clipped_moe_step(ref, ropt, mm, o, step, 1e-10, step == from + 1)
                end
              end
              steps(m, opt, 1, 3)
              local rsd, rosd = same_checkpoint(m, opt, hyper, ref, ropt)
              -- the one-process state into a fresh split, sharded model
              local sd = {}
              for name, t in pairs(rsd) do sd[name] = t:clone() end
              local m2 = split(case, 'f64', lay[1], sp)
              ms.ep.load_full_state_dict(m2, sd)
              local opt2 = shard(m2, mesh, strategy)
              ms.ep.load_full_optimizer_state(m2, opt2, rosd)
              steps(m2, opt2, 4, 5)
              FS.same_state(ms.ep.full_state_dict(m2), ref:state_dict(), 1e-9)
            end)
          end
        end
      end
    end
  end

  it('fully_shard of a model split by both: over the ranks that hold the same slices; HYBRID_SHARD only given its '
    .. 'mesh and expert_shard', function()
    if W % 2 ~= 0 then pending(('a world of %d: no TP groups of 2'):format(W)) return end
    local case = cases[1]
    local m = split(case, 'f32', 2, true)
    local ok, err = pcall(ms.fsdp.fully_shard, m, { group = dist.world_group })
    assert.is_false(ok)
    assert.matches(('fully_shard: the expert-parallel model\'s experts are split over 2 ranks with %d copies (%d ranks) '
      .. 'and it is 2-way tensor parallel: shard it over the %d ranks that hold the same slices (the tensor-parallel '
      .. 'mesh\'s replicate axis), not a group of %d'):format(W / 2, W, W / 2, W), tostring(err), 1, true)
    ok, err = pcall(ms.fsdp.fully_shard, m, { strategy = 'HYBRID_SHARD', shard_size = 1 })
    assert.is_false(ok)
    assert.matches('fully_shard: HYBRID_SHARD of a model split by both expert and tensor parallelism takes mesh = '
      .. '(shard groups of the ranks that hold the same slices) and expert_shard =', tostring(err), 1, true)
    ok, err = pcall(ms.fsdp.fully_shard, m, { strategy = 'NO_SHARD', group = dist.mesh { replicate = W / 2,
      shard = 2 }.replicate })
    assert.is_false(ok)
    assert.matches('an expert-parallel model takes FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, not NO_SHARD',
      tostring(err), 1, true)
  end)

  it('refuses expert groups that do not hold the TP groups, the wrong order and a missing data-parallel group',
    function()
    if W ~= 4 then return end
    local case = cases[1]
    local mesh = dist.mesh { replicate = 2, shard = 2 }
    -- experts over {0, 1} and {2, 3}, TP over {0, 2} and {1, 3}
    local m = build(case, 'f32')
    ms.ep.parallelize(m, { group = mesh.shard, replicate = mesh.replicate })
    local ok, err = pcall(ms.tp.parallelize, m, { group = mesh.replicate })
    assert.is_false(ok)
    local mine = table.concat(mesh.shard:ranks(), ',')
    assert.matches(('is split by expert parallelism over ranks %s, which do not hold the tensor-parallel group\'s '
      .. 'ranks %s'):format(mine, table.concat(mesh.replicate:ranks(), ',')), tostring(err), 1, true)
    -- tensor parallelism first: the experts already split by features
    local m2 = ms.tp.parallelize(build(case, 'f32'), { group = mesh.shard })
    ok, err = pcall(ms.ep.parallelize, m2, { group = mesh.shard })
    assert.is_false(ok)
    assert.matches('ep.parallelize: the model is tensor-parallel already', tostring(err), 1, true)
    -- the data-parallel group: required, and of the right size
    local m3 = split(case, 'f32', 2, false)
    ok, err = pcall(ms.ep.all_reduce_grads, m3)
    assert.is_false(ok)
    assert.matches('ep.all_reduce_grads: the model is tensor-parallel too: give the data-parallel group', tostring(err),
      1, true)
    ok, err = pcall(ms.ep.all_reduce_grads, m3, dist.world_group)
    assert.is_false(ok)
    assert.matches('a data-parallel group of 4 ranks x 2-way tensor parallel, but the experts split over 2 ranks with '
      .. '2 copies (4)', tostring(err), 1, true)
  end)
end)
