"""`bubo_probe` (bubo/server/probe_fields.py, bubo/engine/probes.py): per-token captures with the answer
in every dialect, JSON and SSE, equal to a trace of the same tokens; refused without --debug-hooks, for
a bad probe and above the size cap; and with --parallel the other requests' answers stay as they are."""

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from bubo.model.trace import Trace
from bubo.server import probe_fields
from tests.server.live_server import LiveServer, serve_loaded
from tests.server.openapi_doc import pointer, response_schema, validator

PROBE = {"router": [0, 1], "logit_lens": [0, 1], "residual_norm": [1], "top_k": 3}
TOKENS = 5
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(tiny_moe: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(tiny_moe, debug_hooks=True, defaults=SamplingParams(temperature=0.0))
    yield live
    live.stop()


# Each dialect's route, a body asking for TOKENS tokens, and where the answer's text is.
DIALECTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "bubo", "messages": MESSAGES, "max_tokens": TOKENS}),
    "completions": ("/v1/completions", {"model": "bubo", "prompt": PROMPT, "max_tokens": TOKENS}),
    "messages": ("/v1/messages", {"model": "bubo", "messages": MESSAGES, "max_tokens": TOKENS}),
    "responses": ("/v1/responses", {"model": "bubo", "input": PROMPT, "max_output_tokens": TOKENS}),
    "llama": ("/completion", {"prompt": PROMPT, "n_predict": TOKENS}),
}


