"""Shutdown and faults. SIGTERM to a real server process closes the port, lets requests in flight
finish within the grace period, cuts the streams still running after it with a final error event
(never a truncated JSON line) and exits 0 within a bound. An exception inside generation ends that
request with a 500 in the documented shape (a final error event once a stream has started; on
/v1/responses an error event and then response.failed) and the next request is served."""

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from tests.server.live_server import LiveServer, free_port, scripted, serve_loaded, wait_ready

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": "bubo", "messages": [{"role": "user", "content": "hi"}]}

# `serve` in a child process, on the tiny model with its decoder replaced by a scripted one that
# sleeps DELAY s per forward: a generation whose length the test controls.
SERVER_SCRIPT = """
import sys
from pathlib import Path

import bubo.server.served_model as state_module
from bubo.engine.loaded_model import load_model
from bubo.engine.sampler import SamplingParams
from bubo.server.app import serve
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState
from tests.server.live_server import scripted

path, port, words, delay, grace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
state_module.load_model = lambda p, **kw: scripted(load_model(p, **kw), "go " * words, delay=delay)
settings = ServerSettings(Path(path), port=port, shutdown_grace=grace, defaults=SamplingParams(temperature=0.0))
state = ServerState(settings)
state.preflight()
sys.exit(serve(state))
"""


class ServerProcess:
    def __init__(self, model: Path, *, words: int, delay: float, grace: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [str(model), str(self.port), str(words), str(delay), str(grace)]
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER_SCRIPT, *args], cwd=REPO, stderr=subprocess.PIPE, text=True
        )
        if not wait_ready(self.url):
            self.process.kill()
            raise RuntimeError("the server did not become ready")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stderr(self) -> str:
        self.process.kill()
        return self.process.stderr.read() if self.process.stderr else ""


