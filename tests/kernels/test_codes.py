"""The code words every packed layout is built on (bubo/kernels/codes.py): fields of 2 to 8 bits packed
into int32 words, and the dot products of runs of them with x, against plain integer and float64
arithmetic."""

import pytest
import torch

from bubo.kernels.codes import TILE, field_words, fields_a_word, sub_block_dots


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Every field of every word, in order, read back with shifts on int64."""
    wide = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(fields_a_word(bits)) * bits
    return ((wide[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


@pytest.mark.parametrize("n", [128, 61])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_field_words_hold_the_codes_in_order(bits: int, n: int) -> None:
    # 61 codes fill no whole number of words at any width: the last word is padded.
    codes = torch.randint(0, 1 << bits, (3, 2, n), generator=torch.Generator().manual_seed(bits))
    codes[0, 0] = (1 << bits) - 1  # every bit set, the top field's sign bit too
    words = field_words(codes, bits)
    per_word = fields_a_word(bits)
    assert words.dtype == torch.int32 and words.shape == (3, 2, -(-n // per_word))
    fields = _fields(words, bits)
    assert torch.equal(fields[..., :n], codes)
    assert not fields[..., n:].any()  # the last word's unused fields
    # uint8 codes (what the packers pass), every other byte of a tensor: the same words.
    strided = torch.stack((codes, codes), dim=-1).to(torch.uint8)[..., 0]
    assert torch.equal(field_words(strided, bits), words)


@pytest.mark.parametrize(
    ("bits", "group", "run"), [(3, 128, 16), (5, 128, 32), (6, 128, 16), (4, 32, 32), (8, 32, 32)]
)
def test_sub_block_dots_are_each_runs_dot_product(bits: int, group: int, run: int) -> None:
    # Runs that straddle two words (3, 5 and 6 bits: 10, 6 and 5 fields a word), and fields up to the sign bit.
    tiles, groups = 2, 3
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (tiles, TILE, groups, group), generator=gen)
    words = field_words(codes, bits).permute(0, 2, 3, 1).contiguous()  # [tiles, groups, words, TILE]
    x = torch.randn(2, groups * group, generator=gen)
    dots = sub_block_dots(x, words, bits, run)
    weights = codes.double().view(tiles, TILE, groups, group // run, run)
    expected = torch.einsum("tlgjk,rgjk->rtgjl", weights, x.double().view(2, groups, group // run, run))
    assert len(dots) == 2 and all(len(row) == group // run for row in dots)
    # float32 sums of up to 32 products, against float64: relative to the largest dot product.
    atol = 1e-6 * expected.abs().max().item()
    for r, row in enumerate(dots):
        for j, dot in enumerate(row):
            assert dot.shape == (tiles, groups, TILE)
            torch.testing.assert_close(dot.double(), expected[r, :, :, j], rtol=0, atol=atol)
    one_row = sub_block_dots(x[1], words, bits, run)
    assert all(torch.equal(a, b) for a, b in zip(one_row[0], dots[1], strict=True))
