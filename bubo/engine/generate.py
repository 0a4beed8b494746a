"""The generation loop: prefill, then sample and decode one token at a time, as a stream of neutral events.

The events (`TextDelta` pieces, then one `GenerationResult`) carry no API dialect; the CLI and the
server's OpenAI / Anthropic / llama-server adapters each format them their own way. Stopping early is
closing the iterator.
"""

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from bubo.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from bubo.engine.run_ahead import run_ahead_tokens
from bubo.engine.runner import runner_for
from bubo.engine.sampler import Sampler, SamplingParams
from bubo.engine.speculative import Drafter, SpeculativeDecoder
from bubo.engine.token_choice import TokenChooser, TokenConstraint
from bubo.model.state import KVCache

FinishReason = Literal["stop", "length"]
# Why generation ended, in more detail than finish_reason: "eos" (a stop token), "stop_string",
# "max_tokens", "context" (prompt and completion fill the context, or no KV block is left) or "cancelled"
# (the caller's `cancelled()` said so).
StopReason = Literal["eos", "stop_string", "max_tokens", "context", "cancelled"]


class Cache(Protocol):
    length: int
    max_len: int

    @property
    def can_rewind(self) -> bool:
        """False when only truncate(0) and truncate(length) are possible (a recurrent state)."""
        ...

    def truncate(self, n: int) -> None: ...

    def reserve(self, n: int) -> bool:
        """Make room for n more positions; False when there is none (max_len, or no KV block left)."""
        ...


class ModelConfig(Protocol):
    vocab_size: int
    context_length: int


class Model(Protocol):
    """What generate needs from bubo.model.decoder.Decoder."""

    config: ModelConfig
    device: torch.device

    def __call__(self, tokens: torch.Tensor, cache: Cache, last_only: bool = False) -> torch.Tensor: ...

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> Cache: ...


class Tokenizer(Protocol):
    """What generate needs from bubo.model.tokenizer.Tokenizer."""

    stop_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability under the model (log-softmax of its raw logits, before
    penalties and temperature, as OpenAI reports them) and the `top` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """A piece of generated text and the tokens sampled since the previous piece (with their log
    probabilities when they were asked for)."""

    text: str
    token_ids: list[int]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Timings:
    """Wall-clock split of one generation.

    Prefill runs from the prompt forward to the first sampled token (time to first token); decode covers
    the remaining tokens (one forward each, or fewer with speculative decoding), so its rate is
    (completion - 1) / seconds.
    """

    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class GenerationResult:
    """The last event: why generation ended, what it produced, and how long it took.

    `token_ids` holds every sampled token, a final stop token included (it counts as a completion token,
    as in llama-server) though its text is not emitted. `text` is everything the TextDeltas carried, so
    it excludes a matched stop string. `seed` is the seed actually used, drawn or given.
    """

    finish_reason: FinishReason
    stop_reason: StopReason
    stop_token_id: int | None
    stop_string: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    token_ids: list[int]
    text: str
    seed: int
    timings: Timings
    draft_tokens: int = 0
    draft_accepted: int = 0
    draft_verify_steps: int = 0  # verify passes that checked a draft


GenerationEvent = TextDelta | GenerationResult


