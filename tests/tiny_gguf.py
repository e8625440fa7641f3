"""A tiny random model written as GGUF, as llama.cpp's converter writes one (for the loader's and the
hub's tests)."""
from __future__ import annotations

import os

import numpy as np
import torch

from tandem.models import gguf as G

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode() characters, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def write_tiny_gguf(
    path: str | os.PathLike,
    *,
    arch: str = "llama",
    n_layers: int = 2,
    hidden: int = 64,
    n_head: int = 4,
    n_kv_head: int = 2,
    ffn: int = 96,
    tied: bool | None = None,
    qkv_bias: bool | None = None,
    qtype: str | None = None,
    seed: int = 0,
    context_length: int = 256,
    chat_template: str | None = TINY_CHAT_TEMPLATE,
    extra_tensors: dict[str, np.ndarray] | None = None,
    num_pad_tokens: int = 0,
) -> dict[str, torch.Tensor]:
    """Write a tiny random model as GGUF the way llama.cpp's converter would (q/k rows permuted for llama,
    optionally quantized) with a small byte-level BPE tokenizer; return the float32 HF state dict it encodes.

    Meant for fast tests of anything that loads models.  ``qtype`` (e.g. "Q8_0", "Q4_0") quantizes the 2-D
    weights (their inner dimension must be a multiple of the block size); the returned tensors are then the
    dequantized values.  ``arch`` may be any string, to exercise the unsupported-architecture path.
    ``num_pad_tokens``: placeholder tokens "[PAD<id>]" (type UNUSED) after the real ones, as llama.cpp's
    converter pads a vocabulary up to the embedding table's rows (Qwen2.5's 151665 tokens -> 151936).
    """
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    tied = (arch != "qwen2") if tied is None else tied
    qkv_bias = (arch == "qwen2") if qkv_bias is None else qkv_bias
    rng = np.random.default_rng(seed)
    head_dim = hidden // n_head

    alphabet = _byte_level_alphabet()
    merges = ["Ġ t", "h e", "i n", "Ġt he", "a n", "Ġ a", "e r", "o n", "r e", "Ġ s"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    num_real = len(tokens)
    types = [1] * (num_real - 3) + [3, 3, 3]
    tokens += [f"[PAD{i}]" for i in range(num_real, num_real + num_pad_tokens)]
    types += [5] * num_pad_tokens  # gguf.TokenType.UNUSED
    vocab = len(tokens)

    def w(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": w(vocab, hidden, scale=0.5)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = w(n_head * head_dim, hidden)
        hf[p + "self_attn.k_proj.weight"] = w(n_kv_head * head_dim, hidden)
        hf[p + "self_attn.v_proj.weight"] = w(n_kv_head * head_dim, hidden)
        if qkv_bias:
            hf[p + "self_attn.q_proj.bias"] = w(n_head * head_dim, scale=0.1)
            hf[p + "self_attn.k_proj.bias"] = w(n_kv_head * head_dim, scale=0.1)
            hf[p + "self_attn.v_proj.bias"] = w(n_kv_head * head_dim, scale=0.1)
        hf[p + "self_attn.o_proj.weight"] = w(hidden, n_head * head_dim)
        hf[p + "mlp.gate_proj.weight"] = w(ffn, hidden)
        hf[p + "mlp.up_proj.weight"] = w(ffn, hidden)
        hf[p + "mlp.down_proj.weight"] = w(hidden, ffn)
        hf[p + "input_layernorm.weight"] = 1.0 + w(hidden, scale=0.1)
        hf[p + "post_attention_layernorm.weight"] = 1.0 + w(hidden, scale=0.1)
    hf["model.norm.weight"] = 1.0 + w(hidden, scale=0.1)
    if not tied:
        hf["lm_head.weight"] = w(vocab, hidden, scale=0.5)

    candidates = [f"blk.{i}.{b}.{k}" for i in range(n_layers) for b in G._BLOCK_MAP for k in ("weight", "bias")]
    candidates += [f"{b}.{k}" for b in G._TOP_MAP for k in ("weight", "bias")]
    to_gguf = {G.hf_name_for(g): g for g in candidates}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(num_real - 3)
    writer.add_eos_token_id(num_real - 1)
    writer.add_pad_token_id(num_real - 3)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)

    expected: dict[str, torch.Tensor] = {}
    for name, arr in hf.items():
        gname = to_gguf[name]
        stored = arr
        if arch == "llama" and _is_qk(gname):
            stored = G.permute_llama_qk(arr, n_kv_head if ".attn_k." in gname else n_head)
        if qtype and arr.ndim == 2:
            qt = Q[qtype]
            data = quants.quantize(stored, qt)
            writer.add_tensor(gname, data, raw_dtype=qt)
            deq = quants.dequantize(data, qt).reshape(stored.shape)
            if arch == "llama" and _is_qk(gname):
                deq = G.unpermute_llama_qk(deq, n_kv_head if ".attn_k." in gname else n_head)
            expected[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
        else:
            writer.add_tensor(gname, stored)
            expected[name] = torch.from_numpy(arr.copy())
    for gname, arr in (extra_tensors or {}).items():
        writer.add_tensor(gname, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected

def _is_qk(gguf_name: str) -> bool:
    return ".attn_q." in gguf_name or ".attn_k." in gguf_name
