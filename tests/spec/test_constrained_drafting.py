"""Grammar-aware drafting: the drafts of a structured-output request are proposed under its
constraint (the draft logits masked with the grammar after the step's tokens and the drafts
before), so they keep to it, the target accepts more of them, and the output is still the
target's: token for token when greedy, in distribution when sampled."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.engine.grammar import DraftMasks
from tests.helpers import make_spec_models
from tests.stats import ALPHA, chisq_counts_pvalue

REGEX = r"[0-9]{2,4}-(yes|no)"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
CONSTRAINTS = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=["apple pie", "banana", "fox"]),
               StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
               StructuredOutputsParams(grammar='start: "def " NAME "(" NAME? "):"\nNAME: /[a-z]{1,6}/')]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The speculation trio, and "digits": the target whose LM head scores the ten digits alone,
    three times as sharply (its free drafts are mostly digits, drawn from another distribution)."""
    root = tmp_path_factory.mktemp("cd")
    models = make_spec_models(root)
    digits = root / "digits"
    shutil.copytree(models["target"], digits)
    weights = load_file(str(digits / "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(str(digits))
    ids = torch.tensor([tok.convert_tokens_to_ids(str(d)) for d in range(10)])
    head = torch.zeros_like(weights["lm_head.weight"])
    head[ids] = 3 * weights["lm_head.weight"][ids]
    weights["lm_head.weight"] = head
    save_file(weights, str(digits / "model.safetensors"), metadata={"format": "pt"})
    return {**models, "digits": digits}


def _llm(models, draft=None, k=3, method="greedy", spec_extra=None, **kw):
    spec = dict(model=str(models[draft]), num_speculative_tokens=k, draft_sample_method=method,
                **(spec_extra or {})) if draft else None
    return LLM(str(models["target"]), dtype="float32", block_size=8, max_model_len=256, speculative_config=spec, **kw)


def _generate(llm, temperature=0.0, **kw):
    prompts = [{"prompt_token_ids": [5 + j, 40, 41 + 2 * j, 7]} for j in range(len(CONSTRAINTS))]
    params = [SamplingParams(temperature=temperature, seed=j, max_tokens=60, structured_outputs=so, **kw)
              for j, so in enumerate(CONSTRAINTS)]
    return llm.generate(prompts, params, use_tqdm=False)


def _watch_drafts(llm) -> list[bool]:
    """Record, for every draft list that reaches the host, whether it keeps to its constraint
    after the tokens emitted so far (a complete output drafts EOS first)."""
    grammars, seen = llm.engine.grammars, []
    real = grammars.set_drafts

    def set_drafts(req_id, drafts):
        matcher = grammars.matchers.get(req_id)
        if matcher is not None and drafts:
            if matcher.is_stopped():
                seen.append(drafts[0] in grammars.eos_token_ids)
            else:
                n = matcher.validate_tokens(drafts)
                seen.append(n == len(drafts) or drafts[n - 1] in grammars.eos_token_ids)
        real(req_id, drafts)

    grammars.set_drafts = set_drafts
    return seen


@pytest.fixture(scope="module")
def greedy_ref(models):
    return [o.outputs[0].token_ids for o in _generate(_llm(models))]


@pytest.mark.parametrize("way", ["round", "repair", "auto"])
@pytest.mark.parametrize("draft,method", [("near", "greedy"), ("other", "greedy"), ("near", "probabilistic")])
def test_drafts_keep_to_the_constraint(models, greedy_ref, draft, method, way):
    """Every draft keeps to its constraint and greedy output equals target-only output, whether
    each draft is masked before it is drawn ("round", a CPU's way) or the misfits are drawn again
    ("repair", a GPU's way); the same engine with the drafts proposed free of the grammar (as
    vLLM) drafts tokens the constraint rejects, and the target accepts fewer of its drafts."""
    rates, kept = {}, {}
    for aware in (way, None):
        llm = _llm(models, draft, method=method)
        llm.engine.grammar_drafting = aware
        seen = _watch_drafts(llm)
        outs = _generate(llm)
        assert [o.outputs[0].token_ids for o in outs] == greedy_ref
        accepted = sum(o.metrics.num_accepted_tokens for o in outs)
        rates[aware] = accepted / sum(o.metrics.num_draft_tokens for o in outs)
        kept[aware] = seen
    assert kept[way] and all(kept[way])
    assert not all(kept[None])
    assert rates[way] > max(0.2, 2 * rates[None]), rates


@pytest.mark.parametrize("processors", [{}, {"min_tokens": 12, "repetition_penalty": 1.3}])
def test_both_ways_draft_the_same(models, monkeypatch, processors):
    """"round" and "repair" propose the same drafts (greedy: the argmax among the tokens that fit;
    sampled: the same keyed draw among them), so a seeded sampled run gives the same output; with
    logits processors too, which shape the drafts both ways alike. (The
    drafts of a request its step finished are not compared: "round" drew them under its completed
    grammar, EOS alone, and "repair" leaves them, as nothing of them is verified.)"""
    outs = {}
    for way in ("round", "repair"):
        proposed = []
        llm = _llm(models, "near", method="probabilistic")
        llm.engine.grammar_drafting = way
        grammars = llm.engine.grammars
        real = grammars.set_drafts
        grammars.set_drafts = lambda req_id, drafts, _real=real, _g=grammars: (
            proposed.append(list(drafts)) if req_id in _g.matchers else None, _real(req_id, drafts))
        outs[way] = ([o.outputs[0].token_ids for o in _generate(llm, temperature=0.8, top_p=0.9, top_k=40,
                                                                **processors)], proposed)
    assert outs["round"] == outs["repair"]
    assert len(outs["round"][1]) > 10


def test_draft_masks_follow_the_tokens_and_roll_back(models):
    llm = _llm(models)
    grammars, tok = llm.engine.grammars, llm.engine.tokenizer
    matcher = grammars.compile(StructuredOutputsParams(regex=REGEX))
    grammars.add(0, matcher)
    masks = DraftMasks([0], [matcher], grammars.num_words, grammars._executor, grammars._eos_row())

    def allowed(rows):
        return [t for t in range(grammars.vocab_size) if (int(rows[0, t // 32]) >> (t % 32)) & 1]

    digits = sorted(tok.convert_tokens_to_ids(str(d)) for d in range(10))
    one, two, x, dash = (tok.convert_tokens_to_ids(c) for c in ("1", "2", "x", "-"))
    masks.advance(0, [one])
    assert allowed(masks.rows()) == digits  # after one digit: a second
    masks.advance(0, [two])
    assert dash in allowed(masks.rows()) and one in allowed(masks.rows([0]))
    masks.advance(0, [x])  # does not consume: open from here
    assert allowed(masks.rows()) == list(range(grammars.vocab_size))
    masks.finish()
    assert allowed(DraftMasks([0], [matcher], grammars.num_words, grammars._executor, grammars._eos_row()).rows()) \
        == digits
    assert matcher.validate_tokens([one, two, dash]) == 3  # rolled back to the start of the output
    assert grammars.misfits({0: [one, two, x, dash]}) == {0: 2}
    assert grammars.misfits({0: [one, two, dash]}) == {}
    # The next step verifies fitting drafts with the rows misfits computed, while the matcher stays.
    from tandem.plan import ScheduledReq, StepPlan

    grammars.set_drafts(0, [one, two, dash])
    plan = StepPlan([], [ScheduledReq(0, 0, 10, [5], 2, [0, 1], True, 1, 3)])
    assert 0 in grammars._fitting_rows
    kept = grammars.bitmask(plan).bitmask
    grammars._fitting_rows.clear()
    assert (grammars.bitmask(plan).bitmask == kept).all() and kept.shape[0] == 3
    grammars.misfits({0: [one, two, dash]})
    grammars.accept(0, [one])
    assert 0 not in grammars._fitting_rows


def test_a_draft_the_target_row_forbids_is_a_misfit(models):
    """A matcher follows any tokens that spell the language's bytes, but the row of forced text
    allows one tokenization of it: after "jumps" of the choice "jumps over", " o" and not " "
    (which the matcher would follow with "o", "ve", "r"). The target verifies a draft with that
    row, so " " is a misfit and is drawn again; kept as it fits the bytes, a sampled draft would
    be verified against a draft distribution it was not drawn from and emit a token the choice
    forbids. 2,000 sampled requests, repaired free rounds: every output is one of the choices."""
    choices = ["The quick brown fox", "jumps over", "the lazy dog", "def fib(n)", "return n", "Paris is", "capital"]
    llm = _llm(models, "near", method="probabilistic", max_num_seqs=256)
    llm.engine.grammar_drafting = "repair"
    grammars, tok = llm.engine.grammars, llm.engine.tokenizer
    matcher = grammars.compile(StructuredOutputsParams(choice=choices))
    grammars.add(0, matcher)
    assert matcher.consume_tokens(tok.encode("jumps"))
    space, o, ve, r = tok.convert_tokens_to_ids(["Ġ", "o", "ve", "r"])
    assert matcher.validate_tokens([space, o, ve, r]) == 4  # the bytes fit
    assert grammars.misfits({0: [space, o, ve]}) == {0: 0}
    grammars.remove(0)
    n = 2000
    params = [SamplingParams(temperature=1.3, seed=s, max_tokens=30, structured_outputs=StructuredOutputsParams(
        choice=choices)) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": [5, 40, 41, 7]}] * n, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs if o.outputs[0].text not in choices] == []
    assert sum(o.metrics.num_accepted_tokens for o in outs) > n


def test_auto_masks_the_rounds_of_requests_that_often_miss(models):
    """"auto": a request whose free rounds leave its grammar in a quarter of them or more has its
    rounds masked; masked rounds fade the estimate until a free round measures again."""
    from tandem.engine.grammar import MISFIT_FADE, ROUND_ABOVE
    from tandem.plan import ScheduledReq, StepPlan

    llm = _llm(models)
    grammars, tok = llm.engine.grammars, llm.engine.tokenizer
    grammars.add(0, grammars.compile(StructuredOutputsParams(regex=REGEX)))
    plan = StepPlan([], [ScheduledReq(0, 0, 10, [5], 0, [0, 1], True, 1, 3)])
    assert plan.reqs[0].num_next_drafts == 3 and not grammars.prefers_masking(plan)
    one, x = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("x")
    grammars.misfits({0: [one, one, one]})
    assert not grammars.prefers_masking(plan)
    grammars.misfits({0: [x, one, one]})
    rate = grammars.misfit_rate[0]
    assert rate >= ROUND_ABOVE and grammars.prefers_masking(plan)
    fades = 0
    while grammars.prefers_masking(plan):
        grammars.masked_rounds([0])
        fades += 1
    assert grammars.misfit_rate[0] == pytest.approx(rate * MISFIT_FADE ** fades) and fades >= 1
    grammars.remove(0)
    assert 0 not in grammars.misfit_rate


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """softmax of rows [n, m] (float64) cut to top-p as the sampler cuts (a token stays while the mass
    strictly above it is < top_p), renormalised."""
    probs = logits.softmax(-1)
    srt = probs.sort(-1, descending=True).values
    above = srt.cumsum(-1) - srt
    cut = srt.masked_fill(above >= top_p, float("inf")).min(-1, keepdim=True).values
    probs = probs.masked_fill(probs < cut, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _exact_two_digits(models, prompt, allowed_ids, top_p):
    """The target's joint distribution of two tokens among allowed_ids after prompt, at temperature 1
    and top_p over the tokens the grammar allows (transformers on the same weights) ->
    [len(allowed_ids) ** 2]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(models["target"]), torch_dtype=torch.float32).eval()
    ids = torch.tensor(allowed_ids)
    with torch.no_grad():
        first = _nucleus(hf(torch.tensor([prompt])).logits[0, -1, ids].double()[None], top_p)[0]
        batch = torch.tensor([prompt + [t] for t in allowed_ids])
        second = _nucleus(hf(batch).logits[:, -1][:, ids].double(), top_p)
    return (first[:, None] * second).flatten().numpy()


@pytest.mark.parametrize("way", ["round", "repair"])
def test_processors_and_a_grammar_that_leave_only_a_stop(models, way):
    """A sampled request whose processors and grammar together allow nothing but EOS after two
    digits (allowed_token_ids without the grammar's "-": EOS ends it; min_tokens past a complete
    grammar: EOS until min_tokens), as the target alone gives, and so does speculation with the
    draft under the same processors (the draft row they empty falls back to its unprocessed
    logits, in the round and when repaired: a draw from an empty row would give q no mass and emit
    token 0)."""
    tok = AutoTokenizer.from_pretrained(str(models["digits"]))
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    n = 24
    cases = [(dict(structured_outputs=StructuredOutputsParams(regex="[0-9]{2}-"), allowed_token_ids=digits + [1]), 3),
             (dict(structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"), min_tokens=10), 10)]
    spec = dict(model=str(models["digits"]), num_speculative_tokens=3, draft_sample_method="probabilistic")
    llm = LLM(str(models["digits"]), dtype="float32", block_size=8, max_model_len=128, speculative_config=spec)
    llm.engine.grammar_drafting = way
    for case, length in cases:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, **case) for s in range(n)]
        outs = llm.generate([{"prompt_token_ids": [5, 40, 41, 7]}] * n, params, use_tqdm=False)
        for o in outs:
            t = o.outputs[0].token_ids
            assert len(t) == length and t[0] in digits and t[1] in digits and set(t[2:]) == {1}, t
            assert o.outputs[0].finish_reason == "stop"
        assert sum(o.metrics.num_draft_tokens for o in outs) > n


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampled_output_keeps_the_target_distribution(models, top_p, tmp_path):
    """regex [0-9]{2} at temperature 1: the two digits drawn through speculation with sampled drafts
    under the grammar (an unrelated draft, so most drafts are rejected and resampled; a draft whose
    free drafts mostly fit, so most are not repaired and their probabilities are the draft's own
    restricted to the digits), masked in the round or repaired, follow the target's exact
    distribution: its logits masked to the digits, then cut to top_p (chi-square, 2,000 seeds each).
    Also with a pruned draft head (draft_token_map) that scores no digit, or half of them: where
    the grammar allows no hot id, the draft draws uniformly among the ids it allows; and with
    block verification."""
    prompt = [5, 40, 41, 7]
    llm = _llm(models)
    tok = llm.engine.tokenizer
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    probs = _exact_two_digits(models, prompt, digits, top_p)
    n = 2000
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s, max_tokens=4,
                             structured_outputs=StructuredOutputsParams(regex="[0-9]{2}")) for s in range(n)]
    maps = {}
    for name, drop in (("no_digits", digits), ("half_digits", digits[::2])):
        maps[name] = tmp_path / f"{name}.json"
        maps[name].write_text(json.dumps([t for t in range(320) if t not in drop]))
    runs = [(None, 0, None, None), ("other", 3, "round", None), ("other", 3, "repair", None),
            ("digits", 2, "repair", None), ("near", 2, "round", "no_digits"), ("near", 2, "repair", "half_digits"),
            ("digits", 2, "round", "block")]  # block verification, its q restricted to the grammar too
    for draft, k, way, hot in runs:
        extra = None
        if hot == "block":
            extra = {"rejection_sample_method": "block"}
        elif hot:
            extra = {"draft_token_map": str(maps[hot])}
        engine = llm if draft is None else _llm(models, draft, k=k, method="probabilistic", max_num_seqs=256,
                                                spec_extra=extra)
        engine.engine.grammar_drafting = way
        outs = engine.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        counts = np.zeros(100)
        for o in outs:
            t = o.outputs[0].token_ids
            assert len(t) == 3 and t[2] in engine.engine.grammars.eos_token_ids, t
            counts[digits.index(t[0]) * 10 + digits.index(t[1])] += 1
        assert chisq_counts_pvalue(counts, probs) > ALPHA, (draft, way, hot)
        if draft is not None:
            assert sum(o.metrics.num_draft_tokens for o in outs) > n  # the second digit came through verification
