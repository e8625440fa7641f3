"""SamplingParams.output_kind: what each engine output of a request carries (vLLM's RequestOutputKind),
and streamed text that never takes back what it showed when a stop string spans tokens."""
import pytest

from tandem import LLM, RequestOutputKind, SamplingParams
from tandem.errors import RequestError
from tests.helpers import make_hf_model, make_spec_models

PROMPT = [8, 9, 10, 11]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("kind") / "m", "qwen3", init_std=0.3)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), dtype="float32", max_model_len=128, block_size=8)


def _stream(llm, params, request_id="r"):
    """Every output engine.step() gives for one request, in order."""
    llm.engine.add_request(request_id, PROMPT, params)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.request_id == request_id]
    return outs


def _joined(outs, index):
    """A sequence's DELTA outputs put back together: text, token ids, logprobs."""
    seqs = [c for o in outs for c in o.outputs if c.index == index]
    logprobs = [lp for c in seqs for lp in (c.logprobs or [])]
    return "".join(c.text for c in seqs), [t for c in seqs for t in c.token_ids], logprobs, seqs


@pytest.mark.parametrize("n", [1, 3])
def test_delta_outputs_add_up_to_the_cumulative_ones(llm, n):
    params = dict(n=n, temperature=0.8 if n > 1 else 0, seed=5, max_tokens=10, ignore_eos=True, logprobs=2,
                  prompt_logprobs=1)
    cumulative = _stream(llm, SamplingParams(**params), "c")
    delta = _stream(llm, SamplingParams(**params, output_kind=RequestOutputKind.DELTA), "d")
    final = cumulative[-1]
    assert len(delta) == len(cumulative) and delta[-1].finished and not any(o.finished for o in delta[:-1])
    for c in final.outputs:
        text, tokens, logprobs, seqs = _joined(delta, c.index)
        assert (text, tokens, logprobs) == (c.text, c.token_ids, c.logprobs)
        assert all(s.token_ids for s in seqs)  # an output carries a sequence only when it has something new
        assert seqs[-1].finish_reason == "length" and all(s.finish_reason is None for s in seqs[:-1])
        assert seqs[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob)
    # The prompt logprobs come with the first output alone.
    assert delta[0].prompt_logprobs == final.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in delta[1:])
    # The cumulative outputs each hold everything so far.
    for before, after in zip(cumulative, cumulative[1:]):
        for b, a in zip(before.outputs, after.outputs):
            assert a.token_ids[: len(b.token_ids)] == b.token_ids and a.text.startswith(b.text)


