"""TPGroup's collectives on two CPU ranks (gloo), against the single-process results."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tandem.layers.quant import fake_quantize_fp8_, quantize_linears_
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


def _rank(rank: int, port: int, queue, received) -> None:
    group = TPGroup(rank, 2, port, torch.device("cpu"))
    full = _logits()
    rows = 501
    local = torch.zeros(full.shape[0], rows)
    part = full[:, rank * rows : (rank + 1) * rows]
    local[:, : part.shape[1]] = part  # the last shard's padding row is zero: above row 3's -5
    queue.put((rank, group.top_tokens(local, VOCAB), group.gather_vocab(local, VOCAB),  # rank 0's order
               group.all_reduce_(torch.full((3,), float(rank + 1))), group.min_int(7 - rank),
               group.all_reduce_max_(torch.tensor([1.0, -2.0]) * (rank + 1))))
    received.wait(60)
    group.close()


def _start_rank_1(target):
    """Rank 1 runs target(1, port, queue, received) in a spawned process; -> (rank 0's group, receive, that
    process). receive() takes rank 1's results off the queue, then lets it exit (received): its tensors travel
    as shared-memory file descriptors, which its process must still hold when this one opens them (a rank that
    had exited reset the connection)."""
    ctx = mp.get_context("spawn")
    store = host_store(2)
    queue, received = ctx.Queue(), ctx.Event()
    other = ctx.Process(target=target, args=(1, store.port, queue, received))
    other.start()

    def receive():
        try:
            return queue.get(timeout=60)
        finally:
            received.set()

    return TPGroup(0, 2, store.port, torch.device("cpu"), store), receive, other


def test_collectives_match_one_process():
    group, receive, other = _start_rank_1(_rank)
    full = _logits()
    local = full[:, :501].clone()
    got = [(0, group.top_tokens(local, VOCAB), group.gather_vocab(local, VOCAB),
            group.all_reduce_(torch.full((3,), 1.0)), group.min_int(7),
            group.all_reduce_max_(torch.tensor([1.0, -2.0])))]
    got.append(receive())
    other.join(timeout=60)
    for rank, top, gathered, summed, smallest, largest in got:
        assert largest.tolist() == [2.0, -2.0], rank
        assert torch.equal(top, full.argmax(dim=-1)), rank
        assert top.tolist()[1:5] == [10, 600, 0, 1000]
        assert torch.equal(gathered, full), rank
        assert summed.tolist() == [3.0] * 3 and smallest == 6


def _fp8_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """(o_proj [8, 64], qkv_proj [8, 32]) whole: some o rows' second halves 1e4x the first."""
    g = torch.Generator().manual_seed(1)
    o = torch.randn(8, 64, generator=g)
    o[::2, 32:] *= 1e4  # (e4m3 is floating point: a larger scale changes only values it pushes below its normals)
    return o, torch.randn(8, 32, generator=g)


def _fp8_shard(rank: int) -> torch.nn.Module:
    """A rank's o_proj (row-parallel: its 32 input columns) and qkv_proj (column-parallel: its 4 rows)."""
    o, qkv = _fp8_weights()
    shard = torch.nn.Module()
    shard.o_proj = torch.nn.Linear(32, 8, bias=False)
    shard.qkv_proj = torch.nn.Linear(32, 4, bias=False)
    with torch.no_grad():
        shard.o_proj.weight.copy_(o[:, rank * 32 : (rank + 1) * 32])
        shard.qkv_proj.weight.copy_(qkv[rank * 4 : (rank + 1) * 4])
    return shard


def _fp8_rank(rank: int, port: int, queue, received) -> None:
    group = TPGroup(rank, 2, port, torch.device("cpu"))
    shard = _fp8_shard(rank)
    quantize_linears_(shard, "fp8", in_place=False, tp=group)
    queue.put((rank, shard.o_proj.weight.detach().clone(), shard.qkv_proj.weight.detach().clone()))
    received.wait(60)
    group.close()


def test_fp8_rank_holds_the_one_rank_models_values():
    """quantize_linears_ on a tensor-parallel rank's shard: a row-parallel layer's rows are scaled by
    the whole row's magnitude (an all-reduce of the ranks' row maxima), so each rank holds its part
    of the one-rank model's fp8 weights (rounded even with in_place=False); a column-parallel layer's
    whole rows are rounded as usual (here with in_place=False: marked only)."""
    group, receive, other = _start_rank_1(_fp8_rank)
    shard = _fp8_shard(0)
    quantize_linears_(shard, "fp8", in_place=False, tp=group)
    got = [(0, shard.o_proj.weight, shard.qkv_proj.weight), receive()]
    other.join(timeout=60)
    o, qkv = _fp8_weights()
    whole = o.clone()
    fake_quantize_fp8_(whole)
    for rank, o_part, qkv_part in got:
        assert torch.equal(o_part, whole[:, rank * 32 : (rank + 1) * 32]), rank
        assert torch.equal(qkv_part, qkv[rank * 4 : (rank + 1) * 4]), rank  # marked, left for W8Linear
    alone = o[:, :32].clone()
    fake_quantize_fp8_(alone)  # rank 0's part scaled by itself: other values
    assert not torch.equal(alone, whole[:, :32])


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
