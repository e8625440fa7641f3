"""Tool calling's pieces without a model: the hermes and llama3_json parsers, the constraints of named and "required"
tool choice, and the streamed deltas of a choice (tandem/server/tools.py). The server end to end
is in test_server.py."""
from __future__ import annotations

import json

import pytest

from tandem.sampling_params import StructuredOutputsParams
from tandem.server.protocol import ChatCompletionRequest
from tandem.server import TOOL_CALL_PARSERS
from tandem.server.tools import (PARSERS, ToolChoice, ToolChoiceError, ToolStream, parse_hermes, parse_llama3_json,
                                 tool_choice)

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "é"}}\n</tool_call>'


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_parse_hermes():
    content, calls = parse_hermes("I'll look.\n" + CALL + "\n" + CALL.replace('"f"', '"g"'))
    assert content == "I'll look.\n" and _calls(calls) == [("f", {"x": 1, "s": "é"}), ("g", {"x": 1, "s": "é"})]
    assert calls[0].arguments == '{"x": 1, "s": "é"}'  # json.dumps's layout, not ASCII-escaped
    # the last block unclosed (the model ended its turn there); "parameters" for "arguments"; blank content
    content, calls = parse_hermes('  \n<tool_call>\n{"name": "f", "parameters": {}}')
    assert content is None and _calls(calls) == [("f", {})]
    for text in ("plain text", CALL.replace('"x": 1', '"x": '), '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>["f"]</tool_call>',
                 '<tool_call>{"name": "g"' + CALL):
        assert parse_hermes(text) == (text, []), text  # a first block that is not a call: all of it is content
    for bad in ('<tool_call>{"name": "g"', "\n<tool_call>\nnot json</tool_call>", "<tool_call>[1]</tool_call>" + CALL):
        # a later one ends the calls (a stream has sent those before it), dropped as text after the last block is
        assert parse_hermes("x " + CALL + bad) == ("x ", parse_hermes(CALL)[1]), bad


LLAMA_CALL = '{"name": "f", "parameters": {"x": 1, "s": "é"}}'


def test_parse_llama3_json():
    """Llama 3's calls: the reply opens with them (after blanks or <|python_tag|>), "; " between them,
    "arguments" for "parameters" too; anything else, or a first call that does not parse, is content; a
    later call cut short is dropped and the complete ones kept (as hermes keeps its complete blocks)."""
    two = LLAMA_CALL + "; " + LLAMA_CALL.replace('"f"', '"g"').replace("parameters", "arguments")
    for text in (two, "\n " + two, "<|python_tag|>" + two, two + ";", two + "\n\nDone."):
        content, calls = parse_llama3_json(text)
        assert content is None and _calls(calls) == [("f", {"x": 1, "s": "é"}), ("g", {"x": 1, "s": "é"})], text
    assert parse_llama3_json(LLAMA_CALL)[1][0].arguments == '{"x": 1, "s": "é"}'
    assert _calls(parse_llama3_json('{"name": "f", "parameters": {"deep": {"a": [{"b": {}}]}}}')[1]) == \
        [("f", {"deep": {"a": [{"b": {}}]}})]  # (vLLM's regex takes one level of nesting)
    for text in ("plain text", "Sure: " + LLAMA_CALL, '{"answer": 42}', '{"name": "f", "parameters": [1]}',
                 '{"name": 3, "parameters": {}}', LLAMA_CALL[:-4]):
        assert parse_llama3_json(text) == (text, []), text
    for cut in ('; {"name": "g", "para', '; {"name": "g", "parameters": {"x": ', '; {"name": 3}'):
        content, calls = parse_llama3_json(LLAMA_CALL + cut)
        assert content is None and _calls(calls) == [("f", {"x": 1, "s": "é"})], cut


