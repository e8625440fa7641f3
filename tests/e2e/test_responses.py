"""POST /v1/responses, driven by the official openai client, against the same server's chat
completions: a response is the chat reply, told as the Responses API. The client builds its
objects without checking them, so the raw JSON is validated against its types apart."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from tandem.errors import RequestError  # noqa: E402
from tandem.server.responses import BackgroundRun, ResponseBuilder, ResponsesRequest, ResponseStore, \
    _input_messages, chat_request  # noqa: E402
from tests.e2e.test_server import ASK, MODEL, WEATHER, LiveServer, _llm, model_dirs  # noqa: E402,F401

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def live(model_dirs):  # noqa: F811
    server = LiveServer(_llm(model_dirs))
    yield server
    server.stop()


def _chat(live, messages, **kw):
    return live.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_response_is_the_chat_reply(live):
    r = live.client.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=10, temperature=0)
    chat = _chat(live, ASK, max_tokens=10)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [item.type for item in r.output] == ["message"]
    message = r.output[0]
    assert message.role == "assistant" and message.id.startswith("msg_") and message.status == "incomplete"
    assert r.output_text == message.content[0].text == chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"  # cut by the token limit:
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 10
    assert r.usage.total_tokens == chat.usage.total_tokens and r.usage.input_tokens_details.cached_tokens >= 0
    assert r.max_output_tokens == 10 and r.temperature == 0 and r.store is False


def test_the_raw_json_is_what_the_openai_types_say(live):
    body = {"model": MODEL, "input": "Weather in Paris?", "max_output_tokens": 6, "temperature": 0}
    raw = httpx.post(live.url + "/v1/responses", json=body, timeout=60).json()
    assert Response.model_validate(raw).output_text
    events = TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", live.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and "[DONE]" not in lines
    assert [events.validate_python(d).type for d in data][-1] == "response.incomplete"
    builder = ResponseBuilder(ResponsesRequest.model_validate({"input": "x"}), MODEL)
    failed = builder.start() + builder.failed("the engine stopped", None, None)
    assert [events.validate_python(e).type for e in failed][-2:] == ["error", "response.failed"]
    assert failed[-1]["response"]["status"] == "failed" and failed[-1]["response"]["error"]["code"] == "server_error"


def test_a_previous_output_passed_back_is_one_assistant_turn():
    """The output items of a turn (its reasoning, message and calls), given back as input, are one
    assistant message with its text, its tool calls and its thinking, as chat would hold it."""
    items = [{"role": "user", "content": "Weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
             {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
             {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}",
              "status": "completed"},
             {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "1"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]}]
    chat = chat_request(ResponsesRequest.model_validate({"input": items, "instructions": "Be brief."}))
    got = [m.template_dict() for m in chat.messages]
    assert [m["role"] for m in got] == ["system", "user", "assistant", "tool", "tool"]
    turn = got[2]
    assert turn["content"] == "Checking." and turn["reasoning_content"] == "Use the tool."
    assert [(c["id"], c["function"]["name"]) for c in turn["tool_calls"]] == [("c1", "f"), ("c2", "g")]
    assert (got[3]["tool_call_id"], got[4]["content"]) == ("c1", "2")


@pytest.mark.parametrize("arguments, status", [('{"city": "Paris"}', "completed"), ('{"city": "Pa', "incomplete")])
def test_only_a_call_the_limit_cut_is_incomplete(arguments, status):
    """A reply max_output_tokens cut after a whole call (a later call the parser dropped, the text
    around the calls) is incomplete, but that call is not: continued with
    previous_response_id it stays in the conversation (a call marked incomplete is left out). A call
    whose arguments the limit cut is incomplete."""
    from tandem.server.protocol import (ChatCompletionChunk, ChatStreamChoice, DeltaFunctionCall, DeltaMessage,
                                        DeltaToolCall, UsageInfo)

    usage = UsageInfo(prompt_tokens=5, completion_tokens=60, total_tokens=65)
    builder = ResponseBuilder(ResponsesRequest(input="hi"), MODEL)
    call = DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f", arguments=arguments))
    builder.start()
    builder.on_chunk(ChatCompletionChunk(id="c", created=0, model=MODEL, choices=[
        ChatStreamChoice(index=0, delta=DeltaMessage(tool_calls=[call]), finish_reason="length")]))
    response = builder.finish(usage, 0, 0)[-1]["response"]  # (a whole response is made so too)
    assert response["status"] == "incomplete" and [i["status"] for i in response["output"]] == [status]
    item = response["output"][0]  # stored, then continued: [the stored input, its call] + the call's output
    stored = [{"role": "user", "content": "hi"}, item,
              {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}]
    kept = _input_messages(stored, num_previous=2)
    assert any(m.get("tool_calls") for m in kept) == (status == "completed")


def test_a_reply_cut_inside_a_call_is_told_alike_streamed_or_not(live):
    """max_output_tokens cutting a "required" reply inside its call: the whole response and the
    stream's last one hold the same items (the whole one held the call's raw text as a message,
    the stream the call it had begun, incomplete), and so continue the same conversation."""
    def shown(response):
        items = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
        return response["status"], items, response["usage"]["output_tokens"]

    kinds = set()
    for limit in (3, 6, 10, 16, 40):
        body = {"model": MODEL, "input": "Weather in Paris?", "max_output_tokens": limit, "temperature": 0,
                "tools": [FLAT_WEATHER], "tool_choice": "required"}
        whole = httpx.post(live.url + "/v1/responses", json=body, timeout=120).json()
        with httpx.stream("POST", live.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert shown(whole) == shown(events[-1]["response"]), limit
        kinds |= {(item["type"], item["status"]) for item in whole["output"]}
    assert ("function_call", "incomplete") in kinds, kinds  # (cut before a call's name: its text, a message)


def test_input_items_keep_their_turns_apart():
    """Two assistant messages in a row stay two messages; a thinking followed by a user message (no
    assistant turn after it) is dropped; a stored response's call its limit cut (status incomplete,
    arguments not JSON) is left out of the continued conversation, a client's own is not."""
    cut = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"cit', "status": "incomplete"}
    items = [{"role": "user", "content": "Q1"},
             {"type": "message", "role": "assistant", "content": "First."},
             {"type": "message", "role": "assistant", "content": "Second."},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "R1"}]}, cut,
             {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    got = [m.template_dict() for m in chat_request(ResponsesRequest.model_validate({"input": "x"}), items,
                                                    num_previous=len(items)).messages]
    assert [(m["role"], m["content"]) for m in got] == [
        ("user", "Q1"), ("assistant", "First."), ("assistant", "Second."), ("user", "Q2"), ("assistant", "A2")]
    assert not any("reasoning_content" in m or m.get("tool_calls") for m in got)
    own = chat_request(ResponsesRequest.model_validate({"input": [{"role": "user", "content": "Q"}, cut]}))
    with pytest.raises(RequestError, match="not JSON"):  # the client's own cut call is kept, and is its mistake
        own.messages[-1].template_dict()


def test_instructions_and_input_items_are_the_chat_messages(live):
    """instructions is a system message; developer messages are system ones; text parts are joined;
    a function call and its output are the assistant's tool call and the tool message."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 2}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather in Paris?\nTwo days."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"},
                                                             {"type": "input_text", "text": "Two days."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 2}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = live.client.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=8,
                                     temperature=0, tools=[FLAT_WEATHER], tool_choice="none")
    chat = _chat(live, messages, max_tokens=8, tools=[WEATHER], tool_choice="none")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_a_streamed_response_tells_the_same_reply_in_events(live):
    kw = dict(model=MODEL, input="The quick brown fox", max_output_tokens=12, temperature=0.8, top_p=0.9,
              extra_body={"seed": 5})
    whole = live.client.responses.create(**kw)
    events = _events(live.client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert deltas >= 2 and events[0].response.status == "in_progress"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete" and final.usage.output_tokens == 12
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2] if hasattr(e, "item_id"))
    assert events[-2].item.id == item_id == final.output[0].id and final.id == events[0].response.id
    assert events[-2].item.status == whole.output[0].status == "incomplete"  # the item the limit cut


def test_a_named_tool_choice_is_a_function_call_item(live):
    kw = dict(model=MODEL, input="Weather in Paris?", max_output_tokens=80, temperature=0, tools=[FLAT_WEATHER],
              tool_choice={"type": "function", "name": "get_weather"})
    r = live.client.responses.create(**kw)
    chat = _chat(live, ASK, max_tokens=80, tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    want = chat.choices[0].message.tool_calls[0].function
    assert [item.type for item in r.output] == ["function_call"] and r.status == "completed"
    call = r.output[0]
    assert (call.name, call.arguments) == (want.name, want.arguments) and json.loads(call.arguments)["city"]
    assert call.call_id and call.id.startswith("fc_") and r.output_text == ""
    events = _events(live.client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments == want.arguments and done.item_id == events[2].item.id
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert events[-1].response.output[0].arguments == want.arguments


def test_reasoning_is_its_own_item(live):
    """With a reasoning parser the thinking is a reasoning item before the message (set on the
    server here, so a regex can force the whole reply)."""
    from tandem.reasoning import REASONING_PARSERS

    server = live.app.state.server
    reply = "<think>Paris is in France.</think>\n\nIt is sunny."
    kw = dict(model=MODEL, input="Weather in Paris?", max_output_tokens=99, temperature=0,
              extra_body={"guided_regex": re.escape(reply)})
    server.reasoning = REASONING_PARSERS["qwen3"]
    try:
        r = live.client.responses.create(**kw)
        events = _events(live.client.responses.create(**kw, stream=True))
        hidden = live.client.responses.create(**{**kw, "extra_body": {**kw["extra_body"], "include_reasoning": False}})
        cut = live.client.responses.create(**{**kw, "max_output_tokens": 15})
    finally:
        server.reasoning = None
    chat = _chat(live, [{"role": "user", "content": kw["input"]}], max_tokens=99, logprobs=True,
                 extra_body=kw["extra_body"])
    assert [item.type for item in hidden.output] == ["message"] and hidden.output_text == "\n\nIt is sunny."
    # hidden, the thinking still counts (OpenAI counts a hidden one)
    assert hidden.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens > 0
    # Cut short in the thinking: every output token is a reasoning token.
    assert [item.type for item in cut.output] == ["reasoning"] and cut.status == "incomplete"
    assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens == 15
    # This tokenizer spells </think> in text: the thinking is the fewest tokens whose text holds it.
    pieces = [t.token for t in chat.choices[0].logprobs.content]
    spelt = next(n for n in range(1, len(pieces) + 1) if "</think>" in "".join(pieces[:n]))
    assert r.usage.output_tokens_details.reasoning_tokens == spelt < r.usage.output_tokens
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == "Paris is in France." and r.output_text == "\n\nIt is sunny."
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, text) == ("Paris is in France.", "\n\nIt is sunny.")
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"] and [i.type for i in events[-1].response.output] == added


def test_a_streamed_message_has_the_whole_ones_logprobs(live):
    """As in the whole response (and vLLM's), a message's logprobs are every output token's: the
    thinking's and the EOS's too, streamed or not; the deltas and output_text.done carry them all (the
    EOS's in an empty delta)."""
    from tandem.reasoning import REASONING_PARSERS

    server = live.app.state.server
    for reasoning, reply in ((None, "It is sunny."), ("qwen3", "<think>Paris is in France.</think>\n\nIt is sunny.")):
        kw = dict(model=MODEL, input="Weather in Paris?", max_output_tokens=99, temperature=0, top_logprobs=0,
                  extra_body={"guided_regex": re.escape(reply)})
        server.reasoning = REASONING_PARSERS[reasoning] if reasoning else None
        try:
            whole = live.client.responses.create(**kw)
            events = _events(live.client.responses.create(**kw, stream=True))
        finally:
            server.reasoning = None
        tokens = [lp.token for lp in whole.output[-1].content[0].logprobs]
        assert len(tokens) == whole.usage.output_tokens and "".join(tokens).startswith(reply)  # then the EOS
        streamed = events[-1].response.output[-1].content[0].logprobs
        assert [(lp.token, lp.logprob) for lp in streamed] == [
            (lp.token, pytest.approx(lp.logprob, abs=1e-3)) for lp in whole.output[-1].content[0].logprobs]
        deltas = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
        done = next(e for e in events if e.type == "response.output_text.done")
        assert deltas == tokens and [lp.token for lp in done.logprobs] == tokens


def test_tokens_that_show_no_text_stream_their_logprobs():
    """A token that shows no text of its own (part of a character, an EOS) still streams its logprob:
    in an empty output_text.delta while the message is open, in the empty message's when a reply
    ends before any text (max_output_tokens=1 on part of a character); before the message, in its
    first delta. The deltas add up to output_text.done's and the final message's logprobs."""
    from tandem.server.protocol import (ChatCompletionChunk, ChatLogprob, ChatLogprobs, ChatStreamChoice, DeltaMessage,
                                        UsageInfo)

    def chunk(text, token, finish=None):
        lp = ChatLogprobs(content=[ChatLogprob(token=token, logprob=-1.0, bytes=[0xE2])])
        return ChatCompletionChunk(id="c", created=0, model=MODEL, choices=[
            ChatStreamChoice(index=0, delta=DeltaMessage(content=text), logprobs=lp, finish_reason=finish)])

    usage = UsageInfo(prompt_tokens=1, completion_tokens=4, total_tokens=5)
    for replies in ([("", "a", "length")], [("", "a"), ("", "b"), ("xy", "c"), ("", "d"), ("z", "e"), ("", "f", "stop")]):
        builder = ResponseBuilder(ResponsesRequest(input="hi", top_logprobs=0), MODEL)
        events = builder.start()
        for reply in replies:
            events += builder.on_chunk(chunk(*reply))
        events += builder.finish(usage, 0, 0)
        tokens = [r[1] for r in replies]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert [lp["token"] for e in deltas for lp in e["logprobs"]] == tokens
        assert "".join(e["delta"] for e in deltas) == "".join(r[0] for r in replies)
        done = next(e for e in events if e["type"] == "response.output_text.done")
        message = events[-1]["response"]["output"][0]
        assert [lp["token"] for lp in done["logprobs"]] == [lp["token"] for lp in message["content"][0]["logprobs"]] \
            == tokens


def test_response_reports_its_sampling_and_takes_request_id(model_dirs):  # noqa: F811
    """Unset temperature / top_p / top_logprobs report what sampling used (vLLM's); vLLM's request_id
    names the response; an id a stored response has is refused."""
    server = LiveServer(_llm(model_dirs), responses_store_size=4)
    try:
        ask = dict(model=MODEL, input="hi", max_output_tokens=2, extra_body={"request_id": "r1"})
        r = server.client.responses.create(**ask)
        assert (r.id, r.temperature, r.top_p, r.top_logprobs) == ("r1", 1.0, 1.0, 0)
        assert server.client.responses.retrieve("r1").id == "r1"
        with pytest.raises(openai.BadRequestError) as e:
            server.client.responses.create(**ask)
        assert e.value.body["param"] == "request_id"
    finally:
        server.stop()


def test_json_schema_format_and_logprobs(live):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    r = live.client.responses.create(model=MODEL, input="Where?", max_output_tokens=30, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
                                     top_logprobs=2)
    assert json.loads(r.output_text)["city"] in ("Paris", "Rome")
    chat = _chat(live, [{"role": "user", "content": "Where?"}], max_tokens=30, logprobs=True, top_logprobs=2,
                 response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    assert r.output_text == chat.choices[0].message.content
    got, want = r.output[0].content[0].logprobs, chat.choices[0].logprobs.content
    assert [(lp.token, len(lp.top_logprobs)) for lp in got] == [(lp.token, 2) for lp in want]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-3)  # other batches


@pytest.mark.parametrize("kw, param, says", [
    (dict(previous_response_id="resp_1"), "previous_response_id", "stores no responses"),
    (dict(background=True), "background", "stores no responses"),
    (dict(truncation="auto"), "truncation", "'auto' is not supported"),
    (dict(reasoning={"effort": 5}), "reasoning.effort", "reasoning.effort=5 is invalid: give one of 'none'"),
    (dict(tools=[{"type": "web_search"}]), "tools.0.type", "function tools"),
    (dict(input=[{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input.0.content", "text only"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input.0.type", "'item_reference' item"),
    (dict(input=[{"type": {"a": 1}, "role": "user", "content": "x"}]), "input.0.type", "item"),  # was a 500
    (dict(input=[{"type": ["message"], "role": "user", "content": "x"}]), "input.0.type", "item"),
    (dict(input=[{"role": "critic", "content": "x"}]), "input.0.role", "'critic'"),
    (dict(input=[]), "input", "empty"),
    (dict(input=[{"type": "reasoning", "summary": 5}, {"role": "user", "content": "x"}]), "input.0.summary",
     "list of text parts"),  # was a 500
    (dict(max_output_tokens=500), "max_output_tokens", "'max_output_tokens'"),
    (dict(text={"format": {"type": "yaml"}}), "text.format", "'yaml'"),
    (dict(tool_choice={"type": "web_search"}, tools=[FLAT_WEATHER]), "tool_choice", "'tool_choice' must be"),
    (dict(text={"format": "json"}), "text.format", "must be an object"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": "{}"}}), "text.format.schema", "schema"),
    (dict(text={"format": {"type": "json_schema", "schema": {}}}), "text.format.name", "name the schema"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema", "is required"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}), "text.format",
     "'text.format': not a constraint"),
    (dict(tools=[{"type": "function", "parameters": {}}]), "tools.0.name", "'tools.0.name' is required"),
    (dict(max_output_tokens=-1), "max_output_tokens", "max_output_tokens=-1 is invalid"),
    (dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs", "/v1/completions"),
    (dict(extra_body={"n": 2}), "n", "one output"),
    (dict(include=["foo"]), "include", "include 'foo' is not one of OpenAI's values"),
    (dict(extra_body={"previous_input_messages": [{"role": "user", "content": "x"}]}), "previous_input_messages",
     "send the whole conversation"),
    (dict(extra_body={"enable_response_messages": True}), "enable_response_messages", "not returned"),
    (dict(extra_body={"best_of": 2}), "best_of", "'best_of'=2 is not supported"),  # was taken silently
    (dict(extra_body={"kv_transfer_params": {"do_remote_decode": True}}), "kv_transfer_params", "KV connector"),
])
def test_bad_requests_name_the_responses_field(live, kw, param, says):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        live.client.responses.create(**body)
    assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


def test_a_store_keeps_responses_to_continue_read_and_drop(model_dirs):  # noqa: F811
    """--responses-store-size 2: previous_response_id puts the stored conversation (not its
    instructions) before the input; GET and DELETE read and drop; store false keeps nothing; the
    least recently used response goes first."""
    server = LiveServer(_llm(model_dirs), responses_store_size=2)
    client = server.client
    try:
        kw = dict(model=MODEL, max_output_tokens=6, temperature=0)
        first = client.responses.create(input="Weather in Paris?", instructions="Be long.", **kw)
        assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(input="And Rome?", previous_response_id=first.id, instructions="Be brief.",
                                         **kw)
        chat = _chat(server, [{"role": "system", "content": "Be brief."}, *ASK,
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And Rome?"}], max_tokens=6)
        assert second.output_text == chat.choices[0].message.content
        assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
        unstored = client.responses.create(input="Hi", store=False, **kw)
        assert unstored.store is False
        streamed = _events(client.responses.create(input="Hi", stream=True, **kw))[-1].response
        assert client.responses.retrieve(streamed.id).output_text == streamed.output_text  # first is dropped
        for gone in (first.id, unstored.id):
            with pytest.raises(openai.NotFoundError, match="no stored response has the id"):
                client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(input="x", previous_response_id=first.id, **kw)
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.BadRequestError) as e:  # the request's own item, not the stored ones before it
            client.responses.create(input=[{"type": "message", "role": "user", "content": "ok"},
                                           {"type": "message", "role": "robot", "content": "x"}],
                                    previous_response_id=second.id, **kw)
        assert e.value.body["param"] == "input.1.role" and "'input.1.role'" in e.value.body["message"]
        client.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(second.id)
    finally:
        server.stop()


def test_a_stored_responses_input_items_and_an_inputs_token_count(model_dirs):  # noqa: F811
    """GET /v1/responses/{id}/input_items lists the items a stored response was made from (the
    conversation it continued, then its own input) through the SDK's pager, the newest first by
    default, with stable ids; POST /v1/responses/input_tokens counts a request's templated input
    (the usage a response would report)."""
    server = LiveServer(_llm(model_dirs), responses_store_size=4)
    client = server.client
    try:
        kw = dict(model=MODEL, max_output_tokens=4, temperature=0)
        first = client.responses.create(input="Weather in Paris?", **kw)
        second = client.responses.create(input=[{"type": "message", "role": "user", "content": "And Rome?"}],
                                         previous_response_id=first.id, **kw)
        items = list(client.responses.input_items.list(second.id, order="asc"))
        assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"),
                                                     ("message", "user")]
        assert [i.content[0].text for i in items] == ["Weather in Paris?", first.output_text, "And Rome?"]
        assert items[1].id == first.output[0].id and items[0].content[0].type == "input_text"
        assert [i.id for i in client.responses.input_items.list(first.id)] == [items[0].id]  # kept ids
        newest = client.responses.input_items.list(second.id, limit=2)  # desc: the newest first
        assert [i.id for i in newest.data] == [items[2].id, items[1].id] and newest.has_more
        assert [i.id for i in newest] == [i.id for i in items[::-1]]  # the pager asks for the rest after last_id
        for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
            r = httpx.get(f"{server.url}/v1/responses/{second.id}/input_items", params=query, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list("resp_none")
        # the input's token count is the usage its response reports
        counted = client.responses.input_tokens.count(model=MODEL, input="And Rome?", previous_response_id=first.id)
        assert counted.input_tokens == second.usage.input_tokens
        for body, param in (({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
                            ({"input": [{"type": {"a": 1}, "content": "x"}]}, "input.0.type"),
                            ({"input": "x", "truncation": "auto"}, "truncation")):
            r = server.post("/v1/responses/input_tokens", json={"model": MODEL, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # the model's own card, as /v1/models lists it
        assert client.models.retrieve(MODEL).model_dump() == client.models.list().data[0].model_dump()
        for name in ("nope", ""):
            r = httpx.get(f"{server.url}/v1/models/{name}", timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    finally:
        server.stop()


def _kinds(events) -> list[str]:
    """The events' types, a run of deltas as one (how many the text takes depends on the engine's steps)."""
    kinds = [e.type for e in events]
    return [kind for i, kind in enumerate(kinds) if not (kind.endswith(".delta") and kinds[i - 1] == kind)]


def _finished(client, response_id: str, timeout: float = 60):
    """The response, polled until it is neither queued nor in progress."""
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {r.status}"
        time.sleep(0.02)
    return r


def test_background_responses_are_read_followed_and_cancelled(model_dirs):  # noqa: F811
    """background: the request is answered at once and the response made apart: GET reads it (as far
    as it went), a background stream carries the same events as a plain one and GET ?stream=true
    replays them from any sequence number; cancel stops it and aborts its engine request; one still
    running cannot be continued yet, and does not hold up the server's shutdown."""
    server = LiveServer(_llm(model_dirs), responses_store_size=16)
    client = server.client
    kw = dict(model=MODEL, input="Weather in Paris?", max_output_tokens=12, temperature=0)
    try:
        plain = client.responses.create(**kw)
        started = client.responses.create(background=True, **kw)
        assert started.background is True and started.status in ("queued", "in_progress") and started.store is True
        done = _finished(client, started.id)
        assert (done.status, done.output_text, done.usage.output_tokens) == \
               (plain.status, plain.output_text, plain.usage.output_tokens)
        assert done.background is True and done.output[0].status == plain.output[0].status

        events = _events(client.responses.create(background=True, stream=True, **kw))
        assert _kinds(events) == _kinds(_events(client.responses.create(stream=True, **kw)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
        assert events[-1].response.output_text == plain.output_text and events[-1].response.background is True
        rid = events[0].response.id
        again = list(client.responses.retrieve(rid, stream=True, starting_after=3))
        assert [e.model_dump() for e in again] == [e.model_dump() for e in events[4:]]
        assert [e.model_dump() for e in client.responses.retrieve(rid, stream=True)] == \
               [e.model_dump() for e in events]
        for bad, param in (("--1", "starting_after"), ("x", "starting_after"), ("-2", "starting_after")):
            r = httpx.get(f"{server.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.get(f"{server.url}/v1/responses/{rid}", params={"stream": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
        follow_up = dict(kw, input="And Rome?")  # a finished background response is continued as any other
        assert client.responses.create(previous_response_id=rid, **follow_up).output_text == \
               client.responses.create(previous_response_id=plain.id, **follow_up).output_text

        with pytest.raises(openai.BadRequestError) as e:  # only background responses are cancelled or replayed
            client.responses.cancel(plain.id)
        assert "only background responses" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.retrieve(plain.id, stream=True)
        assert e.value.body["param"] == "stream"
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(background=True, store=False, **kw)
        assert e.value.body["param"] == "background" and "'store' is false" in e.value.body["message"]

        engine = server.llm.engine
        step = engine.step
        engine.step = lambda: (time.sleep(0.05), step())[1]  # slow steps: the run is caught mid-way
        long = dict(kw, max_output_tokens=60, extra_body={"ignore_eos": True})
        running = client.responses.create(background=True, **long)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(previous_response_id=running.id, **kw)
        assert e.value.body["param"] == "previous_response_id" and "still" in e.value.body["message"]
        follower = iter(client.responses.retrieve(running.id, stream=True))
        seen = [next(follower)]
        while seen[-1].type != "response.output_text.delta":
            seen.append(next(follower))
        cancelled = client.responses.cancel(running.id)
        assert cancelled.status == "cancelled" and 0 < len(cancelled.output_text)
        assert cancelled.output[0].status == "incomplete" and cancelled.usage is None
        rest = list(follower)  # the follower ends with the run, without a last event
        assert not {e.type for e in rest} & {"response.completed", "response.incomplete", "response.failed"}
        assert client.responses.retrieve(running.id).status == "cancelled"
        assert client.responses.cancel(running.id).status == "cancelled"  # again: as it is
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests():  # its request was aborted, not left to run out
            assert time.monotonic() < deadline
            time.sleep(0.02)
        left = client.responses.create(background=True, **long)  # still running when the server stops
        assert left.status in ("queued", "in_progress")
    finally:
        server.stop()


def test_a_background_run_cancelled_before_it_ran_or_failing_outside_its_stream():
    """A run cancelled before its task ran is cancelled all the same (its task's done callbacks,
    where the server releases the engine requests, still run); one whose work raises ends failed;
    one deleted while running is not stored on its way out (it would push an older response out)."""
    async def scenario() -> None:
        finished: list[dict] = []
        run = BackgroundRun(ResponseBuilder(ResponsesRequest(input="hi", background=True), MODEL, stored=True),
                            on_finish=finished.append)
        ran, released = [], []

        async def work() -> None:
            ran.append(True)

        run.start(work())
        run.task.add_done_callback(lambda _: released.append(True))
        assert run.snapshot()["status"] == "queued" and run.snapshot()["background"] is True
        follower = run.follow()
        response = await run.cancel()
        await asyncio.sleep(0)
        assert response["status"] == "cancelled" and finished == [response] and not ran and released == [True]
        assert [e async for e in follower] == [] and await run.cancel() is response

        failing = BackgroundRun(ResponseBuilder(ResponsesRequest(input="hi", background=True), MODEL),
                                on_finish=finished.append)

        async def broken() -> None:
            failing.builder.start()
            raise RuntimeError("boom")

        failing.start(broken())
        events = [e["type"] async for e in failing.follow()]
        assert events == ["response.created", "response.in_progress"]
        assert failing.final["status"] == "failed" and "boom" in failing.final["error"]["message"]
        assert finished[-1] is failing.final

        # A running response deleted: cancelled without being stored, so nothing older is pushed out.
        store = ResponseStore(1)
        older = ResponseBuilder(ResponsesRequest(input="hi"), MODEL).response("completed", [])
        store.put(older, [])
        doomed = BackgroundRun(ResponseBuilder(ResponsesRequest(input="hi", background=True), MODEL),
                               on_finish=lambda response: store.put(response, []))
        doomed.start(asyncio.Event().wait())
        store.start(doomed)
        assert store.get(doomed.id)[0]["status"] == "queued" and store.get(doomed.id)[1] is None
        assert (await doomed.cancel(keep=False))["status"] == "cancelled"
        assert store.delete(doomed.id) and store.get(doomed.id) is None and store.get(older["id"])[0] is older

    asyncio.run(scenario())


def test_a_failed_responses_error_code_is_one_openai_defines():
    for code, want in (("queue_full", "rate_limit_exceeded"), ("shutting_down", "server_error"), (None, "server_error")):
        builder = ResponseBuilder(ResponsesRequest(input="hi"), MODEL)
        error, failed = builder.failed("it stopped", code, None)
        assert error["code"] == code and failed["response"]["error"]["code"] == want
        Response.model_validate(failed["response"])


def test_the_responses_defaults_sent_back_are_taken(live):
    """What a Response reports as its settings (tool_choice "auto", no tools, OpenAI's include values it has
    nothing to add for) goes back as a request unrefused: clients (the Agents SDK) send those defaults."""
    r = live.client.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0, tool_choice="auto",
                                     tools=[], include=["reasoning.encrypted_content"],
                                     extra_body={"previous_input_messages": []})
    plain = live.client.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0)
    assert r.output_text == plain.output_text and r.tool_choice == "auto"
