"""The Triton kernels compile for an H100 / H200 (sm_90), checked ahead of time on the CPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia", reason="this triton build has no CUDA backend")

REPO = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm_90() -> None:
    # A fresh process: this session's kernels were decorated for the interpreter.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_for_cuda"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    # GEMV per type, the Q4_K word GEMV for 1 and 4 rows, GEMM, fused MoE; paged attention (partitions, combine); gated delta (recurrent
    # step, chunk kernels).
    assert result.stdout.count("compiled ") == 12 + 2 + 3 + 2 + 2 + 6 + 4 + 4 + 6
    # The decode step's per-token kernels at the flagship's sizes keep everything in registers.
    decode = [
        line
        for line in result.stdout.splitlines()
        if line.startswith("compiled _recurrent_kernel")
        or (line.startswith("compiled _partition_kernel bf16") and "'HEAD_DIM': 256" in line)
    ]
    assert len(decode) == 4 + 2
    assert all(line.endswith(" stack=0") for line in decode), "\n".join(decode)
    # The Q4_K GEMV loads its codes 16 bytes at a time, never byte by byte, without spilling; so does
    # the MoE decode's Q4_K gate.
    words = [
        line
        for line in result.stdout.splitlines()
        if line.startswith(("compiled _gemv_q4_k_kernel", "compiled _gate_up_token_kernel"))
    ]
    assert len(words) == 3
    assert all("16B:" in line and line.endswith(" stack=0") for line in words), "\n".join(words)
    assert all("1B:" not in line for line in words[:2]), "\n".join(words)
    # Nor do paged attention's combine step (up to the 391 partitions of a 200k-token context) and the
    # chunked prefill's kernels at every chunk length.
    long_context = [
        line
        for line in result.stdout.splitlines()
        if line.startswith(
            ("compiled _combine_kernel", "compiled _chunk_prepare_kernel", "compiled _chunk_recurrence")
        )
    ]
    assert len(long_context) == 4 + 3 + 3
    assert all(line.endswith(" stack=0") for line in long_context), "\n".join(long_context)
