"""The OpenAI Responses dialect: POST /v1/responses, as JSON or SSE.

A Responses body carries its conversation as `input` items (messages, function calls and their
outputs, reasoning) and `instructions`, which bubo/server/responses_input.py turns into the template
messages every dialect shares; this module runs them and answers with a `response` object whose `output` holds a reasoning
item (when the model reasoned), an assistant message (left out when the answer is only function
calls) and one `function_call` item per call. The stream is the Responses event sequence
(`event: NAME` plus `data: JSON`, each with a `sequence_number`); a failure once it has started ends
it with an `error` event and then `response.failed`. Nothing is stored, so
`previous_response_id`, `conversation` and `background` are refused rather than ignored.

Function tools and `strict` (OpenAI's Responses API treats an absent `strict` as true; Bubo does not):

- no `strict`, or `strict: null`, and `strict: false`: the parameters schema is used as sent, so
  optional properties stay optional and extra properties are allowed where the schema allows them.
- `strict: true`: the schema is first made strict the way OpenAI's strict mode defines it: every
  object in it (nested ones too) requires all of its properties and, unless it says otherwise,
  allows no others (`additionalProperties: false`). The template shows the model that schema.

A schema is enforced only when the call is forced (tool_choice "required" or a named function):
the grammar that forces the call then holds the arguments to it. With tool_choice "auto" the
model's calls are parsed, not validated: a call to a known function whose arguments break its
schema still comes back as a function_call; only malformed markup or an unknown name comes back as
message text.
"""

import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from bubo.engine.chat_request import (
    ChatRequest,
    generation_prompt,
    thinking_choice,
)
from bubo.engine.generate import TokenLogprob
from bubo.engine.output_format import output_constraint
from bubo.engine.request import (
    Finished,
    GenerationRequest,
    OutputDelta,
    OutputEvent,
    PromptProgress,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from bubo.engine.sampler import SamplingParams
from bubo.model.tokenizer import Tokenizer
from bubo.server.errors import ApiError
from bubo.server.fields import Body, bias_text_tokens, read_json, sampling_params
from bubo.server.keys import REQUEST_ID, STATE
from bubo.server.probe_fields import probe_json, with_probe
from bubo.server.request_context import new_id
from bubo.server.responses_input import (
    check_unsupported,
    function_tools,
    input_messages,
    reasoning_effort,
    text_config,
    tool_choice,
)
from bubo.server.sse import EventStream
from bubo.server.state import ServerState
from bubo.server.stream_extras import delta_timings, progress_json, with_stream_extras
from bubo.server.usage import gufo, timings

__all__ = ["routes"]


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # Bubo has no billed cache writes: the slot simply keeps whatever it last ran.
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
        "gufo": gufo(usage),
    }


@dataclass
class _Reply:
    """The response object's fixed fields, echoed from the request in every body and lifecycle event."""

    model: str
    echo: dict[str, Any]
    id: str = ""
    created_at: int = 0

    def __post_init__(self) -> None:
        self.id = new_id("resp_")
        self.created_at = int(time.time())

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        finished: Finished | None = None,
        error: ApiError | None = None,
    ) -> dict[str, Any]:
        incomplete = status == "incomplete"
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None if error is None else {"code": error.code, "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "output": output,
            **self.echo,
            "usage": _usage(finished.usage) if finished is not None else None,
        }
        if finished is not None:
            body["timings"] = timings(finished.usage)
            body.update(probe_json(finished))
        return body


