"""MapperConfig: the shape and hyper-parameters of a :class:`~proxykv_hf.mapper.HybridAxialMapper`, its presets, and
the depth-proportional pairing of target layers with proxy layers.

:mod:`proxykv_hf.mapper` builds the network from it and re-exports these names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ._fields import check_known_fields

__all__ = ["INPUT_TRANSFORMS", "MapperConfig", "layer_pairing"]

INPUT_TRANSFORMS = ("log1p", "log", "none")


@dataclass(kw_only=True, frozen=True)
class MapperConfig:
    """Shape and hyper-parameters of a :class:`~proxykv_hf.mapper.HybridAxialMapper`; defaults: the paper preset.

    Defaults of note:

    * ``ffn_mult = 2``: encoder FFN width ``2 * d_time`` (the paper preset's ~13M encoder parameters);
      ``ffn_mult=4`` gives a ``4 * d_time`` FFN.
    * ``stem_hidden = 256``: width of the first conv of the stem.
    * ``d_head = 48``: slot width of the head stage, whose K and V projections ``d_time -> H_s * d_head`` hold
      about ``2 * d_time * H_s * d_head`` parameters.
    * ``input_transform = "log1p"``: the stem reads ``log1p(max(x, 0))`` of the raw features. Proxy features are
      accumulated attention whose scale grows with N, with sink tokens far above the rest; ``log1p`` turns that
      growth into an additive shift and compresses the tail before BatchNorm. ``"log"`` reads
      ``log(max(x, 0) + 1e-4)`` (:data:`~proxykv_hf.mapper.LOG_FLOOR`), which keeps small probabilities
      (e.g. per-key maxima, mostly far below 0.01) apart; ``"none"`` is the identity. With several statistics,
      one transform per statistic separated by commas, e.g. ``"log1p,log"``: the sums through ``log1p``, the
      maxima through ``log``.
    * ``dropout = 0.1``: PyTorch's encoder default. The ``small`` preset uses 0, which also lets the encoder's
      attention take PyTorch's fused path when training on the CPU.

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
    paper's attention sums, 2 the sums and the per-key maximum attention (``proxykv_hf.attention.statistics``). The
    features then hold ``num_statistics * num_proxy_heads`` rows per layer; the stem and the direct path read them all,
    the head stage still attends over ``num_proxy_heads`` slots.
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
