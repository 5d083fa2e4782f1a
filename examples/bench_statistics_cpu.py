"""What the max statistic costs on a CPU: attention sums alone vs sums and maxima, one SmolLM2-shaped layer.

    python examples/bench_statistics_cpu.py

Random inputs of one SmolLM2-135M layer (9 query heads, 3 KV heads, head dim 64), one torch thread, mean of 3
calls after a warm-up, the PyTorch path of :func:`proxykv_hf.scoring.attention_sums`; prints a markdown table.
"""

from __future__ import annotations

import time

import torch

from proxykv_hf.scoring import attention_sums


def main() -> None:
    torch.set_num_threads(1)
    print("| N | sum (ms) | sum + max (ms) | ratio |")
    print("|---|---|---|---|")
    for n in (2048, 4096):
        torch.manual_seed(0)
        q, k = torch.randn(1, 9, n, 64), torch.randn(1, 3, n, 64)
        ms = {}
        for stats in (("sum",), ("sum", "max")):
            attention_sums(q, k, statistics=stats)
            t0 = time.perf_counter()
            for _ in range(3):
                attention_sums(q, k, statistics=stats)
            ms[stats] = (time.perf_counter() - t0) / 3 * 1000
        print(f"| {n} | {ms[('sum',)]:.0f} | {ms[('sum', 'max')]:.0f} | {ms[('sum', 'max')] / ms[('sum',)]:.2f} |")


if __name__ == "__main__":
    main()
