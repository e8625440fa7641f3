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
import math
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
    "GGUFTensor",
    "DTYPE_NAMES",
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
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order (fastest-moving dimension first), like gguf.GGUFReader
    tensor_type: object  # gguf.GGMLQuantizationType
    offset: int  # absolute offset in the file
    n_bytes: int
    _map: np.ndarray | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def data(self) -> np.ndarray:
        """The raw bytes as a read-only uint8 view, shaped (rows..., bytes per row)."""
        from gguf.quants import quant_shape_to_byte_shape

        raw = self._map[self.offset : self.offset + self.n_bytes]
        return raw.reshape(quant_shape_to_byte_shape(self.hf_shape, self.tensor_type))


@dataclass
class GGUFInfo:
    path: pathlib.Path
    arch: str
    meta: dict = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)
    file_size: int = 0

    def get(self, key: str, default=None):
        return self.meta.get(key, default)

    def arch_get(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)


@dataclass(frozen=True)
class StringArray:
    """A long string array in the metadata (vocabulary, merges), left unread."""

    count: int


# GGUF metadata value types
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_STRINGS = 256  # string arrays up to this length are read, longer ones only counted


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals

    def string(self) -> str:
        (n,) = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise EOFError("string runs past the end of the file")
        v = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return v

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack, end = self.buf, self.pos, struct.unpack_from, len(self.buf)
        for _ in range(count):
            pos += 8 + unpack("<Q", buf, pos)[0]
            if pos > end:  # (a damaged length would take the next read past what an offset can hold)
                raise EOFError("string array runs past the end of the file")
        self.pos = pos

    def value(self, vtype: int, keep_long_strings: bool = False):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("IQ")
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                vals = np.frombuffer(self.buf, dtype="<" + {"?": "b1"}.get(fmt, fmt), count=count, offset=self.pos)
                self.pos += vals.nbytes
                return vals.tolist() if count <= _KEEP_STRINGS else vals.copy()
            if etype == _STRING:
                if count <= _KEEP_STRINGS or keep_long_strings:
                    return [self.string() for _ in range(count)]
                self.skip_strings(count)
                return StringArray(count)
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")


def _open_map(path: pathlib.Path) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r")


