"""The directory side of a saved context: where it may be written, how it is written whole, and how a directory is
recognised as one (:mod:`proxykv_hf.contexts` writes and reads the files themselves).

A directory is a saved context when its ``context.json`` is a header this library writes (the format marker and a
``format_version``) and it holds nothing but the files a save writes. Only such a directory, or an empty one, is
ever replaced or removed; anything else at the target is refused with an error naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable

HEADER_NAME = "context.json"
TENSORS_NAME = "context.safetensors"
FORMAT_MARKER = "proxykv_hf context"
SAVED_FILES = frozenset({HEADER_NAME, TENSORS_NAME})
_MAX_HEADER_BYTES = 64 << 20
_PREFIX_BYTES = 200  # of the target's name in a temporary name: 1 + 200 + 22 bytes stay under NAME_MAX (255)
_TEMP = re.compile(r"^\..*\.pkv-[0-9a-f]{12}\.(tmp|old)$", re.DOTALL)


def normalize(path: str | os.PathLike) -> Path:
    """``path`` with ``~`` expanded and made absolute (``.`` and ``..`` resolved lexically), as every save and load
    names it."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def temp_name(name: str, kind: str = "tmp") -> str:
    """A hidden sibling name for ``name`` (``kind`` ``"tmp"`` or ``"old"``), short enough for any valid ``name``."""
    prefix = os.fsdecode(os.fsencode(name)[:_PREFIX_BYTES])
    return f".{prefix}.pkv-{uuid.uuid4().hex[:12]}.{kind}"


def is_temp(path: Path) -> bool:
    """Whether ``path`` is a temporary directory of a save (named by :func:`temp_name`, holding only saved files)."""
    return bool(_TEMP.match(path.name)) and path.is_dir() and not path.is_symlink() and _only_saved_files(path)


def _only_saved_files(path: Path) -> bool:
    try:
        return all(p.name in SAVED_FILES and p.is_file() and not p.is_symlink() for p in path.iterdir())
    except OSError:
        return False


def is_saved_context(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory this library saved a context to (whole or damaged): its ``context.json`` is
    a header this library writes (the format marker, a ``format_version``, the ``library_version`` and the tensor
    file's name), and it holds only the files a save writes (and a save's temporary directory)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        entries = list(path.iterdir())
        header = path / HEADER_NAME
        if not header.is_file() or header.is_symlink() or header.stat().st_size > _MAX_HEADER_BYTES:
            return False
        data = json.loads(header.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    if not isinstance(data, dict):
        return False
    version, tensors = data.get("format_version"), data.get("tensors")
    if data.get("format") != FORMAT_MARKER or not isinstance(version, int) or isinstance(version, bool) or \
            version < 1 or "library_version" not in data or not isinstance(tensors, dict) or \
            tensors.get("file") != TENSORS_NAME:
        return False
    return all((p.name in SAVED_FILES and p.is_file() and not p.is_symlink()) or is_temp(p) for p in entries)


def check_target(path: str | os.PathLike) -> str:
    """Where a context may be saved: ``"new"`` (nothing there), ``"empty"`` (an empty directory, filled in place)
    or ``"context"`` (a saved context, replaced).

    Raises:
        FileExistsError: ``path`` is a file, or a directory that is not a saved context (its files are never touched).
        NotADirectoryError: a parent of ``path`` is a file.
        PermissionError: the directory that would be written is not writable.
    """
    path = normalize(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise FileExistsError(f"{path} exists and is not a directory; give a new or empty directory, or a saved "
                                  "context to replace")
        if not any(path.iterdir()):
            _check_writable(path, path)
            return "empty"
        if not is_saved_context(path):
            raise FileExistsError(f"{path} is not empty and not a saved proxykv_hf context (no context header of "
                                  "this library, or other files beside it); it is left alone: give a new or empty "
                                  "directory")
        _check_writable(path if _is_cwd(path) else path.parent, path)
        return "context"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot save a context to {path}: {parent} is a file, not a directory")
    _check_writable(parent, path)
    return "new"


def _check_writable(directory: Path, path: Path) -> None:
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot save a context to {path}: the directory {directory} is not writable")


def _is_cwd(path: Path) -> bool:
    try:
        return os.path.samefile(path, os.getcwd())
    except OSError:
        return False


def _chmod_files(directory: Path, mode: int) -> None:
    for file in directory.iterdir():
        os.chmod(file, mode)


def write_directory(path: str | os.PathLike, fill: Callable[[Path], None], *, overwrite: bool = True) -> bool:
    """Create the directory ``path`` whole or not at all: ``fill(tmp)`` writes into a fresh temporary directory,
    which then becomes ``path``.

    A new ``path`` is the temporary directory (beside it) renamed; an existing saved context is renamed away first, so
    that at every moment ``path`` holds the old context, nothing or the new one, and the new directory keeps the old
    one's mode; an empty directory (``.`` included) is filled in place, the header last. Files get the directory's
    permissions, never more than the umask allows.

    Args:
        path: the directory to create (``~`` expanded).
        fill: writes the files (and fsyncs them) into the directory it is given.
        overwrite: replace a saved context at ``path``; False keeps it (two writers racing for one path: the first
            wins).

    Returns:
        True when this call's files are at ``path``; False when ``overwrite`` is False and a context was already
        there.

    Raises:
        FileExistsError, NotADirectoryError, PermissionError: :func:`check_target`, naming ``path``.
    """
    path = normalize(path)
    kind = check_target(path)
    if kind == "context" and not overwrite:
        return False
    in_place = kind == "empty" or _is_cwd(path)
    if kind == "new":
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = (path if in_place else path.parent) / temp_name(path.name)
    try:
        tmp.mkdir()  # the umask's permissions, as any directory the user makes
    except PermissionError as err:
        raise PermissionError(f"cannot save a context to {path}: {tmp.parent} is not writable") from err
    umask_mode = tmp.stat().st_mode & 0o777
    dir_mode = path.stat().st_mode & 0o7777 if kind != "new" else umask_mode
    moved: list[Path] = []
    try:
        os.chmod(tmp, dir_mode | 0o700)  # private while it is filled, if the target is
        fill(tmp)
        _chmod_files(tmp, dir_mode & umask_mode & 0o666)
        if in_place:
            for name in sorted(os.listdir(tmp), key=lambda n: n == HEADER_NAME):  # the header last: until it lands,
                os.replace(tmp / name, path / name)  # the path is no context
                moved.append(path / name)
            tmp.rmdir()
            _fsync(path)
            return True
        os.chmod(tmp, dir_mode)
        if kind == "context":
            old = path.parent / temp_name(path.name, "old")
            os.replace(path, old)  # two renames: at every moment `path` is absent, the old context or the new one
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, path)  # fails when another writer's directory got there first
            except OSError:
                if not is_saved_context(path):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                return False
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for file in moved if kind == "empty" else ():  # an empty directory is left empty
            file.unlink(missing_ok=True)
        raise
    _fsync(path.parent)
    return True


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a directory cannot be opened on some systems: best effort
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_context(path: Path) -> None:
    """Remove the saved context at ``path`` at once (renamed away, so that no reader finds it half deleted), then
    delete it; anything that is not a saved context is left alone."""
    if not is_saved_context(path):
        return
    trash = path.parent / temp_name(path.name, "old")
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)
