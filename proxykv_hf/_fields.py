"""A shared check for the ``from_dict`` constructors of the package's config dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Any


def check_known_fields(cls: type, data: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the keys of ``data`` that are not fields of the dataclass ``cls``."""
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
