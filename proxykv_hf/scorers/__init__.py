"""Scoring methods: each turns a prefill into `(B, H_kv, T)` importance scores (higher = keep)."""

from .base import LayerInputs, Prompt, Scorer
from .kvzip import KVzipScorer
from .random import RandomScorer
from .snapkv import SnapKVScorer
from .statistic import AttentionStatisticScorer
from .streaming import StreamingLLMScorer

__all__ = ["AttentionStatisticScorer", "KVzipScorer", "LayerInputs", "Prompt", "RandomScorer", "Scorer",
           "SnapKVScorer", "StreamingLLMScorer"]
