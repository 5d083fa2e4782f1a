"""The FLOP counts of proxykv_hf.bench.flop_model against torch's own FlopCounterMode and transformers' own masks."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from proxykv_hf.attention.compat import with_cache
from proxykv_hf.bench.flop_model import (causal_pairs, decoder_flops, kvzip_flops, kvzip_prefill_flops,
                                         kvzip_template_tokens, mapper_flops, prefill_flops, snapkv_flops)
from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
from proxykv_hf.mapper.proxy import decoder_of, layer_subset
from proxykv_hf.testing import FAMILIES, tiny_config, tiny_model

# head_dim 24 is not hidden / heads (8), 3 KV heads for 6 query heads, an MLP 3x wide: a formula that mixes up any two
# of these sizes gives another count
SHAPE = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=24, intermediate_size=3 * 48)


def _counted(module, fn) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        fn(module)
    return counter.get_total_flops()


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_flops_equal_torch_counter(family):
    model = tiny_model(family, attn_implementation="eager", **SHAPE)
    n = 37
    ids = torch.randint(5, 100, (1, n))
    counted = _counted(decoder_of(model), lambda d: d(input_ids=ids))
    ours = decoder_flops(model.config, n, causal=False)  # the counter counts attention dense
    assert ours["linear"] + ours["attention"] == counted
    assert ours["attention"] == 2 * ours["qk"]
    subset = [0, 2]
    counted = _counted(layer_subset(model, subset), lambda d: d(input_ids=ids))
    ours = decoder_flops(model.config, n, layers=subset, causal=False)
    assert ours["linear"] + ours["attention"] == counted


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_causal_pairs_are_the_keys_transformers_lets_each_query_see(family):
    """Count the non-zero attention probabilities of an eager prefill: the causal triangle, or for Gemma3's
    sliding layers (window 16) the band, per head."""
    model = tiny_model(family, attn_implementation="eager", **SHAPE)
    n = 41
    with torch.no_grad():
        out = model(input_ids=torch.randint(5, 100, (1, n)), output_attentions=True)
    per_layer = [int((a > 0).sum()) // a.shape[1] for a in out.attentions]
    dense = decoder_flops(model.config, n, causal=False)["qk"]
    ours = decoder_flops(model.config, n)["qk"]
    heads, head_dim = SHAPE["num_attention_heads"], SHAPE["head_dim"]
    assert ours == 2 * heads * head_dim * sum(per_layer)
    if family == "gemma3":
        assert per_layer[0] == causal_pairs(n, 16) < causal_pairs(n) == per_layer[2]
    else:
        assert 2 * ours == dense + 2 * heads * head_dim * n * len(per_layer)  # the triangle and its diagonal


def test_causal_pairs_by_brute_force():
    for n in (1, 5, 16, 17, 40):
        for window in (None, 1, 4, 16, 64):
            brute = sum(min(q + 1, window or n) for q in range(n))
            assert causal_pairs(n, window) == brute


@pytest.mark.parametrize("overrides", [{}, dict(direct_path=True),
                                       dict(num_statistics=2, input_transform="log1p,log", num_target_layers=3)])
@pytest.mark.parametrize("n", [50, 64, 200])
def test_mapper_flops_equal_torch_counter(overrides, n):
    """One window (50), exactly one (64 = crop_len) and overlapping windows (200), with and without the direct
    path."""
    cfg = MapperConfig.tiny(**overrides)
    mapper = HybridAxialMapper(cfg).eval()
    x = torch.rand(1, cfg.num_proxy_layers, cfg.num_features, n)
    assert mapper_flops(cfg, n) == _counted(mapper, lambda m: m(x))


def test_prefill_flops_parts():
    target = tiny_config("llama", num_hidden_layers=4, **SHAPE)
    proxy = tiny_config("llama", num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    mapper = MapperConfig.tiny(num_proxy_layers=2, num_proxy_heads=2, num_target_layers=4, num_target_heads=3)
    n = 300
    full = prefill_flops(target, n)
    whole = decoder_flops(target, n)
    assert full == {"target": whole["linear"] + whole["attention"], "proxy": 0, "statistics": 0, "mapper": 0,
                    "total": whole["linear"] + whole["attention"]}
    small = decoder_flops(proxy, n)
    for passes in (1, 2):
        got = prefill_flops(target, n, proxy_kind="model", proxy_config=proxy, mapper_config=mapper,
                            statistics_passes=passes)
        assert got["proxy"] == small["linear"] + small["attention"]
        assert got["statistics"] == passes * small["qk"]
        assert got["mapper"] == mapper_flops(mapper, n)
        assert got["total"] == full["target"] + got["proxy"] + got["statistics"] + got["mapper"]
    self_mapper = MapperConfig.tiny(num_proxy_layers=4, num_proxy_heads=6, num_target_layers=4, num_target_heads=3)
    own = prefill_flops(target, n, proxy_kind="self", mapper_config=self_mapper)
    assert own["proxy"] == 0 and own["statistics"] == whole["qk"]  # scored inside the target's own prefill
    layers = prefill_flops(target, n, proxy_kind="layers", proxy_layers=[1, 3], mapper_config=mapper)
    sub = decoder_flops(target, n, layers=[1, 3])
    assert layers["proxy"] == sub["linear"] + sub["attention"] == (whole["linear"] + whole["attention"]) // 2


def test_flops_reject_what_they_cannot_count():
    target = tiny_config("llama")
    with pytest.raises(ValueError, match="mapper"):
        prefill_flops(target, 10, proxy_kind="self")
    with pytest.raises(ValueError, match="proxy's config"):
        prefill_flops(target, 10, proxy_kind="model", mapper_config=MapperConfig.tiny())
    with pytest.raises(ValueError, match="proxy_kind"):
        prefill_flops(target, 10, proxy_kind="oracle", mapper_config=MapperConfig.tiny())
    with pytest.raises(ValueError, match="n must be"):
        decoder_flops(target, 0)
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="gated-MLP"):
        decoder_flops(GPT2Config(), 10)


def _kvzip_setup(chunk_size):
    from proxykv_hf.scorers.kvzip import KVzipScorer
    from proxykv_hf.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    return tok, kvzip_template_tokens(KVzipScorer(tok, context_chunk=chunk_size))


@pytest.mark.parametrize("n, chunk_size", [(33, 2048), (70, 32), (100, 40)])
def test_kvzip_flops_equal_torch_counter(n, chunk_size):
    """KVzip's prefill, repeat forwards (one chunk, several, a short last one) and scoring, as counted by torch."""
    from proxykv_hf.scorers.kvzip import kvzip_scores

    model = tiny_model("llama", attn_implementation="eager", **SHAPE)
    tok, (first, later) = _kvzip_setup(chunk_size)
    ids = torch.randint(5, 100, (1, n))
    counted = _counted(model, lambda m: kvzip_scores(m, ids, tokenizer=tok, context_chunk=chunk_size))
    prefill = decoder_flops(model.config, n, causal=False)
    ours = kvzip_flops(model.config, n, first_extra=first, later_extra=later, context_chunk=chunk_size, causal=False)
    assert prefill["linear"] + prefill["attention"] + ours["repeat"] + ours["scoring"] == counted
    causal = kvzip_flops(model.config, n, first_extra=first, later_extra=later, context_chunk=chunk_size)
    assert causal["scoring"] == ours["scoring"] and causal["repeat"] < ours["repeat"]


