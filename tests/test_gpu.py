"""CUDA paths (skipped without a GPU): side-stream proxy scoring equals the CPU result; a proxy on another device."""

import math

import pytest
import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.hub import Checkpoint, TargetSpec, save_checkpoint
from proxykv_hf.mapper import HybridAxialMapper, MapperConfig
from proxykv_hf.proxy import ProxySpec
from proxykv_hf.testing import random_prompt, tiny_model

pytestmark = pytest.mark.gpu


def _checkpoint(tmp_path):
    spec = ProxySpec(kind="model", num_layers=2, num_heads=4, model_id="tiny-proxy")
    cfg = MapperConfig.tiny(num_proxy_layers=2, num_proxy_heads=4, num_target_layers=4, num_target_heads=2)
    torch.manual_seed(0)
    target = TargetSpec(model_id="t", model_type="llama", num_layers=4, num_kv_heads=2, num_heads=4)
    return save_checkpoint(Checkpoint(mapper=HybridAxialMapper(cfg).eval(), proxy=spec, target=target), tmp_path)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean share of the kept positions two selections `(B, H, K)` have in common."""
    same = [len(set(x.tolist()) & set(y.tolist())) / len(x) for x, y in zip(a.flatten(0, 1), b.flatten(0, 1))]
    return sum(same) / len(same)


@pytest.mark.parametrize("proxy_device", [None, "cuda:1"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("overlap", [None, True])
def test_side_stream_matches_cpu(tmp_path, monkeypatch, proxy_device, padded, overlap):
    """The threaded side-stream path (fused attention sums when unpadded) selects what the CPU path selects."""
    if proxy_device == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the mapper's convolutions: full float32
    path = _checkpoint(tmp_path)
    inputs = random_prompt(2, 64, lengths=[64, 50] if padded else None)
    kept, scores = {}, {}
    for device, autocast in (("cpu", False), ("cuda", False), ("cuda", True)):
        target = tiny_model("llama", num_hidden_layers=4).to(device)
        proxy = tiny_model("llama", num_hidden_layers=2, seed=1).to(proxy_device or device)
        for record_only in (False, True):
            cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.3, proxy=proxy, record_only=record_only,
                                                 proxy_device=proxy_device if device == "cuda" else None)
            cache.scorer.mapper_autocast, cache.scorer.overlap = autocast, overlap
            target.generate(**{k: v.to(device) for k, v in inputs.items()}, past_key_values=cache,
                            max_new_tokens=4, do_sample=False, pad_token_id=0)
            if record_only:
                scores[device, autocast] = [cache.scores[i].float().cpu() for i in sorted(cache.scores)]
            else:
                kept[device, autocast] = [layer.kept_positions.cpu() for layer in cache.layers]
                assert cache.physical_lengths() == [math.ceil(0.3 * 64) + 3] * 4
    for a, b, c in zip(scores["cpu", False], scores["cuda", False], scores["cuda", True]):
        scale = a[torch.isfinite(a)].abs().max()
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b)) and torch.equal(fin, torch.isfinite(c))  # padding: -inf alike
        torch.testing.assert_close(b[fin], a[fin], atol=1e-4 * scale, rtol=1e-4)
        torch.testing.assert_close(c[fin], a[fin], atol=5e-2 * scale, rtol=5e-2)  # bfloat16 mapper
    for a, b in zip(kept["cpu", False], kept["cuda", False]):
        assert _overlap(a, b) > 0.8  # equal scores up to float noise; a random tiny mapper has many near-ties
