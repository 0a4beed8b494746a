"""What the packed matvecs share: the tiled layout of their weights, and expanding the fields packed in
int32 code words in a form inductor compiles to few instructions.

Tiles: output rows are grouped `TILE` at a time (the float lanes of the CPU's vector registers, 8
with AVX2, 16 with AVX-512), and each group's words are stored together, [tiles, blocks, words, TILE].
The compiled loop computes one tile's outputs as a full-width vector while walking one contiguous
stretch of memory, so a matvec streams the weights front to back (a [blocks, words, out] layout
instead reads a vector from a different page at every step of the reduction, which for a large
matrix costs half the speed). Rows are padded to a whole number of tiles with zero weights.

Codes: a field of `bits` bits at position s of a word is isolated by masking it in place: the result
is code * 2^(bits * s), an integer with at most `bits` significant bits, so its float32 conversion is
exact. The activation it multiplies is scaled by 2^(-bits * s) instead, a power of two and so exact
too (short of underflow below 1e-30, where the product is negligible): each product x * code is bit
for bit the one a shift would give, for one AND per code rather than a shift and an AND. The top
field can't be masked in place (it would set the sign bit) and is shifted down instead.
"""

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = [
    "TILE",
    "concat_tiled",
    "from_tiles",
    "pairwise_sum",
    "placed_codes",
    "slice_tiled",
    "tiled_by_rows",
    "to_tiles",
]


def _float_lanes() -> int:
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
        return isa.nelements(torch.float32) if isa else 8
    except Exception:  # no inductor, or no way to ask: 8 lanes suit AVX2 and do no harm elsewhere
        return 8


TILE = _float_lanes()


def to_tiles(t: torch.Tensor) -> torch.Tensor:
    """[out, *rest] -> [tiles, *rest, TILE], rows padded with zeros to a whole number of tiles."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat((t, t.new_zeros(pad, *t.shape[1:])))
    tiled = t.view(-1, TILE, *t.shape[1:])
    return tiled.permute(0, *range(2, tiled.dim()), 1).contiguous()


# Rows packed per step by `tiled_by_rows` (a multiple of any TILE): bounds the temporaries of packing a
# large matrix (an output head) to a few MB instead of several copies of the whole weight.
PACK_ROWS = 4096


def tiled_by_rows(
    rows: int, make: Callable[[int, int], tuple[torch.Tensor, ...]]
) -> tuple[torch.Tensor, ...]:
    """`to_tiles` of each tensor `make(0, rows)` would return, built PACK_ROWS rows at a time: `make(start,
    stop)` gives rows start:stop of each, and only those are ever held besides the result."""
    results: list[torch.Tensor] = []
    for start in range(0, rows, PACK_ROWS):
        stop = min(start + PACK_ROWS, rows)
        parts = make(start, stop)
        if not results:
            tiles = -(-rows // TILE)
            results = [p.new_empty(tiles, *p.shape[1:], TILE) for p in parts]
        for result, part in zip(results, parts, strict=True):
            result[start // TILE : -(-stop // TILE)] = to_tiles(part)
    return tuple(results)


def from_tiles(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of a tiled [tiles, *rest, TILE] tensor, as [*rest, stop - start]."""
    first, last = start // TILE, -(-stop // TILE)
    part = t[first:last]
    rows = part.permute(*range(1, part.dim() - 1), 0, part.dim() - 1).reshape(*part.shape[1:-1], -1)
    return rows[..., start - first * TILE : stop - first * TILE]


Packed = TypeVar("Packed")


def concat_tiled(parts: list[Packed]) -> Packed:
    """One packed matrix holding the rows of `parts` (packed dataclasses of one type whose rows fill whole
    tiles) one after the other: its tensors concatenated along the tile dimension."""
    first = parts[0]
    fields = {}
    for field in dataclasses.fields(first):  # type: ignore[arg-type]
        values = [getattr(p, field.name) for p in parts]
        fields[field.name] = torch.cat(values) if isinstance(values[0], torch.Tensor) else sum(values)
    return type(first)(**fields)


def slice_tiled(packed: Packed, start: int, stop: int) -> Packed:
    """Rows start:stop (whole tiles) of a packed matrix, as views of its tensors."""
    fields = {}
    for field in dataclasses.fields(packed):  # type: ignore[arg-type]
        value = getattr(packed, field.name)
        fields[field.name] = (
            value[start // TILE : stop // TILE] if isinstance(value, torch.Tensor) else stop - start
        )
    return type(packed)(**fields)


def placed_codes(word: torch.Tensor, s: int, bits: int) -> tuple[torch.Tensor, float]:
    """Field s of every int32 in `word` as float32 codes (unsigned), and the factor that undoes their
    placement: codes * factor is the field's value."""
    top = 32 // bits - 1
    mask = (1 << bits) - 1
    if s == top:
        return ((word >> (bits * s)) & mask).to(torch.float32), 1.0
    return (word & (mask << (bits * s))).to(torch.float32), 2.0 ** (-bits * s)


def pairwise_sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """The sum of `terms`, added as a balanced tree: short dependency chains for the compiled loop."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]
