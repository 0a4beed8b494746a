"""Sparse mixture-of-experts feed-forward (Qwen3-MoE), its experts held as the GGUF file holds them.

The formula is transformers' Qwen3MoeSparseMoeBlock (Qwen3MoeTopKRouter, then Qwen3MoeExperts),
which llama.cpp's qwen3moe graph (build_moe_ffn: softmax gating, SiLU, normalised weights) matches:

    p      = softmax(x R^T)                      router R [num_experts, hidden], in float32
    (w, e) = the top-k of p;  w = w / sum(w)     the latter when norm_topk_prob
    y      = sum_j w_j * down_ej(silu(gate_ej(x)) * up_ej(x))

Each of gate/up/down is one 3-D tensor [num_experts, out, in] (llama.cpp's ffn_gate_exps,
ffn_up_exps, ffn_down_exps). A quantized one stays raw blocks [num_experts, out, row_bytes], and
each forward dequantizes only the experts some token was routed to: per decoded token that is
top-k of them (8 of 128 in Qwen3-30B-A3B), which is the point of a sparse model.

Qwen3-Next and Qwen3.5-MoE add a shared expert every token goes through, scaled by a learned scalar
gate (Qwen3_5MoeSparseMoeBlock / Qwen3NextSparseMoeBlock; llama.cpp's ffn_*_shexp tensors):

    y += sigmoid(g · x) * down_s(silu(gate_s(x)) * up_s(x))      g: ffn_gate_inp_shexp [1, hidden]

On CUDA, quantized experts (with triton installed and not turned off by --no-triton) go through the fused Triton
kernel of bubo/kernels/triton_moe.py instead of the per-expert loop below. On the CPU, a stack of a type
the compiled matvecs read is repacked at load as one matrix of experts x rows rows (bubo/kernels/), and
an expert's product runs on its slice of whole tiles: a decoded token's few rows as matvecs on the codes,
a prefill's many through unpacked chunks, as a dense QuantizedLinear's do; gate and up are merged into
one packed matrix (`merge_gate_up`), an expert's gate rows followed by its up rows. A decoded token's
experts are one compiled graph (`_gathered_experts_kernel`: its chosen experts' gate|up rows as one
matvec, SwiGLU, their down blocks as one matvec), which a compiled decode step traces into the layer's
own graph: no Python runs between the router and the sum. Dequantizing each routed expert whole for
every token made decode ~13x slower than llama.cpp's on Qwen3-30B-A3B's widths
(benchmarks/make_kquant_model.py --moe).
"""

import functools

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn
from torch._inductor.inductor_prims import force_stride_order

from bubo.gguf.quants import block_size, dequantize, type_size
from bubo.kernels.codes import TILE, concat_tiled, slice_tiled
from bubo.kernels.compiled import StaticKernel
from bubo.kernels.triton_support import TRITON_TYPES, triton_enabled
from bubo.model import quantized_linear
from bubo.model.quantized_linear import (
    Packed,
    gemm_operand,
    int8_layout,
    pack_for_cpu,
    packed_graph_expert_matvec,
    packed_graph_inputs,
    packed_graph_matvec,
    packed_graph_tensors,
    packed_product,
    same_layout,
    scratch_buffer,
    warm_up_packed,
)
from bubo.model.step_ops import in_compiled_step
from bubo.options import current_options

# A prompt of up to this many tokens runs its routed experts through the int8 kernels' (row, expert) pairs,
# one call a stack, rather than a loop over its experts (a GEMM on each one's unpacked weights): on a small
# hybrid MoE 2-3x faster at 16 to 128 tokens, and faster still at 512 (benchmarks/RESULTS.md,
# "INT8_EXPERT_ROWS"). The dense projections of such a prompt keep their float GEMMs: int8 activations
# there change the default model's greedy answer to a question (as they change llama.cpp's).
INT8_EXPERT_ROWS = 128

__all__ = [
    "ExpertMatrices",
    "Experts",
    "QuantizedExpertMatrices",
    "SparseMoE",
    "merge_gate_up",
    "pack_experts",
    "pack_experts_enabled",
    "packed_stack",
    "top_k_routing",
]


