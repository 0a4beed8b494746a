"""The debug hooks: absent by default; with --debug-hooks, the rendered prompt, the cache, the settings."""

from collections.abc import Iterator

import httpx
import pytest
import torch

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from tests.server.live_server import LiveServer, scripted, serve_loaded

KEY = "s3cret-debug-key"
MODEL_ID = "tiny-llama-01b"
CHAT = {
    "model": "bubo",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
}
DEBUG_PATHS = (("POST", "/debug/prompt"), ("GET", "/debug/cache"), ("GET", "/debug/settings"))


@pytest.fixture(scope="module")
def server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(
        scripted(tiny_llama, "Short answer."),
        debug_hooks=True,
        api_key=KEY,
        defaults=SamplingParams(temperature=0.0, max_tokens=16),
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_absent_without_debug_hooks(tiny_server: LiveServer) -> None:
    with httpx.Client(base_url=tiny_server.url, timeout=10) as c:
        for method, path in DEBUG_PATHS:
            response = c.request(method, path, json=CHAT if method == "POST" else None)
            assert response.status_code == 404, path
            assert response.json()["error"]["code"] == "not_found"


def test_need_the_api_key(server: LiveServer) -> None:
    response = httpx.get(server.url + "/debug/settings", timeout=10)
    assert response.status_code == 401


def test_prompt_is_what_generation_uses(client: httpx.Client, server: LiveServer) -> None:
    debug = client.post("/debug/prompt", json=CHAT).json()
    applied = client.post("/apply-template", json=CHAT).json()["prompt"]
    assert debug["prompt"] == applied
    assert debug["prompt"].endswith("<|im_start|>assistant\n")
    assert debug["tokens"] == server.state.tokenize(applied)
    assert debug["n_tokens"] == len(debug["tokens"])
    # The tiny model's ChatML template knows no <think>: no reasoning to split off.
    assert debug["reasoning"] is False and debug["in_reasoning"] is False
    chat = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).json()
    assert chat["usage"]["prompt_tokens"] == debug["n_tokens"]


def test_every_dialect_renders_without_the_generation_prompt_alike(client: httpx.Client) -> None:
    closed = {"add_generation_prompt": False}
    debug = client.post("/debug/prompt", json={**CHAT, **closed}).json()
    assert debug["prompt"] == client.post("/apply-template", json={**CHAT, **closed}).json()["prompt"]
    assert debug["prompt"].endswith("Hello there<|im_end|>\n")
    chat = client.post("/v1/chat/completions", json={**CHAT, **closed, "max_tokens": 2}).json()
    assert chat["usage"]["prompt_tokens"] == debug["n_tokens"]
    # The other dialects take it in chat_template_kwargs.
    kwargs = {"chat_template_kwargs": closed}
    system, user = (m["content"] for m in CHAT["messages"])
    anthropic = {"model": "bubo", "system": system, "messages": [{"role": "user", "content": user}], **kwargs}
    counted = client.post("/v1/messages/count_tokens", json=anthropic).json()
    assert counted == {"input_tokens": debug["n_tokens"]}
    message = client.post("/v1/messages", json={**anthropic, "max_tokens": 2}).json()
    usage = message["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == debug["n_tokens"]
    responses = {"model": "bubo", "instructions": system, "input": user, "max_output_tokens": 2, **kwargs}
    answer = client.post("/v1/responses", json=responses).json()
    assert answer["usage"]["input_tokens"] == debug["n_tokens"]


def test_prompt_errors(client: httpx.Client) -> None:
    response = client.post("/debug/prompt", json={"messages": []})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "missing_messages"


def test_cache_after_a_shared_prefix(client: httpx.Client, server: LiveServer) -> None:
    prompts = ("The quick brown fox jumps over", "The quick brown fox runs far away")
    ids = [server.state.tokenize(p) for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    first = client.post("/completion", json={"prompt": prompts[0]}).json()
    first_cache = client.get("/debug/cache").json()
    second = client.post("/completion", json={"prompt": prompts[1]}).json()
    cache = client.get("/debug/cache").json()

    report = cache["last_cache_report"]
    assert report == second["usage"]["gufo"]["options"]
    assert report["cache_hit"] is True
    assert report["cache_miss_reason"] is None
    assert shared > 2
    assert report["cached_tokens"] == second["tokens_cached"] == shared
    assert cache["n_ctx"] == 512
    assert cache["can_rewind"] is True
    assert cache["last_prompt_tokens"] == second["tokens_evaluated"]
    # The cache holds the prompt and every sampled token but the final end token.
    assert cache["cached_tokens"] == second["tokens_evaluated"] + second["tokens_predicted"] - 1
    assert cache["last_request_id"].startswith("req_")
    assert cache["last_request_id"] != first_cache["last_request_id"]
    assert first_cache["last_cache_report"] == first["usage"]["gufo"]["options"]
    assert first_cache["last_cache_report"]["cache_hit"] is False


def test_settings(client: httpx.Client, server: LiveServer, tiny_llama: LoadedModel) -> None:
    response = client.get("/debug/settings")
    assert response.status_code == 200
    assert KEY not in response.text
    settings = response.json()
    assert settings["api_key_set"] is True
    assert settings["host"] == "127.0.0.1"
    assert settings["port"] == server.state.settings.port
    assert settings["model_path"] == str(tiny_llama.path)
    assert settings["model_id"] == MODEL_ID
    assert settings["served_ids"] == [MODEL_ID, "bubo"]
    assert settings["ready"] is True
    assert settings["ctx_size"] is None
    assert settings["n_ctx"] == 512
    assert settings["dtype"] == "float32"
    assert settings["device"] == "cpu"
    assert settings["debug_hooks"] is True
    assert settings["torch_threads"] == torch.get_num_threads()
    defaults = settings["sampling_defaults"]
    assert defaults["temperature"] == 0.0
    assert defaults["max_tokens"] == 16
    assert defaults["top_k"] == 40
    assert defaults["logit_bias"] == []
    assert settings["versions"]["torch"] == torch.__version__
