"""Server fixtures: a tiny random llama GGUF (fast, real decoder), the default model, live servers."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from bubo.engine.loaded_model import LoadedModel, load_model
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.server.live_server import LiveServer, serve_loaded


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama with random weights, the fixture byte-level vocabulary and a ChatML template."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    randomize_(model, seed=3)
    return write_gguf(model, tmp_path_factory.mktemp("server") / "Tiny-Llama-0.1B.gguf")


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_path: Path) -> LoadedModel:
    return load_model(tiny_llama_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> LoadedModel:
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    """A server on the tiny model with default settings (greedy by default, so outputs repeat)."""
    from bubo.engine.sampler import SamplingParams

    server = serve_loaded(tiny_llama, defaults=SamplingParams(temperature=0.0, max_tokens=16))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    """A server on the default model with the server's default settings."""
    server = serve_loaded(smollm2)
    yield server
    server.stop()
