"""Speculative decoding is lossless end to end: through LLM(..., speculative_config=...), the
joint distribution of the first generated tokens equals the target's own distribution.

The target's exact joint distribution of the first 4 tokens after a fixed prompt is computed
with transformers on the same weights (every prefix, processed as the sampler does: logit
bias, penalties, temperature, min-p, top-k, top-p). Thousands of requests with distinct fixed
seeds are sampled in one generate() call per engine, and chi-square tests (bins with expected
< 5 pooled, p > 1e-3) compare the sample against it: the full 4-token joint, each position's
marginal and adjacent pairs. With k = 2 and max_tokens = 4 the first token comes from the
prefill step and tokens 2-4 from one verification round (two drafts and the bonus row), plus
later rounds after rejections. Negative controls show the tests have power: accepting every
draft (sampling from q) and verifying with the draft's temperature left out are both rejected.
Seeded outputs are also reproducible across runs and batch compositions with speculation on.
"""
from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tandem.spec.base as speculator_base
from tandem import LLM, SamplingParams
from tests.stats import ALPHA, chisq_counts_pvalue
from tests.helpers import hf_model, make_hf_model

V = 32
PROMPT = [5, 9, 3]
DEPTH = 4  # tokens whose joint distribution is tested


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


# ----------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """target: 2-layer llama; near: the target's first layer alone (~50% acceptance);
    small: an unrelated 1-layer qwen2 with hidden size 32 (low acceptance, many residual draws)."""
    root = tmp_path_factory.mktemp("dist")
    target = make_hf_model(root / "target", "llama", vocab_size=V, tokenizer=False, init_std=0.5, seed=1)
    weights = load_file(str(target / "model.safetensors"))
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        weights[name] = weights[name] * 0.5  # a weaker last layer: the truncated draft stays close
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    near = root / "near"
    near.mkdir()
    save_file({n: w for n, w in weights.items() if not n.startswith("model.layers.1.")},
              str(near / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (near / "config.json").write_text(json.dumps(config))
    small = make_hf_model(root / "small", "qwen2", vocab_size=V, hidden_size=32, num_layers=1, num_heads=2,
                          num_kv_heads=1, intermediate_size=64, tokenizer=False, init_std=0.2, seed=2)
    # A tokenizer of V - 4 tokens for the target, and the near draft cut to those rows: the
    # target's last 4 ids are padding rows the draft lacks (Qwen2.5's 7B against its 0.5B).
    target_tok, near_cut = root / "target_tok", root / "near_cut"
    shutil.copytree(target, target_tok)
    shutil.copytree(near, near_cut)
    for d in (target_tok, near_cut):
        _word_tokenizer(V - 4).save_pretrained(str(d))
    cut = {n: (w[: V - 4] if n in ("model.embed_tokens.weight", "lm_head.weight") else w)
           for n, w in load_file(str(near / "model.safetensors")).items()}
    save_file(cut, str(near_cut / "model.safetensors"), metadata={"format": "pt"})
    config["vocab_size"] = V - 4
    (near_cut / "config.json").write_text(json.dumps(config))
    # A pair that ignores its context (every embedding row the same): each token is an independent
    # draw, and a draft is the same token whatever came before it.
    free, free_draft = root / "free", root / "free_draft"
    shutil.copytree(target, free)
    shutil.copytree(near, free_draft)
    for d in (free, free_draft):
        w = load_file(str(d / "model.safetensors"))
        w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"][:1].expand(V, -1).contiguous()
        if d == free_draft:  # further from the target: overlap 0.72
            g = torch.Generator().manual_seed(7)
            w["lm_head.weight"] = w["lm_head.weight"] + 0.3 * torch.randn(w["lm_head.weight"].shape, generator=g)
        save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return {"target": target, "near": near, "small": small, "target_tok": target_tok, "near_cut": near_cut,
            "free": free, "free_draft": free_draft}


def _word_tokenizer(n: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@functools.cache
def _all_prefix_logits(path: str) -> list[torch.Tensor]:
    """transformers logits after PROMPT + every continuation of length d < DEPTH:
    -> [L_0 [V], L_1 [V, V], ..., L_{DEPTH-1} [V]*DEPTH], float64."""
    model = hf_model(path)
    d = DEPTH - 1
    conts = torch.cartesian_prod(*[torch.arange(V)] * d)  # [V^d, d]
    ids = torch.cat([torch.tensor(PROMPT).expand(conts.shape[0], -1), conts], 1)
    out = []
    with torch.no_grad():
        for chunk in ids.split(4096):
            out.append(model(chunk).logits[:, len(PROMPT) - 1 :].double())
    logits = torch.cat(out)  # [V^d, d + 1, V]
    full = logits.view(*[V] * d, d + 1, V)
    res = []
    for depth in range(DEPTH):
        index = (slice(None),) * depth + (0,) * (d - depth) + (depth,)
        res.append(full[index].clone())
    return res


def _process(logits: torch.Tensor, outputs: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Reference processing, float64, rows [n, V] with their output tokens so far [n, d] -> probs."""
    x = logits.clone()
    if cfg.get("allowed_token_ids") is not None:
        banned = torch.ones(V, dtype=torch.bool)
        banned[cfg["allowed_token_ids"]] = False
        x[:, banned] = float("-inf")
    for word in cfg.get("bad_words_token_ids") or []:  # banned after the rest of the word ends the output
        n = len(word) - 1
        if n <= outputs.shape[1]:
            hit = (outputs[:, outputs.shape[1] - n :] == torch.tensor(word[:-1])).all(1)
            x[hit, word[-1]] = float("-inf")
    for t, b in (cfg.get("logit_bias") or {}).items():
        x[:, t] += b
    rep, freq, pres = cfg.get("repetition_penalty", 1.0), cfg.get("frequency_penalty", 0.0), cfg.get("presence_penalty", 0.0)
    if (rep, freq, pres) != (1.0, 0.0, 0.0):
        counts = torch.nn.functional.one_hot(outputs, V).sum(1).double() if outputs.shape[1] else torch.zeros_like(x)
        seen = counts > 0
        seen[:, PROMPT] = True
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).double()
    x = x / cfg["temperature"]
    if cfg.get("min_p", 0.0) > 0:
        pr = x.softmax(-1)
        x = x.masked_fill(pr < cfg["min_p"] * pr.max(-1, keepdim=True).values, float("-inf"))
    k, p = cfg.get("top_k", 0), cfg.get("top_p", 1.0)
    srt = x.sort(-1, descending=True).values
    if 0 < k < V:
        x = x.masked_fill(x < srt[:, k - 1 : k], float("-inf"))
        srt = srt.masked_fill(srt < srt[:, k - 1 : k], float("-inf"))
    if p < 1:
        probs = srt.softmax(-1)
        above = probs.cumsum(-1) - probs
        n_keep = (above < p).sum(-1, keepdim=True)
        x = x.masked_fill(x < srt.gather(1, n_keep - 1), float("-inf"))
    return x.softmax(-1)


