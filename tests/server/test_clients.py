"""What real clients and evaluation harnesses need from the server (issue 33): the SDKs' models.retrieve,
structured output as vLLM and llama-server do it, forced tool calls that end the turn, prompt log
probabilities, the tokenizer routes, the request log and the key's 401 wording."""

import json
import logging
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
import torch

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from bubo.server.request_log import JsonFormatter
from tests.server.live_server import LiveServer, scripted, serve_loaded
from tests.server.openapi_doc import response_schema, validator

# GET /v1/models/{id}


def test_the_sdk_retrieves_each_served_model(tiny_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    for model_id in ("tiny-llama-01b", "bubo"):
        model = client.models.retrieve(model_id)
        assert (model.id, model.object, model.owned_by) == (model_id, "model", "bubo")
        assert model.model_extra is not None and model.model_extra["context_length"] == 512
    assert httpx.get(tiny_server.url + "/models/bubo").json()["id"] == "bubo"


def test_an_unknown_model_id_is_404_model_not_found(tiny_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4o")
    assert error.value.code == "model_not_found"
    body = httpx.get(tiny_server.url + "/models/gpt-4o").json()
    assert body["error"]["type"] == "invalid_request_error"
    assert "tiny-llama-01b" in body["error"]["message"]


@pytest.fixture(scope="module")
def slashed_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(tiny_llama, served_model_name="org/tiny")
    yield live
    live.stop()


def test_a_served_name_with_a_slash_is_retrieved(slashed_server: LiveServer) -> None:
    body = httpx.get(slashed_server.url + "/v1/models/org/tiny").json()
    assert body["id"] == "org/tiny"


# Structured output

EXTRA_KEYS = '{"a": true, "extra": 2}'


@pytest.fixture(scope="module")
def json_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    """A server whose model writes EXTRA_KEYS: JSON with a key that schemas here do not list."""
    live = serve_loaded(
        scripted(tiny_llama, EXTRA_KEYS), defaults=SamplingParams(temperature=0.0, max_tokens=40)
    )
    yield live
    live.stop()


def _chat_json(server: LiveServer, response_format: dict) -> httpx.Response:
    body = {
        "model": "bubo",
        "messages": [{"role": "user", "content": "JSON"}],
        "response_format": response_format,
    }
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def _json_schema(schema: dict, **extra: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **extra}}


A_ONLY = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}


def test_a_schema_that_says_nothing_of_other_keys_forbids_them(json_server: LiveServer) -> None:
    answer = _chat_json(json_server, _json_schema(A_ONLY)).json()["choices"][0]
    assert (answer["message"]["content"], answer["finish_reason"]) == ('{"a": true}', "stop")
    allowed = _chat_json(json_server, _json_schema({**A_ONLY, "additionalProperties": True})).json()
    assert allowed["choices"][0]["message"]["content"] == EXTRA_KEYS


def test_strict_requires_every_property(json_server: LiveServer) -> None:
    # The grammar keeps the schema's order of properties: "b" can only come before "a".
    schema = {"type": "object", "properties": {"b": {"enum": ["x"]}, "a": {"type": "boolean"}}}
    loose = _chat_json(json_server, _json_schema(schema, strict=False)).json()
    assert loose["choices"][0]["message"]["content"] == '{"a": true}'
    strict = _chat_json(json_server, _json_schema(schema, strict=True)).json()
    assert list(json.loads(strict["choices"][0]["message"]["content"])) == ["b", "a"]
    wrong = _chat_json(json_server, _json_schema(schema, strict="yes"))
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "response_format.json_schema.strict"


def test_llama_servers_json_object_with_a_schema_is_honoured(json_server: LiveServer) -> None:
    fmt = {
        "type": "json_object",
        "schema": {"type": "object", "properties": {"b": {"const": "x"}}, "required": ["b"]},
    }
    chat = _chat_json(json_server, fmt).json()
    assert chat["choices"][0]["message"]["content"] == '{"b": "x"}'
    completion = httpx.post(
        json_server.url + "/completion", json={"prompt": "JSON", "response_format": fmt}, timeout=30
    ).json()
    assert completion["content"] == '{"b": "x"}'
    free = _chat_json(json_server, {"type": "json_object"}).json()
    assert free["choices"][0]["message"]["content"] == EXTRA_KEYS


