"""The public Python API: `bubo.load(...)` opens a GGUF file into a `Model`, which generates text, chats
(with tools, JSON output and reasoning budgets), runs forward passes step by step on explicit state, and
says which path each kind of step takes.

The CLI and the server are clients of the same pieces: `Model.generate` and `Model.chat` run a request
on a session slot (bubo/engine/slot.py) exactly as a server slot does, with its prompt cache, and yield
the same protocol-neutral events the server formats (bubo/engine/request.py); `Model.chat` prepares its
chat as the server's chat routes do (bubo/engine/chat_prompt.py), and refuses what they refuse with a
RequestError (bubo/engine/request_error.py), a ValueError.
"""

import contextlib
import itertools
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, overload

import torch

from bubo.default_model import default_model_path
from bubo.dtypes import CACHE_TYPES, DTYPES
from bubo.engine.chat_prompt import ChatPrompter, chat_template
from bubo.engine.chat_request import chat_request
from bubo.engine.drafters import drafter_for, prepare_drafting
from bubo.engine.loaded_model import LoadedModel, load_model
from bubo.engine.ngram_drafter import DEFAULT_NGRAM_SIZE
from bubo.engine.output_format import output_constraint, output_schema
from bubo.engine.output_grammar import request_constraints
from bubo.engine.request import Finished, GenerationRequest, OutputEvent, ToolCall, Usage, check_prompt_fits
from bubo.engine.request_error import RequestError
from bubo.engine.request_fields import Body
from bubo.engine.runner import Plan, runner_for
from bubo.engine.sampler import SamplingParams
from bubo.engine.slot import SessionSlot
from bubo.engine.speculative import Drafter
from bubo.gguf.model_config import ModelConfig
from bubo.model.decoder import Decoder
from bubo.model.mtp_weights import load_mtp_weights
from bubo.model.state import KVCache
from bubo.model.tokenizer import Tokenizer
from bubo.model.trace import Trace
from bubo.options import RuntimeOptions, use_options

__all__ = ["ChatResult", "Model", "load"]


def load(
    path: str | Path | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    ctx_size: int | None = None,
    cache_type: str | tuple[str, str] = "f16",
    threads: int | None = None,
    options: RuntimeOptions | None = None,
    progress: bool = False,
    spec_type: str | None = None,
    spec_draft: int | None = None,
    spec_ngram_size: int = DEFAULT_NGRAM_SIZE,
    mtp_weights: str | Path | None = None,
) -> "Model":
    """Open the GGUF file at `path` (None: the default model, SmolLM2-135M-Instruct Q4_1) on `device`.

    `dtype` is the compute dtype ("float32" is the fast CPU path); `ctx_size` caps the context (default:
    the model's trained context); `cache_type` is the KV cache's storage ("f16", "bf16" or "f32", or a
    (keys, values) pair);
    `threads` sets torch's CPU threads; `options` installs the runtime options for the process
    (bubo.options.RuntimeOptions; default: the environment's). Speculative decoding as `bubo serve`'s
    flags of the same names set it (bubo/engine/drafters.py): `spec_type` "mtp" (the model's MTP block,
    the default where it has one), "ngram-simple" or "none", `spec_draft` tokens a round (0: off), and
    `mtp_weights`, a checkpoint shard holding the MTP block the GGUF lacks. Raises FileNotFoundError,
    GGUFError or UnsupportedArchitectureError for a file it can't serve, ValueError for a bad argument.
    """
    compute = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if compute not in DTYPES.values():
        raise ValueError(f"dtype: one of {', '.join(DTYPES)}, not {dtype!r}")
    storage = (cache_type, cache_type) if isinstance(cache_type, str) else tuple(cache_type)
    if len(storage) != 2 or any(part not in CACHE_TYPES for part in storage):
        raise ValueError(f"cache_type: one of {', '.join(CACHE_TYPES)} (or a pair), not {cache_type!r}")
    if ctx_size is not None and ctx_size < 2:
        raise ValueError(f"ctx_size must be at least 2, got {ctx_size}")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    if options is not None:
        use_options(options)
    file = Path(path) if path is not None else default_model_path()
    if not file.is_file():
        raise FileNotFoundError(
            f"model file not found: {file}" if not file.exists() else f"not a file: {file}"
        )
    loaded = load_model(
        file,
        dtype=compute,
        device=device,
        progress=progress,
        cache_dtypes=(CACHE_TYPES[storage[0]], CACHE_TYPES[storage[1]]),
    )
    try:
        if mtp_weights is not None:
            load_mtp_weights(loaded.model, Path(mtp_weights))
        drafter = drafter_for(loaded.model, spec_type, spec_draft, spec_ngram_size)
        prepare_drafting(loaded.model, drafter)
    except BaseException:
        loaded.file.close()
        raise
    return Model(loaded, ctx_size, drafter)


