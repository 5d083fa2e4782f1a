"""ProxyKVCache: a DynamicCache whose full-attention layers keep only the top-K entries per KV head after prefill.

The first prefill runs on the full K/V, so the first generated token is exact. Right after each full-attention
layer's prefill attention the layer (a :class:`~proxykv_hf.cache.layer.ProxyKVLayer`) is compacted to
``K = ceil(keep_ratio * T_real)`` entries per KV head; the dropped entries are released. Later tokens are kept in
full. When a layer is scored depends on the scorer's kind (:mod:`proxykv_hf.scorers.base`); the layer's queries come
from the attention wrapper (:mod:`proxykv_hf.attention.wrapper`).

A cache holds one conversation (:mod:`.conversation`): every forward's tokens are recorded (:mod:`.prompt`), and
every ``generate`` call on a used cache must continue them (:mod:`.calls`). The prompt it compresses is what
``generate`` was given (or what :meth:`ProxyKVCache.prepare` names): chunked prefill compresses once the whole prompt
is in, and assisted decoding's first forward is split into the prompt and the candidates (:mod:`.candidates`).
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..attention import wrapper as attention
from .calls import CallTracker, check_prepared_call
from .conversation import Conversation, check_prompt_forward
from ..models.fingerprints import describe_model
from .layer import ProxyKVLayer, RaggedAttention, SpareSlots, held_bytes
from .prompt import SUPPORTED_FAMILIES, check_prompt, make_prompt
from .budget import PromptBudget
from .schedule import Schedule
from ..scorers.base import LayerScorer, ModelScorer, Prompt, Scorer
from ..attention.statistics import FusedStatistics
from .selection import BUDGETS, check_keep_ratio

__all__ = ["DEFAULT_KEEP_RATIO", "ProxyKVCache", "ProxyKVLayer", "SUPPORTED_FAMILIES"]

logger = logging.getLogger(__name__)

DEFAULT_KEEP_RATIO = 0.3
"""The keep ratio of a cache built without one (the paper's main setting)."""

_TRANSIENT = ("calls",)  # per call: never copied, pickled or snapshotted


class ProxyKVCache(DynamicCache):
    """A ``DynamicCache`` that compacts each full-attention layer to its top-K entries per KV head after prefill.

    Args:
        scorer: a :class:`~proxykv_hf.scorers.base.Scorer` (None keeps everything: a full cache). The cache scores
            with its own :meth:`~proxykv_hf.scorers.base.Scorer.fresh` copy, so one scorer can serve many caches,
            also from several threads at once.
        keep_ratio: fraction of each row's real prompt tokens kept per KV head, in (0, 1] (the paper's rho); default
            :data:`DEFAULT_KEEP_RATIO` with a scorer, 1 without one (below 1 it needs a scorer: ``ValueError``).
        n_sink, n_recent: always keep the first ``n_sink`` and the last ``n_recent`` real tokens.
        config: the model config; lays out sliding / full layers up front. Optional: without it the layout is
            taken from the model at the first prefill.
        fuse_statistics: let a scorer's attention statistics come out of the layer's own attention pass where
            that pays (:class:`~proxykv_hf.attention.statistics.FusedStatistics`); False runs attention, then them.
        budget: ``"uniform"`` (every KV head of every layer keeps ``K``) or ``"global"`` (each row keeps the best
            ``L * H_kv * K`` entries of all layers and heads, at least ``ceil(0.2 * K)`` per head, packed:
            :func:`~proxykv_hf.cache.selection.select_global`; the prefill holds every layer's full K/V until the
            last is scored). None: the scorer's :attr:`~proxykv_hf.scorers.base.Scorer.default_budget`.

    Example::

        cache = ProxyKVCache(SnapKVScorer(), keep_ratio=0.3)
        out = model.generate(**inputs, cache=cache, max_new_tokens=32)  # past_key_values= before transformers 5.24

    A cache compresses once, on its first prefill, and holds one conversation: calling ``generate`` again with the
    same cache continues it (the new prompt must start with every token the cache holds, generated ones included);
    anything else is a ``ValueError``. Use :meth:`fresh` or :meth:`reset` for a new prompt.
    """

    def __init__(self, scorer: Scorer | None = None, keep_ratio: float | None = None, *, n_sink: int = 0,
                 n_recent: int = 0, config=None, fuse_statistics: bool = True, budget: str | None = None):
        keep_ratio = (1.0 if scorer is None else DEFAULT_KEEP_RATIO) if keep_ratio is None else keep_ratio
        self.keep_ratio = check_keep_ratio(keep_ratio, scored=scorer is not None, fix="ProxyKVCache(SnapKVScorer(), "
                                           "keep_ratio=...) or ProxyKVCache.from_pretrained(mapper, keep_ratio=...)")
        if scorer is not None and not isinstance(scorer, (LayerScorer, ModelScorer)):
            raise ValueError(f"scorer must subclass LayerScorer or ModelScorer, got {type(scorer).__name__}")
        budget = ("uniform" if scorer is None else scorer.default_budget) if budget is None else budget
        if budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
        self.budget = budget
        for name, value in (("n_sink", n_sink), ("n_recent", n_recent)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.scorer = None if scorer is None else scorer.fresh()
        self._settings = dict(n_sink=n_sink, n_recent=n_recent, config=config, fuse_statistics=fuse_statistics,
                              budget=budget)
        self.n_sink = max(n_sink, getattr(scorer, "n_sink", 0))
        self.n_recent = max(n_recent, getattr(scorer, "n_recent", 0))
        self.fused = FusedStatistics(enabled=fuse_statistics)
        super().__init__(config=config)
        self._adopt_layers()
        self.conversation = Conversation()
        self._user_defined = False
        self._clear_state()

    @classmethod
    def from_pretrained(cls, name_or_path, keep_ratio: float = DEFAULT_KEEP_RATIO, *,
                        fuse_statistics: bool = True, **kwargs) -> "ProxyKVCache":
        """A ProxyKV cache driven by a trained mapper checkpoint (a local directory, a Hub repository id, or a
        :class:`~proxykv_hf.mapper.checkpoint.Checkpoint` in memory).

        ``n_sink``, ``n_recent``, ``config`` and ``budget`` go to the constructor; ``name_or_path`` and the other
        ``kwargs`` (``proxy``, ``proxy_device``, ``revision``, ``cache_dir``, ``token``, ``local_files_only``,
        ``mapper_autocast``, ...) to :meth:`ProxyScorer.from_pretrained <proxykv_hf.scorers.proxy.ProxyScorer.
        from_pretrained>`; ``fuse_statistics`` to both. Use the cache for one conversation, :meth:`fresh` next.
        """
        from ..scorers.proxy import ProxyScorer

        own = {k: kwargs.pop(k) for k in ("n_sink", "n_recent", "config", "budget") if k in kwargs}
        scorer = ProxyScorer.from_pretrained(name_or_path, fused=FusedStatistics(enabled=fuse_statistics), **kwargs)
        return cls(scorer, keep_ratio, fuse_statistics=fuse_statistics, **own)

    def fresh(self) -> "ProxyKVCache":
        """An empty cache with the same settings, sharing the scorer's heavy parts (mapper, proxy model)."""
        return type(self)(self.scorer, self.keep_ratio if self.scorer is not None else 1.0, **self._settings)

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
        self.prompt: Prompt | None = None  # the compressed prompt (its model only until it is compressed)
        self._prepared = False  # the prompt came from prepare(), and no forward has run yet
        self._prompt_budget: PromptBudget | None = None  # what the prompt's layers keep, while it is compressed
        self._schedule: Schedule | None = None  # while the first prefill is being compressed
        self.calls = CallTracker(self)  # the generate call the forwards belong to, and the hooks that see them
        self._model_ref = self._model_description = None  # the model that filled the cache (weakly), described
        self.conversation.clear()

    def reset(self) -> None:
        """Empty the cache, forget the conversation; the next prefill is compressed again."""
        super().reset()
        self.calls.close()  # the hooks go with the old state
        self._clear_state()

    @property
    def _is_user_defined(self) -> bool:
        return self._user_defined

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        # transformers' generate sets this on a cache it is given, once per call, before any forward
        self._user_defined = value
        self.calls.generate_started(self)

    def _held(self) -> int:
        """Tokens the cache holds; the conversation is marked unknown if its layers were filled behind its back."""
        held = self.get_seq_length()
        if held != len(self.conversation):
            self.conversation.clear()
            self.conversation.append(None, held)
        return held

    def settings(self) -> dict:
        """The keyword settings the cache was built with (``n_sink``, ``n_recent``, ``config``, ``fuse_statistics``,
        ``budget``), as given; :meth:`fresh` builds from them."""
        return dict(self._settings)

    def set_model(self, model, description: dict | None = None) -> None:
        """Name the model whose K/V the cache holds (e.g. a loaded context's; ``description``: what was recorded of
        it, see :meth:`model_description`), held weakly; its forwards' inputs reach the cache from now on."""
        self._model_ref, self._model_description = weakref.ref(model), description
        self.calls.watch(model)

    def model_description(self) -> dict | None:
        """What a saved context records of the model that filled this cache
        (:func:`~proxykv_hf.models.fingerprints.describe_model`), worked out when first asked; None when unknown."""
        model = None if self._model_ref is None else self._model_ref()
        if self._model_description is None and model is not None:
            self._model_description = describe_model(model)
        return self._model_description

    def compressing(self) -> bool:
        """Whether the cache is between the first forward of its prompt and the last layer's compaction."""
        return self._schedule is not None or (self.prompt is not None and self.prompt.model is not None
                                               and self.get_seq_length() > 0)

    # ----------------------------------------------------------------------------------------------- prompt
    def prepare(self, model, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                *, inputs_embeds_shape: tuple[int, int] | None = None) -> "ProxyKVCache":
        """Name the model and the first prompt before running it, e.g. for a hand-written loop or chunked forwards.

        The forwards that follow must feed exactly this prompt (a ``generate`` call must be given it; hand-written
        forwards may feed it in chunks), else they raise ``ValueError``.

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
        self._prepared = True
        return self

    def _start(self, prompt: Prompt) -> None:
        check_prompt(prompt, self.scorer)
        self.set_model(prompt.model)
        attention.use_proxykv_attention(prompt.model)
        if self.layer_class_to_replicate is not None and not self.layers:  # no config given: the model's layout
            self.layers = DynamicCache(config=prompt.model.config).layers
            self.layer_class_to_replicate = None
            self._adopt_layers()
        self.prompt = prompt
        self._prompt_budget = self.prompt_budget()
        if not self._keeps_everything():
            self._schedule = Schedule(self.scorer, self._prompt_budget, prompt, self.fused, self)
            self.scorer.prepare(prompt)
        elif self.scorer is not None:
            logger.warning("ProxyKVCache keeps all %d prompt tokens (keep_ratio=%s, %d always kept by n_sink + "
                           "n_recent): nothing is pruned", prompt.length, self.keep_ratio, self.n_sink + self.n_recent)

    def _keeps_everything(self) -> bool:  # no scorer, or every row keeps its whole prompt
        return self.scorer is None or self._prompt_budget.keeps_everything(self.prompt.length)

    def prompt_budget(self, rows: torch.Tensor | None = None) -> PromptBudget:
        """What the layers keep of the prompt under this cache's settings: the one place where a layer's scores
        become kept entries (:class:`~proxykv_hf.cache.budget.PromptBudget`; a subclass may return its own, e.g.
        one that records the scores). ``rows``: `(B,)` entries each row keeps per KV head (default: from
        ``keep_ratio``)."""
        return PromptBudget(self.layers, self.compactable_layers(), self.prompt.valid, self.keep_ratio,
                            n_sink=self.n_sink, n_recent=self.n_recent, kind=self.budget, scorer=self.scorer, rows=rows)

    def _begin_forward(self, n: int) -> None:
        """At the first layer of every forward (``n`` new tokens): learn or check the prompt, record the tokens."""
        forward, ids, held = self.calls.forward_started(self, n)
        if self.prompt is None:
            if forward is None:
                raise ValueError("ProxyKVCache could not find the model running this forward (called outside a "
                                 "transformers model, or under torch.compile). Call cache.prepare(model, input_ids, "
                                 "attention_mask) before running the model.")
            if forward.input_ids is None:
                raise ValueError("ProxyKVCache was given inputs_embeds without a prompt to compress: call "
                                 "cache.prepare(model, inputs_embeds_shape=(batch, length), attention_mask=...) "
                                 "before the forward (or pass input_ids).")
            self._start(make_prompt(forward.input_ids, forward.attention_mask, forward.model))
        if self.compressing() or self._prepared:
            check_prompt_forward(self.prompt.input_ids, self.prompt.length, ids, held, n)
        self._prepared = False
        self.conversation.append(ids, n)

    def _check_call(self, call, held: int) -> None:
        """A ``generate`` call's prompt starts an empty cache, or must continue what the cache holds."""
        if held == 0 and not self._prepared:  # an empty cache: the call's prompt is the prompt
            self._schedule = self._prompt_budget = None  # (what an earlier call that failed before its forward started)
            self._start(make_prompt(call.input_ids, call.attention_mask, call.model, (call.batch, call.length)))
        elif self._prepared:  # prepare() named the prompt: generate must be given the same
            check_prepared_call(self.prompt.input_ids, call)
        else:
            factor = self.conversation.check(call.input_ids)
            if factor > 1:
                self.batch_repeat_interleave(factor)

    # ----------------------------------------------------------------------------------------------- update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:  # the first layer of a forward
            self._begin_forward(key_states.shape[-2])
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        schedule = self._schedule
        if isinstance(layer, ProxyKVLayer):
            if not layer.compacted:
                if layer.cumulative_length >= self.prompt.length:
                    if schedule is None:
                        layer.compact(None)  # nothing to drop (keep_ratio 1.0, or every row short enough)
                        if all(self.layers[i].compacted for i in self.compactable_layers()):
                            self._compressed()
                    else:  # the layer's attention hands its queries to the schedule, which compacts the layer
                        attention.set_pending(schedule.pending(layer_idx, self._compressed))
                elif schedule is not None:
                    attention.set_pending(schedule.chunk(layer_idx))  # a prefill chunk: its queries count too
            elif layer.ragged:
                attention.set_pending(RaggedAttention(layer))
            elif layer.slot_valid is not None:
                attention.set_pending(SpareSlots(layer))
        elif schedule is not None and schedule.waiting and schedule.after_layer(layer_idx):
            self._compressed()  # the model ends with sliding layers: its scorer needed their K/V too
        return keys, values

    def _compressed(self) -> None:
        """Every compacted layer is compacted: drop what only the compression needed (the model, the schedule), so
        that copies and pickles of the cache hold K/V and the model's description."""
        self._schedule, self._prompt_budget = None, None
        self.model_description()  # described now, while the model is alive (the cache holds it weakly)
        self.prompt = replace(self.prompt, model=None)

    # ----------------------------------------------------------------------------------------------- kept entries
    def kept_sets(self) -> dict[int, list[list[torch.Tensor]]]:
        """``{layer: [b][h] -> sorted prompt positions kept}`` for every compacted layer, under either budget."""
        return {i: self.layers[i].kept_sets() for i in self.compactable_layers() if self.layers[i].compacted}

    def held_entries(self) -> int:
        """K/V entries stored by the compacted layers, summed over layers, rows and heads (spare slots included)."""
        return sum(self.layers[i].held_entries() for i in self.compactable_layers())

    # ----------------------------------------------------------------------------------------------- generate hooks
    def activate_past_recording(self, **kwargs) -> None:
        """Called by transformers before candidate-verifying decoding (assisted, prompt lookup; keywords from 5.25):
        their first forward holds the prompt and the candidates, so it is split (:mod:`proxykv_hf.cache.candidates`)."""
        parent = getattr(super(), "activate_past_recording", None)
        if parent is not None:
            parent(**kwargs)
        self.calls.verification_started(self)

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        self.conversation.crop(self.get_seq_length())

    def _rows_changed(self, rows: torch.Tensor) -> None:
        self.conversation.select_rows(rows)
        if self.prompt is not None:
            ids = None if self.prompt.input_ids is None else self.prompt.input_ids[rows.to(self.prompt.valid.device)]
            valid = self.prompt.valid[rows.to(self.prompt.valid.device)]
            self.prompt = replace(self.prompt, input_ids=ids, valid=valid)

    def _refuse_mid_prefill(self, what: str) -> None:
        if self.compressing():
            raise ValueError(f"cannot {what} a ProxyKVCache in the middle of compressing its prompt")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse_mid_prefill("expand")
        rows = torch.arange(self._batch_size()).repeat_interleave(repeats)
        super().batch_repeat_interleave(repeats)
        self._rows_changed(rows)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse_mid_prefill("select rows of")
        super().batch_select_indices(indices)
        self._rows_changed(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse_mid_prefill("reorder")
        super().reorder_cache(beam_idx)
        self._rows_changed(beam_idx)

    def _batch_size(self) -> int:
        if self.conversation.rows is not None:
            return self.conversation.rows
        if self.prompt is not None:
            return self.prompt.valid.shape[0]
        layer = next((l for l in self.layers if getattr(l, "keys", None) is not None and l.keys.numel()), None)
        return 0 if layer is None else layer._batch_size() if isinstance(layer, ProxyKVLayer) else layer.keys.shape[0]

    # ----------------------------------------------------------------------------------------------- reuse, size
    def snapshot(self) -> dict:
        """A cheap handle on the current state (tensors are shared, not copied): appends never change what a
        stored tensor or view shows (:meth:`~proxykv_hf.cache.layer.ProxyKVLayer._into_room`), so :meth:`restore`
        brings the cache back, e.g. to answer several questions from one compressed context."""
        return {"layers": [dict(vars(layer)) for layer in self.layers],
                "conversation": copy.copy(self.conversation), "prompt": self.prompt}

    def restore(self, state: dict) -> None:
        """Return to a :meth:`snapshot` taken on this cache."""
        if len(state["layers"]) != len(self.layers):
            raise ValueError("snapshot was taken on a cache with a different number of layers")
        for layer, saved in zip(self.layers, state["layers"]):
            layer.__dict__.clear()
            layer.__dict__.update(saved)
        self.conversation, self.prompt = copy.copy(state["conversation"]), state["prompt"]
        self.calls.forget()

    def physical_lengths(self) -> list[int]:
        """Entries stored per layer and KV head (compacted: K plus the tokens added since; global budget: all heads)."""
        return [0 if not layer.is_initialized or layer.keys is None else layer.held_entries()
                if getattr(layer, "ragged", False) else layer.keys.shape[-2] for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes of memory the cache's layers hold: every tensor's whole storage, counted once (K/V with the spare
        room kept for later tokens, the kept positions and the global budget's packed indices). The token ids of
        the conversation (a few bytes per token) are not counted."""
        return held_bytes(self.layers)

    # ----------------------------------------------------------------------------------------------- copy, pickle
    def _state(self, what: str) -> dict:
        if self.compressing():
            raise ValueError(f"cannot {what} a ProxyKVCache in the middle of compressing its prompt (between its "
                             "first forward and the last layer's compaction)")
        return {k: v for k, v in self.__dict__.items() if k not in _TRANSIENT}

    def __deepcopy__(self, memo: dict) -> "ProxyKVCache":
        """A copy holding copies of the K/V and of the conversation; the scorer's heavy parts are shared
        (:meth:`~proxykv_hf.scorers.base.Scorer.fresh`), the model is never copied."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self._state("copy").items():
            new.__dict__[key] = value.fresh() if key == "scorer" and value is not None else copy.deepcopy(value, memo)
        new.calls = CallTracker(new)
        return new

    def __getstate__(self) -> dict:
        state = self._state("pickle")
        state.update(_model_description=self.model_description(), _model_ref=None)  # a weak reference does not pickle
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.calls = CallTracker(self)

    # ----------------------------------------------------------------------------------------------- on disk
    def save_context(self, path: str, tokenizer=None):
        """Save what the cache holds after its first prefill to the directory ``path`` (a str or path), whole or not
        at all; ``tokenizer`` is fingerprinted when given (:func:`proxykv_hf.contexts.save_context`)."""
        from ..contexts.format import save_context

        return save_context(self, path, tokenizer)

    @classmethod
    def load_context(cls, path: str, model, tokenizer=None, *, scorer: Scorer | None = None,
                     dtype: str = "refuse") -> "ProxyKVCache":
        """A cache on ``model`` that continues exactly where the one saved at ``path`` stood (its K/V, kept positions
        and token ids). Refuses, naming the file, another model, tokenizer, dtype (unless ``dtype="convert"``) or
        scorer, a newer format and damaged files (:func:`proxykv_hf.contexts.read_context`)."""
        from ..contexts.format import read_context

        return read_context(path, model, tokenizer, cache_class=cls, scorer=scorer, dtype=dtype).cache

    def save_pretrained(self, directory: str):
        """The scorer's mapper checkpoint with its settings (:meth:`ProxyScorer.save_pretrained
        <proxykv_hf.scorers.proxy.ProxyScorer.save_pretrained>`); :meth:`push_to_hub` uploads it."""
        if not hasattr(self.scorer, "save_pretrained"):
            raise ValueError(f"{type(self.scorer).__name__} has no checkpoint to save (a ProxyScorer's mapper has)")
        return self.scorer.save_pretrained(directory)

    def push_to_hub(self, repo_id: str, **kwargs) -> str:
        """Upload what :meth:`save_pretrained` writes to the Hub repository ``repo_id``; returns the commit URL."""
        if not hasattr(self.scorer, "push_to_hub"):
            raise ValueError(f"{type(self.scorer).__name__} has no checkpoint to push (a ProxyScorer's mapper has)")
        return self.scorer.push_to_hub(repo_id, **kwargs)
