"""The batch-invariant attention (tandem/kernels/chunked_attention.py) and GEMM (tandem/kernels/gemm_invariant.py):
a query's output, a row's product, has the same bits whatever step computes it; both near their references.

Each query of a request is computed in a prefill chunk (the walk over chunks), alone as a decode (both
launch forms), among a verification's rows and beside other requests: every form's row must equal every
other's bit for bit, and the PyTorch reference (dense_paged_attention) within rounding. Outputs are poisoned
(NaN) first. GPU tests run on CUDA; interpreter variants with TANDEM_TRITON_INTERPRET=1 (small chunks).
"""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TANDEM_TRITON_INTERPRET") == "1"
if INTERPRET:  # must precede the first `import triton`
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

import tandem.kernels.chunked_attention as ca  # noqa: E402
from tandem.kernels.gemm_invariant import gemm_invariant  # noqa: E402
from tandem.kernels.gemm_rows import rows_config  # noqa: E402
from tandem.layers.table_attention import dense_paged_attention  # noqa: E402
from tests.kernels.interp import interpret_mark  # noqa: E402

gpu = pytest.mark.gpu  # (skipped without CUDA: tests/conftest.py)
interp = interpret_mark(ca._chunked_attention_kernel)


def _cache(num_blocks, block_size, kv_heads, head_dim, dtype, device, g, cache_dtype=None):
    k = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)).to(device, dtype)
    v = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)).to(device, dtype)
    if cache_dtype is not None:
        k, v = k.to(cache_dtype), v.to(cache_dtype)
    return k, v


def _attend(q, k_cache, v_cache, tables, seq_lens, q_lens, split):
    """chunked_attention over requests given as (their rows of q, table, seq_len); -> out."""
    dev = q.device
    cu = torch.tensor([0] + q_lens, device=dev).cumsum(0)
    out = torch.full_like(q, float("nan"))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
    ca.chunked_attention(q, k_cache, v_cache, bt, torch.tensor(seq_lens, device=dev), cu.to(torch.int32),
                         max(q_lens), 0.1, out, split=split)
    return out, bt, cu


