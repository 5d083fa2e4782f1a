"""Scores read straight off the prefill's own attention, with no learned mapper.

The self proxy's features (the target's own attention, per query head and key) used directly as scores: the
"no-mapper" baselines that show how much of ProxyKV's result the HybridAxialMapper itself contributes.
``"sum"`` is the attention each key receives summed over all prompt queries (H2O's accumulated attention, Zhang et
al., 2023, arXiv:2306.14048); ``"max"`` is the largest attention any other prompt query gives it; ``"lookback"``
scores a token by its novelty, one minus the largest attention it gives, as a query, to text well before it (a
token copied from earlier text scores low, one with nothing to copy from scores high).
"""

from __future__ import annotations

import torch

from .._fields import renamed_option
from ..scoring import CHUNK_SIZE, attention_sums, check_statistics
from ..selection import check_kernel_size, smooth_scores
from .base import LayerInputs, LayerScorer

GROUP_REDUCTIONS = ("max", "mean")


class AttentionStatisticScorer(LayerScorer):
    """One statistic of each layer's own prefill attention as the layer's scores.

    The statistic is taken per query head, then reduced over the query heads of each KV head (``group_reduce``;
    ``"max"`` as KVzip does) and optionally pooled along the keys (``kernel_size``, as SnapKV's).

    Args:
        statistic: ``"sum"``, ``"max"`` or ``"lookback"`` (see :func:`~proxykv_hf.scoring.attention_sums`;
            ``"lookback"`` scores ``1 - lookback``, the token's novelty).
        group_reduce: ``"max"`` or ``"mean"`` over the query heads of a KV head.
        kernel_size: lift each score to the mean of this many tokens around it where that is higher (odd; 1 = off);
            ``pool_kernel`` is its deprecated spelling.
        n_sink: first tokens always kept.
        chunk_size: queries per chunk when the statistic is not handed over by the cache.
    """

    def __init__(self, statistic: str = "max", *, group_reduce: str = "max", kernel_size: int = 1, n_sink: int = 4,
                 chunk_size: int = CHUNK_SIZE, pool_kernel: int | None = None):
        (self.statistic,) = check_statistics((statistic,))
        if group_reduce not in GROUP_REDUCTIONS:
            raise ValueError(f"group_reduce must be one of {GROUP_REDUCTIONS}, got {group_reduce!r}")
        if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"n_sink must be an int >= 0, got {n_sink!r}")
        self.group_reduce = group_reduce
        kernel_size = renamed_option(kernel_size, pool_kernel, "AttentionStatisticScorer", "pool_kernel", "kernel_size")
        self.kernel_size = check_kernel_size(kernel_size, "kernel_size")
        self.n_sink, self.chunk_size = n_sink, chunk_size
        self.statistics = (self.statistic,)

    @torch.no_grad()
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        x = inputs.statistics  # (B, H, T) when the cache computed it in the attention's own pass
        device = inputs.keys.device
        if x is None:
            x = attention_sums(inputs.queries, inputs.keys, inputs.attention_mask, inputs.scaling,
                               query_valid=inputs.query_valid.to(device),
                               chunk_size=self.chunk_size, statistics=self.statistics)
        B, H, T = x.shape
        H_kv = inputs.keys.shape[1]
        grouped = x.float().view(B, H_kv, H // H_kv, T)  # (B, H_kv, G, T)
        if self.statistic == "lookback":
            grouped = 1.0 - grouped  # novelty: higher = less copied from earlier text
        scores = grouped.amax(dim=2) if self.group_reduce == "max" else grouped.mean(dim=2)  # (B, H_kv, T)
        return smooth_scores(scores, inputs.valid.to(device), self.kernel_size, keep_peaks=True)
