"""The agreement arithmetic of scripts/kvpress_compare.py on hand-made kept sets (no kvpress, no model)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[1] / "scripts" / "kvpress_compare.py"


@pytest.fixture(scope="module")
def kc():
    spec = importlib.util.spec_from_file_location("kvpress_compare", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_jaccard(kc):
    assert kc.jaccard([0, 1, 2], [1, 2, 3]) == pytest.approx(2 / 4)
    assert kc.jaccard([5], [5]) == 1.0
    assert kc.jaccard([0], [1]) == 0.0
    assert kc.jaccard([], []) == 1.0
    assert kc.jaccard([1, 1, 2], [2]) == pytest.approx(1 / 2)  # duplicates count once


def test_chance_jaccard(kc):
    # sizes 5 and 5 of 10: E|A & B| = 2.5, union 7.5
    assert kc.chance_jaccard(5, 5, 10) == pytest.approx(2.5 / 7.5)
    assert kc.chance_jaccard(10, 10, 10) == 1.0  # both keep everything
    assert kc.chance_jaccard(0, 4, 10) == 0.0
    assert kc.chance_jaccard(0, 0, 10) == 1.0
    with pytest.raises(ValueError, match="set sizes"):
        kc.chance_jaccard(11, 1, 10)


def test_pearson(kc):
    assert kc.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert kc.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert kc.pearson([1, 2, 3], [5, 5, 5]) is None  # a uniform budget: constant counts
    assert kc.pearson([1], [1]) is None
    with pytest.raises(ValueError, match="same length"):
        kc.pearson([1, 2], [1, 2, 3])


def test_agreement_identical_sets(kc):
    kept = [[[0, 1, 4], [0, 2]], [[0, 1, 2, 3, 4, 5], [0]]]  # 2 layers x 2 KV heads, T = 8
    out = kc.agreement(kept, kept, context_length=8, prefix_length=2)
    assert out["jaccard"] == out["jaccard_body"] == out["pooled"] == 1.0
    assert out["count_r"] == pytest.approx(1.0) and out["layer_r"] == pytest.approx(1.0)
    assert out["kept_ours"] == out["kept_theirs"] == 12
    assert out["count_mad"] == 0.0


def test_agreement_hand_computed(kc):
    T = 10
    ours = [[[0, 1, 2, 3], [0, 5]],            # layer 0
            [[0, 1], [0, 6, 7, 8]]]            # layer 1
    theirs = [[[0, 1, 2, 9], [0, 5, 6]],
              [[0, 1, 2, 3, 4], [0]]]
    out = kc.agreement(ours, theirs, context_length=T, prefix_length=1)
    per_head = [3 / 5, 2 / 3, 2 / 5, 1 / 4]
    assert out["jaccard"] == pytest.approx(sum(per_head) / 4)
    # without position 0 (the prefix): {1,2,3}/{1,2,9}: 2/4; {5}/{5,6}: 1/2; {1}/{1,2,3,4}: 1/4; {6,7,8}/{}: 0
    assert out["jaccard_body"] == pytest.approx((2 / 4 + 1 / 2 + 1 / 4 + 0) / 4)
    assert out["pooled"] == pytest.approx((3 + 2 + 2 + 1) / (5 + 3 + 5 + 4))
    chance = [kc.chance_jaccard(a, b, T) for a, b in ((4, 4), (2, 3), (2, 5), (4, 1))]
    assert out["chance"] == pytest.approx(sum(chance) / 4)
    assert out["count_r"] == pytest.approx(kc.pearson([4, 2, 2, 4], [4, 3, 5, 1]))
    assert out["layer_r"] is None  # our per-layer totals are constant (6, 6)
    assert out["kept_ours"] == 12 and out["kept_theirs"] == 13
    assert out["count_mad"] == pytest.approx((0 + 1 + 3 + 3) / 4 / T)


def test_agreement_disjoint_and_layout_errors(kc):
    out = kc.agreement([[[0, 1]]], [[[2, 3]]], context_length=4)
    assert out["jaccard"] == out["pooled"] == 0.0
    assert out["chance"] == pytest.approx(kc.chance_jaccard(2, 2, 4))
    with pytest.raises(ValueError, match="layouts differ"):
        kc.agreement([[[0], [1]]], [[[0]]], context_length=4)
    with pytest.raises(ValueError, match="kept positions"):
        kc.agreement([[[0, 4]]], [[[0]]], context_length=4)
    with pytest.raises(ValueError, match="prefix_length"):
        kc.agreement([[[0]]], [[[0]]], context_length=4, prefix_length=5)


def test_summarize_and_table(kc):
    records = [
        {"keep_ratio": 0.3, "jaccard": 0.5, "jaccard_body": 0.4, "pooled": 0.6, "chance": 0.2, "count_r": None,
         "layer_r": 0.5, "count_mad": 0.1, "acc_ours": 1.0, "acc_kvpress": 0.0, "s_ours": 2.0, "s_kvpress": 4.0},
        {"keep_ratio": 0.3, "jaccard": 0.7, "jaccard_body": 0.6, "pooled": 0.8, "chance": 0.2, "count_r": 0.4,
         "layer_r": None, "count_mad": 0.3, "acc_ours": 0.5, "acc_kvpress": 1.0, "s_ours": 4.0, "s_kvpress": 6.0},
        {"keep_ratio": 0.1, "jaccard": 0.3, "jaccard_body": 0.3, "pooled": 0.3, "chance": 0.05, "count_r": None,
         "layer_r": None, "count_mad": 0.0, "acc_ours": 0.0, "acc_kvpress": 0.0, "s_ours": 1.0, "s_kvpress": 1.0},
    ]
    summary = kc.summarize(records)
    assert [row["keep_ratio"] for row in summary] == [0.1, 0.3]
    low, high = summary
    assert low["n"] == 1 and high["n"] == 2
    assert high["jaccard"] == pytest.approx(0.6) and high["acc_ours"] == pytest.approx(0.75)
    assert high["count_r"] == pytest.approx(0.4)  # None left out of the mean
    assert high["layer_r"] == pytest.approx(0.5)
    assert low["count_r"] is None and low["layer_r"] is None
    table = kc.markdown_table(summary).splitlines()
    assert len(table) == 4 and table[1].count("---") == table[0].count("|") - 1
    cells = [c.strip() for c in table[3].strip("|").split("|")]
    assert cells[:2] == ["0.3", "2"] and cells[2] == "0.600" and cells[6] == "0.400"
    assert cells[8:10] == ["75.0", "50.0"]
    assert [c.strip() for c in table[2].strip("|").split("|")][6] == "-"
