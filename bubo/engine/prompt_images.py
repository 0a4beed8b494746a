"""The images of a prompt, as the engine runs them: where their pad tokens lie, what the prompt cache
compares at those positions, and the vision inputs of each prefill chunk.

A prompt with images holds, for each image, `tokens` copies of the model's image pad token starting at
`start`. Their token ids are all the same, so the prompt cache compares those positions by the sha256
of the image's bytes instead (`ImageToken`): a conversation that resends the same image reuses its
positions, another image of the same size does not.

Prefilling such a prompt, each forward pass over positions [start, end) that holds image tokens gets
`MultimodalInputs` (bubo/model/multimodal_inputs.py): the rows that take image embeddings, those
embeddings (only the images with tokens in the chunk are encoded, each once per request), and the
chunk's mrope positions. Every chunk also sets `cache.rope_delta`, the offset at which text after the
chunk continues (text positions are index + rope_delta), so later chunks, decode steps, speculative
verify passes and batched decode steps need no image inputs at all.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["ImageToken", "PromptImage", "PromptVision", "VisionEncoder", "cache_key"]


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its first pad token's index, its patch grid (t, h, w) before the spatial
    merge, its number of pad tokens, the sha256 of its bytes, and the decoded image (a PIL image, only
    preprocessed when its tokens have to be computed)."""

    start: int
    grid: tuple[int, int, int]
    tokens: int
    digest: str
    image: Any

    @property
    def end(self) -> int:
        return self.start + self.tokens


@dataclass(frozen=True)
class ImageToken:
    """What the prompt cache compares at an image position: the image's digest and the offset in it."""

    digest: str
    index: int


def cache_key(prompt_ids: Sequence[int], images: Sequence[PromptImage]) -> list[int | ImageToken]:
    """The prompt as the prompt cache compares it: token ids, with image positions by image digest."""
    key: list[int | ImageToken] = list(prompt_ids)
    for image in images:
        key[image.start : image.end] = [ImageToken(image.digest, i) for i in range(image.tokens)]
    return key


class VisionEncoder(Protocol):
    """What the engine needs of bubo.vision.tower.VisionTower."""

    config: Any  # spatial_merge_size

    def preprocess(self, image: Any) -> Any: ...

    def encode(self, patches: Any) -> torch.Tensor: ...


class PromptVision:
    """The vision side of one prompt's prefill: `chunk(cache, start, end)` before each forward pass."""

    def __init__(
        self, tower: VisionEncoder, images: Sequence[PromptImage], length: int, device: torch.device
    ) -> None:
        # Imported here: the vision package is only needed (and only loaded) with a tower.
        from bubo.vision.positions import ImageSpan, mrope_positions

        self.tower = tower
        self.images = list(images)
        self.device = device
        spans = [ImageSpan(image.start, image.grid) for image in self.images]
        positions, _ = mrope_positions(length, spans, tower.config.spatial_merge_size)
        self.positions = positions.to(device)
        # Where text after the first n tokens continues: the highest position so far plus one.
        self._next_position = positions.max(0).values.cummax(0).values + 1
        self._embeds: dict[int, torch.Tensor] = {}
        self.encoded = 0  # images run through the tower (each once)

    def rope_delta(self, end: int) -> int:
        """The offset of text positions after the first `end` tokens (position = index + offset)."""
        return 0 if end == 0 else int(self._next_position[end - 1]) - end

    def chunk(self, cache: Any, start: int, end: int) -> Any:
        """Set `cache.rope_delta` for what follows tokens [start, end), and return the chunk's
        MultimodalInputs when it holds image tokens (None otherwise: its text positions follow
        rope_delta, which is the same at its start and end)."""
        from bubo.model.multimodal_inputs import MultimodalInputs

        cache.rope_delta = self.rope_delta(end)
        inside = [
            (i, image) for i, image in enumerate(self.images) if image.start < end and image.end > start
        ]
        if not inside:
            return None
        rows, embeds = [], []
        for i, image in inside:
            first, last = max(image.start, start), min(image.end, end)
            rows.append(torch.arange(first - start, last - start))
            embeds.append(self._embedding(i)[first - image.start : last - image.start])
        return MultimodalInputs(
            rows=torch.cat(rows).to(self.device),
            embeds=torch.cat(embeds),
            positions=self.positions[:, start:end],
        )

    def _embedding(self, i: int) -> torch.Tensor:
        if i not in self._embeds:
            image = self.images[i]
            embeds = self.tower.encode(self.tower.preprocess(image.image))
            if embeds.shape[0] != image.tokens:
                raise RuntimeError(
                    f"the vision tower gave {embeds.shape[0]} embeddings for an image of {image.tokens} tokens"
                )
            self._embeds[i] = embeds
            self.encoded += 1
        return self._embeds[i]
