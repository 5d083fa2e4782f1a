"""A mapper for a dataset: its config (:func:`mapper_config_for`), the check that a config fits the dataset
(:func:`check_mapper_fits`) and starting from the weights of another mapper (:func:`init_mapper_from`)."""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from ..mapper import HybridAxialMapper, MapperConfig
from .manifest import Manifest

logger = logging.getLogger(__name__)

# mapper fields whose new parameters start at zero, a no-op: value off
ADDITIVE_FIELDS = {"direct_path": False, "layer_embedding": False}
# the input transform a dataset's statistic gets by default: sums through log1p, probabilities (maxima) through log
STATISTIC_TRANSFORMS = {"sum": "log1p", "max": "log", "lookback": "log"}
# mapper fields that may grow: the input rows they add (statistics beyond the sum) start with zero weights
# (``direct_context``: the direct path's columns for earlier proxy layers follow those of the paired layer)
WIDENING_INPUTS = {"num_statistics": (("stem.conv1.weight", 1), ("direct.weight", 2)),
                   "direct_context": (("direct.weight", 2),)}


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

    The configs must be equal, except that ``mapper`` may switch on fields of :data:`ADDITIVE_FIELDS` that
    ``start`` has off (the parameters those add are set to zero, a no-op), and may read more feature statistics
    (:data:`WIDENING_INPUTS`: e.g. the sum and the max where ``start`` read the sum; the weights on the new feature
    rows start at zero) or more earlier proxy layers in the direct path (``direct_context``), the statistics each
    through its own transform (``input_transform="log1p,log"`` after ``"log1p"``). Either way ``mapper`` starts
    out computing exactly what ``start`` computes. It may also read another number of proxy layers
    (``num_proxy_layers``, e.g. a self proxy's layer subset, ``TrainConfig.proxy_layers``): no weight depends on it,
    only which proxy layer each target layer reads.
    """
    new, old = mapper.config.to_dict(), start.config.to_dict()
    diff = {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v}
    grown = {k for k in diff if k in WIDENING_INPUTS and diff[k][1] > diff[k][0]}
    if grown and "input_transform" in diff:
        before, after = old["input_transform"].split(","), diff["input_transform"][1].split(",")
        if after[:len(before)] == before:
            grown.add("input_transform")  # the widened mapper reads its new statistics through their own transform
    repaired = {"num_proxy_layers"}  # the pairing changes, no parameter's shape
    if any(k not in grown | repaired and (k not in ADDITIVE_FIELDS or old.get(k) != ADDITIVE_FIELDS[k]) for k in diff):
        raise ValueError(f"{name} holds another mapper config (field: (checkpoint, new)) {diff}")
    if "num_statistics" in grown and (old.get("direct_context") or new.get("direct_context")):
        raise ValueError(f"{name}: widen the statistics with direct_context 0, then the direct context")
    state = start.state_dict()
    own = mapper.state_dict()
    for param, dim in (pd for k in grown for pd in WIDENING_INPUTS.get(k, ())):
        if param in state:  # the old statistics are the leading feature rows (statistic-major)
            wide = torch.zeros_like(own[param])
            wide.narrow(dim, 0, state[param].shape[dim]).copy_(state[param])
            state[param] = wide
    missing, unexpected = mapper.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{name}: unexpected parameters {unexpected}")
    with torch.no_grad():  # what start lacks (an additive field's weights) starts at zero: the same scores as start
        for param in missing:
            mapper.get_parameter(param).zero_()
    logger.info("initialised the mapper from %s%s%s", name, f" (new, at zero: {missing})" if missing else "",
                f" (widened: {sorted(grown)})" if grown else "")
