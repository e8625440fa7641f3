"""Turn raw logits into the processed distribution a request samples from.

Order (as vLLM): allowed token ids, bad words, logit bias, min_tokens, penalties, then (sampled
rows only) temperature, min-p, top-k, top-p. Masked tokens get -inf. Every stage works on fp32 rows and decides from
host mirrors whether it has anything to do, so an unused feature costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.sampling.state import SamplingState
from tandem.sampling_params import FLOAT32_MAX


# Rows the processors handle at once: their temporaries (penalty counts, sort, softmax, cumsum)
# are [rows, V]; a verification of 256 requests x 5 rows at a 128k vocabulary is 0.6 GiB per
# fp32 copy (chunking the masks and logprobs cut the worst-case step's memory from 10.3 to 6.0 GiB
# on the H200: docs/benchmarks.md, fourteenth run).
CHUNK_ROWS = 128


@dataclass(slots=True)
class SampleRows:
    """The logits rows of one step and whose they are."""

    slots: list[int]  # [n] host
    slot_ids: Tensor  # [n] int64 device
    positions: Tensor  # [n] int64, position of the token each row generates (noise key)
    num_outputs: list[int]  # [n] output tokens that precede the row's token
    prior_drafts: Tensor | None = None  # [n, k] int64 earlier drafts of the same request, -1 pad

    def __len__(self) -> int:
        return len(self.slots)


def apply_token_bitmask(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """Structured outputs: -inf, in place in logits [n, V], every token that rows [m] int64 may not
    emit: bitmask [m, ceil(V / 32)] int32 allows token t iff bit t % 32 of word t // 32 is set."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]  # [m, V]
    kept = logits.index_select(0, rows).masked_fill_(allowed == 0, float("-inf"))
    logits.index_copy_(0, rows, kept)


def apply_logits_processors(logits: Tensor, state: SamplingState, rows: SampleRows, penalties: bool = True) -> None:
    """Allowed token ids, bad words, logit bias, min_tokens and (unless penalties is False) penalties,
    in place on fp32 logits [n, V]."""
    for i, slot in enumerate(rows.slots):
        guard = slot in state.can_empty
        if guard:
            stop_ids = state.stop_ids[slot]
            stop_logits = logits[i].index_select(0, stop_ids)  # [s] before the masks
        allowed = state.allowed_ids.get(slot)
        if allowed is not None:
            kept = logits[i].index_select(0, allowed)  # [m]
            logits[i].fill_(float("-inf")).index_copy_(0, allowed, kept)
        words = state.bad_words.get(slot)
        if words is not None:
            _ban_bad_words(logits[i], words, state.recent.get(slot),
                           rows.prior_drafts[i] if rows.prior_drafts is not None else None)
        bias = state.logit_bias.get(slot)
        if bias is not None:
            logits[i].index_add_(0, bias[0], bias[1])
        if guard:
            _end_if_empty(logits[i], stop_ids, stop_logits)
        stop_ids = state.min_tokens_ids.get(slot)
        if stop_ids is not None and rows.num_outputs[i] < state.params[slot].min_tokens:
            _hold_back(logits[i], stop_ids)
    if not penalties:
        return
    pen = [i for i, slot in enumerate(rows.slots) if slot in state.output_counts]
    for i in range(0, len(pen), CHUNK_ROWS):
        _apply_penalties(logits, state, rows, pen[i : i + CHUNK_ROWS])


def _end_if_empty(row: Tensor, stop_ids: Tensor, stop_logits: Tensor) -> None:
    """A row [V] that allowed_token_ids, bad words or a -inf logit bias left empty (no token fits
    both them and the request's structured output) allows its stop ids [s] instead, at their logits [s] from before
    those masks (0 where the grammar had masked them too): the output ends there rather than
    drawing a token every constraint forbids until max_tokens. No sync."""
    empty = torch.isneginf(row).all()
    fallback = torch.where(torch.isneginf(stop_logits), 0.0, stop_logits)
    row.index_copy_(0, stop_ids, torch.where(empty, fallback, row.index_select(0, stop_ids)))


