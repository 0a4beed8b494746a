"""Inductor-compiled kernels with static shapes and no per-call guard checks.

`torch.compile` checks its guards on every call, about 50 µs on this class of CPU: more than a
small matvec itself costs, paid some 200 times per decoded token. Tracing with make_fx and
compiling the graph with `torch._inductor.compile` gives a callable that just runs the generated
C++ (about 10 µs), one per input shape, kept here. Tracing runs on fake tensors: a real run would
materialize the float planes that the fused kernel exists to avoid (hundreds of MB for an output head). Where inductor can't build (no C++ compiler),
the plain function is used and the reason is logged once.
"""

import logging
import threading
from collections.abc import Callable

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = ["StaticKernel"]

log = logging.getLogger(__name__)

# Set while a StaticKernel traces its function: a kernel called from inside another kernel's function
# (a matvec inside a whole decode step, bubo/engine/compiled_decode.py) then traces as plain torch code
# into the caller's graph, so inductor fuses it with what surrounds it.
_tracing = threading.local()

# A kernel is compiled for one layout of its arguments (the key holds every shape and stride), so the
# generated code's per-call checks of each input's size, stride and alignment would only repeat that:
# some 600 calls a decoded token on the default model.
_STATIC = {"size_asserts": False, "alignment_asserts": False}
_FUSED = {
    **_STATIC,
    "realize_opcount_threshold": 100_000,
    "realize_reads_threshold": 100_000,
    "realize_acc_reads_threshold": 100_000,
    "cpp.enable_floating_point_contract_flag": "fast",
}


class StaticKernel:
    """`fn` compiled once per distinct (shape, stride, dtype) of its tensor arguments."""

    def __init__(self, fn: Callable[..., torch.Tensor], fused: bool = False) -> None:
        self.fn = fn
        # Inductor stores a pointwise result to memory once its expression grows past a few dozen
        # operations or reads; a matvec that expands 32 codes per block wants it all inline in the
        # reduction loop (materializing the expanded codes would cost more memory traffic than the
        # weights themselves), and FMA contraction.
        self._options = _FUSED if fused else _STATIC
        self._compiled: dict[tuple, Callable[..., torch.Tensor]] = {}
        self._broken = False

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if getattr(_tracing, "active", False):
            return self.fn(*args)
        return self.kernel_for(*args)(*args)

    def kernel_for(self, *args: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The compiled kernel for arguments laid out as `args` (compiled now if it is new): a caller that
        passes the same layouts every time can keep it and skip the lookup."""
        key = tuple((a.shape, a.stride(), a.dtype) for a in args)
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self._compiled[key] = self._compile(args)
        return kernel

    def _compile(self, args: tuple[torch.Tensor, ...]) -> Callable[..., torch.Tensor]:
        if self._broken:
            return self.fn
        try:
            with torch.inference_mode(False), torch.no_grad():
                # Traced under a fake mode with a (static) shape env, compiled inside a tracing context that
                # holds it: without one inductor bypasses its on-disk FX graph cache ("No shape env") and
                # lowers every shape again at each load, seconds and ~30 MB of RSS more than a cache hit.
                mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
                fake = [mode.from_tensor(a, static_shapes=True) for a in args]
                _tracing.active = True
                try:
                    with mode:
                        graph = make_fx(self.fn, tracing_mode="real")(*fake)
                finally:
                    _tracing.active = False
                with torch._inductor.config.patch(self._options), tracing(TracingContext(mode)):
                    return torch._inductor.compile(graph, list(args))
        except Exception as error:  # a missing compiler or an inductor limitation: run uncompiled
            log.warning("inductor could not compile %s (%s); running it uncompiled", self.fn.__name__, error)
            self._broken = True
            return self.fn
