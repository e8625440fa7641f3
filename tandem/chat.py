"""Chat messages -> the chat template's input, prepared as vLLM prepares them (for LLM.chat and the server)."""
from __future__ import annotations

import codecs
import functools
import json
import os
import re
from typing import Any

from tandem.errors import ConfigError, RequestError


def load_chat_template(value: str, flag: str = "--chat-template") -> str:
    """A chat template given as a file or as its text (vLLM's --chat-template): a path to an existing
    file is read; text with template syntax ('{', '}' or a line break) is the template itself, its
    backslash escapes (\\n) read as in a string literal; anything else is a missing file (ConfigError)."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{flag}: the template file {value!r} could not be read ({e})") from None
    if not any(c in value for c in "{}\n"):
        raise ConfigError(f"{flag}: {value!r} is neither a file nor a template's text; give the path of a Jinja "
                          "template file, or the template itself")
    try:  # characters past latin-1 pass through as escapes of their own
        return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag}: the template's text has a broken backslash escape ({e.reason}); write a "
                          "backslash as \\\\, or give the template as a file") from None


# A message's keys that reach the template (vLLM's): others are dropped.
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content", "tools",
                "task")
# Content part types that are text (the Responses API's too), and the key holding it.
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def text_message(message: dict, content_format: str = "string") -> dict:
    """The message as chat templates take it (vLLM's preparation): its content's text parts (and
    plain strings among them) joined by newlines ("string", most templates), or as a list of text
    parts for a template that loops over them ("openai": content_format()); null content as none
    (""); other part types refused by name. An assistant message's tool-call arguments, JSON text
    in OpenAI's format, are parsed into the object templates print (empty or null: {}), and an
    empty tool_calls list is dropped; reasoning and reasoning_content both carry the thinking;
    keys a template is not given (MESSAGE_KEYS) are left out."""
    if not isinstance(message, dict):
        raise RequestError(f"a message must be a dict with 'role' and 'content'; got {type(message).__name__}")
    if not isinstance(message.get("role"), str) or not message["role"]:
        raise RequestError(f"a message's role {message.get('role')!r} is invalid: give a string such as 'user'")
    content = message.get("content")
    if not (content is None or isinstance(content, (str, list))):
        raise RequestError(f"a message's content {content!r} is invalid: give a string, a list of text parts or None")
    texts = [content] if isinstance(content, str) else [part_text(part) for part in content or []]
    message = {k: v for k, v in message.items() if k in MESSAGE_KEYS}
    message["content"] = [{"type": "text", "text": t} for t in texts] if content_format == "openai" \
        else "\n".join(texts)
    for key, other in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
        if message.get(key) is not None and message.get(other) is None:
            message[other] = message[key]
    calls = message.get("tool_calls")
    if isinstance(calls, list) and not calls:
        del message["tool_calls"]  # the template's plain assistant turn
    elif isinstance(calls, list):
        message["tool_calls"] = [_parsed_arguments(c, i) for i, c in enumerate(calls)]
    return message


def part_text(part: Any) -> str:
    """A content part's text (a plain string is one); RequestError naming another part type."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
    if key is not None and not isinstance(part.get(key), str):
        raise RequestError(f"a {kind!r} content part needs a string {key!r} field; got {part.get(key)!r}")
    if key is None:
        what = f"a {kind!r} part" if isinstance(kind, str) else f"{part!r}"
        raise RequestError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported; got {what}")
    return part[key]


def content_format(template: Any) -> str:
    """vLLM's detection of how a chat template takes content: "openai" (a list of parts) when it
    loops over a message's content, else "string"."""
    if isinstance(template, dict):
        template = template.get("default")
    return _content_format(template) if isinstance(template, str) else "string"


def developer_as_system(messages: list[dict], template: Any) -> list[dict]:
    """OpenAI's developer messages (its newer name for system ones) as system messages for a
    template that names no developer role (Qwen's, Llama's: it would drop them without a word);
    one that does (gpt-oss's) gets them as they are."""
    templates = list(template.values()) if isinstance(template, dict) else [template]
    if any(isinstance(t, str) and _DEVELOPER_ROLE.search(t) for t in templates) or not any(
            isinstance(t, str) for t in templates):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


# A template that compares a role with 'developer' (the word elsewhere, "for developers", is no sign).
_DEVELOPER_ROLE = re.compile(r"""(['"])developer\1""")


@functools.lru_cache(maxsize=16)
def _content_format(template: str) -> str:
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter):  # message['content'] | selectattr(...)
            it = it.node
        if (isinstance(it, nodes.Getattr) and it.attr == "content") or (
                isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content"):
            return "openai"
    return "string"


def _parsed_arguments(call: Any, i: int) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), dict):
        return call
    if not isinstance(function.get("arguments"), (str, type(None))):
        raise RequestError(f"tool_calls.{i}.function.arguments={function['arguments']!r} is invalid: give the "
                           "arguments as a JSON object's text, as the reply that made the call gave them")
    if not function.get("arguments"):  # none: no arguments (vLLM's)
        return {**call, "function": {**function, "arguments": {}}}
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError) as e:  # (RecursionError: nested past json's limit, ~1,000 levels)
        raise RequestError(f"tool_calls.{i}.function.arguments is not JSON ({e}); give the arguments as a JSON "
                           "object's text, as the reply that made the call gave them") from None
    return {**call, "function": {**function, "arguments": arguments}}


def template_kwargs(chat_template: str | None, add_generation_prompt: bool, continue_final_message: bool,
                    tools: list | None = None, extra: dict[str, Any] | None = None,
                    documents: list | None = None) -> dict[str, Any]:
    """apply_chat_template's keyword arguments: extra (chat_template_kwargs) override the others, as
    in vLLM, except a null chat_template, which would unset the template given (vLLM drops it too);
    tokenize and conversation stay the caller's; documents (a RAG template's) only when given."""
    kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, tools=tools)
    if documents is not None:
        kwargs["documents"] = documents
    kwargs.update({k: v for k, v in (extra or {}).items()
                   if k not in ("tokenize", "conversation") and not (k == "chat_template" and v is None)})
    return kwargs
