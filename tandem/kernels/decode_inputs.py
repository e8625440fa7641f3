"""The inputs of one draft decode step, computed on the device in one launch.

Each of the draft loop's k - 1 steps advances every row by one position and needs its input
token (the draft just written), the clamped position, the KV slot of that position and the
attention metadata (seq_lens, cu_q_lens). As separate torch operations these were 14 small
kernels a step, ~20 us of launches in a ~850 us forward (H200, bench/gpu_profile.py --sections
gaps); `decode_inputs_ref` is that torch sequence, the reference the kernel is tested against.

NOTE: the attention kernels read seq_lens and cu_q_lens before their PDL wait (see
tandem/kernels/pdl.py). That is safe because the forward's embedding lookup, a plainly launched
torch kernel, runs between this launch and the first attention; metadata written by a PDL kernel
with nothing plain after it would race.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandem.kernels.pdl import pdl_flags, wait_for_inputs

_BLOCK = 128


@triton.jit
def _decode_inputs_kernel(
    pos_ptr,  # [n] int64, the position of the previous token
    slots_ptr,  # [n] int64, each row's draft buffer row
    drafts_ptr,  # [*, k] int64
    table_ptr,  # [n, max_blocks] int64
    valid_ptr,  # [n] bool (uint8)
    out_pos_ptr, out_safe_ptr, out_ids_ptr, out_slot_ptr, out_seq_ptr, out_cu_ptr,
    n, col, stride_d, stride_t, max_pos, block_size,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    pos = tl.load(pos_ptr + i, mask=ok, other=0) + 1
    safe = tl.minimum(pos, max_pos)
    valid = tl.load(valid_ptr + i, mask=ok, other=0) != 0
    slot = tl.load(slots_ptr + i, mask=ok, other=0)
    ids = tl.load(drafts_ptr + slot * stride_d + col, mask=ok, other=0)
    blk = tl.load(table_ptr + i.to(tl.int64) * stride_t + safe // block_size, mask=ok, other=0)
    tl.store(out_pos_ptr + i, pos, mask=ok)
    tl.store(out_safe_ptr + i, safe, mask=ok)
    tl.store(out_ids_ptr + i, ids, mask=ok)
    tl.store(out_slot_ptr + i, tl.where(valid, blk * block_size + safe % block_size, -1), mask=ok)
    tl.store(out_seq_ptr + i, tl.where(valid, safe + 1, 0), mask=ok)
    tl.store(out_cu_ptr + i, i.to(tl.int32), mask=ok)
    last = i * 0 + n  # cu_q_lens[n] = n, written by lane 0 of program 0
    tl.store(out_cu_ptr + last, last.to(tl.int32), mask=(i == 0))


def decode_inputs(pos: Tensor, slots: Tensor, drafts: Tensor, col: int, table: Tensor, valid: Tensor,
                  max_model_len: int, block_size: int) -> tuple[Tensor, ...]:
    """One draft decode step's inputs. pos [n] int64 (position of drafts[slots, col]'s
    predecessor), slots [n] int64, drafts [*, k] int64, table [n, max_blocks] int64 covering
    min(pos + 1, max_model_len - 1), valid [n] bool (False: a padding row, writes no KV).
    -> (pos + 1, clamped position, input ids, slot_mapping (-1 on padding), seq_lens (0 on
    padding), cu_q_lens [n + 1] int32), as decode_inputs_ref."""
    n = pos.shape[0]
    dev = pos.device
    assert pos.dtype == slots.dtype == drafts.dtype == table.dtype == torch.int64 and valid.dtype == torch.bool
    assert drafts.stride(1) == 1 and table.stride(1) == 1 and pos.is_contiguous() and slots.is_contiguous()
    out = [torch.empty(n, dtype=torch.int64, device=dev) for _ in range(5)]
    cu = torch.empty(n + 1, dtype=torch.int32, device=dev)
    _decode_inputs_kernel[(triton.cdiv(max(n, 1), _BLOCK),)](
        pos, slots, drafts, table, valid.view(torch.uint8), *out, cu, n, col, drafts.stride(0), table.stride(0),
        max_model_len - 1, block_size, BLOCK=_BLOCK, num_warps=4, **pdl_flags(pos),
    )
    return (*out, cu)


def decode_inputs_ref(pos: Tensor, slots: Tensor, drafts: Tensor, col: int, table: Tensor, valid: Tensor,
                      max_model_len: int, block_size: int) -> tuple[Tensor, ...]:
    """decode_inputs in torch operations."""
    n = pos.shape[0]
    pos = pos + 1
    safe = pos.clamp(max=max_model_len - 1)
    slot_mapping = table.gather(1, (safe // block_size)[:, None])[:, 0] * block_size + safe % block_size
    return (pos, safe, drafts[slots, col], torch.where(valid, slot_mapping, -1), torch.where(valid, safe + 1, 0),
            torch.arange(n + 1, dtype=torch.int32, device=pos.device))
