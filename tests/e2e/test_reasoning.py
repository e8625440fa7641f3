"""Reasoning parsers (tandem/reasoning.py): where a reply starts, the split of thinking from answer,
whole or in pieces, and structured outputs that hold from the end of the thinking on (the grammar
gate, through the engine, with and without a draft model)."""
from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.reasoning import REASONING_PARSERS, ReasoningSplit, reasoning_tag_tokens
from tandem.sampling_params import StructuredOutputsParams
from tests.helpers import make_hf_model

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("fmt,prompt,opens", [
    (R1, "<|User|>hi<|Assistant|><think>\n", True),  # the template opened the thinking
    (QWEN3, "<|im_start|>assistant\n<think>\n", True),
    (R1, "assistant\n<think>\n\n</think>\n\n", False),  # closed: Qwen3's enable_thinking=False
    (QWEN3, "assistant\n<think>\n\n</think>\n\n", False),
    (R1, "<|im_start|>assistant\n", True),  # neither: R1 thinks anyway, Qwen3 if it opens <think>
    (QWEN3, "<|im_start|>assistant\n", None),
    (QWEN3, None, None),
])
def test_where_a_reply_starts(fmt, prompt, opens):
    assert fmt.opens(prompt) is opens


CASES = [  # text, opens -> (thinking, answer)
    ("<think>Let me see.</think>\n\nIt is 4.", None, ("Let me see.", "\n\nIt is 4.")),
    ("<think>Let me see.</think>\n\nIt is 4.", True, ("Let me see.", "\n\nIt is 4.")),
    ("Let me see.</think>It is 4.", True, ("Let me see.", "It is 4.")),
    ("Let me see.</think>It is 4.", None, (None, "Let me see.</think>It is 4.")),  # no <think>: all answer
    ("It is 4.", None, (None, "It is 4.")),
    ("It is 4.", False, (None, "It is 4.")),
    ("<think>x</think>y", False, (None, "<think>x</think>y")),  # the prompt closed the thinking
    ("<think>cut short before the end", None, ("cut short before the end", None)),
    ("cut short", True, ("cut short", None)),
    ("\n\n<think>a</think>b</think>c", None, ("a", "b</think>c")),  # the first </think> ends it
    ("<think></think>answer", True, ("", "answer")),
    ("", True, (None, None)),
    ("", None, (None, None)),
    ("  <thi", None, (None, "  <thi")),
    ("  <thi", True, ("  <thi", None)),
    ("ab</thin", True, ("ab</thin", None)),
]


@pytest.mark.parametrize("text,opens,expect", CASES)
def test_split_whole_and_in_pieces(text, opens, expect):
    assert QWEN3.split(text, opens) == expect
    for size in (1, 2, 3, 7, max(1, len(text))):
        split = ReasoningSplit(opens)
        pieces = [split.feed(text[i:i + size]) for i in range(0, len(text), size)] + [split.finish()]
        thinking = "".join(p[0] for p in pieces)
        answer = "".join(p[1] for p in pieces)
        assert ((thinking if split.thought else None), answer or None) == expect, size


def test_streaming_holds_back_only_a_possible_tag():
    split = ReasoningSplit(True)
    assert split.feed("I think </th") == ("I think ", "")  # "</th" may begin </think>
    assert split.feed("at is it") == ("</that is it", "")
    assert split.feed("</think>\nAnswer") == ("", "\nAnswer")
    assert split.feed(" more") == ("", " more")
    undecided = ReasoningSplit(None)
    assert undecided.feed("\n <thi") == ("", "")  # may still open the thinking
    assert undecided.feed("nk>hm") == ("hm", "")


