"""What a llama-server user relies on, as llama.cpp's own server tests see it (issue 39): routes without
/v1, constraints on chat, llama-server's error details, /completion's fields, string logit_bias keys,
the first chat chunk, /metrics and chat request checks, against live servers."""

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from tests.server.live_server import LiveServer, scripted, serve_loaded

TEXT = "Hello there, world!"


@pytest.fixture(scope="module")
def server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    """The tiny model (random weights), greedy, 8 tokens by default."""
    live = serve_loaded(tiny_llama, defaults=SamplingParams(temperature=0.0, max_tokens=8))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def hello(tiny_llama: LoadedModel) -> Iterator[httpx.Client]:
    """A server whose model always writes TEXT and then <|im_end|>."""
    live = serve_loaded(scripted(tiny_llama, TEXT), defaults=SamplingParams(temperature=0.0))
    with httpx.Client(base_url=live.url, timeout=60) as http:
        yield http
    live.stop()


def events(response: httpx.Response) -> list[Any]:
    """The JSON payloads of an SSE body ([DONE] left out)."""
    assert response.status_code == 200, response.text
    payloads = [
        line.removeprefix("data: ") for line in response.text.split("\n") if line.startswith("data: ")
    ]
    return [json.loads(p) for p in payloads if p != "[DONE]"]


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


CHAT = {"model": "bubo", "messages": [{"role": "user", "content": "greet"}]}


# 1. Routes without /v1


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        ("/chat/completions", CHAT, "chat.completion"),
        ("/completions", {"model": "bubo", "prompt": "Once upon"}, "text_completion"),
        ("/responses", {"model": "bubo", "input": "greet"}, "response"),
    ],
)
def test_the_openai_routes_answer_without_v1(
    hello: httpx.Client, path: str, body: dict[str, Any], kind: str
) -> None:
    bare = hello.post(path, json=body)
    twin = hello.post("/v1" + path, json=body)
    assert bare.status_code == twin.status_code == 200, bare.text
    assert bare.json()["object"] == twin.json()["object"] == kind
    text = {
        "chat.completion": lambda b: b["choices"][0]["message"]["content"],
        "text_completion": lambda b: b["choices"][0]["text"],
        "response": lambda b: b["output"][-1]["content"][0]["text"],
    }[kind]
    assert text(bare.json()) == text(twin.json()) == TEXT


@pytest.mark.parametrize("path", ["/embeddings", "/reranking"])
def test_the_unserved_routes_without_v1_answer_as_their_twins(hello: httpx.Client, path: str) -> None:
    body = {"model": "bubo", "input": "hi", "query": "q", "documents": ["d"]}
    assert error_of(hello.post(path, json=body), 501, "not_implemented")
    assert error_of(hello.post("/v1" + path, json=body), 501, "not_implemented")


# 3. Context overflow


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_context_overflow_carries_llama_servers_numbers(
    client: httpx.Client, server: LiveServer, path: str
) -> None:
    prompt = "a b c d " * 200
    n_prompt = len(server.state.tokenize(prompt))
    assert n_prompt >= server.state.n_ctx
    error = error_of(
        client.post(path, json={"model": "bubo", "prompt": prompt}), 400, "context_length_exceeded"
    )
    assert error["type"] == "invalid_request_error"
    assert error["n_prompt_tokens"] == n_prompt
    assert error["n_ctx"] == server.state.n_ctx == 512


# 6. The first chat stream chunk


def test_the_first_chat_chunk_has_the_role_and_null_content(hello: httpx.Client) -> None:
    chunks = events(hello.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == TEXT


# 8. Chat request checks


def test_continue_final_message_with_add_generation_prompt_is_refused(hello: httpx.Client) -> None:
    messages = [{"role": "user", "content": "greet"}, {"role": "assistant", "content": "Hel"}]
    body = {"model": "bubo", "messages": messages, "continue_final_message": True}
    error = error_of(
        hello.post("/v1/chat/completions", json={**body, "add_generation_prompt": True}),
        400,
        "conflicting_fields",
    )
    assert error["param"] == "continue_final_message"
    kwargs = {"chat_template_kwargs": {"add_generation_prompt": True}}
    error_of(hello.post("/v1/chat/completions", json={**body, **kwargs}), 400, "conflicting_fields")
    # Either alone is fine, and so is asking to continue without opening a turn.
    assert hello.post("/v1/chat/completions", json=body).status_code == 200
    both = {**body, "add_generation_prompt": False}
    assert hello.post("/v1/chat/completions", json=both).status_code == 200
    ends_with_user = {**body, "messages": messages[:1]}
    error_of(hello.post("/v1/chat/completions", json=ends_with_user), 400, "invalid_value")


def test_two_trailing_assistant_messages_are_refused(hello: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "greet"},
        {"role": "assistant", "content": "Hello."},
        {"role": "assistant", "content": "Hel"},
    ]
    error = error_of(
        hello.post("/v1/chat/completions", json={"model": "bubo", "messages": messages}), 400, "invalid_value"
    )
    assert error["param"] == "messages[2]"
    assert hello.post("/apply-template", json={"messages": messages}).status_code == 400
    # Two assistant turns with a user turn after them are an ordinary history.
    history = [*messages, {"role": "user", "content": "again"}]
    assert hello.post("/v1/chat/completions", json={"model": "bubo", "messages": history}).status_code == 200


