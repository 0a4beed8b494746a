"""POST /v1/responses against a live server: the official SDK (JSON, events, the stream helper),
raw HTTP for the exact SSE framing and the error bodies, reasoning items with a Qwen3 template, and
the input-item and tool conversion the template sees."""

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
)

from bubo.engine.chat_request import ChatRequest
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.output_format import strict_schema
from bubo.engine.sampler import SamplingParams
from bubo.server.responses_input import function_tools, input_messages
from tests.server.live_server import LiveServer, scripted, serve_loaded

ANSWER = "Hello from Bubo."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather now.",
    "parameters": WEATHER,
}
_prompts = itertools.count()


def unique(text: str = "Say hi") -> str:
    """A prompt no earlier request sent: the scripted model replays its script only after a prefill
    of two tokens or more, so a fully cached prompt would not restart it."""
    return f"{text} (request {next(_prompts)})"


@pytest.fixture(scope="module")
def plain_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    """A ChatML model that always answers ANSWER."""
    server = serve_loaded(scripted(tiny_llama, ANSWER), defaults=SamplingParams(temperature=0.0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinking_server(qwen3_template_llama: LoadedModel) -> Iterator[LiveServer]:
    """A thinking model: it reasons "reasoning", then answers "answer"."""
    server = serve_loaded(scripted(qwen3_template_llama, "<think>\nreasoning</think>\n\nanswer"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def direct_server(qwen3_template_llama: LoadedModel) -> Iterator[LiveServer]:
    """The Qwen3 template with a model that answers without reasoning, as one told not to think does."""
    server = serve_loaded(scripted(qwen3_template_llama, "plain answer"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def call_server(long_llama: LoadedModel) -> Iterator[LiveServer]:
    """A model that always calls get_weather for Paris (city only, in the JSON `<tool_call>` format)."""
    server = serve_loaded(scripted(long_llama, CALL), defaults=SamplingParams(temperature=0.0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def real_server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    """The real default model (slow: keep max_output_tokens small)."""
    server = serve_loaded(smollm2)
    yield server
    server.stop()


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def post(server: LiveServer, body: Any) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        server.url + "/v1/responses",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )


def sse_events(server: LiveServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) for each event of a streamed response, checking the framing on the way."""
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        name, data = lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])
        assert data["type"] == name
        events.append((name, data))
    return events


# The official SDK


def test_sdk_create_parses_a_completed_response(plain_server: LiveServer) -> None:
    response = sdk(plain_server).responses.create(model="bubo", input=unique(), instructions="Be brief.")
    assert isinstance(response, Response)
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status == "completed"
    assert response.incomplete_details is None
    assert response.model == "bubo"
    assert response.instructions == "Be brief."
    assert response.output_text == ANSWER
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    usage = response.usage
    assert usage is not None
    # The script's tokens plus the end-of-turn token.
    assert usage.output_tokens == len(plain_server.state.tokenize(ANSWER, parse_special=False)) + 1
    assert usage.input_tokens > 10
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    extra = response.model_extra or {}
    assert extra["timings"]["predicted_n"] == usage.output_tokens
    cache = (usage.model_extra or {})["gufo"]["options"]
    assert cache["cached_tokens"] == usage.input_tokens_details.cached_tokens


def test_sdk_stream_events_in_order(plain_server: LiveServer) -> None:
    events = list(sdk(plain_server).responses.create(model="bubo", input=unique(), stream=True))
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(deltas) == ANSWER
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == ANSWER
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == []
    assert final.id == created.id and final.status == "completed"
    assert final.output_text == ANSWER
    added = events[2].item
    assert final.output[0].id == added.id == done.item_id


def test_sdk_stream_helper_accumulates_the_final_response(plain_server: LiveServer) -> None:
    with sdk(plain_server).responses.stream(model="bubo", input=unique()) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == ANSWER
    assert final.output_text == ANSWER
    assert final.usage is not None and final.usage.output_tokens > 0


# Raw HTTP: framing, limits, errors


def test_raw_stream_framing_and_final_usage(plain_server: LiveServer) -> None:
    events = sse_events(plain_server, {"model": "bubo", "input": unique()})
    name, final = events[-1]
    assert name == "response.completed"
    usage = final["response"]["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["input_tokens_details"]["cached_tokens"] >= 0
    assert "timings" in final["response"]
    item_events = [data for name, data in events if "item_id" in data]
    assert {data["item_id"] for data in item_events} == {final["response"]["output"][0]["id"]}


def test_max_output_tokens_reached_is_incomplete(plain_server: LiveServer) -> None:
    r = post(plain_server, {"model": "bubo", "input": unique(), "max_output_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3
    assert body["max_output_tokens"] == 3
    [message] = body["output"]
    assert message["status"] == "incomplete"
    assert ANSWER.startswith(message["content"][0]["text"]) and message["content"][0]["text"] != ANSWER

    events = sse_events(plain_server, {"model": "bubo", "input": unique(), "max_output_tokens": 3})
    name, final = events[-1]
    assert name == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_max_output_tokens_minus_one_keeps_the_default(plain_server: LiveServer) -> None:
    r = post(plain_server, {"model": "bubo", "input": unique(), "max_output_tokens": -1})
    assert r.status_code == 200
    assert r.json()["status"] == "completed"
    assert r.json()["output"][0]["content"][0]["text"] == ANSWER


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"input": "hi"}, 400, "missing_model", "model"),
        ({"model": "nope", "input": "hi"}, 404, "model_not_found", "model"),
        ({"model": "bubo"}, 400, "missing_input", "input"),
        ({"model": "bubo", "input": ""}, 400, "missing_input", "input"),
        ({"model": "bubo", "input": []}, 400, "missing_input", "input"),
        (
            {"model": "bubo", "input": "hi", "reasoning": {"effort": "extreme"}},
            400,
            "invalid_value",
            "reasoning.effort",
        ),
        ({"model": "bubo", "input": "hi", "max_output_tokens": 0}, 400, "invalid_value", "max_output_tokens"),
        (
            {"model": "bubo", "input": "hi", "max_output_tokens": -5},
            400,
            "invalid_value",
            "max_output_tokens",
        ),
        (
            {"model": "bubo", "input": "hi", "max_output_tokens": 2.5},
            400,
            "invalid_value",
            "max_output_tokens",
        ),
        (
            {"model": "bubo", "input": "hi", "previous_response_id": "resp_1"},
            400,
            "unsupported_previous_response_id",
            "previous_response_id",
        ),
        (
            {
                "model": "bubo",
                "input": "hi",
                "text": {"format": {"type": "json_schema", "schema": {"type": "bad"}}},
            },
            400,
            "invalid_schema",
            "text.format",
        ),
        (
            {"model": "bubo", "input": "hi", "tools": [{"type": "web_search"}]},
            400,
            "unsupported_tool",
            "tools[0].type",
        ),
        *(
            (
                {
                    "model": "bubo",
                    "input": "hi",
                    "tools": [{"type": "function", "name": "f", "strict": True, "parameters": parameters}],
                },
                400,
                "invalid_schema",
                param,
            )
            for parameters, param in [
                ({"type": "object", "properties": None}, "tools[0].parameters.properties"),
                ({"type": "object", "properties": 5}, "tools[0].parameters.properties"),
                (
                    {"type": "object", "properties": {"a": {"type": "object", "properties": [1]}}},
                    "tools[0].parameters.properties.a.properties",
                ),
                ({"anyOf": [{"properties": "x"}]}, "tools[0].parameters.anyOf[0].properties"),
            ]
        ),
        ({"model": "bubo", "input": [{"type": "computer_call"}]}, 400, "invalid_value", "input[0].type"),
        (
            {
                "model": "bubo",
                "input": "hi",
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "name": "get_time"},
            },
            400,
            "invalid_value",
            "tool_choice.name",
        ),
        ({"model": "bubo", "input": "hi", "tool_choice": "required"}, 400, "invalid_value", "tool_choice"),
        ({"model": "bubo", "input": "hi", "tool_choice": "any"}, 400, "invalid_value", "tool_choice"),
        (
            {
                "model": "bubo",
                "input": "hi",
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            400,
            "conflicting_fields",
            "text.format",
        ),
        (
            {
                "model": "bubo",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            },
            400,
            "unsupported_content",
            "input[0].content",
        ),
        (
            {
                "model": "bubo",
                "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
            },
            400,
            "invalid_value",
            "input[0].arguments",
        ),
    ],
)
def test_request_errors(
    plain_server: LiveServer, body: dict[str, Any], status: int, code: str, param: str
) -> None:
    r = post(plain_server, body)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == code
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_bad_json_is_a_parse_error(plain_server: LiveServer) -> None:
    r = post(plain_server, '{"model": "bubo", "input": ')
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "parse_error"


def test_stream_errors_before_the_first_event_keep_their_status(plain_server: LiveServer) -> None:
    r = post(plain_server, {"model": "nope", "input": "hi", "stream": True})
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "model_not_found"


# Reasoning


def test_reasoning_item_in_json(thinking_server: LiveServer) -> None:
    response = sdk(thinking_server).responses.create(model="bubo", input=unique())
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_")
    assert reasoning.summary == []
    assert reasoning.content is not None and [c.text for c in reasoning.content] == ["reasoning"]
    assert response.output_text == "answer"
    assert response.usage is not None
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens


def test_reasoning_item_in_stream(thinking_server: LiveServer) -> None:
    events = sse_events(thinking_server, {"model": "bubo", "input": unique()})
    kinds = [name for name, _ in events]
    compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert compact == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    reasoning = "".join(d["delta"] for k, d in events if k == "response.reasoning_text.delta")
    answer = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert (reasoning, answer) == ("reasoning", "answer")
    final = events[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "reasoning"}]
    assert [d["output_index"] for k, d in events if k == "response.output_item.added"] == [0, 1]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_cut_inside_the_reasoning(thinking_server: LiveServer) -> None:
    # Enough tokens to pass "<think>\n" and start the reasoning, too few to finish it.
    body = {"model": "bubo", "input": unique(), "max_output_tokens": 12}
    json_output = post(thinking_server, body).json()["output"]
    final = sse_events(thinking_server, {**body, "input": unique()})[-1][1]["response"]
    for output in (json_output, final["output"]):
        assert [(item["type"], item["status"]) for item in output] == [
            ("reasoning", "incomplete"),
            ("message", "incomplete"),
        ]
        assert output[1]["content"][0]["text"] == ""
        assert "reasoning".startswith(output[0]["content"][0]["text"])
    assert final["status"] == "incomplete"


def test_reasoning_off_renders_without_thinking(direct_server: LiveServer) -> None:
    default = post(direct_server, {"model": "bubo", "input": unique("Hi")}).json()
    off = post(direct_server, {"model": "bubo", "input": unique("Hi"), "reasoning": {"effort": "off"}}).json()
    none = post(
        direct_server, {"model": "bubo", "input": unique("Hi"), "reasoning": {"effort": "none"}}
    ).json()
    for body in (off, none):
        assert [item["type"] for item in body["output"]] == ["message"]
        assert body["output"][0]["content"][0]["text"] == "plain answer"
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
        # Qwen3's template closes an empty <think></think> block in the prompt when thinking is off.
        assert body["usage"]["input_tokens"] > default["usage"]["input_tokens"]
    assert off["usage"]["input_tokens"] == none["usage"]["input_tokens"]
    assert off["reasoning"] == {"effort": "off", "summary": None}


def test_reasoning_conflicting_with_template_kwargs(direct_server: LiveServer) -> None:
    r = post(
        direct_server,
        {
            "model": "bubo",
            "input": "hi",
            "reasoning": {"effort": "high"},
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "conflicting_fields"


# Input items and tools, as the template sees them


def test_input_items_become_template_messages() -> None:
    messages = input_messages(
        [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Ask."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny and rainy."}]},
        ],
        instructions="Be brief.",
    )
    assert [m["role"] for m in messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    assert messages[0]["content"] == "Be brief."
    call_turn = messages[3]
    assert call_turn["reasoning_content"] == "Ask."
    assert [(c["id"], c["function"]["arguments"]) for c in call_turn["tool_calls"]] == [
        ("c1", {"city": "Paris"}),
        ("c2", {"city": "Rome"}),
    ]
    assert [(m["tool_call_id"], m["name"], m["content"]) for m in messages[4:6]] == [
        ("c1", "weather", "sunny"),
        ("c2", "weather", "rain"),
    ]
    assert messages[6] == {"role": "assistant", "content": "Sunny and rainy."}


def test_function_tools_make_only_strict_true_strict() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = function_tools(
        [
            {"type": "function", "name": "a", "parameters": schema},
            {"type": "function", "name": "b", "parameters": schema, "strict": None},
            {"type": "function", "name": "c", "description": "C.", "parameters": schema, "strict": True},
            {"type": "function", "name": "d", "parameters": schema, "strict": False},
        ]
    )
    assert tools == [
        {"type": "function", "function": {"name": "a", "parameters": schema}},
        {"type": "function", "function": {"name": "b", "parameters": schema}},
        {
            "type": "function",
            "function": {
                "name": "c",
                "description": "C.",
                "parameters": {**schema, "required": ["city"], "additionalProperties": False},
                "strict": True,
            },
        },
        {"type": "function", "function": {"name": "d", "parameters": schema, "strict": False}},
    ]


def test_tool_conversation_renders_with_qwen3(direct_server: LiveServer) -> None:
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": True}]
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    prompt = direct_server.state.render(ChatRequest(input_messages(items), function_tools(tools)))
    declared = prompt[prompt.index("<tools>\n") : prompt.index("\n</tools>")]
    assert '"name": "weather"' in declared and '"strict": true' in declared
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt

    r = post(direct_server, {"model": "bubo", "input": items, "tools": tools, "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tools"] == tools
    assert body["tool_choice"] == "auto"
    assert body["usage"]["input_tokens"] == len(direct_server.state.tokenize(prompt))


def test_strict_schema_requires_every_property_of_every_object() -> None:
    schema = {
        "type": "object",
        "properties": {
            "place": {"type": "object", "properties": {"city": {"type": "string"}}},
            "days": {"type": "array", "items": {"type": ["object", "null"], "properties": {"n": {}}}},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
        "$defs": {"unit": {"anyOf": [{"type": "object", "properties": {"u": {}}}, {"type": "string"}]}},
    }
    strict = strict_schema(schema, "parameters")
    assert strict["required"] == ["place", "days", "extra"] and strict["additionalProperties"] is False
    assert strict["properties"]["place"]["required"] == ["city"]
    assert strict["properties"]["days"]["items"]["required"] == ["n"]
    assert strict["properties"]["days"]["items"]["additionalProperties"] is False
    # An object that sets additionalProperties keeps it.
    assert strict["properties"]["extra"]["additionalProperties"] == {"type": "integer"}
    assert strict["$defs"]["unit"]["anyOf"][0] == {
        "type": "object",
        "properties": {"u": {}},
        "required": ["u"],
        "additionalProperties": False,
    }
    assert schema["properties"]["place"] == {"type": "object", "properties": {"city": {"type": "string"}}}


# Function calls


def test_sdk_function_call_output_item(call_server: LiveServer) -> None:
    response = sdk(call_server).responses.create(model="bubo", input=unique("Weather?"), tools=[WEATHER_TOOL])
    assert response.status == "completed"
    # The answer is only a call: no empty message item before it.
    [call] = response.output
    assert isinstance(call, ResponseFunctionToolCall)
    assert call.id is not None and call.id.startswith("fc_")
    assert call.call_id.startswith("call_")
    assert (call.name, call.arguments, call.status) == ("get_weather", '{"city": "Paris"}', "completed")
    assert response.output_text == ""
    assert response.tool_choice == "auto" and response.parallel_tool_calls is True


def test_function_call_stream_events(call_server: LiveServer) -> None:
    events = list(
        sdk(call_server).responses.create(
            model="bubo", input=unique("Weather?"), tools=[WEATHER_TOOL], stream=True
        )
    )
    kinds = [event.type for event in events]
    deltas = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added, done, item_done = events[2], events[-3], events[-2]
    assert isinstance(added, ResponseOutputItemAddedEvent)
    assert isinstance(done, ResponseFunctionCallArgumentsDoneEvent)
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert added.item.name == "get_weather" and added.item.status == "in_progress"
    assert {(e.item_id, e.output_index) for e in [*deltas, done]} == {(added.item.id, 0)}
    assert "".join(e.delta for e in deltas) == done.arguments == '{"city": "Paris"}'
    final = events[-1].response
    assert [item.model_dump(exclude_none=True) for item in final.output] == [
        item_done.item.model_dump(exclude_none=True)
    ]
    [call] = final.output
    assert isinstance(call, ResponseFunctionToolCall)
    assert (call.id, call.call_id, call.arguments) == (added.item.id, added.item.call_id, done.arguments)


def test_sdk_stream_helper_accumulates_function_calls(call_server: LiveServer) -> None:
    with sdk(call_server).responses.stream(model="bubo", input=unique("Weather?"), tools=[WEATHER_TOOL]) as s:
        final = s.get_final_response()
    [call] = final.output
    assert isinstance(call, ResponseFunctionToolCall) and call.arguments == '{"city": "Paris"}'


def test_function_call_output_round_trip(call_server: LiveServer) -> None:
    """The call the server answered with, sent back with its output, renders as that call's result."""
    client = sdk(call_server)
    question = unique("Weather?")
    first = client.responses.create(model="bubo", input=question, tools=[WEATHER_TOOL])
    [call] = first.output
    assert isinstance(call, ResponseFunctionToolCall)
    items = [
        {"role": "user", "content": question},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    messages = input_messages(items)
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert (messages[2]["tool_call_id"], messages[2]["name"]) == (call.call_id, "get_weather")
    prompt = call_server.state.render(ChatRequest(messages, function_tools([WEATHER_TOOL])))
    assert prompt.index(CALL) < prompt.index("<tool_response>\nsunny\n</tool_response>")
    second = client.responses.create(model="bubo", input=items, tools=[WEATHER_TOOL])
    assert second.status == "completed"


def test_reasoning_then_call_stream(qwen3_template_llama: LoadedModel) -> None:
    """Items after the reasoning item take the next output_index; the Qwen3 template knows tools."""
    model = scripted(qwen3_template_llama, f"<think>\nweather</think>\n\n{CALL}")
    server = serve_loaded(model, defaults=SamplingParams(temperature=0.0))
    try:
        events = sse_events(server, {"model": "bubo", "input": unique(), "tools": [WEATHER_TOOL]})
        body = post(server, {"model": "bubo", "input": unique(), "tools": [WEATHER_TOOL]}).json()
    finally:
        server.stop()
    added = [data["item"] for name, data in events if name == "response.output_item.added"]
    assert [(item["type"], item["status"]) for item in added] == [
        ("reasoning", "in_progress"),
        ("function_call", "in_progress"),
    ]
    call_events = [data for _, data in events if data.get("item_id") == added[1]["id"]]
    assert {data["output_index"] for data in call_events} == {1}
    final = events[-1][1]["response"]
    for output in (final["output"], body["output"]):
        assert [item["type"] for item in output] == ["reasoning", "function_call"]
        assert output[1]["arguments"] == '{"city": "Paris"}'
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


def test_malformed_call_comes_back_as_text(long_llama: LoadedModel) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    server = serve_loaded(scripted(long_llama, text), defaults=SamplingParams(temperature=0.0))
    try:
        body = post(server, {"model": "bubo", "input": unique(), "tools": [WEATHER_TOOL]}).json()
    finally:
        server.stop()
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["output"][0]["content"][0]["text"] == text


def test_tool_choice_none_hides_the_tools(call_server: LiveServer) -> None:
    body = {"model": "bubo", "input": unique("Weather?"), "tools": [WEATHER_TOOL], "tool_choice": "none"}
    response = post(call_server, body).json()
    # The tools are not offered, so the call markup is only text.
    assert [item["type"] for item in response["output"]] == ["message"]
    assert response["output"][0]["content"][0]["text"] == CALL
    assert response["tool_choice"] == "none"


@pytest.mark.parametrize("strict", ["absent", None, False, True])
def test_strict_rule_for_a_forced_call(call_server: LiveServer, strict: Any) -> None:
    """The model writes a call without the optional `unit`. As sent (no strict, null, false) the grammar
    that forces the call accepts it; strict true requires every property, so the grammar makes the
    model add a unit."""
    tool = dict(WEATHER_TOOL) if strict == "absent" else {**WEATHER_TOOL, "strict": strict}
    body = {
        "model": "bubo",
        "input": unique("Weather?"),
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "get_weather"},
        # The call is ~70 tokens in the tiny byte-level vocabulary.
        "max_output_tokens": 120,
    }
    response = post(call_server, body).json()
    [call] = response["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    arguments = json.loads(call["arguments"])
    if strict is True:
        assert arguments["city"] == "Paris" and arguments["unit"] in ("c", "f")
        jsonschema.validate(arguments, strict_schema(WEATHER, "parameters"))
    else:
        assert arguments == {"city": "Paris"}
    assert response["tool_choice"] == {"type": "function", "name": "get_weather"}


# The real default model


def test_real_model_required_tool_call_validates(real_server: LiveServer) -> None:
    # No extra properties, so the forced call stays well inside max_output_tokens.
    parameters = {**WEATHER, "additionalProperties": False}
    response = sdk(real_server).responses.create(
        model="bubo",
        input="What is the weather in Paris?",
        tools=[{**WEATHER_TOOL, "parameters": parameters}],
        tool_choice="required",
        # One call: with parallel calls allowed the model may go on calling until max_output_tokens.
        parallel_tool_calls=False,
        temperature=0.7,
        max_output_tokens=60,
    )
    calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
    assert calls and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), parameters)


def test_real_model_json_schema_output_validates(real_server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    response = sdk(real_server).responses.create(
        model="bubo",
        input="Describe the weather in Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}},
        temperature=0.7,
        max_output_tokens=60,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
