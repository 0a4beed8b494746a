"""configure_cpu_process keeps triton out of a CPU process unless Triton's interpreter is wanted."""

import sys

import pytest
import torch

from bubo import process_memory


@pytest.fixture
def no_triton_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_a_cpu_process_does_not_import_triton(no_triton_loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    process_memory.configure_cpu_process()
    assert "triton" in sys.modules and sys.modules["triton"] is None
    with pytest.raises(ImportError):
        import triton  # noqa: F401


def test_the_triton_interpreter_keeps_triton(no_triton_loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    process_memory.configure_cpu_process()
    assert "triton" not in sys.modules


def test_a_gpu_process_keeps_triton(no_triton_loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    process_memory.configure_cpu_process()
    assert "triton" not in sys.modules


def _resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_lazy_zeros_takes_memory_only_for_pages_written() -> None:
    before = _resident_mb()
    pool = process_memory.lazy_zeros((64, 1 << 18), torch.float32)  # 64 MB
    assert pool.shape == (64, 1 << 18) and pool.dtype == torch.float32
    # One value of every 4 KB page (a small temporary, unlike pool.any()): reading maps the shared zero
    # page, still nothing committed.
    assert not pool.view(-1)[::1024].any()
    assert _resident_mb() - before < 16
    pool[:32] = 1.0
    assert _resident_mb() - before > 28  # the 32 MB written
    assert int(pool.sum()) == 32 << 18


def test_lazy_zeros_of_no_elements() -> None:
    assert process_memory.lazy_zeros((0, 4), torch.float16).shape == (0, 4)


def test_a_cpu_block_pool_starts_zeroed_and_lazy() -> None:
    from bubo.engine.block_pool import BlockPool

    pool = BlockPool(2, 3, 64, 4, 16, torch.float32, "cpu")
    assert all(t.shape == (3, 64, 64) and not t.any() for t in (*pool.keys, *pool.values))
    # Not torch's allocator: each layer's keys lie in a mapping of their own, written in place.
    pool.keys[1][:, 16:32] = 2.0
    assert float(pool.keys[1].sum()) == 2.0 * 3 * 16 * 64 and not pool.keys[0].any()


def test_drop_trace_caches_empties_the_fake_tensor_cache() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(4, 4))
        (x @ x).relu()
    assert FakeTensorMode.cache
    process_memory.drop_trace_caches()
    assert not FakeTensorMode.cache
