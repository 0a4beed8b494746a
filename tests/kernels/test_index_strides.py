"""bubo/kernels/index_strides.py answers inductor's stride question as inductor does, where it answers."""

import contextlib
from collections.abc import Callable

import pytest
import sympy
import torch
from gguf import GGMLQuantizationType as Q
from torch._inductor.sizevars import stride_at_vec_range
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from bubo.kernels import compiled, index_strides
from bubo.kernels.codes import word_bits
from bubo.kernels.super_block_matvec import super_block_matvec_bits
from bubo.model.quantized_linear import pack_for_cpu
from tests.kernels.k_blocks import random_blocks

x0, x1, x2, s = sympy.symbols("x0 x1 x2 s", integer=True, nonnegative=True)

# Index forms inductor writes for the packed matvecs' loads and stores (x1: the lanes, x2: the groups),
# answered at least for x1.
ANSWERED = [
    x1 + 64 * x2 + 1024 * ModularIndexing(x0, 1, 32) + 32768 * s,
    16 * x0 + x1,
    512 * FloorDiv(x1, 16) + 3 * x2,
    7 * ModularIndexing(x1, 16, 4) + x0,
    2 * ModularIndexing(x1, 1, 32) + FloorDiv(x0, 3),
    sympy.Integer(5),
    32 * x2,
]
# Forms it leaves to inductor: a division of a sum, a divisor the vector doesn't divide, a product.
LEFT = [
    16 * ModularIndexing(4 * x1 + 1, 1, 32),
    64 * FloorDiv(x1, 8),
    16 * ModularIndexing(x1, 4, 2),
    s * x1,
]


@pytest.mark.parametrize("index", ANSWERED, ids=str)
def test_strides_it_answers_are_inductors(index: sympy.Expr) -> None:
    assert index_strides._linear_stride(index, x1, 16) is not None
    for var in (x0, x1, x2):
        fast = index_strides._linear_stride(index, var, 16)
        assert fast is None or fast == stride_at_vec_range(index, var, 16)


@pytest.mark.parametrize("index", LEFT, ids=str)
def test_other_forms_are_left_to_inductor(index: sympy.Expr) -> None:
    assert index_strides._linear_stride(index, x1, 16) is None


def _generated_code(qtype: Q, fast: bool, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The source inductor generates for a packed matvec of `qtype`, compiled afresh (no FX graph cache),
    with or without the fast stride analysis."""
    packed = pack_for_cpu(torch.from_numpy(random_blocks(qtype, 128, 512, seed=0)), qtype)
    assert packed is not None
    args = [torch.randn(512), word_bits(packed.words), word_bits(packed.fields), packed.factors]
    if not fast:
        monkeypatch.setattr(compiled, "fast_index_strides", contextlib.nullcontext)

    def matvec(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        return super_block_matvec_bits(x, *tensors, 128, qtype)

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    fake = [mode.from_tensor(a, static_shapes=True) for a in args]
    graph = compiled._trace(matvec, mode, fake, "real")
    options = {**compiled._FUSED, "fx_graph_cache": False}
    _, code = run_and_get_code(compiled._inductor_compile, graph, args, mode, options)
    monkeypatch.undo()
    # Less the compile's serial number, which is all that differs between two compiles of one graph.
    return ["\n".join(line for line in c.splitlines() if not line.startswith("# AOT ID")) for c in code]


# Q4_K: a Q4_K_M's bulk. (Q6_K's matvec, whose codes straddle words, takes ~15 s to compile without the
# fast path; its index forms are among those the unit tests above check.)
@pytest.mark.parametrize("qtype", [Q.Q4_K])
def test_a_matvec_compiles_to_the_same_code_either_way(
    qtype: Q, monkeypatch: pytest.MonkeyPatch, runtime_options: Callable[..., None]
) -> None:
    runtime_options(int8_matvec=False)  # the float matvec: inductor's code, not the int8 kernel
    index_strides._linear_stride.cache_clear()
    fast = _generated_code(qtype, True, monkeypatch)
    assert index_strides._linear_stride.cache_info().currsize > 0  # the fast path answered
    assert fast == _generated_code(qtype, False, monkeypatch)
    assert any("cpp_fused" in source for source in fast)


def test_installed_while_any_compile_runs_and_removed_after_the_last() -> None:
    # Two compiles overlapping (two threads): the second shares the first's installation, and inductor's
    # own function is back once both have left, whichever leaves first.
    from torch._inductor.codegen import cpp

    original = cpp.stride_at_vec_range
    first, second = index_strides.fast_index_strides(), index_strides.fast_index_strides()
    first.__enter__()
    installed = cpp.stride_at_vec_range
    assert installed is not original
    second.__enter__()
    assert cpp.stride_at_vec_range is installed
    first.__exit__(None, None, None)
    assert cpp.stride_at_vec_range is installed
    second.__exit__(None, None, None)
    assert cpp.stride_at_vec_range is original
