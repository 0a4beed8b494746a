"""What real clients and evaluation harnesses need from the server (issue 33): the SDKs' models.retrieve,
structured output as vLLM and llama-server do it, forced tool calls that end the turn, prompt log
probabilities, the tokenizer routes, the request log and the key's 401 wording."""

from collections.abc import Iterator

import httpx
import openai
import pytest

from bubo.engine.loaded_model import LoadedModel
from tests.server.live_server import LiveServer, serve_loaded

# GET /v1/models/{id}


def test_the_sdk_retrieves_each_served_model(tiny_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    for model_id in ("tiny-llama-01b", "bubo"):
        model = client.models.retrieve(model_id)
        assert (model.id, model.object, model.owned_by) == (model_id, "model", "bubo")
        assert model.model_extra is not None and model.model_extra["context_length"] == 512
    assert httpx.get(tiny_server.url + "/models/bubo").json()["id"] == "bubo"


def test_an_unknown_model_id_is_404_model_not_found(tiny_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4o")
    assert error.value.code == "model_not_found"
    body = httpx.get(tiny_server.url + "/models/gpt-4o").json()
    assert body["error"]["type"] == "invalid_request_error"
    assert "tiny-llama-01b" in body["error"]["message"]


@pytest.fixture(scope="module")
def slashed_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(tiny_llama, served_model_name="org/tiny")
    yield live
    live.stop()


def test_a_served_name_with_a_slash_is_retrieved(slashed_server: LiveServer) -> None:
    body = httpx.get(slashed_server.url + "/v1/models/org/tiny").json()
    assert body["id"] == "org/tiny"
