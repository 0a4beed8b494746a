"""The OpenAI dialect as clients see it: the official SDK and raw HTTP against a live server."""

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from tests.server.live_server import LiveServer, scripted, serve_loaded


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing: every event is one `data:` line
    followed by a blank line."""
    body = response.text
    assert body.endswith("\n\n")
    payloads = []
    for block in body[:-2].split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        payloads.append(lines[0].removeprefix("data: "))
    return payloads


@pytest.fixture(scope="module")
def client(tiny_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hello_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    """A server whose model always answers "Hello there, world!" and then <|im_end|>."""
    server = serve_loaded(
        scripted(tiny_llama, "Hello there, world!"), defaults=SamplingParams(temperature=0.0)
    )
    yield server
    server.stop()


def test_sdk_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="bubo", messages=[{"role": "user", "content": "Say hi."}], max_tokens=5
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == "bubo"
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert reply.usage.completion_tokens == 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 5
    extra = reply.model_extra
    assert extra["timings"]["predicted_n"] == 5 and extra["timings"]["prompt_n"] >= 1


def test_the_served_id_and_bubo_both_work(client: openai.OpenAI, tiny_server: LiveServer) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-llama-01b", "bubo"]
    reply = client.chat.completions.create(
        model="tiny-llama-01b", messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    assert reply.model == "tiny-llama-01b"


def test_sdk_stream_with_usage(hello_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=hello_server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="bubo",
            messages=[{"role": "user", "content": "greet"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there, world!"
    last_with_choices = [c for c in chunks if c.choices][-1]
    assert last_with_choices.choices[0].finish_reason == "stop"
    assert last_with_choices.model_extra["timings"]["predicted_n"] == chunks[-1].usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_raw_stream_framing_and_done(hello_server: LiveServer) -> None:
    response = httpx.post(
        hello_server.url + "/v1/chat/completions",
        json={"model": "bubo", "messages": [{"role": "user", "content": "greet"}], "stream": True},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_events(response)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    final = chunks[-1]
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "stop"
    assert "timings" in final and "usage" not in final  # no include_usage: no usage chunk


def test_stop_string_ends_with_stop_and_is_not_returned(hello_server: LiveServer) -> None:
    response = httpx.post(
        hello_server.url + "/v1/chat/completions",
        json={"model": "bubo", "messages": [{"role": "user", "content": "greet"}], "stop": [", wor"]},
    ).json()
    assert response["choices"][0]["message"]["content"] == "Hello there"
    assert response["choices"][0]["finish_reason"] == "stop"


def test_text_completion(hello_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=hello_server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model="bubo", prompt="The capital of France is", max_tokens=3)
    assert reply.object == "text_completion"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    pieces = list(client.completions.create(model="bubo", prompt="Once upon", stream=True))
    assert "".join(p.choices[0].text for p in pieces) == "Hello there, world!"
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_echo_prepends_the_prompt(hello_server: LiveServer, tiny_llama: LoadedModel) -> None:
    body = {"model": "bubo", "prompt": "Once upon", "max_tokens": 2, "echo": True}
    reply = httpx.post(hello_server.url + "/v1/completions", json=body).json()
    first_two = tiny_llama.tokenizer.decode(tiny_llama.tokenizer.encode("Hello there, world!")[:2])
    assert reply["choices"][0]["text"] == "Once upon" + first_two


def test_the_prompt_cache_reports_a_shared_prefix(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, defaults=SamplingParams(temperature=0.0, max_tokens=2))
    try:
        history = [{"role": "user", "content": "first question about caching"}]
        first = httpx.post(
            server.url + "/v1/chat/completions", json={"model": "bubo", "messages": history}
        ).json()
        assert first["usage"]["gufo"]["options"]["cache_hit"] is False
        assert first["usage"]["gufo"]["options"]["cache_miss_reason"] == "empty"
        history += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "second"},
        ]
        second = httpx.post(
            server.url + "/v1/chat/completions", json={"model": "bubo", "messages": history}
        ).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > first["usage"]["prompt_tokens"] // 2
        options = second["usage"]["gufo"]["options"]
        # The history now holds the answer as text; re-tokenized, it may differ from the sampled
        # tokens, which the report calls a rewritten history (never before the first prompt's end).
        diverged = options["cache_diverged_at"]
        assert diverged is None or diverged >= first["usage"]["prompt_tokens"]
        assert options == {
            "cache_hit": True,
            "cached_tokens": cached,
            "cache_miss_reason": None,
            "cache_snapshots": 0,
            "cache_snapshots_skipped": 0,
            "cache_diverged_at": diverged,
            "cache_history_rewritten": diverged is not None,
        }
        assert second["timings"]["cache_n"] == cached
        assert second["timings"]["prompt_n"] == second["usage"]["prompt_tokens"] - cached
    finally:
        server.stop()


def test_cached_and_uncached_runs_give_the_same_text(tiny_llama: LoadedModel) -> None:
    """Reusing the cache must not change the output: greedy text with a warm cache equals a cold one."""
    body = {
        "model": "bubo",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    cold = serve_loaded(tiny_llama)
    try:
        first = httpx.post(cold.url + "/v1/chat/completions", json=body).json()
        again = httpx.post(cold.url + "/v1/chat/completions", json=body).json()
    finally:
        cold.stop()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "missing_model"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
        ({"model": "bubo"}, 400, "missing_messages"),
        ({"model": "bubo", "messages": []}, 400, "missing_messages"),
        ({"model": "bubo", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "unsupported_n"),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            400,
            "invalid_value",
        ),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5},
            400,
            "invalid_value",
        ),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "9"},
            400,
            "invalid_value",
        ),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "invalid_value",
        ),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5},
            400,
            "invalid_value",
        ),
        ({"model": "bubo", "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value"),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "huge"},
            400,
            "invalid_value",
        ),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}},
            400,
            "invalid_value",
        ),
        (
            {
                "model": "bubo",
                "messages": [{"role": "user", "content": "x"}],
                "reasoning_effort": "off",
                "chat_template_kwargs": {"enable_thinking": True},
            },
            400,
            "conflicting_fields",
        ),
        *(
            (
                {
                    "model": "bubo",
                    "messages": [{"role": "user", "content": "x"}],
                    "chat_template_kwargs": {name: []},
                },
                400,
                "invalid_value",
            )
            for name in ("messages", "tools", "documents")
        ),
        (
            {
                "model": "bubo",
                "messages": [{"role": "user", "content": "x"}],
                "reasoning_effort": "high",
                "thinking": {"type": "disabled"},
            },
            400,
            "conflicting_fields",
        ),
        (
            {
                "model": "bubo",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
                        ],
                    }
                ],
            },
            400,
            "unsupported_content",
        ),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}},
            400,
            "invalid_value",
        ),
        (
            {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "stop": [""]},
            400,
            "invalid_value",
        ),
    ],
)
def test_field_rules(tiny_server: LiveServer, body: dict, status: int, code: str) -> None:
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize(
    ("tool", "tool_choice", "code", "param"),
    [
        ({"type": "function"}, "auto", "invalid_value", "tools[0].function"),
        ({"name": "f"}, "auto", "invalid_value", "tools[0].type"),
        ({"type": "custom", "custom": {"name": "f"}}, "auto", "unsupported_tool", "tools[0].type"),
        ({"type": "function", "function": {"name": 5}}, "auto", "invalid_value", "tools[0].function.name"),
        (
            {"type": "function", "function": {"name": "f", "description": ["x"]}},
            "auto",
            "invalid_value",
            "tools[0].function.description",
        ),
        (
            {"type": "function", "function": {"name": "f", "parameters": "x"}},
            "required",
            "invalid_value",
            "tools[0].function.parameters",
        ),
    ],
)
def test_malformed_tools_are_400_naming_the_field(
    tiny_server: LiveServer, tool: dict, tool_choice: str, code: str, param: str
) -> None:
    """The tools must be OpenAI function tools; the template, parser and forcing grammar index into them."""
    body = {
        "model": "bubo",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [tool],
        "tool_choice": tool_choice,
        "max_tokens": 1,
    }
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)


@pytest.mark.parametrize("limit", [-1, None])
def test_minus_one_and_null_keep_the_default_limit(tiny_server: LiveServer, limit: int | None) -> None:
    body = {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "max_tokens": limit}
    reply = httpx.post(tiny_server.url + "/v1/chat/completions", json=body).json()
    assert reply["usage"]["completion_tokens"] == 16  # the tiny server's default n_predict


def test_sdk_raises_the_documented_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as found:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert found.value.code == "model_not_found"
    assert "tiny-llama-01b" in found.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="bubo", messages=[{"role": "user", "content": "x"}], n=3)
    assert bad.value.code == "unsupported_n"


def test_text_parts_are_joined(hello_server: LiveServer) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    body = {"model": "bubo", "messages": [{"role": "user", "content": parts}]}
    reply = httpx.post(hello_server.url + "/apply-template", json=body)
    assert reply.json()["prompt"] == "<|im_start|>user\none\ntwo<|im_end|>\n<|im_start|>assistant\n"
    completion = httpx.post(hello_server.url + "/v1/chat/completions", json=body).json()
    assert completion["choices"][0]["message"]["content"] == "Hello there, world!"


def test_logprobs_are_the_models_log_softmax(tiny_server: LiveServer, tiny_llama: LoadedModel) -> None:
    body = {
        "model": "bubo",
        "messages": [{"role": "user", "content": "numbers"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 3,
        "temperature": 0,
    }
    reply = httpx.post(tiny_server.url + "/v1/chat/completions", json=body).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        # Greedy: the chosen token is the most likely one.
        assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]

    from bubo.engine.chat_request import ChatRequest

    prompt = tiny_server.state.render_prompt(ChatRequest(body["messages"]))
    model = tiny_llama.model
    with torch.inference_mode():
        logits = model(torch.tensor([prompt.ids]), model.new_cache(max_len=64), last_only=True)[0, -1]
    expected = logits.float().log_softmax(-1)
    assert content[0]["logprob"] == pytest.approx(float(expected.max()), abs=1e-5)
    assert bytes(content[0]["bytes"]) == tiny_llama.tokenizer.token_bytes(int(expected.argmax()))


def test_streamed_logprobs_cover_every_content_token(hello_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=hello_server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="bubo", messages=[{"role": "user", "content": "greet"}], stream=True, logprobs=True
        )
    )
    tokens = [
        t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert "".join(tokens) == "Hello there, world!"


def test_completion_logprobs_have_offsets(hello_server: LiveServer) -> None:
    body = {"model": "bubo", "prompt": "Say", "max_tokens": 3, "logprobs": 2, "echo": True}
    reply = httpx.post(hello_server.url + "/v1/completions", json=body).json()
    logprobs = reply["choices"][0]["logprobs"]
    text = reply["choices"][0]["text"]
    # With echo the prompt's tokens come first ("S", "a", "y"), the first without a log probability.
    assert len(logprobs["tokens"]) == 6 and all(len(t) == 2 for t in logprobs["top_logprobs"][1:])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert text[offset : offset + len(token)] == token
    assert logprobs["text_offset"][3] == len("Say")


def test_top_logprobs_without_logprobs_is_refused(tiny_server: LiveServer) -> None:
    body = {"model": "bubo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


def test_the_default_model_answers_through_the_sdk(smollm2_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="bubo",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 20  # SmolLM2's template adds its default system prompt
    assert reply.model_extra["timings"]["predicted_n"] == reply.usage.completion_tokens
