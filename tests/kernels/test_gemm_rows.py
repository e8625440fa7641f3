"""The few-row GEMM (tandem/kernels/gemm_rows.py) against the exact product rounded once, and its
qkv projection with the rotary embedding and KV store inside against the separate kernels.

Fresh random inputs at the linear shapes of the supported models plus ragged ones; outputs are
poisoned (NaN) first. Criterion per element: within 1 ulp of the float64 product rounded to the
dtype, or within 1e-5 of sum |x| |w| (fp32 accumulation in another order). A row's result does
not depend on the other rows (bits). The fused qkv projection and the SiLU-and-mul epilogue give
the unfused pairs' bits. Interpreter variants: TANDEM_TRITON_INTERPRET=1.
"""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TANDEM_TRITON_INTERPRET") == "1"
if INTERPRET:  # must precede the first `import triton`
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
tl = triton.language

from tandem.kernels.gemm_rows import (W8Tile, _rows_kernel, _widen, gemm_rows, gemm_rows_qkv_rope,  # noqa: E402
                                      gemm_w8, row_tile, rows_config, w8_config)
from tests.kernels.interp import interpret_mark  # noqa: E402
from tests.kernels.test_gemv import _near, assert_near_exact, assert_rope_store_matches  # noqa: E402

SMALL = (16, 32, 4, 2)  # a tile for the interpreter's small shapes


def check_rows(n: int, k: int, m: int, dtype: torch.dtype, bias: bool, device: str, config=None,
               max_ulps: int = 1) -> None:
    g = torch.Generator(device="cpu").manual_seed(n * 7 + k + m)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    gemm_rows(x, w, b, out=out, config=config)
    assert_near_exact(out, x, w, b, max_ulps)
    for i in (0, m - 1):  # a row alone gives the same bits
        assert torch.equal(gemm_rows(x[i:i + 1], w, b, config=config), out[i:i + 1])


def check_qkv_rope(heads: int, kv_heads: int, head_dim: int, k: int, m: int, dtype: torch.dtype, device: str,
                   bias: bool, config=None) -> None:
    """gemm_rows_qkv_rope == gemm_rows then rotary_embedding with its KV store (bits), padding
    rows (slot -1) write nothing."""
    from tandem.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cpu").manual_seed(heads * 31 + k + m)
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    rot = RotaryEmbedding(head_dim, 512, 500000.0, None, device=device)
    pos = torch.arange(m, device=device) + 290
    slots = torch.arange(m, device=device) * 2 + 1
    slots[m // 2] = -1
    k_cache = torch.full((max(8, m // 2 + 1), 4, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    out = gemm_rows_qkv_rope(x, w, b, heads, kv_heads, pos, rot.cos, rot.sin, k_cache, v_cache, slots,
                             config=config and config[1:])
    ref = gemm_rows(x, w, b, config=(32, *(config or rows_config(n, k))[1:]))  # the same 32-row tile
    assert_rope_store_matches(out, ref, k_cache, v_cache, pos, rot, slots, heads, kv_heads)
    assert k_cache.isnan().sum().item() == k_cache.numel() - (m - 1) * kv_heads * head_dim


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 5, 6, 16, 17, 32])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (3072, 2048), (2048, 8192), (1536, 8960),
                                 (1000, 700), (7, 4096)])
def test_gemm_rows_gpu(n, k, m, dtype):
    check_rows(n, k, m, dtype, bias=n in (3072, 1000), device="cuda")


def check_silu_mul(n: int, k: int, m: int, dtype: torch.dtype, bias: bool, device: str, config=None) -> None:
    """gemm_rows(act="silu_mul") == silu_and_mul(gemm_rows) at the same tile (bits); a row alone too."""
    from tandem.kernels.fused import silu_and_mul

    g = torch.Generator(device="cpu").manual_seed(n * 5 + k + m)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    out = torch.full((m, n // 2), float("nan"), dtype=dtype, device=device)
    gemm_rows(x, w, b, out=out, config=config, act="silu_mul")
    assert torch.equal(out, silu_and_mul(gemm_rows(x, w, b, config=config or rows_config(n, k))))
    assert torch.equal(gemm_rows(x[m - 1 :], w, b, config=config, act="silu_mul"), out[m - 1 :])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 5, 6, 32])
