"""GraphRunner: CUDA graphs of one model's forward (+ logits) for uniform batches.

A uniform batch has tokens_per_req query tokens for every request (1 for decode, 1 + k for
verification). Graphs are captured for num_reqs in a ladder of sizes, largest first, sharing
one memory pool; a step replays the smallest size that fits, padding with inert rows
(seq_len 0, KV slot -1). Inputs are copied into static buffers before each replay, so the
captured attention metadata (views of those buffers) always describes the current step.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.layers.table_attention import TableAttnMetadata

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def warm_up_on(stream: torch.cuda.Stream, fn, times: int) -> None:
    """Run fn() times times on stream (Triton compiles, cuBLAS picks its kernels), ordered after
    and before the current stream's work."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def capture_on(stream: torch.cuda.Stream, pool, fn, warmups: int = 1) -> torch.cuda.CUDAGraph:
    """Run fn() warmups times on stream, then capture it there into the memory pool `pool` (a
    handle, or None for a new pool). -> the graph.

    Every graph of an engine warms up and captures on one stream: cuBLAS keeps a workspace
    (32 MiB on Hopper) for each stream it ever ran on, for the life of the process, and a fresh
    `torch.cuda.Stream()` per graph walks PyTorch's pool of 32 streams, leaving up to 32 of
    them behind."""
    warm_up_on(stream, fn, warmups)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        fn()
    return graph


class GraphRunner:
    def __init__(self, model, kv, *, tokens_per_req: int, max_num_reqs: int, max_blocks: int, block_size: int,
                 device: torch.device, use_triton: bool, logits: Tensor | None = None, invariant: bool = False):
        """logits: the buffer the graphs write their logits to ([>= max_num_reqs * tokens_per_req,
        vocab]; None: one of its own), which graphs that never replay between a replay and the use
        of its logits may share."""
        self.model, self.kv = model, kv
        self.t = tokens_per_req
        self.block_size = block_size
        self.use_triton = use_triton
        self.invariant = invariant  # the batch-invariant attention (TableAttnMetadata.invariant)
        n_tok = max_num_reqs * tokens_per_req
        self.input_ids = torch.zeros(n_tok, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n_tok, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n_tok,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.cu_q_lens = torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device) * tokens_per_req
        sizes = [s for s in CAPTURE_SIZES if s < max_num_reqs] + [max_num_reqs]
        self.sizes = sorted(set(sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every size's logits land in one static buffer (a graph's own output would stay allocated
        # per size: 871 x 5 rows of a 128k vocabulary, 1.1 GiB, for the 8B's verification at 256 requests).
        head = model.lm_head.weight
        if logits is None:
            logits = torch.empty(n_tok, head.shape[0], dtype=head.dtype, device=device)
        self.logits = logits[:n_tok]  # [max_num_reqs * t, vocab]

    def _metadata(self, n: int) -> TableAttnMetadata:
        return TableAttnMetadata(
            slot_mapping=self.slot_mapping[: n * self.t],
            block_tables=self.block_tables[:n],
            seq_lens=self.seq_lens[:n],
            cu_q_lens=self.cu_q_lens[: n + 1],
            max_q_len=self.t,
            block_size=self.block_size,
            use_triton=self.use_triton,
            invariant=self.invariant,
        )

    def forward(self, n: int) -> Tensor:
        """The forward over the static buffers' first n requests (what a graph captures)."""
        m = n * self.t
        hidden = self.model(self.input_ids[:m], self.positions[:m], self._metadata(n), self.kv)
        return self.model.compute_logits(hidden, out=self.logits[:m])  # [n * t, vocab]

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream, pool=None) -> None:
        """stream: the side stream to warm up and capture on (see `capture_on`); pool: a graph
        memory pool handle to share (torch.cuda.graph_pool_handle()); sizes share one."""
        for n in sorted(self.sizes, reverse=True):
            graph = capture_on(stream, pool, lambda: self.forward(n), warmups=2)  # Triton compiles, cuBLAS picks kernels
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def bucket(self, num_reqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_reqs), None)

    def replay(self, num_reqs: int, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor,
               block_tables: Tensor, seq_lens: Tensor) -> Tensor:
        """Device inputs for num_reqs * t tokens; block_tables [num_reqs, nb] (nb <= max_blocks).
        -> logits [num_reqs * t, vocab] (a view of the graph's static output)."""
        n = self.set_inputs(num_reqs, input_ids, positions, slot_mapping, block_tables, seq_lens)
        self.graphs[n].replay()
        return self.logits[: num_reqs * self.t]

    def set_inputs(self, num_reqs: int, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor,
                   block_tables: Tensor, seq_lens: Tensor) -> int:
        """Copy a step's inputs into the static buffers (replay's arguments), padding rows inert.
        -> the bucket whose graph reads them."""
        n = self.bucket(num_reqs)
        m, pad = num_reqs * self.t, n * self.t
        # One multi-tensor launch for the contiguous inputs (each launch costs ~10-40 us of host).
        torch._foreach_copy_(
            [self.input_ids[:m], self.positions[:m], self.slot_mapping[:m], self.seq_lens[:num_reqs]],
            [input_ids, positions, slot_mapping, seq_lens.to(torch.int64)],
        )
        if pad > m:  # inert padding rows: no KV write, no keys
            self.slot_mapping[m:pad].fill_(-1)
            self.positions[m:pad].zero_()
            self.seq_lens[num_reqs:n].zero_()
        nb = block_tables.shape[1]
        self.block_tables[:num_reqs, :nb].copy_(block_tables)
        return n
