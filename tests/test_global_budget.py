"""The global budget: one Top-K per row across layers and heads, stored packed (no padding), exact under generate."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proxykv_hf import KVzipScorer, LayerInputs, LayerScorer, ProxyKVCache, SnapKVScorer
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.cache.layer import ProxyKVLayer
from proxykv_hf.cache.selection import keep_counts, protected_mask, select_global
from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer

GEN = dict(do_sample=False, pad_token_id=0)


def _brute_force(scores, keep_ratio, valid, n_sink, n_recent, head_floor):
    """The rule of select_global, entry by entry in plain Python."""
    L, (B, H, T) = len(scores), scores[0].shape
    keep = [torch.zeros(B, H, T, dtype=torch.bool) for _ in range(L)]
    for b in range(B):
        real = [t for t in range(T) if valid[b, t]]
        k = int(keep_counts(torch.tensor([len(real)]), keep_ratio, n_sink + n_recent)[0])
        prot = {t for t in range(T) if protected_mask(valid[b:b + 1], n_sink, n_recent)[0, t]}
        chosen = {(l, h, t) for l in range(L) for h in range(H) for t in prot}
        floor = min(math.ceil(head_floor * k - 1e-9), k) - len(prot)
        for l in range(L):
            for h in range(H):
                free = sorted((t for t in real if t not in prot), key=lambda t: (-float(scores[l][b, h, t]), t))
                chosen |= {(l, h, t) for t in free[:max(floor, 0)]}
        rest = sorted(((l, h, t) for l in range(L) for h in range(H) for t in real if (l, h, t) not in chosen),
                      key=lambda e: (-float(scores[e[0]][b, e[1], e[2]]), e))
        chosen |= set(rest[:k * L * H - len(chosen)])
        for l, h, t in chosen:
            keep[l][b, h, t] = True
    return keep


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 3), B=st.integers(1, 3), H=st.integers(1, 3), T=st.integers(4, 24),
       keep_ratio=st.sampled_from([0.05, 0.2, 0.5, 0.9, 1.0]), n_sink=st.integers(0, 3), n_recent=st.integers(0, 3),
       head_floor=st.sampled_from([0.0, 0.2, 1.0]), ties=st.booleans(), seed=st.integers(0, 10_000))
def test_select_global_equals_brute_force(L, B, H, T, keep_ratio, n_sink, n_recent, head_floor, ties, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = [torch.randint(0, 3, (B, H, T), generator=gen).float() if ties else torch.rand(B, H, T, generator=gen)
              for _ in range(L)]
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    valid = torch.arange(T)[None, :] >= (T - lengths)[:, None]  # left padded rows of their own lengths
    got = select_global(scores, keep_ratio, valid, n_sink, n_recent, head_floor=head_floor)
    want = _brute_force(scores, keep_ratio, valid, n_sink, n_recent, head_floor)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    k = keep_counts(valid.sum(-1), keep_ratio, n_sink + n_recent)
    assert torch.equal(sum(g.sum((1, 2)) for g in got), k * L * H)  # the nominal budget, exactly
    assert not any((g & ~valid[:, None, :]).any() for g in got)  # padding never kept


class _SameValuesPerHead(LayerScorer):
    """Each (layer, head) scores its row's real tokens by a permutation of the same values: a global Top-K then keeps
    exactly K per head, the entries the uniform budget keeps."""

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        B, H, T, _ = inputs.keys.shape
        out = torch.zeros(B, H, T)
        gen = torch.Generator().manual_seed(inputs.layer_idx)
        for b, n in enumerate(inputs.valid.sum(-1).tolist()):
            for h in range(H):
                out[b, h, T - n:] = torch.randperm(n, generator=gen).float() / n
        return out.to(inputs.keys.device)


@pytest.mark.parametrize("padded", [False, True])
def test_global_layout_decodes_like_uniform_when_counts_agree(padded):
    """Packed storage + the per-head attention give what the uniform layout gives for the same kept sets: greedy,
    beam search, sampling, a continued conversation and chunked prefill."""
    model = tiny_model("llama", num_hidden_layers=3)  # 4 query heads over 2 KV heads (GQA)
    inputs = random_prompt(2, 50, lengths=[50, 37] if padded else None, seed=2)
    runs = {}
    for budget in ("uniform", "global"):
        cache = ProxyKVCache(_SameValuesPerHead(), keep_ratio=0.3, budget=budget)
        out = model.generate(**inputs, **with_cache(cache), max_new_tokens=6, output_logits=True,
                             return_dict_in_generate=True, **GEN)
        beams = model.generate(**inputs, **with_cache(ProxyKVCache(_SameValuesPerHead(), 0.3, budget=budget)),
                               max_new_tokens=4, num_beams=2, **GEN)
        torch.manual_seed(0)
        sampled = model.generate(**inputs, **with_cache(ProxyKVCache(_SameValuesPerHead(), 0.3, budget=budget)),
                                 max_new_tokens=4, do_sample=True, top_k=5, pad_token_id=0)
        more = torch.cat([out.sequences, torch.randint(4, 200, (2, 5))], 1)  # the conversation goes on
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, more.shape[1] - 50, dtype=torch.long)], 1)
        cont = model.generate(input_ids=more, attention_mask=mask, **with_cache(cache), max_new_tokens=3, **GEN)
        chunked = model.generate(**inputs, **with_cache(ProxyKVCache(_SameValuesPerHead(), 0.3, budget=budget)),
                                 max_new_tokens=4, prefill_chunk_size=16, **GEN)
        runs[budget] = out, beams, sampled, cont, chunked, cache
    (u, *u_rest, u_cache), (g, *g_rest, g_cache) = runs["uniform"], runs["global"]
    assert torch.equal(u.sequences, g.sequences)
    for a, b in zip(u.logits, g.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(u_rest, g_rest):
        assert torch.equal(a, b)
    assert all(layer.ragged for layer in g_cache.layers)
    for i, sets in u_cache.kept_sets().items():
        for row_u, row_g in zip(sets, g_cache.kept_sets()[i]):
            for a, b in zip(row_u, row_g):
                assert torch.equal(a.cpu(), b.cpu())


def test_ragged_attention_by_hand():
    """Each query head attends to exactly its own KV head's kept entries and the later tokens before it."""
    torch.manual_seed(0)
    B, H, G, T, D = 2, 2, 3, 12, 8
    layer = ProxyKVLayer()
    layer.update(torch.randn(B, H, T, D), torch.randn(B, H, T, D))
    full_k, full_v = layer.keys.clone(), layer.values.clone()
    keep = torch.rand(B, H, T) < 0.4
    keep[..., 0] = True
    layer.compact_ragged(keep)
    new_k, new_v = torch.randn(B, H, 3, D), torch.randn(B, H, 3, D)
    layer.update(new_k, new_v)
    q = torch.randn(B, H * G, 3, D)
    got, _ = layer.ragged_attention(q, 0.5)
    for b in range(B):
        for hq in range(H * G):
            h = hq // G
            k = torch.cat([full_k[b, h, keep[b, h]], new_k[b, h]])
            v = torch.cat([full_v[b, h, keep[b, h]], new_v[b, h]])
            n_kept = int(keep[b, h].sum())
            for i in range(3):  # query i sees the kept entries and the new tokens up to itself
                p = (k[: n_kept + i + 1] @ q[b, hq, i]) * 0.5
                want = p.softmax(-1) @ v[: n_kept + i + 1]
                torch.testing.assert_close(got[b, hq, i], want, rtol=1e-5, atol=1e-5)
    assert layer.held_entries() == int(keep.sum()) + B * H * 3


