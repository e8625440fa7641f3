"""RMSNorm, computed in fp32 and scaled in the input dtype (as the reference implementation).

On CUDA a fused Triton kernel does the (optional) residual add and the norm in one pass,
bit-compatible with the torch path below; on a CPU with a build of tandem's C kernels
(`cpu_isa`, set by the loader), one call of tandem.kernels.cpu_rows does it.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from tandem.kernels import cpu_rows


@functools.cache
def fused_kernels_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import tandem.kernels.fused  # noqa: F401
    except ImportError:
        return False
    return True


class RMSNorm(nn.Module):
    cpu_isa: str | None = None  # the build of tandem's CPU kernels the CPU path calls (None: torch ops)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x [..., dim] -> norm(x). With residual: residual += x in place first (the new
        residual stream), and the norm is of that sum."""
        if x.is_cuda and x.dim() == 2 and fused_kernels_available():
            from tandem.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=residual)
        if (self.cpu_isa is not None and residual is None and x.dim() > 2 and x.stride(-1) == 1
                and x.dtype in (torch.bfloat16, torch.float16) and cpu_rows.rows_of(x) is None):
            # Rows at two strides (q / k of a multi-row step, views of the qkv output, under q/k norm):
            # gathered, so the C kernel takes them as it takes one row's (contiguous) view, and a row's
            # bits do not depend on how many rows its step has.
            x = x.contiguous()
        if (self.cpu_isa is not None and self.weight.dtype == x.dtype and cpu_rows.rows_of(x) is not None
                and self.weight.shape == x.shape[-1:]
                and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                          and _own_rows(residual)))):
            return cpu_rows.rms_norm(x, self.weight, self.eps, residual, self.cpu_isa)
        if residual is not None:
            residual.add_(x)
            x = residual
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _own_rows(residual: Tensor) -> bool:
    """Whether the C norm may add into residual in place: rows it takes (`rows_of`) that do not
    overlap (an expanded tensor's would; torch refuses to write into those)."""
    rows = cpu_rows.rows_of(residual)
    return rows is not None and (rows[0] <= 1 or rows[1] >= residual.shape[-1])
