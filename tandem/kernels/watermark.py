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
    drafts_ptr,  # [num_slots(+1), drafts_stride] int64: each slot's drafts (unread without HAS_DRAFTS)
    slot_ptr,  # [n] int64
    num_drafts_ptr,  # [n] int64: drafts of the slot that precede the row
    out_ptr,  # [n] int64: the hash, in [0, 2**32)
    n,
    drafts_stride,
    W: tl.constexpr,
    HAS_DRAFTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    slot = tl.load(slot_ptr + rows, mask=ok, other=0)
    if HAS_DRAFTS:
        nd = tl.load(num_drafts_ptr + rows, mask=ok, other=0)
    else:
        nd = tl.zeros((BLOCK,), dtype=tl.int64)
    h = tl.full((BLOCK,), _HASH_START, tl.uint32)
    for j in tl.static_range(W):
        at = nd + j  # index into window ++ drafts; the context is [nd, nd + W)
        in_window = at < W
        token = tl.load(windows_ptr + slot * W + at, mask=ok & in_window, other=0)
        if HAS_DRAFTS:
            drafted = tl.load(drafts_ptr + slot * drafts_stride + (at - W), mask=ok & ~in_window, other=0)
            token = tl.where(in_window, token, drafted)
        h = _fmix32(h ^ (token.to(tl.uint32) * _TOKEN_MUL))
    tl.store(out_ptr + rows, h.to(tl.int64), mask=ok)


def context_hashes(windows: Tensor, slot_ids: Tensor, drafts: Tensor | None, num_drafts: Tensor | None) -> Tensor:
    """The hash of window[slot] ++ drafts[slot, :num_drafts], last W tokens, per row -> [n] int64
    (tandem.sampling.watermark.context_hash of last_window(...))."""
    n, width = slot_ids.shape[0], windows.shape[1]
    assert windows.dtype == slot_ids.dtype == torch.int64 and windows.is_contiguous()
    out = torch.empty(n, dtype=torch.int64, device=windows.device)
    if n == 0:
        return out
    has = drafts is not None
    if has:
        assert drafts.dtype == num_drafts.dtype == torch.int64 and drafts.stride(1) == 1
    _context_hash_kernel[(triton.cdiv(n, _BLOCK),)](
        windows, drafts if has else windows, slot_ids, num_drafts if has else slot_ids, out, n,
        drafts.stride(0) if has else 0, W=width, HAS_DRAFTS=has, BLOCK=_BLOCK,
    )
    return out
