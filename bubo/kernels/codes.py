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
exact. A kernel sums the products of one field position and scales that sum by 2^(-bits * s) once: a
power of two, so the scaled sum is bit for bit the one shifted codes would give (short of overflow or
underflow, some 30 orders of magnitude away), for one AND per code rather than a shift and an AND. A
field that holds the sign bit (the top one of 2, 4 or 8 bits) is shifted down instead. Fields of 3, 5 or
6 bits lie 10, 6 or 5 to a word (30 bits used): a run of weights with one scale may then straddle two
words, which `sub_block_dots` follows, so those codes cost 3.25 / 5.5 / 6.5 bits a weight (packed 128 at a
time, bubo/kernels/super_block_matvec.py), not 4 or 8.

Per-block fields: a matvec streams as few arrays as it can. A block's scale and offset (PackedQ4,
PackedQ8Offset) lie next to each other, [tiles, blocks, 2, TILE], so the words and the fields are two
arrays rather than three, which streams faster. They are float16 where every value survives the round trip
(`half_if_exact`: the fp16 d and m of Q4_0/Q4_1/Q5_1, the file's own bytes), float32 otherwise (Q4_0's
offset -8d where it overflows float16); the kernels widen them as they load them. A scale alone
(PackedQ8) rides in the block's words as one more word of float32 bits. K-quant super-blocks keep their
sub-blocks' integer scales as bytes in an array of their own, and d, dmin in a float32 array beside it
(bubo/kernels/super_block_matvec.py).

