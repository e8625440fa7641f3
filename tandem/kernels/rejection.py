"""Fused rejection sampler: the semantics of tandem.spec.rejection.rejection_sample, one program
per request, no softmax materialised and no host sync.

A program walks its request's rows in order. For each row it makes one pass over the vocabulary
for the target's (and draft's) max, log-sum-exp and argmax, which give p(x) and q(x) for the
draft x; it then applies the accept test of the torch sampler. At the first row that does not
accept (a rejection, or the bonus row) it makes one more pass: a blocked Gumbel-max over
log(max(p - q, 0)) with the RECOVER salt, or over the raw processed logits with the TARGET salt
on the bonus row (the same draw a non-speculative step makes), or nothing for greedy rows (the
argmax from the first pass). Rows past the stop are written -1 (the torch sampler fills them
with tokens nothing reads).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from tandem.kernels.gumbel import _gumbel, _noise_key, _uniform
from tandem.kernels.pdl import pdl_flags, wait_for_inputs
from tandem.sampling.gumbel import ACCEPT_SALT, RECOVER_SALT, TARGET_SALT

_BLOCK_V = 4096

# libdevice's expf is torch's CUDA exp, used where a single value decides (p(x), q(x)); the
# vocabulary loops use tl.exp (ex2.approx), whose error only moves sums and scores by about
# 1e-7 relative. The interpreter implements only tl.exp.
if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def _exp(x):
        return tl.exp(x)

else:

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)


@triton.jit
def _lane_lse(m, s, x):
    """Per-lane online log-sum-exp update with a new block x (lanes that saw only -inf keep m = -inf)."""
    m_new = tl.maximum(m, x)
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    return m_new, s * tl.exp(m - m_safe) + tl.exp(x - m_safe)


@triton.jit
def _lane_finish(m, s):
    """Per-lane (m, s) -> the row's (max, sum exp(x - max))."""
    m_row = tl.max(m, 0)
    m_safe = tl.where(m_row == -float("inf"), 0.0, m_row)
    return m_row, tl.sum(s * tl.exp(m - m_safe), 0)


@triton.jit
def _lane_argmax(best_val, best_idx):
    """Per-lane (max, first index) -> the row's first index of its max, as torch.argmax."""
    top = tl.max(best_val, 0)
    return tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)


