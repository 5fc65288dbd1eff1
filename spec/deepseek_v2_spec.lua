-- models/deepseek_v2.lua (docs/models.md, "DeepSeek-V2"): golden runs
-- against transformers' DeepseekV2ForCausalLM (spec/fixtures, made by
-- tools/make_deepseek_fixture.py: group-limited greedy routing with q
-- through the low-rank pair; V2-Lite's layout with q_proj, greedy routing,
-- biases and YaRN; both with the chosen scores scaled, not renormalised),
-- logits, loss and every gradient within 1e-6 relative in f64 and 1e-5 in
-- f32; V2's router (softmax, a group scored by its best expert, greedy
-- ignoring the groups) against its choices written out; float64 finite differences; the
-- save/load round trip with transformers' names and config; DeepSeek's own
-- config fields read; what it cannot run refused by name; bin/train on one
-- process and on two ranks (FSDP, expert parallel).
local ms = require 'moonshard'
local A = ms.autograd
local nn = ms.nn
local hf = require 'models.hf'
local ds = require 'models.deepseek_v2'
local S = require 'spec.support'
local q = S.shell_quote

local fixtures = require('moonshard.tensor').root .. '/spec/fixtures'

-- a small config (vocabulary 40)
local function small(over)
  local cfg = { vocab_size = 40, hidden_size = 16, intermediate_size = 20, moe_intermediate_size = 12,
    num_hidden_layers = 3, num_attention_heads = 2, n_shared_experts = 1, n_routed_experts = 6,
    routed_scaling_factor = 1.5, kv_lora_rank = 8, q_lora_rank = 12, qk_rope_head_dim = 4, v_head_dim = 6,
    qk_nope_head_dim = 4, topk_method = 'group_limited_greedy', n_group = 3, topk_group = 2,
    num_experts_per_tok = 2, first_k_dense_replace = 1, max_position_embeddings = 16,
    bos_token_id = hf.null, eos_token_id = hf.null }
  for k, v in pairs(over or {}) do cfg[k] = v end
  return cfg
end

