-- The LM head under fully_shard (#mpi; tools/run_mpi_specs.sh runs it with
-- 1-4 ranks): the head weight (the model's head_weight(): GPT-2's tied wte,
-- Llama's lm_head) and the final norm belong to the root unit, which is
-- gathered when the root's forward starts and stays unsharded until its
-- backward ends (the loss, nn.functional.lm_loss — the FLCE — runs at the
-- end of the root's forward, and the root's backward is the first to start
-- and the last to end). So the head weight is all-gathered once per step,
-- never again in the backward. The all-gathers of one step, counted from
-- the trace: FULL_SHARD and HYBRID_SHARD gather the root once and every
-- block twice (forward and backward); SHARD_GRAD_OP every unit once;
-- NO_SHARD every unit once, a local refresh after the optimizer step (its
-- layout is one rank: no collective); offload changes none of these.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil
local fixtures = T.root .. '/../shared/fixtures'
local have_fixture = io.open(fixtures .. '/gpt2-tiny/model.safetensors', 'rb')
if have_fixture then have_fixture:close() end

local FAMILIES = {
  { name = 'gpt2-tiny', module = 'models.gpt2', unit = 'GPT2Block', head = 'transformer.wte.weight',
    norm = 'transformer.ln_f.weight' },
  { name = 'llama-tiny', module = 'models.llama', unit = 'LlamaDecoderLayer', head = 'lm_head.weight',
    norm = 'model.norm.weight' },
}

local function batch(r)
  local seed = 31337 + 7919 * r
  return FS.lcg_batch(seed, 2, 16)
end

describe('fsdp: the LM head is gathered once per step #mpi', function()
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
  local cases = { { 'FULL_SHARD' }, { 'SHARD_GRAD_OP' }, { 'NO_SHARD' }, { 'FULL_SHARD', true } }
  if W % 2 == 0 then cases[#cases + 1] = { 'HYBRID_SHARD' } end

  for _, fam in ipairs(FAMILIES) do
    for _, c in ipairs(cases) do
      local strategy, offload = c[1], c[2]
      it(('%s, %s%s: the all-gathers of a step, the head in the root'):format(fam.name, strategy,
        offload and ' with offload' or ''), function()
        local model = require(fam.module).from_pretrained(fixtures .. '/' .. fam.name, { dtype = 'f32' })
        local o = { policy = fsdp.policy.by_class { fam.unit }, strategy = strategy, offload = offload }
        if strategy == 'HYBRID_SHARD' then o.shard_size = W / 2 end
        fsdp.fully_shard(model, o)
        local units = fsdp.units(model)
        local root = units[1]
        assert.are.equal('root', root.label)
        local names = {}
        for _, n in ipairs(root.param_names) do names[n] = true end
        assert.is_true(names[fam.head], fam.head .. ' is not in the root unit')
        assert.is_true(names[fam.norm], fam.norm .. ' is not in the root unit')
        for k = 2, #units do
          for _, n in ipairs(units[k].param_names) do
            assert.are_not.equal(fam.head, n)
          end
        end
        local opt = fsdp.AdamW(model, { lr = 1e-3 })
        local x, y = batch(R)
        for step = 1, 2 do
          local loss = model(x, y)
          -- between the forward and the backward the root (and the head) stays gathered
          assert.are.equal('unsharded', root.status)
          loss:backward()
          opt:step()
          opt:zero_grad()
          local count = {}
          for _, ev in ipairs(fsdp.trace(model)) do
            local label = ev:match('^all_gather (.*)$')
            if label then count[label] = (count[label] or 0) + 1 end
          end
          for k, u in ipairs(units) do
            local want
            -- (NO_SHARD: the refresh after the optimizer step, a local
            -- one: its layout is one rank)
            if strategy == 'SHARD_GRAD_OP' or strategy == 'NO_SHARD' or k == 1 then want = 1
            else want = 2 end
            assert.are.equal(want, count[u.label], ('step %d: all-gathers of %s'):format(step, u.label))
          end
        end
      end)
    end
  end
end)
