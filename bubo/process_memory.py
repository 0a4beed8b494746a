"""Process-wide settings that keep a CPU server's resident memory near what its weights need.

Measured on SmolLM2-135M Q4_1 (97 MB of weights), 2 threads: torch's import alone is ~220 MB of RSS.

- inductor imports triton whenever it is installed, ~70 MB of RSS, though on a machine without a GPU
  it only ever generates C++ (and Bubo runs its Triton kernels only on CUDA);
- compiling the kernels at load leaves freed heap pages behind; `trim_heap` returns them (~10 MB);
- tracing the kernels on fake tensors fills FakeTensorMode's class-wide dispatch cache (~850 entries,
  ~7 MB on that model), which nothing reads once they are compiled: `drop_trace_caches`;
- torch.zeros writes every page of the KV pool at once (the server's default pool, the whole context,
  is ~370 MB of fp32 on that model); `lazy_zeros` takes memory only for the pages written.

- a prefill's activations are fresh multi-MB tensors, op after op; glibc serves blocks above its mmap
  threshold (128 KB, rising with what is freed) by mmap and returns the top of its heap past the trim
  threshold at every free, so each such tensor's pages fault in anew, about a tenth of a prefill's time.
  `configure_cpu_process` keeps blocks up to 32 MB on the heap and the heap untrimmed: prefill gets that
  time back and the peak stays the same (freed blocks are reused), but a server keeps its peak resident;
  `trim_heap` still returns free pages when asked. (A low fixed mmap threshold, which unmaps every large
  block when it is freed, saved a few MB of peak but cost a quarter of prefill speed: not used.)
"""

import ctypes
import math
import mmap
import os
import sys
from pathlib import Path

import torch

__all__ = ["configure_cpu_process", "drop_trace_caches", "lazy_zeros", "meminfo", "trim_heap"]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_HEAP_BLOCK_LIMIT = 32 << 20  # glibc's largest dynamic mmap threshold
_NO_TRIM = 1 << 30


def configure_cpu_process() -> None:
    """Call before the model (and so inductor) is imported, in a process that will run on the CPU."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCK_LIMIT)
        libc.mallopt(_M_TRIM_THRESHOLD, _NO_TRIM)
    if (
        not torch.cuda.is_available()
        and not os.environ.get("TRITON_INTERPRET")
        and "triton" not in sys.modules
    ):
        # A None entry makes `import triton` fail, so inductor takes triton as absent. Not with
        # TRITON_INTERPRET set: that runs the Triton kernels on the CPU (the test suite does).
        sys.modules["triton"] = None  # type: ignore[assignment]


def meminfo() -> dict[str, int]:
    """/proc/meminfo's fields in bytes (MemAvailable, MemTotal, ...); empty where there is none."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc; elsewhere nothing to do)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages take memory only once written: a fresh anonymous mapping,
    which the kernel zero-fills page by page on first touch (reading an untouched page maps the shared
    zero page, which costs nothing). torch.zeros would write, and so commit, every page up front."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # no POSIX anonymous mappings (Windows)
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive (torch.frombuffer holds a reference to its buffer); it is unmapped
    # when the last view of it goes.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def drop_trace_caches() -> None:
    """Empty the fake-tensor dispatch cache that tracing the compiled kernels filled (a later trace refills
    what it needs), then return the freed heap."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = getattr(FakeTensorMode, "cache", None)
    if isinstance(cache, dict):
        cache.clear()
    trim_heap()
