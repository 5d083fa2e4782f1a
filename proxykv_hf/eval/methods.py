"""The methods the harness compares, by name (the scorer registry), and the one score recorder of ratio sweeps.

Scores depend only on the prompt, so one scoring pass serves every keep ratio of a sample: a
:class:`RecordingCache` prefills the context with the method's scorer on the same code path a user's cache runs,
keeps everything and records each layer's scores; :func:`compacted_copy` then builds, for any keep ratio, the cache
that a live :class:`~proxykv_hf.cache.ProxyKVCache` with that ratio would hold
(``tests/test_cache.py::test_compacted_copy_equals_a_live_cache``).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from ..cache.budget import PromptBudget
from ..cache.proxykv_cache import ProxyKVCache
from ..cache.layer import ProxyKVLayer
from ..contexts.pipeline import compress_context
from ..scorers import registry
from ..scorers.base import BackgroundScorer, LayerInputs, LayerScorer, Prompt
from ..scorers.registry import ScorerContext
from ..attention.statistics import CHUNK_SIZE
from ..cache.selection import keep_counts

METHODS = tuple(registry.names())
"""Method names registered when this module was imported (``registry.names()`` is the live list). ``attn_sum`` /
``attn_max`` / ``attn_novelty``: the self proxy's statistics (sum, max, lookback) used as scores with no mapper
(:class:`~proxykv_hf.scorers.statistic.AttentionStatisticScorer`)."""

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

    def prompt_budget(self, rows: torch.Tensor | None = None) -> PromptBudget:
        return _Recorder(self)


class _Recorder(PromptBudget):
    """A recording cache's budget: each layer's scores are recorded, and the layer keeps every entry."""

    def __init__(self, cache: RecordingCache):
        super().__init__(cache.layers, cache.compactable_layers(), cache.prompt.valid, 1.0)
        self.record = cache.scores

    def scored(self, layer_idx: int, scores: torch.Tensor) -> bool:
        self.record[layer_idx] = scores.detach().float().cpu()
        self.layers[layer_idx].compact(None)
        return self.done()


def record_scores(model, scorer, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> RecordingCache:
    """A :class:`RecordingCache` over a fresh copy of ``scorer`` after one forward of the left-padded prompt
    ``input_ids`` (``attention_mask``: its padding, None for none): its ``scores`` are each layer's."""
    return compress_context(model, RecordingCache(scorer.fresh()), input_ids, attention_mask)


