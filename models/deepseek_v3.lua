-- models/deepseek_v3.lua — DeepSeek-V3 (DeepSeek-AI 2024), as Hugging
-- Face's DeepseekV3ForCausalLM: Llama's decoder (models/llama.lua) with
--   * multi-head latent attention (self_attn: q_a_proj, q_a_layernorm,
--     q_b_proj (or q_proj without q_lora_rank), kv_a_proj_with_mqa,
--     kv_a_layernorm, kv_b_proj, o_proj; nn.MLAttention), RoPE on
--     qk_rope_head_dim of each head's qk_nope_head_dim + qk_rope_head_dim,
--     interleaved (rope_interleave), default or YaRN (rope_parameters);
--   * the MLP of the first first_k_dense_replace layers dense
--     (intermediate_size), the others a mixture of n_routed_experts SwiGLU
--     experts of moe_intermediate_size (mlp.gate, mlp.experts.N.gate_proj /
--     up_proj / down_proj; nn.MoE, docs/moe.md): sigmoid scores, the
--     routing bias mlp.gate.e_score_correction_bias added to choose the
--     experts, group-limited routing (n_group groups, topk_group of them, a
--     group scored by its two best), num_experts_per_tok a token, weights
--     renormalised (norm_topk_prob) and scaled by routed_scaling_factor;
--     plus n_shared_experts shared experts as one MLP
--     (mlp.shared_experts).
-- The same config.json fields and parameter names as transformers'. No
-- auxiliary loss unless aux_loss_alpha > 0 (transformers has none): balance
-- with --moe-bias-rate, which moves the routing biases, and with
-- aux_loss_alpha the report's complementary sequence-wise balance loss
-- (eq. 17-20: f_i counts each token's k best plain scores, without the
-- routing bias or the group limit; s' the sigmoid scores over their sum;
-- docs/moe.md). The multi-token-prediction
-- layers (num_nextn_predict_layers) are not built, and a checkpoint's are
-- skipped on load, as transformers skips them, unless mtp_loss_weight > 0
-- (ours): then they are built and trained (below, "Multi-token
-- prediction").
--
--   local deepseek_v3 = require 'models.deepseek_v3'
--   local model = deepseek_v3.new('tiny')
--   local loss = model(input_ids, targets)
local nn = require 'moonshard.nn'
local T = require 'moonshard.tensor'
local A = require 'moonshard.autograd'
local F = require 'moonshard.ops'
local hf = require 'models.hf'
local llama = require 'models.llama'

local deepseek_v3 = { name = 'deepseek_v3', model_type = 'deepseek_v3' }

-- Config fields: DeepseekV3Config's, with its defaults (DeepSeek-V3's
-- shapes), but for the four that may be null: those default to null here
-- (a null in config.json reads as an absent field), and the preset
-- 'deepseek-v3' has transformers' values (q_lora_rank 1536, n_group 8,
-- topk_group 4, num_key_value_heads 128).
deepseek_v3.fields = {
  { 'model_type', { 'deepseek_v3' }, 'deepseek_v3', 'always deepseek_v3' },
  { 'vocab_size', 'int>0', 129280, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 7168, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 18432, 'width of a dense layer\'s gated MLP' },
  { 'moe_intermediate_size', 'int>0', 2048, 'width of each expert\'s gated MLP' },
  { 'num_hidden_layers', 'int>0', 61, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 128, 'attention heads' },
  { 'num_key_value_heads', 'int>0?', nil, 'must equal num_attention_heads (each head has its keys); nil: the same' },
  { 'n_shared_experts', 'int>=0', 1, 'shared experts, one MLP of n_shared_experts x moe_intermediate_size (0: none)' },
  { 'n_routed_experts', 'int>0', 256, 'routed experts in each sparse layer' },
  { 'routed_scaling_factor', 'number>0', 2.5, 'the routing weights\' multiplier' },
  { 'kv_lora_rank', 'int>0', 512, 'width of the compressed keys and values' },
  { 'q_lora_rank', 'int>0?', nil, 'width of the compressed queries; nil: q_proj, no compression' },
  { 'qk_rope_head_dim', 'int>0', 64, 'width of the rotary part of each head\'s q and k' },
  { 'v_head_dim', 'int>0', 128, 'width of each head\'s values' },
  { 'qk_nope_head_dim', 'int>0', 128, 'width of the non-rotary part of each head\'s q and k' },
  { 'n_group', 'int>0?', nil, 'expert groups (group-limited routing); nil: 1' },
  { 'topk_group', 'int>0?', nil, 'groups each token picks; nil: 1' },
  { 'num_experts_per_tok', 'int>0', 8, 'experts each token goes to (top-k)' },
  { 'first_k_dense_replace', 'int>=0', 3, 'the first layers that keep a dense MLP' },
  { 'norm_topk_prob', 'bool', true, 'renormalise the top-k scores to sum 1' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 4096, 'longest sequence' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'rms_norm_eps', 'number>0', 1e-6, 'RMSNorm epsilon of the layers\' and the final norms' },
  { 'bos_token_id', 'ids?', 0, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', 1, 'end of sequence' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0 },
    'RoPE: rope_theta; rope_type default or yarn (factor, original_max_position_embeddings, beta_fast, beta_slow, '
      .. 'mscale, mscale_all_dim, attention_factor, truncate)' },
  { 'rope_interleave', 'bool', true, 'the rotary dimensions in (even, odd) pairs, as DeepSeek\'s checkpoints' },
  { 'attention_bias', 'bool', false, 'biases on q_a_proj, kv_a_proj_with_mqa and o_proj' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities (not applied here)' },
  { 'num_nextn_predict_layers', 'int>=0', 1, 'multi-token-prediction depths (built when mtp_loss_weight > 0, else '
    .. 'skipped on load, as transformers does)' },
  { 'mtp_loss_weight', 'number>=0', 0, 'ours (DeepSeek-V3\'s lambda): above 0 builds the num_nextn_predict_layers '
    .. 'multi-token-prediction modules and adds this weight / their number times the sum of their losses; 0: none' },
  { 'aux_loss_alpha', 'number>=0', 0, 'DeepSeek\'s configs\' field: above 0 the training loss (training mode) adds '
    .. 'this times the sequence-wise balance loss of every MoE layer (DeepSeek-V3\'s complementary loss; its '
    .. 'training used 0.0001, its config.json says 0.001); 0 (the default here): none (docs/moe.md)' },
  { 'seq_aux', 'bool', true, 'DeepSeek\'s configs\' field: the balance loss per sequence (true) or over each '
    .. 'forward\'s tokens at once (false)' },
}
deepseek_v3.config = hf.defaults(deepseek_v3.fields)

deepseek_v3.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes: the first of
  -- its 4 layers dense, 8 routed experts in 4 groups (2 groups a token, 2
  -- experts a token) and a shared one; q/k heads of 32 + 32, values of 32
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, moe_intermediate_size = 64,
           num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 4, n_shared_experts = 1,
           n_routed_experts = 8, routed_scaling_factor = 2.5, kv_lora_rank = 64, q_lora_rank = 96,
           qk_rope_head_dim = 32, v_head_dim = 32, qk_nope_head_dim = 32, n_group = 4, topk_group = 2,
           num_experts_per_tok = 2, first_k_dense_replace = 1, max_position_embeddings = 256, rms_norm_eps = 1e-5,
           bos_token_id = hf.null, eos_token_id = hf.null },
}
-- DeepSeek-V3's shapes (671B parameters, 37B a token; its YaRN context
-- extension not included: give rope_parameters for it)
deepseek_v3.presets['deepseek-v3'] = { q_lora_rank = 1536, n_group = 8, topk_group = 4, num_key_value_heads = 128 }

