"""scripts/recency_calibration.py, the scorer plug-in behind a dev-split experiment: the position it reads over the
real tokens, and the penalty between ProxyKV's ranking (weight 0) and the earliest tokens first (a large weight)."""

from __future__ import annotations

import pytest
import torch

from proxykv_hf.eval.methods import record_scores
from proxykv_hf.scorers import ScorerContext, registry
from proxykv_hf.testing import random_prompt, tiny_model
from conftest import load_scorer_plugin
from test_contexts import self_proxy_scorer


@pytest.fixture(scope="module")
def calibration():
    yield from load_scorer_plugin("recency_calibration")


def test_position_runs_from_0_to_1_over_the_real_tokens(calibration):
    valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    got = calibration.position01(valid)
    assert torch.allclose(got, torch.tensor([[0.0, 0.0, 0.0, 0.5, 1.0], [0.0, 0.25, 0.5, 0.75, 1.0]]))


def test_the_weight_moves_the_ranking_from_proxykv_to_the_earliest_tokens(calibration, tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    self_proxy_scorer(model).save_pretrained(tmp_path / "mapper")
    ctx = ScorerContext(model=model, mapper=str(tmp_path / "mapper"))
    inputs = random_prompt(2, 64, seed=3)  # left-padded rows
    inputs["attention_mask"][0, :9] = 0

    def recorded(scorer):
        # the mapper in float32: its bfloat16 logits (CPUs with AVX512-BF16 or AMX) tie, and ties rank either way
        scorer.mapper_autocast = False
        return record_scores(model, scorer, inputs["input_ids"], inputs["attention_mask"]).scores

    plain = recorded(registry.build("proxykv", ctx))
    same = recorded(calibration.build(0.0)(ctx))
    heavy = recorded(calibration.build(1000.0)(ctx))
    valid = inputs["attention_mask"].bool()
    for layer, scores in plain.items():
        for b in range(2):
            real = valid[b]
            for h in range(scores.shape[1]):  # weight 0: ProxyKV's order; a large weight: by place, first first
                order = scores[b, h, real].argsort(descending=True, stable=True)
                assert torch.equal(same[layer][b, h, real].argsort(descending=True, stable=True), order), layer
                assert torch.equal(heavy[layer][b, h, real].argsort(descending=True), torch.arange(int(real.sum())))
    assert registry.describe("proxykv_recency10").startswith("ProxyKV ranks - 0.1")
