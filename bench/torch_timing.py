"""What bench/torch_*.py's kernel timings share with bench/common.lua: the
median of CUDA-event timings after warm-up runs, the L2 flushed (a fill of
`flush`, 256 MiB) before each."""
import torch


def median_ms(fn, iters, warmup, flush):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        flush.zero_()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    return ts[(len(ts) - 1) // 2]
