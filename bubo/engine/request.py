"""The protocol-neutral request every API dialect builds, and the events every dialect formats.

A dialect adapter validates its body into a `GenerationRequest`; the slot runs it and answers with
`OutputDelta` pieces (reasoning or answer text) and one `Finished`. Nothing here knows about HTTP or
about any one API's field names.
"""

from collections.abc import Hashable
from dataclasses import dataclass, field

from bubo.engine.generate import GenerationResult, TokenLogprob
from bubo.engine.probes import ProbeSpec, TokenProbe
from bubo.engine.prompt_images import PromptImage, cache_key
from bubo.engine.request_error import RequestError
from bubo.engine.sampler import SamplingParams
from bubo.engine.token_choice import TokenConstraint
from bubo.templates.reasoning import Channel
from bubo.templates.tool_calls import ToolCall, ToolCallArguments, ToolCallEnd, ToolCallParser, ToolCallStart


@dataclass(frozen=True)
class GenerationRequest:
    """What to run: the prompt (text as rendered, and its token ids) and how to sample.

    `reasoning` says whether the output may hold a `<think>` block to split off; `in_reasoning`
    whether the prompt already opened it (the generation prompt ends in `<think>\\n`). `logprobs`
    (None: off) asks for each token's log probability and that many alternatives. `constraints`
    (a grammar, a reasoning budget) and `tool_parser` (which turns the answer's tool-call markup into
    tool-call events) belong to this one request: they keep state as it runs. `images` are the
    prompt's images, whose pad tokens `prompt_ids` holds (bubo/engine/prompt_images.py). `special` keeps
    the text of special tokens such as <|im_end|> in the output, which is otherwise dropped.
    `prompt_logprobs` (None: off) asks for each prompt token's log probability given the tokens before
    it, with that many alternatives (bubo/engine/prompt_logprobs.py). `probe` (None: off) asks for
    per-token captures of chosen layers once the generation is done (bubo/engine/probes.py).
    """

    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    reasoning: bool = False
    in_reasoning: bool = False
    logprobs: int | None = None
    constraints: tuple[TokenConstraint, ...] = ()
    tool_parser: ToolCallParser | None = None
    cache_prompt: bool = True
    images: tuple[PromptImage, ...] = ()
    # Whose cache this prompt may reuse: prompts of different scopes share no prefix (None: anyone's).
    cache_scope: Hashable | None = None
    special: bool = False  # keep the text of special tokens (`bubo generate --special`)
    # llama-server's stream extras: PromptProgress events while the prompt is computed, and the running
    # usage on every OutputDelta.
    return_progress: bool = False
    timings_per_token: bool = False
    prompt_logprobs: int | None = None
    probe: ProbeSpec | None = None

    @property
    def cache_key(self) -> list[Hashable]:
        """The prompt as the prompt cache and the slot choice compare it (images by their digest). With
        a scope, its first position carries the scope, so prompts of two scopes differ from the start."""
        key: list[Hashable] = (
            list(cache_key(self.prompt_ids, self.images)) if self.images else list(self.prompt_ids)
        )
        if self.cache_scope is not None and key:
            key[0] = (self.cache_scope, key[0])
        return key


def check_prompt_fits(prompt_ids: list[int], n_ctx: int) -> None:
    """RequestError unless the prompt has a token and leaves room in a context of `n_ctx` positions for
    at least one generated token."""
    if not prompt_ids:
        raise RequestError(
            "the prompt is empty: give at least one token", param="prompt", code="empty_prompt"
        )
    if len(prompt_ids) >= n_ctx:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens but the context holds {n_ctx} "
            "(prompt plus at least one generated token); shorten the prompt",
            code="context_length_exceeded",
            # llama-server's numbers, for clients that size the prompt from them.
            details={"n_prompt_tokens": len(prompt_ids), "n_ctx": n_ctx},
        )


@dataclass(frozen=True)
class OutputDelta:
    """A piece of reasoning or answer text, with the tokens that completed it (and their log
    probabilities), from the slot `slot_id`; `usage` is the request's usage so far, where it asked for
    it (`timings_per_token`)."""

    channel: Channel
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    slot_id: int = 0
    token_ids: tuple[int, ...] = ()
    usage: "Usage | None" = None


@dataclass(frozen=True)
class PromptProgress:
    """How far the prompt's computation is (llama-server's prompt_progress), sent where a request asked
    for it (`return_progress`): once before it starts (`processed` == `cached`), after each piece, and
    when it is done (`processed` == `total`)."""

    total: int
    cached: int
    processed: int
    elapsed_ms: float


@dataclass(frozen=True)
class CacheReport:
    """How the prompt cache served one request (the same values /debug/cache shows); the reasons are
    documented in bubo/engine/prompt_cache.py."""

    cache_hit: bool
    cached_tokens: int
    cache_miss_reason: str | None
    cache_snapshots: int = 0
    cache_snapshots_skipped: int = 0
    cache_diverged_at: int | None = None
    cache_history_rewritten: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "cache_hit": self.cache_hit,
            "cached_tokens": self.cached_tokens,
            "cache_miss_reason": self.cache_miss_reason,
            "cache_snapshots": self.cache_snapshots,
            "cache_snapshots_skipped": self.cache_snapshots_skipped,
            "cache_diverged_at": self.cache_diverged_at,
            "cache_history_rewritten": self.cache_history_rewritten,
        }


@dataclass(frozen=True)
class Usage:
    """Token counts and speeds of one request, in the neutral names each dialect maps from."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    prompt_ms: float
    predicted_ms: float
    draft_tokens: int = 0
    draft_accepted: int = 0
    cache: CacheReport = field(default_factory=lambda: CacheReport(False, 0, "empty"))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def prompt_per_second(self) -> float:
        return (
            (self.prompt_tokens - self.cached_tokens) / self.prompt_ms * 1000 if self.prompt_ms > 0 else 0.0
        )

    @property
    def decode_tokens(self) -> int:
        """The generated tokens after the first: the first one's time is the prompt's (time to first
        token), so the decode time covers only these."""
        return max(self.completion_tokens - 1, 0)

    @property
    def predicted_per_second(self) -> float:
        return self.decode_tokens / self.predicted_ms * 1000 if self.predicted_ms > 0 else 0.0


@dataclass(frozen=True)
class Finished:
    """The last event; `result` keeps the engine's detail."""

    result: GenerationResult
    usage: Usage
    reasoning_text: str
    content_text: str
    content_logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    slot_id: int = 0
    # The length of content_text before each call: the calls' places in the answer.
    tool_call_offsets: tuple[int, ...] = ()
    # The prompt's tokens after the first, each given those before it (when the request asked).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # Each generated token's captures (when the request asked for a probe).
    probe: tuple[TokenProbe, ...] | None = None

    def answer_parts(self) -> list[str | ToolCall]:
        """The answer in the order it was generated: runs of text (never empty) and the calls."""
        parts: list[str | ToolCall] = []
        start = 0
        for call, offset in zip(self.tool_calls, self.tool_call_offsets, strict=True):
            if offset > start:
                parts.append(self.content_text[start:offset])
            parts.append(call)
            start = offset
        if start < len(self.content_text):
            parts.append(self.content_text[start:])
        return parts

    @property
    def finish_reason(self) -> str:
        """ "stop", "length", or "tool_calls" when the answer ended with tool calls."""
        if self.tool_calls and self.result.finish_reason == "stop":
            return "tool_calls"
        return self.result.finish_reason


ToolCallEvent = ToolCallStart | ToolCallArguments | ToolCallEnd
OutputEvent = OutputDelta | ToolCallEvent | Finished | PromptProgress
