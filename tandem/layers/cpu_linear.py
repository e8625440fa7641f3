"""CPU matmuls for bf16/fp16 models through FBGEMM's fp16-weight GEMM.

On CPUs without native bf16 matrix instructions (AVX2-only x86), PyTorch's bf16 linear costs
the same per input row: verifying 1 + k tokens costs 1 + k decode steps, which leaves
speculative decoding nothing to gain. FBGEMM's fp16-weight GEMM (the kernel behind PyTorch's
dynamic fp16 linear) streams the weights once for a small batch of rows and computes in fp32:
on the 2-core AVX2 dev machine a 17920 x 1536 layer takes 3.1 / 13.6 ms for 1 / 5 rows in
torch bf16 and 1.9 / 2.7 ms here. Packing costs 6-9 ns per weight on 2 cores at load time.

Weights are stored as fp16. Every bf16 value of magnitude in [2^-14, 65504] is exactly
representable in fp16, so trained weights convert exactly apart from the tiniest magnitudes
(< 6.1e-5, rounded to fp16's subnormal grid, an absolute error below 3e-8); a weight above
65504 cannot be stored and is refused. Activations go in as fp32 and come back in the model
dtype, so a linear's output matches a bf16 matmul with fp32 accumulation up to summation order.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor, nn

from tandem.errors import ConfigError

CPU_MATMULS = ("auto", "fbgemm", "torch")


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class FbgemmLinear(nn.Module):
    """y = x W^T (+ b) with W (and b) packed for FBGEMM (see pack_linears); called like nn.Linear."""

    def __init__(self, linear: nn.Linear, packed):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        self.packed = packed  # opaque FBGEMM handle: fp16 weights, fp32 bias

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # [n, in]
        y = torch.ops.quantized.linear_dynamic_fp16(x2, self.packed)  # [n, out] fp32
        return y.to(self.out_dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 weights (FBGEMM)"


def use_fbgemm(cpu_matmul: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` runs its linears through FBGEMM."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or cpu_matmul == "torch":
        return False
    if not fbgemm_available():
        if cpu_matmul == "fbgemm":
            raise ConfigError("cpu_matmul='fbgemm' but this PyTorch build has no FBGEMM; use cpu_matmul='torch'")
        return False
    return True


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of `model` by an FbgemmLinear, in place, packing on all threads
    (the bf16 weights are released unless another module, e.g. a tied embedding, holds them)."""
    sites = [(module, name, child) for module in model.modules() for name, child in module.named_children()
             if isinstance(child, nn.Linear)]
    limit = torch.finfo(torch.float16).max

    def pack(site):
        _, name, child = site
        w = child.weight.detach()
        lo, hi = torch.aminmax(w)
        if max(-lo.item(), hi.item()) > limit:
            raise ConfigError(f"cpu_matmul='fbgemm': weight {name!r} exceeds the fp16 range; use cpu_matmul='torch'")
        bias = child.bias.detach().float() if child.bias is not None else None
        return torch.ops.quantized.linear_prepack_fp16(w.float(), bias)

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        packed = list(pool.map(pack, sites))
    for (module, name, child), handle in zip(sites, packed):
        setattr(module, name, FbgemmLinear(child, handle))
