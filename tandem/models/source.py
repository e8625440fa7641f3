"""Where a model comes from: a directory, a GGUF file or a known name; its tokenizer and EOS ids."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from tandem.config import DTYPE_NAMES, half_dtype, read_json, token_ids_setting
from tandem.errors import ConfigError, RequestError
from tandem.sampling_params import SamplingParams


def resolve_model_dir(model: str, dtype, field: str = "model", device: torch.device | None = None,
                      weights: bool = True, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local HF directory, a .gguf file or a known model name -> a directory with config.json
    (converted to dtype; "auto": the half dtype the device runs, config.half_dtype). weights=False
    (dummy weights): its config and tokenizer suffice; a GGUF's tensors need not be converted.
    cache_dir: where fetched and converted models are kept (None: $TANDEM_CACHE, else ~/.cache/tandem)."""
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ConfigError(f"{field}={model!r} must be a path or a model name")
    try:
        from tandem.models.hub import resolve_model
    except ImportError:  # pragma: no cover - hub support not installed
        resolve_model = None
    path = Path(model)
    try:
        if path.is_dir() and (path / "config.json").exists():
            return path
    except OSError as e:  # a directory without permission, ...
        raise ConfigError(f"{field}={model!r} could not be read ({e.strerror or e}); check its permissions") from None
    if resolve_model is not None:
        # the dtype a GGUF file or known name is converted to ("auto": bfloat16, or float16 on a GPU
        # without it); aliases as their names
        want = dtype if isinstance(dtype, torch.dtype) else DTYPE_NAMES.get(dtype, half_dtype(device))
        try:
            return Path(resolve_model(str(model), want, weights=weights, cache_dir=cache_dir))
        except ConfigError as e:
            if field == "model":
                raise
            raise type(e)(f"{field}: {e}") from None  # say which of the two models it was
    if not path.exists():
        raise ConfigError(f"{field} path {model!r} does not exist; pass a Hugging Face model directory")
    raise ConfigError(f"{field}: {model!r} has no config.json; pass a Hugging Face model directory")


def load_tokenizer(path, field: str | None = None):
    """AutoTokenizer from the directory, or None when it ships no tokenizer files.

    field: the setting that named the path explicitly (`tokenizer`): then a path without tokenizer
    files is an error rather than "no tokenizer"."""
    path = Path(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    where = f"{field}={str(path)!r}" if field else f"the tokenizer in {path}"
    looks_local = path.is_absolute() or str(path).startswith((".", "~")) or str(path).count("/") > 1
    if field and not path.exists() and looks_local:  # not a hub id ("name" or "namespace/name") either
        raise ConfigError(f"{where} does not exist; pass the directory that holds tokenizer.json")
    if field and path.exists() and not path.is_dir():
        raise ConfigError(f"{where} is not a directory; pass the directory that holds tokenizer.json")
    if path.is_dir() and not any((path / n).exists() for n in names):
        if field:
            raise ConfigError(f"{where} holds no tokenizer files ({', '.join(names)})")
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds for broken files: name the files, keep the reason
        reason = f"{type(e).__name__}: {e}"
    if (path / "config.json").is_file():  # AutoTokenizer reads config.json too: transformers' checks of it
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(str(path))
        except Exception as e:
            raise ConfigError(f"{path / 'config.json'} does not pass transformers' checks, which loading the tokenizer "
                              f"runs ({type(e).__name__}: {e}); fix the field it names") from None
    raise ConfigError(f"{where} could not be loaded ({reason}); check or re-download its tokenizer files")


def eos_token_ids(model_dir: Path, arch, tokenizer) -> tuple[int, ...]:
    """Every token id that ends a request: the tokenizer's EOS first (the primary one, as vLLM's:
    a request it ends has no stop_reason), then config.json's and generation_config.json's others
    (vLLM adds those to stop_token_ids, so a request one of them ends reports its id as stop_reason)."""
    ids = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
    ids += arch.eos_token_ids
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        try:
            eos = read_json(gen, "model")["eos_token_id"]
        except (KeyError, TypeError):
            eos = None
        ids += token_ids_setting(eos, "model: eos_token_id", gen)
    return tuple(dict.fromkeys(ids))


# generation_config.json keys that set sampling defaults (vLLM's list) -> SamplingParams fields.
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(generation_config: str, model_dir: Path, override: dict | None = None) -> dict:
    """The sampling defaults the model's creator recommends, as SamplingParams fields: what
    generation_config.json sets among GENERATION_DEFAULT_KEYS ("auto": the model directory's file;
    a directory: its file; "vllm": none, the engine's own defaults), with override's keys (vLLM's
    override_generation_config: the same keys, set over the file's, or alone under "vllm")."""
    if not isinstance(generation_config, str) or not generation_config:
        raise ConfigError(f"generation_config={generation_config!r} must be 'auto', 'vllm' or a directory")
    override = check_generation_override(override) or {}
    set_here = {field: override[key] for key, field in GENERATION_DEFAULT_KEYS.items() if override.get(key) is not None}
    return {**_file_defaults(generation_config, model_dir), **set_here}


def check_generation_override(override: dict | None) -> dict | None:
    """override_generation_config, unchanged; ConfigError unless it is None or a dict of
    GENERATION_DEFAULT_KEYS."""
    if override is None:
        return None
    if not isinstance(override, dict):
        raise ConfigError(f"override_generation_config={override!r} must be a dict such as {{'temperature': 0.5}}")
    unknown = sorted(set(override) - set(GENERATION_DEFAULT_KEYS), key=repr)
    if unknown:
        raise ConfigError(f"override_generation_config sets {unknown}, which are not sampling defaults; use some "
                          f"of {sorted(GENERATION_DEFAULT_KEYS)}")
    try:  # its values as SamplingParams takes them (else every request would fail, blaming itself)
        SamplingParams(**{GENERATION_DEFAULT_KEYS[key]: value for key, value in override.items() if value is not None})
    except RequestError as e:
        raise ConfigError(f"override_generation_config sets an invalid sampling default: {e}") from None
    return override


def _file_defaults(generation_config: str, model_dir: Path) -> dict:
    if generation_config == "vllm":
        return {}
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not folder.is_dir():
        raise ConfigError(f"generation_config={generation_config!r} is not a directory; pass the directory that "
                          "holds generation_config.json, or 'auto' / 'vllm'")
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    data = read_json(path, "generation_config")
    if not isinstance(data, dict):
        raise ConfigError(f"generation_config: {path} must hold a JSON object")
    return {field: data[key] for key, field in GENERATION_DEFAULT_KEYS.items() if data.get(key) is not None}
