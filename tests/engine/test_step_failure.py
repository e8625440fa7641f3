"""A step that fails while serving (out of GPU memory, a bug) ends the requests it ran with a
StepError that names them (and, for out of memory, the settings to change); the requests it did
not run finish with the outputs they would have had, and the engine serves new requests."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import StepError
from tests.helpers import make_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 40)), [3, 1, 4, 1, 5, 9, 2, 6], [100, 101, 102]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("step_failure")
    return {"target": make_hf_model(root / "t", "llama", init_std=0.3),
            "draft": make_hf_model(root / "d", "llama", num_layers=1, init_std=0.3, seed=7)}


def _llm(models, kind):
    kw = dict(dtype="float32", max_model_len=96, block_size=8, max_num_seqs=2)
    if kind == "spec":
        kw["speculative_config"] = dict(model=str(models["draft"]), num_speculative_tokens=3)
    return LLM(str(models["target"]), async_scheduling=kind == "async", **kw)


@pytest.fixture(scope="module")
def reference(models):
    """Greedy outputs of each prompt alone, target-only (speculation does not change them)."""
    llm = _llm(models, "plain")
    return [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def _fail_once(monkeypatch, obj, name, at_call, error):
    real, calls = getattr(obj, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, failing)
    return calls


def _assert_idle(engine):
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks
    assert sorted(engine.scheduler.free_slots) == list(range(engine.cfg.sched.max_num_seqs))


# (engine kind, the object that fails, its method, the failing call): a failure in the target's
# launch, in the collect of a step launched ahead, and in the draft's proposal after verification.
CASES = [
    ("plain", "runner", "launch", 3),
    ("async", "runner", "collect", 4),
    ("spec", "speculator", "propose", 3),
]


@pytest.mark.parametrize("method,at_call", [("collect", 4), ("launch", 4)])
def test_a_failure_with_a_step_planned_ahead_ends_both(models, reference, monkeypatch, method, at_call):
    """Async scheduling with every request decoding: the step launched ahead is dropped (a failed
    collect of the current step, or a failed launch of the next) and its requests end with it."""
    llm = _llm(models, "async")
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", p, GREEDY)
    ahead_in_flight = []
    real_collect = engine.runner.collect

    def collect(launched):
        ahead_in_flight.append(engine._inflight is not None)
        return real_collect(launched)

    monkeypatch.setattr(engine.runner, "collect", collect)
    _fail_once(monkeypatch, engine.runner, method, at_call, torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(StepError) as e:
        while engine.has_unfinished_requests():
            engine.step()
    assert any(ahead_in_flight), "no step was planned ahead before the failure"
    assert sorted(e.value.request_ids) == ["r0", "r1"] and engine._inflight is None
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort", "abort"]
    _assert_idle(engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("kind,where,method,at_call", CASES, ids=[c[0] for c in CASES])
def test_out_of_memory_ends_the_steps_requests_and_the_others_go_on(models, reference, monkeypatch, kind, where,
                                                                    method, at_call):
    llm = _llm(models, kind)
    engine = llm.engine
    target = engine.runner if where == "runner" else engine.runner.speculator
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    _fail_once(monkeypatch, target, method, at_call, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    finished, error = {}, None
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except StepError as e:
            assert error is None, "one failure was injected"
            error = e
            continue
        finished.update((o.request_id, o) for o in outs if o.finished)
    assert error is not None
    # max_num_seqs=2: the failed step ran the first two requests; the two waiting ones were not in it.
    assert sorted(error.request_ids) == ["r0", "r1"]
    message = str(error)
    assert "ran out of GPU memory" in message and "its requests were ended" in message
    assert "lower kv_cache_memory_bytes" in message  # the setting that sized this (CPU) pool
    assert "max_num_batched_tokens=" in message and "max_num_seqs=2" in message
    assert error.__cause__ is None  # torch's message is not the story
    for i in (0, 1):
        assert finished[f"r{i}"].outputs[0].finish_reason == "abort"
    for i in (2, 3):
        assert finished[f"r{i}"].outputs[0].token_ids == reference[i], f"r{i} changed"
        assert finished[f"r{i}"].outputs[0].finish_reason == "length"
    _assert_idle(engine)
    # And the engine serves new work as a fresh one would.
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    _assert_idle(engine)


def _failing_first_step(models, monkeypatch, where: str, method: str, error: BaseException):
    """An engine with one request "a" whose first step fails in engine.<where>.<method>. -> (engine, ExceptionInfo)."""
    engine = _llm(models, "plain").engine
    engine.add_request("a", PROMPTS[0], GREEDY)
    _fail_once(monkeypatch, getattr(engine, where), method, 1, error)
    with pytest.raises(StepError) as e:
        engine.step()
    return engine, e


def test_other_failures_keep_their_cause(models, monkeypatch):
    engine, e = _failing_first_step(models, monkeypatch, "runner", "collect", RuntimeError("injected"))
    assert e.value.request_ids == ["a"] and "failed and its requests were ended" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError) and "injected" in str(e.value)
    assert not engine.has_unfinished_requests()
    assert engine.step()[0].outputs[0].finish_reason == "abort"  # reported once, then forgotten
    assert engine.step() == []
    _assert_idle(engine)


def test_generate_ends_its_requests_when_a_step_fails(models, reference, monkeypatch):
    llm = _llm(models, "plain")
    _fail_once(monkeypatch, llm.engine.runner, "launch", 2, torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(StepError, match="ran out of GPU memory"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    _assert_idle(llm.engine)  # the waiting requests of that call were ended too
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("where", ["engine", "runner"])
def test_interrupted_generate_leaves_nothing_behind(models, reference, monkeypatch, where):
    """Ctrl-C between steps (generate's own clean-up) or inside one (the engine's, then generate's)."""
    llm = _llm(models, "plain")
    target, method = (llm.engine, "step") if where == "engine" else (llm.engine.runner, "launch")
    _fail_once(monkeypatch, target, method, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    _assert_idle(llm.engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[:2]


def test_planning_failure_names_no_requests(models, monkeypatch):
    engine, e = _failing_first_step(models, monkeypatch, "scheduler", "schedule", RuntimeError("planning bug"))
    assert e.value.request_ids is None and not e.value.fatal
    assert engine.has_unfinished_requests()  # nothing ran, nothing ended: the next step serves it
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(engine)


def test_a_device_error_is_fatal(models, monkeypatch):
    """An error that leaves the CUDA context unusable (an illegal memory access) is reported as fatal."""
    _, e = _failing_first_step(models, monkeypatch, "runner", "collect",
                               torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert e.value.fatal and e.value.request_ids == ["a"]
    assert "leaves the GPU unusable" in str(e.value) and "restart the process" in str(e.value)


def test_after_a_device_error_the_engine_takes_no_work(models, monkeypatch):
    engine = _llm(models, "plain").engine
    for i, p in enumerate(PROMPTS[:3]):  # max_num_seqs=2: the third waits, outside the failed step
        engine.add_request(f"r{i}", p, GREEDY)
    _fail_once(monkeypatch, engine.runner, "collect", 1, torch.AcceleratorError("CUDA error: misaligned address"))
    with pytest.raises(StepError) as e:
        engine.step()
    assert sorted(e.value.request_ids) == ["r0", "r1"]
    assert not engine.has_unfinished_requests()  # the waiting one ended too: nothing can run it
    with pytest.raises(StepError, match="^the engine stopped after a device error .*; restart the process$") as e2:
        engine.add_request("b", PROMPTS[0], GREEDY)
    assert e2.value.fatal
