"""Text logits after images: transformers' Qwen3_5ForConditionalGeneration (tiny random text model and
tower) against Bubo's Decoder on the text model's GGUF, fed the tower's embeddings through
MultimodalInputs with mrope_positions; then decoding text tokens after the prompt with cache.rope_delta.
Measured max |Δlogit| (8 decode steps): qwen35 with two images (181 tokens) prefill 2.9e-5, decode
2.3e-5; qwen4exp with one image (74 tokens) prefill 1.5e-5, decode 1.8e-5. Tolerance 1e-3."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import PreTrainedModel, Qwen3_5ForConditionalGeneration, Qwen4ExpForCausalLM
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.decoder import Decoder
from bubo.model.loader import load_decoder
from bubo.model.multimodal_inputs import MultimodalInputs
from bubo.model.state import CacheBatch
from bubo.vision.loader import load_vision_tower
from bubo.vision.positions import ImageSpan, mrope_positions
from bubo.vision.tower import VisionTower
from tests.fixtures.mmproj_writer import (
    IMAGE_TOKEN_ID,
    PREPROCESSOR,
    QWEN4EXP_IMAGE_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    text_model_of,
    tiny_qwen4exp_vision_language_model,
    write_mmproj,
)
from tests.fixtures.qwen4exp_gguf import write_qwen4exp_gguf

TOLERANCE = 1e-3  # fp32 text logits (issue 9, TESTING.md)
SPECIAL = (VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID)
DECODE_STEPS = 4
MERGE = 2

pytestmark = pytest.mark.usefixtures("one_thread")


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(
    tokens_per_image: list[int], seed: int = 0, special: tuple[int, int, int] = SPECIAL, vocab: int = 250
) -> tuple[list[int], list[int]]:
    """Token ids: text, then per image <vision_start> pads <vision_end> text; and each image's first pad.
    `special`: the ids of <vision_start>, <|image_pad|>, <vision_end>."""
    rng = np.random.default_rng(seed)
    start_id, pad_id, end_id = special
    ids = rng.integers(0, vocab, 5).tolist()
    starts = []
    for n in tokens_per_image:
        ids.append(start_id)
        starts.append(len(ids))
        ids += [pad_id] * n + [end_id] + rng.integers(0, vocab, 3).tolist()
    return ids, starts


def _decoder(path: Path) -> Decoder:
    f = GGUFFile(path)
    return load_decoder(f, config_from_gguf(f))


class _Reference:
    """transformers' prefill of a prompt with images, then greedy steps from its cache."""

    def __init__(
        self, model: Qwen3_5ForConditionalGeneration, ids: list[int], images: list[Image.Image]
    ) -> None:
        self.model = model
        input_ids = torch.tensor([ids])
        inputs = {"input_ids": input_ids, "use_cache": True}
        if images:
            processed = Qwen2VLImageProcessorPil(**PREPROCESSOR)(images=images, return_tensors="pt")
            inputs.update(
                pixel_values=processed["pixel_values"],
                image_grid_thw=processed["image_grid_thw"],
                mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
            )
        model.model.rope_deltas = None
        with torch.no_grad():
            out = model(**inputs)
        self.logits, self.cache = out.logits, out.cache

    def step(self, token: int) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([[token]]), cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits


def _multimodal(
    tower: VisionTower, ids: list[int], starts: list[int], images: list[Image.Image]
) -> tuple[MultimodalInputs, int]:
    patches = [tower.preprocess(image) for image in images]
    spans = [ImageSpan(start, p.grid) for start, p in zip(starts, patches, strict=True)]
    positions, delta = mrope_positions(len(ids), spans, MERGE)
    rows = torch.cat([torch.arange(s.start, s.start + tower.token_count(s.grid)) for s in spans])
    embeds = torch.cat([tower.encode(p) for p in patches])
    return MultimodalInputs(rows=rows, embeds=embeds, positions=positions), delta


def _compare(
    reference: PreTrainedModel,
    decoder: Decoder,
    tower: VisionTower,
    ids: list[int],
    starts: list[int],
    images: list[Image.Image],
) -> None:
    """Prefill logits, then DECODE_STEPS greedy steps with cache.rope_delta, against transformers."""
    expected = _Reference(reference, ids, images)
    cache = decoder.new_cache()
    multimodal, delta = _multimodal(tower, ids, starts, images)
    logits = decoder(torch.tensor([ids]), cache, multimodal=multimodal)
    assert (logits - expected.logits).abs().max().item() <= TOLERANCE

    assert delta < 0  # the images use fewer positions than tokens: without the delta the steps would drift
    cache.rope_delta = delta
    token = int(logits[0, -1].argmax())
    for _ in range(DECODE_STEPS):
        step = decoder(torch.tensor([[token]]), cache)
        assert (step - expected.step(token)).abs().max().item() <= TOLERANCE
        token = int(step[0, -1].argmax())


@pytest.mark.parametrize(
    "sizes", [[(256, 256)], [(300, 200), (200, 520)]], ids=["one image", "two images of different grids"]
)
def test_logits_after_images_and_decoding_match_transformers(
    vl_model: Qwen3_5ForConditionalGeneration, vl_files: dict[str, Path], sizes: list[tuple[int, int]]
) -> None:
    tower = load_vision_tower(vl_files["mmproj"], dtype=torch.float32, device="cpu")
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    ids, starts = _prompt([tower.token_count(tower.grid_for_size(*size)) for size in sizes])
    _compare(vl_model, _decoder(vl_files["text"]), tower, ids, starts, images)


