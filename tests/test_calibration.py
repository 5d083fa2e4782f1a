"""The global budget's quantile table: fitted on oracle scores, stored in checkpoints, read by ProxyScorer under the
global budget; `proxykv calibrate` adds it to a mapper trained without one."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.cache.selection import global_keep
from proxykv_hf.cli import main
from proxykv_hf.cli.helpers import tiny_mapper_checkpoint
from proxykv_hf.mapper.calibration import GRID, calibrate, fit_quantiles, grid, percentiles
from proxykv_hf.mapper.checkpoint import CONFIG_NAME, read_checkpoint, save_checkpoint
from proxykv_hf.mapper.proxy import proxy_features
from proxykv_hf.scorers import ProxyScorer
from proxykv_hf.testing import tiny_model, tiny_tokenizer
from proxykv_hf.train import DataConfig, build_dataset
from proxykv_hf.train.quantiles import calibrated, dataset_quantiles

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=4)


def table_for(ckpt, values: torch.Tensor) -> torch.Tensor:
    """A (L, H, GRID) table whose head rows are ``values`` (H,) plus a rising ramp."""
    L, H = ckpt.target.num_layers, ckpt.target.num_kv_heads
    return (values.view(1, H, 1) + grid().view(1, 1, -1)).expand(L, H, GRID).clone()


def test_grid_runs_from_zero_to_one_densest_at_the_top():
    g = grid()
    assert g[0] == 0 and g[-1] == 1 and bool((g.diff() > 0).all())
    assert g.diff()[-1] < g.diff()[0] / 10


def test_fit_quantiles_is_the_mean_of_each_rows_log_quantiles():
    a = torch.rand(2, 3, 50) + 0.01
    b = torch.rand(2, 3, 80) * 5 + 0.01
    valid_b = torch.ones(80, dtype=torch.bool)
    valid_b[60:] = False  # padding is left out
    table = fit_quantiles([(a, torch.ones(50, dtype=torch.bool)), (b, valid_b)], n=9)
    g = grid(9).double()
    want = (torch.quantile(torch.log(a.double() + 1e-8), g, dim=-1)
            + torch.quantile(torch.log(b[..., :60].double() + 1e-8), g, dim=-1)) / 2
    assert table.shape == (2, 3, 9)
    torch.testing.assert_close(table, want.permute(1, 2, 0).float())
    with pytest.raises(ValueError, match="no oracle rows"):
        fit_quantiles([])


def test_percentiles_rank_within_each_rows_real_tokens():
    scores = torch.tensor([[[3.0, 1.0, 2.0, 9.0], [0.0, 5.0, 4.0, 7.0]]])
    valid = torch.tensor([[True, True, True, False]])
    p = percentiles(scores, valid)
    assert p.tolist() == [[[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 0.5, 0.0]]]


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 60), st.integers(0, 10_000))
def test_calibrate_keeps_each_rows_order_and_reads_the_table_at_its_ends(n, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, 2, n, generator=gen)
    table = fit_quantiles([(torch.rand(2, 2, 40, generator=gen), torch.ones(40, dtype=torch.bool))])[0]
    valid = torch.ones(1, n, dtype=torch.bool)
    out = calibrate(scores, valid, table)
    for h in range(2):
        order = scores[0, h].argsort()
        assert bool((out[0, h, order].diff() >= -1e-6).all())  # the row's order is kept
        torch.testing.assert_close(out[0, h].max(), table[h, -1])
        torch.testing.assert_close(out[0, h].min(), table[h, 0])


def test_the_table_decides_each_heads_share_of_a_global_budget():
    ckpt = tiny_mapper_checkpoint(tiny_model("llama", num_hidden_layers=4))
    L, H, T = ckpt.target.num_layers, ckpt.target.num_kv_heads, 200
    gen = torch.Generator().manual_seed(0)
    scores = {i: torch.randn(1, H, T, generator=gen) * (10 if i == 0 else 1) for i in range(L)}  # layer 0: loud
    valid = torch.ones(1, T, dtype=torch.bool)

    class Scorer:  # global_keep asks the scorer for comparable scores
        def __init__(self, c):
            self.global_scores = c.global_scores

    raw = global_keep(Scorer(ckpt), scores, valid, 0.2, 0, 0)
    assert raw[0].sum() > raw[1].sum()  # dicts by layer; without a table the logits' scale decides
    favour = torch.zeros(H)
    favour[1] = 5.0  # head 1 of every layer: high oracle scores at every percentile
    ckpt_t = replace(ckpt, global_quantiles=table_for(ckpt, favour))
    kept = global_keep(Scorer(ckpt_t), scores, valid, 0.2, 0, 0)
    per_head = torch.stack([kept[i][0].sum(-1) for i in range(L)])  # (L, H)
    assert bool((per_head[:, 1] > per_head[:, 0]).all())
    assert len({int(n) for n in per_head[:, 1]}) == 1  # every layer alike: the loud logits of layer 0 no longer count


def test_checkpoint_round_trip_and_malformed_tables(tmp_path):
    ckpt = tiny_mapper_checkpoint(tiny_model("llama", num_hidden_layers=4))
    table = table_for(ckpt, torch.tensor([0.0, -2.0])) - 3.123456789
    save_checkpoint(replace(ckpt, global_quantiles=table), tmp_path / "a")
    back = read_checkpoint(tmp_path / "a")
    torch.testing.assert_close(back.global_quantiles, table, atol=1e-4, rtol=0)
    assert "quantile table" in (tmp_path / "a" / "README.md").read_text()
    save_checkpoint(ckpt, tmp_path / "none")
    assert read_checkpoint(tmp_path / "none").global_quantiles is None
    assert "global_quantiles" not in json.loads((tmp_path / "none" / CONFIG_NAME).read_text())

    config = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())
    good = config["global_quantiles"]
    for bad, match in ((good[:2], "shape"), ([[row[::-1] for row in layer] for layer in good], "nondecreasing"),
                       ([[["x"] * 3] * 2] * 4, "table of numbers")):
        (tmp_path / "a" / CONFIG_NAME).write_text(json.dumps({**config, "global_quantiles": bad}))
        with pytest.raises(ValueError, match=f"{CONFIG_NAME} is malformed.*{match}"):
            read_checkpoint(tmp_path / "a")


def test_the_table_changes_the_global_budgets_kept_set_and_the_settings_only(target):
    ckpt = tiny_mapper_checkpoint(target)
    tok = tiny_tokenizer()
    ids = tok(["alpha beta gamma delta " * 12], return_tensors="pt")["input_ids"]
    favour = torch.tensor([6.0, 0.0])
    with_table = replace(ckpt, global_quantiles=table_for(ckpt, favour))
    kept = {}
    for name, c in (("raw", ckpt), ("table", with_table)):
        for budget in ("uniform", "global"):
            cache = ProxyKVCache(ProxyScorer(c), keep_ratio=0.3, budget=budget)
            with torch.no_grad():
                target(input_ids=ids, **with_cache(cache), use_cache=True)
            kept[name, budget] = [[s.tolist() for s in layer.kept_sets()[0]] for layer in cache.layers]
            kept[name, budget, "settings"] = json.dumps(cache.scorer.settings(), sort_keys=True, default=str)
    assert kept["raw", "uniform"] == kept["table", "uniform"]
    assert kept["raw", "global", "settings"] != kept["table", "global", "settings"]  # a saved context's key
    # head 0 of every layer is favoured: under the global budget it keeps more than head 1
    for heads in kept["table", "global"]:
        assert len(heads[0]) > len(heads[1])


def test_the_default_budget_is_global_where_scores_compare_across_heads(target, tmp_path, capsys):
    """Unless told otherwise a cache ranks KVzip's scores and a tabled mapper's globally, as chosen on dev; other
    scorers, a mapper without a table and the full cache keep the uniform budget; an explicit budget wins, and
    `proxykv compress` reports the budget it used."""
    from proxykv_hf import KVzipScorer, SnapKVScorer

    ckpt = tiny_mapper_checkpoint(target)
    tabled = replace(ckpt, global_quantiles=table_for(ckpt, torch.tensor([6.0, 0.0])))
    assert ProxyKVCache(KVzipScorer(tiny_tokenizer()), 0.3).budget == "global"
    assert ProxyKVCache(ProxyScorer(tabled), 0.3).budget == "global"
    assert ProxyKVCache.from_pretrained(tabled, 0.3).fresh().budget == "global"
    assert ProxyKVCache(ProxyScorer(ckpt), 0.3).budget == "uniform"
    assert ProxyKVCache(SnapKVScorer(), 0.3).budget == ProxyKVCache().budget == "uniform"
    assert ProxyKVCache(KVzipScorer(tiny_tokenizer()), 0.3, budget="uniform").budget == "uniform"
    assert ProxyKVCache.from_pretrained(tabled, 0.3, budget="uniform").budget == "uniform"
    with pytest.raises(ValueError, match="scorer must subclass"):
        ProxyKVCache("kvzip", 0.3)
    for method, budget in (("kvzip", "global"), ("snapkv", "uniform")):
        assert main(["compress", "--tiny", "--method", method, "--keep-ratio", "0.5", "--prompt", "one two three " * 9,
                     "--out", str(tmp_path / method)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["budget"] == budget


def fake_oracle(model, input_ids, attention_mask=None, tokenizer=None, **kw):
    """Stand-in for KVzip: the target's attention sums, max over each GQA group (L, B, H_kv, T)."""
    x = proxy_features(model, input_ids, attention_mask)
    B, L, H, T = x.shape
    h_kv = model.config.num_key_value_heads
    return x.view(B, L, h_kv, H // h_kv, T).amax(3).permute(1, 0, 2, 3)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, target):
    rng = random.Random(0)
    words = "alpha beta gamma delta key value cache token needle haystack".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 40))) for _ in range(4)]
    out = tmp_path_factory.mktemp("data")
    cfg = DataConfig(crop_len=64, stride=32, shard_size=8, proxy_kind="layers", layer_stride=2)
    build_dataset(texts, target, tiny_tokenizer(), out, cfg, oracle=fake_oracle, progress=False)
    return out


