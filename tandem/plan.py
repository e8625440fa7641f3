"""Plain-data messages between the scheduler and the runner (no torch, no behaviour).

The scheduler emits a StepPlan; the runner executes it and answers with a StepResult.
Neither side imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.sampling_params import SamplingParams

# An input token the host does not know yet: the token the previous step samples for this slot.
# Only plans made ahead of that step's result (Scheduler.schedule_ahead) carry it; the runner
# reads the token on the device.
PENDING_TOKEN = -1


@dataclass(slots=True)
class NewReq:
    """A request (re)admitted to a slot: everything the runner keeps per slot."""

    req_id: int
    slot: int
    token_ids: list[int]  # prompt + output so far (penalties count them)
    num_prompt_tokens: int
    params: SamplingParams
    seed: int


@dataclass(slots=True)
class ScheduledReq:
    """One request's share of a step: a prefill chunk, or 1 token plus num_drafts drafts."""

    req_id: int
    slot: int
    start_pos: int  # num_computed_tokens before this step = position of the first input token
    input_token_ids: list[int]  # tokens fed this step (or [PENDING_TOKEN]); drafts follow them, read on device
    num_drafts: int  # drafts (pending in the slot) verified after the input tokens
    block_ids: list[int]  # the request's whole block table
    sample: bool  # the chunk reaches the last known token, so a token is sampled
    num_output_tokens: int  # output tokens before this step (min_tokens, penalties)
    num_next_drafts: int = 0  # drafts to propose after this step (0: no drafting)
    # Dynamic speculation: tokens at positions draft_backfill_start.. (before start_pos) whose KV the
    # draft skipped, fed to it before this step's tokens; draft_skip: the draft does not see this
    # step's tokens (drafting is off, or the backfill stops short of start_pos).
    draft_backfill: list[int] = field(default_factory=list)
    draft_backfill_start: int = 0
    draft_skip: bool = False
    # Of num_drafts, those that can still become output (None: all). The rest lie past max_tokens:
    # verified only so the batch stays uniform, and left out of the acceptance metrics.
    num_useful_drafts: int | None = None
    # prompt_logprobs: the prompt tokens after each of the chunk's first tokens, whose logprobs the
    # chunk yields (token start_pos + 1 + j for input token j); None when not asked for.
    prompt_logprob_targets: list[int] | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_token_ids) + self.num_drafts

    @property
    def num_budget_tokens(self) -> int:
        """What the item takes of max_num_batched_tokens: its new tokens and the draft's backfill."""
        return self.num_new_tokens + len(self.draft_backfill)

    @property
    def num_counted_drafts(self) -> int:
        """The drafts the acceptance metrics count: num_drafts less those past max_tokens."""
        return self.num_drafts if self.num_useful_drafts is None else min(self.num_drafts, self.num_useful_drafts)


@dataclass(slots=True)
class GrammarMask:
    """The tokens structured-output requests may emit at each of their rows this step.

    reqs: indices into StepPlan.reqs of sampling requests with a constraint; each has
    num_drafts + 1 logits rows (the row after each of its drafts, then the bonus row), in order.
    bitmask: [sum of those rows, ceil(V / 32)] int32 (a numpy array): token t is allowed iff bit
    t % 32 of word t // 32 is set. A row after a draft the constraint rejects allows everything:
    that draft is rejected at its own row, so nothing later is emitted."""

    reqs: list[int]
    bitmask: Any


@dataclass(slots=True)
class StepPlan:
    new_reqs: list[NewReq]
    reqs: list[ScheduledReq]  # batch order
    freed_slots: list[int] = field(default_factory=list)  # released since the previous plan
    # (slot, start, end): responses that ended ("stop" or "length") since the previous plan, at
    # positions start..end - 1 of their slot's tokens (suffix lookup keeps them; tandem/spec/suffix.py)
    finished_outputs: list[tuple[int, int, int]] = field(default_factory=list)
    grammar: GrammarMask | None = None  # set by the engine when a structured-output request samples

    @property
    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.reqs)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token: the chosen one and the top-n (of the distribution
    logprobs_mode names)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the chosen token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class StepResult:
    """Per scheduled request (same order as StepPlan.reqs): the tokens it emitted this step.

    A request with drafts emits its accepted drafts plus one recovered or bonus token; a
    prefill chunk that does not reach the end emits nothing.
    """

    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    num_drafts_proposed: list[int]  # drafts now pending in each request's slot
    # per request: the logprobs of ScheduledReq.prompt_logprob_targets (None when it has none)
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
    # plan.reqs index -> the draft steps its chain ran, for the requests the confidence stop cut short
    # (num_drafts_proposed < num_next_drafts; the rest ran their plan's); None: none was
    draft_steps: dict[int, int] | None = None
