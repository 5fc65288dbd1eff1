-- models/deepseek_v2.lua — DeepSeek-V2 and DeepSeek-V2-Lite (DeepSeek-AI
-- 2024), as Hugging Face's DeepseekV2ForCausalLM: DeepSeek-V3's decoder
-- (models/deepseek_v3.lua: multi-head latent attention, the first
-- first_k_dense_replace layers dense, the others a mixture of
-- n_routed_experts plus n_shared_experts shared ones, the same parameter
-- names) with V2's router:
--   * softmax scores over the experts (no routing bias);
--   * topk_method greedy (the num_experts_per_tok best experts), or
--     group_limited_greedy (n_group groups each scored by its best expert,
--     the topk_group best groups kept, the experts chosen among theirs);
--   * the chosen scores times routed_scaling_factor, not renormalised.
-- RoPE is always on (even, odd) pairs (DeepSeek's checkpoints), default or
-- YaRN (DeepSeek-V2's long-context configs), with YaRN's mscale² in the
-- softmax scale as in V3. The same config.json fields as transformers';
-- DeepSeek's own configs' extra fields (moe_layer_freq 1, ...) are read and
-- ignored, as transformers ignores them, but for aux_loss_alpha and
-- seq_aux: with aux_loss_alpha > 0 the training loss adds DeepSeek's
-- expert-level balance loss of its MoEGate, per sequence (seq_aux) or over
-- the forward's tokens, f_i counting the experts the routing chose
-- (greedy or group-limited), the softmax scores as they are (docs/moe.md).
-- Not built: V2's device- and communication-level balance losses;
-- --moe-bias-rate balances too. norm_topk_prob = true is refused: transformers' model
-- ignores it while DeepSeek's code renormalises, so no single meaning.
--
--   local deepseek_v2 = require 'models.deepseek_v2'
--   local model = deepseek_v2.new('tiny')
--   local model = deepseek_v2.from_pretrained('path/to/DeepSeek-V2-Lite')
local nn = require 'moonshard.nn'
local hf = require 'models.hf'
local llama = require 'models.llama'
local v3 = require 'models.deepseek_v3'

local deepseek_v2 = { name = 'deepseek_v2', model_type = 'deepseek_v2' }

-- Config fields: DeepseekV2Config's, with its defaults (DeepSeek-V2's
-- shapes), but q_lora_rank, which may be null, defaults to null here (a
-- null in config.json reads as an absent field); the presets have the
-- models' values.
deepseek_v2.fields = {
  { 'model_type', { 'deepseek_v2' }, 'deepseek_v2', 'always deepseek_v2' },
  { 'vocab_size', 'int>0', 102400, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 4096, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 11008, 'width of a dense layer\'s gated MLP' },
  { 'moe_intermediate_size', 'int>0', 1407, 'width of each expert\'s gated MLP' },
  { 'num_hidden_layers', 'int>0', 32, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 32, 'attention heads' },
  { 'num_key_value_heads', 'int>0?', nil, 'must equal num_attention_heads (each head has its keys); nil: the same' },
  { 'n_shared_experts', 'int>=0', 2, 'shared experts, one MLP of n_shared_experts x moe_intermediate_size (0: none)' },
  { 'n_routed_experts', 'int>0', 64, 'routed experts in each sparse layer' },
  { 'routed_scaling_factor', 'number>0', 1.0, 'the routing weights\' multiplier' },
  { 'kv_lora_rank', 'int>0', 512, 'width of the compressed keys and values' },
  { 'q_lora_rank', 'int>0?', nil, 'width of the compressed queries; nil: q_proj, no compression (V2-Lite)' },
  { 'qk_rope_head_dim', 'int>0', 64, 'width of the rotary part of each head\'s q and k' },
  { 'v_head_dim', 'int>0', 128, 'width of each head\'s values' },
  { 'qk_nope_head_dim', 'int>0', 128, 'width of the non-rotary part of each head\'s q and k' },
  { 'topk_method', { 'greedy', 'group_limited_greedy' }, 'greedy',
    'greedy: the best experts; group_limited_greedy: among the topk_group best of n_group groups' },
  { 'n_group', 'int>0?', nil, 'expert groups (group_limited_greedy); nil: 1' },
  { 'topk_group', 'int>0?', nil, 'groups each token picks (group_limited_greedy); nil: 1' },
  { 'num_experts_per_tok', 'int>0?', nil, 'experts each token goes to (top-k); must be given' },
  { 'first_k_dense_replace', 'int>=0', 0, 'the first layers that keep a dense MLP' },
  { 'norm_topk_prob', 'bool', false, 'renormalise the top-k scores: false only (see the file\'s head)' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 2048, 'longest sequence' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'rms_norm_eps', 'number>0', 1e-6, 'RMSNorm epsilon of the layers\' and the final norms' },
  { 'bos_token_id', 'ids?', 1, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', 2, 'end of sequence' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0 },
    'RoPE: rope_theta; rope_type default or yarn (factor, original_max_position_embeddings, beta_fast, beta_slow, '
      .. 'mscale, mscale_all_dim, attention_factor, truncate)' },
  { 'attention_bias', 'bool', false, 'biases on q_a_proj, kv_a_proj_with_mqa and o_proj' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities (not applied here)' },
  { 'mlp_bias', 'bool', false, 'biases on the MLPs: false only' },
  { 'aux_loss_alpha', 'number>=0', 0, 'DeepSeek\'s configs\' field: above 0 the training loss (training mode) adds '
    .. 'this times the sequence-wise balance loss of every MoE layer (DeepSeek\'s MoEGate; its configs say 0.001); 0 '
    .. '(the default here): none (docs/moe.md)' },
  { 'seq_aux', 'bool', true, 'DeepSeek\'s configs\' field: the balance loss per sequence (true) or over each '
    .. 'forward\'s tokens at once (false)' },
}
deepseek_v2.config = hf.defaults(deepseek_v2.fields)

deepseek_v2.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes: the first of
  -- its 4 layers dense, 8 routed experts in 4 groups (2 groups a token, 2
  -- experts a token) and two shared ones; q/k heads of 32 + 32, values of 32
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, moe_intermediate_size = 64,
           num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 4, n_shared_experts = 2,
           n_routed_experts = 8, routed_scaling_factor = 1.0, kv_lora_rank = 64, q_lora_rank = 96,
           qk_rope_head_dim = 32, v_head_dim = 32, qk_nope_head_dim = 32, topk_method = 'group_limited_greedy',
           n_group = 4, topk_group = 2, num_experts_per_tok = 2, first_k_dense_replace = 1,
           max_position_embeddings = 256, rms_norm_eps = 1e-5, bos_token_id = hf.null, eos_token_id = hf.null },
  -- DeepSeek-V2-Lite's shapes (15.7B parameters, 2.4B a token)
  ['deepseek-v2-lite'] = { vocab_size = 102400, hidden_size = 2048, intermediate_size = 10944,
           moe_intermediate_size = 1408, num_hidden_layers = 27, num_attention_heads = 16, num_key_value_heads = 16,
           n_shared_experts = 2, n_routed_experts = 64, kv_lora_rank = 512, q_lora_rank = hf.null,
           num_experts_per_tok = 6, first_k_dense_replace = 1, max_position_embeddings = 163840,
           bos_token_id = 100000, eos_token_id = 100001 },
  -- DeepSeek-V2's shapes (236B parameters, 21B a token; its YaRN context
  -- extension not included: give rope_parameters for it)
  ['deepseek-v2'] = { vocab_size = 102400, hidden_size = 5120, intermediate_size = 12288,
           moe_intermediate_size = 1536, num_hidden_layers = 60, num_attention_heads = 128,
           num_key_value_heads = 128, n_shared_experts = 2, n_routed_experts = 160, routed_scaling_factor = 16.0,
           kv_lora_rank = 512, q_lora_rank = 1536, topk_method = 'group_limited_greedy', n_group = 8, topk_group = 3,
           num_experts_per_tok = 6, first_k_dense_replace = 1, max_position_embeddings = 163840,
           bos_token_id = 100000, eos_token_id = 100001 },
}

