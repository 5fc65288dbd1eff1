-- The hooks the sharding layer relies on, exercised by a fake FSDP user:
-- forward pre/post hooks (unshard / reshard), backward pre/post hooks fired
-- by tape markers (unshard before a unit's backward; reduce-scatter once its
-- gradients are final), the tape's module order (prefetch), and tape-level
-- events. See docs/autograd.md.
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local A = ms.autograd
local F = ms.raw

-- a tiny tied-embedding LM: wte -> blocks -> ln_f -> wte^T
local Block = nn.Module:extend('HookBlock')
function Block:init(dim)
  self:register_module('ln', nn.LayerNorm(dim))
  self:register_module('fc', nn.Linear(dim, dim))
end
function Block:forward(x) return x + self.fc(self.ln(x)) end

local LM = nn.Module:extend('HookLM')
function LM:init(vocab, dim, n, ckpt)
  self.ckpt = ckpt
  self:register_module('wte', nn.Embedding(vocab, dim))
  local blocks = {}
  for i = 1, n do blocks[i] = Block(dim) end
  self:register_module('h', nn.ModuleList(blocks))
  self:register_module('ln_f', nn.LayerNorm(dim))
end
function LM:forward(ids, targets)
  local x = self.wte(ids)
  for _, b in ipairs(self.h) do
    if self.ckpt then x = ms.checkpoint(b, x) else x = b(x) end
  end
  return nn.functional.lm_loss(self.ln_f(x), self.wte.weight, targets)
end

local function make(ckpt)
  ms.manual_seed(3)
  local m = LM(11, 6, 3, ckpt)
  m:to('f64')
  local ids = ms.tensor({ { 1, 5, 7, 2 }, { 3, 3, 9, 10 } }, { dtype = 'i64' })
  local tg = ms.tensor({ { 5, 7, 2, 0 }, { 3, 9, 10, 1 } }, { dtype = 'i64' })
  return m, ids, tg
end

