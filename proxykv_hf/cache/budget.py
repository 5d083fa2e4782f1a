"""What the compacted layers of one prompt keep: :class:`PromptBudget`, where a layer's scores become kept entries.

The schedule (:mod:`.schedule`) decides when a layer is scored and hands its scores here (:meth:`PromptBudget.scored`,
the one seam between scores and kept entries). Under the uniform budget the layer keeps its own Top-K per KV head at
once (:meth:`ProxyKVLayer.keep <proxykv_hf.cache.layer.ProxyKVLayer.keep>`); under the global budget the scores of
every compacted layer are collected, and once the last is in, one selection over all layers and heads
(:func:`~proxykv_hf.cache.selection.global_keep`) tells each layer what it keeps
(:meth:`ProxyKVLayer.compact_ragged <proxykv_hf.cache.layer.ProxyKVLayer.compact_ragged>`).
"""

from __future__ import annotations

import torch

from .selection import BUDGETS, global_keep, keep_counts


class PromptBudget:
    """The budget of one prompt over a cache's compacted layers.

    Args:
        layers: the cache's layers (the list itself: the budget compacts them in place).
        compactable: indices of the layers it compacts (full attention), in order.
        valid: `(B, T)` True on the prompt's real tokens.
        keep_ratio, n_sink, n_recent: as for :func:`~proxykv_hf.cache.selection.select_topk`.
        kind: ``"uniform"`` or ``"global"`` (:data:`~proxykv_hf.cache.selection.BUDGETS`).
        scorer: the scorer whose scores it is given (the global budget asks it to make them comparable).
        rows: `(B,)` entries each row keeps per KV head (default: :func:`~proxykv_hf.cache.selection.keep_counts`).

    Attributes:
        rows: `(B,)` on the CPU, so that selecting never waits for the GPU.
    """

    def __init__(self, layers: list, compactable: list[int], valid: torch.Tensor, keep_ratio: float, *,
                 n_sink: int = 0, n_recent: int = 0, kind: str = "uniform", scorer=None,
                 rows: torch.Tensor | None = None):
        if kind not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS}, got {kind!r}")
        self.layers, self.compactable, self.valid = layers, list(compactable), valid
        self.keep_ratio, self.n_sink, self.n_recent, self.kind, self.scorer = keep_ratio, n_sink, n_recent, kind, scorer
        self.rows = (keep_counts(valid.sum(-1), keep_ratio, n_sink + n_recent) if rows is None else rows).cpu()
        self._scored: dict[int, torch.Tensor] = {}  # global: each layer's scores until every layer's are in

    def keeps_everything(self, length: int) -> bool:
        """Whether every row keeps its whole prompt of ``length`` tokens."""
        return int(self.rows.max()) >= length

    def scored(self, layer_idx: int, scores: torch.Tensor) -> bool:
        """The scores `(B, H_kv, T)` of layer ``layer_idx`` are in: the layer keeps its top entries under them (under
        the global budget: every layer keeps its share once the last layer's scores are in).

        Returns:
            whether every compacted layer is compacted now.
        """
        if self.kind == "global":
            self._scored[layer_idx] = scores
            if len(self._scored) == len(self.compactable):
                scored, self._scored = self._scored, {}
                for i, keep in global_keep(self.scorer, scored, self.valid, self.keep_ratio, self.n_sink,
                                           self.n_recent).items():
                    self.layers[i].compact_ragged(keep)
        else:
            self.layers[layer_idx].keep(scores, self.rows, self.valid, keep_ratio=self.keep_ratio,
                                        n_sink=self.n_sink, n_recent=self.n_recent)
        return self.done()

    def done(self) -> bool:
        """Whether every compacted layer is compacted."""
        return all(self.layers[i].compacted for i in self.compactable)
