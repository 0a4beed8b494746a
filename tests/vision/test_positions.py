"""mrope_positions against transformers' Qwen3_5Model.get_rope_index for prompts with images."""

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from bubo.vision.positions import ImageSpan, mrope_positions
from tests.fixtures.mmproj_writer import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID

MERGE = 2

LAYOUTS = {
    "text only": (6, []),
    "one image": (3, [(1, 4, 6)]),
    "tall image": (2, [(1, 10, 4)]),
    "image first": (0, [(1, 6, 6)]),
    "two images": (4, [(1, 4, 6), (1, 8, 2)]),
    "two frames": (1, [(2, 4, 4)]),
    "many frames": (2, [(5, 2, 4)]),
}


def _prompt(lead: int, grids: list[tuple[int, int, int]]) -> tuple[list[int], list[ImageSpan]]:
    ids, spans = list(range(10, 10 + lead)), []
    for grid in grids:
        if ids:
            ids.append(VISION_START_ID)
        spans.append(ImageSpan(len(ids), grid))
        ids += [IMAGE_TOKEN_ID] * (grid[0] * grid[1] * grid[2] // MERGE**2) + [VISION_END_ID, 7, 8]
    return ids, spans


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_positions_and_delta_match_get_rope_index(
    vl_model: Qwen3_5ForConditionalGeneration, layout: tuple[int, list[tuple[int, int, int]]]
) -> None:
    ids, spans = _prompt(*layout)
    input_ids = torch.tensor([ids])
    expected, expected_delta = vl_model.model.get_rope_index(
        input_ids,
        (input_ids == IMAGE_TOKEN_ID).int(),
        image_grid_thw=torch.tensor([s.grid for s in spans]) if spans else None,
    )
    positions, delta = mrope_positions(len(ids), spans, MERGE)
    assert positions.dtype == torch.int64
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected_delta)


def test_spans_may_come_in_any_order() -> None:
    ids, spans = _prompt(*LAYOUTS["two images"])
    assert torch.equal(
        mrope_positions(len(ids), spans[::-1], MERGE)[0], mrope_positions(len(ids), spans, MERGE)[0]
    )


@pytest.mark.parametrize(
    "spans",
    [
        [ImageSpan(2, (1, 4, 4))],  # 4 tokens from 2 pass the 5-token prompt
        [ImageSpan(0, (1, 2, 2)), ImageSpan(0, (1, 2, 2))],  # overlap
        [ImageSpan(0, (1, 3, 2))],  # not whole merge blocks
        [ImageSpan(0, (0, 2, 2))],  # empty
    ],
)
def test_bad_spans_are_refused(spans: list[ImageSpan]) -> None:
    with pytest.raises(ValueError):
        mrope_positions(5, spans, MERGE)