# Forced tool calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def calling_server(long_llama: LoadedModel) -> Iterator[LiveServer]:
    """A server whose model calls get_weather three times over, as small models do when let."""
    live = serve_loaded(
        scripted(long_llama, "\n".join([CALL] * 3)), defaults=SamplingParams(temperature=0.0, max_tokens=400)
    )
    yield live
    live.stop()


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "calls"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, True, 1),
        ({"type": "function", "function": {"name": "get_weather"}}, False, 1),
        ("required", True, 3),
        ("required", False, 1),
    ],
)
def test_a_named_tool_choice_forces_one_call_and_required_as_many_as_parallel_allows(
    calling_server: LiveServer, tool_choice: object, parallel: bool, calls: int
) -> None:
    client = openai.OpenAI(base_url=calling_server.url + "/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    request = dict(
        model="bubo", messages=ask, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=parallel
    )
    choice = client.chat.completions.create(**request).choices[0]  # type: ignore[call-overload]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"] * calls
    chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
    indexes = {t.index for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []}
    assert indexes == set(range(calls))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_named_function_in_responses_is_called_once(calling_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=calling_server.url + "/v1", api_key="none", max_retries=0)
    response = client.responses.create(
        model="bubo",
        input="Weather in Paris?",
        tools=[{"type": "function", **WEATHER["function"]}],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert [item.type for item in response.output] == ["function_call"]
    assert response.status == "completed"


@pytest.mark.parametrize(("single", "calls"), [(True, 1), (False, 3)])
def test_anthropics_named_tool_is_called_once_when_parallel_use_is_disabled(
    calling_server: LiveServer, single: bool, calls: int
) -> None:
    """Anthropic's own rule: `tool` forces that tool, and only disable_parallel_tool_use makes it one call."""
    client = anthropic.Anthropic(base_url=calling_server.url, api_key="none", max_retries=0)
    message = client.messages.create(
        model="bubo",
        max_tokens=400,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": single},
    )
    assert [block.type for block in message.content] == ["tool_use"] * calls
    assert message.stop_reason == "tool_use"


# What evaluation harnesses need


def _reference_logprobs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log P(ids[i] | ids[:i]) for i >= 1, from one forward pass over the whole prompt."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids]), loaded.model.new_cache(max_len=len(ids)))
    logprobs = logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(
    tiny_server: LiveServer, tiny_llama: LoadedModel, max_tokens: int
) -> None:
    prompt = "The capital of France is Paris"
    ids = tiny_llama.tokenizer.encode(prompt)
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    choice = client.completions.create(
        model="bubo", prompt=prompt, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
    ).choices[0]
    assert choice.logprobs is not None and choice.text.startswith(prompt)
    scored = choice.logprobs.token_logprobs or []
    assert len(scored) == len(ids) + max_tokens
    assert scored[0] is None and (choice.logprobs.top_logprobs or [])[0] is None
    expected = _reference_logprobs(tiny_llama, ids)
    assert torch.allclose(torch.tensor(scored[1 : len(ids)]), expected, atol=1e-4)
    assert "".join(choice.logprobs.tokens or []) == choice.text
    # Two alternatives each (fewer where two byte tokens read as the same replacement character).
    assert all(1 <= len(top) <= 2 for top in (choice.logprobs.top_logprobs or [])[1:])
    assert choice.finish_reason == "length"


def test_max_tokens_0_needs_echo(tiny_server: LiveServer) -> None:
    body = {"model": "bubo", "prompt": "Hi", "max_tokens": 0}
    assert httpx.post(tiny_server.url + "/v1/completions", json=body).status_code == 400
    streamed = {**body, "echo": True, "logprobs": 1, "stream": True}
    response = httpx.post(tiny_server.url + "/v1/completions", json=streamed)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"


def _sse_payloads(text: str) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_n_probs_lists_each_tokens_log_probability(tiny_server: LiveServer) -> None:
    body = {"prompt": "Hello", "n_predict": 4, "n_probs": 2, "temperature": 0}
    answer = httpx.post(tiny_server.url + "/completion", json=body).json()
    probabilities = answer["completion_probabilities"]
    assert not list(validator(response_schema("/completion", "POST", 200)).iter_errors(answer))
    assert len(probabilities) == answer["tokens_predicted"] == 4
    for entry in probabilities:
        assert set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        # Greedy: the token chosen is the most likely one.
        assert entry["top_logprobs"][0]["id"] == entry["id"]
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
    assert "".join(entry["token"] for entry in probabilities) == answer["content"]
    chunks = _sse_payloads(httpx.post(tiny_server.url + "/completion", json={**body, "stream": True}).text)
    streamed = [entry for chunk in chunks for entry in chunk.get("completion_probabilities", [])]
    # The same tokens (the second run reads the prompt from the cache: logprobs equal to float noise).
    assert [e["id"] for e in streamed] == [e["id"] for e in probabilities]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in probabilities], abs=1e-4)
    refused = httpx.post(tiny_server.url + "/completion", json={**body, "post_sampling_probs": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "post_sampling_probs"


def test_responses_top_logprobs_are_answered(tiny_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    request = dict(model="bubo", input="Hello", max_output_tokens=4, temperature=0, top_logprobs=2)
    response = client.responses.create(**request)  # type: ignore[call-overload]
    [message] = response.output
    part = message.content[0]  # type: ignore[union-attr]
    assert len(part.logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text
    events = list(client.responses.create(**request, stream=True))  # type: ignore[call-overload]
    deltas = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert deltas == [lp.token for lp in part.logprobs]
    included = client.responses.create(
        model="bubo", input="Hello", max_output_tokens=4, include=["message.output_text.logprobs"]
    )
    assert len(included.output[0].content[0].logprobs) == 4  # type: ignore[union-attr]


def test_tokenize_in_llama_servers_shape(tiny_server: LiveServer, tiny_llama: LoadedModel) -> None:
    tokenizer = tiny_llama.tokenizer
    text = "Hello world<|im_end|>"
    plain = httpx.post(tiny_server.url + "/tokenize", json={"content": text}).json()
    assert plain == {"tokens": tokenizer.encode(text, add_bos=False)}
    special = httpx.post(tiny_server.url + "/tokenize", json={"content": text, "add_special": True}).json()
    assert special["tokens"] == tokenizer.encode(text)
    literal = httpx.post(tiny_server.url + "/tokenize", json={"content": text, "parse_special": False}).json()
    assert tokenizer.token_to_id("<|im_end|>") not in literal["tokens"]
    pieces = httpx.post(tiny_server.url + "/tokenize", json={"content": "é!", "with_pieces": True}).json()
    # The byte-level fixture vocabulary splits "é" into two bytes that are not UTF-8 alone.
    assert [p["id"] for p in pieces["tokens"]] == tokenizer.encode("é!", add_bos=False)
    assert (
        b"".join(
            bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
            for p in pieces["tokens"]
        )
        == "é!".encode()
    )
    missing = httpx.post(tiny_server.url + "/tokenize", json={"content": 5})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "content"
    neither = httpx.post(tiny_server.url + "/tokenize", json={"content": None})
    assert neither.status_code == 400 and "content" in neither.json()["error"]["message"]


def test_tokenize_in_vllms_shape(tiny_server: LiveServer, tiny_llama: LoadedModel) -> None:
    tokenizer = tiny_llama.tokenizer
    answer = httpx.post(
        tiny_server.url + "/tokenize", json={"model": "bubo", "prompt": "Hi there", "return_token_strs": True}
    ).json()
    ids = tokenizer.encode("Hi there")
    assert answer == {
        "count": len(ids),
        "max_model_len": 512,
        "tokens": ids,
        "token_strs": [tokenizer.token_bytes(i).decode() for i in ids],
    }
    bare = httpx.post(
        tiny_server.url + "/tokenize", json={"prompt": "Hi there", "add_special_tokens": False}
    ).json()
    assert bare["tokens"] == tokenizer.encode("Hi there", add_bos=False)
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    rendered = httpx.post(tiny_server.url + "/apply-template", json=chat).json()["prompt"]
    counted = httpx.post(tiny_server.url + "/tokenize", json=chat).json()
    assert counted["tokens"] == tokenizer.encode(rendered, add_bos=False)
    wrong = httpx.post(tiny_server.url + "/tokenize", json={"model": "nope", "prompt": "x"})
    assert wrong.status_code == 404


def test_detokenize_answers_in_both_shapes(tiny_server: LiveServer, tiny_llama: LoadedModel) -> None:
    ids = tiny_llama.tokenizer.encode("Hello world", add_bos=False)
    answer = httpx.post(tiny_server.url + "/detokenize", json={"tokens": ids}).json()
    assert answer == {"content": "Hello world", "prompt": "Hello world"}
    for bad in ([-1], [10**9], ["a"], [True]):
        response = httpx.post(tiny_server.url + "/detokenize", json={"tokens": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"


def test_tokenizer_info_is_what_a_remote_tokenizer_reads(
    tiny_server: LiveServer, tiny_llama: LoadedModel
) -> None:
    info = httpx.get(tiny_server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 512
    assert "im_start" in info["chat_template"]
    # lm-eval's remote tokenizer finds the end token's id by tokenizing its text.
    eos = httpx.post(
        tiny_server.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
    ).json()
    assert eos["tokens"] == [tiny_llama.tokenizer.eos_id]


# Operability


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(tiny_llama, api_key="sesame")
    yield live
    live.stop()


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_the_401_names_both_key_headers(keyed_server: LiveServer, path: str) -> None:
    response = httpx.post(keyed_server.url + path, json={})
    assert response.status_code == 401
    error = response.json()["error"]
    assert "x-api-key" in error["message"] and "Authorization: Bearer" in error["message"]
    anthropic_client = anthropic.Anthropic(base_url=keyed_server.url, api_key="sesame", max_retries=0)
    assert (
        anthropic_client.messages.count_tokens(
            model="bubo", messages=[{"role": "user", "content": "hi"}]
        ).input_tokens
        > 0
    )


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [record.http for record in caplog.records if record.name == "bubo.requests"]  # type: ignore[attr-defined]


def test_every_request_gets_one_log_line(tiny_server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bubo.requests")
    chat = {"model": "bubo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    answer = httpx.post(tiny_server.url + "/v1/chat/completions", json=chat)
    streamed = httpx.post(tiny_server.url + "/v1/chat/completions", json={**chat, "stream": True})
    missing = httpx.get(tiny_server.url + "/nowhere", headers={"x-request-id": "mine-1"})
    [first, second, third] = _request_lines(caplog)
    usage = answer.json()["usage"]
    assert first == {
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 200,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "ms": first["ms"],
        "request_id": answer.headers["x-request-id"],
    }
    assert first["ms"] > 0
    # A stream is logged once it has ended, with its tokens.
    assert (second["status"], second["completion_tokens"]) == (200, 3)
    assert second["request_id"] == streamed.headers["x-request-id"]
    assert (third["status"], third["prompt_tokens"], third["request_id"]) == (404, None, "mine-1")
    assert missing.status_code == 404
    text = next(r.getMessage() for r in caplog.records if r.name == "bubo.requests")
    assert (
        text.startswith("POST /v1/chat/completions 200 prompt_tokens=")
        and f"id={first['request_id']}" in text
    )


def test_json_log_lines_carry_the_requests_fields() -> None:
    record = logging.LogRecord("bubo.requests", logging.INFO, __file__, 1, "GET %s", ("/health",), None)
    record.http = {"method": "GET", "path": "/health", "status": 200}
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "GET /health" and line["level"] == "INFO" and line["logger"] == "bubo.requests"
    assert (line["method"], line["path"], line["status"]) == ("GET", "/health", 200)
    assert line["time"].endswith("Z")


@pytest.mark.parametrize(("strict", "keys"), [(False, ["city"]), (True, ["city", "unit"])])
def test_a_strict_chat_tool_requires_every_property(
    calling_server: LiveServer, strict: bool, keys: list[str]
) -> None:
    """openai-agents sends its chat tools with strict: true; the forced call then fills every property."""
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c"]}},
        "required": ["city"],
    }
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": parameters, "strict": strict},
    }
    client = openai.OpenAI(base_url=calling_server.url + "/v1", api_key="none", max_retries=0)
    choice = client.chat.completions.create(
        model="bubo",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]
    [call] = choice.message.tool_calls or []
    assert list(json.loads(call.function.arguments)) == keys  # type: ignore[union-attr]
