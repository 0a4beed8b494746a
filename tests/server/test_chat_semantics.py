"""Chat semantics through the OpenAI dialect: tool calls (both formats, streamed and not, forced by
tool_choice), structured output, reasoning budgets and the tools prompt for templates without tools."""

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.sampler import SamplingParams
from tests.conftest import _tiny_llama
from tests.server.live_server import LiveServer, scripted, serve_loaded

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def client_for(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def serve() -> Iterator:
    servers: list[LiveServer] = []

    def start(loaded: LoadedModel, text: str | None = None, **settings: object) -> LiveServer:
        model = scripted(loaded, text) if text is not None else loaded
        server = serve_loaded(model, **settings)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_a_json_tool_call_becomes_tool_calls(serve, long_llama: LoadedModel) -> None:
    client = client_for(serve(long_llama, "Let me check.\n" + JSON_CALL))
    reply = client.chat.completions.create(model="bubo", messages=ASK, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_streamed_tool_calls_arrive_name_first_then_argument_fragments(
    serve, long_llama: LoadedModel
) -> None:
    client = client_for(serve(long_llama, JSON_CALL + "\n" + JSON_CALL.replace("Paris", "Rome")))
    chunks = list(client.chat.completions.create(model="bubo", messages=ASK, tools=[WEATHER], stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    calls: dict[int, dict] = {}
    for piece in pieces:
        entry = calls.setdefault(piece.index, {"id": piece.id, "name": None, "arguments": "", "fragments": 0})
        if piece.function.name:
            assert entry["name"] is None and entry["arguments"] == ""  # the name comes first
            entry["name"] = piece.function.name
        if piece.function.arguments:
            entry["arguments"] += piece.function.arguments
            entry["fragments"] += 1
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_weather"]
    assert [json.loads(calls[i]["arguments"])["city"] for i in sorted(calls)] == ["Paris", "Rome"]
    assert all(c["fragments"] >= 2 for c in calls.values())
    assert calls[0]["id"] != calls[1]["id"]
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def _sse(text: str) -> list[dict]:
    """The JSON payloads of an SSE body (named events or not), without the final [DONE]."""
    return [
        json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_a_call_cut_by_the_token_limit_leaks_no_markup(serve, long_llama: LoadedModel) -> None:
    """A second call cut short by max_tokens is dropped in every dialect, streamed or not: its markup
    reaches no answer text, and what remains keeps the order it was generated in."""
    done = "Let me check.\n" + JSON_CALL
    cut = '\n<tool_call>\n{"name": "get_'
    limit = len(long_llama.tokenizer.encode(done + cut, add_bos=False, parse_special=False))
    server = serve(long_llama, done + "\n" + JSON_CALL, defaults=SamplingParams(temperature=0.0))
    tools = [WEATHER]
    chat = {"model": "bubo", "messages": ASK, "tools": tools, "max_tokens": limit}
    flat_tools = [{"type": "function", **WEATHER["function"]}]
    responses = {"model": "bubo", "input": "Weather?", "tools": flat_tools, "max_output_tokens": limit}
    anthropic_tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    messages = {"model": "bubo", "messages": ASK, "tools": [anthropic_tool], "max_tokens": limit}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
        assert reply["message"]["content"] == "Let me check."
        assert len(reply["message"]["tool_calls"]) == 1 and reply["finish_reason"] == "length"
        chunks = _sse(http.post("/v1/chat/completions", json={**chat, "stream": True}).text)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
        assert {call["index"] for d in deltas for call in d.get("tool_calls", [])} == {0}

        output = http.post("/v1/responses", json=responses).json()["output"]
        assert [item["type"] for item in output] == ["message", "function_call"]
        assert output[0]["content"][0]["text"] == "Let me check."
        events = _sse(http.post("/v1/responses", json={**responses, "stream": True}).text)
        texts = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(texts) == "Let me check."

        message = http.post("/v1/messages", json=messages).json()
        assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
        assert message["content"][0]["text"] == "Let me check." and message["stop_reason"] == "max_tokens"
        events = _sse(http.post("/v1/messages", json={**messages, "stream": True}).text)
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert starts == ["text", "tool_use"]
        texts = [
            e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and "text" in e["delta"]
        ]
        assert "".join(texts) == "Let me check."


def test_text_after_a_call_keeps_its_place_streamed_or_not(serve, long_llama: LoadedModel) -> None:
    server = serve(long_llama, JSON_CALL + "\nDone.", defaults=SamplingParams(temperature=0.0))
    flat_tools = [{"type": "function", **WEATHER["function"]}]
    responses = {"model": "bubo", "input": "Weather?", "tools": flat_tools}
    anthropic_tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    messages = {"model": "bubo", "messages": ASK, "tools": [anthropic_tool], "max_tokens": 200}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        message = http.post("/v1/messages", json=messages).json()
        assert [b["type"] for b in message["content"]] == ["tool_use", "text"]
        events = _sse(http.post("/v1/messages", json={**messages, "stream": True}).text)
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert starts == ["tool_use", "text"]
        output = http.post("/v1/responses", json=responses).json()["output"]
        assert [item["type"] for item in output] == ["function_call", "message"]
        events = _sse(http.post("/v1/responses", json={**responses, "stream": True}).text)
        done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
        assert done == ["function_call", "message"]


def test_parallel_tool_calls_false_keeps_one_call(serve, long_llama: LoadedModel) -> None:
    client = client_for(serve(long_llama, JSON_CALL + "\n" + JSON_CALL))
    reply = client.chat.completions.create(
        model="bubo", messages=ASK, tools=[WEATHER], parallel_tool_calls=False
    )
    assert len(reply.choices[0].message.tool_calls) == 1
    assert "<tool_call>" in reply.choices[0].message.content


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
    ],
)
def test_a_malformed_call_is_returned_as_text(serve, long_llama: LoadedModel, bad: str) -> None:
    client = client_for(serve(long_llama, bad))
    reply = client.chat.completions.create(model="bubo", messages=ASK, tools=[WEATHER])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == bad


def test_a_call_the_model_ends_inside_is_dropped(serve, long_llama: LoadedModel) -> None:
    client = client_for(serve(long_llama, 'Checking.\n<tool_call>\n{"name": "get_weather"'))
    reply = client.chat.completions.create(model="bubo", messages=ASK, tools=[WEATHER])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == "Checking."


def test_xml_parameter_calls_are_typed_by_the_schema(serve, qwen35_template_llama: LoadedModel) -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    # Qwen3.5's generation prompt opens the reasoning block itself.
    client = client_for(serve(qwen35_template_llama, "The user wants weather.\n</think>\n\n" + text))
    reply = client.chat.completions.create(model="bubo", messages=ASK, tools=[WEATHER])
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants weather.\n"
    [call] = message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "New York", "days": 3}


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": "city"},
        {"type": "object", "properties": {"city": 5, "days": {"type": 3}}},
    ],
)
def test_xml_calls_against_a_malformed_schema_keep_their_values(
    serve, qwen35_template_llama: LoadedModel, parameters: dict
) -> None:
    """The parser types XML parameter values by the tool's schema; a schema that is JSON but not a
    usable schema (the request's mistake, never compiled unless the call is forced) leaves the values
    untyped instead of failing the generation with an internal error."""
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    server = serve(qwen35_template_llama, "Weather.\n</think>\n\n" + text)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    body = {"model": "bubo", "messages": ASK, "tools": [tool]}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [call] = response.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_tool_choice_none_hides_the_tools(serve, long_llama: LoadedModel) -> None:
    server = serve(long_llama, JSON_CALL)
    body = {"model": "bubo", "messages": ASK, "tools": [WEATHER]}
    with_tools = httpx.post(server.url + "/apply-template", json=body).json()["prompt"]
    without = httpx.post(server.url + "/apply-template", json={**body, "tool_choice": "none"}).json()[
        "prompt"
    ]
    assert "get_weather" in with_tools and "get_weather" not in without
    reply = httpx.post(server.url + "/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
    assert reply["choices"][0]["message"]["content"] == JSON_CALL  # not parsed: no tools were offered


def test_a_template_without_tools_gets_them_in_the_system_prompt(serve, long_llama: LoadedModel) -> None:
    server = serve(long_llama, "ok")
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    prompt = httpx.post(
        server.url + "/apply-template", json={"messages": history, "tools": [WEATHER]}
    ).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in prompt


def test_a_template_with_tools_renders_them_itself(serve, qwen3_template_llama: LoadedModel) -> None:
    server = serve(qwen3_template_llama, "ok")
    prompt = httpx.post(server.url + "/apply-template", json={"messages": ASK, "tools": [WEATHER]}).json()[
        "prompt"
    ]
    assert "<tools>\n" + json.dumps(WEATHER) in prompt and "# Tools" in prompt


def test_an_assistant_turn_with_null_content_renders(serve, qwen3_template_llama: LoadedModel) -> None:
    """The tool round trip as OpenAI clients make it: the assistant's calls come back with
    `content: null` (as the server sent them), then the tool's result. Qwen3's template reads
    `message.content` unguarded; the server must not make that a 400."""
    server = serve(qwen3_template_llama, "ok")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    response = httpx.post(server.url + "/apply-template", json={"messages": history, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    prompt = response.json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    body = {"model": "bubo", "messages": history, "tools": [WEATHER], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("choice", "status", "param"),
    [
        ({"type": "function", "function": {"name": "nope"}}, 400, "tool_choice.function.name"),
        ("sometimes", 400, "tool_choice"),
    ],
)
def test_bad_tool_choices(serve, long_llama: LoadedModel, choice: object, status: int, param: str) -> None:
    server = serve(long_llama, "x")
    body = {"model": "bubo", "messages": ASK, "tools": [WEATHER], "tool_choice": choice}
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == status and response.json()["error"]["param"] == param


def test_required_without_tools_is_refused(tiny_server: LiveServer) -> None:
    body = {"model": "bubo", "messages": ASK, "tool_choice": "required"}
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


def test_an_invalid_schema_is_400_naming_the_problem(tiny_server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    response = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        json={"model": "bubo", "messages": ASK, "response_format": fmt},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (
        error["code"] == "invalid_schema"
        and error["param"] == "response_format"
        and "objekt" in error["message"]
    )


def test_a_schema_no_json_matches_is_400(tiny_server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}
    response = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        json={"model": "bubo", "messages": ASK, "response_format": fmt},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_schema", "response_format")


_BAD_PARAMETERS = {"type": "object", "properties": {"city": 5}}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": ASK,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": _BAD_PARAMETERS}}],
                "tool_choice": "required",
            },
        ),
        (
            "/v1/responses",
            {
                "input": "hi",
                "tools": [{"type": "function", "name": "f", "parameters": _BAD_PARAMETERS}],
                "tool_choice": "required",
            },
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 4,
                "messages": ASK,
                "tools": [{"name": "f", "input_schema": _BAD_PARAMETERS}],
                "tool_choice": {"type": "any"},
            },
        ),
    ],
)
def test_a_forced_call_to_a_tool_with_an_unusable_schema_is_400(
    tiny_server: LiveServer, path: str, body: dict[str, object]
) -> None:
    """The grammar that forces a call embeds the tool's schema; a schema it cannot compile is the
    request's mistake (400 invalid_schema naming tools), not an internal error."""
    response = httpx.post(tiny_server.url + path, json={"model": "bubo", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error.get("param", "tools")) == ("invalid_schema", "tools")
    assert "properties" in error["message"] or "schema" in error["message"]


def test_max_tokens_inside_the_reasoning_leaves_the_answer_empty(
    serve, qwen3_template_llama: LoadedModel
) -> None:
    client = client_for(serve(qwen3_template_llama, "<think>\n" + "step " * 30 + "</think>\n\nanswer"))
    reply = client.chat.completions.create(model="bubo", messages=ASK, max_tokens=12)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == ""
    assert reply.choices[0].message.model_extra["reasoning_content"].startswith("step")


def test_a_reasoning_budget_closes_the_block_and_the_answer_starts(
    serve, qwen3_template_llama: LoadedModel
) -> None:
    client = client_for(serve(qwen3_template_llama, "<think>\n" + "step " * 400 + "</think>\n\nanswer"))
    reply = client.chat.completions.create(
        model="bubo", messages=ASK, reasoning_effort="minimal", max_tokens=700
    )
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.count("step") <= 256 < 400
    assert message.content  # the model went on writing after the forced </think>
    assert reply.usage.completion_tokens_details.reasoning_tokens >= 256


# The real default model: forced tool calls and JSON output that must validate, also when sampled.


@pytest.fixture(scope="module")
def smollm2_sampling(smollm2: LoadedModel) -> Iterator[LiveServer]:
    server = serve_loaded(smollm2, defaults=SamplingParams(temperature=0.8, seed=7))
    yield server
    server.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_the_default_model_makes_a_valid_forced_call(smollm2_sampling: LiveServer, choice: object) -> None:
    client = client_for(smollm2_sampling)
    reply = client.chat.completions.create(
        model="bubo", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60
    )
    [call] = reply.choices[0].message.tool_calls[:1]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert reply.choices[0].finish_reason == "tool_calls"


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_the_default_model_writes_json_that_validates(smollm2_sampling: LiveServer, stream: bool) -> None:
    client = client_for(smollm2_sampling)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Invent a person."}]
    if stream:
        chunks = client.chat.completions.create(
            model="bubo", messages=messages, response_format=fmt, max_tokens=80, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = client.chat.completions.create(
            model="bubo", messages=messages, response_format=fmt, max_tokens=80
        )
        text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_mode_gives_an_object(smollm2_sampling: LiveServer, runtime_options) -> None:
    # Greedy, the 135M model's answer under the grammar is a short object with float activations; with int8
    # ones it runs on inside one string past any budget (the grammar bounds the shape, not the length).
    runtime_options(int8_matvec=False)
    reply = client_for(smollm2_sampling).chat.completions.create(
        model="bubo",
        messages=[{"role": "user", "content": "A JSON object with a colour."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_xml_parameter_calls_stream_as_tool_call_deltas(serve, qwen35_template_llama: LoadedModel) -> None:
    text = (
        "Checking.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>"
    )
    client = client_for(serve(qwen35_template_llama, text))
    chunks = list(client.chat.completions.create(model="bubo", messages=ASK, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    pieces = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert reasoning == "Checking."
    assert pieces[0].function.name == "get_weather" and pieces[0].id.startswith("call_")
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Oslo", "days": 1}
    assert not any(d.content for d in deltas)


PREFILL = [
    {"role": "user", "content": "What is six times seven?"},
    {"role": "assistant", "content": "It is "},
]


def test_a_final_assistant_message_is_continued(serve, tiny_llama: LoadedModel) -> None:
    """A chat that ends with an assistant message asks for its continuation (Anthropic's prefill, and
    llama-server's): the prompt stops after that text, not after a closed turn and a new header."""
    server = serve(tiny_llama, "42.")
    prompt = httpx.post(server.url + "/apply-template", json={"messages": PREFILL}).json()["prompt"]
    assert prompt.endswith(
        "<|im_start|>user\nWhat is six times seven?<|im_end|>\n<|im_start|>assistant\nIt is"
    )
    reply = httpx.post(
        server.url + "/v1/chat/completions", json={"model": "bubo", "messages": PREFILL}
    ).json()
    assert reply["choices"][0]["message"]["content"] == "42."  # the continuation alone
    assert reply["usage"]["prompt_tokens"] == len(server.state.tokenize(prompt))
    anthropic = httpx.post(
        server.url + "/v1/messages", json={"model": "bubo", "max_tokens": 8, "messages": PREFILL}
    ).json()
    assert anthropic["content"] == [{"type": "text", "text": "42."}]
    usage = anthropic["usage"]  # the prompt cache holds the first request's prompt: read, not input
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(server.state.tokenize(prompt))


def test_a_continued_turn_keeps_the_templates_thinking_block(
    serve, qwen3_template_llama: LoadedModel
) -> None:
    server = serve(qwen3_template_llama, "42.")
    prompt = httpx.post(server.url + "/apply-template", json={"messages": PREFILL}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is")


def test_a_final_assistant_message_the_template_rewrites_is_400(serve, tmp_path) -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    loaded = load_model(_tiny_llama(tmp_path / "Upper.gguf", 512, **{"tokenizer.chat_template": template}))
    server = serve(loaded, "x")
    reply = httpx.post(server.url + "/v1/chat/completions", json={"model": "bubo", "messages": PREFILL})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages[1].content"
