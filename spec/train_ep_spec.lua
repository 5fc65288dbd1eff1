-- Expert parallelism in the built-in loop (bin/train --ep N, docs/moe.md):
-- CPU ranks through mpirun, a tiny Mixtral (4 experts, 2 a token, without
-- the load-balancing loss, which is each rank's tokens' own). Checked
-- against one process over the same global batches: the loss curve
-- (within 1e-5 relative) at --ep 2 on 2 ranks, --ep 2 on 4 (two copies of
-- each expert) and --ep 4 on 4, and with --moe-bias-rate (under bf16
-- autocast, GPUs' default, within bf16 rounding); the final
-- weights are the whole model; the checkpoints are one process's (every
-- expert in them) and resume in one process and at --ep 2 with the losses
-- of the run that never stopped, and a one-process checkpoint resumes at
-- --ep 2; with --fsdp FULL_SHARD (4 ranks) and SHARD_GRAD_OP (2) the
-- same curve and weights, sharded checkpoints that list every expert and
-- resume in one process, as they ran and under plain --ep; with --fsdp
-- HYBRID_SHARD (4 ranks in shard groups of 2, 8 in groups of 4) the same
-- curve and weights, and the 8-rank run resumes as it ran and in one
-- process; bad layouts exit 2 with a message. Activation checkpointing, micro-batches and
-- --init-from follow the curve too.
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus = S.fixed_corpus(dir, 20000)
local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 48 '
  .. '--model.output_router_logits false --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 '
  .. '--sample-tokens 0 --log-every 2 --data ' .. q(corpus)