-- DeepSeek's own configs' fields that transformers' DeepseekV2Config does
-- not have (moe_layer_freq, ...) are kept as read and written back;
-- moe_layer_freq must be 1 (every layer past first_k_dense_replace sparse,
-- as both models build) and scoring_func softmax.
function deepseek_v2.normalize(cfg)
  v3.normalize(cfg)
  local f = cfg.moe_layer_freq
  if f ~= nil and f ~= hf.null and f ~= 1 then
    error(('deepseek_v2 config: moe_layer_freq %s is not supported (1: every layer past first_k_dense_replace '
      .. 'sparse, as transformers builds it)'):format(tostring(f)), 3)
  end
  local sf = cfg.scoring_func
  if sf ~= nil and sf ~= hf.null and sf ~= 'softmax' then
    error(('deepseek_v2 config: scoring_func %s is not supported (DeepSeek-V2 scores by softmax)'):format(
      tostring(sf)), 3)
  end
end

function deepseek_v2.check(cfg)
  local function cfg_error(fmt, ...) error(('deepseek_v2 config: ' .. fmt):format(...), 3) end
  if cfg.num_experts_per_tok == nil then cfg_error('num_experts_per_tok must be given (experts a token)') end
  if cfg.norm_topk_prob then
    cfg_error('norm_topk_prob = true is not supported (transformers\' DeepseekV2 ignores it, DeepSeek\'s code '
      .. 'renormalises; false in the released models)')
  end
  if cfg.mlp_bias then cfg_error('mlp_bias = true is not supported (no released model has MLP biases)') end
  v3.check_latent(cfg, 'deepseek_v2')
  -- (greedy routing ignores the groups)
  local greedy = cfg.topk_method == 'greedy'
  v3.check_router(cfg, 'deepseek_v2', 'max', (not greedy) and cfg.n_group or nil, (not greedy) and cfg.topk_group or nil)
