"""The prompt dicts LLM.generate takes, as vLLM's TypedDicts (plain dicts at run time, so code
written against vLLM's `TextPrompt(prompt=...)` / `TokensPrompt(prompt_token_ids=...)` runs as is)."""
from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer."""

    prompt: str
    cache_salt: NotRequired[str]  # shares cached prefix blocks only with prompts of the same salt


class TokensPrompt(TypedDict):
    """A prompt as token ids (prompt: its text, shown in the output, if given)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]
