-- models/glm4_moe.lua (docs/models.md, "GLM-4.5"): golden runs against
-- transformers' Glm4MoeForCausalLM (spec/fixtures, made by
-- tools/make_deepseek_fixture.py: half of each head rotated with q/k norms,
-- biases and groups; a quarter rotated, one group, no renormalisation),
-- logits, loss and every gradient within 1e-6 relative in f64 and 1e-5 in
-- f32; nn.CausalSelfAttention's rotary_dim against its formula written out
-- (f64, 1e-12) and finite differences; the save/load round trip with
-- transformers' names and config (partial_rotary_factor in both places), a
-- checkpoint's MTP layer skipped; what it cannot run refused by name;
-- bin/train on one process and on two ranks (FSDP, expert parallel,
-- context parallel).
local ms = require 'moonshard'
local A = ms.autograd
local nn = ms.nn
local nnf = nn.functional
local hf = require 'models.hf'
local glm = require 'models.glm4_moe'
local S = require 'spec.support'
local q = S.shell_quote

local fixtures = require('moonshard.tensor').root .. '/spec/fixtures'

local function small(over)
  local cfg = { vocab_size = 40, hidden_size = 16, intermediate_size = 20, moe_intermediate_size = 12,
    num_hidden_layers = 3, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 12, n_shared_experts = 1,
    n_routed_experts = 4, routed_scaling_factor = 1.5, n_group = 2, topk_group = 1, num_experts_per_tok = 2,
    first_k_dense_replace = 1, max_position_embeddings = 16, use_qk_norm = true, attention_bias = true }
  for k, v in pairs(over or {}) do cfg[k] = v end
  return cfg
end

