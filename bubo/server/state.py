"""What the server knows: its settings, the model once loaded, the slots, and the shared steps every
dialect takes between validating a body and formatting the answer (model name resolution, rendering
a chat, tokenizing, the memory guard, running on the slot)."""

import asyncio
import logging
import re
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from bubo.engine.compute_threads import use_one_thread
from bubo.engine.constraints import GrammarConstraint, ReasoningBudget, ReasoningTracker
from bubo.engine.drafters import check_mtp_block, drafter_for, prepare_drafting
from bubo.engine.generate import TokenConstraint
from bubo.engine.grammar import GrammarError, GrammarMatcher, gbnf_grammar, json_schema_grammar, lark_grammar
from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.ngram_drafter import DEFAULT_NGRAM_SIZE
from bubo.engine.prompt_cache import SnapshotPolicy
from bubo.engine.prompt_images import PromptImage
from bubo.engine.request import Finished, GenerationRequest, OutputEvent
from bubo.engine.runner import runner_for
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot import DeviceLostError
from bubo.engine.slot_pool import SlotPool
from bubo.engine.tool_grammar import tool_call_grammar
from bubo.gguf.config import config_from_gguf
from bubo.gguf.reader import GGUFFile
from bubo.model.block_pool import BlockPool, KVPoolExhaustedError
from bubo.model.load_progress import LoadProgress
from bubo.model.mtp_weights import check_mtp_file, load_mtp_weights
from bubo.model.tensor_parallel import TensorParallel
from bubo.server.chat import ChatRequest, without_image_sources
from bubo.server.errors import ApiError, bad_field
from bubo.server.image_fetch import Lookup, system_lookup
from bubo.server.image_input import DecodedImage, ImageLimits
from bubo.server.image_prompt import (
    IMAGE_PAD,
    ImageFit,
    check_mmproj,
    load_images,
    place_images,
    text_only,
)
from bubo.server.memory_guard import (
    MemoryGuard,
    MemoryProbe,
    SystemMemoryProbe,
    kv_bytes_per_position,
    request_cost,
    vision_bytes,
)
from bubo.server.request_tokens import record_usage
from bubo.server.shutdown import StreamCutoff
from bubo.templates.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ConversationTooLargeError,
    TemplateSandboxError,
)
from bubo.templates.tool_calls import ToolCallParser, tool_call_format
from bubo.templates.tool_prompt import with_tools_in_messages

__all__ = [
    "CACHE_ISOLATION",
    "CURRENT_API_KEY",
    "CURRENT_REQUEST_ID",
    "INLINE_PROMPT_BYTES",
    "RenderedPrompt",
    "ServerSettings",
    "ServerState",
    "model_id_from_path",
    "new_id",
]

log = logging.getLogger("bubo.server")

SERVED_ALIAS = "bubo"
# The HTTP request's id (x-request-id), set by the app's error middleware for the request's task, so a
# failure deep in generation is reported under the id the client sees.
CURRENT_REQUEST_ID: ContextVar[str | None] = ContextVar("bubo_request_id", default=None)
# Which of the API keys the request came with (its index), set by the app's key check.
CURRENT_API_KEY: ContextVar[int | None] = ContextVar("bubo_api_key", default=None)
CACHE_ISOLATION = ("shared", "key", "request")
# Request bodies up to this size have their prompt rendered and tokenized on the event loop. 8 KiB of
# text tokenizes in ~2.5 ms (SmolLM2's vocabulary, 2 cores), a stall no other connection notices; a hop
# to the prompt thread costs ~60 µs idle and more on a busy machine, and ordinary requests must not
# queue behind a huge one there. Past it the stall grows with the prompt: 1.7 s for 2.3 MB of prose.
INLINE_PROMPT_BYTES = 8 << 10

_T = TypeVar("_T")


