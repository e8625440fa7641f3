"""N-gram lookup (speculative_config method="ngram", vLLM's prompt lookup): the lookup against a
plain reference of vLLM's rule, and the engine's output against target-only, token for token,
greedy and seeded-sampled, with every feature that verification meets."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.errors import ConfigError
from tandem.spec.config import SpeculativeConfig
from tandem.spec.ngram import ngram_drafts
from tests.helpers import make_spec_models

MAX_LEN = 256


def lookup_ref(context: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """vLLM's rule, spelled out: the longest n in [min_n, max_n] whose last-n tokens occur earlier
    (ending before the last token); the k tokens after the earliest such occurrence."""
    total = len(context)
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > total:
            continue
        suffix = context[total - n:]
        for i in range(0, total - n):  # the occurrence ends at i + n - 1 <= total - 2
            if context[i:i + n] == suffix:
                return context[i + n:i + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8, 50])
def test_lookup_matches_the_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        b = 1 + trial % 5
        lens = torch.randint(0, 40, (b,), generator=g)
        width = int(lens.max()) + int(torch.randint(0, 4, (1,), generator=g))
        tokens = torch.randint(0, vocab, (b, max(width, 1)), generator=g)
        min_n = 1 + trial % 3
        max_n = min_n + trial % 4
        k = 1 + trial % 6
        max_model_len = 45 if trial % 7 else int(lens.max()) + 1  # near the limit: fewer drafts
        drafts, counts = ngram_drafts(tokens, lens, min_n, max_n, k, max_model_len)
        for r in range(b):
            want = lookup_ref(tokens[r, : lens[r]].tolist(), min_n, max_n, k, max_model_len)
            assert counts[r] == len(want), (trial, r)
            assert drafts[r, : len(want)].tolist() == want, (trial, r)


def test_lookup_examples():
    # vLLM's docstring example: the last 3 tokens [4, 2, 3] occur nowhere else, [2, 3] does
    drafts, counts = ngram_drafts(torch.tensor([[1, 2, 3, 4, 2, 3]]), torch.tensor([6]), 2, 3, 4, 100)
    assert counts.tolist() == [3] and drafts[0, :3].tolist() == [4, 2, 3]
    # the earliest of equally long matches; a shorter context row padded with junk
    tokens = torch.tensor([[7, 8, 1, 7, 8, 2, 7, 8], [5, 6, 9, 9, 9, 9, 9, 9]])
    drafts, counts = ngram_drafts(tokens, torch.tensor([8, 2]), 1, 2, 2, 100)
    assert counts.tolist() == [2, 0] and drafts[0].tolist() == [1, 7]
    # below min_n: nothing
    _, counts = ngram_drafts(torch.tensor([[1, 2, 3, 1]]), torch.tensor([4]), 2, 2, 3, 100)
    assert counts.tolist() == [0]


# ---------------------------------------------------------------- config
def test_config_defaults_aliases_and_errors():
    cfg = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 3}, 512)
    assert cfg.ngram and cfg.model is None and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert cfg.verify_counts == (1, 2, 3)
    for alias in ({"method": "[ngram]"}, {"method": "ngram_gpu"}, {"model": "[ngram]"}, {"model": "ngram"}):
        cfg = SpeculativeConfig.from_user({**alias, "num_speculative_tokens": 2, "prompt_lookup_max": 4}, 512)
        assert cfg.ngram and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    cfg = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, 512)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.from_user(cfg, 512) == cfg  # the object itself passes again
    obj = SpeculativeConfig(model="[ngram]", num_speculative_tokens=2)  # its method: the field's default
    assert SpeculativeConfig.from_user(obj, 512).ngram
    bad = [
        ({"model": "/some/draft"}, "model"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 exceeds"),
        ({"prompt_lookup_max": 0}, "prompt_lookup_max=0"),
        ({"prompt_lookup_min": "2"}, "prompt_lookup_min='2'"),
        ({"draft_sample_method": "probabilistic"}, "draft_sample_method"),
        ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0}, "synthetic"),
        ({"synthetic_acceptance_length": 2.0}, "synthetic_acceptance_length=2.0: synthetic acceptance"),
        ({"tensor_parallel_size": 2}, "pass draft_tensor_parallel_size instead"),
        ({"num_speculative_tokens_per_batch_size": "auto"}, "auto"),
        ({"quantization": "fp8"}, "quantization"),
        ({"draft_vocab_size": 100}, "draft_vocab_size"),
        ({"draft_confidence_threshold": 0.5}, "draft_confidence_threshold"),
        ({"bogus": 1}, "unknown keys"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"num_speculative_tokens": 512}, "must be below max_model_len=512"),
        ({"rejection_sample_method": "bogus"}, r"rejection_sample_method='bogus' is not supported; use one of "
                                               r"\['standard', 'block'\]"),  # not the synthetic message
        ({"seed": 3}, "speculative_config.seed=3 configures a draft model"),  # were taken silently
        ({"draft_load_format": "dummy"}, "draft_load_format='dummy' configures a draft model"),
    ]
    for extra, words in bad:
        with pytest.raises(ConfigError, match=words):
            SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2, **extra}, 512)
    with pytest.raises(ConfigError, match="num_speculative_tokens is required"):
        SpeculativeConfig.from_user({"method": "ngram"}, 512)
    with pytest.raises(ConfigError, match=r"unknown keys \['num_speculative_token'\]"):  # before "is required"
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_token": 3}, 512)
    with pytest.raises(ConfigError, match="prompt_lookup_max sets n-gram lookup"):
        SpeculativeConfig.from_user({"model": "/x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, 512)


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The speculation trio, and "constant": the target with a zero LM head, whose greedy output
    repeats one token (so the lookup's drafts are accepted)."""
    root = tmp_path_factory.mktemp("ngram")
    models = make_spec_models(root)
    constant = root / "constant"
    shutil.copytree(models["target"], constant)
    weights = load_file(str(constant / "model.safetensors"))
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, str(constant / "model.safetensors"), metadata={"format": "pt"})
    return {**models, "constant": constant}


