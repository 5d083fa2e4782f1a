"""proxykv_hf: ProxyKV KV-cache pruning as a drop-in HuggingFace transformers Cache."""

from .compat import SUPPORTED as SUPPORTED_TRANSFORMERS
from .compat import check_version

check_version()  # one clear error, naming the supported range, for a transformers release outside it

from .cache import ProxyKVCache
from .compressed import CompressedContext
from .layer import ProxyKVLayer
from .pipeline import ProxyKVGenerationPipeline, ProxyKVPipeline, register_pipeline
from .scorers import (AttentionStatisticScorer, BackgroundScorer, KVzipIAMScorer, KVzipScorer, LayerInputs,
                      LayerScorer, ModelScorer, Prompt, ProxyScorer, RandomScorer, Scorer, ScorerContext,
                      SnapKVScorer, StreamingLLMScorer, register)
from .store import ContextStore

__version__ = "0.1.0"

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
