"""Weights that stay in their ggml block format and are dequantized where they are used.

`raw` is the tensor's bytes as uint8 [rows, row_bytes] — on the CPU a view of the file's memory
map, so loading copies nothing. Every row holds whole blocks, so rows can be indexed before
dequantizing: the embedding lookup dequantizes only the looked-up rows.

On the CPU, Q4_0 / Q4_1 / Q8_0 matrices are also repacked at load (same bytes, see bubo/kernels/), Q5_0 /
Q5_1 / IQ4_NL into those layouts (bubo/kernels/repack.py), and the K-quants (Q2_K to Q6_K) and IQ4_XS into
words that keep their super-blocks (bubo/kernels/super_block_matvec.py), while the memory available
allows (`pack_for_cpu`): a single row (decode) goes through a compiled matvec that reads the codes
directly; several rows (prefill) multiply column chunks unpacked from the repacked words, in bfloat16
where the CPU multiplies bfloat16 natively (`bf16_prefill`), else in float32.

On CUDA (with triton installed and not turned off by --no-triton) the product runs in the Triton kernels of
bubo/kernels/triton_gemm.py, which read the blocks as stored: no float weight is ever materialized.
"""

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn
from torch._inductor.inductor_prims import force_stride_order

from bubo.gguf.quants import block_size, dequantize, type_size
from bubo.kernels.codes import TILE, concat_tiled, slice_tiled, word_bits
from bubo.kernels.compiled import StaticKernel
from bubo.kernels.int8_matvec import (
    PackedQ6KInt8,
    int8_matvec_enabled,
    int8_rows,
    q4_int8_matvec,
    q4_k_int8_matvec,
    q6_k_int8_matvec,
    q8_int8_matvec,
)
from bubo.kernels.q4_matvec import PACKABLE_Q4, PackedQ4, pack_q4, q4_matvec_bits
from bubo.kernels.q8_matvec import PackedQ8Offset, pack_q8, q8_matvec_bits, q8_offset_matvec_bits
from bubo.kernels.repack import REPACKABLE, Packed, repack
from bubo.kernels.super_block_matvec import PackedSuperBlocks, super_block_matvec_bits
from bubo.kernels.triton_support import TRITON_TYPES, triton_enabled
from bubo.model.step_ops import in_compiled_step
from bubo.options import current_options
from bubo.process_memory import meminfo

__all__ = [
    "QuantizedEmbedding",
    "QuantizedLinear",
    "RowGroup",
    "bf16_prefill",
    "gemm_operand",
    "group_rows",
    "has_packed_weights",
    "int8_layout",
    "native_bf16",
    "pack_for_cpu",
    "packed_graph_expert_matvec",
    "packed_graph_inputs",
    "packed_graph_matvec",
    "packed_graph_tensors",
    "packed_product",
    "packing_deferred",
    "project_rows",
    "same_layout",
    "scratch_buffer",
    "warm_up_packed",
]

# Dequantizing a whole weight per call allocates a fresh float matrix every time, and on the CPU
# faulting those pages in costs more than the arithmetic. So forward works through row chunks of
# at most this many values, dequantized into one reused per-thread buffer that stays cache-warm (a
# packed weight's compiled unpacking allocates its chunk, a block of that size the heap hands back).
CHUNK_VALUES = 1 << 20
_scratch = threading.local()
# Below this many weights a matrix keeps the dequantize-per-call path: it is cheap there, and each
# new shape of compiled matvec costs seconds of compiling (tiny test models have many shapes).
MIN_PACKED_WEIGHTS = 1 << 16
# Up to this many rows a product runs as that many matvecs; more (a prefill) unpack float columns for a
# GEMM, which pays for the unpacking once the rows share it. On the default model the two cross at 10-12
# rows of an eager forward (benchmarks/RESULTS.md, "MATVEC_ROWS").
MATVEC_ROWS = 12