def exact_joint(path, cfg: dict) -> np.ndarray:
    """P(t1..t_DEPTH | PROMPT) [V]*DEPTH for a config dict (SamplingParams fields)."""
    logits = _all_prefix_logits(str(path))
    joint = torch.ones(())
    for d in range(DEPTH):
        outputs = torch.cartesian_prod(*[torch.arange(V)] * d).view(-1, d) if d else torch.zeros(1, 0, dtype=torch.int64)
        probs = _process(logits[d].reshape(-1, V), outputs, cfg).view(*[V] * (d + 1))
        joint = joint[..., None] * probs
    return joint.numpy()


# ----------------------------------------------------------------------------- statistics
def fit_pvalues(tokens: np.ndarray, joint: np.ndarray) -> dict[str, float]:
    """tokens [n, DEPTH] against the exact joint: full joint, marginals, adjacent pairs."""
    n = tokens.shape[0]
    flat = np.ravel_multi_index(tuple(tokens.T), joint.shape)
    counts = np.bincount(flat, minlength=joint.size).reshape(joint.shape)
    impossible = counts[joint == 0].sum()
    assert impossible == 0, f"{impossible} samples have zero target probability"
    out = {"joint": chisq_counts_pvalue(counts, joint)}
    axes = tuple(range(DEPTH))
    for i in range(DEPTH):
        other = tuple(a for a in axes if a != i)
        out[f"t{i + 1}"] = chisq_counts_pvalue(counts.sum(other), joint.sum(other))
    for i in range(1, DEPTH - 1):
        other = tuple(a for a in axes if a not in (i, i + 1))
        out[f"t{i + 1}t{i + 2}"] = chisq_counts_pvalue(counts.sum(other), joint.sum(other))
    assert n == counts.sum()
    return out


