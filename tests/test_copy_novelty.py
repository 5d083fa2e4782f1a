"""scripts/copy_novelty.py, the scorer plug-in behind a dev-split experiment: layers before the first source keep
ProxyKV's scores; from a source layer on, the blend moves each head's ranking from ProxyKV's (weight 0) to the
source layer's novelty (a large weight), per KV head where a retrieval table weighs the heads."""

from __future__ import annotations

import json

import pytest
import torch

from proxykv_hf.eval.methods import record_scores
from proxykv_hf.scorers import ScorerContext, registry
from proxykv_hf.testing import random_prompt, tiny_model
from conftest import load_scorer_plugin
from test_contexts import self_proxy_scorer


@pytest.fixture(scope="module")
def blend():
    yield from load_scorer_plugin("copy_novelty")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("llama", num_hidden_layers=4)
    path = tmp_path_factory.mktemp("mapper") / "m"
    self_proxy_scorer(model).save_pretrained(path)
    inputs = random_prompt(1, 64, seed=3)

    def recorded(scorer):
        return record_scores(model, scorer, inputs["input_ids"], inputs["attention_mask"]).scores

    return model, ScorerContext(model=model, mapper=str(path)), recorded


def follows(scores: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether each head's ``reference`` values, taken in the order of its ``scores``, never rise."""
    ranked = reference[0].gather(-1, scores[0].argsort(-1, descending=True))
    return bool((ranked[:, 1:] <= ranked[:, :-1] + 1e-5).all())


def test_layers_from_the_source_on_follow_its_novelty_under_a_large_weight(blend, setup):
    model, ctx, recorded = setup
    plain = recorded(registry.build("proxykv", ctx))
    novelty = recorded(registry.build("attn_novelty", ctx))  # (1, H_kv, T) per layer
    source_layer = novelty[2].amax(1, keepdim=True)  # the source's novelty: the largest over all its heads
    light = recorded(blend.build((2,), 0.0)(ctx))
    heavy = recorded(blend.build((2,), 1000.0)(ctx))
    for layer in plain:
        assert follows(light[layer], plain[layer])  # weight 0: ProxyKV's own order everywhere
    for layer in (0, 1):
        assert torch.equal(heavy[layer], plain[layer])  # before the source: ProxyKV's scores, untouched
    for layer in (2, 3):
        assert follows(heavy[layer], source_layer.expand_as(heavy[layer]))
        assert not torch.equal(heavy[layer].argsort(-1), plain[layer].argsort(-1))


def test_a_retrieval_table_weighs_each_kv_head(blend, setup, tmp_path, monkeypatch):
    model, ctx, recorded = setup
    n_kv = model.config.num_key_value_heads
    table = [[0.0] * n_kv for _ in range(model.config.num_hidden_layers)]
    table[3][0] = 1.0  # only layer 3's first KV head blends
    path = tmp_path / "retrieval.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(blend, "RETRIEVAL", str(path))
    plain = recorded(registry.build("proxykv", ctx))
    source_layer = recorded(registry.build("attn_novelty", ctx))[1].amax(1, keepdim=True)
    got = recorded(blend.build((1,), 1000.0, per_head=True)(ctx))
    assert follows(got[3][:, :1], source_layer)
    for layer in got:
        heads = range(1, n_kv) if layer == 3 else range(n_kv)
        for h in heads:
            assert follows(got[layer][:, h:h + 1], plain[layer][:, h:h + 1])
    monkeypatch.setattr(blend, "RETRIEVAL", None)
    with pytest.raises(ValueError, match="PROXYKV_RETRIEVAL"):
        blend.build((1,), 1.0, per_head=True)(ctx)


def test_a_checkpoint_without_the_statistic_is_refused(blend, tmp_path):
    from proxykv_hf.cli_helpers import tiny_mapper_checkpoint

    model = tiny_model("llama", num_hidden_layers=4)
    ctx = ScorerContext(model=model, mapper=tiny_mapper_checkpoint(model, str(tmp_path)))  # a "layers" proxy
    with pytest.raises(ValueError, match="self-proxy checkpoint"):
        blend.build((1,), 0.5)(ctx)
    assert registry.describe("proxykv_nov20_30").startswith("ProxyKV + 0.3")
