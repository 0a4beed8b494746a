"""A chat's images on their way into the prompt: refused for a model without a vision tower, fetched and
decoded (`load_images`), and each image's template placeholder expanded to the tower's tokens
(`place_images`)."""

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubo.engine.chat_messages import ImagePart
from bubo.engine.prompt_images import PromptImage
from bubo.gguf.reader import GGUFFile
from bubo.server.errors import ApiError
from bubo.server.image_fetch import Lookup, fetch_image
from bubo.server.image_input import (
    DecodedImage,
    ImageLimits,
    decode_image,
    image_error,
    image_size,
    inline_bytes,
)

__all__ = ["IMAGE_PAD", "ImageFit", "check_mmproj", "load_images", "place_images"]

# The token the Qwen-VL family's templates put where an image goes (between <|vision_start|> and
# <|vision_end|>); the prompt repeats it once per image token.
IMAGE_PAD = "<|image_pad|>"


# Images are decoded here one at a time, whichever requests they come from: a decode holds an image's
# full-size pixels (up to ImageLimits.max_pixels) until it is scaled down.
_DECODE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bubo-image")


@dataclass(frozen=True)
class ImageFit:
    """What the vision tower makes of images: `target` the size it takes an upright image of a given
    (width, height) at, `check` refuses a request's images (their upright sizes) that cannot fit the
    context or the memory guard, before any is decoded."""

    target: Callable[[int, int], tuple[int, int]]
    check: Callable[[Sequence[tuple[int, int]]], None]


async def load_images(
    parts: Sequence[ImagePart],
    limits: ImageLimits,
    *,
    allow_urls: bool,
    lookup: Lookup,
    fit: ImageFit | None = None,
) -> list[DecodedImage]:
    """The parts' images: inline bytes decoded, http(s) URLs fetched when `allow_urls`. Every image's
    size is read from its header first, and `fit.check` sees them all before any is decoded; then they
    are decoded one at a time off the event loop, each scaled down to `fit.target` at once. 400 for
    too many images, a refused URL, a corrupt or oversized image."""
    if len(parts) > limits.max_images:
        raise image_error(
            parts[limits.max_images].where,
            f"a request takes at most {limits.max_images} images",
            "too_many_images",
        )
    sources = []
    for part in parts:
        if part.remote:
            if not allow_urls:
                raise image_error(
                    part.where,
                    "this server does not fetch image URLs: send the image inline as a data: URL "
                    "(base64), or start the server with --allow-image-urls",
                    "image_url_not_allowed",
                )
            assert part.url is not None
            data = await fetch_image(part.url, part.where, limits, lookup=lookup)
        else:
            data = inline_bytes(part, limits)
        sources.append(data)
    loop = asyncio.get_running_loop()
    sizes = [
        await loop.run_in_executor(_DECODE_THREAD, image_size, data, part.where, limits)
        for part, data in zip(parts, sources, strict=True)
    ]
    if fit is not None:
        fit.check(sizes)
    target = fit.target if fit is not None else None
    return [
        await loop.run_in_executor(_DECODE_THREAD, decode_image, data, part.where, limits, target)
        for part, data in zip(parts, sources, strict=True)
    ]


def place_images(
    ids: list[int], pad: int | None, images: Sequence[DecodedImage], tower: Any
) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The prompt with each image's pad token repeated `tower.token_count(grid)` times, and where each
    image's tokens lie; 400 when the prompt does not hold exactly one pad token per image."""
    at = [i for i, token in enumerate(ids) if token == pad]
    if pad is None or len(at) != len(images):
        raise ApiError(
            400,
            "image_placeholder_mismatch",
            f"the prompt holds {len(at)} {IMAGE_PAD} tokens for {len(images)} images: the chat template "
            f"must render each image part once, and text must not contain {IMAGE_PAD}",
        )
    out: list[int] = []
    placed = []
    previous = 0
    for index, image in zip(at, images, strict=True):
        out += ids[previous:index]
        grid = tuple(tower.grid_for_size(*image.size))
        count = tower.token_count(grid)
        placed.append(PromptImage(len(out), grid, count, image.digest, image.image))
        out += [pad] * count
        previous = index + 1
    out += ids[previous:]
    return out, tuple(placed)


def check_mmproj(path: Path) -> None:
    """--mmproj names a file or a checkpoint folder that exists; a GGUF must be a vision projector."""
    if not path.exists():
        raise FileNotFoundError(f"--mmproj: vision tower not found: {path}")
    if path.is_file() and path.suffix.lower() == ".gguf":
        with GGUFFile(path) as file:
            architecture = file.metadata.get("general.architecture")
        if architecture != "clip":
            raise ValueError(
                f"--mmproj {path}: general.architecture is {architecture!r}, not 'clip': not a vision "
                "projector file (the model file goes first, the projector after --mmproj)"
            )
