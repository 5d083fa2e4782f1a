"""Which proxy's attention sees the needle? A feature-level comparison of the `self` and `layers` proxies.

    python examples/compare_proxies.py --n-samples 4 --tokens 1024 --seed 100

For needle-in-a-haystack samples on the bundled SmolLM2-135M-Instruct, this finds the context tokens of the answer
and reports, for each source of per-token scores, how highly they rank (the percentile of their mean rank among
all context tokens; 0 = top, 0.5 = chance):

* ``self``: the target's own prefill attention sums (30 layers x 9 heads);
* ``layers``: attention sums of the layer-subset proxy, every 3rd decoder layer of the target run as a
  10-layer network on the same weights;
* ``kvzip``: the KVzip oracle the mapper is trained to imitate (30 layers x 3 KV heads);
* ``mapper``: the shipped mapper's scores from the self features (30 layers x 3 KV heads).

For the proxies' raw features the best head of each layer is taken (a mapper can pick heads); for KVzip and the
mapper, which score the 3 KV heads the cache selects on, the mean over heads. "best layer" is the most
needle-focused layer, "median layer" the typical one. A mapper can only recover from its features what they hold.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from proxykv_hf.eval import tasks as task_lib
from proxykv_hf.hub import BUNDLED_MAPPER, load_checkpoint
from proxykv_hf.models import load_model_and_tokenizer
from proxykv_hf.proxy import every_kth_layer, proxy_features
from proxykv_hf.scorers.kvzip import kvzip_scores


def rank_percentile(scores: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """``scores (..., N)`` -> ``(...)``: mean descending-rank percentile of ``positions`` (0 = the top)."""
    ranks = scores.argsort(-1, descending=True).argsort(-1).float() / scores.shape[-1]
    return ranks[..., positions].mean(-1)


def needle_positions(sample, tokenizer) -> tuple[torch.Tensor, list[int]]:
    """The context ids of ``sample`` and the indices of the tokens that spell its first answer."""
    text, _ = task_lib.prompt_texts(sample, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    start = text.find(sample.answers[0])
    end = start + len(sample.answers[0])
    positions = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
    return torch.tensor([enc["input_ids"]]), positions


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=100)
    ns = p.parse_args(argv)
    model, tok = load_model_and_tokenizer()
    ckpt = load_checkpoint(BUNDLED_MAPPER)
    mapper, heads, stats = ckpt.mapper, model.config.num_attention_heads, list(ckpt.proxy.statistics)
    if "sum" not in stats:
        raise SystemExit(f"the bundled mapper reads {stats}; this comparison needs the attention sums among them")
    rows_sum = slice(stats.index("sum") * heads, (stats.index("sum") + 1) * heads)  # statistic-major rows
    rows: dict[str, list[tuple[float, float]]] = {"self": [], "layers": [], "kvzip": [], "mapper": []}
    for sample in task_lib.generate(ns.task, ns.n_samples, ns.tokens, tok, ns.seed):
        ids, pos = needle_positions(sample, tok)
        features = proxy_features(model, ids, statistics=stats)[0]  # what the mapper reads
        sources = {
            "self": features[:, rows_sum],  # (30, 9, N): the attention sums
            "layers": proxy_features(model, ids, layers=every_kth_layer(model.config.num_hidden_layers, 3))[0],
            "kvzip": kvzip_scores(model, ids, tokenizer=tok)[:, 0],  # (30, 3, N)
        }
        with torch.no_grad():
            sources["mapper"] = mapper(features[None])[0]  # (30, 3, N)
        for name, scores in sources.items():
            per_head = rank_percentile(scores.float(), pos)  # (L, H)
            per_layer = per_head.min(-1).values if name in ("self", "layers") else per_head.mean(-1)  # (L,)
            rows[name].append((float(per_layer.min()), float(per_layer.median())))
    print(f"{ns.task}, {ns.n_samples} samples of ~{ns.tokens} tokens, seed {ns.seed}: rank percentile of the needle "
          "(0 = top, 0.5 = chance)")
    print(f"{'source':<8} {'best layer':>10} {'median layer':>12}")
    for name, vals in rows.items():
        best = statistics.mean(v[0] for v in vals)
        median = statistics.mean(v[1] for v in vals)
        print(f"{name:<8} {best:>10.3f} {median:>12.3f}")


if __name__ == "__main__":
    main()
