"""The int8 matvecs (bubo/kernels/int8_matvec.py) against a float64 reference built from gguf's numpy
dequantizer and activations quantized here, per block of 32, as llama.cpp quantizes them: random blocks of
every type they run (Q4_K, Q6_K, Q4_0, Q4_1, Q8_0, and Q5_0 and IQ4_NL repacked as Q8_0), several rows, a
stack of experts read by id, the Q6_K layout's unpacking bit for bit, inside a compiled graph, and the
switch that turns them off."""

from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch

from bubo.kernels import int8_matvec
from bubo.kernels.codes import TILE, slice_tiled
from bubo.kernels.compiled import StaticKernel
from bubo.kernels.int8_matvec import (
    PackedQ6KInt8,
    q4_int8_matvec,
    q4_k_int8_matvec,
    q6_k_int8_matvec,
    q8_int8_matvec,
)
from bubo.kernels.q4_matvec import PackedQ4, pack_q4
from bubo.kernels.q8_matvec import PackedQ8, pack_q8
from bubo.kernels.repack import Packed, repack
from bubo.kernels.super_block_matvec import PackedSuperBlocks
from bubo.model import quantized_linear
from bubo.model.quantized_linear import QuantizedLinear
from tests.fixtures.op_calls import OpCalls
from tests.kernels.k_blocks import random_blocks

Q = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(
    not int8_matvec._loaded(), reason="the int8 kernels need AVX512-VNNI or AVX2 and a C++ compiler"
)


@pytest.fixture(autouse=True)
def int8_on(runtime_options: Callable[..., None]) -> None:
    runtime_options(int8_matvec=True)


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] as the kernels multiply it: per 32 values a scale amax / 127 (float32) and the values
    rounded to the nearest integer multiple of it (ties to even), in float64."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse)
    return (q.double() * d.double()).view_as(x)


def _weight(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64))


# The types the int8 kernels run, and the layout each is packed in.
LAYOUTS = {
    Q.Q4_K: PackedSuperBlocks,
    Q.Q6_K: PackedQ6KInt8,
    Q.Q4_0: PackedQ4,
    Q.Q4_1: PackedQ4,
    Q.Q8_0: PackedQ8,
    Q.Q5_0: PackedQ8,
    Q.IQ4_NL: PackedQ8,
}


def _blocks(qtype: Q, rows: int, in_features: int, seed: int) -> np.ndarray:
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):  # gguf's numpy code quantizes these (random bytes would do too)
        weight = np.random.default_rng(seed).standard_normal((rows, in_features), dtype=np.float32)
        return gguf.quants.quantize(weight, qtype)
    return random_blocks(qtype, rows, in_features, seed)


def _pack(raw: np.ndarray, qtype: Q) -> Packed:
    blocks = torch.from_numpy(raw)
    if qtype in (Q.Q4_0, Q.Q4_1):
        return pack_q4(blocks, qtype)
    return pack_q8(blocks) if qtype == Q.Q8_0 else repack(blocks, qtype)


def _product(packed: Packed, x: torch.Tensor, **experts: object) -> torch.Tensor:
    if isinstance(packed, PackedQ6KInt8):
        return q6_k_int8_matvec(x, packed.words, packed.factors, **experts)  # type: ignore[arg-type]
    if isinstance(packed, PackedQ4):
        return q4_int8_matvec(x, packed.words, packed.scale_offset, **experts)  # type: ignore[arg-type]
    if isinstance(packed, PackedQ8):
        return q8_int8_matvec(x, packed.words, **experts)  # type: ignore[arg-type]
    assert isinstance(packed, PackedSuperBlocks)
    return q4_k_int8_matvec(x, packed.words, packed.fields, packed.factors, **experts)  # type: ignore[arg-type]


@pytest.mark.parametrize("qtype", list(LAYOUTS))
def test_matches_the_reference_on_quantized_activations(qtype: Q) -> None:
    raw = _blocks(qtype, 2 * TILE + 3, 1024, seed=1)
    packed = _pack(raw, qtype)
    assert isinstance(packed, LAYOUTS[qtype])
    # Six rows: the kernels take four at a time (the codes unpacked once for them), then the other two.
    x = torch.randn(6, 1024, generator=torch.Generator().manual_seed(2))
    x[1, :32] = 0  # a block of zeros: scale 0, no division by it
    weight = _weight(raw, qtype)
    got = packed.matvec(x)
    assert got.shape == (6, 2 * TILE + 3)
    expected = _quantized(x) @ weight.T
    # float32 sums of 1024 products in another order than float64's.
    bound = (x.abs().double() @ weight.abs().T).max().item()
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-6 * bound)
    # What quantizing the activations costs against exact ones: a small fraction of the terms' magnitude.
    assert (got.double() - x.double() @ weight.T).abs().max().item() < 5e-3 * bound
    for row, alone in zip(got, (packed.matvec(r) for r in x), strict=True):
        assert torch.equal(row, alone)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q8_0])
def test_experts_by_id_are_their_slices_products(qtype: Q) -> None:
    experts, rows = 5, 2 * TILE
    packed = _pack(_blocks(qtype, experts * rows, 512, seed=3), qtype)
    picked = torch.tensor([4, 0, 4, 2])  # expert 4 twice: its two pairs share one pass over its tiles
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    each = _product(packed, x, experts=picked, expert_rows=rows)
    shared = _product(packed, x[:1], experts=picked, expert_rows=rows)
    # Two rows with two experts each (a batched step's rows, their top-k ids one after the other).
    pairs = _product(packed, x[:2], experts=picked, expert_rows=rows)
    assert each.shape == shared.shape == pairs.shape == (4, rows)
    for i, e in enumerate(picked.tolist()):
        alone = slice_tiled(packed, e * rows, (e + 1) * rows)
        assert torch.equal(each[i], _product(alone, x[i : i + 1])[0])
        assert torch.equal(shared[i], _product(alone, x[:1])[0])
        assert torch.equal(pairs[i], _product(alone, x[i // 2 : i // 2 + 1])[0])


def test_q8_codes_at_both_ends_of_the_byte_range() -> None:
    """Codes -128 and 127 (gguf's quantizer writes -127..127, another may write -128) against activations
    of full magnitude: stored plus 128 they are bytes 0 and 255, whose products AVX2's byte instruction
    would saturate if it summed two of them into int16 as they are."""
    raw = _blocks(Q.Q8_0, 2 * TILE, 256, seed=4)
    codes = raw.reshape(2 * TILE, -1, 34)[:, :, 2:].view(np.int8)
    codes[::2] = 127
    codes[1::2] = -128
    packed = _pack(raw, Q.Q8_0)
    x = torch.ones(2, 256)
    x[1, ::2] = -1  # products of both signs
    weight = _weight(raw, Q.Q8_0)
    bound = (x.abs().double() @ weight.abs().T).max().item()
    torch.testing.assert_close(packed.matvec(x).double(), _quantized(x) @ weight.T, rtol=0, atol=2e-6 * bound)


def test_rejects_an_expert_out_of_range() -> None:
    packed = repack(torch.from_numpy(random_blocks(Q.Q4_K, 4 * TILE, 256, seed=5)), Q.Q4_K)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        _product(packed, torch.zeros(1, 256), experts=torch.tensor([2]), expert_rows=2 * TILE)
    with pytest.raises(RuntimeError, match="whole number of ids"):
        _product(packed, torch.zeros(2, 256), experts=torch.tensor([0, 1, 0]), expert_rows=2 * TILE)
    with pytest.raises(RuntimeError, match="float32"):
        _product(packed, torch.zeros(1, 512))


def test_q6_k_layout_unpacks_bit_exactly() -> None:
    raw = random_blocks(Q.Q6_K, 2 * TILE + 3, 512, seed=6)
    packed = repack(torch.from_numpy(raw), Q.Q6_K)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K))
    assert torch.equal(packed.unpack(0, packed.out_features).T, weight)
    assert torch.equal(packed.unpack(3, 2 * TILE, torch.bfloat16).T, weight[3 : 2 * TILE].to(torch.bfloat16))
    # 6.625 bits a weight: a word of codes' low nibbles per 8 weights, of high bits per 16, scales, d.
    held = sum(t.numel() * t.element_size() for t in (packed.words, packed.factors))
    assert held * 8 / (packed.words.shape[0] * TILE * 512) == 6.625


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q5_0])
# One row, a few (one call for all of them), and a prefill's (unpacked column chunks for a GEMM, exact).
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_a_quantized_linear_runs_them(monkeypatch: pytest.MonkeyPatch, qtype: Q, rows: int) -> None:
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    monkeypatch.setattr(quantized_linear, "CHUNK_VALUES", 256 * 24)  # 16 or 24 columns a chunk, of 40
    raw = _blocks(qtype, 40, 256, seed=13)
    weight = _weight(raw, qtype)
    layer = QuantizedLinear(torch.from_numpy(raw), qtype, 256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(14))
    with torch.inference_mode(), OpCalls() as ops:
        got = layer(x)
    matvecs = [op for op in ops.calls if op.namespace == "bubo_int8" and op.name().endswith("_matvec")]
    assert len(matvecs) == (1 if rows <= quantized_linear.MATVEC_ROWS else 0)
    bound = (x.abs().double() @ weight.abs().T).max().item()
    expected = (_quantized(x) if rows <= quantized_linear.MATVEC_ROWS else x.double()) @ weight.T
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-6 * bound)


def test_runs_inside_a_compiled_graph() -> None:
    packed = repack(torch.from_numpy(random_blocks(Q.Q4_K, 256, 256, seed=7)), Q.Q4_K)
    q6 = repack(torch.from_numpy(random_blocks(Q.Q6_K, 2 * TILE, 256, seed=8)), Q.Q6_K)

    def two_products(
        x: torch.Tensor,
        words: torch.Tensor,
        fields: torch.Tensor,
        factors: torch.Tensor,
        q6_words: torch.Tensor,
        q6_factors: torch.Tensor,
    ) -> torch.Tensor:
        # Exact elementwise work around the ops (inductor's and aten's SiLU differ in the last bits).
        h = torch.relu(q4_k_int8_matvec(x * 2, words, fields, factors))
        return q6_k_int8_matvec(h, q6_words, q6_factors) - 1

    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(9))
    tensors = (packed.words, packed.fields, packed.factors, q6.words, q6.factors)
    compiled = StaticKernel(two_products, fused=True)(x, *tensors)
    assert torch.equal(compiled, two_products(x, *tensors))


def test_off_switch_keeps_the_float_layouts(runtime_options: Callable[..., None]) -> None:
    runtime_options(int8_matvec=False)
    raw = random_blocks(Q.Q6_K, TILE, 256, seed=10)
    assert isinstance(repack(torch.from_numpy(raw), Q.Q6_K), PackedSuperBlocks)
    raw = random_blocks(Q.Q4_K, TILE, 256, seed=11)
    packed = repack(torch.from_numpy(raw), Q.Q4_K)
    x = torch.randn(256, generator=torch.Generator().manual_seed(12))
    # The float matvec: exact activations, float32 rounding alone.
    torch.testing.assert_close(
        packed.matvec(x).double(), _weight(raw, Q.Q4_K) @ x.double(), rtol=1e-5, atol=1e-4
    )


def test_q4_scales_in_float16_or_float32_give_the_same_products() -> None:
    # PackedQ4 keeps its scales and offsets in float16 where exact, else float32 (codes.half_if_exact).
    packed = pack_q4(torch.from_numpy(_blocks(Q.Q4_1, 2 * TILE, 256, seed=15)), Q.Q4_1)
    assert packed.scale_offset.dtype == torch.float16
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(16))
    wide = q4_int8_matvec(x, packed.words, packed.scale_offset.float())
    assert torch.equal(q4_int8_matvec(x, packed.words, packed.scale_offset), wide)
