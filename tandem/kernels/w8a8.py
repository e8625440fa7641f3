"""fp8 GEMM for many rows (W8A8): each row of x rounded to e4m3 with its own power-of-two scale,
then torch._scaled_mm with the weight's per-row scales (the fp8 target's steps of more than 32
rows: prefill chunks, large decode batches).

A weight-only product (gemm_w8: e4m3 weights widened to bf16 in registers) keeps every product
exact but runs on Ampere-style tensor-core instructions; past a few dozen rows it lost to cuBLAS
on bf16 weights everywhere (H200, bench/kernels.py --w8, cold weights, 8B shapes: 64 rows, qkv
33 against 16 us; 2048 rows, gate_up 1052 against 626). Hopper's fp8 tensor cores want both
operands in fp8: 2048 rows of the 8B's gate_up take 435 us so, 0.69x cuBLAS's bf16 time. That is
vLLM's fp8 on Hopper too (dynamic per-token activation scales).

`quantize_rows` is one launch (a program a row: its max, then the rounding). The scale is the
least power of two s with max |x| / s <= 448, so x / s is exact before the rounding to e4m3 and
the torch reference (tandem.layers.quant.quantize_rows_fp8) gives the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.pdl import pdl_flags, wait_for_inputs

# 0.875 = 448 / 2**9: a row max m * 2**e (frexp, m in [0.5, 1)) fits 448 * 2**(e - 9) iff m <= 0.875
_FRAC_875 = tl.constexpr(0x600000)  # fp32 fraction bits of 1.75 (= 2 * 0.875)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.maximum(tl.max(amax, axis=0), 7.888609052210118e-31)  # 2 ** -100, as the reference's clamp
    bits = top.to(tl.int32, bitcast=True)
    t = ((bits >> 23) & 0xFF) - 126 - 9 + ((bits & 0x7FFFFF) > _FRAC_875).to(tl.int32)  # frexp exponent - 9 (+ 1)
    tl.store(s_ptr + row, ((t + 127) << 23).to(tl.float32, bitcast=True))
    inv = ((127 - t) << 23).to(tl.float32, bitcast=True)  # 1 / s, exactly: x * inv == x / s
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + k0 + offs, (x * inv).to(tl.float8e4nv), mask=k0 + offs < K)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """tandem.layers.quant.quantize_rows_fp8 in one launch: x [M, K] bf16 / fp16 / fp32 on CUDA, rows contiguous."""
    assert x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=min(4096, triton.next_power_of_2(k)),
                                    num_warps=4, **pdl_flags(x))
    return q, s


def w8a8_supported(k: int, n: int, dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes an [n, k] weight with row-wise scales for inputs of dtype
    (dimensions multiples of 16; a bf16 output)."""
    return k % 16 == 0 and n % 16 == 0 and dtype == torch.bfloat16


def w8a8_matmul(x: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] bf16 / fp16 rows contiguous; weight [N, K] e4m3 rows contiguous, w_scale [N] fp32;
    -> [M, N] in x's dtype: (quantized x) @ weight^T, scaled by both, plus bias."""
    q, s = quantize_rows(x)
    out = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=w_scale.view(1, -1), out_dtype=x.dtype)
    if bias is not None:
        out += bias
    return out