def test_packed_segments_stay_in_order_and_attend_like_the_masked_reference():
    """Appends of any length land at the end of each (row, KV head)'s segment, a crop and a row selection keep the
    order, and the per-segment attention equals the all-entries masked reference (the path that returns weights)."""
    torch.manual_seed(1)
    B, H, G, T, D = 2, 3, 2, 20, 8
    layer = ProxyKVLayer()
    layer.update(torch.randn(B, H, T, D), torch.randn(B, H, T, D))
    keep = torch.rand(B, H, T) < 0.3
    keep[..., 0] = True
    layer.compact_ragged(keep)

    def check(Q):
        order = layer.owner.long() * (layer.cumulative_length + 1) + layer.position.long()
        assert bool((order[1:] > order[:-1]).all())  # by owner, then position: contiguous segments
        assert torch.equal(layer.segment_counts(), torch.bincount(layer.owner.long(), minlength=layer.budgets.numel()))
        q = torch.randn(B, H * G, Q, D)
        fast, _ = layer.ragged_attention(q, 0.3)
        reference, probs = layer.ragged_attention(q, 0.3, weights=True)
        torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
        assert probs.shape == (B, H * G, Q, layer.cumulative_length)

    for q in (3, 1, 1, 4):  # a chunk, two decode steps, a chunk
        layer.update(torch.randn(B, H, q, D), torch.randn(B, H, q, D))
        check(q)
    layer.crop(-5)
    check(1)
    layer.batch_select_indices(torch.tensor([1]))
    layer.batch_repeat_interleave(2)
    check(2)
    layer._counts = None  # counted again from the owners (as after a load)
    check(1)


