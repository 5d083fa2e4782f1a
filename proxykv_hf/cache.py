"""ProxyKVCache: a DynamicCache whose full-attention layers keep only the top-K entries per KV head after prefill.

This is the only module that mutates K/V. Design (``docs/design.md``):

* Each full-attention layer is a :class:`ProxyKVLayer` with a **logical** length (tokens processed, what
  positions, masks and ``generate`` see) and a **physical** length (entries stored). ``get_mask_sizes`` returns
  ``(physical + q, logical - physical)`` so that the shared mask addresses the compacted slots.
* The first prefill runs on the full K/V, so the first generated token is exact. Right after each layer's prefill
  attention the layer is compacted to ``K = ceil(keep_ratio * T_real)`` entries per KV head, stored in position
  order; the dropped entries are released. Later tokens (decode, continuation prefills) are kept in full.
* The cache needs the prompt (padding, token ids) and a hand-off from the attention function (queries). It gets
  both either from :meth:`ProxyKVCache.prepare` (explicit) or, inside ``model.generate``, by looking up the calling
  frames once at the first prefill (implicit). See :mod:`proxykv_hf.attention`.
"""

from __future__ import annotations

import copy
import logging
import sys

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from . import attention
from .scorers.base import LayerInputs, Prompt, Scorer
from .scoring import CHUNK_SIZE, causal_attention_with_statistics, fuses_with_attention
from .selection import check_keep_ratio, keep_counts, select_topk

logger = logging.getLogger(__name__)

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text")


