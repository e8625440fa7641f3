"""PiecewiseGraphs: one model's forward as CUDA graphs cut at the attention, per token count.

The uniform graphs (graphs.py) take steps whose requests all feed the same number of tokens.
The rest (a prefill chunk beside decodes, verifications of unequal numbers of drafts, the
draft's catch-up over such a batch) ran eagerly, and eagerly the forward is bound by the host:
~10 launches a layer at ~30-80 us of Python each (H200, 8B shape, 32 decodes: 16 ms a step
against 5.0 ms of kernels; with a k = 4 draft 60 ms against 11). Only the attention depends on
more than the token count: its grid and tile constants follow the step's requests and longest
query. So per bucket of token counts the forward is captured in pieces, the graph ended before
each attention and a new one begun after it: L + 1 graphs for L layers. A step pads its tokens
to the bucket (padding rows: KV slot -1, no key written; their rows of every activation are
computed and ignored) and replays piece 0, runs layer 0's attention eagerly over the step's own
metadata, replays piece 1, and so on: L attention launches and L + 1 graph launches.

The attention reads its queries from, and writes its output to, static buffers shared by every
layer and bucket (a piece copies its q there before it ends), so no piece's activations stay
allocated between steps; the pieces' temporaries live in the graph memory pool the engine's
other graphs share (a step replays one forward's pieces in order, and nothing else runs in
between but the attention, whose memory is not the pool's). Requires the Triton kernels (the
rotary / qkv kernel stores K/V inside a piece, `TableAttnMetadata.fuses_kv_store`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.layers.table_attention import TableAttnMetadata
from tandem.runner.graphs import warm_up_on

# Token-count buckets (capped by the engine's max_cudagraph_tokens): steps above the largest run
# eagerly, where the prefill's arithmetic outlasts the host's launches anyway.
PIECEWISE_SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 768, 1024, 1536, 2048)


def piece_sizes(max_tokens: int) -> list[int]:
    """The buckets for steps of up to max_tokens tokens (max_tokens itself the largest)."""
    if max_tokens < 1:
        return []
    return sorted({s for s in PIECEWISE_SIZES if s < max_tokens} | {max_tokens})


class _Cut:
    """The attention metadata a piece is captured with: attend() hands the layer's query to
    on_attend (which ends the graph being captured, begins the next and returns the static
    output buffer); everything else in the forward reads only slot_mapping."""

    fuses_kv_store = True

    def __init__(self, slot_mapping: Tensor, on_attend):
        self.slot_mapping = slot_mapping  # [T] int64, the bucket's static slots
        self._on_attend = on_attend

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float,
               kv_stored: bool = False) -> Tensor:
        assert kv_stored, "piecewise graphs need the K/V store inside the rotary or qkv kernel"
        return self._on_attend(q, k_cache, v_cache, scale)


@dataclass(slots=True)
class _Pieces:
    graphs: list[torch.cuda.CUDAGraph]  # L + 1, replayed in order
    attention: list[tuple[Tensor, Tensor, float]]  # L: each cut's (k_cache, v_cache, scale)
    hidden: Tensor  # [T, hidden_size] the last piece's output


class PiecewiseGraphs:
    def __init__(self, model, kv, *, max_tokens: int, device: torch.device):
        self.model, self.kv = model, kv
        arch = model.arch
        dtype = model.model.embed_tokens.weight.dtype  # the activations' (an fp8 cache's is not)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        # The attention's query and output rows, static for every layer and bucket.
        self.q = torch.zeros(max_tokens, arch.num_heads, arch.head_dim, dtype=dtype, device=device)
        self.out = torch.zeros(max_tokens, arch.num_heads, arch.head_dim, dtype=dtype, device=device)
        self.sizes = piece_sizes(max_tokens)
        self.pieces: dict[int, _Pieces] = {}

    def bucket(self, num_tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= num_tokens), None)

    def takes(self, num_tokens: int, attn) -> bool:
        """Whether a step of num_tokens tokens with this metadata replays pieces."""
        return (bool(self.pieces) and isinstance(attn, TableAttnMetadata) and attn.fuses_kv_store
                and self.bucket(num_tokens) is not None)

    # ---------------------------------------------------------------- capture
    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream, pool=None) -> None:
        """Warm up and capture every bucket, largest first, on stream (the engine's one capture
        stream, see graphs.capture_on) into the graph memory pool `pool` (a handle; None: a new one)."""
        for t in sorted(self.sizes, reverse=True):
            self.pieces[t] = self._capture(t, stream, pool)
            pool = self.pieces[t].graphs[0].pool()
        torch.cuda.synchronize()

    def _forward(self, t: int, on_attend) -> Tensor:
        return self.model(self.input_ids[:t], self.positions[:t], _Cut(self.slot_mapping[:t], on_attend), self.kv)

    def _capture(self, t: int, stream: torch.cuda.Stream, pool) -> _Pieces:
        q, out = self.q[:t], self.out[:t]

        def warm(q_layer: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
            q.copy_(q_layer)
            return out

        warm_up_on(stream, lambda: self._forward(t, warm), 2)
        torch.cuda.synchronize()

        graphs: list[torch.cuda.CUDAGraph] = []
        attention: list[tuple[Tensor, Tensor, float]] = []
        capturing = [False]

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graphs.append(graph)
            graph.capture_begin(pool=graphs[0].pool() if len(graphs) > 1 else pool)
            capturing[0] = True

        def end() -> None:
            capturing[0] = False
            graphs[-1].capture_end()

        def cut(q_layer: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
            q.copy_(q_layer)  # captured: the last kernel of this piece
            end()
            attention.append((k_cache, v_cache, scale))
            begin()
            return out

        with torch.cuda.stream(stream):
            try:
                begin()
                hidden = self._forward(t, cut)
                end()
            except BaseException:
                if capturing[0]:  # leave the stream out of capture mode, keep the first error
                    try:
                        end()
                    except Exception:
                        pass
                raise
        torch.cuda.current_stream().wait_stream(stream)
        return _Pieces(graphs, attention, hidden)

    # ---------------------------------------------------------------- replay
    def run(self, input_ids: Tensor, positions: Tensor, attn: TableAttnMetadata) -> Tensor:
        """input_ids, positions [T] int64 (T <= the largest bucket) and the step's own metadata
        -> hidden [T, hidden_size] (a view of the bucket's static output, valid until the next run)."""
        n = input_ids.shape[0]
        t = self.bucket(n)
        assert positions.shape[0] == n and attn.slot_mapping.shape[0] == n, "one position and KV slot per token"
        # One multi-tensor launch for the inputs; padding rows write no KV.
        torch._foreach_copy_([self.input_ids[:n], self.positions[:n], self.slot_mapping[:n]],
                             [input_ids, positions, attn.slot_mapping])
        if t > n:
            self.slot_mapping[n:t].fill_(-1)
        pieces = self.pieces[t]
        q, out = self.q[:t], self.out[:t]
        for graph, (k_cache, v_cache, scale) in zip(pieces.graphs, pieces.attention):
            graph.replay()
            attn.kernel()(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.cu_q_lens, attn.max_q_len,
                          scale, out)
        pieces.graphs[-1].replay()
        return pieces.hidden[:n]


def forward(model, kv, pieces: PiecewiseGraphs | None, input_ids: Tensor, positions: Tensor, attn) -> Tensor:
    """model's forward over a step (-> hidden [T, hidden_size]): on the pieces where they take
    it, else eagerly."""
    if pieces is not None and pieces.takes(input_ids.shape[0], attn):
        return pieces.run(input_ids, positions, attn)
    return model(input_ids, positions, attn, kv)
