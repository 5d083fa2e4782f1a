"""select_topk invariants (hypothesis) and budget maths."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proxykv_hf.cache.selection import check_keep_ratio, keep_counts, select_topk, smooth_scores


@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, 3))
    T = draw(st.integers(1, 24))
    lengths = [draw(st.integers(1, T)) for _ in range(B)]
    # few distinct values, so that ties are common
    values = draw(st.lists(st.integers(0, 4), min_size=B * H * T, max_size=B * H * T))
    scores = torch.tensor(values, dtype=torch.float32).view(B, H, T)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, T - n:] = True
    rho = draw(st.floats(0.01, 1.0))
    n_sink = draw(st.integers(0, 4))
    n_recent = draw(st.integers(0, 4))
    return scores, valid, rho, n_sink, n_recent


def reference(scores, valid, rho, n_sink, n_recent):
    """Plain-Python selection: protected first, then score, ties -> earlier position."""
    B, H, T = scores.shape
    out = []
    for b in range(B):
        real = [t for t in range(T) if valid[b, t]]
        k = max(math.ceil(rho * len(real) - 1e-9), min(n_sink + n_recent, len(real)))
        k = min(k, len(real))
        prot = set(real[:n_sink]) | set(real[len(real) - n_recent:] if n_recent else [])
        row = []
        for h in range(H):
            ranked = sorted(real, key=lambda t: (t not in prot, -scores[b, h, t].item(), t))
            row.append(sorted(ranked[:k]))
        out.append(row)
    return out


@settings(max_examples=200, deadline=None)
@given(problems())
def test_kept_set_is_the_reference_topk(problem):
    scores, valid, rho, n_sink, n_recent = problem
    indices, slot_valid = select_topk(scores, rho, valid, n_sink, n_recent)
    expected = reference(scores, valid, rho, n_sink, n_recent)
    B, H, K = indices.shape
    for b in range(B):
        real = valid[b].nonzero().flatten().tolist()
        for h in range(H):
            kept = indices[b, h][slot_valid[b]].tolist()
            assert kept == expected[b][h]  # exactly the top-K, sorted by position
            assert all(valid[b, t] for t in kept)  # never padding
            assert set(real[:n_sink]) <= set(kept)  # sinks kept
            if n_recent:
                assert set(real[-n_recent:]) <= set(kept)  # recent kept
        # spare slots come first
        n_spare = int((~slot_valid[b]).sum())
        assert not slot_valid[b, :n_spare].any() and slot_valid[b, n_spare:].all()


def test_keep_counts():
    n = torch.tensor([10, 7, 3, 100])
    assert keep_counts(n, 0.3).tolist() == [3, 3, 1, 30]
    assert keep_counts(n, 0.1, n_protected=5).tolist() == [5, 5, 3, 10]
    assert keep_counts(n, 1.0).tolist() == [10, 7, 3, 100]


def test_scores_with_nan_rank_lowest():
    scores = torch.tensor([[[float("nan"), 1.0, 0.5, 2.0]]])
    idx, _ = select_topk(scores, 0.5)
    assert idx.tolist() == [[[1, 3]]]


@settings(max_examples=100, deadline=None)
@given(problems(), st.sampled_from([1, 3, 5]), st.booleans())
def test_smooth_scores_is_the_mean_over_real_neighbours(problem, kernel, keep_peaks):
    scores, valid, *_ = problem
    scores = scores + torch.rand(scores.shape)  # break ties
    scores[~valid[:, None, :].expand_as(scores)] = float("-inf")  # padding may hold anything
    out = smooth_scores(scores, valid, kernel, keep_peaks=keep_peaks)
    B, H, T = scores.shape
    for b in range(B):
        for t in range(T):
            if not valid[b, t]:
                continue
            near = [u for u in range(t - kernel // 2, t + kernel // 2 + 1) if 0 <= u < T and valid[b, u]]
            want = scores[b, :, near].mean(-1)
            if keep_peaks:
                want = torch.maximum(want, scores[b, :, t])
            assert torch.allclose(out[b, :, t], want, atol=1e-5), (b, t)


def test_smooth_scores_pads_like_alone_and_checks_kernel():
    scores = torch.rand(1, 2, 9)
    padded = torch.cat([torch.full((1, 2, 3), 7.0), scores], dim=-1)
    valid = torch.tensor([[False] * 3 + [True] * 9])
    alone = smooth_scores(scores, torch.ones(1, 9, dtype=torch.bool), 5)
    assert torch.allclose(smooth_scores(padded, valid, 5)[..., 3:], alone)
    assert smooth_scores(scores, torch.ones(1, 9, dtype=torch.bool), 1) is scores
    for bad in (0, 2, -1, 3.0, True):
        with pytest.raises(ValueError, match="positive odd int"):
            smooth_scores(scores, torch.ones(1, 9, dtype=torch.bool), bad)


@pytest.mark.parametrize("make", [
    lambda: np.float32(0.3), lambda: np.float16(0.3), lambda: np.float64(0.3), lambda: torch.tensor(0.3),
    lambda: torch.tensor(0.3, dtype=torch.float16), lambda: torch.tensor(0.3, dtype=torch.bfloat16),
    lambda: torch.tensor(0.3, dtype=torch.float64),
], ids=["np32", "np16", "np64", "t32", "t16", "tbf16", "t64"])
def test_numpy_and_tensor_keep_ratios_mean_their_short_decimal(make):
    """float32 0.3 is 0.30000001...: read as 0.3, it keeps 3 of 10 tokens, not 4."""
    rho = make()
    assert check_keep_ratio(rho) == 0.3
    valid = torch.ones(1, 10, dtype=torch.bool)
    idx, _ = select_topk(torch.arange(10.0).view(1, 1, 10), rho, valid)
    assert idx.tolist() == [[[7, 8, 9]]]


def test_keep_ratio_integers_and_bad_values():
    assert check_keep_ratio(np.int64(1)) == 1.0 and check_keep_ratio(torch.tensor(1)) == 1.0
    assert check_keep_ratio(np.float32(0.123456789)) == pytest.approx(0.123456789, rel=1e-7)
    for bad in (torch.tensor([0.3]), torch.tensor([0.3, 0.5]), torch.tensor(True), np.bool_(True), True, "0.3",
                torch.tensor(1.5), np.float32(0.0), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match="keep_ratio"):
            check_keep_ratio(bad)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        check_keep_ratio(torch.tensor([0.3, 0.5]))