# 2. Constraints on chat

GRAMMAR = 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?'
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def test_chat_follows_a_top_level_grammar(client: httpx.Client) -> None:
    """The tiny model writes noise; only the grammar decides what comes out."""
    for seed in range(2):
        body = {**CHAT, "grammar": GRAMMAR, "max_tokens": 20, "temperature": 1.0, "seed": seed}
        reply = client.post("/v1/chat/completions", json=body).json()
        answer, number = reply["choices"][0]["message"]["content"].split(" ")
        assert answer in ("yes", "no") and 1 <= int(number) <= 99
        assert reply["choices"][0]["finish_reason"] == "stop"


def test_chat_and_completions_follow_a_top_level_json_schema(client: httpx.Client) -> None:
    body = {**CHAT, "json_schema": SCHEMA, "max_tokens": 30, "temperature": 1.0, "seed": 1}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert isinstance(json.loads(reply["choices"][0]["message"]["content"])["ok"], bool)
    text = {"model": "bubo", "prompt": "x", "json_schema": SCHEMA, "max_tokens": 30, "temperature": 1.0}
    reply = client.post("/v1/completions", json=text).json()
    assert isinstance(json.loads(reply["choices"][0]["text"])["ok"], bool)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/chat/completions", CHAT),
        ("/v1/completions", {"model": "bubo", "prompt": "x"}),
        ("/completion", {"prompt": "x"}),
        ("/v1/responses", {"model": "bubo", "input": "x"}),
        ("/v1/messages", {"model": "bubo", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
    ],
)
def test_an_invalid_grammar_is_refused_on_every_route(client: httpx.Client, path: str, body: dict) -> None:
    response = client.post(path, json={**body, "grammar": "root ::= ("})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_grammar"


def test_two_constraints_on_chat_are_refused(client: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    body = {**CHAT, "grammar": GRAMMAR, "response_format": fmt}
    assert error_of(client.post("/v1/chat/completions", json=body), 400, "conflicting_fields")["param"] == (
        "response_format"
    )
    body = {**CHAT, "json_schema": SCHEMA, "grammar": GRAMMAR}
    assert error_of(client.post("/v1/chat/completions", json=body), 400, "conflicting_fields")["param"] == (
        "grammar"
    )


# 5. logit_bias keys that are text


def test_a_logit_bias_key_of_text_biases_each_of_its_tokens(
    client: httpx.Client, tiny_llama: LoadedModel
) -> None:
    ids = tiny_llama.tokenizer.encode(" Paris!", add_bos=False, add_eos=False, parse_special=False)
    assert len(ids) > 1

    def content(path: str, bias: Any) -> str:
        body = {"model": "bubo", "prompt": "Once upon", "max_tokens": 6, "logit_bias": bias}
        reply = client.post(path, json=body).json()
        return reply["content"] if path == "/completion" else reply["choices"][0]["text"]

    for path in ("/completion", "/v1/completions"):
        by_ids = content(path, {str(i): 30 for i in ids})
        assert by_ids != content(path, None)
        assert content(path, {" Paris!": 30}) == by_ids
        assert content(path, [[" Paris!", 30]]) == by_ids
        assert set(by_ids) <= set(" Paris!")
    chat = client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {" Paris!": 30}}).json()
    assert set(chat["choices"][0]["message"]["content"]) <= set(" Paris!")
    # A ban of text bans each of its tokens (the later key wins, as in llama-server).
    pushed = content("/completion", {str(ids[0]): 30})
    assert pushed == tiny_llama.tokenizer.decode(ids[:1]) * 6
    banned = content("/completion", {str(ids[0]): 30, " Paris!": False})
    assert banned != pushed and not set(ids) & set(tiny_llama.tokenizer.encode(banned, add_bos=False))


