-- Sharded training in the built-in loop (moonshard.train, docs/train.md
-- "Sharded training"): bin/train --nproc-per-node N --device cpu starts the
-- ranks through mpirun; the loop joins ms.dist, wraps the model with
-- ms.fsdp.fully_shard and gives every rank its own rows of each batch.
-- Checked against one process over the same global batches: the loss
-- curve (within 1e-5 relative), micro-batch accumulation under no_sync,
-- a sharded checkpoint written at 2 ranks resumed at 1 and 3 (and the
-- corrupt newest one skipped) and at 2, bitwise the straight run under
-- every strategy (metrics, weights, moments), the final weights gathered into
-- model.safetensors; plus the pieces in-process: the block class the auto
-- policy picks, the mixed-precision option, the rank-aware byte loader.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local json = require 'dkjson'
local train = require 'moonshard.train'
local data = require 'moonshard.data'

local root = T.root
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

-- the text every run reads: fixed while the spec runs
local corpus_path = S.fixed_corpus(dir, 120000)

-- a model small enough that a step takes milliseconds
local tiny = '--preset tiny --model.n_layer 2 --model.n_embd 32 --model.n_head 2 --seq-len 16 --lr 1e-2 --warmup 1 '
  .. '--eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 2 --data ' .. q(corpus_path)

