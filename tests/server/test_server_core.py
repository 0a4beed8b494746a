"""What every route shares: errors in the documented shape, the API key, readiness, the memory guard,
a lost device, and the session slot (queueing, cancellation on disconnect)."""

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import openai
import pytest
import torch

from bubo.engine import output_grammar as state_module
from bubo.engine.grammar import GrammarMatcher
from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.sampler import SamplingParams
from bubo.server import fields
from bubo.server.memory_guard import MemoryInfo, kv_bytes_per_position
from bubo.server.state import INLINE_PROMPT_BYTES
from tests.server.live_server import LiveServer, ScriptedModel, scripted, serve_loaded

CHAT = {"model": "bubo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}


def assert_error(response: httpx.Response, status: int, type_: str, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (type_, code)
    assert error["message"]
    return response.json()


# Errors


@pytest.mark.parametrize(("method", "path"), [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v1/chat")])
def test_unknown_paths_are_404_not_found(tiny_server: LiveServer, method: str, path: str) -> None:
    assert_error(httpx.request(method, tiny_server.url + path), 404, "invalid_request_error", "not_found")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/rerank"),
        ("POST", "/v1/reranking"),
        ("POST", "/rerank"),
        ("POST", "/infill"),
        ("GET", "/sdapi/v1/sd-models"),
        ("POST", "/sdapi/v1/txt2img"),
    ],
)
def test_paths_a_text_model_does_not_serve_are_501(tiny_server: LiveServer, method: str, path: str) -> None:
    response = httpx.request(method, tiny_server.url + path, json={})
    assert_error(response, 501, "server_error", "not_implemented")


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_parse_error(tiny_server: LiveServer, raw: bytes) -> None:
    response = httpx.post(
        tiny_server.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400, "invalid_request_error", "parse_error")


def test_a_json_null_body_says_null(tiny_server: LiveServer) -> None:
    response = httpx.post(tiny_server.url + "/v1/chat/completions", content=b"null")
    error = assert_error(response, 400, "invalid_request_error", "parse_error")["error"]
    assert error["message"].endswith("got null")


@pytest.mark.parametrize(
    ("path", "anthropic"), [("/v1/chat/completions", False), ("/completion", False), ("/v1/messages", True)]
)
def test_a_corrupt_compressed_body_is_parse_error(
    tiny_server: LiveServer, path: str, anthropic: bool, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        response = httpx.post(tiny_server.url + path, content=b"notgzip", headers=headers)
        time.sleep(0.2)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["error"]["code"] == "parse_error"
    assert body.get("type") == ("error" if anthropic else None)
    # aiohttp meets the corrupt body again as it drains it after the answer: a warning, no traceback.
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in records)


def _raw_request(port: int, head: bytes, body: bytes = b"", wait: float = 30) -> bytes:
    """What the server answers to `head` and `body` sent on a socket (the connection left open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < 10:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


@pytest.mark.parametrize(
    "headers",
    [
        b"Content-Length: abc\r\n",
        b"Content-Length: 5\r\nContent-Length: 6\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Content-Encoding: br\r\nContent-Length: 2\r\n",
    ],
)
def test_a_request_aiohttp_cannot_parse_is_one_warning(
    tiny_server: LiveServer, caplog: pytest.LogCaptureFixture, headers: bytes
) -> None:
    """aiohttp refuses these below the app: they get 400 parse_error in the JSON shape
    (bubo/server/connections.py), and the log a warning line, not an ERROR with a traceback."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    body = b"zz\r\n{}\r\n0\r\n\r\n" if b"chunked" in headers else b"{}"
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        answer = _raw_request(tiny_server.port, head, body, wait=10)
        time.sleep(0.2)
    assert answer.split(b"\r\n")[0].split(b" ")[1] == b"400", answer[:200]
    assert b'"code": "parse_error"' in answer
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.levelno == logging.WARNING and r.exc_info is None for r in records)


def test_a_declared_body_over_the_limit_is_413_before_it_arrives(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, max_body_mb=0.01)
    try:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n"
        )
        started = time.monotonic()
        answer = _raw_request(server.port, head, b'{"model":', wait=10)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"request_too_large" in answer and time.monotonic() - started < 5
    finally:
        server.stop()