describe('models.deepseek_v2', function()
  before_each(function() A.clear_tape() end)

  for _, case in ipairs({ 'deepseek-v2-tiny', 'deepseek-v2-tiny-lite' }) do
    local dir = fixtures .. '/' .. case
    it(case .. ': logits, loss and every gradient as transformers\' in f64 (1e-6)', function()
      S.hf_golden(ds, dir, 'f64', 1e-6)
    end)
    it(case .. ': the same in f32 (1e-5)', function() S.hf_golden(ds, dir, 'f32', 1e-5) end)
  end

  it('the router: softmax scores, groups scored by their best expert (greedy: no groups); the parameters named as '
    .. 'the checkpoint', function()
    local dir = fixtures .. '/deepseek-v2-tiny'
    local m = ds.from_pretrained(dir)
    local want, got = {}, {}
    for k in pairs(ms.load_safetensors(dir .. '/model.safetensors')) do want[#want + 1] = k end
    for k in pairs(m:state_dict()) do got[#got + 1] = k end
    table.sort(want); table.sort(got)
    assert.are.same(want, got)
    assert.is_true(m.model.layers[1].self_attn.rope_interleave)
    for _, method in ipairs({ 'group_limited_greedy', 'greedy' }) do
      ms.manual_seed(11)
      local mm = ds.new(small({ topk_method = method })):to('f64')
      local moe = mm.model.layers[2].mlp
      assert.are.equal(nn.MoE, getmetatable(moe))
      assert.is_nil(moe:routing_bias())
      local x = ms.randn({ 12, 16 }, { dtype = 'f64', seed = 4 })
      local probs, ids = moe:route(x)
      local logits = A.no_grad(function() return moe.gate(x) end)
      local pv, iv, sv = logits:totable(), ids:totable(), probs:totable()
      for t = 1, 12 do
        local mx, z = -math.huge, 0
        for e = 1, 6 do mx = math.max(mx, pv[t][e]) end
        local p = {}
        for e = 1, 6 do p[e] = math.exp(pv[t][e] - mx); z = z + p[e] end
        for e = 1, 6 do
          p[e] = p[e] / z
          assert.is_true(math.abs(sv[t][e] - p[e]) < 1e-12, ('%s token %d expert %d: %g vs %g'):format(method, t, e,
            sv[t][e], p[e]))
        end
        local allowed = { true, true, true, true, true, true }
        if method == 'group_limited_greedy' then
          -- groups {1,2}, {3,4}, {5,6} by their best; the worst group out
          local g = { math.max(p[1], p[2]), math.max(p[3], p[4]), math.max(p[5], p[6]) }
          local worst = 1
          for i = 2, 3 do if g[i] < g[worst] then worst = i end end
          allowed[2 * worst - 1], allowed[2 * worst] = false, false
        end
        local order = {}
        for e = 1, 6 do if allowed[e] then order[#order + 1] = e end end
        table.sort(order, function(a, b) return p[a] > p[b] end)
        local chosen = { iv[t][1] + 1, iv[t][2] + 1 }
        table.sort(chosen, function(a, b) return p[a] > p[b] end)
        assert.are.same({ order[1], order[2] }, chosen, method .. ' token ' .. t)
      end
    end
  end)

  it('float64 finite differences through the latent attention, the router and the experts', function()
    ms.manual_seed(6)
    local m = ds.new(small()):to('f64')
    for name, p in m:named_parameters() do
      if not name:match('norm') then ms.normal_(p, 0, 0.3) else ms.normal_(p, 1, 0.1) end
    end
    local x, y = S.token_batch(2, 5, 40, 7)
    local L = m.model.layers
    local worst = A.gradcheck(function() return m(x, y) end, { L[1].self_attn.q_a_proj.weight,
      L[2].mlp.gate.weight, L[2].mlp.experts[1].up_proj.weight, L[3].mlp.shared_experts.down_proj.weight,
      L[3].self_attn.kv_b_proj.weight })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('save_pretrained / from_pretrained: DeepseekV2ForCausalLM\'s config.json and names, the same loss; '
    .. 'DeepSeek\'s own config fields read; what it cannot run refused by name', function()
    ms.manual_seed(5)
    local rp = { rope_type = 'yarn', rope_theta = 5000.0, factor = 2.0, original_max_position_embeddings = 8,
      mscale = 0.707, mscale_all_dim = 0.707 }
    local m = ds.new(small({ rope_parameters = rp, q_lora_rank = hf.null }))
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local cfg = hf.read_json(dir .. '/config.json')
    assert.are.same({ 'DeepseekV2ForCausalLM' }, cfg.architectures)
    assert.are.equal('deepseek_v2', cfg.model_type)
    assert.are.equal('group_limited_greedy', cfg.topk_method)
    assert.is_truthy(S.slurp(dir .. '/config.json'):find('"q_lora_rank": null', 1, true))
    assert.are.equal(4, cfg.head_dim)
    assert.are.equal('yarn', cfg.rope_scaling.type)
    local x, y = S.token_batch(2, 6, 40, 13)
    assert.are.equal(m(x, y):item(), ds.from_pretrained(dir)(x, y):item())
    -- DeepSeek's own config.json: rope_theta and rope_scaling at the top,
    -- its training fields kept, moe_layer_freq 1
    cfg.rope_parameters = nil
    cfg.rope_theta, cfg.rope_scaling = 5000, { type = 'yarn', factor = 2, original_max_position_embeddings = 8,
      mscale = 0.707, mscale_all_dim = 0.707 }
    cfg.moe_layer_freq, cfg.aux_loss_alpha, cfg.seq_aux, cfg.scoring_func = 1, 0.001, true, 'softmax'
    local f = assert(io.open(dir .. '/config.json', 'wb'))
    f:write(require('dkjson').encode(cfg))
    f:close()
    -- (aux_loss_alpha 0.001: the training loss adds the sequence-wise balance
    -- loss, as DeepSeek's MoEGate in training mode; in eval mode it does not)
    local loaded = ds.from_pretrained(dir)
    assert.are.equal(0.001, loaded.config.aux_loss_alpha)
    local with = loaded(x, y):item()
    local direct = ms.nn.moe.seq_aux_loss(ms.nn.moe.layers(loaded), 0.001):item()
    assert.is_true(direct > 0)
    assert.is_true(math.abs(with - (m(x, y):item() + direct)) <= 1e-6, ('%.9g against %.9g + %.9g'):format(with,
      m(x, y):item(), direct))
    loaded:eval()
    assert.are.equal(m(x, y):item(), loaded(x, y):item())
    os.execute('rm -rf ' .. q(dir))
    local function bad(over, msg)
      local ok, err = pcall(ds.new, small(over))
      assert.is_false(ok)
      assert.matches(msg, tostring(err), 1, true)
    end
    bad({ norm_topk_prob = true }, 'deepseek_v2 config: norm_topk_prob = true is not supported')
    bad({ moe_layer_freq = 2 }, 'deepseek_v2 config: moe_layer_freq 2 is not supported')
    bad({ scoring_func = 'sigmoid' }, 'deepseek_v2 config: scoring_func sigmoid is not supported')
    bad({ topk_method = 'noaux_tc' }, 'deepseek_v2 config: topk_method must be')
    bad({ num_experts_per_tok = hf.null }, 'deepseek_v2 config: num_experts_per_tok must be given')
    bad({ n_group = 4 }, 'deepseek_v2 config: n_routed_experts 6 do not split into n_group = 4 groups')
    bad({ num_experts_per_tok = 5 }, 'deepseek_v2 config: num_experts_per_tok 5 is more than the 4 experts')
    bad({ num_key_value_heads = 1 }, 'deepseek_v2 config: num_key_value_heads (1) must equal num_attention_heads (2)')
    -- greedy ignores the groups (V2-Lite's configs leave them null; a
    -- value there does not constrain it)
    assert.are.equal(1, ds.new(small({ topk_method = 'greedy', n_group = 4 })).model.layers[2].mlp.n_group)
    -- groups of one expert are fine when a group is scored by its best
    assert.are.equal(6, ds.new(small({ n_group = 6, topk_group = 3 })).model.layers[2].mlp.n_group)
  end)

  describe('bin/train', function()
    local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 48 '
      .. '--model.moe_intermediate_size 16 --model.q_lora_rank 16 --model.kv_lora_rank 16 --model.qk_nope_head_dim 8 '
      .. '--model.qk_rope_head_dim 8 --model.v_head_dim 8 --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 '
      .. '--eval-iters 2 --sample-tokens 0 --log-every 2'

    it('trains the tiny preset; two ranks follow one process: FSDP, expert parallel', function()
      S.moe_train_runs('models/deepseek_v2.lua', flags, { '--fsdp FULL_SHARD', '--ep 2' }, '')
    end)
  end)
end)
