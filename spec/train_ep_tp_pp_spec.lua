-- Expert and tensor parallelism inside pipeline stages (bin/train --pp P
-- --tp N --ep M, docs/moe.md "Expert and tensor parallelism"): CPU ranks
-- through mpirun, 4 ranks at --pp 2 --tp 2 --ep 2 (each stage one TP group
-- of 2, which is its expert group), against one process over the same
-- global batches. A tiny Mixtral (one MoE layer a stage, no load-balancing
-- loss) plain, with sequence parallelism, under --fsdp FULL_SHARD and
-- SHARD_GRAD_OP, and a tiny DeepSeek-V3 (a split shared expert, MLA, the
-- sequence-wise balance loss, --moe-bias-rate) plain and under FULL_SHARD:
-- the loss curve and the gradient norm within 1e-5 (the norm counts every
-- parameter once: each expert, each slice, each replicated tensor), the
-- final weights whole; a checkpoint, sharded (plain and under FSDP) or
-- --checkpoint-format full, resumes in one process, at --tp 2 --ep 2 and
-- at --pp 2 --tp 2 --ep 2 on the curve, and a one-process checkpoint
-- resumes at --pp 2 --tp 2 --ep 2; with --cp 2 too (8 ranks) Mixtral plain
-- and under FULL_SHARD and DeepSeek-V3 on the curve and gradient norm;
-- bad layouts exit 2 with a message.
require 'moonshard'
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus = S.fixed_corpus(dir, 20000)
local mixtral, deepseek = S.tiny_moe_flags(corpus, 1, ' --model.output_router_logits false')
local layout = ' --pp 2 --tp 2 --ep 2'

local norms = S.run_grad_norms   -- (step -> grad_norm)

