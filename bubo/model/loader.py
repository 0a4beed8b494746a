"""Build a `Decoder` from a GGUF file's tensors.

Float tensors (F32/F16/BF16) become parameters in the compute dtype. Quantized tensors stay
quantized: their raw blocks (on the CPU, a view of the memory map) go into `QuantizedLinear` /
`QuantizedEmbedding` / `QuantizedExpertMatrices`, which dequantize where the weight is used.
A lookup table (qwen4exp's PLE table) stays as stored, float or blocks, in the memory map.
"""

import ctypes
import mmap
import sys
from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType
from torch import nn
from tqdm import tqdm

from bubo.gguf.model_config import ModelConfig
from bubo.gguf.quants import SUPPORTED_TYPES
from bubo.gguf.reader import GGUFError, GGUFFile, GGUFTensor
from bubo.model.decoder import Decoder
from bubo.model.load_progress import LoadProgress
from bubo.model.moe import ExpertMatrices, Experts, QuantizedExpertMatrices
from bubo.model.quantized_linear import QuantizedEmbedding, QuantizedLinear
from bubo.process_memory import trim_heap

__all__ = ["GGUFWeights", "load_decoder"]

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
_STORAGE_DTYPE = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_TORCH_FLOAT = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}

# A float tensor at least this large is used in place in the memory map; a smaller one is copied.
MIN_MAPPED_FLOAT_BYTES = 2 << 20

# Tensors a file may hold that the decoder doesn't ask for: rope_freqs is read into the config,
# attn_rot_embd is an unused leftover of old llama conversions.
_NOT_LOADED = ("rope_freqs.weight", ".attn_rot_embd.weight")


def release_pages(view: torch.Tensor) -> None:
    """Drop from RSS the memory-map pages lying wholly inside `view`: they are clean copy-on-write pages
    of the file (never written), so a later read just faults them in again from the file. Only for
    views of a file map: on anonymous memory this would zero the data."""
    if not sys.platform.startswith("linux"):
        return
    start, stop = view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = stop // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


def _release_if_packed(module: QuantizedLinear | QuantizedExpertMatrices, t: GGUFTensor) -> None:
    """Drop the map's pages of `t` once `module` holds a repacked copy of its blocks read through the map:
    that copy serves every product from now on, and the pages would stay in RSS (the weights twice)
    until memory ran short."""
    if module.packed is not None and module.raw.data_ptr() == t.raw.data_ptr():
        release_pages(t.raw)


