"""``save_pretrained`` / ``push_to_hub`` on ProxyScorer and ProxyKVCache: a scorer (also one whose layers are scored by
several mappers) is published as a checkpoint that ``from_pretrained`` loads with the same behaviour, from a local
directory and from an HF-cache layout (offline)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from proxykv_hf import KVzipScorer, ProxyKVCache, ProxyScorer, SnapKVScorer
from proxykv_hf.hub import CONFIG_NAME, WEIGHTS_NAME, Checkpoint
from proxykv_hf.pipeline import compress_context
from proxykv_hf.testing import random_prompt, self_proxy_scorer, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def trained_scorer(model) -> ProxyScorer:
    """A self-proxy scorer whose mapper's weights differ from the random start's (as a trained one's do)."""
    scorer = self_proxy_scorer(model)
    torch.manual_seed(2)
    for p in scorer.mapper.parameters():
        p.data.normal_(0, 0.2)
    return scorer


def kept(model, scorer, budget: str = "uniform") -> dict:
    inputs = random_prompt(2, 70, lengths=[70, 57], seed=4)
    cache = compress_context(model, ProxyKVCache(scorer, 0.3, budget=budget), inputs["input_ids"],
                             inputs["attention_mask"])
    return {i: [[h.tolist() for h in row] for row in rows] for i, rows in cache.kept_sets().items()}


def test_a_scorer_saved_and_loaded_keeps_the_same_entries(model, tmp_path):
    tuned = trained_scorer(model)
    assert kept(model, tuned) != kept(model, self_proxy_scorer(model))  # the weights change what is kept
    tuned.save_pretrained(tmp_path / "mapper")
    again = ProxyScorer.from_pretrained(str(tmp_path / "mapper"), mapper_autocast=False)
    for budget in ("uniform", "global"):
        assert kept(model, again, budget) == kept(model, tuned, budget)
    assert again.settings()["checkpoint"] == tuned.settings()["checkpoint"]


def test_the_cache_forwards_to_its_scorer(model, tmp_path):
    ProxyKVCache(trained_scorer(model), 0.3).save_pretrained(tmp_path / "mapper")
    cache = ProxyKVCache.from_pretrained(str(tmp_path / "mapper"), 0.3, mapper_autocast=False)
    assert kept(model, cache.scorer) == kept(model, trained_scorer(model))
    for scorer in (SnapKVScorer(), KVzipScorer(tiny_tokenizer())):
        with pytest.raises(ValueError, match=f"{type(scorer).__name__} has no checkpoint to save"):
            ProxyKVCache(scorer, 0.3).save_pretrained(tmp_path / "none")
    with pytest.raises(ValueError, match="has no checkpoint to push"):
        ProxyKVCache(SnapKVScorer(), 0.3).push_to_hub("me/none")


def test_a_checkpoint_of_two_mappers_round_trips(model, tmp_path):
    base = self_proxy_scorer(model).checkpoint
    other = trained_scorer(model).mapper
    combined = ProxyScorer(Checkpoint(mapper=base.mapper, proxy=base.proxy, target=base.target,
                                      extra_mappers=[other], layer_mappers=[0, 1, 0]), mapper_autocast=False)
    combined.save_pretrained(tmp_path / "combined")
    again = ProxyScorer.from_pretrained(str(tmp_path / "combined"), mapper_autocast=False)
    assert again.checkpoint.layer_mappers == [0, 1, 0]
    assert kept(model, again) == kept(model, combined) != kept(model, ProxyScorer(base, mapper_autocast=False))
    assert again.settings() == combined.settings()
    assert again.settings()["checkpoint"]["weights"] != self_proxy_scorer(model).settings()["checkpoint"]["weights"]


def test_loads_from_an_hf_cache_layout_offline(model, tmp_path):
    tuned = trained_scorer(model)
    tuned.save_pretrained(tmp_path / "saved")
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--me--tiny-mapper"
    shutil.copytree(tmp_path / "saved", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    again = ProxyScorer.from_pretrained("me/tiny-mapper", cache_dir=str(tmp_path / "hub"), local_files_only=True,
                                        mapper_autocast=False)
    assert kept(model, again) == kept(model, tuned)


def test_push_to_hub_uploads_what_save_pretrained_writes(model, monkeypatch):
    import huggingface_hub

    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls["repo"] = (repo_id, private)

        def upload_folder(self, folder_path, repo_id, commit_message):
            calls["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            calls["config"] = json.loads((Path(folder_path) / CONFIG_NAME).read_text())
            return f"https://huggingface.co/{repo_id}/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    url = ProxyKVCache(trained_scorer(model), 0.3).push_to_hub("me/tuned", private=True, token="t")
    assert url.endswith("me/tuned/commit/1") and calls["repo"] == ("me/tuned", True) and calls["token"] == "t"
    assert WEIGHTS_NAME in calls["files"] and calls["config"]["layer_mappers"] is None


def test_settings_are_json_and_tell_scorers_apart(model):
    scorers = [SnapKVScorer(), SnapKVScorer(window=8), KVzipScorer(tiny_tokenizer(), context_chunk=16),
               self_proxy_scorer(model), self_proxy_scorer(model, n_sink=8), trained_scorer(model)]
    settings = [json.dumps(s.settings(), sort_keys=True) for s in scorers]
    assert len(set(settings)) == len(scorers)
    assert "tokenizer" not in scorers[2].settings() and scorers[1].settings()["window"] == 8


@pytest.mark.parametrize("change, message", [
    (lambda c: c["mapper"].update(d_time=1 << 16), "do not fit the mapper config"),
    (lambda c: c.update(layer_mappers="ab"), "layer_mappers must be null or a non-empty list")])
def test_a_config_that_does_not_fit_its_weights_is_refused_before_building(tmp_path, monkeypatch, change, message):
    import proxykv_hf.checkpoint as checkpoint_module
    from proxykv_hf.hub import Checkpoint, TargetSpec, save_checkpoint
    from proxykv_hf.mapper import HybridAxialMapper, MapperConfig
    from proxykv_hf.proxy import ProxySpec

    mapper = HybridAxialMapper(MapperConfig.tiny(num_proxy_layers=3, num_proxy_heads=4, num_target_layers=3,
                                                 num_target_heads=2, num_statistics=1)).eval()
    save_checkpoint(Checkpoint(mapper=mapper, proxy=ProxySpec(kind="self", num_layers=3, num_heads=4,
                                                              statistics=["sum"]),
                               target=TargetSpec(model_id="tiny", model_type="llama", num_layers=3, num_kv_heads=2,
                                                 num_heads=4)), tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    change(config)
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    built = []  # mappers built with weights (the shape check builds one on the meta device: nothing allocated)

    def counted(*a, **k):
        if torch.get_default_device().type != "meta":
            built.append(a)
        return HybridAxialMapper(*a, **k)

    monkeypatch.setattr(checkpoint_module, "HybridAxialMapper", counted)
    with pytest.raises(ValueError, match=message) as info:
        ProxyScorer.from_pretrained(tmp_path)
    assert str(tmp_path / CONFIG_NAME) in str(info.value) and built == []  # refused before any mapper was built
