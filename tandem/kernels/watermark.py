"""The watermark's context hashes on the GPU, bit-exact with tandem.sampling.watermark.

One launch per call instead of the reference's ~80 int64 element-wise ops (gather the slot's
window and drafts, take the last context_width tokens, hash them): the keys are computed every
draft step and every verification, where those launches cost more than the draws themselves.
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
    h = tl.full((BLOCK,), _HASH_START, tl.uint32)
    for j in tl.static_range(W):
        at = nt + j  # index into window ++ tail; the context is [nt, nt + W)
        in_window = at < W
        token = tl.load(windows_ptr + slot * W + at, mask=ok & in_window, other=0)
        if HAS_TAIL:
            after = tl.load(tail_ptr + tail_row * tail_stride + (at - W), mask=ok & ~in_window, other=0)
            token = tl.where(in_window, token, after)
        h = _fmix32(h ^ (token.to(tl.uint32) * _TOKEN_MUL))
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
