"""Mapper checkpoints (:mod:`proxykv_hf.mapper.checkpoint`, :mod:`proxykv_hf.mapper.hub`) and ``save_pretrained`` /
``push_to_hub`` on ProxyScorer and ProxyKVCache: a checkpoint (also one whose layers are scored by several mappers)
saved and loaded keeps the same entries, from a local directory and from an offline HF cache; a config that does not
fit its weights, or holds a key the format does not have, is refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import proxykv_hf.mapper.checkpoint as checkpoint_module
from proxykv_hf import KVzipScorer, ProxyKVCache, ProxyScorer, SnapKVScorer
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.contexts.pipeline import compress_context
from proxykv_hf.mapper.hub import CONFIG_NAME, WEIGHTS_NAME, Checkpoint, TargetSpec, load_checkpoint, save_checkpoint
from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
from proxykv_hf.mapper.proxy import ProxySpec
from proxykv_hf.testing import random_prompt, self_proxy_scorer, tiny_checkpoint, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

TARGET_LAYERS = 4
FLOAT32 = {"mapper_autocast": False}  # compare kept sets with the float32 mapper's own scores, bit for bit


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=TARGET_LAYERS)


def make_checkpoint(tmp_path, kind, name="ckpt"):
    """A random tiny checkpoint for ``target`` (:func:`proxykv_hf.testing.tiny_checkpoint`), saved to
    ``tmp_path / name``: ``(directory, checkpoint)``."""
    ckpt = tiny_checkpoint(kind, num_target_layers=TARGET_LAYERS)
    return save_checkpoint(ckpt, tmp_path / name), ckpt


def trained_scorer(model) -> ProxyScorer:
    """A self-proxy scorer whose mapper's weights differ from the random start's (as a trained one's do)."""
    scorer = self_proxy_scorer(model)
    torch.manual_seed(2)
    for p in scorer.mapper.parameters():
        p.data.normal_(0, 0.2)
    return scorer


def kept(model, scorer, budget: str = "uniform") -> dict:
    """What a cache of ``scorer`` keeps of a fixed left-padded batch, per layer, row and KV head."""
    inputs = random_prompt(2, 70, lengths=[70, 57], seed=4)
    cache = compress_context(model, ProxyKVCache(scorer, 0.3, budget=budget), inputs["input_ids"],
                             inputs["attention_mask"])
    return {i: [[h.tolist() for h in row] for row in rows] for i, rows in cache.kept_sets().items()}


def test_checkpoint_round_trip(tmp_path):
    path, ckpt = make_checkpoint(tmp_path, "layers")
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "model.safetensors", "proxykv_config.json"]
    loaded = load_checkpoint(path)
    for (k, a), (_, b) in zip(ckpt.mapper.state_dict().items(), loaded.mapper.state_dict().items()):
        assert torch.equal(a, b), k
    assert loaded.proxy == ckpt.proxy and loaded.target == ckpt.target
    assert loaded.training == {"texts": 0} and loaded.metrics == {"mass_recovery@0.3": 0.5}
    assert "# ProxyKV mapper for `tiny-llama`" in (path / "README.md").read_text()


def test_a_scorer_saved_and_loaded_keeps_the_same_entries(target, tmp_path):
    tuned = trained_scorer(target)
    assert kept(target, tuned) != kept(target, self_proxy_scorer(target))  # the weights change what is kept
    tuned.save_pretrained(tmp_path / "mapper")
    again = ProxyScorer.from_pretrained(str(tmp_path / "mapper"), **FLOAT32)
    for budget in ("uniform", "global"):
        assert kept(target, again, budget) == kept(target, tuned, budget)
    assert again.settings()["checkpoint"] == tuned.settings()["checkpoint"]


def test_the_cache_forwards_to_its_scorer(target, tmp_path):
    ProxyKVCache(trained_scorer(target), 0.3).save_pretrained(tmp_path / "mapper")
    cache = ProxyKVCache.from_pretrained(str(tmp_path / "mapper"), 0.3, **FLOAT32)
    assert kept(target, cache.scorer) == kept(target, trained_scorer(target))
    for scorer in (SnapKVScorer(), KVzipScorer(tiny_tokenizer())):
        with pytest.raises(ValueError, match=f"{type(scorer).__name__} has no checkpoint to save"):
            ProxyKVCache(scorer, 0.3).save_pretrained(tmp_path / "none")
    with pytest.raises(ValueError, match="has no checkpoint to push"):
        ProxyKVCache(SnapKVScorer(), 0.3).push_to_hub("me/none")


