"""A pruned draft head (speculative_config draft_vocab_size / draft_token_map): the draft scores
a hot set of ids only, its drafts are hot ids, and the output is still the target's."""
import json

import pytest
import torch
from safetensors.torch import load_file

import tandem.spec.speculator as speculator_mod
from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.spec.config import SpeculativeConfig
from tandem.spec.hot_vocab import count_token_map, hot_token_ids, read_token_map, special_token_ids
from tests.helpers import make_hf_model, make_spec_models

MAX_LEN = 256
V = 320


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hot")
    models = make_spec_models(root)
    models["tied"] = make_hf_model(root / "tied", "llama", num_layers=1, hidden_size=32, num_heads=2,
                                   num_kv_heads=1, tie=True, seed=3)
    return models


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, V, (n,), generator=g).tolist()} for n in lengths]


PROMPTS = _prompts([4, 19, 64, 7])
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _llm(models, draft="near", k=4, method="greedy", llm_kw=None, **spec_extra):
    spec = None
    if draft is not None:
        spec = dict(model=str(models[draft]), num_speculative_tokens=k, draft_sample_method=method, **spec_extra)
    return LLM(str(models["target"]), dtype="float32", block_size=8, max_model_len=MAX_LEN, speculative_config=spec,
               **(llm_kw or {}))


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(models):
    return _tokens(_llm(models, None).generate(PROMPTS, GREEDY, use_tqdm=False))


def _watch_drafts(monkeypatch) -> list[int]:
    """Every draft token any draft step writes (the CPU drafts step by step)."""
    seen = []
    real = speculator_mod.DraftSpeculator._draft_step

    def draft_step(self, step, logits, slots, gen_pos, sampling, *args, **kwargs):
        real(self, step, logits, slots, gen_pos, sampling, *args, **kwargs)
        seen.extend(self.drafts[slots, step].tolist())

    monkeypatch.setattr(speculator_mod.DraftSpeculator, "_draft_step", draft_step)
    return seen


def test_the_pruned_head_keeps_the_hot_rows(models):
    """The head holds the hot rows of the checkpoint's head (untied) or of the embedding table
    (tied, which stays whole), and the speculator maps each logit column to its id."""
    hot = [1, 3, 7, 40, 41, 200]
    for name, head_key in (("near", "lm_head.weight"), ("tied", "model.embed_tokens.weight")):
        path = models[name]
        mapping = path.parent / f"{name}_map.json"
        mapping.write_text(json.dumps(hot[::-1]))
        llm = _llm(models, name, draft_token_map=str(mapping))
        spec = llm.engine.runner.speculator
        weights = load_file(str(path / "model.safetensors"))
        specials = special_token_ids(llm.get_tokenizer())  # <s>, </s> and Qwen2's <|endoftext|>: kept
        assert specials == {0, 1, 300}
        assert spec.hot_ids.tolist() == sorted(set(hot) | specials)
        head = spec.model.lm_head.weight
        assert torch.equal(head, weights[head_key][spec.hot_ids])
        embed = spec.model.model.embed_tokens.weight
        assert torch.equal(embed, weights["model.embed_tokens.weight"])  # any emitted token can be read
        hidden = torch.randn(3, head.shape[1])
        assert spec.model.compute_logits(hidden).shape == (3, len(spec.hot_ids))


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_greedy_output_equals_target_only(models, baseline, monkeypatch, method):
    """Greedy requests give the target's own tokens with a pruned draft head; every draft is a hot
    id, and a smaller hot set accepts fewer drafts (the target's tokens outside it are never drafted)."""
    rates = {}
    for size in (None, 200, 64):
        seen = _watch_drafts(monkeypatch)
        llm = _llm(models, method=method, **({} if size is None else {"draft_vocab_size": size}))
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
        rates[size] = llm.engine.spec_metrics.acceptance_rate
        if size is not None:
            hot = set(llm.engine.runner.speculator.hot_ids.tolist())
            assert hot == set(range(size)) | special_token_ids(llm.get_tokenizer())
            assert seen and set(seen) <= hot
        monkeypatch.undo()
    assert rates[None] > rates[200] > rates[64] > 0, rates


def test_sampled_output_is_seeded_and_hot(models, monkeypatch):
    """Sampled requests with probabilistic drafts: every draft is a hot id, and seeded output does
    not depend on the batch (the distribution itself: test_distribution.py)."""
    seen = _watch_drafts(monkeypatch)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=30, ignore_eos=True, top_k=k)
              for s, (t, k) in enumerate([(1.0, 0), (0.7, 20), (1.3, 0), (0.9, 5)])]
    llm = _llm(models, method="probabilistic", draft_vocab_size=150)
    together = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    alone = [_tokens(llm.generate([p], q, use_tqdm=False))[0] for p, q in zip(PROMPTS, params)]
    assert together == alone
    assert seen and set(seen) <= set(llm.engine.runner.speculator.hot_ids.tolist())


