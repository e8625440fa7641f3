"""CUDA graphs of the draft model, per batch size bucket:

- `catchup` (a GraphRunner): the catch-up forward over uniform verification steps (every request
  fed 1 + k tokens, so the draft sees k + 2 per request), logits for every row;
- `rounds`: a whole greedy drafting round after such a step as one replay: that catch-up forward,
  the argmax of each request's row after its accepted drafts into drafts[:, 0], then the k - 1
  single-token draft steps (forward, logits, argmax, write into the per-slot draft buffer);
- `loops`: the k - 1 step loop alone, after an eager catch-up (mixed batches).

One replay instead of two takes the kernels between them (the row gather, the argmax, the loop's
input copies: 10 launches, ~50 us of a batch-1 round on the H200's device timeline) into the
graph, where they cost a few us (a k = 4 round at batch 1: 8.27 -> 8.25 ms). Padding rows point
at a scratch slot and write no KV.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.layers.backend import AttnBackend
from tandem.runner.graphs import GraphRunner, capture_on
from tandem.sampling.sampler import greedy_tokens


class DraftGraphs:
    def __init__(self, model, kv, drafts: Tensor, *, k: int, vocab_size: int, max_num_reqs: int, max_blocks: int,
                 max_model_len: int, backend: AttnBackend, device: torch.device, hot_ids: Tensor | None = None):
        """vocab_size: the logits columns a draft is taken from; hot_ids [vocab_size] (a pruned
        head, tandem/spec/hot_vocab.py): the token id of each column, else None (column = id)."""
        self.model, self.kv, self.drafts = model, kv, drafts
        self.k, self.vocab_size, self.max_model_len = k, vocab_size, max_model_len
        self.hot_ids = hot_ids
        self.backend = backend
        self.scratch_slot = drafts.shape[0] - 1
        self.max_kv = max_blocks * backend.block_size
        self.catchup = GraphRunner(model, kv, tokens_per_req=self.catchup_tokens(k), max_num_reqs=max_num_reqs,
                                   max_blocks=max_blocks,
                                   block_size=backend.block_size, device=device, use_triton=backend.use_triton,
                                   invariant=backend.invariant)
        self.slots = torch.full((max_num_reqs,), self.scratch_slot, dtype=torch.int64, device=device)
        self.pos = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.table = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int64, device=device)
        self.valid = torch.zeros(max_num_reqs, dtype=torch.bool, device=device)
        self.new_rows = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)  # each emitted token's catch-up row
        self.sizes = self.catchup.sizes  # one ladder of batch buckets for every draft graph
        self.loops: dict[int, torch.cuda.CUDAGraph] = {}
        self.rounds: dict[int, torch.cuda.CUDAGraph] = {}

    @staticmethod
    def catchup_tokens(k: int) -> int:
        """Rows per request of the catch-up graph (k + 2)."""
        return k + 2

    def _round(self, n: int) -> None:
        rows = self.new_rows[:n]
        logits = self.catchup.forward(n)[rows, : self.vocab_size]  # [n, V]
        self.drafts[self.slots[:n], 0] = self._argmax(logits)
        self._loop(n, self.catchup.positions[rows])

    def _loop(self, n: int, pos: Tensor) -> None:
        """The k - 1 greedy steps; pos [n]: the position of drafts[:, 0]'s predecessor."""
        slots, table, valid = self.slots[:n], self.table[:n], self.valid[:n]
        for step in range(1, self.k):
            pos, safe, ids, meta = self.backend.draft_step(pos, slots, self.drafts, step - 1, table, valid,
                                                           self.max_kv, self.max_model_len)
            hidden = self.model(ids, safe, meta, self.kv)
            logits = self.model.compute_logits(hidden)[:, : self.vocab_size]  # [n, V]
            self.drafts[slots, step] = self._argmax(logits)

    def _argmax(self, logits: Tensor) -> Tensor:
        """logits [n, vocab_size] -> each row's greedy token id [n] int64."""
        tokens = greedy_tokens(logits, self.backend.use_triton)
        return tokens if self.hot_ids is None else self.hot_ids[tokens]

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream, pool=None) -> None:
        """stream: the side stream to warm up and capture on (`capture_on`); pool: a graph memory
        pool handle to share (every draft graph shares one)."""
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.catchup.capture(stream, pool)
        kinds = [(self.rounds, self._round)]
        if self.k >= 2:
            kinds.append((self.loops, lambda n: self._loop(n, self.pos[:n])))
        for graphs, fn in kinds:
            for n in sorted(self.sizes, reverse=True):
                graph = capture_on(stream, pool, lambda: fn(n))
                pool = graph.pool()
                graphs[n] = graph
        self.drafts.zero_()
        torch.cuda.synchronize()

    def bucket(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def _set_rows(self, slots: Tensor, table: Tensor, dst: list[Tensor], src: list[Tensor]) -> int:
        """Copy each request's slot, src [n] into dst (static buffers) and the block tables in;
        pad to the bucket. -> the bucket."""
        n = slots.shape[0]
        b = self.bucket(n)
        torch._foreach_copy_([self.slots[:n]] + [d[:n] for d in dst], [slots] + src)  # one launch
        self.table[:n, : table.shape[1]].copy_(table)
        self.valid[:n].fill_(True)
        if b > n:  # padding rows draft into the scratch slot and write no KV
            self.slots[n:b].fill_(self.scratch_slot)
            self.valid[n:b].fill_(False)
        return b

    def run_round(self, num_reqs: int, ids: Tensor, positions: Tensor, slot_mapping: Tensor, block_tables: Tensor,
                  seq_lens: Tensor, new_rows: Tensor, slots: Tensor, table: Tensor) -> None:
        """A greedy round after a uniform verification step: the catch-up's inputs (catchup.replay's
        arguments, the emitted tokens already placed), new_rows [n] (the catch-up row of each
        emitted token), slots [n], table [n, nb] int64. -> drafts[slots, :k]."""
        self.catchup.set_inputs(num_reqs, ids, positions, slot_mapping, block_tables, seq_lens)
        b = self._set_rows(slots, table, [self.new_rows], [new_rows])
        if b > slots.shape[0]:  # a stale row index of a larger batch would gather out of bounds
            self.new_rows[slots.shape[0] : b].zero_()
        self.rounds[b].replay()

    def run_loop(self, slots: Tensor, pos: Tensor, table: Tensor) -> None:
        """slots [n], pos [n] (position of the token the target emitted), table [n, nb] int64."""
        self.loops[self._set_rows(slots, table, [self.pos], [pos])].replay()
