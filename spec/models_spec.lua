-- Golden runs of models/gpt2.lua and models/llama.lua against the PyTorch
-- fixtures in ../shared/fixtures (see its README): logits, loss and every
-- parameter gradient within 1e-5 relative error in f32 and 1e-6 in f64;
-- 20 AdamW steps against an independent recomputation in plain Lua; configs,
-- presets, save/load round trips, sampling and the errors bad input gives.
local ffi = require 'ffi'
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local nn = require 'moonshard.nn'
local gpt2 = require 'models.gpt2'
local llama = require 'models.llama'
local hf = require 'models.hf'
local json = require 'dkjson'

local fixtures = T.root .. '/../shared/fixtures'
local have_fixtures = io.open(fixtures .. '/gpt2-tiny/model.safetensors', 'rb')
if have_fixtures then have_fixtures:close() end

-- host copy of a tensor as a flat Lua list of doubles (row-major)
local function values(t)
  local h = t:to({ dtype = 'f64', device = 'cpu', copy = true }):contiguous()
  local p = ffi.cast('double*', h:data_ptr())
  local out = {}
  for i = 0, h:numel() - 1 do out[i + 1] = p[i] end
  return out
end

-- ‖got − expected‖ / ‖expected‖, in double precision
local function relerr(got, exp)
  assert(got ~= nil, 'no tensor to compare')
  assert.are.same(exp.shape, got.shape)
  local g, e = values(got), values(exp)
  local num, den = 0, 0
  for i = 1, #e do
    local d = g[i] - e[i]
    num, den = num + d * d, den + e[i] * e[i]
  end
  return math.sqrt(num) / math.sqrt(den)
end

local S = require 'spec.support'
local tmpdir = S.tmpdir

local families = {
  { name = 'gpt2-tiny', M = gpt2 },
  { name = 'llama-tiny', M = llama },
}

