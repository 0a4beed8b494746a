"""Image parts over HTTP: the three dialects' image parts reach the engine as image tokens (the template's
pad token repeated per image token, the image inputs handed to the prefill), a model without a tower
refuses them, bad images are 400 in each dialect's shape, images that cannot fit are 507, count_tokens
refuses images, the model list shows the image modality only with a tower, and a resent image is
taken from the prompt cache.

The model is a tiny llama whose vocabulary has Qwen's vision tokens and whose template is Qwen3.5's,
with its decoder replaced by a recording double and the contract's test-double tower attached.
"""

import base64
import resource
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.sampler import SamplingParams
from bubo.server.image_input import ImageLimits
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState
from tests.conftest import CHAT_TEMPLATES
from tests.fixtures.gguf_writer import byte_level_vocab, randomize_, write_gguf
from tests.fixtures.vision_doubles import (
    FakeTower,
    RecordingModel,
    png,
)
from tests.server.live_server import LiveServer, scripted, serve_loaded

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
RED = png(32, 32, (255, 0, 0))  # 4 image tokens with the test tower
BLUE = png(32, 32, (0, 0, 255))
GREEN = png(32, 32, (0, 255, 0))


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vision_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny llama with <|vision_start|>, <|image_pad|>, <|vision_end|> added to its vocabulary and
    Qwen3.5's template."""
    tokens, types, merges = byte_level_vocab(320)
    tokens += VISION_TOKENS
    types += [3] * len(VISION_TOKENS)  # control tokens
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokens),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    randomize_(model, seed=3)
    path = tmp_path_factory.mktemp("vision") / "Tiny-Vision-Llama.gguf"
    overrides = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.chat_template": (CHAT_TEMPLATES / "Qwen3.5.jinja").read_text(),
    }
    return load_model(write_gguf(model, path, metadata_overrides=overrides))


@dataclass
class VisionServer:
    live: LiveServer
    model: RecordingModel
    tower: FakeTower

    @property
    def url(self) -> str:
        return self.live.url

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=30)


def _serve(loaded: LoadedModel, **settings: Any) -> VisionServer:
    answer = scripted(loaded, "It is red.").model.script
    model = RecordingModel(loaded.config, answer=answer)
    tower = FakeTower()
    state = ServerState(ServerSettings(model_path=loaded.path, defaults=GREEDY, **settings))
    state.attach(replace(loaded, model=model), tower)
    return VisionServer(LiveServer(state).start(), model, tower)


@pytest.fixture(scope="module")
def server(vision_llama: LoadedModel) -> Iterator[VisionServer]:
    live = _serve(vision_llama)
    yield live
    live.live.stop()


@pytest.fixture(scope="module")
def text_server(vision_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(vision_llama, defaults=GREEDY)
    yield live
    live.stop()


def _chat(image_part: dict[str, Any], text: str = "What color is this?") -> dict[str, Any]:
    content = [{"type": "text", "text": text}, image_part]
    return {"model": "bubo", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def _openai(data: bytes) -> dict[str, Any]:
    return _chat({"type": "image_url", "image_url": {"url": _data_url(data)}})


def _anthropic(data: bytes) -> dict[str, Any]:
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(data)}}
    return {
        **_chat(block),
        "messages": [{"role": "user", "content": [block, {"type": "text", "text": "Color?"}]}],
    }


def _responses(data: bytes) -> dict[str, Any]:
    content = [
        {"type": "input_text", "text": "Color?"},
        {"type": "input_image", "image_url": _data_url(data)},
    ]
    return {"model": "bubo", "input": [{"role": "user", "content": content}], "max_output_tokens": 4}


DIALECTS = {
    "/v1/chat/completions": _openai,
    "/v1/messages": _anthropic,
    "/v1/responses": _responses,
}


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    return body["error"]


def _image_prefills(model: RecordingModel) -> list[Any]:
    return [f for f in model.forwards if f.multimodal is not None]


