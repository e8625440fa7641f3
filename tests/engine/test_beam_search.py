"""LLM.beam_search (vLLM's) against a beam search written here over transformers' logits on the
same weights, and its settings' errors."""
import math
import random

import pytest
import torch

from tandem import LLM, BeamSearchParams
from tandem.beam_search import BeamSearchSequence, beam_search_score, better
from tandem.errors import RequestError
from tests.helpers import hf_model, make_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("beam") / "m", "qwen3", init_std=0.3)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), dtype="float32", max_model_len=64, block_size=8)


def _reference(hf, prompt: list[int], width: int, max_tokens: int, eos: set[int], length_penalty: float,
               max_len: int) -> list[tuple[list[int], float, str]]:
    """(tokens after the prompt, cum logprob, finish reason) of the best `width` sequences."""
    def score(tokens, cum):
        return cum / ((len(tokens) - (tokens[-1] in eos)) ** length_penalty)

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if all(len(t) >= max_len for t, _ in beams):
            break
        candidates = []
        for tokens, cum in beams:
            if len(tokens) >= max_len:
                candidates.append((tokens, cum))
                continue
            with torch.no_grad():
                row = hf(torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
            top = row.topk(2 * width)
            for t, lp in zip(top.indices.tolist(), top.values.tolist()):
                (done if t in eos else candidates).append((tokens + [t], cum + lp))
        beams = sorted(candidates, key=lambda b: score(*b), reverse=True)[:width]
    ranked = sorted([(t, c, "stop") for t, c in done] + [(t, c, "length") for t, c in beams],
                    key=lambda b: score(b[0], b[1]), reverse=True)[:width]
    return [(t[len(prompt):], c, f) for t, c, f in ranked]


def _got(out, prompt_len: int) -> list[tuple[list[int], float, str]]:
    return [(s.tokens[prompt_len:], s.cum_logprob, s.finish_reason) for s in out.sequences]


def _same(got, want):
    assert [(t, f) for t, _, f in got] == [(t, f) for t, _, f in want]
    assert [c for _, c, _ in got] == pytest.approx([c for _, c, _ in want], abs=1e-4)


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (3, 1.0), (2, 0.0), (3, 2.5)])
def test_beam_search_matches_a_reference_over_transformers(llm, model, width, length_penalty, monkeypatch):
    """The sequences, their logprobs and finish reasons equal a plain beam search over transformers'
    logits; an EOS among the candidates (here a token the first step's candidates hold, made an EOS)
    sets its sequence aside as completed, ranked with the open ones by the length-penalised score."""
    hf = hf_model(model)
    prompts = [[5, 17, 99, 3, 250], [7, 8]]
    with torch.no_grad():
        first = hf(torch.tensor([prompts[0]])).logits[0, -1].topk(2 * width).indices.tolist()
    eos = {first[1]}  # the second likeliest first token: completes a sequence at the first step
    monkeypatch.setattr(llm.engine, "eos_token_ids", tuple(eos))
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == 2 and all(len(o.sequences) == width for o in outs)
    for prompt, out in zip(prompts, outs):
        _same(_got(out, len(prompt)), _reference(hf, prompt, width, 5, eos, length_penalty, 64))
        for seq in out.sequences:
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
            assert math.isclose(sum(lp[t].logprob for lp, t in zip(seq.logprobs, seq.tokens[len(prompt):])),
                                seq.cum_logprob, abs_tol=1e-4)
    if length_penalty <= 1:  # the one-token sequence ranks among the best: fewer tokens, fewer logprobs to add
        assert any(s.finish_reason == "stop" and len(s.tokens) == 6 for s in outs[0].sequences)


