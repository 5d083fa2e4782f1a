"""Scores read straight off the prefill's own attention, with no learned mapper.

The self proxy's features (the target's own attention, per query head and key) used directly as scores: the
"no-mapper" baselines that show how much of ProxyKV's result the HybridAxialMapper itself contributes.
``"sum"`` is the attention each key receives summed over all prompt queries (H2O's accumulated attention, Zhang et
al., 2023, arXiv:2306.14048); ``"max"`` is the largest attention any other prompt query gives it; ``"lookback"``
scores a token by its novelty, one minus the largest attention it gives, as a query, to text well before it (a
token copied from earlier text scores low, one with nothing to copy from scores high).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..mapper.config import layer_pairing
from ..attention.statistics import CHUNK_SIZE, attention_sums, check_statistics
from ..cache.selection import check_kernel_size, smooth_scores
from .base import LayerInputs, LayerScorer, Prompt

GROUP_REDUCTIONS = ("max", "mean")


@dataclass(kw_only=True)
class AttentionStatisticScorer(LayerScorer):
    """One statistic of each layer's own prefill attention as the layer's scores.

    The statistic is taken per query head, then reduced over the query heads of each KV head (``group_reduce``;
    ``"max"`` as KVzip does) and optionally pooled along the keys (``kernel_size``, as SnapKV's).

    Attributes:
        statistic: ``"sum"``, ``"max"`` or ``"lookback"`` (see :func:`~proxykv_hf.attention.statistics.attention_sums`;
            ``"lookback"`` scores ``1 - lookback``, the token's novelty).
        group_reduce: ``"max"`` or ``"mean"`` over the query heads of a KV head.
        kernel_size: lift each score to the mean of this many tokens around it where that is higher (odd; 1 = off).
        n_sink: first tokens always kept.
        chunk_size: queries per chunk when the statistic is not handed over by the cache.
        statistics: what the cache hands over, ``(statistic,)`` (set from ``statistic``).

    ``statistic`` may be given by position.
    """

    statistic: str = field(default="max", kw_only=False)
    group_reduce: str = "max"
    kernel_size: int = 1
    n_sink: int = 4
    chunk_size: int = CHUNK_SIZE
    statistics: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        (self.statistic,) = check_statistics((self.statistic,))
        if self.group_reduce not in GROUP_REDUCTIONS:
            raise ValueError(f"group_reduce must be one of {GROUP_REDUCTIONS}, got {self.group_reduce!r}")
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be an int >= 0, got {self.n_sink!r}")
        self.kernel_size = check_kernel_size(self.kernel_size, "kernel_size")
        self.statistics = (self.statistic,)

    @torch.no_grad()
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        x = inputs.statistics  # (B, H, T) when the cache computed it in the attention's own pass
        device = inputs.keys.device
        if x is None:
            x = attention_sums(inputs.queries, inputs.keys, inputs.attention_mask, inputs.scaling,
                               query_valid=inputs.query_valid.to(device),
                               chunk_size=self.chunk_size, statistics=self.statistics)
        B, H, T = x.shape
        H_kv = inputs.keys.shape[1]
        grouped = x.float().view(B, H_kv, H // H_kv, T)  # (B, H_kv, G, T)
        if self.statistic == "lookback":
            grouped = 1.0 - grouped  # novelty: higher = less copied from earlier text
        scores = grouped.amax(dim=2) if self.group_reduce == "max" else grouped.mean(dim=2)  # (B, H_kv, T)
        return smooth_scores(scores, inputs.valid.to(device), self.kernel_size, keep_peaks=True)


@dataclass(kw_only=True)
class ProxyStatisticScorer(LayerScorer):
    """One statistic of a separate proxy model's attention as the target's scores, with no learned mapper: the
    "proxy's statistics without a mapper" baseline of a real proxy, the counterpart of
    :class:`AttentionStatisticScorer` (which reads the target's own attention).

    The proxy runs once on the prompt (:meth:`prepare`); target layer ``l`` (1-based, of ``L_t``) reads proxy layer
    ``ceil(l * L_s / L_t)`` (the depth-proportional pairing of the mapper and of KVzip+IAM), and target KV head ``h``
    reads the query heads of proxy KV head ``floor(h * Hkv_s / Hkv_t)``, reduced by ``group_reduce``.

    Attributes:
        proxy: the proxy model (same tokenizer as the target).
        statistic: ``"sum"``, ``"max"`` or ``"lookback"`` (scored as ``1 - lookback``, the token's novelty).
        group_reduce: ``"max"`` or ``"mean"`` over the proxy query heads read by a target KV head.
        kernel_size: lift each score to the mean of this many tokens around it where that is higher (odd; 1 = off).
        n_sink: first tokens always kept.
        chunk_size: queries per chunk in the proxy's attention accumulation.

    ``proxy`` and ``statistic`` may be given by position.
    """

    needs_input_ids = True

    proxy: torch.nn.Module = field(kw_only=False, repr=False)
    statistic: str = field(default="lookback", kw_only=False)
    group_reduce: str = "max"
    kernel_size: int = 1
    n_sink: int = 4
    chunk_size: int = CHUNK_SIZE
    _self: AttentionStatisticScorer = field(init=False, repr=False, compare=False)  # the scores of mapped features
    _features: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # (B, L_s, H_s, T)
    _layer_map: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.proxy, torch.nn.Module):
            raise ValueError(f"proxy must be a loaded model, got {type(self.proxy).__name__}")
        self._self = AttentionStatisticScorer(self.statistic, group_reduce=self.group_reduce,
                                              kernel_size=self.kernel_size, n_sink=self.n_sink,
                                              chunk_size=self.chunk_size)
        self.kernel_size = self._self.kernel_size

    def fresh(self) -> "ProxyStatisticScorer":
        return replace(self)

    @torch.no_grad()
    def prepare(self, prompt: Prompt) -> None:
        from ..models.layout import full_attention_layers
        from ..mapper.proxy import proxy_features

        target, ids = prompt.model, prompt.input_ids
        if ids is None:
            raise ValueError("the proxy statistics need the prompt's input_ids")
        if int(ids.max()) >= self.proxy.config.vocab_size:
            raise ValueError("proxy and target must share a tokenizer: the prompt has token ids outside the "
                             f"proxy's vocabulary ({self.proxy.config.vocab_size})")
        device = next(self.proxy.parameters()).device
        mask = None if bool(prompt.valid.all()) else prompt.valid.long().to(device)
        self._features = proxy_features(self.proxy, ids.to(device), mask, chunk_size=self.chunk_size,
                                        statistics=(self.statistic,),
                                        statistics_layers=full_attention_layers(self.proxy))  # (B, L_s, H_s, T)
        self._layer_map = layer_pairing(self._features.shape[1], len(full_attention_layers(target)))

    @torch.no_grad()
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        if self._features is None:
            raise RuntimeError("ProxyStatisticScorer.score before prepare (start each prompt on a fresh cache)")
        x = self._features[:, self._layer_map[inputs.compact_index]].to(inputs.keys.device)  # (B, H_s, T)
        hkv_t = inputs.keys.shape[1]
        hkv_s = self.proxy.config.get_text_config(decoder=True).num_key_value_heads
        groups = x.view(x.shape[0], hkv_s, x.shape[1] // hkv_s, x.shape[2])  # (B, Hkv_s, G_s, T)
        heads = torch.tensor([h * hkv_s // hkv_t for h in range(hkv_t)], device=x.device)
        picked = groups.index_select(1, heads).flatten(1, 2)  # (B, Hkv_t * G_s, T): each target KV head's group
        mapped = LayerInputs(inputs.layer_idx, inputs.keys, inputs.values, None, None, inputs.scaling, inputs.prompt,
                             inputs.compact_index, statistics=picked)
        if inputs.compact_index == len(self._layer_map) - 1:
            self._features = None  # the last layer has its scores
        return self._self.score(mapped)
