"""Greedy speculative output equals target-only greedy output, token for token."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.models.decoder import KVCache
from tandem.config import read_arch_config
from tandem.kernels import cpu_build
from tandem.layers.quant import quantize_fp8
from tandem.spec import step_costs
from tandem.spec.adaptive import StepCosts
from tandem.spec.speculator import DraftSpeculator
from tests.helpers import make_hf_model, make_spec_models

MAX_LEN = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_spec_models(tmp_path_factory.mktemp("spec"))


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist()} for n in lengths]


PROMPTS = _prompts([4, 19, 64, 7, 33, 120])
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _llm(models, draft=None, k=4, method="greedy", spec_extra=None, **kw):
    spec = None
    if draft is not None:
        spec = dict(model=str(models[draft]), num_speculative_tokens=k, draft_sample_method=method, **(spec_extra or {}))
    kw.setdefault("max_model_len", MAX_LEN)
    return LLM(str(models["target"]), dtype="float32", block_size=8, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def baseline(models):
    outs = _llm(models).generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_near_draft_matches_target(models, baseline, k, method):
    llm = _llm(models, "near", k, method)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(outs) == baseline
    m = llm.engine.spec_metrics
    assert m.num_draft_rounds > 0
    assert 0.05 < m.acceptance_rate < 0.98  # partial acceptance exercises both branches
    assert all(o.metrics.num_draft_tokens > 0 for o in outs)


def test_get_metrics_reads_as_vllms(models):
    """LLM.get_metrics() in vLLM's shapes: the spec-decode counters and the per-position Vector that
    vLLM's spec_decode example reads, equal to the engine's counts and to the requests' own."""
    from tandem.metrics_reader import Counter, Gauge, Vector

    llm = _llm(models, "near", 3)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = {m.name: m for m in llm.get_metrics()}
    assert got["tandem_spec_decode_num_drafts"].labels == {"model_name": str(models["target"])}
    drafts, tokens = got["tandem_spec_decode_num_drafts"], got["tandem_spec_decode_num_draft_tokens"]
    accepted = got["tandem_spec_decode_num_accepted_tokens"]
    per_pos = got["tandem_spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(drafts, Counter) and isinstance(per_pos, Vector) and len(per_pos.values) == 3
    assert tokens.value == sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert accepted.value == sum(per_pos.values) == sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafts.value == llm.engine.spec_metrics.num_draft_rounds > 0
    assert isinstance(got["tandem_num_requests_running"], Gauge) and got["tandem_num_requests_running"].value == 0
    assert got["tandem_prefix_cache_queries"].value == sum(len(o.prompt_token_ids) for o in outs)


@pytest.mark.parametrize("k,isa", [(2, "avx512"), (4, "avx512"), (7, "avx512"), (4, "avx2"), (4, "avx512bf16"),
                                   (7, "avx512bf16")])
def test_bf16_matches_target_only_bit_for_bit(models, k, isa):
    """In bf16 too: the CPU linears (each build of our kernel) give a row the same bits in any
    batch and attention runs each decode / verification token alone against exactly its keys, so
    a verified token sees the logits a decoded one would (batched requests, long outputs, partial
    acceptance)."""
    if cpu_build.load_error(isa) is not None:
        pytest.skip(f"CPU kernels: {cpu_build.load_error(isa)}")
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    common = dict(dtype="bfloat16", block_size=8, max_model_len=MAX_LEN, cpu_matmul=isa)
    target = LLM(str(models["target"]), **common)
    expect = _tokens(target.generate(PROMPTS[:5], params, use_tqdm=False))
    llm = LLM(str(models["target"]), **common,
              speculative_config=dict(model=str(models["near"]), num_speculative_tokens=k))
    assert _tokens(llm.generate(PROMPTS[:5], params, use_tqdm=False)) == expect
    assert 0.05 < llm.engine.spec_metrics.acceptance_rate < 0.98


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_draft_matches_target(models, dtype):
    """A draft quantized to fp8 (weight-only, speculative_config quantization="fp8") proposes from
    other weights, fp8-representable ones: the output is still the target's. (This random model's
    logits are flat enough that fp8 alone costs the target-as-its-own-draft most of its
    agreement; the unrelated draft agrees < 10% of the time.)"""
    target = LLM(str(models["target"]), dtype=dtype, block_size=8, max_model_len=MAX_LEN)
    expect = _tokens(target.generate(PROMPTS, PARAMS, use_tqdm=False))
    for draft, low, high in (("near", 0.05, 0.98), ("target", 0.25, 0.98)):
        llm = LLM(str(models["target"]), dtype=dtype, block_size=8, max_model_len=MAX_LEN,
                  speculative_config=dict(model=str(models[draft]), num_speculative_tokens=4, quantization="fp8"))
        assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expect
        assert low < llm.engine.spec_metrics.acceptance_rate <= high
    lin = llm.engine.runner.speculator.model.model.layers[0].mlp.down_proj  # the target's, quantized
    if hasattr(lin, "w8"):  # bf16 on the CPU kernels: the e4m3 bytes alone (W8Linear)
        assert lin.w8.dtype == torch.float8_e4m3fn
        w = lin.w8.float() * lin.w_scale[:, None]
    else:
        w = lin.weight
        q, s = quantize_fp8(w)
        assert torch.equal(q.float() * s[:, None], w.float())
    assert not torch.equal(w.float(), target.engine.runner.model.model.layers[0].mlp.down_proj.weight.float())


def test_target_as_draft_accepts_everything(models, baseline):
    llm = _llm(models, "target", 4)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(outs) == baseline
    assert llm.engine.spec_metrics.acceptance_rate == 1.0


def test_target_as_its_own_sampled_draft_accepts_everything(models):
    """Sampled drafts from the target itself pass every ratio test (q == p) under the request's temperature,
    min-p, top-k and top-p: the draft samples from the distribution the target verifies against (min-p was
    left out of the drafts: 0.42 of them accepted at min_p=0.1)."""
    llm = _llm(models, "target", 4, "probabilistic")
    for kw in (dict(), dict(min_p=0.1), dict(top_k=5), dict(top_p=0.7), dict(min_p=0.2, top_k=8, top_p=0.9)):
        params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=1, n=2, **kw)
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in outs) == drafted, kw


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_unrelated_smaller_draft(models, baseline, method):
    llm = _llm(models, "other", 3, method)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(outs) == baseline
    assert llm.engine.spec_metrics.acceptance_rate < 0.1


