"""Priority scheduling through the engine: who runs first, what a preemption keeps, and the errors.

The scheduler's own tests (tests/scheduler) cover the policy step by step; these check that the
engine and LLM pass priorities through, and that outputs do not depend on them.
"""
import numpy as np
import pytest

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError, RequestError
from tests.helpers import make_hf_model

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("priority") / "m", init_std=0.3)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), dtype="float32", max_model_len=128, block_size=8, max_num_seqs=2,
               scheduling_policy="priority")


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's greedy tokens, from an engine that runs first come, first served."""
    fcfs = LLM(str(model), dtype="float32", max_model_len=128, block_size=8)
    return [o.outputs[0].token_ids for o in fcfs.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS,
                                                          use_tqdm=False)]


def _drain(engine) -> list[str]:
    """Step until idle; the request ids in the order they finished."""
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    return done


def test_generate_takes_one_priority_a_prompt(llm, alone):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False, priority=[3, 2, 1, 0])
    assert [o.outputs[0].token_ids for o in outs] == alone  # in the prompts' order, each its own tokens
    # Two slots: the last two prompts (the lowest values) are scheduled first, the first two after.
    assert max(o.metrics.first_scheduled_time for o in outs[2:]) < min(o.metrics.first_scheduled_time
                                                                      for o in outs[:2])


def test_a_later_higher_priority_request_preempts_the_lowest(llm, alone):
    engine = llm.engine
    engine.add_request("low-a", PROMPTS[0], PARAMS, priority=2)
    engine.add_request("low-b", PROMPTS[1], PARAMS, priority=3)
    engine.step()
    engine.step()
    engine.add_request("urgent", PROMPTS[2], PARAMS, priority=0)
    outs = {}
    order = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
                order.append(o.request_id)
    # Two slots: "urgent" takes low-b's (the lowest priority); low-a runs on and finishes first.
    assert order == ["low-a", "urgent", "low-b"]
    assert outs["low-b"].metrics.num_preemptions == 1
    assert outs["low-a"].metrics.num_preemptions == outs["urgent"].metrics.num_preemptions == 0
    for rid, i in (("low-a", 0), ("low-b", 1), ("urgent", 2)):
        assert outs[rid].outputs[0].token_ids == alone[i]


def test_equal_priorities_run_first_come_first_served(llm):
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, PARAMS.clone(max_tokens=3 + i), priority=1)
    assert _drain(engine) == ["r0", "r1", "r2", "r3"]
    assert engine.scheduler.blocks.num_free_blocks == engine.cfg.cache.num_blocks


def test_priority_errors(model, llm):
    with pytest.raises(ConfigError, match="scheduling_policy='lifo' is not supported"):
        LLM(str(model), dtype="float32", max_model_len=128, scheduling_policy="lifo")
    for bad in (1.5, "1", True, None):
        with pytest.raises(RequestError, match="priority=.* must be an integer"):
            llm.engine.add_request("bad", PROMPTS[0], PARAMS, priority=bad)
    assert not llm.engine.has_unfinished_requests() and "bad" not in llm.engine._requests
    with pytest.raises(RequestError, match="one integer per prompt"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False, priority=[0])
    with pytest.raises(RequestError, match="must be an integer"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, priority=[0.5])
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, priority=[np.int64(-2)])
    assert len(out[0].outputs[0].token_ids) == 12  # numpy's integers are integers


def test_fcfs_refuses_a_priority(model):
    fcfs = LLM(str(model), dtype="float32", max_model_len=128)
    with pytest.raises(RequestError, match="scheduling_policy='priority'"):
        fcfs.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, priority=[1])
    with pytest.raises(RequestError, match="scheduling_policy='priority'"):
        fcfs.engine.add_request("x", PROMPTS[0], PARAMS, priority=-1)
    assert not fcfs.engine.has_unfinished_requests()
    out = fcfs.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False, priority=[0])  # 0 is fine
    assert len(out[0].outputs[0].token_ids) == 12


def test_the_servers_queue_makes_way_for_a_higher_priority(llm):
    """max_queued_requests under the priority policy: a request counts what would wait ahead of
    it, so a low-priority backlog does not turn an urgent one away; the queue stays within the
    limit by refusing (503) the latest request of the lowest priority that has not started."""
    import asyncio

    from tandem.server.async_engine import AsyncEngine, RequestStream, ServerOverloaded, _Add

    engine, loop = llm.engine, asyncio.new_event_loop()
    client = AsyncEngine(engine, max_queued_requests=2)  # two batch slots, two more waiting

    def submit(name: str, priority: int) -> RequestStream:
        stream = RequestStream(name, loop)
        client._handle(_Add(stream, PROMPTS[0], PARAMS, None, priority))
        loop.run_until_complete(asyncio.sleep(0))  # deliver what the engine side put
        return stream

    try:
        low = [submit(f"low{i}", 5) for i in range(5)]
        assert [s._accepted for s in low] == [True] * 4 + [False]  # the fifth would be the third waiting
        assert isinstance(low[4]._error, ServerOverloaded)
        urgent = submit("urgent", 0)
        assert urgent._accepted and urgent._error is None  # nothing of its priority waits ahead of it
        assert isinstance(low[3]._error, ServerOverloaded) and "took this one's place" in str(low[3]._error)
        assert all(s._error is None for s in low[:3])
        assert sorted(engine._requests) == ["low0", "low1", "low2", "urgent"]
    finally:
        for name in list(engine._requests):
            engine.abort_request(name)
        loop.close()
    _drain(engine)
    assert engine.scheduler.blocks.num_free_blocks == engine.cfg.cache.num_blocks


def test_a_beam_searchs_steps_are_let_in_once_and_never_shed(llm):
    """The async engine's rules for a beam search's steps: its first step counts the beams it lets
    in (num_seqs), its later steps (admitted) pass the queue limit, and its steps (internal) are
    not shed for a request of a higher priority."""
    import asyncio

    from tandem.server.async_engine import AsyncEngine, RequestStream, ServerOverloaded, _Add

    engine, loop = llm.engine, asyncio.new_event_loop()
    client = AsyncEngine(engine, max_queued_requests=2)  # two batch slots, two more waiting

    def submit(name: str, priority: int, **kw) -> RequestStream:
        stream = RequestStream(name, loop)
        client._handle(_Add(stream, PROMPTS[0], PARAMS, None, priority, **kw))
        loop.run_until_complete(asyncio.sleep(0))
        return stream

    try:
        low = [submit(f"low{i}", 5) for i in range(3)]  # one waits
        first = submit("search-0", 5, internal=True, num_seqs=3)  # its 3 beams would make 4 wait
        assert isinstance(first._error, ServerOverloaded)
        first = submit("search-0", 5, internal=True, num_seqs=2)  # 2 beams: 3 wait, over the limit too
        assert isinstance(first._error, ServerOverloaded)
        first = submit("search-0", 5, internal=True, num_seqs=1)
        assert first._accepted  # 2 wait: within the limit
        later = [submit(f"search-1-{j}", 5, internal=True, admitted=True) for j in range(2)]
        assert all(s._accepted and s._error is None for s in later)  # 4 wait: past the limit, let in
        assert isinstance(submit("late", 5)._error, ServerOverloaded)  # an ordinary one is not
        urgent = submit("urgent", 0)
        assert urgent._accepted  # it sheds the ordinary requests of lower priority, never the steps
        assert all(s._error is None for s in [first, *later])
        assert any(isinstance(s._error, ServerOverloaded) for s in low)
    finally:
        for name in list(engine._requests):
            engine.abort_request(name)
        loop.close()
    _drain(engine)
