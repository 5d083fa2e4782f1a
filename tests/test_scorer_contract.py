"""The contract every registered scorer keeps, checked on each one: the shape of its scores, higher = keep, a padded
row scored as it would be alone, keep_ratio 1 identical to a DynamicCache, and a clear error for a wrong shape."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from proxykv_hf import LayerScorer, ModelScorer, ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.cli.helpers import tiny_mapper_checkpoint
from proxykv_hf.eval.methods import record_scores
from proxykv_hf.scorers import ScorerContext, registry
from proxykv_hf.scorers.proxy import bfloat16_is_fast
from proxykv_hf.cache.selection import keep_counts, select_topk
from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer

BUILT_IN = [name for name in registry.names() if name != "full"]
GEN = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", num_hidden_layers=4)
    mapper = tiny_mapper_checkpoint(model)  # in memory: the registry takes a Checkpoint
    ctx = ScorerContext(model=model, tokenizer=tiny_tokenizer(), mapper=mapper, fields={"context_chunk": 16})
    return model, _ProxyContexts(ctx)


class _ProxyContexts:
    """The test context, with a separate proxy model (other depth and head count) for the ``proxy_*`` methods."""

    def __init__(self, ctx):
        self.plain = ctx
        self.with_proxy = copy.copy(ctx)
        self.with_proxy.proxy = tiny_model("llama", num_hidden_layers=3, num_attention_heads=8, seed=1)

    def __getattr__(self, name):
        return getattr(self.plain, name)


def _build(name, ctx):
    return registry.build(name, ctx.with_proxy if name.startswith("proxy_") else ctx.plain)


def _recorded(model, scorer, inputs) -> dict[int, torch.Tensor]:
    return record_scores(model, scorer, inputs["input_ids"], inputs["attention_mask"]).scores


def test_every_built_in_method_is_registered():
    assert set(BUILT_IN) >= {"kvzip", "snapkv", "streaming", "random", "proxykv", "kvzip_iam", "attn_sum",
                             "attn_max", "attn_novelty", "proxy_novelty", "proxy_max", "proxy_sum"}


@pytest.mark.parametrize("name", BUILT_IN)
def test_scores_shape_and_higher_means_keep(setup, name):
    model, ctx = setup
    scorer = _build(name, ctx)
    assert isinstance(scorer, (LayerScorer, ModelScorer))
    inputs = random_prompt(2, 120, lengths=[120, 100], seed=3)  # longer than SnapKV's window of 64
    scores = _recorded(model, scorer, inputs)
    cache = ProxyKVCache(scorer.fresh(), keep_ratio=0.3, budget="uniform")
    model.generate(**inputs, **with_cache(cache), **GEN)
    assert sorted(scores) == cache.compactable_layers()
    for i, s in scores.items():
        assert s.shape == (2, model.config.num_key_value_heads, 120)
        want, _ = select_topk(s, 0.3, inputs["attention_mask"].bool(), cache.n_sink, cache.n_recent)
        assert torch.equal(cache.layers[i].kept_positions.cpu(), want)  # the cache keeps the highest scores


@pytest.mark.parametrize("name", BUILT_IN)
def test_padded_rows_score_as_alone(setup, name):
    model, ctx = setup
    scorer = _build(name, ctx)
    batch = random_prompt(2, 40, lengths=[40, 29], seed=5)
    alone = {k: v[1:, -29:] for k, v in batch.items()}
    together, single = _recorded(model, scorer, batch), _recorded(model, scorer, alone)
    # a mapper under bfloat16 autocast rounds differently in a batch of two than alone
    tol = 3e-2 if getattr(scorer, "mapper_autocast", False) and bfloat16_is_fast(torch.device("cpu")) else 1e-4
    for i in together:
        a, b = together[i][1, :, -29:], single[i][0]
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a, b, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("name", BUILT_IN)
def test_keep_ratio_one_is_a_dynamic_cache(setup, name):
    model, ctx = setup
    inputs = random_prompt(2, 30, lengths=[30, 22], seed=7)
    ref = model.generate(**inputs, **with_cache(DynamicCache(config=model.config)), **GEN)
    for budget in ("uniform", "global"):
        cache = ProxyKVCache(_build(name, ctx), keep_ratio=1.0, budget=budget)
        assert torch.equal(ref, model.generate(**inputs, **with_cache(cache), **GEN))


@pytest.mark.parametrize("name", BUILT_IN)
def test_global_budget_keeps_the_nominal_total(setup, name):
    """Under the global budget every scorer's cache holds each row's nominal total, spread over layers and heads."""
    model, ctx = setup
    inputs = random_prompt(2, 100, lengths=[100, 80], seed=8)
    cache = ProxyKVCache(_build(name, ctx), keep_ratio=0.3, budget="global")
    model.generate(**inputs, **with_cache(cache), max_new_tokens=1, do_sample=False, pad_token_id=0)
    k = keep_counts(inputs["attention_mask"].sum(-1), 0.3, cache.n_sink + cache.n_recent)
    L, H = len(cache.compactable_layers()), model.config.num_key_value_heads
    assert cache.held_entries() == int(k.sum()) * L * H


@pytest.mark.parametrize("name", BUILT_IN)
def test_wrong_score_shape_is_a_clear_error(setup, name, monkeypatch):
    model, ctx = setup
    cache = ProxyKVCache(_build(name, ctx), keep_ratio=0.3)
    scorer = cache.scorer  # the cache scores with its own copy
    if isinstance(scorer, ModelScorer):
        real = scorer.score_all
        monkeypatch.setattr(scorer, "score_all", lambda *a: {i: s[..., 1:] for i, s in real(*a).items()})
    else:
        real = scorer.score
        monkeypatch.setattr(scorer, "score", lambda inputs: real(inputs)[..., 1:])
    inputs = random_prompt(1, 100, seed=9)
    with pytest.raises(ValueError, match=r"returned scores of shape \(1, 2, 99\) .* expected \(1, 2, 100\)"):
        model.generate(**inputs, **with_cache(cache), **GEN)


def test_registry_refuses_bad_names_and_builders():
    with pytest.raises(ValueError, match="already registered"):
        registry.register("snapkv", lambda ctx: None)
    with pytest.raises(ValueError, match="identifier other than 'full'"):
        registry.register("full", lambda ctx: None)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        registry.build("nope", ScorerContext())
    registry.register("not_a_scorer", lambda ctx: object())
    try:
        with pytest.raises(ValueError, match="returned object, not a Scorer"):
            registry.build("not_a_scorer", ScorerContext())
    finally:
        registry.unregister("not_a_scorer")
    with pytest.raises(ValueError, match="must subclass LayerScorer or ModelScorer"):
        ProxyKVCache(object(), keep_ratio=0.5)


def test_a_separate_proxy_is_hashed_once_and_again_after_it_changes(monkeypatch):
    import proxykv_hf.models.fingerprints as fp
    from proxykv_hf import ProxyScorer
    from proxykv_hf.mapper.hub import Checkpoint, TargetSpec
    from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
    from proxykv_hf.mapper.proxy import ProxySpec

    proxy = tiny_model("llama", seed=3, num_hidden_layers=4)
    mapper = HybridAxialMapper(MapperConfig.tiny(num_proxy_layers=4, num_proxy_heads=4, num_target_layers=3,
                                                 num_target_heads=2, num_statistics=1)).eval()
    ckpt = Checkpoint(mapper=mapper, proxy=ProxySpec(kind="model", model_id="p", num_layers=4, num_heads=4,
                                                     statistics=["sum"]),
                      target=TargetSpec(model_id="t", model_type="llama", num_layers=3, num_kv_heads=2, num_heads=4))
    scorer = ProxyScorer(ckpt, proxy_model=proxy, mapper_autocast=False)
    first = scorer.settings()
    assert first["proxy_model"]["weights"]
    hashed = []
    original = fp._tensor_bytes
    monkeypatch.setattr(fp, "_tensor_bytes", lambda t: hashed.append(t.numel()) or original(t))
    assert scorer.settings() == first and hashed == []  # memoised: nothing read again
    with torch.no_grad():
        next(proxy.parameters())[0, 0] += 1.0
    assert scorer.settings()["proxy_model"] != first["proxy_model"] and hashed
