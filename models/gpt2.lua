-- models/gpt2.lua — GPT-2 (Radford et al. 2019), as Hugging Face's
-- GPT2LMHeadModel: the same config.json fields, the same parameter names and
-- layouts (Conv1D weights stored (in, out)), the LM head tied to wte.
--
--   local gpt2 = require 'models.gpt2'
--   local model = gpt2.new('tiny')                      -- a preset, or a config table
--   local model = gpt2.new{ n_layer = 2, n_embd = 64, vocab_size = 256 }
--   local model = gpt2.from_pretrained('path/to/gpt2')  -- config.json + model.safetensors
--   local logits = model(input_ids)                     -- (B, T) i64 -> (B, T, V)
--   local loss = model(input_ids, targets)              -- mean CE over targets ~= -100
--   local out = model:generate(ids, 50, { temperature = 0.8, top_k = 40, seed = 1 })
--   model:save_pretrained('out/dir')                    -- HF transformers loads it back
--
-- Structure (HF names):
--   transformer.wte (V, C)  transformer.wpe (n_positions, C)
--   transformer.h.N: ln_1 -> attn (c_attn: C -> 3C, c_proj) -> +, ln_2 -> mlp (c_fc, c_proj, GELU tanh) -> +
--   transformer.ln_f, then logits = h @ wte^T (no lm_head.weight of its own)
local ms = require 'moonshard'
local nn = require 'moonshard.nn'
local hf = require 'models.hf'

local gpt2 = { name = 'gpt2', model_type = 'gpt2' }

-- Config fields: { name, type, default, meaning } (types: models/hf.lua).
gpt2.fields = {
  { 'model_type', { 'gpt2' }, 'gpt2', 'always gpt2' },
  { 'vocab_size', 'int>0', 50257, 'tokens in the vocabulary' },
  { 'n_positions', 'int>0', 1024, 'longest sequence (learned positions)' },
  { 'n_embd', 'int>0', 768, 'width of the residual stream' },
  { 'n_layer', 'int>0', 12, 'transformer blocks' },
  { 'n_head', 'int>0', 12, 'attention heads' },
  { 'n_inner', 'int>0?', nil, 'MLP width; nil (null) means 4 * n_embd' },
  { 'activation_function', { 'gelu_new', 'gelu_pytorch_tanh' }, 'gelu_new', 'MLP activation (the tanh GELU)' },
  { 'resid_pdrop', 'prob', 0.1, 'dropout after each residual branch' },
  { 'embd_pdrop', 'prob', 0.1, 'dropout after the embeddings' },
  { 'attn_pdrop', 'prob', 0.1, 'dropout on attention probabilities' },
  { 'layer_norm_epsilon', 'number>0', 1e-5, 'LayerNorm epsilon' },
  { 'initializer_range', 'number>=0', 0.02, 'std of the normal initialisation' },
  { 'scale_attn_weights', { true }, true, 'scores / sqrt(head_dim) (false is not supported)' },
  { 'scale_attn_by_inverse_layer_idx', { false }, false, 'not supported' },
  { 'reorder_and_upcast_attn', 'bool', false, 'numerics only; attention is computed in f32 or wider' },
  { 'add_cross_attention', { false }, false, 'not supported' },
  { 'tie_word_embeddings', { true }, true, 'the LM head is wte (GPT-2 checkpoints have no lm_head.weight)' },
  { 'bos_token_id', 'ids?', 50256, 'beginning of text' },
  { 'eos_token_id', 'ids?', 50256, 'end of text' },
}
gpt2.config = hf.defaults(gpt2.fields)

gpt2.presets = {
  -- a byte-level model that trains on a laptop CPU in minutes
  tiny = { vocab_size = 256, n_positions = 256, n_embd = 128, n_layer = 4, n_head = 4,
           resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null },
  -- the shapes of openai-community/gpt2 (124M parameters)
  ['gpt2-124m'] = {},
  ['gpt2-350m'] = { n_embd = 1024, n_layer = 24, n_head = 16 },
}
gpt2.presets.gpt2 = gpt2.presets['gpt2-124m']

function gpt2.check(cfg)
  if cfg.n_embd % cfg.n_head ~= 0 then
    error(('gpt2 config: n_embd (%d) must be a multiple of n_head (%d)'):format(cfg.n_embd, cfg.n_head), 3)
  end
end

-- ------------------------------------------------------------------ model
local Block = nn.Module:extend('GPT2Block')

