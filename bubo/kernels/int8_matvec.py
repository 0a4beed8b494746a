"""Matvecs with int8 activations on AVX512-VNNI or AVX2 (Q4_K, Q6_K, Q4_0/Q4_1, Q8_0 and the types repacked
as it): the C++ kernels of csrc/int8_matvec.cpp.

Inductor emits float code only: per vector of weights an AND, a conversion and an FMA on the expanded codes.
llama.cpp's CPU kernels instead quantize the activations to int8 and multiply bytes by bytes with integer dot
products (`vpdpbusd` on AVX512-VNNI; `vpmaddubsw` and `vpmaddwd` on AVX2), which ran 1.25-2.1x as fast as the
float matvecs on this project's Xeon and 1.1-2.9x on its AVX2 EPYC (benchmarks/bench_int8_matvec.py). These
kernels do that: the activations are quantized per block of 32 (a float scale, values rounded to -127..127,
the same error llama.cpp's Q8 activations make) once a call, the products run on the codes in their packed
words, and each sub-block's integer sum is scaled in float32.

Q4_K keeps super_block_matvec.py's layout (`PackedSuperBlocks`), whose words suit the instruction as they
are, and so do Q4_0/Q4_1's (`PackedQ4`, the same nibble words a block of 32) and Q8_0's (`PackedQ8`, a
code byte each, stored plus 128). Q6_K gets a layout of its own, `PackedQ6KInt8` (6.625 bits a weight,
the other layout's 7.125): its 6-bit codes straddle the 32-bit words there, and a sub-block's 16 codes
must sit in whole bytes for an integer sum. Its prefill unpacking is C++ too (`q6_k_unpack`).

The ops (`torch.ops.bubo_int8.*`) are registered from C++, so that a compiled decode step's generated
code calls them through the dispatcher alone (a Python op costs several microseconds a call), and have
fake implementations for tracing them into its graphs. The library is compiled on first use with the
C++ compiler inductor uses, against the running torch, for the instruction set whose vector lanes are
codes.py's TILE (16: AVX512-VNNI, 8: AVX2 with FMA and F16C), and kept by the hash of its sources and
flags. Off where the CPU has neither, where the build fails (the float matvecs run instead), or with
--no-int8-matvec.
"""

import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from bubo.gguf.quants import QK_K, f16_field, q6_k_codes, q6_k_sub_scales
from bubo.kernels.codes import TILE, expand_tiles, field_words
from bubo.options import current_options

__all__ = [
    "PackedQ6KInt8",
    "int8_matvec_enabled",
    "int8_rows",
    "matvec_plan",
    "q4_int8_matvec",
    "q4_k_int8_matvec",
    "q6_k_int8_matvec",
    "q6_k_int8_rows",
    "q8_int8_matvec",
]

log = logging.getLogger(__name__)

_SOURCES = Path(__file__).with_name("csrc")
_SOURCE = _SOURCES / "int8_matvec.cpp"


@dataclass(frozen=True)
class _InstructionSet:
    name: str
    lanes: int  # float lanes of a vector: the TILE the packed layouts must have
    compiler_flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]  # as /proc/cpuinfo names them


# The first that this CPU has and whose lanes are the packed layouts' TILE (int8_vectors.h).
_INSTRUCTION_SETS = (
    _InstructionSet(
        "AVX512-VNNI",
        16,
        ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"),
        ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"),
    ),
    _InstructionSet("AVX2", 8, ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
)
# Q6_K's words a super-block: 4 of scales, then a sub-block's 2 of low nibbles and 1 of high bits, 16 times
# (see the C++ source).
Q6_K_WORDS = 52


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; none elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split())
    except OSError:
        pass
    return set()


@functools.cache
def _instruction_set() -> _InstructionSet | None:
    flags = _cpu_flags()
    for isa in _INSTRUCTION_SETS:
        if isa.lanes == TILE and set(isa.cpu_flags) <= flags:
            return isa
    return None


def _compile_command(isa: _InstructionSet, output: Path) -> list[str]:
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch.utils.cpp_extension import include_paths, library_paths

    torch_lib = library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        get_cpp_compiler(),
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",  # at::parallel_for is OpenMP in torch's CPU builds: the same runtime, torch's libgomp
        *isa.compiler_flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
        str(_SOURCE),
        "-o",
        str(output),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]


