-- models/llama.lua — Llama (Touvron et al. 2023), as Hugging Face's
-- LlamaForCausalLM: the same config.json fields, the same parameter names,
-- RMSNorm, rotary position embeddings (RoPE, rotate-half as HF), SwiGLU MLP,
-- grouped-query attention, an LM head of its own (unless tie_word_embeddings).
--
--   local llama = require 'models.llama'
--   local model = llama.new('tiny')                       -- a preset, or a config table
--   local model = llama.from_pretrained('path/to/dir')    -- config.json + model.safetensors
--   local logits = model(input_ids)                       -- (B, T) i64 -> (B, T, V)
--   local loss = model(input_ids, targets)                -- mean CE over targets ~= -100
--   model:save_pretrained('out/dir')
--
-- Structure (HF names):
--   model.embed_tokens (V, C)
--   model.layers.N: input_layernorm -> self_attn (q_proj, k_proj, v_proj, o_proj; RoPE on q, k) -> +,
--                   post_attention_layernorm -> mlp (down_proj(silu(gate_proj(x)) * up_proj(x))) -> +
--   model.norm, lm_head (V, C): called as one module, model:head_module()
--   (nn.LMHead: the norm and the loss; it owns no parameters of its own)
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local hf = require 'models.hf'

local llama = { name = 'llama', model_type = 'llama' }

-- Config fields: { name, type, default, meaning } (types: models/hf.lua).
-- The defaults are LlamaConfig's (Llama 2 7B shapes).
llama.fields = {
  { 'model_type', { 'llama' }, 'llama', 'always llama' },
  { 'vocab_size', 'int>0', 32000, 'tokens in the vocabulary' },
  { 'hidden_size', 'int>0', 4096, 'width of the residual stream' },
  { 'intermediate_size', 'int>0', 11008, 'width of the gated MLP' },
  { 'num_hidden_layers', 'int>0', 32, 'decoder layers' },
  { 'num_attention_heads', 'int>0', 32, 'query heads' },
  { 'num_key_value_heads', 'int>0?', nil, 'key/value heads (grouped-query attention); nil: num_attention_heads' },
  { 'head_dim', 'int>0?', nil, 'width of one head; nil: hidden_size / num_attention_heads' },
  { 'hidden_act', { 'silu' }, 'silu', 'gate activation' },
  { 'max_position_embeddings', 'int>0', 2048, 'longest sequence' },
  { 'rms_norm_eps', 'number>0', 1e-6, 'RMSNorm epsilon' },
  { 'rope_parameters', 'table', { rope_type = 'default', rope_theta = 10000.0 },
    'RoPE: rope_theta; rope_type default, linear (factor), llama3 (Llama 3.1: factor, low_freq_factor, high_freq_factor, '
      .. 'original_max_position_embeddings) or yarn (factor, original_max_position_embeddings, ...)' },
  { 'attention_bias', 'bool', false, 'biases on q/k/v/o projections' },
  { 'attention_dropout', 'prob', 0.0, 'dropout on attention probabilities' },
  { 'mlp_bias', 'bool', false, 'biases on gate/up/down projections' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'tie_word_embeddings', 'bool', false, 'lm_head shares embed_tokens' },
  { 'bos_token_id', 'ids?', 1, 'beginning of sequence' },
  { 'eos_token_id', 'ids?', 2, 'end of sequence' },
}
llama.config = hf.defaults(llama.fields)

llama.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes
  tiny = { vocab_size = 256, hidden_size = 128, intermediate_size = 352, num_hidden_layers = 4,
           num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 256,
           rms_norm_eps = 1e-5, bos_token_id = hf.null, eos_token_id = hf.null },
  -- ~1.1B parameters, the shapes of TinyLlama-1.1B (Llama 2 architecture)
  ['llama-1b'] = { vocab_size = 32000, hidden_size = 2048, intermediate_size = 5632, num_hidden_layers = 22,
                   num_attention_heads = 32, num_key_value_heads = 4, max_position_embeddings = 2048,
                   rms_norm_eps = 1e-5 },
  -- the 1.25B benchmark model of ../shared/bench/torch_llama.py (bench/fsdp.lua):
  -- Llama 3 vocabulary, untied head, GQA 32/8, RoPE theta 5e5
  ['llama-1.25b'] = { vocab_size = 128256, hidden_size = 2048, intermediate_size = 5632, num_hidden_layers = 16,
                      num_attention_heads = 32, num_key_value_heads = 8, max_position_embeddings = 2048,
                      rope_parameters = { rope_type = 'default', rope_theta = 500000.0 },
                      tie_word_embeddings = false, rms_norm_eps = 1e-5 },
}
llama.presets['1b'] = llama.presets['llama-1b']

