"""Scoring methods: each turns a prefill into `(B, H_kv, T)` importance scores (higher = keep).

Each method is one class in one file; :mod:`.registry` gives each a name for the command line and the harness.
"""

from . import registry
from .base import BackgroundScorer, LayerInputs, LayerScorer, ModelScorer, Prompt, Scorer
from .iam import KVzipIAMScorer
from .kvzip import KVzipScorer
from .proxy import ProxyScorer, SelfProxyScorer, SeparateProxyScorer
from .random import RandomScorer
from .registry import ScorerContext, register
from .snapkv import SnapKVScorer
from .statistic import AttentionStatisticScorer
from .streaming import StreamingLLMScorer

__all__ = ["AttentionStatisticScorer", "BackgroundScorer", "KVzipIAMScorer", "KVzipScorer", "LayerInputs",
           "LayerScorer", "ModelScorer", "Prompt", "ProxyScorer", "RandomScorer", "Scorer", "ScorerContext",
           "SelfProxyScorer", "SeparateProxyScorer", "SnapKVScorer", "StreamingLLMScorer", "register", "registry"]