def test_escapes_no_reply_can_carry_and_deep_nesting():
    """A call whose name holds a lone surrogate (the escape "\\ud800": no UTF-8 encodes it) is kept with
    U+FFFD for it, its arguments' one as an ASCII escape; arguments nested past json's recursion limit
    are no call (the text stays content). Both answered 500 before (UnicodeEncodeError, RecursionError)."""
    for parse, head, close in ((parse_hermes, "<tool_call>", "</tool_call>"), (parse_llama3_json, "", "")):
        text = head + '{"name": "f\\ud800", "arguments": {"s": "a\\udc00"}}' + close
        _, calls = parse(text)
        assert [(c.name, c.arguments) for c in calls] == [("f\ufffd", '{"s": "a\\udc00"}')], parse
        assert calls[0].name.encode() and calls[0].arguments.encode()
        deep = head + '{"name": "f", "arguments": {"q": ' + "[" * 5000 + "]" * 5000 + "}}" + close
        assert parse(deep) == (deep, []), parse
    _, calls, _ = _stream(ToolChoice("auto", parallel=True, parser="hermes"),
                          '<tool_call>\n{"name": "f\\ud800", "arguments": {}}\n</tool_call>', 7)
    assert [name for name, _ in calls] == ["f\ufffd"]  # streamed as the whole reply holds it


def test_every_parser_the_flag_offers_exists():
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


def test_choices_and_their_errors():
    def request(**fields) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})

    f = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    g = {"type": "function", "function": {"name": "g"}}
    assert tool_choice(request(), None).mode == "none"
    assert tool_choice(request(tools=[f], tool_choice="none"), None).mode == "none"
    assert tool_choice(request(tools=[f]), "hermes").mode == "auto"  # the default with tools
    named = tool_choice(request(tools=[f, g], tool_choice={"type": "function", "function": {"name": "g"}}), None)
    assert (named.mode, named.name, named.tools[1]["parameters"]) == ("named", "g", {"type": "object"})
    for fields, parser, constrained, param, says in [
        ({"tools": [f]}, None, False, "tool_choice", "--enable-auto-tool-choice --tool-call-parser hermes"),
        ({"tool_choice": "required"}, None, False, "tool_choice", "needs 'tools'"),
        ({"tools": [f, f], "tool_choice": "required"}, None, False, "tools", "twice"),
        ({"tools": [f], "tool_choice": {"type": "function", "function": {"name": "h"}}}, None, False, "tool_choice",
         "'h', which is not in 'tools'"),
        ({"tools": [f], "tool_choice": "required"}, None, True, "tool_choice", "drop one"),
    ]:
        with pytest.raises(ToolChoiceError, match=says) as e:
            tool_choice(request(**fields), parser, constrained)
        assert e.value.param == param
    assert tool_choice(request(tools=[f]), "hermes", constrained=True).mode == "auto"  # its own constraint holds


