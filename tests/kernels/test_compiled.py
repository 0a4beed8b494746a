"""StaticKernel: one compiled callable per input shape, and the plain function where inductor fails."""

import torch

from bubo.kernels import compiled
from bubo.kernels.compiled import StaticKernel


def _scaled_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x[:, None] * w).sum(0)


def test_compiles_once_per_shape_and_matches_eager() -> None:
    kernel = StaticKernel(_scaled_sum)
    g = torch.Generator().manual_seed(0)
    for rows in (8, 16, 8):
        x, w = torch.randn(rows, generator=g), torch.randn(rows, 24, generator=g)
        torch.testing.assert_close(kernel(x, w), _scaled_sum(x, w))
    assert len(kernel._compiled) == 2


def test_falls_back_to_the_plain_function(monkeypatch, caplog) -> None:
    def broken(graph, inputs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled.torch._inductor, "compile", broken)
    kernel = StaticKernel(_scaled_sum)
    x, w = torch.ones(4), torch.ones(4, 3)
    assert torch.equal(kernel(x, w), torch.full((3,), 4.0))
    assert "no C++ compiler" in caplog.text


def test_a_shape_compiled_before_comes_from_inductors_graph_cache() -> None:
    # A second kernel for the same function and shape (as at the next load of a model) must find the first
    # one's graph in inductor's FX graph cache instead of lowering it again.
    from torch._dynamo.utils import counters

    x, w = torch.ones(5), torch.ones(5, 7)
    StaticKernel(_scaled_sum)(x, w)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    assert torch.equal(StaticKernel(_scaled_sum)(x, w), torch.full((7,), 5.0))
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
