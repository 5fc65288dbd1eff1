-- models/llama4.lua (docs/models.md, "Llama 4"): golden runs against
-- transformers' Llama4ForCausalLM (spec/fixtures/llama4-*, made by
-- tools/make_llama4_fixture.py: every layer MoE with top-1, RoPE with
-- llama3 scaling, the L2 qk norm, chunks that split the sequence with
-- padding, a temperature-tuned NoPE layer; every second layer MoE with
-- top-2, no qk norm, biases; Scout's RoPE, given moe_layers and
-- no_rope_layers, a chunk longer than the sequence, a tied head): logits,
-- loss and every gradient within 1e-6 relative in f64 and 1e-5 in f32; the
-- chunked attention against an explicit mask; float64 finite differences
-- through the chunks, the temperature tuning and the router's input
-- scaling; the checkpoint's fused experts read, written back and read
-- deferred; configs and their errors; bin/train on one process and two
-- ranks (FSDP, expert parallel, both).
local ms = require 'moonshard'
local A = ms.autograd
local nn = ms.nn
local nnf = nn.functional
local hf = require 'models.hf'
local llama4 = require 'models.llama4'
local S = require 'spec.support'
local q = S.shell_quote

local fixtures = require('moonshard.tensor').root .. '/spec/fixtures'
local cases = { 'llama4-tiny', 'llama4-tiny-step2', 'llama4-tiny-scout' }

-- a small config (vocabulary 40): 4 layers, the second and fourth MoE (4
-- experts, 1 a token), the fourth NoPE with temperature tuning, chunks of 4
local function small(over)
  local cfg = { vocab_size = 40, hidden_size = 16, intermediate_size = 12, intermediate_size_mlp = 20,
    num_hidden_layers = 4, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 8, num_local_experts = 4,
    num_experts_per_tok = 1, interleave_moe_layer_step = 2, attention_chunk_size = 4, floor_scale = 2, attn_scale = 0.3,
    max_position_embeddings = 32, bos_token_id = hf.null, eos_token_id = hf.null }
  for k, v in pairs(over or {}) do cfg[k] = v end
  return cfg
end

-- The golden run of a fixture folder (S.hf_golden): the expected
-- gradients are under the checkpoint's names (the experts fused) and go
-- through llama4.fix_state_dict as the weights do. A gradient that is zero
-- in exact arithmetic (a NoPE layer's k_proj.bias without the qk norm: a
-- constant added to every key leaves the softmax as it is) is rounding
-- noise in the reference; ours must be as small.
local function golden(dir, dtype, bound)
  return S.hf_golden(llama4, dir, dtype, bound, { map = llama4.fix_state_dict })
end

-- chunked causal attention written out: scores with the chunked causal
-- mask (-inf where j > i or the chunks differ), softmax, values (unfused)
local function chunked_reference(qt, kt, vt, chunk)
  local Tn = qt.shape[3]
  local rows = {}
  for i = 0, Tn - 1 do
    local r = {}
    for j = 0, Tn - 1 do
      r[j + 1] = (j <= i and math.floor(i / chunk) == math.floor(j / chunk)) and 0 or -math.huge
    end
    rows[i + 1] = r
  end
  local mask = ms.tensor(rows, { dtype = 'f64' })
  return nnf.scaled_dot_product_attention(qt, kt, vt, { causal = false, mask = mask, unfused = true })
end

