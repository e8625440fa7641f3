"""Build a CausalLM from a model directory (safetensors) or with seeded dummy weights."""
from __future__ import annotations

import glob
import json
import logging
import os
import pathlib

import torch
from safetensors import SafetensorError, safe_open

from tandem.config import ModelConfig
from tandem.errors import ConfigError
from tandem.kernels import cpu_build
from tandem.layers.cpu_linear import cpu_linear_kind, prepare_linears, runs_fp8_bytes
from tandem.layers.gpu_linear import prepare_gpu_linears
from tandem.layers.quant import quantize_linears_
from tandem.models.decoder import CausalLM
from tandem.models.registry import model_class
from tandem.parallel.group import TPGroup
from tandem.parallel.shard import PACKED_FROM, packed_rows, read_rank_part, shard_arch, shard_param
from tandem.oom import OutOfMemoryGuard, check_weights_fit

logger = logging.getLogger("tandem")

# Checkpoint entries that are recomputed, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors dtype names of the weights read

# Checkpoint projection -> (our packed parameter, shard index); shards are stacked along dim 0.
PACKED = {part: (packed, i) for packed, parts in PACKED_FROM.items() for i, part in enumerate(parts)}


def _packed_target(name: str) -> tuple[str, str, int] | None:
    """'model.layers.3.self_attn.k_proj.bias' -> ('model.layers.3.self_attn.qkv_proj.bias', 'qkv_proj', 1)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in PACKED:
        packed, shard = PACKED[parts[-2]]
        return ".".join(parts[:-2] + [packed, parts[-1]]), packed, shard
    return None


def load_model(cfg: ModelConfig, device: torch.device, field: str = "model", dtype_field: str = "dtype",
               tp: TPGroup | None = None, head_ids: list[int] | None = None) -> CausalLM:
    """Instantiate the model without initialising it, then fill every parameter once.

    field, dtype_field: the settings that chose the model and its dtype, named by the ConfigError
    raised for weights that cannot fit on the GPU or that run it out of memory while loading.
    tp: this rank's tensor-parallel group: the model holds the rank's shard of each weight
    (tandem.parallel.shard), and only that part of a checkpoint tensor is read from its file
    (dummy weights are drawn whole, then cut: the same model whatever the number of ranks).
    head_ids: a pruned LM head (a draft's hot vocabulary, tandem/spec/hot_vocab.py): the head keeps
    only these rows, in this order, as its own weight (a tied head is cut from the embedding table,
    which stays whole); compute_logits then gives [n, len(head_ids)]."""
    what = f"{field}={cfg.path!r} in {str(cfg.dtype).removeprefix('torch.')}"
    fix = f"use a smaller {field}, or a smaller {dtype_field}"
    if tp is not None:
        fix += f", or a larger tensor_parallel_size than {tp.size}"
    rope_bytes = 2 * cfg.max_model_len * cfg.arch.head_dim * 4  # the fp32 cos / sin tables, a row a position
    if rope_bytes > 2**28:
        fix += (f", or a smaller max_model_len (its {cfg.max_model_len} positions' rotary tables alone take "
                f"{rope_bytes / 2**30:.1f} GiB)")
    with OutOfMemoryGuard(device, f"loading the weights of {what}", fix):
        # nothing of it referenced here: an error releases it all
        return _build(cfg, device, what, fix, field, tp, head_ids)


def _build(cfg: ModelConfig, device: torch.device, what: str, fix: str, field: str, tp: TPGroup | None,
           head_ids: list[int] | None = None) -> CausalLM:
    cls = model_class(cfg.arch)
    with torch.device("meta"):
        model = cls(shard_arch(cfg.arch, tp.size) if tp is not None else cfg.arch, cfg.max_model_len,
                    rope_device=device, tp=tp)
        whole = model if tp is None else cls(cfg.arch, cfg.max_model_len, rope_device="meta")
    check_weights_fit(sum(p.numel() for p in model.parameters()) * cfg.dtype.itemsize, device, what, fix)
    params = dict(whole.named_parameters())  # the checkpoint's shapes; tied weights appear once
    if cfg.load_format == "dummy":
        tensors = _dummy_tensors(params, cfg, device)
        if tp is not None:
            tensors = {name: shard_param(name, t, cfg.arch, tp.rank, tp.size) for name, t in tensors.items()}
    else:
        local = dict(model.named_parameters())
        tensors = _read_safetensors(params, cfg, device, field, local, (tp.rank, tp.size) if tp is not None else None)
    if tp is not None and cfg.arch.tie_word_embeddings:  # the head: the rank's vocabulary rows of the embedding table
        tensors["lm_head.weight"] = shard_param("lm_head.weight", tensors["model.embed_tokens.weight"], cfg.arch,
                                                tp.rank, tp.size)
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    del tensors
    if cfg.arch.tie_word_embeddings and tp is None:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    model.requires_grad_(False)
    kind = cpu_linear_kind(cfg.cpu_matmul, device, cfg.dtype) if device.type != "cuda" else None
    if cfg.quantization is not None:  # (before a head is pruned: a tied embedding keeps the rounded values)
        quantize_linears_(model, cfg.quantization, lm_head=cfg.fp8_draft_layout,
                          in_place=kind is None or not runs_fp8_bytes(kind), tp=tp)
    if head_ids is not None:
        assert tp is None, "a pruned head is not sharded (SpeculatorFactory refuses it)"
        rows = torch.tensor(head_ids, dtype=torch.int64, device=device)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.index_select(0, rows), requires_grad=False)
        model.lm_head.out_features = len(head_ids)
    if device.type == "cuda":
        prepare_gpu_linears(model, cfg.dtype, keep_weights=cfg.fp8_draft_layout, invariant=cfg.batch_invariant)
    else:
        prepare_linears(model, kind, chosen=cfg.cpu_matmul != "auto")
        if kind in cpu_build.ISAS:
            use_cpu_kernels(model, kind)
    if cfg.quantization is not None and any(isinstance(m, torch.nn.Linear) and getattr(m, "fp8_weights", False)
                                            for m in model.modules()):
        logger.info("quantization=%r, %s on %s: the linears' weights are rounded to fp8 values but keep their bytes "
                    "(fp8 bytes need bf16 / fp16 and, on a CPU, cpu_matmul 'auto' or 'avx2' / 'avx512')",
                    cfg.quantization, str(cfg.dtype).removeprefix("torch."), device.type)
    return model


def use_cpu_kernels(model: torch.nn.Module, isa: str) -> None:
    """Route the CPU path of every module that declares `cpu_isa` (norms, rotary, attention, the
    MLP's activation) through that build of tandem's C kernels (tandem.kernels.cpu_rows and
    cpu_attention), beside its GEMM."""
    for module in model.modules():
        if hasattr(type(module), "cpu_isa"):
            module.cpu_isa = isa


def _weight_files(cfg: ModelConfig, field: str) -> list[str]:
    """The safetensors files to read: those model.safetensors.index.json names when it exists (a
    folder may hold other copies, e.g. Mistral's consolidated.safetensors), else every one."""
    index = os.path.join(cfg.path, "model.safetensors.index.json")
    if not os.path.exists(index):
        found = sorted(glob.glob(os.path.join(cfg.path, "*.safetensors")))
        dangling = [p for p in found if os.path.islink(p) and not os.path.exists(p)]  # a broken or looping link
        if dangling:
            raise ConfigError(f"{field}: {dangling[0]} is not a readable file (a broken link?); re-download it")
        return [p for p in found if os.path.isfile(p)]  # (a folder of that name is no weight file)
    try:
        weight_map = json.loads(pathlib.Path(index).read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        bad = next((n for n in names if not isinstance(n, str) or not n), None)
        if bad is not None:
            raise TypeError(f"its weight_map names the file {bad!r}")
        if not names:
            raise TypeError("its weight_map names no file")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{field}: {index} is not a valid safetensors index ({type(e).__name__}: {e}); "
                          "re-download it") from None
    missing = [n for n in names if not os.path.isfile(os.path.join(cfg.path, n))]
    if missing:
        raise ConfigError(f"{field}: {cfg.path} lacks the weight files {missing[:3]} that its "
                          "model.safetensors.index.json names; re-download them")
    return [os.path.join(cfg.path, n) for n in names]


def _read_safetensors(params: dict, cfg: ModelConfig, device: torch.device, field: str = "model",
                      local: dict | None = None, cut: tuple[int, int] | None = None) -> dict:
    """params: the checkpoint's parameters (names and whole shapes, checked against each file);
    local, cut: under tensor parallelism, the rank's parameters and (rank, size): each tensor is
    read only in the part the rank keeps (tandem.parallel.shard.read_rank_part)."""
    files = _weight_files(cfg, field)
    if not files:
        pickled = glob.glob(os.path.join(cfg.path, "*.bin")) + glob.glob(os.path.join(cfg.path, "*.pt"))
        ggufs = sorted(glob.glob(os.path.join(cfg.path, "*.gguf")))
        if ggufs:  # a GGUF repository's folder (many ship a config.json beside the files)
            raise ConfigError(f"{field}: {cfg.path} holds GGUF weights, no *.safetensors; pass the .gguf file "
                              f"itself (e.g. {ggufs[0]})")
        fix = ("convert them to safetensors (transformers: save_pretrained(..., safe_serialization=True))"
               if pickled else "load_format='dummy' gives random weights of the same shapes")
        raise ConfigError(f"{field}: no *.safetensors files in {cfg.path}"
                          + (f" (only pickled weights: {os.path.basename(pickled[0])})" if pickled else "")
                          + f"; {fix}")
    loaded: dict[str, torch.Tensor] = {}
    shards_seen: dict[str, set[int]] = {}
    for path in files:
        try:
            _read_file(path, params, cfg, device, loaded, shards_seen, field, local, cut)
        except (SafetensorError, OSError) as e:
            if os.path.exists(path) and not os.access(path, os.R_OK):
                raise ConfigError(f"{field}: {path} could not be read (permission denied); make it readable") from None
            raise ConfigError(f"{field}: {path} is not a valid safetensors file ({e}); re-download or re-convert "
                              "it") from None
    for target, seen in shards_seen.items():
        kind = target.split(".")[-2]
        if len(seen) != len(packed_rows(kind, cfg.arch)):
            raise ConfigError(f"{field}: {cfg.path} lacks some of the projections packed into {target!r}")
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ConfigError(f"{field}: {cfg.path} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return loaded


def _read_file(path: str, params: dict, cfg: ModelConfig, device: torch.device, loaded: dict,
               shards_seen: dict[str, set[int]], field: str = "model", local: dict | None = None,
               cut: tuple[int, int] | None = None) -> None:
    """One safetensors file's tensors into loaded (packed projections: their rows, in shards_seen).
    A tensor met twice (in two files) is refused: which copy is right cannot be told. local, cut:
    see _read_safetensors."""
    local = local or params

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if cut is None:
            return f.get_tensor(name)
        return read_rank_part(name, f.get_slice(name), shape, *cut)

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            part = f.get_slice(name)
            shape = tuple(part.get_shape())
            if part.get_dtype() not in _FLOAT_DTYPES:  # integers, bools, fp8 without its scales: not weights we read
                raise ConfigError(f"{field}: tensor {name!r} in {path} is stored as {part.get_dtype()}; expected "
                                  f"floating point ({', '.join(sorted(_FLOAT_DTYPES))}): re-convert the checkpoint")
            packed = _packed_target(name)
            if packed is not None and packed[0] in params:
                target, kind, shard = packed
                rows = packed_rows(kind, cfg.arch)
                want = (rows[shard],) + tuple(params[target].shape[1:])
                if shape != want:
                    raise ConfigError(f"{field}: tensor {name!r} has shape {shape} in {path}, the "
                                      f"config implies {want}")
                if shard in shards_seen.get(target, ()):
                    raise ConfigError(f"{field}: tensor {name!r} appears twice (again in {path}); remove the stray "
                                      "weight file")
                if target not in loaded:
                    loaded[target] = torch.empty(local[target].shape, dtype=cfg.dtype, device=device)
                mine = packed_rows(kind, shard_arch(cfg.arch, cut[1] if cut else 1))  # the rank's rows of each
                start = sum(mine[:shard])
                loaded[target][start : start + mine[shard]].copy_(read(name, shape))
                shards_seen.setdefault(target, set()).add(shard)
                continue
            if name not in params:
                if name == "lm_head.weight" and cfg.arch.tie_word_embeddings:
                    continue
                raise ConfigError(f"{field}: unexpected tensor {name!r} in {path}")
            if name in loaded:
                raise ConfigError(f"{field}: tensor {name!r} appears twice (again in {path}); remove the stray "
                                  "weight file")
            param = params[name]
            if shape != tuple(param.shape):
                raise ConfigError(
                    f"{field}: tensor {name!r} has shape {shape} in {path}, "
                    f"the config implies {tuple(param.shape)}"
                )
            loaded[name] = read(name, shape).to(device=device, dtype=cfg.dtype)


def _dummy_tensors(params: dict, cfg: ModelConfig, device: torch.device) -> dict:
    """Seeded random weights with the real shapes: no file is read."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    out = {}
    for name, param in params.items():
        data = torch.empty(param.shape, dtype=cfg.dtype, device=device)
        if name.endswith("norm.weight"):
            data.fill_(1.0)
        else:
            data.normal_(0.0, 0.02, generator=gen)
        out[name] = data
    return out
