"""Data building and the training loop on tiny random models: build -> train -> save -> load -> generate."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.mapper.hub import load_checkpoint
from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
from proxykv_hf.mapper.proxy import proxy_features
from proxykv_hf.testing import tiny_model, tiny_tokenizer
from proxykv_hf.train import (DataConfig, Manifest, MapperDataset, TrainConfig, build_dataset, crop_starts,
                              mapper_config_for, merge_datasets, split_dataset, texts_from_files, texts_from_hf_dataset,
                              train_mapper)
from proxykv_hf.train.features import check_shared_tokenizer
from proxykv_hf.train.evaluate import read_log

WORDS = "alpha beta gamma delta key value cache token needle haystack the of and river stone".split()


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def texts():
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 45))) for _ in range(6)]


def fake_oracle(model, input_ids, attention_mask=None, tokenizer=None, **kw):
    """Stand-in for KVzip: the target's attention sums, max over each GQA group, per-row max-normalised."""
    x = proxy_features(model, input_ids, attention_mask)  # (B, L, H, T)
    B, L, H, T = x.shape
    h_kv = model.config.num_key_value_heads
    y = x.view(B, L, h_kv, H // h_kv, T).amax(3)  # (B, L, H_kv, T)
    return (y / y.amax(-1, keepdim=True)).permute(1, 0, 2, 3)  # (L, B, H_kv, T)


class CountingOracle:
    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("simulated crash")
        return fake_oracle(*args, **kwargs)


def data_config(**kw) -> DataConfig:
    return DataConfig(**{**dict(crop_len=64, stride=32, shard_size=8, proxy_kind="layers", layer_stride=2), **kw})


def fast_train(**kw) -> TrainConfig:
    return TrainConfig(**{**dict(epochs=2, batch_size=8, warmup_steps=2, lr=1e-3, val_fraction=0.1, log_every=1,
                                 progress=False), **kw})


@pytest.fixture(scope="module")
def self_data(tmp_path_factory, target, tok, texts):
    out = tmp_path_factory.mktemp("self_data")
    build_dataset(texts, target, tok, out, data_config(proxy_kind="self"), oracle=fake_oracle, progress=False)
    return out


# ------------------------------------------------------------------------------------------------ configs, crops
def test_config_validation():
    with pytest.raises(ValueError, match="stride"):
        DataConfig(crop_len=64, stride=65)
    with pytest.raises(ValueError, match="proxy_kind"):
        DataConfig(proxy_kind="bogus")
    with pytest.raises(ValueError, match="65504"):
        DataConfig(max_length=100_000)
    DataConfig(max_length=100_000, dtype="float32")
    assert DataConfig.from_dict(data_config(proxy_layers=[0, 2]).to_dict()) == data_config(proxy_layers=(0, 2))
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainConfig(mixed_precision="fp8")
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    assert TrainConfig.from_dict(fast_train().to_dict()) == fast_train()


@pytest.mark.parametrize("crop_len,stride", [(64, 32), (64, 64), (10, 3)])
def test_crop_starts_cover_every_token(crop_len, stride):
    for n in range(1, 200):
        starts = crop_starts(n, crop_len, stride)
        covered = set()
        for s in starts:
            covered.update(range(s, min(s + crop_len, n)))
        assert covered == set(range(n))
        assert min(starts[-1] + crop_len, n) == n and starts[-1] + min(crop_len, n) == n  # end-aligned
        assert starts == sorted(set(starts)) and starts[0] == 0
        if n <= crop_len:
            assert starts == [0]


def test_shards_cover_texts_and_hold_the_features(tmp_path, target, tok, texts):
    items = [{"text": t, "source": "words"} for t in texts] + [list(range(5, 45))]  # a short token-id text
    m = build_dataset(items, target, tok, tmp_path, data_config(), oracle=fake_oracle, progress=False)
    assert (m.texts, len(m.shards), m.sources) == (7, len(list(tmp_path.glob("shard-*.safetensors"))),
                                                   {"words": 6, "unknown": 1})
    assert json.loads((tmp_path / "manifest.json").read_text())["counts"]["crops"] == m.crops
    assert m.disk_bytes == sum(p.stat().st_size for p in tmp_path.glob("shard-*.safetensors"))
    rows = {}
    for shard in m.shards:
        with safe_open(str(tmp_path / shard["file"]), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        assert t["x"].dtype == torch.float16 and t["x"].shape[1:] == (2, 4, 64) and t["y"].shape[1:] == (4, 2, 64)
        assert torch.equal(t["mask"], torch.arange(64)[None] < t["length"][:, None])
        for i in range(len(t["text"])):
            rows.setdefault(int(t["text"][i]), []).append((int(t["start"][i]), int(t["length"][i]), t["x"][i]))
    lengths = []
    for text_id, crops in sorted(rows.items()):
        n = max(s + length for s, length, _ in crops)
        lengths.append(n)
        assert [s for s, _, _ in crops] == crop_starts(n, 64, 32)
        assert set().union(*(range(s, s + length) for s, length, _ in crops)) == set(range(n))
        if n < 64:
            assert len(crops) == 1 and crops[0][1] == n
    assert sum(lengths) == m.tokens and lengths[-1] == 40  # token ids are used as given
    # crop contents are slices of the whole text's features (computed before cropping)
    ids = tok.apply_chat_template([{"role": "user", "content": texts[0] + "\u2063"}], tokenize=False,
                                  add_generation_prompt=True).split("\u2063")[0]
    ids = torch.tensor([tok(ids, add_special_tokens=False)["input_ids"]])
    assert ids.shape[1] == lengths[0]
    x = proxy_features(target, ids, layers=[1, 3])[0]  # (L_s, H_s, N)
    for s, length, xc in rows[0]:
        torch.testing.assert_close(xc[..., :length].float(), x[..., s:s + length].half().float())
        assert not xc[..., length:].any()


# ------------------------------------------------------------------------------------------------ resume, tokenizer
def test_build_resume_skips_done_texts(tmp_path, target, tok, texts):
    cfg = data_config(shard_size=1)  # a shard (and a manifest write) after every text
    first = CountingOracle()
    build_dataset(texts[:2], target, tok, tmp_path, cfg, oracle=first, progress=False)
    assert first.calls == 2
    crash = CountingOracle(fail_at=3)  # texts 3 and 4 succeed, the 5th crashes
    with pytest.raises(RuntimeError, match="simulated"):
        build_dataset(texts, target, tok, tmp_path, cfg, oracle=crash, progress=False)
    assert Manifest.load(tmp_path).texts == 4
    rest = CountingOracle()
    m = build_dataset(texts + texts[:1], target, tok, tmp_path, cfg, oracle=rest, progress=False)
    assert rest.calls == 2 and m.texts == 6 and len(m.done) == 6
    assert sorted(set(MapperDataset(tmp_path).text_ids)) == list(range(6))
    fresh = CountingOracle()
    m2 = build_dataset(texts, target, tok, tmp_path / "fresh", cfg, oracle=fresh, progress=False)
    assert fresh.calls == 6 and (m2.crops, m2.tokens) == (m.crops, m.tokens)
    with pytest.raises(ValueError, match="crop_len"):
        build_dataset(texts, target, tok, tmp_path, data_config(crop_len=48), oracle=fresh, progress=False)
    again = CountingOracle()
    assert build_dataset(texts[:1], target, tok, tmp_path, cfg, oracle=again, resume=False,
                         progress=False).texts == 1 and again.calls == 1


def test_mismatched_tokenizer_raises(tmp_path, target, tok, texts):
    other = tiny_model("llama", num_hidden_layers=2, vocab_size=200)
    cfg = data_config(proxy_kind="model", proxy_model_id="tiny-proxy-200", target_model_id="tiny-target")
    with pytest.raises(ValueError, match=r"tiny-proxy-200.*tiny-target.*cannot hold.*200 vs 272"):
        build_dataset(texts, target, tok, tmp_path, cfg, proxy=other, oracle=fake_oracle, progress=False)
    wider = tiny_model("llama", num_hidden_layers=2, vocab_size=300)  # a padded table, same tokenizer: fine
    check_shared_tokenizer(target, wider, tok, tiny_tokenizer())
    shared = tiny_model("llama", num_hidden_layers=2, seed=1)
    altered = tiny_tokenizer()
    altered.add_tokens(["alpha"])
    check_shared_tokenizer(target, shared, tok, tiny_tokenizer())
    with pytest.raises(ValueError, match="encode differently"):
        check_shared_tokenizer(target, shared, tok, altered)


# ------------------------------------------------------------------------------------------------ dataset, split
def test_dataset_items_and_deterministic_split(self_data):
    ds = MapperDataset(self_data)
    item = ds[len(ds) - 1]
    assert item["x"].shape == (4, 4, 64) and item["y"].shape == (4, 2, 64) and item["mask"].dtype == torch.bool
    assert item["x"].dtype == torch.float32 and not item["y"][..., ~item["mask"]].any()
    train, val = split_dataset(ds, 0.1, seed=0)
    train2, val2 = split_dataset(MapperDataset(self_data), 0.1, seed=0)
    assert (train.indices, val.indices) == (train2.indices, val2.indices)
    assert val.indices and not set(train.indices) & set(val.indices)
    assert sorted(train.indices + val.indices) == list(range(len(ds)))
    texts = ds.text_ids
    assert not {texts[i] for i in train.indices} & {texts[i] for i in val.indices}  # whole texts per side
    crops = split_dataset(ds, 0.2, seed=3, by_text=False)[1].indices
    assert len(crops) == math.ceil(0.2 * len(ds)) and crops == split_dataset(ds, 0.2, seed=3, by_text=False)[1].indices
    assert crops != split_dataset(ds, 0.2, seed=4, by_text=False)[1].indices
    assert split_dataset(ds, 0.0)[1].indices == []


def test_merge_datasets_built_apart(tmp_path, target, tok, texts):
    cfg = data_config(proxy_kind="self")
    a = build_dataset(texts[:4], target, tok, tmp_path / "a", cfg, oracle=fake_oracle, progress=False)
    b = build_dataset(texts[4:], target, tok, tmp_path / "b", data_config(proxy_kind="self", shard_size=3),
                      oracle=fake_oracle, progress=False)
    whole = build_dataset(texts, target, tok, tmp_path / "whole", cfg, oracle=fake_oracle, progress=False)
    m = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    assert (m.texts, m.crops, m.tokens) == (a.texts + b.texts, a.crops + b.crops, a.tokens + b.tokens)
    assert (m.texts, m.crops, m.tokens, m.sources) == (whole.texts, whole.crops, whole.tokens, whole.sources)
    assert Manifest.load(tmp_path / "ab").done == a.done + b.done
    merged, ref = MapperDataset(tmp_path / "ab"), MapperDataset(tmp_path / "whole")
    assert len(merged) == len(ref) and merged.text_ids == ref.text_ids  # text ids offset past the first source's
    for i in range(len(ref)):
        for name in ("x", "y", "mask"):
            torch.testing.assert_close(merged[i][name], ref[i][name])
    with pytest.raises(ValueError, match="in both"):
        merge_datasets([tmp_path / "a", tmp_path / "whole"], tmp_path / "dup")
    with pytest.raises(ValueError, match="not empty"):
        merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    build_dataset(texts[4:], target, tok, tmp_path / "c", data_config(proxy_kind="self", crop_len=48),
                  oracle=fake_oracle, progress=False)
    with pytest.raises(ValueError, match="crop_len"):
        merge_datasets([tmp_path / "a", tmp_path / "c"], tmp_path / "ac")


# ------------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("kind", ["self", "layers", "model"])
def test_build_train_load_generate(kind, tmp_path, target, tok, texts):
    proxy = tiny_model("llama", num_hidden_layers=2, seed=1) if kind == "model" else None
    cfg = data_config(proxy_kind=kind, proxy_model_id="tiny-proxy" if kind == "model" else None)
    manifest = build_dataset(texts, target, tok, tmp_path / "data", cfg, proxy=proxy, oracle=fake_oracle,
                             progress=False)
    assert manifest.proxy["kind"] == kind and manifest.target["num_layers"] == 4
    mcfg = mapper_config_for(tmp_path / "data", "tiny")
    assert (mcfg.num_proxy_layers, mcfg.num_proxy_heads) == {"self": (4, 4), "layers": (2, 4), "model": (2, 4)}[kind]
    ckpt = train_mapper(tmp_path / "data", tmp_path / "run", mcfg, fast_train(epochs=2))
    assert ckpt.proxy.kind == kind and ckpt.target.num_kv_heads == 2
    assert ckpt.training["texts"] == 6 and ckpt.training["crops"] == manifest.crops
    assert ckpt.training["epochs"] == 2 and ckpt.training["steps"] > 2 and ckpt.training["device"] == "cpu"
    for r in (0.1, 0.3, 0.5):
        assert 0 < ckpt.metrics[f"mass_recovery@{r:g}"] <= 1 and 0 <= ckpt.metrics[f"topk_recall@{r:g}"] <= 1
    assert {"loss", "loss_bin", "loss_mse", "loss_fine", "loss_global", "loss_cos"} <= set(ckpt.metrics)
    assert (tmp_path / "run" / "training.png").stat().st_size > 0
    epochs = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and all("val_mass_recovery@0.1" in r for r in epochs)

    loaded = load_checkpoint(tmp_path / "run")
    for a, b in zip(loaded.mapper.state_dict().values(), ckpt.mapper.state_dict().values()):
        assert torch.equal(a, b)
    assert loaded.global_quantiles.shape[:2] == (4, 2)  # the global budget's table of the training oracle
    cache = ProxyKVCache.from_pretrained(str(tmp_path / "run"), keep_ratio=0.3, proxy=proxy)
    enc = tok([texts[0]], return_tensors="pt")
    n = enc["input_ids"].shape[1]
    out = target.generate(**enc, **with_cache(cache), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, n + 3)
    assert max(cache.physical_lengths()) < n  # the prompt was compacted


# ------------------------------------------------------------------------------------------------ training
def test_training_resume_continues_from_saved_step(self_data, tmp_path):
    mcfg = mapper_config_for(self_data, "tiny")
    cfg = dict(epochs=50, batch_size=4)  # several steps per epoch: the stop falls mid-epoch
    train_mapper(self_data, tmp_path / "a", mcfg, fast_train(max_steps=9, **cfg))
    train_mapper(self_data, tmp_path / "b", mcfg, fast_train(max_steps=5, **cfg))
    assert torch.load(tmp_path / "b" / "last" / "state.pt", weights_only=True)["state"]["step"] == 5
    ckpt = train_mapper(self_data, tmp_path / "b", mcfg, fast_train(max_steps=9, **cfg))
    steps = [r["step"] for r in read_log(tmp_path / "b" / "log.jsonl") if r["kind"] == "step"]
    assert steps == list(range(1, 10))
    assert ckpt.training["steps"] in (5, 9)
    a = load_file(str(tmp_path / "a" / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "last" / "model.safetensors"))
    for k in a:  # same data order, optimizer, scheduler and RNG: the resumed run ends where the straight one does
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="another mapper config"):
        train_mapper(self_data, tmp_path / "b", mapper_config_for(self_data, "tiny", d_time=16),
                     fast_train(max_steps=12, **cfg))


def test_loss_decreases(self_data, tmp_path):
    mcfg = mapper_config_for(self_data, "tiny")
    train_mapper(self_data, tmp_path, mcfg, fast_train(epochs=100, max_steps=30, lr=3e-3, warmup_steps=0))
    losses = [r["loss"] for r in read_log(tmp_path / "log.jsonl") if r["kind"] == "step"]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)