describe('models.llama4', function()
  before_each(function() A.clear_tape() end)

  for _, case in ipairs(cases) do
    local dir = fixtures .. '/' .. case
    it(case .. ': logits, loss and every gradient as transformers\' in f64 (1e-6)', function()
      golden(dir, 'f64', 1e-6)
    end)
    it(case .. ': the same in f32 (1e-5)', function() golden(dir, 'f32', 1e-5) end)
  end

  it('reads the fixtures\' configs and checkpoints: the per-layer kinds, the fused experts split, the names written '
    .. 'back as the checkpoint\'s, the same values', function()
    local m = llama4.from_pretrained(fixtures .. '/llama4-tiny-step2')
    local L = m.model.layers
    assert.are.same({ 1, 3 }, m.config.moe_layers)
    assert.are.same({ 'chunked_attention', 'full_attention', 'chunked_attention', 'full_attention' },
      m.config.layer_types)
    assert.are.equal(nn.GatedMLP, getmetatable(L[1].feed_forward))
    assert.are.equal(96, L[1].feed_forward.hidden)
    local moe = L[2].feed_forward
    assert.are.equal(nn.MoE, getmetatable(moe))
    assert.is_true(moe.scale_input)
    assert.are.equal(2, moe.top_k)
    assert.are.equal('sigmoid', moe.score)
    assert.is_false(moe.norm_topk)
    assert.are.equal(6, L[1].self_attn.chunk)
    assert.is_nil(L[2].self_attn.chunk)
    assert.is_nil(L[1].self_attn.qk_norm_eps)      -- (use_qk_norm false)
    assert.are.equal(4, L[2].self_attn.floor_scale)  -- (NoPE: temperature tuning)
    assert.is_nil(L[2].self_attn.rope)
    local t = llama4.from_pretrained(fixtures .. '/llama4-tiny')
    assert.are.equal(1e-5, t.model.layers[1].self_attn.qk_norm_eps)
    assert.is_nil(t.model.layers[4].self_attn.qk_norm_eps)   -- (the NoPE layer: no qk norm)
    assert.are.equal('table', type(t.model.layers[1].self_attn.rope))
    -- expert e's linears: the fused tensors' slices, transposed
    local sd = ms.load_safetensors(fixtures .. '/llama4-tiny-step2/model.safetensors')
    local gu = sd['model.layers.1.feed_forward.experts.gate_up_proj']
    local dn = sd['model.layers.1.feed_forward.experts.down_proj']
    assert.are.same({ 4, 64, 64 }, gu.shape)
    assert.are.same({ 4, 32, 64 }, dn.shape)
    local e3 = moe.experts[3]
    assert.are.same(S.values(gu:narrow(1, 3, 1):reshape({ 64, 64 }):narrow(2, 1, 32):t():contiguous()),
      S.values(e3.gate_proj.weight))
    assert.are.same(S.values(gu:narrow(1, 3, 1):reshape({ 64, 64 }):narrow(2, 33, 32):t():contiguous()),
      S.values(e3.up_proj.weight))
    assert.are.same(S.values(dn:narrow(1, 3, 1):reshape({ 32, 64 }):t():contiguous()), S.values(e3.down_proj.weight))
    -- saved: the checkpoint's names, shapes and values, bit for bit
    for _, case in ipairs(cases) do
      local dir = S.tmpdir()
      local mc = llama4.from_pretrained(fixtures .. '/' .. case)
      mc:save_pretrained(dir)
      local want = ms.load_safetensors(fixtures .. '/' .. case .. '/model.safetensors')
      local got = ms.load_safetensors(dir .. '/model.safetensors')
      local wk, gk = {}, {}
      for k in pairs(want) do wk[#wk + 1] = k end
      for k in pairs(got) do gk[#gk + 1] = k end
      table.sort(wk); table.sort(gk)
      assert.are.same(wk, gk)
      for k, w in pairs(want) do
        assert.are.same(w.shape, got[k].shape, k)
        assert.are.equal(0, (got[k] - w):abs():max():item(), k)
      end
      local j, jw = hf.read_json(dir .. '/config.json'), hf.read_json(fixtures .. '/' .. case .. '/config.json')
      for _, f in ipairs({ 'model_type', 'moe_layers', 'no_rope_layers', 'layer_types', 'attention_chunk_size',
        'rope_parameters', 'num_local_experts', 'intermediate_size_mlp', 'tie_word_embeddings', 'use_qk_norm',
        'attn_temperature_tuning', 'floor_scale' }) do
        assert.are.same(jw[f], j[f], f)
      end
      assert.are.same({ 'Llama4ForCausalLM' }, j.architectures)
      os.execute('rm -rf ' .. q(dir))
    end
  end)

  it('save_pretrained / from_pretrained and deferred loading: the same loss; a checkpoint in our experts\' names '
    .. '(bin/train --fsdp\'s) reads too; a fused tensor of the wrong shape is named', function()
    ms.manual_seed(3)
    local m = llama4.new(small())
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local x, y = S.token_batch(2, 10, 40, 5)
    local l0 = m(x, y):item()
    assert.are.equal(l0, llama4.from_pretrained(dir)(x, y):item())
    -- deferred (each FSDP rank reads its rows): the same weights
    local lazy = ms.nn.materialize(llama4.from_pretrained(dir, { deferred = true }))
    local pl = {}
    for name, p in lazy:named_parameters() do pl[name] = p end
    for name, p in m:named_parameters() do
      assert.are.equal(0, (pl[name] - p):abs():max():item(), name)
    end
    -- element ranges of a deferred expert weight, as a rank's shard asks
    local sd = require('moonshard.safetensors').load_deferred(dir .. '/model.safetensors')
    local part = llama4.fix_state_dict(sd, m.config)['model.layers.1.feed_forward.experts.2.up_proj.weight']
    local full = S.values(m.model.layers[2].feed_forward.experts[3].up_proj.weight)
    local T = require 'moonshard.tensor'
    for _, r in ipairs({ { 0, 5 }, { 7, 30 }, { 50, #full - 50 } }) do
      local buf = ms.empty({ r[2] })
      T.replay(part, buf, r[1])
      local v = S.values(buf)
      for i = 1, r[2] do assert.are.equal(full[r[1] + i], v[i]) end
    end
    -- our own names read as they are
    local own = S.tmpdir()
    local plain = {}
    for name, p in pairs(m:state_dict()) do if type(name) == 'string' then plain[name] = p end end
    ms.save_safetensors(own .. '/model.safetensors', plain)
    os.execute('cp ' .. q(dir .. '/config.json') .. ' ' .. q(own .. '/config.json'))
    assert.are.equal(l0, llama4.from_pretrained(own)(x, y):item())
    -- a fused tensor of the wrong shape
    local st = ms.load_safetensors(dir .. '/model.safetensors')
    st['model.layers.3.feed_forward.experts.down_proj'] = ms.zeros({ 4, 16, 12 })
    ms.save_safetensors(dir .. '/model.safetensors', st)
    local ok, err = pcall(llama4.from_pretrained, dir)
    assert.is_false(ok)
    assert.matches('llama4: model.layers.3.feed_forward.experts.down_proj is (4, 16, 12), expected (4, 12, 16) '
      .. '(num_local_experts, intermediate_size, hidden_size)', tostring(err), 1, true)
    st['model.layers.3.feed_forward.experts.down_proj'] = nil
    ms.save_safetensors(dir .. '/model.safetensors', st)
    ok, err = pcall(llama4.from_pretrained, dir)
    assert.is_false(ok)
    assert.matches('model.layers.3.feed_forward.experts.gate_up_proj has no down_proj beside it', tostring(err), 1, true)
    os.execute('rm -rf ' .. q(dir) .. ' ' .. q(own))
  end)

  it('reads a Llama4ForConditionalGeneration folder (the Hub\'s Llama 4: model_type llama4): its text_config and '
    .. 'language_model.* tensors, the vision model\'s left out; whole or deferred', function()
    local src = fixtures .. '/llama4-tiny'
    local dir = S.tmpdir()
    local text = hf.read_json(src .. '/config.json')
    hf.write_json(dir .. '/config.json', { model_type = 'llama4', architectures = { 'Llama4ForConditionalGeneration' },
      text_config = text, vision_config = { model_type = 'llama4_vision_model', hidden_size = 8 },
      image_token_index = 200092, tie_word_embeddings = false })
    local sd = {}
    for name, t in pairs(ms.load_safetensors(src .. '/model.safetensors')) do sd['language_model.' .. name] = t end
    sd['vision_model.class_embedding'] = ms.randn({ 8 })
    sd['multi_modal_projector.linear_1.weight'] = ms.randn({ 4, 8 })
    ms.save_safetensors(dir .. '/model.safetensors', sd)
    local exp = ms.load_safetensors(src .. '/expected.safetensors')
    local m = llama4.from_pretrained(dir, { dtype = 'f64' })
    assert.are.equal('llama4_text', m.config.model_type)
    local e = S.relerr(ms.no_grad(function() return m(exp.input_ids) end), exp.logits)
    assert.is_true(e < 1e-6, 'logits ' .. e)
    local lazy = ms.nn.materialize(llama4.from_pretrained(dir, { deferred = true })):to('f64')
    assert.are.equal(0, (ms.no_grad(function() return lazy(exp.input_ids) end) - ms.no_grad(function()
      return m(exp.input_ids) end)):abs():max():item())
    -- saved: a llama4_text folder
    local out = S.tmpdir()
    m:save_pretrained(out)
    assert.are.equal('llama4_text', hf.read_json(out .. '/config.json').model_type)
    assert.is_not_nil(ms.load_safetensors(out .. '/model.safetensors')['model.layers.0.feed_forward.experts.gate_up_proj'])
    -- a tensor of neither part is named
    sd['audio_model.weight'] = ms.zeros({ 2 })
    ms.save_safetensors(dir .. '/model.safetensors', sd)
    local ok, err = pcall(llama4.from_pretrained, dir)
    assert.is_false(ok)
    assert.matches('llama4: audio_model.weight is neither the language model\'s (language_model.*) nor the vision '
      .. 'model\'s or the projector\'s', tostring(err), 1, true)
    os.execute('rm -rf ' .. q(dir) .. ' ' .. q(out))
  end)

  it('chunked attention: the fused kernel over chunks equals the chunked causal mask written out (f64, 1e-12), '
    .. 'padded or not, with GQA; plain causal when T <= chunk; finite differences', function()
    for _, c in ipairs({ { 3, 4 }, { 8, 4 }, { 10, 4 }, { 13, 5 }, { 7, 1 } }) do
      local Tn, chunk = c[1], c[2]
      local qt = ms.randn({ 2, 4, Tn, 8 }, { dtype = 'f64', seed = Tn })
      local kt = ms.randn({ 2, 2, Tn, 8 }, { dtype = 'f64', seed = Tn + 1 })
      local vt = ms.randn({ 2, 2, Tn, 8 }, { dtype = 'f64', seed = Tn + 2 })
      local got = ms.no_grad(function() return llama4.chunked_attention(qt, kt, vt, chunk) end)
      local want = ms.no_grad(function() return chunked_reference(qt, kt, vt, chunk) end)
      assert.are.same({ 2, 4, Tn, 8 }, got.shape)
      local err = (got - want):abs():max():item()
      assert.is_true(err < 1e-12, ('T %d, chunk %d: %g'):format(Tn, chunk, err))
    end
    local qt = ms.randn({ 1, 2, 7, 4 }, { dtype = 'f64', seed = 1 }):requires_grad_()
    local kt = ms.randn({ 1, 1, 7, 4 }, { dtype = 'f64', seed = 2 }):requires_grad_()
    local vt = ms.randn({ 1, 1, 7, 4 }, { dtype = 'f64', seed = 3 }):requires_grad_()
    local worst = A.gradcheck(function() return llama4.chunked_attention(qt, kt, vt, 3) end, { qt, kt, vt })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('the attention\'s parts against their formulas: pairs rotated as complex numbers, the L2 norm, the '
    .. 'temperature scales (f64)', function()
    ms.manual_seed(4)
    local m = llama4.new(small()):to('f64')
    local x = ms.randn({ 2, 9, 16 }, { dtype = 'f64', seed = 8 })
    for li, kind in ipairs({ 'rope', 'rope', 'rope', 'nope' }) do
      local att = m.model.layers[li].self_attn
      local got = ms.no_grad(function() return att(x) end)
      local want = A.no_grad(function()
        local B, Tn, H, hd = 2, 9, 2, 8
        local qf = att.q_proj(x):reshape(B, Tn, H, hd)
        local kf = att.k_proj(x):reshape(B, Tn, 1, hd)
        local function rot(t, heads)   -- (x[2i], x[2i+1]) times e^(i p f_i), as Meta's complex form
          local out = ms.zeros(t.shape, { dtype = 'f64' })
          for p = 0, Tn - 1 do
            for i = 0, hd / 2 - 1 do
              local f = type(att.rope) == 'table' and att.rope.inv[i + 1] or 1 / att.rope ^ (2 * i / hd)
              local c, s = math.cos(p * f), math.sin(p * f)
              local re = t:narrow(2, p + 1, 1):narrow(4, 2 * i + 1, 1)
              local im = t:narrow(2, p + 1, 1):narrow(4, 2 * i + 2, 1)
              out:narrow(2, p + 1, 1):narrow(4, 2 * i + 1, 1):copy_(re * c - im * s)
              out:narrow(2, p + 1, 1):narrow(4, 2 * i + 2, 1):copy_(re * s + im * c)
            end
          end
          return out
        end
        local function l2(t) return t / ((t * t):mean(4, true) + 1e-5):sqrt() end   -- (rms_norm_eps)
        if kind == 'rope' then
          qf, kf = l2(rot(qf, H)), l2(rot(kf, 1))
        else
          local sc = {}
          for p = 0, Tn - 1 do sc[p + 1] = 1 + 0.3 * math.log(1 + math.floor((p + 1) / 2)) end
          qf = qf * ms.tensor(sc, { dtype = 'f64' }):reshape({ 1, Tn, 1, 1 })
        end
        local qh, kh = qf:transpose(2, 3):contiguous(), kf:transpose(2, 3):expand(B, H, Tn, hd):contiguous()
        local vh = att.v_proj(x):reshape(B, Tn, 1, hd):transpose(2, 3):expand(B, H, Tn, hd):contiguous()
        local y
        if att.chunk then y = chunked_reference(qh, kh, vh, att.chunk)
        else y = nnf.scaled_dot_product_attention(qh, kh, vh, { causal = true, unfused = true }) end
        return att.o_proj(y:transpose(2, 3):reshape(B, Tn, H * hd))
      end)
      local err = (got - want):abs():max():item()
      assert.is_true(err < 1e-12, ('layer %d (%s): %g'):format(li - 1, kind, err))
    end
  end)

  it('finite differences through the whole model: chunked RoPE attention, the temperature-tuned NoPE layer, the '
    .. 'router\'s input scaling (top-1 and top-2), the experts, the shared expert', function()
    for _, k in ipairs({ 1, 2 }) do
      ms.manual_seed(6)
      local m = llama4.new(small({ num_experts_per_tok = k, attention_bias = true })):to('f64')
      for name, p in m:named_parameters() do if not name:match('norm') then ms.normal_(p, 0, 0.4) end end
      local L = m.model.layers
      local x, y = S.token_batch(2, 10, 40, 7)
      local worst = A.gradcheck(function() return m(x, y) end, { L[2].feed_forward.router.weight,
        L[4].feed_forward.router.weight, L[2].feed_forward.experts[2].gate_proj.weight,
        L[4].feed_forward.experts[3].down_proj.weight, L[2].feed_forward.shared_expert.up_proj.weight,
        L[1].self_attn.q_proj.weight, L[1].self_attn.k_proj.bias, L[4].self_attn.q_proj.weight,
        L[4].self_attn.v_proj.bias, L[3].feed_forward.gate_proj.weight, m.model.embed_tokens.weight })
      assert.is_true(worst < 1e-6, ('top-%d: relative error %g'):format(k, worst))
    end
  end)

  it('configs: transformers\' derived lists and defaults, older fields; errors name the field', function()
    local cfg = hf.config(llama4, nil, small())
    assert.are.same({ 1, 1, 1, 0 }, cfg.no_rope_layers)
    assert.are.same({ 1, 3 }, cfg.moe_layers)
    assert.are.same({ 'chunked_attention', 'chunked_attention', 'chunked_attention', 'full_attention' },
      cfg.layer_types)
    assert.are.same({ rope_type = 'default', rope_theta = 500000.0 }, cfg.rope_parameters)
    local d = hf.config(llama4, nil, {})
    assert.are.equal(16, d.num_local_experts)
    assert.are.equal(48, #d.moe_layers)
    -- older config.json fields: rope_theta and rope_scaling at the top level
    local old = hf.config(llama4, nil, small({ rope_theta = 1000, rope_scaling = { type = 'linear', factor = 2 },
      moe_layers = 2 }))
    assert.are.same({ rope_type = 'linear', rope_theta = 1000, factor = 2 }, old.rope_parameters)
    assert.are.same({ 2 }, old.moe_layers)
    -- Scout's preset config builds (its llama3 RoPE without a blended band)
    local sc = hf.config(llama4, 'scout')
    local r = llama4.rope(sc)
    assert.are.equal(64, #r.inv)
    assert.are.equal(1, r.inv[1])
    assert.is_true(math.abs(r.inv[64] - 1 / 500000 ^ (126 / 128) / 16) < 1e-22)
    local function bad(over, msg)
      local ok, err = pcall(llama4.new, small(over))
      assert.is_false(ok)
      assert.matches(msg, tostring(err), 1, true)
    end
    bad({ num_experts_per_tok = 5 }, 'llama4 config: num_experts_per_tok 5 is more than num_local_experts 4')
    bad({ layer_types = { 'chunked_attention', 'sliding_attention', 'full_attention', 'full_attention' } },
      'llama4 config: layer_types[1] must be chunked_attention or full_attention, got sliding_attention')
    bad({ layer_types = { 'full_attention' } },
      'llama4 config: layer_types must list one of chunked_attention, full_attention for each of the 4 layers, got 1')
    bad({ no_rope_layers = { 1, 0 } }, 'llama4 config: no_rope_layers has 2 entries for 4 layers (num_hidden_layers)')
    bad({ no_rope_layers = { 1, 2, 1, 1 } }, 'llama4 config: no_rope_layers[1] must be 1 (RoPE) or 0 (NoPE), got 2')
    bad({ attention_chunk_size = hf.null }, 'llama4 config: attention_chunk_size is null, but layer_types has '
      .. 'chunked_attention layers')
    bad({ moe_layers = { 1, 7 } }, 'llama4 config: moe_layers holds layer 7, past the 4 layers (num_hidden_layers)')
    bad({ rope_parameters = { rope_type = 'longrope', rope_theta = 1e4 } },
      'llama4 config: rope_parameters.rope_type longrope is not supported (default, linear, llama3 or yarn)')
    bad({ rope_parameters = { rope_type = 'llama3', rope_theta = 1e4, factor = 8 } },
      'llama4 config: rope_parameters: llama3_rope: low_freq_factor must be a positive number, got nil')
    bad({ num_attention_heads = 3, num_key_value_heads = 2 },
      'llama4 config: num_attention_heads (3) must be a multiple of num_key_value_heads (2)')
    bad({ head_dim = 7 }, 'llama4 config: head_dim (7) must be even for RoPE')
    bad({ interleave_moe_layers_step = 2 }, 'llama4 config: unknown field interleave_moe_layers_step (did you mean '
      .. 'interleave_moe_layer_step?)')
    bad({ floor_scale = 0 }, 'llama4 config: floor_scale must be a positive integer, got 0')
    -- every layer NoPE: no RoPE needed, an odd head_dim allowed; no chunked layers: no chunk size needed
    assert.is_not_nil(llama4.new(small({ no_rope_layers = { 0, 0, 0, 0 }, head_dim = 7, attention_chunk_size = hf.null })))
    -- a folder of another model is named
    local dir = S.tmpdir()
    hf.write_json(dir .. '/config.json', { model_type = 'llama', hidden_size = 16 })
    local ok, err = pcall(llama4.from_pretrained, dir)
    assert.is_false(ok)
    assert.matches('config.json has model_type llama, expected llama4_text', tostring(err), 1, true)
    hf.write_json(dir .. '/config.json', { model_type = 'llama4', vision_config = {} })
    ok, err = pcall(llama4.from_pretrained, dir)
    assert.is_false(ok)
    assert.matches('config.json has model_type llama4 but no text_config', tostring(err), 1, true)
    os.execute('rm -rf ' .. q(dir))
    -- bad input
    local m = llama4.new(small())
    assert.has_error(function() m.model.layers[1].self_attn(ms.zeros({ 2, 3, 5 })) end,
      'Llama4TextAttention: expected x of shape (B, T, 16), got (2, 3, 5)')
    ok, err = pcall(m, ms.tensor({ { 1, 2, 40 } }, { dtype = 'i64' }))
    assert.is_false(ok)
    assert.matches('input_ids holds token id 40, outside the vocabulary [0, 40)', tostring(err), 1, true)
  end)

  it('no load-balancing loss, whatever output_router_logits says (as transformers\' Llama 4)', function()
    ms.manual_seed(2)
    local a = llama4.new(small())
    local dir = S.tmpdir()
    a:save_pretrained(dir)
    local j = hf.read_json(dir .. '/config.json')
    j.output_router_logits = true
    hf.write_json(dir .. '/config.json', j)
    local b = llama4.from_pretrained(dir)
    local x, y = S.token_batch(2, 6, 40, 9)
    assert.are.equal(a(x, y):item(), b(x, y):item())
    os.execute('rm -rf ' .. q(dir))
  end)

  describe('bin/train', function()
    local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 32 '
      .. '--model.intermediate_size_mlp 48 --model.head_dim 8 --model.no_rope_layer_interval 2 '
      .. '--model.attention_chunk_size 8 --model.floor_scale 4 --seq-len 20 --lr 1e-2 --warmup 1 --eval-every 0 '
      .. '--eval-iters 2 --sample-tokens 0 --log-every 2'

    it('trains the tiny preset; two ranks follow one process: FSDP, expert parallel, both', function()
      S.moe_train_runs('models/llama4.lua', flags, { '--fsdp FULL_SHARD', '--ep 2', '--ep 2 --fsdp FULL_SHARD' }, '')
    end)

    it('--out holds a checkpoint in transformers\' names (fused experts) that reads back; under --fsdp too; '
      .. '--moe-bias-rate balances', function()
      local dir = S.tmpdir()
      local f = flags .. ' --data ' .. q(S.fixed_corpus(dir, 20000))
      local status, text = S.bin_train(('models/llama4.lua %s --batch-size 4 --steps 2 --moe-bias-rate 0.01 '
        .. '--out %s/one'):format(f, q(dir)))
      assert.are.equal(0, status, text)
      local sd = ms.load_safetensors(dir .. '/one/model.safetensors')
      assert.are.same({ 4, 32, 64 }, sd['model.layers.1.feed_forward.experts.gate_up_proj'].shape)
      assert.is_nil(sd['model.layers.1.feed_forward.experts.0.gate_proj.weight'])
      local m = llama4.from_pretrained(dir .. '/one')
      assert.is_true(m.model.layers[2].feed_forward.expert_bias:abs():sum():item() > 0)
      status, text = S.bin_train(('--nproc-per-node 2 --device cpu models/llama4.lua %s --batch-size 4 '
        .. '--steps 2 --fsdp FULL_SHARD --moe-bias-rate 0.01 --out %s/fsdp'):format(f, q(dir)))
      assert.are.equal(0, status, text)
      -- (save_full's file in our experts' names, rewritten in the checkpoints': hf.export_file)
      local sf = ms.load_safetensors(dir .. '/fsdp/model.safetensors')
      assert.are.same({ 4, 32, 64 }, sf['model.layers.1.feed_forward.experts.gate_up_proj'].shape)
      assert.are.same({ 4, 32, 32 }, sf['model.layers.1.feed_forward.experts.down_proj'].shape)
      assert.is_nil(sf['model.layers.1.feed_forward.experts.3.down_proj.weight'])
      local ka, kb = {}, {}
      for k in pairs(sd) do ka[#ka + 1] = k end
      for k in pairs(sf) do kb[#kb + 1] = k end
      table.sort(ka); table.sort(kb)
      assert.are.same(ka, kb)
      local x, y = S.token_batch(2, 20, 256, 3)
      assert.is_true(llama4.from_pretrained(dir .. '/fsdp')(x, y):item() > 0)
      os.execute('rm -rf ' .. q(dir))
    end)
  end)
end)
