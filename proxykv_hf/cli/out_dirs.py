"""Which ``--out`` directory a ``proxykv`` command may write, checked before any work: a new or empty one, or one
that holds only what the same command wrote there before (an earlier run, resumed or replaced). Its own output is
recognised by its content, a marker or manifest it writes first, never by file names alone; a directory holding
anything else is refused with an error naming it, and its files are left alone.

============  ==========================================================  =================================
command       its own files                                               recognised by
============  ==========================================================  =================================
train         proxykv_config.json, model.safetensors, README.md,           the run's ``training`` record in
              log.jsonl, training.png, last/ (last.old/, last.tmp/)        proxykv_config.json, or log.jsonl
eval          config.json, results.jsonl, results.md, accuracy.png,       config.json's run record, or
              oracle/, rank-NNNNN-of-NNNNN/ (one process's config.json     rank directories (a distributed
              and results.jsonl under torchrun)                            run under way)
bench         bench.json (bench.json.tmp), bench.md, bench.png             bench.json's summary
build-data    manifest.json, shard-NNNNN.safetensors,                      manifest.json (a dataset's)
              rank-NNNNN-of-NNNNN/ (one dataset per process)
merge-data    none: a new or empty directory only (written whole or not at all)
calibrate     none: a new or empty directory only (written whole or not at all)
============  ==========================================================  =================================

``compress`` follows the same rule for saved contexts (:func:`proxykv_hf.contexts.directory.check_target`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..mapper.checkpoint import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME
from ..contexts.directory import normalize
from ..train.loop import LOG_NAME, PLOT_NAME
from ..train.manifest import MANIFEST_NAME, MANIFEST_VERSION
from ..train.resume import LAST_DIR

__all__ = ["OUTPUTS", "check_out", "out_help"]

_MAX_JSON_BYTES = 64 << 20


@dataclass(frozen=True)
class Output:
    """What one command writes into its ``--out``.

    Attributes:
        files: a regular expression matching the name of every file it writes there.
        dirs: subdirectory name pattern -> whether such a subdirectory (given its path) is the command's own.
        marker: whether a directory holding only such names is the command's output (None: the command writes
            into new or empty directories only).
        needs: what :attr:`marker` looks for, for the error message.
    """

    files: str = ""
    dirs: dict[str, Callable[[Path], bool]] | None = None
    marker: Callable[[Path], bool] | None = None
    needs: str = ""


def _json(path: Path) -> dict | None:
    """The JSON object in the file ``path`` (not a link), or None."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_JSON_BYTES:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _only(path: Path, files: str) -> bool:
    """Whether ``path`` holds nothing but files (not links) whose names match ``files``."""
    try:
        return all(re.fullmatch(files, p.name) and p.is_file() and not p.is_symlink() for p in path.iterdir())
    except OSError:
        return False


