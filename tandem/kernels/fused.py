"""Fused elementwise kernels for the decode hot path: RMSNorm (optionally with the residual add),
rotary embedding of q and k in place, and SiLU-and-mul. Each replaces a chain of small eager
launches with one, and rounds exactly where the eager torch op rounds:

- rms_norm: r = x + residual rounded to the dtype (written back to `residual`), then
  weight * (r32 * rsqrt(mean(r32^2) + eps)).to(dtype), the final product computed in fp32 from
  the two dtype values and rounded once (as torch's `weight * y` in bf16 / fp16). Only the
  order of the sum of squares differs from torch (one program sums a row as a tree).
- rotary_embedding: x * cos + rotate_half(x) * sin from fp32 tables in fp32, rounded once
  (the eager op rounds the tables and each product to the dtype first).
- silu_and_mul: silu(gate) computed in fp32 and rounded, times up in fp32 and rounded, as
  torch's `F.silu(gate) * up`.

Numerics: every launch passes enable_fp_fusion=False, so no multiply-add is contracted to an FMA
(torch's separate launches round each product). On CUDA, exp and rsqrt go through libdevice's
expf / rsqrtf, the routines torch's CUDA silu and rsqrt call, and the divide is IEEE (div_rn);
the mean is sum * fp32(1/H) as torch's CUDA mean (sum / H on the CPU, as torch's CPU mean).

Every wrapper takes its sizes from tensor shapes only (no device-to-host reads, no
data-dependent allocation), so each launch can be captured in a CUDA graph.
"""
from __future__ import annotations


import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from tandem.kernels.device import interpreting
from tandem.kernels.kv_store import to_cache
from tandem.kernels.pdl import pdl_flags, release_then_wait, wait_for_inputs

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _numerics(t: Tensor) -> dict:
    """Launch flags: libdevice math on compiled CUDA; software bf16 rounding in the interpreter.

    NOTE: Triton 3.6's interpreter truncates fp32 -> bf16 casts (no round-to-nearest-even), and
    cannot run libdevice calls; it takes the portable paths there."""
    interpret = interpreting()
    return dict(
        CUDA_LIBM=t.is_cuda and not interpret,
        SOFT_BF16=interpret and t.dtype == torch.bfloat16,
    )


