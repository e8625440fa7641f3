"""Chat messages -> the chat template's input, prepared as vLLM prepares them (for LLM.chat and the server)."""
from __future__ import annotations

import codecs
import json
import os
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


def text_message(message: dict) -> dict:
    """The message as chat templates take it (vLLM's preparation): OpenAI-style content parts joined
    into its text by newlines (other part types are refused), and an assistant message's tool-call
    arguments, JSON text in OpenAI's format, parsed into the object templates print."""
    if not isinstance(message, dict):
        raise RequestError(f"a message must be a dict with 'role' and 'content'; got {type(message).__name__}")
    if not isinstance(message.get("role"), str) or not message["role"]:
        raise RequestError(f"a message's role {message.get('role')!r} is invalid: give a string such as 'user'")
    content = message.get("content")
    if not (content is None or isinstance(content, (str, list))):
        raise RequestError(f"a message's content {content!r} is invalid: give a string, a list of text parts or None")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise RequestError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        message = {**message, "content": "\n".join(part["text"] for part in content)}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and any(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                       and isinstance(c["function"].get("arguments"), str) for c in calls):
        message = {**message, "tool_calls": [_parsed_arguments(c, i) for i, c in enumerate(calls)]}
    return message


def _parsed_arguments(call: Any, i: int) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError as e:
        raise RequestError(f"tool_calls.{i}.function.arguments is not JSON ({e}); give the arguments as a JSON "
                           "object's text, as the reply that made the call gave them") from None
    return {**call, "function": {**function, "arguments": arguments}}


def template_kwargs(chat_template: str | None, add_generation_prompt: bool, continue_final_message: bool,
                    tools: list | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """apply_chat_template's keyword arguments: extra (chat_template_kwargs) override the others, as
    in vLLM; tokenize and conversation stay the caller's."""
    kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, tools=tools)
    kwargs.update({k: v for k, v in (extra or {}).items() if k not in ("tokenize", "conversation")})
    return kwargs
