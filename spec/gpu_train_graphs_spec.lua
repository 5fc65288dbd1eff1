-- bin/train --cuda-graphs on a GPU (docs/cuda-graphs.md, "In bin/train"):
-- the same run with and without it gives the same losses, gradient norms,
-- validation losses, checkpoints and final weights, bit for bit — a tiny
-- GPT-2 and a tiny Llama, in f32 and under bf16 autocast, with a cosine lr
-- schedule, clipping that bites, two micro-batches a step, evaluations and
-- checkpoints between the replays; a run stopped and resumed captures again
-- and still ends on the same bits; an --inject-nan step runs eagerly between
-- replays and is skipped as in the eager run; tuned GEMM plans read from one
-- file give the same bits too; a capture an op refuses is reported once and
-- the run goes on eagerly with the eager run's results.
-- Run on a GPU host: bash tools/run_specs.sh --tags=gpu spec/gpu_train_graphs_spec.lua
local ms = require 'moonshard'
local json = require 'dkjson'
local S = require 'spec.support'
local q = S.shell_quote

local function rows(out)
  local r = {}
  for line in io.lines(out .. '/metrics.jsonl') do
    local obj = assert(json.decode(line, 1, nil), line)
    r[obj.step] = obj
  end
  return r
end

-- the runs' logged numbers (loss, grad_norm, lr, val_loss, skipped) equal
-- at steps from..8, b's at step 8 with a validation -> both runs' rows
local function same_rows(a, b, from, what)
  local ra, rb = rows(a), rows(b)
  for s = from, 8 do
    local x, y = ra[s], rb[s]
    assert.is_table(y, what .. ': step ' .. s .. ' missing')
    for _, k in ipairs({ 'loss', 'grad_norm', 'lr', 'val_loss', 'skipped' }) do
      assert.are.equal(x[k], y[k], ('%s: step %d: %s'):format(what, s, k))
    end
  end
  assert.is_number(rb[8].val_loss)
  return ra, rb
end

-- a describe's setup: a GPU, a fresh folder and the fixed corpus in it ->
-- the folder, the corpus
local function scratch()
  assert.is_true(ms.cuda.is_available(), 'no CUDA device')
  local dir = S.tmpdir()
  return dir, S.fixed_corpus(dir, 60000)
end

local function count(text, s)
  local n, at = 0, 1
  while true do
    local i = text:find(s, at, true)
    if not i then return n end
    n, at = n + 1, i + #s
  end
end

local models = {
  gpt2 = 'models/gpt2.lua --preset tiny --model.n_layer 2 --model.n_embd 64 --model.n_head 2',
  llama = 'models/llama.lua --preset tiny --model.num_hidden_layers 2 --model.hidden_size 64 '
    .. '--model.intermediate_size 128 --model.num_attention_heads 2 --model.num_key_value_heads 1',
}
local precisions = { f32 = '--autocast off', bf16 = '--autocast bf16' }

-- (GEMM tuning off unless a case says otherwise: each run would time its
-- own plans and may pick others, with other bits)
local env = 'MS_GEMM_TUNE=0'

