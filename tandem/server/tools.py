"""Tool calling for chat completions: OpenAI's `tools` / `tool_choice`, with vLLM's rules.

A request's `ToolChoice` says how its reply becomes tool calls:
- "none": plain text (the tools still reach the chat template, as in vLLM);
- a named function: the output is constrained to that function's arguments (a JSON schema), and
  the reply is one call of it;
- "required": the output is constrained to a JSON array of {"name", "parameters"} objects, one of
  the tools each (at most one with parallel_tool_calls false), and the reply is those calls;
- "auto" (the default when tools are given): the model writes freely and the server's tool-call
  parser (`--enable-auto-tool-choice --tool-call-parser hermes`) finds the calls in its text.

Constrained choices run on structured outputs, so with a draft model their drafts are proposed
under the same grammar (grammar-aware drafting) and output stays exactly the target's.
`ToolStream` turns a choice's streamed text into chat deltas: content while it is plain text, the
arguments of a named call as they come, and parsed calls once the choice ends.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from tandem.sampling_params import StructuredOutputsParams
from tandem.server import TOOL_CALL_PARSERS  # noqa: F401  (the parsers below, by name)
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
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[FunctionCall]]:
    """Hermes-style calls (Qwen2.5's template asks for them): `<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>` blocks, the last one possibly unclosed (the model stopped at
    its end-of-turn token). Returns (the text before the first block, None if blank; the calls). A
    block that is not such an object makes the whole text content and no call (vLLM's rule)."""
    start = text.find(_HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for closed, unclosed in _HERMES_CALL.findall(text[start:]):
        try:
            obj = json.loads(closed or unclosed)
        except ValueError:
            return text, []
        arguments = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(arguments, dict):
            return text, []
        calls.append(FunctionCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False)))
    content = text[:start]
    return (content if content.strip() else None), calls


