"""Memory-mapped GGUF reader.

The file is mapped copy-on-write and parsed with a small cursor over the mapped bytes: only the
header, metadata and tensor table are touched on open, and each tensor is a zero-copy uint8 view
of the map. A GGUF file is untrusted input, so every count and length is checked against the
bytes that remain before anything is sized from it, and every problem is a GGUFError that names
the file and what is wrong.
"""

import itertools
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from bubo.gguf.quants import SUPPORTED_TYPES, dequantize

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8
# Metadata arrays become Python lists, several times the size of their bytes (a float32 is 32 bytes
# as a list item), so a count that merely fits in the file could still cost gigabytes. The longest
# real arrays are vocabularies and merge lists (Gemma's 262k tokens, Llama 3's 280k merges).
MAX_ARRAY_LENGTH = 1 << 21
_INT64_MAX = 2**63 - 1

V = GGUFValueType
# value type -> (struct format, numpy dtype) for fixed-size scalars
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    V.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    V.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    V.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    V.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    V.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    V.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    V.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    V.BOOL: (struct.Struct("<B"), np.dtype("<u1")),
    V.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    V.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    V.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Smallest possible encodings, used to reject counts the remaining bytes could never hold.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MIN_VALUE_BYTES = {V.STRING: 8, V.ARRAY: 4 + 8}


