"""The multimodal rope positions of a prompt with images (transformers' Qwen3_5Model.get_rope_index for
images): text tokens count up on all three rows (t, h, w) alike; an image's tokens all start from the
position the image begins at and add their frame, merged row and merged column on the t, h and w rows; the
text after an image continues from its start + max(merged rows, merged columns). The prompt therefore uses
fewer positions than it has tokens, and what follows it runs `delta` positions off its token index."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ImageSpan", "mrope_positions"]


@dataclass(frozen=True)
class ImageSpan:
    start: int  # index in the prompt's token ids of the image's first <|image_pad|>
    grid: tuple[int, int, int]  # (t, h, w) patch grid before merge; its tokens: t*h*w // merge**2


def _image_positions(start: int, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[3, tokens] positions of one image's tokens, frame-major then row-major over the merged grid
    (the order the merger emits them), each row offset by `start` (get_vision_position_ids)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack((frame, row, col)).reshape(3, -1) + start


def mrope_positions(length: int, spans: Sequence[ImageSpan], merge: int) -> tuple[torch.Tensor, int]:
    """The [3, length] int64 (t, h, w) rope positions of a prompt of `length` tokens whose image pad runs
    are `spans`, and `delta` = (largest position + 1) - length: the tokens after the prompt sit at their
    index + delta on every row."""
    pieces, index, position = [], 0, 0
    for span in sorted(spans, key=lambda s: s.start):
        t, h, w = span.grid
        if min(span.grid) < 1 or h % merge or w % merge:
            raise ValueError(f"image grid {span.grid} must be positive with h and w multiples of {merge}")
        tokens = t * h * w // merge**2
        if span.start < index or span.start + tokens > length:
            raise ValueError(
                f"image tokens {span.start}..{span.start + tokens} overlap another image or pass the "
                f"prompt's {length} tokens"
            )
        text = span.start - index
        pieces.append(torch.arange(text).expand(3, text) + position)
        position += text
        pieces.append(_image_positions(position, span.grid, merge))
        position += max(h, w) // merge
        index = span.start + tokens
    pieces.append(torch.arange(length - index).expand(3, length - index) + position)
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta
