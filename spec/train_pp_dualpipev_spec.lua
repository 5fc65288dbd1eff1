-- bin/train --pp 2 --pp-schedule dualpipev (docs/pp.md), CPU ranks through
-- mpirun: GPT-2 (its tied head on rank 0 with the embedding, under the V)
-- and Llama on 2 ranks follow the one-process loss curve and gradient
-- norms within 1e-5, and their saved weights are one process's; a sharded
-- checkpoint stopped at step 2 resumes at --pp 2 dualpipev and in one
-- process on the curve of the run that never stopped; --pp 2 dualpipev
-- --fsdp FULL_SHARD on 4 ranks follows one process over the 8 rows; bad
-- micro-batch and chunk counts exit 2 and name them.
require 'moonshard'
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus_path = S.fixed_corpus(dir, 48000)
-- 4 blocks: 2 x 2 virtual stages
local tiny, tiny_llama = S.tiny_flags(corpus_path, 4)

describe('bin/train --pp 2 --pp-schedule dualpipev (CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  local reference = S.references(dir)

  it('--pp 2 on 2 ranks follows the one-process loss curve and gradient norms (gpt2, llama); the final weights are one process\'s',
    function()
    for _, c in ipairs({ { 'models/gpt2.lua', tiny, 'g' }, { 'models/llama.lua', tiny_llama, 'l' } }) do
      local one = reference(c[1], c[2], c[3] .. '1')
      local out = ('%s/%s2dpv'):format(dir, c[3])
      local status, text = bin_train(('--nproc-per-node 2 --device cpu %s %s --batch-size 4 --steps 4 --pp 2 '
        .. '--pp-schedule dualpipev --out %s'):format(c[1], c[2], q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('[rank 0] pipeline parallel: 2 stages over 2 ranks, blocks {1, 1, 1, 1}, data '
        .. 'parallel 1, dualpipev, 2 chunks a rank in a V, 4 micro-batches of 1 sequences', 1, true), text)
      close_losses(one, losses(out), 1, 4, c[1] .. ' --pp 2 dualpipev')
      local g1, g2 = S.run_grad_norms(dir .. '/' .. c[3] .. '1'), S.run_grad_norms(out)
      local n = 0
      for step, g in pairs(g1) do
        assert.is_number(g2[step], ('%s: no grad_norm at step %d'):format(c[1], step))
        assert.is_true(math.abs(g2[step] - g) <= 1e-5 * math.abs(g), ('%s: step %d grad_norm %.17g against %.17g'):format(
          c[1], step, g2[step], g))
        n = n + 1
      end
      assert.is_true(n >= 2, c[1] .. ': grad norms logged')
      S.close_weights(out .. '/model.safetensors', dir .. '/' .. c[3] .. '1/model.safetensors', c[1] .. ' dualpipev')
    end
  end)

  it('a --pp 2 dualpipev checkpoint resumes at --pp 2 dualpipev and in one process with the losses of the run that never stopped',
    function()
    local one = reference('models/llama.lua', tiny_llama, 'l1')
    S.pp_stop_and_resume('models/llama.lua ' .. tiny_llama, 'dualpipev', dir .. '/lz', one, function(out)
      assert.is_nil(losses(out)[3], 'stopped at step 2')
      local index = require('moonshard.fsdp_checkpoint').read_index(out .. '/ckpt-2')
      assert.is_true(#index.params > 10)
    end)
  end)

  it('--pp 2 --pp-schedule dualpipev --fsdp FULL_SHARD on 4 ranks (2 pipelines of 4 rows) follows the one-process curve '
    .. 'of their 8 rows', function()
    S.pp_fsdp_follows(dir, tiny_llama, 'dualpipev', 'ldf')
  end)

  it('bad micro-batch and chunk counts exit 2 and say why', function()
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --batch-size 3 '
      .. '--pp-schedule dualpipev --out %s/b1'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp 2: pp.pipeline: the dualpipev schedule needs at least 2 x 2 = 4 micro-batches over 2 '
      .. 'stages (the last rank\'s first overlapped pair comes after every rank\'s 2 x 2 warm-up forwards), got 3', 1,
      true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --batch-size 4 '
      .. '--pp-schedule dualpipev --pp-chunks 3 --out %s/b2'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp-schedule dualpipev runs 2 chunks a rank, got --pp-chunks 3', 1, true), text)
  end)
end)
