"""The hybrid architectures served over HTTP: a tiny qwen35moe and a tiny qwen4exp answer chat
requests, and the slot's cache handles their recurrent state honestly — a prompt that does not
extend everything the cache holds cannot rewind a DeltaNet state, so it is recomputed from the start
(`cache_miss_reason` "no_snapshot") and gives the same greedy answer as the first time."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

from bubo.engine.loaded_model import load_model
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
def hybrid_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    writer = _qwen35moe if request.param == "qwen35moe" else _qwen4exp
    loaded = load_model(writer(tmp_path_factory.mktemp("hybrid") / f"tiny-{request.param}.gguf"))
    server = serve_loaded(loaded, defaults=SamplingParams(temperature=0.0, max_tokens=6))
    yield server
    server.stop()


def test_a_hybrid_model_answers_and_resets_its_recurrent_state(hybrid_server: LiveServer) -> None:
    assert not hybrid_server.state.slot.can_rewind
    body = {"model": "bubo", "messages": [{"role": "user", "content": "hello hybrid"}]}
    first = httpx.post(hybrid_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert first["usage"]["completion_tokens"] == 6
    again = httpx.post(hybrid_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    # The cache holds the first prompt and its answer; the same prompt again is shorter, and the
    # recurrent state cannot be cut back to it.
    assert again["usage"]["gufo"]["options"]["cache_hit"] is False
    assert again["usage"]["gufo"]["options"]["cache_miss_reason"] == "no_snapshot"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_prompt_that_extends_the_cache_reuses_it(hybrid_server: LiveServer) -> None:
    """The second prompt is everything the cache holds (the first prompt and the answer's tokens that
    went through the model) plus more: the recurrent state is continued, not recomputed."""
    slot = hybrid_server.state.slot
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
