"""GGUF -> Hugging Face conversion.

Turns a (possibly quantized) GGUF checkpoint into a Hugging Face-style directory:
``config.json`` + ``generation_config.json`` (built from the GGUF metadata), one
``model.safetensors`` with HF parameter names in the requested dtype, and the tokenizer
files (converted from the GGUF's own tokenizer metadata by transformers, never fetched
from a hub).

Only the pure conversion lives here; caching, atomic placement and integrity markers are
the business of :mod:`tandem.models.hub`, which calls :func:`convert_gguf` on a temporary
directory.

Supported architectures: ``llama`` (q/k rows permuted the llama.cpp way, undone here) and
``qwen2`` (no permutation, q/k/v biases).  Supported tensor types: whatever
``gguf.quants.dequantize`` implements (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants,
the IQ types, ...).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.models.hub import ModelFormatError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFInfo",
    "read_gguf",
    "supported_tensor_types",
    "build_config",
    "iter_hf_tensors",
    "load_gguf_state_dict",
    "write_safetensors",
    "convert_tokenizer",
    "convert_gguf",
    "hf_name_for",
    "permute_llama_qk",
    "unpermute_llama_qk",
]

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

_DTYPE_TO_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# GGUF per-block tensor name -> HF name inside model.layers.N.
_BLOCK_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_name_for(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its HF parameter name (None when unknown)."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, base, kind = m.groups()
        hf = _BLOCK_MAP.get(base)
        return None if hf is None else f"model.layers.{int(layer)}.{hf}.{kind}"
    m = _TOP_RE.match(gguf_name)
    if m:
        base, kind = m.groups()
        hf = _TOP_MAP.get(base)
        return None if hf is None else f"{hf}.{kind}"
    return None


def permute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> llama.cpp row order (what convert_hf_to_gguf.py does); used by tests."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp -> HF row order, per head (inverse of :func:`permute_llama_qk`)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelFormatError(
            f"cannot undo the llama.cpp q/k permutation: {rows} rows is not a multiple of 2*{n_head} heads; "
            "the GGUF head counts do not match its tensors (corrupt or unsupported file)."
        )
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def supported_tensor_types() -> set[str]:
    from gguf import GGMLQuantizationType
    from gguf import quants

    names = {GGMLQuantizationType.F32.name, GGMLQuantizationType.F16.name}
    names.update(t.name for t in getattr(quants, "_type_traits", {}))
    return names


# --------------------------------------------------------------------------- reading


@dataclass
class GGUFInfo:
    path: pathlib.Path
    reader: object  # gguf.GGUFReader
    arch: str
    meta: dict = field(default_factory=dict)

    def get(self, key: str, default=None):
        return self.meta.get(key, default)

    def arch_get(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)


def _field_value(f):
    from gguf import GGUFValueType

    try:
        return f.contents()
    except Exception:  # very old/odd fields: fall back to raw parts
        if f.types and f.types[0] == GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
        return None


_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def read_gguf(path: str | os.PathLike, *, check_arch: bool = True) -> GGUFInfo:
    """Open and validate a GGUF file (header, metadata, tensor extents, architecture)."""
    import gguf

    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(
            f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF'). "
            "Pass a .gguf model file, or an HF model directory containing config.json."
        )
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # struct errors, numpy errors, ValueError on truncated data
        raise ModelFormatError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it is probably truncated or "
            "corrupt. Delete it and download it again."
        ) from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelFormatError(
                f"{path} is truncated: tensor {t.name!r} needs bytes {t.data_offset}..{t.data_offset + t.n_bytes} "
                f"but the file has {size} bytes. Delete it and download it again."
            )
    meta = {}
    for k, f in reader.fields.items():
        if k in _BIG_ARRAYS:
            continue
        meta[k] = _field_value(f)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{path} has no general.architecture metadata; it is not a model GGUF file.")
    info = GGUFInfo(path=path, reader=reader, arch=arch, meta=meta)
    if check_arch:
        check_supported(info)
    return info


def check_supported(info: GGUFInfo) -> None:
    if info.arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(
            f"{info.path.name}: GGUF architecture {info.arch!r} is not supported; supported architectures: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}. Use a model of a supported architecture, or an HF "
            "directory (config.json + safetensors)."
        )
    ok = supported_tensor_types()
    bad = sorted({t.tensor_type.name for t in info.reader.tensors if t.tensor_type.name not in ok})
    if bad:
        raise ModelFormatError(
            f"{info.path.name}: tensor type(s) {', '.join(bad)} cannot be dequantized by the installed gguf "
            f"package; supported types: {', '.join(sorted(ok))}. Use another quantization of the model, or "
            "upgrade the `gguf` package."
        )
    names = {t.name for t in info.reader.tensors}
    unknown = sorted(n for n in names if hf_name_for(n) is None)
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise ModelFormatError(
            f"{info.path.name}: unsupported tensor(s) for a plain {info.arch} model: {shown}. "
            "(e.g. rope_freqs = llama3-style RoPE scaling is not supported.)"
        )
    for needed in ("token_embd.weight", "output_norm.weight"):
        if needed not in names:
            raise ModelFormatError(f"{info.path.name}: required tensor {needed!r} is missing; the file is incomplete.")


# --------------------------------------------------------------------------- config


def _int(v):
    if isinstance(v, (list, tuple)):
        vals = set(v)
        if len(vals) != 1:
            raise ModelFormatError(f"per-layer head counts {v} are not supported (all layers must match)")
        v = v[0]
    return None if v is None else int(v)


def build_config(info: GGUFInfo, dtype: torch.dtype = torch.float32) -> dict:
    """HF config.json content from GGUF metadata."""
    a = info.arch_get
    names = {t.name: t for t in info.reader.tensors}
    emb = names["token_embd.weight"]
    hidden = _int(a("embedding_length")) or int(emb.shape[0])
    n_layers = _int(a("block_count"))
    if n_layers is None:
        n_layers = 1 + max(int(m.group(1)) for n in names if (m := _BLOCK_RE.match(n)))
    n_head = _int(a("attention.head_count"))
    if not n_head:
        raise ModelFormatError(f"{info.path.name}: missing {info.arch}.attention.head_count metadata")
    n_kv = _int(a("attention.head_count_kv")) or n_head
    head_dim = _int(a("attention.key_length")) or hidden // n_head
    ffn = _int(a("feed_forward_length"))
    if ffn is None:
        ffn = int(names["blk.0.ffn_gate.weight"].shape[1])
    vocab = int(emb.shape[1])
    tied = "output.weight" not in names
    ctx = _int(a("context_length")) or 4096
    eps = float(a("attention.layer_norm_rms_epsilon", 1e-6))
    theta = float(a("rope.freq_base", 10000.0))

    cfg: dict = {
        "architectures": [SUPPORTED_ARCHITECTURES[info.arch]],
        "model_type": info.arch,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "max_position_embeddings": ctx,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "torch_dtype": DTYPE_NAMES[dtype],
        "use_cache": True,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
    }
    rtype = a("rope.scaling.type")
    if rtype and rtype != "none":
        factor = float(a("rope.scaling.factor", 1.0))
        rs = {"rope_type": rtype, "type": rtype, "factor": factor}
        orig = a("rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = int(orig)
        if rtype not in ("linear", "yarn"):
            raise ModelFormatError(f"{info.path.name}: RoPE scaling type {rtype!r} is not supported (linear, yarn)")
        cfg["rope_scaling"] = rs
    if info.arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
        cfg["mlp_bias"] = False
        cfg["pretraining_tp"] = 1
    elif info.arch == "qwen2":
        swa = a("attention.sliding_window")
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = int(swa) if swa else ctx
        cfg["max_window_layers"] = n_layers
    for gkey, hkey in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("padding_token_id", "pad_token_id")):
        v = info.get(f"tokenizer.ggml.{gkey}")
        if v is not None:
            cfg[hkey] = int(v)
    return cfg


def build_generation_config(info: GGUFInfo, cfg: dict) -> dict:
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = info.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    gen: dict = {"_from_model_config": False}
    if "bos_token_id" in cfg:
        gen["bos_token_id"] = cfg["bos_token_id"]
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "pad_token_id" in cfg:
        gen["pad_token_id"] = cfg["pad_token_id"]
    return gen


# --------------------------------------------------------------------------- tensors


def _tensor_plan(info: GGUFInfo) -> list[tuple[str, object, tuple[int, ...]]]:
    """[(hf_name, reader_tensor, hf_shape)] in file order."""
    plan = []
    for t in info.reader.tensors:
        hf = hf_name_for(t.name)
        if hf is None:  # check_supported already rejected these
            raise ModelFormatError(f"{info.path.name}: unsupported tensor {t.name!r}")
        shape = tuple(int(x) for x in reversed([int(s) for s in t.shape]))
        # GGUF stores 1-D tensors with shape [n]; keep as is.
        plan.append((hf, t, shape))
    return plan


def _dequant_one(info: GGUFInfo, t, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ModelFormatError(f"{info.path.name}: tensor {t.name}: {e}") from None
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if info.arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
        n_head = _int(info.arch_get("attention.head_count"))
        if ".attn_k." in t.name:
            n_head = _int(info.arch_get("attention.head_count_kv")) or n_head
        arr = unpermute_llama_qk(arr, n_head)
    if np.may_share_memory(arr, t.data) or not arr.flags.c_contiguous:
        arr = np.array(arr, dtype=np.float32, order="C")  # F32 tensors come back as views of the read-only memmap
    ten = torch.from_numpy(arr)
    if dtype != torch.float32:
        ten = ten.to(dtype)
    return ten


def iter_hf_tensors(info: GGUFInfo, dtype: torch.dtype = torch.float32, *, workers: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) in file order, dequantized (in a small thread pool) and cast to dtype."""
    plan = _tensor_plan(info)
    if workers <= 1:
        for hf, t, shape in plan:
            yield hf, _dequant_one(info, t, shape, dtype)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = []
        it = iter(plan)
        for hf, t, shape in it:  # keep `workers` tensors in flight, yield in order
            pending.append((hf, pool.submit(_dequant_one, info, t, shape, dtype)))
            if len(pending) >= workers:
                name, fut = pending.pop(0)
                yield name, fut.result()
        for name, fut in pending:
            yield name, fut.result()


