"""Compressed contexts: compress a long text once, answer many questions from it, in this process or another.

:mod:`.pipeline` ``ProxyKVPipeline`` and the ``"proxykv-generation"`` task; :mod:`.compressed` a
:class:`CompressedContext`; :mod:`.store` a :class:`ContextStore` of them on disk; the on-disk format:
:mod:`.format` (write and read), :mod:`.header` (the checked header) and :mod:`.directory` (writing a directory
whole); :mod:`.chat_prompt` a context and a question split token-exactly.
"""

from .format import DTYPE_POLICIES, FORMAT_VERSION, check_fits, read_context, read_header, save_context

__all__ = ["DTYPE_POLICIES", "FORMAT_VERSION", "check_fits", "read_context", "read_header", "save_context"]
