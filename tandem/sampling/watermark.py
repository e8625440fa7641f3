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

Greedy requests (temperature 0) stay argmax. Per-slot windows of the last context_width tokens
live on the device and follow the emitted tokens without a host round trip.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tandem.errors import ConfigError
from tandem.plan import NewReq
from tandem.runner.upload import Uploader
from tandem.sampling.gumbel import _M32, _fmix32, _mul32, noise_key, uniform
from tandem.sampling_params import MAX_SEED, SamplingParams

WATERMARK_SALT = 4  # disjoint from the salts of tandem.sampling.gumbel
MAX_CONTEXT_WIDTH = 64
HASH_START = 0x6A09E667  # the context hash's state before its first token
TOKEN_MUL = 0xCC9E2D51  # token ids are multiplied by this (mod 2**32) before each mixing round


@dataclass(frozen=True)
class WatermarkConfig:
    """Engine-level watermark settings (vLLM's WatermarkConfig, algorithm "gumbel")."""

    key: int  # the secret: detection needs the same value
    context_width: int = 4  # preceding tokens that key each draw
    algorithm: str = "gumbel"

    def __repr__(self) -> str:  # the key stays out of logs
        return f"WatermarkConfig(algorithm={self.algorithm!r}, context_width={self.context_width}, key=<hidden>)"


def parse_watermark_config(value: Any) -> WatermarkConfig | None:
    """LLM(watermark_config=...): None, a WatermarkConfig, or a dict of its fields -> validated."""
    if value is None or isinstance(value, WatermarkConfig):
        raw = None if value is None else {"key": value.key, "context_width": value.context_width,
                                          "algorithm": value.algorithm}
    elif isinstance(value, dict):
        raw = dict(value)
    else:
        raise ConfigError(f"watermark_config must be a dict such as {{'key': 42}} or None, got {type(value).__name__}")
    if raw is None:
        return None
    known = ("key", "context_width", "algorithm")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"watermark_config: unknown or unsupported key(s) {unknown}; known keys: {list(known)}")
    if "key" not in raw:
        raise ConfigError("watermark_config.key is required: the secret integer in [0, 2**63) that detection needs")
    key, width, algorithm = raw["key"], raw.get("context_width", 4), raw.get("algorithm", "gumbel")
    if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key <= MAX_SEED:
        raise ConfigError(f"watermark_config.key must be an integer in [0, {MAX_SEED}], got a {type(key).__name__}")
    if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_CONTEXT_WIDTH:
        raise ConfigError(f"watermark_config.context_width={width!r} must be an integer in [1, {MAX_CONTEXT_WIDTH}]")
    if algorithm != "gumbel":
        raise ConfigError(f"watermark_config.algorithm={algorithm!r} is not supported; use 'gumbel'")
    return WatermarkConfig(key=key, context_width=width, algorithm=algorithm)


def watermarked(params: SamplingParams) -> bool:
    """Whether a request of a watermarking engine draws with the key (greedy rows cannot)."""
    return params.watermarking is not False and params.temperature > 0


def context_hash(contexts: Tensor) -> Tensor:
    """contexts [n, w] int64 token ids (-1 before the sequence's start) -> [n] int64 in [0, 2**32)."""
    h = torch.full(contexts.shape[:1], HASH_START, dtype=torch.int64, device=contexts.device)
    for j in range(contexts.shape[1]):
        h = _fmix32(h ^ _mul32(contexts[:, j] & _M32, TOKEN_MUL))
    return h


def row_keys(key: int, contexts: Tensor) -> Tensor:
    """contexts [n, w] -> the (seed, position) pair that keys each row's noise: seeds [n] (all key)
    and positions [n] (the context hashes), for gumbel_argmax / gumbel_sample with WATERMARK_SALT."""
    return torch.full(contexts.shape[:1], key, dtype=torch.int64, device=contexts.device), context_hash(contexts)


def keyed_uniform(key: int, contexts: Tensor, token_ids: Tensor) -> Tensor:
    """The u the draw used: contexts [n, w], token_ids [n] -> [n] fp32 in (0, 1) (the detector's input)."""
    seeds, hashes = row_keys(key, contexts)
    return uniform(noise_key(seeds, hashes, WATERMARK_SALT), token_ids)


def last_window(head: Tensor, tail: Tensor, num_tail: Tensor, width: int) -> Tensor:
    """The last `width` tokens of head ++ tail[:num_tail]: head [n, width], tail [n, m] (valid
    entries first), num_tail [n] int64 in [0, m] -> [n, width]."""
    joined = torch.cat([head, tail], dim=1)  # [n, width + m]
    cols = num_tail[:, None] + torch.arange(width, device=head.device)[None, :]
    return joined.gather(1, cols)


class WatermarkState:
    """Per-slot context windows on the device, and which slots draw with the key (host mirror)."""

    def __init__(self, cfg: WatermarkConfig, max_num_seqs: int, device: torch.device, upload: Uploader,
                 use_triton: bool = False):
        self.cfg = cfg
        self.key = cfg.key
        self.width = cfg.context_width
        self.upload = upload
        self.use_triton = use_triton  # the context hashes in one Triton launch (CUDA), else the torch reference
        self.windows = torch.full((max_num_seqs, self.width), -1, dtype=torch.int64, device=device)  # [slots, w]
        self.on = [False] * max_num_seqs

    def add_all(self, reqs: list[NewReq]) -> None:
        """Install the last context_width tokens (prompt and any output) of the new watermarked requests."""
        marked = []
        for r in reqs:
            self.on[r.slot] = watermarked(r.params)
            if self.on[r.slot]:
                marked.append(r)
        if not marked:
            return
        w = self.width
        rows = [([-1] * w + r.token_ids)[-w:] for r in marked]
        slot_t, rows_t = self.upload([r.slot for r in marked], [t for row in rows for t in row])
        self.windows.index_copy_(0, slot_t, rows_t.view(len(marked), w))

    def remove(self, slot: int) -> None:
        self.on[slot] = False

    def record(self, slot_ids: Tensor, tokens: Tensor, num_emitted: Tensor) -> None:
        """Slide the windows of slot_ids [n] (watermarked slots) over their emitted tokens:
        tokens [n, m] int64 (a request's first num_emitted [n] entries are its new tokens)."""
        self.windows[slot_ids] = last_window(self.windows[slot_ids], tokens, num_emitted, self.width)

    def keys(self, slot_ids: Tensor, drafts: Tensor | None = None, num_drafts: Tensor | None = None
             ) -> tuple[Tensor, Tensor]:
        """The noise keys (seeds, positions) of rows drawn right after their slot's window and the
        slot's first num_drafts [n] drafts (drafts: the speculator's per-slot buffer [slots, k];
        None: no drafts before the rows)."""
        if self.use_triton:
            from tandem.kernels.watermark import context_hashes

            hashes = context_hashes(self.windows, slot_ids, drafts, num_drafts)
            return torch.full_like(hashes, self.key), hashes
        contexts = self.windows[slot_ids]  # [n, w]
        if drafts is not None:
            contexts = last_window(contexts, drafts[slot_ids], num_drafts, self.width)
        return row_keys(self.key, contexts)
