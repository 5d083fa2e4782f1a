"""Running the proxy: the features X `(B, L_s, H_s, N)` that the mapper turns into target scores.

``X[b, l, h, n] = sum_q softmax(Q K^T / sqrt(D))[q, n]`` at proxy layer ``l`` and query head ``h`` (the paper's
proxy feature), accumulated in query chunks inside the proxy's own prefill. The proxy keeps no KV cache: each
layer's K/V is dropped as soon as that layer's attention has run.

Three kinds of proxy (:class:`ProxySpec`):

* ``"model"``: a separate, smaller model of the same family and tokenizer (the paper's setting).
* ``"layers"``: a subset of the target's own decoder layers (e.g. every third), run on the target's weights:
  no second model, a cheaper forward than the target's prefill.
* ``"self"``: the target's own prefill attention sums (no extra forward; scoring sits on the critical path).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from ..attention import wrapper as attention
from ..attention.compat import with_cache
from ..attention.statistics import (CHUNK_SIZE, FusedStatistics, attention_sums, causal_attention_with_statistics,
                                    check_statistics, fuses_with_attention)

logger = logging.getLogger(__name__)

PROXY_KINDS = ("model", "layers", "self")


@dataclass(kw_only=True)
class ProxySpec:
    """Which proxy produces the features, as stored in a mapper checkpoint.

    Attributes:
        kind: ``"model"``, ``"layers"`` or ``"self"``.
        model_id: Hub id or path of the proxy model (kind ``"model"``).
        layers: target layer indices the proxy runs (kind ``"layers"``; None = all), or, for kind ``"self"``, the
            target's compacted layers whose statistics the mapper reads (None = all of them; a subset spares the
            other layers the statistics, :func:`check_self_layers`).
        num_layers: L_s, the number of proxy layers the mapper reads.
        num_heads: H_s, query heads per proxy layer.
        statistics: per-key statistics of each head's attention the mapper reads
            (:data:`proxykv_hf.attention.statistics.STATISTICS`): ``["sum"]`` (the paper's feature) or e.g. ``["sum",
            "max"]``; the features then hold ``len(statistics) * H_s`` rows per layer, statistic-major.
    """

    kind: str
    num_layers: int
    num_heads: int
    model_id: str | None = None
    layers: list[int] | None = field(default=None)
    statistics: list[str] = field(default_factory=lambda: ["sum"])

    def __post_init__(self):
        if self.kind not in PROXY_KINDS:
            raise ValueError(f"proxy kind must be one of {PROXY_KINDS}, got {self.kind!r}")
        if self.kind == "layers" and not self.layers:
            raise ValueError("a 'layers' proxy needs a non-empty list of layer indices")
        if self.kind == "model" and self.layers is not None:
            raise ValueError("a 'model' proxy runs all its layers; layers must be None")
        if self.kind == "model" and (not isinstance(self.model_id, str) or not self.model_id.strip()):
            raise ValueError(f"a 'model' proxy needs model_id, the proxy model's name, directory or Hub id; got "
                             f"{self.model_id!r}")
        if self.layers is not None:
            if len(self.layers) != self.num_layers:
                raise ValueError(f"num_layers ({self.num_layers}) must equal len(layers) ({len(self.layers)})")
            self.layers = [int(i) for i in self.layers]
            if self.layers != sorted(set(self.layers)) or self.layers[0] < 0:
                raise ValueError(f"layers must be increasing, distinct and >= 0, got {self.layers}")
        self.statistics = list(check_statistics(self.statistics))

    def layer_list(self) -> list[int]:
        """:attr:`layers`, or all ``num_layers`` indices where it is None."""
        return list(self.layers) if self.layers is not None else list(range(self.num_layers))

    @property
    def num_features(self) -> int:
        """Feature rows per proxy layer: ``len(statistics) * num_heads``."""
        return len(self.statistics) * self.num_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ProxySpec":
        return cls(**data)


def check_self_layers(layers: list[int] | None, num_target_layers: int) -> list[int]:
    """The target layers whose statistics a ``"self"`` proxy reads (``layers``; None = all), checked against the
    mapper's pairing (:func:`~proxykv_hf.mapper.layer_pairing`): each target layer is scored right after its own
    attention, so the proxy layer it reads must be itself or an earlier one. E.g. ``[0, 2, 4, ...]`` serves layers
    0 and 1 from layer 0's statistics; ``[1, 3, ...]`` would make layer 0 wait for layer 1 and is refused."""
    from .model import layer_pairing

    if layers is None:
        return list(range(num_target_layers))
    if layers[-1] >= num_target_layers:
        raise ValueError(f"self-proxy layers {layers} out of range for a target with {num_target_layers} "
                         "compacted layers")
    pairs = layer_pairing(len(layers), num_target_layers)
    late = [l for l, p in enumerate(pairs) if layers[p] > l]
    if late:
        first = [l for l, p in enumerate(pairs) if l == 0 or p != pairs[l - 1]]  # each proxy layer's first target
        raise ValueError(f"target layers {late} would read the statistics of a later layer; a self proxy must read "
                         f"each target layer's statistics from itself or an earlier layer, e.g. layers {first}")
    return list(layers)