@triton.jit
def _round(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even (by hand for bf16 under the interpreter)."""
    if SOFT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


# ----------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N], rows contiguous
    res_ptr,  # [T, N] residual stream, updated in place (HAS_RES only)
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    stride_x,
    stride_r,
    stride_o,
    eps,
    inv_n,  # fp32(1 / N)
    n_float,  # float(N)
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    release_then_wait(PDL)  # a GEMV usually follows: its programs are placed while this waits
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r_ptrs = res_ptr + row * stride_r + offs
        r = _round(x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32), dtype, SOFT_BF16)
        tl.store(r_ptrs, r, mask=mask)
        x = r.to(tl.float32)
    ss = tl.sum(x * x, axis=0)
    if CUDA_LIBM:
        inv = libdevice.rsqrt(ss * inv_n + eps)
    else:
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, n_float) + eps))
    y = _round(x * inv, dtype, SOFT_BF16).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, _round(w * y, dtype, SOFT_BF16), mask=mask)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """RMSNorm of each row of x (or of x + residual); writes and returns out.

    x [T, H] bf16 / fp16 / fp32 (each row contiguous, row stride free); weight [H] same dtype,
    contiguous. Without residual: out = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype),
    as tandem.layers.norm.RMSNorm. With residual [T, H] (same dtype, rows contiguous): residual
    becomes (x + residual) rounded to dtype, in place, and out = rms_norm(that). out [T, H]
    (rows contiguous; allocated when None) may be x itself, not residual.
    """
    assert x.dim() == 2 and x.dtype in _FLOAT_DTYPES and x.stride(1) == 1
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and weight.is_contiguous()
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        assert residual.data_ptr() != out.data_ptr() and residual.data_ptr() != x.data_ptr()
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(hidden)
    assert block <= 32768, "one program holds a whole row in registers"
    res = residual if residual is not None else x
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0),
        float(eps), float(np.float32(1.0) / np.float32(hidden)), float(hidden),
        N=hidden, BLOCK=block, HAS_RES=residual is not None, **_numerics(x), **pdl_flags(x),
        num_warps=max(1, min(16, block // 512)), enable_fp_fusion=False,
    )
    return out


# ----------------------------------------------------------------------------- rotary
@triton.jit
def _rotate_heads(
    base_ptr, stride_h, h0, c1, c2, s1, s2, offs_d, d_mask,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    """Heads [h0, h0 + BLOCK_H) of one token: x1' = x1 c1 - x2 s1, x2' = x2 c2 + x1 s2 (fp32)."""
    heads = h0 + tl.arange(0, BLOCK_H)
    mask = (heads < NUM_HEADS)[:, None] & d_mask[None, :]
    p1 = base_ptr + heads[:, None].to(tl.int64) * stride_h + offs_d[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    dtype = base_ptr.dtype.element_ty
    o1 = _round(o1, dtype, SOFT_BF16).to(dtype)
    o2 = _round(o2, dtype, SOFT_BF16).to(dtype)
    tl.store(p1, o1, mask=mask)
    tl.store(p2, o2, mask=mask)
    return o1, o2, heads, mask


@triton.jit
def _rotary_kernel(
    pos_ptr,  # [T] int32 / int64
    q_ptr,  # [T, NUM_Q, 2 * HALF], last dim contiguous
    k_ptr,  # [T, NUM_K, 2 * HALF]
    cos_ptr,  # [max_pos, 2 * HALF] fp32
    sin_ptr,
    v_ptr,  # [T, NUM_K, 2 * HALF] (STORE only)
    k_cache_ptr,  # [num_slots, NUM_K, 2 * HALF] contiguous (STORE only)
    v_cache_ptr,
    slot_ptr,  # [T] int32 / int64, -1 = padding (STORE only)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, stride_vt, stride_vh,
    STORE: tl.constexpr,  # also write the rotated k and v into the paged cache
    NUM_Q: tl.constexpr,
    NUM_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, q head blocks + k head blocks): one block of one token's q or k heads."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    c_row = cos_ptr + pos * stride_cos + offs_d
    s_row = sin_ptr + pos * stride_sin + offs_d
    c1 = tl.load(c_row, mask=d_mask, other=0.0)
    c2 = tl.load(c_row + HALF, mask=d_mask, other=0.0)
    s1 = tl.load(s_row, mask=d_mask, other=0.0)
    s2 = tl.load(s_row + HALF, mask=d_mask, other=0.0)
    Q_BLOCKS: tl.constexpr = (NUM_Q + BLOCK_H - 1) // BLOCK_H
    if hb < Q_BLOCKS:
        _rotate_heads(q_ptr + token * stride_qt, stride_qh, hb * BLOCK_H, c1, c2, s1, s2, offs_d, d_mask,
                      NUM_HEADS=NUM_Q, HALF=HALF, BLOCK_H=BLOCK_H, SOFT_BF16=SOFT_BF16)
    else:
        k1, k2, heads, mask = _rotate_heads(
            k_ptr + token * stride_kt, stride_kh, (hb - Q_BLOCKS) * BLOCK_H, c1, c2, s1, s2, offs_d, d_mask,
            NUM_HEADS=NUM_K, HALF=HALF, BLOCK_H=BLOCK_H, SOFT_BF16=SOFT_BF16,
        )
        if STORE:
            slot = tl.load(slot_ptr + token).to(tl.int64)
            if slot >= 0:
                row = slot * (NUM_K * 2 * HALF) + heads[:, None].to(tl.int64) * (2 * HALF) + offs_d[None, :]
                tl.store(k_cache_ptr + row, to_cache(k1, k_cache_ptr), mask=mask)
                tl.store(k_cache_ptr + row + HALF, to_cache(k2, k_cache_ptr), mask=mask)
                v_src = v_ptr + token * stride_vt + heads[:, None].to(tl.int64) * stride_vh + offs_d[None, :]
                tl.store(v_cache_ptr + row, to_cache(tl.load(v_src, mask=mask), v_cache_ptr), mask=mask)
                tl.store(v_cache_ptr + row + HALF, to_cache(tl.load(v_src + HALF, mask=mask), v_cache_ptr), mask=mask)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                     store: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> None:
    """Rotate q and k in place: x = x * cos[p] + rotate_half(x) * sin[p] (rotate-half layout:
    dims i and i + D/2 pair up), in fp32 with one rounding to the dtype.

    store = (v, k_cache, v_cache, slot_mapping): also write the rotated k and v into the paged
    cache in the same launch (as kernels.kv_store.kv_store would): v like k; caches
    [num_blocks, block_size, Hkv, D] contiguous, k's dtype or float8 e4m3 (saturated); slot_mapping [T] int32 / int64
    (-1 = padding, not written).

    positions [T] int32 / int64 (each < max_pos; not checked); q [T, H, D], k [T, Hkv, D]
    bf16 / fp16 / fp32, same dtype, last dim contiguous, token and head strides free (views of
    a fused qkv output work); cos, sin [max_pos, D] fp32, last dim contiguous (the tables of
    tandem.layers.rotary.RotaryEmbedding).
    """
    assert q.dim() == 3 and k.dim() == 3 and q.dtype == k.dtype and q.dtype in _FLOAT_DTYPES
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64)
    assert cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == head_dim
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(1) == 1 and sin.stride(1) == 1
    if store is not None:
        v, k_cache, v_cache, slot_mapping = store
        assert v.shape == k.shape and v.dtype == k.dtype and v.stride(2) == 1
        assert k_cache.shape == v_cache.shape and k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim)
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (k.dtype, torch.float8_e4m3fn)
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
    else:
        v, k_cache, v_cache, slot_mapping = k, k, k, positions  # unused
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(num_heads, num_kv_heads)), 1024 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    _rotary_kernel[grid](
        positions, q, k, cos, sin, v, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), v.stride(0), v.stride(1),
        STORE=store is not None, NUM_Q=num_heads, NUM_K=num_kv_heads, HALF=half, BLOCK_H=block_h, BLOCK_D=block_d,
        SOFT_BF16=_numerics(q)["SOFT_BF16"], num_warps=4 if block_h * block_d >= 512 else 2,
        enable_fp_fusion=False, **pdl_flags(q),
    )


# ----------------------------------------------------------------------------- SiLU and mul
@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * N] = [gate | up], rows contiguous
    out_ptr,  # [T, N]
    stride_x,
    stride_o,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    CUDA_LIBM: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + N + offs, mask=mask, other=0.0).to(tl.float32)
    if CUDA_LIBM:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = _round(tl.div_rn(gate, 1.0 + e), dtype, SOFT_BF16).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, _round(silu * up, dtype, SOFT_BF16), mask=mask)


def silu_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """out = F.silu(gate) * up for x = [gate | up]; writes and returns out.

    x [T, 2I] bf16 / fp16 / fp32 (rows contiguous, row stride free); out [T, I] same dtype
    (rows contiguous; allocated when None).
    """
    assert x.dim() == 2 and x.dtype in _FLOAT_DTYPES and x.stride(1) == 1 and x.shape[1] % 2 == 0
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, inter) and out.dtype == x.dtype and out.stride(1) == 1
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), N=inter, BLOCK=block, **_numerics(x), **pdl_flags(x),
        num_warps=4 if block >= 512 else 2, enable_fp_fusion=False,
    )
    return out