def test_a_layer_laid_out_as_a_file_or_an_older_release_holds_it_is_put_in_order_before_use():
    """A packed layer with the later tokens inside its segments, out of order and without a tail (a saved context's
    layout; a layer unpickled from an older release) is sorted and its later tokens moved to the tail the first time
    it is used: it then keeps, attends and saves as the layer it was made from."""
    torch.manual_seed(2)
    layer = ProxyKVLayer()
    layer.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
    layer.compact_ragged(torch.rand(1, 2, 10) < 0.5)
    layer.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    saved = {name: t.clone() for name, t in layer.saved_tensors().items()}
    assert saved["keys"].shape[2] == layer.held_entries() == int(layer.budgets.sum()) + 2 * 2
    q = torch.randn(1, 6, 1, 4)
    want = layer.ragged_attention(q, 0.5)[0]
    old = ProxyKVLayer()
    old.__dict__.update({k: v for k, v in vars(layer).items() if k not in ("tail_keys", "tail_values", "_counts")})
    shuffle = torch.randperm(saved["owner"].numel())
    old.keys, old.values = saved["keys"][:, :, shuffle], saved["values"][:, :, shuffle]
    old.owner, old.position = saved["owner"][shuffle], saved["position"][shuffle]
    assert old.segment_counts().tolist() == layer.segment_counts().tolist()
    assert torch.equal(old.tail_keys, layer.tail_keys) and torch.equal(old.keys, layer.keys)
    assert all(torch.equal(a, b) for a, b in zip(old.kept_sets()[0], layer.kept_sets()[0]))
    torch.testing.assert_close(old.ragged_attention(q, 0.5)[0], want)
    assert all(torch.equal(old.saved_tensors()[name], t) for name, t in saved.items())
    uneven = ProxyKVLayer()  # a later token given to one head twice and to another not at all: refused, not misread
    uneven.__dict__.update({k: v for k, v in vars(old).items() if k not in ("tail_keys", "tail_values", "_counts")})
    owner = saved["owner"].clone()
    owner[saved["position"] == layer.compacted_at] = 0
    uneven.keys, uneven.values, uneven.owner, uneven.position = saved["keys"], saved["values"], owner, saved["position"]
    with pytest.raises(ValueError, match="once per"):
        uneven.segment_counts()


@pytest.mark.parametrize("scorer", ["kvzip", "snapkv"])
def test_global_cache_holds_its_nominal_budget(scorer):
    """Entries held after compaction, counted from the cache's tensors: at most 1.05x the nominal budget (exactly
    it here) plus the tokens added later; heads keep different amounts."""
    model = tiny_model("llama", num_hidden_layers=4)
    inputs = random_prompt(2, 120, lengths=[120, 90], seed=4)
    make = {"kvzip": lambda: KVzipScorer(tiny_tokenizer(), context_chunk=64), "snapkv": lambda: SnapKVScorer(window=8)}
    cache = ProxyKVCache(make[scorer](), keep_ratio=0.2, budget="global")
    model.generate(**inputs, **with_cache(cache), max_new_tokens=5, **GEN)
    L, H = len(cache.compactable_layers()), model.config.num_key_value_heads
    k = keep_counts(inputs["attention_mask"].sum(-1), 0.2, cache.n_sink + cache.n_recent)
    nominal = int(k.sum()) * L * H
    later = 4 * 2 * H * L  # the fed-back generated tokens
    held = sum(layer.keys.shape[-2] + layer.tail_keys.shape[:3].numel() for layer in cache.layers)  # packed + tail
    assert held == cache.held_entries() <= 1.05 * nominal + later
    counts = torch.stack([layer.budgets for layer in cache.layers])  # (L, B, H_kv)
    assert len(set(counts[:, 0].flatten().tolist())) > 1  # non-uniform across layers and heads
    assert int(counts.min()) >= math.ceil(0.2 * int(k.min()))  # the per-head floor


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="budget must be one of"):
        ProxyKVCache(SnapKVScorer(), 0.3, budget="per-layer")


