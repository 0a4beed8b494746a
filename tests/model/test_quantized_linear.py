"""QuantizedLinear's row-chunked forward against a plain linear on gguf's own dequantization."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bubo.model import quantized_linear
from bubo.model.quantized_linear import QuantizedLinear

Q = gguf.GGMLQuantizationType


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
