"""HybridAxialMapper: proxy attention features -> per-target-KV-head importance scores.

Paper section "HybridAxialMapper architecture". One shared network maps the features of one proxy layer,
``(B, H_s, N)``, to logits for one target layer, ``(B, H_l, N)``, in three stages:

1. conv stem: two ``Conv1d(k=3, p=1) + BatchNorm1d + GELU`` blocks, ``H_s -> stem_hidden -> d_time``;
2. time encoder: sinusoidal positions + a pre-norm ``nn.TransformerEncoder`` over tokens, run in windows of
   ``crop_len`` with stride ``stride`` and overlap averaging, so attention cost is O(N);
3. head stage: per token, ``H_s`` synthetic key/value slots of width ``d_head`` are read by a learned bank of
   ``H_l`` target queries, then ``Linear(d_head -> 1)``.

``H_l`` counts the target's KV heads (the cache selects per KV head). Target layer ``l`` (1-based) reads proxy layer
``ceil(l * L_s / L_l)``; without ``layer_embedding`` target layers sharing a proxy layer get identical
scores, as the paper's shared mapper implies. Scores follow the package convention: higher means keep. Where the
features carry more than the attention sum (``MapperConfig.num_statistics``), read ``H_s`` below as the
``num_statistics * H_s`` feature rows of a layer wherever the input is meant.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ._fields import check_known_fields
from .mapper_blocks import ConvStem, DirectPath, HeadStage, TimeEncoder, window_starts

logger = logging.getLogger(__name__)

INPUT_TRANSFORMS = ("log1p", "log", "none")
TIME_ENCODERS = ("transformer", "meanpool", "none")


@dataclass(kw_only=True, frozen=True)
class MapperConfig:
    """Shape and hyper-parameters of a :class:`HybridAxialMapper`; field defaults are the paper preset.

    Defaults of note:

    * ``ffn_mult = 2``: encoder FFN width ``2 * d_time`` (the paper preset's ~13M encoder parameters);
      ``ffn_mult=4`` gives a ``4 * d_time`` FFN.
    * ``stem_hidden = 256``: width of the first conv of the stem.
    * ``d_head = 48``: slot width of the head stage, whose K and V projections ``d_time -> H_s * d_head`` hold
      about ``2 * d_time * H_s * d_head`` parameters.
    * ``input_transform = "log1p"``: the stem reads ``log1p(max(x, 0))`` of the raw features. Proxy features are
      accumulated attention whose scale grows with N, with sink tokens far above the rest; ``log1p`` turns that
      growth into an additive shift and compresses the tail before BatchNorm. ``"log"`` reads
      ``log(max(x, 0) + 1e-4)`` (:data:`~proxykv_hf.mapper_blocks.LOG_FLOOR`), which keeps small probabilities
      (e.g. per-key maxima, mostly far below 0.01) apart; ``"none"`` is the identity. With several statistics,
      one transform per statistic separated by commas, e.g. ``"log1p,log"``: the sums through ``log1p``, the
      maxima through ``log``.
    * ``dropout = 0.1``: PyTorch's encoder default. The ``small`` preset uses 0, which also lets the encoder's
      attention take PyTorch's fused path when training on the CPU.

    Ablation switches: ``conv_stem=False`` replaces stage 1 by a pointwise ``Conv1d(k=1) + GELU``;
    ``time_encoder="meanpool"`` replaces the transformer by adding the window's masked mean (no parameters),
    ``"none"`` by the identity; ``head_stage=False`` replaces stage 3 by ``Linear(d_time -> H_l)``;
    ``layer_embedding=True`` adds a learned target-layer embedding before stage 3 (off in the paper).

    Beyond the paper: ``direct_path=True`` adds a residual linear path from the transformed input features to the
    logits. Per target layer ``l`` and KV head ``h`` it adds ``sum_s W[l, h, s] * f_s + b[l, h]``, with ``f_s`` the
    transformed features of proxy head ``s`` of the paired proxy layer, centred per row over real tokens (so a
    length-dependent shift of the attention sums does not move it). It gives each target layer its own weights
    on the proxy heads of its paired layer, which the shared stem, encoder and head stage do not, and passes a
    one-token spike through unsmoothed. ``W`` and ``b`` start at zero, so the path is a no-op at initialisation
    and a trained mapper can be fine-tuned with it (``docs/training.md``). ``direct_context = c`` (0 by default;
    needs ``direct_path``) lets the direct path of a target layer also read the features of the ``c`` proxy layers
    before its paired one (zeros where there are none), so that a layer can keep what the layers just before it
    single out; its weights are ``W[l, h, (j, s)]`` for ``j = 0..c`` layers back.

    Also beyond the paper: ``num_statistics`` feature rows per proxy head (``ProxySpec.statistics``): 1 reads the
    paper's attention sums, 2 the sums and the per-key maximum attention (``proxykv_hf.scoring``). The features
    then hold ``num_statistics * num_proxy_heads`` rows per layer; the stem and the direct path read them all, the
    head stage still attends over ``num_proxy_heads`` slots.
    """

    num_proxy_layers: int
    num_proxy_heads: int
    num_target_layers: int
    num_target_heads: int
    d_time: int = 512
    stem_hidden: int = 256
    num_encoder_layers: int = 6
    num_encoder_heads: int = 8
    ffn_mult: int = 2
    d_head: int = 48
    crop_len: int = 2048
    stride: int = 1024
    dropout: float = 0.1
    input_transform: str = "log1p"
    conv_stem: bool = True
    time_encoder: str = "transformer"
    head_stage: bool = True
    layer_embedding: bool = False
    direct_path: bool = False
    direct_context: int = 0
    num_statistics: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "direct_context" else 1
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"{f.name} must be {'a positive int' if least else 'an int >= 0'}, got {value!r}")
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be a bool, got {value!r}")
        if self.d_time % self.num_encoder_heads:
            raise ValueError(
                f"d_time must be divisible by num_encoder_heads, got {self.d_time} and {self.num_encoder_heads}"
            )
        if self.stride > self.crop_len:
            raise ValueError(f"stride must be <= crop_len ({self.crop_len}), got {self.stride}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        parts = self.input_transform.split(",") if isinstance(self.input_transform, str) else [None]
        if any(t not in INPUT_TRANSFORMS for t in parts) or len(parts) not in (1, self.num_statistics):
            raise ValueError(f"input_transform must be one of {INPUT_TRANSFORMS}, or one per statistic separated by "
                             f"commas ({self.num_statistics} statistics), got {self.input_transform!r}")
        if self.time_encoder not in TIME_ENCODERS:
            raise ValueError(f"time_encoder must be one of {TIME_ENCODERS}, got {self.time_encoder!r}")
        if self.direct_context and not self.direct_path:
            raise ValueError(f"direct_context {self.direct_context} needs direct_path=True")
        if self.direct_context >= self.num_proxy_layers:
            raise ValueError(f"direct_context must be below num_proxy_layers ({self.num_proxy_layers}), got "
                             f"{self.direct_context}")

    @classmethod
    def paper(cls, **kwargs: Any) -> MapperConfig:
        """The paper's ~15M mapper (d_time 512, 6 x 8-head encoder); pass the four shape fields."""
        return cls(**kwargs)

    @classmethod
    def small(cls, **kwargs: Any) -> MapperConfig:
        """A ~0.3M mapper for ~100M-class targets (e.g. SmolLM2-135M); pass the four shape fields."""
        return cls(**{**dict(d_time=128, stem_hidden=64, num_encoder_layers=2, num_encoder_heads=4, d_head=16,
                             dropout=0.0), **kwargs})

    @classmethod
    def tiny(cls, **kwargs: Any) -> MapperConfig:
        """An ~11k-parameter mapper for unit tests; shape fields default to a 2->4 layer pair."""
        defaults = dict(num_proxy_layers=2, num_proxy_heads=2, num_target_layers=4, num_target_heads=2,
                        d_time=32, stem_hidden=16, num_encoder_layers=1, num_encoder_heads=2, d_head=8,
                        crop_len=64, stride=32, dropout=0.0)
        return cls(**{**defaults, **kwargs})

    @property
    def num_features(self) -> int:
        """Feature rows per proxy layer: ``num_statistics * num_proxy_heads``."""
        return self.num_statistics * self.num_proxy_heads

    def pairing(self) -> list[int]:
        """0-based proxy layer read by each target layer (:func:`layer_pairing`)."""
        return layer_pairing(self.num_proxy_layers, self.num_target_layers)

    def direct_sources(self) -> list[list[int]]:
        """Per target layer, the proxy layers its direct path reads: the paired one, then up to
        ``direct_context`` before it, most recent first (-1 where the proxy has no such layer: zero features)."""
        return [[p - j if p - j >= 0 else -1 for j in range(self.direct_context + 1)] for p in self.pairing()]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable field dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MapperConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        check_known_fields(cls, data)
        return cls(**data)


def layer_pairing(num_proxy_layers: int, num_target_layers: int) -> list[int]:
    """0-based proxy layer read by each target layer: ``ceil(l * L_s / L_l) - 1`` for 1-based ``l`` (the paper's
    depth-proportional pairing; each proxy layer serves a run of consecutive target layers)."""
    return [-(-(l * num_proxy_layers) // num_target_layers) - 1 for l in range(1, num_target_layers + 1)]


def mask_padding(scores: Tensor, attention_mask: Tensor | None, fill_value: float = float("-inf")) -> Tensor:
    """Set padded positions of mapper scores to ``fill_value`` so Top-K never selects them.

    Args:
        scores: ``(B, ..., N)`` logits, e.g. ``(B, L_l, H_l, N)`` or ``(B, H_l, N)``.
        attention_mask: ``(B, N)``, 1 for real tokens, 0 for padding; ``None`` returns ``scores`` unchanged.
    """
    if attention_mask is None:
        return scores
    valid = attention_mask.bool().view(attention_mask.shape[0], *([1] * (scores.dim() - 2)), -1)
    return scores.masked_fill(~valid, fill_value)


class HybridAxialMapper(nn.Module):
    """The ProxyKV mapper. Returns finite logits everywhere; callers mask padding (:func:`mask_padding`).

    Args:
        config: shapes and hyper-parameters.
        window_batch: encoder windows processed together at inference; bounds memory at long N.
        layer_batch: proxy layers encoded together in eval mode (as extra batch rows).
    """

    def __init__(self, config: MapperConfig, *, window_batch: int = 8, layer_batch: int = 4) -> None:
        super().__init__()
        if window_batch < 1 or layer_batch < 1:
            raise ValueError(f"window_batch and layer_batch must be >= 1, got {window_batch}, {layer_batch}")
        self.config = config
        self.window_batch = window_batch
        self.layer_batch = layer_batch
        self.stem = ConvStem(config)
        self.time_encoder = TimeEncoder(config)
        self.head = HeadStage(config) if config.head_stage else nn.Linear(config.d_time, config.num_target_heads)
        self.layer_embedding = None
        if config.layer_embedding:
            self.layer_embedding = nn.Embedding(config.num_target_layers, config.d_time)
            nn.init.normal_(self.layer_embedding.weight, std=0.02)
        self.direct = DirectPath(config) if config.direct_path else None

    @property
    def num_features(self) -> int:
        """Feature rows per proxy layer that the mapper reads (:attr:`MapperConfig.num_features`)."""
        return self.config.num_features

    def pairing(self) -> list[int]:
        """0-based proxy layer read by each target layer (see :meth:`MapperConfig.pairing`)."""
        return self.config.pairing()

    def num_parameters_by_stage(self) -> dict[str, int]:
        """Trainable parameter counts ``{"stem", "encoder", "head"}``; a layer embedding and a direct path count
        as head."""
        count = lambda m: 0 if m is None else sum(p.numel() for p in m.parameters())  # noqa: E731
        return {"stem": count(self.stem), "encoder": count(self.time_encoder),
                "head": count(self.head) + count(self.layer_embedding) + count(self.direct)}

    def encode(self, x_layer: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Stages 1-2 for one proxy layer, windowed over time.

        Each token's output is the mean over the windows covering it; for ``N <= crop_len`` this is one pass.

        Args:
            x_layer: ``(B, H_s, N)`` proxy features.
            attention_mask: ``(B, N)``, 1 for real tokens, 0 for padding.

        Returns:
            ``(B, N, d_time)`` contextualised features.
        """
        x_layer = x_layer.to(dtype=next(self.parameters()).dtype)
        valid = None if attention_mask is None else attention_mask.bool()  # (B, N)
        z = self.stem(x_layer, valid).transpose(1, 2)  # (B, N, d_time)
        b, n, d = z.shape
        crop = self.config.crop_len
        starts = window_starts(n, crop, self.config.stride)
        if len(starts) == 1:
            return self.time_encoder(z, valid)
        out = torch.zeros_like(z)
        count = z.new_zeros(n)
        for c in range(0, len(starts), self.window_batch):
            chunk = starts[c:c + self.window_batch]
            zw = torch.stack([z[:, s:s + crop] for s in chunk]).flatten(0, 1)  # (W*B, crop, d_time)
            vw = None if valid is None else torch.stack([valid[:, s:s + crop] for s in chunk]).flatten(0, 1)
            yw = self.time_encoder(zw, vw).view(len(chunk), b, crop, d)  # (W, B, crop, d_time)
            for i, s in enumerate(chunk):
                out[:, s:s + crop] += yw[i]
                count[s:s + crop] += 1
        return out / count[None, :, None]

    def _head(self, z: Tensor, target_layer_idx: int) -> Tensor:
        """z ``(B, N, d_time)`` -> ``(B, H_l, N)``."""
        if self.layer_embedding is not None:
            z = z + self.layer_embedding.weight[target_layer_idx]
        out = self.head(z)
        return out if self.config.head_stage else out.transpose(1, 2)  # (B, H_l, N)

    def forward_layer(self, x_layer: Tensor, target_layer_idx: int,
                      attention_mask: Tensor | None = None, earlier: list[Tensor] | None = None,
                      encoded: Tensor | None = None) -> Tensor:
        """Scores for one target layer from its paired proxy layer's features.

        Args:
            x_layer: ``(B, H_s, N)`` features of proxy layer ``pairing()[target_layer_idx]``.
            target_layer_idx: 0-based target layer.
            attention_mask: ``(B, N)``, 1 for real tokens, 0 for padding.
            earlier: with ``direct_context = c > 0``, the ``(B, H_s, N)`` features of the proxy layers before the
                paired one, most recent first: ``min(c, paired layer)`` of them (the layers
                :meth:`MapperConfig.direct_sources` names).
            encoded: :meth:`encode` of ``x_layer`` where the caller has it (target layers paired with one proxy
                layer share it); None encodes here.

        Returns:
            ``(B, H_l, N)`` logits, higher means keep.
        """
        if not 0 <= target_layer_idx < self.config.num_target_layers:
            raise ValueError(f"target_layer_idx must be in [0, {self.config.num_target_layers}), "
                             f"got {target_layer_idx}")
        self._check(x_layer, 3, attention_mask)
        want = len(self.direct_layers(target_layer_idx)) - 1
        earlier = list(earlier or [])
        if len(earlier) != want:
            raise ValueError(f"target layer {target_layer_idx} reads {want} earlier proxy layers through its direct "
                             f"path (direct_context {self.config.direct_context}), got {len(earlier)}")
        for e in earlier:
            self._check(e, 3, attention_mask)
        z = self.encode(x_layer, attention_mask) if encoded is None else encoded
        out = self._head(z, target_layer_idx)
        if self.direct is None:
            return out
        feats = [self._direct_features(f, attention_mask) for f in (x_layer, *earlier)]
        return out + self.direct(self._direct_inputs(feats), target_layer_idx)

    def _direct_features(self, x_layer: Tensor, attention_mask: Tensor | None) -> Tensor:
        return self.direct.features(x_layer, None if attention_mask is None else attention_mask.bool())

    def direct_layers(self, target_layer_idx: int) -> list[int]:
        """The proxy layers the direct path of a target layer reads that exist (paired one first)."""
        return [q for q in self.config.direct_sources()[target_layer_idx] if q >= 0]

    def _direct_inputs(self, feats: list[Tensor]) -> Tensor:
        """The direct features of the paired layer and the earlier ones (most recent first) -> the direct path's
        input ``(B, (1 + direct_context) * F, N)``, zeros for layers the proxy does not have."""
        if self.config.direct_context == 0:
            return feats[0]
        missing = self.config.direct_context + 1 - len(feats)
        return torch.cat([*feats, *[torch.zeros_like(feats[0])] * missing], dim=1)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None,
                target_layers: list[int] | None = None) -> Tensor:
        """Scores for every target layer (or ``target_layers``); stages 1-2 run once per distinct paired proxy layer.

        Args:
            x: ``(B, L_s, H_s, N)`` proxy features.
            attention_mask: ``(B, N)``, 1 for real tokens, 0 for padding.
            target_layers: 0-based target layers to score, in this order (training on a random subset of layers
                per step); None = all.

        Returns:
            ``(B, L_l, H_l, N)`` logits (``L_l = len(target_layers)`` when given), higher means keep; finite at
            padded positions too.
        """
        self._check(x, 4, attention_mask)
        pairs = self.pairing()
        wanted = list(range(len(pairs))) if target_layers is None else list(target_layers)
        bad = [l for l in wanted if not 0 <= l < len(pairs)]
        if bad or not wanted:
            raise ValueError(f"target_layers must be a non-empty list of indices in [0, {len(pairs)}), got "
                             f"{target_layers}")
        scores: dict[int, Tensor] = {}
        direct_feats: dict[int, Tensor] = {}  # per proxy layer, computed once (direct_context reads earlier ones)
        proxy_layers = sorted({pairs[l] for l in wanted})
        # In eval mode (BatchNorm on running statistics, so rows are independent) several proxy layers share one
        # pass through stages 1-2 as extra batch rows: fewer, larger kernels. Training keeps one layer per pass,
        # so that BatchNorm's batch statistics stay those of one layer.
        group = 1 if self.training else self.layer_batch
        b = x.shape[0]
        for g in range(0, len(proxy_layers), group):
            ps = proxy_layers[g:g + group]
            mask = None if attention_mask is None else attention_mask.repeat(len(ps), 1)
            zs = self.encode(x[:, ps].transpose(0, 1).flatten(0, 1), mask).view(len(ps), b, x.shape[-1], -1)
            for p, z in zip(ps, zs):  # z: (B, N, d_time)
                shared = None if self.layer_embedding is not None else self._head(z, 0)
                paired = [l for l in dict.fromkeys(wanted) if pairs[l] == p]
                f = None
                if self.direct is not None:  # this proxy layer's direct features, then those of the earlier ones
                    sources = self.direct_layers(paired[0])
                    for q in sources:
                        if q not in direct_feats:
                            direct_feats[q] = self._direct_features(x[:, q], attention_mask)
                    f = self._direct_inputs([direct_feats[q] for q in sources])
                for l in paired:
                    scores[l] = self._head(z, l) if shared is None else shared
                    if f is not None:
                        scores[l] = scores[l] + self.direct(f, l)
        return torch.stack([scores[l] for l in wanted], dim=1)  # (B, len(wanted), H_l, N)

    def _check(self, x: Tensor, ndim: int, attention_mask: Tensor | None) -> None:
        cfg = self.config
        expected = (cfg.num_proxy_layers, cfg.num_features)[4 - ndim:]
        if x.dim() != ndim or tuple(x.shape[1:-1]) != expected:
            raise ValueError(f"expected features of shape (B, {', '.join(map(str, expected))}, N), "
                             f"got {tuple(x.shape)}")
        if attention_mask is not None and attention_mask.shape != (x.shape[0], x.shape[-1]):
            raise ValueError(f"attention_mask must have shape {(x.shape[0], x.shape[-1])}, "
                             f"got {tuple(attention_mask.shape)}")
