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

Top to bottom: the helpers the stages share (windows, positions, the input transform), the three stages
(:class:`ConvStem`, :class:`TimeEncoder`, :class:`HeadStage`) and the optional :class:`DirectPath`, then
:class:`HybridAxialMapper`, which runs them. Sizes and presets are :class:`~proxykv_hf.mapper.config.MapperConfig`'s,
a module of its own that reads a checkpoint's shape without building a network.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import INPUT_TRANSFORMS, MapperConfig, layer_pairing

# the config and the pairing live in mapper_config.py; imported from here as well
__all__ = ["INPUT_TRANSFORMS", "HybridAxialMapper", "MapperConfig", "layer_pairing", "mask_padding"]

LOG_FLOOR = 1e-4  # the "log" transform reads log(x + LOG_FLOOR): attention below 1e-4 counts as none


def window_starts(n: int, crop_len: int, stride: int) -> list[int]:
    """Start offsets of the encoder windows over ``n`` tokens; the last window ends exactly at ``n``."""
    if n <= crop_len:
        return [0]
    starts = list(range(0, n - crop_len + 1, stride))
    if starts[-1] + crop_len < n:
        starts.append(n - crop_len)
    return starts


def sinusoidal_encoding(positions: Tensor, dim: int) -> Tensor:
    """Transformer sinusoidal encoding. positions ``(..., N)`` -> ``(..., N, dim)`` (float32)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=positions.device) / max(half, 1))
    angles = positions.float()[..., None] * freqs  # (..., N, half)
    enc = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return nn.functional.pad(enc, (0, dim - 2 * half))


def transform_features(x: Tensor, transform: str) -> Tensor:
    """The mapper's input transform (``MapperConfig.input_transform``) on raw proxy features ``(..., S * H_s, N)``;
    a comma-separated transform applies one per statistic (each a block of ``H_s`` rows)."""
    parts = transform.split(",")
    if len(parts) > 1:
        return torch.cat([transform_features(block, t) for block, t in zip(x.chunk(len(parts), dim=-2), parts)],
                         dim=-2)
    if transform == "log1p":
        return torch.log1p(x.clamp_min(0))
    if transform == "log":
        return torch.log(x.clamp_min(0) + LOG_FLOOR)
    return x


class ConvStem(nn.Module):
    """Stage 1. ``(B, H_s, N)`` features -> ``(B, d_time, N)``.

    Padded positions are zeroed before each conv, so in eval mode right/left padding looks like the conv's own
    zero padding to real tokens. In train mode BatchNorm statistics still include padded positions.
    """

    def __init__(self, config: MapperConfig) -> None:
        super().__init__()
        self.transform = config.input_transform
        self.conv1 = nn.Conv1d(config.num_features, config.stem_hidden, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm1d(config.stem_hidden)
        self.conv2 = nn.Conv1d(config.stem_hidden, config.d_time, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm1d(config.d_time)

    def forward(self, x: Tensor, valid: Tensor | None = None) -> Tensor:
        """x ``(B, H_s, N)``, valid ``(B, N)`` bool -> ``(B, d_time, N)``."""
        x = transform_features(x, self.transform)
        keep = None if valid is None else valid[:, None, :].to(x.dtype)  # (B, 1, N)
        if keep is not None:
            x = x * keep
        h = nn.functional.gelu(self.bn1(self.conv1(x)))  # (B, stem_hidden, N)
        if keep is not None:
            h = h * keep  # padding must look like the conv's zero padding to its real neighbours
        return nn.functional.gelu(self.bn2(self.conv2(h)))  # (B, d_time, N)


class TimeEncoder(nn.Module):
    """Stage 2 on one window. ``(B, W, d_time)`` -> ``(B, W, d_time)``; positions count real tokens only."""

    def __init__(self, config: MapperConfig) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            config.d_time, config.num_encoder_heads, dim_feedforward=config.ffn_mult * config.d_time,
            dropout=config.dropout, activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.num_encoder_layers, norm=nn.LayerNorm(config.d_time),
                                             enable_nested_tensor=False)

    def forward(self, z: Tensor, valid: Tensor | None = None) -> Tensor:
        """z ``(B, W, d_time)``, valid ``(B, W)`` bool -> ``(B, W, d_time)``."""
        if valid is None:
            positions = torch.arange(z.shape[1], device=z.device)[None]  # (1, W): the same for every window
            pad = None
        else:
            positions = (valid.long().cumsum(1) - 1).clamp_min(0)  # (B, W)
            pad = ~valid
            pad = pad & ~pad.all(1, keepdim=True)  # all-padding windows attend freely: finite, ignored later
        z = z + sinusoidal_encoding(positions, z.shape[-1]).to(z.dtype)
        if not self.training:
            return self.encode_sdpa(z, pad)
        return self.encoder(z, src_key_padding_mask=pad)

    def encode_sdpa(self, z: Tensor, pad: Tensor | None = None) -> Tensor:
        """The encoder's eval-mode forward on its own weights, with attention through
        ``F.scaled_dot_product_attention`` (pre-norm layers, GELU, no dropout); on a CPU under bfloat16 autocast, the
        unpadded windows' attention through :func:`window_attention_bf16` instead.

        Equal to the module's own forward within float rounding, and faster in eval mode on the CPU (where
        ``nn.TransformerEncoder``'s fused path computes float32 attention as batched matmuls and a separate softmax)
        and on a GPU (where its path under autocast launches more element-wise kernels; docs/performance.md).

        Args:
            z: ``(B, W, d_time)`` window inputs with positions added.
            pad: ``(B, W)`` bool, True on padding keys; None = no padding.
        """
        b, w, d = z.shape
        mask = None if pad is None else ~pad[:, None, None, :]  # (B, 1, 1, W): True = attend
        for layer in self.encoder.layers:
            attn = layer.self_attn
            qkv = nn.functional.linear(layer.norm1(z), attn.in_proj_weight, attn.in_proj_bias)
            q, k, v = qkv.view(b, w, 3, attn.num_heads, d // attn.num_heads).permute(2, 0, 3, 1, 4)
            if mask is None and q.device.type == "cpu" and q.dtype == torch.bfloat16:
                o = window_attention_bf16(q, k, v)
            else:
                o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, heads, W, d_head)
            z = z + attn.out_proj(o.transpose(1, 2).reshape(b, w, d))
            z = z + layer.linear2(nn.functional.gelu(layer.linear1(layer.norm2(z))))
        return self.encoder.norm(z)


# (window, head) pairs per batched matmul of window_attention_bf16: their logits (8 x 512 x 512 in bfloat16, 4 MiB)
# stay in the L3 cache between the two matmuls and the softmax
WINDOW_ATTENTION_ROWS = 8


def window_attention_bf16(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Unmasked attention over the encoder's windows on a CPU, in bfloat16: ``(B, heads, W, d_head)`` each ->
    ``(B, heads, W, d_head)``.

    What ``F.scaled_dot_product_attention`` computes, as two batched matmuls and a softmax over a few (window, head)
    pairs at a time. PyTorch's CPU flash kernel runs no faster in bfloat16 than in float32 at the mapper's head
    width, while the batched matmuls take the CPU's bfloat16 dot products (AVX512-BF16, AMX): the mapper runs faster
    (docs/performance.md, "How the CPU path runs"). The logits and probabilities are rounded to bfloat16, which
    changes the kept tokens about as little as autocast's own rounding does.
    """
    b, h, w, d = q.shape
    qf, kf, vf = (q * d**-0.5).flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)  # (B * heads, W, d_head)
    out = torch.empty(b * h, w, v.shape[-1], dtype=v.dtype, device=v.device)
    for i in range(0, b * h, WINDOW_ATTENTION_ROWS):
        rows = slice(i, i + WINDOW_ATTENTION_ROWS)
        probs = torch.bmm(qf[rows], kf[rows].transpose(1, 2)).softmax(-1)
        torch.bmm(probs.to(vf.dtype), vf[rows], out=out[rows])
    return out.view(b, h, w, -1)


