"""A decode step compiled by inductor on the CPU: the model's own forward, with each layer's forward traced
into one graph. One token of one sequence, a verify pass's few tokens of one sequence, or one token each
of a few batched sequences.

Run eagerly, a layer is some 25 small ops between its matvecs (norms, rotary, residual adds, SwiGLU):
each an op dispatch and an OpenMP parallel region, about a third of a token's time on the default model.
Here the model's own `Decoder.residual` runs as it always does, but on a `CompiledState`, whose
`run_layer` calls the compiled trace of the layer's own `forward` instead of the module (the eager cache
calls the module), and whose `run_inputs` runs `Decoder.inputs` (the token embeddings and rotary
angles) as one more compiled graph, as `Decoder.head` (the output norm and head) runs after them:
make_fx traces the layer with its weights swapped for the graph's inputs (`LayerTensors`), and inductor
fuses the glue into the matvecs' loops (bubo/kernels/compiled.py: a matvec called while a graph traces
traces into it). Since the weights are inputs, not constants, every layer alike in structure and shapes
runs the same compiled graph: a model whose layers are alike compiles one graph per kind of step.

What can't be a fixed graph stays out of it as opaque ops the layer code calls inside a compiled step
(bubo/model/step_ops.py): the cache write with the attention over the whole cache (whose length grows every
step), run here (`_StepOps.attend`) as views of the pool and one attention kernel compiled for every length
(bubo/kernels/decode_attention.py); a token's routed experts where their stacks stay in the file's
blocks (`_StepOps.routed_experts`, the mixture-of-experts module's own expert loop; repacked stacks are
gathered by index inside the layer's graph); and qwen4exp's QSA token
mixer (`_StepOps.mix`), run eagerly, whose indexer state grows by whole blocks. A Gated DeltaNet layer's
recurrent and convolution states and qwen4exp's PLE history are inputs the graph updates in place.

The eager forward stays the reference; tests/engine/test_compiled_decode.py holds this step to it on
every architecture. Not covered (the runner, bubo/engine/runner.py, then runs the eager step and says
why): compute in a dtype other than float32 or off the CPU, a batch of qwen4exp's sequences (its indexer
and PLE states are per call), and a step inside which the prompt cache wants recurrent-state snapshots.
"""

import dataclasses
import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from bubo.kernels.compiled import StaticKernel
from bubo.kernels.decode_attention import decode_attention_kernel
from bubo.model.attention import Attention
from bubo.model.decoder import Decoder
from bubo.model.decoder_layer import DecoderLayer, DeltaNetMixer, HyperConnectedLayer, IndexedAttentionMixer
from bubo.model.moe import SparseMoE
from bubo.model.state import CacheBatch, DeltaNetState, KVCache, PLEState
from bubo.model.step_ops import layer_in_compiled_step, step_ops
from bubo.options import current_options

__all__ = ["CompiledDecodeStep", "CompiledState", "UnsupportedModelError"]

log = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The model has a part the compiled step doesn't cover; it decodes eagerly."""


# Attributes that name a layer's own slots or parts (which KV slot, which recurrent state, which modules
# form a row group), not its math: layers that differ only in them share a compiled graph.
_IDENTITY_ATTRIBUTES = frozenset({"layer_index", "state_index", "members", "training"})

# Where a tensor of a layer lives: (owner, "_parameters" | "_buffers" | "attr", name).
Place = tuple[Any, str, str]


