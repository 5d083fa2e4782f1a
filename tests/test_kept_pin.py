"""What the caches keep on the real SmolLM2 through ``generate``, pinned as digests: the bundled ProxyKV mapper and
SnapKV, under the uniform and the global budget, on one prompt and on a left-padded batch of two, so that a
refactor of how scores reach the layers (the schedule, the cache, the layers) cannot change the kept entries
unnoticed. The digests were computed before that refactor. The mapper runs in float32 (``mapper_autocast=False``),
so that the pin does not depend on whether the CPU has native bfloat16 (as in ``tests/test_bundled_pin.py``, which
pins the same mapper through a plain forward)."""

import hashlib
import json

import pytest
import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.mapper.hub import BUNDLED_MAPPER
from proxykv_hf.scorers.snapkv import SnapKVScorer

PROMPT = ("The harbour town woke slowly. Fishing boats came in with the tide, and the baker on Quay Street "
          "opened at six as always. Somewhere in the middle of the morning, the postmistress wrote in her diary: "
          "the code word for the lighthouse is marigold-47. Then the rain came, and the gulls went quiet. ") * 2
SHORT = "The ferry sounded twice. The code word for the lighthouse is marigold-47, wrote the postmistress."

# (method, budget, batch) -> first 16 hex digits of the SHA-256 of json.dumps({layer: [row][head] kept positions})
PINNED = {
    ("proxykv", "uniform", 1): "72e081153814b3b1",
    ("proxykv", "global", 1): "fc88fd35d125cc97",
    ("snapkv", "uniform", 1): "254181db56d42ecd",
    ("snapkv", "global", 1): "03244c64eb96931e",
    ("snapkv", "uniform", 2): "6fc89ef99016e2de",
    ("snapkv", "global", 2): "a9dc0f254ee96f41",
}


def digest(cache) -> str:
    kept = {str(i): [[h.tolist() for h in row] for row in rows] for i, rows in sorted(cache.kept_sets().items())}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def make(method: str, budget: str) -> ProxyKVCache:
    if method == "proxykv":
        return ProxyKVCache.from_pretrained(BUNDLED_MAPPER, 0.3, mapper_autocast=False, budget=budget)
    return ProxyKVCache(SnapKVScorer(window=16), 0.3, budget=budget)


def kept_digest(smollm, method: str, budget: str, batch: int) -> str:
    model, tok = smollm
    tok.padding_side = "left"
    inputs = tok([PROMPT, SHORT][:batch], return_tensors="pt", padding=True)
    cache = make(method, budget)
    with torch.no_grad():
        model.generate(**inputs, **with_cache(cache), max_new_tokens=2, do_sample=False)
    return digest(cache)


@pytest.mark.smollm
@pytest.mark.slow
@pytest.mark.parametrize("method, budget, batch", list(PINNED))
def test_kept_entries_are_pinned(smollm, method, budget, batch):
    assert kept_digest(smollm, method, budget, batch) == PINNED[method, budget, batch]
