"""Mean accuracy (%) per keep ratio of several eval runs, over the samples they all hold (one table row per run).

    python examples/accuracy_on_common_samples.py new=runs/eval-new/results.jsonl \
        --reference shipped=docs/data/eval_2k_proxykv.jsonl:proxykv kvzip=docs/data/eval_2k_grid.jsonl \
        --held-out vt qa --oracle kvzip

Each ``LABEL=PATH`` is a ``results.jsonl`` of ``proxykv eval`` holding one method other than the full cache (its
ProxyKV records, say). ``--reference LABEL=PATH:METHOD`` rows come from a method of another file (default method:
the label). Only the (task, context length, sample) triples every run and reference holds are counted, so runs of
different sizes compare on the same samples; the table says how many. ``--held-out`` adds a row block for those
tasks alone; ``--oracle LABEL`` gives each mean as a share of that run's too. ``--report DIR`` writes those
samples' records, each run's under its label as the method (plus the full-cache records any input holds for them),
to ``DIR/results.jsonl`` with the harness's ``results.md`` (per-task table included) and ``accuracy.png``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def read(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load(path: str, records: list[dict], method: str | None = None) -> dict[tuple, dict[float, float]]:
    """``{(task, length, sample): {keep_ratio: score}}`` of one method of ``path``'s records (the only non-full one
    when None)."""
    out: dict[tuple, dict[float, float]] = defaultdict(dict)
    methods = set()
    for r in records:
        if r["method"] == "full" or (method is not None and r["method"] != method):
            continue
        methods.add(r["method"])
        out[(r["task"], r["context_length"], r["sample"])][r["keep_ratio"]] = r["score"]
    if len(methods) != 1:
        raise SystemExit(f"{path}: expected one method, found {sorted(methods) or 'none'}; "
                         "name it as LABEL=PATH:METHOD")
    return out


def write_report(out_dir: str, sources: dict[str, tuple[list[dict], str | None]], keys: list[tuple],
                 ratios: list[float], held_out: list[str]) -> Path:
    """The records behind the table (``{label: (records, method)}`` on ``keys`` and ``ratios``) as a harness
    report."""
    from proxykv_hf.eval.report import markdown, plot

    keep, records, full = set(keys), [], {}
    for label, (source, method) in sources.items():
        for r in source:
            key = (r["task"], r["context_length"], r["sample"])
            if key not in keep:
                continue
            if r["method"] == "full":
                full.setdefault(key, r)
            elif (method is None or r["method"] == method) and r["keep_ratio"] in ratios:
                records.append(dict(r, method=label))
    records += full.values()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    (out / "results.md").write_text(markdown(records, held_out))
    plot(records, out / "accuracy.png")
    return out


def table(runs: dict[str, dict], keys: list[tuple], ratios: list[float], title: str,
          oracle: str | None = None) -> list[str]:
    means = {label: [100 * sum(s[k][r] for k in keys) / len(keys) for r in ratios] for label, s in runs.items()}
    mean = {label: sum(m) / len(m) for label, m in means.items()}
    header = "| run | " + " | ".join(f"rho={r:g}" for r in ratios) + " | mean |" + (f" of {oracle} |" if oracle else "")
    lines = [f"{title} ({len(keys)} samples)", "", header, "|---" * (len(ratios) + 2 + bool(oracle)) + "|"]
    for label, m in means.items():
        share = ""
        if oracle:
            share = f" {100 * mean[label] / mean[oracle]:.1f}% |" if mean[oracle] > 0 else " |"
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in m) + f" | {mean[label]:.1f} |" + share)
    return lines + [""]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    p.add_argument("--reference", nargs="*", default=[], metavar="LABEL=PATH[:METHOD]")
    p.add_argument("--held-out", nargs="*", default=[])
    p.add_argument("--oracle", default=None, help="label of the run each mean is also given as a share of")
    p.add_argument("--report", default=None, metavar="DIR", help="write the compared records, table and plot here")
    ns = p.parse_args(argv)
    paths: dict[str, tuple[str, str | None]] = {}
    for item in ns.runs:
        label, _, path = item.partition("=")
        paths[label] = (path, None)
    for item in ns.reference:
        label, _, rest = item.partition("=")
        path, _, method = rest.partition(":")
        paths[label] = (path, method or label)
    files = {path: read(path) for path, _ in paths.values()}  # each file read once
    sources = {label: (files[path], method) for label, (path, method) in paths.items()}
    runs = {label: load(path, files[path], method) for label, (path, method) in paths.items()}
    ratios = sorted(set.intersection(*({r for per in s.values() for r in per} for s in runs.values())))
    keys = sorted(k for k in set.intersection(*(set(s) for s in runs.values()))
                  if all(set(ratios) <= set(s[k]) for s in runs.values()))  # samples with every ratio in every run
    if not keys:
        raise SystemExit("the runs share no sample with every keep ratio")
    if ns.oracle is not None and ns.oracle not in runs:
        raise SystemExit(f"--oracle {ns.oracle!r} is not one of the labels {sorted(runs)}")
    lines = table(runs, keys, ratios, "All tasks", ns.oracle)
    held = [k for k in keys if k[0] in ns.held_out]
    if held:
        lines += table(runs, held, ratios, "Held-out tasks " + ", ".join(ns.held_out), ns.oracle)
    print("\n".join(lines))
    if ns.report:
        out = write_report(ns.report, sources, keys, ratios, ns.held_out)
        print(f"records, results.md and accuracy.png: {out}")


if __name__ == "__main__":
    main()
