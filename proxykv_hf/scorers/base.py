"""What every scorer receives and returns.

A scorer turns a prefill into importance scores `(B, H_kv, T)` per compacted layer, higher = keep (see
:mod:`proxykv_hf.cache.selection`). Three kinds, one base class each; the cache asks which one a scorer is and nothing
else:

* :class:`LayerScorer` (SnapKV, StreamingLLM, the attention statistics): :meth:`LayerScorer.score` runs right after
  each full-attention layer's prefill attention, with that layer's queries, keys and values; the cache compacts
  the layer at once. A layer scorer that reads statistics of the layer's own attention names them in
  ``statistics``, and the cache may compute them in the attention's own pass.
* :class:`BackgroundScorer` (ProxyKV's proxy): a layer scorer whose scores are computed beside the target's
  prefill, started in :meth:`Scorer.prepare`. While :meth:`BackgroundScorer.ready` is False the cache lets layers
  pass uncompacted and compacts them together once the scores are in (at the latest after the last layer).
* :class:`ModelScorer` (KVzip): :meth:`ModelScorer.score_all` runs once, after the whole prefill, and returns the
  scores of every compacted layer.

A new method is one subclass of one of these in one file, a ``@dataclass(kw_only=True)`` whose fields are its
options (validated in ``__post_init__``; the state of a prompt being scored in ``field(init=False, repr=False,
compare=False)`` fields), and one :func:`~proxykv_hf.scorers.registry.register` call to give it a name in ``proxykv
eval``, ``bench``, ``demo`` and ``generate`` (docs/design.md, "Adding a scorer").
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..models.fingerprints import weights_digest
from ..attention.statistics import CHUNK_SIZE, attention_sums


@dataclass
class Prompt:
    """The first prefill of a cache, as the cache found it.

    Attributes:
        input_ids: `(B, T)` token ids, or None when the model was called with ``inputs_embeds``.
        valid: `(B, T)` bool, True for real (non-padding) tokens.
        model: the model being run (a ``PreTrainedModel``), or None when unknown.
    """

    input_ids: torch.Tensor | None
    valid: torch.Tensor
    model: torch.nn.Module | None = None

    @property
    def length(self) -> int:
        return self.valid.shape[1]


@dataclass
class LayerInputs:
    """One full-attention layer at the end of the first prefill.

    Attributes:
        layer_idx: index of the decoder layer.
        keys: `(B, H_kv, T, D)` all keys of the prompt (after RoPE); for one chunk of a chunked prefill
            (:meth:`LayerScorer.chunk_statistics`), the keys up to the chunk's end.
        values: `(B, H_kv, T, D)` all values of the prompt (up to the chunk's end, likewise).
        queries: `(B, H, Q, D)` queries of the last prefill forward (Q = T unless the prefill was chunked), the last
            ``Q`` positions of ``keys``.
        attention_mask: the mask that forward's attention used (bool, additive float, or None = causal).
        scaling: softmax scale of the layer.
        prompt: the :class:`Prompt`.
        compact_index: position of this layer among the compacted (full-attention) layers.
        statistics: for a :class:`LayerScorer` with ``statistics``, those statistics of the layer's attention
            `(B, S * H, T)` when the cache computed them in the attention's own pass
            (:func:`~proxykv_hf.attention.statistics.attention_sums` of ``queries`` over ``keys``, no group reduction,
            padding queries weighted 0); after a chunked prefill, what :meth:`LayerScorer.chunk_statistics` gathered
            over every chunk; None otherwise.
    """

    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None
    attention_mask: torch.Tensor | None
    scaling: float
    prompt: Prompt
    compact_index: int = 0
    statistics: torch.Tensor | None = field(default=None, repr=False)

    @property
    def valid(self) -> torch.Tensor:
        """`(B, T)` True on the prompt's real tokens."""
        return self.prompt.valid

    @property
    def query_valid(self) -> torch.Tensor:
        """`(B, Q)` True on the real tokens among ``queries`` (the last ``Q`` positions of ``keys``)."""
        end = self.keys.shape[2]
        return self.prompt.valid[:, end - self.queries.shape[2]:end]


class Scorer:
    """What every scorer has. Subclass :class:`LayerScorer`, :class:`BackgroundScorer` or :class:`ModelScorer`, as a
    dataclass whose fields are the method's options (:meth:`settings` reads them; a scorer that is not a dataclass
    works too).

    Attributes:
        n_sink: first real tokens this method always keeps (merged with the cache's own setting by max).
        n_recent: last real tokens this method always keeps.
        needs_input_ids: the prompt's token ids are required (the cache refuses ``inputs_embeds`` otherwise).
        default_budget: the budget a :class:`~proxykv_hf.cache.proxykv_cache.ProxyKVCache` gives this scorer unless
            told otherwise: ``"uniform"``, or ``"global"`` where the scores compare across layers and heads (KVzip,
            a mapper with a quantile table).
    """

    n_sink: int = 0
    n_recent: int = 0
    needs_input_ids: bool = False
    default_budget = "uniform"

    def fresh(self) -> "Scorer":
        """A scorer for a new cache: ``self`` when stateless, a clean copy otherwise (sharing heavy parts)."""
        return self

    def settings(self) -> dict:
        """What this scorer does, as a JSON-able dict: ``"class"`` (:meth:`settings_class`) and its options. A
        saved context records it, and a context store keys by it (:mod:`proxykv_hf.contexts`).

        The options are the fields of a dataclass scorer (:func:`setting_fields`; of another scorer, its public
        attributes) whose values are numbers, strings, booleans, None, dtypes or lists of those; a module, such as
        a proxy model, by its name and a digest of its weights; tokenizers and devices are left out. A scorer whose
        options the fields do not show (learned weights) adds what tells two of them apart."""
        out = {"class": self.settings_class()}
        for name, value in sorted(setting_fields(self).items()):
            plain = _plain(value)
            if plain is not _SKIP:
                out[name] = plain
            elif isinstance(value, torch.nn.Module):  # a proxy model: its name and a digest of its weights (memoised)
                out[name] = {"name": str(getattr(getattr(value, "config", None), "name_or_path", "") or ""),
                             "weights": weights_digest([value])}
        return out

    @classmethod
    def settings_class(cls) -> str:
        """The ``"class"`` of :meth:`settings`: the module and name of the class."""
        return f"{cls.__module__}.{cls.__qualname__}"

    def prepare(self, prompt: Prompt) -> None:
        """Called once when the cache first sees its prompt, before any layer runs (start side work here)."""

    def global_scores(self, scores: dict[int, torch.Tensor], valid: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each layer's scores made comparable across layers and heads, for the global budget
        (:func:`~proxykv_hf.cache.selection.select_global`); ``valid`` `(B, T)` marks real tokens. Default: as they
        are."""
        return scores


class LayerScorer(Scorer):
    """Scores one layer at a time, right after its prefill attention.

    Attributes:
        statistics: names from :data:`~proxykv_hf.attention.statistics.STATISTICS` of the layer's own attention that
            :meth:`score` reads; the cache may compute them with the attention output in one pass and hand them
            over as ``inputs.statistics``.
    """

    statistics: tuple[str, ...] = ()

    def statistics_for(self, compact_index: int) -> tuple[str, ...]:
        """The statistics :meth:`score` reads from the compacted layer at ``compact_index``: :attr:`statistics`
        on every layer unless a scorer says otherwise."""
        return self.statistics

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        """Scores `(B, H_kv, T)` of one layer."""
        raise NotImplementedError(f"{type(self).__name__}.score")

    def chunk_statistics(self, inputs: LayerInputs) -> torch.Tensor | None:
        """What :meth:`score` reads from the prompt's queries, for one chunk of a chunked prefill (``inputs``: the
        chunk's queries over the keys up to its end): `(B, X, T_c)`, summed or maximised over the chunks by
        :meth:`merge_statistics` and handed to :meth:`score` as ``inputs.statistics``. None: nothing from this
        chunk. Default: the layer's :attr:`statistics` (:func:`~proxykv_hf.attention.statistics.attention_sums`); a
        scorer that reads ``inputs.queries`` otherwise overrides it (else it would see only the last chunk's
        queries)."""
        wanted = self.statistics_for(inputs.compact_index)
        if not wanted:
            return None
        return attention_sums(inputs.queries, inputs.keys, inputs.attention_mask, inputs.scaling,
                              query_valid=inputs.query_valid.to(inputs.keys.device),
                              chunk_size=getattr(self, "chunk_size", CHUNK_SIZE), statistics=wanted)

    def merge_statistics(self, total: torch.Tensor, part: torch.Tensor, compact_index: int) -> torch.Tensor:
        """``total`` and one more chunk's ``part`` (both `(B, X, T_i)`, the shorter padded with zeros at the end):
        summed for ``"sum"``, maximised for ``"max"`` and ``"lookback"`` (each query's own row appears once)."""
        return merge_statistics(total, part, self.statistics_for(compact_index))


class BackgroundScorer(LayerScorer):
    """A layer scorer whose scores are computed beside the prefill (started by :meth:`prepare`), so that the cache
    need not wait for them: layers prefilled before :meth:`ready` are compacted together later."""

    def ready(self) -> bool:
        """Whether :meth:`score` can run now without waiting on side work (checked without blocking)."""
        return True


class ModelScorer(Scorer):
    """Scores every compacted layer at once, after the whole prefill."""

    def score_all(self, prompt: Prompt, cache) -> dict[int, torch.Tensor]:
        """Scores `(B, H_kv, T)` for every compacted layer index of ``cache`` (``cache.compactable_layers()``)."""
        raise NotImplementedError(f"{type(self).__name__}.score_all")


def chunk_size_spelling(owner: Scorer, chunk_size: int | None) -> None:
    """``chunk_size=``, the 0.1.0 spelling of ``context_chunk=``: still accepted, with a ``FutureWarning``."""
    if chunk_size is not None:
        warnings.warn(f"{type(owner).__name__}(chunk_size=...) is deprecated; use context_chunk=...", FutureWarning,
                      stacklevel=4)
        owner.context_chunk = chunk_size


_SKIP = object()


def setting_fields(scorer: Scorer) -> dict:
    """The options of ``scorer`` by name: a dataclass scorer's fields, but those whose name starts with ``_`` and
    those marked ``compare=False`` (the state of a prompt being scored, or an option that does not change the
    scores, such as compiling the mapper); another scorer's public attributes."""
    if dataclasses.is_dataclass(scorer):
        return {f.name: getattr(scorer, f.name) for f in dataclasses.fields(scorer)
                if f.compare and not f.name.startswith("_")}
    return {name: value for name, value in vars(scorer).items() if not name.startswith("_")}


def _plain(value):
    """``value`` as JSON (lists for tuples, names for dtypes), or ``_SKIP`` for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    return _SKIP


def merge_statistics(total: torch.Tensor, part: torch.Tensor, statistics: tuple[str, ...]) -> torch.Tensor:
    """Statistics of two sets of queries `(B, S * H, T_i)` (statistic-major, ``statistics`` in order; the shorter
    padded with zeros at the end) as those of both: sums add, ``"max"`` and ``"lookback"`` take the maximum."""
    T = max(total.shape[-1], part.shape[-1])
    total, part = (F.pad(x, (0, T - x.shape[-1])) for x in (total, part))
    if set(statistics) <= {"sum"}:
        return total + part
    H = total.shape[1] // len(statistics)
    out = torch.empty_like(total)
    for j, name in enumerate(statistics):
        a, b = total[:, j * H:(j + 1) * H], part[:, j * H:(j + 1) * H]
        out[:, j * H:(j + 1) * H] = a + b if name == "sum" else torch.maximum(a, b)
    return out
