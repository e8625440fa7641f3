"""Engine-wide acceptance metrics of speculative decoding, and their periodic log line."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.plan import StepPlan, StepResult


@dataclass
class SpecMetrics:
    """Counts over every verified draft round (a round = one request's drafts in one step).

    acceptance_rate = accepted / drafted; mean_acceptance_length = 1 + accepted / rounds
    (tokens emitted per round); length_histogram[n] = rounds that emitted n tokens.
    """

    k: int
    num_draft_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    length_histogram: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.k
        self.drafted_per_position = [0] * self.k
        self.length_histogram = [0] * (self.k + 2)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        for item, tokens in zip(plan.reqs, result.sampled_token_ids):
            drafts = item.num_counted_drafts  # drafts past max_tokens do not count
            if not drafts or not tokens:
                continue
            accepted = min(len(tokens) - 1, drafts)
            self.num_draft_rounds += 1
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += accepted
            for i in range(drafts):
                self.drafted_per_position[i] += 1
            for i in range(accepted):
                self.accepted_per_position[i] += 1
            self.length_histogram[accepted + 1] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_draft_rounds if self.num_draft_rounds else None

    def per_position_rates(self) -> list[float]:
        """Unconditional per-position acceptance, as vLLM's log line: drafts accepted at position i
        over every round (rounds that drafted fewer than i + 1 count as misses there), so the rates
        never rise with i and sum to the mean acceptance length minus 1."""
        rounds = self.num_draft_rounds
        return [a / rounds if rounds else 0.0 for a in self.accepted_per_position]

    def log_line(self) -> str:
        if not self.num_draft_rounds:
            return "speculative decoding: no draft rounds yet"
        rates = ", ".join(f"{r:.2f}" for r in self.per_position_rates())
        return (
            f"speculative decoding: acceptance rate {self.acceptance_rate:.3f}, mean acceptance length "
            f"{self.mean_acceptance_length:.2f}, {self.num_draft_rounds} rounds, {self.num_draft_tokens} drafts, "
            f"{self.num_accepted_tokens} accepted, per-position [{rates}]"
        )
