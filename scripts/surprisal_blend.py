"""A scorer plug-in: ProxyKV's scores blended with each context token's surprisal (a dev-split experiment).

A token's surprisal is the model's negative log-probability of it given the tokens before it. It is high on what no
template predicts (numbers, codes, names), whatever the sentence around them says, so it is a format-free guess at
which tokens a later question may need. The blend ranks each KV head's tokens by ProxyKV's score and by surprisal
(ranks scaled to [0, 1] over the real tokens) and keeps the Top-K of ``rank(ProxyKV) + weight * rank(surprisal)``.
The surprisal comes from a second forward pass over the prompt with every position's logits, so this is for
measuring accuracy, not speed.

How to run me (dev split: a choice is made on it)::

    PYTHONPATH=scripts proxykv eval --plugin surprisal_blend --split dev \\
        --methods proxykv_surprisal25 proxykv_surprisal50 --context-lengths 2048 --n-samples 10 \\
        --max-new-tokens 40 --out-dir runs/dev-surprisal

``proxykv_surprisalW`` blends with weight ``W / 100``.
"""

from __future__ import annotations

import torch

from proxykv_hf.scorers.proxy import ProxyScorer
from proxykv_hf.scorers.registry import ScorerContext, register

WEIGHTS = (0.25, 0.5)


def rank01(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's ranks over its ``valid`` entries, scaled to [0, 1] (the lowest 0, the highest 1); invalid
    entries 0. ``scores`` and ``valid`` of one shape, rows along the last dimension."""
    order = scores.masked_fill(~valid, float("-inf")).argsort(-1).argsort(-1).float()
    n = valid.sum(-1, keepdim=True).float()
    return ((order - (scores.shape[-1] - n)) / (n - 1).clamp(min=1)).clamp(min=0) * valid


@torch.no_grad()
def surprisal(model, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`(B, T)` float32: ``-log p(token_t | tokens before t)`` under ``model`` for left-padded rows (``valid``: `(B,
    T)` bool, the real tokens); 0 at the first position, meaningless on padding."""
    mask = valid.long()
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                   use_cache=False).logits[:, :-1].float()
    nll = -torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(nll[:, :1]), nll], 1)


class SurprisalBlend(ProxyScorer):
    """ProxyKV (any checkpoint) whose per-head scores are blended with the prompt's surprisal."""

    weight: float = 0.0

    def prepare(self, prompt) -> None:
        super().prepare(prompt)
        self._surprisal = surprisal(prompt.model, prompt.input_ids, prompt.valid.to(prompt.input_ids.device))

    def score(self, inputs) -> torch.Tensor:
        scores = super().score(inputs).float()
        valid = inputs.valid.to(scores.device)[:, None, :].expand_as(scores)
        extra = self._surprisal.to(scores.device)[:, None, :].expand_as(scores)
        return rank01(scores, valid) + self.weight * rank01(extra, valid)


def blend_builder(cls, weight: float, what: str):
    """A registry builder of the ProxyKV blend ``cls`` (a :class:`ProxyScorer` with a ``weight``) at ``weight``;
    ``what`` names the blend in the error for a missing mapper."""
    def build_blend(ctx: ScorerContext) -> ProxyScorer:
        if ctx.mapper is None:
            raise ValueError(f"the {what} blend needs a mapper checkpoint (--mapper)")
        scorer = cls.from_pretrained(ctx.mapper, pool_kernel=ctx.pool_kernel, layer_mix=ctx.layer_mix)
        scorer.weight = weight
        return scorer

    return build_blend


def build(weight: float):
    return blend_builder(SurprisalBlend, weight, "surprisal")


for _w in WEIGHTS:
    register(f"proxykv_surprisal{round(100 * _w)}", build(_w), f"ProxyKV + {_w} x surprisal rank",
             replace=True)