Words enter a compiled kernel as int32 with AVX-512 and as float32 bit patterns elsewhere (`word_bits`),
viewed back to int32 inside it. Inductor loads a vector of int32 with `Vectorized<int32_t>::loadu(ptr,
count)`, which in ATen's AVX2 header always copies through a stack buffer (two 16-byte stores, then one
32-byte load: a store-forwarding stall on every load); the float32 load has a full-width fast path (2.3-2.9x
the speed on the default model's matrices). The AVX-512 header loads int32 directly, while the bit cast
back from float32 is emitted as a loop over the lanes through the stack, which the C++ compiler leaves
scalar (inductor turns its loop vectorizer off): with 16 lanes the int32 words run at twice the speed.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = [
    "TILE",
    "block_dots",
    "block_sums",
    "by_block",
    "by_rows",
    "concat_tiled",
    "expand_tiles",
    "field_words",
    "fields_a_word",
    "half_if_exact",
    "pairwise_sum",
    "placed_codes",
    "slice_tiled",
    "sub_block_dots",
    "tiled_by_rows",
    "to_tiles",
    "word_bits",
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
    """[out, *rest] -> [tiles, *rest, TILE], rows padded with zeros to a whole number of tiles: a permuted
    view of t (of its padded copy), for the caller to copy into place in one pass."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat((t, t.new_zeros(pad, *t.shape[1:])))
    tiled = t.reshape(-1, TILE, *t.shape[1:])
    return tiled.permute(0, *range(2, tiled.dim()), 1)


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


def expand_tiles(
    kernel: Callable[..., torch.Tensor], tiled: Sequence[torch.Tensor], start: int, stop: int
) -> torch.Tensor:
    """Rows start:stop of a packed matrix, expanded by `kernel` from the whole tiles that hold them (each
    of `tiled` cut to those tiles) into [..., rows of those tiles]: the columns of the rows outside
    start:stop cut off again."""
    first, last = start // TILE, -(-stop // TILE)
    expanded = kernel(*(t[first:last] for t in tiled))
    return expanded[..., start - first * TILE : stop - first * TILE]


def half_if_exact(fields: torch.Tensor) -> torch.Tensor:
    """float32 per-block fields as float16 when every one converts back to itself, else as they are."""
    half = fields.to(torch.float16)
    return half if torch.equal(half.to(torch.float32), fields) else fields


def by_block(t: torch.Tensor) -> torch.Tensor:
    """A per-block field [tiles, blocks, TILE] as [blocks, 1, 1, tiles, TILE]: to broadcast over a block's
    expanded codes [blocks, words, fields, tiles, TILE] (an unpacking's transposed weight)."""
    return t.permute(1, 0, 2)[:, None, None]


Packed = TypeVar("Packed")


def concat_tiled(parts: list[Packed]) -> Packed:
    """One packed matrix holding the rows of `parts` (packed dataclasses of one type whose rows fill whole
    tiles) one after the other: its tensors concatenated along the tile dimension (per-block fields in
    float32 unless every part has them in float16), out_features summed, any other field (a ggml type)
    alike in every part."""
    first = parts[0]
    fields = {}
    for field in dataclasses.fields(first):  # type: ignore[arg-type]
        values = [getattr(p, field.name) for p in parts]
        if isinstance(values[0], torch.Tensor):
            # torch.cat promotes: float16 fields joined with float32 ones become float32.
            fields[field.name] = torch.cat(values)
        elif field.name == "out_features":
            fields[field.name] = sum(values)
        else:
            if len(set(values)) != 1:
                raise ValueError(f"packed matrices of different {field.name}: {values}")
            fields[field.name] = values[0]
    return type(first)(**fields)


def slice_tiled(packed: Packed, start: int, stop: int) -> Packed:
    """Rows start:stop (whole tiles) of a packed matrix, as views of its tensors."""
    fields = {}
    for field in dataclasses.fields(packed):  # type: ignore[arg-type]
        value = getattr(packed, field.name)
        if isinstance(value, torch.Tensor):
            value = value[start // TILE : stop // TILE]
        elif field.name == "out_features":
            value = stop - start
        fields[field.name] = value
    return type(packed)(**fields)


def fields_a_word(bits: int) -> int:
    """How many `bits`-bit fields an int32 code word holds: 16 / 10 / 8 / 6 / 5 / 4 of 2 to 8 bits."""
    return 32 // bits


def placed_codes(word: torch.Tensor, s: int, bits: int) -> tuple[torch.Tensor, float]:
    """Field s of every int32 in `word` as float32 codes (unsigned), and the factor that undoes their
    placement: codes * factor is the field's value."""
    mask = (1 << bits) - 1
    if bits * (s + 1) == 32:  # the field holds the sign bit: shifted down, not masked in place
        return ((word >> (bits * s)) & mask).to(torch.float32), 1.0
    return (word & (mask << (bits * s))).to(torch.float32), 2.0 ** (-bits * s)


def sub_block_dots(
    x: torch.Tensor, words: torch.Tensor, bits: int, sub_block: int
) -> list[list[torch.Tensor]]:
    """x_j . codes_j for every run j of `sub_block` weights of every group of an output row, the codes
    unsigned `bits`-bit fields of `words` int32 [tiles, groups, words, TILE] (field s of word w of a group
    is its weight w * fields_a_word + s, as field_words stores them; a run may straddle two words): for
    each row of x ([in_features] as one row, or [rows, in_features]) a list of [tiles, groups, TILE], one
    for each run of a group.

    One reduction over groups whose body expands a group's codes, so that inductor emits a single loop
    per tile with nothing stored between the words and the result. The products of one run and one field
    position form a chain (one FMA per word) scaled once by its placement factor. With several rows (a
    verify pass's few tokens, batched slots) the codes are expanded once for all of them, and that
    expansion is what a matvec's time goes to when its weights are in cache, so the rows after the first
    cost little."""
    n_groups, n_words = words.shape[1], words.shape[2]
    group = x.shape[-1] // n_groups
    per_word = fields_a_word(bits)
    # x's weight k of every group as [1, groups, 1], row by row, and each word of every group: taken apart
    # once (unbind), as indexing each term out would trace five view ops for every one of its products,
    # which made up half of a matvec's graph and of its tracing time at load.
    planes = x.view(-1, n_groups, group).permute(0, 2, 1)[:, :, None, :, None]
    xs = [row.unbind(0) for row in planes.unbind(0)]
    word_planes = words.unbind(2)
    runs = group // sub_block
    # chains[r][j][s]: row r's products of run j's codes at field position s, traced word by word (a
    # word's fields expanded together, where its load is).
    chains: list[list[dict[int, torch.Tensor]]] = [[{} for _ in range(runs)] for _ in xs]
    places: dict[int, float] = {}
    for w in range(n_words):
        for s in range(per_word):
            k = w * per_word + s
            if k >= group:  # an unused field of the last word
                break
            codes, places[s] = placed_codes(word_planes[w], s, bits)
            for r, row_chains in enumerate(chains):
                term = xs[r][k] * codes
                run = row_chains[k // sub_block]
                run[s] = run[s] + term if s in run else term
    positions = [
        [[run[s] if places[s] == 1.0 else run[s] * places[s] for s in sorted(run)] for run in row]
        for row in chains
    ]
    return [[pairwise_sum(run) for run in row] for row in positions]


def block_dots(x: torch.Tensor, words: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """x_b . codes_b for every block b of every output row (`sub_block_dots` with a group's weights one
    run, `words` [tiles, blocks, words, TILE]): [tiles, blocks, TILE] for each row of x."""
    return [row[0] for row in sub_block_dots(x, words, bits, x.shape[-1] // words.shape[1])]


def block_sums(x: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """sum(x_b) per block of each row of x ([in_features] or [rows, in_features]): [rows, 1, blocks, 1],
    row r broadcasting against a block_dots term as [1, blocks, 1]."""
    return x.view(-1, 1, n_blocks, 1, x.shape[-1] // n_blocks).sum(-1)


def by_rows(x: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
    """A matvec's per-row results [out] as x's rows are shaped: [out] for a vector x, else [rows, out]."""
    return outputs[0] if x.dim() == 1 else torch.stack(outputs)


def field_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes of `bits` bits (2 to 8; any integer dtype) [..., n] of a group's weights in order ->
    their int32 words [..., ceil(n / fields_a_word)], field s of word w holding code w * fields_a_word + s
    (little end first), the last word's unused fields zero."""
    # Fields that never straddle a byte (2, 4, 8 bits) are put together a byte at a time: a quarter of the
    # memory int32s take while a large matrix is packed.
    unit = torch.uint8 if 8 % bits == 0 else torch.int32
    per_unit = unit.itemsize * 8 // bits
    n = codes.shape[-1]
    width = n + -n % fields_a_word(bits)
    if width != n or codes.dtype != unit:
        # Converted and padded in one pass: the copy converts, and only the padding is zeroed.
        padded = codes.new_empty(*codes.shape[:-1], width, dtype=unit)
        padded[..., :n] = codes
        padded[..., n:] = 0
        codes = padded
    codes = codes.contiguous()
    if unit == torch.int32:
        grouped = codes.view(*codes.shape[:-1], -1, per_unit)
        packed = grouped[..., 0] | (grouped[..., 1] << bits)
        for s in range(2, per_unit):
            packed |= grouped[..., s] << (bits * s)
        return packed
    if per_unit == 1:
        return codes.view(torch.int32)
    # A byte's per_unit codes, one a byte, read as one little-endian integer (as GGUF's bytes are read
    # everywhere): code s sits at bit 8s, and shifted right by s * (8 - bits) at bit s * bits, inside
    # the low byte, which the narrowing to uint8 keeps.
    wide = codes.view(torch.int16 if per_unit == 2 else torch.int32)
    packed = wide | (wide >> (8 - bits))
    for s in range(2, per_unit):
        packed |= wide >> (s * (8 - bits))
    return packed.to(torch.uint8).view(torch.int32)


def word_bits(words: torch.Tensor) -> torch.Tensor:
    """int32 code words as a compiled kernel takes them in (see above): a view."""
    return words if TILE >= 16 else words.view(torch.float32)


def pairwise_sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """The sum of `terms`, added as a balanced tree: short dependency chains for the compiled loop."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]
