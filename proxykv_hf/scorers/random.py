"""Random eviction, the floor every method must beat."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from .base import LayerInputs, LayerScorer


@dataclass(kw_only=True)
class RandomScorer(LayerScorer):
    """Independent uniform scores per (row, KV head, token), reproducible from ``seed`` and the layer index.

    A row's scores depend only on its number of real tokens, not on the padding around it (a padded row scores as
    it would alone).

    Attributes:
        seed: base seed; layer ``l`` uses ``seed + l``.
    """

    seed: int = field(default=0, kw_only=False)

    def __post_init__(self):
        try:
            if isinstance(self.seed, bool):
                raise TypeError
            self.seed = operator.index(self.seed)  # a numpy integer too
        except TypeError:
            raise ValueError(f"seed must be an int, got {self.seed!r}") from None

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        B, H_kv, T, _ = inputs.keys.shape
        scores = torch.zeros(B, H_kv, T)
        for b, n in enumerate(inputs.valid.sum(-1).tolist()):
            gen = torch.Generator().manual_seed(self.seed + inputs.layer_idx)
            scores[b, :, T - n:] = torch.rand(H_kv, n, generator=gen)  # left padding: the real tokens come last
        return scores.to(inputs.keys.device)
