"""Suffix lookup (vLLM's method="suffix", suffix decoding): drafts from the request's own tokens and
from the responses of finished requests.

No draft model. After every step each drafting request looks for the longest suffix of its context,
up to suffix_decoding_max_tree_depth tokens, that occurred before in two sources: its own tokens
(prompt and output, an occurrence ending before the last token) and the corpus, the responses of
requests that finished ("stop" or "length"). A source proposes by walking the occurrences of its
longest match: each draft is the token that most of them continue with (the most recent
occurrence among equals), the walk keeping only the occurrences that continued so. It stops where
the share of the first step's occurrences that agree with every draft so far falls below
suffix_decoding_min_token_prob, at suffix_decoding_max_spec_factor drafts per matched token (at
least one), at k, at its source's end, and at max_model_len. The corpus's proposal is taken where
its match is longer than the request's own, or where the request's own tokens propose nothing.

That is a suffix tree with counts, as in vLLM's suffix decoding (Arctic Inference), with tandem's
own choice among paths: Arctic scores the paths of every match length and takes the best score,
where tandem walks the longest match only and picks the source by match length. It is computed
by brute force: the match is sought back from the NUM_OCCURRENCES most recent occurrences of the
context's last token in each source, and NUM_CANDIDATES of the most recent occurrences of the
longest match weigh in: a fixed number of tensor ops, whatever the sources hold.

The corpus is a ring of suffix_decoding_corpus_tokens token ids on the device, each response
followed by a separator, whole responses evicted oldest first (as room, or
suffix_decoding_max_cached_requests, runs out). A response is copied into it from its slot's
tokens on the device when the plan after its end says so (StepPlan.finished_outputs), before the
slot takes another request: no host round trip.

The drafts are one-hot proposals verified as greedy drafts (tandem/spec/base.py), so the output is
target-only's token for token. The lookup is tensor ops (suffix_drafts, the reference) on the CPU
and one Triton launch on a GPU (tandem/kernels/suffix.py, tested against suffix_drafts).
"""
from __future__ import annotations

from collections import deque

import torch
from torch import Tensor
from torch.nn.functional import pad

from tandem.spec.ngram import NgramSpeculator

SEPARATOR = -1  # the corpus entry after each response (and where none is kept)
NUM_OCCURRENCES = 1024  # the most recent occurrences of the context's last token searched in each source
NUM_CANDIDATES = 64  # the most recent occurrences of the longest match that choose its continuation


def _longest_match(src: Tensor, may_end: Tensor, ctx: Tensor, last: Tensor, depth: int,
                   num_occurrences: int, num_candidates: int) -> tuple[Tensor, Tensor]:
    """Where src holds the longest suffix of each context, among the most recent occurrences of its
    last token.

    src [S, L] int64 (S = B, or 1 for a source every row shares); may_end [B or 1, L] bool: the
    positions that may end a match (a token follows them; in the request's own tokens, before its
    last one); ctx [B, W] int64 with its last token at last [B].
    -> (cand [B, P] int64: the most recent ends of the longest match, -1 past them; its length [B])."""
    width = src.shape[1]
    ends = torch.arange(width, device=src.device)
    hit = (src == ctx.gather(1, last[:, None])) & may_end  # [B, L] occurrences of the last token
    occ, _ = torch.where(hit, ends[None, :], -1).topk(min(num_occurrences, width), dim=1)  # [B, M], latest first
    back = torch.arange(depth, device=src.device)
    src_idx = occ[:, :, None] - back  # [B, M, depth] src[e - j]
    ctx_idx = last[:, None] - back  # [B, depth] ctx[last - j]
    if src.shape[0] == 1:
        seen = src[0][src_idx.clamp(min=0)]
    else:
        seen = src.gather(1, src_idx.clamp(min=0).flatten(1)).view(src_idx.shape)
    want = ctx.gather(1, ctx_idx.clamp(min=0))  # [B, depth]
    same = (seen == want[:, None, :]) & (src_idx >= 0) & (ctx_idx >= 0)[:, None, :] & (occ >= 0)[:, :, None]
    run = same.long().cumprod(dim=2).sum(dim=2)  # [B, M] tokens matched back from each occurrence
    best = run.amax(dim=1)  # [B]
    cand, _ = torch.where((run == best[:, None]) & (best[:, None] > 0), occ, -1).topk(
        min(num_candidates, occ.shape[1]), dim=1)  # [B, P], latest first
    return cand, best


