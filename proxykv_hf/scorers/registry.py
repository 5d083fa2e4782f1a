"""Scorers by name: the one list that ``proxykv eval``, ``bench``, ``demo`` and ``generate`` read.

A name maps to a builder ``build(context) -> Scorer``; :class:`ScorerContext` carries what builders may need beyond
the model (a tokenizer, a mapper checkpoint, a proxy, a seed). ``"full"`` is the name of the uncompressed cache
(no scorer). Registering a new method::

    from proxykv_hf.scorers import LayerScorer, register

    class KeyNormScorer(LayerScorer):
        def score(self, inputs):
            return -inputs.keys.float().norm(dim=-1)  # (B, H_kv, T): small keys kept

    register("keynorm", lambda ctx: KeyNormScorer(), "keys of small norm")

after which ``proxykv eval --plugin mymodule --methods full keynorm`` runs it (``--plugin`` imports the module
that calls :func:`register`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import Scorer

FULL = "full"


@dataclass(kw_only=True)
class ScorerContext:
    """What a builder may need beyond the model.

    Attributes:
        model: the target model the scorer's cache will run on.
        tokenizer: the target's tokenizer (KVzip's repeat prompt).
        mapper: ProxyKV mapper checkpoint: a directory, a Hub id, or a :class:`~proxykv_hf.checkpoint.Checkpoint` in
            memory (e.g. a random one for ``--tiny``).
        proxy: a loaded proxy model for checkpoints whose proxy is a separate model.
        proxy_device: where ProxyKV's proxy and mapper run; None: the target's device.
        iam_proxy: the proxy model of KVzip+IAM (a separate model), or None for a layer subset of the target.
        iam_layers: the target layers of KVzip+IAM's layer-subset proxy.
        seed: for the random method.
        kvzip_chunk: KVzip's reconstruction chunk size.
        compile_mapper: compile ProxyKV's mapper encoder (:class:`~proxykv_hf.scorers.proxy.ProxyScorer`).
        extra: anything a registered third-party builder wants.
    """

    model: object = None
    tokenizer: object = None
    mapper: object = None
    proxy: object = None
    proxy_device: str | None = None
    iam_proxy: object = None
    iam_layers: list[int] | None = None
    seed: int = 0
    kvzip_chunk: int = 2048
    compile_mapper: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    """One registered method: its builder and a one-line description for ``--help``."""

    build: Callable[[ScorerContext], Scorer]
    description: str = ""


_REGISTRY: dict[str, Entry] = {}


def register(name: str, build: Callable[[ScorerContext], Scorer], description: str = "", *,
             replace: bool = False) -> None:
    """Give a scorer a name. ``build(context)`` returns a new :class:`~proxykv_hf.scorers.base.Scorer`.

    Raises:
        ValueError: a bad name, or a name already taken (unless ``replace``).
    """
    if not isinstance(name, str) or not name.isidentifier() or name == FULL:
        raise ValueError(f"a scorer name must be an identifier other than {FULL!r}, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a scorer named {name!r} is already registered; pass replace=True to replace it")
    if not callable(build):
        raise ValueError(f"build must be callable, got {build!r}")
    _REGISTRY[name] = Entry(build, description)


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
def _snapkv(ctx: ScorerContext) -> Scorer:
    from .snapkv import SnapKVScorer

    return SnapKVScorer()


def _streaming(ctx: ScorerContext) -> Scorer:
    from .streaming import StreamingLLMScorer

    return StreamingLLMScorer()


def _random(ctx: ScorerContext) -> Scorer:
    from .random import RandomScorer

    return RandomScorer(ctx.seed)


def _kvzip(ctx: ScorerContext) -> Scorer:
    from .kvzip import KVzipScorer

    return KVzipScorer(ctx.tokenizer, context_chunk=ctx.kvzip_chunk)


def _kvzip_iam(ctx: ScorerContext) -> Scorer:
    from .iam import KVzipIAMScorer

    return KVzipIAMScorer(ctx.tokenizer, proxy=ctx.iam_proxy, layers=ctx.iam_layers, context_chunk=ctx.kvzip_chunk)


def _proxykv(ctx: ScorerContext) -> Scorer:
    from .proxy import ProxyScorer

    if ctx.mapper is None:
        raise ValueError("method 'proxykv' needs a mapper checkpoint (--mapper)")
    return ProxyScorer.from_pretrained(ctx.mapper, proxy=ctx.proxy, proxy_device=ctx.proxy_device,
                                       compile_mapper=ctx.compile_mapper)


def _statistic(name: str) -> Callable[[ScorerContext], Scorer]:
    def build_statistic(ctx: ScorerContext) -> Scorer:
        from .statistic import AttentionStatisticScorer

        return AttentionStatisticScorer(name)

    return build_statistic


def _proxy_statistic(method: str, statistic: str) -> Callable[[ScorerContext], Scorer]:
    def build_proxy_statistic(ctx: ScorerContext) -> Scorer:
        from .statistic import ProxyStatisticScorer

        proxy = ctx.proxy if ctx.proxy is not None else ctx.iam_proxy
        if proxy is None:
            raise ValueError(f"method {method!r} needs a separate proxy model (--proxy-model)")
        return ProxyStatisticScorer(proxy, statistic)

    return build_proxy_statistic


register("kvzip", _kvzip, "KVzip's context-reconstruction scores (the oracle ProxyKV learns)")
register("snapkv", _snapkv, "attention of the last 64 prompt queries, pooled")
register("streaming", _streaming, "attention sinks and the most recent tokens")
register("random", _random, "uniform random scores")
register("proxykv", _proxykv, "the trained mapper on the proxy's attention (--mapper)")
register("kvzip_iam", _kvzip_iam, "KVzip on a proxy, mapped by a fixed layer/head alignment")
register("attn_sum", _statistic("sum"), "the self proxy's summed attention as scores, no mapper")
register("attn_max", _statistic("max"), "the self proxy's largest attention as scores, no mapper")
register("attn_novelty", _statistic("lookback"), "one minus the self proxy's lookback attention, no mapper")
register("proxy_novelty", _proxy_statistic("proxy_novelty", "lookback"),
         "one minus the proxy model's lookback attention, no mapper (--proxy-model)")
register("proxy_max", _proxy_statistic("proxy_max", "max"),
         "the proxy model's largest attention as scores, no mapper (--proxy-model)")
register("proxy_sum", _proxy_statistic("proxy_sum", "sum"),
         "the proxy model's summed attention as scores, no mapper (--proxy-model)")
