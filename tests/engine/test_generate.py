"""generate() features: logprobs, stop strings, n > 1, chat, min_tokens, abort, outputs."""
import math
import re

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError, RequestError
from tests.helpers import hf_model, make_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("gen") / "m", "qwen3", init_std=0.3)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), dtype="float32", max_model_len=128, block_size=8)


def test_logprobs_match_transformers(llm, model):
    prompt = [5, 17, 99, 3, 250]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    hf = hf_model(model)
    ids = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    total = 0.0
    for i, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        top = row.topk(3)
        assert list(lp)[:3] == top.indices.tolist()
        assert lp[tok].rank == 1 and math.isclose(lp[tok].logprob, row[tok].item(), abs_tol=1e-4)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(lp[t].logprob, v, abs_tol=1e-4)
        total += lp[tok].logprob
    assert math.isclose(out.outputs[0].cumulative_logprob, total, rel_tol=1e-6)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_mode(llm, model, mode):
    """raw_logprobs (the default, as vLLM's): the model's own distribution; processed_logprobs: the
    one sampled from (temperature, top-k), checked against transformers on the same prefix."""
    engine = llm if mode == "raw_logprobs" else LLM(str(model), dtype="float32", max_model_len=128, block_size=8,
                                                    logprobs_mode=mode)
    prompt = [5, 6, 7]
    p = SamplingParams(temperature=0.7, top_k=5, max_tokens=8, logprobs=2, seed=1, ignore_eos=True)
    out = engine.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        ref = hf_model(model)(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    if mode == "processed_logprobs":
        ref = (ref / 0.7).masked_fill(ref < ref.topk(5, dim=-1).values[:, -1:], float("-inf"))
    ref = ref.log_softmax(-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp[tok].rank <= 5  # a top-k survivor was sampled
        assert math.isclose(lp[tok].logprob, ref[i, tok].item(), abs_tol=1e-4)
        top = ref[i].topk(2)
        assert [lp[t].logprob for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_match_transformers(model, chunk):
    """Every prompt token after the first gets its logprob under the model (raw, as vLLM), its rank
    and the top-n; in prefill chunks too, and with prefix caching on (the cache is bypassed), for a
    request in a batch with others that ask for none."""
    kw = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    engine = LLM(str(model), dtype="float32", max_model_len=128, block_size=8, enable_prefix_caching=True, **kw)
    prompt = [5, 17, 99, 3, 250, 7, 7, 8, 9, 10, 11, 12, 13, 40, 41, 42, 43, 44, 45, 46]
    with torch.no_grad():
        ref = hf_model(model)(torch.tensor([prompt])).logits[0].log_softmax(-1)
    p = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    engine.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)  # fills the cache
    outs = engine.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:6]}],
                           [p, SamplingParams(max_tokens=2)], use_tqdm=False)
    got = outs[0].prompt_logprobs
    assert outs[1].prompt_logprobs is None
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, tok = ref[i - 1], prompt[i]
        assert math.isclose(got[i][tok].logprob, row[tok].item(), abs_tol=1e-4)
        assert got[i][tok].rank == int((row >= row[tok]).sum())
        top = row.topk(2)
        assert [got[i][t].logprob for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert len(got[i]) <= 3


def test_tied_tokens_rank_by_their_place_in_the_top_n(tmp_path):
    """Tokens 2i and 2i + 1 share an LM-head row, so their logits tie exactly (bf16 logits tie often):
    a sampled or prompt token among the top-n is ranked by its place there, so the entries rank 1..n
    with no gap (it was ranked after its twin, which ranked 2 as well, and top_logprobs=1 came back
    empty); one outside the top-n keeps the count of tokens at least as likely (vLLM's rules)."""
    from safetensors.torch import load_file, save_file

    from tandem.server.render import chat_logprobs

    path = make_hf_model(tmp_path / "twin", "qwen2", seed=3)
    weights = load_file(path / "model.safetensors")
    head = weights["lm_head.weight"].clone()
    head[1::2] = head[0::2]
    weights["lm_head.weight"] = head
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    engine = LLM(str(path), dtype="float32", max_model_len=64, block_size=8)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, logprobs=n, prompt_logprobs=n, ignore_eos=True)
              for s in range(4) for n in (1, 2)]
    outs = engine.generate([{"prompt_token_ids": [5, 17, 99, 3, 250, 7]}] * len(params), params, use_tqdm=False)
    checked = 0
    for out, p in zip(outs, params):
        c = out.outputs[0]
        for token, lp in [*zip(c.token_ids, c.logprobs), *zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]:
            top = sorted(v.rank for t, v in lp.items() if t != token or len(lp) == p.logprobs)
            assert top == list(range(1, p.logprobs + 1)), lp
            checked += lp[token].rank <= p.logprobs and (token ^ 1) in lp  # a tie within the top-n
        assert all(len(e.top_logprobs) == p.logprobs for e in chat_logprobs(c.token_ids, c.logprobs, p.logprobs).content)
    assert checked  # the seeds draw tied tokens among the top-n


def test_logprobs_mode_is_checked(model):
    from tandem.errors import ConfigError

    with pytest.raises(ConfigError, match="logprobs_mode='raw_logits' is not supported"):
        LLM(str(model), dtype="float32", max_model_len=128, logprobs_mode="raw_logits")


def test_stop_strings(llm):
    base = llm.generate("The quick brown", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    for include in (False, True):
        p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "zzzz"],
                           include_stop_str_in_output=include)
        out = llm.generate("The quick brown", p, use_tqdm=False)[0].outputs[0]
        cut = text.index(stop)
        assert out.text == (text[: cut + len(stop)] if include else text[:cut])
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == base.token_ids[: len(out.token_ids)]


def test_a_stop_string_cannot_end_in_the_first_min_tokens(llm):
    """As EOS is held back for min_tokens tokens, a stop string counts only when it ends in the
    text of a later token (vLLM's rule)."""
    prompt = {"prompt_token_ids": [8, 9, 10]}
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    texts = [tok.decode(base.token_ids[: i + 1]) for i in range(len(base.token_ids))]
    # m: the first token (from the 2nd) whose text is new: found nowhere else in the output.
    m, stop = next((i + 1, texts[i][len(texts[i - 1]):]) for i in range(1, 10)
                   if texts[i][len(texts[i - 1]):].strip() and texts[-1].count(texts[i][len(texts[i - 1]):]) == 1)
    for min_tokens, length in ((m - 1, m), (m, 12)):
        p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=min_tokens, stop=[stop])
        out = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == length, (min_tokens, stop, out)
        assert out.finish_reason == ("stop" if length == m else "length")


