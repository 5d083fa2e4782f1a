"""When each layer of a ProxyKV cache is scored during the first prefill.

The cache's ``update`` leaves a pending call for the attention wrapper (:mod:`proxykv_hf.attention.wrapper`); the
wrapper hands the layer's queries back here right after the layer's prefill attention. What happens then depends on the
scorer's kind (:mod:`proxykv_hf.scorers.base`):

* a :class:`LayerScorer` scores the layer at once, and the layer is compacted at once (its statistics, if it reads
  any, computed in the attention's own pass where that pays);
* a :class:`BackgroundScorer` that is not :meth:`~BackgroundScorer.ready` lets the layer wait uncompacted; the
  waiting layers are scored from their stored K/V once it is, at the latest after the last compacted layer;
* a :class:`ModelScorer` waits for the whole prefill, then scores every layer at once.

A prompt prefilled in chunks (``prefill_chunk_size``, or hand-written forwards after ``prepare``) is scored once its
last chunk is in; the statistics a layer scorer reads from the prompt's queries are gathered over every chunk
(:meth:`~proxykv_hf.scorers.base.LayerScorer.chunk_statistics`), so the kept set does not depend on the chunking.

The schedule talks to the layers, never to the cache: each layer's scores go to the prompt's
:class:`~proxykv_hf.cache.budget.PromptBudget`, where the layer keeps its top entries, and every step returns whether
the prompt is compressed now (the hand-off then tells the cache, which armed it).
"""

from __future__ import annotations

import torch

from ..attention.statistics import CHUNK_SIZE, causal_attention_with_statistics, fuses_with_attention
from ..scorers.base import BackgroundScorer, LayerInputs, LayerScorer, ModelScorer
from .budget import PromptBudget


class Schedule:
    """The scoring schedule of one prompt's first prefill.

    Args:
        scorer: the cache's scorer.
        budget: where each layer's scores go (it holds the cache's layers and which of them are compacted).
        prompt: the prompt being compressed.
        fused: whether statistics may come out of the attention's own pass
            (:class:`~proxykv_hf.attention.statistics.FusedStatistics`).
        owner: what a :class:`ModelScorer`'s ``score_all`` is handed with the prompt (the cache); the schedule itself
            never calls it.
    """

    def __init__(self, scorer, budget: PromptBudget, prompt, fused, owner):
        self.scorer, self.budget, self.prompt, self.fused, self.owner = scorer, budget, prompt, fused, owner
        self.layers, self.compactable = budget.layers, budget.compactable
        self.waiting: list[int] = []  # prefilled layers not compacted yet
        self.gathered: dict[int, torch.Tensor] = {}  # chunked prefill: each layer's statistics of earlier chunks

    def pending(self, layer_idx: int, on_done) -> "_Pending":
        """The hand-off for the prefill attention of ``layer_idx``; ``on_done()`` runs once the prompt is compressed."""
        return _Pending(self, layer_idx, on_done)

    def chunk(self, layer_idx: int) -> "_Chunk":
        """The hand-off for the attention of a prefill chunk that does not end the prompt."""
        return _Chunk(self, layer_idx)

    def gather(self, layer_idx: int, inputs: LayerInputs, scores_now: bool) -> torch.Tensor | None:
        """Add one chunk's query statistics to the layer's; return the total when the prompt is complete."""
        if not isinstance(self.scorer, LayerScorer):
            return None
        part = self.scorer.chunk_statistics(inputs)
        total = self.gathered.pop(layer_idx, None)
        if part is not None:
            total = part if total is None else self.scorer.merge_statistics(total, part, inputs.compact_index)
        if not scores_now and total is not None:
            self.gathered[layer_idx] = total
        return total

    def attend(self, layer_idx: int, query, key, value, scaling) -> tuple[torch.Tensor, bool] | None:
        """A plain causal prefill of a layer whose scorer reads statistics of its attention: the output and the
        statistics in one pass, then the layer is scored; returns the output and whether the prompt is compressed
        now, or None (the model's attention runs) where that does not pay."""
        wanted = self.scorer.statistics_for(self.compactable.index(layer_idx)) \
            if hasattr(self.scorer, "statistics_for") else ()
        if not wanted or not fuses_with_attention(query, self.fused):
            return None
        Q = query.shape[2]
        out, statistics = causal_attention_with_statistics(
            query, key, value, scaling, query_valid=self.prompt.valid[:, -Q:].to(query.device),
            chunk_size=getattr(self.scorer, "chunk_size", CHUNK_SIZE), statistics=wanted, fused=self.fused)
        return out, self.prefilled(layer_idx, query, key, value, None, scaling, statistics=statistics)

    def prefilled(self, layer_idx: int, query, key, value, attention_mask, scaling, *, statistics=None) -> bool:
        """Layer ``layer_idx`` has run its prefill attention: score and compact it now, or later. Returns whether the
        prompt is compressed now."""
        if statistics is None and query.shape[2] < self.prompt.length:  # the last chunk of a chunked prefill
            statistics = self.gather(layer_idx, self._inputs(layer_idx, scaling, query, key, value, attention_mask),
                                     scores_now=True)
        self.waiting.append(layer_idx)
        if isinstance(self.scorer, ModelScorer):
            return self.after_layer(layer_idx)
        last = layer_idx == self.compactable[-1]
        if isinstance(self.scorer, BackgroundScorer) and not self.scorer.ready() and not last:
            return False  # the scores are still being computed beside the prefill: compact this layer later
        waited, self.waiting = self.waiting[:-1], []
        for i in waited:  # layers prefilled before the scores were in: their K/V come from the layers
            self._scored(i, self.scorer.score(self._inputs(i, scaling)))
        inputs = self._inputs(layer_idx, scaling, query, key, value, attention_mask, statistics)
        return self._scored(layer_idx, self.scorer.score(inputs))

    def after_layer(self, layer_idx: int) -> bool:
        """A model scorer scores once every compacted layer is prefilled and ``layer_idx`` is the model's last
        layer (Gemma3 can end with sliding layers, whose K/V the scorer needs too). Returns whether the prompt is
        compressed now."""
        if not isinstance(self.scorer, ModelScorer) or layer_idx != len(self.layers) - 1 or \
                len(self.waiting) != len(self.compactable):
            return False
        scores = self.scorer.score_all(self.prompt, self.owner)
        if not isinstance(scores, dict):
            raise ValueError(f"{type(self.scorer).__name__}.score_all returned {type(scores).__name__}, expected a "
                             "dict {layer index: (B, H_kv, T) scores}")
        waited, self.waiting = self.waiting, []
        done = False
        for i in waited:
            done = self._scored(i, scores.get(i))
        return done

    def _inputs(self, layer_idx, scaling, query=None, key=None, value=None, attention_mask=None,
                statistics=None) -> LayerInputs:
        """The scorer's view of one layer; keys and values default to what the layer holds (a layer that waited)."""
        layer, T = self.layers[layer_idx], self.prompt.length
        key = layer.keys if key is None else key
        value = layer.values if value is None else value
        return LayerInputs(layer_idx=layer_idx, keys=key[:, :, :T], values=value[:, :, :T], queries=query,
                           attention_mask=attention_mask, scaling=scaling, prompt=self.prompt,
                           compact_index=self.compactable.index(layer_idx), statistics=statistics)

    def _scored(self, layer_idx: int, scores) -> bool:
        layer, T = self.layers[layer_idx], self.prompt.length
        want = (*layer.keys.shape[:2], T)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != want:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"{type(self.scorer).__name__} returned scores of shape {got} for layer {layer_idx}, "
                             f"expected {want} (batch, KV heads, prompt tokens)")
        return self.budget.scored(layer_idx, scores)


