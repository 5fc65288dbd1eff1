-- DeepSeek's sequence-wise balance loss (docs/moe.md, "The sequence-wise
-- balance loss") on the CPU: nn.moe.seq_aux_loss against the formula
-- written out token by token in f64, and against PyTorch's float64
-- fixtures of DeepSeek-V2's MoEGate and the V3 report's eq. 17-20
-- (tools/make_seq_aux_fixture.py); float64 finite differences through the
-- router; the models' sessions (seq_aux_begin / seq_aux_end) give the same
-- value and gradient, under activation checkpointing and released
-- activations too; DeepSeek-V2's and V3's training loss adds it; errors
-- name what is wrong.
local ms = require 'moonshard'
local nn = ms.nn
local A = ms.autograd
local moe = nn.moe
local S = require 'spec.support'
local vals = S.values

local function build(cfg, seed)
  ms.manual_seed(seed or 3)
  local m = nn.MoE(cfg):to('f64')
  if cfg.router_bias then
    m.gate.e_score_correction_bias:copy_(ms.randn({ cfg.experts }, { dtype = 'f32', seed = (seed or 3) + 50 }) * 0.3)
  end
  return m
end

-- the loss of layer m's last forward on x (B, T, H), written out per
-- token in Lua numbers: scores, the experts each token counts for (the
-- layer's own choice when choice is 'routing', the k best plain scores
-- when 'scores'), f and P per sequence (per_seq false: all tokens one)
local function reference(m, x, alpha, choice, per_seq)
  local H, E, k = m.dim, m.n_experts, m.top_k
  local N = x:numel() / H
  local Tn = per_seq and x.shape[x.ndim - 1] or N
  local logits = vals(x:detach():reshape({ N, H }):matmul(m.gate.weight:detach():t()))
  local st = rawget(m, '_stats')
  local ids = vals(st.ids)
  local total = 0
  for b = 0, N / Tn - 1 do
    local count, psum = {}, {}
    for e = 1, E do count[e], psum[e] = 0, 0 end
    for t = 0, Tn - 1 do
      local n = b * Tn + t
      local s, z = {}, 0
      if m.score == 'softmax' then
        local mx = -math.huge
        for e = 1, E do mx = math.max(mx, logits[n * E + e]) end
        for e = 1, E do s[e] = math.exp(logits[n * E + e] - mx); z = z + s[e] end
      else
        for e = 1, E do s[e] = 1 / (1 + math.exp(-logits[n * E + e])); z = z + s[e] end
      end
      for e = 1, E do psum[e] = psum[e] + s[e] / z end
      if choice == 'scores' then
        local idx = {}
        for e = 1, E do idx[e] = e end
        table.sort(idx, function(a, c) if s[a] ~= s[c] then return s[a] > s[c] end return a < c end)
        for j = 1, k do count[idx[j]] = count[idx[j]] + 1 end
      else
        for j = 1, k do local e = ids[n * k + j] + 1; count[e] = count[e] + 1 end
      end
    end
    for e = 1, E do total = total + (count[e] * E / (k * Tn)) * (psum[e] / Tn) end
  end
  return alpha * total / (N / Tn)
end

