"""BlockTable: every slot's block ids, kept on the device across steps.

A running request's block list only grows (blocks are appended as its tokens need them, and
freed all at once when it leaves its slot), so a step sends the device only the ids that are
new since the last step, not every request's whole table: at 256 requests of 16k tokens that
is a few ids instead of 262,144. A step's attention metadata then gathers the rows of its
requests' slots on the device (vLLM's persistent block table does the same).
"""
from __future__ import annotations

import torch
from torch import Tensor


class BlockTable:
    def __init__(self, max_num_seqs: int, max_blocks: int, device: torch.device):
        self.max_blocks = max_blocks
        self.table = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int64, device=device)  # [slot, block index]
        self.num_synced = [0] * max_num_seqs  # per slot: the leading ids the device row holds
        self.last = [-1] * max_num_seqs  # per slot: the last of them (a cheap check the list only grew)

    def clear(self, slot: int) -> None:
        """The slot was freed or takes a new request: its row is rewritten from the next list on."""
        self.num_synced[slot] = 0

    def new_entries(self, slots: list[int], block_lists: list[list[int]]) -> tuple[list[int], list[int]]:
        """The writes that bring the rows of slots up to block_lists (each slot's whole list)
        -> (flat indices into table, block ids), for `write`; counted as synced from now on.
        A list that did not just grow from the synced one (it never happens while a request
        keeps its slot) is written again whole."""
        index: list[int] = []
        values: list[int] = []
        width = self.max_blocks
        for slot, ids in zip(slots, block_lists):
            n, total = self.num_synced[slot], len(ids)
            if total == n and (n == 0 or ids[-1] == self.last[slot]):
                continue
            if total > width:
                raise RuntimeError(f"slot {slot} holds {total} blocks; its block table has room for {width}")
            if total < n or (n and ids[n - 1] != self.last[slot]):
                n = 0
            index.extend(range(slot * width + n, slot * width + total))
            values.extend(ids[n:])
            self.num_synced[slot] = total
            self.last[slot] = ids[-1] if total else -1
        return index, values

    def write(self, index: Tensor, values: Tensor) -> None:
        """Apply new_entries' writes, on the device: index, values [m] int64."""
        if index.numel():
            self.table.view(-1).index_copy_(0, index, values)

    def rows(self, slots: Tensor, width: int) -> Tensor:
        """The first width block ids of each slot's row -> [len(slots), width] int64 (entries past
        a request's list are stale or zero: a kernel reads only the blocks below its seq_len)."""
        return self.table[:, : min(width, self.max_blocks)].index_select(0, slots)
