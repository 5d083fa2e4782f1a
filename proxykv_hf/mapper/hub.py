"""Finding a mapper checkpoint by name and publishing one: a checkpoint bundled with the package, a local directory,
or a Hub repository through ``huggingface_hub``.

The checkpoint itself (:class:`~proxykv_hf.mapper.checkpoint.Checkpoint`, the directory format, its checks) is
:mod:`proxykv_hf.mapper.checkpoint`'s; its names are importable from here as well.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .checkpoint import (CARD_NAME, CONFIG_NAME, FORMAT_VERSION, WEIGHTS_NAME, Checkpoint, TargetSpec, read_checkpoint,
                         save_checkpoint)

__all__ = ["BUNDLED_DIR", "BUNDLED_MAPPER", "BUNDLED_MAPPERS", "CARD_NAME", "CONFIG_NAME", "FORMAT_VERSION",
           "WEIGHTS_NAME", "Checkpoint", "TargetSpec", "load_checkpoint", "looks_like_local_path", "push_to_hub",
           "resolve", "save_checkpoint"]

BUNDLED_DIR = Path(__file__).parent / "checkpoints"
BUNDLED_MAPPER = "proxykv-smollm2-135m-instruct"  # shipped with the package, for the bundled SmolLM2 target
BUNDLED_MAPPERS = {"smollm2-135m-instruct": BUNDLED_MAPPER,
                   "qwen2.5-coder-1.5b-instruct": "proxykv-qwen2.5-coder-1.5b-instruct"}
"""The mapper shipped with the package for each packaged target (:mod:`proxykv_hf.models`), by model name."""


def looks_like_local_path(name_or_path: str | os.PathLike) -> bool:
    """Whether ``name_or_path`` can only mean a local path, never a Hub repository id.

    A Hub id is ``"name"`` or ``"namespace/name"``, its parts starting with a letter, digit or underscore. So a
    :class:`os.PathLike` (e.g. a :class:`~pathlib.Path`) is a path, and so is a string that is absolute, starts with
    ``"."`` (``"./x"``, ``"../x"``) or ``"~"``, holds a separator other than ``"/"`` (``os.sep`` / ``os.altsep``,
    e.g. ``"\\"`` on Windows), or holds more than one ``"/"``. Anything else (``"org/mapper"``, ``"runs"``) may be
    either, and is looked up as a directory first, then on the Hub.
    """
    if not isinstance(name_or_path, str):
        return True
    name = name_or_path
    seps = {s for s in (os.sep, os.altsep) if s and s != "/"}
    return (os.path.isabs(name) or name.startswith((".", "~")) or any(s in name for s in seps)
            or name.count("/") > 1)


def resolve(name_or_path: str | os.PathLike, *, revision: str | None = None, cache_dir=None, token=None,
            local_files_only: bool | None = None) -> Path:
    """A local directory, a checkpoint bundled with the package (by name, e.g. ``"proxykv-smollm2-135m-instruct"``),
    or a Hub repository downloaded through ``huggingface_hub`` (``HF_HUB_OFFLINE`` honoured).

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a local path (:func:`looks_like_local_path`) and no such
            directory exists; it is not tried as a Hub id.
        ValueError: ``name_or_path`` is a file, not a directory.
        FileNotFoundError: neither a directory nor a Hub repository (offline: one in the HF cache) of that name.
        OSError: a Hub repository that cannot be downloaded for another reason (network).
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if (BUNDLED_DIR / str(name_or_path)).is_dir():  # a checkpoint shipped inside the package, by name
        return BUNDLED_DIR / str(name_or_path)
    if path.exists():
        raise ValueError(f"{str(name_or_path)!r} is a file; a mapper checkpoint is a directory or a Hub repository id")
    if looks_like_local_path(name_or_path):
        raise FileNotFoundError(f"mapper checkpoint directory {str(path)!r} does not exist")
    from huggingface_hub import constants, snapshot_download

    offline = bool(local_files_only or constants.HF_HUB_OFFLINE)
    try:
        local = snapshot_download(str(name_or_path), revision=revision, cache_dir=cache_dir, token=token,
                                  local_files_only=offline, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, CARD_NAME])
    except Exception as err:  # huggingface_hub raises several types for "not there"
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        hint = " (offline mode: it must already be in the HF cache)" if offline else ""
        # not there (offline: not cached), or not a valid repo id: FileNotFoundError; the rest (network): OSError
        missing = isinstance(err, (FileNotFoundError, ValueError, RepositoryNotFoundError, RevisionNotFoundError))
        raise (FileNotFoundError if missing else OSError)(
            f"could not find the mapper checkpoint {str(name_or_path)!r} as a local directory or a Hub "
            f"repository{hint}: {err}") from err
    return Path(local)


def load_checkpoint(name_or_path: str | os.PathLike, *, map_location: str | torch.device = "cpu",
                    **hub_kwargs) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint` from a directory or a Hub id.

    Args:
        name_or_path: a checkpoint directory, the name of a bundled checkpoint, or a Hub repository id
            (:func:`resolve`; a string that can only be a path, :func:`looks_like_local_path`, is never sent to
            the Hub).
        map_location: device of the loaded mappers.
        **hub_kwargs: ``revision``, ``cache_dir``, ``token``, ``local_files_only`` for :func:`resolve`.

    Raises:
        FileNotFoundError: a local path that does not exist, or a Hub id that cannot be found.
        OSError: a directory without the checkpoint files, or a Hub repository that cannot be downloaded.
        ValueError: a file that cannot be read as what it should be
            (:func:`~proxykv_hf.mapper.checkpoint.read_checkpoint`); the message names the file.
    """
    return read_checkpoint(resolve(name_or_path, **hub_kwargs), map_location=map_location)


def push_to_hub(ckpt: Checkpoint, repo_id: str, *, private: bool = False, token=None,
                commit_message: str = "Upload ProxyKV mapper") -> str:
    """Create ``repo_id`` if needed and upload the checkpoint; returns the commit URL."""
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(ckpt, tmp)
        info = api.upload_folder(folder_path=tmp, repo_id=repo_id, commit_message=commit_message)
    return str(info)
