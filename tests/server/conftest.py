"""Server fixtures: live servers on the tiny models (tests/conftest.py) and the default model."""

from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from tests.server.live_server import GATED_TEXT, GatedModel, LiveServer, scripted, serve_loaded


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
