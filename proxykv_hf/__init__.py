"""proxykv_hf: ProxyKV KV-cache pruning as a drop-in HuggingFace transformers Cache."""

import importlib
import importlib.abc
import importlib.util
import sys

from .attention.compat import SUPPORTED as SUPPORTED_TRANSFORMERS
from .attention.compat import check_version

check_version()  # one clear error, naming the supported range, for a transformers release outside it

from .cache import ProxyKVCache, ProxyKVLayer
from .contexts.compressed import CompressedContext
from .contexts.pipeline import ProxyKVGenerationPipeline, ProxyKVPipeline, register_pipeline
from .contexts.store import ContextStore
from .scorers import (AttentionStatisticScorer, BackgroundScorer, KVzipIAMScorer, KVzipScorer, LayerInputs,
                      LayerScorer, ModelScorer, Prompt, ProxyScorer, RandomScorer, Scorer, ScorerContext,
                      SnapKVScorer, StreamingLLMScorer, register)

__version__ = "0.1.0"

MOVED = {"compat": "attention.compat", "scoring": "attention.statistics", "kernels": "attention.kernels",
         "hub": "mapper.hub", "proxy": "mapper.proxy", "pipeline": "contexts.pipeline",
         "compressed": "contexts.compressed", "fingerprints": "models.fingerprints",
         "model_cache": "models.model_cache", "model_parts": "models.parts", "cli_helpers": "cli.helpers",
         "flops": "bench.flop_model"}
"""Modules of 0.1.0 that moved into a folder, still importable by their old name (``proxykv_hf.compat``, ...)."""


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``proxykv_hf.<old>`` as the module it moved to: the same module object, not a copy."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(__name__ + ".")
        return importlib.util.spec_from_loader(fullname, self) if old in MOVED and old != fullname else None

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.removeprefix(__name__ + '.')]}")
        spec.loader_state = module.__spec__  # the import machinery sets the old name's spec on it: kept to restore
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModule) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModule())

register_pipeline()  # makes pipeline("proxykv-generation") available; nothing else happens on import

__all__ = [
    # the cache and the pipeline
    "ProxyKVCache",
    "ProxyKVGenerationPipeline",
    "ProxyKVLayer",
    "ProxyKVPipeline",
    # compressed contexts on disk
    "CompressedContext",
    "ContextStore",
    # scorers
    "AttentionStatisticScorer",
    "KVzipIAMScorer",
    "KVzipScorer",
    "ProxyScorer",
    "RandomScorer",
    "SnapKVScorer",
    "StreamingLLMScorer",
    # writing a scorer
    "BackgroundScorer",
    "LayerInputs",
    "LayerScorer",
    "ModelScorer",
    "Prompt",
    "Scorer",
    "ScorerContext",
    "register",
]
