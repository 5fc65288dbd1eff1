-- moonshard.nn.mla — multi-head latent attention (DeepSeek-V2, Liu et al.
-- 2024; DeepSeek-V3), as Hugging Face's DeepseekV3Attention: the same
-- parameter names and math (docs/models.md, "DeepSeek-V3").
--
-- nn.MLAttention{dim, n_head, q_lora_rank = nil, kv_lora_rank,
--   qk_nope_head_dim, qk_rope_head_dim, v_head_dim, bias = false,
--   rope = 10000 (a theta, or nnf.yarn_rope's table), rope_interleave = true,
--   scale = (qk_nope_head_dim + qk_rope_head_dim)^-0.5, norm_eps = 1e-6,
--   unfused = false, dtype, device}
--
-- x (B, T, dim):
--   q   = q_b_proj(q_a_layernorm(q_a_proj(x)))   (q_proj(x) without q_lora_rank)
--         per head: nope (qk_nope_head_dim) | rope (qk_rope_head_dim)
--   ckv = kv_a_proj_with_mqa(x): the latent (kv_lora_rank) | one rope key
--         (qk_rope_head_dim) all the heads share
--   kv  = kv_b_proj(kv_a_layernorm(latent)), per head: k nope | v (v_head_dim)
--   RoPE on q's rope part and the shared key (rope_interleave: their
--   dimensions in (even, odd) pairs, as DeepSeek's checkpoints lay them out:
--   the pairs are gathered into halves first, so the rotation is the usual
--   rotate-half one); k = k nope | the shared rope key, for every head;
--   causal softmax(q kᵀ · scale) v, heads merged, o_proj.
-- bias: q_a_proj, kv_a_proj_with_mqa and o_proj get biases (HF's
-- attention_bias). The q_a and kv_a norms take norm_eps (HF's default 1e-6,
-- not the config's rms_norm_eps).
--
-- The attention is nnf.scaled_dot_product_attention with q/k and v at their
-- own head widths (the fused kernel takes v narrower than q/k: DeepSeek-V3's
-- 192 and 128 run as they are; widths a GPU's kernels lack are padded there,
-- docs/nn.md); unfused = true, or the field set later, asks for the unfused
-- path (scores materialised) everywhere. Context parallelism (cp.apply) rings
-- it as it rings nn.CausalSelfAttention (not with unfused); tensor
-- parallelism (moonshard.tp) splits it by heads, the latents replicated.
local T = require 'moonshard.tensor'
local A = require 'moonshard.autograd'
local W = A.W

local mla = {}

-- the gathered latents g (B, T, q1 + k1 + dr) -> their three views (q's,
-- kv's, the rotary key's); backward: the three gradients copied into one
-- buffer of g's shape, which the gather's reduce-scatter then sums. (Three
-- recorded narrows cost, each micro-batch and layer, three zero-filled
-- buffers of g's whole width and two adds of them: docs/perf-notes.md,
-- "Sequence parallelism under --pp, op by op".)
local SplitLatents = A.Function {
  name = 'mla_split_latents',
  forward = function(ctx, g, q1, k1, dr)
    ctx.shape, ctx.widths = g.shape, { q1, k1, dr }
    return g:narrow(3, 1, q1), g:narrow(3, q1 + 1, k1), g:narrow(3, q1 + k1 + 1, dr)
  end,
  backward = function(ctx, ...)
    local gs = { ... }   -- (a missing one: zeros, from the autograd)
    local full = T.empty(ctx.shape, { dtype = gs[1].dtype, device = gs[1].device })
    local off = 1
    for i, w in ipairs(ctx.widths) do
      local v = full:narrow(3, off, w)
      v:copy_(gs[i])
      v:free()
      off = off + w
    end
    return full, nil, nil, nil
  end,
}

function mla.install(nn, nnf)
  local MLA = nn.Module:extend('MLAttention')
  nn.MLAttention = MLA

  local function pos_int(what, v, optional)
    if optional and v == nil then return end
    if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
      error(('MLAttention: %s must be a positive integer, got %s'):format(what, tostring(v)), 4)
    end
  end

  function MLA:init(cfg)
    cfg = cfg or {}
    for _, f in ipairs({ 'dim', 'n_head', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim' }) do
      pos_int(f, cfg[f])
    end
    pos_int('q_lora_rank', cfg.q_lora_rank, true)
    if cfg.qk_rope_head_dim % 2 ~= 0 then
      error(('MLAttention: RoPE needs an even qk_rope_head_dim, got %d'):format(cfg.qk_rope_head_dim), 3)
    end
    local rope = cfg.rope or 10000
    if not (type(rope) == 'number' and rope > 0) and not (type(rope) == 'table' and rope.key and rope.inv) then
      error(('MLAttention: rope must be a positive theta or nnf.yarn_rope\'s table, got %s'):format(tostring(rope)), 3)
    end
    if type(rope) == 'table' and #rope.inv ~= cfg.qk_rope_head_dim / 2 then
      error(('MLAttention: rope has %d frequencies for qk_rope_head_dim %d'):format(#rope.inv, cfg.qk_rope_head_dim), 3)
    end
    self.dim, self.n_head = cfg.dim, cfg.n_head
    self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
    self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
      cfg.v_head_dim
    self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    self.rope, self.rope_interleave = rope, cfg.rope_interleave ~= false
    self.scale = cfg.scale or 1 / math.sqrt(self.qk_head_dim)
    self.unfused = cfg.unfused == true or nil
    local eps = cfg.norm_eps or 1e-6
    local bias = cfg.bias == true
    local H, dq = cfg.n_head, self.qk_head_dim
    local function L(i, o, b) return nn.Linear(i, o, { bias = b, dtype = cfg.dtype, device = cfg.device }) end
    if cfg.q_lora_rank then
      self:register_module('q_a_proj', L(cfg.dim, cfg.q_lora_rank, bias))
      self:register_module('q_a_layernorm', nn.RMSNorm(cfg.q_lora_rank, { eps = eps, dtype = cfg.dtype,
        device = cfg.device }))
      self:register_module('q_b_proj', L(cfg.q_lora_rank, H * dq, false))
    else
      self:register_module('q_proj', L(cfg.dim, H * dq, false))
    end
    self:register_module('kv_a_proj_with_mqa', L(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias))
    self:register_module('kv_a_layernorm', nn.RMSNorm(cfg.kv_lora_rank, { eps = eps, dtype = cfg.dtype,
      device = cfg.device }))
    self:register_module('kv_b_proj', L(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), false))
    self:register_module('o_proj', L(H * cfg.v_head_dim, cfg.dim, bias))
  end

  -- the latents of x (..., dim): q's (after its norm; nil without
  -- q_lora_rank), kv's (after its norm) and the shared rotary key's
  local function latents(self, x)
    local nd, kl = x.ndim, self.kv_lora_rank
    local ql = self.q_lora_rank and self.q_a_layernorm(self.q_a_proj(x)) or nil
    local ckv = self.kv_a_proj_with_mqa(x)                               -- (..., kv_lora_rank + dr)
    return ql, self.kv_a_layernorm(ckv:narrow(nd, 1, kl)), ckv:narrow(nd, kl + 1, self.qk_rope_head_dim)
  end

  local function same(t) return t end   -- (one function for every call: a closure made per call is not compiled)

  function MLA:forward(x)
    -- tensor parallelism (moonshard.tp): this rank's heads; the latents
    -- replicated, their gradient parts summed where they enter the split
    -- projections (sum). Under sequence parallelism x is this rank's rows:
    -- with q_lora_rank the latents are computed on them and gathered (one
    -- all-gather of q_lora_rank + kv_lora_rank + dr features a token, not
    -- x's dim; its backward's reduce-scatter sums the split projections'
    -- parts, and the latent layers' weight gradients, partial then, are
    -- summed by tp's sequence-parallel hooks); without it, x is gathered
    local tp = rawget(self, '_tp')
    local H = self.n_head
    local sum = same
    local ql, kvl, kpe
    if tp ~= nil then
      H = tp.n_head
      local sp = tp.sp
      if tp.latent_gather and sp.active and T.is_tensor(x) and x.ndim == 2 and x.shape[2] == self.dim then
        local a, b, c = latents(self, x)
        local g = sp.enter(W.cat({ a, b, c }, 2))                        -- (B, T, q_lora + kv_lora + dr)
        ql, kvl, kpe = SplitLatents(g, self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim)
        x = g
      else
        sum = tp.sum
        x = require('moonshard.tp').gathered(x, tp)
      end
    end
    if not T.is_tensor(x) or x.ndim ~= 3 or (not kvl and x.shape[3] ~= self.dim) then
      error(('MLAttention: expected x of shape (B, T, %d), got (%s)'):format(self.dim,
        T.is_tensor(x) and table.concat(x.shape, ', ') or type(x)), 2)
    end
    local B, Tn = x.shape[1], x.shape[2]
    local dn, dr, dv, dq = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.qk_head_dim
    if not kvl then ql, kvl, kpe = latents(self, x) end
    local q
    if ql then q = self.q_b_proj(sum(ql))
    else q = self.q_proj(sum(x)) end
    q = q:view(B, Tn, H, dq)
    local kv = self.kv_b_proj(sum(kvl))
    kv = kv:view(B, Tn, H, dn + dv)
    local q_rot = q:narrow(4, dn + 1, dr)                                -- (B, T, H, dr)
    local k_rot = sum(kpe):reshape(B, Tn, 1, dr)
    if self.rope_interleave then q_rot, k_rot = nnf.pairs_to_halves(q_rot), nnf.pairs_to_halves(k_rot) end
    q_rot, k_rot = q_rot:transpose(2, 3), k_rot:transpose(2, 3)          -- (B, H, T, dr), (B, 1, T, dr)
    local cpc = rawget(self, '_cp')
    local cdt = q.dtype == 'f64' and 'f64' or 'f32'
    local cos, sin
    if cpc then cos, sin = cpc:rope(Tn, dr, self.rope, cdt, q.device_id, q.dtype)
    else cos, sin = nnf.rope_cache(Tn, dr, self.rope, cdt, q.device_id, q.dtype) end
    q_rot, k_rot = nnf.apply_rotary(q_rot, cos, sin), nnf.apply_rotary(k_rot, cos, sin)
    local qh = W.cat({ q:narrow(4, 1, dn):transpose(2, 3), q_rot }, 4)   -- (B, H, T, dq)
    local kh = W.cat({ kv:narrow(4, 1, dn):transpose(2, 3), k_rot:expand(B, H, Tn, dr) }, 4)
    local vh = kv:narrow(4, dn + 1, dv):transpose(2, 3)                  -- (B, H, T, dv)
    if cpc and self.unfused then
      error('MLAttention: context parallelism rings the fused attention; unfused = true asks for the unfused path', 2)
    end
    local y
    if cpc then y = require('moonshard.cp').attention(qh, kh, vh, cpc, { scale = self.scale })
    else y = nnf.scaled_dot_product_attention(qh, kh, vh, { causal = true, scale = self.scale, unfused = self.unfused }) end
    y = y:transpose(2, 3):reshape(B, Tn, H * dv)                         -- (B, T, H * dv)
    return self.o_proj(y)
  end

  function MLA:extra_repr()
    return ('dim=%d, n_head=%d, q_lora_rank=%s, kv_lora_rank=%d, qk_nope=%d, qk_rope=%d, v=%d%s'):format(self.dim,
      self.n_head, tostring(self.q_lora_rank), self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
      self.v_head_dim, self.rope_interleave and ', interleaved RoPE' or '')
  end
end

return mla
