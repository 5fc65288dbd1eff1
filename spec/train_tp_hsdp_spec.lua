-- HYBRID_SHARD with tensor parallelism, no pipeline (bin/train --tp T --fsdp
-- HYBRID_SHARD --shard-size S; docs/tp.md, "Hybrid sharding"): CPU ranks
-- through mpirun, against one process over the same global batches. The
-- ranks that hold the same TP slice (rank j * T + t for the world / T
-- values of j) are the slice's data-parallel axis, cut into shard groups of
-- S consecutive j (FULL_SHARD inside, replicated across: torchtitan's
-- dp_replicate x dp_shard x tp). At --tp 2 on 8 ranks (4 data-parallel
-- ranks a slice: S = 2, two shard groups of 2, both reductions; S = 1, four
-- replicas; the default, one node's 8 ranks / 2 = 4, one shard group), GPT-2
-- (its tied head) and Llama, with and without sequence parallelism, with
-- --cp 2 (the shard groups of a slice's data- and context-parallel ranks)
-- and gradient accumulation: the loss curve and the gradient norm within
-- 1e-5 (a wrong reduction scale moves the norm, which AdamW's losses would
-- hide) and the final weights whole; the sharded checkpoint resumes at the
-- same layout, in one process, at --tp 2 --fsdp FULL_SHARD and at --tp 2
-- plain, and a one-process checkpoint resumes at the hybrid layout; bad
-- sizes exit 2 naming them.
require 'moonshard'
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()

local corpus = S.fixed_corpus(dir, 48000)
local tiny, tiny_llama = S.tiny_flags(corpus, 3)

describe('bin/train --tp 2 --fsdp HYBRID_SHARD (CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- the one-process runs: 4 steps of 4 sequences, checkpoints every 2
  local reference = S.references(dir)   -- (model, args, name) -> its losses
  -- follows(np, args, ref, name, what, lines): a run of `np` ranks against
  -- reference `ref` (curve, gradient norm, final weights; S.follows)
  local follows = S.follows(dir, reference)
  local gpt2, llama = { 'models/gpt2.lua ' .. tiny, 'g1' }, { 'models/llama.lua ' .. tiny_llama, 'l1' }

  it('8 ranks, --shard-size 2 (two shard groups of 2 a slice, replicated over 2), sequence parallel and not, follow '
    .. 'the one-process curve, gradient norm and weights (gpt2, llama)', function()
    for _, m in ipairs({ gpt2, llama }) do
      follows(8, m[1] .. ' --batch-size 1 --tp 2 --fsdp HYBRID_SHARD --shard-size 2 --sequence-parallel', m,
        m[2] .. 's2', m[2] .. ' 8 ranks --shard-size 2', {
          'fsdp: HYBRID_SHARD over 4 ranks (shard groups of 2, replicated over 2)',
          'tensor parallel: 2-way over 8 ranks, data parallel 4 (HYBRID_SHARD), sequence parallel' })
      follows(8, m[1] .. ' --batch-size 1 --tp 2 --fsdp HYBRID_SHARD --shard-size 2 --no-sequence-parallel', m,
        m[2] .. 'n2', m[2] .. ' 8 ranks --shard-size 2, no sequence parallel', {
          'fsdp: HYBRID_SHARD over 4 ranks (shard groups of 2, replicated over 2)',
          'data parallel 4 (HYBRID_SHARD), no sequence parallel' })
    end
  end)

  it('--shard-size 1 (four replicas of each slice), the default (a node\'s 8 ranks / 2: one shard group), --cp 2 '
    .. '(shard groups of a slice\'s data- and context-parallel ranks) and gradient accumulation: the one-process '
    .. 'curve (llama)', function()
    follows(8, llama[1] .. ' --batch-size 1 --tp 2 --fsdp HYBRID_SHARD --shard-size 1', llama, 'ls1',
      '--shard-size 1', { 'fsdp: HYBRID_SHARD over 4 ranks (shard groups of 1, replicated over 4)' })
    follows(8, llama[1] .. ' --batch-size 1 --tp 2 --fsdp HYBRID_SHARD', llama, 'ldef', 'the default --shard-size',
      { 'fsdp: HYBRID_SHARD over 4 ranks (shard groups of 4, replicated over 1)' })
    follows(8, llama[1] .. ' --batch-size 2 --tp 2 --cp 2 --fsdp HYBRID_SHARD --shard-size 2', llama, 'lcp', '--cp 2',
      { 'fsdp: HYBRID_SHARD over 4 ranks (shard groups of 2, replicated over 2)', 'context parallel: 2-way' })
    follows(8, llama[1] .. ' --batch-size 1 --tokens-per-step 64 --tp 2 --cp 2 --fsdp HYBRID_SHARD --shard-size 1',
      llama, 'lacc', 'accumulation', { '4 steps x 64 tokens (2 data-parallel groups x 1 x 16 x 2 micro-batches)',
        'shard groups of 1, replicated over 4' })
  end)

  it('its checkpoint is sharded: it resumes at the same layout, in one process, at --tp 2 --fsdp FULL_SHARD and at '
    .. '--tp 2; a one-process checkpoint resumes at the hybrid layout', function()
    local one = reference(gpt2[1], '', gpt2[2])
    local out = dir .. '/hck'
    local n = S.hybrid_stop(8, gpt2[1] .. ' --tp 2 --fsdp HYBRID_SHARD --shard-size 2', out)
    -- each piece once: the first replica's shard groups (ranks 0-3: j = 0,
    -- 1 of both slices) hold every piece, the other replica's none
    for r = 0, 7 do assert.are.equal(r < 4, (n[r] or 0) > 0, 'rank ' .. r .. ' writes pieces') end
    S.resumes_at(one, out, {
      { '--nproc-per-node 8 --device cpu ', ' --tp 2', 'the same layout' },
      { '', ' --fsdp off', 'one process' },
      { '--nproc-per-node 4 --device cpu ', ' --tp 2 --fsdp FULL_SHARD --batch-size 2', '--tp 2 --fsdp FULL_SHARD' },
      { '--nproc-per-node 2 --device cpu ', ' --tp 2 --fsdp off --batch-size 4', '--tp 2' } },
      'the hybrid checkpoint resumed at ', true)
    -- the one-process run's checkpoint, at the hybrid layout
    S.one_process_ckpt_at(dir, 'g1', 8, '--tp 2 --fsdp HYBRID_SHARD --shard-size 2',
      'shard groups of 2, replicated over 2', one, 'a one-process checkpoint resumed at --tp 2 --fsdp HYBRID_SHARD')
  end)

  it('bad sizes exit 2 and name them', function()
    local function bad(np, args, msg) S.exits_2(np, args, dir .. '/bad', msg) end
    bad(8, llama[1] .. ' --tp 2 --fsdp HYBRID_SHARD --shard-size 3',
      '--tp 2 --fsdp HYBRID_SHARD: --shard-size 3 does not divide the 4 data-parallel ranks of a tensor-parallel slice '
        .. '(the world of 8 over 2 TP ranks; --shard-size counts those ranks: 1, or a divisor of 4)')
    -- (whole ranks, as --tp --ep counts them, are too many here)
    bad(8, llama[1] .. ' --tp 2 --fsdp HYBRID_SHARD --shard-size 8',
      '--shard-size 8 does not divide the 4 data-parallel ranks of a tensor-parallel slice')
    bad(8, llama[1] .. ' --batch-size 2 --tp 2 --cp 2 --fsdp HYBRID_SHARD --shard-size 3',
      '--tp 2 --fsdp HYBRID_SHARD: --shard-size 3 does not divide the 4 data- and context-parallel ranks of a '
        .. 'tensor-parallel slice')
    bad(6, llama[1] .. ' --tp 4 --fsdp HYBRID_SHARD', '--tp 4: the world of 6 ranks is not a multiple of it')
  end)
end)
