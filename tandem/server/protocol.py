"""Pydantic models of the OpenAI API: requests (with vLLM's extra sampling fields) and responses.

Requests ignore unknown fields, as OpenAI clients send new ones before servers know them.
`to_sampling_params` turns a request into tandem's SamplingParams, which does the range checks
(its RequestError names the field). Responses may carry vLLM's `metrics` object as an extra field
(tandem/server/response_metrics.py).
"""
from __future__ import annotations

import time
import uuid
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from tandem.chat import text_message
from tandem.errors import RequestError
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128  # choices per request: more would take the whole batch


class Items:
    """Items[T]: a request's list[T] whose validation stops at its first bad item (the error names
    that one): a body's list of 5M items of the wrong type made 5M errors, seconds on the event loop."""

    def __class_getitem__(cls, item):
        return Annotated[list[item], Field(fail_fast=True)]


# vLLM's extra request fields that tandem refuses -> what they would need.
UNSUPPORTED_FIELDS = {
    "logits_processors": "custom logits processors are not supported",
    "kv_transfer_params": "tandem does not disaggregate prefill from decode (it has no KV connector)",
    "mm_processor_kwargs": "tandem serves text-only models",
    "prompt_embeds": "prompts are text or token ids here; send them as 'prompt'",
    "structural_tag": "structural tags are not supported; hold the output with structured_outputs (json, regex, "
                      "choice or grammar) or response_format",
    "guided_whitespace_pattern": "a whitespace pattern is not supported; structured_outputs' disable_any_whitespace "
                                 "gives JSON without free whitespace",
}

# vLLM's older structured-output fields -> the StructuredOutputsParams field each sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# guided_decoding_backend values that name the one backend tandem has (llguidance, vLLM's "guidance").
GUIDED_BACKENDS = ("auto", "guidance", "llguidance")
# OpenAI's reasoning efforts (chat's reasoning_effort, the Responses API's reasoning.effort): passed to the
# chat template as reasoning_effort, as vLLM does (the template decides what one means; most ignore it)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _unset(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def _allows_none(annotation) -> bool:
    return annotation is None or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                  and type(None) in typing.get_args(annotation))


# Sampling fields beam search does not take (it ranks sequences by their logprobs alone) -> whether a
# value leaves that field unset.
_UNSET_UNDER_BEAM_SEARCH = {
    "top_p": lambda v: v is None or v == 1, "top_k": lambda v: v in (None, 0, -1),
    "min_p": lambda v: v is None or v == 0, "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0, "repetition_penalty": lambda v: v is None or v == 1,
    "logit_bias": _unset, "allowed_token_ids": _unset, "bad_words": _unset, "stop": _unset,
    "stop_token_ids": _unset, "min_tokens": lambda v: v == 0, "prompt_logprobs": lambda v: v is None,
}


class _Request(BaseModel):
    # strict: "5" is not an int and true is not a number; JSON ints still pass as floats.
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null for a field with a default means that default (OpenAI clients send
        `"n": null` and the like); fields that are nullable keep their null."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required() and not _allows_none(fields[k].annotation))}


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- errors
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


