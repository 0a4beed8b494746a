"""A decode step (one token, one sequence) of static shapes and device-side state, captured whole as a CUDA
graph and replayed per token, in place of the eager model's many small launches.

The eager step cannot be captured: `KVCache.write` slices the pool at the cache's host-side length and
the paged-attention tables are built from host lists, so a capture would bake one step's position in.
Here everything that changes from token to token lives in preallocated device tensors (`StepInputs`):
the token, its rope position, the attended length, the pool position its keys and values go to, and the
block table at a fixed width (the whole pool's block count). The host updates them in place before each
replay (`StepInputs.load`: fills and a device-to-device copy of the sampled token, no read back); the
step writes k/v with `index_copy_` at the device index and attends over a static-shaped view: the
Triton paged kernel reading the lengths and table from device tensors (CUDA), or a gather of the
table's positions under a length mask (anywhere, the path the CPU tests trace).

The step is the model's own forward (`Decoder.forward` on a `StaticState`, its layers in a step:
bubo/model/step_ops.py), so it covers what the modules cover without host syncs: attention layers (llama, qwen2, qwen3,
gated attention) and Gated DeltaNet layers (hybrid qwen35 / qwen3next: their recurrent states are the
cache's own tensors, advanced in place), with a dense MLP or a mixture of experts whose quantized
experts run in the fused Triton kernel (qwen3moe / qwen35moe on CUDA: the routed ids stay on the
device); not the CPU's expert loop (it reads the ids back) or qwen4exp's streams and indexer. tests/engine/test_graph_decode.py holds it to the eager decoder and traces it with
`torch.compile(fullgraph=True)`, which fails on any `.item()`, `.tolist()` or value-dependent branch.

Capture follows PyTorch's recipe (warm-up runs on a side stream, then `torch.cuda.graph`); it happens on
a cache's first decoded token, with that token's inputs loaded, so the warm-up runs write the same keys
and values the replay will (a DeltaNet layer's state is restored after them: they advance it). A failed capture logs a warning once and the model decodes eagerly.
--no-cuda-graphs (`RuntimeOptions.cuda_graphs`) turns the path off.
"""

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bubo.kernels.triton_support import TRITON_TYPES, triton_enabled
from bubo.model.attention import Attention
from bubo.model.block_pool import BlockPool
from bubo.model.decoder import Decoder
from bubo.model.decoder_layer import DecoderLayer, DeltaNetMixer
from bubo.model.layers import MLP, RMSNorm
from bubo.model.moe import QuantizedExpertMatrices, SparseMoE
from bubo.model.state import DeltaNetState, KVCache
from bubo.model.step_ops import layer_in_compiled_step

__all__ = [
    "GraphDecodeStep",
    "StaticState",
    "StepInputs",
    "UnsupportedGraphModelError",
    "capture_cuda_graph",
    "masked_attention",
    "paged_attention",
    "static_decode_step",
]

log = logging.getLogger(__name__)

# Runs before capture: the first compiles the Triton kernels and settles the allocator; PyTorch's
# CUDA-graph notes use a few on a side stream so that lazy initialisation is not captured.
WARM_UP_RUNS = 3

Run = Callable[[], torch.Tensor]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "StepInputs", int], torch.Tensor]


class UnsupportedGraphModelError(ValueError):
    """The model has a part the static step can't run without host syncs; it decodes eagerly."""


