"""Helpers shared by the ``proxykv`` subcommands (:mod:`proxykv_hf.cli`, :mod:`proxykv_hf.bench.cli`,
:mod:`proxykv_hf.cli.demo`): options generated from config dataclasses, option values checked when the command line is
read, the exit for a user error, and loading what ``--tiny`` / ``--model`` / ``--mapper`` name."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import typing

import torch

from ..mapper._fields import DTYPES
from ..mapper.hub import BUNDLED_DIR, looks_like_local_path
from ..cache.selection import check_keep_ratio

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
"""The exception types a subcommand raises for bad input (a value out of range, a path that is not there or not
writable): ``main`` turns them, and the environment's errors (:func:`is_user_error`), into :class:`UsageError`;
anything else is a bug and keeps its traceback."""


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is the user's or the environment's, not a bug: one of :data:`USER_ERRORS`, or an ``OSError``
    (or safetensors' report of one) of a full disk, a read-only file system or a missing permission
    (:data:`~proxykv_hf.models.file_errors.ENVIRONMENT_ERRNOS`)."""
    from ..models.file_errors import environment_errno

    return isinstance(err, USER_ERRORS) or environment_errno(err)


def user_message(err: BaseException) -> str:
    """The one line for a user error: its message; an ``OSError`` of the environment as ``FILE: reason``."""
    if not isinstance(err, USER_ERRORS) and isinstance(err, OSError) and err.filename and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return str(err)


class UsageError(SystemExit):
    """A user error on the command line, exit status 2 like argparse's own.

    :meth:`report` prints the one line ``proxykv <command>: error: <message>`` to stderr; ``str()`` gives
    ``<command>: <message>``.
    """

    def __init__(self, command: str | None, message: str):
        super().__init__(2)
        self.command, self.message = command, message

    def __str__(self) -> str:
        return f"{self.command}: {self.message}" if self.command else self.message

    def report(self) -> "UsageError":
        prog = f"proxykv {self.command}" if self.command else "proxykv"
        print(f"{prog}: error: {self.message}", file=sys.stderr)
        return self


