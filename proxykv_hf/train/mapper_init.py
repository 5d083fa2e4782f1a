"""A mapper for a dataset: its config (:func:`mapper_config_for`), the check that a config fits the dataset
(:func:`check_mapper_fits`) and starting from the weights of another mapper (:func:`init_mapper_from`)."""

from __future__ import annotations

import logging
import os
from typing import Sequence

from ..mapper.model import HybridAxialMapper, MapperConfig
from .manifest import Manifest

logger = logging.getLogger(__name__)

# the input transform a dataset's statistic gets by default: sums through log1p, probabilities (maxima) through log
STATISTIC_TRANSFORMS = {"sum": "log1p", "max": "log", "lookback": "log"}

def mapper_config_for(data: str | os.PathLike | Manifest, preset: str = "small", *,
                      statistics: Sequence[str] | None = None, proxy_layers: Sequence[int] | None = None,
                      **overrides) -> MapperConfig:
    """A :class:`MapperConfig` preset (``"paper"``, ``"small"``, ``"tiny"``) shaped for a dataset: proxy layers,
    heads and statistics (each read through :data:`STATISTIC_TRANSFORMS`; ``statistics``: a subset of the
    dataset's, as ``TrainConfig.statistics``; ``proxy_layers``: a subset of its proxy layers, as
    ``TrainConfig.proxy_layers``), target layers and KV heads, and the dataset's crop length and stride as the
    inference windows."""
    manifest = data if isinstance(data, Manifest) else Manifest.load(data)
    if statistics is not None:
        manifest = manifest.with_statistics(statistics)
    if proxy_layers is not None:
        manifest = manifest.with_proxy_layers(proxy_layers)
    if preset not in ("paper", "small", "tiny"):
        raise ValueError(f"preset must be 'paper', 'small' or 'tiny', got {preset!r}")
    transforms = [STATISTIC_TRANSFORMS[s] for s in manifest.proxy_spec().statistics]
    shape = dict(num_proxy_layers=manifest.proxy["num_layers"], num_proxy_heads=manifest.proxy["num_heads"],
                 num_statistics=len(transforms),
                 input_transform=transforms[0] if len(set(transforms)) == 1 else ",".join(transforms),
                 num_target_layers=manifest.target["num_layers"], num_target_heads=manifest.target["num_kv_heads"],
                 crop_len=manifest.data_config["crop_len"], stride=manifest.data_config["stride"])
    return getattr(MapperConfig, preset)(**{**shape, **overrides})

def check_mapper_fits(config: MapperConfig, manifest: Manifest) -> None:
    """Raise ``ValueError`` unless the mapper's shape fields match the dataset's proxy and target."""
    want = dict(num_proxy_layers=manifest.proxy["num_layers"], num_proxy_heads=manifest.proxy["num_heads"],
                num_statistics=len(manifest.proxy_spec().statistics),
                num_target_layers=manifest.target["num_layers"], num_target_heads=manifest.target["num_kv_heads"])
    got = {k: getattr(config, k) for k in want}
    if got != want:
        raise ValueError(f"mapper config shape {got} does not match the dataset {want}; "
                         "build it with mapper_config_for(data_dir, preset)")
    if manifest.data_config["crop_len"] > config.crop_len:
        logger.warning("training crops (%d tokens) are longer than the mapper's encoder window (%d): the encoder "
                       "trains on windows it will see the same way at inference", manifest.data_config["crop_len"],
                       config.crop_len)

def init_mapper_from(mapper: HybridAxialMapper, start: HybridAxialMapper, name: str = "init_from") -> None:
    """Copy the weights of ``start`` into ``mapper`` (``TrainConfig.init_from``).

    The configs must be equal, but for the number of proxy layers (``num_proxy_layers``, e.g. a self proxy's layer
    subset, ``TrainConfig.proxy_layers``): no weight depends on it, only which proxy layer each target layer reads.

    Raises:
        ValueError: another config, naming the fields that differ.
    """
    new, old = mapper.config.to_dict(), start.config.to_dict()
    diff = {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v and k != "num_proxy_layers"}
    if diff:
        raise ValueError(f"{name} holds another mapper config (field: (checkpoint, new)) {diff}")
    mapper.load_state_dict(start.state_dict(), strict=True)
    logger.info("initialised the mapper from %s", name)
