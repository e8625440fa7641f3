"""Paged attention on the CPU (cpu_attention.c through ctypes): the step's K/V store and every
query token's attention in one call.

The reference is tandem/layers/attention.py (`store_kv` then `paged_attention`, PyTorch's
SDPA per group), which a decode step of the 2-core dev machine spends ~0.5 ms a layer in,
mostly per-op dispatch and the gathers of each request's keys. The C kernel reads the keys in
place through each row's slot list (`AttnRows`, built once per step) and computes each
(token, KV head) alone in fp32, so a token's output never depends on its neighbours. It
differs from SDPA's bits (another summation order; SDPA rounds the softmax weights to bf16
before the V product, this kernel keeps them in fp32). An fp8 (e4m3) cache (kv_cache_dtype
"fp8") is read through a table of its 256 values, exactly; its rows are stored by the caller
(tandem/layers/attention.py's store_kv, which saturates and rounds them).
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.kernels import cpu_build


def fits(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether paged_attention takes these: one 16-bit dtype on the CPU (the caches that, or fp8
    e4m3: kv_cache_dtype "fp8"); q [T, H, D], k / v [T, Hkv, D] with heads D apart and unit
    element stride (views of a qkv buffer are fine); contiguous caches [num_blocks, block_size, Hkv, D]."""
    if q.dtype not in cpu_build.HALF_KIND or q.device.type != "cpu" or q.dim() != 3:
        return False
    if any(t.dtype != q.dtype for t in (k, v)) or any(t.dtype not in (q.dtype, torch.float8_e4m3fn)
                                                      for t in (k_cache, v_cache)):
        return False
    if k_cache.dtype != v_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    head_dim = q.shape[2]
    return (all(t.dim() == 3 and t.shape[2] == head_dim and t.stride(2) == 1 and t.stride(1) == head_dim
                for t in (q, k, v)) and q.shape[1] % k.shape[1] == 0 and v.shape == k.shape
            # the caches hold k's heads (the store copies rows of Hkv x D into them)
            and all(t.dim() == 4 and t.shape[2:] == k.shape[1:] for t in (k_cache, v_cache)))


# The 256 e4m3 byte values as fp32 (exact): how the C kernel reads an fp8 cache.
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                    rows, scale: float, isa: str) -> Tensor:
    """Store k, v [T, Hkv, D] at slot_mapping [T], then attend every row of `rows`
    (tandem.layers.attention.AttnRows) -> [T, H, D] contiguous. Tensors as `fits` accepts; an fp8
    cache must hold the step's k and v already (the caller stores them: tandem.layers.attention's
    store_kv, which saturates and rounds them)."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    rc = cpu_build.library(isa).tandem_paged_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        slot_mapping.data_ptr(), 0 if fp8 else slot_mapping.shape[0], k_cache.data_ptr(), v_cache.data_ptr(),
        rows.token.data_ptr(), rows.slot_start.data_ptr(), rows.len.data_ptr(), rows.slots.data_ptr(),
        rows.token.shape[0], num_heads, k.shape[1], head_dim, scale, cpu_build.HALF_KIND[q.dtype],
        torch.get_num_threads(), _FP8_VALUES.data_ptr() if fp8 else None)
    if rc != 0:
        raise MemoryError("cpu paged attention: could not allocate its work buffers")
    return out
