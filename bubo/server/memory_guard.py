"""The memory guard: refuse a request up front rather than run out of memory halfway through it.

Before a request runs, its needs are estimated — KV cache for the positions it will add (prompt plus
max tokens) where their memory is not committed yet, recurrent state, and prefill activations — and
compared with what the machine has, and the blocks its prompt needs with those of the slots' shared KV
pool that are free or reclaimable: GPU memory on CUDA (`torch.cuda.mem_get_info`), otherwise the
kernel's MemAvailable. Three answers:
short now (503 insufficient_memory, Retry-After: 5: free memory and retry), the system under memory
pressure (503 memory_pressure, Retry-After: 5; Linux PSI `full avg10`), or more than the machine has
at all (507 insufficient_memory_permanent, no Retry-After: shorten the prompt).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from bubo.gguf.model_config import ModelConfig
from bubo.process_memory import meminfo as process_meminfo
from bubo.server.errors import ApiError

__all__ = [
    "MemoryGuard",
    "MemoryInfo",
    "MemoryProbe",
    "RequestCost",
    "SystemMemoryProbe",
    "request_cost",
    "vision_bytes",
]

# PSI "full" means every task was stalled on memory; 10% of the last 10 s is thrashing territory.
_PRESSURE_FULL_AVG10 = 10.0


@dataclass(frozen=True)
class MemoryInfo:
    """Bytes free now and bytes the device has at all (for the model's working memory), and whether
    the system is thrashing."""

    available: int
    total: int
    under_pressure: bool = False


class MemoryProbe(Protocol):
    def read(self) -> MemoryInfo: ...


class SystemMemoryProbe:
    """Reads the real numbers: CUDA's free/total for a GPU, /proc/meminfo and /proc/pressure for RAM."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> MemoryInfo:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return MemoryInfo(available=free, total=total)
        meminfo = process_meminfo()
        return MemoryInfo(
            available=meminfo.get("MemAvailable", meminfo.get("MemFree", 0)),
            total=meminfo.get("MemTotal", 0),
            under_pressure=_pressure_full_avg10() > _PRESSURE_FULL_AVG10,
        )


def _pressure_full_avg10() -> float:
    try:
        text = Path("/proc/pressure/memory").read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("full"):
            for item in line.split():
                if item.startswith("avg10="):
                    return float(item.removeprefix("avg10="))
    return 0.0


@dataclass(frozen=True)
class RequestCost:
    """The per-model constants of the estimate."""

    kv_bytes_per_token: int
    activation_bytes_per_token: int
    fixed_bytes: int


class MemoryGuard:
    """Checks each request's estimated need against the probe's answer."""

    def __init__(self, probe: MemoryProbe, cost: RequestCost) -> None:
        self.probe = probe
        self.cost = cost

    def estimate(self, prompt_tokens: int, new_positions: int, encoding_bytes: int = 0) -> int:
        """Bytes a request needs beyond what is already allocated: KV for `new_positions`, the positions
        it may write into KV memory not committed yet, activations for the prompt it computes, fixed
        per-request buffers (logits, sampler), and what encoding its images takes (`vision_bytes`)."""
        c = self.cost
        return (
            new_positions * c.kv_bytes_per_token
            + prompt_tokens * c.activation_bytes_per_token
            + c.fixed_bytes
            + encoding_bytes
        )

    def check(self, prompt_tokens: int, new_positions: int, encoding_bytes: int = 0) -> None:
        need = self.estimate(prompt_tokens, new_positions, encoding_bytes)
        info = self.probe.read()
        mib = 1 << 20
        if info.total and need > info.total:
            raise ApiError(
                507,
                "insufficient_memory_permanent",
                f"this request needs about {need // mib} MiB but the machine has {info.total // mib} MiB in "
                "all; shorten the prompt, lower max_tokens or send smaller images",
            )
        if info.under_pressure:
            raise ApiError(
                503,
                "memory_pressure",
                "the system is under memory pressure; free memory and send the request again",
                headers={"Retry-After": "5"},
            )
        if need > info.available:
            raise ApiError(
                503,
                "insufficient_memory",
                f"this request needs about {need // mib} MiB but only {info.available // mib} MiB are free "
                "now; free memory and send the request again",
                headers={"Retry-After": "5"},
            )

    def check_blocks(self, needed: int, available: int, total: int) -> None:
        """The KV blocks a prompt needs against the shared pool's: blocks free or held only by idle slots'
        caches (which give them back when asked), and the pool's size."""
        if needed > total:
            raise ApiError(
                507,
                "insufficient_memory_permanent",
                f"this prompt needs {needed} KV blocks but the cache has {total} in all; shorten the prompt",
            )
        if needed > available:
            raise ApiError(
                503,
                "insufficient_memory",
                f"this prompt needs {needed} KV blocks but only {available} are free now: the other slots "
                "hold the rest; send the request again",
                headers={"Retry-After": "5"},
            )


def kv_bytes_per_position(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values a position takes over the model's attention layers, stored in `dtype`."""
    attention_layers = config.num_layers - sum(config.recurrent_layers)
    return attention_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize


def request_cost(config: ModelConfig, kv_bytes: int) -> RequestCost:
    """The estimate's constants for a model whose KV cache takes `kv_bytes` a position: those, and a
    generous bound on prefill activations per prompt token (the residual stream, q/k/v, the MLP's
    gate/up/down widths, all in float32 as the matmuls produce them)."""
    mlp_width = max(
        config.intermediate_size,
        config.moe_intermediate_size * max(config.num_experts_per_tok, 1)
        + config.shared_expert_intermediate_size,
    )
    activations = 4 * (12 * config.hidden_size + 3 * mlp_width + 2 * config.num_heads * config.head_dim)
    # Per request: the logits row and the sampler's sort buffers, plus slack for allocator rounding.
    fixed = 16 * config.vocab_size + (64 << 20)
    return RequestCost(kv_bytes_per_token=kv_bytes, activation_bytes_per_token=activations, fixed_bytes=fixed)


def vision_bytes(config: Any, grids: Sequence[tuple[int, int, int]]) -> int:
    """A generous bound on what encoding images of these patch grids takes in the vision tower: per
    patch, float32 activations of the residual stream, q/k/v and the MLP (16 widths), and per image the
    attention scores of every head over its patches (an image's patches attend to each other)."""
    width = getattr(config, "hidden_size", None) or config.out_hidden_size
    heads = getattr(config, "num_heads", None) or 16
    total = 0
    for t, h, w in grids:
        patches = t * h * w
        total += 4 * (16 * width * patches + heads * patches * patches)
    return total
