-- fsdp.fully_shard over MPI (#mpi; tools/run_mpi_specs.sh runs it with 1, 2,
-- 3 and 4 ranks). Every rank loads gpt2-tiny from the shared fixtures and
-- takes the same full batch, so the sharded run (units by the GPT-2 Block
-- class, the root taking the embeddings, the tied head and ln_f) must match
-- the same AdamW steps of an unsharded copy of the model, computed on every
-- rank alone: the loss each step, and every parameter after the steps
-- (gathered). 3 ranks give uneven shards.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil
local dir = T.root .. '/../shared/fixtures/gpt2-tiny'
local have_fixture = io.open(dir .. '/model.safetensors', 'rb')
if have_fixture then have_fixture:close() end

local STEPS = 4
-- eps 1e-6, not 1e-8: the gradient of the attention key bias is rounding
-- noise (softmax ignores a bias added to every key), and with eps near its
-- size Adam turns the last bit of an average over ranks into a whole step
-- of lr. weight_decay 0 here; the decay split is checked by
-- spec/dist_fsdp_rt_equiv_spec.lua (weight decay 0.1).
local OPTS = { lr = 1e-3, eps = 1e-6, weight_decay = 0 }

local function load_model()
  local gpt2 = require 'models.gpt2'
  return gpt2.from_pretrained(dir, { dtype = 'f32' })
end

local rel = FS.rel

local max_rel = FS.max_rel

describe('fsdp.fully_shard over MPI #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not have_fixture then
    it('needs the gpt2-tiny fixture', function() pending('no ' .. dir) end)
    return
  end

  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local exp
  local ref_losses, ref_params = {}, {}
  local function reference()
    if #ref_losses > 0 then return end
    exp = ms.load_safetensors(dir .. '/expected.safetensors')
    local model = load_model()
    local opt = ms.optim.AdamW(model:parameters(), OPTS)
    for s = 1, STEPS do
      local loss = model(exp.input_ids, exp.targets)
      ref_losses[s] = loss:item()
      loss:backward()
      opt:step()
      opt:zero_grad()
    end
    for name, p in model:named_parameters() do ref_params[#ref_params + 1] = { name, p:clone() } end
  end

  -- a list: every rank runs the same specs in the same order
  for _, strategy in ipairs({ 'FULL_SHARD', 'NO_SHARD' }) do
    it(('%d AdamW steps of gpt2-tiny under %s match one process (loss and every parameter, 1e-5)'):format(
      STEPS, strategy), function()
      reference()
      local gpt2 = require 'models.gpt2'
      local model = load_model()
      local names = {}
      for name, p in model:named_parameters() do names[#names + 1] = { name, p.shape } end
      fsdp.fully_shard(model, { policy = fsdp.policy.by_class { gpt2.Block }, strategy = strategy })
      -- the units: one per block and the root
      assert.are.equal(model.config.n_layer + 1, #fsdp.units(model))
      -- the same names and shapes, as views of the unsharded buffers
      local i = 0
      for name, p in model:named_parameters() do
        i = i + 1
        assert.are.equal(names[i][1], name)
        assert.are.same(names[i][2], p.shape)
      end
      assert.are.equal(#names, i)
      if strategy == 'FULL_SHARD' then
        local W = dist.world_size()
        for _, u in ipairs(fsdp.units(model)) do assert.are.equal(W, u.fp.world_size) end
      end
      local opt = fsdp.AdamW(model, OPTS)
      for s = 1, STEPS do
        local loss = model(exp.input_ids, exp.targets)
        local l = loss:item()
        assert.is_true(rel(l, ref_losses[s]) < 1e-5,
          ('step %d: loss %.9g, one process %.9g'):format(s, l, ref_losses[s]))
        loss:backward()
        -- every unit's backward ended: its gradient is this rank's shard
        -- (the whole flat parameter under NO_SHARD), and FULL_SHARD resharded
        for _, u in ipairs(fsdp.units(model)) do
          assert.are.equal(u.fp.shard_numel, u.fp.shard.grad:numel())
          if strategy == 'FULL_SHARD' then
            assert.is_false(u.unsharded)
            assert.are.equal(u.fp.total, dist.world_size() * u.fp.shard_numel)
          else
            assert.are.equal(u.fp.total, u.fp.shard_numel)
          end
        end
        opt:step()
        opt:zero_grad()
      end
      fsdp.unshard(model)
      local k = 0
      for name, p in model:named_parameters() do
        k = k + 1
        assert.are.equal(ref_params[k][1], name)
        local e = max_rel(p, ref_params[k][2])
        assert.is_true(e < 1e-5, ('%s: relative difference %.3g after %d steps'):format(name, e, STEPS))
      end
      assert.are.equal(#ref_params, k)
    end)
  end
  it('a tensor used by two units goes to the root, once; training still matches one process', function()
    local nn = ms.nn
    local Tied = nn.Module:extend('FsdpSpecTied')
    function Tied:init()
      self:register_module('a', nn.Linear(6, 6))
      self:register_module('b', nn.Linear(6, 6))
      self.b:register_parameter('weight', self.a.weight)   -- tied
    end
    function Tied:forward(x) return self.b(self.a(x)):pow(2):mean() end
    local function build()
      local m = Tied()
      ms.no_grad(function()
        for i, p in ipairs(m:parameters()) do p:copy_(ms.randn(p.shape, { seed = 7 + i })) end
      end)
      return m
    end
    local x = ms.randn({ 5, 6 }, { seed = 3 })
    local ref = build()
    local ropt = ms.optim.AdamW(ref:parameters(), OPTS)
    local ref_losses = {}
    for s = 1, 3 do
      local l = ref(x); ref_losses[s] = l:item(); l:backward(); ropt:step(); ropt:zero_grad()
    end
    local m = build()
    fsdp.fully_shard(m, { policy = fsdp.policy.by_class { 'Linear' } })
    local units = fsdp.units(m)
    assert.are.equal(3, #units)
    assert.are.equal(m, units[1].module)
    assert.are.equal(1, units[1].fp.nparams)        -- the shared weight
    assert.are.equal(1, units[2].fp.nparams)        -- a.bias
    assert.are.equal(1, units[3].fp.nparams)        -- b.bias
    assert.are.equal(rawget(m.a, 'weight'), rawget(m.b, 'weight'))
    local names = {}
    for name in m:named_parameters() do names[#names + 1] = name end
    assert.are.same({ 'a.weight', 'a.bias', 'b.bias' }, names)
    local opt = fsdp.AdamW(m, OPTS)
    for s = 1, 3 do
      local l = m(x)
      assert.is_true(rel(l:item(), ref_losses[s]) < 1e-5, ('step %d: %.9g vs %.9g'):format(s, l:item(), ref_losses[s]))
      l:backward(); opt:step(); opt:zero_grad()
    end
    fsdp.unshard(m)
    local rp = ref:parameters()
    for i, p in ipairs(m:parameters()) do
      local e = max_rel(p, rp[i])
      assert.is_true(e < 1e-5, ('parameter %d: %.3g'):format(i, e))
    end
  end)
end)