def test_a_body_that_stops_arriving_is_408(tiny_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fields, "BODY_STALL_SECONDS", 0.5)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    answer = _raw_request(tiny_server.port, head, b'{"model":', wait=10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/apply-template", CHAT),
        ("/v1/messages/count_tokens", {"model": "bubo"}),
        ("/v1/responses", {"model": "bubo", "input": []}),
    ],
)
def test_a_conversation_too_large_for_the_template_limits_is_400(
    tiny_server: LiveServer, path: str, body: dict
) -> None:
    """A message past the template sandbox's 16M-character limit is the request's size, not a
    template failure (a 500)."""
    huge = [{"role": "user", "content": "x" * 17_000_000}]
    field = "input" if path == "/v1/responses" else "messages"
    response = httpx.post(tiny_server.url + path, json={**body, field: huge}, timeout=120)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "too large" in error["message"]


def test_a_body_over_the_limit_is_413(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, max_body_mb=0.01)
    try:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]}
        response = httpx.post(server.url + "/v1/chat/completions", json=big)
        assert_error(response, 413, "invalid_request_error", "request_too_large")
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        server.stop()


def test_a_prompt_longer_than_the_context_is_400(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, ctx_size=24)
    try:
        body = {**CHAT, "messages": [{"role": "user", "content": "word " * 40}]}
        response = httpx.post(server.url + "/v1/chat/completions", json=body)
        body = assert_error(response, 400, "invalid_request_error", "context_length_exceeded")
        assert "24" in body["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("prompt_tokens", [5, 23])
def test_a_generation_to_the_context_end_counts_as_many_tokens_as_the_context(
    tiny_llama: LoadedModel, prompt_tokens: int
) -> None:
    # Prompt and completion fill the 24 positions and are counted as 24, llama-server's count: the last
    # token the model could sample would have no position of its own.
    server = serve_loaded(tiny_llama, ctx_size=24, defaults=SamplingParams(temperature=0.0))
    prompt = [ord("a")] * prompt_tokens
    try:
        openai_reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": "bubo", "prompt": prompt, "ignore_eos": True},
            timeout=60,
        ).json()
        assert openai_reply["choices"][0]["finish_reason"] == "length"
        usage = openai_reply["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            prompt_tokens,
            24 - prompt_tokens,
            24,
        )
        llama = httpx.post(
            server.url + "/completion", json={"prompt": prompt, "ignore_eos": True}, timeout=60
        ).json()
        assert (llama["tokens_evaluated"], llama["tokens_predicted"]) == (prompt_tokens, 24 - prompt_tokens)
        assert (llama["stop_type"], llama["truncated"]) == ("limit", True)
    finally:
        server.stop()


class _BrokenModel(ScriptedModel):
    def __init__(self, config: object, error: Exception) -> None:
        super().__init__(config, [0], 0)
        self.error = error

    def __call__(self, tokens: torch.Tensor, cache: object, last_only: bool = False) -> torch.Tensor:
        raise self.error


def test_a_server_fault_is_a_500_in_the_documented_shape_with_the_request_id(
    tiny_llama: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    broken = replace(tiny_llama, model=_BrokenModel(tiny_llama.config, ValueError("boom")))
    server = serve_loaded(broken)
    try:
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert_error(response, 500, "server_error", "internal_error")
        request_id = response.headers["x-request-id"]
        assert request_id in response.json()["error"]["message"]
        assert any(request_id in r.getMessage() for r in caplog.records)
        # The slot is free again: the next request is answered (by the same fault).
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 500
    finally:
        server.stop()


# API key


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    server = serve_loaded(tiny_llama, api_key="s3cret", defaults=SamplingParams(max_tokens=1))
    yield server
    server.stop()


@pytest.mark.parametrize("path", ["/health", "/ready", "/v1/models", "/props", "/slots", "/metrics"])
@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": "s3cret"}]
)
def test_every_route_needs_the_key(keyed_server: LiveServer, path: str, headers: dict) -> None:
    response = httpx.get(keyed_server.url + path, headers=headers)
    assert_error(response, 401, "authentication_error", "invalid_api_key")
    assert response.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"}])
