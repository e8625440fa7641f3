"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

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

import torch
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


# Checkpoint projections whose output rows the ranks split (column-parallel; weight and bias),
# and those whose input columns they split (row-parallel; the weight: a bias, o_proj's under
# attention_bias, is added once: rank 0 keeps it, the others hold zeros, and the sum adds it).
ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COLUMN_SPLIT = ("o_proj", "down_proj")
# Our packed parameters: the checkpoint projections stacked in their rows (tandem/models/loader.py packs them).
PACKED_FROM = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def packed_rows(packed: str, arch: ArchConfig) -> list[int]:
    """The rows of each projection stacked in a packed parameter of the shape arch."""
    if packed == "qkv_proj":
        return [arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim]
    return [arch.intermediate_size, arch.intermediate_size]


def split_dim(name: str) -> int | None:
    """The dimension of checkpoint tensor `name` (Hugging Face names) that the ranks split: 0 (rows),
    1 (columns), or None (whole on every rank). lm_head.weight: 0, by vocab_rows."""
    parts = name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if module in ROW_SPLIT or name == "lm_head.weight":
        return 0
    if module in COLUMN_SPLIT and leaf == "weight":
        return 1
    return None


def rank_span(name: str, length: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank's part of the `length` rows / columns of `name` that split_dim splits."""
    if name == "lm_head.weight":  # ceil(V / size) rows a rank; the last rank's run short (padded)
        rows = vocab_rows(length, size)
        return min(rank * rows, length), min((rank + 1) * rows, length)
    n = length // size
    return rank * n, (rank + 1) * n


def pad_head(name: str, t: Tensor, vocab_size: int, size: int) -> Tensor:
    """lm_head's rank part padded with zero rows to vocab_rows (every rank's shard one size)."""
    rows = vocab_rows(vocab_size, size)
    if name != "lm_head.weight" or t.shape[0] == rows:
        return t
    out = t.new_zeros(rows, t.shape[1])
    out[: t.shape[0]].copy_(t)
    return out


def read_rank_part(name: str, tensor, shape: tuple[int, ...], rank: int, size: int) -> Tensor:
    """Rank's part of checkpoint tensor `name` of `shape`, read from `tensor`: a safetensors slice
    (only that part leaves the file) or a whole tensor."""
    dim = split_dim(name)
    if size > 1 and rank > 0 and name.endswith(tuple(f"{m}.bias" for m in COLUMN_SPLIT)):
        return torch.zeros_like(tensor[:])
    if dim is None or size == 1:
        return tensor[:]
    start, stop = rank_span(name, shape[dim], rank, size)
    part = tensor[start:stop] if dim == 0 else tensor[:, start:stop]
    return pad_head(name, part, shape[0], size)


def shard_param(name: str, full: Tensor, arch: ArchConfig, rank: int, size: int) -> Tensor:
    """The whole parameter `name` (the model's own names: qkv_proj, gate_up_proj, ...) of the
    checkpoint's shape arch -> rank's slice of it (dummy weights, drawn whole)."""
    if size == 1:
        return full
    owner, _, leaf = name.rpartition(".")
    prefix, _, module = owner.rpartition(".")
    if module in PACKED_FROM:  # each stacked projection split as the checkpoint's would be
        pieces = full.split(packed_rows(module, arch), dim=0)
        return torch.cat([read_rank_part(f"{prefix}.{p}.{leaf}", t, tuple(t.shape), rank, size)
                          for p, t in zip(PACKED_FROM[module], pieces)])
    return read_rank_part(name, full, tuple(full.shape), rank, size).contiguous()
