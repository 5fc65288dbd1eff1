-- A resumed run keeps its checkpoint's parallel layout (bin/train --resume,
-- docs/checkpoints.md "Resume is bitwise"): a bare --resume of a --tp 2,
-- a --pp 2 and an --fsdp FULL_SHARD run at 2 ranks goes on as it ran,
-- bitwise the run that never stopped (metrics, final weights, the last
-- checkpoint's rank files); a layout given on the command line wins, axis
-- by axis (--tp 1: the checkpoint resharded), and the options that refine
-- an axis follow it; a world that cannot host the layout is a usage error
-- that names it and leaves the run folder as it was; in one process the
-- checkpoint resumes without its layout, saying so. A config file given
-- with the resume (--config) sits between the checkpoint's options and
-- the command line, its layout counting as given; another data-parallel
-- width keeps the checkpoint's tokens a step, the batch a rank derived
-- (bitwise the run given that batch), or a usage error naming them; a
-- HYBRID_SHARD --shard-size taken into a layout that counts it otherwise
-- (--tp --ep: whole ranks; --tp: a TP slice's data-parallel ranks) is
-- converted, or dropped to the default, saying so.
local train = require 'moonshard.train'

local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus_path = S.fixed_corpus(dir, 48000)
local tiny = S.tiny_flags(corpus_path, 2)

-- the options a run with `given` saved, as train.run writes them
local function saved(given)
  local o = train.defaults()
  for k, v in pairs(given) do o[k] = v end
  return o
end

describe('bin/train --resume and the parallel layout', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  it('takes each layout option from the checkpoint unless given, its refinements only with their axis', function()
    -- as it ran
    local kept, flags, left = train.resume_layout(saved { tp = 2, sequence_parallel = false }, {}, 2)
    assert.are.same({ 2, false, '--tp 2 --no-sequence-parallel', false },
      { kept.tp, kept.sequence_parallel, flags, left })
    -- another --tp given: the checkpoint's sequence parallelism stays behind
    kept, flags = train.resume_layout(saved { tp = 2, sequence_parallel = false }, { tp = 1 }, 2)
    assert.is_nil(kept.sequence_parallel)
    assert.are.equal('', flags)
    -- the same --tp given: it comes along
    kept = train.resume_layout(saved { tp = 2, sequence_parallel = false }, { tp = 2 }, 4)
    assert.is_false(kept.sequence_parallel)
    -- --pp 4 given: not the --pp 2 run's schedule, cut or micro-batches; its --fsdp kept
    kept, flags = train.resume_layout(saved { pp = 2, pp_layers = '1,1', pp_schedule = 'zbv', pp_microbatches = 4,
      fsdp = 'FULL_SHARD' }, { pp = 4 }, 4)
    assert.are.same({ 'FULL_SHARD', '--fsdp FULL_SHARD' }, { kept.fsdp, flags })
    assert.is_nil(kept.pp_layers); assert.is_nil(kept.pp_schedule); assert.is_nil(kept.pp_microbatches)
    -- another --fsdp given: not the HYBRID_SHARD run's --shard-size
    kept = train.resume_layout(saved { fsdp = 'HYBRID_SHARD', shard_size = 2 }, { fsdp = 'FULL_SHARD' }, 4)
    assert.is_nil(kept.shard_size)
    kept, flags = train.resume_layout(saved { fsdp = 'HYBRID_SHARD', shard_size = 2 }, {}, 4)
    assert.are.same({ 2, '--fsdp HYBRID_SHARD --shard-size 2' }, { kept.shard_size, flags })
    -- (a value given as a string, train.run's own callers: the same as the number)
    kept = train.resume_layout(saved { tp = 2, sequence_parallel = false }, { tp = '2' }, 2)
    assert.is_false(kept.sequence_parallel)
    -- in one process: without tp, pp, cp, ep and what refines them; --fsdp kept
    kept, flags, left = train.resume_layout(saved { tp = 2, pp = 2, pp_layers = '1,1', fsdp = 'FULL_SHARD' }, {}, 1)
    assert.are.same({ '--tp 2 --pp 2', true, 'FULL_SHARD' }, { flags, left, kept.fsdp })
    assert.is_nil(kept.tp); assert.is_nil(kept.pp); assert.is_nil(kept.pp_layers)
    -- a plain data-parallel run: no layout to name
    kept, flags = train.resume_layout(saved {}, {}, 3)
    assert.are.same({ 1, '' }, { kept.tp, flags })
  end)

  it('converts a HYBRID_SHARD --shard-size taken into a layout that counts it otherwise, or drops it, saying so',
    function()
    -- --tp 2 --ep 2: shard groups of 4 whole ranks; at --ep 1 the same 4
    -- ranks are 2 data-parallel ranks of each TP slice
    local kept, flags, _, notes = train.resume_layout(saved { tp = 2, ep = 2, fsdp = 'HYBRID_SHARD', shard_size = 4 },
      { ep = 1 }, 4)
    assert.are.same({ 2, '--tp 2 --fsdp HYBRID_SHARD --shard-size 2' }, { kept.shard_size, flags })
    assert.are.same({ 'resume: --shard-size 4 (whole ranks under the checkpoint\'s --tp 2 --ep 2) counts the '
      .. 'data-parallel ranks of a tensor-parallel slice at --tp 2: --shard-size 2, shard groups of 4 ranks as before' },
      notes)
    -- and back: --tp 2 --shard-size 1 (groups of 2 ranks) at --ep 2 counts whole ranks
    kept, _, _, notes = train.resume_layout(saved { tp = 2, fsdp = 'HYBRID_SHARD', shard_size = 1 }, { ep = 2 }, 4)
    assert.are.same({ 2, 1 }, { kept.shard_size, #notes })
    -- --pp given: a stage's TP slice's ranks; 2 ranks are no whole number of 4-rank TP groups: the default
    kept, flags, _, notes = train.resume_layout(saved { tp = 2, ep = 2, fsdp = 'HYBRID_SHARD', shard_size = 2 },
      { pp = 2, tp = 4 }, 8)
    assert.is_nil(kept.shard_size)
    assert.are.equal('--ep 2 --fsdp HYBRID_SHARD', flags)
    assert.are.same({ 'resume: --shard-size 2 (whole ranks under the checkpoint\'s --tp 2 --ep 2), shard groups of 2 '
      .. 'ranks, is no whole number of 4-rank tensor-parallel groups at --tp 4 --pp 2 --ep 2: the default shard size '
      .. '(give --shard-size to choose)' }, notes)
    -- the same convention: the number as it was, nothing said
    kept, _, _, notes = train.resume_layout(saved { tp = 2, ep = 2, fsdp = 'HYBRID_SHARD', shard_size = 4 },
      { ep = 4 }, 8)
    assert.are.same({ 4, 0 }, { kept.shard_size, #notes })
    kept, _, _, notes = train.resume_layout(saved { tp = 2, fsdp = 'HYBRID_SHARD', shard_size = 2 }, { tp = 1 }, 4)
    assert.are.same({ 2, 0 }, { kept.shard_size, #notes })
  end)

  it('another data-parallel width keeps the checkpoint\'s tokens a step: the batch a rank derived, or a usage error',
    function()
    local function batch(st, given, world)
      return train.resume_batch(st, (train.resume_layout(st.options, given, world)), given, world)
    end
    local function sizes(b, tps) return { b, tps } end   -- (the batch and tokens a step, not the line)
    -- a --tp 2 run of 4 x 64 tokens at 2 ranks (1 data-parallel rank) resumed at --tp 1: 2 a rank
    local tp2 = { options = saved { tp = 2, batch_size = 4, seq_len = 64 }, tokens_per_step = 256, world_size = 1 }
    local b, tps, line = batch(tp2, { tp = 1 }, 2)
    assert.are.same({ 2, 0 }, { b, tps })
    assert.are.equal('resume: --batch-size 2, 1 micro-batch a step, on 2 data-parallel ranks: derived to keep the '
      .. 'checkpoint\'s 256 tokens a step (it ran --batch-size 4; give --batch-size or --tokens-per-step to choose)',
      line)
    -- its layout kept, or the batch given: nothing derived
    assert.is_nil(batch(tp2, {}, 2))
    assert.is_nil(batch(tp2, { tp = 1, batch_size = 4 }, 2))
    assert.is_nil(batch(tp2, { tp = 1, tokens_per_step = 512 }, 2))
    -- a 2-rank run of 2 a rank at 1 rank: 2 micro-batches of 2; at 4: 1 a rank
    local dp2 = { options = saved { batch_size = 2, seq_len = 64 }, tokens_per_step = 256, world_size = 2 }
    assert.are.same({ 2, 256 }, sizes(batch(dp2, {}, 1)))
    assert.are.same({ 1, 0 }, sizes(batch(dp2, {}, 4)))
    -- a one-process checkpoint (no tokens_per_step written) at 2 ranks
    assert.are.same({ 2, 0 }, sizes(batch({ options = saved { batch_size = 4, seq_len = 64 } }, {}, 2)))
    -- accumulation: the batch kept while it divides, the micro-batches follow
    local acc = { options = saved { batch_size = 2, seq_len = 64, tokens_per_step = 512 }, tokens_per_step = 512,
      world_size = 1 }
    assert.is_nil(batch(acc, {}, 2))
    -- with --pp-microbatches kept: a multiple of it (4 sequences a rank: 4 = 2 x 2, not 3)
    local pp = { options = saved { pp = 2, pp_microbatches = 2, batch_size = 8, seq_len = 64 }, tokens_per_step = 512,
      world_size = 1 }
    assert.are.same({ 4, 0 }, sizes(batch(pp, {}, 4)))
    -- 4 sequences over 3 data-parallel ranks: a usage error naming them and the options
    local ok, e = pcall(batch, dp2, {}, 3)
    assert.is_false(ok)
    assert.is_true(train.is_usage_error(e), tostring(e))
    assert.are.equal('--resume: the checkpoint\'s 256 tokens a step (4 sequences of --seq-len 64) do not split over '
      .. 'the 3 data-parallel ranks of this layout (the world of 3 over --tp x --pp x --cp = 1); give --batch-size (with '
      .. '--tokens-per-step for the tokens a step), or a layout whose data-parallel ranks divide 4', tostring(e))
  end)

  it('a config file given with a resume says what it changes against the checkpoint, the command line over it',
    function()
    assert.are.equal('resume: --config c.lua changes against the checkpoint: --lr 0.001 (was 0.003), --tp 2 (was 1), '
      .. '--model.n_layer 3 (was 2)', train.config_changes('c.lua', saved { lr = 3e-3, steps = 6,
      model_config = { n_layer = 2 } }, { lr = 1e-3, steps = 6, tp = 2, batch_size = 8, model_config = { n_layer = 3 } },
      { batch_size = 2 }))
    assert.are.equal('resume: --config c.lua changes no option against the checkpoint',
      train.config_changes('c.lua', saved { steps = 6 }, { steps = 6, stop_at = 2 }, {}))
  end)

  it('a world that cannot host the checkpoint\'s layout is a usage error naming it, the world and the flags', function()
    local function err(...)
      local ok, e = pcall(train.resume_layout, ...)
      assert.is_false(ok)
      assert.is_true(train.is_usage_error(e), tostring(e))
      return tostring(e)
    end
    assert.are.equal('--resume: the checkpoint\'s layout --tp 2 --pp 2 needs a multiple of 4 ranks and this run has 2; '
      .. 'launch it on 4 (bin/train --nproc-per-node 4) to go on as it ran, or give the layout to resume it in (e.g. '
      .. '--tp 1 --pp 1: the checkpoint is resharded)', err(saved { tp = 2, pp = 2 }, {}, 2))
    -- a part given: the rest named, with what was given
    assert.are.equal('--resume: the checkpoint\'s layout --pp 2 with --tp 2 given needs a multiple of 4 ranks and this '
      .. 'run has 6; launch it on 4 (bin/train --nproc-per-node 4) to go on as it ran, or give the layout to resume it '
      .. 'in (e.g. --pp 1: the checkpoint is resharded)', err(saved { pp = 2 }, { tp = 2 }, 6))
    -- the expert groups in each stage's ranks: --pp 2 --cp 2 --ep 4 needs 8 ranks, --tp 2 --ep 4 4
    assert.is_truthy(err(saved { pp = 2, ep = 4, cp = 2 }, {}, 4):find('needs a multiple of 8 ranks', 1, true))
    assert.has_no.errors(function() train.resume_layout(saved { tp = 2, ep = 4 }, {}, 8) end)
    assert.is_truthy(err(saved { tp = 2, ep = 4 }, {}, 6):find('--tp 2 --ep 4 needs a multiple of 4', 1, true))
    -- the layout given whole: the layout's own checks (not this one) say what is wrong
    assert.has_no.errors(function() train.resume_layout(saved { tp = 2, pp = 2 }, { tp = 1, pp = 1 }, 3) end)
  end)

  -- 6 steps straight, and stopped at 3 then resumed with a bare --resume:
  -- the same bits (metrics, final weights, ckpt-6's rank files)
  local common = ('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 6 --log-every 1 '
    .. '--save-every 3 --keep-checkpoints 0'):format(tiny)
  for _, c in ipairs({ { 'tp', '--tp 2', 'tensor parallel: 2-way over 2 ranks' },
                       { 'pp', '--pp 2 --pp-schedule gpipe --pp-microbatches 2', 'pipeline parallel: 2 stages over 2 ranks' },
                       { 'fsdp', '--fsdp FULL_SHARD --batch-size 2', 'fsdp: FULL_SHARD over 2 ranks' } }) do
    it('a bare --resume of a ' .. c[2] .. ' run at 2 ranks goes on in its layout, bitwise the straight run', function()
      local a, b = ('%s/%s-straight'):format(dir, c[1]), ('%s/%s-stopped'):format(dir, c[1])
      local status, text = bin_train(('%s %s --out %s'):format(common, c[2], q(a)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find(c[3], 1, true), text)
      status, text = bin_train(('%s %s --stop-at 3 --out %s'):format(common, c[2], q(b)))
      assert.are.equal(0, status, text)
      os.execute(('cp -r %s %s-kept'):format(q(b), q(b)))   -- (the reshard and error cases below)
      status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s'):format(q(b)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('resumed from ' .. b .. '/ckpt-3 at step 3', 1, true), text)
      assert.is_truthy(text:find(c[3], 1, true), text)
      local layout = c[2]:gsub(' %-%-batch%-size %d+', '')
      assert.is_truthy(text:find('[rank 0] resume: the checkpoint\'s layout ' .. layout .. ' (give --tp, --pp, --cp, '
        .. '--ep, --fsdp to change it)', 1, true), text)
      S.same_metrics(a, b, 6, c[2])
      S.same_files(a, b, { 'model.safetensors' })
      S.same_files(a .. '/ckpt-6', b .. '/ckpt-6', { 'rank-00000-of-00002.safetensors', 'rank-00001-of-00002.safetensors' })
    end)
  end

  it('--tp 1 given on a resume of a --tp 2 checkpoint reshards it into data parallelism, on the straight curve',
    function()
    local kept = dir .. '/tp-stopped-kept'
    assert.is_truthy(io.open(kept .. '/ckpt-3/index.json'), 'the --tp 2 case above ran')
    local r = dir .. '/tp-resharded'
    os.execute(('cp -r %s %s'):format(q(kept), q(r)))
    local status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s --tp 1 --batch-size 2'):format(q(r)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('resumed from ' .. r .. '/ckpt-3 at step 3', 1, true), text)
    assert.is_falsy(text:find('tensor parallel:', 1, true), text)
    assert.is_falsy(text:find('the checkpoint\'s layout', 1, true), text)
    assert.is_falsy(text:find('derived', 1, true), text)
    close_losses(losses(dir .. '/tp-straight'), losses(r), 1, 6, 'a --tp 2 checkpoint resumed at --tp 1 on 2 ranks')
    -- without --batch-size: the checkpoint's 4 x 16 tokens a step over 2
    -- data-parallel ranks, 2 a rank, bitwise the run given it
    local d = dir .. '/tp-derived'
    os.execute(('cp -r %s %s'):format(q(kept), q(d)))
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s --tp 1'):format(q(d)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('[rank 0] resume: --batch-size 2, 1 micro-batch a step, on 2 data-parallel ranks: derived '
      .. 'to keep the checkpoint\'s 64 tokens a step (it ran --batch-size 4; give --batch-size or --tokens-per-step to '
      .. 'choose)', 1, true), text)
    S.same_metrics(r, d, 6, 'derived --batch-size 2 against the given one')
  end)

  it('--config on a resume: its options over the checkpoint\'s (its --tp 1 a layout given), the command line over '
    .. 'them, bitwise the same options given as flags', function()
    local kept = dir .. '/tp-stopped-kept'
    assert.is_truthy(io.open(kept .. '/ckpt-3/index.json'), 'the --tp 2 case above ran')
    local cfg = dir .. '/resume-config.lua'
    local f = assert(io.open(cfg, 'w'))
    f:write('return { tp = 1, lr = 5e-3, steps = 5, log_every = 1 }\n')
    f:close()
    local a, b = dir .. '/tp-config', dir .. '/tp-flags'
    os.execute(('cp -r %s %s && cp -r %s %s'):format(q(kept), q(a), q(kept), q(b)))
    local status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s --config %s --steps 6'):format(q(a),
      q(cfg)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('[rank 0] resume: --config ' .. cfg .. ' changes against the checkpoint: --lr 0.005 (was '
      .. '0.01), --tp 1 (was 2)', 1, true), text)
    assert.is_falsy(text:find('tensor parallel:', 1, true), text)
    assert.is_truthy(text:find('derived to keep the checkpoint\'s 64 tokens a step', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s --tp 1 --lr 5e-3 --steps 6'):format(q(b)))
    assert.are.equal(0, status, text)
    S.same_metrics(b, a, 6, '--config against the same flags')
    -- (the config's lr took: not the straight run's from step 4)
    assert.are_not.equal(losses(dir .. '/tp-straight')[5], losses(a)[5])
    local run = S.slurp(a .. '/run.json')
    assert.is_truthy(run:find('"config":"' .. cfg .. '"', 1, true), run)
  end)

  it('a --tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 4 checkpoint resumed at --ep 1 (4 ranks) shards over the same '
    .. '4 ranks, --shard-size 2 of a TP slice, on the straight curve', function()
    local mixtral = S.tiny_moe_flags(corpus_path, 1) .. ' --model.output_router_logits false'
    local run = ('--nproc-per-node 4 --device cpu %s --batch-size 2 --steps 4 --save-every 2 --keep-checkpoints 0 '
      .. '--tp 2 --ep 2 --fsdp HYBRID_SHARD --shard-size 4'):format(mixtral)
    local a, b = dir .. '/hs-straight', dir .. '/hs-stopped'
    local status, text = bin_train(('%s --out %s'):format(run, q(a)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('%s --stop-at 2 --out %s'):format(run, q(b)))
    assert.are.equal(0, status, text)
    -- (before: --shard-size 4 taken as 4 of the 2 data-parallel ranks of a TP slice, exit 2)
    status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s --ep 1'):format(q(b)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('[rank 0] resume: --shard-size 4 (whole ranks under the checkpoint\'s --tp 2 --ep 2) '
      .. 'counts the data-parallel ranks of a tensor-parallel slice at --tp 2: --shard-size 2, shard groups of 4 ranks '
      .. 'as before', 1, true), text)
    assert.is_truthy(text:find('the checkpoint\'s layout --tp 2 --fsdp HYBRID_SHARD --shard-size 2', 1, true), text)
    assert.is_falsy(text:find('expert parallel:', 1, true), text)
    assert.is_falsy(text:find('derived', 1, true), text)
    close_losses(losses(a), losses(b), 1, 4, 'a --tp 2 --ep 2 HYBRID_SHARD checkpoint resumed at --ep 1')
  end)

  it('on 3 ranks a --tp 2 checkpoint is a usage error naming its layout; the run folder stays as it was', function()
    local kept = dir .. '/tp-stopped-kept'
    local r = dir .. '/tp-three'
    os.execute(('cp -r %s %s'):format(q(kept), q(r)))
    local before = S.slurp(r .. '/metrics.jsonl')
    local status, text = bin_train(('--nproc-per-node 3 --device cpu --resume %s'):format(q(r)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--resume: the checkpoint\'s layout --tp 2 needs a multiple of 2 ranks and this run has '
      .. '3; launch it on 2 (bin/train --nproc-per-node 2) to go on as it ran, or give the layout to resume it in (e.g. '
      .. '--tp 1: the checkpoint is resharded)', 1, true), text)
    assert.are.equal(before, S.slurp(r .. '/metrics.jsonl'))
    local p = io.popen('ls ' .. q(r))
    local names = p:read('*a')
    p:close()
    assert.are.equal('ckpt-3\nmetrics.jsonl\n', names:gsub('run%.json\n', ''))
  end)

  it('in one process a --tp 2 checkpoint resumes without its layout, saying so, on the straight curve', function()
    local r = dir .. '/tp-one'
    os.execute(('cp -r %s %s'):format(q(dir .. '/tp-stopped-kept'), q(r)))
    local status, text = bin_train(('--resume %s'):format(q(r)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('resume: in one process, without the checkpoint\'s --tp 2 (launch it on several ranks, '
      .. 'bin/train --nproc-per-node N, to keep it)', 1, true), text)
    close_losses(losses(dir .. '/tp-straight'), losses(r), 1, 6, 'a --tp 2 checkpoint resumed in one process')
  end)
end)
