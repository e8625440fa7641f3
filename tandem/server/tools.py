"""Tool calling for chat completions: OpenAI's `tools` / `tool_choice`, with vLLM's rules.

A request's `ToolChoice` says how its reply becomes tool calls:
- "none": plain text (the tools still reach the chat template, as in vLLM);
- a named function: the output is constrained to that function's arguments (a JSON schema), and
  the reply is one call of it;
- "required": the output is constrained to a JSON array of {"name", "parameters"} objects, one of
  the tools each (at most one with parallel_tool_calls false), and the reply is those calls;
- "auto" (the default when tools are given): the model writes freely and the server's tool-call
  parser (`--enable-auto-tool-choice --tool-call-parser hermes|llama3_json`) finds the calls in its
  text; a tool with "strict": true holds the calls it writes to the tools with the parser's grammar.

Constrained choices run on structured outputs, so with a draft model their drafts are proposed
under the same grammar (grammar-aware drafting) and output stays exactly the target's.
`ToolStream` turns a choice's streamed text into chat deltas: content while it is plain text, and
each call's id and name once read, then its arguments as they are written (`_CallScan`).
"""
from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tandem.engine.grammar import rebased_refs
from tandem.sampling_params import StructuredOutputsParams
from tandem.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    random_id,
)

_ANY_OBJECT = {"type": "object"}
# Calls are held to json.dumps's layout, the one chat templates render past calls in: one space
# after each ',' and ':', no other whitespace (free JSON whitespace lets a model pad until max_tokens).
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolChoiceError(ValueError):
    """A request's tools / tool_choice that cannot be served; param names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------- parsers
_HERMES_START = "<tool_call>"
# A call's head, its name and then its arguments' key, up to where the arguments object opens:
# the order the formats ask for. A call written in another order is still parsed, only not
# streamed piece by piece.
_HEAD = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:%s)"\s*:\s*(?=\{)'
_HERMES_HEAD = re.compile(r"<tool_call>\s*" + _HEAD % "arguments|parameters")
# "required"'s array items, the first after "[" (the array may follow blanks: a reasoning model's
# after </think>), each later one after the last one's "},"
_ITEM_HEADS = (re.compile(r"\s*\[\s*" + _HEAD % "parameters"), re.compile(r"\s*\}\s*,\s*" + _HEAD % "parameters"))
_NONBLANK = re.compile(r"\S")
_HEAD_MAX = 200  # characters from where a head should begin to where it must have been read


class _ObjectEnd:
    """Where a JSON object that starts at `start` ends, found as its text grows (strings, escapes
    and nesting followed; each character read once)."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_string, self.escaped = start, 0, False, False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        i, depth, in_string, escaped = self.pos, self.depth, self.in_string, self.escaped
        while self.end is None and i < len(text):
            ch = text[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self.end = i
        self.pos, self.depth, self.in_string, self.escaped = i, depth, in_string, escaped
        return self.end


@dataclass
class _Open:
    """The call being read: its name, where its arguments start, how far they were handed out."""

    name: str
    start: int
    sent: int
    scan: _ObjectEnd


@dataclass
class _CallScan:
    """The calls in a growing text, each found by its head and followed to its arguments' end.
    advance(text) -> (index, name when the call is new, a piece of its arguments' text) events."""

    heads: tuple[re.Pattern, re.Pattern]  # the first call's head, a later one's
    marker: str | None  # where the next head begins: at this text after the last call (hermes), or right there
    limit: int | None = None  # calls to find at most
    done: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments' text) of each complete call
    pos: int = 0
    open: _Open | None = None
    stopped: bool = False  # a call not written head first: it and those after it are not followed
    searched: int = 0  # the next marker does not begin before this

    def advance(self, text: str) -> list[tuple[int, str | None, str]]:
        events = []
        while not self.stopped and (self.limit is None or len(self.done) < self.limit):
            if self.open is None:
                at = self.pos if self.marker is None else text.find(self.marker, max(self.pos, self.searched))
                if at < 0:
                    self.searched = len(text) - len(self.marker) + 1
                    break
                m = self.heads[bool(self.done)].match(text, at)
                if m is None:
                    self.stopped = len(text) - at > _HEAD_MAX
                    break
                self.open = _Open(_name(m.group(1)), m.end(), m.end(), _ObjectEnd(m.end()))
                events.append((len(self.done), self.open.name, ""))
            call = self.open
            end = call.scan.scan(text)
            upto = len(text) if end is None else end
            if upto > call.sent:
                events.append((len(self.done), None, text[call.sent:upto]))
                call.sent = upto
            if end is None:
                break
            self.done.append((call.name, text[call.start:end]))
            self.pos, self.open = end, None
        return events


def _name(quoted: str) -> str:
    try:
        return _utf8(json.loads(f'"{quoted}"'))
    except ValueError:
        return quoted


def _as_written(calls: list[FunctionCall], scan: _CallScan, text: str) -> list[FunctionCall]:
    """calls with their arguments' text as the model wrote it (the scan's, which streaming sends)
    where it says the same; json.dumps's otherwise."""
    scan.advance(text)
    out = []
    for i, call in enumerate(calls):
        if i < len(scan.done) and scan.done[i][0] == call.name:
            try:
                if json.loads(scan.done[i][1]) == json.loads(call.arguments):
                    call = FunctionCall(name=call.name, arguments=scan.done[i][1])
            except (ValueError, RecursionError):
                pass
        out.append(call)
    return out


class _Object(dict):
    """A JSON object as json.loads reads it (a key written twice: its last value), with its pairs as
    written (`pairs`)."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        self.pairs = pairs


_DECODER = json.JSONDecoder(object_pairs_hook=_Object)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8(name: str) -> str:
    """A decoded name as text a reply can carry: a lone surrogate (a JSON escape "\\ud800" the model
    wrote; no UTF-8 encodes it) replaced by U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", name)


def _dumps(arguments: Any) -> str:
    """Arguments as JSON text in their characters, or ASCII escapes where a string holds a lone surrogate."""
    text = json.dumps(arguments, ensure_ascii=False)
    return json.dumps(arguments) if _LONE_SURROGATE.search(text) else text


def _call(obj: Any, arguments_by_default: dict | None) -> FunctionCall | None:
    """The call a decoded object writes, or None: its name and its arguments ("arguments" or
    "parameters"), each the first such key written, the one a stream reads in the call's head
    (json.loads would take a key written twice at its last value, the other key before it)."""
    if not isinstance(obj, _Object):
        return None
    name = next((value for key, value in obj.pairs if key == "name"), None)
    arguments = next((value for key, value in obj.pairs if key in ("arguments", "parameters")), arguments_by_default)
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return FunctionCall(name=_utf8(name), arguments=_dumps(arguments))


def parse_hermes(text: str) -> tuple[str | None, list[FunctionCall]]:
    """Hermes-style calls (Qwen2.5's template asks for them): `<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>` blocks, the last one possibly unclosed (the model stopped at
    its end-of-turn token). Returns (the text before the first block, None if blank; the calls,
    their arguments in json.dumps's layout). Each block's object is read as JSON (a "</tool_call>"
    inside one of its strings is text) and the next block is sought after it, as a stream reads
    them (a block left unclosed before the next one, or text after an object before its closing
    tag, ends nothing). A first block that is not such an object makes the whole text content and
    no call (vLLM's rule); a later one ends the calls, its text and what follows dropped as after
    the last block, so the reply holds the complete calls a stream of it has sent (vLLM's
    whole-reply parser drops them all, though its stream sent them); the broken block itself, which
    a stream may have begun (cut by max_tokens), is in the stream alone."""
    start = text.find(_HERMES_START)
    if start < 0:
        return text, []
    calls, pos = [], start
    while (at := text.find(_HERMES_START, pos)) >= 0:
        body = _NONBLANK.search(text, at + len(_HERMES_START))
        try:
            obj, pos = _DECODER.raw_decode(text, body.start() if body else len(text))
        except (ValueError, RecursionError):  # (nested past json's recursion limit: no call either)
            break
        call = _call(obj, {})
        if call is None:
            break
        calls.append(call)
    if not calls:
        return text, []
    content = text[:start]
    return (content if content.strip() else None), calls


def hermes_grammar(tools: tuple[dict[str, Any], ...], tag_tokens: dict[str, int], parallel: bool) -> str:
    """llguidance's Lark for free text whose `<tool_call>` blocks are calls of the tools, written as
    Qwen2.5's template asks: a strict tool's arguments held to its schema, another's to any JSON
    object, all in json.dumps's layout. tag_tokens: the tags llguidance holds as special tokens (by
    id; Grammars.special_tags): the grammar must name those, as their text does not match them."""
    def tag(text: str) -> str:
        return f"<[{tag_tokens[text]}]>" if text in tag_tokens else json.dumps(text)

    lines = ["%llguidance {}", "", "text: TEXT", "TEXT: /(.|\\n)*/"]
    if _HERMES_START in tag_tokens:  # a call begins at the token, after any text
        begins = f"TEXT {tag(_HERMES_START)}"
    else:  # or at the tag's text, once it appears (a lazy lexeme ends the text there)
        lines.append(f"call_start[lazy]: TEXT {tag(_HERMES_START)}")
        begins = "call_start"
    close = json.dumps("}\n") + " " + tag("</tool_call>")
    for i, t in enumerate(tools):
        schema = t["parameters"] if t["strict"] else _ANY_OBJECT
        schema = {**schema, "x-guidance": {**_LAYOUT, **schema.get("x-guidance", {})}}
        head = '\n{"name": ' + json.dumps(t["name"], ensure_ascii=False) + ', "arguments": '
        lines.append(f"call_{i}: {begins} {json.dumps(head)} %json {json.dumps(schema)} {close}")
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    lines[1] = f"start: ({calls}){'*' if parallel else '?'} text"
    return "\n".join(lines)


# Llama 3.1's JSON tool calls (its template's "JSON based tool calling"; vLLM's llama3_json and
# llama4_json): the reply is one or more {"name": ..., "parameters": {...}} objects separated by
# "; ", after a <|python_tag|> token where the template asks for one. A call's head: the first
# one's at the reply's start, each later one's after the previous call's closing brace and ";".
_PYTHON_TAG = "<|python_tag|>"
# the first call's head (at the reply's start), a later one's (after the last call's "}" and ";")
_LLAMA_HEADS = (re.compile(r"\s*(?:<\|python_tag\|>\s*)?" + _HEAD % "parameters|arguments"),
                re.compile(r"\s*\}\s*;\s*" + _HEAD % "parameters|arguments"))


def parse_llama3_json(text: str) -> tuple[str | None, list[FunctionCall]]:
    """Llama 3's JSON calls: a reply that starts (after blanks and an optional <|python_tag|>) with
    `{"name": ..., "parameters": {...}}` objects separated by ";" is those calls ("arguments" for
    "parameters" too; what follows the last call is dropped, as after hermes's last block); any
    other reply, or one whose first call does not parse, is content; a later call that does not
    (cut short by max_tokens) is dropped, the calls before it kept, as the stream sent them and as
    hermes keeps its complete blocks (vLLM's parser returns the whole text as content). Unlike vLLM's whole-reply parser,
    which takes the first JSON object anywhere in the text and drops the text around it, a call
    must open the reply, the rule vLLM's streaming applies: a streamed reply and a whole one agree."""
    body = text.lstrip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    calls, pos = [], 0
    while True:
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return (None, calls) if calls else (text, [])
        call = _call(obj, None)
        if call is None:
            return (None, calls) if calls else (text, [])
        calls.append(call)
        rest = body[pos:].lstrip()
        if not rest.startswith(";") or not rest[1:].strip():  # the last call (a ";" with nothing after it too)
            return None, calls
        pos = len(body) - len(rest[1:].lstrip())


def llama3_json_grammar(tools: tuple[dict[str, Any], ...], tag_tokens: dict[str, int], parallel: bool) -> str:
    """llguidance's Lark for a reply that is either text (not opening with "{") or calls of the
    tools as Llama 3's template asks (`{"name": ..., "parameters": {...}}`, "; " between them, after
    the <|python_tag|> token where the tokenizer has it): a strict tool's parameters held to its
    schema, another's to any JSON object, in json.dumps's layout."""
    lines = ["%llguidance {}", "", "text: TEXT", "TEXT: /(\\s*[^{\\s](.|\\n)*)?/"]
    for i, t in enumerate(tools):
        schema = t["parameters"] if t["strict"] else _ANY_OBJECT
        schema = {**schema, "x-guidance": {**_LAYOUT, **schema.get("x-guidance", {})}}
        head = '{"name": ' + json.dumps(t["name"], ensure_ascii=False) + ', "parameters": '
        lines.append(f"call_{i}: {json.dumps(head)} %json {json.dumps(schema)} \"}}\"")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    tag = f"<[{tag_tokens[_PYTHON_TAG]}]>? " if _PYTHON_TAG in tag_tokens else ""
    more = ' ("; " call)*' if parallel else ""
    lines[1] = f"start: {tag}call{more} | text"
    return "\n".join(lines)


class _Llama3Plain:
    """How much of a growing llama3_json reply is surely content: all of it once it opens with
    something other than a call (a "{", or the <|python_tag|>), else nothing. Decided once its
    opening is read; until then each call reads on from where the last one stopped."""

    def __init__(self):
        self.content: bool | None = None  # None: undecided (blank so far, or a prefix of the tag)
        self.read = 0  # the text before this is blank

    def __call__(self, text: str) -> int:
        if self.content is None:
            m = _NONBLANK.search(text, self.read)
            self.read = len(text) if m is None else m.start()
            head = text[self.read:self.read + len(_PYTHON_TAG)]
            if head == _PYTHON_TAG:
                self.content = False
            elif head and not _PYTHON_TAG.startswith(head):
                self.content = not head.startswith("{")
        return len(text) if self.content else 0


class _BeforeMarker:
    """How much of a growing text is surely content: up to the first call's marker, holding back a
    tail that could still become one, and nothing while it is blank (content before calls is None
    when blank). Each call reads on from where the last one stopped."""

    def __init__(self, marker: str):
        self.marker = marker
        self.at: int | None = None  # where the marker is, once found
        self.searched = 0  # the marker does not begin before this
        self.visible: int | None = None  # the first non-blank character's index, once seen
        self.blank = 0  # the text before this is blank

    def __call__(self, text: str) -> int:
        if self.at is None:
            at = text.find(self.marker, self.searched)
            if at >= 0:
                self.at = at
            else:
                self.searched = max(self.searched, len(text) - len(self.marker) + 1)
        end = self.at
        if end is None:
            end = len(text)
            for n in range(min(len(self.marker) - 1, len(text)), 0, -1):
                if text.endswith(self.marker[:n]):
                    end = len(text) - n
                    break
        if self.visible is None:
            m = _NONBLANK.search(text, self.blank)
            self.blank, self.visible = (len(text), None) if m is None else (m.start(), m.start())
        return end if self.visible is not None and self.visible < end else 0


class _Parser(NamedTuple):
    """An "auto" format: the parse of a whole text; for streaming, the head of a call, the text a
    call begins with (None: right where the last one ended) and how much of a growing text is
    surely content; the grammar that holds its calls to strict tools' schemas; the tags that grammar
    must name as tokens where the tokenizer has them."""

    parse: Callable[[str], tuple[str | None, list[FunctionCall]]]
    heads: tuple[re.Pattern, re.Pattern]  # the first call's head, a later one's
    marker: str | None
    plain: Callable[[], Callable[[str], int]]  # a new tracker of how much of a growing text is surely content
    grammar: Callable[[tuple[dict[str, Any], ...], dict[str, int], bool], str]
    tags: tuple[str, ...]


_LLAMA3_JSON = _Parser(parse_llama3_json, _LLAMA_HEADS, None, _Llama3Plain, llama3_json_grammar, (_PYTHON_TAG,))
# "auto"'s parsers by the names of tandem.server.TOOL_CALL_PARSERS.
PARSERS = {
    "hermes": _Parser(parse_hermes, (_HERMES_HEAD, _HERMES_HEAD), _HERMES_START, lambda: _BeforeMarker(_HERMES_START),
                      hermes_grammar, (_HERMES_START, "</tool_call>")),
    "llama3_json": _LLAMA3_JSON,
    "llama4_json": _LLAMA3_JSON,  # Llama 4 writes the same calls (as vLLM's parser of both names)
}


def tag_tokens(tokenizer, parser: str) -> dict[str, int]:
    """The parser's tags that the tokenizer holds as single added tokens -> their ids."""
    if tokenizer is None:
        return {}
    added = tokenizer.get_added_vocab()
    return {t: added[t] for t in PARSERS[parser].tags if t in added}


# ---------------------------------------------------------------- a request's choice
@dataclass(frozen=True)
class ToolChoice:
    """How one chat request's reply becomes tool calls (see the module docstring)."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[dict[str, Any], ...] = ()  # each {"name", "parameters"} (the parameters' schema)
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str | None = None  # "auto"'s parser
    tag_tokens: tuple[tuple[str, int], ...] = ()  # "auto": the parser's tags that are tokens (tag_tokens)

    @property
    def makes_calls(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint a named or "required" choice puts on the output (a
        JSON schema; llguidance's "x-guidance" keeps it in _LAYOUT unless the schema sets its own),
        or an "auto" choice with a strict tool (the parser's grammar of text and calls)."""
        if self.mode == "auto" and any(t["strict"] for t in self.tools):
            return StructuredOutputsParams(grammar=PARSERS[self.parser].grammar(self.tools, dict(self.tag_tokens),
                                                                                 self.parallel))
        if self.mode == "named":
            schema = dict(next(t["parameters"] for t in self.tools if t["name"] == self.name))
        elif self.mode == "required":
            defs: dict[str, Any] = {}
            items = []
            for i, t in enumerate(self.tools):
                parameters, key = t["parameters"], f"tandem_tool_{i}"
                rebased = rebased_refs(parameters, f"#/$defs/{key}")
                if rebased != parameters:  # local refs ("#", "#/$defs/x"): moved under the root's $defs, rebased
                    defs[key], parameters = rebased, {"$ref": f"#/$defs/{key}"}
                items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                                                "parameters": parameters},
                              "required": ["name", "parameters"], "additionalProperties": False})
            schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            if defs:
                schema["$defs"] = defs
        else:
            return None
        schema["x-guidance"] = {**_LAYOUT, **schema.get("x-guidance", {})}
        return StructuredOutputsParams(json=schema)

    def scan(self) -> _CallScan | None:
        """A scan of the calls in this choice's text, as it grows (None: a named call, whose text
        is its arguments, or no calls)."""
        if self.mode == "required":
            return _CallScan(_ITEM_HEADS, marker=None)
        if self.mode == "auto":
            parser = PARSERS[self.parser]
            return _CallScan(parser.heads, parser.marker, limit=None if self.parallel else 1)
        return None

    def parse(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """(content, calls) of a finished choice's text, each call's arguments as the model wrote
        them. Text that does not hold calls stays content (a choice cut short by max_tokens before its
        first call was whole, for one)."""
        if self.mode == "named":  # (a blank before the object: after a reasoning model's </think>)
            text = text.lstrip()  # none at all (cut in the thinking or just after it): no call, as in vLLM
            return None, [FunctionCall(name=self.name, arguments=text)] if text else []
        if self.mode == "required":
            try:
                items = json.loads(text)
                calls = [FunctionCall(name=_utf8(item["name"]), arguments=_dumps(item["parameters"])) for item in items]
            except (ValueError, TypeError, KeyError, RecursionError):  # (nested past json's recursion limit)
                # cut short (max_tokens): the calls written whole before the cut, which a stream has sent
                # (the one cut, begun in a stream, is in the stream alone, as parse_hermes drops it)
                scan = self.scan()
                scan.advance(text)
                if not scan.done:
                    return text, []
                return None, [FunctionCall(name=name, arguments=arguments) for name, arguments in scan.done]
            return None, _as_written(calls, self.scan(), text)
        if self.mode == "auto":
            content, calls = PARSERS[self.parser].parse(text)
            return content, _as_written(calls if self.parallel else calls[:1], self.scan(), text)
        return text, []

    def finish_reason(self, calls: list[FunctionCall], finish: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model chose to call ("auto", "required") and stopped by itself."""
        if calls and finish == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish


def tools_for_template(request) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template takes them, as vLLM passes them: each function's name,
    description and parameters (null where not given), then any other key the client sent
    ("strict" among them only where sent), so a template that prints the whole tool prints vLLM's."""
    tools = getattr(request, "tools", None)
    if not tools:
        return None
    out = []
    for tool in tools:
        dumped = tool.model_dump()
        if "strict" not in tool.function.model_fields_set:
            del dumped["function"]["strict"]
        out.append(dumped)
    return out


def tool_choice(request: ChatCompletionRequest, auto_parser: str | None, constrained: bool = False,
                tags: dict[str, int] | None = None) -> ToolChoice:
    """The request's ToolChoice, checked (ToolChoiceError names the field). auto_parser: the
    server's tool-call parser, None without --enable-auto-tool-choice; constrained: the request
    constrains its output itself (response_format, structured_outputs or guided_*); tags: the
    parser's tags that the tokenizer holds as tokens (tag_tokens)."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or (choice == "auto" and request.tools is not None and not tools):  # ("tools": []: none)
        return ToolChoice("none")
    if not tools:
        raise ToolChoiceError(f"'tool_choice' {_shown(choice)} needs 'tools' to choose from; give 'tools' or drop "
                              "'tool_choice'", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        dup = next(n for n, count in collections.Counter(names).items() if count > 1)  # (linear: 20k tools took 5 s)
        raise ToolChoiceError(f"'tools' names the function {dup!r} twice; give each function once", "tools")
    specs = tuple({"name": t.function.name, "parameters": t.function.parameters or _ANY_OBJECT,
                   "strict": bool(t.function.strict)} for t in tools)
    if constrained and choice != "auto":
        raise ToolChoiceError(f"'tool_choice' {_shown(choice)} constrains the output to tool calls, and the request "
                              "constrains it too ('response_format', 'structured_outputs' or 'guided_*'); drop one",
                              "tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise ToolChoiceError("'tool_choice' \"auto\" (the default with 'tools') needs the server started with "
                                  "--enable-auto-tool-choice --tool-call-parser hermes (or llama3_json); start it "
                                  "so, or send "
                                  "'tool_choice' \"required\", a named function or \"none\"", "tool_choice")
        if constrained and any(t["strict"] for t in specs):
            raise ToolChoiceError("'tools': a function with 'strict': true holds \"auto\" calls to its schema with a "
                                  "grammar, and the request constrains its output too ('response_format', "
                                  "'structured_outputs' or 'guided_*'); drop one", "tools")
        return ToolChoice("auto", specs, parallel=request.parallel_tool_calls, parser=auto_parser,
                          tag_tokens=tuple(sorted((tags or {}).items())))
    if choice == "required":
        return ToolChoice("required", specs, parallel=request.parallel_tool_calls)
    name = choice.function.name
    if name not in names:
        raise ToolChoiceError(f"'tool_choice' names the function {name!r}, which is not in 'tools' ({names}); name one "
                              "of them", "tool_choice")
    return ToolChoice("named", specs, name=name)


def _shown(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


# ---------------------------------------------------------------- streaming
@dataclass
class ToolStream:
    """One streamed choice's text -> its deltas under a ToolChoice. feed(text) takes each new piece
    of the choice's text; finish() the choice's end. The deltas carry what the whole response
    would: the content before the calls (held back where a call may begin), then each call, its id
    and name once its head is read and its arguments as they are written. One exception: a call
    begun and then cut short (max_tokens) or broken stays as sent, where the whole response, which
    cannot parse it, holds the text as content."""

    choice: ToolChoice
    text: str = ""
    sent: int = 0  # characters of text sent as content ("auto") or arguments ("named")
    call_id: str | None = None  # the named call's
    calls: list[FunctionCall] = field(default_factory=list)  # once finished
    scan: _CallScan | None = None
    plain: Callable[[str], int] | None = None  # "auto": how much of the text is surely content
    lead: int | None = None  # "named": the blank characters before the arguments, once they begin

    def __post_init__(self):
        self.scan = self.choice.scan()
        if self.choice.mode == "auto":
            self.plain = PARSERS[self.choice.parser].plain()

    def feed(self, piece: str) -> DeltaMessage | None:
        self.text += piece
        if self.choice.mode == "named":
            return self._arguments()
        content = None
        if self.plain is not None:
            end = self.plain(self.text)
            if end > self.sent:
                content, self.sent = self.text[self.sent:end], end
        calls = _call_deltas(self.scan.advance(self.text))
        return DeltaMessage(content=content, tool_calls=calls) if content or calls else None

    def finish(self) -> DeltaMessage | None:
        if self.choice.mode == "named":
            return self._arguments()
        content, self.calls = self.choice.parse(self.text)
        streamed = len(self.scan.done) + (self.scan.open is not None)
        if not self.calls:
            if streamed:  # a call already begun (its id and name sent), then cut short (max_tokens) or broken:
                return None  # it stays as sent, and the content before it was sent whole (vLLM's stream does so)
            # plain text after all: whatever was held back is content
            return DeltaMessage(content=self.text[self.sent:]) if self.sent < len(self.text) else None
        rest = content[self.sent:] if content is not None and len(content) > self.sent else None
        calls = [DeltaToolCall(index=i, id=random_id("chatcmpl-tool"), type="function",
                               function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                 for i, c in enumerate(self.calls) if i >= streamed]  # those written in another order
        return DeltaMessage(content=rest, tool_calls=calls) if rest or calls else None

    def _arguments(self) -> DeltaMessage | None:
        # The arguments are the text without its leading blanks (as parse reads it); sent counts
        # their characters sent, so each step reads only its new piece.
        if self.lead is None:
            m = _NONBLANK.search(self.text)
            if m is None:  # the call begins with its first argument text (none: no call, as parse says)
                return None
            self.lead = m.start()
            self.call_id = random_id("chatcmpl-tool")  # the call's first piece: its id and name
            self.sent = len(self.text) - self.lead
            return DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=self.call_id, type="function",
                                                          function=DeltaFunctionCall(name=self.choice.name,
                                                                                     arguments=self.text[self.lead:]))])
        start = self.lead + self.sent
        if start == len(self.text):
            return None
        piece, self.sent = self.text[start:], len(self.text) - self.lead
        return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))])


def _call_deltas(events: list[tuple[int, str | None, str]]) -> list[DeltaToolCall]:
    """A scan's events as tool-call deltas, one per call: a new call's carries its id and name."""
    deltas: dict[int, DeltaToolCall] = {}
    for index, name, piece in events:
        if name is not None:
            deltas[index] = DeltaToolCall(index=index, id=random_id("chatcmpl-tool"), type="function",
                                          function=DeltaFunctionCall(name=name, arguments=""))
        delta = deltas.setdefault(index, DeltaToolCall(index=index, function=DeltaFunctionCall(arguments="")))
        delta.function.arguments += piece
    return list(deltas.values())
