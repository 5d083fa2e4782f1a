"""proxykv_hf: ProxyKV KV-cache pruning as a drop-in HuggingFace transformers Cache."""

from .cache import ProxyKVCache, ProxyKVLayer
from .pipeline import ProxyKVGenerationPipeline, ProxyKVPipeline, register_pipeline
from .scorers import AttentionStatisticScorer, KVzipScorer, RandomScorer, Scorer, SnapKVScorer, StreamingLLMScorer
from .scorers.kvzip import full_attention_layers, kvzip_scores
from .selection import select_topk

__version__ = "0.1.0"

register_pipeline()  # makes pipeline("proxykv-generation") available; nothing else happens on import

__all__ = [
    "AttentionStatisticScorer",
    "KVzipScorer",
    "ProxyKVCache",
    "ProxyKVGenerationPipeline",
    "ProxyKVLayer",
    "ProxyKVPipeline",
    "RandomScorer",
    "Scorer",
    "SnapKVScorer",
    "StreamingLLMScorer",
    "full_attention_layers",
    "kvzip_scores",
    "select_topk",
]
