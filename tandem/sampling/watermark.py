"""Gumbel watermark (Aaronson): a keyed draw in place of the random one.

A watermarked request samples token v at the row whose last `context_width` tokens are c as
argmax_v(l_v / T + g_v), with g_v = -log(-log u(key, c, v)) and u the same counter hash as the
seeded draw (tandem.sampling.gumbel) keyed by (key, hash of c, WATERMARK_SALT) instead of
(seed, position, salt). Over random keys that is an exact draw from softmax(l / T), so the
output is unbiased; for a fixed key the chosen tokens have unusually large u, which
tandem.detect measures from the token ids and the key alone.

The draw depends only on the prefix and the key, so speculation keeps it exactly: the draft
proposes with the same keyed noise on its own logits (the coupling makes it agree with the
target about as often as 1 - TV(p, q)), and the target accepts a draft iff it equals its own
keyed draw at that row, emitting its draw at the first mismatch (spec/rejection.py's
force_target_tokens). Speculative watermarked output equals target-only watermarked output
token for token. The request's seed does not enter: n > 1 choices of one prompt coincide.

A context the request has already drawn after (deduplicate_contexts "single_turn", vLLM's
default; "all" also counts the contexts inside the prompt) draws with the request's seed
instead, as without a watermark: the keyed noise would repeat, so the same token would tend to
follow (loops) and its evidence would not be independent. Only the most recent
deduplicate_contexts_max_history contexts are searched. Speculation mirrors this too: a verified
row's context counts the drafts before it, and the draft checks the same history.

Greedy requests (temperature 0) stay argmax. Per-slot windows of the last context_width tokens,
and the hashes of the contexts already drawn after, live on the device and follow the emitted
tokens without a host round trip.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tandem.errors import ConfigError
from tandem.plan import NewReq
from tandem.upload import Uploader
from tandem.sampling.gumbel import _M32, WATERMARK_SALT, _fmix32, _mul32, noise_key, uniform
from tandem.sampling_params import MAX_SEED, SamplingParams

MAX_CONTEXT_WIDTH = 64
DEDUP_SCOPES = ("none", "single_turn", "all")
MIN_HISTORY = 64
HASH_START = 0x6A09E667  # the context hash's state before its first token
TOKEN_MUL = 0xCC9E2D51  # token ids are multiplied by this (mod 2**32) before each mixing round


@dataclass(frozen=True)
class WatermarkConfig:
    """Engine-level watermark settings (vLLM's WatermarkConfig, algorithm "gumbel")."""

    key: int  # the secret: detection needs the same value
    context_width: int = 4  # preceding tokens that key each draw
    algorithm: str = "gumbel"
    deduplicate_contexts: str = "single_turn"  # "none" | "single_turn" | "all" (the prompt's contexts too)
    deduplicate_contexts_max_history: int | None = 8192  # recent contexts searched (None: the whole request)

    def __repr__(self) -> str:  # the key stays out of logs
        return (f"WatermarkConfig(algorithm={self.algorithm!r}, context_width={self.context_width}, "
                f"deduplicate_contexts={self.deduplicate_contexts!r}, "
                f"deduplicate_contexts_max_history={self.deduplicate_contexts_max_history}, key=<hidden>)")


_FIELDS = ("key", "context_width", "algorithm", "deduplicate_contexts", "deduplicate_contexts_max_history")


def parse_watermark_config(value: Any) -> WatermarkConfig | None:
    """LLM(watermark_config=...): None, a WatermarkConfig, or a dict of its fields -> validated."""
    if value is None:
        return None
    if isinstance(value, WatermarkConfig):
        raw = {name: getattr(value, name) for name in _FIELDS}
    elif isinstance(value, dict):
        raw = dict(value)
    else:
        raise ConfigError(f"watermark_config must be a dict such as {{'key': 42}} or None, got {type(value).__name__}")
    unknown = sorted(set(raw) - set(_FIELDS), key=repr)
    if unknown:
        raise ConfigError(f"watermark_config: unknown or unsupported key(s) {unknown}; known keys: {list(_FIELDS)}")
    if "key" not in raw:
        raise ConfigError("watermark_config.key is required: the secret integer in [0, 2**63) that detection needs")
    cfg = WatermarkConfig(**raw)
    key, width, history = cfg.key, cfg.context_width, cfg.deduplicate_contexts_max_history
    if not _is_int(key) or not 0 <= key <= MAX_SEED:
        what = "an integer out of that range" if _is_int(key) else f"a {type(key).__name__}"  # (the key stays secret)
        raise ConfigError(f"watermark_config.key must be an integer in [0, {MAX_SEED}], got {what}")
    if not _is_int(width) or not 1 <= width <= MAX_CONTEXT_WIDTH:
        raise ConfigError(f"watermark_config.context_width={width!r} must be an integer in [1, {MAX_CONTEXT_WIDTH}]")
    if cfg.algorithm != "gumbel":
        raise ConfigError(f"watermark_config.algorithm={cfg.algorithm!r} is not supported; use 'gumbel'")
    if cfg.deduplicate_contexts not in DEDUP_SCOPES:
        raise ConfigError(f"watermark_config.deduplicate_contexts={cfg.deduplicate_contexts!r} is not supported; use "
                          f"one of {list(DEDUP_SCOPES)}")
    if history is not None and (not _is_int(history) or history < MIN_HISTORY):
        raise ConfigError(f"watermark_config.deduplicate_contexts_max_history={history!r} must be an integer >= "
                          f"{MIN_HISTORY}, or None for the whole request")
    return cfg


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def watermarked(params: SamplingParams) -> bool:
    """Whether a request of a watermarking engine draws with the key (greedy rows cannot)."""
    return params.watermarking is not False and params.temperature > 0


def context_hash(contexts: Tensor) -> Tensor:
    """contexts [n, w] int64 token ids (-1 before the sequence's start) -> [n] int64 in [0, 2**32)."""
    h = torch.full(contexts.shape[:1], HASH_START, dtype=torch.int64, device=contexts.device)
    for j in range(contexts.shape[1]):
        h = _fmix32(h ^ _mul32(contexts[:, j] & _M32, TOKEN_MUL))
    return h


def keyed_uniform(key: int, contexts: Tensor, token_ids: Tensor) -> Tensor:
    """The u the keyed draw used: contexts [n, w], token_ids [n] -> [n] fp32 in (0, 1) (the detector's input)."""
    hashes = context_hash(contexts)
    return uniform(noise_key(torch.full_like(hashes, key), hashes, WATERMARK_SALT), token_ids)


def last_window(head: Tensor, tail: Tensor, num_tail: Tensor, width: int) -> Tensor:
    """The last `width` tokens of head ++ tail[:num_tail]: head [n, width], tail [n, m] (valid
    entries first), num_tail [n] int64 in [0, m] -> [n, width]."""
    joined = torch.cat([head, tail], dim=1)  # [n, width + m]
    cols = num_tail[:, None] + torch.arange(width, device=head.device)[None, :]
    return joined.gather(1, cols)


def sequence_contexts(token_ids: list[int], width: int) -> Tensor:
    """The context of every position of a sequence: [len, width] int64 (-1 before its start)."""
    padded = torch.tensor([-1] * width + token_ids, dtype=torch.int64)
    return padded.unfold(0, width, 1)[: len(token_ids)]


class WatermarkState:
    """Per-slot context windows and drawn-context histories on the device, and which slots draw
    with the key (host mirror)."""

    def __init__(self, cfg: WatermarkConfig, max_num_seqs: int, max_model_len: int, device: torch.device,
                 upload: Uploader, use_triton: bool = False):
        self.cfg = cfg
        self.key = cfg.key
        self.width = cfg.context_width
        self.upload = upload
        self.use_triton = use_triton  # the context hashes in one Triton launch (CUDA), else the torch reference
        self.windows = torch.full((max_num_seqs, self.width), -1, dtype=torch.int64, device=device)  # [slots, w]
        self.on = [False] * max_num_seqs
        self.dedup = cfg.deduplicate_contexts != "none"
        # Each slot's recent drawn-after context hashes, a ring of history_len (-1: empty), and the
        # count ever appended; the extra last column takes the writes of padded entries.
        cap = cfg.deduplicate_contexts_max_history or max_model_len
        self.history_len = min(cap, max_model_len) if self.dedup else 0
        self.history = torch.full((max_num_seqs, self.history_len + 1), -1, dtype=torch.int64, device=device)
        self.count = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)  # [slots]

    def add_all(self, reqs: list[NewReq]) -> None:
        """Install the new watermarked requests' windows (their last context_width tokens) and
        histories (the contexts of their output so far; with "all", of their prompt too)."""
        marked = []
        for r in reqs:
            self.on[r.slot] = watermarked(r.params)
            if self.on[r.slot]:
                marked.append(r)
        if not marked:
            return
        w, n = self.width, len(marked)
        rows = [([-1] * w + r.token_ids)[-w:] for r in marked]
        hist = [self._history_of(r) if self.dedup else [] for r in marked]
        at_row = [i for i, h in enumerate(hist) for _ in h]  # each history entry's request and column
        at_col = [c for h in hist for c in range(len(h))]
        slot_t, rows_t, hist_t, lens_t, row_t, col_t = self.upload(
            [r.slot for r in marked], [t for row in rows for t in row], [h for row in hist for h in row],
            [len(h) for h in hist], at_row, at_col)
        self.windows.index_copy_(0, slot_t, rows_t.view(n, w))
        if self.dedup:
            fresh = torch.full((n, self.history_len + 1), -1, dtype=torch.int64, device=self.history.device)
            fresh[row_t, col_t] = hist_t
            self.history.index_copy_(0, slot_t, fresh)
            self.count.index_copy_(0, slot_t, lens_t)

    def _history_of(self, r: NewReq) -> list[int]:
        """The hashes of the contexts a (re)admitted request has drawn after, the most recent last."""
        start = 0 if self.cfg.deduplicate_contexts == "all" else r.num_prompt_tokens
        contexts = sequence_contexts(r.token_ids, self.width)[start:]
        return context_hash(contexts)[-self.history_len :].tolist()

    def remove(self, slot: int) -> None:
        self.on[slot] = False

    def hashes(self, slot_ids: Tensor, tail: Tensor | None = None, tail_rows: Tensor | None = None,
               num_tail: Tensor | None = None) -> Tensor:
        """The context hashes [n] of rows drawn right after their slot's window ++ the first
        num_tail [n] tokens of tail[tail_rows] (tail [R, m]: the speculator's per-slot drafts,
        or a step's emitted tokens; None: the window alone)."""
        if self.use_triton:
            from tandem.kernels.watermark import context_hashes

            return context_hashes(self.windows, slot_ids, tail, tail_rows, num_tail)
        contexts = self.windows[slot_ids]  # [n, w]
        if tail is not None:
            contexts = last_window(contexts, tail[tail_rows], num_tail, self.width)
        return context_hash(contexts)

    def keys(self, slot_ids: Tensor, tail: Tensor | None = None, tail_rows: Tensor | None = None,
             num_tail: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """hashes(...) and which of those contexts the request has drawn after already (None
        without deduplication) -> ([n] int64, [n] bool | None).

        Drawn after: one of the contexts of the rows drawn before these in the same step or
        draft round (window ++ tail[:i] for i < num_tail: verified drafts, or this round's
        drafts), or one of the history entries those rows did not push out of reach (the last
        history_len - num_tail)."""
        if not self.dedup:
            return self.hashes(slot_ids, tail, tail_rows, num_tail), None
        if self.use_triton:
            from tandem.kernels.watermark import context_hashes_seen

            return context_hashes_seen(self.windows, slot_ids, tail, tail_rows, num_tail, self.history, self.count,
                                       self.history_len)
        hashes = self.hashes(slot_ids, tail, tail_rows, num_tail)
        size = self.history_len
        recent = self.history[slot_ids, :size]  # (not the scratch column) [n, size]
        count = self.count[slot_ids][:, None]  # [n, 1] entries ever appended
        earlier = torch.zeros_like(count) if num_tail is None else num_tail[:, None]
        col = torch.arange(size, device=hashes.device)
        entry = count - 1 - (count - 1 - col) % size  # the entry each column holds (< 0: none yet)
        seen = ((recent == hashes[:, None]) & (entry >= count + earlier - size)).any(dim=1)
        for i in range(tail.shape[1] if tail is not None else 0):
            before = self.hashes(slot_ids, tail, tail_rows, torch.full_like(num_tail, i))
            seen |= (before == hashes) & (i < num_tail)
        return hashes, seen

    def record(self, slot_ids: Tensor, tokens: Tensor, num_emitted: Tensor) -> None:
        """Slide the windows of slot_ids [n] (watermarked slots) over their emitted tokens,
        tokens [n, m] int64 (a request's first num_emitted [n] entries are its new tokens), and
        append those tokens' contexts to the histories."""
        n, m = tokens.shape
        if self.dedup:
            dev = tokens.device
            j = torch.arange(m, device=dev).repeat(n)  # [n * m]: each token's index within its request
            req = torch.arange(n, device=dev).repeat_interleave(m)
            hashes = self.hashes(slot_ids[req], tokens, req, j).view(n, m)
            col = (self.count[slot_ids][:, None] + torch.arange(m, device=dev)) % self.history_len  # [n, m]
            col = torch.where(torch.arange(m, device=dev) < num_emitted[:, None], col, self.history_len)
            self.history[slot_ids[:, None], col] = hashes
            self.count[slot_ids] += num_emitted
        self.windows[slot_ids] = last_window(self.windows[slot_ids], tokens, num_emitted, self.width)
