"""Adaptive speculation: each step's number of drafts from an online acceptance estimate and the
measured cost of a step.

`num_speculative_tokens_per_batch_size="auto"` replaces the user's table of batch sizes with a
choice made every step: the K in 0..k that maximises the tokens a request emits per millisecond,

    (1 + S_0 + ... + S_{K-1}) / cost(batch size, K),

where S_j = P(the first j + 1 drafts are accepted) comes from `AcceptanceEstimator` and
cost(n, K) is the step time measured at start-up (`StepCosts`, tandem/spec/step_costs.py)
for a batch of n requests each verifying K drafts and proposing K more. Every request of a
step gets the same K (uniform batches replay the CUDA graphs). K = 0 switches the draft model
off; the scheduler then has it catch up when drafting resumes.

Under the confidence stop (tandem/spec/confidence.py) a round planned with K drafts may propose
fewer: S_j then counts a draft never proposed as rejected (the stop's yield), and the cost of
planning K is the measured one scaled by how often the stop lets some chain of the batch run that
many draft steps (`AdaptiveDrafts.expected_costs`; the costs are measured with the stop off).

A position that is never verified is never observed: while K stays below k, the estimate of
S_K goes stale. So when S_K has not been observed for `probe_interval` steps, the policy
drafts K + 1 until an observation arrives (a probe), which also lets it climb back from K = 0
when the draft starts agreeing again. Plain Python: no torch.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from tandem.plan import StepPlan, StepResult


class AcceptanceEstimator:
    """S_j = P(the first j + 1 drafts are accepted), j < k, over recently verified rounds.

    A round that verified n drafts and accepted a of them observes S_j for every j < n
    (1 if a > j): no position it verified is censored, so the estimate is the plain mean of
    what was seen, exponentially forgotten over about `window` observations per position (the
    workload drifts). Before any observation S_j is prior**(j + 1), held with prior_weight
    observations' weight: optimistic (1.0), so a fresh engine drafts k and observes every
    position at once; the first few verified rounds outweigh it.

    A position seen again after more than `stale_after` steps unobserved (the policy stopped
    verifying it; a probe looks again) keeps at most `stale_weight` observations' weight of what
    it knew: forgetting per observation alone would hold the evidence of the rounds that switched
    it off (a window's worth) against each probe's one or few rounds, and a draft that agrees
    again would wait thousands of steps to be used."""

    def __init__(self, k: int, window: float = 1000.0, prior: float = 1.0, prior_weight: float = 2.0,
                 stale_after: int = 64, stale_weight: float = 8.0):
        self.k = k
        self.stale_after, self.stale_weight = stale_after, stale_weight
        self.decay = 1.0 - 1.0 / window
        self.weight = [prior_weight] * k  # forgotten count of observations of position j
        self.hits = [prior_weight * prior ** (j + 1) for j in range(k)]  # of which the first j + 1 were accepted
        self.num_steps = 0  # steps observed (observe() calls)
        self.last_seen = [0] * k  # the step that last observed position j

    def observe(self, rounds: list[tuple[int, int]]) -> None:
        """One step's verified rounds, as (drafts verified, drafts accepted) per request."""
        self.num_steps += 1
        seen, hit = [0] * self.k, [0] * self.k
        for num_drafts, num_accepted in rounds:
            for j in range(min(num_drafts, self.k)):
                seen[j] += 1
                hit[j] += num_accepted > j
        for j in range(self.k):
            if seen[j]:
                if self.num_steps - self.last_seen[j] > self.stale_after and self.weight[j] > self.stale_weight:
                    shrink = self.stale_weight / self.weight[j]  # the same estimate, held more loosely
                    self.weight[j] *= shrink
                    self.hits[j] *= shrink
                keep = self.decay ** seen[j]
                self.weight[j] = keep * self.weight[j] + seen[j]
                self.hits[j] = keep * self.hits[j] + hit[j]
                self.last_seen[j] = self.num_steps

    def survival(self) -> list[float]:
        """[S_0, ..., S_{k-1}], non-increasing (a later position never survives more often)."""
        out, low = [], 1.0
        for h, w in zip(self.hits, self.weight):
            low = min(low, h / w)
            out.append(low)
        return out

    def steps_unseen(self, j: int) -> int:
        return self.num_steps - self.last_seen[j]


@dataclass(frozen=True)
class StepCosts:
    """Measured step time (ms) by batch size and number of drafts.

    ms[i][K]: a step of sizes[i] requests, each verifying K drafts and proposing K (inf: not
    measured, e.g. the step does not fit max_num_batched_tokens). A batch between two sizes
    costs what the next size up costs where a CUDA graph pads it to that size (`padded`), else
    the line between the two; past the last size, the line through the last two (one size:
    its costs), as the reference extrapolates: verification grows with the rows it multiplies."""

    sizes: tuple[int, ...]  # ascending
    ms: tuple[tuple[float, ...], ...]
    padded: bool = True  # the steps run on CUDA graphs of these sizes (else eagerly, at any size)

    @classmethod
    def from_measured(cls, sizes: list[int], ms: list[list[float]], padded: bool = True) -> "StepCosts":
        """Measured medians made monotone (a running max along K, then along the sizes): more
        drafts or more requests never cost less, whatever the timer's noise said."""
        rows, prev = [], None
        for row in ms:
            row = [max(row[: K + 1]) for K in range(len(row))]
            if prev is not None:
                row = [max(a, b) for a, b in zip(row, prev)]
            rows.append(tuple(row))
            prev = row
        return cls(tuple(sizes), tuple(rows), padded)

    def at(self, num_reqs: int) -> tuple[float, ...]:
        sizes = self.sizes
        i = bisect.bisect_left(sizes, num_reqs)
        if i < len(sizes) and (sizes[i] == num_reqs or self.padded) or i == 0 or len(sizes) == 1:
            return self.ms[min(i, len(sizes) - 1)]
        lo = min(i, len(sizes) - 1) - 1  # between sizes[lo] and the next, or past the last two
        frac = (num_reqs - sizes[lo]) / (sizes[lo + 1] - sizes[lo])
        row, low = [], 0.0
        for a, b in zip(self.ms[lo], self.ms[lo + 1]):
            low = max(low, a + frac * (b - a) if not math.isinf(b) else math.inf)  # monotone along K
            row.append(low)
        return tuple(row)

    def table(self) -> str:
        """One line per size: the ms of K = 0, 1, ... (for the log)."""
        return "; ".join(f"{n}: " + " ".join("-" if math.isinf(t) else f"{t:.2f}" for t in row)
                         for n, row in zip(self.sizes, self.ms))


class AdaptiveDrafts:
    """The scheduler's k_for_batch under num_speculative_tokens_per_batch_size="auto"; the engine
    calls observe() with every step's result."""

    def __init__(self, k: int, costs: StepCosts, estimator: AcceptanceEstimator | None = None,
                 probe_interval: int = 64):
        self.k = k
        self.costs = costs
        self.estimator = estimator if estimator is not None else AcceptanceEstimator(k, stale_after=probe_interval)
        self.probe_interval = probe_interval
        self.num_steps_by_k = [0] * (k + 1)  # steps that proposed K drafts, K = 0..k (observe)
        # Under the confidence stop: R_j = P(a chain runs more than j draft steps | it planned more drafts),
        # the same survival estimate over (drafts planned, draft steps run); 1 without the stop. A chain
        # ended by an unsure draft ran the step that drew it: one step more than the drafts it proposes.
        self.proposals = AcceptanceEstimator(k, stale_after=probe_interval)
        # req id -> (the drafts its next round planned, the draft steps its chain ran), for rounds the
        # confidence stop cut short
        self.planned_by_req: dict[int, tuple[int, int]] = {}

    def expected_costs(self, num_reqs: int) -> list[float]:
        """The expected ms of a step planning K = 0..k drafts. A round's draft steps end once every
        chain has (the confidence stop), so planning K costs cost(1) plus, for each further draft
        step j, its share cost(j + 1) - cost(j) times P(some chain of the batch runs step j),
        1 - (1 - R_j)^n; without the stop every R_j is 1 and this is the measured cost(K). (The share
        also holds the verification of draft j, which the next step skips where the stop dropped
        draft j though its step ran: a slight over-pricing, on the safe side.)"""
        row = self.costs.at(num_reqs)
        alive = self.proposals.survival()
        out = list(row[:2])
        for j in range(1, self.k):
            if math.isinf(row[j + 1]):  # K = j + 1 does not fit
                out.append(math.inf)
            else:
                out.append(out[j] + (1.0 - (1.0 - alive[j]) ** num_reqs) * (row[j + 1] - row[j]))
        return out[: self.k + 1]

    def best(self, num_reqs: int) -> int:
        """The K in 0..k with the most expected tokens per millisecond at this batch size."""
        survival = self.estimator.survival()
        row = self.expected_costs(num_reqs)
        best, best_rate, tokens = 0, -1.0, 1.0
        for K in range(self.k + 1):
            if K:
                tokens += survival[K - 1]
            rate = tokens / row[K] if row[K] > 0 else 0.0
            if rate > best_rate:
                best, best_rate = K, rate
        return best

    def __call__(self, num_reqs: int) -> int:
        """The drafts a step proposes at a batch of num_reqs: the best K, or K + 1 when position K
        has gone unobserved for probe_interval steps (a probe). No side effects: the scheduler
        may ask more than once per step."""
        K = self.best(num_reqs)
        if K < self.k and self.estimator.steps_unseen(K) > self.probe_interval \
                and not math.isinf(self.costs.at(num_reqs)[K + 1]):
            return K + 1
        return K

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """One step's verified rounds. A round the confidence stop (tandem/spec/confidence.py) cut
        short counts its unproposed positions as rejected, not as unobserved: they yield no token,
        and left out they would be seen only in the rounds the draft was sure of, so the estimate
        of deep positions would rise with the stop and steer K up for nothing. Counted this way
        S_j is the yield of the policy in force: P(draft j is proposed and the first j + 1 are
        accepted). The same rounds teach `proposals` how many draft steps the stop lets a chain run,
        which prices a plan of K drafts (expected_costs)."""
        cut = self.planned_by_req
        verified = [(item, *cut.get(item.req_id, (item.num_drafts, item.num_drafts)), len(tokens) - 1)
                    for item, tokens in zip(plan.reqs, result.sampled_token_ids) if item.num_drafts and tokens]
        self.estimator.observe([(max(item.num_drafts, num_planned), num_accepted)
                                for item, num_planned, _, num_accepted in verified])
        self.proposals.observe([(max(item.num_drafts, num_planned), num_steps)
                                for item, num_planned, num_steps, _ in verified])
        # Rebuilt every step: a request verifies its drafts the step after it proposes them.
        steps = result.draft_steps or {}
        self.planned_by_req = {item.req_id: (item.num_next_drafts, steps.get(i, num_proposed))
                               for i, (item, num_proposed) in enumerate(zip(plan.reqs, result.num_drafts_proposed))
                               if num_proposed < item.num_next_drafts}
        if any(item.sample for item in plan.reqs):  # a step of prefill chunks alone chose no K
            self.num_steps_by_k[max(item.num_next_drafts for item in plan.reqs)] += 1

    def summary(self) -> dict:
        """What it chose and believes, as plain data (the benchmarks' JSON)."""
        return dict(steps_by_drafts=list(self.num_steps_by_k), estimated_survival=self.estimator.survival(),
                    estimated_proposals=self.proposals.survival(), step_costs=self.costs.table())

    def log_line(self) -> str:
        s = ", ".join(f"{v:.2f}" for v in self.estimator.survival())
        steps = ", ".join(f"{K}: {n}" for K, n in enumerate(self.num_steps_by_k) if n)
        return f"adaptive drafts: estimated P(first j+1 accepted) [{s}]; steps by drafts proposed {{{steps}}}"
