-- bin/train and moonshard.train: a short run learns (the loss falls), writes
-- well-formed JSONL metrics, saves weights from_pretrained reads, samples; bad
-- flags and files are clear errors with a non-zero exit; the byte corpus and
-- the batch loader are deterministic.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local json = require 'dkjson'
local train = require 'moonshard.train'
local data = require 'moonshard.data'

local root = T.root
local S_ = require 'spec.support'
local q, tmpdir = S_.shell_quote, S_.tmpdir

-- runs bin/train with the given argument string; returns exit status, output
local function bin_train(args)
  local p = io.popen(('cd %s && bin/train %s 2>&1; echo "__status=$?"'):format(q(root), args))
  local out = p:read('*a')
  p:close()
  local status = tonumber(out:match('__status=(%d+)%s*$'))
  return status, out:gsub('__status=%d+%s*$', '')
end

local function read_jsonl(path)
  local f = assert(io.open(path, 'rb'))
  local rows = {}
  for line in f:lines() do
    local obj, _, err = json.decode(line, 1, nil)
    assert(type(obj) == 'table', ('%s: a line that is not a JSON object: %s (%s)'):format(path, line, tostring(err)))
    rows[#rows + 1] = obj
  end
  f:close()
  return rows
end

-- a model small enough that a few steps take well under a second
local small = '--preset tiny --model.n_layer 1 --model.n_embd 32 --model.n_head 2 --seq-len 32 --batch-size 8'

describe('bin/train', function()
  it('trains a model file: the loss falls, metrics.jsonl is well-formed, weights and a sample come out', function()
    local out = tmpdir()
    local status, text = bin_train(('models/gpt2.lua %s --steps 30 --lr 1e-2 --warmup 3 --log-every 10 '
      .. '--eval-every 10 --eval-iters 2 --sample-tokens 20 --out %s'):format(small, q(out)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('step 10/30 | loss', 1, true), text)
    assert.is_truthy(text:find('tok/s', 1, true), text)
    assert.is_truthy(text:find('ETA', 1, true), text)
    assert.is_truthy(text:find('---- sample', 1, true), text)
    local rows = read_jsonl(out .. '/metrics.jsonl')
    assert.are.equal(30, #rows)
    for i, r in ipairs(rows) do
      assert.are.equal(i, r.step)
      assert.is_number(r.loss)
      assert.is_number(r.lr)
      assert.is_number(r.grad_norm)
      assert.is_number(r.elapsed_s)
    end
    assert.is_number(rows[10].val_loss)
    assert.is_number(rows[30].val_loss)
    assert.is_number(rows[10].tokens_per_s)
    local function mean(a, b)
      local s = 0
      for i = a, b do s = s + rows[i].loss end
      return s / (b - a + 1)
    end
    assert.is_true(rows[1].loss > 5, tostring(rows[1].loss)) -- about ln(256) = 5.55 at the start
    assert.is_true(mean(26, 30) < mean(1, 5) - 1, ('loss %.3f -> %.3f'):format(mean(1, 5), mean(26, 30)))
    -- the run's options and the final weights
    local run = assert(json.decode(assert(io.open(out .. '/run.json')):read('*a')))
    assert.are.equal(30, run.options.steps)
    assert.are.equal(32, run.model_config.n_embd)
    local gpt2 = require 'models.gpt2'
    local m = gpt2.from_pretrained(out)
    assert.are.equal(1, m.config.n_layer)
    os.execute('rm -rf ' .. q(out))
  end)

  it('trains llama too', function()
    local out = tmpdir()
    local status, text = bin_train(('models/llama.lua --preset tiny --model.num_hidden_layers 1 '
      .. '--model.hidden_size 32 --model.intermediate_size 64 --seq-len 32 --batch-size 8 --steps 4 '
      .. '--sample-tokens 4 --no-save --quiet --out %s'):format(q(out)))
    assert.are.equal(0, status, text)
    assert.are.equal(4, #read_jsonl(out .. '/metrics.jsonl'))
    assert.is_nil(io.open(out .. '/model.safetensors'))
    os.execute('rm -rf ' .. q(out))
  end)

  it('gives clear errors for bad flags and files, with exit status 2', function()
    local cases = {
      { 'models/gpt2.lua --steps abc', '--steps expects a number' },
      { 'models/gpt2.lua --steps 2.5', '--steps expects an integer' },
      { 'models/gpt2.lua --steps 0', '--steps must be > 0' },
      { 'models/gpt2.lua --lr -1', '--lr must be >= 0' },
      { 'models/gpt2.lua --stpes 10', 'unknown option --stpes' },
      { 'models/gpt2.lua --steps', '--steps needs a value' },
      { 'models/gpt2.lua stray', 'unexpected argument' },
      { 'models/gpt2.lua --preset huge --steps 1', 'unknown preset huge' },
      { 'models/gpt2.lua --model.n_layerz 2', 'has no config field n_layerz' },
      { 'models/gpt2.lua --model.n_embd wide', '--model.n_embd expects a number' },
      { 'models/gpt2.lua --seq-len 4096 --steps 1', 'exceeds the model' },
      { 'models/gpt2.lua --data /nonexistent/file --steps 1', 'cannot read /nonexistent/file' },
      { 'models/gpt2.lua --dtype bf17', 'dtype must be f32 or f64' },
      { 'models/gpt2.lua --autocast fp8', "autocast must be auto, bf16 or off, got 'fp8'" },
      { 'models/gpt2.lua --autocast bf16 --dtype f64', 'autocast bf16 needs dtype f32' },
      { 'no/such/file.lua', 'cannot open no/such/file.lua' },
      { '--frobnicate models/gpt2.lua', 'unknown launcher option --frobnicate' },
      { '', 'usage: bin/train' },
      { 'models/gpt2.lua --lr-schedule step', 'lr_schedule must be cosine, linear, wsd or constant' },
      { 'models/gpt2.lua --decay-fraction 1.5', 'decay_fraction must be in (0, 1]' },
      { 'models/gpt2.lua --decay-shape exp', 'decay_shape must be linear, cosine or sqrt' },
      { 'models/gpt2.lua --activation-checkpointing half', 'activation_checkpointing must be none, full' },
      { 'models/gpt2.lua --init-from /nonexistent/dir --steps 1', '/nonexistent/dir/config.json' },
      -- (byte-level --data took no --val-data: it was ignored, the run validated on --val-fraction's tail)
      { 'models/gpt2.lua --data README.md --val-data val.bin --steps 1',
        '--val-data val.bin: validation shards go with token shards in --data (a folder, a glob or a .bin file); '
          .. 'README.md is byte-level text' },
    }
    for _, c in ipairs(cases) do
      local status, text = bin_train(c[1])
      assert.are.equal(2, status, c[1] .. ': ' .. text)
      assert.is_truthy(text:find(c[2], 1, true), ('%s: expected "%s" in: %s'):format(c[1], c[2], text))
      assert.is_falsy(text:find('stack traceback', 1, true), c[1] .. ': ' .. text)
    end
  end)

  it('a model config error names the field', function()
    local status, text = bin_train('models/gpt2.lua --model.activation_function relu --steps 1')
    assert.are_not.equal(0, status)
    assert.is_truthy(text:find("activation_function must be one of 'gelu_new'", 1, true), text)
  end)

  it('prints help with the options and the model\'s presets', function()
    local status, text = bin_train('models/llama.lua --help')
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('--batch-size', 1, true), text)
    assert.is_truthy(text:find('llama presets: 1b, llama-1.25b, llama-1b, tiny', 1, true), text)
    status, text = bin_train('--help')
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('usage: bin/train FILE', 1, true), text)
    -- the launcher's --help with FILE, and a run config's --help (FILE was
    -- ignored; the config said 'unknown option --help', exit 2)
    for _, args in ipairs({ '--help models/llama.lua', '-h models/llama.lua' }) do
      status, text = bin_train(args)
      assert.are.equal(0, status, args .. ': ' .. text)
      assert.is_truthy(text:find('llama presets: 1b, llama-1.25b, llama-1b, tiny', 1, true), args .. ': ' .. text)
    end
    for _, args in ipairs({ 'configs/tiny.lua --help', '--help configs/tiny.lua', '--config configs/tiny.lua --help' }) do
      status, text = bin_train(args)
      assert.are.equal(0, status, args .. ': ' .. text)
      assert.is_truthy(text:find('--batch-size', 1, true), args .. ': ' .. text)
    end
    status, text = bin_train('configs/tiny.lua --help')
    assert.is_truthy(text:find('gpt2 presets: gpt2, gpt2-124m, gpt2-350m, tiny', 1, true), text)
  end)

  it('runs a training script as it is, with its arguments', function()
    local dir = tmpdir()
    local script = dir .. '/script.lua'
    local f = assert(io.open(script, 'w'))
    f:write([[
local ms = require 'moonshard'
local gpt2 = require 'models.gpt2'
local a, b = ...
print('script args', a, b, arg[0] ~= nil)
ms.manual_seed(1)
local m = gpt2.new('tiny', { n_layer = 1 })
print('loss', m(ms.tensor({ { 1, 2, 3 } }, { dtype = 'i64' }), ms.tensor({ { 2, 3, 4 } }, { dtype = 'i64' })):item())
]])
    f:close()
    local status, text = bin_train(q(script) .. ' --foo bar')
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('script args\t--foo\tbar\ttrue', 1, true), text)
    assert.is_truthy(text:find('loss\t5%.'), text)
    -- a script that fails exits non-zero with its message
    f = assert(io.open(script, 'w'))
    f:write("error('the script failed on purpose')\n")
    f:close()
    status, text = bin_train(q(script))
    assert.are.equal(1, status, text)
    assert.is_truthy(text:find('the script failed on purpose', 1, true), text)
    os.execute('rm -rf ' .. q(dir))
  end)

  it('runs a run config file (a Lua table of options), flags override it', function()
    local dir = tmpdir()
    local cfg = dir .. '/run.lua'
    local f = assert(io.open(cfg, 'w'))
    f:write(([[
return { model = 'models/gpt2.lua', preset = 'tiny', steps = 5, seq_len = 16, batch_size = 2,
         model_config = { n_layer = 1, n_embd = 32, n_head = 2 }, sample_tokens = 0, save = false,
         quiet = true, out = %q }
]]):format(dir .. '/out'))
    f:close()
    local status, text = bin_train(q(cfg) .. ' --steps 3')
    assert.are.equal(0, status, text)
    assert.are.equal(3, #read_jsonl(dir .. '/out/metrics.jsonl'))
    os.execute('rm -rf ' .. q(dir))
  end)
end)

describe('moonshard.train', function()
  it('runs in-process and returns a summary; the same seed gives the same losses', function()
    local dir = tmpdir()
    local function run()
      return train.run{ model = 'models.gpt2', preset = 'tiny', steps = 6, seq_len = 16, batch_size = 4,
                        model_config = { n_layer = 1, n_embd = 32, n_head = 2 }, lr = 1e-2, warmup = 1,
                        sample_tokens = 8, temperature = 0, save = false, quiet = true, out = dir, seed = 5 }
    end
    local a = run()
    local la = read_jsonl(dir .. '/metrics.jsonl')
    local b = run()
    local lb = read_jsonl(dir .. '/metrics.jsonl')
    assert.are.equal(6, a.steps)
    assert.is_true(a.final_loss < a.first_loss)
    for i = 1, 6 do assert.are.equal(la[i].loss, lb[i].loss) end
    assert.are.equal(a.sample, b.sample)
    assert.are.equal(8, #a.sample - 1) -- the prompt "\n" and 8 sampled bytes
    os.execute('rm -rf ' .. q(dir))
  end)

  it('--autocast: auto is bf16 on a GPU without FSDP (FSDP\'s mixed precision sets it there), off on the CPU and in '
    .. 'f64; a bf16 run trains f32 weights under autocast, its losses near the f32 run\'s but not equal', function()
    local ad = train.autocast_dtype
    assert.are.equal('bf16', ad({ autocast = 'auto' }, 'cuda', nil))
    assert.are.equal('bf16', ad({}, 'cuda:1', nil))
    assert.is_nil(ad({ autocast = 'auto' }, 'cuda', 'FULL_SHARD'))
    assert.is_nil(ad({ autocast = 'auto' }, 'cpu', nil))
    assert.is_nil(ad({ autocast = 'auto', dtype = 'f64' }, 'cuda', nil))
    assert.is_nil(ad({ autocast = 'off' }, 'cuda', nil))
    assert.are.equal('bf16', ad({ autocast = 'bf16' }, 'cpu', nil))
    assert.are.equal('bf16', ad({ autocast = 'bf16' }, 'cuda', 'NO_SHARD'))
    local base = { model = 'models/llama.lua', preset = 'tiny', model_config = { num_hidden_layers = 1 }, steps = 3,
      batch_size = 2, seq_len = 32, quiet = true, save = false, sample_tokens = 0, eval_every = 0, eval_iters = 1,
      out = tmpdir() }
    local f = train.run(base)
    base.autocast = 'bf16'
    base.out = tmpdir()
    local b = train.run(base)
    assert.are.equal('f32', b.model.lm_head.weight.dtype)
    assert.are.equal('bf16', require('moonshard.amp').precision(b.model))
    assert.is_true(math.abs(b.final_loss - f.final_loss) <= 2e-2 * f.final_loss, b.final_loss .. ' vs ' .. f.final_loss)
    assert.are_not.equal(f.final_loss, b.final_loss)
    os.execute('rm -rf ' .. q(base.out))
  end)

  it('release_activations (on by default) frees at backward: the same losses as without, the setting restored', function()
    local dir = tmpdir()
    local function run(rel)
      local o = { model = 'models.gpt2', preset = 'tiny', steps = 4, seq_len = 16, batch_size = 4, tokens_per_step = 128,
                  model_config = { n_layer = 1, n_embd = 32, n_head = 2 }, lr = 1e-2, warmup = 1,
                  sample_tokens = 0, save = false, quiet = true, out = dir, seed = 9 }
      o.release_activations = rel
      local r = train.run(o)
      return r, read_jsonl(dir .. '/metrics.jsonl')
    end
    assert.is_false(ms.autograd.release_activations)
    -- the setting the model's loss sees (models call nn.functional.lm_loss at each step)
    local nnf = ms.nn.functional
    local orig, seen = nnf.lm_loss, {}
    nnf.lm_loss = function(...)
      seen[#seen + 1] = ms.autograd.release_activations
      return orig(...)
    end
    local ok, a, la, b, lb = pcall(function()
      local a_, la_ = run(nil)
      local b_, lb_ = run(false)
      return a_, la_, b_, lb_
    end)
    nnf.lm_loss = orig
    assert(ok, a)
    assert.is_true(a.options.release_activations)
    assert.is_false(b.options.release_activations)
    assert.is_false(ms.autograd.release_activations)
    -- 4 steps of 2 micro-batches each run, no validation in between
    local train_calls = 0
    for _, v in ipairs(seen) do if v then train_calls = train_calls + 1 end end
    assert.are.equal(8, train_calls)
    assert.are.equal(4, #la)
    for i = 1, 4 do assert.are.equal(lb[i].loss, la[i].loss) end
    assert.is_true(a.final_loss < a.first_loss)
    -- the flag is parsed both ways
    local oa = train.parse_args({ '--no-release-activations' })
    assert.is_false(oa.release_activations)
    os.execute('rm -rf ' .. q(dir))
  end)

  it('reads a step\'s losses from the device at once (train.host_values): item()\'s values to the bit, one copy a '
    .. 'dtype and device; with 4 micro-batches the logged loss is the mean of the 4 read apart, in order', function()
    local M = T.methods
    -- the unit: tensors of two dtypes, a number, a hole
    local a, b, d = ms.tensor({ 1 / 3 }), ms.tensor({ 2 / 7 }):reshape({}), ms.tensor({ -5.25e-3 })
    local h = ms.tensor({ 1 / 3 }):to('bf16')
    local want = { a:item(), 5, nil, b:item(), h:item(), d:item() }
    local item, totable, reads = M.item, M.totable, { item = 0, totable = 0 }
    M.item = function(...) reads.item = reads.item + 1; return item(...) end
    M.totable = function(...) reads.totable = reads.totable + 1; return totable(...) end
    local ok, got = pcall(train.host_values, { a, 5, nil, b, h, d }, 6)
    M.item, M.totable = item, totable
    assert(ok, got)
    for i = 1, 6 do assert.are.equal(want[i], got[i]) end
    assert.is_nil(got[3])
    assert.are_not.equal(want[1], want[5])   -- (the bf16 one rounded: read in its own group)
    assert.are.same({ item = 1, totable = 1 }, reads)
    -- the loop: the same run with each tensor read apart (item), the
    -- micro-batches' values noted; the logged loss is their mean as the
    -- loop computed it before (summed in order, then divided)
    local dir = tmpdir()
    local function run()
      train.run{ model = 'models.gpt2', preset = 'tiny', steps = 3, seq_len = 16, batch_size = 2, tokens_per_step = 128,
                 model_config = { n_layer = 1, n_embd = 32, n_head = 2 }, lr = 1e-2, warmup = 1,
                 sample_tokens = 0, save = false, quiet = true, out = dir, seed = 7, eval_every = 0 }
      return read_jsonl(dir .. '/metrics.jsonl')
    end
    local hv, calls = train.host_values, 0
    train.host_values = function(list, n)
      calls = calls + 1
      return hv(list, n)
    end
    local ok1, la = pcall(run)
    local apart = {}
    train.host_values = function(list, n)
      local r, v = {}, {}
      for i = 1, n do
        r[i] = T.is_tensor(list[i]) and list[i]:item() or list[i]
        v[i] = r[i]
      end
      apart[#apart + 1] = v
      return r
    end
    local ok2, lb = pcall(run)
    train.host_values = hv
    assert(ok1, la)
    assert(ok2, lb)
    assert.are.equal(3, calls)
    assert.are.equal(3, #la)
    for s = 1, 3 do
      assert.are.equal(4, #apart[s])
      local sum = 0
      for k = 1, 4 do sum = sum + apart[s][k] end
      assert.are.equal(sum / 4, la[s].loss)
      assert.are.equal(lb[s].loss, la[s].loss)
    end
    os.execute('rm -rf ' .. q(dir))
  end)

  it('--lr-schedule: cosine, linear, wsd (with decay_fraction and decay_shape) and constant at hand-picked steps', function()
    local base = { lr = 1, min_lr = 0.1, warmup = 2, steps = 10 }
    local function at(extra)
      local o = {}
      for k, v in pairs(base) do o[k] = v end
      for k, v in pairs(extra) do o[k] = v end
      local f = train.schedule(o)
      local r = {}
      for k = 1, 10 do r[k] = f(k) end
      return r
    end
    local function near(a, b) return math.abs(a - b) <= 1e-12 end
    local c = at({})                                   -- the default: cosine
    assert.is_true(near(c[1], 0.5) and near(c[2], 1) and near(c[3], 1))
    assert.is_true(near(c[7], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8))))
    local l = at({ lr_schedule = 'linear' })
    assert.is_true(near(l[3], 1) and near(l[7], 1 - 0.9 * 4 / 8) and near(l[10], 1 - 0.9 * 7 / 8))
    local w = at({ lr_schedule = 'wsd', decay_fraction = 0.3 })   -- 3 decay steps: 9, 10, 11
    for k = 2, 8 do assert.is_true(near(w[k], 1), k) end
    assert.is_true(near(w[9], 1 - 0.9 / 3) and near(w[10], 1 - 0.9 * 2 / 3))
    local q = at({ lr_schedule = 'wsd', decay_fraction = 0.3, decay_shape = 'sqrt' })
    assert.is_true(near(q[10], 1 - 0.9 * math.sqrt(2 / 3)))
    local k = at({ lr_schedule = 'constant' })
    assert.is_true(near(k[1], 0.5) and near(k[10], 1))
  end)

  it('parses flags: --key value, --key=value, dashes or underscores, --no-bool, model fields', function()
    local gpt2 = require 'models.gpt2'
    local o = train.parse_args({ '--steps', '10', '--batch_size=4', '--seq-len', '64', '--no-save', '--quiet',
      '--model.n_layer', '2', '--n-head', '2', '--lr', '3e-4' }, gpt2)
    assert.are.equal(10, o.steps)
    assert.are.equal(4, o.batch_size)
    assert.are.equal(64, o.seq_len)
    assert.is_false(o.save)
    assert.is_true(o.quiet)
    assert.are.equal(3e-4, o.lr)
    assert.are.same({ n_layer = 2, n_head = 2 }, o.model_config)
  end)

  it('tells model files, run configs and scripts apart by what they return', function()
    assert.are.equal('model', train.kind_of(require 'models.gpt2'))
    assert.are.equal('model', train.kind_of(require 'models.llama'))
    assert.are.equal('script', train.kind_of(nil))
    assert.are.equal('script', train.kind_of(function() end))
    assert.are.equal('config', train.kind_of({ model = 'models/gpt2.lua' }))
  end)
end)

describe('moonshard.data', function()
  it('builds the default corpus from the repository sources in sorted order', function()
    local files = data.source_files()
    assert.is_true(#files > 5)
    for i = 2, #files do assert.is_true(files[i - 1] < files[i]) end
    for _, f in ipairs(files) do
      assert.is_truthy(f:match('%.lua$') or f:match('%.[ch]$') or f:match('%.md$'), f)
      assert.is_falsy(f:match('^build'), f)
    end
    local c = data.corpus{ val_fraction = 0.1 }
    assert.are.equal(c.n, c.train.n + c.val.n)
    assert.are.equal(math.floor(c.n * 0.1), c.val.n)
  end)

  it('draws batch k as a pure function of (seed, k); y is x shifted by one', function()
    local c = data.corpus{ text = ('abcdefghijklmnopqrstuvwxyz'):rep(20), val_fraction = 0.1 }
    local L1 = data.Loader(c.train, { batch_size = 3, seq_len = 8, seed = 4 })
    local L2 = data.Loader(c.train, { batch_size = 3, seq_len = 8, seed = 4 })
    local x1, y1 = L1:next()
    L1:next()
    local x3 = L1:next()
    L2:set_state({ step = 2 })
    assert.are.same(x3:totable(), L2:next():totable())
    assert.are.equal('i64', x1.dtype)
    assert.are.same({ 3, 8 }, x1.shape)
    local xs, ys = x1:totable(), y1:totable()
    for b = 1, 3 do
      for t = 1, 7 do assert.are.equal(xs[b][t + 1], ys[b][t]) end
      -- consecutive letters
      assert.are.equal((xs[b][8] - 97 + 1) % 26 + 97, ys[b][8])
    end
  end)

  it('refuses data too short for the sequence length', function()
    local ok, err = pcall(data.corpus, { text = 'short', min_len = 33 })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('needs at least 33'))
  end)
end)
