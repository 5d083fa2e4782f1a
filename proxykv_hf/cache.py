"""ProxyKVCache: a DynamicCache whose full-attention layers keep only the top-K entries per KV head after prefill.

The first prefill runs on the full K/V, so the first generated token is exact. Right after each full-attention
layer's prefill attention the layer (a :class:`~proxykv_hf.layer.ProxyKVLayer`) is compacted to
``K = ceil(keep_ratio * T_real)`` entries per KV head; the dropped entries are released. Later tokens (decode,
continuation prefills) are kept in full. When a layer is scored depends on the scorer's kind
(:mod:`proxykv_hf.scorers.base`). The cache learns its prompt from :meth:`ProxyKVCache.prepare` or, inside
``generate``, from the calling frames (:mod:`proxykv_hf.prompt`), and gets each layer's queries from the attention
wrapper (:mod:`proxykv_hf.attention`). Design: docs/design.md.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import attention
from .layer import ProxyKVLayer
from .prompt import SUPPORTED_FAMILIES, check_continuation, check_prompt, find_prompt, make_prompt
from .schedule import RaggedAttention, Schedule, SpareSlots
from .scorers.base import LayerScorer, ModelScorer, Prompt, Scorer
from .scoring import FusedStatistics
from .selection import BUDGETS, check_keep_ratio, keep_counts, select_global, select_topk

__all__ = ["ProxyKVCache", "ProxyKVLayer", "SUPPORTED_FAMILIES"]


class ProxyKVCache(DynamicCache):
    """A ``DynamicCache`` that compacts each full-attention layer to its top-K entries per KV head after prefill.

    Args:
        scorer: a :class:`~proxykv_hf.scorers.base.Scorer` (None keeps everything: a full cache).
        keep_ratio: fraction of each row's real prompt tokens kept per KV head, in (0, 1] (the paper's rho).
        n_sink: always keep the first ``n_sink`` real tokens.
        n_recent: always keep the last ``n_recent`` real tokens.
        config: the model config; lays out sliding / full layers up front. Optional: without it the layout is
            taken from the model at the first prefill.
        fuse_statistics: let a scorer's attention statistics come out of the layer's own attention pass where
            that pays (:class:`~proxykv_hf.scoring.FusedStatistics`); False runs the model's attention, then them.
        budget: ``"uniform"`` (every KV head of every layer keeps ``K``) or ``"global"`` (each row keeps the
            best ``L * H_kv * K`` entries of all compacted layers and heads together, at least
            ``ceil(0.2 * K)`` per head, stored without padding; :func:`~proxykv_hf.selection.select_global`). The
            global budget scores every layer before compacting any, so the prefill holds the full K/V of all layers.

    Example::

        cache = ProxyKVCache(SnapKVScorer(), keep_ratio=0.3)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

    A cache compresses once, on its first prefill. Calling ``generate`` again with the same cache continues the
    conversation (the new prompt must start with the old one); use :meth:`fresh` or :meth:`reset` for a new prompt.
    """

    def __init__(self, scorer: Scorer | None = None, keep_ratio: float = 1.0, *, n_sink: int = 0, n_recent: int = 0,
                 config=None, fuse_statistics: bool = True, budget: str = "uniform"):
        self.keep_ratio = check_keep_ratio(keep_ratio)
        if budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
        self.budget = budget
        for name, value in (("n_sink", n_sink), ("n_recent", n_recent)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if scorer is not None and not isinstance(scorer, (LayerScorer, ModelScorer)):
            raise ValueError(f"scorer must subclass LayerScorer or ModelScorer, got {type(scorer).__name__}")
        self.scorer = scorer
        self._settings = dict(n_sink=n_sink, n_recent=n_recent, config=config, fuse_statistics=fuse_statistics,
                              budget=budget)
        self.n_sink = max(n_sink, getattr(scorer, "n_sink", 0))
        self.n_recent = max(n_recent, getattr(scorer, "n_recent", 0))
        self.fused = FusedStatistics(enabled=fuse_statistics)
        super().__init__(config=config)
        self._adopt_layers()
        self._clear_state()

    @classmethod
    def from_pretrained(cls, name_or_path: str, keep_ratio: float = 0.3, *, fuse_statistics: bool = True,
                        **kwargs) -> "ProxyKVCache":
        """A ProxyKV cache driven by a trained mapper checkpoint (a local directory or a Hub repository id).

        ``n_sink``, ``n_recent``, ``config`` and ``budget`` go to the constructor; ``name_or_path`` and the other
        ``kwargs`` (``proxy``, ``proxy_device``, ``revision``, ``cache_dir``, ``token``, ``local_files_only``,
        ``pool_kernel``, ...) to :meth:`ProxyScorer.from_pretrained <proxykv_hf.scorers.proxy.ProxyScorer.
        from_pretrained>`; ``fuse_statistics`` to both. Use the cache for one ``generate`` call, :meth:`fresh` next.
        """
        from .scorers.proxy import ProxyScorer

        own = {k: kwargs.pop(k) for k in ("n_sink", "n_recent", "config", "budget") if k in kwargs}
        scorer = ProxyScorer.from_pretrained(name_or_path, fused=FusedStatistics(enabled=fuse_statistics), **kwargs)
        return cls(scorer, keep_ratio, fuse_statistics=fuse_statistics, **own)

    def fresh(self) -> "ProxyKVCache":
        """An empty cache with the same settings, sharing the scorer's heavy parts (mapper, proxy model)."""
        return type(self)(None if self.scorer is None else self.scorer.fresh(), self.keep_ratio, **self._settings)

    # ----------------------------------------------------------------------------------------------- layout, state
    def _adopt_layers(self) -> None:
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = ProxyKVLayer
        self.layers = [ProxyKVLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]

    def compactable_layers(self) -> list[int]:
        """Indices of the full-attention layers that ProxyKV compacts (memoised: asked on every update)."""
        memo = getattr(self, "_compactable", None)
        if memo is None or memo[0] is not self.layers or memo[1] != len(self.layers):
            idx = [i for i, layer in enumerate(self.layers) if isinstance(layer, ProxyKVLayer)]
            memo = self._compactable = (self.layers, len(self.layers), idx)
        return memo[2]

    def _clear_state(self) -> None:
        self.prompt: Prompt | None = None
        self._budgets: torch.Tensor | None = None  # (B,) entries each row keeps per KV head, on the CPU
        self._schedule: Schedule | None = None  # while the first prefill is being compressed
        self._scored: dict[int, torch.Tensor] = {}  # global budget: each layer's scores until all are in

    def reset(self) -> None:
        """Empty the cache, forget the prompt; the next prefill is compressed again."""
        super().reset()
        self._clear_state()

    # ----------------------------------------------------------------------------------------------- prompt
    def prepare(self, model, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                *, inputs_embeds_shape: tuple[int, int] | None = None) -> "ProxyKVCache":
        """Explicitly give the cache its model and first prompt (no frame lookup), e.g. before ``generate``.

        Args:
            model: the ``PreTrainedModel`` that will run with this cache.
            input_ids: `(B, T)` the whole first prompt (all chunks, if ``prefill_chunk_size`` is used).
            attention_mask: `(B, T)` 1 for real tokens, 0 for (left) padding. None = no padding.
            inputs_embeds_shape: ``(B, T)`` when the model will be called with embeddings instead of ids.

        Returns:
            self, for chaining.
        """
        if self.get_seq_length() > 0:
            raise ValueError("prepare() must be called on an empty cache; call reset() first")
        self._start(make_prompt(input_ids, attention_mask, model, inputs_embeds_shape))
        return self

    def _start(self, prompt: Prompt) -> None:
        n_real = check_prompt(prompt, self.scorer)
        attention.use_proxykv_attention(prompt.model)
        if self.layer_class_to_replicate is not None and not self.layers:  # no config given: the model's layout
            self.layers = DynamicCache(config=prompt.model.config).layers
            self.layer_class_to_replicate = None
            self._adopt_layers()
        self.prompt = prompt
        self._budgets = keep_counts(n_real, self.keep_ratio, self.n_sink + self.n_recent).cpu()
        if not self._keeps_everything():
            self._schedule = Schedule(self)
            self.scorer.prepare(prompt)

    def _keeps_everything(self) -> bool:
        """No scorer, or every row keeps its whole prompt."""
        return self.scorer is None or int(self._budgets.max()) >= self.prompt.length

    # ----------------------------------------------------------------------------------------------- update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.prompt is None:
            prompt = find_prompt()
            if prompt is None:
                raise ValueError(
                    "ProxyKVCache could not find the prompt of this forward (called with inputs_embeds, under "
                    "torch.compile, or outside a transformers model). Call "
                    "cache.prepare(model, input_ids, attention_mask) before running the model."
                )
            self._start(prompt)
        elif key_states.shape[-2] > 1 and layer_idx == self.compactable_layers()[0] and \
                self.layers[layer_idx].compacted:
            check_continuation(self.prompt)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        schedule = self._schedule
        if isinstance(layer, ProxyKVLayer):
            if not layer.compacted and layer.cumulative_length >= self.prompt.length:
                if schedule is None:
                    layer.compact(None)  # nothing to drop (keep_ratio 1.0, or every row short enough)
                else:
                    attention.set_pending(schedule.pending(layer_idx))
            elif layer.ragged:
                attention.set_pending(RaggedAttention(layer))
            elif layer.slot_valid is not None:
                attention.set_pending(SpareSlots(layer))
        elif schedule is not None and schedule.waiting:
            schedule.after_layer(layer_idx)  # the model ends with sliding layers: its scorer needs their K/V too
        return keys, values

    # ----------------------------------------------------------------------------------------------- selection
    def select(self, layer_idx: int, scores: torch.Tensor) -> None:
        """Compact layer ``layer_idx`` to its top entries under ``scores`` `(B, H_kv, T)` (the one place where the
        cache turns scores into kept entries; a subclass may record the scores here instead). Under the global
        budget the layers are compacted together once every one has its scores."""
        if self.budget == "global":
            self._scored[layer_idx] = scores
            if len(self._scored) == len(self.compactable_layers()):
                scored, self._scored = self._scored, {}
                for i, keep in global_keep(self.scorer, scored, self.prompt.valid, self.keep_ratio, self.n_sink,
                                           self.n_recent).items():
                    self.layers[i].compact_ragged(keep)
            return
        indices, slot_valid = select_topk(scores, self.keep_ratio, self.prompt.valid.to(scores.device), self.n_sink,
                                          self.n_recent, k_row=self._budgets)
        spare = bool((self._budgets < self._budgets.max()).any())  # on the CPU: no device sync
        self.layers[layer_idx].compact(indices, budgets=self._budgets, slot_valid=slot_valid if spare else None)

    def kept_sets(self) -> dict[int, list[list[torch.Tensor]]]:
        """``{layer: [b][h] -> sorted prompt positions kept}`` for every compacted layer, under either budget."""
        return {i: self.layers[i].kept_sets() for i in self.compactable_layers() if self.layers[i].compacted}

    def held_entries(self) -> int:
        """K/V entries stored by the compacted layers, summed over layers, rows and heads (spare slots included)."""
        return sum(self.layers[i].held_entries() for i in self.compactable_layers())

    # ----------------------------------------------------------------------------------------------- reuse, size
    def snapshot(self) -> list[dict]:
        """A cheap handle on the current state (tensors are shared, not copied): appends never change what a
        stored tensor or view shows (:meth:`ProxyKVLayer._append <proxykv_hf.layer.ProxyKVLayer._append>`), so
        :meth:`restore` brings the cache back, e.g. to answer several questions from one compressed context."""
        return [dict(vars(layer)) for layer in self.layers]

    def restore(self, state: list[dict]) -> None:
        """Return to a :meth:`snapshot` taken on this cache."""
        if len(state) != len(self.layers):
            raise ValueError("snapshot was taken on a cache with a different number of layers")
        for layer, saved in zip(self.layers, state):
            layer.__dict__.clear()
            layer.__dict__.update(saved)

    def physical_lengths(self) -> list[int]:
        """Entries stored per layer (compacted layers: K plus the tokens added since)."""
        return [layer.keys.shape[-2] if layer.is_initialized and layer.keys is not None else 0
                for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes held by all K/V tensors of the cache."""
        tensors = [t for layer in self.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def global_keep(scorer: Scorer, scores: dict[int, torch.Tensor], valid: torch.Tensor, keep_ratio: float, n_sink: int,
                n_recent: int) -> dict[int, torch.Tensor]:
    """``{layer: (B, H_kv, T) keep mask}`` of the global budget, from each layer's scores made comparable by the
    scorer (:meth:`~proxykv_hf.scorers.base.Scorer.global_scores`)."""
    layers = sorted(scores)
    device = scores[layers[0]].device
    comparable = scorer.global_scores({i: scores[i] for i in layers}, valid.to(device))
    keep = select_global([comparable[i] for i in layers], keep_ratio, valid.to(device), n_sink, n_recent)
    return dict(zip(layers, keep))
