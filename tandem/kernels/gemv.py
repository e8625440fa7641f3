"""GEMV for one-row decode steps: out[n] = sum_k x[k] * w[n, k] (+ bias[n]).

At batch 1 a linear layer is a matrix-vector product bound by reading the weight once. One
program owns BLOCK_N output rows and walks K in BLOCK_K steps, accumulating elementwise products
in fp32 registers (no reduction inside the loop), then reduces once and rounds once to the
output dtype. There is no split-K: the grid is N / BLOCK_N programs, enough to fill the chip at
every shape of the supported models, and each output element is summed in one fixed order, so
the result does not depend on the launch (nor on anything but x, w and the tile shape).

The wrapper takes its sizes from tensor shapes only (no device-to-host reads), so a launch can
be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], rows contiguous
    b_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [N]
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k0 + offs_k)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """-> (BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight.

    H200 sweep (bench/kernels.py --gemv, cold weights): 4 x 1024 tiles with 4 warps are best or
    within 3% on every Llama-3 8B / 3.2 1B shape but the 8B's 4096-6144-row ones, where 8 x 512
    is (o_proj 10.9 vs 11.2 us, down_proj 30.3 vs 33.6 us). BLOCK_K divides K where a power of
    two from 128 to 1024 does (no masked tail), and the tile keeps ~4096 weights per step."""
    block_n, block_k = (8, 512) if 4096 <= n <= 8192 else (4, 1024)
    if k % block_k:
        block_k = next((b for b in (1024, 512, 256, 128) if k % b == 0), block_k)
        block_n = max(block_n, 4096 // block_k)
    return block_n, block_k, 4


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> Tensor:
    """x [1, K] (or [K]) bf16 / fp16 / fp32, contiguous; weight [N, K] same dtype, rows contiguous;
    bias [N] or None. -> out [1, N] (or [N]) in x's dtype, fp32 accumulation, rounded once.
    config: (BLOCK_N, BLOCK_K, num_warps) in place of gemv_config, for tuning sweeps."""
    n, k = weight.shape
    assert x.shape[-1] == k and x.numel() == k and x.is_contiguous() and weight.stride(1) == 1
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out
