"""CUDA paths (skipped without a GPU): side-stream proxy scoring equals the CPU result; a proxy on another device;
mapper training under bf16 autocast."""

import math

import pytest
import torch

from proxykv_hf import ProxyKVCache, ProxyScorer
from proxykv_hf.attention.compat import with_cache
from proxykv_hf.eval.methods import RecordingCache
from proxykv_hf.mapper.hub import Checkpoint, TargetSpec, save_checkpoint
from proxykv_hf.mapper.model import HybridAxialMapper, MapperConfig
from proxykv_hf.mapper.proxy import ProxySpec
from proxykv_hf.testing import random_prompt, tiny_model

pytestmark = pytest.mark.gpu


def _checkpoint(tmp_path):
    spec = ProxySpec(kind="model", num_layers=2, num_heads=4, model_id="tiny-proxy")
    cfg = MapperConfig.tiny(num_proxy_layers=2, num_proxy_heads=4, num_target_layers=4, num_target_heads=2)
    torch.manual_seed(0)
    target = TargetSpec(model_id="t", model_type="llama", num_layers=4, num_kv_heads=2, num_heads=4)
    return save_checkpoint(Checkpoint(mapper=HybridAxialMapper(cfg).eval(), proxy=spec, target=target), tmp_path)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean share of the kept positions two selections `(B, H, K)` have in common."""
    same = [len(set(x.tolist()) & set(y.tolist())) / len(x) for x, y in zip(a.flatten(0, 1), b.flatten(0, 1))]
    return sum(same) / len(same)


@pytest.mark.parametrize("proxy_device", [None, "cpu", "cuda:1"])  # cpu: a proxy beside, not on, the GPU
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("overlap", [None, True])
def test_side_stream_matches_cpu(tmp_path, monkeypatch, proxy_device, padded, overlap):
    """The threaded side-stream path (fused attention sums when unpadded) selects what the CPU path selects."""
    if proxy_device == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the mapper's convolutions: full float32
    path = _checkpoint(tmp_path)
    inputs = random_prompt(2, 64, lengths=[64, 50] if padded else None)
    kept, scores = {}, {}
    for device, autocast in (("cpu", False), ("cuda", False), ("cuda", True)):
        target = tiny_model("llama", num_hidden_layers=4).to(device)
        proxy = tiny_model("llama", num_hidden_layers=2, seed=1).to(proxy_device or device)
        for record_only in (False, True):
            scorer = ProxyScorer.from_pretrained(path, proxy=proxy,
                                                 proxy_device=proxy_device if device == "cuda" else None)
            cache = RecordingCache(scorer) if record_only else ProxyKVCache(scorer, 0.3)
            cache.scorer.mapper_autocast, cache.scorer.overlap = autocast, overlap
            target.generate(**{k: v.to(device) for k, v in inputs.items()}, **with_cache(cache),
                            max_new_tokens=4, do_sample=False, pad_token_id=0)
            if record_only:
                scores[device, autocast] = [cache.scores[i].float().cpu() for i in sorted(cache.scores)]
            else:
                kept[device, autocast] = [layer.kept_positions.cpu() for layer in cache.layers]
                assert cache.physical_lengths() == [math.ceil(0.3 * 64) + 3] * 4
    for a, b, c in zip(scores["cpu", False], scores["cuda", False], scores["cuda", True]):
        scale = a[torch.isfinite(a)].abs().max()
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b)) and torch.equal(fin, torch.isfinite(c))  # padding: -inf alike
        torch.testing.assert_close(b[fin], a[fin], atol=1e-4 * scale, rtol=1e-4)
        torch.testing.assert_close(c[fin], a[fin], atol=5e-2 * scale, rtol=5e-2)  # bfloat16 mapper
    for a, b in zip(kept["cpu", False], kept["cuda", False]):
        assert _overlap(a, b) > 0.8  # equal scores up to float noise; a random tiny mapper has many near-ties


def test_train_bf16_autocast(tmp_path):
    """`proxykv train` on CUDA runs the mapper under bfloat16 autocast (the default) and learns: its loss falls and
    its validation metrics stay within noise of a float32 run of the same steps."""
    import json

    from proxykv_hf.cli import main
    from proxykv_hf.mapper.hub import load_checkpoint
    from proxykv_hf.train.evaluate import read_log

    data = tmp_path / "data"
    main(["build-data", "--tiny", "--tasks", "niah_single_1", "vt", "--n-per-task", "4", "--tokens",
          "300", "--crop-len", "64", "--stride", "32", "--out", str(data)])
    seen = []
    original = HybridAxialMapper.forward

    def spy(self, *args, **kwargs):
        if self.training:
            seen.append((torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
        return original(self, *args, **kwargs)

    HybridAxialMapper.forward = spy
    try:
        runs = {}
        for precision in ("bf16", "no"):
            out = tmp_path / precision
            main(["train", "--data", str(data), "--out", str(out), "--preset", "tiny", "--max-steps", "60",
                  "--epochs", "100", "--batch-size", "4", "--warmup-steps", "0", "--lr", "3e-3", "--log-every", "1",
                  "--no-progress", "--mixed-precision", precision])
            runs[precision] = (load_checkpoint(out), read_log(out / "log.jsonl"))
    finally:
        HybridAxialMapper.forward = original
    assert seen[0] == (True, torch.bfloat16) and seen[-1][0] is False  # bf16 run first, then the fp32 one
    for precision, (ckpt, log) in runs.items():
        assert ckpt.training["device"] == torch.cuda.get_device_name(0), json.dumps(ckpt.training)
        losses = [r["loss"] for r in log if r["kind"] == "step"]
        assert sum(losses[-10:]) / 10 < 0.85 * sum(losses[:10]) / 10, (precision, losses[:10], losses[-10:])
        assert next(ckpt.mapper.parameters()).dtype == torch.float32  # autocast: float32 master weights saved
    bf16, fp32 = runs["bf16"][0].metrics, runs["no"][0].metrics
    assert abs(bf16["topk_recall@0.3"] - fp32["topk_recall@0.3"]) < 0.1, (bf16, fp32)


def _kvzip_on(device: str, dtype: torch.dtype, lengths, dense: bool, monkeypatch) -> torch.Tensor:
    """KVzip scores of a tiny Llama on ``device``; ``dense``: the repeat attention with the materialised mask (as
    before the lower-right causal bias)."""
    from proxykv_hf.scorers import kvzip
    from proxykv_hf.testing import tiny_tokenizer

    with monkeypatch.context() as patch:
        if dense:
            patch.setattr(kvzip._LayerCall, "before", lambda self, module, mask, query, key: mask)
        model = tiny_model("llama", num_hidden_layers=3, dtype=dtype).to(device)
        inputs = random_prompt(2, 96, lengths=lengths, seed=5)
        return kvzip.kvzip_scores(model, **{k: v.to(device) for k, v in inputs.items()}, tokenizer=tiny_tokenizer(),
                                  context_chunk=40).cpu()


@pytest.mark.parametrize("lengths", [None, [96, 70]])
def test_kvzip_on_cuda_matches_cpu(monkeypatch, lengths):
    """KVzip on CUDA (its unpadded repeat attention through the lower-right causal bias, padded through the mask)
    gives the CPU's scores in float32, and in bfloat16 (where a flash kernel may take the bias) the scores of the
    materialised mask within bfloat16 noise, with the same kept sets almost everywhere."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cpu = _kvzip_on("cpu", torch.float32, lengths, False, monkeypatch)
    cuda = _kvzip_on("cuda", torch.float32, lengths, False, monkeypatch)
    torch.testing.assert_close(cuda, cpu, atol=1e-4, rtol=1e-3)
    bias = _kvzip_on("cuda", torch.bfloat16, lengths, False, monkeypatch)
    mask = _kvzip_on("cuda", torch.bfloat16, lengths, True, monkeypatch)
    torch.testing.assert_close(bias, mask, atol=3e-2, rtol=0)
    from proxykv_hf.cache.selection import select_topk

    for a, b in zip(bias, mask):  # per layer: (B, H_kv, T); row 0 is unpadded in both cases
        assert _overlap(select_topk(a[:1], 0.3)[0], select_topk(b[:1], 0.3)[0]) > 0.9