def test_bad_words(llm):
    """A bad word (a string, tokenized with and without a leading space) never appears in the output;
    the output before it is untouched."""
    prompt = {"prompt_token_ids": [8, 9, 10]}
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    word = tok.decode(base.token_ids[4:6])
    ids = tok.encode(word.lstrip(), add_special_tokens=False)
    out = llm.generate(prompt, p.clone(bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert not any(out.token_ids[i : i + len(ids)] == ids for i in range(len(out.token_ids)))
    first = next(i for i in range(len(base.token_ids)) if base.token_ids[i : i + len(ids)] == ids)
    assert out.token_ids[: first + len(ids) - 1] == base.token_ids[: first + len(ids) - 1]


def test_bad_words_spaced_spelling_rule():
    """The spaced spelling is banned too only where the space folds into a different first token and
    the word keeps its length (vLLM's rule): not where only a later token differs."""
    from types import SimpleNamespace

    from tandem.engine.engine import bad_word_ids

    spellings = {"ab": [1, 2], " ab": [3, 2], "cd": [4, 5], " cd": [4, 6], "ef": [7], " ef": [8, 7]}
    tok = SimpleNamespace(encode=lambda text, add_special_tokens: spellings[text])
    assert bad_word_ids(tok, ["ab", " cd", "ef"]) == [[1, 2], [3, 2], [4, 5], [7]]


def test_truncate_prompt_tokens(llm):
    """The prompt's last k tokens run (left truncation, as vLLM); -1 keeps max_model_len of them."""
    prompt = list(range(20, 220))  # longer than max_model_len = 128
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": prompt[-50:]}, p, use_tqdm=False)[0]
    got = llm.generate({"prompt_token_ids": prompt}, p.clone(truncate_prompt_tokens=50), use_tqdm=False)[0]
    assert got.prompt_token_ids == prompt[-50:] and got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(RequestError, match="max_model_len"):  # 128 tokens leave no room to generate
        llm.generate({"prompt_token_ids": prompt}, p.clone(truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(RequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    # more than max_model_len is refused before any work, for a short prompt too (as vLLM's)
    for prompt_ids in (prompt, prompt[:10]):
        with pytest.raises(RequestError, match=r"truncate_prompt_tokens=129 is invalid: .*max_model_len=128"):
            llm.generate({"prompt_token_ids": prompt_ids}, p.clone(truncate_prompt_tokens=129), use_tqdm=False)
    ok = llm.generate({"prompt_token_ids": prompt[:10]}, p.clone(truncate_prompt_tokens=128), use_tqdm=False)[0]
    assert ok.prompt_token_ids == prompt[:10]


def test_n_greater_than_one(llm):
    p = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [4, 5, 6]}, p, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    again = llm.generate({"prompt_token_ids": [4, 5, 6]}, p, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    single = llm.generate({"prompt_token_ids": [4, 5, 6]}, p.clone(n=1), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "hello"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt.startswith("<s>user: hello") and out.prompt.endswith("assistant:")
    expect = llm.get_tokenizer()(out.prompt, add_special_tokens=False).input_ids
    assert out.prompt_token_ids == expect


def test_chat_takes_vllms_arguments(llm):
    """Content parts, continue_final_message, tools and chat_template_kwargs, as vLLM's LLM.chat."""
    p = SamplingParams(temperature=0, max_tokens=2)
    plain = llm.chat([{"role": "user", "content": "hello\nthere"}], p, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}],
                     p, use_tqdm=False)[0]
    assert parts.prompt == plain.prompt and parts.outputs[0].token_ids == plain.outputs[0].token_ids
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The quick"}]
    cont = llm.chat(msgs, p, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("assistant: The quick")
    template = "{{ tools | length }}:{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix }}"
    out = llm.chat(msgs[:1], p, use_tqdm=False, chat_template=template, tools=[{"type": "function"}] * 2,
                   chat_template_kwargs={"suffix": "!"})[0]
    assert out.prompt == "2:hi!"
    kept = llm.chat(msgs[:1], p, use_tqdm=False, chat_template=template, tools=[{"type": "function"}],
                    chat_template_kwargs={"chat_template": None})
    assert kept[0].prompt == "1:hi"  # a null chat_template among the kwargs leaves the one given (vLLM's rule)
    none = llm.chat(msgs[:1], p, use_tqdm=False, chat_template=template, tools=[], mm_processor_kwargs={})[0]
    assert none.prompt == "0:hi"
    with pytest.raises(RequestError, match="mm_processor_kwargs=.* text-only models"):
        llm.chat(msgs[:1], p, mm_processor_kwargs={"num_crops": 4})
    with pytest.raises(RequestError, match="add_generation_prompt"):
        llm.chat(msgs, p, continue_final_message=True)
    with pytest.raises(RequestError, match="text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], p)
    with pytest.raises(RequestError, match="'text' content part needs a string 'text' field; got None"):
        llm.chat([{"role": "user", "content": [{"type": "text"}]}], p)  # was: "only text parts ... got a 'text' part"
    with pytest.raises(RequestError, match="text content parts"):  # an unhashable type was a bare TypeError
        llm.chat([{"role": "user", "content": [{"type": ["text"], "text": "x"}]}], p)


def test_vllm_prompt_and_seed_forms(llm, model):
    text = "The quick brown fox"
    greedy = SamplingParams(temperature=0, max_tokens=4)
    as_str, as_dict = llm.generate([text, {"prompt": text}], greedy, use_tqdm=False)
    assert as_dict.prompt == text and as_dict.prompt_token_ids == as_str.prompt_token_ids
    assert as_dict.outputs[0].token_ids == as_str.outputs[0].token_ids
    assert as_str.num_cached_tokens == as_str.metrics.num_cached_tokens  # vLLM's RequestOutput field
    # cache_salt in a dict prompt (vLLM's): cached prefix blocks serve prompts of the same salt only
    ids = list(range(40, 80))
    salted = [llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, greedy, use_tqdm=False)[0]
              for salt in ("a", "a", "b")]
    assert [o.num_cached_tokens for o in salted] == [0, 32, 0]
    assert salted[0].outputs[0].token_ids == salted[1].outputs[0].token_ids == salted[2].outputs[0].token_ids
    with pytest.raises(RequestError, match="cache_salt"):
        llm.generate({"prompt": text, "cache_salt": 5}, greedy, use_tqdm=False)
    # seed -1 is vLLM's "no seed": two runs sample independently (as None), not one fixed stream
    assert SamplingParams(seed=-1).seed is None
    sampled = [llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(seed=-1, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert sampled[0] != sampled[1]
    # a positive temperature below 0.01 is raised to 0.01 (logits / 1e-38 would overflow)
    tiny = SamplingParams(temperature=1e-38, seed=3, max_tokens=6, min_p=0.1)
    assert tiny.temperature == 0.01
    outs = llm.generate([text] * 2, [tiny, tiny.clone(temperature=0.01)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert LLM(str(model), dtype="float32", max_model_len=64, block_size=8, seed=None, tensor_parallel_size=1,
               trust_remote_code=True, tokenizer_mode="auto").config.model.seed >= 0
    assert LLM(str(model), dtype="float32", max_model_len=64, block_size=8, pipeline_parallel_size=1,
               distributed_executor_backend="uni").config.model.tp_size == 1
    for kw in (dict(tensor_parallel_size=0), dict(tensor_parallel_size=3), dict(tokenizer_mode="slow"),
               dict(pipeline_parallel_size=2), dict(distributed_executor_backend="ray"),
               dict(tensor_parallel_size=2, distributed_executor_backend="uni")):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            LLM(str(model), dtype="float32", max_model_len=64, block_size=8, **kw)


def test_logprobs_decode_each_token_once(llm, model, monkeypatch):
    """A logprob's decoded token is tokenizer.decode([id]), decoded once per engine: whole-vocabulary
    logprobs decoded every id again every step (150k decodes, the batch waiting on them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    engine = llm.engine
    engine._token_text.clear()
    decoded = []
    decode = engine.tokenizer.decode
    monkeypatch.setattr(engine.tokenizer, "decode", lambda ids, *a, **kw: (  # (the detokenizer's name options)
        decoded.append(list(ids)) if not a and not kw else None, decode(ids, *a, **kw))[1])
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=20, prompt_logprobs=20, ignore_eos=True)
    out = llm.generate(["The quick brown fox", "def fib(n):"], p, use_tqdm=False)
    entries = [(t, lp) for o in out for d in o.outputs[0].logprobs + o.prompt_logprobs[1:] for t, lp in d.items()]
    assert len(entries) > 200 and all(lp.decoded_token == tok.decode([t]) for t, lp in entries)
    singles = [ids[0] for ids in decoded if len(ids) == 1]
    assert len(singles) == len(set(singles)) == len({t for t, _ in entries})


def test_detokenize_false_gives_token_ids_only(llm):
    """vLLM's detokenize=False: the same tokens, no text, logprobs without decoded tokens; stop
    strings, which need the text, are refused."""
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    text, ids_only = llm.generate(["The quick brown fox"] * 2, [p, p.clone(detokenize=False)], use_tqdm=False)
    assert ids_only.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert ids_only.outputs[0].text == ""
    assert all(v.decoded_token is None for lp in ids_only.outputs[0].logprobs for v in lp.values())
    # the same tokens' logprobs (to rounding: the two rows of one batch may meet a CPU GEMM's
    # blocking differently, e.g. MKL's sgemm on an AVX-512 machine)
    for a, b in zip(ids_only.outputs[0].logprobs, text.outputs[0].logprobs):
        assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
    with pytest.raises(RequestError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def test_max_logprobs_caps_what_a_request_asks(llm, model):
    """vLLM's max_logprobs (20 by default): more is refused by name; -1 asks for the whole
    vocabulary, which an engine with max_logprobs=-1 (no cap) returns."""
    prompt = {"prompt_token_ids": [5, 17, 99]}
    with pytest.raises(RequestError, match=r"SamplingParams.logprobs=21 .*max_logprobs=20"):
        llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=21))
    with pytest.raises(RequestError, match=r"SamplingParams.prompt_logprobs=-1 .*max_logprobs=20"):
        llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=-1))
    wide = LLM(str(model), dtype="float32", max_model_len=64, block_size=8, max_logprobs=-1)
    vocab = wide.engine.vocab_size
    out = wide.generate(prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                        use_tqdm=False)[0]
    assert [len(lp) for lp in out.outputs[0].logprobs] == [vocab, vocab]
    assert all(len(lp) == vocab for lp in out.prompt_logprobs[1:])
    probs = torch.tensor([v.logprob for v in out.outputs[0].logprobs[0].values()]).exp().sum()
    assert probs.item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ConfigError, match="max_logprobs"):
        LLM(str(model), dtype="float32", max_model_len=64, block_size=8, max_logprobs=-2)
    # No cap, but no more than the vocabulary holds: refused by name before anything runs (as vLLM)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(RequestError, match=rf"SamplingParams.{name}={vocab + 1} .*vocabulary has {vocab}"):
            wide.generate([prompt, prompt], SamplingParams(max_tokens=2, **{name: vocab + 1}), use_tqdm=False)
        assert not wide.engine.has_unfinished_requests()


def test_min_tokens_and_eos(llm):
    eos = llm.engine.eos_token_ids[0]
    p = SamplingParams(temperature=0, max_tokens=12, logit_bias={eos: 100.0})
    out = llm.generate({"prompt_token_ids": [8, 9]}, p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = llm.generate({"prompt_token_ids": [8, 9]}, p.clone(min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    out = llm.generate({"prompt_token_ids": [8, 9]}, p.clone(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    # under ignore_eos, min_tokens still holds EOS back (vLLM masks all_stop_token_ids, EOS included)
    out = llm.generate({"prompt_token_ids": [8, 9]}, p.clone(ignore_eos=True, min_tokens=5), use_tqdm=False)[0]
    assert eos not in out.outputs[0].token_ids[:5] and out.outputs[0].token_ids[5:] == [eos] * 7


def test_min_tokens_yields_where_only_stop_tokens_are_allowed(llm):
    """allowed_token_ids of stop tokens alone: min_tokens would leave nothing to draw, so it keeps
    them (a row never empties: the old way drew token 0, which the request does not allow); the
    output goes on with them until min_tokens, where the stop counts. Greedy and sampled."""
    eos = llm.engine.eos_token_ids[0]
    for temperature in (0.0, 1.0):
        p = SamplingParams(temperature=temperature, seed=3, max_tokens=12, min_tokens=4, allowed_token_ids=[eos])
        out = llm.generate({"prompt_token_ids": [8, 9]}, p, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [eos] * 4 and out.finish_reason == "stop", (temperature, out)


def test_an_output_no_token_fits_ends_there(llm):
    """allowed_token_ids whose tokens bad words ban leave nothing to draw: the output ends there
    with EOS (finish "stop"), greedy or sampled, where it drew token 0, a token both forbid, until
    max_tokens. A bad word of two tokens empties the row only after its first."""
    eos = llm.engine.eos_token_ids[0]
    for temperature in (0.0, 1.0):
        run = lambda **kw: llm.generate({"prompt_token_ids": [8, 9]}, SamplingParams(
            temperature=temperature, seed=3, max_tokens=6, **kw), use_tqdm=False)[0].outputs[0]
        out = run(allowed_token_ids=[50, 51], bad_words_token_ids=[[50], [51]])
        assert (out.token_ids, out.finish_reason) == ([eos], "stop"), (temperature, out)
        out = run(allowed_token_ids=[50], bad_words_token_ids=[[50, 50]])
        assert (out.token_ids, out.finish_reason) == ([50, eos], "stop"), (temperature, out)


def test_offline_logit_bias_takes_any_float32_and_minus_inf(llm):
    """Offline, as vLLM's SamplingParams: a bias beyond OpenAI's [-100, 100] (the server's range)
    is taken: 1000 forces its token, -inf bans it; a row -inf biases empty ends the output (a finite
    bias that turns -inf under the temperature too)."""
    eos = llm.engine.eos_token_ids[0]
    run = lambda **kw: llm.generate({"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=4, seed=1, **kw),
                                    use_tqdm=False)[0].outputs[0].token_ids
    assert run(temperature=1.0, logit_bias={50: 1000.0}) == [50] * 4
    free = run(temperature=0, ignore_eos=True)
    banned = run(temperature=0, ignore_eos=True, logit_bias={free[0]: float("-inf")})
    assert banned[0] != free[0] and free[0] not in banned
    everything = {t: float("-inf") for t in range(llm.engine.vocab_size)}
    assert run(temperature=1.0, logit_bias=everything) == [eos]
    # a finite bias that a temperature below 1 takes past the floats (-inf) empties the row as surely
    lowest = {t: -3.4e38 for t in range(llm.engine.vocab_size)}
    assert run(temperature=0.5, logit_bias=lowest) == [eos]


@pytest.mark.parametrize("draft", ["none", "probabilistic"])
def test_a_huge_positive_bias_forces_its_tokens_evenly(model, draft):
    """A bias that a temperature below 1 takes past the floats (3e38 / 0.5) forces its token under
    min-p and top-p too (it overflowed to inf: a NaN softmax, min-p masked every token and token 0
    was drawn), with finite processed logprobs; two such tokens are drawn about evenly (the Gumbel
    noise was swamped: always the lower id); a request beside them draws what it draws alone. With
    probabilistic drafts too (the model its own draft: the drafts' distribution is shifted alike)."""
    spec = None if draft == "none" else dict(model=str(model), num_speculative_tokens=2, draft_sample_method=draft)
    llm = LLM(str(model), dtype="float32", max_model_len=128, block_size=8, logprobs_mode="processed_logprobs",
              speculative_config=spec)
    prompt = {"prompt_token_ids": [8, 9]}
    forced = SamplingParams(temperature=0.5, min_p=0.1, top_p=0.9, logit_bias={50: 3e38}, max_tokens=3, seed=1,
                            logprobs=1)
    out = llm.generate(prompt, forced, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [50] * 3
    assert all(math.isfinite(lp.logprob) for step in out.logprobs for lp in step.values()), out.logprobs
    two = SamplingParams(n=200, temperature=0.5, logit_bias={50: 3e38, 51: 3e38}, max_tokens=1, seed=2)
    drawn = [o.token_ids[0] for o in llm.generate(prompt, two, use_tqdm=False)[0].outputs]
    assert set(drawn) == {50, 51} and 60 < drawn.count(50) < 140, drawn  # Binomial(200, 1/2): 5e-9 outside
    other = SamplingParams(temperature=0.8, max_tokens=6, seed=3, ignore_eos=True)
    alone = llm.generate(prompt, other, use_tqdm=False)[0].outputs[0].token_ids
    together = llm.generate([prompt, prompt], [forced, other], use_tqdm=False)
    assert together[1].outputs[0].token_ids == alone and together[0].outputs[0].token_ids == [50] * 3


def test_a_repetition_penalty_below_one_keeps_a_lifted_logit_finite(model):
    """A repetition penalty below 1 divides a seen token's positive logit: a biased one (3e38 / 0.5), or one
    with a bias of 100 under the smallest penalty accepted (1.2e-38), went past the floats (+inf): processed
    logprobs NaN with rank 0 (the server answered 500), and of two forced tokens the lower id always drawn.
    Now held at the largest float and the row shifted: the token forced with logprob 0 at rank 1, two such
    tokens drawn about evenly, as without the penalty."""
    llm = LLM(str(model), dtype="float32", max_model_len=128, block_size=8, logprobs_mode="processed_logprobs")
    prompt = {"prompt_token_ids": [8, 50, 51, 9]}  # 50 and 51 seen: the repetition penalty applies to them
    for temperature in (0.0, 1.0, 0.5):
        for bias, penalty in ((3e38, 0.5), (100.0, 1.2e-38)):
            p = SamplingParams(temperature=temperature, logit_bias={50: bias}, repetition_penalty=penalty, seed=1,
                               max_tokens=3, logprobs=2, ignore_eos=True)
            out = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == [50] * 3, (temperature, bias, penalty)
            for step in out.logprobs:
                assert step[50].logprob == 0.0 and step[50].rank == 1, step
                assert all(not math.isnan(lp.logprob) and lp.rank >= 1 for lp in step.values()), step
    two = SamplingParams(n=200, temperature=1.0, logit_bias={50: 3e38, 51: 3e38}, repetition_penalty=0.5,
                         max_tokens=1, seed=2)
    drawn = [o.token_ids[0] for o in llm.generate(prompt, two, use_tqdm=False)[0].outputs]
    assert set(drawn) == {50, 51} and 60 < drawn.count(50) < 140, drawn  # Binomial(200, 1/2): 5e-9 outside


def test_a_stop_token_that_is_the_last_allowed_stops(llm):
    """EOS or a stop token as the last token max_tokens allows finishes with "stop" (its text left
    out, its stop_reason set), as vLLM since its PR 27640 (stop before the length cap)."""
    eos = llm.engine.eos_token_ids[0]
    run = lambda **kw: llm.generate({"prompt_token_ids": [8, 9]}, SamplingParams(temperature=0, max_tokens=1, **kw),
                                    use_tqdm=False)[0].outputs[0]
    out = run(logit_bias={eos: 100.0}, skip_special_tokens=False)
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([eos], "", "stop", None)
    out = run(logit_bias={50: 100.0}, stop_token_ids=[50])
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([50], "", "stop", 50)
    assert run(logit_bias={50: 100.0}).finish_reason == "length"


def test_a_request_keeps_the_params_it_was_added_with(llm):
    """The engine keeps a copy of each request's SamplingParams (vLLM's clone, a deep copy): a
    caller reusing its object for the next request changes no request already running."""
    import numpy as np

    prompt = [8, 9, 10]
    alone = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[])
    engine = llm.engine
    engine.add_request("kept", prompt, p)
    engine.step()
    p.temperature, p.max_tokens = 1.0, 2
    p.stop.append(llm.get_tokenizer().decode(alone[3:5]))
    p.stop_token_ids.append(alone[4])
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == alone
    q = SamplingParams(extra_args={"tags": ["a"]}, structured_outputs={"regex": "[a-z]+"})
    c = q.clone()
    assert c.extra_args == q.extra_args and c.extra_args["tags"] is not q.extra_args["tags"]
    assert c.structured_outputs == q.structured_outputs and c.structured_outputs is not q.structured_outputs
    # numpy's numbers and logprobs=True are taken, as vLLM takes them
    n = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), seed=np.int64(3), logprobs=True,
                       allowed_token_ids=[np.int64(4)], logit_bias={np.int64(5): np.float32(1.0)})
    assert (n.max_tokens, n.temperature, n.seed, n.logprobs, n.allowed_token_ids, n.logit_bias) == \
        (5, 0.5, 3, 1, [4], {5: 1.0})
    assert type(n.max_tokens) is int and type(n.temperature) is float


def test_a_stop_token_is_in_token_ids_but_not_in_the_text(llm):
    """As vLLM: the EOS or stop_token_ids token that ends a request is not detokenized, unless
    include_stop_str_in_output; text shown with skip_special_tokens=False too."""
    prompt = {"prompt_token_ids": [8, 9, 10]}
    run = lambda **kw: llm.generate(prompt, SamplingParams(temperature=0, ignore_eos=True, **kw),
                                    use_tqdm=False)[0].outputs[0]
    base = run(max_tokens=12)
    stop_at = next(i for i in range(2, 12) if base.token_ids[i] not in base.token_ids[:i])
    stop_id = base.token_ids[stop_at]
    before, through = run(max_tokens=stop_at).text, run(max_tokens=stop_at + 1).text
    assert through != before  # the stop token has text of its own
    for include, want in ((False, before), (True, through)):
        out = run(max_tokens=12, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        assert out.token_ids == base.token_ids[: stop_at + 1] and out.stop_reason == stop_id
        assert out.text == want
    eos = llm.engine.eos_token_ids[0]
    p = SamplingParams(temperature=0, max_tokens=4, logit_bias={eos: 100.0}, min_tokens=2, skip_special_tokens=False)
    out = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    alone = run(max_tokens=2, skip_special_tokens=False)  # the same two tokens before it (EOS was masked)
    assert out.token_ids == alone.token_ids + [eos] and out.text == alone.text  # the EOS token's text left out


def test_min_tokens_holds_back_every_eos_id(tmp_path):
    """An EOS id that only generation_config.json names (Qwen2.5-Instruct's <|endoftext|>) is masked
    until min_tokens like config.json's, and ends the request after it with its id as stop_reason (vLLM
    adds such ids to stop_token_ids); the tokenizer's EOS ends one with none."""
    import json

    d = make_hf_model(tmp_path / "m", init_std=0.3)
    extra_eos = 292
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, extra_eos]}))
    llm = LLM(str(d), dtype="float32", max_model_len=64, block_size=8)
    assert extra_eos in llm.engine.eos_token_ids
    p = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={extra_eos: 100.0})
    out = llm.generate({"prompt_token_ids": [8, 9]}, p, use_tqdm=False)[0].outputs[0]
    assert extra_eos not in out.token_ids[:3]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == extra_eos and out.finish_reason == "stop"
    assert out.stop_reason == extra_eos and llm.engine.eos_token_ids[0] == llm.tokenizer.eos_token_id
    out = llm.generate({"prompt_token_ids": [8, 9]}, p.clone(logit_bias={1: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == 1 and out.finish_reason == "stop" and out.stop_reason is None


def test_penalties_change_greedy_output(llm):
    prompt = {"prompt_token_ids": [8, 9, 10]}
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    pen = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=2.0,
                                              presence_penalty=2.0), use_tqdm=False)
    a, b = base[0].outputs[0].token_ids, pen[0].outputs[0].token_ids
    assert len(set(b)) >= len(set(a))
    rep = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              repetition_penalty=5.0), use_tqdm=False)[0].outputs[0].token_ids
    assert not set(rep) & {8, 9, 10} or rep != a


def test_abort_frees_blocks(llm):
    engine = llm.engine
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("x", [3] * 30, p)
    engine.add_request("y", [4] * 20, p)
    engine.step()
    engine.step()
    assert engine.abort_request("x")
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    assert finished["x"].outputs[0].finish_reason == "abort" and finished["x"].finished
    assert len(finished["y"].outputs[0].token_ids) == 50
    assert engine.scheduler.blocks.num_free_blocks == engine.cfg.cache.num_blocks
    assert not engine.abort_request("x")


def test_request_output_fields(llm):
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "hello world" and out.prompt_token_ids == llm.get_tokenizer()("hello world").input_ids
    assert out.finished and out.outputs[0].finish_reason == "length"
    m = out.metrics
    assert m.num_prompt_tokens == len(out.prompt_token_ids) and m.num_generation_tokens == 5
    assert m.first_token_time >= m.arrival_time and m.finished_time >= m.first_token_time
    assert m.acceptance_rate is None and m.mean_acceptance_length is None


def _with_generation_config(src, dst, **fields):
    """A copy of the model directory src whose generation_config.json also sets fields."""
    import json
    import shutil

    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return dst


def test_generation_config_sets_the_sampling_defaults(model, tmp_path):
    """As vLLM (generation_config="auto"): a call without sampling_params samples with the sampling
    defaults of the model's generation_config.json; "vllm" ignores them; a bad one fails at load."""
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [250, 8]}]
    # top_k 1 makes the defaults greedy whatever the temperature: the output must equal temperature 0's
    d = _with_generation_config(model, tmp_path / "m", temperature=0.7, top_k=1, top_p=0.9, max_new_tokens=5,
                                repetition_penalty=1.0, do_sample=True)
    llm = LLM(str(d), dtype="float32", max_model_len=128, block_size=8)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.7, 1, 0.9, 5)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    sampled = llm.generate(prompts, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in greedy]
    assert all(len(o.outputs[0].token_ids) <= 5 for o in sampled)
    plain = LLM(str(d), dtype="float32", max_model_len=128, block_size=8, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    assert LLM(str(model), dtype="float32", max_model_len=128, block_size=8,
               generation_config=str(d)).get_default_sampling_params().top_k == 1
    bad = _with_generation_config(model, tmp_path / "bad", temperature=-1.0)
    with pytest.raises(ConfigError, match="generation_config"):
        LLM(str(bad), dtype="float32", max_model_len=128, block_size=8)
    LLM(str(bad), dtype="float32", max_model_len=128, block_size=8, generation_config="vllm")  # ignored: loads
    with pytest.raises(ConfigError, match="generation_config"):
        LLM(str(model), dtype="float32", max_model_len=128, block_size=8, generation_config=str(tmp_path / "none"))


def test_override_generation_config_sets_defaults_over_the_files(model, tmp_path):
    """vLLM's override_generation_config: its keys over generation_config.json's (the file's others
    kept), or alone under generation_config="vllm"; a key that is no sampling default, or a bad
    value, fails at load naming it."""
    d = _with_generation_config(model, tmp_path / "m", temperature=0.7, top_k=1, max_new_tokens=5)
    kw = dict(dtype="float32", max_model_len=128, block_size=8)
    over = LLM(str(d), override_generation_config={"temperature": 0.3, "max_new_tokens": 9}, **kw)
    params = over.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 1, 9)
    alone = LLM(str(d), generation_config="vllm", override_generation_config={"top_p": 0.5}, **kw)
    assert alone.get_default_sampling_params() == SamplingParams(top_p=0.5)
    with pytest.raises(ConfigError, match=r"override_generation_config sets \['do_sample'\]"):
        LLM(str(d), override_generation_config={"do_sample": True}, **kw)
    with pytest.raises(ConfigError, match="override_generation_config sets an invalid"):
        LLM(str(d), override_generation_config={"temperature": -2}, **kw)


class _SpacingTokenizer:
    """A slow tokenizer's way with special tokens: id 0 is "<s>", spaced from its neighbours unless
    spaces_between_special_tokens=False; ids 1.. are letters."""

    def __init__(self):
        self.calls = []

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        self.calls.append(spaces_between_special_tokens)
        pieces = [chr(96 + i) for i in ids if i] if skip_special_tokens else [chr(96 + i) if i else "<s>" for i in ids]
        return (" " if spaces_between_special_tokens else "").join(pieces)


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_reach_the_tokenizer(spaces):
    """vLLM's spaces_between_special_tokens goes to the tokenizer's decode with the special tokens
    shown, so the streamed text is the tokenizer's whole decode of the output (Hugging Face's fast
    tokenizers, the tests' others, have no such spaces to add)."""
    from tandem.engine.detokenizer import Detokenizer

    tok = _SpacingTokenizer()
    detok = Detokenizer(tok)
    state = detok.new_state([1, 2], [], False, skip_special=False, spaces_between_special=spaces)
    for t in (3, 0, 4):
        detok.push(state, t, check_stop=False)
    context = tok.decode([1, 2], skip_special_tokens=False, spaces_between_special_tokens=spaces)
    whole = tok.decode([1, 2, 3, 0, 4], skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert context + state.text == whole == ("a b c <s> d" if spaces else "abc<s>d")
    assert set(tok.calls) == {spaces}
    with pytest.raises(RequestError, match=r"^SamplingParams.spaces_between_special_tokens=1 is invalid"):
        SamplingParams(spaces_between_special_tokens=1)


def test_characters_split_across_tokens_stream_whole(model):
    """The test tokenizer is byte-level and never saw these characters, so each takes two to four byte
    tokens: pushed one at a time, the text waits for a character's last byte (a decode ending in
    U+FFFD is not emitted) and ends as the tokenizer's whole decode; a stop string right after one is
    found and cut."""
    from transformers import AutoTokenizer

    from tandem.engine.detokenizer import Detokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = "ok \U0001f99c and \U0001d518\U0001d52b\u00e9 done"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text)  # multi-byte characters took several tokens each
    detok = Detokenizer(tok)
    state = detok.new_state([], [], False, skip_special=True)
    for t in ids:
        before = state.text
        detok.push(state, t, check_stop=False)
        assert "\ufffd" not in state.text and state.text.startswith(before)
    assert state.text == tok.decode(ids) == text
    state = detok.new_state([], [" and"], False, skip_special=True)
    stop = next(found for t in ids if (found := detok.push(state, t, check_stop=True)) is not None)
    assert stop == " and" and state.text == "ok \U0001f99c"


def test_stop_strings_across_tokens_in_the_text_buffer(model):
    """The detokenizer's text grows in a buffer (not a str copied every token): a stop string is
    found however the tokens split it, among stops of unequal lengths, with and without
    include_stop, line breaks kept as they are; the text is the full decode's, cut there."""
    from transformers import AutoTokenizer

    from tandem.engine.detokenizer import Detokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = "The quick brown fox\r\njumps over the lazy dog. def fib(n):\r\n return n\r"
    ids = tok(text, add_special_tokens=False).input_ids
    detok = Detokenizer(tok)
    for stops in (["lazy"], ["quick brown fox\r\nj"], ["\r\njumps", "fox"], ["fib(n):\r\n", "ove"], ["g. def", "z"],
                  ["xyz"], ["n\r"]):
        for include in (False, True):
            state = detok.new_state([], stops, include, skip_special=True)
            found = next((f for t in ids if (f := detok.push(state, t, check_stop=True)) is not None), None)
            hits = sorted((text.find(stop), stop) for stop in stops if stop in text)
            if not hits:
                assert found is None and state.text == text
                continue
            at, stop = hits[0]
            assert found == stop and state.text == text[: at + len(stop) * include], (stops, include, state.text)
            assert state.buffer.length == len(state.text)
            assert state.buffer.between(2, 7) == state.text[2:7]
    # A stop that starts in the text of tokens pushed without the check (min_tokens) still counts once it ends later.
    state = detok.new_state([], ["quick brown fox"], False, skip_special=True)
    found = next((f for i, t in enumerate(ids) if (f := detok.push(state, t, check_stop=i >= 2)) is not None), None)
    assert found == "quick brown fox" and state.text == "The "


def test_many_stop_strings_are_looked_for_by_their_last_character(model, monkeypatch):
    """With many stop strings only those ending in the new piece's characters are searched (100k
    stops were 100k searches a token); the stop found and the text cut are those of searching them
    all, ties (two stops starting at one place) going to the first listed, as before."""
    import random

    from transformers import AutoTokenizer

    from tandem.engine.detokenizer import Detokenizer, StopStrings

    tok = AutoTokenizer.from_pretrained(str(model))
    text = "The quick brown fox\r\njumps over the lazy dog. def fib(n):\r\n return n\r"
    ids = tok(text, add_special_tokens=False).input_ids
    detok = Detokenizer(tok)
    rng = random.Random(0)

    def run(stops, include, check_from=0):
        state = detok.new_state([], StopStrings(stops), include, skip_special=True)
        found = next((f for i, t in enumerate(ids) if (f := detok.push(state, t, check_stop=i >= check_from))
                      is not None), None)
        return found, state.text

    found = 0
    for trial in range(60):
        stops = ["".join(rng.choice("abcxyz#") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(16, 80))]
        for _ in range(rng.randint(0, 3)):  # a few that occur, some starting at one place
            at = rng.randrange(len(text) - 1)
            stops.insert(rng.randrange(len(stops) + 1), text[at: at + rng.randint(1, 8)])
        include, check_from = rng.random() < 0.5, rng.choice([0, 0, 3])
        indexed = run(stops, include, check_from)
        monkeypatch.setattr(StopStrings, "INDEX_FROM", 10 ** 9)  # every stop searched, as before
        assert run(stops, include, check_from) == indexed, (trial, stops)
        monkeypatch.undo()
        assert len(stops) >= StopStrings.INDEX_FROM
        found += indexed[0] is not None
    assert found > 30  # most trials end at a stop


class _FailingStream:
    def step(self, tokenizer, token):
        raise Exception("Invalid prefix encountered")


def test_the_tokenizers_incremental_decoder_streams_the_windows_text(model):
    """A fast tokenizer's text comes from its DecodeStream: on random ids of the byte-level test
    tokenizer (characters split across byte tokens, special tokens shown and skipped) it streams
    what decoding by windows does, which is the whole decode less the context's, and holds back
    the same incomplete characters; a stream that fails goes on by windows."""
    import random

    from transformers import AutoTokenizer

    from tandem.engine.detokenizer import Detokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    detok = Detokenizer(tok)
    rng = random.Random(0)
    for trial in range(60):
        skip = trial % 2 == 0
        context = tok("def f(x):", add_special_tokens=False).input_ids
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        fast = detok.new_state(context, [], False, skip_special=skip)
        windows = detok.new_state(context, [], False, skip_special=skip)
        assert fast.stream is not None
        windows.stream = None
        failing = detok.new_state(context, [], False, skip_special=skip)
        for j, t in enumerate(ids):
            if j == len(ids) // 2:
                failing.stream = _FailingStream()  # the state goes on by windows
            detok.push(fast, t, check_stop=False)
            detok.push(windows, t, check_stop=False)
            detok.push(failing, t, check_stop=False)
            assert fast.text == windows.text
        assert failing.stream is None or len(ids) == 1
        whole = tok.decode(context + ids, skip_special_tokens=skip)
        if not whole.endswith("\ufffd"):
            assert fast.text == failing.text == whole[len(tok.decode(context, skip_special_tokens=skip)):]


def test_a_run_of_skipped_special_tokens_keeps_the_decode_window_short(model):
    """EOS after EOS (ignore_eos) adds no text under skip_special_tokens, nor do ids past the tokenizer's:
    those ids stay out of the decode window, which used to grow with the run, making each push decode all
    of it again (quadratic in the run); the text is the tokenizer's whole decode either way, and shows the
    EOS without skipping."""
    from transformers import AutoTokenizer

    from tandem.engine.detokenizer import Detokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    eos, fox = tok.eos_token_id, tok("fox", add_special_tokens=False).input_ids
    detok = Detokenizer(tok)

    def run(ids: list[int], skip: bool) -> tuple[str, int]:
        """-> (the text, the widest decode window)."""
        state, widest = detok.new_state([], [], False, skip_special=skip), 0
        for t in ids:
            detok.push(state, t, check_stop=False)
            widest = max(widest, len(state.ids) - state.prefix_offset)
        return state.text, widest

    ids = fox + [eos] * 500 + fox
    unknown = fox + [len(tok) + 7] * 500 + fox  # ids past the tokenizer's (a padded model vocabulary)
    for skip in (True, False):
        text, widest = run(ids, skip)
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert widest <= 2 * len(fox) + 2 if skip else "</s>" in text
        text, widest = run(unknown, skip)
        assert text == tok.decode(fox + fox) and widest <= 2 * len(fox) + 2


def test_a_token_past_a_gap_in_the_vocabulary_has_its_text(tmp_path):
    """A vocabulary that skips an id (len() counts entries, one less than the highest id + 1): its
    last token still has its text, as tokenizer.decode gives it (it counted as a padding id: no text)."""
    import json

    from transformers import AutoTokenizer

    from tandem.engine.detokenizer import Detokenizer, num_token_ids
    from tests.helpers import save_tokenizer

    save_tokenizer(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    merged = {part for m in spec["model"]["merges"] for part in (m.split(" ") if isinstance(m, str) else m)}
    gap = next(t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i > 5 and t not in merged and len(t) == 1)
    del vocab[gap]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    top = max(vocab.values())
    assert len(tok) == top and num_token_ids(tok) == top + 1
    ids = tok("The quick", add_special_tokens=False).input_ids + [top]
    detok = Detokenizer(tok)
    state = detok.new_state([], [], False, True)
    for t in ids:
        detok.push(state, t, check_stop=False)
    assert state.text == tok.decode(ids) and state.text.endswith(tok.decode([top]))


def test_request_timings_start_when_the_step_is_planned(llm, monkeypatch):
    """A request's first_scheduled_time is taken before its first step is planned and launched (on a
    CPU the forward runs inside the launch): the time to first token holds the step, the queue time
    does not; vLLM's per-request timing fields follow from them (tandem/server/response_metrics.py)."""
    import time

    from tandem.server.response_metrics import timing_metrics

    launch = llm.engine.runner.launch

    def slow(plan):
        time.sleep(0.05)
        return launch(plan)

    monkeypatch.setattr(llm.engine.runner, "launch", slow)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    m = llm.generate({"prompt_token_ids": [8, 9]}, params, use_tqdm=False)[0].metrics
    assert m.arrival_time <= m.first_scheduled_time < m.first_token_time <= m.last_token_time
    t = timing_metrics(m)
    assert t["time_to_first_token_ms"] >= 50 and t["queue_time_ms"] < 50
    assert t["generation_time_ms"] >= 100  # two more steps
    assert t["mean_itl_ms"] == pytest.approx(t["generation_time_ms"] / 2)
    assert t["tokens_per_second"] == pytest.approx(3 / (m.last_token_time - m.first_scheduled_time))
    one = timing_metrics(llm.generate({"prompt_token_ids": [8, 9]}, params.clone(max_tokens=1),
                                      use_tqdm=False)[0].metrics)
    assert one["mean_itl_ms"] is None and one["generation_time_ms"] == 0.0  # a single token: no gaps


def test_vllms_offline_api_forms(llm):
    """What scripts written for vLLM's LLM call: llm_engine, abort_request with a list of ids,
    reset_prefix_cache, lora_request=None, chat_template_content_format; logprob dicts with the
    sampled token first; Engine.add_request refusing a text prompt by name."""
    engine = llm.llm_engine
    assert engine is llm.engine
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for request_id in ("a", "b", "c"):
        engine.add_request(request_id, [5, 6, 7], p)
    engine.step()
    assert engine.abort_request(["a", "b"]) and engine.abort_request(("c",)) and not engine.abort_request(["a"])
    finished = {o.request_id: o for o in engine.step() if o.finished}  # the aborts are reported by the next step
    assert {k: o.outputs[0].finish_reason for k, o in finished.items()} == {"a": "abort", "b": "abort", "c": "abort"}
    engine.add_request("d", "hello", p)  # vLLM's LLMEngine takes a text prompt (and a dict) too
    engine.abort_request("d", internal=False)
    llm.generate({"prompt_token_ids": list(range(10, 40))}, p, use_tqdm=False)
    engine.add_request("e", [5, 6, 7], p)
    assert llm.reset_prefix_cache() is False  # a request holds blocks: nothing done, as vLLM
    engine.abort_request("e")
    engine.step()
    assert llm.reset_prefix_cache() is True and not engine.scheduler.blocks.cached
    again = llm.generate({"prompt_token_ids": list(range(10, 40))}, p, use_tqdm=False, lora_request=None)[0]
    assert again.num_cached_tokens == 0
    with pytest.raises(RequestError, match="LoRA"):
        llm.generate("hi", p, use_tqdm=False, lora_request=object())
    sampled = SamplingParams(temperature=1.5, seed=1, max_tokens=8, logprobs=1, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, sampled, use_tqdm=False)[0]
    assert all(next(iter(lp)) == t for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs))
    assert all(next(iter(lp)) == t for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    template = "{% for m in messages %}{{ m['content'] is string }}{% endfor %}"
    for fmt, says in (("string", "True"), ("openai", "False")):
        got = llm.chat(msgs, p, use_tqdm=False, chat_template=template, chat_template_content_format=fmt)[0]
        assert got.prompt == says
    with pytest.raises(RequestError, match="chat_template_content_format"):
        llm.chat(msgs, p, use_tqdm=False, chat_template_content_format="parts")


def test_vllm_prompt_types_and_output_fields_port_as_they_are(tmp_path):
    """Code written against vLLM's API: TextPrompt / TokensPrompt (plain dicts), the outputs'
    lora_request (always None here), a Logprob built without a rank."""
    from tandem import Logprob, TextPrompt, TokensPrompt

    llm = LLM(str(make_hf_model(tmp_path / "m", "llama")), dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=3)
    text, ids = llm.generate([TextPrompt(prompt="a b"), TokensPrompt(prompt_token_ids=[5, 6, 7])], params,
                             use_tqdm=False)
    assert text.outputs[0].token_ids == llm.generate(["a b"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ids.prompt_token_ids == [5, 6, 7]
    assert text.lora_request is None and text.outputs[0].lora_request is None
    assert Logprob(-0.5).rank is None


def test_vllms_engine_and_method_signatures(llm):
    """vLLM's LLMEngine.add_request order (request_id, prompt, params, arrival_time, lora_request,
    tokenization_kwargs, trace_headers, priority, prompt_text): a float fourth is the arrival time (it was
    taken as the prompt's text), a text or dict prompt is tokenized; get_num_unfinished_requests;
    generate / chat take tokenization_kwargs and a None per prompt as lora_request; chat takes a tuple
    of conversations; reset_prefix_cache takes vLLM's arguments; RequestOutput has vLLM's other fields."""
    import time

    engine, tok = llm.llm_engine, llm.get_tokenizer()
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("t", [5, 6, 7], p, time.time())
    engine.add_request("s", "hello there", p, None, None, {"add_special_tokens": False}, None, 0, None)
    engine.add_request("d", {"prompt": "hello there"}, p, prompt_text=None)
    assert engine.get_num_unfinished_requests() == 3
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["t"].prompt is None and outs["t"].prompt_token_ids == [5, 6, 7]
    assert outs["s"].prompt == "hello there"
    assert outs["s"].prompt_token_ids == tok("hello there", add_special_tokens=False).input_ids
    assert outs["d"].prompt_token_ids == tok("hello there").input_ids
    assert engine.get_num_unfinished_requests() == 0
    for bad, says in [(dict(arrival_time="now"), "arrival_time must be a time"),
                      (dict(lora_request=object()), "LoRA"), (dict(tokenization_kwargs={"truncation": True}),
                                                            "tokenization_kwargs ['truncation'] are not supported"),
                      (dict(prompt_text=5), "prompt_text must be the prompt's text")]:
        with pytest.raises(RequestError, match=re.escape(says)):
            engine.add_request("x", [5, 6], p, **bad)
    plain = llm.generate(["hello there"], p, use_tqdm=False, lora_request=[None])[0]
    bare = llm.generate(["hello there"], p, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})[0]
    assert plain.prompt_token_ids == tok("hello there").input_ids
    assert bare.prompt_token_ids == tok("hello there", add_special_tokens=False).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    one, two = llm.chat((msgs, msgs), p, use_tqdm=False)
    special = llm.chat(msgs, p, use_tqdm=False, tokenization_kwargs={"add_special_tokens": True})[0]
    assert one.prompt_token_ids == two.prompt_token_ids == tok(one.prompt, add_special_tokens=False).input_ids
    assert special.prompt_token_ids == tok(one.prompt).input_ids
    assert llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False) is True
    assert llm.reset_prefix_cache(None) is True  # (what asks nothing)
    with pytest.raises(RequestError, match="reset_running_requests=True"):
        llm.reset_prefix_cache(reset_running_requests=True)
    with pytest.raises(RequestError, match="LoRA"):
        llm.generate(["hi"], p, lora_request=[object()])
    assert (plain.encoder_prompt, plain.encoder_prompt_token_ids, plain.kv_transfer_params,
            plain.multi_modal_placeholders) == (None, None, None, {})
