"""HybridAxialMapper: proxy attention features -> per-target-KV-head importance scores.

Paper section "HybridAxialMapper architecture". One shared network maps the features of one proxy layer,
``(B, H_s, N)``, to logits for one target layer, ``(B, H_l, N)``, in three stages:

1. conv stem: two ``Conv1d(k=3, p=1) + BatchNorm1d + GELU`` blocks, ``H_s -> stem_hidden -> d_time``;
2. time encoder: sinusoidal positions + a pre-norm ``nn.TransformerEncoder`` over tokens, run in windows of
   ``crop_len`` with stride ``stride`` and overlap averaging, so attention cost is O(N);
3. head stage: per token, ``H_s`` synthetic key/value slots of width ``d_head`` are read by a learned bank of
   ``H_l`` target queries, then ``Linear(d_head -> 1)``.

``H_l`` counts the target's KV heads (the cache selects per KV head). Target layer ``l`` (1-based) reads proxy layer
``ceil(l * L_s / L_l)``; target layers sharing a proxy layer get identical scores from these stages, as the paper's
shared mapper implies (the optional direct path, ``MapperConfig.direct_path``, has weights per target layer). Scores
follow the package convention: higher means keep. Where the features carry more than the attention sum
(``MapperConfig.num_statistics``), read ``H_s`` below as the ``num_statistics * H_s`` feature rows of a layer
wherever the input is meant.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from .mapper_blocks import ConvStem, DirectPath, HeadStage, TimeEncoder, window_starts
from .mapper_config import INPUT_TRANSFORMS, MapperConfig, layer_pairing

# MapperConfig and the pairing live in mapper_config.py (mapper_blocks reads them too); imported from here as before
__all__ = ["INPUT_TRANSFORMS", "HybridAxialMapper", "MapperConfig", "layer_pairing", "mask_padding"]

logger = logging.getLogger(__name__)


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
        self.head = HeadStage(config)
        self.direct = DirectPath(config) if config.direct_path else None

    @property
    def num_features(self) -> int:
        """Feature rows per proxy layer that the mapper reads (:attr:`MapperConfig.num_features`)."""
        return self.config.num_features

    def pairing(self) -> list[int]:
        """0-based proxy layer read by each target layer (see :meth:`MapperConfig.pairing`)."""
        return self.config.pairing()

    def num_parameters_by_stage(self) -> dict[str, int]:
        """Trainable parameter counts ``{"stem", "encoder", "head"}``; a direct path counts as head."""
        count = lambda m: 0 if m is None else sum(p.numel() for p in m.parameters())  # noqa: E731
        return {"stem": count(self.stem), "encoder": count(self.time_encoder),
                "head": count(self.head) + count(self.direct)}

    def encode(self, x_layer: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Stages 1-2 for one proxy layer, windowed over time.

        Each token's output is the mean over the windows covering it; for ``N <= crop_len`` this is one pass. In a
        left-padded batch longer than a window, each row's windows start at its first real token, so that a row is
        encoded as it would be alone.

        Args:
            x_layer: ``(B, H_s, N)`` proxy features.
            attention_mask: ``(B, N)``, 1 for real tokens, 0 for padding.

        Returns:
            ``(B, N, d_time)`` contextualised features.
        """
        x_layer = x_layer.to(dtype=next(self.parameters()).dtype)
        valid = None if attention_mask is None else attention_mask.bool()  # (B, N)
        z = self.stem(x_layer, valid).transpose(1, 2)  # (B, N, d_time)
        if valid is None or z.shape[1] <= self.config.crop_len or bool(valid.all()):
            return self._windows(z, valid)
        # left-padded rows longer than a window: each row's windows are laid over its own real tokens, as alone
        out = torch.zeros_like(z)
        for b, pad in enumerate((~valid).sum(-1).tolist()):
            out[b:b + 1, pad:] = self._windows(z[b:b + 1, pad:], None)
        return out

    def _windows(self, z: Tensor, valid: Tensor | None) -> Tensor:
        """The time encoder over ``z`` `(B, N, d_time)` in windows of ``crop_len``, averaged where they overlap."""
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
        out = self.head(z)  # (B, H_l, N)
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
                shared = self.head(z)  # (B, H_l, N): the same for every target layer paired with p
                paired = [l for l in dict.fromkeys(wanted) if pairs[l] == p]
                f = None
                if self.direct is not None:  # this proxy layer's direct features, then those of the earlier ones
                    sources = self.direct_layers(paired[0])
                    for q in sources:
                        if q not in direct_feats:
                            direct_feats[q] = self._direct_features(x[:, q], attention_mask)
                    f = self._direct_inputs([direct_feats[q] for q in sources])
                for l in paired:
                    scores[l] = shared
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
