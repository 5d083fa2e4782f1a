"""When each layer of a ProxyKV cache is scored during the first prefill.

The cache's ``update`` leaves a pending call for the attention wrapper (:mod:`proxykv_hf.attention`); the wrapper
hands the layer's queries back here right after the layer's prefill attention. What happens then depends on the
scorer's kind (:mod:`proxykv_hf.scorers.base`):

* a :class:`LayerScorer` scores the layer at once, and the cache compacts it at once (its statistics, if it reads
  any, computed in the attention's own pass where that pays);
* a :class:`BackgroundScorer` that is not :meth:`~BackgroundScorer.ready` lets the layer wait uncompacted; the
  waiting layers are scored from their stored K/V once it is, at the latest after the last compacted layer;
* a :class:`ModelScorer` waits for the whole prefill, then scores every layer at once.

A prompt prefilled in chunks (``prefill_chunk_size``, or hand-written forwards after ``prepare``) is scored once its
last chunk is in; the statistics a layer scorer reads from the prompt's queries are gathered over every chunk
(:meth:`~proxykv_hf.scorers.base.LayerScorer.chunk_statistics`), so the kept set does not depend on the chunking.

Compaction itself is the cache's (:meth:`ProxyKVCache.select <proxykv_hf.cache.ProxyKVCache.select>`).
"""

from __future__ import annotations

import torch

from .scorers.base import BackgroundScorer, LayerInputs, LayerScorer, ModelScorer
from .scoring import CHUNK_SIZE, causal_attention_with_statistics, fuses_with_attention


class Schedule:
    """The scoring schedule of one cache's first prefill (``cache.prompt`` known, the cache compressing)."""

    def __init__(self, cache):
        self.cache, self.scorer = cache, cache.scorer
        self.waiting: list[int] = []  # prefilled layers not compacted yet
        self.gathered: dict[int, torch.Tensor] = {}  # chunked prefill: each layer's statistics of earlier chunks

    def pending(self, layer_idx: int) -> "_Pending":
        """The hand-off for the prefill attention of ``layer_idx``."""
        return _Pending(self, layer_idx)

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

    def attend(self, layer_idx: int, query, key, value, scaling) -> torch.Tensor | None:
        """A plain causal prefill of a layer whose scorer reads statistics of its attention: the output and the
        statistics in one pass, then the layer is scored; None (the model's attention runs) where that does not
        pay."""
        wanted = self.scorer.statistics_for(self.cache.compactable_layers().index(layer_idx)) \
            if hasattr(self.scorer, "statistics_for") else ()
        if not wanted or not fuses_with_attention(query, self.cache.fused):
            return None
        Q = query.shape[2]
        out, statistics = causal_attention_with_statistics(
            query, key, value, scaling, query_valid=self.cache.prompt.valid[:, -Q:].to(query.device),
            chunk_size=getattr(self.scorer, "chunk_size", CHUNK_SIZE), statistics=wanted, fused=self.cache.fused)
        self.prefilled(layer_idx, query, key, value, None, scaling, statistics=statistics)
        return out

    def prefilled(self, layer_idx: int, query, key, value, attention_mask, scaling, *, statistics=None) -> None:
        """Layer ``layer_idx`` has run its prefill attention: score and compact it now, or later."""
        if statistics is None and query.shape[2] < self.cache.prompt.length:  # the last chunk of a chunked prefill
            statistics = self.gather(layer_idx, self._inputs(layer_idx, scaling, query, key, value, attention_mask),
                                     scores_now=True)
        self.waiting.append(layer_idx)
        if isinstance(self.scorer, ModelScorer):
            self.after_layer(layer_idx)
            return
        last = layer_idx == self.cache.compactable_layers()[-1]
        if isinstance(self.scorer, BackgroundScorer) and not self.scorer.ready() and not last:
            return  # the scores are still being computed beside the prefill: compact this layer later
        waited, self.waiting = self.waiting[:-1], []
        for i in waited:  # layers prefilled before the scores were in: their K/V come from the cache
            self._compact(i, self.scorer.score(self._inputs(i, scaling)))
        inputs = self._inputs(layer_idx, scaling, query, key, value, attention_mask, statistics)
        self._compact(layer_idx, self.scorer.score(inputs))

    def after_layer(self, layer_idx: int) -> None:
        """A model scorer scores once every compacted layer is prefilled and ``layer_idx`` is the model's last
        layer (Gemma3 can end with sliding layers, whose K/V the scorer needs too)."""
        cache = self.cache
        if not isinstance(self.scorer, ModelScorer) or layer_idx != len(cache.layers) - 1 or \
                len(self.waiting) != len(cache.compactable_layers()):
            return
        scores = self.scorer.score_all(cache.prompt, cache)
        if not isinstance(scores, dict):
            raise ValueError(f"{type(self.scorer).__name__}.score_all returned {type(scores).__name__}, expected a "
                             "dict {layer index: (B, H_kv, T) scores}")
        waited, self.waiting = self.waiting, []
        for i in waited:
            self._compact(i, scores.get(i))

    def _inputs(self, layer_idx, scaling, query=None, key=None, value=None, attention_mask=None,
                statistics=None) -> LayerInputs:
        """The scorer's view of one layer; keys and values default to what the layer holds (a layer that waited)."""
        cache = self.cache
        layer, T = cache.layers[layer_idx], cache.prompt.length
        key = layer.keys if key is None else key
        value = layer.values if value is None else value
        return LayerInputs(layer_idx=layer_idx, keys=key[:, :, :T], values=value[:, :, :T], queries=query,
                           attention_mask=attention_mask, scaling=scaling, prompt=cache.prompt,
                           compact_index=cache.compactable_layers().index(layer_idx), statistics=statistics)

    def _compact(self, layer_idx: int, scores) -> None:
        layer, T = self.cache.layers[layer_idx], self.cache.prompt.length
        want = (*layer.keys.shape[:2], T)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != want:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"{type(self.scorer).__name__} returned scores of shape {got} for layer {layer_idx}, "
                             f"expected {want} (batch, KV heads, prompt tokens)")
        self.cache.select(layer_idx, scores)
        self.cache.finish_if_compressed()


class _Pending:
    """Hand-off from ``update`` to the prefill attention of the same layer (see :mod:`proxykv_hf.attention`)."""

    __slots__ = ("schedule", "layer_idx")

    def __init__(self, schedule: Schedule, layer_idx: int):
        self.schedule, self.layer_idx = schedule, layer_idx

    def before(self, module, attention_mask, query, key):
        if getattr(module, "layer_idx", self.layer_idx) != self.layer_idx:
            raise RuntimeError(f"ProxyKV hand-off for layer {self.layer_idx} reached layer {module.layer_idx}")
        return attention_mask  # a layer not compacted yet has nothing to hide

    def attend(self, module, query, key, value, scaling):
        return self.schedule.attend(self.layer_idx, query, key, value, scaling)

    def after(self, module, query, key, value, attention_mask, scaling):
        self.schedule.prefilled(self.layer_idx, query, key, value, attention_mask, scaling)


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
