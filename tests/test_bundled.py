"""The mapper checkpoints shipped in the package match their targets: the bundled SmolLM2-135M-Instruct (a self
proxy) and Qwen2.5-Coder-1.5B-Instruct (its 0.5B sibling as the proxy, or its own attention); their configs hold
only what ``save_checkpoint`` and ``train`` write today."""

import dataclasses
import hashlib
import json

import pytest
import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.mapper.hub import BUNDLED_DIR, BUNDLED_MAPPER, BUNDLED_MAPPERS, CONFIG_NAME, load_checkpoint
from proxykv_hf.mapper.model import MapperConfig
from proxykv_hf.testing import pair_installed, tiny_model

PAIR_MAPPER = "proxykv-qwen2.5-coder-1.5b-instruct"
SELF_MAPPER = "proxykv-qwen2.5-coder-1.5b-instruct-self"
BUNDLED = (BUNDLED_MAPPER, PAIR_MAPPER, SELF_MAPPER)
CONFIG_KEYS = {"format_version", "mapper", "proxy", "target", "pairing", "layer_mappers", "training", "metrics"}
TRAINING_KEYS = {"texts", "crops", "tokens", "tasks", "crop_len", "stride", "oracle", "train_crops", "val_crops",
                 "data_dir", "train_config", "device", "num_processes", "steps", "epochs", "wall_time_s",
                 "best_epoch", "best_step", "selected_by"}
"""What ``train`` writes under ``"training"`` (``train/loop.py``, ``Manifest.summary``)."""


def test_shipped_checkpoint_matches_smollm2_shape():
    """The bundled SmolLM2 checkpoint as it loads, pinned: its mapper config, specs, the metrics its card and
    docs/training.md quote, and which tokens its two mappers rank first on fixed features (pinned before its config
    lost the removed options and the training lineage, so that rewriting it changed nothing it does)."""
    path = BUNDLED_DIR / BUNDLED_MAPPER
    assert path.is_dir(), f"the bundled mapper is missing from {path}"
    ckpt = load_checkpoint(BUNDLED_MAPPER)  # resolves by name, offline
    assert ckpt.mapper.config.to_dict() == dict(
        num_proxy_layers=30, num_proxy_heads=9, num_target_layers=30, num_target_heads=3, d_time=128, stem_hidden=64,
        num_encoder_layers=2, num_encoder_heads=4, ffn_mult=2, d_head=16, crop_len=512, stride=512, dropout=0.0,
        input_transform="log1p,log,log", direct_path=True, direct_context=4, num_statistics=3)
    assert ckpt.proxy.to_dict() == dict(kind="self", model_id=None, num_layers=30, num_heads=9, layers=None,
                                        statistics=["sum", "max", "lookback"])  # docs/training.md
    assert ckpt.target.to_dict() == dict(model_id="smollm2-135m-instruct", model_type="llama", num_layers=30,
                                         num_kv_heads=3, num_heads=9)
    assert ckpt.layer_mappers == [int(5 <= layer <= 9) for layer in range(30)]
    assert ckpt.training["texts"] == 105 and ckpt.training["crops"] == 200  # docs/training.md
    assert {k: v for k, v in ckpt.metrics.items() if "@" in k or k == "loss"} == {
        "loss": 9.017765235900878, "topk_recall@0.1": 0.5750948418511285, "topk_recall@0.3": 0.6950081464979384,
        "topk_recall@0.5": 0.7796766493055556, "mass_recovery@0.1": 0.6259424336751302,
        "mass_recovery@0.3": 0.8036318630642361, "mass_recovery@0.5": 0.8973534478081597}
    x = torch.rand(1, 30, 27, 64, generator=torch.Generator().manual_seed(2)) * 3  # (B, L_s, 3 * H_s, N)
    with torch.no_grad():
        logits = ckpt.map_features(x)  # (B, L_l, H_l, N), float32
    kept = logits.topk(20, dim=-1).indices.sort(-1).values.tolist()  # the top 30% of each (layer, KV head)
    assert hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16] == "f78964e965dd758b"
    assert logits.double().sum().item() == pytest.approx(-19878.239625692368, rel=1e-5)


CALIBRATED = {PAIR_MAPPER, SELF_MAPPER}  # the bundled checkpoints holding the global budget's quantile table


