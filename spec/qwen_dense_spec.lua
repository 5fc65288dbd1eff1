-- models/qwen2.lua and models/qwen3.lua (dense Qwen2/2.5 and Qwen3): the
-- same function as their mixture-of-experts siblings with every layer dense
-- (models/qwen2_moe.lua, models/qwen3_moe.lua: the same names, the weights
-- loaded across, bit for bit in f64); transformers' parameter names
-- (q/k/v biases and no o bias for Qwen2; per-head q/k norms for Qwen3);
-- float64 finite differences; the save/load round trip; sliding windows
-- refused; bin/train trains the tiny presets, two FSDP ranks as one process.
local ms = require 'moonshard'
local A = ms.autograd
local hf = require 'models.hf'
local S = require 'spec.support'
local q = S.shell_quote

local small = { vocab_size = 40, hidden_size = 16, intermediate_size = 20, num_hidden_layers = 2,
  num_attention_heads = 2, num_key_value_heads = 1, head_dim = 8, max_position_embeddings = 16 }
local function cfg(over)
  local c = {}
  for k, v in pairs(small) do c[k] = v end
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end

local cases = {
  { name = 'qwen2', M = require 'models.qwen2', moe = require 'models.qwen2_moe', arch = 'Qwen2ForCausalLM',
    has = { 'model.layers.0.self_attn.q_proj.bias', 'model.layers.0.self_attn.v_proj.bias' },
    lacks = { 'model.layers.0.self_attn.o_proj.bias', 'model.layers.0.self_attn.q_norm.weight' } },
  { name = 'qwen3', M = require 'models.qwen3', moe = require 'models.qwen3_moe', arch = 'Qwen3ForCausalLM',
    has = { 'model.layers.0.self_attn.q_norm.weight', 'model.layers.1.self_attn.k_norm.weight' },
    lacks = { 'model.layers.0.self_attn.q_proj.bias' } },
}

describe('dense Qwen models', function()
  before_each(function() A.clear_tape() end)

  for _, c in ipairs(cases) do
    it(c.name .. ': the mixture-of-experts sibling with every layer dense, bit for bit (f64); transformers\' names',
      function()
        ms.manual_seed(3)
        local m = c.M.new(cfg()):to('f64')
        for name, p in m:named_parameters() do
          if not name:match('norm') then ms.normal_(p, 0, 0.3) else ms.normal_(p, 1, 0.1) end
        end
        local sib = c.moe.new(cfg({ mlp_only_layers = { 0, 1 }, num_experts = 4, num_experts_per_tok = 2,
          moe_intermediate_size = 8, shared_expert_intermediate_size = 8, output_router_logits = false })):to('f64')
        sib:load_state_dict(m:state_dict())
        local x, y = S.token_batch(2, 7, 40, 5)
        local a = ms.no_grad(function() return m(x) end)
        local b = ms.no_grad(function() return sib(x) end)
        assert.are.equal(0, (a - b):abs():max():item())
        local names = {}
        for name in m:named_parameters() do names[name] = true end
        for _, n in ipairs(c.has) do assert.is_true(names[n] == true, n) end
        for _, n in ipairs(c.lacks) do assert.is_nil(names[n], n) end
        A.clear_tape()
        local L = m.model.layers
        local ps = { L[1].self_attn.q_proj.weight, L[2].mlp.up_proj.weight, m.model.embed_tokens.weight }
        ps[#ps + 1] = c.name == 'qwen2' and L[1].self_attn.k_proj.bias or L[2].self_attn.k_norm.weight
        local worst = A.gradcheck(function() return m(x, y) end, ps)
        assert.is_true(worst < 1e-6, 'relative error ' .. worst)
      end)

    it(c.name .. ': save_pretrained / from_pretrained (config.json as transformers writes it, the same loss); '
      .. 'sliding windows refused', function()
      ms.manual_seed(4)
      local m = c.M.new(cfg({ tie_word_embeddings = true }))
      local dir = S.tmpdir()
      m:save_pretrained(dir)
      local j = hf.read_json(dir .. '/config.json')
      assert.are.same({ c.arch }, j.architectures)
      assert.are.equal(c.name, j.model_type)
      assert.is_nil(ms.load_safetensors(dir .. '/model.safetensors')['lm_head.weight'])
      local x, y = S.token_batch(2, 6, 40, 9)
      assert.are.equal(m(x, y):item(), c.M.from_pretrained(dir)(x, y):item())
      os.execute('rm -rf ' .. q(dir))
      local ok, err = pcall(c.M.new, cfg({ use_sliding_window = true }))
      assert.is_false(ok)
      assert.matches(c.name .. ' config: use_sliding_window is not supported', tostring(err), 1, true)
    end)

    it(c.name .. ': bin/train trains the tiny preset; two FSDP ranks follow one process', function()
      S.moe_train_runs('models/' .. c.name .. '.lua', '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 '
        .. '--model.intermediate_size 48 --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 '
        .. '--sample-tokens 0 --log-every 2' .. (c.name == 'qwen3' and ' --model.head_dim 16' or ''),
        { '--fsdp FULL_SHARD' }, '')
    end)
  end
end)
