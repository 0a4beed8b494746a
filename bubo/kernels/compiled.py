"""Inductor-compiled kernels with no per-call guard checks: static shapes, or a few dynamic dimensions.

`torch.compile` checks its guards on every call, about 50 µs on this class of CPU: more than a
small matvec itself costs, paid some 200 times per decoded token. Tracing with make_fx and
compiling the graph with `torch._inductor.compile` gives a callable that just runs the generated
C++ (about 10 µs), one per input shape, kept here. Tracing runs on fake tensors: a real run would
materialize the float planes that the fused kernel exists to avoid (hundreds of MB for an output head). Where inductor can't build (no C++ compiler),
the plain function is used and the reason is logged once.

`DynamicKernel` is the same for a function of a length that changes at every call (the positions a
decode step attends over): traced with symbolic sizes and strides and compiled once, so the generated
code takes them from its arguments.

A kernel compiled once is kept on disk (`kernel_store.KernelStore`): the next process loads it without
tracing.
"""

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._guards import TracingContext, tracing
from torch._inductor import CompiledArtifact
from torch._inductor.output_code import CompiledFxGraph
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils import _pytree as pytree

from bubo.kernels.index_strides import fast_index_strides
from bubo.kernels.kernel_store import kernel_store
from bubo.options import current_options

__all__ = ["DynamicKernel", "StaticKernel"]

log = logging.getLogger(__name__)

# Set while a kernel traces its function: a kernel called from inside another kernel's function
# (a matvec inside a whole decode step, bubo/engine/compiled_decode.py) then traces as plain torch code
# into the caller's graph, so inductor fuses it with what surrounds it.
_tracing = threading.local()

# A kernel is compiled for one layout of its arguments (the key holds every shape and stride), so the
# generated code's per-call checks of each input's size, stride and alignment would only repeat that:
# some 600 calls a decoded token on the default model.
#
# The thread count is read as a kernel runs (`cpp.dynamic_threads`), not written into its code: the
# thread governor (bubo/engine/thread_governor.py) runs a step on fewer threads when a neighbour keeps the
# cores busy, and a kernel baked for two threads would still start two.
_STATIC = {"size_asserts": False, "alignment_asserts": False, "cpp.dynamic_threads": True}
_FUSED = {
    **_STATIC,
    "realize_opcount_threshold": 100_000,
    "realize_reads_threshold": 100_000,
    "realize_acc_reads_threshold": 100_000,
    "cpp.enable_floating_point_contract_flag": "fast",
    # A matvec's reduction over a row's few groups (8 for a 1024-wide Q6_K row) stays a loop: inductor
    # would unroll it whole (8 or fewer steps), each step hundreds of instructions.
    "unroll_reductions_threshold": 1,
    # A one-row product with a small float matrix (a router, a shared expert's gate) as a reduction fused
    # with its neighbours rather than a call to the BLAS (inductor's decompose_mm_pass: 1 row, both
    # dimensions at most 2048).
    "post_grad_fusion_options": {"decompose_mm_pass": {}},
}


