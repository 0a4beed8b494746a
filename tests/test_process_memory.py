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
