"""Our KVzip under a global budget vs kvpress's ``KVzipPress`` (global by default): per-head kept-set agreement and
accuracy on the same prompts.

kvpress runs in its own venv (it pins transformers < 5.3), so the comparison is three steps; the first and last run
in OUR venv, the middle one in kvpress's. How to run me (CPU, 2 busy cores: 2 prompts x 5 dev tasks at ~1k tokens
and 4 keep ratios took ~11 min on the kvpress side and ~5.5 min on ours, ``--threads 1``)::

    bash scripts/kvpress_env.sh                                         # once: .venv-kvpress/
    .venv/bin/python scripts/kvpress_compare.py export --n-per-task 2 --length 1024 \\
        --out runs/kvpress/prompts.jsonl                                # dev split tasks, encoded
    MODEL=$(.venv/bin/python -c "from proxykv_hf.models import bundled_model_dir; print(bundled_model_dir())")
    .venv-kvpress/bin/python scripts/kvpress_kept_sets.py --model "$MODEL" --prompts runs/kvpress/prompts.jsonl \\
        --keep-ratios 0.1 0.3 0.5 1.0 --max-new-tokens 32 --threads 1 --out runs/kvpress/kvpress.jsonl
    .venv/bin/python scripts/kvpress_compare.py compare --prompts runs/kvpress/prompts.jsonl \\
        --kvpress runs/kvpress/kvpress.jsonl --budget global --threads 1 --out runs/kvpress/compare_global.json \\
        --plot runs/kvpress/agreement_global.png

``compare`` recomputes OUR kept sets with ``ProxyKVCache(KVzipScorer(tok), keep_ratio, budget=...)`` on each prompt
and keep ratio of the kvpress file (the same model: the bundled SmolLM2 by default, fp32, sdpa), answers with
``answer_from_cache`` (greedy, the kvpress run's ``max_new_tokens``), and reports per keep ratio:

* ``jaccard``: mean over prompts and (layer, KV head) of ``|A & B| / |A | B|`` of the two kept position sets;
* ``jaccard_body``: the same on the positions after the chat-template prefix (KVzipPress gives the prefix tokens
  past its ``n_sink`` sinks score 0, so it drops them first; our KVzip scores every token);
* ``pooled``: ``sum |A & B| / sum |A | B|`` over all heads of a prompt, i.e. the Jaccard of the two sets of
  (layer, head, position) entries, which weighs big heads more;
* ``chance``: the mean per-head Jaccard two random sets of the same sizes would have;
* ``count_r`` / ``layer_r``: Pearson correlation of the kept counts per (layer, head) / per layer (None when one
  side's counts are constant, e.g. ``--budget uniform``);
* accuracy of both (RULER string match, :data:`proxykv_hf.eval.metrics.METRICS` with each prompt's metric) and time.

It prints a markdown table, writes the JSON summary (``--out``; per-record details beside it as ``*.records.jsonl``)
and, with ``--plot``, agreement and accuracy vs keep ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

Kept = Sequence[Sequence[Sequence[int]]]  # [layer][kv_head] -> kept prompt positions

# ---------------------------------------------------------------------------------------------------------------
# agreement arithmetic (pure Python: unit-tested in tests/test_kvpress_compare.py)


def jaccard(a: Sequence[int], b: Sequence[int]) -> float:
    """``|A & B| / |A | B|`` of two position sets; 1.0 when both are empty."""
    sa, sb = set(a), set(b)
    union = len(sa | sb)
    return 1.0 if union == 0 else len(sa & sb) / union


def chance_jaccard(n_a: int, n_b: int, n: int) -> float:
    """The Jaccard two independent uniformly random subsets of sizes ``n_a`` and ``n_b`` of ``n`` items have, with
    the expected intersection ``n_a * n_b / n`` (a ratio of expectations)."""
    if not (0 <= n_a <= n and 0 <= n_b <= n):
        raise ValueError(f"set sizes must be in [0, n={n}], got {n_a} and {n_b}")
    if n == 0 or n_a + n_b == 0:
        return 1.0
    inter = n_a * n_b / n
    return inter / (n_a + n_b - inter)


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson correlation of ``x`` and ``y``; None when either is constant (or shorter than 2)."""
    if len(x) != len(y):
        raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def agreement(ours: Kept, theirs: Kept, context_length: int, prefix_length: int = 0) -> dict:
    """Kept-set agreement of one prompt at one budget.

    Args:
        ours, theirs: kept positions ``[layer][kv_head]``, the same ``L`` and ``H_kv`` on both sides.
        context_length: ``T``, the number of prompt positions.
        prefix_length: positions ``< prefix_length`` are left out of ``jaccard_body``.

    Returns:
        ``{"jaccard", "jaccard_body", "pooled", "chance", "count_r", "layer_r", "kept_ours", "kept_theirs",
        "count_mad"}``: the first four as described in the module docstring, ``count_r``/``layer_r`` Pearson
        correlations of the counts per (layer, head) / per layer (None when constant), the total entries each
        side kept, and the mean absolute difference of the per-head counts, as a fraction of ``T``.
    """
    if len(ours) != len(theirs) or any(len(a) != len(b) for a, b in zip(ours, theirs)):
        raise ValueError(f"layer/head layouts differ: ours {[len(x) for x in ours]}, theirs "
                         f"{[len(x) for x in theirs]}")
    if not 0 <= prefix_length <= context_length:
        raise ValueError(f"prefix_length must be in [0, {context_length}], got {prefix_length}")
    jac, body, chance, inter, union = [], [], [], 0, 0
    counts_a, counts_b = [], []
    for layer_a, layer_b in zip(ours, theirs):
        for a, b in zip(layer_a, layer_b):
            sa, sb = set(a), set(b)
            if any(p < 0 or p >= context_length for p in sa | sb):
                raise ValueError(f"kept positions must be in [0, {context_length}), got {sorted(sa | sb)[-1]}")
            jac.append(jaccard(sa, sb))
            body.append(jaccard({p for p in sa if p >= prefix_length}, {p for p in sb if p >= prefix_length}))
            chance.append(chance_jaccard(len(sa), len(sb), context_length))
            inter += len(sa & sb)
            union += len(sa | sb)
            counts_a.append(len(sa))
            counts_b.append(len(sb))
    layers_a = [sum(len(set(h)) for h in layer) for layer in ours]
    layers_b = [sum(len(set(h)) for h in layer) for layer in theirs]
    n = len(jac)
    return {
        "jaccard": sum(jac) / n, "jaccard_body": sum(body) / n, "pooled": 1.0 if union == 0 else inter / union,
        "chance": sum(chance) / n, "count_r": pearson(counts_a, counts_b), "layer_r": pearson(layers_a, layers_b),
        "kept_ours": sum(counts_a), "kept_theirs": sum(counts_b),
        "count_mad": sum(abs(x - y) for x, y in zip(counts_a, counts_b)) / n / context_length,
    }


