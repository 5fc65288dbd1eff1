# tools/make_deepseek_fixture.py OUT [CASE ...] — the DeepSeek-V3, -V2 and
# GLM-4.5 reference fixtures of spec/fixtures/ (spec/deepseek_v3_spec.lua,
# spec/deepseek_v2_spec.lua, spec/glm4_moe_spec.lua), made with Hugging Face
# transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM /
# Glm4MoeForCausalLM (V3's router) on the CPU in float64, on a
# host that has torch and transformers (pip's, or the lent GPU host's). The
# CASEs named (default: all). For each case, OUT/<case>/ gets:
#   config.json          the config as transformers writes it
#   model.safetensors    the weights, each routed expert under the Hub
#                        checkpoints' names (mlp.experts.N.gate_proj ...)
#   expected.safetensors input_ids, targets (i64), logits, loss and
#                        grad.<name> for every parameter
# (computed in float64, stored as float32).
# Every parameter and the routing biases are drawn again and perturbed
# (normal(0, 0.02) + normal(0, 0.05); norm weights 1 + normal(0, 0.05)),
# and a seed is kept only when every routing choice wins by a margin (no
# near-tie that rounding could flip). OUT/meta.json records the versions and
# margins; the transformers sources the fixtures came from are copied to
# OUT/src/ (read them there, they are not ours).
import json
import math
import os
import re
import shutil
import sys

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_fixture  # noqa: E402

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,  # noqa: E402
                          DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM)

os.makedirs(out + '/src', exist_ok=True)
import transformers.integrations.moe as tmoe  # noqa: E402
for m in (sys.modules[DeepseekV3ForCausalLM.__module__], sys.modules[DeepseekV3Config.__module__],
          sys.modules[DeepseekV2ForCausalLM.__module__], sys.modules[DeepseekV2Config.__module__],
          sys.modules[Glm4MoeForCausalLM.__module__], sys.modules[Glm4MoeConfig.__module__],
          transformers.modeling_rope_utils, tmoe):
    shutil.copy(m.__file__, out + '/src/' + os.path.basename(m.__file__))

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
            norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-5, rope_interleave=True,
            attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, initializer_range=0.02)
CASES = {
    # q through the low-rank pair, interleaved RoPE, group-limited routing
    'deepseek-v3-tiny': dict(rope=dict(rope_type='default', rope_theta=10000.0), T=16),
    # q_proj (no q_lora_rank), rotate-half RoPE, biases, no renormalisation,
    # one group, the first layer sparse
    'deepseek-v3-tiny-qproj': dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False,
                                   attention_bias=True, n_group=1, topk_group=1, num_experts_per_tok=2,
                                   first_k_dense_replace=0, num_hidden_layers=2, routed_scaling_factor=1.0,
                                   n_shared_experts=1, rope=dict(rope_type='default', rope_theta=500.0), T=16),
    # YaRN RoPE past the original context, both mscales
    'deepseek-v3-tiny-yarn': dict(rope=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0,
                                            original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                                            mscale=1.0, mscale_all_dim=0.8), T=32),
    # DeepSeek-V2: softmax scores, group-limited greedy (a group scored by
    # its best expert), weights scaled, not renormalised
    'deepseek-v2-tiny': dict(v2=True, topk_method='group_limited_greedy', norm_topk_prob=False,
                             routed_scaling_factor=1.5, rope=dict(rope_type='default', rope_theta=10000.0), T=16),
    # DeepSeek-V2-Lite's layout: q_proj, greedy top-k over every expert,
    # biases, YaRN with both mscales (as DeepSeek-V2's long-context configs)
    'deepseek-v2-tiny-lite': dict(v2=True, q_lora_rank=None, topk_method='greedy', norm_topk_prob=False,
                                  n_group=None, topk_group=None, attention_bias=True, routed_scaling_factor=1.0,
                                  num_experts_per_tok=2, rope=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                                  mscale=0.707, mscale_all_dim=0.707), T=32),
}
# GLM-4.5 (Glm4MoeForCausalLM): V3's router (mlp.gate with its
# e_score_correction_bias) beside grouped-query attention with partial RoPE
GLM = dict(head_dim=24, num_key_value_heads=2, attention_bias=True, use_qk_norm=True)
CASES.update({
    # half of each head rotated, q/k norms, groups, 2 shared experts
    'glm4-moe-tiny': dict(glm=True, **GLM, rope=dict(rope_type='default', rope_theta=10000.0,
                                                    partial_rotary_factor=0.5), T=16),
    # a quarter rotated (6 of 24), no q/k norm, no biases, one group, no
    # renormalisation, every layer sparse
    'glm4-moe-tiny-quarter': dict(glm=True, head_dim=24, num_key_value_heads=1, attention_bias=False,
                                  use_qk_norm=False, n_group=1, topk_group=1, norm_topk_prob=False,
                                  first_k_dense_replace=0, num_hidden_layers=2, n_shared_experts=1,
                                  rope=dict(rope_type='default', rope_theta=500.0, partial_rotary_factor=0.25),
                                  T=16),
})
if len(sys.argv) > 2:
    CASES = {k: v for k, v in CASES.items() if k in sys.argv[2:]}


