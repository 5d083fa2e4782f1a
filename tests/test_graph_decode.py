"""StaticDecoder (bench decode with fixed buffers, replayable as CUDA graphs) against plain greedy generate."""

import pytest
import torch

from proxykv_hf import ProxyKVCache, SnapKVScorer
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.bench.graph import StaticDecoder
from proxykv_hf.testing import FAMILIES, random_prompt, tiny_model

FULL_ATTENTION = [f for f in FAMILIES if f != "gemma3"]  # gemma3 mixes in sliding-window layers


def _prefilled(model, ids, keep_ratio):
    cache = ProxyKVCache(None if keep_ratio == 1.0 else SnapKVScorer(window=4), keep_ratio=keep_ratio)
    cache.prepare(model, ids)
    with torch.no_grad():
        logits = model(input_ids=ids, **with_cache(cache), use_cache=True, logits_to_keep=1).logits
    return cache, logits[:, -1].argmax(-1, keepdim=True)


@pytest.mark.parametrize("keep_ratio", [1.0, 0.4])
@pytest.mark.parametrize("family", FULL_ATTENTION)
def test_static_decode_equals_generate(family, keep_ratio):
    model = tiny_model(family)
    ids = random_prompt(1, 48, seed=3)["input_ids"]
    ref_cache, first = _prefilled(model, ids, keep_ratio)
    ref = model.generate(input_ids=torch.cat([ids, first], 1), **with_cache(ref_cache), max_new_tokens=9,
                         do_sample=False, pad_token_id=0)[:, ids.shape[1] + 1:]
    cache, first2 = _prefilled(model, ids, keep_ratio)
    assert torch.equal(first, first2)
    dec = StaticDecoder(model, cache, first, max_new_tokens=12)
    assert dec.cache.length == cache.layers[0].keys.shape[-2]
    dec.run(4)
    out = dec.run(5)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="exceed"):
        dec.run(4)


def test_static_decode_rejects_ragged_layers_and_cpu_graphs():
    model = tiny_model("llama")
    ids = random_prompt(1, 32, seed=4)["input_ids"]
    cache, first = _prefilled(model, ids, 0.5)
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecoder(model, cache, first, 4, graph=True)
    layer = cache.layers[1]
    layer.keys, layer.values = layer.keys[..., :-1, :], layer.values[..., :-1, :]
    with pytest.raises(ValueError, match="same cached length"):
        StaticDecoder(model, cache, first, 4)
    model = tiny_model("gemma3")
    cache, first = _prefilled(model, ids, 1.0)
    with pytest.raises(ValueError, match="sliding"):
        StaticDecoder(model, cache, first, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FULL_ATTENTION)
def test_graph_replay_equals_eager_steps(family):
    model = tiny_model(family).cuda()
    ids = random_prompt(1, 300, seed=5)["input_ids"].cuda()
    cache, first = _prefilled(model, ids, 0.3)
    eager = StaticDecoder(model, cache, first, 16).run(16)
    graph = StaticDecoder(model, cache, first, 16, graph=True).run(16)
    assert torch.equal(eager, graph)
