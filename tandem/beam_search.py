"""Beam search over the engine (vLLM's LLM.beam_search): each step runs every live beam as a
one-token request asking for its 2 * beam_width likeliest next tokens, and keeps the beam_width
best extensions per prompt. The prefix cache serves each beam's prompt, so a step computes
little more than the beams' last tokens.

Ranking (vLLM's): cum_logprob / length ** length_penalty, length counting the prompt's tokens and
not an ending EOS. An extension that ends at EOS (unless ignore_eos) is set aside as completed,
whether or not it would have ranked among the beams kept; at the end the completed sequences and
the beams still open compete, and the best beam_width are returned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.errors import RequestError
from tandem.outputs import Logprob
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
    return seq.cum_logprob / (length ** length_penalty)


def run_beam_search(llm: LLM, prompts: list, params: BeamSearchParams, use_tqdm: bool,
                    concurrency_limit: int | None) -> list[BeamSearchOutput]:
    """LLM.beam_search's work: the prompts concurrency_limit at a time (None: all at once)."""
    engine = llm.engine
    width = params.beam_width
    cap = engine.cfg.model.max_logprobs
    if cap != -1 and 2 * width > cap:
        raise RequestError(f"BeamSearchParams.beam_width={width} needs the {2 * width} likeliest tokens of each step, "
                           f"and this LLM returns at most max_logprobs={cap}; start it with max_logprobs >= "
                           f"{2 * width} (or -1)")
    if 2 * width > engine.vocab_size:
        raise RequestError(f"BeamSearchParams.beam_width={width} is invalid: each step takes 2 * beam_width tokens, "
                           f"and the vocabulary has {engine.vocab_size}")
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
        raise RequestError(f"concurrency_limit={concurrency_limit!r} must be an integer >= 1 (or None: every prompt "
                           "at once)")
    step = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)
    items = []
    for prompt in prompts:
        ids, _, _ = llm._tokenize(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        engine.validate_request(ids, step)  # every prompt checked before any work starts
        items.append((ids, salt))
    limit = concurrency_limit or max(len(items), 1)
    outputs = []
    for start in range(0, len(items), limit):
        outputs += _search(llm, items[start:start + limit], params, step, use_tqdm)
    return outputs


def _search(llm: LLM, items: list[tuple[list[int], str | None]], params: BeamSearchParams, step: SamplingParams,
            use_tqdm: bool) -> list[BeamSearchOutput]:
    engine = llm.engine
    eos = frozenset(() if params.ignore_eos else engine.eos_token_ids)
    max_len = engine.cfg.sched.max_model_len
    key = lambda seq: beam_search_score(seq, eos, params.length_penalty)  # noqa: E731
    beams = [[BeamSearchSequence(list(ids))] for ids, _ in items]
    completed: list[list[BeamSearchSequence]] = [[] for _ in items]
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True)
    try:
        for _ in range(params.max_tokens):
            live = [(i, beam) for i, group in enumerate(beams) for beam in group if len(beam.tokens) < max_len]
            if not live:
                break
            runs = [(beam.tokens, None, items[i][1]) for i, beam in live]
            results = llm._run(runs, [step] * len(runs), False, [0] * len(runs))
            candidates: list[list[BeamSearchSequence]] = [[] for _ in items]
            for (i, beam), result in zip(live, results):
                entries = result.outputs[0].logprobs[-1]  # the top 2 * beam_width, and the drawn token
                for token, entry in entries.items():
                    seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entries],
                                             beam.cum_logprob + entry.logprob)
                    if token in eos:
                        seq.finish_reason = "stop"
                        completed[i].append(seq)
                    else:
                        candidates[i].append(seq)
            # a beam at max_model_len keeps its place, ended by length
            for i, group in enumerate(beams):
                candidates[i] += [beam for beam in group if len(beam.tokens) >= max_len]
                beams[i] = sorted(candidates[i], key=key, reverse=True)[:params.beam_width]
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    out = []
    for (ids, _), done, group in zip(items, completed, beams):
        for beam in group:
            beam.finish_reason = "length"
        best = sorted(done + group, key=key, reverse=True)[:params.beam_width]
        for seq in best:
            shown = seq.tokens[len(ids):]
            if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
                shown = shown[:-1]
            seq.text = llm.tokenizer.decode(shown, skip_special_tokens=True) if llm.tokenizer is not None else ""
        out.append(BeamSearchOutput(best))
    return out
