"""The one-row GEMV (tandem/kernels/gemv.py) against the exact product rounded once.

Fresh random inputs at the linear shapes of the supported models (Llama-3 8B / 3.2 1B,
Qwen2.5 1.5B / 0.5B, whose K are not powers of two) plus ragged ones; outputs are poisoned
(NaN) first. Criterion per element: within 1 ulp of the float64 product rounded to the dtype,
or (where cancellation makes ulps meaningless) within 1e-5 of sum |x| |w| (fp32 accumulation
in another order). The interpreter (TANDEM_TRITON_INTERPRET=1) truncates its bf16 stores, so
there bf16 gets 2 ulps. The fused SiLU-and-mul GEMV must give the bits of the unfused pair
(silu_and_mul, then the GEMV) on CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TANDEM_TRITON_INTERPRET") == "1"
if INTERPRET:  # must precede the first `import triton`: @triton.jit reads it at decoration time
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from tandem.kernels.fused import silu_and_mul  # noqa: E402
from tandem.kernels.gemv import _gemv_kernel, gemv, gemv_config  # noqa: E402
from tests.kernels.interp import interpret_mark  # noqa: E402
from tests.kernels.test_fused import ulp_dist  # noqa: E402

GPU_SHAPES = [(6144, 4096), (4096, 14336), (128256, 4096), (3072, 2048), (2048, 8192), (2048, 1536),
              (1536, 8960), (9728, 896), (1000, 1000), (7, 4096)]


def check_gemv(n: int, k: int, dtype: torch.dtype, bias: bool, device: str, max_ulps: int = 1,
               config=None) -> None:
    g = torch.Generator(device="cpu").manual_seed(n * 7 + k)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    out = torch.full((1, n), float("nan"), dtype=dtype, device=device)
    gemv(x, w, b, out=out, config=config)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    scale = x.double().abs() @ w.double().abs().T
    ok = (ulp_dist(out, exact.to(dtype)) <= max_ulps) | ((out.double() - exact).abs() <= 1e-5 * scale)
    assert not out.isnan().any()
    assert ok.all(), f"{(~ok).sum().item()} of {out.numel()} outputs off (n={n}, k={k}, {dtype}, bias={bias})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gemv_gpu(n, k, dtype):
    check_gemv(n, k, dtype, bias=n in (2048, 1000), device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 14336), (2048, 8192), (1536, 8960), (896, 4864)])
def test_gemv_silu_mul_gives_the_unfused_bits(n, k, dtype):
    gate_up = (torch.randn(1, 2 * k, device="cuda") * 3).to(dtype)
    w = (torch.randn(n, k, device="cuda") * 0.05).to(dtype)
    out = torch.full((1, n), float("nan"), dtype=dtype, device="cuda")
    gemv(gate_up, w, out=out, act="silu_mul")
    assert torch.equal(out, gemv(silu_and_mul(gate_up), w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_linear_dispatch():
    from tandem.layers.gpu_linear import GemvLinear

    lin = torch.nn.Linear(512, 300, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = GemvLinear(lin)
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, lin.weight, lin.bias))  # several rows: cuBLAS
    assert torch.equal(layer(x[1:2]), gemv(x[1:2].contiguous(), lin.weight, lin.bias))  # one row: the GEMV
    gate_up = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(layer.forward_silu_mul(gate_up), layer(silu_and_mul(gate_up)))


def test_gemv_config_keeps_programs():
    for n, k in GPU_SHAPES + [(4864, 896), (151936, 896)]:
        block_n, block_k, _ = gemv_config(n, k)
        assert block_n <= 8 and block_n * block_k >= 2048 and block_k <= triton.next_power_of_2(k), (n, k)


@interpret_mark(_gemv_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,config", [(24, 256, None), (20, 96, (4, 32, 4)), (13, 64, (8, 64, 4)),
                                        (40, 160, (8, 64, 4))])
def test_gemv_interpreter(n, k, config, dtype):
    check_gemv(n, k, dtype, bias=n == 20, device="cpu", max_ulps=2 if dtype == torch.bfloat16 else 1, config=config)


@interpret_mark(_gemv_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_silu_mul_interpreter(dtype):
    n, k = 24, 96
    gate_up = (torch.randn(1, 2 * k) * 3).to(dtype)
    w = (torch.randn(n, k) * 0.05).to(dtype)
    gate, up = gate_up.float().split(k, dim=-1)
    act = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    exact = act.double() @ w.double().T
    scale = act.double().abs() @ w.double().abs().T
    out = gemv(gate_up, w, act="silu_mul", config=(8, 32, 4))
    if dtype == torch.bfloat16:  # truncating casts (silu, product, output) and numpy's exp
        assert (ulp_dist(out, exact.to(dtype)) <= 4).all()
    else:
        assert ((out.double() - exact).abs() <= 1e-5 * scale).all()
