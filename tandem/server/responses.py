"""OpenAI's Responses API (POST /v1/responses, as vLLM serves it) as a translation of chat completions.

A request becomes a ChatCompletionRequest (`chat_request`): `instructions` a system message,
`input` (a string, or items: messages, and the `function_call` / `function_call_output` items of
earlier turns) the messages, `max_output_tokens`, `tools` (function tools, given flat),
`tool_choice`, `text.format` (the response_format) and `top_logprobs`; vLLM's extra sampling
fields pass through. It then runs as a chat completion, and `ResponseBuilder` tells the result
as a Response: the chat reply as output items (`reasoning`, `message` with one `output_text`
part, `function_call`), the chat stream's chunks as the Responses stream's typed events, each
with its sequence number. A server started with `--responses-store-size N` keeps the last N
responses in a `ResponseStore` (`store` true, the default): `previous_response_id` continues one,
and GET / DELETE /v1/responses/{id} read and drop one; without it nothing is stored (`store`
answered false) and `previous_response_id` and `background` are refused. A `background` response
is a `BackgroundRun`: generated apart from the request that started it, its events kept, so GET
reads it as far as it went (or streams it, from any sequence number) and POST .../cancel stops it.
No FastAPI, no engine.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.chat import part_text
from tandem.errors import RequestError
from tandem.sampling_params import SamplingParams
from tandem.server.protocol import REASONING_EFFORTS, ChatCompletionChunk, ChatCompletionRequest, ChatLogprobs, Items, \
    UsageInfo, _SamplingRequest, _unset

logger = logging.getLogger(__name__)

# Fields of the Responses API that tandem refuses -> why (each a 400 naming the field when set).
REFUSED_FIELDS = {
    "conversation": "conversations are not stored here; send the whole conversation in 'input'",
    "prompt": "prompt templates are not supported; send the text in 'input'",
    "max_tool_calls": "a cap on tool calls is not supported; leave it out",
    "previous_input_messages": "vLLM's earlier messages are not taken; send the whole conversation in 'input' (or "
                               "'previous_response_id' with --responses-store-size)",
    "enable_response_messages": "vLLM's input_messages / output_messages are not returned; leave it out",
}
# OpenAI's include values: "message.output_text.logprobs" adds the output's logprobs; the others name what
# tandem does not produce (images, tool outputs, encrypted reasoning), so there is nothing to add
INCLUDE_VALUES = ("message.output_text.logprobs", "reasoning.encrypted_content", "code_interpreter_call.outputs",
                  "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
                  "web_search_call.action.sources", "web_search_call.results")
# A chat field's name in errors -> the Responses field it came from.
FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format"}


class ResponsesRequestError(ValueError):
    """A Responses request that cannot be served; param names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param