def test_hot_ids_from_a_map_or_a_size(tmp_path):
    class Tok:
        all_special_ids = [0, 1]
        added_tokens_decoder = {318: None}

    assert hot_token_ids(None, None, 320, Tok(), (1,)) is None  # nothing asked: the whole head
    assert hot_token_ids(5, None, 320, Tok(), (2, 9000)) == [0, 1, 2, 3, 4, 318]  # EOS ids beyond the vocabulary: left out
    path = tmp_path / "map.json"
    path.write_text(json.dumps([50, 7, 50, 9, 300]))
    assert hot_token_ids(None, str(path), 320, None, (1,)) == [1, 7, 9, 50, 300]  # duplicates counted once
    assert hot_token_ids(3, str(path), 320, None, ()) == [7, 9, 50]  # the map's first 3 distinct ids
    pt = tmp_path / "map.pt"
    torch.save(torch.tensor([4, 2]), pt)
    assert read_token_map(pt) == [4, 2]
    torch.save([torch.tensor(5), torch.tensor(3)], pt)  # a list of 0-d tensors, as SGLang's maps may hold
    assert read_token_map(pt) == [5, 3]
    assert hot_token_ids(320, None, 320, None, ()) is None  # the whole vocabulary: nothing pruned


def test_count_token_map(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models["target"]))
    ranked = count_token_map(tok, ["the fox, the dog", "the fox"])
    the, fox = tok("the", add_special_tokens=False).input_ids, tok(" fox", add_special_tokens=False).input_ids
    assert ranked[0] == the[0] and fox[0] in ranked[:3]
    assert count_token_map(tok, ["the fox, the dog", "the fox"], size=2) == ranked[:2]
    counts = {t: sum(tok(x, add_special_tokens=False).input_ids.count(t) for x in ["the fox, the dog", "the fox"])
              for t in ranked}
    assert [counts[t] for t in ranked] == sorted(counts.values(), reverse=True)


def test_bad_settings_name_the_field(models, tmp_path):
    for value in (0, -3, True, 2.5, "32k"):
        with pytest.raises(ConfigError, match=r"draft_vocab_size=.* must be a positive integer"):
            _llm(models, draft_vocab_size=value)
    with pytest.raises(ConfigError, match="draft_token_map=.*is not a file"):
        _llm(models, draft_token_map=str(tmp_path / "missing.json"))
    cases = {"ids.txt": "1 2 3", "bad.json": "{not json", "dict.json": '{"ids": [1]}', "empty.json": "[]",
             "floats.json": "[1.5, 2]"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match="draft_token_map"):
            _llm(models, draft_token_map=str(tmp_path / name))
    torch.save(torch.ones(2, 2, dtype=torch.int64), tmp_path / "square.pt")
    with pytest.raises(ConfigError, match="1-D integer"):
        _llm(models, draft_token_map=str(tmp_path / "square.pt"))
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file at all")
    with pytest.raises(ConfigError, match="draft_token_map=.*cannot be read as a token map"):
        SpeculativeConfig.from_user(dict(model="d", num_speculative_tokens=2,
                                         draft_token_map=str(tmp_path / "garbage.pt")), 64)  # before any model loads
    (tmp_path / "far.json").write_text(json.dumps([3, 4000]))
    with pytest.raises(ConfigError, match=r"outside the draft's vocabulary \[0, 320\).*4000"):
        _llm(models, draft_token_map=str(tmp_path / "far.json"))


@pytest.mark.parametrize("way", ["round", "repair"])
def test_constrained_greedy_output_with_no_hot_id_allowed(models, tmp_path, way):
    """A grammar that allows only ids outside the hot set (digits, none of them scored): the draft
    still proposes one of the ids it allows, and greedy output equals target-only output."""
    from tandem import StructuredOutputsParams

    ref = _llm(models, None)
    digits = [ref.get_tokenizer().convert_tokens_to_ids(str(d)) for d in range(10)]
    path = tmp_path / "map.json"
    path.write_text(json.dumps([t for t in range(V) if t not in digits]))
    prompts = [{"prompt_token_ids": [5 + j, 40, 41 + 2 * j, 7]} for j in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[0-9]{6}"))
    want = _tokens(ref.generate(prompts, params, use_tqdm=False))
    llm = _llm(models, k=3, draft_token_map=str(path))
    llm.engine.grammar_drafting = way
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert all(len(out) == 7 and set(out[:6]) <= set(digits) for out in want)
    assert llm.engine.spec_metrics.num_draft_tokens > 0


def test_watermarked_output_equals_target_only(models):
    """Watermarked requests: the draft's keyed draw over its hot ids, accepted only where it equals
    the target's keyed draw, so the output is the target-only watermarked output."""
    wm = {"watermark_config": {"key": 20261202}}
    params = [SamplingParams(temperature=t, seed=s, max_tokens=30, ignore_eos=True) for s, t in enumerate([1.0, 0.8])]
    want = _tokens(_llm(models, None, llm_kw=wm).generate(PROMPTS[:2], params, use_tqdm=False))
    for method in ("greedy", "probabilistic"):
        llm = _llm(models, method=method, llm_kw=wm, draft_vocab_size=200)
        assert _tokens(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == want
        assert llm.engine.spec_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("draft", ["near", "tied"])
def test_fp8_draft_with_a_pruned_head(models, baseline, draft):
    """An fp8 draft with a pruned head holds the whole-head fp8 draft's weights, its head cut to the
    hot rows (a tied embedding keeps the rounded values, as without pruning); greedy output is
    still the target's."""
    whole = _llm(models, draft, quantization="fp8").engine.runner.speculator.model
    llm = _llm(models, draft, quantization="fp8", draft_vocab_size=200)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    sp = llm.engine.runner.speculator
    assert sp.model.lm_head.weight.shape[0] == len(sp.hot_ids) < V
    assert torch.equal(sp.model.lm_head.weight, whole.lm_head.weight[sp.hot_ids])
    assert torch.equal(sp.model.model.embed_tokens.weight, whole.model.embed_tokens.weight)
