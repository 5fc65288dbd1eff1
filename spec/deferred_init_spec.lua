-- Deferred initialisation (nn.deferred_init, nn.materialize, fully_shard of
-- a deferred model): no memory until materialized, then bitwise the values
-- of the eager build, the generator left where the eager build leaves it;
-- FSDP writes the shards from the records; clear errors otherwise.
local ms = require 'moonshard'
local nn = ms.nn
local T = require 'moonshard.tensor'
local FS = require 'spec.fsdp_support'

local families = {
  { 'gpt2', require 'models.gpt2', { n_layer = 2, n_embd = 64, n_head = 4, vocab_size = 256, n_positions = 64,
    resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0 }, 'GPT2Block' },
  { 'llama', require 'models.llama', { num_hidden_layers = 2, hidden_size = 64, num_attention_heads = 4,
    num_key_value_heads = 2, intermediate_size = 128, vocab_size = 256, max_position_embeddings = 64 }, 'LlamaDecoderLayer' },
}

local S_ = require 'spec.support'
local function settle() S_.settled(function() return ms.live_bytes(-1) end) end
local function params_of(m)
  local r = {}
  for n, p in m:named_parameters() do r[n] = p end
  return r
end
local function bitwise_equal(a, b)
  return ms.no_grad(function() return a.dtype == b.dtype and (a:to('f64') - b:to('f64')):abs():max():item() == 0 end)
end

