"""What the package's config dataclasses and option lists share: the check of their ``from_dict`` constructors, the
dtype names they accept, and old spellings of renamed options."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names accepted wherever a dtype is given by name (``--dtype``, ``--storage-dtype``)."""


def check_known_fields(cls: type, data: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the keys of ``data`` that are not fields of the dataclass ``cls``."""
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {unknown}")


def drop_removed_fields(data: dict[str, Any], removed: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` without the keys of options that were removed (``removed``: name -> the neutral value, what the
    option did when it was off), so that files written before the removal still load.

    Raises:
        ValueError: a removed option with another value than its neutral one, naming the field (what the file asks
            for can no longer be done).
    """
    for name, neutral in removed.items():
        if name in data:
            value = data[name]
            if value != neutral or isinstance(value, bool) != isinstance(neutral, bool):
                raise ValueError(f"{where} field {name!r} was removed; only its neutral value {neutral!r} is "
                                 f"accepted, got {value!r}")
    return {k: v for k, v in data.items() if k not in removed}


def renamed_option(value: Any, old_value: Any, owner: str, old: str, new: str) -> Any:
    """``value``, or ``old_value`` where a caller still passes the option by its old name ``old`` (not None), with a
    ``FutureWarning`` naming the new one."""
    if old_value is None:
        return value
    warnings.warn(f"{owner}({old}=...) is deprecated; use {new}=...", FutureWarning, stacklevel=3)
    return old_value
