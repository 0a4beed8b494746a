"""The Triton GEMV (decode) and dequantize-into-GEMM (prefill) kernels against x @ W^T in float64,
W dequantized by gguf's numpy code, for every type the kernels read; and QuantizedLinear's use of them."""

import gguf
import pytest
import torch

pytest.importorskip("triton")

import triton

from bubo.kernels import triton_gemm
from bubo.kernels.triton_gemm import quantized_gemm, quantized_matmul
from bubo.kernels.triton_gemv import MAX_GEMV_ROWS, fitting_configs, quantized_gemv
from bubo.kernels.triton_support import autotune_configs, triton_enabled
from bubo.model import quantized_linear
from bubo.model.quantized_linear import QuantizedLinear
from tests.kernels.quant_blocks import (
    ALL_TYPES,
    assert_product_close,
    device,
    ragged_width,
    random_blocks,
    reference_weight,
)

Q = gguf.GGMLQuantizationType
OUT_FEATURES = 40  # not a whole number of output tiles
# float32 operands and sums: a few ulps of |x||W| (a float32 sum of up to 512 products, any order).
FLOAT32_REL = 1e-5
# bf16 / fp16: operands (GEMM) and the result rounded to 8 / 11 significant bits.
HALF_REL = 2e-2


def _case(qtype: Q, rows: int, seed: int, dtype: torch.dtype = torch.float32):
    in_features = ragged_width(qtype)
    raw = random_blocks(qtype, OUT_FEATURES, in_features, seed)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return torch.from_numpy(raw).to(device()), reference_weight(raw, qtype), x.to(device())


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_matches_float64_reference(qtype: Q, rows: int) -> None:
    raw, weight, x = _case(qtype, rows, seed=rows)
    assert_product_close(quantized_gemv(x, raw, qtype), x, weight, FLOAT32_REL)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [5, 21])  # one row tile, part-filled; two, the second ragged
def test_gemm_matches_float64_reference(qtype: Q, rows: int) -> None:
    raw, weight, x = _case(qtype, rows, seed=rows)
    assert_product_close(quantized_gemm(x, raw, qtype), x, weight, FLOAT32_REL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [2, 9])  # GEMV, GEMM
def test_half_precision_inputs(dtype: torch.dtype, rows: int) -> None:
    raw, weight, x = _case(Q.Q4_K, rows, seed=7, dtype=dtype)
    got = quantized_matmul(x, raw, Q.Q4_K)
    assert got.dtype == dtype
    assert_product_close(got, x, weight, HALF_REL)


@pytest.mark.parametrize("rows", [1, 6])
def test_bias_is_added(rows: int) -> None:
    raw, weight, x = _case(Q.Q6_K, rows, seed=3)
    bias = torch.randn(OUT_FEATURES, generator=torch.Generator().manual_seed(4)).to(device())
    got = quantized_matmul(x, raw, Q.Q6_K, bias) - bias
    assert_product_close(got, x, weight, FLOAT32_REL)


def test_matmul_keeps_leading_dims_and_strided_rows() -> None:
    raw, weight, x = _case(Q.Q8_0, 12, seed=5)
    batched = x.view(2, 6, -1)
    got = quantized_matmul(batched, raw, Q.Q8_0)
    assert got.shape == (2, 6, OUT_FEATURES)
    assert_product_close(got.view(12, -1), x, weight, FLOAT32_REL)
    every_other = x[::2]  # rows 2 * in_features apart
    assert_product_close(quantized_matmul(every_other, raw, Q.Q8_0), every_other, weight, FLOAT32_REL)
    assert quantized_matmul(x[:0], raw, Q.Q8_0).shape == (0, OUT_FEATURES)


def test_gemv_refuses_too_many_rows() -> None:
    raw, _, x = _case(Q.Q4_0, MAX_GEMV_ROWS + 1, seed=0)
    with pytest.raises(ValueError, match=f"1 to {MAX_GEMV_ROWS} rows"):
        quantized_gemv(x, raw, Q.Q4_0)


def test_gemv_configs_are_pruned_to_what_fits_in_registers() -> None:
    # 128 threads: 8, 16, 64 rows x 256 = 16, 32, 128 products a thread for one row of x.
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": 256}, num_warps=4) for n in (8, 16, 64)]
    assert fitting_configs(configs, {}, BLOCK_M=1) == configs[:2]
    assert fitting_configs(configs, {}, BLOCK_M=2) == configs[:1]
    assert fitting_configs(configs[1:], {}, BLOCK_M=4) == configs[1:2]  # none fits: the smallest


def test_switch(runtime_options) -> None:
    assert not triton_enabled(torch.device("cpu"))
    assert triton_enabled(torch.device("cuda"))
    runtime_options(triton=False)
    assert not triton_enabled(torch.device("cuda"))


@pytest.mark.parametrize("rows", [1, 7])
def test_quantized_linear_runs_the_kernels_where_enabled(monkeypatch, rows: int) -> None:
    calls = []

    def counting_matmul(*args):
        calls.append(args[0].shape)
        return quantized_matmul(*args)

    monkeypatch.setattr(quantized_linear, "triton_enabled", lambda device: True)
    monkeypatch.setattr(triton_gemm, "quantized_matmul", counting_matmul)
    raw, weight, x = _case(Q.Q5_K, rows, seed=rows)
    bias = torch.randn(OUT_FEATURES, generator=torch.Generator().manual_seed(9)).to(device())
    layer = QuantizedLinear(raw, Q.Q5_K, raw.shape[1] // 176 * 256, bias=bias)
    got = layer(x.view(1, rows, -1))
    assert calls == [(1, rows, x.shape[1])]
    assert_product_close((got - bias).view(rows, -1), x, weight, FLOAT32_REL)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("blocks", [1, 3])  # a part-filled last step of 2 superblocks
def test_q4_k_word_gemv_matches_float64_reference(rows: int, blocks: int) -> None:
    # The Q4_K kernel that reads int32 words, on an odd number of output rows, with a bias.
    raw_np = random_blocks(Q.Q4_K, 37, 256 * blocks, seed=rows)
    raw, weight = torch.from_numpy(raw_np).to(device()), reference_weight(raw_np, Q.Q4_K)
    x = torch.randn(rows, 256 * blocks, generator=torch.Generator().manual_seed(blocks)).to(device())
    bias = torch.randn(37, generator=torch.Generator().manual_seed(5)).to(device())
    got = quantized_gemv(x, raw, Q.Q4_K, bias)
    assert_product_close(got - bias, x, weight, FLOAT32_REL)


def test_autotune_switch_keeps_only_the_first_config(runtime_options) -> None:
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": 256}) for n in (8, 16)]
    runtime_options(triton_autotune=True)
    assert autotune_configs(configs) == configs
    runtime_options(triton_autotune=False)
    assert autotune_configs(configs) == configs[:1]
