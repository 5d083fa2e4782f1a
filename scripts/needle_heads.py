"""Where each method keeps a needle: per sample of a needle task, in how many (layer, KV head) pairs every token of
the answer's value survives the compression, and what share of the value's and of the 12 tokens before it (the key
phrase) is kept, per method, at one keep ratio. docs/results.md uses it to ask whether ProxyKV's misses on
plain-sentence needles are needles it dropped.

    python scripts/needle_heads.py --task needle:filler-dev --n-samples 100 --samples 19 29 43 \\
        --methods proxykv kvzip --keep-ratio 0.3 --out needle-heads.jsonl

One JSON record per sample and method (appended to ``--out``), and a table on stdout. The samples are those of
``proxykv eval --tasks TASK --seed SEED --n-samples N --context-lengths L`` (same generator, seed and count).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.cli_helpers import load, mapper_for
from proxykv_hf.compat import with_cache
from proxykv_hf.eval import tasks as task_lib
from proxykv_hf.eval.prompts import encode_sample, token_spans
from proxykv_hf.eval.report import open_records
from proxykv_hf.models import DEFAULT_MODEL
from proxykv_hf.scorers import registry

KEY_TOKENS = 12  # tokens before the value counted as its key phrase


def value_positions(ctx: list[int], value: str, tokenizer) -> list[int]:
    """Positions of the tokens that spell the last occurrence of ``value`` in the context ``ctx``."""
    spans = token_spans(tokenizer, ctx, value)
    if not spans:
        raise ValueError(f"the value {value!r} is not in the decoded context")
    return spans[-1]


@torch.no_grad()
def kept_shares(model, cache: ProxyKVCache, ids: torch.Tensor, value: list[int], key: list[int]) -> dict:
    """Compress ``ids`` with ``cache``; per (layer, KV head) the share of ``value`` and ``key`` positions kept."""
    cache.prepare(model, ids)
    model(input_ids=ids, **with_cache(cache), use_cache=True, logits_to_keep=1)
    layers = cache.compactable_layers()
    val = torch.zeros(len(layers), cache.layers[layers[0]].keys.shape[1])
    keyk = torch.zeros_like(val)
    for row, l in enumerate(layers):
        kept = cache.layers[l].kept_positions  # (B, H_kv, k), None where nothing was dropped
        for h in range(val.shape[1]):
            held = set(range(ids.shape[1])) if kept is None else set(kept[0, h].tolist())
            val[row, h] = sum(p in held for p in value) / len(value)
            keyk[row, h] = sum(p in held for p in key) / max(len(key), 1)
    return {"value_heads": int((val == 1).sum()), "heads": val.numel(), "value_kept": round(val.mean().item(), 4),
            "key_kept": round(keyk.mean().item(), 4), "value_heads_by_layer": (val == 1).sum(1).tolist()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", required=True, help="a needle task, e.g. needle:filler-dev")
    ap.add_argument("--n-samples", type=int, required=True, help="the eval run's --n-samples (fixes the samples)")
    ap.add_argument("--samples", type=int, nargs="+", required=True, help="sample indices to inspect")
    ap.add_argument("--seed", type=int, default=1000003, help="the eval run's --seed (the dev split's by default)")
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--methods", nargs="+", default=["proxykv", "kvzip"])
    ap.add_argument("--keep-ratio", type=float, default=0.3)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="target (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (smoke test)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mapper", default=None, help="ProxyKV checkpoint (default: the bundled one)")
    ap.add_argument("--layer-mix", type=float, default=None,
                    help="ProxyKV's layer_mix (default: the checkpoint's)")
    ap.add_argument("--out", type=Path, required=True,
                    help="JSONL file the records are appended to (.jsonl.gz: compressed)")
    ns = ap.parse_args(argv)
    model, tok = load(ns)
    samples = task_lib.generate(ns.task, ns.n_samples, ns.context_length, tok, ns.seed)
    bad = [i for i in ns.samples if not 0 <= i < len(samples)]
    if bad:
        raise SystemExit(f"samples {bad} are outside the {len(samples)} samples of {ns.task}")
    with tempfile.TemporaryDirectory() as tmp:
        context = registry.ScorerContext(model=model, tokenizer=tok, mapper=mapper_for(ns, model, tmp),
                                          layer_mix=ns.layer_mix)
        scorers = {m: registry.build(m, context) for m in ns.methods}
        print("| sample | value | method | heads keeping the whole value | value kept | key phrase kept |")
        print("|---|---|---|---|---|---|")
        with open_records(ns.out, "at") as log:
            for i in ns.samples:
                sample = samples[i]
                ctx, _ = encode_sample(sample, tok)
                value = value_positions(ctx, sample.answers[0], tok)
                key = list(range(max(0, value[0] - KEY_TOKENS), value[0]))
                ids = torch.tensor([ctx], device=model.device)
                for m, scorer in scorers.items():
                    cache = ProxyKVCache(None, 1.0) if scorer is None else ProxyKVCache(scorer.fresh(), ns.keep_ratio)
                    rec = {"task": ns.task, "context_length": ns.context_length, "sample": i, "seed": ns.seed,
                           "method": m, "keep_ratio": ns.keep_ratio, "answer": sample.answers[0],
                           "n_tokens": len(ctx), **kept_shares(model, cache, ids, value, key)}
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    print(f"| {i} | {sample.answers[0]} | {m} | {rec['value_heads']} of {rec['heads']} | "
                          f"{rec['value_kept']:.2f} | {rec['key_kept']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