end

-- what its layers change in Llama's: V3's latent attention with paired
-- RoPE; V2's router in the sparse layers
llama.variants.deepseek_v2 = {
  self_attn = function(cfg)
    return llama.variants.deepseek_v3.self_attn(setmetatable({ rope_interleave = true }, { __index = cfg }))
  end,
  mlp = function(cfg, idx)
    if idx < cfg.first_k_dense_replace then
      return 'mlp', nn.GatedMLP { dim = cfg.hidden_size, hidden = cfg.intermediate_size }
    end
    local ns, grouped = cfg.n_shared_experts, cfg.topk_method == 'group_limited_greedy'
    return 'mlp', nn.MoE { dim = cfg.hidden_size, hidden = cfg.moe_intermediate_size, experts = cfg.n_routed_experts,
      top_k = cfg.num_experts_per_tok, score = 'softmax', norm_topk = false, route_scale = cfg.routed_scaling_factor,
      n_group = grouped and cfg.n_group or 1, topk_group = grouped and cfg.topk_group or 1, group_score = 'max',
      router = 'gate', shared_hidden = ns > 0 and ns * cfg.moe_intermediate_size or nil, shared = 'shared_experts' }
  end,
}
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
deepseek_v2.fsdp_block = 'LlamaDecoderLayer'
-- the sequence-wise balance loss's f_i counts the experts the routing chose
-- (DeepSeek-V2's MoEGate: its topk_idx, greedy or group-limited)
deepseek_v2.seq_aux_choice = 'routing'

-- build, new, from_pretrained, export_config (DeepseekV2ForCausalLM's
-- config.json, with V3's rope_scaling copy for transformers < 5)
llama.decoder_family(deepseek_v2, 'DeepseekV2ForCausalLM', v3.export_extra)
deepseek_v2.fix_state_dict = v3.fix_state_dict

return deepseek_v2
