-- Expert parallelism (#mpi, 1-4 ranks; nn.moe.expert_parallel,
-- docs/moe.md): every rank holds the router and E / P experts, and routes
-- its own tokens; against one process running the whole layer on every
-- rank's tokens, in f64: each rank's output and input gradient, the local
-- experts' gradients (every rank's tokens summed), the router's summed
-- over the ranks; padded runs; the routing weights on the experts' inputs
-- (scale_input); a Mixtral under expert parallelism as the whole model;
-- the refusals.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local nn = ms.nn
local moe = nn.moe
local FS = require 'spec.fsdp_support'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('expert parallelism #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local R = tonumber(os.getenv('OMPI_COMM_WORLD_RANK'))

  local function build(cfg)
    ms.manual_seed(9)
    local m = nn.MoE(cfg):to('f64')
    for _, p in ipairs(m:parameters()) do ms.normal_(p, 0, 0.5) end
    return m
  end
  -- rank p's tokens (each rank can make every rank's)
  local function tokens(p, n) return ms.randn({ n, 8 }, { dtype = 'f64', seed = 100 + p }) end
  local function probe(p, n) return ms.randn({ n, 8 }, { dtype = 'f64', seed = 200 + p }) end

  for _, c in ipairs({
    { 'top-2 of 4, softmax', { dim = 8, hidden = 6, experts = 4, top_k = 2 } },
    { 'top-3 of 8, sigmoid, a shared expert', { dim = 8, hidden = 5, experts = 8, top_k = 3, score = 'sigmoid',
      shared_hidden = 7 } },
    { 'top-2 of 4, sigmoid, the weights on the inputs (scale_input: Llama 4\'s), a shared expert', { dim = 8,
      hidden = 6, experts = 4, top_k = 2, score = 'sigmoid', norm_topk = false, scale_input = true,
      shared_hidden = 5 } },
  }) do
    for _, align in ipairs({ 1, 4 }) do
      it(('%s%s: each rank\'s output and gradients are the whole layer\'s on every rank\'s tokens (f64)'):format(c[1],
        align > 1 and ', runs padded to 4' or ''), function()
        if c[2].experts % W ~= 0 then return end
        moe.cpu_align = align
        local n = 5 + R            -- (ranks with different numbers of tokens)
        -- the reference: one layer over every rank's tokens
        local ref = build(c[2])
        local xs, gs, mine0 = {}, {}, 0
        for p = 0, W - 1 do
          xs[p + 1], gs[p + 1] = tokens(p, 5 + p), probe(p, 5 + p)
          if p < R then mine0 = mine0 + 5 + p end
        end
        local xa = ms.cat(xs, 1):requires_grad_()
        local ya = ref(xa)
        ya:backward(ms.cat(gs, 1))
        -- expert parallel
        local m = build(c[2])
        moe.expert_parallel(m)
        local x = tokens(R, n):requires_grad_()
        local ok, y = pcall(m, x)
        moe.cpu_align = 1
        assert(ok, y)
        y:backward(probe(R, n))
        local e1 = FS.max_rel(y:detach(), ya:detach():narrow(1, mine0 + 1, n))
        assert.is_true(e1 <= 1e-12, 'output ' .. e1)
        local e2 = FS.max_rel(x.grad, xa.grad:narrow(1, mine0 + 1, n))
        assert.is_true(e2 <= 1e-12, 'input gradient ' .. e2)
        -- the local experts: every rank's tokens' gradient
        local El = c[2].experts / W
        assert.are.equal(El, #m.experts._module_names)
        for j = 1, El do
          local e = R * El + j
          local names = m.experts[j].names
          for _, nm in ipairs(names) do
            local g, gr = m.experts[j][nm].weight.grad, ref.experts[e][nm].weight.grad
            local err = FS.max_rel(g, gr)
            assert.is_true(err <= 1e-10, ('expert %d %s: %g'):format(e, nm, err))
          end
        end
        -- the router (and the shared expert): this rank's tokens', summed over the ranks
        local gg = m.gate.weight.grad:clone()
        dist.all_reduce(gg, 'sum')
        assert.is_true(FS.max_rel(gg, ref.gate.weight.grad) <= 1e-10)
        if m.shared_name then
          local gsh = m[m.shared_name].up_proj.weight.grad:clone()
          dist.all_reduce(gsh, 'sum')
          assert.is_true(FS.max_rel(gsh, ref[ref.shared_name].up_proj.weight.grad) <= 1e-10)
        end
        -- the names of the experts kept are the global ones
        local names = {}
        for name in m:named_parameters() do if name:match('^experts%.') then names[#names + 1] = name end end
        table.sort(names)
        assert.are.equal(('experts.%d.down_proj.weight'):format(R * El), names[1])
      end)
    end
  end

  it('a Mixtral with expert parallelism: the loss (each rank its batch) and the attention\'s gradients, summed, '
    .. 'are the whole model\'s on every batch', function()
    if 4 % W ~= 0 then return end
    local mixtral = require 'models.mixtral'
    local cfg = { vocab_size = 40, hidden_size = 8, intermediate_size = 12, num_hidden_layers = 2,
      num_attention_heads = 2, num_key_value_heads = 1, max_position_embeddings = 16, num_local_experts = 4,
      num_experts_per_tok = 2, bos_token_id = require('models.hf').null, eos_token_id = require('models.hf').null }
    local function make()
      ms.manual_seed(4)
      local m = mixtral.new(cfg):to('f64')
      for name, p in m:named_parameters() do if not name:match('norm') then ms.normal_(p, 0, 0.4) end end
      return m
    end
    local S = require 'spec.support'
    local ref = make()
    local lsum = 0
    for p = 0, W - 1 do
      local x, y = S.token_batch(2, 6, 40, 11 + p)
      local l = ref(x, y)
      l:backward()
      lsum = lsum + l:item()
    end
    local m = make()
    moe.expert_parallel(m)
    local x, y = S.token_batch(2, 6, 40, 11 + R)
    local l = m(x, y)
    l:backward()
    local lt = ms.tensor({ l:item() }, { dtype = 'f64' })
    dist.all_reduce(lt, 'sum')
    assert.is_true(FS.rel(lt:item(), lsum) <= 1e-12, ('%.17g against %.17g'):format(lt:item(), lsum))
    local g = m.model.layers[1].self_attn.q_proj.weight.grad:clone()
    dist.all_reduce(g, 'sum')
    assert.is_true(FS.max_rel(g, ref.model.layers[1].self_attn.q_proj.weight.grad) <= 1e-10)
  end)

  it('refuses experts that do not split over the ranks, a second call, and FSDP or a pipeline over it', function()
    if W == 1 then
      local m = build({ dim = 8, hidden = 6, experts = 3, top_k = 1 })
      moe.expert_parallel(m)
      assert.has_error(function() moe.expert_parallel(m) end, 'moe.expert_parallel: the model is already expert-parallel')
      assert.has_error(function() ms.fsdp.fully_shard(m) end, 'fully_shard: the model is expert-parallel '
        .. '(nn.moe.expert_parallel): its experts differ from rank to rank; split it with ms.ep.parallelize, which says '
        .. 'which ranks hold the same experts')
      local mixtral = require 'models.mixtral'
      local mm = mixtral.new('tiny', { num_hidden_layers = 2, output_router_logits = false })
      moe.expert_parallel(mm)
      assert.has_error(function() ms.pp.pipeline(mm) end,
        'pp.pipeline: model.layers.0.block_sparse_moe is expert-parallel (nn.moe.expert_parallel); cut the model '
        .. 'first, then split each stage\'s experts (ms.ep.parallelize after pp.pipeline, docs/moe.md)')
      return
    end
    local m = build({ dim = 8, hidden = 6, experts = W + 1, top_k = 1 })
    assert.has_error(function() moe.expert_parallel(m) end,
      ('moe.expert_parallel: %d experts do not split over %d ranks'):format(W + 1, W))
    assert.has_error(function() moe.expert_parallel(nn.Linear(3, 3)) end, 'moe.expert_parallel: the model has no MoE layers')
  end)
end)