def route_margin(cfg, logits, bias):
    # the smallest gap at any routing choice (the group and the expert top-k):
    # V3 sigmoid + bias, groups by their two best; V2 softmax, groups by the
    # best (greedy: one group)
    E, G, TG, K = cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    if bias is None:
        s = logits.double().softmax(-1)
        if getattr(cfg, 'topk_method', 'greedy') == 'greedy':
            G, TG = 1, 1
        gs = s.view(-1, G, E // G).max(dim=-1)[0]
    else:
        s = logits.double().sigmoid() + bias.double()
        gs = s.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
    m = math.inf
    if TG < G:
        v = gs.sort(dim=-1, descending=True)[0]
        m = min(m, (v[:, TG - 1] - v[:, TG]).min().item())
    gi = gs.topk(TG, dim=-1)[1]
    mask = torch.zeros_like(gs).scatter_(1, gi, 1).unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    c = s.masked_fill(mask == 0, 0.0)
    v = c.sort(dim=-1, descending=True)[0]
    return min(m, (v[:, K - 1] - v[:, K]).min().item())


def hub_names(cfg, tensors):
    # the in-memory fused experts (transformers 5: experts.gate_up_proj (E, 2I,
    # H), experts.down_proj (E, H, I)) under the checkpoints' per-expert names
    r = {}
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    for k, t in tensors.items():
        mg = re.match(r'(.*\.experts)\.gate_up_proj$', k)
        md = re.match(r'(.*\.experts)\.down_proj$', k)
        if mg:
            assert tuple(t.shape[1:]) == (2 * I, H), (k, t.shape)
            for e in range(t.shape[0]):
                r['%s.%d.gate_proj.weight' % (mg.group(1), e)] = t[e, :I].contiguous()
                r['%s.%d.up_proj.weight' % (mg.group(1), e)] = t[e, I:].contiguous()
        elif md:
            assert tuple(t.shape[1:]) == (H, I), (k, t.shape)
            for e in range(t.shape[0]):
                r['%s.%d.down_proj.weight' % (md.group(1), e)] = t[e].contiguous()
        else:
            r[k] = t.contiguous()
    return r


meta = {'transformers': transformers.__version__, 'torch': torch.__version__, 'cases': {}}
for case, over in CASES.items():
    over = dict(over)
    rope, T, v2, glm = over.pop('rope'), over.pop('T'), over.pop('v2', False), over.pop('glm', False)
    kw = dict(BASE)
    kw.update(over)
    Cfg, Model = (DeepseekV2Config, DeepseekV2ForCausalLM) if v2 else (DeepseekV3Config, DeepseekV3ForCausalLM)
    if glm:
        Cfg, Model = Glm4MoeConfig, Glm4MoeForCausalLM
        for k in ('kv_lora_rank', 'q_lora_rank', 'qk_rope_head_dim', 'v_head_dim', 'qk_nope_head_dim',
                  'rope_interleave'):
            kw.pop(k, None)
    cfg = hf_fixture.make_config(Cfg, kw, rope)
    for seed in range(50):
        torch.manual_seed(seed)
        model = Model(cfg).double()
        hf_fixture.redraw(model, buffers=('e_score_correction_bias',))
        model.eval()
        input_ids, targets = hf_fixture.batch(cfg.vocab_size, T)
        caught = []
        hooks = []
        for name, m in model.named_modules():
            if name.endswith('mlp.gate'):
                hooks.append(m.register_forward_hook(lambda m, i, o: caught.append((
                    F.linear(i[0].detach().reshape(-1, cfg.hidden_size).double(), m.weight.detach().double()),
                    getattr(m, 'e_score_correction_bias', None)))))
        logits = model(input_ids=input_ids).logits
        for h in hooks:
            h.remove()
        margin = min([route_margin(cfg, o, b) for o, b in caught] or [math.inf])
        if margin > 1e-5:
            break
        print(case, 'seed', seed, 'margin', margin, 'too small: again')
    loss, ntensors, nparams = hf_fixture.write_case(out + '/' + case, cfg, model, logits, input_ids, targets,
                                                    hub=lambda t: hub_names(cfg, t))
    meta['cases'][case] = {'seed': seed, 'route_margin': margin, 'loss': loss.item(), 'params': nparams,
                           'moe_layers': len(caught)}
    print(case, 'seed', seed, 'margin %.3g' % margin, 'loss %.6f' % loss.item(), 'tensors', ntensors)
    print(json.dumps(cfg.to_dict(), default=str)[:3000])
with open(out + '/meta.json', 'w') as f:
    json.dump(meta, f, indent=1)
