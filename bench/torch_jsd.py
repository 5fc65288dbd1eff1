"""PyTorch's reference for bench/jsd.lua: TRL's generalized JSD (GKD's
generalized_jsd_loss: beta 0 forward KL, 1 reverse KL, otherwise beta
KL(teacher||m) + (1 - beta) KL(student||m)) on logits materialised by
x @ W.T, eager and under torch.compile, forward + backward.

    python3 bench/torch_jsd.py [--shapes 8192x2048x4096x128256] [--beta 0.5] [--temperature 1]
                               [--iters 10] [--warmup 2] [--modes eager,compile]

The same inputs and timing as bench/jsd.lua (bf16 hidden states and heads,
the student's requiring grad, the teacher's constants; the logits cast to
f32 before the log-softmax, as TRL and Liger's reference do; CUDA events,
median, L2 flushed before each run); memory: the peak of one step above
what the inputs take.
"""
import argparse

import torch
import torch.nn.functional as F
from torch_timing import median_ms  # (bench/torch_timing.py)


def jsd_loss(xs, Ws, xt, Wt, labels, beta, temperature):
    ls = torch.log_softmax((xs @ Ws.T).float() / temperature, -1)
    with torch.no_grad():
        lt = torch.log_softmax((xt @ Wt.T).float() / temperature, -1)
    if beta == 0:
        per = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        per = F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    else:
        b = torch.tensor(beta, dtype=ls.dtype, device=ls.device)
        logm = torch.logsumexp(torch.stack([ls + torch.log(1 - b), lt + torch.log(b)]), dim=0)
        per = beta * F.kl_div(logm, lt, reduction="none", log_target=True).sum(-1) + \
            (1 - beta) * F.kl_div(logm, ls, reduction="none", log_target=True).sum(-1)
    keep = labels != -100
    return (per * keep).sum() / keep.sum().clamp(min=1)



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x2048x4096x128256")
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default="eager,compile")
    a = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(64 * 2**20, dtype=torch.float32, device=dev)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; beta {a.beta}, "
          f"temperature {a.temperature}")
    print("| mode | BT x Hs x Ht x V | ms (fwd+bwd) | peak above inputs GiB | loss |")
    print("|---|---|---|---|---|")
    for s in a.shapes.split(","):
        BT, Hs, Ht, V = (int(v) for v in s.split("x"))
        g = torch.Generator(device=dev).manual_seed(1)
        xs = torch.randn(BT, Hs, device=dev, generator=g).bfloat16().requires_grad_()
        Ws = (torch.randn(V, Hs, device=dev, generator=g) * 0.02).bfloat16().requires_grad_()
        xt = torch.randn(BT, Ht, device=dev, generator=g).bfloat16()
        Wt = (torch.randn(V, Ht, device=dev, generator=g) * 0.02).bfloat16()
        labels = torch.randint(0, V, (BT,), device=dev, generator=g)
        for mode in a.modes.split(","):
            f = torch.compile(jsd_loss) if mode == "compile" else jsd_loss
            out = {}

            def step():
                xs.grad, Ws.grad = None, None
                loss = f(xs, Ws, xt, Wt, labels, a.beta, a.temperature)
                loss.backward()
                out["loss"] = loss.detach()

            try:
                step()
                xs.grad, Ws.grad = None, None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                t = median_ms(step, a.iters, a.warmup, flush)
            except torch.OutOfMemoryError:
                print(f"| {mode} | {s} | out of memory | | |")
                torch.cuda.empty_cache()
                continue
            print(f"| {mode} | {s} | {t:.2f} | {peak:.2f} | {out['loss'].item():.5f} |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
