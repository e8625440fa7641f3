"""Structured outputs (a JSON schema, a regex, a choice, a grammar): every output keeps to its
constraint, with or without a draft model, and speculative output equals target-only output."""
import json
import re

import pytest
import torch

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.engine.grammar import grammar_text
from tandem.models.decoder import KVCache
from tandem.config import read_arch_config
from tandem.errors import RequestError
from tests.helpers import make_spec_models

MAX_LEN = 256
REGEX = r"[0-9]{2,4}-(yes|no)"
CHOICES = ["apple pie", "banana", "fox"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["red", "green"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
LARK = 'start: "def " NAME "(" NAME? "):"\nNAME: /[a-z]{1,6}/'
GBNF = 'root ::= "Paris" | "France" | "fox" [0-9]'


def _constraints():
    return {
        "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
        "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
        "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), _fits_schema),
        # (JSON's default free whitespace lets a random model pad without end: compact here)
        "json-text": (StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True), _fits_schema),
        "lark": (StructuredOutputsParams(grammar=LARK), lambda t: re.fullmatch(r"def [a-z]{1,6}\(([a-z]{1,6})?\):", t)),
        "gbnf": (StructuredOutputsParams(grammar=GBNF), lambda t: re.fullmatch(r"Paris|France|fox[0-9]", t)),
    }


def _fits_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
            and value["tag"] in ("red", "green"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_spec_models(tmp_path_factory.mktemp("so"))


def _llm(models, draft=None, k=3, method="greedy", **kw):
    spec = None
    if draft is not None:
        spec = dict(model=str(models[draft]), num_speculative_tokens=k, draft_sample_method=method)
    kw.setdefault("max_model_len", MAX_LEN)
    return LLM(str(models["target"]), dtype="float32", block_size=8, speculative_config=spec, **kw)


def _requests(temperature: float, n: int = 1):
    names, prompts, params = [], [], []
    for j, (name, (so, _)) in enumerate(_constraints().items()):
        names.append(name)
        prompts.append({"prompt_token_ids": [5 + j, 40, 41 + 2 * j, 7]})
        params.append(SamplingParams(temperature=temperature, seed=j, n=n, max_tokens=60, structured_outputs=so))
    return names, prompts, params


def _check(names, outs):
    checks = _constraints()
    for name, out in zip(names, outs):
        for seq in out.outputs:
            assert seq.finish_reason == "stop", (name, seq)  # the constraint ends in EOS, well before max_tokens
            assert checks[name][1](seq.text), (name, seq.text)


def _tokens(outs):
    return [[s.token_ids for s in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def target_only(models):
    llm = _llm(models)
    names, prompts, params = _requests(0.0)
    greedy = llm.generate(prompts, params, use_tqdm=False)
    names_s, prompts_s, params_s = _requests(1.0, n=2)
    sampled = llm.generate(prompts_s, params_s, use_tqdm=False)
    return names, _tokens(greedy), _tokens(sampled), greedy, sampled


def test_outputs_keep_to_their_constraint(target_only):
    names, _, _, greedy, sampled = target_only
    _check(names, greedy)
    _check(names, sampled)
    # Without the constraint the random model writes something else.
    assert not re.fullmatch(REGEX, greedy[0].outputs[0].text + "x")


@pytest.mark.parametrize("draft,method", [("target", "greedy"), ("near", "greedy"), ("other", "probabilistic"),
                                          ("target", "probabilistic")])
def test_speculative_output_equals_target_only(models, target_only, draft, method):
    """Drafts are verified against the constraint: greedy output is target-only output, token for
    token, and sampled output keeps to the constraint."""
    names, greedy_ref, _, _, _ = target_only
    llm = _llm(models, draft, method=method)
    names, prompts, params = _requests(0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == greedy_ref
    if draft == "target":  # the draft proposes what the unconstrained target would: accepted where allowed
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    names_s, prompts_s, params_s = _requests(1.0, n=2)
    _check(names_s, llm.generate(prompts_s, params_s, use_tqdm=False))


def test_constrained_beside_unconstrained_requests(models, target_only):
    """A constrained request does not change its neighbours' output, nor they its."""
    names, greedy_ref, _, _, _ = target_only
    free = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 2
    free_prompts = [{"prompt_token_ids": [9, 10, 11]}, {"prompt_token_ids": [12, 13]}]
    alone = _llm(models, "near").generate(free_prompts, free, use_tqdm=False)
    _, prompts, params = _requests(0.0)
    mixed = _llm(models, "near").generate(free_prompts + prompts, free + params, use_tqdm=False)
    assert _tokens(mixed[:2]) == _tokens(alone)
    assert _tokens(mixed[2:]) == greedy_ref


@pytest.mark.parametrize("way", ["round", "auto"])
def test_async_scheduling_and_preemption_keep_the_constraint(models, target_only, way):
    """Also with n = 2 sequences a prompt, and whichever way the drafts meet the grammar (masked in
    the round, a CPU's way; "auto", a GPU's: free rounds whose misfits are drawn again)."""
    names, greedy_ref, _, _, _ = target_only
    _, prompts, params = _requests(0.0)
    llm = _llm(models, async_scheduling=True)
    runner, calls = llm.engine.runner, {"forward": 0, "launch": 0}
    for name in calls:  # steps planned ahead run their forward first, their sampling once the masks are in
        def counted(*a, _real=getattr(runner, name), _name=name):
            calls[_name] += 1
            return _real(*a)
        setattr(runner, name, counted)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == greedy_ref
    assert calls["forward"] - calls["launch"] > 10, calls
    # A pool of 9 blocks of 8 tokens for 6 requests of up to 4 blocks preempts some mid-output.
    per_block = sum(KVCache.bytes_per_block(read_arch_config(models[m]), 8, torch.float32) for m in ("target", "near"))
    llm = _llm(models, "near", max_model_len=72, kv_cache_memory_bytes=per_block * 9)
    llm.engine.grammar_drafting = way
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == greedy_ref
    assert llm.engine.scheduler.num_preemptions > 0
    names_s, prompts_s, params_s = _requests(1.0, n=2)
    _check(names_s, llm.generate(prompts_s, params_s, use_tqdm=False))


def test_bad_constraints_are_refused_and_lose_nothing(models):
    llm = _llm(models)
    engine = llm.engine
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20,
                                                         structured_outputs=StructuredOutputsParams(regex=REGEX)))
    cases = [
        (StructuredOutputsParams(regex="[0-9"), "regex does not compile"),
        (StructuredOutputsParams(grammar="start: foo"), "grammar does not compile"),
        (StructuredOutputsParams(json="{not json"), "json is invalid"),
        (StructuredOutputsParams(json='{"a": ' + "[" * 5000 + "]" * 5000 + "}"), "json is invalid"),  # too deep
        (StructuredOutputsParams(json={"type": "strnig"}), "json does not compile"),
    ]
    for so, message in cases:
        with pytest.raises(RequestError, match=message):
            engine.add_request("bad", [5, 6], SamplingParams(temperature=0, structured_outputs=so))
    # LLM.generate checks every request before it adds any.
    good = SamplingParams(temperature=0, max_tokens=5)
    with pytest.raises(RequestError, match="regex does not compile"):
        llm.generate([{"prompt_token_ids": [5, 6]}] * 3,
                     [good, good, good.clone(structured_outputs=StructuredOutputsParams(regex="(a"))], use_tqdm=False)
    assert list(engine._requests) == ["good"]
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out.request_id == "good" and re.fullmatch(REGEX, out.outputs[0].text)


def test_the_first_constrained_step_imports_nothing(models):
    """llguidance.torch (~740 modules, torch.compile's among them: a 1-1.75 s stall of the whole batch
    when the first constrained step imported it) comes in with llguidance's tokenizer (built at a
    server's start, or by the first constrained request)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from transformers import AutoTokenizer\n"
        "from tandem.engine.grammar import Grammars\n"
        f"g = Grammars(AutoTokenizer.from_pretrained({str(models['target'])!r}), 320, (1,))\n"
        "assert 'llguidance.torch' not in sys.modules\n"
        "g.token_bytes()\n"
        "print('llguidance.torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_grammar_threads_started_at_once_each_get_the_deep_stack(monkeypatch):
    """The server's tokenizing threads and the engine loop's start grammar threads at once: each
    starts on the deep stack (one on the default 8 MB would die of a deep grammar) and the
    process's stack size setting is back to its default after (not left at 512 MB for every thread)."""
    import sys
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tandem.engine.grammar import GRAMMAR_STACK_BYTES, _on_grammar_stack

    seen = []
    start = threading.Thread.start

    def recording_start(thread):
        if thread.name == "tandem-grammar":
            seen.append(threading.stack_size())
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: the window between set and restore is hit
    try:
        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(lambda i: _on_grammar_stack(lambda: i), range(3000))) == list(range(3000))
    finally:
        sys.setswitchinterval(interval)
    assert threading.stack_size() == 0
    assert seen.count(GRAMMAR_STACK_BYTES) == len(seen) == 3000


def test_deep_grammars_compile_and_huge_ones_are_refused(models):
    """llguidance recurses once per nested rule or $ref: a chain of 5,000 (a 70 KB request) overflowed an
    8 MB thread stack and killed the process (SIGSEGV). It compiles now (on a deep stack), and a
    grammar past MAX_GRAMMAR_BYTES is refused by name before anything compiles it."""
    llm = _llm(models)
    n = 5000
    chain = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "7"'
    refs = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)} | {f"d{n}": {"enum": [7]}},
            "$ref": "#/$defs/d0"}
    for so in (StructuredOutputsParams(grammar=chain), StructuredOutputsParams(json=refs)):
        out = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(temperature=0, max_tokens=5,
                                                                          structured_outputs=so), use_tqdm=False)
        assert out[0].outputs[0].text == "7"
    from tandem.engine.grammar import MAX_GRAMMAR_BYTES, _told

    # an internal assertion of llguidance's (~70k alternatives) is told without its native backtrace
    assert _told("panic: assertion failed: symbols\n<backtrace>\n   0: f\n at /build/x.rs:1") == \
        "panic: assertion failed: symbols"
    huge = "start: " + " | ".join(f'"{i}"' for i in range(MAX_GRAMMAR_BYTES // 8))
    with pytest.raises(RequestError, match=r"StructuredOutputsParams.grammar is too large: .* at most 1048576"):
        llm.engine.add_request("huge", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(grammar=huge)))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("fields,message", [
    ({}, "no constraint"),
    ({"regex": "a", "choice": ["a"]}, "sets regex, choice"),
    ({"choice": []}, "non-empty list of strings"),
    ({"choice": ["a", 3]}, "non-empty list of strings"),
    ({"regex": ""}, "non-empty string"),
    ({"json": [1, 2]}, "JSON schema"),
    ({"json_object": "yes"}, "json_object"),
    ({"regex": "a", "disable_any_whitespace": 1}, "True or False"),
])
def test_params_are_checked(fields, message):
    with pytest.raises(RequestError, match=message):
        StructuredOutputsParams(**fields)


def test_params_from_a_dict():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(RequestError, match=r"no fields \['regexp'\]"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(RequestError, match="structured_outputs=3 is invalid"):
        SamplingParams(structured_outputs=3)


def test_clone_copies_the_constraint_it_keeps_only(monkeypatch):
    """SamplingParams.clone deep-copies the constraint (nothing shared, as vLLM's), but not one its changes
    replace (a huge schema copied to be dropped)."""
    p = SamplingParams(structured_outputs={"json": {"type": "object"}}, extra_args={"a": [1]})
    q = p.clone(max_tokens=3)
    assert q.structured_outputs == p.structured_outputs and q.structured_outputs is not p.structured_outputs
    assert q.extra_args == p.extra_args and q.extra_args is not p.extra_args
    import copy

    copied = []
    real = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda x, *a: copied.append(x) or real(x, *a))
    new = StructuredOutputsParams(regex="a+")
    r = p.clone(structured_outputs=new, extra_args=None)
    assert r.structured_outputs is new and r.extra_args is None and copied == []


def test_disable_additional_properties_closes_objects():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    closed = json.loads(grammar_text(StructuredOutputsParams(json=schema, disable_additional_properties=True)))
    opened = json.loads(grammar_text(StructuredOutputsParams(json=schema)))
    assert "additionalProperties" not in json.dumps(opened)
    assert json.dumps(closed).count('"additionalProperties": false') == 2
    assert "additionalProperties" not in json.dumps(schema)  # the caller's schema is left alone
    # As vLLM's: only schemas that name properties close; a free-form object and values stay as they are
    free = {"type": "object", "properties": {"meta": {"type": "object"}, "c": {"const": {"properties": {}}}}}
    closed = json.loads(grammar_text(StructuredOutputsParams(json=free, disable_additional_properties=True)))
    assert json.dumps(closed).count('"additionalProperties": false') == 1 and '"const": {"properties": {}}' in \
        json.dumps(closed)
    # property and definition names that are keywords elsewhere: the objects under them close too, and no
    # map of names gains an "additionalProperties" name (a property of that name stays allowed)
    def inner():
        return {"type": "object", "properties": {"a": {"type": "integer"}}}

    named = {"type": "object", "properties": {k: inner() for k in ("default", "enum", "const", "examples", "properties")},
             "$defs": {"default": inner()}}
    closed = json.loads(grammar_text(StructuredOutputsParams(json=named, disable_additional_properties=True)))
    closed = closed["grammars"][0]["json_schema"]
    assert all(closed["properties"][k]["additionalProperties"] is False for k in named["properties"])
    assert closed["$defs"]["default"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"] and "additionalProperties" not in closed["$defs"]
    any_object = StructuredOutputsParams(json_object=True, disable_additional_properties=True)
    assert grammar_text(any_object) == grammar_text(StructuredOutputsParams(json_object=True))
    assert StructuredOutputsParams(regex=" ").regex == " "  # a regex of one space is one


def test_a_choice_among_thousands_and_of_regex_characters(models):
    """A choice among thousands keeps to it (llguidance's Lark form of alternatives refused a row of
    more than 2000 items once the output started: one token, then EOS), with a draft too; choices
    that hold regex syntax are matched as written, nothing else; a JSON schema of thousands of
    branches keeps to it (grammar.MAX_ITEMS_IN_ROW)."""
    from tandem.engine.grammar import _regex_literal

    odd = ["a.b", "(x|y)*", "[1-2]{3}", "c\\d", "#&-~ ^$", "", "é+?"]
    for text in odd:
        assert re.fullmatch(_regex_literal(text), text)
    assert not re.fullmatch(_regex_literal("a.b"), "axb") and not re.fullmatch(_regex_literal("[1-2]{3}"), "111")
    many = [f"option {i}" for i in range(2500)]
    prompt = {"prompt_token_ids": [5, 40]}
    for draft in (None, "near"):
        llm = _llm(models, draft)
        for choices in (many, odd):
            so = StructuredOutputsParams(choice=choices)
            params = SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=40, structured_outputs=so)
            outs = llm.generate(prompt, params, use_tqdm=False)[0].outputs
            assert all(o.text in choices and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
            assert any(o.text for o in outs)
    # a schema of 3000 branches: a row of 3001 items (past llguidance's default 2000: EOS after "{")
    schema = {"anyOf": [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"],
                         "additionalProperties": False} for i in range(3000)]}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outs = llm.generate(prompt, SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=20, structured_outputs=so),
                        use_tqdm=False)[0].outputs
    assert all(o.finish_reason == "stop" and 0 <= json.loads(o.text)["k"] < 3000 for o in outs), [o.text for o in outs]


