-- models/deepseek_v3.lua and nn.MLAttention (docs/models.md, "DeepSeek-V3"):
-- golden runs against transformers' DeepseekV3ForCausalLM (spec/fixtures,
-- made by tools/make_deepseek_fixture.py: q through the low-rank pair with
-- interleaved RoPE; q_proj with rotate-half RoPE and biases; YaRN past the
-- original context), logits, loss and every gradient within 1e-6 relative
-- in f64 and 1e-5 in f32; the latent attention against its math written
-- out with plain ops (f64, 1e-12) in every layout, and float64 finite
-- differences; YaRN's frequencies against their formula; configs, legacy
-- config.json fields, the save/load round trip with transformers' names,
-- the checkpoint's MTP layers skipped and FP8 ones refused; the routing
-- biases moved by --moe-bias-rate; bin/train on one process and on two
-- ranks (FSDP, expert parallel, both, context parallel); multi-token
-- prediction (its depths against their formula; bin/train, --tp 2 and
-- --cp 2 on the one-process curve, --pp refused).
local ms = require 'moonshard'
local A = ms.autograd
local nn = ms.nn
local nnf = nn.functional
local hf = require 'models.hf'
local ds = require 'models.deepseek_v3'
local S = require 'spec.support'
local q = S.shell_quote

local fixtures = require('moonshard.tensor').root .. '/spec/fixtures'

-- a small config (vocabulary 40)
local function small(over)
  local cfg = { vocab_size = 40, hidden_size = 16, intermediate_size = 20, moe_intermediate_size = 12,
    num_hidden_layers = 3, num_attention_heads = 2, n_shared_experts = 1, n_routed_experts = 4,
    routed_scaling_factor = 1.5, kv_lora_rank = 8, q_lora_rank = 12, qk_rope_head_dim = 4, v_head_dim = 6,
    qk_nope_head_dim = 4, n_group = 2, topk_group = 1, num_experts_per_tok = 2, first_k_dense_replace = 1,
    max_position_embeddings = 16, bos_token_id = hf.null, eos_token_id = hf.null }
  for k, v in pairs(over or {}) do cfg[k] = v end
  return cfg
end

