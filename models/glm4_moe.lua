-- models/glm4_moe.lua — GLM-4.5 and GLM-4.5-Air (Zhipu AI 2025; GLM-4.6's
-- text model too), as Hugging Face's Glm4MoeForCausalLM: Llama's decoder
-- (models/llama.lua) with
--   * grouped-query attention whose RoPE turns only the first
--     partial_rotary_factor of each head's features (half by default; the
--     rest pass through), biases on q/k/v when attention_bias (none on
--     o_proj), per-head q/k RMSNorms when use_qk_norm (self_attn.q_norm,
--     k_norm), head_dim given apart from the width;
--   * DeepSeek-V3's router (models/deepseek_v3.lua) in every layer past the
--     first first_k_dense_replace: sigmoid scores, the routing bias
--     mlp.gate.e_score_correction_bias added to choose the experts, groups
--     (n_group, topk_group, a group scored by its two best),
--     num_experts_per_tok a token, weights renormalised (norm_topk_prob)
--     and scaled by routed_scaling_factor, n_shared_experts shared experts
--     as one MLP (mlp.shared_experts).
-- The same config.json fields and parameter names as transformers'. The
-- checkpoints' multi-token-prediction layer (num_nextn_predict_layers:
-- model.layers.N past num_hidden_layers) is skipped on load, as
-- transformers skips it, unless mtp_loss_weight > 0 (ours): then it is
-- built and trained as DeepSeek-V3's. No auxiliary loss (as transformers): balance with
-- --moe-bias-rate, which moves the routing biases (docs/moe.md).
--
--   local glm = require 'models.glm4_moe'
--   local model = glm.new('tiny')
--   local model = glm.from_pretrained('path/to/GLM-4.5-Air')
local nn = require 'moonshard.nn'
local hf = require 'models.hf'
local llama = require 'models.llama'
local v3 = require 'models.deepseek_v3'

local glm4_moe = { name = 'glm4_moe', model_type = 'glm4_moe' }

-- Config fields: Glm4MoeConfig's, with its defaults.
glm4_moe.fields = {
  { 'model_type', { 'glm4_moe' }, 'glm4_moe', 'always glm4_moe' },
  { 'vocab_size', 'int>0', 151552, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 4096, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 10944, 'width of a dense layer\'s gated MLP' },
  { 'moe_intermediate_size', 'int>0', 1408, 'width of each expert\'s gated MLP' },
  { 'num_hidden_layers', 'int>0', 46, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 96, 'query heads' },
  { 'num_key_value_heads', 'int>0?', 8, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', nil, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'n_shared_experts', 'int>=0', 1, 'shared experts, one MLP of n_shared_experts x moe_intermediate_size (0: none)' },
  { 'n_routed_experts', 'int>0', 128, 'routed experts in each sparse layer' },
  { 'routed_scaling_factor', 'number>0', 1.0, 'the routing weights\' multiplier' },
  { 'n_group', 'int>0', 1, 'expert groups (group-limited routing)' },
  { 'topk_group', 'int>0', 1, 'groups each token picks' },
  { 'num_experts_per_tok', 'int>0', 8, 'experts each token goes to (top-k)' },
  { 'first_k_dense_replace', 'int>=0', 1, 'the first layers that keep a dense MLP' },
  { 'norm_topk_prob', 'bool', true, 'renormalise the top-k scores to sum 1' },
  { 'use_qk_norm', 'bool', false, 'RMSNorm each head of q and of k before RoPE' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 131072, 'longest sequence' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'rms_norm_eps', 'number>0', 1e-5, 'RMSNorm epsilon (the q/k norms too)' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0, partial_rotary_factor = 0.5 },
    'RoPE: rope_theta, partial_rotary_factor (the share of each head\'s features rotated); rope_type default, '
      .. 'linear, llama3 or yarn as Llama\'s' },
  { 'attention_bias', 'bool', false, 'biases on q/k/v (not o_proj)' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities (not applied here)' },
  { 'num_nextn_predict_layers', 'int>=0', 1, 'multi-token-prediction depths (built when mtp_loss_weight > 0, else '
    .. 'skipped on load, as transformers does)' },
  { 'mtp_loss_weight', 'number>=0', 0, 'ours: above 0 builds the num_nextn_predict_layers multi-token-prediction '
    .. 'modules (DeepSeek-V3\'s, models/deepseek_v3.lua) and adds this weight / their number times their losses' },
  { 'bos_token_id', 'ids?', nil, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', nil, 'end of sequence' },
}
glm4_moe.config = hf.defaults(glm4_moe.fields)

glm4_moe.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes: the first of
  -- its 4 layers dense, 8 routed experts in 4 groups (2 groups a token, 2
  -- experts a token) and a shared one; heads of 32, half of each rotated
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, moe_intermediate_size = 64,
           num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 32,
           n_routed_experts = 8, n_group = 4, topk_group = 2, num_experts_per_tok = 2, routed_scaling_factor = 2.5,
           use_qk_norm = true, attention_bias = true, max_position_embeddings = 256 },
  -- GLM-4.5-Air's shapes (106B parameters, 12B a token)
  ['glm-4.5-air'] = { hidden_size = 4096, intermediate_size = 10944, moe_intermediate_size = 1408,
           num_hidden_layers = 46, num_attention_heads = 96, num_key_value_heads = 8, head_dim = 128,
           n_routed_experts = 128, num_experts_per_tok = 8, routed_scaling_factor = 1.0, attention_bias = true,
           rope_parameters = { rope_type = 'default', rope_theta = 1000000.0, partial_rotary_factor = 0.5 } },
  -- GLM-4.5's shapes (355B parameters, 32B a token)
  ['glm-4.5'] = { hidden_size = 5120, intermediate_size = 12288, moe_intermediate_size = 1536,
           num_hidden_layers = 92, num_attention_heads = 96, num_key_value_heads = 8, head_dim = 128,
           n_routed_experts = 160, num_experts_per_tok = 8, routed_scaling_factor = 2.5, first_k_dense_replace = 3,
           use_qk_norm = true, attention_bias = true,
           rope_parameters = { rope_type = 'default', rope_theta = 1000000.0, partial_rotary_factor = 0.5 } },
}

