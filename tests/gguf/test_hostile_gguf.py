"""Hostile GGUF files: a seeded mutation fuzzer over a fixture model and the real SmolLM2 header.

Every mutated file must either load or raise one clear error (a ValueError subclass: GGUFError,
TokenizerError) within a time bound and without Python allocations beyond the file's own size:
never another exception type, a hang or a huge allocation. The mutations are truncations, flipped
bytes in the header, absurd values written into structural fields that an independent walker
(below, not the reader) locates, overlapping tensors and a missing tokenizer.
"""

import random
import re
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bubo.engine.loaded_model import load_model
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import MAX_ARRAY_LENGTH, GGUFError, GGUFFile
from bubo.model.tokenizer import Tokenizer, TokenizerError

SEED = 8
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# Value types of one width: uint8/int8/bool, uint16/int16, uint32/int32/float32, uint64/int64/float64.
_WIDTH_GROUPS = ((0, 1, 7), (2, 3), (4, 5, 6), (10, 11, 12))
_SAME_WIDTH = {t: tuple(o for o in group if o != t) for group in _WIDTH_GROUPS for t in group}


@dataclass(frozen=True)
class Field:
    """One structural integer of the file: where it is, how wide, and what it means."""

    offset: int
    width: int
    kind: str


@dataclass(frozen=True)
class Layout:
    fields: tuple[Field, ...]
    header_end: int  # end of the tensor table
    tensor_offsets: tuple[Field, ...]


def walk(data: bytes) -> Layout:
    """The structural fields of a well-formed GGUF v3 file, found by following the format."""
    fields: list[Field] = []
    pos = 8

    def u(width: int, kind: str) -> int:
        nonlocal pos
        fields.append(Field(pos, width, kind))
        (value,) = struct.unpack_from("<Q" if width == 8 else "<I", data, pos)
        pos += width
        return value

    def string(kind: str) -> None:
        nonlocal pos
        length = u(8, kind)
        pos += length

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == _STRING:
            string("string length")
        elif vtype == _ARRAY:
            itype = u(4, "array element type")
            n = u(8, "array length")
            if itype in _SCALAR_SIZES:
                pos += n * _SCALAR_SIZES[itype]
            else:
                for _ in range(n):
                    value(itype)
        else:
            pos += _SCALAR_SIZES[vtype]

    n_tensors = u(8, "tensor count")
    n_kv = u(8, "metadata count")
    for _ in range(n_kv):
        string("key length")
        value(u(4, "value type"))
    offsets = []
    for _ in range(n_tensors):
        string("tensor name length")
        n_dims = u(4, "n_dims")
        for _ in range(n_dims):
            u(8, "dimension")
        u(4, "ggml type")
        u(8, "tensor data offset")
        offsets.append(fields[-1])
    return Layout(tuple(fields), pos, tuple(offsets))


@dataclass(frozen=True)
class Case:
    name: str
    mutate: Callable[[bytearray], bytearray]


def _put(field: Field, value: int) -> Callable[[bytearray], bytearray]:
    def mutate(data: bytearray) -> bytearray:
        data[field.offset : field.offset + field.width] = (value % (1 << (8 * field.width))).to_bytes(
            field.width, "little"
        )
        return data

    return mutate


def _absurd_values(field: Field, current: int, file_size: int, rng: random.Random) -> list[int]:
    top = 1 << (8 * field.width)
    return [
        top - 1,
        top // 2,
        0,
        current + 1,
        current * 2 + 1,
        file_size,
        file_size * 3,
        rng.randrange(top),
    ]


