-- LoRA adapters (nn.apply_lora, nn.lora_merged, save_pretrained merging,
-- bin/train --lora): the model's output unchanged at first, only the
-- adapters trained, the fused paths left for the adapted modules' calls,
-- the merged weights giving the adapted model's output, and the errors.
local ms = require 'moonshard'
local nn = ms.nn
local FS = require 'spec.fsdp_support'
local S = require 'spec.support'

local cases = {
  { 'gpt2-tiny', 8, { 'c_attn', 'c_proj', 'c_fc' } },
  { 'llama-tiny', 14, { 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj' } },
}

describe('LoRA', function()
  if not FS.have_fixture('gpt2-tiny') or not FS.have_fixture('llama-tiny') then
    it('needs the fixtures', function() pending('no ' .. FS.fixtures) end)
    return
  end

  for _, c in ipairs(cases) do
    it(c[1] .. ': unchanged output at first, adapters alone trained, merged weights give the adapted output', function()
      local x, y = FS.lcg_batch(5, 2, 16)
      local base = FS.load_model(c[1])
      local m = FS.load_model(c[1])
      local names = nn.apply_lora(m, { r = 4, alpha = 8 })
      assert.are.equal(c[2], #names)
      for _, n in ipairs(names) do
        local hit = false
        for _, leaf in ipairs(c[3]) do if n:sub(-#leaf) == leaf then hit = true end end
        assert.is_true(hit, n)
      end
      assert.are.equal(ms.no_grad(function() return base(x, y):item() end), ms.no_grad(function() return m(x, y):item() end))
      local trainable = 0
      for n, p in m:named_parameters() do
        assert.are.equal(n:match('%.lora_[AB]$') ~= nil, p.requires_grad, n)
        if p.requires_grad then trainable = trainable + 1 end
      end
      assert.are.equal(2 * c[2], trainable)
      local before = {}
      for n, p in m:named_parameters() do before[n] = p:clone() end
      local opt = ms.optim.AdamW(m, { lr = 1e-2 })
      local first, last
      for k = 1, 4 do
        local l = m(x, y)
        l:backward(); opt:step(); opt:zero_grad()
        if k == 1 then first = l:item() end
        last = l:item()
      end
      assert.is_true(last < first)
      for n, p in m:named_parameters() do
        local d = ms.no_grad(function() return (p - before[n]):abs():max():item() end)
        if n:match('%.lora_[AB]$') then assert.is_true(d > 0, n) else assert.are.equal(0, d, n) end
      end
      -- the merged tensors into a plain model: the adapted model's loss
      local merged = nn.lora_merged(m, m:state_dict())
      for k in pairs(merged) do assert.is_nil(k:match('lora_'), k) end
      local plain = FS.load_model(c[1])
      plain:load_state_dict(merged)
      local la = ms.no_grad(function() return m(x, y):item() end)
      local lb = ms.no_grad(function() return plain(x, y):item() end)
      assert.is_true(FS.rel(lb, la) <= 1e-5, ('merged %.9g, adapted %.9g'):format(lb, la))
      -- merged in place: a plain model again, the same loss
      local m2 = FS.load_model(c[1])
      nn.apply_lora(m2, { r = 4, alpha = 8 })
      m2:load_state_dict(m:state_dict())
      nn.merge_lora(m2)
      assert.is_false(nn.has_lora(m2))
      for n in pairs(m2:state_dict()) do assert.is_nil(n:match('lora_'), n) end
      assert.is_true(nn.plain(m2.transformer and m2.transformer.h[1].mlp.c_fc or m2.model.layers[1].mlp.gate_proj))
      local ld = ms.no_grad(function() return m2(x, y):item() end)
      assert.is_true(FS.rel(ld, la) <= 1e-5, ('merged in place %.9g, adapted %.9g'):format(ld, la))
      -- save_pretrained merges: a plain folder, loaded strictly
      local dir = S.tmpdir()
      m:save_pretrained(dir)
      local back = require(c[1]:match('^gpt2') and 'models.gpt2' or 'models.llama').from_pretrained(dir)
      local lc = ms.no_grad(function() return back(x, y):item() end)
      assert.is_true(FS.rel(lc, la) <= 1e-5, ('saved %.9g, adapted %.9g'):format(lc, la))
      os.execute('rm -rf ' .. S.shell_quote(dir))
    end)
  end

  it('the fused MLP and residual paths step aside for an adapted module', function()
    local m = FS.load_model('gpt2-tiny')
    local mlp = m.transformer.h[1].mlp
    assert.is_true(nn.plain(mlp.c_fc))
    nn.apply_lora(m, { r = 2, targets = { 'h%.0%.mlp%.c_fc$' } })
    assert.is_false(nn.plain(mlp.c_fc))
    assert.is_true(nn.plain(m.transformer.h[2].mlp.c_fc))
    -- with lora_B nonzero the output moves: the adapter is on the path
    local x, y = FS.lcg_batch(6, 2, 16)
    local l0 = ms.no_grad(function() return m(x, y):item() end)
    ms.no_grad(function() mlp.c_fc.lora_B:fill_(0.05) end)
    local l1 = ms.no_grad(function() return m(x, y):item() end)
    assert.is_true(math.abs(l1 - l0) > 1e-4)
  end)

  it('bad arguments are errors that say what is wrong', function()
    local m = FS.load_model('gpt2-tiny')
    local cases_ = {
      { function() nn.apply_lora(m, { targets = { 'nosuchmodule' } }) end, 'no nn.Linear or nn.Conv1D of the model matches' },
      { function() nn.apply_lora(m, { r = 0 }) end, 'r must be a positive integer, got 0' },
      { function() nn.apply_lora(m, { targets = { '[' } }) end, 'bad target pattern [' },
      { function() nn.apply_lora({}, {}) end, 'model must be a module' },
    }
    for i, cs in ipairs(cases_) do
      local ok, err = pcall(cs[1])
      assert.is_false(ok, 'case ' .. i)
      assert.is_truthy(tostring(err):find(cs[2], 1, true), tostring(err))
    end
  end)

  it('a mixture of experts: routed experts\' linears left out and listed (the fused experts read their weights), the '
    .. 'router and the shared expert adapted; targets matching only routed experts are an error', function()
    local q2 = require 'models.qwen2_moe'
    local S = require 'spec.support'
    ms.manual_seed(1)
    local m = q2.new('tiny', { num_hidden_layers = 1, mlp_only_layers = require('models.hf').null })
    local x, y = S.token_batch(2, 8, 256, 3)
    local l0 = m(x, y):item()
    local names, skipped = ms.nn.apply_lora(m, { r = 4, targets = { 'mlp%.' } })
    assert.are.equal(8 * 3, #skipped)
    for _, n in ipairs(skipped) do assert.matches('^model%.layers%.0%.mlp%.experts%.%d+%.', n) end
    -- (the router is a linear called as a module: adapted too)
    assert.are.same({ 'model.layers.0.mlp.gate', 'model.layers.0.mlp.shared_expert.gate_proj',
      'model.layers.0.mlp.shared_expert.up_proj',
      'model.layers.0.mlp.shared_expert.down_proj', 'model.layers.0.mlp.shared_expert_gate' }, names)
    -- the shared expert's adapters are used: B made nonzero moves the loss
    for name, p in m:named_parameters() do if name:match('lora_B') then ms.normal_(p, 0, 1) end end
    assert.are_not.equal(l0, m(x, y):item())
    local ok, err = pcall(ms.nn.apply_lora, q2.new('tiny', { num_hidden_layers = 1 }), { r = 4, targets = { 'experts%.' } })
    assert.is_false(ok)
    assert.matches('apply_lora: the targets experts%. match only routed experts\' linears '
      .. '(model.layers.0.mlp.experts.0.gate_proj and 23 more), whose weights the mixture of experts reads directly',
      tostring(err), 1, true)
  end)
end)
