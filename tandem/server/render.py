"""Engine outputs -> OpenAI bodies and server-sent events: the prompt a request runs (`Prompt`), logprobs in
the completions and chat formats, one renderer per endpoint (`CompletionRenderer`, `ChatRenderer`,
`ResponsesRenderer`: whole responses and stream chunks from RequestOutputs, with usage, tool calls and
reasoning), and the SSE plumbing (`merge_streams`, `EventStream`, `sse_events`, `wait_for_disconnect`)."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tandem.outputs import Logprob, RequestOutput
from tandem.reasoning import ReasoningFormat, ReasoningSplit
from tandem.sampling_params import SamplingParams
from tandem.server.async_engine import GrowingCompletion, RequestStream
from tandem.server.http_errors import APIError
from tandem.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    PromptLogprobs,
    ToolCall,
    TopLogprob,
    UsageInfo,
    random_id,
)
from tandem.server.response_metrics import ResponseMetrics
from tandem.server.responses import ResponseBuilder
from tandem.server.responses import renamed as responses_names
from tandem.server.tools import ToolChoice, ToolStream

@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None
    from_text: bool = False  # tokenized here from text, with the tokenizer's special tokens


LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token masked out (top-k, bias) reads this, as in vLLM


def response_id(request: Request, body, prefix: str) -> str:
    """vLLM's rule: the response's id is prefix-X, X the X-Request-Id header, else the body's
    request_id, else fresh (the engine's ids add a suffix, so a reused X never collides)."""
    given = request.headers.get("x-request-id") or body.request_id
    return f"{prefix}-{given}" if given else random_id(prefix)


def _floor(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN too: JSON has no NaN)


def prompt_logprobs(out: RequestOutput, k: int | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs field: per prompt token, the token and the top k (None: not asked).
    The engine may hold more (echo with a wider logprobs asks for them)."""
    if k is None or out.prompt_logprobs is None:
        return None
    return [None if lp is None else {t: PromptLogprob(logprob=_floor(v.logprob), rank=v.rank,
                                                      decoded_token=v.decoded_token)
                                     for t, v in lp.items() if t == token or v.rank <= k}
            for token, lp in zip(out.prompt_token_ids, out.prompt_logprobs)]


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def _top(lp: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k best (token id, entry) pairs, best first."""
    return sorted(((t, v) for t, v in lp.items() if v.rank <= k), key=lambda tv: tv[1].rank)[:k]


def _token_text(lp: Logprob | None) -> str:
    return lp.decoded_token or "" if lp is not None else ""


def _shown(token: int, lp: Logprob | None, as_ids: bool) -> str:
    """How a logprob entry names its token: its text, or (as_ids, vLLM's
    --return-tokens-as-token-ids) "token_id:N", which names a token whose text is not whole."""
    return f"token_id:{token}" if as_ids else _token_text(lp)


def completion_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int, offset: int,
                        as_ids: bool = False) -> CompletionLogprobs:
    """text_offset counts the tokens' text whichever way they are named."""
    out = CompletionLogprobs()
    for token, lp in zip(token_ids, lps):
        chosen = lp.get(token)
        name = _shown(token, chosen, as_ids)
        out.tokens.append(name)
        out.token_logprobs.append(_floor(chosen.logprob) if chosen is not None else None)
        out.text_offset.append(offset)
        top: dict[str, float] = {}
        for t, v in _top(lp, k):  # tokens that decode alike share a key: keep the likeliest
            top.setdefault(_shown(t, v, as_ids), _floor(v.logprob))
        if chosen is not None:  # the sampled token is always among them (up to k + 1 entries), as in OpenAI's
            top.setdefault(name, _floor(chosen.logprob))
        out.top_logprobs.append(top)
        offset += len(_token_text(chosen))
    return out


def chat_logprobs(token_ids: list[int], lps: list[dict[int, Logprob]], k: int, as_ids: bool = False,
                  token_bytes: Callable[[int], bytes] | None = None) -> ChatLogprobs:
    """token_bytes: token id -> the bytes it stands for (Grammars.token_bytes), for the `bytes` of
    a token whose text is a piece of a character (U+FFFD); None: its text's bytes."""
    def bytes_of(token: int, shown: str) -> list[int]:
        if token_bytes is not None and not as_ids and "\ufffd" in shown:
            return list(token_bytes(token))  # OpenAI's: the piece's own bytes, so a client can join them
        return list(shown.encode())

    content = []
    for token, lp in zip(token_ids, lps):
        chosen = lp.get(token)
        name = _shown(token, chosen, as_ids)
        top = [TopLogprob(token=shown, logprob=_floor(v.logprob), bytes=bytes_of(t, shown))
               for t, v in _top(lp, k) for shown in [_shown(t, v, as_ids)]]
        content.append(ChatLogprob(token=name, logprob=_floor(chosen.logprob) if chosen else LOGPROB_FLOOR,
                                   bytes=bytes_of(token, name), top_logprobs=top))
    return ChatLogprobs(content=content)


class Renderer:
    """Turns RequestOutputs (one per prompt) into an endpoint's response or stream chunks."""

    prompt_tokens_details = False  # usage carries prompt_tokens_details.cached_tokens (the server sets it)
    tokens_as_ids = False  # logprobs name tokens "token_id:N" (the server sets it)
    token_bytes: Callable[[int], bytes] | None = None  # chat logprobs' bytes of a piece of a character (the server's)
    return_token_ids = False  # vLLM's return_token_ids: the prompt's and each choice's token ids, as sent

    def __init__(self, response_id: str, model: str, prompts: list[Prompt], params: SamplingParams,
                 include_usage: bool, report: ResponseMetrics = ResponseMetrics(), continuous_usage: bool = False):
        """include_usage: stream a last chunk with the usage (and the metrics object, where report enables it);
        continuous_usage: every streamed chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        self.id, self.model, self.prompts, self.params = response_id, model, prompts, params
        self.include_usage, self.report, self.continuous_usage = include_usage, report, continuous_usage
        self.created = int(time.time())
        self.n = params.n
        size = len(prompts) * self.n
        self.sent_chars, self.sent_tokens, self.done = [0] * size, [0] * size, [False] * size
        self.started = [False] * size
        self.finals: dict[int, RequestOutput] = {}

    def preamble(self) -> list[BaseModel]:
        return []

    def ids(self, token_ids: list[int], prompt_token_ids: list[int] | None = None) -> dict:
        """The extra fields of a choice (or chunk) under return_token_ids: its token ids (a chunk's:
        those it adds), and the prompt's where given (a stream gives them in a choice's first chunk)."""
        if not self.return_token_ids:
            return {}
        extra = {"token_ids": list(token_ids)}
        if prompt_token_ids is not None:
            extra["prompt_token_ids"] = list(prompt_token_ids)
        return extra

    def opening(self, idx: int, out: RequestOutput) -> BaseModel | None:
        """A chunk sent before a choice's first text, once its request has output (prompt
        logprobs are complete by then); None: nothing to send."""
        return None

    def on_output(self, i: int, out: RequestOutput) -> list[BaseModel]:
        chunks = []
        for seq in out.outputs:
            idx = i * self.n + seq.index
            if self.done[idx]:
                continue
            if not self.started[idx]:
                self.started[idx] = True
                first = self.opening(idx, out)
                if first is not None:
                    chunks.append(self.counted(first))
            # (the engine holds back what could be the start of a stop string)
            if isinstance(seq, GrowingCompletion):  # a stream's output: only the new text is read
                end = seq.buffer.length
                delta = seq.buffer.between(self.sent_chars[idx], end)
            else:
                end = len(seq.text)
                delta = seq.text[self.sent_chars[idx]:end]
            if not delta and seq.finish_reason is None:
                continue
            start_tok = self.sent_tokens[idx]
            lps = seq.logprobs[start_tok:] if seq.logprobs is not None else None
            chunk = self.delta(idx, delta, seq.token_ids[start_tok:], lps, seq.finish_reason, seq.stop_reason)
            self.sent_chars[idx], self.sent_tokens[idx] = end, len(seq.token_ids)
            if chunk is not None:  # (None: text a tool or reasoning parser holds back, nothing else to send)
                chunks.append(self.counted(chunk))
            self.done[idx] = seq.finish_reason is not None
        if out.finished:
            self.finals[i] = out
        return chunks

    def counted(self, chunk: BaseModel) -> BaseModel:
        """chunk, with its choice's usage so far when every chunk carries it (vLLM's: that choice's
        prompt tokens and the tokens it has streamed)."""
        if self.continuous_usage and chunk.choices:
            idx = chunk.choices[0].index
            prompt, completion = len(self.prompts[idx // self.n].token_ids), self.shown_tokens(idx)
            chunk.usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        return chunk

    def shown_tokens(self, idx: int) -> int:
        """The completion tokens choice idx has streamed so far."""
        return self.sent_tokens[idx]

    def metrics(self, outputs: list[RequestOutput]) -> dict:
        """The response's `metrics` field, where the server reports one (ResponseMetrics.extra)."""
        return self.report.extra(outputs)

    def usage(self, outputs: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
        usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        if self.prompt_tokens_details:  # OpenAI's field: the prompt tokens the prefix cache served
            usage.prompt_tokens_details = {"cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs)}
        return usage

    def final_chunks(self) -> list[BaseModel]:
        if not self.include_usage:
            return []
        outputs = [self.finals[i] for i in sorted(self.finals)]
        return [self.chunk([], usage=self.usage(outputs), **self.metrics(outputs))]

    def sse(self, chunk: BaseModel) -> str:
        """One server-sent event."""
        return _sse(chunk)

    def error_sse(self, err: APIError) -> str:
        """The event that ends a stream the engine could not finish."""
        return _sse(err.body())

    end_of_stream = "data: [DONE]\n\n"

    def body(self, outputs: list[RequestOutput]) -> dict:
        """The whole (non-streamed) answer's JSON."""
        return self.response(outputs).model_dump(mode="json")

    def delta(self, idx: int, text: str, token_ids: list[int], lps, finish: str | None, stop) -> BaseModel | None:
        """The chunk of choice idx's new text and tokens (None: nothing to send yet)."""
        raise NotImplementedError

    def chunk(self, choices: list, **extra) -> BaseModel:
        raise NotImplementedError

    def response(self, outputs: list[RequestOutput]) -> BaseModel:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    def __init__(self, *args, echo: bool, shown_prompt_logprobs: int | None = None, decode=None,
                 prompt_only: bool = False, **kwargs):
        """echo: the prompt leads each choice's text (and, with logprobs, its logprobs: the engine
        then computes prompt logprobs); shown_prompt_logprobs: the top-n of vLLM's
        `prompt_logprobs` field (None: not shown); decode: token id -> text, for the first prompt
        token's entry; prompt_only: echo with max_tokens 0 (scoring a prompt): the one token generated
        to get there is left out."""
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.prompt_only = prompt_only
        self.shown_prompt_logprobs = shown_prompt_logprobs
        self.decode = decode
        # Streamed text_offset runs over the tokens' texts, as the whole response's does; the text
        # itself may lag behind the tokens (held back for stop strings).
        self.token_offset = [len(self.prompts[idx // self.n].text or "") if echo else 0 for idx in range(len(self.done))]
        self.ids_sent = [False] * len(self.done)  # return_token_ids: the prompt's ids went with a choice's first delta

    @property
    def echo_logprobs(self) -> bool:
        return self.echo and self.params.logprobs is not None

    def preamble(self) -> list[BaseModel]:
        if not self.echo or self.echo_logprobs:  # echoed with its logprobs once they are known: opening()
            return []
        return [self.chunk([CompletionChoice(index=i * self.n + j, text=p.text or "")])
                for i, p in enumerate(self.prompts) for j in range(self.n)]

    def opening(self, idx: int, out: RequestOutput) -> CompletionChunk | None:
        if not self.echo_logprobs and self.shown_prompt_logprobs is None:
            return None
        text, logprobs = "", None
        if self.echo_logprobs:
            text = self.prompts[idx // self.n].text or ""
            logprobs, self.token_offset[idx] = self._prompt_part(out)  # the completion's offsets go on from there
        return self.chunk([CompletionChoice(index=idx, text=text, logprobs=logprobs,
                                            prompt_logprobs=prompt_logprobs(out, self.shown_prompt_logprobs))])

    def chunk(self, choices: list, **extra) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def _prompt_part(self, out: RequestOutput) -> tuple[CompletionLogprobs, int]:
        """OpenAI's echo with logprobs: the prompt tokens' entries (the first has no logprob), and
        the text offset just past them."""
        ids, lps = out.prompt_token_ids, out.prompt_logprobs
        first = self.decode(ids[0]) if self.decode is not None else ""
        head = CompletionLogprobs(text_offset=[0], token_logprobs=[None], top_logprobs=[None],
                                  tokens=[f"token_id:{ids[0]}" if self.tokens_as_ids else first])
        end = len(first) + sum(len(_token_text(lp.get(t))) for t, lp in zip(ids[1:], lps[1:]))
        return _joined(head, completion_logprobs(ids[1:], lps[1:], self.params.logprobs, len(first),
                                                 self.tokens_as_ids)), end

    def shown_tokens(self, idx: int) -> int:
        return 0 if self.prompt_only else super().shown_tokens(idx)

    def metrics(self, outputs: list[RequestOutput]) -> dict:
        extra = super().metrics(outputs)
        return {"metrics": None} if extra and self.prompt_only else extra  # no generation to report on

    def usage(self, outputs: list[RequestOutput]) -> UsageInfo:
        usage = super().usage(outputs)
        if self.prompt_only:  # the one token generated to get here is not shown, nor counted
            details = getattr(usage, "prompt_tokens_details", None)
            usage = UsageInfo(prompt_tokens=usage.prompt_tokens, total_tokens=usage.prompt_tokens)
            if details is not None:
                usage.prompt_tokens_details = details
        return usage

    def delta(self, idx, text, token_ids, lps, finish, stop) -> CompletionChunk:
        if self.prompt_only:  # the one token generated to get here is not shown
            text, token_ids, lps, finish, stop = "", [], [] if lps is not None else None, "length", None
        logprobs = None
        if lps is not None:
            logprobs = completion_logprobs(token_ids, lps, self.params.logprobs, self.token_offset[idx],
                                           self.tokens_as_ids)
            self.token_offset[idx] += sum(len(_token_text(lp.get(t))) for t, lp in zip(token_ids, lps))
        first = not self.ids_sent[idx]
        self.ids_sent[idx] = True
        ids = self.ids(token_ids, self.prompts[idx // self.n].token_ids if first else None)
        return self.chunk([CompletionChoice(index=idx, text=text, logprobs=logprobs, finish_reason=finish,
                                            stop_reason=stop, **ids)])

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(outputs):
            prefix = (self.prompts[i].text or "") if self.echo else ""
            for seq in out.outputs:
                token_ids, lps, text = seq.token_ids, seq.logprobs, seq.text
                finish, stop = seq.finish_reason, seq.stop_reason
                if self.prompt_only:  # the one token generated to get here is not shown
                    token_ids, text, finish, stop = [], "", "length", None
                    lps = [] if lps is not None else None
                logprobs = None
                if lps is not None:
                    part, end = self._prompt_part(out) if self.echo else (CompletionLogprobs(), 0)
                    # the completion's offsets go on from the prompt's tokens
                    logprobs = _joined(part, completion_logprobs(token_ids, lps, self.params.logprobs, end,
                                                                 self.tokens_as_ids))
                choices.append(CompletionChoice(index=i * self.n + seq.index, text=prefix + text,
                                                logprobs=logprobs, finish_reason=finish, stop_reason=stop,
                                                prompt_logprobs=prompt_logprobs(out, self.shown_prompt_logprobs),
                                                **self.ids(token_ids, out.prompt_token_ids)))
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage(outputs), **self.metrics(outputs))


class ChatRenderer(Renderer):
    def __init__(self, *args, role: str = "assistant", echo_text: str = "", tools: ToolChoice | None = None,
                 reasoning: ReasoningFormat | None = None, include_reasoning: bool = True, **kwargs):
        """role: the reply's; echo_text: what its content starts with (chat's echo); tools: how
        replies become tool calls (None: plain text); reasoning: how a reasoning model's thinking is
        told from its answer (None: all answer), include_reasoning: whether the thinking is sent.
        Tool calls are parsed from the answer alone."""
        super().__init__(*args, **kwargs)
        self.role, self.echo_text = role, echo_text
        self.tools = tools
        self.tool_streams = [ToolStream(tools) for _ in self.done] if tools is not None else None
        self.reasoning, self.include_reasoning = reasoning, include_reasoning
        # where a reply starts: in the thinking or not, from the end of its prompt
        self.opens = reasoning.opens(self.prompts[0].text) if reasoning is not None else False
        self.splits = [ReasoningSplit(self.opens) for _ in self.done] if reasoning is not None else None

    def preamble(self) -> list[BaseModel]:
        size = len(self.done)
        prompt_ids = {"prompt_token_ids": list(self.prompts[0].token_ids)} if self.return_token_ids else {}
        chunks = [self.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role=self.role, content=""),
                                               **self.ids([]))], **prompt_ids) for i in range(size)]  # as vLLM's
        if self.echo_text:
            chunks += [self.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=self.echo_text))])
                       for i in range(size)]
        return chunks

    def chunk(self, choices: list, **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def delta(self, idx, text, token_ids, lps, finish, stop) -> ChatCompletionChunk | None:
        logprobs = chat_logprobs(token_ids, lps, self.params.logprobs, self.tokens_as_ids,
                                 self.token_bytes) if lps is not None else None
        thinking = ""
        if self.splits is not None:
            split = self.splits[idx]
            pieces = [split.feed(text), split.finish() if finish is not None else ("", "")]
            thinking, text = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
        if self.tool_streams is None:
            message = DeltaMessage(content=text or None)
        else:
            stream = self.tool_streams[idx]
            parts = [stream.feed(text) if text else None, stream.finish() if finish is not None else None]
            message = _joined_deltas([p for p in parts if p is not None])
            finish = self.tools.finish_reason(stream.calls, finish)
        if thinking and self.include_reasoning:
            message.reasoning = message.reasoning_content = thinking
        elif (finish is None and logprobs is None and not self.return_token_ids and message.content is None
              and not message.tool_calls):
            return None  # all of it held back by the tool or reasoning parser: no empty delta (vLLM skips it too)
        return self.chunk([ChatStreamChoice(index=idx, delta=message, logprobs=logprobs,
                                            finish_reason=finish, stop_reason=stop, **self.ids(token_ids))])

    def response(self, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for seq in outputs[0].outputs:
            logprobs = None
            if seq.logprobs is not None:
                logprobs = chat_logprobs(seq.token_ids, seq.logprobs, self.params.logprobs, self.tokens_as_ids,
                                         self.token_bytes)
            thinking, content, calls, finish = None, seq.text, [], seq.finish_reason
            if self.reasoning is not None:
                thinking, content = self.reasoning.split(seq.text, self.opens)
            if self.tools is not None and content is not None:
                content, calls = self.tools.parse(content)
                finish = self.tools.finish_reason(calls, finish)
            if not self.include_reasoning or not thinking:
                thinking = None  # an empty thinking ("<think></think>", or cut at "<think>") is none, as streamed
            message = ChatResponseMessage(role=self.role, content=self.echo_text + content if content is not None
                                          else self.echo_text or None, reasoning=thinking, reasoning_content=thinking,
                                          tool_calls=[ToolCall(function=c) for c in calls])
            choices.append(ChatChoice(index=seq.index, message=message, logprobs=logprobs, finish_reason=finish,
                                      stop_reason=seq.stop_reason, **self.ids(seq.token_ids)))
        prompt_ids = {"prompt_token_ids": list(outputs[0].prompt_token_ids)} if self.return_token_ids else {}
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(outputs), **self.metrics(outputs),
                                      prompt_logprobs=prompt_logprobs(outputs[0], self.params.prompt_logprobs),
                                      **prompt_ids)


class ResponsesRenderer(ChatRenderer):
    """/v1/responses: the chat path's rendering told as the Responses API (tandem/server/responses.py):
    a stream of typed events (no usage chunks, no [DONE]) and the Response object."""

    end_of_stream = ""

    def __init__(self, *args, builder: ResponseBuilder, reasoning_tags: dict[str, int] | None = None,
                 decode=None, **kwargs):
        """reasoning_tags: the thinking's tags that are tokens of their own (reasoning_tag_tokens), which
        count the reasoning tokens; decode (token ids -> text) finds a `</think>` spelt in text."""
        super().__init__(*args, **kwargs)
        self.builder = builder
        builder.params = self.params  # the response reports the temperature and top_p used
        self.reasoning_tags = reasoning_tags or {}
        self.decode = decode

    def _counts(self, outputs: list[RequestOutput]) -> tuple[int, int]:
        """(cached prompt tokens, reasoning tokens) of the reply; the thinking counts whether or not it is
        shown (include_reasoning), as OpenAI counts a hidden one."""
        out = outputs[0]
        seq = out.outputs[0]
        thinking = 0
        if self.reasoning is not None:
            thinking = self.reasoning.thinking_tokens(seq.text, seq.token_ids, self.opens, self.reasoning_tags,
                                                      self.decode)
        return out.num_cached_tokens or 0, thinking

    def preamble(self) -> list[dict]:
        return self.builder.start()

    def counted(self, chunk):
        return chunk

    def on_output(self, i: int, out: RequestOutput) -> list[dict]:
        return [event for chunk in super().on_output(i, out) for event in self.builder.on_chunk(chunk)]

    def final_chunks(self) -> list[dict]:
        outputs = [self.finals[i] for i in sorted(self.finals)]
        return self.builder.finish(self.usage(outputs), *self._counts(outputs))

    def body(self, outputs: list[RequestOutput]) -> dict:
        """The whole Response, made as a stream makes its last one: the reply read at once through the
        stream's parsers, so what a stream tells otherwise than a whole chat reply (a call the token
        limit cut, which the stream has begun) is told alike, streamed or not."""
        self.preamble()
        for i, out in enumerate(outputs):
            self.on_output(i, out)
        return self.final_chunks()[-1]["response"]

    def sse(self, event: dict) -> str:
        return _event_sse(event)

    def error_sse(self, err: APIError) -> str:
        message, param = responses_names(err.message, err.param)
        return "".join(self.sse(event) for event in self.builder.failed(message, err.code, param))


def _joined_deltas(parts: list[DeltaMessage]) -> DeltaMessage:
    """One delta holding the pieces' content (joined) and tool calls, in order."""
    content = "".join(p.content for p in parts if p.content is not None)
    return DeltaMessage(content=content or None, tool_calls=[c for p in parts for c in p.tool_calls])


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await q.put((i, out, None))
            await q.put((i, None, None))
        except Exception as e:
            await q.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await q.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


class EventStream(StreamingResponse):
    """An SSE response that runs on_close however it ends (finished, client gone, or cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _event_sse(event: dict) -> str:
    """A Responses API event as a server-sent event."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def sse_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """A background run's events as server-sent events."""
    async for event in events:
        yield _event_sse(event)


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
