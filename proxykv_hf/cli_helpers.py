"""Helpers shared by the ``proxykv`` subcommands (:mod:`proxykv_hf.cli`, :mod:`proxykv_hf.bench.cli`,
:mod:`proxykv_hf.demo`): options generated from config dataclasses, and loading what ``--tiny`` / ``--model`` /
``--mapper`` name."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing

import torch

from ._fields import DTYPES
from .hub import BUNDLED_DIR, BUNDLED_MAPPER as _BUNDLED_NAME

BUNDLED_MAPPER = BUNDLED_DIR / _BUNDLED_NAME
"""The directory of the mapper shipped with the package (for the bundled SmolLM2 target)."""


def field_docs(cls) -> dict[str, str]:
    """Each field's description from the ``Attributes:`` section of ``cls``'s Google-style docstring, reST markup
    (````x````, ``:func:`~a.b```) reduced to plain text; a line ``a, b: text`` describes both fields."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        return {}
    found: dict[str, str] = {}
    names: list[str] = []
    for line in lines[lines.index("Attributes:") + 1:]:
        if line and not line.startswith(" "):
            break  # the next section
        entry = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
        if entry:
            names = entry.group(1).split(", ")
            found.update(dict.fromkeys(names, entry.group(2)))
        elif names and line.strip():
            found.update({n: found[n] + " " + line.strip() for n in names})
    plain = lambda text: re.sub(r":\w+:`~?(?:[\w.]*\.)?(\w+)`", r"\1", text).replace("``", "")  # noqa: E731
    return {name: plain(text) for name, text in found.items()}


def add_dataclass_args(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = (),
                       choices: dict[str, typing.Sequence] | None = None) -> None:
    """``--field-name`` options for the simple fields (int, float, str, bool, lists of those) of ``cls``, with
    their help from :func:`field_docs`; ``choices`` restricts the values of the fields it names."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    choices = choices or {}
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        base = hint
        if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            base = next(a for a in typing.get_args(hint) if a is not type(None))  # Optional[X] -> X
        text = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if base is bool or isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif isinstance(default, (list, tuple)) or typing.get_origin(base) in (list, tuple):
            inner = typing.get_args(base)[0] if typing.get_args(base) else str
            parser.add_argument(flag, nargs="+", type=inner if inner in (int, float, str) else str, default=default,
                                choices=choices.get(f.name), help=text)
        elif base in (int, float, str):
            parser.add_argument(flag, type=base, default=default, choices=choices.get(f.name), help=text)


def from_args(cls, ns: argparse.Namespace, **extra):
    """An instance of the dataclass ``cls`` from the parsed options that name its fields, plus ``extra``."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    values.update(extra)
    for f in dataclasses.fields(cls):  # tuples stay tuples
        if f.name in values and isinstance(f.default, tuple):
            values[f.name] = tuple(values[f.name])
    return cls(**values)


def dtype_of(name: str) -> torch.dtype:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` as a torch dtype."""
    return DTYPES[name]


def load(ns) -> tuple:
    """(model, tokenizer) from ``--tiny`` / ``--model`` / the bundled default."""
    if getattr(ns, "tiny", False):
        from .testing import tiny_model, tiny_tokenizer

        return tiny_model("llama", num_hidden_layers=4), tiny_tokenizer()
    from .models import load_model_and_tokenizer

    return load_model_and_tokenizer(ns.model, dtype=dtype_of(ns.dtype), device=ns.device)


def tiny_mapper_checkpoint(model, directory: str) -> str:
    """A random (untrained) mapper for ``--tiny`` runs: exercises the machinery, predicts nothing useful."""
    from .hub import Checkpoint, save_checkpoint
    from .mapper import HybridAxialMapper, MapperConfig
    from .proxy import ProxySpec, every_kth_layer
    from .train.data import target_spec_of

    layers = every_kth_layer(model.config.num_hidden_layers, 2)
    spec = ProxySpec(kind="layers", num_layers=len(layers), num_heads=model.config.num_attention_heads,
                     layers=layers)
    target = target_spec_of(model, "tiny")
    cfg = MapperConfig.tiny(num_proxy_layers=spec.num_layers, num_proxy_heads=spec.num_heads,
                            num_target_layers=target.num_layers, num_target_heads=target.num_kv_heads)
    torch.manual_seed(0)
    save_checkpoint(Checkpoint(mapper=HybridAxialMapper(cfg).eval(), proxy=spec, target=target), directory)
    return directory


def mapper_for(ns, model, tmp: str) -> str | None:
    """The mapper checkpoint to use: ``--mapper``, a random one in ``tmp`` for ``--tiny``, else the bundled one."""
    if getattr(ns, "mapper", None):
        return ns.mapper
    if getattr(ns, "tiny", False):
        return tiny_mapper_checkpoint(model, tmp)
    return str(BUNDLED_MAPPER) if BUNDLED_MAPPER.is_dir() else None


def field_overrides(cls, items: list[str], flag: str) -> dict:
    """``["FIELD=VALUE", ...]`` -> typed overrides of the simple (bool, int, float, str) fields of ``cls``."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"{flag} expects FIELD=VALUE with FIELD one of {sorted(types)}, got {item!r}")
        kind = types[key] if isinstance(types[key], str) else types[key].__name__
        try:
            if kind == "bool":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                out[key] = value.lower() in ("true", "1")
            else:
                out[key] = {"int": int, "float": float}.get(kind, str)(value)
        except ValueError:
            raise SystemExit(f"{flag} {key}: {value!r} is not a valid {kind}") from None
    return out


def mapper_overrides(items: list[str]) -> dict:
    """``["d_time=64", "dropout=0"]`` (``--mapper-config``) -> typed MapperConfig overrides; unknown fields and bad
    values raise."""
    from .mapper import MapperConfig

    return field_overrides(MapperConfig, items, "--mapper-config")
