"""The cache: :class:`ProxyKVCache` dispatches, each :class:`ProxyKVLayer` holds and compacts its K/V.

:mod:`.proxykv_cache` the ``DynamicCache`` subclass; :mod:`.layer` the per-layer object; :mod:`.schedule` when each
layer is scored during the first prefill; :mod:`.budget` where a layer's scores become kept entries; :mod:`.selection`
scores to kept indices (top-K, budgets); what the cache is given: :mod:`.prompt` (each forward's inputs, through a
hook on the model, and the ``generate`` call's prompt), :mod:`.conversation` (the token ids it holds), :mod:`.calls`
(which ``generate`` call a forward belongs to) and :mod:`.candidates` (assisted decoding).
"""

from .layer import ProxyKVLayer
from .prompt import SUPPORTED_FAMILIES
from .proxykv_cache import DEFAULT_KEEP_RATIO, ProxyKVCache

__all__ = ["DEFAULT_KEEP_RATIO", "ProxyKVCache", "ProxyKVLayer", "SUPPORTED_FAMILIES"]
