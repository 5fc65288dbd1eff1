-- models/mistral.lua — Mistral (Mistral 7B, Mistral NeMo, Ministral and
-- Mistral Small's text models), as Hugging Face's MistralForCausalLM:
-- Llama's decoder (models/llama.lua) with head_dim given apart from the
-- width and an optional sliding window (sliding_window: each token sees
-- itself and the sliding_window - 1 tokens before it; null in the later
-- models). The same config.json fields and parameter names. A sequence
-- longer than the window runs the unfused attention with the window's
-- mask (the fused kernels take no window); context parallelism refuses a
-- window by name.
--
--   local mistral = require 'models.mistral'
--   local model = mistral.new('tiny')
--   local model = mistral.from_pretrained('path/to/Mistral-7B-v0.3')
local hf = require 'models.hf'
local llama = require 'models.llama'

local mistral = { name = 'mistral', model_type = 'mistral' }

-- Config fields: MistralConfig's, with its defaults.
mistral.fields = {
  { 'model_type', { 'mistral' }, 'mistral', 'always mistral' },
  { 'vocab_size', 'int>0', 32000, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 4096, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 14336, 'width of the gated MLP' },
  { 'num_hidden_layers', 'int>0', 32, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 32, 'query heads' },
  { 'num_key_value_heads', 'int>0?', 8, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', nil, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 131072, 'longest sequence' },
  { 'rms_norm_eps', 'number>0', 1e-6, 'RMSNorm epsilon' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0 },
    'RoPE: rope_theta; rope_type default, linear, llama3 or yarn as Llama\'s' },
  { 'sliding_window', 'int>0?', nil, 'sliding-window attention\'s window (Mistral 7B v0.1: 4096); nil: none' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities (not applied here)' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'bos_token_id', 'ids?', 1, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', 2, 'end of sequence' },
}
mistral.config = hf.defaults(mistral.fields)

mistral.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes (a window of
  -- 64 over 256 positions)
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, num_hidden_layers = 4,
           num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 256, sliding_window = 64,
           bos_token_id = hf.null, eos_token_id = hf.null },
  -- Mistral 7B v0.3's shapes (its vocabulary of 32768, no window)
  ['mistral-7b'] = { vocab_size = 32768, hidden_size = 4096, intermediate_size = 14336, num_hidden_layers = 32,
           num_attention_heads = 32, num_key_value_heads = 8, head_dim = 128, max_position_embeddings = 32768,
           rope_parameters = { rope_type = 'default', rope_theta = 1000000.0 }, rms_norm_eps = 1e-5 },
}

mistral.normalize = llama.normalize
mistral.check = llama.check
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
mistral.fsdp_block = 'LlamaDecoderLayer'

-- what its layers change in Llama's: the window
llama.variants.mistral = {
  attention = function(cfg) return { bias = false, window = cfg.sliding_window } end,
}

-- build, new, from_pretrained, fix_state_dict, and export_config
-- (MistralForCausalLM's config.json; sliding_window written as null when
-- there is none)
llama.decoder_family(mistral, 'MistralForCausalLM', function(cfg)
  if cfg.sliding_window == nil then cfg.sliding_window = hf.null end
end)
return mistral
