"""The chunked attention-sum equals an explicit softmax."""

import threading

import pytest
import torch

from proxykv_hf.attention.statistics import attention_sums


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


def explicit_lookback(p, valid, Q, T):
    """"lookback" by its definition: at each query's position, the largest probability it gives to a key at least
    LOOKBACK_GAP positions back and past the row's first LOOKBACK_SINKS real tokens; ``p`` (B, H, Q, T)."""
    from proxykv_hf.attention.statistics import LOOKBACK_GAP, LOOKBACK_SINKS

    B, H = p.shape[:2]
    out = torch.zeros(B, H, T)
    for b in range(B):
        first = int(valid[b].float().argmax()) + LOOKBACK_SINKS
        for i in range(Q):
            pos = i + T - Q
            keys = list(range(first, pos - LOOKBACK_GAP + 1))
            if keys and valid[b, pos]:
                out[b, :, pos] = p[b, :, i, keys].amax(-1)
    return out


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("Q", [40, 23])
@pytest.mark.parametrize("masked", [True, False])
def test_lookback_statistic_equals_explicit(chunk, Q, masked):
    """"lookback" is read on the query side: padding queries, positions before this call's queries, keys within
    LOOKBACK_GAP of the query and each row's first real tokens (the sinks) never count. The sums and maxima of the
    same pass are those of the probabilities before the lookback zeroes the keys near each query."""
    torch.manual_seed(5)
    B, H, H_kv, T, D = 2, 4, 2, 40, 8
    query, key = torch.randn(B, H, Q, D) * 2, torch.randn(B, H_kv, T, D) * 2
    valid = torch.ones(B, T, dtype=torch.bool)
    if masked:
        valid[1, :7] = False
    qpos = torch.arange(Q) + (T - Q)
    mask = (torch.arange(T)[None, :] <= qpos[:, None])[None, None] & valid[:, None, None, :] if masked else None
    p = explicit_probs(query, key, valid, 0.3)  # (B, H, Q, T)
    want = explicit_lookback(p, valid, Q, T)
    peak = p.masked_fill(torch.arange(T)[None, :] == qpos[:, None], 0.0).amax(2)  # (B, H, T)
    got = attention_sums(query, key, mask, 0.3, query_valid=valid[:, T - Q:], chunk_size=chunk,
                         statistics=("sum", "max", "lookback"), backend="torch")
    torch.testing.assert_close(got, torch.cat([p.sum(2), peak, want], 1), rtol=1e-5, atol=1e-6)
    assert not got[:, 2 * H:, :T - Q].any() and want.abs().max() > 0
    if masked:  # an additive float mask (eager) gives the same
        add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        got_f = attention_sums(query, key, add, 0.3, query_valid=valid[:, T - Q:], chunk_size=chunk,
                               statistics=("lookback",))
        torch.testing.assert_close(got_f, want, rtol=1e-5, atol=1e-6)


def test_lookback_is_high_for_copied_text_and_low_for_new_text():
    """A key that matches a query exactly, far back, draws the query's attention: the token the query stands for
    was seen before (high lookback); a query that matches nothing far back keeps a low lookback."""
    torch.manual_seed(0)
    T, D = 64, 16
    key = torch.randn(1, 1, T, D)
    query = torch.randn(1, 1, T, D) * 0.1
    query[0, 0, 50] = key[0, 0, 20] * 4  # position 50 "copies" position 20
    got = attention_sums(query, key, None, D ** -0.5, statistics=("lookback",))[0, 0]  # (T,)
    assert got[50] > 0.9 and got[51] < 0.2


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
    with pytest.raises(ValueError, match="need T >= Q"):
        attention_sums(torch.randn(1, 2, 6, 2), k)  # no mask: causal, queries at the last Q positions


