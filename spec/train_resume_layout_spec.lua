-- A resumed run keeps its checkpoint's parallel layout (bin/train --resume,
-- docs/checkpoints.md "Resume is bitwise"): a bare --resume of a --tp 2,
-- a --pp 2 and an --fsdp FULL_SHARD run at 2 ranks goes on as it ran,
-- bitwise the run that never stopped (metrics, final weights, the last
-- checkpoint's rank files); a layout given on the command line wins, axis
-- by axis (--tp 1: the checkpoint resharded), and the options that refine
-- an axis follow it; a world that cannot host the layout is a usage error
-- that names it and leaves the run folder as it was; in one process the
-- checkpoint resumes without its layout, saying so.
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
    close_losses(losses(dir .. '/tp-straight'), losses(r), 1, 6, 'a --tp 2 checkpoint resumed at --tp 1 on 2 ranks')
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
