"""Whether the Triton kernels of bubo/kernels/triton_*.py can run on some tensors.

Triton is optional: Bubo imports and runs without it, and its kernels only ever run on CUDA tensors
(tests run them on the CPU through TRITON_INTERPRET=1 by importing the kernel modules directly).
Setting BUBO_TRITON=0 keeps the plain torch paths on CUDA too, to compare the two.
"""

import functools
import importlib.util
import os

import torch

__all__ = ["use_triton"]


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None and os.environ.get("BUBO_TRITON", "1") != "0"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether work on `tensor` should go through the Triton kernels: it is on CUDA and triton is there."""
    return tensor.is_cuda and _triton_importable()
