"""ProxyKV's scorer end to end on tiny models: with a model, a layer-subset or a self proxy, a checkpoint's mapper
keeps the Top-K of its scores under ``generate`` (``ProxyKVCache.from_pretrained``); the errors of a proxy or target
that does not fit; statistics fused with the attention; the mapper's precision, compilation and side thread."""

import math

import pytest
import torch

from proxykv_hf import ProxyKVCache
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.mapper.hub import Checkpoint, load_checkpoint, save_checkpoint
from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig, TimeEncoder
from proxykv_hf.mapper.proxy import ProxySpec, proxy_features
from proxykv_hf.testing import random_prompt, tiny_checkpoint, tiny_model

TARGET_LAYERS = 4
FLOAT32 = {"mapper_autocast": False}  # compare kept sets with the float32 mapper's own scores, bit for bit


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", num_hidden_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def proxy():
    return tiny_model("llama", num_hidden_layers=2, seed=1)


def make_checkpoint(tmp_path, kind, name="ckpt"):
    """A random tiny checkpoint for ``target`` (:func:`proxykv_hf.testing.tiny_checkpoint`), saved to
    ``tmp_path / name``: ``(directory, checkpoint)``."""
    ckpt = tiny_checkpoint(kind, num_target_layers=TARGET_LAYERS)
    return save_checkpoint(ckpt, tmp_path / name), ckpt


@pytest.mark.parametrize("kind", ["model", "layers", "self"])
def test_one_liner_generate(tmp_path, target, proxy, kind):
    path, ckpt = make_checkpoint(tmp_path, kind)
    extra = {"proxy": proxy} if kind == "model" else {}
    inputs = random_prompt(2, 40, lengths=[40, 31], seed=0)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    # physical size after prefill (keep_ratio 1: the scorer contract, tests/test_scorer_contract.py)
    cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.3, **extra)
    out = target.generate(**inputs, **with_cache(cache), **kw)
    assert cache.physical_lengths() == [math.ceil(0.3 * 40) + 4] * TARGET_LAYERS
    assert cache.get_seq_length() == 44
    # the kept sets are the Top-K of the mapper's scores on the proxy features
    if kind != "self":
        runner = proxy if kind == "model" else target
        x = proxy_features(runner, inputs["input_ids"], inputs["attention_mask"], layers=ckpt.proxy.layers)
        scores = ckpt.mapper(x, attention_mask=inputs["attention_mask"])
        from proxykv_hf.cache.selection import select_topk

        for layer in range(TARGET_LAYERS):
            idx, _ = select_topk(scores[:, layer], 0.3, inputs["attention_mask"].bool(), n_sink=4)
            assert torch.equal(idx, cache.layers[layer].kept_positions)
    # a fresh cache from the template gives the same result
    assert torch.equal(out, target.generate(**inputs, **with_cache(cache.fresh()), **kw))


@pytest.mark.parametrize("kind", ["layers", "self"])
def test_direct_context_selects_the_topk_of_the_mapper_scores(tmp_path, target, kind):
    """A mapper whose direct path reads earlier proxy layers (direct_context) keeps the Top-K of the scores its
    all-layer forward gives, also for the self proxy, which hands it its layers one at a time; a fresh cache on a
    second prompt starts anew."""
    from proxykv_hf.cache.selection import select_topk

    _, ckpt = make_checkpoint(tmp_path, kind)
    cfg = ckpt.mapper.config
    torch.manual_seed(1)
    wide = HybridAxialMapper(MapperConfig.from_dict({**cfg.to_dict(), "direct_path": True,
                                                     "direct_context": 1})).eval()
    with torch.no_grad():
        wide.direct.weight.normal_(std=3.0)
    ckpt.mapper = wide
    path = save_checkpoint(ckpt, tmp_path / "context")
    assert load_checkpoint(path).mapper.config.direct_context == 1
    cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.5, **FLOAT32)
    for seed in (0, 1):
        inputs = random_prompt(2, 40, lengths=[40, 31], seed=seed)
        valid = inputs["attention_mask"].bool()
        x = proxy_features(target, inputs["input_ids"], inputs["attention_mask"], layers=ckpt.proxy.layers,
                           statistics=ckpt.proxy.statistics)
        scores = wide(x, attention_mask=inputs["attention_mask"])
        cache = cache.fresh()
        target.generate(**inputs, **with_cache(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
        for layer in range(TARGET_LAYERS):
            idx, _ = select_topk(scores[:, layer], 0.5, valid, n_sink=4)
            assert torch.equal(idx, cache.layers[layer].kept_positions), (seed, layer)


def test_clear_errors(tmp_path, target, proxy):
    path, _ = make_checkpoint(tmp_path, "model")
    # missing files
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="missing proxykv_config.json"):
        ProxyKVCache.from_pretrained(tmp_path / "empty")
    # proxy with another vocabulary (= another tokenizer)
    other = tiny_model("llama", num_hidden_layers=2, vocab_size=200)
    cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.3, proxy=other)
    prompt = random_prompt(1, 20)
    prompt["input_ids"][0, 5] = 250
    with pytest.raises(ValueError, match=r"share a tokenizer: token id \d+ is outside the proxy.s vocabulary \(200 rows"):
        target.generate(**prompt, **with_cache(cache), max_new_tokens=2, pad_token_id=0)
    # proxy with another shape than the mapper was trained on
    with pytest.raises(ValueError, match="mapper expects"):
        ProxyKVCache.from_pretrained(path, proxy=tiny_model("llama", num_hidden_layers=3))
    # target with other head counts
    wrong = tiny_model("llama", num_hidden_layers=TARGET_LAYERS, num_key_value_heads=1)
    cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.3, proxy=proxy)
    with pytest.raises(ValueError, match="1 KV heads"):
        wrong.generate(**random_prompt(1, 20), **with_cache(cache), max_new_tokens=2, pad_token_id=0)


