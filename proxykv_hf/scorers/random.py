"""Random eviction, the floor every method must beat."""

from __future__ import annotations

import torch

from .base import LayerInputs, Scorer


class RandomScorer(Scorer):
    """Independent uniform scores per (row, KV head, token), reproducible from ``seed`` and the layer index.

    Args:
        seed: base seed; layer ``l`` uses ``seed + l``.
    """

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        B, H_kv, T, _ = inputs.keys.shape
        gen = torch.Generator().manual_seed(self.seed + inputs.layer_idx)
        return torch.rand(B, H_kv, T, generator=gen).to(inputs.keys.device)
