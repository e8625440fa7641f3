"""The OpenAI-compatible HTTP API: `build_app(llm_or_engine, model_name)` and `run_server(args)`.

Routes: /v1/completions, /v1/chat/completions (the tokenizer's chat template, or the server's),
/v1/responses (and GET / DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel), /v1/models,
/health (and /ping), /metrics, and vLLM's /tokenize, /detokenize and /version; with api_keys the /v1 routes
need a key. Bodies are parsed here (pydantic, strict
types) so every error, malformed JSON included, gets the OpenAI error body naming the field. Generation goes through one AsyncEngine; streaming
responses are server-sent events ending with `data: [DONE]`.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import hashlib
import hmac
import json
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from tandem.beam_search import check_beam_width, step_params
from tandem.chat import content_format, developer_as_system, template_kwargs
from tandem.errors import ConfigError, RequestError
from tandem.outputs import RequestOutput
from tandem.reasoning import reasoning_format, reasoning_tag_tokens
from tandem.sampling_params import BeamSearchParams, SamplingParams, is_int_text
from tandem.server.async_engine import AsyncEngine, EngineStopped, RequestStream, ServerOverloaded
from tandem.server.beam_search import BeamSearchStream
from tandem.server.fim import FimError, fim_prompt, fim_sentinels
from tandem.server.http_errors import APIError, non_finite_error, request_error, validation_error
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    REASONING_EFFORTS,
    TokenizeRequest,
    TokenizeResponse,
    UNSUPPORTED_FIELDS,
)
from tandem.server.render import (
    ChatRenderer,
    CompletionRenderer,
    EventStream,
    Prompt,
    Renderer,
    ResponsesRenderer,
    merge_streams,
    response_id,
    sse_events,
    wait_for_disconnect,
)
from tandem.server.response_metrics import ResponseMetrics
from tandem.server.responses import BackgroundRun, ResponseBuilder, ResponsesRequest, ResponsesRequestError, \
    ResponseStore, chat_request, input_item_resource, input_items
from tandem.server.responses import renamed as responses_names
from tandem.server import TOOL_CALL_PARSERS
from tandem.server.tools import (
    ToolChoiceError,
    tag_tokens,
    tool_choice,
    tools_for_template,
)

logger = logging.getLogger("tandem.server")
request_logger = logging.getLogger("tandem.server.requests")  # --enable-log-requests: each request received
TOKENIZING_THREADS = 4  # requests templated and tokenized at once (each thread holds a copy of the tokenizer)


# ---------------------------------------------------------------- the server
class OpenAIServer:
    """Route handlers of the OpenAI API over one AsyncEngine."""

    def __init__(self, client: AsyncEngine, tokenizer, model_names: list[str], metrics: ServerMetrics,
                 trust_request_chat_template: bool = False, generation_defaults: dict | None = None,
                 tool_call_parser: str | None = None, report: ResponseMetrics = ResponseMetrics(),
                 force_include_usage: bool = False, responses_store_size: int = 0, chat_template: str | None = None,
                 prompt_tokens_details: bool = False, tokens_as_ids: bool = False, response_role: str = "assistant",
                 log_requests: bool = False, max_log_len: int | None = None, chat_template_content_format: str = "auto"):
        engine = client.engine
        self.chat_template_content_format = chat_template_content_format  # "auto": detected from the template
        self.log_requests = log_requests  # log each request received ...
        self.log_cut = slice(max_log_len)  # ... its prompt's characters and ids cut to max_log_len (None: all)
        self.response_role = response_role  # chat replies' role under add_generation_prompt
        self.prompt_tokens_details = prompt_tokens_details  # usage.prompt_tokens_details.cached_tokens
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens "token_id:N"
        # the last responses of /v1/responses, for previous_response_id and GET (None: none kept)
        self.responses_store = ResponseStore(responses_store_size) if responses_store_size else None
        self.report = report  # what a response's `metrics` object carries (none of it by default)
        self.force_include_usage = force_include_usage  # streams end with the usage chunk, asked or not
        self.client = client
        self.tool_call_parser = tool_call_parser  # "auto" tool choice's parser; None: "auto" is refused
        # the engine's reasoning parser (its constraints hold after the thinking): replies split by it
        self.reasoning = reasoning_format(engine.cfg.reasoning_parser)
        self.trust_request_chat_template = trust_request_chat_template
        self.generation_defaults = dict(generation_defaults or {})  # for the sampling fields a request leaves out
        # Templating, tokenizing and detokenizing a request's text run off the event loop, on
        # TOKENIZING_THREADS worker threads, each with its own copy of the tokenizer (a copy is used by
        # one thread at a time): the Rust tokenizer lets go of the GIL while it encodes, so a huge
        # prompt (10 MB: seconds) holds up its own thread, not the other requests' (or the loop).
        copies = queue.SimpleQueue()
        for _ in range(TOKENIZING_THREADS):
            copies.put(_copy_tokenizer(tokenizer))
        self._local = threading.local()
        self._tokenizing = ThreadPoolExecutor(TOKENIZING_THREADS, thread_name_prefix="tandem-tokenize",
                                              initializer=lambda: setattr(self._local, "tokenizer", copies.get()))
        # the event loop's own copy (renderers decode a token's text with it)
        self._loop_tokenizer = _copy_tokenizer(tokenizer)
        self.chat_template = chat_template  # the server's own (--chat-template), or None: the tokenizer's
        if chat_template is not None:
            _check_chat_template(self.tokenizer, chat_template)
        elif (broken := _template_syntax_error(self.tokenizer)) is not None:  # completions still serve: warn
            logger.warning("the model's chat template is not valid Jinja (%s): chat requests will fail; start the "
                           "server with --chat-template", broken)
        # the parser's tags a grammar names by id: those llguidance holds as special tokens
        self.tool_tags = engine.grammars.special_tags(tag_tokens(self.tokenizer, tool_call_parser)) \
            if tool_call_parser else {}
        self.fim_sentinels = fim_sentinels(self.tokenizer)  # the model's fill-in-the-middle tokens, if any
        self.reasoning_tags = reasoning_tag_tokens(self.tokenizer)  # the thinking's tags that are tokens
        self.model_names = model_names
        self.metrics = metrics
        self.max_model_len = engine.cfg.sched.max_model_len
        self.vocab_size = engine.vocab_size
        self.root = engine.cfg.model.path
        # llguidance's reading of the tokenizer, built now (about a second at a 150k vocabulary, holding
        # the GIL: built while serving, it would stall every request): structured outputs' first
        # request skips the build, and chat logprobs give a piece of a character its own bytes.
        self.token_bytes = engine.grammars.token_bytes()

    @property
    def tokenizer(self):
        """The tokenizer of the calling thread: a tokenizing thread's own copy, else the loop's."""
        return getattr(self._local, "tokenizer", self._loop_tokenizer)

    async def _off_loop(self, fn, *args):
        """fn(*args) on a tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False)
        for run in self.responses_store.running() if self.responses_store is not None else []:
            run.task.cancel()  # what the engine's drain left running (its requests were aborted)

    # ---------------------------------------------------------------- simple routes
    async def health(self, request: Request) -> Response:
        if not self.client.is_running:
            raise APIError(503, "the engine loop is not running", type="service_unavailable_error")
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        cards = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len) for name in self.model_names]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the model's card, as /v1/models lists it."""
        name = self._check_model(request.path_params["model"] or " ")  # ("": no model, not the default one)
        return JSONResponse(ModelCard(id=name, root=self.root, max_model_len=self.max_model_len).model_dump(mode="json"))

    async def tokenize(self, request: Request) -> Response:
        body = await _parse(request, TokenizeRequest)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="prompt" if body.prompt is not None else "messages")
        if body.prompt is not None:
            ids = (await self._off_loop(self._prompt, body.prompt, body.add_special_tokens is not False)).token_ids
        else:
            ids = (await self._off_loop(self._chat_prompt, body)).token_ids  # no special tokens unless asked
        extra = {"token_strs": await self._off_loop(lambda: self.tokenizer.convert_ids_to_tokens(ids))} \
            if body.return_token_strs else {}
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                             **extra).model_dump(mode="json"))

    async def detokenize(self, request: Request) -> Response:
        body = await _parse(request, DetokenizeRequest)
        self._check_model(body.model)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        return JSONResponse(DetokenizeResponse(prompt=await self._off_loop(self._detokenize, body.tokens))
                            .model_dump(mode="json"))

    def _detokenize(self, tokens: list[int]) -> str:
        """/detokenize's text, on a tokenizing thread (5M ids: a second or two)."""
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"'tokens' holds {bad}, not a token id in [0, {self.vocab_size})", param="tokens")
        return self.tokenizer.decode(tokens)

    async def version(self, request: Request) -> Response:
        from tandem import __version__

        return JSONResponse({"version": __version__})

    async def prometheus(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    # ---------------------------------------------------------------- generation routes
    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        model = self._check_common(body)
        if body.suffix or (body.suffix == "" and self.fim_sentinels is not None):  # "" elsewhere: no gap
            body = self._fill_in_the_middle(body)
        echo_logprobs = body.echo and body.logprobs is not None
        # echo with max_tokens 0 scores the prompt (OpenAI's legacy use): one token runs, none is shown
        prompt_only = body.echo and body.max_tokens == 0
        if prompt_only:
            body = body.model_copy(update={"max_tokens": 1, "min_tokens": 0})
        params = self._params(body, {}, "prompt")
        beam = self._beam_search(body, params)
        if beam is not None and echo_logprobs:
            raise APIError(400, "'echo' with 'logprobs' scores the prompt, which beam search does not; drop one of "
                           "them, or 'use_beam_search'", param="echo")
        if echo_logprobs:  # the prompt's entries come from the prompt logprobs
            params = params.clone(prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))
        prompts = await self._off_loop(self._completion_prompts, body.prompt, body.add_special_tokens)
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else None
        renderer = CompletionRenderer(response_id(request, body, "cmpl"), model, prompts, params,
                                      self._include_usage(body), self.report, self._continuous_usage(body),
                                      echo=body.echo, shown_prompt_logprobs=self._shown_prompt_logprobs(body),
                                      decode=decode, prompt_only=prompt_only)
        return await self._generate(request, prompts, params, renderer, body.stream, "prompt", "max_tokens",
                                    body.max_tokens_asked, next(iter(body.constraint_fields()), None),
                                    priority=body.priority,
                                    cache_salt=body.cache_salt, tokens_as_ids=body.return_tokens_as_token_ids,
                                    token_ids=body.return_token_ids, beam=beam)

    async def chat_completions(self, request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        model = self._check_common(body)
        return await self._chat(request, body, model, response_id(request, body, "chatcmpl"), ChatRenderer)

    async def invocations(self, request: Request) -> Response:
        """POST /invocations (vLLM's, for SageMaker): a chat completion when the body has 'messages', a
        completion when it has 'prompt', answered as those routes answer."""
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise APIError(400, f"the body is not JSON: {e}") from None
        if isinstance(body, dict) and "messages" in body:
            return await self.chat_completions(request)
        if isinstance(body, dict) and "prompt" in body:
            return await self.completions(request)
        raise APIError(400, "POST /invocations takes a chat completion request (with 'messages') or a completion "
                       "request (with 'prompt'); this body has neither")

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: the request as a chat completion, told back as the Responses API."""
        body = await _parse(request, ResponsesRequest)
        model = self._check_common(body)
        refused = body.refused_field()
        if refused is not None:
            raise APIError(400, f"'{refused[0]}': {refused[1]}", param=refused[0])
        items, chat = self._responses_chat(body)
        store = self.responses_store if body.store is not False else None
        if body.request_id is not None and self.responses_store is not None \
                and self.responses_store.get(body.request_id) is not None:
            raise APIError(400, f"'request_id': a stored response already has the id '{body.request_id}'; give "
                           "another (it names the response)", param="request_id")
        if body.background and store is None:
            why = ("'store' is false" if self.responses_store is not None
                   else "this server stores no responses (start it with --responses-store-size N)")
            raise APIError(400, f"'background': a background response is kept to be read later, and {why}; drop "
                           "'background' or store the response", param="background")

        def keep(response: dict) -> None:  # the conversation so far, for a request that continues it
            store.put(response, items + response["output"])

        builder = ResponseBuilder(body, model, on_done=keep if store is not None and not body.background else None,
                                  stored=store is not None)
        run = BackgroundRun(builder, on_finish=keep, inputs=items) if body.background else None
        try:
            return await self._chat(request, chat, model, builder.id, ResponsesRenderer, builder=builder,
                                    reasoning_tags=self.reasoning_tags, background=run,
                                    decode=self.tokenizer.decode if self.tokenizer is not None else None)
        except APIError as e:
            e.message, e.param = responses_names(e.message, e.param)
            raise

    def _responses_chat(self, body: ResponsesRequest) -> tuple[list[dict], ChatCompletionRequest]:
        """(the items the response is made from (input_items), the chat completion that serves it)."""
        previous = None
        if body.previous_response_id is not None:
            if self.responses_store is None:
                raise APIError(400, "'previous_response_id': this server stores no responses (start it with "
                               "--responses-store-size N); send the whole conversation in 'input'",
                               param="previous_response_id")
            previous = self._stored(body.previous_response_id, "previous_response_id")[1]
            if previous is None:
                raise APIError(400, f"'previous_response_id': the response '{body.previous_response_id}' is still "
                               "being made in the background; continue it once it ended (GET /v1/responses/"
                               f"{body.previous_response_id} says when)", param="previous_response_id")
        items = input_items(body, previous)
        try:
            return items, chat_request(body, items, len(previous or []))
        except ResponsesRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValidationError as e:  # a field passed on to the chat request (a tool's, tool_choice)
            err = validation_error(e)
            err.message, err.param = responses_names(err.message, err.param)
            raise err from None

    async def responses_input_tokens(self, request: Request) -> Response:
        """POST /v1/responses/input_tokens: how many tokens a Responses request's input would take
        (its instructions, the conversation it continues, its input and tools, as templated)."""
        body = await _parse(request, ResponsesRequest)
        self._check_common(body)
        refused = body.refused_field()
        if refused is not None:
            raise APIError(400, f"'{refused[0]}': {refused[1]}", param=refused[0])
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot apply a chat template", param="input")
        try:
            prompt = await self._off_loop(self._chat_prompt, self._responses_chat(body)[1])
        except APIError as e:
            e.message, e.param = responses_names(e.message, e.param)
            raise
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt.token_ids)})

    def _stored(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        entry = self.responses_store.get(response_id) if self.responses_store is not None else None
        if entry is None:
            kept = (f"this server keeps the last {self.responses_store.size}" if self.responses_store is not None
                    else "this server stores none (--responses-store-size)")
            raise APIError(404, f"no stored response has the id '{response_id}' ({kept})", param=param,
                           type="invalid_request_error", code="response_not_found")
        return entry

    async def get_response(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}: a stored response (a background one as far as it went).
        ?stream=true replays a background response's events, after ?starting_after=N if given, and
        follows it until it ends."""
        response_id = request.path_params["response_id"]
        response = self._stored(response_id)[0]
        query = request.query_params
        stream = query.get("stream", "false").lower()
        if stream not in ("true", "false", "1", "0"):
            raise APIError(400, f"'stream' must be true or false; got {query['stream']!r}", param="stream")
        if stream in ("false", "0"):
            return JSONResponse(response)
        run = self.responses_store.run(response_id)
        if run is None:
            raise APIError(400, f"'stream': the response '{response_id}' was not made in the background, so it "
                           "has no events to stream again; leave 'stream' out", param="stream")
        after = query.get("starting_after", "-1")
        try:
            start = int(after)
        except ValueError:
            start = None
        if start is None or start < -1:
            raise APIError(400, f"'starting_after' must be an event's sequence number (an integer >= 0); got "
                           f"{after!r}", param="starting_after")
        return EventStream(sse_events(run.follow(start)), lambda: None)

    async def response_input_items(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}/input_items: the items a stored response was made from
        (the conversation it continued, then its own input), a page at a time: ?limit=N (1-100,
        default 20) after ?after=<an item's id>, ?order=desc (the newest first, the default) or asc."""
        response_id = request.path_params["response_id"]
        self._stored(response_id)
        items = [input_item_resource(item) for item in self.responses_store.inputs(response_id) or []]
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"'order' must be 'asc' or 'desc'; got {order!r}", param="order")
        if order == "desc":
            items.reverse()
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise APIError(400, f"'limit' must be an integer from 1 to 100; got {query['limit']!r}", param="limit")
        if "after" in query:
            ids = [item.get("id") for item in items]
            if query["after"] not in ids:
                raise APIError(400, f"'after': the response '{response_id}' has no input item '{query['after']}'",
                               param="after")
            items = items[ids.index(query["after"]) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    async def cancel_response(self, request: Request) -> Response:
        """POST /v1/responses/{response_id}/cancel: stop a background response -> it, cancelled (or
        as it ended, if it ended first)."""
        response_id = request.path_params["response_id"]
        self._stored(response_id)
        run = self.responses_store.run(response_id)
        if run is None:
            raise APIError(400, f"the response '{response_id}' was not made in the background; only background "
                           "responses can be cancelled", param="response_id")
        return JSONResponse(await run.cancel())

    async def delete_response(self, request: Request) -> Response:
        """DELETE /v1/responses/{response_id}: drop a stored response (a background one still
        running is cancelled first)."""
        response_id = request.path_params["response_id"]
        self._stored(response_id)
        run = self.responses_store.run(response_id)
        if run is not None:
            await run.cancel(keep=False)  # not stored on the way out (it would push an older response out)
        self.responses_store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def _chat(self, request: Request, body: ChatCompletionRequest, model: str, response_id: str,
                    renderer_class: type[ChatRenderer], background: BackgroundRun | None = None,
                    **renderer_kwargs) -> Response:
        if body.top_logprobs not in (None, 0) and not body.logprobs:  # 0 asks nothing (vLLM's rule)
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if body.prompt_logprobs not in (None, 0) and body.stream:  # (0 asks nothing a stream lacks: vLLM's rule)
            raise APIError(400, "'prompt_logprobs' with 'stream': true is supported on /v1/completions only; "
                           "drop one of them", param="prompt_logprobs")

        fields = {"logprobs": "top_logprobs", "max_tokens": body.max_tokens_field}
        params = self._params(body, fields, "messages")
        beam = self._beam_search(body, params)
        try:
            tools = tool_choice(body, self.tool_call_parser, constrained=params.structured_outputs is not None,
                                tags=self.tool_tags)
        except ToolChoiceError as e:
            if beam is not None and e.param == "tool_choice":  # its fixes but one hold the reply to a call
                raise APIError(400, f"{e} (under 'use_beam_search': 'tool_choice' \"none\", or \"auto\" with the "
                               "server started so; beam search cannot hold the reply to a call)",
                               param=e.param) from None
            raise APIError(400, str(e), param=e.param) from None
        constraint = tools.constraint()
        if constraint is not None and beam is not None:
            raise APIError(400, f"'tool_choice' {body.tool_choice!r} holds the reply to a call, and beam search "
                           "holds it to nothing; use 'tool_choice': 'auto', or drop 'use_beam_search'",
                           param="tool_choice")
        if constraint is not None:
            params = params.clone(structured_outputs=constraint)
        if tools.mode == "auto" and tools.parser == "hermes" and params.skip_special_tokens:
            # vLLM's hermes parser does the same: some tokenizers mark <tool_call> special, and the text needs it
            params = params.clone(skip_special_tokens=False)
        prompts = [await self._off_loop(self._chat_prompt, body)]
        # The reply's role, and what echo repeats: the last message's content when it has that role (vLLM's).
        role = self.response_role if body.add_generation_prompt else body.messages[-1].role
        last = body.messages[-1]
        echo_text = last.template_dict().get("content") or "" if body.echo and last.role == role else ""
        renderer = renderer_class(response_id, model, prompts, params, self._include_usage(body), self.report,
                                  self._continuous_usage(body), role=role,
                                  echo_text=echo_text, tools=tools if tools.makes_calls else None,
                                  reasoning=self.reasoning, include_reasoning=body.include_reasoning,
                                  **renderer_kwargs)
        return await self._generate(request, prompts, params, renderer, body.stream, "messages",
                                    body.max_tokens_field, body.max_tokens_asked,
                                    "tools" if constraint is not None else next(iter(body.constraint_fields()), None),
                                    priority=body.priority, background=background, cache_salt=body.cache_salt,
                                    tokens_as_ids=body.return_tokens_as_token_ids, token_ids=body.return_token_ids,
                                    beam=beam)

    # ---------------------------------------------------------------- helpers
    def _include_usage(self, body) -> bool:
        return body.stream and (body.include_usage or self.force_include_usage)

    def _continuous_usage(self, body) -> bool:
        """vLLM's rule: continuous_usage_stats only where the stream reports usage at all."""
        return self._include_usage(body) and body.continuous_usage

    def _check_model(self, name: str | None) -> str:
        model = name or self.model_names[0]
        if model not in self.model_names:
            raise APIError(404, f"the model '{model}' does not exist; this server serves {self.model_names}",
                           type="invalid_request_error", param="model", code="model_not_found")
        return model

    def _check_common(self, body) -> str:
        model = self._check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
        field = body.unsupported_field()
        if field is not None:
            raise APIError(400, f"'{field}': {UNSUPPORTED_FIELDS[field]}; leave it out", param=field)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"'best_of'={body.best_of} is not supported; leave it out or set it to n={body.n}",
                           param="best_of")
        try:
            self.client.engine.validate_priority(body.priority)
        except RequestError as e:
            raise APIError(400, f"'priority': {e}", param="priority") from None
        return model

    def _params(self, body, fields: dict[str, str], prompt_param: str) -> SamplingParams:
        if body.logit_bias:
            for key in body.logit_bias:
                if not is_int_text(key) or not 0 <= int(key) < self.vocab_size:
                    raise APIError(400, f"'logit_bias' key {key!r} is not a token id in [0, {self.vocab_size})",
                                   param="logit_bias")
            if any(not -100 <= bias <= 100 for bias in body.logit_bias.values()):
                raise APIError(400, "'logit_bias' values must be in [-100, 100] (OpenAI's range)", param="logit_bias")
        if body.use_beam_search:  # n beams, not n samples: the rule that greedy sampling takes n = 1 is not its
            body = body.model_copy(update={"temperature": 1.0})  # (the search's own: BeamSearchParams')
        elif body.length_penalty != 1:
            raise APIError(400, "'length_penalty' ranks beam search's sequences; set 'use_beam_search': true, or "
                           "leave it out", param="length_penalty")
        bad = [t for t in body.allowed_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"'allowed_token_ids' holds {bad[0]}, not a token id in [0, {self.vocab_size})",
                           param="allowed_token_ids")
        try:
            return self.client.engine.resolve_logprobs(body.to_sampling_params(self.generation_defaults))
        except RequestError as e:
            raise request_error(e, fields, prompt_param) from None

    def _beam_search(self, body, params: SamplingParams) -> BeamSearchParams | None:
        """The request's beam search (use_beam_search: n beams; max_tokens set per prompt by
        _beam_streams), or None. Unlike vLLM's, an unset temperature is 0 here (vLLM's 1 adds a
        random candidate to each beam's), and a field beam search does not take is refused."""
        if not body.use_beam_search:
            return None
        field = body.beam_search_conflict()
        if field is not None:
            raise APIError(400, f"'{field}' does not apply to beam search, which ranks sequences by their logprobs "
                           "alone; leave it out, or drop 'use_beam_search'", param=field)
        engine = self.client.engine
        if engine.cfg.watermark is not None and params.watermarking is not False:
            raise APIError(400, "this server watermarks its outputs, and beam search cannot (it picks sequences, it "
                           "does not sample them); set 'watermarking': false for an unwatermarked search",
                           param="use_beam_search")
        try:
            check_beam_width(params.n, engine.cfg.model.max_logprobs, engine.vocab_size, field="n")
            return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens or 1, ignore_eos=params.ignore_eos,
                                    temperature=body.temperature or 0.0, length_penalty=body.length_penalty,
                                    include_stop_str_in_output=params.include_stop_str_in_output)
        except RequestError as e:  # "BeamSearchParams.<field>=...", or check_beam_width's "n=..."
            name = next((f for f in ("temperature", "length_penalty") if f"BeamSearchParams.{f}=" in str(e)), "n")
            raise APIError(400, str(e).replace("BeamSearchParams.", ""), param=name) from None

    def _fill_in_the_middle(self, body: CompletionRequest) -> CompletionRequest:
        """The request with each text prompt wrapped in the model's FIM sentinels around `suffix`."""
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise APIError(400, "'suffix' takes text prompts (the code before the gap); give 'prompt' as a string or "
                           "strings, or leave 'suffix' out", param="suffix")
        if body.echo:
            raise APIError(400, "'echo' repeats the prompt, and with 'suffix' the prompt is split around the middle; "
                           "drop one of them", param="echo")
        if body.truncate_prompt_tokens is not None:  # it would cut the sentinels off the front
            raise APIError(400, "'truncate_prompt_tokens' keeps a prompt's last tokens, and with 'suffix' those are "
                           "the suffix's; shorten the prefix or the suffix yourself, or drop one of them",
                           param="truncate_prompt_tokens")
        try:
            filled = [fim_prompt(p, body.suffix, self.fim_sentinels) for p in prompts]
        except FimError as e:
            raise APIError(400, f"'suffix': {e}", param="suffix") from None
        return body.model_copy(update={"prompt": filled if isinstance(body.prompt, list) else filled[0]})

    def _completion_prompts(self, prompt, add_special_tokens: bool = True) -> list[Prompt]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "'prompt' is empty: give a string, strings, token ids or lists of token ids",
                           param="prompt")
        return [self._prompt(p, add_special_tokens) for p in prompt]

    def _prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> Prompt:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer, so 'prompt' must be token ids", param="prompt")
            return Prompt(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids, prompt,
                          from_text=True)
        text = None
        # Out-of-vocab ids are refused by the engine; ids that leave no room are cut (_truncate decodes
        # what is kept) or refused: not decoded here (3M ids held the GIL for seconds)
        if self.tokenizer is not None and len(prompt) < self.max_model_len \
                and all(0 <= t < self.vocab_size for t in prompt):
            text = self.tokenizer.decode(prompt)
        return Prompt(list(prompt), text)

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest) -> Prompt:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot apply a chat template", param="messages")
        chat_kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:  # as the Responses API's reasoning.effort (a kwarg of that name wins)
            if body.reasoning_effort not in REASONING_EFFORTS:
                raise APIError(400, f"'reasoning_effort'={body.reasoning_effort!r} is invalid: give one of "
                               f"{', '.join(map(repr, REASONING_EFFORTS))}, or leave it out", param="reasoning_effort")
            chat_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if not self.trust_request_chat_template:  # a template is code the server runs (vLLM refuses them too)
            for param, value in (("chat_template", body.chat_template),
                                 ("chat_template_kwargs", chat_kwargs.get("chat_template"))):
                if value is not None:
                    raise APIError(400, f"'{param}' sets a chat template, and this server does not run templates "
                                   "sent in requests; leave it out, or start the server with "
                                   "--trust-request-chat-template", param=param)
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "'continue_final_message' continues the last message, so 'add_generation_prompt' "
                           "must be false; set 'add_generation_prompt': false", param="continue_final_message")
        kwargs = template_kwargs(body.chat_template or self.chat_template, body.add_generation_prompt,
                                 body.continue_final_message, tools=tools_for_template(body),
                                 extra=chat_kwargs, documents=body.documents)  # tokenized below
        template = kwargs["chat_template"] or getattr(self.tokenizer, "chat_template", None)
        fmt = content_format(template) if self.chat_template_content_format == "auto" \
            else self.chat_template_content_format
        conversation = []
        for i, m in enumerate(body.messages):
            try:
                conversation.append(m.template_dict(fmt))
            except RequestError as e:
                raise APIError(400, f"'messages.{i}': {e}", param=f"messages.{i}") from None
        conversation = developer_as_system(conversation, template)
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        except Exception as e:  # jinja errors, or a tokenizer without a template
            from jinja2 import TemplateSyntaxError

            if isinstance(e, TemplateSyntaxError) and body.chat_template is None:  # the server's own: not the client's
                raise APIError(500, f"the server's chat template is not valid Jinja ({e.message}, line {e.lineno}); "
                               "its operator can pass --chat-template", type="server_error") from None
            raise APIError(400, f"the chat template could not be applied to 'messages': {e}", param="messages")
        ids = self.tokenizer(text, add_special_tokens=bool(body.add_special_tokens)).input_ids
        return Prompt(ids, text, from_text=True)

    async def _generate(self, request: Request, prompts: list[Prompt], params: SamplingParams,
                        renderer: Renderer, stream: bool, prompt_param: str, max_tokens_param: str,
                        max_tokens_asked: int | None, constraint_param: str | None = None, priority: int = 0,
                        background: BackgroundRun | None = None, cache_salt: str | None = None,
                        tokens_as_ids: bool | None = None, token_ids: bool | None = None,
                        beam: BeamSearchParams | None = None) -> Response:
        """max_tokens_asked: the limit the client sent (the context check's; params' may be the
        server default's); constraint_param: the field that set params' structured output ('tools' for a tool
        choice's), named by the error when it does not compile; background: generate apart from this
        request (a Responses renderer's run), which is answered at once: the response queued, or
        its events as they come (the client going away does not stop it); cache_salt,
        tokens_as_ids, token_ids: the request's cache_salt, return_tokens_as_token_ids, return_token_ids;
        beam: run a beam search per prompt instead (params: the request's, for the renderer)."""
        await self._off_loop(self._truncate, prompts, params)
        self._check_context(prompts, max_tokens_asked, prompt_param, max_tokens_param)
        renderer.prompt_tokens_details = self.prompt_tokens_details
        renderer.tokens_as_ids = self.tokens_as_ids or bool(tokens_as_ids)
        renderer.token_bytes = self.token_bytes
        renderer.return_token_ids = bool(token_ids)
        if beam is None:
            streams = await self._submit(renderer.id, prompts, params, prompt_param, constraint_param, priority,
                                         cache_salt)
        else:
            streams = self._beam_streams(renderer.id, prompts, params, beam, prompt_param, priority, cache_salt)

        def release() -> None:
            for s in streams:
                s.release() if isinstance(s, BeamSearchStream) else self.client.release(s)

        if background is not None:
            async def work() -> None:
                async for _ in self._events(streams, renderer):
                    pass  # the builder hands each event to the run

            self.responses_store.start(background)
            background.start(work())
            background.task.add_done_callback(lambda _: release())  # even if cancelled before it ran
            return EventStream(sse_events(background.follow()), lambda: None) if stream \
                else JSONResponse(background.snapshot())
        if stream:
            return EventStream(self._events(streams, renderer), release)
        try:
            outputs = await self._finals(request, streams)
        finally:
            release()
        if outputs is None:
            return Response(status_code=499)  # the client is gone; its requests were aborted
        return JSONResponse(renderer.body(outputs))

    def _check_context(self, prompts: list[Prompt], max_tokens: int | None, prompt_param: str,
                       max_tokens_param: str) -> None:
        """A prompt plus the max_tokens the client sent past max_model_len is refused (as OpenAI and
        vLLM do) rather than cut short; a null max_tokens means whatever room the prompt leaves, at
        most the server's default (the generation config's, which never refuses a request). A prompt
        that leaves no room at all is the engine's error (it names the prompt)."""
        if max_tokens is None:
            return
        for p in prompts:
            num = len(p.token_ids)
            if num < self.max_model_len and num + max_tokens > self.max_model_len:
                raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, but "
                               f"{num + max_tokens} were requested ({num} in '{prompt_param}', "
                               f"{max_tokens} in '{max_tokens_param}'); shorten the prompt or lower "
                               f"'{max_tokens_param}'", param=max_tokens_param, code="context_length_exceeded")

    def _shown_prompt_logprobs(self, body: CompletionRequest) -> int | None:
        """The top-n of the prompt_logprobs field shown (-1: the whole vocabulary)."""
        n = body.prompt_logprobs
        return self.vocab_size if n == -1 else n

    def _truncate(self, prompts: list[Prompt], params: SamplingParams) -> None:
        """Cut each prompt to what runs (truncate_prompt_tokens): the context check and the usage count it."""
        engine = self.client.engine
        for p in prompts:
            if p.from_text:  # a text prompt's echo stays its text, as vLLM's
                p.token_ids = engine.truncate_text_prompt(p.text, p.token_ids, params, self.tokenizer)
                continue
            kept = engine.truncate_prompt(p.token_ids, params)
            if len(kept) < len(p.token_ids):  # ids echo as the ones that ran
                p.text = self._prompt(kept).text
            p.token_ids = kept

    def _check_capacity(self, prompts: list[Prompt], n: int, prompt_param: str) -> None:
        capacity = self.client.engine.cfg.sched.max_num_seqs + self.client.max_queued_requests
        if len(prompts) * n > capacity:  # a 503 would say "retry later", and no retry could fit
            param = "n" if n > 1 else prompt_param
            raise APIError(400, f"{len(prompts)} prompt(s) x n={n} asks for {len(prompts) * n} "
                           f"sequences at once, more than this server ever holds (max_num_seqs + max_queued_requests"
                           f" = {capacity}); send fewer prompts or a smaller 'n'", param=param)

    def _log_request(self, engine_id: str, p: Prompt, params) -> None:
        if self.log_requests:
            cut = self.log_cut
            request_logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", engine_id,
                                p.text[cut] if p.text is not None else None, params, p.token_ids[cut])

    def _beam_streams(self, response_id: str, prompts: list[Prompt], params: SamplingParams, beam: BeamSearchParams,
                      prompt_param: str, priority: int, cache_salt: str | None) -> list[BeamSearchStream]:
        """One beam search a prompt, every prompt checked first; each step runs n one-token requests."""
        self._check_capacity(prompts, params.n, prompt_param)
        engine = self.client.engine
        step = step_params(beam, params.logprobs, detokenize=params.logprobs is not None, seed=params.seed)
        for p in prompts:
            try:
                engine.validate_request(p.token_ids, step)
            except RequestError as e:
                raise request_error(e, {}, prompt_param) from None
        tokenizer = self.tokenizer
        kwargs = {"skip_special_tokens": params.skip_special_tokens}
        if not params.spaces_between_special_tokens:  # (the tokenizers' default is on)
            kwargs["spaces_between_special_tokens"] = False
        decode = (lambda tokens: tokenizer.decode(tokens, **kwargs)) if tokenizer is not None else (lambda tokens: "")
        room = engine.cfg.sched.max_model_len
        streams = []
        for i, p in enumerate(prompts):
            engine_id = f"{response_id}-{i}-{uuid.uuid4().hex[:8]}"
            left = room - len(p.token_ids)
            search = dataclasses.replace(beam, max_tokens=left if params.max_tokens is None
                                         else min(params.max_tokens, left))
            self._log_request(engine_id, p, search)
            streams.append(BeamSearchStream(self.client, engine_id, p.token_ids, p.text, search, step, decode,
                                            params.logprobs is not None, priority, cache_salt))
        return streams

    async def _submit(self, response_id: str, prompts: list[Prompt], params: SamplingParams,
                      prompt_param: str, constraint_param: str | None = None,
                      priority: int = 0, cache_salt: str | None = None) -> list[RequestStream]:
        self._check_capacity(prompts, params.n, prompt_param)
        streams: list[RequestStream] = []
        try:
            self.client.check_accepting()  # (a draining server answers 503 before any work)
            submitted, matchers = await self._off_loop(self._prepare, prompts, params)
            for i, p in enumerate(prompts):
                engine_id = f"{response_id}-{i}-{uuid.uuid4().hex[:8]}"  # unique though a request_id repeats
                self._log_request(engine_id, p, params)
                streams.append(await self.client.add_request(engine_id, p.token_ids, submitted, p.text, priority,
                                                             cache_salt, matcher=matchers[i]))
        except BaseException as e:
            for s in streams:
                self.client.release(s)
            if isinstance(e, RequestError):
                if constraint_param is not None and str(e).startswith("StructuredOutputsParams."):
                    what = ("a function's 'parameters' is not a JSON schema" if constraint_param == "tools"
                            else "not a constraint")
                    raise APIError(400, f"'{constraint_param}': {what} tandem can hold the output to: {e}",
                                   param=constraint_param) from None
                raise request_error(e, {}, prompt_param) from None
            raise
        return streams

    def _prepare(self, prompts: list[Prompt], params: SamplingParams) -> tuple[SamplingParams, list]:
        """On a tokenizing thread, what the engine loop's thread would otherwise do while every
        request waits on it: params with its bad words tokenized (300k take seconds), and each
        prompt's structured-output matcher compiled (a large grammar: up to a second)."""
        engine = self.client.engine
        for p in prompts:  # the engine's checks first (a matcher is compiled for a valid prompt only)
            engine.validate_request(p.token_ids, params)
        if params.bad_words and self.tokenizer is not None:
            params = engine.resolve_bad_words(params, self.tokenizer)
        if params.structured_outputs is None:
            return params, [None] * len(prompts)
        return params, [engine.compile_structured(params, p.token_ids) for p in prompts]

    async def _finals(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
        """Every request's final output, or None if the client disconnected first. One request's
        error ends the wait: the others' waits are cancelled (their requests are released, and a
        released stream is never woken)."""
        finals = [asyncio.ensure_future(s.final()) for s in streams]
        results = asyncio.gather(*finals)
        # A gather cancelled below ends with an error nobody awaits: retrieve it, so it is not logged.
        results.add_done_callback(lambda f: f.cancelled() or f.exception())
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            for final in finals:
                final.cancel()  # (a gather already done left the others waiting)
        return results.result() if results.done() and not results.cancelled() else None

    async def _events(self, streams: list[RequestStream], renderer: Renderer) -> AsyncIterator[str]:
        try:
            for chunk in renderer.preamble():
                yield renderer.sse(renderer.counted(chunk))
            async for i, out in merge_streams(streams):
                for chunk in renderer.on_output(i, out):
                    yield renderer.sse(chunk)
            for chunk in renderer.final_chunks():
                yield renderer.sse(chunk)
        except Exception as e:  # the engine stopped or failed mid-stream: report it in-band
            logger.warning("stream %s ended with an error: %r", renderer.id, e)
            err = _api_error(e)
            self.metrics.on_error(err.status)
            yield renderer.error_sse(err)
        if renderer.end_of_stream:
            yield renderer.end_of_stream


def _check_chat_template(tokenizer, chat_template: str) -> None:
    """Refuse (ConfigError) a server chat template that cannot run: no tokenizer, or a syntax error
    (found by rendering one user message; what the template raises for that message is its business)."""
    if tokenizer is None:
        raise ConfigError("--chat-template needs a tokenizer to encode the text it makes; this model has none "
                          "(give --tokenizer)")
    broken = _template_syntax_error(tokenizer, chat_template)
    if broken is not None:
        raise ConfigError(f"--chat-template is not a valid Jinja template: {broken}")


def _template_syntax_error(tokenizer, chat_template: str | None = None) -> str | None:
    """The Jinja syntax error ("message (line N)") of chat_template (None: the model's own), found by
    rendering one user message, or None (none found, or no template: a chat request then says so)."""
    from jinja2 import TemplateSyntaxError

    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        return None
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=chat_template,
                                      tokenize=False, add_generation_prompt=True)
    except TemplateSyntaxError as e:
        return f"{e.message} (line {e.lineno})"
    except Exception:  # what the template raises for that message is its business
        pass
    return None


