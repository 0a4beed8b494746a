"""The steps every dialect takes between validating a body and formatting the answer: turning a prompt
or a chat into a generation request (rendered and tokenized, its grammar compiled, its images fetched
and placed, the context and the memory guard checked) and running it on a slot. Chat preparation itself
is the library's (bubo/engine/chat_prompt.py), shared with `Model.chat`; what is the server's alone is
here: work off the event loop, image fetching, the memory guard, request ids, cache isolation and
cutting streams off at shutdown."""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from functools import partial
from typing import Any, TypeVar

from bubo.engine.chat_messages import text_only
from bubo.engine.chat_prompt import ImagePlacer, PreparedChat, RenderedPrompt, prompt_tokens
from bubo.engine.chat_request import ChatRequest
from bubo.engine.grammar import GrammarMatcher
from bubo.engine.output_format import OutputConstraint
from bubo.engine.output_grammar import GrammarCompiler, request_constraints
from bubo.engine.prompt_images import PromptImage
from bubo.engine.request import Finished, GenerationRequest, OutputEvent, check_prompt_fits
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot import DeviceLostError
from bubo.model.block_pool import BlockPool, KVPoolExhaustedError
from bubo.server.errors import ApiError, bad_field
from bubo.server.image_input import DecodedImage
from bubo.server.image_prompt import IMAGE_PAD, ImageFit, load_images, place_images
from bubo.server.memory_guard import vision_bytes
from bubo.server.request_context import CURRENT_API_KEY, CURRENT_REQUEST_ID, new_id
from bubo.server.request_tokens import record_usage
from bubo.server.served_model import ServedModel
from bubo.templates.tool_calls import ToolCallParser

__all__ = ["INLINE_PROMPT_BYTES", "ServerState"]

log = logging.getLogger("bubo.server")

# Request bodies up to this size have their prompt rendered and tokenized on the event loop. 8 KiB of
# text tokenizes in ~2.5 ms (SmolLM2's vocabulary, 2 cores), a stall no other connection notices; a hop
# to the prompt thread costs ~60 µs idle and more on a busy machine, and ordinary requests must not
# queue behind a huge one there. Past it the stall grows with the prompt: 1.7 s for 2.3 MB of prose.
INLINE_PROMPT_BYTES = 8 << 10

_T = TypeVar("_T")


class ServerState(ServedModel):
    """Shared by every handler: the served model (bubo/server/served_model.py) and the steps below."""

    async def prompt_work(self, size: int, work: Callable[..., _T], *args: Any) -> _T:
        """`work(*args)` (rendering, tokenizing) for a request body of `size` bytes: on the event loop
        up to INLINE_PROMPT_BYTES, else on the prompt thread so that the loop keeps serving every other
        connection meanwhile. Its errors (ApiError, RequestError) are raised here either way."""
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
        return prompt_tokens(self.require_ready().tokenizer, text, parse_special=parse_special)

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
        assert self.prompter is not None
        return self.prompter.render(chat)

    async def chat_generation(
        self,
        chat: ChatRequest,
        params: SamplingParams,
        *,
        size: int,
        logprobs: int | None = None,
        constraint: OutputConstraint | None = None,
        cache_prompt: bool = True,
        images: Sequence[DecodedImage] = (),
    ) -> GenerationRequest:
        """A chat's generation request, prepared as the library prepares one (ChatPrompter.prepare): its
        prompt, its reasoning budget, the tool-call parser when tools are offered (and the grammar that
        forces a call for tool_choice "required" or a named tool), or the grammar of the output
        `constraint` the body asked for. `size` is the request body's (`prompt_work`); `images` are the
        chat's images (`load_images`). A grammar compiles on the prompt thread whatever the body's size:
        its cost follows the grammar, and on the event loop it would stall every stream."""
        assert len(images) == len(chat.images), "the chat's images come from load_images"
        self.require_ready()
        assert self.prompter is not None
        work = partial(self.prompter.prepare, chat, constraint, self._image_placer(chat, images))
        prepared: PreparedChat = await (
            self._off_loop(work)
            if self.prompter.compiles_grammar(chat, constraint)
            else self.prompt_work(size, work)
        )
        prompt = prepared.prompt
        return self.request(
            prompt.text,
            prompt.ids,
            params,
            reasoning=prompt.reasoning,
            in_reasoning=prompt.in_reasoning,
            logprobs=logprobs,
            reasoning_budget=prepared.reasoning_budget,
            grammar=prepared.grammar,
            tool_parser=prepared.tool_parser,
            cache_prompt=cache_prompt,
            images=prompt.images,
        )

    def render_prompt(
        self, chat: ChatRequest, images: Sequence[DecodedImage] | None = None
    ) -> RenderedPrompt:
        """The chat's prompt text and tokens. With `images` (the chat's images, decoded), each image's
        pad token is repeated once per token the vision tower gives it; without, an image is the one pad
        token the template wrote (what /apply-template and /debug/prompt show)."""
        self.require_ready()
        assert self.prompter is not None
        return self.prompter.prompt(chat, self._image_placer(chat, images))

    def _image_placer(self, chat: ChatRequest, images: Sequence[DecodedImage] | None) -> ImagePlacer | None:
        """How the chat's decoded `images` go into its tokens; None where it has none to place."""
        if images is None or not chat.images:
            return None
        pad = self.require_ready().tokenizer.token_to_id(IMAGE_PAD)
        return lambda ids: place_images(ids, pad, images, self.tower)

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
        image_tokens = sum(image.tokens for image in images)
        if images and len(prompt_ids) >= self.n_ctx and len(prompt_ids) - image_tokens < self.n_ctx:
            # The text alone would fit: the images are what never can.
            raise ApiError(
                507,
                "insufficient_memory_permanent",
                f"the prompt has {len(prompt_ids)} tokens, {image_tokens} of them for its {len(images)} "
                f"images, but the context holds {self.n_ctx}; send fewer or smaller images",
            )
        check_prompt_fits(prompt_ids, self.n_ctx)

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
        grammar (from `compile_constraint` or a chat's preparation) become the request's
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
        constraints = request_constraints(
            loaded.tokenizer,
            reasoning=reasoning,
            in_reasoning=in_reasoning,
            budget=reasoning_budget,
            grammar=grammar,
        )
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
            constraints,
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

    async def compile_constraint(self, constraint: OutputConstraint | None) -> GrammarMatcher | None:
        """The matcher of an output constraint (None for none), compiled on the prompt thread: its cost
        follows the grammar, not the body. 400 invalid_schema or invalid_grammar saying what is wrong."""
        if constraint is None:
            return None
        return await self._off_loop(partial(self._grammars().constraint, constraint))

    def _grammars(self) -> GrammarCompiler:
        self.require_ready()
        assert self.prompter is not None
        return self.prompter.grammars

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
