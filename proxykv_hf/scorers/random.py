"""Random eviction, the floor every method must beat."""

from __future__ import annotations

import torch

from .base import LayerInputs, LayerScorer


class RandomScorer(LayerScorer):
    """Independent uniform scores per (row, KV head, token), reproducible from ``seed`` and the layer index.

    A row's scores depend only on its number of real tokens, not on the padding around it (a padded row scores as
    it would alone).

    Args:
        seed: base seed; layer ``l`` uses ``seed + l``.
    """

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        B, H_kv, T, _ = inputs.keys.shape
        scores = torch.zeros(B, H_kv, T)
        for b, n in enumerate(inputs.valid.sum(-1).tolist()):
            gen = torch.Generator().manual_seed(self.seed + inputs.layer_idx)
            scores[b, :, T - n:] = torch.rand(H_kv, n, generator=gen)  # left padding: the real tokens come last
        return scores.to(inputs.keys.device)
