-- bin/train with DeepSeek's sequence-wise balance loss (--model.aux_loss_alpha,
-- docs/moe.md): the logged loss holds it; activation checkpointing and
-- micro-batches take it as they are; on two CPU ranks FSDP, context,
-- expert, tensor and pipeline parallelism follow the one-process curve
-- (each sequence's loss whole: the context-parallel ranks sum a sequence's
-- counts and scores; the data-parallel ranks' means average as the
-- cross-entropy's).
local S = require 'spec.support'
local q = S.shell_quote

describe('bin/train with --model.aux_loss_alpha (DeepSeek\'s sequence-wise balance loss)', function()
  local dir = S.tmpdir()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)
  local corpus = S.fixed_corpus(dir, 20000)
  -- (two layers, both sparse: a pipeline's stages each hold one)
  local flags = '--preset tiny --model.num_hidden_layers 2 --model.first_k_dense_replace 0 --model.hidden_size 32 '
    .. '--model.intermediate_size 48 --model.moe_intermediate_size 16 --model.q_lora_rank 16 --model.kv_lora_rank 16 '
    .. '--model.qk_nope_head_dim 8 --model.qk_rope_head_dim 8 --model.v_head_dim 8 --seq-len 16 --lr 1e-2 '
    .. '--warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 2 --data ' .. q(corpus)

  local function run(model, extra, out, nproc)
    local status, text = S.bin_train(('%s%s %s %s --steps 4 --out %s'):format(
      nproc and ('--nproc-per-node %d --device cpu '):format(nproc) or '', model, flags, extra, q(out)))
    assert.are.equal(0, status, text)
    return S.run_losses(out), text
  end

  it('deepseek_v3: the loss holds alpha x the layers\' terms; checkpointed, in micro-batches and on two ranks '
    .. '(--fsdp, --cp 2, --ep 2, --tp 2, --pp 2, --cp 2 checkpointed) the one-process curve', function()
    local m = 'models/deepseek_v3.lua'
    local a = ' --model.aux_loss_alpha 0.5'
    local one = run(m, '--batch-size 4' .. a, dir .. '/one')
    local plain = run(m, '--batch-size 4', dir .. '/plain')
    -- step 1 (the same weights): two layers' terms of about alpha each
    local d = one[1] - plain[1]
    assert.is_true(d > 0.8 and d < 1.5, ('the balance loss at step 1: %g'):format(d))
    local ac, text = run(m, '--batch-size 4 --activation-checkpointing full' .. a, dir .. '/ac')
    assert.is_truthy(text:find('activation checkpointing: 2 of 2', 1, true), text)
    S.close_losses(one, ac, 1, 4, 'checkpointed', 1e-6)
    S.close_losses(one, run(m, '--batch-size 2 --tokens-per-step 64' .. a, dir .. '/accum'), 1, 4, 'two micro-batches')
    for _, how in ipairs({ '--fsdp FULL_SHARD --batch-size 2', '--cp 2 --batch-size 4', '--ep 2 --batch-size 2',
      '--tp 2 --batch-size 4', '--pp 2 --batch-size 4', '--cp 2 --batch-size 4 --activation-checkpointing full' }) do
      S.close_losses(one, run(m, how .. a, dir .. '/' .. how:gsub('[^%w]', ''), 2), 1, 4, m .. ' ' .. how)
    end
  end)

  it('deepseek_v2 (softmax scores, the routing\'s experts): --fsdp and --cp 2 follow one process', function()
    local m = 'models/deepseek_v2.lua'
    local a = ' --model.aux_loss_alpha 0.5 --model.first_k_dense_replace 1'
    local one = run(m, '--batch-size 4' .. a, dir .. '/v2one')
    local plain = run(m, '--batch-size 4 --model.first_k_dense_replace 1', dir .. '/v2plain')
    assert.is_true(one[1] - plain[1] > 0.4, ('%g against %g'):format(one[1], plain[1]))
    for _, how in ipairs({ '--fsdp FULL_SHARD --batch-size 2', '--cp 2 --batch-size 4' }) do
      S.close_losses(one, run(m, how .. a, dir .. '/v2' .. how:gsub('[^%w]', ''), 2), 1, 4, m .. ' ' .. how)
    end
  end)
end)
