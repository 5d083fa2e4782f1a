"""Tables and plots from a harness run's ``results.jsonl`` (or records kept gzip-compressed, ``.jsonl.gz``)."""

from __future__ import annotations

import gzip
import json
import logging
import warnings
from collections import defaultdict
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)


def open_records(path: str | Path, mode: str = "rt") -> IO[str]:
    """A JSON-lines file of records, text mode: gzip-compressed when its name ends in ``.gz``. Appending
    (``mode="at"``) to a ``.gz`` file adds a gzip member, which every reader sees as the same one stream."""
    opener = gzip.open if str(path).endswith(".gz") else open
    return opener(path, mode, encoding="utf-8")


def read_records(path: str | Path) -> list[dict]:
    """The records of a ``.jsonl`` or ``.jsonl.gz`` file, one dict per non-empty line."""
    with open_records(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_results(out_dir: str | Path) -> list[dict]:
    """The records of a run directory's ``results.jsonl`` (or ``results.jsonl.gz`` when only that is there)."""
    path = Path(out_dir) / "results.jsonl"
    if not path.exists() and path.with_suffix(".jsonl.gz").exists():
        path = path.with_suffix(".jsonl.gz")
    return read_records(path)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def accuracy_table(records: list[dict]) -> dict:
    """``{(method, keep_ratio): {task: mean score, "all": mean over tasks}}`` (the full cache at 1.0)."""
    by = defaultdict(lambda: defaultdict(list))
    for r in records:
        by[(r["method"], r["keep_ratio"])][r["task"]].append(r["score"])
    table = {}
    for key, tasks in by.items():
        row = {t: _mean(v) for t, v in tasks.items()}
        row["all"] = _mean(row.values())
        table[key] = row
    return table


def markdown(records: list[dict], held_out: list[str] | tuple[str, ...] = ()) -> str:
    """Accuracy per method and keep ratio (mean over tasks, and per task), fidelity, ProxyKV / KVzip; with
    ``held_out`` task families (see ``eval.tasks.TASK_FAMILIES``), the same split into trained and held-out."""
    table = accuracy_table(records)
    methods = sorted({m for m, _ in table}, key=lambda m: (m != "full", m))
    ratios = sorted({r for m, r in table if m != "full"})
    tasks = sorted({r["task"] for r in records})
    lengths = sorted({r["context_length"] for r in records})
    n = len({(r["task"], r["context_length"], r["sample"]) for r in records})
    lines = [f"Samples: {n} ({len(tasks)} tasks x context lengths {lengths}). Scores are RULER string-match "
             "accuracy in %, averaged over tasks.", "",
             "| method | " + " | ".join(f"rho={r}" for r in ratios) + " |",
             "|---|" + "---|" * len(ratios)]
    for m in methods:
        if m == "full":
            full = table[("full", 1.0)]["all"]
            lines.append("| full cache | " + " | ".join(f"{100 * full:.1f}" for _ in ratios) + " |")
            continue
        lines.append(f"| {m} | " + " | ".join(f"{100 * table.get((m, r), {}).get('all', float('nan')):.1f}"
                                               for r in ratios) + " |")
    if "proxykv" in methods and "kvzip" in methods:
        rel = [table[("proxykv", r)]["all"] / table[("kvzip", r)]["all"] if table[("kvzip", r)]["all"] else
               float("nan") for r in ratios]
        lines.append("| ProxyKV / KVzip | " + " | ".join(f"{100 * x:.1f}%" for x in rel) + " |")
    lines += ["", "Per task (accuracy %, mean over the keep ratios above; full cache at 1.0):", "",
              "| method | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for m in methods:
        rows = [table[(m, 1.0)]] if m == "full" else [table[(m, r)] for r in ratios if (m, r) in table]
        lines.append(f"| {m} | " + " | ".join(f"{100 * _mean(row.get(t, float('nan')) for row in rows):.1f}"
                                               for t in tasks) + " |")
    fid = [r for r in records if "topk_recall" in r and r["method"] not in ("full", "kvzip")]
    if fid:
        lines += ["", "Oracle fidelity against KVzip (top-K recall / share of KVzip score mass kept):", "",
                  "| method | " + " | ".join(f"rho={r}" for r in ratios) + " |", "|---|" + "---|" * len(ratios)]
        for m in sorted({r["method"] for r in fid}):
            cells = []
            for ratio in ratios:
                rs = [r for r in fid if r["method"] == m and r["keep_ratio"] == ratio]
                cells.append(f"{_mean(r['topk_recall'] for r in rs):.3f} / {_mean(r['mass_recovery'] for r in rs):.3f}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if held_out:
        lines += held_out_section(records, held_out, ratios)
    return "\n".join(lines) + "\n"


def held_out_section(records: list[dict], held_out, ratios: list[float]) -> list[str]:
    """Markdown lines: accuracy and fidelity per method, split into trained and held-out task families."""
    from .tasks import TASK_FAMILIES, family_of

    bad = sorted(set(held_out) - set(TASK_FAMILIES))
    if bad:
        raise ValueError(f"unknown task families {bad}; choose from {', '.join(TASK_FAMILIES)}")
    missing = sorted(set(held_out) - {family_of(r["task"]) for r in records})
    if missing:
        logger.warning("held-out families %s have no records in this run", missing)
    name = f"held-out ({', '.join(held_out)})"
    splits = {"trained families": [r for r in records if family_of(r["task"]) not in held_out],
              name: [r for r in records if family_of(r["task"]) in held_out]}
    lines = ["", f"Held-out task families ({', '.join(held_out)}: not in the mapper's training data). Accuracy % "
             "(mean over tasks) / top-K recall / KVzip mass kept:", "",
             "| method | split | " + " | ".join(f"rho={r}" for r in ratios) + " |",
             "|---|---|" + "---|" * len(ratios)]
    methods = sorted({r["method"] for r in records if r["method"] != "full"})
    for m in methods:
        for split, rs in splits.items():
            if not rs:
                continue
            table = accuracy_table([r for r in rs if r["method"] == m])
            cells = []
            for ratio in ratios:
                acc = table.get((m, ratio), {}).get("all", float("nan"))
                fid = [r for r in rs if r["method"] == m and r["keep_ratio"] == ratio and "topk_recall" in r]
                cell = f"{100 * acc:.1f}"
                if fid and m != "kvzip":
                    recall, mass = _mean(r["topk_recall"] for r in fid), _mean(r["mass_recovery"] for r in fid)
                    cell += f" / {recall:.3f} / {mass:.3f}"
                cells.append(cell)
            lines.append(f"| {m} | {split} | " + " | ".join(cells) + " |")
    return lines


def plot(records: list[dict], path: str | Path) -> Path | None:
    """Accuracy vs keep ratio, one line per method; one panel for the mean and one per task."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no plot written (pip install matplotlib)")
        return None
    table = accuracy_table(records)
    tasks = ["all"] + sorted({r["task"] for r in records})
    methods = sorted({m for m, _ in table}, key=lambda m: (m != "full", m))
    cols = min(4, len(tasks))
    rows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for m in methods:
            if m == "full":
                ax.axhline(100 * table[("full", 1.0)].get(task, float("nan")), color="k", ls="--", label="full")
                continue
            pts = sorted((r, 100 * row.get(task, float("nan"))) for (mm, r), row in table.items() if mm == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_title("mean over tasks" if task == "all" else task)
        ax.set_xlabel("keep ratio")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-5, 105)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _replicates(records: list[dict], n_boot: int, seed: int):
    """``(columns, tasks' sample counts, point means (C,), bootstrap means (n_boot, C))`` of :func:`bootstrap`,
    one column per ``(method, keep_ratio)``."""
    import numpy as np

    columns = sorted({(r["method"], r["keep_ratio"]) for r in records})
    col = {c: i for i, c in enumerate(columns)}
    units: dict[str, dict[tuple, int]] = defaultdict(dict)
    for r in records:
        units[r["task"]].setdefault((r["context_length"], r["sample"]), len(units[r["task"]]))
    tasks = sorted(units)
    mats = {t: np.full((len(units[t]), len(columns)), np.nan) for t in tasks}
    for r in records:
        mats[r["task"]][units[r["task"]][(r["context_length"], r["sample"])], col[(r["method"], r["keep_ratio"])]] \
            = r["score"]
    rng = np.random.default_rng(seed)
    reps = np.zeros((n_boot, len(columns)))
    with warnings.catch_warnings():  # a method missing from a task gives NaN there, by design
        warnings.simplefilter("ignore", RuntimeWarning)
        point = np.nanmean(np.stack([np.nanmean(mats[t], 0) for t in tasks]), 0)  # (C,)
        for t in tasks:
            m = mats[t]
            idx = rng.integers(0, len(m), size=(n_boot, len(m)))
            reps += np.nanmean(m[idx], axis=1)  # (n_boot, C)
    reps /= len(tasks)
    return columns, {t: len(units[t]) for t in tasks}, point, reps


def bootstrap(records: list[dict], *, n_boot: int = 1000, seed: int = 0) -> dict:
    """Task-balanced mean accuracy per ``(method, keep_ratio)`` with a 95% bootstrap interval over samples.

    A replicate redraws, within each task, that task's samples with replacement (every method and ratio sees the
    same draw, so differences between methods are paired), then averages over samples and over tasks. Returns
    ``{"n": {task: samples}, "cells": {(method, ratio): (mean, lo, hi)}, "mean_over_ratios": {method: (mean, lo,
    hi)}, "proxykv_vs_kvzip": (ratio, lo, hi) or None}``; the last two use the keep ratios below 1.0 that both
    methods share (ProxyKV's mean accuracy over them divided by KVzip's).
    """
    import numpy as np

    columns, n, point, reps = _replicates(records, n_boot, seed)
    col = {c: i for i, c in enumerate(columns)}

    def interval(values: np.ndarray, at: float) -> tuple[float, float, float]:
        lo, hi = np.nanpercentile(values, [2.5, 97.5]) if np.isfinite(values).any() else (np.nan, np.nan)
        return float(at), float(lo), float(hi)

    cells = {c: interval(reps[:, i], point[i]) for c, i in col.items()}
    methods = sorted({m for m, _ in columns})
    shared = sorted({r for m, r in columns if r < 1.0})
    over = {}
    for m in methods:
        idx = [col[(m, r)] for r in shared if (m, r) in col]
        if idx and len(idx) == len(shared):
            over[m] = interval(reps[:, idx].mean(1), point[idx].mean())
    rel = None
    if "proxykv" in over and "kvzip" in over:
        p = [col[("proxykv", r)] for r in shared]
        k = [col[("kvzip", r)] for r in shared]
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = interval(reps[:, p].mean(1) / reps[:, k].mean(1), point[p].mean() / point[k].mean())
    return {"n": n, "cells": cells, "mean_over_ratios": over, "proxykv_vs_kvzip": rel}


def paired_difference(records: list[dict], a: str, b: str, *, n_boot: int = 1000, seed: int = 0
                      ) -> tuple[float, float, float]:
    """Method ``a``'s mean accuracy over the keep ratios below 1.0 that both share, minus method ``b``'s, in points,
    with its 95% interval over the same paired bootstrap draws as :func:`bootstrap`: ``(difference, lo, hi)``.

    Raises:
        ValueError: a method has no records, or the two share no keep ratio below 1.0.
    """
    import numpy as np

    columns, _, point, reps = _replicates(records, n_boot, seed)
    ratios = {m: {r for c, r in columns if c == m and r < 1.0} for m in (a, b)}
    shared = sorted(ratios[a] & ratios[b])
    if not shared:
        raise ValueError(f"methods {a!r} and {b!r} share no keep ratio below 1.0 in these records")
    ia = [columns.index((a, r)) for r in shared]
    ib = [columns.index((b, r)) for r in shared]
    diff = 100 * (reps[:, ia].mean(1) - reps[:, ib].mean(1))
    lo, hi = np.nanpercentile(diff, [2.5, 97.5])
    return float(100 * (point[ia].mean() - point[ib].mean())), float(lo), float(hi)


_ORDER = ("kvzip", "proxykv", "attn_novelty", "attn_max", "attn_sum", "proxy_novelty", "proxy_max", "proxy_sum",
          "snapkv", "streaming", "random", "kvzip_iam")
_NAMES = {"full": "full cache", "kvzip": "KVzip", "proxykv": "ProxyKV", "attn_max": "no mapper: max (`attn_max`)",
          "attn_sum": "no mapper: sum (`attn_sum`)",
          "attn_novelty": "no mapper: novelty (`attn_novelty`)",
          "proxy_novelty": "proxy, no mapper: novelty (`proxy_novelty`)",
          "proxy_max": "proxy, no mapper: max (`proxy_max`)", "proxy_sum": "proxy, no mapper: sum (`proxy_sum`)",
          "snapkv": "SnapKV", "streaming": "StreamingLLM", "random": "random", "kvzip_iam": "KVzip+IAM"}


def interval_tables(records: list[dict], split: str | None = None, n_boot: int = 1000) -> str:
    """Markdown, per context length: every method's accuracy % per keep ratio, its mean over the ratios with a 95%
    bootstrap interval and its share of KVzip's, ProxyKV / KVzip with its interval, and the accuracy per task."""
    lines = []
    for length in sorted({r["context_length"] for r in records}):
        rs = [r for r in records if r["context_length"] == length]
        b = bootstrap(rs, n_boot=n_boot)
        ratios = sorted({r for _, r in b["cells"] if r < 1.0})
        n = b["n"]
        pct = lambda c: f"{100 * c[0]:.1f}"  # noqa: E731
        span = lambda c: f"{100 * c[0]:.1f} [{100 * c[1]:.1f}, {100 * c[2]:.1f}]"  # noqa: E731
        fewest, most = min(n.values()), max(n.values())
        per_task = f"{fewest}" if fewest == most else f"{fewest}-{most}"
        lines += ["", f"Split {split or 'custom'}, ~{length} tokens: {sum(n.values())} samples ({len(n)} "
                  f"task{'s' if len(n) > 1 else ''} x {per_task}); accuracy %, mean over the ratios with its 95% "
                  "bootstrap interval over samples", "",
                  "| method | " + " | ".join(f"rho={r}" for r in ratios) + " | mean [95% interval] | of KVzip |",
                  "|---|" + "---|" * (len(ratios) + 2)]
        if ("full", 1.0) in b["cells"]:
            lines.append("| full cache (rho=1) |" + " |" * len(ratios) + f" {span(b['cells'][('full', 1.0)])} | |")
        kvzip = b["mean_over_ratios"].get("kvzip", (float("nan"),))[0]
        methods = [m for m in _ORDER if m in b["mean_over_ratios"]]
        methods += sorted(set(b["mean_over_ratios"]) - set(methods))
        for m in methods:
            over = b["mean_over_ratios"][m]
            share = f"{100 * over[0] / kvzip:.0f}%" if m != "kvzip" and kvzip > 0 else ""  # NaN > 0 is False
            lines.append(f"| {_NAMES.get(m, m)} | " + " | ".join(pct(b["cells"][(m, r)]) for r in ratios)
                         + f" | {span(over)} | {share} |")
        if b["proxykv_vs_kvzip"] is not None:
            v = b["proxykv_vs_kvzip"]
            lines += ["", f"ProxyKV / KVzip: {100 * v[0]:.0f}% (95% interval {100 * v[1]:.0f}-{100 * v[2]:.0f}%)."]
        lines += full_answered_table(rs, methods, ratios)
        table = accuracy_table(rs)
        tasks = sorted({r["task"] for r in rs})
        lines += ["", "Per task (accuracy %, mean over the ratios; full cache at rho=1):", "",
                  "| method | " + " | ".join(f"`{t}`" for t in tasks) + " |", "|---|" + "---|" * len(tasks)]
        for m in ["full"] + methods:
            rows = [row for (mm, _), row in table.items() if mm == m]
            if rows:
                lines.append(f"| {_NAMES.get(m, m)} | " + " | ".join(
                    f"{100 * sum(row.get(t, 0.0) for row in rows) / len(rows):.1f}" for t in tasks) + " |")
    return "\n".join(lines) + "\n"


def _full_right(records: list[dict]) -> set[tuple]:
    return {(r["task"], r["context_length"], r["sample"]) for r in records if r["method"] == "full" and r["score"] >= 1}


def full_answered(records: list[dict]) -> list[dict]:
    """The records of the samples (task, length, sample) the full cache answers fully right (score 1), less the
    full cache's own: on these, a method's accuracy is the share of usable answers its compression keeps, free of
    the samples the model gets wrong with its whole cache (and of lucky answers there)."""
    right = _full_right(records)
    return [r for r in records if r["method"] != "full" and (r["task"], r["context_length"], r["sample"]) in right]


def paired_answered(records: list[dict], a: str, b: str, *, n_boot: int = 1000, seed: int = 0
                    ) -> dict[float, tuple[int, int, int, float, float, float]]:
    """Per keep ratio below 1.0 that both methods ran: over the samples the full cache answers fully right, how many
    method ``a`` and method ``b`` still answer fully right, and ``a``'s share minus ``b``'s in points with a 95%
    interval from redrawing those samples with replacement within each task (the same draw for both: paired).

    Returns:
        ``{ratio: (samples, a's count, b's count, difference, lo, hi)}``.

    Raises:
        ValueError: the full cache answers no sample fully right, or a method lacks a record on one of those samples
            at a ratio the other ran.
    """
    import numpy as np

    right = sorted(_full_right(records))
    if not right:
        raise ValueError("the full cache answers no sample fully right in these records")
    index = {k: i for i, k in enumerate(right)}
    ok: dict[tuple, bool] = {}
    for r in full_answered(records):
        if r["method"] in (a, b) and r["keep_ratio"] < 1.0:
            ok[(r["method"], r["keep_ratio"], index[(r["task"], r["context_length"], r["sample"])])] = r["score"] >= 1
    ratios = sorted({x for m, x, _ in ok if m == a} & {x for m, x, _ in ok if m == b})
    groups: dict[str, list[int]] = defaultdict(list)
    for i, (task, _, _) in enumerate(right):
        groups[task].append(i)
    rng = np.random.default_rng(seed)
    draws = np.concatenate([rng.choice(g, size=(n_boot, len(g))) for _, g in sorted(groups.items())], axis=1)
    out = {}
    for x in ratios:
        missing = [right[i] for m in (a, b) for i in range(len(right)) if (m, x, i) not in ok]
        if missing:
            raise ValueError(f"at keep ratio {x}, {a!r} or {b!r} has no record of (task, length, sample) {missing[0]}")
        va = np.array([ok[(a, x, i)] for i in range(len(right))], dtype=float)
        vb = np.array([ok[(b, x, i)] for i in range(len(right))], dtype=float)
        diff = 100 * (va[draws].mean(1) - vb[draws].mean(1))
        lo, hi = np.percentile(diff, [2.5, 97.5])
        out[x] = (len(right), int(va.sum()), int(vb.sum()), float(100 * (va.mean() - vb.mean())), float(lo), float(hi))
    return out


def full_answered_table(records: list[dict], methods: list[str], ratios: list[float]) -> list[str]:
    """Markdown lines: per method and keep ratio, how many of the samples the full cache answers fully right it
    still answers fully right (``"14/16"``); no lines when the records hold no full-cache run."""
    if not any(r["method"] == "full" for r in records):
        return []
    n = len(_full_right(records))
    run = {(r["method"], r["keep_ratio"]) for r in records}
    count = defaultdict(int)
    for r in full_answered(records):
        count[(r["method"], r["keep_ratio"])] += r["score"] >= 1
    lines = ["", f"On the {n} samples the full cache answers fully right: how many each method still answers fully "
             "right", "", "| method | " + " | ".join(f"rho={r}" for r in ratios) + " |",
             "|---|" + "---|" * len(ratios)]
    for m in methods:
        cells = [f"{count[(m, r)]}/{n}" if (m, r) in run else "" for r in ratios]
        lines.append(f"| {_NAMES.get(m, m)} | " + " | ".join(cells) + " |")
    return lines


def write_report(out_dir: str | Path, held_out: list[str] | tuple[str, ...] = ()) -> str:
    """Write ``results.md`` and ``accuracy.png`` next to ``results.jsonl``; return the markdown."""
    out = Path(out_dir)
    records = load_results(out)
    config = out / "config.json"
    split = json.loads(config.read_text())["config"].get("split") if config.exists() else None
    text = interval_tables(records, split) + "\n" + markdown(records, held_out)
    (out / "results.md").write_text(text)
    plot(records, out / "accuracy.png")
    return text