# 4. /completion as llama-server returns it, and the stream extras


def script(tiny_llama: LoadedModel) -> list[int]:
    return tiny_llama.tokenizer.encode(TEXT, add_bos=False, parse_special=False)


def test_completion_returns_tokens_and_counts(hello: httpx.Client, tiny_llama: LoadedModel) -> None:
    plain = hello.post("/completion", json={"prompt": "Once upon"}).json()
    assert plain["tokens"] == [] and plain["has_new_line"] is False
    body = hello.post("/completion", json={"prompt": "Once upon", "return_tokens": True}).json()
    assert body["content"] == TEXT
    assert body["tokens"] == script(tiny_llama)
    # The end token counts as predicted (llama-server's way) but has no text, so it is not in tokens.
    assert body["tokens_predicted"] == len(script(tiny_llama)) + 1
    assert body["tokens_evaluated"] == body["usage"]["prompt_tokens"]


def test_has_new_line_says_whether_the_answer_has_one(client: httpx.Client) -> None:
    for text, expected in (("a\\nb", True), ("ab", False)):
        body = {"prompt": "x", "grammar": f'root ::= "{text}"', "n_predict": 8}
        reply = client.post("/completion", json=body).json()
        assert reply["content"] == text.replace("\\n", "\n") and reply["has_new_line"] is expected


def test_completion_stream_chunks_carry_tokens_and_counts(
    hello: httpx.Client, tiny_llama: LoadedModel
) -> None:
    chunks = events(hello.post("/completion", json={"prompt": "Once upon", "stream": True}))
    *pieces, last = chunks
    assert last["stop"] is True and last["has_new_line"] is False
    assert all(c["stop"] is False and c["tokens"] for c in pieces)
    assert [t for c in pieces for t in c["tokens"]] == script(tiny_llama)
    assert [c["tokens_predicted"] for c in pieces] == list(
        itertools.accumulate(len(c["tokens"]) for c in pieces)
    )
    assert {c["tokens_evaluated"] for c in pieces} == {last["tokens_evaluated"]}
    assert "".join(c["content"] for c in pieces) == TEXT
    # Without the extras, no chunk has progress or timings.
    assert not any("prompt_progress" in c or "timings" in c for c in pieces)


def test_response_fields_keep_only_those_fields(hello: httpx.Client) -> None:
    fields = ["content", "generation_settings/n_predict", "prompt", "no_such_field"]
    body = {"prompt": "Once upon", "n_predict": 5, "response_fields": fields}
    reply = hello.post("/completion", json=body).json()
    assert reply == {"content": reply["content"], "generation_settings/n_predict": 5, "prompt": "Once upon"}
    error_of(hello.post("/completion", json={**body, "response_fields": "content"}), 400, "invalid_value")


