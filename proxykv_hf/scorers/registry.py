"""Scorers by name: the one list that ``proxykv eval``, ``bench``, ``demo`` and ``generate`` read.

A name maps to a scorer dataclass, built as ``cls(**fields)`` (:func:`scorer_fields`: the values a
:class:`ScorerContext` holds for the class's fields), or to a builder ``build(context) -> Scorer``. ``"full"`` is
the name of the uncompressed cache (no scorer). Registering a new method::

    from dataclasses import dataclass

    from proxykv_hf.scorers import LayerScorer, register

    @dataclass(kw_only=True)
    class KeyNormScorer(LayerScorer):
        power: float = 2.0  # the norm's order: a field, so an option (and part of the settings)

        def score(self, inputs):
            return -inputs.keys.float().norm(p=self.power, dim=-1)  # (B, H_kv, T): small keys kept

    register("keynorm", KeyNormScorer, "keys of small norm")

after which ``proxykv eval --plugin mymodule --methods full keynorm`` runs it (``--plugin`` imports the module
that calls :func:`register`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import Scorer
from .iam import KVzipIAMScorer
from .kvzip import KVzipScorer
from .proxy import ProxyScorer
from .random import RandomScorer
from .snapkv import SnapKVScorer
from .statistic import AttentionStatisticScorer, ProxyStatisticScorer
from .streaming import StreamingLLMScorer

FULL = "full"
_SHARED = ("model", "tokenizer", "mapper", "proxy")  # what a context holds beside the fields, by the fields' names


@dataclass(kw_only=True)
class ScorerContext:
    """What a scorer is built from: the model and what comes with it, and the scorers' options.

    Attributes:
        model: the target model the scorer's cache will run on.
        tokenizer: the target's tokenizer (KVzip's repeat prompts).
        mapper: ProxyKV mapper checkpoint: a directory, a Hub id, or a
        :class:`~proxykv_hf.mapper.checkpoint.Checkpoint` in
            memory (e.g. a random one for ``--tiny``).
        proxy: a separate proxy model, loaded once: KVzip+IAM's, the ``proxy_*`` methods', and ProxyKV's where its
            mapper reads a separate model (the other methods leave it alone).
        fields: scorer options by field name, e.g. ``{"context_chunk": 16, "seed": 1}``. One dict serves every method
            of a run: each scorer dataclass takes those that name its fields (``context_chunk`` reaches KVzip and
            KVzip+IAM, ``seed`` the random method); a registered builder may read any.
    """

    model: object = None
    tokenizer: object = None
    mapper: object = None
    proxy: object = None
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    """One registered method: its builder and a one-line description for ``--help``."""

    build: Callable[[ScorerContext], Scorer]
    description: str = ""


_REGISTRY: dict[str, Entry] = {}


def register(name: str, build: type | Callable[[ScorerContext], Scorer], description: str = "", *,
             replace: bool = False, **preset) -> None:
    """Give a scorer a name.

    Args:
        name: the method's name (an identifier other than ``"full"``).
        build: a scorer dataclass, built as ``build(**fields)`` (:func:`scorer_fields`), or a function
            ``build(context)`` that returns a new :class:`~proxykv_hf.scorers.base.Scorer`.
        description: one line for ``--help``.
        replace: replace a name already taken.
        **preset: fields of a scorer dataclass fixed for this name (e.g. ``statistic="sum"``).

    Raises:
        ValueError: a bad name, a name already taken (unless ``replace``), or a ``preset`` that is not a field.
    """
    if not isinstance(name, str) or not name.isidentifier() or name == FULL:
        raise ValueError(f"a scorer name must be an identifier other than {FULL!r}, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a scorer named {name!r} is already registered; pass replace=True to replace it")
    if not callable(build):
        raise ValueError(f"build must be callable, got {build!r}")
    if isinstance(build, type) and dataclasses.is_dataclass(build):
        build = _dataclass_builder(build, preset)
    elif preset:
        raise ValueError(f"preset fields {sorted(preset)} need a scorer dataclass, got {build!r}")
    _REGISTRY[name] = Entry(build, description)


def scorer_fields(cls: type, context: ScorerContext, **preset) -> dict:
    """The arguments of ``cls(**...)`` for the scorer dataclass ``cls``: for each of its init fields, ``preset``'s
    value, else ``context.fields``', else the context's attribute of that name (``tokenizer``, ``proxy``) where it
    is not None. Fields found nowhere keep their defaults."""
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in preset:
            out[f.name] = preset[f.name]
        elif f.name in context.fields:
            out[f.name] = context.fields[f.name]
        elif f.name in _SHARED and getattr(context, f.name) is not None:
            out[f.name] = getattr(context, f.name)
    return out


def _dataclass_builder(cls: type, preset: dict) -> Callable[[ScorerContext], Scorer]:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(preset) - names:
        raise ValueError(f"{sorted(set(preset) - names)} are not fields of {cls.__name__}; choose from "
                         f"{sorted(names)}")

    def build(context: ScorerContext) -> Scorer:
        return cls(**scorer_fields(cls, context, **preset))

    return build


def unregister(name: str) -> None:
    """Remove a registered name (``KeyError`` if unknown)."""
    del _REGISTRY[name]


def names() -> list[str]:
    """``"full"`` and every registered name, in registration order."""
    return [FULL, *_REGISTRY]


def describe(name: str) -> str:
    return "the uncompressed cache" if name == FULL else _entry(name).description


def build(name: str, context: ScorerContext) -> Scorer | None:
    """A new scorer of method ``name`` (None for ``"full"``).

    Raises:
        ValueError: an unknown name, or a builder that returned something other than a scorer.
    """
    if name == FULL:
        return None
    scorer = _entry(name).build(context)
    if not isinstance(scorer, Scorer):
        raise ValueError(f"the builder of {name!r} returned {type(scorer).__name__}, not a Scorer")
    return scorer


def load_plugins(modules: list[str] | None, *, search_cwd: bool = True) -> None:
    """Import ``modules`` (dotted names) for the :func:`register` calls they make.

    Args:
        modules: module names, e.g. ``["mymethods", "mypackage.scorers"]``.
        search_cwd: look in the current working directory first, as ``python -m`` and ``python script.py`` from
            there would (an installed console script such as ``proxykv`` does not have it on ``sys.path``), so that
            ``proxykv eval --plugin mymethods`` finds ``./mymethods.py``. The directory is on ``sys.path`` during
            these imports only.

    Raises:
        ValueError: a module that cannot be imported, naming it.
    """
    modules = list(modules or ())
    if not modules:
        return
    cwd = os.getcwd()
    added = search_cwd and not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path)
    if added:
        sys.path.insert(0, cwd)
    try:
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise ValueError(f"could not import scorer plugin {module!r}: {err}") from err
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _entry(name: str) -> Entry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(names())}")
    return _REGISTRY[name]


# ------------------------------------------------------------------------------------------------ built-in methods
def _proxykv(ctx: ScorerContext) -> Scorer:
    from ..mapper.checkpoint import Checkpoint
    from ..mapper.hub import load_checkpoint

    if ctx.mapper is None:
        raise ValueError("method 'proxykv' needs a mapper checkpoint (--mapper)")
    options = scorer_fields(ProxyScorer, ctx)
    ckpt = ctx.mapper if isinstance(ctx.mapper, Checkpoint) else \
        load_checkpoint(ctx.mapper, map_location=options.get("proxy_device") or "cpu")
    proxy = ctx.proxy if ckpt.proxy.kind == "model" else None  # a self or layer-subset proxy reads the target
    return ProxyScorer.from_pretrained(ckpt, proxy=proxy, **options)


def _proxy_statistic(method: str, statistic: str) -> Callable[[ScorerContext], Scorer]:
    def build_proxy_statistic(ctx: ScorerContext) -> Scorer:
        if ctx.proxy is None and "proxy" not in ctx.fields:
            raise ValueError(f"method {method!r} needs a separate proxy model (--proxy-model)")
        return ProxyStatisticScorer(**scorer_fields(ProxyStatisticScorer, ctx, statistic=statistic))

    return build_proxy_statistic


register("kvzip", KVzipScorer, "KVzip's context-reconstruction scores (the oracle ProxyKV learns)")
register("snapkv", SnapKVScorer, "attention of the last 64 prompt queries, pooled")
register("streaming", StreamingLLMScorer, "attention sinks and the most recent tokens")
register("random", RandomScorer, "uniform random scores")
register("proxykv", _proxykv, "the trained mapper on the proxy's attention (--mapper)")
register("kvzip_iam", KVzipIAMScorer, "KVzip on a proxy, mapped by a fixed layer/head alignment")
register("attn_sum", AttentionStatisticScorer, "the self proxy's summed attention as scores, no mapper",
         statistic="sum")
register("attn_max", AttentionStatisticScorer, "the self proxy's largest attention as scores, no mapper",
         statistic="max")
register("attn_novelty", AttentionStatisticScorer, "one minus the self proxy's lookback attention, no mapper",
         statistic="lookback")
register("proxy_novelty", _proxy_statistic("proxy_novelty", "lookback"),
         "one minus the proxy model's lookback attention, no mapper (--proxy-model)")
register("proxy_max", _proxy_statistic("proxy_max", "max"),
         "the proxy model's largest attention as scores, no mapper (--proxy-model)")
register("proxy_sum", _proxy_statistic("proxy_sum", "sum"),
         "the proxy model's summed attention as scores, no mapper (--proxy-model)")