def cases(
    data: bytes, layout: Layout, rng: random.Random, *, file_size: int, n_fields: int, n_flips: int
) -> Iterator[Case]:
    size = len(data)
    cuts = {0, 3, 4, 7, 8, 16, 23, 24, 25, layout.header_end - 1, layout.header_end, size - 1}
    cuts |= {rng.randrange(layout.header_end) for _ in range(20)}
    if layout.header_end < size:
        cuts |= {rng.randrange(layout.header_end, size) for _ in range(6)}
    for cut in sorted(c for c in cuts if c < size):
        yield Case(f"truncated at {cut}", lambda d, cut=cut: d[:cut])

    # Every kind of field at least once, then a random sample of all of them.
    by_kind: dict[str, list[Field]] = {}
    for f in layout.fields:
        by_kind.setdefault(f.kind, []).append(f)
    chosen = [rng.choice(group) for group in by_kind.values()]
    chosen += rng.sample(layout.fields, min(n_fields, len(layout.fields)))
    for f in chosen:
        current = int.from_bytes(data[f.offset : f.offset + f.width], "little")
        for value in rng.sample(_absurd_values(f, current, file_size, rng), 3):
            yield Case(f"{f.kind} at {f.offset}: {current} -> {value}", _put(f, value))

    # Wrong types that keep the layout: a value or array element read as another type of its width.
    for f in by_kind.get("value type", []) + by_kind.get("array element type", []):
        current = int.from_bytes(data[f.offset : f.offset + 4], "little")
        for other in _SAME_WIDTH.get(current, ()):
            yield Case(f"{f.kind} at {f.offset}: {current} -> {other}", _put(f, other))

    # Arrays as long as the rest of the file can hold: the most a count check alone would allow.
    for f in by_kind.get("array length", []):
        itype = int.from_bytes(data[f.offset - 4 : f.offset], "little")
        longest = (file_size - f.offset - 8) // _SCALAR_SIZES.get(itype, 8)
        yield Case(f"array length at {f.offset} -> {longest}", _put(f, longest))

    for i in range(n_flips):
        positions = [rng.randrange(layout.header_end) for _ in range(rng.randint(1, 4))]

        def flip(d: bytearray, positions: list[int] = positions, seed: int = i) -> bytearray:
            r = random.Random(seed)
            for p in positions:
                d[p] ^= r.randrange(1, 256)
            return d

        yield Case(f"flipped bytes at {positions}", flip)

    offsets = layout.tensor_offsets
    if len(offsets) >= 2:
        first = int.from_bytes(data[offsets[0].offset : offsets[0].offset + 8], "little")
        yield Case("two tensors at one offset", _put(offsets[1], first))
        yield Case("last tensor over the first", _put(offsets[-1], first))

    def no_tokenizer(d: bytearray) -> bytearray:
        at = bytes(d).find(b"tokenizer.ggml.tokens")
        d[at : at + 9] = b"tokenizeX"
        return d

    yield Case("no tokenizer vocabulary", no_tokenizer)


def _run_case(case: Case, original: bytes, path: Path, pad_to: int, load: Callable[[Path], object]) -> str:
    data = case.mutate(bytearray(original))
    with path.open("wb") as fh:
        fh.write(data)
        if pad_to > len(data) and len(data) == len(original):
            fh.truncate(pad_to)  # sparse zeros stand in for the real file's tensor data
    try:
        load(path)
    except (GGUFError, TokenizerError) as error:
        # A GGUFError names the file; both name the key, tensor or offset at fault.
        assert str(error).strip(), f"{case.name}: an error without a message"
        return "error"
    except Exception as error:  # what the test is about: nothing but the clear errors
        pytest.fail(f"{case.name}: {type(error).__name__}: {error}")
    return "loaded"


def _fuzz(
    cases_: list[Case],
    original: bytes,
    path: Path,
    pad_to: int,
    load: Callable[[Path], object],
    *,
    seconds_per_case: float,
    traced_every: int,
) -> dict[str, int]:
    outcomes = {"loaded": 0, "error": 0}
    memory_bound = pad_to + (8 << 20)
    for index, case in enumerate(cases_):
        traced = index % traced_every == 0 or case.name.startswith("array length")
        if traced:
            tracemalloc.start()
        started = time.perf_counter()
        try:
            outcomes[_run_case(case, original, path, pad_to, load)] += 1
        finally:
            elapsed = time.perf_counter() - started
            peak = tracemalloc.get_traced_memory()[1] if traced else 0
            if traced:
                tracemalloc.stop()
        assert elapsed < seconds_per_case * (4 if traced else 1), f"{case.name}: took {elapsed:.1f} s"
        assert peak < memory_bound, f"{case.name}: {peak / 2**20:.0f} MiB allocated for a {pad_to} B file"
    return outcomes


def test_mutated_fixture_files_load_or_fail_clearly(tiny_llama_path: Path, tmp_path: Path) -> None:
    original = tiny_llama_path.read_bytes()
    layout = walk(original)
    found = list(
        cases(original, layout, random.Random(SEED), file_size=len(original), n_fields=90, n_flips=80)
    )
    assert len(found) >= 300

    def load(path: Path) -> None:
        load_model(path).file.close()

    outcomes = _fuzz(
        found, original, tmp_path / "mutant.gguf", len(original), load, seconds_per_case=5, traced_every=1
    )
    # The fuzzer must reach both outcomes, or it tests nothing (all rejected) or nothing hostile.
    assert outcomes["error"] > len(found) // 2 and outcomes["loaded"] > 0, outcomes