@pytest.mark.parametrize("chunk", [1, 4])
def test_more_queries_than_keys_under_an_explicit_mask(chunk):
    """With an explicit mask, T < Q is allowed: query q sits at position q + T - Q, so the first Q - T queries own
    no key, and the maximum leaves out only the keys that are some query's own."""
    torch.manual_seed(5)
    B, H, H_kv, Q, T, D = 1, 2, 1, 6, 4, 8
    query, key = torch.randn(B, H, Q, D), torch.randn(B, H_kv, T, D)
    mask = torch.ones(B, 1, Q, T, dtype=torch.bool)
    p = torch.softmax(query @ key.repeat_interleave(H, dim=1).transpose(-1, -2) * 0.5, -1)  # (B, H, Q, T)
    own = torch.arange(T)[None, :] == (torch.arange(Q) + T - Q)[:, None]  # (Q, T): rows 0, 1 own nothing
    got = attention_sums(query, key, mask, 0.5, chunk_size=chunk, statistics=("sum", "max"))
    torch.testing.assert_close(got, torch.cat([p.sum(2), p.masked_fill(own, 0.0).amax(2)], dim=1),
                               rtol=1e-5, atol=1e-6)


def test_a_mask_that_shows_the_future_is_honoured():
    """Causal masks let each query chunk skip later keys; a mask that shows later keys must not be truncated."""
    from proxykv_hf.attention.statistics_torch import _hides_future

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
@pytest.mark.parametrize("statistics", [("sum",), ("max", "sum"), ("sum", "max", "lookback")])
def test_attention_with_statistics_equals_attention_then_statistics(chunk, Q, statistics):
    """One pass gives the causal attention output (queries at the last Q of T positions) and what attention_sums
    returns; padding queries weigh nothing in the statistics but still get their output rows."""
    from proxykv_hf.attention.statistics import causal_attention_with_statistics

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


def padded_prefill(seed: int, T: int):
    """Random prefill inputs of 2 rows (6 query heads, 3 KV heads, head dim 8), the second left-padded by 5 tokens:
    ``(query, key, value, valid (B, T), causal padding mask (B, 1, T, T))``."""
    torch.manual_seed(seed)
    B, H, H_kv, D = 2, 6, 3, 8
    query, key, value = torch.randn(B, H, T, D) * 2, torch.randn(B, H_kv, T, D) * 2, torch.randn(B, H_kv, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :5] = False
    mask = (torch.arange(T)[None, :] <= torch.arange(T)[:, None])[None, None] & valid[:, None, None, :]
    return query, key, value, valid, mask


@pytest.mark.parametrize("masked", [True, False])
def test_kv_heads_per_pass_do_not_change_the_result(monkeypatch, masked):
    """The PyTorch path computes one KV head's queries at a time on a CPU and all KV heads at once elsewhere: both
    give the same statistics and output, under a padding mask too."""
    from proxykv_hf.attention import statistics as scoring, statistics_torch as scoring_torch

    query, key, value, valid, mask = padded_prefill(seed=4, T=21)
    stats = ("sum", "max", "lookback")

    def run(per_pass):
        monkeypatch.setattr(scoring_torch, "_kv_heads_per_pass", lambda device, n: per_pass)
        if masked:
            found, _ = scoring_torch._torch_statistics(query, key, mask, 0.3, valid, 4, stats)
            return [found[s] for s in stats]
        out, got = scoring.causal_attention_with_statistics(query, key, value, 0.3, chunk_size=4, statistics=stats,
                                                            backend="torch")
        return [out, got]

    assert scoring_torch._kv_heads_per_pass(torch.device("cpu"), key.shape[1]) == 1
    one, two, every = run(1), run(2), run(key.shape[1])
    for a, b, c in zip(one, two, every):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_attention_with_statistics_bad_arguments():
    from proxykv_hf.attention.statistics import causal_attention_with_statistics as fused

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


