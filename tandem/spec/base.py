"""Speculator: what every proposer shares: the drafts pending in each slot, and their verification.

A proposer (DraftSpeculator: a draft model; NgramSpeculator, SuffixSpeculator: lookups) keeps each
request's drafts on the device in `drafts` [max_num_seqs + 1, k], in the request's slot. The next
step feeds them to the target after the request's token (pending_drafts) and verifies them
(verify): greedy drafts by coupling (a draft is kept iff the target's seeded draw at its row is
that token, so the output is target-only's token for token), probabilistic ones by the ratio
test against their cached draft logits, watermarked rows by exact match with the target's keyed
draw. propose() then drafts for the next step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tandem.config import SchedulerConfig
from tandem.layers.backend import AttnBackend
from tandem.plan import NewReq, StepPlan
from tandem.runner.inputs import Batch, row_prior_drafts
from tandem.sampling.processors import apply_token_bitmask, divide_by_temperature
from tandem.sampling.sampler import keyed_draw, process_logits
from tandem.sampling.state import SamplingState
from tandem.spec.config import SpeculativeConfig
from tandem.spec.rejection import block_rejection_sample, force_target_tokens, rejection_sample

if TYPE_CHECKING:
    from tandem.engine.grammar import DraftMasks


class Speculator:
    """The per-slot drafts and their verification; subclasses propose."""

    def __init__(self, spec: SpeculativeConfig, sched: SchedulerConfig, state: SamplingState, device: torch.device,
                 attn_backend: AttnBackend):
        self.k = spec.k
        self.draft_counts = [d for d in spec.draft_counts if d > 0]  # the numbers of drafts a step may propose
        self.device = device
        self.attn_backend = attn_backend
        # Greedy drafts gain nothing from the block test (README), and the coupled test keeps the
        # target-only tokens: they are verified as under "standard".
        block = spec.rejection_sample_method == "block" and spec.draft_sample_method == "probabilistic"
        if attn_backend.use_triton:
            from tandem.kernels import rejection as fused

            self.rejection_sample = fused.block_rejection_sample if block else fused.rejection_sample
        else:
            self.rejection_sample = block_rejection_sample if block else rejection_sample
        self.max_model_len = sched.max_model_len
        self.state = state
        self.vocab_size = state.vocab_size  # the target's
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        # [max_num_seqs + 1, k]; the last row is scratch for padded rows of captured graphs.
        self.drafts = torch.zeros(sched.max_num_seqs + 1, self.k, dtype=torch.int64, device=device)
        # [max_num_seqs, k, vocab] fp32 draft logits of probabilistic drafts (set by a proposer that samples)
        self.draft_logits: Tensor | None = None
        rates = spec.conditional_rates() if spec.synthetic else None
        self.synthetic_rates = torch.tensor(rates, dtype=torch.float32, device=device) if rates else None

    def capture_graphs(self, max_num_reqs: int, max_blocks: int, stream: torch.cuda.Stream, pool=None,
                       piecewise_tokens: int = 0) -> None:
        """Capture the proposer's CUDA graphs (none by default)."""

    def add(self, new: NewReq) -> None:
        """A request (re)admitted to new.slot (nothing by default: sampling parameters live in the
        shared SamplingState)."""

    def finished(self, outputs: list[tuple[int, int, int]]) -> None:
        """Responses that ended, as StepPlan.finished_outputs, before their slots are reused
        (nothing by default)."""

    def pending_drafts(self, src: Tensor) -> Tensor:
        """src [n, 2] int64 (slot, draft index) -> draft tokens [n] int64."""
        return self.drafts[src[:, 0], src[:, 1]]

    # ---------------------------------------------------------------- verify
    @torch.inference_mode()
    def verify(self, plan: StepPlan, batch: Batch, logits: Tensor, state: SamplingState,
               grammar: tuple[Tensor, Tensor] | None = None):
        """Target logits [num_rows, V] -> (processed [num_rows, V], row_tokens [num_rows], num_emitted [num_reqs]).
        grammar: (rows, bitmask) the logits were masked with (structured outputs); sampled drafts
        were drawn under the same rows, and their distribution is restricted to them too."""
        rows = batch.rows
        wm = state.watermark
        marked = [r for r, s in enumerate(rows.slots) if wm is not None and wm.on[s]]  # keyed rows: exact match
        if state.output_counts or state.recent:  # penalties and bad words see earlier drafts
            rows.prior_drafts = row_prior_drafts(batch, self.drafts)
        processed = process_logits(logits, state, rows)
        row_req, row_index, row_is_bonus = [], [], []
        for n, i in enumerate(batch.sampling):
            d = plan.reqs[i].num_drafts
            row_req += [n] * (d + 1)
            row_index += list(range(d + 1))
            row_is_bonus += [False] * d + [True]
        keyed = set(marked)
        sampled = [r for r, s in enumerate(rows.slots) if state.params[s].temperature > 0 and r not in keyed]
        # One pinned, non-blocking upload: torch.tensor(list, device=cuda) would wait for the
        # verification forward queued just before (a hidden sync that idles the GPU).
        row_req_t, row_index_t, bonus_t, sampled_t, marked_t = self.attn_backend.upload(
            row_req, row_index, row_is_bonus, sampled, marked)
        is_bonus = bonus_t.bool()
        col = row_index_t.clamp(max=self.k - 1)
        row_draft = torch.where(is_bonus, -1, self.drafts[rows.slot_ids, col])
        temperature = state.temperature[rows.slot_ids]
        q_logits = None
        if self.probabilistic:
            q_logits = divide_by_temperature(self.draft_logits[rows.slot_ids, col], temperature, rows.slots, state)
            if grammar is not None:  # the drafts that fit without a repair kept the draft's own logits
                apply_token_bitmask(q_logits, *grammar)
        row_tokens, num_emitted = self.rejection_sample(
            processed,
            row_draft,
            is_bonus,
            temperature == 0,
            sampled_t if sampled else None,
            q_logits,
            state.seeds[rows.slot_ids],
            rows.positions,
            row_req_t,
            row_index_t,
            len(batch.sampling),
            self.synthetic_rates,
        )
        if marked:  # the target's keyed draw at each row, after the drafts before it
            slot_m = rows.slot_ids[marked_t]
            hashes, seen = wm.keys(slot_m, self.drafts, slot_m, row_index_t[marked_t])
            forced = torch.full_like(row_draft, -1)
            forced[marked_t] = keyed_draw(processed[marked_t], wm.key, hashes, seen, state.seeds[slot_m],
                                          rows.positions[marked_t], state.use_triton)
            row_tokens, num_emitted = force_target_tokens(row_tokens, num_emitted, forced, row_draft, row_req_t,
                                                          row_index_t, len(batch.sampling))
        return processed, row_tokens, num_emitted

    def repair(self, items, masks) -> None:
        """Draw again, under their grammar, drafts that left it (a draft model's; the engine asks
        no other proposer: a lookup's drafts are verified under the grammar as they are)."""
        raise NotImplementedError(f"{type(self).__name__} drafts cannot be drawn again under a grammar")

    # ---------------------------------------------------------------- propose
    def propose(self, plan: StepPlan, batch: Batch, row_tokens: Tensor, num_emitted: Tensor,
                masks: DraftMasks | None = None) -> dict[int, tuple[int, int]] | Tensor | None:
        """Draft num_next_drafts tokens for every sampling request of the step (row_tokens [num_rows],
        num_emitted [num_sampling]: what verify() gave) -> the requests that propose fewer than
        their plan's, as {plan.reqs index: (count, draft steps its chain ran)} (known on the host) or a
        device tensor of every
        sampling request's count [num_sampling] (the runner brings it back with the step's
        results); None: every request proposes its plan's number."""
        raise NotImplementedError
