"""Batch-invariant paged attention (`LLM(batch_invariant=True)`): a query's output has the same bits
whatever step it is in (decoded alone, verified among 1 + k drafts, in a prefill chunk, beside
other requests), so speculative greedy output equals target-only greedy output on a GPU in bf16 too.

tandem/kernels/attention.py picks its tiles and its split-K from the step (the query length, the
batch, the SM count), so a query's keys are summed in an order that depends on the step. Here the
order is fixed by the query alone:

- keys are cut into chunks of CHUNK_KEYS at fixed positions (0, CHUNK_KEYS, 2 CHUNK_KEYS, ...);
  each chunk's softmax partial (max m, sum l, acc) starts fresh and walks its keys in BLOCK_N
  tiles (tandem.kernels.attention._attn_tile); keys a query does not see are masked to -inf, which
  leaves every sum it takes part in unchanged;
- the partials are merged in chunk order by `_merge` (M = max(M, m); L = L 2^(M_old - M) + l 2^(m - M);
  acc likewise), then divided by `_finish`;
- one tile shape for every step of a model (`invariant_tile`, from its head layout and dtype alone: 64
  query rows and 64-key tiles in bf16 / fp16 at head_dim <= 128), and no floating-point contraction
  (enable_fp_fusion=False), so each product and sum is rounded the same way.

Two launches compute that same function. A step of one query tile per request with few programs
(decode, verification at a small batch) runs each (request, KV head, chunk) as a program that stores
its partial; `_merge_kernel` merges them (a request with one chunk is finished in place). Any other
step (prefill chunks, large batches) runs each (query tile, request, KV head) as a program that walks
the chunks itself, merging as it goes. tests/kernels/test_chunked_attention.py checks both against
each other bit for bit, and against the PyTorch reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.attention import _LOG2E, _attn_tile
from tandem.kernels.device import interpreting, num_sms

CHUNK_KEYS = 512  # keys a chunk holds (a multiple of every BLOCK_N below)
SPLIT_MAX_BYTES = 64 << 20  # the most memory the split launch's partials may take (else the walk)


@triton.jit
def _merge(M, L, A, m, l, acc):
    """Merge one chunk's partial (m, l [R], acc [R, D]) into the running (M, L, A)."""
    M_new = tl.maximum(M, m)
    safe = tl.where(M_new == -float("inf"), 0.0, M_new)
    a = tl.exp2(M - safe)
    b = tl.exp2(m - safe)
    return M_new, L * a + l * b, A * a[:, None] + acc * b[:, None]


@triton.jit
def _finish(A, L):
    return A / tl.where(L == 0.0, 1.0, L)[:, None]  # no visible key (a padding request): 0