describe('bin/train with several ranks (FSDP, CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- one process, 4 sequences per step: the reference of the first two specs
  local ref
  local function reference()
    if ref then return ref end
    local status, text = bin_train(('models/gpt2.lua %s --batch-size 4 --steps 4 --out %s/one'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    ref = losses(dir .. '/one')
    return ref
  end

  it('--fsdp FULL_SHARD on 2 ranks follows the one-process loss curve over the same global batches', function()
    local one = reference()
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 2 --steps 4 '
      .. '--fsdp FULL_SHARD --out %s/two'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(dir .. '/two'), 1, 4, '2 ranks')
    -- rank 0 logs (the other ranks only say they are done); the validation is every rank's
    assert.is_truthy(text:find('[rank 0] fsdp: FULL_SHARD over 2 ranks, units GPT2Block (3)', 1, true), text)
    assert.is_truthy(text:find('[rank 0] step 4/4 | loss', 1, true), text)
    assert.is_falsy(text:find('[rank 1] step', 1, true), text)
    assert.is_truthy(text:find('[rank 1] done: 4 steps', 1, true), text)
    local function val_of(out)
      local v
      for line in io.lines(out .. '/metrics.jsonl') do v = json.decode(line).val_loss or v end
      return v
    end
    local v1, v2 = val_of(dir .. '/one'), val_of(dir .. '/two')
    assert.is_true(math.abs(v2 - v1) <= 1e-5 * v1, ('val %.17g, one process %.17g'):format(v2, v1))
    -- the final weights, gathered by rank 0 into model.safetensors: evaluated
    -- in this process on the same validation batches, the loss the ranks
    -- computed with their shards
    local gpt2 = require 'models.gpt2'
    local m = gpt2.from_pretrained(dir .. '/two')
    local corpus = data.corpus{ path = corpus_path, val_fraction = 0.1, min_len = 17 }
    local v = train.evaluate(m, data.Loader(corpus.val, { batch_size = 4, seq_len = 16, seed = 1337 + 1 }), 2)
    assert.is_true(math.abs(v - v2) <= 1e-5 * v2, ('the saved weights give val %.17g, the run %.17g'):format(v, v2))
  end)

  it('--init-from a Hugging Face folder: one process, and FULL_SHARD on 2 ranks with deferred loading; lr 0 saves the folder\'s weights', function()
    local fixture = root .. '/../shared/fixtures/gpt2-tiny'
    if not io.open(fixture .. '/model.safetensors', 'rb') then pending('no gpt2-tiny fixture'); return end
    local want = ms.load_safetensors(fixture .. '/model.safetensors')
    local function same_weights(out)
      local got = ms.load_safetensors(out .. '/model.safetensors')
      local n = 0
      for k, v in pairs(got) do
        local w = want[k] or want[(k:gsub('^transformer%.', ''))]
        assert.is_not_nil(w, k)
        assert.are.equal(0, (v:double() - w:double()):abs():max():item(), k)
        n = n + 1
      end
      assert.is_true(n >= 20)
    end
    local common = ('models/gpt2.lua --init-from %s --steps 1 --lr 0 --seq-len 16 --eval-every 0 --sample-tokens 0 '
      .. '--data %s'):format(q(fixture), q(corpus_path))
    local status, text = bin_train(('%s --batch-size 4 --out %s/init1'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('from ' .. fixture, 1, true), text)
    same_weights(dir .. '/init1')
    status, text = bin_train(('--nproc-per-node 2 --device cpu %s --batch-size 2 --fsdp FULL_SHARD --out %s/init2'):format(
      common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('deferred init', 1, true), text)
    same_weights(dir .. '/init2')
    -- the same first loss as the one process (the same global batch)
    local l1, l2 = losses(dir .. '/init1'), losses(dir .. '/init2')
    assert.is_true(math.abs(l2[1] - l1[1]) <= 1e-5 * l1[1], ('%.17g against %.17g'):format(l2[1], l1[1]))
    status, text = bin_train(('%s --model.n_layer 3 --out %s/init3'):format(common, q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('drop the --model.* options', 1, true), text)
  end)

  it('--freeze on 2 ranks under FULL_SHARD: the frozen tensors come out as loaded, a stopped run resumes with the same losses', function()
    local fixture = root .. '/../shared/fixtures/gpt2-tiny'
    if not io.open(fixture .. '/model.safetensors', 'rb') then pending('no gpt2-tiny fixture'); return end
    local want = ms.load_safetensors(fixture .. '/model.safetensors')
    local common = ('--nproc-per-node 2 --device cpu models/gpt2.lua --init-from %s --freeze wte,ln_f --steps 4 '
      .. '--seq-len 16 --batch-size 2 --log-every 1 --eval-every 0 --sample-tokens 0 --fsdp FULL_SHARD --data %s'):format(
      q(fixture), q(corpus_path))
    local status, text = bin_train(('%s --out %s/fz'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('frozen: 3 tensors', 1, true), text)
    local got = ms.load_safetensors(dir .. '/fz/model.safetensors')
    for k, v in pairs(got) do
      local w = want[k] or want[(k:gsub('^transformer%.', ''))]
      local d = (v:double() - w:double()):abs():max():item()
      if k:find('wte', 1, true) or k:find('ln_f', 1, true) then assert.are.equal(0, d, k)
      else assert.is_true(d > 0, k .. ' did not train') end
    end
    status, text = bin_train(('%s --stop-at 2 --out %s/fz2'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s/fz2'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(losses(dir .. '/fz'), losses(dir .. '/fz2'), 1, 4, 'resumed with frozen tensors')
    -- the sharded checkpoint as a Hugging Face folder, in one process: a
    -- resume with nothing left to train saves the weights (docs/train.md)
    status, text = bin_train(('--resume %s/fz2/ckpt-2 --steps 2 --out %s/fzx'):format(q(dir), q(dir)))
    assert.are.equal(0, status, text)
    local m = require('models.gpt2').from_pretrained(dir .. '/fzx')
    local wte = want['wte.weight'] or want['transformer.wte.weight']
    assert.are.equal(0, ms.no_grad(function() return (m.transformer.wte.weight - wte):abs():max():item() end))
    status, text = bin_train(('models/gpt2.lua --freeze nosuchparam --steps 1 --out %s/fz3'):format(q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('the pattern nosuchparam matches no parameter', 1, true), text)
  end)

  it('--lora: one process and FULL_SHARD on 2 ranks train alike, resume, and save a plain folder with only the adapted weights changed', function()
    local fixture = root .. '/../shared/fixtures/gpt2-tiny'
    if not io.open(fixture .. '/model.safetensors', 'rb') then pending('no gpt2-tiny fixture'); return end
    local want = ms.load_safetensors(fixture .. '/model.safetensors')
    local common = ('models/gpt2.lua --init-from %s --lora 4 --lora-alpha 8 --steps 4 --seq-len 16 --lr 1e-2 '
      .. '--log-every 1 --eval-every 0 --sample-tokens 0 --data %s'):format(q(fixture), q(corpus_path))
    local status, text = bin_train(('%s --batch-size 4 --out %s/lo1'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('lora: rank 4, alpha 8, 8 modules', 1, true), text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu %s --batch-size 2 --fsdp FULL_SHARD --out %s/lo2'):format(
      common, q(dir)))
    assert.are.equal(0, status, text)
    close_losses(losses(dir .. '/lo1'), losses(dir .. '/lo2'), 1, 4, 'LoRA on 2 ranks')
    status, text = bin_train(('--nproc-per-node 2 --device cpu %s --batch-size 2 --fsdp FULL_SHARD --stop-at 2 --out %s/lo3'):format(
      common, q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s/lo3'):format(q(dir)))
    assert.are.equal(0, status, text)
    close_losses(losses(dir .. '/lo2'), losses(dir .. '/lo3'), 1, 4, 'LoRA resumed')
    for _, run in ipairs({ 'lo1', 'lo2', 'lo3' }) do
      local m = require('models.gpt2').from_pretrained(dir .. '/' .. run)   -- strict: no lora_ tensors in it
      local changed = 0
      for k, v in pairs(m:state_dict()) do
        local w = want[k] or want[(k:gsub('^transformer%.', ''))]
        local d = ms.no_grad(function() return (v:double() - w:double()):abs():max():item() end)
        if d > 0 then
          changed = changed + 1
          assert.is_truthy(k:match('c_attn%.weight$') or k:match('c_proj%.weight$') or k:match('c_fc%.weight$'), run .. ' ' .. k)
        end
      end
      assert.are.equal(8, changed, run)
    end
  end)

  it('--float8 --float8-all-gather on 2 ranks: the losses of bf16 gathers, exactly, and a checkpoint resumes with them', function()
    local f8 = ('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 2 --fsdp FULL_SHARD '
      .. '--fsdp-mixed-precision bf16 --float8 '):format(tiny)
    local status, text = bin_train(f8 .. ('--steps 4 --out %s/f8'):format(q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(f8 .. ('--float8-all-gather --steps 4 --out %s/f8g'):format(q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('float8 all-gathers', 1, true), text)
    local a, b = losses(dir .. '/f8'), losses(dir .. '/f8g')
    for k = 1, 4 do assert.are.equal(a[k], b[k], 'step ' .. k) end
    -- stopped after step 2 with a checkpoint, resumed: the same steps 3 and 4
    status, text = bin_train(f8 .. ('--float8-all-gather --steps 2 --save-every 2 --out %s/f8r'):format(q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(f8 .. ('--float8-all-gather --steps 4 --resume --out %s/f8r'):format(q(dir)))
    assert.are.equal(0, status, text)
    local c = losses(dir .. '/f8r')
    for k = 3, 4 do assert.are.equal(b[k], c[k], 'resumed step ' .. k) end
  end)

  it('--float8 blockwise --float8-all-gather on 2 ranks: the losses of bf16 gathers, exactly, and a checkpoint resumes with them', function()
    -- (a tiny Llama whose MLP is 128 wide: 20 of its 29 linear layers blockwise)
    local f8 = ('--nproc-per-node 2 --device cpu models/llama.lua --model.intermediate_size 256 --batch-size 2 '
      .. '--seq-len 64 --eval-every 0 --sample-tokens 0 --log-every 1 --fsdp FULL_SHARD --fsdp-mixed-precision bf16 '
      .. '--float8 blockwise --lr-schedule constant --warmup 1 --data ' .. q(corpus_path) .. ' ')
    local status, text = bin_train(f8 .. ('--steps 4 --out %s/b8'):format(q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('float8: blockwise, 20 of 29 linear layers', 1, true), text)
    status, text = bin_train(f8 .. ('--float8-all-gather --steps 4 --out %s/b8g'):format(q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('float8 all-gathers', 1, true), text)
    local a, b = losses(dir .. '/b8'), losses(dir .. '/b8g')
    for k = 1, 4 do assert.are.equal(a[k], b[k], 'step ' .. k) end
    status, text = bin_train(f8 .. ('--float8-all-gather --steps 2 --save-every 2 --out %s/b8r'):format(q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(f8 .. ('--float8-all-gather --steps 4 --resume --out %s/b8r'):format(q(dir)))
    assert.are.equal(0, status, text)
    local c = losses(dir .. '/b8r')
    for k = 3, 4 do assert.are.equal(b[k], c[k], 'resumed step ' .. k) end
  end)

  it('accumulates micro-batches under no_sync to the big batch (2 ranks x 2 micro-batches of 1 = 4)', function()
    local one = reference()
    local status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 1 --tokens-per-step 64 '
      .. '--steps 4 --fsdp SHARD_GRAD_OP --no-save --out %s/accum'):format(tiny, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('64 tokens (2 ranks x 1 x 16 x 2 micro-batches)', 1, true), text)
    close_losses(one, losses(dir .. '/accum'), 1, 4, 'accumulation')
  end)

  it('a checkpoint saved at 2 ranks resumes at 1 and at 3 ranks with the same losses; the last K kept; a corrupt one skipped', function()
    -- 6 sequences per step: 2 ranks x 3 micro-batches, 3 x 2, 1 x 6
    local common = ('models/gpt2.lua %s --batch-size 1 --tokens-per-step 96 --steps 6 --no-save'):format(tiny)
    local status, text = bin_train(('%s --out %s/straight'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    local straight = losses(dir .. '/straight')
    status, text = bin_train(('--nproc-per-node 2 --device cpu %s --fsdp FULL_SHARD --save-every 1 --keep-checkpoints 2 '
      .. '--stop-at 3 --out %s/saved'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('stopped by --stop-at 3 after step 3/6', 1, true), text)
    close_losses(straight, losses(dir .. '/saved'), 1, 3, 'before the save')
    -- the run's layout: the newest 2 of ckpt-1..3, each a sharded checkpoint with state and manifest
    local p = io.popen('ls ' .. q(dir .. '/saved'))
    local names = p:read('*a')
    p:close()
    assert.are.equal('ckpt-2\nckpt-3\nmetrics.jsonl\nrun.json\n', names)
    local ck = dir .. '/saved/ckpt-3'
    for _, f in ipairs({ 'index.json', 'state.json', 'manifest.json', 'rank-00000-of-00002.safetensors',
                         'rank-00001-of-00002.safetensors' }) do
      assert.is_truthy(io.open(ck .. '/' .. f), ck .. '/' .. f)
    end
    assert.is_true(train.verify_checkpoint(ck))
    local st = json.decode(assert(io.open(ck .. '/state.json')):read('*a'))
    assert.are.equal(3, st.step)
    assert.are.equal(2, st.world_size)
    assert.are.equal(96, st.tokens_per_step)
    assert.are.equal(3 * 6, st.data.rows)

    for _, np in ipairs({ 1, 3 }) do
      local out = ('%s/at%d'):format(dir, np)
      os.execute(('cp -r %s %s'):format(q(dir .. '/saved'), q(out)))
      local launcher = np > 1 and ('--nproc-per-node %d --device cpu '):format(np) or ''
      status, text = bin_train(('%s--resume %s'):format(launcher, q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('resumed from ' .. out .. '/ckpt-3 at step 3', 1, true), text)
      close_losses(straight, losses(out), 1, 6, ('resumed at %d rank(s)'):format(np))
    end

    -- a flipped byte in a rank file of the newest: reported, the previous one used
    local out = dir .. '/corrupt'
    os.execute(('cp -r %s %s'):format(q(dir .. '/saved'), q(out)))
    local path = out .. '/ckpt-3/rank-00001-of-00002.safetensors'
    local f = assert(io.open(path, 'r+b'))
    local size = f:seek('end')
    f:seek('set', size - 5)
    local c = f:read(1)
    f:seek('set', size - 5)
    f:write(string.char((c:byte() + 1) % 256))
    f:close()
    status, text = bin_train(('--resume %s'):format(q(out)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('checkpoint ' .. out .. '/ckpt-3 is corrupt: ' .. path .. ': checksum mismatch', 1, true), text)
    assert.is_truthy(text:find('at step 2', 1, true), text)
    close_losses(straight, losses(out), 1, 6, 'resumed from the previous checkpoint')
  end)

  it('--async-checkpoint on 2 ranks (FULL_SHARD): the sharded checkpoints of the synchronous run, written in the '
    .. 'background; a stopped run resumes from them with the same losses', function()
    local common = ('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 2 --steps 6 --fsdp FULL_SHARD '
      .. '--save-every 2 --keep-checkpoints 0 --no-save'):format(tiny)
    local text = S.sync_and_async(common, dir .. '/sync', dir .. '/async')
    assert.is_truthy(text:find('[rank 0] checkpoint ' .. dir .. '/async/ckpt-2: staged in', 1, true), text)
    assert.is_truthy(text:find('[rank 0] checkpoint ' .. dir .. '/async/ckpt-2 (written in the background in', 1, true), text)
    close_losses(losses(dir .. '/sync'), losses(dir .. '/async'), 1, 6, 'the same run')
    for _, c in ipairs({ 'ckpt-2', 'ckpt-4', 'ckpt-6' }) do
      local ck = dir .. '/async/' .. c
      assert.is_true(train.verify_checkpoint(ck), ck)
      for r = 0, 1 do
        local f = ('/rank-%05d-of-00002.safetensors'):format(r)
        assert.is_true(S.same_tensors(dir .. '/sync/' .. c .. f, ck .. f) > 3)
      end
      -- (byte for byte: the rank files' descriptions have sorted keys, so
      -- the index's CRCs agree too; spec/train_async_ckpt_spec.lua does the
      -- same under --tp, --pp and --ep)
      S.same_files(dir .. '/sync/' .. c, ck, { 'rank-00000-of-00002.safetensors', 'rank-00001-of-00002.safetensors',
        'index.json' })
    end
    -- stopped at step 4 (its save in the background completes first), resumed: the rest of the curve
    local status
    status, text = bin_train(('%s --async-checkpoint --stop-at 4 --out %s/stopped'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('stopped by --stop-at 4 after step 4/6: checkpoint ' .. dir .. '/stopped/ckpt-4', 1, true),
      text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s'):format(q(dir .. '/stopped')))
    assert.are.equal(0, status, text)
    close_losses(losses(dir .. '/sync'), losses(dir .. '/stopped'), 1, 6, 'resumed from a background save')
  end)

  it('a 2-rank run stopped and resumed at the same layout is bitwise the straight one (losses, grad norms, lr, '
    .. 'final weights and optimizer state): NO_SHARD with and without overlap, FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD',
    function()
    -- every field of metrics.jsonl but the timings, step -> { field -> value }
    -- (the file writes %.17g: a decoded number is the bits the run had)
    local function metrics(out)
      local rows = {}
      for line in io.lines(out .. '/metrics.jsonl') do
        local obj = assert(json.decode(line), line)
        obj.elapsed_s, obj.tokens_per_s = nil, nil
        rows[obj.step] = obj
      end
      return rows
    end
    local common = ('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 2 --steps 6 --log-every 1 '
      .. '--save-every 3 --keep-checkpoints 0'):format(tiny)
    local rank_files = { 'rank-00000-of-00002.safetensors', 'rank-00001-of-00002.safetensors' }
    for _, layout in ipairs({ '', '--no-overlap-grad-reduce', '--fsdp FULL_SHARD', '--fsdp SHARD_GRAD_OP',
                              '--fsdp HYBRID_SHARD --shard-size 1' }) do
      local what = layout == '' and 'NO_SHARD' or layout
      local a, b = dir .. '/bs', dir .. '/bs-resumed'
      os.execute('rm -rf ' .. q(a) .. ' ' .. q(b))
      local status, text = bin_train(('%s %s --out %s'):format(common, layout, q(a)))
      assert.are.equal(0, status, text)
      status, text = bin_train(('%s %s --stop-at 3 --out %s'):format(common, layout, q(b)))
      assert.are.equal(0, status, text)
      status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s'):format(q(b)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('resumed from ' .. b .. '/ckpt-3 at step 3', 1, true), text)
      local ra, rb = metrics(a), metrics(b)
      for step = 1, 6 do
        assert.is_table(ra[step], what .. ': straight step ' .. step)
        assert.is_table(rb[step], what .. ': resumed step ' .. step)
        for _, k in ipairs({ 'loss', 'grad_norm', 'lr' }) do
          assert.is_number(ra[step][k], ('%s: step %d has no %s'):format(what, step, k))
          assert.is_true(ra[step][k] == rb[step][k], ('%s: step %d %s: resumed %.17g, straight %.17g'):format(what, step,
            k, rb[step][k] or 0 / 0, ra[step][k]))
        end
        for k, v in pairs(rb[step]) do
          assert.are.same(ra[step][k], v, ('%s: step %d %s'):format(what, step, k))
        end
      end
      assert.is_number(ra[6].val_loss, what)
      -- the final weights, and the last checkpoint's rank files (the
      -- shards or replicas of the weights and of AdamW's moments) byte for byte
      S.same_files(a, b, { 'model.safetensors' })
      S.same_files(a .. '/ckpt-6', b .. '/ckpt-6', rank_files)
    end
  end)

  it('a HYBRID_SHARD checkpoint of 2 ranks resumes in one process without a launcher', function()
    local common = ('models/gpt2.lua %s --batch-size 1 --tokens-per-step 32 --steps 4 --no-save'):format(tiny)
    local status, text = bin_train(('%s --out %s/hstraight'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu %s --fsdp HYBRID_SHARD --shard-size 1 --save-every 2 '
      .. '--stop-at 2 --out %s/hsaved'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--resume %s'):format(q(dir .. '/hsaved')))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('resumed from ' .. dir .. '/hsaved/ckpt-2 at step 2', 1, true), text)
    close_losses(losses(dir .. '/hstraight'), losses(dir .. '/hsaved'), 1, 4, 'HYBRID_SHARD resumed in one process')
  end)

  it('--max-restarts: a rank that dies restarts with the others from the newest checkpoint, with the same losses', function()
    local one = reference()
    -- GPT-2 whose rank 1 dies at its 4th forward in the first attempt only
    local model = require('spec.support').write_dying_model(dir .. '/dies.lua', 1, 4, 9)
    local status, text = bin_train(('--nproc-per-node 2 --device cpu --max-restarts 2 %s %s --batch-size 2 --steps 4 '
      .. '--fsdp FULL_SHARD --save-every 2 --out %s/restarted'):format(q(model), tiny, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('rank 1 dies at forward 4', 1, true), text)
    assert.is_truthy(text:find('bin/train: restarting every rank (restart 1 of 2)', 1, true), text)
    assert.is_falsy(text:find('restart 2 of 2', 1, true), text)
    assert.is_truthy(text:find('restart 1: resuming from the newest checkpoint in ' .. dir .. '/restarted', 1, true), text)
    assert.is_truthy(text:find('resumed from ' .. dir .. '/restarted/ckpt-2 at step 2', 1, true), text)
    close_losses(one, losses(dir .. '/restarted'), 1, 4, 'restarted')
  end)

  it('stops every rank after the same step on SIGINT, with a complete sharded checkpoint that resumes', function()
    local out = dir .. '/sigint'
    os.execute(('cd %s && ( luajit bin/train --nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 1 --fsdp '
      .. '--steps 100000 --log-every 1 --no-save --out %s > %s 2>&1 & echo $! > %s; wait $!; echo $? > %s ) > /dev/null 2>&1 &')
      :format(q(root), tiny, q(out), q(dir .. '/sigint.log'), q(dir .. '/sigint.pid'), q(dir .. '/sigint.status')))
    local function slurp(p)
      local f = io.open(p, 'rb')
      if not f then return nil end
      local s = f:read('*a')
      f:close()
      return s
    end
    local function wait_for(pred, what)
      for _ = 1, 600 do
        if pred() then return end
        os.execute('sleep 0.05')
      end
      error('timed out waiting for ' .. what .. '; log: ' .. tostring(slurp(dir .. '/sigint.log')))
    end
    wait_for(function() return (slurp(dir .. '/sigint.log') or ''):find('step%s+3/100000') end, 'the third progress line')
    local pid = tonumber(slurp(dir .. '/sigint.pid'))
    assert.is_number(pid)
    os.execute('kill -INT ' .. pid)   -- the launcher forwards it to every rank
    wait_for(function() return (slurp(dir .. '/sigint.status') or ''):match('%d') end, 'the exit status')
    local log = slurp(dir .. '/sigint.log')
    assert.are.equal(130, tonumber(slurp(dir .. '/sigint.status')), log)   -- (the launcher's status after a signal)
    local k = tonumber(log:match('%[rank 0%] stopped by SIGINT after step (%d+)/100000'))
    assert.is_number(k, log)
    assert.is_falsy(log:find('failed', 1, true), log)
    local ck = ('%s/ckpt-%d'):format(out, k)
    assert.is_true(train.verify_checkpoint(ck))
    assert.are.equal(k, json.decode(assert(io.open(ck .. '/state.json')):read('*a')).step)
    local l = losses(out)
    assert.is_number(l[k])
    assert.is_nil(l[k + 1])
    local status, text = bin_train(('--resume %s --steps %d'):format(q(out), k + 2))
    assert.are.equal(0, status, text)
    assert.is_number(losses(out)[k + 2], text)
  end)

  it('plain data parallel on 2 ranks: --no-overlap-grad-reduce (the all-reduce after the whole backward, as '
    .. '--cuda-graphs runs it) gives the bits of the overlapped default: losses, norms, skips, final weights', function()
    -- 2 micro-batches a rank, clipping that acts, a NaN step skipped (the
    -- --cuda-graphs step's halves: local_grads under no_sync, then
    -- fsdp.reduce_grads and the clipping)
    local common = ('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 1 --tokens-per-step 64 --steps 5 '
      .. '--grad-clip 0.5 --inject-nan 3'):format(tiny)
    local status, text = bin_train(('%s --out %s/dp_overlap'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('training data-parallel (NO_SHARD)', 1, true) or text:find('NO_SHARD over 2 ranks', 1,
      true), text)
    assert.is_falsy(text:find('all-reduced after the backward', 1, true), text)
    status, text = bin_train(('%s --no-overlap-grad-reduce --out %s/dp_after'):format(common, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('NO_SHARD over 2 ranks, units GPT2Block (3), no mixed precision, gradients all-reduced '
      .. 'after the backward', 1, true), text)
    local a, b = losses(dir .. '/dp_overlap'), losses(dir .. '/dp_after')
    local ga, gb = S.run_grad_norms(dir .. '/dp_overlap'), S.run_grad_norms(dir .. '/dp_after')
    for k = 1, 5 do
      if k == 3 then
        assert.is_nil(a[k]); assert.is_nil(b[k])   -- (the NaN step: skipped by both)
      else
        assert.is_number(a[k], 'step ' .. k)
        assert.are.equal(a[k], b[k], 'loss of step ' .. k)
        assert.are.equal(ga[k], gb[k], 'grad norm of step ' .. k)
      end
    end
    assert.is_true(ga[1] > 0.5, tostring(ga[1]))   -- (the clipping acts)
    assert.is_true(S.same_tensors(dir .. '/dp_overlap/model.safetensors', dir .. '/dp_after/model.safetensors') > 0)
    -- not for the sharding strategies
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/gpt2.lua %s --batch-size 1 --steps 1 --fsdp '
      .. 'FULL_SHARD --no-overlap-grad-reduce --no-save'):format(tiny))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--no-overlap-grad-reduce: for plain data parallel', 1, true), text)
    assert.is_truthy(text:find('got --fsdp FULL_SHARD', 1, true), text)
  end)

  it('refuses a bad --fsdp, --fsdp-policy or --fsdp-mixed-precision with exit status 2', function()
    for _, c in ipairs({
      { 'models/gpt2.lua --fsdp HALF_SHARD --steps 1', 'fsdp must be FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or off' },
      { 'models/gpt2.lua --fsdp --fsdp-policy NoSuchBlock --steps 1', 'the model has no module of class NoSuchBlock' },
      { 'models/gpt2.lua --fsdp-policy size:x --steps 1', 'size:N needs a number' },
      { 'models/gpt2.lua --fsdp-mixed-precision bf17 --steps 1', 'fsdp_mixed_precision: expected PARAM/REDUCE' },
    }) do
      local status, text = bin_train(c[1])
      assert.are.equal(2, status, c[1] .. ': ' .. text)
      assert.is_truthy(text:find(c[2], 1, true), ('%s: expected "%s" in: %s'):format(c[1], c[2], text))
    end
  end)
end)

describe('moonshard.train FSDP pieces', function()
  it('finds the block class of a model: GPT2Block, LlamaDecoderLayer, also at one layer', function()
    local gpt2, llama = require 'models.gpt2', require 'models.llama'
    for _, c in ipairs({
      { gpt2, { n_layer = 2, n_embd = 32, n_head = 2 }, 'GPT2Block' },
      { gpt2, { n_layer = 1, n_embd = 32, n_head = 2 }, 'GPT2Block' },
      { llama, { num_hidden_layers = 1, hidden_size = 32, intermediate_size = 64 }, 'LlamaDecoderLayer' },
    }) do
      local m = c[1].new('tiny', c[2])
      assert.are.equal(c[3], train.block_class(c[1], m))
    end
    -- a model file that names its block wins
    local m = gpt2.new('tiny', { n_layer = 1, n_embd = 32, n_head = 2 })
    assert.are.equal('LayerNorm', train.block_class({ fsdp_block = 'LayerNorm' }, m))
    assert.are.equal('GPT2Block', train.block_class({ fsdp_block = gpt2.Block }, m))
    local policy, desc = train.fsdp_policy(gpt2, m, 'auto')
    assert.are.equal('GPT2Block', desc)
    assert.is_true(policy(m.transformer.h[1]))
    assert.is_false(policy(m.transformer))
  end)

  it('reads --fsdp-mixed-precision: auto is bf16/f32 on CUDA and none on the CPU', function()
    assert.is_nil(train.mixed_precision('auto', 'cpu'))
    assert.are.same({ param = 'bf16', reduce = 'f32' }, train.mixed_precision('auto', 'cuda'))
    assert.are.same({ param = 'bf16', reduce = 'bf16' }, train.mixed_precision('bf16/bf16', 'cpu'))
    assert.are.same({ param = 'bf16', reduce = 'f32' }, train.mixed_precision('bf16', 'cpu'))
    assert.is_nil(train.mixed_precision('none', 'cuda'))
    assert.has_error(function() train.mixed_precision('bf16/i8') end)
    local o = train.parse_args({ '--fsdp', '--shard-size', '2' })
    assert.are.equal('FULL_SHARD', o.fsdp)
    o = train.check_options(train.parse_args({ '--fsdp', 'hybrid-shard' }))
    assert.are.equal('HYBRID_SHARD', o.fsdp)
  end)

  it('gives rank r of W its rows of the big batch, and a position resumes at another world size', function()
    local corpus = data.corpus{ text = ('the quick brown fox jumps over the lazy dog. '):rep(40), val_fraction = 0 }
    local one = data.Loader(corpus.train, { batch_size = 6, seq_len = 8, seed = 3 })
    local x1 = one:batch(2):totable()
    for _, W in ipairs({ 2, 3 }) do
      for r = 0, W - 1 do
        local l = data.Loader(corpus.train, { batch_size = 6 / W, seq_len = 8, seed = 3, rank = r, world_size = W })
        local x = l:batch(2):totable()
        for b = 1, 6 / W do assert.are.same(x1[r * 6 / W + b], x[b]) end
      end
    end
    -- without rank/world_size: the loader as before (batch k is rows k*B ..)
    local l4 = data.Loader(corpus.train, { batch_size = 3, seq_len = 8, seed = 3 })
    assert.are.same({ x1[4], x1[5], x1[6] }, l4:batch(5):totable())
    -- 2 steps of 2 ranks x 3 rows = 12 rows; at 3 ranks x 2 rows that is step 2; at 1 x 4, step 3
    local a = data.Loader(corpus.train, { batch_size = 3, seq_len = 8, seed = 3, rank = 1, world_size = 2 })
    a:next(); a:next()
    local s = a:state()
    assert.are.equal(12, s.rows)
    local b = data.Loader(corpus.train, { batch_size = 2, seq_len = 8, seed = 3, rank = 0, world_size = 3 })
    b:set_state(s)
    assert.are.equal(2, b.step)
    local c = data.Loader(corpus.train, { batch_size = 4, seq_len = 8, seed = 3 })
    c:set_state(s)
    assert.are.equal(3, c.step)
    local d = data.Loader(corpus.train, { batch_size = 5, seq_len = 8, seed = 3 })
    assert.has_error(function() d:set_state(s) end)
    assert.has_error(function() data.Loader(corpus.train, { rank = 2, world_size = 2 }) end)
  end)
end)