def test_delta_outputs_of_sequences_that_run_apart(model):
    """n = 3 with room for two sequences at a time: the third waits, so outputs leave out the
    sequences with nothing new, and the last delta holds only the sequence that finished last."""
    narrow = LLM(str(model), dtype="float32", max_model_len=128, block_size=8, max_num_seqs=2)
    params = dict(n=3, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    final = narrow.generate({"prompt_token_ids": PROMPT}, SamplingParams(**params), use_tqdm=False)[0]
    delta = _stream(narrow, SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    assert any(len(o.outputs) < 3 for o in delta)
    assert len(delta[-1].outputs) < 3 and delta[-1].finished
    for c in final.outputs:
        text, tokens, _, seqs = _joined(delta, c.index)
        assert (text, tokens) == (c.text, c.token_ids)
        assert [s.finish_reason for s in seqs] == [None] * (len(seqs) - 1) + ["length"]


def test_text_held_back_for_a_stop_string_comes_out_at_the_end(llm):
    """A stop string that never matches still holds back its length less one character of the
    text until the sequence ends; then the rest comes out."""
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, stop=["\x00 never \x00"])
    cumulative = _stream(llm, SamplingParams(**params), "c")
    delta = _stream(llm, SamplingParams(**params, output_kind=RequestOutputKind.DELTA), "d")
    text = cumulative[-1].outputs[0].text
    assert len(text) > 8 and cumulative[-1].outputs[0].finish_reason == "length"
    assert all(len(o.outputs[0].text) <= max(0, len(text) - 8) for o in cumulative[:-1])
    assert _joined(delta, 0)[0] == text and delta[-1].outputs[0].text  # the held part comes with the last


def test_final_only_gives_one_output(llm):
    params = dict(temperature=0, max_tokens=7, ignore_eos=True)
    outs = _stream(llm, SamplingParams(**params, output_kind="final_only"))
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == _stream(llm, SamplingParams(**params), "c")[-1].outputs[0].token_ids


def test_an_abort_ends_a_delta_stream_with_an_empty_output(llm):
    llm.engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                       output_kind=RequestOutputKind.DELTA))
    first = [o for o in llm.engine.step() + llm.engine.step() if o.request_id == "a"]
    assert first and sum(len(o.outputs[0].token_ids) for o in first) >= 1
    assert llm.engine.abort_request("a")
    last = [o for o in llm.engine.step() if o.request_id == "a"]
    assert len(last) == 1 and last[0].finished
    assert last[0].outputs[0].token_ids == [] and last[0].outputs[0].finish_reason == "abort"
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def _spanning_stop(llm):
    """A stop string that starts in one token's text and ends in the next one's, found nowhere
    earlier in the greedy output, and the text before it (the token boundaries as the engine's
    text has them: one token a step)."""
    outs = _stream(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), "boundaries")
    ends = [len(o.outputs[0].text) for o in outs]
    text = outs[-1].outputs[0].text
    for i in range(1, len(ends) - 1):
        left, right = min(2, ends[i] - ends[i - 1]), min(2, ends[i + 1] - ends[i])
        stop = text[ends[i] - left : ends[i] + right]
        if left and right and stop.strip() and text.find(stop) == ends[i] - left:
            return stop, text[: ends[i] - left]
    raise AssertionError(f"no token boundary of {text!r} has a stop string around it")


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_streamed_text_never_takes_back_what_it_showed(llm, kind):
    """The stop string's first characters arrive a step before its end: an output must not show
    them (they are cut from the final text), so each output's text extends the previous one."""
    stop, before = _spanning_stop(llm)
    outs = _stream(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                       output_kind=kind))
    texts = [o.outputs[0].text for o in outs if o.outputs]
    if kind == RequestOutputKind.DELTA:
        texts = ["".join(texts[: i + 1]) for i in range(len(texts))]
    assert texts[-1] == before and outs[-1].outputs[0].finish_reason == "stop"
    assert all(before.startswith(t) for t in texts)
    if kind != RequestOutputKind.FINAL_ONLY:
        assert len(texts) > 1


def test_a_stop_string_kept_in_the_output_holds_nothing_back(llm):
    stop, before = _spanning_stop(llm)
    outs = _stream(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                       include_stop_str_in_output=True))
    tok = llm.get_tokenizer()
    assert all(o.outputs[0].text == tok.decode(o.outputs[0].token_ids) for o in outs[:-1])
    assert outs[-1].outputs[0].text == before + stop


def test_generate_reads_final_outputs_whatever_the_kind(llm):
    """LLM.generate asks the engine for final outputs only (as vLLM); the caller's params are left as given."""
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    out = llm.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)[0]
    ref = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and len(out.outputs[0].token_ids) == 6
    assert p.output_kind == RequestOutputKind.DELTA


@pytest.mark.parametrize("value, kind", [(1, RequestOutputKind.DELTA), ("Cumulative", RequestOutputKind.CUMULATIVE),
                                         (RequestOutputKind.FINAL_ONLY, RequestOutputKind.FINAL_ONLY)])
def test_output_kind_takes_the_enum_its_value_or_its_name(value, kind):
    assert SamplingParams(output_kind=value).output_kind is kind


@pytest.mark.parametrize("value", [3, "partial", None, 1.0, True])
def test_a_bad_output_kind_is_named(value):
    with pytest.raises(RequestError, match=r"SamplingParams.output_kind=.* is invalid: give a RequestOutputKind"):
        SamplingParams(output_kind=value)