class SharedPrefill(LayerScorer):
    """Several layer scorers over one prefill: each member scores every layer from the same inputs (its own
    statistics sliced out of the union the attention pass computes), and its scores are kept in ``scores``.

    Only members that read the prefill the same way share one: plain layer scorers (not background or model
    scorers), all with statistics or all without, so that the K/V they see are those of their own live cache
    (:func:`prefill_groups`).

    Attributes:
        scores: ``{member name: {layer_idx: (B, H_kv, T) float32 on the CPU}}`` after the prefill.
    """

    def __init__(self, members: dict[str, LayerScorer]):
        if not members or any(not isinstance(m, LayerScorer) or isinstance(m, BackgroundScorer)
                              for m in members.values()):
            raise ValueError("SharedPrefill takes plain LayerScorer members")
        self.members = members
        self.statistics = tuple(dict.fromkeys(s for m in members.values() for s in m.statistics))
        chunks = {getattr(m, "chunk_size", CHUNK_SIZE) for m in members.values() if m.statistics}
        if len(chunks) > 1:
            raise ValueError(f"members that read statistics must share one chunk_size, got {sorted(chunks)}")
        self.chunk_size = chunks.pop() if chunks else CHUNK_SIZE
        self.scores: dict[str, dict[int, torch.Tensor]] = {name: {} for name in members}

    def fresh(self) -> "SharedPrefill":
        return SharedPrefill({name: m.fresh() for name, m in self.members.items()})

    def prepare(self, prompt: Prompt) -> None:
        for m in self.members.values():
            m.prepare(prompt)

    def _statistics_of(self, member: LayerScorer, inputs: LayerInputs) -> torch.Tensor | None:
        if inputs.statistics is None or not member.statistics:
            return None
        H = inputs.statistics.shape[1] // len(self.statistics)  # statistic-major (B, S * H, T)
        parts = [inputs.statistics[:, j * H:(j + 1) * H] for j in map(self.statistics.index, member.statistics)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        first = None
        for name, member in self.members.items():
            s = member.score(replace(inputs, statistics=self._statistics_of(member, inputs)))
            self.scores[name][inputs.layer_idx] = s.detach().float().cpu()
            first = s if first is None else first
        return first


def prefill_groups(scorers: dict[str, object]) -> list[list[str]]:
    """The methods of ``scorers`` (name -> scorer, None for the full cache) in groups that can share one prefill:
    plain layer scorers without statistics with the full cache, plain layer scorers with statistics together, every
    other method alone. Groups keep the order of ``scorers``."""
    groups: dict[tuple, list[str]] = {}
    for name, scorer in scorers.items():
        if scorer is None:
            key = ("shared", False)
        elif isinstance(scorer, LayerScorer) and not isinstance(scorer, BackgroundScorer):
            key = ("shared", bool(scorer.statistics))
        else:
            key = ("alone", name)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _twin_layers(recorded: RecordingCache, rows: int = 1) -> list:
    """Copies of ``recorded``'s layers sharing its tensors (repeated ``rows`` times along the batch)."""
    out = []
    for layer in recorded.layers:
        twin = ProxyKVLayer() if isinstance(layer, ProxyKVLayer) else copy.copy(layer)
        twin.__dict__.update(vars(layer))
        if rows > 1 and getattr(twin, "keys", None) is not None:
            twin.keys = twin.keys.expand(rows, *twin.keys.shape[1:])
            twin.values = twin.values.expand(rows, *twin.values.shape[1:])
        out.append(twin)
    return out


def _check_recorded(recorded: RecordingCache, name: str) -> None:
    first = recorded.compactable_layers()
    if recorded.prompt is None or not first or not recorded.layers[first[0]].compacted:
        raise ValueError(f"{name}() needs a RecordingCache whose prompt has been prefilled")


def compacted_copy(recorded: RecordingCache, keep_ratio: float, budget: str = "uniform", *, scorer=None,
                   scores: dict[int, torch.Tensor] | None = None) -> ProxyKVCache:
    """From a :class:`RecordingCache` after its prefill: a new cache holding what a cache with ``keep_ratio`` and
    ``budget`` would hold (same scores, same selection), sharing no mutable state with ``recorded``.

    ``scorer`` and ``scores``: one member of a :class:`SharedPrefill` and its scores (default: the recorder's)."""
    _check_recorded(recorded, "compacted_copy")
    scorer = recorded.scorer if scorer is None else scorer
    scores = recorded.scores if scores is None else scores
    new = ProxyKVCache(scorer, keep_ratio, n_sink=max(recorded.n_sink, getattr(scorer, "n_sink", 0)),
                       n_recent=max(recorded.n_recent, getattr(scorer, "n_recent", 0)), budget=budget)
    new.layer_class_to_replicate = None
    new.layers = _twin_layers(recorded)
    new.prompt, new.conversation = recorded.prompt, copy.copy(recorded.conversation)
    budget = new.prompt_budget()
    for i in sorted(scores):  # the live cache's own selection (uniform or global)
        budget.scored(i, scores[i])
    return new


def compacted_batch(recorded: RecordingCache, keep_ratios: list[float], *, scorer=None,
                    scores: dict[int, torch.Tensor] | None = None) -> ProxyKVCache:
    """The uniform-budget caches of several keep ratios as the rows of one batched cache: row ``j`` holds what
    ``compacted_copy(recorded, keep_ratios[j])`` holds (the shorter rows padded with masked spare slots), so one
    batched ``generate`` answers for every ratio. ``recorded`` must hold a single row."""
    _check_recorded(recorded, "compacted_batch")
    if recorded.prompt.valid.shape[0] != 1:
        raise ValueError("compacted_batch() takes a RecordingCache of one row")
    if not keep_ratios:
        raise ValueError("compacted_batch() needs at least one keep ratio")
    scorer = recorded.scorer if scorer is None else scorer
    scores = recorded.scores if scores is None else scores
    rows = len(keep_ratios)
    new = ProxyKVCache(scorer, max(keep_ratios), n_sink=max(recorded.n_sink, getattr(scorer, "n_sink", 0)),
                       n_recent=max(recorded.n_recent, getattr(scorer, "n_recent", 0)), budget="uniform")
    new.layer_class_to_replicate = None
    new.layers = _twin_layers(recorded, rows)
    prompt = recorded.prompt
    ids = None if prompt.input_ids is None else prompt.input_ids.expand(rows, -1)
    new.prompt = Prompt(ids, prompt.valid.expand(rows, -1), prompt.model)
    new.conversation = copy.copy(recorded.conversation)
    new.conversation.select_rows(torch.zeros(rows, dtype=torch.long))
    n_real = prompt.valid.sum(-1)
    budget = new.prompt_budget(rows=torch.cat([keep_counts(n_real, r, new.n_sink + new.n_recent) for r in keep_ratios]))
    for i in sorted(scores):
        budget.scored(i, scores[i].expand(rows, -1, -1))
    return new


def entry_bytes(cache, row: int | None = None) -> int:
    """Bytes of the K/V entries a cache's layers store (the kept prompt entries and the tokens added since): what
    the evaluation records as ``kv_bytes``. Unlike :meth:`ProxyKVCache.nbytes`, the spare room of the buffers and
    the index tensors are left out, so that every way of building a method's cache reports the same figure.

    ``row``: of a :func:`compacted_batch` cache, the entries of that row's keep ratio alone (its spare slots left
    out)."""
    total = 0
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None:
            continue
        for t in (layer.keys, layer.values, getattr(layer, "tail_keys", None), getattr(layer, "tail_values", None)):
            if t is None:  # the global budget's tail (the tokens after the prompt) is the last two
                continue
            if row is None:
                total += t.numel() * t.element_size()
                continue
            per_entry = t.shape[1] * t.shape[-1] * t.element_size()
            n = int(layer.budgets[row]) if isinstance(layer, ProxyKVLayer) and layer.budgets is not None \
                else t.shape[-2]
            total += n * per_entry
    return total