class LayerTensors:
    """Every tensor a layer's forward may read, found by walking its modules: parameters, buffers, plain
    tensor attributes, and the tensors of dataclass attributes (repacked weights, row groups). A trace
    swaps them for its inputs (`swapped`); `signature` says which layers trace to the same graph."""

    def __init__(self, layer: nn.Module) -> None:
        self.places: list[Place] = []
        signature: list[Any] = []
        seen: set[int] = set()
        for module in layer.modules():
            signature.append(type(module).__name__)
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(module, kind).items():
                    if tensor is not None:
                        self.places.append((module, kind, name))
            self._walk(module, sorted(k for k in vars(module) if not k.startswith("_")), signature, seen)
        self.signature = tuple(signature)

    def _walk(self, owner: Any, names: Sequence[str], signature: list[Any], seen: set[int]) -> None:
        for name in names:
            value = getattr(owner, name)
            if isinstance(value, torch.Tensor):
                self.places.append((owner, "attr", name))
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                signature.append((name, type(value).__name__))
                if id(value) not in seen:  # a row group's packed matrix is shared by its members
                    seen.add(id(value))
                    self._walk(value, [f.name for f in dataclasses.fields(value)], signature, seen)
            elif name not in _IDENTITY_ATTRIBUTES and isinstance(
                value, int | float | str | bool | tuple | enum.Enum | type(None)
            ):
                signature.append((name, value))

    def tensors(self) -> list[torch.Tensor]:
        return [_get(place) for place in self.places]

    @contextmanager
    def swapped(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """The layer reading `tensors` (in `places` order) in place of its own while inside."""
        own = self.tensors()
        try:
            for place, tensor in zip(self.places, tensors, strict=True):
                _set(place, tensor)
            yield
        finally:
            for place, tensor in zip(self.places, own, strict=True):
                _set(place, tensor)


def _get(place: Place) -> torch.Tensor:
    owner, kind, name = place
    return getattr(owner, kind)[name] if kind != "attr" else getattr(owner, name)


def _set(place: Place, tensor: torch.Tensor) -> None:
    owner, kind, name = place
    if kind == "attr":
        object.__setattr__(owner, name, tensor)  # frozen dataclasses too
    else:
        getattr(owner, kind)[name] = tensor


class _TracedCache:
    """What a layer's forward sees as one sequence's cache while traced: an empty sequence (no masks, no
    snapshots) whose recurrent state, whichever index the layer asks for, and PLE state are the graph's
    state inputs."""

    length = 0
    batch = 1
    snapshot_at: tuple[int, ...] = ()

    def __init__(self, recurrent: DeltaNetState | None, ple: PLEState | None) -> None:
        self._recurrent = recurrent
        self.ple = ple

    @property
    def recurrent(self) -> "_TracedCache":
        return self

    def __getitem__(self, index: int) -> DeltaNetState:
        assert self._recurrent is not None
        return self._recurrent

    def step_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention's cache write and attention, as the opaque op the step runs (`_StepOps.attend`) for
        the layer running then."""
        return torch.ops.bubo.cached_attention(q, k, v)

    def opaque_mixer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A token mixer run eagerly as an op of the graph (`_StepOps.mix`)."""
        return torch.ops.bubo.token_mixer(x, cos, sin)


class _TracedBatch(CacheBatch):
    """What a layer's forward sees while traced for a batch's rows: each row's `_TracedCache`, and the
    step's attention op for all rows at once."""

    step_attention = _TracedCache.step_attention


def _has_state(layer: nn.Module) -> tuple[bool, bool]:
    """Whether a layer carries per-sequence state into its graph: a DeltaNet's, a PLE layer's."""
    return isinstance(layer.attention, DeltaNetMixer), getattr(layer, "ple", None) is not None


def _state_tensors(
    layer: nn.Module, has_state: tuple[bool, bool], caches: Sequence[KVCache]
) -> tuple[torch.Tensor, ...]:
    """The per-sequence state a layer's graph takes as inputs (and updates), of each row's sequence in
    turn: a DeltaNet layer's convolution and recurrent states, a PLE layer's token and conv history
    (`has_state`: which of the two the layer has)."""
    deltanet, ple = has_state
    out: list[torch.Tensor] = []
    for c in caches:
        if deltanet:
            state = c.recurrent[layer.attention.state_index]
            out += [state.conv_state, state.recurrent_state]
        if ple:
            assert c.ple is not None  # Decoder.new_cache makes one when a layer has PLE
            out += [c.ple.tokens, c.ple.conv_state]
    return tuple(out)


def _traced_cache(layer: nn.Module, rows: int, state: Sequence[torch.Tensor]) -> "_TracedCache | CacheBatch":
    """The cache a layer's trace sees: one sequence's, or for a batch's rows each row's own (a DeltaNet
    layer then runs its own batching of the rows' states, `DeltaNetMixer._forward_rows`)."""
    deltanet, ple = _has_state(layer)
    per_row = 2 * deltanet + 2 * ple
    caches = []
    for row in range(rows):
        mine = list(state[row * per_row : (row + 1) * per_row])
        recurrent = DeltaNetState(mine.pop(0), mine.pop(0)) if deltanet else None
        history = PLEState(mine.pop(0), mine.pop(0), layer.ple.embedding.eos_token_id) if ple else None
        caches.append(_TracedCache(recurrent, history))
    return caches[0] if rows == 1 else _TracedBatch(caches)  # type: ignore[arg-type]


def _layer_graph(layer: nn.Module, tensors: LayerTensors) -> StaticKernel:
    """`layer`'s forward as a kernel of (x, cos, sin, tokens, *state tensors, *layer tensors): compiled
    once per layout of those, for any layer with the same `signature`. A batch's rows (x [B, 1, hidden],
    B > 1) are distinct sequences, with `states` state tensors each."""

    def layer_step(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *rest: torch.Tensor
    ) -> torch.Tensor:
        rows, states = x.shape[0], 2 * sum(_has_state(layer))
        tokens, state, weights = rest[0], rest[1 : 1 + states * rows], rest[1 + states * rows :]
        cache = _traced_cache(layer, rows, state)
        with tensors.swapped(weights), layer_in_compiled_step():
            return layer(x, cos, sin, cache, tokens)

    layer_step.__name__ = f"layer_step_{type(layer.attention).__name__}_{type(layer.mlp).__name__}"
    return StaticKernel(layer_step, fused=True)  # type: ignore[arg-type]


def _part_graph(part: Callable[..., Any], arguments: int, tensors: LayerTensors, fused: bool) -> StaticKernel:
    """A part of the model's forward outside its layers (`Decoder.inputs`: the embeddings and rotary
    angles; `Decoder.head`: the output norm and head) as a kernel of (its `arguments` arguments, *the
    tensors of its modules): eagerly, their few ops each and the calls down to the embedding's and
    head's kernels were ~12% of a small hybrid model's step. `fused`: StaticKernel's, which the head's
    matvec wants; the inputs' graph is compiled as the embedding's own kernel is, without it."""

    def part_step(*args: torch.Tensor) -> Any:
        with tensors.swapped(args[arguments:]), layer_in_compiled_step():
            return part(*args[:arguments])

    part_step.__name__ = f"{part.__name__}_step"
    return StaticKernel(part_step, fused=fused)  # type: ignore[arg-type]


def _why_not(model: Decoder) -> str | None:
    """Why the compiled step can't run `model`, or None."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"compute on {model.device} in {model.dtype}; compiled: CPU float32"
    mixers = Attention | DeltaNetMixer | IndexedAttentionMixer
    for layer in model.layers:
        if not isinstance(layer, DecoderLayer | HyperConnectedLayer) or not isinstance(
            layer.attention, mixers
        ):
            return f"a {type(layer).__name__} with a {type(layer.attention).__name__}"
    return None


class CompiledDecodeStep:
    """`step(token, cache)` -> float32 logits [vocab] of the next position, as `model(token.view(1, 1),
    cache)[0, -1]` computes them, for a single-sequence KVCache (the cache advances by one).
    `step(tokens, cache)` with tokens [T] (a few: a speculative round's verify pass) runs them at the
    cache's next T positions in one pass -> logits [T, vocab], each position attending to those before
    it. `step.batch(tokens, caches)` runs the next token of several sequences as the rows of one pass
    (continuous batching's decode steps, bubo/engine/batcher.py)."""

    def __init__(self, model: Decoder) -> None:
        reason = _why_not(model)
        if reason:
            raise UnsupportedModelError(reason)
        self.model = model
        self.layers = list(model.layers)
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        self._tensors = [LayerTensors(layer) for layer in self.layers]
        self._weights = [t.tensors() for t in self._tensors]
        self._has_state = [_has_state(layer) for layer in self.layers]
        # One graph per kind of layer (the first layer of each signature is traced for all of them).
        graphs: dict[tuple, StaticKernel] = {}
        self._graphs = []
        for layer, tensors, has_state in zip(self.layers, self._tensors, self._has_state, strict=True):
            key = (tensors.signature, has_state)
            if key not in graphs:
                graphs[key] = _layer_graph(layer, tensors)
            self._graphs.append(graphs[key])
        inputs = LayerTensors(nn.ModuleList([model.embedding, model.rotary]))
        self._inputs, self._inputs_weights = (
            _part_graph(model.inputs, 2, inputs, fused=False),
            inputs.tensors(),
        )
        head = LayerTensors(nn.ModuleList([model.norm, model.output]))
        self._head, self._head_weights = _part_graph(model.head, 1, head, fused=True), head.tensors()
        # The compiled kernel of each layer (and of the inputs and the head) for each input layout, looked up
        # once: the lookup keys every input's shape and stride, and every step of the same kind passes the
        # same layouts.
        self._kernels: dict[tuple, Callable[..., Any]] = {}
        self._attention_kernels: dict[tuple[int, int], Callable[..., torch.Tensor]] = {}

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        logits = self._forward(tokens.view(1, -1), cache, [cache])[0]
        return logits if tokens.dim() else logits[0]

    def batch(self, tokens: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor:
        """The next token of each of several sequences (tokens [B], one single-sequence KVCache each; every
        cache advances by one) -> logits [B, vocab]: the sequences are the rows of one pass, so every
        matvec expands the weights' codes once for all of them, and each row attends over its own cache."""
        return self._forward(tokens.view(-1, 1), CacheBatch(caches), list(caches))[:, -1]

    def _forward(
        self, tokens: torch.Tensor, cache: KVCache | CacheBatch, caches: list[KVCache]
    ) -> torch.Tensor:
        """The model's forward on `tokens` [rows, T] through the compiled layers; row i continues
        `caches[i]` (one cache: `cache` itself; several: `cache` is their CacheBatch)."""
        # Each sequence's blocks are taken now, so the step's writes know whether they form one run.
        runs = [c.single_run(c.length + tokens.shape[1]) for c in caches]
        ops = _StepOps(self, list(zip(caches, runs, strict=True)))
        with step_ops(ops), torch.inference_mode():
            return self.head(self.model.residual(tokens, CompiledState(self, cache, caches, ops)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """`Decoder.head` (float32 logits of the last layer's residual) through its compiled graph."""
        return self._run_part(self._head, x, weights=self._head_weights)

    def run_inputs(
        self, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`Decoder.inputs` of a step through its compiled graph."""
        return self._run_part(self._inputs, tokens, positions, weights=self._inputs_weights)

    def _run_part(self, graph: StaticKernel, *inputs: torch.Tensor, weights: list[torch.Tensor]) -> Any:
        args = (*inputs, *weights)
        return self._kernel((graph, *(a.shape for a in inputs)), graph, args)(*args)

    def _kernel(self, key: tuple, graph: StaticKernel, args: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
        """`graph`'s compiled kernel for `args`, found by `key` (what sets a step's layouts) after the
        first time."""
        key = (current_options(), *key)  # options change what is traced (kernels/compiled.py)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = graph.kernel_for(*args)
        return kernel

    def run_layer(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tokens: torch.Tensor,
        caches: Sequence[KVCache],
        ops: "_StepOps",
    ) -> torch.Tensor:
        """One layer of a step through its compiled graph; row i continues `caches[i]`."""
        i = self._index[id(layer)]
        state = _state_tensors(layer, self._has_state[i], caches)
        args = (x, cos, sin, tokens, *state, *self._weights[i])
        kernel = self._kernel((i, x.shape, cos.shape), self._graphs[i], args)
        ops.layer = layer
        return kernel(*args)

    def attention(self, slot: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """decode_attention for layer `slot`, its compiled kernel looked up once per layer and query count:
        the layouts don't change between steps (only the length, which the kernel reads from its inputs)."""
        kernel = self._attention_kernels.get((slot, q.shape[2]))
        if kernel is None:
            kernel = self._attention_kernels[slot, q.shape[2]] = decode_attention_kernel(q, keys, values)
        return kernel(q, keys, values)

    def warm_up(self, tokens: int = 1) -> None:
        """Compile every graph for passes of `tokens` tokens now (seconds to a minute on a cold inductor
        cache) by running one on a scratch cache, rather than on the first decoded token or verify pass."""
        cache = self.model.new_cache(max_len=tokens + 1)
        self(torch.zeros(() if tokens == 1 else (tokens,), dtype=torch.long), cache)

    def warm_up_batch(self, rows: int) -> None:
        """Compile every graph for `batch` passes of `rows` sequences now, on scratch caches: a batch's
        layer inputs are [rows, 1, ...], not a verify pass's [1, rows, ...], so they are other kernels."""
        caches = [self.model.new_cache(max_len=2) for _ in range(rows)]
        self.batch(torch.zeros(rows, dtype=torch.long), caches)


class CompiledState:
    """The cache a compiled step hands the model's forward: the step's KVCache or CacheBatch, whose layers
    run through their compiled graphs (`CompiledDecodeStep.run_layer`)."""

    def __init__(
        self, step: CompiledDecodeStep, cache: KVCache | CacheBatch, caches: list[KVCache], ops: "_StepOps"
    ) -> None:
        self._step, self._cache, self._caches, self._ops = step, cache, caches, ops

    def positions(self, length: int) -> torch.Tensor:
        return self._cache.positions(length)

    def run_layer(
        self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        return self._step.run_layer(layer, x, cos, sin, tokens, self._caches, self._ops)

    def run_inputs(
        self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._step.run_inputs(tokens, positions)

    def advance(self, n: int) -> None:
        self._cache.advance(n)


def _write_and_view(pool: torch.Tensor, run: int, start: int, new: torch.Tensor) -> torch.Tensor:
    """Store `new` [kv_heads, tokens, D] at positions start.. of a sequence whose positions lie at `run`..
    of a layer's pool [kv_heads, pool positions, D], and return positions 0..start + tokens - 1 as [1,
    kv_heads, start + tokens, D]: two ops where KVCache.update runs a dozen (a decode step pays this twice
    a layer)."""
    tokens = new.shape[1]
    pool.narrow(1, run + start, tokens).copy_(new)
    heads, _, dim = pool.shape
    head_stride, position_stride, dim_stride = pool.stride()
    return pool.as_strided(
        (1, heads, start + tokens, dim),
        (heads * head_stride, head_stride, position_stride, dim_stride),
        pool.storage_offset() + run * position_stride,
    )


def _store(
    cache: KVCache, slot: int, run: int | None, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [kv_heads, rows, D] written at the cache's next positions of layer `slot`; its keys and
    values up to them."""
    if run is None:
        return cache.update(slot, k[None], v[None])
    start = cache.length
    return (
        _write_and_view(cache.pool.keys[slot], run, start, k),
        _write_and_view(cache.pool.values[slot], run, start, v),
    )


class _StepOps:
    """The opaque points of one step's layers (bubo/model/step_ops.py): `sequences` are the caches the
    step's rows belong to, in row order, each with the pool position of its blocks' one run (or None);
    `layer` is the layer running now."""

    def __init__(self, step: CompiledDecodeStep, sequences: list[tuple[KVCache, int | None]]) -> None:
        self.step = step
        self.sequences = sequences
        self.layer: nn.Module | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.layer is not None
        slot = self.layer.attention.layer_index
        single = len(self.sequences) == 1  # the usual case: no slicing of q, no concatenation
        outputs = []
        for row, (cache, run) in enumerate(self.sequences):
            keys, values = _store(cache, slot, run, k[row], v[row])
            outputs.append(self.step.attention(slot, q if single else q[row : row + 1], keys, values))
        return outputs[0] if single else torch.cat(outputs)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        assert self.layer is not None and len(self.sequences) == 1  # qwen4exp runs no cache batch
        return self.layer.attention(x, cos, sin, self.sequences[0][0])

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        assert self.layer is not None
        moe = self.layer.mlp
        assert isinstance(moe, SparseMoE)
        return moe.routed(x, weights, chosen)
