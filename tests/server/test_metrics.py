"""GET /metrics: Prometheus text under llama-server's names, values that follow the slot's work."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from bubo.engine.loaded_model import LoadedModel
from tests.server.live_server import GatedModel, LiveServer, scripted, serve_loaded

TEXT = "Counting: one two three."

COUNTERS = (
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:prompt_seconds_total",
    "llamacpp:tokens_predicted_total",
    "llamacpp:tokens_predicted_seconds_total",
    "llamacpp:n_decode_total",
    "llamacpp:spec_decode_num_draft_tokens_total",
    "llamacpp:spec_decode_num_accepted_tokens_total",
    "llamacpp:draft_tokens_total",
    "llamacpp:draft_tokens_accepted_total",
    "llamacpp:draft_verify_steps_total",
    "bubo_requests_total",
    "bubo_requests_deferred_total",
    "bubo_images_encoded_total",
)
GAUGES = (
    "llamacpp:prompt_tokens_seconds",
    "llamacpp:predicted_tokens_seconds",
    "llamacpp:n_busy_slots_per_decode",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "llamacpp:kv_cache_usage_ratio",
    "llamacpp:kv_cache_tokens",
    "llamacpp:n_tokens_max",
    "llamacpp:draft_acceptance_rate",
    "llamacpp:draft_mean_accept_len",
)


def settled(gated_client: httpx.Client) -> dict[str, float]:
    """A scrape once the slot has let go of its last request: the slot counts a request as processing
    until its worker thread is done, which can be a moment after the answer went out."""
    deadline = time.monotonic() + 5
    while (values := scrape(gated_client)[0])["llamacpp:requests_processing"] > 0:
        assert time.monotonic() < deadline, "the slot never became idle"
        time.sleep(0.01)
    return values


def scrape(gated_client: httpx.Client, path: str = "/metrics") -> tuple[dict[str, float], dict[str, str]]:
    """The samples (name -> value) and the declared types (name -> type) of one scrape."""
    response = gated_client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    values: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in response.text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.removeprefix("# TYPE ").split()
            types[name] = kind
        elif line and not line.startswith("#"):
            name, value = line.split()
            values[name] = float(value)
    return values, types


def test_exposes_the_llama_server_names(gated_client: httpx.Client) -> None:
    for path in ("/metrics", "/v1/metrics"):
        values, types = scrape(gated_client, path)
        # Exactly these names: prometheus-client must not add or double a `_total` suffix.
        assert set(values) == set(COUNTERS) | set(GAUGES)
        assert {types[n] for n in COUNTERS} == {"counter"}
        assert {types[n] for n in GAUGES} == {"gauge"}


def test_values_follow_a_request(gated_client: httpx.Client) -> None:
    before = settled(gated_client)
    body = gated_client.post("/completion", json={"prompt": "Metrics prompt, fresh:"}).json()
    after = settled(gated_client)
    usage = body["usage"]
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    delta = {name: after[name] - before[name] for name in COUNTERS}
    assert computed > 0
    assert delta["llamacpp:prompt_tokens_total"] == computed
    assert delta["llamacpp:tokens_predicted_total"] == usage["completion_tokens"] > 1
    # Every generated token but the first needed one decode call.
    assert delta["llamacpp:n_decode_total"] == usage["completion_tokens"] - 1
    assert delta["llamacpp:prompt_seconds_total"] == pytest.approx(body["timings"]["prompt_ms"] / 1000)
    assert delta["llamacpp:tokens_predicted_seconds_total"] == pytest.approx(
        body["timings"]["predicted_ms"] / 1000
    )
    assert delta["llamacpp:spec_decode_num_draft_tokens_total"] == 0
    assert after["llamacpp:prompt_tokens_seconds"] == pytest.approx(
        after["llamacpp:prompt_tokens_total"] / after["llamacpp:prompt_seconds_total"]
    )
    assert after["llamacpp:predicted_tokens_seconds"] == pytest.approx(
        after["llamacpp:n_decode_total"] / after["llamacpp:tokens_predicted_seconds_total"]
    )
    # The cache holds the prompt and every sampled token but the final end token.
    cached = body["tokens_evaluated"] + body["tokens_predicted"] - 1
    assert after["llamacpp:kv_cache_tokens"] == cached
    assert after["llamacpp:kv_cache_usage_ratio"] == pytest.approx(cached / 512)
    assert after["llamacpp:n_busy_slots_per_decode"] == 1.0
    assert after["llamacpp:requests_deferred"] == 0


def test_processing_and_deferred(
    gated_client: httpx.Client, gated_server: LiveServer, gated: GatedModel
) -> None:
    gated.gate.clear()
    try:
        with (
            ThreadPoolExecutor(1) as pool,
            gated_client.stream(
                "POST", "/completion", json={"prompt": "First in line:", "stream": True}
            ) as first,
        ):
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            # The first request holds the slot (its decode waits on the gate); the second must wait.
            second = pool.submit(
                httpx.post, gated_server.url + "/completion", json={"prompt": "Second in line:"}, timeout=30
            )
            deadline = time.monotonic() + 10
            while (values := scrape(gated_client)[0])["llamacpp:requests_deferred"] < 1:
                assert time.monotonic() < deadline, "the second request was never deferred"
                time.sleep(0.02)
            assert values["llamacpp:requests_deferred"] == 1
            assert values["llamacpp:requests_processing"] == 1
            deferred_before = values["bubo_requests_deferred_total"]
            gated.gate.set()
            last = json.loads(
                [line for line in lines if line.startswith("data: ")][-1].removeprefix("data: ")
            )
            assert last["stop_type"] == "eos"
            assert second.result().json()["stop_type"] == "eos"
    finally:
        gated.gate.set()
    after = settled(gated_client)
    assert after["llamacpp:requests_deferred"] == 0
    # The wait is over, but it happened: the counter keeps it.
    assert after["bubo_requests_deferred_total"] == deferred_before >= 1


def test_each_server_counts_its_own(gated_client: httpx.Client, tiny_llama: LoadedModel) -> None:
    gated_client.post("/completion", json={"prompt": "Make the totals move:"})
    busy, _ = scrape(gated_client)
    fresh = serve_loaded(scripted(tiny_llama, TEXT))
    try:
        with httpx.Client(base_url=fresh.url, timeout=10) as other:
            values, _ = scrape(other)
    finally:
        fresh.stop()
    assert busy["llamacpp:prompt_tokens_total"] > 0
    assert values["llamacpp:prompt_tokens_total"] == 0
    assert values["llamacpp:kv_cache_tokens"] == 0


def test_not_ready_while_loading(tiny_llama: LoadedModel) -> None:
    loading = serve_loaded(None, model_path=tiny_llama.path)
    try:
        response = httpx.get(loading.url + "/metrics", timeout=10)
    finally:
        loading.stop()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "not_ready"
    assert response.headers["Retry-After"] == "5"
