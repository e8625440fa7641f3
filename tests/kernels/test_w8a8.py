"""W8A8 for the fp8 target's many-row steps (tandem/kernels/w8a8.py): the per-row activation
rounding against its torch reference (bits), and the fp8 GEMM against the exact product of the
rounded operands. Outputs poisoned first; interpreter variant: TANDEM_TRITON_INTERPRET=1."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TANDEM_TRITON_INTERPRET") == "1"
if INTERPRET:  # must precede the first `import triton`
    os.environ["TRITON_INTERPRET"] = "1"

from tandem.layers.quant import FP8_MAX, quantize_rows_fp8 as quantize_rows_ref  # noqa: E402

def _rows(m: int, k: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Rows of every magnitude: one all zero, one with a single huge entry, others scaled 1e-6..1e3."""
    g = torch.Generator().manual_seed(seed + m + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, m)[:, None]
    x[0] = 0
    if m > 2:
        x[2, k // 2] = 3e4
    return x.to(device, dtype)


def test_reference_scales_are_least_powers_of_two():
    x = _rows(40, 300, torch.float32, "cpu")
    q, s = quantize_rows_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (40, 1)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    amax = x.abs().amax(1, keepdim=True)
    live = amax[:, 0] > 0
    ratio = amax[live] / s[live]
    assert (ratio <= FP8_MAX).all() and (ratio > FP8_MAX / 2).all()  # no power of two smaller would do
    assert (q[0].float() == 0).all()
    err = (q.float() * s - x).abs()
    assert (err <= 16 * s).all()  # half of e4m3's widest step (32, in [256, 448])


def check_quantize(m: int, k: int, dtype: torch.dtype, device: str) -> None:
    from tandem.kernels.w8a8 import quantize_rows

    x = _rows(m, k, dtype, device)
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_ref(x)
    assert torch.equal(s, s_ref)
    same = q.view(torch.uint8) == q_ref.view(torch.uint8)
    if INTERPRET:
        # Triton 3.6's interpreter rounds e4m3 ties away from zero (-84 -> -88, not -80) and drops the
        # carry when rounding up to a power of two (-124.6 -> -64, not -128): the kernel's bits are
        # checked on a GPU; here, each value within a step of the reference's, or that carry case
        ref, got = q_ref.float(), q.float()
        same |= (got - ref).abs() <= ref.abs() / 8
        same |= (ref.abs() == torch.exp2(torch.log2(ref.abs()).round())) & (got == ref / 2)
    assert same.all(), f"{(~same).sum().item()} of {q.numel()} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 16), (33, 4096), (70, 14336), (5, 1000), (300, 896)])
def test_quantize_rows_gpu(m, k, dtype):
    check_quantize(m, k, dtype, "cuda")


@pytest.mark.skipif(not INTERPRET, reason="set TANDEM_TRITON_INTERPRET=1 to run the kernels in Triton's interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_interpreter(dtype):
    check_quantize(9, 200, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [33, 64, 100, 512, 2048])
@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (4096, 14336, False), (2048, 1536, True), (896, 4864, False)])
def test_w8a8_matmul_gpu(m, n, k, bias):
    """== the fp64 product of the rounded rows and weights (scales applied), rounded to bf16, within
    the fp8 tensor cores' accumulation error."""
    from tandem.kernels.w8a8 import quantize_rows, w8a8_matmul, w8a8_supported
    from tandem.layers.quant import quantize_fp8

    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
    w8, ws = quantize_fp8((torch.randn(n, k, generator=g) * 0.02).cuda())
    b = torch.randn(n, generator=g).to("cuda", torch.bfloat16) if bias else None
    assert w8a8_supported(k, n, torch.bfloat16) and not w8a8_supported(k, n, torch.float16)
    out = w8a8_matmul(x, w8, ws, b)
    q, s = quantize_rows(x)
    product = (q.double() * s.double()) @ (w8.double() * ws.double()[:, None]).T
    ref = product + (b.double() if b is not None else 0.0)
    scale = (q.double().abs() * s.double()) @ (w8.double().abs() * ws.double()[:, None]).T
    err = (out.double() - ref).abs()
    assert not out.isnan().any()
    # the product's bf16 rounding (and the bias add's, a second one), and the fp8 tensor cores'
    # accumulation: about 14 bits between promotions to fp32 (DeepSeek-V3's measurement on
    # Hopper), so 2^-12 of sum |products|
    tol = 2 ** -8 * ref.abs() + 2 ** -12 * scale + (0.0 if b is None else 2 ** -8 * product.abs())
    worst = f"worst err / tol {(err / tol).max().item():.2f}, err / scale {(err / scale).max().item():.1e}"
    assert (err <= tol).all(), worst
    # and near the bf16 product: what rounding the rows costs
    exact = x.double() @ (w8.double() * ws.double()[:, None]).T + (b.double() if b is not None else 0)
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 0.05