describe('bin/train --cuda-graphs #gpu', function()
  local dir, corpus
  setup(function() dir, corpus = scratch() end)
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- 8 steps of 2 micro-batches of 4 x 32 tokens, lr warmup 2 then cosine,
  -- clipping at 0.5, validation every 3 steps, checkpoints every 4
  local function flags(model, precision, extra)
    return ('%s %s --device cuda --seq-len 32 --batch-size 4 --tokens-per-step 256 --steps 8 --lr 1e-2 --warmup 2 '
      .. '--lr-schedule cosine --grad-clip 0.5 --eval-every 3 --eval-iters 2 --save-every 4 --keep-checkpoints 0 '
      .. '--log-every 1 --sample-tokens 0 --data %s %s'):format(models[model], precisions[precision], q(corpus),
      extra or '')
  end

  -- the two runs' every logged number, checkpoint and final weights equal
  local function same_runs(a, b, from, what)
    local ra, rb = same_rows(a, b, from or 1, what)
    S.same_tensors(a .. '/model.safetensors', b .. '/model.safetensors')
    S.same_files(a .. '/ckpt-8', b .. '/ckpt-8', { 'model.safetensors', 'optimizer.safetensors', 'optimizer.json' })
    return ra, rb
  end

  for _, model in ipairs({ 'gpt2', 'llama' }) do
    for _, precision in ipairs({ 'f32', 'bf16' }) do
      it(('%s %s: the eager run\'s losses, norms, validations, checkpoints and weights, bit for bit'):format(model,
        precision), function()
        local a, b = ('%s/%s-%s-eager'):format(dir, model, precision), ('%s/%s-%s-graphs'):format(dir, model, precision)
        local st, text = S.bin_train(flags(model, precision, '--out ' .. q(a)), env)
        assert.are.equal(0, st, text)
        st, text = S.bin_train(flags(model, precision, '--cuda-graphs --graph-warmup 2 --out ' .. q(b)), env)
        assert.are.equal(0, st, text)
        assert.are.equal(1, count(text, 'cuda graphs: step 3 captured'), text)
        assert.is_truthy(text:find('cuda graphs: 6 steps replayed', 1, true), text)
        assert.is_falsy(text:find('could not be captured', 1, true), text)
        local _, rb = same_runs(a, b, 1, model .. ' ' .. precision)
        for s = 1, 8 do assert.are.equal(s >= 3 or nil, rb[s].replayed, 'step ' .. s .. ' replayed') end
        S.same_files(a .. '/ckpt-4', b .. '/ckpt-4', { 'model.safetensors', 'optimizer.safetensors', 'optimizer.json' })
      end)
    end
  end

  -- the eager gpt2 f32 run (made by the first case; again where it was
  -- left out) -> its folder
  local function eager_gpt2()
    local a = dir .. '/gpt2-f32-eager'
    if not io.open(a .. '/model.safetensors') then
      local st, text = S.bin_train(flags('gpt2', 'f32', '--out ' .. q(a)), env)
      assert.are.equal(0, st, text)
    end
    return a
  end

  it('a run stopped at a checkpoint and resumed captures again after its warm-up: the bits of the eager run',
    function()
    local a = eager_gpt2()
    local c = dir .. '/resumed'
    local st, text = S.bin_train(flags('gpt2', 'f32', '--cuda-graphs --graph-warmup 1 --stop-at 4 --out ' .. q(c)),
      env)
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('cuda graphs: step 2 captured', 1, true), text)
    -- (the options, --cuda-graphs among them, come from the checkpoint)
    st, text = S.bin_train(('--resume %s'):format(q(c)), env)
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('cuda graphs: step 6 captured', 1, true), text)
    local _, rc = same_runs(a, c, 1, 'resumed')
    for s = 5, 8 do assert.are.equal(s >= 6 or nil, rc[s].replayed, 'step ' .. s .. ' replayed') end
  end)

  it('an --inject-nan step runs eagerly between replays and is skipped as in the eager run', function()
    local a, b = dir .. '/nan-eager', dir .. '/nan-graphs'
    local st, text = S.bin_train(flags('llama', 'bf16', '--inject-nan 5 --out ' .. q(a)), env)
    assert.are.equal(0, st, text)
    st, text = S.bin_train(flags('llama', 'bf16', '--inject-nan 5 --cuda-graphs --graph-warmup 2 --out ' .. q(b)),
      env)
    assert.are.equal(0, st, text)
    local _, rb = same_runs(a, b, 1, 'inject-nan')
    assert.is_true(rb[5].skipped)
    assert.is_nil(rb[5].replayed)
    for _, s in ipairs({ 3, 4, 6, 7, 8 }) do assert.is_true(rb[s].replayed, 'step ' .. s) end
  end)

  it('with activation checkpointing: the bits of the eager run', function()
    local a, b = dir .. '/ac-eager', dir .. '/ac-graphs'
    local st, text = S.bin_train(flags('llama', 'bf16', '--activation-checkpointing full --out ' .. q(a)), env)
    assert.are.equal(0, st, text)
    st, text = S.bin_train(flags('llama', 'bf16', '--activation-checkpointing full --cuda-graphs --out ' .. q(b)), env)
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('cuda graphs: step 4 captured', 1, true), text)   -- (--graph-warmup 3, the default)
    same_runs(a, b, 1, 'activation checkpointing')
  end)

  it('with GEMM plans tuned once and read from one file: the bits of the eager run that reads them', function()
    local tune = dir .. '/gemm_tune.txt'
    local tenv = 'MS_GEMM_TUNE=1 MS_GEMM_TUNE_FILE=' .. q(tune)
    local st, text = S.bin_train(flags('gpt2', 'bf16', '--out ' .. q(dir .. '/tune-first')), tenv)
    assert.are.equal(0, st, text)
    local a, b = dir .. '/tune-eager', dir .. '/tune-graphs'
    st, text = S.bin_train(flags('gpt2', 'bf16', '--out ' .. q(a)), tenv)
    assert.are.equal(0, st, text)
    st, text = S.bin_train(flags('gpt2', 'bf16', '--cuda-graphs --out ' .. q(b)), tenv)
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('cuda graphs: step 4 captured', 1, true), text)
    same_runs(a, b, 1, 'tuned GEMMs')
  end)

  -- --float8: dynamic scales (amaxes, scales, casts: kernels of the
  -- step, no host read), so the replay is the eager step
  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    it(('llama bf16 --float8 %s: the eager run\'s bits'):format(recipe), function()
      local a, b = ('%s/f8-%s-eager'):format(dir, recipe), ('%s/f8-%s-graphs'):format(dir, recipe)
      local st, text = S.bin_train(flags('llama', 'bf16', ('--float8 %s --out %s'):format(recipe, q(a))), env)
      assert.are.equal(0, st, text)
      assert.is_truthy(text:find('float8: ' .. recipe, 1, true), text)
      st, text = S.bin_train(flags('llama', 'bf16', ('--float8 %s --cuda-graphs --graph-warmup 2 --out %s'):format(
        recipe, q(b))), env)
      assert.are.equal(0, st, text)
      assert.is_truthy(text:find('cuda graphs: step 3 captured', 1, true), text)
      assert.is_truthy(text:find('cuda graphs: 6 steps replayed', 1, true), text)
      assert.is_falsy(text:find('could not be captured', 1, true), text)
      same_runs(a, b, 1, 'float8 ' .. recipe)
    end)
  end

  it('a capture an op refuses: one warning naming it, then eagerly, with the eager run\'s bits', function()
    -- a GPT-2 whose forward waits for the device while a capture goes on
    local file = dir .. '/syncing_gpt2.lua'
    local f = assert(io.open(file, 'w'))
    f:write([[
local gpt2 = require 'models.gpt2'
local ms = require 'moonshard'
local M = setmetatable({ name = 'gpt2' }, { __index = gpt2 })
function M.new(...)
  local m = gpt2.new(...)
  m:register_forward_pre_hook(function() if ms.cuda.is_capturing() then ms.cuda.synchronize() end end, true)
  return m
end
return M
]])
    f:close()
    local a = eager_gpt2()
    local b = dir .. '/refused'
    local st, text = S.bin_train(flags('gpt2', 'f32', '--cuda-graphs --out ' .. q(b)):gsub('^models/gpt2%.lua',
      q(file)), env)
    assert.are.equal(0, st, text)
    assert.are.equal(1, count(text, '--cuda-graphs: the step could not be captured, training on eagerly'), text)
    assert.is_truthy(text:find('synchronize', 1, true), text)
    local _, rb = same_runs(a, b, 1, 'refused capture')
    for s = 1, 8 do assert.is_nil(rb[s].replayed) end
  end)
