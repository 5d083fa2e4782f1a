"""Fused attention column sums on the GPU (Triton), the fast path of
:func:`proxykv_hf.attention.statistics.attention_sums`.

``X[b, h, n] = sum_q softmax(Q K^T * scaling)[b, h, q, n]`` under a causal mask, without ever writing the
probabilities to memory. Two passes, each a tiled ``Q K^T`` on the tensor cores with float32 accumulation:

1. per query row, the log-sum-exp of its logits over the keys it sees (an online max / sum, as in
   flash-attention's forward, without the values);
2. per key tile, a loop over the query tiles that see it: ``exp(logit - lse)`` summed over the queries (and, on
   request, its maximum over the queries other than the key's own position: the ``"max"`` statistic).

Memory beyond the inputs is the ``(B, H, Q)`` log-sum-exp and the ``(B, H, T)`` output. Where the layer's own
attention ran through flash attention, that call already computed each row's log-sum-exp
(:func:`flash_attention_with_lse`); handing it over (``lse=``) skips pass 1. The PyTorch path in
:mod:`proxykv_hf.attention.statistics` stays the reference: ``tests/test_kernels.py`` checks the two agree (on a GPU,
and on the CPU through Triton's interpreter when Triton is installed).

Supported: the causal case with no explicit mask (what transformers hands an sdpa attention function for an
unpadded prompt), queries at the last ``Q`` of ``T`` key positions, GQA, optional per-query validity, any head
dimension up to 256. Anything else (padded batches, sliding windows, custom masks) takes the PyTorch path.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs go without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

_LOG2E = 1.4426950408889634


def available(query: torch.Tensor) -> bool:
    """True where the fused kernels can run on ``query``'s device (CUDA + Triton, or Triton's interpreter)."""
    if triton is None or query.shape[-1] > 256:
        return False
    return query.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _tile(PTR, base, offs, n, stride, offs_d, d_ok):
        """Rows ``offs`` (< ``n``) of a ``(n, D)`` matrix at ``PTR + base``, zero-padded to the tile."""
        return tl.load(PTR + base + offs[:, None] * stride + offs_d[None, :], mask=(offs[:, None] < n) & d_ok[None, :],
                       other=0.0)

    @triton.jit
    def _logits(q, k, IEEE: tl.constexpr):
        """``q @ k^T`` of two tiles; ``IEEE`` keeps float32 inputs out of TF32."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        return s

    @triton.jit
    def _row_step(m_i, l_i, q, K, k_base, n0, offs_m, offs_d, d_ok, skn, T, OFFSET, scale_log2,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
        """One key tile of pass 1: the online max / sum of the rows' logits; ``MASKED`` hides the keys a row does
        not see (only the tiles on the causal diagonal need it)."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _tile(K, k_base, offs_n, T, skn, offs_d, d_ok)
        s = _logits(q, k, IEEE) * scale_log2
        if MASKED:
            seen = (offs_n[None, :] < T) & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        return m_new, l_i

    @triton.jit
    def _row_lse_kernel(Q, K, LSE, sqb, sqh, sqm, skb, skh, skn, H, G, Q_LEN, T, OFFSET, scale_log2,
                        D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        IEEE: tl.constexpr):
        """Pass 1: base-2 log-sum-exp of each query row's causal logits."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        m0 = pid_m * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        q = _tile(Q, b * sqb + h * sqh, offs_m, Q_LEN, sqm, offs_d, d_ok)
        k_base = b * skb + (h // G) * skh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        end = tl.minimum(T, m0 + BLOCK_M + OFFSET)  # keys after the tile's last query are never seen
        clean = tl.minimum((m0 + OFFSET + 1) // BLOCK_N * BLOCK_N, end)  # tiles every row of this one sees whole
        for n0 in range(0, clean, BLOCK_N):
            m_i, l_i = _row_step(m_i, l_i, q, K, k_base, n0, offs_m, offs_d, d_ok, skn, T, OFFSET, scale_log2,
                                 BLOCK_N=BLOCK_N, MASKED=False, IEEE=IEEE)
        for n0 in range(clean, end, BLOCK_N):
            m_i, l_i = _row_step(m_i, l_i, q, K, k_base, n0, offs_m, offs_d, d_ok, skn, T, OFFSET, scale_log2,
                                 BLOCK_N=BLOCK_N, MASKED=True, IEEE=IEEE)
        lse = m_i + tl.log2(l_i)
        tl.store(LSE + bh * Q_LEN + offs_m, lse, mask=offs_m < Q_LEN)

    @triton.jit
    def _column_step(acc, top, k, Q, q_base, LSE, VALID, bh, b, m0, offs_n, offs_d, d_ok, sqm, Q_LEN, T, OFFSET,
                     scale_log2, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_VALID: tl.constexpr,
                     HAS_MAX: tl.constexpr, IEEE: tl.constexpr, TILE_ACC: tl.constexpr):
        """One query tile of pass 2. Rows past ``Q_LEN`` read a log-sum-exp of +inf, so their probabilities are 0;
        ``MASKED`` hides the keys a row does not see and, for the maximum, the row's own key (only the tiles on
        the causal diagonal need it). ``TILE_ACC``: ``acc`` and ``top`` are ``(BLOCK_M, BLOCK_N)`` tiles that take
        each step's probabilities element-wise (reduced over the rows once, at the end), instead of ``(BLOCK_N,)``
        vectors that take a reduction over the tile's rows at every step."""
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Q_LEN
        q = _tile(Q, q_base, offs_m, Q_LEN, sqm, offs_d, d_ok)
        lse = tl.load(LSE + bh * Q_LEN + offs_m, mask=m_ok, other=float("inf"))
        p = tl.exp2(_logits(q, k, IEEE) * scale_log2 - lse[:, None])
        if MASKED:
            seen = (offs_n[None, :] < T) & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
            p = tl.where(seen, p, 0.0)
        if HAS_VALID:
            w = tl.load(VALID + b * Q_LEN + offs_m, mask=m_ok, other=0.0)
            p = p * w[:, None]
        if TILE_ACC:
            acc += p
        else:
            acc += tl.sum(p, 0)
        if HAS_MAX:
            if MASKED:
                p = tl.where(offs_n[None, :] < offs_m[:, None] + OFFSET, p, 0.0)  # strictly before the row's key
            if TILE_ACC:
                top = tl.maximum(top, p)
            else:
                top = tl.maximum(top, tl.max(p, 0))
        return acc, top

    @triton.jit
    def _column_sum_kernel(Q, K, LSE, VALID, OUT, OUT_MAX, sqb, sqh, sqm, skb, skh, skn, H, G, Q_LEN, T, OFFSET,
                           scale_log2, HAS_VALID: tl.constexpr, HAS_MAX: tl.constexpr, D: tl.constexpr,
                           D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                           TILE_ACC: tl.constexpr):
        """Pass 2: for one key tile of one query head, the probabilities summed over every query that sees it (and
        with ``HAS_MAX`` their maximum over the queries other than the key's own position)."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        k = _tile(K, b * skb + (h // G) * skh, offs_n, T, skn, offs_d, d_ok)
        q_base = b * sqb + h * sqh
        if TILE_ACC:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            top = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            top = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = tl.maximum(n0 - OFFSET, 0)  # the first query that can see this tile
        # from query tile ``clean`` on, every row sees the whole key tile and owns none of its keys: no masks
        clean = tl.minimum((tl.maximum(n0 + BLOCK_N - OFFSET, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, Q_LEN)
        for m0 in range((first // BLOCK_M) * BLOCK_M, clean, BLOCK_M):
            acc, top = _column_step(acc, top, k, Q, q_base, LSE, VALID, bh, b, m0, offs_n, offs_d, d_ok, sqm, Q_LEN,
                                    T, OFFSET, scale_log2, BLOCK_M=BLOCK_M, MASKED=True, HAS_VALID=HAS_VALID,
                                    HAS_MAX=HAS_MAX, IEEE=IEEE, TILE_ACC=TILE_ACC)
        for m0 in range(clean, Q_LEN, BLOCK_M):
            acc, top = _column_step(acc, top, k, Q, q_base, LSE, VALID, bh, b, m0, offs_n, offs_d, d_ok, sqm, Q_LEN,
                                    T, OFFSET, scale_log2, BLOCK_M=BLOCK_M, MASKED=False, HAS_VALID=HAS_VALID,
                                    HAS_MAX=HAS_MAX, IEEE=IEEE, TILE_ACC=TILE_ACC)
        if TILE_ACC:
            acc = tl.sum(acc, 0)
            top = tl.max(top, 0)
        tl.store(OUT + bh * T + offs_n, acc, mask=offs_n < T)
        if HAS_MAX:
            tl.store(OUT_MAX + bh * T + offs_n, top, mask=offs_n < T)


def default_tiles(head_dim: int) -> dict:
    """Launch settings of both passes for a head dimension: ``block_m``, ``block_n`` (query and key tiles),
    ``num_warps`` and ``num_stages``, the fastest of a sweep on an H200 at 32k (docs/performance.md); and
    ``tile_acc``, how pass 2 accumulates (see :func:`causal_attention_sums`)."""
    if head_dim <= 64:
        return dict(block_m=128, block_n=64, num_warps=4, num_stages=3, tile_acc=True)
    if head_dim <= 128:
        return dict(block_m=128, block_n=128, num_warps=4, num_stages=2, tile_acc=False)
    return dict(block_m=64, block_n=64, num_warps=4, num_stages=2, tile_acc=False)


def causal_attention_sums(query: torch.Tensor, key: torch.Tensor, scaling: float,
                          query_valid: torch.Tensor | None = None, *, block_m: int | None = None,
                          block_n: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, with_max: bool = False,
                          lse: torch.Tensor | None = None,
                          tile_acc: bool | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused causal attention column sums (queries at the last ``Q`` of the ``T`` key positions).

    Args:
        query: `(B, H, Q, D)` (after RoPE), float16 / bfloat16 / float32.
        key: `(B, H_kv, T, D)` with ``T >= Q``; ``H`` a multiple of ``H_kv``.
        scaling: softmax scale.
        query_valid: `(B, Q)` bool or float weights; rows of invalid queries add nothing.
        block_m, block_n: query and key tile sizes (powers of two, >= 16).
        num_warps, num_stages: Triton launch settings. Each None takes :func:`default_tiles`'s value.
        tile_acc: pass 2 adds each query tile's probabilities into a ``(block_m, block_n)`` register tile and
            reduces it over the rows once per key tile (True), or reduces every query tile's probabilities over its
            rows as it goes (False). The same sums up to float32 rounding order. None: :func:`default_tiles`.
        with_max: also return each key's maximum probability over the queries other than its own position.
        lse: `(B, H, Q)` natural-log log-sum-exp of each query row's scaled causal logits, as flash attention
            returns it (:func:`flash_attention_with_lse`): pass 1 is skipped.

    Returns:
        float32 sums `(B, H, T)`, or ``(sums, maxima)`` with ``with_max``.
    """
    if triton is None:
        raise RuntimeError("the fused attention sums need Triton (it ships with CUDA builds of PyTorch)")
    B, H, Q, D = query.shape
    _, H_kv, T, _ = key.shape
    if H % H_kv or T < Q:
        raise ValueError(f"need H % H_kv == 0 and T >= Q, got H={H}, H_kv={H_kv}, Q={Q}, T={T}")
    if key.dtype != query.dtype:
        key = key.to(query.dtype)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    tiles = default_tiles(D)
    block_m, block_n = block_m or tiles["block_m"], block_n or tiles["block_n"]
    num_warps, num_stages = num_warps or tiles["num_warps"], num_stages or tiles["num_stages"]
    tile_acc = tiles["tile_acc"] if tile_acc is None else bool(tile_acc)
    out = torch.empty(B, H, T, dtype=torch.float32, device=query.device)
    top = torch.empty_like(out) if with_max else None
    valid = None if query_valid is None else query_valid.to(device=query.device, dtype=torch.float32).contiguous()
    common = dict(D=D, D_PAD=max(16, triton.next_power_of_2(D)), IEEE=query.dtype == torch.float32,
                  num_warps=num_warps, num_stages=num_stages)
    strides = (*query.stride()[:3], *key.stride()[:3])
    scale_log2 = float(scaling) * _LOG2E
    if lse is None:
        lse = torch.empty(B, H, Q, dtype=torch.float32, device=query.device)
        _row_lse_kernel[(triton.cdiv(Q, block_m), B * H)](
            query, key, lse, *strides, H, H // H_kv, Q, T, T - Q, scale_log2, BLOCK_M=block_m, BLOCK_N=block_n,
            **common)
    else:  # the kernels work in base 2
        if lse.shape != (B, H, Q):
            raise ValueError(f"lse must have shape {(B, H, Q)}, got {tuple(lse.shape)}")
        lse = (lse.to(device=query.device, dtype=torch.float32) * _LOG2E).contiguous()
    _column_sum_kernel[(triton.cdiv(T, block_n), B * H)](
        query, key, lse, valid if valid is not None else lse, out, top if with_max else out, *strides, H, H // H_kv,
        Q, T, T - Q, scale_log2, HAS_VALID=valid is not None, HAS_MAX=with_max, BLOCK_M=block_m, BLOCK_N=block_n,
        TILE_ACC=tile_acc, **common)
    return (out, top) if with_max else out


def flash_lse_supported(query: torch.Tensor) -> bool:
    """Whether :func:`flash_attention_with_lse` takes queries like ``query``: PyTorch's flash kernel (CUDA: float16
    / bfloat16, head dim a multiple of 8 up to 256), or its CPU counterpart."""
    if query.is_cuda:
        return query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256
    return query.device.type == "cpu"


LSE_KERNELS = ("flash", "cudnn")
LSE_KERNEL = "cudnn"  # what :func:`flash_attention_with_lse` calls on a GPU when not told (docs/performance.md)
# (device, grouped heads, dtype, head dim) -> "grouped", "repeated" or None (refused)
_cudnn_modes: dict[tuple, str | None] = {}


def _cudnn_op(query, key, value, scaling):
    """cuDNN's causal attention: ``(output, log-sum-exp)``."""
    found = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, True, 0.0, True, False,
                                                               scale=scaling)
    return found[0], found[1]


def _cudnn_attention_with_lse(query, key, value, scaling):
    """cuDNN's causal attention with the row log-sum-exp, or None where cuDNN refuses the inputs. Asked once per
    device, dtype and head dimension (and for grouped key heads apart): grouped heads as they are, else repeated to
    the query heads."""
    groups = query.shape[1] // key.shape[1]
    slot = (query.device, groups > 1, query.dtype, query.shape[-1])

    def heads(mode):
        if mode == "grouped":
            return key, value
        return key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)

    if slot in _cudnn_modes:  # asked before: a refusal now is a real failure, not a fallback
        mode = _cudnn_modes[slot]
        return None if mode is None else _cudnn_op(query, *heads(mode), scaling)
    for mode in ("grouped", "repeated")[:1 + (groups > 1)]:
        try:
            found = _cudnn_op(query, *heads(mode), scaling)
        except RuntimeError:
            continue
        _cudnn_modes[slot] = mode
        return found
    _cudnn_modes[slot] = None
    return None


def flash_attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scaling: float, kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Causal self-attention output and each query row's log-sum-exp from one flash-attention call, or None where
    PyTorch's flash kernel does not take these inputs (then run sdpa and :func:`causal_attention_sums` in full).

    The same kernel sdpa picks for an unpadded causal prefill computes the row log-sum-exp anyway and drops it;
    this keeps it, so the statistics that follow need only pass 2 (``causal_attention_sums(..., lse=...)``).

    Args:
        query: `(B, H, N, D)`; key, value: `(B, H_kv, N, D)` with ``H`` a multiple of ``H_kv`` (queries and keys
            at the same ``N`` positions). On a GPU: float16 / bfloat16 and ``D`` a multiple of 8 up to 256; on the
            CPU (what the tests use beside Triton's interpreter): any floating dtype.
        scaling: softmax scale.
        kernel: on a GPU, ``"flash"`` (PyTorch's FlashAttention-2) or ``"cudnn"`` (cuDNN's attention, which also
            returns the log-sum-exp; flash's where cuDNN refuses the inputs); None = :data:`LSE_KERNEL`. The CPU
            has one kernel.

    Returns:
        ``(output (B, H, N, D), lse (B, H, N) float32, natural log of the scaled logits' exp-sum)``, or None.
    """
    kernel = LSE_KERNEL if kernel is None else kernel
    if kernel not in LSE_KERNELS:
        raise ValueError(f"kernel must be one of {LSE_KERNELS}, got {kernel!r}")
    B, H, N, D = query.shape
    if (not flash_lse_supported(query) or key.shape[2] != N or value.shape[:3] != key.shape[:3]
            or value.shape[-1] != D or H % key.shape[1] or not key.dtype == value.dtype == query.dtype):
        return None
    found = _cudnn_attention_with_lse(query, key, value, scaling) if query.is_cuda and kernel == "cudnn" else None
    if found is None and query.is_cuda:
        found = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False,
                                                                    scale=scaling)
    elif found is None:
        found = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True,
                                                                            scale=scaling)
    out, lse = found[0], found[1]
    return out, lse.reshape(B, H, -1)[..., :N].float()  # (some builds round the rows up, or add a unit dimension)