def test_layers_per_step_trains_on_a_random_subset(self_data, tmp_path, monkeypatch):
    mcfg = mapper_config_for(self_data, "tiny")
    seen = []
    original = HybridAxialMapper.forward

    def spy(self, x, attention_mask=None, target_layers=None):
        out = original(self, x, attention_mask, target_layers)
        if self.training:
            seen.append((target_layers, out.shape[1]))
        return out

    monkeypatch.setattr(HybridAxialMapper, "forward", spy)
    ckpt = train_mapper(self_data, tmp_path, mcfg, fast_train(max_steps=6, layers_per_step=2))
    assert len(seen) == 6 and all(len(l) == 2 == n and l == sorted(set(l)) for l, n in seen)
    assert len({tuple(l) for l, _ in seen}) > 1  # drawn anew each step
    assert math.isfinite(ckpt.metrics["loss"])  # validation scores every layer
    with pytest.raises(ValueError, match="layers_per_step"):
        fast_train(layers_per_step=0)


def test_target_layers_train_and_validate_on_those_layers_alone(self_data, tmp_path, monkeypatch):
    """``target_layers``: every training step draws among those layers only, validation scores them alone, and a
    checkpoint of several mappers cannot be the start of a run."""
    from proxykv_hf.mapper.hub import Checkpoint, save_checkpoint

    mcfg = mapper_config_for(self_data, "tiny")
    assert mcfg.num_target_layers >= 3
    seen = []
    original = HybridAxialMapper.forward

    def spy(self, x, attention_mask=None, target_layers=None):
        out = original(self, x, attention_mask, target_layers)
        seen.append((self.training, target_layers, out.shape[1]))
        return out

    monkeypatch.setattr(HybridAxialMapper, "forward", spy)
    ckpt = train_mapper(self_data, tmp_path / "a", mcfg, fast_train(max_steps=6, layers_per_step=1,
                                                                     target_layers=[2, 0]))
    trained = [l for on, l, _ in seen if on]
    assert len(trained) == 6 and all(len(l) == 1 and l[0] in (0, 2) for l in trained)
    assert {l[0] for l in trained} == {0, 2}
    assert all(l == [0, 2] and n == 2 for on, l, n in seen if not on)  # validation: those two layers
    assert ckpt.training["train_config"]["target_layers"] == [0, 2]
    assert math.isfinite(ckpt.metrics["loss"])
    with pytest.raises(ValueError, match="target_layers must be a non-empty list"):
        fast_train(target_layers=[])
    with pytest.raises(ValueError, match=f"the mapper scores {mcfg.num_target_layers} target layers"):
        train_mapper(self_data, tmp_path / "b", mcfg, fast_train(max_steps=1, target_layers=[mcfg.num_target_layers]))
    choice = [0, 1] + [0] * (mcfg.num_target_layers - 2)
    both = save_checkpoint(Checkpoint(mapper=ckpt.mapper, proxy=ckpt.proxy, target=ckpt.target,
                                      extra_mappers=[ckpt.mapper], layer_mappers=choice), tmp_path / "both")
    with pytest.raises(ValueError, match="--init-from takes a checkpoint with one mapper"):
        train_mapper(self_data, tmp_path / "c", mcfg, fast_train(max_steps=1, init_from=str(both)))


