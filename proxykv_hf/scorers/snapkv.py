"""SnapKV: keys that the last prompt queries attend to (Li et al., 2024, arXiv:2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.statistics import attention_sums
from ..cache.selection import check_kernel_size, smooth_scores
from .base import LayerInputs, LayerScorer, merge_statistics


@dataclass(kw_only=True)
class SnapKVScorer(LayerScorer):
    """Attention of the last ``window`` prompt queries, summed over them, average-pooled along the keys and averaged
    over the query heads of each KV head. The observation window itself is always kept.

    Attributes:
        window: number of last prompt tokens whose queries vote (and which are always kept).
        kernel_size: width of the average pooling along the key axis (odd).
        chunk_size: queries per chunk in the attention accumulation.
        n_recent: the last tokens always kept: the window (set from ``window``).
    """

    window: int = 64
    kernel_size: int = 5
    chunk_size: int = 256
    n_recent: int = field(init=False)

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")
        self.kernel_size = check_kernel_size(self.kernel_size)
        self.n_recent = self.window

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        sums = inputs.statistics  # (B, H, T): gathered over the chunks of a chunked prefill
        if sums is None:
            sums = self.chunk_statistics(inputs)
        pooled = smooth_scores(sums, inputs.valid, self.kernel_size)  # (B, H, T)
        B, H, T = pooled.shape
        H_kv = inputs.keys.shape[1]
        return pooled.view(B, H_kv, H // H_kv, T).mean(dim=2)  # (B, H_kv, T)

    def chunk_statistics(self, inputs: LayerInputs) -> torch.Tensor | None:
        """Attention of the queries of ``inputs`` that lie in the prompt's last ``window`` positions, summed over
        them: `(B, H, T_c)` (None when the chunk holds none of them)."""
        end, Q = inputs.keys.shape[2], inputs.queries.shape[2]
        first = max(inputs.prompt.length - self.window, end - Q)  # the window's part of this chunk: a suffix
        if first >= end:
            return None
        w = end - first
        q = inputs.queries[:, :, -w:]  # (B, H, w, D)
        mask = None if inputs.attention_mask is None else inputs.attention_mask[:, :, -w:]
        query_valid = inputs.prompt.valid[:, first:end].to(q.device)
        return attention_sums(q, inputs.keys, mask, inputs.scaling, query_valid=query_valid,
                              chunk_size=self.chunk_size, group_reduce="none")  # (B, H, T_c)

    def merge_statistics(self, total: torch.Tensor, part: torch.Tensor, compact_index: int) -> torch.Tensor:
        return merge_statistics(total, part, ("sum",))

    def global_scores(self, scores: dict[int, torch.Tensor], valid: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each layer's scores over their sum across the layer's heads and real tokens (per row): every layer
        brings the same attention mass, and within a layer heads compare as the attention they receive (kvpress's
        AdaKV compares SnapKV's scores across the heads of a layer unnormalised)."""
        out = {}
        for i, s in scores.items():
            s = s.float().masked_fill(~valid[:, None, :], 0.0)
            out[i] = s / s.sum((1, 2), keepdim=True).clamp_min(1e-12)
        return out
