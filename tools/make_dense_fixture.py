# tools/make_dense_fixture.py OUT [CASE ...] — reference fixtures of spec/fixtures/ for
# the dense decoders (spec/hf_dense_spec.lua): Hugging Face transformers'
# LlamaForCausalLM with each scaled RoPE (linear, llama3, yarn) past the
# original context, Qwen2ForCausalLM (q/k/v biases, tied embeddings) and
# Qwen3ForCausalLM (per-head q/k norms, a head width apart from the model's,
# attention biases) and MistralForCausalLM (a sliding window shorter than the
# sequence, and none), computed on the CPU in float64 and stored as float32.
# Needs torch and transformers (pip's; this machine or the lent GPU host).
# For each case OUT/<case>/ gets:
#   config.json          the config as transformers writes it
#   model.safetensors    the weights under transformers' names
#   expected.safetensors input_ids, targets (i64, about 10% -100), logits,
#                        loss (mean over the targets kept), grad.<name> for
#                        every parameter
# Every parameter is drawn again (tools/hf_fixture.py: normal(0, 0.02) +
# normal(0, 0.05); norm weights 1 + normal(0, 0.05); biases normal(0, 0.05))
# so none sits at a trivial value. OUT/meta.json records the versions and
# the losses.
import json
import os
import sys

import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_fixture  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=1, initializer_range=0.02)
LLAMA = (LlamaConfig, LlamaForCausalLM)
CASES = {
    # Llama 3.1's RoPE: wavelengths past the original context divided by
    # the factor, those under high_freq's kept, a blend between
    'llama-tiny-llama3rope': (LLAMA, dict(rope_parameters=dict(
        rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)), 40),
    # positions divided by the factor
    'llama-tiny-linear': (LLAMA, dict(rope_parameters=dict(rope_type='linear', rope_theta=10000.0, factor=2.5),
                                      attention_bias=True, mlp_bias=True), 24),
    # YaRN with transformers' default attention factor (0.1 ln(factor) + 1)
    'llama-tiny-yarn': (LLAMA, dict(rope_parameters=dict(
        rope_type='yarn', rope_theta=10000.0, factor=4.0, original_max_position_embeddings=12, beta_fast=32.0,
        beta_slow=1.0), head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=48), 40),
    # Qwen2: q/k/v biases, no o bias, the head tied to the embedding
    'qwen2-tiny': ((Qwen2Config, Qwen2ForCausalLM), dict(rope_parameters=dict(rope_type='default',
                                                                              rope_theta=1000000.0),
                                                         tie_word_embeddings=True), 20),
    # Qwen3: q and k RMS-normalised per head, heads of 24 (not 64 / 4),
    # biases on every projection
    'qwen3-tiny': ((Qwen3Config, Qwen3ForCausalLM), dict(rope_parameters=dict(rope_type='default',
                                                                              rope_theta=1000000.0),
                                                         head_dim=24, attention_bias=True), 20),
    # Mistral: a sliding window of 6 over 20 positions (each token sees
    # itself and the 5 before), heads of 24
    'mistral-tiny-window': ((MistralConfig, MistralForCausalLM), dict(rope_parameters=dict(rope_type='default',
                                                                                          rope_theta=10000.0),
                                                                      sliding_window=6, head_dim=24), 20),
    # Mistral without a window (the later models)
    'mistral-tiny': ((MistralConfig, MistralForCausalLM), dict(rope_parameters=dict(rope_type='default',
                                                                                   rope_theta=1000000.0),
                                                               sliding_window=None), 20),
}
if len(sys.argv) > 2:
    CASES = {k: v for k, v in CASES.items() if k in sys.argv[2:]}


meta = {'transformers': transformers.__version__, 'torch': torch.__version__, 'cases': {}}
for case, ((Cfg, Model), over, T) in CASES.items():
    kw = dict(SMALL)
    kw.update(over)
    rope = kw.pop('rope_parameters')
    cfg = hf_fixture.make_config(Cfg, kw, rope)
    torch.manual_seed(len(case))
    model = Model(cfg).double()
    hf_fixture.redraw(model)
    model.eval()
    input_ids, targets = hf_fixture.batch(cfg.vocab_size, T)
    logits = model(input_ids=input_ids).logits
    loss, ntensors, _ = hf_fixture.write_case(out + '/' + case, cfg, model, logits, input_ids, targets)
    meta['cases'][case] = {'loss': loss.item(), 'params': ntensors, 'T': T}
    print(case, 'loss %.6f' % loss.item(), 'tensors', ntensors)
with open(out + '/meta.json', 'w') as f:
    json.dump(meta, f, indent=1)
