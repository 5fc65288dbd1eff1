-- The routers' load-balancing loss under pipeline parallelism (#mpi, 1-4
-- ranks): Switch's loss over every layer's tokens (output_router_logits)
-- is one product of means over all the stages' layers, so a pipeline
-- carries each micro-batch's counts and mean scores forward with its
-- activation and f̄ back with its gradient (docs/pp.md). A Mixtral and a
-- Qwen2-MoE with a dense layer (a stage may hold no MoE layer) of 4
-- blocks, in f64, cut over every rank: the loss and this stage's
-- gradients are one process's over the same micro-batches (each
-- micro-batch's loss its own product of means, as gradient accumulation
-- in one process), under 1f1b, gpipe, zbh1, without overlap, with the
-- blocks checkpointed, and interleaved (2 chunks a rank); two clipped
-- AdamW steps train as one process; evaluation matches.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local P = require 'spec.pp_support'
local dist = require 'moonshard.dist'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('pipeline parallelism with the load-balancing loss #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 60 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local pp = ms.pp

  local cases = {
    { 'mixtral', require 'models.mixtral', { vocab_size = 257, hidden_size = 24, intermediate_size = 20,
      num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 16,
      num_local_experts = 4, num_experts_per_tok = 2, output_router_logits = true, router_aux_loss_coef = 0.5,
      bos_token_id = hf.null, eos_token_id = hf.null } },
    { 'qwen2_moe', require 'models.qwen2_moe', { vocab_size = 257, hidden_size = 24, intermediate_size = 40,
      moe_intermediate_size = 12, shared_expert_intermediate_size = 16, num_hidden_layers = 4,
      num_attention_heads = 4, num_key_value_heads = 4, max_position_embeddings = 16, num_experts = 4,
      num_experts_per_tok = 2, mlp_only_layers = { 1 }, output_router_logits = true, router_aux_loss_coef = 0.5 } },
  }
  local function build(case)
    ms.manual_seed(7)
    local cfg = {}
    for k, v in pairs(case[3]) do cfg[k] = v end
    local m = case[2].new(cfg):to('f64')
    m:train()
    return m
  end
  local B, Tn, M = 4, 8, 2

  -- one process over the same micro-batches: each one's loss (its own
  -- load-balancing term) counts 1 / M
  local function reference(case, x, y)
    local ref = build(case)
    local total = 0
    for i = 1, M do
      local xi = x:narrow(1, (i - 1) * (B / M) + 1, B / M):contiguous()
      local yi = y:narrow(1, (i - 1) * (B / M) + 1, B / M):contiguous()
      local l = ref(xi, yi)
      total = total + l:item() / M
      local scaled = l * (1 / M)
      scaled:backward()
    end
    return ref, total
  end

  for _, case in ipairs(cases) do
    for _, c in ipairs({ { '1f1b' }, { 'gpipe' }, { 'zbh1' }, { '1f1b', overlap = false }, { '1f1b', ac = true },
      { 'interleaved', chunks = 2 } }) do
      local how = c[1] .. (c.overlap == false and ', no overlap' or '') .. (c.ac and ', blocks checkpointed' or '')
      it(('%s over %s stages, %s: the loss (the load-balancing term over every stage\'s layers) and the gradients '
        .. 'are one process\'s (f64)'):format(case[1], 'every rank\'s', how), function()
        if W < 2 then pending('one rank: no pipeline') return end
        if (c.chunks or 1) * W > case[3].num_hidden_layers then pending('more virtual stages than blocks') return end
        if c.chunks and M % W ~= 0 then pending('the interleaved schedule needs micro-batches in multiples of the stages') return end
        local x, y = FS.lcg_batch(5, B, Tn)
        local ref, l0 = reference(case, x, y)
        -- (the term counts: the loss without it differs)
        local plain = build(case)
        plain.config.output_router_logits = false
        local lp = plain(x:narrow(1, 1, B / M):contiguous(), y:narrow(1, 1, B / M):contiguous()):item()
        local m = build(case)
        if c.ac then ms.nn.apply_activation_checkpointing(m, { class = m.model.layers[1]:class_name() }) end
        local pipe = pp.pipeline(m, { microbatches = M, schedule = c.chunks and nil or c[1], chunks = c.chunks,
          overlap = c.overlap })
        local l = pipe:step(x, y)
        assert.is_true(FS.rel(l:item(), l0) <= 1e-12, ('%s: %.17g against %.17g'):format(how, l:item(), l0))
        assert.is_true(math.abs(lp - l0) > 1e-6, 'the load-balancing term changed nothing')
        assert.is_true(P.same_grads(m, ref, how) > 0)
        -- two clipped AdamW steps, then the evaluation: one process's
        if c[1] == '1f1b' and not c.ac and c.overlap ~= false then
          local o0 = ms.optim.AdamW(ref:parameters(), { lr = 1e-2 })
          local o1 = ms.optim.AdamW(m:parameters(), { lr = 1e-2 })
          for step = 1, 2 do
            if step > 1 then
              local a, b = FS.lcg_batch(5 + step, B, Tn)
              for i = 1, M do
                local ai = a:narrow(1, (i - 1) * (B / M) + 1, B / M):contiguous()
                local bi = b:narrow(1, (i - 1) * (B / M) + 1, B / M):contiguous()
                local scaled = ref(ai, bi) * (1 / M)
                scaled:backward()
              end
              pipe:step(a, b):free()
            end
            local n0, n1 = ms.optim.clip_grad_norm(ref, 0.05), pp.clip_grad_norm_(m, 0.05)
            assert.is_true(FS.rel(n1, n0) <= 1e-10, ('norm %.17g against %.17g'):format(n1, n0))
            o0:step(); o0:zero_grad(); o1:step(); o1:zero_grad()
          end
          local a, b = FS.lcg_batch(19, B, Tn)
          local la = 0
          for i = 1, M do
            local ai = a:narrow(1, (i - 1) * (B / M) + 1, B / M):contiguous()
            local bi = b:narrow(1, (i - 1) * (B / M) + 1, B / M):contiguous()
            la = la + ref(ai, bi):item() / M
          end
          local lb = pipe:evaluate(a, b):item()
          assert.is_true(FS.rel(lb, la) <= 1e-10, ('after the steps %.17g against %.17g'):format(lb, la))
        end
        pipe:free()
      end)
    end
  end
end)
