"""The watermark's context hashes on the GPU, bit-exact with tandem.sampling.watermark.

One launch per call instead of the reference's ~80 int64 element-wise ops (gather the slot's
window and drafts, take the last context_width tokens, hash them) and, with deduplication, the
~15 more that search the history: the keys are computed every draft step and every
verification, where those launches cost more than the draws themselves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.gumbel import _fmix32
from tandem.sampling import watermark as ref

_BLOCK = 128  # rows per program
_HASH_START = tl.constexpr(ref.HASH_START)
_TOKEN_MUL = tl.constexpr(ref.TOKEN_MUL)


@triton.jit
def _hash_contexts(windows_ptr, slot, tail_ptr, tail_row, tail_stride, start, live, W: tl.constexpr,
                   HAS_TAIL: tl.constexpr, SIZE: tl.constexpr):
    """The hashes [SIZE] uint32 of the W tokens from `start` [SIZE] on in windows[slot] ++
    tail[tail_row] (slot, tail_row: scalars or [SIZE]); entries where `live` is false are junk."""
    h = tl.full((SIZE,), _HASH_START, tl.uint32)
    for j in tl.static_range(W):
        at = start + j  # index into window ++ tail
        in_window = at < W
        token = tl.load(windows_ptr + slot * W + at, mask=live & in_window, other=0)
        if HAS_TAIL:
            after = tl.load(tail_ptr + tail_row * tail_stride + (at - W), mask=live & ~in_window, other=0)
            token = tl.where(in_window, token, after)
        h = _fmix32(h ^ (token.to(tl.uint32) * _TOKEN_MUL))
    return h


@triton.jit
def _context_hash_kernel(
    windows_ptr,  # [num_slots, W] int64: each slot's last W tokens
    slot_ptr,  # [n] int64: the row's window
    tail_ptr,  # [R, tail_stride] int64: tokens after the windows (unread without HAS_TAIL)
    tail_row_ptr,  # [n] int64: the row's tail row
    num_tail_ptr,  # [n] int64: tail tokens that precede the row
    out_ptr,  # [n] int64: the hash, in [0, 2**32)
    n,
    tail_stride,
    W: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    slot = tl.load(slot_ptr + rows, mask=ok, other=0)
    if HAS_TAIL:
        nt = tl.load(num_tail_ptr + rows, mask=ok, other=0)
        tail_row = tl.load(tail_row_ptr + rows, mask=ok, other=0)
    else:
        nt = tl.zeros((BLOCK,), dtype=tl.int64)
        tail_row = nt
    h = _hash_contexts(windows_ptr, slot, tail_ptr, tail_row, tail_stride, nt, ok, W, HAS_TAIL, BLOCK)
    tl.store(out_ptr + rows, h.to(tl.int64), mask=ok)


def context_hashes(windows: Tensor, slot_ids: Tensor, tail: Tensor | None, tail_rows: Tensor | None,
                   num_tail: Tensor | None) -> Tensor:
    """The hash of the last W tokens of windows[slot] ++ tail[tail_row, :num_tail], per row -> [n]
    int64 (tandem.sampling.watermark.context_hash of last_window(...))."""
    n, width = slot_ids.shape[0], windows.shape[1]
    assert windows.dtype == slot_ids.dtype == torch.int64 and windows.is_contiguous()
    out = torch.empty(n, dtype=torch.int64, device=windows.device)
    if n == 0:
        return out
    has = tail is not None
    if has:
        assert tail.dtype == tail_rows.dtype == num_tail.dtype == torch.int64 and tail.stride(1) == 1
        assert tail_rows.shape == num_tail.shape == (n,)
    _context_hash_kernel[(triton.cdiv(n, _BLOCK),)](
        windows, slot_ids, tail if has else windows, tail_rows if has else slot_ids, num_tail if has else slot_ids,
        out, n, tail.stride(0) if has else 0, W=width, HAS_TAIL=has, BLOCK=_BLOCK,
    )
    return out


@triton.jit
def _context_seen_kernel(
    windows_ptr,  # [num_slots, W] int64
    slot_ptr,  # [n] int64
    tail_ptr,  # [R, tail_stride] int64 (unread without HAS_TAIL)
    tail_row_ptr,  # [n] int64
    num_tail_ptr,  # [n] int64
    history_ptr,  # [num_slots, history_stride] int64: drawn-after context hashes, a ring of H (-1: empty)
    count_ptr,  # [num_slots] int64: entries ever appended
    hash_ptr,  # [n] int64 out: the row's context hash
    seen_ptr,  # [n] int8 out: the context was drawn after already
    tail_stride,
    history_stride,
    H,
    W: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    BLOCK_I: tl.constexpr,  # > the most tail tokens before a row
    BLOCK_H: tl.constexpr,
):
    """One program per row: the hashes of window ++ tail[:i] for every i <= num_tail (i = num_tail is
    the row's own context, i < num_tail the contexts of the rows drawn before it this step), then
    the row's hash against the history entries still within reach."""
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if HAS_TAIL:
        nt = tl.load(num_tail_ptr + row)
        tail_row = tl.load(tail_row_ptr + row)
    else:
        nt = tl.zeros((), dtype=tl.int64)
        tail_row = nt
    i = tl.arange(0, BLOCK_I).to(tl.int64)
    h = _hash_contexts(windows_ptr, slot, tail_ptr, tail_row, tail_stride, i, i <= nt, W, HAS_TAIL, BLOCK_I)
    h64 = h.to(tl.int64)  # (zero-extended)
    own64 = tl.sum(tl.where(i == nt, h64, 0), axis=0)
    seen = tl.sum(tl.where((i < nt) & (h64 == own64), 1, 0), axis=0) > 0
    count = tl.load(count_ptr + slot)
    for c0 in range(0, H, BLOCK_H):
        col = c0 + tl.arange(0, BLOCK_H).to(tl.int64)
        written = (col < H) & (col < count)
        entry = count - 1 - (count - 1 - col) % H  # the entry the column holds (count - 1 - col >= 0 where written)
        reach = written & (entry >= count + nt - H)
        value = tl.load(history_ptr + slot * history_stride + col, mask=reach, other=-1)
        seen = seen | (tl.sum(tl.where(reach & (value == own64), 1, 0), axis=0) > 0)
    tl.store(hash_ptr + row, own64)
    tl.store(seen_ptr + row, seen.to(tl.int8))


def context_hashes_seen(windows: Tensor, slot_ids: Tensor, tail: Tensor | None, tail_rows: Tensor | None,
                        num_tail: Tensor | None, history: Tensor, count: Tensor, history_len: int
                        ) -> tuple[Tensor, Tensor]:
    """-> (hashes [n] int64, seen [n] bool): context_hashes, and whether each context is among
    the rows' earlier ones (window ++ tail[:i], i < num_tail) or the history entries
    num_tail did not push out of reach (tandem.sampling.watermark.WatermarkState.seen)."""
    n, width = slot_ids.shape[0], windows.shape[1]
    hashes = torch.empty(n, dtype=torch.int64, device=windows.device)
    seen = torch.empty(n, dtype=torch.int8, device=windows.device)
    if n == 0:
        return hashes, seen.bool()
    has = tail is not None
    if has:
        assert tail.dtype == tail_rows.dtype == num_tail.dtype == torch.int64 and tail.stride(1) == 1
    assert history.dtype == count.dtype == torch.int64 and history.stride(1) == 1 and history_len >= 1
    _context_seen_kernel[(n,)](
        windows, slot_ids, tail if has else windows, tail_rows if has else slot_ids, num_tail if has else slot_ids,
        history, count, hashes, seen, tail.stride(0) if has else 0, history.stride(0), history_len,
        W=width, HAS_TAIL=has, BLOCK_I=triton.next_power_of_2((tail.shape[1] if has else 0) + 1),
        BLOCK_H=min(1024, triton.next_power_of_2(history_len)), num_warps=4,
    )
    return hashes, seen.bool()
