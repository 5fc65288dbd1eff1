-- The load-balancing loss's sessions (nn.moe.aux_begin / aux_end,
-- docs/moe.md "The load-balancing loss"): Switch / GShard's loss over
-- every layer's tokens at once, as the models' training loss adds it
-- (output_router_logits), gets its exact gradient where the forward keeps
-- no graph from the router's scores: activation checkpointing (whole,
-- every N-th block, the op-level selective policy) and released
-- activations. On two layers and through Mixtral, Qwen3-MoE and Qwen2-MoE
-- in f64: the value is moe.aux_loss's bit for bit, the unchecked
-- gradients too, the checkpointed ones within 1e-12; bin/train's
-- checkpointed runs follow the unchecked curve, on one process and on two
-- (FSDP, expert, context and tensor parallel); errors name what is wrong.
local ms = require 'moonshard'
local nn = ms.nn
local A = ms.autograd
local moe = nn.moe
local S = require 'spec.support'
local q = S.shell_quote
local null = require('models.hf').null

local function build(cfg, seed)
  ms.manual_seed(seed or 3)
  return nn.MoE(cfg):to('f64')
end

-- the bits of t (f64), for bit-for-bit comparisons
local function same_bits(a, b, what)
  assert.are.same(a.shape, b.shape, what)
  local d = (a - b):abs():max():item()
  assert.is_true(d == 0, ('%s: differs by %g'):format(what, d))
end

