-- bin/train on a GPU: the run folder keeps the GEMM tuning file, and a
-- resumed run takes its choices from it (nothing appended: no plan timed
-- again) and goes on. Run on a GPU host: `make test-gpu`.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'

local root = T.root
local S_ = require 'spec.support'
local q, tmpdir = S_.shell_quote, S_.tmpdir
local bin_train, losses = S_.bin_train, S_.run_losses
local function lines(path)
  local f = io.open(path)
  if not f then return nil end
  local n = 0
  for l in f:lines() do
    assert(l:match('^ms%-gemm%-tune 1 %d+ %S+'), path .. ': ' .. l)
    n = n + 1
  end
  f:close()
  return n
end

local small = '--preset tiny --model.n_layer 2 --model.n_embd 128 --model.n_head 4 --seq-len 64 --batch-size 8'

describe('bin/train on cuda #gpu', function()
  setup(function() assert.is_true(ms.cuda.is_available(), 'no CUDA device') end)

  it('keeps gemm_tune.txt in the run folder and takes the choices from it on resume', function()
    local out = tmpdir()
    local st, text = bin_train(('models/gpt2.lua %s --device cuda --steps 4 --save-every 4 --log-every 2 '
      .. '--sample-tokens 0 --out %s'):format(small, q(out)), 'MS_GEMM_TUNE_FILE= MS_GEMM_TUNE=1')
    assert.are.equal(0, st, text)
    local n = lines(out .. '/gemm_tune.txt')
    assert.is_truthy(n, 'no gemm_tune.txt in ' .. out)
    assert.is_true(n >= 1, 'no plan recorded')
    st, text = bin_train(('--resume %s --steps 6 --sample-tokens 0'):format(q(out)), 'MS_GEMM_TUNE_FILE= MS_GEMM_TUNE=1')
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('done:', 1, true), text)
    assert.are.equal(n, lines(out .. '/gemm_tune.txt'), 'plans timed again on resume')
    -- tuning off: no file
    local out2 = tmpdir()
    st, text = bin_train(('models/gpt2.lua %s --device cuda --steps 2 --sample-tokens 0 --out %s'):format(small, q(out2)),
      'MS_GEMM_TUNE=0')
    assert.are.equal(0, st, text)
    assert.is_nil(lines(out2 .. '/gemm_tune.txt'))
    os.execute('rm -rf ' .. q(out) .. ' ' .. q(out2))
  end)
end)