def test_thinking_tokens_count_up_to_the_end_tag():
    tags = {"<think>": 7, "</think>": 8}
    # A reply that thinks: its tokens up to and with </think>; cut short in the thinking: all of them.
    assert QWEN3.thinking_tokens("<think>a b</think>c", [7, 1, 2, 8, 3], None, tags) == 4
    assert R1.thinking_tokens("a b</think>c d", [1, 2, 8, 3, 4], True, tags) == 3
    assert R1.thinking_tokens("a b c", [1, 2, 3], True, tags) == 3
    # No thinking: 0 (the prompt closed it, or a Qwen3 reply that does not open it).
    assert R1.thinking_tokens("a</think>b", [1, 8, 2], False, tags) == 0
    assert QWEN3.thinking_tokens("a</think>b", [1, 8, 2], None, tags) == 0
    # </think> spelt in text, not a token: the fewest tokens whose text holds it (unknown without a decoder).
    assert R1.thinking_tokens("a b</think>c", [1, 2, 5, 6, 3], True, {}) == 0
    pieces = {1: "a", 2: " b", 5: "</th", 6: "ink>", 3: "c"}
    decode = lambda ids: "".join(pieces[t] for t in ids)  # noqa: E731
    assert R1.thinking_tokens("a b</think>c", [1, 2, 5, 6, 3], True, {}, decode) == 4
    assert QWEN3.thinking_tokens("a b</think>c", [1, 2, 5, 6, 3], None, {}, decode) == 0  # never opened


def _tokenizer(tmp_path, tags: bool | str):
    """The test tokenizer; tags: <think> and </think> as added tokens ("special": special ones)."""
    from tests.helpers import save_tokenizer

    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    if tags == "special":
        tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    elif tags:
        tok.add_tokens(["<think>", "</think>"])
    return tok


@pytest.mark.parametrize("tags", [True, "special", False], ids=["tag-tokens", "special-tag-tokens", "tag-text"])
def test_gate_holds_the_constraint_after_the_thinking(tmp_path, tags):
    """The gated grammar lets the thinking be any text and holds the answer to the constraint;
    with tags as special tokens they are named by id (their text would not match them); as tokens
    that are not special (Qwen3's), they are text, which their tokens spell."""
    import llguidance

    from tandem.engine.grammar import Grammars, grammar_text, ll_tokenizer_of

    tok = _tokenizer(tmp_path, tags)
    assert reasoning_tag_tokens(tok) == ({"<think>": 300, "</think>": 301} if tags else {})
    named = Grammars(tok, 320, (tok.eos_token_id,)).special_tags(reasoning_tag_tokens(tok))
    assert named == (reasoning_tag_tokens(tok) if tags == "special" else {})
    ll = ll_tokenizer_of(tok, 320, (tok.eos_token_id,))
    regex = grammar_text(StructuredOutputsParams(regex="[ab]+"))
    schema = grammar_text(StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                                        "required": ["n"]}))

    def fits(grammar: str, text: str) -> bool:  # text is a prefix of the language
        ids = tok(text, add_special_tokens=False).input_ids
        return llguidance.LLMatcher(ll, grammar, log_level=0).validate_tokens(ids) == len(ids)

    for opens in (True, None):
        gated = QWEN3.gate(regex, opens, named)
        assert not llguidance.LLMatcher.validate_grammar_with_warnings(gated, ll)[0]
        assert fits(gated, "<think>any text at all, fox</think>\n\nabba")
        assert not fits(gated, "<think>any text</think>abc")  # the answer holds to the regex
        assert fits(gated, "abba")  # (a reply that does not think is the answer: Qwen3's None)
        assert fits(gated, "thinking without the tag") is bool(opens)
        assert fits(QWEN3.gate(schema, opens, named), '<think>hm</think>\n{"n": 12}')
        if opens is None:  # a reply that does not think may open with a blank (it closed the answer: only <think> was left)
            assert fits(QWEN3.gate(schema, opens, named), '\n{"n": 12}')
    assert QWEN3.gate(regex, False, {}) == regex  # the prompt closed the thinking: unchanged


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """A tiny model whose tokenizer holds <think> and </think>; -> (its path, their ids)."""
    root = tmp_path_factory.mktemp("reasoning")
    path = make_hf_model(root / "m", "qwen2", seed=2)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(path))
    return path, tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")


