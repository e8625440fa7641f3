"""Chat messages -> the chat template's input, prepared as vLLM prepares them (for LLM.chat and the server)."""
from __future__ import annotations

from typing import Any

from tandem.errors import RequestError


def text_message(message: dict) -> dict:
    """The message with its OpenAI-style content parts joined into its text (vLLM joins text parts
    with newlines); other part types are refused."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
               for part in content):
        raise RequestError("only text content parts ({'type': 'text', 'text': ...}) are supported")
    return {**message, "content": "\n".join(part["text"] for part in content)}


def template_kwargs(chat_template: str | None, add_generation_prompt: bool, continue_final_message: bool,
                    tools: list | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """apply_chat_template's keyword arguments: extra (chat_template_kwargs) override the others, as
    in vLLM; tokenize and conversation stay the caller's."""
    kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, tools=tools)
    kwargs.update({k: v for k, v in (extra or {}).items() if k not in ("tokenize", "conversation")})
    return kwargs
