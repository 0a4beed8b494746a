"""The Anthropic dialect: POST /v1/messages (JSON or SSE) and POST /v1/messages/count_tokens.

Anthropic clients (the official SDK, agents) send content blocks: text, tool_use, tool_result,
thinking. This adapter turns them into the OpenAI-style template messages that
bubo/engine/chat_messages.py checks (tool_use becomes assistant `tool_calls`, tool_result a `tool`
message, thinking `reasoning_content`), runs the neutral request, and writes the answer as a `message`
with thinking, text and tool_use blocks, or as Anthropic's named SSE events (message_start,
content_block_*, message_delta, message_stop).

Tool-call ids: the engine names a call "call_X" and the client sees "toolu_X"; ids coming back in the
history ("toolu_X" on a tool_use and on its tool_result) are turned back into "call_X", so the
template sees the same ids whichever dialect carried the conversation.

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens that were computed, and
`cache_read_input_tokens` those the prompt cache served, so their sum is the whole prompt.
"""

import json
from collections.abc import Mapping
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from bubo.engine.chat_messages import IMAGE_PART, ImagePart, chat_messages
from bubo.engine.chat_request import (
    ChatRequest,
    ThinkingChoice,
    ToolChoice,
    generation_prompt,
    named_tool_choice,
    thinking_choice,
    tool_list,
)
from bubo.engine.output_format import output_constraint, output_schema
from bubo.engine.request import (
    Finished,
    GenerationRequest,
    OutputDelta,
    OutputEvent,
    ToolCallArguments,
    ToolCallEvent,
    ToolCallStart,
    Usage,
)
from bubo.engine.sampler import SamplingParams
from bubo.server.errors import ApiError, bad_field, error_body
from bubo.server.fields import Body, read_json, sampling_params, stop_strings
from bubo.server.keys import REQUEST_ID, STATE
from bubo.server.probe_fields import probe_json, with_probe
from bubo.server.request_context import new_id
from bubo.server.sse import EventStream
from bubo.server.state import ServerState
from bubo.server.usage import gufo, timings

__all__ = ["routes"]

_STOP_REASONS = {
    "eos": "end_turn",
    "stop_string": "stop_sequence",
    "max_tokens": "max_tokens",
    "context": "max_tokens",
    # A cancelled generation has no reader left; the value only has to be a valid one.
    "cancelled": "end_turn",
}
# Block types that carry something no model here can read (images are read in user turns).
_UNSUPPORTED_BLOCKS = ("document", "search_result", "container_upload")
# The sampling fields Anthropic defines; other llama-server knobs are not part of this dialect.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens")
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_CALL_PREFIX = "call_"
_TOOL_USE_PREFIX = "toolu_"


def _tool_use_id(call_id: str) -> str:
    """The Anthropic-style id of an engine call id ("call_X" becomes "toolu_X")."""
    return _TOOL_USE_PREFIX + call_id.removeprefix(_CALL_PREFIX)


def _call_id(tool_use_id: str) -> str:
    """The engine-style id of a tool_use id from the history; ids of other origins pass unchanged."""
    if tool_use_id.startswith(_TOOL_USE_PREFIX):
        return _CALL_PREFIX + tool_use_id.removeprefix(_TOOL_USE_PREFIX)
    return tool_use_id


def _unsupported(kind: str, where: str) -> ApiError:
    return ApiError(
        400,
        "unsupported_content",
        f"{where}: {kind!r} blocks are not supported",
        param=where,
    )


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, Mapping):
        raise bad_field(where, "a content block must be an object")
    kind = block.get("type")
    if kind in _UNSUPPORTED_BLOCKS:
        raise _unsupported(kind, where)
    if not isinstance(kind, str):
        raise bad_field(f"{where}.type", "is required")
    return kind


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_field(f"{where}.text", "must be a string")
    return text


