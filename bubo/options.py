"""The runtime's switches: one options object, with a CLI flag each (bubo/cli.py), installed for the
process by `bubo.load` or `use_options`.

They are process-wide because what they switch is: the compiled kernels on disk, the Triton kernels'
autotuning (read as a kernel module is imported), and the decode paths every loaded model shares. The
`BUBO_*` environment variables of earlier versions are still honoured, read here and nowhere else
(`RuntimeOptions.from_environment`), so a deployment that sets them keeps its behaviour:

| variable | field | flag |
| --- | --- | --- |
| BUBO_COMPILE_DECODE=0 | compile_decode | --no-compile-decode |
| BUBO_CUDA_GRAPHS=0 | cuda_graphs | --no-cuda-graphs |
| BUBO_TRITON=0 | triton | --no-triton |
| BUBO_TRITON_AUTOTUNE=0 | triton_autotune | --no-triton-autotune |
| BUBO_PACK_EXPERTS=0 | pack_experts | --no-pack-experts |
| BUBO_PREFILL_BF16=1 / 0 | prefill_bf16 "on" / "off" | --prefill-bf16 {auto,on,off} |
| BUBO_KERNEL_CACHE=DIR / 0 | kernel_cache DIR / "off" | --kernel-cache {DIR,off} |
| BUBO_ADAPTIVE_THREADS=0 | adaptive_threads | --no-adaptive-threads |
"""

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = ["RuntimeOptions", "current_options", "use_options", "using_options"]

PrefillBF16 = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime runs a model; every field has a CLI flag.

    compile_decode: CPU decode steps run compiled by inductor where the step covers the model
        (bubo/engine/compiled_decode.py); off: the eager step.
    cuda_graphs: CUDA decode steps are captured as CUDA graphs where the step covers the model
        (bubo/engine/graph_decode.py); off: eager launches.
    triton: quantized matmuls, the fused MoE, paged attention and the gated-delta rule run in the Triton
        kernels on CUDA; off: the torch reference paths (for comparing, or a kernel problem on some GPU).
    triton_autotune: the Triton kernels sweep their configs at first launch; off: each takes its first,
        known-good config (a fast start; tests).
    pack_experts: CPU expert stacks are repacked into the compiled matvecs' layouts; off: the file's
        blocks stay mapped and are dequantized per routed expert (less memory, several times slower).
    prefill_bf16: the GEMMs of a float32 CPU prefill multiply in bfloat16 ("on"), in float32 ("off"), or
        in bfloat16 where the CPU has bfloat16 dot products ("auto").
    kernel_cache: where compiled CPU kernels are kept between processes: a directory, "" for the
        default (inside inductor's cache directory), or "off".
    adaptive_threads: CPU decode steps run on all the threads given (--threads) or on one, whichever
        their timings say is faster at the moment (bubo/engine/thread_governor.py); off: always all.
    int8_matvec: on CPUs with AVX512-VNNI or AVX2, Q4_K, Q6_K, Q4_0/Q4_1 and Q8_0 (Q5_0, IQ4_NL) matvecs
        multiply int8-quantized activations with the codes in integer arithmetic, as llama.cpp does
        (bubo/kernels/int8_matvec.py); off: the float matvecs, which keep the activations exact.
    """

    compile_decode: bool = True
    cuda_graphs: bool = True
    triton: bool = True
    triton_autotune: bool = True
    pack_experts: bool = True
    prefill_bf16: PrefillBF16 = "auto"
    kernel_cache: str = ""
    adaptive_threads: bool = True
    int8_matvec: bool = True

    def __post_init__(self) -> None:
        if self.prefill_bf16 not in ("auto", "on", "off"):
            raise ValueError(f"prefill_bf16: 'auto', 'on' or 'off', not {self.prefill_bf16!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "RuntimeOptions":
        """The defaults, changed by any `BUBO_*` variable that is set (the table above)."""
        changes: dict[str, Any] = {}
        for name, field_name in (
            ("BUBO_COMPILE_DECODE", "compile_decode"),
            ("BUBO_CUDA_GRAPHS", "cuda_graphs"),
            ("BUBO_TRITON", "triton"),
            ("BUBO_TRITON_AUTOTUNE", "triton_autotune"),
            ("BUBO_PACK_EXPERTS", "pack_experts"),
            ("BUBO_ADAPTIVE_THREADS", "adaptive_threads"),
        ):
            if name in environ:
                changes[field_name] = environ[name] != "0"
        bf16 = environ.get("BUBO_PREFILL_BF16")
        if bf16 is not None:
            changes["prefill_bf16"] = {"1": "on", "0": "off"}.get(bf16, "auto")
        cache = environ.get("BUBO_KERNEL_CACHE")
        if cache is not None:
            changes["kernel_cache"] = "off" if cache == "0" else cache
        return cls(**changes)

    def changed(self, **fields: Any) -> "RuntimeOptions":
        """A copy with `fields` replaced."""
        return replace(self, **fields)


_current: RuntimeOptions | None = None


def current_options() -> RuntimeOptions:
    """The options in force: those installed last, or the environment's until any are."""
    global _current
    if _current is None:
        _current = RuntimeOptions.from_environment()
    return _current


def use_options(options: RuntimeOptions) -> None:
    """Install `options` for the process (models loaded before keep the weights' layouts they got)."""
    global _current
    _current = options


@contextmanager
def using_options(options: RuntimeOptions) -> Iterator[RuntimeOptions]:
    """`options` in force inside the block, the previous ones after it."""
    before = current_options()
    use_options(options)
    try:
        yield options
    finally:
        use_options(before)
