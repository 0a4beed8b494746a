"""The OpenAI dialect: POST /v1/chat/completions and POST /v1/completions, as JSON or SSE."""

import time
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

from aiohttp import web

from bubo.engine.chat_request import chat_request
from bubo.engine.generate import TokenLogprob
from bubo.engine.output_format import output_constraint, output_schema
from bubo.engine.request import (
    Finished,
    GenerationRequest,
    OutputDelta,
    OutputEvent,
    PromptProgress,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from bubo.model.tokenizer import Tokenizer
from bubo.server.errors import ApiError, bad_field, error_body
from bubo.server.fields import Body, bias_text_tokens, read_json, reject_n, sampling_params
from bubo.server.keys import REQUEST_ID, STATE
from bubo.server.probe_fields import probe_json, with_probe
from bubo.server.request_context import new_id
from bubo.server.sse import EventStream
from bubo.server.state import ServerState
from bubo.server.stream_extras import delta_timings, progress_json, with_stream_extras
from bubo.server.usage import openai_usage, timings

__all__ = ["routes"]


def _stream_options(body: Body) -> bool:
    """Whether the stream ends with a usage chunk (`stream_options.include_usage`)."""
    options = body.object("stream_options")
    if options is None:
        return False
    flag = options.get("include_usage", False)
    if not isinstance(flag, bool):
        raise bad_field("stream_options.include_usage", "must be true or false")
    return flag


def _chat_logprobs(body: Body) -> int | None:
    """`logprobs: true` with `top_logprobs` alternatives (0-20); None when not asked for."""
    top = body.integer("top_logprobs", minimum=0, maximum=20)
    if not body.boolean("logprobs"):
        if top:
            raise bad_field("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    loaded = state.require_ready()
    model = state.resolve_model(body.raw("model"))
    reject_n(body)
    chat = chat_request(body)
    stream = body.boolean("stream")
    include_usage = _stream_options(body)
    params = sampling_params(
        body,
        state.settings.defaults,
        loaded.tokenizer.vocab_size,
        limit_fields=("max_completion_tokens", "max_tokens"),
        tokenize=bias_text_tokens(loaded.tokenizer),
    )
    top_logprobs = _chat_logprobs(body)
    schema = output_schema(body.object("response_format") or {"type": "text"}, "response_format")
    generation = await state.chat_generation(
        chat,
        params,
        size=body.size,
        logprobs=top_logprobs,
        constraint=output_constraint(body, schema),
        cache_prompt=body.boolean("cache_prompt", True),
        images=await state.load_images(chat),
    )
    generation = with_probe(with_stream_extras(generation, body, stream), body, state)
    reply = _Reply(new_id("chatcmpl-"), "chat.completion", model, loaded.tokenizer, top_logprobs)
    if stream:
        return await _stream(request, state, generation, reply, include_usage, _chat_chunk)
    finished = await state.complete(generation)
    message: dict[str, Any] = {"role": "assistant", "content": finished.content_text}
    if generation.reasoning:
        message["reasoning_content"] = finished.reasoning_text
    if finished.tool_calls:
        # OpenAI's shape: content is null when the answer is only calls.
        message["content"] = finished.content_text or None
        message["tool_calls"] = [
            _tool_call(call.id, call.name, call.arguments) for call in finished.tool_calls
        ]
    choice = {
        "index": 0,
        "message": message,
        "logprobs": reply.chat_logprobs(finished.content_logprobs),
        "finish_reason": finished.finish_reason,
    }
    return web.json_response(reply.body(choice, finished), headers={"x-request-id": request[REQUEST_ID]})


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    loaded = state.require_ready()
    model = state.resolve_model(body.raw("model"))
    reject_n(body)
    text, ids = await state.prompt_work(body.size, state.completion_prompt, body.raw("prompt"))
    stream = body.boolean("stream")
    include_usage = _stream_options(body)
    echo = body.boolean("echo")
    if body.string("suffix"):
        raise ApiError(
            400, "unsupported_suffix", "suffix: fill-in-the-middle is not supported", param="suffix"
        )
    # The legacy API's `logprobs` is the number of alternatives (0-5 there; up to 20 here).
    top_logprobs = body.integer("logprobs", minimum=0, maximum=20)
    # With echo, logprobs covers the prompt's tokens too, and max_tokens 0 asks for nothing more: how
    # evaluation harnesses score the likelihood of a text.
    scored = top_logprobs if echo else None
    if scored is not None and stream:
        raise ApiError(
            400,
            "unsupported_value",
            "stream: echo with logprobs (the prompt's log probabilities) is answered without streaming",
            param="stream",
        )
    params = sampling_params(
        body,
        state.settings.defaults,
        loaded.tokenizer.vocab_size,
        limit_minimum=0 if echo else 1,
        tokenize=bias_text_tokens(loaded.tokenizer),
    )
    schema = output_schema(body.object("response_format") or {"type": "text"}, "response_format")
    generation = state.request(
        text,
        ids,
        params,
        logprobs=top_logprobs,
        grammar=await state.compile_constraint(output_constraint(body, schema)),
        cache_prompt=body.boolean("cache_prompt", True),
        prompt_logprobs=scored,
    )
    generation = with_probe(with_stream_extras(generation, body, stream), body, state)
    prefix = text if echo else ""
    reply = _Reply(new_id("cmpl-"), "text_completion", model, loaded.tokenizer, top_logprobs, prefix)
    if stream:
        return await _stream(request, state, generation, reply, include_usage, _text_chunk)
    finished = await state.complete(generation)
    echoed = (ids[0], finished.prompt_logprobs) if scored is not None else None
    choice = {
        "index": 0,
        "text": reply.prefix + finished.content_text,
        "logprobs": reply.text_logprobs(finished.content_logprobs, echoed),
        "finish_reason": finished.finish_reason,
    }
    return web.json_response(reply.body(choice, finished), headers={"x-request-id": request[REQUEST_ID]})


class _Reply:
    """The fields every body and chunk of one answer repeats, and its log-probability formatting."""

    def __init__(
        self,
        reply_id: str,
        kind: str,
        model: str,
        tokenizer: Tokenizer,
        logprobs: int | None,
        prefix: str = "",
    ) -> None:
        self.id = reply_id
        self.kind = kind
        self.model = model
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.prefix = prefix
        self.created = int(time.time())
        # Where the next token starts in the text (the legacy API's text_offset).
        self.offset = len(prefix)

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": self._text(token_id), "logprob": logprob, "bytes": list(raw)}

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        content = [
            {**self._token(lp.token_id, lp.logprob), "top_logprobs": [self._token(i, v) for i, v in lp.top]}
            for lp in logprobs
        ]
        return {"content": content, "refusal": None}

    def text_logprobs(
        self, logprobs: Sequence[TokenLogprob], echoed: tuple[int, Sequence[TokenLogprob]] | None = None
    ) -> dict[str, Any] | None:
        """The legacy shape. `echoed` (the prompt's first token, then the log probabilities of the
        others) puts the prompt's tokens first, the first one's log probability null as OpenAI's was."""
        if self.logprobs is None:
            return None
        rows: list[tuple[int, float | None, dict[str, float] | None]] = []
        if echoed is not None:
            first, scored = echoed
            rows.append((first, None, None))
            self.offset = 0
            logprobs = [*scored, *logprobs]
        rows += [(lp.token_id, lp.logprob, {self._text(i): v for i, v in lp.top}) for lp in logprobs]
        tokens = [self._text(token_id) for token_id, _, _ in rows]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in rows],
            "top_logprobs": [top for _, _, top in rows],
            "text_offset": offsets,
        }

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def body(self, choice: dict[str, Any], finished: Finished) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "bubo",
            "choices": [choice],
            "usage": openai_usage(finished.usage),
            "timings": timings(finished.usage),
            **probe_json(finished),
        }

    def choice_chunk(
        self,
        part: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """A chunk of the one choice: `part` is its delta (chat) or text (completions)."""
        choice = {"index": 0, **part, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.chunk([choice], **extra)

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.kind == "chat.completion" else self.kind
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "bubo",
            "choices": choices,
            **extra,
        }


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat_chunk(reply: _Reply, event: OutputEvent | None) -> dict[str, Any] | None:
    """The chunk for one event (None: not sent); `event` None is the opening chunk with the role.

    A tool call streams as OpenAI's do: its first piece has the index, id, type and name with empty
    arguments, the next pieces only the index and an arguments fragment."""
    if isinstance(event, ToolCallStart):
        piece = {"index": event.index, **_tool_call(event.id, event.name, "")}
        return reply.choice_chunk({"delta": {"tool_calls": [piece]}})
    if isinstance(event, ToolCallArguments):
        piece = {"index": event.index, "function": {"arguments": event.fragment}}
        return reply.choice_chunk({"delta": {"tool_calls": [piece]}})
    if isinstance(event, ToolCallEnd):
        return None
    if isinstance(event, PromptProgress):
        return reply.chunk([], prompt_progress=progress_json(event))
    if event is None:
        # As OpenAI and llama-server open a stream: the role, and no content yet.
        return reply.choice_chunk({"delta": {"role": "assistant", "content": None}})
    if isinstance(event, OutputDelta):
        key = "reasoning_content" if event.channel == "reasoning" else "content"
        logprobs = reply.chat_logprobs(event.logprobs) if event.channel == "content" else None
        return reply.choice_chunk({"delta": {key: event.text}}, logprobs, **delta_timings(event))
    return reply.choice_chunk(
        {"delta": {}}, finish_reason=event.finish_reason, timings=timings(event.usage), **probe_json(event)
    )


def _text_chunk(reply: _Reply, event: OutputEvent | None) -> dict[str, Any] | None:
    if event is None:
        return reply.choice_chunk({"text": reply.prefix}) if reply.prefix else None
    if isinstance(event, PromptProgress):
        return reply.chunk([], prompt_progress=progress_json(event))
    if isinstance(event, OutputDelta):
        logprobs = reply.text_logprobs(event.logprobs)
        return reply.choice_chunk({"text": event.text}, logprobs, **delta_timings(event))
    return reply.choice_chunk(
        {"text": ""}, finish_reason=event.finish_reason, timings=timings(event.usage), **probe_json(event)
    )


async def _stream(
    request: web.Request,
    state: ServerState,
    generation: GenerationRequest,
    reply: _Reply,
    include_usage: bool,
    chunk: Any,
) -> web.StreamResponse:
    async with aclosing(state.stream(generation)) as events:
        first = await anext(events)
        sse = EventStream(request, request[REQUEST_ID])
        await sse.start()
        try:
            opening = chunk(reply, None)
            if opening is not None:
                await sse.send(opening)
            event: OutputEvent | None = first
            while event is not None:
                data = chunk(reply, event)
                if data is not None:
                    await sse.send(data)
                if isinstance(event, Finished):
                    if include_usage:
                        await sse.send(reply.chunk([], usage=openai_usage(event.usage)))
                    break
                event = await anext(events, None)
            await sse.send("[DONE]")
        except ApiError as error:
            await sse.send(error_body(error, anthropic=False, request_id=request[REQUEST_ID]))
        except ConnectionResetError:
            return sse.response
        return await sse.finish()


def routes() -> list[web.RouteDef]:
    # The paths without /v1 as well: llama-server serves both, and an OpenAI client whose base_url
    # lacks /v1 asks for these.
    return [
        route
        for prefix in ("/v1", "")
        for route in (
            web.post(f"{prefix}/chat/completions", chat_completions),
            web.post(f"{prefix}/completions", completions),
        )
    ]