describe('nn.moe.seq_aux_loss', function()
  local layouts = {
    { name = 'softmax, greedy (DeepSeek-V2)', cfg = { dim = 6, hidden = 8, experts = 8, top_k = 2 } },
    { name = 'softmax, group-limited by the best (V2)', cfg = { dim = 6, hidden = 8, experts = 8, top_k = 2,
      n_group = 4, topk_group = 2, group_score = 'max', norm_topk = false } },
    { name = 'sigmoid, groups and routing bias (V3)', cfg = { dim = 6, hidden = 8, experts = 8, top_k = 3,
      score = 'sigmoid', n_group = 4, topk_group = 2, router_bias = true } },
    { name = 'sigmoid, top-1', cfg = { dim = 6, hidden = 8, experts = 4, top_k = 1, score = 'sigmoid' } },
  }
  for _, lay in ipairs(layouts) do
    it('against the formula token by token (f64, 1e-14): ' .. lay.name, function()
      local m = build(lay.cfg, 5)
      local x = ms.randn({ 3, 7, 6 }, { dtype = 'f64', seed = 9 })
      m(x)
      for _, choice in ipairs({ 'routing', 'scores' }) do
        for _, per_seq in ipairs({ true, false }) do
          local got = moe.seq_aux_loss({ m }, 0.01, { choice = choice, per_sequence = per_seq }):item()
          local want = reference(m, x, 0.01, choice, per_seq)
          assert.is_true(want > 0)
          assert.is_true(math.abs(got - want) <= 1e-14 * want, ('%s %s: %.17g against %.17g'):format(choice,
            tostring(per_seq), got, want))
        end
      end
    end)
  end

  it('the routing bias and the group limit change what "routing" counts, not what "scores" counts', function()
    local cfg = { dim = 6, hidden = 8, experts = 8, top_k = 2, score = 'sigmoid', n_group = 4, topk_group = 2,
      router_bias = true }
    local m = build(cfg, 5)
    local plain = build({ dim = 6, hidden = 8, experts = 8, top_k = 2, score = 'sigmoid' }, 5)
    local x = ms.randn({ 2, 9, 6 }, { dtype = 'f64', seed = 9 })
    m(x); plain(x)
    local a = moe.seq_aux_loss({ m }, 1, { choice = 'scores' }):item()
    assert.are.equal(moe.seq_aux_loss({ plain }, 1):item(), a)
    assert.are_not.equal(a, moe.seq_aux_loss({ m }, 1):item())
  end)

  it('sums over the layers; a 2-D input is one sequence; nil without statistics', function()
    local m1 = build({ dim = 6, hidden = 8, experts = 4, top_k = 2 }, 5)
    local m2 = build({ dim = 6, hidden = 8, experts = 4, top_k = 2, score = 'sigmoid' }, 6)
    local x = ms.randn({ 2, 5, 6 }, { dtype = 'f64', seed = 9 })
    m2(m1(x))
    local both = moe.seq_aux_loss({ m1, m2 }, 0.5):item()
    local h = m1(x)
    local one = moe.seq_aux_loss({ m1 }, 0.5):item()
    m2(h)
    assert.is_true(math.abs(both - (one + moe.seq_aux_loss({ m2 }, 0.5):item())) <= 1e-15)
    m1(x:reshape({ 10, 6 }))
    assert.are.equal(moe.seq_aux_loss({ m1 }, 0.5, { per_sequence = false }):item(), moe.seq_aux_loss({ m1 }, 0.5):item())
    m1:clear_stats()
    assert.is_nil(moe.seq_aux_loss({ m1 }, 0.5))
  end)

  it('evenly routed scores give alpha: f and P of 1 and 1 / E', function()
    -- a zero router: every score the same (softmax 1 / E), the top k the
    -- first k experts of every token, f = E / k on them
    local m = build({ dim = 4, hidden = 4, experts = 4, top_k = 2 }, 5)
    m.gate.weight:zero_()
    m(ms.randn({ 2, 3, 4 }, { dtype = 'f64', seed = 1 }))
    -- Σ_i f_i P_i = 2 experts x (4 / 2) x 1/4 = 1
    assert.is_true(math.abs(moe.seq_aux_loss({ m }, 0.3):item() - 0.3) <= 1e-15)
  end)

  it('DeepSeek-V2\'s MoEGate and the V3 report\'s formula, as PyTorch computes them (f64 fixtures): the loss '
    .. '(1e-12) and the gradients of the router and the input (1e-10)', function()
    local dir = 'spec/fixtures/seq_aux'
    local f = assert(io.open(dir .. '/cases.json', 'rb'))
    local meta = require('dkjson').decode(f:read('*a'))
    f:close()
    local n = 0
    for name, c in pairs(meta.cases) do
      local t = ms.load_safetensors(dir .. '/' .. name .. '.safetensors')
      local E, H = t.w.shape[1], t.w.shape[2]
      local m = nn.MoE { dim = H, hidden = 4, experts = E, top_k = c.k, score = c.score, n_group = c.n_group,
        topk_group = c.topk_group, group_score = c.score == 'softmax' and 'max' or 'top2',
        router_bias = c.score == 'sigmoid' }:to('f64')
      m.gate.weight:copy_(t.w)
      if c.score == 'sigmoid' then m.gate.e_score_correction_bias:copy_(t.bias) end
      m.gate.weight:requires_grad_()
      local x = t.x:reshape({ c.B, c.T, H }):clone():requires_grad_()
      m(x)
      local loss = moe.seq_aux_loss({ m }, c.alpha, { choice = c.choice, per_sequence = c.per_seq })
      local want = t.loss:item()
      assert.is_true(math.abs(loss:item() - want) <= 1e-12 * want, ('%s: %.17g against %.17g'):format(name,
        loss:item(), want))
      loss:backward()
      assert.is_true(S.relerr(m.gate.weight.grad, t.grad_w) <= 1e-10, name .. ' router')
      assert.is_true(S.relerr(x.grad:reshape({ c.B * c.T, H }), t.grad_x) <= 1e-10, name .. ' input')
      A.clear_tape()
      n = n + 1
    end
    assert.are.equal(5, n)
  end)

  it('float64 finite differences of the router and the input', function()
    for _, cfg in ipairs({ { dim = 5, hidden = 6, experts = 6, top_k = 2 },
      { dim = 5, hidden = 6, experts = 6, top_k = 2, score = 'sigmoid', n_group = 3, topk_group = 2,
        router_bias = true } }) do
      local m = build(cfg, 7)
      local x = ms.randn({ 2, 4, 5 }, { dtype = 'f64', seed = 3 }):requires_grad_()
      local w = m.gate.weight
      w:requires_grad_()
      for _, choice in ipairs({ 'routing', 'scores' }) do
        local worst = A.gradcheck(function()
          m(x)
          return moe.seq_aux_loss({ m }, 0.7, { choice = choice })
        end, { w, x })
        assert.is_true(worst < 1e-6, 'relative error ' .. worst)
      end
    end
  end)

  it('errors name the argument', function()
    local m = build({ dim = 6, hidden = 8, experts = 4, top_k = 2 }, 5)
    m(ms.randn({ 2, 3, 6 }, { dtype = 'f64', seed = 1 }))
    local function bad(fn, msg)
      local ok, err = pcall(fn)
      assert.is_false(ok)
      assert.matches(msg, tostring(err), 1, true)
    end
    bad(function() moe.seq_aux_loss({ m }, -1) end, 'moe.seq_aux_loss: alpha must be a non-negative number, got -1')
    bad(function() moe.seq_aux_loss({ m }, 0 / 0) end, 'moe.seq_aux_loss: alpha must be a non-negative number')
    bad(function() moe.seq_aux_loss({ m }, '0.1') end, 'moe.seq_aux_loss: alpha must be a non-negative number, got 0.1')
    bad(function() moe.seq_aux_loss({ m }, 0.1, { choice = 'bias' }) end,
      'moe.seq_aux_loss: choice must be routing or scores, got bias')
    bad(function() moe.seq_aux_loss({ m }, 0.1, { per_sequence = 1 }) end,
      'moe.seq_aux_loss: per_sequence must be a boolean, got 1')
    bad(function() moe.seq_aux_begin({ m }, { alpha = -2 }) end,
      'moe.seq_aux_begin: alpha must be a non-negative number, got -2')
    bad(function() moe.seq_aux_end(ms.zeros({ 1 }, { dtype = 'f64' }), moe.seq_aux_begin({ m }, { alpha = 1 })) end,
      'moe.seq_aux_end: no MoE layer of the session ran a forward')
    moe.seq_aux_begin({ m }, nil)
    -- the scores released by the backward
    local prev = A.release_activations
    A.release_activations = true
    local x = ms.randn({ 2, 3, 6 }, { dtype = 'f64', seed = 1 }):requires_grad_()
    local ok, err = pcall(function()
      m(x):sum():backward()
      bad(function() moe.seq_aux_loss({ m }, 0.1) end, 'released by its backward')
    end)
    A.release_activations = prev
    A.clear_tape()
    assert(ok, err)
  end)
end)

