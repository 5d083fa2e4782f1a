"""Which per-token reduction of the self proxy's attention singles out the needle? (a diagnostic, no training)

    python examples/needle_features.py --tasks niah_single_1 niah_single_2 niah_multikey_1 niah_multivalue \
        niah_multiquery --n-samples 2 --tokens 2048 --seed 555

The shipped mapper reads, per (layer, head, token), the attention a token receives summed over all queries
(the paper's feature). This script compares that sum with other reductions of the same attention matrix, by the
needle rank percentile of ``examples/needle_rank.py`` (0 = top, 0.5 = chance; the first 4 tokens, the protected
sinks, left out): "best head" takes the best of a layer's heads per sample, "head mean" the mean of the heads'
ranks; each then reports the best and the median of the 30 layers. Eager attention, all layers' probabilities held
at once (~4.5 GB at 2k tokens).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_proxies import needle_positions  # noqa: E402
from needle_rank import needle_rank  # noqa: E402

from proxykv_hf.eval import tasks as task_lib  # noqa: E402
from proxykv_hf.models import load_model_and_tokenizer  # noqa: E402

N_SINK = 4


def reductions(attn: torch.Tensor) -> dict[str, torch.Tensor]:
    """``attn (H, N, N)`` (query, key) -> ``{name: (H, N)}`` per-key features."""
    n = attn.shape[-1]
    seen_by = torch.arange(n, 0, -1, dtype=attn.dtype)  # queries that can see each key
    off_diag = attn - torch.diag_embed(torch.diagonal(attn, dim1=-2, dim2=-1))
    far = torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-8)  # query at least 8 tokens after the key
    return {
        "sum over queries (shipped)": attn.sum(1),
        "sum / queries seeing it": attn.sum(1) / seen_by,
        "max over other queries": off_diag.amax(1),
        "max over queries >= 8 later": attn.masked_fill(~far, 0).amax(1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["niah_single_1"])
    p.add_argument("--n-samples", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=555)
    ns = p.parse_args(argv)
    model, tok = load_model_and_tokenizer()
    model.config._attn_implementation = "eager"
    items: dict[str, list[dict]] = {}  # per reduction, needle_rank's items: {"x": (L, H, N), "pos"}
    for task in ns.tasks:
        for sample in task_lib.generate(task, ns.n_samples, ns.tokens, tok, ns.seed):
            ids, pos = needle_positions(sample, tok)
            with torch.no_grad():
                attentions = model(input_ids=ids, output_attentions=True).attentions
            per_layer = [reductions(a[0].float()) for a in attentions]
            for name in per_layer[0]:
                x = torch.stack([f[name] for f in per_layer])  # (L, H, N)
                x[..., :N_SINK] = -1.0
                items.setdefault(name, []).append({"x": x, "pos": pos})
            del attentions, per_layer
    print(f"{', '.join(ns.tasks)}: {ns.n_samples} samples each, ~{ns.tokens} tokens, seed {ns.seed}")
    print("| reduction | best head: best layer | best head: median layer | head mean: best layer | head mean: median layer |")
    print("|---|---|---|---|---|")
    for name, its in items.items():
        figures = [*needle_rank(lambda x: x, its, best_head=True), *needle_rank(lambda x: x, its, best_head=False)]
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in figures) + " |")


if __name__ == "__main__":
    main()
