-- Expert parallelism with tensor parallelism in the built-in loop
-- (bin/train --tp N --ep M, docs/moe.md "Expert and tensor parallelism"):
-- CPU ranks through mpirun, against one process over the same global
-- batches. A tiny Mixtral: --tp 2 --ep 2 on 2 ranks with and without
-- sequence parallelism and with the load-balancing loss (one TP group: the
-- loss is one process's), --tp 2 --ep 2 on 4 (two copies of each expert)
-- and --tp 2 --ep 4 on 4 (two TP groups in the expert group) without it
-- (each TP group's own); a tiny DeepSeek-V3 (a split shared expert, MLA,
-- the sequence-wise balance loss, --moe-bias-rate) at --tp 2 --ep 2 on 2
-- and --tp 2 --ep 4 on 4: the loss curve within 1e-5, the final weights
-- whole; a checkpoint is sharded by default (resuming in one process, at
-- --tp 2 --ep 2 and at --ep 2) and a one-process one with
-- --checkpoint-format full, each on the curve; with --fsdp FULL_SHARD /
-- SHARD_GRAD_OP (FSDP x TP x EP) the same curves, a --fsdp checkpoint in
-- both formats; with --fsdp HYBRID_SHARD (shard groups of 2 and of 4
-- ranks on 4) the same curves and gradient norms, a sharded checkpoint
-- resuming in one process, at --tp 2 --ep 2 and under FULL_SHARD, a full
-- one in one process; with --cp 2 (rank = (d * 2 + c) * 2 + t, the expert
-- groups consecutive ranks: --tp 2 --ep 2 --cp 2 and --tp 2 --ep 4 --cp 2 on
-- 4 ranks, --tp 2 --ep 4 --cp 2 on 8) Mixtral and DeepSeek-V3 (also with
-- multi-token prediction) plain and under FULL_SHARD, SHARD_GRAD_OP and
-- HYBRID_SHARD: the curve and the gradient norm, the final weights whole;
-- a --cp checkpoint (sharded, plain and under FSDP, and full) resumes in
-- one process, at other --tp / --ep / --cp layouts, on the curve; bad
-- layouts exit 2 with a message.
require 'moonshard'
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus = S.fixed_corpus(dir, 20000)
local mixtral, deepseek = S.tiny_moe_flags(corpus, 2)
local no_aux = ' --model.output_router_logits false'

local norms = S.run_grad_norms   -- (step -> grad_norm)

describe('bin/train --tp --ep (expert and tensor parallelism, CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  local reference, refs = S.references(dir)   -- (model, args, name) -> its losses; name -> losses
  local close_weights = S.close_weights   -- (spec/support.lua: at most 1 in 50 beyond 2e-5, none beyond 5e-4)
  -- a run of `np` ranks, the global batch of 4 sequences split over its
  -- np / per data-parallel groups (per: the ranks of one; 2, a TP group)
  local function run(np, args, name, per)
    local status, text = bin_train(('--nproc-per-node %d --device cpu %s --batch-size %d --steps 4 --out %s/%s'):format(
      np, args, 4 / (np / (per or 2)), q(dir), name))
    assert.are.equal(0, status, text)
    return text
  end

  it('mixtral: --tp 2 --ep 2 on 2 ranks (with and without sequence parallelism, with the load-balancing loss), '
    .. '--tp 2 --ep 2 and --tp 2 --ep 4 on 4 follow the one-process curve; the final weights are the whole model',
    function()
    local one = reference(mixtral, no_aux, 'm1')
    local aux = reference(mixtral, '', 'm1aux')
    for _, c in ipairs({
      { 2, ' --tp 2 --ep 2', one, '2-way over 2 ranks (1 copy of each expert), 2 of 4 experts a rank in 2 layers, each '
        .. 'expert whole, each group 1 tensor-parallel group of 2', 'data parallel 1, sequence parallel' },
      { 2, ' --tp 2 --ep 2 --no-sequence-parallel', one, nil, 'data parallel 1, no sequence parallel' },
      { 2, ' --tp 2 --ep 2 --model.output_router_logits true', aux, nil, 'sequence parallel' },
      { 4, ' --tp 2 --ep 2', one, '2-way over 4 ranks (2 copies of each expert), 2 of 4 experts a rank in 2 layers',
        'data parallel 2, sequence parallel' },
      { 4, ' --tp 2 --ep 4 --no-sequence-parallel', one, '4-way over 4 ranks (1 copy of each expert), 1 of 4 experts a '
        .. 'rank in 2 layers, each expert whole, each group 2 tensor-parallel groups of 2', 'no sequence parallel' },
    }) do
      local name = ('m%d_%d'):format(c[1], #c[2])
      local args = mixtral .. (c[3] == one and no_aux or '') .. c[2]
      local text = run(c[1], args, name)
      if c[4] then assert.is_truthy(text:find('[rank 0] expert parallel: ' .. c[4], 1, true), text) end
      assert.is_truthy(text:find(c[5], 1, true), text)
      close_losses(c[3], losses(dir .. '/' .. name), 1, 4, ('%d ranks%s'):format(c[1], c[2]))
      close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/' .. (c[3] == one and 'm1' or 'm1aux')
        .. '/model.safetensors', c[2])
    end
  end)

  it('deepseek-v3 (a split shared expert, the sequence-wise balance loss, --moe-bias-rate): --tp 2 --ep 2 on 2 ranks '
    .. 'and --tp 2 --ep 4 on 4 follow the one-process curve', function()
    local one = reference(deepseek, '', 'd1')
    for _, c in ipairs({ { 2, ' --tp 2 --ep 2' }, { 4, ' --tp 2 --ep 4 --no-sequence-parallel' } }) do
      local name = ('d%d'):format(c[1])
      run(c[1], deepseek .. c[2], name)
      close_losses(one, losses(dir .. '/' .. name), 1, 4, 'deepseek-v3' .. c[2])
      close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/d1/model.safetensors', c[2])
    end
  end)

  -- a run of `np` ranks with `flags` and --checkpoint-format full stopped at
  -- step 2 (into dir/name): its checkpoint is the one-process run's after 2
  -- steps (every expert and the whole tensors in one file); a copy of it
  -- resumes in one process, and it resumes on `np` ranks with `resume`, both
  -- on the curve
  local function full_resumes(name, np, flags, resume)
    local one = reference(mixtral, no_aux, 'm1')
    local status, text = bin_train(('--nproc-per-node %d --device cpu %s%s %s --checkpoint-format full --save-every 1 '
      .. '--stop-at 2 --out %s/%s'):format(np, mixtral, no_aux, flags, q(dir), name))
    assert.are.equal(0, status, text)
    close_weights(dir .. '/' .. name .. '/ckpt-2/model.safetensors', dir .. '/m1/ckpt-2/model.safetensors',
      name .. ': the checkpoint')
    os.execute(('cp -r %s/%s %s/%s1'):format(q(dir), name, q(dir), name))
    status, text = bin_train(('--resume %s/%s1'):format(q(dir), name))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/' .. name .. '1'), 1, 4, name .. ': resumed in one process')
    status, text = bin_train(('--nproc-per-node %d --device cpu --resume %s/%s %s'):format(np, q(dir), name, resume))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/' .. name), 1, 4, name .. ': resumed at ' .. resume)
  end

  it('a --tp 2 --ep 2 checkpoint with --checkpoint-format full is a one-process one: it resumes in one process and '
    .. 'at --tp 2 --ep 2 on the curve', function()
    full_resumes('cs', 2, '--batch-size 4 --steps 4 --tp 2 --ep 2', '--tp 2 --ep 2')
  end)

  -- a run of `np` ranks with `flags` stopped at step 2 writes a sharded
  -- checkpoint (index.json); each of `resumes` ({ launcher flags, run
  -- flags }) resumes a copy of it and follows the one-process curve
  local function sharded_resumes(name, np, flags, resumes)
    local one = reference(mixtral, no_aux, 'm1')
    local status, text = bin_train(('--nproc-per-node %d --device cpu %s%s %s --save-every 1 --stop-at 2 --out %s/%s')
      :format(np, mixtral, no_aux, flags, q(dir), name))
    assert.are.equal(0, status, text)
    local f = io.open(dir .. '/' .. name .. '/ckpt-2/index.json')
    assert.is_truthy(f, 'a sharded checkpoint has an index.json')
    f:close()
    for i, c in ipairs(resumes) do
      local copy = name .. i
      os.execute(('cp -r %s/%s %s/%s'):format(q(dir), name, q(dir), copy))
      status, text = bin_train(('%s--resume %s/%s%s'):format(c[1], q(dir), copy, c[2]))
      assert.are.equal(0, status, text)
      close_losses(one, losses(dir .. '/' .. copy), 1, 4, 'resumed ' .. (c[2] == '' and 'in one process' or 'at' .. c[2]))
    end
  end

  it('a --tp 2 --ep 2 checkpoint is sharded by default: it resumes in one process, at --tp 2 --ep 2 and at --ep 2 '
    .. 'on the curve', function()
    sharded_resumes('ss', 2, '--batch-size 4 --steps 4 --tp 2 --ep 2', {
      { '', '' }, { '--nproc-per-node 2 --device cpu ', ' --tp 2 --ep 2' },
      { '--nproc-per-node 2 --device cpu ', ' --tp 1 --ep 2 --batch-size 2' } })
  end)

  -- FSDP x TP x EP (--fsdp FULL_SHARD / SHARD_GRAD_OP): the slices
  -- sharded over the ranks that hold the same ones, the experts over their
  -- copies (none with --ep 4 on 4: whole on their rank)
  it('mixtral and deepseek-v3: --tp 2 --ep 2 and --tp 2 --ep 4 with --fsdp FULL_SHARD and SHARD_GRAD_OP follow the '
    .. 'one-process curve; the final weights are the whole model', function()
    local one = reference(mixtral, no_aux, 'm1')
    local d1 = reference(deepseek, '', 'd1')
    for _, c in ipairs({
      { 2, mixtral .. no_aux, ' --tp 2 --ep 2 --fsdp FULL_SHARD', one, 'm1', ', each rank\'s experts whole, the rest '
        .. 'sharded (FULL_SHARD)' },
      { 4, mixtral .. no_aux, ' --tp 2 --ep 2 --fsdp FULL_SHARD', one, 'm1', ', the experts sharded over their 2 copies '
        .. '(FULL_SHARD)' },
      { 4, mixtral .. no_aux, ' --tp 2 --ep 2 --fsdp SHARD_GRAD_OP --no-sequence-parallel', one, 'm1',
        ', the experts sharded over their 2 copies (SHARD_GRAD_OP)' },
      { 4, mixtral .. no_aux, ' --tp 2 --ep 4 --fsdp SHARD_GRAD_OP', one, 'm1', ', each rank\'s experts whole, the '
        .. 'rest sharded (SHARD_GRAD_OP)' },
      { 4, deepseek, ' --tp 2 --ep 4 --fsdp FULL_SHARD --no-sequence-parallel', d1, 'd1', nil },
      { 4, deepseek, ' --tp 2 --ep 2 --fsdp FULL_SHARD', d1, 'd1', nil },
    }) do
      local name = ('f%d_%d_%s'):format(c[1], #c[3], c[5])
      local text = run(c[1], c[2] .. c[3], name)
      if c[6] then assert.is_truthy(text:find(c[6], 1, true), text) end
      local strategy = c[3]:match('%-%-fsdp (%S+)')
      assert.is_truthy(text:find(('data parallel %d (%s)'):format(c[1] / 2, strategy), 1, true), text)
      close_losses(c[4], losses(dir .. '/' .. name), 1, 4, ('%d ranks%s'):format(c[1], c[3]))
      close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/' .. c[5] .. '/model.safetensors', c[3])
    end
  end)

  it('a --tp 2 --ep 2 --fsdp checkpoint with --checkpoint-format full is a one-process one: it resumes in one process '
    .. 'and at --tp 2 --ep 2 --fsdp on the curve', function()
    full_resumes('fs', 4, '--batch-size 2 --steps 4 --tp 2 --ep 2 --fsdp FULL_SHARD',
      '--tp 2 --ep 2 --fsdp SHARD_GRAD_OP')
  end)

  it('a --tp 2 --ep 2 --fsdp checkpoint is sharded by default: it resumes in one process, at --tp 2 --ep 2 --fsdp '
    .. 'and at --tp 2 --ep 2 on the curve', function()
    sharded_resumes('fss', 4, '--batch-size 2 --steps 4 --tp 2 --ep 2 --fsdp FULL_SHARD', {
      { '', '' }, { '--nproc-per-node 4 --device cpu ', ' --tp 2 --ep 2 --fsdp SHARD_GRAD_OP' },
      { '--nproc-per-node 2 --device cpu ', ' --tp 2 --ep 2 --batch-size 4' } })
  end)

  -- HYBRID_SHARD: shard groups of --shard-size ranks holding whole expert
  -- groups, each as FULL_SHARD over its ranks that hold the same slices
  -- (the experts over their copies in it), replicated across
  it('mixtral and deepseek-v3: --tp 2 --ep 2 --fsdp HYBRID_SHARD (shard groups of 2 and 4 ranks) follow the '
    .. 'one-process curve and gradient norm; the final weights are the whole model', function()
    local one = reference(mixtral, no_aux, 'm1')
    local d1 = reference(deepseek, '', 'd1')
    for _, c in ipairs({
      { mixtral .. no_aux, ' --shard-size 2', one, 'm1', ', each expert whole in each shard group of 2, replicated '
        .. 'over 2 (HYBRID_SHARD)' },
      { mixtral .. no_aux, ' --shard-size 4 --no-sequence-parallel', one, 'm1', ', the experts sharded over their 2 '
        .. 'copies in each shard group of 4, replicated over 1 (HYBRID_SHARD)' },
      { deepseek, ' --shard-size 4', d1, 'd1', nil },
    }) do
      local name = ('h_%d_%s'):format(#c[2], c[4])
      local text = run(4, c[1] .. ' --tp 2 --ep 2 --fsdp HYBRID_SHARD' .. c[2], name)
      if c[5] then assert.is_truthy(text:find(c[5], 1, true), text) end
      assert.is_truthy(text:find('data parallel 2 (HYBRID_SHARD)', 1, true), text)
      local what = '--tp 2 --ep 2 --fsdp HYBRID_SHARD' .. c[2] .. ' (' .. c[4] .. ')'
      close_losses(c[3], losses(dir .. '/' .. name), 1, 4, what)
      close_losses(norms(dir .. '/' .. c[4]), norms(dir .. '/' .. name), 1, 4, what .. ' (gradient norm)')
      close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/' .. c[4] .. '/model.safetensors', what)
    end
  end)

  it('a --tp 2 --ep 2 --fsdp HYBRID_SHARD checkpoint is sharded: it resumes in one process, at --tp 2 --ep 2 and at '
    .. '--tp 2 --ep 2 --fsdp FULL_SHARD on the curve; with --checkpoint-format full it is one process\'s', function()
    sharded_resumes('hs', 4, '--batch-size 2 --steps 4 --tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 2', {
      { '', ' --fsdp off' }, { '--nproc-per-node 2 --device cpu ', ' --tp 2 --ep 2 --fsdp off --batch-size 4' },
      { '--nproc-per-node 4 --device cpu ', ' --tp 2 --ep 2 --fsdp FULL_SHARD' } })
    local one = reference(mixtral, no_aux, 'm1')
    local status, text = bin_train(('--nproc-per-node 4 --device cpu %s%s --batch-size 2 --steps 4 --tp 2 --ep 2 '
      .. '--fsdp HYBRID_SHARD --shard-size 4 --checkpoint-format full --save-every 1 --stop-at 2 --out %s/hf'):format(
      mixtral, no_aux, q(dir)))
    assert.are.equal(0, status, text)
    close_weights(dir .. '/hf/ckpt-2/model.safetensors', dir .. '/m1/ckpt-2/model.safetensors', 'the checkpoint')
    status, text = bin_train(('--resume %s/hf --fsdp off'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/hf'), 1, 4, 'a HYBRID_SHARD full checkpoint resumed in one process')
  end)

  -- --tp 2 --ep M --cp 2 (rank = (d * 2 + c) * 2 + t): the expert groups
  -- M consecutive ranks (M / 2 TP groups of the context-parallel pairs),
  -- each rank routing its own rows of its chunks; the experts' copies the
  -- ranks at the same place in the other expert groups
  local function run_cp(np, args, name) return run(np, args, name, 4) end
  local deepseek_mtp = deepseek .. ' --model.mtp_loss_weight 0.3 --model.num_nextn_predict_layers 2'
  it('mixtral and deepseek-v3 (also with multi-token prediction): --tp 2 --ep 2 --cp 2 and --tp 2 --ep 4 --cp 2 on 4 '
    .. 'ranks and --tp 2 --ep 4 --cp 2 on 8 (data parallel 2) follow the one-process curve and gradient norm, with and '
    .. 'without sequence parallelism; the final weights are the whole model', function()
    local one = reference(mixtral, no_aux, 'm1')
    local d1 = reference(deepseek, '', 'd1')
    local dm = reference(deepseek_mtp, '', 'dm1')
    for _, c in ipairs({
      { 4, mixtral .. no_aux, ' --tp 2 --ep 2 --cp 2', 'm1', '2-way over 4 ranks (2 copies of each expert), 2 of 4 '
        .. 'experts a rank in 2 layers, each expert whole, each group 1 tensor-parallel group of 2' },
      { 4, mixtral .. no_aux, ' --tp 2 --ep 4 --cp 2 --no-sequence-parallel', 'm1', '4-way over 4 ranks (1 copy of '
        .. 'each expert), 1 of 4 experts a rank in 2 layers, each expert whole, each group 2 tensor-parallel groups of 2' },
      { 8, mixtral .. no_aux, ' --tp 2 --ep 4 --cp 2', 'm1', '4-way over 8 ranks (2 copies of each expert)' },
      { 4, deepseek, ' --tp 2 --ep 2 --cp 2', 'd1', nil },
      { 4, deepseek, ' --tp 2 --ep 4 --cp 2 --no-sequence-parallel', 'd1', nil },
      { 8, deepseek, ' --tp 2 --ep 4 --cp 2 --no-sequence-parallel', 'd1', nil },
      { 4, deepseek_mtp, ' --tp 2 --ep 4 --cp 2', 'dm1', nil },
    }) do
      local name = ('c%d_%d_%s'):format(c[1], #c[3], c[4])
      local text = run_cp(c[1], c[2] .. c[3], name)
      if c[5] then assert.is_truthy(text:find('[rank 0] expert parallel: ' .. c[5], 1, true), text) end
      assert.is_truthy(text:find(('context parallel: 2-way (ring attention, load-balanced chunks of 4 tokens), data '
        .. 'parallel %d'):format(c[1] / 4), 1, true), text)
      local what = ('%d ranks%s (%s)'):format(c[1], c[3], c[4])
      close_losses(refs[c[4]], losses(dir .. '/' .. name), 1, 4, what)
      close_losses(norms(dir .. '/' .. c[4]), norms(dir .. '/' .. name), 1, 4, what .. ' (gradient norm)')
      close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/' .. c[4] .. '/model.safetensors', what)
    end
    assert.are.same(one, refs.m1); assert.are.same(d1, refs.d1); assert.are.same(dm, refs.dm1)
  end)

  it('mixtral and deepseek-v3: --tp 2 --ep M --cp 2 with --fsdp FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD (shard '
    .. 'groups of 2 and of 4 ranks) follow the one-process curve and gradient norm; the final weights are the whole '
    .. 'model', function()
    reference(mixtral, no_aux, 'm1')
    reference(deepseek, '', 'd1')
    for _, c in ipairs({
      { 4, mixtral .. no_aux, ' --tp 2 --ep 2 --cp 2 --fsdp FULL_SHARD', 'm1', ', the experts sharded over their 2 '
        .. 'copies (FULL_SHARD)', 'FULL_SHARD over 2 ranks' },
      { 4, mixtral .. no_aux, ' --tp 2 --ep 4 --cp 2 --fsdp SHARD_GRAD_OP --no-sequence-parallel', 'm1', ', each '
        .. 'rank\'s experts whole, the rest sharded (SHARD_GRAD_OP)', 'SHARD_GRAD_OP over 2 ranks' },
      { 8, mixtral .. no_aux, ' --tp 2 --ep 4 --cp 2 --fsdp FULL_SHARD', 'm1', ', the experts sharded over their 2 '
        .. 'copies (FULL_SHARD)', 'FULL_SHARD over 4 ranks' },
      { 4, mixtral .. no_aux, ' --tp 2 --ep 2 --cp 2 --fsdp HYBRID_SHARD --shard-size 2', 'm1', ', each expert whole '
        .. 'in each shard group of 2, replicated over 2 (HYBRID_SHARD)', 'HYBRID_SHARD over 2 ranks' },
      { 4, mixtral .. no_aux, ' --tp 2 --ep 2 --cp 2 --fsdp HYBRID_SHARD --shard-size 4 --no-sequence-parallel', 'm1',
        ', the experts sharded over their 2 copies in each shard group of 4, replicated over 1 (HYBRID_SHARD)', nil },
      { 4, deepseek, ' --tp 2 --ep 4 --cp 2 --fsdp FULL_SHARD', 'd1', nil, nil },
      { 4, deepseek, ' --tp 2 --ep 2 --cp 2 --fsdp HYBRID_SHARD --shard-size 2', 'd1', nil, nil },
    }) do
      local name = ('cf%d_%d_%s'):format(c[1], #c[3], c[4])
      local text = run_cp(c[1], c[2] .. c[3], name)
      if c[5] then assert.is_truthy(text:find(c[5], 1, true), text) end
      if c[6] then assert.is_truthy(text:find('[rank 0] fsdp: ' .. c[6], 1, true), text) end
      local what = ('%d ranks%s (%s)'):format(c[1], c[3], c[4])
      close_losses(refs[c[4]], losses(dir .. '/' .. name), 1, 4, what)
      close_losses(norms(dir .. '/' .. c[4]), norms(dir .. '/' .. name), 1, 4, what .. ' (gradient norm)')
      close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/' .. c[4] .. '/model.safetensors', what)
    end
  end)

  it('a --tp 2 --ep 4 --cp 2 checkpoint is sharded: it resumes in one process, at --tp 2 --ep 2 --cp 2, at --ep 2 --cp 2 '
    .. 'and at --tp 2 --ep 2 on the curve; under --fsdp FULL_SHARD too (resuming at --tp 2 --ep 4 --cp 2 --fsdp '
    .. 'SHARD_GRAD_OP); with --checkpoint-format full it is one process\'s', function()
    sharded_resumes('cps', 4, '--batch-size 4 --steps 4 --tp 2 --ep 4 --cp 2', {
      { '', '' }, { '--nproc-per-node 4 --device cpu ', ' --tp 2 --ep 2 --cp 2' },
      { '--nproc-per-node 2 --device cpu ', ' --tp 1 --ep 2 --cp 2' },
      { '--nproc-per-node 2 --device cpu ', ' --tp 2 --ep 2 --cp 1' } })
    sharded_resumes('cpfs', 4, '--batch-size 4 --steps 4 --tp 2 --ep 4 --cp 2 --fsdp FULL_SHARD', {
      { '', ' --fsdp off' }, { '--nproc-per-node 4 --device cpu ', ' --tp 2 --ep 4 --cp 2 --fsdp SHARD_GRAD_OP' } })
    full_resumes('cpf', 4, '--batch-size 4 --steps 4 --tp 2 --ep 2 --cp 2', '--tp 2 --ep 2 --cp 2')
  end)

  it('bad layouts exit 2 and say why', function()
    local function bad(np, extra, msg)
      local status, text = bin_train(('--nproc-per-node %d --device cpu %s%s --steps 1 %s --out %s/bad'):format(np,
        mixtral, no_aux, extra, q(dir)))
      assert.are.equal(2, status, text)
      assert.is_truthy(text:find(msg, 1, true), text)
    end
    bad(4, '--tp 4 --ep 2', '--ep 2 with --tp 4: --ep must be a multiple of --tp (an expert group holds whole '
      .. 'tensor-parallel groups of consecutive ranks: --ep 4, 8, ...)')
    bad(4, '--tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 1', '--ep 2 --tp 2 with --fsdp HYBRID_SHARD: the shard '
      .. 'groups of 1 ranks (--shard-size; default the ranks of a node) must hold whole expert groups and divide the '
      .. 'world of 4')
    bad(4, '--tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 8', 'the shard groups of 8 ranks')
    -- (--cp: a world of whole context-parallel groups of TP groups, expert
    -- groups of whole TP groups that divide it, the experts split evenly)
    bad(2, '--tp 2 --ep 2 --cp 2', '--cp 2 with --tp 2: the world of 2 ranks is not a multiple of 4')
    bad(4, '--tp 2 --ep 8 --cp 2', '--ep 8: the world of 4 ranks is not a multiple of it')
    bad(8, '--tp 4 --ep 2 --cp 2', '--ep 2 with --tp 4: --ep must be a multiple of --tp')
    bad(8, '--tp 2 --ep 8 --cp 2', '--ep 8: ep.parallelize: 4 experts do not split over 8 ranks')
    bad(4, '--tp 2 --ep 2 --cp 2 --fsdp HYBRID_SHARD --shard-size 1', '--ep 2 --tp 2 with --fsdp HYBRID_SHARD: the '
      .. 'shard groups of 1 ranks')
  end)
end)
