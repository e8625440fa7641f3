"""Scheduler: a phase-less token budget over waiting and running requests.

Every step each running request asks for the tokens it has not computed yet: a prefill chunk,
or its last token plus the drafts pending in its slot. Requests in decode are served first so
long prompts never starve them; prefills (running, then waiting) share what is left of
max_num_batched_tokens. When blocks run out, the most recently admitted request is preempted:
its blocks are freed and it recomputes later from its tokens, so its output does not change
(with probabilistic drafts, a sampled request's draws after that point come from other noise
streams, because its pending drafts are dropped: still the target's distribution, not the same
tokens; greedy drafts are verified against the target's own seeded draws, which do not change).

scheduling_policy="priority" orders by Request.sort_key (priority, then arrival) instead: the
waiting queue is kept in that order; decodes still come first, by priority, then the running
prefills by priority, each after the waiting requests that outrank it; a block shortage
preempts the running request that comes last in that order (one of a lower priority even if the
step already planned it, its tokens going back to the budget, where preempting those makes room);
and a waiting request that finds no slot or too few blocks preempts running requests of a
strictly lower priority (a larger value), one by one until it fits, provided that preempting all
of them would make room for a chunk of it (its prefix-cache hit counted; never for nothing), its
chunk then cut to that room; nothing that does not outrank a request preempted so is admitted in
that step. Equal priorities never preempt each other, so two requests cannot take a slot back
and forth.

With a draft model, each step's number of drafts comes from the batch size (`k_for_batch`,
speculative_config.num_speculative_tokens_per_batch_size; under "auto", tandem.spec.adaptive
also weighs the measured acceptance and step costs). Decode steps that draft nothing skip
the draft model altogether; when drafting resumes, the tokens it skipped are fed to it first
(`draft_backfill`, out of the same token budget), and until then the prefix cache registers no
block past them (a cached block holds valid KV of both models).
Prefix caching within a step: a waiting request whose prompt shares at least
SHARED_PREFIX_WAIT_TOKENS uncached tokens (whole blocks) with the blocks a request scheduled in the
same step computes is not admitted in that step (nor anything after it, as for a request that does
not fit); the next step finds those blocks cached. A burst of prompts sharing a new prefix thus
computes it once, not once per prompt admitted together (vLLM registers blocks at allocation to the
same end; SGLang defers such requests, as here).
Plain Python: no torch, no device.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tandem.plan import PENDING_TOKEN, NewReq, ScheduledReq, StepPlan, StepResult
from tandem.scheduler.blocks import BlockManager
from tandem.scheduler.request import Request, Status

if TYPE_CHECKING:
    from tandem.config import CacheConfig, SchedulerConfig


# A waiting request whose prompt would hit at least this many more tokens in blocks that another
# request computes in the same step waits one step for them instead of computing them again
# (in-batch prefix sharing; a hit on blocks still being computed would read KV not yet written).
SHARED_PREFIX_WAIT_TOKENS = 32


@dataclass
class _StepBuild:
    """A plan while schedule() builds it."""

    budget: int  # tokens left of max_num_batched_tokens
    k_next: int  # the drafts this step proposes
    scheduled: dict[int, ScheduledReq] = field(default_factory=dict)  # req_id -> its item
    new_reqs: list[NewReq] = field(default_factory=list)
    admitting: bool = True  # False once a running request was preempted for blocks, or a waiting one did not fit
    ceiling: float = float("inf")  # admit only priorities below this (a victim's, once one was preempted)
    cap: float = float("inf")  # the most tokens the waiting head may take (what fits once its victims are out)
    filling: set[tuple] = field(default_factory=set)  # keys of the blocks the step fills (BlockManager.keys_filled)


class Scheduler:
    """Decides what runs each step and applies each step's result to request state."""

    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_speculative_tokens: int = 0,
                 k_for_batch: Callable[[int], int] | None = None, record_spec_steps: bool = False,
                 draft_kv: bool = True, sampled_drafts: bool = False):
        """k_for_batch: the drafts a step proposes at a batch size (None: num_speculative_tokens);
        record_spec_steps: keep every request's accepted and drafted count of each round (Request.per_step_*);
        draft_kv: the proposer keeps a KV cache of its own (a draft model), which must be fed the
        tokens of steps it skipped before it drafts again (False: a lookup, n-gram or suffix, which sees every token);
        sampled_drafts: the draft samples its tokens (probabilistic drafts), so whether a step drafts decides
        which seeded draws its verification takes: a step planned ahead must draft as the synchronous one would."""
        assert cache.num_blocks is not None, "the engine sizes the KV pool before building the scheduler"
        if sched.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={sched.scheduling_policy!r} is not 'fcfs' or 'priority'")
        self.cfg = sched
        self.by_priority = sched.scheduling_policy == "priority"
        self.k = num_speculative_tokens
        self.k_for_batch = k_for_batch
        self.record_spec_steps = record_spec_steps
        self.draft_kv = draft_kv
        self.sampled_drafts = sampled_drafts
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[int, Request] = {}
        self.free_slots = list(range(sched.max_num_seqs - 1, -1, -1))
        self._freed_slots: list[int] = []
        self._finished_outputs: list[tuple[int, int, int]] = []  # StepPlan.finished_outputs
        self._finished_at: dict[int, int] = {}  # req_id -> its entry in _finished_outputs
        self.num_preemptions = 0
        # Prefix-cache lookups of admitted prompts, in tokens (vLLM's prefix_cache_queries / _hits): each
        # request's first admission with prefix caching on, not one with prompt logprobs (it skips the cache).
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ---------------------------------------------------------------- requests in and out
    def add(self, req: Request) -> None:
        if self.record_spec_steps:
            req.per_step_accepted, req.per_step_drafted = [], []
        self.requests[req.req_id] = req
        if self.by_priority:
            self._wait_in_order(req)
        else:
            self.waiting.append(req)

    def abort(self, req_id: int) -> Request | None:
        req = self.requests.get(req_id)
        if req is not None and not req.is_finished:
            self.finish(req, "abort")
        return req

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None,
               num_output_tokens: int | None = None) -> None:
        """num_output_tokens: the output tokens that stand, where fewer than the request emitted (a
        stop string found part-way through a step's tokens). A stop string found in a step whose
        tokens ended the request already (EOS, max_tokens) finishes it again: fewer tokens stand."""
        if req.is_finished:
            entry = self._finished_at.get(req.req_id)
            if num_output_tokens is not None and entry is not None:
                slot, start, end = self._finished_outputs[entry]
                self._finished_outputs[entry] = (slot, start, min(end, start + num_output_tokens))
                req.finish_reason, req.stop_reason = reason, stop_reason
            return
        if req.status == Status.RUNNING:
            self.running.remove(req)
            if reason != "abort":
                start = len(req.prompt_token_ids)
                kept = len(req.output_token_ids) if num_output_tokens is None else num_output_tokens
                self._finished_at[req.req_id] = len(self._finished_outputs)
                self._finished_outputs.append((req.slot, start, start + kept))
            self._release(req)
        else:
            self.waiting.remove(req)
            self.blocks.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.req_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        step = _StepBuild(self.cfg.max_num_batched_tokens, self._num_next_drafts())
        # Running requests: decodes first, then unfinished prefills, each in admission order (by
        # priority first under the priority policy; the sort is stable). Under the priority policy
        # a waiting request that outranks a running prefill is admitted before it.
        decodes = [r for r in self.running if not r.is_prefilling]
        prefills = [r for r in self.running if r.is_prefilling]
        if self.by_priority:
            decodes.sort(key=lambda r: r.priority)
            prefills.sort(key=lambda r: r.priority)
        for i, req in enumerate(decodes + prefills):
            if step.budget > 0 and self.by_priority and i >= len(decodes):
                self._admit_waiting(step, outranking=req.priority)
            if step.budget <= 0:
                break
            if req.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            # A draft's backfill leaves room for the decodes after it (1 + k_next tokens each).
            reserve = max(0, len(decodes) - i - 1) * (1 + step.k_next)
            item = self._schedule_running(req, step, reserve)
            if item is not None:
                step.scheduled[req.req_id] = item
                step.budget -= item.num_budget_tokens
                self._note_filled(req, item, step)
        self._admit_waiting(step)
        reqs = [step.scheduled[r.req_id] for r in self.running if r.req_id in step.scheduled]
        return self._plan(step.new_reqs, reqs)

    def _admit_waiting(self, step: _StepBuild, outranking: int | None = None) -> None:
        """Admit waiting requests, in arrival (or priority) order, while budget, slots and blocks
        last; outranking: only those of a smaller priority value. Nothing is admitted in a step
        where a running request was preempted for blocks (the freed room is left to the running
        requests), nor after a request that does not fit (it keeps its place at the head), nor,
        once a request was preempted for a waiting one, anything not outranking that victim."""
        while self.waiting and step.budget > 0 and step.admitting:
            req = self.waiting[0]
            if (outranking is not None and req.priority >= outranking) or req.priority >= step.ceiling:
                return
            if (step.filling and req.params.prompt_logprobs is None
                    and self.blocks.pending_hit(req, step.filling) >= SHARED_PREFIX_WAIT_TOKENS):
                step.admitting = False  # its shared prefix is being computed: a hit in the next step
                return
            item = self._admit(req, min(step.budget, step.cap), step.k_next) if self.free_slots else None
            if item is None:
                if not self._preempt_for(req, step):
                    step.admitting = False
                continue
            step.cap = float("inf")
            self.waiting.popleft()
            step.new_reqs.append(item[0])
            step.scheduled[req.req_id] = item[1]
            step.budget -= item[1].num_new_tokens
            self._note_filled(req, item[1], step)

    def _note_filled(self, req: Request, item: ScheduledReq, step: _StepBuild) -> None:
        """Add the blocks item's tokens fill to step.filling, while requests wait (whom they may serve)."""
        if self.waiting and len(item.input_token_ids) >= self.blocks.block_size:
            step.filling.update(self.blocks.keys_filled(req, item.start_pos,
                                                        item.start_pos + len(item.input_token_ids)))

    def _num_next_drafts(self) -> int:
        """The drafts this step proposes: by the batch size, the requests running or waiting (at
        most max_num_seqs)."""
        if not self.k or self.k_for_batch is None:
            return self.k
        return self.k_for_batch(min(len(self.running) + len(self.waiting), self.cfg.max_num_seqs))

    def _drafts_if_some_stop(self) -> bool:
        """Whether the batch, less requests that may stop in the step being collected (EOS, a stop
        string or id, a grammar's end), would draft: the batch size k_for_batch then sees is any
        from the requests that cannot stop to all of them."""
        if self.k_for_batch is None:
            return False
        fixed = sum(1 for req in self.running if req.params.ignore_eos and not req.params.stop
                    and not req.params.stop_token_ids and req.params.structured_outputs is None)
        return any(self.k_for_batch(m) for m in range(max(fixed, 1), len(self.running)))

    def schedule_ahead(self, prev: StepPlan) -> StepPlan | None:
        """The next step, planned while `prev` still runs (before its result is known), for the
        one case whose plan does not depend on that result: without drafts, when every running
        request samples in `prev`, each continues with the one token `prev` samples for it (a
        PENDING_TOKEN the runner reads on the device). With a draft model, only where the batch
        size turns drafting off (the draft skips the step), and with sampled drafts only where it stays
        off whichever requests stop in `prev` (`_drafts_if_some_stop`). With a lookup (draft_kv=False), also
        while the last result applied drafted nothing for any running request: the step is planned
        without drafts and looks up after it (what `prev` looked up is left unverified; once a
        lookup finds drafts, steps wait for their result again, so a repeating stretch costs one
        step's delay). None when anything else may happen (requests waiting, drafts, a prefill
        chunk, the budget, a block shortage, a request near its token limits): the caller then
        waits for `prev` and calls schedule().

        A request that stops at `prev` (EOS, a stop string) has already been given this step:
        update() drops its result, and its KV write lands past its last token."""
        if self.waiting or not self.running or len(self.running) > self.cfg.max_num_batched_tokens:
            return None
        lookup = 0  # the drafts the planned step looks up after it (a lookup's steps only)
        if self.k and self._num_next_drafts():
            if self.draft_kv or any(req.num_pending_drafts for req in self.running):
                return None
            lookup = self._num_next_drafts()
        elif self.k and self.sampled_drafts and self._drafts_if_some_stop():
            return None  # the synchronous step, planned once prev's stops are out, would draft
        prev_items = {r.req_id: r for r in prev.reqs}
        for req in self.running:
            p = prev_items.get(req.req_id)
            # prev's tokens are not applied yet: req.output_token_ids lags it by one.
            if (p is None or not p.sample or p.num_drafts or (p.num_next_drafts and not lookup)
                    or p.num_output_tokens + 2 > req.max_tokens):
                return None
            if p.start_pos + p.num_new_tokens + 2 > self.cfg.max_model_len:
                return None
        reqs = []
        for req in self.running:
            p = prev_items[req.req_id]
            start = p.start_pos + p.num_new_tokens  # the token prev samples sits here
            if not self.blocks.allocate(req, start + 1):
                return None  # a preemption decision: schedule() makes it with prev applied
            reqs.append(ScheduledReq(
                req_id=req.req_id,
                slot=req.slot,
                start_pos=start,
                input_token_ids=[PENDING_TOKEN],
                num_drafts=0,
                block_ids=list(req.block_ids),
                sample=True,
                num_output_tokens=p.num_output_tokens + 1,
                num_next_drafts=lookup,
                draft_skip=bool(self.k) and not lookup,
            ))
        return self._plan([], reqs)

    def _schedule_running(self, req: Request, step: _StepBuild, reserve: int) -> ScheduledReq | None:
        item = self._make_item(req, step.budget, step.k_next, reserve)  # its size kept while room is made
        while True:
            span = self._blocks_span(item)
            if self.blocks.allocate(req, span):
                item.block_ids = list(req.block_ids)
                return item
            unplanned = [r for r in self.running if r.req_id not in step.scheduled]  # req among them
            if not self.by_priority:
                victim = unplanned[-1]
            else:
                # The last in priority order: one of a lower priority even if the step already
                # planned it (a decode; its tokens go back to the budget), where preempting all of
                # those makes room; else the last unplanned one, req at worst. (Requests admitted
                # this step outrank every running prefill after them: never among the lower.)
                lower = [r for r in self.running if r.priority > req.priority]
                room = self.blocks.num_free_blocks + len(self._freed_by(lower))
                victim = max(lower if lower and self.blocks.blocks_needed(req, span) <= room else unplanned,
                             key=lambda r: r.sort_key)
            self._unplan(victim, step)
            self._preempt(victim)
            step.admitting = False
            if victim is req:
                return None

    def _freed_by(self, victims: list[Request]) -> set[int]:
        """The blocks that preempting every request of victims would free: those they alone hold."""
        holders: dict[int, int] = {}
        for r in victims:
            for b in r.block_ids:
                holders[b] = holders.get(b, 0) + 1
        return {b for b, n in holders.items() if n == self.blocks.ref_counts[b]}

    def _unplan(self, req: Request, step: _StepBuild) -> None:
        """Take req's item (if any) out of the plan being built; its tokens go back to the budget."""
        item = step.scheduled.pop(req.req_id, None)
        if item is not None:
            step.budget += item.num_budget_tokens

    def _preempt_for(self, req: Request, step: _StepBuild) -> bool:
        """Under the priority policy, make room for waiting req, which found no slot or too few
        blocks: preempt the running request last in priority order if req outranks it strictly
        (a smaller priority value) and preempting every such request would make room for a chunk
        of req (else none is preempted, for nothing); the victim leaves this step's plan, and
        req's chunk is capped to what fits. -> whether one was preempted."""
        if not self.by_priority:
            return False
        victims = [r for r in self.running if r.priority > req.priority]
        if not victims:
            return False
        step.cap = self._room_after(req, victims, step)
        if step.cap < 1:
            step.cap = float("inf")
            return False
        victim = max(victims, key=lambda r: r.sort_key)
        self._unplan(victim, step)
        self._preempt(victim)
        step.ceiling = min(step.ceiling, victim.priority)  # its room is not for it, nor its equals
        return True

    def _room_after(self, req: Request, victims: list[Request], step: _StepBuild) -> int:
        """The most tokens waiting req could compute this step (as _admit would: after its prefix
        hit, its lookahead included) once every victim is preempted; 0: not one."""
        bs, blocks = self.blocks.block_size, self.blocks
        hit = [] if req.params.prompt_logprobs is not None else [b for b, _ in blocks.prefix_blocks(req)]
        freed = self._freed_by(victims)
        reused = sum(1 for b in hit if blocks.ref_counts[b] == 0 or b in freed)  # attached, not free for new ones
        cover = (len(hit) + blocks.num_free_blocks + len(freed) - reused) * bs  # positions the blocks would hold
        start, remaining = len(hit) * bs, req.num_tokens - len(hit) * bs
        planned = [step.scheduled[r.req_id] for r in victims if r.req_id in step.scheduled]
        budget = step.budget + sum(item.num_budget_tokens for item in planned)

        def fits(chunk: int) -> bool:
            lookahead = self.k if chunk == remaining and self.draft_kv else 0
            return min(start + chunk + lookahead, self.cfg.max_model_len) <= cover

        chunk = min(remaining, budget, max(0, cover - start))
        if chunk and not fits(chunk):  # the whole rest fits, its lookahead does not: stop one short
            chunk -= 1
        return chunk if chunk >= 1 and fits(chunk) else 0

    def _admit(self, req: Request, budget: int, k_next: int) -> tuple[NewReq, ScheduledReq] | None:
        # Prompt logprobs need the logits of every prompt position: no cached prefix skips them.
        num_cached = 0 if req.params.prompt_logprobs is not None else self.blocks.match_prefix(req)
        req.num_computed_tokens = num_cached
        item = self._make_item(req, budget, k_next)
        if not self.blocks.allocate(req, self._blocks_span(item)):
            self.blocks.free(req)
            req.num_computed_tokens = 0
            return None
        if not req.num_preemptions:  # the prompt's hit when first admitted (vLLM's); a re-admission's is its own work
            req.num_cached_tokens = num_cached
            if self.blocks.enable_prefix_caching and req.params.prompt_logprobs is None:
                self.num_prefix_queries += len(req.all_token_ids)
                self.num_prefix_hits += num_cached
        req.slot = item.slot = self.free_slots.pop()
        item.block_ids = list(req.block_ids)
        req.status = Status.RUNNING
        self.running.append(req)
        new = NewReq(
            req_id=req.req_id,
            slot=req.slot,
            token_ids=req.all_token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            params=req.params,
            seed=req.seed,
        )
        return new, item

    def _make_item(self, req: Request, budget: int, k_next: int, reserve: int = 0) -> ScheduledReq:
        """reserve: budget a draft backfill leaves to the requests scheduled after this one."""
        start = req.num_computed_tokens
        remaining = req.num_tokens - start
        num_drafts = 0
        if remaining == 1:
            # Verify every pending draft, even past max_tokens: update() ends the output there,
            # and the batch stays uniform (a CUDA graph, not an eager step). The drafts past it
            # hold KV slots for this one step (at most k - 1 positions) and stay out of the
            # acceptance metrics (num_useful_drafts). No draft runs past max_model_len.
            room_len = self.cfg.max_model_len - req.num_tokens - 1
            num_drafts = max(0, min(req.num_pending_drafts, room_len, budget - 1))
        room_out = max(0, req.max_tokens - len(req.output_token_ids) - 1)  # drafts that can become output
        chunk = min(remaining, budget)
        sample = start + chunk == req.num_tokens
        num_next = k_next if sample else 0
        backfill, skip = [], False
        if req.draft_start is not None:  # the draft skipped draft_start .. start - 1: feed it first
            lag = start - req.draft_start
            n = max(0, min(lag, budget - reserve - chunk - num_drafts)) if num_next else 0
            backfill = [req.token_id(p) for p in range(req.draft_start, req.draft_start + n)]
            skip = n < lag  # the draft is still behind after this step: it drafts nothing
        elif self.k and num_next == 0 and remaining == 1:
            skip = True  # a decode step without drafting: the draft model does not run
        targets = None
        num_prompt = len(req.prompt_token_ids)
        if req.params.prompt_logprobs is not None and start + 1 < num_prompt:
            targets = req.prompt_token_ids[start + 1 : min(start + chunk, num_prompt - 1) + 1]
        return ScheduledReq(
            req_id=req.req_id,
            slot=req.slot,
            start_pos=start,
            input_token_ids=[req.token_id(p) for p in range(start, start + chunk)],
            num_drafts=num_drafts,
            block_ids=[],  # filled once the blocks are allocated
            sample=sample,
            num_output_tokens=len(req.output_token_ids),
            num_next_drafts=0 if skip else num_next,
            num_useful_drafts=min(num_drafts, room_out),
            prompt_logprob_targets=targets,
            draft_backfill=backfill,
            draft_backfill_start=req.draft_start or 0,
            draft_skip=skip,
        )

    def _blocks_span(self, item: ScheduledReq) -> int:
        """Positions whose KV this step may write: the new tokens plus the draft model's lookahead
        (a lookup writes none), never past max_model_len (the draft writes a draft's KV at most at
        position max_model_len - 1)."""
        end = item.start_pos + item.num_new_tokens + (self.k if item.sample and self.draft_kv else 0)
        return min(end, self.cfg.max_model_len)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_pending_drafts = 0
        req.draft_start = None  # recomputed from the start, by both models
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._wait_in_order(req)
        else:
            self.waiting.appendleft(req)

    def _wait_in_order(self, req: Request) -> None:
        """Queue req by its sort key (the priority policy's waiting order)."""
        self.waiting.insert(bisect.bisect(self.waiting, req.sort_key, key=lambda r: r.sort_key), req)

    def _plan(self, new_reqs: list[NewReq], reqs: list[ScheduledReq]) -> StepPlan:
        """The step's plan, carrying the slots freed and the responses ended since the previous
        plan (an empty plan too: the runner takes them from it, ModelRunner.release)."""
        plan = StepPlan(new_reqs=new_reqs, reqs=reqs, freed_slots=self._freed_slots,
                        finished_outputs=self._finished_outputs)
        self._freed_slots, self._finished_outputs, self._finished_at = [], [], {}
        return plan

    def _release(self, req: Request) -> None:
        self.blocks.free(req)
        self.free_slots.append(req.slot)
        self._freed_slots.append(req.slot)
        req.slot = None

    # ---------------------------------------------------------------- update
    def update(self, plan: StepPlan, result: StepResult) -> list[tuple[Request, list[int]]]:
        """Apply a step's result; return (request, newly emitted tokens) for every request that
        emitted tokens or finished. Token-level stops (max_tokens, EOS, stop ids, max_model_len)
        are applied here, one token at a time, so a stop inside an accepted run ends it exactly."""
        events = []
        for item, tokens, num_proposed in zip(plan.reqs, result.sampled_token_ids, result.num_drafts_proposed):
            req = self.requests.get(item.req_id)
            if req is None or req.status != Status.RUNNING:
                continue
            num_accepted = len(tokens) - 1 if item.num_drafts else 0
            req.num_computed_tokens += len(item.input_token_ids) + num_accepted
            if item.num_counted_drafts and tokens:
                self._count_acceptance(req, item.num_counted_drafts, min(num_accepted, item.num_counted_drafts))
            req.num_pending_drafts = num_proposed
            if not item.draft_skip:
                req.draft_start = None
            elif item.draft_backfill:
                req.draft_start = item.draft_backfill_start + len(item.draft_backfill)
            elif req.draft_start is None and self.draft_kv:
                req.draft_start = item.start_pos
            emitted, reason = [], None
            for token in tokens:
                req.output_token_ids.append(token)
                emitted.append(token)
                reason = self._check_stop(req, token)
                if reason is not None:
                    break
            # Before a finish frees them: a final step's blocks are reusable too; none the draft skipped.
            self.blocks.cache_full_blocks(req, req.draft_start)
            if reason is not None:
                self.finish(req, *reason)
            if emitted:
                events.append((req, emitted))
        return events

    def _count_acceptance(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        req.num_draft_rounds += 1
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        if len(req.accepted_per_position) < num_drafts:
            req.accepted_per_position += [0] * (num_drafts - len(req.accepted_per_position))
        for i in range(num_accepted):
            req.accepted_per_position[i] += 1
        if num_drafts not in req.acceptance_by_num_drafts:
            req.acceptance_by_num_drafts[num_drafts] = [0] * (num_drafts + 1)
        req.acceptance_by_num_drafts[num_drafts][num_accepted] += 1
        if req.per_step_accepted is not None:
            req.per_step_accepted.append(num_accepted)
            req.per_step_drafted.append(num_drafts)

    def _check_stop(self, req: Request, token: int) -> tuple[str, int | str | None] | None:
        """EOS, then stop tokens (once min_tokens are out), then the length cap, as in vLLM (since
        its PR 27640): a stop token that is also the last one allowed finishes with "stop"; the
        primary EOS (eos_token_ids[0]) with no stop_reason even when stop_token_ids lists it, any
        other EOS id with its id (vLLM counts those as stop tokens)."""
        num_out, params = len(req.output_token_ids), req.params
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return "stop", None if token == req.eos_token_ids[0] else token
            if token in req.stop_token_set:
                return "stop", token
        if num_out >= req.max_tokens or len(req.prompt_token_ids) + num_out >= self.cfg.max_model_len:
            return "length", None
        return None