@pytest.mark.parametrize("kind", ["self", "layers"])
def test_statistics_fused_with_the_attention_change_nothing(tmp_path, target, kind, monkeypatch):
    """Off the GPU, the proxy's statistics of an unpadded prefill come with the attention output from one softmax
    (scoring.causal_attention_with_statistics): same kept sets and tokens as sdpa followed by the statistics.
    Padded batches keep that path."""
    from proxykv_hf.mapper import proxy as proxy_module
    from proxykv_hf.cache import schedule as schedule_module

    path, ckpt = make_checkpoint(tmp_path, kind)
    calls, features = [], []
    for module in (schedule_module, proxy_module):
        real = module.causal_attention_with_statistics
        monkeypatch.setattr(module, "causal_attention_with_statistics",
                            lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    for name in ("forward", "forward_layer"):  # what the mapper reads
        real = getattr(HybridAxialMapper, name)
        monkeypatch.setattr(HybridAxialMapper, name, lambda self, x, *a, _real=real, **k:
                            features.append(x.clone()) or _real(self, x, *a, **k))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    for lengths, fused_calls in (([40, 40], ckpt.proxy.num_layers), ([40, 31], 0)):
        inputs = random_prompt(2, 40, lengths=lengths, seed=4)
        runs = {}
        for fuse in (False, True):
            calls.clear(), features.clear()
            cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.3, fuse_statistics=fuse)
            out = target.generate(**inputs, **with_cache(cache), **kw)
            runs[fuse] = out, [layer.kept_positions for layer in cache.layers], len(calls), list(features)
        assert runs[False][2] == 0 and runs[True][2] == fused_calls
        assert torch.equal(runs[False][0], runs[True][0])
        for a, b in zip(runs[False][1], runs[True][1]):
            assert torch.equal(a, b)
        assert len(runs[True][3]) == (1 if kind == "layers" else TARGET_LAYERS)
        for a, b in zip(runs[False][3], runs[True][3], strict=True):
            torch.testing.assert_close(a, b)


def test_mapper_precision_follows_the_device(tmp_path, target, monkeypatch):
    """The mapper runs under bfloat16 autocast where bfloat16 is fast (CUDA, a CPU with AVX512-BF16 or AMX) and in
    float32 elsewhere or with mapper_autocast=False; bfloat16 keeps nearly the same tokens as float32."""
    from proxykv_hf.scorers import proxy as proxy_scorers

    fast = proxy_scorers.bfloat16_is_fast
    assert fast(torch.device("cuda")) and not fast(torch.device("meta"))
    path, _ = make_checkpoint(tmp_path, "self")
    inputs = random_prompt(2, 200, lengths=[200, 150], seed=3)
    dtypes = []

    def kept(fast: bool, **extra) -> list[torch.Tensor]:
        monkeypatch.setattr(proxy_scorers, "bfloat16_is_fast", lambda device: fast)
        cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.3, **extra)
        real = cache.scorer.mapper.forward_layer
        monkeypatch.setattr(cache.scorer.mapper, "forward_layer",
                            lambda *a, **kw: dtypes.append(torch.get_autocast_dtype("cpu")
                                                           if torch.is_autocast_enabled("cpu") else None)
                            or real(*a, **kw))
        target.generate(**inputs, **with_cache(cache), max_new_tokens=1, do_sample=False, pad_token_id=0)
        return [cache.layers[i].kept_positions for i in range(TARGET_LAYERS)]

    full = kept(False)
    assert set(dtypes) == {None}
    assert all(torch.equal(a, b) for a, b in zip(full, kept(True, mapper_autocast=False)))
    assert set(dtypes) == {None}
    half = kept(True)
    assert set(dtypes[-TARGET_LAYERS:]) == {torch.bfloat16}
    same = sum(len(set(a[r, h].tolist()) & set(b[r, h].tolist())) for a, b in zip(full, half)
               for r in range(a.shape[0]) for h in range(a.shape[1]))
    total = sum(a.numel() for a in full)
    assert same / total > 0.75, same / total  # ~0.3 by chance; a random tiny mapper's scores are close together


