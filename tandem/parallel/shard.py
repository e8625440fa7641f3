"""Which slice of each weight a tensor-parallel rank holds (Megatron-style).

- qkv_proj (rows [q | k | v]): column-parallel by heads: rank r holds its num_heads / tp query
  heads and num_kv_heads / tp key / value heads, so its attention and KV cache cover those heads
  only.
- gate_up_proj (rows [gate | up]): column-parallel: rank r holds its intermediate_size / tp rows of
  each half, so SiLU-and-mul stays local.
- o_proj, down_proj: row-parallel: rank r holds the input columns matching its heads /
  intermediate rows; their partial outputs are summed across ranks (TPGroup.all_reduce_).
- lm_head: vocabulary-parallel: rank r holds rows r * ceil(V / tp) .. (the last shard padded with
  zero rows); the logits are gathered (TPGroup.gather_vocab) or reduced to their argmax
  (TPGroup.top_tokens).
- everything else (the embedding table, the norms, q / k norms of a head_dim): whole on every rank.
"""
from __future__ import annotations

import dataclasses

from torch import Tensor

from tandem.config import ArchConfig
from tandem.errors import ConfigError


def check_shardable(arch: ArchConfig, size: int, field: str = "tensor_parallel_size", what: str = "the model") -> None:
    """ConfigError unless every sharded dimension divides by size."""
    for name, value in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
                        ("intermediate_size", arch.intermediate_size)):
        if value % size:
            ok = [d for d in range(1, 9) if arch.num_heads % d == 0 and arch.num_kv_heads % d == 0
                  and arch.intermediate_size % d == 0]
            raise ConfigError(f"{field}={size} does not divide {what}'s {name}={value}; use one of {ok}")


def shard_arch(arch: ArchConfig, size: int) -> ArchConfig:
    """The shape one rank runs: its heads, key / value heads and intermediate rows (the vocabulary
    stays whole: logits are gathered to it)."""
    if size == 1:
        return arch
    return dataclasses.replace(arch, num_heads=arch.num_heads // size, num_kv_heads=arch.num_kv_heads // size,
                               intermediate_size=arch.intermediate_size // size)


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the LM head each rank holds."""
    return -(-vocab_size // size)


def _chunk(t: Tensor, dim: int, rank: int, size: int) -> Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def shard_param(name: str, full: Tensor, arch: ArchConfig, rank: int, size: int) -> Tensor:
    """The whole parameter `name` (the model's own names: qkv_proj, gate_up_proj, ...) of the
    checkpoint's shape arch -> rank's slice of it (a new contiguous tensor)."""
    if size == 1:
        return full
    parts = name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if module == "qkv_proj":
        d = arch.head_dim
        sizes = [arch.num_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d]
        return _cat([_chunk(s, 0, rank, size) for s in full.split(sizes, dim=0)])
    if module == "gate_up_proj":
        return _cat([_chunk(s, 0, rank, size) for s in full.split(arch.intermediate_size, dim=0)])
    if module in ("o_proj", "down_proj") and leaf == "weight":
        return _chunk(full, 1, rank, size).contiguous()
    if name == "lm_head.weight":
        rows = vocab_rows(arch.vocab_size, size)
        out = full.new_zeros(rows, full.shape[1])
        start, stop = rank * rows, min((rank + 1) * rows, full.shape[0])
        if stop > start:
            out[: stop - start].copy_(full[start:stop])
        return out
    return full


def _cat(pieces: list[Tensor]) -> Tensor:
    import torch

    return torch.cat(pieces, dim=0)
