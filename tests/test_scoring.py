"""The chunked attention-sum equals an explicit softmax."""

import pytest
import torch

from proxykv_hf.scoring import attention_sums


def explicit(query, key, valid, scaling):
    """Summed over queries: the (B, H, T) column sums of :func:`explicit_probs`."""
    return explicit_probs(query, key, valid, scaling).sum(2)


def explicit_probs(query, key, valid, scaling):
    """Full (B, H, Q, T) softmax with causal + padding mask, padded query rows zeroed."""
    B, H, Q, D = query.shape
    H_kv, T = key.shape[1], key.shape[2]
    k = key.repeat_interleave(H // H_kv, dim=1)
    logits = query @ k.transpose(-1, -2) * scaling
    qpos = torch.arange(Q) + (T - Q)
    allowed = torch.arange(T)[None, :] <= qpos[:, None]  # (Q, T)
    allowed = allowed[None, None] & valid[:, None, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    return p * valid[:, None, T - Q:, None]


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("Q", [17, 5])
def test_chunked_equals_explicit_with_padding(chunk, Q):
    torch.manual_seed(0)
    B, H, H_kv, T, D = 2, 4, 2, 17, 8
    query = torch.randn(B, H, Q, D) * 2
    key = torch.randn(B, H_kv, T, D) * 2
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :6] = False  # left padding
    qpos = torch.arange(Q) + (T - Q)
    mask = (torch.arange(T)[None, :] <= qpos[:, None])[None, None] & valid[:, None, None, :]  # (B, 1, Q, T)
    ref = explicit(query, key, valid, 0.3)
    got = attention_sums(query, key, mask, 0.3, query_valid=valid[:, T - Q:], chunk_size=chunk)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # additive float mask (eager) gives the same
    add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    got_f = attention_sums(query, key, add, 0.3, query_valid=valid[:, T - Q:], chunk_size=chunk)
    torch.testing.assert_close(got_f, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("Q", [15, 6])
@pytest.mark.parametrize("masked", [True, False])
def test_max_statistic_equals_explicit(chunk, Q, masked):
    """"max": the largest probability a key gets from a query other than its own position, beside the sum; with a
    padding mask, and without one (causal: the path that masks only each chunk's diagonal block)."""
    torch.manual_seed(3)
    B, H, H_kv, T, D = 2, 4, 2, 15, 8
    query, key = torch.randn(B, H, Q, D) * 2, torch.randn(B, H_kv, T, D) * 2
    valid = torch.ones(B, T, dtype=torch.bool)
    if masked:
        valid[1, :4] = False
    qpos = torch.arange(Q) + (T - Q)
    mask = (torch.arange(T)[None, :] <= qpos[:, None])[None, None] & valid[:, None, None, :] if masked else None
    p = explicit_probs(query, key, valid, 0.3)  # (B, H, Q, T)
    own = torch.arange(T)[None, :] == qpos[:, None]  # (Q, T)
    peak = p.masked_fill(own, 0.0).amax(2)  # (B, H, T)
    got = attention_sums(query, key, mask, 0.3, query_valid=valid[:, T - Q:] if masked else None,
                         chunk_size=chunk, statistics=("sum", "max"), backend="torch")
    torch.testing.assert_close(got, torch.cat([p.sum(2), peak], 1), rtol=1e-5, atol=1e-5)
    assert got[:, H:, -1].abs().max() == 0  # the last key is seen by its own query only
    grouped = attention_sums(query, key, mask, 0.3, query_valid=valid[:, T - Q:], chunk_size=chunk,
                             statistics=("max",), group_reduce="mean")
    torch.testing.assert_close(grouped, peak.view(B, H_kv, 2, T).mean(2), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="statistics"):
        attention_sums(query, key, mask, statistics=("sum", "sum"))
    with pytest.raises(ValueError, match="statistics"):
        attention_sums(query, key, mask, statistics=("median",))


def test_mask_none_is_causal_and_group_reductions():
    torch.manual_seed(1)
    query, key = torch.randn(1, 6, 9, 4), torch.randn(1, 2, 9, 4)
    valid = torch.ones(1, 9, dtype=torch.bool)
    ref = explicit(query, key, valid, 0.5)
    got = attention_sums(query, key, None, 0.5, chunk_size=4)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention_sums(query, key, None, 0.5, group_reduce="mean"),
                               ref.view(1, 2, 3, 9).mean(2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention_sums(query, key, None, 0.5, group_reduce="max"),
                               ref.view(1, 2, 3, 9).amax(2), rtol=1e-5, atol=1e-5)
    # every real query distributes a total mass of one
    assert torch.allclose(got.sum(-1), torch.full((1, 6), 9.0))


def test_bad_arguments():
    q, k = torch.randn(1, 3, 4, 2), torch.randn(1, 2, 4, 2)
    with pytest.raises(ValueError, match="multiple"):
        attention_sums(q, k)
    with pytest.raises(ValueError, match="group_reduce"):
        attention_sums(torch.randn(1, 2, 4, 2), k, group_reduce="median")


def test_a_mask_that_shows_the_future_is_honoured():
    """Causal masks let each query chunk skip later keys; a mask that shows later keys must not be truncated."""
    from proxykv_hf.scoring import _hides_future

    torch.manual_seed(2)
    B, H, H_kv, T, D = 2, 4, 2, 12, 8
    query, key = torch.randn(B, H, T, D), torch.randn(B, H_kv, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :3] = False
    both = valid[:, None, None, :].expand(B, 1, T, T)  # bidirectional over the real tokens
    k = key.repeat_interleave(H // H_kv, dim=1)
    logits = (query @ k.transpose(-1, -2) * 0.4).masked_fill(~both, float("-inf"))
    ref = torch.softmax(logits, -1).sum(2)
    for chunk in (1, 5, 12):
        torch.testing.assert_close(attention_sums(query, key, both, 0.4, chunk_size=chunk), ref,
                                   rtol=1e-5, atol=1e-5)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & both
    assert _hides_future(causal, T, T) and _hides_future(None, T, T) and not _hides_future(both, T, T)
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert _hides_future(additive, T, T)
    assert _hides_future(causal[:, :, -4:], 4, T)  # the last 4 queries of a longer prompt


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("Q", [13, 6])
@pytest.mark.parametrize("statistics", [("sum",), ("max", "sum")])
def test_attention_with_statistics_equals_attention_then_statistics(chunk, Q, statistics):
    """One pass gives the causal attention output (queries at the last Q of T positions) and what attention_sums
    returns; padding queries weigh nothing in the statistics but still get their output rows."""
    from proxykv_hf.scoring import causal_attention_with_statistics

    torch.manual_seed(3)
    B, H, H_kv, T, D, Dv = 2, 6, 2, 13, 8, 5
    query, key, value = torch.randn(B, H, Q, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, Dv)
    query_valid = torch.rand(B, Q) > 0.3
    out, stats = causal_attention_with_statistics(query, key, value, 0.3, query_valid=query_valid,
                                                  chunk_size=chunk, statistics=statistics)
    valid_keys = torch.ones(B, T, dtype=torch.bool)
    p = explicit_probs(query, key, valid_keys, 0.3)  # (B, H, Q, T), every query row kept
    want_out = p @ value.repeat_interleave(H // H_kv, dim=1)
    assert out.shape == (B, H, Q, Dv) and out.dtype == query.dtype
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats, attention_sums(query, key, None, 0.3, query_valid=query_valid,
                                                     chunk_size=chunk, statistics=statistics), rtol=0, atol=0)
    if Q == T:  # what transformers' sdpa computes for an unpadded prefill
        sdpa = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.3,
                                                                enable_gqa=True)
        torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-6)


def test_attention_with_statistics_bad_arguments():
    from proxykv_hf.scoring import causal_attention_with_statistics as fused

    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="multiple"):
        fused(torch.randn(1, 3, 6, 8), k, k)
    with pytest.raises(ValueError, match="values shaped like the keys"):
        fused(q, k, torch.randn(1, 2, 5, 8))
    with pytest.raises(ValueError, match="T >= Q"):
        fused(q, k[:, :, :4], k[:, :, :4])
    with pytest.raises(ValueError, match="statistics"):
        fused(q, k, k, statistics=("mean",))
    with pytest.raises(ValueError, match="chunk_size"):
        fused(q, k, k, chunk_size=0)


def test_fusion_is_off_where_the_fused_kernels_run(monkeypatch):
    from proxykv_hf import scoring

    q = torch.randn(1, 2, 4, 8)
    assert scoring.fuses_with_attention(q) == (not scoring.kernels.available(q))
    monkeypatch.setattr(scoring.kernels, "available", lambda query: True)
    assert not scoring.fuses_with_attention(q)
    monkeypatch.setattr(scoring.kernels, "available", lambda query: False)
    assert scoring.fuses_with_attention(q)
    monkeypatch.setattr(scoring, "FUSE_WITH_ATTENTION", False)
    assert not scoring.fuses_with_attention(q)
