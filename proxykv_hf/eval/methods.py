"""The methods the harness compares, by name (the scorer registry), and the one score recorder of ratio sweeps.

Scores depend only on the prompt, so one scoring pass serves every keep ratio of a sample: a
:class:`RecordingCache` prefills the context with the method's scorer on the same code path a user's cache runs,
keeps everything and records each layer's scores; :func:`compacted_copy` then builds, for any keep ratio, the cache
that a live :class:`~proxykv_hf.cache.ProxyKVCache` with that ratio would hold
(``tests/test_cache.py::test_compacted_copy_equals_a_live_cache``).
"""

from __future__ import annotations

import copy

import torch

from ..cache import ProxyKVCache
from ..layer import ProxyKVLayer
from ..scorers import registry
from ..scorers.registry import ScorerContext
from ..selection import keep_counts

METHODS = tuple(registry.names())
"""Method names registered when this module was imported (``registry.names()`` is the live list). ``attn_sum`` /
``attn_max`` / ``attn_novelty``: the self proxy's statistics (sum, max, lookback) used as scores with no mapper
(:class:`~proxykv_hf.scorers.statistic.AttentionStatisticScorer`; pooled only with ``pool_kernel``)."""

def build_method(name: str, model, options: ScorerContext):
    """The scorer of method ``name`` (None for the full cache), built by the registry for ``model``."""
    context = copy.copy(options)
    context.model = model
    return registry.build(name, context)


class RecordingCache(ProxyKVCache):
    """A cache that scores its prompt with ``scorer`` as a compressing cache would, keeps every entry, and records
    the scores.

    Attributes:
        scores: ``{layer_idx: (B, H_kv, T) float32}`` on the CPU, after the prefill.
    """

    def __init__(self, scorer, **kwargs):
        self.scores: dict[int, torch.Tensor] = {}
        super().__init__(scorer, 1.0, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.scores = {}

    def _keeps_everything(self) -> bool:
        return self.scorer is None  # score even though keep_ratio is 1

    def select(self, layer_idx: int, scores: torch.Tensor) -> None:
        self.scores[layer_idx] = scores.detach().float().cpu()
        self.layers[layer_idx].compact(None)


def compacted_copy(recorded: RecordingCache, keep_ratio: float, budget: str = "uniform") -> ProxyKVCache:
    """From a :class:`RecordingCache` after its prefill: a new cache holding what a cache with ``keep_ratio`` and
    ``budget`` would hold (same scores, same selection), sharing no mutable state with ``recorded``."""
    first = recorded.compactable_layers()
    if recorded.prompt is None or not first or not recorded.layers[first[0]].compacted:
        raise ValueError("compacted_copy() needs a RecordingCache whose prompt has been prefilled")
    new = ProxyKVCache(recorded.scorer, keep_ratio, n_sink=recorded.n_sink, n_recent=recorded.n_recent,
                       budget=budget)
    new.layer_class_to_replicate = None
    new.layers = []
    for layer in recorded.layers:
        twin = copy.copy(layer)
        if isinstance(layer, ProxyKVLayer):
            twin = ProxyKVLayer()
            twin.__dict__.update(vars(layer))
        new.layers.append(twin)
    new.prompt = recorded.prompt
    new._budgets = keep_counts(recorded.prompt.valid.sum(-1), keep_ratio, new.n_sink + new.n_recent).cpu()
    for i in sorted(recorded.scores):  # the live cache's own selection (uniform or global)
        new.select(i, recorded.scores[i])
    return new
