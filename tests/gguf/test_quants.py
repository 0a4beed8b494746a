"""bubo.gguf.quants against gguf.quants.dequantize (numpy), bit for bit, on random blocks."""

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from bubo.gguf import quants
from bubo.gguf.quants import SUPPORTED_TYPES, block_size, dequantize, type_size

T = GGMLQuantizationType

EXPECTED_TYPES = {
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
}  # fmt: skip

# Byte offsets of the fp16 scale fields inside one block. Random bytes are a valid block once
# these are finite (elsewhere every bit pattern is a legal quant).
FP16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}  # fmt: skip

ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)
# (leading dims, blocks per row): one block, one row, several rows, a 3-D stack.
SHAPES = [((), 1), ((1,), 3), ((5,), 4), ((2, 3), 2)]


def random_blocks(qtype: GGMLQuantizationType, lead: tuple[int, ...], n_blocks: int, seed: int) -> np.ndarray:
    """uint8 `[*lead, n_blocks * type_size]` of random blocks with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    ts = type_size(qtype)
    raw = rng.integers(0, 256, size=(*lead, n_blocks * ts), dtype=np.uint8)
    blocks = raw.reshape(-1, ts)
    for offset in FP16_FIELDS.get(qtype, ()):
        # Scales across magnitudes, both signs, fp16 subnormals and zeros included.
        magnitude = rng.choice([0.0, 1e-7, 1e-4, 1e-2, 1.0, 300.0], size=blocks.shape[0])
        scales = (rng.standard_normal(blocks.shape[0]) * magnitude).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def reference(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw, qtype), dtype=np.float32))


def assert_bit_exact(actual: torch.Tensor, expected: torch.Tensor, qtype: GGMLQuantizationType) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    if qtype == T.F16:
        # torch's fp16->fp32 conversion quiets NaNs (numpy keeps the payload); every other value,
        # infinities and signed zeros included, must match bit for bit.
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan)
        actual, expected = actual[~nan], expected[~nan]
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32)), (
        f"{qtype.name}: {(actual != expected).sum().item()} of {actual.numel()} values differ"
    )


def test_supported_types() -> None:
    assert set(SUPPORTED_TYPES) == EXPECTED_TYPES
    for qtype in ALL_TYPES:
        assert (block_size(qtype), type_size(qtype)) == GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("lead", "n_blocks"), SHAPES, ids=lambda x: str(x))
def test_matches_reference(qtype: GGMLQuantizationType, lead: tuple[int, ...], n_blocks: int) -> None:
    raw = random_blocks(qtype, lead, n_blocks, seed=qtype.value * 100 + n_blocks)
    out = dequantize(torch.from_numpy(raw), qtype)
    assert out.shape == (*lead, n_blocks * block_size(qtype))
    assert_bit_exact(out, reference(raw, qtype), qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_many_blocks(qtype: GGMLQuantizationType) -> None:
    """Enough blocks that every scale/bit pattern path is exercised many times."""
    raw = random_blocks(qtype, (16,), 8192 // block_size(qtype), seed=7)
    assert_bit_exact(dequantize(torch.from_numpy(raw), qtype), reference(raw, qtype), qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_misaligned_and_strided_input(qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, (6,), 3, seed=11)
    expected = reference(raw, qtype)
    # Starting one byte into a buffer defeats every aligned view inside.
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw).reshape(-1)
    assert_bit_exact(dequantize(buf[1:].view(raw.shape), qtype), expected, qtype)
    # Every other row: not contiguous.
    assert_bit_exact(dequantize(torch.from_numpy(raw)[::2], qtype), expected[::2], qtype)
    # A single block sliced out of the middle of a row.
    ts = type_size(qtype)
    one = torch.from_numpy(raw)[1, ts : 2 * ts]
    assert_bit_exact(dequantize(one, qtype), expected[1, block_size(qtype) : 2 * block_size(qtype)], qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dtype_is_float32_result_cast(qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    raw = torch.from_numpy(random_blocks(qtype, (3,), 2, seed=3))
    expected = dequantize(raw, qtype).to(dtype)
    out = dequantize(raw, qtype, dtype)
    assert out.dtype == dtype
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_out_buffer_is_filled_and_returned(dtype: torch.dtype) -> None:
    raw = torch.from_numpy(random_blocks(T.Q4_K, (4,), 2, seed=5))
    out = torch.full((4, 512), float("nan"), dtype=dtype)
    result = dequantize(raw, T.Q4_K, dtype, out=out)
    assert result is out
    assert torch.equal(out, dequantize(raw, T.Q4_K, dtype))


def test_result_does_not_alias_raw() -> None:
    raw = torch.from_numpy(random_blocks(T.F32, (2,), 8, seed=1))
    out = dequantize(raw, T.F32)
    out.fill_(0)
    assert torch.equal(dequantize(raw, T.F32), reference(raw.numpy(), T.F32))


def test_empty_input() -> None:
    out = dequantize(torch.empty(0, 34, dtype=torch.uint8), T.Q8_0)
    assert out.shape == (0, 32) and out.dtype == torch.float32


def test_errors() -> None:
    with pytest.raises(NotImplementedError, match="IQ2_XXS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), T.IQ2_XXS)
    with pytest.raises(ValueError, match="not a whole number of 18-byte blocks"):
        dequantize(torch.zeros(2, 20, dtype=torch.uint8), T.Q4_0)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(2, 18, dtype=torch.int8), T.Q4_0)
    with pytest.raises(ValueError, match="out must be"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), T.Q4_0, out=torch.empty(2, 31))


def test_tables_follow_the_device() -> None:
    """Lookup tables are made per device, never fixed to the CPU."""
    meta = torch.device("meta")
    assert quants._iq4_codebook(meta).device == meta
    assert quants._q5_high_words(meta).device == meta


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_reference(qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, (8,), 16, seed=13)
    out = dequantize(torch.from_numpy(raw).cuda(), qtype)
    assert out.device.type == "cuda"
    assert_bit_exact(out.cpu(), reference(raw, qtype), qtype)
