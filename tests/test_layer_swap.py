"""The helpers of scripts/layer_swap.py (no model): where an answer's tokens are, what a head keeps of them, the
layer ranges, and its refusal of any split but dev."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from proxykv_hf.testing import tiny_tokenizer

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "layer_swap.py"


@pytest.fixture(scope="module")
def swap():
    spec = importlib.util.spec_from_file_location("layer_swap", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_answer_positions_cover_every_occurrence(swap):
    tok = tiny_tokenizer()  # one token per byte
    text = "the code is QX-12 and again QX-12."
    ids = tok.encode(text, add_special_tokens=False)
    got = swap.answer_positions(tok, ids, ["QX-12"])
    first, second = text.find("QX-12"), text.rfind("QX-12")
    assert got == [*range(first, first + 5), *range(second, second + 5)]
    assert swap.answer_positions(tok, ids, ["absent"]) == []
    assert swap.answer_positions(tok, ids, [""]) == []


def test_kept_share_counts_heads_and_positions(swap):
    scores = {0: torch.tensor([[[5.0, 4.0, 0.0, 1.0], [0.0, 1.0, 5.0, 4.0]]]),  # (1, H_kv=2, T=4)
              1: torch.tensor([[[0.0, 1.0, 5.0, 4.0], [0.0, 1.0, 5.0, 4.0]]])}
    assert swap.kept_share(scores, 2, [0, 1]) == [0.5, 0.0]  # layer 0: head 0 keeps both, head 1 neither
    assert swap.kept_share(scores, 2, [2]) == [0.5, 1.0]


def test_groups_and_the_dev_only_rule(swap):
    assert swap.parse_group("20-29", 30) == list(range(20, 30))
    assert swap.parse_group("7", 30) == [7]
    for bad in ("25-30", "9-3"):
        with pytest.raises(SystemExit, match="not a layer range"):
            swap.parse_group(bad, 30)
    with pytest.raises(SystemExit, match="dev split only"):
        swap.main(["--tasks", "letter:everyday-test"])


def test_exclusive_tokens_report_where_and_how_common_each_methods_own_tokens_are(swap):
    ids = [7, 7, 7, 7, 1, 2, 3, 4]  # token 7 occurs four times, the others once
    early = torch.tensor([[[9.0, 8.0, 0, 0, 0, 0, 0, 0]]])  # (1, H_kv=1, T=8): keeps positions 0 and 1
    late = torch.tensor([[[0, 0, 0, 0, 0, 0, 8.0, 9.0]]])  # keeps positions 6 and 7
    got = swap.exclusive_tokens(ids, {0: early}, {0: late}, [0], 2)
    assert got["a"] == [0.0, 4.0]  # positions 0 and 1 (torch's median: the lower middle), a token seen four times
    assert got["b"] == [6 / 8, 1.0]
    same = swap.exclusive_tokens(ids, {0: early}, {0: early}, [0], 2)
    assert all(v != v for v in same["a"] + same["b"])  # nothing kept by one alone: NaN, not a made-up figure


def test_token_spans_give_each_occurrence_in_order():
    from proxykv_hf.eval.prompts import token_spans

    tok = tiny_tokenizer()  # one token per byte
    ids = tok.encode("aaa b aaa", add_special_tokens=False)
    assert token_spans(tok, ids, "aa") == [[0, 1], [1, 2], [6, 7], [7, 8]]  # overlapping occurrences too
    assert token_spans(tok, ids, "b") == [[4]]
    assert token_spans(tok, ids, "zz") == [] and token_spans(tok, ids, "") == []
