"""Mapper checkpoints: save / load / push, from a local directory or a Hub repository.

A checkpoint is a directory with three files, safetensors only (no pickle):

* ``proxykv_config.json``: format version, mapper config, proxy spec, target description (model id, number of
  compacted layers, KV heads), the layer pairing, training-data summary and validation metrics.
* ``model.safetensors``: the mapper weights.
* ``README.md``: a generated model card.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .mapper import HybridAxialMapper, MapperConfig
from .proxy import ProxySpec, check_self_layers
from .selection import check_kernel_size, check_layer_mix

logger = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).parent / "checkpoints"
BUNDLED_MAPPER = "proxykv-smollm2-135m-instruct"  # shipped with the package, for the bundled SmolLM2 target
CONFIG_NAME = "proxykv_config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
FORMAT_VERSION = 1


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

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(kw_only=True)
class Checkpoint:
    """Everything needed to use a trained mapper.

    Attributes:
        pool_kernel: before the Top-K, each of the mapper's scores is lifted to the mean of the ``pool_kernel``
            tokens around it where that is higher (odd; 1 = off, the paper's selection;
            :func:`~proxykv_hf.selection.smooth_scores` with ``keep_peaks``). A scoring setting, not a weight: chosen
            after training and stored with the mapper so that every user of the checkpoint selects the same way.
        layer_mix: before the Top-K, each layer's scores (standardised per head over the real tokens) get
            ``layer_mix`` times the mean of the standardised scores of that layer and every earlier one added: a
            token that the earlier layers rank high is kept more often in the later ones too. 0 = off (the paper's
            selection). A scoring setting like ``pool_kernel``.
    """

    mapper: HybridAxialMapper
    proxy: ProxySpec
    target: TargetSpec
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    pool_kernel: int = 1
    layer_mix: float = 0.0

    def __post_init__(self) -> None:
        check_kernel_size(self.pool_kernel, "pool_kernel")
        self.layer_mix = check_layer_mix(self.layer_mix)
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

    def check_target(self, config) -> None:
        """Raise if a target model's config does not match the one the mapper was trained for."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = getattr(text, "layer_types", None)
        n_full = sum(t == "full_attention" for t in types) if types else text.num_hidden_layers
        kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        got = (n_full, kv)
        want = (self.target.num_layers, self.target.num_kv_heads)
        if got != want:
            raise ValueError(
                f"mapper was trained for a target with {want[0]} full-attention layers and {want[1]} KV heads "
                f"({self.target.model_id}), but the model has {got[0]} layers and {got[1]} KV heads"
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
        "out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)", "```", "",
        "| | |", "|---|---|",
        f"| target | `{ckpt.target.model_id}` ({ckpt.target.num_layers} layers, {ckpt.target.num_kv_heads} KV heads) |",
        f"| proxy | {ckpt.proxy.kind}: `{ckpt.proxy.model_id or ckpt.proxy.layers or 'target attention'}` |",
        f"| proxy features | attention {' and '.join(ckpt.proxy.statistics)} per head and token |",
        f"| mapper parameters | {sum(p.numel() for p in ckpt.mapper.parameters()):,} |",
        f"| score pooling (`pool_kernel`) | {ckpt.pool_kernel} (1 = off) |",
        f"| mixing with earlier layers (`layer_mix`) | {ckpt.layer_mix:g} (0 = off) |",
    ]
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
        "pool_kernel": ckpt.pool_kernel,
        "layer_mix": ckpt.layer_mix,
        "training": ckpt.training,
        "metrics": ckpt.metrics,
    }
    state = {k: v.detach().contiguous().cpu() for k, v in ckpt.mapper.state_dict().items()}
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (path / CARD_NAME).write_text(_card(ckpt))
    return path


def resolve(name_or_path: str | os.PathLike, *, revision: str | None = None, cache_dir=None, token=None,
            local_files_only: bool | None = None) -> Path:
    """A local directory, a checkpoint bundled with the package (by name, e.g. ``"proxykv-smollm2-135m-instruct"``),
    or a Hub repository downloaded through ``huggingface_hub`` (``HF_HUB_OFFLINE`` honoured)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if (BUNDLED_DIR / str(name_or_path)).is_dir():  # a checkpoint shipped inside the package, by name
        return BUNDLED_DIR / str(name_or_path)
    if path.exists():
        raise ValueError(f"{name_or_path!r} is a file; a mapper checkpoint is a directory or a Hub repository id")
    from huggingface_hub import constants, snapshot_download

    offline = bool(local_files_only or constants.HF_HUB_OFFLINE)
    try:
        local = snapshot_download(str(name_or_path), revision=revision, cache_dir=cache_dir, token=token,
                                  local_files_only=offline, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, CARD_NAME])
    except Exception as err:  # huggingface_hub raises several types for "not there"
        hint = " (offline mode: it must already be in the HF cache)" if offline else ""
        raise OSError(f"could not find the mapper checkpoint {str(name_or_path)!r}{hint}: {err}") from err
    return Path(local)


def load_checkpoint(name_or_path: str | os.PathLike, *, map_location: str | torch.device = "cpu",
                    **hub_kwargs) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint` from a directory or a Hub id."""
    path = resolve(name_or_path, **hub_kwargs)
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (path / n).is_file()]
    if missing:
        raise OSError(f"{path} is not a ProxyKV mapper checkpoint: missing {', '.join(missing)}")
    config = json.loads((path / CONFIG_NAME).read_text())
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"unsupported checkpoint format_version {config.get('format_version')!r} in {path}")
    mapper = HybridAxialMapper(MapperConfig.from_dict(config["mapper"]))
    state = load_file(str(path / WEIGHTS_NAME), device=str(map_location))
    mapper.load_state_dict(state, strict=True)
    mapper.to(map_location).eval()
    return Checkpoint(mapper=mapper, proxy=ProxySpec.from_dict(config["proxy"]),
                      target=TargetSpec(**config["target"]), training=config.get("training", {}),
                      metrics=config.get("metrics", {}), pool_kernel=config.get("pool_kernel", 1),
                      layer_mix=config.get("layer_mix", 0.0))


def push_to_hub(ckpt: Checkpoint, repo_id: str, *, private: bool = False, token=None,
                commit_message: str = "Upload ProxyKV mapper") -> str:
    """Create ``repo_id`` if needed and upload the checkpoint; returns the commit URL."""
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(ckpt, tmp)
        info = api.upload_folder(folder_path=tmp, repo_id=repo_id, commit_message=commit_message)
    return str(info)
