-- HYBRID_SHARD with pipeline and tensor parallelism (bin/train --pp P --tp T
-- --fsdp HYBRID_SHARD --shard-size S, with and without --ep; docs/pp.md,
-- "Hybrid sharding with tensor parallelism"): CPU ranks through mpirun,
-- against one process over the same global batches. In each stage the
-- ranks that hold the same TP slice are the data-parallel axis, cut into
-- shard groups of S of them (FULL_SHARD inside, replicated across:
-- torchtitan's dp_replicate x dp_shard x pp x tp). At --pp 2 --tp 2 on 8
-- ranks (2 data-parallel ranks a slice: S = 2, one shard group; S = 1, two
-- replicas) and on 16 (4 a slice: S = 2, two shard groups of 2, both
-- reductions), GPT-2 (its tied head) and Llama, with sequence parallelism,
-- gradient accumulation and --cp 2: the loss curve and the gradient norm
-- within 1e-5 (a wrong reduction scale moves the norm, which AdamW's
-- losses would hide) and the final weights whole; the sharded checkpoint
-- resumes at the same layout, in one process, at --pp 2 --tp 2 --fsdp
-- FULL_SHARD and at --tp 2, and a one-process checkpoint resumes at the
-- hybrid layout. With --ep (expert groups of whole TP groups inside the
-- shard groups) a tiny Mixtral and DeepSeek-V3 the same (Mixtral with
-- --cp 2 too), and a resume; bad
-- sizes exit 2 naming them.
require 'moonshard'
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train = S.bin_train

local corpus = S.fixed_corpus(dir, 48000)
local tiny, tiny_llama = S.tiny_flags(corpus, 3)
local mixtral, deepseek = S.tiny_moe_flags(corpus, 1, ' --model.output_router_logits false')

describe('bin/train --pp 2 --tp 2 --fsdp HYBRID_SHARD (CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- the one-process runs: 4 steps of 4 sequences, checkpoints every 2
  local reference = S.references(dir)   -- (model, args, name) -> its losses
  -- follows(np, args, ref, name, what, lines): a run of `np` ranks against
  -- reference `ref` (curve, gradient norm, final weights; S.follows)
  local follows = S.follows(dir, reference)
  local gpt2, llama = { 'models/gpt2.lua ' .. tiny, 'g1' }, { 'models/llama.lua ' .. tiny_llama, 'l1' }

  it('8 ranks (--shard-size 2: one shard group a slice; 1: two replicas) and 16 ranks (two shard groups of 2, '
    .. 'replicated) follow the one-process curve, gradient norm and weights (gpt2, llama)', function()
    for _, m in ipairs({ gpt2, llama }) do
      follows(8, m[1] .. ' --batch-size 2 --pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 2', m, m[2] .. 's2',
        m[2] .. ' 8 ranks --shard-size 2', { 'fsdp: HYBRID_SHARD over 2 ranks (shard groups of 2, replicated over 1)',
          'tensor parallel: 2-way over 8 ranks, data parallel 2 (HYBRID_SHARD)',
          'pipeline parallel: 2 stages over 8 ranks' })
      follows(8, m[1] .. ' --batch-size 2 --pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 1', m, m[2] .. 's1',
        m[2] .. ' 8 ranks --shard-size 1', { 'fsdp: HYBRID_SHARD over 2 ranks (shard groups of 1, replicated over 2)' })
      follows(16, m[1] .. ' --batch-size 1 --pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 2', m, m[2] .. 'h16',
        m[2] .. ' 16 ranks --shard-size 2', { 'fsdp: HYBRID_SHARD over 4 ranks (shard groups of 2, replicated over 2)',
          'tensor parallel: 2-way over 16 ranks, data parallel 4 (HYBRID_SHARD)' })
    end
  end)

  it('with sequence parallelism, with gradient accumulation (the replicas all-reduced once a step) and with --cp 2 '
    .. '(the shard groups of a slice\'s data- and context-parallel ranks) on 16 ranks: the one-process curve', function()
    follows(16, llama[1] .. ' --batch-size 1 --pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 2 --sequence-parallel',
      llama, 'lsp', 'sequence parallel', { 'data parallel 4 (HYBRID_SHARD), sequence parallel' })
    follows(8, gpt2[1] .. ' --batch-size 1 --tokens-per-step 64 --pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 1',
      gpt2, 'gacc', 'accumulation', { '4 steps x 64 tokens (2 data-parallel groups x 1 x 16 x 2 micro-batches)' })
    follows(16, llama[1] .. ' --batch-size 2 --pp 2 --tp 2 --cp 2 --fsdp HYBRID_SHARD --shard-size 2', llama, 'lcp',
      '--cp 2', { 'fsdp: HYBRID_SHARD over 4 ranks (shard groups of 2, replicated over 2)',
        'context parallel: 2-way' })
  end)

  it('its checkpoint is sharded: it resumes at the same layout, in one process, at --pp 2 --tp 2 --fsdp FULL_SHARD '
    .. 'and at --tp 2; a one-process checkpoint resumes at the hybrid layout', function()
    local one = reference(llama[1], '', llama[2])
    local out = dir .. '/hck'
    local n = S.hybrid_stop(16, llama[1] .. ' --pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 2', out)
    -- each piece once: the first replica's ranks hold every piece, the
    -- other replica's none
    local writers = 0
    for r = 0, 15 do if (n[r] or 0) > 0 then writers = writers + 1 end end
    assert.are.equal(8, writers)
    S.resumes_at(one, out, {
      { '--nproc-per-node 16 --device cpu ', ' --pp 2 --tp 2', 'the same layout' },
      { '', ' --fsdp off', 'one process' },
      { '--nproc-per-node 8 --device cpu ', ' --pp 2 --tp 2 --fsdp FULL_SHARD', '--pp 2 --tp 2 --fsdp FULL_SHARD' },
      { '--nproc-per-node 2 --device cpu ', ' --pp 1 --tp 2 --fsdp off --batch-size 4', '--tp 2' } },
      'the hybrid checkpoint resumed at ', true)
    -- the one-process run's checkpoint, at the hybrid layout
    S.one_process_ckpt_at(dir, 'l1', 16, '--pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 2',
      'shard groups of 2, replicated over 2', one,
      'a one-process checkpoint resumed at --pp 2 --tp 2 --fsdp HYBRID_SHARD')
  end)

  it('with --ep (whole TP groups a expert group, inside the shard groups): mixtral and deepseek-v3 follow the '
    .. 'one-process curve, gradient norm and weights on 8 and 16 ranks; a checkpoint resumes in one process and at '
    .. '--pp 2 --tp 2 --ep 2 --fsdp SHARD_GRAD_OP', function()
    local m, d = { mixtral, 'm1' }, { deepseek, 'd1' }
    follows(8, mixtral .. ' --batch-size 2 --pp 2 --tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 2', m, 'me8',
      'mixtral 8 ranks --ep 2', { 'the experts sharded over their 2 copies in each shard group of 4 ranks (2 of each TP '
        .. 'slice), replicated over 1 (HYBRID_SHARD)' })
    follows(16, mixtral .. ' --batch-size 1 --pp 2 --tp 2 --ep 4 --fsdp HYBRID_SHARD --shard-size 2', m, 'me16',
      'mixtral 16 ranks --ep 4', { 'each expert whole in each shard group of 4 ranks (2 of each TP slice), replicated '
        .. 'over 2 (HYBRID_SHARD)', 'fsdp: HYBRID_SHARD over 4 ranks (shard groups of 2, replicated over 2)' })
    follows(16, mixtral .. ' --batch-size 1 --pp 2 --tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 4', m, 'me16b',
      'mixtral 16 ranks --ep 2 --shard-size 4', { 'the experts sharded over their 4 copies in each shard group of 8 '
        .. 'ranks (4 of each TP slice), replicated over 1 (HYBRID_SHARD)' })
    follows(16, deepseek .. ' --batch-size 1 --pp 2 --tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 2', d, 'de16',
      'deepseek-v3 16 ranks --ep 2')
    -- with --cp 2 too: a shard group's ranks a slice's (d, c) pairs' TP groups
    follows(16, mixtral .. ' --batch-size 2 --pp 2 --tp 2 --cp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 2', m, 'mecp',
      'mixtral 16 ranks --cp 2 --ep 2', { 'the experts sharded over their 2 copies in each shard group of 4 ranks (2 of '
        .. 'each TP slice), replicated over 2 (HYBRID_SHARD)', 'context parallel: 2-way' })
    -- a checkpoint
    local one = reference(mixtral, '', 'm1')
    local out = dir .. '/meck'
    local status, text = bin_train(('--nproc-per-node 16 --device cpu %s --batch-size 1 --steps 4 --pp 2 --tp 2 --ep 2 '
      .. '--fsdp HYBRID_SHARD --shard-size 2 --save-every 1 --stop-at 2 --out %s'):format(mixtral, q(out)))
    assert.are.equal(0, status, text)
    S.resumes_at(one, out, { { '', ' --fsdp off', 'one process' },
      { '--nproc-per-node 4 --device cpu ', ' --pp 2 --tp 2 --ep 2 --fsdp SHARD_GRAD_OP --batch-size 4',
        '--pp 2 --tp 2 --ep 2 --fsdp SHARD_GRAD_OP' } }, 'the --ep hybrid checkpoint resumed at ')
  end)

  it('bad sizes exit 2 and name them', function()
    local function bad(np, args, msg) S.exits_2(np, args, dir .. '/bad', msg) end
    bad(8, 'models/llama.lua ' .. tiny_llama .. ' --pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 4',
      '--pp 2 --tp 2 --fsdp HYBRID_SHARD: --shard-size 4 does not divide the 2 data-parallel ranks of a stage\'s '
        .. 'tensor-parallel slice (the world of 8 over 2 stages x 2 TP ranks')
    bad(16, 'models/llama.lua ' .. tiny_llama .. ' --pp 2 --tp 2 --fsdp HYBRID_SHARD --shard-size 3',
      '--shard-size 3 does not divide the 4 data-parallel ranks')
    bad(8, mixtral .. ' --pp 2 --tp 2 --ep 4 --fsdp HYBRID_SHARD --shard-size 1',
      '--ep 4 with --pp 2 --tp 2 --fsdp HYBRID_SHARD: a shard group (--shard-size 1 data-parallel rank of a stage\'s '
        .. 'TP slice, with its TP groups 2 ranks) must hold whole expert groups of 4 ranks: --shard-size a multiple of 2')
  end)
end)
