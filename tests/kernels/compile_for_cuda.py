"""Compile every Triton kernel for an sm_90 GPU (H100 / H200) ahead of time, without a GPU.

The interpreter runs a kernel as Python, so it accepts code the compiler rejects (a constexpr that
isn't one, an operator triton lacks); this builds the real PTX and cubin for each kernel, for
every ggml type the dequantization reads, and for paged attention and the gated delta rule with the
constexprs, dtypes and warps their launchers pick for the flagship's heads (256-wide attention, 2 KV
heads for 24 query heads; 128-wide DeltaNet heads) and for other head sizes, in bfloat16 and float32.
Each line gives the registers per thread and the bytes of local stack, which in these kernels (no
local arrays) is what ptxas spilled registers to. Run in a process without TRITON_INTERPRET (kernels
decorated under the interpreter can't be compiled): `TRITON_INTERPRET=0 python -m tests.kernels.compile_for_cuda`.
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bubo.kernels import (
    triton_gated_delta,
    triton_gemm,
    triton_gemv,
    triton_moe,
    triton_paged_attention,
)
from bubo.kernels.triton_quant import interpreting
from bubo.kernels.triton_support import TRITON_TYPES
from bubo.model.block_pool import DEFAULT_BLOCK_SIZE

SM_90 = GPUTarget("cuda", 90, 32)
# Pointer arguments by name: the weights' bytes, their fp16 view, the codebook, routing tables,
# and activations in the compute dtype.
POINTERS = {
    "w_ptr": "*u8", "gate_ptr": "*u8", "up_ptr": "*u8", "down_ptr": "*u8",
    "h_ptr": "*fp16", "gate_h_ptr": "*fp16", "up_h_ptr": "*fp16", "down_h_ptr": "*fp16",
    "words_ptr": "*i32", "lut_ptr": "*fp32", "pairs_ptr": "*i32", "tile_expert_ptr": "*i32", "experts_ptr": "*i64",
}  # fmt: skip
DTYPES = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


# Paged attention: queries and the softmax partials in float32, block tables and positions int32; the
# pools in the cache dtype (the `dtype` of each compile), the combined output in the query's.
ATTENTION = {
    "q_ptr": "*fp32", "tables_ptr": "*i32", "lengths_ptr": "*i32", "positions_ptr": "*i32",
    "max_ptr": "*fp32", "sum_ptr": "*fp32", "acc_ptr": "*fp32", "scale_log2": "fp32",
}  # fmt: skip
# The gated delta rule: the state, the output and the chunk scratch (u, w, gamma) in float32; the
# inputs in `dtype` (the activations for the fused decode step, float32 for the others).
DELTA = {
    "state_ptr": "*fp32", "out_ptr": "*fp32", "u_ptr": "*fp32", "w_ptr": "*fp32", "gamma_ptr": "*fp32",
    "scale": "fp32", "eps": "fp32",
}  # fmt: skip
# Global loads in the PTX: single bytes, and 2-, 4-, 8- and 16-byte ones (a weight's bytes should come
# in wide loads).
LOADS = re.compile(r"ld\.global(?:\.[a-z]+)*?\.(v2\.|v4\.)?([usb])(8|16|32|64)\b")
# The cuobjdump resource line of a kernel: registers per thread and bytes of local stack per thread.
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+)")


def _compile(
    kernel: triton.JITFunction,
    dtype: str,
    constants: dict,
    num_warps: int,
    types: dict[str, str] = POINTERS,
    num_stages: int = 2,
    aligned: tuple[str, ...] = (),
) -> None:
    """Compile `kernel` with `constants`; `types` names the types of arguments that are not pointers to
    `dtype` or int32. Launches that set no num_stages get Triton's default, 3. `aligned` names the
    arguments to specialize as multiples of 16, as a launch does for pointers and ints that are."""
    signature = {
        name: "constexpr"
        if name in constants
        else types.get(name, f"*{dtype}" if name.endswith("_ptr") else "i32")
        for name in kernel.arg_names
    }
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(
        source, target=SM_90, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    registers, stack = _resources(compiled.asm["cubin"])
    print(
        f"compiled {kernel.__name__} {dtype} {constants} loads={_load_widths(compiled.asm['ptx'])} "
        f"regs={registers} stack={stack}",
        flush=True,
    )


def _load_widths(ptx: str) -> str:
    """How many global load instructions of each width (bytes per thread) the PTX holds: '1B:40,4B:8'."""
    counts: dict[int, int] = {}
    for vector, _, bits in LOADS.findall(ptx):
        width = int(bits) // 8 * (int(vector[1]) if vector else 1)
        counts[width] = counts.get(width, 0) + 1
    return ",".join(f"{width}B:{counts[width]}" for width in sorted(counts))


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, bytes of stack) per thread of the one kernel in `cubin`, as cuobjdump reports them."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    found = RESOURCES.search(usage)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{usage}")
    return int(found[1]), int(found[2])


def main() -> None:
    if interpreting():
        sys.exit("TRITON_INTERPRET is set: run with TRITON_INTERPRET=0")
    for qtype in sorted(TRITON_TYPES):
        gemv = {"QTYPE": int(qtype), "HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256}
        _compile(triton_gemv._gemv_kernel.fn, "bf16", gemv, 4)
    for rows, block_n, superblocks, warps in ((1, 16, 2, 4), (4, 8, 4, 8)):
        words = {"HAS_BIAS": True, "BLOCK_M": rows, "BLOCK_N": block_n, "SUPERBLOCKS": superblocks}
        # Q4_K rows are multiples of 144 bytes: with 16-byte aligned rows, as torch allocates them.
        aligned = ("x_ptr", "words_ptr", "h_ptr", "bias_ptr", "out_ptr", "row_bytes", "K")
        _compile(triton_gemv._gemv_q4_k_kernel.fn, "bf16", words, warps, aligned=aligned)
    for dtype, qtype in (("bf16", Q.Q4_K), ("fp16", Q.Q6_K), ("fp32", Q.Q8_0)):
        gemm = {"QTYPE": int(qtype), "HAS_BIAS": True, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32}
        _compile(triton_gemm._gemm_kernel.fn, dtype, {**gemm, "GROUP_M": 8, "DOT_DTYPE": DTYPES[dtype]}, 8)
    tiles = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "DOT_DTYPE": tl.bfloat16}
    gate_up = {"GATE_TYPE": int(Q.Q4_K), "UP_TYPE": int(Q.IQ4_XS), **tiles}
    _compile(triton_moe._gate_up_kernel, "bf16", gate_up, 8)
    _compile(triton_moe._down_kernel, "bf16", {"QTYPE": int(Q.Q6_K), **tiles}, 8)
    one_token = {"BLOCK_N": 16, "BLOCK_K": 256}
    # As a launch on 16-byte aligned expert stacks specializes it (the Q4_K gate then loads 16 bytes).
    _compile(
        triton_moe._gate_up_token_kernel,
        "bf16",
        {"GATE_TYPE": int(Q.Q4_K), "UP_TYPE": int(Q.Q5_0), **one_token},
        4,
        aligned=("x_ptr", "gate_ptr", "gate_h_ptr", "up_ptr", "up_h_ptr", "act_ptr", "gate_row_bytes", "K"),
    )
    _compile(triton_moe._down_token_kernel, "bf16", {"QTYPE": int(Q.Q6_K), **one_token}, 4)
    _compile_paged_attention()
    _compile_gated_delta()


def _compile_paged_attention() -> None:
    """As `paged_attention_decode` launches: BLOCK_D the head size rounded up to a power of two (8 warps
    from 256), TILE_N = TILE_VALUES / BLOCK_D positions, TF32 products on a half-precision pool and
    exact ones on a float32 pool; partitions of 128 positions (short or QSA-selected context) to 512
    (long), and the combine over 1 partition up to the 391 of a 200k-token context."""
    pa = triton_paged_attention
    # (pool dtype, query heads per KV head, head size, partition, selected positions)
    partitions = (
        ("bf16", 12, 256, 512, False),  # the flagship, a long context
        ("bf16", 12, 256, 128, True),  # the flagship's QSA layers: the selected positions
        ("bf16", 4, 128, 256, False),
        ("fp16", 4, 128, 128, False),
        ("fp32", 12, 256, 128, True),
        ("fp32", 3, 64, 512, False),
    )
    for dtype, group, head_dim, part, selected in partitions:
        block_d = max(pa.MIN_DOT, triton.next_power_of_2(head_dim))
        constants = {
            "GROUP": group, "GROUP_PAD": max(pa.MIN_DOT, triton.next_power_of_2(group)),
            "HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_SIZE": DEFAULT_BLOCK_SIZE, "PART": part,
            "TILE_N": min(part, max(pa.MIN_DOT, pa.TILE_VALUES // block_d)),
            "PRECISION": "ieee" if dtype == "fp32" else "tf32", "SELECTED": selected,
        }  # fmt: skip
        _compile(pa._partition_kernel, dtype, constants, 8 if block_d >= 256 else 4, ATTENTION, 3)
    # (output dtype, head size, partitions, positions per partition)
    for dtype, head_dim, partitions_used, part in (
        ("bf16", 256, 1, 128),
        ("bf16", 256, 65, 128),  # QSA: 2048 blocks of 4 and the tail, 8195 positions
        ("bf16", 256, 391, 512),  # 200k positions
        ("fp32", 64, 8, 512),
    ):
        constants = {
            "HEAD_DIM": head_dim, "BLOCK_D": max(pa.MIN_DOT, triton.next_power_of_2(head_dim)),
            "BLOCK_P": min(pa.COMBINE_PARTITIONS, triton.next_power_of_2(partitions_used)), "PART": part,
        }  # fmt: skip
        _compile(pa._combine_kernel, dtype, constants, 4, ATTENTION, 3)


def _compile_gated_delta() -> None:
    """As triton_gated_delta launches: the fused decode step on the activations (bfloat16 for the
    flagship, both key-head orders) and float32, the plain recurrent step and the chunk kernels on
    float32, all at 128-wide heads (and 64-wide for the fused step); chunks of 16 to 64 tokens."""
    gd = triton_gated_delta
    for dtype, head_dim, tiled, raw_gates in (
        ("bf16", 128, True, True),  # the flagship's decode step
        ("bf16", 128, False, True),  # qwen3next's grouped key heads
        ("fp32", 64, True, True),
        ("fp32", 128, False, False),  # a one-token piece of a prompt
    ):
        constants = {
            "K": head_dim, "V": head_dim, "BK": triton.next_power_of_2(head_dim),
            "BV": min(gd.STATE_COLUMNS, triton.next_power_of_2(head_dim)), "TILED": tiled, "RAW_GATES": raw_gates,
        }  # fmt: skip
        _compile(gd._recurrent_kernel, dtype, constants, 4, DELTA, 3)
    head_dim = 128
    sizes = {"K": head_dim, "V": head_dim}
    for chunk in (16, 32, gd.CHUNK):
        prepare = {**sizes, "BC": gd.CHUNK_COLUMNS, "C": chunk}
        _compile(gd._chunk_prepare_kernel, "fp32", prepare, gd.CHUNK_WARPS, DELTA, 3)
        recurrence = {**sizes, "BK": gd.CHUNK_COLUMNS, "BV": gd.CHUNK_STATE_COLUMNS, "C": chunk}
        _compile(gd._chunk_recurrence_kernel, "fp32", recurrence, gd.recurrence_warps(chunk), DELTA, 3)


if __name__ == "__main__":
    main()