def _train_log(path: Path) -> bool:
    """Whether ``path`` is a training log: step and epoch records (a last line cut off by a stopped run aside)."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_JSON_BYTES:
            return False
        lines = path.read_text().split("\n")
    except (OSError, UnicodeDecodeError):
        return False
    records = []
    for line in lines[:-1]:  # complete lines only
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError):
            return False
    return bool(records) and all(isinstance(r, dict) and r.get("kind") in ("step", "epoch") and "step" in r
                                 for r in records)


def _train_run(path: Path) -> bool:
    """A run's checkpoint (its config holds the ``training`` record that only ``train`` writes), or its log alone
    (a run stopped before its first checkpoint)."""
    if (path / CONFIG_NAME).exists() or (path / CONFIG_NAME).is_symlink():
        config = _json(path / CONFIG_NAME) or {}
        training = config.get("training")
        return "format_version" in config and isinstance(training, dict) and "train_config" in training
    return _train_log(path / LOG_NAME)


def _eval_run(path: Path) -> bool:
    record = _json(path / "config.json") or {}
    return isinstance(record.get("config"), dict) and {"methods", "tasks"} <= set(record["config"]) and \
        "env" in record and "options" in record


def _bench_run(path: Path) -> bool:
    """A bench run's summary (saved after each method's row), or only its first one being written."""
    if not (path / "bench.json").exists() and not (path / "bench.json").is_symlink():
        return all(p.name == "bench.json.tmp" for p in path.iterdir())
    summary = _json(path / "bench.json") or {}
    return isinstance(summary.get("config"), dict) and "env" in summary and isinstance(summary.get("rows"), list)


def _eval_rank_dir(path: Path) -> bool:
    """One process's records of a distributed eval (:mod:`proxykv_hf.eval.distributed`): its config.json and
    results.jsonl, or one being started (empty, or its config.json still a temporary file)."""
    if not _only(path, r"config\.json(\.tmp)?|results\.jsonl"):
        return False
    return _eval_run(path) or all(p.name == "config.json.tmp" for p in path.iterdir())


def _evaluated(path: Path) -> bool:
    """An eval run: its run record, or (before rank 0 writes that) the rank directories of a distributed run."""
    if (path / "config.json").exists() or (path / "config.json").is_symlink():
        return _eval_run(path)
    return any(re.fullmatch(_RANK, p.name) for p in path.iterdir())


_DATASET_FILES = rf"{re.escape(MANIFEST_NAME)}(\.tmp)?|shard-\d{{5}}\.safetensors(\.tmp)?"
_RANK = r"rank-\d{5}-of-\d{5}"


def _manifest(path: Path) -> bool:
    """Whether ``path`` holds a dataset manifest (written before any shard)."""
    manifest = _json(path / MANIFEST_NAME) or {}
    return manifest.get("version") == MANIFEST_VERSION and isinstance(manifest.get("shards"), list) and \
        isinstance(manifest.get("data_config"), dict)


def _rank_dir(path: Path) -> bool:
    """One process's share of a distributed build: a dataset and nothing else, or one being started (empty, or its
    first manifest still a temporary file: processes check ``--out`` while the others start)."""
    if not _only(path, _DATASET_FILES):
        return False
    return _manifest(path) or all(p.name == MANIFEST_NAME + ".tmp" for p in path.iterdir())


def _built(path: Path) -> bool:
    """A dataset, or the directory of a distributed build (its processes' datasets, maybe merged beside them)."""
    if (path / MANIFEST_NAME).exists() or (path / MANIFEST_NAME).is_symlink():
        return _manifest(path)
    return any(re.fullmatch(_RANK, p.name) for p in path.iterdir())


OUTPUTS: dict[str, Output] = {
    "train": Output(files="|".join(map(re.escape, (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, LOG_NAME, PLOT_NAME))),
                    dirs={re.escape(LAST_DIR) + r"(\.old|\.tmp)?":
                          lambda d: _only(d, rf"{re.escape(WEIGHTS_NAME)}|state\.pt")},
                    marker=_train_run, needs=f"the training record `proxykv train` writes in {CONFIG_NAME}, or its "
                                             f"{LOG_NAME}"),
    "eval": Output(files=r"(config\.json|results\.jsonl)(\.tmp)?|results\.md|accuracy\.png",
                   dirs={"oracle": lambda d: _only(d, r"[^/]+\.safetensors(\.part)?"), _RANK: _eval_rank_dir},
                   marker=_evaluated, needs="the run record `proxykv eval` writes in config.json"),
    "bench": Output(files=r"bench\.(json(\.tmp)?|md|png)", marker=_bench_run,
                    needs="the summary `proxykv bench` writes in bench.json"),
    "build-data": Output(files=_DATASET_FILES, dirs={_RANK: _rank_dir},
                         marker=_built, needs=f"a dataset {MANIFEST_NAME}"),
    "merge-data": Output(),
    "calibrate": Output(),
}
"""The ``--out`` of each command that writes one (``compress``: :mod:`proxykv_hf.contexts.directory`)."""


def out_help(command: str) -> str:
    """The rule for ``command``'s ``--out``, as its ``--help`` states it."""
    if OUTPUTS[command].marker is None:
        return "Must be a new or empty directory; it is written whole or not at all."
    return (f"Must be a new or empty directory, or one an earlier `proxykv {command}` wrote (resumed or replaced); "
            "one holding anything else is refused before any work, its files left alone.")


def check_out(command: str, path: str | os.PathLike) -> Path:
    """Check ``path`` as ``command``'s ``--out`` (see the module docstring), before any work; nothing is written.

    Args:
        command: a key of :data:`OUTPUTS`.
        path: the directory (``~`` expanded).

    Returns:
        ``path``, absolute.

    Raises:
        FileExistsError: ``path`` is a file, or a directory holding what ``command`` did not write.
        NotADirectoryError: a parent of ``path`` is a file.
        OSError: the directory to write in is not writable, or on a read-only file system.
    """
    path, spec = normalize(path), OUTPUTS[command]
    if not (path.exists() or path.is_symlink()):
        parent = path.parent
        while not (parent.exists() or parent.is_symlink()):
            parent = parent.parent
        if not parent.is_dir():
            raise NotADirectoryError(f"cannot create {path}: {parent} is a file, not a directory")
        _check_writable(parent, path)
        return path
    if not path.is_dir():
        raise FileExistsError(f"{path} is an existing file; give a directory for the output")
    entries = sorted(path.iterdir())
    if entries and spec.marker is None:
        raise FileExistsError(f"{path} is not empty; `proxykv {command}` writes into a new or empty directory only "
                              "(nothing there is touched)")
    foreign = [p.name + ("/" if p.is_dir() else "") for p in entries if not _own_entry(p, spec)]
    if foreign:
        names = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise FileExistsError(f"{path} holds what `proxykv {command}` does not write ({names}); it is left alone: "
                              "give a new or empty directory")
    if entries and not spec.marker(path):
        raise FileExistsError(f"{path} is not empty and not the output of an earlier `proxykv {command}` (it lacks "
                              f"{spec.needs}); it is left alone: give a new or empty directory")
    _check_writable(path, path)
    return path


def _own_entry(entry: Path, spec: Output) -> bool:
    if entry.is_symlink():
        return False
    if entry.is_dir():
        return any(re.fullmatch(name, entry.name) and own(entry) for name, own in (spec.dirs or {}).items())
    return entry.is_file() and bool(re.fullmatch(spec.files, entry.name))


def _check_writable(directory: Path, path: Path) -> None:
    if os.access(directory, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "is on a read-only file system" if read_only else "is not writable"
    raise OSError(f"cannot write {path}: {directory} {why}")
