"""A mixed workload against each request run alone.

Requests of every kind (greedy and seeded sampling, top-k/p/min-p, penalties, logit bias, banned
and allowed tokens, stop tokens, min_tokens, logprobs, prompt logprobs, n = 2, structured outputs,
repetitive prompts that n-gram lookup drafts from) arrive at different steps; some are aborted while they run; the
KV pool is small enough to preempt and the token budget small enough to cut prompts into chunks.
Every finished request must equal what it produces alone on a roomy target-only engine (tokens,
finish and stop reasons, logprobs), and an aborted one must have emitted a prefix of it, in each
engine configuration: target-only, a draft model, n-gram and suffix lookup, async scheduling, the
priority scheduler, a watermark and an fp8 KV cache. The workload is seeded: the same requests every run."""
import math
import random
from dataclasses import dataclass

import pytest

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.spec import step_costs
from tandem.spec.adaptive import StepCosts
from tests.helpers import make_spec_models

MAX_LEN = 192
VOCAB = (2, 320)  # the token ids prompts and biases draw from


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_spec_models(tmp_path_factory.mktemp("mixed"))


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrive: int  # the engine step it is added before
    abort: int | None  # the step it is aborted before (None: runs to the end)
    priority: int


def _params(rng: random.Random) -> SamplingParams:
    kw: dict = dict(max_tokens=rng.randint(1, 28), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.5:
        kw.update(temperature=0)
    else:
        kw.update(temperature=rng.choice([0.5, 0.8, 1.3]), seed=rng.randrange(1 << 30))
        kw.update(top_k=rng.choice([0, 0, 5, 40]), top_p=rng.choice([1.0, 1.0, 0.9]), min_p=rng.choice([0.0, 0.05]))
        if rng.random() < 0.3:
            kw.update(n=2)
    if rng.random() < 0.3:
        kw.update(repetition_penalty=1.3, presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=0.4)
    if rng.random() < 0.15:
        kw.update(structured_outputs=rng.choice([StructuredOutputsParams(regex=r"[0-9]{2,4}-(yes|no)"),
                                                 StructuredOutputsParams(choice=["apple pie", "banana", "fox"])]))
        return SamplingParams(**kw)
    if rng.random() < 0.2:
        kw.update(logit_bias={rng.randrange(*VOCAB): rng.choice([-100.0, 5.0]) for _ in range(3)})
    elif rng.random() < 0.25:  # output that loops over a few tokens: long runs of drafts that stand
        kw.update(logit_bias={rng.randrange(*VOCAB): 12.0 for _ in range(rng.randint(1, 3))})
    if rng.random() < 0.15:
        kw.update(allowed_token_ids=rng.sample(range(*VOCAB), 40))
    if rng.random() < 0.15:
        kw.update(bad_words_token_ids=[[rng.randrange(*VOCAB)] for _ in range(4)])
    if rng.random() < 0.3:
        kw.update(stop_token_ids=rng.sample(range(*VOCAB), 12))
    if rng.random() < 0.2:
        kw.update(min_tokens=min(kw["max_tokens"], rng.randint(1, 10)))
    if rng.random() < 0.3:
        kw.update(logprobs=rng.choice([0, 2]))
    if rng.random() < 0.15:
        kw.update(prompt_logprobs=1)
    return SamplingParams(**kw)


def _prompt(rng: random.Random) -> list[int]:
    n = rng.choice([1, 3, 8, 20, 45, 90])
    if rng.random() < 0.3:  # a repeating stretch: something for n-gram lookup to find
        unit = [rng.randrange(*VOCAB) for _ in range(rng.randint(2, 6))]
        return (unit * (n // len(unit) + 1))[:max(n, 2 * len(unit))]
    return [rng.randrange(*VOCAB) for _ in range(n)]


def _workload(seed: int, num_jobs: int = 28) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(num_jobs):
        arrive = rng.randint(0, 16)
        abort = arrive + rng.randint(0, 8) if rng.random() < 0.15 else None
        jobs.append(Job(f"r{i}", _prompt(rng), _params(rng), arrive, abort, rng.randint(0, 2)))
    return jobs


def _drive(llm: LLM, jobs: list[Job], priorities: bool) -> dict:
    """Runs the jobs through llm's engine as they arrive and abort -> request id -> final output."""
    engine, done, step = llm.engine, {}, 0
    while step <= max(j.arrive for j in jobs) or engine.has_unfinished_requests():
        for job in jobs:
            if job.abort == step:
                engine.abort_request(job.request_id)
            if job.arrive == step:
                engine.add_request(job.request_id, job.prompt, job.params,
                                   priority=job.priority if priorities else 0)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 5000, "the workload did not finish"
    return done


def _logprob_rows(rows):
    return None if rows is None else [
        None if row is None else {t: (lp.logprob, lp.rank) for t, lp in row.items()} for row in rows]


def _same_rows(got, want, what: str, tol: float) -> None:
    got, want = _logprob_rows(got), _logprob_rows(want)
    if want is None or got is None:
        assert got is None and want is None, what
        return
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        if w is None or g is None:
            assert g is None and w is None, what
            continue
        assert g.keys() == w.keys(), what
        for t in w:
            assert g[t][1] == w[t][1] and math.isclose(g[t][0], w[t][0], rel_tol=tol, abs_tol=tol), what


def expected_alone(target, jobs: list[Job], **kw) -> dict:
    """Each job's output alone on a roomy target-only engine."""
    alone = LLM(str(target), dtype="float32", block_size=8, max_model_len=MAX_LEN, **kw)
    return {job.request_id: alone.generate({"prompt_token_ids": job.prompt}, job.params, use_tqdm=False)[0]
            for job in jobs}


def alone_by_settings(target, jobs: list[Job], **kw):
    """-> settings -> expected_alone(target, jobs, **kw, **settings), each computed once."""
    cache = {}

    def expect(settings: dict) -> dict:
        key = repr(sorted(settings.items()))
        if key not in cache:
            cache[key] = expected_alone(target, jobs, **kw, **settings)
        return cache[key]
    return expect


@pytest.fixture(scope="module")
def workload(models):
    jobs = _workload(seed=2026)
    return jobs, alone_by_settings(models["target"], jobs)


TIGHT = dict(num_gpu_blocks_override=24, max_num_seqs=6, max_num_batched_tokens=40)
# On this table the choice of drafts under "auto" follows the acceptance seen (the measured one
# may leave the draft off throughout).
AUTO_COSTS = StepCosts((1, 6), ((4.0, 4.8, 5.2, 5.6), (4.4, 5.4, 5.9, 6.4)))

# Settings that change every request's output: the roomy engine a request runs alone on has them too.
SHARED = ("watermark_config", "kv_cache_dtype")
WATERMARK = {"key": 20261203}

CONFIGS = {
    "target-only": {},
    "draft": dict(speculative_config=dict(model="near", num_speculative_tokens=3)),
    "ngram": dict(speculative_config=dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                          prompt_lookup_max=3)),
    "suffix": dict(speculative_config=dict(method="suffix", num_speculative_tokens=6)),
    "suffix-async": dict(speculative_config=dict(method="suffix", num_speculative_tokens=4,
                                                 suffix_decoding_corpus_tokens=256), async_scheduling=True),
    # async scheduling plans the steps of more than 3 requests (no drafts) ahead of the last result
    "draft-async": dict(speculative_config=dict(model="near", num_speculative_tokens=2,
                                                num_speculative_tokens_per_batch_size=[[1, 3, 2], [4, 6, 0]]),
                        async_scheduling=True),
    "ngram-async": dict(speculative_config=dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                                                prompt_lookup_max=2), async_scheduling=True),
    "draft-auto": dict(speculative_config=dict(model="near", num_speculative_tokens=3,
                                               num_speculative_tokens_per_batch_size="auto"), async_scheduling=True),
    "draft-confidence": dict(speculative_config=dict(model="near", num_speculative_tokens=4,
                                                     draft_confidence_threshold=0.4)),
    "draft-fp8-pruned": dict(speculative_config=dict(model="near", num_speculative_tokens=3, quantization="fp8",
                                                     draft_vocab_size=160)),
    "watermark": dict(watermark_config=WATERMARK),
    "draft-watermark": dict(speculative_config=dict(model="near", num_speculative_tokens=3),
                            watermark_config=WATERMARK),
    "fp8-kv": dict(kv_cache_dtype="fp8"),
    "draft-fp8-kv": dict(speculative_config=dict(model="near", num_speculative_tokens=3), kv_cache_dtype="fp8"),
    "priority": dict(scheduling_policy="priority"),
    "draft-priority": dict(speculative_config=dict(model="near", num_speculative_tokens=4),
                           scheduling_policy="priority"),
}


def run_and_check(models, jobs: list[Job], expect_for, name: str, monkeypatch, **engine_kw) -> LLM:
    """Runs the jobs on CONFIGS[name] (a tight pool and budget) and checks each against itself alone
    (expect_for: alone_by_settings)."""
    kw = CONFIGS[name]
    expect = expect_for({key: kw[key] for key in SHARED if key in kw})
    spec = kw.get("speculative_config")
    if spec is not None and spec.get("num_speculative_tokens_per_batch_size") == "auto":
        monkeypatch.setattr(step_costs, "profile_step_costs", lambda runner, cfg: AUTO_COSTS)
    if spec is not None and "model" in spec:
        kw = dict(kw, speculative_config=dict(spec, model=str(models[spec["model"]])))
    llm = LLM(str(models["target"]), dtype="float32", block_size=8, max_model_len=MAX_LEN, **TIGHT, **kw,
              **engine_kw)
    done = _drive(llm, jobs, priorities=kw.get("scheduling_policy") == "priority")
    # fp32 logits move by ~1e-6 with the batch's shape; an fp8 cache rounds such keys and values
    # to neighbouring codes now and then (logprobs ~1e-3 apart, the tokens the same)
    tol = 5e-3 if kw.get("kv_cache_dtype") == "fp8" else 1e-4
    preempted = aborted = 0
    for job in jobs:
        got, want = done[job.request_id], expect[job.request_id]
        what = f"{name}: {job}"
        assert len(got.outputs) == len(want.outputs) == job.params.n, what
        preempted += got.metrics.num_preemptions
        for g, w in zip(got.outputs, want.outputs):
            if g.finish_reason == "abort":
                aborted += 1
                assert job.abort is not None and g.token_ids == w.token_ids[:len(g.token_ids)], what
                continue
            assert (g.token_ids, g.finish_reason, g.stop_reason) == (w.token_ids, w.finish_reason, w.stop_reason), what
            _same_rows(g.logprobs, w.logprobs, what, tol)
        if all(g.finish_reason != "abort" for g in got.outputs):
            _same_rows(got.prompt_logprobs, want.prompt_logprobs, what, tol)
    assert preempted > 0 and aborted > 0, (preempted, aborted)  # the workload reached both
    if spec is not None:
        assert llm.engine.spec_metrics.num_accepted_tokens > 0
    if llm.engine.adaptive is not None:
        by_k = llm.engine.adaptive.num_steps_by_k
        assert sum(by_k[1:]) > 0 and sum(n > 0 for n in by_k) >= 2, by_k  # it drafted, and changed its mind
    return llm


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_request_equals_itself_alone(models, workload, name, monkeypatch):
    run_and_check(models, *workload, name, monkeypatch)