class GGUFWeights:
    """The `WeightSource` for a GGUF file: checks names and shapes, holds quantized weights as blocks.

    Each tensor is materialised once, so a tied output matrix shares the embedding's storage.
    """

    def __init__(self, f: GGUFFile, dtype: torch.dtype, device: torch.device, progress: Any) -> None:
        self.file = f
        self.dtype = dtype
        self.device = device
        self._progress = progress
        self._loaded: dict[str, torch.Tensor] = {}

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self._get(name, shape)
        return self._materialise(name, lambda: self._float(t))

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def _float(self, t: GGUFTensor) -> torch.Tensor:
        # A large float tensor already in the compute dtype is used where it lies in the memory map: a
        # converted copy would cost its size again on top of the file's pages. A small one (a norm) is
        # copied: reading it through the map would fault in the page cache's whole folio around it (up to
        # 2 MB on Linux 6.x), many times its size, for as long as the model lives.
        if (
            _STORAGE_DTYPE.get(t.ggml_type) == self.dtype
            and self.device == t.raw.device
            and t.nbytes >= MIN_MAPPED_FLOAT_BYTES
        ):
            return t.raw.view(self.dtype).view(t.shape)
        return t.dequantize(self.dtype, self.device)

    def linear(self, name: str, shape: tuple[int, int], bias: str | None = None) -> nn.Module:
        stored = self._stored_shape(name, shape)
        t = self._get(name, stored)
        b = None if bias is None else self.tensor(bias, shape[:1])
        if t.ggml_type in FLOAT_TYPES:
            layer = nn.Linear(shape[1], shape[0], bias=b is not None, device="meta")
            layer.weight = nn.Parameter(self.tensor(name, stored).view(shape), requires_grad=False)
            if b is not None:
                layer.bias = nn.Parameter(b, requires_grad=False)
            return layer
        layer = QuantizedLinear(self._raw(t).view(shape[0], -1), t.ggml_type, in_features=shape[1], bias=b)
        _release_if_packed(layer, t)
        return layer

    def embedding(self, name: str, shape: tuple[int, int]) -> nn.Module:
        t = self._get(name, shape)
        if t.ggml_type in FLOAT_TYPES:
            return nn.Embedding.from_pretrained(self.tensor(name, shape), freeze=True)
        return QuantizedEmbedding(self._raw(t), t.ggml_type, embedding_dim=shape[1], dtype=self.dtype)

    def experts(self, name: str, shape: tuple[int, int, int]) -> Experts:
        t = self._get(name, shape)
        if t.ggml_type in FLOAT_TYPES:
            return ExpertMatrices(self.tensor(name, shape))
        stack = QuantizedExpertMatrices(self._raw(t), t.ggml_type, in_features=shape[2])
        _release_if_packed(stack, t)
        return stack

    def table(self, name: str, dim: int) -> tuple[torch.Tensor, GGMLQuantizationType | None]:
        t = self.file.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.file.path}: missing tensor '{name}'")
        self._get(name, (t.shape[0], dim))  # checks the row width and the type
        if t.ggml_type in FLOAT_TYPES:
            # A zero-copy view of the bytes as floats; lookups convert only the rows they pick.
            return self._materialise(name, lambda: t.raw.view(_TORCH_FLOAT[t.ggml_type])), None
        return self._raw(t), t.ggml_type

    def unused(self, ignored: tuple[str, ...] = ()) -> list[str]:
        """Tensors of the file the model did not take (and that aren't known to be unneeded or `ignored`
        name prefixes)."""
        return [
            n
            for n in self.file.tensors
            if n not in self._loaded and not n.endswith(_NOT_LOADED) and not n.startswith(ignored)
        ]

    def _stored_shape(self, name: str, shape: tuple[int, int]) -> tuple[int, ...]:
        """`shape`, or [in] where the file holds a one-row matrix 1-D: the converter writes the shared
        expert's gate ffn_gate_inp_shexp [1, H], but files that went through llama-quantize hold it
        [H], so both reach us (shared/spec/qwen4exp.md section 5, item 5)."""
        t = self.file.tensors.get(name)
        return shape[1:] if shape[0] == 1 and t is not None and tuple(t.shape) == shape[1:] else shape

    def _get(self, name: str, shape: tuple[int, ...]) -> GGUFTensor:
        t = self.file.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.file.path}: missing tensor '{name}'")
        if tuple(t.shape) != tuple(shape):
            raise GGUFError(
                f"{self.file.path}: tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(shape)}"
            )
        if t.ggml_type not in FLOAT_TYPES and t.ggml_type not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{self.file.path}: tensor '{name}' has type {t.ggml_type.name}, which Bubo can't dequantize"
            )
        return t

    def _raw(self, t: GGUFTensor) -> torch.Tensor:
        return self._materialise(t.name, lambda: t.raw.to(self.device))

    def _materialise(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if name not in self._loaded:
            self._loaded[name] = make()
            self._progress.update(1)
        return self._loaded[name]


def load_decoder(
    f: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool | LoadProgress = False,
) -> Decoder:
    """The model `config` describes, with its weights from `f`, computing in `dtype` on `device`.

    `progress`: a bar of the tensors loaded (True), or a LoadProgress that tells them its way.

    Raises GGUFError naming the tensor when one is missing, has an unexpected shape or type, or
    when the file holds tensors the model would ignore (a sign the config misreads the file).
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported compute dtype {dtype}; use float32, bfloat16 or float16")
    # qwen4exp attention layers with compress ratio 0 run dense and leave their indexer unused, as in
    # llama.cpp (config_from_gguf warns about such a file).
    dense = () if config.indexer is None else config.indexer.compress_ratios
    ignored = tuple(
        f"blk.{i}.indexer." for i, ratio in enumerate(dense) if ratio == 0 and not config.recurrent_layers[i]
    )
    n = config.num_layers
    if config.mtp_layers:
        # Copies of the shared embedding (and, but for qwen4exp, whose block drafts with it when
        # present, of the head) that some converters write into the MTP block.
        ignored += (f"blk.{n}.nextn.embed_tokens.",)
        if not config.hc_count:
            ignored += (f"blk.{n}.nextn.shared_head_head.",)
        if config.indexer is not None and not any(config.indexer.compress_ratios):
            ignored += (f"blk.{n}.indexer.",)  # the block runs dense with the trunk (decoder_layer.py)
    elif config.architecture == "qwen4exp":
        # A block without `nextn_predict_layers` to say it is one is left alone (spec section 4.11).
        ignored += (f"blk.{n}.", "mtp.")
    wanted = [n for n in f.tensors if not n.endswith(_NOT_LOADED) and not n.startswith(ignored)]
    if isinstance(progress, LoadProgress):
        counter = progress.counter(len(wanted), "loading and repacking weights")
    else:
        counter = tqdm(total=len(wanted), desc="Loading weights", unit="tensor", disable=not progress)
    with counter as bar:
        weights = GGUFWeights(f, dtype, torch.device(device), bar)
        model = Decoder(config, weights)
    unused = weights.unused(ignored)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise GGUFError(f"{f.path}: tensors not used by the {config.architecture} model: {shown}")
    # Packing (and on a GPU, copying) read every weight through the map; what is still used as stored is
    # faulted in again when read.
    f.release_pages()
    if torch.device(device).type == "cpu":
        trim_heap()  # what packing and compiling the kernels freed
    return model.eval()