def every_kth_layer(num_layers: int, k: int) -> list[int]:
    """Layer indices ``k-1, 2k-1, ...`` (the last of each group of ``k``), always including the last layer."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    layers = list(range(k - 1, num_layers, k))
    if not layers or layers[-1] != num_layers - 1:
        layers.append(num_layers - 1)
    return layers


class _Capture:
    """Pending call that records one layer's attention sums (see :mod:`proxykv_hf.attention`)."""

    __slots__ = ("sink", "layer_idx", "valid", "chunk_size", "statistics", "fused")

    def __init__(self, sink: dict, layer_idx: int, valid: torch.Tensor | None, chunk_size: int,
                 statistics: tuple[str, ...], fused: FusedStatistics):
        self.sink, self.layer_idx, self.valid, self.chunk_size = sink, layer_idx, valid, chunk_size
        self.statistics, self.fused = statistics, fused

    def before(self, module, attention_mask, query, key):
        return attention_mask

    def attend(self, module, query, key, value, scaling):
        if not fuses_with_attention(query, self.fused):
            return None
        out, self.sink[self.layer_idx] = causal_attention_with_statistics(
            query, key, value, scaling, query_valid=self._valid(query), chunk_size=self.chunk_size,
            statistics=self.statistics, fused=self.fused)
        return out

    def after(self, module, query, key, value, attention_mask, scaling):
        self.sink[self.layer_idx] = attention_sums(query, key, attention_mask, scaling, query_valid=self._valid(query),
                                                   chunk_size=self.chunk_size, statistics=self.statistics)

    def _valid(self, query):
        return None if self.valid is None else self.valid.to(query.device)


class FeatureCache(DynamicCache):
    """A cache that stores nothing: it lets each layer attend over its own prompt K/V, records the attention sums,
    and drops the K/V right away (the proxy's memory premium is one layer's K/V plus one chunk of probabilities)."""

    def __init__(self, valid: torch.Tensor | None, chunk_size: int = CHUNK_SIZE,
                 statistics: tuple[str, ...] = ("sum",), fused: FusedStatistics | None = None,
                 only: list[int] | None = None):
        super().__init__()
        self.sums: dict[int, torch.Tensor] = {}
        self.valid, self.chunk_size, self.statistics = valid, chunk_size, tuple(statistics)
        self.fused = fused or FusedStatistics()
        self.only = None if only is None else set(only)  # the layers to record; the others attend as usual

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.only is None or layer_idx in self.only:
            attention.set_pending(_Capture(self.sums, layer_idx, self.valid, self.chunk_size, self.statistics,
                                          self.fused))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (``LlamaModel`` etc.) of a CausalLM or of a bare decoder."""
    base = getattr(model, "model", None)
    return base if base is not None and hasattr(base, "layers") else model


def _renumbered(layer: nn.Module, idx: int) -> nn.Module:
    """A shallow copy of a decoder layer whose attention reports ``layer_idx = idx`` (weights shared)."""
    twin = copy.copy(layer)
    twin._modules = dict(layer._modules)
    for name, child in layer._modules.items():
        if hasattr(child, "layer_idx"):
            attn = copy.copy(child)
            attn.layer_idx = idx
            twin._modules[name] = attn
    if hasattr(twin, "layer_idx"):
        twin.layer_idx = idx
    return twin


def layer_subset(model: nn.Module, layers: list[int]) -> nn.Module:
    """A decoder that runs only ``layers`` of ``model`` on the same weights (no copy of any parameter); its layers
    are numbered ``0..len(layers)-1`` so that it works with any cache.

    ``model`` is opted into the ProxyKV attention wrapper first (a pass-through for other caches): the subset's
    attention modules are ``model``'s own and read ``model``'s config, not the subset's copy, so opting the subset
    in later would not reach them."""
    attention.use_proxykv_attention(model)
    base = decoder_of(model)
    if list(layers) != sorted(set(layers)):
        raise ValueError(f"layers must be increasing and distinct, got {layers}")
    n = len(base.layers)
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {bad} out of range for a model with {n} layers")
    sub = copy.copy(base)  # shallow: shares every submodule and parameter
    sub._modules = dict(base._modules)
    sub.layers = nn.ModuleList([_renumbered(base.layers[i], j) for j, i in enumerate(layers)])
    cfg = copy.copy(base.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [base.config.layer_types[i] for i in layers]
    sub.config = cfg
    return sub


@torch.no_grad()
def proxy_features(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   *, layers: list[int] | None = None, chunk_size: int = CHUNK_SIZE,
                   statistics: tuple[str, ...] | list[str] = ("sum",),
                   fused: FusedStatistics | None = None, statistics_layers: list[int] | None = None) -> torch.Tensor:
    """Run ``model`` (or the subset ``layers`` of it) on the prompt and return the attention sums.

    Args:
        model: a CausalLM or decoder of a supported family.
        input_ids: `(B, N)` token ids (left padded).
        attention_mask: `(B, N)` 1 = real token.
        layers: run only these decoder layers (a layer-subset proxy); None = all layers.
        chunk_size: queries per chunk.
        statistics: per-key statistics of the attention (see :func:`~proxykv_hf.attention.statistics.attention_sums`).
        fused: how they come with each layer's attention (:class:`~proxykv_hf.attention.statistics.FusedStatistics`).
        statistics_layers: record only these of the layers run (indices among them; the others attend as usual,
            as a ``"self"`` proxy with a layer list does); None = every one.

    Returns:
        float32 `(B, L_s, S * H_s, N)` for ``S = len(statistics)`` (statistic-major), ``L_s`` the layers recorded;
        rows of padding keys are zero.
    """
    attention.use_proxykv_attention(model)
    decoder = decoder_of(model) if layers is None else layer_subset(model, layers)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    valid = attention_mask.to(torch.bool)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    cache = FeatureCache(valid, chunk_size, statistics, fused, only=statistics_layers)
    decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            **with_cache(cache), use_cache=True)
    order = sorted(cache.sums)  # captured under the layers' own indices
    wanted = len(decoder.layers) if statistics_layers is None else len(set(statistics_layers))
    if len(order) != wanted:
        raise RuntimeError(f"captured {len(order)} of {wanted} layers; is the attention wrapped?")
    return torch.stack([cache.sums[i] for i in order], dim=1)  # (B, L_s, H_s, N)
