"""A bounded soak test on loopback: 64 concurrent clients for a fixed time against `bubo serve
--parallel 4` (a real process), every dialect, streaming and not, a third of the clients hanging up
mid-stream at random points.

Every request that completes must give what the same request gives alone (greedy); afterwards no slot
is busy, /metrics counts exactly the requests that ran, the process's resident memory is back within
10 % of what it was before, and /health answered ok throughout."""

import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.live_server import free_port, wait_ready

CLIENTS = 64
SOAK_SECONDS = 20.0
MAX_TOKENS = 8


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@dataclass(frozen=True)
class Kind:
    """One kind of request: route, body, and how to read the generated text from the answer."""

    name: str
    path: str
    body: dict[str, Any]
    text: Callable[[dict[str, Any]], str]  # from a non-streamed answer
    piece: Callable[[dict[str, Any]], str]  # from one streamed event


def _responses_text(body: dict[str, Any]) -> str:
    return "".join(
        part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"]
    )


def _kinds(question: str) -> list[Kind]:
    chat = {"model": "bubo", "messages": _chat(question), "max_tokens": MAX_TOKENS}
    return [
        Kind(
            "openai-chat",
            "/v1/chat/completions",
            chat,
            lambda b: b["choices"][0]["message"]["content"],
            lambda e: (e.get("choices") or [{}])[0].get("delta", {}).get("content") or "",
        ),
        Kind(
            "openai-completions",
            "/v1/completions",
            {"model": "bubo", "prompt": question, "max_tokens": MAX_TOKENS},
            lambda b: b["choices"][0]["text"],
            lambda e: (e.get("choices") or [{}])[0].get("text") or "",
        ),
        Kind(
            "anthropic",
            "/v1/messages",
            chat,
            lambda b: "".join(c["text"] for c in b["content"] if c["type"] == "text"),
            lambda e: e.get("delta", {}).get("text", "") if e.get("type") == "content_block_delta" else "",
        ),
        Kind(
            "responses",
            "/v1/responses",
            {"model": "bubo", "input": question, "max_output_tokens": MAX_TOKENS},
            _responses_text,
            lambda e: e.get("delta", "") if e.get("type") == "response.output_text.delta" else "",
        ),
        Kind(
            "llama",
            "/completion",
            {"prompt": question, "n_predict": MAX_TOKENS},
            lambda b: b["content"],
            lambda e: "" if e.get("stop") else e.get("content", ""),
        ),
    ]


QUESTIONS = ["what is a slot?", "name a prime", "say something", "count to three"]
KINDS = [kind for q in QUESTIONS for kind in _kinds(q)]


async def _send(client: httpx.AsyncClient, kind: Kind, stream: bool, hang_up_after: int | None) -> str | None:
    """The answer's text, or None when this client hung up mid-stream."""
    body = {**kind.body, "stream": stream}
    if not stream:
        reply = await client.post(kind.path, json=body)
        assert reply.status_code == 200, reply.text
        return kind.text(reply.json())
    pieces, events = [], 0
    async with client.stream("POST", kind.path, json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            pieces.append(kind.piece(event))
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                return None
    return "".join(pieces)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


@pytest.fixture(scope="module")
def soak_server(tiny_llama_path: Path) -> Iterator[tuple[str, int]]:
    """(url, pid) of `bubo serve --parallel 4` on the tiny llama, greedy by default."""
    port = free_port()
    command = [sys.executable, "-m", "bubo", "serve", "--model", str(tiny_llama_path), "--port", str(port)]
    process = subprocess.Popen([*command, "--parallel", "4", "--temp", "0"], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(30)


def test_64_clients_with_disconnects_lose_nothing_and_leak_nothing(soak_server: tuple[str, int]) -> None:
    url, pid = soak_server

    async def expected_answers() -> dict[tuple[str, str], str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return {
                (kind.name, kind.path + json.dumps(kind.body)): await _send(client, kind, False, None) or ""
                for kind in KINDS
            }

    expected = asyncio.run(expected_answers())
    rss_before = _rss(pid)
    before = httpx.get(url + "/metrics").text

    async def soak() -> tuple[int, int, int, list[int]]:
        completed = hung_up = mismatches = 0
        health: list[int] = []
        deadline = time.monotonic() + SOAK_SECONDS
        limits = httpx.Limits(max_connections=CLIENTS + 4)

        async def client_loop(seed: int) -> None:
            nonlocal completed, hung_up, mismatches
            rng = random.Random(seed)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                while time.monotonic() < deadline:
                    kind = rng.choice(KINDS)
                    stream = rng.random() < 0.6
                    hang_up = rng.randint(1, MAX_TOKENS) if stream and seed % 3 == 0 else None
                    text = await _send(client, kind, stream, hang_up)
                    if text is None:
                        hung_up += 1
                        continue
                    completed += 1
                    mismatches += text != expected[(kind.name, kind.path + json.dumps(kind.body))]

        async def watch_health() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                while time.monotonic() < deadline:
                    health.append((await client.get("/health")).status_code)
                    await asyncio.sleep(0.25)

        await asyncio.gather(watch_health(), *(client_loop(i) for i in range(CLIENTS)))
        return completed, hung_up, mismatches, health

    completed, hung_up, mismatches, health = asyncio.run(soak())
    assert completed > CLIENTS and hung_up > 0
    assert mismatches == 0
    assert health and set(health) == {200}

    # Hung-up generations stop within a token; then every slot is free.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        slots = httpx.get(url + "/slots").json()
        if not any(s["is_processing"] for s in slots):
            break
        time.sleep(0.05)
    assert len(slots) == 4 and not any(s["is_processing"] for s in slots)
    after = httpx.get(url + "/metrics").text
    # Every request that reached a slot (all completed ones, and every hung-up stream, which had
    # begun) is counted exactly once; each completed one predicted at least a token.
    assert (
        _metric(after, "bubo_requests_total") - _metric(before, "bubo_requests_total") == completed + hung_up
    )
    predicted = _metric(after, "llamacpp:tokens_predicted_total") - _metric(
        before, "llamacpp:tokens_predicted_total"
    )
    assert predicted >= completed
    assert _metric(after, "llamacpp:requests_processing") == 0
    assert _metric(after, "llamacpp:requests_deferred") == 0
    rss_after = _rss(pid)
    assert rss_after <= rss_before * 1.10
    print(
        f"soak: {completed} completed, {hung_up} hung up in {SOAK_SECONDS:.0f} s; "
        f"server RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
    )
