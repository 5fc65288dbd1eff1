# tools/make_llama4_fixture.py OUT — the Llama 4 (text) reference fixtures
# of spec/fixtures/ (spec/llama4_spec.lua), made with Hugging Face
# transformers' Llama4ForCausalLM (model_type llama4_text) on the CPU in
# float64 (torch and transformers on this machine are enough). For each
# case, OUT/<case>/ gets:
#   config.json          the config as transformers writes it
#   model.safetensors    the weights as the Hub checkpoints hold them (the
#                        experts fused: feed_forward.experts.gate_up_proj
#                        (E, H, 2I) and feed_forward.experts.down_proj
#                        (E, I, H), both (in, out) as torch.bmm takes them)
#   expected.safetensors input_ids, targets (i64, about 10% -100), logits,
#                        loss and grad.<name> for every parameter
# (computed in float64, stored as float32).
# Every parameter is drawn again and perturbed (normal(0, 0.02) +
# normal(0, 0.05); norm weights 1 + normal(0, 0.05)), and a seed is kept
# only when every routing choice wins by a margin (no near-tie that rounding
# could flip), on the router's logits and on their sigmoids. OUT/meta.json
# records the versions and margins.
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers import Llama4ForCausalLM, Llama4TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_fixture  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
            max_position_embeddings=64, rms_norm_eps=1e-5, attention_bias=False, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=1, pad_token_id=None, initializer_range=0.02, use_qk_norm=True,
            attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, attention_chunk_size=8,
            interleave_moe_layer_step=1)
CASES = {
    # every layer a mixture of experts (top-1), the fourth NoPE (temperature
    # tuned, full causal), the others RoPE (Llama 3.1's scaling past its 16
    # original positions) with the L2 qk norm and chunks of 8 (20 = 8 + 8 + 4)
    'llama4-tiny': dict(rope=dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=16), T=20),
    # every second layer sparse (top-2 of 4), the others dense
    # (intermediate_size_mlp); a NoPE layer every second (no_rope_layer_interval
    # 2); no qk norm; chunks of 6 (20 = 6 + 6 + 6 + 2); default RoPE; biases
    'llama4-tiny-step2': dict(interleave_moe_layer_step=2, num_experts_per_tok=2, use_qk_norm=False,
                              no_rope_layer_interval=2, attention_chunk_size=6, attention_bias=True,
                              rope=dict(rope_type='default', rope_theta=10000.0), T=20),
    # Llama 4 Scout's RoPE (llama3 with low_freq_factor = high_freq_factor:
    # no blended band), moe_layers given, no_rope_layers given, a chunk
    # longer than the sequence (plain causal), no temperature tuning, the
    # head tied to the embedding
    'llama4-tiny-scout': dict(moe_layers=[0, 2], no_rope_layers=[1, 0, 1, 1], attention_chunk_size=32,
                              attn_temperature_tuning=False, tie_word_embeddings=True, num_key_value_heads=1,
                              rope=dict(rope_type='llama3', rope_theta=500000.0, factor=16.0, low_freq_factor=1.0,
                                        high_freq_factor=1.0, original_max_position_embeddings=8), T=20),
}


def route_margin(k, logits):
    # the smallest gap between the k-th and the (k+1)-th choice, on the
    # logits (transformers' top-k) and on their sigmoids (ours)
    m = math.inf
    for s in (logits.double(), logits.double().sigmoid()):
        v = s.sort(dim=-1, descending=True)[0]
        m = min(m, (v[:, k - 1] - v[:, k]).min().item())
    return m


meta = {'transformers': transformers.__version__, 'torch': torch.__version__, 'cases': {}}
for case, over in CASES.items():
    over = dict(over)
    rope, T = over.pop('rope'), over.pop('T')
    kw = dict(BASE)
    kw.update(over)
    cfg = hf_fixture.make_config(Llama4TextConfig, kw, rope, strict=True)
    for seed in range(50):
        torch.manual_seed(seed)
        model = Llama4ForCausalLM(cfg).double()
        hf_fixture.redraw(model)
        model.eval()
        input_ids, targets = hf_fixture.batch(cfg.vocab_size, T)
        caught = []
        hooks = []
        for name, m in model.named_modules():
            if name.endswith('feed_forward.router'):
                hooks.append(m.register_forward_hook(lambda m, i, o: caught.append(
                    F.linear(i[0].detach().reshape(-1, cfg.hidden_size).double(), m.weight.detach().double()))))
        logits = model(input_ids=input_ids).logits
        for h in hooks:
            h.remove()
        margin = min([route_margin(cfg.num_experts_per_tok, o) for o in caught] or [math.inf])
        if margin > 1e-5:
            break
        print(case, 'seed', seed, 'margin', margin, 'too small: again')
    loss, ntensors, nparams = hf_fixture.write_case(out + '/' + case, cfg, model, logits, input_ids, targets)
    meta['cases'][case] = {'seed': seed, 'route_margin': margin, 'loss': loss.item(), 'params': nparams,
                           'moe_layers': len(caught), 'layer_types': cfg.layer_types,
                           'no_rope_layers': cfg.no_rope_layers, 'moe_layer_ids': cfg.moe_layers}
    print(case, 'seed', seed, 'margin %.3g' % margin, 'loss %.6f' % loss.item(), 'tensors', ntensors)
with open(out + '/meta.json', 'w') as f:
    json.dump(meta, f, indent=1)
print(json.dumps(meta, indent=1))
