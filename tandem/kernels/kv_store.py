"""Scatter this step's K/V rows into the paged KV cache (one program per token)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.pdl import pdl_flags, wait_for_inputs


@triton.jit
def to_cache(x, cache_ptr):
    """x as the cache at cache_ptr keeps it: a float8 (e4m3) cache saturates at +-448, as
    tandem.layers.attention.to_cache does (an outlier clipped, never made NaN; a NaN kept); others a
    plain cast."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _kv_store_kernel(
    k_ptr,  # [num_tokens, Hkv, D], heads and dims contiguous
    v_ptr,
    k_cache_ptr,  # [num_blocks * block_size, Hkv * D] contiguous
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int32 / int64, -1 = padding
    stride_k,
    stride_v,
    ROW: tl.constexpr,  # Hkv * D
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, to_cache(k, k_cache_ptr), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, to_cache(v, v_cache_ptr), mask=mask)


def kv_store(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter new K/V rows into the paged cache; slot -1 means padding, skip.

    k, v [num_tokens, Hkv, D] (each token's [Hkv, D] contiguous; the token stride is free, so
    slices of a fused qkv output work); k_cache, v_cache [num_blocks, block_size, Hkv, D]
    contiguous, k's dtype or float8 e4m3 (kv_cache_dtype 'fp8': saturated, to_cache); slot_mapping
    [num_tokens] int32 / int64, flat block * block_size + offset.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k.dtype == v.dtype and k_cache.dtype == v_cache.dtype and k_cache.dtype in (k.dtype, torch.float8_e4m3fn)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    for t in (k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "each token's [Hkv, D] must be contiguous"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    block = triton.next_power_of_2(row)
    _kv_store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW=row, BLOCK=block, num_warps=max(1, min(8, block // 256)), **pdl_flags(k),
    )