def test_compile_mapper_compiles_the_encoder_forward_only(tmp_path):
    """``compile_mapper=True`` wraps the time encoder's forward in ``torch.compile`` (once, however many scorers
    share the checkpoint), leaves the state dict's keys alone, and refuses a non-bool."""
    from proxykv_hf.scorers.proxy import ProxyScorer

    _, ckpt = make_checkpoint(tmp_path, "self")
    keys = list(ckpt.mapper.state_dict())
    assert not hasattr(ProxyScorer(ckpt).mapper.time_encoder.forward, "_torchdynamo_orig_callable")
    compiled = ProxyScorer(ckpt, compile_mapper=True).mapper.time_encoder.forward
    assert hasattr(compiled, "_torchdynamo_orig_callable")
    assert ProxyScorer(ckpt, compile_mapper=True).mapper.time_encoder.forward is compiled  # not wrapped twice
    assert list(ckpt.mapper.state_dict()) == keys
    with pytest.raises(ValueError, match="compile_mapper must be a bool"):
        ProxyScorer(ckpt, compile_mapper="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_mapper_gives_the_same_logits():
    """On a GPU the compiled encoder's logits equal the eager ones (bfloat16 autocast, windows and layer batches)."""
    config = MapperConfig.tiny(num_proxy_layers=3, num_proxy_heads=4, num_target_layers=6, num_target_heads=2)
    mapper = HybridAxialMapper(config).cuda().eval()
    x = torch.rand(2, 3, 4, 300, device="cuda") * 3
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        eager = mapper(x).float()
        mapper.time_encoder.forward = torch.compile(mapper.time_encoder.forward)
        compiled = mapper(x).float()
    torch.testing.assert_close(compiled, eager, atol=3e-2, rtol=3e-2)


def test_side_work_runs_on_one_thread_for_the_process():
    """The worker that launches the proxies on CUDA lives as long as the process (what CUDA libraries keep per
    thread is built once), apart from the caller's thread."""
    import threading

    from proxykv_hf.scorers.proxy import side_worker

    first = side_worker().submit(threading.get_ident).result()
    assert side_worker() is side_worker()
    assert side_worker().submit(threading.get_ident).result() == first != threading.get_ident()


@pytest.mark.parametrize("lengths", [[40, 40], [40, 31]])
def test_self_proxy_on_a_layer_subset_reads_those_layers_alone(tmp_path, target, monkeypatch, lengths):
    """A self proxy whose mapper reads layers 0 and 2 of the four (ProxySpec.layers): the statistics are computed on
    those two layers only (fused with their attention, and the mapper run without a mask, on an unpadded batch),
    layers 1 and 3 take their paired layer's features, and every layer keeps the Top-K of the scores the mapper's
    all-layer forward gives on those two layers' features (the direct path reading one layer back)."""
    from proxykv_hf.cache import schedule as schedule_module
    from proxykv_hf import scorers
    from proxykv_hf.cache.selection import select_topk

    _, ckpt = make_checkpoint(tmp_path, "self")
    spec = ProxySpec(kind="self", num_layers=2, num_heads=4, layers=[0, 2])
    torch.manual_seed(2)
    cfg = MapperConfig.from_dict({**ckpt.mapper.config.to_dict(), "num_proxy_layers": 2, "direct_path": True,
                                  "direct_context": 1})
    mapper = HybridAxialMapper(cfg).eval()
    with torch.no_grad():
        mapper.direct.weight.normal_(std=3.0)
    path = save_checkpoint(Checkpoint(mapper=mapper, proxy=spec, target=ckpt.target), tmp_path / "half")
    fused, summed = [], []
    real_fused = schedule_module.causal_attention_with_statistics
    monkeypatch.setattr(schedule_module, "causal_attention_with_statistics",
                        lambda *a, **k: fused.append(1) or real_fused(*a, **k))
    real_sums = scorers.proxy.attention_sums
    monkeypatch.setattr(scorers.proxy, "attention_sums", lambda *a, **k: summed.append(1) or real_sums(*a, **k))
    masked, real_encode = [], TimeEncoder.encode_sdpa
    monkeypatch.setattr(TimeEncoder, "encode_sdpa", lambda self, z, pad=None: masked.append(pad is not None) or
                        real_encode(self, z, pad))
    inputs = random_prompt(2, 40, lengths=lengths, seed=5)
    cache = ProxyKVCache.from_pretrained(path, keep_ratio=0.5, **FLOAT32)
    target.generate(**inputs, **with_cache(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert (len(fused), len(summed)) == ((2, 0) if lengths[0] == lengths[1] else (0, 2))
    assert masked == [lengths[0] != lengths[1]] * 2  # the encoder's attention takes a mask only where there is padding
    x = proxy_features(target, inputs["input_ids"], inputs["attention_mask"], statistics_layers=[0, 2])
    assert x.shape[1] == 2
    scores = mapper(x, attention_mask=inputs["attention_mask"])
    valid = inputs["attention_mask"].bool()
    for layer in range(TARGET_LAYERS):
        idx, _ = select_topk(scores[:, layer], 0.5, valid, n_sink=4)
        assert torch.equal(idx, cache.layers[layer].kept_positions), layer
    assert cache.scorer.statistics_for(1) == () and cache.scorer.statistics_for(2) == ("sum",)


def test_self_proxy_layers_must_not_read_a_later_layer(tmp_path):
    """Each target layer is compacted right after its attention, so a self proxy's layer list must pair every
    target layer with itself or an earlier layer; a model proxy runs all its layers."""
    from proxykv_hf.mapper.proxy import check_self_layers

    assert check_self_layers([0, 2], 4) == [0, 2] and check_self_layers(None, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"target layers \[0, 2\] would read .* e.g. layers \[0, 2\]"):
        check_self_layers([1, 3], 4)
    with pytest.raises(ValueError, match="out of range"):
        check_self_layers([0, 4], 4)
    with pytest.raises(ValueError, match="increasing, distinct"):
        ProxySpec(kind="self", num_layers=2, num_heads=4, layers=[2, 0])
    with pytest.raises(ValueError, match="'model' proxy runs all its layers"):
        ProxySpec(kind="model", num_layers=2, num_heads=4, model_id="m", layers=[0, 1])
    _, ckpt = make_checkpoint(tmp_path, "self")
    cfg = MapperConfig.from_dict({**ckpt.mapper.config.to_dict(), "num_proxy_layers": 2})
    with pytest.raises(ValueError, match="would read the statistics of a later layer"):
        Checkpoint(mapper=HybridAxialMapper(cfg), proxy=ProxySpec(kind="self", num_layers=2, num_heads=4,
                                                                  layers=[1, 3]), target=ckpt.target)
    with pytest.raises(ValueError, match="without a layer list reads every target layer"):
        Checkpoint(mapper=HybridAxialMapper(cfg), proxy=ProxySpec(kind="self", num_layers=2, num_heads=4),
                   target=ckpt.target)


def test_proxy_statistic_scores_are_the_paired_proxy_layer_and_kv_group():
    from proxykv_hf.eval.methods import record_scores
    from proxykv_hf.mapper.proxy import proxy_features
    from proxykv_hf.scorers import ScorerContext, registry

    target = tiny_model("llama", num_hidden_layers=4)
    proxy = tiny_model("llama", num_hidden_layers=3, num_attention_heads=8, seed=1)
    scorer = registry.build("proxy_novelty", ScorerContext(model=target, proxy=proxy))
    ids = random_prompt(1, 50, seed=2)["input_ids"]
    got = record_scores(target, scorer, ids).scores
    x = proxy_features(proxy, ids, statistics=("lookback",))  # (1, 3 proxy layers, 8 heads, 50)
    for layer, proxy_layer in zip(range(4), [0, 1, 2, 2]):  # ceil(l * 3 / 4) for l = 1..4
        want = (1 - x[:, proxy_layer]).view(1, 2, 4, 50).amax(dim=2)  # target KV head h reads proxy KV group h
        torch.testing.assert_close(got[layer], want)


def test_proxy_statistic_needs_a_proxy_model():
    from proxykv_hf.scorers import ScorerContext, registry

    with pytest.raises(ValueError, match="proxy_sum.*--proxy-model"):
        registry.build("proxy_sum", ScorerContext(model=tiny_model("llama")))
