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
    # The counts at the last interval_line: (rounds, drafts, accepted, accepted per position).
    _mark: tuple[int, int, int, list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.k
        self.drafted_per_position = [0] * self.k
        self.length_histogram = [0] * (self.k + 2)
        self._mark = (0, 0, 0, [0] * self.k)

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

    def interval_line(self, seconds: float) -> str | None:
        """The engine's periodic log line, as vLLM's: the rounds verified since the last call
        (`seconds` ago), with the accepted and drafted tokens a second, and the totals since the
        start after them; None where no round was verified since (nothing to log)."""
        r0, d0, a0, pos0 = self._mark
        self._mark = (self.num_draft_rounds, self.num_draft_tokens, self.num_accepted_tokens,
                      list(self.accepted_per_position))
        rounds, drafted, accepted = self.num_draft_rounds - r0, self.num_draft_tokens - d0, self.num_accepted_tokens - a0
        if not rounds:
            return None
        rates = ", ".join(f"{(a - b) / rounds:.2f}" for a, b in zip(self.accepted_per_position, pos0))
        per_s = max(seconds, 1e-9)
        return (
            f"speculative decoding, last {seconds:.1f} s: mean acceptance length {1 + accepted / rounds:.2f}, "
            f"acceptance rate {accepted / drafted if drafted else 0.0:.3f}, accepted {accepted / per_s:.1f} tokens/s, "
            f"drafted {drafted / per_s:.1f} tokens/s ({accepted} of {drafted} drafts, {rounds} rounds), per-position "
            f"[{rates}]; since the start: acceptance rate {self.acceptance_rate:.3f}, mean acceptance length "
            f"{self.mean_acceptance_length:.2f}"
        )

    def log_line(self) -> str:
        """Totals since the start (scripts and tests print it at the end of a run)."""
        if not self.num_draft_rounds:
            return "speculative decoding: no draft rounds yet"
        rates = ", ".join(f"{r:.2f}" for r in self.per_position_rates())
        return (
            f"speculative decoding: acceptance rate {self.acceptance_rate:.3f}, mean acceptance length "
            f"{self.mean_acceptance_length:.2f}, {self.num_draft_rounds} rounds, {self.num_draft_tokens} drafts, "
            f"{self.num_accepted_tokens} accepted, per-position [{rates}]"
        )
