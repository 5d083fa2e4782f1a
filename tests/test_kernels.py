"""The fused attention-sum kernels equal the PyTorch reference (GPU, or Triton's interpreter on the CPU)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from proxykv_hf.attention import kernels, statistics as scoring
from proxykv_hf.attention.statistics import attention_sums, causal_attention_with_statistics

CASES = [  # B, H, H_kv, Q, T, D
    (1, 4, 2, 70, 70, 32),
    (2, 4, 1, 37, 90, 24),  # queries at the last Q positions, head dim padded to 32
    (1, 2, 2, 130, 130, 64),
    (1, 2, 1, 20, 100, 16),  # few queries at the end of a long prompt: most tiles need no mask
]
# query x key tiles: the two passes split each loop into the tiles on the causal diagonal (masked) and those that
# every row sees whole (unmasked); unequal tiles in both orders move that boundary
BLOCKS = [(16, 32), (32, 16), (16, 16)]


def _compare(device, dtype, atol):
    torch.manual_seed(0)
    for B, H, H_kv, Q, T, D in CASES:
        q = torch.randn(B, H, Q, D, device=device).to(dtype)
        k = torch.randn(B, H_kv, T, D, device=device).to(dtype)
        valid = torch.rand(B, Q, device=device) > 0.2
        ref = attention_sums(q, k, None, D**-0.5, query_valid=valid, backend="torch")
        peak = attention_sums(q, k, None, D**-0.5, query_valid=valid, statistics=("max",), backend="torch")
        for (block_m, block_n), tile_acc in zip(BLOCKS * 2, [False] * len(BLOCKS) + [True] * len(BLOCKS)):
            got, top = kernels.causal_attention_sums(q, k, D**-0.5, valid, block_m=block_m, block_n=block_n,
                                                     with_max=True, tile_acc=tile_acc)
            torch.testing.assert_close(got, ref, atol=atol, rtol=1e-3)
            torch.testing.assert_close(top, peak, atol=atol, rtol=1e-3)
            alone = kernels.causal_attention_sums(q, k, D**-0.5, valid, block_m=block_m, block_n=block_n,
                                                  tile_acc=tile_acc)
            torch.testing.assert_close(alone, ref, atol=atol, rtol=1e-3)
        grouped = attention_sums(q, k, None, D**-0.5, query_valid=valid, group_reduce="max", backend="triton")
        torch.testing.assert_close(grouped, ref.view(B, H_kv, H // H_kv, T).amax(2), atol=atol, rtol=1e-3)
        both_ref = attention_sums(q, k, None, D**-0.5, query_valid=valid, statistics=("max", "sum"), backend="torch")
        both = attention_sums(q, k, None, D**-0.5, query_valid=valid, statistics=("max", "sum"), backend="triton")
        torch.testing.assert_close(both, both_ref, atol=atol, rtol=1e-3)
        assert both_ref[:, :H].amax() > 0.05  # the maxima are not all zero


def _compare_flash(device, dtype, atol, kernel="flash"):
    """Flash attention's log-sum-exp in place of pass 1: output and statistics equal the PyTorch path's."""
    kernels.LSE_KERNEL = kernel  # (the callers restore it through monkeypatch)
    torch.manual_seed(0)
    for B, H, H_kv, _, N, D in CASES:
        q, k, v = (torch.randn(B, h, N, D, device=device).to(dtype) for h in (H, H_kv, H_kv))
        valid = torch.rand(B, N, device=device) > 0.2
        found = kernels.flash_attention_with_lse(q, k, v, D**-0.5)
        assert found is not None
        lse = found[1]
        fused = scoring.FusedStatistics()
        for statistics in (("sum",), ("max", "sum")):
            ref_out, ref = causal_attention_with_statistics(q, k, v, D**-0.5, query_valid=valid,
                                                            statistics=statistics, backend="torch")
            out, got = causal_attention_with_statistics(q, k, v, D**-0.5, query_valid=valid, statistics=statistics,
                                                        backend="triton", fused=fused)
            half = dtype != torch.float32  # outputs in 16 bits: a few units of their last place
            torch.testing.assert_close(out, ref_out, atol=2e-2 if half else atol, rtol=2e-2 if half else 1e-3)
            torch.testing.assert_close(got, ref, atol=atol, rtol=1e-3)
            assert fused.flash_lse is True  # the first call's check passed
        two_pass = kernels.causal_attention_sums(q, k, D**-0.5, valid, block_m=16, block_n=32)
        one_pass = kernels.causal_attention_sums(q, k, D**-0.5, valid, block_m=16, block_n=32, lse=lse)
        torch.testing.assert_close(one_pass, two_pass, atol=atol, rtol=1e-3)
        with pytest.raises(ValueError, match="lse must have shape"):
            kernels.causal_attention_sums(q, k, D**-0.5, lse=lse[:, :, 1:])


def test_backend_is_checked():
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="backend"):
        attention_sums(q, k, backend="cuda")
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="triton backend needs"):
        attention_sums(q, k, mask, backend="triton")  # an explicit mask is never fused


def _under_interpreter(args: list[str]) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` from the repository root with Triton's CPU interpreter on (it needs NumPy < 2.4: newer
    NumPy breaks its loops)."""
    import numpy

    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip("Triton's interpreter fails with NumPy >= 2.4")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, *args], env=env, cwd=root, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a new Python process under Triton's CPU interpreter
