"""The ``proxykv`` command (:mod:`.commands`), its option helpers (:mod:`.helpers`), the ``--out`` rules
(:mod:`.out_dirs`) and the demo (:mod:`.demo`)."""

from .commands import build_parser, field_docs, main

__all__ = ["build_parser", "field_docs", "main"]