def _text_blocks(content: Any, where: str) -> str:
    """A string, or an array of text blocks joined by newlines (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or an array of text blocks")
    texts = []
    for i, block in enumerate(content):
        kind = _block_type(block, f"{where}[{i}]")
        if kind == "image":
            raise ApiError(
                400,
                "unsupported_content",
                f"{where}[{i}]: images are taken in user messages only",
                param=f"{where}[{i}]",
            )
        if kind != "text":
            raise bad_field(f"{where}[{i}].type", f"must be text here, got {kind!r}")
        texts.append(_text(block, f"{where}[{i}]"))
    return "\n".join(texts)


def _user_messages(content: list[Any], where: str) -> list[dict[str, Any]]:
    """One user turn: its text and images, and each tool_result as a `tool` message, in the order sent."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append({"type": IMAGE_PART, "image": _image(block, at)})
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": _user_content(parts)})
                parts = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_field(f"{at}.tool_use_id", "must be a non-empty string")
            result = _text_blocks(block.get("content", ""), f"{at}.content")
            out.append({"role": "tool", "tool_call_id": _call_id(call_id), "content": result})
        else:
            raise bad_field(
                f"{at}.type", f"a user message takes text, image and tool_result blocks, not {kind!r}"
            )
    if parts or not out:
        out.append({"role": "user", "content": _user_content(parts)})
    return out


def _user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text only: one string, as the template has always seen it; with images: the parts."""
    if any(p["type"] == IMAGE_PART for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image(block: Mapping[str, Any], at: str) -> ImagePart:
    """An image block's source: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "base64":
        assert isinstance(source, Mapping)
        data = source.get("data")
        if not isinstance(data, str) or not data:
            raise bad_field(f"{at}.source.data", "must be base64 text")
        return ImagePart(f"{at}.source.data", at, "image", data=data)
    if kind == "url":
        assert isinstance(source, Mapping)
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise bad_field(f"{at}.source.url", "must be a URL string")
        return ImagePart(f"{at}.source.url", at, "image", url=url)
    raise bad_field(f"{at}.source.type", f'must be "base64" or "url"; got {kind!r}')