def _walk(src: Tensor, src_len: Tensor | None, cand: Tensor, best: Tensor, k: int, max_spec_factor: float,
          min_token_prob: float) -> tuple[Tensor, Tensor]:
    """The most frequent continuation of the occurrences cand [B, P] (-1: none) in src [S, L]
    (S = B, or 1: shared), reading no further than src_len [B] (None: L) -> (drafts [B, k], counts [B])."""
    b, width = cand.shape[0], src.shape[1]
    pos = cand[:, :, None] + 1 + torch.arange(k, device=src.device)  # [B, P, k] each occurrence's continuation
    if src.shape[0] == 1:
        tok = src[0][pos.clamp(max=width - 1)]
    else:
        tok = src.gather(1, pos.clamp(max=width - 1).flatten(1)).view(pos.shape)
    # a continuation ends at its source's end or a separator; nothing follows a missing occurrence
    ok = (pos < (width if src_len is None else src_len[:, None, None])) & (tok != SEPARATOR) & (cand >= 0)[:, :, None]
    ok = ok.long().cumprod(dim=2).bool()
    limit = (best.double() * max_spec_factor).floor().clamp(min=1, max=k).long()  # [B]
    drafts = torch.zeros(b, k, dtype=torch.int64, device=src.device)
    counts = torch.zeros(b, dtype=torch.int64, device=src.device)
    going = best > 0  # [B] still drafting
    alive = ok[:, :, 0]  # [B, P] the occurrences that agree with every draft so far
    least = min_token_prob * alive.sum(dim=1).double()  # [B] the agreeing occurrences a draft needs
    for j in range(k):
        t = tok[:, :, j]
        alive = alive & ok[:, :, j]
        votes = ((t[:, :, None] == t[:, None, :]) & alive[:, None, :]).sum(dim=2)  # [B, P] occurrences agreeing
        top, pick = torch.where(alive, votes, -1).max(dim=1)  # the first (most recent) among the most frequent
        going = going & (top > 0) & (top.double() >= least) & (j < limit)
        drafts[:, j] = t.gather(1, pick[:, None])[:, 0]
        counts += going
        alive = alive & (t == drafts[:, j : j + 1])
    return drafts, counts


def suffix_drafts(tokens: Tensor, num_tokens: Tensor, corpus: Tensor | None, depth: int, k: int,
                  max_spec_factor: float, min_token_prob: float, max_model_len: int,
                  num_occurrences: int = NUM_OCCURRENCES, num_candidates: int = NUM_CANDIDATES) -> tuple[Tensor, Tensor]:
    """The lookup over a batch of contexts (the reference, and the path on every device).

    tokens [B, L] int: each row's context in its first num_tokens [B] entries; corpus [C] int
    (responses separated by SEPARATOR) or None -> drafts [B, k] int64 (entries past a row's count
    unspecified), counts [B] int64."""
    ctx = tokens.long()
    num_tokens = num_tokens.long()
    last = (num_tokens - 1).clamp(min=0)  # (a captured graph's padding rows may hold empty slots)
    ends = torch.arange(ctx.shape[1], device=ctx.device)
    cand, best = _longest_match(ctx, ends[None, :] < last[:, None], ctx, last, depth, num_occurrences,
                                num_candidates)
    drafts, counts = _walk(ctx, num_tokens, cand, best, k, max_spec_factor, min_token_prob)
    if corpus is not None:
        src = corpus.long()[None, :]  # [1, C]
        follows = pad(src[:, 1:], (0, 1), value=SEPARATOR) != SEPARATOR  # [1, C] a token follows e
        c_cand, c_best = _longest_match(src, follows, ctx, last, depth, num_occurrences, num_candidates)
        c_drafts, c_counts = _walk(src, None, c_cand, c_best, k, max_spec_factor, min_token_prob)
        # the corpus proposes where its match is longer, or where the request's own tokens propose nothing
        use = ((c_best > best) | (counts == 0)) & (c_counts > 0)  # [B]
        drafts = torch.where(use[:, None], c_drafts, drafts)
        counts = torch.where(use, c_counts, counts)
    counts = torch.minimum(counts, (max_model_len - num_tokens).clamp(min=0))
    return drafts, counts


