"""A scorer plug-in: ProxyKV's scores blended with each token's novelty (a dev-split experiment).

A token's novelty is one minus the largest attention it gives, as a query, to text well before it (the ``lookback``
statistic that the bundled mapper already reads; ``attn_novelty`` uses it alone as a score). Text that copies or
continues earlier text looks back; a value stated once (a number, a code, a name) does not. The statistic costs
nothing extra here: ProxyKV's self proxy computes it for each layer in the prefill's own attention pass. The blend
ranks each KV head's tokens by ProxyKV's score and by the layer's novelty (the largest over the head's query heads;
ranks scaled to [0, 1] over the real tokens, as in ``surprisal_blend.py``) and keeps the Top-K of
``rank(ProxyKV) + weight * rank(novelty)``.

How to run me (dev split: a choice is made on it)::

    PYTHONPATH=scripts proxykv eval --plugin novelty_blend --split dev \\
        --methods proxykv proxykv_novelty25 proxykv_novelty50 --context-lengths 2048 --n-samples 10 \\
        --max-new-tokens 40 --out-dir runs/dev-novelty

``proxykv_noveltyW`` blends with weight ``W / 100``.
"""

from __future__ import annotations

import torch
from surprisal_blend import blend_builder, rank01

from proxykv_hf.scorers.proxy import ProxyScorer
from proxykv_hf.scorers.registry import register

WEIGHTS = (0.25, 0.5, 1.0)


def novelty(statistics: torch.Tensor, names, n_kv_heads: int) -> torch.Tensor:
    """`(B, H_kv, T)`: one minus the ``"lookback"`` rows of statistic-major ``statistics`` `(B, S * H, T)` (``names``
    the ``S`` statistics in order), the largest over each KV head's query heads."""
    B, SH, T = statistics.shape
    H = SH // len(names)
    i = list(names).index("lookback")
    lookback = statistics[:, i * H:(i + 1) * H].float()
    return (1.0 - lookback).view(B, n_kv_heads, H // n_kv_heads, T).amax(2)


class NoveltyBlend(ProxyScorer):
    """ProxyKV with a self proxy that reads ``"lookback"``, its per-head scores blended with the layer's novelty."""

    weight: float = 0.0

    def __init__(self, checkpoint, **kwargs):
        super().__init__(checkpoint, **kwargs)
        if self.spec.kind != "self" or "lookback" not in self.spec.statistics:
            raise ValueError("the novelty blend needs a self-proxy checkpoint that reads the 'lookback' statistic")

    def score(self, inputs) -> torch.Tensor:
        scores = super().score(inputs).float()
        layer = self._proxy_of.get(inputs.compact_index)
        if layer is None or layer not in self._features:
            raise ValueError(f"layer {inputs.compact_index} has no proxy statistics to blend with")
        extra = novelty(self._features[layer].to(scores.device), self.spec.statistics, scores.shape[1])
        valid = inputs.valid.to(scores.device)[:, None, :].expand_as(scores)
        return rank01(scores, valid) + self.weight * rank01(extra, valid)


def build(weight: float):
    return blend_builder(NoveltyBlend, weight, "novelty")


for _w in WEIGHTS:
    register(f"proxykv_novelty{round(100 * _w)}", build(_w), f"ProxyKV + {_w} x novelty rank", replace=True)
