"""The compiled Q4_0 / Q4_1 matvec and its unpacking against gguf's numpy dequantizer + a float64 matvec."""

import gguf
import numpy as np
import pytest
import torch

from bubo.kernels import codes
from bubo.kernels.q4_matvec import pack_q4, q4_matvec, q4_matvec_reference

Q = gguf.GGMLQuantizationType


# The float matvecs, exact activations (tests/conftest.py); the int8 ones: tests/kernels/test_int8_matvec.py.
pytestmark = pytest.mark.usefixtures("float_matvecs")


def _blocks(qtype: Q, out_features: int, in_features: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return gguf.quants.quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), qtype)


def _numpy_weight(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
# 44 rows: not a whole number of tiles (8 or 16 rows), so the last tile is padding.
@pytest.mark.parametrize(("out_features", "in_features"), [(40, 64), (72, 160), (44, 64)])
def test_matvec_matches_float64_reference(qtype: Q, out_features: int, in_features: int) -> None:
    raw = _blocks(qtype, out_features, in_features, seed=out_features)
    packed = pack_q4(torch.from_numpy(raw), qtype)
    x = torch.randn(in_features, generator=torch.Generator().manual_seed(1))
    expected = _numpy_weight(raw, qtype) @ x.double()
    with torch.inference_mode():
        got = q4_matvec(x, packed)
    assert got.shape == (out_features,)
    # float32 sums of in_features products, in another order than float64's: a few ulps of |y| ~ 10.
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(q4_matvec_reference(x, torch.from_numpy(raw), qtype), expected)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_unpack_is_bit_exact(qtype: Q) -> None:
    raw = _blocks(qtype, 26, 96, seed=3)
    packed = pack_q4(torch.from_numpy(raw), qtype)
    weight = gguf.quants.dequantize(raw, qtype)
    assert torch.equal(packed.unpack(0, 26).T, torch.from_numpy(weight))
    assert torch.equal(packed.unpack(5, 11).T, torch.from_numpy(weight[5:11]))
    assert torch.equal(packed.unpack(17, 26).T, torch.from_numpy(weight[17:26]))
    # A prefill's GEMM takes the weight in bfloat16: each value rounded once from the exact float32.
    rounded = torch.from_numpy(weight).to(torch.bfloat16)
    assert torch.equal(packed.unpack(5, 11, torch.bfloat16).T, rounded[5:11])
    assert torch.equal(packed.unpack(0, 26, torch.bfloat16).T, rounded)


def test_every_code_and_scale_sign_round_trips() -> None:
    # Random bytes reach every nibble value (code 15 in the top nibble sets an int32 word's sign bit).
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(16, 4, 20), dtype=np.uint8)
    raw[..., :4] = rng.uniform(-1, 1, size=(16, 4, 2)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(16, 80)
    packed = pack_q4(torch.from_numpy(raw), Q.Q4_1)
    assert torch.equal(packed.unpack(0, 16).T, torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_1)))


def test_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="Q4_0 or Q4_1"):
        pack_q4(torch.zeros(2, 34, dtype=torch.uint8), Q.Q8_0)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_packing_in_row_steps_matches_the_blocks(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps of two tiles over 5 tiles + 3 rows: several steps, the last one short and padded.
    monkeypatch.setattr(codes, "PACK_ROWS", 2 * codes.TILE)
    rows = 5 * codes.TILE + 3
    raw = _blocks(qtype, rows, 64, seed=11)
    packed = pack_q4(torch.from_numpy(raw), qtype)
    assert torch.equal(packed.unpack(0, rows).T, torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    x = torch.randn(64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        got = q4_matvec(x, packed)
    torch.testing.assert_close(got.double(), _numpy_weight(raw, qtype) @ x.double(), rtol=1e-5, atol=2e-5)


def _with_scale(raw: np.ndarray, d: float) -> np.ndarray:
    """Q4_0 blocks with the first block's fp16 d replaced by `d`."""
    raw = raw.copy()
    raw[0, :2] = np.array([d], dtype=np.float16).view(np.uint8)
    return raw


def test_scales_and_offsets_are_float16_where_exact() -> None:
    # Q4_1's d and m are fp16 in the file: kept so. Q4_0's offset -8d is too unless it overflows fp16:
    # d = 10000 makes -80000, which float16 can't hold, so that matrix keeps float32 fields.
    q4_1 = pack_q4(torch.from_numpy(_blocks(Q.Q4_1, 32, 64, seed=5)), Q.Q4_1)
    assert q4_1.scale_offset.dtype == torch.float16 and q4_1.scale_offset.shape[-2] == 2
    raw = _with_scale(_blocks(Q.Q4_0, 32, 64, seed=6), 10000.0)
    packed = pack_q4(torch.from_numpy(raw), Q.Q4_0)
    assert packed.scale_offset.dtype == torch.float32
    weight = gguf.quants.dequantize(raw, Q.Q4_0)
    assert np.abs(weight).max() >= 70000
    assert torch.equal(packed.unpack(0, 32).T, torch.from_numpy(weight))
    x = torch.randn(64, generator=torch.Generator().manual_seed(2))
    expected = _numpy_weight(raw, Q.Q4_0) @ x.double()
    with torch.inference_mode():
        got = q4_matvec(x, packed)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
