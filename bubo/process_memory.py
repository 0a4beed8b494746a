"""Process-wide settings that keep a CPU server's resident memory near what its weights need.

Measured on SmolLM2-135M Q4_1 (97 MB of weights), 2 threads, the peak RSS of a 512-token prefill and
32 decoded tokens was 718 MB; torch alone is ~220 MB of it. Three things here take ~100 MB off:

- inductor imports triton whenever it is installed, ~70 MB of RSS, though on a machine without a GPU
  it only ever generates C++ (and Bubo runs its Triton kernels only on CUDA);
- glibc's malloc raises its mmap threshold each time a large block is freed, after which blocks of
  that size come from the heap and their pages stay resident after `free`: each prefill chunk's
  temporaries would pile up there. A fixed threshold hands them back to the system at once;
- compiling the kernels at load leaves freed heap pages behind; `trim_heap` returns them.
"""

import ctypes
import logging
import os
import sys

import torch

__all__ = ["MMAP_THRESHOLD", "configure_cpu_process", "trim_heap"]

log = logging.getLogger(__name__)

# Blocks at least this large are mapped on their own and unmapped when freed (glibc's default starts at
# 128 KiB and grows up to 32 MiB). 1 MiB keeps small, frequent allocations on the heap.
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def configure_cpu_process() -> None:
    """Call before the model (and so inductor) is imported, in a process that will run on the CPU."""
    if (
        not torch.cuda.is_available()
        and not os.environ.get("TRITON_INTERPRET")
        and "triton" not in sys.modules
    ):
        # A None entry makes `import triton` fail, so inductor takes triton as absent. Not with
        # TRITON_INTERPRET set: that runs the Triton kernels on the CPU (the test suite does).
        sys.modules["triton"] = None  # type: ignore[assignment]
    libc = _libc()
    if libc is not None and not libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        log.debug("mallopt(M_MMAP_THRESHOLD) refused")


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc; elsewhere nothing to do)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
