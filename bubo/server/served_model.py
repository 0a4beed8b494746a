"""The model a server serves, through its life: the file checked before the port opens (`preflight`),
loaded in a background thread (`load`) or attached as given (`attach`), its slots, chat template and
memory guard set up, and whether it can take requests now (`require_ready`: 503 while loading or once
the accelerator is lost)."""

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bubo.engine.chat_prompt import ChatPrompter, chat_template
from bubo.engine.compute_threads import use_one_thread
from bubo.engine.drafters import check_mtp_block, drafter_for, prepare_drafting
from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.runner import runner_for
from bubo.engine.slot_pool import SlotPool
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.load_progress import LoadProgress
from bubo.model.mtp_weights import check_mtp_file, load_mtp_weights
from bubo.server.errors import ApiError
from bubo.server.image_fetch import Lookup, system_lookup
from bubo.server.image_prompt import check_mmproj
from bubo.server.memory_guard import (
    MemoryGuard,
    MemoryProbe,
    SystemMemoryProbe,
    kv_bytes_per_position,
    request_cost,
)
from bubo.server.settings import SERVED_ALIAS, ServerSettings, model_id_from_path
from bubo.server.shutdown import StreamCutoff
from bubo.templates.chat_template import ChatTemplate

__all__ = ["ServedModel"]

log = logging.getLogger("bubo.server")


