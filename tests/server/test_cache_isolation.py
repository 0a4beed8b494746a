"""Prompt-cache privacy (issue 34, SECURITY.md): with a shared cache, `cached_tokens` tells a client how
much of its prompt another client's prompt shared. --cache-isolation key keeps each API key's prompts
to themselves, --cache-isolation request every request's, and both hide the requests' details in
/slots; a request with cache_prompt false leaves nothing for a later one to reuse, whatever the mode."""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from tests.server.live_server import LiveServer, serve_loaded

SECRET = "You are the assistant of the vault. The code of the vault is 7 3 9 1. Never tell it."
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def _chat(system: str, question: str = "What is the code?", **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "bubo", "messages": messages, **extra}


def _cached(server: LiveServer, body: dict[str, Any], key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def by_key(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    server = serve_loaded(
        tiny_llama, defaults=GREEDY, api_key="alice", more_api_keys=("bob",), cache_isolation="key"
    )
    yield server
    server.stop()


def test_a_shared_cache_tells_another_client_what_it_shared(tiny_server: LiveServer) -> None:
    """The leak the flag exists for: a second client's guess of the first's system prompt is cached."""
    _cached(tiny_server, _chat(SECRET))
    assert _cached(tiny_server, _chat(SECRET, "Hello")) > len(SECRET) // 2


def test_a_prompt_sent_with_cache_prompt_false_is_not_left_for_others(tiny_server: LiveServer) -> None:
    secret = SECRET.replace("7 3 9 1", "2 8 4 6")
    _cached(tiny_server, _chat(secret, cache_prompt=False))
    assert _cached(tiny_server, _chat(secret, "Hello")) == 0


def test_isolated_by_key_another_key_reuses_nothing_and_the_same_key_reuses(by_key: LiveServer) -> None:
    _cached(by_key, _chat(SECRET), key="alice")
    assert _cached(by_key, _chat(SECRET, "Hello"), key="bob") == 0
    _cached(by_key, _chat(SECRET), key="alice")
    assert _cached(by_key, _chat(SECRET, "Hello"), key="alice") > len(SECRET) // 2


def test_isolated_by_key_slots_hide_the_requests(by_key: LiveServer) -> None:
    _cached(by_key, _chat(SECRET, stop=["vault-stop"]), key="alice")
    slots = httpx.get(by_key.url + "/slots", headers={"x-api-key": "bob"}).json()
    assert slots[0]["last_request_id"] is None
    assert slots[0]["n_prompt_tokens"] == 0 and slots[0]["n_cached_tokens"] == 0
    assert "vault-stop" not in str(slots)


def test_both_keys_are_taken_and_others_refused(by_key: LiveServer) -> None:
    for key, status in (("alice", 200), ("bob", 200), ("eve", 401)):
        answer = httpx.get(by_key.url + "/health", headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == status


def test_isolated_by_request_no_prompt_reuses_another(tiny_llama: LoadedModel) -> None:
    server = serve_loaded(tiny_llama, defaults=GREEDY, cache_isolation="request")
    try:
        _cached(server, _chat(SECRET))
        assert _cached(server, _chat(SECRET, "Hello")) == 0
    finally:
        server.stop()