@pytest.mark.parametrize("draft_vocab", [310, 330])
def test_draft_vocabulary_of_another_size(models, baseline, tmp_path, draft_vocab):
    """A draft whose table has fewer or more padding rows than the target's 320 (the tokenizer has
    301 tokens): the target keeps its whole vocabulary; prompts hold ids up to 319, which a
    310-row draft embeds as its last row."""
    d = make_hf_model(tmp_path / "d", "qwen2", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, seed=7,
                      vocab_size=draft_vocab)
    spec = dict(model=str(d), num_speculative_tokens=3)
    llm = LLM(str(models["target"]), dtype="float32", block_size=8, max_model_len=MAX_LEN, speculative_config=spec)
    assert llm.engine.vocab_size == 320
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    base = _llm(models).generate(PROMPTS, params, use_tqdm=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(outs) == baseline == _tokens(base)
    for a, b in zip(outs, base):
        assert [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == pytest.approx(
            [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)], abs=1e-4)


def test_chunked_prefill_with_mixed_batch(models, baseline):
    llm = _llm(models, "near", 4, max_num_batched_tokens=24)
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == baseline


def test_preemption(models, baseline):
    target_arch = read_arch_config(models["target"])
    draft_arch = read_arch_config(models["near"])
    per_block = KVCache.bytes_per_block(target_arch, 8, torch.float32) + KVCache.bytes_per_block(
        draft_arch, 8, torch.float32
    )
    llm = _llm(models, "near", 4, max_model_len=176, kv_cache_memory_bytes=per_block * 24)
    params = PARAMS.clone(prompt_logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(outs) == baseline
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.cfg.cache.num_blocks
    # Prompt logprobs with speculation and preemption (recomputed prompts add nothing) = target-only's.
    ref = _llm(models).generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(outs, ref):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert [x[t].logprob for t in x] == pytest.approx([y[t].logprob for t in x], abs=1e-4)


SAMPLED = [SamplingParams(temperature=t, top_p=top_p, top_k=top_k, seed=100 + i, max_tokens=40, ignore_eos=True,
                          presence_penalty=pres)
           for i, (t, top_p, top_k, pres) in enumerate([(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.3, 1.0, 20, 0.0),
                                                        (0.9, 0.95, 0, 0.5), (1.0, 1.0, 0, 0.0), (0.6, 1.0, 5, 0.0)])]


@pytest.mark.parametrize("k", [1, 4])
def test_seeded_sampling_with_greedy_drafts_equals_target_only(models, k):
    """Greedy drafts are verified by the coupled test: a seeded sampled request emits exactly the
    tokens target-only decoding emits with that seed, through rejections, penalties and top-k /
    top-p, and through preemptions (which drop the pending drafts)."""
    ref = _tokens(_llm(models).generate(PROMPTS, SAMPLED, use_tqdm=False))
    llm = _llm(models, "near", k)
    assert _tokens(llm.generate(PROMPTS, SAMPLED, use_tqdm=False)) == ref
    m = llm.engine.spec_metrics
    assert 0.05 < m.acceptance_rate < 0.98  # drafts accepted and rejected
    target_arch, draft_arch = read_arch_config(models["target"]), read_arch_config(models["near"])
    per_block = KVCache.bytes_per_block(target_arch, 8, torch.float32) + KVCache.bytes_per_block(
        draft_arch, 8, torch.float32)
    tight = _llm(models, "near", k, max_model_len=176, kv_cache_memory_bytes=per_block * 24)
    assert _tokens(tight.generate(PROMPTS, SAMPLED, use_tqdm=False)) == ref
    assert tight.engine.scheduler.num_preemptions > 0


def test_priority_scheduling_keeps_outputs(models, baseline, monkeypatch):
    """Requests of a higher priority arrive while lower ones run, in a pool too small for all:
    they preempt them (for slots and for blocks), and every output is still the target's greedy one."""
    from tandem.scheduler.scheduler import Scheduler

    target_arch = read_arch_config(models["target"])
    draft_arch = read_arch_config(models["near"])
    per_block = KVCache.bytes_per_block(target_arch, 8, torch.float32) + KVCache.bytes_per_block(
        draft_arch, 8, torch.float32
    )
    llm = _llm(models, "near", 4, max_model_len=176, kv_cache_memory_bytes=per_block * 24, max_num_seqs=3,
               scheduling_policy="priority")
    for_waiting = []
    preempt_for = Scheduler._preempt_for
    monkeypatch.setattr(Scheduler, "_preempt_for",
                        lambda self, req, step: for_waiting.append(preempt_for(self, req, step)) or for_waiting[-1])
    engine = llm.engine
    for i in range(3):  # the first three, at a low priority
        engine.add_request(str(i), PROMPTS[i]["prompt_token_ids"], PARAMS, priority=5)
    for _ in range(3):
        engine.step()
    for i in range(3, len(PROMPTS)):  # the rest, each more urgent than the one before
        engine.add_request(str(i), PROMPTS[i]["prompt_token_ids"], PARAMS, priority=5 - i)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [outs[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == baseline
    assert any(for_waiting) and engine.scheduler.num_preemptions > 0
    assert engine.scheduler.blocks.num_free_blocks == engine.cfg.cache.num_blocks


def test_prefix_cache_hits(models):
    shared = _prompts([40])[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + tail["prompt_token_ids"]} for tail in _prompts([3, 9, 17], seed=5)]
    ref = _tokens(_llm(models, enable_prefix_caching=False).generate(prompts, PARAMS, use_tqdm=False))
    llm = _llm(models, "near", 4)
    first = llm.generate(prompts[:1], PARAMS, use_tqdm=False)
    rest = llm.generate(prompts[1:], PARAMS, use_tqdm=False)
    assert _tokens(first + rest) == ref
    assert all(o.metrics.num_cached_tokens >= 40 - 8 for o in rest)


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_a_final_steps_blocks_are_cached_with_valid_draft_kv(models, method):
    """The blocks a request fills in its last step (a verification of up to 1 + k tokens) enter the
    prefix cache too, so a follow-up turn (prompt + output + more) hits every block whose KV was
    computed, whatever k; the target's and the draft's KV in them are both right: the follow-up's
    tokens and acceptance equal a run without the cache."""
    prompt = _prompts([10], seed=2)[0]["prompt_token_ids"]
    llm = _llm(models, "near", 4, method=method)
    uncached = _llm(models, "near", 4, method=method, enable_prefix_caching=False)
    for max_tokens in (15, 25, 26):
        llm.engine.scheduler.blocks.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        follow = [{"prompt_token_ids": prompt + out + [7, 8, 9]}]
        hit = llm.generate(follow, PARAMS, use_tqdm=False)[0]
        assert hit.metrics.num_cached_tokens == (len(prompt) + max_tokens - 1) // 8 * 8
        fresh = uncached.generate(follow, PARAMS, use_tqdm=False)[0]
        assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
        assert hit.metrics.num_accepted_tokens == fresh.metrics.num_accepted_tokens


def test_allowed_token_ids_with_speculation(models, baseline):
    """Rows limited to allowed_token_ids, batched with rows that are not: the limited rows emit only
    those ids, speculative output equals target-only, and the other rows are untouched."""
    allowed = list(range(2, 320, 3))
    limited = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, allowed_token_ids=allowed)
    params = [limited if i % 2 else PARAMS for i in range(len(PROMPTS))]
    base = _tokens(_llm(models).generate(PROMPTS, params, use_tqdm=False))
    spec = _tokens(_llm(models, "near", 4).generate(PROMPTS, params, use_tqdm=False))
    assert spec == base
    for i, toks in enumerate(base):
        if i % 2:
            assert set(toks) <= set(allowed) and toks != baseline[i]
        else:
            assert toks == baseline[i]


def test_bad_words_with_speculation(models, baseline):
    """Bad words of one to three tokens, taken from the target-only output so they bite, banned
    with the earlier drafts of a verification counted as output: speculative output equals
    target-only, and no banned sequence appears."""
    base = baseline[2]
    words = [[base[5]], base[10:12], base[20:23]]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, bad_words_token_ids=words)
    want = _tokens(_llm(models).generate(PROMPTS, p, use_tqdm=False))
    for llm in (_llm(models, "near", 4), _llm(models, "target", 3)):
        assert _tokens(llm.generate(PROMPTS, p, use_tqdm=False)) == want
    assert want[2] != base
    for toks in want:
        for w in words:
            assert not any(toks[i : i + len(w)] == w for i in range(len(toks))), (w, toks)
    # One two-token word, so the output follows the baseline up to it: its first token is a draft the
    # same verification accepts, which the row after it must see (drafts 10 and 11 share a round at k = 3, 4).
    p = p.clone(bad_words_token_ids=[base[10:12]])
    want = _tokens(_llm(models).generate(PROMPTS, p, use_tqdm=False))
    assert want[2][:11] == base[:11] and want[2][11] != base[11]
    for llm in (_llm(models, "target", 3), _llm(models, "target", 4), _llm(models, "near", 4)):
        assert _tokens(llm.generate(PROMPTS, p, use_tqdm=False)) == want


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_drafts_follow_the_requests_logits_processors(models, method, monkeypatch):
    """A request's logit bias, allowed ids and bad words shape its drafts as they shape its tokens:
    the output stays the target's, a bias that forces one token (greedy, or sampled at temperature
    1) has every draft accepted (none when the draft ignored it), the other two take more drafts
    than a draft that ignores them, and a penalised request (penalties stay the target's) and a
    plain one beside them draft as before."""
    bias = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias={50: 100.0})
    params = [bias, bias.clone(temperature=1.0, seed=3),
              PARAMS.clone(allowed_token_ids=list(range(2, 320, 7))),
              PARAMS.clone(bad_words_token_ids=[[t] for t in range(100, 200)]),
              PARAMS.clone(repetition_penalty=2.0), PARAMS]
    want = _tokens(_llm(models).generate(PROMPTS, params, use_tqdm=False))

    def run():
        outs = _llm(models, "near", 4, method).generate(PROMPTS, params, use_tqdm=False)
        assert _tokens(outs) == want
        return [(o.metrics.num_accepted_tokens, o.metrics.num_draft_tokens) for o in outs]

    shaped = run()
    monkeypatch.setattr(DraftSpeculator, "_processes", lambda self, sampling: False)
    free = run()
    assert [a / d for a, d in shaped[:2]] == [1.0, 1.0] and [a for a, _ in free[:2]] == [0, 0]
    assert sum(a for a, _ in shaped[2:4]) / sum(d for _, d in shaped[2:4]) > \
        sum(a for a, _ in free[2:4]) / sum(d for _, d in free[2:4]) + 0.05
    assert shaped[4:] == free[4:]


