"""DraftSpeculator: a separate draft LM that proposes k tokens per request, kept on the device.

Per step, after the target has verified: (1) the draft catches up over the target's batch,
each sampling request extended by one slot that receives the token the target just emitted,
at the position after the accepted drafts (rejected slots are left in place: the causal mask
hides them and later steps overwrite their KV); (2) k - 1 single-token decode steps (after a
uniform verification step with greedy drafting, both are one CUDA graph replay). Drafts
(and, for probabilistic drafting, the draft logits) go to per-slot buffers; the next step
reads them on the device. Positions that depend on acceptance are computed on the device, so
proposing never waits for the host. Rounds that cannot run as one graph (sampled or
watermarked drafts, grammar-aware drafting) replay a captured one-step graph per draft.

Grammar-aware drafting (structured outputs): constrained requests propose only tokens their
grammar allows, two ways with the same drafts. propose() with the engine's DraftMasks masks their
draft logits before each draft is taken; the masks follow the tokens, so that round waits for
the step's emitted tokens and then for each step's drafts of those requests (each copy queued
before the next forward, so the host makes the masks while that forward runs). repair() takes a
round that ran free and draws again, under the grammar, the drafts from the first that left it.

Requests whose logits processors steer (allowed_token_ids, bad words, logit_bias, min_tokens) draft
under them too, as the target samples (the drafts before a column count as output), so a request
that a bias or an allowed set steers keeps its acceptance; their rounds run step by step. Penalties
stay the target's alone: soft, and common enough (Qwen's generation_config sets a repetition penalty
for every request) that following them would take every round off the one-graph path.

Watermarked requests (tandem.sampling.watermark) draft with the target's keyed noise and are
verified by exact match with the target's keyed draw, so their output is the target's alone.

A step proposes the number of drafts its plan says (num_next_drafts: k, or fewer under
dynamic speculation). Requests whose step skips the draft (draft_skip) are left out of it; the
tokens it skipped come back as a backfill in front of a later step's tokens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.layers.backend import AttnBackend
from tandem.models.decoder import CausalLM, KVCache
from tandem.plan import StepPlan
from tandem.runner.graphs import GraphRunner
from tandem.runner.inputs import Batch
from tandem.upload import to_host
from tandem.runner.piecewise import PiecewiseGraphs, forward
from tandem.sampling.gumbel import draft_salt
from tandem.sampling.processors import (SampleRows, apply_logits_processors, apply_min_p, apply_token_bitmask,
                                       apply_top_k_top_p, divide_by_temperature, on_rows)
from tandem.sampling.sampler import draw, greedy_tokens, keyed_draw
from tandem.sampling.state import SamplingState
from tandem.spec.base import Speculator
from tandem.spec.confidence import ConfidenceStop
from tandem.spec.config import SpeculativeConfig
from tandem.spec.draft_graphs import DraftGraphs

if TYPE_CHECKING:
    from tandem.engine.grammar import DraftMasks


class DraftSpeculator(Speculator):
    """Owns the draft model, its KV cache (same block ids as the target) and the draft buffers."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        draft_cfg: ModelConfig,
        model: CausalLM,
        cache: CacheConfig,
        sched: SchedulerConfig,
        state: SamplingState,
        device: torch.device,
        attn_backend: AttnBackend,
        hot_ids: list[int] | None = None,
    ):
        """hot_ids: the token ids the draft's pruned LM head scores, ascending (tandem/spec/hot_vocab.py), or
        None for its whole vocabulary."""
        # (batch_invariant: the draft's attention as invariant as its linears, factory.SpeculatorFactory says when)
        super().__init__(spec, sched, state, device, attn_backend if draft_cfg.batch_invariant else attn_backend.fast())
        self.model = model
        self.block_size = cache.block_size
        # The draft scores ids below draft_vocab; ids a smaller draft table lacks (padding rows past
        # the tokenizer, factory._check_vocab) get probability zero, and the draft embeds them as its
        # last row when the target emits one.
        self.draft_vocab = min(self.vocab_size, draft_cfg.arch.vocab_size)
        self.clamp_ids = draft_cfg.arch.vocab_size < self.vocab_size
        # A pruned head's logits [n, H] score hot_ids [H] (ascending); its drafts are hot_ids[argmax].
        self.hot_ids = torch.tensor(hot_ids, dtype=torch.int64, device=device) if hot_ids is not None else None
        self.head_cols = len(hot_ids) if hot_ids is not None else self.draft_vocab  # the logits a draft step reads
        self.local_argmax = spec.use_local_argmax_reduction is not False
        self.confidence_threshold = spec.draft_confidence_threshold  # None: every round drafts its plan's number
        self.kv = KVCache(model.arch, cache.num_blocks, cache.block_size, cache.kv_dtype(draft_cfg.dtype), device)
        # [max_num_seqs, k, vocab] fp32 pre-temperature (masked) draft logits, for the ratio test.
        self.draft_logits = (
            torch.zeros(sched.max_num_seqs, self.k, self.vocab_size, dtype=torch.float32, device=device)
            if self.probabilistic else None
        )
        self.graphs: dict[int, DraftGraphs] = {}  # number of drafts -> that round's graphs
        # One draft step's forward and logits (CUDA): the rounds that draft step by step (sampled or
        # watermarked drafts, grammar-aware drafting) run their loop steps on it.
        self.step_graph: GraphRunner | None = None
        self.piecewise: PiecewiseGraphs | None = None  # catch-ups beside prefills, cut at the attention

    def capture_graphs(self, max_num_reqs: int, max_blocks: int, stream: torch.cuda.Stream, pool=None,
                       piecewise_tokens: int = 0) -> None:
        """Capture the catch-up forward and the greedy draft loop (CUDA only) for each number of
        drafts on stream, into the graph memory pool `pool`, one draft step (for the rounds that
        draft step by step), and the piecewise forward of other catch-ups of up to
        piecewise_tokens tokens (0: none)."""
        for d in self.draft_counts:
            self.graphs[d] = DraftGraphs(
                self.model, self.kv, self.drafts, k=d, vocab_size=self.head_cols, hot_ids=self.hot_ids,
                max_num_reqs=max_num_reqs,
                max_blocks=max_blocks, max_model_len=self.max_model_len, backend=self.attn_backend,
                device=self.device,
            )
            self.graphs[d].capture(stream, pool)
        if self.k >= 2 and os.environ.get("TANDEM_DRAFT_STEP_GRAPH", "1") != "0":  # =0: the eager loop (A/B)
            self.step_graph = GraphRunner(self.model, self.kv, tokens_per_req=1, max_num_reqs=max_num_reqs,
                                          max_blocks=max_blocks, block_size=self.block_size, device=self.device,
                                          use_triton=self.attn_backend.use_triton,
                                          invariant=self.attn_backend.invariant)
            self.step_graph.capture(stream, pool)
        if piecewise_tokens > 0 and self.attn_backend.use_triton:
            self.piecewise = PiecewiseGraphs(self.model, self.kv, max_tokens=piecewise_tokens, device=self.device)
            self.piecewise.capture(stream, pool)

    def _forward(self, ids: Tensor, positions: Tensor, meta) -> Tensor:
        """The draft's forward over a catch-up batch -> hidden [num_tokens, hidden] (pieces of
        graphs where they take it)."""
        return forward(self.model, self.kv, self.piecewise, ids, positions, meta)

    # ---------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, plan: StepPlan, batch: Batch, row_tokens: Tensor, num_emitted: Tensor,
                masks: DraftMasks | None = None) -> dict[int, tuple[int, int]] | None:
        """Catch the draft up on this step's tokens (and any it skipped before), then draft
        num_next_drafts tokens for every sampling request that does not skip the draft.

        masks: the structured-output requests' grammars (grammar-aware drafting), whose rows mask
        their draft logits before each draft is taken. The round then runs step by step, each
        step's drafts of those requests brought to the host (a wait) while the next forward runs.

        -> the requests (plan.reqs indices) that propose fewer drafts than their plan's, with how
        many and how many draft steps their chain ran (draft_confidence_threshold's early stop,
        tandem/spec/confidence.py); None: none."""
        k = max((plan.reqs[i].num_next_drafts for i in batch.sampling), default=0)
        drafting = [n for n, i in enumerate(batch.sampling) if plan.reqs[i].num_next_drafts]  # into batch.sampling
        if masks is not None:
            try:
                self._propose(plan, batch, row_tokens, num_emitted, k, drafting,
                              _Constrained.of(masks, batch, drafting, row_tokens, num_emitted,
                                              self.attn_backend.upload))
            finally:
                masks.finish()
            return None
        stop = self._propose(plan, batch, row_tokens, num_emitted, k, drafting, None)
        if stop is None:
            return None
        planned = [plan.reqs[batch.sampling[n]].num_next_drafts for n in drafting]
        return {batch.sampling[n]: (c, s) for n, c, s, p in zip(drafting, stop.counts, stop.steps, planned)
                if c < p} or None

    def _propose(self, plan: StepPlan, batch: Batch, row_tokens: Tensor, num_emitted: Tensor, k: int,
                 drafting: list[int], constrained: _Constrained | None) -> ConfidenceStop | None:
        """-> the confidence stop's record of the round, when it ran (None: every chain drafted its plan)."""
        layout = _catchup_layout(plan, batch.input_ids.shape[0], extra=k > 0)
        if not layout.lens:
            return None  # every request skips the draft
        sampling = [plan.reqs[batch.sampling[n]] for n in drafting]
        positions_host = [p for st, n in zip(layout.starts, layout.lens) for p in range(st, st + n)]
        max_kv = max((r.start_pos + r.num_new_tokens + k for r in sampling), default=0)
        max_blocks = -(-max_kv // self.block_size)
        row_base_host = [batch.cu_num_rows[n] for n in drafting]
        some = len(drafting) < len(batch.sampling)
        src_t, positions, row_base, extra_t, slots, backfill, picked = self.attn_backend.upload(
            layout.src, positions_host, row_base_host, layout.extra_rows, [r.slot for r in sampling],
            layout.backfill, drafting if some else [],
        )
        ids = torch.cat([batch.input_ids, batch.input_ids.new_zeros(1), backfill])[src_t]
        if self.clamp_ids:
            ids = ids.clamp_(max=self.draft_vocab - 1)
        # rowwise=False: for a draft, the CPU reference may batch short queries
        meta = self.attn_backend.prefill(layout.starts, layout.lens, layout.tables, rowwise=False, slots=layout.slots)
        if not sampling:
            self._forward(ids, positions, meta)
            return None
        # The token the target emitted goes right after the accepted drafts: base + num_accepted.
        num_accepted = (num_emitted[picked] if some else num_emitted) - 1  # [num_drafting]
        new_tokens = row_tokens[row_base + num_accepted]  # [num_drafting]
        if self.clamp_ids:
            new_tokens = new_tokens.clamp(max=self.draft_vocab - 1)
        new_rows = extra_t + num_accepted
        ids[new_rows] = new_tokens
        table = self.attn_backend.rows(slots, max_blocks, [r.block_ids for r in sampling])  # [num_drafting, <= nb]
        if self._local_argmax(sampling, constrained):
            self._greedy_round(ids, positions, meta, new_rows, slots, table, max_kv, k)
            return None
        catchup = self._catchup_graph(plan, batch)
        # constrained or processed: step by step
        graphs = self.graphs.get(k) if constrained is None and not self._processes(sampling) else None
        # outputs before each first draft: at least the step's one emitted token (its accepted drafts
        # are on the device only), for min_tokens
        num_outputs = [r.num_output_tokens + 1 for r in sampling]
        if catchup is graphs and graphs is not None and self._greedy(sampling):  # the whole round in one replay
            graphs.run_round(len(plan.reqs), ids, positions, meta.slot_mapping, meta.block_tables,
                             meta.seq_lens, new_rows, slots, table)
            return None
        if catchup is not None:
            logits = catchup.catchup.replay(len(plan.reqs), ids, positions, meta.slot_mapping,
                                            meta.block_tables, meta.seq_lens)[new_rows]
        else:
            logits = self.model.compute_logits(self._forward(ids, positions, meta)[new_rows])
        pos = positions[new_rows]  # [num_drafting] position of the emitted token
        mask = None
        if constrained is not None:  # the masks are made while the catch-up runs
            mask = constrained.first()
        # A structured-output round keeps its plan's drafts: its masks and draft copies follow them.
        stop = None
        if self.confidence_threshold is not None and constrained is None:  # (CPU only: LLM refuses it on CUDA)
            stop = ConfidenceStop(self.confidence_threshold, [r.num_next_drafts for r in sampling])
        self._draft_step(0, logits, slots, pos + 1, sampling, num_outputs, mask)
        if stop is not None and stop.after(0, logits[:, : self.head_cols]):
            return stop
        if graphs is not None and graphs.loops and self._greedy(sampling) and graphs.bucket(len(sampling)) is not None:
            graphs.run_loop(slots, pos, table)
            return None
        for step in range(1, k):
            if constrained is not None:
                constrained.copy_drafts(self.drafts, slots, step - 1)  # before the forward: it waits for the copy only
            pos = pos + 1  # position of drafts[:, step - 1]
            safe = pos.clamp(max=self.max_model_len - 1)
            meta = self.attn_backend.decode(safe, table, max_kv)
            logits = self._step_logits(self.drafts[slots, step - 1], safe, meta)
            if constrained is not None:  # the masks are made while the forward runs
                mask = constrained.next()
            self._draft_step(step, logits, slots, pos + 1, sampling, num_outputs, mask)
            if stop is not None and stop.after(step, logits[:, : self.head_cols]):
                break
        return stop

    def _local_argmax(self, sampling, constrained: _Constrained | None) -> bool:
        """Whether a round's drafts are argmaxes a tensor-parallel draft can take from each rank's
        best token alone (CausalLM.top_tokens): greedy, free of grammars, over a draft vocabulary no
        larger than the target's (a pruned head is never sharded: SpeculatorFactory)."""
        return (self.local_argmax and self.confidence_threshold is None and self.model.tp is not None
                and constrained is None and self._greedy(sampling) and not self._processes(sampling)
                and self.model.arch.vocab_size == self.draft_vocab and self.hot_ids is None)

    def _greedy_round(self, ids: Tensor, positions: Tensor, meta, new_rows: Tensor, slots: Tensor, table: Tensor,
                      max_kv: int, k: int) -> None:
        """A greedy round under tensor parallelism: the catch-up forward, then k - 1 draft steps,
        each draft the argmax reduced across the ranks (2 values a row per rank, not V / tp)."""
        self.drafts[slots, 0] = self.model.top_tokens(self._forward(ids, positions, meta)[new_rows])
        pos = positions[new_rows]  # [num_drafting] position of the emitted token
        for step in range(1, k):
            pos = pos + 1  # position of drafts[:, step - 1]
            safe = pos.clamp(max=self.max_model_len - 1)
            hidden = self._forward(self.drafts[slots, step - 1], safe, self.attn_backend.decode(safe, table, max_kv))
            self.drafts[slots, step] = self.model.top_tokens(hidden)

    def _step_logits(self, ids: Tensor, positions: Tensor, meta) -> Tensor:
        """One draft step's logits [n, V] over ids [n] at positions [n] (the step graph where it fits)."""
        graph = self.step_graph
        if graph is not None and graph.bucket(ids.shape[0]) is not None:
            return graph.replay(ids.shape[0], ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        return self.model.compute_logits(self._forward(ids, positions, meta))

    # ---------------------------------------------------------------- repair
    @torch.inference_mode()
    def repair(self, items: list[Redraft], masks: DraftMasks) -> None:
        """Grammar-aware drafting by repair (the GPU's way: a round runs free, as one graph, and only
        drafts that leave the grammar cost anything): each item's drafts from its first misfit on
        are drawn again under the grammar, one draft step at a time (a wait for each, the masks
        following the drafts), into the draft buffers.

        masks[j]: item j's matcher advanced over its emitted tokens and the drafts before the
        misfit. The misfit's own column is drawn from the round's logits: a sampled request's
        cached draft logits (so its draft distribution stays exact: with the same noise, the draft
        is the draw among the tokens that fit, whichever way it got there), a greedy one's step
        recomputed; the columns after it from fresh draft steps. A steered request's cached logits
        carry its processors but not the grammar, and the two may leave nothing: that row is drawn
        from a fresh step instead (processed with the grammar, or unprocessed where that too is
        empty, as the round draws it), which stays exact because its free draw then surely missed."""
        upload = self.attn_backend.upload
        max_kv = max(it.pos + it.num_drafts for it in items) + 1
        max_blocks = -(-max_kv // self.block_size)
        slots, pos, emitted = upload([it.slot for it in items], [it.pos for it in items], [it.token for it in items])
        table = self.attn_backend.rows(slots, max_blocks, [it.block_ids for it in items])  # [m, <= max_blocks]
        for col in range(min(it.first for it in items), max(it.num_drafts for it in items)):
            act = [j for j, it in enumerate(items) if it.first <= col < it.num_drafts]
            if not act:
                continue
            (act_t,) = upload(act)
            slots_a = slots[act_t]
            ids = emitted[act_t] if col == 0 else self.drafts[slots_a, col - 1]  # the token before the draft
            if self.clamp_ids:
                ids = ids.clamp(max=self.draft_vocab - 1)
            at = pos[act_t] + col  # the position of the token before the draft
            safe = at.clamp(max=self.max_model_len - 1)
            cached = [r for r, j in enumerate(act) if items[j].first == col and self._caches_logits(items[j].slot)]
            fresh = [r for r in range(len(act)) if r not in cached]
            steered = [n for n, r in enumerate(cached) if items[act[r]].slot in self.state.steered]
            logits = None  # (rows that all draw from their cached logits need no forward)
            if fresh or steered:
                logits = self._step_logits(ids, safe, self.attn_backend.decode(safe, table[act_t], max_kv))
            bitmask = upload.words(masks.rows(act))
            for group, from_cache in ((fresh, False), (cached, True)):
                if not group:
                    continue
                (rows_t,) = upload(group)
                group_slots = slots_a[rows_t]
                group_items = [items[act[r]] for r in group]
                num_outputs = [it.num_outputs for it in group_items]
                mask = (torch.arange(len(group), device=self.device), bitmask[rows_t])
                if not from_cache:
                    self._draft_step(col, logits[rows_t], group_slots, at[rows_t] + 1, group_items, num_outputs, mask)
                    continue
                group_logits = self.draft_logits[group_slots, col]  # [g, V], a copy
                if steered:
                    self._refill_empty(group_logits, steered, logits[rows_t], col, group_slots, at[rows_t] + 1,
                                       group_items, num_outputs, mask)
                self._draft_step(col, group_logits, group_slots, at[rows_t] + 1, group_items, num_outputs, mask,
                                 cached=True)
            tokens, ready = to_host(self.drafts[slots_a, col])
            if ready is not None:
                ready.synchronize()  # SYNC: the next column's masks follow this one's drafts
            for j, token in zip(act, tokens.tolist()):
                masks.advance(j, [token])

    def _refill_empty(self, cached: Tensor, rows: list[int], logits: Tensor, col: int, slots: Tensor, gen_pos: Tensor,
                      items: list[Redraft], num_outputs: list[int], mask: tuple[Tensor, Tensor]) -> None:
        """repair: the cached draft logits [g, V] of a column's misfits, in place: those of rows (into
        them: steered requests) that their grammar (mask) leaves empty become the fresh step's logits
        [g, head_cols] processed under the grammar (_processed)."""
        (rows_t,) = self.attn_backend.upload(rows)
        own = (torch.arange(len(rows), device=self.device), mask[1][rows_t])  # the rows' grammar masks
        mine = cached[rows_t]  # [r, V]
        kept = mine.clone()
        apply_token_bitmask(kept, *own)
        empty = torch.isneginf(kept).all(dim=-1, keepdim=True)  # [r, 1]
        fresh = self._processed(self._full_logits(logits[rows_t], self.state.temperature[slots[rows_t]]), col,
                                slots[rows_t], gen_pos[rows_t], [items[n] for n in rows], [num_outputs[n] for n in rows],
                                own)
        cached[rows_t] = torch.where(empty, fresh, mine)

    def _caches_logits(self, slot: int) -> bool:
        """Whether a request's drafts are sampled and their logits cached (probabilistic drafting at
        temperature > 0, not watermarked)."""
        wm = self.state.watermark
        return (self.draft_logits is not None and self.state.params[slot].temperature > 0
                and not (wm is not None and wm.on[slot]))

    def _processes(self, sampling) -> bool:
        """Whether any request of a round drafts under logits processors of its own (_processed)."""
        steered = self.state.steered
        return bool(steered) and any(r.slot in steered for r in sampling)

    def _greedy(self, sampling) -> bool:
        """Whether every draft of the round is an argmax (the captured draft loop's case): not
        with a watermarked request (its drafts are keyed draws), nor a sampled one's
        probabilistic drafts."""
        wm = self.state.watermark
        if wm is not None and any(wm.on[r.slot] for r in sampling):
            return False
        return not self.probabilistic or all(self.state.params[r.slot].temperature == 0 for r in sampling)

    def _catchup_graph(self, plan: StepPlan, batch: Batch) -> DraftGraphs | None:
        """The graphs whose catch-up forward fits this step (every request verified the same
        number of drafts, all sample and none skips or backfills the draft), else None."""
        graphs = self.graphs.get(plan.reqs[0].num_drafts)
        if graphs is None or graphs.catchup.bucket(len(plan.reqs)) is None or len(batch.sampling) != len(plan.reqs):
            return None
        d = graphs.k
        if all(len(r.input_token_ids) == 1 and r.num_drafts == d and not r.draft_skip and not r.draft_backfill
               for r in plan.reqs):
            return graphs
        return None

    def _draft_step(self, step: int, logits: Tensor, slots: Tensor, gen_pos: Tensor, sampling, num_outputs: list[int],
                    mask: tuple[Tensor, Tensor] | None = None, cached: bool = False) -> None:
        """Sample drafts[:, step] from the draft's logits: a draft step's [n, head_cols], or cached
        ones [n, V] (repair); gen_pos [n] is the position of the token being drafted (the noise
        key, with the column step: draft_salt). Watermarked requests draw with the target's keyed noise on the draft's distribution,
        whatever draft_sample_method says: the shared noise is what makes a draft equal the
        target's keyed draw.

        mask (rows [m] into logits, bitmask [m, words], on the device): structured outputs' grammar.
        The draft distribution of those rows is the draft's own restricted to the tokens the grammar
        allows (their logits are kept that way for the ratio test). A structured-output request's
        drafts skip the draft-side min-p / top-k / top-p (the target still applies them): untruncated, a
        draw among the tokens that fit is the same whether the mask comes before the draw or after
        a free draw that missed (DraftSpeculator.repair), and never from an empty set.

        num_outputs [n]: each row's output tokens before its column-0 draft (a lower bound is
        enough: it only decides min_tokens for the draft, see _processed; repair counts as the round
        does, so both ways draft the same). cached: the logits are cached draft logits, which the
        processors already shaped (repair)."""
        greedy = self._greedy(sampling)
        processes = not cached and self._processes(sampling)
        if greedy and mask is None and not processes and (self.hot_ids is None or logits.shape[-1] == self.head_cols):
            tokens = greedy_tokens(logits[:, : self.head_cols], self.attn_backend.use_triton)  # the head's argmax
            self.drafts[slots, step] = tokens if self.hot_ids is None else self.hot_ids[tokens]
            return
        temp = self.state.temperature[slots]
        logits = self._full_logits(logits, temp)
        if processes:
            logits = self._processed(logits, step, slots, gen_pos, sampling, [n + step for n in num_outputs], mask)
        if greedy:
            if mask is not None:
                apply_token_bitmask(logits, *mask)
            self.drafts[slots, step] = greedy_tokens(logits, self.attn_backend.use_triton)
            return
        params = [self.state.params[r.slot] for r in sampling]
        scaled = divide_by_temperature(logits, temp, [r.slot for r in sampling], self.state)
        cut = [p.min_p > 0 and p.structured_outputs is None for p in params]
        truncated = [(p.top_k > 0 or p.top_p < 1) and p.structured_outputs is None for p in params]
        # min-p, then top-k / top-p: the target's order (apply_temperature_and_masks), on the rows that ask
        # only; structured-output rows keep their whole distribution
        upload = self.attn_backend.upload
        on_rows(scaled, [i for i, c in enumerate(cut) if c], upload,
                lambda sub, idx: apply_min_p(sub, self.state.min_p[slots[idx]]))
        on_rows(scaled, [i for i, t in enumerate(truncated) if t], upload,
                lambda sub, idx: apply_top_k_top_p(sub, self.state.top_k[slots[idx]], self.state.top_p[slots[idx]]))
        if mask is not None:
            apply_token_bitmask(scaled, *mask)
            apply_token_bitmask(logits, *mask)
        wm = self.state.watermark
        marked = [n for n, r in enumerate(sampling) if wm is not None and wm.on[r.slot]]
        tokens = logits.argmax(dim=-1)  # greedy drafts, and every request at temperature 0
        unmarked = len(marked) < len(sampling)
        if self.probabilistic and unmarked:
            drawn = draw(scaled, self.state.seeds[slots], gen_pos, draft_salt(step), self.attn_backend.use_triton)
            tokens = torch.where(temp > 0, drawn, tokens)
        if marked:  # (temperature > 0 by definition)
            (idx,) = self.attn_backend.upload(marked)
            slot_m = slots[idx]
            hashes, seen = wm.keys(slot_m, self.drafts, slot_m, torch.full_like(idx, step))
            tokens[idx] = keyed_draw(scaled[idx], wm.key, hashes, seen, self.state.seeds[slot_m], gen_pos[idx],
                                     self.attn_backend.use_triton)
        self.drafts[slots, step] = tokens
        if self.draft_logits is not None and unmarked:  # (keyed rows verify by exact match: no q)
            self.draft_logits[slots, step] = torch.where(scaled == float("-inf"), scaled, logits)

    def _processed(self, logits: Tensor, step: int, slots: Tensor, gen_pos: Tensor, sampling, num_outputs: list[int],
                   mask: tuple[Tensor, Tensor] | None) -> Tensor:
        """fp32 logits [n, V] -> a new [n, V]: each row under its request's steering logits processors
        (allowed_token_ids, bad words, logit_bias, min_tokens; tandem.sampling.processors; not penalties),
        the drafts before column `step` counted as output, as the target's verification counts
        them. A draft is free to come from any distribution (the verification keeps the output the
        target's), so these are for acceptance: num_outputs [n] may fall short of the truth (min_tokens
        then holds a stop id back a draft or two longer than the target does). A row the processors
        and its grammar (mask) leave empty keeps its logits unprocessed."""
        rows = SampleRows(slots=[r.slot for r in sampling], slot_ids=slots, positions=gen_pos, num_outputs=num_outputs,
                          prior_drafts=self.drafts[slots, :step] if step else None)
        out = logits.clone()
        apply_logits_processors(out, self.state, rows, penalties=False)
        if mask is not None:
            apply_token_bitmask(out, *mask)
        empty = torch.isneginf(out).all(dim=-1, keepdim=True)  # [n, 1]
        return torch.where(empty, logits, out)

    def _full_logits(self, logits: Tensor, temp: Tensor) -> Tensor:
        """A draft step's logits [n, head_cols] (or cached ones, [n, V]) -> fp32 [n, V] over the
        target's ids; temp [n]: the rows' temperatures (0: greedy).

        Ids a smaller draft table lacks get -inf (probability zero). The other ids a pruned head does
        not score get the row's least logit minus 1e4 * max(1, temperature): probability zero (exp(-1e4)
        is 0 in fp32) while a hot token is left, yet finite, so a grammar that allows only tokens
        outside the hot set still leaves a distribution to draw from (uniform over them, drawn by
        the same Gumbel noise the ratio test's q describes): the draft stays a true sample of q."""
        logits = logits.float()
        if logits.shape[-1] == self.vocab_size and (self.hot_ids is not None or self.draft_vocab == self.vocab_size):
            return logits  # cached draft logits (or a whole head): already over the target's ids
        if self.hot_ids is None:
            logits = logits[:, : self.draft_vocab]
            if self.draft_vocab < self.vocab_size:  # ids the draft lacks: probability zero
                logits = F.pad(logits, (0, self.vocab_size - self.draft_vocab), value=float("-inf"))  # [n, V]
            return logits
        floor = logits.amin(dim=-1, keepdim=True) - 1e4 * temp.clamp(min=1.0)[:, None]  # [n, 1]
        full = floor.expand(logits.shape[0], self.vocab_size).clone()  # [n, V]
        if self.draft_vocab < self.vocab_size:  # ids the draft lacks: probability zero, as without a hot set
            full[:, self.draft_vocab :] = float("-inf")
        return full.index_copy_(1, self.hot_ids, logits)


@dataclass(slots=True)
class Redraft:
    """A request whose drafts are drawn again from its first misfit on (DraftSpeculator.repair)."""

    slot: int
    pos: int  # the position of the token it emitted last (its first draft's predecessor)
    token: int  # that token
    block_ids: list[int]
    first: int  # the column of its first draft that left the grammar
    num_drafts: int  # its drafts this round
    num_outputs: int  # its output tokens before its first draft (column 0), counted as the round counts them


class _Constrained:
    """A drafting round's grammar-aware part: where the constrained requests' rows are, and their
    tokens on the way to the host (the step's emitted tokens, then each step's drafts)."""

    def __init__(self, masks: DraftMasks, rows: Tensor, starts: list[int], counts: list[int], host: Tensor,
                 ready: torch.cuda.Event | None, upload):
        self.masks = masks
        self._rows = rows  # [m] per constrained request: its row among the round's drafting requests
        self._starts = starts  # per constrained request: its first row in the step's row tokens
        self._counts = counts  # per constrained request: its entry in host after the row tokens
        self._host = host  # [num_rows + num_sampling] int64: row tokens, then num_emitted
        self._ready = ready
        self._upload = upload
        self._drafts: tuple[Tensor, torch.cuda.Event | None] | None = None

    @classmethod
    def of(cls, masks: DraftMasks, batch: Batch, drafting: list[int], row_tokens: Tensor, num_emitted: Tensor,
           upload) -> _Constrained:
        """Start the copy of the step's emitted tokens to the host (no wait)."""
        row_of = {batch.sampling[n]: j for j, n in enumerate(drafting)}  # plan.reqs index -> drafting row
        n_of = {i: n for n, i in enumerate(batch.sampling)}
        if any(i not in row_of for i in masks.reqs):
            raise RuntimeError("a structured-output request got draft masks but drafts nothing this step")
        host, ready = to_host(torch.cat([row_tokens, num_emitted]))
        (rows,) = upload([row_of[i] for i in masks.reqs])
        starts = [batch.cu_num_rows[n_of[i]] for i in masks.reqs]
        counts = [row_tokens.shape[0] + n_of[i] for i in masks.reqs]
        return cls(masks, rows, starts, counts, host, ready, upload)

    def first(self) -> tuple[Tensor, Tensor]:
        """The masks of the first drafts (waits for the step's emitted tokens) -> _draft_step's mask."""
        if self._ready is not None:
            self._ready.synchronize()  # SYNC: grammar-aware drafting starts from the emitted tokens
        flat = self._host.tolist()
        for j, (start, at) in enumerate(zip(self._starts, self._counts)):
            self.masks.advance(j, flat[start : start + flat[at]])
        return self._rows, self._upload.words(self.masks.rows())

    def copy_drafts(self, drafts: Tensor, slots: Tensor, col: int) -> None:
        """Start the copy to the host of the constrained requests' drafts[:, col] (no wait)."""
        self._drafts = to_host(drafts[slots[self._rows], col])

    def next(self) -> tuple[Tensor, Tensor]:
        """The masks of the next drafts, after the ones copy_drafts started (waits for that copy only)."""
        mine, event = self._drafts
        if event is not None:
            event.synchronize()  # SYNC: one a draft step, queued before the forward it runs beside
        for j, token in enumerate(mine.tolist()):
            self.masks.advance(j, [token])
        return self._rows, self._upload.words(self.masks.rows())


@dataclass(slots=True)
class CatchupLayout:
    """The draft's catch-up batch: per request that runs the draft, the tokens it skipped
    earlier (backfill), the step's target tokens and, when drafting, one slot for the token the
    target emits."""

    starts: list[int]  # per entry: the position of its first token
    lens: list[int]  # per entry: its tokens
    tables: list[list[int]]  # per entry: the block table
    slots: list[int]  # per entry: the request's slot
    src: list[int]  # per token: its row in [target ids, a zero placeholder, backfill ids]
    extra_rows: list[int]  # per drafting request: the row of its emitted token's slot, before acceptance
    backfill: list[int]  # the backfill token ids, in order


def _catchup_layout(plan: StepPlan, num_target_tokens: int, extra: bool) -> CatchupLayout:
    """extra: add the emitted token's slot for each sampling request that drafts."""
    out = CatchupLayout([], [], [], [], [], [], [])
    offset = target_offset = 0
    for r in plan.reqs:
        q = r.num_new_tokens
        bf = r.draft_backfill
        if bf or not r.draft_skip:
            at = num_target_tokens + 1 + len(out.backfill)
            out.src.extend(range(at, at + len(bf)))
            out.backfill.extend(bf)
            n = len(bf)
            if not r.draft_skip:
                out.src.extend(range(target_offset, target_offset + q))
                n += q
                if extra and r.sample:
                    out.src.append(num_target_tokens)
                    out.extra_rows.append(offset + len(bf) + len(r.input_token_ids))
                    n += 1
            out.starts.append(r.draft_backfill_start if bf else r.start_pos)
            out.lens.append(n)
            out.tables.append(r.block_ids)
            out.slots.append(r.slot)
            offset += n
        target_offset += q
    return out
