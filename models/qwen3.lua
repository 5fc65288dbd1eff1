-- models/qwen3.lua — Qwen3 (dense), as Hugging Face's Qwen3ForCausalLM:
-- Llama's decoder (models/llama.lua) with q and k each RMS-normalised per
-- head before RoPE (self_attn.q_norm, self_attn.k_norm), head_dim given
-- apart from the width, and biases on every attention projection when
-- attention_bias. The same config.json fields and parameter names;
-- sliding-window attention is refused (the released models train with it
-- off). Its mixture-of-experts sibling is models/qwen3_moe.lua.
--
--   local qwen3 = require 'models.qwen3'
--   local model = qwen3.new('tiny')
--   local model = qwen3.from_pretrained('path/to/Qwen3-0.6B')
local hf = require 'models.hf'
local llama = require 'models.llama'

local qwen3 = { name = 'qwen3', model_type = 'qwen3' }

-- Config fields: Qwen3Config's, with its defaults.
qwen3.fields = {
  { 'model_type', { 'qwen3' }, 'qwen3', 'always qwen3' },
  { 'vocab_size', 'int>0', 151936, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 4096, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 22016, 'width of the gated MLP' },
  { 'num_hidden_layers', 'int>0', 32, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 32, 'query heads' },
  { 'num_key_value_heads', 'int>0?', 32, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', 128, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 32768, 'longest sequence' },
  { 'rms_norm_eps', 'number>0', 1e-6, 'RMSNorm epsilon (the q and k norms too)' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0 },
    'RoPE: rope_theta (rope_type default only)' },
  { 'attention_bias', 'bool', false, 'biases on q/k/v/o projections' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities (not applied here)' },
  { 'use_sliding_window', 'bool', false, 'sliding-window attention: not supported (false only)' },
  { 'sliding_window', 'int>0?', 4096, 'its window (unused)' },
  { 'max_window_layers', 'int>=0?', 28, 'its layers (unused)' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'bos_token_id', 'ids?', nil, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', nil, 'end of sequence' },
}
qwen3.config = hf.defaults(qwen3.fields)

qwen3.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes: heads of 32
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, num_hidden_layers = 4,
           num_attention_heads = 4, num_key_value_heads = 2, head_dim = 32, max_position_embeddings = 256 },
}

qwen3.normalize = llama.normalize
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
qwen3.fsdp_block = 'LlamaDecoderLayer'

-- what its layers change in Llama's: q and k normalised per head
llama.variants.qwen3 = { qk_norm = true }

function qwen3.check(cfg)
  llama.check(cfg)
  if cfg.use_sliding_window then
    error('qwen3 config: use_sliding_window is not supported (full causal attention only)', 3)
  end
end

-- build, new, from_pretrained, fix_state_dict, and export_config
-- (Qwen3ForCausalLM's config.json)
llama.decoder_family(qwen3, 'Qwen3ForCausalLM')
return qwen3
