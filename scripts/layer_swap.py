"""Which target layers cost ProxyKV its answers: ProxyKV's kept sets with KVzip's scores swapped in for a range of
layers, and the share of the answer's tokens each method keeps per layer.

How to run me (dev split only: this is a tool for choosing, so never point it at the test split)::

    python scripts/layer_swap.py --tasks needle:filler-dev needle:readmes --n-samples 10 --keep-ratio 0.3 \\
        --groups 0-9 10-19 20-29 --out runs/layer-swap.jsonl

Per sample, one prefill scored by KVzip and one by ProxyKV (the bundled model and mapper unless ``--model`` /
``--mapper``), then one query-agnostic answer per variant at ``--keep-ratio``: ``proxykv`` (ProxyKV's scores in
every layer), ``kvzip`` (KVzip's everywhere) and ``kvzip@A-B`` (KVzip's in layers A..B, ProxyKV's elsewhere). If
``kvzip@A-B`` answers where ``proxykv`` does not, ProxyKV's choices in those layers lost the answer. The second
table: per layer, the share of (KV head, answer token) pairs each method keeps, over the samples whose answer
strings are found in the context. The third: per range of ``--groups``, the tokens that one method keeps in a head
and the other does not, by their median position (a share of the context) and their median count in the context
(how often the same token occurs), averaged over the heads. Records (one JSON line per sample) go to ``--out``; a
rerun appends. ``--samples`` picks samples by index among the first ``--n-samples`` of each task.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from proxykv_hf.eval import tasks as task_lib
from proxykv_hf.eval.methods import build_method, compacted_copy, record_scores
from proxykv_hf.eval.metrics import score_sample
from proxykv_hf.eval.prompts import encode_sample, token_spans
from proxykv_hf.eval.report import open_records
from proxykv_hf.eval.splits import split_of_task
from proxykv_hf.models import DEFAULT_MODEL, load_model_and_tokenizer
from proxykv_hf.pipeline import answer_from_cache
from proxykv_hf.scorers.registry import ScorerContext

DEV_SEED = 1_000_003


def answer_positions(tokenizer, ids: list[int], answers: list[str]) -> list[int]:
    """Positions of the tokens that overlap any occurrence of an answer string in the decoded context."""
    return sorted({j for answer in answers for span in token_spans(tokenizer, ids, answer) for j in span})


def parse_group(text: str, n_layers: int) -> list[int]:
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 0 <= lo <= hi < n_layers:
        raise SystemExit(f"--groups: {text!r} is not a layer range A-B within 0-{n_layers - 1}")
    return list(range(lo, hi + 1))


def top_mask(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """`(H_kv, T)` scores -> `(H_kv, T)` bool: each head's top ``keep`` positions."""
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(keep, -1).indices, True)


def kept_share(scores: dict[int, torch.Tensor], keep: int, positions: list[int]) -> list[float]:
    """Per layer, the share of (KV head, position) pairs of ``positions`` in each head's top ``keep``."""
    return [top_mask(scores[layer][0], keep)[:, positions].float().mean().item() for layer in sorted(scores)]


