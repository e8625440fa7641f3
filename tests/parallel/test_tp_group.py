"""TPGroup's collectives on two CPU ranks (gloo), against the single-process results."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tandem.parallel.group import TPGroup, host_store

VOCAB = 1001  # two shards of 501 rows, the last padded by one


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, VOCAB, generator=g)
    x[1, [10, 700]] = 9.0  # a tie across the shards: the lower id wins
    x[2, [600, 650]] = 9.0  # a tie inside the second shard
    x[3, :] = -5.0  # every token tied
    x[4, 1000] = 50.0  # the last token, beside the padding row
    return x


def _rank(rank: int, port: int, queue) -> None:
    group = TPGroup(rank, 2, port, torch.device("cpu"))
    full = _logits()
    rows = 501
    local = torch.zeros(full.shape[0], rows)
    part = full[:, rank * rows : (rank + 1) * rows]
    local[:, : part.shape[1]] = part  # the last shard's padding row is zero: above row 3's -5
    queue.put((rank, group.top_tokens(local, VOCAB), group.gather_vocab(local, VOCAB),  # rank 0's order
               group.all_reduce_(torch.full((3,), float(rank + 1))), group.min_int(7 - rank)))
    group.close()


def test_collectives_match_one_process():
    store = host_store(2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    other = ctx.Process(target=_rank, args=(1, store.port, queue))
    other.start()
    group = TPGroup(0, 2, store.port, torch.device("cpu"), store)
    full = _logits()
    local = full[:, :501].clone()
    got = [(0, group.top_tokens(local, VOCAB), group.gather_vocab(local, VOCAB),
            group.all_reduce_(torch.full((3,), 1.0)), group.min_int(7))]
    got.append(queue.get(timeout=60))
    other.join(timeout=60)
    for rank, top, gathered, summed, smallest in got:
        assert torch.equal(top, full.argmax(dim=-1)), rank
        assert top.tolist()[1:5] == [10, 600, 0, 1000]
        assert torch.equal(gathered, full), rank
        assert summed.tolist() == [3.0] * 3 and smallest == 6


def test_a_failed_ranks_own_error_is_chosen():
    """After rank 0's collective broke: of the errors the ranks report, their own cause (a
    ConfigError, then any error but a transport one) is raised, not a transport error of a rank
    that only saw another one leave; with transport errors alone there is nothing better."""
    import multiprocessing as mp

    from tandem.errors import ConfigError
    from tandem.parallel.workers import Workers, is_transport_error

    class Done:  # a finished rank's process
        exitcode = 1

        def join(self, timeout=None):
            pass

    def workers(*messages):
        w = object.__new__(Workers)
        w.conns, w.procs = [], []
        for msg in messages:
            mine, theirs = mp.Pipe()
            theirs.send(msg)
            w.conns.append(mine)
            w.procs.append(Done())
        return w

    transport = ("error", "Traceback ...\nRuntimeError: [gloo/pair.cc] Connection closed by peer [127.0.0.1]:1")
    err = workers(transport, ("config", "model: broken.safetensors is not a valid safetensors file")).failed_rank(1)
    assert isinstance(err, ConfigError) and str(err).startswith("tensor-parallel rank 2: model:")
    err = workers(transport, ("error", "Traceback ...\nMemoryError: out of memory")).failed_rank(1)
    assert "rank 2 failed to start" in str(err) and "MemoryError" in str(err)
    assert workers(transport, transport).failed_rank(1) is None
    assert workers(("ready", None)).failed_rank(1) is None
    assert is_transport_error(RuntimeError("Read error [127.0.0.1]:9936: Connection reset by peer"))
    assert not is_transport_error(MemoryError("Connection reset by peer"))
