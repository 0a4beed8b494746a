"""`--parallel N`: several slots on one model, their decode steps batched, their KV in one block pool.
Every answer must equal what the same request gets alone (greedy), whatever runs beside it."""

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.sampler import SamplingParams
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid
from tests.server.live_server import LiveServer, serve_loaded

SYSTEM = "You are a terse assistant who answers every question in as few words as possible. " * 3


def _body(question: str, max_tokens: int = 10) -> dict:
    return {
        "model": "bubo",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
    }


@pytest.fixture(scope="module")
def parallel_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    server = serve_loaded(tiny_llama, parallel=4, defaults=SamplingParams(temperature=0.0), debug_hooks=True)
    yield server
    server.stop()


def _ask(server: LiveServer, body: dict) -> dict:
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_slots_lists_every_slot(parallel_server: LiveServer) -> None:
    slots = httpx.get(parallel_server.url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(not s["is_processing"] for s in slots)
    props = httpx.get(parallel_server.url + "/props").json()
    assert props["total_slots"] == 4


def test_concurrent_requests_each_get_what_they_get_alone(
    parallel_server: LiveServer, tiny_llama: LoadedModel
) -> None:
    questions = [f"question number {i}?" for i in range(4)]
    alone = serve_loaded(tiny_llama, defaults=SamplingParams(temperature=0.0))
    try:
        expected = [
            _ask(alone, _body(q, 8 + i))["choices"][0]["message"]["content"] for i, q in enumerate(questions)
        ]
    finally:
        alone.stop()
    results: dict[int, dict] = {}
    start = threading.Barrier(len(questions))

    def ask(i: int) -> None:
        start.wait()
        results[i] = _ask(parallel_server, _body(questions[i], 8 + i))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i]["choices"][0]["message"]["content"] for i in range(4)] == expected
    assert [results[i]["usage"]["completion_tokens"] for i in range(4)] == [8, 9, 10, 11]
    metrics = httpx.get(parallel_server.url + "/metrics").text
    busy = next(line for line in metrics.splitlines() if line.startswith("llamacpp:n_busy_slots_per_decode"))
    assert float(busy.split()[-1]) > 1.0  # decode passes carried several slots' steps
    assert all(not s["is_processing"] for s in httpx.get(parallel_server.url + "/slots").json())


def test_completion_stream_chunks_name_the_slot_that_writes_them(parallel_server: LiveServer) -> None:
    # llama-server's /completion chunks carry id_slot; with several slots busy they must differ.
    slots: dict[int, list[int]] = {}
    start = threading.Barrier(2)

    def stream(i: int) -> None:
        body = {"prompt": f"stream number {i} says", "n_predict": 6, "stream": True, "ignore_eos": True}
        start.wait()
        with httpx.stream("POST", parallel_server.url + "/completion", json=body, timeout=120) as reply:
            lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
        slots[i] = [json.loads(line.removeprefix("data: "))["id_slot"] for line in lines]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for ids in slots.values():
        assert len(ids) > 1 and len(set(ids)) == 1  # every chunk and the final event: one slot
    assert slots[0][0] != slots[1][0]


def test_a_new_conversation_shares_the_system_prompt_blocks_of_another_slot(
    parallel_server: LiveServer,
) -> None:
    first = _ask(parallel_server, _body("what is the capital of france?", 4))
    second = _ask(parallel_server, _body("how tall is mount everest?", 4))
    assert first["usage"]["completion_tokens"] == 4
    ids = [
        httpx.post(parallel_server.url + "/debug/prompt", json=_body(q)).json()["tokens"]
        for q in ("what is the capital of france?", "how tall is mount everest?")
    ]
    common = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    assert common > 50  # the system prompt
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == common
    cache = httpx.get(parallel_server.url + "/debug/cache").json()
    assert cache["kv_pool"]["shared_blocks"] >= 1
    # Both conversations stay cached, each on its own slot.
    held = sorted(s["cached_tokens"] for s in cache["slots"] if s["cached_tokens"])
    assert len(held) >= 2
    again = _ask(parallel_server, _body("what is the capital of france?", 4))
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1


def test_a_prompt_that_needs_more_blocks_than_are_free_waits_with_a_503(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(
        tiny_llama, parallel=2, ctx_size=64, kv_tokens=64, defaults=SamplingParams(temperature=0.0)
    )
    try:
        pool = server.state.slots.pool
        assert pool is not None
        held = [pool.take() for _ in range(pool.free_blocks)]  # another slot's long generation, say
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "bubo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=60,
        )
        assert reply.status_code == 503 and reply.headers["Retry-After"] == "5"
        assert reply.json()["error"]["code"] == "insufficient_memory"
        pool.release(held)
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "bubo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=60,
        )
        assert reply.status_code == 200
    finally:
        server.stop()


def test_a_hybrid_model_serves_concurrent_requests_as_each_alone(tmp_path: Path) -> None:
    """Gated DeltaNet states batch too: their rows are stacked for the step and split back."""
    model = tiny_hybrid(
        "qwen35moe", ["linear_attention", "full_attention"] * 2, vocab_size=320, max_position_embeddings=1024
    )
    randomize_(model)
    loaded = load_model(write_gguf(model, tmp_path / "tiny-qwen35moe.gguf"))
    questions = [f"tell me about {topic}" for topic in ("owls", "rivers", "bread")]
    alone = serve_loaded(loaded, defaults=SamplingParams(temperature=0.0))
    try:
        expected = [_ask(alone, _body(q, 10))["choices"][0]["message"]["content"] for q in questions]
    finally:
        alone.stop()
    server = serve_loaded(loaded, parallel=3, defaults=SamplingParams(temperature=0.0))
    try:
        results: dict[int, str] = {}
        start = threading.Barrier(len(questions))

        def ask(i: int) -> None:
            start.wait()
            results[i] = _ask(server, _body(questions[i], 10))["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results[i] for i in range(len(questions))] == expected
        assert server.state.slots.batcher.rows > server.state.slots.batcher.steps
    finally:
        server.stop()