-- MLA's forward written out: projections, the norms, the pairs gathered
-- (interleave), RoPE as rotate-half, scores, causal softmax, values
local function mla_reference(att, x)
  return A.no_grad(function()
    local B, Tn = x.shape[1], x.shape[2]
    local H, dn, dr, dv = att.n_head, att.qk_nope_head_dim, att.qk_rope_head_dim, att.v_head_dim
    local function rms(t, w, eps) return t / ((t * t):mean(t.ndim, true) + eps):sqrt() * w end
    local qf
    if att.q_lora_rank then
      qf = att.q_b_proj(rms(att.q_a_proj(x), att.q_a_layernorm.weight, att.q_a_layernorm.eps))
    else
      qf = att.q_proj(x)
    end
    qf = qf:reshape(B, Tn, H, dn + dr)
    local ckv = att.kv_a_proj_with_mqa(x)
    local lat = rms(ckv:narrow(3, 1, att.kv_lora_rank), att.kv_a_layernorm.weight, att.kv_a_layernorm.eps)
    local kv = att.kv_b_proj(lat):reshape(B, Tn, H, dn + dv)
    -- rope dims: (even, odd) pairs rotated by one frequency each when
    -- interleaved (transformers' formula), halves otherwise
    local inv = {}
    local rope = att.rope
    for i = 0, dr / 2 - 1 do
      inv[i + 1] = type(rope) == 'table' and rope.inv[i + 1] or 1 / rope ^ (2 * i / dr)
    end
    local mult = type(rope) == 'table' and rope.factor or 1
    local function rot(t)   -- t (B, T, heads, dr) -> (B, T, heads, dr)
      local out = ms.zeros(t.shape, { dtype = 'f64' })
      for p = 0, Tn - 1 do
        for i = 0, dr / 2 - 1 do
          local c, s = math.cos(p * inv[i + 1]) * mult, math.sin(p * inv[i + 1]) * mult
          local a, b
          if att.rope_interleave then a, b = 2 * i + 1, 2 * i + 2 else a, b = i + 1, i + 1 + dr / 2 end
          local x1 = t:narrow(2, p + 1, 1):narrow(4, a, 1)
          local x2 = t:narrow(2, p + 1, 1):narrow(4, b, 1)
          out:narrow(2, p + 1, 1):narrow(4, i + 1, 1):copy_(x1 * c - x2 * s)
          out:narrow(2, p + 1, 1):narrow(4, i + 1 + dr / 2, 1):copy_(x2 * c + x1 * s)
        end
      end
      return out
    end
    local qr = rot(qf:narrow(4, dn + 1, dr):contiguous())
    local kr = rot(ckv:narrow(3, att.kv_lora_rank + 1, dr):reshape(B, Tn, 1, dr):contiguous())
    local qh = ms.cat({ qf:narrow(4, 1, dn), qr }, 4):transpose(2, 3)
    local kh = ms.cat({ kv:narrow(4, 1, dn), kr:expand(B, Tn, H, dr) }, 4):transpose(2, 3)
    local vh = kv:narrow(4, dn + 1, dv):transpose(2, 3)
    local sc = ms.matmul(qh:contiguous(), kh:contiguous():transpose(3, 4)) * att.scale
    sc = sc + nnf.causal_mask(Tn, Tn, 'f64', -1)
    local o = ms.matmul(nnf.softmax(sc, -1), vh:contiguous())
    return att.o_proj(o:transpose(2, 3):reshape(B, Tn, H * dv))
  end)
end

describe('models.deepseek_v3', function()
  before_each(function() A.clear_tape() end)

  for _, case in ipairs({ 'deepseek-v3-tiny', 'deepseek-v3-tiny-qproj', 'deepseek-v3-tiny-yarn' }) do
    local dir = fixtures .. '/' .. case
    local function golden(dtype, bound) S.hf_golden(ds, dir, dtype, bound) end
    it(case .. ': logits, loss and every gradient as transformers\' in f64 (1e-6)', function() golden('f64', 1e-6) end)
    it(case .. ': the same in f32 (1e-5)', function() golden('f32', 1e-5) end)
  end

  it('names its parameters and routing biases as the checkpoint; the fixtures\' configs read back', function()
    local dir = fixtures .. '/deepseek-v3-tiny'
    local m = ds.from_pretrained(dir)
    local want, got = {}, {}
    for k in pairs(ms.load_safetensors(dir .. '/model.safetensors')) do want[#want + 1] = k end
    for k in pairs(m:state_dict()) do got[#got + 1] = k end
    table.sort(want); table.sort(got)
    assert.are.same(want, got)
    local att = m.model.layers[1].self_attn
    assert.are.equal(nn.MLAttention, getmetatable(att))
    assert.are.equal(1e-6, att.q_a_layernorm.eps)   -- (transformers' default, not rms_norm_eps)
    assert.are.equal(1e-5, m.model.layers[1].input_layernorm.eps)
    assert.are.equal(nn.GatedMLP, getmetatable(m.model.layers[1].mlp))
    local moe = m.model.layers[2].mlp
    assert.are.equal(nn.MoE, getmetatable(moe))
    assert.are.equal(moe.gate.e_score_correction_bias, moe:routing_bias())
    local y = ds.from_pretrained(fixtures .. '/deepseek-v3-tiny-yarn')
    local rp = y.config.rope_parameters
    assert.are.equal('yarn', rp.rope_type)
    assert.are.equal(4, rp.factor)
    local s = 1 / math.sqrt(24) * (0.1 * 0.8 * math.log(4) + 1) ^ 2
    assert.is_true(math.abs(y.model.layers[1].self_attn.scale - s) < 1e-15)
  end)

  it('MLAttention against its math written out (f64, 1e-12): q_lora or q_proj, interleaved or not, v narrower, '
    .. 'wider or as wide as q/k, YaRN; the unfused path; finite differences', function()
    local cases = {
      { q_lora_rank = 12, rope_interleave = true, v_head_dim = 6 },
      { rope_interleave = false, v_head_dim = 10, bias = true },
      { q_lora_rank = 6, rope_interleave = true, v_head_dim = 8 },
      { q_lora_rank = 6, rope_interleave = false, v_head_dim = 4, yarn = true },
    }
    for i, c in ipairs(cases) do
      ms.manual_seed(20 + i)
      local rope = 100
      if c.yarn then
        rope = nnf.yarn_rope(100, 4, { factor = 3, original_max_position_embeddings = 4, mscale = 1,
          mscale_all_dim = 0.5 })
      end
      local att = nn.MLAttention { dim = 16, n_head = 2, q_lora_rank = c.q_lora_rank, kv_lora_rank = 8,
        qk_nope_head_dim = 4, qk_rope_head_dim = 4, v_head_dim = c.v_head_dim, bias = c.bias, rope = rope,
        rope_interleave = c.rope_interleave, scale = 0.4 }:to('f64')
      for name, p in att:named_parameters() do
        if name:match('norm') then ms.normal_(p, 1, 0.2) else ms.normal_(p, 0, 0.4) end
      end
      local x = ms.randn({ 2, 7, 16 }, { dtype = 'f64', seed = 30 + i }):requires_grad_()
      local y = att(x)
      local want = mla_reference(att, x)
      local err = (y:detach() - want):abs():max():item()
      assert.is_true(err <= 1e-12, ('case %d: max abs error %g'):format(i, err))
      att.unfused = true
      local err2 = (A.no_grad(function() return att(x) end) - want):abs():max():item()
      assert.is_true(err2 <= 1e-12, ('case %d, unfused: max abs error %g'):format(i, err2))
      att.unfused = nil
      A.clear_tape()
      local ps = { x, att.kv_b_proj.weight, att.kv_a_proj_with_mqa.weight, att.kv_a_layernorm.weight, att.o_proj.weight }
      ps[#ps + 1] = att.q_lora_rank and att.q_a_proj.weight or att.q_proj.weight
      if c.bias then ps[#ps + 1] = att.o_proj.bias end
      local worst = A.gradcheck(function() return att(x) end, ps)
      assert.is_true(worst < 1e-6, ('case %d: relative error %g'):format(i, worst))
    end
  end)

  it('nnf.yarn_rope: the frequencies and attention factor of YaRN\'s formula; the cos/sin tables scaled by it', function()
    local d, theta, f, orig = 16, 1000, 8, 32
    local r = nnf.yarn_rope(theta, d, { factor = f, original_max_position_embeddings = orig, beta_fast = 8,
      beta_slow = 2 })
    -- the correction range: the dimensions that turn 8 and 2 times over 32 positions
    local function dim(n) return d * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(theta)) end
    local lo, hi = math.max(math.floor(dim(8)), 0), math.min(math.ceil(dim(2)), d - 1)
    assert.is_true(hi > lo)
    for i = 0, d / 2 - 1 do
      local base = theta ^ (-2 * i / d)
      local share = 1 - math.min(math.max((i - lo) / (hi - lo), 0), 1)   -- of extrapolation
      local want = base * share + base / f * (1 - share)
      assert.is_true(math.abs(r.inv[i + 1] - want) <= 1e-15 * want, ('frequency %d: %g vs %g'):format(i, r.inv[i + 1], want))
    end
    assert.is_true(math.abs(r.factor - (0.1 * math.log(f) + 1)) < 1e-15)
    -- both mscales: their ratio; a factor of 1 leaves 1
    local r2 = nnf.yarn_rope(theta, d, { factor = f, original_max_position_embeddings = orig, mscale = 2,
      mscale_all_dim = 1 })
    assert.is_true(math.abs(r2.factor - (0.2 * math.log(f) + 1) / (0.1 * math.log(f) + 1)) < 1e-15)
    assert.are.equal(1, nnf.yarn_rope(theta, d, { factor = 1, original_max_position_embeddings = orig }).factor)
    local cs, sn = nnf.rope_cache(5, d, r, 'f64', -1)
    local c0, s0 = S.values(cs), S.values(sn)
    -- row 3 (position 3), column i and i + d/2: cos(3 inv_i) x factor
    for i = 0, d / 2 - 1 do
      local a = 3 * r.inv[i + 1]
      assert.is_true(math.abs(c0[3 * d + i + 1] - math.cos(a) * r.factor) < 1e-15)
      assert.is_true(math.abs(c0[3 * d + i + 1 + d / 2] - math.cos(a) * r.factor) < 1e-15)
      assert.is_true(math.abs(s0[3 * d + i + 1] - math.sin(a) * r.factor) < 1e-15)
    end
    assert.has_error(function() nnf.yarn_rope(theta, d, { original_max_position_embeddings = 4 }) end,
      'yarn_rope: factor must be a positive number, got nil')
    assert.has_error(function() nnf.yarn_rope(theta, d, { factor = 2 }) end,
      'yarn_rope: original_max_position_embeddings must be a positive number, got nil')
  end)

  it('finite differences through the whole model (the router, an expert, the latent attention, the embedding)',
    function()
      ms.manual_seed(6)
      local m = ds.new(small()):to('f64')
      for name, p in m:named_parameters() do if not name:match('norm') then ms.normal_(p, 0, 0.4) end end
      local L = m.model.layers
      L[2].mlp.gate.e_score_correction_bias:copy_(ms.randn({ 4 }, { seed = 3 }) * 0.1)
      local x, y = S.token_batch(2, 6, 40, 7)
      local worst = A.gradcheck(function() return m(x, y) end, { L[2].mlp.gate.weight,
        L[3].mlp.experts[2].down_proj.weight, L[2].mlp.shared_experts.up_proj.weight, L[1].self_attn.q_b_proj.weight,
        L[3].self_attn.kv_a_layernorm.weight, m.model.embed_tokens.weight })
      assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    end)

  it('save_pretrained / from_pretrained: transformers\' names and config.json, the same loss; the routing biases '
    .. 'saved; a checkpoint\'s MTP layers skipped, a bad FP8 weight named', function()
    ms.manual_seed(5)
    local rp = { rope_type = 'yarn', rope_theta = 5000.0, factor = 2.0, original_max_position_embeddings = 8,
      mscale = 1.0, mscale_all_dim = 1.0 }
    local m = ds.new(small({ rope_parameters = rp }))
    m.model.layers[3].mlp.gate.e_score_correction_bias:copy_(ms.randn({ 4 }, { seed = 1 }))
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local sd = ms.load_safetensors(dir .. '/model.safetensors')
    for _, name in ipairs({ 'model.layers.0.self_attn.q_a_proj.weight', 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight',
      'model.layers.0.mlp.gate_proj.weight', 'model.layers.1.mlp.gate.e_score_correction_bias',
      'model.layers.2.mlp.experts.3.down_proj.weight', 'model.layers.2.mlp.shared_experts.up_proj.weight' }) do
      assert.is_not_nil(sd[name], name)
    end
    local cfg = hf.read_json(dir .. '/config.json')
    assert.are.same({ 'DeepseekV3ForCausalLM' }, cfg.architectures)
    assert.are.equal('deepseek_v3', cfg.model_type)
    assert.are.equal(4, cfg.head_dim)
    assert.are.equal(8, cfg.qk_head_dim)
    assert.are.equal('yarn', cfg.rope_scaling.type)
    assert.are.equal(2, cfg.rope_scaling.factor)
    assert.are.equal(5000, cfg.rope_theta)
    local m2 = ds.from_pretrained(dir)
    local x, y = S.token_batch(2, 6, 40, 13)
    assert.are.equal(m(x, y):item(), m2(x, y):item())
    -- q_proj instead (q_lora_rank null in config.json)
    local mq = ds.new(small({ q_lora_rank = hf.null }))
    local dq = S.tmpdir()
    mq:save_pretrained(dq)
    assert.is_truthy(S.slurp(dq .. '/config.json'):find('"q_lora_rank": null', 1, true))
    assert.is_not_nil(ds.from_pretrained(dq).model.layers[1].self_attn.q_proj)
    -- an MTP layer's tensors (model.layers.3 of a 3-layer model) are skipped
    sd['model.layers.3.eh_proj.weight'] = ms.zeros({ 16, 32 })
    ms.save_safetensors(dir .. '/model.safetensors', sd)
    assert.are.equal(m(x, y):item(), ds.from_pretrained(dir)(x, y):item())
    -- a bad FP8 scale is named (the dequantisation itself: the next spec)
    sd['model.layers.0.self_attn.o_proj.weight_scale_inv'] = ms.ones({ 1, 1 })
    ms.save_safetensors(dir .. '/model.safetensors', sd)
    local ok, err = pcall(ds.from_pretrained, dir)
    assert.is_false(ok)
    assert.matches('model.layers.0.self_attn.o_proj.weight is f32 (16x12) beside '
      .. 'model.layers.0.self_attn.o_proj.weight_scale_inv: an FP8 block-quantised weight must be 2-D f8e4m3',
      tostring(err), 1, true)
    os.execute('rm -rf ' .. q(dir) .. ' ' .. q(dq))
  end)

  it('reads FP8 block-quantised checkpoints (weight_scale_inv, as DeepSeek\'s own): each weight times its block\'s '
    .. 'scale, exactly, whole or deferred (any element range), the config without quantization_config', function()
    ms.manual_seed(7)
    local m = ds.new(small())
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local sd = ms.load_safetensors(dir .. '/model.safetensors')
    local cfg = hf.read_json(dir .. '/config.json')
    local b0, b1 = 8, 4   -- (blocks that do not divide every weight: partial blocks at the edges)
    cfg.quantization_config = { quant_method = 'fp8', fmt = 'e4m3', activation_scheme = 'dynamic',
      weight_block_size = { b0, b1 } }
    local f = assert(io.open(dir .. '/config.json', 'wb'))
    f:write(require('dkjson').encode(cfg))
    f:close()
    -- quantise the projections as DeepSeek's checkpoints are (not the
    -- embeddings, the head, the norms or the routers): per block, the scale
    -- is amax / 448; the reference dequantisation written out per element
    local want, nq, names = {}, 0, {}
    for name, w in pairs(sd) do if w.ndim == 2 and name:match('proj%.weight$') then names[#names + 1] = name end end
    for _, name in ipairs(names) do
      local w = sd[name]
      do
        local R, C = w.shape[1], w.shape[2]
        local wv = S.values(w)
        local nb0, nb1 = math.ceil(R / b0), math.ceil(C / b1)
        local sv = {}
        for i = 0, nb0 - 1 do
          for j = 0, nb1 - 1 do
            local amax = 0
            for r = i * b0, math.min(R, (i + 1) * b0) - 1 do
              for c = j * b1, math.min(C, (j + 1) * b1) - 1 do amax = math.max(amax, math.abs(wv[r * C + c + 1])) end
            end
            sv[i * nb1 + j + 1] = amax / 448
          end
        end
        local s = ms.tensor(sv, { dtype = 'f32' }):reshape({ nb0, nb1 })
        local sf = S.values(s)
        local scaled = {}
        for r = 0, R - 1 do
          for c = 0, C - 1 do scaled[r * C + c + 1] = wv[r * C + c + 1] / sf[math.floor(r / b0) * nb1 + math.floor(c / b1) + 1] end
        end
        local w8 = ms.tensor(scaled, { dtype = 'f32' }):reshape({ R, C }):to('f8e4m3')
        local w8v = S.values(w8)
        local ref = {}
        for r = 0, R - 1 do
          for c = 0, C - 1 do
            ref[r * C + c + 1] = ms.tensor({ w8v[r * C + c + 1] }, { dtype = 'f32' })
              * ms.tensor({ sf[math.floor(r / b0) * nb1 + math.floor(c / b1) + 1] }, { dtype = 'f32' })
          end
        end
        for i, t in ipairs(ref) do ref[i] = t:item() end
        want[name] = { ref = ref, orig = wv }
        sd[name], sd[name .. '_scale_inv'] = w8, s
        nq = nq + 1
      end
    end
    assert.is_true(nq >= 20)
    ms.save_safetensors(dir .. '/model.safetensors', sd)
    local whole = ds.from_pretrained(dir)
    assert.is_nil(whole.config.quantization_config)
    local lazy = ms.nn.materialize(ds.from_pretrained(dir, { deferred = true }))
    local pw, pl = {}, {}
    for name, p in whole:named_parameters() do pw[name] = p end
    for name, p in lazy:named_parameters() do pl[name] = p end
    for name, w in pairs(want) do
      local got, got2 = S.values(pw[name]), S.values(pl[name])
      local num, den = 0, 0
      for i = 1, #w.ref do
        assert.are.equal(w.ref[i], got[i], name .. ' element ' .. i)
        assert.are.equal(w.ref[i], got2[i], name .. ' (deferred) element ' .. i)
        num, den = num + (got[i] - w.orig[i]) ^ 2, den + w.orig[i] ^ 2
      end
      assert.is_true(math.sqrt(num / den) < 0.05, name .. ': FP8 error ' .. math.sqrt(num / den))
    end
    -- element ranges that start and end inside rows, as an FSDP rank's shard asks
    local name = 'model.layers.0.self_attn.q_b_proj.weight'
    local sd2 = require('moonshard.safetensors').load_deferred(dir .. '/model.safetensors')
    local full = S.values(pw[name])
    for _, r in ipairs({ { 0, 5 }, { 7, 30 }, { 13, 1 }, { 50, #full - 50 } }) do
      local part = S.values(ds.dequantize(sd2[name], sd2[name .. '_scale_inv'], { b0, b1 }, r[1], r[2]))
      assert.are.equal(r[2], #part)
      for i = 1, r[2] do assert.are.equal(full[r[1] + i], part[i]) end
    end
    -- the model saves back in f32, with no quantization_config
    local out = S.tmpdir()
    whole:save_pretrained(out)
    assert.is_nil(hf.read_json(out .. '/config.json').quantization_config)
    assert.is_nil(ms.load_safetensors(out .. '/model.safetensors')[name .. '_scale_inv'])
    os.execute('rm -rf ' .. q(dir) .. ' ' .. q(out))
  end)

  it('reads older config.json fields (rope_theta, rope_scaling with type, num_local_experts); refuses what it '
    .. 'cannot run, by name', function()
    local cfg = hf.config(ds, nil, small({ rope_theta = 300, rope_scaling = { type = 'yarn', factor = 4,
      original_max_position_embeddings = 4 }, n_routed_experts = hf.null, num_local_experts = 6, n_group = 3,
      topk_group = 2 }))
    assert.are.same({ rope_type = 'yarn', rope_theta = 300, factor = 4, original_max_position_embeddings = 4 },
      cfg.rope_parameters)
    assert.are.equal(6, cfg.n_routed_experts)
    assert.is_nil(cfg.rope_scaling)
    local function bad(over, msg)
      local ok, err = pcall(ds.new, small(over))
      assert.is_false(ok)
      assert.matches(msg, tostring(err), 1, true)
    end
    bad({ num_key_value_heads = 1 }, 'deepseek_v3 config: num_key_value_heads (1) must equal num_attention_heads (2)')
    bad({ rope_parameters = { rope_type = 'longrope', rope_theta = 1e4 } },
      'deepseek_v3 config: rope_parameters.rope_type longrope is not supported (default or yarn)')
    bad({ rope_parameters = { rope_type = 'yarn', rope_theta = 1e4, factor = 2 } },
      'yarn RoPE needs rope_parameters.original_max_position_embeddings')
    bad({ n_group = 3 }, 'deepseek_v3 config: n_routed_experts 4 do not split into n_group = 3 groups')
    bad({ n_group = 4, topk_group = 1 }, 'n_group = 4 leaves groups of 1 expert')
    bad({ topk_group = 3 }, 'topk_group 3 is more than n_group 2')
    bad({ num_experts_per_tok = 3 }, 'num_experts_per_tok 3 is more than the 2 experts of topk_group = 1 groups')
    bad({ qk_rope_head_dim = 3 }, 'qk_rope_head_dim (3) must be even for RoPE')
    local att = ds.new(small()).model.layers[1].self_attn
    assert.has_error(function() att(ms.zeros({ 2, 3, 5 })) end, 'MLAttention: expected x of shape (B, T, 16), got (2, 3, 5)')
    assert.has_error(function() nn.MLAttention { dim = 16, n_head = 2, kv_lora_rank = 8, qk_nope_head_dim = 4,
      qk_rope_head_dim = 5, v_head_dim = 4 } end, 'MLAttention: RoPE needs an even qk_rope_head_dim, got 5')
  end)

  it('the routing biases choose the experts and --moe-bias-rate\'s update moves them (moe.update_bias)', function()
    ms.manual_seed(8)
    local m = ds.new(small()):to('f64')
    local moe = m.model.layers[2].mlp
    local x = ms.randn({ 10, 16 }, { dtype = 'f64', seed = 2 })
    local _, ids0 = moe:route(x)
    -- a large bias on expert 4 puts it in every token's choice (its group kept)
    moe:routing_bias():copy_(ms.tensor({ 0, 0, 0, 10 }, { dtype = 'f32' }))
    local _, ids = moe:route(x)
    for _, row in ipairs(ids:totable()) do assert.is_true(row[1] == 3 or row[2] == 3) end
    assert.are_not.same(ids0:totable(), ids:totable())
    moe:routing_bias():zero_()
    assert.are.equal(0, nn.moe.enable_bias(m))   -- (every sparse layer has its own)
    local xs, ys = S.token_batch(2, 6, 40, 3)
    m(xs, ys):backward()
    assert.are.equal(2, nn.moe.update_bias(m, 0.5))
    local b = S.values(moe:routing_bias())
    for _, v in ipairs(b) do assert.is_true(v == 0.5 or v == -0.5 or v == 0, tostring(v)) end
    assert.is_true(math.abs(b[1]) + math.abs(b[2]) + math.abs(b[3]) + math.abs(b[4]) > 0)
  end)

  it('multi-token prediction (mtp_loss_weight > 0): each depth against its formula written out with plain ops '
    .. '(f64, 1e-12), the targets it reads, finite differences, the checkpoints\' names both ways', function()
    ms.manual_seed(12)
    local lam, D = 0.3, 2
    local m = ds.new(small({ num_hidden_layers = 2, mtp_loss_weight = lam, num_nextn_predict_layers = D })):to('f64')
    for name, p in m:named_parameters() do
      if not name:match('norm') then ms.normal_(p, 0, 0.3) else ms.normal_(p, 1, 0.1) end
    end
    assert.are.equal(D, #m.model.mtp_layers)
    local x, y = S.token_batch(2, 7, 40, 3)
    local loss = m(x, y)
    local got = m:mtp_losses()
    assert.are.equal(D, #got)
    -- the same written out: the main model's normed final states, then per
    -- depth k the states of positions 0 .. T-1-k, the embeddings of the
    -- tokens k on, the block, the shared head, cross-entropy against the
    -- targets k on (mean over the kept ones)
    local function ce(logits, t)
      local lp = nnf.log_softmax(logits, -1)
      local tv, sum, n = t:totable(), 0, 0
      local lpv = lp:totable()
      for b = 1, #tv do
        for i = 1, #tv[b] do
          if tv[b][i] ~= -100 then sum, n = sum - lpv[b][i][tv[b][i] + 1], n + 1 end
        end
      end
      return sum / n
    end
    local want = A.no_grad(function()
      local W = m.lm_head.weight
      local h = m.model(x)
      local main = ce(ms.matmul(h, W:t()), y)
      local ls = {}
      for k = 1, D do
        local n = 7 - k
        local L = m.model.mtp_layers[k]
        local e = m.model.embed_tokens(x:narrow(2, k + 1, n):contiguous())
        local u = L.eh_proj(ms.cat({ L.enorm(e), L.hnorm(h:narrow(2, 1, n):contiguous()) }, 3))
        local r = u + L.self_attn(L.input_layernorm(u))
        r = r + L.mlp(L.post_attention_layernorm(r))
        h = L.shared_head.norm(r)
        ls[k] = ce(ms.matmul(h, W:t()), y:narrow(2, k + 1, n):contiguous())
      end
      return { main = main, ls = ls }
    end)
    for k = 1, D do
      assert.is_true(math.abs(got[k]:item() - want.ls[k]) < 1e-12, ('depth %d: %.15g vs %.15g'):format(k,
        got[k]:item(), want.ls[k]))
    end
    local total = want.main + lam / D * (want.ls[1] + want.ls[2])
    assert.is_true(math.abs(loss:item() - total) < 1e-12, ('%.15g vs %.15g'):format(loss:item(), total))
    -- depth k reads the targets from k on: the first ones change the main
    -- loss only
    A.clear_tape()
    local y2 = y:clone()
    y2:narrow(2, 1, 1):fill_(-100)
    local l2 = m(x, y2)
    assert.are_not.equal(loss:item(), l2:item())
    assert.are.equal(got[1]:item(), m:mtp_losses()[1]:item())
    assert.are.equal(got[2]:item(), m:mtp_losses()[2]:item())
    -- finite differences through the depths and the shared embedding
    A.clear_tape()
    local M1, M2 = m.model.mtp_layers[1], m.model.mtp_layers[2]
    local worst = A.gradcheck(function() return m(x, y) end, { M1.eh_proj.weight, M1.enorm.weight,
      M2.self_attn.kv_b_proj.weight, M2.shared_head.norm.weight, m.model.embed_tokens.weight })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    -- saved as the checkpoints' model.layers.(L + K), with the embedding and
    -- head copies; read back (the copies dropped); without MTP the depths
    -- are skipped and the loss is the main one
    A.clear_tape()
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local sd = ms.load_safetensors(dir .. '/model.safetensors')
    for _, name in ipairs({ 'model.layers.2.eh_proj.weight', 'model.layers.3.enorm.weight',
      'model.layers.3.shared_head.norm.weight', 'model.layers.2.embed_tokens.weight',
      'model.layers.3.shared_head.head.weight', 'model.layers.2.self_attn.kv_b_proj.weight',
      'model.layers.3.mlp.experts.1.up_proj.weight' }) do
      assert.is_not_nil(sd[name], name)
    end
    for name in pairs(sd) do assert.is_nil(name:match('mtp_layers'), name) end
    -- (the file holds f32: the same within its rounding)
    local m2 = ds.from_pretrained(dir):to('f64')
    assert.is_true(math.abs(m2(x, y):item() - loss:item()) < 1e-6 * loss:item())
    local cfg = hf.read_json(dir .. '/config.json')
    assert.are.equal(lam, cfg.mtp_loss_weight)
    cfg.mtp_loss_weight = 0
    local f = assert(io.open(dir .. '/config.json', 'wb'))
    f:write(require('dkjson').encode(cfg))
    f:close()
    local m3 = ds.from_pretrained(dir):to('f64')
    assert.is_nil(rawget(m3.model, 'mtp_layers'))
    assert.is_true(math.abs(m3(x, y):item() - want.main) < 1e-6 * want.main)
    os.execute('rm -rf ' .. q(dir))
    -- what it cannot run, by name
    local ok, err = pcall(ds.new, small({ mtp_loss_weight = 0.1, num_nextn_predict_layers = 0 }))
    assert.is_false(ok)
    assert.matches('mtp_loss_weight > 0 needs num_nextn_predict_layers >= 1', tostring(err), 1, true)
    -- a pipeline puts the depths on the last stage, with a copy of the
    -- embedding (both stages' prefixes name it) and the ids for the head
    local parts = m:pipeline_parts()
    local function has(list, p) for _, v in ipairs(list) do if v == p then return true end end return false end
    assert.is_true(has(parts.first, 'model.embed_tokens.'))
    assert.is_true(has(parts.last, 'model.embed_tokens.'))
    assert.is_true(has(parts.last, 'model.mtp_layers.'))
    assert.is_true(parts.head_ids)
    assert.are.equal(#m.model.mtp_layers, parts.mtp_depths)
  end)

  describe('bin/train', function()
    local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 48 '
      .. '--model.moe_intermediate_size 16 --model.q_lora_rank 16 --model.kv_lora_rank 16 --model.qk_nope_head_dim 8 '
      .. '--model.qk_rope_head_dim 8 --model.v_head_dim 8 --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 '
      .. '--eval-iters 2 --sample-tokens 0 --log-every 2'

    it('trains the tiny preset; two ranks follow one process: FSDP, expert parallel, both', function()
      -- (no load-balancing loss to turn off: the runs compare as they are)
      S.moe_train_runs('models/deepseek_v3.lua', flags, { '--fsdp FULL_SHARD', '--ep 2', '--ep 2 --fsdp FULL_SHARD' }, '')
    end)

    it('--tp 2 (the latent attention by heads, the experts by hidden features, sequence parallel) follows the '
      .. 'one-process curve', function()
      local text = S.two_ranks_follow('models/deepseek_v3.lua', flags, '--tp 2', 3)
      assert.is_truthy(text:find('sequence parallel', 1, true), text)
    end)

    it('--cp 2 follows the one-process curve; --moe-bias-rate moves and saves the routing biases', function()
      local dir = S.tmpdir()
      local f = flags .. ' --data ' .. q(S.fixed_corpus(dir, 20000))
      local status, text = S.bin_train(('models/deepseek_v3.lua %s --batch-size 4 --steps 4 --out %s/one'):format(f,
        q(dir)))
      assert.are.equal(0, status, text)
      status, text = S.bin_train(('--nproc-per-node 2 --device cpu models/deepseek_v3.lua %s --batch-size 4 --steps 4 '
        .. '--cp 2 --out %s/cp'):format(f, q(dir)))
      assert.are.equal(0, status, text)
      S.close_losses(S.run_losses(dir .. '/one'), S.run_losses(dir .. '/cp'), 1, 4, 'deepseek_v3 --cp 2')
      status, text = S.bin_train(('models/deepseek_v3.lua %s --batch-size 4 --steps 4 --moe-bias-rate 0.01 '
        .. '--out %s/bias'):format(f, q(dir)))
      assert.are.equal(0, status, text)
      local mb = ds.from_pretrained(dir .. '/bias')
      assert.is_true(mb.model.layers[2].mlp.gate.e_score_correction_bias:abs():sum():item() > 0)
      os.execute('rm -rf ' .. q(dir))
    end)

    it('multi-token prediction trains (--model.mtp_loss_weight); two ranks follow one process: FSDP, expert '
      .. 'parallel; each depth\'s loss in metrics.jsonl; --tp 2 (sequence parallel and not; with --fsdp), --cp 2, --pp 2 (the '
      .. 'depths on the last stage) and --pp 2 --tp 2 on the one-process curve, each depth\'s loss too, with the routing biases moving',
      function()
      local mf = flags .. ' --model.mtp_loss_weight 0.3 --model.num_nextn_predict_layers 2'
      S.moe_train_runs('models/deepseek_v3.lua', mf, { '--fsdp FULL_SHARD', '--ep 2' }, '')
      local dir = S.tmpdir()
      local f = mf .. ' --data ' .. q(S.fixed_corpus(dir, 20000))
      -- metrics.jsonl has each depth's loss (averaged over the ranks), below
      -- the loss that adds 0.3 / 2 of their sum to the main one
      local function mtp_of(out)
        local r = {}
        for line in io.lines(out .. '/metrics.jsonl') do
          local obj = require('dkjson').decode(line)
          if obj.loss then r[obj.step] = obj.mtp_loss end
        end
        return r
      end
      for _, how in ipairs({ { '', '' }, { '--nproc-per-node 2 --device cpu', '--fsdp FULL_SHARD' } }) do
        local out = dir .. '/m' .. (how[1] .. how[2]):gsub('[^%w]', '')
        local status, text = S.bin_train(('%s models/deepseek_v3.lua %s %s --batch-size 2 --steps 3 --out %s'):format(
          how[1], f, how[2], q(out)))
        assert.are.equal(0, status, text)
        local n = 0
        for line in io.lines(out .. '/metrics.jsonl') do
          local obj = require('dkjson').decode(line)
          if obj.loss then
            n = n + 1
            assert.are.equal(2, #obj.mtp_loss, line)
            for _, v in ipairs(obj.mtp_loss) do assert.is_true(v > 0 and v < obj.loss, line) end
            assert.is_true(obj.loss > 0.15 * (obj.mtp_loss[1] + obj.mtp_loss[2]), line)
          end
        end
        assert.are.equal(3, n)
      end
      -- --tp 2, --cp 2 and --pp 2 keep the global batch: the one-process curve, and
      -- each depth's loss, with --moe-bias-rate moving the routing biases
      -- by counts that leave the depths' filler positions out
      local bf = f .. ' --moe-bias-rate 0.01 --batch-size 4 --steps 3'
      local status, text = S.bin_train(('models/deepseek_v3.lua %s --out %s/one'):format(bf, q(dir)))
      assert.are.equal(0, status, text)
      local one, mone = S.run_losses(dir .. '/one'), mtp_of(dir .. '/one')
      -- (and sequence parallel under FSDP, TP 2 x FSDP 1, and with a
      -- pipeline, --pp 2 --tp 2 on 4 ranks: the stages exchange each TP
      -- rank's rows)
      for _, how in ipairs({ '--tp 2', '--tp 2 --no-sequence-parallel', '--cp 2', '--pp 2', '--tp 2 --fsdp FULL_SHARD',
        '--pp 2 --tp 2 --sequence-parallel' }) do
        local out = dir .. '/two' .. how:gsub('[^%w]', '')
        local np = how:find('--pp 2 --tp 2', 1, true) and 4 or 2
        status, text = S.bin_train(('--nproc-per-node %d --device cpu models/deepseek_v3.lua %s %s --out %s'):format(np,
          bf, how, q(out)))
        assert.are.equal(0, status, text)
        S.close_losses(one, S.run_losses(out), 1, 3, 'mtp ' .. how)
        local m2 = mtp_of(out)
        for step = 1, 3 do
          for k = 1, 2 do
            S.close_losses({ mone[step][k] }, { m2[step][k] }, 1, 1, ('mtp %s step %d depth %d'):format(how, step, k))
          end
        end
      end
      os.execute('rm -rf ' .. q(dir))
    end)
  end)
end)