describe('deferred initialisation', function()
  after_each(function() T.defer.on = false end)

  for _, fam in ipairs(families) do
    local name, M, cfg = fam[1], fam[2], fam[3]
    it(name .. ': no memory, the generator where the eager build leaves it, then bitwise the eager values', function()
      ms.manual_seed(7)
      local eager = M.new(cfg)
      local after_eager = T.rng_state()
      local bytes = 0
      for _, p in ipairs(eager:parameters()) do bytes = bytes + p:numel() * 4 end
      settle()
      local b0 = ms.live_bytes(-1)
      ms.manual_seed(7)
      local m = nn.deferred_init(M.new, cfg)
      settle()
      assert.are.equal(0, ms.live_bytes(-1) - b0)
      assert.are.same(after_eager, T.rng_state())
      assert.is_true(nn.is_deferred(m))
      for _, p in ipairs(m:parameters()) do assert.is_true(nn.is_deferred(p)) end
      assert.is_true(bytes > 100000)
      nn.materialize(m)
      assert.is_false(nn.is_deferred(m))
      local pe = params_of(eager)
      for n, p in m:named_parameters() do assert.is_true(bitwise_equal(p, pe[n]), n) end
      settle()
      assert.are.equal(bytes, ms.live_bytes(-1) - b0)
      -- and it trains like the eager model
      local x, y = FS.lcg_batch(3, 2, 16)
      ms.no_grad(function() assert.are.equal(eager(x, y):item(), m(x, y):item()) end)
    end)

    it(name .. ': moved with to() while deferred, the values of the eager build moved the same way', function()
      ms.manual_seed(8)
      local eager = M.new(cfg):to('f64')
      ms.manual_seed(8)
      local m = nn.deferred_init(M.new, cfg):to('f64')
      assert.is_true(nn.is_deferred(m))
      for _, p in ipairs(m:parameters()) do assert.are.equal('f64', p.dtype) end
      nn.materialize(m)
      local pe = params_of(eager)
      for n, p in m:named_parameters() do assert.is_true(bitwise_equal(p, pe[n]), n) end
    end)

    it(name .. ': fully_shard of a deferred model (f32, bf16 parameters) equals fully_shard of the eager one', function()
      for _, mp in ipairs({ false, { param = 'bf16', reduce = 'f32' } }) do
        local function build(deferred)
          ms.manual_seed(9)
          local m = deferred and nn.deferred_init(M.new, cfg) or M.new(cfg)
          ms.fsdp.fully_shard(m, { policy = ms.fsdp.policy.by_class { fam[4] }, mixed_precision = mp or nil })
          return m
        end
        local a, b = build(false), build(true)
        local ua, ub = ms.fsdp.units(a), ms.fsdp.units(b)
        assert.are.equal(#ua, #ub)
        for i = 1, #ua do assert.is_true(bitwise_equal(ub[i].fp.shard, ua[i].fp.shard), ua[i].label) end
        local oa = ms.fsdp.optimizer(a, ms.optim.AdamW, { lr = 1e-2 })
        local ob = ms.fsdp.optimizer(b, ms.optim.AdamW, { lr = 1e-2 })
        local x, y = FS.lcg_batch(4, 2, 16)
        for _ = 1, 2 do
          local la = a(x, y)
          la:backward()                        -- (one tape: each backward before the next forward)
          local lb = b(x, y)
          lb:backward()
          assert.are.equal(la:item(), lb:item())
          oa:step(); ob:step(); oa:zero_grad(); ob:zero_grad()
        end
      end
    end)
  end

  it('ops on a deferred tensor, views, copies from real tensors: errors that say what to do', function()
    local lin = nn.deferred_init(function() return nn.Linear(8, 4) end)
    local w = lin.weight
    local cases = {
      { function() return w + 1 end, 'has no data yet: it was made under nn.deferred_init' },
      { function() return lin(ms.randn({ 2, 8 })) end, 'has no data yet' },
      { function() return w:sum() end, 'has no data yet' },
      { function() return w:data_ptr() end, 'has no data yet' },
      { function() ms.save_safetensors(os.tmpname(), { w = w }) end, 'tensor "w": save: the tensor (128 bytes) has no data yet' },
      { function() ms.normal_(w:narrow(1, 1, 2), 0, 1) end, 'narrow: the tensor (128 bytes) has no data yet' },
      { function() w:copy_(ms.randn({ 4, 8 })) end, 'takes only a number or another such tensor' },
      { function() nn.deferred_init(3) end, 'expected a function' },
      { function() nn.materialize({}) end, 'expected a module' },
    }
    for i, c in ipairs(cases) do
      local ok, err = pcall(c[1])
      assert.is_false(ok, 'case ' .. i)
      assert.is_truthy(tostring(err):find(c[2], 1, true), 'case ' .. i .. ': ' .. tostring(err))
    end
    -- an error inside fn leaves deferral off
    assert.is_false(pcall(nn.deferred_init, function() error('boom') end))
    assert.is_false(T.defer.on)
    local t = ms.zeros({ 3 })
    assert.is_false(nn.is_deferred(t))
    assert.are.equal(0, t:sum():item())
  end)

  it('T.deferred_fn: values made on demand by a function, whole (materialize) or a range at a time (replay, as a '
    .. 'shard asks), converted to the destination\'s dtype', function()
    local asked = {}
    -- element i (0-based) is i * 0.5 - 3, made in f64
    local t = T.deferred_fn({ 6, 7 }, 'f64', function(first, n)
      asked[#asked + 1] = { first, n }
      local vals = {}
      for i = first, first + n - 1 do vals[#vals + 1] = i * 0.5 - 3 end
      return ms.tensor(vals, { dtype = 'f64' })
    end)
    assert.is_true(nn.is_deferred(t))
    assert.are.same({ 6, 7 }, t.shape)
    assert.are.equal(0, #asked)
    local part = T.replay(t, ms.empty({ 9 }, { dtype = 'f32' }), 11)   -- elements 11 .. 19, mid-row to mid-row
    assert.are.same({ { 11, 9 } }, asked)
    local pv = S_.values(part)
    for i = 1, 9 do assert.are.equal((10 + i) * 0.5 - 3, pv[i]) end
    assert.is_true(T.materialize(t))
    assert.are.same({ 0, 42 }, asked[2])
    local v = S_.values(t)
    for i = 1, 42 do assert.are.equal((i - 1) * 0.5 - 3, v[i]) end
  end)

  it('what the initialisers record: fills, copies, zero_, nested calls; arange and tensor() keep their data', function()
    local got = nn.deferred_init(function()
      local a = ms.ones({ 5 })
      local b = ms.empty({ 5 })
      b:fill_(2.5)
      local c = ms.randn({ 5 })
      local d = ms.empty({ 5 })
      d:copy_(c)                            -- the same record: the same values
      local e = ms.full({ 5 }, 3)
      e:zero_()
      local r = ms.arange(4)                -- computed, not deferred
      local lit = ms.tensor({ 1, 2 })
      local inner = nn.deferred_init(function() return ms.rand({ 2 }) end)
      return { a, b, c, d, e, r, lit, inner }
    end)
    for i = 1, 5 do assert.is_true(nn.is_deferred(got[i]), i) end
    assert.is_false(nn.is_deferred(got[6])); assert.are.equal(6, got[6]:sum():item())
    assert.is_false(nn.is_deferred(got[7])); assert.are.equal(3, got[7]:sum():item())
    assert.is_true(nn.is_deferred(got[8]))
    for _, t in ipairs(got) do T.materialize(t) end
    assert.are.equal(5, got[1]:sum():item())
    assert.are.equal(12.5, got[2]:sum():item())
    assert.is_true(bitwise_equal(got[3], got[4]))
    assert.are.equal(0, got[5]:sum():item())
  end)

  for _, fam in ipairs({ { 'gpt2-tiny', 'models.gpt2', 'GPT2Block' }, { 'llama-tiny', 'models.llama', 'LlamaDecoderLayer' } }) do
    it(fam[1] .. ': from_pretrained{deferred = true}: nothing read until materialized or sharded, then the file\'s values', function()
      local M = require(fam[2])
      local dir = FS.fixtures .. '/' .. fam[1]
      local eager = M.from_pretrained(dir)
      local pe = params_of(eager)
      settle()
      local b0, r0 = ms.live_bytes(-1), T.defer.file_bytes
      local m = M.from_pretrained(dir, { deferred = true })
      settle()
      assert.are.equal(0, ms.live_bytes(-1) - b0)
      assert.are.equal(r0, T.defer.file_bytes)
      assert.is_true(nn.is_deferred(m))
      nn.materialize(m)
      for n, p in m:named_parameters() do assert.is_true(bitwise_equal(p, pe[n]), n) end
      -- in another dtype: the file's values converted once, as the eager load then to()
      local e16 = M.from_pretrained(dir, { dtype = 'bf16' })
      local m16 = nn.materialize(M.from_pretrained(dir, { deferred = true, dtype = 'bf16' }))
      local p16 = params_of(e16)
      for n, p in m16:named_parameters() do assert.is_true(bitwise_equal(p, p16[n]), n) end
      -- sharded in one process: the shards of the eager model's fully_shard
      local a = ms.fsdp.fully_shard(M.from_pretrained(dir), { policy = ms.fsdp.policy.by_class { fam[3] } })
      local b = ms.fsdp.fully_shard(M.from_pretrained(dir, { deferred = true }), { policy = ms.fsdp.policy.by_class { fam[3] } })
      local ua, ub = ms.fsdp.units(a), ms.fsdp.units(b)
      for k = 1, #ua do assert.is_true(bitwise_equal(ub[k].fp.shard, ua[k].fp.shard), ua[k].label) end
    end)
  end
end)
