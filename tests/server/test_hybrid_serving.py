"""The hybrid architectures served over HTTP: a tiny qwen35moe and a tiny qwen4exp answer chat
requests, and the prompt cache handles their recurrent state: a prompt that extends the cache
continues it, one that diverges resumes from the latest state snapshot inside the shared prefix
(taken at turn ends), and without one it is recomputed ("no_snapshot", "evicted"); every path gives
the same greedy answer as computing from scratch."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.prompt_cache import SnapshotPolicy
from bubo.engine.sampler import SamplingParams
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.fixtures.hybrid_models import tiny_hybrid
from tests.fixtures.qwen4exp_gguf import TINY_QWEN4EXP_CONFIG, write_qwen4exp_gguf
from tests.server.live_server import LiveServer, serve_loaded


def _qwen35moe(path: Path) -> Path:
    model = tiny_hybrid(
        "qwen35moe", ["linear_attention", "full_attention"] * 2, vocab_size=320, max_position_embeddings=1024
    )
    randomize_(model)
    return write_gguf(model, path)


def _qwen4exp(path: Path) -> Path:
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**TINY_QWEN4EXP_CONFIG))
    randomize_(model)
    return write_qwen4exp_gguf(model, path)


@pytest.fixture(scope="module", params=["qwen35moe", "qwen4exp"])
def hybrid_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    writer = _qwen35moe if request.param == "qwen35moe" else _qwen4exp
    return load_model(writer(tmp_path_factory.mktemp("hybrid") / f"tiny-{request.param}.gguf"))


@pytest.fixture
def serve(hybrid_model: LoadedModel) -> Iterator:
    servers: list[LiveServer] = []

    def start(policy: SnapshotPolicy | None = None) -> LiveServer:
        server = serve_loaded(
            hybrid_model,
            defaults=SamplingParams(temperature=0.0, max_tokens=6),
            snapshots=policy or SnapshotPolicy(),
        )
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def chat(server: LiveServer, messages: list[dict]) -> dict:
    body = {"model": "bubo", "messages": messages}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()


HELLO = [{"role": "user", "content": "hello hybrid"}]


def _after_last_turn_end(server: LiveServer, messages: list[dict]) -> int:
    """The prompt position just after its last end-of-turn token: where a snapshot is taken."""
    from bubo.engine.chat_request import ChatRequest

    ids = server.state.render_prompt(ChatRequest(messages)).ids
    stops = server.state.loaded.tokenizer.stop_ids
    return max(i + 1 for i, token in enumerate(ids) if token in stops)


def test_a_repeated_prompt_resumes_from_the_turn_end_snapshot(serve) -> None:
    server = serve()
    assert not server.state.slots.slots[0].can_rewind
    first = chat(server, HELLO)
    assert first["usage"]["completion_tokens"] == 6
    again = chat(server, HELLO)
    options = again["usage"]["gufo"]["options"]
    # The cache holds the first prompt and its answer; the state can't be cut back to the shorter
    # prompt, but a snapshot at the end of the user's turn can be restored.
    assert options["cache_hit"] is True and options["cache_miss_reason"] is None
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == _after_last_turn_end(server, HELLO)
    assert options["cache_snapshots"] >= 1
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_debug_cache_lists_the_snapshots(hybrid_model: LoadedModel) -> None:
    server = serve_loaded(
        hybrid_model, defaults=SamplingParams(temperature=0.0, max_tokens=2), debug_hooks=True
    )
    try:
        reply = chat(server, HELLO)
        held = httpx.get(server.url + "/debug/cache").json()
        positions = [s["position"] for s in held["snapshots"]]
        assert positions and _after_last_turn_end(server, HELLO) in positions
        assert all(s["bytes"] > 0 for s in held["snapshots"])
        assert held["snapshot_policy"]["max_snapshots"] == 16 and held["can_rewind"] is False
        assert held["last_cache_report"] == reply["usage"]["gufo"]["options"]
    finally:
        server.stop()


def test_without_snapshots_the_state_is_recomputed(serve) -> None:
    server = serve(SnapshotPolicy(max_snapshots=0))
    first = chat(server, HELLO)
    again = chat(server, HELLO)
    options = again["usage"]["gufo"]["options"]
    assert options["cache_hit"] is False and options["cache_miss_reason"] == "no_snapshot"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_rewritten_answer_is_reported_and_the_user_turn_snapshot_used(serve) -> None:
    """Templates that drop past reasoning re-render the previous answer differently: the prompt
    diverges inside what was generated; the snapshot at the end of the user's turn still serves."""
    server = serve()
    first = chat(server, HELLO)
    history = [
        *HELLO,
        {"role": "assistant", "content": "something else entirely"},
        {"role": "user", "content": "more"},
    ]
    second = chat(server, history)
    options = second["usage"]["gufo"]["options"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert options["cache_history_rewritten"] is True and options["cache_diverged_at"] >= prompt_tokens
    assert options["cache_hit"] is True
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == _after_last_turn_end(server, HELLO)
    cold = serve(SnapshotPolicy(max_snapshots=0))
    assert (
        chat(cold, history)["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    )


def test_the_budget_evicts_the_oldest_snapshots(serve) -> None:
    server = serve(SnapshotPolicy(max_snapshots=1, turn_ends=4))
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    first = chat(server, history)
    assert first["usage"]["gufo"]["options"]["cache_snapshots"] == 1
    assert first["usage"]["gufo"]["options"]["cache_snapshots_skipped"] == 3  # four turn ends, one kept
    # Diverge in the first user turn's text: only an evicted snapshot lay before that point.
    changed = [history[0], {"role": "user", "content": "ONE"}, *history[2:]]
    second = chat(server, changed)
    assert second["usage"]["gufo"]["options"]["cache_miss_reason"] == "evicted"


def test_a_prompt_that_extends_the_cache_reuses_it(serve) -> None:
    """The second prompt is everything the cache holds (the first prompt and the answer's tokens that
    went through the model) plus more: the recurrent state is continued, not recomputed."""
    hybrid_server = serve()
    slot = hybrid_server.state.slots.slots[0]
    tokenizer = hybrid_server.state.loaded.tokenizer
    ids = tokenizer.encode("once upon a time", add_bos=False)
    httpx.post(hybrid_server.url + "/completion", json={"prompt": ids, "n_predict": 4}, timeout=60)
    held = list(slot.cached_token_ids)
    assert held[: len(ids)] == ids and len(held) == len(ids) + 3  # the 4th token was sampled, not fed
    follow = held + tokenizer.encode(" and then", add_bos=False)
    second = httpx.post(
        hybrid_server.url + "/completion", json={"prompt": follow, "n_predict": 2}, timeout=60
    )
    usage = second.json()["usage"]
    assert usage["gufo"]["options"]["cache_hit"] is True
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(held)
    # Continuing the state gives what computing the whole prompt from scratch gives.
    cold = httpx.post(
        hybrid_server.url + "/completion", json={"prompt": follow, "n_predict": 2}, timeout=60
    ).json()
    assert cold["usage"]["gufo"]["options"]["cache_miss_reason"] == "no_snapshot"
    assert cold["content"] == second.json()["content"]