def _prompts():
    """Prompts that repeat themselves (the lookup finds its n-grams), and one that does not."""
    g = torch.Generator().manual_seed(0)
    out = [{"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist() * 3} for n in (3, 9, 25)]
    return out + [{"prompt_token_ids": torch.randint(2, 320, (40,), generator=g).tolist()}]


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _llm(models, target="target", k=4, lookup=(1, 3), **kw):
    spec = None
    if k:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup[0],
                "prompt_lookup_max": lookup[1], **kw.pop("spec_extra", {})}
    kw.setdefault("max_model_len", MAX_LEN)
    return LLM(str(models[target]), dtype="float32", block_size=8, speculative_config=spec, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def target_only(models):
    return _llm(models, k=0)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_target_only(models, target_only, k):
    prompts = _prompts()
    want = _tokens(target_only.generate(prompts, GREEDY, use_tqdm=False))
    outs = _llm(models, k=k).generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # the repeated prompts drafted


def test_drafts_are_accepted_where_the_target_repeats(models):
    """The constant model emits one token again and again: once it has emitted it twice the lookup
    drafts it, and every draft is accepted."""
    prompts = _prompts()
    base = _tokens(_llm(models, "constant", k=0).generate(prompts, GREEDY, use_tqdm=False))
    assert all(len(set(t)) == 1 for t in base)
    outs = _llm(models, "constant", k=4).generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == base
    for o in outs:
        m = o.metrics
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens
        assert m.num_draft_rounds < 20  # 48 tokens in far fewer steps


def test_seeded_sampled_output_is_target_only(models, target_only):
    """Lookup drafts are verified by coupling: at temperature > 0 the seeded tokens are target-only's."""
    prompts = _prompts()
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.1) for s in range(len(prompts))]
    want = _tokens(target_only.generate(prompts, params, use_tqdm=False))
    assert _tokens(_llm(models, k=3).generate(prompts, params, use_tqdm=False)) == want


def test_preemption_ranges_and_penalties_keep_the_output(models, target_only):
    """A KV pool too small for the batch (preemption by recompute: the context is rebuilt in the
    slot), drafting turned off at larger batches, and penalties that see the drafts."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, frequency_penalty=0.3,
                            presence_penalty=0.2)
    want = _tokens(target_only.generate(prompts, params, use_tqdm=False))
    small = _llm(models, num_gpu_blocks_override=24, max_num_seqs=4, max_model_len=128)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == want
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    ranged = _llm(models, spec_extra={"num_speculative_tokens_per_batch_size": [[3, 8, 0]]})
    assert _tokens(ranged.generate(prompts, params, use_tqdm=False)) == want


def test_structured_outputs_with_lookup(models, target_only):
    """Lookup drafts that leave the grammar are rejected at their row: the output is target-only's."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [9, 10, 9, 10]}]
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=so) for so in
              (StructuredOutputsParams(regex=r"([0-9]{2}-){3}[a-c]{2}"),
               StructuredOutputsParams(choice=["apple pie", "banana split"]))]
    want = _tokens(target_only.generate(prompts, params, use_tqdm=False))
    assert _tokens(_llm(models, k=3).generate(prompts, params, use_tqdm=False)) == want


def test_cli_and_prompt_lookup_flag_errors(models):
    with pytest.raises(ConfigError, match="speculative_config.model='/x' is not used by method='ngram'"):
        LLM(str(models["target"]), dtype="float32", max_model_len=MAX_LEN,
            speculative_config={"method": "ngram", "model": "/x", "num_speculative_tokens": 2})
