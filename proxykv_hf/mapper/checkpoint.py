"""Mapper checkpoints: what a trained mapper needs to be used (:class:`Checkpoint`, its :class:`TargetSpec` and the
proxy's :class:`~proxykv_hf.mapper.proxy.ProxySpec`), checked when built, and the directory it is saved as.

A checkpoint is a directory with three files, safetensors only (no pickle):

* ``proxykv_config.json``: format version, mapper config, proxy spec, target description (model id, number of
  compacted layers, KV heads), the layer pairing, training-data summary and validation metrics, and the quantile
  table that makes scores comparable across heads under the global budget (:mod:`proxykv_hf.mapper.calibration`).
* ``model.safetensors``: the mapper weights (those of any extra mapper under ``extra_mappers.<i>.``).
* ``README.md``: a generated model card.

Reading one checks the config against the weights' shapes before any mapper is built. Finding a checkpoint by name
(bundled with the package, a local directory or a Hub id) and publishing one is :mod:`proxykv_hf.mapper.hub`'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ._fields import check_known_fields
from .calibration import calibrate, check_quantiles, table_as_list
from .model import HybridAxialMapper, MapperConfig
from .proxy import ProxySpec, check_self_layers

CONFIG_NAME = "proxykv_config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
FORMAT_VERSION = 1
MAX_MAPPERS = 4096  # layer_mappers' indices: one mapper per target layer at most
EXTRA_PREFIX = "extra_mappers."  # weight names of Checkpoint.extra_mappers[i]: "extra_mappers.<i>.<name>"
CONFIG_KEYS = ("format_version", "mapper", "proxy", "target", "pairing", "layer_mappers", "training", "metrics",
               "global_quantiles")
"""The keys of ``proxykv_config.json`` (:func:`save_checkpoint`); another is refused when read."""


def _weight_prefix(i: int) -> str:
    """The prefix of the weight names of ``Checkpoint.mappers[i]`` in ``model.safetensors``."""
    return "" if i == 0 else f"{EXTRA_PREFIX}{i - 1}."


@dataclass(kw_only=True)
class TargetSpec:
    """The target model a mapper was trained for.

    Attributes:
        model_id: Hub id or path (informative; any model with the same shape can use the mapper).
        model_type: transformers ``model_type``.
        num_layers: number of compacted (full-attention) layers, L_l.
        num_kv_heads: KV heads per layer, H_l.
        num_heads: query heads per layer.
    """

    model_id: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    num_heads: int

    def __post_init__(self) -> None:
        for name in ("model_id", "model_type"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"target {name} must be a non-empty string, got {value!r}")
        for name in ("num_layers", "num_kv_heads", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"target {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"target num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> TargetSpec:
        """Inverse of :meth:`to_dict`; a missing, unknown or mistyped field raises ``ValueError`` naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"target must be an object of {[f.name for f in fields(cls)]}, got {data!r}")
        check_known_fields(cls, data)
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise ValueError(f"target fields {missing} are missing")
        return cls(**data)