# ----------------------------------------------------------------------------- sampling
def _llm(models, draft=None, k=2, method="probabilistic", target="target", **spec_kw):
    spec = None
    if draft is not None:
        spec = dict(model=str(models[draft]), num_speculative_tokens=k, draft_sample_method=method, **spec_kw)
    return LLM(str(models[target]), dtype="float32", max_model_len=64, block_size=8, max_num_seqs=512,
               speculative_config=spec)


def sample_tokens(llm, configs: list[dict], n: int, seed_base: int, max_tokens: int = DEPTH) -> list[np.ndarray]:
    """n requests per config, all in one generate() call -> per config tokens [n, DEPTH]."""
    prompts, params = [], []
    for c, cfg in enumerate(configs):
        for s in range(n):
            prompts.append({"prompt_token_ids": PROMPT})
            params.append(SamplingParams(seed=seed_base + c * 1_000_003 + s, max_tokens=max_tokens,
                                         ignore_eos=True, **cfg))
    outs = llm.generate(prompts, params, use_tqdm=False)
    toks = np.array([o.outputs[0].token_ids[:DEPTH] for o in outs])
    assert toks.shape == (len(configs) * n, DEPTH)
    return [toks[c * n : (c + 1) * n] for c in range(len(configs))]


N = 2000
CONFIGS = [
    dict(temperature=0.5),
    dict(temperature=1.0),
    dict(temperature=1.5),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.2, top_p=0.8),
    dict(temperature=0.8, top_k=8, top_p=0.9),
]
EXTRA = [  # everything the sampler does at once: penalties see earlier drafts of the round
    dict(temperature=1.0, min_p=0.05, logit_bias={3: 1.5, 7: -1.0}, repetition_penalty=1.3,
         frequency_penalty=0.4, presence_penalty=0.3, allowed_token_ids=[t for t in range(V) if t % 4 != 1],
         bad_words_token_ids=[[2]] + [[a, (7 * a + 3) % V] for a in range(V)] + [[4, 6, 8]]),
]


def _check(models, tokens_per_cfg, configs, label):
    failures = []
    for tokens, cfg in zip(tokens_per_cfg, configs):
        joint = exact_joint(models["target"], cfg)
        first = joint.sum(axis=tuple(range(1, DEPTH)))
        assert 0.05 < first.max() < 0.95, "distributions should be neither flat nor one-hot"
        pv = fit_pvalues(tokens, joint)
        bad = {k: v for k, v in pv.items() if not v > ALPHA}
        if bad:
            failures.append((label, cfg, bad))
    assert not failures, failures


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_near_draft_matches_target_distribution(models, method):
    llm = _llm(models, "near", k=2, method=method)
    configs = CONFIGS + EXTRA
    tokens = sample_tokens(llm, configs, N, seed_base=10_000_000 * (method == "greedy"))
    m = llm.engine.spec_metrics
    rate = m.num_accepted_tokens / m.num_draft_tokens
    assert 0.1 < rate < 0.9, rate  # both accepted drafts and residual draws are common
    assert m.drafted_per_position[1] >= N * len(configs)  # every first round verifies two drafts
    assert m.accepted_per_position[1] > 0.05 * N * len(configs)  # ... and often reaches the bonus row
    _check(models, tokens, configs, f"near/{method}")


