"""A scorer plug-in: ProxyKV's per-head ranks with a penalty that grows along the context (a dev-split experiment).

On the dev pass keys, ProxyKV loses mostly the keys stated in the first quarter of the context, where KVzip keeps
them (``scripts/depth_table.py``). This plug-in, meant to move budget toward the start, ranks each KV head's tokens
by ProxyKV's score (ranks scaled to [0, 1] over the real tokens, as in ``surprisal_blend.py``) and keeps the Top-K
of ``rank(ProxyKV) - weight * position``, the position scaled to [0, 1] over the real tokens: a token at the end
needs a rank ``weight`` higher than one at the start to be kept. At rho 0.1-0.3 it kept no more early keys
(docs/results.md, "Pass keys on dev at ~2k").

How to run me (dev split: a choice is made on it)::

    PYTHONPATH=scripts proxykv eval --plugin recency_calibration --split dev --methods proxykv_recency10 \\
        --context-lengths 2048 --n-samples 10 --max-new-tokens 40 --out-dir runs/dev-recency

``proxykv_recencyW`` penalises with weight ``W / 100``.
"""

from __future__ import annotations

import torch
from surprisal_blend import blend_builder, rank01

from proxykv_hf.scorers.proxy import ProxyScorer
from proxykv_hf.scorers.registry import register

WEIGHTS = (0.1,)


def position01(valid: torch.Tensor) -> torch.Tensor:
    """Each real token's place among a row's real tokens, scaled to [0, 1] (first 0, last 1); padding 0."""
    place = valid.long().cumsum(-1) - 1
    n = valid.sum(-1, keepdim=True)
    return (place.float() / (n - 1).clamp(min=1).float()).clamp(min=0) * valid


class RecencyCalibration(ProxyScorer):
    """ProxyKV (any checkpoint) whose per-head ranks are lowered in proportion to the token's place."""

    weight: float = 0.0

    def score(self, inputs) -> torch.Tensor:
        scores = super().score(inputs).float()
        valid = inputs.valid.to(scores.device)[:, None, :].expand_as(scores)
        return rank01(scores, valid) - self.weight * position01(valid)


def build(weight: float):
    return blend_builder(RecencyCalibration, weight, "recency calibration")


for _w in WEIGHTS:
    register(f"proxykv_recency{round(100 * _w)}", build(_w), f"ProxyKV ranks - {_w} x position", replace=True)