Q = GGMLQuantizationType
# Bits a weight of each packable type's layout, against the file's 2.6-8.5: Q4_0 / Q4_1 codes with their
# file's fp16 fields (bubo/kernels/q4_matvec.py), Q8_0 with a float32 scale word (q8_matvec.py), and the
# repacked types' (repack.py, super_block_matvec.py).
PACKED_BITS: dict[GGMLQuantizationType, float] = {Q.Q4_0: 5, Q.Q4_1: 5, Q.Q8_0: 9} | {
    t: bits for t, (_, _, bits) in REPACKABLE.items()
}
# Packing leaves at least this much memory available, or an eighth of the machine's where that is less
# (a 2 GB machine still packs the default model's 100 MB).
PACKING_RESERVE = 1 << 30
_said_short_of_memory = False
_packing_deferred = 0  # how many `packing_deferred` blocks are open
log = logging.getLogger(__name__)


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX512-BF16 or AMX), which oneDNN's bf16 GEMM uses."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch's own probes (private)
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def bf16_prefill() -> bool:
    """Whether the GEMMs of a float32 prefill (more than MATVEC_ROWS rows) multiply in bfloat16, with the
    activations and the unpacked weights rounded to it and float32 accumulation: --prefill-bf16 on / off,
    or by default ("auto") where the CPU has bfloat16 dot products (AVX512-BF16 or AMX), on which that GEMM runs
    several times faster than float32's. transformers' bf16
    path rounds the same operands, and more (its norms, attention and residual stream stay bf16 too);
    llama.cpp rounds the activations of Q4_1 products to 8 bits. Decode (compiled matvecs on the codes)
    stays float32 throughout."""
    setting = current_options().prefill_bf16
    return setting == "on" or (setting == "auto" and native_bf16())


@contextmanager
def packing_deferred() -> Iterator[None]:
    """Quantized matrices made inside the block keep the file's blocks, unpacked: a model loaded whole only
    to be split by tensor parallelism (bubo/model/tensor_parallel.py) packs its rank's slices, made after,
    rather than all of the whole's first. For the load only (the count is the process's, not a thread's)."""
    global _packing_deferred
    _packing_deferred += 1
    try:
        yield
    finally:
        _packing_deferred -= 1


