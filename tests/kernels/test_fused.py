"""The fused elementwise kernels (tandem/kernels/fused.py) against the eager torch ops they replace.

Each check draws fresh random inputs and poisons outputs first (NaN, with NaN padding columns
around strided rows), so unwritten or overwritten elements fail. Distances are in ulps of the
dtype (ordered bit patterns). Criteria:

- rms_norm: the residual update is bit-exact; out is weight * y' rounded once, where y' is the
  reference's normalized value y (before the weight) or a neighbour within YTOL ulps (the sum of
  squares runs in a different order, which can move y by an ulp; the weight product can then
  move out by up to 2 ulps). YTOL: 1 for bf16 / fp16, 4 for fp32. The exact fraction is printed.
- rotary_embedding: <= 1 ulp from the fp32 computation rounded once (exact expected: no FMA
  contraction); vs the eager op (tables and products rounded to the dtype), |diff| <= 2 ulps
  at the scale of the pair's larger input (under cancellation the eager op's error is
  unbounded in ulps of its own output).
- silu_and_mul: bit-exact with F.silu(gate) * up on CUDA (libdevice expf, as torch). The
  interpreter's exp is numpy's, not torch's CPU exp: there fp32 allows 4 ulps, bf16 / fp16
  1 ulp with >= 99% exact.

GPU tests are marked `gpu`; tiny versions run in Triton's interpreter on the CPU with
TANDEM_TRITON_INTERPRET=1 (see tests/kernels/test_kernels.py; Triton 3.6 needs numpy < 2.4).
Run with -s to see the exact fractions.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

INTERPRET = os.environ.get("TANDEM_TRITON_INTERPRET") == "1"
if INTERPRET:  # must precede the first `import triton`: @triton.jit reads it at decoration time
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from tandem.kernels.fused import _rms_norm_kernel, rms_norm, rotary_embedding, silu_and_mul  # noqa: E402
from tandem.layers.rotary import RotaryEmbedding, _rotate_half  # noqa: E402
from tests.kernels.interp import interpret_mark  # noqa: E402
from tests.kernels.refs import kv_store_ref  # noqa: E402

interpret = interpret_mark(_rms_norm_kernel)
GPU = "cuda"
DTYPES = [torch.bfloat16, torch.float32]
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


# ----------------------------------------------------------------------------- ulps
def ordered(t: Tensor) -> Tensor:
    """Float bits -> int64 that counts representable values (+0 and -0 both 0)."""
    nbits = 8 * t.element_size()
    b = t.contiguous().view(_INT[t.dtype]).long()
    mag = b & ((1 << (nbits - 1)) - 1)
    return torch.where(b < 0, -mag, mag)


def from_ordered(o: Tensor, dtype: torch.dtype) -> Tensor:
    nbits = 8 * torch.tensor([], dtype=dtype).element_size()
    signed = torch.where(o < 0, -o - (1 << (nbits - 1)), o)
    return signed.to(_INT[dtype]).view(dtype)


def ulp_dist(a: Tensor, b: Tensor) -> Tensor:
    assert a.dtype == b.dtype and a.shape == b.shape
    return (ordered(a) - ordered(b)).abs()


def ulp_at(v: Tensor, dtype: torch.dtype) -> Tensor:
    """One ulp of `dtype` at magnitude |v| (float64; the subnormal spacing below the normals)."""
    m = v.double().abs().clamp(min=torch.finfo(dtype).tiny)
    _, e = torch.frexp(m)  # m = f * 2^e, f in [0.5, 1)
    return torch.pow(2.0, (e - 1 - _MANTISSA[dtype]).double())


def report(what: str, exact: float, max_ulp: int) -> None:
    print(f"\n  {what}: exact {exact:.6f}, max {max_ulp} ulp", end="")


def poisoned(rows: int, cols: int, dtype, device, pad: int = 16) -> Tensor:
    """A NaN [rows, cols] view with row stride cols + pad (the pad columns must stay NaN)."""
    return torch.full((rows, cols + pad), float("nan"), dtype=dtype, device=device)[:, :cols]


def padding_intact(view: Tensor) -> bool:
    """Every element of view's storage row past its columns is still NaN."""
    base = torch.as_strided(view, (view.shape[0], view.stride(0)), (view.stride(0), 1))
    return bool(base[:, view.shape[1]:].isnan().all())


