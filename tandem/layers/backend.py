"""AttnBackend: builds the attention metadata the device wants, chosen once at start-up.

CPU runs the grouped PyTorch reference (host-built groups, no padding). CUDA runs block-table
metadata (fixed shapes, device-resident), executed by the Triton kernels when Triton is
importable and by the dense torch fallback otherwise; its block tables are rows of a
persistent per-slot table (layers/block_table.py) when the backend is given slots.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor

from tandem.layers.attention import build_attn_metadata, build_decode_metadata
from tandem.layers.block_table import BlockTable
from tandem.layers.table_attention import TableAttnMetadata, build_table_metadata, padded_tables
from tandem.upload import Uploader


def triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import tandem.kernels.attention  # noqa: F401
        import tandem.kernels.kv_store  # noqa: F401
    except ImportError:
        return False
    return True


class AttnBackend:
    def __init__(self, block_size: int, device: torch.device, use_table: bool | None = None,
                 use_triton: bool | None = None, max_num_seqs: int = 0, max_model_len: int = 0,
                 invariant: bool = False):
        """max_num_seqs, max_model_len: the persistent block table's shape (0: none; every step's
        tables then come from its host lists). invariant: the Triton steps' attention batch-invariant
        (LLM(batch_invariant=True): tandem/kernels/chunked_attention.py)."""
        self.block_size = block_size
        self.invariant = invariant
        self.device = device
        self.use_table = device.type == "cuda" if use_table is None else use_table
        self.use_triton = triton_available(device) if use_triton is None else use_triton
        self.upload = Uploader(device)  # shared by the runner and the speculator
        self.block_table = None  # shared too: the draft's KV uses the target's block ids
        if self.use_table and max_num_seqs and max_model_len:
            self.block_table = BlockTable(max_num_seqs, -(-max_model_len // block_size), device)

    def fast(self) -> AttnBackend:
        """This backend with the default attention kernels (invariant off), sharing its uploader and block
        table: a greedy draft model's under LLM(batch_invariant=True), whose numerics move acceptance, never the
        output (H100, batch 1: the 1B draft's step 1.08 ms against 1.17 with the invariant attention)."""
        if not self.invariant:
            return self
        view = copy.copy(self)
        view.invariant = False
        return view

    def clear_slots(self, slots: list[int]) -> None:
        """Slots freed or given new requests: their block table rows start again."""
        if self.block_table is not None:
            for slot in slots:
                self.block_table.clear(slot)

    def prefill(self, start_pos: list[int], q_lens: list[int], block_tables: list[list[int]], rowwise: bool = True,
                slots: list[int] | None = None):
        """Metadata for ragged queries (chunks, decodes, verifications) from host lists.
        rowwise=False lets the CPU reference batch short queries (see layers/attention.py):
        for a draft model, whose numerics cannot change the output. slots: each query's slot,
        whose row of the persistent block table is brought up to its list and used."""
        if self.use_table:
            table = self.block_table if slots is not None else None
            return build_table_metadata(start_pos, q_lens, block_tables, self.block_size, self.upload,
                                        self.use_triton, table, slots, self.invariant)
        return build_attn_metadata(start_pos, q_lens, block_tables, self.block_size, self.device, rowwise)

    def rows(self, slots: Tensor, width: int, block_lists: list[list[int]]) -> Tensor:
        """The block tables of requests in slots [n] (their lists block_lists, which this step's
        prefill brought the persistent table up to) -> [n, <= width] int64 on the device; without a
        persistent table, uploaded from the lists [n, width]."""
        if self.block_table is not None:
            return self.block_table.rows(slots, width)
        (table,) = self.upload(padded_tables(block_lists, width))
        return table.view(len(block_lists), width)

    def draft_step(self, pos: Tensor, slots: Tensor, drafts: Tensor, col: int, table: Tensor, valid: Tensor,
                   max_kv: int, max_model_len: int):
        """A draft decode step's inputs on the device: pos [n] (position of drafts[slots, col]'s
        predecessor) -> (pos + 1, that position clamped below max_model_len, input ids [n], metadata).
        One launch with Triton (tandem/kernels/decode_inputs.py), torch operations otherwise."""
        if self.use_table and self.use_triton:
            from tandem.kernels.decode_inputs import decode_inputs

            pos, safe, ids, slot_mapping, seq_lens, cu = decode_inputs(pos, slots, drafts, col, table, valid,
                                                                       max_model_len, self.block_size)
            meta = TableAttnMetadata(slot_mapping=slot_mapping, block_tables=table, seq_lens=seq_lens,
                                     cu_q_lens=cu, max_q_len=1, block_size=self.block_size, use_triton=True,
                                     invariant=self.invariant)
            return pos, safe, ids, meta
        pos = pos + 1
        safe = pos.clamp(max=max_model_len - 1)
        return pos, safe, drafts[slots, col], self.decode(safe, table, max_kv, valid)

    def decode(self, positions: Tensor, block_table: Tensor, max_kv: int, valid: Tensor | None = None):
        """One query per row at device-side positions [n]; block_table [n, max_blocks] int64.
        valid [n] bool marks real rows (padding rows of a captured graph write no KV)."""
        if not self.use_table:
            return build_decode_metadata(positions, block_table, self.block_size, max_kv)
        bs = self.block_size
        n = positions.shape[0]
        slot_mapping = block_table.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        seq_lens = positions + 1
        if valid is not None:
            slot_mapping = torch.where(valid, slot_mapping, -1)
            seq_lens = torch.where(valid, seq_lens, 0)
        return TableAttnMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_table,
            seq_lens=seq_lens,
            cu_q_lens=torch.arange(n + 1, dtype=torch.int32, device=positions.device),
            max_q_len=1,
            block_size=bs,
            use_triton=self.use_triton,
            invariant=self.invariant,
        )
