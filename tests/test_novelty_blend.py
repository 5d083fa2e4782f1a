"""scripts/novelty_blend.py, the scorer plug-in behind a dev-split experiment: the novelty it reads from ProxyKV's
own statistics, and the blend between ProxyKV's ranking (weight 0) and the novelty's (a large weight)."""

from __future__ import annotations

import pytest
import torch

from proxykv_hf.eval.methods import record_scores
from proxykv_hf.scorers import ScorerContext, registry
from proxykv_hf.testing import random_prompt, tiny_model
from conftest import load_scorer_plugin
from test_contexts import self_proxy_scorer


@pytest.fixture(scope="module")
def blend():
    yield from load_scorer_plugin("novelty_blend")


def test_novelty_reads_the_lookback_rows_and_takes_each_kv_heads_largest(blend):
    B, H, T = 1, 4, 3  # two KV heads of two query heads
    sums = torch.full((B, H, T), 7.0)
    lookback = torch.tensor([[[0.9, 0.2, 0.5], [0.1, 0.8, 0.5], [0.0, 1.0, 0.3], [0.4, 0.6, 0.7]]])
    got = blend.novelty(torch.cat([sums, lookback], 1), ["sum", "lookback"], n_kv_heads=2)
    assert torch.allclose(got, torch.tensor([[[0.9, 0.8, 0.5], [1.0, 0.4, 0.7]]]))


def test_the_weight_moves_the_ranking_from_proxykv_to_novelty(blend, tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    self_proxy_scorer(model).save_pretrained(tmp_path / "mapper")
    ctx = ScorerContext(model=model, mapper=str(tmp_path / "mapper"))
    inputs = random_prompt(1, 64, seed=3)
    mask = inputs["attention_mask"]

    def recorded(scorer):
        return record_scores(model, scorer, inputs["input_ids"], mask).scores

    def follows(blended, reference):
        """Whether each head's ``reference`` values, taken in the order of its ``blended`` scores, never rise."""
        for layer, scores in blended.items():
            ranked = reference[layer][0].gather(-1, scores[0].argsort(-1, descending=True))
            assert (ranked[:, 1:] <= ranked[:, :-1] + 1e-5).all(), layer

    plain = recorded(registry.build("proxykv", ctx))
    follows(recorded(blend.build(0.0)(ctx)), plain)  # weight 0: ProxyKV's own order
    novelty = recorded(registry.build("attn_novelty", ctx))  # the no-mapper scorer of the same statistic
    heavy = recorded(blend.build(1000.0)(ctx))
    follows(heavy, novelty)  # a large weight: the novelty's order first
    assert any(not torch.equal(heavy[layer].argsort(-1), plain[layer].argsort(-1)) for layer in plain)
    assert registry.describe("proxykv_novelty25").startswith("ProxyKV + 0.25")


def test_a_checkpoint_without_the_statistic_is_refused(blend, tmp_path):
    from proxykv_hf.cli_helpers import tiny_mapper_checkpoint

    model = tiny_model("llama", num_hidden_layers=4)
    ctx = ScorerContext(model=model, mapper=tiny_mapper_checkpoint(model, str(tmp_path)))  # a "layers" proxy
    with pytest.raises(ValueError, match="self-proxy checkpoint"):
        blend.build(0.5)(ctx)