class ProxyKVLayer(DynamicLayer):
    """A full-attention cache layer that can be compacted once, keeping its logical length."""

    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cumulative_length = 0
        self.kept_positions: torch.Tensor | None = None  # (B, H_kv, K) original positions, after compaction
        self.compacted = False
        self.compacted_at = 0  # logical length when compacted; crop() may not go below it

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def compact(self, indices: torch.Tensor | None) -> None:
        """Keep the entries at ``indices`` `(B, H_kv, K)` (None: keep all) and free the others."""
        if indices is not None:
            idx = indices[..., None].expand(-1, -1, -1, self.keys.shape[-1])  # (B, H_kv, K, D)
            self.keys = self.keys.gather(2, idx.to(self.keys.device))
            self.values = self.values.gather(2, idx.to(self.values.device))
        self.kept_positions = indices
        self.compacted = True
        self.compacted_at = self.cumulative_length

    @property
    def physical_length(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        physical = self.physical_length
        return physical + query_length, self.cumulative_length - physical

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        n = abs(tokens_to_remove) if tokens_to_remove < 0 else self.cumulative_length - tokens_to_remove
        if self.compacted and self.cumulative_length - n < self.compacted_at:
            raise ValueError(f"cannot crop {n} tokens: only the {self.cumulative_length - self.compacted_at} "
                             "tokens added after the compressed prompt can be removed")
        super().crop(-n)
        self.cumulative_length -= n

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0
        self.kept_positions = None
        self.compacted = False
        self.compacted_at = 0

    def _select_batch(self, fn) -> None:
        if self.kept_positions is not None:
            self.kept_positions = fn(self.kept_positions)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._select_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_batch(lambda t: t[indices])


def _find_prompt() -> Prompt | None:
    """Look up the calling frames for the prompt of the running forward (CPython).

    Prefers ``GenerationMixin._prefill`` (full prompt even with ``prefill_chunk_size``); else the outermost
    ``PreTrainedModel.forward`` frame that has ``input_ids`` and ``attention_mask``.
    """
    frame = sys._getframe(2)
    found = None
    while frame is not None:
        loc = frame.f_locals
        owner = loc.get("self")
        if isinstance(owner, PreTrainedModel):
            if frame.f_code.co_name == "_prefill" and "model_kwargs" in loc:
                ids = loc.get("input_ids")
                # the chunked path keeps the full mask in a local and slices model_kwargs' copy per chunk
                masks = (loc.get("attention_mask"), loc["model_kwargs"].get("attention_mask"))
                mask = next((m for m in masks if m is not None and m.shape[-1] == ids.shape[-1]), None)
                return _make_prompt(ids, mask, owner)
            if "input_ids" in loc and "attention_mask" in loc and loc["input_ids"] is not None:
                found = _make_prompt(loc["input_ids"], loc["attention_mask"], owner)
        frame = frame.f_back
    return found


def _make_prompt(input_ids, attention_mask, model) -> Prompt:
    if attention_mask is None:
        valid = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    else:
        valid = attention_mask.to(torch.bool)
    return Prompt(input_ids=input_ids, valid=valid, model=model)


class _PendingLayer:
    """Hand-off from ``update`` to the attention function of the same layer (see :mod:`proxykv_hf.attention`)."""

    __slots__ = ("cache", "layer_idx", "compact")

    def __init__(self, cache: "ProxyKVCache", layer_idx: int, compact: bool):
        self.cache, self.layer_idx, self.compact = cache, layer_idx, compact

    def _check(self, module) -> None:
        if getattr(module, "layer_idx", self.layer_idx) != self.layer_idx:
            raise RuntimeError(f"ProxyKV hand-off for layer {self.layer_idx} reached layer {module.layer_idx}")

    def before(self, module, attention_mask, query, key):
        self._check(module)
        if self.compact:  # prefill of a layer not compacted yet: nothing to hide
            return attention_mask
        return self.cache._mask_spare_slots(attention_mask, query.shape[2], key.shape[2])

    def attend(self, module, query, key, value, scaling):
        if self.compact:
            return self.cache._attend_with_statistics(self.layer_idx, module, query, key, value, scaling)
        return None

    def after(self, module, query, key, value, attention_mask, scaling):
        if self.compact:
            self.cache._on_prefill_attention(self.layer_idx, module, query, key, value, attention_mask, scaling)


class ProxyKVCache(DynamicCache):
    """A ``DynamicCache`` that compacts each full-attention layer to its top-K entries per KV head after prefill.

    Args:
        scorer: a :class:`~proxykv_hf.scorers.base.Scorer` (None keeps everything: a full cache).
        keep_ratio: fraction of each row's real prompt tokens kept per KV head, in (0, 1] (the paper's rho).
        n_sink: always keep the first ``n_sink`` real tokens.
        n_recent: always keep the last ``n_recent`` real tokens.
        config: the model config; lays out sliding / full layers up front. Optional: without it the layout is
            taken from the model at the first prefill.
        record_only: score the prompt but keep everything; the scores land in ``cache.scores`` and
            :meth:`compacted_copy` then builds compacted caches for any keep ratio without another prefill
            (what the evaluation harness does to sweep ratios).

    Example::

        cache = ProxyKVCache(SnapKVScorer(), keep_ratio=0.3)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

    A cache compresses once, on its first prefill. Calling ``generate`` again with the same cache continues the
    conversation (the new prompt must start with the old one); use a new cache, or :meth:`reset`, for a new prompt.
    """

    def __init__(
        self,
        scorer: Scorer | None = None,
        keep_ratio: float = 1.0,
        *,
        n_sink: int = 0,
        n_recent: int = 0,
        config=None,
        record_only: bool = False,
    ):
        self.record_only = record_only
        self.keep_ratio = check_keep_ratio(keep_ratio)
        for name, value in (("n_sink", n_sink), ("n_recent", n_recent)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.scorer = scorer
        self._settings = dict(n_sink=n_sink, n_recent=n_recent, config=config)
        self.n_sink = max(n_sink, getattr(scorer, "n_sink", 0))
        self.n_recent = max(n_recent, getattr(scorer, "n_recent", 0))
        super().__init__(config=config)
        self._adopt_layers()
        self._clear_state()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        keep_ratio: float = 0.3,
        *,
        proxy=None,
        proxy_device=None,
        revision: str | None = None,
        cache_dir=None,
        token=None,
        local_files_only: bool | None = None,
        chunk_size: int = CHUNK_SIZE,
        pool_kernel: int | None = None,
        **kwargs,
    ) -> "ProxyKVCache":
        """A ProxyKV cache driven by a trained mapper checkpoint (a local directory or a Hub repository id).

        Args:
            name_or_path: checkpoint directory or Hub id (``huggingface_hub``; ``HF_HUB_OFFLINE`` honoured).
            keep_ratio: fraction of the prompt kept per KV head.
            proxy: an already loaded proxy model for checkpoints whose proxy is a separate model (else it is loaded
                from the id the checkpoint names).
            proxy_device: device for the proxy and the mapper (e.g. ``"cuda:1"``); default: the target's.
            revision, cache_dir, token, local_files_only: passed to ``huggingface_hub.snapshot_download``.
            chunk_size: queries per chunk when accumulating the proxy's attention.
            pool_kernel: tokens the scores are average-pooled over before the Top-K; None: the checkpoint's.
            **kwargs: ``n_sink``, ``n_recent``, ``config``, as for the constructor.

        Returns:
            A template cache: use it for one ``generate`` call, and :meth:`fresh` for the next.
        """
        from .hub import load_checkpoint
        from .scorers.proxy import ProxyScorer

        ckpt = load_checkpoint(name_or_path, map_location=proxy_device or "cpu", revision=revision,
                               cache_dir=cache_dir, token=token, local_files_only=local_files_only)
        if ckpt.proxy.kind == "model" and proxy is None:
            from .models import load_model

            proxy = load_model(ckpt.proxy.model_id, device=proxy_device or "cpu")
        if proxy is not None and ckpt.proxy.kind == "model":
            got = getattr(proxy.config, "num_attention_heads", None)
            layers = proxy.config.num_hidden_layers
            if (layers, got) != (ckpt.proxy.num_layers, ckpt.proxy.num_heads):
                raise ValueError(f"proxy has {layers} layers and {got} heads, the mapper expects "
                                 f"{ckpt.proxy.num_layers} layers and {ckpt.proxy.num_heads} heads")
        scorer = ProxyScorer(ckpt, proxy_model=proxy, proxy_device=proxy_device, chunk_size=chunk_size,
                             pool_kernel=pool_kernel)
        return cls(scorer, keep_ratio, **kwargs)

    def fresh(self) -> "ProxyKVCache":
        """An empty cache with the same settings, sharing the scorer's heavy parts (mapper, proxy model)."""
        scorer = None if self.scorer is None else self.scorer.fresh()
        return type(self)(scorer, self.keep_ratio, record_only=self.record_only, **self._settings)

    def compacted_copy(self, keep_ratio: float) -> "ProxyKVCache":
        """From a ``record_only`` cache after its prefill: a new cache holding what a cache with this
        ``keep_ratio`` would hold (same scores, same selection), sharing no mutable state with this one."""
        if not self.record_only or self.prompt is None or not self.layers[self.compactable_layers()[0]].compacted:
            raise ValueError("compacted_copy() needs a record_only cache whose prompt has been prefilled")
        new = type(self)(None, keep_ratio, n_sink=self.n_sink, n_recent=self.n_recent)
        new.layer_class_to_replicate = None
        new.layers = []
        valid = self.prompt.valid
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, ProxyKVLayer):
                new.layers.append(copy.copy(layer))
                continue
            twin = ProxyKVLayer()
            twin.__dict__.update({k: v for k, v in vars(layer).items() if k not in ("kept_positions",)})
            twin.compacted = False
            if i in self.scores:
                indices, slot_valid = select_topk(self.scores[i], keep_ratio, valid.to(self.scores[i].device),
                                                  self.n_sink, self.n_recent)
                twin.compact(indices)
                if new.slot_valid is None and not bool(slot_valid.all()):
                    new.slot_valid = slot_valid
            else:  # the prompt was too short to drop anything
                twin.compact(None)
            new.layers.append(twin)
        new.prompt = self.prompt
        n_real = valid.sum(-1)
        new._k_max = int(keep_counts(n_real, keep_ratio, self.n_sink + self.n_recent).max())
        return new

    # ----------------------------------------------------------------------------------------------- layout
    def _adopt_layers(self) -> None:
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = ProxyKVLayer
        self.layers = [ProxyKVLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]

    def _layout_from(self, model) -> None:
        """Build the sliding / full layout from the model's config if the cache was created without one."""
        if self.layer_class_to_replicate is not None and not self.layers:
            self.layers = DynamicCache(config=model.config).layers
            self.layer_class_to_replicate = None
            self._adopt_layers()

    def compactable_layers(self) -> list[int]:
        """Indices of the full-attention layers that ProxyKV compacts (memoised: asked on every update)."""
        memo = getattr(self, "_compactable", None)
        if memo is None or memo[0] is not self.layers or memo[1] != len(self.layers):
            idx = [i for i, layer in enumerate(self.layers) if isinstance(layer, ProxyKVLayer)]
            memo = self._compactable = (self.layers, len(self.layers), idx)
        return memo[2]

    def _clear_state(self) -> None:
        self.prompt: Prompt | None = None
        self.slot_valid: torch.Tensor | None = None  # (B, K_max), False on spare slots of shorter rows
        self.scores: dict[int, torch.Tensor] = {}  # record_only: layer index -> (B, H_kv, T)
        self._k_max: int | None = None
        self._k_row: torch.Tensor | None = None  # (B,) per-row budgets, on the CPU
        self._pending_all: list[int] = []
        self._deferred: list[int] = []  # layers prefilled before the scorer's scores were ready

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
        if input_ids is None:
            if inputs_embeds_shape is None:
                raise ValueError("prepare() needs input_ids or inputs_embeds_shape")
            valid = torch.ones(inputs_embeds_shape, dtype=torch.bool) if attention_mask is None else \
                attention_mask.to(torch.bool)
            prompt = Prompt(input_ids=None, valid=valid, model=model)
        else:
            prompt = _make_prompt(input_ids, attention_mask, model)
        self._start(prompt)
        return self

    def _start(self, prompt: Prompt) -> None:
        model = prompt.model
        if model is None:
            raise ValueError("ProxyKVCache needs the model; call cache.prepare(model, input_ids, attention_mask)")
        family = getattr(model.config, "model_type", None)
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"model_type {family!r} is not supported by ProxyKVCache; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        attention.use_proxykv_attention(model)
        valid = prompt.valid
        if valid.dim() != 2:
            raise ValueError(f"attention_mask must be 2-D (B, T), got shape {tuple(valid.shape)}")
        n_real = valid.sum(-1)
        if bool((n_real == 0).any()):
            rows = torch.nonzero(n_real == 0).flatten().tolist()
            raise ValueError(f"batch rows {rows} of the prompt are all padding")
        # Left padding only: once a row has a real token, every later token is real.
        if bool((valid.long().cummax(-1).values.bool() & ~valid).any()):
            raise ValueError("ProxyKVCache needs left padding (tokenizer.padding_side = 'left')")
        if self.scorer is not None and self.scorer.needs_input_ids and prompt.input_ids is None:
            raise ValueError(f"{type(self.scorer).__name__} needs the prompt's input_ids; call the model with "
                             "input_ids, or cache.prepare(model, input_ids, attention_mask)")
        self._layout_from(model)
        self.prompt = prompt
        k_row = keep_counts(n_real, self.keep_ratio, self.n_sink + self.n_recent).cpu()
        self._k_row, self._k_max = k_row, int(k_row.max())
        if self.scorer is not None and (self._k_max < prompt.length or self.record_only):
            self.scorer.prepare(prompt)

    @property
    def prefill_length(self) -> int | None:
        """Logical length of the first prefill (None until the prompt is known)."""
        return None if self.prompt is None else self.prompt.length

    def _check_continuation(self) -> None:
        """On a later multi-token forward, make sure the new prompt continues the compressed one."""
        found = _find_prompt()
        if found is None or found.input_ids is None or self.prompt.input_ids is None:
            return
        ids, old = found.input_ids, self.prompt.input_ids
        n = old.shape[1]
        if ids.shape[1] > n and ids.shape[0] == old.shape[0] and not torch.equal(ids[:, :n].to(old.device), old):
            raise ValueError(
                "this ProxyKVCache already holds a different compressed prompt; generate() on the same cache "
                "continues a conversation. Use a new cache (or cache.reset()) for an unrelated prompt."
            )

    # ----------------------------------------------------------------------------------------------- update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.prompt is None:
            prompt = _find_prompt()
            if prompt is None:
                raise ValueError(
                    "ProxyKVCache could not find the prompt of this forward (called with inputs_embeds, under "
                    "torch.compile, or outside a transformers model). Call "
                    "cache.prepare(model, input_ids, attention_mask) before running the model."
                )
            self._start(prompt)
        elif layer_idx == self.compactable_layers()[0] and key_states.shape[-2] > 1 and self._k_max is not None \
                and self.layers[layer_idx].compacted:
            self._check_continuation()
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if not isinstance(layer, ProxyKVLayer) and self._pending_all and self._all_layers_ready(layer_idx):
            self._score_all()  # the model ends with sliding layers: score once the last one holds its K/V
        if isinstance(layer, ProxyKVLayer):
            if not layer.compacted and layer.cumulative_length >= self.prefill_length:
                attention.set_pending(_PendingLayer(self, layer_idx, compact=True))
            elif layer.compacted and self.slot_valid is not None:
                attention.set_pending(_PendingLayer(self, layer_idx, compact=False))
        return keys, values

    # ----------------------------------------------------------------------------------------------- compaction
    def _attend_with_statistics(self, layer_idx, module, query, key, value, scaling) -> torch.Tensor | None:
        """A plain causal prefill of a layer whose scorer reads its own attention statistics: compute the attention
        output and the statistics in one pass, then score the layer; None (sdpa runs) where that does not pay."""
        wanted = getattr(self.scorer, "own_statistics", ())
        if not wanted or not fuses_with_attention(query) or self._keeps_everything():
            return None
        Q = query.shape[2]
        out, statistics = causal_attention_with_statistics(
            query, key, value, scaling, query_valid=self.prompt.valid[:, -Q:].to(query.device),
            chunk_size=getattr(self.scorer, "chunk_size", CHUNK_SIZE), statistics=wanted)
        self._on_prefill_attention(layer_idx, module, query, key, value, None, scaling, statistics=statistics)
        return out

    def _on_prefill_attention(self, layer_idx, module, query, key, value, attention_mask, scaling, *,
                              statistics=None) -> None:
        layer = self.layers[layer_idx]
        if self._keeps_everything():
            layer.compact(None)  # nothing to drop (keep_ratio 1.0, or every row short enough)
            return
        if self.scorer.needs_all_layers:
            self._pending_all.append(layer_idx)
            if self._all_layers_ready(layer_idx):
                self._score_all()
            return
        last = layer_idx == self.compactable_layers()[-1]
        if self.scorer.ready() or last:
            for i in self._deferred:  # scores computed beside the prefill are in: compact the layers that waited
                self._compact(i, self.scorer.score(self._inputs(i, scaling)))
            self._deferred = []
        elif self.scorer.query_free:  # a side stream is still scoring: do not make this stream wait for it
            self._deferred.append(layer_idx)
            return
        self._compact(layer_idx, self.scorer.score(self._inputs(layer_idx, scaling, module=module, query=query,
                                                                key=key, value=value, attention_mask=attention_mask,
                                                                statistics=statistics)))

    def _keeps_everything(self) -> bool:
        """No scorer, or every row keeps its whole prompt (and no scores are to be recorded)."""
        return self.scorer is None or (self._k_max >= self.prefill_length and not self.record_only)

    def _inputs(self, layer_idx, scaling, *, module=None, query=None, key=None, value=None,
                attention_mask=None, statistics=None) -> LayerInputs:
        """The scorer's view of one layer; keys and values default to what the layer holds (a deferred layer)."""
        layer, T = self.layers[layer_idx], self.prefill_length
        key = layer.keys if key is None else key
        value = layer.values if value is None else value
        return LayerInputs(layer_idx=layer_idx, keys=key[:, :, :T], values=value[:, :, :T], queries=query,
                           attention_mask=attention_mask, scaling=scaling, prompt=self.prompt,
                           compact_index=self.compactable_layers().index(layer_idx), module=module,
                           statistics=statistics)

    def _all_layers_ready(self, layer_idx: int) -> bool:
        """All compactable layers prefilled, and ``layer_idx`` is the model's last layer (Gemma3 can end with
        sliding layers, whose K/V a global scorer needs too)."""
        return len(self._pending_all) == len(self.compactable_layers()) and layer_idx == len(self.layers) - 1

    def _score_all(self) -> None:
        scores = self.scorer.score_all(self.prompt, self)
        for i in self._pending_all:
            self._compact(i, scores[i])
        self._pending_all = []

    def _compact(self, layer_idx: int, scores: torch.Tensor) -> None:
        layer = self.layers[layer_idx]
        B, H_kv = layer.keys.shape[:2]
        if scores.shape != (B, H_kv, self.prefill_length):
            raise ValueError(f"{type(self.scorer).__name__} returned scores of shape {tuple(scores.shape)} for "
                             f"layer {layer_idx}, expected {(B, H_kv, self.prefill_length)}")
        if self.record_only:
            self.scores[layer_idx] = scores.detach()
            layer.compact(None)
            return
        indices, slot_valid = select_topk(scores, self.keep_ratio, self.prompt.valid.to(scores.device),
                                          self.n_sink, self.n_recent, k_row=self._k_row)
        layer.compact(indices)
        if self.slot_valid is None and bool((self._k_row < self._k_max).any()):  # on the CPU: no GPU sync
            self.slot_valid = slot_valid

    def _mask_spare_slots(self, attention_mask, q_len: int, kv_len: int):
        """Hide the spare slots of shorter rows (padded batches) from the attention of compacted layers."""
        if self.slot_valid is None or self._k_max is None:
            return attention_mask
        k = self._k_max
        B = self.slot_valid.shape[0]
        device = self.slot_valid.device if attention_mask is None else attention_mask.device
        visible = torch.ones(B, 1, 1, kv_len, dtype=torch.bool, device=device)
        visible[:, 0, 0, :k] = self.slot_valid.to(device)
        if attention_mask is None:  # causal over the new tokens, everything compacted visible
            new = kv_len - k
            causal = torch.arange(new, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None] + (
                new - q_len)
            full = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
            full[:, k:] = causal
            return full[None, None] & visible
        if attention_mask.dtype == torch.bool:
            return attention_mask & visible
        return attention_mask.masked_fill(~visible, torch.finfo(attention_mask.dtype).min)

    # ----------------------------------------------------------------------------------------------- batch ops
    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        if self.slot_valid is not None:
            self.slot_valid = self.slot_valid.index_select(0, beam_idx.to(self.slot_valid.device))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.slot_valid is not None:
            self.slot_valid = self.slot_valid.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        if self.slot_valid is not None:
            self.slot_valid = self.slot_valid[indices]

    # ----------------------------------------------------------------------------------------------- reuse
    def snapshot(self) -> tuple:
        """A cheap handle on the current state (tensors are shared, not copied): appends never modify stored
        tensors in place, so :meth:`restore` brings the cache back, e.g. to answer several questions from one
        compressed context."""
        return [dict(vars(layer)) for layer in self.layers], self.slot_valid

    def restore(self, state: tuple) -> None:
        """Return to a :meth:`snapshot` taken on this cache."""
        layers, self.slot_valid = state
        if len(layers) != len(self.layers):
            raise ValueError("snapshot was taken on a cache with a different number of layers")
        for layer, saved in zip(self.layers, layers):
            layer.__dict__.clear()
            layer.__dict__.update(saved)

    # ----------------------------------------------------------------------------------------------- reporting
    def physical_lengths(self) -> list[int]:
        """Entries stored per layer (compacted layers: K plus the tokens added since)."""
        return [layer.keys.shape[-2] if layer.is_initialized and layer.keys is not None else 0
                for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes held by all K/V tensors of the cache."""
        total = 0
        for layer in self.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