def test_a_prompt_object_is_its_prompt_string(hello: httpx.Client) -> None:
    given = hello.post("/completion", json={"prompt": {"prompt_string": "Once upon"}}).json()
    plain = hello.post("/completion", json={"prompt": "Once upon"}).json()
    assert (given["content"], given["tokens_evaluated"]) == (plain["content"], plain["tokens_evaluated"])
    with_image = {"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}
    error_of(hello.post("/completion", json=with_image), 400, "unsupported_content")
    error_of(hello.post("/completion", json={"prompt": {"text": "x"}}), 400, "invalid_value")


def streamed_text(path: str, chunks: list[dict[str, Any]]) -> str:
    """The answer text of a stream on `path`."""
    if path == "/v1/responses":
        return "".join(c["delta"] for c in chunks if c["type"] == "response.output_text.delta")
    if path == "/completion":
        return "".join(c["content"] for c in chunks)
    if path == "/v1/completions":
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def stream_body(path: str, text: str, **extra: Any) -> dict[str, Any]:
    """A streamed request for `text` on `path`, in its dialect."""
    if path in ("/completion", "/v1/completions"):
        return {"model": "bubo", "prompt": text, "stream": True, **extra}
    if path == "/v1/responses":
        return {"model": "bubo", "input": text, "stream": True, **extra}
    return {"model": "bubo", "messages": [{"role": "user", "content": text}], "stream": True, **extra}


def check_progress(reports: list[dict[str, Any]], cached: bool) -> None:
    """llama-server's prompt_progress sequence: the first before any work (processed == cache), then
    growing, the last when the whole prompt is in."""
    assert reports, "no prompt_progress"
    first, last = reports[0], reports[-1]
    # (A prompt new to the cache may still share its start, a BOS or a template's, with the one before.)
    assert first["processed"] == first["cache"] and (first["cache"] > first["total"] // 2) is cached
    assert last["processed"] == last["total"] > 0
    assert all(r["total"] == first["total"] and r["cache"] == first["cache"] for r in reports)
    assert all(a["processed"] < b["processed"] for a, b in itertools.pairwise(reports))
    assert all(r["time_ms"] >= 0 for r in reports)


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_return_progress_reports_the_prompt(hello: httpx.Client, path: str) -> None:
    body = stream_body(path, f"{path} progress " * 8, return_progress=True)
    for cached in (False, True):
        chunks = events(hello.post(path, json=body))
        if path == "/v1/responses":
            progress = [c for c in chunks if c["type"] == "response.in_progress" and "prompt_progress" in c]
        else:
            progress = [c for c in chunks if "prompt_progress" in c]
        check_progress([c["prompt_progress"] for c in progress], cached)
        assert streamed_text(path, chunks) == TEXT
        if path.startswith("/v1/") and path.endswith("completions"):
            assert all(c["choices"] == [] for c in progress)


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_timings_per_token_ride_on_every_piece(hello: httpx.Client, path: str) -> None:
    body = stream_body(path, "Once upon", timings_per_token=True)
    chunks = events(hello.post(path, json=body))
    if path == "/v1/responses":
        pieces = [c for c in chunks if c["type"] == "response.output_text.delta"]
    elif path == "/completion":
        pieces = [c for c in chunks if not c["stop"]]
    else:
        pieces = [c for c in chunks[1 if path.endswith("chat/completions") else 0 : -1] if c["choices"]]
        assert "timings" not in chunks[0] or not path.endswith("chat/completions")
    counts = [c["timings"]["predicted_n"] for c in pieces]
    assert counts and counts == sorted(counts) and counts[-1] <= len(TEXT)
    assert all(c["timings"]["prompt_n"] + c["timings"]["cache_n"] > 0 for c in pieces)
    assert all(c["timings"]["predicted_per_second"] >= 0 for c in pieces)


# 7. /metrics


def metrics(http: httpx.Client) -> tuple[dict[str, float], httpx.Headers]:
    """The samples of one scrape, once the slot has let go of its last request."""
    deadline = time.monotonic() + 5
    while True:
        response = http.get("/metrics")
        assert response.status_code == 200
        values = {
            line.split()[0]: float(line.split()[1])
            for line in response.text.splitlines()
            if line and not line.startswith("#")
        }
        if values["llamacpp:requests_processing"] == 0:
            return values, response.headers
        assert time.monotonic() < deadline, "the slot never became idle"
        time.sleep(0.01)


def test_metrics_count_cached_prompt_tokens_and_the_most_tokens_held(
    hello: httpx.Client, tiny_llama: LoadedModel
) -> None:
    before, headers = metrics(hello)
    started = int(headers["Process-Start-Time-Unix"])
    assert 0 < started <= time.time()
    body = {"prompt": "Metrics: a prompt seen twice, the second time from the cache.", "return_tokens": True}
    first = hello.post("/completion", json=body).json()
    second = hello.post("/completion", json=body).json()
    after, headers = metrics(hello)
    assert int(headers["Process-Start-Time-Unix"]) == started
    cached = first["tokens_cached"] + second["tokens_cached"]
    assert second["tokens_cached"] > 0
    assert (
        after["llamacpp:prompt_tokens_cached_total"] - before["llamacpp:prompt_tokens_cached_total"] == cached
    )
    # The cache held the prompt and the answer's tokens (all but the last, which was never fed back).
    held = second["tokens_evaluated"] + second["tokens_predicted"] - 1
    assert after["llamacpp:n_tokens_max"] >= held > 0
    assert after["llamacpp:draft_tokens_total"] == after["llamacpp:draft_verify_steps_total"] == 0
    assert after["llamacpp:draft_acceptance_rate"] == after["llamacpp:draft_mean_accept_len"] == 0


def test_predicted_per_second_leaves_out_the_first_token(hello: httpx.Client) -> None:
    """The first token's time is the prompt's (time to first token): the decode rate is of the rest."""
    timings = hello.post("/completion", json={"prompt": "Rates:"}).json()["timings"]
    decoded = timings["predicted_n"] - 1
    assert decoded > 0
    assert timings["predicted_per_second"] == pytest.approx(decoded / timings["predicted_ms"] * 1000)
    assert timings["predicted_per_token_ms"] == pytest.approx(timings["predicted_ms"] / decoded)
