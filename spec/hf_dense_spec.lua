-- The dense decoders against Hugging Face transformers (spec/fixtures, made
-- by tools/make_dense_fixture.py in float64): Llama with each scaled RoPE
-- past its original context (llama3 as Llama 3.1's, linear with attention
-- and MLP biases, YaRN with heads wider than width / heads), Qwen2 (q/k/v
-- biases, tied head), Qwen3 (per-head q/k norms, heads of 24, biases) and
-- Mistral (a sliding window of 6 over 20 positions: the unfused path with
-- the window's mask; and none):
-- logits, loss and every gradient within 1e-6 relative in f64 and 1e-5 in
-- f32; the config read back as transformers wrote it.
local ms = require 'moonshard'
local A = ms.autograd
local hf = require 'models.hf'
local S = require 'spec.support'

local fixtures = require('moonshard.tensor').root .. '/spec/fixtures'

local cases = {
  { 'llama-tiny-llama3rope', 'models.llama', 'llama3' },
  { 'llama-tiny-linear', 'models.llama', 'linear' },
  { 'llama-tiny-yarn', 'models.llama', 'yarn' },
  { 'qwen2-tiny', 'models.qwen2', 'default' },
  { 'qwen3-tiny', 'models.qwen3', 'default' },
  { 'mistral-tiny-window', 'models.mistral', 'default' },
  { 'mistral-tiny', 'models.mistral', 'default' },
}

describe('dense decoders against transformers', function()
  before_each(function() A.clear_tape() end)

  it('nnf.window_mask and the window in nn.CausalSelfAttention: each query sees itself and the window - 1 keys '
    .. 'before it (the unfused path, f64, against the mask written out); no longer sequence, plain causal', function()
    local nnf = ms.nn.functional
    local m = nnf.window_mask(7, 3, 'f64', -1):totable()
    for i = 1, 7 do
      for j = 1, 7 do
        local want = (j <= i - 3) and -math.huge or 0
        assert.are.equal(want, m[i][j], ('(%d, %d)'):format(i, j))
      end
    end
    ms.manual_seed(4)
    local att = ms.nn.CausalSelfAttention { dim = 16, n_head = 2, n_kv_head = 1, head_dim = 8, rope_theta = 100,
      window = 3 }:to('f64')
    for _, p in att:named_parameters() do ms.normal_(p, 0, 0.3) end
    local plain = ms.nn.CausalSelfAttention { dim = 16, n_head = 2, n_kv_head = 1, head_dim = 8, rope_theta = 100 }
      :to('f64')
    plain:load_state_dict(att:state_dict())
    local x = ms.randn({ 2, 7, 16 }, { dtype = 'f64', seed = 2 })
    -- (the first 3 positions see no more than the window: as plain causal)
    local y, y0 = A.no_grad(function() return att(x) end), A.no_grad(function() return plain(x) end)
    assert.is_true(S.relerr(y:narrow(2, 1, 3), y0:narrow(2, 1, 3)) < 1e-14)
    assert.is_true(S.relerr(y:narrow(2, 4, 4), y0:narrow(2, 4, 4)) > 1e-3)
    local x3 = x:narrow(2, 1, 3):contiguous()
    assert.is_true(S.relerr(A.no_grad(function() return att(x3) end), A.no_grad(function() return plain(x3) end))
      < 1e-14)
    local xr = x:clone():requires_grad_()
    local worst = A.gradcheck(function() return att(xr) end, { xr, att.k_proj.weight })
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('bin/train trains Mistral\'s tiny preset past its window (64 of 96 positions); --tp 2 follows one process',
    function()
    S.two_ranks_follow('models/mistral.lua', '--preset tiny --model.num_hidden_layers 2 --seq-len 96 --lr 1e-2 '
      .. '--warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 1', '--tp 2', 3)
  end)

  for _, c in ipairs(cases) do
    local case, M, rope = c[1], require(c[2]), c[3]
    local dir = fixtures .. '/' .. case
    it(case .. ': logits, loss and every gradient as transformers\' in f64 (1e-6)', function()
      S.hf_golden(M, dir, 'f64', 1e-6)
    end)
    it(case .. ': the same in f32 (1e-5)', function() S.hf_golden(M, dir, 'f32', 1e-5) end)
    it(case .. ': the config as transformers wrote it; the names of the checkpoint', function()
      local m = M.from_pretrained(dir)
      local j = hf.read_json(dir .. '/config.json')
      assert.are.equal(rope, m.config.rope_parameters.rope_type)
      assert.are.equal(j.rope_parameters.rope_theta, m.config.rope_parameters.rope_theta)
      assert.are.equal(j.tie_word_embeddings, m.config.tie_word_embeddings)
      local want, got = {}, {}
      for k in pairs(ms.load_safetensors(dir .. '/model.safetensors')) do want[#want + 1] = k end
      for k in pairs(m:state_dict()) do got[#got + 1] = k end
      table.sort(want); table.sort(got)
      assert.are.same(want, got)
    end)
  end
end)