def test_init_from_starts_at_a_checkpoints_weights(self_data, tmp_path):
    mcfg = mapper_config_for(self_data, "tiny")
    first = train_mapper(self_data, tmp_path / "a", mcfg, fast_train(max_steps=3))
    again = train_mapper(self_data, tmp_path / "b", mcfg,
                         fast_train(max_steps=1, lr=0.0, init_from=str(tmp_path / "a")))
    for (name, p), q in zip(first.mapper.named_parameters(), again.mapper.parameters()):
        torch.testing.assert_close(p, q, msg=name)  # lr 0: the weights it started from
    fresh = train_mapper(self_data, tmp_path / "c", mcfg, fast_train(max_steps=1, lr=0.0))
    assert not all(torch.equal(p, q) for p, q in zip(first.mapper.parameters(), fresh.mapper.parameters()))
    with pytest.raises(ValueError, match="another mapper config"):
        train_mapper(self_data, tmp_path / "d", mapper_config_for(self_data, "tiny", d_time=16),
                     fast_train(max_steps=1, init_from=str(tmp_path / "a")))
    for wider in (dict(direct_path=True), dict(direct_path=True, direct_context=1)):  # no widening: equal configs
        with pytest.raises(ValueError, match="another mapper config.*direct_path"):
            train_mapper(self_data, tmp_path / "e", mapper_config_for(self_data, "tiny", **wider),
                         fast_train(max_steps=1, init_from=str(tmp_path / "a")))

