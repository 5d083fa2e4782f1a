"""The fused attention-sum kernels equal the PyTorch reference (GPU, or Triton's interpreter on the CPU)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from proxykv_hf import kernels
from proxykv_hf.scoring import attention_sums

CASES = [  # B, H, H_kv, Q, T, D
    (1, 4, 2, 70, 70, 32),
    (2, 4, 1, 37, 90, 24),  # queries at the last Q positions, head dim padded to 32
    (1, 2, 2, 130, 130, 64),
]


def _compare(device, dtype, atol):
    torch.manual_seed(0)
    for B, H, H_kv, Q, T, D in CASES:
        q = torch.randn(B, H, Q, D, device=device).to(dtype)
        k = torch.randn(B, H_kv, T, D, device=device).to(dtype)
        valid = torch.rand(B, Q, device=device) > 0.2
        ref = attention_sums(q, k, None, D**-0.5, query_valid=valid, backend="torch")
        got = kernels.causal_attention_sums(q, k, D**-0.5, valid, block_m=16, block_n=32)
        torch.testing.assert_close(got, ref, atol=atol, rtol=1e-3)
        grouped = attention_sums(q, k, None, D**-0.5, query_valid=valid, group_reduce="max", backend="triton")
        torch.testing.assert_close(grouped, ref.view(B, H_kv, H // H_kv, T).amax(2), atol=atol, rtol=1e-3)
        both_ref = attention_sums(q, k, None, D**-0.5, query_valid=valid, statistics=("max", "sum"), backend="torch")
        both = attention_sums(q, k, None, D**-0.5, query_valid=valid, statistics=("max", "sum"), backend="triton")
        torch.testing.assert_close(both, both_ref, atol=atol, rtol=1e-3)
        assert both_ref[:, :H].amax() > 0.05  # the maxima are not all zero


def test_backend_is_checked():
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="backend"):
        attention_sums(q, k, backend="cuda")
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="triton backend needs"):
        attention_sums(q, k, mask, backend="triton")  # an explicit mask is never fused


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed")
def test_interpreter_matches_reference():
    """Triton's CPU interpreter runs the same kernel code (it needs NumPy < 2.4: newer NumPy breaks its loops)."""
    import numpy

    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip("Triton's interpreter fails with NumPy >= 2.4")
    script = textwrap.dedent("""
        import torch, tests.test_kernels as t
        t._compare("cpu", torch.float32, 1e-4)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-3)])
def test_gpu_matches_reference(dtype, atol):
    _compare("cuda", dtype, atol)


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