function Block:init(cfg)
  local C = cfg.n_embd
  self:register_module('ln_1', nn.LayerNorm(C, { eps = cfg.layer_norm_epsilon }))
  self:register_module('attn', nn.CausalSelfAttention{ dim = C, n_head = cfg.n_head, bias = true,
                                                       fused_qkv = true })
  self:register_module('ln_2', nn.LayerNorm(C, { eps = cfg.layer_norm_epsilon }))
  self:register_module('mlp', nn.MLP{ dim = C, hidden = cfg.n_inner or 4 * C, conv1d = true })
  self:register_module('drop', nn.Dropout(cfg.resid_pdrop))
end

-- a LayerNorm that can take the residual add before it (nnf.add_layer_norm)
local function fusable_norm(ln) return getmetatable(ln) == nn.LayerNorm and nn.plain(ln) end

-- true when the model may call this block with a deferred residual add
-- (block(x, pending, true), below): exactly a GPT2Block with its own
-- forward, norms that take the add (no hooks on them), and only passive
-- forward hooks on the block (FSDP's: they do not touch inputs or outputs)
function Block:deferrable()
  return getmetatable(self) == Block and rawget(self, 'forward') == nil and nn.passive_hooks_only(self)
    and fusable_norm(self.ln_1) and fusable_norm(self.ln_2)
end

-- block(x) -> x + attn(ln_1(x)) + mlp(ln_2(...)), the block's output.
-- block(x, pending, true) -> r, m with the output r + m left unsummed for
-- the next norm, the input being x + pending (the previous block's deferred
-- add, done here with ln_1 in one pass; pending may be nil): the model's
-- deferred residual adds, one pass over the f32 stream fewer a block
function Block:forward(x, pending, defer)
  local ln1, ln2 = self.ln_1, self.ln_2
  local h
  if pending ~= nil then
    x, h = nn.functional.add_layer_norm(x, pending, ln1.weight, ln1.bias, ln1.eps)
  else
    h = ln1(x)
  end
  local a = self.drop(self.attn(h))
  local r, y
  if fusable_norm(ln2) then
    -- the residual add and ln_2 in one node (one pass on CUDA)
    r, y = nn.functional.add_layer_norm(x, a, ln2.weight, ln2.bias, ln2.eps)
  else
    r = x + a
    y = ln2(r)
  end
  local m = self.drop(self.mlp(y))
  if defer then return r, m end
  return r + m
end

local GPT2Model = nn.Module:extend('GPT2Model')

function GPT2Model:init(cfg)
  self:register_module('wte', nn.Embedding(cfg.vocab_size, cfg.n_embd))
  self:register_module('wpe', nn.Embedding(cfg.n_positions, cfg.n_embd))
  self:register_module('drop', nn.Dropout(cfg.embd_pdrop))
  local blocks = {}
  for i = 1, cfg.n_layer do blocks[i] = Block(cfg) end
  self:register_module('h', nn.ModuleList(blocks))
  self:register_module('ln_f', nn.LayerNorm(cfg.n_embd, { eps = cfg.layer_norm_epsilon }))
end

-- input_ids (B, T) -> the residual stream after the embeddings (B, T, C);
-- with sp (moonshard.tp's sequence parallelism, its ends reduce-scattered)
-- this rank's rows of it (n, C) when B·T divides over its group: wte's
-- sums reduce-scattered to them (sp.embed), the position embeddings of
-- those rows added (wpe's gradient then a part, summed over the group as
-- the norms' are: tp_sp_partial_ends), dropout on the rows (the whole
-- stream's mask, tp's Dropout); else the whole, as without it
function GPT2Model:embed(input_ids, sp)
  local Tn = input_ids.shape[2]
  local cpc = rawget(self, '_cp')   -- moonshard.cp: this rank's tokens, at their positions
  local pe
  if cpc then
    if Tn * cpc.size > self.wpe.num_embeddings then
      error(('gpt2: %d tokens a rank x %d context-parallel ranks is more than n_positions %d'):format(Tn, cpc.size,
        self.wpe.num_embeddings), 3)
    end
    pe = self.wpe(cpc:positions(Tn, input_ids.device))
  else
    local pos = ms.arange(Tn, { dtype = 'i64', device = input_ids.device })
    pe = self.wpe(pos)
    pos:free()   -- (the embedding keeps its own handle for its backward)
  end
  if sp then
    local e = sp.embed(self.wte, input_ids)
    if sp.active then
      local B, C = input_ids.shape[1], e.shape[2]
      local whole = pe:unsqueeze(1):expand({ B, Tn, C }):reshape({ B * Tn, C })
      local x = e + whole:narrow(1, sp.rank * sp.n + 1, sp.n)
      return self.drop(x)
    end
    return self.drop(e + pe)
  end
  return self.drop(self.wte(input_ids) + pe)
end
-- (moonshard.tp: wpe runs on this rank's rows under sequence parallelism
-- with its ends reduce-scattered, embed's sp)
GPT2Model.tp_sp_partial_ends = { 'wpe' }

-- input_ids (B, T) -> final hidden states (B, T, C)
-- (input_ids, true): under moonshard.tp's sequence parallelism this rank's
-- rows of them (n, C), for the head to gather (nn.LMHead: the loss's
-- gradient then reduce-scattered, sp.gather_for_loss)
function GPT2Model:forward(input_ids, rows)
  -- moonshard.tp's sequence parallelism: the blocks see this rank's tokens
  -- of the residual stream (the embeddings' rows, embed's sp), the whole
  -- of it again after ln_f
  local sp = rawget(self, '_sp')
  local x
  if sp and sp.ends_rs then x = self:embed(input_ids, sp)
  else
    x = self:embed(input_ids)
    if sp then x = sp.scatter(x) end
  end
  local n, deferred = #self.h, fusable_norm(self.ln_f)
  for i = 1, n do deferred = deferred and self.h[i]:deferrable() end
  local y
  if deferred and n > 0 then
    -- every residual add but the attention's goes into the next norm's pass
    -- (ln_1 of the next block, ln_f after the last): one pass fewer a block
    local pending
    for i = 1, n do x, pending = self.h[i](x, pending, true) end
    local lf = self.ln_f
    local _, out = nn.functional.add_layer_norm(x, pending, lf.weight, lf.bias, lf.eps)
    y = out
  else
    for i = 1, n do x = self.h[i](x) end
    y = self.ln_f(x)
  end
  if sp and not rows then y = sp.gather(y) end
  return y
end

local GPT2 = nn.Module:extend('GPT2LMHeadModel')
gpt2.GPT2LMHeadModel, gpt2.GPT2Model, gpt2.Block = GPT2, GPT2Model, Block

function GPT2:init(cfg)
  self.config = cfg
  self.family = gpt2
  self:register_module('transformer', GPT2Model(cfg))
  -- the head, called as a module (nn.LMHead, a plain field: it owns no
  -- parameters). Tied to wte, so no norm in it: ln_f stays the end of
  -- transformer's forward, and under fully_shard the head stays in the root
  -- with wte, exactly as before the head was a module.
  rawset(self, '_head', nn.LMHead { proj = self.transformer.wte, tied = true, name = 'lm_head' })
end

-- the nn.LMHead the forward calls (tied: no unit of its own under fully_shard)
function GPT2:head_module() return rawget(self, '_head') end

-- the LM head weight (V, C): tied to the token embedding
function GPT2:head_weight() return self.transformer.wte.weight end
-- the token embedding (moonshard.tp splits it by vocabulary rows)
function GPT2:token_embedding() return self.transformer.wte end
-- the decoder (embeddings, blocks, ln_f): where moonshard.tp's sequence
-- parallelism enters and leaves
function GPT2:decoder() return self.transformer end
function GPT2:max_positions() return self.config.n_positions end

-- model(input_ids) -> logits (B, T, V)
-- model(input_ids, targets) -> mean cross-entropy over targets ~= -100
-- The loss goes through nn.functional.lm_loss, looked up at each call, so a
-- fused linear cross-entropy can replace it without touching this file.
function GPT2:forward(input_ids, targets)
  local cfg = self.config
  local ids, B, Tn = hf.check_ids(input_ids, 'gpt2', 'input_ids', cfg.vocab_size, cfg.n_positions)
  -- (with targets, under sequence parallelism: this rank's rows, the head
  -- gathers them)
  local h = self.transformer(ids, targets ~= nil)
  if targets ~= nil then
    targets = hf.check_targets(targets, B, Tn, 'gpt2', cfg.vocab_size)
  end
  return rawget(self, '_head')(h, nil, targets)
end

-- How moonshard.pp cuts the model into stages (docs/pp.md): the blocks, the
-- first stage's embeddings and the last stage's ln_f and head (the head is
-- tied to wte: both stages hold it), by parameter name prefixes
function GPT2:pipeline_parts()
  local cfg, tr = self.config, self.transformer
  return {
    blocks = tr.h, blocks_prefix = 'transformer.h.', hidden = cfg.n_embd,
    first = { 'transformer.wte.', 'transformer.wpe.' },
    last = { 'transformer.ln_f.', 'transformer.wte.' },
    embed = function(ids) return tr:embed(ids) end,
    -- (under moonshard.tp's sequence parallelism: this rank's rows, wte's
    -- sums reduce-scattered to them; the whole when its ends are not)
    embed_rows = function(ids, sp)
      if sp.ends_rs then return tr:embed(ids, sp) end
      return sp.scatter(tr:embed(ids))
    end,
    head = function(x, targets) return rawget(self, '_head')(tr.ln_f(x), nil, targets) end,
    check = function(ids, targets)
      local _, B, Tn = hf.check_ids(ids, 'gpt2', 'input_ids', cfg.vocab_size, cfg.n_positions, 3)
      if targets ~= nil then hf.check_targets(targets, B, Tn, 'gpt2', cfg.vocab_size, 3) end
    end,
  }
end

-- logits of the last position only, (B, V): what generate needs
function GPT2:last_logits(input_ids)
  local ids, _, Tn = hf.check_ids(input_ids, 'gpt2', 'input_ids', self.config.vocab_size, self.config.n_positions)
  local h = self.transformer(ids):narrow(2, Tn, 1):squeeze(2)
  return rawget(self, '_head'):logits(h)
end

function GPT2:generate(ids, n, opts) return hf.generate(self, ids, n, opts) end
function GPT2:save_pretrained(dir, opts) return hf.save_pretrained(self, dir, opts) end

-- HF's initialisation: normal(0, initializer_range) for weights and
-- embeddings, zeros for biases, ones for LayerNorm weights, and the residual
-- projections (attn.c_proj, mlp.c_proj) scaled by 1/sqrt(2 * n_layer).
function GPT2:init_weights()
  local std = self.config.initializer_range
  local proj_std = std / math.sqrt(2 * self.config.n_layer)
  for name, p in self:named_parameters() do
    if name:match('%.ln_[12f]%.weight$') or name:match('ln_f%.weight$') then
      p:copy_(1)
    elseif name:match('%.bias$') then
      p:copy_(0)
    elseif name:match('c_proj%.weight$') then
      ms.normal_(p, 0, proj_std)
    else
      ms.normal_(p, 0, std)
    end
  end
  return self
end

-- ------------------------------------------------------------ entry points
-- gpt2.new(preset name | config table [, overrides]) -> a model with fresh
-- weights (HF's initialisation, from the global generator: ms.manual_seed)
function gpt2.new(config, overrides)
  local cfg
  if type(config) == 'string' then cfg = hf.config(gpt2, config, overrides)
  else cfg = hf.config(gpt2, nil, config, nil, overrides) end
  return gpt2.build(cfg):init_weights()
end

-- the model for a validated config, weights left as the nn modules made them
function gpt2.build(cfg) return GPT2(cfg) end

function gpt2.from_pretrained(dir, opts) return hf.from_pretrained(gpt2, dir, opts) end

-- Older GPT-2 checkpoints (openai-community/gpt2 itself) name parameters
-- without the 'transformer.' prefix, keep the causal-mask buffers attn.bias /
-- attn.masked_bias, and some save lm_head.weight next to wte: map those onto
-- the names above; anything else goes to the strict loader as it is.
function gpt2.fix_state_dict(sd, cfg)
  local out = {}
  for k, v in pairs(sd) do
    local name = k
    if not name:match('^transformer%.') and not name:match('^lm_head%.') then name = 'transformer.' .. name end
    if name:match('%.attn%.bias$') or name:match('%.attn%.masked_bias$') or name == 'lm_head.weight' then
      name = nil
    end
    if name then out[name] = v end
  end
  return out
end

-- config.json as transformers writes it for GPT2LMHeadModel
function gpt2.export_config(cfg)
  cfg.architectures = { 'GPT2LMHeadModel' }
  cfg.model_type = 'gpt2'
  if cfg.n_inner == nil then cfg.n_inner = hf.null end
  if cfg.bos_token_id == nil then cfg.bos_token_id = hf.null end
  if cfg.eos_token_id == nil then cfg.eos_token_id = hf.null end
  return cfg
end

return gpt2
