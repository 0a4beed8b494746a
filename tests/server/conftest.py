"""Server fixtures: a tiny random llama GGUF (fast, real decoder), the default model, live servers."""

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.sampler import SamplingParams
from tests.fixtures.gguf_writer import randomize_, write_gguf
from tests.server.live_server import GATED_TEXT, GatedModel, LiveServer, scripted, serve_loaded

CHAT_TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"


def _tiny_llama(path: Path, context: int, **metadata: str) -> Path:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    randomize_(model, seed=3)
    return write_gguf(model, path, metadata_overrides=metadata)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama with random weights, the fixture byte-level vocabulary and a ChatML template."""
    return _tiny_llama(tmp_path_factory.mktemp("server") / "Tiny-Llama-0.1B.gguf", 512)


@pytest.fixture(scope="session")
def qwen3_template_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny llama with Qwen3's chat template (thinking on by default; `<think>` blocks)."""
    template = (CHAT_TEMPLATES / "Qwen3.jinja").read_text()
    path = tmp_path_factory.mktemp("server") / "Tiny-Qwen3-Template.gguf"
    return load_model(_tiny_llama(path, 2048, **{"tokenizer.chat_template": template}))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_path: Path) -> LoadedModel:
    return load_model(tiny_llama_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> LoadedModel:
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    """A server on the tiny model with default settings (greedy by default, so outputs repeat)."""
    server = serve_loaded(tiny_llama, defaults=SamplingParams(temperature=0.0, max_tokens=16))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    """A server on the default model with the server's default settings."""
    server = serve_loaded(smollm2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gated(tiny_llama: LoadedModel) -> GatedModel:
    """A model that writes GATED_TEXT, each decode step waiting for `gated.gate` to be open."""
    return GatedModel(scripted(tiny_llama, GATED_TEXT).model)


@pytest.fixture(scope="module")
def gated_server(tiny_llama: LoadedModel, gated: GatedModel) -> Iterator[LiveServer]:
    live = serve_loaded(
        replace(tiny_llama, model=gated), defaults=SamplingParams(temperature=0.0, max_tokens=64)
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def gated_client(gated_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gated_server.url, timeout=30) as client:
        yield client
