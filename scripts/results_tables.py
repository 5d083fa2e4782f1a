"""The accuracy tables and plot of docs/results.md from evaluation records.

How to run me::

    python scripts/results_tables.py docs/data/test_2k.jsonl docs/data/test_4k.jsonl [--plot docs/accuracy_test.png]

Each file holds the ``results.jsonl`` records of one ``proxykv eval`` run (one context length). Printed per file: a
Markdown table of every method's accuracy % per keep ratio, its mean over the ratios with a 95% bootstrap interval
and its share of KVzip's; ProxyKV / KVzip with its interval; and a table per task.
"""

from __future__ import annotations

import argparse
import json

from proxykv_hf.eval.report import accuracy_table, bootstrap, plot

ORDER = ("kvzip", "proxykv", "attn_max", "attn_sum", "snapkv", "streaming", "random", "kvzip_iam")
NAMES = {"full": "full cache", "kvzip": "KVzip", "proxykv": "**ProxyKV** (bundled mapper)",
         "attn_max": "no mapper: max (`attn_max`)", "attn_sum": "no mapper: sum (`attn_sum`)", "snapkv": "SnapKV",
         "streaming": "StreamingLLM", "random": "random", "kvzip_iam": "KVzip+IAM"}


def tables(records: list[dict], n_boot: int = 1000) -> str:
    b = bootstrap(records, n_boot=n_boot)
    ratios = sorted({r for _, r in b["cells"] if r < 1.0})
    n = b["n"]
    pct = lambda c: f"{100 * c[0]:.1f}"  # noqa: E731
    span = lambda c: f"{100 * c[0]:.1f} [{100 * c[1]:.1f}, {100 * c[2]:.1f}]"  # noqa: E731
    lengths = sorted({r["context_length"] for r in records})
    lines = [f"### ~{', '.join(map(str, lengths))} tokens: {sum(n.values())} samples ({len(n)} tasks x "
             f"{min(n.values())}-{max(n.values())})", "",
             "| method | " + " | ".join(f"rho={r}" for r in ratios) + " | mean [95% interval] | of KVzip |",
             "|---|" + "---|" * (len(ratios) + 2)]
    if ("full", 1.0) in b["cells"]:
        lines.append("| full cache (rho=1) |" + " |" * len(ratios) + f" {span(b['cells'][('full', 1.0)])} | |")
    kvzip = b["mean_over_ratios"].get("kvzip", (float("nan"),))[0]
    for m in [m for m in ORDER if m in b["mean_over_ratios"]]:
        over = b["mean_over_ratios"][m]
        share = "" if m == "kvzip" else f"{100 * over[0] / kvzip:.0f}%"
        lines.append(f"| {NAMES[m]} | " + " | ".join(pct(b["cells"][(m, r)]) for r in ratios)
                     + f" | {span(over)} | {share} |")
    if b["proxykv_vs_kvzip"] is not None:
        v = b["proxykv_vs_kvzip"]
        lines += ["", f"ProxyKV / KVzip: **{100 * v[0]:.0f}%** (95% interval {100 * v[1]:.0f}-{100 * v[2]:.0f}%)."]
    table = accuracy_table(records)
    tasks = sorted({r["task"] for r in records})
    lines += ["", "Per task (accuracy %, mean over the ratios; full cache at rho=1):", "",
              "| method | " + " | ".join(f"`{t}`" for t in tasks) + " |", "|---|" + "---|" * len(tasks)]
    for m in ("full",) + ORDER:
        rows = [row for (mm, _), row in table.items() if mm == m]
        if rows:
            lines.append(f"| {NAMES[m]} | " + " | ".join(
                f"{100 * sum(row.get(t, 0.0) for row in rows) / len(rows):.1f}" for t in tasks) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="results.jsonl files, one per context length")
    p.add_argument("--plot", default=None, help="write the first file's accuracy plot here (PNG)")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap replicates")
    ns = p.parse_args(argv)
    for i, path in enumerate(ns.files):
        with open(path) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        print(tables(records, ns.n_boot))
        if i == 0 and ns.plot:
            plot(records, ns.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