def test_beam_search_ignore_eos_limits_and_text(llm, model):
    """ignore_eos extends through EOS; concurrency_limit changes nothing; a sequence reaching
    max_model_len ends there by length; the text is the tokens after the prompt, decoded."""
    hf = hf_model(model)
    prompt = [9, 9, 4]
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": prompt}, "hello there"], params)
    _same(_got(outs[0], 3), _reference(hf, prompt, 2, 4, set(), 1.0, 64))
    one_by_one = llm.beam_search([{"prompt_token_ids": prompt}, "hello there"], params, concurrency_limit=1)
    for a, b in zip(outs, one_by_one):  # (logprobs may differ in the last bits with the batch)
        assert [(s.tokens, s.text, s.finish_reason) for s in a.sequences] == \
            [(s.tokens, s.text, s.finish_reason) for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-4)
    tok = llm.get_tokenizer()
    assert [s.text for s in outs[0].sequences] == [tok.decode(s.tokens[3:], skip_special_tokens=True)
                                                   for s in outs[0].sequences]
    # every logprob entry carries its token's text, as generate's (and vLLM's detokenized steps)
    entries = [(t, lp) for s in outs[0].sequences for step in s.logprobs for t, lp in step.items()]
    assert entries and all(lp.decoded_token == tok.decode([t]) for t, lp in entries)
    near = list(range(10, 10 + 61))  # 3 tokens of room in max_model_len=64
    out = llm.beam_search([{"prompt_token_ids": near}], BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
    assert all(len(s.tokens) == 64 and s.finish_reason == "length" for s in out[0].sequences)
    _same(_got(out[0], 61), _reference(hf, near, 2, 8, set(), 1.0, 64))


@pytest.mark.parametrize("kwargs,field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2.5, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
    (dict(beam_width=2, max_tokens=4, temperature=1e39), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
])
def test_bad_beam_search_params(kwargs, field):
    with pytest.raises(RequestError, match=f"BeamSearchParams.{field}="):
        BeamSearchParams(**kwargs)


def test_a_temperature_past_float32_is_told_so():
    with pytest.raises(RequestError, match=r"temperature=1e\+39 is invalid: .*a finite float32"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=1e39)


def test_beam_search_refusals_name_the_fix(llm):
    with pytest.raises(RequestError, match="max_logprobs >= 22"):  # 2 * 11 logprobs a step, the cap is 20
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    for limit in (0, True):
        with pytest.raises(RequestError, match="concurrency_limit"):
            llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=limit)
    with pytest.raises(RequestError, match="BeamSearchParams"):
        llm.beam_search(["hi"], {"beam_width": 2})
    with pytest.raises(RequestError, match="max_model_len"):
        llm.beam_search(["ok", {"prompt_token_ids": list(range(64))}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("length_penalty", [1e308, -1e308, 1e16, -1e17, 400.0, -400.0])
def test_a_length_penalty_past_the_floats_ranks_as_exact_arithmetic_would(llm, length_penalty):
    """length ** length_penalty overflowing (or reaching 0) raises nothing, and the ranking is the
    exact one: with no EOS every beam of a step has the same length, so any finite penalty ranks
    them as length_penalty 1 does."""
    params = lambda lp: BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=lp, ignore_eos=True)  # noqa: E731
    (out,) = llm.beam_search([{"prompt_token_ids": [5, 17, 99]}], params(length_penalty))
    (want,) = llm.beam_search([{"prompt_token_ids": [5, 17, 99]}], params(1.0))
    assert [s.tokens for s in out.sequences] == [s.tokens for s in want.sequences]
    assert beam_search_score(out.sequences[0], frozenset(), length_penalty) <= 0  # not NaN, no error


def test_better_compares_as_the_score_does_in_exact_arithmetic():
    """Where the score's floats hold, `better` orders as beam_search_score; where they overflow, as
    the exact score would: with a large positive penalty the longer sequence scores higher (its
    length ** penalty is larger), with a large negative one lower."""
    import functools

    eos = frozenset()
    gen = random.Random(0)
    seqs = [BeamSearchSequence([1] * gen.randint(1, 60), cum_logprob=-gen.uniform(0.01, 40)) for _ in range(200)]
    for lp in (0.0, 0.5, 1.0, 2.5, -1.0):
        by_score = sorted(seqs, key=lambda s: beam_search_score(s, eos, lp))
        assert sorted(seqs, key=functools.cmp_to_key(lambda a, b: better(a, b, eos, lp))) == by_score
    short = BeamSearchSequence([1] * 5, cum_logprob=-3.0)
    long = BeamSearchSequence([1] * 50, cum_logprob=-6.0)
    assert better(long, short, eos, 300.0) == 1 == better(short, long, eos, -500.0)  # 50 ** 300 overflows
    assert better(long, short, eos, 1e308) == 1 and better(short, short, eos, 1e308) == 0
    same_length = BeamSearchSequence([1] * 50, cum_logprob=-6.5)
    assert better(long, same_length, eos, 1e300) == 1  # equal lengths: the logprobs decide at any penalty
    assert better(BeamSearchSequence([1, 2], cum_logprob=0.0), short, eos, 1.0) == 1  # the best there is
