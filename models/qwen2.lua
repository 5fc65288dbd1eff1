-- models/qwen2.lua — Qwen2 and Qwen2.5 (dense), as Hugging Face's
-- Qwen2ForCausalLM: Llama's decoder (models/llama.lua) with biases on the
-- q, k and v projections (none on o). The same config.json fields and
-- parameter names; sliding-window attention is refused (the released
-- models train with it off).
--
--   local qwen2 = require 'models.qwen2'
--   local model = qwen2.new('tiny')
--   local model = qwen2.from_pretrained('path/to/Qwen2.5-0.5B')
local hf = require 'models.hf'
local llama = require 'models.llama'

local qwen2 = { name = 'qwen2', model_type = 'qwen2' }

-- Config fields: Qwen2Config's, with its defaults.
qwen2.fields = {
  { 'model_type', { 'qwen2' }, 'qwen2', 'always qwen2' },
  { 'vocab_size', 'int>0', 151936, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 4096, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 22016, 'width of the gated MLP' },
  { 'num_hidden_layers', 'int>0', 32, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 32, 'query heads' },
  { 'num_key_value_heads', 'int>0?', 32, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', nil, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 32768, 'longest sequence' },
  { 'rms_norm_eps', 'number>0', 1e-6, 'RMSNorm epsilon' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0 },
    'RoPE: rope_theta (rope_type default only)' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities (not applied here)' },
  { 'use_sliding_window', 'bool', false, 'sliding-window attention: not supported (false only)' },
  { 'sliding_window', 'int>0?', 4096, 'its window (unused)' },
  { 'max_window_layers', 'int>=0?', 28, 'its layers (unused)' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'bos_token_id', 'ids?', nil, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', nil, 'end of sequence' },
}
qwen2.config = hf.defaults(qwen2.fields)

qwen2.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, num_hidden_layers = 4,
           num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 256 },
}

qwen2.normalize = llama.normalize
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
qwen2.fsdp_block = 'LlamaDecoderLayer'

-- what its layers change in Llama's: q/k/v biases, none on o
llama.variants.qwen2 = {
  attention = function() return { bias = true, o_bias = false } end,
}

function qwen2.check(cfg)
  llama.check(cfg)
  if cfg.use_sliding_window then
    error('qwen2 config: use_sliding_window is not supported (full causal attention only)', 3)
  end
end

-- build, new, from_pretrained, fix_state_dict, and export_config
-- (Qwen2ForCausalLM's config.json)
llama.decoder_family(qwen2, 'Qwen2ForCausalLM')
return qwen2
