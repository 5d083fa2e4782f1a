"""File errors a user can act on. safetensors raises its own ``SafetensorError`` (not an ``OSError``) for a damaged
file and for a failed write alike: :func:`reading` turns it into a ``ValueError`` naming the file, :func:`writing`
into the ``OSError`` it stands for (a full disk, a read-only file system), naming the file. :func:`environment_errno`
tells the errors of the machine (full disk, read-only or unwritable directory) from bugs."""

from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from typing import Iterator

from safetensors import SafetensorError

ENVIRONMENT_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                                errno.ENAMETOOLONG})
"""``OSError`` numbers that are the environment's doing (full disk or quota, read-only file system, no
permission, a name too long), never a bug."""

_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_errno(err: BaseException) -> int | None:
    """The errno of ``err``: an ``OSError``'s own, or the ``(os error N)`` a ``SafetensorError`` quotes; else None."""
    if isinstance(err, OSError):
        return err.errno
    if isinstance(err, SafetensorError):
        found = _OS_ERROR.search(str(err))
        return int(found.group(1)) if found else None
    return None


def environment_errno(err: BaseException) -> bool:
    """Whether ``err`` is an ``OSError`` (or safetensors' report of one) of :data:`ENVIRONMENT_ERRNOS`."""
    return os_errno(err) in ENVIRONMENT_ERRNOS


@contextmanager
def reading(path: str | os.PathLike, what: str = "file") -> Iterator[None]:
    """Around reading the safetensors file ``path``: a ``SafetensorError`` becomes a ``ValueError`` naming it (the
    ``OSError`` it quotes, where it quotes one).

    Args:
        path: the file read.
        what: what the file is, for the message (``"shard"``, ``"checkpoint"``).
    """
    try:
        yield
    except SafetensorError as err:
        code = os_errno(err)
        if code is not None:
            raise OSError(code, os.strerror(code), os.fspath(path)) from err
        raise ValueError(f"{os.fspath(path)} is not a readable safetensors file ({err}): the {what} is damaged or "
                         "truncated") from err


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Around writing the safetensors file ``path``: a ``SafetensorError`` that quotes an ``OSError`` (a full disk)
    becomes that ``OSError``, naming ``path``; any other (tensors it cannot store: a bug) propagates as it is."""
    try:
        yield
    except SafetensorError as err:
        code = os_errno(err)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), os.fspath(path)) from err
