-- models/qwen2_moe.lua and nn.MoE's gated shared expert (shared_gate,
-- docs/moe.md): the layer against its output written out in plain ops
-- (f64, 1e-12) and its finite differences; q/k/v biases without o's; the
-- sparse and dense layers as transformers places them; the loss with the
-- load-balancing loss; finite differences through the model; the
-- save/load round trip with transformers' names; bin/train trains the
-- tiny preset, and two FSDP ranks and two expert-parallel ranks follow one
-- process; what it cannot run is refused by name.
local ms = require 'moonshard'
local A = ms.autograd
local nn = ms.nn
local qwen2_moe = require 'models.qwen2_moe'
local S = require 'spec.support'
local q = S.shell_quote

local function small(over)
  local cfg = { vocab_size = 40, hidden_size = 16, intermediate_size = 20, moe_intermediate_size = 12,
    shared_expert_intermediate_size = 10, num_hidden_layers = 3, num_attention_heads = 2, num_key_value_heads = 1,
    max_position_embeddings = 16, num_experts = 4, num_experts_per_tok = 2, mlp_only_layers = { 1 },
    output_router_logits = true, router_aux_loss_coef = 0.3 }
  for k, v in pairs(over or {}) do cfg[k] = v end
  return cfg
end

local batch = S.token_batch

