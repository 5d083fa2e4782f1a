"""The mapper checkpoint shipped in the package matches the bundled SmolLM2-135M-Instruct target."""

import pytest

from proxykv_hf import ProxyKVCache
from proxykv_hf.hub import BUNDLED_DIR, BUNDLED_MAPPER, load_checkpoint


def test_shipped_checkpoint_matches_smollm2_shape():
    path = BUNDLED_DIR / BUNDLED_MAPPER
    assert path.is_dir(), f"the bundled mapper is missing from {path}"
    ckpt = load_checkpoint(BUNDLED_MAPPER)  # resolves by name, offline
    assert (ckpt.target.num_layers, ckpt.target.num_kv_heads, ckpt.target.num_heads) == (30, 3, 9)
    assert ckpt.mapper.config.num_target_layers == 30 and ckpt.mapper.config.num_target_heads == 3
    assert ckpt.proxy.num_heads == 9
    assert ckpt.proxy.kind == "self" and ckpt.proxy.statistics == ["sum", "max", "lookback"]  # docs/training.md
    assert ckpt.mapper.config.num_statistics == 3
    assert ckpt.metrics, "the checkpoint records its validation metrics"


@pytest.mark.smollm
@pytest.mark.slow
def test_shipped_checkpoint_runs_on_smollm2(smollm):
    model, tok = smollm
    cache = ProxyKVCache.from_pretrained(BUNDLED_MAPPER, keep_ratio=0.3)
    cache.scorer.checkpoint.check_target(model.config)
    inputs = tok(["The code word is azure. " * 20], return_tensors="pt")
    model.generate(**inputs, past_key_values=cache, max_new_tokens=2, do_sample=False)
    n = inputs["input_ids"].shape[1]
    assert cache.physical_lengths()[0] == -(-3 * n // 10) + 1
