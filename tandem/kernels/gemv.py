"""GEMV for one-row steps: out[n] = sum_k x[k] * w[n, k] (+ bias[n]).

At batch 1 a linear layer is a matrix-vector product bound by reading the weight once. One
program owns BLOCK_N output rows and walks K in BLOCK_K steps, accumulating
elementwise products in fp32 registers (no reduction inside the loop), then reduces once and
rounds once to the output dtype. There is no split-K: the grid is N / BLOCK_N programs, enough
to fill the chip at every shape of the supported models, and each output element is summed in
one fixed order. With act="silu_mul" the input is [gate | up] and the kernel multiplies
silu(gate) * up, rounded as the separate silu_and_mul kernel rounds it (so the fused call gives
the unfused call's bits), saving that launch before every down projection.

Rows > 1 stay on cuBLAS: a tensor-core tile for 2-16 rows (tl.dot on a 16-row tile, swept at
5 and 6 rows on the H200) matched cuBLAS on the 8B's layers, lost on down_proj and on every
1B layer, and won only on the LM head (241 vs 253 us), so it was not kept.

The wrapper takes its sizes from tensor shapes only (no device-to-host reads), so a launch can
be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from tandem.kernels.fused import _numerics, _round


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
    SILU_MUL: tl.constexpr,  # x is [gate (K) | up (K)]: multiply silu(gate) * up, rounded as silu_and_mul
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
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
            if SILU_MUL:
                up = tl.load(x_ptr + K + k0 + offs_k)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            if SILU_MUL:
                up = tl.load(x_ptr + K + k0 + offs_k, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        if SILU_MUL:
            dtype = out_ptr.dtype.element_ty
            if CUDA_LIBM:
                e = libdevice.exp(-x)
            else:
                e = tl.exp(-x)
            x = _round(tl.div_rn(x, 1.0 + e), dtype, SOFT_BF16).to(tl.float32)
            x = _round(x * up.to(tl.float32), dtype, SOFT_BF16).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """-> (BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight, from the H200 sweep
    (bench/kernels.py --gemv, cold weights, us against cuBLAS in docs/benchmarks.md): 8 x 512 for
    4096-8192 rows (Llama-3 8B's qkv / o / down); 4 x 1024 where K is a multiple of 1024 (every
    Llama-3.2 1B shape, the 8B's gate_up and head); 8 x 512 where K is a multiple of 512 only
    (Qwen2.5 1.5B, K = 1536: 4 x 1024 would waste half of every second step); else 4 x 2048 with
    8 warps and a masked last step (Qwen2.5 1.5B's down_proj, K = 8960). BLOCK_N stays <= 8 so
    a short N still gives hundreds of programs."""
    if 4096 <= n <= 8192 or (k % 1024 and k % 512 == 0):
        return 8, 512, 4
    if k % 1024 == 0 or k < 1024:
        return 4, min(1024, triton.next_power_of_2(k)), 4
    return 4, 2048, 8


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
         config: tuple[int, int, int] | None = None, act: str | None = None) -> Tensor:
    """x [1, K] (or [K]) bf16 / fp16 / fp32, contiguous; weight [N, K] same dtype, rows contiguous;
    bias [N] or None. -> out [1, N] (or [N]) in x's dtype, fp32 accumulation, rounded once.
    act="silu_mul": x is [1, 2K] = [gate | up] and the product is of F.silu(gate) * up.
    config: (BLOCK_N, BLOCK_K, num_warps) in place of gemv_config, for tuning sweeps."""
    n, k = weight.shape
    silu_mul = act == "silu_mul"
    assert act in (None, "silu_mul")
    assert x.shape[-1] == (2 * k if silu_mul else k) and x.numel() == x.shape[-1] and x.is_contiguous()
    assert weight.stride(1) == 1 and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **_numerics(x),
    )
    return out