def test_the_key_opens_every_route(keyed_server: LiveServer, headers: dict) -> None:
    assert httpx.get(keyed_server.url + "/health", headers=headers).json() == {"status": "ok"}
    assert (
        httpx.post(keyed_server.url + "/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    )


def test_the_sdk_sends_the_key(keyed_server: LiveServer) -> None:
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="s3cret", max_retries=0)
    assert good.models.list().data[1].id == "bubo"
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as error:
        bad.models.list()
    assert error.value.code == "invalid_api_key"


def test_without_a_key_none_is_asked(tiny_server: LiveServer) -> None:
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}


# Readiness


def test_ready_is_503_while_the_model_loads(tiny_llama_path: Path) -> None:
    server = serve_loaded(None, model_path=tiny_llama_path)
    try:
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        response = httpx.get(server.url + "/ready")
        assert_error(response, 503, "server_error", "not_ready")
        assert response.json()["status"] == "not_ready"
        assert_error(
            httpx.post(server.url + "/v1/chat/completions", json=CHAT), 503, "server_error", "not_ready"
        )
        # Known before loading: the model list needs only the file name.
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [
            "tiny-llama-01b",
            "bubo",
        ]
    finally:
        server.stop()


def test_ready_names_the_model(tiny_server: LiveServer) -> None:
    assert httpx.get(tiny_server.url + "/ready").json() == {"status": "ready", "model": "tiny-llama-01b"}
    for alias in ("/v1/ready", "/readyz"):
        assert httpx.get(tiny_server.url + alias).status_code == 200
    for alias in ("/v1/health", "/healthz"):
        assert httpx.get(tiny_server.url + alias).json() == {"status": "ok"}
    assert httpx.get(tiny_server.url + "/models").json()["data"][0]["context_length"] == 512


def test_served_model_name_replaces_the_file_name(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, served_model_name="my-model")
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["my-model", "bubo"]
        response = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "model": "tiny-llama-01b"})
        body = assert_error(response, 404, "invalid_request_error", "model_not_found")
        assert "my-model" in body["error"]["message"]
    finally:
        server.stop()


# Memory guard


class FakeProbe:
    def __init__(self) -> None:
        self.info = MemoryInfo(available=64 << 30, total=128 << 30)

    def read(self) -> MemoryInfo:
        return self.info


def test_the_memory_guard_answers_503_or_507(tiny_llama: LoadedModel) -> None:
    probe = FakeProbe()
    server = serve_loaded(tiny_llama, memory_probe=probe)
    url = server.url + "/v1/chat/completions"
    try:
        assert httpx.post(url, json=CHAT).status_code == 200

        probe.info = MemoryInfo(available=1 << 20, total=128 << 30)
        response = httpx.post(url, json=CHAT)
        assert_error(response, 503, "server_error", "insufficient_memory")
        assert response.headers["Retry-After"] == "5"

        probe.info = MemoryInfo(available=64 << 30, total=128 << 30, under_pressure=True)
        response = httpx.post(url, json=CHAT)
        assert_error(response, 503, "server_error", "memory_pressure")
        assert response.headers["Retry-After"] == "5"

        probe.info = MemoryInfo(available=1 << 20, total=2 << 20)
        response = httpx.post(url, json=CHAT)
        assert_error(response, 507, "server_error", "insufficient_memory_permanent")
        assert "Retry-After" not in response.headers

        probe.info = MemoryInfo(available=64 << 30, total=128 << 30)
        assert httpx.post(url, json=CHAT).status_code == 200
    finally:
        server.stop()


def test_the_estimate_grows_with_the_request(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama)
    try:
        guard = server.state.guard
        assert guard is not None
        assert guard.estimate(100, 200) > guard.estimate(10, 20) > 0
    finally:
        server.stop()


def test_the_estimate_counts_the_kv_in_the_pools_storage_types(tiny_llama_path: Path) -> None:
    # A float16 cache (`bubo serve`'s default) takes half the bytes a position of float32 does.
    loaded = load_model(tiny_llama_path, cache_dtypes=(torch.float16, torch.float16))
    server = serve_loaded(loaded)
    try:
        guard, config = server.state.guard, loaded.config
        assert guard is not None
        half = kv_bytes_per_position(config, torch.float16)
        assert guard.cost.kv_bytes_per_token == half == kv_bytes_per_position(config, torch.float32) // 2
    finally:
        server.stop()


