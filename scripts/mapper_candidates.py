"""A scorer plug-in: ProxyKV with several mapper checkpoints in one evaluation run (a dev-split tool).

``proxykv eval --mapper`` scores one checkpoint a run. This plug-in registers one method per checkpoint named in the
environment variable ``PROXYKV_CANDIDATES`` (``name=directory`` pairs, comma-separated): ``proxykv_<name>``. The
harness shares one prefill among methods that read it the same way, so candidates of one self proxy cost one
prefill a sample between them, and each keeps what ``--mapper directory`` would keep.

How to run me (dev split: a choice is made on it)::

    PROXYKV_CANDIDATES=a=runs/mapper-a,b=runs/mapper-b PYTHONPATH=scripts proxykv eval \\
        --plugin mapper_candidates --tasks passkey:filler-dev2 --seed 1000003 --methods proxykv_a proxykv_b \\
        --keep-ratios 0.1 0.2 0.3 0.5 --context-lengths 2048 --n-samples 80 --max-new-tokens 40 \\
        --out-dir runs/dev-candidates
"""

from __future__ import annotations

import dataclasses
import os

from proxykv_hf.scorers import registry
from proxykv_hf.scorers.registry import ScorerContext

VARIABLE = "PROXYKV_CANDIDATES"


def parse(text: str) -> dict[str, str]:
    """``"a=dir1,b=dir2"`` -> ``{"a": "dir1", "b": "dir2"}``; a bad or repeated name raises ``ValueError``."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.isidentifier() or not path:
            raise ValueError(f"{VARIABLE}: {item!r} is not name=directory with an identifier for a name")
        if name in out:
            raise ValueError(f"{VARIABLE}: the name {name!r} is given twice")
        out[name] = path
    return out


def build(path: str):
    """The registry's own ``proxykv`` builder, with the mapper ``path`` in place of ``--mapper``."""
    def build_candidate(ctx: ScorerContext):
        return registry.build("proxykv", dataclasses.replace(ctx, mapper=path))

    return build_candidate


for _name, _path in parse(os.environ.get(VARIABLE, "")).items():
    registry.register(f"proxykv_{_name}", build(_path), f"ProxyKV with the mapper in {_path}", replace=True)