end)

-- several processes, plain data parallel (NO_SHARD units): graph A the
-- forward and backward of both micro-batches, then the all-reduces and
-- the clipping recorded into it (NCCL under capture, --graph-collectives
-- on), graph B fsdp.AdamW's step. Against the default eager
-- run, whose all-reduces overlap the backward: the same bits (losses,
-- norms, validations, the sharded checkpoints, the final weights), for the
-- default bf16/f32 mixed precision, without it (f32 gradients written in
-- place), and with a bf16 reduction (the gradient shard made in new
-- memory, the graph's own); an injected NaN skipped on both ranks alike.
-- The split (--graph-collectives off, the default: the all-reduce and
-- clipping eager between the graphs) gives the same bits, and so does the fallback to it
-- when the capture with the all-reduce fails (here made to fail after its
-- first all-reduce was recorded).
-- Run on a host with two GPUs:
--   bash tools/run_specs.sh --tags=gpu spec/gpu_train_graphs_spec.lua --filter='two GPUs'
describe('bin/train --cuda-graphs data parallel on two GPUs #gpu #multi', function()
  local dir, corpus
  setup(function() dir, corpus = scratch() end)
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- 2 ranks x 2 micro-batches of 2 x 32 tokens, as the one-GPU cases otherwise
  local function flags(model, extra)
    return ('--nproc-per-node 2 --device cuda %s --seq-len 32 --batch-size 2 --tokens-per-step 256 --steps 8 '
      .. '--lr 1e-2 --warmup 2 --lr-schedule cosine --grad-clip 0.5 --eval-every 3 --eval-iters 2 --save-every 4 '
      .. '--keep-checkpoints 0 --log-every 1 --sample-tokens 0 --data %s %s'):format(models[model], q(corpus),
      extra or '')
  end
  local function same_runs(a, b, what, skipped)
    local ra, rb = same_rows(a, b, 1, what)
    for s = 1, 8 do
      if s ~= skipped then assert.is_number(rb[s].loss, what .. ': step ' .. s) end
    end
    S.same_tensors(a .. '/model.safetensors', b .. '/model.safetensors')
    for _, c in ipairs({ 'ckpt-4', 'ckpt-8' }) do
      S.same_files(a .. '/' .. c, b .. '/' .. c, { 'rank-00000-of-00002.safetensors', 'rank-00001-of-00002.safetensors' })
    end
    return ra, rb
  end

  -- the eager runs, each made once: flags -> the folder
  local eager_done = {}
  local function eager(model, extra, tag)
    local a = dir .. '/' .. tag .. '-eager'
    if not eager_done[a] then
      local st, text = S.bin_train(flags(model, extra .. ' --out ' .. q(a)), env)
      assert.are.equal(0, st, text)
      assert.is_falsy(text:find('all-reduced after the backward', 1, true), text)   -- (the overlapped default)
      eager_done[a] = true
    end
    return a
  end
  local function two_gpus()
    if ms.cuda.device_count() >= 2 then return true end
    pending('needs two GPUs (' .. ms.cuda.device_count() .. ' here)')
    return false
  end

  for _, c in ipairs({
    { 'llama', '', 'bf16/f32', nil, '--graph-collectives on' },
    { 'gpt2', '--fsdp-mixed-precision none', 'f32', nil, '--graph-collectives on' },
    { 'llama', '--fsdp-mixed-precision bf16/bf16 --inject-nan 5', 'bf16 reduction, NaN at 5', 5, '--graph-collectives on' },
    { 'llama', '', 'bf16/f32, --graph-collectives off (the default)' },
    { 'llama', '--fsdp-mixed-precision bf16/bf16 --inject-nan 5', 'bf16 reduction, NaN at 5, --graph-collectives off',
      5, '--graph-collectives off' },
  }) do
    local model, extra, what, nan, gflags = c[1], c[2], c[3], c[4], c[5]
    it(('%s %s: the eager run\'s bits'):format(model, what), function()
      if not two_gpus() then return end
      local a = eager(model, extra, (model .. '-' .. extra):gsub('[^%w]+', '_'))
      local b = dir .. '/' .. (model .. '-' .. what):gsub('[^%w]+', '_') .. '-graphs'
      local st, text = S.bin_train(flags(model, extra .. ' --cuda-graphs --graph-warmup 2 ' .. (gflags or '')
        .. ' --out ' .. q(b)), env)
      assert.are.equal(0, st, text)
      assert.is_truthy(text:find('gradients all-reduced after the backward', 1, true), text)
      assert.is_truthy(text:find('cuda graphs: step 3 captured', 1, true), text)
      if gflags ~= '--graph-collectives on' then
        assert.is_truthy(text:find('the gradient all-reduce and clipping eager after it', 1, true), text)
      else
        assert.is_truthy(text:find('forward, backward, the gradient all-reduce, clipping), replayed', 1, true), text)
        assert.is_falsy(text:find('eager after it', 1, true), text)
      end
      assert.is_falsy(text:find('all-reduce could not be captured', 1, true), text)
      assert.is_truthy(text:find(('cuda graphs: %d steps replayed'):format(nan and 5 or 6), 1, true), text)
      assert.is_falsy(text:find('could not be captured', 1, true), text)
      local _, rb = same_runs(a, b, model .. ' ' .. what, nan)
      for s = 1, 8 do
        assert.are.equal((s >= 3 and s ~= nan) or nil, rb[s].replayed, 'step ' .. s .. ' replayed')
      end
      if nan then assert.is_true(rb[nan].skipped) end
    end)
  end

  it('the capture with the all-reduce refused after its first all-reduce: one warning a rank, the split, the '
    .. 'eager run\'s bits', function()
    if not two_gpus() then return end
    -- a Llama whose second unit's reduction waits for the device while a
    -- capture goes on (fsdp.set_before_reduce, set at its first forward,
    -- when FSDP holds it): the capture with the all-reduce is refused
    -- after the first unit's all-reduce was recorded; the split's capture
    -- runs no reduction, and the eager reductions do not wait
    local file = dir .. '/syncing_llama.lua'
    local f = assert(io.open(file, 'w'))
    f:write([[
local llama = require 'models.llama'
local ms = require 'moonshard'
local M = setmetatable({ name = 'llama' }, { __index = llama })
function M.new(...)
  local m = llama.new(...)
  local set, seen = false, 0
  m:register_forward_pre_hook(function()
    seen = 0
    if not set then
      set = true
      ms.fsdp.set_before_reduce(m, function()
        seen = seen + 1
        if seen == 2 and ms.cuda.is_capturing() then ms.cuda.synchronize() end
      end)
    end
  end, true)
  return m
end
return M
]])
    f:close()
    local a = eager('llama', '', 'llama_')
    local b = dir .. '/fallback-graphs'
    local st, text = S.bin_train(flags('llama', '--cuda-graphs --graph-collectives on --graph-warmup 2 --out ' .. q(b)):gsub(
      'models/llama%.lua', q(file)), env)
    assert.are.equal(0, st, text)
    -- (bin/train's warnings: every rank's)
    assert.are.equal(2, count(text, '--cuda-graphs: the gradient all-reduce could not be captured with the step'),
      text)
    assert.is_truthy(text:find('synchronize', 1, true), text)
    assert.is_falsy(text:find('the step could not be captured', 1, true), text)
    assert.is_truthy(text:find('cuda graphs: step 3 captured', 1, true), text)
    assert.is_truthy(text:find('the gradient all-reduce and clipping eager after it', 1, true), text)
    assert.is_truthy(text:find('cuda graphs: 6 steps replayed', 1, true), text)
    local _, rb = same_runs(a, b, 'fallback')
    for s = 1, 8 do assert.are.equal(s >= 3 or nil, rb[s].replayed, 'step ' .. s .. ' replayed') end
  end)
end)
