"""Time KVzip's scoring with another version of ``proxykv_hf/scorers/kvzip.py`` against the installed one, in one
process, and check that both keep the same K/V.

    git show 4aea182:proxykv_hf/scorers/kvzip.py > /tmp/kvzip_old.py
    OMP_NUM_THREADS=2 python examples/compare_kvzip_scorers.py /tmp/kvzip_old.py --tokens 4096

Runs ``kvzip_scores`` (prefill + reconstruction) on a ``niah_single_1`` prompt of SmolLM2 with the installed scorer,
the other file's ``_ChunkRecorder`` (the per-chunk scoring), then the installed one again, and prints the seconds of
each, the largest score difference and, per keep ratio, the share of the other scorer's kept entries that the
installed one keeps too (the eval harness's top-K recall).
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

from proxykv_hf.eval import tasks as task_lib
from proxykv_hf.scorers import kvzip
from proxykv_hf.eval.harness import fidelity


def load_other(path: str):
    """The module in ``path``, loaded beside the installed ``proxykv_hf.scorers.kvzip`` (its relative imports work)."""
    spec = importlib.util.spec_from_file_location("proxykv_hf.scorers._kvzip_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(model, tok, ids: torch.Tensor, other, keep_ratios=(0.1, 0.3)) -> dict:
    """Seconds of the installed / other / installed scorer on ``ids`` and how their kept sets agree."""
    installed, seconds, scores = kvzip._ChunkRecorder, {}, {}
    try:
        for name, cls in (("installed", installed), ("other", other._ChunkRecorder), ("installed again", installed)):
            kvzip._ChunkRecorder = cls
            t0 = time.perf_counter()
            scores[name] = kvzip.kvzip_scores(model, ids, tokenizer=tok)
            seconds[name] = time.perf_counter() - t0
    finally:
        kvzip._ChunkRecorder = installed
    a, b = scores["installed"], scores["other"]
    # the eval harness's top-K recall of the installed scorer's kept sets against the other's (4 sinks kept by both)
    layers, valid = dict(enumerate(a)), torch.ones(ids.shape, dtype=torch.bool)
    recall = {r: fidelity(layers, dict(enumerate(b)), valid, r, 4, 0, 4)["topk_recall"] for r in keep_ratios}
    return {"seconds": seconds, "max_abs_diff": float((a - b).abs().max()), "kept_agreement": recall}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("other", help="path of the other kvzip.py")
    p.add_argument("--tokens", type=int, default=4096, help="context length of the needle prompt")
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--keep-ratios", type=float, nargs="+", default=[0.1, 0.3])
    ns = p.parse_args(argv)
    from proxykv_hf.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer()
    sample = task_lib.generate("niah_single_1", 1, ns.tokens, tok, ns.seed)[0]
    ids = torch.tensor([task_lib.encode_sample(sample, tok)[0]])
    found = compare(model, tok, ids, load_other(ns.other), ns.keep_ratios)
    print(f"context: {ids.shape[1]} tokens, {torch.get_num_threads()} threads")
    for name, s in found["seconds"].items():
        print(f"{name:>16}: prefill + KVzip {s:.2f} s")
    print(f"largest score difference: {found['max_abs_diff']:.2e}")
    for r, share in found["kept_agreement"].items():
        print(f"keep ratio {r}: {share:.6f} of the kept entries kept by both")


if __name__ == "__main__":
    main()
