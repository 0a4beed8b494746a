"""Where a layer's code meets a compiled or captured step: the points that can't be a fixed graph.

The compiled CPU step (bubo/engine/compiled_decode.py) traces each layer's own forward into a graph, and
the captured CUDA step (bubo/engine/graph_decode.py) records the model's own forward as a CUDA graph.
Three things in a layer can't be a fixed graph: writing the new keys and values into the cache and
attending over every cached position (the cache grows by a position each step); a token's routed
experts on the CPU where their stacks stay in the file's blocks (which ones is known only once the router
has run, and only those are read; repacked stacks are gathered by index inside the graph instead); and
QSA's indexed attention (qwen4exp), whose indexer state grows by whole compressed blocks. While a layer
runs inside such a step (`in_compiled_step`), Attention asks the step's state for its cache write and
attention (`state.step_attention`), IndexedAttentionMixer asks it to run the mixer (`state.opaque_mixer`),
and SparseMoE calls the routed-experts op for stacks it can't gather. The compiled step's state answers
with the custom ops below: a trace records each as one opaque call (its fake implementation gives the
output's shape), and when the graph runs, the op hands the work to the `StepOps` the engine installed for
the step (`step_ops`), which knows the step's caches and the layer being run, as nano-vllm's attention
reads its per-step context. The captured step's state answers with device-side writes and static-shaped
attention instead.
"""

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

__all__ = ["StepOps", "in_compiled_step", "layer_in_compiled_step", "step_ops"]


class StepOps(Protocol):
    """What the engine does at the two opaque points of a compiled step's layer."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v [B, kv_heads, T, D] at the running layer's next positions of each row's cache and
        return the attention of q [B, heads, T, D] over them: [B, heads, T, D]."""
        ...

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The running layer's routed experts for rows x [rows, hidden], with the router's top-k `weights`
        and `chosen` experts [rows, top_k]: the weighted sum [rows, hidden]."""
        ...

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The running layer's token mixer on x [B, T, hidden], run eagerly on the step's cache."""
        ...


_local = threading.local()


@contextmanager
def _setting(name: str, value: object) -> Iterator[None]:
    """This thread's `name` set to `value` while inside."""
    previous = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, previous)


def step_ops(ops: StepOps) -> AbstractContextManager[None]:
    """Install `ops` as what the ops below call while a compiled step runs on this thread."""
    return _setting("ops", ops)


def layer_in_compiled_step() -> AbstractContextManager[None]:
    """Mark a layer's forward as running inside a compiled or captured step (traced, replayed, or run as
    it is where inductor can't build): its cache write, attention and routed experts take the step's
    forms."""
    return _setting("layer", True)


# A constant of a dynamo trace (the captured CUDA step's tests trace it whole): it doesn't change inside one.
@torch.compiler.assume_constant_result
def in_compiled_step() -> bool:
    """Whether the layer code running now is a compiled or captured step's (`layer_in_compiled_step`)."""
    return bool(getattr(_local, "layer", False))


def _ops() -> StepOps:
    ops = getattr(_local, "ops", None)
    if ops is None:
        raise RuntimeError("a compiled step's op ran outside a step (no StepOps installed)")
    return ops


# Registered through torch.library's low-level API: a call from the compiled graph's wrapper then costs
# one dispatcher hop (the decorator API wraps each call in several Python layers, paid twice a layer).
_library = torch.library.Library("bubo", "DEF")
_library.define("cached_attention(Tensor q, Tensor k, Tensor v) -> Tensor")
_library.define("routed_experts(Tensor x, Tensor weights, Tensor chosen) -> Tensor")
_library.define("token_mixer(Tensor x, Tensor cos, Tensor sin) -> Tensor")


def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _ops().attend(q, k, v)


def _routed_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    return _ops().routed_experts(x, weights, chosen)


def _token_mixer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The mixer's own forward runs inside: its layer code must take its eager paths there.
    with _setting("layer", False):
        return _ops().mix(x, cos, sin)


_library.impl("cached_attention", _cached_attention, "CompositeExplicitAutograd")
_library.impl("token_mixer", _token_mixer, "CompositeExplicitAutograd")
_library.impl("routed_experts", _routed_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("bubo::cached_attention")
def _cached_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("bubo::token_mixer")
def _token_mixer_shape(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("bubo::routed_experts")
def _routed_experts_shape(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