@torch.inference_mode()
def generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    cache: Cache | None = None,
    special: bool = False,
    cancelled: Callable[[], bool] | None = None,
    logprobs: int | None = None,
    constraints: Sequence[TokenConstraint] = (),
    drafter: Drafter | None = None,
    prompt_inputs: Callable[[int, int], Any] | None = None,
    prefill_progress: Callable[[int], None] | None = None,
) -> Iterator[GenerationEvent]:
    """Continue `prompt_ids`, yielding TextDelta pieces and then one GenerationResult.

    Without `cache`, a fresh one is sized for the prompt plus max_tokens (the model's context when
    there is no limit). A given cache may already hold a prefix of `prompt_ids` (`cache.length` tokens,
    the caller vouches they match): only the rest is computed. `special` keeps the text of special
    tokens such as <|im_start|>; by default they generate no text, like llama-server. `cancelled` is
    asked before every forward pass; when it answers True generation ends there (a client went away).
    `logprobs` (None: off) attaches each token's log probability and that many top alternatives.
    `constraints` mask the logits before each draw and see each chosen token (log probabilities stay
    the model's own). `drafter` turns on speculative decoding (bubo/engine/speculative.py): same
    events, greedy output identical, sampled output from the same distribution. `prompt_inputs(start,
    end)` gives the prefill of prompt positions [start, end) its image inputs (None for none) and sets
    the cache's rope offset (bubo/engine/prompt_images.py). `prefill_progress` is told the positions
    the cache holds after each piece of the prefill.
    """
    params.validate()
    prompt = list(prompt_ids)
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token to continue from")
    limit = params.token_limit
    if cache is None:
        context = model.config.context_length
        if len(prompt) > context:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens but the model's context is {context} tokens"
            )
        cache = model.new_cache(max_len=context if limit is None else min(context, len(prompt) + limit))
    elif len(prompt) > cache.max_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens but the cache holds at most {cache.max_len}")
    device = model.device

    sampler = Sampler(
        params,
        vocab_size=model.config.vocab_size,
        device=device,
        history=prompt,
        banned=tokenizer.stop_ids if params.ignore_eos else (),
    )
    stop_ids = frozenset() if params.ignore_eos else tokenizer.stop_ids
    detokenizer = IncrementalDetokenizer(_text_bytes(tokenizer, special))
    stops = StopMatcher(params.stop)

    # A cached prefix is reused, but the last prompt token always goes through the model because its
    # logits are what the first sampled token comes from.
    cached = min(cache.length, len(prompt) - 1)
    if cached != cache.length and not cache.can_rewind:
        # A recurrent state holds all of its positions or none: recompute the prompt from the start.
        cached = 0
    cache.truncate(cached)
    chooser = TokenChooser(sampler, constraints)
    speculative = None
    if drafter is not None and isinstance(cache, KVCache):
        speculative = SpeculativeDecoder(model, cache, chooser, drafter)
    started = time.perf_counter()
    tokens = torch.tensor([prompt[cached:]], dtype=torch.long, device=device)
    # The prefill's passes are forward passes too: a caller gone before or during them (a client that
    # left while a long prompt was queued or computed) stops it there, instead of holding the slot for
    # the whole prompt. None: cancelled, and the cache holds the pieces that ran.
    source: Iterator[tuple[int, torch.Tensor]] | None = None
    if cancelled is None or not cancelled():
        inputs = prompt_inputs(cached, len(prompt)) if prompt_inputs is not None else None
        images = {} if inputs is None else {"multimodal": inputs}
        if speculative is None or not speculative.drafter.needs_hidden:
            logits = _prefill(model, cache, tokens, images, cancelled, prefill_progress)
            if logits is not None and speculative is None:
                source = _plain_tokens(model, cache, chooser, logits)
            elif logits is not None:
                source = speculative.tokens(logits, prompt, limit)
        else:
            source = speculative.tokens(speculative.prefill(tokens, inputs), prompt, limit)
            if prefill_progress is not None:
                prefill_progress(cache.length)
    # All of the uncached prompt, unless the prefill was cancelled part way.
    prefilled = cache.length - cached
    first_token_at = started

    completion: list[int] = []
    pending: list[int] = []
    pending_logprobs: list[TokenLogprob] = []
    pieces: list[str] = []
    stop_token: int | None = None
    reason: StopReason = "max_tokens" if source is not None else "cancelled"
    try:
        # Each step asks the source for a token only after every stop check passed: the source runs
        # the model when it has no token left from its last pass.
        while source is not None and (limit is None or len(completion) < limit):
            token, logits = next(source)
            if not completion:
                first_token_at = time.perf_counter()
            completion.append(token)
            if token in stop_ids:
                stop_token, reason = token, "eos"
                break
            pending.append(token)
            if logprobs is not None:
                pending_logprobs.append(_logprob(logits, token, logprobs))
            text = stops.feed(detokenizer.feed(token))
            if text:
                pieces.append(text)
                yield TextDelta(text, pending, tuple(pending_logprobs))
                pending, pending_logprobs = [], []
            if stops.matched is not None:
                reason = "stop_string"
                break
            if limit is not None and len(completion) >= limit:
                break
            # The positions the model has run: the prompt and every token but the newest. The newest is
            # fed only if the token it predicts fits in the context too: prompt and completion together
            # never count more than max_len tokens (llama-server stops on n_past + 1 >= n_ctx alike). A
            # speculative pass may have run it already; otherwise its position needs room in the KV
            # blocks, which the slots share.
            ran = len(prompt) + len(completion) - 1
            if ran + 1 >= cache.max_len or (ran >= cache.length and not cache.reserve(1)):
                reason = "context"
                break
            if cancelled is not None and cancelled():
                reason = "cancelled"
                break
    finally:
        # A speculative source rolls the cache back to the tokens taken when it is closed.
        if source is not None:
            source.close()
    finished_at = time.perf_counter()

    if reason != "stop_string":
        # Bytes still waiting for the rest of a character, and text held back as a possible stop prefix,
        # are final now.
        text = stops.feed(detokenizer.flush())
        if stops.matched is not None:
            reason = "stop_string"
        else:
            text += stops.flush()
        if text:
            pieces.append(text)
            yield TextDelta(text, pending, tuple(pending_logprobs))

    yield GenerationResult(
        finish_reason="length" if reason in ("max_tokens", "context") else "stop",
        stop_reason=reason,
        stop_token_id=stop_token,
        stop_string=stops.matched,
        prompt_tokens=len(prompt),
        cached_tokens=cached,
        completion_tokens=len(completion),
        token_ids=completion,
        text="".join(pieces),
        seed=sampler.seed,
        timings=Timings(
            prefill_tokens=prefilled,
            prefill_seconds=(first_token_at if completion else finished_at) - started,
            decode_tokens=max(len(completion) - 1, 0),
            decode_seconds=finished_at - first_token_at if completion else 0.0,
        ),
        draft_tokens=0 if speculative is None else speculative.proposed,
        draft_accepted=0 if speculative is None else speculative.accepted,
        draft_verify_steps=0 if speculative is None else speculative.verify_steps,
    )


