"""One layer's causal attention on the CPU: sdpa alone against the attention with its statistics in one softmax.

How to run me (docs/performance.md, "How the CPU path runs")::

    OMP_NUM_THREADS=2 python scripts/bench_cpu_attention.py --lengths 2048 4096

The shape defaults to one SmolLM2-135M layer (9 query heads, 3 KV heads, head dim 64) in float32 on random inputs:
what the bundled model's self proxy does per layer. Each row gives the best of ``--repeats`` timings (after one
warm-up) of ``F.scaled_dot_product_attention`` (causal, what a plain prefill runs) and of
``causal_attention_with_statistics`` (output + sum, max and lookback) with the query chunks of one KV head per
pass (the CPU default) and of all KV heads at once (the grouping used off the CPU).
"""

from __future__ import annotations

import argparse
import time

import torch

from proxykv_hf import scoring


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=scoring.CHUNK_SIZE)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    stats = scoring.STATISTICS
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; best of {args.repeats}, seconds per layer")
    print("| tokens | sdpa | one softmax, 1 KV head per pass | one softmax, all KV heads per pass |")
    print("|---|---|---|---|")
    default = scoring._kv_heads_per_pass
    for n in args.lengths:
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(1, args.heads, n, args.head_dim, generator=gen)
        k = torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen)
        v = torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen)
        group = args.heads // args.kv_heads
        sdpa = best_of(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True), args.repeats)
        timed = {}
        for per_pass in (1, args.kv_heads):
            scoring._kv_heads_per_pass = lambda device, num_kv_heads, p=per_pass: p
            try:
                timed[per_pass] = best_of(lambda: scoring.causal_attention_with_statistics(
                    q, k, v, chunk_size=args.chunk_size, statistics=stats, backend="torch"), args.repeats)
            finally:
                scoring._kv_heads_per_pass = default
        print(f"| {n} | {sdpa:.3f} | {timed[1]:.3f} ({timed[1] / sdpa:.2f}x) | "
              f"{timed[args.kv_heads]:.3f} ({timed[args.kv_heads] / sdpa:.2f}x) |")


if __name__ == "__main__":
    main()
