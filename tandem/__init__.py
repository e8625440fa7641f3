"""tandem: an LLM inference engine built around draft-model speculative decoding.

Exports resolve lazily so that torch-free parts (the scheduler) import without torch.
"""
import importlib
import os
import sys

if "torch" not in sys.modules:  # OpenMP reads these once, when torch loads its libgomp
    # A CPU decode step runs ~100 short parallel GEMMs with Python work between them; OpenMP
    # workers that fall asleep after each one must be woken for the next (the 0.5B draft's
    # step: 77 -> 60 ms on the 2-core dev machine with workers spinning). ACTIVE with a spin
    # count keeps them spinning for a few tens of ms after the last parallel region, then they
    # sleep, so an idle engine does not hold a core. Set either variable to override.
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "3000000")

_EXPORTS = {
    "LLM": "tandem.engine.llm",
    "SamplingParams": "tandem.sampling_params",
    "StructuredOutputsParams": "tandem.sampling_params",
    "BeamSearchParams": "tandem.sampling_params",
    "RequestOutputKind": "tandem.sampling_params",
    "RequestOutput": "tandem.outputs",
    "CompletionOutput": "tandem.outputs",
    "Logprob": "tandem.outputs",
    "TextPrompt": "tandem.prompts",
    "TokensPrompt": "tandem.prompts",
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