@dataclass(kw_only=True)
class Checkpoint:
    """Everything needed to use a trained mapper.

    Attributes:
        extra_mappers: further mappers of ``mapper``'s config (e.g. another fine-tune of it) for the target layers
            ``layer_mappers`` gives them.
        layer_mappers: per target layer, the mapper that scores it: 0 is ``mapper``, ``i`` is
            ``extra_mappers[i - 1]``; None scores every layer with ``mapper``. Each layer runs its own mapper only,
            so scoring costs what one mapper costs.
        global_quantiles: `(target layers, KV heads, points)` quantile table of the oracle's log-scores
            (:func:`~proxykv_hf.mapper.calibration.fit_quantiles`) that :meth:`global_scores` reads; None: the
            global budget compares the logits as they are.
    """

    mapper: HybridAxialMapper
    proxy: ProxySpec
    target: TargetSpec
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    extra_mappers: list[HybridAxialMapper] = field(default_factory=list)
    layer_mappers: list[int] | None = None
    global_quantiles: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._check_layer_mappers()
        if self.global_quantiles is not None:
            self.global_quantiles = check_quantiles(self.global_quantiles, self.target.num_layers,
                                                    self.target.num_kv_heads)
        cfg = self.mapper.config
        got = (cfg.num_proxy_layers, cfg.num_proxy_heads, cfg.num_statistics)
        want = (self.proxy.num_layers, self.proxy.num_heads, len(self.proxy.statistics))
        if got != want:
            raise ValueError(f"the mapper reads (proxy layers, heads, statistics) = {got}, but its proxy gives "
                             f"{want} ({self.proxy.statistics})")
        if self.proxy.kind == "self":
            if self.proxy.layers is None and self.proxy.num_layers != self.target.num_layers:
                raise ValueError(f"a self proxy without a layer list reads every target layer: num_layers "
                                 f"{self.proxy.num_layers}, but the target has {self.target.num_layers}")
            check_self_layers(self.proxy.layers, self.target.num_layers)

    def _check_layer_mappers(self) -> None:
        self.extra_mappers = list(self.extra_mappers)
        if self.layer_mappers is None:
            if self.extra_mappers:
                raise ValueError("extra_mappers need layer_mappers: which mapper scores each target layer")
            return
        n = len(self.extra_mappers)
        choice = list(self.layer_mappers)
        if len(choice) != self.target.num_layers or any(type(i) is not int or not 0 <= i <= n for i in choice):
            raise ValueError(f"layer_mappers must give each of the target's {self.target.num_layers} layers a "
                             f"mapper index in [0, {n}] (0 = mapper, i = extra_mappers[i - 1]), got {choice}")
        unused = sorted(set(range(1, n + 1)) - set(choice))
        if unused:
            raise ValueError(f"extra mappers {unused} score no layer (layer_mappers {choice})")
        for i, m in enumerate(self.extra_mappers, 1):
            if m.config != self.mapper.config:
                raise ValueError(f"extra mapper {i} has another config than the checkpoint's mapper; every mapper "
                                 "of a checkpoint reads the same features and has the same shape")
        self.layer_mappers = choice

    @property
    def mappers(self) -> list[HybridAxialMapper]:
        """``mapper`` and the extra mappers, in the order ``layer_mappers`` indexes them."""
        return [self.mapper, *self.extra_mappers]

    def mapper_for(self, layer: int) -> HybridAxialMapper:
        """The mapper that scores target layer ``layer`` (0-based)."""
        return self.mapper if self.layer_mappers is None else self.mappers[self.layer_mappers[layer]]

    def only_mapper(self, purpose: str) -> HybridAxialMapper:
        """``mapper``, for uses that take one mapper (training from it); raises for a checkpoint whose layers are
        scored by several."""
        if self.extra_mappers:
            raise ValueError(f"{purpose} takes a checkpoint with one mapper; this one scores its layers with "
                             f"{len(self.mappers)} (layer_mappers {self.layer_mappers})")
        return self.mapper

    def to(self, device) -> "Checkpoint":
        for m in self.mappers:
            m.to(device)
        return self

    def map_features(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Every target layer's logits ``(B, L_l, H_l, N)`` from proxy features ``x`` ``(B, L_s, H_s, N)``, each
        layer's from its own mapper (:meth:`HybridAxialMapper.forward`)."""
        if self.layer_mappers is None:
            return self.mapper(x, attention_mask=attention_mask)
        out = None
        for i, m in enumerate(self.mappers):
            layers = [l for l, j in enumerate(self.layer_mappers) if j == i]
            if not layers:
                continue
            part = m(x, attention_mask=attention_mask, target_layers=layers)
            if out is None:
                out = part.new_empty(part.shape[0], len(self.layer_mappers), *part.shape[2:])
            out[:, layers] = part
        return out

    def global_scores(self, scores: dict[int, torch.Tensor], valid: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each target layer's logits ``(B, H_kv, T)`` made comparable across layers and heads through the
        quantile table (:func:`~proxykv_hf.mapper.calibration.calibrate`); as they are without one. ``scores`` holds
        every layer the mapper scores, keyed by cache layer index: the k-th in order reads the table's k-th row (a
        hybrid model's cache indices skip its sliding layers)."""
        if self.global_quantiles is None:
            return scores
        if len(scores) != self.global_quantiles.shape[0]:
            raise ValueError(f"the quantile table has {self.global_quantiles.shape[0]} layers, the scores "
                             f"{len(scores)}")
        return {i: calibrate(scores[i], valid.to(scores[i].device), self.global_quantiles[k])
                for k, i in enumerate(sorted(scores))}

    def check_target(self, config) -> None:
        """Raise if a target model's config does not match the one the mapper was trained for.

        The mapper scores ``num_layers`` full-attention layers of ``num_kv_heads`` KV heads; a proxy that runs the
        target's own attention (kind ``"self"`` or ``"layers"``) also hands it features of each query head, so the
        model's query heads must then match the proxy's ``num_heads`` too.

        Raises:
            ValueError: naming the mapper's and the model's layers and heads.
        """
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = getattr(text, "layer_types", None)
        n_full = sum(t == "full_attention" for t in types) if types else text.num_hidden_layers
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        got = (n_full, kv)
        want = (self.target.num_layers, self.target.num_kv_heads)
        if got != want:
            raise ValueError(
                f"mapper was trained for a target with {want[0]} full-attention layers and {want[1]} KV heads "
                f"({self.target.model_id}), but the model has {got[0]} layers and {got[1]} KV heads"
            )
        if self.proxy.kind in ("self", "layers") and heads != self.proxy.num_heads:
            raise ValueError(
                f"mapper reads features of {self.proxy.num_heads} query heads per layer from the model's own "
                f"attention ({self.proxy.kind!r} proxy, trained on {self.target.model_id}), but the model has "
                f"{heads} query heads"
            )


def _card(ckpt: Checkpoint) -> str:
    m = ckpt.metrics
    lines = [
        "---", "library_name: proxykv_hf", "tags: [proxykv, kv-cache, long-context]", "---", "",
        f"# ProxyKV mapper for `{ckpt.target.model_id}`", "",
        "A HybridAxialMapper that maps proxy attention features to per-(layer, KV head, token) importance scores",
        "for KV-cache pruning (ProxyKV). Use it with `proxykv_hf`:", "",
        "```python", "from proxykv_hf import ProxyKVCache",
        "cache = ProxyKVCache.from_pretrained(\"<this repo or directory>\", keep_ratio=0.3)",
        "out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values=cache before 5.24",
        "```", "",
        "| | |", "|---|---|",
        f"| target | `{ckpt.target.model_id}` ({ckpt.target.num_layers} layers, {ckpt.target.num_kv_heads} KV heads) |",
        f"| proxy | {ckpt.proxy.kind}: `{ckpt.proxy.model_id or ckpt.proxy.layers or 'target attention'}` |",
        f"| proxy features | attention {' and '.join(ckpt.proxy.statistics)} per head and token |",
        f"| mapper parameters | {sum(p.numel() for p in ckpt.mapper.parameters()):,}"
        + (f" each, {len(ckpt.mappers)} mappers |" if ckpt.extra_mappers else " |"),
    ]
    if ckpt.global_quantiles is not None:
        lines.append(f"| global budget | quantile table, {ckpt.global_quantiles.shape[-1]} points per head |")
    if ckpt.layer_mappers is not None:
        lines.append(f"| mapper of each target layer (`layer_mappers`, 0 = the first) | {ckpt.layer_mappers} |")
    for key, value in sorted(ckpt.training.items()):
        lines.append(f"| training {key} | {value} |")
    for key, value in sorted(m.items()):
        lines.append(f"| validation {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |")
    return "\n".join(lines) + "\n"


def save_checkpoint(ckpt: Checkpoint, directory: str | os.PathLike) -> Path:
    """Write ``ckpt`` to ``directory`` (created if needed) and return the path."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "format_version": FORMAT_VERSION,
        "mapper": ckpt.mapper.config.to_dict(),
        "proxy": ckpt.proxy.to_dict(),
        "target": ckpt.target.to_dict(),
        "pairing": ckpt.mapper.pairing(),
        "layer_mappers": ckpt.layer_mappers,
        "training": ckpt.training,
        "metrics": ckpt.metrics,
    }
    layers = [] if ckpt.global_quantiles is None else table_as_list(ckpt.global_quantiles)
    if layers:  # one line per target layer, not one per number
        config["global_quantiles"] = [f"@layer-{i}@" for i in range(len(layers))]
    state = {}
    for i, m in enumerate(ckpt.mappers):
        prefix = _weight_prefix(i)
        # cloned: two mappers may share tensors (the same mapper for two indices), which safetensors refuses
        state.update({prefix + k: v.detach().cpu().contiguous().clone() for k, v in m.state_dict().items()})
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    text = json.dumps(config, indent=2, sort_keys=True)
    for i, layer in enumerate(layers):
        text = text.replace(f'"@layer-{i}@"', json.dumps(layer, separators=(",", ":")), 1)
    (path / CONFIG_NAME).write_text(text + "\n")
    (path / CARD_NAME).write_text(_card(ckpt))
    return path


def read_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read a checkpoint directory written by :func:`save_checkpoint` (names and Hub ids:
    :func:`proxykv_hf.mapper.hub.load_checkpoint`).

    Raises:
        FileNotFoundError: a directory without the checkpoint files (an OSError).
        ValueError: a file that cannot be read as what it should be (malformed ``proxykv_config.json``, corrupt
            ``model.safetensors``, weights that do not fit the config); the message names the file and the field.
    """
    path = Path(path)
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a ProxyKV mapper checkpoint: missing {', '.join(missing)} (a "
                                f"checkpoint directory holds {CONFIG_NAME} and {WEIGHTS_NAME}, as `proxykv train "
                                f"--out` writes them)")
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{config_file} is not valid JSON ({err}); the checkpoint is damaged") from err
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(config).__name__}")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"unsupported checkpoint format_version {config.get('format_version')!r} in {config_file}")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{config_file} is malformed: unknown keys {unknown} (a checkpoint's config holds "
                         f"{', '.join(CONFIG_KEYS)})")
    section = "mapper"
    try:
        mapper_config = MapperConfig.from_dict(config["mapper"])
        section = "proxy"
        proxy = ProxySpec.from_dict(config["proxy"])
        section = "target"
        target = TargetSpec.from_dict(config["target"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{config_file} is malformed in {section!r} ({type(err).__name__}: {err})") from err
    layer_mappers = config.get("layer_mappers")
    if layer_mappers is not None and (not isinstance(layer_mappers, list) or not layer_mappers or any(
            not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < MAX_MAPPERS for j in layer_mappers)):
        raise ValueError(f"{config_file} is malformed: layer_mappers must be null or a non-empty list of mapper "
                         f"indices in [0, {MAX_MAPPERS}), got {str(layer_mappers)[:80]!r}")
    check_weight_shapes(mapper_config, [_weight_prefix(i) for i in range(1 + max(layer_mappers or [0]))],
                        config_file, weights_file)
    try:
        state = load_file(str(weights_file), device=str(map_location))
    except SafetensorError as err:
        raise ValueError(f"{weights_file} is not a readable safetensors file ({err}); the checkpoint is "
                         "damaged") from err
    mappers = []
    for i in range(1 + max(layer_mappers or [0])):
        prefix = _weight_prefix(i)
        own = {k[len(prefix):]: v for k, v in state.items()
               if k.startswith(prefix) and (i > 0 or not k.startswith(EXTRA_PREFIX))}
        mapper = HybridAxialMapper(mapper_config)
        try:
            mapper.load_state_dict(own, strict=True)
        except RuntimeError as err:  # missing / unexpected keys, wrong shapes
            raise ValueError(f"the weights in {weights_file} do not fit the mapper config in {config_file}: "
                             f"{err}") from err
        mappers.append(mapper.to(map_location).eval())
    try:
        return Checkpoint(mapper=mappers[0], proxy=proxy, target=target, training=config.get("training", {}),
                          metrics=config.get("metrics", {}), extra_mappers=mappers[1:], layer_mappers=layer_mappers,
                          global_quantiles=config.get("global_quantiles"))
    except ValueError as err:
        raise ValueError(f"{config_file} is malformed: {err}") from err


def check_weight_shapes(mapper_config: MapperConfig, prefixes: list[str], config_file: Path,
                        weights_file: Path) -> None:
    """Compare the mappers ``mapper_config`` describes (built on the meta device: nothing allocated) with the tensor
    names and shapes in the header of ``weights_file`` (no weights read), so that a config that does not fit its
    weights is refused before any mapper is built: ``proxykv_config.json`` decides the mapper's sizes, and a garbled
    or crafted one (say ``d_time`` 65536) would make building the mapper allocate tens of gigabytes. ``prefixes``:
    the weight-name prefix of each mapper the checkpoint holds."""
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
