"""What every scorer receives and returns.

A scorer turns one layer's prefill into importance scores `(B, H_kv, T)`, higher = keep (see
:mod:`proxykv_hf.selection`). Two kinds exist:

* per-layer scorers (``needs_all_layers = False``) are called right after each full-attention layer's prefill
  attention, with that layer's queries, keys and values; the cache compacts the layer at once.
* global scorers (``needs_all_layers = True``, e.g. KVzip) are called once after the last layer's prefill and
  return the scores of every compacted layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
        keys: `(B, H_kv, T, D)` all keys of the prompt (after RoPE).
        values: `(B, H_kv, T, D)` all values of the prompt.
        queries: `(B, H, Q, D)` queries of the last prefill forward (Q = T unless the prefill was chunked).
        attention_mask: the mask that forward's attention used (bool, additive float, or None = causal).
        scaling: softmax scale of the layer.
        prompt: the :class:`Prompt`.
        compact_index: position of this layer among the compacted (full-attention) layers.
        statistics: for a scorer with ``own_statistics``, the layer's attention statistics `(B, S * H, T)` when the
            cache computed them in the attention's own pass (:func:`~proxykv_hf.scoring.attention_sums` of
            ``queries`` over ``keys``, no group reduction, padding queries weighted 0); None otherwise.
    """

    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None
    attention_mask: torch.Tensor | None
    scaling: float
    prompt: Prompt
    compact_index: int = 0
    module: torch.nn.Module | None = field(default=None, repr=False)
    statistics: torch.Tensor | None = field(default=None, repr=False)

    @property
    def valid(self) -> torch.Tensor:
        return self.prompt.valid


class Scorer:
    """Base class. Subclasses set the class attributes they need and implement :meth:`score` or
    :meth:`score_all`.

    Attributes:
        n_sink: first real tokens this method always keeps (merged with the cache's own setting by max).
        n_recent: last real tokens this method always keeps.
        needs_all_layers: call :meth:`score_all` once after the whole prefill instead of :meth:`score` per layer.
        needs_input_ids: the prompt's token ids are required.
        query_free: :meth:`score` does not read the layer's queries, keys or values (scores computed elsewhere,
            e.g. by a proxy on a side stream): the cache may then call it later, once :meth:`ready` says so.
        own_statistics: statistics of each layer's own prefill attention that :meth:`score` needs (names from
            :data:`~proxykv_hf.scoring.STATISTICS`); the cache may compute them with the attention output in one
            pass and hand them over as ``inputs.statistics`` (chunked by the scorer's ``chunk_size``).
    """

    n_sink: int = 0
    n_recent: int = 0
    needs_all_layers: bool = False
    needs_input_ids: bool = False
    query_free: bool = False
    own_statistics: tuple[str, ...] = ()

    def fresh(self) -> "Scorer":
        """A scorer for a new cache: ``self`` when stateless, a clean copy otherwise (sharing heavy parts)."""
        return self

    def prepare(self, prompt: Prompt) -> None:
        """Called once when the cache first sees its prompt, before any layer runs (start side work here)."""

    def ready(self) -> bool:
        """Whether :meth:`score` can run now without waiting on side work (checked without blocking)."""
        return True

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        """Scores `(B, H_kv, T)` of one layer."""
        raise NotImplementedError(f"{type(self).__name__} does not score layer by layer")

    def score_all(self, prompt: Prompt, cache) -> dict[int, torch.Tensor]:
        """Scores `(B, H_kv, T)` for every compacted layer index of ``cache`` (``cache.compactable_layers()``)."""
        raise NotImplementedError(f"{type(self).__name__} does not score all layers at once")