def _library_path(isa: _InstructionSet) -> Path:
    """The compiled library, built into inductor's cache directory unless a build of these sources, these
    flags and this torch is there."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = hashlib.sha256()
    for source in sorted([*_SOURCES.glob("*.cpp"), *_SOURCES.glob("*.h")]):
        key.update(source.read_bytes())
    key.update(" ".join(_compile_command(isa, Path("out"))).encode())
    key.update(f"{torch.__version__} {sys.version}".encode())
    directory = Path(cache_dir()) / "bubo-native"
    path = directory / f"int8_matvec-{key.hexdigest()[:16]}.so"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        # Built under a name of its own and renamed into place: processes building at once never load
        # a half-written file.
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / path.name
            subprocess.run(_compile_command(isa, built), check=True, capture_output=True, text=True)
            os.replace(built, path)
    return path


_loading = threading.Lock()
_why_unavailable: str | None = None  # set once, by the first `_unavailable`


def _unavailable() -> str:
    """Why the kernels can't run here, or "" once the library is loaded and its ops' fake implementations
    registered (once a process: the lock keeps two threads' first calls from registering them twice)."""
    global _why_unavailable
    if _why_unavailable is None:
        with _loading:
            if _why_unavailable is None:
                _why_unavailable = _load()
    return _why_unavailable


def _load() -> str:
    isa = _instruction_set()  # none off Linux: no /proc/cpuinfo
    if isa is None:
        return "the CPU has neither AVX512-VNNI nor AVX2 with FMA and F16C"
    try:
        torch.ops.load_library(str(_library_path(isa)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) else str(e)
        log.warning("the int8 matvec kernels did not build; the float matvecs run instead: %s", detail)
        return "the int8 kernels did not build"
    _register_fakes()
    return ""


def _loaded() -> bool:
    return not _unavailable()


def _register_fakes() -> None:
    def matvec_shape(x: torch.Tensor, words: torch.Tensor, experts: torch.Tensor | None, expert_rows: int):
        if experts is None:
            return x.new_empty(x.shape[0], words.shape[0] * TILE)
        return x.new_empty(experts.shape[0], expert_rows)

    @torch.library.register_fake("bubo_int8::q4_k_matvec")
    def _q4_k(x, words, fields, factors, experts, expert_rows):  # type: ignore[no-untyped-def]
        return matvec_shape(x, words, experts, expert_rows)

    @torch.library.register_fake("bubo_int8::q6_k_matvec")
    def _q6_k(x, words, factors, experts, expert_rows):  # type: ignore[no-untyped-def]
        return matvec_shape(x, words, experts, expert_rows)

    @torch.library.register_fake("bubo_int8::q4_matvec")
    def _q4(x, words, scale_offset, experts, expert_rows):  # type: ignore[no-untyped-def]
        return matvec_shape(x, words, experts, expert_rows)

    @torch.library.register_fake("bubo_int8::q8_matvec")
    def _q8(x, words, experts, expert_rows):  # type: ignore[no-untyped-def]
        return matvec_shape(x, words, experts, expert_rows)

    @torch.library.register_fake("bubo_int8::q6_k_unpack")
    def _q6_k_unpack(words, factors, dtype):  # type: ignore[no-untyped-def]
        return factors.new_empty(words.shape[1] * QK_K, words.shape[0] * TILE, dtype=dtype)


def int8_matvec_enabled() -> bool:
    """Whether the quantized matvecs run the int8 kernels: --no-int8-matvec not given, and the CPU and the
    build allow them."""
    return current_options().int8_matvec and _loaded()


def matvec_plan() -> str:
    """Which matvecs quantized weights take, and why: a line of the runner's plan."""
    if not current_options().int8_matvec:
        return "float activations (--no-int8-matvec)"
    why_not = _unavailable()
    if why_not:
        return f"float activations ({why_not})"
    isa = _instruction_set()
    assert isa is not None  # the library loaded: `_load` found one
    return f"int8 activations for Q4_K, Q6_K, Q4_0/Q4_1, Q8_0 ({isa.name})"


def q4_k_int8_matvec(
    x: torch.Tensor,
    words: torch.Tensor,
    fields: torch.Tensor,
    factors: torch.Tensor,
    experts: torch.Tensor | None = None,
    expert_rows: int = 0,
) -> torch.Tensor:
    """x [rows, in] times a PackedSuperBlocks Q4_K's tensors -> [rows, tiles * TILE]; with `experts` [n]
    (ids into a stack of experts of `expert_rows` rows each, n a multiple of rows), expert experts[i] times
    row i // (n // rows) of x -> [n, expert_rows]."""
    return torch.ops.bubo_int8.q4_k_matvec(x, words, fields, factors, experts, expert_rows)


def q4_int8_matvec(
    x: torch.Tensor,
    words: torch.Tensor,
    scale_offset: torch.Tensor,
    experts: torch.Tensor | None = None,
    expert_rows: int = 0,
) -> torch.Tensor:
    """`q4_k_int8_matvec` for a PackedQ4's tensors (Q4_0, Q4_1)."""
    return torch.ops.bubo_int8.q4_matvec(x, words, scale_offset, experts, expert_rows)


def q8_int8_matvec(
    x: torch.Tensor, words: torch.Tensor, experts: torch.Tensor | None = None, expert_rows: int = 0
) -> torch.Tensor:
    """`q4_k_int8_matvec` for a PackedQ8's words (Q8_0, and Q5_0 and IQ4_NL repacked as it)."""
    return torch.ops.bubo_int8.q8_matvec(x, words, experts, expert_rows)


def q6_k_int8_matvec(
    x: torch.Tensor,
    words: torch.Tensor,
    factors: torch.Tensor,
    experts: torch.Tensor | None = None,
    expert_rows: int = 0,
) -> torch.Tensor:
    """`q4_k_int8_matvec` for a PackedQ6KInt8's tensors."""
    return torch.ops.bubo_int8.q6_k_matvec(x, words, factors, experts, expert_rows)


def int8_rows(
    matvec: Callable[..., torch.Tensor], x: torch.Tensor, *tensors: torch.Tensor, out_features: int
) -> torch.Tensor:
    """x [..., in] (a row or a few) through one of the int8 matvecs above on a packed matrix's `tensors` ->
    [..., out_features]: the ops take [rows, in] and give whole tiles, the last one's padding rows cut off."""
    out = matvec(x.reshape(-1, x.shape[-1]), *tensors)
    return out.view(*x.shape[:-1], -1)[..., :out_features]


@dataclass(frozen=True)
class PackedQ6KInt8:
    words: torch.Tensor  # int32 [tiles, super-blocks, Q6_K_WORDS, TILE]
    factors: torch.Tensor  # float32 [tiles, super-blocks, 1, TILE]: d
    out_features: int
    ggml_type: GGMLQuantizationType = GGMLQuantizationType.Q6_K

    @property
    def in_features(self) -> int:
        return self.words.shape[1] * QK_K

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        return int8_rows(q6_k_int8_matvec, x, self.words, self.factors, out_features=self.out_features)

    def unpack(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Weight columns start:stop, transposed: [in_features, stop - start] in `dtype` (a prefill's GEMM)."""
        return expand_tiles(_q6_k_unpack_kernel(dtype), (self.words, self.factors), start, stop)


@functools.cache
def _q6_k_unpack_kernel(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    return lambda words, factors: torch.ops.bubo_int8.q6_k_unpack(words, factors, dtype)


# Where the 16 two-bit fields of a high-bits word come from: field 4b + p holds code 2b, 2b + 1, 8 + 2b or
# 9 + 2b of its sub-block (p = 0..3), so that a shift and an AND set a dword's high bits beside the low
# nibbles of the code word that holds its codes.
_HIGH_ORDER = [(2 * (f // 4) + f % 4 % 2 + 8 * (f % 4 // 2)) for f in range(16)]


def q6_k_int8_rows(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """One run of n rows' Q6_K blocks, uint8 [n_blocks, 210] -> (words [n, super-blocks, Q6_K_WORDS],
    factors [n, super-blocks, 1]): PackedQ6KInt8's rows, which bubo/kernels/repack.py tiles."""
    n_blocks = blocks.shape[0]
    codes = (q6_k_codes(blocks).view(torch.uint8) + 32).view(n_blocks, 16, 16)  # q - 32 -> q, modulo 256
    low = field_words((codes & 0x0F).view(n_blocks, QK_K), 4)
    high = field_words((codes >> 4)[:, :, _HIGH_ORDER], 2).view(n_blocks, 16)
    # A copy: one block's scales are a slice that counts as contiguous while its stride is the block's.
    scales = field_words(
        q6_k_sub_scales(blocks).view(torch.uint8).clone(memory_format=torch.contiguous_format), 8
    )
    by_sub_block = torch.cat((low.view(n_blocks, 16, 2), high.view(n_blocks, 16, 1)), dim=-1)
    words = torch.cat((scales, by_sub_block.view(n_blocks, 48)), dim=-1)
    return words.view(n, -1, Q6_K_WORDS), f16_field(blocks, 208).view(n, -1, 1)