@pytest.mark.parametrize("spec", [None, 3], ids=["target-only", "draft"])
def test_engine_constrains_after_the_thinking(thinking_model, spec):
    """With reasoning_parser, a regex holds from </think> on: biased towards </think>, the reply
    thinks for nothing, then writes the regex's language; without one, the regex holds from the
    first token (and </think> is never drawn). A prompt that closed the thinking is constrained at
    once. With a draft model the drafts follow the same gated grammar: the output is the same."""
    path, start, end = thinking_model
    common = dict(dtype="float32", max_model_len=128, block_size=8)
    if spec is not None:
        common["speculative_config"] = dict(model=str(path), num_speculative_tokens=spec)
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={end: 40.0},
                            structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    prompt = {"prompt_token_ids": [5, 6, 7, start]}  # ends with <think>: the reply starts in the thinking
    llm = LLM(str(path), reasoning_parser="deepseek_r1", **common)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == end and end not in out.token_ids[1:], out.token_ids
    thinking, answer = R1.split(out.text, True)
    gap = len(answer) - len(answer.lstrip())  # a blank of up to 4 characters may follow </think>
    assert thinking == "" and gap <= 4 and answer[gap:] and set(answer[gap:]) <= {"a", "b"}, out.text
    closed = llm.generate([{"prompt_token_ids": [5, 6, start, end]}], params, use_tqdm=False)[0].outputs[0]
    assert set(closed.text) <= {"a", "b"} and end not in closed.token_ids
    plain = LLM(str(path), **common).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert end not in plain.token_ids and set(plain.text) <= {"a", "b"}
    if spec is not None:  # the drafts went through the same grammar: the target-only reply
        alone = LLM(str(path), reasoning_parser="deepseek_r1", dtype="float32", max_model_len=128, block_size=8)
        assert alone.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == out.token_ids


def test_enable_in_reasoning_constrains_from_the_first_token(thinking_model):
    """structured_outputs_config={"enable_in_reasoning": True} (vLLM's): the constraint holds from the
    first token, so even a reply that starts in the thinking never draws </think>; the reasoning
    parser still splits the reply (all thinking here: it never closed)."""
    path, start, end = thinking_model
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={end: 40.0},
                            structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=8, reasoning_parser="deepseek_r1",
              structured_outputs_config={"enable_in_reasoning": True, "backend": "guidance"})
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, start]}], params, use_tqdm=False)[0].outputs[0]
    assert end not in out.token_ids and out.text and set(out.text) <= {"a", "b"}, out.text
    assert R1.split(out.text, True) == (out.text, None)


@pytest.mark.parametrize("config, says", [
    ({"enable_in_reasoning": "yes"}, "enable_in_reasoning='yes' must be True or False"),
    ({"backend": "xgrammar"}, "backend='xgrammar' is not supported"),
    ({"whitespace_pattern": " "}, "unknown keys ['whitespace_pattern']"),
    ({"reasoning_parser": "qwen3"}, "differs from reasoning_parser='deepseek_r1'"),
    ([1], "must be a dict"),
])
def test_structured_outputs_config_errors(thinking_model, config, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        LLM(str(thinking_model[0]), dtype="float32", reasoning_parser="deepseek_r1", structured_outputs_config=config)


def test_unknown_reasoning_parser_is_refused(thinking_model):
    with pytest.raises(ConfigError, match=r"^reasoning_parser='r1' is not supported; use one of \['deepseek_r1', 'qwen3'\]"):
        LLM(str(thinking_model[0]), dtype="float32", reasoning_parser="r1")
    with pytest.raises(ConfigError, match=r"^structured_outputs_config\.reasoning_parser='r1' is not supported"):
        LLM(str(thinking_model[0]), dtype="float32", structured_outputs_config={"reasoning_parser": "r1"})