def _complete(server: LiveServer, prompt: list[int]) -> httpx.Response:
    return httpx.post(server.url + "/completion", json={"prompt": prompt, "n_predict": 1}, timeout=60)


def test_the_memory_guard_counts_the_kv_a_request_takes_on_another_slot(tiny_llama: LoadedModel) -> None:
    # Slot 0 holds a 40-token prompt; an unrelated one of 40 tokens runs on the idle slot 1, whose blocks
    # the pool has never handed out: their pages are committed as it writes them, 3 blocks of 16.
    probe = FakeProbe()
    server = serve_loaded(tiny_llama, memory_probe=probe, parallel=2, ctx_size=64)
    try:
        assert _complete(server, [ord("a")] * 40).status_code == 200
        guard = server.state.guard
        probe.info = MemoryInfo(available=guard.estimate(40, 16), total=128 << 30)
        assert_error(_complete(server, [ord("b")] * 40), 503, "server_error", "insufficient_memory")
    finally:
        server.stop()


def test_the_memory_guard_does_not_count_kv_already_committed(tiny_llama: LoadedModel) -> None:
    # A 62-token prompt wrote 4 of the pool's 5 blocks; a short one then cut the cache back. A new
    # 62-token prompt rewrites blocks whose memory is taken already: only the 5th can add any.
    probe = FakeProbe()
    server = serve_loaded(tiny_llama, memory_probe=probe, ctx_size=64)
    try:
        assert _complete(server, [ord("a")] * 62).status_code == 200
        assert _complete(server, [ord("c")] * 2).status_code == 200
        guard = server.state.guard
        probe.info = MemoryInfo(available=guard.estimate(62, 16), total=128 << 30)
        assert _complete(server, [ord("b")] * 62).status_code == 200
    finally:
        server.stop()


# A lost device


def test_after_a_device_loss_everything_answers_503_device_lost(tiny_llama: LoadedModel) -> None:
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    server = serve_loaded(replace(tiny_llama, model=_BrokenModel(tiny_llama.config, error)))
    try:
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert_error(response, 503, "server_error", "device_lost")
        assert response.json()["status"] == "device_lost"
        for path in ("/health", "/ready"):
            response = httpx.get(server.url + path)
            assert response.status_code == 503 and response.json()["status"] == "device_lost"
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/completion"):
            response = httpx.post(server.url + path, json={"model": "bubo", "prompt": "x"})
            assert response.status_code == 503 and response.json()["status"] == "device_lost", path
    finally:
        server.stop()


# The event loop


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture(scope="module")
def hooks_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    server = serve_loaded(tiny_llama, debug_hooks=True)
    yield server
    server.stop()


@pytest.fixture
def prompt_calls(hooks_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Records each render of a chat and each tokenizing of a long text on `hooks_server`, and whether it
    ran on the event loop's thread."""
    calls: list[tuple[str, bool]] = []
    state = hooks_server.state
    tokenizer, template = state.loaded.tokenizer, state.template
    encode, render = tokenizer.encode, template.render

    def recorded_encode(text: str, *args: object, **kwargs: object) -> list[int]:
        if len(text) > 200:
            calls.append(("tokenize", _on_event_loop()))
        return encode(text, *args, **kwargs)

    def recorded_render(*args: object, **kwargs: object) -> str:
        calls.append(("render", _on_event_loop()))
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recorded_encode)
    monkeypatch.setattr(template, "render", recorded_render)
    return calls


