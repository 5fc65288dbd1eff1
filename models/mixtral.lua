-- models/mixtral.lua — Mixtral (Jiang et al. 2024), as Hugging Face's
-- MixtralForCausalLM: Llama's decoder (models/llama.lua) with each layer's
-- MLP a sparse mixture of experts (nn.MoE, docs/moe.md): a router
-- (block_sparse_moe.gate) scores num_local_experts SwiGLU experts
-- (block_sparse_moe.experts.N.w1 / w3 / w2: gate, up, down) with a softmax
-- in f32, each token goes to its num_experts_per_tok best, weighted by
-- their renormalised scores. The same config.json fields and parameter
-- names; with output_router_logits the training loss adds
-- router_aux_loss_coef times the load-balancing loss over every layer's
-- tokens, as transformers does.
--
--   local mixtral = require 'models.mixtral'
--   local model = mixtral.new('tiny')
--   local loss = model(input_ids, targets)
local nn = require 'moonshard.nn'
local hf = require 'models.hf'
local llama = require 'models.llama'

local mixtral = { name = 'mixtral', model_type = 'mixtral' }

-- Config fields: Llama's, with MixtralConfig's defaults (Mixtral 8x7B
-- shapes), and the experts'.
mixtral.fields = {
  { 'model_type', { 'mixtral' }, 'mixtral', 'always mixtral' },
  { 'vocab_size', 'int>0', 32000, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 4096, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 14336, 'width of each expert\'s gated MLP' },
  { 'num_hidden_layers', 'int>0', 32, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 32, 'query heads' },
  { 'num_key_value_heads', 'int>0?', 8, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', nil, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 131072, 'longest sequence' },
  { 'rms_norm_eps', 'number>0', 1e-5, 'RMSNorm epsilon' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 1000000.0 },
    'RoPE: rope_theta (rope_type default only)' },
  { 'sliding_window', 'int>0?', nil, 'sliding-window attention: not supported (nil only)' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'bos_token_id', 'ids?', 1, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', 2, 'end of sequence' },
  { 'num_local_experts', 'int>0', 8, 'experts in each layer' },
  { 'num_experts_per_tok', 'int>0', 2, 'experts each token goes to (top-k)' },
  { 'output_router_logits', 'bool', false, 'add the load-balancing loss to the training loss' },
  { 'router_aux_loss_coef', 'number>=0', 0.001, 'its weight' },
  { 'router_jitter_noise', 'number>=0', 0.0, 'multiplicative noise on the router\'s input: not supported (0 only)' },
}
mixtral.config = hf.defaults(mixtral.fields)

mixtral.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes: 4 experts,
  -- 2 a token, the load-balancing loss on
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 176, num_hidden_layers = 4,
           num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 256,
           num_local_experts = 4, num_experts_per_tok = 2, output_router_logits = true,
           router_aux_loss_coef = 0.02, bos_token_id = hf.null, eos_token_id = hf.null },
}

mixtral.normalize = llama.normalize
-- a layer's MLP: the mixture of experts, under HF's names
llama.variants.mixtral = {
  mlp = function(cfg)
    return 'block_sparse_moe', nn.MoE { dim = cfg.hidden_size, hidden = cfg.intermediate_size,
      experts = cfg.num_local_experts, top_k = cfg.num_experts_per_tok, names = { 'w1', 'w3', 'w2' }, router = 'gate' }
  end,
}
-- bin/train's FSDP units and checkpointed blocks: the decoder layers (each
-- holds its experts whole: every rank gathers them, whatever its tokens chose)
mixtral.fsdp_block = 'LlamaDecoderLayer'

function mixtral.check(cfg)
  llama.check(cfg)
  if cfg.num_experts_per_tok > cfg.num_local_experts then
    error(('mixtral config: num_experts_per_tok %d is more than num_local_experts %d'):format(cfg.num_experts_per_tok,
      cfg.num_local_experts), 3)
  end
  if cfg.sliding_window ~= nil and cfg.sliding_window ~= hf.null then
    error(('mixtral config: sliding_window %s is not supported (full causal attention only; set it to null)'):format(
      tostring(cfg.sliding_window)), 3)
  end
  if cfg.router_jitter_noise ~= 0 then
    error(('mixtral config: router_jitter_noise %s is not supported (0 only)'):format(tostring(cfg.router_jitter_noise)),
      3)
  end
end

-- build, new, from_pretrained, fix_state_dict, and export_config
-- (MixtralForCausalLM's config.json: sliding_window null when unset)
llama.decoder_family(mixtral, 'MixtralForCausalLM', function(cfg)
  if cfg.sliding_window == nil then cfg.sliding_window = hf.null end
end)

-- a folder saved by a run with --moe-bias-rate holds the routers' biases
-- (expert_bias): the model gets them before the load
function mixtral.prepare(model, sd)
  for name in pairs(sd) do
    if name:match('%.expert_bias$') then nn.moe.enable_bias(model); return end
  end
end

-- the MoE layers of a model, in order (nn.moe.layers)
function mixtral.moe_layers(model) return nn.moe.layers(model) end

return mixtral
