"""KVzip+IAM: KVzip on a proxy, mapped by a fixed layer/head alignment."""

import math

import pytest
import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.mapper.proxy import layer_subset, proxy_features
from proxykv_hf.scorers.iam import KVzipIAMScorer
from proxykv_hf.scorers.kvzip import kvzip_scores
from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=6)


def test_default_alignment_and_scores(target):
    tok = tiny_tokenizer()
    proxy = tiny_model("llama", num_hidden_layers=2, num_key_value_heads=1, seed=3)
    inputs = random_prompt(2, 40, lengths=[40, 30], seed=1)
    scorer = KVzipIAMScorer(tok, proxy=proxy, context_chunk=32)
    cache = ProxyKVCache(scorer, keep_ratio=0.3)
    target.generate(**inputs, **with_cache(cache), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert cache.scorer.layer_map == [0, 0, 0, 1, 1, 1]  # ceil(l * 2 / 6) - 1 (on the cache's own copy)
    assert cache.scorer.head_map == [[0, 0]] * 6  # two target KV heads read the proxy's single KV head
    assert cache.physical_lengths() == [math.ceil(0.3 * 40) + 2] * 6
    # the kept set is the Top-K of the proxy's KVzip scores of the aligned layer
    y = kvzip_scores(proxy, inputs["input_ids"], inputs["attention_mask"], tokenizer=tok, context_chunk=32)
    from proxykv_hf.cache.selection import select_topk

    idx, _ = select_topk(y[1][:, [0, 0]], 0.3, inputs["attention_mask"].bool(), n_sink=4)
    assert torch.equal(idx, cache.layers[5].kept_positions)


def test_calibration_recovers_a_known_alignment(target):
    """With the target itself as proxy, each layer and head aligns to itself."""
    tok = tiny_tokenizer()
    inputs = random_prompt(2, 36, seed=2)
    scorer = KVzipIAMScorer(tok, proxy=target, context_chunk=64).calibrate(target, **inputs)
    assert scorer.layer_map == list(range(6))
    assert scorer.head_map == [[0, 1]] * 6


def test_layer_subset_is_renumbered_and_shares_weights(target):
    sub = layer_subset(target, [1, 3, 5])
    assert [layer.self_attn.layer_idx for layer in sub.layers] == [0, 1, 2]
    assert [layer.self_attn.layer_idx for layer in target.model.layers] == list(range(6))
    assert sub.layers[1].self_attn.q_proj.weight is target.model.layers[3].self_attn.q_proj.weight
    x = proxy_features(target, **random_prompt(1, 12), layers=[1, 3, 5])
    assert x.shape == (1, 3, 4, 12)
    with pytest.raises(ValueError, match="increasing"):
        layer_subset(target, [3, 1])
    with pytest.raises(ValueError, match="out of range"):
        layer_subset(target, [0, 9])


def test_layer_subset_proxy_scores_on_a_model_not_yet_opted_in():
    """proxy_scores may be the first thing a fresh target runs: the subset's attention (the target's own modules,
    reading the target's config) must still reach KVzip's recorder, and give the subset's own KVzip scores."""
    tok = tiny_tokenizer()
    inputs = random_prompt(1, 40, seed=4)
    fresh = tiny_model("llama", num_hidden_layers=6)
    scores = KVzipIAMScorer(tok, layers=[1, 4], context_chunk=32).proxy_scores(fresh, **inputs)
    want = kvzip_scores(layer_subset(tiny_model("llama", num_hidden_layers=6), [1, 4]), inputs["input_ids"],
                        tokenizer=tok, context_chunk=32)
    assert scores.shape == (2, 1, 2, 40) and torch.allclose(scores, want)


def test_settings_name_the_proxy_and_stay_the_same_after_compressing(tmp_path):
    from proxykv_hf import ContextStore, ProxyKVPipeline
    from proxykv_hf.contexts.pipeline import compress_context

    model, tok = tiny_model("llama"), tiny_tokenizer()
    proxies = [tiny_model("llama", seed=s, num_hidden_layers=2) for s in (1, 2)]
    pipes = [ProxyKVPipeline(model, tok, KVzipIAMScorer(tok, proxy=p, context_chunk=16), keep_ratio=0.3) for p in proxies]
    store, text = ContextStore(tmp_path / "store"), "The code word is ZEBRA-42 and the door opens at nine. " * 3
    assert store.key(pipes[0], text) != store.key(pipes[1], text)
    scorer = KVzipIAMScorer(tok, context_chunk=16)
    before = scorer.settings()
    ids = random_prompt(1, 60, seed=2)["input_ids"]
    cache = compress_context(model, ProxyKVCache(scorer, 0.3), ids)
    assert cache.scorer.layer_map is not None and cache.scorer.settings() == before  # the default is not a setting
    cache.save_context(tmp_path / "ctx", tok)
    loaded = ProxyKVCache.load_context(tmp_path / "ctx", model, tok, scorer=scorer)
    assert loaded.kept_sets().keys() == cache.kept_sets().keys()
    scorer.layer_map, scorer.head_map = [0, 0, 0], [[0, 0]] * 3  # set by hand: a setting, and kept by prepare()
    assert scorer.settings()["layer_map"] == [0, 0, 0]