@dataclass
class StepInputs:
    """The per-token state of a static step, as device tensors updated in place (a captured graph reads
    their addresses): token [1] long, rope position [1] long, attended length [1] int32 (the new position
    included), the pool position the new keys and values go to [1] long, and the block table [1, width]
    int32 (zero-padded past the cache's blocks, never read there)."""

    token: torch.Tensor
    position: torch.Tensor
    length: torch.Tensor
    slot: torch.Tensor
    table: torch.Tensor
    # The blocks the table holds now: it is copied over only when they change.
    loaded_blocks: tuple[int, ...] | None = None

    @classmethod
    def allocate(cls, width: int, device: torch.device) -> "StepInputs":
        def scalar(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(1, dtype=dtype, device=device)

        table = torch.zeros(1, width, dtype=torch.int32, device=device)
        return cls(scalar(torch.long), scalar(torch.long), scalar(torch.int32), scalar(torch.long), table)

    def load(self, token: torch.Tensor, cache: KVCache) -> None:
        """Set the inputs for the step that continues `cache` (one sequence, room for the position
        reserved) with `token`, a device tensor: copied on the device, never read back."""
        position, size, blocks = cache.length, cache.pool.block_size, cache.tables[0]
        if len(blocks) > self.table.shape[1]:
            raise ValueError(
                f"a block table of {len(blocks)} blocks exceeds the step's {self.table.shape[1]}"
            )
        self.token.copy_(token.reshape(1))
        self.position.fill_(position + cache.rope_delta)
        self.length.fill_(position + 1)
        self.slot.fill_(blocks[position // size] * size + position % size)
        # The table changes only when a block is taken or copied on write, or another cache comes.
        if self.loaded_blocks != tuple(blocks):
            padded = torch.tensor([blocks + [0] * (self.table.shape[1] - len(blocks))], dtype=torch.int32)
            if self.table.is_cuda:
                # From pinned memory the copy is queued without waiting for the GPU (a pageable one
                # synchronises); the pinned allocator keeps the buffer until the copy has run.
                padded = padded.pin_memory()
            self.table.copy_(padded, non_blocking=True)
            self.loaded_blocks = tuple(blocks)


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, inputs: StepInputs, block_size: int
) -> torch.Tensor:
    """Attention of q [1, heads, 1, D] over the pool positions of every block in the table ([kv_heads,
    width * block_size, D] gathered from the layer's pool), the positions at or past `length` masked
    out: static shapes whatever the length. Costs the table's width, not the length."""
    offsets = torch.arange(block_size, device=keys.device)
    where = (inputs.table[0, :, None].long() * block_size + offsets).reshape(-1)
    k, v = keys.index_select(1, where)[None].to(q.dtype), values.index_select(1, where)[None].to(q.dtype)
    visible = torch.arange(where.shape[0], device=keys.device) < inputs.length
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible.view(1, 1, 1, -1), enable_gqa=True)


def paged_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, inputs: StepInputs, block_size: int
) -> torch.Tensor:
    """The same attention by the Triton paged kernel, which reads the table and the length on the device
    and skips the partitions past the length: costs the length."""
    from bubo.kernels.triton_paged_attention import paged_attention_decode

    out = paged_attention_decode(q[:, :, 0], keys, values, inputs.table, inputs.length, block_size)
    return out[:, :, None]


def check_supported(model: nn.Module) -> Decoder:
    """`model` as a Decoder whose decode step `static_decode_step` runs, or UnsupportedGraphModelError."""
    if not isinstance(model, Decoder):
        raise UnsupportedGraphModelError(f"a {type(model).__name__}, not a Decoder")
    config = model.config
    if config.hc_count or config.indexer or config.ple or type(model.norm) is not RMSNorm:
        raise UnsupportedGraphModelError("qwen4exp's residual streams, indexer or PLE")
    for layer in model.layers:
        mixer = layer.attention
        if not isinstance(layer, DecoderLayer) or not (
            type(mixer) is Attention or type(mixer) is DeltaNetMixer
        ):
            raise UnsupportedGraphModelError(f"a layer with a {type(mixer).__name__}")
        if not (isinstance(layer.mlp, MLP) or _fused_experts(layer.mlp, model.device)):
            # The expert loop (CPU, float experts) reads the chosen expert ids back to the host.
            raise UnsupportedGraphModelError(
                f"a {type(layer.mlp).__name__} feed-forward, not fused on the device"
            )
    return model


def _fused_experts(mlp: nn.Module, device: torch.device) -> bool:
    """Whether `mlp` is a mixture of experts whose one-token step is the fused Triton kernel, which takes
    the routed expert ids on the device (quantized experts of the types it reads, on CUDA)."""
    if not isinstance(mlp, SparseMoE):
        return False
    stacks = (mlp.gate, mlp.up, mlp.down)
    quantized = all(isinstance(s, QuantizedExpertMatrices) and s.ggml_type in TRITON_TYPES for s in stacks)
    return quantized and triton_enabled(device)


