"""tandem: an LLM inference engine built around draft-model speculative decoding.

Exports resolve lazily so that torch-free parts (the scheduler) import without torch.
"""
import importlib

_EXPORTS = {
    "LLM": "tandem.engine.llm",
    "SamplingParams": "tandem.sampling_params",
    "RequestOutput": "tandem.outputs",
    "CompletionOutput": "tandem.outputs",
    "Logprob": "tandem.outputs",
    "RequestMetrics": "tandem.outputs",
    "TandemError": "tandem.errors",
    "ConfigError": "tandem.errors",
    "RequestError": "tandem.errors",
    "SpeculativeConfig": "tandem.spec.config",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