def test_qwen4exp_logits_after_an_image_match_transformers(tmp_path: Path) -> None:
    """The flagship: the spec's every-feature-live text config (hyper-connections, QSA selecting blocks
    over the 70-token prompt, PLE hashing the image placeholder ids, spec 4.12) with the same tower."""
    reference = tiny_qwen4exp_vision_language_model(seed=2)
    text = write_qwen4exp_gguf(text_model_of(reference, Qwen4ExpForCausalLM), tmp_path / "text.gguf")
    tower = load_vision_tower(
        write_mmproj(reference, tmp_path / "mmproj.gguf"), dtype=torch.float32, device="cpu"
    )
    image = _image(256, 256, seed=9)
    special = (QWEN4EXP_IMAGE_TOKEN_ID + 1, QWEN4EXP_IMAGE_TOKEN_ID, QWEN4EXP_IMAGE_TOKEN_ID + 2)
    ids, starts = _prompt([tower.token_count(tower.grid_for_size(256, 256))], special=special, vocab=1800)
    ids[2] = ids[-2] = 1792  # EOS cuts the PLE's n-gram contexts, before and after the image
    _compare(reference, _decoder(text), tower, ids, starts, [image])


def test_prefill_in_chunks_with_the_image_in_the_second(
    vl_model: Qwen3_5ForConditionalGeneration, vl_files: dict[str, Path]
) -> None:
    """The engine prefills long prompts in pieces: each call takes its slice of the positions, and the
    rows of its own image tokens."""
    tower = load_vision_tower(vl_files["checkpoint"], dtype=torch.float32, device="cpu")
    image = _image(256, 256, seed=5)
    ids, (start,) = _prompt([tower.token_count(tower.grid_for_size(256, 256))], seed=2)
    reference = _Reference(vl_model, ids, [image])
    full, delta = _multimodal(tower, ids, [start], [image])

    decoder = _decoder(vl_files["text"])
    cache = decoder.new_cache()
    cut = start - 2  # the first chunk is text only, at positions 0..cut-1
    first = decoder(torch.tensor([ids[:cut]]), cache)
    second_chunk = MultimodalInputs(
        rows=full.rows - cut, embeds=full.embeds, positions=full.positions[:, cut:]
    )
    second = decoder(torch.tensor([ids[cut:]]), cache, multimodal=second_chunk)
    assert (torch.cat([first, second], dim=1) - reference.logits).abs().max().item() <= TOLERANCE

    cache.rope_delta = delta
    token = int(second[0, -1].argmax())
    assert (decoder(torch.tensor([[token]]), cache) - reference.step(token)).abs().max().item() <= TOLERANCE


def test_cache_batch_rows_continue_at_their_own_delta(
    vl_model: Qwen3_5ForConditionalGeneration, vl_files: dict[str, Path]
) -> None:
    """Two slots decoding as one batch: one after an image (negative delta), one text only."""
    tower = load_vision_tower(vl_files["mmproj"], dtype=torch.float32, device="cpu")
    decoder = _decoder(vl_files["text"])
    image = _image(256, 256, seed=7)
    ids, starts = _prompt([tower.token_count(tower.grid_for_size(256, 256))], seed=3)
    text_ids, _ = _prompt([], seed=4)

    with_image, text_only = decoder.new_cache(), decoder.new_cache()
    multimodal, with_image.rope_delta = _multimodal(tower, ids, starts, [image])
    decoder(torch.tensor([ids]), with_image, multimodal=multimodal)
    decoder(torch.tensor([text_ids]), text_only)

    tokens = [11, 42]
    expected = torch.cat(
        [_Reference(vl_model, ids, [image]).step(11), _Reference(vl_model, text_ids, []).step(42)]
    )
    batched = decoder(torch.tensor([[t] for t in tokens]), CacheBatch([with_image, text_only]))
    assert (batched - expected).abs().max().item() <= TOLERANCE


def test_multimodal_inputs_are_checked(vl_files: dict[str, Path]) -> None:
    decoder = _decoder(vl_files["text"])
    tokens = torch.tensor([[1, 2, 3, 4]])
    positions = torch.arange(4).expand(3, 4)
    hidden = decoder.config.hidden_size
    bad = [
        MultimodalInputs(torch.tensor([1, 2]), torch.zeros(1, hidden), positions),  # rows vs embeds
        MultimodalInputs(torch.tensor([4]), torch.zeros(1, hidden), positions),  # row past the call
        MultimodalInputs(torch.tensor([1]), torch.zeros(1, hidden), positions[:, :3]),  # positions length
        MultimodalInputs(torch.tensor([1]), torch.zeros(1, hidden + 1), positions),  # width
    ]
    for multimodal in bad:
        with pytest.raises(ValueError):
            decoder(tokens, decoder.new_cache(), multimodal=multimodal)
    good = MultimodalInputs(torch.tensor([1]), torch.zeros(1, hidden), positions)
    with pytest.raises(ValueError, match="cache batch"):
        decoder(
            tokens[:, :1].repeat(2, 1),
            CacheBatch([decoder.new_cache(), decoder.new_cache()]),
            multimodal=good,
        )