class RootPath:
    """ASGI middleware: every request's scope names root_path as its root, so the routes answer under
    it (a proxy that keeps the prefix) and without it (one that strips it), as vLLM's --root-path."""

    def __init__(self, app, root_path: str):
        self.app, self.root_path = app, root_path.rstrip("/")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


class RequireApiKey:
    """ASGI middleware: a request to a /v1 route or /invocations must carry `Authorization: Bearer KEY`
    with one of keys, or it is answered 401 (the OpenAI error body, code invalid_api_key) and goes no
    further. The other routes (/health, /metrics, /tokenize, /version, ...) stay open, as vLLM's
    --api-key leaves them (vLLM's leaves /invocations open too: here it generates, so it is guarded)."""

    def __init__(self, app, keys: list[str], on_refused: Callable[[], None] = lambda: None):
        self.app = app
        self.keys = [hashlib.sha256(k.encode()).digest() for k in keys]
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # the route's own path (served under --root-path too)
            path = path[len(root):]
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and \
                (path in ("/v1", "/invocations") or path.startswith("/v1/")) and not self._allowed(scope):
            self.on_refused()
            err = APIError(401, "this server needs an API key: send 'Authorization: Bearer KEY' with a key it was "
                           "started with (--api-key)", code="invalid_api_key")
            response = err.response()
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        # digests compared, every one: the time taken tells neither how much of a key matched nor its length
        digest = hashlib.sha256(token).digest()
        return scheme.lower() == b"bearer" and any([hmac.compare_digest(digest, k) for k in self.keys])


