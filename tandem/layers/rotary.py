"""Rotary position embedding (rotate-half layout), with llama3 and linear frequency scaling."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tandem.kernels import cpu_rows
from tandem.layers.norm import fused_kernels_available


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Inverse frequencies [head_dim // 2] fp32, after the configured scaling rule."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are divided by factor, short ones kept, the band between blended.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions), applied to q and k per token."""

    cpu_isa: str | None = None  # the build of tandem's CPU kernels the CPU path calls (None: torch ops)

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, device=None):
        super().__init__()
        # NOTE: built on an explicit device so the tables are real even when the module is
        # constructed under torch.device("meta") (the loader fills parameters afterwards).
        device = device or torch.device("cpu")
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        freqs = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor, store=None) -> tuple[Tensor, Tensor]:
        """positions [num_tokens] int64; q [num_tokens, H, D]; k [num_tokens, Hkv, D].
        On CUDA the fused kernel rotates q and k in place (they may be views of a qkv buffer);
        store = (v, k_cache, v_cache, slot_mapping) also writes k and v into the paged cache
        in the same launch (CUDA only). On a CPU with `cpu_isa`, one C call rotates them in
        place (the same bits as the torch ops below)."""
        if q.is_cuda and fused_kernels_available():
            from tandem.kernels.fused import rotary_embedding

            rotary_embedding(positions, q, k, self.cos, self.sin, store)
            return q, k
        assert store is None, "the fused rotary + KV store runs on CUDA only"
        if self.cpu_isa is not None and cpu_rows.rotary_fits(positions, q, k, self.cos):
            cpu_rows.rotary_(positions, q, k, self.cos, self.sin, self.cpu_isa)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [num_tokens, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
