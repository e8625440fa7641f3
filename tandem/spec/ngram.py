"""N-gram lookup (vLLM's method="ngram", prompt lookup decoding): drafts from the request's own context.

No draft model: each request's tokens (prompt and output) are kept on the device in its slot, and
after every step the lookup finds the longest n-gram, n from prompt_lookup_max down to
prompt_lookup_min, that ends the context and occurred before; the tokens that followed its
earliest occurrence are the drafts, up to k of them (fewer where the context ends first, none
when nothing matches). That is vLLM's rule, so the same context drafts the same tokens.

The drafts are one-hot proposals, verified as greedy drafts (tandem/spec/base.py): a draft is kept
iff the target's own seeded draw at its row is that token, so the output is target-only's token
for token, greedy or sampled. The search runs on the device (no host round trip): as tensor ops
over the batch (ngram_drafts), or with Triton as one launch (tandem/kernels/ngram.py, tested
against ngram_drafts); the number of drafts each request found comes back with the step's results
(ModelRunner.collect), and the scheduler verifies that many next step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tandem.config import CacheConfig, SchedulerConfig
from tandem.plan import NewReq, StepPlan
from tandem.runner.inputs import Batch
from tandem.spec.base import Speculator
from tandem.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from tandem.engine.grammar import DraftMasks


def ngram_drafts(tokens: Tensor, num_tokens: Tensor, min_n: int, max_n: int, k: int,
                 max_model_len: int) -> tuple[Tensor, Tensor]:
    """The lookup over a batch of contexts.

    tokens [B, L] int: each row's context in its first num_tokens [B] entries (the rest ignored).
    -> drafts [B, k] int64 (entries past a row's count are unspecified), counts [B] int64.

    A row's drafts follow the earliest end e < num_tokens - 1 of the longest run (capped at max_n)
    of tokens equal to the context's last ones, read backwards from e; none when that run is
    shorter than min_n. At most k, no further than the context's end, and none past max_model_len.
    """
    b, width = tokens.shape
    device = tokens.device
    tokens = tokens.long()
    last = num_tokens.long() - 1  # [B]
    ends = torch.arange(width, device=device)  # [L] candidate end positions e
    run = torch.zeros(b, width, dtype=torch.int64, device=device)  # [B, L] run length at each e, capped at max_n
    alive = (ends[None, :] < last[:, None])  # [B, L] e before the last token (something follows it)
    for j in range(max_n):
        tail = last - j  # [B] the context's j-th token from the end
        want = tokens.gather(1, tail.clamp(min=0)[:, None])  # [B, 1]
        seen = torch.nn.functional.pad(tokens, (j, 0), value=-1)[:, :width]  # [B, L] seen[e] = tokens[e - j]
        alive = alive & (seen == want) & (tail >= 0)[:, None]
        run += alive
        if not tokens.is_cuda and not bool(alive.any()):  # no run goes on: the longer n-grams match nowhere
            break
    best = run.amax(dim=1)  # [B]
    # the earliest end among the longest runs: score = run * (L + 1) + (L - e), largest wins
    score = torch.where(run == best[:, None], run * (width + 1) + (width - ends)[None, :], -1)
    end = score.argmax(dim=1)  # [B]
    found = best >= min_n
    start = end + 1  # [B] the first draft's position
    counts = torch.minimum(num_tokens.long() - start, (max_model_len - num_tokens.long()).clamp(min=0))
    counts = torch.where(found, counts.clamp(min=0, max=k), 0)
    cols = (start[:, None] + torch.arange(k, device=device)[None, :]).clamp(max=width - 1)  # [B, k]
    return tokens.gather(1, cols), counts


class NgramSpeculator(Speculator):
    """Keeps each slot's context on the device and drafts by ngram_drafts after every step."""

    def __init__(self, spec: SpeculativeConfig, sched: SchedulerConfig, state, device: torch.device, attn_backend):
        super().__init__(spec, sched, state, device, attn_backend)
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        # [max_num_seqs, max_model_len + 1] int32: each slot's tokens by position (+1: the bonus token
        # of a step that reaches max_model_len), and how many of them are known [max_num_seqs].
        self.context = torch.zeros(sched.max_num_seqs, sched.max_model_len + 1, dtype=torch.int32, device=device)
        self.num_tokens = torch.zeros(sched.max_num_seqs, dtype=torch.int64, device=device)

    def add(self, new: NewReq) -> None:
        ids, length = self.attn_backend.upload(new.token_ids, [len(new.token_ids)])
        self.context[new.slot, : len(new.token_ids)] = ids.to(torch.int32)
        self.num_tokens[new.slot] = length[0]

    @torch.inference_mode()
    def propose(self, plan: StepPlan, batch: Batch, row_tokens: Tensor, num_emitted: Tensor,
                masks: DraftMasks | None = None) -> Tensor | None:
        """Append each sampling request's emitted tokens to its context, then look up the drafts
        of those with num_next_drafts -> every sampling request's count [num_sampling] (0 for
        those that draft nothing); None when the step samples nothing. masks: unused (the lookup's
        drafts are verified under the grammar like any other; a misfit is rejected at its row)."""
        if not batch.sampling:
            return None
        cu = batch.cu_num_rows
        reqs = [plan.reqs[i] for i in batch.sampling]
        base = [r.start_pos + len(r.input_token_ids) for r in reqs]  # the position each one's first row emits
        drafting = [n for n, r in enumerate(reqs) if r.num_next_drafts]
        slots, base_t, drafting_t, want_t = self.attn_backend.upload(
            [r.slot for r in reqs], base, drafting, [reqs[n].num_next_drafts for n in drafting])
        # Each row's token at the position it generates; rows past a request's emitted ones write
        # past its new length: never read, overwritten later.
        rows = batch.rows
        self.context[rows.slot_ids, rows.positions.clamp(max=self.max_model_len)] = row_tokens.to(torch.int32)
        self.num_tokens[slots] = base_t + num_emitted
        counts = torch.zeros(len(reqs), dtype=torch.int64, device=self.device)
        if not drafting:
            return counts
        width = min(self.max_model_len + 1, max(base[n] + cu[n + 1] - cu[n] for n in drafting))  # the longest context
        counts[drafting_t] = self.lookup(slots[drafting_t], want_t, width)
        return counts

    def lookup(self, slots: Tensor, want: Tensor, width: int) -> Tensor:
        """Drafts for the requests in slots [n] (each wanting want [n] at most) into self.drafts
        -> their counts [n]; width: the longest of their contexts."""
        if self.attn_backend.use_triton:  # one launch (tandem/kernels/ngram.py), reading the slots' contexts in place
            from tandem.kernels.ngram import ngram_lookup

            return ngram_lookup(self.context, self.num_tokens, slots, want, self.drafts, self.min_n, self.max_n,
                                self.max_model_len)
        drafts, found = ngram_drafts(self.context[slots, :width], self.num_tokens[slots], self.min_n, self.max_n,
                                     self.k, self.max_model_len)
        self.drafts[slots] = drafts
        return torch.minimum(found, want)


class LookupFactory:
    """The engine's speculator factory for method="ngram" or "suffix": no model to load, no KV cache."""

    model = None

    def __init__(self, spec: SpeculativeConfig):
        self.spec = spec

    def kv_bytes_per_block(self, cache: CacheConfig) -> int:
        return 0

    def build(self, cache: CacheConfig, sched: SchedulerConfig, runner) -> NgramSpeculator:
        cls = NgramSpeculator
        if self.spec.method == "suffix":
            from tandem.spec.suffix import SuffixSpeculator as cls
        return cls(self.spec, sched, runner.state, runner.device, runner.attn_backend)
