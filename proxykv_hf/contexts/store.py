"""A directory of compressed contexts: each text is compressed once, and loaded from disk ever after.

::

    store = ContextStore("~/.cache/contexts", max_bytes=2**30)
    ctx = store.get_or_compress(pipe, manual)       # compresses the first time, loads afterwards
    pipe.ask(ctx, ["How do I reset it?"])

An entry is one saved context (:mod:`proxykv_hf.contexts`) in a directory named by its key: a digest of the model
(config fingerprint, weights probe, dtype), the tokenizer's fingerprint, the scorer's settings, the cache's settings
(``keep_ratio``, ``budget``, ``n_sink``, ``n_recent``) and the text's SHA-256. Entries are written whole or not at
all (a temporary directory renamed into place), so a crash never leaves a half entry that a later run loads; two
processes filling one entry at once both compress, the first rename wins and the other discards its copy. With
``max_bytes`` the least recently used entries are removed (renamed away, then deleted) once the store is larger.
Only the store's own entries (saved contexts, recognised by their header:
:func:`~proxykv_hf.contexts.directory.is_saved_context`) are counted, evicted or repaired; anything else is left alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

from .compressed import CompressedContext
from .directory import is_saved_context, is_temp, remove_context
from .format import FORMAT_VERSION, save_context
from ..models.fingerprints import describe_model, digest, tokenizer_fingerprint

logger = logging.getLogger(__name__)

STALE_SECONDS = 3600.0
"""A temporary directory this old is a crashed writer's, and is removed."""


class ContextStore:
    """Compressed contexts on disk, keyed by everything that decides them (see the module docstring).

    Args:
        directory: where the entries live (created if needed); any number of processes may share it.
        max_bytes: evict the least recently used entries past this many bytes on disk (None: no limit). The entry
            just written is never evicted, even alone past the limit.

    Attributes:
        hits, misses: contexts this store object loaded and compressed.
    """

    def __init__(self, directory: str | os.PathLike, *, max_bytes: int | None = None):
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.directory = Path(directory).expanduser()
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"context store {str(self.directory)!r} is a file, not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.hits = self.misses = 0

    def key(self, pipeline, text: str) -> str:
        """The entry name of ``text`` compressed by ``pipeline`` (its model, tokenizer and cache settings)."""
        template = pipeline.new_cache()
        model = describe_model(pipeline.model)
        return digest({
            "format_version": FORMAT_VERSION,
            "model": {k: model[k] for k in ("config_fingerprint", "weights_probe", "dtype")},
            "tokenizer": tokenizer_fingerprint(pipeline.tokenizer),
            "scorer": None if template.scorer is None else template.scorer.settings(),
            "cache": {"keep_ratio": template.keep_ratio, "budget": template.budget, "n_sink": template.n_sink,
                      "n_recent": template.n_recent},
            "text": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        })

    def get_or_compress(self, pipeline, text: str) -> CompressedContext:
        """``text`` compressed by ``pipeline`` (a :class:`~proxykv_hf.contexts.pipeline.ProxyKVPipeline`): loaded from
        its entry when there is one, else compressed (:meth:`ProxyKVPipeline.compress
        <proxykv_hf.contexts.pipeline.ProxyKVPipeline.compress>`) and stored. An entry that cannot be loaded (damaged on
        disk, e.g. missing its tensor file) is replaced.

        Raises:
            FileExistsError: the entry's name is taken by something that is not a saved context (left alone),
                before anything is compressed.
        """
        entry = self.directory / self.key(pipeline, text)
        if (entry.exists() or entry.is_symlink()) and not is_saved_context(entry):
            raise FileExistsError(f"context store entry {entry} is not a saved context (not written by this store); "
                                  "it is left alone: move it away")
        found = self._load(pipeline, entry, text)
        if found is not None:
            self.hits += 1
            _touch(entry)
            return found
        self.misses += 1
        compressed = pipeline.compress(text)
        save_context(compressed.cache, entry, pipeline.tokenizer, text=text, overwrite=False)
        _touch(entry)
        self._clean_up(keep=entry.name)
        return compressed

    def _load(self, pipeline, entry: Path, text: str) -> CompressedContext | None:
        if not entry.is_dir():
            return None
        try:
            found = pipeline.load(entry)
        except (FileNotFoundError, ValueError) as err:  # evicted by another process meanwhile, or damaged
            if is_saved_context(entry):
                logger.warning("context store entry %s cannot be loaded (%s); compressing it again", entry, err)
                remove_context(entry)
            return None
        if found.text != text:  # a digest collision, or an entry written by hand
            logger.warning("context store entry %s holds another text; compressing it again", entry)
            remove_context(entry)
            return None
        return found

    def entries(self) -> list[Path]:
        """The entries (saved contexts: nothing else in the directory is counted, evicted or repaired), least
        recently used first."""
        found = []
        for path in self.directory.iterdir():
            if not path.name.startswith(".") and is_saved_context(path):
                try:
                    found.append((path.stat().st_mtime, path))
                except FileNotFoundError:  # removed meanwhile
                    continue
        return [path for _, path in sorted(found)]

    def nbytes(self) -> int:
        """Bytes on disk of all entries."""
        return sum(_size(path) for path in self.entries())

    def _clean_up(self, keep: str) -> None:
        """Remove crashed writers' temporary directories, then evict past ``max_bytes`` (never ``keep``)."""
        now = time.time()
        for path in self.directory.iterdir():
            if is_temp(path):
                try:
                    stale = now - path.stat().st_mtime > STALE_SECONDS or path.name.endswith(".old")
                except FileNotFoundError:
                    continue
                if stale:
                    shutil.rmtree(path, ignore_errors=True)
        if self.max_bytes is None:
            return
        entries = [(path, _size(path)) for path in self.entries()]
        total = sum(size for _, size in entries)
        for path, size in entries:
            if total <= self.max_bytes:
                break
            if path.name != keep:
                logger.info("context store: evicting %s (%d bytes)", path.name, size)
                remove_context(path)
                total -= size


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # the directory's mtime is its last use
    except FileNotFoundError:
        pass


def _size(path: Path) -> int:
    total = 0
    for file in path.iterdir() if path.is_dir() else ():
        try:
            total += file.stat().st_size
        except FileNotFoundError:
            continue
    return total