def test_max_tokens_and_stops_inside_accepted_runs(models):
    """With the target as its own draft every draft is accepted, so limits land mid-run."""
    prompts = PROMPTS[:3]
    base_llm = _llm(models)
    spec_llm = _llm(models, "target", 4)
    for max_tokens in (1, 2, 3, 6, 7, 11):
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        base = _tokens(base_llm.generate(prompts, p, use_tqdm=False))
        spec = spec_llm.generate(prompts, p, use_tqdm=False)
        assert _tokens(spec) == base
        assert all(len(t) == max_tokens and o.outputs[0].finish_reason == "length"
                   for t, o in zip(base, spec))
    long = _tokens(base_llm.generate(prompts, PARAMS, use_tqdm=False))
    # A stop token id that appears mid-run.
    for toks, prompt in zip(long, prompts):
        stop_id = toks[9]
        p = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id])
        a = base_llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        b = spec_llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "stop"
        assert b.token_ids[-1] == stop_id and b.stop_reason == stop_id and len(b.token_ids) <= 10
    # A stop string made of the text of tokens in the middle of the output.
    tok = base_llm.get_tokenizer()
    for toks, prompt in zip(long, prompts):
        text = base_llm.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].text
        stop = next((s for s in (tok.decode(toks[i : i + 2]) for i in range(6, 30)) if s.strip() and s in text), None)
        if stop is None:
            continue
        p = SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)
        a = base_llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        b = spec_llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, "stop")
        assert stop not in b.text and b.stop_reason == stop