def _hold_back(row: Tensor, stop_ids: Tensor) -> None:
    """min_tokens: the stop ids [s] of row [V] to -inf, unless nothing else is left in it (a grammar
    whose output is complete, or allowed_token_ids, allows only stop ids): then they stay, and the
    row never empties (an empty row would draw a token its constraint forbids). No sync: the choice
    is made on the device."""
    kept = row.index_select(0, stop_ids)  # [s]
    row.index_fill_(0, stop_ids, float("-inf"))  # (`row[ids] = -inf` copies the scalar: a sync)
    empty = torch.isneginf(row).all()
    row.index_copy_(0, stop_ids, torch.where(empty, kept, float("-inf")))


def _ban_bad_words(row: Tensor, words: tuple[Tensor, Tensor], recent: Tensor | None,
                   prior: Tensor | None) -> None:
    """Ban, in row [V], the last token of every bad word whose other tokens end the output so far.

    words: prefixes [w, width] (right-aligned, -1 = any token) and last tokens [w]; recent [width]
    the slot's last output tokens (-1 = none); prior [k] the drafts before this row in its
    verification (-1 padded), which the output so far includes."""
    prefixes, last = words
    width = prefixes.shape[1]
    if width == 0:  # single-token words: always banned
        row.index_fill_(0, last, float("-inf"))
        return
    history = recent
    if prior is not None:  # the last `width` tokens of recent + the row's prior drafts
        both = torch.cat([recent, prior])  # [width + k]
        start = (prior >= 0).sum()  # the prior drafts are a prefix of `prior`
        history = both.gather(0, start + torch.arange(width, device=both.device))
    match = ((prefixes == history) | (prefixes < 0)).all(dim=-1)  # [w]
    # index_add_, not a masked write: words sharing a last token must not overwrite each other.
    row.index_add_(0, last, torch.where(match, float("-inf"), 0.0))


def _apply_penalties(logits: Tensor, state: SamplingState, rows: SampleRows, pen: list[int]) -> None:
    (idx,) = state.upload(pen)
    counts = torch.stack([state.output_counts[rows.slots[i]] for i in pen])  # [m, V] int32, a copy
    if rows.prior_drafts is not None:
        prior = rows.prior_drafts[idx]  # [m, k]
        counts.scatter_add_(1, prior.clamp(min=0), (prior >= 0).to(torch.int32))
    prompt = torch.stack([state.prompt_mask[rows.slots[i]] for i in pen])  # [m, V] bool
    slot_ids = rows.slot_ids[idx]
    rep = state.repetition_penalty[slot_ids][:, None]  # [m, 1]
    freq = state.frequency_penalty[slot_ids][:, None]
    pres = state.presence_penalty[slot_ids][:, None]
    sub = logits[idx]
    seen = prompt | (counts > 0)
    # A penalty below 1 may lift a large (biased) logit past the floats: held at the largest float32, so the
    # row keeps a finite maximum (an inf made the softmax NaN); such slots are shifted (state.shifted).
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub).clamp(max=FLOAT32_MAX)
    sub = sub - freq * counts - pres * (counts > 0)
    logits[idx] = sub


def apply_temperature_and_masks(logits: Tensor, state: SamplingState, rows: SampleRows) -> Tensor:
    """Sampled rows: divide by temperature, then min-p, top-k, top-p masks. -> new [n, V] fp32.

    Greedy rows (temperature 0) pass through unchanged.
    """
    temp = state.temperature[rows.slot_ids]
    out = divide_by_temperature(logits, temp, rows.slots, state)
    params = [state.params[s] for s in rows.slots]
    # Each mask on the rows that ask for it only (min-p 0, top-k 0 and top-p 1 keep every token): one
    # request's top-p sorted the whole batch's rows over the vocabulary, every step.
    slot_ids = rows.slot_ids
    on_rows(out, [i for i, p in enumerate(params) if p.temperature > 0 and p.min_p > 0], state.upload,
            lambda sub, idx: apply_min_p(sub, state.min_p[slot_ids[idx]]))
    on_rows(out, [i for i, p in enumerate(params) if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1)], state.upload,
            lambda sub, idx: apply_top_k_top_p(sub, state.top_k[slot_ids[idx]], state.top_p[slot_ids[idx]]))
    return torch.where((temp == 0)[:, None], logits, out, out=out)