def test_small_draft_and_k3(models):
    """An unrelated draft of another architecture and size (mostly rejected drafts), and k = 3
    (tokens 2-4 are all drafted rows)."""
    configs = [dict(temperature=1.0), dict(temperature=0.7, top_k=6, top_p=0.95)]
    llm = _llm(models, "small", k=2, method="probabilistic")
    tokens = sample_tokens(llm, configs, N, seed_base=20_000_000)
    m = llm.engine.spec_metrics
    assert m.num_accepted_tokens / m.num_draft_tokens < 0.4
    _check(models, tokens, configs, "small/k2")
    for method in ("probabilistic", "greedy"):
        llm = _llm(models, "near", k=3, method=method)
        tokens = sample_tokens(llm, configs[:1], N, seed_base=30_000_000, max_tokens=5)
        assert llm.engine.spec_metrics.drafted_per_position[2] > 0.2 * N
        _check(models, tokens, configs[:1], f"near/k3/{method}")


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_a_draft_with_fewer_vocabulary_rows(models, method):
    """A draft lacking the target's last ids (padding rows past the tokenizer) leaves the target's
    distribution whole: those ids keep the target's probability (the draft gives them zero, and
    embeds them as its last row when the target emits one)."""
    llm = _llm(models, "near_cut", k=2, method=method, target="target_tok")
    assert llm.engine.vocab_size == V
    configs = [dict(temperature=1.0), dict(temperature=1.5, top_k=12)]
    tokens = sample_tokens(llm, configs, N, seed_base=50_000_000 + 1_000_000 * (method == "greedy"))
    assert any((t >= V - 4).any() for t in tokens)  # the target does emit the ids the draft lacks
    m = llm.engine.spec_metrics
    assert m.num_accepted_tokens > 0.1 * m.num_draft_tokens
    _check(models, tokens, configs, f"near_cut/{method}")


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_a_pruned_draft_head(models, method, tmp_path):
    """A draft whose head scores 18 of the 32 ids (draft_token_map; not a prefix): the ids it never
    drafts keep the target's probability (the residual draws give them), the drafts it does make
    are still accepted."""
    hot = list(range(0, V, 2)) + [3, 7]
    path = tmp_path / "map.json"
    path.write_text(json.dumps(hot))
    llm = _llm(models, "near", k=2, method=method, draft_token_map=str(path))
    assert llm.engine.runner.speculator.hot_ids.tolist() == sorted(set(hot) | {1})  # and the EOS id
    configs = [dict(temperature=1.0), dict(temperature=0.8, top_k=8, top_p=0.9)]
    tokens = sample_tokens(llm, configs, N, seed_base=70_000_000 + 1_000_000 * (method == "greedy"))
    cold = [t for t in range(V) if t not in set(hot) | {1}]
    assert all(np.isin(t[:, 1:], cold).mean() > 0.1 for t in tokens)  # drafted rows often give cold ids
    m = llm.engine.spec_metrics
    assert m.num_accepted_tokens > 0.1 * m.num_draft_tokens
    _check(models, tokens, configs, f"pruned/{method}")


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_block_verification_matches_target_distribution(models, method):
    """rejection_sample_method="block": the first 4 tokens (k = 2: two rounds or more, so a round
    starts where the last one's block ended, with fresh uniforms) follow the target's joint
    distribution, every sampling feature included. (The gain in acceptance: test_block_verification.py.)
    The engine verifies greedy drafts by the coupled test even under "block"; the block sampler's
    one-hot branch is put in its place here, so it stays checked."""
    import tandem.spec.rejection as rejection_mod

    configs = [dict(temperature=1.0), dict(temperature=0.8, top_k=8, top_p=0.9)] + EXTRA
    llm = _llm(models, "near", k=2, method=method, rejection_sample_method="block")
    if method == "greedy":
        llm.engine.runner.speculator.rejection_sample = rejection_mod.block_rejection_sample
    tokens = sample_tokens(llm, configs, N, seed_base=85_000_000 + 1_000_000 * (method == "greedy"))
    m = llm.engine.spec_metrics
    assert 0.1 < m.num_accepted_tokens / m.num_draft_tokens < 0.9  # blocks kept, cut and emptied
    _check(models, tokens, configs, f"block/{method}")


