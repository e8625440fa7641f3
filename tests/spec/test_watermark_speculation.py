"""Watermarked sampling survives speculation: the output equals target-only watermarked output,
token for token, and carries the key's watermark."""
import logging

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.detect import detect_watermark
from tandem.errors import ConfigError
from tandem.spec import step_costs
from tests.helpers import make_hf_model, make_spec_models

MAX_LEN = 256
KEY = {"key": 20261201}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_spec_models(tmp_path_factory.mktemp("wm"))


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist()} for n in lengths]


PROMPTS = _prompts([4, 19, 64, 7, 33, 120])
# Sampled requests of every kind: plain, truncated, opted out, greedy (which a watermark leaves alone).
PARAMS = [
    SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=40, ignore_eos=True, seed=2),
    SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=4, watermarking=False),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.2, min_p=0.02, repetition_penalty=1.1, max_tokens=40, ignore_eos=True, seed=6),
]
KEYED = [0, 1, 2, 5]  # the requests drawn with the key
COMPARABLE = KEYED + [4]  # those a draft cannot change (the opted-out one follows the residual draws)


def _llm(models, draft=None, k=4, method="greedy", watermark=KEY, spec_extra=None, **kw):
    spec = None
    if draft is not None:
        spec = dict(model=str(models[draft]), num_speculative_tokens=k, draft_sample_method=method, **(spec_extra or {}))
    kw.setdefault("max_model_len", MAX_LEN)
    return LLM(str(models["target"]), dtype="float32", block_size=8, watermark_config=watermark,
               speculative_config=spec, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(models):
    return _tokens(_llm(models).generate(PROMPTS, PARAMS, use_tqdm=False))


def test_target_only_watermark_is_keyed_not_seeded(models, baseline):
    """The keyed draw depends on the prefix and the key only: other seeds give the same tokens,
    another key or no watermark other tokens; the opted-out and greedy requests are unchanged."""
    reseeded = [p.clone(seed=(p.seed or 0) + 100) for p in PARAMS]
    again = _tokens(_llm(models).generate(PROMPTS, reseeded, use_tqdm=False))
    assert [again[i] for i in KEYED] == [baseline[i] for i in KEYED]
    plain = _tokens(_llm(models, watermark=None).generate(PROMPTS, PARAMS, use_tqdm=False))
    other_key = _tokens(_llm(models, watermark={"key": 7}).generate(PROMPTS, PARAMS, use_tqdm=False))
    for i in KEYED:
        assert plain[i] != baseline[i] and other_key[i] != baseline[i]
    assert plain[3] == baseline[3] and plain[4] == baseline[4]


def test_generated_text_carries_the_watermark(models, baseline):
    """The detector finds the key in every keyed output (40 tokens of a high-entropy model), and
    not in the outputs drawn without it."""
    plain = _tokens(_llm(models, watermark=None).generate(PROMPTS, PARAMS, use_tqdm=False))
    for i in KEYED:
        prompt = PROMPTS[i]["prompt_token_ids"]
        found = detect_watermark(baseline[i], KEY, prompt_token_ids=prompt)
        assert found.watermarked and found.p_value < 1e-6, (i, found)
        assert not detect_watermark(plain[i], KEY, prompt_token_ids=prompt).watermarked
    assert not detect_watermark(baseline[3], KEY, prompt_token_ids=PROMPTS[3]["prompt_token_ids"]).watermarked


@pytest.mark.parametrize("draft,k,method", [
    ("near", 4, "greedy"), ("near", 4, "probabilistic"), ("near", 1, "greedy"), ("other", 2, "probabilistic"),
    ("target", 3, "greedy"),
])
def test_speculative_watermarked_output_equals_target_only(models, baseline, draft, k, method):
    llm = _llm(models, draft, k, method)
    out = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert [out[i] for i in COMPARABLE] == [baseline[i] for i in COMPARABLE]
    m = llm.engine.spec_metrics
    assert m.num_draft_rounds > 0
    if draft == "target":  # the draft's keyed draw on the same distribution is the target's
        alone = _llm(models, draft, k, method)
        same = [0, 1, 2]  # temperature, top-k, top-p: what a draft applies too (not min_p or penalties)
        keyed = alone.generate([PROMPTS[i] for i in same], [PARAMS[i] for i in same], use_tqdm=False)
        assert alone.engine.spec_metrics.acceptance_rate == 1.0
        assert _tokens(keyed) == [baseline[i] for i in same]
    elif draft == "near":
        assert 0.05 < m.acceptance_rate < 0.98  # both the match and the mismatch branch


def test_block_verification_keeps_the_watermarked_output(models, baseline):
    """Watermarked requests verify by exact match whatever rejection_sample_method says; the
    others of the batch (the opted-out one) run the block test beside them."""
    llm = _llm(models, "near", 4, "probabilistic", spec_extra={"rejection_sample_method": "block"})
    out = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert [out[i] for i in COMPARABLE] == [baseline[i] for i in COMPARABLE]
    assert 0.05 < llm.engine.spec_metrics.acceptance_rate < 0.98


def test_adaptive_and_async_watermarked_speculation(models, baseline, monkeypatch):
    """Under "auto" (steps without drafts planned ahead by async scheduling), the windows follow
    every kind of step."""
    llm = _llm(models, "near", 4, spec_extra=dict(num_speculative_tokens_per_batch_size="auto"), max_num_seqs=8,
               async_scheduling=True)
    out = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert [out[i] for i in COMPARABLE] == [baseline[i] for i in COMPARABLE]
    alone = _tokens(_llm(models, async_scheduling=True).generate(PROMPTS, PARAMS, use_tqdm=False))
    assert [alone[i] for i in COMPARABLE] == [baseline[i] for i in COMPARABLE]


@pytest.mark.parametrize("draft", [None, "near"])
def test_preemption_keeps_the_watermarked_output(models, draft):
    """A preempted request recomputes its prefix and rebuilds its window from it."""
    prompt = [5, 9, 3]
    params = SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True)
    alone = _tokens(_llm(models, draft, max_model_len=64).generate([{"prompt_token_ids": prompt}], params,
                                                                    use_tqdm=False))[0]
    g = torch.Generator().manual_seed(0)
    others = [{"prompt_token_ids": torch.randint(2, 320, (20,), generator=g).tolist()} for _ in range(4)]
    plist = [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True) for _ in range(4)] + [params]
    out = _llm(models, draft, max_model_len=64, num_gpu_blocks_override=14).generate(
        others + [{"prompt_token_ids": prompt}], plist, use_tqdm=False)[-1]
    assert out.metrics.num_preemptions > 0
    assert out.outputs[0].token_ids == alone