def test_synthetic_acceptance_refuses_constraints(models):
    llm = LLM(str(models["target"]), dtype="float32", block_size=8, max_model_len=MAX_LEN,
              speculative_config=dict(model=str(models["near"]), num_speculative_tokens=2,
                                      rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.5, 0.3]))
    with pytest.raises(RequestError, match="synthetic"):
        llm.generate([{"prompt_token_ids": [5, 6]}],
                     SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False)


def test_a_constraint_at_odds_with_min_tokens_harms_no_one(models):
    """min_tokens past the end of the language: the complete output allows only EOS, which
    min_tokens would hold back, leaving nothing to draw; min_tokens yields there (a row never
    empties), so the output goes on with EOS alone up to its min_tokens and stops, its text the
    constraint's, its neighbours untouched. allowed_token_ids without EOS empty the complete
    output's row too (no min_tokens to yield): it ends there with EOS, as where the grammar and
    allowed_token_ids share no token from the start; a grammar whose matcher fails (llguidance's
    item limit) ends at EOS. A speculative step that emits the completing token and the EOS after it
    together leaves the matcher as target-only steps do, so the outputs are the same token for token."""
    so = StructuredOutputsParams(choice=["fox", "Paris"])
    params = [SamplingParams(temperature=0, min_tokens=12, max_tokens=16, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX)),
              SamplingParams(temperature=0, max_tokens=10, structured_outputs=so,
                             allowed_token_ids=[294, 89, 66, 67, 0]),
              SamplingParams(temperature=0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(grammar='start: "a" start'))]
    prompts = [{"prompt_token_ids": [5, 40, 41, 7]}, {"prompt_token_ids": [7, 8]}, {"prompt_token_ids": [5, 40]},
               {"prompt_token_ids": [9, 9]}]
    params.append(SamplingParams(temperature=0.8, seed=1, max_tokens=10, structured_outputs=so,
                                 allowed_token_ids=[89, 66, 67, 0]))  # no token that starts "fox" or "Paris"
    prompts.append({"prompt_token_ids": [5, 41]})
    outs = {draft: _llm(models, draft, k=5).generate(prompts, params, use_tqdm=False) for draft in (None, "near")}
    assert _tokens(outs["near"]) == _tokens(outs[None])
    fox, regex, allowed, endless, disjoint = (o.outputs[0] for o in outs[None])
    assert fox.text == "fox" and len(fox.token_ids) == 12 and fox.finish_reason == "stop"
    eos = 1  # tests.helpers' </s>
    assert set(fox.token_ids[fox.token_ids.index(eos):]) == {eos}, fox.token_ids  # no token the grammar forbids
    assert re.fullmatch(REGEX, regex.text)
    assert (allowed.text, allowed.token_ids[-1], allowed.finish_reason) == ("fox", eos, "stop"), allowed
    assert (disjoint.text, disjoint.token_ids, disjoint.finish_reason) == ("", [eos], "stop"), disjoint
    assert endless.text == "a" and endless.finish_reason == "stop"


