"""Decoder-only transformer shared by the Llama, Mistral, Qwen2 and Qwen3 families.

Module and parameter names follow the Hugging Face checkpoints, so weights load by name.
The families differ only in flags of ArchConfig: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3), RoPE scaling (Llama 3) and tied embeddings.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.config import ArchConfig
from tandem.kernels import cpu_rows
from tandem.layers.attention import AttnMetadata
from tandem.layers.gpu_linear import AddedRow, GemvLinear, NormedRow
from tandem.layers.norm import RMSNorm, fused_kernels_available
from tandem.layers.rotary import RotaryEmbedding
from tandem.parallel.group import TPGroup
from tandem.parallel.shard import vocab_rows


class KVCache:
    """One model's paged KV tensors: per layer k and v of [num_blocks, block_size, Hkv, D]."""

    def __init__(self, arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # On CPU the pool is left unwritten (zeroing GiBs of pages costs seconds at start-up);
        # block 0, where the reference paths point masked padding, is zeroed so a masked key or
        # value is never garbage. Readers mask everything past a request's own keys.
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.k = [alloc(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.v = [alloc(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        for t in self.k + self.v:
            t[0].zero_()

    @staticmethod
    def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


class Attention(nn.Module):
    cpu_isa: str | None = None  # the build of tandem's CPU kernels the CPU attention calls (None: torch ops)
    tp: TPGroup | None = None  # tensor parallelism: this rank's heads only; o_proj's partial sums all-reduced

    def __init__(self, arch: ArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        h, d = arch.hidden_size, arch.head_dim
        # q, k and v projections packed into one matmul (rows [q | k | v]); see parallel.shard.PACKED_FROM.
        self.qkv_sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = nn.Linear(h, sum(self.qkv_sizes), bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.rotary = rotary
        self.scale = 1.0 / math.sqrt(d)

    def rotates_in_projection(self, x: Tensor | NormedRow, attn: AttnMetadata) -> bool:
        """One row or a few rows on the GPU path whose attention takes its K/V pre-stored: the qkv
        GEMV / few-row GEMM rotates and stores (no q/k norm between the projection and the rotation)."""
        return (isinstance(self.qkv_proj, GemvLinear) and self.qkv_proj.rotates(x, self.head_dim)
                and attn.fuses_kv_store and not self.qk_norm)

    def forward(self, x: Tensor | NormedRow, positions: Tensor, attn: AttnMetadata, k_cache: Tensor,
                v_cache: Tensor, add_to: Tensor | None = None) -> Tensor | AddedRow:
        """-> o_proj(attention(x)); with add_to (the residual stream, one row): added into it."""
        n = positions.shape[0]
        rotated = self.rotates_in_projection(x, attn)
        if rotated:  # one launch projects, rotates and stores k, v
            qkv = self.qkv_proj.forward_qkv_rope(x, self.num_heads, self.num_kv_heads, positions, self.rotary,
                                                 k_cache, v_cache, attn.slot_mapping)
        else:
            qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)  # row-strided views
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotated:
            o = attn.attend(q, k, v, k_cache, v_cache, self.scale, kv_stored=True)
        elif attn.fuses_kv_store:  # one launch rotates q, k and writes k, v into the cache
            q, k = self.rotary(positions, q, k, store=(v, k_cache, v_cache, attn.slot_mapping))
            o = attn.attend(q, k, v, k_cache, v_cache, self.scale, kv_stored=True)
        else:
            q, k = self.rotary(positions, q, k)
            o = attn.attend(q, k, v, k_cache, v_cache, self.scale, cpu_isa=self.cpu_isa)
        o = o.reshape(n, self.num_heads * self.head_dim)
        if add_to is not None:
            return self.o_proj.forward_add_(o, add_to)
        if self.tp is not None:
            return self.tp.all_reduce_(self.o_proj(o))
        return self.o_proj(o)


class MLP(nn.Module):
    cpu_isa: str | None = None  # the build of tandem's CPU kernels SiLU-and-mul calls (None: torch ops)
    tp: TPGroup | None = None  # tensor parallelism: this rank's intermediate rows; down_proj's sums all-reduced

    def __init__(self, arch: ArchConfig):
        super().__init__()
        # gate and up projections packed into one matmul (rows [gate | up]).
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.intermediate_size = arch.intermediate_size

    def forward(self, x: Tensor | NormedRow, add_to: Tensor | None = None) -> Tensor | AddedRow:
        """-> down(silu(gate(x)) * up(x)); with add_to (the residual stream, one row): added into it."""
        if self.tp is not None:  # (never fused: the sum across ranks comes before the add)
            return self.tp.all_reduce_(self._forward(x))
        return self._forward(x, add_to)

    def _forward(self, x: Tensor | NormedRow, add_to: Tensor | None = None) -> Tensor | AddedRow:
        if isinstance(self.gate_up_proj, GemvLinear) and self.gate_up_proj.activates(x):
            act = self.gate_up_proj.forward_then_silu_mul(x)  # the activation in gate_up's epilogue
            return self.down_proj(act) if add_to is None else self.down_proj.forward_add_(act, add_to)
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if add_to is not None:
            return self.down_proj.forward_add_(gate_up, add_to, act="silu_mul")
        if gate_up.is_cuda and fused_kernels_available():
            if hasattr(self.down_proj, "forward_silu_mul"):  # GemvLinear: the activation in its GEMV
                return self.down_proj.forward_silu_mul(gate_up)
            from tandem.kernels.fused import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        if self.cpu_isa is not None and cpu_rows.rows_of(gate_up) is not None:
            return self.down_proj(cpu_rows.silu_mul(gate_up, self.cpu_isa))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(arch, rotary)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def fuses_row(self, residual: Tensor) -> bool:
        """Whether this layer runs the one-row GEMV path (its MLP add and the next input norm inside
        GEMVs; not under tensor parallelism, whose partial sums are reduced before the add)."""
        return isinstance(self.mlp.down_proj, GemvLinear) and self.mlp.tp is None and all(
            lin.one_row(residual) for lin in (self.self_attn.qkv_proj, self.self_attn.o_proj,
                                              self.mlp.gate_up_proj, self.mlp.down_proj))

    def forward(
        self, x: Tensor | AddedRow, residual: Tensor | None, positions: Tensor, attn: AttnMetadata, k_cache: Tensor,
        v_cache: Tensor,
    ) -> tuple[Tensor | AddedRow, Tensor]:
        """x: the previous layer's output, not yet added (a Tensor) or already added into the
        residual stream (an AddedRow); residual: the stream. -> (this layer's output, the stream).
        Same arithmetic as `x = x + attn(norm(x)); x = x + mlp(norm(x))`, with each add fused into
        the next norm; for one row on the GPU the MLP's add runs in the down projection's GEMV
        and the next layer's input norm in its qkv GEMV (see tandem/kernels/gemv.py); where the gate | up
        GEMV normalizes its input (fp8 weights, GemvLinear.normalizes_row) the attention's add runs in
        the o projection's GEMV and the post-attention norm in gate_up's."""
        if residual is None:
            residual = x  # the embedding output becomes the residual stream (updated in place)
            h = self.input_layernorm(x)
        elif isinstance(x, AddedRow):
            h = NormedRow(residual, self.input_layernorm, x.sumsq)
        else:
            h = self.input_layernorm(x, residual)
        fused = self.fuses_row(residual)
        if isinstance(h, NormedRow) and not fused:  # the previous layer added; this one has no GEMVs
            h = h.norm(residual)
        if fused and self.mlp.gate_up_proj.normalizes_row():  # o adds, gate_up normalizes
            added = self.self_attn(h, positions, attn, k_cache, v_cache, add_to=residual)
            h = NormedRow(residual, self.post_attention_layernorm, added.sumsq)
        else:
            h = self.self_attn(h, positions, attn, k_cache, v_cache)
            h = self.post_attention_layernorm(h, residual)
        return self.mlp(h, add_to=residual if fused else None), residual


class DecoderModel(nn.Module):
    def __init__(self, arch: ArchConfig, max_positions: int, rope_device=None):
        super().__init__()
        rotary = RotaryEmbedding(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling_dict, device=rope_device
        )
        # _weight skips the random init (the loader fills every parameter): normal_ on the meta
        # device alone costs ~1.4 s of decomposition imports at start-up.
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(arch, rotary) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = rotary


class CausalLM(nn.Module):
    """forward(input_ids, positions, attn, kv) -> hidden states; compute_logits(hidden) -> logits.

    tp: this rank's tensor-parallel group; arch is then the rank's shape (tandem.parallel.shard:
    its heads and intermediate rows) and lm_head holds its vocabulary shard (never tied)."""

    def __init__(self, arch: ArchConfig, max_positions: int, rope_device=None, tp: TPGroup | None = None):
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.model = DecoderModel(arch, max_positions, rope_device)
        head_rows = vocab_rows(arch.vocab_size, tp.size) if tp is not None else arch.vocab_size
        self.lm_head = nn.Linear(arch.hidden_size, head_rows, bias=False)
        if tp is not None:
            for module in self.modules():
                if isinstance(module, (Attention, MLP)):
                    module.tp = tp
        elif arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttnMetadata, kv: KVCache) -> Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden [num_tokens, hidden_size]."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, attn, kv.k[i], kv.v[i])
        if isinstance(x, AddedRow):
            return self.model.norm(residual)
        return self.model.norm(x, residual)

    def compute_logits(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] in the model dtype (a pruned draft head,
        tandem/spec/hot_vocab.py: [n, its rows]); out of that shape, contiguous: written in place and
        returned (a CUDA graph's static output), the same bits."""
        if self.tp is not None:  # every rank's vocabulary shard, gathered
            logits = self.tp.gather_vocab(self.lm_head(hidden), self.arch.vocab_size)
            return logits if out is None else out.copy_(logits)
        if out is None:
            return self.lm_head(hidden)
        if isinstance(self.lm_head, GemvLinear):
            return self.lm_head(hidden, out=out)
        return torch.mm(hidden, self.lm_head.weight.t(), out=out)  # F.linear's kernel (no bias)

    def top_tokens(self, hidden: Tensor) -> Tensor:
        """Under tensor parallelism: hidden [n, hidden_size] -> the argmax token of each row's
        logits [n] int64 (greedy drafts), from each rank's best token alone (TPGroup.top_tokens)."""
        return self.tp.top_tokens(self.lm_head(hidden), self.arch.vocab_size)