def test_bad_combinations_and_requests(models, caplog):
    with pytest.raises(ConfigError, match="synthetic"):
        _llm(models, "near", 2, spec_extra=dict(rejection_sample_method="synthetic", synthetic_acceptance_length=2.0))
    with pytest.raises(ConfigError, match="watermark_config.context_width"):
        _llm(models, watermark={"key": 1, "context_width": 0})
    plain = _llm(models, watermark=None)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        for _ in range(2):
            plain.generate(PROMPTS[:1], SamplingParams(max_tokens=4, watermarking=True), use_tqdm=False)
    assert sum("watermark_config" in r.message for r in caplog.records) == 1  # once per engine
    caplog.clear()
    keyed = _llm(models)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        for _ in range(2):
            keyed.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        keyed.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, watermarking=False), use_tqdm=False)
    assert sum("greedy decoding" in r.message for r in caplog.records) == 1


def test_step_profile_with_a_watermark(models, baseline, monkeypatch):
    """The start-up profile of "auto" runs its dummy requests through a watermarking engine."""
    calls = []
    real = step_costs.profile_step_costs
    monkeypatch.setattr(step_costs, "profile_step_costs", lambda runner, cfg: calls.append(1) or real(runner, cfg))
    llm = _llm(models, "target", 2, spec_extra=dict(num_speculative_tokens_per_batch_size="auto"), max_num_seqs=4)
    assert calls
    out = _tokens(llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False))
    assert out == baseline[:2]


# A six-token vocabulary and a two-token context: contexts repeat within a few steps, so most
# draws fall back to the seeded one (deduplicate_contexts), and a 64-entry history wraps around.
NARROW = dict(KEY, context_width=2, deduplicate_contexts_max_history=64)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("wm-small")
    shape = dict(vocab_size=6, num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, init_std=0.5, tokenizer=False)
    return {"target": make_hf_model(root / "target", "qwen2", **shape),
            "other": make_hf_model(root / "other", "qwen2", seed=5, **shape)}


