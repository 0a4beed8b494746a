"""Hostile values for every numeric and structured request field, in every dialect: negative, zero,
huge, NaN, Infinity, numbers past float or integer range, booleans and strings for numbers, wrong
types, oversized stop lists and strings, deep nesting. Each is a 400 that names the field (`param` in
the OpenAI shape, the message in the Anthropic one), answered at once: nothing is sized by the
client's number."""

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from bubo.server.fields import MAX_COUNT, MAX_JSON_DEPTH, MAX_STOP_BYTES, MAX_STOP_STRINGS
from tests.server.live_server import LiveServer, scripted, serve_loaded

USER = [{"role": "user", "content": "hello there"}]
# Each dialect: its route, a body it answers, and the name of its token limit.
DIALECTS = {
    "chat": ("/v1/chat/completions", {"model": "bubo", "messages": USER, "max_tokens": 2}, "max_tokens"),
    "completions": (
        "/v1/completions",
        {"model": "bubo", "prompt": "hello there", "max_tokens": 2},
        "max_tokens",
    ),
    "responses": (
        "/v1/responses",
        {"model": "bubo", "input": "hello there", "max_output_tokens": 2},
        "max_output_tokens",
    ),
    "messages": ("/v1/messages", {"model": "bubo", "messages": USER, "max_tokens": 2}, "max_tokens"),
    "completion": ("/completion", {"prompt": "hello there", "n_predict": 2}, "n_predict"),
}
COUNT_TOKENS = ("/v1/messages/count_tokens", {"model": "bubo", "messages": USER}, "")
ANTHROPIC = {"messages", "count_tokens"}
# Raw JSON texts a JSON encoder will not write: the server must still refuse them by name.
NAN, INF, NEG_INF, PAST_FLOAT, LONG_INT = "NaN", "Infinity", "-Infinity", "1e999", "9" * 5000
RAW = {NAN, INF, NEG_INF, PAST_FLOAT, LONG_INT}
NOT_NUMBERS = ["1", True, [], {}, [1], {"value": 1}]
NOT_FINITE = [NAN, INF, NEG_INF, PAST_FLOAT, LONG_INT]

