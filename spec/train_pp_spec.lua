-- Pipeline parallelism in the built-in loop (bin/train --pp N, docs/pp.md):
-- CPU ranks through mpirun. Checked against one process over the same
-- global batches: the loss curve (within 1e-5 relative) at 2 ranks (--pp 2,
-- both schedules, GPT-2 with its tied head and Llama) and at 4 (--pp 2 x
-- data parallel 2, with gradient accumulation); the whole-model checkpoint
-- a --pp run writes (sharded by default: every stage's ranks their own
-- files under the whole model's names, the tied embedding once; whole with
-- --pp-checkpoint full) resumes at the same layout, at another
-- data-parallel size and in one process with the losses of the run that
-- never stopped, and a missing or truncated rank file is named; --fsdp
-- shards each stage over the data-parallel ranks (--pp 2 --fsdp,
-- HYBRID_SHARD, and --pp 2 --tp 2 --fsdp), its sharded checkpoint one
-- file a rank; the final
-- weights are the whole model; a NaN
-- step is skipped on every stage; --lora trains as in one process and saves
-- the merged model; bad layouts exit 2 with a message.
local train = require 'moonshard.train'
local data = require 'moonshard.data'

local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus_path = S.fixed_corpus(dir, 48000)

local tiny, tiny_llama = S.tiny_flags(corpus_path, 3)