_BIG = "word " * (INLINE_PROMPT_BYTES // 2)
_BIG_CHAT = [{"role": "user", "content": _BIG}]


@pytest.mark.parametrize(
    ("path", "body", "status", "work"),
    [
        ("/v1/chat/completions", {"model": "bubo", "messages": _BIG_CHAT}, 400, {"render", "tokenize"}),
        ("/v1/completions", {"model": "bubo", "prompt": _BIG}, 400, {"tokenize"}),
        ("/completion", {"prompt": _BIG}, 400, {"tokenize"}),
        ("/v1/responses", {"model": "bubo", "input": _BIG}, 400, {"render", "tokenize"}),
        (
            "/v1/messages",
            {"model": "bubo", "max_tokens": 4, "messages": _BIG_CHAT},
            400,
            {"render", "tokenize"},
        ),
        ("/v1/messages/count_tokens", {"model": "bubo", "messages": _BIG_CHAT}, 200, {"render", "tokenize"}),
        ("/apply-template", {"messages": _BIG_CHAT}, 200, {"render"}),
        ("/debug/prompt", {"messages": _BIG_CHAT}, 200, {"render", "tokenize"}),
    ],
)
def test_a_big_prompt_is_rendered_and_tokenized_off_the_event_loop(
    hooks_server: LiveServer,
    prompt_calls: list[tuple[str, bool]],
    path: str,
    body: dict,
    status: int,
    work: set[str],
) -> None:
    response = httpx.post(hooks_server.url + path, json=body, timeout=60)
    assert response.status_code == status, response.text
    if status == 400:
        # Too long for the tiny model's context: the same error, in the dialect's shape, as before.
        error = response.json()["error"]
        assert error.get("code") == "context_length_exceeded", error
    assert {kind for kind, _ in prompt_calls} == work
    assert not any(on_loop for _, on_loop in prompt_calls), prompt_calls


def test_a_short_prompt_is_rendered_and_tokenized_on_the_event_loop(
    hooks_server: LiveServer, prompt_calls: list[tuple[str, bool]]
) -> None:
    # Tokenizing a short prompt costs less than the hop to another thread.
    words = "word " * 60
    body = {"model": "bubo", "messages": [{"role": "user", "content": words}], "max_tokens": 1}
    response = httpx.post(hooks_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert prompt_calls == [("render", True), ("tokenize", True)]


def test_other_connections_are_served_while_a_huge_prompt_is_tokenized(
    tiny_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ~2 s of tokenizing with the tiny model's vocabulary. /health must answer early in it, not after
    # it: neither the event loop nor the GIL may be held meanwhile. (Half the tokenizing time is the
    # bound, not its end: when the GIL is held, whoever takes it first once the tokenizer lets go is
    # a race, so "before the end" would pass now and then.)
    tokenizer = tiny_server.state.loaded.tokenizer
    encode = tokenizer.encode
    started = threading.Event()
    times: dict[str, float] = {}

    def watched_encode(text: str, *args: object, **kwargs: object) -> list[int]:
        if len(text) < 1_000_000:
            return encode(text, *args, **kwargs)
        times["start"] = time.monotonic()
        started.set()
        try:
            return encode(text, *args, **kwargs)
        finally:
            times["end"] = time.monotonic()

    monkeypatch.setattr(tokenizer, "encode", watched_encode)
    body = {**CHAT, "messages": [{"role": "user", "content": "word " * 400_000}]}
    replies: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: replies.append(
            httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=120)
        )
    )
    sender.start()
    try:
        assert started.wait(60), "the huge prompt was never tokenized"
        health = httpx.get(tiny_server.url + "/health", timeout=60)
        times["health"] = time.monotonic()
    finally:
        sender.join(120)
    assert health.status_code == 200
    tokenizing = times["end"] - times["start"]
    waited = times["health"] - times["start"]
    assert waited < tokenizing / 2, f"/health took {waited:.2f} s of the {tokenizing:.2f} s of tokenizing"
    assert_error(replies[0], 400, "invalid_request_error", "context_length_exceeded")


_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": _SCHEMA}}
_HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path_and_body",
    [
        ("/completion", {"prompt": "hi", "n_predict": 1, "grammar": 'root ::= "a"'}),
        ("/completion", {"prompt": "hi", "n_predict": 1, "json_schema": _SCHEMA}),
        (
            "/v1/chat/completions",
            {
                "model": "bubo",
                "messages": _HI,
                "max_tokens": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": _SCHEMA}},
            },
        ),
        (
            "/v1/chat/completions",
            {"model": "bubo", "messages": _HI, "max_tokens": 1, "tools": [_TOOL], "tool_choice": "required"},
        ),
        (
            "/v1/responses",
            {
                "model": "bubo",
                "input": "hi",
                "max_output_tokens": 1,
                "text": {"format": {"type": "json_schema", "name": "n", "schema": _SCHEMA}},
            },
        ),
        (
            "/v1/messages",
            {
                "model": "bubo",
                "max_tokens": 1,
                "messages": _HI,
                "output_config": {"format": {"type": "json_schema", "schema": _SCHEMA}},
            },
        ),
    ],
    ids=["gbnf", "json_schema", "response_format", "forced_tool", "responses", "messages"],
)
def test_a_grammar_is_compiled_off_the_event_loop(
    hooks_server: LiveServer, monkeypatch: pytest.MonkeyPatch, path_and_body: tuple[str, dict]
) -> None:
    # Compiling costs what the grammar asks, not what the body weighs: 1000 chained GBNF rules in 26 KB
    # held the loop 1.1 s. Every compile (and the first one's token trie) runs on the prompt thread.
    compiled: list[bool] = []
    matcher = state_module.GrammarMatcher

    def recorded_matcher(*args: object, **kwargs: object) -> GrammarMatcher:
        compiled.append(_on_event_loop())
        return matcher(*args, **kwargs)

    monkeypatch.setattr(state_module, "GrammarMatcher", recorded_matcher)
    path, body = path_and_body
    response = httpx.post(hooks_server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert compiled == [False]


@dataclass
class HeldCompiles:
    """JSON schema compiles that wait for `gate` before they compile; `started` are their schemas."""

    gate: threading.Event = field(default_factory=threading.Event)
    started: list[str] = field(default_factory=list)


@pytest.fixture
def held_compiles(hooks_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldCompiles]:
    """On `hooks_server`, a JSON schema compile in progress for as long as a test keeps the gate shut."""
    held = HeldCompiles()
    compile_schema = state_module.json_schema_grammar

    def held_compile(schema: dict) -> str:
        held.started.append(json.dumps(schema))
        held.gate.wait(30)
        return compile_schema(schema)

    monkeypatch.setattr(state_module, "json_schema_grammar", held_compile)
    try:
        yield held
    finally:
        held.gate.set()
        # What a test left queued on the prompt thread runs (or is skipped) before the next test.
        hooks_server.state._prompt_thread.submit(lambda: None).result(30)


def _schema_request(schema: dict) -> dict:
    return {"prompt": "hi", "n_predict": 1, "json_schema": schema}


def test_other_connections_are_served_while_a_grammar_compiles(
    hooks_server: LiveServer, held_compiles: HeldCompiles
) -> None:
    replies: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: replies.append(
            httpx.post(hooks_server.url + "/completion", json=_schema_request(_SCHEMA), timeout=60)
        )
    )
    sender.start()
    try:
        _wait_for(lambda: len(held_compiles.started) == 1)
        health = httpx.get(hooks_server.url + "/health", timeout=5)
    finally:
        held_compiles.gate.set()
        sender.join(60)
    assert health.status_code == 200
    assert replies[0].status_code == 200, replies[0].text


