"""An exclusive advisory file lock across processes (``fcntl.flock``, ``msvcrt`` on Windows), released by the OS
when its holder dies; used so that concurrent processes convert a model once."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .parts import ModelCacheError

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 30 * 60.0


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (released by the OS if the holder dies), waiting with a progress bar."""
    try:
        handle = open(path, "a+b")  # noqa: SIM115 - closed in finally
    except OSError as err:
        raise ModelCacheError(f"cannot create the lock file {str(path)!r} ({err}); set PROXYKV_HF_CACHE to a "
                              f"writable directory") from err
    try:
        if not _try_lock(handle):
            from tqdm.auto import tqdm

            logger.info("another process is converting a model (lock %s); waiting", path)
            start = time.monotonic()
            with tqdm(desc="waiting for the model conversion in another process", unit="s",
                      bar_format="{desc}: {elapsed}") as bar:
                while not _try_lock(handle):
                    if time.monotonic() - start > timeout_s:
                        raise ModelCacheError(f"timed out after {timeout_s:.0f} s waiting for the lock "
                                              f"{str(path)!r}; if no other process is converting the model, delete "
                                              f"the file")
                    time.sleep(0.5)
                    bar.update(0.5)
        yield
    finally:
        _unlock(handle)
        handle.close()


@contextlib.contextmanager
def try_file_lock(path: Path) -> Iterator[bool]:
    """:func:`file_lock` without waiting: yields whether the lock was taken (False while another process holds it,
    or where the lock file cannot be opened)."""
    try:
        handle = open(path, "a+b")  # noqa: SIM115 - closed in finally
    except OSError:
        yield False
        return
    locked = False
    try:
        locked = _try_lock(handle)
        yield locked
    finally:
        if locked:
            _unlock(handle)
        handle.close()


def _try_lock(handle: Any) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _unlock(handle: Any) -> None:
    try:
        import fcntl
    except ImportError:
        import msvcrt

        with contextlib.suppress(OSError):
            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
        return
    with contextlib.suppress(OSError):
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
