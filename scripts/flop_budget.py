"""ProxyKV's compute floor on one device: matmul FLOPs of the full prefill and of ProxyKV's parts, per pair of real
shapes (``proxykv_hf.bench.flop_model``), and, from ``proxykv bench`` JSON files of those shapes, what each part reached.

How to run me (CPU, seconds)::

    python scripts/flop_budget.py                                   # the FLOP table of both pairs, 4k-128k
    python scripts/flop_budget.py --bench docs/data/gpu_llama.json  # + measured TTFT and TFLOP/s per part
    python scripts/flop_budget.py --bench docs/data/gpu_h200_llama_32k.json docs/data/gpu_h200_qwen_32k.json \
        docs/data/gpu_h200_llama_32k_sbs.json docs/data/gpu_h200_qwen_32k_sbs.json --bench-statistics-passes 1 \
        --plot docs/flop_floor_gpu.png  # the tables and plot of docs/performance.md

The FLOP ratio is the TTFT ratio that one device could reach were the proxy, its statistics and the mapper run as
efficiently as the target's prefill; the measured rows say how far each part is from that. A part's rate is its
FLOPs over its time in the run's breakdown (each part timed alone; at the shortest length the mapper's time there
includes its first call's set-up).
"""

from __future__ import annotations

import argparse
import functools
import json

from proxykv_hf.cli.helpers import mapper_overrides
from proxykv_hf.bench.flop_model import kvzip_prefill_flops, kvzip_template_tokens, prefill_flops
from proxykv_hf.bench.shapes import PAIRS, pair_mapper_config, shape_config
from proxykv_hf.scorers.kvzip import KVzipScorer
from proxykv_hf.testing import tiny_tokenizer

TERA = 1e12


def flops(shape: str, n: int, statistics_passes: int, mapper: tuple[str, ...] = ()) -> dict[str, int]:
    """ProxyKV's FLOPs by part for the pair of ``shape`` at ``n`` tokens: the paper-preset mapper, with the fields
    of ``mapper`` (``FIELD=VALUE`` items, as ``proxykv bench --mapper-config`` takes them) changed."""
    return prefill_flops(shape_config(shape), n, proxy_kind="model", proxy_config=shape_config(PAIRS[shape]),
                         mapper_config=pair_mapper_config(shape, **mapper_overrides(list(mapper))),
                         statistics_passes=statistics_passes)


@functools.cache
def bench_templates() -> tuple[int, int]:
    """KVzip's repeat-template sizes with the tiny tokenizer that ``proxykv bench --shape`` runs with."""
    return kvzip_template_tokens(KVzipScorer(tiny_tokenizer()))


def kvzip_total(shape: str, n: int, on_proxy: bool = False) -> int:
    """FLOPs of a KVzip prefill on the target of ``shape``, or of KVzip+IAM (KVzip on its proxy), with the default
    chunking and the bench's repeat templates."""
    first, later = bench_templates()
    return kvzip_prefill_flops(shape_config(shape), n, first_extra=first, later_extra=later,
                               scored_config=shape_config(PAIRS[shape]) if on_proxy else None)["total"]