@pytest.mark.parametrize("path", DIALECTS)
def test_each_dialects_image_reaches_the_prefill_as_image_tokens(server: VisionServer, path: str) -> None:
    server.model.forwards.clear()
    response = server.post(path, DIALECTS[path](RED))
    assert response.status_code == 200, response.text
    (prefill,) = _image_prefills(server.model)
    pad = prefill.tokens[int(prefill.multimodal.rows[0])]
    rows = prefill.multimodal.rows.tolist()
    assert [prefill.tokens[r] for r in rows] == [pad] * 4
    assert rows == list(range(rows[0], rows[0] + 4))
    # The template's <|vision_start|> and <|vision_end|> around the four pad tokens.
    assert prefill.tokens.count(pad) == 4
    assert prefill.multimodal.embeds[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert prefill.multimodal.positions.shape == (3, len(prefill.tokens))


def test_usage_counts_the_image_tokens(server: VisionServer) -> None:
    text = "What color is this?"
    text_only = {"model": "bubo", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    without = server.post("/v1/chat/completions", text_only).json()["usage"]["prompt_tokens"]
    with_image = server.post("/v1/chat/completions", _openai(RED)).json()["usage"]["prompt_tokens"]
    # The image adds <|vision_start|>, 4 pad tokens and <|vision_end|>.
    assert with_image == without + 6


def _images_encoded(server: VisionServer) -> float:
    """bubo_images_encoded_total from /metrics."""
    lines = httpx.get(server.url + "/metrics", timeout=30).text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith("bubo_images_encoded_total ")))


def test_a_resent_image_comes_from_the_prompt_cache(server: VisionServer) -> None:
    # An image no other test sends, so the first request has it uncached.
    server.model.forwards.clear()
    counted = _images_encoded(server)
    first = server.post("/v1/chat/completions", _openai(GREEN)).json()
    assert _images_encoded(server) == counted + 1
    (prefill,) = _image_prefills(server.model)
    image_end = prefill.start + int(prefill.multimodal.rows[-1]) + 1
    encoded = len(server.tower.encoded)
    turn = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    follow_up = [turn, {"role": "user", "content": "And now?"}]
    body = _openai(GREEN)
    body["messages"] += follow_up
    server.model.forwards.clear()
    second = server.post("/v1/chat/completions", body).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_end
    assert len(server.tower.encoded) == encoded and not _image_prefills(server.model)
    assert _images_encoded(server) == counted + 1  # the cached image is not counted again
    other = _openai(BLUE)
    other["messages"] += follow_up
    third = server.post("/v1/chat/completions", other).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == image_end - 4  # up to the image
    assert len(server.tower.encoded) == encoded + 1
    assert _images_encoded(server) == counted + 2


@pytest.mark.parametrize("path", DIALECTS)
def test_a_model_without_a_tower_refuses_image_parts(text_server: LiveServer, path: str) -> None:
    response = httpx.post(text_server.url + path, json=DIALECTS[path](RED), timeout=30)
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "unsupported_content"
    assert "text only" in error["message"]


@pytest.mark.parametrize("path", DIALECTS)
def test_a_corrupt_image_is_400_in_the_dialects_shape(server: VisionServer, path: str) -> None:
    response = server.post(path, DIALECTS[path](b"\x89PNG\r\n\x1a\n broken"))
    assert response.status_code == 400
    body = response.json()
    assert body["error"]["code"] == "invalid_image"
    assert ("type" in body and body["type"] == "error") == (path == "/v1/messages")
    assert "content[" in body["error"]["message"]


def test_an_image_over_the_byte_limit_is_400(vision_llama: LoadedModel) -> None:
    small = _serve(vision_llama, image_limits=ImageLimits(max_bytes=64))
    try:
        response = small.post("/v1/chat/completions", _openai(RED))
        assert response.status_code == 400
        assert _error(response)["code"] == "image_too_large"
    finally:
        small.live.stop()


