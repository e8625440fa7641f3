"""CUDA graphs of the draft model: the catch-up forward and the k - 1 step greedy draft loop.

The catch-up graph covers uniform verification steps (every request fed 1 + k tokens, so the
draft sees k + 2 per request) and returns logits for every row; the caller picks the row
after the accepted drafts on the device. The loop graph runs all k - 1 single-token draft
steps (forward, logits, argmax, write into the per-slot draft buffer) as one replay. Padding
rows point at a scratch slot and write no KV.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.layers.backend import AttnBackend
from tandem.runner.graphs import CAPTURE_SIZES, GraphRunner
from tandem.sampling.sampler import greedy_tokens


class DraftGraphs:
    def __init__(self, model, kv, drafts: Tensor, *, k: int, vocab_size: int, max_num_reqs: int, max_blocks: int,
                 max_model_len: int, backend: AttnBackend, device: torch.device):
        self.model, self.kv, self.drafts = model, kv, drafts
        self.k, self.vocab_size, self.max_model_len = k, vocab_size, max_model_len
        self.backend = backend
        self.scratch_slot = drafts.shape[0] - 1
        self.max_kv = max_blocks * backend.block_size
        self.catchup = GraphRunner(model, kv, tokens_per_req=k + 2, max_num_reqs=max_num_reqs, max_blocks=max_blocks,
                                   block_size=backend.block_size, device=device, use_triton=backend.use_triton)
        self.slots = torch.full((max_num_reqs,), self.scratch_slot, dtype=torch.int64, device=device)
        self.pos = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.table = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int64, device=device)
        self.valid = torch.zeros(max_num_reqs, dtype=torch.bool, device=device)
        self.sizes = sorted(set([s for s in CAPTURE_SIZES if s < max_num_reqs] + [max_num_reqs]))
        self.loops: dict[int, torch.cuda.CUDAGraph] = {}

    def _loop(self, n: int) -> None:
        slots, pos, table, valid = self.slots[:n], self.pos[:n], self.table[:n], self.valid[:n]
        for step in range(1, self.k):
            pos, safe, ids, meta = self.backend.draft_step(pos, slots, self.drafts, step - 1, table, valid,
                                                           self.max_kv, self.max_model_len)
            hidden = self.model(ids, safe, meta, self.kv)
            logits = self.model.compute_logits(hidden)[:, : self.vocab_size]  # [n, V]
            self.drafts[slots, step] = greedy_tokens(logits, self.backend.use_triton)

    @torch.inference_mode()
    def capture(self) -> None:
        self.catchup.capture()
        if self.k < 2:
            return
        pool = None
        for n in sorted(self.sizes, reverse=True):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._loop(n)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._loop(n)
            pool = graph.pool()
            self.loops[n] = graph
        self.drafts.zero_()
        torch.cuda.synchronize()

    def bucket(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def run_loop(self, slots: Tensor, pos: Tensor, table: Tensor) -> None:
        """slots [n], pos [n] (position of the token the target emitted), table [n, nb] int64."""
        n = slots.shape[0]
        b = self.bucket(n)
        torch._foreach_copy_([self.slots[:n], self.pos[:n]], [slots, pos])  # one launch
        self.table[:n, : table.shape[1]].copy_(table)
        self.valid[:n].fill_(True)
        if b > n:  # padding rows draft into the scratch slot and write no KV
            self.slots[n:b].fill_(self.scratch_slot)
            self.valid[n:b].fill_(False)
        self.loops[b].replay()
