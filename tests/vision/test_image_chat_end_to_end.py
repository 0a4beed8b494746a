"""An image chat through a real server (`--mmproj` load path, template, pad expansion, prefill with image
embeddings, rope_delta, prompt cache) against transformers' Qwen3_5ForConditionalGeneration on the same
tiny random model: the greedy tokens of the OpenAI, Anthropic and Responses dialects are the reference's.
"""

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from bubo.engine.sampler import SamplingParams
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState
from tests.fixtures.gguf_writer import byte_level_vocab, write_gguf
from tests.fixtures.mmproj_writer import (
    IMAGE_TOKEN_ID,
    PREPROCESSOR,
    VISION_END_ID,
    VISION_START_ID,
    text_model_of,
    write_mmproj,
)
from tests.server.live_server import LiveServer

MAX_TOKENS = 5
TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "Qwen3.5.jinja"


def _png(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(vl_model: Qwen3_5ForConditionalGeneration, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The tiny model's text half as a qwen35 GGUF whose vocabulary names the vision tokens and whose
    template is Qwen3.5's, its tower as a projector GGUF, served greedily."""
    folder = tmp_path_factory.mktemp("vl-serve")
    tokens, types, merges = byte_level_vocab(300)
    names = {
        IMAGE_TOKEN_ID: "<|image_pad|>",
        VISION_START_ID: "<|vision_start|>",
        VISION_END_ID: "<|vision_end|>",
    }
    replaced = {tokens[i] for i in names}
    merges = [m for m in merges if m.replace(" ", "") not in replaced]
    for i, name in names.items():
        tokens[i], types[i] = name, 3
    text = write_gguf(
        text_model_of(vl_model, Qwen3_5ForCausalLM),
        folder / "text.gguf",
        metadata_overrides={
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.chat_template": TEMPLATE.read_text(),
        },
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    settings = ServerSettings(
        model_path=text, mmproj=write_mmproj(vl_model, folder / "mmproj.gguf"), defaults=greedy, ctx_size=1024
    )
    state = ServerState(settings)
    state.preflight()
    state.load()
    live = LiveServer(state).start()
    yield live
    live.stop()


def _processed(image: bytes) -> dict[str, torch.Tensor]:
    return Qwen2VLImageProcessorPil(**PREPROCESSOR)(
        images=[Image.open(io.BytesIO(image))], return_tensors="pt"
    )


def _image_tokens(image: bytes) -> int:
    """transformers' count of the image's tokens: its patch grid over the 2x2 merge."""
    return int(_processed(image)["image_grid_thw"].prod()) // 4


def _reference(model: Qwen3_5ForConditionalGeneration, ids: list[int], image: bytes) -> list[int]:
    """transformers' greedy continuation of `ids` with `image` at its pad tokens."""
    pixels = Qwen2VLImageProcessorPil(**PREPROCESSOR)(
        images=[Image.open(io.BytesIO(image))], return_tensors="pt"
    )
    input_ids = torch.tensor([ids])
    model.model.rope_deltas = None
    got: list[int] = []
    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
            use_cache=True,
        )
        for _ in range(MAX_TOKENS):
            got.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[got[-1]]]), cache=out.cache, use_cache=True)
    return got


def _cached_ids(live: LiveServer, n: int) -> list[int]:
    """The first `n` token ids the slot's cache holds: the prompt the server ran (template, image pads
    expanded), its image positions (compared by digest there) read back as the pad id."""
    held = live.state.slots.slots[0].cached_token_ids[:n]
    return [t if isinstance(t, int) else IMAGE_TOKEN_ID for t in held]


def _answer_ids(live: LiveServer, token_bytes: list[bytes]) -> list[int]:
    tokenizer = live.state.loaded.tokenizer
    by_bytes = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    return [by_bytes[b] for b in token_bytes]


def test_openai_chat_with_an_image_answers_as_transformers(server: LiveServer, vl_model) -> None:
    image = _png(1, 256, 192)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {
        "model": "bubo",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        "reasoning_effort": "off",
        "logprobs": True,
    }
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    got = [bytes(t["bytes"]) for t in reply["choices"][0]["logprobs"]["content"]]
    prompt = _cached_ids(server, reply["usage"]["prompt_tokens"])
    assert prompt.count(IMAGE_TOKEN_ID) == _image_tokens(image)
    assert _answer_ids(server, got) == _reference(vl_model, prompt, image)

    # The same image again in a longer conversation: its tokens come from the prompt cache.
    follow_up = dict(body)
    follow_up["messages"] = [
        *body["messages"],
        {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Sure?"},
    ]
    again = httpx.post(server.url + "/v1/chat/completions", json=follow_up, timeout=120).json()
    details = again["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] > prompt.index(IMAGE_TOKEN_ID) + prompt.count(IMAGE_TOKEN_ID)
    prompt2 = _cached_ids(server, again["usage"]["prompt_tokens"])
    got2 = [bytes(t["bytes"]) for t in again["choices"][0]["logprobs"]["content"]]
    assert _answer_ids(server, got2) == _reference(vl_model, prompt2, image)


@pytest.mark.parametrize("dialect", ["anthropic", "responses"])
def test_other_dialects_see_the_same_image(server: LiveServer, vl_model, dialect: str) -> None:
    image = _png(2, 128, 320)
    data = base64.b64encode(image).decode()
    if dialect == "anthropic":
        path = "/v1/messages"
        body = {
            "model": "bubo",
            "max_tokens": MAX_TOKENS,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": data},
                        },
                        {"type": "text", "text": "And this?"},
                    ],
                }
            ],
        }
    else:
        path = "/v1/responses"
        body = {
            "model": "bubo",
            "max_output_tokens": MAX_TOKENS,
            "reasoning": {"effort": "none"},
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": "data:image/png;base64," + data},
                        {"type": "input_text", "text": "And this?"},
                    ],
                }
            ],
        }
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    prompt_tokens = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    ids = _cached_ids(server, len(server.state.slots.slots[0].cached_token_ids))
    prompt, answer = ids[:prompt_tokens], ids[prompt_tokens:]
    assert prompt.count(IMAGE_TOKEN_ID) == _image_tokens(image)
    # the cache holds every answer token but the last (sampled, never run)
    assert len(answer) == MAX_TOKENS - 1
    assert answer == _reference(vl_model, prompt, image)[: len(answer)]
