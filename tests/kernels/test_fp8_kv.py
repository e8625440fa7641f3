"""The Triton kernels over a float8 (e4m3) KV cache (kv_cache_dtype='fp8'). Each writer (the KV
store, the rotary kernel's store, the qkv GEMV's and the few-row GEMM's epilogues) stores what
tandem.layers.attention.to_cache makes of what it stores in a cache of the model's dtype (the
same bits: saturated at +-448, rounded to nearest even); paged attention reads the cache widened:
the output over a cache of q's dtype holding those values (to the last bits in fp16, where the
widened tile may compile to another dot), and near the float64 reference. GPU only (Triton's
interpreter has no float8)."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from tandem.kernels.attention import paged_attention  # noqa: E402
from tandem.kernels.fused import rotary_embedding  # noqa: E402
from tandem.kernels.gemm_rows import gemm_rows_qkv_rope  # noqa: E402
from tandem.kernels.gemv import gemv_qkv_rope  # noqa: E402
from tandem.kernels.kv_store import kv_store  # noqa: E402
from tandem.layers.attention import to_cache  # noqa: E402
from tandem.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernels.refs import paged_attention_ref  # noqa: E402
from tests.kernels.test_kernels import make_attention_batch, rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FP8 = torch.float8_e4m3fn
DEV = "cuda"


def caches(shape, dtype):
    """(k, v) zeroed in dtype and in fp8: a slot neither writes stays 0 in both."""
    return [torch.zeros(shape, dtype=d, device=DEV) for d in (dtype, dtype, FP8, FP8)]


def assert_stored_alike(fp8_cache, wide_cache):
    assert torch.equal(fp8_cache.view(torch.uint8), to_cache(wide_cache, FP8).view(torch.uint8))


def slots_with_padding(g, num_tokens, num_slots):
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1
    return slots.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (2, 64)])
def test_kv_store_into_fp8(dtype, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    fused = (torch.randn(200, 3, num_kv_heads, head_dim, generator=g) * 200).to(dtype).to(DEV)  # outliers past 448
    k, v = fused[:, 0], fused[:, 2]
    slots = slots_with_padding(g, 200, 64 * 16)
    k_ref, v_ref, k8, v8 = caches((64, 16, num_kv_heads, head_dim), dtype)
    kv_store(k, v, k_ref, v_ref, slots)
    kv_store(k, v, k8, v8, slots)
    assert_stored_alike(k8, k_ref)
    assert_stored_alike(v8, v_ref)
    assert k8.float().abs().max() == 448.0 and not k8.float().isnan().any()
    row = int((slots >= 0).nonzero()[0])  # a NaN stays NaN (as torch's cast keeps it), never a finite bound
    k[row, 0, 0] = float("nan")
    kv_store(k, v, k8, v8, slots)
    flat = k8.view(-1, num_kv_heads, head_dim).float()
    assert flat[slots[row], 0, 0].isnan() and flat.isnan().sum() == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rotary_store_into_fp8(num_tokens, dtype):
    g = torch.Generator().manual_seed(num_tokens)
    heads, kv_heads, head_dim = 8, 2, 128
    rot = RotaryEmbedding(head_dim, 4096, 10000.0, None, device=torch.device(DEV))
    pos = torch.randint(0, 4096, (num_tokens,), generator=g).to(DEV)
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 40).to(dtype).to(DEV)
    slots = slots_with_padding(g, num_tokens, 32 * 16)
    k_ref, v_ref, k8, v8 = caches((32, 16, kv_heads, head_dim), dtype)
    outs = []
    for kc, vc in ((k_ref, v_ref), (k8, v8)):
        t = qkv.clone()
        q = t[:, : heads * head_dim].view(num_tokens, heads, head_dim)
        k = t[:, heads * head_dim: (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
        v = t[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
        rotary_embedding(pos, q, k, rot.cos, rot.sin, store=(v, kc, vc, slots))
        outs.append(t)
    assert torch.equal(outs[0], outs[1])
    assert_stored_alike(k8, k_ref)
    assert_stored_alike(v8, v_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim,k", [(32, 8, 128, 4096), (14, 2, 64, 896)])
def test_qkv_rope_epilogues_store_into_fp8(heads, kv_heads, head_dim, k, rows, dtype):
    """One row: the GEMV's epilogue; several: the few-row GEMM's."""
    g = torch.Generator().manual_seed(rows + k)
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) * 8).to(DEV, dtype)  # outputs of std 8 sqrt(k): many past 448
    rot = RotaryEmbedding(head_dim, 512, 500000.0, None, device=torch.device(DEV))
    pos = torch.arange(300, 300 + rows, device=DEV)
    slots = torch.tensor([13, -1, 40, 2, 77][:rows], device=DEV)
    k_ref, v_ref, k8, v8 = caches((24, 4, kv_heads, head_dim), dtype)
    run = gemv_qkv_rope if rows == 1 else gemm_rows_qkv_rope
    out_ref = run(x, w, None, heads, kv_heads, pos, rot.cos, rot.sin, k_ref, v_ref, slots)
    out8 = run(x, w, None, heads, kv_heads, pos, rot.cos, rot.sin, k8, v8, slots)
    assert torch.equal(out8, out_ref)
    assert_stored_alike(k8, k_ref)
    assert_stored_alike(v8, v_ref)
    assert k8.float().abs().max() == 448.0  # saturated, not NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("q_lens,ctx_lens,num_splits,kv_heads", [
    ([1] * 6, [0, 15, 16, 100, 700, 2050], None, 2),  # decodes (split-K picked by the kernel: 16)
    ([1, 1], [300, 4000], 8, 2),
    ([1] * 16, [37 * i + 1000 for i in range(16)], None, 8),  # 2 splits: the fp8 cache's 6-stage tile
    ([1] * 4, [900, 1500, 4000, 4200], 4, 8),
    ([5, 5, 5], [12, 250, 1030], None, 2),  # verifications, 1 + k = 5
    ([40, 1, 130], [100, 33, 0], None, 2),  # prefill chunks beside a decode
])
def test_paged_attention_over_fp8(q_lens, ctx_lens, num_splits, kv_heads, dtype):
    q, k_cache, v_cache, tables, seq_lens, cu = make_attention_batch(DEV, q_lens, ctx_lens, 4 * kv_heads, kv_heads,
                                                                     128, dtype, 16, seed=sum(ctx_lens))
    k8, v8 = to_cache(k_cache * 30, FP8), to_cache(v_cache, FP8)  # keys of all sizes, some saturated
    wide_k, wide_v = k8.to(dtype), v8.to(dtype)
    scale, n = 128 ** -0.5, sum(q_lens)
    out8, wide = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    paged_attention(q, k8, v8, tables, seq_lens, cu, max(q_lens), scale, out8, num_splits=num_splits)
    paged_attention(q, wide_k, wide_v, tables, seq_lens, cu, max(q_lens), scale, wide, num_splits=num_splits)
    assert rel_err(out8[:n], wide[:n]) < (1e-6 if dtype == torch.float32 else 1e-3) and out8[n:].isnan().all()
    ref = torch.zeros(q.shape, dtype=torch.float64, device=DEV)
    paged_attention_ref(q.double(), k8.double(), v8.double(), tables, seq_lens, cu, max(q_lens), scale, ref)
    assert rel_err(out8[:n], ref[:n]) < (1e-5 if dtype == torch.float32 else 1e-2)
