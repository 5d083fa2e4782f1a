"""Does KVzip keep every token of the needle? Keep rate of the answer's tokens, by their place in the answer.

    python examples/kvzip_needle_digits.py --task niah_single_2 --tokens 2048 --n-samples 6 --seed 100

For each sample: KVzip's raw scores (every layer and KV head), the context tokens that spell the first answer, and,
per keep ratio, the share of (layer, KV head) rows whose head-wise Top-K (with KVzip's sinks, as the cache selects)
keeps the answer's i-th token. Written to find out why KVzip's answers on SmolLM2 lose digits at low keep ratios
(docs/results.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_proxies import needle_positions  # noqa: E402

from proxykv_hf.eval import tasks as task_lib  # noqa: E402
from proxykv_hf.models import load_model_and_tokenizer  # noqa: E402
from proxykv_hf.scorers.kvzip import KVzipScorer, kvzip_scores  # noqa: E402
from proxykv_hf.selection import select_topk  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="niah_single_2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--n-samples", type=int, default=6)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    ns = p.parse_args(argv)
    model, tok = load_model_and_tokenizer()
    n_sink = KVzipScorer(tok).n_sink
    print("| sample | answer tokens | " + " | ".join(f"rho={r}: kept share per answer token" for r in ns.ratios)
          + " |")
    print("|---|---|" + "---|" * len(ns.ratios))
    for i, sample in enumerate(task_lib.generate(ns.task, ns.n_samples, ns.tokens, tok, ns.seed)):
        ids, pos = needle_positions(sample, tok)
        with torch.no_grad():
            scores = kvzip_scores(model, ids, tokenizer=tok)[:, 0]  # (L, H_kv, N)
        L, H, N = scores.shape
        cells = []
        for ratio in ns.ratios:
            kept = torch.zeros(L, H, N, dtype=torch.bool)
            for layer in range(L):
                idx, _ = select_topk(scores[layer][None], ratio, n_sink=n_sink)
                kept[layer].scatter_(-1, idx[0], True)
            share = kept[:, :, pos].float().mean((0, 1))  # per answer token
            cells.append(" ".join(f"{v:.2f}" for v in share.tolist()))
        pieces = [tok.decode([t]) for t in ids[0, pos].tolist()]
        print(f"| {i} | {'·'.join(pieces)} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