@pytest.mark.parametrize("path", DIALECTS)
def test_images_whose_tokens_cannot_fit_are_507(vision_llama: LoadedModel, path: str) -> None:
    small = _serve(vision_llama, ctx_size=64)
    try:
        # 128x128: 64 image tokens, more than the whole context.
        response = small.post(path, DIALECTS[path](png(128, 128)))
        assert response.status_code == 507
        assert _error(response)["code"] == "insufficient_memory_permanent"
        assert "Retry-After" not in response.headers
    finally:
        small.live.stop()


def test_images_that_cannot_fit_are_refused_from_their_headers_before_decoding(
    vision_llama: LoadedModel,
) -> None:
    """Four 6000x6000 PNGs (100 KB each, 108 MB of pixels each once decoded): 507 from their sizes,
    the process's peak memory barely moving (they were all decoded first, and kept)."""
    huge = png(6000, 6000)
    content = [{"type": "text", "text": "Colors?"}]
    content += [{"type": "image_url", "image_url": {"url": _data_url(huge)}}] * 4
    body = {"model": "bubo", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    live = _serve(vision_llama)
    try:
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        response = live.post("/v1/chat/completions", body)
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
        assert response.status_code == 507
        assert _error(response)["code"] == "insufficient_memory_permanent"
        assert grown_mib < 64, f"the process peak grew by {grown_mib:.0f} MiB"
    finally:
        live.live.stop()


def test_an_image_that_needs_more_memory_than_the_machine_has_is_507(vision_llama: LoadedModel) -> None:
    from bubo.server.memory_guard import MemoryInfo

    class SmallMachine:
        def read(self) -> MemoryInfo:
            return MemoryInfo(available=200 << 20, total=200 << 20)

    answer = scripted(vision_llama, "red").model.script
    state = ServerState(
        ServerSettings(model_path=vision_llama.path, defaults=GREEDY), memory_probe=SmallMachine()
    )
    state.attach(replace(vision_llama, model=RecordingModel(vision_llama.config, answer=answer)), FakeTower())
    live = LiveServer(state).start()
    try:
        fits = httpx.post(live.url + "/v1/chat/completions", json=_openai(RED), timeout=30)
        assert fits.status_code == 200
        # 512x512: 1024 image tokens (they fit in the context) from 4096 patches, whose attention
        # scores alone take about 1 GiB.
        huge = httpx.post(live.url + "/v1/chat/completions", json=_openai(png(512, 512)), timeout=30)
        assert huge.status_code == 507
        assert _error(huge)["code"] == "insufficient_memory_permanent"
    finally:
        live.stop()


def test_http_image_urls_are_refused_unless_allowed(server: VisionServer) -> None:
    body = _chat({"type": "image_url", "image_url": {"url": "https://images.example/cat.png"}})
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "image_url_not_allowed" and "--allow-image-urls" in error["message"]


def test_allowed_image_urls_still_never_reach_loopback(vision_llama: LoadedModel) -> None:
    allowed = _serve(vision_llama, allow_image_urls=True)
    try:
        for url in ("http://127.0.0.1:9/cat.png", "http://localhost:9/cat.png", "http://[::1]/cat.png"):
            body = _chat({"type": "image_url", "image_url": {"url": url}})
            response = allowed.post("/v1/chat/completions", body)
            assert response.status_code == 400, url
            assert _error(response)["code"] == "image_url_not_allowed", url
    finally:
        allowed.live.stop()


def test_count_tokens_refuses_images_even_with_a_tower(server: VisionServer) -> None:
    body = _anthropic(RED)
    body.pop("max_tokens")
    response = server.post("/v1/messages/count_tokens", body)
    assert response.status_code == 400
    assert _error(response)["code"] == "unsupported_content"
    assert response.json()["type"] == "error"


@pytest.mark.parametrize(
    "message",
    [
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": _data_url(RED)}}]},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _data_url(RED)}}]},
    ],
)
def test_images_are_taken_in_user_messages_only(server: VisionServer, message: dict[str, Any]) -> None:
    body = {"model": "bubo", "messages": [message, {"role": "user", "content": "hi"}]}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 400
    assert _error(response)["code"] == "unsupported_content"


def test_a_pad_token_typed_in_text_is_400(server: VisionServer) -> None:
    body = _chat({"type": "image_url", "image_url": {"url": _data_url(RED)}}, text="<|image_pad|>")
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 400
    assert _error(response)["code"] == "image_placeholder_mismatch"


def test_apply_template_shows_one_placeholder_per_image(server: VisionServer) -> None:
    body = _openai(RED)
    response = server.post("/apply-template", body)
    assert response.status_code == 200
    assert "<|vision_start|><|image_pad|><|vision_end|>" in response.json()["prompt"]


def test_the_image_modality_is_listed_only_with_a_tower(
    server: VisionServer, text_server: LiveServer
) -> None:
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert all(m["architecture"]["input_modalities"] == ["text", "image"] for m in models)
    assert httpx.get(server.url + "/props").json()["modalities"]["vision"] is True
    models = httpx.get(text_server.url + "/v1/models").json()["data"]
    assert all(m["architecture"]["input_modalities"] == ["text"] for m in models)
    assert httpx.get(text_server.url + "/props").json()["modalities"]["vision"] is False


def test_mmproj_is_checked_before_the_port_opens(vision_llama: LoadedModel, tmp_path: Path) -> None:
    missing = ServerState(ServerSettings(model_path=vision_llama.path, mmproj=tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="--mmproj"):
        missing.preflight()
    # The text model's own file is no vision projector.
    wrong = ServerState(ServerSettings(model_path=vision_llama.path, mmproj=vision_llama.path))
    with pytest.raises(ValueError, match="not 'clip'"):
        wrong.preflight()


def test_text_too_long_for_the_context_stays_400_with_an_image(vision_llama: LoadedModel) -> None:
    small = _serve(vision_llama, ctx_size=64)
    try:
        body = _chat({"type": "image_url", "image_url": {"url": _data_url(RED)}}, text="words " * 80)
        response = small.post("/v1/chat/completions", body)
        assert response.status_code == 400
        assert _error(response)["code"] == "context_length_exceeded"
    finally:
        small.live.stop()


def test_more_images_than_allowed_are_400(vision_llama: LoadedModel) -> None:
    small = _serve(vision_llama, image_limits=ImageLimits(max_images=1))
    try:
        body = _openai(RED)
        body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": _data_url(BLUE)}})
        response = small.post("/v1/chat/completions", body)
        assert response.status_code == 400
        error = _error(response)
        assert error["code"] == "too_many_images" and "content[2]" in error["message"]
    finally:
        small.live.stop()


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        (
            "/v1/messages",
            {
                "model": "bubo",
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "https://a.example/b.png"}}
                        ],
                    }
                ],
            },
            "image_url_not_allowed",
        ),
        (
            "/v1/messages",
            {
                "model": "bubo",
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "toolu_1", "name": "look", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "toolu_1",
                                "content": [
                                    {
                                        "type": "image",
                                        "source": {
                                            "type": "base64",
                                            "media_type": "image/png",
                                            "data": _b64(RED),
                                        },
                                    }
                                ],
                            }
                        ],
                    },
                ],
            },
            "unsupported_content",
        ),
        (
            "/v1/messages",
            {
                "model": "bubo",
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ],
            },
            "invalid_value",
        ),
        (
            "/v1/responses",
            {
                "model": "bubo",
                "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}],
            },
            "unsupported_content",
        ),
    ],
)
def test_image_sources_bubo_cannot_take_are_400(
    server: VisionServer, path: str, body: dict[str, Any], code: str
) -> None:
    response = server.post(path, body)
    assert response.status_code == 400
    assert _error(response)["code"] == code
