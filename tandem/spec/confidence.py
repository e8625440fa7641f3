"""Confidence-based early stop of a drafting round (vLLM's draft_confidence_threshold).

A request's chain of drafts stays alive while every draft so far had a top-1 probability under
the draft model of at least tau; it proposes the drafts before its first draft below tau, and
always its first draft (as vLLM's DraftConfidenceStop: j drafts, at least one, for a chain that
ends at draft j, 0-based). The round stops launching draft steps once every chain has ended,
which saves the draft's forwards on the rounds it is unsure of. Each request proposes its own
number of drafts (at least 1, at most its plan's; vLLM gives a batch one count), and runs its own
number of draft steps: one more than its drafts when an unsure draft ended it (the step that drew
that draft ran), as many when its plan did.

The stop reads only the draft's distributions, never the target's or any draw the verification
makes, so the rejection sampler still returns the target's distribution: a draft block cut where
the draft prefix says is a valid proposal like any other.
"""
from __future__ import annotations

import torch
from torch import Tensor


class ConfidenceStop:
    """One round's chains. planned [n]: each drafting request's planned number of drafts."""

    def __init__(self, tau: float, planned: list[int]):
        self.tau = tau
        self.counts = list(planned)  # per drafting request: the drafts it proposes
        self.steps = [0] * len(planned)  # per drafting request: the draft steps its chain ran (set as it ends)
        self.alive = [n > 0 for n in planned]

    def after(self, step: int, logits: Tensor) -> bool:
        """Note the confidences of draft `step` (0-based), drawn from logits [n, vocab] (the draft's
        own, before temperature) -> whether every chain has ended (the round can stop)."""
        logits = logits.float()
        top = torch.exp(logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1)).tolist()  # [n] top-1 probability
        for row, p in enumerate(top):
            if not self.alive[row]:
                continue
            if p < self.tau:  # the drafts before this one, or the first
                self.alive[row] = False
                self.counts[row] = min(self.counts[row], max(step, 1))
                self.steps[row] = step + 1
            elif step + 1 >= self.counts[row]:  # the plan's drafts, all sure
                self.alive[row] = False
                self.steps[row] = step + 1
        return not any(self.alive)
