"""The prompts LLM.generate and Engine.add_request take: vLLM's TypedDicts (plain dicts at run time, so
code written against vLLM's `TextPrompt(prompt=...)` / `TokensPrompt(prompt_token_ids=...)` runs as is), a
string, or token ids; `prompt_token_ids` turns any of them into token ids."""
from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from tandem.errors import RequestError


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer."""

    prompt: str
    cache_salt: NotRequired[str]  # shares cached prefix blocks only with prompts of the same salt


class TokensPrompt(TypedDict):
    """A prompt as token ids (prompt: its text, shown in the output, if given)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


# vLLM's prompt keys tandem has no use for -> why.
_REFUSED_PROMPT_KEYS = {
    "multi_modal_data": "this engine serves text-only models",
    "mm_processor_kwargs": "this engine serves text-only models",
    "prompt_embeds": "prompts are text or token ids here, not embeddings",
}


def check_prompt_keys(prompt: dict) -> None:
    """RequestError for a dict prompt's key tandem would otherwise drop without a word."""
    for key in prompt:
        if key in _REFUSED_PROMPT_KEYS:
            raise RequestError(f"a prompt's {key!r} is not supported: {_REFUSED_PROMPT_KEYS[key]}; leave it out")
        if key not in ("prompt", "prompt_token_ids", "cache_salt"):
            raise RequestError(f"a prompt dict takes 'prompt', 'prompt_token_ids' and 'cache_salt'; {key!r} is "
                               "not one of them")


def check_encodable(text: str, what: str) -> None:
    """A RequestError for text the tokenizer would refuse with a bare TypeError (`lone_surrogate`)."""
    from tandem.sampling_params import lone_surrogate

    at = lone_surrogate(text)
    if at is not None:
        raise RequestError(f"{what} holds {text[at]!r} at index {at}, a lone surrogate, which is not valid "
                           "Unicode: decode the text with errors='replace' or remove it")


def add_special_tokens(tokenization_kwargs: Any, default: bool) -> bool:
    """vLLM's tokenization_kwargs (None, or a dict of the tokenizer's arguments) -> whether a text prompt
    gets the tokenizer's special tokens (a BOS); RequestError for the arguments tandem does not take."""
    if tokenization_kwargs is None:
        return default
    if not isinstance(tokenization_kwargs, dict):
        raise RequestError(f"tokenization_kwargs must be a dict such as {{'add_special_tokens': False}}, got "
                           f"{type(tokenization_kwargs).__name__}")
    other = sorted(set(tokenization_kwargs) - {"add_special_tokens"}, key=repr)
    if other:
        raise RequestError(f"tokenization_kwargs {other} are not supported: tandem takes add_special_tokens alone "
                           "(cut a prompt with SamplingParams.truncate_prompt_tokens)")
    value = tokenization_kwargs.get("add_special_tokens", default)
    if not isinstance(value, bool):
        raise RequestError(f"tokenization_kwargs add_special_tokens={value!r} must be True or False")
    return value


def prompt_token_ids(prompt: Any, tokenizer, special_tokens: bool = True,
                     ids: bool = False) -> tuple[list[int], str | None, bool]:
    """A prompt (a string, a TextPrompt or TokensPrompt dict, or with ids token ids themselves: Engine.add_request's
    form) -> (its token ids, its text or None, whether the ids were tokenized here from the text, with
    special_tokens); RequestError otherwise."""
    from tandem.engine.engine import as_token_ids

    if isinstance(prompt, dict):
        check_prompt_keys(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise RequestError(f"a prompt's 'prompt' (its text, beside prompt_token_ids) must be a string, got "
                               f"{type(text).__name__}")
        return as_token_ids(prompt["prompt_token_ids"]), text, False
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("string prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead")
        check_encodable(prompt, "the prompt")
        return tokenizer(prompt, add_special_tokens=special_tokens).input_ids, prompt, True
    if ids and not isinstance(prompt, dict):
        return as_token_ids(prompt), None, False
    raise RequestError("a prompt must be a string, a {'prompt': str} dict or a {'prompt_token_ids': [...]} "
                       f"dict, got {type(prompt).__name__}")