def _status(finished: Finished) -> str:
    return "incomplete" if finished.finish_reason == "length" else "completed"


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _output_text(text: str, logprobs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def _message_item(
    item_id: str, text: str, status: str, logprobs: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_output_text(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _wanted_logprobs(body: Body) -> int | None:
    """`top_logprobs` (0-20 alternatives), or `include` naming message.output_text.logprobs (none);
    None when log probabilities are not asked for."""
    top = body.integer("top_logprobs", minimum=0, maximum=20)
    include = body.array("include", [])
    if top is None and "message.output_text.logprobs" not in include:
        return None
    return top or 0


class _Logprobs:
    """Token log probabilities in the Responses shape (token, logprob, bytes, top_logprobs)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def entries(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        return [
            {**self._token(lp.token_id, lp.logprob), "top_logprobs": [self._token(i, v) for i, v in lp.top]}
            for lp in logprobs
        ]


def _split_by_text(entries: list[dict[str, Any]], texts: Sequence[str]) -> list[list[dict[str, Any]]]:
    """The answer's token entries shared out over its runs of text (the message items), in order: each
    run takes tokens until their text covers its length; the last takes whatever is left."""
    shares: list[list[dict[str, Any]]] = []
    i = 0
    for n, text in enumerate(texts):
        share: list[dict[str, Any]] = []
        covered = 0
        while i < len(entries) and (covered < len(text) or n == len(texts) - 1):
            share.append(entries[i])
            covered += len(entries[i]["token"])
            i += 1
        shares.append(share)
    return shares


def _function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _output(finished: Finished, logprobs: _Logprobs | None = None) -> list[dict[str, Any]]:
    """The output items of a finished answer; a cut answer marks the item it was cut in incomplete.

    Messages and calls come in the order they were generated, as a stream sends them; an answer of
    only calls has no message (as OpenAI does), one of neither an empty message. With `logprobs`, each
    message carries its tokens' log probabilities.
    """
    cut = finished.finish_reason == "length"
    parts = finished.answer_parts() or [""]
    texts = [part for part in parts if isinstance(part, str)]
    entries = logprobs.entries(finished.content_logprobs) if logprobs is not None else []
    shares = iter(_split_by_text(entries, texts))
    output = []
    if finished.reasoning_text:
        status = (
            "incomplete" if cut and not finished.content_text and not finished.tool_calls else "completed"
        )
        output.append(_reasoning_item(new_id("rs_"), finished.reasoning_text, status))
    for i, part in enumerate(parts):
        if isinstance(part, str):
            status = "incomplete" if cut and i == len(parts) - 1 else "completed"
            output.append(_message_item(new_id("msg_"), part, status, next(shares)))
        else:
            output.append(_function_call_item(new_id("fc_"), part.id, part.name, part.arguments, "completed"))
    return output


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    loaded = state.require_ready()
    model = state.resolve_model(body.raw("model"))
    check_unsupported(body)
    instructions = body.string("instructions")
    messages = input_messages(body.raw("input"), instructions)
    effort = reasoning_effort(body)
    thinking, kwargs = thinking_choice(
        Body(
            {
                "reasoning_effort": effort,
                "thinking": body.raw("thinking"),
                "chat_template_kwargs": body.raw("chat_template_kwargs"),
            }
        )
    )
    tools = function_tools(body.raw("tools"))
    choice = tool_choice(body, tools)
    text, schema = text_config(body)
    stream = body.boolean("stream")
    params = sampling_params(
        body,
        state.settings.defaults,
        loaded.tokenizer.vocab_size,
        limit_fields=("max_output_tokens",),
        tokenize=bias_text_tokens(loaded.tokenizer),
    )
    chat = ChatRequest(
        messages,
        tools,
        thinking,
        kwargs,
        add_generation_prompt=generation_prompt(kwargs),
        tool_choice=choice,
    )
    top_logprobs = _wanted_logprobs(body)
    generation = await state.chat_generation(
        chat,
        params,
        size=body.size,
        logprobs=top_logprobs,
        constraint=output_constraint(body, schema, "text.format"),
        images=await state.load_images(chat),
    )
    generation = with_probe(with_stream_extras(generation, body, stream), body, state)
    reply = _Reply(model, _echo(body, params, instructions, text))
    logprobs = _Logprobs(loaded.tokenizer) if top_logprobs is not None else None
    if stream:
        return await _stream(request, state, generation, reply, logprobs)
    finished = await state.complete(generation)
    return web.json_response(
        reply.body(_status(finished), _output(finished, logprobs), finished),
        headers={"x-request-id": request[REQUEST_ID]},
    )


def _echo(
    body: Body, params: SamplingParams, instructions: str | None, text: dict[str, Any]
) -> dict[str, Any]:
    """The request settings a Response repeats back, with the values the generation really used."""
    reasoning = body.object("reasoning")
    return {
        "instructions": instructions,
        "max_output_tokens": params.max_tokens,
        "metadata": body.object("metadata", {}),
        "parallel_tool_calls": body.boolean("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": None} if reasoning else None,
        "store": False,
        "temperature": params.temperature,
        "text": text,
        "tool_choice": body.raw("tool_choice", "auto"),
        "tools": [dict(t) for t in body.array("tools", [])],
        "top_p": body.number("top_p", params.top_p),
        "truncation": "disabled",
        "user": body.string("user"),
    }


class _EventWriter:
    """Writes the Responses event sequence for one answer, opening and closing output items as the
    reasoning, the answer text and the function calls arrive."""

    def __init__(self, sse: EventStream, reply: _Reply, logprobs: _Logprobs | None = None) -> None:
        self.sse = sse
        self.reply = reply
        self.logprobs = logprobs
        self.open_logprobs: list[dict[str, Any]] = []  # the open message's token entries
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open_kind: str | None = None
        self.open_id = ""
        self.open_text: list[str] = []
        self.open_call = ("", "")  # the open function_call's call id and name

    async def send(self, kind: str, **fields: Any) -> None:
        await self.sse.send({"type": kind, "sequence_number": self.sequence, **fields}, event=kind)
        self.sequence += 1

    async def start(self) -> None:
        opening = self.reply.body("in_progress", [])
        await self.send("response.created", response=opening)
        await self.send("response.in_progress", response=opening)

    def _place(self) -> dict[str, Any]:
        return {"item_id": self.open_id, "output_index": len(self.output), "content_index": 0}

    async def _open(self, kind: str) -> None:
        self.open_kind = kind
        self.open_text = []
        self.open_logprobs = []
        index = len(self.output)
        if kind == "reasoning":
            self.open_id = new_id("rs_")
            item = _reasoning_item(self.open_id, "", "in_progress")
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            self.open_id = new_id("msg_")
            item = _message_item(self.open_id, "", "in_progress")
            part = {"type": "output_text", "text": "", "annotations": []}
        await self.send("response.output_item.added", output_index=index, item=item)
        await self.send("response.content_part.added", **self._place(), part=part)

    def _open_item(self, status: str) -> dict[str, Any]:
        """The open item as it stands: its text, or its call's arguments, so far."""
        text = "".join(self.open_text)
        if self.open_kind == "reasoning":
            return _reasoning_item(self.open_id, text, status)
        if self.open_kind == "function_call":
            return _function_call_item(self.open_id, *self.open_call, text, status)
        return _message_item(self.open_id, text, status, self.open_logprobs)

    async def _close(self, status: str) -> None:
        text = "".join(self.open_text)
        if self.open_kind == "reasoning":
            await self.send("response.reasoning_text.done", **self._place(), text=text)
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
        else:
            await self.send(
                "response.output_text.done", **self._place(), text=text, logprobs=self.open_logprobs
            )
            part = {"type": "output_text", "text": text, "annotations": []}
        item = self._open_item(status)
        await self.send("response.content_part.done", **self._place(), part=part)
        await self.send("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.open_kind = None

    async def delta(self, event: OutputDelta) -> None:
        if not event.text:
            return
        kind = "reasoning" if event.channel == "reasoning" else "message"
        if self.open_kind != kind:
            if self.open_kind is not None:
                await self._close("completed")
            await self._open(kind)
        self.open_text.append(event.text)
        if kind == "reasoning":
            await self.send("response.reasoning_text.delta", **self._place(), delta=event.text)
        else:
            entries = self.logprobs.entries(event.logprobs) if self.logprobs is not None else []
            self.open_logprobs += entries
            await self.send(
                "response.output_text.delta",
                **self._place(),
                delta=event.text,
                logprobs=entries,
                **delta_timings(event),
            )

    async def progress(self, event: PromptProgress) -> None:
        """llama-server's prompt_progress, on the lifecycle's own in-progress event."""
        opening = self.reply.body("in_progress", [])
        await self.send("response.in_progress", response=opening, prompt_progress=progress_json(event))

    async def tool_call(self, event: ToolCallStart | ToolCallArguments | ToolCallEnd) -> None:
        """A function_call item: added with empty arguments, then its argument fragments, then done.
        The parser sends a call's events together once the whole call is in, so no text interleaves."""
        if isinstance(event, ToolCallStart):
            if self.open_kind is not None:
                await self._close("completed")
            self.open_kind = "function_call"
            self.open_id = new_id("fc_")
            self.open_call = (event.id, event.name)
            self.open_text = []
            item = _function_call_item(self.open_id, event.id, event.name, "", "in_progress")
            await self.send("response.output_item.added", output_index=len(self.output), item=item)
            return
        place = {"item_id": self.open_id, "output_index": len(self.output)}
        if isinstance(event, ToolCallArguments):
            self.open_text.append(event.fragment)
            await self.send("response.function_call_arguments.delta", **place, delta=event.fragment)
            return
        await self.send("response.function_call_arguments.done", **place, arguments=event.arguments)
        item = _function_call_item(self.open_id, *self.open_call, event.arguments, "completed")
        await self.send("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.open_kind = None

    async def finish(self, finished: Finished) -> None:
        status = _status(finished)
        if self.open_kind == "reasoning":
            await self._close("incomplete" if status == "incomplete" else "completed")
        if self.open_kind is None and not finished.tool_calls:
            # Every answer without calls has a message, even an empty one (all reasoning, or nothing).
            await self._open("message")
        if self.open_kind is not None:
            await self._close(status)
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        await self.send(final, response=self.reply.body(status, self.output, finished))

    async def fail(self, error: ApiError) -> None:
        """End a response that fails with the protocol's two events for it: `error` (code, message,
        param), for clients that watch for errors, then `response.failed`, the lifecycle's last event
        as response.completed is a finished one's, for clients that follow the response's status. Its
        output is what was streamed: an item cut off midway is incomplete."""
        await self.send("error", code=error.code, message=error.message, param=error.param)
        output = self.output if self.open_kind is None else [*self.output, self._open_item("incomplete")]
        await self.send("response.failed", response=self.reply.body("failed", output, error=error))


async def _stream(
    request: web.Request,
    state: ServerState,
    generation: GenerationRequest,
    reply: _Reply,
    logprobs: _Logprobs | None,
) -> web.StreamResponse:
    async with aclosing(state.stream(generation)) as events:
        # The first event decides the status: failures before it still answer with their own code.
        first = await anext(events)
        sse = EventStream(request, request[REQUEST_ID])
        await sse.start()
        writer = _EventWriter(sse, reply, logprobs)
        try:
            await writer.start()
            event: OutputEvent | None = first
            while event is not None:
                if isinstance(event, Finished):
                    await writer.finish(event)
                    break
                if isinstance(event, OutputDelta):
                    await writer.delta(event)
                elif isinstance(event, PromptProgress):
                    await writer.progress(event)
                else:
                    await writer.tool_call(event)
                event = await anext(events, None)
        except ApiError as error:
            await writer.fail(error)
        except ConnectionResetError:
            return sse.response
        return await sse.finish()


def routes() -> list[web.RouteDef]:
    # Also without /v1, as llama-server serves it.
    return [web.post("/v1/responses", create_response), web.post("/responses", create_response)]