@pytest.mark.parametrize("kind", ["layers", "self"])
def test_checkpoint_of_two_mappers_scores_each_layer_with_its_own(tmp_path, target, kind):
    """A checkpoint whose layers 0 and 2 are scored by another mapper (``layer_mappers``, as the bundled one) keeps,
    in every layer, what the checkpoint of that layer's mapper keeps alone (a background proxy, and the self proxy
    scored layer by layer); it survives a save and load, weights included, and works from memory too; a scorer's
    settings name both mappers' weights."""
    path_a, ckpt = make_checkpoint(tmp_path, kind, "a")
    torch.manual_seed(1)
    other = HybridAxialMapper(ckpt.mapper.config).eval()
    path_b = save_checkpoint(Checkpoint(mapper=other, proxy=ckpt.proxy, target=ckpt.target), tmp_path / "b")
    two = Checkpoint(mapper=ckpt.mapper, proxy=ckpt.proxy, target=ckpt.target, extra_mappers=[other],
                     layer_mappers=[1, 0, 1, 0])
    ProxyScorer(two, **FLOAT32).save_pretrained(tmp_path / "ab")
    both = load_checkpoint(tmp_path / "ab")
    assert both.layer_mappers == [1, 0, 1, 0] and both.mapper_for(0) is both.extra_mappers[0]
    card = (tmp_path / "ab" / "README.md").read_text()
    assert "`layer_mappers`, 0 = the first) | [1, 0, 1, 0]" in card
    assert f"| mapper parameters | {sum(p.numel() for p in both.mapper.parameters()):,} each, 2 mappers |" in card
    for mine, theirs in ((both.mapper, ckpt.mapper), (both.extra_mappers[0], other)):
        for (name, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
            assert torch.equal(a, b), name
    settings = ProxyScorer(both, **FLOAT32).settings()
    assert settings == ProxyScorer(two, **FLOAT32).settings()
    assert settings["checkpoint"]["weights"] != ProxyScorer(ckpt, **FLOAT32).settings()["checkpoint"]["weights"]
    inputs = random_prompt(2, 40, lengths=[40, 31], seed=0)
    kept_by = {}
    for name, source in (("a", path_a), ("b", path_b), ("ab", tmp_path / "ab"), ("memory", two)):
        cache = ProxyKVCache.from_pretrained(source, keep_ratio=0.3, **FLOAT32)
        target.generate(**inputs, **with_cache(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
        kept_by[name] = [cache.layers[i].kept_positions for i in range(TARGET_LAYERS)]
    for layer, source in enumerate("baba"):
        assert torch.equal(kept_by["ab"][layer], kept_by[source][layer]), layer
        assert torch.equal(kept_by["memory"][layer], kept_by[source][layer]), layer
    assert not all(torch.equal(a, b) for a, b in zip(kept_by["a"], kept_by["b"]))  # the mappers keep other tokens
    # every layer from the second mapper: the first stays first, unused
    save_checkpoint(Checkpoint(mapper=ckpt.mapper, proxy=ckpt.proxy, target=ckpt.target, extra_mappers=[other],
                               layer_mappers=[1, 1, 1, 1]), tmp_path / "bb")
    assert load_checkpoint(tmp_path / "bb").layer_mappers == [1, 1, 1, 1]


def test_checkpoint_of_several_mappers_errors(tmp_path):
    _, ckpt = make_checkpoint(tmp_path, "self")
    other = HybridAxialMapper(ckpt.mapper.config).eval()
    args = dict(mapper=ckpt.mapper, proxy=ckpt.proxy, target=ckpt.target)
    with pytest.raises(ValueError, match="extra_mappers need layer_mappers"):
        Checkpoint(**args, extra_mappers=[other])
    with pytest.raises(ValueError, match="layer_mappers must give each of the target's 4 layers"):
        Checkpoint(**args, extra_mappers=[other], layer_mappers=[0, 1, 1])
    with pytest.raises(ValueError, match=r"a mapper index in \[0, 1\]"):
        Checkpoint(**args, extra_mappers=[other], layer_mappers=[0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"extra mappers \[2\] score no layer"):
        Checkpoint(**args, extra_mappers=[other, other], layer_mappers=[0, 1, 1, 0])
    wider = HybridAxialMapper(MapperConfig.from_dict({**ckpt.mapper.config.to_dict(), "d_time": 16}))
    with pytest.raises(ValueError, match="extra mapper 1 has another config"):
        Checkpoint(**args, extra_mappers=[wider], layer_mappers=[0, 1, 1, 0])
    both = Checkpoint(**args, extra_mappers=[other], layer_mappers=[0, 0, 0, 1])
    assert both.mapper_for(3) is other and both.mapper_for(0) is ckpt.mapper
    with pytest.raises(ValueError, match="--init-from takes a checkpoint with one mapper"):
        both.only_mapper("--init-from")


def test_removed_options_are_unknown_fields(tmp_path):
    """A config with an option that was removed (``pool_kernel`` and ``layer_mix`` beside the mapper, its
    ``conv_stem`` switch) is refused like any unknown field, naming the field; nor does the checkpoint or the
    scorer take them."""
    path, ckpt = make_checkpoint(tmp_path, "self")
    config_file = path / CONFIG_NAME
    config = json.loads(config_file.read_text())
    for bad, message in (({**config, "pool_kernel": 1}, r"unknown keys \['pool_kernel'\]"),
                         ({**config, "layer_mix": 0.0}, r"unknown keys \['layer_mix'\]"),
                         ({**config, "mapper": {**config["mapper"], "conv_stem": True}},
                          r"malformed in 'mapper'.*unknown MapperConfig fields: \['conv_stem'\]")):
        config_file.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            load_checkpoint(path)
    with pytest.raises(TypeError):
        Checkpoint(mapper=ckpt.mapper, proxy=ckpt.proxy, target=ckpt.target, pool_kernel=1)
    for name, value in (("pool_kernel", 1), ("layer_mix", 0.0), ("global_norm", "none")):
        with pytest.raises(TypeError, match=name):
            ProxyScorer(ckpt, **{name: value})


@pytest.mark.parametrize("change, message", [
    (lambda c: c["mapper"].update(d_time=1 << 16), "do not fit the mapper config"),
    (lambda c: c.update(layer_mappers="ab"), "layer_mappers must be null or a non-empty list")])
def test_a_config_that_does_not_fit_its_weights_is_refused_before_building(tmp_path, monkeypatch, change, message):
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


def test_loads_from_an_hf_cache_layout_offline(target, tmp_path, monkeypatch):
    """A Hub id resolves from a pre-populated HF cache without the network (``local_files_only``, or
    ``HF_HUB_OFFLINE``), and keeps what the saved scorer keeps."""
    tuned = trained_scorer(target)
    tuned.save_pretrained(tmp_path / "saved")
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny-mapper"
    shutil.copytree(tmp_path / "saved", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    again = ProxyScorer.from_pretrained("org/tiny-mapper", cache_dir=str(tmp_path / "hub"), local_files_only=True,
                                        **FLOAT32)
    assert kept(target, again) == kept(target, tuned)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = ProxyKVCache.from_pretrained("org/tiny-mapper", keep_ratio=0.5, cache_dir=tmp_path / "hub")
    target.generate(**random_prompt(1, 20), **with_cache(cache), max_new_tokens=2, pad_token_id=0)
    assert cache.physical_lengths()[0] == 10 + 1
    with pytest.raises(OSError, match="offline"):
        ProxyKVCache.from_pretrained("org/not-there", cache_dir=tmp_path / "hub")


def test_push_to_hub_uploads_what_save_pretrained_writes(target, monkeypatch):
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
    url = ProxyKVCache(trained_scorer(target), 0.3).push_to_hub("me/tuned", private=True, token="t")
    assert url.endswith("me/tuned/commit/1") and calls["repo"] == ("me/tuned", True) and calls["token"] == "t"
    assert calls["files"] == ["README.md", WEIGHTS_NAME, CONFIG_NAME] and calls["config"]["layer_mappers"] is None


def test_settings_are_json_and_tell_scorers_apart(target):
    scorers = [SnapKVScorer(), SnapKVScorer(window=8), KVzipScorer(tiny_tokenizer(), context_chunk=16),
               self_proxy_scorer(target), self_proxy_scorer(target, n_sink=8), trained_scorer(target)]
    settings = [json.dumps(s.settings(), sort_keys=True) for s in scorers]
    assert len(set(settings)) == len(scorers)
    assert "tokenizer" not in scorers[2].settings() and scorers[1].settings()["window"] == 8
