"""Beam search over the engine (vLLM's LLM.beam_search): each step runs every live beam as a
one-token request asking for its 2 * beam_width likeliest next tokens, and keeps the beam_width
best extensions per prompt. The prefix cache serves each beam's prompt, so a step computes
little more than the beams' last tokens.

Ranking (vLLM's): cum_logprob / length ** length_penalty, length counting the prompt's tokens and
not an ending EOS. An extension that ends at EOS (unless ignore_eos) is set aside as completed,
whether or not it would have ranked among the beams kept; at the end the completed sequences and
the beams still open compete, and the best beam_width are returned.

BeamSearch holds the search and leaves running the steps to its driver: run_beam_search here
(LLM.beam_search, through the engine), tandem/server/beam_search.py (the server's use_beam_search,
through the async engine).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tandem.engine.engine import check_cache_salt, progress_bar
from tandem.errors import RequestError
from tandem.outputs import Logprob
from tandem.prompts import prompt_token_ids
from tandem.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tandem.engine.llm import LLM


@dataclass
class BeamSearchSequence:
    """One sequence of a beam search: its tokens (the prompt's first), the logprobs entry of each
    token it added, their summed logprob; text, finish_reason and stop_reason once it is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's result: its best sequences, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(seq: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty; length counts the prompt, not an ending EOS."""
    length = len(seq.tokens) - (seq.tokens[-1] in eos_token_ids)
    try:
        return seq.cum_logprob / (length ** length_penalty)
    except (OverflowError, ZeroDivisionError):  # length ** length_penalty past the floats
        return 0.0 if seq.cum_logprob == 0 else -0.0 if length_penalty > 0 else -math.inf


def better(a: BeamSearchSequence, b: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> int:
    """1 if a's beam_search_score is above b's, -1 if below, 0 if equal, compared in logs, so that
    it holds at any length_penalty (length ** length_penalty leaves the floats at a few hundred,
    where the score's division can no longer order them):
    -cum_a / La ** p > -cum_b / Lb ** p  <=>  log(-cum_a) - log(-cum_b) > p * (log La - log Lb)
    (as the score, it may call two sequences within a rounding error of each other either way)."""
    if a.cum_logprob >= 0 or b.cum_logprob >= 0:  # a score of 0 is the best there is
        return (a.cum_logprob >= 0) - (b.cum_logprob >= 0)
    if a.cum_logprob == b.cum_logprob == -math.inf:  # both scores -inf, whatever the lengths
        return 0
    len_a = len(a.tokens) - (a.tokens[-1] in eos_token_ids)
    len_b = len(b.tokens) - (b.tokens[-1] in eos_token_ids)
    lhs = math.log(-a.cum_logprob) - math.log(-b.cum_logprob) if a.cum_logprob != b.cum_logprob else 0.0
    rhs = length_penalty * (math.log(len_a) - math.log(len_b)) if len_a != len_b else 0.0
    return (lhs < rhs) - (lhs > rhs)


class BeamSearch:
    """The state of one beam search over some prompts, driven a step at a time by its caller (the
    offline LLM runs the steps through its engine, the server through the async engine): `live()`
    names the beams to extend, the caller runs each as a one-token request asking for its
    `num_logprobs` likeliest next tokens, and `advance()` takes those entries."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids, max_model_len: int):
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.max_model_len = max_model_len
        self.prompt_lens = [len(p) for p in prompts]
        self.beams = [[BeamSearchSequence(list(p))] for p in prompts]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.num_steps = 0

    def _ranked(self, seqs: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        """seqs, best first (a stable sort: ties keep their order)."""
        lp = self.params.length_penalty
        return sorted(seqs, key=functools.cmp_to_key(lambda a, b: better(a, b, self.eos, lp)), reverse=True)

    def live(self) -> list[tuple[int, BeamSearchSequence]]:
        """(prompt index, beam) of every beam the next step extends; empty once the search is over
        (max_tokens steps run, or every beam at max_model_len)."""
        if self.num_steps >= self.params.max_tokens:
            return []
        return [(i, beam) for i, group in enumerate(self.beams) for beam in group
                if len(beam.tokens) < self.max_model_len]

    def advance(self, live: list[tuple[int, BeamSearchSequence]], entries: list[dict[int, Logprob]]) -> None:
        """One step: entries[j], the logprobs entry of live[j]'s next token (its likeliest tokens
        and, first, the one drawn; it may hold more than the 2 * beam_width likeliest, as a server
        request asking for more logprobs does), extends that beam by the drawn token and the 2 *
        beam_width likeliest; every prompt keeps its beam_width best."""
        num = 2 * self.params.beam_width
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.beams]
        for (i, beam), step in zip(live, entries):
            for n, (token, entry) in enumerate(step.items()):
                if n > 0 and entry.rank > num:
                    continue
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step], beam.cum_logprob + entry.logprob)
                if token in self.eos:
                    seq.finish_reason = "stop"
                    self.completed[i].append(seq)
                else:
                    candidates[i].append(seq)
        for i, group in enumerate(self.beams):  # a beam at max_model_len keeps its place, ended by length
            candidates[i] += [beam for beam in group if len(beam.tokens) >= self.max_model_len]
            self.beams[i] = self._ranked(candidates[i])[:self.params.beam_width]
        self.num_steps += 1

    def results(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width of its completed sequences and open beams (ended by
        length), best first, with their text: decode of the tokens after the prompt (less an ending
        EOS unless include_stop_str_in_output; "" without decode)."""
        out = []
        for prompt_len, done, group in zip(self.prompt_lens, self.completed, self.beams):
            for beam in group:
                beam.finish_reason = "length"
            best = self._ranked(done + group)[:self.params.beam_width]
            for seq in best:
                shown = seq.tokens[prompt_len:]
                if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    shown = shown[:-1]
                seq.text = decode(shown) if decode is not None else ""
            out.append(BeamSearchOutput(best))
        return out


def check_beam_width(width: int, max_logprobs: int, vocab_size: int, field: str = "BeamSearchParams.beam_width") -> None:
    """RequestError unless each step's 2 * width likeliest tokens can be asked for."""
    if max_logprobs != -1 and 2 * width > max_logprobs:
        raise RequestError(f"{field}={width} needs the {2 * width} likeliest tokens of each step, and this engine "
                           f"returns at most max_logprobs={max_logprobs}; start it with max_logprobs >= {2 * width} "
                           "(or -1)")
    if 2 * width > vocab_size:
        raise RequestError(f"{field}={width} is invalid: each step takes 2 * beam_width tokens, and the vocabulary "
                           f"has {vocab_size}")


def step_params(params: BeamSearchParams, num_logprobs: int | None = None, **overrides) -> SamplingParams:
    """The one-token request that extends a beam: its likeliest 2 * beam_width tokens (or
    num_logprobs, if more), drawn at the search's temperature."""
    return SamplingParams(max_tokens=1, logprobs=max(2 * params.beam_width, num_logprobs or 0),
                          temperature=params.temperature, **overrides)


def run_beam_search(llm: LLM, prompts: list, params: BeamSearchParams, use_tqdm: bool,
                    concurrency_limit: int | None) -> list[BeamSearchOutput]:
    """LLM.beam_search's work: the prompts concurrency_limit at a time (None: all at once)."""
    engine = llm.engine
    check_beam_width(params.beam_width, engine.cfg.model.max_logprobs, engine.vocab_size)
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or isinstance(concurrency_limit, bool)
                                          or concurrency_limit < 1):
        raise RequestError(f"concurrency_limit={concurrency_limit!r} must be an integer >= 1 (or None: every prompt "
                           "at once)")
    # detokenized, as vLLM's steps: the sequences' logprob entries carry their tokens' text
    step = step_params(params, output_kind=RequestOutputKind.FINAL_ONLY)
    items = []
    for prompt in prompts:
        ids, _, _ = prompt_token_ids(prompt, llm.get_tokenizer())
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        check_cache_salt(salt)
        engine.validate_request(ids, step)  # every prompt checked before any work starts
        items.append((ids, salt))
    limit = concurrency_limit or max(len(items), 1)
    decode = None
    if llm.tokenizer is not None:
        decode = lambda tokens: llm.tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    outputs = []
    for start in range(0, len(items), limit):
        outputs += _search(llm, items[start:start + limit], params, step, use_tqdm, decode)
    return outputs


def _search(llm: LLM, items: list[tuple[list[int], str | None]], params: BeamSearchParams, step: SamplingParams,
            use_tqdm: bool, decode) -> list[BeamSearchOutput]:
    search = BeamSearch([ids for ids, _ in items], params, llm.engine.eos_token_ids,
                        llm.engine.cfg.sched.max_model_len)
    bar = progress_bar(use_tqdm, params.max_tokens, "Beam search")
    try:
        while live := search.live():
            runs = [(beam.tokens, None, items[i][1]) for i, beam in live]
            results = llm._run(runs, [step] * len(runs), False, [0] * len(runs))
            # each result's last logprobs entry: the top 2 * beam_width, and the drawn token
            search.advance(live, [result.outputs[0].logprobs[-1] for result in results])
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return search.results(decode)
