-- optim: AdamW and SGD against independent element-by-element Lua
-- recomputations, parameter groups, schedules at hand-picked steps,
-- clip_grad_norm against a hand computation, and state save/resume.
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local optim = require 'moonshard.optim'
local json = require 'dkjson'
local A = ms.autograd
local F = ms.raw

local function flat(t) return t:contiguous():view(-1):totable() end
local function maxdiff_list(a, b)
  local m = 0
  for i = 1, #a do m = math.max(m, math.abs(a[i] - b[i])) end
  return m
end

-- a small model with 2-D weights, biases and a norm
local function model(dtype, seed)
  ms.manual_seed(seed or 1)
  local m = nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.LayerNorm(5), nn.Linear(5, 2))
  m:to(dtype or 'f64')
  ms.no_grad(function()
    for _, p in ipairs(m:parameters()) do
      F.add_(p, F.mul(ms.randn(p.shape, { dtype = p.dtype, seed = p:numel() }), 0.2))
    end
  end)
  return m
end
local function data(dtype)
  return ms.randn({ 6, 3 }, { dtype = dtype or 'f64', seed = 77 }),
      ms.randn({ 6, 2 }, { dtype = dtype or 'f64', seed = 78 })
end
local function loss_of(m, x, y)
  local d = m(x) - y
  return (d * d):mean()
end