def test_near_max_model_len(models):
    """A request close to max_model_len gets fewer drafts and never runs past the limit."""
    prompt = _prompts([58])
    p = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    base = _llm(models, max_model_len=64).generate(prompt, p, use_tqdm=False)[0].outputs[0]
    spec = _llm(models, "target", 4, max_model_len=64).generate(prompt, p, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == base.token_ids and len(spec.token_ids) == 6
    assert spec.finish_reason == "length"


def test_greedy_and_sampled_requests_mix(models, baseline):
    """Sampled requests in the batch do not change greedy ones."""
    llm = _llm(models, "near", 4, method="probabilistic")
    sampled = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=3)
    params = [PARAMS if i % 2 == 0 else sampled for i in range(len(PROMPTS))]
    outs = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert [t for i, t in enumerate(outs) if i % 2 == 0] == [t for i, t in enumerate(baseline) if i % 2 == 0]


# ---------------------------------------------------------------- dynamic speculation
# Outputs of different lengths, so the batch shrinks from 6 requests to 1 and the number of drafts
# steps through every range: 2, then none, then 1, then 4.
VARIED = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (10, 20, 30, 45, 60, 80)]
SCHEDULE = [[1, 1, 4], [2, 2, 1], [3, 4, 0], [5, 6, 2]]


