"""Async scheduling: steps planned and launched before the previous result reaches the host give
the same outputs as the synchronous loop (on the CPU the overlap buys nothing, but the logic is
the GPU's)."""
import pytest

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tests.helpers import make_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("async") / "m", "llama", init_std=0.3)


def _llm(model, overlap):
    return LLM(str(model), dtype="float32", max_model_len=96, block_size=8, max_num_seqs=6,
               async_scheduling=overlap)


def _workload(tok):
    """Greedy and seeded sampled requests that stop by EOS, a stop string, a stop id,
    max_tokens and max_model_len, with logprobs, penalties, min_tokens and n = 2."""
    base = "The quick brown"
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [
        ("The quick brown", greedy),
        ({"prompt_token_ids": [7] * 90}, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)),
        ("def fib(n):", SamplingParams(temperature=0.8, seed=3, max_tokens=20, logprobs=2)),
        ("lazy dog", SamplingParams(temperature=1.0, seed=5, max_tokens=16, n=2, min_tokens=4,
                                    presence_penalty=0.5, ignore_eos=True)),
        (base, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tok(base)[-1]], ignore_eos=True)),
        ("jumps over", SamplingParams(temperature=0.7, seed=11, max_tokens=1)),
        ("return n", SamplingParams(temperature=0, max_tokens=2)),
    ]
    return reqs


def _summary(outs):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
          [{t: (round(lp.logprob, 5), lp.rank) for t, lp in d.items()} for d in c.logprobs or []])
         for c in o.outputs]
        for o in outs
    ]


def test_async_outputs_equal_synchronous_outputs(model):
    sync_llm, async_llm = _llm(model, False), _llm(model, True)
    assert async_llm.engine.async_scheduling and not sync_llm.engine.async_scheduling
    tok = lambda s: sync_llm.get_tokenizer()(s).input_ids  # noqa: E731
    reqs = _workload(tok)
    prompts, params = [p for p, _ in reqs], [sp for _, sp in reqs]
    # A stop string cut from the greedy text of the first prompt.
    text = sync_llm.generate(prompts[0], params[0], use_tqdm=False)[0].outputs[0].text
    prompts.append(prompts[0])
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[10:13]]))

    ahead = []
    sched = async_llm.engine.scheduler
    plan_ahead = sched.schedule_ahead
    sched.schedule_ahead = lambda prev: ahead.append(plan_ahead(prev)) or ahead[-1]
    expected = _summary(sync_llm.generate(prompts, params, use_tqdm=False))
    got = _summary(async_llm.generate(prompts, params, use_tqdm=False))
    assert got == expected
    assert sum(p is not None for p in ahead) >= 10  # the steady decode steps ran planned ahead
    # Nothing is left in flight or allocated once every request has finished.
    assert async_llm.engine._inflight is None
    assert sched.blocks.num_free_blocks == async_llm.engine.cfg.cache.num_blocks
    # Again, now that the engine is warm (the stop string's request reuses freed slots).
    assert _summary(async_llm.generate(prompts, params, use_tqdm=False)) == expected


def test_abort_while_a_step_is_in_flight(model):
    llm = _llm(model, True)
    engine = llm.engine
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("x", [3] * 30, p)
    engine.add_request("y", [4] * 20, p)
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None  # decoding: the next step is already launched
    assert engine.abort_request("x")
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    assert finished["x"].outputs[0].finish_reason == "abort"
    ref = _llm(model, False).generate({"prompt_token_ids": [4] * 20}, p, use_tqdm=False)[0].outputs[0].token_ids
    assert finished["y"].outputs[0].token_ids == ref
    assert engine._inflight is None
    assert engine.scheduler.blocks.num_free_blocks == engine.cfg.cache.num_blocks