def test_block_verification_draws_each_round_s_drafts_afresh(models, monkeypatch):
    """Block verification decides how many drafts it keeps from all of them, the ones past its
    block included, and the next round drafts those positions again: with the noise of the first
    draw (keyed by seed and position alone) a draft that ignores its context repeats the drafts
    the last decision turned down, and tokens 3 and 4 leave the target's distribution. Draft
    noise is keyed by the draft's column as well (draft_salt): a fresh draw."""
    import tandem.spec.speculator as speculator_mod
    from tandem.sampling.gumbel import DRAFT_SALT

    cfg = dict(temperature=1.0)
    joint = exact_joint(models["free"], cfg)
    pvalues = []
    for fresh in (True, False):
        if not fresh:
            monkeypatch.setattr(speculator_mod, "draft_salt", lambda column: DRAFT_SALT)
        llm = _llm(models, "free_draft", k=3, target="free", rejection_sample_method="block")
        (tokens,) = sample_tokens(llm, [cfg], 20_000, seed_base=97_000_000, max_tokens=5)
        m = llm.engine.spec_metrics
        assert 0.2 < m.num_accepted_tokens / m.num_draft_tokens < 0.8
        pvalues.append(fit_pvalues(tokens, joint))
    assert min(pvalues[0].values()) > ALPHA, pvalues[0]
    assert min(pvalues[1].values()) < 1e-4, pvalues[1]  # the control: the test sees the bias


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_confidence_stop_keeps_the_target_distribution(models, method):
    """draft_confidence_threshold: rounds cut where the draft is unsure (k = 3: one, two or three
    drafts verified, by the draft's own confidence) still give the target's joint distribution."""
    configs = [dict(temperature=1.0), dict(temperature=0.8, top_k=8, top_p=0.9)]
    llm = _llm(models, "near", k=3, method=method, draft_confidence_threshold=0.4)
    tokens = sample_tokens(llm, configs, N, seed_base=95_000_000 + 1_000_000 * (method == "greedy"), max_tokens=5)
    m = llm.engine.spec_metrics
    rounds, second, third = m.num_draft_rounds, m.drafted_per_position[1], m.drafted_per_position[2]
    assert 0.1 * rounds < third < second < 0.9 * rounds, (rounds, second, third)  # rounds of every length
    _check(models, tokens, configs, f"confidence/{method}")


def test_block_uniforms_keyed_by_position_alone_are_caught(models, monkeypatch):
    """Negative control for block verification's keying: uniforms keyed by (seed, position) alone,
    as vLLM keys them, are read again by the next round at the positions past the block, already
    known to exceed their thresholds; the output then leaves the target's distribution, and this
    test sees it (the same run with the uniforms fresh every round passes above). Greedy drafts
    show it most; the engine verifies them with the coupled test, so the block sampler is put in
    its place here."""
    import tandem.spec.rejection as rejection_mod
    from tandem.sampling.gumbel import BLOCK_SALT, noise_key, uniform

    monkeypatch.setattr(rejection_mod, "block_uniforms",
                        lambda seeds, positions, row_index: uniform(noise_key(seeds, positions, BLOCK_SALT), 0 * row_index))
    cfg = dict(temperature=1.5)
    llm = _llm(models, "near", k=2, method="greedy", rejection_sample_method="block")
    llm.engine.runner.speculator.rejection_sample = rejection_mod.block_rejection_sample
    tokens = sample_tokens(llm, [cfg], 12_000, seed_base=95_000_000)
    assert min(fit_pvalues(tokens[0], exact_joint(models["target"], cfg)).values()) < 1e-4


