-- Mixture-of-experts layers (nn.MoE, docs/moe.md) on the CPU: the slot
-- sort and the top-k against naive references; the layer against a
-- per-token loop of the routing math (f64); float64 finite-difference
-- gradients of the input, the router and the experts; experts no token
-- chose get zero gradients; the load-balancing loss as transformers'
-- formula; one expert is the dense SwiGLU MLP; scale_input (Llama 4: the
-- weights on the experts' inputs) against the same loop; errors name what
-- is wrong.
local ms = require 'moonshard'
local nn = ms.nn
local A = ms.autograd
local moe = nn.moe

local S = require 'spec.support'
local vals = S.values

-- the reference of one layer's output, token by token (f64 values)
local function reference(m, x)
  local H, E, k = m.dim, m.n_experts, m.top_k
  local N = x:numel() / H
  local x2 = x:detach():reshape({ N, H })
  local logits = x2:matmul(m[m.router_name].weight:detach():t())
  local out = ms.zeros({ N, H }, { dtype = 'f64' })
  for n = 1, N do
    local row = vals(logits:narrow(1, n, 1))
    local score = {}
    if m.score == 'softmax' then
      local mx = -math.huge
      for e = 1, E do mx = math.max(mx, row[e]) end
      local z = 0
      for e = 1, E do z = z + math.exp(row[e] - mx) end
      for e = 1, E do score[e] = math.exp(row[e] - mx) / z end
    else
      for e = 1, E do score[e] = 1 / (1 + math.exp(-row[e])) end
    end
    local idx = {}
    for e = 1, E do idx[e] = e end
    table.sort(idx, function(a, b) if score[a] ~= score[b] then return score[a] > score[b] end return a < b end)
    local wsum = 0
    for j = 1, k do wsum = wsum + score[idx[j]] end
    local xr = x2:narrow(1, n, 1)
    local acc = ms.zeros({ 1, H }, { dtype = 'f64' })
    for j = 1, k do
      local w = score[idx[j]]
      if m.norm_topk then w = w / wsum end   -- (top-1 too: weight 1, as transformers)
      w = w * m.route_scale
      if m.scale_input then   -- (Llama 4: the weight scales the expert's input)
        acc = acc + A.no_grad(function() return m.experts[idx[j]](xr * w) end)
      else
        acc = acc + A.no_grad(function() return m.experts[idx[j]](xr) end) * w
      end
    end
    if m.shared_name then acc = acc + A.no_grad(function() return m[m.shared_name](xr) end) end
    out:narrow(1, n, 1):copy_(acc)
  end
  return out
end

local function build(cfg, seed)
  ms.manual_seed(seed or 3)
  local m = nn.MoE(cfg):to('f64')
  for _, p in ipairs(m:parameters()) do ms.normal_(p, 0, 0.5) end
  return m
end

describe('nn.MoE', function()
  before_each(function() A.clear_tape() end)

  it('sort_slots: the slots by expert, stable; inv, tok, back; counts; padded runs; a bad id is named', function()
    local ids = ms.tensor({ { 2, 0 }, { 1, 2 }, { 0, 3 }, { 2, 1 }, { 3, 0 } }, { dtype = 'i64' })
    local st = moe.sort_slots(ids, 5)
    assert.are.same({ 1, 4, 9, 2, 7, 0, 3, 6, 5, 8 }, vals(st.order))
    assert.are.same({ 3, 2, 3, 2, 0 }, st.counts)
    assert.are.same(st.counts, st.rows)
    assert.are.equal(10, st.M)
    assert.is_false(st.pads)
    for j, s in ipairs(vals(st.order)) do
      assert.are.equal(j - 1, vals(st.inv)[s + 1])
      assert.are.equal(math.floor(s / 2), vals(st.tok)[j])
      assert.are.equal(s, vals(st.back)[j])
    end
    -- runs padded to multiples of 4: rows 0-3 expert 0 (3 and a pad), 4-7 expert 1 (2 and 2 pads), ...
    local p = moe.sort_slots(ids, 5, 4)
    assert.are.same({ 4, 4, 4, 4, 0 }, p.rows)
    assert.are.equal(16, p.M)
    assert.is_true(p.pads)
    assert.are.same({ 0, 2, 4, 5, 1, 3, 5, 5, 0, 1, 3, 5, 2, 4, 5, 5 }, vals(p.tok))
    assert.are.same({ 1, 4, 9, 10, 2, 7, 10, 10, 0, 3, 6, 10, 5, 8, 10, 10 }, vals(p.back))
    for s, r in ipairs(vals(p.inv)) do assert.are.equal(s - 1, vals(p.back)[r + 1]) end
    -- random ids against Lua's sort by (expert, slot)
    local rows, st0 = {}, 12345
    for i = 1, 40 do
      rows[i] = {}
      for j = 1, 3 do st0 = (st0 * 1103515245 + 12345) % 2147483648; rows[i][j] = st0 % 7 end
    end
    local r = ms.tensor(rows, { dtype = 'i64' })
    local q = moe.sort_slots(r, 7)
    local rv = vals(r)
    local want = {}
    for s = 0, #rv - 1 do want[#want + 1] = s end
    table.sort(want, function(a, b)
      if rv[a + 1] ~= rv[b + 1] then return rv[a + 1] < rv[b + 1] end
      return a < b
    end)
    assert.are.same(want, vals(q.order))
    local total = 0
    for _, c in ipairs(q.counts) do total = total + c end
    assert.are.equal(120, total)
    local ok, err = pcall(moe.sort_slots, ms.tensor({ { 0, 4 } }, { dtype = 'i64' }), 4)
    assert.is_false(ok)
    assert.matches('moe: expert id 4 at slot 1 is outside [0, 4)', tostring(err), 1, true)
  end)

  it('sort_slots_on (ms_moe_sort, its CPU path): sort_slots\' table from one op; a bad id named; bad outputs '
    .. 'named', function()
    local seed = 777
    local function ids_of(N, k, E, skip, one)
      local rows = {}
      for i = 1, N do
        rows[i] = {}
        for j = 1, k do
          seed = seed * 16807 % 2147483647   -- (exact in doubles)
          local e = seed % E
          if one then e = one elseif e == skip then e = (e + 1) % E end
          rows[i][j] = e
        end
      end
      return ms.tensor(rows, { dtype = 'i64' })
    end
    for _, c in ipairs({ { 40, 3, 7, 1 }, { 40, 3, 7, 4 }, { 33, 2, 5, 8, 2 }, { 25, 4, 6, 4, nil, 3 }, { 1, 1, 1, 1 } }) do
      local ids = ids_of(c[1], c[2], c[3], c[5], c[6])
      local want, got = moe.sort_slots(ids, c[3], c[4]), moe.sort_slots_on(ids, c[3], c[4])
      for _, f in ipairs({ 'order', 'inv', 'tok', 'back' }) do assert.are.same(vals(want[f]), vals(got[f]), f) end
      assert.are.same(want.counts, got.counts)
      assert.are.same(want.rows, got.rows)
      assert.are.equal(want.M, got.M)
      assert.are.equal(want.pads, got.pads)
      if c[5] then assert.are.equal(0, got.counts[c[5] + 1]) end
      if c[6] then assert.are.equal(c[1] * c[2], got.counts[c[6] + 1]) end
    end
    local ok, err = pcall(moe.sort_slots_on, ms.tensor({ { 0, 1 }, { 2, -3 }, { 9, 0 } }, { dtype = 'i64' }), 4, 2)
    assert.is_false(ok)
    assert.matches('moe: expert id -3 at slot 3 is outside [0, 4)', tostring(err), 1, true)
    local T = require 'moonshard.tensor'
    local ids = ms.tensor({ { 0, 1 }, { 2, 3 } }, { dtype = 'i64' })
    local function e(n) return ms.empty({ n }, { dtype = 'i64' }) end
    ok, err = pcall(T.check, T.C.ms_moe_sort(ids, 2, 4, 2, e(4), e(4), e(7), e(8), e(11)))
    assert.is_false(ok)
    assert.matches('moe_sort: tok must be contiguous i64 of 8 elements or more', tostring(err), 1, true)
    ok, err = pcall(T.check, T.C.ms_moe_sort(ids, 2, 4, 2, e(4), e(4), e(8), e(8), ms.empty({ 11 })))
    assert.is_false(ok)
    assert.matches('moe_sort: info must be contiguous i64 of 11 elements or more', tostring(err), 1, true)
    ok, err = pcall(T.check, T.C.ms_moe_sort(ids, 3, 4, 2, e(4), e(4), e(8), e(8), e(11)))
    assert.is_false(ok)
    assert.matches('moe_sort: 4 slots, k 3', tostring(err), 1, true)
  end)

  it('topk: the k largest of each row in order, ties to the lower index', function()
    local s = ms.tensor({ { 0.1, 0.5, 0.5, 0.2 }, { 0.9, 0.1, 0.3, 0.9 } })
    assert.are.same({ 1, 2, 3, 0, 3, 2 }, vals(moe.topk(s, 3)))
    local x = ms.randn({ 30, 9 }, { seed = 8 })
    local ids = vals(moe.topk(x, 4))
    for n = 1, 30 do
      local row = vals(x:narrow(1, n, 1))
      local idx = {}
      for e = 1, 9 do idx[e] = e end
      table.sort(idx, function(a, b) if row[a] ~= row[b] then return row[a] > row[b] end return a < b end)
      for j = 1, 4 do assert.are.equal(idx[j] - 1, ids[(n - 1) * 4 + j]) end
    end
  end)

  local configs = {
    { 'softmax, top-2 of 4, renormalised', { dim = 6, hidden = 10, experts = 4, top_k = 2 } },
    { 'softmax, top-3 of 5, not renormalised, scaled', { dim = 6, hidden = 8, experts = 5, top_k = 3, norm_topk = false,
      route_scale = 2.5 } },
    { 'sigmoid, top-2 of 6, with a shared expert', { dim = 6, hidden = 8, experts = 6, top_k = 2, score = 'sigmoid',
      shared_hidden = 12 } },
    { 'top-1 of 3', { dim = 6, hidden = 8, experts = 3, top_k = 1 } },
    { 'scale_input (Llama 4): sigmoid, top-1 of 4, the weight on the input, a shared expert', { dim = 6, hidden = 8,
      experts = 4, top_k = 1, score = 'sigmoid', norm_topk = false, scale_input = true, shared_hidden = 10 } },
    { 'scale_input: softmax, top-3 of 5, not renormalised, scaled', { dim = 6, hidden = 8, experts = 5, top_k = 3,
      norm_topk = false, route_scale = 1.5, scale_input = true } },
  }

  for _, c in ipairs(configs) do
    it(c[1] .. ': the per-token loop\'s output (1e-12) and finite-difference gradients (f64)', function()
      local m = build(c[2])
      local x = ms.randn({ 2, 7, 6 }, { dtype = 'f64', seed = 21 }):requires_grad_()
      local y = m(x)
      assert.are.same({ 2, 7, 6 }, y.shape)
      local ref = reference(m, x)
      local err = (y:detach():reshape({ 14, 6 }) - ref):abs():max():item()
      assert.is_true(err <= 1e-12, 'max abs error ' .. err)
      A.clear_tape()
      local checked = { x, m[m.router_name].weight }
      for _, e in ipairs({ 1, c[2].experts }) do
        for _, p in ipairs(m.experts[e]:parameters()) do checked[#checked + 1] = p end
      end
      if m.shared_name then checked[#checked + 1] = m[m.shared_name]:parameters()[1] end
      local worst = A.gradcheck(function() return m(x) end, checked)
      assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    end)
  end

  -- Within a few f64 rounding errors, not bit for bit: OpenBLAS picks its
  -- GEMM kernel by shape (its small-matrix path on AVX-512 machines sums a
  -- row in another order once the padding changes M).
  it('select: the routing choice in one op equals top-k over the group-limited choice scores (ties, biases, f32 and '
    .. 'f64, both group scores); bad arguments are named', function()
    -- (scores on a grid of eighths: many ties, in the experts and in the groups)
    local function grid(N, E, seed, dtype)
      return (ms.rand({ N, E }, { seed = seed }) * 8):to('i64'):to(dtype) / 8
    end
    local n = 0
    for _, c in ipairs({ { 8, 1, 1, 2 }, { 8, 4, 2, 2 }, { 12, 3, 1, 3 }, { 16, 4, 2, 4 }, { 16, 8, 3, 5 },
      { 6, 1, 1, 6 }, { 32, 8, 4, 8 }, { 1, 1, 1, 1 } }) do
      local E, G, TG, k = c[1], c[2], c[3], c[4]
      for _, dtype in ipairs({ 'f32', 'f64' }) do
        for _, how in ipairs({ 'top2', 'max' }) do
          if not (how == 'top2' and G > 1 and E / G < 2) then
            for _, biased in ipairs({ false, true }) do
              n = n + 1
              local s = grid(37, E, n, dtype)
              local b = biased and (ms.rand({ E }, { seed = 100 + n }) * 4):to('i64'):to('f32') / 8 or nil
              local got = moe.select(s, b, G, TG, how, k)
              local choice = b and s + b:to(dtype) or s
              if G > 1 then choice = moe.group_limit(choice, G, TG, how) end
              local want = moe.topk(choice, k)
              assert.are.same(want:totable(), got:totable(),
                ('E %d G %d TG %d k %d %s %s bias %s'):format(E, G, TG, k, dtype, how, tostring(biased)))
            end
          end
        end
      end
    end
    -- the layer routes through it: the same ids as the reference path
    ms.manual_seed(2)
    local m = nn.MoE { dim = 6, hidden = 4, experts = 8, top_k = 2, score = 'sigmoid', n_group = 4, topk_group = 2,
      router_bias = true }:to('f64')
    m.gate.e_score_correction_bias:copy_(ms.randn({ 8 }, { seed = 4 }) * 0.1)
    local probs, ids = m:route(ms.randn({ 20, 6 }, { dtype = 'f64', seed = 5 }))
    local ref = moe.topk(moe.group_limit(probs:detach() + m.gate.e_score_correction_bias:to('f64'), 4, 2, 'top2'), 2)
    assert.are.same(ref:totable(), ids:totable())
    local s = ms.rand({ 4, 8 })
    local function bad(msg, ...)
      local args = { ... }
      local ok, err = pcall(function() return moe.select(unpack(args)) end)
      assert.is_false(ok)
      assert.matches(msg, tostring(err), 1, true)
    end
    bad('moe_select: 8 experts in G = 3 groups, TG = 1 kept', s, nil, 3, 1, 'top2', 2)
    bad('moe_select: k = 5 of the 4 experts of TG = 1 groups', s, nil, 2, 1, 'top2', 5)
    bad('moe_select: bias must be contiguous (8) of the scores\' dtype and device', s, ms.zeros({ 7 }), 1, 1, 'top2', 2)
    bad('moe_select: scores must be contiguous f32 or f64 (N, E)', ms.rand({ 8 }), nil, 1, 1, 'top2', 2)
  end)

  it('runs padded to 8 rows (as on GPUs, to 128) give the unpadded output and gradients (f64, 1e-14 relative)', function()
    local function run(align, cfg)
      moe.cpu_align = align
      local m = build(cfg or { dim = 6, hidden = 10, experts = 5, top_k = 2 }, 8)
      local x = ms.randn({ 3, 7, 6 }, { dtype = 'f64', seed = 31 }):requires_grad_()
      local ok, y = pcall(m, x)
      moe.cpu_align = 1
      assert(ok, y)
      y:backward(ms.randn({ 3, 7, 6 }, { dtype = 'f64', seed = 32 }))
      local g = { y = y:detach(), x = x.grad }
      for name, p in m:named_parameters() do g[name] = p.grad end
      return g
    end
    local a, b = run(1), run(8)
    local scaled = { dim = 6, hidden = 10, experts = 5, top_k = 2, score = 'sigmoid', scale_input = true }
    local sa, sb = run(1, scaled), run(8, scaled)
    for name, t in pairs(sa) do a['scale_input ' .. name], b['scale_input ' .. name] = t, sb[name] end
    for name, t in pairs(a) do
      local d, scale = (b[name] - t):abs():max():item(), t:abs():max():item()
      assert.is_true(scale > 0, name)
      assert.is_true(d <= 1e-14 * scale, ('%s: %g apart (largest %g)'):format(name, d, scale))
    end
  end)

  it('experts no token chose get zero gradients; every parameter has one', function()
    local m = build({ dim = 4, hidden = 6, experts = 8, top_k = 1 })
    local x = ms.randn({ 3, 4 }, { dtype = 'f64', seed = 2 })
    m(x):sum():backward()
    local counts = m:last_stats()
    local idle = 0
    for e = 1, 8 do
      for _, p in ipairs(m.experts[e]:parameters()) do
        assert.is_not_nil(p.grad, 'expert ' .. e)
        local s = p.grad:abs():sum():item()
        if counts[e] == 0 then assert.are.equal(0, s) else assert.is_true(s > 0) end
      end
      if counts[e] == 0 then idle = idle + 1 end
    end
    assert.is_true(idle >= 5, 'three tokens, eight experts')
    assert.is_not_nil(m.gate.weight.grad)
    -- no tokens at all: an empty output, every gradient zeros
    m:zero_grad()
    local x0 = ms.empty({ 0, 4 }, { dtype = 'f64' }):requires_grad_()
    local y0 = m(x0)
    assert.are.same({ 0, 4 }, y0.shape)
    y0:sum():backward()
    for name, p in m:named_parameters() do
      assert.is_not_nil(p.grad, name)
      assert.are.equal(0, p.grad:abs():sum():item(), name)
    end
  end)

  it('one expert of one is the dense SwiGLU MLP, bit for bit', function()
    local m = build({ dim = 6, hidden = 10, experts = 1, top_k = 1 })
    local d = nn.GatedMLP { dim = 6, hidden = 10 }:to('f64')
    for _, n in ipairs({ 'gate_proj', 'up_proj', 'down_proj' }) do d[n].weight:copy_(m.experts[1][n].weight) end
    local x = ms.randn({ 3, 4, 6 }, { dtype = 'f64', seed = 4 })
    assert.are.equal(0, (m(x) - d(x)):abs():max():item())
  end)

  it('aux_loss: transformers\' load-balancing loss over the layers\' tokens at once, and its gradient', function()
    local m1 = build({ dim = 6, hidden = 8, experts = 4, top_k = 2 }, 5)
    local m2 = build({ dim = 6, hidden = 8, experts = 4, top_k = 2 }, 6)
    local x = ms.randn({ 10, 6 }, { dtype = 'f64', seed = 9 })
    m2(m1(x))
    local aux = moe.aux_loss({ m1, m2 })
    -- by hand: E * sum_e (count_e over both layers / (2 N)) * (mean of the scores over both layers)
    local c1, p1 = m1:last_stats()
    local c2, p2 = m2:last_stats()
    local pv1, pv2 = vals(p1), vals(p2)
    local want = 0
    for e = 1, 4 do want = want + (c1[e] + c2[e]) / 20 * (pv1[e] + pv2[e]) / 2 end
    want = want * 4
    assert.is_true(math.abs(aux:item() - want) <= 1e-14, ('%.17g against %.17g'):format(aux:item(), want))
    -- a balanced router gives 1 at its minimum: uniform scores and counts
    A.clear_tape()
    local w = m1.gate.weight
    w:requires_grad_()
    local worst = A.gradcheck(function()
      m1(x)
      return moe.aux_loss({ m1 })
    end, { w })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    -- none after clear_stats
    m1:clear_stats()
    assert.is_nil(m1:last_stats())
    assert.is_nil(moe.aux_loss({ m1 }))
  end)

  it('last_stats after a backward that released the activations: the counts and tokens, no mean; aux_loss says '
    .. 'when to take it', function()
    local m = build({ dim = 6, hidden = 8, experts = 4, top_k = 2 }, 5)
    local x = ms.randn({ 10, 6 }, { dtype = 'f64', seed = 9 }):requires_grad_()
    local prev = A.release_activations
    A.release_activations = true
    local ok, err = pcall(function()
      m(x):sum():backward()
      local c, p, n = m:last_stats()
      local total = 0
      for e = 1, 4 do total = total + c[e] end
      assert.are.equal(20, total)
      assert.is_nil(p)
      assert.are.equal(10, n)
      local ok2, e2 = pcall(moe.aux_loss, { m })
      assert.is_false(ok2)
      assert.matches('released by its backward', tostring(e2), 1, true)
      -- the next forward's stats are whole again
      m(x)
      local _, p3 = m:last_stats()
      assert.are.same({ 4 }, p3.shape)
    end)
    A.release_activations = prev
    A.clear_tape()
    assert(ok, err)
  end)

  it('expert_bias (balancing without an auxiliary loss): it chooses the experts, the weights stay the scores\'; '
    .. 'update_bias moves it by the rate towards the mean count', function()
    local m = build({ dim = 6, hidden = 8, experts = 4, top_k = 2 })
    local x = ms.randn({ 9, 6 }, { dtype = 'f64', seed = 41 })
    local y0 = m(x)
    assert.are.equal(1, moe.enable_bias(m))
    assert.are.equal(0, moe.enable_bias(m), 'once')
    -- a zero bias changes nothing
    assert.are.equal(0, (m(x) - y0):abs():max():item())
    -- a large bias on expert 3 (0-based) puts it in every token's top 2
    m.expert_bias:copy_(ms.tensor({ 0, 0, 0, 10 }))
    local y = m(x)
    local counts = m:last_stats()
    assert.are.equal(9, counts[4])
    -- the reference: the biased choice, the scores' weights (renormalised)
    local logits = x:matmul(m.gate.weight:t())
    local probs = logits:softmax(2)
    local want = ms.zeros({ 9, 6 }, { dtype = 'f64' })
    for n = 1, 9 do
      local p = vals(probs:narrow(1, n, 1))
      local idx = { 1, 2, 3, 4 }
      table.sort(idx, function(a, b)
        local sa, sb = p[a] + (a == 4 and 10 or 0), p[b] + (b == 4 and 10 or 0)
        if sa ~= sb then return sa > sb end
        return a < b
      end)
      local sum = p[idx[1]] + p[idx[2]]
      local xr = x:narrow(1, n, 1)
      local acc = ms.zeros({ 1, 6 }, { dtype = 'f64' })
      for j = 1, 2 do acc = acc + m.experts[idx[j]](xr) * (p[idx[j]] / sum) end
      want:narrow(1, n, 1):copy_(acc)
    end
    local err = (y - want):abs():max():item()
    assert.is_true(err <= 1e-12, 'max abs error ' .. err)
    -- counts under grad accumulate; update_bias: + rate below the mean, - above, 0 at it
    m.expert_bias:zero_()
    moe.reset_counts(m)
    rawset(m, '_tokens', { 3, 5, 4, 4 })
    assert.are.equal(1, moe.update_bias(m, 0.5))
    assert.are.same({ 0.5, -0.5, 0, 0 }, vals(m.expert_bias))
    assert.is_nil(rawget(m, '_tokens'))
    -- no counts since the last update: every expert at the mean
    moe.update_bias(m, 0.5)
    assert.are.same({ 0.5, -0.5, 0, 0 }, vals(m.expert_bias))
    -- forwards under grad count, under no_grad not
    m(x)
    ms.no_grad(function() m(x) end)
    local t = 0
    for _, c in ipairs(rawget(m, '_tokens')) do t = t + c end
    assert.are.equal(18, t)
  end)

  it('bf16 autocast: close to the f32 layer; the router scores stay f32', function()
    ms.manual_seed(7)
    local m = nn.MoE { dim = 16, hidden = 32, experts = 4, top_k = 2 }
    local x = ms.randn({ 8, 16 }, { seed = 3 })
    local y32 = m(x)
    local yb = nn.functional.autocast('bf16', function() return m(x) end)
    assert.are.equal('bf16', yb.dtype)
    local _, p = m:last_stats()
    assert.are.equal('f32', p.dtype)
    local rel = (yb:to('f32') - y32):abs():max():item() / y32:abs():max():item()
    assert.is_true(rel < 3e-2, 'relative error ' .. rel)
  end)

  it('the experts\' SwiGLU on a gate-and-up product, both ways, as silu(gate) up and its autograd gradient', function()
    local T = require 'moonshard.tensor'
    for _, dt in ipairs({ 'f64', 'f32', 'bf16' }) do
      local M, I = 7, 5
      local gu = (ms.randn({ M, 2 * I }, { seed = 41 }) * 3):to(dt)
      local dh = ms.randn({ M, I }, { seed = 42 }):to(dt)
      local h, d13 = ms.empty({ M, I }, { dtype = dt }), ms.empty({ M, 2 * I }, { dtype = dt })
      T.check(T.C.ms_moe_swiglu(h, gu))
      T.check(T.C.ms_moe_swiglu_backward(d13, gu, dh))
      -- the reference in f64 through autograd
      local g = gu:narrow(2, 1, I):to('f64'):contiguous():requires_grad_(true)
      local u = gu:narrow(2, I + 1, I):to('f64'):contiguous():requires_grad_(true)
      local want = nn.functional.silu(g) * u
      want:backward(dh:to('f64'))
      local tol = dt == 'bf16' and 1e-2 or (dt == 'f32' and 1e-6 or 1e-12)
      local function rel(a, b) return (a:to('f64') - b):abs():max():item() / b:abs():max():item() end
      assert.is_true(rel(h, want:detach()) < tol, dt .. ' h ' .. rel(h, want:detach()))
      assert.is_true(rel(d13:narrow(2, 1, I), g.grad) < tol, dt .. ' d gate')
      assert.is_true(rel(d13:narrow(2, I + 1, I), u.grad) < tol, dt .. ' d up')
    end
    -- errors name the tensors
    local gu = ms.randn({ 3, 4 })
    local ok, err = pcall(T.check, T.C.ms_moe_swiglu(ms.empty({ 3, 3 }), gu))
    assert.is_false(ok)
    assert.matches('moe_swiglu: h must be (3, 2), got', tostring(err), 1, true)
    ok, err = pcall(T.check, T.C.ms_moe_swiglu(ms.empty({ 3, 2 }), ms.randn({ 3, 5 })))
    assert.is_false(ok)
    assert.matches('moe_swiglu: gu must be (rows, 2 I), got', tostring(err), 1, true)
    ok, err = pcall(T.check, T.C.ms_moe_swiglu_backward(gu, gu, ms.randn({ 3, 2 })))
    assert.is_false(ok)
    assert.matches('moe_swiglu_backward: d13 shares its storage with an input', tostring(err), 1, true)
  end)

  it('between forward and backward: a copy of the experts\' weights held only when they were cast', function()
    -- 16 experts of 64 x 64 (786 KB in f32) and 4 tokens: the weights dwarf the activations
    local m = nn.MoE { dim = 64, hidden = 64, experts = 16, top_k = 2 }
    local x = ms.randn({ 4, 64 }, { seed = 61 })
    local wbytes = 16 * 3 * 64 * 64 * 4
    local function held(run)
      local base = S.settled(ms.live_bytes)
      local y = run()
      local after = S.settled(ms.live_bytes)
      y:sum():backward()
      for _, p in ipairs(m:parameters()) do p.grad = nil end
      return after - base
    end
    -- f32 weights, f32 rows: nothing copied is kept (the backward copies them again)
    local same = held(function() return m(x) end)
    assert.is_true(same < wbytes / 4, ('f32: %d bytes held after the forward'):format(same))
    -- bf16 autocast: the bf16 cast is kept, as autocast keeps a cast weight
    local cast = held(function() return nn.functional.autocast('bf16', function() return m(x) end) end)
    assert.is_true(cast >= wbytes / 2, ('bf16 autocast: %d bytes held after the forward'):format(cast))
  end)

  it('refuses bad configurations and inputs, naming them', function()
    assert.has_error(function() nn.MoE { dim = 4, hidden = 4, experts = 2, top_k = 3 } end,
      'MoE: top_k 3 is more than the 2 experts')
    assert.has_error(function() nn.MoE { dim = 4, hidden = 4, experts = 0, top_k = 1 } end,
      'MoE: experts must be a positive integer, got 0')
    assert.has_error(function() nn.MoE { dim = 4, hidden = 4, experts = 2, top_k = 1, score = 'relu' } end,
      'MoE: score must be softmax or sigmoid, got relu')
    assert.has_error(function() nn.MoE { dim = 4, hidden = 4, experts = 2, top_k = 1, scale_input = 'yes' } end,
      'MoE: scale_input must be a boolean, got yes')
    local m = nn.MoE { dim = 4, hidden = 4, experts = 2, top_k = 1 }
    local ok, err = pcall(function() return m(ms.randn({ 3, 5 })) end)
    assert.is_false(ok)
    assert.matches('MoE: input of shape (3, 5) does not end in dim = 4', tostring(err), 1, true)
    -- the C loop's checks name what is wrong
    local T = require 'moonshard.tensor'
    local ffi = ms.ffi
    local xs, ys = ms.randn({ 5, 4 }), ms.empty({ 5, 4 })
    local gu = ms.empty({ 5, 6 })
    local wf = ms.randn({ 3 * 3 * 4 })
    local function run(rows, w, g)
      local r = ffi.new('int64_t[1]', rows)
      return pcall(T.check, T.C.ms_moe_experts_forward(ys, g or gu, xs, w or wf, r, 1))
    end
    assert.is_true((run(5)))
    local ok1, e1 = run(4)
    assert.is_false(ok1)
    assert.matches('moe_experts_forward: the experts\' rows sum to 4, but xs has 5', tostring(e1), 1, true)
    local ok2, e2 = run(5, ms.randn({ 35 }))
    assert.is_false(ok2)
    assert.matches('moe_experts_forward: the experts\' weights must be one contiguous tensor of 1 x 3 x 3 x 4 elements '
      .. '(each expert\'s gate, up and down in turn), got', tostring(e2), 1, true)
    local ok3, e3 = run(5, nil, ms.empty({ 5, 5 }))
    assert.is_false(ok3)
    assert.matches('moe_experts_forward: gu must be (rows, 2 x hidden of an expert), got', tostring(e3), 1, true)
    local ok4, e4 = run(5, ms.randn({ 36 }, { dtype = 'f64' }))
    assert.is_false(ok4)
    assert.matches('moe_experts_forward: the weights (f64) and gu must have the rows\' dtype', tostring(e4), 1, true)
    local ok5, e5 = run(5, ms.randn({ 72 }):view({ 36, 2 }):narrow(2, 1, 1))
    assert.is_false(ok5)
    assert.matches('must be one contiguous tensor', tostring(e5), 1, true)
    -- the row moves check their ids
    local x = ms.randn({ 3, 4 })
    local out = ms.empty({ 2, 4 })
    local okg, eg = pcall(T.check, T.C.ms_moe_gather_rows(out, x, ms.tensor({ 1, 4 }, { dtype = 'i64' })))
    assert.is_false(okg)
    assert.matches('moe_gather_rows: idx[1] = 4 is outside [0, 3]', tostring(eg), 1, true)
    local okc, ec = pcall(T.check, T.C.ms_moe_combine(ms.empty({ 1, 4 }), x, ms.tensor({ 0, 3 }, { dtype = 'i64' }), nil, 2))
    assert.is_false(okc)
    assert.matches('moe_combine: inv[1] = 3 is outside [0, 2]', tostring(ec), 1, true)
    -- FSDP units inside the experts: each rank runs only the experts its tokens chose
    local s = nn.Sequential(nn.Linear(4, 4), nn.MoE { dim = 4, hidden = 6, experts = 2, top_k = 1 })
    assert.has_error(function() ms.fsdp.fully_shard(s, { policy = ms.fsdp.policy.by_class { 'MoEExpert' } }) end,
      'fully_shard: the unit 1.experts.0 is inside the mixture of experts 1, whose experts run only on the ranks whose '
      .. 'tokens chose them; make units of the modules that hold the MoE layers (docs/moe.md)')
  end)

  it('group-limited routing (n_group, topk_group: DeepSeek-V2/V3): each token\'s experts from its best groups, as '
    .. 'written out per token; finite differences; the refusals', function()
    -- the reference: per token, each group's score, the best groups, then
    -- the top_k among their experts (the others never: -inf, as
    -- transformers' DeepSeek-V3 router), ties to the lower
    local function ref_ids(c, G, TG, k, how)
      local rows = {}
      local per = #c[1] / G
      for n, row in ipairs(c) do
        local gs = {}
        for g = 1, G do
          local v = {}
          for j = 1, per do v[j] = row[(g - 1) * per + j] end
          table.sort(v, function(a, b) return a > b end)
          gs[g] = how == 'max' and v[1] or v[1] + v[2]
        end
        local order = {}
        for g = 1, G do order[g] = g end
        table.sort(order, function(a, b) if gs[a] ~= gs[b] then return gs[a] > gs[b] end return a < b end)
        local keep = {}
        for j = 1, TG do keep[order[j]] = true end
        local masked, eo = {}, {}
        for e = 1, #row do
          masked[e] = keep[math.floor((e - 1) / per) + 1] and row[e] or -math.huge
          eo[e] = e
        end
        table.sort(eo, function(a, b) if masked[a] ~= masked[b] then return masked[a] > masked[b] end return a < b end)
        rows[n] = {}
        for j = 1, k do rows[n][j] = eo[j] - 1 end
      end
      return rows
    end
    for _, c in ipairs({ { 8, 4, 2, 2, 'top2', 'sigmoid' }, { 12, 3, 1, 3, 'top2', 'softmax' }, { 8, 8, 3, 2, 'max', 'sigmoid' },
      { 16, 4, 2, 4, 'top2', 'sigmoid' } }) do
      local E, G, TG, k, how, score = c[1], c[2], c[3], c[4], c[5], c[6]
      ms.manual_seed(7)
      local m = nn.MoE { dim = 8, hidden = 6, experts = E, top_k = k, n_group = G, topk_group = TG, group_score = how,
        score = score }:to('f64')
      for _, p in ipairs(m:parameters()) do ms.normal_(p, 0, 0.6) end
      for _, biased in ipairs({ false, true }) do
        if biased then
          nn.moe.enable_bias(m)
          m.expert_bias:copy_(ms.randn({ E }, { seed = 9 }):to('f32') * 0.3)
        end
        local x = ms.randn({ 20, 8 }, { dtype = 'f64', seed = 11 })
        local probs, ids = m:route(x)
        local choice = probs:detach()
        if biased then choice = choice + m.expert_bias:to('f64') end
        assert.are.same(ref_ids(choice:totable(), G, TG, k, how), ids:totable(),
          ('%d experts in %d groups, %d kept, top-%d, %s, bias %s'):format(E, G, TG, k, how, tostring(biased)))
      end
      A.clear_tape()
      local x = ms.randn({ 6, 8 }, { dtype = 'f64', seed = 12 }):requires_grad_()
      local worst = A.gradcheck(function() return m(x) end, { x, m.gate.weight, m.experts[2].up_proj.weight })
      assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    end
    local function bad(cfg, msg)
      local base = { dim = 8, hidden = 6, experts = 8, top_k = 2 }
      for kk, v in pairs(cfg) do base[kk] = v end
      assert.has_error(function() nn.MoE(base) end, msg)
    end
    bad({ n_group = 3 }, 'MoE: 8 experts do not split into n_group = 3 groups')
    bad({ n_group = 8 }, 'MoE: group_score top2 needs groups of 2 experts or more, n_group = 8 leaves 1')
    bad({ n_group = 4, topk_group = 5 }, 'MoE: topk_group 5 is more than n_group 4')
    bad({ n_group = 4, topk_group = 1, top_k = 3 }, 'MoE: top_k 3 is more than the 2 experts of topk_group = 1 groups')
    bad({ n_group = 2, group_score = 'mean' }, 'MoE: group_score must be top2 or max, got mean')
    bad({ n_group = 0 }, 'MoE: n_group must be a positive integer, got 0')
  end)
end)