def _small(small, draft=None, k=4, method="greedy", watermark=NARROW, **kw):
    return _llm(small, draft, k, method, watermark, **kw)


SMALL_PROMPTS = [{"prompt_token_ids": p} for p in ([1, 2, 3], [4, 0, 5, 5, 1], [2])]


def _few(seed=None, n=150):
    return SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=seed)


@pytest.mark.parametrize("scope", ["single_turn", "all", "none"])
def test_repeated_contexts_fall_back_to_the_seeded_draw(small, scope):
    """With deduplication a repeated context draws with the request's seed (other seeds, other
    tokens); without it the keyed draw repeats (the seed does not matter). Either way speculation
    (the draft mirroring the history, rows checked against the drafts before them) changes nothing."""
    wm = dict(NARROW, deduplicate_contexts=scope)
    alone = _small(small, watermark=wm)
    base = _tokens(alone.generate(SMALL_PROMPTS, [_few(seed=s) for s in (1, 2, 3)], use_tqdm=False))
    reseeded = _tokens(alone.generate(SMALL_PROMPTS, [_few(seed=s + 10) for s in (1, 2, 3)], use_tqdm=False))
    if scope == "none":
        assert reseeded == base
    else:
        assert all(a != b for a, b in zip(reseeded, base))
    for draft, method in (("other", "greedy"), ("target", "probabilistic")):
        spec = _small(small, draft, 4, method, watermark=wm)
        assert _tokens(spec.generate(SMALL_PROMPTS, [_few(seed=s) for s in (1, 2, 3)], use_tqdm=False)) == base
        m = spec.engine.spec_metrics
        if draft == "target":  # the draft mirrors the fallback too
            assert m.acceptance_rate == 1.0
        else:
            assert 0.05 < m.acceptance_rate < 0.95


def test_preemption_rebuilds_the_history(small):
    """A preempted request's history of drawn-after contexts is rebuilt from its tokens."""
    params = _few(seed=7, n=40)
    alone = _tokens(_small(small, "other", max_model_len=64).generate(SMALL_PROMPTS[:1], params, use_tqdm=False))[0]
    g = torch.Generator().manual_seed(0)
    others = [{"prompt_token_ids": torch.randint(0, 6, (20,), generator=g).tolist()} for _ in range(4)]
    plist = [_few(n=40) for _ in range(4)] + [params]
    out = _small(small, "other", max_model_len=64, num_gpu_blocks_override=14).generate(
        others + SMALL_PROMPTS[:1], plist, use_tqdm=False)[-1]
    assert out.metrics.num_preemptions > 0
    assert out.outputs[0].token_ids == alone


def test_detector_scores_exactly_the_keyed_draws(small):
    """The detector replays the engine's deduplication: with the engine's settings it scores the
    draws made with the key (a context's first occurrence within the last 64), whose u is the
    largest of the vocabulary's more often than chance."""
    from tandem.sampling.watermark import keyed_uniform

    prompt = SMALL_PROMPTS[1]["prompt_token_ids"]
    out = _tokens(_small(small).generate(SMALL_PROMPTS[1:2], _few(seed=1, n=400), use_tqdm=False))[0]
    found = detect_watermark(out, NARROW, prompt_token_ids=prompt)
    seq = prompt + out
    keyed, last = [], {}
    for e, i in enumerate(range(len(prompt), len(seq))):  # e: the entry of output token i in the history
        c = tuple(seq[i - 2 : i])
        if c not in last or last[c] < e - 64:
            keyed.append(i)
        last[c] = e
    assert found.num_tokens == len(keyed) >= 30  # of 36 possible contexts
    ctx = torch.tensor([seq[i - 2 : i] for i in keyed])
    u = torch.stack([keyed_uniform(NARROW["key"], ctx, torch.full((len(keyed),), t)) for t in range(6)], dim=1)
    chosen = torch.tensor([seq[i] for i in keyed])
    assert (u.argmax(dim=1) == chosen).float().mean() > 0.4  # chance: 1/6
