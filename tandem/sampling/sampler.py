"""Sampler: processed logits -> one token per row, plus logprobs when a request asks for them."""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.sampling.gumbel import TARGET_SALT, gumbel_argmax
from tandem.sampling.processors import CHUNK_ROWS, SampleRows, apply_logits_processors, apply_temperature_and_masks
from tandem.sampling.state import SamplingState
from tandem.sampling.watermark import WATERMARK_SALT


def process_logits(logits: Tensor, state: SamplingState, rows: SampleRows) -> Tensor:
    """Raw logits [n, V] -> the processed distribution's logits [n, V] fp32 (-inf = masked).

    Greedy rows get allowed ids, bad words, bias, min_tokens and penalties but no temperature or truncation.
    """
    # NOTE: processors write in place; for fp32 models that is the step's own logits buffer
    # (or a graph's static output), which nothing reads after sampling.
    logits = logits[:, : state.vocab_size].float()
    params = [state.params[s] for s in rows.slots]
    if state.processed and any(slot in state.processed for slot in rows.slots):
        apply_logits_processors(logits, state, rows)
    if all(p.temperature == 0 for p in params):
        return logits  # greedy rows: no temperature, no truncation
    return apply_temperature_and_masks(logits, state, rows)


def greedy_tokens(logits: Tensor, use_triton: bool) -> Tensor:
    """logits [n, V] -> argmax [n] int64 (ties to the lower token), chip-wide on CUDA."""
    if use_triton:
        from tandem.kernels.gumbel import argmax_rows

        return argmax_rows(logits, torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device))
    return logits.argmax(dim=-1)


def sample(processed: Tensor, state: SamplingState, rows: SampleRows, salt: int = TARGET_SALT) -> Tensor:
    """processed [n, V] fp32 -> tokens [n] int64: argmax for greedy rows, seeded Gumbel-max otherwise
    (keyed by the watermark and the row's context instead for watermarked rows)."""
    tokens = greedy_tokens(processed, state.use_triton)
    wm = state.watermark
    sampled, marked = [], []
    for i, s in enumerate(rows.slots):
        if state.params[s].temperature > 0:
            (marked if wm is not None and wm.on[s] else sampled).append(i)
    if sampled:
        (idx,) = state.upload(sampled)
        tokens[idx] = draw(processed[idx], state.seeds[rows.slot_ids[idx]], rows.positions[idx], salt, state.use_triton)
    if marked:
        (idx,) = state.upload(marked)
        slot_ids = rows.slot_ids[idx]
        hashes, seen = wm.keys(slot_ids)
        tokens[idx] = keyed_draw(processed[idx], wm.key, hashes, seen, state.seeds[slot_ids], rows.positions[idx],
                                 state.use_triton)
    return tokens


def keyed_draw(processed: Tensor, key: int, hashes: Tensor, seen: Tensor | None, seeds: Tensor, positions: Tensor,
               use_triton: bool) -> Tensor:
    """Watermarked rows' draws [n]: keyed by (key, the context hash [n]), except where seen [n]
    (a context the request drew after before; None: none) the seeded draw a row without the
    watermark would make, keyed by (seeds [n], positions [n])."""
    tokens = draw(processed, torch.full_like(hashes, key), hashes, WATERMARK_SALT, use_triton)
    if seen is not None:
        tokens = torch.where(seen, draw(processed, seeds, positions, TARGET_SALT, use_triton), tokens)
    return tokens


def draw(processed: Tensor, seeds: Tensor, positions: Tensor, salt: int, use_triton: bool) -> Tensor:
    """processed [n, V] fp32 (temperature applied) -> the Gumbel-max draws [n] int64 keyed by
    (seeds [n], positions [n], salt): the Triton kernel on CUDA, the torch reference elsewhere."""
    if use_triton:
        from tandem.kernels.gumbel import gumbel_sample

        ones = torch.ones(processed.shape[0], dtype=torch.float32, device=processed.device)
        out = torch.empty(processed.shape[0], dtype=torch.int64, device=processed.device)
        return gumbel_sample(processed, ones, seeds, positions, salt, out)
    return gumbel_argmax(processed, seeds, positions, salt)


