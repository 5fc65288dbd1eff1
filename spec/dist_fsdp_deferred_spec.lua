-- fully_shard of a model built under nn.deferred_init on several ranks
-- (#mpi, 1-4 ranks): every rank's shards are bitwise those of the eagerly
-- built model, no rank ever allocates the whole model's parameters, and
-- the two train alike (FULL_SHARD, HYBRID-free: the world group).
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local fsdp = ms.fsdp

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('fsdp of a deferred model #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)
  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))

  local cases = {
    { 'models.gpt2', { n_layer = 3, n_embd = 64, n_head = 4, vocab_size = 256, n_positions = 64,
      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0 }, 'GPT2Block' },
    { 'models.llama', { num_hidden_layers = 3, hidden_size = 64, num_attention_heads = 4, num_key_value_heads = 2,
      intermediate_size = 128, vocab_size = 256, max_position_embeddings = 64 }, 'LlamaDecoderLayer' },
  }
  for _, c in ipairs(cases) do
    it(c[1] .. ': the shards of the eager build, bitwise; the same losses over three steps', function()
      local M = require(c[1])
      -- the bytes the build allocates (the allocator's running total: the
      -- garbage of earlier specs, freed whenever the collector gets to it,
      -- does not count, as it would in a difference of live bytes)
      local C = require('moonshard.tensor').C
      local function allocated() return tonumber(C.ms_bytes_allocated_total()) end
      local function build(deferred)
        ms.manual_seed(21)
        local a0 = allocated()
        local m = deferred and ms.nn.deferred_init(M.new, c[2]) or M.new(c[2])
        local made = allocated() - a0
        local whole = 0
        for _, p in ipairs(m:parameters()) do whole = whole + p:numel() * 4 end
        fsdp.fully_shard(m, { policy = fsdp.policy.by_class { c[3] } })
        return m, made, whole
      end
      local a, made_a, whole = build(false)
      local b, made_b = build(true)
      assert.is_true(made_a >= whole, ('the eager build allocated %d bytes, its parameters hold %d'):format(made_a, whole))
      assert.are.equal(0, made_b)
      local ua, ub = fsdp.units(a), fsdp.units(b)
      for i = 1, #ua do
        local d = ms.no_grad(function() return (ua[i].fp.shard - ub[i].fp.shard):abs():max():item() end)
        assert.are.equal(0, d, ua[i].label)
        assert.are.equal(ua[i].fp.shard_numel, ub[i].fp.shard_numel)
      end
      local oa = fsdp.optimizer(a, ms.optim.AdamW, { lr = 1e-2 })
      local ob = fsdp.optimizer(b, ms.optim.AdamW, { lr = 1e-2 })
      for k = 1, 3 do
        local x, y = FS.lcg_batch(50 * k + R, 2, 16)
        local la = a(x, y); la:backward()
        local lb = b(x, y); lb:backward()
        assert.are.equal(la:item(), lb:item(), ('rank %d of %d, step %d'):format(R, W, k))
        oa:step(); ob:step(); oa:zero_grad(); ob:zero_grad()
      end
    end)
  end

  for _, c in ipairs({ { 'gpt2-tiny', 'models.gpt2', 'GPT2Block' }, { 'llama-tiny', 'models.llama', 'LlamaDecoderLayer' } }) do
    it(c[1] .. ' from_pretrained{deferred = true}: each rank reads only its shards\' bytes, the eager shards bitwise', function()
      if not FS.have_fixture(c[1]) then pending('no fixture ' .. c[1]); return end
      local T = require 'moonshard.tensor'
      local M = require(c[2])
      local dir = FS.fixtures .. '/' .. c[1]
      local a = fsdp.fully_shard(M.from_pretrained(dir), { policy = fsdp.policy.by_class { c[3] } })
      local whole = 0
      for _, u in ipairs(fsdp.units(a)) do
        for k = 1, u.fp.nparams do whole = whole + u.fp.numels[k] * 4 end   -- (the fixtures are f32)
      end
      local r0 = T.defer.file_bytes
      local b = fsdp.fully_shard(M.from_pretrained(dir, { deferred = true }), { policy = fsdp.policy.by_class { c[3] } })
      local read = T.defer.file_bytes - r0
      local ua, ub = fsdp.units(a), fsdp.units(b)
      for k = 1, #ua do
        local d = ms.no_grad(function() return (ua[k].fp.shard - ub[k].fp.shard):abs():max():item() end)
        assert.are.equal(0, d, ua[k].label)
      end
      -- the ranks together read each parameter's bytes once
      local t = ms.tensor({ read }, { dtype = 'f64' })
      dist.all_reduce(t, 'sum')
      assert.are.equal(whole, t:item())
      assert.is_true(read <= whole / W + 4096 * #ua, ('rank %d read %d of %d bytes'):format(R, read, whole))
    end)
  end
end)