describe('seq_aux sessions (the models\' training loss)', function()
  local cfg = { dim = 6, hidden = 8, experts = 8, top_k = 2, score = 'sigmoid', n_group = 4, topk_group = 2,
    router_bias = true }

  -- two layers on x; the loss (sum of the output times a fixed tensor, plus
  -- the session's value through seq_aux_end when `session`, else the
  -- seq_aux_loss of the stats) times 3, backward; -> loss value, the
  -- routers' and the input's gradients
  local function run(session, wrap)
    local m1, m2 = build(cfg, 5), build(cfg, 6)
    local x = ms.randn({ 3, 5, 6 }, { dtype = 'f64', seed = 9 }):requires_grad_()
    local r = ms.randn({ 3, 5, 6 }, { dtype = 'f64', seed = 10 })
    m1.gate.weight:requires_grad_(); m2.gate.weight:requires_grad_()
    local box = session and moe.seq_aux_begin({ m1, m2 }, { alpha = 0.05, choice = 'scores' }) or nil
    local f = function(h) return m2(m1(h)) end
    local y = wrap and wrap(f, x) or f(x)
    local loss = (y * r):sum():reshape({ 1 })
    if session then loss = moe.seq_aux_end(loss, box)
    else loss = loss + moe.seq_aux_loss({ m1, m2 }, 0.05, { choice = 'scores' }) end
    local v = loss:item()
    ;(loss * 3):backward()
    local g = { m1.gate.weight.grad:clone(), m2.gate.weight.grad:clone(), x.grad:clone(),
      m1.experts[1].up_proj.weight.grad:clone() }
    moe.seq_aux_begin({ m1, m2 }, nil)
    A.clear_tape()
    return v, g
  end

  it('the session\'s value and gradients are seq_aux_loss\'s (1e-13); so under activation checkpointing and '
    .. 'with the activations released', function()
    local v0, g0 = run(false)
    local function same(v, g, what)
      assert.is_true(math.abs(v - v0) <= 1e-13 * math.abs(v0), what .. (': %.17g against %.17g'):format(v, v0))
      for i = 1, #g0 do assert.is_true(S.relerr(g[i], g0[i]) <= 1e-13, what .. ' gradient ' .. i) end
    end
    local vs, gs = run(true)
    same(vs, gs, 'session')
    local v, g = run(true, function(f, x) return A.checkpoint(f, x) end)
    same(v, g, 'checkpointed')
    local prev = A.release_activations
    A.release_activations = true
    local ok, err = pcall(function()
      local vr, gr = run(true)
      same(vr, gr, 'released')
      vr, gr = run(true, function(f, x) return A.checkpoint(f, x) end)
      same(vr, gr, 'released and checkpointed')
    end)
    A.release_activations = prev
    assert(ok, err)
  end)

  it('a session\'s layer that runs again without grad adds nothing twice; the session ends with nil', function()
    local m = build(cfg, 5)
    local x = ms.randn({ 2, 4, 6 }, { dtype = 'f64', seed = 9 })
    local box = moe.seq_aux_begin({ m }, { alpha = 1 })
    m(x)
    local v = moe.seq_aux_value(box):item()
    ms.no_grad(function() m(x) end)
    assert.are.equal(v, moe.seq_aux_value(box):item())
    assert.are.equal(1, #box.values)
    moe.seq_aux_begin({ m }, nil)
    m(x)
    assert.are.equal(1, #box.values)
    assert.is_nil(rawget(m, '_seq_aux'))
  end)

  it('a backward that skips seq_aux_end says so', function()
    local m = build(cfg, 5)
    m.gate.weight:requires_grad_()
    local x = ms.randn({ 2, 4, 6 }, { dtype = 'f64', seed = 9 })
    moe.seq_aux_begin({ m }, { alpha = 1 })
    local ok, err = pcall(function() m(x):sum():backward() end)
    moe.seq_aux_begin({ m }, nil)
    A.clear_tape()
    assert.is_false(ok)
    assert.matches('got no gradient at its loss (moe.seq_aux_end)', tostring(err), 1, true)
  end)
end)

describe('DeepSeek-V2 and V3 with aux_loss_alpha', function()
  for _, name in ipairs({ 'deepseek_v3', 'deepseek_v2' }) do
    local fam = require('models.' .. name)
    local function small(over)
      local c = { num_hidden_layers = 3, hidden_size = 16, intermediate_size = 24, moe_intermediate_size = 8,
        num_attention_heads = 2, num_key_value_heads = 2, kv_lora_rank = 8, q_lora_rank = 12, qk_rope_head_dim = 4,
        v_head_dim = 4, qk_nope_head_dim = 4, vocab_size = 40, n_routed_experts = 8, aux_loss_alpha = 0.05 }
      for k, v in pairs(over or {}) do c[k] = v end
      return fam.new('tiny', c):to('f64')
    end

    it(name .. ': the training loss is the cross-entropy plus alpha x every MoE layer\'s balance loss (per '
      .. 'sequence, or with seq_aux false over the batch); none in eval mode or at alpha 0', function()
      local m = small()
      -- (random routers and biases: no ties, every layer's routing its own)
      for n, p in m:named_parameters() do
        if n:match('gate%.weight$') then ms.normal_(p, 0, 0.5) end
      end
      for _, lm in ipairs(moe.layers(m)) do
        local b = lm:routing_bias()
        if b then b:copy_(ms.randn(b.shape, { dtype = b.dtype, seed = 4 }) * 0.2) end
      end
      local x, y = S.token_batch(3, 6, 40, 11)
      for _, seq in ipairs({ true, false }) do
        m.config.seq_aux = seq
        local l = m(x, y):item()
        local aux = moe.seq_aux_loss(moe.layers(m), 0.05, { choice = fam.seq_aux_choice, per_sequence = seq }):item()
        m:eval()
        local ce = m(x, y):item()
        m:train()
        assert.is_true(aux > 0.05, 'two MoE layers of about alpha each: ' .. aux)
        assert.is_true(math.abs(l - (ce + aux)) <= 1e-13, ('%.17g against %.17g + %.17g'):format(l, ce, aux))
      end
      m.config.aux_loss_alpha = 0
      local l0 = m(x, y):item()
      m:eval()
      assert.are.equal(l0, m(x, y):item())
    end)

    it(name .. ': finite differences through the model with it; activation checkpointing gives the same '
      .. 'gradients; AdamW steps lower the loss', function()
      local m = small()
      for n, p in m:named_parameters() do
        if not n:match('norm') then ms.normal_(p, 0, 0.3) else ms.normal_(p, 1, 0.1) end
      end
      local x, y = S.token_batch(2, 5, 40, 7)
      local L = m.model.layers
      local worst = A.gradcheck(function() return m(x, y) end, { L[3].mlp.gate.weight })
      assert.is_true(worst < 1e-6, 'relative error ' .. worst)
      A.clear_tape()
      local function grads()
        for _, p in ipairs(m:parameters()) do p.grad = nil end
        local l = m(x, y)
        l:backward()
        local g = {}
        for n, p in m:named_parameters() do g[n] = p.grad and p.grad:clone() end
        A.clear_tape()
        return l:item(), g
      end
      local l0, g0 = grads()
      nn.apply_activation_checkpointing(m, { class = 'LlamaDecoderLayer' })
      local l1, g1 = grads()
      assert.are.equal(l0, l1)
      for n, g in pairs(g0) do assert.is_true(S.relerr(g1[n], g) <= 1e-12, n) end
      local losses = S.adamw_losses(small(), x, y, 6, 1e-2)
      assert.is_true(losses[6] < losses[1], ('%g -> %g'):format(losses[1], losses[6]))
    end)
  end

  it('deepseek_v3 with multi-token prediction: its depths\' MoE layers add their terms too', function()
    local v3 = require 'models.deepseek_v3'
    local m = v3.new('tiny', { num_hidden_layers = 2, hidden_size = 16, intermediate_size = 24,
      moe_intermediate_size = 8, num_attention_heads = 2, num_key_value_heads = 2, kv_lora_rank = 8, q_lora_rank = 12,
      qk_rope_head_dim = 4, v_head_dim = 4, qk_nope_head_dim = 4, vocab_size = 40, aux_loss_alpha = 0.05,
      mtp_loss_weight = 0.3, num_nextn_predict_layers = 1 }):to('f64')
    local x, y = S.token_batch(2, 6, 40, 5)
    local l = m(x, y):item()
    local aux = moe.seq_aux_loss(moe.layers(m), 0.05, { choice = 'scores' }):item()
    assert.are.equal(2, #moe.layers(m))
    m:eval()
    local plain = m(x, y):item()
    assert.is_true(math.abs(l - (plain + aux)) <= 1e-13, ('%.17g against %.17g + %.17g'):format(l, plain, aux))
  end)

  it('a model whose layers are all dense adds nothing', function()
    local v3 = require 'models.deepseek_v3'
    local m = v3.new('tiny', { num_hidden_layers = 2, first_k_dense_replace = 2, aux_loss_alpha = 0.1 })
    local x, y = S.token_batch(2, 6, 256, 3)
    local l = m(x, y):item()
    m:eval()
    assert.are.equal(m(x, y):item(), l)
  end)

  it('a bad aux_loss_alpha or seq_aux is refused by name', function()
    for _, name in ipairs({ 'deepseek_v3', 'deepseek_v2' }) do
      local fam = require('models.' .. name)
      local ok, err = pcall(fam.new, 'tiny', { aux_loss_alpha = -0.1 })
      assert.is_false(ok)
      assert.matches('aux_loss_alpha', tostring(err), 1, true)
      ok, err = pcall(fam.new, 'tiny', { seq_aux = 'yes' })
      assert.is_false(ok)
      assert.matches('seq_aux', tostring(err), 1, true)
    end
  end)
end)