# ------------------------------------------------------------------------------------------------ option types
def keep_ratio_arg(text: str) -> float:
    """``--keep-ratio``: a number in (0, 1]."""
    try:
        return check_keep_ratio(float(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"keep_ratio must be a number in (0, 1], got {text!r}") from err


def device_arg(text: str) -> str:
    """``--device``: anything ``torch.device`` reads (``cpu``, ``cuda``, ``cuda:1``, ``mps``, ``meta``); a CUDA
    device only where there is one. Returned as given."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: there are {torch.cuda.device_count()} CUDA devices")
    return text


def text_file_arg(text: str) -> str:
    """A file that must exist (``--prompt-file``)."""
    if not os.path.isfile(os.path.expanduser(text)):
        what = "is a directory, not a file" if os.path.isdir(os.path.expanduser(text)) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {what}")
    return os.path.expanduser(text)


def checkpoint_arg(text: str) -> str:
    """A mapper checkpoint: a directory, a bundled checkpoint's name or a Hub id. A value that can only be a local
    path (:func:`~proxykv_hf.mapper.hub.looks_like_local_path`) must be an existing directory."""
    path = os.path.expanduser(text)
    if looks_like_local_path(text) and not os.path.isdir(path):
        what = "is a file, not a checkpoint directory" if os.path.exists(path) else "does not exist"
        raise argparse.ArgumentTypeError(f"mapper checkpoint directory {text!r} {what}")
    return text


def context_dir_arg(text: str) -> str:
    """A saved context (``--context``): an existing directory."""
    path = os.path.expanduser(text)
    if not os.path.isdir(path):
        what = "is a file, not a saved context directory" if os.path.exists(path) else "does not exist"
        raise argparse.ArgumentTypeError(f"context directory {text!r} {what}")
    return path


def out_arg(command: str):
    """The type of ``command``'s ``--out``: checked by :func:`proxykv_hf.cli.out_dirs.check_out` when the command line
    is read (before any work), returned ``~`` expanded."""

    def out_dir(text: str) -> str:
        from .out_dirs import check_out

        try:
            check_out(command, text)
        except OSError as err:
            raise argparse.ArgumentTypeError(str(err)) from err
        return os.path.expanduser(text)

    return out_dir


def add_out_arg(parser: argparse.ArgumentParser, command: str, what: str, **kwargs) -> None:
    """``--out`` of ``command`` (:func:`out_arg`), its help ``what`` it holds and then the rule it follows."""
    from .out_dirs import out_help

    parser.add_argument("--out", type=out_arg(command), help=f"{what}. {out_help(command)}".replace("%", "%%"),
                        **kwargs)


def context_out_arg(text: str) -> str:
    """Where ``compress`` saves a context (``~`` expanded): a new or empty directory, or a saved context to
    replace, that can be written (:func:`~proxykv_hf.contexts.directory.check_target`), checked before any work."""
    from ..contexts.directory import check_target, normalize

    try:
        check_target(text)
    except OSError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return str(normalize(text))


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


def add_field_arg(parser: argparse.ArgumentParser, cls, name: str, flag: str | None = None, **kwargs) -> None:
    """One option for the field ``name`` of the dataclass ``cls`` (e.g. a scorer's option on a subcommand that
    builds several scorers), its default and help taken from the field (:func:`field_docs`): ``--name`` unless
    ``flag`` is given, an on/off switch for a bool; ``kwargs`` (``type``, ``metavar``, ...) go to ``add_argument``."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    kwargs.setdefault("default", f.default)
    kwargs.setdefault("help", field_docs(cls).get(name, "").replace("%", "%%"))  # argparse formats help with %
    if isinstance(f.default, bool):
        kwargs.setdefault("action", argparse.BooleanOptionalAction)
    elif "type" not in kwargs and isinstance(f.default, (int, float, str)):
        kwargs["type"] = type(f.default)
    parser.add_argument(flag or "--" + name.replace("_", "-"), **kwargs)


def from_args(cls, ns: argparse.Namespace, **extra):
    """An instance of the dataclass ``cls`` from the parsed options that name its fields, plus ``extra``."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    values.update(extra)
    for f in dataclasses.fields(cls):  # tuples stay tuples
        if f.name in values and isinstance(f.default, tuple):
            values[f.name] = tuple(values[f.name])
    return cls(**values)


def dtype_of(name: str, model: str | None = None, device: str | torch.device | None = None) -> torch.dtype:
    """``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (:func:`proxykv_hf.models.resolve_dtype` for
    ``model`` on ``device``: bfloat16 for the packaged Qwen pair where the hardware has native bf16) as a dtype."""
    if name == "auto":
        from ..models.loading import DEFAULT_MODEL, resolve_dtype

        return resolve_dtype("auto", model or DEFAULT_MODEL, device or "cpu")
    return DTYPES[name]


def default_device(ns) -> str:
    """The device without ``--device``: ``cpu`` for ``--tiny`` (a smoke test), else ``cuda`` when there is one."""
    return "cpu" if getattr(ns, "tiny", False) or not torch.cuda.is_available() else "cuda"


def load(ns) -> tuple:
    """(model, tokenizer) from ``--tiny`` / ``--model`` / the bundled default, in ``--dtype`` (float32 where that is
    None) on ``--device`` (:func:`default_device` where that is None)."""
    device = getattr(ns, "device", None) or default_device(ns)
    dtype = dtype_of(getattr(ns, "dtype", None) or "auto", None if getattr(ns, "tiny", False) else
                     getattr(ns, "model", None), device)
    if getattr(ns, "tiny", False):
        from ..testing import tiny_model, tiny_tokenizer

        return tiny_model("llama", num_hidden_layers=4, dtype=dtype, device=device), tiny_tokenizer()
    from ..models.loading import DEFAULT_MODEL, load_model_and_tokenizer

    return load_model_and_tokenizer(getattr(ns, "model", None) or DEFAULT_MODEL, dtype=dtype, device=device)


def model_of_context(ns) -> None:
    """``--model`` / ``--dtype`` left out with ``--context``: those the saved context names (:func:`load` takes the
    defaults where they are still None); a ``--dtype`` other than the context's needs ``--convert-dtype``. Checked
    before the model is loaded."""
    from ..contexts.format import read_header

    saved = read_header(ns.context)
    if ns.model is None and not ns.tiny and not saved["model"].get("name"):
        raise ValueError(f"the context {ns.context} does not name its model (one built from a config); pass --model "
                         "(or --tiny)")
    ns.model = ns.model or saved["model"]["name"]
    if ns.dtype is not None and ns.dtype != saved["dtype"] and not ns.convert_dtype:
        raise ValueError(f"the context {ns.context} holds {saved['dtype']} K/V, but --dtype is {ns.dtype}: leave out "
                         f"--dtype (the context's own), or add --convert-dtype to cast the K/V to {ns.dtype} (answers "
                         "may then differ from the saved cache's by the rounding)")
    ns.dtype = ns.dtype or saved["dtype"]


def tiny_mapper_checkpoint(model):
    """A random (untrained) mapper checkpoint for ``--tiny`` runs, in memory: exercises the machinery, predicts
    nothing useful."""
    from ..mapper.hub import Checkpoint
    from ..mapper.model import HybridAxialMapper, MapperConfig
    from ..mapper.proxy import ProxySpec, every_kth_layer
    from ..train.data import target_spec_of

    layers = every_kth_layer(model.config.num_hidden_layers, 2)
    spec = ProxySpec(kind="layers", num_layers=len(layers), num_heads=model.config.num_attention_heads,
                     layers=layers)
    target = target_spec_of(model, "tiny")
    cfg = MapperConfig.tiny(num_proxy_layers=spec.num_layers, num_proxy_heads=spec.num_heads,
                            num_target_layers=target.num_layers, num_target_heads=target.num_kv_heads)
    torch.manual_seed(0)
    return Checkpoint(mapper=HybridAxialMapper(cfg).eval(), proxy=spec, target=target)


def mapper_for(ns, model):
    """The mapper checkpoint to use: ``--mapper`` (a directory or Hub id), a random one in memory for ``--tiny``
    (:func:`tiny_mapper_checkpoint`), else the one bundled for ``--model`` (None where none is)."""
    from ..mapper.hub import BUNDLED_MAPPERS
    from ..models.loading import DEFAULT_MODEL

    if getattr(ns, "mapper", None):
        return ns.mapper
    if getattr(ns, "tiny", False):
        return tiny_mapper_checkpoint(model)
    name = BUNDLED_MAPPERS.get(getattr(ns, "model", None) or DEFAULT_MODEL)
    return str(BUNDLED_DIR / name) if name and (BUNDLED_DIR / name).is_dir() else None


def proxy_model_of(ns, model):
    """``--proxy-model`` loaded in the target's dtype, on ``--proxy-device`` or the target's device; None without
    it."""
    name = getattr(ns, "proxy_model", None)
    if not name:
        return None
    if getattr(ns, "tiny", False):
        raise ValueError("--proxy-model needs a real target model, not --tiny")
    from ..models.loading import load_model

    return load_model(name, dtype=model.dtype, device=getattr(ns, "proxy_device", None) or model.device)


def field_overrides(cls, items: list[str], flag: str) -> dict:
    """``["FIELD=VALUE", ...]`` -> typed overrides of the simple (bool, int, float, str) fields of ``cls``.

    Raises:
        ValueError: an unknown field or a value of the wrong type, quoting ``flag`` and the item.
    """
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ValueError(f"{flag} expects FIELD=VALUE with FIELD one of {sorted(types)}, got {item!r}")
        kind = types[key] if isinstance(types[key], str) else types[key].__name__
        try:
            if kind == "bool":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                out[key] = value.lower() in ("true", "1")
            else:
                out[key] = {"int": int, "float": float}.get(kind, str)(value)
        except ValueError:
            raise ValueError(f"{flag} {key}: {value!r} is not a valid {kind}") from None
    return out


def mapper_overrides(items: list[str]) -> dict:
    """``["d_time=64", "dropout=0"]`` (``--mapper-config``) -> typed MapperConfig overrides; unknown fields and bad
    values raise."""
    from ..mapper.model import MapperConfig

    return field_overrides(MapperConfig, items, "--mapper-config")
