"""Architecture name (config.json `architectures`) -> model class."""
from __future__ import annotations

from tandem.config import SUPPORTED_ARCHITECTURES, ArchConfig
from tandem.errors import ConfigError
from tandem.models.decoder import CausalLM

MODEL_CLASSES = {name: CausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class(arch: ArchConfig) -> type[CausalLM]:
    try:
        return MODEL_CLASSES[arch.architecture]
    except KeyError:
        raise ConfigError(
            f"architecture {arch.architecture!r} is not supported; supported: {', '.join(MODEL_CLASSES)}"
        ) from None