class HeadStage(nn.Module):
    """Stage 3. ``(B, N, d_time)`` -> ``(B, H_l, N)`` logits via per-token cross-attention over H_s slots."""

    def __init__(self, config: MapperConfig) -> None:
        super().__init__()
        self.h_s, self.d_head = config.num_proxy_heads, config.d_head
        self.k_proj = nn.Linear(config.d_time, config.num_proxy_heads * config.d_head)
        self.v_proj = nn.Linear(config.d_time, config.num_proxy_heads * config.d_head)
        self.queries = nn.Parameter(torch.randn(config.num_target_heads, config.d_head) * config.d_head**-0.5)
        self.out = nn.Linear(config.d_head, 1)

    def forward(self, z: Tensor) -> Tensor:
        """z ``(B, N, d_time)`` -> logits ``(B, H_l, N)``."""
        b, n, _ = z.shape
        k = self.k_proj(z).view(b, n, self.h_s, self.d_head)  # (B, N, H_s, d_head)
        v = self.v_proj(z).view(b, n, self.h_s, self.d_head)  # (B, N, H_s, d_head)
        att = torch.einsum("hd,bnsd->bnhs", self.queries, k) * self.d_head**-0.5  # (B, N, H_l, H_s)
        o = torch.einsum("bnhs,bnsd->bnhd", att.softmax(-1), v)  # (B, N, H_l, d_head)
        return self.out(o).squeeze(-1).transpose(1, 2)  # (B, H_l, N)


class DirectPath(nn.Module):
    """Beyond the paper (``MapperConfig.direct_path``): per (target layer, KV head) a linear combination of the
    paired proxy layer's transformed, row-centred features (and, with ``direct_context``, those of the proxy layers
    just before it), added to the stage-3 logits. Zero-initialised."""

    def __init__(self, config: MapperConfig) -> None:
        super().__init__()
        self.transform = config.input_transform
        self.weight = nn.Parameter(torch.zeros(config.num_target_layers, config.num_target_heads,
                                               (1 + config.direct_context) * config.num_features))
        self.bias = nn.Parameter(torch.zeros(config.num_target_layers, config.num_target_heads))

    def features(self, x_layer: Tensor, valid: Tensor | None = None) -> Tensor:
        """x_layer ``(B, H_s, N)`` raw features, valid ``(B, N)`` bool -> ``(B, H_s, N)`` transformed features,
        centred per row over real tokens (0 on padding); shared by every target layer that reads this proxy layer."""
        f = transform_features(x_layer.to(self.weight.dtype), self.transform)  # (B, H_s, N)
        keep = torch.ones_like(f[:, :1]) if valid is None else valid[:, None, :].to(f.dtype)  # (B, 1, N)
        mean = (f * keep).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp_min(1)  # (B, H_s, 1)
        return (f - mean) * keep

    def forward(self, features: Tensor, target_layer_idx: int) -> Tensor:
        """:meth:`features` of the paired proxy layer (then of the ``direct_context`` layers before it, most recent
        first, concatenated along the rows) -> ``(B, H_l, N)`` logits of one target layer."""
        out = torch.einsum("hs,bsn->bhn", self.weight[target_layer_idx], features)  # (B, H_l, N)
        return out + self.bias[target_layer_idx][None, :, None]


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