@pytest.mark.parametrize("padded", [False, True])
def test_global_budget_on_cuda_matches_cpu(padded):
    """The packed layout and its attention on CUDA: the same kept sets and tokens as on the CPU (KVzip scores)."""
    from proxykv_hf import KVzipScorer
    from proxykv_hf.testing import tiny_tokenizer

    inputs = random_prompt(2, 96, lengths=[96, 70] if padded else None, seed=3)
    runs = {}
    for device in ("cpu", "cuda"):
        model = tiny_model("llama", num_hidden_layers=4).to(device)
        cache = ProxyKVCache(KVzipScorer(tiny_tokenizer(), context_chunk=32), keep_ratio=0.3, budget="global")
        out = model.generate(**{k: v.to(device) for k, v in inputs.items()}, **with_cache(cache), max_new_tokens=6,
                             do_sample=False, pad_token_id=0)
        runs[device] = out.cpu(), cache.kept_sets(), cache.held_entries()
    (a, sets_a, n_a), (b, sets_b, n_b) = runs["cpu"], runs["cuda"]
    assert n_a == n_b and torch.equal(a, b)
    for i in sets_a:
        for row_a, row_b in zip(sets_a[i], sets_b[i]):
            assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(row_a, row_b))


def test_peak_memory_reads_against_live_memory():
    """A reference cycle freed during the measured block does not lower the peak: what the block itself allocates
    is counted in full."""
    from proxykv_hf.bench.run import PeakMemory

    class Cycle:
        def __init__(self):
            self.me, self.buf = self, torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    Cycle()  # unreachable, freed only by the collector
    with PeakMemory(torch.device("cuda")) as mem:
        import gc

        gc.collect()  # a collection during the run (a prefill's many allocations trigger them)
        held = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    assert mem.peak >= held.numel()
