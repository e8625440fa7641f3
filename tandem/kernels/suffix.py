"""Suffix lookup in one launch (tandem/spec/suffix.py's fast path on a GPU).

As torch operations (`tandem.spec.suffix.suffix_drafts`, the reference this kernel is tested
against) the lookup is ~150 small kernels over whole slots and the whole corpus: 0.7-1.4 ms of
device time a step on the H200 even as CUDA graphs. Here one program per drafting request does
what suffix_drafts does for its row, for each source (its own tokens, then the corpus):

1. scans the source backwards from its end in blocks, listing the NUM_OCCURRENCES most recent
   occurrences of the context's last token that may end a match (scratch memory, latest first),
   and stops once it has them;
2. measures how far back each listed occurrence matches the context (up to the depth), and lists
   the NUM_CANDIDATES most recent of those that match longest;
3. walks their continuations, k steps of a [P, P] vote each.

Then it picks the source as the reference does, cuts the count at max_model_len and at what the
request wants, and writes that many drafts into the request's slot of the drafts buffer.

Float thresholds come in as integer tables computed on the host in double precision, as the
reference computes them: need[c], the votes a draft needs when c occurrences started the walk
(ceil(min_token_prob * c)), and limit[m], the most drafts a match of m tokens allows
(floor(m * max_spec_factor) within [1, k]).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit
def _propose(src, src_len, row, last, occ_buf, cand_buf, depth, need_ptr, limit_ptr,
             IS_CORPUS: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, M: tl.constexpr, P: tl.constexpr,
             BLOCK: tl.constexpr):
    """One source's proposal for the context row[:last + 1] -> (longest match, count, drafts [K_POW2])."""
    SEP: tl.constexpr = -1  # tandem.spec.suffix.SEPARATOR
    want_last = tl.load(row + last)
    # 1. the M most recent ends e that may end a match, latest first, into occ_buf
    if IS_CORPUS:
        top = (src_len - 2).to(tl.int64)  # a token (not the separator) must follow e
    else:
        top = (last - 1).to(tl.int64)  # before the last token
    found = top * 0
    offs = tl.arange(0, BLOCK)
    while (top >= 0) & (found < M):
        e = top - offs
        valid = e >= 0
        got = tl.load(src + e, mask=valid, other=SEP)
        hit = valid & (got == want_last)
        if IS_CORPUS:
            hit = hit & (tl.load(src + e + 1, mask=valid, other=SEP) != SEP)
        rank = found + tl.cumsum(hit.to(tl.int32), 0).to(tl.int64) - 1
        tl.store(occ_buf + rank, e, mask=hit & (rank < M))
        found += tl.sum(hit.to(tl.int64), 0)
        top -= BLOCK
    found = tl.minimum(found, M)
    tl.debug_barrier()
    # 2. how far back each occurrence matches; the P most recent of the longest into cand_buf
    idx = tl.arange(0, M)
    listed = idx < found
    occ = tl.load(occ_buf + idx, mask=listed, other=0)
    run = tl.zeros([M], dtype=tl.int32)
    alive = listed
    for j in range(0, depth):
        at = occ - j
        ok = alive & (at >= 0) & (last - j >= 0)
        alive = ok & (tl.load(src + at, mask=ok, other=SEP) == tl.load(row + tl.maximum(last - j, 0)))
        run += alive.to(tl.int32)
    best = tl.max(run, 0)
    is_cand = listed & (run == best) & (best > 0)
    crank = tl.cumsum(is_cand.to(tl.int32), 0) - 1
    tl.store(cand_buf + crank, occ, mask=is_cand & (crank < P))
    num_cand = tl.minimum(tl.sum(is_cand.to(tl.int32), 0), P)
    tl.debug_barrier()
    # 3. the walk: each draft the continuation most of the agreeing occurrences take
    pidx = tl.arange(0, P)
    cand = tl.load(cand_buf + pidx, mask=pidx < num_cand, other=0)
    okc = pidx < num_cand  # [P] continuation still inside its source (and no separator yet)
    alive = okc
    limit = tl.load(limit_ptr + best)
    going = best > 0
    count = best.to(tl.int64) * 0
    need = count
    kidx = tl.arange(0, K_POW2)
    drafts = tl.zeros([K_POW2], dtype=tl.int64)
    for j in tl.static_range(K):
        pos = cand + 1 + j
        inside = okc & (pos < src_len)
        t = tl.load(src + pos, mask=inside, other=SEP)
        okc = inside & (t != SEP)
        if j == 0:
            need = tl.load(need_ptr + tl.sum(okc.to(tl.int32), 0))
        alive = alive & okc
        votes = tl.sum(((t[:, None] == t[None, :]) & alive[None, :]).to(tl.int32), 1)  # [P]
        score = tl.where(alive, votes, -1)
        most = tl.max(score, 0)
        pick = tl.min(tl.where(score == most, pidx, P), 0)  # the most recent among the most frequent
        d = tl.sum(tl.where(pidx == pick, t, 0), 0)
        going = going & (most > 0) & (most >= need) & (j < limit)
        drafts = tl.where(kidx == j, d.to(tl.int64), drafts)
        count += going.to(tl.int64)
        alive = alive & (t == d)
    return best, count, drafts