@pytest.fixture(scope="module")
def varied_baseline(models):
    return _tokens(_llm(models).generate(PROMPTS, VARIED, use_tqdm=False))


def _dynamic(models, draft, method="greedy", **kw):
    return _llm(models, draft, 4, method, spec_extra=dict(num_speculative_tokens_per_batch_size=SCHEDULE), **kw)


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_dynamic_speculation_matches_target(models, varied_baseline, method):
    llm = _dynamic(models, "near", method, per_request_spec_decode_metrics="detailed")
    outs = llm.generate(PROMPTS, VARIED, use_tqdm=False)
    assert _tokens(outs) == varied_baseline
    assert 0.05 < llm.engine.spec_metrics.acceptance_rate < 0.98
    # The requests that outlive the others drafted 4 at a time at the end.
    counts = {len(o.metrics.accepted_per_position) for o in outs}
    assert max(counts) == 4 and all(o.metrics.num_draft_tokens > 0 for o in outs)
    # Each request's rounds, in order, agree with its counts and its histograms by number of drafts.
    for m in (o.metrics for o in outs):
        pairs = list(zip(m.per_step_drafted, m.per_step_accepted))
        assert len(pairs) == m.num_draft_rounds and sum(m.per_step_drafted) == m.num_draft_tokens
        assert sum(m.per_step_accepted) == m.num_accepted_tokens
        table = {n: [sum(1 for p in pairs if p == (n, j)) for j in range(n + 1)] for n in sorted({n for n, _ in pairs})}
        assert m.acceptance_by_num_drafts == table
        assert m.acceptance_histogram == [sum(a == j for _, a in pairs) for j in range(5)]
    assert max(len(o.metrics.acceptance_by_num_drafts) for o in outs) > 1  # the batch shrank: fewer drafts