# ---------------------------------------------------------------- requests
class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | Items[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Items[int] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields (None here and in temperature / top_p: the model's generation
    # config default, else the engine's)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Items[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: Items[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    watermarking: bool | None = None  # False opts out of the server's --watermark-config (vLLM's field)
    priority: int = 0  # vLLM's: lower is scheduled first (needs --scheduling-policy priority)
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only among requests of one salt
    request_id: str | None = None  # vLLM's: the response's id is cmpl-/chatcmpl- and it (X-Request-Id wins)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob tokens as "token_id:N" (or the server flag)
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids in the reply
    vllm_xargs: dict[str, Any] | None = None  # vLLM's: SamplingParams.extra_args (for plugins; read by none)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs (StructuredOutputsParams'
    # fields) or its older guided_* fields; one of them per request.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Items[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's beam search: n beams, ranked by cum_logprob / length ** length_penalty (tandem/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM fields tandem does not implement: read only to refuse them, never ignored silently.
    logits_processors: Any = None
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None
    kv_transfer_params: Any = None
    mm_processor_kwargs: Any = None
    prompt_embeds: Any = None
    best_of: int | None = None  # only n (or null): n samples, each drawn on its own

    def unsupported_field(self) -> str | None:
        """The first vLLM field this request sets that tandem does not implement (None, false and
        empty count as unset; 0 does not)."""
        return next((name for name in UNSUPPORTED_FIELDS if not _unset(getattr(self, name))), None)

    def beam_search_conflict(self) -> str | None:
        """The first field this request sets that beam search does not take (sampling filters,
        penalties, biases, stops, constraints): vLLM ignores them; here they are refused."""
        return next((name for name, unset in _UNSET_UNDER_BEAM_SEARCH.items() if not unset(getattr(self, name))),
                    next(iter(self.constraint_fields()), None))

    def _params(self, max_tokens: int | None, logprobs: int | None, defaults: dict | None) -> SamplingParams:
        """defaults: the server's sampling defaults (the model's generation config) for the fields a
        request leaves unset; its max_tokens caps the request's, as in vLLM (and, like a null
        max_tokens, is cut by the engine to the room a prompt leaves: only max_tokens_asked can
        overflow the context)."""
        defaults = defaults or {}

        def pick(name: str, engine_default):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, engine_default)

        if "max_tokens" in defaults:
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
        return SamplingParams(
            structured_outputs=self.structured(),
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            extra_args=self.vllm_xargs,
            watermarking=self.watermarking,
        )

    def constraint_fields(self) -> list[str]:
        """The fields that constrain the output, in the order they are checked. A guided_* field
        counts once given at all (an empty choice list or regex is refused by name, not taken as
        unset), and so does a response_format (an empty one names no type: refused, as OpenAI's); an
        empty structured_outputs or a "text" response_format constrains nothing."""
        given = {"response_format", *GUIDED_FIELDS}
        return [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
                if (getattr(self, name) is not None if name in given else not _unset(getattr(self, name)))
                and not (name == "response_format" and self.response_format.get("type") == "text")]

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint; RequestError naming the field for a malformed one, or
        for two of them."""
        given = self.constraint_fields()
        if self.guided_decoding_backend not in (None, *GUIDED_BACKENDS):
            raise RequestError(f"SamplingParams.guided_decoding_backend={self.guided_decoding_backend!r} is invalid: "
                               f"tandem's structured outputs run on llguidance; give one of {list(GUIDED_BACKENDS)} "
                               "or leave it out")
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(f"SamplingParams.{given[1]}=... is invalid: the request already constrains its output "
                               f"with '{given[0]}'; give one of them")
        name = given[0]
        try:
            if name == "structured_outputs":
                return StructuredOutputsParams.from_dict(self.structured_outputs)
            if name in GUIDED_FIELDS:
                return StructuredOutputsParams(**{GUIDED_FIELDS[name]: getattr(self, name)})
            return _response_format(self.response_format)
        except RequestError as e:
            raise RequestError(f"SamplingParams.{name}=... is invalid: {e}") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    """OpenAI's response_format {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}} -> the constraint."""
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise RequestError('give {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
        return StructuredOutputsParams(json=spec.get("schema", {}))  # no schema: any JSON
    if kind is None:  # OpenAI's (and vLLM's) required field
        raise RequestError("it names no type; give one of 'text', 'json_object', 'json_schema'")
    raise RequestError(f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. prompt: a string, strings, token ids, or lists of token ids."""

    prompt: str | Items[str] | Items[int] | Items[Items[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # the tokenizer's special tokens (a BOS) around a text prompt
    suffix: str | None = None

    @property
    def max_tokens_asked(self) -> int | None:
        """The limit the client sent (None: the room the prompt leaves, or the server's default)."""
        return self.max_tokens

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs, defaults)


class ContentPart(_Request):
    """A content part: text ("text", the Responses API's "input_text" / "output_text", "refusal");
    other types are refused by name when the message is prepared (tandem.chat.text_message)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionDefinition(_Request):
    model_config = ConfigDict(extra="allow", strict=True)  # other keys reach the chat template, as in vLLM

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None  # "auto" calls held to the schema too (named and "required" always are)


class ChatTool(_Request):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """tool_choice {"type": "function", "function": {"name": ...}}: the reply calls that function."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, ...) are passed on to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | Items[ContentPart | str] | None = None

    def template_dict(self, content_format: str = "string") -> dict[str, Any]:
        """The message as the template takes it (tandem.chat.text_message; content_format: its)."""
        return text_message(self.model_dump(exclude_none=True), content_format)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. logprobs is a bool here; top_logprobs gives how many alternatives."""

    messages: Items[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open: the reply continues it
    add_special_tokens: bool = False  # on top of the template's own (which usually holds them)
    echo: bool = False  # the reply starts with the last message's content when it has the reply's role
    documents: Items[dict[str, Any]] | None = None  # vLLM's: to the template (RAG templates print them)
    # A Jinja template instead of the tokenizer's: refused unless the server trusts request templates.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (Qwen3's enable_thinking)
    # Tool calling (tandem/server/tools.py): the functions the model may call and whether it must.
    tools: Items[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # with a reasoning parser: the thinking in the reply (False: dropped)
    reasoning_effort: str | None = None  # one of REASONING_EFFORTS: to the chat template, as vLLM

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_tokens_asked(self) -> int | None:
        """The limit the client sent (None: the room the prompt leaves, or the server's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        return self._params(self.max_tokens_asked, (self.top_logprobs or 0) if self.logprobs else None, defaults)


# ---------------------------------------------------------------- responses
class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One entry of vLLM's prompt_logprobs: a token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token (None for the first): token id -> its entry, the prompt token's and the top-n.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with prompt_logprobs=n


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


@model_serializer(mode="wrap")
def _carried_only(self, handler) -> dict[str, Any]:
    """A streamed delta's fields without those it does not carry (None, an empty list), as OpenAI's
    and vLLM's streams leave them out: a call's later pieces hold only their arguments."""
    return {k: v for k, v in handler(self).items() if v is not None and v != []}


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None
    _carried = _carried_only


class DeltaToolCall(_Response):
    """A streamed piece of a tool call: the first piece of call `index` carries its id and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
    _carried = _carried_only


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    # A reasoning model's thinking (with the server's --reasoning-parser), under vLLM's name and its older one.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with prompt_logprobs=n


class DeltaMessage(_Response):
    """A streamed chat chunk's delta (what it does not carry left out)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # as ChatResponseMessage's
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    _carried = _carried_only


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- tokenizer routes (vLLM's)
class TokenizeRequest(_Request):
    """POST /tokenize: a prompt (as /v1/completions encodes it) or messages (as chat does)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    messages: Items[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Items[ChatTool] | None = None  # rendered by the chat template, as chat completions render them
    documents: Items[dict[str, Any]] | None = None  # to the template, as chat completions give them
    reasoning_effort: str | None = None  # to the template, as chat completions give it
    return_token_strs: bool = False  # vLLM's: the tokens' strings (the tokenizer's own pieces) as token_strs


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Items[int]


class DetokenizeResponse(_Response):
    prompt: str

