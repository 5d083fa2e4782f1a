"""KVzipScorer / kvzip_scores: a naive reference, chunking, padded batches, generate with compaction, errors."""

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.cache.proxykv_cache import ProxyKVLayer
from proxykv_hf.scorers import kvzip as kvzip_module
from proxykv_hf.scorers.kvzip import KVzipScorer, full_attention_layers, kvzip_scores
from proxykv_hf.cache.selection import select_topk
from proxykv_hf.testing import random_prompt, tiny_model, tiny_tokenizer

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
TINY_POSTFIX = "</s>\n<s>assistant\n"  # end of the user turn + assistant header in testing.CHAT_TEMPLATE


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def naive_kvzip(model, ctx: list[int], tok, chunk_size: int, prev: int, n_sink: int) -> torch.Tensor:
    """KVzip by hand for one unpadded row: `(L, H_kv, T)` (every layer, sliding ones included).

    Per chunk, the model runs on the concatenated sequence [context + repeat input] without any cache; each layer's
    post-RoPE queries and keys are recomputed from its input hidden states, and the softmax over [sinks + chunk +
    repeat keys up to the query] is written out explicitly, one query and one head at a time.
    """
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    attns = [layer.self_attn for layer in model.model.layers]
    H, H_kv, D = model.config.num_attention_heads, model.config.num_key_value_heads, attns[0].head_dim
    G, T = H // H_kv, len(ctx)
    scores = torch.zeros(len(attns), H_kv, T, dtype=torch.float64)
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        if s == 0:
            head = enc(FIRST)
        else:
            previous = ctx[s - chunk_size:s]
            head = enc(LATER) + (previous[max(len(previous) - prev, 0):] if prev else [])
        rep = head + enc(TINY_POSTFIX) + ctx[s:e]
        captured = {}

        def hook(mod, args, kwargs, output, i):
            captured[i] = (kwargs["hidden_states"], kwargs["position_embeddings"])

        handles = [a.register_forward_hook(lambda m, a_, k, o, i=i: hook(m, a_, k, o, i), with_kwargs=True)
                   for i, a in enumerate(attns)]
        with torch.no_grad():
            model(input_ids=torch.tensor([ctx + rep]), use_cache=False)
        for h in handles:
            h.remove()
        sinks = list(range(min(n_sink, s)))
        chunk = list(range(s, e))
        for i, attn in enumerate(attns):
            hidden, (cos, sin) = captured[i]
            with torch.no_grad():
                q = attn.q_proj(hidden).view(1, -1, H, D).transpose(1, 2)
                k = attn.k_proj(hidden).view(1, -1, H_kv, D).transpose(1, 2)
                if hasattr(attn, "q_norm"):  # qwen3, gemma3: RMSNorm over D before RoPE
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
            q, k = q[0].double(), k[0].repeat_interleave(G, dim=0).double()  # (H, T + Q, D) both
            for j in range(len(rep)):  # one repeat query at a time, all query heads at once
                cand = sinks + chunk + [T + m for m in range(j + 1)]
                logits = torch.einsum("hd,hnd->hn", q[:, T + j], k[:, cand]) * attn.scaling  # gemma3: not D**-0.5
                p = torch.exp(logits - logits.amax(-1, keepdim=True))
                p = p / p.sum(-1, keepdim=True)  # (H, |cand|)
                col = p[:, len(sinks):len(sinks) + len(chunk)].view(H_kv, G, -1).amax(1)  # max over the group
                scores[i, :, s:e] = torch.maximum(scores[i, :, s:e], col)
    scores[:, :, :n_sink] = 1.0
    return scores.float()