@triton.jit
def _suffix_kernel(
    context_ptr,  # [max_num_seqs, width] int32: each slot's tokens by position
    num_tokens_ptr,  # [max_num_seqs] int64: the known tokens of each slot
    corpus_ptr,  # [C] int32: finished responses, each followed by the separator
    slots_ptr,  # [n] int64: the drafting requests' slots
    want_ptr,  # [n] int64: the most drafts each may propose
    scratch_ptr,  # [n, M + P] int64: each program's occurrence and candidate lists
    need_ptr,  # [P + 1] int64: votes a draft needs, by the occurrences the walk started with
    limit_ptr,  # [depth + 1] int64: drafts a match allows, by its length
    drafts_ptr,  # [*, k] int64 out: drafts[slot, :count]
    counts_ptr,  # [n] int64 out
    stride_c, stride_d, corpus_len, depth, max_model_len,
    USE_CORPUS: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr, M: tl.constexpr, P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    n = tl.load(num_tokens_ptr + slot)
    row = context_ptr + slot * stride_c
    last = tl.maximum(n - 1, 0)
    occ_buf = scratch_ptr + i * (M + P)
    best, count, drafts = _propose(row, n, row, last, occ_buf, occ_buf + M, depth, need_ptr, limit_ptr,
                                   False, K, K_POW2, M, P, BLOCK)
    if USE_CORPUS:
        c_best, c_count, c_drafts = _propose(corpus_ptr, corpus_len, row, last, occ_buf, occ_buf + M, depth,
                                             need_ptr, limit_ptr, True, K, K_POW2, M, P, BLOCK)
        use = ((c_best > best) | (count == 0)) & (c_count > 0)
        drafts = tl.where(use, c_drafts, drafts)
        count = tl.where(use, c_count, count)
    count = tl.minimum(count, tl.maximum(max_model_len - n, 0))
    count = tl.minimum(count, tl.load(want_ptr + i))
    cols = tl.arange(0, K_POW2)
    tl.store(drafts_ptr + slot * stride_d + cols, drafts, mask=cols < count)
    tl.store(counts_ptr + i, count)


def walk_tables(depth: int, k: int, max_spec_factor: float, min_token_prob: float, num_candidates: int,
                device: torch.device) -> tuple[Tensor, Tensor]:
    """(need [P + 1], limit [depth + 1]) int64: the walk's float thresholds as suffix_drafts computes
    them (in double precision), for the kernel's integer comparisons."""
    need = [math.ceil(min_token_prob * c) for c in range(num_candidates + 1)]
    limit = [min(max(math.floor(m * max_spec_factor), 1), k) for m in range(depth + 1)]
    return (torch.tensor(need, dtype=torch.int64, device=device),
            torch.tensor(limit, dtype=torch.int64, device=device))


def suffix_lookup(context: Tensor, num_tokens: Tensor, corpus: Tensor | None, slots: Tensor, want: Tensor,
                  drafts: Tensor, tables: tuple[Tensor, Tensor], depth: int, max_model_len: int,
                  num_occurrences: int, num_candidates: int) -> Tensor:
    """For each drafting request i (slots [n], want [n] int64): suffix_drafts over
    context[slots[i], :num_tokens[slots[i]]] (context [S, W] int32, num_tokens [S] int64) and corpus
    [C] int32 (None: none); its drafts go to drafts[slots[i], :count] (drafts [*, k] int64; the rest
    of the row is left as it was) -> counts [n] int64, at most want[i]. tables: walk_tables(...)."""
    n, k = slots.shape[0], drafts.shape[1]
    assert context.dtype == torch.int32 and context.stride(1) == 1 and drafts.stride(1) == 1
    assert num_tokens.dtype == slots.dtype == want.dtype == drafts.dtype == torch.int64
    assert num_occurrences & (num_occurrences - 1) == 0 and num_candidates & (num_candidates - 1) == 0
    counts = torch.empty(n, dtype=torch.int64, device=slots.device)
    if n:
        scratch = torch.empty(n, num_occurrences + num_candidates, dtype=torch.int64, device=slots.device)
        need, limit = tables
        use_corpus = corpus is not None
        if corpus is None:
            corpus = context  # (not read)
        assert corpus.dtype == torch.int32
        _suffix_kernel[(n,)](
            context, num_tokens, corpus, slots.contiguous(), want.contiguous(), scratch, need, limit, drafts,
            counts, context.stride(0), drafts.stride(0), corpus.numel(), depth, max_model_len,
            USE_CORPUS=use_corpus, K=k, K_POW2=triton.next_power_of_2(k), M=num_occurrences, P=num_candidates,
            BLOCK=_BLOCK, num_warps=8,
        )
    return counts
