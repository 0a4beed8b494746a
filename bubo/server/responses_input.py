"""The request side of the OpenAI Responses dialect (bubo/server/responses.py answers): a body's `input`
items and `instructions` as the template messages every dialect shares, its flat function tools in the
chat shape, `tool_choice`, `reasoning.effort` and `text.format`, and the stored-state features Bubo
refuses rather than ignores."""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from bubo.engine.chat_messages import chat_messages, message_content, text_content
from bubo.engine.chat_request import REASONING_EFFORTS, ToolChoice, named_tool_choice, require_function_tool
from bubo.engine.output_format import output_schema, strict_schema
from bubo.server.errors import ApiError, bad_field
from bubo.server.fields import Body, json_text

__all__ = [
    "check_unsupported",
    "function_tools",
    "input_messages",
    "reasoning_effort",
    "text_config",
    "tool_choice",
]

_MESSAGE_ROLES = ("system", "developer", "user", "assistant")
# Stateful or hosted features: Bubo keeps no responses and runs no hosted tools.
_UNSUPPORTED_FIELDS = {
    "previous_response_id": "previous_response_id: stored responses are not supported; send the "
    "whole conversation in input",
    "conversation": "conversation: stored conversations are not supported; send the whole "
    "conversation in input",
    "prompt": "prompt: stored prompt templates are not supported; send instructions and input",
}


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
            isinstance(p, Mapping) and p.get("type") == part_type and isinstance(p.get("text"), str)
            for p in parts
        ):
            raise bad_field(f"{where}.{key}", f"must be an array of {part_type} parts with text")
        if parts:
            return "\n".join(p["text"] for p in parts)
    return ""


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_field(f"{where}.{key}", "is required and must be a non-empty string")
    return value


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A function_call item as an OpenAI chat tool call; the arguments must be JSON."""
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise bad_field(f"{where}.arguments", "must be a JSON string")
    parsed = json_text(arguments, f"{where}.arguments") if arguments.strip() else {}
    return {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": _string(item, "name", where), "arguments": parsed},
    }


def input_messages(raw: Any, instructions: str | None = None) -> list[dict[str, Any]]:
    """`input` (a string or an array of items) and `instructions` as OpenAI-style template messages.

    Consecutive function_call items become one assistant turn (parallel calls), joined to the
    assistant message just before them; a function_call_output becomes a tool message; a reasoning
    item's text becomes the reasoning_content of the next assistant turn.
    """
    if raw is None or raw == "" or raw == []:
        raise ApiError(
            400,
            "missing_input",
            "input is required: a string, or a non-empty array of input items",
            param="input",
        )
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise bad_field("input", "must be a string or an array of input items")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None
    call_names: dict[str, str] = {}

    def assistant_turn() -> dict[str, Any]:
        """The assistant message function calls join: the last message, if the assistant wrote it."""
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if reasoning is not None:
            last["reasoning_content"] = "\n".join(filter(None, (last.get("reasoning_content"), reasoning)))
            reasoning = None
        return last

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad_field(where, "an input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise bad_field(f"{where}.role", f"must be one of {', '.join(_MESSAGE_ROLES)}; got {role!r}")
            content = message_content(item.get("content"), f"{where}.content", images=role == "user")
            message = {"role": role, "content": content}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"] = reasoning
                reasoning = None
            messages.append(message)
        elif kind == "function_call":
            call = _function_call(item, where)
            call_names[call["id"]] = call["function"]["name"]
            assistant_turn().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            tool: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": call_id,
                "content": text_content(item.get("output"), f"{where}.output"),
            }
            if call_id in call_names:
                tool["name"] = call_names[call_id]
            messages.append(tool)
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        elif kind == "item_reference":
            raise ApiError(
                400,
                "unsupported_item",
                f"{where}: item_reference needs stored items, which Bubo does not keep; send the item itself",
                param=f"{where}.type",
            )
        else:
            raise bad_field(
                f"{where}.type",
                f"must be message, function_call, function_call_output or reasoning; got {kind!r}",
            )
    if not any(m["role"] != "system" for m in messages):
        raise ApiError(400, "missing_input", "input holds no message to answer", param="input")
    return chat_messages(messages, "input")


def function_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Responses function tools (flat: name, description, parameters, strict) in the OpenAI chat
    shape the templates know. `strict` is kept only when it is true or false: absent or null means
    the schema is used as sent; true makes it strict (`strict_schema`), false keeps it as sent."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_field("tools", "must be an array of tool objects")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise bad_field(where, "a tool must be an object")
        require_function_tool(tool, where)
        function: dict[str, Any] = {"name": _string(tool, "name", where)}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise bad_field(f"{where}.description", "must be a string")
            function["description"] = description
        parameters = tool.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise bad_field(f"{where}.parameters", "must be a JSON schema object")
            function["parameters"] = dict(parameters)
        strict = tool.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise bad_field(f"{where}.strict", "must be true, false or null")
            function["strict"] = strict
            if strict:
                parameters = function.get("parameters", {"type": "object"})
                function["parameters"] = strict_schema(parameters, f"{where}.parameters")
        tools.append({"type": "function", "function": function})
    return tools or None


def tool_choice(body: Body, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """`tool_choice` ("none" / "auto" / "required" / {"type": "function", "name"}) and
    `parallel_tool_calls`. A named function must be among the tools and is called once."""
    choice = body.raw("tool_choice", "auto")
    parallel = body.boolean("parallel_tool_calls", True)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return replace(named_tool_choice(choice.get("name"), tools, "tool_choice.name"), parallel=False)
    if choice not in ("none", "auto", "required"):
        raise bad_field(
            "tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}'
        )
    if choice == "required" and not tools:
        raise bad_field("tool_choice", '"required" needs tools')
    return ToolChoice(mode=choice, parallel=parallel)


def reasoning_effort(body: Body) -> str | None:
    """`reasoning.effort`, in chat's terms: OpenAI's "none" is chat's "off"."""
    reasoning = body.object("reasoning")
    if reasoning is None:
        return None
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort == "none":
        return "off"
    if effort not in REASONING_EFFORTS:
        raise bad_field(
            "reasoning.effort", f"must be one of none, {', '.join(REASONING_EFFORTS)}; got {effort!r}"
        )
    return effort


def text_config(body: Body) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`text` as echoed back, and the JSON schema its `format` asks for (None for plain text)."""
    text = body.object("text") or {}
    fmt = text.get("format") or {"type": "text"}
    return {**text, "format": fmt}, output_schema(fmt, "text.format")


def check_unsupported(body: Body) -> None:
    """Refuse what needs stored state (earlier responses, conversations, prompts, background runs)."""
    for name, message in _UNSUPPORTED_FIELDS.items():
        if name in body:
            raise ApiError(400, f"unsupported_{name}", message, param=name)
    if body.boolean("background"):
        raise ApiError(
            400,
            "unsupported_background",
            "background: background responses need stored responses, which Bubo does not keep",
            param="background",
        )
    metadata = body.object("metadata")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise bad_field("metadata", "values must be strings")
    body.boolean("store")
