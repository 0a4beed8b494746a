"""A decode step compiled by inductor on the CPU, in place of the eager model's: one token of one sequence,
a verify pass's few tokens of one sequence, or one token each of a few batched sequences.

The eager decoder runs some 25 small ops a layer between its compiled matvecs (norms, rotary, residual
adds, the SwiGLU product): each an op dispatch and an OpenMP parallel region, about a third of a
token's time on the default model. Here everything of a layer that sits between one attention and the
next is one compiled graph: the output projection, residual, MLP, the next layer's norm, q/k/v
projection, q/k norms and rotary. The quantized matvecs trace into that graph as plain torch code
(bubo/kernels/compiled.py inlines a kernel called while another traces) and inductor fuses the glue
into their loops. Attention itself runs between the segments: the cache grows by a position every
step, so its length is the one shape that changes. The new position is written into the cache in place
(or by KVCache.update when the sequence's blocks are not one run), and the attention over it is one
kernel compiled for every length (bubo/kernels/decode_attention.py), in place of SDPA's machinery.

The weights are inputs of the compiled graphs, not constants, so every layer with the same shapes runs
the same compiled segment: three compiles (entering the first layer, between layers, the head) for a
model whose layers are alike, one more for each other pair of neighbouring layer formats (a Q4_K_M
file mixes Q4_K and Q6_K down projections: four between-layer graphs). The eager model
(bubo/model/decoder.py) stays the reference; the segments compute its float32 math op for op, and
tests/engine/test_compiled_decode.py holds them to it.

Covered: dense transformer layers (llama, qwen2, qwen3: biases, q/k norms) in float32 whose projections
are repacked blocks (`QuantizedLinear.packed`: Q4_0/Q4_1 as PackedQ4, Q8_0/Q5_0/IQ4_NL as PackedQ8, Q5_1
as PackedQ8Offset, the K-quants and IQ4_XS as PackedSuperBlocks) or float weights, and qwen3moe's
mixture-of-experts layers whose expert stacks are repacked (bubo/model/moe.py): such a layer's graph
ends at the router's top-k; each routed expert runs as a compiled graph of its own
(`SparseMoE.one_token`), and a second graph adds their sum and goes on to the next attention. Anything
else (a hybrid's DeltaNet or gated attention, a shared expert, qwen4exp, another compute dtype, a weight
format the matvecs don't read) keeps the eager step: the runner (bubo/engine/runner.py) says why in its plan.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.inductor_prims import force_stride_order

from bubo.gguf.config import RopeStyle
from bubo.kernels.compiled import StaticKernel
from bubo.kernels.decode_attention import decode_attention_kernel
from bubo.model.attention import Attention
from bubo.model.decoder import Decoder, DecoderLayer
from bubo.model.layers import MLP, RMSNorm, apply_rotary, rms_norm
from bubo.model.moe import SparseMoE, top_k_routing
from bubo.model.quantized_linear import (
    MIN_PACKED_WEIGHTS,
    Packed,
    QuantizedLinear,
    packed_graph_inputs,
    packed_graph_matvec,
    packed_graph_tensors,
)
from bubo.model.state import KVCache

__all__ = [
    "CompiledDecodeStep",
]

log = logging.getLogger(__name__)

Tensors = tuple[torch.Tensor, ...]


class UnsupportedModelError(ValueError):
    """The model has a part the compiled step doesn't cover; it decodes eagerly."""


@dataclass(frozen=True)
class _Projection:
    """How the step runs one or more projections of the same input as one product: the weight's
    format, the widths of the members (split from one output), and whether a bias is added. The
    tensors are passed in at each call: [word bits(, per-block fields)] packed, or [weight] float (+ bias)."""

    kind: str  # "dense", or a packed kind (quantized_linear.packed_graph_inputs)
    sizes: tuple[int, ...]
    has_bias: bool

    def __call__(self, x: torch.Tensor, tensors: Tensors) -> list[torch.Tensor]:
        """x [rows, in] -> each member's [rows, out]."""
        out_features = sum(self.sizes)
        # Store the input once: left as an expression, inductor would inline it (a norm, SiLU's exp)
        # into the matvec's loop, to be recomputed for every tile of output rows.
        x = force_stride_order(x, x.stride())
        if self.kind == "dense":
            y = F.linear(x, tensors[0])
        else:
            y = packed_graph_matvec(self.kind, x, tensors[: _tensor_count(self.kind)], out_features)
        if self.has_bias:
            y = y + tensors[-1]
        return list(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [y]


def _tensor_count(kind: str) -> int:
    """Tensors a product of `kind` takes before a bias: a float weight, or a packed matrix's."""
    return 1 if kind == "dense" else packed_graph_tensors(kind)


def _projections(*linears: nn.Module) -> list[tuple[_Projection, Tensors]]:
    """The products that compute `linears` (one input), each with its tensors: one when they are a
    packed row group, else one per member (float weights are used as they are: stacking them would
    copy them)."""
    group = getattr(linears[0], "group", None)
    if group is not None and group.members == tuple(id(m) for m in linears):
        return [_packed(group.packed, [m.bias for m in linears], group.sizes)]
    out = []
    for m in linears:
        if isinstance(m, QuantizedLinear) and m.packed is not None:
            out.append(_packed(m.packed, [m.bias], (m.out_features,)))
        elif isinstance(m, QuantizedLinear) and m.out_features * m.in_features <= MIN_PACKED_WEIGHTS:
            # Too small to pack (test models): its float weight is as small as its blocks.
            weight = m._dequantize_rows(0, m.out_features, torch.float32).clone()
            out.append(_with_bias("dense", (weight,), [m.bias], (m.out_features,)))
        elif isinstance(m, nn.Linear):
            out.append(_with_bias("dense", (m.weight,), [m.bias], (m.out_features,)))
        else:
            raise UnsupportedModelError(f"a projection the compiled step can't run: {m}")
    return out


def _packed(packed: Packed, biases: list, sizes: tuple[int, ...]) -> tuple[_Projection, Tensors]:
    return _with_bias(*packed_graph_inputs(packed), biases, sizes)


def _with_bias(
    kind: str, tensors: Tensors, biases: list, sizes: tuple[int, ...]
) -> tuple[_Projection, Tensors]:
    if all(b is None for b in biases):
        return _Projection(kind, sizes, False), tensors
    if any(b is None for b in biases):
        raise UnsupportedModelError("projections of one input with and without biases")
    return _Projection(kind, sizes, True), (*tensors, torch.cat(list(biases)))


def _project(
    x: torch.Tensor, products: Sequence[_Projection], tensors: Sequence[Tensors]
) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for product, ts in zip(products, tensors, strict=True):
        out += product(x, ts)
    return out


@dataclass(frozen=True)
class _LayerPlan:
    """What is fixed about a layer's compiled math (its tensors come separately, `_LayerTensors`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_style: RopeStyle
    qk_norm: bool
    qkv: tuple[_Projection, ...]
    o: tuple[_Projection, ...]
    gate_up: tuple[_Projection, ...]  # empty in a mixture-of-experts layer,
    down: tuple[_Projection, ...]
    router: tuple[_Projection, ...]  # which routes to experts instead
    top_k: int
    norm_topk_prob: bool


@dataclass(frozen=True)
class _LayerTensors:
    attn_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: tuple[Tensors, ...]
    o: tuple[Tensors, ...]
    ffn_norm: torch.Tensor
    gate_up: tuple[Tensors, ...]
    down: tuple[Tensors, ...]
    router: tuple[Tensors, ...]

    def flat(self) -> list[torch.Tensor]:
        """Every tensor in a fixed order (`_unflatten` reads it back)."""
        norms = [self.attn_norm, self.ffn_norm]
        if self.q_norm is not None and self.k_norm is not None:
            norms += [self.q_norm, self.k_norm]
        groups = (self.qkv, self.o, self.gate_up, self.down, self.router)
        return norms + [t for group in groups for ts in group for t in ts]


def _unflatten(plan: _LayerPlan, flat: Sequence[torch.Tensor]) -> _LayerTensors:
    flat = list(flat)
    attn_norm, ffn_norm = flat.pop(0), flat.pop(0)
    q_norm = k_norm = None
    if plan.qk_norm:
        q_norm, k_norm = flat.pop(0), flat.pop(0)

    def take(products: tuple[_Projection, ...]) -> tuple[Tensors, ...]:
        out = []
        for product in products:
            count = _tensor_count(product.kind) + product.has_bias
            out.append(tuple(flat[:count]))
            del flat[:count]
        return tuple(out)

    qkv, o, gate_up, down = take(plan.qkv), take(plan.o), take(plan.gate_up), take(plan.down)
    return _LayerTensors(attn_norm, q_norm, k_norm, qkv, o, ffn_norm, gate_up, down, take(plan.router))


def _plan_layer(layer: nn.Module) -> tuple[_LayerPlan, _LayerTensors]:
    if not isinstance(layer, DecoderLayer) or type(layer.attention) is not Attention:
        raise UnsupportedModelError(f"a {type(layer).__name__} with a {type(layer.attention).__name__}")
    attention, mlp = layer.attention, layer.mlp
    if attention.output_gate:
        raise UnsupportedModelError("gated attention")
    if isinstance(mlp, SparseMoE):
        if mlp.shared_expert is not None or not mlp.packed_experts:
            raise UnsupportedModelError("a mixture of experts with a shared expert, or experts not repacked")
    elif not isinstance(mlp, MLP):
        raise UnsupportedModelError(f"a {type(mlp).__name__} feed-forward")
    norms = (layer.attn_norm, layer.ffn_norm, attention.q_norm, attention.k_norm)
    if not all(n is None or type(n) is RMSNorm for n in norms):
        raise UnsupportedModelError("a norm other than RMSNorm")
    if len({n.eps for n in norms if n is not None}) != 1:
        raise UnsupportedModelError("norms with different eps")
    qkv = _projections(attention.q_proj, attention.k_proj, attention.v_proj)
    o = _projections(attention.o_proj)
    routed = isinstance(mlp, SparseMoE)
    gate_up = [] if routed else _projections(mlp.gate, mlp.up)
    down = [] if routed else _projections(mlp.down)
    router = _projections(mlp.router) if routed else []
    plan = _LayerPlan(
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        eps=layer.attn_norm.eps,
        rope_style=attention.rope_style,
        qk_norm=attention.q_norm is not None,
        qkv=tuple(p for p, _ in qkv),
        o=tuple(p for p, _ in o),
        gate_up=tuple(p for p, _ in gate_up),
        down=tuple(p for p, _ in down),
        router=tuple(p for p, _ in router),
        top_k=mlp.top_k if routed else 0,
        norm_topk_prob=routed and mlp.norm_topk_prob,
    )
    tensors = _LayerTensors(
        attn_norm=layer.attn_norm.weight,
        q_norm=None if attention.q_norm is None else attention.q_norm.weight,
        k_norm=None if attention.k_norm is None else attention.k_norm.weight,
        qkv=tuple(t for _, t in qkv),
        o=tuple(t for _, t in o),
        ffn_norm=layer.ffn_norm.weight,
        gate_up=tuple(t for _, t in gate_up),
        down=tuple(t for _, t in down),
        router=tuple(t for _, t in router),
    )
    return plan, tensors


def _enter(
    plan: _LayerPlan, w: _LayerTensors, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> Tensors:
    """Attention.project on the layer's normed input x [tokens, hidden]: rotated q [1, heads, tokens, D],
    k and v [kv_heads, tokens, D] (the shape of their positions in the cache)."""
    q, k, v = _project(rms_norm(x, w.attn_norm, plan.eps), plan.qkv, w.qkv)
    tokens = x.shape[0]
    q = q.view(1, tokens, plan.num_heads, plan.head_dim)
    k = k.view(1, tokens, plan.num_kv_heads, plan.head_dim)
    v = v.view(1, tokens, plan.num_kv_heads, plan.head_dim)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = rms_norm(q, w.q_norm, plan.eps), rms_norm(k, w.k_norm, plan.eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = apply_rotary(q, cos, sin, plan.rope_style), apply_rotary(k, cos, sin, plan.rope_style)
    return q, k[0], v[0]


def _attention_residual(
    plan: _LayerPlan, w: _LayerTensors, x: torch.Tensor, attended: torch.Tensor
) -> torch.Tensor:
    """x plus o_proj of the heads' outputs [1, heads, tokens, D]: a layer's state after its attention."""
    (o,) = _project(attended.transpose(1, 2).reshape(x.shape[0], -1), plan.o, w.o)
    return x + o


def _leave(plan: _LayerPlan, w: _LayerTensors, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The rest of DecoderLayer after attention: o_proj of the heads' outputs [1, heads, tokens, D], the
    residual, the MLP and its residual -> x [tokens, hidden]."""
    x = _attention_residual(plan, w, x, attended)
    gate, up = _project(rms_norm(x, w.ffn_norm, plan.eps), plan.gate_up, w.gate_up)
    (down,) = _project(F.silu(gate) * up, plan.down, w.down)
    return x + down


def _route(plan: _LayerPlan, w: _LayerTensors, x: torch.Tensor, attended: torch.Tensor) -> Tensors:
    """A mixture-of-experts layer after attention, up to its experts (SparseMoE.forward's routing): x after
    the attention's residual, the experts' normed input, and each row's top-k weights and experts."""
    x = _attention_residual(plan, w, x, attended)
    h = rms_norm(x, w.ffn_norm, plan.eps)
    (scores,) = _project(h, plan.router, w.router)
    return (x, h, *top_k_routing(scores, plan.top_k, plan.norm_topk_prob))


def _logits(
    head: _Projection, x: torch.Tensor, norm: torch.Tensor, head_tensors: Tensors, eps: float
) -> torch.Tensor:
    """The final norm and the output head on the last layer's x: float32 logits [tokens, vocab]."""
    (logits,) = head(rms_norm(x, norm, eps), head_tensors)
    return logits.float()


# Layers whose projections differ in format (a Q4_K_M file's ffn_down is Q4_K in some layers and Q6_K
# in others) run different graphs, one per pair of neighbouring formats: a bound on the compiles.
MAX_BETWEEN_GRAPHS = 8


def _enter_graph(plan: _LayerPlan) -> StaticKernel:
    def enter(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *layer: torch.Tensor) -> Tensors:
        return _enter(plan, _unflatten(plan, layer), x, cos, sin)

    return StaticKernel(enter, fused=True)  # type: ignore[arg-type]


def _between_graph(plan: _LayerPlan, following: _LayerPlan, count: int) -> StaticKernel:
    """The graph from one layer's attention (`plan`, `count` tensors) to the next one's (`following`): its
    inputs are x, the attention's output, the layer's tensors, the rotary's cos and sin, then the next
    layer's tensors."""

    def between(x: torch.Tensor, attended: torch.Tensor, *tensors: torch.Tensor) -> Tensors:
        x = _leave(plan, _unflatten(plan, tensors[:count]), x, attended)
        cos, sin, following_layer = tensors[count], tensors[count + 1], tensors[count + 2 :]
        return (x, *_enter(following, _unflatten(following, following_layer), x, cos, sin))

    return StaticKernel(between, fused=True)  # type: ignore[arg-type]


def _route_graph(plan: _LayerPlan) -> StaticKernel:
    """The graph from a mixture-of-experts layer's attention to its routing (`_route`)."""

    def route(x: torch.Tensor, attended: torch.Tensor, *layer: torch.Tensor) -> Tensors:
        return _route(plan, _unflatten(plan, layer), x, attended)

    return StaticKernel(route, fused=True)  # type: ignore[arg-type]


def _resume_graph(following: _LayerPlan) -> StaticKernel:
    """The graph from a mixture of experts' output (added to x) to the next layer's attention."""

    def resume(
        x: torch.Tensor, experts: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *layer: torch.Tensor
    ) -> Tensors:
        x = x + experts
        return (x, *_enter(following, _unflatten(following, layer), x, cos, sin))

    return StaticKernel(resume, fused=True)  # type: ignore[arg-type]


def _resume_finish_graph(head: _Projection, eps: float) -> StaticKernel:
    """The graph from the last layer's mixture of experts to the logits."""

    def finish(
        x: torch.Tensor, experts: torch.Tensor, norm: torch.Tensor, *head_tensors: torch.Tensor
    ) -> torch.Tensor:
        return _logits(head, x + experts, norm, head_tensors, eps)

    return StaticKernel(finish, fused=True)


def _finish_graph(plan: _LayerPlan, count: int, head: _Projection, eps: float) -> StaticKernel:
    """The graph from the last layer's attention to the logits; its inputs end with the final norm's
    weight and the head's tensors."""

    def finish(x: torch.Tensor, attended: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        x = _leave(plan, _unflatten(plan, tensors[:count]), x, attended)
        return _logits(head, x, tensors[count], tensors[count + 1 :], eps)

    return StaticKernel(finish, fused=True)


def _boundary_graph(key: tuple, head: _Projection, eps: float) -> StaticKernel:
    """The graph a CompiledDecodeStep key names: ("leave", plan, following plan or None, the layer's tensor
    count) after a dense layer's attention; ("route", plan) after a mixture-of-experts layer's; ("resume",
    following plan or None) after its experts. None for the following plan: the head comes next."""
    kind, *rest = key
    if kind == "route":
        return _route_graph(rest[0])
    if kind == "resume":
        return _resume_finish_graph(head, eps) if rest[0] is None else _resume_graph(rest[0])
    plan, following, count = rest
    return (
        _finish_graph(plan, count, head, eps) if following is None else _between_graph(plan, following, count)
    )


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


class CompiledDecodeStep:
    """`step(token, cache)` -> float32 logits [vocab] of the next position, as `model(token.view(1, 1),
    cache)[0, -1]` computes them, for a single-sequence KVCache (the cache advances by one).
    `step(tokens, cache)` with tokens [T] (a few: a speculative round's verify pass) runs them at the
    cache's next T positions in one pass -> logits [T, vocab], each position attending to those before
    it: the weights are expanded once for all T rows (bubo/kernels/codes.py's block_dots), the graphs are
    compiled once per T. `step.batch(tokens, caches)` runs the next token of several sequences as the
    rows of one pass (continuous batching's decode steps, bubo/engine/batcher.py)."""

    def __init__(self, model: Decoder) -> None:
        if model.device.type != "cpu" or model.dtype != torch.float32:
            raise UnsupportedModelError(f"compute on {model.device} in {model.dtype}; compiled: CPU float32")
        if type(model.norm) is not RMSNorm:
            raise UnsupportedModelError("a final norm other than RMSNorm")
        self.model = model
        planned = [_plan_layer(layer) for layer in model.layers]
        self.layers = [tensors.flat() for _, tensors in planned]
        self.layer_slots = [layer.attention.layer_index for layer in model.layers]
        plans = [plan for plan, _ in planned]
        (head_plan, self.head_tensors) = _projections(model.output)[0]
        self._norm_weight = model.norm.weight
        # A mixture-of-experts layer's experts run between two graphs (its routing, then the rest up to
        # the next attention): which ones a token takes is known only once the router has run.
        self.experts = [layer.mlp if isinstance(layer.mlp, SparseMoE) else None for layer in model.layers]
        # The graphs are compiled on their first call (or `warm_up`), once per distinct set of shapes.
        self._enter = _enter_graph(plans[0])
        graphs: dict[tuple, StaticKernel] = {}

        def graph(key: tuple) -> StaticKernel:
            if key not in graphs:
                graphs[key] = _boundary_graph(key, head_plan, model.norm.eps)
            return graphs[key]

        # After layer i's attention: the graph to the next attention (or the logits), or to the routing;
        # after its experts (None for a dense layer): the graph to the next attention or the logits.
        self._after: list[StaticKernel] = []
        self._resume: list[StaticKernel | None] = []
        for i, plan in enumerate(plans):
            following = plans[i + 1] if i + 1 < len(plans) else None
            if self.experts[i] is None:
                self._after.append(graph(("leave", plan, following, len(self.layers[i]))))
                self._resume.append(None)
            else:
                self._after.append(graph(("route", plan)))
                self._resume.append(graph(("resume", following)))
        if len(graphs) > MAX_BETWEEN_GRAPHS:
            raise UnsupportedModelError(f"{len(graphs)} kinds of layer boundary, each a graph to compile")
        self._kernels: dict[tuple[int, int], Callable[..., Any]] = {}
        self._attention_kernels: dict[tuple[int, int], Callable[..., torch.Tensor]] = {}

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        start, count = cache.length, tokens.numel()
        positions = torch.arange(start, start + count) + cache.rope_delta
        logits = self._forward(
            tokens.view(count), positions, [(cache, count, cache.single_run(start + count))]
        )
        cache.advance(count)
        return logits if tokens.dim() else logits[0]

    def batch(self, tokens: torch.Tensor, caches: Sequence[KVCache]) -> torch.Tensor:
        """The next token of each of several sequences (tokens [B], one single-sequence KVCache each; every
        cache advances by one) -> logits [B, vocab]: the sequences are the rows of one pass, so every
        matvec expands the weights' codes once for all of them, and each row attends over its own cache."""
        positions = torch.tensor([cache.length + cache.rope_delta for cache in caches])
        sequences = [(cache, 1, cache.single_run(cache.length + 1)) for cache in caches]
        logits = self._forward(tokens.view(-1), positions, sequences)
        for cache in caches:
            cache.advance(1)
        return logits

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, sequences: list[tuple[KVCache, int, int | None]]
    ) -> torch.Tensor:
        """Logits [rows, vocab] of `tokens` [rows] at `positions`; `sequences` are the caches the rows belong
        to, in row order: (cache, its rows, the pool position of its blocks' one run or None)."""
        model, count = self.model, tokens.shape[0]
        cos, sin = model.rotary(positions, model.dtype)
        x = model.embedding(tokens)
        q, k, v = self._run(0, count, self._enter, x, cos, sin, *self.layers[0])
        last = len(self.layers) - 1
        for i, slot in enumerate(self.layer_slots):
            attended = self._attend(slot, q, k, v, sequences)
            # What the graph after this layer reads besides its own inputs: the next layer's rotary and
            # tensors, or the final norm and the head.
            following = (
                [cos, sin, *self.layers[i + 1]] if i < last else [self._norm_weight, *self.head_tensors]
            )
            experts = self.experts[i]
            if experts is None:
                out = self._run(i + 1, count, self._after[i], x, attended, *self.layers[i], *following)
            else:
                x, h, weights, chosen = self._run(i + 1, count, self._after[i], x, attended, *self.layers[i])
                routed = torch.cat(
                    [
                        experts.one_token(h[r : r + 1], weights[r : r + 1], chosen[r : r + 1])
                        for r in range(count)
                    ]
                )
                resume = self._resume[i]
                assert resume is not None
                out = self._run(-(i + 1), count, resume, x, routed, *following)
            if i < last:
                x, q, k, v = out
        return out

    def _attend(
        self,
        slot: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sequences: list[tuple[KVCache, int, int | None]],
    ) -> torch.Tensor:
        """Layer `slot`'s attention for a pass's rows: each sequence's new keys and values (k, v [kv_heads,
        rows, D]) written into its cache, and its queries (q [1, heads, rows, D]) attending over it."""
        if len(sequences) == 1:
            ((cache, _, run),) = sequences
            return self._attention(slot, q, *_store(cache, slot, run, k, v))
        outputs, row = [], 0
        for cache, rows, run in sequences:
            mine = slice(row, row + rows)
            keys, values = _store(cache, slot, run, k[:, mine], v[:, mine])
            # A copy in a lone sequence's layout: the attention kernel compiled for it serves every row.
            outputs.append(self._attention(slot, q[:, :, mine].contiguous(), keys, values))
            row += rows
        # Contiguous, as decode_attention's own result is: the graphs that take it are looked up by row
        # count alone (CompiledDecodeStep._run), so a verify pass and a batch of as many rows share them.
        return torch.cat(outputs, dim=2)

    def _attention(
        self, slot: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """decode_attention for layer `slot`, its compiled kernel looked up once per layer and query count:
        the layouts don't change between steps (only the length, which the kernel reads from its inputs)."""
        kernel = self._attention_kernels.get((slot, q.shape[2]))
        if kernel is None:
            kernel = self._attention_kernels[slot, q.shape[2]] = decode_attention_kernel(q, keys, values)
        return kernel(q, keys, values)

    def _run(self, call: int, count: int, graph: StaticKernel, *args: torch.Tensor) -> Any:
        """The step's `call`-th graph on `args` for `count` tokens: every step of that many passes the
        same layouts there, so the compiled kernel is looked up once (the lookup keys some 40 tensors'
        shapes and strides)."""
        kernel = self._kernels.get((call, count))
        if kernel is None:
            kernel = self._kernels[call, count] = graph.kernel_for(*args)
        return kernel(*args)

    def warm_up(self, tokens: int = 1) -> None:
        """Compile every graph for passes of `tokens` tokens now (seconds to a minute on a cold inductor
        cache) by running one on a scratch cache, rather than on the first decoded token or verify pass."""
        cache = self.model.new_cache(max_len=tokens + 1)
        with torch.inference_mode():
            self(torch.zeros(() if tokens == 1 else (tokens,), dtype=torch.long), cache)