@pytest.mark.parametrize("n,k", [(28672, 4096), (16384, 2048), (17920, 1536), (1000, 700)])
def test_gemm_rows_silu_mul_gpu(n, k, m, dtype):
    check_silu_mul(n, k, m, dtype, bias=n == 1000, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,k,bias,m", [(32, 8, 128, 4096, False, 5), (32, 8, 64, 2048, False, 6),
                                                             (12, 2, 128, 1536, True, 5), (14, 2, 64, 896, True, 2),
                                                             (32, 8, 128, 4096, False, 32), (32, 8, 64, 2048, False, 24)])
def test_gemm_rows_qkv_rope_gpu(heads, kv_heads, head_dim, k, bias, m, dtype):
    check_qkv_rope(heads, kv_heads, head_dim, k, m, dtype, "cuda", bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_few_rows_gpu(tmp_path, arch, monkeypatch):
    """A bf16 model's 9-token prefill through gemm_rows (the qkv projection rotating and storing
    K/V: head_dim 32) and its decode steps: logits near the fp32 CPU model's and near the same
    model with cuBLAS and the separate rotary kernel for those rows (TANDEM_GEMM_ROWS=0)."""
    from tests.helpers import make_hf_model
    from tests.kernels.test_gemv import _decode_logits

    monkeypatch.setattr("tandem.layers.gpu_linear.FEW_ROWS_MIN_OUT", 1)  # this model's layers are all narrow
    path = make_hf_model(tmp_path / "m", arch, hidden_size=128, num_heads=4, num_kv_heads=2)
    ref = _decode_logits(path, "cpu", torch.float32, swap=False)
    rows = _decode_logits(path, "cuda", torch.bfloat16, swap=False)
    monkeypatch.setenv("TANDEM_GEMM_ROWS", "0")
    cublas = _decode_logits(path, "cuda", torch.bfloat16, swap=False)
    scale = ref.abs().max().item()
    assert (rows - ref).abs().max().item() <= 0.05 * scale
    assert (rows - cublas).abs().max().item() <= 0.05 * scale


@interpret_mark(_rows_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,m", [(40, 96, 2), (24, 64, 5), (33, 80, 16), (33, 80, 24)])
def test_gemm_rows_interpreter(n, k, m, dtype):
    check_rows(n, k, m, dtype, bias=n == 40, device="cpu", config=SMALL, max_ulps=2 if dtype == torch.bfloat16 else 1)


@interpret_mark(_rows_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,m,bias", [(64, 96, 5, False), (40, 64, 2, True)])
def test_gemm_rows_silu_mul_interpreter(n, k, m, bias, dtype):
    check_silu_mul(n, k, m, dtype, bias, "cpu", config=SMALL)


@interpret_mark(_rows_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_rows_qkv_rope_interpreter(bias, dtype):
    check_qkv_rope(4, 2, 32, 64, 5, dtype, "cpu", bias, config=SMALL)


def check_fp8_weights(n: int, k: int, m: int, dtype: torch.dtype, device: str, config=None, heads=None) -> None:
    """fp8 weights with per-row power-of-two scales compute what the fake-quantized weights in
    the model dtype compute (the same exact products; within an ulp where the sums' order
    differs): plain with a bias, with SiLU-and-mul; heads=(H, Hkv, D): the qkv GEMM rotating and
    storing K/V."""
    from tandem.kernels.fused import silu_and_mul
    from tandem.layers.quant import fake_quantize_fp8_, quantize_fp8
    from tandem.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cpu").manual_seed(n + 3 * k + m)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    fake_quantize_fp8_(w)
    q, s = quantize_fp8(w)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    _near(gemm_rows(x, q, b, config=config, w_scale=s), gemm_rows(x, w, b, config=config), x, w)
    if n % 2 == 0:  # SiLU-and-mul in the epilogue: the separate kernel's bits on the same fp8 products
        out = gemm_rows(x, q, config=config, act="silu_mul", w_scale=s)
        assert torch.equal(out, silu_and_mul(gemm_rows(x, q, config=config or rows_config(n, k), w_scale=s)))
    if heads is not None:
        h, hkv, d = heads
        rot = RotaryEmbedding(d, 64, 10000.0, None, device=device)
        pos = torch.arange(m, device=device) + 5
        slots = torch.arange(m, device=device)
        caches = [torch.zeros(4, 4, hkv, d, dtype=dtype, device=device) for _ in range(4)]
        cfg = config and config[1:]
        out8 = gemm_rows_qkv_rope(x, q, b, h, hkv, pos, rot.cos, rot.sin, caches[0], caches[1], slots, config=cfg,
                                  w_scale=s)
        out = gemm_rows_qkv_rope(x, w, b, h, hkv, pos, rot.cos, rot.sin, caches[2], caches[3], slots, config=cfg)
        tol = 2 * torch.finfo(dtype).eps
        for a, b_ in ((out8, out), (caches[0], caches[2]), (caches[1], caches[3])):
            assert ((a.float() - b_.float()).abs() <= tol * (b_.float().abs() + out.float().abs().amax())).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 6])
@pytest.mark.parametrize("n,k,heads", [(3072, 2048, (32, 8, 64)), (16384, 2048, None), (128256, 2048, None),
                                       (2048, 8192, None), (1000, 700, None)])
def test_gemm_rows_fp8_weights_gpu(n, k, m, heads, dtype):
    check_fp8_weights(n, k, m, dtype, "cuda", heads=heads)


@interpret_mark(_rows_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_rows_fp8_weights_interpreter(dtype):
    check_fp8_weights(128, 96, 5, dtype, "cpu", config=SMALL, heads=(2, 1, 32))


def check_w8(n: int, k: int, m: int, dtype: torch.dtype, device: str, config=None, bias: bool = True) -> None:
    """gemm_w8 (any number of rows, fp8 weights): near the exact product of x and the fake-quantized
    weights rounded once (assert_near_exact), NaN-poisoned output fully written, a row's result
    independent of the other rows (bits), SiLU-and-mul in the epilogue the separate kernel's bits."""
    from tandem.kernels.fused import silu_and_mul
    from tandem.layers.quant import fake_quantize_fp8_, quantize_fp8

    g = torch.Generator(device="cpu").manual_seed(n + 5 * k + m)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    fake_quantize_fp8_(w)
    q, s = quantize_fp8(w)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    gemm_w8(x, q, s, b, out=out, config=config)
    assert_near_exact(out, x, w, b, 2 if dtype == torch.bfloat16 else 1)
    config = config or w8_config(m, n, k)  # (w8_config's tile depends on m: the rows alone at m's tile)
    for i in (0, m - 1):
        assert torch.equal(gemm_w8(x[i:i + 1], q, s, b, config=config), out[i:i + 1])
    if n % 2 == 0:
        act = gemm_w8(x, q, s, b, act="silu_mul", config=config)
        assert torch.equal(act, silu_and_mul(gemm_w8(x, q, s, b, config=config)))


@triton.jit
def _widen_kernel(q_ptr, out_ptr, ASM: tl.constexpr):
    offs = tl.arange(0, 256)
    w = tl.load(q_ptr + offs)
    tl.store(out_ptr + offs, _widen(w, tl.bfloat16, ASM))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("asm", [True, False])
def test_e4m3_widening_is_exact_gpu(asm):
    """Every e4m3 byte (subnormals, both zeros; not the two NaNs) widened to bf16 in a kernel, by
    _E4M3_TO_BF16 (asm) or Triton's cast, gives torch's bf16 of that e4m3 value, bit for bit."""
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).cuda().view(torch.float8_e4m3fn)
    out = torch.full((256,), float("nan"), dtype=torch.bfloat16, device="cuda")
    _widen_kernel[(1,)](q, out, ASM=asm)
    ref = q.to(torch.bfloat16)
    ok = ~torch.isnan(ref)
    assert int(ok.sum()) == 254
    assert torch.equal(out[ok].view(torch.int16), ref[ok].view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 32, 33, 64, 100, 257, 1030])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096), (2048, 1536), (1000, 700), (7, 4096)])