def test_crop_and_batch_ops_on_the_packed_layout():
    """crop() removes only later tokens, and batch selection / repetition move whole rows with their owners."""
    model = tiny_model("llama", num_hidden_layers=2)
    inputs = random_prompt(2, 60, lengths=[60, 44], seed=9)
    short = ProxyKVCache(_SameValuesPerHead(), 0.3, budget="global")
    long = ProxyKVCache(_SameValuesPerHead(), 0.3, budget="global")
    model.generate(**inputs, **with_cache(short), max_new_tokens=3, **GEN)  # prompt + 2 fed-back tokens
    model.generate(**inputs, **with_cache(long), max_new_tokens=6, **GEN)
    long.crop(62)
    for a, b in zip(short.layers, long.layers):
        assert a.cumulative_length == b.cumulative_length == 62
        assert torch.equal(a.owner, b.owner) and torch.equal(a.position, b.position)
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.tail_keys, b.tail_keys)  # the 2 later tokens, after the crop too
        assert a.tail_keys.shape[2] == 2
    with pytest.raises(ValueError, match="cannot crop"):
        long.crop(59)
    sets = short.kept_sets()
    short.batch_select_indices(torch.tensor([1]))
    short.batch_repeat_interleave(2)
    for i, rows in short.kept_sets().items():
        assert len(rows) == 2
        for row in rows:
            assert all(torch.equal(a, b) for a, b in zip(row, sets[i][1]))


def test_the_packed_layout_holds_only_the_index_it_needs(tmp_path):
    from proxykv_hf.contexts.pipeline import compress_context
    from proxykv_hf.cache.selection import BUDGETS
    from proxykv_hf.testing import random_prompt, tiny_model

    model = tiny_model("llama")
    ids = random_prompt(1, 200, seed=2)["input_ids"]
    caches = {b: compress_context(model, ProxyKVCache(SnapKVScorer(window=8), 0.3, budget=b), ids) for b in BUDGETS}
    layer = caches["global"].layers[0]
    for index in (layer.owner, layer.position):  # 4 bytes per kept entry each, owning exactly their storage
        assert index.dtype == torch.int32 and index.untyped_storage().nbytes() == 4 * index.numel()
    kept = sum(l.keys.shape[-2] for l in caches["global"].layers)
    uniform = sum(l.kept_positions.numel() for l in caches["uniform"].layers)
    assert kept == uniform  # the same number of entries kept in all
    assert caches["global"].nbytes() <= caches["uniform"].nbytes() + 8 * 3 * 2 * 4  # + the (B, H_kv) budgets
    caches["global"].save_context(tmp_path / "ctx")
    assert ProxyKVCache.load_context(tmp_path / "ctx", model).nbytes() == caches["global"].nbytes()


def test_entry_bytes_counts_the_tokens_after_the_prompt():
    """The evaluation's ``kv_bytes`` of a global-budget cache after an answer: the kept prompt entries and the tokens
    added since (held in the layer's tail), as for the uniform layout."""
    from proxykv_hf.eval.methods import entry_bytes

    model = tiny_model("llama", num_hidden_layers=2)
    cache = ProxyKVCache(SnapKVScorer(window=8), 0.3, budget="global")
    model.generate(**random_prompt(1, 60, seed=3), **with_cache(cache), max_new_tokens=4, **GEN)
    assert all(layer.tail_keys.shape[2] == 3 for layer in cache.layers)  # the fed-back tokens
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert entry_bytes(cache) == cache.held_entries() * 2 * head_dim * 4  # K and V, float32
    assert sum(cache.physical_lengths()) == cache.held_entries()