# ----------------------------------------------------------------------------- references
def rms_norm_ref(x, weight, eps, residual=None):
    """-> (out, new residual or None, y): RMSNorm.forward of x (+ residual), and its normalized
    value before the weight, y = (r32 * rsqrt(mean(r32^2) + eps)).to(dtype)."""
    # The torch path of tandem.layers.norm.RMSNorm, written out: on CUDA the module itself
    # dispatches to the kernel under test.
    r = x if residual is None else x + residual
    r32 = r.float()
    y = (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * y
    return out, (r if residual is not None else None), y


def rotary_ref(positions, q, k, cos, sin):
    """fp32 x * cos + rotate_half(x) * sin, rounded once."""
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    return tuple((x.float() * c + _rotate_half(x.float()) * s).to(x.dtype) for x in (q, k))


def rotary_eager(rotary: RotaryEmbedding, positions, q, k):
    """The op the kernel replaces (tables and each product rounded to the dtype)."""
    return rotary(positions, q, k)


def silu_and_mul_ref(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- rms_norm
def _check_rms_out(out, ref, y, weight, what):
    ytol = 4 if out.dtype == torch.float32 else 1
    ok = out == ref
    oy = ordered(y)
    for j in range(-ytol, ytol + 1):
        if j:
            ok |= out == weight * from_ordered(oy + j, y.dtype)
    d = ulp_dist(out, ref)
    exact, worst = float((d == 0).float().mean()), int(d.max())
    report(what, exact, worst)
    assert not out.isnan().any(), what
    assert bool(ok.all()), (what, int((~ok).sum()), worst)
    if out.dtype != torch.float32:  # a systematic rounding error would show up far more often
        assert int((d != 0).sum()) <= max(4, out.numel() // 1000), (what, exact)


def check_rms_norm(device, num_tokens, hidden, dtype, seed, eps=1e-6):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(num_tokens, 1, generator=g) * 8 + 0.05  # rows of different norms
    wide = (torch.randn(num_tokens, hidden + 24, generator=g) * scale).to(dtype).to(device)
    x = wide[:, 3 : 3 + hidden]  # row stride != hidden
    weight = (torch.randn(hidden, generator=g) * 0.5 + 1).to(dtype).to(device)
    tag = f"rms_norm {_name(dtype)} T={num_tokens} H={hidden}"

    # plain, into a poisoned strided out
    out = poisoned(num_tokens, hidden, dtype, device)
    ret = rms_norm(x, weight, eps, out=out)
    assert ret.data_ptr() == out.data_ptr() and padding_intact(out)
    ref, _, y = rms_norm_ref(x, weight, eps)
    _check_rms_out(out, ref, y, weight, tag)
    # out=None allocates; same values
    assert torch.equal(rms_norm(x, weight, eps), out)

    # fused residual add: residual becomes x + residual (bit-exact), out = norm of that
    residual = poisoned(num_tokens, hidden, dtype, device, pad=8)
    residual.copy_((torch.randn(num_tokens, hidden, generator=g) * scale * 2).to(dtype))
    res_before = residual.clone()
    out = poisoned(num_tokens, hidden, dtype, device)
    rms_norm(x, weight, eps, residual=residual, out=out)
    ref, new_res, y = rms_norm_ref(x, weight, eps, res_before)
    assert torch.equal(residual, new_res), "residual update differs"
    assert padding_intact(residual) and padding_intact(out)
    _check_rms_out(out, ref, y, weight, tag + " +residual")

    # in place: out = x
    x2 = x.clone()
    rms_norm(x2, weight, eps, out=x2)
    assert torch.equal(x2, rms_norm(x, weight, eps))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("hidden", [576, 896, 2048, 4096])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_rms_norm_gpu(num_tokens, hidden, dtype):
    check_rms_norm(GPU, num_tokens, hidden, dtype, seed=num_tokens * 7 + hidden)


@pytest.mark.gpu
def test_rms_norm_fp16_and_head_dim_gpu():
    check_rms_norm(GPU, 64, 4096, torch.float16, seed=1)
    check_rms_norm(GPU, 300 * 32, 128, torch.bfloat16, seed=2)  # qk-norm shape: one row per head


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_name)
@pytest.mark.parametrize("num_tokens,hidden", [(5, 48), (3, 40), (1, 256)])
def test_rms_norm_interpret(num_tokens, hidden, dtype):
    check_rms_norm("cpu", num_tokens, hidden, dtype, seed=hidden)


# ----------------------------------------------------------------------------- rotary
def check_rotary(device, num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed, max_pos=8192,
                 theta=10000.0, scaling=None):
    g = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(head_dim, max_pos, theta, scaling, device=torch.device(device))
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    positions[0] = 0
    if num_tokens > 1:
        positions[-1] = max_pos - 1
    positions = positions.to(device)
    # q and k as row-strided views of a fused [T, (H + 2 Hkv) D] qkv output, plus NaN padding
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = poisoned(num_tokens, width, dtype, device, pad=8)
    qkv.copy_((torch.randn(num_tokens, width, generator=g) * 2).to(dtype))
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    before = qkv.clone()
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    tag = f"rotary {_name(dtype)} T={num_tokens} H={num_heads}/{num_kv_heads} D={head_dim}"
    v_cols = slice((num_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_cols], before[:, v_cols]), "v was written"
    assert padding_intact(qkv)
    half = head_dim // 2
    for name, got, x0, ref, eager in zip(
        "qk", (q, k), (q0, k0), rotary_ref(positions, q0, k0, rotary.cos, rotary.sin),
        rotary_eager(rotary, positions, q0, k0),
    ):
        d = ulp_dist(got, ref)
        exact, worst = float((d == 0).float().mean()), int(d.max())
        report(f"{tag} {name} vs fp32-once", exact, worst)
        assert worst <= 1, (tag, name, worst)
        # vs the eager op: within 2 ulps at the scale of the pair's larger input
        pair_max = torch.maximum(x0[..., :half].abs(), x0[..., half:].abs()).repeat(1, 1, 2)
        diff = (got.double() - eager.double()).abs()
        ratio = float((diff / ulp_at(pair_max, dtype)).max())
        de = ulp_dist(got, eager)
        report(f"{tag} {name} vs eager (max {ratio:.2f} input-scale ulp)", float((de == 0).float().mean()),
               int(de.max()))
        assert ratio <= 2.0, (tag, name, ratio)
        if dtype == torch.float32:  # no table rounding there: the eager op rounds exactly as the kernel
            assert torch.equal(got, eager), (tag, name)


ROTARY_CASES = [(32, 8, 128), (14, 2, 64), (32, 8, 64), (14, 2, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("heads", ROTARY_CASES, ids=lambda c: f"H{c[0]}-Hkv{c[1]}-D{c[2]}")
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_rotary_gpu(num_tokens, heads, dtype):
    h, hkv, d = heads
    check_rotary(GPU, num_tokens, h, hkv, d, dtype, seed=num_tokens + h + d, theta=500000.0 if d == 128 else 10000.0)


@pytest.mark.gpu
def test_rotary_llama3_scaling_fp16_gpu():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    check_rotary(GPU, 300, 32, 8, 128, torch.bfloat16, seed=3, max_pos=131072, theta=500000.0, scaling=scaling)
    check_rotary(GPU, 64, 32, 8, 128, torch.float16, seed=4)


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_name)
@pytest.mark.parametrize("heads", [(4, 2, 16), (3, 1, 32), (14, 2, 8)], ids=lambda c: f"H{c[0]}-Hkv{c[1]}-D{c[2]}")
def test_rotary_interpret(heads, dtype):
    h, hkv, d = heads
    check_rotary("cpu", 5, h, hkv, d, dtype, seed=h * d, max_pos=512)


def check_rotary_store(device, num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed, block_size=16):
    """rotary_embedding(..., store=...) == rotary_embedding then kv_store, bit for bit; padding
    slots (-1) and every other cache row untouched."""
    g = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, device=torch.device(device))
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width, generator=g) * 2).to(dtype).to(device)
    num_blocks = 2 * num_tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.3] = -1  # graph padding rows
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)

    def split(t):
        q = t[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        k = t[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
        return q, k, t[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)

    ref_qkv, ref_k_cache, ref_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    q, k, v = split(ref_qkv)
    rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    kv_store_ref(k, v, ref_k_cache, ref_v_cache, slots)
    q, k, v = split(qkv)
    rotary_embedding(positions, q, k, rotary.cos, rotary.sin, store=(v, k_cache, v_cache, slots))
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("heads", ROTARY_CASES, ids=lambda c: f"H{c[0]}-Hkv{c[1]}-D{c[2]}")
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_rotary_store_gpu(num_tokens, heads, dtype):
    h, hkv, d = heads
    check_rotary_store(GPU, num_tokens, h, hkv, d, dtype, seed=num_tokens * d + h)


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_rotary_store_interpret(dtype):
    check_rotary_store("cpu", 9, 4, 2, 16, dtype, seed=1, block_size=4)


# ----------------------------------------------------------------------------- silu_and_mul
def check_silu_and_mul(device, num_tokens, inter, dtype, seed, exact_required=True):
    g = torch.Generator().manual_seed(seed)
    x = poisoned(num_tokens, 2 * inter, dtype, device, pad=8)
    x.copy_((torch.randn(num_tokens, 2 * inter, generator=g) * 3).to(dtype))
    x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-3, -1e-3, 20.0, -20.0], dtype=dtype)  # tails
    out = poisoned(num_tokens, inter, dtype, device)
    ret = silu_and_mul(x, out=out)
    assert ret.data_ptr() == out.data_ptr() and padding_intact(out)
    ref = silu_and_mul_ref(x)
    d = ulp_dist(out, ref)
    exact, worst = float((d == 0).float().mean()), int(d.max())
    report(f"silu_and_mul {_name(dtype)} T={num_tokens} I={inter}", exact, worst)
    assert not out.isnan().any()
    if exact_required:
        assert torch.equal(out, ref), (exact, worst)
    else:  # the interpreter's exp is numpy's, not torch's CPU exp
        assert worst <= (4 if dtype == torch.float32 else 1), worst
        if dtype != torch.float32:
            assert exact >= 0.99, exact
    assert torch.equal(silu_and_mul(x), out)  # out=None allocates


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=_name)
@pytest.mark.parametrize("inter", [1536, 4864, 14336])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_silu_and_mul_gpu(num_tokens, inter, dtype):
    check_silu_and_mul(GPU, num_tokens, inter, dtype, seed=num_tokens + inter)


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_name)
@pytest.mark.parametrize("num_tokens,inter", [(3, 100), (2, 1030)])
def test_silu_and_mul_interpret(num_tokens, inter, dtype):
    check_silu_and_mul("cpu", num_tokens, inter, dtype, seed=inter, exact_required=False)


