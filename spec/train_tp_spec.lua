-- Tensor parallelism in the built-in loop (bin/train --tp N, docs/tp.md):
-- CPU ranks through mpirun. Checked against one process over the same
-- global batches: the loss curve (within 1e-5 relative) at 2 ranks (--tp 2)
-- and at 4 (--tp 2 x data parallel 2), GPT-2 and Llama; the whole-model
-- checkpoint a --tp run writes resumes in one process and at --tp 2 with
-- the losses of the run that never stopped; the final weights are the
-- whole model; float8 with the TP group's scales follows the one-process
-- float8 curve; under --autocast bf16 (GPUs' default) the one-process bf16
-- curve; bad layouts exit 2 with a message.
local train = require 'moonshard.train'
local data = require 'moonshard.data'

local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus_path = S.fixed_corpus(dir, 48000)

local tiny, tiny_llama = S.tiny_flags(corpus_path, 2)

describe('bin/train --tp (tensor parallelism, CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- weights (name -> tensor) after `steps` AdamW steps against a reference
  -- run's: within f32 rounding as AdamW carries it (an update is ~lr = 1e-2
  -- whatever the gradient's size, so rounding-level gradient differences
  -- move a weight by ~1e-5), but for the odd element whose gradient is near
  -- zero (its update g / (|g| + eps) moves with the rounding: 1e-4 and more
  -- are seen): at most one in a thousand beyond 2e-5, none beyond the
  -- 2 lr a step the two runs can move apart
  local function close_weights(got, ref, steps, what)
    for name, t in pairs(ref) do
      local d = (got[name]:to('f64') - t:to('f64')):abs()
      local far, n, most = d:gt(2e-5):sum():item(), d:numel(), d:max():item()
      assert.is_true(far <= math.max(1, n / 1000) and most <= 2e-2 * steps,
        ('%s: %d of %d elements beyond 2e-5 of %s, the most %g'):format(name, far, n, what, most))
    end
  end

  local reference = S.references(dir)

  it('--tp 2 on 2 ranks follows the one-process loss curve (gpt2, llama); the final weights are the whole model', function()
    for _, c in ipairs({ { 'models/gpt2.lua', tiny, 'g' }, { 'models/llama.lua', tiny_llama, 'l' } }) do
      local one = reference(c[1], c[2], c[3] .. '1')
      local status, text = bin_train(('--nproc-per-node 2 --device cpu %s %s --batch-size 4 --steps 4 --tp 2 --out %s/%s2')
        :format(c[1], c[2], q(dir), c[3]))
      assert.are.equal(0, status, text)
      close_losses(one, losses(dir .. '/' .. c[3] .. '2'), 1, 4, c[1] .. ' --tp 2')
      assert.is_truthy(text:find('[rank 0] tensor parallel: 2-way over 2 ranks, data parallel 1, sequence parallel', 1,
        true), text)
      local ok = text:find('[rank 1] done: 4 steps', 1, true)
      assert.is_truthy(ok, text)
      -- the saved folder is the whole model: its validation loss in this process is the run's
      local M = require(c[1]:gsub('%.lua$', ''):gsub('/', '.'))
      local m = M.from_pretrained(dir .. '/' .. c[3] .. '2')
      local m1 = M.from_pretrained(dir .. '/' .. c[3] .. '1')
      local corpus = data.corpus { path = corpus_path, val_fraction = 0.1, min_len = 17 }
      local function val(model)
        return train.evaluate(model, data.Loader(corpus.val, { batch_size = 4, seq_len = 16, seed = 1337 + 1 }), 2)
      end
      local v, v1 = val(m), val(m1)
      assert.is_true(math.abs(v - v1) <= 1e-5 * v1, ('the --tp weights give val %.17g, one process\'s %.17g'):format(v, v1))
    end
  end)

  it('--tp 2 --autocast bf16 (the default on GPUs without --fsdp): the one-process bf16 curve within bf16 rounding, '
    .. 'not the f32 one', function()
    local one32 = reference('models/llama.lua', tiny_llama, 'l1')
    local one = reference('models/llama.lua', tiny_llama .. ' --autocast bf16', 'lb1')
    S.autocast_follows('models/llama.lua', tiny_llama, '--tp 2', dir .. '/lb2', one, one32)
  end)

  it('--tp 2 with micro-batches (sequence parallel: the norms\' partial gradients summed once a backward) follows the one-process curve', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 2 --tokens-per-step 64 '
      .. '--steps 4 --tp 2 --out %s/gacc'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('2 x 16 x 2 micro-batches', 1, true), text)
    close_losses(one, losses(dir .. '/gacc'), 1, 4, '--tp 2, 2 micro-batches')
  end)

  it('--no-tp-overlap: the losses of the overlapped backward (the default), exactly', function()
    local runs = {}
    for _, flag in ipairs({ '', ' --no-tp-overlap' }) do
      local status, text = bin_train(('--nproc-per-node 2 --device cpu models/llama.lua %s --batch-size 4 --steps 4 --tp 2%s '
        .. '--no-sequence-parallel --out %s/ov%d'):format(tiny_llama, flag, q(dir), #flag))
      assert.are.equal(0, status, text)
      assert.are.equal(flag ~= '', text:find('no backward overlap', 1, true) ~= nil, text)
      runs[#runs + 1] = losses(('%s/ov%d'):format(dir, #flag))
    end
    assert.is_true(#runs[1] >= 2)
    assert.are.same(runs[2], runs[1])
  end)

  it('--tp 2 on 4 ranks (data parallel 2) follows the one-process curve over the same global batches, with and without sequence parallelism', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    for _, sp in ipairs({ '', ' --no-sequence-parallel' }) do
      local status, text = bin_train(('--nproc-per-node 4 --device cpu models/gpt2.lua %s --batch-size 2 --steps 4 --tp 2%s '
        .. '--out %s/g4%d'):format(tiny, sp, q(dir), #sp))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('2-way over 4 ranks, data parallel 2, ' .. (sp == '' and '' or 'no ') .. 'sequence parallel',
        1, true), text)
      close_losses(one, losses(('%s/g4%d'):format(dir, #sp)), 1, 4, '--tp 2 x dp 2' .. sp)
    end
  end)

  it('--tp 2 --fsdp FULL_SHARD on 4 ranks (FSDP x TP, sequence parallel by default): the one-process curve; stopped, it resumes in one process and 2-D', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local common = ('--nproc-per-node 4 --device cpu models/gpt2.lua %s --batch-size 2 --steps 4 --tp 2 --fsdp FULL_SHARD'):format(tiny)
    local status, text = bin_train(('%s --out %s/f4'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('2-way over 4 ranks, data parallel 2 (FULL_SHARD), sequence parallel', 1, true), text)
    assert.is_truthy(text:find('fsdp: FULL_SHARD over 2 ranks', 1, true), text)
    close_losses(one, losses(dir .. '/f4'), 1, 4, '--tp 2 x FULL_SHARD 2')
    status, text = bin_train(('%s --no-sequence-parallel --out %s/f4n'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('2-way over 4 ranks, data parallel 2 (FULL_SHARD), no sequence parallel', 1, true), text)
    close_losses(one, losses(dir .. '/f4n'), 1, 4, '--tp 2 x FULL_SHARD 2, no sequence parallelism')
    -- the final weights are the whole model's
    local gpt2 = require 'models.gpt2'
    local m, m1 = gpt2.from_pretrained(dir .. '/f4'), gpt2.from_pretrained(dir .. '/g1')
    close_weights(m:state_dict(), m1:state_dict(), 4, 'the one-process run\'s final weights')
    status, text = bin_train(('%s --save-every 1 --stop-at 2 --out %s/f4s'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    os.execute(('cp -r %s/f4s %s/f4s1'):format(q(dir), q(dir)))
    status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s/f4s --tp 2 --fsdp FULL_SHARD'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/f4s'), 1, 4, 'FSDP x TP resumed as FSDP x TP')
    status, text = bin_train(('--resume %s/f4s1'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/f4s1'), 1, 4, 'FSDP x TP resumed in one process')
  end)

  it('--tp 2 --fsdp SHARD_GRAD_OP with sequence parallelism and micro-batches (llama): the one-process curve', function()
    local one = reference('models/llama.lua', tiny_llama, 'l1')
    local status, text = bin_train(('--nproc-per-node 4 --device cpu models/llama.lua %s --batch-size 1 --tokens-per-step 64 '
      .. '--steps 4 --tp 2 --fsdp SHARD_GRAD_OP --out %s/l4f'):format(tiny_llama, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('2-way over 4 ranks, data parallel 2 (SHARD_GRAD_OP), sequence parallel', 1, true), text)
    assert.is_truthy(text:find('1 x 16 x 2 micro-batches', 1, true), text)
    close_losses(one, losses(dir .. '/l4f'), 1, 4, '--tp 2 x SHARD_GRAD_OP 2, micro-batches')
  end)

  it('with --checkpoint-format full a --tp checkpoint is a whole-model one: it resumes in one process and at --tp 2 with '
    .. 'the same losses', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 4 --tp 2 '
      .. '--checkpoint-format full --save-every 1 --stop-at 2 --out %s/gs'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    -- the files of a one-process checkpoint, the whole tensors in them
    local sd = require('moonshard.safetensors').load(dir .. '/gs/ckpt-2/model.safetensors')
    assert.are.same({ 256, 32 }, sd['transformer.wte.weight'].shape)
    assert.are.same({ 32, 96 }, sd['transformer.h.0.attn.c_attn.weight'].shape)
    -- the one-process run's weights after 2 steps
    local ref2 = require('moonshard.safetensors').load(dir .. '/g1/ckpt-2/model.safetensors')
    close_weights(sd, ref2, 2, 'the one-process checkpoint')
    os.execute(('cp -r %s/gs %s/gs1'):format(q(dir), q(dir)))
    status, text = bin_train(('--resume %s/gs1'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/gs1'), 1, 4, 'a --tp checkpoint resumed in one process')
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s/gs --tp 2'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/gs'), 1, 4, 'a --tp checkpoint resumed at --tp 2')
    -- and a one-process checkpoint resumes at --tp 2
    os.execute(('mkdir -p %s/g1r && cp -r %s/g1/ckpt-2 %s/g1r/'):format(q(dir), q(dir), q(dir)))
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s/g1r --tp 2'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/g1r'), 3, 4, 'a one-process checkpoint resumed at --tp 2')
  end)

  it('a --tp checkpoint is sharded by default (each rank its slices\' boxes, written in parallel): it resumes at --tp 2, '
    .. 'at --tp 2 --fsdp FULL_SHARD on 4 ranks, at --fsdp FULL_SHARD on 2 and in one process with the losses of the run '
    .. 'that never stopped', function()
    local one = reference('models/gpt2.lua', tiny, 'g1')
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 4 --tp 2 '
      .. '--save-every 1 --stop-at 2 --out %s/ts'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    local ck = require 'moonshard.fsdp_checkpoint'
    local index = ck.read_index(dir .. '/ts/ckpt-2')
    assert.are.equal(2, index.version)
    assert.are.equal(2, #index.files)
    -- c_attn's weight (32, 96): 3 sections x 2 ranks, a box of (32, 16) each, rank 1 writing 3 of them
    local boxes, by1 = 0, 0
    for _, pc in ipairs(index.pieces['transformer.h.0.attn.c_attn.weight']) do
      boxes = boxes + 1
      assert.are.same({ 32, 16 }, pc.box.sizes)
      if pc.rank == 1 then by1 = by1 + 1 end
    end
    assert.are.equal(6, boxes)
    assert.are.equal(3, by1)
    -- (the global batch of 4 sequences at every layout)
    local layouts = { { 'ts', '--nproc-per-node 2 --device cpu', '--tp 2' },
                      { 'ts4', '--nproc-per-node 4 --device cpu', '--tp 2 --fsdp FULL_SHARD --batch-size 2' },
                      { 'tsf', '--nproc-per-node 2 --device cpu', '--tp 1 --fsdp FULL_SHARD --batch-size 2' },
                      { 'ts1', '', '' } }
    for _, c in ipairs(layouts) do
      if c[1] ~= 'ts' then os.execute(('rm -rf %s/%s && cp -r %s/ts %s/%s'):format(q(dir), c[1], q(dir), q(dir), c[1])) end
    end
    for _, c in ipairs(layouts) do
      status, text = bin_train(('%s --resume %s/%s %s'):format(c[2], q(dir), c[1], c[3]))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('resumed from', 1, true), text)
      close_losses(one, losses(dir .. '/' .. c[1]), 1, 4, 'a sharded --tp checkpoint resumed with ' .. c[2] .. ' ' .. c[3])
    end
  end)

  it('--async-checkpoint with --tp 2: rank 0 writes the whole-model checkpoints of the synchronous run in the background',
    function()
    local common = ('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 4 --steps 4 --tp 2 --save-every 1 '
      .. '--keep-checkpoints 0 --no-save --pp-checkpoint full'):format(tiny)   -- (the older name of --checkpoint-format)
    local text = S.sync_and_async(common, dir .. '/tsync', dir .. '/tasync')
    assert.is_truthy(text:find('(written in the background in', 1, true), text)
    for step = 1, 4 do
      local a, b = ('%s/tsync/ckpt-%d'):format(dir, step), ('%s/tasync/ckpt-%d'):format(dir, step)
      assert.is_true(require('moonshard.checkpoint').verify(b))
      S.same_files(a, b, { 'model.safetensors', 'optimizer.safetensors', 'optimizer.json' })
    end
  end)

  it('--tp 2 --float8 --float8-tp-scales group: the one-process float8 curve (torchao\'s scales); shard scales drift further', function()
    -- (4 kv heads: every shard a multiple of 16 wide, so the same 14 layers
    -- are converted split and whole)
    local f8_llama = tiny_llama .. ' --model.num_key_value_heads 4'
    local one = reference('models/llama.lua', f8_llama .. ' --float8', 'f8l1')
    local curves = {}
    for _, scales in ipairs({ 'group', 'shard' }) do
      local status, text = bin_train(('--nproc-per-node 2 --device cpu models/llama.lua %s --float8 --float8-tp-scales %s '
        .. '--batch-size 4 --steps 4 --tp 2 --out %s/f8l2%s'):format(f8_llama, scales, q(dir), scales))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('float8: tensorwise, 14 of 15 linear layers, TP scales ' .. scales, 1, true), text)
      curves[scales] = losses(dir .. '/f8l2' .. scales)
    end
    -- the first step's f8 values are the unsplit ones (the loss to f32
    -- rounding); later steps move by the partial sums' order through FP8
    -- rounding
    local function dev(c, k) return math.abs(c[k] - one[k]) / one[k] end
    assert.is_true(dev(curves.group, 1) <= 1e-6, ('step 1: %.9g, one process %.9g'):format(curves.group[1], one[1]))
    local worst_g, worst_s = 0, 0
    for k = 1, 4 do worst_g, worst_s = math.max(worst_g, dev(curves.group, k)), math.max(worst_s, dev(curves.shard, k)) end
    assert.is_true(worst_g <= 1e-3 and worst_s > 3 * worst_g, ('group %g, shard %g'):format(worst_g, worst_s))
    local status, text = bin_train(('models/llama.lua %s --float8 --float8-tp-scales group --steps 1 --out %s/b0'):format(
      tiny_llama, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--float8-tp-scales group needs --float8 and --tp', 1, true), text)
  end)

  it('bad layouts exit 2 and say why', function()
    local status, text = bin_train(('models/gpt2.lua %s --steps 1 --tp 2 --out %s/b1'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--tp 2: the world of 1 rank is not a multiple of it', 1, true), text)
    -- (--tp with HYBRID_SHARD trains: spec/train_tp_hsdp_spec.lua; its
    -- --shard-size counts a TP slice's data-parallel ranks, one here)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --steps 1 --tp 2 --fsdp HYBRID_SHARD '
      .. '--shard-size 2 --out %s/b2'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--tp 2 --fsdp HYBRID_SHARD: --shard-size 2 does not divide the 1 data-parallel rank of a '
      .. 'tensor-parallel slice (the world of 2 over 2 TP ranks; --shard-size counts those ranks: 1)', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --model.n_head 1 --steps 1 --tp 2 '
      .. '--out %s/b3'):format(tiny, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('1 heads and 1 kv heads; both must be multiples of the group size 2', 1, true), text)
  end)
end)
