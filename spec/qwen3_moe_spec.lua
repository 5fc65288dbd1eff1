-- models/qwen3_moe.lua and the attention's per-head q/k norms
-- (nn.CausalSelfAttention{qk_norm_eps}, docs/moe.md): the norms against
-- plain ops, float64 finite differences; the sparse and dense layers as
-- transformers places them; the loss with the load-balancing loss;
-- finite differences through the whole model; the save/load round trip
-- with transformers' names; bin/train trains the tiny preset; what it
-- cannot run is refused by name.
local ms = require 'moonshard'
local A = ms.autograd
local nn = ms.nn
local nnf = nn.functional
local qwen3_moe = require 'models.qwen3_moe'
local S = require 'spec.support'
local q = S.shell_quote

local function small(over)
  local cfg = { vocab_size = 40, hidden_size = 16, intermediate_size = 20, moe_intermediate_size = 12,
    num_hidden_layers = 3, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 8,
    max_position_embeddings = 16, num_experts = 4, num_experts_per_tok = 2, norm_topk_prob = true,
    mlp_only_layers = { 1 }, output_router_logits = true, router_aux_loss_coef = 0.3 }
  for k, v in pairs(over or {}) do cfg[k] = v end
  return cfg
end

local batch = S.token_batch

describe('q/k norms and models.qwen3_moe', function()
  before_each(function() A.clear_tape() end)

  it('CausalSelfAttention{qk_norm_eps}: each head\'s q and k RMS-normalised before RoPE (against plain ops, f64); '
    .. 'finite differences', function()
    ms.manual_seed(3)
    local att = nn.CausalSelfAttention { dim = 16, n_head = 4, n_kv_head = 2, head_dim = 8, rope_theta = 10000,
      qk_norm_eps = 1e-6 }:to('f64')
    for _, p in ipairs(att:parameters()) do ms.normal_(p, 0.5, 0.4) end
    local x = ms.randn({ 2, 5, 16 }, { dtype = 'f64', seed = 4 }):requires_grad_()
    local y = att(x)
    -- the reference: the norm written out
    local function norm(t, w)
      local ms_ = (t * t):mean(4, true)
      return t / (ms_ + 1e-6):sqrt() * w
    end
    local y2 = A.no_grad(function()
      local qh = norm(att.q_proj(x):view(2, 5, 4, 8), att.q_norm.weight):transpose(2, 3)
      local kh = norm(att.k_proj(x):view(2, 5, 2, 8), att.k_norm.weight):transpose(2, 3)
      local vh = att.v_proj(x):view(2, 5, 2, 8):transpose(2, 3)
      local cos, sin = nnf.rope_cache(5, 8, 10000, 'f64', x.device_id, 'f64')
      qh, kh = nnf.apply_rotary(qh, cos, sin), nnf.apply_rotary(kh, cos, sin)
      local o = nnf.scaled_dot_product_attention(qh, kh, vh, { causal = true })
      return att.o_proj(o:transpose(2, 3):reshape(2, 5, 32))
    end)
    local err = (y:detach() - y2):abs():max():item()
    assert.is_true(err <= 1e-12, 'max abs error ' .. err)
    A.clear_tape()
    local worst = A.gradcheck(function() return att(x) end, { x, att.q_norm.weight, att.k_norm.weight,
      att.q_proj.weight })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('sparse layers where transformers puts them (decoder_sparse_step, mlp_only_layers); the loss adds the '
    .. 'load-balancing loss; finite differences through the model', function()
    ms.manual_seed(4)
    local m = qwen3_moe.new(small()):to('f64')
    local kinds = {}
    for i, l in ipairs(m.model.layers) do kinds[i] = getmetatable(l.mlp) == nn.MoE and 'moe' or 'dense' end
    assert.are.same({ 'moe', 'dense', 'moe' }, kinds)
    local m2 = qwen3_moe.new(small({ decoder_sparse_step = 2, mlp_only_layers = require('models.hf').null }))
    local k2 = {}
    for i, l in ipairs(m2.model.layers) do k2[i] = getmetatable(l.mlp) == nn.MoE and 'moe' or 'dense' end
    assert.are.same({ 'dense', 'moe', 'dense' }, k2)
    assert.is_not_nil(m.model.layers[1].self_attn.q_norm)
    for name, p in m:named_parameters() do if not name:match('norm') then ms.normal_(p, 0, 0.4) end end
    local x, y = batch(2, 6, 40, 7)
    local l = m(x, y):item()
    local aux = nn.moe.aux_loss(nn.moe.layers(m)):item()
    assert.are.equal(2, #nn.moe.layers(m))
    m.config.output_router_logits = false
    local ce = m(x, y):item()
    assert.is_true(math.abs(l - (ce + 0.3 * aux)) <= 1e-12, ('%.17g against %.17g + 0.3 x %.17g'):format(l, ce, aux))
    m.config.output_router_logits = true
    A.clear_tape()
    local L = m.model.layers
    local worst = A.gradcheck(function() return m(x, y) end, { L[1].mlp.gate.weight, L[1].self_attn.k_norm.weight,
      L[3].mlp.experts[2].down_proj.weight, L[2].mlp.up_proj.weight })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('save_pretrained / from_pretrained: transformers\' names and config, the same loss', function()
    ms.manual_seed(5)
    local m = qwen3_moe.new(small())
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local sd = ms.load_safetensors(dir .. '/model.safetensors')
    for _, name in ipairs({ 'model.layers.0.self_attn.q_norm.weight', 'model.layers.0.self_attn.k_norm.weight',
      'model.layers.0.mlp.gate.weight', 'model.layers.2.mlp.experts.3.down_proj.weight',
      'model.layers.1.mlp.gate_proj.weight' }) do
      assert.is_not_nil(sd[name], name)
    end
    assert.are.same({ 16, 12 }, sd['model.layers.2.mlp.experts.3.down_proj.weight'].shape)
    local cfg = require('models.hf').read_json(dir .. '/config.json')
    assert.are.equal('qwen3_moe', cfg.model_type)
    assert.are.same({ 'Qwen3MoeForCausalLM' }, cfg.architectures)
    assert.are.same({ 1 }, cfg.mlp_only_layers)
    local m2 = qwen3_moe.from_pretrained(dir)
    local x, y = batch(2, 6, 40, 13)
    assert.are.equal(m(x, y):item(), m2(x, y):item())
    os.execute('rm -rf ' .. q(dir))
  end)

  it('refuses what it cannot run, by name', function()
    assert.has_error(function() qwen3_moe.new(small({ use_sliding_window = true })) end,
      'qwen3_moe config: use_sliding_window is not supported (full causal attention only)')
    assert.has_error(function() qwen3_moe.new(small({ num_experts_per_tok = 5 })) end,
      'qwen3_moe config: num_experts_per_tok 5 is more than num_experts 4')
  end)

  it('bin/train trains the tiny preset; two FSDP ranks follow one process without the load-balancing loss; '
    .. '--tp 2 (its per-head q/k norms and split experts, sequence parallel) follows one process', function()
    local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.head_dim 16 '
      .. '--model.intermediate_size 48 --model.moe_intermediate_size 16 --seq-len 16 --lr 1e-2 --warmup 1 '
      .. '--eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 2'
    S.moe_train_runs('models/qwen3_moe.lua', flags, { '--fsdp FULL_SHARD' })
    local text = S.two_ranks_follow('models/qwen3_moe.lua', flags, '--tp 2', 3)
    assert.is_truthy(text:find('sequence parallel', 1, true), text)
  end)
end)
