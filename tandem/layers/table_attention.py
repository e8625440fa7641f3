"""Block-table attention metadata: fixed-shape, device-resident, CUDA-graph friendly.

Unlike the grouped reference metadata (built per step on the host), every field here is a
device tensor of a shape fixed by upper bounds, so a captured graph replays it after the
runner rewrites the buffers in place. Padding rows have seq_len 0 and slot -1.
The Triton kernels run it on CUDA; `dense_paged_attention` is the torch fallback with the
same contract (and the reference the kernels are tested against).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.layers.attention import as_bytes, to_cache
from tandem.layers.block_table import BlockTable


def build_table_metadata(
    start_pos: list[int], q_lens: list[int], block_tables: list[list[int]], block_size: int,
    upload, use_triton: bool, table: BlockTable | None = None, slots: list[int] | None = None,
    invariant: bool = False,
) -> "TableAttnMetadata":
    """Host lists -> device metadata for an eager step; upload: a tandem.upload.Uploader.
    table, slots: the persistent block table and each query's slot there (the rows are brought
    up to block_tables, sending only new ids); None: the tables are sent whole."""
    max_blocks = max(map(len, block_tables))
    if min(q_lens) == max(q_lens) == 1:  # decodes (the common step at a large batch): one token a query
        slot_mapping = [t[p // block_size] * block_size + p % block_size for p, t in zip(start_pos, block_tables)]
        cu = list(range(len(q_lens) + 1))
        seq_lens = [s + 1 for s in start_pos]
    else:
        slot_mapping = []
        for start, n, t in zip(start_pos, q_lens, block_tables):
            slot_mapping += [t[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        seq_lens = [s + n for s, n in zip(start_pos, q_lens)]
    if table is None:
        slot_t, seq_t, cu_t, tables_t = upload(slot_mapping, seq_lens, cu, padded_tables(block_tables, max_blocks))
        tables_t = tables_t.view(len(block_tables), max_blocks)
    else:
        index, values = table.new_entries(slots, block_tables)
        slot_t, seq_t, cu_t, slots_t, index_t, values_t = upload(slot_mapping, seq_lens, cu, slots, index, values)
        table.write(index_t, values_t)
        tables_t = table.rows(slots_t, max_blocks)
    return TableAttnMetadata(
        slot_mapping=slot_t,
        block_tables=tables_t,
        seq_lens=seq_t,
        cu_q_lens=cu_t,
        max_q_len=max(q_lens),
        block_size=block_size,
        use_triton=use_triton,
        invariant=invariant,
    )


def padded_tables(block_lists: list[list[int]], width: int) -> list[int]:
    """Each list cut or zero-padded to width, flattened: a [len(block_lists), width] table's values."""
    return [b for ids in block_lists for b in (ids + [0] * width)[:width]]


@dataclass(slots=True)
class TableAttnMetadata:
    """One model's attention inputs for a step; shared by all its layers."""

    slot_mapping: Tensor  # [num_tokens] int64, -1 = padding (no KV written)
    block_tables: Tensor  # [num_reqs, max_blocks] int32 / int64
    seq_lens: Tensor  # [num_reqs] int32 / int64, keys per request incl. this step's tokens (0 = padding)
    cu_q_lens: Tensor  # [num_reqs + 1] int32 / int64, query start offsets
    max_q_len: int  # host-known upper bound on any request's query length
    block_size: int
    use_triton: bool = False
    invariant: bool = False  # the Triton path's batch-invariant kernel (tandem/kernels/chunked_attention.py)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def fuses_kv_store(self) -> bool:
        """True: the model's rotary kernel also writes this step's K/V (attend(kv_stored=True))."""
        return self.use_triton

    def kernel(self):
        """The Triton attention this step runs (tandem/kernels/attention.py's paged_attention, or its
        batch-invariant form), called with paged_attention's arguments."""
        if self.invariant:
            from tandem.kernels.chunked_attention import chunked_attention

            return chunked_attention
        from tandem.kernels.attention import paged_attention

        return paged_attention

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float,
               kv_stored: bool = False, cpu_isa: str | None = None) -> Tensor:
        """Store (unless kv_stored) and attend -> [num_tokens, H, D]; cpu_isa is AttnMetadata's
        (this form runs the Triton kernels or the dense torch fallback, never the C kernel)."""
        if self.use_triton:
            from tandem.kernels.kv_store import kv_store

            if not kv_stored:
                kv_store(k, v, k_cache, v_cache, self.slot_mapping)
            out = torch.empty_like(q)
            self.kernel()(q, k_cache, v_cache, self.block_tables, self.seq_lens, self.cu_q_lens, self.max_q_len,
                          scale, out)
            return out
        store_kv_masked(k, v, k_cache, v_cache, self.slot_mapping)
        return dense_paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens, self.cu_q_lens,
                                     self.max_q_len, scale)