@triton.jit
def _row_stats(p_row, q_row, vocab, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass over a row of p (and q) logits -> (m_p, s_p, argmax p, m_q, s_q); no barriers in the loop."""
    lanes = tl.arange(0, BLOCK_V)
    m_p = tl.full([BLOCK_V], -float("inf"), tl.float32)
    s_p = tl.zeros([BLOCK_V], tl.float32)
    best_idx = lanes
    m_q = tl.full([BLOCK_V], -float("inf"), tl.float32)
    s_q = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + lanes
        mask = offs < vocab
        pl = tl.load(p_row + offs, mask=mask, other=-float("inf"))
        best_idx = tl.where(pl > m_p, offs, best_idx)  # strict: a lane keeps its first max
        m_p, s_p = _lane_lse(m_p, s_p, pl)
        if HAS_Q:
            ql = tl.load(q_row + offs, mask=mask, other=-float("inf"))
            m_q, s_q = _lane_lse(m_q, s_q, ql)
    argmax = _lane_argmax(m_p, best_idx)
    m_p_row, s_p_row = _lane_finish(m_p, s_p)
    m_q_row, s_q_row = _lane_finish(m_q, s_q)
    return m_p_row, s_p_row, argmax, m_q_row, s_q_row


@triton.jit
def _stop_draw(p_row, q_row, vocab, m_p, s_p, m_q, s_q, draft, key, bonus,
               HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """Gumbel-max over the bonus scores (raw logits) or the residual log(max(p - q, 0))."""
    lanes = tl.arange(0, BLOCK_V)
    best_val = tl.full([BLOCK_V], -float("inf"), tl.float32)
    best_idx = lanes
    inv_s_p = 1.0 / s_p
    inv_s_q = 1.0 / s_q
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + lanes
        mask = offs < vocab
        pl = tl.load(p_row + offs, mask=mask, other=-float("inf"))
        if bonus:
            score = pl
        else:
            p = tl.exp(pl - m_p) * inv_s_p
            if HAS_Q:
                ql = tl.load(q_row + offs, mask=mask, other=-float("inf"))
                resid = tl.maximum(p - tl.exp(ql - m_q) * inv_s_q, 0.0)
            else:
                resid = tl.where(offs == draft, 0.0, p)
            score = tl.log(resid)
        score = tl.where(mask, score + _gumbel(key, offs), -float("inf"))
        best_idx = tl.where(score > best_val, offs, best_idx)
        best_val = tl.maximum(best_val, score)
    return _lane_argmax(best_val, best_idx)


@triton.jit
def _rejection_kernel(
    p_ptr,  # [num_rows, V] fp32
    q_ptr,  # [num_rows, V] fp32 (HAS_Q)
    stride_p,
    stride_q,
    draft_ptr,  # [num_rows] int64, -1 on bonus rows
    bonus_ptr,  # [num_rows] uint8
    greedy_ptr,  # [num_rows] uint8
    sampled_ptr,  # [num_rows] uint8, temperature > 0
    seeds_ptr,  # [num_rows] int64
    positions_ptr,  # [num_rows] int64
    row_index_ptr,  # [num_rows] int64
    rates_ptr,  # [num_rates] fp32 (SYNTHETIC)
    num_rates,
    req_start_ptr,  # [num_reqs] int64, first row
    req_rows_ptr,  # [num_reqs] int64, rows in the request
    tokens_ptr,  # [num_rows] int64 out
    emitted_ptr,  # [num_reqs] int64 out
    vocab,
    HAS_Q: tl.constexpr,
    SYNTHETIC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACCEPT: tl.constexpr,
    RECOVER: tl.constexpr,
    TARGET: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    req = tl.program_id(0)
    start = tl.load(req_start_ptr + req)
    num_rows = tl.load(req_rows_ptr + req)
    j = num_rows * 0
    running = num_rows > 0
    while running:
        row = start + j
        p_row = p_ptr + row * stride_p
        q_row = q_ptr + row * stride_q
        raw_draft = tl.load(draft_ptr + row)
        draft = tl.minimum(tl.maximum(raw_draft, 0), vocab - 1)
        bonus = tl.load(bonus_ptr + row) != 0
        seed = tl.load(seeds_ptr + row)
        position = tl.load(positions_ptr + row)
        m_p, s_p, argmax, m_q, s_q = _row_stats(p_row, q_row, vocab, HAS_Q, BLOCK_V)
        q_x = 1.0
        if HAS_Q:
            q_x = tl.math.div_rn(_exp(tl.load(q_row + draft) - m_q), s_q)
        p_x = tl.math.div_rn(_exp(tl.load(p_row + draft) - m_p), s_p)
        u = _uniform(_noise_key(seed, position, ACCEPT), tl.full((), 0, tl.int32))
        if SYNTHETIC:
            idx = tl.minimum(tl.load(row_index_ptr + row), num_rates - 1)
            accept = u < tl.load(rates_ptr + idx)
        else:
            accept = tl.where(tl.load(greedy_ptr + row) != 0, draft == argmax, u * q_x < p_x)
        accept = accept & (tl.load(bonus_ptr + row) == 0) & (raw_draft >= 0)
        if accept:
            tl.store(tokens_ptr + row, raw_draft)
            j += 1
        else:
            token = argmax.to(tl.int64)
            if tl.load(sampled_ptr + row) != 0:
                key = _noise_key(seed, position, RECOVER)
                if bonus:
                    key = _noise_key(seed, position, TARGET)
                token = _stop_draw(p_row, q_row, vocab, m_p, s_p, m_q, s_q, draft, key, bonus,
                                   HAS_Q, BLOCK_V).to(tl.int64)
            tl.store(tokens_ptr + row, token)
            running = False
        running = running & (j < num_rows)
    tl.store(emitted_ptr + req, j + 1)
    for jj in range(j + 1, num_rows):
        tl.store(tokens_ptr + start + jj, -1)


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
    them out); every request has >= 1 row and its last row is the bonus row.
    """
    num_rows, vocab = p_logits.shape
    dev = p_logits.device
    assert p_logits.dtype == torch.float32 and p_logits.stride(1) == 1
    for t in (row_draft, seeds, positions, row_req, row_index):
        assert t.shape == (num_rows,) and t.dtype == torch.int64
    assert row_is_bonus.shape == row_greedy.shape == (num_rows,)
    assert row_is_bonus.dtype == row_greedy.dtype == torch.bool
    if q_logits is not None:
        assert q_logits.shape == p_logits.shape and q_logits.dtype == torch.float32 and q_logits.stride(1) == 1
    if synthetic_rates is not None:
        assert synthetic_rates.dim() == 1 and synthetic_rates.shape[0] >= 1
    row_tokens = torch.empty(num_rows, dtype=torch.int64, device=dev)
    num_emitted = torch.empty(num_reqs, dtype=torch.int64, device=dev)
    if num_reqs == 0:
        return row_tokens, num_emitted
    row_sampled = torch.zeros(num_rows, dtype=torch.uint8, device=dev)
    if sampled_idx is not None:
        row_sampled.index_fill_(0, sampled_idx, 1)
    rows = torch.arange(num_rows, dtype=torch.int64, device=dev)
    req_start = torch.full((num_reqs,), num_rows, dtype=torch.int64, device=dev)
    req_start.scatter_reduce_(0, row_req, rows, "amin")
    req_rows = torch.zeros(num_reqs, dtype=torch.int64, device=dev).scatter_add_(0, row_req, torch.ones_like(rows))
    rates = synthetic_rates.float().contiguous() if synthetic_rates is not None else p_logits
    q = q_logits if q_logits is not None else p_logits
    _rejection_kernel[(num_reqs,)](
        p_logits, q, p_logits.stride(0), q.stride(0),
        row_draft, row_is_bonus.view(torch.uint8), row_greedy.view(torch.uint8), row_sampled,
        seeds, positions, row_index, rates, rates.shape[0] if synthetic_rates is not None else 1,
        req_start, req_rows, row_tokens, num_emitted, vocab,
        HAS_Q=q_logits is not None, SYNTHETIC=synthetic_rates is not None, BLOCK_V=_BLOCK_V,
        ACCEPT=ACCEPT_SALT, RECOVER=RECOVER_SALT, TARGET=TARGET_SALT, num_warps=16, **pdl_flags(p_logits),
    )
    return row_tokens, num_emitted
