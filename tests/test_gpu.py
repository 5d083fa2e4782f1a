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


@pytest.mark.parametrize("proxy_device", [None, "cuda:1"])
def test_side_stream_matches_cpu(tmp_path, proxy_device):
    if proxy_device == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path = _checkpoint(tmp_path)
    inputs = random_prompt(2, 64, lengths=[64, 50])
    kept = {}
    for device in ("cpu", "cuda"):
        target = tiny_model("llama", num_hidden_layers=4).to(device)
        proxy = tiny_model("llama", num_hidden_layers=2, seed=1).to(proxy_device or device)
        cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.3, proxy=proxy,
                                             proxy_device=proxy_device if device == "cuda" else None)
        target.generate(**{k: v.to(device) for k, v in inputs.items()}, past_key_values=cache, max_new_tokens=4,
                        do_sample=False, pad_token_id=0)
        kept[device] = [layer.kept_positions.cpu() for layer in cache.layers]
        assert cache.physical_lengths() == [math.ceil(0.3 * 64) + 3] * 4
    for a, b in zip(kept["cpu"], kept["cuda"]):
        assert (a == b).float().mean() > 0.95  # float differences may flip near-ties