def _sse(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data: ") :])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _post(server: LiveServer, dialect: str, stream: bool, **extra: Any) -> httpx.Response:
    path, body = DIALECTS[dialect]
    return httpx.post(server.url + path, json={**body, "stream": stream, **extra}, timeout=60)


def _probe_of(reply: httpx.Response, stream: bool) -> dict[str, Any]:
    """The answer's probe: in the body, or in a stream's one event that has it (its last but the
    closing ones)."""
    assert reply.status_code == 200, reply.text
    if not stream:
        return reply.json()["bubo_probe"]
    found = [
        event
        for event in _sse(reply.text)
        if "bubo_probe" in event or "bubo_probe" in event.get("response", {})
    ]
    assert len(found) == 1
    return found[0].get("bubo_probe") or found[0]["response"]["bubo_probe"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_every_dialect_answers_with_the_probe(server: LiveServer, dialect: str, stream: bool) -> None:
    reply = _post(server, dialect, stream, bubo_probe=PROBE)
    probe = _probe_of(reply, stream)
    assert not list(validator(pointer("components", "schemas", "ProbeResult")).iter_errors(probe))
    if not stream:  # the whole answer is the documented one, bubo_probe included
        schema = response_schema(DIALECTS[dialect][0], "POST", 200)
        assert not list(validator(schema).iter_errors(reply.json()))
    tokens = probe["tokens"]
    assert 1 <= len(tokens) <= TOKENS
    for i, entry in enumerate(tokens):
        assert set(entry) == {"id", "token", "position", "logit_lens", "router", "residual_norm"}
        assert entry["position"] == tokens[0]["position"] + i
        assert set(entry["logit_lens"]) == {"0", "1"} and all(
            len(top) == 3 for top in entry["logit_lens"].values()
        )
        # Greedy: the last layer's lens is the model's output, whose top token is the one chosen.
        assert entry["logit_lens"]["1"][0]["id"] == entry["id"]
        for routed in entry["router"].values():
            assert len(routed) == 2 and abs(sum(r["weight"] for r in routed) - 1) < 1e-5
        assert entry["residual_norm"]["1"] > 0
    # Without the field the answer has none.
    plain = _post(server, dialect, False)
    assert "bubo_probe" not in plain.json()


def test_the_probe_is_a_trace_of_the_same_tokens(server: LiveServer, tiny_moe: LoadedModel) -> None:
    """The captures equal those of one traced pass over the prompt and answer, position for position."""
    reply = _post(server, "llama", False, bubo_probe=PROBE, return_tokens=True)
    answer = reply.json()
    probe = answer["bubo_probe"]["tokens"]
    prompt = tiny_moe.tokenizer.encode(PROMPT)
    generated = [entry["id"] for entry in probe]
    assert generated[: len(answer["tokens"])] == answer["tokens"]
    model = tiny_moe.model
    sequence = torch.tensor([prompt + generated[:-1]])
    with torch.inference_mode(), Trace(model, sites=["residual", "router"]) as trace:
        model(sequence, model.new_cache(max_len=sequence.shape[1]))
    first = len(prompt) - 1
    for i, entry in enumerate(probe):
        at = first + i
        assert entry["position"] == at
        for layer in (0, 1):
            experts = trace["router_experts", layer][0][0, at].tolist()
            weights = trace["router_weights", layer][0][0, at].tolist()
            assert [r["expert"] for r in entry["router"][str(layer)]] == experts
            assert [r["weight"] for r in entry["router"][str(layer)]] == pytest.approx(weights, abs=1e-5)
            residual = trace["residual", layer][0][0, at]
            lens = model.output(model.norm(residual)).float().log_softmax(-1).topk(3)
            assert [t["id"] for t in entry["logit_lens"][str(layer)]] == lens.indices.tolist()
            assert [t["logprob"] for t in entry["logit_lens"][str(layer)]] == pytest.approx(
                lens.values.tolist(), abs=1e-4
            )
        norm = trace["residual", 1][0][0, at].norm().item()
        assert entry["residual_norm"]["1"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize(
    ("probe", "message"),
    [
        ("yes", "bubo_probe: must be an object"),
        ({"router": [0], "attention": [1]}, "bubo_probe.attention: unknown"),
        ({}, "bubo_probe: asks for nothing"),
        ({"router": [2]}, "bubo_probe: router: layer 2 is out of range: the model has 2 layers"),
        ({"logit_lens": [0, 0]}, "bubo_probe.logit_lens: names a layer twice"),
        ({"logit_lens": ["0"]}, "bubo_probe.logit_lens: must be an array of layer numbers"),
        ({"logit_lens": [0], "top_k": 21}, "bubo_probe.top_k: must be an integer from 1 to 20"),
    ],
)
def test_a_bad_probe_is_400(server: LiveServer, probe: Any, message: str) -> None:
    reply = _post(server, "chat", False, bubo_probe=probe)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "invalid_probe" and error["message"].startswith(message)
    assert error["type"] == "invalid_request_error" and error["param"].startswith("bubo_probe")


def test_a_probe_over_the_cap_is_400(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 tokens x (2 lens layers x 3 + 2 router layers x 2 experts + 1 norm) = 55 values.
    monkeypatch.setattr(probe_fields, "MAX_PROBE_VALUES", 54)
    reply = _post(server, "completions", False, bubo_probe=PROBE)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "probe_too_large"
    assert "5 tokens x 11 values a token is 55 values, over the cap of 54" in error["message"]
    monkeypatch.setattr(probe_fields, "MAX_PROBE_VALUES", 55)
    assert _post(server, "completions", False, bubo_probe=PROBE).status_code == 200


def test_refused_without_debug_hooks(tiny_server: LiveServer) -> None:
    body = {"model": "bubo", "messages": MESSAGES, "max_tokens": 2, "bubo_probe": {"logit_lens": [0]}}
    reply = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "debug_hooks_disabled"
    assert "--debug-hooks" in reply.json()["error"]["message"]
    anthropic = httpx.post(tiny_server.url + "/v1/messages", json=body, timeout=60)
    assert anthropic.status_code == 400
    assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["code"] == "debug_hooks_disabled"


def test_other_requests_are_unchanged_beside_a_probe_with_parallel(tiny_moe: LoadedModel) -> None:
    """Two slots: a short probed request and two longer plain ones at once, so the probe runs while the
    others decode; every answer, the probe's included, is what it is alone."""
    questions = [f"question {i}" for i in range(3)]

    def body(i: int) -> dict[str, Any]:
        probe = {"bubo_probe": PROBE, "max_tokens": 8} if i == 0 else {"max_tokens": 40}
        return {"model": "bubo", "prompt": questions[i], "ignore_eos": True, **probe}

    def ask(live: LiveServer, payload: dict[str, Any]) -> dict[str, Any]:
        reply = httpx.post(live.url + "/v1/completions", json=payload, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    alone = serve_loaded(tiny_moe, debug_hooks=True, defaults=SamplingParams(temperature=0.0))
    try:
        expected = [ask(alone, body(i)) for i in range(3)]
    finally:
        alone.stop()
    live = serve_loaded(tiny_moe, parallel=2, debug_hooks=True, defaults=SamplingParams(temperature=0.0))
    try:
        results: dict[int, dict[str, Any]] = {}
        start = threading.Barrier(3)

        def run(i: int) -> None:
            start.wait()
            results[i] = ask(live, body(i))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        metrics = httpx.get(live.url + "/metrics").text
    finally:
        live.stop()
    busy = next(line for line in metrics.splitlines() if line.startswith("llamacpp:n_busy_slots_per_decode"))
    assert float(busy.split()[-1]) > 1.0  # decode passes carried both slots' steps
    assert [results[i]["choices"][0]["text"] for i in range(3)] == [e["choices"][0]["text"] for e in expected]
    assert len(results[0]["bubo_probe"]["tokens"]) == 8
    _assert_same_probe(results[0]["bubo_probe"], expected[0]["bubo_probe"])
    assert all("bubo_probe" not in results[i] for i in (1, 2))


def _assert_same_probe(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Equal but for float32 rounding (the batch shapes differ)."""
    for a, b in zip(got["tokens"], expected["tokens"], strict=True):
        assert (a["id"], a["position"]) == (b["id"], b["position"])
        for layer, routed in a["router"].items():
            assert [r["expert"] for r in routed] == [r["expert"] for r in b["router"][layer]]
        for layer, top in a["logit_lens"].items():
            assert [t["logprob"] for t in top] == pytest.approx(
                [t["logprob"] for t in b["logit_lens"][layer]], abs=1e-4
            )
