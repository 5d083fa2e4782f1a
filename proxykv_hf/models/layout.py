"""Facts about a model's layers that the scorers and the tooling share."""

from __future__ import annotations

from transformers import DynamicCache


def full_attention_layers(model) -> list[int]:
    """Indices of the layers KVzip scores (and ProxyKV compacts): every layer that is not sliding-window."""
    layers = DynamicCache(config=model.config).layers
    return [i for i, layer in enumerate(layers) if not getattr(layer, "is_sliding", False)]