class ExpertMatrices(nn.Module):
    """Float expert weights [num_experts, out_features, in_features]; `linear(x, e)` is x W_e^T."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(x, self.weight[expert])

    def extra_repr(self) -> str:
        return "experts={}, out_features={}, in_features={}".format(*self.weight.shape)


class QuantizedExpertMatrices(nn.Module):
    """Expert weights kept as ggml blocks (uint8 [num_experts, out_features, row_bytes]); `linear(x, e)`
    multiplies by expert e alone: on its slice of the repacked stack (`pack_experts`) where there is one,
    else dequantized into the thread's scratch buffer (see quantized_linear)."""

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, in_features: int) -> None:
        super().__init__()
        self.register_buffer("raw", raw)
        self.ggml_type = ggml_type
        self.in_features = in_features
        self.packed = pack_experts(raw, ggml_type)

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the packed products' kernels now rather than on the first request (once per shape)."""
        if self.packed is not None:
            warm_up_packed(self._expert(0), dtype)

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        if self.packed is not None:
            return packed_product(x, self._expert(expert))
        rows = self.raw.shape[1]
        operand = gemm_operand(x)
        buffer = scratch_buffer(rows * self.in_features, operand.dtype, self.raw.device)
        weight = dequantize(
            self.raw[expert], self.ggml_type, operand.dtype, out=buffer.view(rows, self.in_features)
        )
        return F.linear(operand, weight).to(x.dtype)

    def _expert(self, expert: int) -> Packed:
        assert self.packed is not None
        rows = self.raw.shape[1]
        return slice_tiled(self.packed, expert * rows, (expert + 1) * rows)

    def extra_repr(self) -> str:
        experts, rows, _ = self.raw.shape
        return f"experts={experts}, out_features={rows}, in_features={self.in_features}, type={self.ggml_type.name}"


def pack_experts_enabled() -> bool:
    """Whether CPU expert stacks are repacked (`RuntimeOptions.pack_experts`, --no-pack-experts). The packed layouts take
    more memory than the file's blocks (Q4_K 4.75 bits a weight against 4.5, Q6_K 7.125 against 6.56: a
    Qwen3-30B-A3B Q4_K_M's experts grow from ~17 to ~18 GB); 0 keeps the file's bytes, mapped and
    dequantized per routed expert, which decodes several times slower."""
    return current_options().pack_experts