def test_the_direct_path_trains_at_its_own_learning_rate(self_data, tmp_path):
    """The direct path's parameter group runs at 50 times the learning rate (what the bundled mapper was trained
    with); the rest at the learning rate."""
    from proxykv_hf.train.loop import param_groups

    mapper = HybridAxialMapper(mapper_config_for(self_data, "tiny", direct_path=True))
    groups = param_groups(mapper, fast_train(lr=1e-3))
    assert len(groups) == 2 and groups[1]["lr"] == pytest.approx(0.05)
    assert {id(p) for p in groups[1]["params"]} == {id(mapper.direct.weight), id(mapper.direct.bias)}
    assert len(param_groups(HybridAxialMapper(mapper_config_for(self_data, "tiny")), fast_train())) == 1
    ckpt = train_mapper(self_data, tmp_path / "d", mapper_config_for(self_data, "tiny", direct_path=True),
                        fast_train(max_steps=3))
    assert ckpt.mapper.config.direct_path and ckpt.mapper.direct.weight.abs().sum() > 0
    for removed in ("direct_path_lr_mult", "layer_embedding_lr_mult"):
        with pytest.raises(TypeError, match=removed):
            fast_train(**{removed: 50.0})

# ------------------------------------------------------------------------------------------------ sources, oracle
def test_texts_from_files(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\n\nsecond block\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert [t["text"] for t in texts_from_files(tmp_path)] == ["first doc\n\nsecond block", "from jsonl", "two"]
    split = list(texts_from_files([tmp_path / "a.txt"], split_paragraphs=True))
    assert [t["text"] for t in split] == ["first doc", "second block"] and split[0]["source"] == "a"
    with pytest.raises(ValueError, match="unsupported"):
        list(texts_from_files(tmp_path / "c.csv"))


def test_texts_from_hf_dataset_needs_datasets():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="datasets"):
            next(texts_from_hf_dataset("anything"))
    else:
        pytest.skip("datasets is installed")


