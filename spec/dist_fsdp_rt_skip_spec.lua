-- ms.fsdp.set_skip_comm (#mpi; tools/run_mpi_specs.sh runs it with 1-4
-- ranks): while on, the runtime issues no collective (the trace shows none:
-- no all_gather, reduce_scatter or all_reduce event, clip_grad_norm's
-- all-reduce included) but steps run (forward, backward, clipping, an
-- optimizer step) and every unit goes through its buffers as usual; after
-- turning it off, the next steps equal those of a model that never skipped
-- (the unsharded buffers are gathered again from the master shards). With
-- more than one rank the skipped run's gradients really differ (the test
-- can fail: the collectives were skipped, not merely untraced).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil
local fixtures = T.root .. '/../shared/fixtures'
local have_fixture = io.open(fixtures .. '/gpt2-tiny/model.safetensors', 'rb')
if have_fixture then have_fixture:close() end

local OPTS = { lr = 1e-3, eps = 1e-6, weight_decay = 0.1 }
local ROWS, SEQ = 2, 16

local function load_model()
  return require('models.gpt2').from_pretrained(fixtures .. '/gpt2-tiny', { dtype = 'f32' })
end

-- rank r's rows of step s (vocab 256)
local function batch(r, s)
  local seed = 4242 + 7919 * r + 104729 * s
  return FS.lcg_batch(seed, ROWS, SEQ)
end

local function collectives(tr)
  local n = 0
  for _, ev in ipairs(tr) do
    if ev:match('^all_gather') or ev:match('^reduce_scatter') or ev:match('^all_reduce') then n = n + 1 end
  end
  return n
end

describe('fsdp.set_skip_comm #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  if not have_fixture then
    it('needs the fixtures', function() pending('no ' .. fixtures) end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))
  local strategies = { 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD' }
  if W % 2 == 0 then strategies[#strategies + 1] = 'HYBRID_SHARD' end

  local function build(strategy, mp)
    local model = load_model()
    local o = { policy = fsdp.policy.by_class { 'GPT2Block' }, strategy = strategy, mixed_precision = mp }
    if strategy == 'HYBRID_SHARD' then o.shard_size = W / 2 end
    fsdp.fully_shard(model, o)
    return model, fsdp.AdamW(model, OPTS)
  end

  -- n real steps: the losses (mean over ranks), then the parameters
  local function train(model, opt, from, n)
    local losses = {}
    for s = from, from + n - 1 do
      local x, y = batch(R, s)
      local loss = model(x, y)
      local l = loss:detach():reshape({ 1 }):clone()
      dist.all_reduce(l, 'avg')
      losses[#losses + 1] = l:item()
      loss:backward()
      fsdp.clip_grad_norm(model, 1.0)
      opt:step()
      opt:zero_grad()
    end
    return losses
  end

  local function params(model)
    fsdp.unshard(model)
    local r = {}
    for name, p in model:named_parameters() do r[#r + 1] = { name, p:clone() } end
    fsdp.reshard(model)
    return r
  end

  for _, strategy in ipairs(strategies) do
    it(('%s: no collective while on, steps run, then the same steps as a model that never skipped'):format(strategy),
      function()
        local ref, ropt = build(strategy)
        local rl = train(ref, ropt, 1, 2)
        local model, opt = build(strategy)
        assert.is_false(fsdp.set_skip_comm(model, true))
        -- skipped steps: forward, backward, clipping (no optimizer step, so
        -- the master shards stay those of the reference)
        local skipped_grads
        for s = 1, 2 do
          local x, y = batch(R, s)
          local loss = model(x, y)
          loss:backward()
          local norm = fsdp.clip_grad_norm(model, 1.0)
          assert.are.equal('f64', norm.dtype)
          local tr = fsdp.trace(model)
          assert.is_true(#tr > 0)
          assert.are.equal(0, collectives(tr), table.concat(tr, ', '))
          for _, u in ipairs(fsdp.units(model)) do
            assert.are.equal(u.fp.shard_numel, u.fp.shard.grad:numel())
            if strategy ~= 'NO_SHARD' then assert.are.equal('sharded', u.status) end
          end
          -- while skipping, an unsharded buffer holds this rank's own shard in
          -- every member's slot (values of the real kind, no NaN)
          local u = fsdp.units(model)[1]
          if strategy ~= 'NO_SHARD' and u.fp.world_size > 1 then
            u:unshard()
            local n, src = u.fp.shard_numel, u:gather_source()
            for r = 0, u.fp.world_size - 1 do
              local d = (u.flat:narrow(1, r * n + 1, n):to('f64') - src:to('f64')):abs():max():item()
              assert.are.equal(0, d, ('slot %d of unit %s'):format(r, u.label))
            end
            u:reshard()
          end
          skipped_grads = {}
          for i, u in ipairs(fsdp.units(model)) do skipped_grads[i] = u.fp.shard.grad:clone() end
          opt:zero_grad()
        end
        assert.is_true(fsdp.set_skip_comm(model, false))
        -- the collectives are back in the trace, and the steps match
        local l = train(model, opt, 1, 2)
        assert.is_true(collectives(fsdp.trace(model)) > 0 or W == 1)
        for s = 1, 2 do
          assert.is_true(l[s] == rl[s], ('step %d: loss %.9g, never skipped %.9g'):format(s, l[s], rl[s]))
        end
        local a, b = params(model), params(ref)
        for i = 1, #a do
          assert.are.equal(b[i][1], a[i][1])
          local d = (a[i][2] - b[i][2]):abs():max():item()
          assert.are.equal(0, d, a[i][1])
        end
        -- with several ranks the skipped gradients were not the reduced ones
        if W > 1 and strategy ~= 'NO_SHARD' then
          local x, y = batch(R, 2)
          local loss = model(x, y)
          loss:backward()
          local differ = false
          for i, u in ipairs(fsdp.units(model)) do
            local d = (u.fp.shard.grad - skipped_grads[i]):abs():max():item()
            if d ~= d or d > 0 then differ = true end     -- NaN: from a buffer never gathered
          end
          opt:zero_grad()
          assert.is_true(differ)
        end
      end)
  end

  it('an optimizer step runs while skipping, and bf16 mixed precision', function()
    local model, opt = build('FULL_SHARD', { param = 'bf16', reduce = 'bf16' })
    fsdp.set_skip_comm(model, true)
    for s = 1, 2 do
      local x, y = batch(R, s)
      model(x, y):backward()
      fsdp.clip_grad_norm(model, 1.0)
      opt:step()
      opt:zero_grad()
      assert.are.equal(0, collectives(fsdp.trace(model)))
    end
    fsdp.set_skip_comm(model, false)
    local x, y = batch(R, 3)
    model(x, y):backward()
    if W > 1 then assert.is_true(collectives(fsdp.trace(model)) > 0) end
    opt:zero_grad()
  end)

  it('is refused inside a backward and for a model that is not sharded', function()
    assert.has_error(function() fsdp.set_skip_comm(load_model(), true) end)
    local model = build('FULL_SHARD')
    local x, y = batch(R, 1)
    local loss = model(x, y)
    local ok, err
    -- a backward hook of the root runs inside the backward
    model:register_backward_hook(function()
      ok, err = pcall(fsdp.set_skip_comm, model, true)
    end)
    loss:backward()
    assert.is_false(ok)
    assert.matches('not inside a backward', err)
    assert.is_false(fsdp.set_skip_comm(model, false))
  end)
end)
