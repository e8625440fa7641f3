"""Seeded Gumbel-max sampling whose noise is a pure function of (seed, position, salt, token).

argmax_v(l_v / T + g_v) with g_v = -log(-log u_v) is an exact draw from softmax(l / T). The
uniform u_v comes from a counter-based hash, so a request's draw never depends on what else
is in the batch, on padding, or on whether drafts were used. The hash is 32-bit murmur3
finalisation done in int64 tensors with exact wrap-around multiplication, so the GPU
kernels (uint32 arithmetic) reproduce the same bits.
"""
from __future__ import annotations

import torch
from torch import Tensor

# Salts keep the noise streams disjoint: target sampling, draft sampling (one salt per draft
# column: draft_salt), the residual resample after a rejection, the uniforms of the accept test,
# block verification's uniforms (keyed by the round's first position and the row:
# tandem/spec/rejection.py) and the watermark's keyed draws (tandem/sampling/watermark.py).
TARGET_SALT = 0
DRAFT_SALT = 1
RECOVER_SALT = 2
ACCEPT_SALT = 3
BLOCK_SALT = 4
WATERMARK_SALT = 5

_M32 = 0xFFFFFFFF


def _mul32(a: Tensor, b: int) -> Tensor:
    """(a * b) mod 2**32 for a in [0, 2**32) without int64 overflow."""
    lo = (a & 0xFFFF) * b
    hi = ((a >> 16) * b) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def _fmix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def draft_salt(column: int) -> int:
    """The salt of a round's drafts at column (0-based; the column-th draft of the round): 1 + 8 * column,
    never another stream's salt. A position is drafted again by the round after one that ended before it,
    at a smaller column, so with fresh noise: block verification reads a round's drafts past the tokens it
    keeps (their p / q ratios decide how far it accepts), and a draft drawn again with the same noise would
    repeat what that decision already saw (with a draft that ignores its context, exactly), biasing the
    next round away from the target's distribution. Keying by column is keying by the round's first
    position (column = position - that), and DraftSpeculator.repair draws a column again with its noise."""
    return DRAFT_SALT + 8 * column


def salt_word(salt: int) -> int:
    """The 32-bit word a salt mixes into a key."""
    return (salt * 0x9E3779B1 + 0x7F4A7C15) & _M32


def noise_key(seeds: Tensor, positions: Tensor, salt: int) -> Tensor:
    """seeds [n] int64 (>= 0), positions [n] int64 -> per-row key [n] int64 in [0, 2**32)."""
    h = _fmix32((seeds & _M32) ^ salt_word(salt))
    h = _fmix32(h ^ ((seeds >> 32) & _M32))
    return _fmix32(h ^ (positions & _M32))


def uniform(keys: Tensor, token_ids: Tensor) -> Tensor:
    """keys [n, 1] or [n], token_ids broadcastable -> u in (0, 1) fp32 from 23 random bits.

    u = (top 23 bits + 0.5) / 2**23 is exact in fp32 and lies in [2**-24, 1 - 2**-24], so the
    Gumbel noise is always finite (with 24 bits the largest value would round to 1.0, giving
    infinite noise that beats even a masked -inf logit).
    """
    h = _fmix32(keys ^ _mul32(token_ids, 0x27D4EB2D))
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seeds: Tensor, positions: Tensor, salt: int, vocab_size: int) -> Tensor:
    """-> g [n, vocab_size] fp32 Gumbel(0, 1) noise keyed by (seed, position, salt, token)."""
    return gumbel_from_keys(noise_key(seeds, positions, salt), vocab_size)


def gumbel_from_keys(keys: Tensor, vocab_size: int) -> Tensor:
    """keys [n] from noise_key -> g [n, vocab_size] fp32."""
    return -torch.log(-torch.log(uniform_rows(keys, vocab_size)))


def uniform_rows(keys: Tensor, vocab_size: int) -> Tensor:
    """keys [n] from noise_key -> u [n, vocab_size] = uniform(keys[:, None], arange(vocab_size)).

    On a CPU where tandem's C kernels build, one call of tandem.kernels.cpu_gumbel (the same bits:
    integer arithmetic and an exact conversion; 3.6 ms -> ~0.05 ms a row of a 151936-token
    vocabulary on the 2-core dev machine); elsewhere (and on CUDA outside the Triton kernels) the
    int64 emulation above."""
    if keys.device.type == "cpu":
        from tandem.kernels import cpu_build

        isa = cpu_build.best_isa()
        if isa is not None:
            from tandem.kernels.cpu_gumbel import uniform_rows as c_uniform_rows

            return c_uniform_rows(keys, vocab_size, isa)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)[None, :]
    return uniform(keys[:, None], tokens)


def gumbel_argmax(logits: Tensor, seeds: Tensor, positions: Tensor, salt: int) -> Tensor:
    """logits [n, V] fp32 (already divided by temperature, -inf = masked) -> tokens [n] int64."""
    return (logits + gumbel_noise(seeds, positions, salt, logits.shape[-1])).argmax(dim=-1)