# A longer prompt (without images) prefills in pieces of this many tokens, each continuing the cache, so
# its activations stay those of a 2048-token pass however long it is. Long prompts pay some speed for it
# (each piece unpacks the weights again, and attends under an explicit mask where one pass skips the
# masked blocks); smaller pieces, such as llama.cpp's 512-token ubatch, would slow prompts of ordinary
# length too, so only prompts past 2048 pay anything.
PREFILL_CHUNK_TOKENS = 2048


def _prefill(
    model: Model,
    cache: Cache,
    tokens: torch.Tensor,
    images: dict[str, Any],
    cancelled: Callable[[], bool] | None = None,
    progress: Callable[[int], None] | None = None,
) -> torch.Tensor | None:
    """Run the prompt tokens [1, T] into `cache`; the logits [vocab] of the last position, or None when
    `cancelled` said so before a piece after the first (the cache then holds the pieces that ran).
    `progress` is told the cache's length after each piece."""
    runner = runner_for(model)
    step = runner.prefill_step(cache, tokens.shape[1], bool(images))
    governor = runner.governor
    if governor is not None:
        governor.settle()
    if step is None:
        # Only the last position's logits are needed; a long prompt's [T, vocab] logits would be large.
        # Image embeddings and their positions come with the whole prompt: one pass.
        chunk = tokens.shape[1] if images else PREFILL_CHUNK_TOKENS
        for start in range(0, tokens.shape[1], chunk):
            if start and cancelled is not None and cancelled():
                return None
            logits = model(tokens[:, start : start + chunk], cache, last_only=True, **images)[0, -1]
            if progress is not None:
                progress(cache.length)
        return logits
    for token in tokens[0]:
        logits = step(token, cache)
    if progress is not None:
        progress(cache.length)
    return logits


def _plain_tokens(
    model: Model, cache: Cache, chooser: TokenChooser, logits: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor]]:
    """One token per forward pass, each with the logits row it was chosen from; the pass is the path the
    model's runner chooses (bubo/engine/runner.py): the compiled decode step (CPU), the decode step
    captured as a CUDA graph, each launched before the previous token is read back
    (bubo/engine/run_ahead.py), or the eager forward."""
    runner = runner_for(model)
    step = runner.decode_step(cache)
    graph = runner.graph_step(cache) if step is None else None
    if graph is not None:
        assert isinstance(cache, KVCache)  # the runner has no captured step for any other cache
        yield from run_ahead_tokens(graph, cache, chooser, logits)
        return
    # On a CPU the steps' thread count follows their timings (bubo/engine/thread_governor.py).
    governor = runner.governor
    while True:
        token, on_device = chooser.pick_on_device(logits)
        yield token, logits
        with nullcontext() if governor is None else governor.step():
            logits = model(on_device.view(1, 1), cache)[0, -1] if step is None else step(on_device, cache)


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logprobs = logits.float().log_softmax(-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = logprobs.topk(top)
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), alternatives)


def _text_bytes(tokenizer: Tokenizer, special: bool) -> Callable[[int], bytes]:
    if special:
        return tokenizer.token_bytes
    return lambda token: b"" if tokenizer.is_special(token) else tokenizer.token_bytes(token)
