"""scripts/mapper_candidates.py, the plug-in that evaluates several mapper checkpoints in one run: each registered
method scores as ``proxykv`` with that checkpoint does, and bad candidate lists are refused."""

from __future__ import annotations

import pytest
import torch

from proxykv_hf.eval.methods import record_scores
from proxykv_hf.scorers import ScorerContext, registry
from proxykv_hf.testing import random_prompt, tiny_model
from conftest import load_scorer_plugin
from test_contexts import self_proxy_scorer


def test_each_candidate_scores_as_proxykv_with_its_mapper(tmp_path, monkeypatch):
    model = tiny_model("llama", num_hidden_layers=4)
    self_proxy_scorer(model).save_pretrained(tmp_path / "m1")
    other = self_proxy_scorer(model)
    with torch.no_grad():
        for p in other.checkpoint.mapper.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    other.save_pretrained(tmp_path / "m2")
    monkeypatch.setenv("PROXYKV_CANDIDATES", f"one={tmp_path / 'm1'}, two={tmp_path / 'm2'}")
    plugin = load_scorer_plugin("mapper_candidates")
    next(plugin)
    try:
        assert {"proxykv_one", "proxykv_two"} <= set(registry.names())
        inputs = random_prompt(1, 48, seed=5)

        def recorded(name, mapper):
            scorer = registry.build(name, ScorerContext(model=model, mapper=mapper))
            return record_scores(model, scorer, inputs["input_ids"], inputs["attention_mask"]).scores

        one, two = recorded("proxykv_one", None), recorded("proxykv_two", None)
        want_one = recorded("proxykv", str(tmp_path / "m1"))
        want_two = recorded("proxykv", str(tmp_path / "m2"))
        for layer in want_one:
            assert torch.equal(one[layer], want_one[layer]) and torch.equal(two[layer], want_two[layer])
        assert any(not torch.equal(one[layer], two[layer]) for layer in one)  # the two mappers differ
    finally:
        plugin.close()
    assert "proxykv_one" not in registry.names()


@pytest.mark.parametrize("text", ["a", "a=", "=dir", "1a=dir", "a=x,a=y"])
def test_a_bad_candidate_list_is_refused(text, monkeypatch):
    monkeypatch.setenv("PROXYKV_CANDIDATES", "")
    plugin = load_scorer_plugin("mapper_candidates")
    module = next(plugin)
    try:
        with pytest.raises(ValueError, match="PROXYKV_CANDIDATES"):
            module.parse(text)
    finally:
        plugin.close()
