"""Compile every Triton kernel for an sm_90 GPU (H100 / H200) ahead of time, without a GPU.

The interpreter runs a kernel as Python, so it accepts code the compiler rejects (a constexpr that
isn't one, an operator triton lacks); this builds the real PTX and cubin for each kernel, for
every ggml type the dequantization reads. Run in a process without TRITON_INTERPRET (kernels
decorated under the interpreter can't be compiled): `TRITON_INTERPRET=0 python -m tests.kernels.compile_for_cuda`.
"""

import sys

import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bubo.kernels import triton_gemm, triton_gemv, triton_moe
from bubo.kernels.triton_quant import interpreting
from bubo.kernels.triton_support import TRITON_TYPES

SM_90 = GPUTarget("cuda", 90, 32)
# Pointer arguments by name: the weights' bytes, their fp16 view, the codebook, routing tables,
# and activations in the compute dtype.
POINTERS = {
    "w_ptr": "*u8", "gate_ptr": "*u8", "up_ptr": "*u8", "down_ptr": "*u8",
    "h_ptr": "*fp16", "gate_h_ptr": "*fp16", "up_h_ptr": "*fp16", "down_h_ptr": "*fp16",
    "lut_ptr": "*fp32", "pairs_ptr": "*i32", "tile_expert_ptr": "*i32", "experts_ptr": "*i64",
}  # fmt: skip
DTYPES = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def _compile(kernel: triton.JITFunction, dtype: str, constants: dict, num_warps: int) -> None:
    signature = {
        name: "constexpr"
        if name in constants
        else POINTERS.get(name, f"*{dtype}" if name.endswith("_ptr") else "i32")
        for name in kernel.arg_names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    triton.compile(source, target=SM_90, options={"num_warps": num_warps, "num_stages": 2})
    print(f"compiled {kernel.__name__} {dtype} {constants}", flush=True)


def main() -> None:
    if interpreting():
        sys.exit("TRITON_INTERPRET is set: run with TRITON_INTERPRET=0")
    for qtype in sorted(TRITON_TYPES):
        gemv = {"QTYPE": int(qtype), "HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256}
        _compile(triton_gemv._gemv_kernel.fn, "bf16", gemv, 4)
    for dtype, qtype in (("bf16", Q.Q4_K), ("fp16", Q.Q6_K), ("fp32", Q.Q8_0)):
        gemm = {"QTYPE": int(qtype), "HAS_BIAS": True, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32}
        _compile(triton_gemm._gemm_kernel.fn, dtype, {**gemm, "GROUP_M": 8, "DOT_DTYPE": DTYPES[dtype]}, 8)
    tiles = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "DOT_DTYPE": tl.bfloat16}
    gate_up = {"GATE_TYPE": int(Q.Q4_K), "UP_TYPE": int(Q.IQ4_XS), **tiles}
    _compile(triton_moe._gate_up_kernel, "bf16", gate_up, 8)
    _compile(triton_moe._down_kernel, "bf16", {"QTYPE": int(Q.Q6_K), **tiles}, 8)
    one_token = {"BLOCK_N": 16, "BLOCK_K": 256}
    _compile(
        triton_moe._gate_up_token_kernel,
        "bf16",
        {"GATE_TYPE": int(Q.Q4_K), "UP_TYPE": int(Q.Q5_0), **one_token},
        4,
    )
    _compile(triton_moe._down_token_kernel, "bf16", {"QTYPE": int(Q.Q6_K), **one_token}, 4)


if __name__ == "__main__":
    main()