@dataclass(frozen=True)
class ChatResult:
    """A chat's answer: its `text`, its `reasoning` (the thinking block's text, "" without one), the
    `tool_calls` it made (each a name and its arguments as JSON object text), why it ended (`finish_reason`:
    "stop", "length" or "tool_calls"), its `usage`, and the `finished` event with the engine's detail."""

    text: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    usage: Usage
    finished: Finished

    @classmethod
    def of(cls, finished: Finished) -> "ChatResult":
        return cls(
            finished.content_text,
            finished.reasoning_text,
            finished.tool_calls,
            finished.finish_reason,
            finished.usage,
            finished,
        )


class Model:
    """A loaded model: its tokenizer, its decoder (a torch module), and one session slot that runs its
    generations one at a time, keeping the prompt cache between them (a continued conversation is
    computed once). Not for use from several threads at once."""

    def __init__(
        self, loaded: LoadedModel, ctx_size: int | None = None, drafter: Drafter | None = None
    ) -> None:
        self.loaded = loaded
        self.drafter = drafter  # speculative decoding's drafter (bubo/engine/speculative.py); None: off
        trained = loaded.config.context_length
        self.ctx_size = min(ctx_size or trained, trained)
        self._slot: SessionSlot | None = None
        self._busy = threading.Lock()
        self._ids = itertools.count(1)

    @property
    def path(self) -> Path:
        return self.loaded.path

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def decoder(self) -> Decoder:
        """The torch module (bubo/model/decoder.py): hooks, parameters and submodules are all its own."""
        return self.loaded.model

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def plan(self) -> Plan:
        """Which path each kind of step runs (eager, compiled, CUDA graph) and why."""
        return runner_for(self.decoder).plan

    # Step by step

    def new_state(self, max_len: int | None = None) -> KVCache:
        """An empty decode state (KV cache, recurrent and indexer states) for up to `max_len` positions
        (default: the context size), for `forward`."""
        return self.decoder.new_cache(max_len=self.ctx_size if max_len is None else max_len)

    def forward(self, ids: Sequence[int] | torch.Tensor, state: KVCache | None = None) -> torch.Tensor:
        """The float32 logits [len(ids), vocab] of `ids` continuing `state` (None: a fresh state sized
        for `ids`), which advances past them. This is the eager forward: hooks on the decoder's modules
        see every call."""
        tokens = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        if tokens.shape[1] == 0:
            raise ValueError("forward needs at least one token")
        if state is None:
            state = self.new_state(max_len=tokens.shape[1])
        if state.length + tokens.shape[1] > state.max_len:
            raise ValueError(
                f"the state holds {state.length} of {state.max_len} positions: no room for {tokens.shape[1]} more"
            )
        with torch.inference_mode():
            return self.decoder(tokens, state)[0].float()

    # Inspection

    @contextlib.contextmanager
    def trace(
        self,
        sites: Sequence[str] = ("residual",),
        layers: Iterable[int] | Mapping[str, Iterable[int]] | None = None,
        *,
        steer: Mapping[int, torch.Tensor] | None = None,
        patch: Mapping[int, Trace] | None = None,
        ablate_experts: Mapping[int, Iterable[int]] | None = None,
    ) -> Iterator[Trace]:
        """Capture `sites` of `layers` at every pass of `forward` or `generate` inside the `with` block,
        and apply the interventions added to the trace (bubo/model/trace.py lists the sites):

            with model.trace(sites=["residual", "logit_lens"], layers=[3, 7]) as t:
                t.add("residual", direction, layers=[3])   # steer every step
                model.generate("The capital of France is", max_tokens=8)
            t.tokens("logit_lens", 7)                          # [1, positions, vocab]

        The common interventions can be given here instead, each a mapping layer -> what to do there:
        `steer` adds a vector [hidden] to the residual after the layer, `patch` puts in place of that
        residual what another run's trace (one that captured it) saved at the same step, and
        `ablate_experts` takes expert ids out of the layer's router (the others renormalised).

        While it is active every step runs eagerly (`plan` says so). A traced generation computes its
        whole prompt (the prompt cache is dropped on entry), and the cache it leaves, made under the
        trace's interventions, is dropped on exit: later requests never reuse it."""
        if self._busy.locked():
            raise RuntimeError("this model is generating: finish or close that generation before tracing")
        traced = Trace(self.decoder, sites, layers)
        for layer, vector in (steer or {}).items():
            traced.add("residual", vector, layers=[layer])
        for layer, donor in (patch or {}).items():
            traced.patch("residual", donor, layers=[layer])
        for layer, experts in (ablate_experts or {}).items():
            traced.ablate_experts(experts, layers=[layer])
        self._slot = None
        try:
            with traced:
                yield traced
        finally:
            self._slot = None

    # Generation

    @cached_property
    def _prompter(self) -> ChatPrompter:
        """The model's chat template with its tokenizer, as the server prepares chats with it."""
        return ChatPrompter(chat_template(self.loaded), self.tokenizer, self.config.vocab_size)

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        stream: Literal[False] = False,
        special: bool = False,
        **sampling: Any,
    ) -> Finished: ...

    @overload
    def generate(
        self, prompt: str | Sequence[int], *, stream: Literal[True], special: bool = False, **sampling: Any
    ) -> Iterator[OutputEvent]: ...

    def generate(
        self, prompt: str | Sequence[int], *, stream: bool = False, special: bool = False, **sampling: Any
    ) -> Finished | Iterator[OutputEvent]:
        """Continue `prompt` (text, tokenized with the file's BOS, or token ids). `sampling` are
        SamplingParams fields (temperature, top_k, top_p, min_p, seed, max_tokens, stop, ...; llama-server's
        defaults). Returns the `Finished` event (its `content_text`, `usage`, `finish_reason`), or with
        `stream=True` yields `OutputDelta` pieces as they are generated and then the `Finished` event.
        `special` keeps the text of special tokens (<|im_end|>), which is dropped by default."""
        params = _sampling(sampling)
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
                raise ValueError(f"token ids must be in [0, {self.tokenizer.vocab_size})")
            text = self.tokenizer.decode(ids)
        check_prompt_fits(ids, self.ctx_size)
        request = GenerationRequest(f"gen-{next(self._ids)}", text, ids, params, special=special)
        events = self._run(request)
        return events if stream else _finished(events)

    @overload
    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        stream: Literal[False] = False,
        **sampling: Any,
    ) -> ChatResult: ...

    @overload
    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        stream: Literal[True],
        **sampling: Any,
    ) -> Iterator[OutputEvent]: ...

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        stream: bool = False,
        **sampling: Any,
    ) -> ChatResult | Iterator[OutputEvent]:
        """Answer a conversation, as the server's /v1/chat/completions does with the fields of these
        names: `messages` in OpenAI's shape ({"role", "content"}, tool calls and results), `tools`
        (function tools), `tool_choice` ("auto", "none", "required" or {"type": "function", "function":
        {"name": ...}}, which force a call by a grammar), `response_format` ({"type": "json_schema",
        "json_schema": {"schema": ...}} or {"type": "json_object"}: the answer is JSON held to it),
        `reasoning_effort` (off, minimal ... max: thinking on or off, and its token budget, where the
        template thinks). `sampling` are SamplingParams fields, as for `generate`.

        Returns a ChatResult, or with `stream=True` yields the neutral events: OutputDelta pieces of
        reasoning or answer text, ToolCallStart / ToolCallArguments / ToolCallEnd pieces of each call,
        then the Finished event (usage and timings). A request the server would refuse raises
        RequestError (a ValueError) naming the argument, before anything runs."""
        body = {
            "messages": messages,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            "response_format": response_format,
            "reasoning_effort": reasoning_effort,
            "chat_template_kwargs": chat_template_kwargs,
        }
        fields = Body(body)
        chat = chat_request(fields)
        schema = output_schema(fields.object("response_format") or {"type": "text"}, "response_format")
        params = _sampling(sampling)
        prepared = self._prompter.prepare(chat, output_constraint(fields, schema))
        prompt = prepared.prompt
        check_prompt_fits(prompt.ids, self.ctx_size)
        constraints = request_constraints(
            self.tokenizer,
            reasoning=prompt.reasoning,
            in_reasoning=prompt.in_reasoning,
            budget=prepared.reasoning_budget,
            grammar=prepared.grammar,
        )
        request = GenerationRequest(
            f"chat-{next(self._ids)}",
            prompt.text,
            prompt.ids,
            params,
            prompt.reasoning,
            prompt.in_reasoning,
            constraints=constraints,
            tool_parser=prepared.tool_parser,
        )
        events = self._run(request)
        return events if stream else ChatResult.of(_finished(events))

    def _run(self, request: GenerationRequest) -> Iterator[OutputEvent]:
        """The request's events from the model's slot; one generation at a time. Closing the iterator
        stops the generation before its next forward pass."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this model is generating already: finish or close the other generation first")
        try:
            if self._slot is None:
                self._slot = SessionSlot(self.decoder, self.tokenizer, self.ctx_size, drafter=self.drafter)
            yield from self._slot.events(request)
        finally:
            self._busy.release()

    def close(self) -> None:
        """Release the file's memory map (the model can't be used after)."""
        self.loaded.file.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<bubo.Model {self.config.architecture} from {self.path.name} on {self.device}>"


def _sampling(fields: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams of the keyword arguments (an unknown name is Python's TypeError); RequestError
    for an unusable value."""
    params = SamplingParams(**fields)
    try:
        params.validate()
    except ValueError as error:
        raise RequestError(str(error)) from None
    return params


def _finished(events: Iterator[OutputEvent]) -> Finished:
    """The last event of a generation, run to its end."""
    for event in events:
        if isinstance(event, Finished):
            return event
    raise RuntimeError("the generation ended without a result")