def test_required_schema_keeps_each_tools_references_and_a_schemas_own_layout(tmp_path):
    """tool_choice "required" nests every tool's parameters in one array schema: a tool's local
    references ("#", "#/properties/b", its own $defs, a $defs name another tool defines otherwise)
    still resolve inside that tool (they pointed at the array, failed, or took the other tool's)."""
    from transformers import AutoTokenizer

    from tandem.engine.grammar import Grammars
    from tests.helpers import save_tokenizer

    def tool(name, parameters):
        return {"name": name, "parameters": {"type": "object", "additionalProperties": False, **parameters}}

    specs = (
        tool("f", {"properties": {"v": {"type": "integer"}, "child": {"$ref": "#"}}, "required": ["v"]}),
        tool("g", {"properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "string"}}, "required": ["a"]}),
        tool("h", {"properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"], "$defs": {"P": {"type": "string"}}}),
        tool("k", {"properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"], "$defs": {"P": {"type": "integer"}}}),
        tool("plain", {"properties": {"x": {"type": "integer"}}}),
        tool("inner", {"properties": {"a": {"$id": "urn:inner", "type": "object", "additionalProperties": False,
                                            "properties": {"x": {"type": "integer"}, "y": {"$ref": "#/properties/x"}}},
                                      "b": {"$ref": "#/properties/a"}}}),  # "#" inside the $id: that subschema
    )
    schema = ToolChoice("required", specs, parallel=False).constraint().json
    assert schema["maxItems"] == 1 and [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [
        ["f"], ["g"], ["h"], ["k"], ["plain"], ["inner"]]
    assert schema["items"]["anyOf"][4]["properties"]["parameters"] == specs[4]["parameters"]  # no refs: in place
    assert schema["x-guidance"] == {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    grammars = Grammars(tok, 320, (tok.eos_token_id,))

    def fits(name: str, arguments: str) -> bool:
        matcher = grammars.compile(StructuredOutputsParams(json=schema))
        ids = tok.encode(f'[{{"name": "{name}", "parameters": {arguments}}}]', add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    assert fits("f", '{"v": 1, "child": {"v": 2}}') and not fits("f", '{"v": 1, "child": [{"name": "f", '
                                                                   '"parameters": {"v": 2}}]}')
    assert fits("g", '{"a": "x"}') and not fits("g", '{"a": 1}')
    assert fits("h", '{"p": "x"}') and not fits("h", '{"p": 1}')
    assert fits("k", '{"p": 1}') and not fits("k", '{"p": "x"}')
    assert fits("plain", '{"x": 1}')
    assert fits("inner", '{"a": {"y": 2}}') and not fits("inner", '{"a": {"y": "z"}}')
    assert fits("inner", '{"b": {"x": 1}}') and not fits("inner", '{"b": {"x": 1, "q": 2}}')
    own = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    assert ToolChoice("named", ({"name": "a", "parameters": own},), name="a").constraint().json["x-guidance"][
        "whitespace_flexible"] is True


def _stream(choice: ToolChoice, text: str, size: int) -> tuple[str, list[tuple[str, str]], list]:
    """text streamed in pieces of size -> (content, each call's (name, arguments), the deltas); each
    call's first delta alone carries its id and name, as OpenAI streams them."""
    stream = ToolStream(choice)
    deltas = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    deltas = [d for d in deltas if d is not None]
    calls: dict[int, list] = {}
    for c in (c for d in deltas for c in d.tool_calls):
        if c.index not in calls:
            assert c.id.startswith("chatcmpl-tool-") and c.type == "function" and c.function.name, c
            calls[c.index] = [c.function.name, ""]
        else:
            assert c.id is None and c.function.name is None, c
        calls[c.index][1] += c.function.arguments or ""
    assert list(calls) == list(range(len(calls)))
    return "".join(d.content or "" for d in deltas), [tuple(c) for c in calls.values()], deltas


# Blocks read as JSON, as a stream reads them (the whole reply took a regex's blocks: each of these was content
# or fewer calls there, while the stream sent the calls)
HERMES_AS_JSON = {
    '<tool_call>\n{"name": "w", "arguments": {"text": "ends with </tool_call>"}}\n</tool_call>':
        [("w", '{"text": "ends with </tool_call>"}')],
    '<tool_call>\n{"name": "f", "arguments": {}}\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>':
        [("f", "{}"), ("g", "{}")],  # a block left unclosed before the next one
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}}</tool_call>'
    '<tool_call>{"name": "h", "arguments": {}}</tool_call>': [("f", "{}"), ("g", "{}"), ("h", "{}")],  # text after one
    '<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}, "name": "g"}</tool_call>':
        [("f", '{"a": 1}')],  # keys written twice: the first, which the stream reads in the head
}


def test_hermes_blocks_are_read_as_json():
    for text, want in HERMES_AS_JSON.items():
        assert [(c.name, c.arguments) for c in parse_hermes(text)[1]] == want, text


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_auto_choice_equals_the_whole_reply(size):
    auto = ToolChoice("auto", parallel=True, parser="hermes")
    two = "Sure, checking.\n" + CALL + "\n" + CALL.replace('"x": 1', '"x": {"y": "}]\\"{"}')
    reordered = '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>'  # parsed, sent whole at the end
    for text in (two, "\n\n" + CALL, reordered, CALL + reordered, reordered + CALL, reordered * 5 + CALL,
                 "no call, only a <tool", "a <tool_call> that breaks", CALL + "\n<tool_call>\nnot json</tool_call>",
                 "Sure. " + CALL + '<tool_call>{"name": "g"', *HERMES_AS_JSON):
        want_content, want_calls = auto.parse(text)
        content, calls, deltas = _stream(auto, text, size)
        assert content == (want_content or ""), (text, size)
        assert calls == [(c.name, c.arguments) for c in want_calls], (text, size)
        if want_calls:  # nothing of a call leaks into content
            assert not any("<tool" in (d.content or "") for d in deltas)
    # arguments come as the model wrote them, streamed or not
    assert auto.parse(two)[1][1].arguments == '{"x": {"y": "}]\\"{"}, "s": "é"}'
    assert auto.parse('<tool_call>{"name":"f","arguments":{"x":1}}')[1][0].arguments == '{"x":1}'
    if size == 3:  # a call's arguments come in pieces, as they are written
        assert sum(1 for d in _stream(auto, two, size)[2] if d.tool_calls) > 10
    one = ToolChoice("auto", parallel=False, parser="hermes")
    assert len(one.parse(CALL + CALL)[1]) == 1 and len(_stream(one, CALL + CALL, size)[1]) == 1
    # A call begun (its name sent) and then cut short by max_tokens stays as sent: the whole reply, which
    # cannot parse it, is its text as content, but the stream does not send that text again as content.
    cut = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1, "s'
    assert auto.parse(cut) == (cut, [])
    assert _stream(auto, cut, size)[:2] == ("Sure. ", [("f", '{"x": 1, "s')])


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_llama3_json_choice_equals_the_whole_reply(size):
    """A llama3_json reply streams as it parses whole: content only once it surely opens with no
    call, each call's arguments as they are written."""
    auto = ToolChoice("auto", parallel=True, parser="llama3_json")
    nested = LLAMA_CALL.replace('"x": 1', '"x": {"y": "}]\\";{"}')
    reordered = '{"parameters": {"x": 1}, "name": "f"}'  # parsed, sent whole at the end
    for text in (LLAMA_CALL + "; " + nested, "\n" + LLAMA_CALL, "<|python_tag|>" + LLAMA_CALL, reordered,
                 LLAMA_CALL + "; " + reordered, "plain text, no call", "<|python", '{"answer": 42}',
                 "Sure: " + LLAMA_CALL, LLAMA_CALL + "\n\nDone.", LLAMA_CALL + '; {"name": "g", "para',
                 "}; " + LLAMA_CALL, " <|python_tag|> " + LLAMA_CALL,  # a later call's head opens no reply
                 '{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}'):
        want_content, want_calls = auto.parse(text)
        content, calls, deltas = _stream(auto, text, size)
        assert content == (want_content or ""), (text, size)
        assert calls == [(c.name, c.arguments) for c in want_calls], (text, size)
    assert auto.parse(LLAMA_CALL + "; " + nested)[1][1].arguments == '{"x": {"y": "}]\\";{"}, "s": "é"}'
    if size == 3:  # a call's arguments come in pieces, as they are written
        assert sum(1 for d in _stream(auto, LLAMA_CALL + "; " + nested, size)[2] if d.tool_calls) > 10
    assert auto.parse("}; " + LLAMA_CALL)[1] == [] and len(auto.parse(" <|python_tag|> " + LLAMA_CALL)[1]) == 1
    assert _stream(auto, '{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}', size)[1] == [("f", '{"a": 1}')]
    one = ToolChoice("auto", parallel=False, parser="llama3_json")
    assert len(one.parse(LLAMA_CALL + "; " + LLAMA_CALL)[1]) == 1
    assert len(_stream(one, LLAMA_CALL + "; " + LLAMA_CALL, size)[1]) == 1


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_calls_send_their_arguments_as_they_come(size):
    named = ToolChoice("named", ({"name": "f", "parameters": {"type": "object"}},), name="f")
    content, calls, deltas = _stream(named, '{"x": 1}', size)
    assert content == "" and calls == [("f", '{"x": 1}')] and len(deltas) == -(-8 // size)
    # a blank before the object (a reasoning model's, after </think>) is not part of the arguments
    assert _stream(named, '\n\n{"x": 1}', size)[1] == [("f", '{"x": 1}')] == \
        [(c.name, c.arguments) for c in named.parse('\n\n{"x": 1}')[1]]
    assert named.finish_reason([], "stop") == "stop"
    # no answer at all (cut in a reasoning model's thinking, or just after it): no call, streamed or not
    assert named.parse("\n") == (None, []) and _stream(named, "\n", size)[1] == []
    required = ToolChoice("required", named.tools + ({"name": "g", "parameters": {"type": "object"}},))
    text = '[{"name": "f", "parameters": {"x": [1, "]"]}}, {"name": "g", "parameters": {}}]'
    content, calls, deltas = _stream(required, text, size)
    assert content == "" and calls == [("f", '{"x": [1, "]"]}'), ("g", "{}")]
    assert calls == [(c.name, c.arguments) for c in required.parse(text)[1]]
    for blank in ("", "\n\n"):  # after blanks too (a reasoning model's, after </think>)
        content, calls, deltas = _stream(required, blank + text, size)
        assert content == "" and calls == [(c.name, c.arguments) for c in required.parse(blank + text)[1]]
        if size == 1:  # f's arguments are sent as they come, before g is written
            first_g = next(i for i, d in enumerate(deltas) if any(c.index == 1 for c in d.tool_calls))
            assert sum(1 for d in deltas[:first_g] if d.tool_calls) > 10
    assert required.finish_reason(required.parse(text)[1], "stop") == "tool_calls"
    # cut short (max_tokens): the calls written whole before the cut, as the stream sent them (it began
    # the cut one too); with none whole, the text stays content
    cut = text[:-3]
    whole = [(c.name, c.arguments) for c in required.parse(cut)[1]]
    assert required.parse(cut)[0] is None and whole == [("f", '{"x": [1, "]"]}')] == _stream(required, cut, size)[1][:1]
    assert required.finish_reason(required.parse(cut)[1], "length") == "length"
    assert required.parse(text[:30]) == (text[:30], []) and required.finish_reason([], "length") == "length"


def _whole_plain_end(parser: str, text: str) -> int:
    """How much of text is surely content, read from the whole text (the rule the streams' trackers
    follow a piece at a time)."""
    if parser == "llama3_json":
        head, tag = text.lstrip(), "<|python_tag|>"
        return 0 if not head or head.startswith(("{", tag)) or tag.startswith(head) else len(text)
    marker = "<tool_call>"
    end = text.find(marker)
    if end < 0:
        end = len(text)
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-n:]):
                end = len(text) - n
                break
    return end if text[:end].strip() else 0


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_streams_content_tracker_reads_only_new_text(parser):
    """The content a growing text surely holds is found a piece at a time as from the whole text,
    for texts of blanks, tags' prefixes, braces and calls cut anywhere (each step reads only the
    new text: a long reply costs each step the same)."""
    import random

    rng = random.Random(0)
    atoms = [" ", "\n", "\u3000", "<", "<tool", "_call>", "<tool_call>", "<|python", "_tag|>", "{", "}", "a", "é "]
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        track, grown = PARSERS[parser].plain(), ""
        while len(grown) < len(text):
            grown = text[:len(grown) + rng.randint(1, 4)]
            assert track(grown) == _whole_plain_end(parser, grown), (parser, text, grown)