class _Pending:
    """Hand-off from ``update`` to the prefill attention of the same layer (see :mod:`proxykv_hf.attention.wrapper`):
    the schedule scores the layer, and ``on_done()`` (the cache's) runs once it says the prompt is compressed."""

    __slots__ = ("schedule", "layer_idx", "on_done")

    def __init__(self, schedule: Schedule, layer_idx: int, on_done):
        self.schedule, self.layer_idx, self.on_done = schedule, layer_idx, on_done

    def before(self, module, attention_mask, query, key):
        if getattr(module, "layer_idx", self.layer_idx) != self.layer_idx:
            raise RuntimeError(f"ProxyKV hand-off for layer {self.layer_idx} reached layer {module.layer_idx}")
        return attention_mask  # a layer not compacted yet has nothing to hide

    def attend(self, module, query, key, value, scaling):
        result = self.schedule.attend(self.layer_idx, query, key, value, scaling)
        if result is None:
            return None
        if result[1]:
            self.on_done()
        return result[0]

    def after(self, module, query, key, value, attention_mask, scaling):
        if self.schedule.prefilled(self.layer_idx, query, key, value, attention_mask, scaling):
            self.on_done()


class _Chunk:
    """Hand-off for the attention of a prefill chunk before the prompt's last: gathers its query statistics."""

    __slots__ = ("schedule", "layer_idx")

    def __init__(self, schedule: Schedule, layer_idx: int):
        self.schedule, self.layer_idx = schedule, layer_idx

    def before(self, module, attention_mask, query, key):
        return attention_mask

    def after(self, module, query, key, value, attention_mask, scaling):
        schedule = self.schedule
        schedule.gather(self.layer_idx, schedule._inputs(self.layer_idx, scaling, query, key, value, attention_mask),
                        scores_now=False)