describe('bin/train --pp 2 --tp 2 --ep 2 (expert and tensor parallelism in pipeline stages, CPU through mpirun)',
  function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- the one-process runs: 4 steps of 4 sequences, checkpoints every 2
  local reference = S.references(dir)   -- (model, args, name) -> its losses
  local close_weights = S.close_weights   -- (spec/support.lua: at most 1 in 50 beyond 2e-5, none beyond 5e-4)

  it('mixtral and deepseek-v3 follow the one-process curve and gradient norm, plain, with sequence parallelism and '
    .. 'under --fsdp FULL_SHARD and SHARD_GRAD_OP; the final weights are the whole model', function()
    local one, d1 = reference(mixtral, '', 'm1'), reference(deepseek, '', 'd1')
    for _, c in ipairs({
      { mixtral, '', 'm1', '[rank 0] expert parallel: 2-way in each stage\'s 2 ranks (1 copy of each expert), 2 of 4 experts a rank in 2 layers, '
        .. 'each expert whole, each group 1 tensor-parallel group of 2 routing its ranks\' own rows' },
      { mixtral, ' --sequence-parallel', 'm1', nil },
      { mixtral, ' --fsdp FULL_SHARD', 'm1', 'each rank\'s experts whole, the rest sharded (FULL_SHARD)' },
      { mixtral, ' --fsdp SHARD_GRAD_OP --sequence-parallel', 'm1', nil },
      { deepseek, '', 'd1', nil },
      { deepseek, ' --fsdp FULL_SHARD', 'd1', nil },
    }) do
      local name = ('p_%s_%d'):format(c[3], #c[2])
      local status, text = bin_train(('--nproc-per-node 4 --device cpu %s%s%s --batch-size 4 --steps 4 --out %s/%s')
        :format(c[1], layout, c[2], q(dir), name))
      assert.are.equal(0, status, text)
      if c[4] then assert.is_truthy(text:find(c[4], 1, true), text) end
      assert.is_truthy(text:find(c[2]:find('sequence') and ', sequence parallel' or ', no sequence parallel', 1, true),
        text)
      local what = layout .. c[2] .. ' (' .. c[3] .. ')'
      close_losses(c[3] == 'm1' and one or d1, losses(dir .. '/' .. name), 1, 4, what)
      close_losses(norms(dir .. '/' .. c[3]), norms(dir .. '/' .. name), 1, 4, what .. ' (gradient norm)')
      close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/' .. c[3] .. '/model.safetensors', what)
    end
  end)

  -- --cp 2 too (8 ranks, rank = (c * 2 + p) * 2 + t): each stage's 4 ranks
  -- (its TP groups of the two context-parallel ranks) split its experts in
  -- expert groups of 2 (one TP group each), the copies on the other
  -- context-parallel rank
  it('with --cp 2 too (8 ranks), mixtral plain and under --fsdp FULL_SHARD and deepseek-v3 plain follow the '
    .. 'one-process curve and gradient norm; the final weights are the whole model', function()
    local one, d1 = reference(mixtral, '', 'm1'), reference(deepseek, '', 'd1')
    for _, c in ipairs({ { mixtral, '', 'm1' }, { mixtral, ' --fsdp FULL_SHARD --sequence-parallel', 'm1' },
      { deepseek, '', 'd1' } }) do
      local name = ('pc_%s_%d'):format(c[3], #c[2])
      local status, text = bin_train(('--nproc-per-node 8 --device cpu %s%s --cp 2%s --batch-size 4 --steps 4 '
        .. '--out %s/%s'):format(c[1], layout, c[2], q(dir), name))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('[rank 0] expert parallel: 2-way in each stage\'s 4 ranks (2 copies of each expert)',
        1, true), text)
      assert.is_truthy(text:find('context parallel: 2-way', 1, true), text)
      local what = layout .. ' --cp 2' .. c[2] .. ' (' .. c[3] .. ')'
      close_losses(c[3] == 'm1' and one or d1, losses(dir .. '/' .. name), 1, 4, what)
      close_losses(norms(dir .. '/' .. c[3]), norms(dir .. '/' .. name), 1, 4, what .. ' (gradient norm)')
      close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/' .. c[3] .. '/model.safetensors', what)
    end
  end)

  -- a run with `flags` stopped at step 2 writes a checkpoint (sharded:
  -- index.json); each of `resumes` ({ launcher flags, run flags }) resumes
  -- a copy of it and follows the one-process curve
  local function resumes(name, flags, sharded, list)
    local one = reference(mixtral, '', 'm1')
    local status, text = bin_train(('--nproc-per-node 4 --device cpu %s%s --batch-size 4 --steps 4 %s --save-every 1 '
      .. '--stop-at 2 --out %s/%s'):format(mixtral, layout, flags, q(dir), name))
    assert.are.equal(0, status, text)
    local f = io.open(dir .. '/' .. name .. '/ckpt-2/index.json')
    assert.are.equal(sharded, f ~= nil, name .. ': a sharded checkpoint has an index.json')
    if f then f:close() end
    if not sharded then
      -- a one-process checkpoint: every expert and the whole tensors in one file
      close_weights(dir .. '/' .. name .. '/ckpt-2/model.safetensors', dir .. '/m1/ckpt-2/model.safetensors', name)
    end
    for i, c in ipairs(list) do
      local copy = name .. i
      os.execute(('cp -r %s/%s %s/%s'):format(q(dir), name, q(dir), copy))
      status, text = bin_train(('%s--resume %s/%s%s'):format(c[1], q(dir), copy, c[2]))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('resumed from', 1, true), text)
      close_losses(one, losses(dir .. '/' .. copy), 1, 4, name .. ' resumed ' .. (c[2] == '' and 'in one process'
        or 'at' .. c[2]))
    end
  end
  local at_tp_ep = { '--nproc-per-node 2 --device cpu ', ' --pp 1 --tp 2 --ep 2' }
  local at_pp_fsdp = { '--nproc-per-node 4 --device cpu ', layout .. ' --fsdp SHARD_GRAD_OP' }

  it('a checkpoint is sharded by default: it resumes in one process, at --tp 2 --ep 2 and at --pp 2 --tp 2 --ep 2 '
    .. '--fsdp on the curve', function()
    resumes('ps', '', true, { { '', '' }, at_tp_ep, at_pp_fsdp })
  end)

  it('a --fsdp FULL_SHARD checkpoint is sharded: it resumes in one process, at --tp 2 --ep 2 and at --pp 2 --tp 2 '
    .. '--ep 2 --fsdp SHARD_GRAD_OP on the curve', function()
    resumes('pfs', '--fsdp FULL_SHARD', true, { { '', '' }, at_tp_ep, at_pp_fsdp })
  end)

  it('with --checkpoint-format full (plain and under FSDP) a checkpoint is one process\'s: it resumes in one process '
    .. 'and at --pp 2 --tp 2 --ep 2; a one-process checkpoint resumes at --pp 2 --tp 2 --ep 2 on the curve', function()
    resumes('pf', '--checkpoint-format full', false, { { '', '' }, { '--nproc-per-node 4 --device cpu ', layout } })
    resumes('pff', '--fsdp FULL_SHARD --checkpoint-format full', false, { { '', '' } })
    local one = reference(mixtral, '', 'm1')
    local r = dir .. '/one_r'
    os.execute(('mkdir -p %s && cp -r %s/m1/ckpt-2 %s/'):format(q(r), q(dir), q(r)))
    local status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s%s'):format(q(r), layout))
    assert.are.equal(0, status, text)
    close_losses(one, losses(r), 3, 4, 'a one-process checkpoint resumed at' .. layout)
  end)

  it('bad layouts exit 2 and say why', function()
    local function bad(np, extra, msg)
      local status, text = bin_train(('--nproc-per-node %d --device cpu %s --steps 1 %s --out %s/bad'):format(np,
        mixtral, extra, q(dir)))
      assert.are.equal(2, status, text)
      assert.is_truthy(text:find(msg, 1, true), text)
    end
    bad(4, '--pp 2 --tp 2 --ep 4', '--ep 4 with --pp 2: the 2 ranks of each stage (the world of 4 over 2 stages) are '
      .. 'not a multiple of 4')
    -- (HYBRID_SHARD: spec/train_pp_tp_hsdp_spec.lua; here a shard group larger than a slice's data-parallel ranks)
    bad(4, '--pp 2 --tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 2', '--pp 2 --tp 2 --fsdp HYBRID_SHARD: --shard-size 2 '
      .. 'does not divide the 1 data-parallel ranks of a stage\'s tensor-parallel slice')
  end)
end)