def budget_table(shape: str, lengths: list[int], statistics_passes: int) -> list[str]:
    lines = [f"{shape} target, {PAIRS[shape]} proxy, paper-preset mapper, {statistics_passes} recomputation(s) of "
             "Q K^T per proxy layer for the statistics (TFLOP; ratios to the full prefill); KVzip and KVzip+IAM "
             "(KVzip on the proxy) as ratios:", "",
             "| context | full prefill | proxy forward | statistics | mapper | ProxyKV | FLOPs / full | "
             "KVzip / full | KVzip+IAM / full | KVzip / ProxyKV |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in lengths:
        f = flops(shape, n, statistics_passes)
        part = lambda k: f"{f[k] / TERA:.1f} ({f[k] / f['target']:.3f})"  # noqa: E731
        kvzip = kvzip_total(shape, n)
        lines.append(f"| {n} | {f['target'] / TERA:.1f} | {part('proxy')} | {part('statistics')} | {part('mapper')} | "
                     f"{f['total'] / TERA:.1f} | {f['total'] / f['target']:.3f} | {kvzip / f['target']:.3f} | "
                     f"{kvzip_total(shape, n, on_proxy=True) / f['target']:.3f} | {kvzip / f['total']:.3f} |")
    return lines


def methods_table(path: str, statistics_passes: int) -> list[str]:
    """Every counted method's measured TTFT ratio against its FLOP ratio, and the rate of its whole prefill."""
    data = json.load(open(path))
    shape = data["env"].get("shape")
    lines = [f"{path}: TTFT against FLOPs per method ({shape}; ProxyKV's statistics with {statistics_passes} "
             "recomputation(s)):", "", "| context | method | TTFT / full | FLOPs / full | TFLOP/s |",
             "|---|---|---|---|---|"]
    for row in data["rows"]:
        n, method = row["context"], row["method"]
        count = {"full": lambda: prefill_flops(shape_config(shape), n)["target"],
                 "proxykv": lambda: flops(shape, n, statistics_passes,
                                          tuple(data["env"].get("mapper_config") or ()))["total"],
                 "kvzip": lambda: kvzip_total(shape, n),
                 "kvzip_iam": lambda: kvzip_total(shape, n, on_proxy=True)}.get(method)
        if row.get("flops"):  # newer bench rows carry their own counts
            total = row["flops"]["total"]
        elif count is not None:
            total = count()
        else:
            continue
        full = prefill_flops(shape_config(shape), n)["target"]
        lines.append(f"| {n} | {method} | {row['ttft_vs_full']:.2f} | {total / full:.2f} | "
                     f"{total / row['ttft_s'] / TERA:.0f} |")
    return lines


def measured_table(path: str, statistics_passes: int, floor_passes: int) -> list[str]:
    """ProxyKV rows of one bench JSON: measured TTFT ratio against the FLOP floor, and TFLOP/s per part."""
    data = json.load(open(path))
    shape = data["env"].get("shape")
    if shape not in PAIRS:
        raise SystemExit(f"{path}: its env names no shape with a proxy pair ({shape!r}); run with --shape")
    lines = [f"{path} ({shape}; {data['env'].get('device')}; the proxy's statistics there: {statistics_passes} "
             "recomputation(s) of Q K^T per layer):", "",
             "| context | TTFT / full | FLOP floor | target TFLOP/s | proxy + statistics TFLOP/s | mapper TFLOP/s |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        b = row.get("breakdown")
        if row["method"] != "proxykv" or b is None:
            continue
        n = row["context"]
        mapper = tuple(data["env"].get("mapper_config") or ())  # the bench's --mapper-config, if any
        ran = row.get("flops") or flops(shape, n, statistics_passes, mapper)
        floor = flops(shape, n, floor_passes, mapper)
        side = (ran["proxy"] + ran["statistics"]) / b["proxy_s"]
        lines.append(f"| {n} | {row['ttft_vs_full']:.2f} | {floor['total'] / floor['target']:.2f} | "
                     f"{ran['target'] / b['target_prefill_s'] / TERA:.0f} | {side / TERA:.0f} | "
                     f"{ran['mapper'] / b['mapper_s'] / TERA:.0f} |")
    return lines


def plot(lengths: list[int], statistics_passes: int, bench: list[str], path: str, target: float | None = None) -> None:
    """Each pair's FLOP floor (dashed), the measured ProxyKV TTFT ratios of the bench files (points) and, where
    given, a target ratio (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    colour = {shape: f"C{i}" for i, shape in enumerate(PAIRS)}
    for shape in PAIRS:
        floor = [flops(shape, n, statistics_passes) for n in lengths]
        ax.plot(lengths, [f["total"] / f["target"] for f in floor], ls="--", color=colour[shape],
                label=f"{shape} / {PAIRS[shape]}: FLOPs / full")
    for path_in in bench:
        data = json.load(open(path_in))
        rows = [r for r in data["rows"] if r["method"] == "proxykv"]
        shape = data["env"].get("shape")
        ax.plot([r["context"] for r in rows], [r["ttft_vs_full"] for r in rows], marker="o", ls="-",
                color=colour.get(shape, "k"), label=f"{path_in.rsplit('/', 1)[-1]}: TTFT / full")
    ax.axhline(1.0, color="grey", lw=0.8)
    if target is not None:
        ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target}")
    ax.set(xlabel="context tokens", ylabel="ratio to the full cache's prefill", xscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context-lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    p.add_argument("--statistics-passes", type=int, default=1,
                   help="Q K^T recomputations per proxy layer in the floor (1: the flash path's pass 2 alone)")
    p.add_argument("--bench", nargs="*", default=[], help="proxykv bench JSON files of the real shapes")
    p.add_argument("--bench-statistics-passes", type=int, default=2,
                   help="what the runs in --bench executed, for rows without their own FLOP counts (2: sdpa + both "
                        "fused passes, as in docs/data/gpu_*.json)")
    p.add_argument("--plot", default=None, help="write a plot of the floors and the measured ratios here")
    p.add_argument("--target", type=float, default=None, help="a TTFT ratio to draw on the plot")
    ns = p.parse_args(argv)
    lines = []
    for shape in PAIRS:
        lines += budget_table(shape, ns.context_lengths, ns.statistics_passes) + [""]
    for path in ns.bench:
        lines += measured_table(path, ns.bench_statistics_passes, ns.statistics_passes) + [""]
        lines += methods_table(path, ns.bench_statistics_passes) + [""]
    print("\n".join(lines).rstrip())
    if ns.plot:
        plot(ns.context_lengths, ns.statistics_passes, ns.bench, ns.plot, ns.target)


if __name__ == "__main__":
    main()
