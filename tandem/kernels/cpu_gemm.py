"""Small-batch GEMM with bf16/fp16 (or fp8 e4m3) weights on x86-64 CPUs: cpu_gemm.c through ctypes.

The C library is built and loaded by tandem.kernels.cpu_build (one build per instruction set:
"avx512bf16", "avx512", "avx2").
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.kernels import cpu_build

_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # also the kinds x may have


def _rows_and_output(x: Tensor, bias: Tensor | None, n: int, out_dtype: torch.dtype,
                     name: str) -> tuple[Tensor, Tensor]:
    """The kernels' common checks: bias [n] fp32 contiguous or None; -> (x as the kernel takes it:
    fp32 / bf16 / fp16 with contiguous rows, the output [M, n] in out_dtype)."""
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be a contiguous fp32 [{n}]")
    if x.dtype not in _OUT_KIND:
        x = x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, torch.empty(x.shape[0], n, dtype=out_dtype)


def gemm_w16(x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype, isa: str) -> Tensor:
    """y = x weight^T (+ bias) on the CPU, by the `isa` build of the kernel.

    x: [M, K] any float dtype (fp32, bf16 and fp16 rows go in as they are, at any row stride, and
    are widened to fp32 inside, except bf16 rows against bf16 weights in the "avx512bf16" build,
    which VDPBF16PS multiplies as they are); weight: [N, K] bf16 or fp16, contiguous;
    bias: [N] fp32 or None. Returns [M, N] in out_dtype (fp32, bf16 or fp16), fp32 accumulation,
    each row bit-identical to computing it alone (with the same build)."""
    fn = cpu_build.library(isa).tandem_gemm_w16
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or not weight.is_contiguous() or weight.dtype not in cpu_build.HALF_KIND:
        raise ValueError(f"gemm_w16: weight must be a contiguous bf16/fp16 [N, {K}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    x, y = _rows_and_output(x, bias, N, out_dtype, "gemm_w16")
    if M == 0:
        return y
    scratch = torch.empty(2 * M * K, dtype=torch.float32)  # x widened and split (see tandem_gemm_w16)
    rc = fn(x.data_ptr(), x.stride(0), _OUT_KIND[x.dtype], weight.data_ptr(),
            bias.data_ptr() if bias is not None else None, y.data_ptr(), scratch.data_ptr(), M, K, N,
            cpu_build.HALF_KIND[weight.dtype], _OUT_KIND[out_dtype], torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm_w16: unsupported dtypes {weight.dtype} -> {out_dtype}")
    return y


def gemm_w8(x: Tensor, weight: Tensor, w_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype,
            isa: str) -> Tensor:
    """y = x (weight * w_scale[:, None])^T (+ bias) on the CPU by the `isa` build, for fp8 weights:
    weight [N, K] float8_e4m3fn contiguous, w_scale [N] fp32 (tandem/layers/quant.py), bias [N]
    fp32 or None; x and the result as gemm_w16 (each row bit-identical to computing it alone)."""
    fn = cpu_build.library(isa).tandem_gemm_w8
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or not weight.is_contiguous() or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"gemm_w8: weight must be a contiguous float8_e4m3fn [N, {K}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if w_scale.dtype != torch.float32 or w_scale.shape != (N,):
        raise ValueError(f"gemm_w8: w_scale must be fp32 [{N}]")
    x, y = _rows_and_output(x, bias, N, out_dtype, "gemm_w8")
    if M == 0:
        return y
    scale = (w_scale * 256.0).contiguous()  # the kernel widens e4m3 to its value over 2^8 (exact)
    scratch = torch.empty(2 * M * K, dtype=torch.float32)  # x widened (or bf16 rows packed, see tandem_gemm_w8)
    rc = fn(x.data_ptr(), x.stride(0), _OUT_KIND[x.dtype], weight.data_ptr(), scale.data_ptr(),
            bias.data_ptr() if bias is not None else None, y.data_ptr(), scratch.data_ptr(), M, K, N,
            _OUT_KIND[out_dtype], torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm_w8: unsupported dtypes {x.dtype} -> {out_dtype}")
    return y


def gemm_w16_ref(x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """Plain-torch reference: fp32 matmul of the widened weights, one rounding to out_dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
