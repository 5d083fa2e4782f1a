"""StreamingLLM: attention sinks plus the most recent tokens (Xiao et al., 2023, arXiv:2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import LayerInputs, LayerScorer


@dataclass(kw_only=True)
class StreamingLLMScorer(LayerScorer):
    """Keeps the first ``n_sink`` tokens and, for the rest of the budget, the most recent ones.

    Attributes:
        n_sink: attention-sink tokens always kept.
    """

    n_sink: int = 4

    def __post_init__(self):
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be an int >= 0, got {self.n_sink!r}")

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        B, H_kv, T, _ = inputs.keys.shape
        pos = inputs.valid.to(inputs.keys.device).float().cumsum(-1)  # (B, T) position among the real tokens
        return pos[:, None, :].expand(B, H_kv, T).clone()  # later = higher
