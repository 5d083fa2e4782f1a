"""Fused (Triton) vs PyTorch attention column sums on a GPU: time, peak memory, agreement.

How to run me (one CUDA GPU; ``bash scripts/gpu_benchmarks.sh tests OUT`` runs both, for docs/performance.md)::

    python scripts/bench_attention_sums.py --lengths 4096 8192 16384 32768 65536
    python scripts/bench_attention_sums.py --lengths 4096 8192 16384 32768 65536 --statistics sum max

The shape defaults to one Llama-3.2-1B layer (32 query heads, 8 KV heads, head dim 64) in bfloat16: the work the
proxy does per layer on top of its own prefill. ``--statistics sum max`` times the sums with the per-key maxima
(what a sum+max mapper reads) instead of the sums alone.

A second table times what a proxy layer does in all, attention output plus statistics: sdpa followed by both fused
passes, against flash attention handing its row log-sum-exp to the second pass alone
(``causal_attention_with_statistics``, the path the proxy and the self-proxy cache take on a GPU).
"""

from __future__ import annotations

import argparse
import json

import torch

from proxykv_hf.scoring import attention_sums, causal_attention_with_statistics


def measure(fn, repeats: int) -> tuple[float, int, torch.Tensor]:
    out = fn()  # warm-up (compiles the Triton kernels on the first call)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, torch.cuda.max_memory_allocated() - base, out


def inputs(ns, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded bf16 queries `(1, heads, n, D)` and keys, values `(1, kv_heads, n, D)` on the GPU."""
    torch.manual_seed(0)
    q = torch.randn(1, ns.heads, n, ns.head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, ns.kv_heads, n, ns.head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    return q, k, v


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--statistics", nargs="+", default=["sum"], choices=["sum", "max"])
    ns = p.parse_args()
    stats = tuple(ns.statistics)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| N | torch ms | triton ms | speed-up | torch peak MiB | triton peak MiB | max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for n in ns.lengths:
        q, k, _ = inputs(ns, n)
        t_ref, m_ref, ref = measure(lambda: attention_sums(q, k, backend="torch", statistics=stats), ns.repeats)
        t_fused, m_fused, got = measure(lambda: attention_sums(q, k, backend="triton", statistics=stats), ns.repeats)
        diff = rel_diff(got, ref)
        rows.append(dict(n=n, torch_ms=t_ref, triton_ms=t_fused, torch_peak=m_ref, triton_peak=m_fused, diff=diff))
        print(f"| {n} | {t_ref:.1f} | {t_fused:.1f} | {t_ref / t_fused:.1f}x | {m_ref / 2**20:.0f} | "
              f"{m_fused / 2**20:.0f} | {diff:.1e} |")
    print(json.dumps(rows))

    print("\nattention output + statistics (one layer):")
    print("| N | sdpa + both passes ms | flash + pass 2 ms | saved | max rel. diff |")
    print("|---|---|---|---|---|")
    rows = []
    for n in ns.lengths:
        q, k, v = inputs(ns, n)

        def two_pass():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return out, attention_sums(q, k, backend="triton", statistics=stats)

        t_ref, _, (_, ref) = measure(two_pass, ns.repeats)
        t_new, _, (_, got) = measure(lambda: causal_attention_with_statistics(q, k, v, backend="triton",
                                                                              statistics=stats), ns.repeats)
        diff = rel_diff(got, ref)
        rows.append(dict(n=n, sdpa_two_pass_ms=t_ref, flash_pass2_ms=t_new, diff=diff))
        print(f"| {n} | {t_ref:.1f} | {t_new:.1f} | {1 - t_new / t_ref:.0%} | {diff:.1e} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
