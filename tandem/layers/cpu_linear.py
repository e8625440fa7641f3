"""CPU matmuls for bf16/fp16 models: our kernel (AVX-512 BF16, AVX-512 or AVX2 build), or FBGEMM's fp16-weight GEMM.

On CPUs without native bf16 matrix instructions (AVX2 / AVX-512F x86), PyTorch's bf16 linear
costs the same per input row: verifying 1 + k tokens costs 1 + k decode steps, which leaves
speculative decoding nothing to gain. Two kernels stream the weights once for a small batch of
rows and compute in fp32:

- "avx512bf16" / "avx512" / "avx2" (tandem/kernels/cpu_gemm.c, three builds of one source): reads the bf16/fp16
  weights exactly as loaded, so it costs nothing at load time and loses no precision, and each
  row's result is bit-identical whatever the batch (a verified token sees the same logits as a
  decoded one). Up to 6 rows are bound by reading the weights: on the 2-core AMD EPYC dev
  machine a 17920 x 1536 bf16 layer takes about 1.8 ms for 1 or 4 rows with either AVX-512 build
  and 1.85 with the AVX2 one (an older AVX-512F Xeon: 3.6 / 4.1 and 3.8 / 6.5). The avx512bf16
  build (CPUs with AVX512_BF16) multiplies a bf16 model's bf16 rows by its bf16 weights with
  VDPBF16PS, twice the multiply-adds an instruction: prefill (64 rows) ~1.5x faster, decode
  alike. Needs a C compiler at first use (the build is cached).
- "fbgemm": the kernel behind PyTorch's dynamic fp16 linear, about as fast, but its weights
  must be repacked to fp16 at load (6-9 ns per weight on 2 cores: 14-19 s for the
  Qwen2.5-Coder pair), tiny weights (< 6.1e-5) are rounded to fp16's subnormal grid, and a
  weight above 65504 cannot be stored and is refused.

"auto" takes the best build of our kernel that runs here (avx512bf16, avx512, then avx2), else fbgemm,
else torch's own linear. With our kernel, a linear whose weight was rounded to fp8
(`quantization="fp8"`, tandem/layers/quant.py) keeps only the e4m3 bytes and row scales and runs
the same build's fp8 GEMM (W8Linear; the AVX-512 builds widen 16 bytes a register where AVX2
widens 8: one row of the 1.5B's gate_up 1.07 -> 0.93 ms).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor, nn

from tandem.errors import ConfigError
from tandem.kernels import cpu_build, cpu_gemm

logger = logging.getLogger(__name__)


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


class W16Linear(nn.Module):
    """y = x W^T (+ b) through the `isa` build of tandem/kernels/cpu_gemm.c on the weight as
    loaded; called like nn.Linear."""

    def __init__(self, linear: nn.Linear, isa: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.isa = isa
        self.weight = linear.weight  # [out, in] bf16/fp16, shared with a tied embedding if any
        self.bias32 = linear.bias.detach().float() if linear.bias is not None else None  # [out]

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = cpu_gemm.gemm_w16(x.reshape(-1, self.in_features), self.weight, self.bias32, self.weight.dtype,
                              self.isa)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.dtype} "
                f"({self.isa} kernel)")


class W8Linear(nn.Module):
    """y = x (W8 * s)^T (+ b) for a linear whose weight holds fp8 values (tandem/layers/quant.py:
    the fp8 target's and draft's), through the `isa` build of tandem/kernels/cpu_gemm.c (the one the
    model's other linears run) on the e4m3 bytes and their row scales: half a bf16 weight's memory
    and traffic, the same function (the products exact, summed in fp32). The model-dtype weight is
    not kept (a tied embedding keeps its own). Called like nn.Linear; out_dtype: the model's dtype."""

    def __init__(self, linear: nn.Linear, isa: str):
        super().__init__()
        from tandem.layers.quant import quantize_fp8

        self.isa = isa
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        self.w8, self.w_scale = quantize_fp8(linear.weight)  # [out, in] e4m3, [out] fp32
        self.bias32 = linear.bias.detach().float() if linear.bias is not None else None  # [out]

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = cpu_gemm.gemm_w8(x.reshape(-1, self.in_features), self.w8, self.w_scale, self.bias32, self.out_dtype,
                             self.isa)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8 e4m3 ({self.isa} kernel)"


def cpu_linear_kind(cpu_matmul: str, device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel a model on `device` in `dtype` runs its linears through: "avx512bf16", "avx512" or "avx2"
    (a build of our kernel), "fbgemm" or "torch" (the nn.Linear as built). An explicit choice
    that cannot run here is an error."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or cpu_matmul == "torch":
        return "torch"
    if cpu_matmul in cpu_build.ISAS:
        err = cpu_build.load_error(cpu_matmul)
        if err is not None:
            raise ConfigError(f"cpu_matmul={cpu_matmul!r} cannot run here: {err}; use cpu_matmul='auto' or 'torch'")
        return cpu_matmul
    if cpu_matmul == "auto" and cpu_build.best_isa() is not None:
        return cpu_build.best_isa()
    if cpu_matmul == "auto":
        why = cpu_build.load_error("avx2")  # (the build every x86-64 CPU of this decade runs)
        log = logger.info if why.startswith("this CPU lacks") else logger.warning
        log("cpu_matmul='auto': tandem's CPU kernels cannot run here (%s); the linears run %s", why,
            "FBGEMM's fp16 GEMM (weights rounded to float16)" if fbgemm_available() else "PyTorch's own")
    if fbgemm_available():
        return "fbgemm"
    if cpu_matmul == "fbgemm":
        raise ConfigError("cpu_matmul='fbgemm' but this PyTorch build has no FBGEMM; use cpu_matmul='torch'")
    return "torch"


def linear_sites(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent module, attribute name, nn.Linear) for every linear layer of model."""
    return [(module, name, child) for module in model.modules() for name, child in module.named_children()
            if isinstance(child, nn.Linear)]


def runs_fp8_bytes(kind: str) -> bool:
    """Whether prepare_linears(model, kind) turns linears marked `fp8_weights` into W8Linear (the
    e4m3 bytes through that build of cpu_gemm.c) rather than keeping their rounded weights."""
    return kind in cpu_build.ISAS and cpu_build.load_error(kind) is None


def prepare_linears(model: nn.Module, kind: str, chosen: bool = True) -> None:
    """Swap every nn.Linear of `model` for the `kind` kernel (see cpu_linear_kind), in place; with
    our kernel, linears marked `fp8_weights` (tandem/layers/quant.py) become W8Linear. chosen: the
    user named kind (else "auto" fell back to it: FBGEMM then keeps PyTorch's linears for weights
    past the fp16 range instead of refusing them)."""
    if kind in cpu_build.ISAS:
        fp8 = runs_fp8_bytes(kind)
        for module, name, child in linear_sites(model):
            if fp8 and getattr(child, "fp8_weights", False):
                setattr(module, name, W8Linear(child, kind))
                child.weight = None  # freed now unless tied to the embedding (the load's peak: the bf16 model)
                continue
            if not child.weight.is_contiguous():
                child.weight = nn.Parameter(child.weight.detach().contiguous(), requires_grad=False)
            setattr(module, name, W16Linear(child, kind))
    elif kind == "fbgemm":
        pack_linears(model, chosen)


def pack_linears(model: nn.Module, chosen: bool = True) -> None:
    """Replace every nn.Linear of `model` by an FbgemmLinear, in place, packing on all threads
    (the bf16 weights are released unless another module, e.g. a tied embedding, holds them). A
    weight past the fp16 range is refused where the user chose FBGEMM (chosen), else every linear
    stays PyTorch's (checked before any is packed)."""
    sites = linear_sites(model)
    limit = torch.finfo(torch.float16).max
    for _, name, child in sites:
        lo, hi = torch.aminmax(child.weight.detach())
        if max(-lo.item(), hi.item()) > limit:
            if chosen:
                raise ConfigError(f"cpu_matmul='fbgemm': weight {name!r} exceeds the fp16 range; use "
                                  "cpu_matmul='torch'")
            logger.warning("cpu_matmul='auto': weight %r exceeds the fp16 range of FBGEMM's GEMM, so the linears "
                           "stay PyTorch's", name)
            return

    def pack(site):
        _, name, child = site
        w = child.weight.detach()
        bias = child.bias.detach().float() if child.bias is not None else None
        return torch.ops.quantized.linear_prepack_fp16(w.float(), bias)

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        packed = list(pool.map(pack, sites))
    for (module, name, child), handle in zip(sites, packed):
        setattr(module, name, FbgemmLinear(child, handle))
