"""Scheduler-side request state: token ids, progress, blocks, slot and status."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request as the scheduler sees it. There are no phases: num_computed_tokens catches up
    to num_tokens (prompt + outputs), a chunk at a time, then one token (+ drafts) per step."""

    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int  # resolved: params.max_tokens or what fits in max_model_len
    eos_token_ids: tuple[int, ...] = ()  # the primary (tokenizer's) EOS first: models.source.eos_token_ids
    priority: int = 0  # scheduling_policy="priority": lower runs first (ties: lower req_id, i.e. arrival)
    cache_salt: str | None = None  # the root of its blocks' chained hashes (BlockManager): shares only with its salt
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full computed blocks
    slot: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_pending_drafts: int = 0  # drafts in the runner's slot, proposed by the last step
    # The first position whose KV the draft skipped (steps without drafting); None: none skipped.
    draft_start: int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Acceptance counters (speculative decoding).
    num_draft_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # acceptance_by_num_drafts[K][j]: the rounds that drafted K (counted) tokens and accepted j of them.
    acceptance_by_num_drafts: dict[int, list[int]] = field(default_factory=dict)
    # Each round's accepted and counted drafts, in order: kept only when the scheduler records steps
    # (per_request_spec_decode_metrics="detailed"); None otherwise.
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None
    # params.stop_token_ids as a set (None: made from them): every output token is looked up in it
    # (a list of 1M ids was a scan a token); the n sequences of a request share one
    stop_token_set: frozenset[int] | None = None

    def __post_init__(self) -> None:
        if self.stop_token_set is None:
            self.stop_token_set = frozenset(self.params.stop_token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        """The priority policy's order: lower priority value first, then arrival."""
        return self.priority, self.req_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_in(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end - 1, without building the whole prompt + output list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def token_id(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