-- The fake FSDP: units are modules; the root is the whole model.
local function fake_fsdp(model)
  local units, names = {}, {}
  for i, b in ipairs(model.h) do units[#units + 1] = b; names[b] = 'b' .. i end
  units[#units + 1] = model
  names[model] = 'root'
  local log, handles = {}, {}
  local state = {}
  local snapshots = {}
  local function own_params(u)
    if u == model then
      -- the root unit owns what no block took
      return { model.wte.weight, model.ln_f.weight, model.ln_f.bias }
    end
    return u:parameters()
  end
  for _, u in ipairs(units) do
    local n = names[u]
    handles[#handles + 1] = u:register_forward_pre_hook(function(m, inputs)
      log[#log + 1] = 'fwd_pre:' .. n
      state[m] = 'unsharded'
    end)
    handles[#handles + 1] = u:register_forward_hook(function(m, inputs, out)
      log[#log + 1] = 'fwd_post:' .. n
      if m ~= model then state[m] = 'sharded' end
    end)
    handles[#handles + 1] = u:register_backward_pre_hook(function(m)
      log[#log + 1] = 'bwd_pre:' .. n
      state[m] = 'unsharded'
      -- prefetch: the unit before m in forward order is needed next
      local order = A.tape_modules()
      for i = 2, #order do
        if order[i] == m and names[order[i - 1]] and order[i - 1] ~= model then
          log[#log + 1] = 'prefetch:' .. names[order[i - 1]]
        end
      end
    end)
    handles[#handles + 1] = u:register_backward_hook(function(m)
      log[#log + 1] = 'bwd_post:' .. n
      assert.are.equal('unsharded', state[m])
      state[m] = 'sharded'
      -- "reduce-scatter": the grads must exist and be final now
      local snap = {}
      for i, p in ipairs(own_params(m)) do
        assert.is_not_nil(p.grad, n .. ' param ' .. i .. ' has no grad in its post-backward hook')
        snap[i] = p.grad:clone()
      end
      snapshots[m] = snap
    end)
  end
  handles[#handles + 1] = A.register_hook('backward_begin', function()
    local order = {}
    for _, m in ipairs(A.tape_modules()) do order[#order + 1] = names[m] end
    log[#log + 1] = 'begin:' .. table.concat(order, ',')
  end)
  handles[#handles + 1] = A.register_hook('backward_end', function() log[#log + 1] = 'end' end)
  local fsdp = { log = log, units = units, names = names }
  function fsdp.check_final()
    for _, u in ipairs(units) do
      for i, p in ipairs(own_params(u)) do
        local d = F.sub(p.grad, snapshots[u][i])
        assert.are.equal(0, F.sum(F.abs(d)):item(), names[u] .. ' param ' .. i .. ' changed after its hook')
      end
    end
  end
  function fsdp.remove()
    for _, h in ipairs(handles) do h.remove() end
  end
  return fsdp
end

local function grads(m)
  local r = {}
  for name, p in m:named_parameters() do r[name] = p.grad:clone() end
  return r
end

describe('hooks for a sharding runtime', function()
  before_each(function() A.clear_tape() end)

  it('fire forward and backward hooks in unit order, grads final at post-backward', function()
    local m, ids, tg = make(false)
    local fsdp = fake_fsdp(m)
    local loss = m(ids, tg)
    local fwd = table.concat(fsdp.log, ' ')
    assert.are.equal('fwd_pre:root fwd_pre:b1 fwd_post:b1 fwd_pre:b2 fwd_post:b2 fwd_pre:b3 fwd_post:b3 fwd_post:root', fwd)
    -- the tape knows the units' order before backward starts
    local order = {}
    for _, u in ipairs(A.tape_modules()) do order[#order + 1] = fsdp.names[u] end
    assert.are.equal('root,b1,b2,b3', table.concat(order, ','))
    for k in pairs(fsdp.log) do fsdp.log[k] = nil end
    loss:backward()
    assert.are.equal(table.concat({
      'begin:root,b1,b2,b3',
      'bwd_pre:root',
      'bwd_pre:b3', 'prefetch:b2', 'bwd_post:b3',
      'bwd_pre:b2', 'prefetch:b1', 'bwd_post:b2',
      'bwd_pre:b1', 'bwd_post:b1',
      'bwd_post:root',
      'end' }, ' '), table.concat(fsdp.log, ' '))
    fsdp.check_final()
    assert.are.equal(0, #A.tape_modules())
    fsdp.remove()
  end)

  it('tied weights: the root unit sees both uses of wte in its final grad', function()
    local m, ids, tg = make(false)
    local fsdp = fake_fsdp(m)
    m(ids, tg):backward()
    fsdp.check_final()
    fsdp.remove()
    -- the same model without hooks gives the same gradients
    local g1 = grads(m)
    m:zero_grad()
    m(ids, tg):backward()
    for name, p in m:named_parameters() do
      assert.are.equal(0, F.sum(F.abs(F.sub(p.grad, g1[name]))):item(), name)
    end
  end)

  it('checkpointed units: forward hooks run again for the recompute, backward hooks once, in order', function()
    local m, ids, tg = make(true)
    local fsdp = fake_fsdp(m)
    local loss = m(ids, tg)
    local order = {}
    for _, u in ipairs(A.tape_modules()) do order[#order + 1] = fsdp.names[u] end
    assert.are.equal('root,b1,b2,b3', table.concat(order, ','))
    for k in pairs(fsdp.log) do fsdp.log[k] = nil end
    loss:backward()
    assert.are.equal(table.concat({
      'begin:root,b1,b2,b3',
      'bwd_pre:root',
      'fwd_pre:b3', 'fwd_post:b3', 'bwd_pre:b3', 'bwd_post:b3',
      'fwd_pre:b2', 'fwd_post:b2', 'bwd_pre:b2', 'bwd_post:b2',
      'fwd_pre:b1', 'fwd_post:b1', 'bwd_pre:b1', 'bwd_post:b1',
      'bwd_post:root',
      'end' }, ' '), table.concat(fsdp.log, ' '))
    fsdp.check_final()
    fsdp.remove()
    -- checkpointed and plain runs agree
    local gc = grads(m)
    local m2 = make(false)
    m2(ids, tg):backward()
    for name, p in m2:named_parameters() do
      local d = F.sum(F.abs(F.sub(p.grad, gc[name]))):item()
      assert.is_true(d < 1e-12, name)
    end
  end)

  it('records no markers once the backward hooks are removed', function()
    local m, ids, tg = make(false)
    local fsdp = fake_fsdp(m)
    fsdp.remove()
    local loss = m(ids, tg)
    assert.are.equal(0, #A.tape_modules())
    for i = 1, A.tape_size() do assert.is_nil(A.tape[i].marker) end
    loss:backward()
    assert.are.equal(0, #fsdp.log)
  end)

  it('global module hooks mark every module; queue_callback runs at the end', function()
    local m, ids, tg = make(false)
    local seen, after = {}, nil
    local h1 = A.register_hook('module_pre_backward', function(mod) seen[#seen + 1] = 'pre:' .. mod:class_name() end)
    local h2 = A.register_hook('module_post_backward', function(mod)
      seen[#seen + 1] = 'post:' .. mod:class_name()
      if mod == m then A.queue_callback(function() after = #seen end) end
    end)
    m(ids, tg):backward()
    h1.remove(); h2.remove()
    assert.are.equal('pre:HookLM', seen[1])
    assert.are.equal('post:HookLM', seen[#seen])
    assert.are.equal(#seen, after)
    -- every module that ran (all but the ModuleList) got a pre and a post
    local n = 0
    for mod in m:modules() do if mod:class_name() ~= 'ModuleList' then n = n + 1 end end
    assert.are.equal(2 * n, #seen)
    assert.has_error(function() A.queue_callback(function() end) end)
  end)

  it('a backward that fails runs only the callbacks queued with always; the first error is raised', function()
    local x = ms.randn({ 3 }, { seed = 5 }):requires_grad_()
    local ran = {}
    local y = x * 2
    y:register_hook(function()
      A.queue_callback(function() ran[#ran + 1] = 'plain' end)
      A.queue_callback(function() ran[#ran + 1] = 'always'; error('second') end, { always = true })
      error('the hook failed')
    end)
    local ok, e = pcall(function() y:sum():backward() end)
    assert.is_false(ok)
    assert.matches('the hook failed', tostring(e))
    assert.are.same({ 'always' }, ran)
    -- and both run after a backward that succeeds
    ran = {}
    local z = x * 3
    z:register_hook(function()
      A.queue_callback(function() ran[#ran + 1] = 'plain' end)
      A.queue_callback(function() ran[#ran + 1] = 'always' end, { always = true })
    end)
    z:sum():backward()
    assert.are.same({ 'plain', 'always' }, ran)
    assert.has_error(function() A.queue_callback('nope') end)
  end)

  it('gradients accumulate into views of a flat buffer preset as .grad', function()
    local m, ids, tg = make(false)
    m(ids, tg):backward()
    local want = grads(m)
    m:zero_grad()
    local ps = m:parameters()
    local n = 0
    for _, p in ipairs(ps) do n = n + p:numel() end
    local flat = ms.zeros({ n }, { dtype = 'f64' })
    local off = 1
    for _, p in ipairs(ps) do
      p.grad = flat:narrow(1, off, p:numel()):view(p.shape)
      off = off + p:numel()
    end
    m(ids, tg):backward()
    off = 1
    for name, p in m:named_parameters() do
      local part = flat:narrow(1, off, p:numel()):view(p.shape)
      assert.are.equal(0, F.max(F.abs(F.sub(part, want[name]))):item(), name)
      off = off + p:numel()
    end
  end)

  it('forward hooks can replace inputs and outputs', function()
    local lin = nn.Linear(3, 2)
    local x = ms.randn({ 1, 3 })
    local h1 = lin:register_forward_pre_hook(function(m, inputs) return { F.mul(inputs[1], 0) } end)
    local h2 = lin:register_forward_hook(function(m, inputs, out) return F.add(out, 1) end)
    local y = lin(x)
    local want = F.add(lin.bias, 1)
    assert.are.equal(0, F.sum(F.abs(F.sub(y:view(2), want))):item())
    h1.remove(); h2.remove()
    assert.is_false(h1.remove())
  end)
end)
