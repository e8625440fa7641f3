"""ModelRunner: executes a StepPlan on the device and answers with a StepResult.

A step is launch() then collect(). launch() reads top to bottom: install new slots, build the
batch, run the model over every scheduled token (forward()), then launch_sampling(): apply the
plan's grammar masks, sample (or verify drafts when a speculator is present), start the copy of
the results to the host, and let the speculator propose the next drafts; nothing in it waits
for the device. collect() waits for that copy (the step's one
synchronisation) and reads it. So the host applies a step's result while the device still
drafts, and the engine may launch the next decode step before collecting this one
(Scheduler.schedule_ahead).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tandem.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.models.decoder import CausalLM, KVCache
from tandem.plan import StepPlan, StepResult, TokenLogprobs
from tandem.layers.backend import AttnBackend
from tandem.runner.graphs import GraphRunner
from tandem.runner.piecewise import PiecewiseGraphs, forward
from tandem.runner.inputs import Batch, build_batch
from tandem.upload import to_host
from tandem.sampling.processors import CHUNK_ROWS, apply_token_bitmask
from tandem.sampling.sampler import compute_logprobs, process_logits, sample
from tandem.sampling.state import SamplingState
from tandem.sampling.watermark import WatermarkConfig

if TYPE_CHECKING:
    from tandem.engine.grammar import DraftMasks


@dataclass(slots=True)
class Forwarded:
    """A step whose forward is queued but not its sampling (ModelRunner.forward): what
    ModelRunner.launch_sampling needs to finish it."""

    plan: StepPlan
    batch: Batch
    logits: Tensor  # [num_rows, vocab]
    prompt: Tensor | None  # prompt logprobs rows, or None


@dataclass(slots=True)
class Launched:
    """A step whose device work is queued; ModelRunner.collect() turns it into a StepResult."""

    plan: StepPlan
    sampling: list[int]  # indices into plan.reqs of the requests that sample
    cu_num_rows: list[int]  # [len(sampling) + 1] logits rows per sampling request
    row_logprobs: list[int | None]  # per logits row: top-n logprobs wanted (None: none)
    num_top: int | None  # widest top-n of the step (None: no logprobs)
    host: Tensor  # the results, being copied to (pinned) host memory
    ready: torch.cuda.Event | None  # recorded after the copy (None on CPU: already there)
    prompt_host: Tensor | None = None  # prompt logprobs rows [num_prompt_rows, 2 + 2 * top], same copy
    prompt_ks: dict[int, int] | None = None  # plan.reqs index -> its prompt top-n
    # Structured outputs' next drafts: (plan.reqs indices, their drafts [m, k] being copied to the
    # host after the draft round, the event recorded after that copy)
    drafts: tuple[list[int], Tensor, torch.cuda.Event | None] | None = None
    masked_drafts: bool = False  # its drafting round masked structured-output requests' drafts step by step
    # plan.reqs index -> (drafts proposed, draft steps its chain ran), for requests whose round proposed
    # fewer than num_next_drafts (draft_confidence_threshold's early stop); None: every request its plan's
    fewer_drafts: dict[int, tuple[int, int]] | None = None
    # Every sampling request's drafts proposed [num_sampling], being copied to the host after a round
    # that counts them on the device (a lookup, n-gram or suffix), and the event after that copy; None: not counted so
    draft_counts: tuple[Tensor, torch.cuda.Event | None] | None = None


class ModelRunner:
    """Owns the target model, its KV cache and the per-slot sampling state."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cache: CacheConfig,
        sched: SchedulerConfig,
        device: torch.device,
        model: CausalLM,
        watermark: WatermarkConfig | None = None,
    ):
        self.model = model
        self.device = device
        self.block_size = cache.block_size
        self.attn_backend = AttnBackend(cache.block_size, device, max_num_seqs=sched.max_num_seqs,
                                        max_model_len=sched.max_model_len, invariant=model_cfg.batch_invariant)
        self.kv = KVCache(model.arch, cache.num_blocks, cache.block_size, cache.kv_dtype(model_cfg.dtype), device)
        self.vocab_size = model_cfg.arch.vocab_size
        self.logprobs_mode = model_cfg.logprobs_mode
        self.state = SamplingState(sched.max_num_seqs, self.vocab_size, model_cfg.arch.eos_token_ids, device,
                                   use_triton=self.attn_backend.use_triton, upload=self.attn_backend.upload,
                                   watermark=watermark, max_model_len=sched.max_model_len)
        self.speculator = None  # set by the engine when a draft model is configured
        self.graphs: dict[int, GraphRunner] = {}  # tokens per request -> captured forward
        self.piecewise: PiecewiseGraphs | None = None  # the other steps' forward, cut at the attention
        # [max_num_seqs] int64: each slot's last sampled token, for steps planned ahead of it
        # (PENDING_TOKEN inputs); allocated by enable_pending_inputs().
        self.last_tokens: Tensor | None = None
        self._max_num_seqs = sched.max_num_seqs

    def enable_pending_inputs(self) -> None:
        """Keep each slot's sampled token on the device so a plan made before the host knows
        it (Scheduler.schedule_ahead) can feed it. Only steps without drafts are planned ahead,
        so only those steps' tokens (one row per request) are kept."""
        self.last_tokens = torch.zeros(self._max_num_seqs, dtype=torch.int64, device=self.device)

    def capture_graphs(self, tokens_per_req: list[int], max_num_reqs: int, max_blocks: int, stream: torch.cuda.Stream,
                       pool=None, piecewise_tokens: int = 0) -> None:
        """Capture uniform decode / verification steps (CUDA only) on stream, into the graph memory
        pool `pool`, and the piecewise forward of other steps of up to piecewise_tokens tokens
        (0: none; needs the Triton kernels). The graphs share one logits buffer: a step uses its
        logits before the next step replays (with a lookup at k = 8 and 256 requests that is 9 x 256
        rows instead of 45 x 256: 2.4 GB less of a 128k vocabulary in bf16)."""
        head = self.model.lm_head.weight
        logits = torch.empty(max_num_reqs * max(tokens_per_req, default=1), head.shape[0], dtype=head.dtype,
                             device=self.device)  # [max_num_reqs * max t, vocab]
        for t in tokens_per_req:
            runner = GraphRunner(self.model, self.kv, tokens_per_req=t, max_num_reqs=max_num_reqs,
                                 max_blocks=max_blocks, block_size=self.block_size, device=self.device,
                                 use_triton=self.attn_backend.use_triton, logits=logits,
                                 invariant=self.attn_backend.invariant)
            runner.capture(stream, pool)
            self.graphs[t] = runner
        if piecewise_tokens > 0 and self.attn_backend.use_triton:
            self.piecewise = PiecewiseGraphs(self.model, self.kv, max_tokens=piecewise_tokens, device=self.device)
            self.piecewise.capture(stream, pool)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    def release(self, plan: StepPlan) -> None:
        """What plan releases: its freed slots' sampling state, and the responses that ended, to the
        speculator (before their slots take new requests). The engine calls it for a plan that runs
        nothing; forward() for the others."""
        for slot in plan.freed_slots:
            self.state.remove(slot)
        self.attn_backend.clear_slots(plan.freed_slots)
        if self.speculator is not None and plan.finished_outputs:
            self.speculator.finished(plan.finished_outputs)

    def launch(self, plan: StepPlan) -> Launched:
        """Queue a step's device work; never waits for the device."""
        return self.launch_sampling(self.forward(plan))

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> Forwarded:
        """Queue a step's forward (slots installed, the batch built, the logits computed); its
        sampling waits for launch_sampling(). The engine splits a step this way when it has
        grammar masks to make: they are made while the forward runs, and for a step planned ahead
        once the step before it has been collected."""
        self.attn_backend.upload.new_step()  # the step before the previous one was collected
        self.release(plan)
        self.state.add_all(plan.new_reqs)
        self.attn_backend.clear_slots([new.slot for new in plan.new_reqs])
        for new in plan.new_reqs:
            if self.speculator is not None:
                self.speculator.add(new)
        batch = build_batch(plan, self.attn_backend)
        if batch.pending_dst is not None:
            batch.input_ids[batch.pending_dst] = self.last_tokens[batch.pending_slots]
        if batch.draft_dst is not None:
            batch.input_ids[batch.draft_dst] = self.speculator.pending_drafts(batch.draft_src)
        logits, hidden = self._logits(plan, batch)  # [num_rows, vocab]
        return Forwarded(plan, batch, logits, self._prompt_logprobs(plan, batch, hidden))

    @torch.inference_mode()
    def launch_sampling(self, fwd: Forwarded, draft_masks: DraftMasks | None = None) -> Launched:
        """Queue a forwarded step's sampling (or verification), the copy of its results to the
        host, and the next drafts; never waits for the device, except with draft_masks (the
        structured-output requests' grammars, which their drafts follow: Grammars.draft_masks),
        where the drafting round waits for each of their tokens in turn."""
        plan, batch, logits, prompt = fwd.plan, fwd.batch, fwd.logits, fwd.prompt
        grammar = None
        if plan.grammar is not None:  # before everything, as vLLM: logprobs see the constraint too
            grammar = self._apply_grammar(plan, batch, logits)
        raw = self._raw_for_logprobs(logits, batch)
        if self.speculator is None:
            processed = process_logits(logits, self.state, batch.rows)
            row_tokens = sample(processed, self.state, batch.rows)  # [num_rows]
            num_emitted = torch.ones(len(batch.sampling), dtype=torch.int64, device=self.device)
        else:
            processed, row_tokens, num_emitted = self.speculator.verify(plan, batch, logits, self.state, grammar)
        if self.last_tokens is not None and len(batch.rows.slots) == len(batch.sampling):
            self.last_tokens[batch.rows.slot_ids] = row_tokens  # one row per sampling request: no drafts
        self._record_outputs(batch, row_tokens, num_emitted)
        launched = self._copy_results(plan, batch, processed if raw is None else raw, row_tokens, num_emitted, prompt)
        if self.speculator is not None:  # the draft runs while the host applies this result
            fewer = self.speculator.propose(plan, batch, row_tokens, num_emitted, draft_masks)
            if isinstance(fewer, Tensor):  # counted on the device: collect() waits for them instead
                launched.draft_counts = to_host(fewer)
            else:
                launched.fewer_drafts = fewer
            launched.drafts = self._copy_constrained_drafts(plan, batch)
            launched.masked_drafts = draft_masks is not None
        return launched

    def _apply_grammar(self, plan: StepPlan, batch: Batch, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Mask the logits rows of structured-output requests with the plan's grammar bitmask
        -> (those rows [m], the bitmask [m, words]) on the device."""
        grammar, cu = plan.grammar, batch.cu_num_rows
        n_of = {i: n for n, i in enumerate(batch.sampling)}
        rows = [r for i in grammar.reqs for r in range(cu[n_of[i]], cu[n_of[i] + 1])]
        if len(rows) != grammar.bitmask.shape[0]:
            raise RuntimeError(f"the grammar bitmask has {grammar.bitmask.shape[0]} rows for {len(rows)} logits rows")
        (rows_t,) = self.attn_backend.upload(rows)
        bitmask = self.attn_backend.upload.words(torch.from_numpy(grammar.bitmask))
        apply_token_bitmask(logits, rows_t, bitmask)
        return rows_t, bitmask

    def _copy_constrained_drafts(self, plan: StepPlan, batch: Batch):
        """Start the copy to the host of the drafts just proposed for structured-output requests
        (their next step's bitmask rows follow the drafts) -> Launched.drafts, or None."""
        want = [i for i in batch.sampling if plan.reqs[i].num_next_drafts
                and self.state.params[plan.reqs[i].slot].structured_outputs is not None]
        if not want:
            return None
        (slots,) = self.attn_backend.upload([plan.reqs[i].slot for i in want])
        drafts, ready = to_host(self.speculator.drafts[slots])  # [m, k]
        return want, drafts, ready

    def _logits(self, plan: StepPlan, batch: Batch) -> tuple[Tensor, Tensor | None]:
        """-> logits [num_rows, vocab], and the hidden states [num_tokens, hidden] (None from a graph)."""
        graph = self._graph_for(plan)
        if graph is not None:
            a = batch.attn
            return graph.replay(len(plan.reqs), batch.input_ids, batch.positions, a.slot_mapping, a.block_tables,
                                a.seq_lens), None
        hidden = forward(self.model, self.kv, self.piecewise, batch.input_ids, batch.positions, batch.attn)
        return self.model.compute_logits(hidden[batch.logits_indices]), hidden

    def _prompt_logprobs(self, plan: StepPlan, batch: Batch, hidden: Tensor | None) -> Tensor | None:
        """prompt_logprobs: the raw logprob, rank and top-n of each prompt token a chunk row predicts
        -> [num_prompt_rows, 2 + 2 * top] fp64 (None when no request asks). Prefill chunks never run
        as whole-step graphs, so their hidden states are at hand."""
        if batch.prompt_rows is None:
            return None
        top = max(self.state.params[plan.reqs[i].slot].prompt_logprobs for i in batch.prompt_reqs)  # the widest
        parts = []
        for i in range(0, batch.prompt_rows.shape[0], CHUNK_ROWS):  # bounds the [rows, V] temporaries
            rows = batch.prompt_rows[i : i + CHUNK_ROWS]
            logits = self.model.compute_logits(hidden[rows])[:, : self.vocab_size].float()
            lp, rank, top_ids, top_lp = compute_logprobs(logits, batch.prompt_targets[i : i + CHUNK_ROWS], top)
            parts.append(torch.cat([lp[:, None].double(), rank[:, None].double(), top_ids.double(), top_lp.double()],
                                   dim=1))
        return torch.cat(parts)

    def _graph_for(self, plan: StepPlan) -> GraphRunner | None:
        """A captured graph when every request feeds 1 token + the same number of drafts."""
        if not self.graphs:
            return None
        t = plan.reqs[0].num_new_tokens
        graph = self.graphs.get(t)
        if graph is None or graph.bucket(len(plan.reqs)) is None:
            return None
        if all(r.sample and len(r.input_token_ids) == 1 and r.num_new_tokens == t for r in plan.reqs):
            return graph
        return None

    def _record_outputs(self, batch: Batch, row_tokens: Tensor, num_emitted: Tensor) -> None:
        """Penalty counts, bad-word windows and watermark contexts follow the emitted tokens on the
        device (no host round trip)."""
        rows = batch.rows
        cu = batch.cu_num_rows
        if self.state.watermark is not None:
            self._record_watermark(batch, row_tokens, num_emitted)
        if not (self.state.output_counts or self.state.recent):
            return
        row_req_host = [n for n in range(len(batch.sampling)) for _ in range(cu[n + 1] - cu[n])]
        row_req, start = self.attn_backend.upload(row_req_host, cu[:-1])
        emitted = (torch.arange(len(rows), device=self.device) - start[row_req]) < num_emitted[row_req]
        tokens = torch.where(emitted, row_tokens, -1)
        self.state.record_outputs(rows.slots, tokens[:, None])

    def _record_watermark(self, batch: Batch, row_tokens: Tensor, num_emitted: Tensor) -> None:
        """Slide the watermarked requests' context windows over the tokens they emitted."""
        wm, cu = self.state.watermark, batch.cu_num_rows
        marked = [n for n in range(len(batch.sampling)) if wm.on[batch.rows.slots[cu[n]]]]
        if not marked:
            return
        width = max(cu[n + 1] - cu[n] for n in marked)
        pad = cu[-1]  # the row of the -1 appended below
        index = [cu[n] + j if j < cu[n + 1] - cu[n] else pad for n in marked for j in range(width)]
        index_t, marked_t, slot_t = self.attn_backend.upload(index, marked, [batch.rows.slots[cu[n]] for n in marked])
        tokens = torch.cat([row_tokens, row_tokens.new_full((1,), -1)])[index_t].view(len(marked), width)
        wm.record(slot_t, tokens, num_emitted[marked_t])

    def _raw_for_logprobs(self, logits: Tensor, batch: Batch) -> Tensor | None:
        """The raw logits [num_rows, V] fp32 that logprobs are taken from under logprobs_mode
        "raw_logprobs", kept apart from the processors (which write in place); None when no row
        wants logprobs or they come from the processed distribution."""
        if self.logprobs_mode != "raw_logprobs" or all(self.state.params[s].logprobs is None for s in batch.rows.slots):
            return None
        raw = logits[:, : self.vocab_size].float()
        return raw.clone() if raw.data_ptr() == logits.data_ptr() else raw

    def _copy_results(
        self, plan: StepPlan, batch: Batch, lp_logits: Tensor, row_tokens: Tensor, num_emitted: Tensor,
        prompt: Tensor | None = None,
    ) -> Launched:
        """Pack the step's results into one tensor and start its copy to pinned host memory;
        logprobs come from lp_logits [num_rows, V] (raw or processed, ModelConfig.logprobs_mode)."""
        want = [self.state.params[s].logprobs for s in batch.rows.slots]
        num_top = max((w for w in want if w is not None), default=None)
        if num_top is None:
            packed = torch.cat([row_tokens, num_emitted])  # [num_rows + num_sampling] int64
        else:
            lp, rank, top_ids, top_lp = self._row_logprobs(lp_logits, row_tokens, num_top, want)
            rows = torch.cat(
                [row_tokens[:, None].double(), lp[:, None].double(), rank[:, None].double(),
                 top_ids.double(), top_lp.double()], dim=1
            )  # [num_rows, 3 + 2 * num_top]
            packed = torch.cat([rows.flatten(), num_emitted.double()])
        ready = None
        if packed.is_cuda:
            packed = packed.to("cpu", non_blocking=True)  # into pinned memory, no wait
            if prompt is not None:
                prompt = prompt.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        ks = None  # read now: by collect() a slot may hold another request
        if prompt is not None:
            ks = {i: self.state.params[plan.reqs[i].slot].prompt_logprobs for i in batch.prompt_reqs}
        return Launched(plan, batch.sampling, batch.cu_num_rows, want, num_top, packed, ready, prompt, ks)

    def _row_logprobs(self, lp_logits: Tensor, row_tokens: Tensor, num_top: int,
                      want: list[int | None]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """compute_logprobs over the rows that want logprobs only (one request's logprobs took the
        log-softmax, rank and top-k of every row of the batch, every step); the other rows' entries
        are zeros, never read (collect)."""
        which = [r for r, w in enumerate(want) if w is not None]
        if len(which) == len(want):
            return compute_logprobs(lp_logits, row_tokens, num_top)
        (idx,) = self.attn_backend.upload(which)
        parts = compute_logprobs(lp_logits.index_select(0, idx), row_tokens.index_select(0, idx), num_top)
        out = []
        for part in parts:  # [m] or [m, num_top] -> [num_rows] or [num_rows, num_top]
            full = part.new_zeros((len(want), *part.shape[1:]))
            out.append(full.index_copy_(0, idx, part))
        return tuple(out)

    def collect(self, launched: Launched) -> StepResult:
        """Wait for a launched step's results and read them (host data only: the slot state may
        already belong to a later step)."""
        # SYNC: the one wait of a step (for drafts counted on the device, their copy: queued after the results')
        ready = launched.draft_counts[1] if launched.draft_counts is not None else launched.ready
        if ready is not None:
            ready.synchronize()
        flat = launched.host.tolist()
        plan, num_top = launched.plan, launched.num_top
        n_rows = launched.cu_num_rows[-1]
        if num_top is None:
            tokens_host, emitted_host = flat[:n_rows], flat[n_rows:]
            lp_rows = None
        else:
            width = 3 + 2 * num_top
            lp_rows = [flat[i * width : (i + 1) * width] for i in range(n_rows)]
            tokens_host = [int(r[0]) for r in lp_rows]
            emitted_host = [int(x) for x in flat[n_rows * width :]]
        sampled: list[list[int]] = [[] for _ in plan.reqs]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(plan.reqs)
        for n, i in enumerate(launched.sampling):
            start = launched.cu_num_rows[n]
            count = emitted_host[n]
            sampled[i] = tokens_host[start : start + count]
            k = launched.row_logprobs[start]
            if lp_rows is not None and k is not None:
                logprobs[i] = [_token_logprobs(lp_rows[r], k, num_top) for r in range(start, start + count)]
        proposed = [r.num_next_drafts if self.speculator is not None else 0 for r in plan.reqs]
        fewer = launched.fewer_drafts or {}
        for i, (count, _) in fewer.items():
            proposed[i] = count
        draft_steps = {i: steps for i, (_, steps) in fewer.items()} or None
        if launched.draft_counts is not None:
            for i, count in zip(launched.sampling, launched.draft_counts[0].tolist()):
                proposed[i] = count
        return StepResult(sampled_token_ids=sampled, logprobs=logprobs, num_drafts_proposed=proposed,
                          prompt_logprobs=_prompt_results(launched), draft_steps=draft_steps)

    def repair_drafts(self, launched: Launched, result: StepResult, misfits: dict[int, int],
                      drafts: dict[int, list[int]], grammars) -> dict[int, list[int]]:
        """Draw again, under their grammar, the drafts of a collected step's structured-output
        requests from the first that left it (misfits: req_id -> its column; drafts: as
        collect_drafts gave them; grammars: the engine's Grammars, whose matchers have followed
        the step's tokens) -> req_id -> the new drafts. Waits for each redrawn column."""
        from tandem.spec.speculator import Redraft

        reqs = launched.plan.reqs
        index = {r.req_id: i for i, r in enumerate(reqs)}
        ids = list(misfits)
        items = []
        for req_id in ids:
            r = reqs[index[req_id]]
            emitted = result.sampled_token_ids[index[req_id]]
            items.append(Redraft(slot=r.slot, pos=r.start_pos + len(r.input_token_ids) - 1 + len(emitted),
                                 token=emitted[-1], block_ids=r.block_ids, first=misfits[req_id],
                                 num_drafts=r.num_next_drafts, num_outputs=r.num_output_tokens + 1))
        masks = grammars.repair_masks(ids, [drafts[req_id][: misfits[req_id]] for req_id in ids])
        try:
            self.speculator.repair(items, masks)
        finally:
            masks.finish()
        (slots,) = self.attn_backend.upload([it.slot for it in items])
        rows, ready = to_host(self.speculator.drafts[slots])  # [m, k]
        if ready is not None:
            ready.synchronize()  # SYNC: the repaired drafts, for the next step's masks
        return {req_id: row[: it.num_drafts] for req_id, it, row in zip(ids, items, rows.tolist())}

    def collect_drafts(self, launched: Launched) -> dict[int, list[int]]:
        """The drafts a collected step proposed for its structured-output requests (their next
        masks follow them): req_id -> drafts. Waits for the draft round, so the engine calls it
        after applying the step's result, which the host does while the draft runs."""
        if launched.drafts is None:
            return {}
        want, drafts_host, ready = launched.drafts
        if ready is not None:
            ready.synchronize()  # SYNC: the second wait of a step with a constrained request drafting
        reqs = launched.plan.reqs
        return {reqs[i].req_id: row[: reqs[i].num_next_drafts] for i, row in zip(want, drafts_host.tolist())}


def _prompt_results(launched: Launched) -> list[list[TokenLogprobs] | None] | None:
    """The prompt logprobs rows, read back -> per planned request (None: it asked for none)."""
    if launched.prompt_host is None:
        return None
    rows = launched.prompt_host.tolist()
    top = (launched.prompt_host.shape[1] - 2) // 2
    out: list[list[TokenLogprobs] | None] = [None] * len(launched.plan.reqs)
    at = 0
    for i, r in enumerate(launched.plan.reqs):
        if not r.prompt_logprob_targets:
            continue
        k = launched.prompt_ks[i]
        out[i] = [_token_logprobs([t] + row, k, top) for t, row in
                  zip(r.prompt_logprob_targets, rows[at : at + len(r.prompt_logprob_targets)])]
        at += len(r.prompt_logprob_targets)
    return out


def _token_logprobs(row: list[float], k: int, num_top: int) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=int(row[0]),
        logprob=row[1],
        rank=int(row[2]),
        top_ids=[int(t) for t in row[3 : 3 + k]],
        top_logprobs=row[3 + num_top : 3 + num_top + k],
    )