-- Older configs (transformers < 5, DeepSeek's own) put rope_theta at the
-- top level and the YaRN parameters in rope_scaling (with `type`), read as
-- Llama's (llama.normalize), and may name the experts num_local_experts and
-- the MTP layers num_mtp_layers.
function deepseek_v3.normalize(cfg)
  llama.normalize(cfg)
  cfg.rope_parameters.rope_type = cfg.rope_parameters.rope_type or 'default'
  local function absent(v) return v == nil or v == hf.null end
  if absent(cfg.n_routed_experts) and not absent(cfg.num_local_experts) then cfg.n_routed_experts = cfg.num_local_experts end
  if absent(cfg.num_nextn_predict_layers) and not absent(cfg.num_mtp_layers) then
    cfg.num_nextn_predict_layers = cfg.num_mtp_layers
  end
  cfg.num_local_experts, cfg.num_mtp_layers = nil, nil
  if cfg.n_group == hf.null then cfg.n_group = nil end
  if cfg.topk_group == hf.null then cfg.topk_group = nil end
end

-- A config's checks in two parts, each naming the model (name): the
-- latent attention's (RoPE default or YaRN, a key per head, an even rotary
-- width; DeepSeek-V2's too) and the router's (groups that split the
-- experts, enough experts in the kept groups; group_score 'top2' scores a
-- group by its two best, so groups of one are refused; V2's 'max' and
-- GLM-4.5's 'top2' routers call it too)
local function cfg_error(name, fmt, ...) error((name .. ' config: ' .. fmt):format(...), 4) end
function deepseek_v3.check_latent(cfg, name)
  local rp = cfg.rope_parameters
  local rt = rp.rope_type or 'default'
  if rt ~= 'default' and rt ~= 'yarn' then
    cfg_error(name, 'rope_parameters.rope_type %s is not supported (default or yarn)', tostring(rt))
  end
  if type(rp.rope_theta) ~= 'number' or rp.rope_theta <= 0 then
    cfg_error(name, 'rope_parameters.rope_theta must be a positive number, got %s', tostring(rp.rope_theta))
  end
  if rt == 'yarn' then
    local o = rp.original_max_position_embeddings
    if type(o) ~= 'number' or o <= 0 then
      cfg_error(name, 'yarn RoPE needs rope_parameters.original_max_position_embeddings, got %s', tostring(o))
    end
    -- (as transformers: no factor means the ratio of the two contexts)
    if rp.factor == nil or rp.factor == hf.null then rp.factor = cfg.max_position_embeddings / o end
    if type(rp.factor) ~= 'number' or rp.factor <= 0 then
      cfg_error(name, 'rope_parameters.factor must be a positive number, got %s', tostring(rp.factor))
    end
  end
  local nh = cfg.num_attention_heads
  if cfg.num_key_value_heads ~= nil and cfg.num_key_value_heads ~= nh then
    cfg_error(name, 'num_key_value_heads (%d) must equal num_attention_heads (%d): latent attention gives every head '
      .. 'its keys', cfg.num_key_value_heads, nh)
  end
  if cfg.qk_rope_head_dim % 2 ~= 0 then
    cfg_error(name, 'qk_rope_head_dim (%d) must be even for RoPE', cfg.qk_rope_head_dim)
  end
end
-- (G, TG: the groups and the kept ones; nil: 1)
function deepseek_v3.check_router(cfg, name, group_score, G, TG)
  local E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  G, TG = G or 1, TG or 1
  if E % G ~= 0 then cfg_error(name, 'n_routed_experts %d do not split into n_group = %d groups', E, G) end
  if G > 1 and E / G < 2 and group_score == 'top2' then
    cfg_error(name, 'n_group = %d leaves groups of %d expert; a group is scored by its two best', G, E / G)
  end
  if TG > G then cfg_error(name, 'topk_group %d is more than n_group %d', TG, G) end
  if k > TG * E / G then
    cfg_error(name, 'num_experts_per_tok %d is more than the %d experts of topk_group = %d groups', k, TG * E / G, TG)
  end
end
function deepseek_v3.check(cfg)
  deepseek_v3.check_latent(cfg, 'deepseek_v3')
  deepseek_v3.check_router(cfg, 'deepseek_v3', 'top2', cfg.n_group, cfg.topk_group)
end

-- the RoPE of cfg (a theta, or nnf.yarn_rope's table: llama.rope over the
-- qk_rope_head_dim rotary dimensions) and the attention's softmax scale
-- (qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)² when
-- rope_type is yarn and mscale_all_dim is set, as transformers'
-- DeepseekV3Attention)
function deepseek_v3.rope(cfg) return llama.rope(cfg, cfg.qk_rope_head_dim) end
function deepseek_v3.softmax_scale(cfg)
  local s = 1 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
  local rp = cfg.rope_parameters
  local m = rp.mscale_all_dim
  if (rp.rope_type or 'default') ~= 'default' and m and m ~= 0 and rp.factor > 1 then
    local ms = 0.1 * m * math.log(rp.factor) + 1
    s = s * ms * ms
  end
  return s
end

-- what its layers change in Llama's: latent attention; the MLP of a layer
-- past the first first_k_dense_replace a mixture of experts
llama.variants.deepseek_v3 = {
  self_attn = function(cfg)
    return nn.MLAttention { dim = cfg.hidden_size, n_head = cfg.num_attention_heads, q_lora_rank = cfg.q_lora_rank,
      kv_lora_rank = cfg.kv_lora_rank, qk_nope_head_dim = cfg.qk_nope_head_dim, qk_rope_head_dim = cfg.qk_rope_head_dim,
      v_head_dim = cfg.v_head_dim, bias = cfg.attention_bias, rope = deepseek_v3.rope(cfg),
      rope_interleave = cfg.rope_interleave, scale = deepseek_v3.softmax_scale(cfg) }
  end,
  mlp = function(cfg, idx)
    if idx < cfg.first_k_dense_replace then
      return 'mlp', nn.GatedMLP { dim = cfg.hidden_size, hidden = cfg.intermediate_size }
    end
    local ns = cfg.n_shared_experts
    return 'mlp', nn.MoE { dim = cfg.hidden_size, hidden = cfg.moe_intermediate_size, experts = cfg.n_routed_experts,
      top_k = cfg.num_experts_per_tok, score = 'sigmoid', norm_topk = cfg.norm_topk_prob,
      route_scale = cfg.routed_scaling_factor, n_group = cfg.n_group or 1, topk_group = cfg.topk_group or 1,
      group_score = 'top2', router = 'gate', router_bias = true,
      shared_hidden = ns > 0 and ns * cfg.moe_intermediate_size or nil, shared = 'shared_experts' }
  end,
}
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
deepseek_v3.fsdp_block = 'LlamaDecoderLayer'
-- the sequence-wise balance loss's f_i counts each token's k best plain
-- scores (the report's eq. 18: no routing bias, no group limit), as
-- Megatron-LM's DeepSeek-V3 recipe does (llama.seq_aux_begin)
deepseek_v3.seq_aux_choice = 'scores'

-- build, new, from_pretrained, and export_config (DeepseekV3ForCausalLM's
-- config.json; rope_theta also at the top level, and YaRN's parameters in
-- rope_scaling, where transformers < 5 reads them)
-- (V2's too: models/deepseek_v2.lua)
function deepseek_v3.export_extra(cfg)
  cfg.head_dim = cfg.qk_rope_head_dim
  cfg.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  if cfg.q_lora_rank == nil then cfg.q_lora_rank = hf.null end
  local rp = cfg.rope_parameters
  if (rp.rope_type or 'default') ~= 'default' then
    local rs = {}
    for k, v in pairs(rp) do if k ~= 'rope_theta' and k ~= 'rope_type' then rs[k] = v end end
    rs.type, rs.rope_type = rp.rope_type, rp.rope_type
    cfg.rope_scaling = rs
  end
end
llama.decoder_family(deepseek_v3, 'DeepseekV3ForCausalLM', deepseek_v3.export_extra)

-- FP8 block-quantised checkpoints (DeepSeek's own: quantization_config
-- {quant_method = 'fp8', fmt = 'e4m3', weight_block_size = {128, 128}}):
-- a weight W (R, C) in f8e4m3 beside W_scale_inv (ceil(R / b0), ceil(C /
-- b1)) means W[i][j] * W_scale_inv[i // b0][j // b1] (in f32).
-- deepseek_v3.dequantize(w, s, block, first, n) -> f32 (n): elements
-- first .. first + n - 1 (row-major) of that product; w and s tensors, or
-- deferred ones (a checkpoint read lazily: only the rows asked for are read)
function deepseek_v3.dequantize(w, s, block, first, n)
  local R, C = w.shape[1], w.shape[2]
  first, n = first or 0, n or R * C
  if n == 0 then return T.empty({ 0 }, { dtype = 'f32' }) end
  local r0, r1 = math.floor(first / C), math.floor((first + n - 1) / C) + 1
  local nr = r1 - r0
  local rows
  if T.is_deferred(w) then
    rows = T.empty({ nr, C }, { dtype = w.dtype })
    T.replay(w, rows, r0 * C)
  else
    rows = w:narrow(1, r0 + 1, nr)
  end
  local sc = s
  if T.is_deferred(s) then sc = T.replay(s, T.empty(s.shape, { dtype = s.dtype })) end
  local b0, b1 = block[1], block[2]
  local ri, ci = {}, {}
  for r = r0, r1 - 1 do ri[#ri + 1] = math.floor(r / b0) end
  for c = 0, C - 1 do ci[#ci + 1] = math.floor(c / b1) end
  local ms = require 'moonshard'
  local sf = sc:to('f32'):index_select(1, ms.tensor(ri, { dtype = 'i64' })):index_select(2, ms.tensor(ci, { dtype = 'i64' }))
  local out = (rows:to('f32') * sf):reshape({ nr * C })
  if first ~= r0 * C or n ~= nr * C then out = out:narrow(1, first - r0 * C + 1, n):contiguous() end
  return out
end

-- A checkpoint's multi-token-prediction layers (model.layers.N for N from
-- num_hidden_layers on) are dropped, as transformers drops them, or read
-- into model.mtp_layers when the model has them (mtp_loss_weight > 0: the
-- copies of the embedding and the head each carries are dropped); FP8
-- block-quantised weights are dequantised (deepseek_v3.dequantize; lazily
-- when the tensors are deferred: --init-from under FSDP reads each rank's
-- rows only), and the config loses its quantization_config.
function deepseek_v3.fix_state_dict(sd, cfg)
  local L, mtp = cfg.num_hidden_layers, cfg.num_nextn_predict_layers or 0
  local qc = cfg.quantization_config
  local block = { 128, 128 }
  if type(qc) == 'table' and qc ~= hf.null then
    if qc.quant_method ~= nil and qc.quant_method ~= 'fp8' then
      error(('deepseek_v3: quantization_config.quant_method %s is not supported (fp8 block quantisation only)'):format(
        tostring(qc.quant_method)), 3)
    end
    if type(qc.weight_block_size) == 'table' then block = { qc.weight_block_size[1], qc.weight_block_size[2] } end
  end
  local scales = {}
  for name in pairs(sd) do if name:match('%.weight_scale_inv$') then scales[#scales + 1] = name end end
  for _, name in ipairs(scales) do
    local wname = name:gsub('_scale_inv$', '')
    local w, s = sd[wname], sd[name]
    if w == nil then error(('deepseek_v3: %s has no weight %s beside it'):format(name, wname), 3) end
    if w.dtype ~= 'f8e4m3' or w.ndim ~= 2 then
      error(('deepseek_v3: %s is %s (%s) beside %s: an FP8 block-quantised weight must be 2-D f8e4m3'):format(wname,
        w.dtype, table.concat(w.shape, 'x'), name), 3)
    end
    local R, C = w.shape[1], w.shape[2]
    local want = { math.ceil(R / block[1]), math.ceil(C / block[2]) }
    if s.ndim ~= 2 or s.shape[1] ~= want[1] or s.shape[2] ~= want[2] then
      error(('deepseek_v3: %s is %s; %s (%dx%d) in blocks of %dx%d needs %dx%d'):format(name, table.concat(s.shape, 'x'),
        wname, R, C, block[1], block[2], want[1], want[2]), 3)
    end
    if T.is_deferred(w) then
      sd[wname] = T.deferred_fn({ R, C }, 'f32', function(first, n) return deepseek_v3.dequantize(w, s, block, first, n) end)
    else
      sd[wname] = deepseek_v3.dequantize(w, s, block):reshape({ R, C })
    end
    sd[name] = nil
  end
  if #scales > 0 then cfg.quantization_config = nil end
  local keep = (cfg.mtp_loss_weight or 0) > 0
  local names = {}
  for name in pairs(sd) do names[#names + 1] = name end
  for _, name in ipairs(names) do
    local i, rest = name:match('^model%.layers%.(%d+)%.(.*)$')
    i = tonumber(i)
    if i and i >= L and i < L + mtp then
      local t = sd[name]
      sd[name] = nil
      if keep and rest ~= 'embed_tokens.weight' and rest ~= 'shared_head.head.weight' then
        sd[('model.mtp_layers.%d.%s'):format(i - L, rest)] = t
      end
    end
  end
  return llama.fix_state_dict(sd, cfg)
end


-- ------------------------------------------------- Multi-token prediction
-- DeepSeek-V3's MTP (its report, section 2.2), built when mtp_loss_weight
-- is above 0: D = num_nextn_predict_layers sequential modules. Module k
-- takes the hidden states h of depth k - 1 (the main model's after its
-- final norm for k = 1) at positions 0 .. T-1-k and the embeddings of the
-- tokens k further on, and gives
--   h_k = shared_head.norm(block(eh_proj([enorm(emb(t[i+k])); hnorm(h[i])])))
-- with block a decoder layer of the model's own kind (latent attention and
-- the MoE of the sparse layers), then logits through the model's head, the
-- head and embedding shared with the main model. Depth k at position i
-- predicts token i + k + 1 (the targets k places further); its loss is the
-- mean cross-entropy over its T - k positions' kept targets, and the
-- model's loss is the main one plus mtp_loss_weight / D times their sum.
-- The modules are model.mtp_layers.K, read from and saved as the
-- checkpoints' model.layers.(num_hidden_layers + K) (with the copies of
-- the embedding and the head written beside each, as DeepSeek's own, for
-- inference engines that read them there).
local MTPLayer = llama.Layer:extend('DeepseekV3MTPLayer')   -- (GLM-4.5's too: deepseek_v3.with_mtp)
deepseek_v3.MTPLayer = MTPLayer
-- (moonshard.tp: eh_proj stays whole on every rank (replicated). Its input
-- is the concatenation of two replicated (or, under sequence parallelism,
-- row-split) streams and its output enters the block, which splits by
-- heads and experts itself: column-parallel it would need an all-gather of
-- its output in forward and an all-reduce of its 2C-wide input's gradient
-- in backward (Megatron-LM's choice), row-parallel an all-reduce of its
-- output; replicated it costs no collective, runs on 1/N of the tokens
-- under sequence parallelism, and holds 2 C^2 weights a depth, small
-- beside the block's experts. Under sequence parallelism its gradient is
-- this rank's tokens' part, summed over the group with the norms':
-- tp_sp_partial.)
MTPLayer.tp_sp_partial = { 'eh_proj' }
function MTPLayer:init(cfg, idx)
  llama.Layer.init(self, cfg, idx)
  local C = cfg.hidden_size
  self:register_module('enorm', nn.RMSNorm(C, { eps = cfg.rms_norm_eps }))
  self:register_module('hnorm', nn.RMSNorm(C, { eps = cfg.rms_norm_eps }))
  self:register_module('eh_proj', nn.Linear(2 * C, C, { bias = false }))
  local head = nn.Module()
  head:register_module('norm', nn.RMSNorm(C, { eps = cfg.rms_norm_eps }))
  self:register_module('shared_head', head)
end
-- (h (B, n, C) of the depth before, e (B, n, C) the embeddings k on) -> h_k
-- (under sequence parallelism both this rank's rows, (n, C))
function MTPLayer:forward(h, e)
  local x = self.eh_proj(require('moonshard').cat({ self.enorm(e), self.hnorm(h) }, h.ndim))
  return self.shared_head.norm(llama.Layer.forward(self, x))
end

-- t (B, T) -> t's columns k on, then k columns of `fill`: (B, T) again
local function shifted(t, k, fill)
  local B, Tn = t.shape[1], t.shape[2]
  local pad = T.full({ B, k }, fill, { dtype = t.dtype, device = t.device })
  local y = require('moonshard').cat({ t:narrow(2, k + 1, Tn - k), pad }, 2)
  pad:free()
  return y
end

-- the whole sequences' layout (under tensor or context parallelism): every
-- depth runs on all T positions, as the main model does, so that its
-- tokens split as the main model's (sequence parallelism's rows, context
-- parallelism's chunks). Depth k at position i reads the hidden state at i
-- (local), the embedding of token i + k and targets i + k + 1: the ids and
-- targets shifted by k on the whole sequence (under context parallelism
-- gathered from the group, shifted, and sharded again with the same
-- layout). Its last k positions read a filler token (id 0) and ignore
-- their targets: causal attention keeps them from every earlier position,
-- the loss skips them, and the depth's MoE layer leaves them out of its
-- statistics (nn.MoE's _pad mask: the routing biases' counts and the
-- sequence-wise balance loss count the T - k tokens the one-process depth
-- has). So every loss and gradient is the one-process one's.
local function mtp_whole(self, ids, targets, h, w, loss_of, cpc, sp)
  local m = self.model
  local D = #m.mtp_layers
  local wids, wt = ids, targets
  if cpc then
    local cp = require 'moonshard.cp'
    wids, wt = cp.unshard(ids, cpc), cp.unshard(targets, cpc)
  end
  local Tw, Tl = wids.shape[2], ids.shape[2]
  local sum, losses = nil, {}
  for k = 1, D do
    if Tw - k < 1 then break end
    local sid, st = shifted(wids, k, 0), shifted(wt, k, -100)
    local lid, lt = sid, st
    if cpc then
      local cp = require 'moonshard.cp'
      lid, lt = cp.shard(sid, cpc), cp.shard(st, cpc)
      if lid ~= sid then sid:free() end
    end
    -- (this rank's rows, as h: the embedding's sums reduce-scattered, sp.embed)
    local e
    if sp and h.ndim == 2 then e = sp.embed(m.embed_tokens, lid) else e = m.embed_tokens(lid) end
    local layer = m.mtp_layers[k]
    local moe = rawget(layer, 'mlp')
    if moe ~= nil and getmetatable(moe) == nn.MoE then
      -- the tokens the one-process depth has: positions below T - k
      local pos = cpc and cpc:positions(Tl, ids.device) or T.arange(Tl, { dtype = 'i64', device = ids.device })
      local below = F.lt(pos, Tw - k)
      local keep = below:to('f32')
      local B = ids.shape[1]
      rawset(moe, '_pad', { mask = keep:reshape({ 1, Tl }):expand({ B, Tl }):contiguous():reshape({ B * Tl }), k = k })
      keep:free(); below:free()
      if not cpc then pos:free() end   -- (the context's positions are cached)
    end
    h = layer(h, e)
    local lk
    if cpc then
      -- each rank's share: its positions' summed cross-entropy over the
      -- group's kept targets, times the group's size (the ranks' losses,
      -- and their gradients, are averaged: the mean is the whole batch's)
      local s = loss_of(h, lt, 'sum')
      local scale = A.no_grad(function()
        -- (counted in the loss's dtype, f32 at least: exact to 2^24 targets)
        local kept = F.clamp(F.ne(st, -100):to(s.dtype == 'f64' and 'f64' or 'f32'):sum(), 1, nil)
        return F.div(cpc.size, kept)
      end)
      if scale.dtype ~= s.dtype then scale = scale:to(s.dtype) end
      lk = s * scale
      -- (what mtp_losses() reports: the whole batch's, on every rank)
      local whole = A.no_grad(function()
        local v = lk:detach():clone()
        require('moonshard.dist').all_reduce(v, 'sum', { group = cpc.group })
        return v * (1 / cpc.size)
      end)
      losses[k] = whole
    else
      lk = loss_of(h, lt)
      losses[k] = lk
    end
    if lt ~= st then st:free() end
    sum = sum and sum + lk or lk
  end
  if wids ~= ids then wids:free(); wt:free() end
  return sum, losses
end

-- the main loss and the depths' after the last decoder layer: h the
-- states after the final norm, ids and targets (B, T) -> the main loss
-- plus mtp_loss_weight / D times the depths' (each depth's kept for
-- mtp_losses()). The whole model's forward runs it after its layers, and
-- a pipeline's last stage as its head (mtp_pipeline_parts)
local function mtp_tail(self, ids, targets, h)
  local cfg = self.config
  local Tn = ids.shape[2]
  local m = self.model
  -- moonshard.tp (the head's vocabulary-parallel loss, sequence
  -- parallelism's rows) and moonshard.cp (this rank's chunks)
  local tpi, cpc = rawget(self, '_tp'), rawget(self, '_cp')
  local sp = tpi and tpi.sp
  local ht = rawget(rawget(self, '_head'), '_tp')
  local w = self:head_weight()
  -- the loss of states hk (this rank's rows under sequence parallelism:
  -- gathered first) against targets t, mean or sum over the kept ones
  -- (the gather's backward sums the loss's partial grad_x: sp.gather_for_loss)
  local function loss_of(hk, t, reduction)
    local part = false
    if sp then hk, part = sp.gather_for_loss(hk) end
    local o = nil
    if ht ~= nil or reduction ~= nil then
      o = { reduction = reduction }
      if ht ~= nil then o.group, o.vocab_size, o.grad_x_partial = ht.group, ht.total, part end
    end
    return nn.functional.lm_loss(hk, w, t, o)
  end
  local loss = loss_of(h, targets)
  local D = #m.mtp_layers
  local sum, losses = nil, {}
  if tpi ~= nil or cpc ~= nil then
    sum, losses = mtp_whole(self, ids, targets, h, w, loss_of, cpc, sp)
  else
    for k = 1, D do
      local n = Tn - k
      if n < 1 then break end
      local moe = rawget(m.mtp_layers[k], 'mlp')
      if moe ~= nil then rawset(moe, '_pad', nil) end   -- (every token counts: no filler)
      local e = m.embed_tokens(ids:narrow(2, k + 1, n):contiguous())
      h = m.mtp_layers[k](h:narrow(2, 1, n), e)
      local lk = nn.functional.lm_loss(h, w, targets:narrow(2, k + 1, n):contiguous())
      losses[k] = lk
      sum = sum and sum + lk or lk
    end
  end
  rawset(self, '_mtp_losses', losses)
  if sum ~= nil then loss = loss + sum * (cfg.mtp_loss_weight / D) end
  return loss
end

local function mtp_forward(self, input_ids, targets)
  if targets == nil then return llama.LlamaForCausalLM.forward(self, input_ids) end
  local cfg = self.config
  local name = self.family.name
  local ids, B, Tn = hf.check_ids(input_ids, name, 'input_ids', cfg.vocab_size, cfg.max_position_embeddings)
  targets = hf.check_targets(targets, B, Tn, name, cfg.vocab_size)
  local m = self.model
  local box = self:seq_aux_begin(targets)
  local x, pending = m(ids, true)
  local norm, h = m.norm, nil
  if pending ~= nil then
    local _, y = nn.functional.add_rms_norm(x, pending, norm.weight, norm.eps)
    h = y
  else
    h = norm(x)
  end
  local loss = mtp_tail(self, ids, targets, h)
  -- (the MTP depths' MoE layers add their terms too, each over its T - k tokens)
  if box then loss = nn.moe.seq_aux_end(loss, box) end
  return loss
end

-- How moonshard.pp cuts a model with MTP depths (docs/pp.md, "Multi-token
-- prediction"): the depths run after the last decoder layer, so they go
-- to the last stage with the final norm and the head, and the head's
-- forward there is mtp_tail. A depth also reads the token embedding,
-- which the first stage holds: the last stage holds a copy of it too
-- (Megatron-LM's scheme for a tied embedding and head: both prefixes name
-- it, pp.pipeline keeps it on both stages and sums its gradient between
-- them every step, so the copies stay equal), and reads the micro-batch's
-- ids (every stage has the batch's ids).
local function mtp_pipeline_parts(self)
  local cfg, m = self.config, self.model
  local parts = llama.LlamaForCausalLM.pipeline_parts(self)
  if not cfg.tie_word_embeddings then parts.last[#parts.last + 1] = 'model.embed_tokens.' end
  parts.last[#parts.last + 1] = 'model.mtp_layers.'
  parts.head_ids = true
  parts.aux = nil   -- (mtp_forward adds no load-balancing loss over the layers)
  parts.mtp_depths = #m.mtp_layers
  -- (the depths' MoE layers join the last stage's balance-loss session)
  parts.last_moe = nn.moe.layers(m.mtp_layers)
  parts.head = function(x, targets, ids) return mtp_tail(self, ids, targets, m.norm(x)) end
  return parts
end

-- model:mtp_losses() -> the last forward's loss of each depth (a list of
-- scalar tensors; empty when the model has no MTP)
local function mtp_losses(self) return rawget(self, '_mtp_losses') or {} end

local function mtp_attach(m, cfg)
  local L, list = cfg.num_hidden_layers, {}
  for k = 1, cfg.num_nextn_predict_layers do list[k] = MTPLayer(cfg, L + k - 1) end
  m.model:register_module('mtp_layers', nn.ModuleList(list))
  rawset(m, 'forward', mtp_forward)
  -- (the MTP depths use the head after the main loss: it stays in FSDP's
  -- root unit, gathered for the whole step, not a unit of its own)
  rawset(m, 'head_module', function() return nil end)
  -- (moonshard.tp still splits the head by vocabulary rows: each depth's
  -- loss is the vocabulary-parallel one)
  rawset(m, 'tp_head_module', function(self) return rawget(self, '_head') end)
  rawset(m, 'pipeline_parts', mtp_pipeline_parts)
end

-- deepseek_v3.with_mtp(fam): a decoder family (llama.decoder_family's)
-- whose config has num_nextn_predict_layers and mtp_loss_weight builds the
-- MTP depths when the weight is above 0 (DeepSeek-V3's; GLM-4.5's, whose
-- MTP layers are the same modules), reads them from its checkpoints
-- (deepseek_v3.fix_state_dict) and saves them in their names
-- (deepseek_v3.export_state_dict)
function deepseek_v3.with_mtp(fam)
  local build = fam.build
  function fam.build(cfg)
    local m = build(cfg)
    rawset(m, 'mtp_losses', mtp_losses)
    if (cfg.mtp_loss_weight or 0) > 0 then
      if (cfg.num_nextn_predict_layers or 0) < 1 then
        error(('%s config: mtp_loss_weight > 0 needs num_nextn_predict_layers >= 1 (the MTP depths)'):format(
          fam.name), 3)
      end
      mtp_attach(m, cfg)
    end
    return m
  end
  fam.export_state_dict = deepseek_v3.export_state_dict
  return fam
end

-- model -> checkpoint names (hf.save_pretrained): model.mtp_layers.K as
-- model.layers.(num_hidden_layers + K), each with copies of the embedding
-- and the head (embed_tokens, shared_head.head), as DeepSeek's checkpoints
function deepseek_v3.export_state_dict(sd, cfg)
  if (cfg.mtp_loss_weight or 0) <= 0 then return sd end
  local L, out = cfg.num_hidden_layers, {}
  local head = sd[cfg.tie_word_embeddings and 'model.embed_tokens.weight' or 'lm_head.weight']
  for name, t in pairs(sd) do
    local k, rest = name:match('^model%.mtp_layers%.(%d+)%.(.*)$')
    if k then
      local pre = ('model.layers.%d.'):format(L + tonumber(k))
      out[pre .. rest] = t
      out[pre .. 'embed_tokens.weight'] = sd['model.embed_tokens.weight']
      out[pre .. 'shared_head.head.weight'] = head
    else
      out[name] = t
    end
  end
  return out
end
deepseek_v3.with_mtp(deepseek_v3)

return deepseek_v3