def read_gguf(path: str | os.PathLike, *, check_arch: bool = True) -> GGUFInfo:
    """Open and validate a GGUF file: header, metadata, tensor table and extents, architecture.

    A small pure-Python parser (the gguf package's GGUFReader spends ~20 s building numpy
    views of a 150k-token vocabulary that conversion never needs).
    """
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(
            f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF'). "
            "Pass a .gguf model file, or an HF model directory containing config.json."
        )
    corrupt = (
        f"{path} is truncated or corrupt ({{}}). Delete it and download it again, or check the file you passed."
    )
    mm = _open_map(path)
    cur = _Cursor(mm)
    try:
        _, version = cur.unpack("4sI")
        if version not in (2, 3):
            if version in (0x02000000, 0x03000000):
                raise ModelFormatError(f"{path} is a big-endian GGUF file; only little-endian files are supported.")
            raise ModelFormatError(f"{path}: GGUF version {version} is not supported (versions 2 and 3 are).")
        n_tensors, n_kv = cur.unpack("QQ")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ValueError(f"implausible header counts ({n_tensors} tensors, {n_kv} metadata keys)")
        meta: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("I")
            meta[key] = cur.value(vtype)
        raw_tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = cur.unpack(f"{n_dims}Q")
            ttype, off = cur.unpack("IQ")
            raw_tensors.append((name, tuple(int(d) for d in dims), ttype, off))
    except ModelFormatError:
        raise
    except (struct.error, EOFError, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise ModelFormatError(corrupt.format(f"bad header: {e}")) from None

    align = int(meta.get("general.alignment", 32) or 32)
    data_start = (cur.pos + align - 1) // align * align
    tensors = []
    expected = 0  # where the next tensor must start: right after the last one, aligned (llama.cpp's rule)
    for name, dims, ttype, off in raw_tensors:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise ModelFormatError(
                f"{path.name}: tensor {name!r} has unknown ggml type id {ttype}; supported types: "
                f"{', '.join(sorted(supported_tensor_types()))}. Upgrade the `gguf` package or use another file."
            ) from None
        block, tsize = GGML_QUANT_SIZES[qtype]
        n_el = math.prod(dims)  # (exact: numpy's int64 product wraps around for a damaged dimension)
        if n_el % block or (dims and dims[0] % block):
            raise ModelFormatError(corrupt.format(f"tensor {name!r} shape {dims} does not fit {qtype.name} blocks"))
        nbytes = n_el // block * tsize
        if off != expected:  # (a wrong type or shape: the tensor would read into its neighbour, or leave a gap)
            raise ModelFormatError(corrupt.format(
                f"tensor {name!r} ({qtype.name}, shape {dims}) starts at data offset {off}, but the tensors before it "
                f"end at {expected}"))
        expected += (nbytes + align - 1) // align * align
        start = data_start + off
        if start + nbytes > size:
            raise ModelFormatError(
                f"{path} is truncated: tensor {name!r} needs bytes {start}..{start + nbytes} but the file has {size} "
                "bytes. Delete it and download it again."
            )
        tensors.append(GGUFTensor(name, dims, qtype, start, nbytes, mm))
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{path} has no general.architecture metadata; it is not a model GGUF file.")
    info = GGUFInfo(path=path, arch=arch, meta=meta, tensors=tensors, file_size=size)
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
    bad = sorted({t.tensor_type.name for t in info.tensors if t.tensor_type.name not in ok})
    if bad:
        raise ModelFormatError(
            f"{info.path.name}: tensor type(s) {', '.join(bad)} cannot be dequantized by the installed gguf "
            f"package; supported types: {', '.join(sorted(ok))}. Use another quantization of the model, or "
            "upgrade the `gguf` package."
        )
    names = {t.name for t in info.tensors}
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
    layers = {int(m.group(1)) for n in names if (m := _BLOCK_RE.match(n))}
    n_layers = _int(info.arch_get("block_count"))
    found = 1 + max(layers, default=-1)
    if n_layers is not None and n_layers > found:  # (a damaged count would list millions of missing names)
        raise ModelFormatError(f"{info.path.name}: its metadata says {info.arch}.block_count={n_layers} but its "
                               f"tensors hold {found} layers; the file is incomplete or corrupt (re-download or "
                               "re-convert it).")
    n_layers = n_layers if n_layers is not None else found
    per_layer = [f"{base}.weight" for base in _BLOCK_MAP]
    if info.arch == "qwen2":  # its q, k and v projections always carry biases
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    missing = [f"blk.{i}.{t}" for i in range(n_layers) for t in per_layer if f"blk.{i}.{t}" not in names]
    if missing:  # refused before anything is converted (the converted copy would be cached, and fail to load)
        shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelFormatError(f"{info.path.name}: required tensor(s) {shown} of its {n_layers} layers are missing; the "
                               "file is incomplete (re-download or re-convert it).")


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
    names = {t.name: t for t in info.tensors}
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
    rot = _int(a("rope.dimension_count"))
    if rot is not None and rot != head_dim:
        raise ModelFormatError(f"{info.path.name}: {info.arch}.rope.dimension_count={rot} rotates part of each "
                               f"head (head_dim {head_dim}); partial rotary embeddings are not supported")
    # As llama.cpp reads it: the factor under rope.scaling.factor, else the older rope.scale_linear,
    # and the type linear unless rope.scaling.type names another (early converters wrote the factor alone).
    factor = a("rope.scaling.factor")
    factor = float(a("rope.scale_linear", 0.0) if factor is None else factor) or 1.0
    rtype = a("rope.scaling.type") or ("linear" if factor != 1.0 else None)
    if rtype and rtype != "none":
        rs = {"rope_type": rtype, "type": rtype, "factor": factor}
        orig = a("rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = int(orig)
        if rtype != "linear":  # the rope types tandem runs (tandem.config.ROPE_TYPES) that GGUF describes
            raise ModelFormatError(f"{info.path.name}: RoPE scaling type {rtype!r} is not supported (linear)")
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


def _check_shapes(info: GGUFInfo, cfg: dict, plan: list[tuple[str, object, tuple[int, ...]]]) -> None:
    """Every tensor's shape as the metadata (the config built from it) implies, refused before
    anything is converted: the loader would refuse the converted copy, cached by then, naming it."""
    hidden, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    rows_cols = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                 "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden),
                 "mlp.down_proj": (hidden, ffn), "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
                 "model.embed_tokens": (vocab, hidden), "model.norm": (hidden,), "lm_head": (vocab, hidden)}
    for hf, t, shape in plan:
        module, kind = re.sub(r"^model\.layers\.\d+\.", "", hf).rsplit(".", 1)
        want = rows_cols[module] if kind == "weight" else rows_cols[module][:1]
        if shape != want:
            raise ModelFormatError(
                f"{info.path.name}: tensor {t.name!r} has shape {shape} (rows, columns), but its metadata "
                f"({info.arch}.embedding_length, feed_forward_length, attention.head_count and the vocabulary) "
                f"implies {want}; the file is corrupt (re-download or re-convert it).")


def _tensor_plan(info: GGUFInfo) -> list[tuple[str, object, tuple[int, ...]]]:
    """[(hf_name, GGUFTensor, hf_shape)] in file order."""
    plan = []
    for t in info.tensors:
        hf = hf_name_for(t.name)
        if hf is None:  # check_supported already rejected these
            raise ModelFormatError(f"{info.path.name}: unsupported tensor {t.name!r}")
        plan.append((hf, t, t.hf_shape))
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
        try:
            arr = unpermute_llama_qk(arr, n_head)
        except ModelFormatError as e:
            raise ModelFormatError(f"{info.path.name}: tensor {t.name}: {e}") from None
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


def _tokenizer_class(arch: str):
    """The class AutoTokenizer would pick for a GGUF of this architecture, without its slow config pass.

    (AutoTokenizer.from_pretrained(gguf_file=...) first builds the model config through the gguf package's
    GGUFReader, which takes ~20 s on a 150k-token vocabulary; the tokenizer itself needs ~1 s.)
    """
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    name = TOKENIZER_MAPPING_NAMES.get(arch)
    cls = tokenizer_class_from_name(name) if name else TokenizersBackend
    if cls is None:
        raise LookupError(f"no tokenizer class for {arch}")
    return cls


def convert_tokenizer(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    *,
    arch: str | None = None,
    tokenizer_model: str | None = None,
    chat_template: str | None = None,
    model_max_length: int | None = None,
):
    """Build the tokenizer from the GGUF metadata (transformers' GGUF converter) and save it to out_dir.

    Never touches a hub: the GGUF holds the vocabulary, merges, special tokens and chat template.
    """
    gguf_path = pathlib.Path(gguf_path)
    folder, fname = str(gguf_path.parent), gguf_path.name
    tok = None
    if arch in ("llama", "qwen2") and tokenizer_model == "gpt2":  # the combinations checked to match AutoTokenizer
        try:
            tok = _tokenizer_class(arch).from_pretrained(folder, gguf_file=fname, local_files_only=True)
        except Exception:  # transformers internals moved: take the documented (slower) route below
            tok = None
    if tok is None:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        except Exception as e:
            raise ModelFormatError(
                f"{fname}: could not build a tokenizer from the GGUF metadata ({type(e).__name__}: {e})."
            ) from None
    # GGUF files carry the chat template in tokenizer.chat_template; make sure it survived.
    if not getattr(tok, "chat_template", None) and isinstance(chat_template, str):
        tok.chat_template = chat_template
    if model_max_length:
        tok.model_max_length = int(model_max_length)
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok


# --------------------------------------------------------------------------- driver


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    *,
    progress: bool = True,
    info: GGUFInfo | None = None,
    weights: bool = True,
) -> dict[str, int]:
    """Convert ``gguf_path`` into ``out_dir`` (must exist, should be empty).

    Writes config.json, generation_config.json, model.safetensors (not with weights=False: the
    shapes alone, for dummy weights) and the tokenizer files.
    Returns {file name: size} of everything written.  Not atomic by itself: callers write
    into a temporary directory and rename it into place (see tandem.models.hub).
    """
    if dtype not in _DTYPE_TO_ST:
        raise ModelFormatError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    out = pathlib.Path(out_dir)
    info = info or read_gguf(gguf_path)
    cfg = build_config(info, dtype)
    plan = _tensor_plan(info)  # (an unknown tensor refused by name first)
    _check_shapes(info, cfg, plan)
    entries = [(hf, shape) for hf, _, shape in plan]
    if len({hf for hf, _ in entries}) != len(entries):
        raise ModelFormatError(f"{info.path.name}: duplicate tensors after name mapping")

    # Tokenizer first: it is quick and fails early on odd metadata.
    convert_tokenizer(
        info.path,
        out,
        arch=info.arch,
        tokenizer_model=info.get("tokenizer.ggml.model"),
        chat_template=info.get("tokenizer.chat_template"),
        model_max_length=cfg["max_position_embeddings"],
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(build_generation_config(info, cfg), indent=2) + "\n")
    if not weights:
        return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}

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