def _copy_tokenizer(tokenizer):
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # some tokenizers do not copy; share it (encoding does not mutate it)
        return tokenizer


async def _parse(request: Request, model: type[BaseModel]):
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None
    error = non_finite_error(raw)
    if error is not None:
        raise error
    return body


def _api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ServerOverloaded):
        return APIError(503, str(e), type="service_unavailable_error", code="queue_full")
    if isinstance(e, EngineStopped):
        return APIError(503, str(e), type="service_unavailable_error", code="shutting_down")
    if isinstance(e, RequestError):
        return APIError(400, str(e))
    return APIError(500, f"internal error: {e!r}", type="server_error")


# ---------------------------------------------------------------- app factory
def build_app(
    llm_or_engine,
    model_name: str | list[str],
    *,
    tokenizer=None,
    max_queued_requests: int = 256,
    drain_timeout_s: float = 0.0,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
    enable_per_request_metrics: bool = False,
    enable_force_include_usage: bool = False,
    responses_store_size: int = 0,
    api_keys: list[str] | None = None,
    chat_template: str | None = None,
    enable_prompt_tokens_details: bool = False,
    cors: dict | None = None,
    enable_docs: bool = True,
    root_path: str = "",
    return_tokens_as_token_ids: bool = False,
    response_role: str = "assistant",
    log_requests: bool = False,
    max_log_len: int | None = None,
    chat_template_content_format: str = "auto",
) -> FastAPI:
    """A FastAPI app serving an LLM (or an Engine). Its engine loop starts and stops with the app's lifespan.
    trust_request_chat_template: run chat templates that requests send (off: they are refused);
    tool_call_parser: enables "auto" tool choice with that parser (`tools.TOOL_CALL_PARSERS`);
    enable_per_request_metrics: responses carry vLLM's `metrics` object with timing figures; the
    engine's per_request_spec_decode_metrics "summary" or "detailed" puts `metrics.speculative_decoding`
    in it (either alone is enough for the object); enable_force_include_usage: every stream ends with
    the usage chunk (where the metrics ride); responses_store_size: the /v1/responses kept for
    previous_response_id and GET /v1/responses/{id} (0: none); api_keys: the /v1 routes answer only
    requests that carry one of them (`Authorization: Bearer KEY`; None or empty: open to all);
    chat_template: the template's text, used instead of the tokenizer's (a request's own, where
    trusted, still wins); enable_prompt_tokens_details: completion and chat usage carry
    prompt_tokens_details.cached_tokens; cors: starlette CORSMiddleware's arguments (allow_origins, ...;
    None: no CORS headers, so browsers on other origins are refused); enable_docs: FastAPI's /docs,
    /redoc and /openapi.json; root_path: the prefix a proxy serves the app under (the routes answer
    with and without it, as vLLM's); return_tokens_as_token_ids: logprobs name each token
    "token_id:N" rather than by its text (vLLM's flag: a token that is part of a character has no text);
    response_role: the role of chat replies to requests with add_generation_prompt (vLLM's flag);
    log_requests: log each engine request received (its prompt, ids and sampling parameters; the prompt and
    ids cut to max_log_len characters and ids), at INFO on the "tandem.server.requests" logger (vLLM's flag);
    chat_template_content_format: how messages' content reaches the chat template: "auto" (detected from the
    template, as vLLM), "string" (parts joined into text) or "openai" (a list of parts) (vLLM's flag).

    app.state.engine_client is the AsyncEngine, app.state.metrics the ServerMetrics.
    """
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    if tokenizer is None:
        tokenizer = getattr(llm_or_engine, "tokenizer", None) or engine.tokenizer
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names:
        raise ValueError("model_name must name at least one served model")
    if chat_template_content_format not in ("auto", "string", "openai"):
        raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is not 'auto', 'string' or "
                         "'openai'")
    if tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise ValueError(f"tool_call_parser={tool_call_parser!r} is not one of {list(TOOL_CALL_PARSERS)}")
    k = engine.spec_metrics.k if engine.spec_metrics is not None else 0
    metrics = ServerMetrics(names[0], num_speculative_tokens=k)
    client = AsyncEngine(engine, max_queued_requests=max_queued_requests, metrics=metrics)
    defaults = getattr(llm_or_engine, "generation_defaults", None)  # an LLM's (an Engine has none)
    report = ResponseMetrics(timing=enable_per_request_metrics, spec_decode=engine.cfg.per_request_spec_decode_metrics,
                             num_spec_tokens=k)
    server = OpenAIServer(client, tokenizer, names, metrics, trust_request_chat_template, defaults, tool_call_parser,
                          report, enable_force_include_usage, responses_store_size, chat_template,
                          enable_prompt_tokens_details, return_tokens_as_token_ids, response_role, log_requests,
                          max_log_len, chat_template_content_format)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        try:
            yield
        finally:
            await client.shutdown(drain_timeout_s)
            server.close()

    docs = {} if enable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="tandem", lifespan=lifespan, **docs)
    if api_keys:
        app.add_middleware(RequireApiKey, keys=api_keys, on_refused=lambda: metrics.on_error(401))
    if cors is not None:  # added after the key check: outside it, so a preflight is answered first
        app.add_middleware(CORSMiddleware, **cors)
    if root_path:  # outermost: the key check and the routes read the root it sets
        app.add_middleware(RootPath, root_path=root_path)
    app.state.root_path = root_path
    app.state.engine_client = client
    app.state.drain = lambda: client.shutdown(drain_timeout_s)  # DrainingServer runs it first
    app.state.metrics = metrics
    app.state.server = server

    def route(path: str, handler, method: str = "POST") -> None:
        counted = path not in ("/health", "/ping")  # a probe's 503 (a stopped engine) is no request's error
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:
                err = _api_error(e)
                if err.status >= 500 and not isinstance(e, (ServerOverloaded, EngineStopped, APIError)):
                    logger.exception("%s failed", path)
                if counted:
                    metrics.on_error(err.status)
                return err.response()

        app.add_api_route(path, endpoint, methods=[method])

    route("/v1/completions", server.completions)
    route("/v1/chat/completions", server.chat_completions)
    route("/v1/responses", server.responses)
    route("/invocations", server.invocations)
    route("/v1/responses/{response_id}", server.get_response, "GET")
    route("/v1/responses/{response_id}", server.delete_response, "DELETE")
    route("/v1/responses/input_tokens", server.responses_input_tokens)
    route("/v1/responses/{response_id}/cancel", server.cancel_response)
    route("/v1/responses/{response_id}/input_items", server.response_input_items, "GET")
    route("/v1/models", server.models, "GET")
    route("/v1/models/{model:path}", server.model, "GET")  # (a name may hold slashes: "Qwen/Qwen3-8B")
    route("/health", server.health, "GET")
    route("/ping", server.health, "GET")  # vLLM's (SageMaker's health check): /health's answer
    route("/ping", server.health, "POST")
    route("/metrics", server.prometheus, "GET")
    route("/tokenize", server.tokenize)
    route("/detokenize", server.detokenize)
    route("/version", server.version, "GET")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=str(exc.status_code)).response()

    return app


