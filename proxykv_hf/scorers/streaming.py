"""StreamingLLM: attention sinks plus the most recent tokens (Xiao et al., 2023, arXiv:2309.17453)."""

from __future__ import annotations

import torch

from .base import LayerInputs, LayerScorer


class StreamingLLMScorer(LayerScorer):
    """Keeps the first ``n_sink`` tokens and, for the rest of the budget, the most recent ones.

    Args:
        n_sink: attention-sink tokens always kept.
    """

    def __init__(self, n_sink: int = 4):
        if n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {n_sink}")
        self.n_sink = n_sink

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        B, H_kv, T, _ = inputs.keys.shape
        pos = inputs.valid.to(inputs.keys.device).float().cumsum(-1)  # (B, T) position among the real tokens
        return pos[:, None, :].expand(B, H_kv, T).clone()  # later = higher
