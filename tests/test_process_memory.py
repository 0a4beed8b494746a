"""configure_cpu_process keeps triton out of a CPU process unless Triton's interpreter is wanted, and keeps
large temporaries on the heap; lazy_zeros takes memory only for the pages written."""

import json
import subprocess
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
    from bubo.model.block_pool import BlockPool

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


# Run in a fresh interpreter: the malloc settings are process-wide, and the test process's own heap
# history would decide where its next block lands. mallinfo2 (glibc >= 2.33) reports both sides.
_HEAP_PROBE = """
import ctypes, json, sys, torch
from bubo import process_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "configured":
    process_memory.configure_cpu_process()
before = libc.mallinfo2()
temporary = torch.ones(5 << 20)  # 20 MB, a prefill activation's order of size
during = libc.mallinfo2()
del temporary
after = libc.mallinfo2()
print(json.dumps({"mapped": during.hblkhd - before.hblkhd, "kept": after.fordblks - before.fordblks}))
"""


def _heap_probe(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(proc.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_large_temporaries_stay_on_the_heap_for_reuse() -> None:
    try:
        default = _heap_probe("default")
    except subprocess.CalledProcessError as error:
        if "mallinfo2" in error.stderr:
            pytest.skip("glibc without mallinfo2")
        raise
    configured = _heap_probe("configured")
    mb = 1 << 20
    # glibc's defaults: a fresh mapping for the block, unmapped when it is freed, so the next one faults in anew.
    assert default["mapped"] >= 20 * mb and default["kept"] < mb
    # Configured: carved from the heap, and kept there once freed, for the next temporary to reuse. The
    # interpreter's own small allocations between the free and the count (the result objects) may come
    # out of the freed chunk: a few KB of it (3.6 KB seen on the AMX Xeon VM).
    assert configured["mapped"] < mb and configured["kept"] >= 20 * mb - 64 * 1024