describe('AdamW', function()
  before_each(function() A.clear_tape() end)

  it('splits a module into decay (2-D weights) and no-decay groups', function()
    local m = model()
    local opt = optim.AdamW(m, { lr = 1e-3, weight_decay = 0.1 })
    assert.are.equal(2, #opt.param_groups)
    assert.are.same({ '0.weight', '3.weight' }, opt.param_groups[1].names)
    assert.are.equal(0.1, opt.param_groups[1].weight_decay)
    assert.are.same({ '0.bias', '2.weight', '2.bias', '3.bias' }, opt.param_groups[2].names)
    assert.are.equal(0, opt.param_groups[2].weight_decay)
    assert.is_true(optim.no_decay('transformer.wte.weight', ms.zeros({ 4, 4 })))
    assert.is_true(optim.no_decay('model.embed_tokens.weight', ms.zeros({ 4, 4 })))
    assert.is_true(optim.no_decay('h.0.ln_1.weight', ms.zeros({ 4 })))
    assert.is_false(optim.no_decay('h.0.attn.c_attn.weight', ms.zeros({ 4, 4 })))
  end)

  local function adamw_matches_reference(dtype, tol)
    local m = model(dtype)
    local x, y = data(dtype)
    local lr_at = optim.schedule.cosine { lr = 0.05, warmup = 3, total = 20, min_lr = 0.005 }
    local b1, b2, eps, wd = 0.8, 0.95, 1e-7, 0.2
    local opt = optim.AdamW(m, { lr = 0.05, betas = { b1, b2 }, eps = eps, weight_decay = wd })
    -- the reference: plain Lua numbers, element by element
    local ref = {}
    for gi, g in ipairs(opt.param_groups) do
      for _, p in ipairs(g.params) do
        local v = flat(p)
        local z1, z2 = {}, {}
        for i = 1, #v do z1[i], z2[i] = 0, 0 end
        ref[#ref + 1] = { p = p, val = v, m = z1, v = z2, decay = gi == 1 }
      end
    end
    for step = 1, 20 do
      local lr = lr_at(step - 1)
      for _, g in ipairs(opt.param_groups) do g.lr = lr end
      local loss = loss_of(m, x, y)
      loss:backward()
      for _, r in ipairs(ref) do
        local g = flat(r.p.grad)
        for i = 1, #g do
          local p = r.val[i]
          if r.decay then p = p - lr * wd * p end
          r.m[i] = b1 * r.m[i] + (1 - b1) * g[i]
          r.v[i] = b2 * r.v[i] + (1 - b2) * g[i] * g[i]
          local mhat = r.m[i] / (1 - b1 ^ step)
          local vhat = r.v[i] / (1 - b2 ^ step)
          r.val[i] = p - lr * mhat / (math.sqrt(vhat) + eps)
        end
      end
      opt:step()
      opt:zero_grad()
      for k, r in ipairs(ref) do
        local got = flat(r.p)
        local scale = 0
        for i = 1, #got do scale = math.max(scale, math.abs(r.val[i])) end
        local d = maxdiff_list(got, r.val)
        assert(d <= tol * math.max(scale, 1), ('step %d, tensor %d: differs by %.3e'):format(step, k, d))
      end
      -- keep the reference on the model's exact values (f32 rounding)
      for _, r in ipairs(ref) do r.val = flat(r.p) end
    end
  end

  it('20 steps equal an element-by-element Lua recomputation (f64)', function()
    adamw_matches_reference('f64', 1e-13)
  end)
  it('20 steps equal the recomputation within f32 rounding (f32 parameters)', function()
    adamw_matches_reference('f32', 1e-6)
  end)

  it('keeps f32 moments for bf16 parameters and updates them', function()
    local w = ms.randn({ 4, 4 }):to('bf16'):requires_grad_()
    local opt = optim.AdamW({ w }, { lr = 0.1 })
    local before = w:to('f32')
    ;(w:to('f32') * 2):sum():backward()
    opt:step()
    assert.are.equal('bf16', w.dtype)
    local st = opt.state[tonumber(w.id)]
    assert.are.equal('f32', st.exp_avg.dtype)
    assert.is_true(F.max(F.abs(F.sub(w:to('f32'), before))):item() > 0.05)
  end)

  it('state_dict saved with safetensors + JSON resumes exactly', function()
    local dir = os.tmpname()
    os.remove(dir)
    os.execute('mkdir -p ' .. dir)
    local function run(m, opt, n)
      local x, y = data()
      for _ = 1, n do
        loss_of(m, x, y):backward()
        opt:step()
        opt:zero_grad()
      end
    end
    local m1 = model()
    local o1 = optim.AdamW(m1, { lr = 0.01 })
    run(m1, o1, 5)
    local sd = o1:state_dict()
    ms.save_safetensors(dir .. '/opt.safetensors', sd.tensors)
    local f = io.open(dir .. '/opt.json', 'w')
    f:write(json.encode(sd.meta))
    f:close()
    ms.save_safetensors(dir .. '/model.safetensors', (m1:state_dict()))
    run(m1, o1, 5)

    local m2 = model(nil, 999)
    m2:load_state_dict(ms.load_safetensors(dir .. '/model.safetensors'))
    local o2 = optim.AdamW(m2, { lr = 0.5 })
    local fr = io.open(dir .. '/opt.json')
    local meta = json.decode(fr:read('*a'))
    fr:close()
    o2:load_state_dict({ tensors = ms.load_safetensors(dir .. '/opt.safetensors'), meta = meta })
    assert.are.equal(0.01, o2.param_groups[1].lr)
    run(m2, o2, 5)
    local p1, p2 = m1:parameters(), m2:parameters()
    for i = 1, #p1 do assert.are.equal(0, maxdiff_list(flat(p1[i]), flat(p2[i]))) end
    os.execute('rm -rf ' .. dir)
  end)

  it('load_state_dict rejects a state of another shape', function()
    local o1 = optim.AdamW({ ms.randn({ 2 }):requires_grad_() })
    local o2 = optim.AdamW({ ms.randn({ 2 }):requires_grad_(), ms.randn({ 2 }):requires_grad_() })
    assert.has_error(function() o2:load_state_dict(o1:state_dict()) end)
    local w = ms.randn({ 2 }):requires_grad_()
    local o3 = optim.AdamW({ w })
    ;(w * w):sum():backward()
    o3:step()
    local sd = o3:state_dict()
    sd.tensors['1.exp_avg'] = ms.zeros({ 3 })
    assert.has_error(function() optim.AdamW({ ms.randn({ 2 }):requires_grad_() }):load_state_dict(sd) end)
  end)
end)

describe('SGD', function()
  before_each(function() A.clear_tape() end)

  for _, cfg in ipairs({ { momentum = 0 }, { momentum = 0.9, weight_decay = 0.01 },
    { momentum = 0.8, nesterov = true }, { momentum = 0.9, dampening = 0.3 } }) do
    it(('matches a Lua recomputation (%s)'):format(json.encode(cfg)), function()
      local m = model()
      local x, y = data()
      local lr = 0.1
      local o = { lr = lr }
      for k, v in pairs(cfg) do o[k] = v end
      local opt = optim.SGD(m, o)
      local ref = {}
      for _, p in ipairs(m:parameters()) do ref[#ref + 1] = { p = p, val = flat(p) } end
      local mom, wd, damp = cfg.momentum or 0, cfg.weight_decay or 0, cfg.dampening or 0
      for _ = 1, 5 do
        loss_of(m, x, y):backward()
        for _, r in ipairs(ref) do
          local g = flat(r.p.grad)
          for i = 1, #g do
            local d = g[i] + wd * r.val[i]
            if mom ~= 0 then
              if r.buf == nil then r.buf = {} end
              if r.buf[i] == nil then r.buf[i] = d
              else r.buf[i] = mom * r.buf[i] + (1 - damp) * d end
              if cfg.nesterov then d = d + mom * r.buf[i] else d = r.buf[i] end
            end
            r.val[i] = r.val[i] - lr * d
          end
        end
        opt:step()
        opt:zero_grad()
        for _, r in ipairs(ref) do assert.is_true(maxdiff_list(flat(r.p), r.val) < 1e-13) end
      end
    end)
  end

  it('rejects nesterov without momentum', function()
    assert.has_error(function() optim.SGD({ ms.zeros({ 1 }) }, { nesterov = true }) end)
  end)
end)

describe('schedules', function()
  local function near(a, b) return math.abs(a - b) < 1e-12 end

  it('cosine with linear warmup', function()
    local f = optim.schedule.cosine { lr = 1.0, warmup = 10, total = 110, min_lr = 0.1 }
    assert.is_true(near(f(0), 0.1))
    assert.is_true(near(f(4), 0.5))
    assert.is_true(near(f(9), 1.0))
    assert.is_true(near(f(10), 1.0))
    assert.is_true(near(f(60), 0.55))          -- halfway: min + (lr - min) / 2
    assert.is_true(near(f(35), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))))
    assert.is_true(near(f(110), 0.1))
    assert.is_true(near(f(1000), 0.1))
  end)

  it('warmup-stable-decay, linear, cosine and sqrt decay', function()
    local f = optim.schedule.wsd { lr = 2.0, warmup = 4, stable = 10, decay = 10, min_lr = 0.0 }
    assert.is_true(near(f(0), 0.5))
    assert.is_true(near(f(3), 2.0))
    assert.is_true(near(f(4), 2.0))
    assert.is_true(near(f(13), 2.0))
    assert.is_true(near(f(14), 2.0))
    assert.is_true(near(f(19), 1.0))
    assert.is_true(near(f(23), 0.2))
    assert.is_true(near(f(24), 0.0))
    local c = optim.schedule.wsd { lr = 1, stable = 0, decay = 4, shape = 'cosine' }
    assert.is_true(near(c(2), 0.5))
    local s = optim.schedule.wsd { lr = 1, stable = 0, decay = 4, shape = 'sqrt', min_lr = 0 }
    assert.is_true(near(s(1), 0.5))
    assert.has_error(function() optim.schedule.wsd { lr = 1, stable = 1 } end)
    assert.has_error(function() optim.schedule.cosine { lr = 1, warmup = 5, total = 5 } end)
  end)
end)

describe('clip_grad_norm', function()
  before_each(function() A.clear_tape() end)

  local function with_grads()
    local a = ms.tensor({ { 3, 0 }, { 0, 4 } }):requires_grad_()
    local b = ms.tensor({ 1, 2, 2 }, { dtype = 'f64' }):requires_grad_()
    a.grad = ms.tensor({ { 3, 0 }, { 0, 4 } })
    b.grad = ms.tensor({ 1, 2, 2 }, { dtype = 'f64' })
    return a, b
  end

  it('returns the total 2-norm and scales the gradients to max_norm', function()
    local a, b = with_grads()
    local n = optim.clip_grad_norm({ a, b }, 1.0)
    assert.is_true(math.abs(n - math.sqrt(9 + 16 + 1 + 4 + 4)) < 1e-6)
    local after = math.sqrt(F.sum(F.square(a.grad:to('f64'))):item() + F.sum(F.square(b.grad)):item())
    assert.is_true(math.abs(after - 1.0) < 1e-5)
    assert.is_true(math.abs(a.grad:get(2, 2) - 4 / n) < 1e-6)
  end)

  it('opts.tensor: the norm as a 0-dim f64 tensor (no host read), the same scaling', function()
    local a, b = with_grads()
    local t = optim.clip_grad_norm({ a, b }, 1.0, { tensor = true })
    assert.is_true(ms.is_tensor(t))
    assert.are.equal('f64', t.dtype)
    assert.are.equal(0, t.ndim)
    assert.is_true(math.abs(t:item() - math.sqrt(34)) < 1e-12)
    assert.is_true(math.abs(a.grad:get(2, 2) - 4 / math.sqrt(34)) < 1e-6)
    assert.is_true(math.abs(b.grad:get(3) - 2 / math.sqrt(34)) < 1e-6)
  end)

  it('opts.defer = an AdamW: the gradients stay, its next step applies the coefficient (the same parameters, bit for bit)', function()
    local function run(defer)
      local m = model()
      local opt = optim.AdamW(m, { lr = 1e-2, weight_decay = 0.1 })
      local norms = {}
      for s = 1, 3 do
        A.clear_tape()
        opt:zero_grad()
        local x, y = data()
        loss_of(m, x, y):backward()
        local g0 = m:parameters()[1].grad:clone()
        norms[s] = optim.clip_grad_norm(m, 0.05, { defer = defer and opt or nil })
        if defer then   -- not scaled here
          assert.are.equal(0, F.sum(F.abs(F.sub(m:parameters()[1].grad, g0))):item())
        end
        opt:step()
      end
      local ps = {}
      for i, p in ipairs(m:parameters()) do ps[i] = p:to('f64'):view(-1):totable() end
      return ps, norms
    end
    local p0, n0 = run(false)
    local p1, n1 = run(true)
    assert.are.same(n0, n1)
    assert.is_true(n0[1] > 0.05)   -- the clipping did scale
    assert.are.same(p0, p1)
    local sgd = optim.SGD(model(), { lr = 0.1 })
    local a, b = with_grads()
    local ok, err = pcall(optim.clip_grad_norm, { a, b }, 1.0, { defer = sgd })
    assert.is_false(ok)
    assert.matches('defer must be an optimizer with defer_grad_scale', err, 1, true)
  end)

  it('leaves gradients alone below max_norm; inf norm; modules', function()
    local a, b = with_grads()
    local n = optim.clip_grad_norm({ a, b }, 100)
    assert.is_true(math.abs(n - math.sqrt(34)) < 1e-6)
    assert.are.equal(4, a.grad:get(2, 2))
    assert.are.equal(4, optim.clip_grad_norm({ a, b }, nil, { norm_type = math.huge }))
    local m = model()
    local x, y = data()
    loss_of(m, x, y):backward()
    local want = 0
    for _, p in ipairs(m:parameters()) do want = want + F.sum(F.square(p.grad)):item() end
    assert.is_true(math.abs(optim.clip_grad_norm(m, 1e9) - math.sqrt(want)) < 1e-12)
  end)
end)