describe('bin/train --async-checkpoint on cuda #gpu', function()
  setup(function() assert.is_true(ms.cuda.is_available(), 'no CUDA device') end)

  it('stages into page-locked memory: the checkpoints of the synchronous run, byte for byte; resumes from them', function()
    local a, b = tmpdir(), tmpdir()
    local common = ('models/gpt2.lua %s --device cuda --steps 6 --save-every 2 --keep-checkpoints 0 --log-every 2 '
      .. '--sample-tokens 0 --no-save'):format(small)
    -- (GEMM tuning off: each run would time its own plans and may pick others, with other bits)
    local text = S_.sync_and_async(common, a, b, 'MS_GEMM_TUNE=0')
    assert.is_truthy(text:find('checkpoint ' .. b .. '/ckpt-4 (written in the background in', 1, true), text)
    for _, c in ipairs({ 'ckpt-2', 'ckpt-4', 'ckpt-6' }) do
      assert.is_true(require('moonshard.checkpoint').verify(b .. '/' .. c))
      S_.same_files(a .. '/' .. c, b .. '/' .. c, { 'model.safetensors', 'optimizer.safetensors', 'optimizer.json' })
    end
    os.execute('rm -rf ' .. q(b .. '/ckpt-6'))
    local st
    st, text = bin_train(('--resume %s'):format(q(b .. '/ckpt-4')), 'MS_GEMM_TUNE=0')
    assert.are.equal(0, st, text)
    local la, lb = losses(a), losses(b)
    assert.are.equal(6, #lb)
    for i = 5, 6 do assert.is_true(math.abs(la[i] - lb[i]) <= 1e-6 * math.abs(la[i]), i .. ': ' .. la[i] .. ' vs ' .. lb[i]) end
    os.execute('rm -rf ' .. q(a) .. ' ' .. q(b))
  end)
end)

-- two GPUs: NCCL's unique id goes through the launcher's store, and a
-- restarted attempt must not read the failed one's (the r1/ prefix)
describe('bin/train --max-restarts on two GPUs #gpu', function()
  it('restarts NCCL ranks after a failure; FSDP resumes from the checkpoint', function()
    if ms.cuda.device_count() < 2 then
      pending('needs two GPUs (' .. ms.cuda.device_count() .. ' here)')
      return
    end
    local dir = tmpdir()
    local script = dir .. '/nccl_restart.lua'
    local f = assert(io.open(script, 'w'))
    f:write([[
      local ms = require 'moonshard'
      local dist = require 'moonshard.dist'
      dist.init { backend = 'nccl' }
      local t = ms.full({ 1000 }, dist.rank() + 1, { device = 'cuda' })
      dist.all_reduce(t, 'sum')
      print(('attempt %s sum %g'):format(os.getenv('MS_RESTART_COUNT'), t:float():cpu():totable()[1000]))
      io.stdout:flush()
      if os.getenv('MS_RESTART_COUNT') == '0' and dist.rank() == 1 then os.exit(7) end
      dist.destroy()
    ]])
    f:close()
    local st, text = bin_train(('--nproc-per-node 2 --device cuda --max-restarts 1 %s'):format(q(script)))
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('[rank 1] attempt 0 sum 3', 1, true), text)
    assert.is_truthy(text:find('restarting every rank (restart 1 of 1)', 1, true), text)
    assert.is_truthy(text:find('[rank 0] attempt 1 sum 3', 1, true), text)
    assert.is_truthy(text:find('[rank 1] attempt 1 sum 3', 1, true), text)

    -- the built-in loop under FSDP: rank 1 dies at its 3rd forward the first time
    local model = S_.write_dying_model(dir .. '/dies.lua', 1, 3, 9)
    st, text = bin_train(('--nproc-per-node 2 --device cuda --max-restarts 1 %s %s --steps 4 --save-every 2 '
      .. '--fsdp FULL_SHARD --log-every 1 --eval-every 0 --sample-tokens 0 --out %s/run'):format(q(model), small, q(dir)))
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('resumed from ' .. dir .. '/run/ckpt-2 at step 2', 1, true), text)
    assert.is_truthy(text:find('[rank 0] checkpoint ' .. dir .. '/run/ckpt-2', 1, true), text)
    assert.is_truthy(text:find('[rank 0] step 4/4', 1, true), text)
    assert.is_truthy(text:find('[rank 1] done: 2 steps', 1, true), text)   -- the steps after the resume
    os.execute('rm -rf ' .. q(dir))
  end)
end)

describe('bin/train --async-checkpoint on two GPUs #gpu', function()
  it('FULL_SHARD: each rank stages its shard in page-locked memory; the sharded checkpoints of the synchronous run '
    .. '(tensors, index); a stopped run resumes from them', function()
    if ms.cuda.device_count() < 2 then
      pending('needs two GPUs (' .. ms.cuda.device_count() .. ' here)')
      return
    end
    local json = require 'dkjson'
    local dir = tmpdir()
    local common = ('--nproc-per-node 2 --device cuda models/gpt2.lua %s --steps 6 --save-every 2 --keep-checkpoints 0 '
      .. '--log-every 1 --eval-every 0 --sample-tokens 0 --no-save --fsdp FULL_SHARD'):format(small)
    local text = S_.sync_and_async(common, dir .. '/sync', dir .. '/async', 'MS_GEMM_TUNE=0')
    assert.is_truthy(text:find('[rank 0] checkpoint ' .. dir .. '/async/ckpt-4 (written in the background in', 1, true), text)
    local train = require 'moonshard.train'
    for _, c in ipairs({ 'ckpt-2', 'ckpt-4', 'ckpt-6' }) do
      assert.is_true(train.verify_checkpoint(dir .. '/async/' .. c), c)
      for r = 0, 1 do
        local f = ('/rank-%05d-of-00002.safetensors'):format(r)
        S_.same_tensors(dir .. '/sync/' .. c .. f, dir .. '/async/' .. c .. f)
      end
      local ia = json.decode(assert(io.open(dir .. '/sync/' .. c .. '/index.json')):read('*a'))
      local ib = json.decode(assert(io.open(dir .. '/async/' .. c .. '/index.json')):read('*a'))
      assert.are.same(ia.pieces, ib.pieces)
    end
    local st
    st, text = bin_train(('%s --async-checkpoint --stop-at 4 --out %s/stopped'):format(common, q(dir)), 'MS_GEMM_TUNE=0')
    assert.are.equal(0, st, text)
    st, text = bin_train(('--nproc-per-node 2 --device cuda --resume %s'):format(q(dir .. '/stopped')), 'MS_GEMM_TUNE=0')
    assert.are.equal(0, st, text)
    local la, lb = losses(dir .. '/sync'), losses(dir .. '/stopped')
    for i = 1, 6 do
      assert.is_true(math.abs(la[i] - lb[i]) <= 1e-6 * math.abs(la[i]), i .. ': ' .. la[i] .. ' vs ' .. lb[i])
    end
    os.execute('rm -rf ' .. q(dir))
  end)
end)