-- Older configs (transformers < 5) put rope_theta at the top level and
-- rope_scaling beside it (its type as `type` or `rope_type`); bring them
-- into rope_parameters.
function llama.normalize(cfg)
  if cfg.rope_parameters == hf.null then cfg.rope_parameters = nil end
  if cfg.rope_theta ~= nil and cfg.rope_theta ~= hf.null then
    local rp = type(cfg.rope_parameters) == 'table' and cfg.rope_parameters or {}
    if type(cfg.rope_theta) ~= 'number' then
      error(('llama config: rope_theta must be a positive number, got %s'):format(tostring(cfg.rope_theta)), 3)
    end
    rp.rope_theta = cfg.rope_theta
    cfg.rope_parameters = rp
  end
  cfg.rope_theta = nil
  if type(cfg.rope_scaling) == 'table' and cfg.rope_scaling ~= hf.null then
    local rp = type(cfg.rope_parameters) == 'table' and cfg.rope_parameters or { rope_theta = 10000.0 }
    for k, v in pairs(cfg.rope_scaling) do
      if k == 'type' then k = 'rope_type' end
      rp[k] = v
    end
    cfg.rope_parameters = rp
  end
  cfg.rope_scaling = nil
  if cfg.rope_parameters == nil then cfg.rope_parameters = { rope_type = 'default', rope_theta = 10000.0 } end
end

llama.rope_types = { default = true, linear = true, llama3 = true, yarn = true }
function llama.check(cfg)
  local rp = cfg.rope_parameters
  local rt = rp.rope_type or 'default'
  if not llama.rope_types[rt] then
    error(('llama config: rope_parameters.rope_type %s is not supported (default, linear, llama3 or yarn)'):format(
      tostring(rt)), 3)
  end
  if type(rp.rope_theta) ~= 'number' or rp.rope_theta <= 0 then
    error(('llama config: rope_parameters.rope_theta must be a positive number, got %s'):format(tostring(rp.rope_theta)), 3)
  end
  rp.rope_type = rt
  if rt == 'yarn' and (rp.factor == nil or rp.factor == hf.null) and type(rp.original_max_position_embeddings) == 'number' then
    rp.factor = cfg.max_position_embeddings / rp.original_max_position_embeddings   -- (as transformers)
  end
  local nh = cfg.num_attention_heads
  local nkv = cfg.num_key_value_heads or nh
  if nh % nkv ~= 0 then
    error(('llama config: num_attention_heads (%d) must be a multiple of num_key_value_heads (%d)'):format(nh, nkv), 3)
  end
  if cfg.head_dim == nil and cfg.hidden_size % nh ~= 0 then
    error(('llama config: hidden_size (%d) must be a multiple of num_attention_heads (%d), or give head_dim')
      :format(cfg.hidden_size, nh), 3)
  end
  local hd = cfg.head_dim or math.floor(cfg.hidden_size / nh)
  if hd % 2 ~= 0 then error(('llama config: head_dim (%d) must be even for RoPE'):format(hd), 3) end
  local ok, err = pcall(llama.rope, cfg)
  if not ok then error('llama config: rope_parameters: ' .. tostring(err):gsub('^[^:\n]*%.lua:%d+: ', ''), 3) end
end

-- the attention's RoPE for cfg: rope_theta, or the table of its scaled
-- frequencies (nnf.linear_rope, llama3_rope, yarn_rope: transformers' rope
-- types of the same names) over hd rotary dimensions (default: head_dim)
function llama.rope(cfg, hd)
  local rp = cfg.rope_parameters
  local rt = rp.rope_type or 'default'
  if rt == 'default' then return rp.rope_theta end
  hd = hd or cfg.head_dim or math.floor(cfg.hidden_size / cfg.num_attention_heads)
  local nnf = nn.functional
  if rt == 'linear' then return nnf.linear_rope(rp.rope_theta, hd, rp) end
  if rt == 'llama3' then return nnf.llama3_rope(rp.rope_theta, hd, rp) end
  return nnf.yarn_rope(rp.rope_theta, hd, rp)