def _assistant_message(content: list[Any], where: str) -> dict[str, Any]:
    """One assistant turn: text, tool_use as tool_calls, thinking as reasoning_content."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}[{i}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise bad_field(f"{at}.thinking", "must be a string")
            thoughts.append(thinking)
        elif kind == "redacted_thinking":
            # Its `data` is another server's encrypted reasoning: nothing this model can read.
            continue
        elif kind == "tool_use":
            name = block.get("name")
            call_id = block.get("id")
            arguments = block.get("input", {})
            if not isinstance(name, str) or not name:
                raise bad_field(f"{at}.name", "must be a non-empty string")
            if not isinstance(call_id, str) or not call_id:
                raise bad_field(f"{at}.id", "must be a non-empty string")
            if not isinstance(arguments, Mapping):
                raise bad_field(f"{at}.input", "must be an object")
            function = {"name": name, "arguments": dict(arguments)}
            calls.append({"id": _call_id(call_id), "type": "function", "function": function})
        else:
            raise bad_field(
                f"{at}.type", f"an assistant message takes text, thinking and tool_use blocks, not {kind!r}"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _template_messages(body: Body) -> list[dict[str, Any]]:
    """`system` and `messages` as OpenAI-style template messages, checked by chat_messages."""
    raw = body.raw("messages")
    if raw is None or raw == []:
        raise ApiError(
            400, "missing_messages", "messages is required and must be a non-empty array", param="messages"
        )
    if not isinstance(raw, list):
        raise bad_field("messages", "must be a non-empty array of messages")
    out: list[dict[str, Any]] = []
    system = body.raw("system")
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise bad_field(where, "a message must be an object")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad_field(f"{where}.role", f"must be user or assistant; got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad_field(f"{where}.content", "must be a string or an array of content blocks")
        elif role == "user":
            out += _user_messages(content, f"{where}.content")
        else:
            out.append(_assistant_message(content, f"{where}.content"))
    return chat_messages(out)


def _tools(body: Body) -> list[dict[str, Any]] | None:
    """Anthropic tools ({name, description, input_schema}) as the OpenAI function tools templates know."""
    tools = tool_list(body.raw("tools"))
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise ApiError(
                400,
                "unsupported_tool",
                f"{where}.type: server tools such as {kind!r} are not available; define a custom tool",
                param="tools",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{where}.name", "must be a non-empty string")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise bad_field(f"{where}.input_schema", "must be a JSON schema object")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_field(f"{where}.description", "must be a string")
        function: dict[str, Any] = {"name": name, "parameters": dict(schema)}
        if description is not None:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body: Body, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """Anthropic's `tool_choice`: auto, any (at least one call), tool (that one), none (no tools shown).

    `disable_parallel_tool_use` allows at most one call (exactly one for any and tool).
    """
    choice = body.object("tool_choice")
    if choice is None:
        return ToolChoice()
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_field("tool_choice.type", f"must be auto, any, tool or none; got {kind!r}")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise bad_field("tool_choice.disable_parallel_tool_use", "must be true or false")
    if kind == "tool":
        return replace(named_tool_choice(choice.get("name"), tools, "tool_choice.name"), parallel=not single)
    if kind == "any" and not tools:
        raise bad_field("tool_choice.type", '"any" needs tools')
    mode = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return ToolChoice(mode=mode, parallel=not single)


def _thinking(body: Body) -> tuple[ThinkingChoice, dict[str, Any]]:
    """Anthropic's `thinking` and `output_config.effort`, read by the shared thinking switch.

    The template has one switch, so "between_tools" (thinking only between tool calls) counts as
    enabled, and an effort level is the reasoning effort unless thinking is disabled. `budget_tokens`
    becomes the reasoning budget: when it runs out the server closes the reasoning block.
    """
    data = dict(body.data)
    thinking = body.object("thinking") or {}
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise bad_field("thinking.display", "must be summarized or omitted")
    if thinking.get("type") == "between_tools":
        data["thinking"] = {**thinking, "type": "enabled"}
    output = body.object("output_config") or {}
    effort = output.get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise bad_field("output_config.effort", f"must be one of {', '.join(_EFFORTS)}; got {effort!r}")
        if thinking.get("type") != "disabled" and "reasoning_effort" not in body:
            data["reasoning_effort"] = effort
    return thinking_choice(Body(data))


def _chat_request(body: Body) -> ChatRequest:
    """Everything that shapes the prompt, shared by messages and count_tokens."""
    messages = _template_messages(body)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    thinking, kwargs = _thinking(body)
    body.object("metadata")
    return ChatRequest(
        messages, tools, thinking, kwargs, add_generation_prompt=generation_prompt(kwargs), tool_choice=choice
    )


def _omit_thinking(body: Body) -> bool:
    """`thinking.display: "omitted"`: thinking blocks are sent, their text is not."""
    return (body.object("thinking") or {}).get("display") == "omitted"


def _max_tokens(body: Body) -> int:
    """Anthropic requires max_tokens, a positive integer (no -1 for the server default here)."""
    if "max_tokens" not in body:
        raise ApiError(
            400, "missing_max_tokens", "max_tokens is required: a positive integer", param="max_tokens"
        )
    limit = body.count("max_tokens")
    assert limit is not None
    return limit


def _sampling(body: Body, defaults: SamplingParams, vocab_size: int) -> SamplingParams:
    _max_tokens(body)
    fields = Body({name: body.data[name] for name in _SAMPLING_FIELDS if name in body.data})
    params = sampling_params(fields, defaults, vocab_size)
    array = body.array("stop_sequences")
    if array is None:
        return params
    return replace(params, stop=stop_strings(array, "stop_sequences"))


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "gufo": gufo(usage),
    }


def _stop(finished: Finished) -> tuple[str, str | None]:
    """stop_reason and stop_sequence for a finished generation."""
    if finished.finish_reason == "tool_calls":
        return "tool_use", None
    result = finished.result
    reason = _STOP_REASONS[result.stop_reason]
    return reason, result.stop_string if reason == "stop_sequence" else None


def _message(message_id: str, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
    }


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    loaded = state.require_ready()
    model = state.resolve_model(body.raw("model"))
    chat = _chat_request(body)
    stream = body.boolean("stream")
    params = _sampling(body, state.settings.defaults, loaded.tokenizer.vocab_size)
    output = body.object("output_config") or {}
    schema = output_schema(output.get("format") or {"type": "text"}, "output_config.format")
    generation = await state.chat_generation(
        chat,
        params,
        size=body.size,
        constraint=output_constraint(body, schema, "output_config.format"),
        images=await state.load_images(chat),
    )
    generation = with_probe(generation, body, state)
    message_id = new_id("msg_")
    omit = _omit_thinking(body)
    if stream:
        return await _stream(request, state, generation, _message(message_id, model, []), omit)
    finished = await state.complete(generation)
    content: list[dict[str, Any]] = []
    if generation.reasoning and finished.reasoning_text:
        thinking = "" if omit else finished.reasoning_text
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    # Text and tool_use blocks in the order they were generated, as a stream sends them.
    content += [
        {"type": "text", "text": part}
        if isinstance(part, str)
        else _tool_use(part.id, part.name, json.loads(part.arguments))
        for part in finished.answer_parts()
    ]
    stop_reason, stop_sequence = _stop(finished)
    answer = {
        **_message(message_id, model, content),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(finished.usage),
        "timings": timings(finished.usage),
        **probe_json(finished),
    }
    return web.json_response(answer, headers={"x-request-id": request[REQUEST_ID]})


def _tool_use(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_use_id(call_id), "name": name, "input": arguments}


class _Blocks:
    """Opens content blocks lazily as the channel changes, numbering them, and closes them.

    A tool call is a block of its own: its start event opens it (closing any text block first), its
    argument fragments are `input_json_delta`s, and its end closes it.
    """

    def __init__(self, sse: EventStream, omit_thinking: bool) -> None:
        self.sse = sse
        self.omit_thinking = omit_thinking
        self.index = -1
        self.kind: str | None = None

    async def write(self, event: OutputDelta | ToolCallEvent) -> None:
        if not isinstance(event, OutputDelta):
            await self._tool(event)
            return
        if not event.text:
            return
        kind = "thinking" if event.channel == "reasoning" else "text"
        if kind != self.kind:
            await self.close()
            self.index += 1
            self.kind = kind
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            await self._send("content_block_start", content_block=block)
        if kind == "thinking" and self.omit_thinking:
            return
        delta = (
            {"type": "thinking_delta", "thinking": event.text}
            if kind == "thinking"
            else {"type": "text_delta", "text": event.text}
        )
        await self._send("content_block_delta", delta=delta)

    async def _tool(self, event: ToolCallEvent) -> None:
        if isinstance(event, ToolCallStart):
            await self.close()
            self.index += 1
            self.kind = "tool_use"
            await self._send("content_block_start", content_block=_tool_use(event.id, event.name, {}))
        elif isinstance(event, ToolCallArguments):
            await self._send(
                "content_block_delta", delta={"type": "input_json_delta", "partial_json": event.fragment}
            )
        else:
            await self.close()

    async def close(self) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":
            # Clients pass the signature back with the block; Bubo does not sign its reasoning.
            await self._send("content_block_delta", delta={"type": "signature_delta", "signature": ""})
        await self._send("content_block_stop")
        self.kind = None

    async def _send(self, name: str, **fields: Any) -> None:
        await self.sse.send({"type": name, "index": self.index, **fields}, event=name)


async def _stream(
    request: web.Request,
    state: ServerState,
    generation: GenerationRequest,
    message: dict[str, Any],
    omit_thinking: bool,
) -> web.StreamResponse:
    request_id = request[REQUEST_ID]
    async with aclosing(state.stream(generation)) as events:
        # Failures before the first event (a busy or lost device) still get a status code.
        first = await anext(events)
        sse = EventStream(request, request_id)
        await sse.start()
        try:
            start_usage = {
                "input_tokens": len(generation.prompt_ids),
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            }
            await sse.send(
                {"type": "message_start", "message": {**message, "usage": start_usage}}, event="message_start"
            )
            await sse.send({"type": "ping"}, event="ping")
            blocks = _Blocks(sse, omit_thinking)
            event: OutputEvent | None = first
            while event is not None and not isinstance(event, Finished):
                await blocks.write(event)
                event = await anext(events, None)
            if event is not None:
                await blocks.close()
                stop_reason, stop_sequence = _stop(event)
                await sse.send(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": _usage(event.usage),
                        "timings": timings(event.usage),
                        **probe_json(event),
                    },
                    event="message_delta",
                )
                await sse.send({"type": "message_stop"}, event="message_stop")
        except ApiError as error:
            # The same body the error middleware writes, so a stream fails as a request would.
            await sse.send(error_body(error, anthropic=True, request_id=request_id), event="error")
        except ConnectionResetError:
            return sse.response
        return await sse.finish()


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's token count as generation would see it; the context length does not limit it."""
    state = request.app[STATE]
    body = await read_json(request)
    state.require_ready()
    state.resolve_model(body.raw("model"))
    if body.boolean("stream"):
        raise ApiError(
            400,
            "unsupported_stream",
            "stream: count_tokens answers with one JSON object, not a stream",
            param="stream",
        )
    chat = _chat_request(body)
    if chat.images:
        where = chat.images[0].param
        raise ApiError(
            400, "unsupported_content", f"{where}: count_tokens does not count images", param=where
        )
    prompt = await state.prompt_work(body.size, state.render_prompt, chat)
    return web.json_response({"input_tokens": len(prompt.ids)}, headers={"x-request-id": request[REQUEST_ID]})


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/messages", messages), web.post("/v1/messages/count_tokens", count_tokens)]