def test_steps_without_drafts_are_planned_ahead_with_a_draft(model):
    """With drafting turned off at some batch sizes, those steps are planned ahead as without a
    draft; the output is the synchronous target-only output, the drafting steps around them too."""
    spec = {"model": str(model), "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[3, 6, 0]]}
    llm = LLM(str(model), dtype="float32", max_model_len=96, block_size=8, max_num_seqs=6, async_scheduling=True,
              speculative_config=spec)
    assert llm.engine.async_scheduling
    prompts = [{"prompt_token_ids": [5 + i] * (3 + 4 * i)} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 8 * i, ignore_eos=True) for i in range(5)]
    ahead = []
    sched = llm.engine.scheduler
    plan_ahead = sched.schedule_ahead
    sched.schedule_ahead = lambda prev: ahead.append(plan_ahead(prev)) or ahead[-1]
    expected = [o.outputs[0].token_ids for o in _llm(model, False).generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    planned = [p for p in ahead if p is not None]
    assert len(planned) >= 10 and all(r.draft_skip for p in planned for r in p.reqs)
    m = llm.engine.spec_metrics
    assert m.num_draft_rounds > 0 and m.acceptance_rate == 1.0  # the target as its own draft, after the skips
    assert llm.engine._inflight is None and sched.blocks.num_free_blocks == llm.engine.cfg.cache.num_blocks


def test_sampled_drafts_are_planned_ahead_only_where_a_stop_cannot_turn_drafting_on(model):
    """Probabilistic drafts: a step planned ahead at a batch size without drafts, while a request
    stops (EOS) in the step being collected, would skip the draft where the synchronous engine,
    planning once that request is out, drafts; the seeded draws then differ. Such steps wait."""
    eos = LLM(str(model), dtype="float32", max_model_len=96).get_tokenizer().eos_token_id
    spec = {"model": str(model), "num_speculative_tokens": 3, "draft_sample_method": "probabilistic",
            "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 0]]}
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i] * 3} for i in range(3)]
    params = [SamplingParams(temperature=0.9, seed=10, max_tokens=30, min_tokens=10, logit_bias={eos: 40.0}),
              SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=12, max_tokens=30, ignore_eos=True)]
    outs = {}
    for overlap in (False, True):
        llm = LLM(str(model), dtype="float32", max_model_len=96, block_size=8, max_num_seqs=6,
                  async_scheduling=overlap, speculative_config=spec)
        assert llm.engine.async_scheduling == overlap
        outs[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                         for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[True] == outs[False]
    assert outs[False][0][1] == "stop" and len(outs[False][0][0]) == 11  # EOS once min_tokens allows it


def test_lookup_steps_are_planned_ahead_while_nothing_matches(model):
    """method="ngram": while the last applied result drafted nothing, steps are planned ahead (no
    drafts verified, the lookup after them); once a lookup finds drafts, steps wait for their
    result and verify them. The output is target-only's, with sampled requests and n = 2 among them."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(str(model), dtype="float32", max_model_len=96, block_size=8, max_num_seqs=6, async_scheduling=True,
              speculative_config=spec)
    assert llm.engine.async_scheduling
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i] * (1 + i)} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=30 + 8 * i, ignore_eos=True) for i in range(4)]
    params.append(SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=40, ignore_eos=True))
    ahead = []
    sched = llm.engine.scheduler
    plan_ahead = sched.schedule_ahead
    sched.schedule_ahead = lambda prev: ahead.append(plan_ahead(prev)) or ahead[-1]
    expected = [[c.token_ids for c in o.outputs] for o in _llm(model, False).generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    planned = [p for p in ahead if p is not None]
    assert len(planned) >= 5 and all(r.num_drafts == 0 and r.num_next_drafts == 3 for p in planned for r in p.reqs)
    assert llm.engine.spec_metrics.num_draft_tokens > 0  # and the synchronous steps verified drafts
    assert llm.engine._inflight is None and sched.blocks.num_free_blocks == llm.engine.cfg.cache.num_blocks


def test_async_scheduling_with_a_draft_is_refused(model):
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLM(str(model), dtype="float32", max_model_len=96, async_scheduling=True,
            speculative_config={"model": str(model), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLM(str(model), dtype="float32", async_scheduling="yes")
    # "auto" with probabilistic drafts: its K follows the result being collected, whose seeded draws it decides
    with pytest.raises(ConfigError, match="greedy drafts"):
        LLM(str(model), dtype="float32", max_model_len=96, async_scheduling=True,
            speculative_config={"model": str(model), "num_speculative_tokens": 2, "draft_sample_method": "probabilistic",
                                "num_speculative_tokens_per_batch_size": "auto"})
