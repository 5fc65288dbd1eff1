-- Memory: a training step leaves nothing behind. After backward the tape is
-- empty and the saved tensors are released; over 50 steps of a small
-- transformer with AdamW the number of live storages does not grow.
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local optim = require 'moonshard.optim'
local A = ms.autograd
local unpack = unpack or table.unpack

local Block = nn.Module:extend('MemBlock')
function Block:init(d, llama)
  if llama then
    self:register_module('ln_1', nn.RMSNorm(d))
    self:register_module('attn', nn.CausalSelfAttention { dim = d, n_head = 4, n_kv_head = 2, rope_theta = 10000 })
    self:register_module('ln_2', nn.RMSNorm(d))
    self:register_module('mlp', nn.GatedMLP { dim = d, hidden = 2 * d })
  else
    self:register_module('ln_1', nn.LayerNorm(d))
    self:register_module('attn', nn.CausalSelfAttention { dim = d, n_head = 2, fused_qkv = true })
    self:register_module('ln_2', nn.LayerNorm(d))
    self:register_module('mlp', nn.MLP { dim = d })
  end
  self:register_module('drop', nn.Dropout(0.1))
end
function Block:forward(x)
  x = x + self.drop(self.attn(self.ln_1(x)))
  return x + self.mlp(self.ln_2(x))
end

local LM = nn.Module:extend('MemLM')
function LM:init(vocab, d, n, llama, ckpt)
  self.ckpt = ckpt
  self:register_module('wte', nn.Embedding(vocab, d, { std = 0.02 }))
  local bs = {}
  for i = 1, n do bs[i] = Block(d, llama) end
  self:register_module('h', nn.ModuleList(bs))
  self:register_module('ln_f', nn.LayerNorm(d))
end
function LM:forward(ids, targets)
  local x = self.wte(ids)
  for _, b in ipairs(self.h) do
    if self.ckpt then x = ms.checkpoint(b, x) else x = b(x) end
  end
  return nn.functional.lm_loss(self.ln_f(x), self.wte.weight, targets)
end

local function train(llama, ckpt)
  -- what earlier specs left behind (compiled traces may hold old objects)
  jit.flush()
  for _ = 1, 4 do collectgarbage() end
  ms.manual_seed(0)
  local vocab = 32
  local m = LM(vocab, 16, 2, llama, ckpt)
  local opt = optim.AdamW(m, { lr = 1e-2 })
  local ids = ms.randn({ 2, 9 })   -- reused buffer for the batch
  local counts, losses, tapes = {}, {}, {}
  for step = 1, 50 do
    local raw = ms.rand({ 2, 9 }, { seed = 1 })   -- one batch, fresh tensors each step
    local b = ms.raw.mul(raw, vocab):to('i64')
    local x, y = b:narrow(2, 1, 8), b:narrow(2, 2, 8):contiguous()
    local loss = m(x:contiguous(), y)
    losses[step] = loss:item()
    loss:backward()
    tapes[step] = A.tape_size()
    optim.clip_grad_norm(m, 1.0)
    opt:step()
    opt:zero_grad()
    loss, raw, b, x, y = nil, nil, nil, nil, nil
    collectgarbage()
    collectgarbage()
    counts[step] = ms.live_storages()
  end
  ids:free()
  return counts, losses, tapes
end

describe('memory', function()
  for _, cfg in ipairs({ { 'GPT-2-like', false, false }, { 'Llama-like', true, false },
    { 'GPT-2-like with checkpointing', false, true } }) do
    it(('50 AdamW steps of a %s model: no storage growth, empty tape'):format(cfg[1]), function()
      local counts, losses, tapes = train(cfg[2], cfg[3])
      for step = 1, 50 do assert.are.equal(0, tapes[step], 'tape not empty at step ' .. step) end
      for step = 3, 50 do
        assert.are.equal(counts[2], counts[step], ('live storages: %d after step 2, %d after step %d')
          :format(counts[2], counts[step], step))
      end
      assert.is_true(losses[50] < losses[1], 'the loss did not fall')
    end)
  end

  it('with release_activations, 20 steps need no garbage collection at all', function()
    jit.flush()
    for _ = 1, 4 do collectgarbage() end
    ms.manual_seed(0)
    local m = LM(32, 16, 2, true, false)
    local opt = optim.AdamW(m, { lr = 1e-2 })
    local ids = {}
    for i = 1, 9 do ids[i] = (i * 7) % 32 end
    local x = ms.tensor({ { unpack(ids, 1, 8) } }, { dtype = 'i64' })
    local y = ms.tensor({ { unpack(ids, 2, 9) } }, { dtype = 'i64' })
    A.release_activations = true
    collectgarbage('stop')
    local ok, err = pcall(function()
      local counts = {}
      for step = 1, 20 do
        local loss = m(x, y)
        loss:backward()
        loss:free()
        opt:step()
        opt:zero_grad()
        counts[step] = ms.live_storages()
      end
      for step = 3, 20 do
        assert.are.equal(counts[2], counts[step], ('live storages without GC: %d after step 2, %d after step %d')
          :format(counts[2], counts[step], step))
      end
    end)
    collectgarbage('restart')
    A.release_activations = false
    if not ok then error(err, 0) end
  end)

  it('backward releases saved tensors at once, without the garbage collector', function()
    collectgarbage()
    collectgarbage('stop')
    local ok, err = pcall(function()
      local nnf = nn.functional
      local x = ms.randn({ 64, 64 }):requires_grad_()
      local w = ms.randn({ 64, 64 }):requires_grad_()
      local base = ms.live_storages()
      -- fused nodes own their saved tensors (xhat, rstd, softmax outputs, masks)
      local y = nnf.layer_norm(x, w:select(1, 1), nil, 1e-5)
      local z = nnf.cross_entropy(y, ms.zeros({ 64 }, { dtype = 'i64' }))
      local during = ms.live_storages()
      z:backward()
      local after = ms.live_storages()
      assert.is_true(during > base)
      -- left: x.grad, w.grad, and the handles still referenced here (y, z, targets, views)
      assert.is_true(after <= base + 5, ('%d storages before, %d during, %d after'):format(base, during, after))
    end)
    collectgarbage('restart')
    if not ok then error(err, 0) end
  end)
end)
