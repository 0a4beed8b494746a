"""A GGUF file opened into everything generation needs: config, decoder and tokenizer."""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bubo.engine.runner import runner_for
from bubo.engine.tensor_parallel_steps import StepLeader, load_shard
from bubo.gguf.config import config_from_gguf
from bubo.gguf.model_config import ModelConfig
from bubo.gguf.reader import GGUFFile
from bubo.model.decoder import Decoder
from bubo.model.load_progress import LoadProgress
from bubo.model.loader import load_decoder
from bubo.model.quantized_linear import bf16_prefill, has_packed_weights
from bubo.model.tensor_parallel import TensorParallel
from bubo.model.tokenizer import Tokenizer
from bubo.process_memory import drop_trace_caches

log = logging.getLogger(__name__)

# Metadata arrays only the tokenizer reads: dropped from `LoadedModel.file.metadata` once it is built.
_VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


@dataclass
class LoadedModel:
    """`file.metadata` lacks the vocabulary arrays (`_VOCABULARY_KEYS`), which `tokenizer` holds. A model
    split by tensor parallelism has its `step_leader` (rank 0's; `config` stays the whole file's)."""

    path: Path
    file: GGUFFile
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer
    step_leader: StepLeader | None = None


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool | LoadProgress = False,
    cache_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
    tensor_parallel: TensorParallel | None = None,
) -> LoadedModel:
    """Open `path`, check its architecture, and build the decoder and tokenizer from it; its caches
    store keys and values in `cache_dtypes` (default: `dtype`). `progress`: a bar of the weights
    loaded (True), or a LoadProgress that also tells the compiling that follows. With `tensor_parallel`
    (rank 0 of its group) the decoder is this rank's shard, leading the other ranks' steps, which load
    the same file with the same settings (`tensor_parallel_steps.follow_file`).

    The config is read first so an unsupported architecture fails before any weight is touched.
    """
    file = GGUFFile(path)
    try:
        config = config_from_gguf(file)
        tokenizer = Tokenizer.from_gguf(file.metadata)
        for key in _VOCABULARY_KEYS:
            # The tokenizer holds its own tables; as lists of Python strings these stay ~8 MB of heap.
            file.metadata.pop(key, None)
        leader = None
        if tensor_parallel is None:
            model = load_decoder(file, config, dtype=dtype, device=device, progress=progress)
        else:
            if tensor_parallel.rank != 0:
                raise ValueError("only rank 0 loads a model to serve; the others follow it (follow_file)")
            model = load_shard(file, config, tensor_parallel, dtype, device, progress)
            leader = StepLeader(model, tensor_parallel)
        if cache_dtypes is not None:
            # Before the decode step is prepared: its warm-up compiles attention for these dtypes.
            model.cache_dtypes = cache_dtypes
        stage = progress.stage if isinstance(progress, LoadProgress) else _quietly
        with stage("compiling the decode step (a first start compiles; later starts read the kernel cache)"):
            runner_for(model).prepare()
        drop_trace_caches()
        _report_cpu_precision(model, dtype)
    except BaseException:
        file.close()
        raise
    return LoadedModel(Path(path), file, config, model, tokenizer, leader)


@contextmanager
def _quietly(what: str) -> Iterator[None]:
    yield


def _report_cpu_precision(model: Decoder, dtype: torch.dtype) -> None:
    """The CPU's repacked matvec kernels are float32: in another compute dtype every product takes the
    dense dequantizing path, which decodes many times slower.
    In float32, says which precision the prefill GEMMs take (`bf16_prefill`)."""
    if model.device.type != "cpu":
        return
    if dtype == torch.float32:
        precision = "bfloat16 (--prefill-bf16 off for float32)" if bf16_prefill() else "float32"
        log.info("CPU prefill GEMMs in %s; decode in float32", precision)
        return
    if has_packed_weights(model):
        name = str(dtype).removeprefix("torch.")
        log.warning(
            "compute dtype %s on the CPU: the repacked quantized kernels run in float32 only, so every "
            "product dequantizes to dense %s (many times slower); --dtype float32 is the fast CPU path",
            name,
            name,
        )
