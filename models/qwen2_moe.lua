-- models/qwen2_moe.lua — Qwen2-MoE (Qwen1.5-MoE-A2.7B's and
-- Qwen2-57B-A14B's architecture), as Hugging Face's Qwen2MoeForCausalLM:
-- Llama's decoder (models/llama.lua) with
--   * biases on the q, k and v projections (qkv_bias), none on o;
--   * the MLP of every decoder_sparse_step-th layer (but mlp_only_layers) a
--     mixture of num_experts SwiGLU experts of moe_intermediate_size
--     (mlp.gate, mlp.experts.N.gate_proj / up_proj / down_proj; nn.MoE,
--     docs/moe.md), num_experts_per_tok a token (softmax scores, the top-k
--     renormalised when norm_topk_prob), plus a shared expert of
--     shared_expert_intermediate_size that every token goes through,
--     weighted by sigmoid(x · shared_expert_gate) (mlp.shared_expert,
--     mlp.shared_expert_gate); the others a dense MLP of intermediate_size.
-- The same config.json fields and parameter names; with
-- output_router_logits the loss adds router_aux_loss_coef times the
-- load-balancing loss over every sparse layer's tokens, as transformers.
--
--   local qwen2_moe = require 'models.qwen2_moe'
--   local model = qwen2_moe.new('tiny')
local nn = require 'moonshard.nn'
local hf = require 'models.hf'
local llama = require 'models.llama'

local qwen2_moe = { name = 'qwen2_moe', model_type = 'qwen2_moe' }

-- Config fields: Qwen2MoeConfig's, with its defaults.
qwen2_moe.fields = {
  { 'model_type', { 'qwen2_moe' }, 'qwen2_moe', 'always qwen2_moe' },
  { 'vocab_size', 'int>0', 151936, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 2048, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 5632, 'width of a dense layer\'s gated MLP' },
  { 'moe_intermediate_size', 'int>0', 1408, 'width of each routed expert\'s gated MLP' },
  { 'shared_expert_intermediate_size', 'int>0', 5632, 'width of the shared expert\'s gated MLP' },
  { 'num_hidden_layers', 'int>0', 24, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 16, 'query heads' },
  { 'num_key_value_heads', 'int>0?', 16, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', nil, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 32768, 'longest sequence' },
  { 'rms_norm_eps', 'number>0', 1e-6, 'RMSNorm epsilon' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0 },
    'RoPE: rope_theta (rope_type default only)' },
  { 'qkv_bias', 'bool', true, 'biases on the q, k and v projections (o has none)' },
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
  { 'num_experts', 'int>0', 60, 'routed experts in each sparse layer' },
  { 'num_experts_per_tok', 'int>0', 4, 'routed experts each token goes to (top-k)' },
  { 'norm_topk_prob', 'bool', false, 'renormalise the top-k scores to sum 1' },
  { 'output_router_logits', 'bool', false, 'add the load-balancing loss to the training loss' },
  { 'router_aux_loss_coef', 'number>=0', 0.001, 'its weight' },
}
qwen2_moe.config = hf.defaults(qwen2_moe.fields)

qwen2_moe.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes: 8 routed
  -- experts, 2 a token, and the shared one; the second of its 4 layers dense
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, moe_intermediate_size = 96,
           shared_expert_intermediate_size = 192, num_hidden_layers = 4, num_attention_heads = 4,
           num_key_value_heads = 2, max_position_embeddings = 256, num_experts = 8, num_experts_per_tok = 2,
           mlp_only_layers = { 1 }, output_router_logits = true, router_aux_loss_coef = 0.02 },
}

local qwen3_moe = require 'models.qwen3_moe'
qwen2_moe.normalize = qwen3_moe.normalize
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
qwen2_moe.fsdp_block = 'LlamaDecoderLayer'

-- what its layers change in Llama's: q/k/v biases without o's; a sparse
-- layer's (placed as Qwen3-MoE's) mlp a mixture of experts with a gated
-- shared expert
llama.variants.qwen2_moe = {
  attention = function(cfg) return { bias = cfg.qkv_bias, o_bias = false } end,
  mlp = function(cfg, idx)
    if not qwen3_moe.sparse(cfg, idx) then
      return 'mlp', nn.GatedMLP { dim = cfg.hidden_size, hidden = cfg.intermediate_size }
    end
    return 'mlp', nn.MoE { dim = cfg.hidden_size, hidden = cfg.moe_intermediate_size, experts = cfg.num_experts,
      top_k = cfg.num_experts_per_tok, norm_topk = cfg.norm_topk_prob, router = 'gate',
      shared_hidden = cfg.shared_expert_intermediate_size, shared = 'shared_expert', shared_gate = 'shared_expert_gate' }
  end,
}

-- check, build, new, from_pretrained, export_config (Qwen2MoeForCausalLM's
-- config.json), as Qwen3-MoE's
qwen3_moe.entry_points(qwen2_moe, 'Qwen2MoeForCausalLM')
return qwen2_moe