def load_gguf_state_dict(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Whole HF state dict of a GGUF file in memory (no caching)."""
    info = read_gguf(path)
    return dict(iter_hf_tensors(info, dtype))


def write_safetensors(
    path: str | os.PathLike,
    entries: list[tuple[str, tuple[int, ...]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    *,
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
) -> int:
    """Stream tensors into a safetensors file without holding them all in memory.

    ``entries`` (name, shape) fixes the header up front; ``tensors`` must then yield the same
    names in the same order.  Returns the file size.  Data is fsync'ed before returning.
    """
    st = _DTYPE_TO_ST[dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    for name, shape in entries:
        n = int(np.prod(shape)) * esize
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 8)
    total = 8 + len(hb) + off
    expected = iter(entries)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, ten in tensors:
            ename, eshape = next(expected)
            if name != ename or tuple(ten.shape) != tuple(eshape) or ten.dtype != dtype:
                raise RuntimeError(f"safetensors writer: got {name} {tuple(ten.shape)} {ten.dtype}, expected {ename} {eshape}")
            buf = ten.contiguous().view(torch.uint8).numpy()
            f.write(memoryview(buf))
            if on_tensor is not None:
                on_tensor(name, buf.nbytes)
        if next(expected, None) is not None:
            raise RuntimeError("safetensors writer: fewer tensors than announced")
        f.flush()
        os.fsync(f.fileno())
    return total


# --------------------------------------------------------------------------- tokenizer


def convert_tokenizer(gguf_path: str | os.PathLike, out_dir: str | os.PathLike):
    """Build the tokenizer from the GGUF metadata (transformers' converter) and save it to out_dir."""
    from transformers import AutoTokenizer

    gguf_path = pathlib.Path(gguf_path)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelFormatError(
            f"{gguf_path.name}: could not build a tokenizer from the GGUF metadata ({type(e).__name__}: {e})."
        ) from None
    # GGUF files carry the chat template in tokenizer.chat_template; make sure it survived.
    if not getattr(tok, "chat_template", None):
        tmpl = _read_chat_template(gguf_path)
        if tmpl:
            tok.chat_template = tmpl
    tok.save_pretrained(str(out_dir))
    return tok


def _read_chat_template(gguf_path: pathlib.Path) -> str | None:
    import gguf

    r = gguf.GGUFReader(str(gguf_path), "r")
    f = r.fields.get("tokenizer.chat_template")
    return None if f is None else _field_value(f)


# --------------------------------------------------------------------------- driver


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    *,
    progress: bool = True,
    info: GGUFInfo | None = None,
) -> dict[str, int]:
    """Convert ``gguf_path`` into ``out_dir`` (must exist, should be empty).

    Writes config.json, generation_config.json, model.safetensors and the tokenizer files.
    Returns {file name: size} of everything written.  Not atomic by itself: callers write
    into a temporary directory and rename it into place (see tandem.models.hub).
    """
    if dtype not in _DTYPE_TO_ST:
        raise ModelFormatError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    out = pathlib.Path(out_dir)
    info = info or read_gguf(gguf_path)
    cfg = build_config(info, dtype)
    plan = _tensor_plan(info)
    entries = [(hf, shape) for hf, _, shape in plan]
    if len({hf for hf, _ in entries}) != len(entries):
        raise ModelFormatError(f"{info.path.name}: duplicate tensors after name mapping")

    # Tokenizer first: it is quick and fails early on odd metadata.
    convert_tokenizer(info.path, out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(build_generation_config(info, cfg), indent=2) + "\n")

    from tqdm.auto import tqdm

    total_bytes = sum(int(np.prod(s)) for _, s in entries) * torch.empty((), dtype=dtype).element_size()
    bar = tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc=f"converting {info.path.name}", disable=not progress, leave=False
    )
    try:
        write_safetensors(
            out / "model.safetensors",
            entries,
            iter_hf_tensors(info, dtype),
            dtype,
            metadata={"format": "pt", "source": info.path.name, "converted_by": "tandem"},
            on_tensor=lambda _n, nb: bar.update(nb),
        )
    finally:
        bar.close()
    return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