def test_where_statistics_come_with_the_attention(monkeypatch):
    """Off the fused kernels' path always (one softmax); on it where flash attention can hand over its log-sum-exp
    and no earlier check of the same FusedStatistics has failed; never when it is disabled."""
    from proxykv_hf.attention import statistics as scoring

    q = torch.randn(1, 2, 4, 8)
    fuses, recomputations = scoring.fuses_with_attention, scoring.recomputations  # + how often Q K^T is redone
    fresh = scoring.FusedStatistics()
    monkeypatch.setattr(scoring.kernels, "available", lambda query: False)
    assert fuses(q, fresh) and recomputations(q, fresh) == 0
    monkeypatch.setattr(scoring.kernels, "available", lambda query: True)
    assert fuses(q, fresh) and recomputations(q, fresh) == 1  # CPU tensors: CPU flash attention gives the lse
    monkeypatch.setattr(scoring.kernels, "flash_lse_supported", lambda query: False)
    assert not fuses(q, fresh) and recomputations(q, fresh) == 2  # e.g. float32 on CUDA: sdpa, both fused passes
    monkeypatch.setattr(scoring.kernels, "flash_lse_supported", lambda query: True)
    failed = scoring.FusedStatistics(flash_lse=False)
    assert not fuses(q, failed) and recomputations(q, failed) == 2
    assert fuses(q) and fuses(q, fresh)  # one object's failed check is no one else's
    monkeypatch.setattr(scoring.kernels, "available", lambda query: False)
    assert fuses(q, failed) and recomputations(q, failed) == 0
    off = scoring.FusedStatistics(enabled=False)
    assert not fuses(q, off) and recomputations(q, off) == 1  # sdpa, then the PyTorch statistics


def test_flash_attention_with_lse_on_cpu():
    """PyTorch's flash attention returns sdpa's output and each row's natural-log log-sum-exp (GQA included)."""
    from proxykv_hf.attention import kernels

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 33, 16), torch.randn(2, 2, 33, 16), torch.randn(2, 2, 33, 16)
    out, lse = kernels.flash_attention_with_lse(q, k, v, 0.3)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)
    logits = q @ k.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.3
    logits = logits.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
    assert kernels.flash_lse_supported(q)
    assert kernels.flash_attention_with_lse(q, k[:, :, 1:], v[:, :, 1:], 0.3) is None  # keys != queries
    assert kernels.flash_attention_with_lse(q, k, v.double(), 0.3) is None  # mixed dtypes
    assert kernels.flash_attention_with_lse(q, k, v[..., :8], 0.3) is None  # value width != query width
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernels.flash_attention_with_lse(q, k, v, 0.3, kernel="flash3")


def test_cudnn_heads_asked_once_per_device(monkeypatch):
    """cuDNN's attention is tried with grouped key heads, then with heads repeated, then given up (flash runs
    instead); the answer is kept per device, dtype and head dimension, and a refusal after it once ran for them is
    an error, not a fallback."""
    from proxykv_hf.attention import kernels

    calls = []

    def fake(query, key, value, scaling):  # a cuDNN that takes only as many key heads as query heads
        calls.append(key.shape[1])
        if key.shape[1] != query.shape[1]:
            raise RuntimeError("grouped heads not supported")
        return query.clone(), torch.zeros(query.shape[:3])

    monkeypatch.setattr(kernels, "_cudnn_op", fake)
    monkeypatch.setattr(kernels, "_cudnn_modes", {})
    q, k = torch.randn(1, 6, 5, 8), torch.randn(1, 2, 5, 8)
    assert kernels._cudnn_attention_with_lse(q, k, k, 0.3) is not None and calls == [2, 6]
    assert kernels._cudnn_attention_with_lse(q, k, k, 0.3) is not None and calls == [2, 6, 6]  # straight to repeated
    assert kernels._cudnn_modes == {(q.device, True, q.dtype, 8): "repeated"}
    assert kernels._cudnn_attention_with_lse(q, q, q, 0.3) is not None  # ungrouped heads: asked apart
    assert kernels._cudnn_modes[(q.device, False, q.dtype, 8)] == "grouped"

    def refuse(query, key, value, scaling):
        raise RuntimeError("no cuDNN attention here")

    monkeypatch.setattr(kernels, "_cudnn_op", refuse)
    with pytest.raises(RuntimeError, match="no cuDNN"):  # it ran before on this device
        kernels._cudnn_attention_with_lse(q, k, k, 0.3)
    kernels._cudnn_modes.clear()
    assert kernels._cudnn_attention_with_lse(q, k, k, 0.3) is None  # never ran: refused for good, flash instead
    assert kernels._cudnn_modes == {(q.device, True, q.dtype, 8): None}
    assert kernels._cudnn_attention_with_lse(q, k, k, 0.3) is None
    wide = torch.randn(1, 6, 5, 16)
    monkeypatch.setattr(kernels, "_cudnn_op", fake)  # another head dimension is asked apart
    assert kernels._cudnn_attention_with_lse(wide, wide[:, :2], wide[:, :2], 0.3) is not None


