"""Where in the context the facts a method loses were: per quarter of the context (the depth of the sample's first
fact, from the generator), how many samples the full cache answers fully right, and how many of those each method
still answers fully right at each keep ratio.

How to run me (the samples are regenerated from the task, seed and count the records were run with)::

    python scripts/depth_table.py docs/data/dev_2k_passkey.jsonl.gz --task passkey:filler-dev2 --seed 1000003 \\
        --n-samples 80 --context-length 2048
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from proxykv_hf.eval import tasks as task_lib
from proxykv_hf.eval.report import read_records
from proxykv_hf.models import DEFAULT_MODEL, load_tokenizer


def depth_rows(records: list[dict], depths: dict[int, float], bins: int = 4) -> dict:
    """``{method: {keep ratio: [kept in each depth bin]}}`` and the full cache's count per bin under ``"full"``."""
    by = defaultdict(dict)
    for r in records:
        by[r["sample"]][r["method"], r["keep_ratio"]] = r["score"]
    answered = [s for s, got in by.items() if got.get(("full", 1.0)) == 1.0 and s in depths]
    bin_of = {s: min(int(depths[s] * bins), bins - 1) for s in answered}
    rows: dict = {"full": {1.0: [sum(bin_of[s] == b for s in answered) for b in range(bins)]}}
    for method, ratio in sorted({k for got in by.values() for k in got if k[0] != "full"}):
        rows.setdefault(method, {})[ratio] = [sum(bin_of[s] == b and by[s].get((method, ratio)) == 1.0
                                                  for s in answered) for b in range(bins)]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="results.jsonl (or .jsonl.gz) files, read as one run")
    p.add_argument("--task", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--n-samples", type=int, required=True)
    p.add_argument("--context-length", type=int, required=True)
    p.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer the samples were fitted with")
    p.add_argument("--bins", type=int, default=4)
    ns = p.parse_args(argv)
    records = [r for path in ns.files for r in read_records(path)
               if r["task"] == ns.task and r["context_length"] == ns.context_length]
    samples = task_lib.generate(ns.task, ns.n_samples, ns.context_length, load_tokenizer(ns.model), ns.seed)
    rows = depth_rows(records, {i: s.meta["depths"][0] for i, s in enumerate(samples)}, ns.bins)
    edges = [f"{b / ns.bins:.2f}-{(b + 1) / ns.bins:.2f}" for b in range(ns.bins)]
    print(f"{ns.task} at ~{ns.context_length}: of the samples the full cache answers fully right, per depth of the "
          f"fact, how many each method still answers fully right")
    print("| method | keep ratio | " + " | ".join(f"depth {e}" for e in edges) + " |")
    print("|---|---|" + "---|" * ns.bins)
    for method, by_ratio in rows.items():
        for ratio, counts in by_ratio.items():
            print(f"| {method} | {ratio:g} | " + " | ".join(str(c) for c in counts) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
