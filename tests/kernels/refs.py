"""Pure-torch references the Triton kernels in tandem/kernels/ are checked against.

Each `x_ref` takes the same arguments as the kernel wrapper `x` (minus launch knobs) and states
the rule plainly, with no tiling. Attention is computed in fp32 from upcast inputs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.sampling.gumbel import gumbel_argmax, noise_key, uniform
from tandem.spec.rejection import rejection_sample


def kv_store_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k_cache.flat[slot] = k[t] for every token t with slot_mapping[t] >= 0; likewise v."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k.shape[1:])[slots] = k[keep]
    v_cache.view(-1, *v.shape[1:])[slots] = v[keep]


def paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_q_lens: Tensor,
    max_q_len: int,
    scale: float,
    out: Tensor,
) -> Tensor:
    """out[t, h] = softmax_j(scale * q[t, h] . K[j, h // group]) V[j, h // group] over the keys j of
    t's request at positions <= t's position (seq_len - q_len + i for its i-th query); a query
    with no such key (padding, seq_len 0) gets zeros."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    cu = cu_q_lens.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q_len = cu[r + 1] - cu[r]
        if q_len == 0:
            continue
        assert q_len <= max_q_len
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[r].long()[pos // block_size]
        keys = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)  # [seq_len, H, D]
        vals = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)
        qr = q[cu[r] : cu[r + 1]].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qr, keys) * scale
        q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.where(q_pos[None, :, None] >= 0, scores.softmax(-1), 0.0)
        out[cu[r] : cu[r + 1]] = torch.einsum("hqk,khd->qhd", probs, vals).to(out.dtype)
    return out


def gumbel_uniform_ref(seeds: Tensor, positions: Tensor, salt: int, vocab_size: int) -> Tensor:
    """u [n, vocab_size] fp32 from tandem.sampling.gumbel's hash."""
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)[None, :]
    return uniform(noise_key(seeds, positions, salt)[:, None], tokens)


def gumbel_scores_ref(logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor, salt: int) -> Tensor:
    """The scores the sampler maximises: logits / T + g (T > 0) or the raw logits (T == 0), fp32."""
    x = logits.float()
    sampled = temperature > 0
    scaled = x / torch.where(sampled, temperature, 1.0)[:, None]
    g = -torch.log(-torch.log(gumbel_uniform_ref(seeds, positions, salt, x.shape[1])))
    return torch.where(sampled[:, None], scaled + g, x)


def gumbel_sample_ref(
    logits: Tensor, temperature: Tensor, seeds: Tensor, positions: Tensor, salt: int, out: Tensor
) -> Tensor:
    """tandem.sampling.gumbel.gumbel_argmax on logits / T; plain argmax where T == 0."""
    x = logits.float()
    sampled = temperature > 0
    drawn = gumbel_argmax(x / torch.where(sampled, temperature, 1.0)[:, None], seeds, positions, salt)
    out.copy_(torch.where(sampled, drawn, x.argmax(-1)))
    return out


def rejection_sample_ref(*args, **kwargs) -> tuple[Tensor, Tensor]:
    """The vectorised torch sampler (tandem.spec.rejection.rejection_sample) is the reference."""
    return rejection_sample(*args, **kwargs)
