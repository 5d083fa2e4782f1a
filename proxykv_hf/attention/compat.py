"""The transformers releases proxykv_hf supports, and the one place where their differences are handled.

Supported: transformers ``>=5.19,<6`` (:data:`SUPPORTED`); :func:`check_version` refuses any other release at import.
What the cache relies on from transformers, and how the releases differ (docs/design.md, "transformers versions"):

* **The name a cache goes by** in ``generate`` and in a model's ``forward``: ``cache`` from 5.24, which deprecates
  ``past_key_values``; ``past_key_values`` before. :data:`CACHE_KWARG` is the installed release's own default name
  (``transformers.generation.utils.ALL_CACHE_NAMES[0]``); :func:`with_cache` passes a cache under it and
  :func:`cache_of` reads one from a forward's keyword arguments under either name.
* Everything else the cache reads is the same in every supported release, and tested in
  ``tests/test_transformers_contract.py``: ``generate`` marks a cache it is given with ``_is_user_defined = True``
  before the first forward (:mod:`proxykv_hf.cache.prompt` reads the call's prompt then), keeps the expanded prompt in
  its ``input_ids`` local and its padding in ``model_kwargs``; assisted decoding calls ``activate_past_recording()``
  before its first forward (:mod:`proxykv_hf.cache.candidates`; from 5.25 with ``recurrent_states_to_keep=``, which the
  cache passes on to ``DynamicCache``); ``Cache.get_mask_sizes`` / ``get_seq_length`` / ``get_query_offset``
  delegate to the layers; ``DynamicLayer`` keeps ``keys`` / ``values`` and ``DynamicCache``
  lays out its layers from the config; attention functions and mask functions register through
  ``AttentionInterface`` / ``AttentionMaskInterface``.
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers.generation import utils as _generation

MIN_VERSION = "5.19"
"""The oldest supported release (its fast test suite passes; see docs/design.md)."""
BELOW_VERSION = "6"
SUPPORTED = f">={MIN_VERSION},<{BELOW_VERSION}"

CACHE_KWARG: str = getattr(_generation, "ALL_CACHE_NAMES", ["past_key_values"])[0]
"""``"cache"`` (transformers >= 5.24) or ``"past_key_values"``: the keyword under which a cache is passed."""


def check_version(version: str | None = None) -> None:
    """Raise ``ImportError`` naming the supported range when ``version`` (default: the installed transformers) is
    outside it."""
    version = transformers.__version__ if version is None else version
    release = Version(Version(version).base_version)
    if not Version(MIN_VERSION) <= release < Version(BELOW_VERSION):
        raise ImportError(f"proxykv_hf supports transformers {SUPPORTED}, but transformers {version} is installed: "
                          f"pip install 'transformers{SUPPORTED}'")


def with_cache(cache) -> dict:
    """``{name: cache}`` for ``model.generate(**...)`` or ``model(**...)``, under the installed release's name."""
    return {CACHE_KWARG: cache}


def cache_of(kwargs: dict):
    """The cache a forward was called with (under ``cache`` or ``past_key_values``), or None."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache
