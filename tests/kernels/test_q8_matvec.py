"""The compiled Q8_0 matvec and its unpacking against gguf's numpy dequantizer + a float64 matvec."""

import gguf
import numpy as np
import pytest
import torch

from bubo.kernels import codes
from bubo.kernels.q8_matvec import pack_q8, q8_matvec, q8_matvec_reference

Q = gguf.GGMLQuantizationType


# The float matvecs, exact activations (tests/conftest.py); the int8 ones: tests/kernels/test_int8_matvec.py.
pytestmark = pytest.mark.usefixtures("float_matvecs")


# 60 rows: not a whole number of tiles (8 or 16 rows), so the last tile is padding.
@pytest.mark.parametrize("out_features", [56, 60])
def test_matvec_matches_float64_reference(out_features: int) -> None:
    rng = np.random.default_rng(0)
    raw = gguf.quants.quantize(rng.standard_normal((out_features, 128), dtype=np.float32), Q.Q8_0)
    packed = pack_q8(torch.from_numpy(raw))
    x = torch.randn(128, generator=torch.Generator().manual_seed(1))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0).astype(np.float64)) @ x.double()
    with torch.inference_mode():
        got = q8_matvec(x, packed)
    assert got.shape == (out_features,)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(q8_matvec_reference(x, torch.from_numpy(raw)), expected)


def test_every_byte_unpacks_exactly_and_multiplies_right() -> None:
    # Random bytes cover all 256 codes in every byte position of a word (signs included; -128 too, which
    # the quantizer never writes): PackedQ8 stores them biased, and the matvec takes the bias back out.
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, size=(35, 3, 34), dtype=np.uint8)
    raw[..., :2] = rng.uniform(-1, 1, size=(35, 3, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(35, 102)
    packed = pack_q8(torch.from_numpy(raw))
    weight = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0))
    assert torch.equal(packed.unpack(0, 35).T, weight)
    assert torch.equal(packed.unpack(30, 35).T, weight[30:35])
    assert torch.equal(packed.unpack(9, 20).T, weight[9:20])
    # A prefill's GEMM takes the weight in bfloat16: each value rounded once from the exact float32.
    assert torch.equal(packed.unpack(9, 20, torch.bfloat16).T, weight[9:20].to(torch.bfloat16))
    x = torch.randn(96, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = q8_matvec(x, packed)
    expected = weight.double() @ x.double()
    # float32 sums of ~100 products of up to 127 * |scale|: errors relative to the largest output.
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6 * expected.abs().max().item())


def test_packing_in_row_steps_matches_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps of two tiles over 5 tiles + 3 rows: several steps, the last one short and padded.
    monkeypatch.setattr(codes, "PACK_ROWS", 2 * codes.TILE)
    rows = 5 * codes.TILE + 3
    raw = gguf.quants.quantize(np.random.default_rng(5).standard_normal((rows, 64), dtype=np.float32), Q.Q8_0)
    packed = pack_q8(torch.from_numpy(raw))
    weight = gguf.quants.dequantize(raw, Q.Q8_0)
    assert torch.equal(packed.unpack(0, rows).T, torch.from_numpy(weight))
    x = torch.randn(64, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        got = q8_matvec(x, packed)
    expected = torch.from_numpy(weight.astype(np.float64)) @ x.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
