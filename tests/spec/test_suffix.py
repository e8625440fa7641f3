"""Suffix lookup (speculative_config method="suffix", vLLM's suffix decoding): the lookup against a
plain reference of its rule, the corpus of finished responses and its eviction, and the engine's
output against target-only, token for token, greedy and seeded-sampled."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.spec.config import SpeculativeConfig
from tandem.spec.suffix import NUM_CANDIDATES, NUM_OCCURRENCES, SEPARATOR, suffix_drafts
from tests.helpers import make_spec_models

MAX_LEN = 256


def _walk_ref(source: list[int], ends: list[int], k: int, limit: int, min_prob: float) -> list[int]:
    """From the occurrences ending at `ends` (most recent first): each step, the token most of the
    surviving ones continue with (the most recent among equals), while the share of the first
    step's occurrences that agree with every draft so far stays >= min_prob."""
    alive = [e + 1 for e in ends if e + 1 < len(source) and source[e + 1] != SEPARATOR]
    first, out = len(alive), []
    while alive and len(out) < min(k, limit):
        tokens = [source[p] if p < len(source) else SEPARATOR for p in alive]
        alive = [p for p, t in zip(alive, tokens) if t != SEPARATOR]
        tokens = [t for t in tokens if t != SEPARATOR]
        if not tokens:
            break
        votes = [tokens.count(t) for t in tokens]
        top = max(votes)
        pick = tokens[votes.index(top)]
        if top < min_prob * first:  # (exact: min_prob * first in float64, as the lookup compares)
            break
        out.append(pick)
        alive = [p + 1 for p, t in zip(alive, tokens) if t == pick]
    return out


def _longest(source: list[int], context: list[int], depth: int, own: bool, num_occ: int,
             num_cand: int) -> tuple[int, list[int]]:
    """The longest suffix of context (<= depth tokens) ending at one of the num_occ most recent
    occurrences e of its last token in source that have a token after them (own: e before the
    context's last token) -> (its length, the num_cand most recent e it ends at)."""
    occ = [e for e in range(len(source) - 1) if source[e] == context[-1] and source[e + 1] != SEPARATOR]
    occ = sorted(occ, reverse=True)[:num_occ]

    def run(e):
        n = 0
        while n < depth and e - n >= 0 and n < len(context) and source[e - n] == context[-1 - n]:
            n += 1
        return n
    best = max((run(e) for e in occ), default=0)
    return best, [e for e in occ if run(e) == best][:num_cand] if best else []


def suffix_ref(context, corpus, depth, k, factor, min_prob, max_model_len, num_occ=NUM_OCCURRENCES,
               num_cand=NUM_CANDIDATES) -> list[int]:
    def propose(source, own):
        n, ends = _longest(source, context, depth, own, num_occ, num_cand)
        return n, (_walk_ref(source, ends, k, max(1, int(n * factor)), min_prob) if n else [])
    own_n, drafts = propose(context, True)
    if corpus is not None:  # the corpus proposes where its match is longer, or the own tokens propose nothing
        c_n, c_drafts = propose(corpus, False)
        if c_drafts and (c_n > own_n or not drafts):
            drafts = c_drafts
    return drafts[:max(0, max_model_len - len(context))]


