"""Redraw the benchmark plots of docs/performance.md from the ``bench.json`` files that ``proxykv bench`` wrote.

How to run me (CPU, seconds; needs matplotlib)::

    python scripts/bench_plots.py docs/data/cpu_bench_1k8k.json \\
        --memory-from docs/data/cpu_bench_1k8k_fresh_memory.json --out docs/bench_cpu_1k8k.png
    python scripts/bench_plots.py docs/data/bench_cpu_qwen_pair_1k8k_fp32_epyc_avx2.json \\
        --out docs/bench_cpu_qwen_pair_1k8k_fp32.png   # more bench.json files after the first: one curve

The plot is the one ``proxykv bench`` draws (``bench.png``): TTFT and peak prefill memory against context length,
one line per method, and TTFT against FLOPs where the rows carry FLOP counts. ``--memory-from`` takes the peak
prefill memory from a second run of the same methods and lengths (a ``--fresh-memory`` run) and the times from the
first. Several ``bench.json`` files (runs at different lengths) are drawn as one.
"""

from __future__ import annotations

import argparse
import json

from proxykv_hf.bench.run import plot


def read_rows(path: str) -> list[dict]:
    with open(path) as fh:
        return json.load(fh)["rows"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", nargs="+", help="bench.json files written by proxykv bench (their rows are joined)")
    p.add_argument("--memory-from", default=None, help="a bench.json whose peak prefill memory replaces the first's")
    p.add_argument("--out", required=True, help="the PNG to write")
    ns = p.parse_args(argv)
    rows = [row for path in ns.bench for row in read_rows(path)]
    points = [(r["context"], r["method"]) for r in rows]
    if len(set(points)) < len(points):
        raise SystemExit(f"(context, method) {max(points, key=points.count)} is in more than one of {ns.bench}")
    if ns.memory_from:
        peaks = {(r["context"], r["method"]): r["peak_prefill_bytes"] for r in read_rows(ns.memory_from)}
        missing = sorted({(r["context"], r["method"]) for r in rows} - set(peaks))
        if missing:
            raise SystemExit(f"{ns.memory_from} has no row for (context, method) {missing[0]}")
        rows = [dict(r, peak_prefill_bytes=peaks[(r["context"], r["method"])]) for r in rows]
    plot(rows, ns.out)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
