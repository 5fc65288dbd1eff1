# tools/make_jsd_fixture.py OUT — reference cases of the fused linear JSD
# (spec/jsd_spec.lua): the generalized Jensen-Shannon divergence as TRL's
# GKD trainer defines it (generalized_jsd_loss: beta 0 the forward KL of the
# teacher against the student, beta 1 the reverse KL, otherwise
# beta KL(teacher‖m) + (1 − beta) KL(student‖m), m the beta-weighted
# mixture, with torch.logsumexp for log m), on logits of hidden states times
# each side's head divided by the temperature, summed over the vocabulary
# and averaged over the tokens whose label is not -100 (all tokens without
# labels) or summed. Computed by PyTorch in float64 with autograd on the
# CPU. For each case OUT/<case>.safetensors holds xs, Ws, xt, Wt (f64),
# labels (i64, when the case has them), loss, grad_xs, grad_Ws; OUT/cases.json
# each case's beta, temperature, reduction and whether it has labels.
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

out = sys.argv[1]
os.makedirs(out, exist_ok=True)


def jsd(ls, lt, beta):
    # ls, lt: log-probabilities (rows, V); the divergence of each row
    if beta == 0:
        return F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=ls.dtype)
    logm = torch.logsumexp(torch.stack([ls + torch.log(1 - b), lt + torch.log(b)]), dim=0)
    kl_t = F.kl_div(logm, lt, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(logm, ls, reduction="none", log_target=True).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


CASES = {
    "beta0.5": dict(beta=0.5, temperature=1.0, reduction="mean", labels=False, N=7, V=37, Hs=12, Ht=20),
    "beta0": dict(beta=0.0, temperature=1.0, reduction="mean", labels=True, N=9, V=41, Hs=10, Ht=16),
    "beta1": dict(beta=1.0, temperature=1.0, reduction="mean", labels=True, N=9, V=41, Hs=10, Ht=16),
    "beta0.3_temp2_labels": dict(beta=0.3, temperature=2.0, reduction="mean", labels=True, N=11, V=53, Hs=8,
                                 Ht=24),
    "beta0.8_sum": dict(beta=0.8, temperature=0.7, reduction="sum", labels=True, N=6, V=29, Hs=14, Ht=14),
}
g = torch.Generator().manual_seed(20261128)
meta = {"torch": torch.__version__, "cases": {}}
for name, c in CASES.items():
    N, V, Hs, Ht = c["N"], c["V"], c["Hs"], c["Ht"]
    xs = torch.randn(N, Hs, dtype=torch.float64, generator=g).requires_grad_()
    Ws = (torch.randn(V, Hs, dtype=torch.float64, generator=g) * 0.7).requires_grad_()
    xt = torch.randn(N, Ht, dtype=torch.float64, generator=g)
    Wt = torch.randn(V, Ht, dtype=torch.float64, generator=g) * 0.7
    labels = torch.randint(0, V, (N,), generator=g)
    if c["labels"]:
        labels[torch.rand(N, generator=g) < 0.3] = -100
        labels[1] = -100
    ls = torch.log_softmax(xs @ Ws.T / c["temperature"], -1)
    lt = torch.log_softmax(xt @ Wt.T / c["temperature"], -1)
    per = jsd(ls, lt, c["beta"])
    keep = (labels != -100) if c["labels"] else torch.ones(N, dtype=torch.bool)
    per = per * keep
    loss = per.sum() / keep.sum().clamp(min=1) if c["reduction"] == "mean" else per.sum()
    loss.backward()
    t = {"xs": xs.detach(), "Ws": Ws.detach(), "xt": xt, "Wt": Wt, "loss": loss.detach().reshape(1),
         "grad_xs": xs.grad, "grad_Ws": Ws.grad}
    if c["labels"]:
        t["labels"] = labels
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out, name + ".safetensors"))
    meta["cases"][name] = {k: c[k] for k in ("beta", "temperature", "reduction", "labels")}
    meta["cases"][name]["loss"] = loss.item()
with open(os.path.join(out, "cases.json"), "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
print(json.dumps(meta, indent=1))
