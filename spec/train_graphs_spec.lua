-- bin/train --cuda-graphs on the CPU: the flags parse, every combination it
-- cannot take is a usage error naming both options (before anything is
-- written: a resumed run's metrics stay), and the step the graphs capture
-- (train.lua's grads_of, which the eager loop runs too) keeps its losses
-- when backward releases the activations under gradient accumulation.
-- The captured runs themselves: spec/gpu_train_graphs_spec.lua (#gpu).
local train = require 'moonshard.train'
local S = require 'spec.support'
local q, tmpdir = S.shell_quote, S.tmpdir

-- the usage error of fn() (a failure if it passes or raises anything else)
local function usage_of(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok, 'no error')
  assert.is_true(train.is_usage_error(err), 'not a usage error: ' .. tostring(err))
  return tostring(err)
end

local function has(text, ...)
  for _, w in ipairs({ ... }) do assert.is_truthy(text:find(w, 1, true), ('"%s" not in: %s'):format(w, text)) end
end

local tiny = { model = 'models.gpt2', preset = 'tiny', model_config = { n_layer = 1, n_embd = 32, n_head = 2 },
  seq_len = 16, batch_size = 2, lr = 1e-2, warmup = 1, eval_every = 0, eval_iters = 1, sample_tokens = 0,
  save = false, quiet = true }
local function with(extra)
  local o = {}
  for k, v in pairs(tiny) do o[k] = v end
  for k, v in pairs(extra) do o[k] = v end
  return o
end

describe('bin/train --cuda-graphs (CPU side)', function()
  it('parses --overlap-grad-reduce (on by default) and --no-overlap-grad-reduce', function()
    assert.is_true(train.defaults().overlap_grad_reduce)
    assert.is_false(train.parse_args({ '--no-overlap-grad-reduce' }).overlap_grad_reduce)
    assert.is_true(train.parse_args({ '--overlap-grad-reduce' }).overlap_grad_reduce)
    has(train.usage_text(), '--overlap-grad-reduce')
  end)

  it('parses --cuda-graphs, --no-cuda-graphs and --graph-warmup N (N >= 1; 3 by default)', function()
    local o = train.parse_args({ '--cuda-graphs', '--graph-warmup', '5' })
    assert.is_true(o.cuda_graphs)
    assert.are.equal(5, o.graph_warmup)
    assert.is_false(train.parse_args({ '--no-cuda-graphs' }).cuda_graphs)
    assert.is_true(train.parse_args({ '--cuda-graphs=true' }).cuda_graphs)
    assert.is_false(train.defaults().cuda_graphs)
    assert.are.equal(3, train.defaults().graph_warmup)
    has(usage_of(function() train.parse_args({ '--graph-warmup', '0' }) end), '--graph-warmup must be > 0')
    has(usage_of(function() train.parse_args({ '--graph-warmup', 'x' }) end), '--graph-warmup expects a number')
    has(train.usage_text(), '--cuda-graphs', '--graph-warmup')
  end)

  it('parses --graph-collectives on|off (off by default); anything else is a usage error naming it', function()
    assert.are.equal('off', train.defaults().graph_collectives)
    assert.are.equal('off', train.parse_args({ '--graph-collectives', 'off' }).graph_collectives)
    assert.are.equal('on', train.parse_args({ '--graph-collectives=on' }).graph_collectives)
    has(usage_of(function() train.check_options(train.parse_args({ '--graph-collectives', 'maybe' }), 'options') end),
      'graph_collectives must be on or off', 'maybe')
    train.check_options({ graph_collectives = 'off' }, 'options')
    has(train.usage_text(), '--graph-collectives')
    -- (taken with --cuda-graphs, one process or several data parallel)
    train.check_cuda_graphs({ cuda_graphs = true, device = 'cuda', graph_collectives = 'off' }, 2)
  end)

  -- graph A's choice for a data-parallel step, with a stubbed capture: the
  -- step with its all-reduce when it can be captured on every rank, else
  -- one warning naming why and the step without it, else nothing
  it('graph A: the all-reduce in the graph, or one warning and the split, agreed by every rank', function()
    -- fails: the set of with_reduce values whose capture fails on this rank
    local function run(coll, fails, others_ok)
      local r = { captures = {}, warnings = {}, agreed = {}, discarded = {} }
      local c = {
        coll = coll, clipping = true,
        capture = function(with_reduce)
          r.captures[#r.captures + 1] = with_reduce
          if fails[with_reduce] then return nil, ('refused %s'):format(tostring(with_reduce)) end
          return { with_reduce = with_reduce }, { losses = { with_reduce } }
        end,
        warn = function(m) r.warnings[#r.warnings + 1] = m end,
        discard = function(g) r.discarded[#r.discarded + 1] = g end,
      }
      if others_ok ~= nil then
        c.agree = function(ok)
          r.agreed[#r.agreed + 1] = ok
          return ok and others_ok
        end
      end
      r.g, r.out, r.coll = train.capture_graph_a(c)
      return r
    end
    -- on, captured (one process; two, every rank): one capture, no warning
    for _, world in ipairs({ 1, 2 }) do
      local others = world > 1 or nil
      local r = run(true, {}, others)
      assert.are.same({ true }, r.captures)
      assert.is_true(r.g.with_reduce)
      assert.is_true(r.coll)
      assert.are.same({ true }, r.out.losses)
      assert.are.same({}, r.warnings)
      assert.are.same(others and { true } or {}, r.agreed)
    end
    -- on, this rank's capture refused: the split, one warning naming why;
    -- every rank is told
    local r = run(true, { [true] = true }, true)
    assert.are.same({ true, false }, r.captures)
    assert.are.same({ false }, r.agreed)
    assert.is_false(r.coll)
    assert.is_false(r.g.with_reduce)
    assert.are.equal(1, #r.warnings)
    has(r.warnings[1], 'all-reduce could not be captured', 'without it', 'clipping eager', 'refused true')
    assert.are.same({}, r.discarded)
    -- on, captured here but not on another rank: this graph discarded, the split
    r = run(true, {}, false)
    assert.are.same({ true, false }, r.captures)
    assert.are.equal(1, #r.discarded)
    assert.is_true(r.discarded[1].with_reduce)
    assert.is_false(r.coll)
    has(r.warnings[1], 'another rank')
    -- off: the split only, nobody asked, no warning
    r = run(false, {}, true)
    assert.are.same({ false }, r.captures)
    assert.are.same({}, r.agreed)
    assert.are.same({}, r.warnings)
    assert.is_false(r.coll)
    -- neither can be captured: nil and the split's reason (the caller trains eagerly)
    r = run(true, { [true] = true, [false] = true })
    assert.is_nil(r.g)
    assert.are.equal('refused false', r.out)
    assert.are.equal(1, #r.warnings)
  end)

  it('refuses each option it cannot combine with, naming both', function()
    local base = { cuda_graphs = true, device = 'cuda', tp = 1, pp = 1, ep = 1, cp = 1, float8 = 'off',
      lora_dropout = 0, moe_bias_rate = 0 }
    local function refused(extra, world, ...)
      local o = {}
      for k, v in pairs(base) do o[k] = v end
      for k, v in pairs(extra) do o[k] = v end
      has(usage_of(function() train.check_cuda_graphs(o, world or 1) end), '--cuda-graphs', ...)
    end
    refused({ device = 'cpu' }, 1, '--device cuda', '--device cpu')
    refused({ tp = 2 }, 1, '--tp 2')
    refused({ pp = 2 }, 1, '--pp 2')
    refused({ ep = 4 }, 1, '--ep 4')
    refused({ cp = 2 }, 1, '--cp 2')
    refused({ fsdp = 'FULL_SHARD' }, 2, '--fsdp FULL_SHARD', 'fixed addresses', 'NO_SHARD, do capture')
    refused({ fsdp = 'SHARD_GRAD_OP' }, 4, '--fsdp SHARD_GRAD_OP')
    refused({ fsdp = 'HYBRID_SHARD' }, 4, '--fsdp HYBRID_SHARD')
    refused({ tp = 2 }, 4, '--tp 2')
    refused({ lora_dropout = 0.1 }, 1, '--lora-dropout 0.1')
    refused({ moe_bias_rate = 1e-3 }, 1, '--moe-bias-rate 0.001')
    -- what it takes: cuda, one process or several data parallel (--fsdp
    -- off or NO_SHARD), --float8's recipes, and nothing at all without
    -- --cuda-graphs
    train.check_cuda_graphs(base, 1)
    local function taken(extra, world)
      local o = {}
      for k, v in pairs(base) do o[k] = v end
      for k, v in pairs(extra) do o[k] = v end
      train.check_cuda_graphs(o, world)
    end
    taken({ fsdp = 'off' }, 1)
    taken({}, 2)
    taken({ fsdp = 'off' }, 8)
    taken({ fsdp = 'NO_SHARD' }, 2)
    taken({ fsdp = 'NO_SHARD' }, 1)
    for _, r in ipairs({ 'tensorwise', 'rowwise', 'rowwise_with_gw_hp', 'blockwise' }) do taken({ float8 = r }, 1) end
    taken({ float8 = 'rowwise' }, 2)
    train.check_cuda_graphs({ cuda_graphs = false, device = 'cpu', tp = 4 }, 8)
  end)

  it('refuses a model with dropout (named by its config field, or by the module) or MoE layers', function()
    local gpt2 = require 'models.gpt2'
    local o = { cuda_graphs = true }
    local m = gpt2.new('tiny', { n_layer = 1, n_embd = 32, n_head = 2, resid_pdrop = 0.1 })
    has(usage_of(function() train.check_cuda_graphs_model(o, m) end), '--cuda-graphs with dropout',
      '--model.resid_pdrop 0.1')
    train.check_cuda_graphs_model({ cuda_graphs = false }, m)
    local clean = gpt2.new('tiny', { n_layer = 1, n_embd = 32, n_head = 2 })
    train.check_cuda_graphs_model(o, clean)
    -- (a Dropout that no config field names)
    local ms = require 'moonshard'
    clean:register_module('extra_drop', ms.nn.Dropout(0.25))
    has(usage_of(function() train.check_cuda_graphs_model(o, clean) end), 'extra_drop', 'p = 0.25')
    local mixtral = require 'models.mixtral'
    local moe = mixtral.new('tiny', { num_hidden_layers = 1 })
    has(usage_of(function() train.check_cuda_graphs_model(o, moe) end), '--cuda-graphs with a mixture-of-experts',
      '1 MoE layers')
  end)

  it('on the CPU: a usage error naming the device (exit status 2), before a resumed run\'s metrics are touched',
    function()
    local dir = tmpdir()
    local corpus = S.fixed_corpus(dir, 20000)
    local flags = ('--preset tiny --model.n_layer 1 --model.n_embd 32 --model.n_head 2 --seq-len 16 --batch-size 2 '
      .. '--warmup 1 --eval-every 0 --eval-iters 1 --sample-tokens 0 --no-save --data %s'):format(q(corpus))
    local st, text = S.bin_train(('models/gpt2.lua %s --steps 1 --cuda-graphs --out %s/a'):format(flags, q(dir)))
    assert.are.equal(2, st, text)
    has(text, '--cuda-graphs needs --device cuda', '--device cpu')
    assert.is_falsy(text:find('stack traceback', 1, true), text)
    assert.is_nil(io.open(dir .. '/a/metrics.jsonl'), 'the refused run wrote metrics')
    -- a run checkpointed at step 2, resumed with --cuda-graphs on the CPU: refused, its files as they were
    st, text = S.bin_train(('models/gpt2.lua %s --steps 4 --stop-at 2 --out %s/b'):format(flags, q(dir)))
    assert.are.equal(0, st, text)
    local before = S.slurp(dir .. '/b/metrics.jsonl')
    st, text = S.bin_train(('--resume %s/b --cuda-graphs'):format(q(dir)))
    assert.are.equal(2, st, text)
    has(text, '--cuda-graphs needs --device cuda', '--no-cuda-graphs')
    assert.are.equal(before, S.slurp(dir .. '/b/metrics.jsonl'))
    -- other combinations from the command line, on cuda (refused before a device is touched)
    st, text = S.bin_train(('models/gpt2.lua %s --steps 1 --cuda-graphs --device cuda --tp 2'):format(flags))
    assert.are.equal(2, st, text)
    has(text, '--cuda-graphs with --tp 2')
    os.execute('rm -rf ' .. q(dir))
  end)

  it('the shared step: with gradient accumulation and clipping the losses and norms are those with the '
    .. 'activations kept (the read values outlive backward\'s release)', function()
    local dir = tmpdir()
    local a = train.run(with({ out = dir .. '/a', steps = 3, tokens_per_step = 64, grad_clip = 0.5,
      release_activations = true }))
    local b = train.run(with({ out = dir .. '/b', steps = 3, tokens_per_step = 64, grad_clip = 0.5,
      release_activations = false }))
    local la, lb = S.run_losses(dir .. '/a'), S.run_losses(dir .. '/b')
    local ga, gb = S.run_grad_norms(dir .. '/a'), S.run_grad_norms(dir .. '/b')
    for s = 1, 3 do
      assert.is_number(la[s])
      assert.are.equal(lb[s], la[s], 'step ' .. s)
      assert.are.equal(gb[s], ga[s], 'step ' .. s)
    end
    -- (clipping at 0.5 is active: the norms are above it)
    assert.is_true(ga[1] > 0.5, tostring(ga[1]))
    assert.are.equal(a.final_loss, b.final_loss)
    os.execute('rm -rf ' .. q(dir))
  end)
end)
