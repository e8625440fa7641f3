"""What generate() returns: RequestOutput, CompletionOutput, Logprob, RequestMetrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token (under the distribution logprobs_mode names: the model's raw
    one by default), its rank and text."""

    logprob: float
    rank: int | None = None  # (None: not computed, as vLLM's default)
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the top-n plus the chosen token).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Timing and (when speculating) acceptance figures of one request, times from time.monotonic()."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding (zero without a draft model).
    num_draft_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # On a finished request's output: acceptance_histogram[j], the rounds that accepted exactly j
    # drafts (j = 0..k; the bonus token not counted); acceptance_by_num_drafts[K][j], the same for
    # the rounds that counted K drafts (drafts past max_tokens are not counted).
    acceptance_histogram: list[int] = field(default_factory=list)
    acceptance_by_num_drafts: dict[int, list[int]] = field(default_factory=dict)
    # Each round's accepted and drafted tokens, in order: with per_request_spec_decode_metrics=
    # "detailed" and n == 1 only (None otherwise).
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_draft_rounds if self.num_draft_rounds else None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    lora_request: None = None  # vLLM's field: no LoRA adapters here, always None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and the outputs so far (final when finished)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: per prompt token, its logprob and the top-n (None for the first)
    prompt_logprobs: SampleLogprobs | None = None
    lora_request: None = None  # vLLM's field: no LoRA adapters here, always None
    # vLLM's fields of encoder-decoder, disaggregated and multimodal serving: a decoder-only text engine's values
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None
    multi_modal_placeholders: dict = field(default_factory=dict)

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens served from the prefix cache (vLLM's RequestOutput field)."""
        return self.metrics.num_cached_tokens if self.metrics is not None else None
