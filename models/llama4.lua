-- models/llama4.lua — Llama 4's text model (Meta 2025: Scout, Maverick), as
-- Hugging Face's Llama4ForCausalLM (model_type llama4_text,
-- Llama4TextConfig): Llama's decoder (models/llama.lua) with
--   * attention (self_attn: q_proj, k_proj, v_proj, o_proj) of two kinds:
--     RoPE layers rotate q and k in (even, odd) pairs (Meta's complex
--     form), then, with use_qk_norm, L2-normalise each head of q and k
--     (weightless, rms_norm_eps); NoPE layers (no_rope_layers[i] = 0:
--     every no_rope_layer_interval-th layer by default) have no position
--     encoding, and with attn_temperature_tuning scale q at position p by
--     1 + attn_scale * log(1 + floor((p + 1) / floor_scale));
--     layers of layer_types 'chunked_attention' (the RoPE layers by
--     default) attend causally within chunks of attention_chunk_size
--     tokens (llama4.chunked_attention), the others over the whole prefix;
--   * feed_forward: in the moe_layers (every interleave_moe_layer_step-th
--     by default) a mixture of num_local_experts SwiGLU experts of
--     intermediate_size (feed_forward.router, feed_forward.experts,
--     feed_forward.shared_expert; nn.MoE with scale_input): each token's
--     num_experts_per_tok best router logits chosen, the sigmoid of each
--     chosen logit scaling the expert's input (not its output), plus a
--     shared expert of intermediate_size on every token; elsewhere a
--     dense SwiGLU MLP of intermediate_size_mlp.
-- The same config.json fields and parameter names as transformers'; the
-- experts as the checkpoints hold them, fused (feed_forward.experts.
-- gate_up_proj (E, H, 2I) and down_proj (E, I, H), each (in, out)), split
-- into our experts' linears on load and fused again by save_pretrained.
-- No auxiliary loss (as transformers' Llama4ForCausalLM, whatever
-- output_router_logits says): balance with --moe-bias-rate (docs/moe.md).
--
--   local llama4 = require 'models.llama4'
--   local model = llama4.new('tiny')
--   local model = llama4.from_pretrained('dir')   -- a llama4_text folder
--   local loss = model(input_ids, targets)
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local T = require 'moonshard.tensor'
local hf = require 'models.hf'
local llama = require 'models.llama'

local llama4 = { name = 'llama4', model_type = 'llama4_text' }

