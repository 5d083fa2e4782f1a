"""Do two eval runs give the same answers? Compares ``results.jsonl`` records by (task, length, sample, method, rho).

    python examples/compare_eval_runs.py runs/cpu-check-2k/results.jsonl docs/data/eval_2k_grid.jsonl

Every record of the first file must exist in the second, on the same sample (same answers and prompt length);
prints the share of identical predictions and every difference.
"""

from __future__ import annotations

import json
import sys


def records(path: str) -> dict[tuple, dict]:
    out = {}
    with open(path) as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                out[(r["task"], r["context_length"], r["sample"], r["method"], r["keep_ratio"])] = r
    return out


def main(argv=None) -> None:
    first, second = (records(p) for p in (argv or sys.argv[1:]))
    same = 0
    for key, r in first.items():
        if key not in second:
            raise SystemExit(f"{key} is missing from the second run")
        g = second[key]
        if (g["answers"], g["n_tokens"]) != (r["answers"], r["n_tokens"]):
            raise SystemExit(f"{key}: not the same sample in both runs")
        if g["prediction"] == r["prediction"]:
            same += 1
        else:
            print(f"{key}: {r['prediction']!r} vs {g['prediction']!r}")
    print(f"{same} / {len(first)} predictions identical")


if __name__ == "__main__":
    main()