def test_mutated_real_headers_load_or_fail_clearly(smollm2_path: Path, tmp_path: Path) -> None:
    with GGUFFile(smollm2_path) as real:
        header_size = real.data_offset
    original = smollm2_path.read_bytes()[:header_size]
    layout = walk(original)
    rng = random.Random(SEED + 1)
    found = list(cases(original, layout, rng, file_size=smollm2_path.stat().st_size, n_fields=8, n_flips=12))

    def load(path: Path) -> None:
        with GGUFFile(path) as f:
            config_from_gguf(f)

    outcomes = _fuzz(
        found,
        original,
        tmp_path / "mutant.gguf",
        smollm2_path.stat().st_size,
        load,
        seconds_per_case=3,
        traced_every=25,
    )
    assert outcomes["error"] > len(found) // 2, outcomes


def test_a_file_without_a_tokenizer_fails_naming_it(tiny_llama_path: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_llama_path.read_bytes())
    at = bytes(data).find(b"tokenizer.ggml.model")
    data[at : at + 9] = b"tokenizeX"
    path = tmp_path / "no-tokenizer.gguf"
    path.write_bytes(data)
    with pytest.raises(TokenizerError, match=re.escape("tokenizer.ggml.model")):
        load_model(path)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tokenizer.ggml.tokens", "abc", "tokenizer.ggml.tokens should be an array of strings"),
        ("tokenizer.ggml.token_type", [1.5], "tokenizer.ggml.token_type should be an array of integers"),
        ("tokenizer.ggml.token_type", "all", "tokenizer.ggml.token_type should be an array of integers"),
        ("tokenizer.ggml.merges", [1, 2], "tokenizer.ggml.merges should be an array of strings"),
        ("tokenizer.ggml.pre", ["smollm"], None),
        ("tokenizer.ggml.add_bos_token", "yes", "tokenizer.ggml.add_bos_token should be a boolean"),
    ],
)
def test_mistyped_tokenizer_metadata_is_named(
    tiny_llama_path: Path, key: str, value: object, message: str | None
) -> None:
    with GGUFFile(tiny_llama_path) as f:
        metadata = dict(f.metadata)
    metadata[key] = value
    if message is None:  # an unknown pre-tokenizer falls back to GPT-2's regex
        Tokenizer.from_gguf(metadata)
        return
    with pytest.raises(TokenizerError, match=re.escape(message)):
        Tokenizer.from_gguf(metadata)


def test_token_types_outside_the_enum_are_named(tiny_llama_path: Path) -> None:
    with GGUFFile(tiny_llama_path) as f:
        metadata = dict(f.metadata)
    types = list(metadata["tokenizer.ggml.token_type"])
    types[5] = 90
    with pytest.raises(TokenizerError, match="token_type holds 90"):
        Tokenizer.from_gguf({**metadata, "tokenizer.ggml.token_type": types})


def test_a_sentencepiece_piece_too_long_to_split_is_refused() -> None:
    tokens = ["<unk>", "<s>", "</s>", "a", "a" * 5000]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [2, 3, 3, 1, 1],
    }
    started = time.perf_counter()
    with pytest.raises(TokenizerError, match="piece of 5000 characters"):
        Tokenizer.from_gguf(metadata)
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize("ne", [(32, 0, 2**62), (0, 2**63 - 1), (0,)])
def test_an_empty_dimension_is_refused(tmp_path: Path, ne: tuple[int, ...]) -> None:
    info = b"".join(
        [struct.pack("<Q", 1), b"t", struct.pack("<I", len(ne))]
        + [struct.pack("<Q", n) for n in ne]
        + [struct.pack("<IQ", 0, 0)]
    )
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + info
    path = tmp_path / "empty.gguf"
    path.write_bytes(header + bytes(-len(header) % 32 + 64))
    with pytest.raises(GGUFError, match=re.escape(f"tensor 't' has an empty dimension: {list(ne)}")):
        GGUFFile(path)


def test_an_array_longer_than_any_model_needs_is_refused(tmp_path: Path) -> None:
    n = MAX_ARRAY_LENGTH + 1
    kv = struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", _ARRAY, 0, n) + bytes(n)  # n uint8
    path = tmp_path / "long-array.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    with pytest.raises(GGUFError, match=f"metadata array 'k' has {n} elements"):
        GGUFFile(path)