class GGUFError(ValueError):
    """A GGUF file is malformed or uses something Bubo does not support."""


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor of a GGUF file: its table entry and a zero-copy uint8 view of its bytes."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: ggml's ne reversed
    offset: int  # absolute byte offset in the file
    nbytes: int
    raw: torch.Tensor = field(repr=False)  # uint8 [*shape[:-1], row_bytes]
    file: Path | None = field(default=None, repr=False)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The tensor as `dtype` with `shape`, on `device` (the raw bytes move, not the floats)."""
        if self.ggml_type not in SUPPORTED_TYPES:
            where = f"{self.file}: " if self.file is not None else ""
            raise GGUFError(
                f"{where}tensor {self.name!r} has ggml type {self.ggml_type.name}, which Bubo cannot dequantize "
                f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
            )
        raw = self.raw if device is None else self.raw.to(device)
        return dequantize(raw, self.ggml_type, dtype)


class _Cursor:
    """Reads little-endian values from the mapped bytes, checking each read against the end."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.end = size
        self.path = path

    def error(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise self.error(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, but the file has only "
                f"{self.end - self.pos} left"
            )

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        self.need(fmt.size, what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def u32(self, what: str) -> int:
        return self.scalar(_U32, what)

    def u64(self, what: str) -> int:
        return self.scalar(_U64, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """A count read from the file, rejected if n items of min_bytes each can't fit in what is left."""
        if n * min_bytes > self.end - self.pos:
            raise self.error(
                f"{what} is {n}, but only {self.end - self.pos} bytes remain at offset {self.pos} "
                f"(at least {min_bytes} per item): the count is corrupt or the file is truncated"
            )
        return n

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise self.error(f"metadata {key!r} has unknown value type {vtype}") from None
        if vt == V.STRING:
            return self.string(f"metadata {key!r}")
        if vt == V.ARRAY:
            return self.array(key, depth)
        fmt, _ = _SCALARS[vt]
        value = self.scalar(fmt, f"metadata {key!r}")
        return bool(value) if vt == V.BOOL else value

    def array(self, key: str, depth: int) -> list[Any]:
        if depth >= MAX_ARRAY_NESTING:
            raise self.error(f"metadata {key!r} nests arrays deeper than {MAX_ARRAY_NESTING} levels")
        itype = self.u32(f"element type of metadata {key!r}")
        n = self.u64(f"length of metadata {key!r}")
        try:
            it = GGUFValueType(itype)
        except ValueError:
            raise self.error(f"metadata {key!r} is an array of unknown value type {itype}") from None
        if it in _SCALARS:
            _, dtype = _SCALARS[it]
            self.count(n, dtype.itemsize, f"length of metadata array {key!r}")
            self._check_array_length(n, key)
            values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
            self.pos += n * dtype.itemsize
            return (values != 0).tolist() if it == V.BOOL else values.tolist()
        self.count(n, _MIN_VALUE_BYTES[it], f"length of metadata array {key!r}")
        self._check_array_length(n, key)
        if it == V.STRING:
            return self._strings(n, key)
        return [self.array(key, depth + 1) for _ in range(n)]

    def _check_array_length(self, n: int, key: str) -> None:
        if n > MAX_ARRAY_LENGTH:
            raise self.error(
                f"metadata array {key!r} has {n} elements, more than the {MAX_ARRAY_LENGTH} any model needs"
            )

    def _strings(self, n: int, key: str) -> list[str]:
        # The hot loop of opening a file (a vocabulary is 100k+ strings), so it avoids method calls.
        buf, pos, end, unpack = self.buf, self.pos, self.end, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for i in range(n):
                if end - pos < 8:
                    raise self.error(f"truncated: metadata {key!r} ends inside the length of string {i}")
                (length,) = unpack(buf, pos)
                pos += 8
                if length > end - pos:
                    raise self.error(
                        f"truncated: string {i} of metadata {key!r} is {length} bytes, but only {end - pos} remain"
                    )
                append(buf[pos : pos + length].decode("utf-8"))
                pos += length
        except UnicodeDecodeError as e:
            raise self.error(
                f"string {len(out)} of metadata {key!r} is not valid UTF-8 ({e.reason})"
            ) from None
        self.pos = pos
        return out


class GGUFFile:
    """A GGUF file (v2 or v3, little-endian), memory-mapped copy-on-write.

    `tensors` are zero-copy views of the map: nothing is read until used, and writing to a view
    changes private pages, never the file. The map lives as long as any view of it does.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 4 + 4 + 8 + 8:
            raise GGUFError(f"{self.path}: truncated: {size} bytes is too short for a GGUF header (24 bytes)")
        with self.path.open("rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        self._closed = False
        self._map = mm
        cur = _Cursor(mm, size, self.path)
        self.version = self._read_header(cur)
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        cur.count(n_kv, _MIN_KV_BYTES, "metadata count")
        cur.count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor count")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            if key in self.metadata:
                raise cur.error(f"duplicate metadata key {key!r}")
            self.metadata[key] = cur.value(cur.u32(f"value type of metadata {key!r}"), key)
        self.alignment = self._read_alignment(cur)
        infos = [self._read_tensor_info(cur) for _ in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        # numpy holds a buffer export on the map for as long as any view lives, so the map can
        # never be closed under a tensor (torch.frombuffer alone would not prevent that).
        base = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self.tensors: dict[str, GGUFTensor] = self._build_tensors(cur, infos, base)

    @staticmethod
    def _read_header(cur: _Cursor) -> int:
        magic = cur.buf[0:4]
        if magic != GGUF_MAGIC:
            raise cur.error(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if version & 0xFFFF == 0 and swapped in (1, *SUPPORTED_VERSIONS):
                raise cur.error(
                    f"big-endian GGUF (version {swapped}) is not supported; only little-endian files"
                )
            raise cur.error(
                f"unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})"
            )
        return version

    def _read_alignment(self, cur: _Cursor) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        alignment = self.metadata["general.alignment"]
        # `type() is int` keeps out bools (ints in Python) along with strings, floats and lists.
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise cur.error(f"general.alignment must be a power of two, got {alignment!r}")
        return alignment

    @staticmethod
    def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string("tensor name")
        n_dims = cur.u32(f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.error(f"tensor {name!r} has {n_dims} dimensions (must be 1 to {MAX_DIMS})")
        cur.need(8 * n_dims, f"dimensions of tensor {name!r}")
        ne = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
        cur.pos += 8 * n_dims
        type_id = cur.u32(f"type of tensor {name!r}")
        offset = cur.u64(f"data offset of tensor {name!r}")
        return name, ne, type_id, offset

    def _build_tensors(
        self, cur: _Cursor, infos: list[tuple[str, tuple[int, ...], int, int]], base: torch.Tensor
    ) -> dict[str, GGUFTensor]:
        tensors: dict[str, GGUFTensor] = {}
        for name, ne, type_id, rel_offset in infos:
            if name in tensors:
                raise cur.error(f"duplicate tensor name {name!r}")
            try:
                ggml_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise cur.error(f"tensor {name!r} has unknown ggml type id {type_id}") from None
            bs, ts = GGML_QUANT_SIZES[ggml_type]
            if 0 in ne:
                # No weight is empty, and an empty tensor's other dimensions could be anything at all.
                raise cur.error(f"tensor {name!r} has an empty dimension: {list(ne)}")
            n_elements = math.prod(ne)
            if n_elements > _INT64_MAX:
                raise cur.error(
                    f"tensor {name!r} has dimensions {list(ne)} whose element count overflows int64"
                )
            if ne[0] % bs:
                raise cur.error(
                    f"tensor {name!r} ({ggml_type.name}) has rows of {ne[0]} elements, "
                    f"not a multiple of the block size {bs}"
                )
            if rel_offset % self.alignment:
                raise cur.error(
                    f"tensor {name!r} data offset {rel_offset} is not a multiple of the alignment {self.alignment}"
                )
            nbytes = n_elements // bs * ts
            offset = self.data_offset + rel_offset
            if offset + nbytes > cur.end:
                raise cur.error(
                    f"truncated: tensor {name!r} data spans bytes {offset}..{offset + nbytes} "
                    f"but the file ends at {cur.end}"
                )
            shape = tuple(reversed(ne))
            raw = base[offset : offset + nbytes].view(*shape[:-1], ne[0] // bs * ts)
            tensors[name] = GGUFTensor(name, ggml_type, shape, offset, nbytes, raw, self.path)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
        for (_, prev_end, prev), (start, _, cur_name) in itertools.pairwise(spans):
            if start < prev_end:
                raise cur.error(f"tensor data overlaps: {cur_name!r} starts at {start}, inside {prev!r}")
        return tensors

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata has no string general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory. They are clean copy-on-write pages
        (nothing writes to the map), so a later read of any tensor faults its pages in again from the
        file: after load, only what is still read (float norms, looked-up embedding rows) comes back."""
        if hasattr(mmap, "MADV_DONTNEED") and not self._map.closed:
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Drop this object's tensor views; the map is released once no other view remains."""
        self.tensors = {}
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.tensors)} tensors"
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {state})"