def test_texts_from_tasks(tok):
    tasks = pytest.importorskip("proxykv_hf.eval.tasks")
    from proxykv_hf.train import texts_from_tasks

    name = next(iter(tasks.TASKS))
    items = list(texts_from_tasks([name], 2, 300, tok, seed=0))
    sample = tasks.generate(name, 2, 300, tok, 0)[0]
    assert len(items) == 2 and items[0] == {"text": f"{sample.context}\n\n{sample.question}", "source": name}
    with pytest.raises(ValueError, match="unknown task"):
        list(texts_from_tasks(["nope"], 1, 300, tok))


def test_default_oracle_is_kvzip(tmp_path, target, tok, texts):
    pytest.importorskip("proxykv_hf.scorers.kvzip")
    m = build_dataset(texts[:1], target, tok, tmp_path, data_config(oracle_kwargs={"context_chunk": 32}),
                      progress=False)
    assert m.oracle.endswith("kvzip_scores")
    y = MapperDataset(tmp_path)[0]["y"]  # (L_l, H_kv, C)
    assert y.shape == (4, 2, 64) and float(y.max()) <= 1 and torch.all(y[..., :4] == 1)  # KVzip's sinks


def test_hybrid_target_keeps_full_attention_layers(tmp_path, tok, texts):
    """Gemma3 (sliding + full layers): X ("self") and Y cover only the full-attention layers ProxyKV compacts."""
    target = tiny_model("gemma3", num_hidden_layers=6)  # full attention at layers 2 and 5
    m = build_dataset(texts[:3], target, tok, tmp_path / "data", data_config(proxy_kind="self"), oracle=fake_oracle,
                      progress=False)
    assert (m.target["num_layers"], m.proxy["num_layers"]) == (2, 2)
    item = MapperDataset(tmp_path / "data")[0]
    assert item["x"].shape == (2, 4, 64) and item["y"].shape == (2, 2, 64)
    train_mapper(tmp_path / "data", tmp_path / "run", mapper_config_for(tmp_path / "data", "tiny"),
                 fast_train(epochs=1, max_steps=2))
    enc = tok([texts[0]], return_tensors="pt")
    for budget in ("uniform", "global"):  # global: the table's rows are the full-attention layers, in order
        cache = ProxyKVCache.from_pretrained(str(tmp_path / "run"), keep_ratio=0.3, budget=budget)
        out = target.generate(**enc, **with_cache(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert out.shape[1] == enc["input_ids"].shape[1] + 2 and cache.compactable_layers() == [2, 5]


@pytest.mark.slow  # two Python processes under torchrun, each loading torch and transformers
def test_two_processes_share_the_batches(self_data, tmp_path):
    """Data-parallel training (what `accelerate launch` on several GPUs runs), here as two CPU processes over gloo:
    each process takes half of the batches, the checkpoint is written once and says how many processes trained."""
    import subprocess
    import sys

    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           "-m", "proxykv_hf.cli", "train", "--data", str(self_data), "--out", str(out), "--preset", "tiny",
           "--epochs", "2", "--batch-size", "2", "--warmup-steps", "2", "--log-every", "1", "--no-progress",
           "--cpu", "--layers-per-step", "2", "--mapper-config", "direct_path=true"]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_"))}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    ckpt = load_checkpoint(out)
    assert ckpt.training["num_processes"] == 2
    train_crops = ckpt.training["train_crops"]
    per_epoch = math.ceil(math.ceil(train_crops / 2) / 2)  # batches of 2, dealt to 2 processes
    steps = [r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "step"]
    assert steps == list(range(1, 2 * per_epoch + 1))  # logged once (by the main process), not twice
    assert math.isfinite(ckpt.metrics["loss"]) and ckpt.mapper.config.direct_path


def test_training_after_another_accelerator_in_the_same_process(self_data, tmp_path):
    """A notebook that used accelerate with other settings (here bf16 autocast) can still train: the loop starts
    from a fresh single-process state instead of failing on accelerate's "already initialized"."""
    from accelerate import Accelerator

    from proxykv_hf.train.loop import _fresh_accelerator_state

    _fresh_accelerator_state()  # whatever earlier tests left behind
    Accelerator(cpu=True, mixed_precision="bf16")
    ckpt = train_mapper(self_data, tmp_path, mapper_config_for(self_data, "tiny"), fast_train(max_steps=2))
    assert ckpt.training["steps"] == 2


def test_plot_training_without_matplotlib_warns(tmp_path, monkeypatch, caplog):
    import builtins

    from proxykv_hf.train.evaluate import plot_training

    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"kind": "step", "step": 1, "loss": 1.0}) + "\n")
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert plot_training(log, tmp_path / "t.png") is None
    assert "matplotlib is not installed" in caplog.text and not (tmp_path / "t.png").exists()