# ---------------------------------------------------------------- command line
def run_server(args: argparse.Namespace) -> int:
    """`tandem serve`: load the model (and draft), then serve until interrupted. args: see add_serve_args."""
    from tandem.server import DEFAULT_K, check_serve_args

    check_serve_args(args)  # before the model loads, so a flag mistake fails fast
    from tandem.engine.llm import LLM
    from tandem.flags import speculative_config_from_flags

    spec = speculative_config_from_flags(args, args.draft, DEFAULT_K)
    logging.getLogger("tandem").setLevel(logging.INFO)  # a server logs what it loads and, each 10 s, its acceptance
    llm = LLM(
        args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        enable_prefix_caching=args.enable_prefix_caching, load_format=args.load_format, seed=args.seed,
        download_dir=args.download_dir, hf_overrides=args.hf_overrides,
        speculative_config=spec, logprobs_mode=args.logprobs_mode, generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        max_logprobs=args.max_logprobs, watermark_config=args.watermark_config,
        reasoning_parser=args.reasoning_parser, tensor_parallel_size=args.tensor_parallel_size,
        structured_outputs_config=args.structured_outputs_config,
        per_request_spec_decode_metrics=args.per_request_spec_decode_metrics or "none",
        scheduling_policy=args.scheduling_policy, enforce_eager=args.enforce_eager,
        disable_log_stats=args.disable_log_stats, batch_invariant=args.batch_invariant,
        max_cudagraph_tokens=args.max_cudagraph_tokens, cpu_matmul=args.cpu_matmul,
        async_scheduling=args.async_scheduling, trust_remote_code=args.trust_remote_code,
        tokenizer_mode=args.tokenizer_mode, enable_chunked_prefill=args.enable_chunked_prefill,
        swap_space=args.swap_space, pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
    )
    app = build_app(llm, args.served_model_name or [args.model], max_queued_requests=args.max_queued_requests,
                    drain_timeout_s=args.shutdown_timeout,
                    trust_request_chat_template=args.trust_request_chat_template,
                    tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                    enable_per_request_metrics=args.enable_per_request_metrics,
                    enable_force_include_usage=args.enable_force_include_usage,
                    responses_store_size=args.responses_store_size, api_keys=args.api_key,
                    chat_template=args.chat_template, enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    cors=cors_settings(args), enable_docs=not args.disable_fastapi_docs, root_path=args.root_path,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids, response_role=args.response_role,
                    log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                    chat_template_content_format=args.chat_template_content_format)
    if args.enable_log_requests:
        request_logger.setLevel(logging.INFO)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S, **ssl_settings(args))
    DrainingServer(config, app).run()
    return 0


