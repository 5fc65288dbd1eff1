"""The PyTorch reference for `bench/fsdp.lua --model deepseek --no-fsdp`: Hugging
Face transformers' DeepseekV3ForCausalLM at the same shapes (a 1.34B DeepSeek-V3:
vocab 32000, width 2048, 8 layers (the first dense, MLP 5632), 16 heads, q rank
512, kv rank 512, q/k heads 128 + 64 (RoPE; DeepSeek-V3's), v heads 128, 16 routed experts of
1408 in 4 groups (2 a token) and 2 shared, 4 experts a token), trained on one
GPU under bf16 autocast with fused AdamW on random tokens, as
../shared/bench/torch_llama.py trains its Llama. Prints the median step time,
tokens/s and the peak memory.
Usage: python3 bench/torch_deepseek.py [--batch 8] [--seq 1024] [--steps 12]
       [--experts grouped_mm|batched_mm|eager] [--attn sdpa|eager]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", default="grouped_mm")
    ap.add_argument("--attn", default="sdpa")
    a = ap.parse_args()
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=32000, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                           num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=16,
                           n_shared_experts=2, n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=512,
                           q_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=4,
                           topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True,
                           max_position_embeddings=a.seq, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg._attn_implementation = a.attn
    cfg._experts_implementation = a.experts
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device="cuda", generator=g) for _ in range(4)]
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(a.steps):
        d = data[step % 4]
        x, y = d[:, :-1], d[:, 1:]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        if step in (0, 1, a.steps - 1):
            print(f"step {step} loss {loss.item():.4f} dt {dt * 1000:.1f} ms", flush=True)
    med = statistics.median(times[2:])
    print(f"torch DeepseekV3ForCausalLM ({a.attn} attention, {a.experts} experts): {nparams / 1e9:.2f}B parameters, "
          f"B={a.batch} T={a.seq}: {med * 1000:.1f} ms/step, {a.batch * a.seq / med:,.0f} tokens/s, "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