def compute_logprobs(processed: Tensor, tokens: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> chosen logprob [n], chosen rank [n] (1-based), top ids [n, num_top], top logprobs [n, num_top].
    Rows go CHUNK_ROWS at a time (each chunk's log-softmax is a [rows, V] temporary)."""
    if processed.shape[0] <= CHUNK_ROWS:
        return _logprobs(processed, tokens, num_top)
    chunks = [_logprobs(processed[i : i + CHUNK_ROWS], tokens[i : i + CHUNK_ROWS], num_top)
              for i in range(0, processed.shape[0], CHUNK_ROWS)]
    return tuple(torch.cat(parts) for parts in zip(*chunks))


def _logprobs(processed: Tensor, tokens: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    logprobs = processed.log_softmax(dim=-1)
    tokens = tokens.clamp(min=0)  # rows past a rejection may hold -1; nothing reads them
    chosen = logprobs.gather(1, tokens[:, None])  # [n, 1]
    rank = (logprobs >= chosen).sum(dim=-1)  # tokens tied with the chosen one count before it, as in vLLM
    if num_top == 0:
        return chosen[:, 0], rank, tokens[:, None][:, :0], logprobs[:, :0]
    top_ids = top_tokens(logprobs, num_top)
    return chosen[:, 0], rank, top_ids, logprobs.gather(1, top_ids)


TOP_ROWS = 32  # _keyed_top's rows a pass: [32, 152k] int64 keys are 39 MB (~80 MB with the temporaries)
TIE_MARGIN = 16  # top_tokens on a CPU: candidates past k that hold the ties at the k-th value


def top_tokens(logprobs: Tensor, k: int) -> Tensor:
    """The k likeliest tokens of each row of logprobs [n, V] (fp32 values), likeliest first, equal values in
    token-id order -> [n, k] int64. So a row's first j are its top j whatever k: a request asking logprobs=1
    lists the same token beside one asking 5 as alone (torch.topk orders ties as its k makes it, and a step's k
    is its widest request's).

    On a GPU (and for k near V) every token is keyed (`_keyed_top`: no host sync). On a CPU, where keying the
    whole vocabulary took ~6x torch.topk's time (64 rows of 152k, 91 against 14 ms), torch.topk takes k +
    TIE_MARGIN candidates first; a row whose last candidate is below its k-th value holds every token tied
    with it, and those are keyed alone; the other rows (more ties at the k-th value than the margin) are
    keyed whole."""
    n, vocab = logprobs.shape
    if n == 0:
        return torch.zeros(0, k, dtype=torch.int64, device=logprobs.device)
    if logprobs.is_cuda or k + TIE_MARGIN >= vocab:
        return _keyed_top(logprobs, k, torch.arange(vocab, dtype=torch.int64, device=logprobs.device))
    vals, ids = logprobs.topk(k + TIE_MARGIN, dim=-1)  # [n, k + margin]
    out = ids.gather(1, _keyed_top(vals, k, ids))  # (ties sorted within the candidates)
    whole = (vals[:, -1] >= vals[:, k - 1]).nonzero()[:, 0]  # rows whose ties at the k-th value spill over
    if whole.numel():
        every = torch.arange(vocab, dtype=torch.int64)
        out[whole] = _keyed_top(logprobs.index_select(0, whole), k, every)
    return out


def _keyed_top(values: Tensor, k: int, ids: Tensor) -> Tensor:
    """Positions (along the last dim) of the k largest of values [n, m], equal values by ids ([m], or [n, m]:
    token ids < 2^32) ascending: one int64 key each, the value's bits ordered as the floats are, above the
    id reversed; TOP_ROWS rows a pass."""
    parts = []
    for i in range(0, values.shape[0], TOP_ROWS):
        bits = values[i : i + TOP_ROWS].float().view(torch.int32)
        key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # negative floats: magnitude flipped
        key.mul_(1 << 32).add_((1 << 32) - 1 - (ids if ids.dim() == 1 else ids[i : i + TOP_ROWS]))  # distinct
        parts.append(key.topk(k, dim=-1).indices)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