@pytest.mark.parametrize("budget", [None, 16])
def test_the_draft_catches_up_on_the_tokens_it_skipped(models, varied_baseline, budget, monkeypatch):
    """The target as its own draft accepts every draft only if the draft's KV is whole: the steps
    that skipped the draft are fed to it before it drafts again (with a budget of 16 tokens, over
    several steps). Without that feed, the same run accepts far less."""
    kw = {} if budget is None else dict(max_num_batched_tokens=budget)
    llm = _dynamic(models, "target", **kw)
    assert _tokens(llm.generate(PROMPTS, VARIED, use_tqdm=False)) == varied_baseline
    assert llm.engine.spec_metrics.acceptance_rate == 1.0
    if budget is not None:
        return
    from tandem.scheduler.scheduler import Scheduler

    make_item = Scheduler._make_item

    def no_backfill(self, *args):
        item = make_item(self, *args)
        if not item.draft_skip:
            item.draft_backfill = []
        return item

    monkeypatch.setattr(Scheduler, "_make_item", no_backfill)
    broken = _dynamic(models, "target")
    assert _tokens(broken.generate(PROMPTS, VARIED, use_tqdm=False)) == varied_baseline
    assert broken.engine.spec_metrics.acceptance_rate < 0.9


def test_drafting_off_skips_the_draft_in_decode_steps(models, baseline, monkeypatch):
    """num_drafts 0 at every batch size: the draft model runs over the prompts only."""
    llm = _llm(models, "near", 4, spec_extra=dict(num_speculative_tokens_per_batch_size=[[1, 64, 0]]))
    spec = llm.engine.runner.speculator
    fed = []
    forward = spec._forward
    monkeypatch.setattr(spec, "_forward", lambda ids, *a: fed.append(ids.shape[0]) or forward(ids, *a))
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == baseline
    assert llm.engine.spec_metrics.num_draft_rounds == 0
    assert sum(fed) == sum(len(p["prompt_token_ids"]) for p in PROMPTS)