STRICT_F = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                                        "required": ["x"], "additionalProperties": False}, "strict": True}


def _tags_and_fits(tmp_path, parser: str, added: list[str], special: bool = False):
    """The test tokenizer with `added` as tokens of their own -> (the parser's tags a grammar names
    by id, as the server finds them: those llguidance holds as special tokens; fits(choice, text):
    whether the text's tokens keep to the choice's grammar, read as the engine reads them)."""
    import llguidance
    from transformers import AutoTokenizer

    from tandem.engine.grammar import Grammars, ll_tokenizer_of
    from tandem.server.tools import tag_tokens
    from tests.helpers import save_tokenizer

    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    if added and special:
        tok.add_special_tokens({"additional_special_tokens": added})
    elif added:
        tok.add_tokens(added)
    for tag in added:  # the text of a tag is its token
        assert tok.encode(tag, add_special_tokens=False) == [tok.convert_tokens_to_ids(tag)]
    ll_tok = ll_tokenizer_of(tok, len(tok), (tok.eos_token_id,))

    def fits(choice: ToolChoice, text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tok, choice.constraint().grammar, log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error()

    return Grammars(tok, len(tok), (tok.eos_token_id,)).special_tags(tag_tokens(tok, parser)), fits


@pytest.mark.parametrize("tags_as", ["text", "tokens", "special tokens"])
def test_strict_tools_hold_auto_calls_to_their_schemas(tmp_path, tags_as):
    """A strict tool makes "auto" a grammar: text is free, and a <tool_call> block must call a tool
    with arguments that fit (a strict tool's schema; another's any object). Where the tokenizer
    holds the tags as special tokens, the grammar names those tokens; as tokens that are not
    special (Qwen2.5's), they are text, which the tag tokens or other tokens may spell."""
    tags, fits = _tags_and_fits(tmp_path, "hermes", ["<tool_call>", "</tool_call>"] if tags_as != "text" else [],
                                special=tags_as == "special tokens")
    as_tokens = tags_as == "special tokens"
    assert len(tags) == (2 if as_tokens else 0)
    strict = STRICT_F
    loose = {"name": "g", "parameters": {"type": "object", "properties": {"y": {"type": "string"}}}, "strict": False}
    assert ToolChoice("auto", ({**strict, "strict": False}, loose), parser="hermes").constraint() is None
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 12}}\n</tool_call>'

    for parallel in (True, False):
        choice = ToolChoice("auto", (strict, loose), parallel=parallel, parser="hermes",
                            tag_tokens=tuple(sorted(tags.items())))
        assert choice.constraint().kind == "grammar"
        assert fits(choice, "Sure. " + call + " Done.") and fits(choice, "no call at all, only <b>text</b>")
        assert fits(choice, '<tool_call>\n{"name": "g", "arguments": {"z": [1, 2]}}\n</tool_call>')  # not strict
        for bad in ('<tool_call>\n{"name": "h", "arguments": {}}', '<tool_call>\n{"name": "f", "arguments": {"y": 1}}',
                    '<tool_call>\n{"name":"f","arguments":{"x":1}}', call.replace("12", '"12"')):
            assert not fits(choice, bad), bad
        if as_tokens:  # a second call needs the tag token, which only a call may write
            assert fits(choice, call + "\n" + call) == parallel
    # a name beyond ASCII is written as the template's tojson writes it, not \u-escaped
    meteo = ToolChoice("auto", ({**strict, "name": "météo"},), parser="hermes",
                       tag_tokens=tuple(sorted(tags.items())))
    assert fits(meteo, call.replace('"f"', '"météo"')) and not fits(meteo, call.replace('"f"', '"m\\u00e9t\\u00e9o"'))