describe('bin/train --pp (pipeline parallelism, CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  local reference = S.references(dir)

  it('--pp 2 on 2 ranks follows the one-process loss curve (gpt2, llama; 1f1b, gpipe, zbh1); the final weights are the whole model',
    function()
    for _, c in ipairs({ { 'models/gpt2.lua', tiny, 'g' }, { 'models/llama.lua', tiny_llama, 'l' } }) do
      local one = reference(c[1], c[2], c[3] .. '1')
      for _, sched in ipairs({ '1f1b', 'gpipe', 'zbh1' }) do
        local out = ('%s/%s2%s'):format(dir, c[3], sched)
        local status, text = bin_train(('--nproc-per-node 2 --device cpu %s %s --batch-size 4 --steps 4 --pp 2 '
          .. '--pp-schedule %s --out %s'):format(c[1], c[2], sched, q(out)))
        assert.are.equal(0, status, text)
        close_losses(one, losses(out), 1, 4, c[1] .. ' --pp 2 ' .. sched)
        assert.is_truthy(text:find(('[rank 0] pipeline parallel: 2 stages over 2 ranks, blocks {2, 1}, data parallel 1, '
          .. '%s, 4 micro-batches of 1 sequences'):format(sched), 1, true), text)
        assert.is_truthy(text:find('[rank 1] done: 4 steps', 1, true), text)
        -- the saved folder is the whole model: its validation loss in this process is the run's
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

  it('--pp 2 --autocast bf16 (the default on GPUs without --fsdp): every stage\'s forward in bf16, the one-process '
    .. 'bf16 curve within bf16 rounding', function()
    local one32 = reference('models/llama.lua', tiny_llama, 'l1')
    local one = reference('models/llama.lua', tiny_llama .. ' --autocast bf16', 'lb1')
    S.autocast_follows('models/llama.lua', tiny_llama, '--pp 2', dir .. '/lb2', one, one32)
  end)

  it('--pp 2 on 4 ranks (data parallel 2), with 2 micro-batches and gradient accumulation, follows the one-process curve',
    function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local status, text = bin_train(('--nproc-per-node 4 --device cpu models/gpt2.lua %s --batch-size 1 --tokens-per-step 64 '
      .. '--steps 4 --pp 2 --pp-microbatches 1 --out %s/g4'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('2 stages over 4 ranks, blocks {2, 1}, data parallel 2, 1f1b, 1 micro-batches', 1, true), text)
    assert.is_truthy(text:find('4 steps x 64 tokens (2 data-parallel groups x 1 x 16 x 2 micro-batches)', 1, true), text)
    close_losses(one, losses(dir .. '/g4'), 1, 4, '--pp 2 x dp 2 with accumulation')
    -- validation runs through the pipeline: the same as one process's
    local status2, text2 = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 2 --pp 2 '
      .. '--eval-every 1 --out %s/gv'):format(tiny, q(dir)))
    assert.are.equal(0, status2, text2)
    local status1, text1 = bin_train(('models/gpt2.lua %s --batch-size 4 --steps 2 --eval-every 1 --out %s/gv1'):format(
      tiny, q(dir)))
    assert.are.equal(0, status1, text1)
    local function vals(path)
      local r = {}
      for line in io.lines(path .. '/metrics.jsonl') do
        local v = line:match('"val_loss":([%d%.e%-]+)')
        if v then r[#r + 1] = tonumber(v) end
      end
      return r
    end
    local a, b = vals(dir .. '/gv'), vals(dir .. '/gv1')
    assert.are.equal(2, #a)
    for i = 1, 2 do assert.is_true(math.abs(a[i] - b[i]) <= 1e-5 * b[i], ('val %d: %g against %g'):format(i, a[i], b[i])) end
  end)

  -- the rank files of a sharded checkpoint: rank -> number of pieces it
  -- holds (read from the index), and the ranks holding each parameter
  local function pieces_by_rank(path)
    local index = require('moonshard.fsdp_checkpoint').read_index(path)
    local n, holders = {}, {}
    for r = 0, index.world_size - 1 do n[r] = 0 end
    for name, list in pairs(index.pieces) do
      holders[name] = {}
      for _, pc in ipairs(list) do
        n[pc.rank] = n[pc.rank] + 1
        holders[name][pc.rank] = true
      end
    end
    return index, n, holders
  end
  local function exists(path)
    local f = io.open(path, 'rb')
    if f then f:close() end
    return f ~= nil
  end

  it('a --pp checkpoint is sharded: one data-parallel copy of each stage writes its file under the whole model\'s names, '
    .. 'the tied embedding once; it resumes at the same layout, at another data-parallel size and in one process with the '
    .. 'same losses; a missing or truncated rank file is named', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local out = dir .. '/gss'
    local status, text = bin_train(('--nproc-per-node 4 --device cpu models/gpt2.lua %s --batch-size 2 --steps 4 --pp 2 '
      .. '--pp-microbatches 2 --save-every 1 --stop-at 2 --out %s'):format(tiny, q(out)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('2 stages over 4 ranks, blocks {2, 1}, data parallel 2', 1, true), text)
    local ck = out .. '/ckpt-2'
    assert.is_false(exists(ck .. '/model.safetensors'), 'a sharded --pp checkpoint has no whole-model file')
    for r = 0, 3 do
      assert.is_true(exists(ck .. '/' .. require('moonshard.fsdp_checkpoint').rank_file(r, 4)), 'rank file ' .. r)
    end
    local index, n, holders = pieces_by_rank(ck)
    assert.are.equal(4, index.world_size)
    assert.are.equal(2, index.step)
    -- the whole model's names (the uncut model's 40 parameters, wte once, no lm_head)
    local gpt2 = require 'models.gpt2'
    local function uncut() return gpt2.new('tiny', { n_layer = 3, n_embd = 32, n_head = 2 }) end
    local whole = 0
    for _ in uncut():named_parameters() do whole = whole + 1 end
    assert.are.equal(40, whole)
    assert.are.equal(whole, #index.params)
    for _, e in ipairs(index.params) do assert.is_truthy(holders[e.name], e.name .. ' has pieces') end
    assert.is_nil(holders['lm_head.weight'])
    -- stage 0's first data-parallel rank (0) and stage 1's (1) write; their copies (2, 3) write empty files
    assert.is_true(n[0] > 0 and n[1] > 0, ('pieces by rank: %d, %d'):format(n[0], n[1]))
    assert.are.equal(0, n[2]); assert.are.equal(0, n[3])
    assert.are.same({ [0] = true }, holders['transformer.wte.weight'])   -- (the last stage's tied copy is not written)
    assert.are.same({ [1] = true }, holders['transformer.ln_f.weight'])
    assert.are.same({ [1] = true }, holders['transformer.h.2.mlp.c_fc.weight'])
    for _, c in ipairs({ 'a', 'b', 'c', 'e', 'f' }) do os.execute(('cp -r %s %s%s'):format(q(out), q(out), c)) end
    -- the same layout
    status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s --pp 2'):format(q(out)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(out), 1, 4, 'a sharded --pp checkpoint resumed at the same layout')
    -- --pp 2 without data parallelism (the global batch the checkpoint's)
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %sa --pp 2 --batch-size 4'):format(q(out)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(out .. 'a'), 1, 4, 'a sharded --pp checkpoint resumed at --pp 2 x data parallel 1')
    -- one process
    status, text = bin_train(('--resume %sb --batch-size 4'):format(q(out)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(out .. 'b'), 1, 4, 'a sharded --pp checkpoint resumed in one process')
    -- FSDP at --pp 2 over 4 ranks
    status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %sc --pp 2 --fsdp FULL_SHARD'):format(q(out)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(out .. 'c'), 1, 4, 'a sharded --pp checkpoint resumed at --pp 2 --fsdp FULL_SHARD')
    -- a missing rank file, then a truncated one (the only checkpoint of the folder): named
    os.execute(('rm -rf %se/ckpt-1 %sf/ckpt-1 && rm %se/ckpt-2/rank-00001-of-00004.safetensors'):format(q(out), q(out),
      q(out)))
    status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %se --pp 2'):format(q(out)))
    assert.are_not.equal(0, status, text)
    assert.is_truthy(text:find(out .. 'e/ckpt-2/rank-00001-of-00004.safetensors is missing', 1, true), text)
    os.execute(('truncate -s 1000 %sf/ckpt-2/rank-00000-of-00004.safetensors'):format(q(out)))
    status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %sf --pp 2'):format(q(out)))
    assert.are_not.equal(0, status, text)
    assert.is_truthy(text:find(out .. 'f/ckpt-2/rank-00000-of-00004.safetensors has 1000 bytes', 1, true), text)
    -- (the loader's own check, without the manifest's: the folder read as a checkpoint)
    local ok, err = pcall(require('moonshard.fsdp_checkpoint').load_sharded, uncut(), out .. 'e/ckpt-2')
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find(out .. 'e/ckpt-2/rank-00001-of-00004.safetensors is missing (the file of rank 1 '
      .. 'of the 4', 1, true), tostring(err))
  end)

  it('a sharded --pp checkpoint holds each MoE layer\'s routing biases from the stage that updates them; resumed in one '
    .. 'process and at --pp 2, the run that never stopped', function()
    local flags = ('--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 48 '
      .. '--seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 1 --data %s '
      .. '--model.output_router_logits false --moe-bias-rate 0.01 --batch-size 4 --steps 6'):format(q(corpus_path))
    local out = dir .. '/mxs'
    local status, text = bin_train(('models/mixtral.lua %s --out %s1'):format(flags, q(out)))
    assert.are.equal(0, status, text)
    local one = losses(out .. '1')
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --pp 2 --save-every 3 --stop-at 3 '
      .. '--out %s'):format(flags, q(out)))
    assert.are.equal(0, status, text)
    local index, _, holders = pieces_by_rank(out .. '/ckpt-3')
    assert.are.equal(2, #index.buffers)
    -- (every stage keeps every buffer; only stage 1's forwards move layer 1's)
    assert.are.same({ [0] = true }, holders['model.layers.0.block_sparse_moe.expert_bias'])
    assert.are.same({ [1] = true }, holders['model.layers.1.block_sparse_moe.expert_bias'])
    os.execute(('cp -r %s %s2'):format(q(out), q(out)))
    status, text = bin_train(('--resume %s'):format(q(out)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(out), 1, 6, 'mixtral --pp 2 --moe-bias-rate, resumed in one process')
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s2 --pp 2'):format(q(out)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(out .. '2'), 1, 6, 'mixtral --pp 2 --moe-bias-rate, resumed at --pp 2')
  end)

  it('--pp 2 --async-checkpoint writes its sharded checkpoints in the background; one resumes in one process', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local out = dir .. '/gsa'
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 4 --pp 2 '
      .. '--async-checkpoint --save-every 1 --stop-at 3 --out %s'):format(tiny, q(out)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('checkpoint ' .. out .. '/ckpt-2 (written in the background', 1, true), text)
    local index, n = pieces_by_rank(out .. '/ckpt-2')
    assert.are.equal(2, index.world_size)
    assert.is_true(n[0] > 0 and n[1] > 0)
    status, text = bin_train(('--resume %s/ckpt-2'):format(q(out)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(out), 1, 4, 'an async sharded --pp checkpoint resumed in one process')
  end)

  it('with --pp-checkpoint full a --pp checkpoint is a whole-model one: it resumes in one process and at --pp 2 with the '
    .. 'same losses', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 4 --pp 2 '
      .. '--pp-checkpoint full --save-every 1 --stop-at 2 --out %s/gs'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_false(exists(dir .. '/gs/ckpt-2/index.json'))
    local sd = require('moonshard.safetensors').load(dir .. '/gs/ckpt-2/model.safetensors')
    assert.are.same({ 256, 32 }, sd['transformer.wte.weight'].shape)
    assert.are.same({ 32, 96 }, sd['transformer.h.2.attn.c_attn.weight'].shape)
    os.execute(('cp -r %s/gs %s/gs1'):format(q(dir), q(dir)))
    status, text = bin_train(('--resume %s/gs1'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/gs1'), 1, 4, 'a --pp checkpoint resumed in one process')
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s/gs --pp 2'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/gs'), 1, 4, 'a --pp checkpoint resumed at --pp 2')
    -- and a one-process checkpoint resumes at --pp 3 (one block a stage)
    os.execute(('mkdir -p %s/g1r && cp -r %s/g1/ckpt-2 %s/g1r/'):format(q(dir), q(dir), q(dir)))
    status, text = bin_train(('--nproc-per-node 3 --device cpu --resume %s/g1r --pp 3 --pp-microbatches 2'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/g1r'), 3, 4, 'a one-process checkpoint resumed at --pp 3')
  end)

  it('--pp 2 with --activation-checkpointing full, and with --float8: the one-process curves', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 4 --pp 2 '
      .. '--activation-checkpointing full --out %s/gac'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('activation checkpointing: 3 of 3 GPT2Block', 1, true), text)
    close_losses(one, losses(dir .. '/gac'), 1, 4, '--pp 2 --activation-checkpointing full')
    -- zbh1 with the blocks checkpointed (their weight gradients run inside the recompute)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 4 --pp 2 '
      .. '--pp-schedule zbh1 --activation-checkpointing full --out %s/gacz'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/gacz'), 1, 4, '--pp 2 --pp-schedule zbh1 --activation-checkpointing full')
    -- (float8's dynamic scales are each micro-batch's amax: one micro-batch of the whole batch has the
    -- one-process scales)
    local one8 = reference('models/gpt2.lua', tiny .. ' --float8', 'g1f8')
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --float8 --batch-size 4 --steps 4 --pp 2 '
      .. '--pp-microbatches 1 --out %s/gf8'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one8, losses(dir .. '/gf8'), 1, 4, '--pp 2 --float8')
    -- float8's weight-gradient GEMMs taken out of the walk by zbh1
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --float8 --batch-size 4 --steps 4 --pp 2 '
      .. '--pp-microbatches 1 --pp-schedule zbh1 --out %s/gf8z'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one8, losses(dir .. '/gf8z'), 1, 4, '--pp 2 --float8 --pp-schedule zbh1')
  end)

  it('--pp 2 --tp 2 --sequence-parallel on 4 ranks (TP pairs in 2 stages, the stages exchange each TP rank\'s rows) '
    .. 'follows the one-process curve; its checkpoint resumes in one process; without sequence parallelism (the '
    .. 'default under --pp) too', function()
    for _, c in ipairs({ { 'models/gpt2.lua', tiny, 'g' }, { 'models/llama.lua', tiny_llama, 'l' } }) do
      local one = reference(c[1], c[2], c[3] .. '1')
      local out = ('%s/%s22'):format(dir, c[3])
      local status, text = bin_train(('--nproc-per-node 4 --device cpu %s %s --batch-size 4 --steps 4 '
        .. '--pp 2 --tp 2 --sequence-parallel --save-every 1 --stop-at 2 --out %s'):format(c[1], c[2], q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('tensor parallel: 2-way over 4 ranks, data parallel 1, sequence parallel', 1, true), text)
      assert.is_truthy(text:find('pipeline parallel: 2 stages over 4 ranks', 1, true), text)
      status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s --pp 2 --tp 2 --sequence-parallel'):format(
        q(out)))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out), 1, 4, c[1] .. ' --pp 2 --tp 2, stopped and resumed')
      os.execute(('cp -r %s %s1'):format(q(out), q(out)))
      status, text = bin_train(('--resume %s1/ckpt-2 --out %s1'):format(q(out), q(out)))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out .. '1'), 1, 4, c[1] .. ' a --pp 2 --tp 2 checkpoint resumed in one process')
      if c[3] == 'g' then
        -- (sharded: each rank its stage's slices as boxes) at --tp 2 alone, and at --pp 2 alone, on 2 ranks
        for _, r in ipairs({ { 't', '--tp 2 --pp 1' }, { 'p', '--pp 2 --tp 1' } }) do
          os.execute(('rm -rf %s%s && cp -r %s1 %s%s'):format(q(out), r[1], q(out), q(out), r[1]))
          os.execute(('rm -rf %s%s/ckpt-3 %s%s/ckpt-4'):format(q(out), r[1], q(out), r[1]))
          status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s%s/ckpt-2 --out %s%s %s'):format(q(out),
            r[1], q(out), r[1], r[2]))
          assert.are.equal(0, status, text)
          close_losses(one, losses(out .. r[1]), 1, 4, c[1] .. ' a --pp 2 --tp 2 checkpoint resumed at ' .. r[2])
        end
      end
      status, text = bin_train(('--nproc-per-node 4 --device cpu %s %s --batch-size 4 --steps 4 --pp 2 --tp 2 '
        .. '--out %sn'):format(c[1], c[2], q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('data parallel 1, no sequence parallel', 1, true), text)
      close_losses(one, losses(out .. 'n'), 1, 4, c[1] .. ' --pp 2 --tp 2 (no sequence parallelism: the default)')
    end
  end)

  it('--pp 2 --fsdp on 4 ranks (each stage sharded over 2; HYBRID_SHARD too) follows the one-process curve; its '
    .. 'checkpoint resumes in one process and sharded again', function()
    for _, c in ipairs({ { 'models/gpt2.lua', tiny, 'g', 'FULL_SHARD' }, { 'models/llama.lua', tiny_llama, 'l', 'SHARD_GRAD_OP' } }) do
      local one = reference(c[1], c[2], c[3] .. '1')
      local out = ('%s/%sf'):format(dir, c[3])
      local status, text = bin_train(('--nproc-per-node 4 --device cpu %s %s --batch-size 2 --steps 4 --pp 2 --fsdp %s '
        .. '--save-every 1 --stop-at 2 --out %s'):format(c[1], c[2], c[4], q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('pipeline parallel: 2 stages over 4 ranks, blocks {2, 1}, data parallel 2', 1, true), text)
      assert.is_truthy(text:find('fsdp: ' .. c[4] .. ' over 2 ranks', 1, true), text)
      -- its checkpoint: sharded, every rank's file with pieces of its stage's shard, no whole-model file
      local ck = out .. '/ckpt-2'
      assert.is_false(exists(ck .. '/model.safetensors'), c[1] .. ': no whole-model file')
      local index, n = pieces_by_rank(ck)
      assert.are.equal(4, index.world_size)
      assert.are.equal(c[4], index.strategy)
      for r = 0, 3 do assert.is_true(n[r] > 0, ('%s: rank %d wrote no pieces'):format(c[1], r)) end
      os.execute(('cp -r %s %s1 && cp -r %s %s2'):format(q(out), q(out), q(out), q(out)))
      status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s --pp 2 --fsdp %s'):format(q(out), c[4]))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out), 1, 4, c[1] .. ' --pp 2 --fsdp, stopped and resumed')
      status, text = bin_train(('--resume %s1/ckpt-2 --out %s1'):format(q(out), q(out)))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out .. '1'), 1, 4, c[1] .. ' a --pp 2 --fsdp checkpoint resumed in one process')
      -- at --pp 2 on 2 ranks: each stage on one rank (another data-parallel size)
      status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s2 --pp 2 --batch-size 4'):format(q(out)))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out .. '2'), 1, 4, c[1] .. ' a --pp 2 --fsdp checkpoint resumed at --pp 2 on 2 ranks')
    end
    -- gradient accumulation (2 steps of one sequence a rank): the reductions once, after the last
    local onea = reference('models/gpt2.lua', tiny, 'g1')
    local sa, ta = bin_train(('--nproc-per-node 4 --device cpu models/gpt2.lua %s --batch-size 1 --tokens-per-step 64 '
      .. '--steps 4 --pp 2 --fsdp --out %s/gfa'):format(tiny, q(dir)))
    assert.are.equal(0, sa, ta)
    assert.is_truthy(ta:find('4 steps x 64 tokens (2 data-parallel groups x 1 x 16 x 2 micro-batches)', 1, true), ta)
    close_losses(onea, losses(dir .. '/gfa'), 1, 4, '--pp 2 --fsdp with accumulation')
    -- float8 with its all-gathers in f8: the losses of bf16 gathers, exactly
    local f8 = ('--nproc-per-node 4 --device cpu models/gpt2.lua %s --batch-size 2 --steps 3 --pp 2 --fsdp '
      .. '--fsdp-mixed-precision bf16 --float8 '):format(tiny)
    local s8, t8 = bin_train(f8 .. ('--out %s/gp8'):format(q(dir)))
    assert.are.equal(0, s8, t8)
    s8, t8 = bin_train(f8 .. ('--float8-all-gather --out %s/gp8g'):format(q(dir)))
    assert.are.equal(0, s8, t8)
    assert.is_truthy(t8:find('float8 all-gathers', 1, true), t8)
    local a8, b8 = losses(dir .. '/gp8'), losses(dir .. '/gp8g')
    for k = 1, 3 do assert.are.equal(a8[k], b8[k], 'float8 all-gathers, step ' .. k) end
    -- HYBRID_SHARD: each stage's 2 data-parallel ranks as shard groups of one, replicated
    local oneh = reference('models/gpt2.lua', tiny, 'g1')
    local st, tx = bin_train(('--nproc-per-node 4 --device cpu models/gpt2.lua %s --batch-size 2 --steps 4 --pp 2 '
      .. '--fsdp HYBRID_SHARD --shard-size 1 --out %s/gh'):format(tiny, q(dir)))
    assert.are.equal(0, st, tx)
    assert.is_truthy(tx:find('fsdp: HYBRID_SHARD over 2 ranks', 1, true), tx)
    close_losses(oneh, losses(dir .. '/gh'), 1, 4, '--pp 2 --fsdp HYBRID_SHARD')
    st, tx = bin_train(('--nproc-per-node 4 --device cpu models/gpt2.lua %s --batch-size 2 --steps 1 --pp 2 '
      .. '--fsdp HYBRID_SHARD --shard-size 3 --out %s/gh3'):format(tiny, q(dir)))
    assert.are.equal(2, st, tx)
    assert.is_truthy(tx:find('--pp 2 --fsdp HYBRID_SHARD: --shard-size 3 does not divide the 2 data-parallel ranks of a stage',
      1, true), tx)
    -- 3-D: TP pairs in 2 stages, each sharded (over one rank here)
    local one = reference('models/llama.lua', tiny_llama, 'l1')
    local status, text = bin_train(('--nproc-per-node 4 --device cpu models/llama.lua %s --batch-size 4 --steps 4 '
      .. '--pp 2 --tp 2 --sequence-parallel --fsdp --out %s/l3d'):format(tiny_llama, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('fsdp: FULL_SHARD over 1 rank', 1, true), text)
    assert.is_truthy(text:find('data parallel 1 (FULL_SHARD), sequence parallel', 1, true), text)
    close_losses(one, losses(dir .. '/l3d'), 1, 4, '--pp 2 --tp 2 --fsdp (sequence parallel)')
  end)

  it('--pp 2 --pp-chunks 2 (interleaved 1F1B, 4 virtual stages) follows the one-process curve', function()
    local one = reference('models/gpt2.lua', tiny .. ' --model.n_layer 4', 'g1l4')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --model.n_layer 4 --batch-size 4 '
      .. '--steps 4 --pp 2 --pp-chunks 2 --out %s/gi'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('pipeline parallel: 2 stages over 2 ranks, blocks {1, 1, 1, 1}, data parallel 1, '
      .. 'interleaved 1f1b, 2 chunks a rank, 4 micro-batches', 1, true), text)
    close_losses(one, losses(dir .. '/gi'), 1, 4, '--pp 2 --pp-chunks 2')
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --model.n_layer 4 --batch-size 3 '
      .. '--steps 1 --pp 2 --pp-chunks 2 --out %s/gi3'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('the interleaved schedule needs micro-batches in multiples of the 2 stages, got 3', 1, true),
      text)
  end)

  it('--pp 2 --lora: the one-process LoRA curve, a resume at --pp 2, and a saved folder of the plain model with only the '
    .. 'adapted weights changed', function()
    local root = require('moonshard.tensor').root
    local fixture = root .. '/../shared/fixtures/gpt2-tiny'
    if not io.open(fixture .. '/model.safetensors', 'rb') then pending('no gpt2-tiny fixture'); return end
    local ms = require 'moonshard'
    local want = ms.load_safetensors(fixture .. '/model.safetensors')
    local common = ('models/gpt2.lua --init-from %s --lora 4 --lora-alpha 8 --steps 4 --seq-len 16 --lr 1e-2 '
      .. '--log-every 1 --eval-every 0 --sample-tokens 0 --batch-size 4 --data %s'):format(q(fixture), q(corpus_path))
    local status, text = bin_train(('%s --out %s/pl1'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu %s --pp 2 --out %s/pl2'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('lora: rank 4, alpha 8, 8 modules', 1, true), text)
    close_losses(losses(dir .. '/pl1'), losses(dir .. '/pl2'), 1, 4, '--pp 2 --lora')
    status, text = bin_train(('--nproc-per-node 2 --device cpu %s --pp 2 --save-every 2 --stop-at 2 --out %s/pl3'):format(
      common, q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s/pl3 --pp 2'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(losses(dir .. '/pl1'), losses(dir .. '/pl3'), 1, 4, '--pp 2 --lora resumed')
    for _, run in ipairs({ 'pl2', 'pl3' }) do
      local m = require('models.gpt2').from_pretrained(dir .. '/' .. run)   -- strict: no lora_ tensors in it
      local m1 = require('models.gpt2').from_pretrained(dir .. '/pl1')
      local one = m1:state_dict()
      local changed = 0
      for k, v in pairs(m:state_dict()) do
        local w = want[k] or want[(k:gsub('^transformer%.', ''))]
        local d = ms.no_grad(function() return (v:double() - w:double()):abs():max():item() end)
        if d > 0 then
          changed = changed + 1
          assert.is_truthy(k:match('c_attn%.weight$') or k:match('c_proj%.weight$') or k:match('c_fc%.weight$'), run .. ' ' .. k)
        end
        -- the one-process run's merged weights
        local e = ms.no_grad(function() return (v:double() - one[k]:double()):abs():max():item() end)
        assert.is_true(e <= 1e-5, ('%s %s: %g from the one-process weights'):format(run, k, e))
      end
      assert.are.equal(8, changed, run)
    end
  end)

  it('a NaN loss on the last stage skips the step on every stage', function()
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 3 --pp 2 '
      .. '--inject-nan 2 --out %s/gn'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('step 2: loss nan, grad norm nan: skipped (1 in a row, 1 in all)', 1, true)
      or text:find('step 2: loss -nan, grad norm -nan: skipped (1 in a row, 1 in all)', 1, true), text)
    assert.is_truthy(text:find('[rank 1] done: 3 steps', 1, true), text)
  end)

  it('bad layouts exit 2 and say why', function()
    local status, text = bin_train(('models/gpt2.lua %s --steps 1 --pp 2 --out %s/b1'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp 2: the world of 1 rank is not a multiple of it', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --tp 2 --out %s/b2')
      :format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp 2 with --tp 2: the world of 2 ranks is not a multiple of 4', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --batch-size 4 '
      .. '--pp-microbatches 3 --out %s/b3'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp-microbatches 3 does not divide --batch-size 4', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --model.n_layer 1 --steps 1 --pp 2 '
      .. '--out %s/b5'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp 2: pp.pipeline: 1 blocks cannot fill 2 stages', 1, true), text)
    status, text = bin_train(('--nproc-per-node 4 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --fsdp FULL_SHARD '
      .. '--pp-schedule zbh1 --out %s/b6'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--pp-schedule zbh1 with --fsdp FULL_SHARD: a sharded stage reduces its gradients', 1, true),
      text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --pp 2 --pp-checkpoint whole '
      .. '--out %s/b7'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('pp_checkpoint must be sharded or full, got \'whole\'', 1, true), text)
  end)
end)
