-- Float8 with tensor parallelism on CPU ranks (#mpi, 1-4 ranks): a GPT-2
-- (Conv1D, fused qkv) and a Llama (Linear, GQA) converted by float8.convert
-- before or after tp.parallelize compute every projection in FP8, the
-- row-parallel ones included (each rank's product with the scales of its
-- own shards, then the sum over the group in the activations' dtype): one
-- rank gives the unsplit converted model's losses exactly; more follow them
-- within FP8's rounding (per-shard scales are not the whole tensor's), and
-- train; the same with sequence parallelism; float8.revert keeps the
-- tensor-parallel forwards.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local dist = require 'moonshard.dist'
local gpt2 = require 'models.gpt2'
local llama = require 'models.llama'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('float8 with tensor parallelism #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 300 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local tp, float8 = ms.tp, ms.float8

  -- 12 heads, widths that are multiples of 16 whole (float8.convert's rule,
  -- checked on the shards when it runs after the split)
  local cases = {
    { 'gpt2', gpt2, { vocab_size = 259, n_positions = 32, n_embd = 96, n_layer = 2, n_head = 12,
      resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
    { 'llama', llama, { vocab_size = 257, hidden_size = 96, intermediate_size = 192, num_hidden_layers = 2,
      num_attention_heads = 12, num_key_value_heads = 12, max_position_embeddings = 32 } },
  }
  local function build(case)
    ms.manual_seed(7)
    return case[2].new(case[3])
  end
  local function run(m, x, y)
    local before = float8.stats().input_casts
    local losses = require('spec.support').adamw_losses(m, x, y, 4, 3e-3)
    return losses, float8.stats().input_casts - before
  end

  for _, case in ipairs(cases) do
    for _, order in ipairs({ 'convert, then split', 'split, then convert' }) do
      it(('%s (%s): every projection in FP8; one rank exact, more within FP8 rounding'):format(case[1], order),
        function()
          local x, y = FS.lcg_batch(3, 2, 16)
          local ref = build(case)
          local n_ref = #float8.convert(ref)
          local l_ref, casts_ref = run(ref, x, y)
          local m = build(case)
          local n
          if order == 'convert, then split' then
            n = #float8.convert(m)
            tp.parallelize(m)
          else
            tp.parallelize(m)
            n = #float8.convert(m)
          end
          -- (converted after the split, a layer whose shard is not a
          -- multiple of 16 wide stays plain: gpt2's attention on 4 ranks)
          if order == 'convert, then split' then assert.are.equal(n_ref, n) else assert.is_true(n > 0 and n <= n_ref) end
          local l, casts = run(m, x, y)
          -- the row-parallel layers cast their inputs as the unsplit ones do
          if n == n_ref then assert.are.equal(casts_ref, casts) end
          if W == 1 then
            assert.are.same(l_ref, l)
          else
            for k = 1, 4 do
              assert.is_true(FS.rel(l[k], l_ref[k]) < 0.02, ('step %d: %.6g against %.6g'):format(k, l[k], l_ref[k]))
            end
          end
          assert.is_true(l[4] < l[1], 'it trains')
          -- revert: the plain products, the split forwards kept (the loss
          -- moves by FP8's rounding only)
          local a = ms.no_grad(function() return m(x, y):item() end)
          float8.revert(m)
          local before = float8.stats().input_casts
          local b = ms.no_grad(function() return m(x, y):item() end)
          assert.are.equal(before, float8.stats().input_casts, 'no FP8 after revert')
          assert.is_true(a ~= b and FS.rel(b, a) < 0.02, ('reverted %g, float8 %g'):format(b, a))
        end)
    end

    it(case[1] .. ': sequence parallel with float8 trains as without it (within FP8 rounding)', function()
      local x, y = FS.lcg_batch(5, 2, 16)
      local ref = build(case)
      float8.convert(ref)
      local l_ref = run(ref, x, y)
      local m = build(case)
      float8.convert(m)
      tp.parallelize(m, { sequence_parallel = true })
      local l = run(m, x, y)
      for k = 1, 4 do
        assert.is_true(FS.rel(l[k], l_ref[k]) < 0.02, ('step %d: %.6g against %.6g'):format(k, l[k], l_ref[k]))
      end
    end)
  end
end)
