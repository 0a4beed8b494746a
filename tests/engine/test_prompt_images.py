"""A prompt's images in the engine (bubo/engine/prompt_images.py, the slot's prefill): image inputs
passed for the chunks that hold image tokens, only uncached images encoded, cache.rope_delta set so
text and decode positions continue after the images, and the prompt cache comparing image positions
by the digest of the image bytes. The tower and the decoder are the contract's test doubles.

Expected positions are worked out by hand from Qwen2-VL's rule (text continues at the highest position
so far plus one; a merged h x w image at offset s takes (s, s + row, s + column)).
"""

import asyncio
import hashlib
from dataclasses import dataclass

import pytest
import torch
from PIL import Image

from bubo.engine.batcher import _Call
from bubo.engine.loaded_model import LoadedModel
from bubo.engine.prompt_cache import PromptCache
from bubo.engine.prompt_images import ImageToken, PromptImage, PromptVision, cache_key
from bubo.engine.request import Finished, GenerationRequest
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot import SessionSlot
from bubo.engine.speculative import SpeculativeDecoder
from bubo.model.state import KVCache
from tests.fixtures.vision_doubles import (
    FakeTower,
    RecordingCache,
    RecordingModel,
    png,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
TEXT = [40, 41, 42]
# A 32x32 image: a 2x2 merged grid, 4 tokens, at index 3 of a 9-token prompt.
EXPECTED_POSITIONS = [
    [0, 1, 2, 3, 3, 3, 3, 5, 6],
    [0, 1, 2, 3, 3, 4, 4, 5, 6],
    [0, 1, 2, 3, 4, 3, 4, 5, 6],
]
# Text after the prompt continues at 7 = 9 + (-2).
EXPECTED_DELTA = -2


def _image(color: tuple[int, int, int], size: int = 32) -> PromptImage:
    data = png(size, size, color)
    tokens = (size // 16) ** 2
    return PromptImage(
        len(TEXT),
        (1, size // 8, size // 8),
        tokens,
        hashlib.sha256(data).hexdigest(),
        Image.new("RGB", (size, size), color),
    )


RED, BLUE = _image((255, 0, 0)), _image((0, 0, 255))


def _prompt(image: PromptImage, pad: int, after: list[int]) -> list[int]:
    return TEXT + [pad] * image.tokens + after


@dataclass
class Rig:
    slot: SessionSlot
    model: RecordingModel
    tower: FakeTower
    pad: int


@pytest.fixture
def rig(tiny_llama: LoadedModel) -> Rig:
    model = RecordingModel(tiny_llama.config, answer=[50, 51, 52])
    tower = FakeTower()
    slot = SessionSlot(model, tiny_llama.tokenizer, 128, vision=tower)
    return Rig(slot, model, tower, pad=7)


def _run(slot: SessionSlot, prompt: list[int], images: tuple[PromptImage, ...]) -> Finished:
    request = GenerationRequest("req_test", "", prompt, GREEDY, images=images)

    async def collect() -> Finished:
        events = [event async for event in slot.run(request)]
        assert isinstance(events[-1], Finished)
        return events[-1]

    return asyncio.run(collect())


def test_the_prefill_gets_the_images_rows_embeddings_and_positions(rig: Rig) -> None:
    prompt = _prompt(RED, rig.pad, [60, 61])
    _run(rig.slot, prompt, (RED,))
    prefill = rig.model.forwards[0]
    inputs = prefill.multimodal
    assert prefill.start == 0 and prefill.tokens == prompt
    assert inputs.rows.tolist() == [3, 4, 5, 6]
    # Token k of the red image: 1.0 (mean red / 255) + k in every channel.
    assert inputs.embeds[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert inputs.positions.tolist() == EXPECTED_POSITIONS
    assert rig.tower.encoded == [(1, 4, 4)]


def test_decode_steps_continue_at_the_rope_offset(rig: Rig) -> None:
    _run(rig.slot, _prompt(RED, rig.pad, [60, 61]), (RED,))
    decodes = rig.model.forwards[1:]
    assert decodes and all(f.multimodal is None and f.rope_delta == EXPECTED_DELTA for f in decodes)
    assert rig.slot.prompt_cache.cache.rope_delta == EXPECTED_DELTA


def test_a_resent_image_is_reused_and_not_encoded_again(rig: Rig) -> None:
    first = _prompt(RED, rig.pad, [60, 61])
    finished = _run(rig.slot, first, (RED,))
    ran = first + finished.result.token_ids[:-1]
    rig.model.forwards.clear()
    second = [*ran, 70, 71]
    finished = _run(rig.slot, second, (RED,))
    assert finished.usage.cached_tokens == len(ran)
    prefill = rig.model.forwards[0]
    # The uncached text after the image: no image inputs, positions by the offset.
    assert prefill.start == len(ran) and prefill.multimodal is None
    assert prefill.rope_delta == EXPECTED_DELTA
    assert rig.tower.encoded == [(1, 4, 4)]
    assert rig.slot.stats.images_encoded_total == 1


def test_another_image_of_the_same_size_is_not_reused(rig: Rig) -> None:
    _run(rig.slot, _prompt(RED, rig.pad, [60, 61]), (RED,))
    rig.model.forwards.clear()
    finished = _run(rig.slot, _prompt(BLUE, rig.pad, [60, 61]), (BLUE,))
    assert finished.usage.cached_tokens == len(TEXT)
    assert finished.usage.cache.cache_diverged_at == len(TEXT)
    inputs = rig.model.forwards[0].multimodal
    assert rig.model.forwards[0].start == len(TEXT)
    assert inputs.rows.tolist() == [0, 1, 2, 3]
    assert inputs.embeds[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]  # no red in the blue image
    assert inputs.positions.tolist() == [row[3:] for row in EXPECTED_POSITIONS]
    assert rig.slot.stats.images_encoded_total == 2


def test_a_text_prompt_after_an_image_prompt_has_no_rope_offset(rig: Rig) -> None:
    _run(rig.slot, _prompt(RED, rig.pad, [60, 61]), (RED,))
    rig.model.forwards.clear()
    _run(rig.slot, [*TEXT, 80, 81], ())
    assert all(f.rope_delta == 0 and f.multimodal is None for f in rig.model.forwards)


def test_a_slot_without_a_tower_refuses_images(tiny_llama: LoadedModel) -> None:
    slot = SessionSlot(RecordingModel(tiny_llama.config, answer=[50]), tiny_llama.tokenizer, 64)
    with pytest.raises(ValueError, match="vision tower"):
        _run(slot, _prompt(RED, 7, [60]), (RED,))


def test_chunks_that_split_an_image_get_their_part_and_encode_it_once() -> None:
    tower = FakeTower()
    vision = PromptVision(tower, [RED], 9, torch.device("cpu"))
    cache = RecordingCache(64)
    first = vision.chunk(cache, 0, 5)
    assert first.rows.tolist() == [3, 4]
    assert first.embeds[:, 0].tolist() == [1.0, 2.0]
    assert first.positions.tolist() == [row[:5] for row in EXPECTED_POSITIONS]
    second = vision.chunk(cache, 5, 9)
    assert second.rows.tolist() == [0, 1]
    assert second.embeds[:, 0].tolist() == [3.0, 4.0]
    assert cache.rope_delta == EXPECTED_DELTA
    assert vision.chunk(cache, 0, 3) is None and cache.rope_delta == 0
    assert tower.encoded == [(1, 4, 4)]


def test_image_positions_are_compared_by_the_image_bytes() -> None:
    prompt = TEXT + [7] * 4 + [60]
    red, blue = cache_key(prompt, [RED]), cache_key(prompt, [BLUE])
    assert red[3] == ImageToken(RED.digest, 0) and red[:3] == TEXT and red[-1] == 60
    pc = PromptCache(RecordingCache(64), frozenset())
    pc.cache.length = len(red)
    pc.finish(red, [])
    assert pc.prepare(red).cached_tokens == len(red) - 1
    pc.cache.length = len(red)
    pc.finish(red, [])
    report = pc.prepare(blue)
    assert report.cached_tokens == len(TEXT) and report.cache_diverged_at == len(TEXT)


def test_a_forward_with_image_inputs_is_never_batched() -> None:
    cache = KVCache(1, 1, 1, 8, 4, torch.float32, "cpu")
    token = torch.tensor([[5]])
    assert _Call("forward", token, cache, False).batchable
    assert not _Call("forward", token, cache, False, multimodal=object()).batchable


def test_the_speculative_prefill_hands_the_image_inputs_to_the_model() -> None:
    seen = []

    class Drafting:
        device = torch.device("cpu")

        def hidden_and_mtp_input(self, tokens: torch.Tensor, cache: object, **images: object):
            seen.append(images)
            hidden = torch.zeros(1, tokens.shape[1], 4)
            return hidden, hidden

        def output(self, hidden: torch.Tensor) -> torch.Tensor:
            return torch.zeros(1, hidden.shape[1], 10)

    class NoDrafts:
        max_draft = 0

        def start(self, max_len: int) -> None:
            pass

    decoder = SpeculativeDecoder(Drafting(), RecordingCache(16), None, NoDrafts())
    marker = object()
    decoder.prefill(torch.tensor([[1, 2]]), marker)
    decoder.prefill(torch.tensor([[1, 2]]))
    assert seen == [{"multimodal": marker}, {}]
