"""A scorer plug-in: ProxyKV's scores blended with the novelty an earlier layer of the self proxy reads (a dev-split
experiment).

A token's novelty is one minus the largest attention it gives, as a query, to text well before it (the ``lookback``
statistic the bundled mapper reads; ``attn_novelty`` scores with it alone). ``novelty_blend.py`` blends each layer
with its own novelty. Here each layer from a source layer on is blended with the source layer's novelty instead (the
largest over all its query heads): layers whose own attention does not mark a value stated once (a number, a code)
borrow the mark from a layer whose attention does. A layer only reads sources at or before it, so the live cache,
which scores and prunes each layer as the prefill reaches it, computes the same scores. Each KV head keeps the
Top-K of ``rank(ProxyKV) + weight * rank(novelty of the source layer)`` (ranks scaled to [0, 1] over the real
tokens); layers before the first source keep ProxyKV's scores.

The sources were picked on the train split: on 30 train pass-key texts (``passkey:filler-train``, seed 720000) and
one text of each other train task (seed 730000), layer 20's novelty ranks the key's tokens in its top 20 % most often
of the 30 layers, layer 4's next.

How to run me (dev split: a choice is made on it)::

    PYTHONPATH=scripts proxykv eval --plugin copy_novelty --tasks passkey:filler-dev2 --seed 1000003 \\
        --methods proxykv_nov20_30 proxykv_nov4_20_10 --keep-ratios 0.1 0.2 0.3 0.5 --context-lengths 2048 \\
        --n-samples 80 --max-new-tokens 40 --out-dir runs/dev-copy-novelty

``proxykv_nov20_W`` blends layers 20-29 with layer 20's novelty at weight ``W / 100``; ``proxykv_nov4_20_W``
blends layers 4-19 with layer 4's and layers 20-29 with layer 20's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from novelty_blend import novelty
from surprisal_blend import blend_builder, rank01

from proxykv_hf.scorers.proxy import ProxyScorer
from proxykv_hf.scorers.registry import ScorerContext, register

VARIANTS = {"nov20_30": ((20,), 0.3), "nov4_20_10": ((4, 20), 0.1), "nov4_20_20": ((4, 20), 0.2),
            "ret100": ((4, 20), 1.0), "ret200": ((4, 20), 2.0)}
# ``retN``: each KV head's weight is N / 100 times its retrieval mass (``scripts/retrieval_heads.py``), read from
# the JSON file named by the environment variable PROXYKV_RETRIEVAL (a list per layer of one value per KV head)
RETRIEVAL = os.environ.get("PROXYKV_RETRIEVAL")


class CopyNovelty(ProxyScorer):
    """ProxyKV with a self proxy that reads ``"lookback"``, each layer from the first of ``sources`` on blended with
    the novelty of the latest source at or before it."""

    sources: tuple[int, ...] = ()
    weight: float = 0.0
    per_head: torch.Tensor | None = None

    def __init__(self, checkpoint, **kwargs):
        super().__init__(checkpoint, **kwargs)
        if self.spec.kind != "self" or "lookback" not in self.spec.statistics:
            raise ValueError("the copy-novelty blend needs a self-proxy checkpoint that reads the 'lookback' statistic")
        self._novelty: dict[int, torch.Tensor] = {}

    def fresh(self) -> "CopyNovelty":
        new = super().fresh()  # a shallow copy: sources, weight and per_head come along
        new._novelty = {}
        return new

    def score(self, inputs) -> torch.Tensor:
        scores = super().score(inputs).float()
        layer = inputs.compact_index
        if layer == 0:
            self._novelty = {}
        if layer in self.sources:  # this layer's features are still held: the mapper just read them
            features = self._features[self._proxy_of[layer]].to(scores.device)
            self._novelty[layer] = novelty(features, self.spec.statistics, 1)  # (B, 1, T)
        held = [s for s in self.sources if s <= layer]
        if not held:
            return scores
        valid = inputs.valid.to(scores.device)[:, None, :]
        extra = rank01(self._novelty[held[-1]], valid).expand_as(scores)
        weight = self.weight
        if self.per_head is not None:  # (L, H_kv): this layer's weight per KV head
            weight = weight * self.per_head[layer].to(scores.device)[None, :, None]
        return rank01(scores, valid.expand_as(scores)) + weight * extra


def build(sources: tuple[int, ...], weight: float, per_head: bool = False):
    blend = blend_builder(CopyNovelty, weight, "copy-novelty")

    def build_blend(ctx: ScorerContext) -> CopyNovelty:
        scorer = blend(ctx)
        scorer.sources = sources
        if per_head:
            if not RETRIEVAL:
                raise ValueError("the retN blends read each KV head's retrieval mass from PROXYKV_RETRIEVAL")
            scorer.per_head = torch.tensor(json.loads(Path(RETRIEVAL).read_text()), dtype=torch.float32)
        return scorer

    return build_blend


for _name, (_sources, _weight) in VARIANTS.items():
    register(f"proxykv_{_name}", build(_sources, _weight, _name.startswith("ret")),
             f"ProxyKV + {_weight} x the novelty rank of layers {_sources}", replace=True)