@pytest.mark.parametrize("as_token", [False, True])
def test_strict_tools_hold_llama3_json_calls_to_their_schemas(tmp_path, as_token):
    """llama3_json's grammar with a strict tool: a reply is text that does not open with "{", or
    calls that fit (a strict tool's schema; another's any object), after the <|python_tag|> token
    where the tokenizer has it."""
    tags, fits = _tags_and_fits(tmp_path, "llama3_json", ["<|python_tag|>"] if as_token else [], special=True)
    assert len(tags) == int(as_token)
    loose = {"name": "g", "parameters": {"type": "object"}, "strict": False}
    call = '{"name": "f", "parameters": {"x": 12}}'

    for parallel in (True, False):
        choice = ToolChoice("auto", (STRICT_F, loose), parallel=parallel, parser="llama3_json",
                            tag_tokens=tuple(sorted(tags.items())))
        assert fits(choice, call) and fits(choice, "no call at all, {not} one") and fits(choice, "")
        assert fits(choice, '{"name": "g", "parameters": {"z": [1, 2]}}')  # not strict
        assert fits(choice, call + '; {"name": "g", "parameters": {}}') == parallel
        for bad in ('{"name": "h", "parameters": {}}', '{"name": "f", "parameters": {"y": 1}}',
                    '{"name":"f","parameters":{"x":1}}', call.replace("12", '"12"'), '{"answer": 1}'):
            assert not fits(choice, bad), bad
        if as_token:
            assert fits(choice, "<|python_tag|>" + call)


