"""Tensor parallelism: one process per rank, each holding a shard of every layer (group.py: the
collectives; shard.py: which slice of which weight a rank holds; workers.py: ranks 1.. as
processes that repeat rank 0's engine calls)."""
