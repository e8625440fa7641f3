"""Where a model comes from: a directory, a GGUF file or a known name; its tokenizer and EOS ids."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tandem.errors import ConfigError


def resolve_model_dir(model: str, dtype, load_format: str) -> Path:
    """A local HF directory, a .gguf file or a known model name -> a directory with config.json."""
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ConfigError(f"model={model!r} must be a path or a model name")
    try:
        from tandem.models.hub import resolve_model
    except ImportError:  # pragma: no cover - hub support not installed
        resolve_model = None
    path = Path(model)
    if path.is_dir() and (path / "config.json").exists():
        return path
    if resolve_model is not None:
        want = dtype if isinstance(dtype, torch.dtype) else {"float32": torch.float32, "float16": torch.float16}.get(
            dtype, torch.bfloat16
        )
        return Path(resolve_model(str(model), want))
    if not path.exists():
        raise ConfigError(f"model path {model!r} does not exist; pass a Hugging Face model directory")
    raise ConfigError(f"model: {model!r} has no config.json; pass a Hugging Face model directory")


def load_tokenizer(path):
    """AutoTokenizer from the directory, or None when it ships no tokenizer files."""
    path = Path(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if path.is_dir() and not any((path / n).exists() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(model_dir: Path, arch, tokenizer) -> tuple[int, ...]:
    ids = list(arch.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