# ----------------------------------------------------------------------------- CUDA graphs
@pytest.mark.gpu
def test_fused_capture_in_cuda_graph_gpu():
    """All three wrappers capture (no host sync, no data-dependent allocation) and a replay on
    new device values matches the references."""
    dtype, n, hidden, inter, h, hkv, d = torch.bfloat16, 8, 2048, 5632, 32, 8, 64
    rotary = RotaryEmbedding(d, 4096, 10000.0, None, device=torch.device(GPU))
    x = torch.randn(n, hidden, device=GPU).to(dtype)
    residual = torch.randn(n, hidden, device=GPU).to(dtype)
    weight = torch.randn(hidden, device=GPU).to(dtype)
    qkv = torch.randn(n, (h + 2 * hkv) * d, device=GPU).to(dtype)
    q = qkv[:, : h * d].view(n, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(n, hkv, d)
    positions = torch.randint(0, 4096, (n,), device=GPU)
    gate_up = torch.randn(n, 2 * inter, device=GPU).to(dtype)
    outs = {}

    def step():
        outs["norm"] = rms_norm(x, weight, 1e-5, residual=residual)  # allocates inside the capture
        rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
        outs["mlp"] = silu_and_mul(gate_up)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in (x, residual, qkv, gate_up):
        t.copy_(torch.randn_like(t))
    positions.copy_(torch.randint(0, 4096, (n,), device=GPU))
    res0, q0, k0 = residual.clone(), q.clone(), k.clone()
    graph.replay()
    torch.cuda.synchronize()
    ref, new_res, y = rms_norm_ref(x, weight, 1e-5, res0)
    assert torch.equal(residual, new_res)
    _check_rms_out(outs["norm"], ref, y, weight, "graph rms_norm")
    rq, rk = rotary_ref(positions, q0, k0, rotary.cos, rotary.sin)
    assert int(ulp_dist(q, rq).max()) <= 1 and int(ulp_dist(k, rk).max()) <= 1
    assert torch.equal(outs["mlp"], silu_and_mul_ref(gate_up))
