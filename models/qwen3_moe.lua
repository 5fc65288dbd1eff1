-- models/qwen3_moe.lua — Qwen3-MoE (Qwen3-30B-A3B's architecture), as
-- Hugging Face's Qwen3MoeForCausalLM: Llama's decoder (models/llama.lua)
-- with
--   * q and k each normalised per head (self_attn.q_norm, self_attn.k_norm:
--     RMSNorm over head_dim) before RoPE;
--   * the MLP of every decoder_sparse_step-th layer (but mlp_only_layers) a
--     mixture of num_experts SwiGLU experts of moe_intermediate_size
--     (mlp.gate, mlp.experts.N.gate_proj / up_proj / down_proj; nn.MoE,
--     docs/moe.md), num_experts_per_tok a token, the top-k scores
--     renormalised when norm_topk_prob; the others a dense MLP of
--     intermediate_size.
-- The same config.json fields and parameter names; with
-- output_router_logits the loss adds router_aux_loss_coef times the
-- load-balancing loss over every sparse layer's tokens, as transformers.
--
--   local qwen3_moe = require 'models.qwen3_moe'
--   local model = qwen3_moe.new('tiny')
local nn = require 'moonshard.nn'
local hf = require 'models.hf'
local llama = require 'models.llama'

local qwen3_moe = { name = 'qwen3_moe', model_type = 'qwen3_moe' }

-- Config fields: Qwen3MoeConfig's, with its defaults.
qwen3_moe.fields = {
  { 'model_type', { 'qwen3_moe' }, 'qwen3_moe', 'always qwen3_moe' },
  { 'vocab_size', 'int>0', 151936, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 2048, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 6144, 'width of a dense layer\'s gated MLP' },
  { 'moe_intermediate_size', 'int>0', 768, 'width of each expert\'s gated MLP' },
  { 'num_hidden_layers', 'int>0', 24, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 32, 'query heads' },
  { 'num_key_value_heads', 'int>0?', 4, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', nil, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 32768, 'longest sequence' },
  { 'rms_norm_eps', 'number>0', 1e-6, 'RMSNorm epsilon (the q and k norms too)' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0 },
    'RoPE: rope_theta (rope_type default only)' },
  { 'attention_bias', 'bool', false, 'biases on q/k/v/o projections' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities' },
  { 'use_sliding_window', 'bool', false, 'sliding-window attention: not supported (false only)' },
  { 'sliding_window', 'int>0?', 4096, 'its window (unused)' },
  { 'max_window_layers', 'int>=0?', 28, 'its layers (unused)' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'bos_token_id', 'ids?', nil, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', nil, 'end of sequence' },
  { 'decoder_sparse_step', 'int>0', 1, 'every decoder_sparse_step-th layer is sparse' },
  { 'mlp_only_layers', 'ids?', nil, 'layers (0-based) kept dense' },
  { 'num_experts', 'int>0', 128, 'experts in each sparse layer' },
  { 'num_experts_per_tok', 'int>0', 8, 'experts each token goes to (top-k)' },
  { 'norm_topk_prob', 'bool', false, 'renormalise the top-k scores to sum 1' },
  { 'output_router_logits', 'bool', false, 'add the load-balancing loss to the training loss' },
  { 'router_aux_loss_coef', 'number>=0', 0.001, 'its weight' },
}
qwen3_moe.config = hf.defaults(qwen3_moe.fields)

qwen3_moe.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes: 8 experts,
  -- 2 a token, the second of its 4 layers dense
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, moe_intermediate_size = 96,
           num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 32,
           max_position_embeddings = 256, num_experts = 8, num_experts_per_tok = 2, norm_topk_prob = true,
           mlp_only_layers = { 1 }, output_router_logits = true, router_aux_loss_coef = 0.02 },
}

qwen3_moe.normalize = function(cfg)
  llama.normalize(cfg)
  if type(cfg.mlp_only_layers) == 'number' then cfg.mlp_only_layers = { cfg.mlp_only_layers } end
  if cfg.mlp_only_layers == hf.null then cfg.mlp_only_layers = nil end
end
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
qwen3_moe.fsdp_block = 'LlamaDecoderLayer'

-- whether layer idx (0-based) is sparse (its MLP a mixture of experts), as
-- transformers decides it (Qwen2-MoE's layers too)
function qwen3_moe.sparse(cfg, idx)
  for _, i in ipairs(cfg.mlp_only_layers or {}) do if i == idx then return false end end
  return cfg.num_experts > 0 and (idx + 1) % cfg.decoder_sparse_step == 0
end
-- what its layers change in Llama's: q and k normalised per head; a
-- sparse layer's mlp a mixture of experts
llama.variants.qwen3_moe = {
  qk_norm = true,
  mlp = function(cfg, idx)
    if not qwen3_moe.sparse(cfg, idx) then
      return 'mlp', nn.GatedMLP { dim = cfg.hidden_size, hidden = cfg.intermediate_size }
    end
    return 'mlp', nn.MoE { dim = cfg.hidden_size, hidden = cfg.moe_intermediate_size, experts = cfg.num_experts,
      top_k = cfg.num_experts_per_tok, norm_topk = cfg.norm_topk_prob, router = 'gate' }
  end,
}

-- qwen3_moe.entry_points(fam, arch): the entry points a Qwen MoE family
-- (`fam`, with its name, fields and variant) shares with this one: check,
-- prepare, and llama.decoder_family's (config.json for architecture `arch`,
-- mlp_only_layers null when unset)
function qwen3_moe.entry_points(fam, arch)
  function fam.check(cfg)
    llama.check(cfg)
    if cfg.num_experts_per_tok > cfg.num_experts then
      error(('%s config: num_experts_per_tok %d is more than num_experts %d'):format(fam.name,
        cfg.num_experts_per_tok, cfg.num_experts), 3)
    end
    if cfg.use_sliding_window then
      error(fam.name .. ' config: use_sliding_window is not supported (full causal attention only)', 3)
    end
  end
  -- (the routers' biases of a --moe-bias-rate run: models/mixtral.lua)
  fam.prepare = require('models.mixtral').prepare
  return llama.decoder_family(fam, arch, function(cfg)
    if cfg.mlp_only_layers == nil then cfg.mlp_only_layers = hf.null end
  end)
end
qwen3_moe.entry_points(qwen3_moe, 'Qwen3MoeForCausalLM')
return qwen3_moe
