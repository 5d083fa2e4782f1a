"""proxykv_hf: ProxyKV KV-cache pruning as a drop-in HuggingFace transformers Cache."""

from .cache import ProxyKVCache, ProxyKVLayer
from .scorers import RandomScorer, Scorer, SnapKVScorer, StreamingLLMScorer
from .selection import select_topk

__version__ = "0.1.0"

__all__ = [
    "ProxyKVCache",
    "ProxyKVLayer",
    "RandomScorer",
    "Scorer",
    "SnapKVScorer",
    "StreamingLLMScorer",
    "select_topk",
]
