-- Saved-tensor versions: an in-place write to a tensor that a recorded node
-- saved makes backward raise (naming the op and the tensor) instead of
-- computing a wrong gradient; writes that leave saved tensors alone, and the
-- engine's own buffer writes (FSDP's gathers), do not.
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local A = ms.autograd
local F = ms.raw

local function leaf(shape, s)
  return ms.randn(shape, { dtype = 'f64', seed = s or 1 }):requires_grad_()
end
local function data(shape, s) return ms.randn(shape, { dtype = 'f64', seed = s or 2 }) end
local function max_abs_diff(a, b) return F.max(F.abs(F.sub(a, b))):item() end

-- backward of y must fail with a message naming `op`; the leaves get no grad
local function must_fail(y, op, leaves)
  local ok, err = pcall(function() y:backward() end)
  assert.is_false(ok)
  err = tostring(err)
  assert.is_truthy(err:find('backward of ' .. op, 1, true), err)
  assert.is_truthy(err:find('modified by an in-place operation', 1, true), err)
  for _, l in ipairs(leaves or {}) do assert.is_nil(l.grad) end
  assert.are.equal(0, A.tape_size())
  return err
end

describe('saved-tensor versions', function()
  after_each(function() A.clear_tape() end)

  it('every in-place write of the Lua face bumps the version, views share it, raw ops do not', function()
    local t = data({ 4, 3 })
    assert.are.equal(0, t._version)
    local writes = {
      function() t:add_(1) end, function() t:sub_(1) end, function() t:mul_(2) end,
      function() t:div_(2) end, function() t:copy_(data({ 4, 3 }, 5)) end, function() t:fill_(0.5) end,
      function() t:zero_() end, function() t:set(1, 1, 3) end, function() ms.normal_(t, 0, 1) end,
      function() ms.uniform_(t, -1, 1) end, function() t:normal_(0, 1) end,
      function() ms.add_(t, 1) end, function() t:index_add_(1, ms.tensor({ 1, 2 }, { dtype = 'i64' }), data({ 2, 3 })) end,
    }
    for i, w in ipairs(writes) do
      w()
      assert.are.equal(i, t._version)
    end
    local v = t:narrow(1, 2, 2)
    assert.are.equal(#writes, v._version)
    v:mul_(3)
    assert.are.equal(#writes + 1, t._version)
    -- the raw layer and out-of-place ops leave it alone
    F.add_(t, 1); F.fill_(t, 0); local u = t + 1
    assert.are.equal(#writes + 1, t._version)
    assert.are.equal(0, u._version)
    -- a fresh tensor from clone starts at 0
    assert.are.equal(0, t:clone()._version)
  end)

  it('an input saved by matmul, changed in place: backward raises and no gradient lands', function()
    local w = leaf({ 3, 2 })
    local x = data({ 4, 3 })
    local y = ms.matmul(x, w):tanh():sum()
    x:mul_(2)
    local err = must_fail(y, 'matmul', { w })
    assert.is_truthy(err:find('shape (4, 3), f64 on cpu', 1, true), err)
    assert.is_truthy(err:find('version 1, saved at version 0', 1, true), err)
  end)

  it('a saved output changed in place under no_grad (exp saves its result)', function()
    local a = leaf({ 5 })
    local e = a:exp()
    local s = e:sum()
    ms.no_grad(function() e:add_(1) end)
    must_fail(s, 'exp', { a })
  end)

  it('a write through a view of the saved tensor is caught', function()
    local w = leaf({ 3, 3 })
    local x = data({ 3, 3 })
    local y = ms.matmul(x, w):sum()
    local row = x:select(1, 2)
    row:fill_(0)
    must_fail(y, 'matmul', { w })
  end)

  it('an optimizer step between forward and backward: a parameter the backward needs', function()
    -- y = w * w: the backward of mul needs w itself
    local w = leaf({ 4 })
    w.grad = data({ 4 }, 7)
    local opt = ms.optim.SGD({ w }, { lr = 0.1 })
    local y = (w * w):sum()
    opt:step()
    must_fail(y, 'mul')
    local w2 = leaf({ 4 }, 3)
    w2.grad = data({ 4 }, 8)
    local adam = ms.optim.AdamW({ w2 }, { lr = 0.1 })
    local y2 = (w2 * w2):sum()
    adam:step()
    must_fail(y2, 'mul')
  end)

  it('a parameter that no backward reads may change: no error, the same gradient', function()
    -- z = x @ w: grad_w = x^T g needs x only, so changing w is harmless
    local w = leaf({ 3, 2 })
    local x = data({ 4, 3 })
    local z = ms.matmul(x, w):sum()
    ms.no_grad(function() w:mul_(2) end)
    z:backward()
    local ref = ms.matmul(x:t(), ms.ones({ 4, 2 }, { dtype = "f64" }))
    assert.is_true(max_abs_diff(w.grad, ref) < 1e-12)
  end)

  it('writes made before the forward, or after backward, are fine', function()
    local w = leaf({ 3, 2 })
    local x = data({ 4, 3 })
    x:mul_(2)
    local y = ms.matmul(x, w):sum()
    y:backward()
    x:mul_(2)            -- the graph is consumed: nothing to check
    local y2 = ms.matmul(x, w):sum()
    y2:backward()
    assert.is_not_nil(w.grad)
  end)

  it('a Function\'s saved_tensors and a checkpoint\'s arguments are checked', function()
    local Cube = A.Function {
      name = 'Cube',
      forward = function(ctx, x) ctx:save_for_backward(x); return x:pow(3) end,
      backward = function(ctx, g) return g * ctx.saved_tensors[1]:square() * 3 end,
    }
    local a = leaf({ 4 })
    local b = a * 1          -- a non-leaf that the Function saves
    local y = Cube(b):sum()
    ms.no_grad(function() b:mul_(2) end)
    must_fail(y, 'Cube', { a })

    local w = leaf({ 3, 3 }, 4)
    local x = data({ 2, 3 })
    local out = ms.checkpoint(function(t) return ms.matmul(t, w):tanh() end, x)
    local s = out:sum()
    x:add_(1)
    must_fail(s, 'checkpoint', { w })
  end)

  it('a write made by a hook during backward is caught at the node that needs the tensor', function()
    local w = leaf({ 3 })
    local x = data({ 3 })
    local h = w * x          -- mul saves x (for w's gradient)
    local h2 = h:exp()       -- exp saves its output
    local s = h2:sum()
    h2:register_hook(function(g) ms.no_grad(function() x:add_(1) end) end)
    local ok, err = pcall(function() s:backward() end)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('backward of mul', 1, true), tostring(err))
    assert.are.equal(0, A.tape_size())
  end)

  it('a module trained normally, with micro-batches and an optimizer, never trips it', function()
    local m = nn.Linear(6, 4, { dtype = 'f64' })
    local opt = ms.optim.AdamW(m, { lr = 1e-2 })
    for _ = 1, 3 do
      for k = 1, 2 do
        local x = data({ 5, 6 }, 10 + k)
        m(x):tanh():sum():backward()
      end
      opt:step()
      opt:zero_grad()
    end
    assert.is_true(m.weight._version >= 3)
  end)

  it('FSDP at one rank, bf16 parameters: its gathers and gradient buffers leave the versions alone', function()
    local T = require 'moonshard.tensor'
    local FS = require 'spec.fsdp_support'
    local dir = T.root .. '/../shared/fixtures/gpt2-tiny'
    local model = require('models.gpt2').from_pretrained(dir, { dtype = 'f32' })
    -- bf16 parameters: at one rank the unshard copies the bf16 shard into
    -- the unsharded buffer, before the forward and again before each unit's
    -- backward (reshard after forward), while the tape holds views of it
    ms.fsdp.fully_shard(model, { policy = ms.fsdp.policy.by_class { 'GPT2Block' },
      mixed_precision = { param = 'bf16', reduce = 'f32' } })
    local opt = ms.fsdp.optimizer(model, ms.optim.AdamW, { lr = 1e-3 })
    local x, y = FS.lcg_batch(5, 2, 16)
    local first, last
    for step = 1, 3 do
      local loss = model(x, y)
      loss:backward()          -- a gather into the unsharded buffers runs before each unit's backward
      if step == 1 then first = loss:item() end
      last = loss:item()
      opt:step()
      opt:zero_grad()
    end
    assert.is_true(last < first)
    assert.are.equal(0, A.tape_size())
  end)
end)
