"""tandem: an LLM inference engine built around draft-model speculative decoding."""
from tandem.engine.llm import LLM
from tandem.errors import ConfigError, RequestError, TandemError
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "TandemError",
    "ConfigError",
    "RequestError",
]
__version__ = "0.1.0"