def test_bitmask_rows_follow_the_drafts(models):
    """The masks of a verification: row i comes after drafts 1..i; past a draft the constraint
    rejects, every token is allowed."""
    from tandem.engine.grammar import Grammars
    from tandem.plan import ScheduledReq, StepPlan

    llm = _llm(models)
    tok = llm.engine.tokenizer
    grammars = Grammars(tok, 320, (1,))
    grammars.add(0, grammars.compile(StructuredOutputsParams(regex=r"[0-9]{2,4}-(yes|no)")))
    ids = tok.encode("12x3", add_special_tokens=False)  # '1', '2' valid, 'x' not
    assert [tok.decode([t]) for t in ids] == ["1", "2", "x", "3"]
    grammars.drafts[0] = ids
    plan = StepPlan([], [ScheduledReq(0, 0, 10, [5], 4, [0, 1], True, 3, 4)])
    mask = grammars.bitmask(plan)
    bits = torch.from_numpy(mask.bitmask)
    allowed = [[t for t in range(320) if (int(bits[r, t // 32]) >> (t % 32)) & 1] for r in range(5)]
    digits = sorted(tok.convert_tokens_to_ids(str(d)) for d in range(10))
    assert mask.reqs == [0]
    assert allowed[0] == digits and allowed[1] == digits  # before '1', before '2'
    assert tok.convert_tokens_to_ids("-") in allowed[2] and ids[2] not in allowed[2]
    assert allowed[3] == allowed[4] == list(range(320))  # after the rejected 'x'
    # The matcher was rolled back: the next step's rows start from the same state.
    grammars.accept(0, ids[:2])
    grammars.drafts[0] = []
    plan = StepPlan([], [ScheduledReq(0, 0, 12, [5], 0, [0, 1], True, 5, 0)])
    bits = torch.from_numpy(grammars.bitmask(plan).bitmask)
    assert [t for t in range(320) if (int(bits[0, t // 32]) >> (t % 32)) & 1] == allowed[2]


ENDLESS = 'start: item+\nitem: "x" | "y" w\nw: "c" w'  # after "y" no output completes: "c" forever


def test_a_draft_llguidance_fails_on_leaves_the_matcher_and_rows_as_target_only_does(models):
    """llguidance gives up on the forced text of a rule with no end ("Too many items ...
    ff_tokens") after it follows a "c" past a row it computed, and then fails to roll back: the
    rows of a draft "y c" left the matcher in error (every later row EOS alone, the output cut short
    after a draft the target rejected) and its unfilled rows allowing every token. Now the rows
    it left are EOS alone, as an erring matcher's, and the matcher is rebuilt at the output so far."""
    from tandem.engine.grammar import Grammars
    from tandem.plan import ScheduledReq, StepPlan

    tok = _llm(models).engine.tokenizer
    x, y, c = (tok.convert_tokens_to_ids(t) for t in "xyc")
    grammars = Grammars(tok, 320, (1,))
    grammars.add(0, grammars.compile(StructuredOutputsParams(grammar=ENDLESS)))
    grammars.accept(0, [x])
    grammars.drafts[0] = [y, c, c]
    mask = grammars.bitmask(StepPlan([], [ScheduledReq(0, 0, 10, [5], 3, [0, 1], True, 3, 3)]))
    bits = torch.from_numpy(mask.bitmask)
    allowed = [[t for t in range(320) if (int(bits[r, t // 32]) >> (t % 32)) & 1] for r in range(4)]
    assert allowed[0] == sorted([1, x, y]) and allowed[1] == [c] and allowed[2] == allowed[3] == [1]
    assert grammars.matchers[0].is_error()  # the rollback failed ...
    grammars.drafts[0] = []
    bits = torch.from_numpy(grammars.bitmask(StepPlan([], [ScheduledReq(0, 0, 10, [5], 0, [0, 1], True, 3, 0)]))
                            .bitmask)
    assert not grammars.matchers[0].is_error()  # ... and the matcher was rebuilt after "x"
    assert grammars._history[0][1] == []  # the next rebuild starts from this one (replays what follows alone)
    assert [t for t in range(320) if (int(bits[0, t // 32]) >> (t % 32)) & 1] == sorted([1, x, y])


@pytest.mark.parametrize("spec", ["ngram", "suffix", "other"])
def test_speculation_over_a_grammar_llguidance_fails_on_equals_target_only(models, spec):
    """Drafts that walk into the endless branch (the prompt's "x y" makes the lookups propose "y"
    after "x"): whether the target rejects them (logit_bias bans "y") or writes "y" itself, the
    output is target-only's (it was cut two tokens in, or went on past where target-only ended)."""
    config = {"ngram": dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1),
              "suffix": dict(method="suffix", num_speculative_tokens=2),
              "other": dict(model=str(models["other"]), num_speculative_tokens=3)}[spec]
    base = _llm(models)
    tok = base.get_tokenizer()
    x, y = tok.convert_tokens_to_ids("x"), tok.convert_tokens_to_ids("y")
    prompts = [{"prompt_token_ids": [5, 40, x, y, x, y, x]}, {"prompt_token_ids": [9, x, y, x, y, x]}]
    constraint = StructuredOutputsParams(grammar=ENDLESS)
    params = [SamplingParams(temperature=0, max_tokens=12, logit_bias={y: -100.0}, structured_outputs=constraint),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs=constraint)]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(models["target"]), dtype="float32", block_size=8, max_model_len=MAX_LEN, speculative_config=config)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and len(want[0]) == 12


def test_ignore_eos_goes_on_with_eos_after_a_complete_output(models, caplog):
    """Under ignore_eos an output goes on past the EOS that completes its constraint, and only EOS
    may follow: without a draft, and with drafts that propose the completing EOS and more after it
    in one round (the draft being the target, or grammar-masked drafting); speculative output
    equals target-only output, and no matcher is ever given a token it refuses."""
    _, prompts, _ = _requests(0.0)
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, structured_outputs=so)
              for so, _ in _constraints().values()]
    checks = [check for _, check in _constraints().values()]
    eos = 1  # tests.helpers' </s>
    outs = {}
    for draft in (None, "target", "near"):
        outs[draft] = _llm(models, draft, k=4).generate(prompts, params, use_tqdm=False)
    for draft, got in outs.items():
        assert _tokens(got) == _tokens(outs[None]), draft
        for check, out in zip(checks, got):
            seq = out.outputs[0]
            first = seq.token_ids.index(eos)
            assert len(seq.token_ids) == 48 and set(seq.token_ids[first:]) == {eos}, (draft, seq.token_ids)
            assert check(seq.text), (draft, seq.text)
    assert "matcher failed" not in caplog.text


def test_a_constraint_may_spell_an_added_token_that_is_not_special(tmp_path):
    """Text a constraint forces that a non-special added token holds (Qwen2.5's <tool_call>, Qwen3's
    <think>) is written: llguidance, which takes every added token as special, allowed that token
    there and then refused it, so the output ended cut ("stop") short of the constraint. Where the
    text is not forced the token itself fits too; a special token's text still never matches it."""
    import numpy as np
    from transformers import AutoTokenizer

    from tandem.engine.grammar import Grammars
    from tests.helpers import save_tokenizer

    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.add_tokens(["<tool_call>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|sp|>"]})
    tag, sp = tok.convert_tokens_to_ids(["<tool_call>", "<|sp|>"])
    eos = tok.eos_token_id
    grammars = Grammars(tok, 320, (eos,))

    def forced_walk(regex: str) -> list[int]:
        """The tokens of the output when every step takes the lowest token its mask allows (not EOS)."""
        matcher, out = grammars.compile(StructuredOutputsParams(regex=regex)), []
        while not matcher.is_stopped() and len(out) < 40:
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            allowed = [t for t in range(320) if (int(mask[t // 32]) >> (t % 32)) & 1 and t != eos]
            if not allowed:
                break
            assert matcher.consume_tokens([allowed[0]]) and not matcher.is_error(), matcher.get_error()
            out.append(allowed[0])
        assert matcher.is_accepting()
        return out

    assert tok.decode(forced_walk("A<tool_call>\nB")) == "A<tool_call>\nB"
    assert tok.decode(forced_walk('\\{"t": "<tool_call>"\\}')) == '{"t": "<tool_call>"}'
    loose = grammars.compile(StructuredOutputsParams(regex="A(<tool_call>|<tool_x>)\nB"))
    ids = tok.encode("A<tool_call>\nB", add_special_tokens=False)
    assert tag in ids and loose.try_consume_tokens(ids) == len(ids) and not loose.is_error()
    strict = grammars.compile(StructuredOutputsParams(regex="A(<\\|sp\\|>|x)"))
    assert strict.try_consume_tokens(tok.encode("A<|sp|>", add_special_tokens=False)) == 1  # A, and not the token
    assert tok.decode(forced_walk("A<\\|sp\\|>B"), skip_special_tokens=False) == "A<|sp|>B"  # spelt in text
    assert grammars.special_tags({"<tool_call>": tag, "<|sp|>": sp}) == {"<|sp|>": sp}
    import llguidance.hf

    from tandem.engine.grammar import ll_tokenizer_of

    ours, theirs = ll_tokenizer_of(tok, 320, (eos,)), llguidance.hf.from_tokenizer(tok, n_vocab=320, eos_token=eos)
    assert [t for t in range(320) if ours.is_special_token(t) != theirs.is_special_token(t)] == [tag]  # else alike
    assert all(ours.decode_bytes([t]) == theirs.decode_bytes([t]) for t in range(len(tok)))


@pytest.mark.parametrize("prefix", ["normalizer", "metaspace"])
def test_forced_text_is_tokenized_as_llguidance_reads_it_on_a_sentencepiece_tokenizer(prefix):
    """A sentencepiece-style tokenizer (Llama 2's, Mistral's: a "▁" put before a text, by a Prepend
    normalizer or Metaspace's prepend_scheme) tokenizes forced text as llguidance's own reading does,
    without that "▁" (a first version put it there: the mask then allowed only "▁", which the matcher
    refused); special tokens' text is spelt out in ordinary tokens."""
    import numpy as np
    import llguidance.hf
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tandem.engine.grammar import _forced_text_tokenizer, ll_tokenizer_of
    from tests.helpers import TEXT

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    if prefix == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]))
    spec = json.loads(backend.to_str())  # the byte tokens as ordinary ones of the vocabulary, as Llama 2's
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>")
    eos, n = tok.eos_token_id, len(tok)
    theirs, forced = llguidance.hf.from_tokenizer(tok, n_vocab=n, eos_token=eos), _forced_text_tokenizer(tok)
    for text in ("fox jumps", " The quick\nbrown", "{\"key\": 1.5}", "é  x"):
        assert forced.encode(text, add_special_tokens=False).ids == theirs.tokenize_str(text)
    ours = ll_tokenizer_of(tok, n, (eos,))
    for regex, want in (("The quick brown fox", "The quick brown fox"), ('\\{"city": "(a|b)"\\}', '{"city": "a"}'),
                        ("x</s>y", "x</s>y")):
        matcher = llguidance.LLMatcher(ours, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0)
        out = []
        while not matcher.is_stopped() and len(out) < 60:
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            allowed = [t for t in range(n) if (int(mask[t // 32]) >> (t % 32)) & 1 and t != eos]
            if not allowed:
                break
            assert matcher.consume_tokens([allowed[0]]) and not matcher.is_error(), (regex, matcher.get_error())
            out.append(allowed[0])
        assert matcher.is_accepting() and tok.decode(out, skip_special_tokens=False) == want, (regex, out)
