-- Context parallelism in the built-in loop (bin/train --cp N, docs/cp.md):
-- CPU ranks through mpirun. Checked against one process over the same
-- global batches: the loss curve (within 1e-5 relative) with --cp 2 on 2
-- ranks (GPT-2 and Llama, plain data parallel and --fsdp), --cp 2 x data
-- parallel 2 on 4 ranks with accumulation and validation, --cp 2 --tp 2
-- on 4 ranks (plain and --fsdp), --cp 2 --pp 2 on 4 ranks (GPT-2 and
-- Llama, plain and --fsdp), --cp 2 --pp 2 --tp 2 on 8 ranks (4-D; GPT-2
-- and Llama, Llama with --fsdp too, resumed in one process; 16 ranks with
-- data parallel 2 and --fsdp); a --cp run's
-- checkpoint resumes in one process on the curve; the final weights are
-- the whole model's; bad layouts exit 2 with a message.
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus_path = S.fixed_corpus(dir, 48000)

local tiny, tiny_llama = S.tiny_flags(corpus_path, 2)

describe('bin/train --cp (context parallelism, CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  local reference = S.references(dir)

  -- c = { model file, its flags, reference name } on n ranks with `flags`:
  -- exit 0, every line of `lines` in the output, the one-process curve
  local function follows_one(n, c, flags, out, lines)
    local status, text = bin_train(('--nproc-per-node %d --device cpu %s %s --batch-size 4 --steps 4 %s --out %s'):format(
      n, c[1], c[2], flags, q(out)))
    assert.are.equal(0, status, text)
    for _, l in ipairs(lines) do assert.is_truthy(text:find(l, 1, true), text) end
    close_losses(reference(c[1], c[2], c[3] .. '1'), losses(out), 1, 4, c[1] .. ' ' .. flags)
  end

  -- GPT-2 on n ranks with the given flags, stopped at step 2 with a
  -- checkpoint, then resumed in one process: the one-process curve
  local function stopped_and_resumed_in_one(n, flags, out, what)
    local status, text = bin_train(('--nproc-per-node %d --device cpu models/gpt2.lua %s --batch-size 4 --steps 4 %s '
      .. '--stop-at 2 --out %s'):format(n, tiny, flags, q(out)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('models/gpt2.lua --resume %s --steps 4'):format(q(out)))
    assert.are.equal(0, status, text)
    close_losses(reference('models/gpt2.lua', tiny, 'g1'), losses(out), 1, 4, what)
  end

  it('--cp 2 on 2 ranks follows the one-process loss curve (gpt2, llama; data parallel and --fsdp)', function()
    for _, c in ipairs({ { 'models/gpt2.lua', tiny, 'g' }, { 'models/llama.lua', tiny_llama, 'l' } }) do
      local one = reference(c[1], c[2], c[3] .. '1')
      for _, fs in ipairs({ '', '--fsdp FULL_SHARD' }) do
        local out = ('%s/%s2%s'):format(dir, c[3], fs == '' and 'dp' or 'fs')
        local status, text = bin_train(('--nproc-per-node 2 --device cpu %s %s --batch-size 4 --steps 4 --cp 2 %s '
          .. '--out %s'):format(c[1], c[2], fs, q(out)))
        assert.are.equal(0, status, text)
        close_losses(one, losses(out), 1, 4, c[1] .. ' --cp 2 ' .. fs)
        assert.is_truthy(text:find('[rank 0] context parallel: 2-way (ring attention, load-balanced chunks of 4 tokens), '
          .. 'data parallel 1, 8 tokens a rank of each sequence', 1, true), text)
        assert.is_truthy(text:find('4 steps x 64 tokens (1 data-parallel group x 4 x 16 x 1 micro-batches)', 1, true), text)
      end
    end
  end)

  it('--cp 2 on 4 ranks (data parallel 2) with accumulation and validation follows the one-process curve', function()
    -- one process reads the 2 data-parallel groups' rows as one batch of 2
    local status, text = bin_train(('models/llama.lua %s --batch-size 2 --tokens-per-step 64 --steps 4 --eval-every 2 '
      .. '--out %s/lv1'):format(tiny_llama, q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--nproc-per-node 4 --device cpu models/llama.lua %s --batch-size 1 '
      .. '--tokens-per-step 64 --steps 4 --cp 2 --eval-every 2 --out %s/l4'):format(tiny_llama, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('4 steps x 64 tokens (2 data-parallel groups x 1 x 16 x 2 micro-batches)', 1, true), text)
    close_losses(losses(dir .. '/lv1'), losses(dir .. '/l4'), 1, 4, '--cp 2 x dp 2 with accumulation')
    local function val(run)
      local f = io.open(dir .. '/' .. run .. '/metrics.jsonl')
      local v = f:read('*a'):match('"val_loss":([%d%.e%-]+)')
      f:close()
      return tonumber(v)
    end
    local v1, v4 = val('lv1'), val('l4')
    assert.is_not_nil(v1)
    assert.is_true(math.abs(v4 - v1) <= 1e-5 * v1, v4 .. ' vs ' .. v1)
  end)

  it('a --cp 2 checkpoint resumes in one process on the curve; the final weights are the whole model', function()
    local out = dir .. '/gr'
    stopped_and_resumed_in_one(2, '--cp 2', out, '--cp 2 resumed in one process')
    -- the saved folder is the whole model: its validation loss in this process is the one-process run's
    local train, data, gpt2 = require 'moonshard.train', require 'moonshard.data', require 'models.gpt2'
    local corpus = data.corpus { path = corpus_path, val_fraction = 0.1, min_len = 17 }
    local function val(m)
      return train.evaluate(m, data.Loader(corpus.val, { batch_size = 4, seq_len = 16, seed = 1337 + 1 }), 2)
    end
    local v, v1 = val(gpt2.from_pretrained(out)), val(gpt2.from_pretrained(dir .. '/g1'))
    assert.is_true(math.abs(v - v1) <= 1e-5 * v1, ('the --cp weights give val %.17g, one process\'s %.17g'):format(v, v1))
  end)

  it('--cp 2 --tp 2 on 4 ranks (TP pairs inside the context-parallel groups) follows the one-process curve, with --fsdp too',
    function()
    for _, fs in ipairs({ '', '--fsdp FULL_SHARD' }) do
      follows_one(4, { 'models/llama.lua', tiny_llama, 'l' }, '--cp 2 --tp 2 ' .. fs,
        ('%s/lct%s'):format(dir, fs == '' and 'dp' or 'fs'),
        { '[rank 0] context parallel: 2-way', '[rank 0] tensor parallel: 2-way over 4 ranks' })
    end
  end)

  it('--cp 2 --pp 2 on 4 ranks (pipelines inside the context-parallel groups) follows the one-process curve, with --fsdp too',
    function()
    for _, c in ipairs({ { 'models/gpt2.lua', tiny, 'g' }, { 'models/llama.lua', tiny_llama, 'l' } }) do
      for _, fs in ipairs({ '', '--fsdp FULL_SHARD' }) do
        follows_one(4, c, '--cp 2 --pp 2 ' .. fs, ('%s/%scp%s'):format(dir, c[3], fs == '' and 'dp' or 'fs'),
          { '[rank 0] context parallel: 2-way', '[rank 0] pipeline parallel: 2 stages over 4 ranks' })
      end
    end
  end)

  it('--cp 2 --pp 2 --tp 2 on 8 ranks (4-D: TP pairs inside pipelines inside the context-parallel groups) follows '
    .. 'the one-process curve, with --fsdp too; its checkpoint resumes in one process on the curve', function()
    for _, c in ipairs({ { 'models/llama.lua', tiny_llama, 'l' }, { 'models/gpt2.lua', tiny, 'g' } }) do
      for _, fs in ipairs({ '', '--fsdp FULL_SHARD' }) do
        if c[3] == 'l' or fs == '' then
          local lines = { '[rank 0] context parallel: 2-way', '[rank 0] pipeline parallel: 2 stages over 8 ranks',
            '[rank 0] tensor parallel: 2-way over 8 ranks' }
          -- (--fsdp: a stage's slice is sharded over the two context-parallel ranks that hold it)
          if fs ~= '' then lines[#lines + 1] = '[rank 0] fsdp: FULL_SHARD over 2 ranks' end
          follows_one(8, c, '--cp 2 --pp 2 --tp 2 ' .. fs, ('%s/%s4d%s'):format(dir, c[3], fs == '' and 'dp' or 'fs'),
            lines)
        end
      end
    end
    -- 16 ranks: data parallel 2 across the 4-D blocks, FSDP over the four
    -- ranks that hold a slice (two data-parallel x two context-parallel)
    local out16 = dir .. '/l4d16'
    local status16, text16 = bin_train(('--nproc-per-node 16 --device cpu models/llama.lua %s --batch-size 2 '
      .. '--steps 4 --cp 2 --pp 2 --tp 2 --fsdp FULL_SHARD --out %s'):format(tiny_llama, q(out16)))
    assert.are.equal(0, status16, text16)
    assert.is_truthy(text16:find('4 steps x 64 tokens (2 data-parallel groups x 2 x 16 x 1 micro-batches)', 1, true),
      text16)
    assert.is_truthy(text16:find('[rank 0] fsdp: FULL_SHARD over 4 ranks', 1, true), text16)
    close_losses(reference('models/llama.lua', tiny_llama, 'l1'), losses(out16), 1, 4, '16 ranks: dp 2 x 4-D')
    -- stopped at step 2, resumed in one process: the rest of the curve
    stopped_and_resumed_in_one(8, '--cp 2 --pp 2 --tp 2', dir .. '/g4dr',
      '--cp 2 --pp 2 --tp 2 resumed in one process')
  end)

  it('refuses layouts it cannot run, with a message', function()
    local cases = {
      { '--nproc-per-node 2 --device cpu models/gpt2.lua ' .. tiny .. ' --cp 3 --steps 1', 'world of 2 ranks is not a multiple' },
      { '--nproc-per-node 2 --device cpu models/gpt2.lua ' .. tiny .. ' --seq-len 18 --cp 2 --steps 1',
        '--seq-len 18 is not a multiple of 4' },
      { '--nproc-per-node 2 --device cpu models/gpt2.lua ' .. tiny .. ' --cp 2 --pp 2 --steps 1',
        'with --pp 2: the world of 2 ranks is not a multiple of 4' },
      { '--nproc-per-node 4 --device cpu models/gpt2.lua ' .. tiny .. ' --cp 2 --pp 2 --tp 2 --steps 1',
        '--cp 2 with --pp 2 --tp 2: the world of 4 ranks is not a multiple of 8' },
      { '--nproc-per-node 2 --device cpu models/gpt2.lua ' .. tiny .. ' --cp 2 --tp 2 --steps 1',
        'world of 2 ranks is not a multiple of 4' },
    }
    for _, c in ipairs(cases) do
      local status, text = bin_train(c[1] .. ' --out ' .. q(dir .. '/bad'))
      assert.are.equal(2, status, text)
      assert.is_truthy(text:find(c[2], 1, true), text)
    end
  end)
end)