@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
def test_interpreter_matches_reference():
    """Triton's CPU interpreter runs the same kernel code (KVzip's fused scores too)."""
    script = textwrap.dedent("""
        import torch, tests.test_kernels as t
        t._compare("cpu", torch.float32, 1e-4)
        t._compare_flash("cpu", torch.float32, 1e-4)
        import tests.test_kvzip as z
        z.compare_fused_scores("cpu", torch.float32, 1e-5)
        print("ok")
    """)
    done = _under_interpreter(["-c", script])
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow  # pytest in a new Python process under Triton's CPU interpreter
@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
def test_interpreter_end_to_end():
    """With the fused kernels on (the GPU's path, here through the interpreter), ProxyKV with a self and a
    layer-subset proxy keeps the same sets, generates the same tokens and feeds the mapper the same features
    whether the statistics take sdpa + both passes or flash attention's log-sum-exp + pass 2."""
    done = _under_interpreter(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_proxy_scorer.py", "-k",
                               "fused_with_the_attention"])
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow  # pytest in a new Python process under Triton's CPU interpreter
@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
def test_interpreter_kvzip_end_to_end():
    """With the fused kernels on, KVzip's scores (its repeat queries' maxima from the kernels' second pass) still
    equal the by-hand reference, for any chunking, and a padded batch still equals its rows alone."""
    done = _under_interpreter(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kvzip.py", "-k",
                               "llama and scores_equal_naive_reference or any_chunking or rows_alone"])
    assert done.returncode == 0 and " passed" in done.stdout and "failed" not in done.stdout, \
        done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-3)])
def test_gpu_matches_reference(dtype, atol):
    _compare("cuda", dtype, atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-3)])
@pytest.mark.parametrize("kernel", kernels.LSE_KERNELS)
def test_gpu_flash_lse_matches_reference(dtype, atol, kernel, monkeypatch):
    """CUDA's flash attention (and cuDNN's) hands its log-sum-exp to pass 2 (GQA included), and the check accepts
    it."""
    monkeypatch.setattr(kernels, "LSE_KERNEL", kernels.LSE_KERNEL)
    _compare_flash("cuda", dtype, atol, kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_long_context_bf16():
    """A long causal prompt in bf16 at the default tiles: every column sums to what the reference gives."""
    torch.manual_seed(1)
    q = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16)
    ref = attention_sums(q, k, backend="torch")
    got = attention_sums(q, k)  # auto: the fused path on CUDA
    torch.testing.assert_close(got, ref, atol=5e-3, rtol=2e-3)
    assert abs(got.sum().item() - 8 * 4096) < 1.0  # each query's probabilities sum to one


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("dtype,head_dim", [("bf16", 64), ("bf16", 128), ("fp32", 64)])
def test_kernels_compile_for_an_h100(dtype, head_dim):
    """Both passes compile to an sm_90 binary (Triton's ahead-of-time compile, no GPU needed): what the
    interpreter cannot show, since it never lowers the kernels."""
    import shutil

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not (os.path.exists(ptxas) or shutil.which("ptxas")):
        pytest.skip("no ptxas")
    ints = dict.fromkeys(["sqb", "sqh", "sqm", "skb", "skh", "skn", "H", "G", "Q_LEN", "T", "OFFSET"], "i32")
    tiles = kernels.default_tiles(head_dim)  # the shipped tiles of this head dimension
    shape = dict(D=head_dim, D_PAD=head_dim, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], IEEE=dtype == "fp32")
    rows = dict(Q=f"*{dtype}", K=f"*{dtype}", LSE="*fp32", **ints, scale_log2="fp32")
    columns = dict(Q=f"*{dtype}", K=f"*{dtype}", LSE="*fp32", VALID="*fp32", OUT="*fp32", OUT_MAX="*fp32", **ints,
                   scale_log2="fp32")
    builds = [(kernels._row_lse_kernel, rows, shape)]
    builds += [(kernels._column_sum_kernel, columns, dict(shape, HAS_VALID=valid, HAS_MAX=peak, TILE_ACC=acc))
               for valid in (False, True) for peak in (False, True) for acc in (False, True)]
    for fn, signature, constexprs in builds:
        signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        done = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
        assert done.asm["cubin"]  # lowered through PTX to an sm_90 binary
