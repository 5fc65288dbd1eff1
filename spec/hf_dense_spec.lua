-- The dense decoders against Hugging Face transformers (spec/fixtures, made
-- by tools/make_dense_fixture.py in float64): Llama with each scaled RoPE
-- past its original context (llama3 as Llama 3.1's, linear with attention
-- and MLP biases, YaRN with heads wider than width / heads), Qwen2 (q/k/v
-- biases, tied head) and Qwen3 (per-head q/k norms, heads of 24, biases):
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
}

describe('dense decoders against transformers', function()
  before_each(function() A.clear_tape() end)

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
