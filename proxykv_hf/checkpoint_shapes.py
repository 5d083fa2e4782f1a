"""A mapper checkpoint's config checked against its weights' shapes before any mapper is built (:mod:`.hub`).

``proxykv_config.json`` decides the mapper's sizes; a garbled or crafted one (say ``d_time`` 65536) would make
building the mapper allocate tens of gigabytes. The mapper is built on the meta device instead, and its tensor shapes
compared with those in the header of ``model.safetensors`` (read without its weights).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .mapper import HybridAxialMapper, MapperConfig


def check_weight_shapes(mapper_config: MapperConfig, prefixes: list[str], config_file: Path,
                        weights_file: Path) -> None:
    """Compare the mappers ``mapper_config`` describes (built on the meta device: nothing allocated) with the tensor
    names and shapes in the header of ``weights_file`` (no weights read), so that a config that does not fit its
    weights (a garbled or crafted one) is refused before any mapper is built. ``prefixes``: the weight-name prefix of
    each mapper the checkpoint holds."""
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights_file} is not a readable safetensors file ({err}); the checkpoint is "
                         "damaged") from err
    try:
        with torch.device("meta"):
            wanted = {name: tuple(t.shape) for name, t in HybridAxialMapper(mapper_config).state_dict().items()}
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(f"{config_file} holds a mapper config that cannot be built ({err})") from err
    for prefix in prefixes:
        for name, shape in wanted.items():
            found = shapes.get(prefix + name)
            if found != shape:
                raise ValueError(f"the weights in {weights_file} do not fit the mapper config in {config_file}: "
                                 f"{prefix + name} is {'missing' if found is None else found}, the config makes "
                                 f"{shape}")