end

-- ------------------------------------------------------------------ model
local Layer = nn.Module:extend('LlamaDecoderLayer')

-- What the families built on this decoder change in a layer, by
-- model_type (models/mixtral.lua, models/qwen3_moe.lua, models/qwen2_moe.lua
-- register theirs): qk_norm (q and k RMS-normalised per head),
-- attention(cfg) -> { bias =, o_bias = } (the q/k/v and o projections'
-- biases; default attention_bias on all four), self_attn(cfg, idx) -> the
-- attention module itself (instead of nn.CausalSelfAttention: DeepSeek-V3's
-- nn.MLAttention) and mlp(cfg, idx) -> the name and the module of layer
-- idx's (0-based) MLP.
llama.variants = {}

local function dense_mlp(cfg)
  return 'mlp', nn.GatedMLP{ dim = cfg.hidden_size, hidden = cfg.intermediate_size, bias = cfg.mlp_bias }
end

function Layer:init(cfg, idx)
  local C = cfg.hidden_size
  local v = llama.variants[cfg.model_type] or {}
  if v.self_attn then
    self:register_module('self_attn', v.self_attn(cfg, idx or 0))
  else
    -- (a variant's attention(cfg): bias, o_bias, rotary_dim (RoPE on that
    -- many of each head's features: GLM-4.5's), qk_norm (beside v.qk_norm),
    -- window (Mistral's sliding window))
    local ab = v.attention and v.attention(cfg) or { bias = cfg.attention_bias }
    self:register_module('self_attn', nn.CausalSelfAttention{
      dim = C, n_head = cfg.num_attention_heads, n_kv_head = cfg.num_key_value_heads or cfg.num_attention_heads,
      head_dim = cfg.head_dim or math.floor(C / cfg.num_attention_heads), bias = ab.bias, o_bias = ab.o_bias,
      rope_theta = llama.rope(cfg, ab.rotary_dim), rotary_dim = ab.rotary_dim, window = ab.window, fused_qkv = false,
      qk_norm_eps = (v.qk_norm or ab.qk_norm) and cfg.rms_norm_eps or nil })
  end
  local name, mlp = (v.mlp or dense_mlp)(cfg, idx or 0)
  self:register_module(name, mlp)
  self:register_module('input_layernorm', nn.RMSNorm(C, { eps = cfg.rms_norm_eps }))
  self:register_module('post_attention_layernorm', nn.RMSNorm(C, { eps = cfg.rms_norm_eps }))
end

-- an RMSNorm that can take the residual add before it (nnf.add_rms_norm)
local function fusable_norm(ln) return getmetatable(ln) == nn.RMSNorm and nn.plain(ln) end

-- true when the model may call this layer with a deferred residual add
-- (layer(x, pending, true)): exactly a LlamaDecoderLayer with its own
-- forward, norms that take the add, only passive forward hooks (FSDP's)
function Layer:deferrable()
  return getmetatable(self) == Layer and rawget(self, 'forward') == nil and nn.passive_hooks_only(self)
    and fusable_norm(self.input_layernorm) and fusable_norm(self.post_attention_layernorm)
end

-- layer(x) -> the layer's output; layer(x, pending, true) -> r, m with the
-- output r + m left for the next norm, the input being x + pending (added
-- in input_layernorm's pass; pending may be nil), as GPT-2's blocks
function Layer:forward(x, pending, defer)
  local ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
  local h
  if pending ~= nil then
    x, h = nn.functional.add_rms_norm(x, pending, ln1.weight, ln1.eps)
  else
    h = ln1(x)
  end
  local a = self.self_attn(h)
  local r, y
  if fusable_norm(ln2) then
    -- the residual add and the norm in one node (one pass on CUDA)
    r, y = nn.functional.add_rms_norm(x, a, ln2.weight, ln2.eps)
  else
    r = x + a
    y = ln2(r)
  end
  -- (Mixtral names its MoE block_sparse_moe, Llama 4 its MLPs feed_forward)
  local m = (rawget(self, 'mlp') or rawget(self, 'block_sparse_moe') or rawget(self, 'feed_forward'))(y)
  if defer then return r, m end
  return r + m
end

local LlamaModel = nn.Module:extend('LlamaModel')

function LlamaModel:init(cfg)
  self:register_module('embed_tokens', nn.Embedding(cfg.vocab_size, cfg.hidden_size))
  local layers = {}
  for i = 1, cfg.num_hidden_layers do layers[i] = Layer(cfg, i - 1) end
  self:register_module('layers', nn.ModuleList(layers))
  self:register_module('norm', nn.RMSNorm(cfg.hidden_size, { eps = cfg.rms_norm_eps }))
end

-- input_ids (B, T) -> final hidden states (B, T, C)
-- (input_ids, true) -> x, pending: the residual stream before the final
-- norm, its last add possibly left pending (nil when not), for the LM head
-- module that holds the norm (nn.LMHead: norm(x + pending))
function LlamaModel:forward(input_ids, prenorm)
  -- moonshard.tp's sequence parallelism: the layers see this rank's tokens
  -- of the residual stream (the embedding's sums reduce-scattered to them,
  -- sp.embed), the whole of it again after the final norm
  local sp = rawget(self, '_sp')
  local x
  if sp then x = sp.embed(self.embed_tokens, input_ids) else x = self.embed_tokens(input_ids) end
  local n, deferred = #self.layers, fusable_norm(self.norm)
  for i = 1, n do deferred = deferred and self.layers[i]:deferrable() end
  local y
  if deferred and n > 0 then
    -- each layer's last residual add goes into the next norm's pass
    local pending
    for i = 1, n do x, pending = self.layers[i](x, pending, true) end
    if prenorm then return x, pending end
    local _, out = nn.functional.add_rms_norm(x, pending, self.norm.weight, self.norm.eps)
    y = out
  else
    for i = 1, n do x = self.layers[i](x) end
    if prenorm then return x end
    y = self.norm(x)
  end
  if sp then y = sp.gather(y) end
  return y
end

local Llama = nn.Module:extend('LlamaForCausalLM')
llama.LlamaForCausalLM, llama.LlamaModel, llama.Layer = Llama, LlamaModel, Layer

function Llama:init(cfg)
  self.config = cfg
  self.family = llama
  self:register_module('model', LlamaModel(cfg))
  if not cfg.tie_word_embeddings then
    self:register_module('lm_head', nn.Linear(cfg.hidden_size, cfg.vocab_size, { bias = false }))
  end
  -- the final norm and the head, called as one module (a plain field, not a
  -- child: the parameters keep their names model.norm.weight, lm_head.weight)
  rawset(self, '_head', nn.LMHead { norm = self.model.norm, name = 'lm_head',
    proj = cfg.tie_word_embeddings and self.model.embed_tokens or self.lm_head, tied = cfg.tie_word_embeddings })
end

-- the nn.LMHead the forward calls (model.norm and the head weight; fully_shard
-- makes it a unit of its own when untied)
function Llama:head_module() return rawget(self, '_head') end
-- the token embedding (moonshard.tp splits it by vocabulary rows)
function Llama:token_embedding() return self.model.embed_tokens end
-- the decoder (embeddings, layers, final norm): where moonshard.tp's
-- sequence parallelism enters and leaves
function Llama:decoder() return self.model end

function Llama:head_weight()
  if self.config.tie_word_embeddings then return self.model.embed_tokens.weight end
  return self.lm_head.weight
end
function Llama:max_positions() return self.config.max_position_embeddings end

-- model(input_ids) -> logits (B, T, V)
-- model(input_ids, targets) -> mean cross-entropy over targets ~= -100,
-- through nn.functional.lm_loss looked up at each call (FLCE replaces it).
-- The final norm and the loss (or logits) are the head module's forward
-- (nn.LMHead), so an FSDP unit's hooks can fire around them.
function Llama:forward(input_ids, targets)
  local cfg = self.config
  local ids, B, Tn = hf.check_ids(input_ids, 'llama', 'input_ids', cfg.vocab_size, cfg.max_position_embeddings)
  local box = self:seq_aux_begin(targets)
  local abox = self:aux_begin(targets)
  local x, pending = self.model(ids, true)
  if targets ~= nil then
    targets = hf.check_targets(targets, B, Tn, 'llama', cfg.vocab_size)
  end
  local out = rawget(self, '_head')(x, pending, targets)
  if box then out = nn.moe.seq_aux_end(out, box) end
  if abox then out = nn.moe.aux_end(out, abox) end
  return out
end

-- the model's MoE layers (found once: the modules do not change)
function Llama:moe_layers()
  local layers = rawget(self, '_moe_layers')
  if layers == nil then layers = nn.moe.layers(self); rawset(self, '_moe_layers', layers) end
  return layers
end

-- DeepSeek's sequence-wise balance loss (a family with seq_aux_choice:
-- DeepSeek-V2's and V3's; docs/moe.md): a forward with targets in
-- training mode whose config has aux_loss_alpha > 0 opens a session on the
-- MoE layers (nn.moe.seq_aux_begin: per sequence when seq_aux, else over
-- the forward's tokens at once, as DeepSeek's MoEGate), and the loss adds
-- its value (nn.moe.seq_aux_end); any other forward ends the last one.
-- -> the session or nil
function Llama:seq_aux_begin(targets)
  -- (none for a model without MoE layers: first_k_dense_replace past them all)
  if self.family.seq_aux_choice == nil or #self:moe_layers() == 0 then return nil end
  return nn.moe.seq_aux_begin(self:moe_layers(), self:seq_aux_options(targets ~= nil))
end
-- the session's options (nn.moe.seq_aux_begin) of a forward with targets
-- (with_targets) in the model's present mode, or nil: none (a pipeline
-- stage opens its own: moonshard.pp)
function Llama:seq_aux_options(with_targets)
  local choice = self.family.seq_aux_choice
  local cfg = self.config
  if choice == nil or not with_targets or not self.training or (cfg.aux_loss_alpha or 0) <= 0 then return nil end
  return { alpha = cfg.aux_loss_alpha, choice = choice, per_sequence = cfg.seq_aux ~= false }
end

-- Mixtral's and Qwen-MoE's load-balancing loss (output_router_logits;
-- docs/moe.md): a forward with targets opens a session on the MoE layers
-- (nn.moe.aux_begin), and the loss adds router_aux_loss_coef times the
-- loss over every layer's tokens, as transformers (nn.moe.aux_end); any
-- other forward ends the last one. A family whose transformers model
-- adds none says no_aux_loss (Llama 4). The session gives a checkpointed
-- layer its gradient in the recompute. -> the session or nil
function Llama:aux_begin(targets)
  local cfg = self.config
  local on = targets ~= nil and cfg.output_router_logits and not self.family.no_aux_loss
  local layers = self:moe_layers()
  if not on and #layers == 0 then return nil end
  return nn.moe.aux_begin(layers, on and { coef = cfg.router_aux_loss_coef } or nil)
end

-- How moonshard.pp cuts the model into stages (docs/pp.md): the layers, the
-- first stage's embedding and the last stage's norm and head (a tied head
-- is the embedding: both stages hold it), by parameter name prefixes
function Llama:pipeline_parts()
  local cfg, m = self.config, self.model
  -- (the routers' load-balancing loss over every layer, as aux_begin
  -- adds it: the pipeline carries its statistics between the stages)
  local moes = self:moe_layers()
  local aux = cfg.output_router_logits and not self.family.no_aux_loss and #moes > 0
    and { coef = cfg.router_aux_loss_coef, experts = moes[1].n_experts } or nil
  return {
    aux = aux,
    blocks = m.layers, blocks_prefix = 'model.layers.', hidden = cfg.hidden_size,
    first = { 'model.embed_tokens.' },
    last = { 'model.norm.', cfg.tie_word_embeddings and 'model.embed_tokens.' or 'lm_head.' },
    embed = function(ids) return m.embed_tokens(ids) end,
    -- (under moonshard.tp's sequence parallelism: this rank's rows, the
    -- embedding's sums reduce-scattered to them)
    embed_rows = function(ids, sp) return sp.embed(m.embed_tokens, ids) end,
    head = function(x, targets) return rawget(self, '_head')(x, nil, targets) end,
    check = function(ids, targets)
      local _, B, Tn = hf.check_ids(ids, 'llama', 'input_ids', cfg.vocab_size, cfg.max_position_embeddings, 3)
      if targets ~= nil then hf.check_targets(targets, B, Tn, 'llama', cfg.vocab_size, 3) end
    end,
  }
end

function Llama:last_logits(input_ids)
  local cfg = self.config
  local ids, _, Tn = hf.check_ids(input_ids, 'llama', 'input_ids', cfg.vocab_size, cfg.max_position_embeddings)
  local h = self.model(ids):narrow(2, Tn, 1):squeeze(2)
  return rawget(self, '_head'):logits(h)
end

function Llama:generate(ids, n, opts) return hf.generate(self, ids, n, opts) end
function Llama:save_pretrained(dir, opts) return hf.save_pretrained(self, dir, opts) end

-- HF's initialisation: normal(0, initializer_range) for projections and
-- embeddings, zeros for biases, ones for RMSNorm weights.
function Llama:init_weights()
  local std = self.config.initializer_range
  for name, p in self:named_parameters() do
    if name:match('norm%.weight$') then p:copy_(1)
    elseif name:match('%.bias$') then p:copy_(0)
    else ms.normal_(p, 0, std) end
  end
  return self
end

-- ------------------------------------------------------------ entry points
-- llama.new(preset name | config table [, overrides]) -> a model with fresh
-- weights (HF's initialisation, from the global generator: ms.manual_seed)
function llama.new(config, overrides)
  local cfg
  if type(config) == 'string' then cfg = hf.config(llama, config, overrides)
  else cfg = hf.config(llama, nil, config, nil, overrides) end
  return llama.build(cfg):init_weights()
end

function llama.build(cfg) return Llama(cfg) end

function llama.from_pretrained(dir, opts) return hf.from_pretrained(llama, dir, opts) end

-- A tied checkpoint may carry lm_head.weight next to embed_tokens; HF drops
-- it on load, and so do we.
function llama.fix_state_dict(sd, cfg)
  if cfg.tie_word_embeddings and sd['model.embed_tokens.weight'] then sd['lm_head.weight'] = nil end
  return sd
end

-- a scaled RoPE also as rope_scaling, where transformers < 5 reads it
local function legacy_rope(cfg)
  local rp = cfg.rope_parameters
  if (rp.rope_type or 'default') == 'default' then return end
  local rs = {}
  for k, v in pairs(rp) do if k ~= 'rope_theta' then rs[k] = v end end
  rs.type = rp.rope_type
  cfg.rope_scaling = rs
end

-- config.json as transformers writes it for LlamaForCausalLM (rope_theta is
-- also written at the top level, and a scaled RoPE as rope_scaling, where
-- transformers < 5 looks for them)
function llama.export_config(cfg)
  cfg.architectures = { 'LlamaForCausalLM' }
  cfg.model_type = 'llama'
  cfg.rope_theta = cfg.rope_parameters.rope_theta
  legacy_rope(cfg)
  cfg.head_dim = cfg.head_dim or math.floor(cfg.hidden_size / cfg.num_attention_heads)
  cfg.num_key_value_heads = cfg.num_key_value_heads or cfg.num_attention_heads
  cfg.hidden_act = 'silu'
  cfg.pretraining_tp = 1
  if cfg.bos_token_id == nil then cfg.bos_token_id = hf.null end
  if cfg.eos_token_id == nil then cfg.eos_token_id = hf.null end
  return cfg
end

-- llama.decoder_family(fam, arch, extra): the entry points of a family
-- built on this decoder (mixtral, qwen3_moe, qwen2_moe): build (a
-- LlamaForCausalLM whose family is fam), new, from_pretrained,
-- fix_state_dict, and export_config (config.json as transformers writes it
-- for architecture `arch`; extra(cfg) adds the family's own fields)
function llama.decoder_family(fam, arch, extra)
  function fam.build(cfg)
    local m = Llama(cfg)
    m.family = fam
    return m
  end
  function fam.new(config, overrides)
    local cfg
    if type(config) == 'string' then cfg = hf.config(fam, config, overrides)
    else cfg = hf.config(fam, nil, config, nil, overrides) end
    return fam.build(cfg):init_weights()
  end
  function fam.from_pretrained(dir, opts) return hf.from_pretrained(fam, dir, opts) end
  fam.fix_state_dict = llama.fix_state_dict
  function fam.export_config(cfg)
    cfg.architectures = { arch }
    cfg.model_type = fam.model_type
    cfg.rope_theta = cfg.rope_parameters.rope_theta
    legacy_rope(cfg)
    cfg.head_dim = cfg.head_dim or math.floor(cfg.hidden_size / cfg.num_attention_heads)
    cfg.num_key_value_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    cfg.hidden_act = 'silu'
    if cfg.bos_token_id == nil then cfg.bos_token_id = hf.null end
    if cfg.eos_token_id == nil then cfg.eos_token_id = hf.null end
    if extra then extra(cfg) end
    return cfg
  end
  return fam
end

return llama