def check_invariance(heads, kv_heads, head_dim, seq_len, dtype, device, cache_dtype=None, block_size=16, n=7):
    """Request A's last `n` queries: one prefill chunk (several query tiles where n is large), each alone
    (split and walked), beside another request, a verification of 3 rows: the same bits; and near the reference."""
    g = torch.Generator().manual_seed(heads * 131 + seq_len)
    nblk = -(-seq_len // block_size)
    k_cache, v_cache = _cache(2 * nblk + 8, block_size, kv_heads, head_dim, dtype, device, g, cache_dtype)
    table_a = torch.randperm(2 * nblk + 8, generator=g)[:nblk].tolist()
    table_b = torch.randperm(2 * nblk + 8, generator=g)[:nblk].tolist()
    q_a = torch.randn(n, heads, head_dim, generator=g).to(device, dtype)
    chunk, bt, cu = _attend(q_a, k_cache, v_cache, [table_a], [seq_len], [n], split=False)
    ref = dense_paged_attention(q_a, k_cache, v_cache, bt, torch.tensor([seq_len], device=device), cu, n, 0.1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(chunk.float(), ref.float(), atol=tol, rtol=tol)
    other = torch.randn(5, heads, head_dim, generator=g).to(device, dtype)
    for i in range(n):
        pos = seq_len - n + i
        for split in (False, True):
            alone, _, _ = _attend(q_a[i:i + 1], k_cache, v_cache, [table_a], [pos + 1], [1], split)
            assert torch.equal(alone, chunk[i:i + 1]), (i, split)
        # beside request B's 5 queries (a longer context), as the second request of the step
        both = torch.cat([other, q_a[i:i + 1]])
        out, _, _ = _attend(both, k_cache, v_cache, [table_b, table_a], [seq_len, pos + 1], [5, 1], None)
        assert torch.equal(out[5:], chunk[i:i + 1]), i
    # a verification of the last 3 queries, split and walked
    for split in (False, True):
        ver, _, _ = _attend(q_a[n - 3:], k_cache, v_cache, [table_a], [seq_len], [3], split)
        assert torch.equal(ver, chunk[n - 3:]), split


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_attention_is_batch_invariant_interpreted(dtype, monkeypatch):
    monkeypatch.setattr(ca, "CHUNK_KEYS", 128)  # several chunks at the interpreter's sizes
    check_invariance(4, 2, 32, 300, dtype, "cpu")


@interp
@pytest.mark.parametrize("seq_len", [128, 256, 257])
def test_chunked_attention_tiles_padding_and_exact_chunks_interpreted(seq_len, monkeypatch):
    """A prefill of several query tiles (80 queries, GQA 3 heads a KV head, padded to 4) whose keys end at a
    chunk's edge or one past it; then, in one step, a padding request (seq_len 0, q_len 2: zeros), a request
    with no query and one of the prefill's queries alone: the same bits as in the prefill."""
    monkeypatch.setattr(ca, "CHUNK_KEYS", 128)
    check_invariance(6, 2, 32, seq_len, torch.float32, "cpu", n=80)
    g = torch.Generator().manual_seed(seq_len)
    k_cache, v_cache = _cache(40, 16, 2, 32, torch.float32, "cpu", g)
    table = list(range(1, 1 + -(-seq_len // 16)))
    q = torch.randn(seq_len, 6, 32, generator=g)
    whole, _, _ = _attend(q, k_cache, v_cache, [table], [seq_len], [seq_len], split=False)
    for split in (False, True):
        step = torch.cat([torch.randn(2, 6, 32, generator=g), q[-1:]])
        out, _, _ = _attend(step, k_cache, v_cache, [[0], [0], table], [0, 5, seq_len], [2, 0, 1], split)
        assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.equal(out[2:], whole[-1:]), split


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 8, 128), (12, 2, 128), (16, 16, 64), (8, 1, 256)])
def test_chunked_attention_is_batch_invariant_gpu(dtype, shape):
    for seq_len in (40, 600, 1500):
        check_invariance(*shape, seq_len, dtype, "cuda")


@gpu
def test_chunked_attention_over_an_fp8_cache_gpu():
    check_invariance(32, 8, 128, 1100, torch.bfloat16, "cuda", cache_dtype=torch.float8_e4m3fn)


@gpu
def test_chunked_attention_padding_requests_get_zeros_gpu():
    """A padding request (seq_len 0, a graph's inert row) gets zeros, in both launch forms."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = _cache(8, 16, 2, 64, torch.bfloat16, "cuda", g)
    q = torch.randn(2, 4, 64, generator=g).to("cuda", torch.bfloat16)
    for split in (False, True):
        out, _, _ = _attend(q, k_cache, v_cache, [[1, 2], [0]], [20, 0], [1, 1], split)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def check_gemm_invariant(n, k, dtype, device, fp8=False, act=None, bias=False):
    """A row's product has the same bits alone, among 5, 16, 17, 40 and 100 rows, at every tile and 1, 2, 4 (the
    plan's) or 8 row tiles a program, the weight the dot's first operand or its second; near the fp32 product. (Triton's
    interpreter sums a dot's BLOCK_K columns at once, a GPU 16 at a time: its tiles keep one BLOCK_K.)"""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(100, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    w_scale = None
    if fp8:
        from tandem.layers.quant import quantize_fp8

        w8, w_scale = quantize_fp8(w)
        w = w8
    small = device == "cpu"  # (the interpreter: tiles within its small weights, one BLOCK_K, see above)
    plan = (32, 32, 4, 2, False) if small else None  # (None: invariant_plan's for each row count)
    full = gemm_invariant(x, w, b, act=act, w_scale=w_scale, config=plan)
    for m in (1, 5, 16, 17, 40):
        part = gemm_invariant(x[3:3 + m], w, b, act=act, w_scale=w_scale, config=plan)
        assert torch.equal(part, full[3:3 + m]), m
    configs = [(32, 32, 4, 2, False), (64, 32, 4, 2, False), (128, 32, 4, 2, False)] if small else [
        (32, 128, 4, 4, False), (64, 64, 4, 4, False), (128, 64, 4, 3, False), (128, 128, 8, 3, False)]
    if not fp8:
        configs.append((32, 32, 4, 2, True) if small else rows_config(n, k) + (True,))
    for config in configs:  # weight first or second, any tile, 1-8 row tiles a program: the same bits
        for tiles in (1, 2, 8):
            got = gemm_invariant(x, w, b, act=act, w_scale=w_scale, tiles=tiles, config=config)
            assert torch.equal(got, full), (config, tiles)
    wf = (w.float() * w_scale[:, None]) if fp8 else w.float()
    ref = x.float() @ wf.t() + (b.float() if b is not None else 0)
    if act == "silu_mul":
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(full.float(), ref, atol=3e-2, rtol=3e-2)


@interp
def test_gemm_invariant_rows_interpreted():
    check_gemm_invariant(64, 96, torch.float16, "cpu", bias=True)
    check_gemm_invariant(64, 64, torch.float16, "cpu", act="silu_mul")
    check_gemm_invariant(64, 64, torch.bfloat16, "cpu", fp8=True, act="silu_mul")
    check_gemm_invariant(72, 80, torch.float16, "cpu", act="silu_mul", bias=True)  # (K, N and pairs past the tiles)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (2048, 2048),
                                  (3072, 2048), (512, 200), (128256 // 8, 4096)])
def test_gemm_invariant_rows_gpu(n, k, dtype):
    check_gemm_invariant(n, k, dtype, "cuda", bias=n == 512)


@gpu
@pytest.mark.parametrize("n, k", [(28672, 4096), (4096, 14336), (2000, 1000)])  # (the last: K, N and pairs past tiles)
def test_gemm_invariant_silu_mul_and_fp8_gpu(n, k):
    check_gemm_invariant(n, k, torch.bfloat16, "cuda", act="silu_mul" if n > k else None)
    check_gemm_invariant(n, k, torch.bfloat16, "cuda", fp8=True, act="silu_mul" if n > k else None)