def cors_settings(args: argparse.Namespace) -> dict | None:
    """CORSMiddleware's arguments from --allowed-origins and friends (None: no origin given, no CORS)."""
    if not args.allowed_origins:
        return None
    methods = [m.upper() for m in args.allowed_methods or ["*"]]  # browsers send them upper-case
    return dict(allow_origins=args.allowed_origins, allow_methods=methods,
                allow_headers=args.allowed_headers or ["*"], allow_credentials=args.allow_credentials)


def ssl_settings(args: argparse.Namespace) -> dict:
    """uvicorn.Config's TLS arguments from --ssl-keyfile and friends (none: plain HTTP)."""
    if args.ssl_keyfile is None:
        return {}
    return dict(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs)


GRACE_AFTER_DRAIN_S = 5.0  # what the aborted requests' answers get to finish sending


class DrainingServer(uvicorn.Server):
    """A uvicorn Server for build_app's app whose shutdown first drains the engine (requests in
    flight get drain_timeout_s to finish, the rest end with a 503 / an in-band error and [DONE],
    new ones get 503 meanwhile) and only then closes connections; plain uvicorn would cancel the
    handlers first, cutting their answers (a bare 500, a stream without [DONE])."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self._drain = app.state.drain

    async def shutdown(self, sockets=None) -> None:
        await self._drain()
        await super().shutdown(sockets)