def test_a_client_that_leaves_while_its_grammar_compiles_leaves_nothing_behind(
    hooks_server: LiveServer, held_compiles: HeldCompiles
) -> None:
    # The first client's compile is under way; the second's waits for the prompt thread. Both leave: the
    # first compile's result is dropped, the second is never compiled, and the slot stays free.
    state = hooks_server.state
    first, second = {**_SCHEMA, "title": "first"}, {**_SCHEMA, "title": "second"}
    sockets = []
    for schema in (first, second):
        body = json.dumps(_schema_request(schema)).encode()
        sock = socket.create_connection(("127.0.0.1", hooks_server.port), timeout=30)
        sock.sendall(
            b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        sockets.append(sock)
        if schema is first:
            _wait_for(lambda: len(held_compiles.started) == 1)
    for sock in sockets:
        sock.close()
    _wait_for(lambda: not hooks_server.runner.server.connections)
    held_compiles.gate.set()
    state._prompt_thread.submit(lambda: None).result(30)
    assert held_compiles.started == [json.dumps(first)]
    slots = httpx.get(hooks_server.url + "/slots", timeout=30).json()
    assert [slot["is_processing"] for slot in slots] == [False]
    assert state.slots.stats.requests_deferred == 0
    after = httpx.post(hooks_server.url + "/completion", json=_schema_request(_SCHEMA), timeout=60)
    assert after.status_code == 200, after.text


def _wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# The slot


@pytest.fixture
def slow_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    """A model that writes a long text at 50 ms per token."""
    loaded = scripted(tiny_llama, "word " * 200, delay=0.05)
    server = serve_loaded(loaded, defaults=SamplingParams(temperature=0.0))
    yield server
    server.stop()


def test_concurrent_requests_wait_their_turn_and_each_gets_its_own_output(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(scripted(tiny_llama, "Hello there, world!", delay=0.01))
    slot = server.state.slots.slots[0]
    assert slot is not None
    results: dict[int, dict] = {}

    def ask(i: int) -> None:
        body = {
            "model": "bubo",
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 4 + i,
        }
        results[i] = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()

    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        tokenizer = tiny_llama.tokenizer
        script = tokenizer.encode("Hello there, world!")
        for i in range(4):
            assert results[i]["usage"]["completion_tokens"] == 4 + i
            assert results[i]["choices"][0]["message"]["content"] == tokenizer.decode(script[: 4 + i])
        stats = server.state.slots.stats
        assert stats.requests_deferred_total >= 1
        assert stats.requests_deferred == 0 and not slot.is_processing
    finally:
        server.stop()


def test_a_client_that_disconnects_stops_its_generation(slow_server: LiveServer) -> None:
    slot = slow_server.state.slots.slots[0]
    assert slot is not None
    model = slot.model
    assert isinstance(model, ScriptedModel)
    body = {**CHAT, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", slow_server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 4:
                break
    closed_at = model.forwards
    deadline = time.monotonic() + 5
    while slot.is_processing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not slot.is_processing
    assert model.forwards <= closed_at + 2  # stopped within a token or two of the disconnect
    # The slot is free: a new request runs at once.
    started = time.monotonic()
    reply = httpx.post(slow_server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=30)
    assert reply.status_code == 200 and time.monotonic() - started < 2


def test_a_non_streaming_client_that_gives_up_frees_the_slot(slow_server: LiveServer) -> None:
    slot = slow_server.state.slots.slots[0]
    assert slot is not None
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 200}, timeout=0.5)
    deadline = time.monotonic() + 5
    while slot.is_processing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not slot.is_processing
    assert slot.model.forwards < 40  # 200 tokens would take 10 s


class _HeldPrefill:
    """Wraps a decoder: its first prefill piece (a forward of several tokens) waits for `release`, and
    `pieces` counts the prefill pieces run."""

    def __init__(self, model: object) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.entered = threading.Event()
        self.release = threading.Event()
        self.pieces = 0

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> object:
        return self.model.new_cache(batch, max_len)

    def __call__(self, tokens: torch.Tensor, cache: object, last_only: bool = False) -> torch.Tensor:
        if tokens.shape[1] > 1:
            self.pieces += 1
            self.entered.set()
            assert self.release.wait(30), "the test never released the prefill"
        return self.model(tokens, cache, last_only)


def test_a_client_that_disconnects_during_the_prefill_stops_it(
    tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long prompt is computed in pieces; a client gone meanwhile must not hold the slot for the rest.
    monkeypatch.setattr("bubo.engine.generate.PREFILL_CHUNK_TOKENS", 16)
    held = _HeldPrefill(tiny_llama.model)
    server = serve_loaded(replace(tiny_llama, model=held), defaults=SamplingParams(temperature=0.0))
    try:
        slot = server.state.slots.slots[0]
        body = {"prompt": [5] * 160, "n_predict": 4, "stream": True}
        payload = json.dumps(body).encode()
        head = (
            "POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(head.encode() + payload)
            assert held.entered.wait(30)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            # The connection is closed; wait until the server has dropped it (its handler cancelled).
            deadline = time.monotonic() + 5
            while server.runner.server.connections and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
            held.release.set()
            while slot.is_processing and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not slot.is_processing
            ran = held.pieces
            assert ran <= 2  # of 10
            assert slot.cached_tokens == 16 * ran  # what ran is what the cache holds
            assert server.state.slots.stats.prompt_tokens_total == 16 * ran  # and what /metrics counts
            # The slot serves the next request, reusing the pieces that ran.
            reply = client.post("/completion", json={**body, "stream": False})
            assert reply.status_code == 200, reply.text
            assert reply.json()["tokens_cached"] == 16 * ran
            assert server.state.slots.stats.prompt_tokens_total == 160
    finally:
        held.release.set()
        server.stop()
