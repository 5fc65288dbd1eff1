"""PyTorch's scaled_dot_product_attention at bench/attention.lua's shapes:
the reference our fused attention kernels are measured against.

    python3 bench/torch_attention.py [--shapes 8x12x1024,4x32x2048x128,...]
                                     [--backends flash,cudnn,efficient] [--iters 20] [--warmup 3]

Causal, bf16, q/k/v (B, H, T, D) contiguous as SDPA takes them. Each
backend is forced in turn (torch.nn.attention.sdpa_kernel); a backend that
refuses a shape is reported as such. Timing as bench/attention.lua: CUDA
events, median of the runs, L2 flushed (a 256 MiB fill) before each; the
backward is torch.autograd.grad of the output against a fixed random
gradient. Flops (causal, FA2's count): forward 2·B·H·T²·(D + Dv) / 2,
backward 2·B·H·T²·(3D + 2Dv) / 2.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch_timing import median_ms  # (bench/torch_timing.py)

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def parse_shape(s):
    p = [int(v) for v in s.split("x")]
    B, H, T = p[0], p[1], p[2]
    D = p[3] if len(p) > 3 else 64
    Dv = p[4] if len(p) > 4 else D
    return B, H, T, D, Dv



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x12x1024,4x32x2048,2x16x4096x128,2x16x4096x192,2x16x4096x192x128")
    ap.add_argument("--backends", default="flash,cudnn,efficient")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(64 * 2**20, dtype=torch.float32, device=dev)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16, causal")
    print("| backend | B x H x T x D (x Dv) | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for s in a.shapes.split(","):
        B, H, T, D, Dv = parse_shape(s)
        g = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        k = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        v = torch.randn(B, H, T, Dv, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        go = torch.randn(B, H, T, Dv, device=dev, dtype=torch.bfloat16, generator=g)
        ff = 2 * B * H * T * T * (D + Dv) / 2
        fb = 2 * B * H * T * T * (3 * D + 2 * Dv) / 2
        for name in a.backends.split(","):
            try:
                with sdpa_kernel([BACKENDS[name]]):
                    def fwd():
                        with torch.no_grad():
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    fwd()
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)

                    def bwd():
                        return torch.autograd.grad(o, (q, k, v), go, retain_graph=True)
                    bwd()
                    tf = median_ms(fwd, a.iters, a.warmup, flush)
                    tb = median_ms(bwd, a.iters, a.warmup, flush)
                    del o
            except Exception as e:  # a backend that does not take the shape
                print(f"| {name} | {s} | refused: {str(e).splitlines()[0][:80]} | | | |")
                continue
            print(f"| {name} | {s} | {tf:.3f} | {ff / tf / 1e9:.1f} | {tb:.3f} | {fb / tb / 1e9:.1f} |")


if __name__ == "__main__":
    main()