describe('bin/train --ep (expert parallelism, CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- the one-process run: 4 steps of 4 sequences, checkpoints every 2
  local refs = {}
  local function reference(extra, name)
    if refs[name] then return refs[name] end
    local status, text = bin_train(('models/mixtral.lua %s%s --batch-size 4 --steps 4 --save-every 2 --out %s/%s'):format(
      flags, extra, q(dir), name))
    assert.are.equal(0, status, text)
    refs[name] = losses(dir .. '/' .. name)
    return refs[name]
  end
  local function max_diff(a, b)
    local d = (a:to('f64') - b:to('f64')):abs():max():item()
    return d
  end

  it('--ep 2 on 2 ranks, --ep 2 on 4 (two copies) and --ep 4 on 4 follow the one-process curve; the final weights are '
    .. 'the whole model', function()
    local one = reference('', 'one')
    local mixtral = require 'models.mixtral'
    local m1 = mixtral.from_pretrained(dir .. '/one')
    for _, c in ipairs({ { 2, 2, '2-way over 2 ranks (1 copy of each expert), 2 of 4 experts a rank in 2 layers, 0.04M' },
      { 4, 2, '2-way over 4 ranks (2 copies of each expert), 2 of 4 experts a rank in 2 layers, 0.04M' },
      { 4, 4, '4-way over 4 ranks (1 copy of each expert), 1 of 4 experts a rank in 2 layers, 0.03M' } }) do
      local np, ep = c[1], c[2]
      local out = ('%s/ep%d_%d'):format(dir, np, ep)
      local status, text = bin_train(('--nproc-per-node %d --device cpu models/mixtral.lua %s --batch-size %d --steps 4 '
        .. '--ep %d --out %s'):format(np, flags, 4 / np, ep, q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('[rank 0] expert parallel: ' .. c[3], 1, true), text)
      close_losses(one, losses(out), 1, 4, ('--ep %d on %d ranks'):format(ep, np))
      -- the saved folder: every expert, the one-process run's weights
      local m = mixtral.from_pretrained(out)
      local ref = m1:state_dict()
      local n = 0
      for name, t in pairs(m:state_dict()) do
        n = n + 1
        local d = max_diff(t, ref[name])
        -- lr 1e-2: 5% of one step. f32 sums in another order move the
        -- weights of experts that few tokens chose by up to ~1e-4 (AdamW
        -- divides by their small second moments)
        assert.is_true(d <= 5e-4, ('%s (--ep %d on %d): %g from the one-process weights'):format(name, ep, np, d))
      end
      assert.is_truthy(ref['model.layers.1.block_sparse_moe.experts.3.w2.weight'])
      assert.is_truthy(m:state_dict()['model.layers.1.block_sparse_moe.experts.3.w2.weight'])
    end
  end)

  it('--ep 2 with --moe-bias-rate follows the one-process curve (the counts summed over the ranks)', function()
    local one = reference(' --moe-bias-rate 1e-2', 'one_bias')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --moe-bias-rate 1e-2 '
      .. '--batch-size 2 --steps 4 --ep 2 --out %s/ep_bias'):format(flags, q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/ep_bias'), 1, 4, '--ep 2 --moe-bias-rate')
  end)

  it('--ep 2 --autocast bf16 (the default on GPUs): the forward under bf16 autocast, the f32 curve within '
    .. 'bf16 rounding', function()
    local one = reference('', 'one')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 2 --steps 4 '
      .. '--ep 2 --autocast bf16 --out %s/ep_bf16'):format(flags, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('parameters, f32, bf16 autocast', 1, true), text)
    local got = losses(dir .. '/ep_bf16')
    close_losses(one, got, 1, 4, '--ep 2 under bf16 autocast', 2e-2)
    local same = true
    for k = 1, 4 do same = same and got[k] == one[k] end
    assert.is_false(same, 'the bf16 forward gave the f32 losses bit for bit: autocast did not run')
  end)

  it('with --checkpoint-format full an --ep checkpoint is a one-process one: it resumes in one process and at --ep 2 '
    .. 'with the same losses, and a one-process checkpoint resumes at --ep 2', function()
    local one = reference('', 'one')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 2 --steps 4 '
      .. '--ep 2 --checkpoint-format full --save-every 1 --stop-at 2 --out %s/es'):format(flags, q(dir)))
    assert.are.equal(0, status, text)
    -- every expert in the files, the one-process run's values after 2 steps
    local st = require 'moonshard.safetensors'
    local sd = st.load(dir .. '/es/ckpt-2/model.safetensors')
    local ref2 = st.load(dir .. '/one/ckpt-2/model.safetensors')
    local n = 0
    for name, t in pairs(ref2) do
      n = n + 1
      assert.is_truthy(sd[name], name)
      assert.is_true(max_diff(sd[name], t) <= 1e-4, name)
    end
    for name in pairs(sd) do assert.is_truthy(ref2[name], 'not the model\'s: ' .. name) end
    assert.is_true(n > 0)
    local osd = st.load(dir .. '/es/ckpt-2/optimizer.safetensors')
    local oref = st.load(dir .. '/one/ckpt-2/optimizer.safetensors')
    for name, t in pairs(oref) do
      assert.is_truthy(osd[name], name)
      assert.is_true(max_diff(osd[name], t) <= 1e-4 * math.max(1, t:abs():max():item()), name)
    end
    os.execute(('cp -r %s/es %s/es1'):format(q(dir), q(dir)))
    status, text = bin_train(('--resume %s/es1'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/es1'), 1, 4, 'an --ep checkpoint resumed in one process')
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s/es --ep 2'):format(q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('resumed from', 1, true), text)
    close_losses(one, losses(dir .. '/es'), 1, 4, 'an --ep checkpoint resumed at --ep 2')
    -- a one-process checkpoint at --ep 2 on 2 ranks, and at --ep 2 on 4 (the
    -- same global batch: a one-process checkpoint keeps its --batch-size)
    for _, np in ipairs({ 2, 4 }) do
      local r = ('%s/one_r%d'):format(dir, np)
      os.execute(('mkdir -p %s && cp -r %s/one/ckpt-2 %s/'):format(q(r), q(dir), q(r)))
      status, text = bin_train(('--nproc-per-node %d --device cpu --resume %s --ep 2 --batch-size %d'):format(np, q(r),
        4 / np))
      assert.are.equal(0, status, text)
      close_losses(one, losses(r), 3, 4, ('a one-process checkpoint resumed at --ep 2 on %d ranks'):format(np))
    end
  end)

  it('--ep with --fsdp FULL_SHARD (4 ranks) and SHARD_GRAD_OP (2): the one-process curve and final weights; stopped, '
    .. 'it resumes in one process and under --ep --fsdp, and a one-process checkpoint resumes under --ep --fsdp', function()
    local one = reference('', 'one')
    local mixtral = require 'models.mixtral'
    local ref = mixtral.from_pretrained(dir .. '/one'):state_dict()
    for _, c in ipairs({ { 4, 'FULL_SHARD', 2 }, { 2, 'SHARD_GRAD_OP', 2 } }) do
      local np, strategy, ep = c[1], c[2], c[3]
      local common = ('--nproc-per-node %d --device cpu models/mixtral.lua %s --batch-size %d --steps 4 --ep %d '
        .. '--fsdp %s'):format(np, flags, 4 / np, ep, strategy)
      local out = ('%s/ef_%s'):format(dir, strategy)
      local status, text = bin_train(('%s --out %s'):format(common, q(out)))
      assert.are.equal(0, status, text)
      local how = np > ep and ('the experts sharded over their %d copies (%s)'):format(np / ep, strategy)
        or ('each rank\'s experts whole, the rest sharded (%s)'):format(strategy)
      assert.is_truthy(text:find(how, 1, true), text)
      assert.is_truthy(text:find(('[rank 0] fsdp: %s over %d ranks'):format(strategy, np), 1, true), text)
      close_losses(one, losses(out), 1, 4, ('--ep %d --fsdp %s on %d ranks'):format(ep, strategy, np))
      local m = mixtral.from_pretrained(out)
      for name, t in pairs(m:state_dict()) do
        assert.is_true(max_diff(t, ref[name]) <= 1e-4, ('%s (--ep --fsdp %s)'):format(name, strategy))
      end
      -- stopped after 2 steps: a sharded checkpoint (each rank's pieces, its
      -- experts' among them), resumed in one process, as it ran, and under
      -- plain --ep 2 on 2 ranks
      local st_out = out .. '_s'
      status, text = bin_train(('%s --save-every 1 --stop-at 2 --out %s'):format(common, q(st_out)))
      assert.are.equal(0, status, text)
      local index = require('moonshard.fsdp_checkpoint').read_index(st_out .. '/ckpt-2')
      assert.are.equal(np, index.world_size)
      local listed = {}
      for _, e in ipairs(index.params) do listed[#listed + 1] = e.name end
      local whole = {}
      for name in mixtral.from_pretrained(dir .. '/one'):named_parameters() do whole[#whole + 1] = name end
      assert.are.same(whole, listed)   -- every expert, in the whole model's order
      for _, c2 in ipairs({ { '1', '', '' }, { '', ('--nproc-per-node %d --device cpu'):format(np),
        (' --ep %d --fsdp %s'):format(ep, strategy) }, { '2', '--nproc-per-node 2 --device cpu', ' --ep 2' } }) do
        local d = st_out .. c2[1]
        if c2[1] ~= '' then os.execute(('cp -r %s %s'):format(q(st_out), q(d))) end
        status, text = bin_train(('%s --resume %s%s'):format(c2[2], q(d), c2[3]))
        assert.are.equal(0, status, text)
        close_losses(one, losses(d), 1, 4, ('--ep --fsdp %s resumed by %s%s'):format(strategy, c2[2], c2[3]))
      end
      local r = out .. '_one'
      os.execute(('mkdir -p %s && cp -r %s/one/ckpt-2 %s/'):format(q(r), q(dir), q(r)))
      status, text = bin_train(('--nproc-per-node %d --device cpu --resume %s --ep %d --fsdp %s --batch-size %d'):format(
        np, q(r), ep, strategy, 4 / np))
      assert.are.equal(0, status, text)
      close_losses(one, losses(r), 3, 4, 'a one-process checkpoint resumed under --ep --fsdp ' .. strategy)
    end
  end)

  it('--ep 2 with the layers checkpointed (the recompute exchanges again, under FSDP too) and with micro-batches '
    .. '(plain and under FSDP) follows the one-process curve', function()
    local one = reference('', 'one')
    for i, extra in ipairs({ '--activation-checkpointing full', '--activation-checkpointing full --fsdp FULL_SHARD',
      '--batch-size 1 --tokens-per-step 64', '--batch-size 1 --tokens-per-step 64 --fsdp FULL_SHARD' }) do
      local out = ('%s/epx%d'):format(dir, i)
      local status, text = bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 2 --steps 4 '
        .. '--ep 2 %s --out %s'):format(flags, extra, q(out)))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out), 1, 4, '--ep 2 ' .. extra)
    end
  end)

  it('--ep 2 --init-from a saved folder (each rank reads its experts), plain and under FSDP: one process\'s curve from it',
    function()
    reference('', 'one')
    local common = ('--seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 1 '
      .. '--data %s --init-from %s/one --steps 3'):format(q(corpus), q(dir))
    local status, text = bin_train(('models/mixtral.lua %s --batch-size 4 --out %s/if1'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    local one = losses(dir .. '/if1')
    for i, extra in ipairs({ '', ' --fsdp FULL_SHARD' }) do
      local out = ('%s/if_ep%d'):format(dir, i)
      status, text = bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 2 --ep 2%s --out %s')
        :format(common, extra, q(out)))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out), 1, 3, '--ep 2 --init-from' .. extra)
    end
  end)

  it('--ep with --cp (each rank its chunks of its group\'s sequences): --ep 2 --cp 2 on 2 ranks and --ep 4 --cp 2 '
    .. '--fsdp FULL_SHARD on 4 follow the one-process curve', function()
    local one = reference('', 'one')
    for _, c in ipairs({ { 2, 2, '', 4 }, { 4, 4, ' --fsdp FULL_SHARD', 2 } }) do
      local out = ('%s/epcp%d'):format(dir, c[1])
      local status, text = bin_train(('--nproc-per-node %d --device cpu models/mixtral.lua %s --batch-size %d --steps 4 '
        .. '--ep %d --cp 2%s --out %s'):format(c[1], flags, c[4], c[2], c[3], q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('[rank 0] context parallel: 2-way', 1, true), text)
      assert.is_truthy(text:find(('[rank 0] expert parallel: %d-way over %d ranks'):format(c[2], c[1]), 1, true), text)
      close_losses(one, losses(out), 1, 4, ('--ep %d --cp 2%s on %d ranks'):format(c[2], c[3], c[1]))
    end
  end)

  it('--ep 2 with --fsdp HYBRID_SHARD (the expert groups inside the shard groups): 4 ranks in shard groups of 2 and 8 '
    .. 'in groups of 4 follow the one-process curve and final weights; stopped, the 8-rank run resumes as it ran and '
    .. 'in one process', function()
    local mixtral = require 'models.mixtral'
    for _, c in ipairs({ { 4, 2 }, { 8, 4 } }) do
      local np, S = c[1], c[2]
      -- the one-process run over the same global batches (np sequences a step)
      local ref_out = ('%s/hy_one_%d'):format(dir, np)
      local status, text = bin_train(('models/mixtral.lua %s --batch-size %d --steps 4 --out %s'):format(flags, np,
        q(ref_out)))
      assert.are.equal(0, status, text)
      local one = losses(ref_out)
      local ref = mixtral.from_pretrained(ref_out):state_dict()
      local common = ('--nproc-per-node %d --device cpu models/mixtral.lua %s --batch-size 1 --steps 4 --ep 2 '
        .. '--fsdp HYBRID_SHARD --shard-size %d'):format(np, flags, S)
      local out = ('%s/hy_%d'):format(dir, np)
      status, text = bin_train(('%s --out %s'):format(common, q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find(('the experts sharded over their %d copies in each shard group of %d, replicated over '
        .. '%d (HYBRID_SHARD)'):format(S / 2, S, np / S), 1, true), text)
      close_losses(one, losses(out), 1, 4, ('--ep 2 --fsdp HYBRID_SHARD --shard-size %d on %d ranks'):format(S, np))
      local m = mixtral.from_pretrained(out)
      for name, t in pairs(m:state_dict()) do
        assert.is_true(max_diff(t, ref[name]) <= 1e-4, ('%s (--ep 2 HYBRID_SHARD on %d ranks)'):format(name, np))
      end
      if np == 8 then
        local st_out = out .. '_s'
        status, text = bin_train(('%s --save-every 1 --stop-at 2 --out %s'):format(common, q(st_out)))
        assert.are.equal(0, status, text)
        -- every tensor listed once (the replicas write nothing), every expert among them
        local index = require('moonshard.fsdp_checkpoint').read_index(st_out .. '/ckpt-2')
        local listed, whole = {}, {}
        for _, e in ipairs(index.params) do listed[#listed + 1] = e.name end
        for name in mixtral.from_pretrained(ref_out):named_parameters() do whole[#whole + 1] = name end
        assert.are.same(whole, listed)
        local d1 = st_out .. '1'
        os.execute(('cp -r %s %s'):format(q(st_out), q(d1)))
        status, text = bin_train(('--nproc-per-node 8 --device cpu --resume %s --ep 2 --fsdp HYBRID_SHARD --shard-size 4')
          :format(q(st_out)))
        assert.are.equal(0, status, text)
        close_losses(one, losses(st_out), 1, 4, '--ep 2 HYBRID_SHARD, resumed as it ran')
        status, text = bin_train(('--resume %s --batch-size 8 --ep 1 --fsdp off'):format(q(d1)))
        assert.are.equal(0, status, text)
        close_losses(one, losses(d1), 1, 4, '--ep 2 HYBRID_SHARD, resumed in one process')
      end
    end
  end)

  it('bad layouts exit 2 and say why', function()
    local function fails(args, msg)
      local status, text = bin_train(args .. (' --steps 1 --out %s/bad'):format(q(dir)))
      assert.are.equal(2, status, text)
      assert.is_truthy(text:find(msg, 1, true), text)
    end
    fails(('models/mixtral.lua %s --ep 2'):format(flags), '--ep 2: the world of 1 rank is not a multiple of it')
    fails(('--nproc-per-node 4 --device cpu models/mixtral.lua %s --ep 4 --fsdp HYBRID_SHARD --shard-size 2'):format(
      flags), '--ep 4 with --fsdp HYBRID_SHARD: the shard groups of 2 ranks (--shard-size; default the ranks of a node) '
      .. 'must hold whole expert groups and divide the world of 4')
    -- (--tp --ep --fsdp FULL_SHARD / SHARD_GRAD_OP train: spec/train_ep_tp_spec.lua)
    fails(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --ep 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 1')
      :format(flags), '--ep 2 --tp 2 with --fsdp HYBRID_SHARD: the shard groups of 1 ranks')
    fails(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --ep 2 --lora 4'):format(flags),
      '--ep with --lora: not supported')
    fails(('--nproc-per-node 3 --device cpu models/mixtral.lua %s --ep 3'):format(flags),
      '--ep 3: ep.parallelize: 4 experts do not split over 3 ranks')
    fails(('--nproc-per-node 2 --device cpu models/llama.lua --preset tiny --model.num_hidden_layers 1 --seq-len 16 '
      .. '--data %s --ep 2'):format(q(corpus)), '--ep 2: ep.parallelize: the model has no MoE layers')
  end)
end)
