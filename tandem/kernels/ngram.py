"""N-gram lookup over the slots' contexts in one launch (tandem/spec/ngram.py's fast path).

As torch operations (`tandem.spec.ngram.ngram_drafts`, the reference this kernel is tested
against) the lookup is ~40 small kernels, ~0.7 ms of launches a step whatever the context length
(H200); here one program per drafting request walks its context in blocks of positions, keeps the
longest run of tokens equal to the context's last ones (capped at max_n) and its earliest end,
then writes that many drafts into the request's slot of the drafts buffer and their count.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit
def _ngram_kernel(
    context_ptr,  # [max_num_seqs, width] int32: each slot's tokens by position
    num_tokens_ptr,  # [max_num_seqs] int64: the known tokens of each slot
    slots_ptr,  # [n] int64: the drafting requests' slots
    want_ptr,  # [n] int64: the most drafts each may propose
    drafts_ptr,  # [*, k] int64 out: drafts[slot, :count]
    counts_ptr,  # [n] int64 out
    stride_c, stride_d, min_n, max_n, max_model_len,
    K: tl.constexpr, K_POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    n = tl.load(num_tokens_ptr + slot)
    row = context_ptr + slot * stride_c
    last = n - 1
    best_run = n * 0  # (int64 scalars)
    best_end = n * 0
    for start in range(0, n - 1, BLOCK):
        ends = start + tl.arange(0, BLOCK).to(tl.int64)  # candidate ends e < last: something follows them
        alive = ends < last
        run = tl.zeros([BLOCK], dtype=tl.int64)
        for j in range(0, max_n):  # (a runtime loop: any prompt_lookup_max compiles once)
            tail = last - j
            want_tok = tl.load(row + tl.maximum(tail, 0))
            pos = ends - j
            ok = alive & (pos >= 0) & (tail >= 0)
            got = tl.load(row + pos, mask=ok, other=-1)
            alive = ok & (got == want_tok)
            run += alive.to(tl.int64)
        block_best = tl.max(run, 0)
        block_end = tl.min(tl.where(run == block_best, ends, n), 0)  # (n: past every candidate)
        better = block_best > best_run  # strict: an earlier block's end is earlier
        best_end = tl.where(better, block_end, best_end)
        best_run = tl.where(better, block_best, best_run)
    first = best_end + 1
    count = tl.minimum(n - first, tl.maximum(max_model_len - n, 0))
    count = tl.minimum(tl.maximum(count, 0), K)
    count = tl.where((best_run >= min_n) & (best_run > 0), count, 0)
    count = tl.minimum(count, tl.load(want_ptr + i))
    cols = tl.arange(0, K_POW2)
    take = cols < count
    tokens = tl.load(row + first + cols, mask=take, other=0)
    tl.store(drafts_ptr + slot * stride_d + cols, tokens.to(tl.int64), mask=take)
    tl.store(counts_ptr + i, count)


def ngram_lookup(context: Tensor, num_tokens: Tensor, slots: Tensor, want: Tensor, drafts: Tensor, min_n: int,
                 max_n: int, max_model_len: int) -> Tensor:
    """For each drafting request i (slots [n], want [n] int64): the lookup over
    context[slots[i], :num_tokens[slots[i]]] (context [S, W] int32, num_tokens [S] int64); its
    drafts go to drafts[slots[i], :count] (drafts [*, k] int64; the rest of the row is left as
    it was) -> counts [n] int64, at most want[i] (as ngram_drafts' counts, cut to want)."""
    n = slots.shape[0]
    k = drafts.shape[1]
    assert context.dtype == torch.int32 and context.stride(1) == 1 and drafts.stride(1) == 1
    assert num_tokens.dtype == slots.dtype == want.dtype == drafts.dtype == torch.int64
    counts = torch.empty(n, dtype=torch.int64, device=slots.device)
    if n:
        _ngram_kernel[(n,)](
            context, num_tokens, slots.contiguous(), want.contiguous(), drafts, counts, context.stride(0),
            drafts.stride(0), min_n, max_n, max_model_len, K=k, K_POW2=triton.next_power_of_2(k),
            BLOCK=_BLOCK, num_warps=4,
        )
    return counts
