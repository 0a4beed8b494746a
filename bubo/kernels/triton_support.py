"""When the Triton kernels run: on CUDA, triton importable, and `RuntimeOptions.triton` on (--no-triton).

This module never imports triton (CPU installs have none); the kernel modules (triton_gemv,
triton_gemm, triton_moe, triton_paged_attention, triton_gated_delta) do, so callers import those only once `triton_enabled` said yes.

--no-triton-autotune (`RuntimeOptions.triton_autotune`) makes every autotuned kernel use only its first config
(`autotune_configs`): no autotuning sweep at first launch, for tests and a fast start.
"""

import functools
import importlib.util

import torch
from gguf import GGMLQuantizationType

from bubo.options import current_options

__all__ = ["TRITON_TYPES", "autotune_configs", "triton_enabled"]

T = GGMLQuantizationType

# The ggml types `triton_quant.dequantize_tile` reads.
TRITON_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS}
)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_enabled(device: torch.device) -> bool:
    """Whether quantized matmuls on `device` go through the Triton kernels.

    --no-triton turns them off (the dequantize-then-matmul torch path runs instead), for comparing the
    two or working around a kernel problem on some GPU.
    """
    return device.type == "cuda" and current_options().triton and _triton_importable()


def autotune_configs(configs: list) -> list:
    """`configs`, or only the first with autotuning off (read when a kernel module is imported)."""
    return configs if current_options().triton_autotune else configs[:1]