def model_id_from_path(path: Path) -> str:
    """The served id for a file: its name lowercased, a dot inside a version number dropped, other
    separators as dashes (Huihui-Qwen3.8-Flash-Next-UD-Q4_K_XL-v1.gguf -> huihui-qwen38-flash-next-ud-q4-k-xl-v1)."""
    name = re.sub(r"(?<=\d)\.(?=\d)", "", path.stem.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "model"


def new_id(prefix: str) -> str:
    """An id like OpenAI's: prefix plus 24 random lowercase letters and digits."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return prefix + "".join(secrets.choice(alphabet) for _ in range(24))


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


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat rendered by the template: the text, its tokens, and where reasoning stands at its end."""

    text: str
    ids: list[int]
    reasoning: bool
    in_reasoning: bool
    images: tuple[PromptImage, ...] = ()


class ServerState:
    """Shared by every handler. The model loads in a background thread so the port opens at once."""

    def __init__(self, settings: ServerSettings, memory_probe: MemoryProbe | None = None) -> None:
        self.settings = settings
        self.created = int(time.time())
        self.model_id = settings.served_model_name or model_id_from_path(settings.model_path)
        self.context_length: int | None = None
        self.loaded: LoadedModel | None = None
        self.tower: Any = None  # bubo.vision.tower.VisionTower, with --mmproj
        # How image URLs' hosts are resolved (tests give their own).
        self.image_lookup: Lookup = system_lookup
        self.slots: SlotPool | None = None
        self.template: ChatTemplate | None = None
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
        special = {
            name: tokenizer.decode([token_id])
            for name, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))
            if token_id is not None
        }
        source = loaded.file.metadata.get("tokenizer.chat_template")
        try:
            template = (
                ChatTemplate(source, special) if isinstance(source, str) else ChatTemplate.fallback(special)
            )
        except ChatTemplateError as error:
            log.warning("%s; using the ChatML fallback", error)
            template = ChatTemplate.fallback(special)
        self.template = template
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

    # The shared steps

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

    @property
    def n_ctx(self) -> int:
        assert self.slots is not None
        return self.slots.n_ctx

    async def prompt_work(self, size: int, work: Callable[..., _T], *args: Any) -> _T:
        """`work(*args)` (rendering, tokenizing) for a request body of `size` bytes: on the event loop
        up to INLINE_PROMPT_BYTES, else on the prompt thread so that the loop keeps serving every other
        connection meanwhile. Its errors (ApiError included) are raised here either way."""
        if size <= INLINE_PROMPT_BYTES:
            return work(*args)
        return await self._off_loop(work, *args)

    async def _off_loop(self, work: Callable[..., _T], *args: Any) -> _T:
        # A client that leaves while this waits for the thread cancels the work before it starts; once
        # started, it runs to its end and its result is dropped.
        return await asyncio.get_running_loop().run_in_executor(self._prompt_thread, work, *args)

    def tokenize(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Prompt tokens; BOS as the file says, unless the text already starts with it (templates
        that write `bos_token` themselves would otherwise get two)."""
        loaded = self.require_ready()
        tokenizer = loaded.tokenizer
        ids = tokenizer.encode(text, parse_special=parse_special)
        bos = tokenizer.bos_id
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def completion_prompt(self, prompt: Any) -> tuple[str, list[int]]:
        """A completion's `prompt` field: a string, an array of token ids, an array mixing token ids and
        strings (llama-server's mixed prompt: one prompt, its strings tokenized in place, BOS only before
        a string that comes first), or a one-element array of one of these. Several prompts (an array of
        strings or arrays) would be several choices, which only n=1 allows."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, list) and any(_is_token_id(t) for t in prompt):
            tokenizer = self.require_ready().tokenizer
            ids: list[int] = []
            for i, piece in enumerate(prompt):
                if isinstance(piece, str):
                    ids += self.tokenize(piece) if i == 0 else tokenizer.encode(piece, add_bos=False)
                elif _is_token_id(piece) and 0 <= piece < tokenizer.vocab_size:
                    ids.append(piece)
                else:
                    raise bad_field("prompt", f"token ids must be integers in [0, {tokenizer.vocab_size})")
            return tokenizer.decode(ids), ids
        if isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError(
                400,
                "unsupported_n",
                "prompt: one prompt per request (several would be n > 1)",
                param="prompt",
            )
        raise bad_field("prompt", "is required: a string, or an array of token ids")

    def render(self, chat: ChatRequest) -> str:
        """The prompt text of a chat, exactly as generation uses it."""
        self.require_ready()
        assert self.template is not None
        kwargs = dict(chat.template_kwargs)
        if chat.thinking.enabled is not None:
            kwargs["enable_thinking"] = chat.thinking.enabled
        if chat.thinking.effort is not None:
            kwargs["reasoning_effort"] = chat.thinking.effort
        tools = chat.tools if chat.tool_choice.mode != "none" else None
        images = chat.images
        if images and self.tower is None:
            raise text_only(images[0])
        messages = without_image_sources(chat.messages) if images else chat.messages
        uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if uses_tools and not self.template.supports_tools:
            messages, tools = with_tools_in_messages(messages, tools), None
        prefill = _prefill(chat.messages)
        try:
            text = self.template.render(
                messages,
                tools=tools,
                add_generation_prompt=chat.add_generation_prompt and prefill is None,
                **kwargs,
            )
        except ConversationTooLargeError as error:
            raise ApiError(400, "context_length_exceeded", str(error)) from None
        except TemplateSandboxError as error:
            # The model file's template is at fault, not the request.
            log.error("the chat template was stopped: %s", error)
            raise ApiError(500, "template_error", f"the model's chat template was stopped: {error}") from None
        except ChatTemplateError as error:
            raise ApiError(400, "template_error", str(error)) from None
        if prefill is None:
            return text
        # The template closes the final turn; the answer continues its text instead (transformers'
        # continue_final_message: cut after the last place the text appears).
        end = text.rfind(prefill)
        if end < 0:
            raise bad_field(
                f"messages[{len(chat.messages) - 1}].content",
                "is a final assistant message to continue, but the chat template does not write it as given",
            )
        return text[: end + len(prefill)]

    async def chat_generation(
        self,
        chat: ChatRequest,
        params: SamplingParams,
        *,
        size: int,
        logprobs: int | None = None,
        schema: Mapping[str, Any] | None = None,
        schema_field: str = "response_format",
        gbnf: str | None = None,
        cache_prompt: bool = True,
        images: Sequence[DecodedImage] = (),
    ) -> GenerationRequest:
        """A chat's generation request: its prompt, its reasoning budget, the tool-call parser when tools
        are offered (and the grammar that forces a call for tool_choice "required" or a named tool), or
        the grammar of a JSON schema answer or of a GBNF grammar (`gbnf`), which the body's
        `schema_field` asked for. `size` is the request body's (`prompt_work`); `images` are the chat's
        images (`load_images`)."""
        assert len(images) == len(chat.images), "the chat's images come from load_images"
        prompt = await self.prompt_work(size, self.render_prompt, chat, images)
        assert self.template is not None
        choice = chat.tool_choice
        parser, grammar = None, None
        if chat.tools and choice.mode != "none":
            fmt = tool_call_format(self.template.source if self.template.supports_tools else "")
            parser = ToolCallParser(fmt, chat.tools, parallel=choice.parallel)
            if choice.forced and (schema is not None or gbnf is not None):
                raise ApiError(
                    400,
                    "conflicting_fields",
                    f"{schema_field}: a constrained answer and a forced tool call cannot both be asked for",
                    param=schema_field,
                )
            if choice.forced:
                try:
                    grammar = await self._compile(
                        lambda: lark_grammar(
                            tool_call_grammar(fmt, chat.tools, name=choice.name, parallel=choice.parallel)
                        )
                    )
                except GrammarError as error:
                    # The forcing grammar embeds each tool's parameters schema: a broken one is the
                    # request's fault, as it is in response_format.
                    raise ApiError(
                        400,
                        "invalid_schema",
                        f"tools: a tool's parameters schema is not usable: {error}",
                        param="tools",
                    ) from None
        if schema is not None:
            grammar = await self.compile_schema(schema, schema_field)
        elif gbnf is not None:
            grammar = await self.compile_gbnf(gbnf, schema_field)
        return self.request(
            prompt.text,
            prompt.ids,
            params,
            reasoning=prompt.reasoning,
            in_reasoning=prompt.in_reasoning,
            logprobs=logprobs,
            reasoning_budget=chat.thinking.budget,
            grammar=grammar,
            tool_parser=parser,
            cache_prompt=cache_prompt,
            images=prompt.images,
        )

    def render_prompt(
        self, chat: ChatRequest, images: Sequence[DecodedImage] | None = None
    ) -> RenderedPrompt:
        """The chat's prompt text and tokens. With `images` (the chat's images, decoded), each image's
        pad token is repeated once per token the vision tower gives it; without, an image is the one pad
        token the template wrote (what /apply-template and /debug/prompt show)."""
        text = self.render(chat)
        assert self.template is not None
        thinking = self.template.supports_thinking and chat.thinking.enabled is not False
        opened = text.rstrip().endswith("<think>")
        ids = self.tokenize(text)
        placed: tuple[PromptImage, ...] = ()
        if images is not None and chat.images:
            pad = self.require_ready().tokenizer.token_to_id(IMAGE_PAD)
            ids, placed = place_images(ids, pad, images, self.tower)
        return RenderedPrompt(text, ids, reasoning=thinking or opened, in_reasoning=opened, images=placed)

    async def load_images(self, chat: ChatRequest) -> list[DecodedImage]:
        """The chat's images, fetched (http(s) URLs, with --allow-image-urls) and decoded off the event
        loop; 400 for a text-only model, a refused URL, a corrupt or oversized image."""
        parts = chat.images
        if not parts:
            return []
        self.require_ready()
        if self.tower is None:
            raise text_only(parts[0])
        settings = self.settings
        return await load_images(
            parts,
            settings.image_limits,
            allow_urls=settings.allow_image_urls,
            lookup=self.image_lookup,
            fit=ImageFit(self._image_target, self._check_images),
        )

    def _image_target(self, width: int, height: int) -> tuple[int, int]:
        """The size the vision tower takes an upright image of this size at (its patch grid's)."""
        _, grid_h, grid_w = self.tower.grid_for_size(width, height)
        patch = self.tower.config.patch_size
        return grid_w * patch, grid_h * patch

    def _check_images(self, sizes: Sequence[tuple[int, int]]) -> None:
        """Images (upright sizes, from their headers) whose tokens alone fill the context, or whose
        decoding and encoding the memory guard refuses: 507 / 503 before any is decoded."""
        grids = [tuple(self.tower.grid_for_size(width, height)) for width, height in sizes]
        tokens = sum(self.tower.token_count(grid) for grid in grids)
        if tokens >= self.n_ctx:
            raise ApiError(
                507,
                "insufficient_memory_permanent",
                f"the {len(sizes)} images take {tokens} tokens but the context holds {self.n_ctx}; "
                "send fewer or smaller images",
            )
        # One image decoded at a time (its pixels and their RGB copy, 4 bytes each at most), the
        # scaled-down images kept, and the tower's encoding.
        decoding = max(w * h for w, h in sizes) * 8 + sum(
            w * h * 3 for w, h in (self._image_target(*size) for size in sizes)
        )
        assert self.guard is not None and self.slots is not None
        pool = self.slots.pool
        positions = tokens if pool is None else _uncommitted_positions(pool, tokens)
        self.guard.check(tokens, positions, decoding + vision_bytes(self.tower.config, grids))

    def check_context(self, prompt_ids: list[int], images: Sequence[PromptImage] = ()) -> None:
        if not prompt_ids:
            raise ApiError(
                400, "empty_prompt", "the prompt is empty: give at least one token", param="prompt"
            )
        image_tokens = sum(image.tokens for image in images)
        if images and len(prompt_ids) >= self.n_ctx and len(prompt_ids) - image_tokens < self.n_ctx:
            # The text alone would fit: the images are what never can.
            raise ApiError(
                507,
                "insufficient_memory_permanent",
                f"the prompt has {len(prompt_ids)} tokens, {image_tokens} of them for its {len(images)} "
                f"images, but the context holds {self.n_ctx}; send fewer or smaller images",
            )
        if len(prompt_ids) >= self.n_ctx:
            raise ApiError(
                400,
                "context_length_exceeded",
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.n_ctx} "
                "(prompt plus at least one generated token); shorten the prompt",
                # llama-server's numbers, for clients that size the prompt from them.
                details={"n_prompt_tokens": len(prompt_ids), "n_ctx": self.n_ctx},
            )

    def request(
        self,
        prompt: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        reasoning: bool = False,
        in_reasoning: bool = False,
        logprobs: int | None = None,
        reasoning_budget: int | None = None,
        grammar: GrammarMatcher | None = None,
        tool_parser: ToolCallParser | None = None,
        cache_prompt: bool = True,
        images: tuple[PromptImage, ...] = (),
        prompt_logprobs: int | None = None,
    ) -> GenerationRequest:
        """The neutral request, after the context check and the memory guard. A reasoning budget and a
        grammar (from `compile_schema`, `compile_gbnf` or a tool-call grammar) become the request's
        constraints."""
        loaded = self.require_ready()
        self.check_context(prompt_ids, images)
        assert self.guard is not None and self.slots is not None
        limit = params.token_limit
        total = min(len(prompt_ids) + (self.n_ctx if limit is None else limit), self.n_ctx)
        encoding = vision_bytes(self.tower.config, [image.grid for image in images]) if images else 0
        pool = self.slots.pool
        self.guard.check(
            len(prompt_ids), total if pool is None else _uncommitted_positions(pool, total), encoding
        )
        if pool is not None:
            self.guard.check_blocks(
                pool.blocks_for(len(prompt_ids)), self.slots.available_blocks, pool.num_blocks
            )
        tokenizer = loaded.tokenizer
        constraints: list[TokenConstraint] = []
        if reasoning and reasoning_budget is not None:
            tracker = ReasoningTracker(tokenizer, reasoning=reasoning, in_reasoning=in_reasoning)
            constraints.append(ReasoningBudget(tokenizer, reasoning_budget, tracker))
        if grammar is not None:
            tracker = ReasoningTracker(tokenizer, reasoning=reasoning, in_reasoning=in_reasoning)
            constraints.append(GrammarConstraint(grammar, tracker))
        request_id = CURRENT_REQUEST_ID.get() or new_id("req_")
        return GenerationRequest(
            # The HTTP request's id (x-request-id, echoed to the client): what /slots and the logs name.
            request_id,
            prompt,
            prompt_ids,
            params,
            reasoning,
            in_reasoning,
            logprobs,
            tuple(constraints),
            tool_parser,
            cache_prompt,
            images,
            self._cache_scope(request_id),
            prompt_logprobs=prompt_logprobs,
        )

    def _cache_scope(self, request_id: str) -> Any:
        """The prompt cache scope of a request (GenerationRequest.cache_scope) under --cache-isolation."""
        isolation = self.settings.cache_isolation
        if isolation == "key":
            return ("key", CURRENT_API_KEY.get())
        if isolation == "request":
            return ("request", request_id)
        return None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every key the server takes (none without --api-key)."""
        key = self.settings.api_key
        return () if key is None else (key, *self.settings.more_api_keys)

    async def compile_gbnf(self, source: str, field_name: str = "grammar") -> GrammarMatcher:
        """A matcher for a GBNF grammar (llama-server's `grammar`); 400 invalid_grammar saying what is
        wrong."""
        try:
            return await self._compile(partial(gbnf_grammar, source))
        except GrammarError as error:
            raise ApiError(400, "invalid_grammar", f"{field_name}: {error}", param=field_name) from None

    async def compile_schema(self, schema: Mapping[str, Any], field_name: str) -> GrammarMatcher:
        """A matcher for JSON valid against `schema`; 400 invalid_schema saying what is wrong."""
        try:
            return await self._compile(partial(json_schema_grammar, schema))
        except GrammarError as error:
            raise ApiError(
                400,
                "invalid_schema",
                f"{field_name}: the JSON schema is not usable: {error}",
                param=field_name,
            ) from None

    async def _compile(self, grammar: Callable[[], str]) -> GrammarMatcher:
        """A matcher for the grammar `grammar()` writes, compiled on the prompt thread: its cost does not
        follow the body's size (a 26 KB GBNF of 1000 chained rules takes 1.1 s, 3000 optional properties
        in 89 KB 1.8 s, the first grammar 0.3 s more for the vocabulary's token trie), and on the event
        loop that long stalls every stream and health check. llguidance releases the GIL as it compiles:
        the loop meanwhile waits 15 ms at most. GrammarError when it does not compile."""
        loaded = self.require_ready()
        return await self._off_loop(
            lambda: GrammarMatcher(grammar(), loaded.tokenizer, loaded.config.vocab_size)
        )

    async def stream(self, request: GenerationRequest) -> AsyncIterator[OutputEvent]:
        """Run on a slot; closing this iterator (a client gone) stops the generation. Any failure is an
        ApiError, so a stream that has started ends with an error event in its dialect's shape."""
        self.require_ready()
        assert self.slots is not None
        try:
            async with aclosing(self.slots.run(request)) as events:
                while (event := await self.cutoff.next(events)) is not None:
                    if isinstance(event, Finished):
                        record_usage(event.usage)
                    yield event
        except KVPoolExhaustedError as error:
            raise ApiError(
                503, "insufficient_memory", f"{error}; send the request again", headers={"Retry-After": "5"}
            ) from None
        except DeviceLostError as error:
            raise ApiError(
                503, "device_lost", f"the accelerator was lost: {error}", top_level={"status": "device_lost"}
            ) from None
        except ApiError:
            raise
        except Exception:
            request_id = CURRENT_REQUEST_ID.get() or request.request_id
            log.exception("request %s failed during generation", request_id)
            raise ApiError(
                500, "internal_error", f"internal server error (request id {request_id})"
            ) from None

    async def complete(self, request: GenerationRequest) -> Finished:
        async with aclosing(self.stream(request)) as events:
            async for event in events:
                if isinstance(event, Finished):
                    return event
        raise RuntimeError("the generation ended without a result")


def _uncommitted_positions(pool: BlockPool, positions: int) -> int:
    """Of the KV memory that `positions` positions of a request can take, what is not committed yet.
    The slots' KV pool is allocated up front, so only a block never written before adds memory (on the
    CPU; on a GPU none does). Which blocks a request writes does not follow from what its prompt shares
    with a cache: a slot's rewritten positions reuse blocks, and another slot's take fresh ones."""
    return min(pool.blocks_for(positions), pool.uncommitted_blocks) * pool.block_size


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prefill(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The text of a final assistant message to continue, as Anthropic's Messages API and llama-server
    do with one (a prefill: the answer starts with it): a text answer without tool calls, stripped as
    templates strip it. None when the chat ends otherwise."""
    final = messages[-1] if messages else {}
    content = final.get("content")
    if final.get("role") != "assistant" or final.get("tool_calls") or not isinstance(content, str):
        return None
    return content.strip() or None