@pytest.mark.parametrize("vocab", [2, 3, 6, 40])
def test_lookup_matches_the_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        b = 1 + trial % 4
        lens = torch.randint(1, 40, (b,), generator=g)
        width = int(lens.max()) + int(torch.randint(0, 4, (1,), generator=g))
        tokens = torch.randint(0, vocab, (b, width), generator=g)
        corpus = None
        if trial % 3:
            corpus = torch.randint(0, vocab, (50,), generator=g)
            corpus[torch.randint(0, 50, (6,), generator=g)] = SEPARATOR
        depth, k = 1 + trial % 5, 1 + trial % 7
        factor = (0.5, 1.0, 2.5)[trial % 3]
        min_prob = (0.0, 0.1, 0.4, 0.3, 0.6)[trial % 5]  # 0.3 and 0.6: products that float32 rounds up
        max_model_len = 45 if trial % 5 else int(lens.max()) + 1
        num_occ, num_cand = ((NUM_OCCURRENCES, NUM_CANDIDATES), (3, 2), (6, 1))[trial % 3]
        drafts, counts = suffix_drafts(tokens, lens, corpus, depth, k, factor, min_prob, max_model_len, num_occ,
                                       num_cand)
        for r in range(b):
            want = suffix_ref(tokens[r, : lens[r]].tolist(), None if corpus is None else corpus.tolist(), depth, k,
                              factor, min_prob, max_model_len, num_occ, num_cand)
            assert drafts[r, : counts[r]].tolist() == want, (trial, r)


def _drafts(context, corpus=None, k=4, factor=1.0, min_prob=0.1, depth=24):
    d, c = suffix_drafts(torch.tensor([context]), torch.tensor([len(context)]),
                         None if corpus is None else torch.tensor(corpus), depth, k, factor, min_prob, 1000)
    return d[0, : c[0]].tolist()


def test_lookup_examples():
    assert _drafts([1, 2, 3, 4, 9, 1, 2]) == [3, 4]  # a 2-token match drafts 2 (max_spec_factor 1)
    assert _drafts([1, 2, 3, 4, 9, 1, 2], factor=2.0) == [3, 4, 9, 1]  # ... or 4, into the suffix itself
    assert _drafts([5, 6, 1, 5, 7, 2, 5, 6, 3, 5], k=1) == [6]  # the most frequent continuation
    assert _drafts([5, 6, 5, 7, 5, 8, 5, 9, 5], k=2, min_prob=0.3) == []  # none likely enough
    corpus = [SEPARATOR, 9, 1, 2, 3, 4, 5, 6, SEPARATOR]
    assert _drafts([1, 2, 3], corpus) == [4, 5, 6]  # the corpus matches 3 tokens, the context none
    assert _drafts([1, 2, 3], corpus, depth=2) == [4, 5]
    assert _drafts([7, 1, 2, 3], [1, 2, 3, SEPARATOR]) == []  # nothing followed the match there
    assert _drafts([1, 2, 3, 1, 2, 3], [1, 2, 3, 8, SEPARATOR]) == [1, 2, 3]  # a tie goes to the request's own
    assert _drafts([4, 2, 3, 5, 1, 2, 3], [9, 1, 2, 3, SEPARATOR]) == [5, 1]  # a match with nothing after it is none
    # the own tokens' 2 occurrences of 5 disagree (share 0.5 < 0.6): the corpus's shorter match proposes
    assert _drafts([5, 6, 5, 7, 5], [5, 8, 9, SEPARATOR], min_prob=0.6) == [8]
    # exactly the threshold's share: 3 of 5 occurrences agree, 0.6 * 5 = 3 (float32 would read 3.0000001)
    assert _drafts([5, 1, 5, 1, 5, 1, 5, 2, 5, 3, 5], k=1, min_prob=0.6) == [1]


