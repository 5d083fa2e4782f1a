"""Real model shapes for speed work with random weights (speed does not depend on weight values).

The configs are written out here (no download): the published sizes of each model.
"""

from __future__ import annotations

import torch

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, head_dim=128, tie_word_embeddings=False),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, head_dim=64, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       max_position_embeddings=131072, tie_word_embeddings=False, use_sliding_window=False),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                         max_position_embeddings=131072, tie_word_embeddings=True, use_sliding_window=False),
}

PAIRS = {"llama-3.1-8b": "llama-3.2-1b", "qwen2.5-7b": "qwen2.5-1.5b"}


def shape_config(shape: str):
    """The transformers config of ``shape`` (see :data:`SHAPES`)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    spec = dict(SHAPES[shape])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def pair_mapper_config(shape: str, preset: str = "paper", **overrides):
    """A mapper config (``MapperConfig.<preset>``: paper, small or tiny) between the target ``shape`` and its proxy
    ``PAIRS[shape]``: every query head of every proxy layer in, every KV head of every target layer out; other
    fields from ``overrides`` (e.g. ``stride=2048``)."""
    from ..mapper.model import MapperConfig

    if shape not in PAIRS or preset not in ("paper", "small", "tiny"):
        raise ValueError(f"no mapper for shape {shape!r} with preset {preset!r}; shapes with a proxy: "
                         f"{', '.join(PAIRS)}; presets: paper, small, tiny")
    target, proxy = SHAPES[shape], SHAPES[PAIRS[shape]]
    return getattr(MapperConfig, preset)(
        num_proxy_layers=proxy["num_hidden_layers"], num_proxy_heads=proxy["num_attention_heads"],
        num_target_layers=target["num_hidden_layers"], num_target_heads=target["num_key_value_heads"], **overrides)


def random_model(shape: str, *, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 attn_implementation: str = "sdpa", seed: int = 0):
    """A causal LM with the shape ``shape`` (see :data:`SHAPES`) and random weights, built on ``device``."""
    from transformers import AutoModelForCausalLM

    cfg = shape_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise directly on the device (an 8B model in a few seconds on a GPU)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()
