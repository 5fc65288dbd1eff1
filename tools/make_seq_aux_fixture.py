# tools/make_seq_aux_fixture.py OUT — reference cases of DeepSeek's
# sequence-wise balance loss (spec/moe_seq_aux_spec.lua), computed by
# PyTorch in float64 with autograd on the CPU, written from the formulas
# (our own code):
#   * DeepSeek-V2's MoEGate (its modeling_deepseek.py, seq_aux): softmax
#     scores; the experts the routing chose (greedy, or group-limited:
#     each group scored by its best expert, the topk_group best kept);
#     per sequence b: ce_bi = (count of expert i among the sequence's
#     T k choices) E / (T k), loss = alpha mean_b sum_i ce_bi mean_t s_bti;
#     seq_aux false: the same over all the forward's tokens at once;
#   * the DeepSeek-V3 report's eq. 17-20: sigmoid scores s, s' = s / sum_j
#     s_j, f_i counting each token's k best plain scores (the routing bias
#     and the group limit not applied), P_i the mean of s'.
# For each case OUT/<case>.safetensors holds x (N, H), w (E, H) the router,
# bias (E) the routing bias (zeros for V2), loss (1), grad_x, grad_w; and
# OUT/cases.json each case's B, T, k, alpha, score, n_group, topk_group,
# per_seq, choice.
import json
import os
import sys

import torch
from safetensors.torch import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)


def v2_topk(scores, k, G, TG):
    N, E = scores.shape
    if G == 1:
        return torch.topk(scores, k, dim=-1).indices
    gs = scores.view(N, G, -1).max(dim=-1).values
    gi = torch.topk(gs, TG, dim=-1).indices
    mask = torch.zeros_like(gs).scatter_(1, gi, 1)
    keep = mask.unsqueeze(-1).expand(N, G, E // G).reshape(N, E)
    return torch.topk(scores.masked_fill(~keep.bool(), 0.0), k, dim=-1).indices


def balance(scores_for_aux, idx, B, T, k, E, alpha, per_seq):
    if per_seq:
        ce = torch.zeros(B, E, dtype=scores_for_aux.dtype)
        ce.scatter_add_(1, idx.view(B, -1), torch.ones(B, T * k, dtype=scores_for_aux.dtype))
        ce = ce / (T * k / E)
        return (ce * scores_for_aux.view(B, T, E).mean(dim=1)).sum(dim=1).mean() * alpha
    onehot = torch.nn.functional.one_hot(idx.reshape(-1), num_classes=E).to(scores_for_aux.dtype)
    f = onehot.mean(0) * E
    return (f * scores_for_aux.mean(0)).sum() * alpha


CASES = {
    "v2_greedy": dict(score="softmax", B=3, T=7, H=6, E=8, k=2, G=1, TG=1, alpha=0.001, per_seq=True),
    "v2_grouped": dict(score="softmax", B=2, T=9, H=5, E=12, k=3, G=4, TG=2, alpha=0.003, per_seq=True),
    "v2_batch": dict(score="softmax", B=3, T=5, H=6, E=8, k=2, G=4, TG=2, alpha=0.01, per_seq=False),
    "v3_grouped_bias": dict(score="sigmoid", B=3, T=6, H=7, E=16, k=4, G=4, TG=2, alpha=0.0001, per_seq=True),
    "v3_top1": dict(score="sigmoid", B=4, T=5, H=6, E=8, k=1, G=1, TG=1, alpha=0.02, per_seq=True),
}
g = torch.Generator().manual_seed(20261128)
meta = {"torch": torch.__version__, "cases": {}}
for name, c in CASES.items():
    B, T, H, E, k, G, TG = c["B"], c["T"], c["H"], c["E"], c["k"], c["G"], c["TG"]
    N = B * T
    x = torch.randn(N, H, dtype=torch.float64, generator=g).requires_grad_()
    w = (0.7 * torch.randn(E, H, dtype=torch.float64, generator=g)).requires_grad_()
    v3 = c["score"] == "sigmoid"
    bias = 0.3 * torch.randn(E, dtype=torch.float64, generator=g) if v3 else torch.zeros(E, dtype=torch.float64)
    logits = x @ w.t()
    if v3:
        s = logits.sigmoid()
        idx = torch.topk(s, k, dim=-1).indices   # eq. 18: the k best plain scores
        loss = balance(s / s.sum(dim=-1, keepdim=True), idx, B, T, k, E, c["alpha"], c["per_seq"])
    else:
        s = logits.softmax(dim=-1)
        idx = v2_topk(s, k, G, TG)
        loss = balance(s, idx, B, T, k, E, c["alpha"], c["per_seq"])
    loss.backward()
    save_file({"x": x.detach(), "w": w.detach(), "bias": bias, "loss": loss.detach().reshape(1),
               "grad_x": x.grad, "grad_w": w.grad}, os.path.join(out, name + ".safetensors"))
    meta["cases"][name] = dict(B=B, T=T, k=k, alpha=c["alpha"], score=c["score"], n_group=G, topk_group=TG,
                               per_seq=c["per_seq"], choice="scores" if v3 else "routing")
with open(os.path.join(out, "cases.json"), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