def _mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are not None (None if there are none)."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


SUMMARY_KEYS = ("jaccard", "jaccard_body", "pooled", "chance", "count_r", "layer_r", "count_mad", "acc_ours",
                "acc_kvpress", "s_ours", "s_kvpress")


def summarize(records: Sequence[dict]) -> list[dict]:
    """Per keep ratio, the means over prompts of the per-record fields named in :data:`SUMMARY_KEYS`.

    Args:
        records: dicts with ``keep_ratio`` and the :data:`SUMMARY_KEYS` (a None value is left out of its mean).

    Returns:
        one dict per keep ratio, ascending: ``{"keep_ratio", "n", <each key>: mean or None}``.
    """
    groups: dict[float, list[dict]] = defaultdict(list)
    for rec in records:
        groups[rec["keep_ratio"]].append(rec)
    out = []
    for ratio in sorted(groups):
        rows = groups[ratio]
        row = {"keep_ratio": ratio, "n": len(rows)}
        row.update({key: _mean([r.get(key) for r in rows]) for key in SUMMARY_KEYS})
        out.append(row)
    return out


def markdown_table(summary: Sequence[dict]) -> str:
    """The summary as a markdown table (accuracies in percent)."""
    head = ("| keep | n | Jaccard/head | Jaccard body | pooled | chance | count r | layer r | acc ours | "
            "acc kvpress | s/prompt ours | s/prompt kvpress |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(value, digits=3, scale=1.0):
        return "-" if value is None else f"{value * scale:.{digits}f}"

    for row in summary:
        lines.append(f"| {row['keep_ratio']:g} | {row['n']} | {f(row['jaccard'])} | {f(row['jaccard_body'])} | "
                     f"{f(row['pooled'])} | {f(row['chance'])} | {f(row['count_r'])} | {f(row['layer_r'])} | "
                     f"{f(row['acc_ours'], 1, 100)} | {f(row['acc_kvpress'], 1, 100)} | {f(row['s_ours'], 1)} | "
                     f"{f(row['s_kvpress'], 1)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# export: the dev split's prompts, encoded


@dataclass(kw_only=True)
class ExportConfig:
    out: str
    n_per_task: int = 2
    length: int = 1024
    tasks: tuple[str, ...] | None = None  # None: the dev split's
    seed: int | None = None  # None: the dev split's
    model: str | None = None  # tokenizer; None: the bundled default

    def __post_init__(self) -> None:
        if self.n_per_task < 1:
            raise ValueError(f"n_per_task must be >= 1, got {self.n_per_task}")
        if self.length < 64:
            raise ValueError(f"length must be >= 64 tokens, got {self.length}")


def export(cfg: ExportConfig) -> list[dict]:
    """Write the prompts JSONL that scripts/kvpress_kept_sets.py reads; returns its records."""
    from proxykv_hf.eval.splits import get_split
    from proxykv_hf.eval.tasks import encode_sample, generate
    from proxykv_hf.models import DEFAULT_MODEL, load_tokenizer

    split = get_split("dev")
    tasks = cfg.tasks or split.tasks
    seed = split.seed if cfg.seed is None else cfg.seed
    tok = load_tokenizer(cfg.model or DEFAULT_MODEL)
    records = []
    for task in tasks:
        for i, sample in enumerate(generate(task, cfg.n_per_task, cfg.length, tok, seed)):
            ctx, question = encode_sample(sample, tok)
            records.append({"id": f"{task}/{i}", "task": task, "metric": sample.metric, "answers": sample.answers,
                            "seed": seed, "length": cfg.length, "context_ids": ctx, "question_ids": question})
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    with open(cfg.out, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    print(f"wrote {len(records)} prompts ({', '.join(tasks)}; seed {seed}; ~{cfg.length} tokens) to {cfg.out}")
    return records


# ---------------------------------------------------------------------------------------------------------------
# compare: our kept sets on the same prompts


@dataclass(kw_only=True)
class CompareConfig:
    kvpress: str
    prompts: str
    out: str | None = None
    budget: str = "global"
    model: str | None = None  # None: the bundled default
    max_new_tokens: int | None = None  # None: the kvpress run's
    plot: str | None = None
    threads: int | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.budget not in ("global", "uniform"):
            raise ValueError(f"budget must be 'global' or 'uniform', got {self.budget!r}")


def kept_sets_of(cache) -> list[list[list[int]]]:
    """Kept prompt positions ``[layer][kv_head]`` of batch row 0, from ``cache.kept_sets()``
    (``{layer: [b][h] -> LongTensor}``)."""
    sets = cache.kept_sets()
    return [[sorted(t.tolist()) for t in sets[i][0]] for i in sorted(sets)]


def run_ours(model, tok, prompt: dict, keep_ratio: float, budget: str, max_new_tokens: int) -> dict:
    """Our KVzip kept sets and answer for one prompt and keep ratio."""
    import torch

    from proxykv_hf import KVzipScorer, ProxyKVCache
    from proxykv_hf.pipeline import answer_from_cache, compress_context

    ctx = torch.tensor([prompt["context_ids"]])  # (1, T)
    question = torch.tensor([prompt["question_ids"]])  # (1, Q)
    cache = ProxyKVCache(KVzipScorer(tok), keep_ratio=keep_ratio, budget=budget)
    t0 = time.perf_counter()
    compress_context(model, cache, ctx)
    t1 = time.perf_counter()
    kept = kept_sets_of(cache)
    ids = answer_from_cache(model, cache, ctx, question, max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=tok.pad_token_id)
    t2 = time.perf_counter()
    return {"kept": kept, "answer": tok.decode(ids[0], skip_special_tokens=True), "compress_s": t1 - t0,
            "answer_s": t2 - t1}


def score(prompt: dict, prediction: str) -> float:
    """RULER string match with the prompt's metric (``"all"`` unless the prompt says otherwise)."""
    from proxykv_hf.eval.metrics import METRICS

    return METRICS[prompt.get("metric", "all")](prediction, prompt["answers"])


def compare(cfg: CompareConfig) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from proxykv_hf.models import DEFAULT_MODEL, load_model_and_tokenizer

    hf_logging.disable_progress_bar()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    prompts = {p["id"]: p for p in map(json.loads, Path(cfg.prompts).read_text().splitlines())}
    theirs = [json.loads(line) for line in Path(cfg.kvpress).read_text().splitlines() if line.strip()]
    if cfg.limit:
        keep_ids = list(dict.fromkeys(r["id"] for r in theirs))[:cfg.limit]
        theirs = [r for r in theirs if r["id"] in keep_ids]
    missing = sorted({r["id"] for r in theirs} - set(prompts))
    if missing:
        raise ValueError(f"{len(missing)} kvpress records have no prompt in {cfg.prompts}: {missing[:5]}")
    model, tok = load_model_and_tokenizer(cfg.model or DEFAULT_MODEL)
    records = []
    for i, rec in enumerate(theirs):
        prompt = prompts[rec["id"]]
        if rec["context_length"] != len(prompt["context_ids"]):
            raise ValueError(f"prompt {rec['id']}: kvpress saw {rec['context_length']} context tokens, the prompts "
                             f"file has {len(prompt['context_ids'])}")
        max_new = cfg.max_new_tokens or rec.get("max_new_tokens", 32)
        ours = run_ours(model, tok, prompt, rec["keep_ratio"], cfg.budget, max_new)
        row = {"id": rec["id"], "task": prompt.get("task"), "keep_ratio": rec["keep_ratio"]}
        row.update(agreement(ours["kept"], rec["kept"], rec["context_length"], rec.get("prefix_length", 0)))
        row.update({
            "acc_ours": score(prompt, ours["answer"]), "acc_kvpress": score(prompt, rec["answer"]),
            "s_ours": ours["compress_s"] + ours["answer_s"], "s_kvpress": rec["compress_s"] + rec["answer_s"],
            "compress_s_ours": ours["compress_s"], "compress_s_kvpress": rec["compress_s"],
            "answer_ours": ours["answer"], "answer_kvpress": rec["answer"], "answers": prompt["answers"],
            "counts_ours": [[len(h) for h in layer] for layer in ours["kept"]], "counts_kvpress": rec["kept_counts"],
        })
        records.append(row)
        print(f"[{i + 1}/{len(theirs)}] {rec['id']} keep {rec['keep_ratio']:g}: jaccard {row['jaccard']:.3f} "
              f"(chance {row['chance']:.3f}) acc ours {row['acc_ours']:.2f} kvpress {row['acc_kvpress']:.2f} "
              f"({row['s_ours']:.1f}s) -> {ours['answer'][:50]!r}", flush=True)
    summary = summarize(records)
    table = markdown_table(summary)
    print(f"\nour KVzip (budget={cfg.budget}) vs kvpress KVzipPress (global), {len(set(r['id'] for r in records))} "
          f"prompts\n\n{table}")
    result = {"config": asdict(cfg), "kvpress_versions": theirs[0].get("versions") if theirs else None,
              "summary": summary, "table": table}
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(result, indent=1) + "\n")
        details = Path(cfg.out).with_suffix(".records.jsonl")
        details.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"wrote {cfg.out} and {details}")
    if cfg.plot:
        plot(summary, cfg.plot, cfg.budget)
    print(json.dumps({"summary": summary}))
    return result


def plot(summary: Sequence[dict], path: str, budget: str) -> None:
    """Agreement (left) and accuracy (right) vs keep ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [row["keep_ratio"] for row in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, style in (("jaccard", "per-head Jaccard", "o-"), ("jaccard_body", "per-head Jaccard, body", "s-"),
                              ("pooled", "pooled Jaccard", "^-"), ("chance", "chance (random sets)", "k:")):
        left.plot(x, [row[key] for row in summary], style, label=label)
    left.set(xlabel="keep ratio", ylabel="agreement", ylim=(0, 1), title=f"ours ({budget}) vs KVzipPress kept sets")
    left.legend()
    for key, label in (("acc_ours", f"our KVzip ({budget})"), ("acc_kvpress", "kvpress KVzipPress")):
        right.plot(x, [100 * row[key] for row in summary], "o-", label=label)
    right.set(xlabel="keep ratio", ylabel="accuracy (%)", ylim=(0, 105), title="accuracy")
    right.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write the prompts JSONL from the dev split's tasks")
    e.add_argument("--out", required=True)
    e.add_argument("--n-per-task", type=int, default=2)
    e.add_argument("--length", type=int, default=1024, help="context tokens per prompt (target)")
    e.add_argument("--tasks", nargs="+", default=None, help="default: the dev split's tasks")
    e.add_argument("--seed", type=int, default=None, help="default: the dev split's seed")
    e.add_argument("--model", default=None, help="tokenizer (default: the bundled SmolLM2)")
    c = sub.add_parser("compare", help="our kept sets on the kvpress run's prompts and ratios, and the agreement")
    c.add_argument("--kvpress", required=True, help="JSONL written by scripts/kvpress_kept_sets.py")
    c.add_argument("--prompts", required=True, help="the prompts JSONL it read")
    c.add_argument("--out", default=None, help="JSON summary (per-record details beside it)")
    c.add_argument("--budget", choices=["global", "uniform"], default="global", help="our side's budget")
    c.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    c.add_argument("--max-new-tokens", type=int, default=None, help="default: the kvpress run's")
    c.add_argument("--plot", default=None, help="PNG of agreement and accuracy vs keep ratio")
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    a = p.parse_args(argv)
    if a.command == "export":
        export(ExportConfig(out=a.out, n_per_task=a.n_per_task, length=a.length,
                            tasks=tuple(a.tasks) if a.tasks else None, seed=a.seed, model=a.model))
    else:
        compare(CompareConfig(kvpress=a.kvpress, prompts=a.prompts, out=a.out, budget=a.budget, model=a.model,
                              max_new_tokens=a.max_new_tokens, plot=a.plot, threads=a.threads, limit=a.limit))


if __name__ == "__main__":
    sys.exit(main())