def test_templates_and_repeat_inputs(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    scorer = KVzipScorer(tok, context_chunk=16, prev_postfix_size=8)
    assert scorer.templates(tok) == (enc(FIRST), enc(LATER), enc(TINY_POSTFIX))
    ctx = list(range(10, 50))  # 40 tokens -> chunks [0,16) [16,32) [32,40)
    reps = scorer.repeat_inputs(ctx)
    assert [(s, e) for s, e, _ in reps] == [(0, 16), (16, 32), (32, 40)]
    assert reps[0][2] == enc(FIRST) + enc(TINY_POSTFIX) + ctx[:16]
    assert reps[1][2] == enc(LATER) + ctx[8:16] + enc(TINY_POSTFIX) + ctx[16:32]
    assert reps[2][2] == enc(LATER) + ctx[24:32] + enc(TINY_POSTFIX) + ctx[32:]
    # no chat template, or not asked to use it: plain "\n" closes the prompt (kvpress's fallback)
    plain = KVzipScorer(tok, use_chat_template=False)
    assert plain.templates(tok)[2] == enc("\n")
    assert KVzipScorer(tok, prev_postfix_size=0, context_chunk=16).repeat_inputs(ctx)[1][2] == \
        enc(LATER) + enc(TINY_POSTFIX) + ctx[16:32]
    # chunks shorter than prev_postfix_size are quoted whole
    short = KVzipScorer(tok, context_chunk=3, prev_postfix_size=8).repeat_inputs(ctx[:7])
    assert [rep for _, _, rep in short] == [enc(FIRST) + enc(TINY_POSTFIX) + ctx[:3],
                                            enc(LATER) + ctx[:3] + enc(TINY_POSTFIX) + ctx[3:6],
                                            enc(LATER) + ctx[3:6] + enc(TINY_POSTFIX) + ctx[6:7]]


@pytest.mark.parametrize("family,chunk_size,block", [("llama", 16, 128), ("llama", 64, 128), ("llama", 64, 5),
                                                     ("qwen3", 16, 128), ("gemma3", 16, 128), ("gemma3", 16, 4)])
def test_scores_equal_naive_reference(tok, family, chunk_size, block, monkeypatch):
    """gemma3: T = 40 > the sliding window (16), so the repeat forward must see the sliding layers' windows right.
    ``block``: repeat queries per softmax block (small ones split every repeat forward into several blocks)."""
    monkeypatch.setattr(kvzip_module, "_QUERY_BLOCK", block)
    model = tiny_model(family)
    inputs = random_prompt(1, 40, seed=1)
    layers = full_attention_layers(model)
    got = kvzip_scores(model, **inputs, tokenizer=tok, context_chunk=chunk_size)[layers, 0]  # (L_full, H_kv, T)
    ref = naive_kvzip(model, inputs["input_ids"][0].tolist(), tok, chunk_size, 8, 4)[layers]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert float(got.min()) > 0 and float(got.max()) <= 1.0


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(T=17, chunk_size=3, prev=8, n_sink=5, seed=1)  # fewer sinks before chunk 1 than n_sink; carry > chunk
@given(T=st.integers(5, 30), chunk_size=st.integers(3, 20), prev=st.integers(0, 9), n_sink=st.integers(0, 6),
       seed=st.integers(0, 100))
def test_scores_equal_naive_reference_any_chunking(llama, tok, T, chunk_size, prev, n_sink, seed):
    inputs = random_prompt(1, T, seed=seed)
    got = kvzip_scores(llama, **inputs, tokenizer=tok, context_chunk=chunk_size, prev_postfix_size=prev,
                       n_sink=n_sink)[:, 0]
    ref = naive_kvzip(llama, inputs["input_ids"][0].tolist(), tok, chunk_size, prev, n_sink)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_chunking_invariants(llama, tok):
    """What chunking may and may not change.

    * Any ``chunk_size >= T`` is the same single chunk: identical scores.
    * ``chunk_size < T`` changes the scores, legitimately: each chunk's softmax is over [sinks + that chunk + repeat],
      so a key competes with fewer context keys. Nor do chunk 0's columns equal a single-chunk run on the truncated
      context ``ctx[:C]``: the repeat tokens attend to the *whole* context inside the model, so truncating it changes
      their hidden states. The per-chunk maths (sets, carry-over, sinks) is pinned by the naive reference instead,
      for random chunk sizes; here only the [0, 1] range is checked.
    """
    inputs = random_prompt(1, 40, seed=2)
    one = kvzip_scores(llama, **inputs, tokenizer=tok, context_chunk=40)
    assert torch.equal(one, kvzip_scores(llama, **inputs, tokenizer=tok, context_chunk=10**6))
    small = kvzip_scores(llama, **inputs, tokenizer=tok, context_chunk=8)
    assert not torch.allclose(one, small)
    assert float(small.min()) >= 0 and float(small.max()) <= 1


@pytest.mark.parametrize("family,block", [("llama", 128), ("gemma3", 128), ("llama", 6)])
def test_left_padded_batch_equals_rows_alone(tok, family, block, monkeypatch):
    monkeypatch.setattr(kvzip_module, "_QUERY_BLOCK", block)
    model = tiny_model(family)
    # a non-zero embedding for the pad id (zero at init): padding repeat queries would win some maxima if they voted
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[tok.pad_token_id] = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    lengths = [40, 23]  # chunk 16: 3 and 2 chunks (the second row is absent from the last forward)
    batch = random_prompt(2, 40, lengths=lengths, seed=3)
    got = kvzip_scores(model, **batch, tokenizer=tok, context_chunk=16)
    assert got.shape == (model.config.num_hidden_layers, 2, model.config.num_key_value_heads, 40)
    for b, n in enumerate(lengths):
        alone = {k: v[b:b + 1, -n:] for k, v in batch.items()}
        ref = kvzip_scores(model, **alone, tokenizer=tok, context_chunk=16)
        torch.testing.assert_close(got[:, b, :, 40 - n:], ref[:, 0], rtol=0, atol=1e-5)
        assert torch.all(got[:, b, :, :40 - n] == 0)  # padding scores 0


def test_sinks_score_one_and_sliding_layers_are_zero(tok):
    model = tiny_model("gemma3", num_hidden_layers=6)
    layers = full_attention_layers(model)
    assert layers == [2, 5]
    s = kvzip_scores(model, **random_prompt(1, 30, seed=4), tokenizer=tok, context_chunk=12)
    assert torch.all(s[layers][..., :4] == 1.0)
    assert torch.all(s[layers][..., 4:] < 1.0)
    assert torch.all(s[[0, 1, 3, 4]] == 0)
    assert torch.all(kvzip_scores(model, **random_prompt(1, 30, seed=4), tokenizer=tok, n_sink=0)[layers] < 1.0)


def test_dtype_option(llama, tok):
    inputs = random_prompt(1, 30, seed=5)
    ref = kvzip_scores(llama, **inputs, tokenizer=tok, context_chunk=12)
    torch.testing.assert_close(kvzip_scores(llama, **inputs, tokenizer=tok, context_chunk=12, dtype=torch.float64),
                               ref, rtol=0, atol=1e-6)
    half = kvzip_scores(llama, **inputs, tokenizer=tok, context_chunk=12, dtype=torch.bfloat16)
    torch.testing.assert_close(half, ref, rtol=0, atol=2e-2)


# 4 gemma3 layers: [sliding, sliding, full, sliding]: the last layer runs after the scorer is called
@pytest.mark.parametrize("family,layers", [("llama", 3), ("gemma3", 3), ("gemma3", 4)])
def test_generate_compacts_and_never_keeps_repeat_tokens(tok, family, layers):
    model = tiny_model(family, num_hidden_layers=layers)
    N, rho = 40, 0.3
    inputs = random_prompt(1, N, seed=6)
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    full = model.generate(**inputs, **with_cache(DynamicCache(config=model.config)), **kw)
    cache = ProxyKVCache(KVzipScorer(tok, context_chunk=16), keep_ratio=rho, budget="uniform")
    out = model.generate(**inputs, **with_cache(cache), **kw)
    # the first token comes from the full prefill, untouched by the nested repeat forwards
    torch.testing.assert_close(out.logits[0], full.logits[0], rtol=0, atol=0)
    t = out.sequences.shape[1] - N - 1
    K = math.ceil(rho * N)
    ref_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**inputs, **with_cache(ref_cache))
    scores = kvzip_scores(model, **inputs, tokenizer=tok, context_chunk=16)
    compacted = cache.compactable_layers()
    assert compacted == full_attention_layers(model)
    for i in compacted:
        layer = cache.layers[i]
        assert isinstance(layer, ProxyKVLayer)
        assert layer.keys.shape[-2] == K + t
        assert cache.get_seq_length(i) == N + t
        kept = layer.kept_positions
        assert torch.all(kept[..., :4] == torch.arange(4))  # sinks always kept
        # the kept entries are the top-K of the functional scores, and hold the prefill's K/V (no repeat tokens)
        idx, _ = select_topk(scores[i], rho, n_sink=4)
        assert torch.equal(kept, idx)
        gather = kept[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        torch.testing.assert_close(layer.keys[:, :, :K], ref_cache.layers[i].keys.gather(2, gather), rtol=0, atol=0)
    assert cache.get_seq_length() == N + t


def test_generate_padded_batch(tok):
    model = tiny_model("llama")
    batch = random_prompt(2, 36, lengths=[36, 25], seed=7)
    cache = ProxyKVCache(KVzipScorer(tok, context_chunk=16), keep_ratio=0.3, budget="uniform")
    out = model.generate(**batch, **with_cache(cache), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 39)
    assert cache.layers[0].keys.shape[-2] == math.ceil(0.3 * 36) + 2
    scores = kvzip_scores(model, **batch, tokenizer=tok, context_chunk=16)
    idx, _ = select_topk(scores[0], 0.3, batch["attention_mask"].bool(), n_sink=4)
    assert torch.equal(cache.layers[0].kept_positions, idx)


def test_tokenizer_from_model_path(tmp_path, tok, llama):
    tok.save_pretrained(tmp_path)
    model = tiny_model("llama")
    model.config._name_or_path = str(tmp_path)
    inputs = random_prompt(1, 30, seed=8)
    cache = ProxyKVCache(KVzipScorer(context_chunk=16), keep_ratio=0.5, budget="uniform")
    with torch.no_grad():
        model(**inputs, **with_cache(cache))
    assert cache.layers[0].keys.shape[-2] == 15
    torch.testing.assert_close(
        kvzip_scores(model, **inputs, context_chunk=16), kvzip_scores(llama, **inputs, tokenizer=tok, context_chunk=16))


@pytest.mark.parametrize("kwargs,match", [
    (dict(context_chunk=0), "context_chunk"), (dict(context_chunk=2.5), "context_chunk"),
    (dict(prev_postfix_size=-1), "prev_postfix_size"), (dict(n_sink=-1), "n_sink"), (dict(n_sink=True), "n_sink"),
    (dict(use_chat_template="yes"), "use_chat_template"), (dict(dtype=torch.int64), "dtype"),
    (dict(dtype="float32"), "dtype"),
])
def test_bad_arguments(tok, kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVzipScorer(tok, **kwargs)


def test_bad_inputs(tok, llama):
    with pytest.raises(ValueError, match="tokenizer"):
        KVzipScorer("not a tokenizer")
    inputs = random_prompt(1, 20, seed=9)
    with pytest.raises(ValueError, match="KVzipScorer\\(tokenizer\\)"):  # no tokenizer, no name_or_path
        with torch.no_grad():
            llama(**inputs, **with_cache(ProxyKVCache(KVzipScorer(), keep_ratio=0.5)))
    with pytest.raises(ValueError, match="KVzipScorer\\(tokenizer\\)"):
        kvzip_scores(llama, **inputs)
    right = random_prompt(2, 20, seed=9)
    right["attention_mask"][1, -3:] = 0
    with pytest.raises(ValueError, match="left padding"):
        kvzip_scores(llama, **right, tokenizer=tok)
    empty = random_prompt(2, 20, seed=9)
    empty["attention_mask"][1] = 0
    with pytest.raises(ValueError, match="all padding"):
        kvzip_scores(llama, **empty, tokenizer=tok)
    with pytest.raises(ValueError, match="input_ids"):  # needs ids: embeddings alone are refused by the cache
        ProxyKVCache(KVzipScorer(tok), keep_ratio=0.5).prepare(llama, inputs_embeds_shape=(1, 20))


@pytest.mark.parametrize("lengths", [None, [40, 30]])
def test_unpadded_repeat_attention_is_said_causal(tok, lengths, monkeypatch):
    """Without padding, every scored layer's repeat attention goes to sdpa as a lower-right causal bias (a flash
    kernel may run it on CUDA), with padding as the materialised mask; the scores equal the materialised mask's."""
    from torch.nn.attention.bias import CausalBias

    model = tiny_model("llama")
    inputs = random_prompt(2, 40, lengths=lengths, seed=3)
    handed = []
    real = kvzip_module._LayerCall.before

    def spy(self, module, mask, query, key):
        out = real(self, module, mask, query, key)
        handed.append(type(out).__name__)
        if isinstance(out, CausalBias):  # lower-right: the last query sees every key
            assert (out.seq_len_q, out.seq_len_kv) == (query.shape[2], key.shape[2])
            assert torch.equal(out._materialize(), mask[0, 0]) and bool((mask == mask[:1]).all())  # every row
        return out

    monkeypatch.setattr(kvzip_module._LayerCall, "before", spy)
    got = kvzip_scores(model, **inputs, tokenizer=tok, context_chunk=16)
    L = model.config.num_hidden_layers  # three rounds of chunks of 16 over 40 tokens, every layer
    # padded: rounds 0 and 1 include the 30-token row (left padded), round 2 holds the 40-token row alone
    assert handed == ["CausalBias"] * 3 * L if lengths is None else ["Tensor"] * 2 * L + ["CausalBias"] * L
    monkeypatch.setattr(kvzip_module._LayerCall, "before", lambda self, module, mask, query, key: mask)
    dense = kvzip_scores(model, **inputs, tokenizer=tok, context_chunk=16)
    torch.testing.assert_close(got, dense, rtol=0, atol=1e-6)


FUSED_CASES = [  # R, H, H_kv, T, Q, D, n_sink, chunk start, chunk length, padded repeat queries in the last row
    (1, 4, 2, 50, 30, 32, 4, 16, 16, 0),
    (2, 4, 1, 70, 45, 16, 3, 40, 25, 5),
    (1, 2, 2, 20, 12, 64, 0, 0, 8, 0),
    (1, 8, 2, 300, 170, 64, 4, 128, 150, 0),  # several key and query tiles of the default 128
]


def compare_fused_scores(device: str, dtype: torch.dtype, atol: float) -> None:
    """A chunk's scores through the fused kernels equal the PyTorch blocks' (GQA, sinks, padded repeat queries)."""
    torch.manual_seed(0)
    for R, H, H_kv, T, Q, D, n_sink, start, length, padded in FUSED_CASES:
        rep_valid = torch.ones(R, Q, dtype=torch.bool, device=device)
        rep_valid[-1, Q - padded:] = False
        record = kvzip_module._ChunkRecorder(
            T=T, n_sink=n_sink, pad=torch.zeros(R, dtype=torch.long, device=device),
            starts=torch.full((R,), start, device=device), lengths=torch.full((R,), length, device=device),
            rep_valid=rep_valid, dtype=torch.float32)
        assert record.fusable and kvzip_module.kernels.available(torch.empty(0, device=device))
        q = torch.randn(R, H, Q, D, device=device).to(dtype)
        k = torch.randn(R, H_kv, T + Q, D, device=device).to(dtype)
        fused = record.score(q, k, D**-0.5)
        record.fusable = False
        reference = record.score(q, k, D**-0.5)
        assert fused.shape == reference.shape == (R, H_kv, length) and fused.dtype == torch.float32
        torch.testing.assert_close(fused, reference, rtol=1e-3, atol=atol)
        assert float(reference.amax()) > 0.05  # not all (near) zero


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4)])
def test_gpu_fused_scores_equal_the_reference(dtype, atol):
    compare_fused_scores("cuda", dtype, atol)


