"""proxykv_hf: ProxyKV KV-cache pruning as a drop-in HuggingFace transformers Cache."""

from .cache import ProxyKVCache
from .layer import ProxyKVLayer
from .pipeline import ProxyKVGenerationPipeline, ProxyKVPipeline, register_pipeline
from .scorers import (AttentionStatisticScorer, BackgroundScorer, KVzipIAMScorer, KVzipScorer, LayerInputs,
                      LayerScorer, ModelScorer, Prompt, ProxyScorer, RandomScorer, Scorer, ScorerContext,
                      SnapKVScorer, StreamingLLMScorer, register)

__version__ = "0.1.0"

register_pipeline()  # makes pipeline("proxykv-generation") available; nothing else happens on import

__all__ = [
    # the cache and the pipeline
    "ProxyKVCache",
    "ProxyKVGenerationPipeline",
    "ProxyKVLayer",
    "ProxyKVPipeline",
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
