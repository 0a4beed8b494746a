"""QuantizedLinear's row-chunked forward against a plain linear on gguf's own dequantization.

The products are checked in float32 (prefill_bf16 off, set for every test here) against float64
references; `test_bf16_gemms_round_operands_once` checks the bfloat16 prefill GEMMs on their own."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bubo.model import quantized_linear
from bubo.model.quantized_linear import QuantizedEmbedding, QuantizedLinear, group_rows, project_rows
from tests.kernels.k_blocks import random_blocks

# The float matvecs, exact activations (tests/conftest.py); the int8 ones: tests/kernels/test_int8_matvec.py.
pytestmark = pytest.mark.usefixtures("float_matvecs")


Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def float32_gemms(runtime_options) -> None:
    runtime_options(prefill_bf16="off")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q5_0])
@pytest.mark.parametrize("chunk_values", [256 * 7, 1 << 20])  # 7 rows a chunk (ragged last chunk), one chunk
@pytest.mark.parametrize("inference", [False, True])
def test_chunked_forward_matches_reference(monkeypatch, qtype: Q, chunk_values: int, inference: bool) -> None:
    monkeypatch.setattr(quantized_linear, "CHUNK_VALUES", chunk_values)
    rng = np.random.default_rng(0)
    out_features, in_features = 50, 256
    raw = gguf.quants.quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), qtype)
    reference_weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(out_features, generator=g)
    layer = QuantizedLinear(torch.from_numpy(raw), qtype, in_features, bias=bias)
    x = torch.randn(3, 5, in_features, generator=g)
    # Outputs reach |~50|: fp32 sums of 256 products taken in another order (a chunk's matmul vs
    # the whole one) differ by a few ulps of that, up to ~1.4e-5 seen, so atol 1e-5 flaked.
    with torch.inference_mode(inference):
        for _ in range(2):  # the second call reuses the scratch buffer
            torch.testing.assert_close(layer(x), F.linear(x, reference_weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 11, 17])  # up to MATVEC_ROWS: compiled matvecs; more: unpacked chunks
# 24 columns a chunk, rounded down to whole tiles (16 or 24 of the 40 columns): a ragged last one; 64: one
# chunk holds the whole weight
@pytest.mark.parametrize("chunk_columns", [24, 64])
def test_repacked_forward_matches_float64_reference(
    monkeypatch, qtype: Q, rows: int, chunk_columns: int
) -> None:
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    monkeypatch.setattr(quantized_linear, "CHUNK_VALUES", 128 * chunk_columns)
    rng = np.random.default_rng(1)
    out_features, in_features = 40, 128
    raw = gguf.quants.quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), qtype)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64))
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(out_features, generator=g)
    layer = QuantizedLinear(torch.from_numpy(raw), qtype, in_features, bias=bias)
    assert layer.packed is not None
    x = torch.randn(1, rows, in_features, generator=g)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (1, rows, out_features)
    torch.testing.assert_close(got.double(), x.double() @ weight.T + bias.double(), rtol=1e-5, atol=2e-5)


def test_small_matrices_keep_the_dequantizing_path() -> None:
    raw = gguf.quants.quantize(np.ones((8, 256), dtype=np.float32), Q.Q4_1)
    assert QuantizedLinear(torch.from_numpy(raw), Q.Q4_1, 256).packed is None  # below MIN_PACKED_WEIGHTS


def test_matrices_stay_unpacked_when_memory_is_short(monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    """Packing a matrix that would leave less than PACKING_RESERVE available keeps the file's blocks (the
    model loads and runs, slower) and says so once, rather than running the machine out of memory. An
    IQ4_XS matrix packs into 8.375 bits a weight: 1.97x the file's bytes."""
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    monkeypatch.setattr(quantized_linear, "_said_short_of_memory", False)
    raw = torch.from_numpy(random_blocks(Q.IQ4_XS, 32, 512, seed=7))
    reserve = quantized_linear.PACKING_RESERVE
    with caplog.at_level("WARNING", logger="bubo.model.quantized_linear"):
        monkeypatch.setattr(quantized_linear, "meminfo", lambda: {"MemAvailable": reserve + raw.numel()})
        layer = QuantizedLinear(raw, Q.IQ4_XS, 512)
        monkeypatch.setattr(quantized_linear, "meminfo", lambda: {"MemAvailable": reserve + 3 * raw.numel()})
        assert QuantizedLinear(raw, Q.IQ4_XS, 512).packed is not None
        monkeypatch.setattr(quantized_linear, "meminfo", lambda: {"MemAvailable": reserve})
        assert QuantizedLinear(raw, Q.IQ4_XS, 512).packed is None
    assert layer.packed is None
    assert len([r for r in caplog.records if "file's blocks" in r.getMessage()]) == 1
    monkeypatch.setattr(quantized_linear, "meminfo", dict)  # no /proc/meminfo: nothing to go by
    assert QuantizedLinear(raw, Q.IQ4_XS, 512).packed is not None
    # A small machine keeps an eighth of its memory, not the whole reserve.
    total = 2 * reserve
    small = {"MemTotal": total, "MemAvailable": total // 8 + 3 * raw.numel()}
    monkeypatch.setattr(quantized_linear, "meminfo", lambda: small)
    assert QuantizedLinear(raw, Q.IQ4_XS, 512).packed is not None
    x = torch.randn(512, generator=torch.Generator().manual_seed(8))
    expected = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q.IQ4_XS).astype(np.float64)) @ x.double()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)


def _projection(qtype: Q, out_features: int, seed: int, bias: bool) -> tuple[QuantizedLinear, torch.Tensor]:
    """A packed layer over random weights, and its float64 weight (+ bias column) from gguf."""
    rng = np.random.default_rng(seed)
    raw = gguf.quants.quantize(rng.standard_normal((out_features, 128), dtype=np.float32), qtype)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64))
    b = torch.randn(out_features, generator=torch.Generator().manual_seed(seed)) if bias else None
    return QuantizedLinear(torch.from_numpy(raw), qtype, 128, bias=b), weight


def _expected(x: torch.Tensor, layer: QuantizedLinear, weight: torch.Tensor) -> torch.Tensor:
    out = x.double() @ weight.T
    return out if layer.bias is None else out + layer.bias.double()


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
# a decode step; a few slots' steps batched; a prefill (one unpacked GEMM for the group)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_grouped_projections_match_float64_reference(monkeypatch, qtype: Q, rows: int) -> None:
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    # q, k, v shaped rows (whole tiles of 8 or 16), a bias on q only as qwen2 has on all three
    parts = [_projection(qtype, n, seed, bias=seed == 0) for seed, n in enumerate((48, 16, 16))]
    layers = [layer for layer, _ in parts]
    group_rows(*layers)
    assert all(layer.group is not None for layer in layers)
    x = torch.randn(1, rows, 128, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        got = project_rows(x, *layers)
        alone = layers[1](x)  # a member called by itself runs its own rows (a view of the group's)
    for out, (layer, weight) in zip(got, parts, strict=True):
        assert out.shape == (1, rows, layer.out_features)
        torch.testing.assert_close(out.double(), _expected(x, layer, weight), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(alone.double(), _expected(x, *parts[1]), rtol=1e-5, atol=2e-5)


def test_rows_that_do_not_fill_tiles_stay_apart(monkeypatch) -> None:
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    parts = [_projection(Q.Q4_1, n, seed, bias=False) for seed, n in enumerate((48, 12))]
    layers = [layer for layer, _ in parts]
    group_rows(*layers)
    assert all(layer.group is None for layer in layers)
    x = torch.randn(1, 1, 128, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        got = project_rows(x, *layers)
    for out, (layer, weight) in zip(got, parts, strict=True):
        torch.testing.assert_close(out.double(), _expected(x, layer, weight), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(
    "qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS]
)
@pytest.mark.parametrize("rows", [1, 17])  # a compiled matvec; unpacked column chunks for a GEMM
def test_repacked_k_quants_match_float64_reference(monkeypatch, runtime_options, qtype: Q, rows: int) -> None:
    runtime_options(
        int8_matvec=False
    )  # exact activations (the int8 matvecs: tests/kernels/test_int8_matvec.py)
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    # A tile of columns a chunk (8 or 16), of 19: the last chunk ragged.
    monkeypatch.setattr(quantized_linear, "CHUNK_VALUES", 512 * 8)
    # tests/kernels/test_repack.py's shape: its one-row matvecs are the kernel store's already (their
    # float graphs take up to half a minute each to compile on a slow CPU).
    raw = random_blocks(qtype, 19, 512, seed=5)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64))
    layer = QuantizedLinear(torch.from_numpy(raw), qtype, 512)
    assert layer.packed is not None
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        got = layer(x)
    # float32 sums of 512 products, in a GEMM's order or the matvec's: off by a few ulps of the sum of the
    # products' magnitudes (random blocks make outputs that mostly cancel); a wrong code or scale would be
    # off by a product's size.
    magnitude = x.double().abs() @ weight.abs().T
    assert ((got.double() - x.double() @ weight.T).abs() <= 1e-6 * magnitude).all()


def _random_projection(qtype: Q, out_features: int, seed: int) -> tuple[QuantizedLinear, torch.Tensor]:
    raw = random_blocks(qtype, out_features, 256, seed)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64))
    return QuantizedLinear(torch.from_numpy(raw), qtype, 256), weight


def test_q5_0_groups_with_q8_0(monkeypatch) -> None:
    # Q4_K_M's q/k/v: Q5_0 with a Q8_0 v in some layers; both are PackedQ8 with blocks of 8 words.
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    parts = [
        _random_projection(qtype, n, seed) for seed, (qtype, n) in enumerate(((Q.Q5_0, 32), (Q.Q8_0, 16)))
    ]
    layers = [layer for layer, _ in parts]
    group_rows(*layers)
    assert all(layer.group is not None for layer in layers)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        got = project_rows(x, *layers)
    for out, (_, weight) in zip(got, parts, strict=True):
        torch.testing.assert_close(out.double(), x.double() @ weight.T, rtol=1e-5, atol=1e-4)


# Q6_K's super-blocks and Q8_0's blocks; Q5_K's and IQ4_XS's super-blocks, as many code words but other
# fields: not one matrix.
@pytest.mark.parametrize("types", [(Q.Q6_K, Q.Q8_0), (Q.Q5_K, Q.IQ4_XS)])
def test_other_layouts_stay_apart(monkeypatch, types: tuple[Q, Q]) -> None:
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    layers = [_random_projection(qtype, 16, seed)[0] for seed, qtype in enumerate(types)]
    group_rows(*layers)
    assert all(layer.group is None for layer in layers)


# packed: the repacked layouts' unpacked chunks (PackedQ4, PackedQ8, PackedSuperBlocks); else the dequantizing path
@pytest.mark.parametrize(
    ("qtype", "packed"), [(Q.Q4_1, True), (Q.Q8_0, True), (Q.Q4_K, True), (Q.Q5_K, True), (Q.Q4_1, False)]
)
@pytest.mark.parametrize("rows", [17, 40])
def test_bf16_gemms_round_operands_once(
    monkeypatch, runtime_options, qtype: Q, packed: bool, rows: int
) -> None:
    runtime_options(prefill_bf16="on")
    if packed:
        monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    monkeypatch.setattr(quantized_linear, "CHUNK_VALUES", 256 * 24)  # 16 or 24 columns a chunk, of 40
    if qtype == Q.Q4_1:
        weights = np.random.default_rng(3).standard_normal((40, 256), dtype=np.float32)
        raw = gguf.quants.quantize(weights, qtype)
    else:
        raw = random_blocks(qtype, 40, 256, seed=3)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype))  # float32, as the unpacking makes it
    layer = QuantizedLinear(torch.from_numpy(raw), qtype, 256)
    assert (layer.packed is not None) == packed
    x = torch.randn(1, rows, 256, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        product = layer(x)
    assert product.dtype == torch.float32 and product.shape == (1, rows, 40)
    # The GEMM's output was bfloat16: every value is one.
    assert torch.equal(product, product.bfloat16().float())
    # Operands rounded to bfloat16 once, products summed exactly (float64 here, float32 there), the sum
    # rounded to bfloat16 once: within half a bfloat16 ulp (2^-9 relative) plus float32 accumulation.
    expected = x.bfloat16().double() @ weight.bfloat16().double().T
    torch.testing.assert_close(product.double(), expected, rtol=2**-8, atol=1e-4)


@pytest.mark.parametrize("setting", ["off", "on"])
def test_bf16_prefill_setting(runtime_options, setting: str) -> None:
    runtime_options(prefill_bf16=setting)
    assert quantized_linear.bf16_prefill() is (setting == "on")
    x = torch.randn(quantized_linear.MATVEC_ROWS + 1, 8)
    assert quantized_linear.gemm_operand(x).dtype == (torch.bfloat16 if setting == "on" else torch.float32)
    # A decode step's few rows, and a bfloat16 model's rows, are left as they are.
    few, half = x[: quantized_linear.MATVEC_ROWS], x.bfloat16()
    assert quantized_linear.gemm_operand(few) is few and quantized_linear.gemm_operand(half) is half


def test_float16_and_float32_fields_group(monkeypatch) -> None:
    # q with fp16-exact fields, k with a Q4_0 scale whose -8d overflows fp16 (float32 fields): one
    # matrix, its fields in float32.
    monkeypatch.setattr(quantized_linear, "MIN_PACKED_WEIGHTS", 0)
    rng = np.random.default_rng(3)
    raws = [gguf.quants.quantize(rng.standard_normal((n, 128), dtype=np.float32), Q.Q4_0) for n in (32, 16)]
    raws[1][0, :2] = np.array([10000.0], dtype=np.float16).view(np.uint8)
    layers = [QuantizedLinear(torch.from_numpy(raw), Q.Q4_0, 128) for raw in raws]
    assert [layer.packed.scale_offset.dtype for layer in layers] == [torch.float16, torch.float32]
    group_rows(*layers)
    assert layers[0].group is not None and layers[0].group.packed.scale_offset.dtype == torch.float32
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        got = project_rows(x, *layers)
    for out, raw in zip(got, raws, strict=True):
        weight = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_0).astype(np.float64))
        expected = x.double() @ weight.T
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.IQ4_NL])
# A decoded token, batched rows, a verify pass; more rows than MATVEC_ROWS: the eager dequantizer.
@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (1, 7), (20, 1)])
def test_embedding_rows_match_gguf_dequantizer(qtype: Q, shape: tuple[int, ...]) -> None:
    raw = random_blocks(qtype, 32, 512, 2)
    table = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    embedding = QuantizedEmbedding(torch.from_numpy(raw), qtype, 512, torch.float32)
    tokens = torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = embedding(tokens)
    assert torch.equal(got, table[tokens])