class SuffixSpeculator(NgramSpeculator):
    """Keeps each slot's context (NgramSpeculator) and the corpus of finished responses on the
    device, and drafts after every step: suffix_drafts, or on a GPU its Triton kernel."""

    def __init__(self, spec, sched, state, device: torch.device, attn_backend):
        super().__init__(spec, sched, state, device, attn_backend)
        self.depth = spec.suffix_decoding_max_tree_depth
        self.max_spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_token_prob = spec.suffix_decoding_min_token_prob
        self.max_responses = spec.suffix_decoding_max_cached_requests
        size = spec.suffix_decoding_corpus_tokens if self.max_responses else 1
        self.corpus = torch.full((size,), SEPARATOR, dtype=torch.int32, device=device)  # [C]
        self.responses: deque[tuple[int, int]] = deque()  # (start, length) of those kept, oldest first
        self.write_pos = 0  # where the next response goes
        self.tables: tuple[Tensor, Tensor] | None = None  # the Triton kernel's thresholds (walk_tables)
        if self.attn_backend.use_triton:
            from tandem.kernels.suffix import walk_tables

            self.tables = walk_tables(self.depth, self.k, self.max_spec_factor, self.min_token_prob, NUM_CANDIDATES,
                                      device)
            # compile the kernel with and without the corpus now, not when the first response enters it
            none = torch.zeros(1, dtype=torch.int64, device=device)  # slot 0, wanting no drafts
            for corpus in (None, self.corpus) if self.max_responses else (None,):
                self._lookup_kernel(none, none, corpus)

    def _lookup_kernel(self, slots: Tensor, want: Tensor, corpus: Tensor | None) -> Tensor:
        from tandem.kernels.suffix import suffix_lookup

        return suffix_lookup(self.context, self.num_tokens, corpus, slots, want, self.drafts, self.tables, self.depth,
                             self.max_model_len, NUM_OCCURRENCES, NUM_CANDIDATES)

    def finished(self, outputs: list[tuple[int, int, int]]) -> None:
        """Copies each response (slot, start, end) that ended into the corpus: its last C - 1 tokens."""
        if not self.max_responses:
            return
        size = self.corpus.shape[0]
        for slot, start, end in outputs:
            start = max(start, end - (size - 1))
            n = end - start
            if n <= 0:
                continue
            if self.write_pos + n + 1 > size:  # no response wraps: the rest of the ring is dropped
                self._evict_through(size)
                self.write_pos = 0
            self._evict_through(self.write_pos + n + 1)
            self.corpus[self.write_pos : self.write_pos + n] = self.context[slot, start:end]
            self.corpus[self.write_pos + n] = SEPARATOR
            self.responses.append((self.write_pos, n))
            self.write_pos += n + 1
            while len(self.responses) > self.max_responses:
                self._evict_oldest()

    def _evict_through(self, end: int) -> None:
        """Evicts the responses that lie (partly) in [write_pos, end), oldest first."""
        while self.responses and self.write_pos <= self.responses[0][0] < end:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        start, n = self.responses.popleft()
        self.corpus[start : start + n] = SEPARATOR

    def lookup(self, slots: Tensor, want: Tensor, width: int) -> Tensor:
        corpus = self.corpus if self.responses else None  # (an empty corpus proposes nothing)
        if self.tables is not None:  # one launch (tandem/kernels/suffix.py), reading the slots' contexts in place
            return self._lookup_kernel(slots, want, corpus)
        drafts, found = suffix_drafts(self.context[slots, :width], self.num_tokens[slots], corpus, self.depth,
                                      self.k, self.max_spec_factor, self.min_token_prob, self.max_model_len)
        self.drafts[slots] = drafts
        return torch.minimum(found, want)