# ---------------------------------------------------------------- config
def test_config_defaults_and_errors():
    cfg = SpeculativeConfig.from_user({"method": "suffix", "num_speculative_tokens": 8}, 512)
    assert cfg.lookup and not cfg.ngram and cfg.model is None and cfg.verify_counts == tuple(range(1, 9))
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob,
            cfg.suffix_decoding_max_cached_requests) == (24, 1.0, 0.1, 10000)  # vLLM's defaults
    assert SpeculativeConfig.from_user({"model": "suffix", "num_speculative_tokens": 2}, 512).method == "suffix"
    with pytest.raises(ConfigError, match="num_speculative_tokens is required .*; vLLM's default for suffix lookup"):
        SpeculativeConfig.from_user({"method": "suffix"}, 512)
    bad = [
        ({"model": "/some/draft"}, "model='/some/draft' is not used by method='suffix'"),
        ({"prompt_lookup_max": 3}, "prompt_lookup_max sets n-gram lookup"),
        ({"suffix_decoding_max_tree_depth": 0}, r"suffix_decoding_max_tree_depth=0 must be an integer in \[1, 256\]"),
        ({"suffix_decoding_max_tree_depth": 1000}, "suffix_decoding_max_tree_depth=1000 must be"),
        ({"suffix_decoding_corpus_tokens": 1 << 30}, "suffix_decoding_corpus_tokens=1073741824 must be"),
        ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor=0 must be a number > 0"),
        ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob=1.5 must be a probability"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests=-1"),
        ({"suffix_decoding_corpus_tokens": 1}, "suffix_decoding_corpus_tokens=1"),
        ({"draft_sample_method": "probabilistic"}, "draft_sample_method"),
        ({"num_speculative_tokens_per_batch_size": "auto"}, "method='suffix' has none"),
        ({"quantization": "fp8"}, "quantization='fp8' configures a draft model"),
    ]
    for extra, words in bad:
        with pytest.raises(ConfigError, match=words):
            SpeculativeConfig.from_user({"method": "suffix", "num_speculative_tokens": 2, **extra}, 512)
    with pytest.raises(ConfigError, match="suffix_decoding_max_tree_depth=3 sets suffix decoding: pass method='suffix'"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2,
                                     "suffix_decoding_max_tree_depth": 3}, 512)
    with pytest.raises(ConfigError, match="which method='draft_model' does not use"):
        SpeculativeConfig.from_user({"model": "/x", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": .2},
                                    512)


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_spec_models(tmp_path_factory.mktemp("suffix"))


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist()} for n in (4, 19, 64, 7)]


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _llm(models, k=8, **kw):
    spec = {"method": "suffix", "num_speculative_tokens": k, **kw.pop("spec_extra", {})} if k else None
    kw.setdefault("max_model_len", MAX_LEN)
    return LLM(str(models["target"]), dtype="float32", block_size=8, speculative_config=spec, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def target_only(models):
    return _llm(models, k=0)


def test_a_response_seen_before_is_drafted_from_the_corpus(models, target_only):
    """The same prompts again: their earlier responses, in the corpus, propose the continuations
    (most drafts stand); with suffix_decoding_max_cached_requests=0 only the request's own tokens
    propose (the random model hardly repeats itself)."""
    prompts = _prompts()
    want = _tokens(target_only.generate(prompts, GREEDY, use_tqdm=False))
    for kept, expect_rate in ((10000, 0.9), (0, None)):
        llm = _llm(models, spec_extra={"suffix_decoding_max_cached_requests": kept})
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
        first = llm.engine.spec_metrics.num_accepted_tokens
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert _tokens(outs) == want
        accepted = sum(o.metrics.num_accepted_tokens for o in outs)
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        if expect_rate is None:
            assert accepted == first == 0
        else:
            assert accepted / drafted > expect_rate and accepted > 0.6 * sum(len(t) for t in want)


def test_seeded_sampled_output_is_target_only(models, target_only):
    """Lookup drafts are verified by coupling: at temperature > 0 the seeded tokens are target-only's,
    with the corpus proposing on the second pass, and under async scheduling."""
    prompts = _prompts()
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.1) for s in range(len(prompts))]
    want = _tokens(target_only.generate(prompts, params, use_tqdm=False))
    for llm in (_llm(models, k=5), _llm(models, k=3, async_scheduling=True)):
        for _ in range(2):
            assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
        assert llm.engine.spec_metrics.num_accepted_tokens > 0


