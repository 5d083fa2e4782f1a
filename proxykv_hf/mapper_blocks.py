"""The building blocks of :class:`~proxykv_hf.mapper.HybridAxialMapper`: the input transform, the three stages
(:class:`ConvStem`, :class:`TimeEncoder`, :class:`HeadStage`) and the optional :class:`DirectPath`, with the
window and position helpers they share. Each block takes its sizes from a
:class:`~proxykv_hf.mapper_config.MapperConfig`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .mapper_config import MapperConfig

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
