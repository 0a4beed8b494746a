"""What `bubo serve` is told: the model file, where to listen, keys, limits, sampling defaults,
slots, speculative decoding and vision (`ServerSettings`, filled from the CLI's flags), and the id the
model is served under."""

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bubo.engine.ngram_drafter import DEFAULT_NGRAM_SIZE
from bubo.engine.prompt_cache import SnapshotPolicy
from bubo.engine.sampler import SamplingParams
from bubo.model.tensor_parallel import TensorParallel
from bubo.server.image_input import ImageLimits

__all__ = ["CACHE_ISOLATION", "SERVED_ALIAS", "ServerSettings", "model_id_from_path"]

SERVED_ALIAS = "bubo"
CACHE_ISOLATION = ("shared", "key", "request")


def model_id_from_path(path: Path) -> str:
    """The served id for a file: its name lowercased, a dot inside a version number dropped, other
    separators as dashes (Huihui-Qwen3.8-Flash-Next-UD-Q4_K_XL-v1.gguf -> huihui-qwen38-flash-next-ud-q4-k-xl-v1)."""
    name = re.sub(r"(?<=\d)\.(?=\d)", "", path.stem.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "model"


@dataclass
class ServerSettings:
    model_path: Path
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    # Further keys, each as good as api_key; under cache_isolation "key" each has a cache of its own.
    more_api_keys: tuple[str, ...] = ()
    # Whose prompts a request's prompt may reuse the cache of: "shared" (anyone's: the fastest, but
    # cached_tokens tells a client how much of its prompt another's shared), "key" (those sent with the
    # same API key), "request" (none: no prompt reuses another's). Other than shared, /slots shows
    # nothing of the requests themselves.
    cache_isolation: str = "shared"
    served_model_name: str | None = None
    ctx_size: int | None = None
    debug_hooks: bool = False
    max_body_mb: float = 32.0
    dtype: torch.dtype = torch.float32
    # The KV cache's storage types (keys, values); None: the compute dtype. `bubo serve` passes float16.
    cache_dtypes: tuple[torch.dtype, torch.dtype] | None = None
    device: str = "cpu"
    threads: int | None = None
    defaults: SamplingParams = field(default_factory=SamplingParams)
    snapshots: SnapshotPolicy = field(default_factory=SnapshotPolicy)
    parallel: int = 1
    kv_tokens: int | None = None
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none: no CORS
    shutdown_grace: float = 10.0  # seconds requests in flight get to finish after SIGTERM
    # Connections (bubo/server/connections.py): seconds a stream may go without the client taking any of
    # it before it is cut, a request head may take to arrive once begun, and a connection may sit idle
    # between requests; how many connections are held at once (None: what the open-files limit allows).
    stream_stall_timeout: float = 30.0
    header_timeout: float = 10.0
    idle_timeout: float = 15.0
    max_connections: int | None = None
    # Speculative decoding (bubo.engine.drafters.drafter_for): the drafter (None: the MTP block when the
    # model has one), tokens drafted per round (0: off; None: the drafter's default), the n-gram size of
    # ngram-simple, and the checkpoint to take an MTP block from.
    spec_type: str | None = None
    spec_draft: int | None = None
    spec_ngram_size: int = DEFAULT_NGRAM_SIZE
    mtp_weights: Path | None = None
    # The vision tower (a projector GGUF, like llama.cpp's --mmproj, or a checkpoint's vision weights);
    # without one, image parts are refused. http(s) image URLs are fetched only when allowed.
    mmproj: Path | None = None
    allow_image_urls: bool = False
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    # Rank 0's place in the group the model is split over (bubo/server/tensor_parallel.py); None: whole.
    tensor_parallel: TensorParallel | None = None
