"""The small per-row ops of a CPU forward (cpu_rows.c through ctypes), with their PyTorch references.

On a CPU, a decode or verification step's norms, rotary embedding and SiLU-and-mul cost more
in PyTorch's per-op dispatch than in arithmetic (the 2-core dev machine: ~300 us a norm of a
few rows, as 9 ops). Each op here is one call into the C library (tandem.kernels.cpu_build) and
rounds where its reference rounds: rotary gives the reference's bits; RMSNorm (its sum of
squares in another order) and SiLU-and-mul (a polynomial exp) can differ from it by a unit or
two in the last place. Each row is computed alone, whatever the rows beside it.

Each wrapper takes bf16 / fp16 tensors laid out as `rows_of` (or `rotary_fits`) accepts. The
references are the PyTorch paths they replace, which the C code follows: RMSNorm.forward
(tandem/layers/norm.py), RotaryEmbedding.forward (tandem/layers/rotary.py) and MLP.forward
(tandem/models/decoder.py) with `cpu_isa` None.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.kernels import cpu_build


def rows_of(x: Tensor) -> tuple[int, int] | None:
    """(rows, row stride) when x's elements form rows of x.shape[-1] contiguous elements at one
    stride (a 2-D tensor with unit last stride, or any contiguous tensor) in a 16-bit dtype the
    kernels take; else None (the caller runs the reference)."""
    if x.dtype not in cpu_build.HALF_KIND or x.device.type != "cpu" or x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x.shape[0], x.stride(0)
    if x.is_contiguous():
        return x.numel() // max(1, x.shape[-1]), x.shape[-1]
    return None


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None, isa: str) -> Tensor:
    """x [..., dim] -> RMSNorm(x) * weight, contiguous, x's dtype. With residual (x's shape):
    residual += x in place first, and the norm is of that sum. x and residual must pass
    `rows_of`; weight [dim] in x's dtype."""
    rows, x_stride = rows_of(x)
    r_stride = rows_of(residual)[1] if residual is not None else 0
    out = torch.empty(x.shape, dtype=x.dtype)
    cpu_build.library(isa).tandem_rms_norm(
        x.data_ptr(), x_stride, residual.data_ptr() if residual is not None else None, r_stride,
        weight.data_ptr(), out.data_ptr(), rows, x.shape[-1], eps, cpu_build.HALF_KIND[x.dtype],
        torch.get_num_threads())
    return out


def rotary_(positions: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, isa: str) -> None:
    """Rotate q [n, H, D] and k [n, Hkv, D] in place (heads contiguous within a row, e.g. views of
    one qkv buffer) by the fp32 tables cos / sin [max_positions, D] at positions [n] int64."""
    n, _, head_dim = q.shape
    cpu_build.library(isa).tandem_rotary(
        q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1], head_dim,
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, cpu_build.HALF_KIND[q.dtype],
        torch.get_num_threads())


def rotary_fits(positions: Tensor, q: Tensor, k: Tensor, cos: Tensor) -> bool:
    """Whether rotary_ takes these tensors (else the reference runs)."""
    return (q.dtype in cpu_build.HALF_KIND and k.dtype == q.dtype and q.device.type == "cpu"
            and q.dim() == 3 and k.dim() == 3 and q.stride(2) == 1 and k.stride(2) == 1
            and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2] and k.shape[0] == q.shape[0]
            and positions.dtype == torch.int64 and positions.is_contiguous() and cos.is_contiguous()
            and positions.shape == q.shape[:1]
            # one head size throughout: the kernel reads q's in k and in the tables
            and k.shape[2] == q.shape[2] and cos.dim() == 2 and cos.shape[1] == q.shape[2])


def silu_mul(gate_up: Tensor, isa: str) -> Tensor:
    """gate_up [n, 2 * I] (rows [gate | up], as `rows_of` accepts) -> silu(gate) * up [n, I]."""
    rows, stride = rows_of(gate_up)
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    cpu_build.library(isa).tandem_silu_mul(gate_up.data_ptr(), stride, out.data_ptr(), rows, inter,
                                           cpu_build.HALF_KIND[gate_up.dtype], torch.get_num_threads())
    return out