def pack_for_cpu(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> Packed | None:
    """The repacked form of a CPU weight the compiled matvec handles, else None (its blocks then stay as
    the file's, dequantized per use): a type without a packed layout, a small matrix, too little memory
    left (`_memory_for_packing`), or inside `packing_deferred`."""
    if _packing_deferred:
        return None
    weights = raw.shape[0] * (raw.shape[1] // type_size(ggml_type)) * block_size(ggml_type)
    if raw.device.type != "cpu" or weights < MIN_PACKED_WEIGHTS or ggml_type not in PACKED_BITS:
        return None
    if not _memory_for_packing(int(weights * PACKED_BITS[ggml_type] / 8)):
        return None
    if ggml_type in PACKABLE_Q4:
        return pack_q4(raw, ggml_type)
    return pack_q8(raw) if ggml_type == Q.Q8_0 else repack(raw, ggml_type)


def _memory_for_packing(packed_bytes: int) -> bool:
    """Whether packing a matrix into `packed_bytes` leaves PACKING_RESERVE (at most an eighth of MemTotal)
    of MemAvailable, which counts the file's mapped pages as reclaimable: the loader drops a matrix's
    pages once it is packed. A model whose packed matrices won't all fit keeps the rest as the file's
    blocks, so it loads and runs (those matrices several times slower) rather than being killed for memory
    partway through the load; said once."""
    global _said_short_of_memory
    info = meminfo()
    available = info.get("MemAvailable")
    reserve = min(PACKING_RESERVE, info.get("MemTotal", 8 * PACKING_RESERVE) // 8)
    if available is None or available - packed_bytes >= reserve:
        return True
    if not _said_short_of_memory:
        _said_short_of_memory = True
        log.warning(
            "%d MB of memory available: quantized matrices from here on stay as the file's blocks, "
            "dequantized per use (decode several times slower than repacked)",
            available >> 20,
        )
    return False


def has_packed_weights(model: nn.Module) -> bool:
    """Whether any of `model`'s quantized matrices (a QuantizedLinear, or an expert stack: bubo/model/moe.py)
    were repacked for the CPU's compiled matvecs."""
    return any(getattr(m, "packed", None) is not None for m in model.modules())


def scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The calling thread's reusable buffer of at least `numel` values (valid until its next use)."""
    # Keyed by inference mode too: a buffer made under torch.inference_mode() can't be written outside it.
    key = (dtype, device, torch.is_inference_mode_enabled())
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(max(numel, CHUNK_VALUES), dtype=dtype, device=device)
    return buffer[:numel]


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] stored quantized and dequantized per call."""

    def __init__(
        self,
        raw: torch.Tensor,
        ggml_type: GGMLQuantizationType,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("raw", raw)
        self.ggml_type = ggml_type
        self.in_features = in_features
        self.out_features = raw.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed = pack_for_cpu(raw, ggml_type)
        self.group: RowGroup | None = None  # set by group_rows
        # A matrix too small to repack (a DeltaNet layer's alpha and beta rows), dequantized once at load
        # (at most MIN_PACKED_WEIGHTS values, 256 KB): in a compiled decode step, dequantized inside the
        # graph it cost a dozen small kernels and host ops a layer, where dense its product is one
        # reduction fused with its neighbours; eagerly, it spares dequantizing it again every call.
        small = raw.device.type == "cpu" and self.out_features * in_features < MIN_PACKED_WEIGHTS
        self.dense = dequantize(raw, ggml_type, torch.float32) if small and self.packed is None else None

    def warm_up(self, dtype: torch.dtype, alone: bool = False) -> None:
        """Compile this shape's kernels now (seconds, once per shape) rather than on the first request: the
        matvec of a decode step and the unpacking for a prefill's GEMMs on `dtype` activations. A grouped
        layer's products run as its group's (warmed by its first member), unless it also runs `alone` (k
        and v in a prefill whose last position alone needs a query)."""
        if self.packed is None:
            return
        if self.group is None or alone:
            warm_up_packed(self.packed, dtype)
        elif self.group.members[0] == id(self):
            warm_up_packed(self.group.packed, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ggml_type in TRITON_TYPES and triton_enabled(self.raw.device):
            # Imported here: triton is optional, and present only where CUDA is.
            from bubo.kernels.triton_gemm import quantized_matmul

            return quantized_matmul(x, self.raw, self.ggml_type, self.bias)
        if self.packed is not None:
            return self._packed_forward(x)
        operand = gemm_operand(x)
        if self.dense is not None or in_compiled_step():
            # Dequantized at load; else in a traced graph, dequantized whole (no scratch buffer).
            weight = (
                self.dense if self.dense is not None else dequantize(self.raw, self.ggml_type, operand.dtype)
            )
            out = F.linear(operand, weight.to(operand.dtype)).to(x.dtype)
            return out if self.bias is None else out + self.bias
        rows = max(1, CHUNK_VALUES // self.in_features)
        if rows >= self.out_features:
            out = F.linear(operand, self._dequantize_rows(0, self.out_features, operand.dtype)).to(x.dtype)
        else:
            out = x.new_empty(*x.shape[:-1], self.out_features)
            for start in range(0, self.out_features, rows):
                stop = min(start + rows, self.out_features)
                out[..., start:stop] = F.linear(operand, self._dequantize_rows(start, stop, operand.dtype))
        return out if self.bias is None else out + self.bias

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = packed_product(x.reshape(-1, self.in_features), self.packed)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _dequantize_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start:stop of the weight, in the thread's scratch buffer (valid until the next call)."""
        buffer = scratch_buffer((stop - start) * self.in_features, dtype, self.raw.device)
        return dequantize(
            self.raw[start:stop], self.ggml_type, dtype, out=buffer.view(stop - start, self.in_features)
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"type={self.ggml_type.name}, bias={self.bias is not None}"
        )


def packed_product(flat: torch.Tensor, packed: Packed) -> torch.Tensor:
    """flat [rows, in_features] times the packed weight, transposed -> [rows, out_features] in flat's dtype.

    Up to MATVEC_ROWS float32 rows (a decode step, the steps of a few slots batched, a short prompt) run
    a compiled matvec per row (one int8 call for all of them where the layout has one), which costs far
    less than unpacking the weight for a GEMM; more rows (a prefill) multiply column chunks unpacked in the
    GEMM operand's dtype, so the unpacking is paid once for all the rows, and a chunk stays in the cache
    between its unpacking and its product."""
    if flat.shape[0] <= MATVEC_ROWS and flat.dtype == torch.float32:
        if in_compiled_step():
            # Traced into a layer's graph: one matvec expands the codes once for all rows, and its input
            # is stored once (as an expression inductor would recompute it, a norm say, in every tile).
            flat = flat.contiguous()  # a view (gate's columns of a gate|up product) is copied once
            return packed.matvec(force_stride_order(flat, flat.stride()))
        if flat.shape[0] == 1:
            return packed.matvec(flat.view(-1))[None]
        if int8_layout(packed):
            return packed.matvec(flat)  # one C++ call for any count of rows: nothing to compile
        # A compiled matvec is one kernel per count of rows: the rows one by one share the one-row kernel.
        return torch.stack([packed.matvec(row) for row in flat])
    operand = gemm_operand(flat)
    # Whole tiles of the packed layout per chunk: an unaligned chunk would unpack its edge tiles twice.
    columns = max(TILE, CHUNK_VALUES // packed.in_features // TILE * TILE)
    if columns >= packed.out_features:  # the whole weight in one chunk: no output copy
        return (operand @ packed.unpack(0, packed.out_features, operand.dtype)).to(flat.dtype)
    out = flat.new_empty(flat.shape[0], packed.out_features)
    for start in range(0, packed.out_features, columns):
        stop = min(start + columns, packed.out_features)
        out[:, start:stop] = operand @ packed.unpack(start, stop, operand.dtype)
    return out


def int8_layout(packed: Packed) -> bool:
    """Whether `packed`'s matvec runs one of the int8 kernels (bubo/kernels/int8_matvec.py)."""
    return _int8_matvec(_graph_kind(packed)) is not None


# The int8 kernel of each kind of packed matrix (`packed_graph_inputs`) that has one.
_INT8_MATVECS: dict[str, Callable[..., torch.Tensor]] = {
    "Q6_K_int8": q6_k_int8_matvec,
    "Q4_K": q4_k_int8_matvec,
    "q4": q4_int8_matvec,
    "q8": q8_int8_matvec,
}


def _int8_matvec(kind: str) -> Callable[..., torch.Tensor] | None:
    """The int8 kernel a packed matrix of `kind` runs, or None: Q6_K_int8 is packed for it alone; the other
    kinds run theirs where the int8 matvecs are on."""
    if kind != "Q6_K_int8" and not int8_matvec_enabled():
        return None
    return _INT8_MATVECS.get(kind)


def packed_graph_inputs(packed: Packed) -> tuple[str, tuple[torch.Tensor, ...]]:
    """How a compiled graph takes `packed` as inputs: its kind ("q4", "q8", "q8_offset", "Q6_K_int8", or a
    super-block type's name, "Q4_K") and its tensors, the words (then the per-block fields where they lie
    apart) as the kind's matvec reads them (`packed_graph_tensors` of them)."""
    kind = _graph_kind(packed)
    if kind == "Q6_K_int8":
        return kind, (packed.words, packed.factors)
    # The int8 kernels read int32 words as they are; the float ones as float32 bits (codes.word_bits), a
    # view that a graph would otherwise run as an op before every int8 call.
    bits = word_bits if _int8_matvec(kind) is None else _as_stored
    if kind in ("q4", "q8_offset"):
        return kind, (bits(packed.words), packed.scale_offset)
    if kind == "q8":
        return kind, (bits(packed.words),)
    return kind, (bits(packed.words), bits(packed.fields), packed.factors)


def _graph_kind(packed: Packed) -> str:
    """`packed_graph_inputs`'s kind of `packed`."""
    if isinstance(packed, PackedQ6KInt8):
        return "Q6_K_int8"
    if isinstance(packed, PackedQ4):
        return "q4"
    if isinstance(packed, PackedQ8Offset):
        return "q8_offset"
    if isinstance(packed, PackedSuperBlocks):
        return packed.ggml_type.name
    return "q8"


def _as_stored(words: torch.Tensor) -> torch.Tensor:
    return words


def packed_graph_tensors(kind: str) -> int:
    """How many tensors `packed_graph_inputs` gives for a packed matrix of `kind`."""
    return 1 if kind == "q8" else 2 if kind in ("q4", "q8_offset", "Q6_K_int8") else 3


def packed_graph_matvec(
    kind: str, x: torch.Tensor, tensors: tuple[torch.Tensor, ...], out_features: int
) -> torch.Tensor:
    """x [in] or [rows, in] times the packed weight that `packed_graph_inputs` gave as (kind, tensors):
    inside a compiled graph's function, the matvec traces into the graph."""
    if kind == "q4":
        return q4_matvec_bits(x, *tensors, out_features)
    if kind == "q8_offset":
        return q8_offset_matvec_bits(x, *tensors, out_features)
    if kind == "q8":
        return q8_matvec_bits(x, *tensors, out_features)
    if kind == "Q6_K_int8":
        return int8_rows(q6_k_int8_matvec, x, *tensors, out_features=out_features)
    return super_block_matvec_bits(x, *tensors, out_features, Q[kind])


def packed_graph_expert_matvec(
    kind: str, x: torch.Tensor, tensors: tuple[torch.Tensor, ...], experts: torch.Tensor, expert_rows: int
) -> torch.Tensor | None:
    """Rows x [rows, in] times experts `experts` [n] (n a multiple of rows: row i // (n // rows) for
    expert i) of a stack of experts of `expert_rows` rows each, packed as `packed_graph_inputs` gave (kind,
    tensors) -> [n, expert_rows], where an int8 kernel reads the stack by expert id
    (bubo/kernels/int8_matvec.py); else None."""
    matvec = _int8_matvec(kind)
    return None if matvec is None else matvec(x, *tensors, experts, expert_rows)


def warm_up_packed(packed: Packed, dtype: torch.dtype) -> None:
    """Run `packed`'s matvec and its prefill product on `dtype` rows once, compiling their kernels."""
    packed.matvec(torch.zeros(packed.in_features))
    packed_product(torch.zeros(MATVEC_ROWS + 1, packed.in_features, dtype=dtype), packed)


def gemm_operand(x: torch.Tensor) -> torch.Tensor:
    """x [..., in_features] as a product on a dequantized weight takes it: rounded to bfloat16 when it is
    a float32 prefill's on the CPU (more than MATVEC_ROWS rows) and `bf16_prefill` says so; else x itself."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.numel() <= MATVEC_ROWS * x.shape[-1]
        or not bf16_prefill()
    ):
        return x
    return x.to(torch.bfloat16)


@dataclass(frozen=True)
class RowGroup:
    """Projections of one input whose packed rows are stored as one matrix (`group_rows`): a decode step
    runs them as one matvec, which costs less than several smaller ones (one kernel call, longer loops)."""

    packed: Packed
    members: tuple[int, ...]  # id() of each member QuantizedLinear, in row order
    sizes: tuple[int, ...]


def same_layout(*parts: Packed) -> bool:
    """Whether packed matrices can be concatenated row-wise (`concat_tiled`): one layout, blocks of as
    many words, and for super-blocks one ggml type (Q5_K's and IQ4_XS's code words are alike, their
    fields not)."""
    return len({(type(p), p.words.shape[2:], getattr(p, "ggml_type", None)) for p in parts}) == 1


def group_rows(*linears: nn.Module) -> None:
    """Store the packed rows of `linears` (projections that always read the same input, such as q/k/v)
    as one matrix, each keeping a view of its own rows; `project_rows` then runs them as one matvec. Does
    nothing unless all are packed the same way with rows filling whole tiles."""
    members = [m for m in linears if isinstance(m, QuantizedLinear) and m.packed is not None]
    if len(members) < 2 or len(members) != len(linears):
        return
    parts = [m.packed for m in members]
    if not same_layout(*parts) or len({m.in_features for m in members}) != 1:
        return
    if any(p.out_features % TILE for p in parts):
        return
    fused = concat_tiled(parts)
    group = RowGroup(fused, tuple(id(m) for m in members), tuple(p.out_features for p in parts))
    start = 0
    for member, size in zip(members, group.sizes, strict=True):
        member.packed = slice_tiled(fused, start, start + size)
        member.group = group
        start += size


def project_rows(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """(linear(x) for each of `linears`), as one product (`packed_product`: one matvec per row, or one
    unpacked GEMM per chunk) when they form a `group_rows` group."""
    group = getattr(linears[0], "group", None)
    if group is None or group.members != tuple(id(m) for m in linears):
        return tuple(m(x) for m in linears)
    out = packed_product(x.reshape(-1, x.shape[-1]), group.packed)
    results = []
    for member, part in zip(linears, out.split(group.sizes, dim=-1), strict=True):
        part = part.view(*x.shape[:-1], part.shape[-1])
        results.append(part if member.bias is None else part + member.bias)
    return tuple(results)


class QuantizedEmbedding(nn.Module):
    """Row lookup in a quantized [num_embeddings, embedding_dim] matrix, dequantizing only those rows."""

    def __init__(
        self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, embedding_dim: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.register_buffer("raw", raw)
        self.ggml_type = ggml_type
        self.num_embeddings = raw.shape[0]
        self.embedding_dim = embedding_dim
        self.dtype = dtype  # the compute dtype; there is no float input to take it from

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if (
            self.raw.device.type == "cpu"
            and tokens.numel() <= MATVEC_ROWS
            and self.ggml_type not in _CODEBOOK_TYPES
        ):
            # A decode step's few rows: one compiled kernel, where the dequantizer's eager ops are a few
            # dozen dispatches (about a twentieth of a small hybrid model's decode step).
            return _embedding_rows_kernel(self.ggml_type, self.dtype)(self.raw, tokens)
        return dequantize(self.raw[tokens], self.ggml_type, dtype=self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.ggml_type.name}"


# Their dequantizer looks codes up in a constant table, which a kernel's trace on fake tensors can't read.
_CODEBOOK_TYPES = frozenset({GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS})


@functools.cache
def _embedding_rows_kernel(ggml_type: GGMLQuantizationType, dtype: torch.dtype) -> StaticKernel:
    """The rows `tokens` of a quantized table, dequantized: (raw, tokens) -> [*tokens.shape, dim]. Compiled
    without FMA contraction, as the dequantizer computes them bit for bit."""

    def embedding_rows(raw: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return dequantize(raw[tokens], ggml_type, dtype=dtype)

    return StaticKernel(embedding_rows)
