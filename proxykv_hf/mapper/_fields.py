"""What the package's config dataclasses and option lists share: the check of their ``from_dict`` constructors and
the dtype names they accept."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names accepted wherever a dtype is given by name (``--dtype``, ``--storage-dtype``)."""


def check_known_fields(cls: type, data: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the keys of ``data`` that are not fields of the dataclass ``cls``."""
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
