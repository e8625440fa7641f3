"""Paged attention for mixed batches (decode, verification, prefill chunks) in one launch.

Request r owns query tokens cu_q_lens[r] .. cu_q_lens[r+1] and keys 0 .. seq_lens[r]-1 (this
step's keys included, already in the cache); its query token i sits at position
seq_lens[r] - q_len + i and attends to every key at a position <= its own.

One program handles one request, one KV head and one tile of BLOCK_Q query tokens; the rows of
its tl.dot are (query token, query head of that KV head) pairs, so each K/V tile is read once
for all GROUP heads. Decode and verification fit in one tile; prefill chunks tile over the
queries. Softmax is online (flash-style) in fp32, in base 2. Keys before the tile's first
query position need no causal mask and run in an unmasked loop; the rest run masked.

Split-K: when the batch is one tile per request and too small to fill the chip, each program
takes 1/num_splits of its request's keys (at least MIN_SPLIT_KEYS) and writes (acc, max, sum)
partials, which a second kernel merges. The number of splits with keys is decided on the device
from seq_len, so a short context runs one split that writes the output itself and the merge
exits at once: a captured graph serves every context length without paying for empty splits.
(The last split to finish merging them itself, after an atomic count, saved no time against the
merge kernel: H200, docs/benchmarks.md, forty-eighth run.)
The grid comes from host-known bounds (num_reqs, max_q_len); programs past a request's real
length exit, so the launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.device import interpreting, num_sms
from tandem.kernels.pdl import pdl_flags, release_then_wait, wait_for_inputs

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32  # split-K factors are powers of two up to this


@triton.jit
def _attn_tile(
    q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, q_pos, start, end, m_i, l_i, acc, scale_log2,
    stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) over keys [start, end) in BLOCK_N steps."""
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            key_ok = keys < end
            blk = tl.load(bt_row_ptr + keys // CACHE_BLOCK, mask=key_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row_ptr + keys // CACHE_BLOCK).to(tl.int64)
        within = keys % CACHE_BLOCK
        k_off = blk * stride_kb + within * stride_ks + kv_head_off
        v_off = blk * stride_vb + within * stride_vs + kv_head_off
        if MASKED:
            kv_mask = key_ok[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
            v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        k = k.to(q.dtype)  # as q: fp32 where the caller upcast it; an fp8 cache's keys and values widened
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_M, BLOCK_N]
        if MASKED:
            s = tl.where(key_ok[None, :] & (keys[None, :] <= q_pos[:, None]), s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


# The split count and the block table's row stride vary from step to step: not specialised on
# (Triton would compile a variant for each value that is 1 or divisible by 16, mid-serving).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, H, D]
    k_cache_ptr,  # [num_blocks, CACHE_BLOCK, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [num_tokens, H, D]
    block_tables_ptr,  # [num_reqs, max_blocks] int32 / int64
    seq_lens_ptr,  # [num_reqs]
    cu_q_lens_ptr,  # [num_reqs + 1]
    part_acc_ptr,  # [num_reqs, Hkv, num_splits, BLOCK_M, BLOCK_D] fp32 (split-K only)
    part_ml_ptr,  # [num_reqs, Hkv, num_splits, 2, BLOCK_M] fp32 (split-K only)
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    num_splits,  # split-K factor (1 without SPLIT)
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    SPLIT: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    if SPLIT:
        tile = 0
        split = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        split = 0
    req = tl.program_id(1)
    kvh = tl.program_id(2)
    # The step's metadata is read before the wait: it was written before the forward's first
    # kernel, which launches plainly, so it is complete before this one starts (see pdl.py).
    q_start = tl.load(cu_q_lens_ptr + req).to(tl.int32)
    q_len = tl.load(cu_q_lens_ptr + req + 1).to(tl.int32) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    wait_for_inputs(PDL)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head = kvh * GROUP + g
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_mask[None, :], other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)
    elif k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        # An fp8 cache's tiles widen to fp16 in one conversion (to bf16 it takes three, and they
        # bound the loop: bench/gpu_kernels.py --fp8-attn), so the dots run in fp16: q's values in
        # fp16 (more mantissa than bf16; attention queries stay far inside its range), fp32 sums.
        q = q.to(tl.float16)
    q_pos = ctx + qi

    # Keys [0, hi) cover the tile's last query; keys below `diag` are visible to every query.
    hi = ctx + tl.minimum((tile + 1) * BLOCK_Q, q_len)
    diag = ctx + tile * BLOCK_Q
    lo = 0
    num_active = 1
    if SPLIT:
        chunk = _split_chunk(hi, num_splits, BLOCK_N, MIN_SPLIT_KEYS)
        num_active = tl.maximum(1, tl.cdiv(hi, chunk))
        if split >= num_active:
            return
        lo = split * chunk
        hi = tl.minimum(hi, lo + chunk)
    full_end = tl.maximum(lo, lo + ((tl.minimum(hi, diag) - lo) // BLOCK_N) * BLOCK_N)

    bt_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kvh.to(tl.int64) * stride_kh
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attn_tile(
        q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, q_pos, lo, full_end, m_i, l_i, acc, scale_log2,
        stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
        MASKED=False, BLOCK_N=BLOCK_N, CACHE_BLOCK=CACHE_BLOCK, DOT_PREC=DOT_PREC,
    )
    m_i, l_i, acc = _attn_tile(
        q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, q_pos, full_end, hi, m_i, l_i, acc, scale_log2,
        stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_mask,
        MASKED=True, BLOCK_N=BLOCK_N, CACHE_BLOCK=CACHE_BLOCK, DOT_PREC=DOT_PREC,
    )

    if num_active == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no visible key (seq_len 0 padding): 0
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    else:
        part = (req * tl.num_programs(2) + kvh) * num_splits + split
        pa = part_acc_ptr + part.to(tl.int64) * (BLOCK_M * BLOCK_D)
        tl.store(pa + offs_m[:, None] * BLOCK_D + offs_d[None, :], acc)
        pml = part_ml_ptr + part.to(tl.int64) * (2 * BLOCK_M)
        tl.store(pml + offs_m, m_i)
        tl.store(pml + BLOCK_M + offs_m, l_i)


@triton.jit
def _split_chunk(hi, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr):
    """Keys per split for a request whose queries see keys [0, hi): a multiple of BLOCK_N."""
    chunk = tl.cdiv(tl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(chunk, MIN_SPLIT_KEYS)


@triton.jit(do_not_specialize=["num_splits"])
def _split_merge_kernel(
    out_ptr, cu_q_lens_ptr, seq_lens_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr, PDL: tl.constexpr,
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the active splits of one
    (req, kv head); with one active split the attention kernel wrote out itself."""
    release_then_wait(PDL)  # the o_proj GEMV follows: its programs are placed during the attention
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(cu_q_lens_ptr + req).to(tl.int32)
    q_len = tl.load(cu_q_lens_ptr + req + 1).to(tl.int32) - q_start
    hi = tl.load(seq_lens_ptr + req).to(tl.int32)  # one query tile: the last query sees every key
    num_active = tl.maximum(1, tl.cdiv(hi, _split_chunk(hi, num_splits, BLOCK_N, MIN_SPLIT_KEYS)))
    if q_len > 0 and num_active > 1:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_s = tl.arange(0, MAX_SPLITS)
        base = (req * tl.num_programs(1) + kvh).to(tl.int64) * num_splits
        ml = part_ml_ptr + base * (2 * BLOCK_M)
        m_all = tl.load(ml + offs_s[:, None] * (2 * BLOCK_M) + offs_m[None, :],
                        mask=(offs_s < num_active)[:, None], other=-float("inf"))  # [MAX_SPLITS, BLOCK_M]
        m_max = tl.max(m_all, 0)
        m_max = tl.where(m_max == -float("inf"), 0.0, m_max)
        l_tot = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(0, num_active):
            w = tl.exp2(tl.load(ml + s * (2 * BLOCK_M) + offs_m) - m_max)
            l_tot += w * tl.load(ml + s * (2 * BLOCK_M) + BLOCK_M + offs_m)
            a = tl.load(part_acc_ptr + (base + s) * (BLOCK_M * BLOCK_D) + offs_m[:, None] * BLOCK_D + offs_d[None, :])
            acc += w[:, None] * a
        qi = offs_m // GROUP_PAD
        g = offs_m % GROUP_PAD
        row_ok = (qi < q_len) & (g < GROUP)
        q_rows = (q_start + qi).to(tl.int64)
        head = kvh * GROUP + g
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        out = acc / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


def _tile_config(max_q_len: int, group_pad: int, block_d: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """-> (BLOCK_Q, BLOCK_N, num_warps, num_stages) for a host-known query-length bound."""
    wide = elem_bytes == 4 or block_d > 128
    if elem_bytes == 4:  # IEEE fp32 dots run on FMA units: small tiles keep them in registers
        max_m, block_n, stages = 32, 32, 2
    elif block_d > 128:  # D = 256: halve the tiles to fit shared memory
        max_m, block_n, stages = 64, 32, 2
    else:
        max_m, block_n, stages = 128, 64, 3
    block_q = triton.next_power_of_2(max(1, max_q_len))
    block_q = max(block_q, triton.cdiv(16, group_pad))  # tl.dot needs M >= 16
    block_q = max(1, min(block_q, max_m // group_pad))
    block_m = block_q * group_pad
    if block_m <= 64 and not wide:
        block_n = 128  # decode / verify: memory-bound, longer K/V tiles (H200 sweep: 76% -> 97% of copy bw)
    num_warps = 8 if block_m >= 128 or elem_bytes == 4 else 4
    return block_q, block_n, num_warps, stages


@functools.cache
def _max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may take on the device (0 where torch does not say)."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def _default_splits(num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM, a power of two, at most MAX_SPLITS."""
    programs = max(1, num_reqs * num_kv_heads)
    want = max(1, (2 * num_sms(device)) // programs)
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_q_lens: Tensor,
    max_q_len: int,
    scale: float,
    out: Tensor,
    num_splits: int | None = None,
    tile_override: tuple[int, int, int] | None = None,
    min_split_keys: int | None = None,
) -> Tensor:
    """Causal paged attention over a batch of requests; writes and returns out.

    q, out [num_tokens, H, D] bf16 / fp16 / fp32 (last dim contiguous); k_cache, v_cache
    [num_blocks, block_size, Hkv, D] with H % Hkv == 0, q's dtype or float8 e4m3 (read widened);
    block_tables [num_reqs, max_blocks] int32 / int64; seq_lens [num_reqs] int32 / int64, each request's keys including this
    step's (stored before the call); cu_q_lens [num_reqs + 1] int32 / int64, query offsets
    (q_len = 0 is allowed and skipped); max_q_len >= every q_len (host-known bound, no sync).
    Rows of q past cu_q_lens[-1] are not written; a query with no visible key (a padding
    request with seq_len 0) gets zeros. fp32 runs IEEE dots (no tf32).
    num_splits: split-K factor for one-tile batches (None: pick from the SM count; forced
    to 1 when a request spans several query tiles); min_split_keys: fewest keys a split takes
    (None: BLOCK_N, one key tile; rounded up to BLOCK_N), so short contexts use fewer splits.
    tile_override: (BLOCK_N, num_warps, num_stages) in place of the built-in choice, for
    tuning sweeps.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    assert out.shape == q.shape and out.dtype == q.dtype and q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert num_heads % num_kv_heads == 0
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs and block_tables.stride(1) == 1
    assert block_tables.dtype in (torch.int32, torch.int64)
    assert seq_lens.dtype in (torch.int32, torch.int64) and cu_q_lens.dtype in (torch.int32, torch.int64)
    assert cu_q_lens.shape == (num_reqs + 1,)
    assert 16 <= head_dim <= 256 and max_q_len >= 1
    if num_reqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_q, block_n, num_warps, num_stages = _tile_config(max_q_len, group_pad, block_d, q.element_size())
    if tile_override is not None:
        block_n, num_warps, num_stages = tile_override
    num_q_tiles = triton.cdiv(max_q_len, block_q)
    if num_q_tiles > 1:
        num_splits = 1
    elif num_splits is None:
        num_splits = _default_splits(num_reqs, num_kv_heads, q.device)
    assert 1 <= num_splits <= MAX_SPLITS and num_splits & (num_splits - 1) == 0, \
        "num_splits must be a power of two, at most MAX_SPLITS"
    block_m = block_q * group_pad
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if (tile_override is None and fp8 and block_m <= 64 and block_d <= 128 and 1 < num_splits <= 4
            and q.element_size() == 2 and _max_shared_memory(q.device) >= 200 << 10):
        # Decode / verify over an fp8 cache with 2-4 splits (B = 8-16 at D = 128): its loop is bound
        # by widening the tiles, not by their bytes, and a deeper pipeline (6 x 32 KB of K and V
        # tiles) keeps the loads ahead of it (H200, bench/gpu_kernels.py --fp8-attn, ctx 4096: B=16
        # 72.3 -> 60.6 us). More splits (B=1) keep the rule below; none (B=64), the built-in tile.
        # (6 stages take ~192 KB of shared memory: Hopper's 227 KB a block, not Ada's 99.)
        num_stages = 6
    elif tile_override is None and num_splits > 1 and block_m <= 64 and q.element_size() == 2 and block_d <= 128:
        # Small decode / verify batches (split-K on): no software pipelining, whose prologue costs
        # more than it hides over a split's few key tiles (H200, bench/gpu_kernels.py --short-attn and
        # --sweep: 10.1 -> 8.4 us at 150 keys, 26.4 -> 23.7 at 4096, B=8 50.4 -> 49.9; without
        # splits, B=32 / 64 at 4096 keys lose 7-8% with it, so they keep the pipeline).
        num_stages = 1
    if min_split_keys is not None:
        min_split_keys = triton.cdiv(min_split_keys, block_n) * block_n
    if num_splits > 1:
        part_acc = torch.empty((num_reqs, num_kv_heads, num_splits, block_m, block_d), dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty((num_reqs, num_kv_heads, num_splits, 2, block_m), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    consts = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_D=block_d,
                  MIN_SPLIT_KEYS=min_split_keys or block_n, **pdl_flags(q))
    _paged_attention_kernel[(num_q_tiles * num_splits, num_reqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_q_lens, part_acc, part_ml, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), num_splits,
        SPLIT=num_splits > 1, BLOCK_N=block_n, CACHE_BLOCK=k_cache.shape[1],
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        # NOTE: Triton 3.6's interpreter multiplies raw bf16 bits in tl.dot; upcast there only.
        UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(),
        num_warps=num_warps, num_stages=num_stages, **consts,
    )
    if num_splits > 1:
        _split_merge_kernel[(num_reqs, num_kv_heads)](
            out, cu_q_lens, seq_lens, part_acc, part_ml, out.stride(0), out.stride(1), num_splits,
            MAX_SPLITS=MAX_SPLITS, BLOCK_N=block_n, num_warps=4, **consts,
        )
    return out

