"""Seeded Gumbel-max sampling on the GPU, bit-exact with tandem.sampling.gumbel.

The noise is the same counter-based hash (32-bit murmur3 finaliser over (seed, position, salt),
then over the token id), done here in uint32 arithmetic whose multiplications wrap exactly as
the int64 emulation in tandem.sampling.gumbel does, so every uniform has the same bits. The
logs go through libdevice's logf, the function torch's CUDA log calls.

Sampling is two launches with no host sync: each program reduces one block of the vocabulary
to (max score, argmax), then one program per row reduces the block results. No softmax.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.device import num_sms
from tandem.kernels.pdl import pdl_flags, wait_for_inputs
from tandem.sampling.gumbel import salt_word

_BLOCK_V = 2048  # tokens per inner step of a program


@triton.jit
def _fmix32(h):
    """murmur3 finaliser on uint32 (multiplications wrap mod 2**32)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _noise_key(seed, position, SALT: tl.constexpr):
    """seed, position int64 scalars (seed >= 0) -> uint32 key, as tandem.sampling.gumbel.noise_key."""
    return _keyed(seed, position, tl.full((), SALT, tl.uint32) * 0x9E3779B1 + 0x7F4A7C15)


@triton.jit
def _keyed(seed, position, salt_word):
    """_noise_key with the salt's word (uint32) given, as tandem.sampling.gumbel.salt_word makes it."""
    h = _fmix32(seed.to(tl.uint32) ^ salt_word)
    h = _fmix32(h ^ (seed >> 32).to(tl.uint32))
    return _fmix32(h ^ position.to(tl.uint32))


@triton.jit
def _uniform(key, tokens):
    """key uint32 scalar, tokens int [B] -> u = (top 23 bits + 0.5) / 2**23 fp32 [B], in
    [2**-24, 1 - 2**-24] so the Gumbel noise is finite (as tandem.sampling.gumbel.uniform)."""
    h = _fmix32(key ^ (tokens.to(tl.uint32) * 0x27D4EB2D))
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _gumbel(key, tokens):
    """-log(-log u). NOTE: tl.log lowers to libdevice's logf on NVIDIA (the PTX is identical),
    the function torch's CUDA log calls, and unlike libdevice.log it also runs interpreted."""
    return -tl.log(-tl.log(_uniform(key, tokens)))


# The chunking follows the number of rows (enough programs to fill the chip), which changes from
# step to step in serving: neither it nor the chunk count is specialised on, so a new batch size
# compiles nothing (a cold serving run at 32 slots had compiled variants of both mid-run). Nor is
# the salt: each column of a draft round has its own (tandem.sampling.gumbel.draft_salt).
@triton.jit(do_not_specialize=["num_chunks", "chunk_size", "salt_word"])
def _gumbel_block_kernel(
    logits_ptr,  # [n, V] fp32 / bf16 / fp16
    temperature_ptr,  # [n] fp32
    seeds_ptr,  # [n] int64
    positions_ptr,  # [n] int64
    part_val_ptr,  # [n, num_chunks] fp32
    part_idx_ptr,  # [n, num_chunks] int32
    stride_row,
    vocab,
    num_chunks,
    chunk_size,  # tokens per program, a multiple of BLOCK_V
    salt_word,  # int32: the salt's word (tandem.sampling.gumbel.salt_word), its bits as a signed int
    BLOCK_V: tl.constexpr,
    SAMPLE: tl.constexpr,  # False: plain argmax (temperature, seeds and positions are not read)
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = 0.0
    key = 0
    if SAMPLE:
        temp = tl.load(temperature_ptr + row)
        key = _keyed(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), salt_word.to(tl.uint32, bitcast=True))
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    best_val = -float("inf")
    best_idx = chunk * chunk_size
    for i in range(0, chunk_size, BLOCK_V):
        v0 = chunk * chunk_size + i
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        x = tl.load(row_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
        if SAMPLE and temp != 0.0:
            # NOTE: div_rn, not '/': Triton's fp32 division is approximate, torch's is IEEE.
            x = tl.math.div_rn(x, temp) + _gumbel(key, offs)
            x = tl.where(mask, x, -float("inf"))
        val, idx = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        better = val > best_val  # strict: ties keep the lower token, as torch.argmax
        best_idx = tl.where(better, v0 + idx, best_idx)
        best_val = tl.where(better, val, best_val)
    tl.store(part_val_ptr + row * num_chunks + chunk, best_val)
    tl.store(part_idx_ptr + row * num_chunks + chunk, best_idx)


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_C >= num_chunks for every chunking of the vocabulary (one variant per vocabulary size)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    vals = tl.load(part_val_ptr + row * num_chunks + offs, mask=offs < num_chunks, other=-float("inf"))
    _, best = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
    idx = tl.load(part_idx_ptr + row * num_chunks + best)
    tl.store(out_ptr + row, idx.to(tl.int64))


@triton.jit
def _gumbel_uniform_kernel(seeds_ptr, positions_ptr, out_ptr, vocab, SALT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key = _noise_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row), SALT)
    tl.store(out_ptr + row.to(tl.int64) * vocab + offs, _uniform(key, offs), mask=offs < vocab)


