"""TPGroup: this process's rank in a tensor-parallel group and the collectives a sharded model needs.

Every rank runs the same engine on the same requests (tandem/parallel/workers.py), so every
collective is met by every rank in the same order. The two in a forward: the sum of the row-
parallel projections' partial outputs (o_proj, down_proj: `all_reduce_`), and the vocabulary
shards of the logits (`gather_vocab`), or, for greedy drafts, only each shard's best token
(`top_tokens`, the local-argmax reduction: 2 values a row per rank instead of V / tp). Both are
exact on every rank alike (a sum reduced once and shared; a gather), so every rank samples the
same tokens from the same logits without exchanging them.

Backends: NCCL for CUDA tensors, gloo on the CPU. TANDEM_TP_BACKEND overrides the choice (gloo on
one GPU: ranks that share a device, for tests).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

# How long a collective waits for the other ranks before it fails (a rank that died mid-step).
TIMEOUT = timedelta(seconds=600)
HOST = "127.0.0.1"  # the ranks of a group run on one machine


def backend_for(device: torch.device) -> str:
    return os.environ.get("TANDEM_TP_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")


def joining_key(rank: int) -> str:
    """The key a rank sets in rank 0's store just before it joins the group."""
    return f"tandem/joining/{rank}"


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous: a key-value store on a free local port (`.port`), for the other ranks to join."""
    return dist.TCPStore(HOST, 0, size, True, timeout=TIMEOUT, wait_for_workers=False)


class TPGroup:
    """A process group of its own (not torch.distributed's global default: two engines may live
    in one process), with the collectives the model calls."""

    def __init__(self, rank: int, size: int, port: int, device: torch.device, store: dist.TCPStore | None = None):
        """Join the group whose rank 0 hosts its store on port (rank 0 passes that store); returns
        once every rank has joined."""
        self.rank, self.size = rank, size
        self.device = device
        self._store = store if store is not None else dist.TCPStore(HOST, port, size, False, timeout=TIMEOUT)
        if rank != 0:  # rank 0 joins once every rank has said so (Workers.wait_joining)
            self._store.set(joining_key(rank), "1")
        backend = backend_for(device)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self._pg = dist.ProcessGroupNCCL(self._store, rank, size, options)
        elif backend == "gloo":
            self._pg = dist.ProcessGroupGloo(self._store, rank, size, TIMEOUT)
        else:
            raise ValueError(f"TANDEM_TP_BACKEND={backend!r}: use 'nccl' or 'gloo'")
        self._staged = device.type == "cuda" and backend == "gloo"  # gloo on a GPU: through the host

    def close(self) -> None:
        self._pg = None
        self._store = None

    def all_reduce_(self, t: Tensor) -> Tensor:
        """Sum t over the ranks, in place; -> t."""
        if self._staged:
            host = t.cpu()
            self._pg.allreduce([host]).wait()
            return t.copy_(host)
        self._pg.allreduce([t]).wait()
        return t

    def all_reduce_max_(self, t: Tensor) -> Tensor:
        """The elementwise largest of t over the ranks, in place; -> t."""
        host = t.cpu() if self._staged else t
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self._pg.allreduce([host], options).wait()
        return t.copy_(host) if self._staged else t

    def _all_gather(self, t: Tensor) -> list[Tensor]:
        src = t.cpu() if self._staged else t.contiguous()
        parts = [torch.empty_like(src) for _ in range(self.size)]
        self._pg.allgather([parts], [src]).wait()
        return [p.to(t.device) for p in parts] if self._staged else parts

    def gather_vocab(self, local: Tensor, vocab_size: int) -> Tensor:
        """local [n, V / tp] (rank r's shard: columns r * V/tp .., zero-padded past the vocabulary on
        the last) -> [n, vocab_size], the same on every rank."""
        return torch.cat(self._all_gather(local), dim=-1)[:, :vocab_size]

    def top_tokens(self, local: Tensor, vocab_size: int) -> Tensor:
        """local [n, V / tp] logits of this rank's vocabulary shard -> the argmax over the whole
        vocabulary [n] int64, from each rank's (max, index) alone. Shards are contiguous and in
        rank order and torch's argmax takes the first maximum, so a tie goes to the lower id, as a
        full argmax's would."""
        rows = local.shape[1]
        start = self.rank * rows
        local = local.float()
        if start + rows > vocab_size:  # the last shard's padding rows are not tokens
            local[:, max(0, vocab_size - start):] = float("-inf")
        best, idx = local.max(dim=-1)  # [n], [n]
        pair = torch.stack([best, (idx + start).float()], dim=0)  # [2, n]; ids < 2^24 stay exact in fp32
        pairs = torch.stack(self._all_gather(pair), dim=0)  # [tp, 2, n]
        winner = pairs[:, 0].argmax(dim=0)  # [n]: the first rank holding the maximum
        return pairs[:, 1].gather(0, winner[None])[0].long()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV blocks each rank's memory allows)."""
        t = torch.tensor([value], dtype=torch.int64, device="cpu" if self._staged else self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._pg.allreduce([t], options).wait()
        return int(t.item())
