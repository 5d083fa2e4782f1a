"""ProxyKV with the self proxy's statistics fused into the attention (one softmax) against sdpa followed by the
statistics (two), in one process: seconds, score differences, kept sets and answers.

    OMP_NUM_THREADS=1 python examples/compare_fused_statistics.py --tokens 4096

For each task's first sample (seed ``--seed``), the context is compressed twice per setting of
``proxykv_hf.scoring.FUSE_WITH_ATTENTION`` (off, on, off, on) with the bundled mapper (or ``--mapper``); printed per
prompt: the seconds of each compression, the largest difference between the two settings' scores, the share of the
unfused kept entries that the fused run keeps too per keep ratio (the eval harness's top-K recall), and whether the
greedy answers are the same.
"""

from __future__ import annotations

import argparse
import time

import torch

from proxykv_hf import scoring
from proxykv_hf.cache import ProxyKVCache
from proxykv_hf.eval import tasks as task_lib
from proxykv_hf.eval.harness import fidelity
from proxykv_hf.pipeline import answer_from_cache, compress_context

SETTINGS = (False, True, False, True)


def compare(model, ctx: torch.Tensor, q: torch.Tensor, mapper: str, keep_ratios=(0.1, 0.3), *,
            max_new_tokens: int = 24) -> dict:
    """Seconds per setting (in :data:`SETTINGS` order), score difference, kept-set recall and answers."""
    seconds, scores, answers = {False: [], True: []}, {}, {}
    saved = scoring.FUSE_WITH_ATTENTION
    try:
        for fuse in SETTINGS:
            scoring.FUSE_WITH_ATTENTION = fuse
            # score every layer and keep everything: the kept sets of any keep ratio from one prefill
            cache = ProxyKVCache.from_pretrained(mapper, keep_ratio=keep_ratios[-1], record_only=True)
            t0 = time.perf_counter()
            with torch.no_grad():
                compress_context(model, cache, ctx)
            seconds[fuse].append(time.perf_counter() - t0)
            scores[fuse] = dict(cache.scores)
            answers[fuse] = answer_from_cache(model, cache.compacted_copy(keep_ratios[-1]), ctx, q,
                                              max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
    finally:
        scoring.FUSE_WITH_ATTENTION = saved
    valid = torch.ones(ctx.shape, dtype=torch.bool)
    diff = max(float((scores[True][i] - scores[False][i]).abs().max()) for i in scores[False])
    recall = {r: fidelity(scores[True], scores[False], valid, r, 4, 0, 4)["topk_recall"] for r in keep_ratios}
    return {"seconds": seconds, "max_abs_diff": diff, "kept_recall": recall,
            "same_answer": answers[True] == answers[False]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="context length of each prompt")
    p.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_multikey_1", "qa"])
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--mapper", default=None, help="mapper checkpoint (default: the bundled one)")
    p.add_argument("--keep-ratios", type=float, nargs="+", default=[0.1, 0.3])
    ns = p.parse_args(argv)
    from proxykv_hf.cli import BUNDLED_MAPPER
    from proxykv_hf.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer()
    for task in ns.tasks:
        sample = task_lib.generate(task, 1, ns.tokens, tok, ns.seed)[0]
        ctx_ids, q_ids = task_lib.encode_sample(sample, tok)
        ctx, q = torch.tensor([ctx_ids]), torch.tensor([q_ids])
        r = compare(model, ctx, q, ns.mapper or str(BUNDLED_MAPPER), tuple(ns.keep_ratios))
        secs = " ".join(f"{'fused' if f else 'sdpa+stats'} {s:.2f}" for f, s in
                        zip(SETTINGS, [r["seconds"][f][i // 2] for i, f in enumerate(SETTINGS)]))
        kept = ", ".join(f"rho {k}: {v:.4f}" for k, v in r["kept_recall"].items())
        print(f"{task} ({ctx.shape[1]} tokens): {secs} s; max |score diff| {r['max_abs_diff']:.2e}; kept recall "
              f"{kept}; same answer: {r['same_answer']}", flush=True)


if __name__ == "__main__":
    main()
