"""The Anthropic dialect end to end: the official SDK and raw HTTP against a live server.

Exact answers come from scripted models (a decoder that writes a fixed text), so content, stop
reasons, token counts and the SSE event order can be asserted value for value; thinking blocks need a
template that knows `<think>`, so one fixture serves a tiny model with Qwen3's template. Tool calls are
scripted on that template too: the tiny ChatML model's 512-token context cannot hold the tools prompt
written for templates without tool support. Forced tool calls and JSON answers run on the real default
model, whose output only the grammar constrains.
"""

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.request import GenerationRequest, OutputDelta, OutputEvent
from bubo.engine.sampler import SamplingParams
from bubo.server.anthropic import _chat_request, _template_messages
from bubo.server.errors import ApiError
from bubo.server.fields import Body
from tests.server.live_server import LiveServer, scripted, serve_loaded

SCRIPT = "Hello world. STOP here, then more."
THINKING_SCRIPT = "<think>\nLet me see.\n</think>\n\nHello there."
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(ARGUMENTS)}}}\n</tool_call>'
# Reasoning, a sentence, then the call: one block of each kind, numbered in that order.
TOOL_SCRIPT = "<think>\nI need the weather.\n</think>\n\nLet me check.\n" + CALL
# The arguments' closing brace is missing: not a call, so the model's text comes back as is.
MALFORMED_CALL = CALL.replace("}}", "}")
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def script_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    """ChatML template; the model writes SCRIPT and ends."""
    server = serve_loaded(scripted(tiny_llama, SCRIPT), defaults=GREEDY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinking_server(qwen3_template_llama: LoadedModel) -> Iterator[LiveServer]:
    """Qwen3 template; the model writes a <think> block (its tags one byte-token at a time) and an answer."""
    server = serve_loaded(scripted(qwen3_template_llama, THINKING_SCRIPT), defaults=GREEDY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tool_server(qwen3_template_llama: LoadedModel) -> Iterator[LiveServer]:
    """Qwen3 template (JSON tool calls); the model thinks, says a sentence, then calls get_weather."""
    server = serve_loaded(scripted(qwen3_template_llama, TOOL_SCRIPT), defaults=GREEDY)
    yield server
    server.stop()


def client(server: LiveServer, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Parse an SSE body strictly: every event is `event: NAME`, `data: JSON`, then a blank line."""
    assert text.endswith("\n\n")
    events = []
    for frame in text[:-2].split("\n\n"):
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), frame
        name, payload = head[len("event: ") :], json.loads(data[len("data: ") :])
        assert payload["type"] == name
        events.append((name, payload))
    return events


def collapse(names: list[str]) -> list[str]:
    """Event names with runs of the same name folded into one."""
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def script_ids(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_bos=False, parse_special=False)


def script_tokens(loaded: LoadedModel, text: str) -> int:
    """Completion tokens for a script: its tokens plus the end token."""
    return len(script_ids(loaded, text)) + 1


def script_prefix(loaded: LoadedModel, text: str, n: int) -> str:
    """The text of the script's first n tokens."""
    return loaded.tokenizer.decode(script_ids(loaded, text)[:n])


# Non-streaming answers


def test_sdk_create_returns_the_scripted_text(script_server: LiveServer, tiny_llama: LoadedModel) -> None:
    message = client(script_server).messages.create(
        model="bubo", max_tokens=64, messages=user("Say the script, please.")
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.model == "bubo"
    assert [(b.type, b.text) for b in message.content] == [("text", SCRIPT)]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == script_tokens(tiny_llama, SCRIPT)
    assert message.usage.cache_creation_input_tokens == 0
    extra = message.model_extra or {}
    assert extra["timings"]["predicted_n"] == message.usage.output_tokens
    assert "cache_hit" in (message.usage.model_extra or {})["gufo"]["options"]


def test_input_tokens_plus_cache_reads_equal_count_tokens(script_server: LiveServer) -> None:
    sdk = client(script_server)
    body = {"model": "bubo", "system": "Be brief.", "messages": user("Count these words for me.")}
    counted = sdk.messages.count_tokens(**body).input_tokens
    message = sdk.messages.create(max_tokens=8, **body)
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted
    assert counted > len("Count these words for me.") // 4


def test_stop_sequence(script_server: LiveServer) -> None:
    message = client(script_server).messages.create(
        model="bubo", max_tokens=64, stop_sequences=["STOP"], messages=user("Stop at the word.")
    )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "STOP"
    assert message.content[0].text == "Hello world. "


def test_max_tokens(script_server: LiveServer, tiny_llama: LoadedModel) -> None:
    message = client(script_server).messages.create(
        model="bubo", max_tokens=3, messages=user("Only three tokens.")
    )
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 3
    assert message.content[0].text == script_prefix(tiny_llama, SCRIPT, 3)


def test_thinking_block_then_text(thinking_server: LiveServer, qwen3_template_llama: LoadedModel) -> None:
    message = client(thinking_server).messages.create(
        model="bubo",
        max_tokens=64,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=user("Think first."),
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == "Let me see."
    assert message.content[0].signature == ""
    assert message.content[1].text == "Hello there."
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == script_tokens(qwen3_template_llama, THINKING_SCRIPT)


def test_thinking_disabled_gives_no_thinking_block(thinking_server: LiveServer) -> None:
    message = client(thinking_server).messages.create(
        model="bubo", max_tokens=64, thinking={"type": "disabled"}, messages=user("Do not think.")
    )
    # The template closed an empty think block itself, so the output is not split: all of it is text.
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == THINKING_SCRIPT


def test_omitted_thinking_display_keeps_the_block_without_its_text(thinking_server: LiveServer) -> None:
    body = {
        "model": "bubo",
        "max_tokens": 64,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "low"},
        "messages": user("Think quietly."),
    }
    answer = post(thinking_server, "/v1/messages", json=body).json()
    assert answer["content"] == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": "Hello there."},
    ]
    events = sse_events(
        post(
            thinking_server, "/v1/messages", json={**body, "stream": True, "messages": user("Quiet stream.")}
        ).text
    )
    deltas = [p["delta"] for n, p in events if n == "content_block_delta"]
    assert [d["type"] for d in deltas if d["type"] != "text_delta"] == ["signature_delta"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == "Hello there."


def test_effort_with_thinking_disabled_is_no_conflict(thinking_server: LiveServer) -> None:
    message = client(thinking_server).messages.create(
        model="bubo",
        max_tokens=64,
        thinking={"type": "disabled"},
        output_config={"effort": "high"},
        messages=user("No thoughts, high effort."),
    )
    assert [b.type for b in message.content] == ["text"]


# Streaming


def test_sdk_stream_thinking_and_text(thinking_server: LiveServer) -> None:
    events = list(
        client(thinking_server).messages.create(
            model="bubo", max_tokens=64, stream=True, messages=user("Stream your thoughts.")
        )
    )
    names = [e.type for e in events]
    # The SDK drops ping events; the raw-SSE test below sees them.
    assert collapse(names) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "text")]
    deltas = [e for e in events if e.type == "content_block_delta"]
    thinking = "".join(e.delta.thinking for e in deltas if e.delta.type == "thinking_delta")
    text = "".join(e.delta.text for e in deltas if e.delta.type == "text_delta")
    assert thinking.strip() == "Let me see." and text == "Hello there."
    # The thinking block ends with its signature, just before its stop.
    first_stop = names.index("content_block_stop")
    assert events[first_stop - 1].delta.type == "signature_delta"
    # The tags came one byte-token at a time: several deltas, none holding a piece of a tag.
    assert len(deltas) > 5
    assert not any("<" in (getattr(e.delta, "thinking", "") or "") for e in deltas)
    assert events[-2].delta.stop_reason == "end_turn"


def test_sdk_stream_helper_final_message(thinking_server: LiveServer) -> None:
    with client(thinking_server).messages.stream(
        model="bubo", max_tokens=64, messages=user("A streamed final message.")
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Hello there."
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking.strip() == "Let me see."
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 10


def test_raw_sse_framing_and_max_tokens(script_server: LiveServer, tiny_llama: LoadedModel) -> None:
    response = httpx.post(
        f"{script_server.url}/v1/messages",
        json={"model": "bubo", "max_tokens": 4, "stream": True, "messages": user("Raw stream please.")},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert collapse([n for n, _ in events]) == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    text = "".join(p["delta"]["text"] for n, p in events if n == "content_block_delta")
    assert text == script_prefix(tiny_llama, SCRIPT, 4)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4
    assert delta["timings"]["predicted_n"] == 4


def test_stream_stop_sequence(script_server: LiveServer) -> None:
    response = httpx.post(
        f"{script_server.url}/v1/messages",
        json={
            "model": "bubo",
            "max_tokens": 64,
            "stream": True,
            "stop_sequences": ["here"],
            "messages": user("Stream until here."),
        },
    )
    events = sse_events(response.text)
    text = "".join(p["delta"]["text"] for n, p in events if n == "content_block_delta")
    assert text == "Hello world. STOP "
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "here"}


def test_error_after_the_stream_started_is_an_error_event(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, defaults=GREEDY)

    async def failing(generation: GenerationRequest) -> AsyncIterator[OutputEvent]:
        yield OutputDelta("content", "Hi")
        raise ApiError(503, "device_lost", "the accelerator was lost")

    server.state.stream = failing  # type: ignore[method-assign]
    try:
        response = post(
            server,
            "/v1/messages",
            json={"model": "bubo", "max_tokens": 4, "stream": True, "messages": user("x")},
        )
    finally:
        server.stop()
    assert response.status_code == 200
    events = sse_events(response.text)
    assert [n for n, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    error = events[-1][1]
    assert error["error"] == {
        "type": "overloaded_error",
        "message": "the accelerator was lost",
        "code": "device_lost",
    }
    assert error["request_id"] == response.headers["x-request-id"]


# Tool use


def tool_call_request(text: str) -> dict[str, Any]:
    return {"model": "bubo", "max_tokens": 200, "tools": [WEATHER], "messages": user(text)}


def test_sdk_create_returns_a_tool_use_block(tool_server: LiveServer) -> None:
    message = client(tool_server).messages.create(**tool_call_request("Weather in Paris?"))
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking.strip() == "I need the weather."
    assert message.content[1].text == "Let me check."
    call = message.content[2]
    assert call.name == "get_weather" and call.input == ARGUMENTS
    assert re.fullmatch(r"toolu_[a-z0-9]{24}", call.id)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None


def test_sdk_stream_helper_assembles_the_tool_use(tool_server: LiveServer) -> None:
    with client(tool_server).messages.stream(**tool_call_request("Streamed weather, please.")) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[1].text == "Let me check."
    call = final.content[2]
    assert (call.name, call.input) == ("get_weather", ARGUMENTS)
    assert call.id.startswith("toolu_")
    assert final.stop_reason == "tool_use"


def test_raw_sse_tool_use_block(tool_server: LiveServer) -> None:
    response = post(
        tool_server, "/v1/messages", json={**tool_call_request("Raw weather stream."), "stream": True}
    )
    events = sse_events(response.text)
    starts = [p for n, p in events if n == "content_block_start"]
    assert [(p["index"], p["content_block"]["type"]) for p in starts] == [
        (0, "thinking"),
        (1, "text"),
        (2, "tool_use"),
    ]
    block = starts[2]["content_block"]
    assert block["name"] == "get_weather" and block["input"] == {}
    assert re.fullmatch(r"toolu_[a-z0-9]{24}", block["id"])
    # The tool block's events, in order: its start, argument fragments, its stop; the text block closed
    # before it opened.
    at = events.index(("content_block_start", starts[2]))
    assert events[at - 1] == ("content_block_stop", {"type": "content_block_stop", "index": 1})
    tail = events[at + 1 :]
    fragments = [p["delta"]["partial_json"] for n, p in tail if n == "content_block_delta"]
    assert all(
        p["index"] == 2 and p["delta"]["type"] == "input_json_delta" for _, p in tail[: len(fragments)]
    )
    # One fragment per argument, joining to the arguments' JSON.
    assert len(fragments) == 2 and json.loads("".join(fragments)) == ARGUMENTS
    assert tail[len(fragments)] == ("content_block_stop", {"type": "content_block_stop", "index": 2})
    assert [n for n, _ in tail[len(fragments) + 1 :]] == ["message_delta", "message_stop"]
    assert tail[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_malformed_call_comes_back_as_text(qwen3_template_llama: LoadedModel) -> None:
    server = serve_loaded(scripted(qwen3_template_llama, MALFORMED_CALL), defaults=GREEDY)
    try:
        message = client(server).messages.create(
            thinking={"type": "disabled"}, **tool_call_request("Weather, badly.")
        )
    finally:
        server.stop()
    assert [(b.type, b.text) for b in message.content] == [("text", MALFORMED_CALL)]
    assert message.stop_reason == "end_turn"


def test_tool_choice_none_hides_the_tools(tool_server: LiveServer) -> None:
    sdk = client(tool_server)
    history = user("Weather in Paris?")
    bare = sdk.messages.count_tokens(model="bubo", messages=history).input_tokens
    offered = sdk.messages.count_tokens(model="bubo", messages=history, tools=[WEATHER]).input_tokens
    hidden = sdk.messages.count_tokens(
        model="bubo", messages=history, tools=[WEATHER], tool_choice={"type": "none"}
    ).input_tokens
    assert hidden == bare < offered


# Errors, in Anthropic's shape


def post(server: LiveServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", **kwargs)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert body["type"] == "error"
    assert body["request_id"] == response.headers["x-request-id"]
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "kind", "code", "words"),
    [
        ({"max_tokens": 4, "messages": user("hi")}, 400, "invalid_request_error", "missing_model", "model"),
        (
            {"model": "nope", "max_tokens": 4, "messages": user("hi")},
            404,
            "not_found_error",
            "model_not_found",
            "nope",
        ),
        (
            {"model": "bubo", "messages": user("hi")},
            400,
            "invalid_request_error",
            "missing_max_tokens",
            "max_tokens",
        ),
        (
            {"model": "bubo", "max_tokens": 0, "messages": user("hi")},
            400,
            "invalid_request_error",
            "invalid_value",
            "max_tokens",
        ),
        (
            {"model": "bubo", "max_tokens": 4, "messages": []},
            400,
            "invalid_request_error",
            "missing_messages",
            "messages",
        ),
        (
            {"model": "bubo", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
            400,
            "invalid_request_error",
            "invalid_value",
            "messages[0].role",
        ),
        (
            {
                "model": "bubo",
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                            },
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "unsupported_content",
            "messages[0].content[1]",
        ),
        (
            {"model": "bubo", "max_tokens": 4, "messages": user("hi"), "thinking": {"type": "sometimes"}},
            400,
            "invalid_request_error",
            "invalid_value",
            "thinking",
        ),
        (
            {
                "model": "bubo",
                "max_tokens": 4,
                "messages": user("hi"),
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "bad"}}},
            },
            400,
            "invalid_request_error",
            "invalid_schema",
            "output_config.format",
        ),
        (
            {
                "model": "bubo",
                "max_tokens": 4,
                "messages": user("hi"),
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            400,
            "invalid_request_error",
            "invalid_value",
            "tool_choice.name",
        ),
        (
            {"model": "bubo", "max_tokens": 4, "messages": user("hi"), "tool_choice": {"type": "any"}},
            400,
            "invalid_request_error",
            "invalid_value",
            "tool_choice.type",
        ),
        (
            {"model": "bubo", "max_tokens": 4, "messages": user("hi"), "stop_sequences": [""]},
            400,
            "invalid_request_error",
            "invalid_value",
            "stop_sequences",
        ),
    ],
)
def test_messages_errors(
    tiny_server: LiveServer, body: dict[str, Any], status: int, kind: str, code: str, words: str
) -> None:
    response = post(tiny_server, "/v1/messages", json=body)
    assert response.status_code == status
    error = error_of(response)
    assert (error["type"], error["code"]) == (kind, code)
    assert words in error["message"]


def test_bad_json_is_a_parse_error(tiny_server: LiveServer) -> None:
    response = post(
        tiny_server,
        "/v1/messages",
        content=b'{"model": "bubo",',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert error_of(response)["code"] == "parse_error"


def test_sdk_raises_typed_errors(tiny_server: LiveServer) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client(tiny_server).messages.create(model="nope", max_tokens=4, messages=user("hi"))
    assert caught.value.status_code == 404
    assert caught.value.body["error"]["code"] == "model_not_found"


def test_count_tokens_refuses_stream_and_images(tiny_server: LiveServer) -> None:
    streamed = post(
        tiny_server,
        "/v1/messages/count_tokens",
        json={"model": "bubo", "stream": True, "messages": user("hi")},
    )
    assert streamed.status_code == 400
    assert error_of(streamed)["code"] == "unsupported_stream"
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    imaged = post(
        tiny_server,
        "/v1/messages/count_tokens",
        json={"model": "bubo", "messages": [{"role": "user", "content": [image]}]},
    )
    assert imaged.status_code == 400
    assert error_of(imaged)["code"] == "unsupported_content"


def test_count_tokens_beyond_the_context(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, ctx_size=16, defaults=GREEDY)
    try:
        body = {
            "model": "bubo",
            "messages": user("This prompt is far longer than sixteen tokens of context."),
        }
        counted = post(server, "/v1/messages/count_tokens", json=body)
        assert counted.status_code == 200
        n = counted.json()["input_tokens"]
        assert n > 16
        refused = post(server, "/v1/messages", json={**body, "max_tokens": 4})
        assert refused.status_code == 400
        error = error_of(refused)
        assert error["code"] == "context_length_exceeded"
        assert re.search(r"the prompt has (\d+) tokens", error["message"]).group(1) == str(n)
    finally:
        server.stop()


# Auth


def test_api_key(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, api_key="k", defaults=GREEDY)
    try:
        counted = client(server, key="k").messages.count_tokens(model="bubo", messages=user("hello"))
        assert counted.input_tokens > 5
        with pytest.raises(anthropic.AuthenticationError) as caught:
            client(server, key="wrong").messages.create(model="bubo", max_tokens=2, messages=user("hi"))
        assert caught.value.status_code == 401
        response = post(
            server,
            "/v1/messages",
            json={"model": "bubo", "max_tokens": 2, "messages": user("hi")},
            headers={"x-api-key": "wrong"},
        )
        assert response.status_code == 401
        error = error_of(response)
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    finally:
        server.stop()


# Message conversion


def test_tool_history_becomes_template_messages() -> None:
    body = Body(
        {
            "system": [{"type": "text", "text": "Use tools."}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Call the tool.", "signature": "s"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "18C"}],
                        },
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
        }
    )
    assert _template_messages(body) == [
        {"role": "system", "content": "Use tools.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "user", "content": "Thanks."},
    ]


def test_tools_and_tool_history_render_with_qwen3(thinking_server: LiveServer) -> None:
    tools = [
        {
            "name": "weather",
            "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}]},
    ]
    sdk = client(thinking_server)
    bare = sdk.messages.count_tokens(model="bubo", messages=history).input_tokens
    with_tools = sdk.messages.count_tokens(model="bubo", messages=history, tools=tools).input_tokens
    # Qwen3 writes each tool's JSON signature into the system prompt: at least the description's bytes.
    assert with_tools - bare >= len("The weather in a city.") // 2
    server_tool = post(
        thinking_server,
        "/v1/messages/count_tokens",
        json={
            "model": "bubo",
            "messages": history,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
    )
    assert server_tool.status_code == 400
    assert error_of(server_tool)["code"] == "unsupported_tool"


def tool_round_trip(tool_use_id: str) -> dict[str, Any]:
    """A conversation where the assistant called get_weather and the user sent back its result."""
    return {
        "model": "bubo",
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": tool_use_id, "name": "get_weather", "input": {"city": "Paris"}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "18C and sunny"}],
            },
        ],
    }


@pytest.mark.parametrize("fixture", ["tool_server", "tiny_server"])
def test_tool_round_trip_renders_the_result(fixture: str, request: pytest.FixtureRequest) -> None:
    """Qwen3 renders the call and its result natively; the ChatML template gets them written as text."""
    server: LiveServer = request.getfixturevalue(fixture)
    chat = _chat_request(Body(tool_round_trip("toolu_abc123")))
    call, result = chat.messages[1]["tool_calls"][0], chat.messages[2]
    assert call["id"] == result["tool_call_id"] == "call_abc123"
    prompt = server.state.render(chat)
    assert "18C and sunny" in prompt
    assert prompt.index('"city": "Paris"') < prompt.index("18C and sunny")


def test_sdk_tool_round_trip(tool_server: LiveServer) -> None:
    """The SDK's own tool_use block, sent back with a tool_result, makes a valid next request."""
    sdk = client(tool_server)
    first = sdk.messages.create(**tool_call_request("Weather in Paris?"))
    call = first.content[-1]
    assert call.type == "tool_use"
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C"}]},
    ]
    counted = sdk.messages.count_tokens(model="bubo", tools=[WEATHER], messages=history).input_tokens
    assert (
        counted > sdk.messages.count_tokens(model="bubo", tools=[WEATHER], messages=history[:1]).input_tokens
    )
    follow_up = sdk.messages.create(model="bubo", max_tokens=200, tools=[WEATHER], messages=history)
    assert follow_up.stop_reason == "tool_use"


# The default model


def test_smollm2_answers_through_the_sdk(smollm2_server: LiveServer) -> None:
    message = client(smollm2_server).messages.create(
        model="bubo",
        # One token: the default model decodes slowly on a busy CPU, and one proves the path.
        max_tokens=1,
        # This SDK version no longer types the sampling fields; the API still takes them.
        extra_body={"temperature": 0.0},
        messages=user("Hi."),
    )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 1
    assert message.content[0].type == "text" and message.content[0].text.strip()


def test_smollm2_named_tool_choice_forces_a_valid_call(smollm2_server: LiveServer) -> None:
    message = client(smollm2_server).messages.create(
        model="bubo",
        max_tokens=60,
        extra_body={"temperature": 0.7},
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=user("What is the weather like in Lisbon?"),
    )
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    assert message.stop_reason == "tool_use"


def test_smollm2_json_schema_output(smollm2_server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = post(
        smollm2_server,
        "/v1/messages",
        json={
            "model": "bubo",
            "max_tokens": 60,
            "temperature": 0.7,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
            "messages": user("Describe a person as JSON with a name and an age."),
        },
        timeout=120,
    )
    answer = response.json()
    assert answer["stop_reason"] == "end_turn"
    [block] = answer["content"]
    jsonschema.validate(json.loads(block["text"]), schema)