# field -> values refused for it (the dialects that read the field are listed below).
FLOAT_FIELDS: dict[str, list[Any]] = {
    "temperature": [-0.1, -1e308, 10**400, *NOT_FINITE, *NOT_NUMBERS],
    "top_p": [-0.1, 1.01, 1e308, *NOT_FINITE, *NOT_NUMBERS],
    "min_p": [-0.1, 1.5, *NOT_FINITE, *NOT_NUMBERS],
    "repeat_penalty": [0, -1, *NOT_FINITE, *NOT_NUMBERS],
    "presence_penalty": [-2.01, 2.01, 1e308, *NOT_FINITE, *NOT_NUMBERS],
    "frequency_penalty": [-3, 3, -1e308, *NOT_FINITE, *NOT_NUMBERS],
}
INTEGER_FIELDS: dict[str, list[Any]] = {
    "top_k": [-2, 10**12, MAX_COUNT + 1, 2**64, 1.5, *NOT_FINITE, *NOT_NUMBERS],
    "seed": [-2, 2**64, 10**30, 0.5, *NOT_FINITE, *NOT_NUMBERS],
    "repeat_last_n": [-2, 10**12, 2.5, *NOT_FINITE, *NOT_NUMBERS],
}
# Keys that are not integers ("abc", "1.5") are text, tokenized as llama-server does
# (tests/server/test_llama_compat.py): not hostile.
LOGIT_BIAS = [
    {"-1": 1},
    {"320": 1},
    {"99999999999999999999": 1},
    {"1": 100.5},
    {"1": -101},
    {"1": 10**400},
    {"1": "1"},
    {"1": True},
    {"1": None},
    {"1": NAN},
    {"1": INF},
    [[1.5, 1]],
    [[True, 1]],
    [[1, 2, 3]],
    [["1", 1e300]],
    "x",
    5,
]
STOP = [
    ["a"] * (MAX_STOP_STRINGS + 1),
    ["s"] * 10_000,
    "x" * (MAX_STOP_BYTES + 1),
    "x" * 1_000_000,
    ["\u00e9" * (MAX_STOP_BYTES // 2 + 1)],
    [""],
    "",
    [1],
    [None],
    [["a"]],
    {"a": 1},
    5,
    True,
]

SAMPLING_DIALECTS = ["chat", "completions", "responses", "completion"]
# Anthropic reads only these of the sampling fields.
ANTHROPIC_FIELDS = {"temperature", "top_p", "top_k"}


def _cases() -> Iterator[Any]:
    for dialect in DIALECTS:
        fields = {**FLOAT_FIELDS, **INTEGER_FIELDS}
        for field, values in fields.items():
            if dialect in ANTHROPIC and field not in ANTHROPIC_FIELDS:
                continue
            for value in values:
                yield pytest.param(dialect, field, value, id=f"{dialect}-{field}-{_id(value)}")
        limit = DIALECTS[dialect][2]
        # /completion's n_predict 0 evaluates the prompt alone (llama-server's cache warming): accepted.
        zero = [] if dialect == "completion" else [0]
        for value in [*zero, -2, 10**12, MAX_COUNT + 1, 2.5, *NOT_FINITE, *NOT_NUMBERS]:
            yield pytest.param(dialect, limit, value, id=f"{dialect}-{limit}-{_id(value)}")
        if dialect not in ANTHROPIC:
            for value in LOGIT_BIAS:
                yield pytest.param(dialect, "logit_bias", value, id=f"{dialect}-logit_bias-{_id(value)}")
        stop = "stop_sequences" if dialect in ANTHROPIC else "stop"
        for value in STOP:
            if dialect in ANTHROPIC and isinstance(value, str):
                continue
            yield pytest.param(dialect, stop, value, id=f"{dialect}-{stop}-{_id(value)}")


def _id(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 24 else f"{text[:12]}...{len(text)}"


def _encode(body: dict[str, Any], field: str, value: Any) -> bytes:
    """`body` with `field` (dotted for nesting) set to `value`; RAW texts go into the JSON as they are."""
    marker = "__value__"

    def place(document: Any, path: list[str], new: Any) -> Any:
        if not path:
            return new
        if isinstance(document, list):
            index = int(path[0])
            return [place(item, path[1:], new) if i == index else item for i, item in enumerate(document)]
        return {**document, path[0]: place(document.get(path[0], {}), path[1:], new)}

    def mark(item: Any) -> Any:
        if isinstance(item, str) and item in RAW:
            return f"{marker}{item}{marker}"
        if isinstance(item, dict):
            return {key: mark(v) for key, v in item.items()}
        if isinstance(item, list):
            return [mark(v) for v in item]
        return item

    text = json.dumps(place(body, field.split("."), mark(value)))
    for raw in RAW:
        text = text.replace(f'"{marker}{raw}{marker}"', raw)
    return text.encode()


@pytest.fixture(scope="module")
def server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(
        scripted(tiny_llama, "Hi there."), defaults=SamplingParams(temperature=0.0, max_tokens=4)
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as session:
        yield session


def assert_refused(response: httpx.Response, dialect: str, field: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text[:300]
    body = response.json()
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    # The field, or a place inside it (logit_bias.5 for a NaN bias of token 5).
    named = error.get("param") if dialect not in ANTHROPIC else error["message"].partition(":")[0]
    assert named is not None and (named == field or named.startswith((f"{field}.", f"{field}["))), error
    assert error["message"].startswith(named), error
    if dialect in ANTHROPIC:
        assert body["type"] == "error"
    return error


@pytest.mark.parametrize(("dialect", "field", "value"), list(_cases()))
def test_a_hostile_value_is_a_400_naming_its_field(
    client: httpx.Client, dialect: str, field: str, value: Any
) -> None:
    path, body, _ = DIALECTS[dialect]
    assert_refused(client.post(path, content=_encode(body, field, value)), dialect, field)


@pytest.mark.parametrize(
    ("dialect", "field", "value", "named"),
    [
        ("chat", "top_logprobs", 21, "top_logprobs"),
        ("chat", "top_logprobs", -1, "top_logprobs"),
        ("chat", "top_logprobs", 10**9, "top_logprobs"),
        ("chat", "n", 10**12, "n"),
        ("completions", "logprobs", 10**9, "logprobs"),
        ("completions", "logprobs", -1, "logprobs"),
        ("completions", "n", -1, "n"),
        ("responses", "top_logprobs", 10**9, "top_logprobs"),
        ("completion", "n_probs", 10**9, "n_probs"),
        ("completion", "n_probs", -1, "n_probs"),
        ("completion", "n_probs", NAN, "n_probs"),
        ("messages", "thinking.budget_tokens", 0, "thinking.budget_tokens"),
        ("messages", "thinking.budget_tokens", 10**12, "thinking.budget_tokens"),
        ("messages", "thinking.budget_tokens", "5", "thinking.budget_tokens"),
        ("messages", "thinking.budget_tokens", INF, "thinking.budget_tokens"),
        ("count_tokens", "thinking.budget_tokens", -5, "thinking.budget_tokens"),
        ("count_tokens", "thinking.budget_tokens", 2**64, "thinking.budget_tokens"),
        ("chat", "thinking.budget_tokens", "x", "thinking.budget_tokens"),
        ("chat", "thinking.budget_tokens", 0, "thinking.budget_tokens"),
        ("responses", "thinking.budget_tokens", 1.5, "thinking.budget_tokens"),
        ("chat", "messages.0.content", NAN, "messages[0].content"),
        ("messages", "messages.0.content", LONG_INT, "messages[0].content"),
        ("responses", "metadata.note", INF, "metadata.note"),
        ("completions", "stream_options.include_usage", 1, "stream_options.include_usage"),
        (
            "chat",
            "response_format.json_schema.schema.maximum",
            PAST_FLOAT,
            "response_format.json_schema.schema.maximum",
        ),
    ],
)
def test_counts_and_nested_numbers_are_refused_by_name(
    client: httpx.Client, dialect: str, field: str, value: Any, named: str
) -> None:
    path, body, _ = COUNT_TOKENS if dialect == "count_tokens" else DIALECTS[dialect]
    if field == "thinking.budget_tokens":
        body = {**body, "thinking": {"type": "enabled"}}
    assert_refused(client.post(path, content=_encode(body, field, value)), dialect, named)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 10_000, 100_000])
@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_deep_nesting_is_a_400_not_a_crash(client: httpx.Client, dialect: str, depth: int) -> None:
    path, body, _ = DIALECTS[dialect]
    nested = ("[" * depth + "]" * depth).encode()
    raw = json.dumps({**body, "metadata": "__deep__"}).encode().replace(b'"__deep__"', nested)
    response = client.post(path, content=raw)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "parse_error" and "deeper" in error["message"]


def test_nesting_within_the_limit_is_accepted(client: httpx.Client) -> None:
    path, body, _ = DIALECTS["chat"]
    raw = json.dumps({**body, "user_data": "__deep__"}).encode()
    depth = MAX_JSON_DEPTH - 1
    response = client.post(path, content=raw.replace(b'"__deep__"', b"[" * depth + b"]" * depth))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("dialect", "field", "value"),
    [
        ("chat", "max_tokens", MAX_COUNT),
        ("completion", "n_predict", MAX_COUNT),
        ("completion", "n_predict", 0),
        ("responses", "max_output_tokens", MAX_COUNT),
        ("messages", "max_tokens", MAX_COUNT),
        ("chat", "top_k", MAX_COUNT),
        ("completions", "repeat_last_n", MAX_COUNT),
        ("completion", "seed", 2**64 - 1),
        ("chat", "stop", ["s"] * MAX_STOP_STRINGS),
        ("chat", "stop", ["x" * MAX_STOP_BYTES]),
        ("chat", "logit_bias", {"319": 100, "5": -100, "7": False}),
        ("completion", "logit_bias", [[319, -100], [5, False]]),
    ],
)
def test_the_largest_allowed_values_are_answered_at_once(
    client: httpx.Client, dialect: str, field: str, value: Any
) -> None:
    """At the limits, the answer is the scripted one and comes at once: a token limit of 2**31 - 1 or a
    top_k past the vocabulary sizes nothing by the number (the generation ends at the model's end token)."""
    path, body, _ = DIALECTS[dialect]
    started = time.monotonic()
    response = client.post(path, content=_encode(body, field, value))
    assert response.status_code == 200, response.text[:300]
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("schema", "status"),
    [
        ({"type": "array", "minItems": 10**9}, 200),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 10**5, "maxItems": 10**5}, 200),
        ({"type": "string", "pattern": "(a{1000}){1000}"}, 200),
        ({"type": "string", "minLength": 10**12}, 400),
        ({"type": "string", "maxLength": -1}, 400),
        ({"type": "string", "minLength": 1.5}, 400),
        ({"type": "integer", "minimum": 10**30}, 400),
        ({"type": "number", "multipleOf": 0}, 400),
    ],
)
def test_numbers_inside_an_output_schema_size_nothing(
    client: httpx.Client, schema: dict[str, Any], status: int
) -> None:
    """A schema's counts bound the answer's grammar, not memory: huge ones compile lazily (the
    generation ends at the token limit) or are refused as invalid_schema."""
    path, body, _ = DIALECTS["chat"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    started = time.monotonic()
    response = client.post(path, json={**body, "response_format": fmt})
    assert response.status_code == status, response.text[:300]
    assert time.monotonic() - started < 10
    if status == 400:
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_schema", "response_format")


CALL_ARGUMENTS = [
    '{"n": ' + LONG_INT + "}",
    '{"n": ' + NAN + "}",
    "[" * 5000 + "]" * 5000,
    '{"city": "\\ud800"}',
    '{"\\udfff": 1}',
]


@pytest.mark.parametrize("arguments", CALL_ARGUMENTS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/apply-template"])
def test_hostile_tool_call_arguments_are_refused_by_name(
    client: httpx.Client, path: str, arguments: str
) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "ok"})
    response = client.post(path, json={"model": "bubo", "messages": history, "max_tokens": 2})
    error = assert_refused(response, "chat", "messages[1].tool_calls[0].function.arguments")
    assert error["code"] == "invalid_value"


@pytest.mark.parametrize("arguments", CALL_ARGUMENTS)
def test_hostile_function_call_item_arguments_are_refused_by_name(
    client: httpx.Client, arguments: str
) -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": arguments}
    items = [{"role": "user", "content": "hi"}, call]
    response = client.post("/v1/responses", json={"model": "bubo", "input": items, "max_output_tokens": 2})
    assert assert_refused(response, "responses", "input[1].arguments")["code"] == "invalid_value"


@pytest.mark.parametrize("dialect", ["completions", "completion"])
def test_a_logit_bias_that_bans_every_token_is_refused(
    client: httpx.Client, server: LiveServer, dialect: str
) -> None:
    path, body, _ = DIALECTS[dialect]
    size = server.state.require_ready().tokenizer.vocab_size
    bias: Any = {str(i): False for i in range(size)}
    if dialect == "completion":
        bias = [[i, False] for i in range(size)]
    error = assert_refused(client.post(path, json={**body, "logit_bias": bias}), dialect, "logit_bias")
    assert error["code"] == "invalid_value"
    # One token left is enough.
    del bias["0" if dialect == "completions" else 0]
    assert client.post(path, json={**body, "logit_bias": bias}).status_code == 200