class _Kernel:
    """What both kinds of kernel share: `fn` compiled once per argument layout (`_key`), looked up on
    every call; inside another kernel's trace, `fn` itself; where inductor can't build, `fn` from then
    on (logged once)."""

    def __init__(self, fn: Callable[..., torch.Tensor], options: dict) -> None:
        self.fn = fn
        self._options = options
        self._compiled: dict[tuple, Callable[..., torch.Tensor]] = {}
        self._broken = False

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if getattr(_tracing, "active", False):
            return self.fn(*args)
        return self.kernel_for(*args)(*args)

    def kernel_for(self, *args: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The compiled kernel for arguments laid out as `args` (compiled now if it is new): a caller that
        passes the same layouts every time can keep it and skip the lookup."""
        # The options in force are part of what is traced (which matvecs a graph calls: --no-int8-matvec).
        key = (current_options(), *self._key(args))
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self._compiled[key] = self._compile(args)
        return kernel

    def _compile(self, args: tuple[torch.Tensor, ...]) -> Callable[..., torch.Tensor]:
        if self._broken:
            return self.fn
        # The thread count the code is generated for is one of its options: in the store's name, and in
        # inductor's own cache key.
        options = {**self._options, "cpp.threads": _compile_threads()}
        store = kernel_store()
        name = store.name(self.fn, self._key(args), options, args) if store else None
        # Traced in inference mode only when an argument was made in it (a cache allocated inside
        # `torch.inference_mode()`): outside it, a graph that updates such a tensor in place (a DeltaNet
        # state) fails to trace ("Inplace update to inference tensor outside InferenceMode").
        inference = any(a.is_inference() for a in args)
        try:
            with torch.inference_mode(inference), torch.no_grad():
                stored = store.load(name, options) if name else None
                if stored is not None:
                    return _direct_call(*stored, loaded=True)
                graph, artifact = self._build(args, options)
        except Exception as error:  # a missing compiler, an inductor limitation, or an assumed layout
            log.warning("inductor could not compile %s (%s); running it uncompiled", self.fn.__name__, error)
            self._broken = True
            return self.fn
        outputs = pytree.tree_structure(graph.graph.output_node().args[0])
        if name:
            store.save(name, artifact, outputs)
        return _direct_call(artifact, outputs, loaded=False)

    def _key(self, args: tuple[torch.Tensor, ...]) -> tuple:
        raise NotImplementedError

    def _build(
        self, args: tuple[torch.Tensor, ...], options: dict
    ) -> tuple[torch.fx.GraphModule, CompiledArtifact]:
        """The traced graph and inductor's compiled artifact of it (callable, as `fn` is), compiled with
        inductor's `options`."""
        raise NotImplementedError


class StaticKernel(_Kernel):
    """`fn` compiled once per distinct (shape, stride, dtype) of its tensor arguments."""

    def __init__(self, fn: Callable[..., torch.Tensor], fused: bool = False) -> None:
        # Inductor stores a pointwise result to memory once its expression grows past a few dozen
        # operations or reads; a matvec that expands 32 codes per block wants it all inline in the
        # reduction loop (materializing the expanded codes would cost more memory traffic than the
        # weights themselves), and FMA contraction.
        super().__init__(fn, _FUSED if fused else _STATIC)

    def _key(self, args: tuple[torch.Tensor, ...]) -> tuple:
        return tuple((a.shape, a.stride(), a.dtype) for a in args)

    def _build(
        self, args: tuple[torch.Tensor, ...], options: dict
    ) -> tuple[torch.fx.GraphModule, CompiledArtifact]:
        # Traced under a fake mode with a (static) shape env, compiled inside a tracing context that
        # holds it: without one inductor bypasses its on-disk FX graph cache ("No shape env") and
        # lowers every shape again at each load, seconds and ~30 MB of RSS more than a cache hit.
        mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
        fake = [mode.from_tensor(a, static_shapes=True) for a in args]
        graph = _trace(self.fn, mode, fake, "real")
        return graph, _inductor_compile(graph, list(args), mode, options)


def _direct_call(artifact: CompiledArtifact, outputs: pytree.TreeSpec, loaded: bool) -> Callable[..., Any]:
    """`artifact` (compiled now, or `loaded`: then it returns its outputs flat) as a function of the kernel's
    arguments returning the outputs structured as `outputs`, calling the innermost layer that does work
    directly: inductor's generated `call` where AOTAutograd's runtime wrapper around it has nothing to do
    at run time (`_generated_call`), else that wrapper. The layers around them (the artifact's call, the
    output restructuring, dynamo's disable context, the list of no parameters put in front, the wrapper's
    version counting and metrics) cost tens of microseconds a call in a decode step, paid a dozen times a
    step. The kernels run outside dynamo, so its disable context has nothing to do. Where the artifact
    isn't built as expected (another torch), it is called as it is."""
    runtime = _runtime_wrapper(artifact)
    if runtime is None:
        if loaded:
            return _structured(lambda args: artifact(*args), outputs)
        return artifact
    generated = _generated_call(runtime)
    if generated is None:
        return _structured(runtime, outputs)

    def call(args: list) -> list:
        # With grad enabled the wrapper turns it off around the call, as the generated code assumes.
        return runtime(args) if torch.is_grad_enabled() else generated(args)

    return _structured(call, outputs)


def _runtime_wrapper(artifact: CompiledArtifact) -> Callable[[list], list] | None:
    """AOTAutograd's runtime wrapper inside `artifact`, which takes the inputs as one list and returns the
    outputs as a flat list; None where the chain of wrappers around it isn't torch 2.13's."""
    fn = getattr(artifact, "_compiled_fn", None)
    for _ in range(4):
        cells = _closure(fn)
        if "params_buffers_flat" in cells:  # aot_module_simplified's forward: the parameters go first
            return None if cells["params_buffers_flat"] else cells.get("compiled_fn")
        if set(cells) == {"compiled_fn"}:  # a loaded artifact's `lambda *args: compiled_fn(list(args))`
            return cells["compiled_fn"]
        fn = cells.get("compiled_fn", cells.get("fn"))  # the output restructuring, the disable context
    return None


# What AOTAutograd's generated runtime wrapper may reference besides the call itself and still have
# nothing to do for an inference graph: bumping the version counters of inputs the graph mutates in
# place, which only autograd reads. A mutation applied after the call, an output rebuilt as a view of an
# input, dynamic-dimension marks or an autocast switch each add a name here, and the wrapper then runs.
_IDLE_WRAPPER_NAMES = {"torch", "_increment_version_", "__builtins__"}


def _generated_call(runtime: Callable[[list], list]) -> Callable[[list], list] | None:
    """Inductor's generated `call` (a list of inputs -> a list of outputs) under the AOTAutograd runtime
    wrapper `runtime`, when the wrapper does nothing else for it (`_IDLE_WRAPPER_NAMES`) and the layers
    between them only pass the list on; else None."""
    wrapper_fn = _unwrapped(runtime)
    cells = _closure(wrapper_fn)
    wrapper = cells.get("_codegen_runtime_wrapper")
    if wrapper is None:
        return None
    if set(wrapper.__globals__) - _IDLE_WRAPPER_NAMES or "enable_grad" in wrapper.__code__.co_names:
        return None
    inner = _unwrapped(cells.get("_inner_compiled_fn"))
    if not isinstance(inner, CompiledFxGraph) or inner.current_callable is None:
        return None
    return inner.current_callable


def _unwrapped(fn: Any) -> Any:
    """`fn` without the SerializableCompiledFunction layers around it (they only pass the call on)."""
    # Imported here: importing this module of torch's before torch._dynamo is a circular import.
    from torch._functorch._aot_autograd.runtime_wrappers import SerializableCompiledFunction

    while isinstance(fn, SerializableCompiledFunction):
        fn = fn.compiled_fn
    return fn


def _closure(fn: Any) -> dict[str, Any]:
    """The variables a function closes over, by name (none for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells, strict=True)}
    except ValueError:  # a cell not filled yet
        return {}


def _structured(runtime: Callable[[list], list], outputs: pytree.TreeSpec) -> Callable[..., Any]:
    """A function of the kernel's arguments calling `runtime` on them as a list, its flat outputs structured
    as `outputs`."""
    if outputs.is_leaf():
        return lambda *args: runtime(list(args))[0]
    if outputs.type is tuple and all(child.is_leaf() for child in outputs.children()):
        return lambda *args: tuple(runtime(list(args)))
    return lambda *args: pytree.tree_unflatten(runtime(list(args)), outputs)


def _trace(
    fn: Callable[..., torch.Tensor], mode: FakeTensorMode, fake: list[torch.Tensor], tracing_mode: str
) -> torch.fx.GraphModule:
    """`fn` traced on the fake tensors of `mode`, with every kernel it calls traced inline (_tracing)."""
    _tracing.active = True
    try:
        with mode:
            return make_fx(fn, tracing_mode=tracing_mode)(*fake)
    finally:
        _tracing.active = False


def _compile_threads() -> int:
    """The thread count inductor generates code for. Its code reads the count as it runs
    (`cpp.dynamic_threads`), but inductor still leaves a region's scalar steps unguarded by `omp single`
    when it compiles for one thread: run on two, both threads apply an in-place step, a sigmoid twice.
    So never fewer than two. Set explicitly (`cpp.threads`), the count is in inductor's FX graph cache key
    too (left at its default, it is not when threads are dynamic), so a graph compiled for one count is
    never served to a process running another."""
    return max(2, torch.get_num_threads())


def _inductor_compile(
    graph: torch.fx.GraphModule, example: list[torch.Tensor], mode: FakeTensorMode, options: dict
) -> CompiledArtifact:
    """`graph` compiled by inductor with `options`, inside a tracing context holding `mode`'s shape env:
    a standalone artifact, which the kernel store can save."""
    with (
        torch._inductor.config.patch(options),
        tracing(TracingContext(mode)),
        fast_index_strides(),
        warnings.catch_warnings(),
    ):
        # Said of a bfloat16 unpacking of float16 scales (both widen to float32 in it).
        warnings.filterwarnings("ignore", "bf16 and fp16 are mixed")
        return torch._inductor.standalone_compile(graph, example, dynamic_shapes="from_tracing_context")


# A dynamic size is traced at this value: not 0 or 1 (which tracing would specialize on), and not a
# multiple of a vector width (so the generated code keeps its loops' tails).
_DYNAMIC_HINT = 37


class DynamicKernel(_Kernel):
    """`fn` compiled once per layout of its arguments, where the dimensions `dynamic` names ({argument
    index: dims}) take any size at every call, and an argument with such a dimension any strides but a
    unit innermost one (a view into a cache of any capacity, or a contiguous copy): the generated code
    reads those sizes and strides from the arguments. Every dynamic dimension must have the same size in
    a call (one length), and `fn` must use them only as extents: like StaticKernel's, the compiled
    kernel checks nothing when called. Compiling refuses a function whose tracing assumed more (a
    stride equal to some product of sizes, as a contiguity test would, or a length's value), and the
    plain function runs."""

    def __init__(self, fn: Callable[..., torch.Tensor], dynamic: dict[int, tuple[int, ...]]) -> None:
        super().__init__(fn, _FUSED)
        self.dynamic = dynamic

    def _key(self, args: tuple[torch.Tensor, ...]) -> tuple:
        return tuple(self._layout(i, a) for i, a in enumerate(args))

    def _layout(self, index: int, a: torch.Tensor) -> tuple:
        dims = self.dynamic.get(index)
        if not dims:
            return (a.shape, a.stride(), a.dtype)
        return (tuple(-1 if d in dims else n for d, n in enumerate(a.shape)), a.stride(-1), a.dtype)

    def _build(
        self, args: tuple[torch.Tensor, ...], options: dict
    ) -> tuple[torch.fx.GraphModule, CompiledArtifact]:
        # No duck sizing: two sizes or strides that happen to be equal when traced stay two symbols.
        shape_env = ShapeEnv(duck_shape=False)
        mode = FakeTensorMode(shape_env=shape_env)
        fake, sizes, strides = [], set(), set()
        for index, a in enumerate(args):
            dims = self.dynamic.get(index, ())
            if not dims:
                fake.append(mode.from_tensor(a, static_shapes=True))
                continue
            context = StatelessSymbolicContext(
                dynamic_sizes=[
                    DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(a.dim())
                ],
                dynamic_strides=[DimDynamic.DYNAMIC] * (a.dim() - 1) + [DimDynamic.INFER_STRIDE],
            )
            symbolic = mode.from_tensor(_generic_example(a, dims), symbolic_context=context)
            sizes |= {symbolic.shape[d].node.expr for d in dims}
            strides |= {s.node.expr for s in symbolic.stride()[:-1] if isinstance(s, torch.SymInt)}
            fake.append(symbolic)
        graph = _trace(self.fn, mode, fake, "symbolic")
        # The graph's own reference to the shape env (the compile's tracing context holds it too):
        # left, it would be hashed into AOTAutograd's cache key, which it can't be, and every
        # load would compile the graph again instead of taking it from the cache.
        del graph.shape_env
        kernel = _inductor_compile(graph, fake, mode, options)
        # A stride replaced by anything, or a length by a constant (the function read its value),
        # is an assumption the generated code would make of every call. (A length replaced by
        # another is the one length every dynamic dim shares.)
        replaced = shape_env.replacements
        assumed = strides.intersection(replaced)
        assumed |= {s for s in sizes.intersection(replaced) if not replaced[s].free_symbols}
        if assumed:
            raise ValueError(f"tracing fixed {sorted(map(str, assumed))} to other values")
        return graph, kernel


def _generic_example(a: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """A tensor shaped like `a`, its dynamic dims at _DYNAMIC_HINT, cut from a larger one: no stride of
    it equals a product of its sizes, so tracing takes no contiguity for granted."""
    shape = [_DYNAMIC_HINT if d in dims else n for d, n in enumerate(a.shape)]
    base = torch.empty([n + 1 for n in shape], dtype=a.dtype, device=a.device)
    return base[tuple(slice(0, n) for n in shape)]