-- Config fields: Llama4TextConfig's, with its defaults (Llama 4 Scout's
-- text shapes, but rope_parameters: the default RoPE of theta 5e5).
llama4.fields = {
  { 'model_type', { 'llama4_text' }, 'llama4_text', 'always llama4_text' },
  { 'vocab_size', 'int>0', 202048, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 5120, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 8192, 'width of each expert\'s and the shared expert\'s gated MLP' },
  { 'intermediate_size_mlp', 'int>0', 16384, 'width of a dense layer\'s gated MLP' },
  { 'num_hidden_layers', 'int>0', 48, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 40, 'query heads' },
  { 'num_key_value_heads', 'int>0?', 8, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', 128, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 131072, 'longest sequence' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'rms_norm_eps', 'number>0', 1e-5, 'RMSNorm epsilon (the q/k L2 norm\'s too)' },
  { 'bos_token_id', 'ids?', 1, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', 2, 'end of sequence' },
  { 'pad_token_id', 'ids?', nil, 'padding' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities (not applied here)' },
  { 'attention_bias', 'bool', false, 'biases on q/k/v/o projections' },
  { 'num_experts_per_tok', 'int>0', 1, 'experts each token goes to (top-k)' },
  { 'num_local_experts', 'int>0', 16, 'experts in each MoE layer' },
  { 'moe_layers', 'ids?', nil, 'the MoE layers (0-based); nil: every interleave_moe_layer_step-th' },
  { 'interleave_moe_layer_step', 'int>0', 1, 'every interleave_moe_layer_step-th layer is MoE (when moe_layers is nil)' },
  { 'use_qk_norm', 'bool', true, 'L2-normalise q and k per head on RoPE layers' },
  { 'output_router_logits', 'bool', false, 'accepted; no load-balancing loss is added (as transformers\' Llama 4)' },
  { 'router_aux_loss_coef', 'number>=0', 0.001, 'unused (as transformers\' Llama 4)' },
  { 'router_jitter_noise', 'number>=0', 0.0, 'unused (as transformers\' Llama 4)' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 500000.0 },
    'RoPE: rope_theta; rope_type default, linear (factor), llama3 (factor, low_freq_factor, high_freq_factor, '
      .. 'original_max_position_embeddings; Scout\'s low = high too) or yarn' },
  { 'no_rope_layers', 'ids?', nil, 'per layer, 1: RoPE, 0: NoPE; nil: NoPE every no_rope_layer_interval-th' },
  { 'no_rope_layer_interval', 'int>0', 4, 'every no_rope_layer_interval-th layer is NoPE (when no_rope_layers is nil)' },
  { 'attention_chunk_size', 'int>0?', 8192, 'tokens in a chunk of chunked attention' },
  { 'layer_types', 'table?', nil, 'per layer, chunked_attention or full_attention; nil: chunked on RoPE layers' },
  { 'attn_temperature_tuning', 'bool', true, 'scale q on NoPE layers by position (floor_scale, attn_scale)' },
  { 'floor_scale', 'int>0', 8192, 'positions per step of the temperature tuning' },
  { 'attn_scale', 'number>=0', 0.1, 'strength of the temperature tuning' },
}
llama4.config = hf.defaults(llama4.fields)

llama4.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes: 4 layers,
  -- the second and fourth MoE (4 experts of 128, 1 a token, a shared
  -- expert), the others dense (256); the fourth NoPE; chunks of 64 tokens
  -- (bin/train's 128-token sequences split in two); the temperature tuning
  -- stepping every 32 positions
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 128, intermediate_size_mlp = 256,
           num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 32,
           max_position_embeddings = 256, num_local_experts = 4, num_experts_per_tok = 1,
           interleave_moe_layer_step = 2, attention_chunk_size = 64, floor_scale = 32,
           bos_token_id = hf.null, eos_token_id = hf.null },
  -- Llama 4 Scout's text model (17B active, 16 experts, 109B in all; its
  -- RoPE: Llama 3.1's scaling by 16 over 8192 positions, no blended band)
  scout = { rope_parameters = { rope_type = 'llama3', rope_theta = 500000.0, factor = 16.0, low_freq_factor = 1.0,
              high_freq_factor = 1.0, original_max_position_embeddings = 8192 }, max_position_embeddings = 10485760,
            bos_token_id = 200000, eos_token_id = { 200001, 200007, 200008 }, pad_token_id = 200018 },
}

local function absent(v) return v == nil or v == hf.null end

-- Older configs (transformers < 5) put rope_theta at the top level and
-- rope_scaling beside it, read as Llama's (llama.normalize); a RoPE without
-- a theta takes Llama 4's 5e5, as transformers; a single layer id is a list.
function llama4.normalize(cfg)
  if cfg.rope_parameters == hf.null then cfg.rope_parameters = nil end
  if cfg.rope_parameters == nil and absent(cfg.rope_theta) then
    cfg.rope_parameters = { rope_type = 'default', rope_theta = 500000.0 }
  end
  if type(cfg.rope_parameters) == 'table' and cfg.rope_parameters.rope_theta == nil and absent(cfg.rope_theta) then
    cfg.rope_parameters.rope_theta = 500000.0
  end
  llama.normalize(cfg)
  for _, f in ipairs({ 'moe_layers', 'no_rope_layers' }) do
    if type(cfg[f]) == 'number' then cfg[f] = { cfg[f] } end
    if cfg[f] == hf.null then cfg[f] = nil end
  end
  if cfg.layer_types == hf.null then cfg.layer_types = nil end
  -- (transformers takes an empty no_rope_layers as none given)
  if type(cfg.no_rope_layers) == 'table' and next(cfg.no_rope_layers) == nil then cfg.no_rope_layers = nil end
end

local function cfg_error(fmt, ...) error(('llama4 config: ' .. fmt):format(...), 4) end

-- The per-layer lists as transformers derives them (Llama4TextConfig's
-- __post_init__), written into cfg: no_rope_layers (1: RoPE), moe_layers,
-- layer_types.
local function derive(cfg)
  local L = cfg.num_hidden_layers
  if cfg.no_rope_layers == nil then
    local r = {}
    for i = 0, L - 1 do r[i + 1] = ((i + 1) % cfg.no_rope_layer_interval ~= 0) and 1 or 0 end
    cfg.no_rope_layers = r
  end
  if cfg.moe_layers == nil then
    local r = {}
    for i = cfg.interleave_moe_layer_step - 1, L - 1, cfg.interleave_moe_layer_step do r[#r + 1] = i end
    cfg.moe_layers = r
  end
  if cfg.layer_types == nil then
    local r = {}
    for i = 1, L do r[i] = cfg.no_rope_layers[i] == 1 and 'chunked_attention' or 'full_attention' end
    cfg.layer_types = r
  end
end

llama4.rope_types = { default = true, linear = true, llama3 = true, yarn = true }
function llama4.check(cfg)
  local rp = cfg.rope_parameters
  local rt = rp.rope_type or 'default'
  if not llama4.rope_types[rt] then
    cfg_error('rope_parameters.rope_type %s is not supported (default, linear, llama3 or yarn)', tostring(rt))
  end
  rp.rope_type = rt
  if type(rp.rope_theta) ~= 'number' or rp.rope_theta <= 0 then
    cfg_error('rope_parameters.rope_theta must be a positive number, got %s', tostring(rp.rope_theta))
  end
  local L, nh = cfg.num_hidden_layers, cfg.num_attention_heads
  local nkv = cfg.num_key_value_heads or nh
  if nh % nkv ~= 0 then cfg_error('num_attention_heads (%d) must be a multiple of num_key_value_heads (%d)', nh, nkv) end
  if cfg.head_dim == nil and cfg.hidden_size % nh ~= 0 then
    cfg_error('hidden_size (%d) must be a multiple of num_attention_heads (%d), or give head_dim', cfg.hidden_size, nh)
  end
  if cfg.num_experts_per_tok > cfg.num_local_experts then
    cfg_error('num_experts_per_tok %d is more than num_local_experts %d', cfg.num_experts_per_tok, cfg.num_local_experts)
  end
  derive(cfg)
  local nr, lt = cfg.no_rope_layers, cfg.layer_types
  if #nr < L then cfg_error('no_rope_layers has %d entries for %d layers (num_hidden_layers)', #nr, L) end
  for i = 1, #nr do
    if nr[i] ~= 0 and nr[i] ~= 1 then
      cfg_error('no_rope_layers[%d] must be 1 (RoPE) or 0 (NoPE), got %s', i - 1, tostring(nr[i]))
    end
  end
  if type(lt) ~= 'table' or #lt < L then
    cfg_error('layer_types must list one of chunked_attention, full_attention for each of the %d layers, got %d',
      L, type(lt) == 'table' and #lt or 0)
  end
  local chunked = false
  for i = 1, L do
    if lt[i] ~= 'chunked_attention' and lt[i] ~= 'full_attention' then
      cfg_error('layer_types[%d] must be chunked_attention or full_attention, got %s', i - 1, tostring(lt[i]))
    end
    chunked = chunked or lt[i] == 'chunked_attention'
  end
  if chunked and cfg.attention_chunk_size == nil then
    cfg_error('attention_chunk_size is null, but layer_types has chunked_attention layers')
  end
  for _, i in ipairs(cfg.moe_layers) do
    if i >= L then cfg_error('moe_layers holds layer %d, past the %d layers (num_hidden_layers)', i, L) end
  end
  local hd = cfg.head_dim or math.floor(cfg.hidden_size / nh)
  local roped = false
  for i = 1, L do roped = roped or nr[i] == 1 end
  if roped then
    if hd % 2 ~= 0 then cfg_error('head_dim (%d) must be even for RoPE', hd) end
    local ok, err = pcall(llama4.rope, cfg)
    if not ok then cfg_error('rope_parameters: %s', (tostring(err):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
  end
end

-- the RoPE of cfg: llama.rope's (a theta or the table of its scaled
-- frequencies) over head_dim (Llama 4 Scout's llama3 parameters have
-- low_freq_factor = high_freq_factor: no blended band, which
-- nnf.llama3_rope takes)
function llama4.rope(cfg)
  return llama.rope(cfg, cfg.head_dim or math.floor(cfg.hidden_size / cfg.num_attention_heads))
end

-- the kinds of layer idx (0-based)
function llama4.uses_rope(cfg, idx) return cfg.no_rope_layers[idx + 1] == 1 end
function llama4.is_chunked(cfg, idx) return cfg.layer_types[idx + 1] == 'chunked_attention' end
function llama4.is_moe(cfg, idx)
  for _, i in ipairs(cfg.moe_layers) do if i == idx then return true end end
  return false
end

-- ------------------------------------------------------------- attention
-- llama4.chunked_attention(q (B, H, T, D), k, v (B, Hkv, T, D), chunk, opts)
-- -> (B, H, T, D): causal attention within each run of `chunk` positions
-- (position i sees j <= i with i // chunk == j // chunk: transformers'
-- chunked causal mask), through the fused kernel: the sequence padded with
-- zeros to a multiple of chunk (the padding comes after every real key of
-- the last chunk, so the causal mask hides it; its outputs are dropped),
-- each chunk made a sequence of its own (B * chunks, H, chunk, D), causal
-- attention over those. Plain causal attention when T <= chunk.
-- opts: scaled_dot_product_attention's (scale).
function llama4.chunked_attention(q, k, v, chunk, opts)
  local nnf = nn.functional
  local o = { causal = true, scale = opts and opts.scale }
  local B, H, Tn, D = q.shape[1], q.shape[2], q.shape[3], q.shape[4]
  if Tn <= chunk then return nnf.scaled_dot_product_attention(q, k, v, o) end
  local n = math.ceil(Tn / chunk)
  local P = n * chunk
  local function split(t)   -- (B, h, T, D) -> (B * n, h, chunk, D)
    local h = t.shape[2]
    if P > Tn then
      local z = T.zeros({ B, h, P - Tn, D }, { dtype = t.dtype, device = t.device })
      t = ms.cat({ t, z }, 3)
    end
    return t:reshape({ B, h, n, chunk, D }):transpose(2, 3):reshape({ B * n, h, chunk, D })
  end
  local y = nnf.scaled_dot_product_attention(split(q), split(k), split(v), o)
  y = y:reshape({ B, n, H, chunk, D }):transpose(2, 3):reshape({ B, H, P, D })
  if P > Tn then y = y:narrow(3, 1, Tn) end
  return y
end

-- the temperature tuning's scales of positions 0 .. T-1, (1, 1, T, 1) in
-- dtype on device: 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
-- (transformers' Llama4TextAttention; cached)
local temp_cache = setmetatable({}, { __mode = 'v' })
local function temperature(Tn, floor_scale, attn_scale, dtype, device)
  local key = ('%d:%d:%.17g:%s:%s'):format(Tn, floor_scale, attn_scale, dtype, device)
  local t = temp_cache[key]
  if t and t.storage ~= nil then return t end
  local s = {}
  for p = 0, Tn - 1 do s[p + 1] = 1 + attn_scale * math.log(1 + math.floor((p + 1) / floor_scale)) end
  t = ms.tensor(s, { dtype = 'f64' }):to({ dtype = dtype, device = device }):reshape({ 1, 1, Tn, 1 })
  temp_cache[key] = t
  return t
end

local Attention = nn.Module:extend('Llama4TextAttention')
llama4.Attention = Attention

function Attention:init(cfg, idx)
  local C, nh = cfg.hidden_size, cfg.num_attention_heads
  local nkv = cfg.num_key_value_heads or nh
  local hd = cfg.head_dim or math.floor(C / nh)
  self.dim, self.n_head, self.n_kv_head, self.head_dim = C, nh, nkv, hd
  local b = cfg.attention_bias
  self:register_module('q_proj', nn.Linear(C, nh * hd, { bias = b }))
  self:register_module('k_proj', nn.Linear(C, nkv * hd, { bias = b }))
  self:register_module('v_proj', nn.Linear(C, nkv * hd, { bias = b }))
  self:register_module('o_proj', nn.Linear(nh * hd, C, { bias = b }))
  if llama4.uses_rope(cfg, idx) then
    self.rope = llama4.rope(cfg)
    if cfg.use_qk_norm then self.qk_norm_eps = cfg.rms_norm_eps end
  elseif cfg.attn_temperature_tuning then
    self.floor_scale, self.attn_scale = cfg.floor_scale, cfg.attn_scale
  end
  if llama4.is_chunked(cfg, idx) then self.chunk = cfg.attention_chunk_size end
end

-- moonshard.tp splits it by heads as nn.CausalSelfAttention (q/k/v_proj
-- by heads, o_proj by rows): its _tp holds this rank's head counts and the
-- input's entry (the stream gathered under sequence parallelism)
Attention.tp_heads = true

function Attention:forward(x)
  local H, Hkv, hd = self.n_head, self.n_kv_head, self.head_dim
  local tp = rawget(self, '_tp')
  if tp ~= nil then
    H, Hkv = tp.n_head, tp.n_kv_head
    x = tp.enter(x)
  end
  if rawget(self, '_cp') ~= nil then
    error('Llama4TextAttention: context parallelism does not ring Llama 4\'s attention (chunks and positions)', 2)
  end
  if not T.is_tensor(x) or x.ndim ~= 3 or x.shape[3] ~= self.dim then
    error(('Llama4TextAttention: expected x of shape (B, T, %d), got (%s)'):format(self.dim,
      T.is_tensor(x) and table.concat(x.shape, ', ') or type(x)), 2)
  end
  local nnf = nn.functional
  local B, Tn = x.shape[1], x.shape[2]
  local q = self.q_proj(x):view(B, Tn, H, hd)
  local k = self.k_proj(x):view(B, Tn, Hkv, hd)
  local v = self.v_proj(x):view(B, Tn, Hkv, hd):transpose(2, 3)
  if self.rope then
    -- (Meta's pairs as halves: nnf.pairs_to_halves)
    q, k = nnf.pairs_to_halves(q):transpose(2, 3), nnf.pairs_to_halves(k):transpose(2, 3)
    local cdt = q.dtype == 'f64' and 'f64' or 'f32'
    local cos, sin = nnf.rope_cache(Tn, hd, self.rope, cdt, q.device_id, q.dtype)
    q, k = nnf.apply_rotary(q, cos, sin), nnf.apply_rotary(k, cos, sin)
    -- (the L2 norm: an RMSNorm without a weight)
    if self.qk_norm_eps then q, k = nnf.rms_norm(q, nil, self.qk_norm_eps), nnf.rms_norm(k, nil, self.qk_norm_eps) end
  else
    q, k = q:transpose(2, 3), k:transpose(2, 3)
    if self.floor_scale then
      -- (the scales in f32 at least, the product rounded once to q's dtype: as transformers)
      local qs = q * temperature(Tn, self.floor_scale, self.attn_scale, q.dtype == 'f64' and 'f64' or 'f32', q.device)
      if qs.dtype ~= q.dtype then qs = qs:to(q.dtype) end
      q = qs
    end
  end
  local y
  if self.chunk then y = llama4.chunked_attention(q, k, v, self.chunk)
  else y = nnf.scaled_dot_product_attention(q, k, v, { causal = true }) end
  return self.o_proj(y:transpose(2, 3):reshape(B, Tn, H * hd))
end

function Attention:extra_repr()
  return ('dim=%d, n_head=%d, n_kv_head=%d, head_dim=%d, %s%s%s'):format(self.dim, self.n_head, self.n_kv_head,
    self.head_dim, self.rope and ('rope ' .. (type(self.rope) == 'table' and self.rope.key or tostring(self.rope)))
      or 'nope', self.qk_norm_eps and ', qk_norm' or (self.floor_scale and ', temperature tuning' or ''),
    self.chunk and (', chunks of %d'):format(self.chunk) or '')
end

-- what its layers change in Llama's: the attention above; the MLP
-- (feed_forward) a mixture of experts in the moe_layers
llama.variants.llama4_text = {
  self_attn = function(cfg, idx) return Attention(cfg, idx) end,
  mlp = function(cfg, idx)
    if not llama4.is_moe(cfg, idx) then
      return 'feed_forward', nn.GatedMLP { dim = cfg.hidden_size, hidden = cfg.intermediate_size_mlp }
    end
    return 'feed_forward', nn.MoE { dim = cfg.hidden_size, hidden = cfg.intermediate_size,
      experts = cfg.num_local_experts, top_k = cfg.num_experts_per_tok, score = 'sigmoid', norm_topk = false,
      scale_input = true, router = 'router', shared_hidden = cfg.intermediate_size, shared = 'shared_expert' }
  end,
}
-- bin/train's FSDP units and checkpointed blocks: the decoder layers
llama4.fsdp_block = 'LlamaDecoderLayer'
-- (transformers' Llama4ForCausalLM adds no load-balancing loss)
llama4.no_aux_loss = true
-- (the routing biases of a --moe-bias-rate run: models/mixtral.lua)
llama4.prepare = require('models.mixtral').prepare

-- ---------------------------------------------------- the experts' layout
-- A checkpoint's experts are fused: prefix.gate_up_proj (E, H, 2I), each
-- expert's gate then up as (in, out) columns, and prefix.down_proj
-- (E, I, H); our experts are linears, prefix.N.{gate,up,down}_proj.weight
-- (out, in). Expert e's gate weight is gate_up_proj[e][:, :I]ᵀ, its up
-- weight gate_up_proj[e][:, I:]ᵀ, its down weight down_proj[e]ᵀ.
-- expert_part(w (E, R, C) or deferred, e, col, ncol) -> (ncol, R): columns
-- col .. col + ncol - 1 of w[e], transposed (a deferred tensor stays
-- deferred: each FSDP rank reads its rows' slab only)
local function expert_part(w, e, col, ncol)
  local R, Cn = w.shape[2], w.shape[3]
  local function make()
    local slab
    if T.is_deferred(w) then
      slab = T.empty({ R, Cn }, { dtype = w.dtype })
      T.replay(w, slab, e * R * Cn)
    else
      slab = w:narrow(1, e + 1, 1):reshape({ R, Cn })
    end
    return slab:narrow(2, col + 1, ncol):t():contiguous()
  end
  if not T.is_deferred(w) then return make() end
  return T.deferred_fn({ ncol, R }, w.dtype, function(first, n)
    local part = make():reshape({ ncol * R })
    if first == 0 and n == ncol * R then return part end
    return part:narrow(1, first + 1, n):contiguous()
  end)
end

-- checkpoint -> model: the fused experts split; a tied checkpoint's
-- lm_head.weight dropped (llama.fix_state_dict). A checkpoint already in
-- our experts' names (bin/train --fsdp's --out) passes as it is. A
-- Llama4ForConditionalGeneration checkpoint (the Hub's Llama 4 folders)
-- gives its language_model.* tensors, the vision model's and the
-- projector's left out.
function llama4.fix_state_dict(sd, cfg)
  local E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
  local multimodal = false
  for name in pairs(sd) do
    if name:match('^language_model%.') then multimodal = true; break end
  end
  if multimodal then
    local text = {}
    for name, t in pairs(sd) do
      local n = name:match('^language_model%.(.*)$')
      if n then text[n] = t
      elseif not (name:match('^vision_model%.') or name:match('^multi_modal_projector%.')) then
        error(('llama4: %s is neither the language model\'s (language_model.*) nor the vision model\'s or the '
          .. 'projector\'s'):format(name), 3)
      end
    end
    sd = text
  end
  local fused = {}
  for name in pairs(sd) do
    local p = name:match('^(.*%.feed_forward%.experts)%.gate_up_proj$')
    if p then fused[#fused + 1] = p end
  end
  table.sort(fused)
  for _, p in ipairs(fused) do
    local gu, dn = sd[p .. '.gate_up_proj'], sd[p .. '.down_proj']
    local function want(t, name, shape)
      if t == nil then error(('llama4: %s.gate_up_proj has no %s beside it'):format(p, name), 4) end
      if t.ndim ~= 3 or t.shape[1] ~= shape[1] or t.shape[2] ~= shape[2] or t.shape[3] ~= shape[3] then
        error(('llama4: %s.%s is (%s), expected (%s) (num_local_experts, %s)'):format(p, name,
          table.concat(t.shape, ', '), table.concat(shape, ', '),
          name == 'down_proj' and 'intermediate_size, hidden_size' or 'hidden_size, 2 x intermediate_size'), 4)
      end
    end
    want(gu, 'gate_up_proj', { E, H, 2 * I })
    want(dn, 'down_proj', { E, I, H })
    for e = 0, E - 1 do
      local q = p .. '.' .. e .. '.'
      sd[q .. 'gate_proj.weight'] = expert_part(gu, e, 0, I)
      sd[q .. 'up_proj.weight'] = expert_part(gu, e, I, I)
      sd[q .. 'down_proj.weight'] = expert_part(dn, e, 0, H)
    end
    sd[p .. '.gate_up_proj'], sd[p .. '.down_proj'] = nil, nil
  end
  return llama.fix_state_dict(sd, cfg)
end

-- model -> checkpoint (hf.save_pretrained, hf.export_file): each MoE
-- layer's experts fused again into gate_up_proj (E, H, 2I) and down_proj
-- (E, I, H), on the host; from deferred tensors (a file read lazily) the
-- fused ones are deferred too, each made when it is replayed. A new
-- table (sd as it is when it holds no experts in our names)
function llama4.export_state_dict(sd, cfg)
  local E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
  local prefixes = {}
  for name in pairs(sd) do
    local p = name:match('^(.*%.feed_forward%.experts)%.0%.gate_proj%.weight$')
    if p then prefixes[#prefixes + 1] = p end
  end
  if #prefixes == 0 then return sd end
  local src = sd
  sd = {}
  for name, t in pairs(src) do sd[name] = t end
  local function host(t, dt)
    if T.is_deferred(t) then return T.replay(t, T.empty(t.shape, { dtype = t.dtype })):to(dt) end
    return t:to({ dtype = dt, device = 'cpu' })
  end
  for _, p in ipairs(prefixes) do
    local first = sd[p .. '.0.gate_proj.weight']
    local dt, lazy = first.dtype, T.is_deferred(first)
    local ws = {}
    for e = 0, E - 1 do
      local q = p .. '.' .. e .. '.'
      local g, u, d = sd[q .. 'gate_proj.weight'], sd[q .. 'up_proj.weight'], sd[q .. 'down_proj.weight']
      if g == nil or u == nil or d == nil then
        error(('llama4: save: expert %s%s is missing (an expert-parallel model saves through ep.full_state_dict)')
          :format(q, g == nil and 'gate_proj.weight' or (u == nil and 'up_proj.weight' or 'down_proj.weight')), 3)
      end
      ws[e + 1] = { g, u, d }
      sd[q .. 'gate_proj.weight'], sd[q .. 'up_proj.weight'], sd[q .. 'down_proj.weight'] = nil, nil, nil
    end
    local function gate_up()
      return ms.no_grad(function()
        local gu = T.empty({ E, H, 2 * I }, { dtype = dt })
        for e = 0, E - 1 do
          local slab = gu:narrow(1, e + 1, 1):reshape({ H, 2 * I })
          slab:narrow(2, 1, I):copy_(host(ws[e + 1][1], dt):t())
          slab:narrow(2, I + 1, I):copy_(host(ws[e + 1][2], dt):t())
        end
        return gu
      end)
    end
    local function down()
      return ms.no_grad(function()
        local dn = T.empty({ E, I, H }, { dtype = dt })
        for e = 0, E - 1 do dn:narrow(1, e + 1, 1):reshape({ I, H }):copy_(host(ws[e + 1][3], dt):t()) end
        return dn
      end)
    end
    if lazy then
      local function deferred(shape, make)
        return T.deferred_fn(shape, dt, function(from, n)
          local whole = make():reshape({ shape[1] * shape[2] * shape[3] })
          if from == 0 and n == whole:numel() then return whole end
          return whole:narrow(1, from + 1, n):contiguous()
        end)
      end
      sd[p .. '.gate_up_proj'], sd[p .. '.down_proj'] = deferred({ E, H, 2 * I }, gate_up), deferred({ E, I, H }, down)
    else
      sd[p .. '.gate_up_proj'], sd[p .. '.down_proj'] = gate_up(), down()
    end
  end
  return sd
end

-- build, new, from_pretrained, and export_config (config.json as
-- transformers writes Llama4TextConfig: the per-layer lists spelt out,
-- rope_theta and a scaled RoPE's rope_scaling also at the top level, where
-- transformers < 5 reads them)
local fix = llama4.fix_state_dict
llama.decoder_family(llama4, 'Llama4ForCausalLM', function(cfg)
  derive(cfg)
  if cfg.pad_token_id == nil then cfg.pad_token_id = hf.null end
  if cfg.attention_chunk_size == nil then cfg.attention_chunk_size = hf.null end
end)
llama4.fix_state_dict = fix

-- llama4.from_pretrained(dir, opts): a llama4_text folder (config.json +
-- model.safetensors or its shards), or a Llama4ForConditionalGeneration
-- one (model_type llama4, the Hub's Llama 4 folders): its text_config and
-- its language model's tensors (the vision model's left out).
-- save_pretrained writes a llama4_text folder.
function llama4.from_pretrained(dir, opts)
  opts = opts or {}
  if type(dir) == 'string' then
    local raw = hf.read_json(dir .. '/config.json')
    if type(raw) == 'table' and raw.model_type == 'llama4' then
      local tc = raw.text_config
      if type(tc) ~= 'table' or tc == hf.null then
        error(('llama4.from_pretrained: %s/config.json has model_type llama4 but no text_config'):format(dir), 2)
      end
      if tc.model_type ~= nil and tc.model_type ~= 'llama4_text' then
        error(('llama4.from_pretrained: %s/config.json\'s text_config has model_type %s, expected llama4_text'):format(
          dir, tostring(tc.model_type)), 2)
      end
      local o = {}
      for k, v in pairs(opts) do o[k] = v end
      o.config = hf.deepcopy(tc)
      o.config.model_type = 'llama4_text'   -- (the text config's tie_word_embeddings ties, as transformers)
      opts = o
    end
  end
  return hf.from_pretrained(llama4, dir, opts)
end

return llama4
