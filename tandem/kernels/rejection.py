"""Fused rejection sampler: the semantics of tandem.spec.rejection.rejection_sample, no softmax
materialised and no host sync, in up to three launches:

1. `_block_stats_kernel`, one program per (row, vocabulary block): the block's max and sum of
   exp(x - max) of the target's logits p (and of the draft's q), and p's first argmax;
2. `_block_draw_kernel` (only when some row samples), same grid: for each sampled row the block's
   best Gumbel score and index of the draw a request makes where it stops (over
   log(max(p - q, 0)) with the RECOVER salt on a draft row, over the raw logits with the TARGET
   salt on the bonus row: the same draw a non-speculative step makes; with greedy drafts every
   row draws the latter, the coupled test of the torch sampler);
3. `_rejection_kernel`, one program per request: walks its rows in order, combines each row's block
   statistics into p(x) and q(x) for the draft x, applies the accept test of the torch sampler and
   stops at the first row that does not accept: its token is the best of that row's block
   candidates if the row samples (sampled_idx), else the argmax. Rows past the stop are written
   -1 (the torch sampler fills them with tokens nothing reads).

Spreading the vocabulary passes over (row, block) programs keeps the step off one SM: the earlier
one-program-per-request walk took 115 us at batch 1 (k = 4, 128256 tokens, H200).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from tandem.kernels.device import interpreting
from tandem.kernels.gumbel import _gumbel, _noise_key, _uniform
from tandem.kernels.pdl import pdl_flags, wait_for_inputs
from tandem.sampling.gumbel import ACCEPT_SALT, BLOCK_SALT, RECOVER_SALT, TARGET_SALT

_BLOCK_V = 4096

# libdevice's expf is torch's CUDA exp, used where a single value decides (p(x), q(x)); the
# per-block statistics and draws use tl.exp (ex2.approx), whose error only moves sums and scores
# by about 1e-7 relative. The interpreter implements only tl.exp.
if interpreting():

    @triton.jit
    def _exp(x):
        return tl.exp(x)

else:

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)


@triton.jit
def _lane_finish(m, s):
    """Lanes of (max, sum exp(x - max)) -> their combination (lanes that saw only -inf have
    m = -inf and add nothing)."""
    m_row = tl.max(m, 0)
    m_safe = tl.where(m_row == -float("inf"), 0.0, m_row)
    return m_row, tl.sum(s * tl.exp(m - m_safe), 0)


@triton.jit
def _block_stats_kernel(
    p_ptr, q_ptr, stride_p, stride_q,
    stats_ptr,  # [num_rows, 4, NB] fp32 out: max p, sum exp(p - max), max q, sum exp(q - max)
    argmax_ptr,  # [num_rows, NB] int32 out: first index of the block's max p
    vocab, NB, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, block): the statistics of one BLOCK_V slice of a row of p (and q)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < vocab
    out = stats_ptr + row * 4 * NB + blk
    pl = tl.load(p_ptr + row * stride_p + offs, mask=mask, other=-float("inf"))
    m_p, s_p = _lane_finish(pl, tl.full([BLOCK_V], 1.0, tl.float32))
    tl.store(out, m_p)
    tl.store(out + NB, s_p)
    tl.store(argmax_ptr + row * NB + blk, tl.min(tl.where(pl == m_p, offs, 2147483647), 0))
    if HAS_Q:
        ql = tl.load(q_ptr + row * stride_q + offs, mask=mask, other=-float("inf"))
        m_q, s_q = _lane_finish(ql, tl.full([BLOCK_V], 1.0, tl.float32))
        tl.store(out + 2 * NB, m_q)
        tl.store(out + 3 * NB, s_q)


@triton.jit
def _row_stats(stats_ptr, argmax_ptr, row, NB, HAS_Q: tl.constexpr, NB_POW2: tl.constexpr):
    """A row's (m_p, s_p, argmax p, m_q, s_q) from its blocks' statistics."""
    b = tl.arange(0, NB_POW2)
    ok = b < NB
    base = stats_ptr + row * 4 * NB
    m_b = tl.load(base + b, mask=ok, other=-float("inf"))
    m_p, s_p = _lane_finish(m_b, tl.load(base + NB + b, mask=ok, other=0.0))
    argmax = tl.min(tl.where(ok & (m_b == m_p), tl.load(argmax_ptr + row * NB + b, mask=ok, other=0), 2147483647), 0)
    m_q = 0.0
    s_q = 1.0
    if HAS_Q:
        m_q, s_q = _lane_finish(tl.load(base + 2 * NB + b, mask=ok, other=-float("inf")),
                                tl.load(base + 3 * NB + b, mask=ok, other=0.0))
    return m_p, s_p, argmax, m_q, s_q


@triton.jit
def _stop_draw(cand_val_ptr, cand_idx_ptr, row, NB, NB_POW2: tl.constexpr, argmax):
    """A sampled row's stop draw: the best of its blocks' candidates (the first index among equal
    scores), or argmax (int64, p's) where every score is -inf: a residual with no mass (p == q),
    which follows no rejection that p and q drew, as the torch samplers have it."""
    b = tl.arange(0, NB_POW2)
    ok = b < NB
    val = tl.load(cand_val_ptr + row * NB + b, mask=ok, other=-float("inf"))
    top = tl.max(val, 0)
    cand = tl.load(cand_idx_ptr + row * NB + b, mask=ok, other=0)
    token = tl.min(tl.where(ok & (val == top), cand, 2147483647), 0).to(tl.int64)
    return tl.where(top == -float("inf"), argmax, token)


@triton.jit
def _block_draw_kernel(
    p_ptr, q_ptr, stride_p, stride_q, stats_ptr, argmax_ptr,
    draft_ptr, bonus_ptr, sampled_ptr, seeds_ptr, positions_ptr,
    cand_val_ptr,  # [num_rows, NB] fp32 out: the block's best Gumbel score
    cand_idx_ptr,  # [num_rows, NB] int32 out: its first index
    vocab, NB, HAS_Q: tl.constexpr, COUPLED: tl.constexpr, BLOCK_V: tl.constexpr, NB_POW2: tl.constexpr,
    RECOVER: tl.constexpr, TARGET: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, block) of a sampled row: this block's candidate for the row's stop draw, a
    Gumbel-max over the raw logits (bonus row, or every row when COUPLED; TARGET salt) or over
    log(max(p - q, 0)) (a draft row, RECOVER salt). Every sampled row draws; the walk keeps the
    one its request stops at (and, COUPLED, compares each draft with its row's draw)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    if tl.load(sampled_ptr + row) == 0:  # rows that do not sample stop at the argmax
        return
    blk = tl.program_id(1)
    bonus = (tl.load(bonus_ptr + row) != 0) | COUPLED
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < vocab
    pl = tl.load(p_ptr + row * stride_p + offs, mask=mask, other=-float("inf"))
    if bonus:
        score = pl
        key = _noise_key(seed, position, TARGET)
    else:
        m_p, s_p, _, m_q, s_q = _row_stats(stats_ptr, argmax_ptr, row, NB, HAS_Q, NB_POW2)
        p = tl.exp(pl - m_p) * (1.0 / s_p)
        if HAS_Q:
            ql = tl.load(q_ptr + row * stride_q + offs, mask=mask, other=-float("inf"))
            resid = tl.maximum(p - tl.exp(ql - m_q) * (1.0 / s_q), 0.0)
        else:
            draft = tl.minimum(tl.maximum(tl.load(draft_ptr + row), 0), vocab - 1)
            resid = tl.where(offs == draft, 0.0, p)
        score = tl.log(resid)
        key = _noise_key(seed, position, RECOVER)
    score = tl.where(mask, score + _gumbel(key, offs), -float("inf"))
    best = tl.max(score, 0)
    tl.store(cand_val_ptr + row * NB + blk, best)
    tl.store(cand_idx_ptr + row * NB + blk, tl.min(tl.where(score == best, offs, 2147483647), 0))


@triton.jit
def _rejection_kernel(
    p_ptr,  # [num_rows, V] fp32
    q_ptr,  # [num_rows, V] fp32 (HAS_Q)
    stride_p,
    stride_q,
    stats_ptr,  # [num_rows, 4, NB] fp32 (_block_stats_kernel)
    argmax_ptr,  # [num_rows, NB] int32
    cand_val_ptr,  # [num_rows, NB] fp32 (_block_draw_kernel, sampled rows)
    cand_idx_ptr,  # [num_rows, NB] int32
    draft_ptr,  # [num_rows] int64, -1 on bonus rows
    bonus_ptr,  # [num_rows] uint8
    greedy_ptr,  # [num_rows] uint8
    sampled_ptr,  # [num_rows] uint8, the rows of sampled_idx
    seeds_ptr,  # [num_rows] int64
    positions_ptr,  # [num_rows] int64
    row_index_ptr,  # [num_rows] int64
    rates_ptr,  # [num_rates] fp32 (SYNTHETIC)
    num_rates,
    row_req_ptr,  # [num_rows] int64, each row's request (a request's rows contiguous)
    total_rows,
    tokens_ptr,  # [num_rows] int64 out
    emitted_ptr,  # [num_reqs] int64 out
    vocab,
    NB,
    HAS_Q: tl.constexpr,
    SYNTHETIC: tl.constexpr,
    COUPLED: tl.constexpr,  # greedy drafts, not synthetic: a draft stands iff it equals its row's draw
    ANY_SAMPLED: tl.constexpr,
    NB_POW2: tl.constexpr,
    ACCEPT: tl.constexpr,
    SCAN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program = request: walks its rows in order with the accept test, stops at the first row
    that does not accept; its token is the row's stop draw if it samples, else the argmax."""
    wait_for_inputs(PDL)
    req = tl.program_id(0)
    start = (req * 0 + total_rows).to(tl.int64)  # this request's first row and row count, from row_req
    num_rows = start * 0
    for r0 in range(0, total_rows, SCAN):
        r = r0 + tl.arange(0, SCAN)
        hit = tl.load(row_req_ptr + r, mask=r < total_rows, other=-1) == req
        start = tl.minimum(start, tl.min(tl.where(hit, r, total_rows), 0).to(tl.int64))
        num_rows += tl.sum(hit.to(tl.int64), 0)
    j = num_rows * 0
    running = num_rows > 0
    while running:
        row = start + j
        raw_draft = tl.load(draft_ptr + row)
        draft = tl.minimum(tl.maximum(raw_draft, 0), vocab - 1)
        seed = tl.load(seeds_ptr + row)
        position = tl.load(positions_ptr + row)
        m_p, s_p, argmax, m_q, s_q = _row_stats(stats_ptr, argmax_ptr, row, NB, HAS_Q, NB_POW2)
        q_x = 1.0
        if HAS_Q:
            q_x = tl.math.div_rn(_exp(tl.load(q_ptr + row * stride_q + draft) - m_q), s_q)
        p_x = tl.math.div_rn(_exp(tl.load(p_ptr + row * stride_p + draft) - m_p), s_p)
        u = _uniform(_noise_key(seed, position, ACCEPT), tl.full((), 0, tl.int32))
        token = argmax.to(tl.int64)  # the row's stop token: its draw if it samples, else the argmax
        if ANY_SAMPLED:
            if tl.load(sampled_ptr + row) != 0:
                token = _stop_draw(cand_val_ptr, cand_idx_ptr, row, NB, NB_POW2, token)
        if SYNTHETIC:
            idx = tl.minimum(tl.load(row_index_ptr + row), num_rates - 1)
            accept = u < tl.load(rates_ptr + idx)
        elif COUPLED:
            accept = draft == token
        else:
            accept = tl.where(tl.load(greedy_ptr + row) != 0, draft == argmax, u * q_x < p_x)
        accept = accept & (tl.load(bonus_ptr + row) == 0) & (raw_draft >= 0)
        if accept:
            tl.store(tokens_ptr + row, raw_draft)
            j += 1
        else:
            tl.store(tokens_ptr + row, token)
            running = False
        running = running & (j < num_rows)
    tl.store(emitted_ptr + req, j + 1)
    for jj in range(j + 1, num_rows):
        tl.store(tokens_ptr + start + jj, -1)


def _check(p_logits: Tensor, row_draft: Tensor, row_is_bonus: Tensor, row_greedy: Tensor, q_logits: Tensor | None,
           seeds: Tensor, positions: Tensor, row_req: Tensor, row_index: Tensor) -> None:
    """The layout both fused samplers take (tandem.spec.rejection's arguments, rows in order)."""
    num_rows = p_logits.shape[0]
    assert p_logits.dtype == torch.float32 and p_logits.stride(1) == 1
    for t in (row_draft, seeds, positions, row_req, row_index):
        assert t.shape == (num_rows,) and t.dtype == torch.int64
    assert row_is_bonus.shape == row_greedy.shape == (num_rows,)
    assert row_is_bonus.dtype == row_greedy.dtype == torch.bool
    if q_logits is not None:
        assert q_logits.shape == p_logits.shape and q_logits.dtype == torch.float32 and q_logits.stride(1) == 1


@dataclass(frozen=True)
class _BlockStats:
    """Both fused samplers' first launch, `_block_stats_kernel`, and what their later launches share."""

    q: Tensor  # the draft's logits, or p standing in for them (has_q false)
    has_q: bool
    pdl: dict
    nb: int  # vocabulary blocks of _BLOCK_V
    stats: Tensor  # [num_rows, 4, nb] fp32: max and sum of exp of p, then of q, per block
    argmax: Tensor  # [num_rows, nb] int32: p's first argmax per block
    row_sampled: Tensor  # [num_rows] uint8: the rows that sample (sampled_idx)


def _block_stats(p_logits: Tensor, q_logits: Tensor | None, sampled_idx: Tensor | None) -> _BlockStats:
    num_rows, vocab = p_logits.shape
    dev = p_logits.device
    row_sampled = torch.zeros(num_rows, dtype=torch.uint8, device=dev)
    if sampled_idx is not None:
        row_sampled.index_fill_(0, sampled_idx, 1)
    q = q_logits if q_logits is not None else p_logits
    has_q, pdl = q_logits is not None, pdl_flags(p_logits)
    nb = triton.cdiv(vocab, _BLOCK_V)
    stats = torch.empty(num_rows, 4, nb, dtype=torch.float32, device=dev)
    argmax = torch.empty(num_rows, nb, dtype=torch.int32, device=dev)
    _block_stats_kernel[(num_rows, nb)](
        p_logits, q, p_logits.stride(0), q.stride(0), stats, argmax, vocab, nb,
        HAS_Q=has_q, BLOCK_V=_BLOCK_V, num_warps=4, **pdl,
    )
    return _BlockStats(q, has_q, pdl, nb, stats, argmax, row_sampled)


def rejection_sample(
    p_logits: Tensor,
    row_draft: Tensor,
    row_is_bonus: Tensor,
    row_greedy: Tensor,
    sampled_idx: Tensor | None,
    q_logits: Tensor | None,
    seeds: Tensor,
    positions: Tensor,
    row_req: Tensor,
    row_index: Tensor,
    num_reqs: int,
    synthetic_rates: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """tandem.spec.rejection.rejection_sample, fused: same arguments, same outputs on the rows
    a request reaches (row_index < num_emitted); later rows are -1.

    NOTE: a request's rows must be contiguous and in row_index order (as the speculator lays
    them out); every request has >= 1 row and its last row is the bonus row. Each request's
    program scans row_req for its rows (num_reqs x num_rows int64 reads from L2, ~5 MB at 256
    requests of k = 8).
    """
    _check(p_logits, row_draft, row_is_bonus, row_greedy, q_logits, seeds, positions, row_req, row_index)
    if synthetic_rates is not None:
        assert synthetic_rates.dim() == 1 and synthetic_rates.shape[0] >= 1
    num_rows, vocab = p_logits.shape
    dev = p_logits.device
    row_tokens = torch.empty(num_rows, dtype=torch.int64, device=dev)
    num_emitted = torch.empty(num_reqs, dtype=torch.int64, device=dev)
    if num_reqs == 0:
        return row_tokens, num_emitted
    b = _block_stats(p_logits, q_logits, sampled_idx)
    q, has_q, pdl, nb, stats, argmax, row_sampled = b.q, b.has_q, b.pdl, b.nb, b.stats, b.argmax, b.row_sampled
    rates = synthetic_rates.float().contiguous() if synthetic_rates is not None else p_logits
    cand_val = torch.empty(num_rows, nb, dtype=torch.float32, device=dev)
    cand_idx = torch.empty(num_rows, nb, dtype=torch.int32, device=dev)
    coupled = not has_q and synthetic_rates is None
    if sampled_idx is not None:  # no sampled row: no stop draws
        _block_draw_kernel[(num_rows, nb)](
            p_logits, q, p_logits.stride(0), q.stride(0), stats, argmax,
            row_draft, row_is_bonus.view(torch.uint8), row_sampled, seeds, positions, cand_val, cand_idx, vocab, nb,
            HAS_Q=has_q, COUPLED=coupled, BLOCK_V=_BLOCK_V, NB_POW2=triton.next_power_of_2(nb),
            RECOVER=RECOVER_SALT, TARGET=TARGET_SALT, num_warps=4, **pdl,
        )
    _rejection_kernel[(num_reqs,)](
        p_logits, q, p_logits.stride(0), q.stride(0), stats, argmax, cand_val, cand_idx,
        row_draft, row_is_bonus.view(torch.uint8), row_greedy.view(torch.uint8), row_sampled,
        seeds, positions, row_index, rates, rates.shape[0] if synthetic_rates is not None else 1,
        row_req, num_rows, row_tokens, num_emitted, vocab, nb,
        HAS_Q=has_q, SYNTHETIC=synthetic_rates is not None, COUPLED=coupled, ANY_SAMPLED=sampled_idx is not None,
        NB_POW2=triton.next_power_of_2(nb), ACCEPT=ACCEPT_SALT, SCAN=1024, num_warps=4, **pdl,
    )
    return row_tokens, num_emitted


# ----------------------------------------------------------------------------- block verification
@triton.jit
def _log_ratio(p_ptr, q_ptr, stride_p, stride_q, stats_ptr, argmax_ptr, draft_ptr, row, row_index, vocab, NB,
               HAS_Q: tl.constexpr, NB_POW2: tl.constexpr):
    """log P at `row`: the running ratio min(1, P p(x) / q(x)) over its request's drafts before it
    (rows row - row_index .. row - 1; P = 1 at the first row), each log ratio kept within +-200."""
    logr = tl.zeros((), tl.float32)
    for j in range(0, row_index):
        r = row - row_index + j
        m_p, s_p, _, m_q, s_q = _row_stats(stats_ptr, argmax_ptr, r, NB, HAS_Q, NB_POW2)
        x = tl.minimum(tl.maximum(tl.load(draft_ptr + r), 0), vocab - 1)
        log_px = tl.load(p_ptr + r * stride_p + x) - m_p - tl.log(s_p)
        log_qx = 0.0
        if HAS_Q:
            log_qx = tl.load(q_ptr + r * stride_q + x) - m_q - tl.log(s_q)
        step = tl.minimum(tl.maximum(log_px - log_qx, -200.0), 200.0)
        step = tl.where(log_px == -float("inf"), -200.0, step)  # a draft p forbids ends every block
        logr = tl.minimum(logr + step, 0.0)
    return logr


@triton.jit
def _block_resid_kernel(
    p_ptr, q_ptr, stride_p, stride_q, stats_ptr, argmax_ptr,
    draft_ptr, bonus_ptr, greedy_ptr, sampled_ptr, seeds_ptr, positions_ptr, row_index_ptr,
    ratio_ptr,  # [num_rows] fp32 out: P at the row
    rho_ptr,  # [num_rows, NB] fp32 out: the block's part of sum_x max(P p(x) - q(x), 0)
    cand_val_ptr, cand_idx_ptr,  # [num_rows, NB] out: the block's best score of the row's stop draw
    vocab, NB, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, NB_POW2: tl.constexpr,
    RECOVER: tl.constexpr, TARGET: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, block) of a row at temperature > 0: the row's running ratio P, this block's
    residual mass max(P p - q, 0), and (a row that samples) its candidate for the stop draw over
    log of that residual (RECOVER salt), or over the raw logits on the bonus row (TARGET salt)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    if tl.load(greedy_ptr + row) != 0:  # temperature 0: the exact-match walk needs none of it
        return
    blk = tl.program_id(1)
    row_index = tl.load(row_index_ptr + row)
    ratio = tl.exp(_log_ratio(p_ptr, q_ptr, stride_p, stride_q, stats_ptr, argmax_ptr, draft_ptr, row, row_index,
                              vocab, NB, HAS_Q, NB_POW2))
    if blk == 0:
        tl.store(ratio_ptr + row, ratio)
    bonus = tl.load(bonus_ptr + row) != 0
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < vocab
    pl = tl.load(p_ptr + row * stride_p + offs, mask=mask, other=-float("inf"))
    m_p, s_p, _, m_q, s_q = _row_stats(stats_ptr, argmax_ptr, row, NB, HAS_Q, NB_POW2)
    scaled = ratio * (tl.exp(pl - m_p) * (1.0 / s_p))
    if HAS_Q:
        ql = tl.load(q_ptr + row * stride_q + offs, mask=mask, other=-float("inf"))
        resid = tl.maximum(scaled - tl.exp(ql - m_q) * (1.0 / s_q), 0.0)
    else:
        draft = tl.minimum(tl.maximum(tl.load(draft_ptr + row), 0), vocab - 1)
        resid = tl.where(offs == draft, 0.0, scaled)
    resid = tl.where(mask, resid, 0.0)
    tl.store(rho_ptr + row * NB + blk, tl.sum(resid, 0))
    if tl.load(sampled_ptr + row) != 0:
        seed = tl.load(seeds_ptr + row)
        position = tl.load(positions_ptr + row)
        if bonus:
            score = pl
            key = _noise_key(seed, position, TARGET)
        else:
            score = tl.log(resid)
            key = _noise_key(seed, position, RECOVER)
        score = tl.where(mask, score + _gumbel(key, offs), -float("inf"))
        best = tl.max(score, 0)
        tl.store(cand_val_ptr + row * NB + blk, best)
        tl.store(cand_idx_ptr + row * NB + blk, tl.min(tl.where(score == best, offs, 2147483647), 0))


@triton.jit
def _block_verify_kernel(
    p_ptr, stride_p, stats_ptr, argmax_ptr, ratio_ptr, rho_ptr, cand_val_ptr, cand_idx_ptr,
    draft_ptr, bonus_ptr, greedy_ptr, sampled_ptr, seeds_ptr, positions_ptr,
    row_req_ptr, total_rows, tokens_ptr, emitted_ptr, vocab, NB,
    NB_POW2: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr,
):
    """Program = request: tau = the last row i >= 1 whose uniform (keyed by the round's first
    position and i) is <= h_i (h = rho / (rho + 1 - P) on a draft row, P on the bonus row), or the
    leading exact matches at temperature 0; rows before tau keep their drafts, row tau its stop
    token (the row's draw if it samples, else the argmax), later rows -1."""
    wait_for_inputs(PDL)
    req = tl.program_id(0)
    start = (req * 0 + total_rows).to(tl.int64)
    num_rows = start * 0
    for r0 in range(0, total_rows, SCAN):
        r = r0 + tl.arange(0, SCAN)
        hit = tl.load(row_req_ptr + r, mask=r < total_rows, other=-1) == req
        start = tl.minimum(start, tl.min(tl.where(hit, r, total_rows), 0).to(tl.int64))
        num_rows += tl.sum(hit.to(tl.int64), 0)
    b = tl.arange(0, NB_POW2)
    ok = b < NB
    greedy = tl.load(greedy_ptr + start) != 0
    tau = num_rows * 0
    if greedy:
        running = num_rows > 1
        while running:
            row = start + tau
            _, _, argmax, _, _ = _row_stats(stats_ptr, argmax_ptr, row, NB, False, NB_POW2)
            raw = tl.load(draft_ptr + row)
            match = (raw >= 0) & (tl.load(bonus_ptr + row) == 0) & (raw == argmax.to(tl.int64))
            tau += match.to(tl.int64)
            running = match & (tau < num_rows - 1)
    else:
        seed = tl.load(seeds_ptr + start)
        first = tl.load(positions_ptr + start)
        for i in range(1, num_rows):
            row = start + i
            ratio = tl.load(ratio_ptr + row)
            rho = tl.sum(tl.load(rho_ptr + row * NB + b, mask=ok, other=0.0), 0)
            denom = rho + 1.0 - ratio
            h = tl.where(denom > 0, rho / tl.maximum(denom, 1e-30), 1.0)
            h = tl.where(tl.load(bonus_ptr + row) != 0, ratio, h)
            eta = _uniform(_noise_key(seed, first, BLOCK), tl.full((), 0, tl.int32) + i)
            tau = tl.where(eta <= h, tau * 0 + i, tau)
    for j in range(0, num_rows):
        row = start + j
        if j < tau:
            tl.store(tokens_ptr + row, tl.load(draft_ptr + row))
        elif j == tau:
            _, _, argmax, _, _ = _row_stats(stats_ptr, argmax_ptr, row, NB, False, NB_POW2)
            token = argmax.to(tl.int64)
            if tl.load(sampled_ptr + row) != 0:
                token = _stop_draw(cand_val_ptr, cand_idx_ptr, row, NB, NB_POW2, token)
            tl.store(tokens_ptr + row, token)
        else:
            tl.store(tokens_ptr + row, -1)
    tl.store(emitted_ptr + req, tau + 1)


def block_rejection_sample(
    p_logits: Tensor,
    row_draft: Tensor,
    row_is_bonus: Tensor,
    row_greedy: Tensor,
    sampled_idx: Tensor | None,
    q_logits: Tensor | None,
    seeds: Tensor,
    positions: Tensor,
    row_req: Tensor,
    row_index: Tensor,
    num_reqs: int,
    synthetic_rates: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """tandem.spec.rejection.block_rejection_sample, fused in three launches: the same arguments
    and outputs on the rows a request reaches (later rows -1). The running ratio and residual
    masses are fp32 here (float64 in the reference), so a decision within rounding of its
    threshold can go the other way. Same layout rules as rejection_sample."""
    if synthetic_rates is not None:
        raise ValueError("block verification does not take synthetic acceptance rates")
    _check(p_logits, row_draft, row_is_bonus, row_greedy, q_logits, seeds, positions, row_req, row_index)
    num_rows, vocab = p_logits.shape
    dev = p_logits.device
    row_tokens = torch.empty(num_rows, dtype=torch.int64, device=dev)
    num_emitted = torch.empty(num_reqs, dtype=torch.int64, device=dev)
    if num_reqs == 0:
        return row_tokens, num_emitted
    b = _block_stats(p_logits, q_logits, sampled_idx)
    q, has_q, pdl, nb, stats, argmax, row_sampled = b.q, b.has_q, b.pdl, b.nb, b.stats, b.argmax, b.row_sampled
    nb2 = triton.next_power_of_2(nb)
    ratio = torch.ones(num_rows, dtype=torch.float32, device=dev)
    rho = torch.zeros(num_rows, nb, dtype=torch.float32, device=dev)
    cand_val = torch.empty(num_rows, nb, dtype=torch.float32, device=dev)
    cand_idx = torch.empty(num_rows, nb, dtype=torch.int32, device=dev)
    bonus, greedy = row_is_bonus.view(torch.uint8), row_greedy.view(torch.uint8)
    _block_resid_kernel[(num_rows, nb)](
        p_logits, q, p_logits.stride(0), q.stride(0), stats, argmax, row_draft, bonus, greedy, row_sampled,
        seeds, positions, row_index, ratio, rho, cand_val, cand_idx, vocab, nb,
        HAS_Q=has_q, BLOCK_V=_BLOCK_V, NB_POW2=nb2, RECOVER=RECOVER_SALT, TARGET=TARGET_SALT, num_warps=4, **pdl,
    )
    _block_verify_kernel[(num_reqs,)](
        p_logits, p_logits.stride(0), stats, argmax, ratio, rho, cand_val, cand_idx, row_draft, bonus, greedy,
        row_sampled, seeds, positions, row_req, num_rows, row_tokens, num_emitted, vocab, nb,
        NB_POW2=nb2, BLOCK=BLOCK_SALT, SCAN=1024, num_warps=4, **pdl,
    )
    return row_tokens, num_emitted
