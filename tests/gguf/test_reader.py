"""bubo.gguf.reader: tiny files from gguf.GGUFWriter, and hand-crafted bytes for every corruption."""

import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType, GGUFValueType

from bubo.gguf import GGUFError, GGUFFile, GGUFTensor, dequantize

T = GGMLQuantizationType
V = GGUFValueType


# -- hand-crafted GGUF bytes -------------------------------------------------------------------


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return u64(len(data)) + data


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def kv_str(key: str, value: str) -> bytes:
    return kv(key, V.STRING, gstr(value))


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, V.UINT32, u32(value))


def tensor_info(name: str, ne: Sequence[int], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + u32(len(ne)) + b"".join(u64(n) for n in ne) + u32(ggml_type) + u64(offset)


def gguf_bytes(
    kvs: Sequence[bytes] = (),
    infos: Sequence[bytes] = (),
    data: bytes = b"",
    *,
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
) -> bytes:
    head = b"GGUF" + u32(version) + u64(len(infos) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


ARCH = kv_str("general.architecture", "llama")
Q8_BLOCKS = bytes(range(68))  # two Q8_0 blocks (fp16 scales 0x0100, 0x2322: finite)
W_Q8 = tensor_info("w", [32, 2], T.Q8_0, 0)


@pytest.fixture
def write(tmp_path: Path) -> Callable[[bytes], Path]:
    counter = iter(range(1_000_000))

    def _write(content: bytes) -> Path:
        path = tmp_path / f"f{next(counter)}.gguf"
        path.write_bytes(content)
        return path

    return _write


def expect_error(path: Path, pattern: str) -> GGUFError:
    with pytest.raises(GGUFError, match=pattern) as info:
        GGUFFile(path)
    assert str(path) in str(info.value), "the message must name the file"
    return info.value


# -- files written by gguf.GGUFWriter ----------------------------------------------------------

RNG = np.random.default_rng(1234)
F32_2D = RNG.standard_normal((3, 64)).astype(np.float32)
F32_3D = RNG.standard_normal((2, 3, 4)).astype(np.float32)
F16_2D = RNG.standard_normal((2, 8)).astype(np.float16)
Q8_SOURCE = RNG.standard_normal((4, 64)).astype(np.float32)
Q4K_BLOCKS = RNG.integers(0, 256, size=(2, 2 * 144), dtype=np.uint8)
Q4K_BLOCKS.reshape(-1, 144)[:, 0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)

METADATA: dict[str, tuple[GGUFValueType, object]] = {
    "t.u8": (V.UINT8, 200),
    "t.i8": (V.INT8, -5),
    "t.u16": (V.UINT16, 60000),
    "t.i16": (V.INT16, -30000),
    "t.u32": (V.UINT32, 4_000_000_000),
    "t.i32": (V.INT32, -2_000_000_000),
    "t.u64": (V.UINT64, 2**63 + 5),
    "t.i64": (V.INT64, -(2**62)),
    "t.f32": (V.FLOAT32, 0.1),
    "t.f64": (V.FLOAT64, 0.1),
    "t.true": (V.BOOL, True),
    "t.false": (V.BOOL, False),
    "t.str": (V.STRING, "héllo ✓ wörld"),
}
ARRAYS: dict[str, list[object]] = {
    "t.ints": [1, -2, 3],
    "t.floats": [0.5, -1.25, 1e10],
    "t.strs": ["a", "", "ünïcode", "<|im_end|>"],
    "t.bools": [True, False, True],
    "t.nested": [[1, 2], [3]],
}


def write_model(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vtype, value) in METADATA.items():
        w.add_key_value(key, value, vtype)
    for key, values in ARRAYS.items():
        w.add_array(key, values)
    w.add_tensor("f32_2d", F32_2D)
    w.add_tensor("f32_3d", F32_3D)
    w.add_tensor("f16", F16_2D)
    w.add_tensor("q8", gguf.quants.quantize(Q8_SOURCE, T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("q4k", Q4K_BLOCKS, raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model.gguf")


def test_metadata_types(model_path: Path) -> None:
    with GGUFFile(model_path) as f:
        assert f.version == 3
        assert f.alignment == 32
        assert f.architecture == "llama"
        for key, (vtype, value) in METADATA.items():
            got = f.metadata[key]
            if vtype == V.FLOAT32:
                assert got == float(np.float32(value))
            else:
                assert got == value and type(got) is type(value), key
        assert f.metadata["t.ints"] == [1, -2, 3]
        assert f.metadata["t.floats"] == [0.5, -1.25, 1e10]
        assert f.metadata["t.strs"] == ARRAYS["t.strs"]
        assert f.metadata["t.bools"] == [True, False, True]
        assert all(type(b) is bool for b in f.metadata["t.bools"])
        assert f.metadata["t.nested"] == [[1, 2], [3]]
        assert f.get("t.u8") == 200
        assert f.get("missing") is None
        assert f.get("missing", 7) == 7


def test_tensor_table(model_path: Path) -> None:
    ref = gguf.GGUFReader(model_path)
    with GGUFFile(model_path) as f:
        assert list(f.tensors) == ["f32_2d", "f32_3d", "f16", "q8", "q4k"]
        expected = {
            "f32_2d": (T.F32, (3, 64), (3, 256)),
            "f32_3d": (T.F32, (2, 3, 4), (2, 3, 16)),
            "f16": (T.F16, (2, 8), (2, 16)),
            "q8": (T.Q8_0, (4, 64), (4, 68)),
            "q4k": (T.Q4_K, (2, 512), (2, 288)),
        }
        for (name, t), rt in zip(f.tensors.items(), ref.tensors, strict=True):
            ggml_type, shape, raw_shape = expected[name]
            assert isinstance(t, GGUFTensor)
            assert (t.name, t.ggml_type, t.shape) == (name, ggml_type, shape)
            assert t.raw.dtype == torch.uint8 and t.raw.shape == raw_shape
            assert t.offset == rt.data_offset and t.offset % f.alignment == 0
            assert t.nbytes == rt.n_bytes == t.raw.numel()
            assert t.n_elements == rt.n_elements
            assert f.data_offset == ref.data_offset


def test_dequantize_values(model_path: Path) -> None:
    with GGUFFile(model_path) as f:
        assert torch.equal(f.tensors["f32_2d"].dequantize(), torch.from_numpy(F32_2D))
        assert torch.equal(f.tensors["f32_3d"].dequantize(), torch.from_numpy(F32_3D))
        assert torch.equal(f.tensors["f16"].dequantize(), torch.from_numpy(F16_2D.astype(np.float32)))
        q8 = gguf.quants.dequantize(gguf.quants.quantize(Q8_SOURCE, T.Q8_0), T.Q8_0)
        assert torch.equal(f.tensors["q8"].dequantize(), torch.from_numpy(q8))
        q4k = f.tensors["q4k"].dequantize()
        assert torch.equal(q4k, torch.from_numpy(gguf.quants.dequantize(Q4K_BLOCKS, T.Q4_K)))
        bf16 = f.tensors["q4k"].dequantize(torch.bfloat16, device="cpu")
        assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, q4k.to(torch.bfloat16))


def test_raw_is_a_zero_copy_view_of_the_map(model_path: Path) -> None:
    size = model_path.stat().st_size
    with GGUFFile(model_path) as f:
        tensors = list(f.tensors.values())
        storage = tensors[0].raw.untyped_storage()
        # One buffer the size of the file backs every tensor, each at its file offset.
        assert storage.nbytes() == size
        for t in tensors:
            assert t.raw.untyped_storage().data_ptr() == storage.data_ptr()
            assert t.raw.data_ptr() - storage.data_ptr() == t.offset
        # Bytes seen through the view are the file's bytes.
        content = model_path.read_bytes()
        q8 = f.tensors["q8"]
        assert bytes(q8.raw.reshape(-1).numpy()) == content[q8.offset : q8.offset + q8.nbytes]


def test_writes_to_raw_stay_private(model_path: Path) -> None:
    """The map is copy-on-write: a view is writable, and the file never changes."""
    before = model_path.read_bytes()
    with GGUFFile(model_path) as f:
        raw = f.tensors["f32_2d"].raw
        raw.fill_(0)
        assert int(raw.sum()) == 0
    assert model_path.read_bytes() == before
    with GGUFFile(model_path) as f:
        assert torch.equal(f.tensors["f32_2d"].dequantize(), torch.from_numpy(F32_2D))


def _mapped_kb(path: Path) -> int:
    """Resident kB of this process's mappings of `path`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = len(fields) > 5 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_release_pages_drops_the_map_from_rss_and_keeps_the_data(tmp_path: Path) -> None:
    values = np.arange(1 << 20, dtype=np.float32)  # 4 MB
    path = tmp_path / "big.gguf"
    path.write_bytes(gguf_bytes(infos=[tensor_info("w", [1 << 20], T.F32, 0)], data=values.tobytes()))
    with GGUFFile(path) as f:
        raw = f.tensors["w"].raw
        assert int(raw.sum()) > 0  # every page read through the map
        assert _mapped_kb(path) >= 4000
        f.release_pages()
        assert _mapped_kb(path) < 512
        # A later read faults the file's bytes in again.
        assert torch.equal(f.tensors["w"].dequantize(), torch.from_numpy(values))


def test_custom_alignment(tmp_path: Path) -> None:
    path = write_model(tmp_path / "aligned.gguf", alignment=64)
    with GGUFFile(path) as f:
        assert f.alignment == 64 and f.metadata["general.alignment"] == 64
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
        assert torch.equal(f.tensors["f32_3d"].dequantize(), torch.from_numpy(F32_3D))


def test_version_2(model_path: Path, write: Callable[[bytes], Path]) -> None:
    """v2 and v3 share one layout (v3 only added big-endian files)."""
    content = bytearray(model_path.read_bytes())
    content[4:8] = u32(2)
    with GGUFFile(write(bytes(content))) as f:
        assert f.version == 2
        assert f.metadata["t.strs"] == ARRAYS["t.strs"]
        assert torch.equal(f.tensors["f32_2d"].dequantize(), torch.from_numpy(F32_2D))


def test_close_keeps_handed_out_tensors_valid(model_path: Path) -> None:
    with GGUFFile(model_path) as f:
        t = f.tensors["q8"]
    assert f.tensors == {}
    assert "closed" in repr(f)
    # The view keeps the map alive after the file object lets go of it.
    assert torch.equal(t.dequantize(), dequantize(t.raw, T.Q8_0))


def test_no_tensors_and_no_architecture(write: Callable[[bytes], Path]) -> None:
    with GGUFFile(write(gguf_bytes([kv_u32("a", 1)]))) as f:
        assert f.tensors == {} and f.metadata == {"a": 1}
        with pytest.raises(GGUFError, match=r"general\.architecture"):
            _ = f.architecture


def test_type_without_dequantizer(write: Callable[[bytes], Path]) -> None:
    """A type the reader knows but Bubo cannot dequantize opens fine and fails on use."""
    path = write(gguf_bytes([ARCH], [tensor_info("blk.0.x", [256, 1], T.IQ2_XXS, 0)], bytes(66)))
    with GGUFFile(path) as f:
        t = f.tensors["blk.0.x"]
        assert t.ggml_type == T.IQ2_XXS and t.raw.shape == (1, 66)
        with pytest.raises(GGUFError, match=r"'blk\.0\.x'.*IQ2_XXS") as info:
            t.dequantize()
        assert str(path) in str(info.value)


def test_huge_file_opens_without_reading_data(tmp_path: Path) -> None:
    """A 4 GiB tensor (a sparse file): opening parses the header only and maps the rest."""
    ne = [1 << 15, 1 << 15]  # F32: 4 GiB
    path = tmp_path / "huge.gguf"
    header = gguf_bytes([ARCH], [tensor_info("big", ne, T.F32, 0)])
    with path.open("wb") as fh:
        fh.write(header)
        fh.truncate(len(header) + 4 * ne[0] * ne[1])
    rss_before = _rss_bytes()
    # CPU time, which a busy neighbour cannot inflate: reading 4 GiB of zeros would take seconds of it.
    start = time.process_time()
    f = GGUFFile(path)
    elapsed = time.process_time() - start
    assert f.tensors["big"].shape == (1 << 15, 1 << 15)
    assert elapsed < 1.0
    if rss_before is not None:
        assert _rss_bytes() - rss_before < 64 << 20, "opening must not read tensor data"
    # Touching one row reads one row.
    assert int(f.tensors["big"].raw[12345, :16].sum()) == 0
    f.close()


def _rss_bytes() -> int | None:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


# -- corrupt and unsupported files --------------------------------------------------------------

HUGE = 1 << 60
W_Q8_HEADER = b"GGUF" + u32(3) + u64(1) + u64(1) + ARCH


def one_kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gguf_bytes([kv(key, vtype, payload)])


def one_tensor(infos: Sequence[bytes], data: bytes = b"") -> bytes:
    return gguf_bytes([ARCH], infos, data)


BAD_FILES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", r"truncated: 0 bytes is too short"),
    "short header": (b"GGUF" + u32(3) + u64(0), r"too short for a GGUF header"),
    "bad magic": (b"GGML" + gguf_bytes()[4:], r"not a GGUF file \(magic b'GGML'"),
    "version 1": (gguf_bytes(version=1), r"unsupported GGUF version 1 \(supported: 2, 3\)"),
    "version 4": (gguf_bytes(version=4), r"unsupported GGUF version 4"),
    "big-endian": (
        b"GGUF" + struct.pack(">I", 3) + bytes(16),
        r"big-endian GGUF \(version 3\) is not supported",
    ),
    "huge kv count": (gguf_bytes(n_kv=HUGE), rf"metadata count is {HUGE}, but only \d+ bytes remain"),
    "huge tensor count": (
        gguf_bytes([ARCH], n_tensors=HUGE),
        rf"tensor count is {HUGE}, but only \d+ bytes remain",
    ),
    "metadata cut short": (
        gguf_bytes([ARCH, kv_u32("b", 1)])[: 24 + len(ARCH) + 9],
        r"truncated: value type of metadata 'b' needs 4 bytes",
    ),
    "huge key length": (gguf_bytes([u64(HUGE) + b"k"]), rf"truncated: metadata key needs {HUGE} bytes"),
    "huge string value": (one_kv("k", V.STRING, u64(HUGE)), rf"truncated: metadata 'k' needs {HUGE} bytes"),
    "huge array": (
        one_kv("k", V.ARRAY, u32(V.UINT32) + u64(HUGE)),
        rf"length of metadata array 'k' is {HUGE}",
    ),
    "huge string array": (
        one_kv("k", V.ARRAY, u32(V.STRING) + u64(HUGE)),
        r"length of metadata array 'k' is",
    ),
    "huge nested array": (one_kv("k", V.ARRAY, u32(V.ARRAY) + u64(HUGE)), r"length of metadata array 'k' is"),
    "huge string in array": (
        one_kv("k", V.ARRAY, u32(V.STRING) + u64(2) + gstr("ok") + u64(HUGE) + bytes(16)),
        rf"truncated: string 1 of metadata 'k' is {HUGE} bytes",
    ),
    "unknown value type": (one_kv("k", 13, u32(0)), r"metadata 'k' has unknown value type 13"),
    "unknown array type": (
        one_kv("k", V.ARRAY, u32(99) + u64(1)),
        r"'k' is an array of unknown value type 99",
    ),
    "arrays nested too deep": (
        one_kv("k", V.ARRAY, (u32(V.ARRAY) + u64(1)) * 9 + u32(V.UINT8) + u64(1) + b"x"),
        r"metadata 'k' nests arrays deeper than 8 levels",
    ),
    "bad utf-8 key": (one_kv(b"k\xff", V.UINT8, b"\x01"), r"metadata key is not valid UTF-8"),
    "bad utf-8 string": (one_kv("k", V.STRING, gstr(b"\xc3(")), r"metadata 'k' is not valid UTF-8"),
    "bad utf-8 in array": (
        one_kv("k", V.ARRAY, u32(V.STRING) + u64(2) + gstr("a") + gstr(b"\xe2\x28\xa1")),
        r"string 1 of metadata 'k' is not valid UTF-8",
    ),
    "duplicate key": (gguf_bytes([kv_u32("a", 1), kv_u32("a", 2)]), r"duplicate metadata key 'a'"),
    "alignment not a power of two": (
        gguf_bytes([kv_u32("general.alignment", 48)]),
        r"general.alignment must be a power of two, got 48",
    ),
    "alignment zero": (gguf_bytes([kv_u32("general.alignment", 0)]), r"must be a power of two, got 0"),
    "alignment string": (
        gguf_bytes([kv_str("general.alignment", "32")]),
        r"must be a power of two, got '32'",
    ),
    "too many dims": (
        one_tensor([tensor_info("w", [32, 1, 1, 1, 1], T.Q8_0, 0)]),
        r"tensor 'w' has 5 dimensions \(must be 1 to 4\)",
    ),
    "zero dims": (one_tensor([tensor_info("w", [], T.F32, 0)]), r"tensor 'w' has 0 dimensions"),
    "huge n_dims": (one_tensor([gstr("w") + u32(2**32 - 1)]), r"tensor 'w' has 4294967295 dimensions"),
    "dims overflow": (
        one_tensor([tensor_info("w", [1 << 40, 1 << 40], T.F32, 0)]),
        r"tensor 'w' has dimensions \[1099511627776, 1099511627776\] whose element count overflows int64",
    ),
    "dim past int64": (one_tensor([tensor_info("w", [2**64 - 1], T.F32, 0)]), r"overflows int64"),
    "unknown ggml type": (
        one_tensor([tensor_info("w", [32], 99, 0)], bytes(64)),
        r"tensor 'w' has unknown ggml type id 99",
    ),
    "removed ggml type": (
        one_tensor([tensor_info("w", [32], 4, 0)], bytes(64)),
        r"tensor 'w' has unknown ggml type id 4",
    ),
    "row not whole blocks": (
        one_tensor([tensor_info("w", [33, 2], T.Q8_0, 0)], bytes(136)),
        r"tensor 'w' \(Q8_0\) has rows of 33 elements, not a multiple of the block size 32",
    ),
    "misaligned offset": (
        one_tensor([tensor_info("w", [8], T.F32, 8)], bytes(64)),
        r"tensor 'w' data offset 8 is not a multiple of the alignment 32",
    ),
    "data past end": (
        one_tensor([W_Q8], Q8_BLOCKS[:67]),
        r"truncated: tensor 'w' data spans bytes \d+\.\.\d+ but the file ends at \d+",
    ),
    "data offset past end": (
        one_tensor([tensor_info("w", [8], T.F32, 1 << 62)]),
        r"truncated: tensor 'w' data spans",
    ),
    "overlap": (
        one_tensor([W_Q8, tensor_info("v", [32], T.Q8_0, 32)], Q8_BLOCKS),
        r"tensor data overlaps: 'v' starts at \d+, inside 'w'",
    ),
    "duplicate tensor": (
        one_tensor([W_Q8, tensor_info("w", [32], T.Q8_0, 96)], Q8_BLOCKS + bytes(62)),
        r"duplicate tensor name 'w'",
    ),
    "tensor info cut short": (W_Q8_HEADER + W_Q8[:-3], r"truncated: data offset of tensor 'w' needs 8 bytes"),
}


@pytest.mark.parametrize(("content", "pattern"), BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_file(write: Callable[[bytes], Path], content: bytes, pattern: str) -> None:
    expect_error(write(content), pattern)


def test_every_truncation_is_reported(model_path: Path, write: Callable[[bytes], Path]) -> None:
    """Cut anywhere before the end of the last tensor's data: always a GGUFError, never a crash."""
    content = model_path.read_bytes()
    with GGUFFile(model_path) as f:
        end = max(t.offset + t.nbytes for t in f.tensors.values())
        data_offset = f.data_offset
    cuts = list(range(data_offset + 1)) + list(range(data_offset + 1, end, 7))
    for cut in cuts:
        with pytest.raises(GGUFError, match=r"truncated|too short"):
            GGUFFile(write(content[:cut]))


def test_random_corruption_never_crashes(model_path: Path, write: Callable[[bytes], Path]) -> None:
    """Flip random header bytes: the file either opens or raises GGUFError, nothing else."""
    content = model_path.read_bytes()
    with GGUFFile(model_path) as f:
        header_end = f.data_offset
    rng = np.random.default_rng(99)
    opened = 0
    for _ in range(400):
        corrupt = bytearray(content)
        for pos in rng.integers(4, header_end, size=rng.integers(1, 4)):
            corrupt[pos] = rng.integers(0, 256)
        try:
            with GGUFFile(write(bytes(corrupt))) as f:
                for t in f.tensors.values():
                    assert t.offset + t.nbytes <= len(corrupt)
            opened += 1
        except GGUFError:
            pass
    assert opened < 400  # most corruptions are caught