def store_kv_masked(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter k/v rows into the cache (in its dtype: to_cache); rows with slot -1 (padding) write
    nothing new (no data-dependent control flow, so it can be captured).

    Padding rows are sent to slot 0, which belongs to block 0, a block like any other: they write
    what slot 0 is to hold after the step, the row a real token stores there or else its current
    value, so that the duplicate index leaves the same bits whichever write lands last."""
    valid = slot_mapping >= 0
    safe = torch.where(valid, slot_mapping, 0)
    keep = valid[:, None, None]
    at_zero = slot_mapping == 0
    first = at_zero.to(torch.int32).argmax().view(1)  # [1] the real row that stores slot 0, if any
    for new, cache in ((k, k_cache), (v, v_cache)):
        flat = as_bytes(cache.view(-1, *new.shape[1:]))
        rows = as_bytes(to_cache(new, cache.dtype))  # [n, Hkv, D]
        # index_select, not rows[first]: indexing by a 0-d tensor reads it on the host (a sync)
        slot_zero = torch.where(at_zero.any(), rows.index_select(0, first)[0], flat[0])  # [Hkv, D]
        flat.index_copy_(0, safe, torch.where(keep, rows, slot_zero))


def dense_paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, cu_q_lens: Tensor,
    max_q_len: int, scale: float,
) -> Tensor:
    """q [num_tokens, H, D] -> [num_tokens, H, D]; each request attends its whole block table
    with a mask (token i of request r at position seq_len_r - q_len_r + i sees keys <= it)."""
    num_tokens, num_heads, head_dim = q.shape
    num_reqs, max_blocks = block_tables.shape
    bs = k_cache.shape[1]
    num_kv = k_cache.shape[2]
    max_kv = max_blocks * bs
    tables = block_tables.long()
    keys = k_cache[tables].reshape(num_reqs, max_kv, num_kv, head_dim).to(q.dtype)  # [R, max_kv, Hkv, D]
    vals = v_cache[tables].reshape(num_reqs, max_kv, num_kv, head_dim).to(q.dtype)
    cu = cu_q_lens.long()
    q_lens = cu[1:] - cu[:-1]  # [R]
    # Token -> (request, index in request), computed on the device.
    tok = torch.arange(num_tokens, device=q.device)
    req = torch.searchsorted(cu[1:], tok, right=True).clamp(max=num_reqs - 1)  # [T]
    # Padding tokens (seq_len 0) clamp to position 0 so no row is fully masked.
    pos = (seq_lens.long()[req] - q_lens[req] + (tok - cu[req])).clamp(min=0)  # [T] query positions
    kv_pos = torch.arange(max_kv, device=q.device)
    mask = kv_pos[None, :] <= pos[:, None]  # [T, max_kv]
    # Keys past a request's length may be unwritten memory: zero them so masking stays exact.
    have = (kv_pos[None, :] < seq_lens.long()[:, None])[:, :, None, None]  # [R, max_kv, 1, 1]
    keys = torch.where(have, keys, 0)
    vals = torch.where(have, vals, 0)
    kt = keys[req].transpose(1, 2)  # [T, Hkv, max_kv, D]
    vt = vals[req].transpose(1, 2)
    rep = num_heads // num_kv
    if rep > 1:
        kt = kt.repeat_interleave(rep, dim=1)
        vt = vt.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], kt, vt, attn_mask=mask[:, None, None, :], scale=scale
    )  # [T, H, 1, D]
    return out[:, :, 0, :]