def test_fused_scores_only_where_they_are_exact(tok):
    """A softmax in another dtype, or context columns past a short chunk (padded batches), keep the PyTorch path."""
    def record(dtype, lengths):
        return kvzip_module._ChunkRecorder(T=40, n_sink=2, pad=torch.zeros(2, dtype=torch.long),
                                           starts=torch.tensor([8, 8]), lengths=torch.tensor(lengths),
                                           rep_valid=torch.ones(2, 30, dtype=torch.bool), dtype=dtype)

    assert record(torch.float32, [16, 16]).fusable
    assert not record(torch.bfloat16, [16, 16]).fusable
    assert not record(torch.float32, [16, 10]).fusable


@pytest.mark.smollm
def test_bundled_model_finds_its_own_tokenizer(smollm):
    """The bundled SmolLM2's config names it "smollm2-135m-instruct": KVzipScorer() resolves that to the converted
    directory's tokenizer, offline, and scores as with the tokenizer passed."""
    model, tok = smollm
    assert model.config.name_or_path == "smollm2-135m-instruct"
    ids = torch.tensor([tok.encode("The sky is blue. The grass is green. Roses are red. " * 2)])
    own = kvzip_scores(model, ids, context_chunk=64)
    torch.testing.assert_close(own, kvzip_scores(model, ids, tokenizer=tok, context_chunk=64))