describe('models.qwen2_moe and the gated shared expert', function()
  before_each(function() A.clear_tape() end)

  it('MoE{shared_gate}: routed experts + sigmoid(x · gate) x the shared expert (against plain ops, f64); finite '
    .. 'differences', function()
    ms.manual_seed(3)
    for _, norm in ipairs({ false, true }) do
      local m = nn.MoE { dim = 8, hidden = 6, experts = 4, top_k = 2, norm_topk = norm, shared_hidden = 5,
        shared_gate = 'shared_expert_gate' }:to('f64')
      for _, p in ipairs(m:parameters()) do ms.normal_(p, 0, 0.5) end
      assert.are.same({ 1, 8 }, m.shared_expert_gate.weight.shape)
      assert.is_nil(m.shared_expert_gate.bias)
      local x = ms.randn({ 7, 8 }, { dtype = 'f64', seed = 5 }):requires_grad_()
      local y = m(x)
      -- the reference, one token at a time
      local ref = A.no_grad(function()
        local probs = nn.functional.softmax(m.gate(x), -1)
        local rows = {}
        local pv, xv = probs:totable(), x:detach()
        for n = 1, 7 do
          local p = pv[n]
          local order = { 1, 2, 3, 4 }
          table.sort(order, function(a, b) if p[a] ~= p[b] then return p[a] > p[b] end return a < b end)
          local w1, w2 = p[order[1]], p[order[2]]
          if norm then w1, w2 = w1 / (w1 + w2), w2 / (w1 + w2) end
          local xn = xv:narrow(1, n, 1)
          local r = m.experts[order[1]](xn) * w1 + m.experts[order[2]](xn) * w2
          local g = nn.functional.sigmoid(m.shared_expert_gate(xn))
          rows[n] = r + m.shared_expert(xn) * g
        end
        return ms.cat(rows, 1)
      end)
      local err = (y:detach() - ref):abs():max():item()
      assert.is_true(err <= 1e-12, ('norm_topk %s: max abs error %g'):format(tostring(norm), err))
      A.clear_tape()
      local worst = A.gradcheck(function() return m(x) end, { x, m.shared_expert_gate.weight, m.shared_expert.up_proj.weight,
        m.gate.weight })
      assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    end
    assert.has_error(function() nn.MoE { dim = 8, hidden = 6, experts = 4, top_k = 2, shared_gate = 'g' } end,
      'MoE: shared_gate needs a shared expert (shared_hidden)')
  end)

  it('q/k/v biases, none on o; sparse layers where transformers puts them; the loss adds the load-balancing loss; '
    .. 'finite differences through the model', function()
    ms.manual_seed(4)
    local m = qwen2_moe.new(small()):to('f64')
    local att = m.model.layers[1].self_attn
    assert.is_not_nil(att.q_proj.bias)
    assert.is_not_nil(att.k_proj.bias)
    assert.is_not_nil(att.v_proj.bias)
    assert.is_nil(att.o_proj.bias)
    assert.is_nil(qwen2_moe.new(small({ qkv_bias = false })).model.layers[1].self_attn.q_proj.bias)
    local kinds = {}
    for i, l in ipairs(m.model.layers) do kinds[i] = getmetatable(l.mlp) == nn.MoE and 'moe' or 'dense' end
    assert.are.same({ 'moe', 'dense', 'moe' }, kinds)
    local m2 = qwen2_moe.new(small({ decoder_sparse_step = 2, mlp_only_layers = require('models.hf').null }))
    local k2 = {}
    for i, l in ipairs(m2.model.layers) do k2[i] = getmetatable(l.mlp) == nn.MoE and 'moe' or 'dense' end
    assert.are.same({ 'dense', 'moe', 'dense' }, k2)
    for name, p in m:named_parameters() do if not name:match('norm') then ms.normal_(p, 0, 0.4) end end
    local x, y = batch(2, 6, 40, 7)
    local l = m(x, y):item()
    local aux = nn.moe.aux_loss(nn.moe.layers(m)):item()
    m.config.output_router_logits = false
    local ce = m(x, y):item()
    assert.is_true(math.abs(l - (ce + 0.3 * aux)) <= 1e-12, ('%.17g against %.17g + 0.3 x %.17g'):format(l, ce, aux))
    m.config.output_router_logits = true
    A.clear_tape()
    local L = m.model.layers
    local worst = A.gradcheck(function() return m(x, y) end, { L[1].mlp.shared_expert_gate.weight,
      L[1].self_attn.q_proj.bias, L[3].mlp.shared_expert.down_proj.weight, L[3].mlp.experts[2].down_proj.weight,
      L[2].mlp.up_proj.weight })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('save_pretrained / from_pretrained: transformers\' names and config, the same loss', function()
    ms.manual_seed(5)
    local m = qwen2_moe.new(small())
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local sd = ms.load_safetensors(dir .. '/model.safetensors')
    for _, name in ipairs({ 'model.layers.0.self_attn.q_proj.bias', 'model.layers.0.self_attn.v_proj.bias',
      'model.layers.0.mlp.gate.weight', 'model.layers.2.mlp.experts.3.down_proj.weight',
      'model.layers.0.mlp.shared_expert.gate_proj.weight', 'model.layers.0.mlp.shared_expert_gate.weight',
      'model.layers.1.mlp.gate_proj.weight' }) do
      assert.is_not_nil(sd[name], name)
    end
    assert.is_nil(sd['model.layers.0.self_attn.o_proj.bias'])
    assert.are.same({ 1, 16 }, sd['model.layers.0.mlp.shared_expert_gate.weight'].shape)
    assert.are.same({ 10, 16 }, sd['model.layers.0.mlp.shared_expert.up_proj.weight'].shape)
    local cfg = require('models.hf').read_json(dir .. '/config.json')
    assert.are.equal('qwen2_moe', cfg.model_type)
    assert.are.same({ 'Qwen2MoeForCausalLM' }, cfg.architectures)
    assert.are.equal(10, cfg.shared_expert_intermediate_size)
    assert.are.equal(true, cfg.qkv_bias)
    local m2 = qwen2_moe.from_pretrained(dir)
    local x, y = batch(2, 6, 40, 13)
    assert.are.equal(m(x, y):item(), m2(x, y):item())
    os.execute('rm -rf ' .. q(dir))
  end)

  it('refuses what it cannot run, by name', function()
    assert.has_error(function() qwen2_moe.new(small({ use_sliding_window = true })) end,
      'qwen2_moe config: use_sliding_window is not supported (full causal attention only)')
    assert.has_error(function() qwen2_moe.new(small({ num_experts_per_tok = 5 })) end,
      'qwen2_moe config: num_experts_per_tok 5 is more than num_experts 4')
  end)

  it('bin/train trains the tiny preset; two FSDP ranks and two expert-parallel ranks follow one process without the '
    .. 'load-balancing loss', function()
    S.moe_train_runs('models/qwen2_moe.lua', '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 '
      .. '--model.intermediate_size 48 --model.moe_intermediate_size 16 --model.shared_expert_intermediate_size 24 '
      .. '--seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 2',
      { '--fsdp FULL_SHARD', '--ep 2' })
  end)
end)