def pack_experts(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> Packed | None:
    """An expert stack uint8 [experts, rows, row_bytes] repacked for the CPU's compiled matvecs as one
    matrix of experts x rows rows, or None: where `pack_for_cpu` takes the type, each expert's rows fill
    whole tiles (so that an expert is a slice of the tiles), and an expert alone is a matrix large enough
    to pack (quantized_linear.MIN_PACKED_WEIGHTS: every shape compiles its own kernels), unless
    --no-pack-experts (`pack_experts_enabled`)."""
    experts, rows, row_bytes = raw.shape
    weights = rows * row_bytes // type_size(ggml_type) * block_size(ggml_type)
    if rows % TILE or weights < quantized_linear.MIN_PACKED_WEIGHTS or not pack_experts_enabled():
        return None
    return pack_for_cpu(raw.reshape(experts * rows, row_bytes), ggml_type)


# What a `WeightSource` hands out for one expert stack: float or quantized, the same `linear`.
Experts = ExpertMatrices | QuantizedExpertMatrices


class SparseMoE(nn.Module):
    """x [..., hidden] -> the routed experts' SwiGLU outputs, weighted by the router (formula above)."""

    def __init__(
        self,
        router: nn.Module,
        gate: Experts,
        up: Experts,
        down: Experts,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if (shared_expert is None) != (shared_expert_gate is None):
            raise ValueError("a shared expert needs its gate, and a gate its expert")
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.router = router
        self.gate = gate
        self.up = up
        self.down = down
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate_up = merge_gate_up(gate, up)

    @property
    def packed_experts(self) -> bool:
        """Whether the experts run on repacked stacks (gate and up merged, down), which a few rows' routed
        experts need to run as one compiled graph (`routed`)."""
        return self.gate_up is not None and packed_stack(self.down)

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the merged gate|up products' kernels now (down's are its own stack's: warm_up there)."""
        if self.gate_up is not None:
            warm_up_packed(self._gate_up_of(0), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = top_k_routing(self.router(x), self.top_k, self.norm_topk_prob)
        weights = weights.to(x.dtype)

        if self._fused(x):
            # Imported here: triton is optional, and present only where CUDA is.
            from bubo.kernels.triton_moe import fused_moe

            out = fused_moe(x, weights, chosen, self.gate, self.up, self.down)
        elif in_compiled_step() and not self._gathered(x):
            # Unpacked experts are read one by one as the router picks them, which a fixed graph can't say:
            # an opaque op of the compiled step runs this module's own expert loop (bubo/model/step_ops.py).
            out = torch.ops.bubo.routed_experts(x, weights, chosen)
        else:
            out = self.routed(x, weights, chosen)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the experts run in the fused Triton kernel (all three quantized, types it reads, CUDA)."""
        stacks = (self.gate, self.up, self.down)
        return all(
            isinstance(s, QuantizedExpertMatrices) and s.ggml_type in TRITON_TYPES for s in stacks
        ) and triton_enabled(x.device)

    def _gathered(self, x: torch.Tensor) -> bool:
        """Whether the rows x run as one graph that gathers their experts from the stacks (`routed`)."""
        return x.shape[0] <= quantized_linear.MATVEC_ROWS and x.dtype == torch.float32 and self.packed_experts

    def _int8_rows(self, x: torch.Tensor) -> bool:
        """Whether rows x run through the int8 kernels' expert products (`_int8_experts`): up to
        INT8_EXPERT_ROWS float32 rows, merged gate|up and packed down stacks of types they run."""
        return (
            x.shape[0] <= INT8_EXPERT_ROWS
            and x.dtype == torch.float32
            and self.packed_experts
            and self.gate_up is not None
            and int8_layout(self.gate_up)
            and isinstance(self.down, QuantizedExpertMatrices)
            and self.down.packed is not None
            and int8_layout(self.down.packed)
        )

    def routed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for rows x [rows, hidden] with the router's top-k `weights` and
        `chosen` experts [rows, top_k]."""
        gathered = self._gathered(x)
        if gathered or self._int8_rows(x):
            assert self.gate_up is not None and isinstance(self.down, QuantizedExpertMatrices)
            assert self.down.packed is not None
            gate_up_kind, gate_up = packed_graph_inputs(self.gate_up)
            down_kind, down = packed_graph_inputs(self.down.packed)
            experts = self.down.raw.shape[0]
            if gathered:
                # A decode step's token, or a few (batched slots, a verify pass): one compiled graph reads
                # each row's chosen experts straight out of the stacks, where the grouped loop below pays a
                # dozen eager ops per expert. Inside a compiled step it traces into the layer's own graph.
                kernel = _gathered_experts_kernel(gate_up_kind, down_kind, experts)
                return kernel(x, weights, chosen, *gate_up, *down)
            # A short prompt's rows: the int8 kernels take every (row, expert) pair in one call, each
            # expert read once for the rows that picked it; nothing to compile for the count of rows.
            _, out = _int8_experts(x, weights, chosen, gate_up_kind, gate_up, down_kind, down, experts)
            assert out is not None  # both stacks' types run int8 (`_int8_rows`)
            return out
        out = torch.zeros_like(x)
        # Tokens grouped by expert, so each active expert's weights are used (and, quantized,
        # dequantized) once for all its tokens. unique() is sorted: experts are summed in the
        # order transformers sums them.
        for expert in chosen.unique().tolist():
            tokens, slot = torch.where(chosen == expert)
            h = x[tokens]
            y = self.down.linear(self._swiglu(h, expert), expert)
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out

    def _swiglu(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        """silu(gate_e(h)) * up_e(h) for the rows h routed to `expert`."""
        if self.gate_up is None:
            return F.silu(self.gate.linear(h, expert)) * self.up.linear(h, expert)
        gate, up = packed_product(h, self._gate_up_of(expert)).chunk(2, dim=-1)
        return F.silu(gate) * up

    def _gate_up_of(self, expert: int) -> Packed:
        assert self.gate_up is not None
        rows = 2 * self.gate.raw.shape[1]  # type: ignore[union-attr]
        return slice_tiled(self.gate_up, expert * rows, (expert + 1) * rows)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


def top_k_routing(
    scores: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router scores [tokens, num_experts] -> each token's top-k weights (float32) and experts [tokens,
    top_k]: the formula's softmax, top-k and renormalisation (the compiled decode step routes with it too)."""
    # float32 softmax whatever the compute dtype, as Qwen3MoeTopKRouter: in half precision
    # close router scores would round together and change which experts are picked.
    weights, chosen = F.softmax(scores.float(), dim=-1).topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def packed_stack(experts: Experts) -> bool:
    """Whether `experts` were repacked for the CPU's compiled matvecs (`pack_experts`)."""
    return isinstance(experts, QuantizedExpertMatrices) and experts.packed is not None


def merge_gate_up(gate: Experts, up: Experts) -> Packed | None:
    """The gate and up stacks, both repacked in one layout, as one packed matrix in which expert e's gate
    rows are followed by its up rows, so that an expert's gate and up run as one matvec (one stream of
    weights instead of two, faster when the experts' weights are cold); else None. The stacks' own packed copies are dropped: the merged one serves both."""
    if not (packed_stack(gate) and packed_stack(up)):
        return None
    assert isinstance(gate, QuantizedExpertMatrices) and isinstance(up, QuantizedExpertMatrices)
    assert gate.packed is not None and up.packed is not None
    if not same_layout(gate.packed, up.packed) or gate.raw.shape[:2] != up.raw.shape[:2]:
        return None
    parts: list[Packed] = []
    for expert in range(gate.raw.shape[0]):
        parts += [gate._expert(expert), up._expert(expert)]
    merged = concat_tiled(parts)
    gate.packed = up.packed = None
    return merged


def _int8_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    gate_up_kind: str,
    gate_up: tuple[torch.Tensor, ...],
    down_kind: str,
    down: tuple[torch.Tensor, ...],
    experts: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The routed experts' weighted sum for rows x [rows, hidden] through the int8 kernels, which read every
    row's picked experts out of the stacks of `experts` experts by id, one call for all the rows (gate|up,
    then down): (the weighted SwiGLU outputs [rows x top_k, ffn], the sum [rows, hidden]). Where the kernels
    don't run the gate|up stack's type: (None, None); the down stack's: (the SwiGLU outputs, None)."""
    rows, top_k = chosen.shape
    gate_up_rows, hidden = gate_up[0].shape[0] // experts * TILE, down[0].shape[0] // experts * TILE
    ids = chosen.flatten()
    h = packed_graph_expert_matvec(gate_up_kind, x, gate_up, ids, gate_up_rows)
    if h is None:
        return None, None
    h = h.view(rows * top_k, 2, -1)
    h = F.silu(h[:, 0]) * h[:, 1] * weights.reshape(-1, 1)
    # Stored once: left as an expression, inductor would recompute SiLU in the down matvec's loop.
    h = force_stride_order(h, h.stride())
    out = packed_graph_expert_matvec(down_kind, h, down, ids, hidden)
    return h, None if out is None else out.view(rows, top_k, hidden).sum(1)


@functools.cache
def _gathered_experts_kernel(gate_up_kind: str, down_kind: str, experts: int) -> StaticKernel:
    """sum_j weight_j * down_ej(silu(gate_ej(x)) * up_ej(x)) over each row's chosen experts e_j, for a few
    rows x [rows, hidden], compiled as one graph on the whole stacks (their packed tensors, of the kinds
    given, after the three arguments).

    A row's experts are gathered by index inside the graph, which inductor folds into the matvecs' loads:
    nothing is copied. Their merged gate|up rows form one matrix of top_k x (gate + up) rows for one matvec.
    The down products add up as one matvec too: the tiles hold output rows and the blocks run along the
    input, so the chosen experts' blocks laid side by side are the matrix [hidden, top_k x ffn] whose
    product with the weighted SwiGLU outputs, concatenated, is the weighted sum. Where the int8 kernels run
    a stack's type (bubo/kernels/int8_matvec.py), they take the whole stack and every row's picked ids
    instead, one call for all the rows, and read those experts' tiles in place; the down products are then
    summed over each row's experts."""
    gate_up_tensors = packed_graph_tensors(gate_up_kind)

    def gathered_experts(
        x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, *tensors: torch.Tensor
    ) -> torch.Tensor:
        gate_up, down = tensors[:gate_up_tensors], tensors[gate_up_tensors:]
        hidden, top_k = down[0].shape[0] // experts * TILE, chosen.shape[1]
        h, out = _int8_experts(x, weights, chosen, gate_up_kind, gate_up, down_kind, down, experts)
        if out is not None:
            return out
        sums = []
        for r, (row, picked) in enumerate(zip(x.unbind(0), chosen.unbind(0), strict=True)):
            # The float matvecs read the picked experts through the gathered views below, which inductor
            # folds into their loads.
            if h is None:
                # [experts x tiles, ...] -> the picked experts' tiles, one after the other.
                gathered = tuple(t.view(experts, -1, *t.shape[1:])[picked].flatten(0, 1) for t in gate_up)
                hr = packed_graph_matvec(gate_up_kind, row, gathered, gathered[0].shape[0] * TILE)
                hr = hr.view(top_k, 2, -1)
                hr = F.silu(hr[:, 0]) * hr[:, 1] * weights[r, :, None]
                # Stored once: left as an expression, inductor would recompute SiLU in the down matvec's loop.
                hr = force_stride_order(hr, hr.stride())
            else:
                hr = h[r * top_k : (r + 1) * top_k]
            out = packed_graph_expert_matvec(down_kind, hr, down, picked, hidden)
            if out is not None:
                sums.append(out.sum(0))
                continue
            # [experts x tiles, blocks, ...] -> [tiles, picked experts' blocks, ...]
            blocks = tuple(
                t.view(experts, -1, *t.shape[1:])[picked].transpose(0, 1).contiguous().flatten(1, 2)
                for t in down
            )
            sums.append(packed_graph_matvec(down_kind, hr.reshape(-1), blocks, blocks[0].shape[0] * TILE))
        return torch.stack(sums)

    return StaticKernel(gathered_experts, fused=True)  # type: ignore[arg-type]