class StaticState:
    """The cache a captured step hands the model's forward: every per-token value is in `inputs`' device
    tensors, so the forward's Python is the same at every token. Its layers run as they are, in a step
    (`layer_in_compiled_step`): an attention layer writes its new key and value at `inputs.slot` with
    `index_copy_` and attends with `attend` over a static-shaped view; a DeltaNet layer advances the
    cache's own recurrent states in place. `advance` is left to the caller, after the replay."""

    length = 0  # no position is read on the host: the rotary positions come from `inputs`
    snapshot_at: tuple[int, ...] = ()

    def __init__(
        self, pool: BlockPool, recurrent: Sequence[DeltaNetState], inputs: StepInputs, attend: Attend
    ) -> None:
        self.pool, self.recurrent, self.inputs, self.attend = pool, list(recurrent), inputs, attend

    def positions(self, length: int) -> torch.Tensor:
        return self.inputs.position

    def run_layer(
        self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        return layer(x, cos, sin, self, tokens)

    def run_inputs(
        self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return model.inputs(tokens, positions)

    def step_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys.index_copy_(1, self.inputs.slot, k[0].to(keys.dtype))
        values.index_copy_(1, self.inputs.slot, v[0].to(values.dtype))
        return self.attend(q, keys, values, self.inputs, self.pool.block_size)

    def advance(self, n: int) -> None:
        """Nothing: the captured step advances the real cache after each replay."""


def static_decode_step(
    model: Decoder,
    pool: BlockPool,
    recurrent: Sequence[DeltaNetState],
    inputs: StepInputs,
    attend: Attend,
) -> torch.Tensor:
    """float32 logits [vocab] of the position after `inputs.token`, as `model(token.view(1, 1),
    cache)[0, -1]` computes them: the model's own forward on a `StaticState`, with the new keys and
    values written into `pool` at `inputs.slot` and the DeltaNet layers' `recurrent` states (a hybrid
    model's; the cache's own) advanced in place. Every shape is fixed and nothing is read back to the
    host: capturable, and traceable whole. Run it inside `layer_in_compiled_step` (set before a trace
    starts: a trace sees the flag as a constant)."""
    return model(inputs.token.view(1, 1), StaticState(pool, recurrent, inputs, attend))[0, -1]


def capture_cuda_graph(run: Run) -> Run:
    """Capture `run` (a step reading and writing only preallocated tensors) as a CUDA graph; the returned
    function replays it and returns the captured output tensor, overwritten by each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARM_UP_RUNS):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the server's other slots keep running their own (eager) work in their threads while
    # this one captures; only this thread's calls are checked for capture safety.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


@dataclass
class _Captured:
    """One cache's captured step: its inputs and the replay (whose closure holds the pool and recurrent
    states, so the memory the graph addresses stays allocated while the cache lives)."""

    inputs: StepInputs
    replay: Run


class GraphDecodeStep:
    """`step(token, cache)` -> float32 logits [vocab], as `model(token.view(1, 1), cache)[0, -1]`, for
    a single-sequence KVCache (the cache advances by one): the static step captured by `capture` on
    first use with a cache and replayed after that, or the eager model's step once a capture failed.
    `attend` is the static attention (`paged_attention` on CUDA with Triton)."""

    def __init__(self, model: nn.Module, attend: Attend, capture: Callable[[Run], Run] = capture_cuda_graph):
        # Held weakly: the model's runner (bubo/engine/runner.py), kept weakly by model, holds the step.
        self._model = weakref.ref(check_supported(model))
        self.attend = attend
        self.capture = capture
        self.failed = False
        # The server's slots run `generate` in threads of their own: one at a time loads the inputs,
        # replays and advances its cache, as they all share the one set of inputs.
        self._lock = threading.Lock()
        # A graph per cache: it addresses the cache's pool and recurrent states. A server slot keeps
        # its cache (one capture per slot); a fresh cache per generation is captured again. Weak keys:
        # a cache's graph goes with it.
        self._captured: weakref.WeakKeyDictionary[KVCache, _Captured] = weakref.WeakKeyDictionary()

    def captured(self, cache: KVCache) -> bool:
        """Whether a captured step is ready to replay for `cache`."""
        return cache in self._captured

    @property
    def model(self) -> Decoder:
        model = self._model()
        if model is None:
            raise ReferenceError("the model of this decode step was freed")
        return model

    def __call__(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        model = self.model
        if self.failed:
            return model(token.view(1, 1), cache)[0, -1]
        with self._lock:
            return self._replay(model, token, cache)

    def _replay(self, model: Decoder, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if not cache.reserve(1):
            raise ValueError(f"KV cache full: no room past {cache.length} positions")
        captured = self._captured.get(cache)
        if captured is None:
            inputs = StepInputs.allocate(cache.pool.num_blocks, model.device)
            inputs.load(token, cache)
            model_ref, pool, recurrent, attend = self._model, cache.pool, list(cache.recurrent), self.attend
            # The warm-up runs advance the DeltaNet states (keys and values they only write again): put
            # back before the first replay, or before the eager step when the capture failed.
            saved = [state.snapshot() for state in recurrent]
            replay: Run | None
            try:
                with layer_in_compiled_step():
                    replay = self.capture(
                        lambda: static_decode_step(model_ref(), pool, recurrent, inputs, attend)
                    )
            except Exception as error:  # any failure to capture: decode eagerly, as before
                log.warning("CUDA graph capture of the decode step failed, decoding eagerly: %r", error)
                self.failed = True
                self._captured.clear()
                replay = None
            for state, before in zip(recurrent, saved, strict=True):
                state.restore(before)
            if replay is None:
                return model(token.view(1, 1), cache)[0, -1]
            captured = self._captured[cache] = _Captured(inputs, replay)
        else:
            captured.inputs.load(token, cache)
        with layer_in_compiled_step():  # a CUDA graph replays no Python; the CPU tests' stand-ins do
            logits = captured.replay()
        cache.advance(1)
        # The replay's output is overwritten by the next one; the caller may hold these logits longer.
        return logits.clone()
