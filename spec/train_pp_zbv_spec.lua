-- bin/train --pp 2 --pp-schedule zbv and looped_bfs (docs/pp.md), CPU
-- ranks through mpirun: the one-process loss curve within 1e-5 (GPT-2 with
-- its tied head, on rank 0 with the embedding under the V, and Llama);
-- the saved weights are the whole model; the sharded checkpoint (the
-- stages' parameters under the whole model's names, the tied embedding
-- once, from rank 0) resumes in one process and at --pp 2 zbv; --fsdp
-- shards the stages under zbv; --pp-layers gives the cut (a chunk of the
-- head alone); bad micro-batch and chunk counts and bad --pp-layers exit 2
-- and name them.
local train = require 'moonshard.train'
local data = require 'moonshard.data'

local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus_path = S.fixed_corpus(dir, 48000)

-- 4 blocks: 2 x 2 virtual stages
local tiny, tiny_llama = S.tiny_flags(corpus_path, 4)

describe('bin/train --pp 2 --pp-schedule zbv | looped_bfs (CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  local reference = S.references(dir)

  it('--pp 2 on 2 ranks follows the one-process loss curve (gpt2, llama; zbv, looped_bfs); the final weights are the whole model',
    function()
    for _, c in ipairs({ { 'models/gpt2.lua', tiny, 'g' }, { 'models/llama.lua', tiny_llama, 'l' } }) do
      local one = reference(c[1], c[2], c[3] .. '1')
      for _, run in ipairs({ { 'zbv', '', 'zbv, 2 chunks a rank in a V' },
        { 'looped_bfs', ' --pp-chunks 2', 'looped bfs, 2 chunks a rank' } }) do
        local out = ('%s/%s2%s'):format(dir, c[3], run[1])
        local status, text = bin_train(('--nproc-per-node 2 --device cpu %s %s --batch-size 4 --steps 4 --pp 2 '
          .. '--pp-schedule %s%s --out %s'):format(c[1], c[2], run[1], run[2], q(out)))
        assert.are.equal(0, status, text)
        close_losses(one, losses(out), 1, 4, c[1] .. ' --pp 2 ' .. run[1])
        assert.is_truthy(text:find(('[rank 0] pipeline parallel: 2 stages over 2 ranks, blocks {1, 1, 1, 1}, data '
          .. 'parallel 1, %s, 4 micro-batches of 1 sequences'):format(run[3]), 1, true), text)
        local M = require(c[1]:gsub('%.lua$', ''):gsub('/', '.'))
        local m = M.from_pretrained(out)
        local m1 = M.from_pretrained(dir .. '/' .. c[3] .. '1')
        local corpus = data.corpus { path = corpus_path, val_fraction = 0.1, min_len = 17 }
        local function val(model)
          return train.evaluate(model, data.Loader(corpus.val, { batch_size = 4, seq_len = 16, seed = 1337 + 1 }), 2)
        end
        local v, v1 = val(m), val(m1)
        assert.is_true(math.abs(v - v1) <= 1e-5 * v1, ('the --pp weights give val %.17g, one process\'s %.17g'):format(v, v1))
      end
    end
  end)

  it('a --pp 2 zbv checkpoint: the whole model\'s names, the tied embedding once from rank 0 (which holds the head '
    .. 'too); resumed in one process and at --pp 2 zbv with the losses of the run that never stopped', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    S.pp_stop_and_resume('models/gpt2.lua ' .. tiny, 'zbv', dir .. '/gz', one, function(out)
      local index = require('moonshard.fsdp_checkpoint').read_index(out .. '/ckpt-2')
      local holders = {}
      for name, list in pairs(index.pieces) do
        holders[name] = {}
        for _, pc in ipairs(list) do holders[name][pc.rank] = true end
      end
      local whole = 0
      for _ in require('models.gpt2').new('tiny', { n_layer = 4, n_embd = 32, n_head = 2 }):named_parameters() do
        whole = whole + 1
      end
      assert.are.equal(whole, #index.params)
      for _, e in ipairs(index.params) do assert.is_truthy(holders[e.name], e.name .. ' has pieces') end
      -- rank 0: virtual stages 0 and 3 (blocks 0 and 3, the embedding, the final norm)
      assert.are.same({ [0] = true }, holders['transformer.wte.weight'])
      assert.are.same({ [0] = true }, holders['transformer.ln_f.weight'])
      assert.are.same({ [0] = true }, holders['transformer.h.0.mlp.c_fc.weight'])
      assert.are.same({ [0] = true }, holders['transformer.h.3.mlp.c_fc.weight'])
      assert.are.same({ [1] = true }, holders['transformer.h.1.mlp.c_fc.weight'])
      assert.are.same({ [1] = true }, holders['transformer.h.2.mlp.c_fc.weight'])
    end)
  end)

  it('--pp 2 --pp-schedule zbv --fsdp FULL_SHARD on 4 ranks (2 pipelines of 4 rows) follows the one-process curve of '
    .. 'their 8 rows', function()
    S.pp_fsdp_follows(dir, tiny_llama, 'zbv', 'lzf', { 'fsdp: FULL_SHARD over 2 ranks' })
  end)

  it('--pp-layers 1,2,1,0: the cut given (the head\'s chunk the head alone) follows the one-process curve', function()
    local one = reference('models/llama.lua', tiny_llama, 'l1')
    local out = dir .. '/lcut'
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/llama.lua %s --batch-size 4 --steps 4 --pp 2 '
      .. '--pp-schedule zbv --pp-layers 1,2,1,0 --out %s'):format(tiny_llama, q(out)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('2 stages over 2 ranks, blocks {1, 2, 1, 0}, data parallel 1, zbv', 1, true), text)
    close_losses(one, losses(out), 1, 4, '--pp 2 zbv --pp-layers 1,2,1,0')
  end)

  it('bad --pp-layers exit 2 and say why', function()
    local function bad(flags, msg, n)
      local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --batch-size 4 %s '
        .. '--out %s/c%d'):format(tiny, flags, q(dir), n))
      assert.are.equal(2, status, text)
      assert.is_truthy(text:find(msg, 1, true), text)
    end
    bad('--pp 2 --pp-schedule zbv --pp-layers 1,1,2', '--pp-layers 1,1,2: 3 counts adding up to 4 blocks, but --pp 2 x 2 '
      .. 'chunks a rank is 4 virtual stages and the model has 4 blocks', 1)
    bad('--pp 2 --pp-layers 2,3', '--pp-layers 2,3: 2 counts adding up to 5 blocks, but --pp 2 x 1 chunk a rank is 2 '
      .. 'virtual stages and the model has 4 blocks', 2)
    bad('--pp 2 --pp-layers 2,,2', 'pp_layers must be blocks per virtual stage, comma-separated counts (2,5,5,4), got '
      .. '\'2,,2\'', 3)
    bad('--pp-layers 2,2', '--pp-layers 2,2 without --pp N > 1: there is no pipeline to cut', 4)
  end)

  it('bad micro-batch and chunk counts exit 2 and say why', function()
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --batch-size 2 '
      .. '--pp-schedule zbv --out %s/b1'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp 2: pp.pipeline: the zbv schedule needs at least 2 x 2 - 1 = 3 micro-batches over 2 '
      .. 'stages (the first rank\'s warm-up runs that many forwards), got 2', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --batch-size 4 '
      .. '--pp-schedule zbv --pp-chunks 3 --out %s/b2'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp-schedule zbv runs 2 chunks a rank, got --pp-chunks 3', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --batch-size 4 '
      .. '--pp-schedule looped_bfs --out %s/b3'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp-schedule looped_bfs runs GPipe over chunks: give --pp-chunks > 1', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --batch-size 4 '
      .. '--pp-schedule zbw --out %s/b4'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('pp_schedule must be 1f1b, zbh1, zbv, dualpipev, gpipe or looped_bfs, got \'zbw\'', 1, true), text)
  end)
end)
