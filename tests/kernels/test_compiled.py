"""StaticKernel: one compiled callable per input shape, and the plain function where inductor fails;
DynamicKernel: one compiled callable for every size of its dynamic dimensions and every layout."""

import torch

from bubo.kernels import compiled
from bubo.kernels.compiled import DynamicKernel, StaticKernel


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
    def broken(graph, inputs, dynamic_shapes):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled.torch._inductor, "standalone_compile", broken)
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


def _gated_rows(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    score = (x * v).sum(-1, keepdim=True)
    rows = (x[:, None, :] * w).sum(-1)
    return rows * torch.sigmoid(score), torch.sigmoid(score)


def test_a_kernel_compiled_on_one_thread_runs_right_on_two() -> None:
    # Inductor puts the score's in-place sigmoid, after the rows' parallel loop, in the same parallel region;
    # generated for one thread it has no `omp single`, and two threads would apply it twice (seen: 199 of
    # 200 calls wrong). A server started with --threads 1 and a test's one-thread module meet this.
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    x, w, v = (
        torch.randn(1, 32, generator=g),
        torch.randn(64, 32, generator=g),
        torch.randn(1, 32, generator=g),
    )
    kernel = StaticKernel(_gated_rows, fused=True)
    try:
        torch.set_num_threads(1)
        kernel(x, w, v)
        torch.set_num_threads(2)
        for _ in range(50):
            torch.testing.assert_close(kernel(x, w, v), _gated_rows(x, w, v))
    finally:
        torch.set_num_threads(threads)


def _append_token(x: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    history.copy_(torch.cat([history, x], 1)[:, 1:])
    return history.sum(1)


def test_a_kernel_updates_a_tensor_made_in_inference_mode(caplog) -> None:
    # A cache allocated inside torch.inference_mode() (a researcher's, a test's): traced outside it, the
    # in-place update is refused and the kernel would run uncompiled from then on.
    kernel = StaticKernel(_append_token)
    with torch.inference_mode():
        history = torch.zeros(1, 3)
        for token in (1.0, 2.0, 3.0, 4.0):
            kernel(torch.tensor([[token]]), history)
    assert torch.equal(history, torch.tensor([[2.0, 3.0, 4.0]]))
    assert "could not compile" not in caplog.text and not kernel._broken


def _weighted_rows(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return (w[:, None] * rows).sum(0) / rows.shape[1]


def test_a_dynamic_kernel_compiles_once_for_every_length_and_layout(caplog) -> None:
    # rows [T, 24] with T dynamic: contiguous, a view into a wider buffer, and a column-sliced one.
    kernel = DynamicKernel(_weighted_rows, dynamic={0: (0,), 1: (0,)})
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(300, 40, generator=g)
    cases = [
        (torch.randn(n, generator=g), rows)
        for n, rows in (
            (1, torch.randn(1, 24, generator=g)),
            (2, torch.randn(2, 24, generator=g)),
            (37, wide[:37, :24]),
            (250, wide[3:253, 10:34]),
        )
    ]
    for w, rows in cases:
        torch.testing.assert_close(kernel(w, rows), _weighted_rows(w, rows))
    assert len(kernel._compiled) == 1
    assert "could not compile" not in caplog.text


def test_a_dynamic_kernel_whose_tracing_fixes_a_stride_runs_uncompiled(caplog) -> None:
    # A function that branches on a stride: tracing takes the branch the traced layout leads to, an
    # assumption the compiled kernel would make of every layout; the kernel refuses it and runs the
    # function itself, which takes the other branch for a contiguous tensor.
    def layout_sum(rows: torch.Tensor) -> torch.Tensor:
        return rows.sum() if rows.stride(0) == rows.shape[1] + 1 else -rows.sum()

    kernel = DynamicKernel(layout_sum, dynamic={0: (0,)})
    assert kernel(torch.ones(5, 8)).item() == -40.0
    assert "could not compile layout_sum (tracing fixed" in caplog.text


def test_a_dynamic_kernel_whose_tracing_reads_a_length_runs_uncompiled(caplog) -> None:
    # float() of a length makes it a constant of the trace: compiled, every call would scale by the
    # traced length.
    def scaled_sum(rows: torch.Tensor) -> torch.Tensor:
        return rows.sum() * float(rows.shape[0])

    kernel = DynamicKernel(scaled_sum, dynamic={0: (0,)})
    assert kernel(torch.ones(5, 8)).item() == 200.0
    assert "could not compile scaled_sum (tracing fixed" in caplog.text


def test_a_dynamic_kernel_compiled_before_comes_from_aotautograds_cache() -> None:
    # As for the static kernels: the next load's kernel must come whole from the cache (a miss compiles
    # again and, the first time in a process, loads inductor's pattern sets: ~14 MB kept).
    from torch._dynamo.utils import counters

    w, rows = torch.ones(6), torch.ones(6, 5)
    DynamicKernel(_weighted_rows, dynamic={0: (0,), 1: (0,)})(w, rows)
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    kernel = DynamicKernel(_weighted_rows, dynamic={0: (0,), 1: (0,)})
    torch.testing.assert_close(kernel(w, rows), _weighted_rows(w, rows))
    assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1
