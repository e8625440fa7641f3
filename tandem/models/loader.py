"""Build a CausalLM from a model directory (safetensors) or with seeded dummy weights."""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open

from tandem.config import ModelConfig
from tandem.errors import ConfigError
from tandem.models.decoder import CausalLM
from tandem.models.registry import model_class

# Checkpoint entries that are recomputed, not loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(cfg: ModelConfig, device: torch.device) -> CausalLM:
    """Instantiate the model without initialising it, then fill every parameter once."""
    cls = model_class(cfg.arch)
    with torch.device("meta"):
        model = cls(cfg.arch, cfg.max_model_len, rope_device=device)
    params = dict(model.named_parameters())  # tied weights appear once
    if cfg.load_format == "dummy":
        tensors = _dummy_tensors(params, cfg, device)
    else:
        tensors = _read_safetensors(params, cfg, device)
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    if cfg.arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    model.requires_grad_(False)
    return model


def _read_safetensors(params: dict, cfg: ModelConfig, device: torch.device) -> dict:
    files = sorted(glob.glob(os.path.join(cfg.path, "*.safetensors")))
    if not files:
        raise ConfigError(f"model: no *.safetensors files in {cfg.path}; use load_format='dummy' for random weights")
    loaded = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    if name == "lm_head.weight" and cfg.arch.tie_word_embeddings:
                        continue
                    raise ConfigError(f"model: unexpected tensor {name!r} in {path}")
                param = params[name]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ConfigError(
                        f"model: tensor {name!r} has shape {tuple(tensor.shape)} in {path}, "
                        f"the config implies {tuple(param.shape)}"
                    )
                loaded[name] = tensor.to(device=device, dtype=cfg.dtype)
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ConfigError(f"model: {cfg.path} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return loaded


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