describe('load-balancing loss sessions', function()
  local cfg = { dim = 6, hidden = 8, experts = 4, top_k = 2 }

  -- two layers on x; the loss (the output times a fixed tensor, plus the
  -- session's loss through aux_end when `session`, else coef x
  -- moe.aux_loss of the stats), times 3, backward; -> loss value, the
  -- routers', the input's and an expert's gradients
  local function run(session, wrap)
    local m1, m2 = build(cfg, 5), build(cfg, 6)
    ms.normal_(m1.gate.weight, 0, 1); ms.normal_(m2.gate.weight, 0, 1)
    local x = ms.randn({ 3, 5, 6 }, { dtype = 'f64', seed = 9 }):requires_grad_()
    local r = ms.randn({ 3, 5, 6 }, { dtype = 'f64', seed = 10 })
    local box = session and moe.aux_begin({ m1, m2 }, { coef = 0.7 }) or nil
    local y = wrap and wrap(m1, m2, x) or m2(m1(x))
    local loss = (y * r):sum():reshape({ 1 })
    if session then loss = moe.aux_end(loss, box)
    else loss = loss + moe.aux_loss({ m1, m2 }) * 0.7 end
    local v = loss:item()
    ;(loss * 3):backward()
    local g = { m1.gate.weight.grad:clone(), m2.gate.weight.grad:clone(), x.grad:clone(),
      m1.experts[1].up_proj.weight.grad:clone() }
    moe.aux_begin({ m1, m2 }, nil)
    A.clear_tape()
    return v, g
  end

  it('the value and the gradients are aux_loss\'s: bit for bit unchecked; within 1e-13 under activation '
    .. 'checkpointing (whole, one layer of two, the op policy) and with the activations released', function()
    local v0, g0 = run(false)
    local vs, gs = run(true)
    assert.are.equal(v0, vs)
    for i = 1, #g0 do same_bits(gs[i], g0[i], 'session gradient ' .. i) end
    local function same(v, g, what)
      assert.are.equal(v0, v, what)
      for i = 1, #g0 do
        local e = S.relerr(g[i], g0[i])
        assert.is_true(e <= 1e-13, ('%s gradient %d: %g'):format(what, i, e))
      end
    end
    local wraps = {
      { 'checkpointed', function(m1, m2, x) return A.checkpoint(function(h) return m2(m1(h)) end, x) end },
      -- (the first layer's graph kept, the second's recomputed)
      { 'the second layer checkpointed', function(m1, m2, x) return A.checkpoint(m2, m1(x)) end },
      { 'each checkpointed', function(m1, m2, x) return A.checkpoint(m2, A.checkpoint(m1, x)) end },
      { 'the op policy', function(m1, m2, x) return A.checkpoint_policy('op', function(h) return m2(m1(h)) end, x) end },
    }
    for _, w in ipairs(wraps) do
      local v, g = run(true, w[2])
      same(v, g, w[1])
      -- (without the session the checkpointed gradients miss the loss's)
      if w[1] == 'checkpointed' then
        local _, gn = run(false, w[2])
        assert.is_true(S.relerr(gn[1], g0[1]) > 1e-3, 'the plain loss under a checkpoint has no gradient')
      end
    end
    local prev = A.release_activations
    A.release_activations = true
    local ok, err = pcall(function()
      local vr, gr = run(true)
      same(vr, gr, 'released')
      vr, gr = run(true, wraps[1][2])
      same(vr, gr, 'released and checkpointed')
    end)
    A.release_activations = prev
    assert(ok, err)
  end)

  it('a layer that runs again without grad adds nothing twice; aux_begin with nil ends the session', function()
    local m = build(cfg, 5)
    local x = ms.randn({ 2, 4, 6 }, { dtype = 'f64', seed = 9 })
    local box = moe.aux_begin({ m }, {})
    m(x)
    local v = moe.aux_value(box):item()
    assert.are.equal(moe.aux_loss({ m }):item(), v)
    ms.no_grad(function() m(x * 2) end)
    assert.are.equal(v, moe.aux_value(box):item())
    moe.aux_begin({ m }, nil)
    assert.is_nil(rawget(m, '_aux'))
    m(x * 2)
    assert.are.equal(v, moe.aux_value(box):item())
  end)

  it('errors: a backward that skips aux_end, no layer run, a bad coef', function()
    local m = build(cfg, 5)
    m.gate.weight:requires_grad_()
    local x = ms.randn({ 2, 4, 6 }, { dtype = 'f64', seed = 9 })
    moe.aux_begin({ m }, {})
    local ok, err = pcall(function() A.checkpoint(m, x):sum():backward() end)
    moe.aux_begin({ m }, nil)
    A.clear_tape()
    assert.is_false(ok)
    assert.matches('got no gradient at its loss (moe.aux_end)', tostring(err), 1, true)
    local box = moe.aux_begin({ m }, { coef = 2 })
    ok, err = pcall(moe.aux_end, ms.zeros({ 1 }, { dtype = 'f64' }), box)
    assert.is_false(ok)
    assert.matches('no MoE layer of the session ran a forward', tostring(err), 1, true)
    moe.aux_begin({ m }, nil)
    for _, c in ipairs({ -1, 0 / 0, 'x' }) do
      ok, err = pcall(moe.aux_begin, { m }, { coef = c })
      assert.is_false(ok)
      assert.matches('moe.aux_begin: coef must be a non-negative number', tostring(err), 1, true)
    end
  end)
end)

describe('the models\' load-balancing loss (output_router_logits) under activation checkpointing', function()
  local fams = {
    { 'mixtral', 'LlamaDecoderLayer', { vocab_size = 40, hidden_size = 8, intermediate_size = 12,
      num_hidden_layers = 3, num_attention_heads = 2, num_key_value_heads = 1, max_position_embeddings = 16,
      num_local_experts = 4, num_experts_per_tok = 2, output_router_logits = true, router_aux_loss_coef = 1,
      bos_token_id = null, eos_token_id = null } },
    { 'qwen3_moe', 'LlamaDecoderLayer', { vocab_size = 40, hidden_size = 16, intermediate_size = 20,
      moe_intermediate_size = 12, num_hidden_layers = 3, num_attention_heads = 2, num_key_value_heads = 1,
      head_dim = 8, max_position_embeddings = 16, num_experts = 4, num_experts_per_tok = 2, norm_topk_prob = true,
      output_router_logits = true, router_aux_loss_coef = 1 } },
    { 'qwen2_moe', 'LlamaDecoderLayer', { vocab_size = 40, hidden_size = 16, intermediate_size = 20,
      moe_intermediate_size = 12, shared_expert_intermediate_size = 10, num_hidden_layers = 3,
      num_attention_heads = 2, num_key_value_heads = 1, max_position_embeddings = 16, num_experts = 4,
      num_experts_per_tok = 2, mlp_only_layers = { 1 }, output_router_logits = true, router_aux_loss_coef = 1 } },
  }
  for _, f in ipairs(fams) do
    local name, cls, cfg = f[1], f[2], f[3]
    it(name .. ': checkpointed (full, every 2nd block, the op policy; with the activations released too) the '
      .. 'loss is the same and every gradient within 1e-12 (f64)', function()
      local fam = require('models.' .. name)
      local x, y = S.token_batch(2, 6, 40, 7)
      local function grads(ac)
        ms.manual_seed(3)
        local m = fam.new(cfg):to('f64')
        -- (routers far from even: the loss's gradient well above rounding)
        for n, p in m:named_parameters() do if n:match('gate%.weight$') then ms.normal_(p, 0, 1) end end
        if ac then nn.apply_activation_checkpointing(m, ac) end
        local l = m(x, y)
        l:backward()
        local g = {}
        for n, p in m:named_parameters() do g[n] = p.grad and p.grad:clone() end
        A.clear_tape()
        return l:item(), g, m
      end
      local l0, g0, m0 = grads(nil)
      local routers = 0
      for n in pairs(g0) do if n:match('%.gate%.weight$') then routers = routers + 1 end end
      assert.are.equal(#moe.layers(m0), routers)
      -- (the loss's share of a router's gradient: what a checkpoint lost before the session)
      m0.config.output_router_logits = false
      for _, p in ipairs(m0:parameters()) do p.grad = nil end
      m0(x, y):backward()
      A.clear_tape()
      local share = 0
      for n, p in m0:named_parameters() do
        if n:match('%.gate%.weight$') then share = math.max(share, S.relerr(p.grad, g0[n])) end
      end
      assert.is_true(share > 0.05, name .. ': the loss\'s share of the routers\' gradients ' .. share)
      local cases = {
        { 'full', { class = cls } },
        { 'every 2nd', { class = cls, every = 2 } },
        { 'op', { class = cls, policy = 'op' } },
      }
      local function check(what, ac)
        local l, g = grads(ac)
        assert.are.equal(l0, l, what)
        for n, want in pairs(g0) do
          assert.is_not_nil(g[n], what .. ': ' .. n)
          local e = S.relerr(g[n], want)
          assert.is_true(e <= 1e-12, ('%s %s: %s relative %g'):format(name, what, n, e))
        end
      end
      for _, c in ipairs(cases) do check(c[1], c[2]) end
      local prev = A.release_activations
      A.release_activations = true
      local ok, err = pcall(function()
        check('released', nil)
        check('full, released', cases[1][2])
      end)
      A.release_activations = prev
      assert(ok, err)
    end)
  end
end)

describe('bin/train with the load-balancing loss, checkpointed', function()
  local dir = S.tmpdir()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)
  local corpus = S.fixed_corpus(dir, 20000)
  -- (the loss on, at a weight that moves the routers)
  local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 48 '
    .. '--model.output_router_logits true --model.router_aux_loss_coef 0.5 --seq-len 16 --lr 1e-2 --warmup 1 '
    .. '--eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 1 --data ' .. q(corpus)

  local function run(model, extra, out, nproc)
    local status, text = S.bin_train(('%s%s %s %s --steps 5 --out %s'):format(
      nproc and ('--nproc-per-node %d --device cpu '):format(nproc) or '', model, flags, extra, q(out)))
    assert.are.equal(0, status, text)
    return S.run_losses(out), text
  end

  it('mixtral and qwen3_moe: --activation-checkpointing full, 2 and op follow the unchecked curve (1e-9); so '
    .. 'do two micro-batches a step, and two ranks under --fsdp, --ep 2, --cp 2 and --tp 2', function()
    for _, m in ipairs({ 'models/mixtral.lua', 'models/qwen3_moe.lua' }) do
      local tag = m:match('models/(.*)%.lua')
      local one = run(m, '--batch-size 4', dir .. '/' .. tag .. 'one')
      for _, how in ipairs({ 'full', '2', 'op' }) do
        local got, text = run(m, '--batch-size 4 --activation-checkpointing ' .. how, dir .. '/' .. tag .. 'ac' .. how)
        assert.is_truthy(text:find('activation checkpointing: ', 1, true), text)
        S.close_losses(one, got, 1, 5, tag .. ' --activation-checkpointing ' .. how, 1e-9)
      end
    end
    local m = 'models/mixtral.lua'
    -- two micro-batches a step: each one's session, its gradient scaled as its loss
    local acc = run(m, '--batch-size 2 --tokens-per-step 64', dir .. '/accum')
    S.close_losses(acc, run(m, '--batch-size 2 --tokens-per-step 64 --activation-checkpointing full',
      dir .. '/accumac'), 1, 5, 'mixtral, two micro-batches, checkpointed', 1e-9)
    -- two ranks (each rank's loss over its own tokens): checkpointed as not, under FSDP, expert, context and
    -- tensor parallelism (the layer's forward_ep and tp paths)
    for _, how in ipairs({ '--fsdp FULL_SHARD --batch-size 2', '--ep 2 --batch-size 2', '--cp 2 --batch-size 4',
      '--tp 2 --batch-size 4' }) do
      local tag = how:gsub('[^%w]', '')
      local two = run(m, how, dir .. '/' .. tag, 2)
      S.close_losses(two, run(m, how .. ' --activation-checkpointing full', dir .. '/' .. tag .. 'ac', 2), 1, 5,
        'mixtral ' .. how .. ', checkpointed', 1e-9)
    end
  end)
end)