def _column_pass(query, key, scaling, query_valid=None, *, with_max=False, lse=None, **_):
    """A PyTorch stand-in for the fused kernels' pass 2 (Triton is not installed everywhere): the probabilities
    ``exp(logit - lse)`` summed over the queries, and their maximum over the other queries."""
    B, H, Q, D = query.shape
    k = key.repeat_interleave(H // key.shape[1], dim=1)
    logits = (query @ k.transpose(-1, -2)).float() * scaling
    logits = logits.masked_fill(torch.ones(Q, Q, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(logits - lse[..., None])
    if query_valid is not None:
        p = p * query_valid[:, None, :, None]
    other = p.masked_fill(torch.eye(Q, dtype=torch.bool), 0.0)
    return (p.sum(2), other.amax(2)) if with_max else p.sum(2)


@pytest.mark.parametrize("fault", [None, "wrong lse", "raises"])
def test_flash_statistics_and_their_check(monkeypatch, caplog, fault):
    """Where the fused kernels run, the statistics take flash attention's log-sum-exp; the first call checks it
    (probabilities summing to one per row), and a log-sum-exp that fails the check, or a flash call that raises,
    sends later calls with the same FusedStatistics back to sdpa + both passes with a warning, never to wrong statistics."""
    from proxykv_hf.attention import kernels, statistics as scoring

    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    valid = torch.rand(1, 20) > 0.2
    want_out, want = scoring.causal_attention_with_statistics(q, k, v, 0.4, query_valid=valid,
                                                              statistics=("sum", "max"), backend="torch")
    real_flash = kernels.flash_attention_with_lse
    calls = []

    def flash(*args):
        calls.append(1)
        if fault == "raises":
            raise RuntimeError("no flash kernel for these inputs")
        out, lse = real_flash(*args)
        return out, lse + (0.5 if fault == "wrong lse" else 0.0)

    fused = scoring.FusedStatistics()
    monkeypatch.setattr(kernels, "available", lambda query: True)
    monkeypatch.setattr(kernels, "flash_attention_with_lse", flash)
    monkeypatch.setattr(kernels, "causal_attention_sums", _column_pass)
    with caplog.at_level("WARNING", logger="proxykv_hf.attention.statistics"):
        out, got = scoring.causal_attention_with_statistics(q, k, v, 0.4, query_valid=valid,
                                                            statistics=("sum", "max"), fused=fused)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [1]
    assert fused.flash_lse is (fault is None)
    assert scoring.fuses_with_attention(q, fused) is (fault is None)
    assert ("the attention statistics use sdpa" in caplog.text) is (fault is not None)
    if fault is None:
        _, again = scoring.causal_attention_with_statistics(q, k, v, 0.4, query_valid=valid, statistics=("max",),
                                                            backend="triton", fused=fused)
        torch.testing.assert_close(again, want[:, 4:], rtol=1e-5, atol=1e-5)
    else:
        with pytest.raises(ValueError, match="triton backend needs"):
            scoring.causal_attention_with_statistics(q, k, v, 0.4, backend="triton", fused=fused)
        assert calls == [1]  # not tried again with this FusedStatistics


@pytest.fixture
def two_torch_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("masked", [True, False])
def test_cpu_chunks_split_between_threads_give_the_one_thread_result(monkeypatch, two_torch_threads, masked):
    """On a CPU with two torch threads the query chunks are shared out between two single-threaded workers, each
    taking the next chunk as it is free (the longest first), with its own sums and maxima: every chunk is computed
    once, off the caller's thread, and the statistics and output are those of one thread over every chunk (up to
    float rounding), under a padding mask and with padded queries too; torch's thread count is 2 again afterwards."""
    from proxykv_hf.attention import statistics as scoring, statistics_torch as scoring_torch

    query, key, value, valid, mask = padded_prefill(seed=5, T=23)
    stats = ("sum", "max", "lookback")
    taken = []  # (thread, chunk start) of each chunk computed
    real = scoring_torch._Chunks.run

    def spy(self, starts, sum_dtype=torch.float32):
        return real(self, (taken.append((threading.get_ident(), q0)) or q0 for q0 in starts), sum_dtype)

    monkeypatch.setattr(scoring_torch._Chunks, "run", spy)

    def run(min_pairs):
        taken.clear()
        monkeypatch.setattr(scoring_torch, "THREADED_MIN_PAIRS", min_pairs)
        if masked:
            found, _ = scoring_torch._torch_statistics(query, key, mask, 0.3, valid, 4, stats)
            return [found[s] for s in stats]
        out, got = scoring.causal_attention_with_statistics(query, key, value, 0.3, query_valid=valid, chunk_size=4,
                                                            statistics=stats, backend="torch")
        return [out, got]

    one = run(10**9)
    assert taken == [(threading.get_ident(), q0) for q0 in (0, 4, 8, 12, 16, 20)]
    split = run(0)
    assert sorted(q0 for _, q0 in taken) == [0, 4, 8, 12, 16, 20]  # chunks of 4 queries, each computed once
    assert taken[0][1] == 20  # the longest first
    assert threading.get_ident() not in {thread for thread, _ in taken}
    assert torch.get_num_threads() == 2
    for a, b in zip(one, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cpu_worker_sums_do_not_depend_on_which_worker_took_which_chunk():
    """The workers' float64 sums, added up and rounded to float32, are the same bits for any split of the chunks
    between them (which chunk a worker takes changes from one call to the next)."""
    from proxykv_hf.attention import statistics_torch as scoring_torch

    query, key, _, valid, mask = padded_prefill(seed=6, T=40)
    chunked = scoring_torch._Chunks(query, key, mask, 0.3, valid, 4, ("sum",), None)
    starts = list(range(0, 40, 4))

    def total(split):
        return torch.stack([chunked.run(part, torch.float64)[0] for part in split]).sum(0).float()

    want = total([starts[0::2], starts[1::2]])
    for split in ([starts[:3], starts[3:]], [starts[::-1][:7], starts[::-1][7:]], [starts[5:], starts[:5]]):
        assert torch.equal(total(split), want)
    one_thread = chunked.run(starts)[0]  # float32 sums, in chunk order
    torch.testing.assert_close(one_thread, want, rtol=1e-6, atol=1e-7)


def test_cpu_pass_stays_on_one_thread_where_threads_do_not_pay(two_torch_threads):
    from proxykv_hf.attention.statistics_torch import THREADED_MIN_PAIRS, _cpu_workers

    big = torch.zeros(1, 1, 2048, 8)
    assert THREADED_MIN_PAIRS <= 2048 * 2048
    assert _cpu_workers(big, big, big, num_chunks=16) == 2
    assert _cpu_workers(big[:, :, :64], big[:, :, :64], big[:, :, :64], num_chunks=16) == 1  # too little work
    assert _cpu_workers(big, big, big, num_chunks=1) == 1  # one chunk: nothing to split
    grad = big.clone().requires_grad_()
    assert _cpu_workers(grad, big, big, num_chunks=16) == 1  # autograd stays on the caller's thread
    with torch.no_grad():
        assert _cpu_workers(grad, big, big, num_chunks=16) == 2
    torch.set_num_threads(1)
    assert _cpu_workers(big, big, big, num_chunks=16) == 1


@pytest.mark.parametrize("scorer", ["snapkv", "proxy", "statistic"])
def test_a_prefill_with_grad_mode_on_scores_without_grad(scorer):
    from proxykv_hf import ProxyKVCache, SnapKVScorer
    from proxykv_hf.attention.compat import with_cache
    from proxykv_hf.scorers.statistic import AttentionStatisticScorer
    from proxykv_hf.testing import random_prompt, self_proxy_scorer, tiny_model

    model = tiny_model("llama")
    made = {"snapkv": lambda: SnapKVScorer(window=8), "proxy": lambda: self_proxy_scorer(model),
            "statistic": lambda: AttentionStatisticScorer("sum")}[scorer]()
    cache = ProxyKVCache(made, 0.3)
    inputs = random_prompt(1, 72, seed=5)
    assert torch.is_grad_enabled()
    model(**inputs, **with_cache(cache), use_cache=True)  # no torch.no_grad()
    assert not cache.compressing() and cache.physical_lengths() == [22, 22, 22]
