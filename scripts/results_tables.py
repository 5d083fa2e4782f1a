"""The accuracy tables and plot of docs/results.md from evaluation records.

How to run me::

    python scripts/results_tables.py docs/data/test_2k.jsonl.gz docs/data/test_4k.jsonl.gz --split test \\
        --plot docs/accuracy_test_2k.png

Each file holds the ``results.jsonl`` records of a ``proxykv eval`` run, as written or gzip-compressed
(``.jsonl.gz``, as docs/data keeps them). Printed per file and context length
(:func:`proxykv_hf.eval.report.interval_tables`): every method's accuracy % per keep ratio, its mean over the
ratios with a 95% bootstrap interval and its share of KVzip's, ProxyKV / KVzip with its interval, how many of the
samples the full cache answers fully right each method still answers, and a table per task. ``--plot`` draws the
first file's accuracy against keep ratio; ``--merge`` reads all files as one run; ``--rename FILE OLD NEW`` calls
method OLD of that file's records NEW (two runs of one method, e.g. two mappers, merged); ``--tasks`` keeps only
the named tasks; ``--samples N`` keeps the first N samples of each task (runs of different sizes compared on the same
samples); ``--paired A B`` adds method A's mean over the ratios minus method B's, with its paired 95% interval,
and per keep ratio, of the samples the full cache answers fully right, A's share minus B's with its paired interval
(:func:`proxykv_hf.eval.report.paired_answered`).
"""

from __future__ import annotations

import argparse

from proxykv_hf.eval.report import interval_tables, paired_answered, paired_difference, plot, read_records


def _renamed(records: list[dict], path: str, renames: list[list[str]]) -> list[dict]:
    names = {old: new for file, old, new in renames if file == path}
    return [{**r, "method": names.get(r["method"], r["method"])} for r in records]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="results.jsonl (or .jsonl.gz) files of proxykv eval runs")
    p.add_argument("--split", default=None, help="the split the records come from, for the headings")
    p.add_argument("--plot", default=None, help="write the first file's accuracy plot here (PNG)")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap replicates")
    p.add_argument("--merge", action="store_true", help="read all files as one run (e.g. two budgets' records)")
    p.add_argument("--methods", nargs="+", default=None, help="only these methods (the full cache is always kept)")
    p.add_argument("--tasks", nargs="+", default=None, help="only these tasks (e.g. needle:manpages)")
    p.add_argument("--samples", type=int, default=None, help="only the first N samples of each task and length")
    p.add_argument("--paired", nargs=2, metavar=("A", "B"), default=None,
                   help="also print method A's mean minus method B's, paired over the same samples, with its interval")
    p.add_argument("--rename", nargs=3, action="append", default=[], metavar=("FILE", "OLD", "NEW"),
                   help="call method OLD of FILE's records NEW (e.g. two mappers' proxykv runs merged)")
    ns = p.parse_args(argv)
    unknown = {path for path, _, _ in ns.rename} - set(ns.files)
    if unknown:
        p.error(f"--rename names a file that is not given: {', '.join(sorted(unknown))}")
    files = [_renamed(read_records(path), path, ns.rename) for path in ns.files]
    runs = [[r for records in files for r in records]] if ns.merge else files
    if ns.samples is not None:
        runs = [[r for r in records if r["sample"] < ns.samples] for records in runs]
    if ns.tasks:
        runs = [[r for r in records if r["task"] in ns.tasks] for records in runs]
    if ns.methods:
        runs = [[r for r in records if r["method"] in {"full", *ns.methods}] for records in runs]
    for i, records in enumerate(runs):
        print(interval_tables(records, ns.split, ns.n_boot))
        if ns.paired:
            a, b = ns.paired
            diff, lo, hi = paired_difference(records, a, b, n_boot=ns.n_boot)
            print(f"{a} - {b}: {diff:+.1f} points (95% interval {lo:+.1f} to {hi:+.1f}), paired over the same samples\n")
            if any(r["method"] == "full" and r["score"] >= 1 for r in records):
                for x, (n, ca, cb, d, lo, hi) in paired_answered(records, a, b, n_boot=ns.n_boot).items():
                    print(f"rho={x}: of the {n} samples the full cache answers fully right, {a} {ca}/{n}, {b} "
                          f"{cb}/{n}: {d:+.1f} points (paired 95% interval {lo:+.1f} to {hi:+.1f})")
                print()
        if i == 0 and ns.plot:
            plot(records, ns.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
