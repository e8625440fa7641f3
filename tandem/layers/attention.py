"""Paged attention: the metadata a step passes to every layer, and the PyTorch reference.

Metadata is built once per step by the runner and passed explicitly to each attention call
(two models run in one process, so nothing here is ambient). The reference kernel handles
queries of any length against a cached prefix: a request's query token i sits at position
start_pos + i and sees every key at a position <= its own.

Grouping. A prompt with no cached prefix runs alone through a plain causal kernel. With
`rowwise` (the target model's steps), every other request of at most ROWWISE_MAX_Q query
tokens (decodes, verifications, short chunks) is a RowGroup: its tokens are attended one at
a time, each against exactly its visible keys (no padding, no mask), so a token's attention
output is computed the same way whether it is decoded alone or verified among 1 + k draft
tokens; with the row-invariant CPU linears of tandem/layers/cpu_linear.py, speculative greedy
output then equals target-only greedy output bit for bit, in bf16 too. The rest (longer
chunks, and everything when not `rowwise`, as in the draft's catch-up, whose numerics cannot
change the output) is batched by equal query length with a causal mask.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.kernels import cpu_attention

# Longest query chunk against a cached prefix attended token by token (see above).
ROWWISE_MAX_Q = 16


@dataclass(slots=True)
class AttnGroup:
    """Query rows attended in one call: G sequences of q_len tokens, each against max_kv keys."""

    token_idx: Tensor  # [G, q_len] int64, rows of the flat token dim
    kv_slots: Tensor | None  # [G, max_kv] int64 flat cache slots (None: a prompt with no prefix)
    mask: Tensor | None  # [G, 1, q_len, max_kv] bool, True = attend (None: every key is visible)


@dataclass(slots=True)
class RowGroup:
    """One request's query tokens [first, first + n), attended one at a time: token t sees the
    keys at positions [0, start + t + 1)."""

    first: int
    n: int
    start: int
    kv_slots: Tensor  # [start + n] int64 flat cache slots


@dataclass(slots=True)
class AttnRows:
    """Every query token of a step as one row, for the C kernel (tandem/kernels/cpu_attention.py):
    row r is token `token[r]` and sees the first `len[r]` keys of its slot list,
    slots[slot_start[r]:]. The same visibility as the groups, in one flat form."""

    token: Tensor  # [R] int64, row of the flat token dim
    slot_start: Tensor  # [R] int64, offset of the row's slot list in `slots`
    len: Tensor  # [R] int64, keys the row sees
    slots: Tensor  # [S] int64 flat cache slots, the requests' lists one after another


@dataclass(slots=True)
class AttnMetadata:
    """Everything attention needs for one step of one model; shared by all its layers."""

    slot_mapping: Tensor  # [num_tokens] int64, flat KV slot (block * block_size + offset) per token
    groups: list[AttnGroup | RowGroup]
    num_tokens: int
    rows: AttnRows | None = None  # the same step as rows (the C kernel's input), where built

    fuses_kv_store = False  # the rotary kernel never stores K/V for this path

    def attend(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float,
               kv_stored: bool = False, cpu_isa: str | None = None) -> Tensor:
        """Store this step's k/v in the paged cache, then attend. -> [num_tokens, H, D].
        With cpu_isa (the model's build of tandem's CPU kernels), one C call does both where
        the tensors fit it; else the PyTorch reference below."""
        assert not kv_stored
        if cpu_isa is not None and self.rows is not None and cpu_attention.fits(q, k, v, k_cache, v_cache):
            if k_cache.dtype != k.dtype:  # an fp8 cache: stored here (saturated and rounded), read by the kernel
                store_kv(k, v, k_cache, v_cache, self.slot_mapping)
            return cpu_attention.paged_attention(q, k, v, k_cache, v_cache, self.slot_mapping, self.rows, scale,
                                                 cpu_isa)
        store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        return paged_attention(q, k, v, k_cache, v_cache, self, scale)


def build_attn_metadata(
    start_pos: list[int],
    q_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    rowwise: bool = True,
) -> AttnMetadata:
    """Host-side construction from plain lists (the reference path: eager, no padding)."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    slots: list[int] = []
    for start, n, table in zip(start_pos, q_lens, block_tables):
        for p in range(start, start + n):
            slots.append(table[p // block_size] * block_size + p % block_size)

    groups: list[AttnGroup | RowGroup] = []
    by_len: dict[int, list[int]] = {}
    request_slots = [_kv_slots(table, start + n, block_size)
                     for start, n, table in zip(start_pos, q_lens, block_tables)]
    for i, (start, n) in enumerate(zip(start_pos, q_lens)):
        if start == 0 and n > 1:  # prompt with no prefix: plain causal
            token_idx = torch.arange(cu[i], cu[i] + n, dtype=torch.int64)[None]
            groups.append(AttnGroup(token_idx.to(device), None, None))
        elif rowwise and n <= ROWWISE_MAX_Q:
            groups.append(RowGroup(cu[i], n, start, request_slots[i].to(device)))
        else:
            by_len.setdefault(n, []).append(i)
    for q_len, members in by_len.items():
        max_kv = max(start_pos[i] + q_len for i in members)
        kv_slots = torch.zeros(len(members), max_kv, dtype=torch.int64)  # masked keys read slot 0
        for row, i in enumerate(members):
            kv_slots[row, : start_pos[i] + q_len] = request_slots[i]
        token_idx = torch.tensor([list(range(cu[i], cu[i] + q_len)) for i in members], dtype=torch.int64)
        q_pos = torch.tensor([start_pos[i] for i in members])[:, None] + torch.arange(q_len)  # [G, q_len]
        mask = torch.arange(max_kv)[None, None, :] <= q_pos[:, :, None]  # [G, q_len, max_kv]
        groups.append(AttnGroup(token_idx.to(device), kv_slots.to(device), mask[:, None].to(device)))
    return AttnMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        groups=groups,
        num_tokens=cu[-1],
        rows=_rows(start_pos, q_lens, cu, request_slots, device),
    )


def _rows(start_pos: list[int], q_lens: list[int], cu: list[int], request_slots: list[Tensor], device) -> AttnRows:
    """Request i's token t (position start + t) sees the first start + t + 1 of its slots."""
    token: list[int] = []
    slot_start: list[int] = []
    lens: list[int] = []
    offset = 0
    for i, (start, n) in enumerate(zip(start_pos, q_lens)):
        token.extend(range(cu[i], cu[i] + n))
        slot_start.extend([offset] * n)
        lens.extend(range(start + 1, start + n + 1))
        offset += start + n
    slots = torch.cat(request_slots) if request_slots else torch.zeros(0, dtype=torch.int64)
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return AttnRows(as_tensor(token), as_tensor(slot_start), as_tensor(lens), slots.to(device))


def _kv_slots(block_table: list[int], kv_len: int, block_size: int) -> Tensor:
    """Flat cache slots of positions [0, kv_len) -> [kv_len] int64."""
    table = torch.tensor(block_table[: -(-kv_len // block_size)], dtype=torch.int64)
    return (table[:, None] * block_size + torch.arange(block_size)).flatten()[:kv_len]


FP8_MAX = 448.0  # float8 e4m3's largest finite value


def to_cache(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in a KV cache's dtype: float8 (kv_cache_dtype 'fp8') saturates at +-FP8_MAX, as vLLM's
    unscaled fp8 cache stores, so an outlier is clipped rather than made NaN."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def as_bytes(t: Tensor) -> Tensor:
    """A float8 tensor viewed as uint8 (index_copy_ has no float8 form on the CPU); others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter new K/V rows [num_tokens, Hkv, D] into the paged cache [num_blocks, block_size, Hkv, D]
    (in the cache's dtype: to_cache)."""
    for new, cache in ((k, k_cache), (v, v_cache)):
        as_bytes(cache.view(-1, *new.shape[1:])).index_copy_(0, slot_mapping, as_bytes(to_cache(new, cache.dtype)))


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, attn: AttnMetadata, scale: float
) -> Tensor:
    """q [num_tokens, H, D], k/v [num_tokens, Hkv, D] (already stored) -> [num_tokens, H, D]. Cached
    keys and values are read in q's dtype (an fp8 cache's widened); a prompt with no cached prefix
    attends its own k and v, rounded as the cache keeps them, so a request's output does not depend
    on whether its prefix was cached.

    GQA without copying keys: the rep = H / Hkv query heads of a KV head are folded into the
    query-length dim, [G, Hkv, rep * q_len, D], with the causal mask repeated along them.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rep = num_heads // num_kv_heads
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    whole = len(attn.groups) == 1 and isinstance(attn.groups[0], AttnGroup)
    out = None if whole else torch.empty_like(q)
    for g in attn.groups:
        if isinstance(g, RowGroup):
            _attend_rows(q, flat_k, flat_v, g, scale, out)
            continue
        n, q_len = g.token_idx.shape
        qg = q.view(n, q_len, num_heads, head_dim) if whole else q[g.token_idx]  # [G, q_len, H, D]
        if g.kv_slots is None:  # a prompt with no cached prefix: plain causal attention
            src_k = k.view(n, q_len, num_kv_heads, head_dim) if whole else k[g.token_idx]
            src_v = v.view(n, q_len, num_kv_heads, head_dim) if whole else v[g.token_idx]
            if k_cache.dtype != k.dtype:  # as the cache keeps them (the GPU's prompts read it)
                src_k, src_v = to_cache(src_k, k_cache.dtype).to(k.dtype), to_cache(src_v, v_cache.dtype).to(v.dtype)
            og = F.scaled_dot_product_attention(
                qg.transpose(1, 2), src_k.transpose(1, 2), src_v.transpose(1, 2), is_causal=True, scale=scale,
                enable_gqa=rep > 1,
            ).transpose(1, 2)  # [G, q_len, H, D]
            if whole:
                return og.reshape(num_tokens, num_heads, head_dim)
            out[g.token_idx] = og
            continue
        # [G, q_len, Hkv, rep, D] -> [G, Hkv, rep, q_len, D] -> [G, Hkv, rep * q_len, D]
        qg = qg.view(n, q_len, num_kv_heads, rep, head_dim).permute(0, 2, 3, 1, 4).reshape(
            n, num_kv_heads, rep * q_len, head_dim
        )
        mask = g.mask
        if mask is not None and rep > 1:
            mask = mask[:, :, None].expand(-1, -1, rep, -1, -1).reshape(n, 1, rep * q_len, mask.shape[-1])
        keys, values = flat_k[g.kv_slots].to(q.dtype), flat_v[g.kv_slots].to(q.dtype)  # [G, max_kv, Hkv, D]
        og = F.scaled_dot_product_attention(
            qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
        )  # [G, Hkv, rep * q_len, D]
        og = og.view(n, num_kv_heads, rep, q_len, head_dim).permute(0, 3, 1, 2, 4).reshape(
            n, q_len, num_heads, head_dim
        )
        if whole:
            return og.reshape(num_tokens, num_heads, head_dim)
        out[g.token_idx] = og
    return out


def _attend_rows(q: Tensor, flat_k: Tensor, flat_v: Tensor, g: RowGroup, scale: float, out: Tensor) -> None:
    """Each token of g as a one-token query against exactly its keys: [1, Hkv, rep, D] x [1, Hkv, L, D]."""
    num_kv_heads, head_dim = flat_k.shape[1:]
    keys = flat_k[g.kv_slots].to(q.dtype).transpose(0, 1)  # [Hkv, start + n, D]
    values = flat_v[g.kv_slots].to(q.dtype).transpose(0, 1)
    for t in range(g.n):
        row = g.first + t
        visible = g.start + t + 1
        og = F.scaled_dot_product_attention(
            q[row].view(1, num_kv_heads, -1, head_dim), keys[None, :, :visible], values[None, :, :visible], scale=scale
        )  # [1, Hkv, rep, D]
        out[row] = og.view(-1, head_dim)


def build_decode_metadata(positions: Tensor, block_table: Tensor, block_size: int, max_kv: int) -> AttnMetadata:
    """One query token per row at a device-side position (draft decode steps: no host sync).

    positions [n] int64; block_table [n, max_blocks] int64 covering positions < max_kv.
    """
    n = positions.shape[0]
    kv_pos = torch.arange(max_kv, device=positions.device)
    visible = kv_pos[None, :] <= positions[:, None]  # [n, max_kv]
    kv_slots = block_table[:, kv_pos // block_size] * block_size + kv_pos % block_size  # [n, max_kv]
    kv_slots = torch.where(visible, kv_slots, 0)  # masked keys read the zeroed slot 0, never garbage
    mask = visible[:, None, None, :]  # [n, 1, 1, max_kv]
    slot_mapping = block_table.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    token_idx = torch.arange(n, device=positions.device)[:, None]
    rows = AttnRows(token_idx[:, 0], token_idx[:, 0] * max_kv, (positions + 1).clamp(max=max_kv), kv_slots.flatten())
    return AttnMetadata(slot_mapping=slot_mapping, groups=[AttnGroup(token_idx, kv_slots, mask)], num_tokens=n,
                        rows=rows)