def test_kvzip_iam_flops_on_a_layer_subset_equal_torch_counter():
    """KVzip+IAM runs KVzip on every third layer of the target: its proxy prefill and KVzip, layers [2, 3]... as
    counted by torch."""
    from proxykv_hf.scorers.iam import KVzipIAMScorer

    model = tiny_model("llama", attn_implementation="eager", num_hidden_layers=5, **SHAPE)
    n, chunk_size = 60, 32
    tok, (first, later) = _kvzip_setup(chunk_size)
    scorer = KVzipIAMScorer(tok, context_chunk=chunk_size)
    ids = torch.randint(5, 100, (1, n))
    counted = _counted(model, lambda m: scorer.proxy_scores(m, ids))
    layers = [2, 4]  # every third of five, and the last
    proxy = decoder_flops(model.config, n, layers=layers, causal=False)
    ours = kvzip_flops(model.config, n, first_extra=first, later_extra=later, context_chunk=chunk_size, causal=False,
                       layers=layers)
    assert proxy["linear"] + proxy["attention"] + ours["repeat"] + ours["scoring"] == counted
    # the whole KVzip+IAM prefill, the subset's config standing for the proxy's (as layer_subset builds it)
    sub = decoder_of(layer_subset(model, layers)).config
    whole = kvzip_prefill_flops(model.config, n, first_extra=first, later_extra=later, scored_config=sub,
                                context_chunk=chunk_size)
    target, proxy = decoder_flops(model.config, n), decoder_flops(model.config, n, layers=layers)
    causal = kvzip_flops(model.config, n, first_extra=first, later_extra=later, context_chunk=chunk_size, layers=layers)
    assert whole == {"target": target["linear"] + target["attention"], "proxy": proxy["linear"] + proxy["attention"],
                     **causal, "total": target["linear"] + target["attention"] + proxy["linear"]
                     + proxy["attention"] + causal["repeat"] + causal["scoring"]}


def test_snapkv_flops_equal_torch_counter():
    """A SnapKV prefill through the cache: the target's prefill and the window's attention sums, every layer."""
    from proxykv_hf.cache.proxykv_cache import ProxyKVCache
    from proxykv_hf.scorers import SnapKVScorer

    model = tiny_model("llama", attn_implementation="eager", **SHAPE)
    n = 100
    ids = torch.randint(5, 100, (1, n))

    def prefill(m):
        cache = ProxyKVCache(SnapKVScorer(window=16), keep_ratio=0.5).prepare(m, ids)
        m.model(input_ids=ids, **with_cache(cache), use_cache=True)

    counted = _counted(model, prefill)
    whole = decoder_flops(model.config, n, causal=False)
    assert whole["linear"] + whole["attention"] + snapkv_flops(model.config, n, 16, causal=False) == counted
    assert snapkv_flops(model.config, n, 16) < snapkv_flops(model.config, n, 16, causal=False)


def test_kvzip_flops_refuse_sliding_windows_and_the_table_marks_uncounted_rows():
    from proxykv_hf.bench.run import table

    with pytest.raises(ValueError, match="sliding-window"):
        kvzip_flops(tiny_config("gemma3"), 40, first_extra=3, later_extra=5)
    row = {"context": 8, "method": "x", "ttft_s": 1.0, "ttft_vs_full": 1.0, "peak_prefill_bytes": 0,
           "peak_vs_full": 1.0, "kv_bytes": 0}
    assert table([row]).splitlines()[2].split("|")[5].strip() == "-"