@pytest.mark.parametrize("name", sorted(CALIBRATED))
def test_the_qwen_mappers_quantile_table_is_the_oracles_shape(name):
    """Per target layer and KV head, 65 nondecreasing log-scores; the top of a row (the attention sinks and needles
    KVzip keeps) near log 1, the bottom far below."""
    table = load_checkpoint(name).global_quantiles
    assert table.shape == (28, 2, 65) and bool((table.diff(dim=-1) >= 0).all())
    assert bool((table[..., -1] > -3).all()) and bool((table[..., 0] < table[..., -1] - 2).all())


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_configs_hold_current_fields_only(name):
    """No removed option (``pool_kernel``, ``layer_mix``, the mapper's old switches, the listwise loss term) and no
    record beyond what ``train`` writes: every field loads into today's dataclasses."""
    from proxykv_hf.train.config import TrainConfig

    config = json.loads((BUNDLED_DIR / name / CONFIG_NAME).read_text())
    assert set(config) == CONFIG_KEYS | ({"global_quantiles"} if name in CALIBRATED else set())
    assert set(config["mapper"]) == {f.name for f in dataclasses.fields(MapperConfig)}
    assert TRAINING_KEYS <= set(config["training"]) <= TRAINING_KEYS | {"splits"}  # the SmolLM2 data's split
    TrainConfig.from_dict(config["training"]["train_config"])  # an unknown field raises, in its loss too
    assert not {"loss_list"} & set(config["metrics"])
    load_checkpoint(name)


