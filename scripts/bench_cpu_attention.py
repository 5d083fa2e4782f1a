"""One layer's causal attention on the CPU: sdpa alone against the attention with its statistics in one softmax.

How to run me (docs/performance.md, "How the CPU path runs")::

    OMP_NUM_THREADS=2 python scripts/bench_cpu_attention.py --lengths 2048 4096

The shape defaults to one SmolLM2-135M layer (9 query heads, 3 KV heads, head dim 64) in float32 on random inputs:
what the bundled model's self proxy does per layer. Each row gives the median and the slowest of ``--repeats``
timings (after one warm-up, the variants taken in turn) of ``F.scaled_dot_product_attention`` (causal, what a plain
prefill runs) and of ``causal_attention_with_statistics`` (output + sum, max and lookback): as the CPU runs it (one
KV head per pass, the query chunks split between single-threaded workers), with torch's threads inside each chunk
instead (the workers off), and with all KV heads per pass (the grouping used off the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from proxykv_hf.attention import statistics as scoring, statistics_torch as scoring_torch


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def in_turn(variants: dict, repeats: int) -> dict:
    """name -> the ``repeats`` timings of ``variants[name]()``, the variants run in turn (a drift in the machine's
    speed touches each alike), after one untimed call each."""
    for fn in variants.values():
        fn()
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _with(chunk_size: int, per_pass: int | None = None, split: bool = True):
    """``causal_attention_with_statistics`` under a KV-head grouping and with or without the thread split."""

    def run(q, k, v):
        default_pass, default_pairs = scoring_torch._kv_heads_per_pass, scoring_torch.THREADED_MIN_PAIRS
        if per_pass is not None:
            scoring_torch._kv_heads_per_pass = lambda device, num_kv_heads: per_pass
        if not split:
            scoring_torch.THREADED_MIN_PAIRS = float("inf")
        try:
            return scoring.causal_attention_with_statistics(q, k, v, chunk_size=chunk_size,
                                                            statistics=scoring.STATISTICS, backend="torch")
        finally:
            scoring_torch._kv_heads_per_pass, scoring_torch.THREADED_MIN_PAIRS = default_pass, default_pairs

    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=scoring.CHUNK_SIZE)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; seconds per layer, median (slowest) of "
          f"{args.repeats}")
    print("| tokens | sdpa | one softmax (the CPU path) | torch's threads inside each chunk | all KV heads per pass |")
    print("|---|---|---|---|---|")
    for n in args.lengths:
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(1, args.heads, n, args.head_dim, generator=gen)
        k = torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen)
        v = torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen)
        variants = {
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "cpu": lambda: _with(args.chunk_size)(q, k, v),
            "shared": lambda: _with(args.chunk_size, split=False)(q, k, v),
            "grouped": lambda: _with(args.chunk_size, per_pass=args.kv_heads)(q, k, v),
        }
        times = in_turn(variants, args.repeats)
        sdpa = statistics.median(times["sdpa"])
        cells = [f"{sdpa:.3f} ({max(times['sdpa']):.3f})"]
        for name in ("cpu", "shared", "grouped"):
            med = statistics.median(times[name])
            cells.append(f"{med:.3f} ({max(times[name]):.3f}); {med / sdpa:.2f}x")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