# ---------------------------------------------------------------- adaptive speculation
# A GPU-like table: a step costs its weights' reads; drafts add little.
GPU_LIKE = StepCosts((1, 8), ((4.0, 4.6, 5.0, 5.4, 5.8), (4.2, 4.9, 5.4, 5.9, 6.4)))
# A costly first draft: drafting pays under the optimistic prior, not at "near"'s acceptance.
COSTLY_DRAFT = StepCosts((1, 8), ((4.0, 6.4, 6.8, 7.2, 7.6), (4.2, 6.7, 7.1, 7.5, 7.9)))


def _auto(models, draft, method="greedy", **kw):
    return _llm(models, draft, 4, method, spec_extra=dict(num_speculative_tokens_per_batch_size="auto"), max_num_seqs=8,
                **kw)


@pytest.mark.parametrize("method,async_scheduling", [("greedy", False), ("probabilistic", False), ("greedy", True)])
def test_adaptive_speculation_matches_target(models, varied_baseline, method, async_scheduling, monkeypatch):
    """"auto" times every batch size and number of drafts at start-up, then chooses each step's
    (steps without drafts planned ahead under async scheduling)."""
    # a loaded machine can stretch a tiny model's step past the eager cut-off, which would time fewer sizes
    monkeypatch.setattr(step_costs, "EAGER_MAX_STEP_MS", float("inf"))
    llm = _auto(models, "near", method, async_scheduling=async_scheduling)
    costs = llm.engine.adaptive.costs
    assert costs.sizes == (1, 2, 4, 8) and all(0 < t < float("inf") for row in costs.ms for t in row)
    # "near" is as large as the target: on a CPU one draft roughly doubles a step, so whether the
    # measured table ever drafts depends on the machine. The choice is made on a fixed table that
    # drafts first, then stops (steps of both kinds, planned ahead or not).
    llm.engine.adaptive.costs = COSTLY_DRAFT
    assert _tokens(llm.generate(PROMPTS, VARIED, use_tqdm=False)) == varied_baseline
    by_k = llm.engine.adaptive.num_steps_by_k
    assert llm.engine.spec_metrics.num_draft_rounds > 0 and by_k[0] > 0 and by_k[4] > 0, by_k


def test_adaptive_speculation_follows_the_draft(models, varied_baseline, monkeypatch):
    """The target as its own draft keeps every draft (and its KV whole across the switches); an
    unrelated draft is switched off after the first rounds, probing now and then."""
    monkeypatch.setattr(step_costs, "profile_step_costs", lambda runner, cfg: GPU_LIKE)
    good = _auto(models, "target")
    assert _tokens(good.generate(PROMPTS, VARIED, use_tqdm=False)) == varied_baseline
    assert good.engine.spec_metrics.acceptance_rate == 1.0
    by_k = good.engine.adaptive.num_steps_by_k
    assert by_k[4] == sum(by_k)
    bad = _auto(models, "other")
    assert _tokens(bad.generate(PROMPTS, VARIED, use_tqdm=False)) == varied_baseline
    by_k = bad.engine.adaptive.num_steps_by_k
    assert bad.engine.spec_metrics.acceptance_rate < 0.1
    assert by_k[0] >= 0.8 * sum(by_k) and by_k[1] > 0  # off, with probes of one draft


def test_the_step_profile_keeps_to_the_budget_and_the_time_cap(models, baseline, monkeypatch):
    """No profiled step exceeds max_num_batched_tokens (inf: the scheduler could not give every
    request K drafts), and the eager profile stops at the first size whose steps took over
    EAGER_MAX_STEP_MS."""
    small = _auto(models, "near", max_num_batched_tokens=6)
    costs = small.engine.adaptive.costs
    assert costs.sizes == (1, 2, 4)
    inf = float("inf")
    assert [[t == inf for t in row] for row in costs.ms] == [[False] * 5, [False] * 3 + [True] * 2,
                                                              [False] + [True] * 4]
    monkeypatch.setattr(step_costs, "EAGER_MAX_STEP_MS", 0.0)
    capped = _auto(models, "near")
    assert capped.engine.adaptive.costs.sizes == (1,)
    assert _tokens(capped.generate(PROMPTS, PARAMS, use_tqdm=False)) == baseline