def test_tools_reach_the_template_as_vllm_passes_them():
    """Each function's name, description and parameters (null where not given), then the other keys the
    client sent: a template printing the whole tool (Qwen2.5's `tool | tojson`) prints vLLM's prompt (the
    nulls and the extra keys were dropped)."""
    from tandem.server.tools import tools_for_template

    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}, "examples": ["g()"],
                                          "strict": True}}]})
    assert tools_for_template(request) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "g", "description": None, "parameters": {"type": "object"},
                                          "strict": True, "examples": ["g()"]}}]


def test_a_past_calls_arguments_must_be_json_text_or_an_object():
    from tandem.chat import _parsed_arguments
    from tandem.errors import RequestError

    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert _parsed_arguments(call, 0)["function"]["arguments"] == {"x": 1}
    as_object = {**call, "function": {"name": "f", "arguments": {"x": 1}}}
    assert _parsed_arguments(as_object, 0) == as_object
    for bad in (5, True, ["x"]):  # (rendered as written: "arguments": 5)
        with pytest.raises(RequestError, match="tool_calls.0.function.arguments=.* is invalid"):
            _parsed_arguments({**call, "function": {"name": "f", "arguments": bad}}, 0)
    deep = '{"x": ' + "[" * 5000 + "]" * 5000 + "}"  # past json's recursion limit: a 400, not a 500
    with pytest.raises(RequestError, match="tool_calls.0.function.arguments is not JSON"):
        _parsed_arguments({**call, "function": {"name": "f", "arguments": deep}}, 0)