def test_proxykv_calibrate_writes_a_new_checkpoint_and_leaves_the_mapper_alone(tiny_data, target, tmp_path, capsys):
    ckpt = tiny_mapper_checkpoint(target)
    save_checkpoint(ckpt, tmp_path / "mapper")
    before = {p.name: p.read_bytes() for p in (tmp_path / "mapper").iterdir()}
    assert main(["calibrate", "--mapper", str(tmp_path / "mapper"), "--data", str(tiny_data),
                 "--out", str(tmp_path / "cal")]) == 0
    assert "quantile table" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in (tmp_path / "mapper").iterdir()} == before
    got = read_checkpoint(tmp_path / "cal")
    torch.testing.assert_close(got.global_quantiles, dataset_quantiles(tiny_data), atol=1e-4, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal", "mapper"]  # no temporary directory left
    # --out holding anything is refused before any work, its files untouched
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as err:
        main(["calibrate", "--mapper", str(tmp_path / "mapper"), "--data", str(tiny_data),
              "--out", str(tmp_path / "busy")])
    assert err.value.code == 2 and (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_calibrating_on_another_targets_oracle_is_refused(tiny_data):
    other = tiny_mapper_checkpoint(tiny_model("llama", num_hidden_layers=2))
    with pytest.raises(ValueError, match="calibrate on a dataset built for the mapper's target"):
        calibrated(other, tiny_data)