@triton.jit
def _chunk(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, q_pos, lo, hi, diag, scale_log2,
           stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr,
           DOT_PREC: tl.constexpr):
    """The softmax partial of keys [lo, hi) for the tile's queries (keys below diag seen by all)."""
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end = tl.maximum(lo, lo + ((tl.minimum(hi, diag) - lo) // BLOCK_N) * BLOCK_N)
    m_i, l_i, acc = _attn_tile(
        q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, q_pos, lo, full_end, m_i, l_i, acc, scale_log2,
        stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
        MASKED=False, BLOCK_N=BLOCK_N, CACHE_BLOCK=CACHE_BLOCK, DOT_PREC=DOT_PREC,
    )
    return _attn_tile(
        q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, q_pos, full_end, hi, m_i, l_i, acc, scale_log2,
        stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
        MASKED=True, BLOCK_N=BLOCK_N, CACHE_BLOCK=CACHE_BLOCK, DOT_PREC=DOT_PREC,
    )


@triton.jit(do_not_specialize=["stride_bt", "num_tokens"])
def _chunked_attention_kernel(
    q_ptr,  # [num_tokens, H, D]
    k_cache_ptr,  # [num_blocks, CACHE_BLOCK, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [num_tokens, H, D]
    block_tables_ptr,  # [num_reqs, max_blocks]
    seq_lens_ptr,  # [num_reqs]
    cu_q_lens_ptr,  # [num_reqs + 1]
    part_m_ptr,  # [num_chunks, num_tokens, H] fp32 (SPLIT only)
    part_l_ptr,  # [num_chunks, num_tokens, H] fp32 (SPLIT only)
    part_acc_ptr,  # [num_chunks, num_tokens, H, BLOCK_D] fp32 (SPLIT only)
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    num_tokens,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CACHE_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """SPLIT: program (chunk, request, KV head) stores that chunk's partial (or, for a request whose
    keys fit one chunk, the output); else program (query tile, request, KV head) walks every chunk."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    if SPLIT:
        tile = 0
        chunk = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        chunk = 0
    req = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_lens_ptr + req).to(tl.int32)
    q_len = tl.load(cu_q_lens_ptr + req + 1).to(tl.int32) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    ctx = seq_len - q_len
    hi = ctx + tl.minimum((tile + 1) * BLOCK_Q, q_len)  # keys [0, hi) cover the tile's last query
    if chunk * CHUNK >= tl.maximum(hi, 1):
        return

    offs_m = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head = kvh * GROUP + g
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    elif k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)  # an fp8 cache's tiles widen to fp16 (as tandem/kernels/attention.py)
    q_pos = ctx + qi
    diag = ctx + tile * BLOCK_Q
    bt_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kvh.to(tl.int64) * stride_kh

    M = tl.full([BLOCK_M], -float("inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    A = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if SPLIT:
        lo = chunk * CHUNK
        m, l, acc = _chunk(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, q_pos, lo,
                           tl.minimum(hi, lo + CHUNK), diag, scale_log2, stride_kb, stride_ks, stride_vb, stride_vs,
                           offs_d, d_mask, BLOCK_M, BLOCK_D, BLOCK_N, CACHE_BLOCK, DOT_PREC)
        if hi > CHUNK:  # several chunks: this one's partial, for _merge_kernel
            heads = q_rows * GROUP * tl.num_programs(2) + head  # (token, head) of each row
            at = chunk.to(tl.int64) * num_tokens * GROUP * tl.num_programs(2) + heads
            tl.store(part_m_ptr + at, m, mask=row_ok)
            tl.store(part_l_ptr + at, l, mask=row_ok)
            tl.store(part_acc_ptr + at[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
            return
        M, L, A = _merge(M, L, A, m, l, acc)
    else:
        for lo in range(0, hi, CHUNK):
            m, l, acc = _chunk(q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, q_pos, lo,
                               tl.minimum(hi, lo + CHUNK), diag, scale_log2, stride_kb, stride_ks, stride_vb,
                               stride_vs, offs_d, d_mask, BLOCK_M, BLOCK_D, BLOCK_N, CACHE_BLOCK, DOT_PREC)
            M, L, A = _merge(M, L, A, m, l, acc)
    out = _finish(A, L)
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_kernel(
    out_ptr, cu_q_lens_ptr, seq_lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_ot, stride_oh, num_tokens,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (request, KV head) of a SPLIT launch: its chunks' partials merged in chunk order."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(cu_q_lens_ptr + req).to(tl.int32)
    q_len = tl.load(cu_q_lens_ptr + req + 1).to(tl.int32) - q_start
    hi = tl.load(seq_lens_ptr + req).to(tl.int32)  # one query tile: its last query sees every key
    if q_len > 0 and hi > CHUNK:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        qi = offs_m // GROUP_PAD
        g = offs_m % GROUP_PAD
        row_ok = (qi < q_len) & (g < GROUP)
        q_rows = (q_start + qi).to(tl.int64)
        head = kvh * GROUP + g
        heads = q_rows * GROUP * tl.num_programs(1) + head
        M = tl.full([BLOCK_M], -float("inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        A = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for c in range(0, tl.cdiv(hi, CHUNK)):
            at = c * num_tokens.to(tl.int64) * GROUP * tl.num_programs(1) + heads
            m = tl.load(part_m_ptr + at, mask=row_ok, other=-float("inf"))
            l = tl.load(part_l_ptr + at, mask=row_ok, other=0.0)
            acc = tl.load(part_acc_ptr + at[:, None] * BLOCK_D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            M, L, A = _merge(M, L, A, m, l, acc)
        out = _finish(A, L)
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


def invariant_tile(group_pad: int, block_d: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """-> (BLOCK_Q, BLOCK_N, num_warps, num_stages): one tile for every step of a model (a query's
    bits must not depend on the step's query length or batch)."""
    if elem_bytes == 4:  # IEEE fp32 dots on FMA units: small tiles
        block_m, block_n = 32, 32
    elif block_d > 128:
        block_m, block_n = 64, 32
    else:
        block_m, block_n = 64, 64
    return max(1, block_m // group_pad), block_n, 4, 2


def chunked_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                      cu_q_lens: Tensor, max_q_len: int, scale: float, out: Tensor, split: bool | None = None) -> Tensor:
    """tandem.kernels.attention.paged_attention's contract (its argument forms and padding rules),
    computed batch-invariantly (above). split: force the launch form (None: chosen from the step;
    both give the same bits)."""
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    assert out.shape == q.shape and out.dtype == q.dtype and q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim and num_heads % num_kv_heads == 0
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs
    assert block_tables.dtype in (torch.int32, torch.int64) and seq_lens.dtype in (torch.int32, torch.int64)
    assert cu_q_lens.dtype in (torch.int32, torch.int64)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert cu_q_lens.shape == (num_reqs + 1,) and 16 <= head_dim <= 256 and max_q_len >= 1
    if num_reqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_q, block_n, num_warps, num_stages = invariant_tile(group_pad, block_d, q.element_size())
    num_q_tiles = triton.cdiv(max_q_len, block_q)
    num_chunks = triton.cdiv(block_tables.shape[1] * k_cache.shape[1], CHUNK_KEYS)  # the most keys a table covers
    part_bytes = num_chunks * num_tokens * num_heads * (block_d + 2) * 4
    if split is None:
        split = (num_q_tiles == 1 and num_reqs * num_kv_heads < 2 * num_sms(q.device)
                 and part_bytes <= SPLIT_MAX_BYTES)
    assert not split or num_q_tiles == 1, "the split launch takes one query tile per request"
    if split:
        part_m = torch.empty(num_chunks, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_chunks, num_tokens, num_heads, block_d, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    consts = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=block_d,
                  CHUNK=CHUNK_KEYS)
    _chunked_attention_kernel[(num_chunks if split else num_q_tiles, num_reqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_q_lens, part_m, part_l, part_acc, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), num_tokens,
        BLOCK_N=block_n, CACHE_BLOCK=k_cache.shape[1], SPLIT=split,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(),  # (the interpreter's bf16 dot: attention.py)
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False, **consts,
    )
    if split:
        _merge_kernel[(num_reqs, num_kv_heads)](
            out, cu_q_lens, seq_lens, part_m, part_l, part_acc, out.stride(0), out.stride(1), num_tokens,
            num_warps=num_warps, enable_fp_fusion=False, **consts,
        )
    return out