@pytest.mark.parametrize("w8_second", [True, False])
def test_gemm_w8_gpu(n, k, m, dtype, w8_second):
    check_w8(n, k, m, dtype, "cuda", config=w8_config(m, n, k)._replace(w8_second=w8_second), bias=n in (2048, 1000))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [5, 40, 64, 200])
@pytest.mark.parametrize("n,k", [(4096, 14336), (28672, 4096), (1000, 700)])
@pytest.mark.parametrize("w8_second,split_k", [(True, 2), (True, 4), (False, 3), (True, 8)])
def test_gemm_w8_split_k_gpu(n, k, m, w8_second, split_k):
    """Split-K: each split's fp32 partial sums stored, added in order by _split_sum_kernel."""
    check_w8(n, k, m, torch.bfloat16, "cuda", config=w8_config(m, n, k)._replace(w8_second=w8_second, split_k=split_k),
             bias=n == 1000)


@interpret_mark(_rows_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,m", [(40, 96, 37), (33, 80, 5), (64, 64, 70)])
@pytest.mark.parametrize("w8_second,split_k", [(True, 1), (False, 1), (True, 3), (False, 2)])
def test_gemm_w8_interpreter(n, k, m, dtype, w8_second, split_k):
    check_w8(n, k, m, dtype, "cpu", config=(16, 16, 32, 4, 2, w8_second, split_k), bias=n != 33)


def check_qkv_rope_split(heads: int, kv_heads: int, head_dim: int, k: int, m: int, split_k: int, device: str,
                         bias: bool, config=None) -> None:
    """gemm_rows_qkv_rope on fp8 weights with K split (the last split of a program to arrive runs
    the epilogue) == gemm_w8 at the same 32-row tile and split, then the rotary kernel and its KV
    store (bits); the counts back to zero."""
    from tandem.layers.quant import quantize_fp8
    from tandem.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cpu").manual_seed(heads * 7 + k + m + split_k)
    n = (heads + 2 * kv_heads) * head_dim
    q, s = quantize_fp8((torch.randn(n, k, generator=g) * 0.05).to(device))
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    b = torch.randn(n, generator=g).to(device, torch.bfloat16) if bias else None
    rot = RotaryEmbedding(head_dim, 512, 500000.0, None, device=device)
    pos = torch.arange(m, device=device) + 17
    slots = torch.arange(m, device=device) * 3
    k_cache = torch.full((max(8, 3 * m // 4 + 1), 4, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16,
                         device=device)
    v_cache = k_cache.clone()
    counts = torch.zeros(n // 32, dtype=torch.int32, device=device)
    block_k, warps, stages = config or rows_config(n, k)[1:]
    out = gemm_rows_qkv_rope(x, q, b, heads, kv_heads, pos, rot.cos, rot.sin, k_cache, v_cache, slots,
                             config=(block_k, warps, stages), w_scale=s, split_k=split_k, counts=counts)
    ref = gemm_w8(x, q, s, b, config=W8Tile(row_tile(m), 32, block_k, warps, stages, True, split_k))
    assert_rope_store_matches(out, ref, k_cache, v_cache, pos, rot, slots, heads, kv_heads)
    assert not counts.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,kv_heads,head_dim,k,bias", [(32, 8, 128, 4096, False), (32, 8, 64, 2048, False),
                                                           (12, 2, 128, 1536, True)])
@pytest.mark.parametrize("m", [2, 5, 32])
@pytest.mark.parametrize("split_k", [2, 3, 4])
def test_gemm_rows_qkv_rope_split_k_gpu(heads, kv_heads, head_dim, k, bias, m, split_k):
    check_qkv_rope_split(heads, kv_heads, head_dim, k, m, split_k, "cuda", bias)


@interpret_mark(_rows_kernel)
@pytest.mark.parametrize("split_k,bias", [(2, False), (3, True)])
def test_gemm_rows_qkv_rope_split_k_interpreter(split_k, bias):
    check_qkv_rope_split(4, 2, 32, 96, 5, split_k, "cpu", bias, config=SMALL[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(256, 128), (6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("kernel", ["gemm_rows", "gemm_w8"])
def test_gemm_rows_fp8_rows_independent_gpu(n, k, kernel):
    """With fp8 weights too, a row's result does not depend on how many rows share the call (16- and
    32-row tiles alike; gemm_w8 at w8_config's few-row tile, K split): the fp8 target's verification
    of 1 + k tokens a request and its decode steps of up to 32 requests give the same bits."""
    from tandem.layers.quant import quantize_fp8

    g = torch.Generator(device="cpu").manual_seed(n + k)
    q, s = quantize_fp8((torch.randn(n, k, generator=g) * 0.05).cuda())
    x = torch.randn(32, k, generator=g).to("cuda", torch.bfloat16)
    gemm = gemm_rows if kernel == "gemm_rows" else gemm_w8
    full = gemm(x, q, w_scale=s)
    for m in (1, 2, 5, 6, 16, 17, 24):
        assert torch.equal(gemm(x[:m], q, w_scale=s), full[:m]), m
