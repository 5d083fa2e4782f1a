"""scripts/surprisal_blend.py, the scorer plug-in behind a dev-split experiment: its ranks, its surprisal, and the
blend between ProxyKV's choice (weight 0) and the surprisal's (a large weight)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from proxykv_hf.cli_helpers import tiny_mapper_checkpoint
from proxykv_hf.eval.methods import record_scores
from proxykv_hf.scorers import ScorerContext, registry
from proxykv_hf.testing import random_prompt, tiny_model

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "surprisal_blend.py"


@pytest.fixture(scope="module")
def blend():
    before = set(registry.names())
    spec = importlib.util.spec_from_file_location("surprisal_blend", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for name in set(registry.names()) - before:  # leave the registry as the other tests find it
        registry.unregister(name)


def test_ranks_cover_the_real_tokens_only(blend):
    scores = torch.tensor([[3.0, -1.0, 7.0, 0.5], [9.0, 2.0, 1.0, 4.0]])
    valid = torch.tensor([[True, True, True, True], [False, True, True, True]])
    got = blend.rank01(scores, valid)
    assert torch.allclose(got[0], torch.tensor([2 / 3, 0.0, 1.0, 1 / 3]))
    assert torch.allclose(got[1], torch.tensor([0.0, 0.5, 0.0, 1.0]))  # padding 0; 1 < 2 < 4 over the real three


def test_surprisal_is_the_negative_log_probability_of_each_next_token(blend):
    vocab = 8

    class Uniform(torch.nn.Module):  # every token equally likely: each surprisal is log(vocab)
        def forward(self, input_ids, **kwargs):
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, vocab))

    ids = torch.tensor([[1, 5, 2, 7]])
    got = blend.surprisal(Uniform(), ids, torch.ones_like(ids, dtype=torch.bool))
    assert torch.allclose(got, torch.tensor([[0.0] + [math.log(vocab)] * 3]))

    class Sure(torch.nn.Module):  # always certain of token 5: 0 where 5 comes, large elsewhere
        def forward(self, input_ids, **kwargs):
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, vocab).index_fill_(-1, torch.tensor([5]), 50.0))

    got = blend.surprisal(Sure(), ids, torch.ones_like(ids, dtype=torch.bool))[0]
    assert got[1] < 1e-6 and got[2] > 40 and got[3] > 40


def test_the_weight_moves_the_choice_from_proxykv_to_surprisal(blend, tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    ctx = ScorerContext(model=model, mapper=tiny_mapper_checkpoint(model, str(tmp_path)))
    inputs = random_prompt(1, 48, seed=3)
    mask = inputs["attention_mask"]

    def recorded(scorer):
        return record_scores(model, scorer, inputs["input_ids"], mask).scores

    def top(scores, k=12):
        return {layer: [set(head.topk(k).indices.tolist()) for head in s[0]] for layer, s in scores.items()}

    plain = recorded(registry.build("proxykv", ctx))
    none, heavy = blend.build(0.0)(ctx), blend.build(1000.0)(ctx)
    assert top(recorded(none)) == top(plain)  # ranks keep each head's order
    extra = blend.surprisal(model, inputs["input_ids"], mask.bool())[0]
    wanted = set(extra.topk(12).indices.tolist())
    assert all(kept == wanted for heads in top(recorded(heavy)).values() for kept in heads)
    assert registry.describe("proxykv_surprisal25").startswith("ProxyKV + 0.25")