for _, fam in ipairs(families) do
  local M, dir = fam.M, fixtures .. '/' .. fam.name
  local function golden(dtype, bound, hooked)
    local model = M.from_pretrained(dir)
    if dtype ~= 'f32' then model:to(dtype) end
    local blocks, seen = model.transformer and model.transformer.h or model.model.layers, 0
    if hooked then
      -- a hook on every block: an ordinary one makes the model run each
      -- block's plain forward, not the deferred residual adds; a passive
      -- one (as FSDP's) keeps them
      local passive = hooked == 'passive'
      for i = 1, #blocks do
        assert.is_true(blocks[i]:deferrable())
        blocks[i]:register_forward_hook(function() seen = seen + 1 end, passive)
        assert.are.equal(passive, blocks[i]:deferrable())
      end
    end
    local _, logits = S.hf_compare(model, dir, bound)
    assert.are.equal(dtype, logits.dtype)
    assert.are.equal(hooked and 2 * #blocks or 0, seen)
  end

  describe(fam.name .. ' golden run', function()
    if not have_fixtures then
      pending('fixtures not found under ' .. fixtures)
      return
    end

    it('matches logits, loss and every gradient in f32 (1e-5)', function() golden('f32', 1e-5) end)
    it('matches logits, loss and every gradient in f64 (1e-6)', function() golden('f64', 1e-6) end)
    it('matches them with a hook on every block (no deferred residual adds), f64', function()
      golden('f64', 1e-6, 'plain')
    end)
    it('matches them with a passive hook on every block (the deferred adds kept), f64', function()
      golden('f64', 1e-6, 'passive')
    end)

    it('names its parameters exactly as the Hugging Face checkpoint', function()
      local model = M.from_pretrained(dir)
      local sd = ms.load_safetensors(dir .. '/model.safetensors')
      local names, want = {}, {}
      for name in model:named_parameters() do names[#names + 1] = name end
      for k in pairs(sd) do want[#want + 1] = k end
      table.sort(names); table.sort(want)
      assert.are.same(want, names)
    end)

    it('20 AdamW steps equal an independent step-by-step recomputation', function()
      local model = M.from_pretrained(dir):to('f64')
      model:train()
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      local lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
      local opt = ms.optim.AdamW(model, { lr = lr, betas = { b1, b2 }, eps = eps, weight_decay = wd })
      -- the reference: plain Lua lists, decay on matrices that are not embeddings
      local ref = {}
      for name, p in model:named_parameters() do
        local v = values(p)
        local m, s = {}, {}
        for i = 1, #v do m[i], s[i] = 0, 0 end
        local decay = p:dim() >= 2 and not name:match('wte') and not name:match('wpe') and not name:match('embed_tokens')
        ref[#ref + 1] = { name = name, p = p, v = v, m = m, s = s, decay = decay }
      end
      local losses = {}
      for step = 1, 20 do
        opt:zero_grad()
        local loss = model(exp.input_ids, exp.targets)
        losses[step] = loss:item()
        loss:backward()
        for _, r in ipairs(ref) do
          local g = values(r.p.grad)
          local bc1, bc2 = 1 - b1 ^ step, 1 - b2 ^ step
          for i = 1, #r.v do
            local x = r.v[i]
            if r.decay then x = x - lr * wd * x end
            r.m[i] = b1 * r.m[i] + (1 - b1) * g[i]
            r.s[i] = b2 * r.s[i] + (1 - b2) * g[i] * g[i]
            local mh, sh = r.m[i] / bc1, r.s[i] / bc2
            r.v[i] = x - lr * mh / (math.sqrt(sh) + eps)
          end
        end
        opt:step()
        for _, r in ipairs(ref) do
          local got = values(r.p)
          local num, den = 0, 0
          for i = 1, #got do
            num = num + (got[i] - r.v[i]) ^ 2
            den = den + r.v[i] ^ 2
          end
          local e = math.sqrt(num / den)
          assert.is_true(e < 1e-10, ('step %d, %s: relative error %.3g'):format(step, r.name, e))
        end
      end
      assert.is_true(losses[20] < losses[1], ('loss %g -> %g'):format(losses[1], losses[20]))
    end)

    it('saves what it loads: save_pretrained -> from_pretrained gives the same model', function()
      local model = M.from_pretrained(dir)
      local out = tmpdir()
      model:save_pretrained(out)
      local cfg = assert(hf.read_json(out .. '/config.json'))
      assert.are.equal(M.model_type, cfg.model_type)
      assert.are.equal('float32', cfg.dtype)
      assert.is_table(cfg.architectures)
      local saved, meta = ms.load_safetensors(out .. '/model.safetensors')
      local orig = ms.load_safetensors(dir .. '/model.safetensors')
      local a, b = {}, {}
      for k, v in pairs(saved) do a[#a + 1] = k; assert.are.equal('f32', v.dtype) end
      for k in pairs(orig) do b[#b + 1] = k end
      table.sort(a); table.sort(b)
      assert.are.same(b, a) -- HF names; GPT-2's tied head saved once, as wte
      assert.are.equal('pt', meta and meta.format)
      for k, v in pairs(orig) do assert.are.equal(0, relerr(saved[k], v)) end
      local again = M.from_pretrained(out)
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      local l1 = ms.no_grad(function() return model(exp.input_ids) end)
      local l2 = ms.no_grad(function() return again(exp.input_ids) end)
      assert.are.equal(0, relerr(l2, l1))
      os.execute("rm -rf '" .. out .. "'")
    end)

    it('reports missing and mis-shaped keys of a checkpoint together', function()
      local out = tmpdir()
      os.execute(("cp '%s/config.json' '%s/'"):format(dir, out))
      local sd = ms.load_safetensors(dir .. '/model.safetensors')
      local names = {}
      for k in pairs(sd) do names[#names + 1] = k end
      table.sort(names)
      local dropped, reshaped = names[1], names[#names]
      sd[dropped] = nil
      sd[reshaped] = ms.zeros({ 3 })
      ms.save_safetensors(out .. '/model.safetensors', sd, { format = 'pt' })
      local ok, err = pcall(M.from_pretrained, out)
      assert.is_false(ok)
      err = tostring(err)
      assert.is_truthy(err:find(dropped, 1, true), err)
      assert.is_truthy(err:find(reshaped, 1, true), err)
      sd = ms.load_safetensors(dir .. '/model.safetensors')
      sd['extra.weight'] = ms.zeros({ 2 })
      ms.save_safetensors(out .. '/model.safetensors', sd, { format = 'pt' })
      ok, err = pcall(M.from_pretrained, out)
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find('extra.weight', 1, true), tostring(err))
      os.execute("rm -rf '" .. out .. "'")
    end)

    it('rejects bad input with clear errors', function()
      local model = M.from_pretrained(dir)
      local cfg = model.config
      local max_len = model:max_positions()
      local function fails(pat, ...)
        local ok, err = pcall(model, ...)
        assert.is_false(ok)
        assert.is_truthy(tostring(err):find(pat), ('expected /%s/, got: %s'):format(pat, tostring(err)))
      end
      fails('%(B, T%)', ms.zeros({ 4 }, { dtype = 'i64' }))
      fails('%(B, T%)', ms.zeros({ 1, 2, 3 }, { dtype = 'i64' }))
      fails('i64 or i32', ms.zeros({ 1, 4 }))
      fails('exceeds', ms.zeros({ 1, max_len + 1 }, { dtype = 'i64' }))
      fails('token id ' .. cfg.vocab_size, ms.full({ 1, 4 }, cfg.vocab_size, { dtype = 'i64' }))
      fails('token id %-1', ms.full({ 1, 4 }, -1, { dtype = 'i64' }))
      fails('targets have shape', ms.zeros({ 1, 4 }, { dtype = 'i64' }), ms.zeros({ 1, 5 }, { dtype = 'i64' }))
      fails('a %(B, T%) integer tensor', 'hello')
    end)

    it('generates: greedy follows the argmax, sampling repeats for a seed', function()
      local model = M.from_pretrained(dir)
      local prompt = { { 1, 2, 3, 4 }, { 5, 6, 7, 8 } }
      local out = model:generate(prompt, 5, { temperature = 0 })
      assert.are.same({ 2, 9 }, out.shape)
      assert.are.equal('i64', out.dtype)
      local rows = out:totable()
      -- the first new token is the argmax of the last logits of the prompt
      local logits = ms.no_grad(function() return model(ms.tensor(prompt, { dtype = 'i64' })) end):totable()
      for b = 1, 2 do
        local last, best, bi = logits[b][4], -math.huge, 0
        for v = 1, #last do if last[v] > best then best, bi = last[v], v - 1 end end
        assert.are.equal(bi, rows[b][5])
      end
      local s1 = model:generate(prompt, 8, { temperature = 1, top_k = 10, seed = 7 }):totable()
      local s2 = model:generate(prompt, 8, { temperature = 1, top_k = 10, seed = 7 }):totable()
      assert.are.same(s1, s2)
      -- longer than the model's positions: the context is cropped
      local long = model:generate({ 1 }, model:max_positions() + 2, { temperature = 0.5, seed = 1 })
      assert.are.same({ 1, model:max_positions() + 3 }, long.shape)
      local ok, err = pcall(model.generate, model, prompt, 2, { temperature = -1 })
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find('temperature'))
    end)
  end)
end

describe('model configs', function()
  it('carry Hugging Face field names and defaults', function()
    assert.are.equal(50257, gpt2.config.vocab_size)
    assert.are.equal(1024, gpt2.config.n_positions)
    assert.are.equal(768, gpt2.config.n_embd)
    assert.are.equal(1e-5, gpt2.config.layer_norm_epsilon)
    assert.are.equal('gelu_new', gpt2.config.activation_function)
    assert.is_true(gpt2.config.tie_word_embeddings)
    assert.are.equal(10000, llama.config.rope_parameters.rope_theta)
    assert.is_false(llama.config.tie_word_embeddings)
    assert.are.equal(1e-6, llama.config.rms_norm_eps)
  end)

  it('name the field of the wrong type', function()
    local function fails(M, cfg, pat)
      local ok, err = pcall(M.new, cfg)
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find(pat), ('expected /%s/, got: %s'):format(pat, tostring(err)))
    end
    fails(gpt2, { n_embd = '64' }, 'n_embd must be a positive integer')
    fails(gpt2, { n_layer = 2.5 }, 'n_layer must be a positive integer')
    fails(gpt2, { activation_function = 'relu' }, "activation_function must be one of 'gelu_new'")
    fails(gpt2, { layer_norm_epsilon = -1 }, 'layer_norm_epsilon must be a positive number')
    fails(gpt2, { tie_word_embeddings = false }, 'tie_word_embeddings')
    fails(gpt2, { n_embd = 65, n_head = 4 }, 'multiple of n_head')
    fails(gpt2, { n_layers = 2 }, 'did you mean n_layer')
    fails(gpt2, 42, 'expected a table')
    fails(llama, { num_key_value_heads = 3 }, 'multiple of num_key_value_heads')
    fails(llama, { rope_theta = 'big' }, 'rope_theta must be a positive number')
    fails(llama, { hidden_act = 'gelu' }, 'hidden_act must be one of')
    -- (patterns: no magic characters)
    fails(llama, { rope_parameters = { rope_type = 'dynamic', rope_theta = 1e4, factor = 2 } },
      'rope_type dynamic is not supported')
    fails(llama, { rope_parameters = { rope_type = 'llama3', rope_theta = 1e4, factor = 8 } },
      'llama3_rope: low_freq_factor must be a positive number, got nil')
    fails(llama, { rope_parameters = { rope_type = 'yarn', rope_theta = 1e4 } },
      'yarn_rope: factor must be a positive number, got nil')
    local ok, err = pcall(gpt2.new, 'huge')
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('unknown preset huge'))
  end)

  it('accept old-style rope_theta and unknown HF fields', function()
    local cfg = hf.config(llama, 'tiny', { rope_theta = 5e5, pretraining_tp = 1 })
    assert.are.equal(5e5, cfg.rope_parameters.rope_theta)
    assert.is_nil(cfg.rope_theta)
    assert.are.equal(1, cfg.pretraining_tp)
    -- Llama 3 style: a list of eos ids, rope_scaling null
    cfg = hf.config(llama, 'tiny', { eos_token_id = { 1, 2 }, rope_scaling = hf.null }, { from_json = true })
    assert.are.same({ 1, 2 }, cfg.eos_token_id)
    -- Llama 3.1 style: rope_scaling of rope_type llama3, beside rope_theta
    cfg = hf.config(llama, 'tiny', { rope_theta = 5e5, rope_scaling = { rope_type = 'llama3', factor = 8.0,
      low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position_embeddings = 8192 } }, { from_json = true })
    assert.are.same({ rope_type = 'llama3', rope_theta = 5e5, factor = 8, low_freq_factor = 1, high_freq_factor = 4,
      original_max_position_embeddings = 8192 }, cfg.rope_parameters)
    assert.is_nil(cfg.rope_scaling)
  end)

  it('scaled RoPE (Llama 3.1\'s llama3, linear, yarn): the frequencies of Meta\'s apply_scaling written out, the '
    .. 'attention using them, config.json both ways', function()
    local nnf = nn.functional
    local p = { factor = 8, low_freq_factor = 1, high_freq_factor = 4, original_max_position_embeddings = 8192 }
    local r = nnf.llama3_rope(500000, 128, p)
    local kinds = {}
    for i = 0, 63 do
      local f = 1 / 500000 ^ (2 * i / 128)
      local wl = 2 * math.pi / f
      local want, kind
      if wl < 8192 / 4 then want, kind = f, 'kept'
      elseif wl > 8192 / 1 then want, kind = f / 8, 'divided'
      else
        local sm = (8192 / wl - 1) / (4 - 1)
        want, kind = (1 - sm) * f / 8 + sm * f, 'blended'
      end
      kinds[kind] = (kinds[kind] or 0) + 1
      assert.is_true(math.abs(r.inv[i + 1] - want) <= 1e-15 * want, ('frequency %d'):format(i))
    end
    assert.is_true(kinds.kept > 0 and kinds.divided > 0 and kinds.blended > 0)
    -- low_freq_factor = high_freq_factor (Llama 4 Scout's): no blended band
    local r2 = nnf.llama3_rope(500000, 128, { factor = 16, low_freq_factor = 1, high_freq_factor = 1,
      original_max_position_embeddings = 8192 })
    local kept, divided = 0, 0
    for i = 0, 63 do
      local f = 1 / 500000 ^ (2 * i / 128)
      local want = 2 * math.pi / f < 8192 and f or f / 16
      if want == f then kept = kept + 1 else divided = divided + 1 end
      assert.are.equal(want, r2.inv[i + 1])
    end
    assert.is_true(kept > 0 and divided > 0)
    assert.has_error(function() nnf.llama3_rope(5e5, 8, { factor = 8, low_freq_factor = 4, high_freq_factor = 1,
      original_max_position_embeddings = 64 }) end, 'llama3_rope: high_freq_factor (1) must not be below low_freq_factor (4)')
    local lin = nnf.linear_rope(1e4, 8, { factor = 4 })
    assert.are.equal(1 / 4, lin.inv[1])
    assert.are.equal(1 / 1e4 ^ (6 / 8) / 4, lin.inv[4])
    -- the model's attention runs on them: as the default RoPE with the same frequencies fed by hand
    local rp = { rope_type = 'llama3', rope_theta = 5e5, factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0,
      original_max_position_embeddings = 32 }
    ms.manual_seed(3)
    local m = llama.new('tiny', { num_hidden_layers = 1, rope_parameters = rp })
    local att = m.model.layers[1].self_attn
    assert.are.equal('table', type(att.rope_theta))
    local x = ms.randn({ 1, 40, 128 }, { seed = 2 })
    local y = ms.no_grad(function() return att(x) end)
    local plain = nn.CausalSelfAttention { dim = 128, n_head = 4, n_kv_head = 2, head_dim = 32,
      rope_theta = { key = 'by hand', inv = att.rope_theta.inv, factor = 1 } }
    plain:load_state_dict(att:state_dict())
    assert.are.equal(0, relerr(ms.no_grad(function() return plain(x) end), y))
    att.rope_theta = 5e5
    assert.is_true(relerr(ms.no_grad(function() return att(x) end), y) > 1e-3)   -- (the scaling changes the output)
    -- config.json: rope_parameters and rope_scaling (transformers < 5), read back the same
    local out = tmpdir()
    local m2 = llama.new('tiny', { num_hidden_layers = 1, rope_parameters = rp })
    m2:save_pretrained(out)
    local j = hf.read_json(out .. '/config.json')
    assert.are.equal('llama3', j.rope_scaling.type)
    assert.are.equal(8, j.rope_scaling.factor)
    assert.are.equal(5e5, j.rope_theta)
    local ids = ms.tensor({ { 1, 2, 3, 4 } }, { dtype = 'i64' })
    assert.are.equal(m2(ids, ids):item(), llama.from_pretrained(out)(ids, ids):item())
    os.execute("rm -rf '" .. out .. "'")
  end)

  it('have presets: tiny for CPU, gpt2-124m, a ~1B llama', function()
    local m = gpt2.new('tiny')
    local n = 0
    for _, p in ipairs(m:parameters()) do n = n + p:numel() end
    local c = m.config
    local C, L = c.n_embd, c.n_layer
    assert.are.equal(c.vocab_size * C + c.n_positions * C + L * (12 * C * C + 13 * C) + 2 * C, n)
    local big = hf.config(gpt2, 'gpt2-124m')
    local Cb, Lb = big.n_embd, big.n_layer
    local nb = big.vocab_size * Cb + big.n_positions * Cb + Lb * (12 * Cb * Cb + 13 * Cb) + 2 * Cb
    assert.are.equal(124439808, nb)
    local l1 = hf.config(llama, 'llama-1b')
    local H, I, Lk = l1.hidden_size, l1.intermediate_size, l1.num_hidden_layers
    local kv = l1.num_key_value_heads * (H / l1.num_attention_heads)
    local nl = 2 * l1.vocab_size * H + Lk * (2 * H * H + 2 * H * kv + 3 * H * I + 2 * H) + H
    assert.is_true(nl > 1.0e9 and nl < 1.2e9, tostring(nl))
    local lt = llama.new('tiny')
    assert.is_not_nil(lt.lm_head)
  end)

  it('call the final norm and the head through model:head_module(), a plain field owning no names', function()
    ms.manual_seed(4)
    for _, tied in ipairs({ false, true }) do
      local m = llama.new('tiny', { tie_word_embeddings = tied, num_hidden_layers = 2 })
      local head = m:head_module()
      assert.are.equal('LMHead', head:class_name())
      assert.are.equal(tied, head.tied)
      assert.are.equal(m.model.norm, head.norm)
      assert.are.equal(tied and m.model.embed_tokens or m.lm_head, head.proj)
      for name, mod in m:named_modules() do assert.are_not.equal(head, mod, name) end
      local sd, keys = m:state_dict()
      assert.are.equal(tied and 20 or 21, #keys)   -- embed, 2 x 9, norm (, lm_head)
      -- the same loss as the norm and lm_loss called by hand
      local x = ms.tensor({ { 1, 2, 3, 4 } }, { dtype = 'i64' })
      local y = ms.tensor({ { 2, 3, 4, 5 } }, { dtype = 'i64' })
      local want = ms.no_grad(function()
        return nn.functional.lm_loss(m.model(x), m:head_weight(), y):item()
      end)
      local got = ms.no_grad(function() return m(x, y):item() end)
      assert.is_true(math.abs(got - want) <= 1e-6 * math.abs(want), ('%.9g vs %.9g'):format(got, want))
    end
    local g = gpt2.new('tiny')
    assert.is_true(g:head_module().tied)
    assert.is_nil(g:head_module().norm)
    assert.are.equal(g.transformer.wte, g:head_module().proj)
  end)

  it('tie llama\'s head when asked, and save it once', function()
    ms.manual_seed(3)
    local m = llama.new('tiny', { tie_word_embeddings = true, num_hidden_layers = 1 })
    local names = {}
    for name in m:named_parameters() do names[name] = true end
    assert.is_nil(names['lm_head.weight'])
    local out = tmpdir()
    m:save_pretrained(out)
    local sd = ms.load_safetensors(out .. '/model.safetensors')
    assert.is_nil(sd['lm_head.weight'])
    local again = llama.from_pretrained(out)
    local x = ms.tensor({ { 1, 2, 3 } }, { dtype = 'i64' })
    local a = ms.no_grad(function() return m(x) end)
    local b = ms.no_grad(function() return again(x) end)
    assert.are.equal(0, relerr(b, a))
    os.execute("rm -rf '" .. out .. "'")
  end)

  it('read sharded checkpoints (model.safetensors.index.json and its shards), whole and deferred; refuse a broken '
    .. 'index by name', function()
    ms.manual_seed(4)
    local m = llama.new('tiny', { num_hidden_layers = 2 })
    local out = tmpdir()
    m:save_pretrained(out)
    local sd = ms.load_safetensors(out .. '/model.safetensors')
    os.remove(out .. '/model.safetensors')
    -- two shards as transformers names them, the layers' tensors in the second
    local shards, wm = { {}, {} }, {}
    for name, t in pairs(sd) do
      local i = name:match('^model%.layers%.') and 2 or 1
      shards[i][name] = t
      wm[name] = ('model-0000%d-of-00002.safetensors'):format(i)
    end
    for i = 1, 2 do ms.save_safetensors(('%s/model-0000%d-of-00002.safetensors'):format(out, i), shards[i]) end
    local function write_index(map)
      local f = assert(io.open(out .. '/model.safetensors.index.json', 'wb'))
      f:write(json.encode({ metadata = { total_size = 0 }, weight_map = map }))
      f:close()
    end
    write_index(wm)
    local x = ms.tensor({ { 1, 2, 3, 4 } }, { dtype = 'i64' })
    local want = ms.no_grad(function() return m(x) end)
    local again = llama.from_pretrained(out)
    assert.are.equal(0, relerr(ms.no_grad(function() return again(x) end), want))
    local lazy = ms.nn.materialize(llama.from_pretrained(out, { deferred = true }))
    assert.are.equal(0, relerr(ms.no_grad(function() return lazy(x) end), want))
    local function refused(msg)
      local ok, err = pcall(llama.from_pretrained, out)
      assert.is_false(ok)
      assert.matches(msg, tostring(err), 1, true)
    end
    -- the index places a tensor in a shard that lacks it
    local bad = {}
    for k, v in pairs(wm) do bad[k] = v end
    bad['model.norm.weight'] = 'model-00002-of-00002.safetensors'
    write_index(bad)
    refused('places model.norm.weight in model-00002-of-00002.safetensors, which does not hold it')
    -- a tensor in two shards
    shards[2]['model.norm.weight'] = sd['model.norm.weight']
    ms.save_safetensors(out .. '/model-00002-of-00002.safetensors', shards[2])
    write_index(wm)
    refused('tensor model.norm.weight is in two shards, model-00001-of-00002.safetensors and '
      .. 'model-00002-of-00002.safetensors')
    -- a shard missing, a path for a file name, no index at all
    shards[2]['model.norm.weight'] = nil
    ms.save_safetensors(out .. '/model-00002-of-00002.safetensors', shards[2])
    bad['model.norm.weight'] = 'model-00003-of-00002.safetensors'
    write_index(bad)
    refused('shard model-00003-of-00002.safetensors, named by ' .. out .. '/model.safetensors.index.json, not found')
    bad['model.norm.weight'] = '../elsewhere.safetensors'
    write_index(bad)
    refused('weight_map[model.norm.weight] = ../elsewhere.safetensors is not a file name in the folder')
    os.remove(out .. '/model.safetensors.index.json')
    refused('neither model.safetensors nor model.safetensors.index.json (a sharded checkpoint) found')
    os.execute("rm -rf '" .. out .. "'")
  end)

  it('read older GPT-2 checkpoints (no transformer. prefix, mask buffers)', function()
    if not have_fixtures then return pending('no fixtures') end
    local dir = fixtures .. '/gpt2-tiny'
    local sd = ms.load_safetensors(dir .. '/model.safetensors')
    local old = {}
    for k, v in pairs(sd) do old[(k:gsub('^transformer%.', ''))] = v end
    old['h.0.attn.bias'] = ms.ones({ 1, 1, 64, 64 })
    local out = tmpdir()
    os.execute(("cp '%s/config.json' '%s/'"):format(dir, out))
    ms.save_safetensors(out .. '/model.safetensors', old, { format = 'pt' })
    local m = gpt2.from_pretrained(out)
    assert.are.equal(0, relerr(m.transformer.wte.weight, sd['transformer.wte.weight']))
    os.execute("rm -rf '" .. out .. "'")
  end)

  it('compute the loss through nn.functional.lm_loss, looked up at call time', function()
    ms.manual_seed(1)
    local m = gpt2.new('tiny', { n_layer = 1 })
    local saw
    local orig = nn.functional.lm_loss
    nn.functional.lm_loss = function(h, w, y, o)
      saw = { h = h.shape, w = w }
      return orig(h, w, y, o)
    end
    local x = ms.tensor({ { 1, 2, 3 } }, { dtype = 'i64' })
    local ok, err = pcall(m, x, x)
    nn.functional.lm_loss = orig
    assert.is_true(ok, tostring(err))
    assert.are.same({ 1, 3, 128 }, saw.h)
    assert.is_true(rawequal(saw.w, m.transformer.wte.weight) or saw.w.id == m.transformer.wte.weight.id)
  end)
end)

-- The bias gradients of GPT-2's c_proj layers (attn.c_proj, mlp.c_proj in
-- gelu_mlp) come from the next norm's backward (its column sums of the
-- branch gradient) instead of the GEMM's bias epilogue: the same values
-- with the fusion on and off, and the fused path really taken (2 a block)
describe('gpt2-tiny: c_proj bias gradients from the norm backward', function()
  if not have_fixtures then
    pending('fixtures not found under ' .. fixtures)
    return
  end
  local nnf = nn.functional
  local dir = fixtures .. '/gpt2-tiny'
  -- every parameter's gradient (f64 copies) and the sums taken, fusion `on`
  local function step(on, bf16, attn)
    local prev = nnf.set_norm_bias_sum(on)
    local prev_attn = nnf.set_attention_bias_sum(attn == true)
    local model = gpt2.from_pretrained(dir)
    if bf16 then nnf.set_precision(model, { compute = 'bf16' }) end
    model:eval()
    local exp = ms.load_safetensors(dir .. '/expected.safetensors')
    local before = nnf.norm_bias_sum_count()
    local ok, err = pcall(function()
      model:zero_grad()
      model(exp.input_ids, exp.targets):backward()
    end)
    nnf.set_norm_bias_sum(prev)
    nnf.set_attention_bias_sum(prev_attn)
    assert(ok, err)
    local grads = {}
    for name, p in model:named_parameters() do grads[name] = p.grad:to({ dtype = 'f64', copy = true }) end
    return grads, nnf.norm_bias_sum_count() - before, #model.transformer.h
  end
  -- attn: c_attn's bias gradient from the attention backward's column sums
  -- of dq, dk, dv too (ms_attention_backward_sum): 3 sums a block, not 2
  local function compare(bound, attn)
    local on, taken, nl = step(true, bound > 1e-4, attn)
    local off, none = step(false, bound > 1e-4, false)
    assert.are.equal((attn and 3 or 2) * nl, taken)
    assert.are.equal(0, none)
    local nb, na = 0, 0
    for name, g in pairs(off) do
      local e = relerr(on[name], g)
      assert.is_true(e <= bound, ('%s: relative error %.3g > %g'):format(name, e, bound))
      if name:match('c_proj%.bias$') or name:match('c_attn%.bias$') then
        if name:match('c_attn') then na = na + 1 else nb = nb + 1 end
        assert.is_true(values(g)[1] ~= 0, name .. ' is zero')
      end
    end
    assert.are.equal(2 * nl, nb)
    assert.are.equal(nl, na)
  end
  it('in f32 equal those of the bias epilogue (1e-5)', function() compare(1e-5) end)
  for _, bound in ipairs({ 1e-5, 1e-2 }) do
    it(('with c_attn\'s from the attention backward too: equal (%g), 3 sums a block'):format(bound), function()
      compare(bound, true)
    end)
  end
  it('under bf16 autocast equal them within bf16 rounding (1e-2)', function() compare(1e-2) end)
  -- the attention's sums are f32: an f64 model's c_attn bias gradient is
  -- the plain column sum of dqkv (they were taken and rounded to f32 before)
  it('in f64 leave c_attn\'s bias gradient in f64 (1e-13 of the plain sums)', function()
    local function grads(attn)
      local prev = nnf.set_attention_bias_sum(attn)
      local model = gpt2.from_pretrained(dir):to('f64')
      local exp = ms.load_safetensors(dir .. '/expected.safetensors')
      local ok, err = pcall(function() model(exp.input_ids, exp.targets):backward() end)
      nnf.set_attention_bias_sum(prev)
      assert(ok, err)
      local g = {}
      for name, p in model:named_parameters() do g[name] = p.grad end
      return g
    end
    local on, off = grads(true), grads(false)
    local n = 0
    for name, g in pairs(off) do
      local e = relerr(on[name], g)
      assert.is_true(e <= 1e-13, ('%s: relative error %.3g'):format(name, e))
      if name:match('c_attn%.bias$') then n = n + 1 end
    end
    assert.is_true(n >= 2)
  end)
  it('are not taken when the branch output has another consumer', function()
    local function run(on, twice)
      local x = T.randn({ 2, 5, 8 }, { seed = 7901 }):requires_grad_()
      local w = T.randn({ 8, 8 }, { seed = 7902 }):requires_grad_()
      local b = T.randn({ 8 }, { seed = 7903 }):requires_grad_()
      local lw = T.randn({ 8 }, { seed = 7904 })
      local prev = nnf.set_norm_bias_sum(on)
      local before = nnf.norm_bias_sum_count()
      local h = nnf.conv1d_linear(x, w, b)
      local r, y = nnf.add_layer_norm(x, h, lw, nil, 1e-5)
      local loss = (y * y):sum() + (r * r):sum()
      if twice then loss = loss + (h * h):sum() end
      loss:backward()
      nnf.set_norm_bias_sum(prev)
      return b.grad:to({ dtype = 'f64', copy = true }), nnf.norm_bias_sum_count() - before
    end
    local db_on, n_on = run(true, false)
    local db_off, n_off = run(false, false)
    assert.are.equal(1, n_on)
    assert.are.equal(0, n_off)
    assert.is_true(relerr(db_on, db_off) <= 1e-5)
    local db2_on, n2 = run(true, true)
    local db2_off = run(false, true)
    assert.are.equal(0, n2)
    assert.is_true(relerr(db2_on, db2_off) <= 1e-5)
    assert.is_true(relerr(db2_on, db_on) > 1e-3)   -- the other consumer's share is in it
  end)
end)