class StreamReader(threading.Thread):
    """Reads one SSE stream to its end on a thread; `started` is set once the first data line arrives."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = body
        self.started = threading.Event()
        self.lines: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as response:
                for line in response.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data:"):
                        self.started.set()
        except BaseException as error:  # the test reads it
            self.error = error
        finally:
            self.started.set()

    def data(self) -> list[Any]:
        """Every data payload, parsed: a truncated JSON line would fail here."""
        return [
            line[5:].strip() if line[5:].strip() == "[DONE]" else json.loads(line[5:])
            for line in self.lines
            if line.startswith("data:")
        ]


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def test_sigterm_lets_a_stream_finish_and_closes_the_port(tiny_llama_path: Path) -> None:
    server = ServerProcess(tiny_llama_path, words=20, delay=0.05, grace=20)
    try:
        reader = StreamReader(
            server.url + "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 400}
        )
        reader.start()
        assert reader.started.wait(30)
        stopped_at = time.monotonic()
        server.terminate()
        time.sleep(0.3)
        assert _refused(server.url), "the port still accepts connections after SIGTERM"
        assert reader.is_alive(), "the stream ended before the port was checked: lengthen it"
        assert server.wait(30) == 0
        took = time.monotonic() - stopped_at
        reader.join(10)
    finally:
        stderr = server.stderr()
    assert reader.error is None, reader.error
    events = reader.data()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == "go " * 20
    assert took < 15, f"exit took {took:.1f} s"
    assert "stopping: no new connections" in stderr


def test_sigterm_cuts_streams_still_running_after_the_grace_period(tiny_llama_path: Path) -> None:
    grace = 1.0
    server = ServerProcess(tiny_llama_path, words=500, delay=0.05, grace=grace)
    try:
        openai_stream = StreamReader(
            server.url + "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 400}
        )
        openai_stream.start()
        assert openai_stream.started.wait(30)
        anthropic_stream = StreamReader(
            server.url + "/v1/messages", {**CHAT, "stream": True, "max_tokens": 400}
        )
        anthropic_stream.start()  # waits for the slot behind the first
        time.sleep(0.3)
        stopped_at = time.monotonic()
        server.terminate()
        assert server.wait(30) == 0
        took = time.monotonic() - stopped_at
        openai_stream.join(10)
        anthropic_stream.join(10)
    finally:
        server.stderr()
    assert took < grace + 5, f"exit took {took:.1f} s"

    assert openai_stream.error is None, openai_stream.error
    events = openai_stream.data()
    assert len(events) > 3 and events[-1]["error"]["code"] == "shutting_down"
    assert events[-1]["error"]["type"] == "server_error"

    # The queued request never started its stream: it gets the error as a plain answer.
    assert anthropic_stream.error is None, anthropic_stream.error
    body = json.loads("".join(anthropic_stream.lines))
    assert body["type"] == "error" and body["error"]["code"] == "shutting_down"


class FailsOnce:
    """A decoder whose first prefill or first decode step (`when`) raises, then works."""

    def __init__(self, model: Any, when: str) -> None:
        self.model = model
        self.config = model.config
        self.device = model.device
        self.when = when
        self.failed = False

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> Any:
        return self.model.new_cache(batch, max_len)

    def __call__(self, tokens: torch.Tensor, cache: Any, last_only: bool = False) -> torch.Tensor:
        step = "decode" if tokens.shape[1] == 1 else "prefill"
        if step == self.when and not self.failed:
            self.failed = True
            raise RuntimeError(f"injected failure in {step}")
        return self.model(tokens, cache, last_only)


@pytest.fixture
def failing(
    tiny_llama: LoadedModel, request: pytest.FixtureRequest
) -> Iterator[tuple[LiveServer, FailsOnce]]:
    model = FailsOnce(scripted(tiny_llama, "Hello world. Goodbye.").model, request.param)
    live = serve_loaded(replace(tiny_llama, model=model), defaults=SamplingParams(temperature=0.0))
    yield live, model
    live.stop()


def _next_request_is_served(live: LiveServer) -> None:
    reply = httpx.post(live.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "Hello world. Goodbye."


@pytest.mark.parametrize("failing", ["prefill", "decode"], indirect=True)
def test_a_generation_failure_is_a_500_and_the_next_request_is_served(
    failing: tuple[LiveServer, FailsOnce],
) -> None:
    live, model = failing
    reply = httpx.post(live.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert model.failed
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert "injected" not in error["message"]  # internals stay in the log
    _next_request_is_served(live)


@pytest.mark.parametrize("failing", ["decode"], indirect=True)
def test_a_failure_inside_a_stream_ends_it_with_an_error_event(failing: tuple[LiveServer, FailsOnce]) -> None:
    live, _ = failing
    reader = StreamReader(live.url + "/v1/chat/completions", {**CHAT, "stream": True})
    reader.run()
    assert reader.error is None
    events = reader.data()
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["error"]["code"] == "internal_error" and "[DONE]" not in events
    _next_request_is_served(live)


@pytest.mark.parametrize("failing", ["decode"], indirect=True)
def test_a_failure_inside_an_anthropic_stream_ends_it_with_an_error_event(
    failing: tuple[LiveServer, FailsOnce],
) -> None:
    live, _ = failing
    reader = StreamReader(live.url + "/v1/messages", {**CHAT, "stream": True, "max_tokens": 20})
    reader.run()
    events = reader.data()
    assert events[0]["type"] == "message_start"
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert events[-1]["error"]["code"] == "internal_error"
    assert "event: error" in reader.lines
    _next_request_is_served(live)


@pytest.mark.parametrize("failing", ["decode"], indirect=True)
def test_a_failure_inside_a_responses_stream_ends_it_with_response_failed(
    failing: tuple[LiveServer, FailsOnce],
) -> None:
    live, model = failing
    body = {"model": "bubo", "input": "hi", "stream": True}
    reader = StreamReader(live.url + "/v1/responses", body)
    reader.run()
    assert reader.error is None
    events = reader.data()
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
    # The protocol's error event, then the failed response as the last lifecycle event.
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "internal_error"
    assert failed["type"] == "response.failed"
    response = failed["response"]
    assert response["id"] == events[0]["response"]["id"]
    assert response["status"] == "failed" and response["usage"] is None
    assert response["error"] == {"code": "internal_error", "message": error["message"]}
    assert "injected" not in error["message"]  # internals stay in the log
    # The first token came out before the failure: the message it began is in the output, cut off.
    [message] = response["output"]
    streamed = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert streamed
    assert message["status"] == "incomplete" and message["content"][0]["text"] == streamed
    _next_request_is_served(live)

    # The official SDK reads both as typed events.
    model.failed = False
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    kinds = [event.type for event in client.responses.create(model="bubo", input="hello", stream=True)]
    assert kinds[-2:] == ["error", "response.failed"]
