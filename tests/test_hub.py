"""Mapper checkpoints (:mod:`proxykv_hf.checkpoint`, :mod:`proxykv_hf.hub`): the directory round trip, a checkpoint
whose layers are scored by several mappers, the removed options at their neutral values, and a Hub id resolved from
an offline HF cache."""

import json
import shutil

import pytest
import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.hub import Checkpoint, load_checkpoint, save_checkpoint
from proxykv_hf.mapper import HybridAxialMapper, MapperConfig
from proxykv_hf.testing import random_prompt, tiny_checkpoint, tiny_model

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


def test_checkpoint_round_trip(tmp_path):
    path, ckpt = make_checkpoint(tmp_path, "layers")
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "model.safetensors", "proxykv_config.json"]
    loaded = load_checkpoint(path)
    for (k, a), (_, b) in zip(ckpt.mapper.state_dict().items(), loaded.mapper.state_dict().items()):
        assert torch.equal(a, b), k
    assert loaded.proxy == ckpt.proxy and loaded.target == ckpt.target
    assert "tiny-llama" in (path / "README.md").read_text()
    config = json.loads((path / "proxykv_config.json").read_text())
    assert not {"pool_kernel", "layer_mix"} & set(config) and "conv_stem" not in config["mapper"]


@pytest.mark.parametrize("kind", ["layers", "self"])
def test_checkpoint_of_two_mappers_scores_each_layer_with_its_own(tmp_path, target, kind):
    """A checkpoint whose layers 0 and 2 are scored by another mapper (``layer_mappers``, as the bundled one) keeps,
    in every layer, what the checkpoint of that layer's mapper keeps alone (a background proxy, and the self proxy
    scored layer by layer); it survives a save and load, weights included, and works from memory too."""
    path_a, ckpt = make_checkpoint(tmp_path, kind, "a")
    torch.manual_seed(1)
    other = HybridAxialMapper(ckpt.mapper.config).eval()
    path_b = save_checkpoint(Checkpoint(mapper=other, proxy=ckpt.proxy, target=ckpt.target), tmp_path / "b")
    two = Checkpoint(mapper=ckpt.mapper, proxy=ckpt.proxy, target=ckpt.target, extra_mappers=[other],
                     layer_mappers=[1, 0, 1, 0])
    save_checkpoint(two, tmp_path / "ab")
    both = load_checkpoint(tmp_path / "ab")
    assert both.layer_mappers == [1, 0, 1, 0] and both.mapper_for(0) is both.extra_mappers[0]
    card = (tmp_path / "ab" / "README.md").read_text()
    assert "`layer_mappers`, 0 = the first) | [1, 0, 1, 0]" in card
    assert f"| mapper parameters | {sum(p.numel() for p in both.mapper.parameters()):,} each, 2 mappers |" in card
    for mine, theirs in ((both.mapper, ckpt.mapper), (both.extra_mappers[0], other)):
        for (name, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
            assert torch.equal(a, b), name
    inputs = random_prompt(2, 40, lengths=[40, 31], seed=0)
    kept = {}
    for name, source in (("a", path_a), ("b", path_b), ("ab", tmp_path / "ab"), ("memory", two)):
        cache = ProxyKVCache.from_pretrained(source, keep_ratio=0.3, **FLOAT32)
        target.generate(**inputs, past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
        kept[name] = [cache.layers[i].kept_positions for i in range(TARGET_LAYERS)]
    for layer, source in enumerate("baba"):
        assert torch.equal(kept["ab"][layer], kept[source][layer]), layer
        assert torch.equal(kept["memory"][layer], kept[source][layer]), layer
    assert not all(torch.equal(a, b) for a, b in zip(kept["a"], kept["b"]))  # the two mappers keep other tokens
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


def test_removed_options_load_at_their_neutral_values_only(tmp_path):
    """A checkpoint written while the removed options existed (the bundled one's ``pool_kernel`` 1, ``layer_mix``
    0 and mapper switches) loads; one that asks for what they did when on is refused, naming the field."""
    path, ckpt = make_checkpoint(tmp_path, "self")
    config_file = path / "proxykv_config.json"
    config = json.loads(config_file.read_text())
    old = {**config, "pool_kernel": 1, "layer_mix": 0.0,
           "mapper": {**config["mapper"], "conv_stem": True, "time_encoder": "transformer", "head_stage": True,
                      "layer_embedding": False}}
    config_file.write_text(json.dumps(old))
    loaded = load_checkpoint(path)
    assert loaded.mapper.config == ckpt.mapper.config
    for (k, a), b in zip(ckpt.mapper.state_dict().items(), loaded.mapper.state_dict().values()):
        assert torch.equal(a, b), k
    config_file.write_text(json.dumps({**old, "layer_mix": 0}))  # 0 and 0.0 are the same weight
    load_checkpoint(path)
    refused = [({**old, "pool_kernel": 9}, "pool_kernel"), ({**old, "layer_mix": 1.0}, "layer_mix"),
               *(({**old, "mapper": {**old["mapper"], name: value}}, name)
                 for name, value in (("conv_stem", False), ("time_encoder", "meanpool"), ("head_stage", False),
                                     ("layer_embedding", True)))]
    for bad, name in refused:
        config_file.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"proxykv_config.json is malformed.*'{name}' was removed"):
            load_checkpoint(path)
    with pytest.raises(TypeError):  # no longer settings of the checkpoint or the scorer
        Checkpoint(mapper=ckpt.mapper, proxy=ckpt.proxy, target=ckpt.target, pool_kernel=1)
    from proxykv_hf.scorers.proxy import ProxyScorer

    for name, value in (("pool_kernel", 1), ("layer_mix", 0.0), ("global_norm", "none")):
        with pytest.raises(TypeError, match=name):
            ProxyScorer(ckpt, **{name: value})


def test_offline_hub_cache_layout(tmp_path, target, monkeypatch):
    """A Hub id resolves from a pre-populated HF cache with HF_HUB_OFFLINE=1 (no network)."""
    src, _ = make_checkpoint(tmp_path, "self")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny-mapper"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cache = ProxyKVCache.from_pretrained("org/tiny-mapper", keep_ratio=0.5, cache_dir=tmp_path / "hub")
    target.generate(**random_prompt(1, 20), past_key_values=cache, max_new_tokens=2, pad_token_id=0)
    assert cache.physical_lengths()[0] == 10 + 1
    with pytest.raises(OSError, match="offline"):
        ProxyKVCache.from_pretrained("org/not-there", cache_dir=tmp_path / "hub")