# ------------------------------------------------------------------------------------------------ max statistic
def test_max_statistic_data_reuses_scores(self_data, tmp_path, target, tok, texts):
    """Features with the max beside the sum: built without another oracle pass, trained on, loaded and used for
    generation; a sum-only mapper cannot start such a run."""
    from proxykv_hf.mapper.hub import Checkpoint
    from proxykv_hf.mapper.proxy import ProxySpec

    cfg = data_config(proxy_kind="self", proxy_statistics=["sum", "max"])
    m = build_dataset(texts, target, tok, tmp_path / "data", cfg, oracle=CountingOracle(fail_at=1),
                      scores_from=self_data, progress=False)  # the oracle would raise at its first call
    old = Manifest.load(self_data)
    assert m.proxy["statistics"] == ["sum", "max"] and m.oracle == old.oracle and m.crops == old.crops
    H = old.proxy["num_heads"]
    with safe_open(str(self_data / old.shards[0]["file"]), "pt") as f:
        x_old, y_old = f.get_tensor("x"), f.get_tensor("y")
    with safe_open(str(tmp_path / "data" / m.shards[0]["file"]), "pt") as f:
        x_new, y_new = f.get_tensor("x"), f.get_tensor("y")
    assert torch.equal(y_new, y_old) and x_new.shape[2] == 2 * H
    torch.testing.assert_close(x_new[:, :, :H], x_old)  # the sums come first
    assert x_new[:, :, H:].max() <= 1 and x_new[:, :, H:].max() > 0.1  # probabilities

    train_mapper(self_data, tmp_path / "a", mapper_config_for(self_data, "tiny", direct_path=True),
                 fast_train(max_steps=1))
    mcfg = mapper_config_for(tmp_path / "data", "tiny", direct_path=True)
    assert mcfg.input_transform == "log1p,log" and mapper_config_for(self_data, "tiny").input_transform == "log1p"
    assert mcfg.num_statistics == 2 and mcfg.num_features == 2 * H
    with pytest.raises(ValueError, match="another mapper config"):  # no widening of a sum-only mapper
        train_mapper(tmp_path / "data", tmp_path / "x", mcfg, fast_train(max_steps=1, init_from=str(tmp_path / "a")))
    wide = train_mapper(tmp_path / "data", tmp_path / "b", mcfg, fast_train(max_steps=2))

    cache = ProxyKVCache.from_pretrained(str(tmp_path / "b"), keep_ratio=0.3)
    enc = tok([texts[0]], return_tensors="pt")
    out = target.generate(**enc, **with_cache(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape[1] == enc["input_ids"].shape[1] + 2 and max(cache.physical_lengths()) < enc["input_ids"].shape[1]
    spec = ProxySpec(kind="self", num_layers=4, num_heads=H)  # sum only: the wide mapper cannot read it
    with pytest.raises(ValueError, match="statistics"):
        Checkpoint(mapper=wide.mapper, proxy=spec, target=wide.target)


def test_training_on_a_subset_of_the_statistics(self_data, tmp_path, target, tok, texts):
    """A sum+max dataset read as sums only (or maxima only) gives exactly those feature rows, and a mapper trained
    on them records the subset as its proxy's statistics."""
    cfg = data_config(proxy_kind="self", proxy_statistics=["sum", "max"])
    build_dataset(texts, target, tok, tmp_path / "data", cfg, oracle=CountingOracle(fail_at=1),
                  scores_from=self_data, progress=False)
    H = Manifest.load(self_data).proxy["num_heads"]
    both = MapperDataset(tmp_path / "data")
    sums, maxima = (MapperDataset(tmp_path / "data", statistics=[s]) for s in ("sum", "max"))
    swapped = MapperDataset(tmp_path / "data", statistics=["max", "sum"])
    for i in (0, len(both) - 1):
        x = both[i]["x"]
        assert x.shape[1] == 2 * H
        assert torch.equal(sums[i]["x"], x[:, :H]) and torch.equal(maxima[i]["x"], x[:, H:])
        assert torch.equal(swapped[i]["x"], torch.cat([x[:, H:], x[:, :H]], 1))
        assert torch.equal(sums[i]["y"], both[i]["y"])
    assert sums.manifest.proxy_spec().statistics == ["sum"] and sums.manifest.config().proxy_statistics == ("sum",)
    assert both.manifest.proxy_spec().statistics == ["sum", "max"]  # the full view is untouched
    for bad in (["mean"], ["sum", "sum"], []):
        with pytest.raises(ValueError, match="statistics"):
            MapperDataset(tmp_path / "data", statistics=bad)
    with pytest.raises(ValueError, match="holds the proxy statistics"):
        MapperDataset(self_data, statistics=["max"])  # a sum-only dataset

    mcfg = mapper_config_for(tmp_path / "data", "tiny", statistics=["sum"])
    assert mcfg.num_statistics == 1 and mcfg.input_transform == "log1p"
    with pytest.raises(ValueError, match="does not match the dataset"):  # a sum+max mapper on the sums only
        train_mapper(tmp_path / "data", tmp_path / "x", mapper_config_for(tmp_path / "data", "tiny"),
                     fast_train(max_steps=1, statistics=("sum",)))
    ckpt = train_mapper(tmp_path / "data", tmp_path / "m", mcfg, fast_train(max_steps=1, statistics=["sum"]))
    assert ckpt.proxy.statistics == ["sum"] and ckpt.mapper.config.num_statistics == 1
    assert ckpt.training["train_config"]["statistics"] == ["sum"]
    assert TrainConfig.from_dict(ckpt.training["train_config"]).statistics == ("sum",)
    with pytest.raises(ValueError, match="statistics"):  # resuming that run on the maxima instead
        train_mapper(tmp_path / "data", tmp_path / "m", mcfg, fast_train(max_steps=2, statistics=["max"]))


def test_training_on_a_subset_of_a_self_proxys_layers(self_data, tmp_path, target, tok, texts):
    """A self proxy's dataset read on layers 0 and 2 of its four gives exactly those feature rows; a mapper trained
    on them, starting from an all-layer mapper's weights, records the layers as its proxy's and compacts a prompt;
    other datasets and layer lists that would read a later layer are refused."""

    full, half = MapperDataset(self_data), MapperDataset(self_data, proxy_layers=[0, 2])
    for i in (0, len(full) - 1):
        assert torch.equal(half[i]["x"], full[i]["x"][[0, 2]]) and torch.equal(half[i]["y"], full[i]["y"])
    assert half.manifest.proxy_spec().layers == [0, 2] and full.manifest.proxy_spec().layers is None
    with pytest.raises(ValueError, match="would read the statistics of a later layer"):
        MapperDataset(self_data, proxy_layers=[1, 3])
    with pytest.raises(ValueError, match="increasing, distinct"):
        MapperDataset(self_data, proxy_layers=[2, 0])
    layers_data = tmp_path / "layers"
    build_dataset(texts[:2], target, tok, layers_data, data_config(), oracle=fake_oracle, progress=False)
    with pytest.raises(ValueError, match="needs a dataset of a 'self' proxy"):
        MapperDataset(layers_data, proxy_layers=[0])

    start = train_mapper(self_data, tmp_path / "all", mapper_config_for(self_data, "tiny", direct_path=True),
                         fast_train(max_steps=1))
    mcfg = mapper_config_for(self_data, "tiny", direct_path=True, proxy_layers=[0, 2])
    assert mcfg.num_proxy_layers == 2 and mcfg.pairing() == [0, 0, 1, 1]
    ckpt = train_mapper(self_data, tmp_path / "half", mcfg,
                        fast_train(max_steps=2, proxy_layers=[0, 2], init_from=str(tmp_path / "all")))
    assert ckpt.proxy.layers == [0, 2] and ckpt.proxy.num_layers == 2
    assert TrainConfig.from_dict(ckpt.training["train_config"]).proxy_layers == (0, 2)
    assert not torch.equal(ckpt.mapper.stem.conv1.weight, start.mapper.stem.conv1.weight)  # it trained on
    with pytest.raises(ValueError, match="proxy layers"):  # resuming that run on other layers
        train_mapper(self_data, tmp_path / "half", mcfg, fast_train(max_steps=3, proxy_layers=[0, 1]))
    cache = ProxyKVCache.from_pretrained(str(tmp_path / "half"), keep_ratio=0.3)
    enc = tok([texts[0]], return_tensors="pt")
    target.generate(**enc, **with_cache(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert max(cache.physical_lengths()) < enc["input_ids"].shape[1]


def test_resume_accepts_a_manifest_written_before_statistics(tmp_path, target, tok, texts):
    cfg = data_config(proxy_kind="self")
    build_dataset(texts[:2], target, tok, tmp_path, cfg, oracle=fake_oracle, progress=False)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    del raw["proxy"]["statistics"], raw["data_config"]["proxy_statistics"]
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    again = CountingOracle()
    m = build_dataset(texts[:3], target, tok, tmp_path, cfg, oracle=again, progress=False)
    assert again.calls == 1 and m.texts == 3
    with pytest.raises(ValueError, match="proxy"):  # other statistics are another dataset
        build_dataset(texts, target, tok, tmp_path, data_config(proxy_kind="self", proxy_statistics=["max"]),
                      oracle=fake_oracle, progress=False)