-- Llama's reading of older configs (rope_theta, rope_scaling), and
-- partial_rotary_factor at the top level (transformers writes it there
-- too) taken into rope_parameters; the MTP layers' older name
function glm4_moe.normalize(cfg)
  local prf = cfg.partial_rotary_factor
  cfg.partial_rotary_factor = nil
  llama.normalize(cfg)
  local rp = cfg.rope_parameters
  if rp.partial_rotary_factor == nil and prf ~= nil and prf ~= hf.null then rp.partial_rotary_factor = prf end
  if rp.partial_rotary_factor == nil then rp.partial_rotary_factor = 0.5 end   -- (Glm4MoeConfig's default)
  if cfg.num_mtp_layers ~= nil and cfg.num_mtp_layers ~= hf.null and cfg.num_nextn_predict_layers == nil then
    cfg.num_nextn_predict_layers = cfg.num_mtp_layers
  end
  cfg.num_mtp_layers = nil
end

-- the rotated features of each head (transformers: int(head_dim *
-- partial_rotary_factor))
function glm4_moe.rotary_dim(cfg)
  local hd = cfg.head_dim or math.floor(cfg.hidden_size / cfg.num_attention_heads)
  return math.floor(hd * cfg.rope_parameters.partial_rotary_factor)
end

function glm4_moe.check(cfg)
  local function cfg_error(fmt, ...) error(('glm4_moe config: ' .. fmt):format(...), 3) end
  local f = cfg.rope_parameters.partial_rotary_factor
  if type(f) ~= 'number' or f <= 0 or f > 1 then
    cfg_error('rope_parameters.partial_rotary_factor must be in (0, 1], got %s', tostring(f))
  end
  local rd = glm4_moe.rotary_dim(cfg)
  if rd < 2 or rd % 2 ~= 0 then
    cfg_error('partial_rotary_factor %g of head_dim %d rotates %d features: RoPE needs an even number, 2 or more', f,
      cfg.head_dim or math.floor(cfg.hidden_size / cfg.num_attention_heads), rd)
  end
  llama.check(cfg)
  -- (the router's checks are DeepSeek-V3's, named as ours)
  v3.check_router(cfg, 'glm4_moe', 'top2', cfg.n_group, cfg.topk_group)
end

-- what its layers change in Llama's: partial RoPE, biases on q/k/v only,
-- the optional q/k norms; the MLP of a layer past the first
-- first_k_dense_replace a mixture of experts
llama.variants.glm4_moe = {
  attention = function(cfg)
    return { bias = cfg.attention_bias, o_bias = false, rotary_dim = glm4_moe.rotary_dim(cfg),
      qk_norm = cfg.use_qk_norm }
  end,
  mlp = function(cfg, idx)
    if idx < cfg.first_k_dense_replace then
      return 'mlp', nn.GatedMLP { dim = cfg.hidden_size, hidden = cfg.intermediate_size }
    end
    local ns = cfg.n_shared_experts
    return 'mlp', nn.MoE { dim = cfg.hidden_size, hidden = cfg.moe_intermediate_size, experts = cfg.n_routed_experts,
      top_k = cfg.num_experts_per_tok, score = 'sigmoid', norm_topk = cfg.norm_topk_prob,
      route_scale = cfg.routed_scaling_factor, n_group = cfg.n_group, topk_group = cfg.topk_group,
      group_score = 'top2', router = 'gate', router_bias = true,
      shared_hidden = ns > 0 and ns * cfg.moe_intermediate_size or nil, shared = 'shared_experts' }
  end,
}
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
glm4_moe.fsdp_block = 'LlamaDecoderLayer'

-- build, new, from_pretrained, export_config (Glm4MoeForCausalLM's
-- config.json; partial_rotary_factor also at the top level, as
-- transformers writes it)
llama.decoder_family(glm4_moe, 'Glm4MoeForCausalLM', function(cfg)
  cfg.partial_rotary_factor = cfg.rope_parameters.partial_rotary_factor
end)
-- (the MTP layers skipped as DeepSeek-V3's, or built and trained with
-- mtp_loss_weight > 0: the same modules, read and saved under the
-- checkpoints' model.layers.(num_hidden_layers + K); FP8 block scales read
-- as its)
glm4_moe.fix_state_dict = v3.fix_state_dict
v3.with_mtp(glm4_moe)

return glm4_moe