@pytest.mark.smollm
@pytest.mark.slow
def test_shipped_checkpoint_runs_on_smollm2(smollm):
    model, tok = smollm
    cache = ProxyKVCache.from_pretrained(BUNDLED_MAPPER, keep_ratio=0.3)
    cache.scorer.checkpoint.check_target(model.config)
    inputs = tok(["The code word is azure. " * 20], return_tensors="pt")
    model.generate(**inputs, **with_cache(cache), max_new_tokens=2, do_sample=False)
    n = inputs["input_ids"].shape[1]
    assert cache.physical_lengths()[0] == -(-3 * n // 10) + 1


def test_shipped_pair_checkpoint_matches_the_qwen_pair():
    assert BUNDLED_MAPPERS["qwen2.5-coder-1.5b-instruct"] == PAIR_MAPPER and (BUNDLED_DIR / PAIR_MAPPER).is_dir()
    ckpt = load_checkpoint(PAIR_MAPPER)  # by name, offline
    assert ckpt.target.model_id == "qwen2.5-coder-1.5b-instruct"
    assert (ckpt.target.num_layers, ckpt.target.num_kv_heads, ckpt.target.num_heads) == (28, 2, 12)
    assert ckpt.proxy.kind == "model" and ckpt.proxy.model_id == "qwen2.5-coder-0.5b-instruct"
    assert (ckpt.proxy.num_layers, ckpt.proxy.num_heads) == (24, 14)
    cfg = ckpt.mapper.config
    assert (cfg.num_proxy_layers, cfg.num_proxy_heads, cfg.num_target_layers, cfg.num_target_heads) == (24, 14, 28, 2)
    assert cfg.num_statistics == len(ckpt.proxy.statistics)
    # the paper's depth-proportional pairing: target layer l (1-based) reads proxy layer ceil(l * 24 / 28)
    assert ckpt.mapper.pairing() == [-(-(l + 1) * 24 // 28) - 1 for l in range(28)]
    assert ckpt.metrics["topk_recall@0.3"] > 0.3, "the checkpoint records its validation metrics"
    card = _card(PAIR_MAPPER)
    assert "| proxy | model: `qwen2.5-coder-0.5b-instruct` (24 layers, 14 heads)" in card
    assert _recall_row(ckpt) in card  # the validation figures the checkpoint itself records
    dev = _dev_means("dev_2k_qwen_pair.jsonl.gz")
    assert f"| {dev['proxykv']} against KVzip's {dev['kvzip']} (" in card  # the dev figures its records give


def test_shipped_self_checkpoint_reads_the_qwen_targets_own_attention():
    assert BUNDLED_MAPPERS["qwen2.5-coder-1.5b-instruct"] == PAIR_MAPPER, "the pair mapper stays the default"
    ckpt = load_checkpoint(SELF_MAPPER)  # by name, offline
    assert ckpt.target.model_id == "qwen2.5-coder-1.5b-instruct"
    assert (ckpt.target.num_layers, ckpt.target.num_kv_heads, ckpt.target.num_heads) == (28, 2, 12)
    assert ckpt.proxy.kind == "self" and ckpt.proxy.model_id is None and ckpt.proxy.layers is None
    assert (ckpt.proxy.num_layers, ckpt.proxy.num_heads) == (28, 12)
    assert ckpt.proxy.statistics == ["sum", "max", "lookback"]
    cfg = ckpt.mapper.config
    assert (cfg.num_proxy_layers, cfg.num_proxy_heads, cfg.num_target_layers, cfg.num_target_heads) == (28, 12, 28, 2)
    assert ckpt.mapper.pairing() == list(range(28))  # each layer reads its own attention
    assert ckpt.metrics["topk_recall@0.3"] > 0.3, "the checkpoint records its validation metrics"
    card = _card(SELF_MAPPER)
    assert "| proxy | self: the target's own attention" in card and _recall_row(ckpt) in card
    own, pair = _dev_means("dev_2k_qwen_self.jsonl.gz"), _dev_means("dev_2k_qwen_pair.jsonl.gz")
    assert f"| {own['proxykv']} against KVzip's {pair['kvzip']} (" in card  # its dev records, KVzip's of the pair run


def _card(name: str) -> str:
    """A bundled checkpoint's model card, its whitespace normalised (a rewrapped line changes no figure)."""
    return " ".join((BUNDLED_DIR / name / "README.md").read_text().split())


def _recall_row(ckpt) -> str:
    """The card's validation figures as the checkpoint's own metrics give them."""
    return "top-K recall " + " / ".join(f"{ckpt.metrics[f'topk_recall@{r}']:.3f}" for r in (0.1, 0.3, 0.5))


def _dev_means(records: str) -> dict[str, str]:
    """Each method's mean accuracy % over the keep ratios in ``docs/data/<records>``, as the docs print it."""
    from pathlib import Path

    from proxykv_hf.eval.report import bootstrap, read_records

    means = bootstrap(read_records(Path(__file__).parents[1] / "docs" / "data" / records), n_boot=2)
    return {m: f"{100 * v[0]:.1f}" for m, v in means["mean_over_ratios"].items()}


def test_a_proxy_handed_to_the_self_mapper_is_refused():
    """The self mapper reads the target's own attention: a proxy given to it would be ignored (and kept alive)."""
    with pytest.raises(ValueError, match="proxy= was given.*own attention.*leave proxy= out"):
        ProxyKVCache.from_pretrained(SELF_MAPPER, 0.3, proxy=tiny_model("llama", num_hidden_layers=2))


@pytest.mark.pair
@pytest.mark.slow
@pytest.mark.skipif(not pair_installed(), reason="the Qwen pair's parts are not installed: proxykv install-models")
def test_shipped_qwen_mappers_run_in_generate_offline(monkeypatch):
    """By the bundled name, offline: the pair mapper loads the 0.5B proxy by itself (or takes one already loaded), the
    self mapper runs no second model; each compresses the 1.5B's prompt in ``generate``."""
    from proxykv_hf.models.loading import load_model, load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = load_model_and_tokenizer("qwen2.5-coder-1.5b-instruct")
    inputs = tok(["The code word is azure. " * 20], return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    pair = ProxyKVCache.from_pretrained(PAIR_MAPPER, keep_ratio=0.3)
    assert pair.scorer.proxy_model.config.num_hidden_layers == 24
    own = ProxyKVCache.from_pretrained(SELF_MAPPER, keep_ratio=0.3)
    assert own.scorer.proxy_model is None  # the target's own attention
    for cache in (pair, own):
        assert cache.budget == "global"  # the default of a mapper with a quantile table
        out = model.generate(**inputs, **with_cache(cache), max_new_tokens=2, do_sample=False)
        assert out.shape[1] == n + 2
        k, heads = -(-3 * n // 10), len(cache.layers) * model.config.num_key_value_heads
        assert sum(cache.physical_lengths()) == heads * (k + 1)  # packed: every layer's heads, K each in all
    proxy = load_model("qwen2.5-coder-0.5b-instruct")
    again = ProxyKVCache.from_pretrained(PAIR_MAPPER, keep_ratio=0.3, proxy=proxy)
    assert again.scorer.proxy_model is proxy