def exclusive_tokens(ids: list[int], kept_a: dict[int, torch.Tensor], kept_b: dict[int, torch.Tensor],
                     layers: list[int], keep: int) -> dict[str, list[float]]:
    """The tokens ``a`` keeps and ``b`` does not (``"a"``), and the other way round (``"b"``), in ``layers``:
    ``[median position / T, median count of the token in ids]`` averaged over the (layer, KV head) pairs where
    there are any. ``kept_a`` / ``kept_b``: dicts of scores (1, H_kv, T) per layer, ranked as the Top-``keep``."""
    t = len(ids)
    ids_t = torch.tensor(ids)
    count = (ids_t[:, None] == ids_t[None, :]).sum(1).float()
    position = torch.arange(t, dtype=torch.float32) / t
    tops = {name: {layer: top_mask(kept[layer][0], keep) for layer in layers}
            for name, kept in (("a", kept_a), ("b", kept_b))}
    out = {}
    for name, other in (("a", "b"), ("b", "a")):
        pos, cnt = [], []
        for layer in layers:
            for only in tops[name][layer] & ~tops[other][layer]:
                if only.any():
                    pos.append(position[only].median().item())
                    cnt.append(count[only].median().item())
        out[name] = [sum(pos) / len(pos), sum(cnt) / len(cnt)] if pos else [float("nan"), float("nan")]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["needle:filler-dev", "needle:readmes"])
    p.add_argument("--n-samples", type=int, default=10)
    p.add_argument("--samples", type=int, nargs="+", default=None,
                   help="sample indices among the first --n-samples of each task (default: all of them)")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--keep-ratio", type=float, default=0.3)
    p.add_argument("--groups", nargs="+", default=["0-9", "10-19", "20-29"], help="layer ranges A-B")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--mapper", default=None, help="mapper checkpoint (default: the bundled one)")
    p.add_argument("--layer-mix", type=float, default=None, help="ProxyKV's layer_mix (default: the checkpoint's)")
    p.add_argument("--out", default="runs/layer-swap.jsonl",
                   help="JSONL file the rows are appended to (.jsonl.gz: compressed)")
    ns = p.parse_args(argv)
    bad = [t for t in ns.tasks if split_of_task(t) != "dev"]
    if bad:
        raise SystemExit(f"layer_swap.py runs on the dev split only; not dev tasks: {bad}")
    from proxykv_hf.cli_helpers import BUNDLED_MAPPER

    model, tok = load_model_and_tokenizer(ns.model)
    options = ScorerContext(tokenizer=tok, mapper=ns.mapper or str(BUNDLED_MAPPER), seed=DEV_SEED,
                            layer_mix=ns.layer_mix)
    kvzip, proxykv = build_method("kvzip", model, options), build_method("proxykv", model, options)
    groups = {g: parse_group(g, model.config.num_hidden_layers) for g in ns.groups}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with open_records(out, "at") as log:
        for task in ns.tasks:
            for i, sample in enumerate(task_lib.generate(task, ns.n_samples, ns.context_length, tok, DEV_SEED)):
                if ns.samples is not None and i not in ns.samples:
                    continue
                ctx_ids, q_ids = encode_sample(sample, tok)
                ctx, q = torch.tensor([ctx_ids]), torch.tensor([q_ids])
                by_k, by_p = record_scores(model, kvzip, ctx), record_scores(model, proxykv, ctx)
                variants = {"proxykv": by_p.scores, "kvzip": by_k.scores}
                variants.update({f"kvzip@{g}": {l: (by_k if l in ls else by_p).scores[l] for l in by_p.scores}
                                 for g, ls in groups.items()})
                row = {"task": task, "sample": i, "keep_ratio": ns.keep_ratio, "scores": {}}
                if ns.mapper:
                    row["mapper"] = ns.mapper  # the bundled one where absent
                for name, scores in variants.items():
                    base = by_k if name == "kvzip" else by_p  # its own sinks and recent window, as in proxykv eval
                    cache = compacted_copy(base, ns.keep_ratio, scorer=base.scorer, scores=scores)
                    ids = answer_from_cache(model, cache, ctx, q, max_new_tokens=ns.max_new_tokens, do_sample=False,
                                            pad_token_id=tok.pad_token_id)
                    row["scores"][name] = score_sample(sample, tok.decode(ids[0], skip_special_tokens=True))
                keep = max(1, int(ns.keep_ratio * len(ctx_ids)))
                row["exclusive"] = {g: exclusive_tokens(ctx_ids, by_p.scores, by_k.scores, ls, keep)
                                    for g, ls in groups.items()}
                positions = answer_positions(tok, ctx_ids, sample.answers)
                if positions:
                    row["kept_answer_tokens"] = {"proxykv": kept_share(by_p.scores, keep, positions),
                                                 "kvzip": kept_share(by_k.scores, keep, positions)}
                log.write(json.dumps(row) + "\n")
                log.flush()
                rows.append(row)
                print(task, i, row["scores"], flush=True)
    names = list(rows[0]["scores"])
    print(f"\naccuracy % at keep ratio {ns.keep_ratio}, {len(rows)} samples")
    print("| " + " | ".join(names) + " |\n|" + "---|" * len(names))
    print("| " + " | ".join(f"{100 * sum(r['scores'][n] for r in rows) / len(rows):.1f}" for n in names) + " |")
    print(f"\ntokens one method keeps and the other does not: median position (share of the context) and median "
          f"count in the context, mean over heads and {len(rows)} samples")
    print("| layers | ProxyKV only: position | count | KVzip only: position | count |\n|---|---|---|---|---|")
    for g in groups:
        mean = [sum(r["exclusive"][g][m][j] for r in rows) / len(rows) for m in ("a", "b") for j in (0, 1)]
        print(f"| {g} | {mean[0]:.2f} | {mean[1]:.1f} | {mean[2]:.2f} | {mean[3]:.1f} |")
    found = [r for r in rows if "kept_answer_tokens" in r]
    if found:
        print(f"\nshare of the answer's tokens kept per layer ({len(found)} samples)\n| layer | ProxyKV | KVzip |\n|---|---|---|")
        for layer in range(len(found[0]["kept_answer_tokens"]["kvzip"])):
            mean = {m: sum(r["kept_answer_tokens"][m][layer] for r in found) / len(found) for m in ("proxykv", "kvzip")}
            print(f"| {layer} | {mean['proxykv']:.2f} | {mean['kvzip']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
