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
from tandem.kernels.gemv import (  # noqa: E402
    RowNorm, _gemv_kernel, gemv, gemv_add_, gemv_config, gemv_gate_up, gemv_qkv_rope, qkv_block_k)
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
    assert_near_exact(out, x, w, b, max_ulps)


def assert_near_exact(out, x, w, b, max_ulps: int) -> None:
    """Each element of out = x @ w.T (+ b) within max_ulps of the float64 product rounded to the
    dtype, or within 1e-5 of sum |x| |w|; nothing NaN."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    scale = x.double().abs() @ w.double().abs().T
    ok = (ulp_dist(out, exact.to(out.dtype)) <= max_ulps) | ((out.double() - exact).abs() <= 1e-5 * scale)
    assert not out.isnan().any()
    assert ok.all(), f"{(~ok).sum().item()} of {out.numel()} outputs off ({tuple(w.shape)}, {out.dtype})"


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


def check_gate_up(n: int, k: int, dtype: torch.dtype, device: str, fp8: bool, norm: bool, bias: bool,
                  config=None) -> None:
    """gemv_gate_up (the activation in the gate | up GEMV's epilogue) gives the bits of
    silu_and_mul after the plain GEMV at the same tile: with fp8 weights, the norm inside, a bias."""
    from tandem.layers.quant import quantize_fp8

    g = torch.Generator(device="cpu").manual_seed(n + 3 * k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    w, s = quantize_fp8(w) if fp8 else (w, None)
    rn = RowNorm((1 + 0.2 * torch.randn(k, generator=g)).to(device, dtype), 1e-5,
                 (x.float() ** 2).sum().reshape(1).contiguous()) if norm else None
    out = torch.full((1, n // 2), float("nan"), dtype=dtype, device=device)
    assert gemv_gate_up(x, w, b, out=out, config=config, norm=rn, w_scale=s) is out
    assert torch.equal(out, silu_and_mul(gemv(x, w, b, config=config, norm=rn, w_scale=s)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(28672, 4096), (16384, 2048), (17920, 1536), (9728, 896), (2002, 700)])
@pytest.mark.parametrize("fp8,norm,bias", [(False, False, False), (False, True, True), (True, False, False),
                                           (True, True, False)])
def test_gemv_gate_up_gives_the_unfused_bits(n, k, dtype, fp8, norm, bias):
    if fp8 and dtype == torch.float32:
        pytest.skip("fp8 weights serve bf16 / fp16 models")
    check_gate_up(n, k, dtype, "cuda", fp8, norm, bias)


@interpret_mark(_gemv_kernel)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # (bf16: the interpreter truncates its casts)
@pytest.mark.parametrize("n,k,config", [(48, 96, (8, 32, 4)), (26, 64, (4, 64, 4))])
def test_gemv_gate_up_interpreter(n, k, config, dtype):
    check_gate_up(n, k, dtype, "cpu", fp8=dtype == torch.float16, norm=n == 48, bias=n == 26, config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_linear_dispatch(monkeypatch):
    from tandem.layers.gpu_linear import GemvLinear

    lin = torch.nn.Linear(512, 300, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = GemvLinear(lin)
    from tandem.kernels.gemm_rows import gemm_rows

    assert torch.equal(layer(torch.ones(3, 512, device="cuda", dtype=torch.bfloat16)),
                       F.linear(torch.ones(3, 512, device="cuda", dtype=torch.bfloat16), lin.weight, lin.bias))
    monkeypatch.setattr("tandem.layers.gpu_linear.FEW_ROWS_MIN_OUT", 300)  # 300 outputs: narrow, unless lowered
    x = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, lin.weight, lin.bias))  # many rows: cuBLAS
    assert torch.equal(layer(x[:3]), gemm_rows(x[:3], lin.weight, lin.bias))  # a few rows: the tensor-core GEMM
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


# ------------------------------------------------------------------ the norm / residual-add fusions
def check_add_and_norm(n: int, k: int, m: int, dtype: torch.dtype, device: str, config=None) -> None:
    """gemv_add_ == residual + gemv (bits; under the interpreter, whose plain gemv store truncates
    bf16, within an ulp of each term), its partial sums of squares add up to the new residual's, and a GEMV with the
    RMSNorm inside (RowNorm of those sums) matches the rms_norm-then-GEMV pair."""
    from tandem.layers.norm import RMSNorm

    g = torch.Generator(device="cpu").manual_seed(n * 3 + k)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    res = torch.randn(1, n, generator=g).to(device, dtype)
    o = gemv(x, w, config=config)
    want = res + o
    got = res.clone()
    sumsq = gemv_add_(x, w, got, config=config)
    if INTERPRET and dtype == torch.bfloat16:
        assert ((got.float() - want.float()).abs() <= 2**-7 * (want.float().abs() + o.float().abs())).all()
    else:
        assert torch.equal(got, want)
    total = (got.double() ** 2).sum().item()
    assert abs(sumsq.double().sum().item() - total) <= 1e-5 * total
    norm = RMSNorm(n, 1e-5).to(device)
    norm.weight.data = (1 + 0.2 * torch.randn(n, generator=g)).to(device, dtype)
    w2 = (torch.randn(m, n, generator=g) * 0.05).to(device, dtype)
    out = torch.full((1, m), float("nan"), dtype=dtype, device=device)
    gemv(got, w2, out=out, norm=RowNorm(norm.weight, norm.eps, sumsq))
    h = norm(got)
    unfused = gemv(h, w2)
    scale = h.double().abs() @ w2.double().abs().T
    assert not out.isnan().any()
    if dtype == torch.float32:
        assert ((out.double() - unfused.double()).abs() <= 1e-5 * scale).all()
    else:
        assert ((out.double() - unfused.double()).abs() <= 1e-2 * scale).all()
        # The norms differ only in the order of one fp32 sum, which rounding to 8 or 11 bits
        # almost always hides: nearly every output keeps its bits.
        assert (out == unfused).float().mean().item() >= 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k,m", [(4096, 4096, 6144), (4096, 14336, 28672), (2048, 2048, 3072),
                                   (1536, 8960, 2048), (896, 896, 1152), (1000, 700, 300)])
def test_gemv_add_and_norm_gpu(n, k, m, dtype):
    check_add_and_norm(n, k, m, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dependent_launch_chain_gpu(monkeypatch):
    """Eight 8B-shaped MLPs in a row as one-row GEMVs (norm inside gate_up, SiLU inside and the
    residual add after down_proj), each reading what the last wrote, replayed as a CUDA graph:
    with programmatic dependent launch (a kernel starts before the previous one has finished,
    tandem/kernels/pdl.py) the residual stream keeps the bits of plain launches."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    g = torch.Generator(device="cpu").manual_seed(5)
    h, inter, layers = 4096, 14336, 8
    w_gu = [(torch.randn(2 * inter, h, generator=g) * 0.02).to("cuda", torch.bfloat16) for _ in range(layers)]
    w_down = [(torch.randn(h, inter, generator=g) * 0.02).to("cuda", torch.bfloat16) for _ in range(layers)]
    norm_w = (1 + 0.1 * torch.randn(h, generator=g)).to("cuda", torch.bfloat16)
    res0 = torch.randn(1, h, generator=g).to("cuda", torch.bfloat16)

    def run(pdl: str) -> torch.Tensor:
        monkeypatch.setenv("TANDEM_PDL", pdl)
        res = res0.clone()
        sumsq0 = (res.float() ** 2).sum().view(1)

        def chain():
            sumsq = sumsq0
            for i in range(layers):
                act = gemv(res, w_gu[i], norm=RowNorm(norm_w, 1e-5, sumsq))
                sumsq = gemv_add_(act, w_down[i], res, act="silu_mul")

        chain()  # compile outside the capture
        res.copy_(res0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        outs = []
        for _ in range(3):
            res.copy_(res0)
            graph.replay()
            outs.append(res.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(o, outs[0]) for o in outs)
        return outs[0]

    plain = run("0")
    assert not plain.isnan().any()
    assert torch.equal(run("1"), plain)


@interpret_mark(_gemv_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,m,config", [(64, 96, 40, (8, 32, 4)), (72, 64, 24, (4, 64, 4))])
def test_gemv_add_and_norm_interpreter(n, k, m, config, dtype):
    check_add_and_norm(n, k, m, dtype, "cpu", config=config)


def _decode_logits(path, device: str, dtype: torch.dtype, swap: bool, use_gemv: bool = True,
                   table_decode: bool = False) -> torch.Tensor:
    """Logits of a 9-token prefill and 4 one-token decode steps of a tiny model; swap: wrap every
    linear in a GemvLinear (the GPU loader does this for bf16 / fp16 by itself); table_decode:
    the decode steps take the GPU's block-table metadata and Triton attention (on CPU: under the
    interpreter), so the qkv GEMV rotates and stores K/V itself."""
    from tandem.config import ModelConfig, read_arch_config
    from tandem.layers.backend import AttnBackend
    from tandem.layers.cpu_linear import linear_sites
    from tandem.layers.gpu_linear import GemvLinear
    from tandem.models.decoder import KVCache
    from tandem.models.loader import load_model

    arch = read_arch_config(path)
    model = load_model(ModelConfig(str(path), arch, dtype, 64), torch.device(device))
    if swap:
        sites = linear_sites(model)
        assert sites
        for module, name, child in sites:
            setattr(module, name, GemvLinear(child))
    for m in model.modules():
        if isinstance(m, GemvLinear):
            m.use_gemv = use_gemv
    kv = KVCache(arch, 8, 4, dtype, device)
    ids = torch.randint(0, 320, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    table = [5, 2, 7, 1]
    backend = AttnBackend(4, torch.device(device))  # on CUDA: block-table metadata, Triton attention
    decode_backend = AttnBackend(4, torch.device(device), use_table=True, use_triton=True) if table_decode else backend
    out = []
    with torch.inference_mode():
        for start, n in [(0, 9), (9, 1), (10, 1), (11, 1), (12, 1)]:
            attn = (backend if n > 1 else decode_backend).prefill([start], [n], [table])
            pos = torch.arange(start, start + n, device=device)
            hidden = model(torch.tensor(ids[start : start + n], device=device), pos, attn, kv)
            out.append(model.compute_logits(hidden[-1:]).float().cpu())
    return torch.cat(out)


@interpret_mark(_gemv_kernel)
def test_decoder_row_path_interpreter(tmp_path):
    """One-token steps through the GEMVs with the norms and adds inside them == the plain model."""
    from tests.helpers import make_hf_model

    path = make_hf_model(tmp_path / "m", "qwen2", num_heads=4, num_kv_heads=2)  # q/k/v biases too
    ref = _decode_logits(path, "cpu", torch.float32, swap=False)
    got = _decode_logits(path, "cpu", torch.float32, swap=True)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    got = _decode_logits(path, "cpu", torch.float32, swap=True, table_decode=True)  # + rotary in the qkv GEMV
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decoder_row_path_gpu(tmp_path, arch):
    from tests.helpers import make_hf_model

    path = make_hf_model(tmp_path / "m", arch, num_heads=4, num_kv_heads=2)
    ref = _decode_logits(path, "cpu", torch.float32, swap=False)
    got = _decode_logits(path, "cuda", torch.float32, swap=True)  # fp32 GEMVs, fused norms and adds
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    bf16 = _decode_logits(path, "cuda", torch.bfloat16, swap=False)  # the loader's GemvLinears
    cublas = _decode_logits(path, "cuda", torch.bfloat16, swap=False, use_gemv=False)
    assert (bf16 - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    assert (bf16 - cublas).abs().max().item() <= 0.05 * ref.abs().max().item()


# ------------------------------------------------------------------ the rotary + KV store epilogue
def check_qkv_rope(heads: int, kv_heads: int, head_dim: int, k: int, dtype: torch.dtype, device: str, bias: bool,
                   norm: bool, slot: int, block_k: int | None = None) -> None:
    """gemv_qkv_rope == the qkv GEMV (same tile) then rotary_embedding with its KV store: the
    same bits in the output and in both caches (nothing written for slot -1)."""
    from tandem.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cpu").manual_seed(heads * 31 + k)
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(1, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    row_norm = None
    if norm:
        nw = (1 + 0.2 * torch.randn(k, generator=g)).to(device, dtype)
        sumsq = (x.float() ** 2).sum().reshape(1).repeat(3) / 3
        row_norm = RowNorm(nw, 1e-6, sumsq.contiguous())
    rot = RotaryEmbedding(head_dim, 512, 500000.0, None, device=device)
    pos = torch.tensor([301], device=device)
    slots = torch.tensor([slot], device=device)
    k_cache = torch.full((6, 4, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    out = gemv_qkv_rope(x, w, b, heads, kv_heads, pos, rot.cos, rot.sin, k_cache, v_cache, slots, norm=row_norm,
                        block_k=block_k)
    block_k = block_k or qkv_block_k(k, fp8=False)
    ref = gemv(x, w, b, config=(8, block_k, 4), norm=row_norm)
    assert_rope_store_matches(out, ref, k_cache, v_cache, pos, rot, slots, heads, kv_heads)
    assert k_cache.isnan().sum().item() == k_cache.numel() - (kv_heads * head_dim if slot >= 0 else 0)


def assert_rope_store_matches(out, ref, k_cache, v_cache, pos, rot, slots, heads: int, kv_heads: int) -> None:
    """out (a fused qkv projection's) == ref (the plain projection's [T, (H + 2 Hkv) D] output)
    rotated by rotary_embedding, and the caches hold what its KV store writes (bits; NaN = unwritten)."""
    from tandem.kernels.fused import rotary_embedding

    head_dim = k_cache.shape[-1]
    q, kk, v = (t.reshape(ref.shape[0], -1, head_dim)
                for t in ref.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    rotary_embedding(pos, q, kk, rot.cos, rot.sin, store=(v, k_ref, v_ref, slots))
    assert torch.equal(out, ref)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,k,bias", [(32, 8, 128, 4096, False), (32, 8, 64, 2048, False),
                                                           (12, 2, 128, 1536, True), (14, 2, 64, 896, True)])
@pytest.mark.parametrize("norm,slot", [(False, 13), (True, 22), (True, -1)])
def test_gemv_qkv_rope_gpu(heads, kv_heads, head_dim, k, bias, norm, slot, dtype):
    check_qkv_rope(heads, kv_heads, head_dim, k, dtype, "cuda", bias, norm, slot)


@interpret_mark(_gemv_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm,slot,bias", [(False, 5, True), (True, -1, False)])
def test_gemv_qkv_rope_interpreter(norm, slot, bias, dtype):
    check_qkv_rope(4, 2, 16, 96, dtype, "cpu", bias, norm, slot, block_k=32)


# ------------------------------------------------------------------ the first weight tile loaded before the wait
def check_preload(n: int, k: int, dtype: torch.dtype, device: str, config=None, fp8: bool = False,
                  qkv=None, qkv_block_k: int | None = None) -> None:
    """preload=1 or 2 (weight tiles loaded before the PDL wait) gives the bits of preload=0
    in every one-row kernel: plain with a bias, with the RMSNorm inside, with SiLU-and-mul, adding into
    the residual, gate | up with SiLU in the epilogue; qkv=(H, Hkv, D): the qkv GEMV rotating and
    storing K/V (n is then (H + 2 Hkv) D)."""
    from tandem.layers.quant import fake_quantize_fp8_, quantize_fp8
    from tandem.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cpu").manual_seed(n * 5 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    w_scale = None
    if fp8:
        fake_quantize_fp8_(w)
        w, w_scale = quantize_fp8(w)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(device, dtype)
    row_norm = RowNorm(nw, 1e-6, ((x.float() ** 2).sum().reshape(1).repeat(3) / 3).contiguous())
    two = torch.randn(1, 2 * k, generator=g).to(device, dtype)

    def both(fn):
        outs = [fn(preload) for preload in (0, 1, 2)]
        for a, *others in zip(*[o if isinstance(o, tuple) else (o,) for o in outs]):
            assert not a.float().isnan().any()
            for b_ in others:
                assert torch.equal(a, b_)

    if qkv is not None:
        heads, kv_heads, head_dim = qkv
        rot = RotaryEmbedding(head_dim, 512, 500000.0, None, device=device)

        def rope(preload):
            caches = [torch.zeros((6, 4, kv_heads, head_dim), dtype=dtype, device=device) for _ in range(2)]
            out = gemv_qkv_rope(x, w, b, heads, kv_heads, torch.tensor([301], device=device), rot.cos, rot.sin,
                                *caches, torch.tensor([9], device=device), norm=row_norm, block_k=qkv_block_k,
                                w_scale=w_scale, preload=preload)
            return out, *caches

        both(rope)
        return
    both(lambda preload: gemv(x, w, b, config=config, w_scale=w_scale, preload=preload))
    both(lambda preload: gemv(x, w, config=config, norm=row_norm, w_scale=w_scale, preload=preload))
    both(lambda preload: gemv(two, w, config=config, act="silu_mul", w_scale=w_scale, preload=preload))
    res = torch.randn(1, n, generator=g).to(device, dtype)

    def add(preload):
        r = res.clone()
        return r, gemv_add_(x, w, r, config=config, w_scale=w_scale, preload=preload)

    both(add)
    if n % 2 == 0:
        both(lambda preload: gemv_gate_up(x, w, config=config, norm=row_norm, w_scale=w_scale, preload=preload))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 2048), (16384, 2048), (2048, 8192), (1536, 8960), (1000, 700)])
@pytest.mark.parametrize("fp8", [False, True])
def test_preload_gives_the_same_bits_gpu(n, k, dtype, fp8):
    check_preload(n, k, dtype, "cuda", fp8=fp8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,kv_heads,head_dim,k", [(32, 8, 128, 4096), (32, 8, 64, 2048), (12, 2, 128, 1536)])
@pytest.mark.parametrize("fp8", [False, True])
def test_preload_qkv_rope_gives_the_same_bits_gpu(heads, kv_heads, head_dim, k, fp8):
    check_preload((heads + 2 * kv_heads) * head_dim, k, torch.bfloat16, "cuda", fp8=fp8,
                  qkv=(heads, kv_heads, head_dim))


@interpret_mark(_gemv_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,config", [(24, 256, (4, 64, 4)), (20, 96, (8, 64, 4)), (13, 64, (8, 64, 4))])
def test_preload_gives_the_same_bits_interpreter(n, k, config, dtype):
    check_preload(n, k, dtype, "cpu", config=config)


@interpret_mark(_gemv_kernel)
def test_preload_qkv_rope_gives_the_same_bits_interpreter():
    check_preload((4 + 2 * 2) * 16, 96, torch.float32, "cpu", qkv=(4, 2, 16), qkv_block_k=32)


# ------------------------------------------------------------------ fp8 weights (tandem/layers/quant.py)
def _near(a, b, x, w):
    """a and b (two GEMV outputs over the same exact products) within 2 ulps of each other or
    within 1e-5 of sum |x| |w|: the fp8 tile's register layout sums them in another order."""
    scale = x.double().abs() @ w.double().abs().T
    ok = (ulp_dist(a, b) <= 2) | ((a.double() - b.double()).abs() <= 1e-5 * scale)
    assert not a.isnan().any() and ok.all(), f"{(~ok).sum().item()} of {a.numel()} off"


def check_fp8_weights(n: int, k: int, dtype: torch.dtype, device: str, config=None, heads=None) -> None:
    """A GEMV streaming fp8 weights with per-row power-of-two scales computes what the same GEMV
    computes on the fake-quantized weights in the model dtype (the same exact products; the fp8
    tile's layout may sum them in another order, so within an ulp): plain with a bias, with
    SiLU-and-mul, with the RMSNorm inside, adding into the residual; heads=(H, Hkv, D): the qkv
    GEMV rotating and storing K/V."""
    from tandem.kernels.fused import rms_norm, silu_and_mul
    from tandem.layers.quant import fake_quantize_fp8_, quantize_fp8
    from tandem.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cpu").manual_seed(n + 7 * k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    fake_quantize_fp8_(w)
    q, s = quantize_fp8(w)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    _near(gemv(x, q, b, config=config, w_scale=s), gemv(x, w, b, config=config), x, w)
    gate_up = torch.randn(1, 2 * k, generator=g).to(device, dtype)
    _near(gemv(gate_up, q, config=config, act="silu_mul", w_scale=s), gemv(gate_up, w, config=config, act="silu_mul"),
          silu_and_mul(gate_up), w)
    norm = RowNorm((1 + 0.2 * torch.randn(k, generator=g)).to(device, dtype), 1e-5,
                   (x.float() ** 2).sum().reshape(1).contiguous())
    _near(gemv(x, q, config=config, norm=norm, w_scale=s), gemv(x, w, config=config, norm=norm),
          rms_norm(x, norm.weight, 1e-5), w)
    res = torch.randn(1, n, generator=g).to(device, dtype)
    res8 = res.clone()
    gemv_add_(x, q, res8, config=config, w_scale=s)
    prod = gemv(x, w, config=config).float()
    gemv_add_(x, w, res, config=config)
    # the add rounds twice: a product an ulp apart moves the sum by that ulp, whatever its size
    assert ((res8.float() - res.float()).abs() <= torch.finfo(dtype).eps * (prod.abs() + res.float().abs())).all()
    if heads is not None:
        h, hkv, d = heads
        rot = RotaryEmbedding(d, 64, 10000.0, None, device=device)
        pos, slot = torch.tensor([37], device=device), torch.tensor([3], device=device)
        caches = [torch.zeros(2, 4, hkv, d, dtype=dtype, device=device) for _ in range(4)]
        out8 = gemv_qkv_rope(x, q, b, h, hkv, pos, rot.cos, rot.sin, caches[0], caches[1], slot, w_scale=s,
                             block_k=config and config[1])
        out = gemv_qkv_rope(x, w, b, h, hkv, pos, rot.cos, rot.sin, caches[2], caches[3], slot,
                            block_k=config and config[1])
        tol = 2 * torch.finfo(dtype).eps  # an ulp of x1 or x2 moves the rotated pair by about one
        for a, b_ in ((out8, out), (caches[0], caches[2]), (caches[1], caches[3])):
            assert ((a.float() - b_.float()).abs() <= tol * (b_.float().abs() + out.float().abs().amax())).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,heads", [(3072, 2048, (32, 8, 64)), (2048, 8192, None), (16384, 2048, None),
                                       (128256, 2048, None), (1152, 896, (14, 2, 64)), (1000, 700, None),
                                       (4096, 14336, None), (6144, 4096, (32, 8, 128))])
def test_gemv_fp8_weights_gpu(n, k, heads, dtype):
    check_fp8_weights(n, k, dtype, "cuda", heads=heads)


@interpret_mark(_gemv_kernel)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_fp8_weights_interpreter(dtype):
    check_fp8_weights(64, 96, dtype, "cpu", config=(8, 32, 4), heads=(4, 2, 8))
