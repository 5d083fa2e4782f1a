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

from ..cache import ProxyKVCache, global_keep
from ..layer import ProxyKVLayer
from ..scorers import registry
from ..scorers.registry import ScorerContext
from ..selection import select_topk

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
    new = ProxyKVCache(None, keep_ratio, n_sink=recorded.n_sink, n_recent=recorded.n_recent, budget=budget)
    new.layer_class_to_replicate = None
    new.layers = []
    valid = recorded.prompt.valid
    keep = {}
    if budget == "global" and recorded.scores:
        keep = global_keep(recorded.scorer, recorded.scores, valid, keep_ratio, recorded.n_sink, recorded.n_recent)
    for i, layer in enumerate(recorded.layers):
        if not isinstance(layer, ProxyKVLayer):
            new.layers.append(copy.copy(layer))
            continue
        twin = ProxyKVLayer()
        twin.__dict__.update(vars(layer))
        if i in keep:
            twin.compact_ragged(keep[i])
        elif i in recorded.scores:
            scores = recorded.scores[i]
            indices, slot_valid = select_topk(scores, keep_ratio, valid.to(scores.device), recorded.n_sink,
                                              recorded.n_recent)
            twin.compact(indices, slot_valid=None if bool(slot_valid.all()) else slot_valid)
        new.layers.append(twin)
    new.prompt = recorded.prompt
    return new