def test_delta_outputs_of_a_speculative_engine(tmp_path_factory):
    """Under speculation a step emits several tokens; a DELTA output carries them all."""
    models = make_spec_models(tmp_path_factory.mktemp("kind_spec"))
    spec = LLM(str(models["target"]), dtype="float32", max_model_len=128, block_size=8,
               speculative_config=dict(model=str(models["near"]), num_speculative_tokens=3))
    params = dict(temperature=0, max_tokens=20, ignore_eos=True)
    delta = _stream(spec, SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    ref = spec.generate({"prompt_token_ids": PROMPT}, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    text, tokens, _, seqs = _joined(delta, 0)
    assert (text, tokens) == (ref.text, ref.token_ids)
    assert max(len(s.token_ids) for s in seqs) > 1


@pytest.mark.parametrize("n", [1, 3])
def test_the_async_engine_adds_the_engines_deltas_up_to_cumulative_outputs(llm, n):
    """The server's request streams ask the engine for DELTA outputs (no step copies a request's
    whole output) and hand out what CUMULATIVE outputs would hold: each time a consistent prefix
    of the final output, which equals the offline engine's, stop string, logprobs and prompt
    logprobs included."""
    import asyncio

    from tandem.server.async_engine import AsyncEngine

    params = SamplingParams(n=n, temperature=0.8 if n > 1 else 0, seed=5, max_tokens=12, logprobs=2,
                            prompt_logprobs=1, stop=["zq", "ab"], ignore_eos=True)
    want = _stream(llm, params, "offline")[-1]
    kinds = []
    add = llm.engine.add_request

    def spy(request_id, prompt_token_ids, p, **kw):
        kinds.append(p.output_kind)
        return add(request_id, prompt_token_ids, p, **kw)

    llm.engine.add_request = spy
    client = AsyncEngine(llm.engine)
    client.start()

    async def run():
        stream = await client.add_request("served", PROMPT, params)
        seen = []
        async for out in stream:
            seen.append([(c.text, list(c.token_ids), list(c.logprobs)) for c in out.outputs])
        return out, seen

    try:
        got, seen = asyncio.run(run())
    finally:
        asyncio.run(client.shutdown())
        llm.engine.add_request = add
    assert kinds == [RequestOutputKind.DELTA]
    assert got.finished and got.prompt_logprobs == want.prompt_logprobs
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.index, g.text, g.token_ids, g.logprobs) == (w.index, w.text, w.token_ids, w.logprobs)
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob)
    for snapshot in seen:  # every output handed out: a prefix of the final one, its logprobs with its tokens
        for (text, tokens, logprobs), w in zip(snapshot, want.outputs, strict=True):
            assert w.text.startswith(text) and w.token_ids[: len(tokens)] == tokens
            assert logprobs == w.logprobs[: len(tokens)]


def test_the_async_engine_refuses_other_kinds(llm):
    """Its request streams keep each request's output so far, so they must be cumulative."""
    import asyncio

    from tandem.server.async_engine import AsyncEngine

    client = AsyncEngine(llm.engine)
    client.start()
    try:
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
            with pytest.raises(RequestError, match=f"output_kind={kind.name} is not served here"):
                asyncio.run(client.add_request("x", PROMPT, SamplingParams(output_kind=kind)))
    finally:
        asyncio.run(client.shutdown())


def test_an_id_aborted_and_added_again_before_a_step_reports_both(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    llm.engine.add_request("again", PROMPT, params)
    llm.engine.step()
    assert llm.engine.abort_request("again")
    llm.engine.add_request("again", PROMPT, params)  # the id is free once its request ended
    outs = [o for o in llm.engine.step() if o.request_id == "again"]
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"  # the ended one, first
    tokens = [t for o in outs[1:] for t in o.outputs[0].token_ids]
    while llm.engine.has_unfinished_requests():
        tokens += [t for o in llm.engine.step() if o.request_id == "again" for t in o.outputs[0].token_ids]
    assert len(tokens) == 4  # the new one, whole