# ---------------------------------------------------------------- a request's choice
@dataclass(frozen=True)
class ToolChoice:
    """How one chat request's reply becomes tool calls (see the module docstring)."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[dict[str, Any], ...] = ()  # each {"name", "parameters"} (the parameters' schema)
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str | None = None  # "auto"'s parser

    @property
    def makes_calls(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint a named or "required" choice puts on the output (a
        JSON schema; llguidance's "x-guidance" keeps it in _LAYOUT unless the schema sets its own)."""
        if self.mode == "named":
            schema = dict(next(t["parameters"] for t in self.tools if t["name"] == self.name))
        elif self.mode == "required":
            defs: dict[str, Any] = {}
            items = []
            for t in self.tools:  # each tool's $defs move to the root, where its "#/$defs/..." refs point
                parameters = dict(t["parameters"])
                if _defs(parameters):
                    defs.update(parameters.pop("$defs"))
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

    def parse(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """(content, calls) of a finished choice's text. Text that does not hold calls stays
        content (a choice cut short by max_tokens, for one)."""
        if self.mode == "named":
            return None, [FunctionCall(name=self.name, arguments=text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                calls = [FunctionCall(name=item["name"], arguments=json.dumps(item["parameters"], ensure_ascii=False))
                         for item in items]
            except (ValueError, TypeError, KeyError):
                return text, []
            return None, calls
        if self.mode == "auto":
            content, calls = parse_hermes(text)
            return content, calls if self.parallel else calls[:1]
        return text, []

    def finish_reason(self, calls: list[FunctionCall], finish: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model chose to call ("auto", "required") and stopped by itself."""
        if calls and finish == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish


def tools_for_template(request) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template takes them (OpenAI's dicts, unset fields left out)."""
    tools = getattr(request, "tools", None)
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def tool_choice(request: ChatCompletionRequest, auto_parser: str | None, constrained: bool = False) -> ToolChoice:
    """The request's ToolChoice, checked (ToolChoiceError names the field). auto_parser: the
    server's tool-call parser, None without --enable-auto-tool-choice; constrained: the request
    constrains its output itself (response_format, structured_outputs or guided_*)."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice("none")
    if not tools:
        raise ToolChoiceError(f"'tool_choice' {_shown(choice)} needs 'tools' to choose from; give 'tools' or drop "
                              "'tool_choice'", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ToolChoiceError(f"'tools' names the function {dup!r} twice; give each function once", "tools")
    specs = tuple({"name": t.function.name, "parameters": t.function.parameters or _ANY_OBJECT} for t in tools)
    if choice == "required":
        seen: dict[str, Any] = {}
        for spec in specs:
            for key, value in _defs(spec["parameters"]).items():
                if seen.setdefault(key, value) != value:
                    raise ToolChoiceError(f"'tools': two functions' parameters define '$defs' {key!r} differently, and "
                                          "tool_choice \"required\" puts them in one schema; rename one", "tools")
    if constrained and choice != "auto":
        raise ToolChoiceError(f"'tool_choice' {_shown(choice)} constrains the output to tool calls, and the request "
                              "constrains it too ('response_format', 'structured_outputs' or 'guided_*'); drop one",
                              "tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise ToolChoiceError("'tool_choice' \"auto\" (the default with 'tools') needs the server started with "
                                  "--enable-auto-tool-choice --tool-call-parser hermes; start it so, or send "
                                  "'tool_choice' \"required\", a named function or \"none\"", "tool_choice")
        return ToolChoice("auto", specs, parallel=request.parallel_tool_calls, parser=auto_parser)
    if choice == "required":
        return ToolChoice("required", specs, parallel=request.parallel_tool_calls)
    name = choice.function.name
    if name not in names:
        raise ToolChoiceError(f"'tool_choice' names the function {name!r}, which is not in 'tools' ({names}); name one "
                              "of them", "tool_choice")
    return ToolChoice("named", specs, name=name)


def _defs(parameters: dict[str, Any]) -> dict[str, Any]:
    defs = parameters.get("$defs")
    return defs if isinstance(defs, dict) else {}


def _shown(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


# ---------------------------------------------------------------- streaming
@dataclass
class ToolStream:
    """One streamed choice's text -> its deltas under a ToolChoice. feed(text) takes each new piece
    of the choice's text; finish() the choice's end. The deltas carry what the whole response would:
    the content before the calls, then the calls (a named call's arguments as they come)."""

    choice: ToolChoice
    text: str = ""
    sent: int = 0  # characters of text sent as content ("auto") or arguments ("named")
    call_id: str | None = None
    calls: list[FunctionCall] = field(default_factory=list)

    def feed(self, piece: str) -> DeltaMessage | None:
        self.text += piece
        if self.choice.mode == "named":
            return self._arguments()
        if self.choice.mode == "auto":
            end = _plain_end(self.text)
            if end > self.sent:
                delta = DeltaMessage(content=self.text[self.sent:end])
                self.sent = end
                return delta
        return None  # "required": the calls come whole, at the end

    def finish(self) -> DeltaMessage | None:
        if self.choice.mode == "named":
            return self._arguments()
        content, self.calls = self.choice.parse(self.text)
        if not self.calls:  # plain text after all: whatever was held back is content
            return DeltaMessage(content=self.text[self.sent:]) if self.sent < len(self.text) else None
        rest = (content or "")[self.sent:] if content is not None and len(content) > self.sent else None
        calls = [DeltaToolCall(index=i, id=random_id("chatcmpl-tool"), type="function",
                               function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                 for i, c in enumerate(self.calls)]
        return DeltaMessage(content=rest, tool_calls=calls)

    def _arguments(self) -> DeltaMessage | None:
        if self.call_id is None:  # the call's first piece: its id and name
            self.call_id = random_id("chatcmpl-tool")
            self.sent = len(self.text)
            return DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=self.call_id, type="function",
                                                          function=DeltaFunctionCall(name=self.choice.name,
                                                                                     arguments=self.text))])
        if len(self.text) == self.sent:
            return None
        piece, self.sent = self.text[self.sent:], len(self.text)
        return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))])


def _plain_end(text: str) -> int:
    """How much of text is surely plain content: up to the first call's start, holding back a tail
    that could still become one, and blank text (content before calls is None when blank)."""
    end = text.find(_HERMES_START)
    if end < 0:
        end = len(text)
        for n in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):
            if _HERMES_START.startswith(text[-n:]):
                end = len(text) - n
                break
    return end if text[:end].strip() else 0
