"""scripts/depth_table.py: the samples the full cache answers, counted per depth bin for each method and ratio."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "depth_table.py"


def _module():
    spec = importlib.util.spec_from_file_location("depth_table", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_the_samples_the_full_cache_answers_count_in_their_depth_bin():
    rec = lambda s, m, r, score: {"sample": s, "method": m, "keep_ratio": r, "score": score}  # noqa: E731
    records = [rec(0, "full", 1.0, 1.0), rec(1, "full", 1.0, 1.0), rec(2, "full", 1.0, 0.0), rec(3, "full", 1.0, 1.0),
               rec(0, "kvzip", 0.1, 1.0), rec(1, "kvzip", 0.1, 0.5), rec(2, "kvzip", 0.1, 1.0), rec(3, "kvzip", 0.1, 1.0),
               rec(0, "proxykv", 0.1, 0.0), rec(1, "proxykv", 0.1, 1.0), rec(3, "proxykv", 0.1, 1.0)]
    rows = _module().depth_rows(records, {0: 0.1, 1: 0.6, 2: 0.1, 3: 1.0}, bins=2)
    assert rows == {"full": {1.0: [1, 2]}, "kvzip": {0.1: [1, 1]}, "proxykv": {0.1: [0, 2]}}