def on_rows(out: Tensor, which: list[int], upload, fn) -> None:
    """fn(out's rows `which` [m, V], their indices [m]) in place on out [n, V] (upload: the
    uploader of host index lists). Each row's result is what fn makes of it alone: fn's operations
    are a row's."""
    if not which:
        return
    (idx,) = upload(which)
    if len(which) == out.shape[0]:
        fn(out, idx)
        return
    sub = out.index_select(0, idx)
    fn(sub, idx)
    out.index_copy_(0, idx, sub)


def divide_by_temperature(logits: Tensor, temp: Tensor, slots: list[int], state: SamplingState) -> Tensor:
    """logits [n, V] / temp [n] (0 read as 1) -> new [n, V] fp32, a row a slot's.

    The rows of slots a huge positive bias or a tiny repetition penalty lifts (state.shifted) lose their
    maximum first, where it is positive: the same distribution, but their biased logits divided by a
    temperature would otherwise overflow to inf (a NaN softmax: min-p / top-p then mask every token) or
    reach magnitudes whose spacing swamps the Gumbel noise (two equally forced tokens not drawn evenly).
    Other rows are divided as they are, bit for bit."""
    divisor = torch.where(temp > 0, temp, 1.0)[:, None]
    if not (state.shifted and any(s in state.shifted for s in slots)):
        return logits / divisor
    (mark,) = state.upload([int(s in state.shifted) for s in slots])
    shift = logits.amax(dim=-1, keepdim=True).clamp_min(0.0).where(mark.bool()[:, None], 0.0)  # [n, 1]
    return (logits - shift) / divisor


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Keep tokens with prob >= min_p * max prob, in place on logits [n, V]. min_p [n] fp32 (0 = off)."""
    for i in range(0, logits.shape[0], CHUNK_ROWS):
        chunk = logits[i : i + CHUNK_ROWS]
        probs = chunk.softmax(dim=-1)
        keep = probs >= min_p[i : i + CHUNK_ROWS, None] * probs.max(dim=-1, keepdim=True).values
        chunk.masked_fill_(~keep, float("-inf"))
    return logits


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Top-k (k [n] int64, 0 = off) then top-p (p [n] fp32, 1 = off) over the top-k survivors,
    in place on logits [n, V].

    Top-k keeps every token whose logit is >= the k-th largest (ties at the cut survive).
    Top-p keeps the smallest set of highest-probability tokens whose mass reaches p: a token
    survives when the mass strictly above it in sorted order is < p (the top token always does).
    The mass is summed from the least likely token up (as vLLM does): the tail's small terms are
    not lost to rounding, and a row with p = 1 loses no token, whatever rows share its batch.
    """
    for i in range(0, logits.shape[0], CHUNK_ROWS):
        j = slice(i, i + CHUNK_ROWS)
        _top_k_top_p(logits[j], top_k[j], top_p[j])
    return logits


def _top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> None:
    vocab = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1).values  # [n, V] ascending
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (vocab - k)[:, None])  # [n, 1] the k-th largest
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_at_or_below = probs.cumsum(dim=-1)  # [n, V]
    drop_sorted = (mass_at_or_below <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]
    drop_sorted[:, -1] = False  # the top token always survives
    # Threshold: the smallest kept logit per row (the dropped set is a prefix of the sorted order).
    num_drop = drop_sorted.sum(dim=-1, keepdim=True)
    cut = torch.maximum(sorted_logits.gather(1, num_drop), kth)
    logits.masked_fill_(logits < cut, float("-inf"))
