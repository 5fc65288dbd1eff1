-- nn: the Module base (registration, traversal, state dicts, dtype moves,
-- printing) and each module against a hand computation; bad input errors.
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local nnf = nn.functional
local A = ms.autograd
local F = ms.raw

local function maxdiff(a, b)
  return F.max(F.abs(F.sub(a, b))):item()
end
local function list_of(it)
  local r = {}
  for a, b in it do r[#r + 1] = { a, b } end
  return r
end
local function errmsg(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok, 'expected an error')
  return tostring(err)
end

-- a two-level model with a tied weight and a buffer
local Inner = nn.Module:extend('Inner')
function Inner:init(d)
  self:register_module('proj', nn.Linear(d, d))
  self:register_module('norm', nn.LayerNorm(d))
end
function Inner:forward(x) return self.norm(self.proj(x)) end

local Net = nn.Module:extend('Net')
function Net:init(v, d)
  self:register_module('embed', nn.Embedding(v, d))
  self:register_module('blocks', nn.ModuleList { Inner(d), Inner(d) })
  self:register_module('head', nn.Linear(d, v, { bias = false }))
  self.head.weight = self.embed.weight          -- tie (a plain assignment)
  self:register_buffer('scale', ms.full({ 1 }, 2))
  self:register_buffer('scratch', ms.zeros({ 2 }), false)
end
function Net:forward(ids)
  local x = self.embed(ids)
  for _, b in ipairs(self.blocks) do x = b(x) end
  return self.head(x)
end

describe('nn.Module', function()
  before_each(function() A.clear_tape() end)

  it('classes: extend, init, __call, class names, is_module', function()
    local n = Net(7, 4)
    assert.are.equal('Net', n:class_name())
    assert.is_true(nn.is_module(n))
    assert.is_true(nn.is_module(n.blocks[1]))
    assert.is_false(nn.is_module({}))
    local y = n(ms.tensor({ { 1, 2 } }, { dtype = 'i64' }))
    assert.are.same({ 1, 2, 7 }, y.shape)
    assert.matches('class Net', tostring(Net))
  end)

  it('named_parameters: dotted names in registration order, a shared tensor once', function()
    local n = Net(7, 4)
    local names = {}
    for name, p in n:named_parameters() do names[#names + 1] = name end
    assert.are.same({ 'embed.weight',
      'blocks.0.proj.weight', 'blocks.0.proj.bias', 'blocks.0.norm.weight', 'blocks.0.norm.bias',
      'blocks.1.proj.weight', 'blocks.1.proj.bias', 'blocks.1.norm.weight', 'blocks.1.norm.bias' }, names)
    assert.are.equal(9, #n:parameters())
    assert.are.equal(7 * 4 + 2 * (16 + 4 + 4 + 4), n:num_parameters())
    for _, p in ipairs(n:parameters()) do assert.is_true(p.requires_grad) end
    local bn = {}
    for name in n:named_buffers() do bn[#bn + 1] = name end
    assert.are.same({ 'scale', 'scratch' }, bn)
  end)

  it('children, modules, apply, train/eval', function()
    local n = Net(7, 4)
    local ch = {}
    for name, c in n:named_children() do ch[#ch + 1] = name .. ':' .. c:class_name() end
    assert.are.same({ 'embed:Embedding', 'blocks:ModuleList', 'head:Linear' }, ch)
    local k = 0
    for _ in n:children() do k = k + 1 end
    assert.are.equal(3, k)
    local mods = {}
    for name in n:named_modules() do mods[#mods + 1] = name end
    assert.are.same({ '', 'embed', 'blocks', 'blocks.0', 'blocks.0.proj', 'blocks.0.norm',
      'blocks.1', 'blocks.1.proj', 'blocks.1.norm', 'head' }, mods)
    local order = {}
    n.blocks[1]:apply(function(m) order[#order + 1] = m:class_name() end)
    assert.are.same({ 'Linear', 'LayerNorm', 'Inner' }, order)
    n:eval()
    for m in n:modules() do assert.is_false(m.training) end
    n:train()
    for m in n:modules() do assert.is_true(m.training) end
  end)

  it('state_dict has every name (tied ones too) and persistent buffers only', function()
    local n = Net(7, 4)
    local sd, keys = n:state_dict()
    assert.are.equal(n.embed.weight, sd['embed.weight'])
    assert.are.equal(n.embed.weight, sd['head.weight'])
    assert.is_not_nil(sd['scale'])
    assert.is_nil(sd['scratch'])
    assert.are.equal(11, #keys)
  end)

  it('load_state_dict copies values; a tied name may be absent', function()
    local a, b = Net(7, 4), Net(7, 4)
    ms.no_grad(function() for _, p in ipairs(b:parameters()) do F.add_(p, 1) end end)
    local sd = b:state_dict()
    sd['head.weight'] = nil
    local r = a:load_state_dict(sd)
    assert.are.same({}, r.missing)
    for name, p in a:named_parameters() do
      assert.are.equal(0, maxdiff(p, b:state_dict()[name]), name)
    end
  end)

  it('strict load reports missing, unexpected and mis-shaped keys together, and loads nothing', function()
    local a, b = Net(7, 4), Net(7, 4)
    local before = a.blocks[1].proj.weight:clone()
    local sd = b:state_dict()
    sd['blocks.0.norm.bias'] = nil
    sd['scale'] = nil
    sd['extra.weight'] = ms.zeros({ 2 })
    sd['blocks.1.proj.weight'] = ms.zeros({ 3, 4 })
    local msg = errmsg(function() a:load_state_dict(sd) end)
    assert.matches('missing keys %(2%): scale, blocks.0.norm.bias', msg)
    assert.matches('unexpected keys %(1%): extra.weight', msg)
    assert.matches('mis%-shaped keys %(1%): blocks.1.proj.weight: checkpoint %(3, 4%), model %(4, 4%)', msg)
    assert.are.equal(0, maxdiff(a.blocks[1].proj.weight, before))
    -- not strict: missing/unexpected are returned; mis-shaped is still an error
    sd['blocks.1.proj.weight'] = nil
    local r = a:load_state_dict(sd, { strict = false })
    assert.are.same({ 'blocks.0.norm.bias', 'blocks.1.proj.weight', 'scale' }, (function()
      table.sort(r.missing); return r.missing end)())
    assert.are.same({ 'extra.weight' }, r.unexpected)
    sd['blocks.1.proj.weight'] = ms.zeros({ 4, 5 })
    assert.has_error(function() a:load_state_dict(sd, { strict = false }) end)
  end)

  it('zero_grad drops every gradient', function()
    local n = Net(7, 4)
    local y = n(ms.tensor({ { 1, 2 } }, { dtype = 'i64' }))
    y:sum():backward()
    for _, p in ipairs(n:parameters()) do assert.is_not_nil(p.grad) end
    n:zero_grad()
    for _, p in ipairs(n:parameters()) do assert.is_nil(p.grad) end
  end)

  it('to(dtype) converts in place, so references stay valid', function()
    local n = Net(7, 4)
    local w = n.blocks[1].proj.weight
    local v = w:clone()
    n(ms.tensor({ { 1 } }, { dtype = 'i64' })):sum():backward()
    n:to('f64')
    assert.are.equal(w, n.blocks[1].proj.weight)
    assert.are.equal('f64', w.dtype)
    assert.are.equal('f64', w.grad.dtype)
    assert.is_true(w.requires_grad)
    assert.are.equal(0, maxdiff(w, v:to('f64')))
    assert.are.equal('f64', n.scale.dtype)
    assert.are.equal(n.embed.weight, n.head.weight)
  end)

  it('tostring summarises the tree with parameter counts', function()
    local s = tostring(Net(7, 4))
    assert.matches('^Net  84 parameters', s)
    assert.matches('embed: Embedding%(7, 4%)  28', s)
    assert.matches('proj: Linear%(4, 4%)  20', s)
    local big = nn.ModuleList { nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2) }
    assert.matches('0%.%.3: Linear%(2, 2%)  6  %(x4%)', tostring(big))
  end)

  it('register_* validate their arguments', function()
    local m = nn.Module()
    assert.has_error(function() m:register_parameter('a.b', ms.zeros({ 1 })) end)
    assert.has_error(function() m:register_parameter('w', 3) end)
    assert.has_error(function() m:register_module('c', {}) end)
    assert.has_error(function() m:forward() end)
  end)
end)

describe('nn modules', function()
  before_each(function() A.clear_tape() end)

  it('Linear: weight (out, in), y = x W^T + b, clear shape errors', function()
    local l = nn.Linear(3, 2)
    assert.are.same({ 2, 3 }, l.weight.shape)
    local x = ms.randn({ 4, 3 })
    local want = F.add(F.matmul(x, l.weight, false, true), l.bias)
    assert.is_true(maxdiff(l(x), want) < 1e-6)
    local msg = errmsg(function() l(ms.randn({ 4, 5 })) end)
    assert.matches('linear: input of shape %(4, 5%) does not end in in_features = 3', msg)
    assert.is_nil(nn.Linear(3, 2, { bias = false }).bias)
    assert.has_error(function() nn.Linear(0, 2) end)
  end)

  it('Conv1D: weight (in, out) as GPT-2, y = x W + b', function()
    local c = nn.Conv1D(3, 5)
    assert.are.same({ 3, 5 }, c.weight.shape)
    local x = ms.randn({ 2, 3 })
    assert.is_true(maxdiff(c(x), F.add(F.matmul(x, c.weight), c.bias)) < 1e-6)
  end)

  it('Embedding: rows of the weight; bad ids name the id and the vocabulary', function()
    local e = nn.Embedding(5, 3)
    local ids = ms.tensor({ { 4, 0 } }, { dtype = 'i64' })
    local y = e(ids)
    assert.are.same({ 1, 2, 3 }, y.shape)
    assert.are.equal(0, maxdiff(y:select(1, 1):select(1, 1), e.weight:select(1, 5)))
    local msg = errmsg(function() e(ms.tensor({ 1, 5 }, { dtype = 'i64' })) end)
    assert.matches('token id 5', msg)
    assert.matches('vocabulary of 5', msg)
    msg = errmsg(function() e(ms.tensor({ -1 }, { dtype = 'i64' })) end)
    assert.matches('token id %-1', msg)
    assert.matches('ids must be i64 or i32', errmsg(function() e(ms.tensor({ 1 })) end))
    assert.are.same({ 1, 3 }, e(ms.tensor({ 2 }, { dtype = 'i32' })).shape)
  end)

  it('LayerNorm and RMSNorm match their formulas', function()
    local x = ms.randn({ 2, 5 }, { dtype = 'f64' })
    local ln = nn.LayerNorm(5, { eps = 1e-5 }):to('f64')
    ms.no_grad(function()
      ln.weight:copy_(ms.randn({ 5 }, { dtype = 'f64', seed = 2 }))
      ln.bias:copy_(ms.randn({ 5 }, { dtype = 'f64', seed = 3 }))
    end)
    local mu = F.mean(x, -1, true)
    local var = F.mean(F.square(F.sub(x, mu)), -1, true)
    local want = F.add(F.mul(F.div(F.sub(x, mu), F.sqrt(F.add(var, 1e-5))), ln.weight), ln.bias)
    assert.is_true(maxdiff(ln(x), want) < 1e-12)
    local rn = nn.RMSNorm(5, { eps = 1e-6 }):to('f64')
    local want2 = F.mul(F.div(x, F.sqrt(F.add(F.mean(F.square(x), -1, true), 1e-6))), rn.weight)
    assert.is_true(maxdiff(rn(x), want2) < 1e-12)
    assert.has_error(function() ln(ms.randn({ 2, 4 }, { dtype = 'f64' })) end)
  end)

  it('Dropout: identity in eval, zeros about p and scales the rest in training', function()
    local d = nn.Dropout(0.25)
    local x = ms.ones({ 10000 })
    d:eval()
    assert.are.equal(x, d(x))
    d:train()
    local y = d(x)
    local zeros = F.sum(F.eq(y, 0):to('f32')):item()
    assert.is_true(math.abs(zeros / 10000 - 0.25) < 0.02)
    local kept = F.sum(y):item() / (10000 - zeros)
    assert.is_true(math.abs(kept - 1 / 0.75) < 1e-5)
    local a = nnf.dropout(x, 0.5, true, { seed = 3 })
    local b = nnf.dropout(x, 0.5, true, { seed = 3 })
    assert.are.equal(0, maxdiff(a, b))
  end)

  it('GELU (tanh form) and SiLU match their formulas', function()
    local x = ms.randn({ 7 }, { dtype = 'f64' })
    local c = math.sqrt(2 / math.pi)
    local inner = F.mul(F.add(x, F.mul(F.pow(x, 3), 0.044715)), c)
    local want = F.mul(F.mul(x, 0.5), F.add(F.tanh(inner), 1))
    assert.is_true(maxdiff(nn.GELU()(x), want) < 1e-12)
    assert.is_true(maxdiff(nn.SiLU()(x), F.mul(x, F.sigmoid(x))) < 1e-12)
    assert.has_error(function() nn.GELU { approximate = 'none' } end)
  end)

  it('MLP, GatedMLP, Sequential, ModuleList use the Hugging Face names', function()
    local names = function(m)
      local r = {}
      for n, p in m:named_parameters() do r[#r + 1] = n .. ':' .. table.concat(p.shape, 'x') end
      return table.concat(r, ' ')
    end
    assert.are.equal('c_fc.weight:4x16 c_fc.bias:16 c_proj.weight:16x4 c_proj.bias:4',
      names(nn.MLP { dim = 4 }))
    assert.are.equal('gate_proj.weight:6x4 up_proj.weight:6x4 down_proj.weight:4x6',
      names(nn.GatedMLP { dim = 4, hidden = 6 }))
    local s = nn.Sequential(nn.Linear(2, 3), nn.SiLU(), nn.Linear(3, 1))
    assert.are.equal('0.weight:3x2 0.bias:3 2.weight:1x3 2.bias:1', names(s))
    assert.are.equal(s[3], s['2'])
    local l = nn.ModuleList { nn.Linear(2, 2) }
    l:append(nn.Linear(2, 2))
    assert.are.equal(2, #l)
    assert.has_error(function() l(ms.zeros({ 2 })) end)
    local x = ms.randn({ 5, 2 })
    assert.are.equal(0, maxdiff(s(x), s[3](s[2](s[1](x)))))
  end)

  for _, conv in ipairs({ true, false }) do
    it(('MLP (%s) runs one gelu_mlp node, equal to the layers one by one; a hooked layer takes the chain')
      :format(conv and 'Conv1D' or 'Linear'), function()
      local m = nn.MLP { dim = 4, hidden = 8, conv1d = conv, dtype = 'f64' }
      for i, p in ipairs(m:parameters()) do p:copy_(ms.randn(p.shape, { seed = 30 + i }):double()) end
      local x = ms.randn({ 2, 3, 4 }, { seed = 32 }):double():requires_grad_()
      local g = ms.randn({ 2, 3, 4 }, { seed = 33 }):double()
      local function run()
        m:zero_grad()
        x.grad = nil
        local y = m(x)
        local ops = {}
        for _, node in ipairs(A.tape) do ops[#ops + 1] = node.name end
        y:backward(g)
        local gs = { x = x.grad:clone() }
        for n, p in m:named_parameters() do gs[n] = p.grad:clone() end
        return y:detach(), gs, table.concat(ops, ' ')
      end
      A.clear_tape()
      local y1, g1, ops1 = run()
      assert.are.equal('gelu_mlp', ops1)
      -- the chain, forced by a hook on c_fc
      local seen = 0
      local h = m.c_fc:register_forward_hook(function() seen = seen + 1 end)
      local y2, g2, ops2 = run()
      h:remove()
      assert.are.equal(1, seen)
      assert.matches('gelu', ops2, 1, true)
      assert.are_not.equal('gelu_mlp', ops2)
      assert.is_true(maxdiff(y1, y2) < 1e-12)
      for k, v in pairs(g1) do assert.is_true(maxdiff(v, g2[k]) < 1e-12, k) end
      -- and by hand
      local lin = conv and nnf.conv1d_linear or nnf.linear
      local want = lin(nnf.gelu(lin(x:detach(), m.c_fc.weight:detach(), m.c_fc.bias:detach())),
        m.c_proj.weight:detach(), m.c_proj.bias:detach())
      assert.is_true(maxdiff(y1, want) < 1e-12)
    end)
  end

  it('gelu_mlp names mismatched shapes', function()
    local ok, err = pcall(nnf.gelu_mlp, ms.randn({ 2, 4 }), ms.randn({ 4, 8 }), ms.randn({ 8 }), ms.randn({ 7, 4 }),
      ms.randn({ 4 }), false)
    assert.is_false(ok)
    assert.matches('shapes do not chain', err, 1, true)
    assert.matches('w2 (7, 4)', err, 1, true)
  end)

  it('swiglu is one node with silu(gate) * up and its gradients (f64 finite differences); shapes must match', function()
    local gate = ms.randn({ 3, 5 }, { seed = 61 }):double():requires_grad_()
    local up = ms.randn({ 3, 5 }, { seed = 62 }):double():requires_grad_()
    local y = nnf.swiglu(gate, up)
    assert.are.equal('swiglu', A.tape[#A.tape].name)
    assert.is_true(maxdiff(y, F.mul(F.silu(gate:detach()), up:detach())) < 1e-14)
    A.clear_tape()
    local worst = A.gradcheck(function() return nnf.swiglu(gate, up) end, { gate, up })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    local ok, err = pcall(nnf.swiglu, gate, ms.randn({ 5 }))
    assert.is_false(ok)
    assert.matches('gate (3, 5) and up (5)', err, 1, true)
  end)

  it('add_layer_norm is one node of two outputs with their gradients (f64 finite differences)', function()
    local x = ms.randn({ 2, 3, 6 }, { seed = 71 }):double():requires_grad_()
    local h = ms.randn({ 2, 3, 6 }, { seed = 72 }):double():requires_grad_()
    local w = ms.randn({ 6 }, { seed = 73 }):double():requires_grad_()
    local b = ms.randn({ 6 }, { seed = 74 }):double():requires_grad_()
    local r1 = ms.randn({ 2, 3, 6 }, { seed = 75 }):double()
    local r2 = ms.randn({ 2, 3, 6 }, { seed = 76 }):double()
    A.clear_tape()
    local res, y = nnf.add_layer_norm(x, h, w, b, 1e-5)
    assert.are.equal(1, #A.tape)
    assert.is_true(maxdiff(res, x:detach() + h:detach()) == 0)
    assert.is_true(maxdiff(y, nnf.layer_norm(res:detach(), w:detach(), b:detach(), 1e-5)) < 1e-14)
    A.clear_tape()
    local worst = A.gradcheck(function()
      local s, z = nnf.add_layer_norm(x, h, w, b, 1e-5)
      return ms.sum(s * r1) + ms.sum(z * r2)
    end, { x, h, w, b })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('add_layer_norm / add_rms_norm give a bf16 h its gradient in bf16 beside an f32 x (one pass)', function()
    for _, rms in ipairs({ false, true }) do
      for _, both in ipairs({ true, false }) do
        local x = ms.randn({ 3, 16 }, { seed = 91 })
        local h = ms.randn({ 3, 16 }, { seed = 92 }):to('bf16'):requires_grad_()
        local w = ms.randn({ 16 }, { seed = 93 })
        local g = ms.randn({ 3, 16 }, { seed = 94 })
        if both then x:requires_grad_() end
        A.clear_tape()
        local res, y
        -- under autocast the norm emits bf16, so its gradient comes in bf16 (h's dtype)
        nnf.autocast('bf16', function()
          if rms then res, y = nnf.add_rms_norm(x, h, w, 1e-6) else res, y = nnf.add_layer_norm(x, h, w, nil, 1e-5) end
        end)
        assert.are.equal('f32', res.dtype)
        assert.are.equal('bf16', y.dtype)
        ms.sum(y:to('f32') * g):backward()
        assert.are.equal('bf16', h.grad.dtype)
        if both then
          assert.are.equal('f32', x.grad.dtype)
          assert.is_true(maxdiff(h.grad, x.grad:to('bf16')) == 0)
        else
          assert.is_nil(x.grad)
        end
      end
    end
  end)

  it('add_rms_norm is one node of two outputs with their gradients (f64 finite differences)', function()
    local x = ms.randn({ 2, 3, 6 }, { seed = 81 }):double():requires_grad_()
    local h = ms.randn({ 2, 3, 6 }, { seed = 82 }):double():requires_grad_()
    local w = ms.randn({ 6 }, { seed = 83 }):double():requires_grad_()
    local r1 = ms.randn({ 2, 3, 6 }, { seed = 84 }):double()
    local r2 = ms.randn({ 2, 3, 6 }, { seed = 85 }):double()
    A.clear_tape()
    local res, y = nnf.add_rms_norm(x, h, w, 1e-6)
    assert.are.equal(1, #A.tape)
    assert.is_true(maxdiff(y, nnf.rms_norm(res:detach(), w:detach(), 1e-6)) < 1e-14)
    A.clear_tape()
    local worst = A.gradcheck(function()
      local s, z = nnf.add_rms_norm(x, h, w, 1e-6)
      return ms.sum(s * r1) + ms.sum(z * r2)
    end, { x, h, w })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('GatedMLP computes down(silu(gate x) * up x)', function()
    local m = nn.GatedMLP { dim = 3, hidden = 5 }
    local x = ms.randn({ 2, 3 })
    local g = F.silu(F.matmul(x, m.gate_proj.weight, false, true))
    local u = F.matmul(x, m.up_proj.weight, false, true)
    local want = F.matmul(F.mul(g, u), m.down_proj.weight, false, true)
    assert.is_true(maxdiff(m(x), want) < 1e-5)
  end)

  it('swiglu_cat: silu(gu[..., :I]) * gu[..., I:] as one node, its gradient (f64 finite differences); errors', function()
    local gu = ms.randn({ 2, 3, 10 }, { seed = 63 }):double():requires_grad_()
    local y = nnf.swiglu_cat(gu)
    assert.are.equal('swiglu_cat', A.tape[#A.tape].name)
    assert.are.same({ 2, 3, 5 }, y.shape)
    local g, u = gu:detach():narrow(3, 1, 5), gu:detach():narrow(3, 6, 5)
    assert.is_true(maxdiff(y, F.mul(F.silu(g), u)) < 1e-14)
    A.clear_tape()
    local worst = A.gradcheck(function() return nnf.swiglu_cat(gu) end, { gu })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    -- a non-contiguous input (the transpose of a (10, 3) product) and a 1-D one
    local t = ms.randn({ 10, 3 }, { seed = 64 }):double():requires_grad_()
    worst = A.gradcheck(function() return nnf.swiglu_cat(t:t()) end, { t })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    local v = ms.randn({ 6 }, { seed = 65 }):double():requires_grad_()
    worst = A.gradcheck(function() return nnf.swiglu_cat(v) end, { v })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    assert.matches('gu must end in an even dimension (2 I), got (2, 7)', errmsg(function()
      nnf.swiglu_cat(ms.randn({ 2, 7 })) end), 1, true)
    assert.matches('the gate weight (4, 3) f32 on cpu and the up weight (5, 3) f32 on cpu must be alike',
      errmsg(function() nnf.swiglu_gate_up(ms.randn({ 2, 3 }), ms.randn({ 4, 3 }), ms.randn({ 5, 3 })) end), 1, true)
  end)

  it('swiglu_gate_up_joined: weights side by side in one storage, their joint view; gradients as the two products', function()
    local I, H = 5, 4
    local base = ms.randn({ 2 * I, H }, { seed = 68 }):double()
    local wg, wu = base:narrow(1, 1, I):requires_grad_(), base:narrow(1, I + 1, I):requires_grad_()
    assert.is_true(nnf.side_by_side(wg, wu))
    assert.is_false(nnf.side_by_side(wu, wg))
    local x0 = ms.randn({ 2, 3, H }, { seed = 69 }):double()
    local r = ms.randn({ 2, 3, I }, { seed = 70 }):double()
    local function run(fn, a, b)
      local x = x0:detach():requires_grad_()
      A.clear_tape()
      local h = fn(x, a, b)
      ms.sum(h * r):backward()
      return h, x.grad
    end
    local wg0, wu0 = wg:detach():clone():requires_grad_(), wu:detach():clone():requires_grad_()
    local h0, gx0 = run(function(x, a, b) return nnf.swiglu(nnf.linear(x, a), nnf.linear(x, b)) end, wg0, wu0)
    local h1, gx1 = run(nnf.swiglu_gate_up_joined, wg, wu)
    assert.is_true(maxdiff(h0, h1) < 1e-14)
    assert.is_true(maxdiff(gx0, gx1) < 1e-13)
    assert.is_true(maxdiff(wg0.grad, wg.grad) < 1e-13)
    assert.is_true(maxdiff(wu0.grad, wu.grad) < 1e-13)
    -- .grad side by side in one buffer (FSDP's grad_direct): added into at once
    local gbuf = ms.zeros({ 2 * I, H }, { dtype = 'f64' })
    wg.grad, wu.grad = gbuf:narrow(1, 1, I), gbuf:narrow(1, I + 1, I)
    run(nnf.swiglu_gate_up_joined, wg, wu)
    assert.is_true(maxdiff(gbuf:narrow(1, 1, I), wg0.grad) < 1e-13)
    assert.is_true(maxdiff(gbuf:narrow(1, I + 1, I), wu0.grad) < 1e-13)
    -- finite differences through the joint view (the base's rows)
    wg.grad, wu.grad = nil, nil
    local xg = x0:detach():requires_grad_()
    local worst = A.gradcheck(function() return nnf.swiglu_gate_up_joined(xg, wg, wu) end, { xg, wg, wu })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    assert.matches('must be side by side in one storage', errmsg(function()
      nnf.swiglu_gate_up_joined(x0, wu, wg) end), 1, true)
  end)

  it('GatedMLP: gate and up as one product (swiglu_gate_up) when both are plain; the same values', function()
    local function run(m, x, on)
      local prev = nn.set_fuse_gate_up(on)
      for _, p in ipairs(m:parameters()) do p.grad = nil end
      local xi = x:detach():requires_grad_()
      A.clear_tape()
      local y = m(xi)
      local names = {}
      for _, n in ipairs(A.tape) do names[#names + 1] = n.name end
      ms.sum(y * y):backward()
      nn.set_fuse_gate_up(prev)
      local gs = { xi.grad }
      for _, p in ipairs(m:parameters()) do gs[#gs + 1] = p.grad end
      return y, gs, table.concat(names, ' ')
    end
    local m = nn.GatedMLP { dim = 6, hidden = 10 }:to('f64')
    local x = ms.randn({ 2, 3, 6 }, { seed = 66 }):double()
    local y0, g0, t0 = run(m, x, false)
    local y1, g1, t1 = run(m, x, true)
    assert.matches('swiglu_cat', t1, 1, true)
    assert.is_nil(t0:find('swiglu_cat', 1, true))
    assert.is_true(maxdiff(y0, y1) < 1e-13)
    assert.are.equal(#g0, #g1)
    for i = 1, #g0 do assert.is_true(maxdiff(g0[i], g1[i]) < 1e-13, 'gradient ' .. i) end
    -- a hook on gate_proj: the modules one by one (the hook sees its call)
    local calls = 0
    local h = m.gate_proj:register_forward_hook(function() calls = calls + 1 end)
    local _, g2, t2 = run(m, x, true)
    assert.are.equal(1, calls)
    assert.is_nil(t2:find('swiglu_cat', 1, true))
    for i = 1, #g0 do assert.is_true(maxdiff(g0[i], g2[i]) < 1e-13, 'gradient ' .. i) end
    h:remove()
    -- bf16 under autocast: the f32 weights' gradients in f32, within bf16
    -- bounds of the two products'
    local m32 = nn.GatedMLP { dim = 16, hidden = 24 }
    local x32 = ms.randn({ 4, 16 }, { seed = 67 })
    local function auto(on)
      local prev = nn.set_fuse_gate_up(on)
      for _, p in ipairs(m32:parameters()) do p.grad = nil end
      local y = nnf.autocast('bf16', m32, x32)
      local yf = y:float()
      ms.sum(yf * yf):backward()
      nn.set_fuse_gate_up(prev)
      local r = {}
      for _, p in ipairs(m32:parameters()) do
        assert.are.equal('f32', p.grad.dtype)
        r[#r + 1] = p.grad
      end
      return r
    end
    local a0, a1 = auto(false), auto(true)
    for i = 1, #a0 do
      local d = F.sub(a0[i], a1[i])
      local e = math.sqrt(F.sum(F.mul(d, d)):item() / F.sum(F.mul(a0[i], a0[i])):item())
      assert.is_true(e < 2e-2, 'gradient ' .. i .. ': ' .. e)
    end
  end)
end)

describe('attention', function()
  before_each(function() A.clear_tape() end)

  it('parameter names: Llama (q/k/v/o_proj) and GPT-2 (c_attn, c_proj)', function()
    local names = function(m)
      local r = {}
      for n, p in m:named_parameters() do r[#r + 1] = n .. ':' .. table.concat(p.shape, 'x') end
      return table.concat(r, ' ')
    end
    assert.are.equal('q_proj.weight:8x8 k_proj.weight:4x8 v_proj.weight:4x8 o_proj.weight:8x8',
      names(nn.CausalSelfAttention { dim = 8, n_head = 4, n_kv_head = 2 }))
    assert.are.equal('c_attn.weight:8x24 c_attn.bias:24 c_proj.weight:8x8 c_proj.bias:8',
      names(nn.CausalSelfAttention { dim = 8, n_head = 2, fused_qkv = true }))
    assert.matches('q_proj.bias:8', names(nn.CausalSelfAttention { dim = 8, n_head = 4, bias = true, o_bias = false }))
    assert.has_error(function() nn.CausalSelfAttention { dim = 8, n_head = 3 } end)
    assert.has_error(function() nn.CausalSelfAttention { dim = 8, n_head = 4, n_kv_head = 3 } end)
  end)

  it('scaled_dot_product_attention equals softmax(q k^T / sqrt(d) + mask) v', function()
    local q = ms.randn({ 1, 2, 3, 4 }, { dtype = 'f64', seed = 1 })
    local k = ms.randn({ 1, 2, 3, 4 }, { dtype = 'f64', seed = 2 })
    local v = ms.randn({ 1, 2, 3, 4 }, { dtype = 'f64', seed = 3 })
    local s = F.mul(F.matmul(q, k, false, true), 0.5)
    -- mask by hand: -inf where key > query
    local m = ms.zeros({ 3, 3 }, { dtype = 'f64' })
    for i = 1, 3 do for j = i + 1, 3 do m:set(i, j, -math.huge) end end
    local want = F.matmul(F.softmax(F.add(s, m), -1), v)
    assert.is_true(maxdiff(nnf.scaled_dot_product_attention(q, k, v), want) < 1e-12)
    local want2 = F.matmul(F.softmax(s, -1), v)
    assert.is_true(maxdiff(nnf.scaled_dot_product_attention(q, k, v, { causal = false }), want2) < 1e-12)
    assert.has_error(function() nnf.scaled_dot_product_attention(q, k:narrow(2, 1, 1), v) end)
  end)

  it('grouped-query attention equals multi-head attention with repeated kv heads', function()
    ms.manual_seed(5)
    local gqa = nn.CausalSelfAttention { dim = 8, n_head = 4, n_kv_head = 2, rope_theta = 10000 }
    local mha = nn.CausalSelfAttention { dim = 8, n_head = 4, rope_theta = 10000 }
    local function rep(w) -- (2 heads * 2, 8) -> (4 heads * 2, 8): head h uses kv head floor(h / 2)
      local rows = {}
      for h = 0, 3 do rows[#rows + 1] = w:narrow(1, math.floor(h / 2) * 2 + 1, 2) end
      return F.cat(rows, 1)
    end
    ms.no_grad(function()
      mha.q_proj.weight:copy_(gqa.q_proj.weight)
      mha.o_proj.weight:copy_(gqa.o_proj.weight)
      mha.k_proj.weight:copy_(rep(gqa.k_proj.weight))
      mha.v_proj.weight:copy_(rep(gqa.v_proj.weight))
    end)
    local x = ms.randn({ 2, 5, 8 })
    assert.is_true(maxdiff(gqa(x), mha(x)) < 1e-5)
  end)

  it('RoPE follows Hugging Face Llama (rotate_half, inv_freq = theta^(-2i/d))', function()
    local T_, d, theta = 4, 6, 100
    local cos, sin = nnf.rope_cache(T_, d, theta, 'f64')
    local x = ms.randn({ 1, 1, T_, d }, { dtype = 'f64', seed = 4 })
    local y = nnf.apply_rotary(x, cos, sin)
    for t = 0, T_ - 1 do
      for j = 0, d - 1 do
        local i = j % (d / 2)
        local ang = t * theta ^ (-2 * i / d)
        local rot = j < d / 2 and -x:get(1, 1, t + 1, j + 1 + d / 2) or x:get(1, 1, t + 1, j + 1 - d / 2)
        local want = x:get(1, 1, t + 1, j + 1) * math.cos(ang) + rot * math.sin(ang)
        assert.is_true(math.abs(y:get(1, 1, t + 1, j + 1) - want) < 1e-12)
      end
    end
  end)

  it('is causal: outputs do not depend on later positions', function()
    for _, cfg in ipairs({ { dim = 8, n_head = 2, fused_qkv = true },
      { dim = 8, n_head = 4, n_kv_head = 2, rope_theta = 10000 } }) do
      local m = nn.CausalSelfAttention(cfg)
      local x = ms.randn({ 1, 4, 8 })
      local y1 = m(x)
      local x2 = x:clone()
      ms.no_grad(function() F.add_(x2:narrow(2, 4, 1), 1) end)
      local y2 = m(x2)
      assert.is_true(maxdiff(y1:narrow(2, 1, 3), y2:narrow(2, 1, 3)) < 1e-6)
      assert.is_true(maxdiff(y1:narrow(2, 4, 1), y2:narrow(2, 4, 1)) > 1e-4)
    end
    local m = nn.CausalSelfAttention { dim = 8, n_head = 2 }
    assert.matches('expected x of shape %(B, T, 8%)', errmsg(function() m(ms.randn({ 1, 4, 6 })) end))
  end)
end)

describe('losses', function()
  before_each(function() A.clear_tape() end)

  local function ce_by_hand(logits, targets, ignore, ls)
    local L, V = logits:totable(), logits.shape[2]
    local total, n = 0, 0
    for i, row in ipairs(L) do
      local t = targets[i]
      if t ~= ignore then
        local mx = -math.huge
        for _, v in ipairs(row) do mx = math.max(mx, v) end
        local s = 0
        for _, v in ipairs(row) do s = s + math.exp(v - mx) end
        local lse = mx + math.log(s)
        local nll = lse - row[t + 1]
        local smooth = 0
        for _, v in ipairs(row) do smooth = smooth + (lse - v) end
        total = total + (1 - ls) * nll + ls * smooth / V
        n = n + 1
      end
    end
    return total, n
  end

  it('cross_entropy matches a hand computation (ignore_index, label smoothing, reductions)', function()
    local logits = ms.randn({ 4, 6 }, { dtype = 'f64', seed = 8 })
    local tt = { 2, -100, 5, 0 }
    local t = ms.tensor(tt, { dtype = 'i64' })
    local tot, n = ce_by_hand(logits, tt, -100, 0)
    assert.is_true(math.abs(nnf.cross_entropy(logits, t):item() - tot / n) < 1e-12)
    assert.is_true(math.abs(nnf.cross_entropy(logits, t, { reduction = 'sum' }):item() - tot) < 1e-12)
    local none = nnf.cross_entropy(logits, t, { reduction = 'none' })
    assert.are.same({ 4 }, none.shape)
    assert.are.equal(0, none:get(2))
    local tot2, n2 = ce_by_hand(logits, tt, -100, 0.2)
    assert.is_true(math.abs(nnf.cross_entropy(logits, t, { label_smoothing = 0.2 }):item() - tot2 / n2) < 1e-12)
    local tt3 = { 2, 1, 5, 0 }
    local tot3, n3 = ce_by_hand(logits, tt3, 5, 0)
    assert.are.equal(3, n3)
    assert.is_true(math.abs(nnf.cross_entropy(logits, ms.tensor(tt3, { dtype = 'i64' }),
      { ignore_index = 5 }):item() - tot3 / n3) < 1e-12)
  end)

  it('cross_entropy with every target ignored is 0 with a zero gradient, not NaN', function()
    local logits = ms.randn({ 3, 4 }, { dtype = 'f64' }):requires_grad_()
    local t = ms.tensor({ -100, -100, -100 }, { dtype = 'i64' })
    local loss = nnf.cross_entropy(logits, t)
    assert.are.equal(0, loss:item())
    loss:backward()
    assert.are.equal(0, F.sum(F.abs(logits.grad)):item())
  end)

  it('cross_entropy errors: out-of-range target, wrong target shape or dtype', function()
    local logits = ms.randn({ 3, 4 })
    assert.matches('target 4 is out of range for 4 classes',
      errmsg(function() nnf.cross_entropy(logits, ms.tensor({ 0, 4, 1 }, { dtype = 'i64' })) end))
    assert.has_error(function() nnf.cross_entropy(logits, ms.tensor({ 0, 1 }, { dtype = 'i64' })) end)
    assert.has_error(function() nnf.cross_entropy(logits, ms.tensor({ 0, 1, 2 })) end)
  end)

  it('lm_loss is cross_entropy of hidden @ W^T, and looked up at call time', function()
    local h = ms.randn({ 2, 3, 4 }, { dtype = 'f64' })
    local w = ms.randn({ 5, 4 }, { dtype = 'f64' })
    local t = ms.tensor({ { 1, 2, 3 }, { 4, 0, -100 } }, { dtype = 'i64' })
    local want = nnf.cross_entropy(F.matmul(h, w, false, true):view(6, 5), t:view(6))
    assert.is_true(math.abs(nnf.lm_loss(h, w, t):item() - want:item()) < 1e-12)
    local M = nn.Module:extend('UsesLoss')
    function M:forward(x) return nn.functional.lm_loss(x, w, t) end
    local saved = nn.functional.lm_loss
    nn.functional.lm_loss = function() return 'fused' end
    local ok, r = pcall(function() return M()(h) end)
    nn.functional.lm_loss = saved
    assert.is_true(ok)
    assert.are.equal('fused', r)
  end)
end)