def test_the_corpus_keeps_whole_finished_responses_oldest_out(models):
    """Only responses that ended ("stop" or "length"; not aborted ones) enter the corpus, each
    followed by a separator; the oldest go first, whole, when the count or the room runs out."""
    llm = _llm(models, spec_extra={"suffix_decoding_max_cached_requests": 3, "suffix_decoding_corpus_tokens": 64})
    speculator = llm.engine.runner.speculator
    prompts = _prompts()

    def run(n):
        return _tokens(llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                    use_tqdm=False))[0]

    def kept() -> list[list[int]]:
        corpus = speculator.corpus.tolist()
        for start, n in speculator.responses:
            assert corpus[start + n] == SEPARATOR
        return [corpus[start:start + n] for start, n in speculator.responses]

    # A response enters with the plan after its end (StepPlan.finished_outputs): the next request's.
    outs = [run(n) for n in (10, 20, 30)]
    assert kept() == outs[:2]
    outs.append(run(5))
    assert kept() == outs[:3]  # 11 + 21 + 31 = 63 of 64 entries
    outs.append(run(7))  # no room after the last: the ring starts over, and the first response goes
    assert kept() == outs[1:4] and speculator.responses[-1][0] == 0
    outs.append(run(3))  # where it goes lay the oldest: it goes
    assert kept() == outs[2:5]
    assert sum(t != SEPARATOR for t in speculator.corpus.tolist()) == sum(map(len, outs[2:5]))
    engine = llm.engine
    engine.add_request("gone", prompts[1]["prompt_token_ids"], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        engine.step()
    outs.append(run(4))
    assert kept() == outs[3:6]  # three kept (the count), the aborted one not among them


def test_preemption_keeps_the_output(models, target_only):
    """A pool too small for the batch: preempted requests recompute, and their partial outputs
    stay out of the corpus until they end."""
    prompts = _prompts()
    want = _tokens(target_only.generate(prompts, GREEDY, use_tqdm=False))
    small = _llm(models, num_gpu_blocks_override=16, max_num_seqs=4, max_model_len=128)
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want and sum(o.metrics.num_preemptions for o in outs) > 0
    kept = [n for _, n in small.engine.runner.speculator.responses]  # (those that ended in the last step come next plan)
    assert kept and kept == [40] * len(kept)  # whole responses only


def test_a_response_that_ends_before_a_plan_that_runs_nothing_enters(models):
    """A response that ended before a plan that runs nothing (here: the only other request aborted
    in between) enters the corpus with that plan (ModelRunner.release), as its slot is freed."""
    llm = _llm(models)
    engine, speculator = llm.engine, llm.engine.runner.speculator
    prompts = _prompts()
    engine.add_request("short", prompts[0]["prompt_token_ids"], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("long", prompts[1]["prompt_token_ids"], SamplingParams(max_tokens=30, ignore_eos=True))
    done = {}
    while "short" not in done:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.abort_request("long")
    assert not speculator.responses
    engine.step()  # nothing to run
    (start, n), = speculator.responses
    assert speculator.corpus[start:start + n].tolist() == done["short"].outputs[0].token_ids


def test_a_stop_string_ends_the_kept_response_where_the_text_ends(models):
    """A stop string found part-way through a step's tokens: the corpus keeps the tokens up to it
    (those the response has), not the rest of the step's."""
    llm = _llm(models, k=6)
    speculator, tokenizer = llm.engine.runner.speculator, llm.get_tokenizer()
    prompt = _prompts()[2]
    full = _tokens(llm.generate(prompt, GREEDY, use_tqdm=False))[0]  # the corpus learns it: later rounds accept runs
    texts = [tokenizer.decode([t]) for t in full]
    cut = next(i for i in range(12, len(full)) if texts[i].strip() and texts.count(texts[i]) == 1
               and texts[i] not in "".join(texts[:i]))
    out = llm.generate(prompt, GREEDY.clone(stop=[texts[cut]]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == full[:cut + 1]
    llm.generate(prompt, GREEDY.clone(max_tokens=1), use_tqdm=False)  # a plan after its end
    start, n = speculator.responses[-1]
    assert speculator.corpus[start:start + n].tolist() == full[:cut + 1]
