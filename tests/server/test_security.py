"""Security defaults: request-head limits, CORS only for named origins, the API key (compared in constant
time, robust to odd bytes), the warning for an open bind, debug hooks on loopback only, and a hostile
chat template stopped with a 500 while the server keeps serving."""

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.sampler import SamplingParams
from bubo.server import app as server_app
from bubo.server.app import MAX_FIELD_SIZE, MAX_HEADERS, create_app, exposure_warning
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState
from tests.conftest import _tiny_llama
from tests.server.live_server import LiveServer, free_port, serve_loaded

CHAT = {"model": "bubo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ALLOWED = "http://app.example"
BUBO_SERVE = [sys.executable, "-m", "bubo", "serve"]


def _raw(server: LiveServer, request: bytes) -> bytes:
    """Send raw bytes, return everything the server answers before closing."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _get_health(headers: bytes = b"", path: bytes = b"/health") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + headers + b"Connection: close\r\n\r\n"


@pytest.fixture(scope="module")
def server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(tiny_llama, defaults=SamplingParams(temperature=0.0, max_tokens=2))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def cors_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(
        tiny_llama,
        defaults=SamplingParams(temperature=0.0, max_tokens=2),
        cors_origins=(ALLOWED,),
        api_key="sesame",
    )
    yield live
    live.stop()


# Request-head limits


def test_headers_within_the_limits_are_served(server: LiveServer) -> None:
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS - 5))
    long = b"X-Long: " + b"a" * (MAX_FIELD_SIZE - 100) + b"\r\n"
    assert _raw(server, _get_health(many + long)).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (_get_health(b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 1))), b"more headers"),
        (_get_health(b"X-Big: " + b"a" * (MAX_FIELD_SIZE + 1) + b"\r\n"), b"longer than"),
        (_get_health(path=b"/" + b"a" * 9000), b"longer than"),
    ],
    ids=["too many headers", "header too long", "request line too long"],
)
def test_request_heads_over_the_limits_get_400_and_the_server_keeps_serving(
    server: LiveServer, request_bytes: bytes, reason: bytes
) -> None:
    answer = _raw(server, request_bytes)
    assert answer.startswith(b"HTTP/1.0 400") and reason in answer
    assert b"application/json" in answer and b'"parse_error"' in answer and b"aaaa" not in answer
    assert httpx.get(server.url + "/health").status_code == 200


# CORS


def test_without_cors_origins_no_cors_headers_are_sent(server: LiveServer) -> None:
    reply = httpx.get(server.url + "/health", headers={"Origin": ALLOWED})
    assert not any(name.lower().startswith("access-control-") for name in reply.headers)
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={"Origin": ALLOWED, "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_a_named_origin_gets_its_preflight_without_a_key(cors_server: LiveServer) -> None:
    preflight = httpx.options(
        cors_server.url + "/v1/chat/completions",
        headers={
            "Origin": ALLOWED,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ALLOWED
    allowed_headers = preflight.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers


def test_a_named_origin_gets_cors_headers_on_answers_streams_and_errors(cors_server: LiveServer) -> None:
    headers = {"Origin": ALLOWED, "Authorization": "Bearer sesame"}
    answer = httpx.post(cors_server.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ALLOWED
    assert "x-request-id" in answer.headers["access-control-expose-headers"]
    with httpx.stream(
        "POST", cors_server.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
    ) as stream:
        assert stream.headers["access-control-allow-origin"] == ALLOWED
        assert "[DONE]" in stream.read().decode()
    refused = httpx.post(cors_server.url + "/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ALLOWED


def test_another_origin_gets_no_cors_headers(cors_server: LiveServer) -> None:
    other = {"Origin": "http://evil.example"}
    preflight = httpx.options(
        cors_server.url + "/v1/chat/completions", headers={**other, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code != 204 and "access-control-allow-origin" not in preflight.headers
    answer = httpx.get(cors_server.url + "/health", headers={**other, "Authorization": "Bearer sesame"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_a_wildcard_origin_allows_any_page(tiny_llama: LoadedModel) -> None:
    live = serve_loaded(tiny_llama, cors_origins=("*",))
    try:
        reply = httpx.get(live.url + "/health", headers={"Origin": "http://anywhere.example"})
        assert reply.headers["access-control-allow-origin"] == "*"
    finally:
        live.stop()


# API key


def test_the_key_is_compared_in_constant_time(
    cors_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = server_app.hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server_app.hmac, "compare_digest", recording)
    assert httpx.get(cors_server.url + "/health", headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.get(cors_server.url + "/health", headers={"x-api-key": "sesame"}).status_code == 200
    assert compared == [(b"wrong", b"sesame"), (b"sesame", b"sesame")]


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"Bearer \xc3\xa9t\xc3\xa9", b"\x00\x01", b"Bearer"])
def test_odd_authorization_bytes_get_401_not_500(cors_server: LiveServer, value: bytes) -> None:
    answer = _raw(cors_server, _get_health(b"Authorization: " + value + b"\r\n"))
    assert answer.split(b"\r\n", 1)[0] in (b"HTTP/1.1 401 Unauthorized", b"HTTP/1.0 400 Bad Request")


# Binding and debug hooks


def test_an_open_bind_without_a_key_is_warned_about(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    assert "WITHOUT an API key" in (exposure_warning(ServerSettings(model, host="0.0.0.0")) or "")
    assert exposure_warning(ServerSettings(model, host="0.0.0.0", api_key="k")) is None
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert exposure_warning(ServerSettings(model, host=loopback)) is None


def test_bubo_serve_on_an_open_host_warns_on_stderr(tiny_llama_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [*BUBO_SERVE, "--model", str(tiny_llama_path), "--host", "0.0.0.0", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("WARNING" in line for line in lines):
            lines.append(process.stderr.readline())
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()
    assert any("WITHOUT an API key" in line for line in lines), lines


def test_debug_hooks_are_refused_off_loopback(tmp_path: Path) -> None:
    state = ServerState(ServerSettings(tmp_path / "m.gguf", host="0.0.0.0", debug_hooks=True))
    with pytest.raises(ValueError, match="loopback"):
        create_app(state)


# A hostile template in the model file


def test_a_runaway_template_is_a_500_and_the_server_keeps_serving(tmp_path: Path) -> None:
    endless = "{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
    path = _tiny_llama(tmp_path / "Hostile.gguf", 512, **{"tokenizer.chat_template": endless})
    live = serve_loaded(load_model(path), defaults=SamplingParams(temperature=0.0, max_tokens=2))
    try:
        started = time.perf_counter()
        failed = httpx.post(live.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert time.perf_counter() - started < 10
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == "template_error" and error["type"] == "server_error"
        assert "ran longer than" in error["message"]
        anthropic = httpx.post(
            live.url + "/v1/messages",
            json={"model": "bubo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert anthropic.status_code == 500 and anthropic.json()["error"]["type"] == "api_error"
        completion = httpx.post(live.url + "/v1/completions", json={"model": "bubo", "prompt": "hello"})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
    finally:
        live.stop()