class ResponsesRequest(_SamplingRequest):
    """POST /v1/responses. vLLM's extra sampling fields (top_k, seed, stop, ...) are taken as in chat."""

    input: str | Items[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None  # the output text's logprobs with this many alternatives
    include: Items[str] | None = None  # "message.output_text.logprobs" asks for the logprobs too
    tools: Items[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # its effort reaches the template as reasoning_effort
    store: bool | None = None  # False: not kept (kept only on a server with --responses-store-size)
    truncation: str | None = None  # "disabled" (OpenAI's default); "auto" is refused
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    background: bool = False
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    previous_input_messages: Any = None  # vLLM's; refused
    enable_response_messages: Any = None  # vLLM's; refused
    # vLLM's chat extras, taken here too
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (Qwen3's enable_thinking)
    include_reasoning: bool = True  # with a reasoning parser: the thinking as a reasoning item (False: dropped)

    def refused_field(self) -> tuple[str, str] | None:
        """(field, why) for the first field set that tandem does not serve."""
        for name, why in REFUSED_FIELDS.items():
            if not _unset(getattr(self, name)):  # (null, false and empty ask for nothing)
                return name, why
        if self.truncation not in (None, "disabled"):
            return "truncation", f"truncation {self.truncation!r} is not supported; leave it out or give 'disabled'"
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            return "reasoning.effort", (f"reasoning.effort={effort!r} is invalid: give one of "
                                        f"{', '.join(map(repr, REASONING_EFFORTS))}, or leave it out")
        bad = next((item for item in self.include or () if item not in INCLUDE_VALUES), None)
        if bad is not None:
            return "include", f"include {bad!r} is not one of OpenAI's values ({', '.join(map(repr, INCLUDE_VALUES))})"
        if self.n != 1:
            return "n", "a response has one output; leave 'n' out"
        if self.prompt_logprobs is not None:
            return "prompt_logprobs", "a response carries no prompt logprobs; ask /v1/completions for them"
        return None

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or [])


# The Response's error codes OpenAI defines that a server's errors map to (others: server_error).
RESPONSE_ERROR_CODES = {"queue_full": "rate_limit_exceeded"}
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class BackgroundRun:
    """A background response: generated by a task of its own (`start`), not by the request that
    asked for it, which is answered at once. Every event of the response is kept (`events[i]` has
    sequence number i), so a reader can follow it from any point (`follow`) while it runs and after;
    `snapshot` is the Response object as far as it went. on_finish gets the last Response object
    (completed, incomplete, failed or cancelled) once."""

    def __init__(self, builder: "ResponseBuilder", on_finish: Callable[[dict[str, Any]], None],
                 inputs: list[dict[str, Any]] = ()):
        self.builder = builder
        self.id = builder.id
        self.inputs = list(inputs)  # the items the response is made from (ResponseStore.inputs)
        self.events: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None  # the last Response object, once it ended
        self.task: asyncio.Task | None = None
        self._on_finish = on_finish
        self._wake = asyncio.Event()  # set (and replaced) whenever an event is added or the run ends
        builder.on_event = self.record

    @property
    def done(self) -> bool:
        return self.final is not None

    def start(self, work) -> None:
        """Run the coroutine work (it generates the response, its builder making the events)."""
        self.task = asyncio.create_task(work)
        self.task.add_done_callback(self._ended)

    def record(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if event["type"] in TERMINAL_EVENTS:
            self._finish(event["response"])
        self._notify()

    def snapshot(self) -> dict[str, Any]:
        if self.final is not None:
            return self.final
        return self.builder.response("in_progress" if self.events else "queued", list(self.builder.items))

    async def cancel(self, keep: bool = True) -> dict[str, Any]:
        """Stop the run (its engine requests are aborted) -> the Response object: cancelled, or how
        it ended if it ended first. keep False: on_finish is not told (the response is being dropped)."""
        if not keep:
            self._on_finish = lambda response: None
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait([self.task])
        if self.final is None:
            self._finish(self._cut("cancelled"))
        return self.final

    async def follow(self, starting_after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """The events after sequence number starting_after: those kept, then each as it comes, until the end."""
        i = max(starting_after + 1, 0)
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await self._wake.wait()

    def _cut(self, status: str) -> dict[str, Any]:
        """The response as far as it went, ended with status (its open item incomplete)."""
        if self.builder.open is not None:
            self.builder.open["status"] = "incomplete"
        return self.builder.response(status, self.builder.items)

    def _ended(self, task: asyncio.Task) -> None:
        """The task ended without a last event (it failed outside the stream, or was cancelled)."""
        if self.final is None and not task.cancelled():
            error = task.exception()
            logger.error("background response %s failed outside its stream: %r", self.id, error)
            response = self._cut("failed")
            message = f"internal error: {error!r}" if error is not None else "the response ended without its last event"
            response["error"] = {"code": "server_error", "message": message}
            self._finish(response)
            self._notify()

    def _finish(self, response: dict[str, Any]) -> None:
        if self.final is None:
            self.final = response
            self._on_finish(response)
            self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()


class ResponseStore:
    """The last `size` stored responses (least recently stored or read dropped first): each one's
    Response object and its conversation as input items (its own input, after those of the
    responses it continued, then its output), which a request continuing it puts before its input.
    A previous response's instructions are not carried over (OpenAI's rule). Background runs are
    kept beside them: one still running is never dropped (nor counted in size), and a finished
    one's events stay while its response does."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._runs: dict[str, BackgroundRun] = {}

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        self._entries[response["id"]] = (response, items)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.size:
            dropped, _ = self._entries.popitem(last=False)
            self._runs.pop(dropped, None)

    def start(self, run: BackgroundRun) -> None:
        self._runs[run.id] = run

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]] | None] | None:
        """(the Response object, its conversation), or None if not kept; a background response
        still running has no conversation yet (None)."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
            return entry
        run = self._runs.get(response_id)
        return (run.snapshot(), None) if run is not None else None

    def inputs(self, response_id: str) -> list[dict[str, Any]] | None:
        """The items a kept response was made from (the conversation it continued, then its own
        input: OpenAI's input items), or None if it is not kept."""
        entry = self._entries.get(response_id)
        if entry is not None:
            response, conversation = entry
            return conversation[:len(conversation) - len(response["output"])]
        run = self._runs.get(response_id)
        return run.inputs if run is not None else None

    def run(self, response_id: str) -> BackgroundRun | None:
        """The response's background run (running or finished), if it was one and is still kept."""
        return self._runs.get(response_id)

    def running(self) -> list[BackgroundRun]:
        return [run for run in self._runs.values() if not run.done]

    def delete(self, response_id: str) -> bool:
        run = self._runs.pop(response_id, None)
        return self._entries.pop(response_id, None) is not None or run is not None


def input_items(body: ResponsesRequest, previous: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The conversation the request continues (previous: a stored response's items) and its input,
    as items; each of the input's items without an id is given one (GET .../input_items names it)."""
    mine = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if isinstance(mine, list):  # (anything else is refused by chat_request)
        mine = [item if not isinstance(item, dict) or "id" in item else {"id": _item_id(item), **item} for item in mine]
    return (previous or []) + list(mine)


_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _item_id(item: dict[str, Any]) -> str:
    """A fresh id for an input item, prefixed by its type as OpenAI's are (any type: chat_request
    refuses a bad one by name)."""
    kind = item.get("type", "message")
    return _id(_ITEM_PREFIXES.get(kind, "item") if isinstance(kind, str) else "item")


def input_item_resource(item: dict[str, Any]) -> dict[str, Any]:
    """A stored input item as GET /v1/responses/{id}/input_items lists it (OpenAI's item objects):
    a message's text content as one text part (input_text; an assistant's output_text), and a
    status where it has none."""
    item = dict(item)
    if item.get("type", "message") == "message":
        item["type"] = "message"
        if isinstance(item.get("content"), str):
            part = ({"type": "output_text", "text": item["content"], "annotations": []} if item.get("role") == "assistant"
                    else {"type": "input_text", "text": item["content"]})
            item["content"] = [part]
    item.setdefault("status", "completed")
    return item


def chat_request(body: ResponsesRequest, items: list[dict[str, Any]] | None = None,
                 num_previous: int = 0) -> ChatCompletionRequest:
    """The chat completion that serves the request (ResponsesRequestError names a bad field);
    items: the input items to use instead of body.input (input_items), whose first num_previous
    come from a stored response (an error names the request's own item: 'input.0' is its first)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += _input_messages(body.input if items is None else items, num_previous)
    if not messages:
        raise ResponsesRequestError("'input' is empty: give a string or at least one message", "input")
    payload = {name: getattr(body, name) for name in _SamplingRequest.model_fields}
    kwargs = dict(body.chat_template_kwargs or {})
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:  # as vLLM: the template decides what an effort means (most ignore it)
        kwargs.setdefault("reasoning_effort", effort)
    payload.update(messages=messages, max_tokens=body.max_output_tokens, parallel_tool_calls=body.parallel_tool_calls,
                   tools=_tools(body.tools), tool_choice=_tool_choice(body.tool_choice, bool(body.tools)),
                   chat_template_kwargs=kwargs or None, include_reasoning=body.include_reasoning)
    fmt = _response_format(body.text)
    if fmt is not None:  # vLLM's response_format and friends, when given instead, stay as they are
        payload["response_format"] = fmt
    if body.wants_logprobs:
        payload.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    return ChatCompletionRequest.model_validate(payload)


def _input_messages(items: str | list[dict[str, Any]], num_previous: int = 0) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; items are messages (a developer
    message a system one unless the template names that role; each its own), function calls (joined to the assistant message before them, if any)
    and their outputs (tool messages); a reasoning item's text is the next assistant message's
    reasoning_content (templates that print it do). A stored response's function call that its
    max_output_tokens cut (status incomplete) is left out: it was never a call."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ResponsesRequestError("'input' must be a string or a list of items (objects)", "input")
    thinking: str | None = None  # a reasoning item's text, for the assistant turn it precedes

    def assistant(new: bool = False) -> dict[str, Any]:
        """The assistant message of this turn: the one just before, or a new one (new: always)."""
        nonlocal thinking
        if new or not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": None})
        if thinking is not None:  # Qwen3's template prints it inside a tool-calling turn
            out[-1]["reasoning_content"], thinking = thinking, None
        return out[-1]

    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input.{i - num_previous}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesRequestError(f"'{where}.role' is {role!r}; give 'user', 'system', 'developer' or "
                                            "'assistant'", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                assistant(new=True)["content"] = text
            else:
                out.append({"role": role, "content": text})  # developer: as the chat route takes it
                thinking = None  # a thinking belongs to the assistant turn right after it
        elif kind == "function_call" and i < num_previous and item.get("status") == "incomplete":
            continue
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            assistant().setdefault("tool_calls", []).append(call)  # with the turn's text and its other calls
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
            thinking = None
        elif kind == "reasoning":
            key = "content" if item.get("content") else "summary"
            parts = item.get(key) or []
            if not isinstance(parts, list):
                raise ResponsesRequestError(f"'{where}.{key}' must be a list of text parts", f"{where}.{key}")
            thinking = "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise ResponsesRequestError(f"'{where}' is a {kind!r} item; this server takes 'message', 'function_call',"
                                        " 'function_call_output' and 'reasoning' items", f"{where}.type")
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ResponsesRequestError(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined by newlines (as chat joins its parts;
    a refusal part is its text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        try:
            return "\n".join(part_text(p) for p in content)  # chat's reading of a part
        except RequestError:
            pass
    raise ResponsesRequestError(f"'{where}' must be a string or text parts ({{'type': 'input_text', 'text': ...}}); "
                                "this server takes text only", where)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools, flat in the Responses API, as chat's {"type": "function", "function": {...}}."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ResponsesRequestError(f"'tools.{i}' is a {tool.get('type')!r} tool; this server calls function "
                                        "tools ('type': 'function') only", f"tools.{i}.type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                           "strict") if tool.get(k) is not None}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None, has_tools: bool) -> str | dict[str, Any] | None:
    """tool_choice as chat's; "auto" without tools (the Responses API's defaults, which a client may send
    back) is plain text."""
    if choice == "auto" and not has_tools:
        return None
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesRequestError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': "
                                "...}", "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None: free text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ResponsesRequestError("'text.format' must be an object: {'type': 'text' | 'json_object' | "
                                    "'json_schema', ...}", "text.format")
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:  # OpenAI's (and vLLM's) required fields
            raise ResponsesRequestError("'text.format.name' is required with type 'json_schema': name the schema",
                                        "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise ResponsesRequestError("'text.format.schema' is required with type 'json_schema': give a JSON "
                                        "schema (an object)", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise ResponsesRequestError(f"'text.format' type {fmt.get('type')!r} is not one of 'text', 'json_object', "
                                "'json_schema'", "text.format")


def renamed(message: str, param: str | None) -> tuple[str, str | None]:
    """An error of the chat path in the Responses API's names: 'messages' (and 'messages.3', whose
    index counts chat messages, not input items) -> 'input', 'max_tokens' -> 'max_output_tokens',
    'response_format' -> 'text.format', 'tools.0.function.name' -> 'tools.0.name'."""
    message = re.sub(r"\bmessages(\.\d+)?\b", "input", message)
    for chat, name in FIELD_NAMES.items():
        if chat != "messages":
            message = re.sub(rf"\b{chat}\b", name, message)
    message = re.sub(r"\b(tools\.\d+)\.function\b", r"\1", message)
    if param is not None:
        head = param.split(".")[0]
        param = "input" if head == "messages" else FIELD_NAMES.get(param, param)
        param = re.sub(r"^(tools\.\d+)\.function\b", r"\1", param)
    return message, param


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response: the Response object and, when streaming, its events from the chat chunks."""

    def __init__(self, body: ResponsesRequest, model: str, on_done=None, stored: bool = False):
        """on_done: called with the final Response object (a store's put); stored: whether it will be."""
        self.id, self.model, self.body = body.request_id or _id("resp"), model, body  # vLLM's request_id
        self.params: SamplingParams | None = None  # what sampling uses (the renderer sets it): the reported values
        self.on_done, self.stored = on_done, stored
        self.on_event: Callable[[dict[str, Any]], None] | None = None  # sees every event made (a BackgroundRun)
        self.created_at = int(time.time())
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []  # the output items streamed, in order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # a chat tool call's index -> its function_call item
        self.finish_reason: str | None = None
        # Logprobs of tokens no message has shown yet (thinking, a call before any text): as in the whole
        # response (and vLLM's), a message's logprobs are every output token's, so its first delta takes them.
        self.held_logprobs: list[dict[str, Any]] = []

    # ------------------------------------------------------------ the Response object
    def response(self, status: str, output: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata, "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature if self.params is None else self.params.temperature,
            "top_p": body.top_p if self.params is None else self.params.top_p, "top_logprobs": body.top_logprobs or 0,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning, "truncation": body.truncation or "disabled", "store": self.stored,
            "background": body.background, "previous_response_id": body.previous_response_id, "user": body.user,
        }

    @staticmethod
    def usage(usage: UsageInfo, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
        return {"input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": usage.total_tokens}

    def status(self, finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def _done(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.on_done is not None:
            self.on_done(response)
        return response

    # ------------------------------------------------------------ streaming
    def event(self, kind: str, **fields) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        if self.on_event is not None:
            self.on_event(event)
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response("in_progress", [])),
                self.event("response.in_progress", response=self.response("in_progress", []))]

    def on_chunk(self, chunk: ChatCompletionChunk) -> list[dict[str, Any]]:
        """The events of one chat chunk: thinking, then text, then tool calls (a chunk holds them in that order)."""
        events: list[dict[str, Any]] = []
        for choice in chunk.choices:
            delta = choice.delta
            logprobs = _logprobs(choice.logprobs)
            if delta.reasoning:
                events += self._text_delta("reasoning", delta.reasoning, [])
            if delta.content or (logprobs and self.open is not None and self.open["type"] == "message"):
                # Tokens that showed no text yet (part of a character, text held back) while the message
                # is open: an empty delta carries their logprobs, as chat's stream sends them without content.
                events += self._text_delta("message", delta.content or "", self.held_logprobs + logprobs)
                self.held_logprobs = []
            else:  # no message open: a tool call's tokens join the message before it (with no event:
                # its output_text.done was sent), thinking's and the first tokens' the next message
                message = next((item for item in reversed(self.items) if item["type"] == "message"), None)
                if message is not None:
                    message["content"][0]["logprobs"] += logprobs
                else:
                    self.held_logprobs += logprobs
            for call in delta.tool_calls:
                if call.index not in self.calls:
                    events += self._close()
                    item = _call_item(_id("fc"), call.id or _id("call"), call.function.name or "", "", "in_progress")
                    self.calls[call.index] = item
                    events += self._open(item)
                item = self.calls[call.index]
                if call.function.arguments:
                    item["arguments"] += call.function.arguments
                    events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                             output_index=self._index(item), delta=call.function.arguments))
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def finish(self, usage: UsageInfo, cached_tokens: int, reasoning_tokens: int) -> list[dict[str, Any]]:
        """The last events: the open item closed (an empty message when the reply had nothing), then
        the whole response."""
        status = self.status(self.finish_reason)
        events = []
        if not self.items:  # an empty message, with the logprobs of tokens that showed no text in its delta
            events = self._text_delta("message", "", self.held_logprobs) if self.held_logprobs \
                else self._open(_message_item(_id("msg"), "", [], "in_progress"))
            self.held_logprobs = []
        events += self._close("incomplete" if status == "incomplete" and not _whole_call(self.open) else "completed")
        response = self._done(self.response(status, self.items, self.usage(usage, cached_tokens, reasoning_tokens)))
        return events + [self.event(f"response.{status}", response=response)]

    def failed(self, message: str, code: str | None, param: str | None) -> list[dict[str, Any]]:
        """A stream the engine could not finish: the error, then the response as failed (its items
        as far as they went)."""
        if self.open is not None:
            self.open["status"] = "incomplete"
        response = self.response("failed", self.items)
        response["error"] = {"code": RESPONSE_ERROR_CODES.get(code, "server_error"), "message": message}
        return [self.event("error", message=message, code=code, param=param),
                self.event("response.failed", response=response)]

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        shown = {**item, "content": []} if "content" in item else dict(item)
        events = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=shown)]
        if "content" in item:
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=_empty(item)))
        return events

    def _text_delta(self, kind: str, text: str, logprobs: list) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item = _reasoning_item(_id("rs"), "", "in_progress") if kind == "reasoning" \
                else _message_item(_id("msg"), "", [], "in_progress")
            events += self._open(item)
        part = self.open["content"][0]
        part["text"] += text
        fields = dict(item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0, delta=text)
        if kind == "message":
            part["logprobs"] += logprobs
            events.append(self.event("response.output_text.delta", logprobs=logprobs, **fields))
        else:
            events.append(self.event("response.reasoning_text.delta", **fields))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self._index(item)
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     arguments=item["arguments"], name=item["name"]))
        else:
            part = item["content"][0]
            where = dict(item_id=item["id"], output_index=index, content_index=0)
            if item["type"] == "message":
                events.append(self.event("response.output_text.done", text=part["text"], logprobs=part["logprobs"],
                                         **where))
            else:
                events.append(self.event("response.reasoning_text.done", text=part["text"], **where))
            events.append(self.event("response.content_part.done", part=part, **where))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def _whole_call(item: dict[str, Any] | None) -> bool:
    """Whether item is a function call whose arguments are whole (the token limit cut the reply after it:
    a later call the parser dropped, or the text around the calls)."""
    if item is None or item["type"] != "function_call":
        return False
    try:
        json.loads(item["arguments"])
    except (ValueError, RecursionError):
        return False
    return True


def _message_item(item_id: str, text: str, logprobs: list, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    """The item's content part before any text."""
    part = item["content"][0]
    return {**part, "text": "", **({"logprobs": []} if "logprobs" in part else {})}


def _logprobs(logprobs: ChatLogprobs | None) -> list[dict[str, Any]]:
    """Chat's token logprobs in the output_text's shape (the same fields)."""
    if logprobs is None or not logprobs.content:
        return []
    return [lp.model_dump(mode="json") for lp in logprobs.content]