-- every sharding strategy of bin/train's loop on two GPUs: 4 steps straight,
-- then stopped at 2 with a checkpoint and resumed at two GPUs and at one;
-- the losses of the resumed runs follow the straight run's (NCCL's
-- reductions round like the straight run's at two GPUs: bit-exact is not
-- asked across world sizes)
describe('bin/train strategies with checkpoints on two GPUs #gpu', function()
  for _, strat in ipairs({ 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD --shard-size 1' }) do
    it(('%s: stop at step 2, resume at two GPUs and at one'):format(strat), function()
      if ms.cuda.device_count() < 2 then
        pending('needs two GPUs (' .. ms.cuda.device_count() .. ' here)')
        return
      end
      local dir = tmpdir()
      local common = ('models/gpt2.lua %s --device cuda --steps 4 --log-every 1 --eval-every 0 --sample-tokens 0 '
        .. '--fsdp %s'):format(small, strat)
      local st, text = bin_train(('--nproc-per-node 2 --device cuda %s --no-save --out %s/straight'):format(common, q(dir)))
      assert.are.equal(0, st, text)
      local straight = losses(dir .. '/straight')
      st, text = bin_train(('--nproc-per-node 2 --device cuda %s --stop-at 2 --out %s/saved'):format(common, q(dir)))
      assert.are.equal(0, st, text)
      assert.is_truthy(text:find('stopped by --stop-at 2 after step 2/4', 1, true), text)
      for _, np in ipairs({ 2, 1 }) do
        local out = ('%s/at%d'):format(dir, np)
        os.execute(('cp -r %s %s'):format(q(dir .. '/saved'), q(out)))
        local launcher = np > 1 and '--nproc-per-node 2 --device cuda ' or ''
        st, text = bin_train(('%s--resume %s'):format(launcher, q(out)))
        assert.are.equal(0, st, text)
        assert.is_truthy(text:find('resumed from ' .. out .. '/ckpt-2 at step 2', 1, true), text)
        local got = losses(out)
        for step = 1, 4 do
          assert.is_number(got[step], ('%s at %d: no loss at step %d'):format(strat, np, step))
          local rel = math.abs(got[step] - straight[step]) / math.abs(straight[step])
          assert.is_true(rel <= 2e-2, ('%s resumed at %d GPU(s): step %d loss %.6g, straight %.6g'):format(
            strat, np, step, got[step], straight[step]))
        end
      end
      os.execute('rm -rf ' .. q(dir))
    end)
  end
end)

-- tensor parallelism through bin/train on two GPUs (docs/tp.md): --tp 2,
-- and --tp 2 --fsdp FULL_SHARD (FSDP groups of one), follow one GPU's loss
-- curve, sample, save the whole model, and a stopped run resumes at --tp 2
-- and on one GPU
describe('bin/train --tp on two GPUs #gpu', function()
  local function close(ref, got, what) S_.close_losses(ref, got, 1, 4, what, 2e-2) end
  local models = {
    { 'models/gpt2.lua', small },
    { 'models/llama.lua', '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 128 '
      .. '--model.intermediate_size 256 --seq-len 64 --batch-size 8' },
  }
  for _, mc in ipairs(models) do
    for _, mode in ipairs({ '--tp 2', '--tp 2 --fsdp FULL_SHARD' }) do
      it(('%s %s: one GPU\'s curve, a sample, the whole model saved; resumed at --tp 2 and on one GPU'):format(mc[1], mode),
        function()
          if ms.cuda.device_count() < 2 then
            pending('needs two GPUs (' .. ms.cuda.device_count() .. ' here)')
            return
          end
          local dir = tmpdir()
          local common = ('%s %s --device cuda --steps 4 --log-every 1 --eval-every 0'):format(mc[1], mc[2])
          local st, text = bin_train(('%s --sample-tokens 0 --out %s/one'):format(common, q(dir)))
          assert.are.equal(0, st, text)
          local one = losses(dir .. '/one')
          st, text = bin_train(('--nproc-per-node 2 --device cuda %s %s --sample-tokens 16 --out %s/tp'):format(common,
            mode, q(dir)))
          assert.are.equal(0, st, text)
          assert.is_truthy(text:find('tensor parallel: 2-way over 2 ranks', 1, true), text)
          assert.is_truthy(text:find('---- sample (16 tokens', 1, true), text)
          close(one, losses(dir .. '/tp'), mode)
          local sd = ms.load_safetensors(dir .. '/tp/model.safetensors')
          local sd1 = ms.load_safetensors(dir .. '/one/model.safetensors')
          for name, t in pairs(sd1) do assert.are.same(t.shape, sd[name].shape, name) end
          st, text = bin_train(('--nproc-per-node 2 --device cuda %s %s --sample-tokens 0 --stop-at 2 --out %s/saved')
            :format(common, mode, q(dir)))
          assert.are.equal(0, st, text)
          os.execute(('cp -r %s %s'):format(q(dir .. '/saved'), q(dir .. '/saved1')))
          st, text = bin_train(('--nproc-per-node 2 --device cuda --resume %s %s'):format(q(dir .. '/saved'), mode))
          assert.are.equal(0, st, text)
          close(one, losses(dir .. '/saved'), mode .. ' resumed at --tp 2')
          st, text = bin_train(('--resume %s'):format(q(dir .. '/saved1')))
          assert.are.equal(0, st, text)
          close(one, losses(dir .. '/saved1'), mode .. ' resumed on one GPU')
          os.execute('rm -rf ' .. q(dir))
        end)
    end
  end
end)

-- the rest of the loop on two GPUs: llama with its head unit, micro-batches,
-- evaluation, a sample at the end, the final full save, SIGINT's checkpoint
describe('bin/train llama on two GPUs #gpu', function()
  it('accumulates, evaluates, samples and saves under FULL_SHARD; SIGINT stops both ranks with a checkpoint', function()
    if ms.cuda.device_count() < 2 then
      pending('needs two GPUs (' .. ms.cuda.device_count() .. ' here)')
      return
    end
    local dir = tmpdir()
    local args = ('models/llama.lua --preset tiny --model.num_hidden_layers 2 --model.hidden_size 64 '
      .. '--model.intermediate_size 128 --seq-len 64 --batch-size 2 --tokens-per-step 512 --device cuda '
      .. '--fsdp FULL_SHARD --log-every 1 --eval-every 2 --eval-iters 2 --sample-tokens 8 --out %s/run'):format(q(dir))
    local st, text = bin_train('--nproc-per-node 2 --device cuda ' .. args .. ' --steps 4')
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('2 micro-batches', 1, true), text)
    assert.is_truthy(text:find('---- sample', 1, true), text)
    assert.is_truthy(text:find('[rank 1] done: 4 steps', 1, true), text)
    assert.is_truthy(io.open(dir .. '/run/model.safetensors'), 'no final save')
    -- SIGINT to the launcher in the middle of a longer run
    local lpid = dir .. '/launcher.pid'
    os.execute(("cd %s && (bin/train --nproc-per-node 2 --device cuda %s --steps 100000 --out %s/int >%s/int.out 2>&1 & "
      .. "echo $! >%s; wait $!; echo $? >%s/int.rc) >/dev/null 2>&1 &"):format(q(root),
      args:gsub('%-%-out %S+', ''), q(dir), q(dir), q(lpid), q(dir)))
    local t0 = os.time()
    local started = false
    while os.time() - t0 < 120 do
      local f = io.open(dir .. '/int.out')
      local out = f and f:read('*a') or ''
      if f then f:close() end
      if out:find('step%s+3/') then started = true; break end
      os.execute('sleep 0.2')
    end
    assert.is_true(started, 'the interrupted run never reached step 3: ' .. (io.open(dir .. '/int.out'):read('*a')))
    local pid = tonumber(io.open(lpid):read('*l'))
    os.execute('kill -INT ' .. pid)
    t0 = os.time()
    while os.time() - t0 < 60 and not io.open(dir .. '/int.rc') do os.execute('sleep 0.2') end
    local out = io.open(dir .. '/int.out'):read('*a')
    assert.is_truthy(out:find('stopped by SIGINT after step', 1, true), out)
    assert.is_truthy(out:find('ckpt%-%d+'), out)
    os.execute('rm -rf ' .. q(dir))
  end)
end)

-- fine-tuning from a Hugging Face folder on two GPUs: each rank reads its
-- shards of the file onto its GPU (deferred init); at lr 0 the gathered
-- final weights are the folder's, bitwise, and the first loss is the one
-- process's on one GPU
describe('bin/train --init-from on two GPUs #gpu', function()
  it('llama-tiny and gpt2-tiny under FULL_SHARD with bf16 parameters: the folder\'s weights back at lr 0', function()
    if ms.cuda.device_count() < 2 then
      pending('needs two GPUs (' .. ms.cuda.device_count() .. ' here)')
      return
    end
    for _, case in ipairs({ { 'gpt2', 'gpt2-tiny' }, { 'llama', 'llama-tiny' } }) do
      local fixture = root .. '/../shared/fixtures/' .. case[2]
      local want = ms.load_safetensors(fixture .. '/model.safetensors')
      local dir = tmpdir()
      local common = ('models/%s.lua --device cuda --init-from %s --steps 1 --lr 0 --seq-len 16 --eval-every 0 '
        .. '--sample-tokens 0'):format(case[1], q(fixture))
      local st, text = bin_train(('--nproc-per-node 2 --device cuda %s --batch-size 2 --fsdp FULL_SHARD --out %s/two'):format(
        common, q(dir)))
      assert.are.equal(0, st, text)
      assert.is_truthy(text:find('deferred init', 1, true), text)
      local got = ms.load_safetensors(dir .. '/two/model.safetensors')
      local n = 0
      for k, v in pairs(got) do
        local w = want[k] or want[(k:gsub('^transformer%.', ''))]
        assert.is_not_nil(w, k)
        assert.are.equal(0, (v:double() - w:double()):abs():max():item(), case[2] .. ' ' .. k)
        n = n + 1
      end
      assert.is_true(n >= 10)
      os.execute('rm -rf ' .. q(dir))
    end
  end)

  it('--lora with --init-from under FULL_SHARD on two GPUs: trains, saves a plain folder with only adapted weights changed', function()
    if ms.cuda.device_count() < 2 then
      pending('needs two GPUs (' .. ms.cuda.device_count() .. ' here)')
      return
    end
    local fixture = root .. '/../shared/fixtures/llama-tiny'
    local want = ms.load_safetensors(fixture .. '/model.safetensors')
    local dir = tmpdir()
    local st, text = bin_train(('--nproc-per-node 2 --device cuda models/llama.lua --device cuda --init-from %s --lora 4 '
      .. '--steps 4 --lr 1e-2 --seq-len 16 --batch-size 2 --eval-every 0 --sample-tokens 0 --fsdp FULL_SHARD --out %s/lo'):format(
      q(fixture), q(dir)))
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('lora: rank 4', 1, true), text)
    local m = require('models.llama').from_pretrained(dir .. '/lo')
    local changed = 0
    for k, v in pairs(m:state_dict()) do
      local w = want[k]
      local d = ms.no_grad(function() return (v:double() - w:double()):abs():max():item() end)
      if d > 0 then
        changed = changed + 1
        assert.is_truthy(k:match('_proj%.weight$'), k)
      end
    end
    assert.are.equal(14, changed)
    os.execute('rm -rf ' .. q(dir))
  end)
end)