describe('models.glm4_moe', function()
  before_each(function() A.clear_tape() end)

  for _, case in ipairs({ 'glm4-moe-tiny', 'glm4-moe-tiny-quarter' }) do
    local dir = fixtures .. '/' .. case
    it(case .. ': logits, loss and every gradient as transformers\' in f64 (1e-6)', function()
      S.hf_golden(glm, dir, 'f64', 1e-6)
    end)
    it(case .. ': the same in f32 (1e-5)', function() S.hf_golden(glm, dir, 'f32', 1e-5) end)
  end

  it('nn.CausalSelfAttention rotary_dim: RoPE on each head\'s first rotary_dim features, the rest as they are '
    .. '(f64, 1e-12); finite differences', function()
    ms.manual_seed(2)
    local att = nn.CausalSelfAttention { dim = 16, n_head = 2, n_kv_head = 1, head_dim = 12, rope_theta = 100,
      rotary_dim = 4, bias = true }:to('f64')
    for _, p in att:named_parameters() do ms.normal_(p, 0, 0.3) end
    local x = ms.randn({ 2, 5, 16 }, { dtype = 'f64', seed = 3 })
    local y = A.no_grad(function() return att(x) end)
    -- written out: q, k per head, positions p, pairs (i, i + 2) of the
    -- first 4 features turned by p / 100^(2i/4)
    local want = A.no_grad(function()
      local qh = att.q_proj(x):reshape(2, 5, 2, 12)
      local kh = att.k_proj(x):reshape(2, 5, 1, 12)
      local function rot(t)
        local out = t:clone()
        for p = 0, 4 do
          for i = 0, 1 do
            local f = 1 / 100 ^ (2 * i / 4)
            local c, s = math.cos(p * f), math.sin(p * f)
            local a = t:narrow(2, p + 1, 1):narrow(4, i + 1, 1)
            local b = t:narrow(2, p + 1, 1):narrow(4, i + 3, 1)
            out:narrow(2, p + 1, 1):narrow(4, i + 1, 1):copy_(a * c - b * s)
            out:narrow(2, p + 1, 1):narrow(4, i + 3, 1):copy_(b * c + a * s)
          end
        end
        return out
      end
      local qr, kr = rot(qh):transpose(2, 3), rot(kh):transpose(2, 3)
      local vh = att.v_proj(x):reshape(2, 5, 1, 12):transpose(2, 3)
      local kr2, vh2 = kr:expand(2, 2, 5, 12):contiguous(), vh:expand(2, 2, 5, 12):contiguous()
      local sc = ms.matmul(qr:contiguous(), kr2:transpose(3, 4)) * (1 / math.sqrt(12))
      sc = sc + nnf.causal_mask(5, 5, 'f64', -1)
      local o = ms.matmul(nnf.softmax(sc, -1), vh2)
      return att.o_proj(o:transpose(2, 3):reshape(2, 5, 24))
    end)
    local e = S.relerr(y, want)
    assert.is_true(e < 1e-12, 'relative error ' .. e)
    local xr = x:clone():requires_grad_()
    local worst = A.gradcheck(function() return att(xr) end, { xr, att.q_proj.weight, att.k_proj.bias })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
    assert.has_error(function() nn.CausalSelfAttention { dim = 16, n_head = 2, head_dim = 8, rope_theta = 10,
      rotary_dim = 3 } end, 'CausalSelfAttention: rotary_dim must be an even number from 2 to head_dim 8, got 3')
  end)

  it('the parameters named as the checkpoint; save/load with transformers\' config.json (partial_rotary_factor in '
    .. 'rope_parameters and at the top), the same loss; a checkpoint\'s MTP layer skipped; refusals by name', function()
    local dir = fixtures .. '/glm4-moe-tiny'
    local m = glm.from_pretrained(dir)
    local want, got = {}, {}
    for k in pairs(ms.load_safetensors(dir .. '/model.safetensors')) do want[#want + 1] = k end
    for k in pairs(m:state_dict()) do got[#got + 1] = k end
    table.sort(want); table.sort(got)
    assert.are.same(want, got)
    assert.are.equal(12, m.model.layers[1].self_attn.rotary_dim)
    assert.is_nil(rawget(m.model.layers[1].self_attn.o_proj, 'bias'))
    ms.manual_seed(5)
    local m1 = glm.new(small({ rope_parameters = { rope_type = 'default', rope_theta = 5e5,
      partial_rotary_factor = 0.5 } }))
    local out = S.tmpdir()
    m1:save_pretrained(out)
    local cfg = hf.read_json(out .. '/config.json')
    assert.are.same({ 'Glm4MoeForCausalLM' }, cfg.architectures)
    assert.are.equal(0.5, cfg.partial_rotary_factor)
    assert.are.equal(0.5, cfg.rope_parameters.partial_rotary_factor)
    local x, y = S.token_batch(2, 6, 40, 13)
    assert.are.equal(m1(x, y):item(), glm.from_pretrained(out)(x, y):item())
    -- an older config: rope_theta at the top, partial_rotary_factor only
    -- there; an MTP layer's tensors (model.layers.3) skipped
    cfg.rope_parameters, cfg.rope_theta, cfg.partial_rotary_factor = nil, 5e5, 0.5
    local f = assert(io.open(out .. '/config.json', 'wb'))
    f:write(require('dkjson').encode(cfg))
    f:close()
    local sd = ms.load_safetensors(out .. '/model.safetensors')
    sd['model.layers.3.eh_proj.weight'] = ms.zeros({ 16, 32 })
    ms.save_safetensors(out .. '/model.safetensors', sd)
    assert.are.equal(m1(x, y):item(), glm.from_pretrained(out)(x, y):item())
    os.execute('rm -rf ' .. q(out))
    local function bad(over, msg)
      local ok, err = pcall(glm.new, small(over))
      assert.is_false(ok)
      assert.matches(msg, tostring(err), 1, true)
    end
    bad({ rope_parameters = { rope_type = 'default', rope_theta = 1e4, partial_rotary_factor = 0.1 } },
      'glm4_moe config: partial_rotary_factor 0.1 of head_dim 12 rotates 1 features')
    bad({ rope_parameters = { rope_type = 'default', rope_theta = 1e4, partial_rotary_factor = 2 } },
      'glm4_moe config: rope_parameters.partial_rotary_factor must be in (0, 1], got 2')
    bad({ n_group = 3 }, 'glm4_moe config: n_routed_experts 4 do not split into n_group = 3 groups')
    bad({ num_experts_per_tok = 3 }, 'glm4_moe config: num_experts_per_tok 3 is more than the 2 experts')
    bad({ num_attention_heads = 3, num_key_value_heads = 2 },
      'num_attention_heads (3) must be a multiple of num_key_value_heads (2)')
  end)

  it('multi-token prediction (mtp_loss_weight > 0, DeepSeek-V3\'s modules): the main loss plus the weight times '
    .. 'the depth\'s (f64); saved and read as the checkpoint\'s model.layers.(L + K)', function()
    ms.manual_seed(9)
    local m = glm.new(small({ num_hidden_layers = 2, mtp_loss_weight = 0.3, num_nextn_predict_layers = 1 })):to('f64')
    for name, p in m:named_parameters() do
      if not name:match('norm') then ms.normal_(p, 0, 0.3) else ms.normal_(p, 1, 0.1) end
    end
    local plain = glm.new(small({ num_hidden_layers = 2 })):to('f64')
    local sd = {}
    for name, t in pairs(m:state_dict()) do if not name:match('mtp_layers') then sd[name] = t end end
    plain:load_state_dict(sd)
    local x, y = S.token_batch(2, 7, 40, 3)
    local l = m(x, y):item()
    local main = plain(x, y):item()
    local d = m:mtp_losses()
    assert.are.equal(1, #d)
    assert.is_true(math.abs(l - (main + 0.3 * d[1]:item())) < 1e-12, ('%.15g vs %.15g'):format(l,
      main + 0.3 * d[1]:item()))
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local st = ms.load_safetensors(dir .. '/model.safetensors')
    for _, name in ipairs({ 'model.layers.2.eh_proj.weight', 'model.layers.2.enorm.weight',
      'model.layers.2.shared_head.norm.weight', 'model.layers.2.shared_head.head.weight',
      'model.layers.2.embed_tokens.weight', 'model.layers.2.self_attn.q_norm.weight',
      'model.layers.2.mlp.experts.1.up_proj.weight' }) do
      assert.is_not_nil(st[name], name)
    end
    local back = glm.from_pretrained(dir):to('f64')
    assert.is_true(math.abs(back(x, y):item() - l) < 1e-6 * l)
    os.execute('rm -rf ' .. q(dir))
  end)

  describe('bin/train', function()
    local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 48 '
      .. '--model.moe_intermediate_size 16 --model.head_dim 16 --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 '
      .. '--eval-iters 2 --sample-tokens 0 --log-every 2'

    it('trains the tiny preset; two ranks follow one process: FSDP, expert parallel; --cp 2 (the partial RoPE at '
      .. 'each rank\'s positions) the one-process curve', function()
      S.moe_train_runs('models/glm4_moe.lua', flags, { '--fsdp FULL_SHARD', '--ep 2' }, '')
      S.two_ranks_follow('models/glm4_moe.lua', flags, '--cp 2', 4)
    end)
  end)
end)