def test_negative_controls_have_power(models, monkeypatch):
    cfg = dict(temperature=0.5)
    joint = exact_joint(models["target"], cfg)
    # Sanity: target-only sampling passes the same tests.
    tokens, = sample_tokens(_llm(models), [cfg], N, seed_base=40_000_000)
    assert min(fit_pvalues(tokens, joint).values()) > ALPHA
    # 1) Accept every draft (synthetic mode, rates 1): tokens 2-3 come from the draft q.
    llm = _llm(models, "near", k=2, method="probabilistic", rejection_sample_method="synthetic",
               synthetic_acceptance_rates=[1.0, 1.0])
    tokens, = sample_tokens(llm, [cfg], N, seed_base=40_000_000)
    pv = fit_pvalues(tokens, joint)
    assert pv["t2"] < 1e-6 and pv["joint"] < 1e-6, pv
    # 2) A verifier that leaves the temperature out of q (q_logits * T undoes it, T = 0.5).
    real = speculator_base.rejection_sample

    def no_temperature_q(p_logits, row_draft, row_is_bonus, row_greedy, sampled_idx, q_logits, *args):
        return real(p_logits, row_draft, row_is_bonus, row_greedy, sampled_idx,
                    None if q_logits is None else q_logits * cfg["temperature"], *args)

    monkeypatch.setattr(speculator_base, "rejection_sample", no_temperature_q)
    tokens, = sample_tokens(_llm(models, "near", k=2, method="probabilistic"), [cfg], N, seed_base=40_000_000)
    pv = fit_pvalues(tokens, joint)
    assert min(pv.values()) < 1e-4, pv


# ----------------------------------------------------------------------------- reproducibility
def _batch(target: SamplingParams, target_prompt, where: int):
    g = torch.Generator().manual_seed(where)
    others = []
    for i in range(7):
        prompt = torch.randint(2, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        params = [
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=99 + i, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=4, max_tokens=5, ignore_eos=True, repetition_penalty=1.2),
            SamplingParams(temperature=1.3, top_p=0.8, n=2, max_tokens=17, ignore_eos=True),
        ][i % 4]
        others.append(({"prompt_token_ids": prompt}, params))
    idx = where % (len(others) + 1)
    others.insert(idx, ({"prompt_token_ids": target_prompt}, target))
    return [o[0] for o in others], [o[1] for o in others], idx


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_seeded_output_reproducible_across_runs_and_batches(models, method):
    targets = [
        ([5, 9, 3], SamplingParams(temperature=0.9, seed=1234, max_tokens=40, ignore_eos=True)),
        ([2, 30, 31, 17, 8, 8, 20], SamplingParams(temperature=1.2, top_k=10, top_p=0.9, seed=7, max_tokens=33,
                                                   ignore_eos=True, presence_penalty=0.5)),
    ]
    llm = _llm(models, "near", k=3, method=method)
    for prompt, params in targets:
        alone = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(alone) == params.max_tokens
        again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert again == alone
        for where in (0, 3, 7):
            prompts, plist, idx = _batch(params, prompt, where)
            outs = llm.generate(prompts, plist, use_tqdm=False)
            assert outs[idx].outputs[0].token_ids == alone, where
        # A fresh engine (with a different engine seed) gives the same tokens.
        fresh = LLM(str(models["target"]), dtype="float32", max_model_len=64, block_size=8, seed=5,
                    speculative_config=dict(model=str(models["near"]), num_speculative_tokens=3,
                                            draft_sample_method=method))
        assert fresh.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == alone


def _preempting_batch(prompt, params):
    """Four long requests ahead of ours in a KV pool too small for all: ours, admitted last, is
    the one preempted (and recomputed)."""
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(2, V, (20,), generator=g).tolist()} for _ in range(4)]
    plist = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=40, ignore_eos=True) for i in range(4)]
    return prompts + [{"prompt_token_ids": prompt}], plist + [params]


def _preemption_run(models, spec):
    prompt = [5, 9, 3]
    params = SamplingParams(temperature=0.9, seed=1234, max_tokens=40, ignore_eos=True)
    mk = lambda **kw: LLM(str(models["target"]), dtype="float32", max_model_len=64, block_size=8,  # noqa: E731
                          speculative_config=spec, **kw)
    alone = mk().generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    prompts, plist = _preempting_batch(prompt, params)
    out = mk(num_gpu_blocks_override=12).generate(prompts, plist, use_tqdm=False)[-1]
    if out.metrics.num_preemptions == 0:
        pytest.skip("the request was not preempted; nothing to check")
    return out.outputs[0].token_ids, alone


def test_preemption_keeps_seeded_output_without_speculation(models):
    got, alone = _preemption_run(models, None)
    assert got == alone
