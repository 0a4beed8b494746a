"""The OpenAI dialect: POST /v1/chat/completions and POST /v1/completions, as JSON or SSE."""

import time
from contextlib import aclosing
from typing import Any

from aiohttp import web

from bubo.engine.request import Finished, GenerationRequest, OutputDelta, OutputEvent
from bubo.server.chat import ChatRequest, chat_messages, thinking_choice, tool_list
from bubo.server.errors import ApiError, bad_field
from bubo.server.fields import Body, read_json, reject_n, sampling_params
from bubo.server.keys import REQUEST_ID, STATE
from bubo.server.sse import EventStream
from bubo.server.state import ServerState, new_id
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


def _check_unsupported(body: Body) -> None:
    """Fields whose meaning Bubo does not implement yet are refused, not silently ignored."""
    if body.boolean("logprobs") or body.integer("top_logprobs", minimum=0, maximum=20):
        raise ApiError(
            400,
            "unsupported_logprobs",
            "logprobs: token log probabilities are not supported yet",
            param="logprobs",
        )
    response_format = body.object("response_format")
    if response_format is not None:
        kind = response_format.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_field("response_format.type", f"must be text, json_object or json_schema; got {kind!r}")
        if kind != "text":
            raise ApiError(
                400,
                "unsupported_response_format",
                f"response_format: {kind} is not supported yet",
                param="response_format",
            )
    tool_choice = body.raw("tool_choice")
    if (
        tool_choice is not None
        and tool_choice not in ("none", "auto", "required")
        and not isinstance(tool_choice, dict)
    ):
        raise bad_field("tool_choice", 'must be "none", "auto", "required" or a function choice object')
    body.boolean("parallel_tool_calls", True)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    loaded = state.require_ready()
    model = state.resolve_model(body.raw("model"))
    reject_n(body)
    messages = chat_messages(body.raw("messages"))
    thinking, kwargs = thinking_choice(body)
    tools = tool_list(body.raw("tools"))
    stream = body.boolean("stream")
    include_usage = _stream_options(body)
    _check_unsupported(body)
    params = sampling_params(
        body,
        state.settings.defaults,
        loaded.tokenizer.vocab_size,
        limit_fields=("max_completion_tokens", "max_tokens"),
    )
    prompt = state.render_prompt(ChatRequest(messages, tools, thinking, kwargs))
    generation = state.request(
        prompt.text, prompt.ids, params, reasoning=prompt.reasoning, in_reasoning=prompt.in_reasoning
    )
    reply = _Reply(new_id("chatcmpl-"), "chat.completion", model, generation.reasoning)
    if stream:
        return await _stream(request, state, generation, reply, include_usage, _chat_chunk)
    finished = await state.complete(generation)
    message: dict[str, Any] = {"role": "assistant", "content": finished.content_text}
    if generation.reasoning:
        message["reasoning_content"] = finished.reasoning_text
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finished.finish_reason}
    return web.json_response(reply.body(choice, finished), headers={"x-request-id": request[REQUEST_ID]})


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    loaded = state.require_ready()
    model = state.resolve_model(body.raw("model"))
    reject_n(body)
    text, ids = _completion_prompt(state, body)
    stream = body.boolean("stream")
    include_usage = _stream_options(body)
    echo = body.boolean("echo")
    if body.string("suffix"):
        raise ApiError(
            400, "unsupported_suffix", "suffix: fill-in-the-middle is not supported", param="suffix"
        )
    if body.raw("logprobs") is not None and body.raw("logprobs") is not False:
        raise ApiError(
            400,
            "unsupported_logprobs",
            "logprobs: token log probabilities are not supported yet",
            param="logprobs",
        )
    params = sampling_params(body, state.settings.defaults, loaded.tokenizer.vocab_size)
    generation = state.request(text, ids, params)
    reply = _Reply(new_id("cmpl-"), "text_completion", model, False, prefix=text if echo else "")
    if stream:
        return await _stream(request, state, generation, reply, include_usage, _text_chunk)
    finished = await state.complete(generation)
    choice = {
        "index": 0,
        "text": reply.prefix + finished.content_text,
        "logprobs": None,
        "finish_reason": finished.finish_reason,
    }
    return web.json_response(reply.body(choice, finished), headers={"x-request-id": request[REQUEST_ID]})


def _completion_prompt(state: ServerState, body: Body) -> tuple[str, list[int]]:
    """`prompt` as a string, a one-element array of strings, or an array of token ids."""
    prompt = body.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, state.tokenize(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        vocab = state.require_ready().tokenizer.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise bad_field("prompt", f"token ids must be in [0, {vocab})")
        return state.require_ready().tokenizer.decode(prompt), list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(
            400,
            "unsupported_n",
            "prompt: one prompt per request (several prompts would be n > 1)",
            param="prompt",
        )
    raise bad_field("prompt", "is required: a string, or an array of token ids")


class _Reply:
    """The fields every body and chunk of one answer repeats."""

    def __init__(self, reply_id: str, kind: str, model: str, reasoning: bool, prefix: str = "") -> None:
        self.id = reply_id
        self.kind = kind
        self.model = model
        self.reasoning = reasoning
        self.prefix = prefix
        self.created = int(time.time())

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
        }

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


def _chat_chunk(reply: _Reply, event: OutputDelta | Finished | None) -> dict[str, Any]:
    """The chunk for one event; None is the opening chunk that carries the role."""
    if event is None:
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        return reply.chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
    if isinstance(event, OutputDelta):
        key = "reasoning_content" if event.channel == "reasoning" else "content"
        return reply.chunk(
            [{"index": 0, "delta": {key: event.text}, "logprobs": None, "finish_reason": None}]
        )
    return reply.chunk(
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": event.finish_reason}],
        timings=timings(event.usage),
    )


def _text_chunk(reply: _Reply, event: OutputDelta | Finished | None) -> dict[str, Any] | None:
    if event is None:
        if not reply.prefix:
            return None
        return reply.chunk([{"index": 0, "text": reply.prefix, "logprobs": None, "finish_reason": None}])
    if isinstance(event, OutputDelta):
        return reply.chunk([{"index": 0, "text": event.text, "logprobs": None, "finish_reason": None}])
    return reply.chunk(
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": event.finish_reason}],
        timings=timings(event.usage),
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
                await sse.send(chunk(reply, event))
                if isinstance(event, Finished):
                    if include_usage:
                        await sse.send(reply.chunk([], usage=openai_usage(event.usage)))
                    break
                event = await anext(events, None)
            await sse.send("[DONE]")
        except ApiError as error:
            await sse.send({"error": {"message": error.message, "type": error.type, "code": error.code}})
        except ConnectionResetError:
            return sse.response
        return await sse.finish()


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/chat/completions", chat_completions), web.post("/v1/completions", completions)]