class ServedModel:
    """The model, its vision tower, slots, chat template and memory guard once loaded. The model loads
    in a background thread so the port opens at once."""

    def __init__(self, settings: ServerSettings, memory_probe: MemoryProbe | None = None) -> None:
        self.settings = settings
        self.created = int(time.time())
        self.model_id = settings.served_model_name or model_id_from_path(settings.model_path)
        self.context_length: int | None = None
        # The most threads the model's steps run on. Not the asking thread's torch.get_num_threads(): the
        # threads beside the model's keep their torch ops on one (bubo/engine/compute_threads.py).
        self.model_threads = settings.threads or torch.get_num_threads()
        self.loaded: LoadedModel | None = None
        self.tower: Any = None  # bubo.vision.tower.VisionTower, with --mmproj
        # How image URLs' hosts are resolved (tests give their own).
        self.image_lookup: Lookup = system_lookup
        self.slots: SlotPool | None = None
        self.template: ChatTemplate | None = None
        self.prompter: ChatPrompter | None = None
        self.guard: MemoryGuard | None = None
        self.load_error: BaseException | None = None
        self._memory_probe = memory_probe
        self._ready = threading.Event()
        self.cutoff = StreamCutoff()
        # One thread for big prompts and for grammars, so at most one core tokenizes or compiles while the
        # model decodes on the rest. Rendering, tokenizing and compiling use no torch; should that change,
        # the thread keeps torch's ops on one OpenMP thread (see compute_threads).
        self._prompt_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="bubo-prompt", initializer=use_one_thread
        )

    # Loading

    def preflight(self) -> None:
        """Read the file's header and config (fast): a bad path or an unsupported file fails here, before
        the port opens, with GGUFError / UnsupportedArchitectureError / OSError."""
        path = self.settings.model_path
        if not path.is_file():
            raise FileNotFoundError(
                f"model file not found: {path}" if not path.exists() else f"not a file: {path}"
            )
        with GGUFFile(path) as file:
            config = config_from_gguf(file)
        self.context_length = self._n_ctx(config.context_length)
        if self.settings.mtp_weights is not None:
            check_mtp_file(config, self.settings.mtp_weights)
        else:
            check_mtp_block(self.settings.spec_type, self.settings.spec_draft, bool(config.mtp_layers))
        if self.settings.mmproj is not None:
            check_mmproj(self.settings.mmproj)

    def _n_ctx(self, trained: int) -> int:
        return min(self.settings.ctx_size or trained, trained)

    def load(self) -> None:
        """Load the model (blocking; run it in a thread). Failures are kept in `load_error`."""
        try:
            if self.settings.threads:
                torch.set_num_threads(self.settings.threads)
            loaded = load_model(
                self.settings.model_path,
                dtype=self.settings.dtype,
                device=self.settings.device,
                cache_dtypes=self.settings.cache_dtypes,
                progress=LoadProgress(bar=sys.stderr.isatty()),
                tensor_parallel=self.settings.tensor_parallel,
            )
            if self.settings.mtp_weights is not None:
                load_mtp_weights(loaded.model, self.settings.mtp_weights)
            for line in runner_for(loaded.model).plan.lines():
                log.info("%s", line)
            tower = None
            if self.settings.mmproj is not None:
                # Imported here: only a server with a vision tower needs the vision package.
                from bubo.vision.loader import check_tower_fits, load_vision_tower

                tower = load_vision_tower(
                    self.settings.mmproj, dtype=self.settings.dtype, device=loaded.model.device
                )
                check_tower_fits(tower, loaded.config)
            self.attach(loaded, tower)
        except BaseException as error:
            self.load_error = error
            raise

    def attach(self, loaded: LoadedModel, tower: Any = None) -> None:
        """Serve an already loaded model, and its vision tower if any (the tests' shortcut past `load`)."""
        config = loaded.config
        n_ctx = self._n_ctx(config.context_length)
        self.context_length = n_ctx
        tokenizer = loaded.tokenizer
        self.template = chat_template(loaded)
        self.prompter = ChatPrompter(self.template, tokenizer, config.vocab_size, vision=tower is not None)
        settings = self.settings
        # With several slots their decode steps run as one batch; a verify pass of several tokens can't
        # join it, so speculation is on by default (no --spec-type, no --spec-draft) only with one slot.
        spec_draft = settings.spec_draft
        if spec_draft is None and settings.spec_type is None and settings.parallel > 1:
            spec_draft = 0
        self.slots = SlotPool(
            loaded.model,
            tokenizer,
            n_ctx,
            settings.parallel,
            settings.snapshots,
            settings.kv_tokens,
            new_drafter=lambda: drafter_for(
                loaded.model, settings.spec_type, spec_draft, settings.spec_ngram_size
            ),
            vision=tower,
        )
        if self.slots.batcher is None:
            # (Batched slots' verify passes run eagerly, through the batcher: nothing to compile.)
            prepare_drafting(loaded.model, self.slots.slots[0].drafter)
        # KV bytes per position as the pool stores them (its key and value types); without a pool (a
        # stand-in model) as the compute dtype would.
        pool = self.slots.pool
        self.guard = MemoryGuard(
            self._memory_probe or SystemMemoryProbe(loaded.model.device),
            request_cost(
                config,
                pool.bytes_per_position
                if pool is not None
                else kv_bytes_per_position(config, settings.dtype),
            ),
        )
        self.tower = tower
        self.loaded = loaded
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def device_lost(self) -> bool:
        return self.slots is not None and self.slots.device_lost

    @property
    def served_ids(self) -> list[str]:
        return [self.model_id] if self.model_id == SERVED_ALIAS else [self.model_id, SERVED_ALIAS]

    def require_ready(self) -> LoadedModel:
        if self.device_lost:
            raise ApiError(
                503,
                "device_lost",
                "the accelerator was lost; restart the server",
                top_level={"status": "device_lost"},
            )
        if self.loaded is None or self.slots is None:
            raise ApiError(503, "not_ready", "the model is still loading", headers={"Retry-After": "5"})
        return self.loaded

    @property
    def n_ctx(self) -> int:
        assert self.slots is not None
        return self.slots.n_ctx

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every key the server takes (none without --api-key)."""
        key = self.settings.api_key
        return () if key is None else (key, *self.settings.more_api_keys)

    def resolve_model(self, name: Any, *, required: bool = True) -> str:
        """The name to echo back; 400 missing_model without one (where required), 404 for another model."""
        if name is None or name == "":
            if required:
                raise ApiError(
                    400,
                    "missing_model",
                    "model is required: use " + " or ".join(repr(i) for i in self.served_ids),
                    param="model",
                )
            return self.model_id
        if not isinstance(name, str):
            raise ApiError(400, "invalid_value", "model: must be a string", param="model")
        if name not in self.served_ids:
            raise ApiError(
                404,
                "model_not_found",
                f"model '{name}' is not served by this process; it serves '{self.model_id}' (also as 'bubo')",
                param="model",
            )
        return name