def _chunk_size(n: int, vocab: int, device: torch.device) -> int:
    """Tokens per program: enough programs to fill the chip twice over, at least one block."""
    want_chunks = max(1, (2 * num_sms(device)) // max(n, 1))
    chunk = triton.next_power_of_2(triton.cdiv(vocab, want_chunks))
    return max(_BLOCK_V, min(chunk, 32 * _BLOCK_V))


def gumbel_sample(
    logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor, salt: int, out: Tensor
) -> Tensor:
    """tokens[i] = argmax_v(logits[i, v] / T_i + g(seed_i, position_i, salt, v)); T_i == 0: argmax.

    logits [n, V] fp32 / bf16 / fp16 (-inf = masked); temperature [n] fp32; seeds, positions
    [n] int64; out [n] int64, written and returned. Ties go to the lower token (torch.argmax).
    The draw equals tandem.sampling.gumbel.gumbel_argmax(logits.float() / T, ...) except where
    two scores tie to within log rounding.
    """
    n, vocab = logits.shape
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1
    assert temperature.shape == (n,) and temperature.dtype == torch.float32
    assert seeds.shape == positions.shape == (n,)
    assert seeds.dtype == positions.dtype == torch.int64
    assert out.shape == (n,) and out.dtype == torch.int64
    assert vocab < 2**31
    return _blocked_argmax(logits, (temperature, seeds, positions), salt, out)


def argmax_rows(logits: Tensor, out: Tensor) -> Tensor:
    """out[i] = argmax_v logits[i, v] (ties to the lower token, as torch.argmax), split over
    the chip in vocabulary chunks: one row of a 128k vocabulary is ~5x faster than torch's
    single-block reduction. logits [n, V] fp32 / bf16 / fp16 (row stride free); out [n] int64."""
    n, vocab = logits.shape
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1
    assert out.shape == (n,) and out.dtype == torch.int64 and vocab < 2**31
    return _blocked_argmax(logits, None, 0, out)


def _blocked_argmax(logits: Tensor, noise: tuple[Tensor, Tensor, Tensor] | None, salt: int, out: Tensor) -> Tensor:
    """Per-chunk (max, argmax) of the scores, then one program per row picks the best chunk.
    noise = (temperature, seeds, positions) scores logits / T + Gumbel; None: the logits."""
    n, vocab = logits.shape
    if n == 0:
        return out
    chunk = _chunk_size(n, vocab, logits.device)
    num_chunks = triton.cdiv(vocab, chunk)
    part_val = torch.empty((n, num_chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((n, num_chunks), dtype=torch.int32, device=logits.device)
    temperature, seeds, positions = noise if noise is not None else (logits, logits, logits)  # unread
    word = salt_word(salt)
    _gumbel_block_kernel[(n, num_chunks)](
        logits, temperature, seeds, positions, part_val, part_idx, logits.stride(0), vocab, num_chunks, chunk,
        word - (1 << 32) if word >= 1 << 31 else word,
        BLOCK_V=_BLOCK_V, SAMPLE=noise is not None, num_warps=8, **pdl_flags(logits),
    )
    _argmax_reduce_kernel[(n,)](
        part_val, part_idx, out, num_chunks, BLOCK_C=triton.next_power_of_2(triton.cdiv(vocab, _BLOCK_V)),
        num_warps=1, **pdl_flags(logits),
    )
    return out


def gumbel_uniform(seeds: Tensor, positions: Tensor, salt: int, vocab_size: int) -> Tensor:
    """Debug path: the kernels' uniforms u [n, vocab_size] fp32, to compare bit for bit with
    tandem.sampling.gumbel.uniform(noise_key(seeds, positions, salt), arange(vocab_size))."""
    n = seeds.shape[0]
    assert seeds.shape == positions.shape == (n,) and seeds.dtype == positions.dtype == torch.int64
    out = torch.empty((n, vocab_size), dtype=torch.float32, device=seeds.device)
    if n:
        grid = (n, triton.cdiv(vocab_size, _BLOCK_V))
        _gumbel_uniform_kernel[grid](seeds, positions, out, vocab_size, SALT=salt, BLOCK_V=_BLOCK_V)
    return out
