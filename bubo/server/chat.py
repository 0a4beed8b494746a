"""Chat requests, whatever their dialect, as the template sees them, and the thinking switch.

Each dialect turns its own message format into OpenAI-style template messages (role, content,
tool_calls, tool_call_id, reasoning_content); this module checks them, decides whether thinking is on
from `reasoning_effort` / `thinking` / `chat_template_kwargs` (which must agree), and renders them
with the model's template into the prompt text and tokens the engine runs.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from bubo.server.errors import ApiError, bad_field
from bubo.server.fields import Body, json_text
from bubo.server.image_input import ImagePart

__all__ = [
    "IMAGE_PART",
    "REASONING_BUDGETS",
    "REASONING_EFFORTS",
    "ChatRequest",
    "ThinkingChoice",
    "ToolChoice",
    "chat_images",
    "chat_messages",
    "chat_request",
    "chat_tools",
    "generation_prompt",
    "message_content",
    "named_tool_choice",
    "openai_tool_choice",
    "output_schema",
    "require_function_tool",
    "strict_schema",
    "text_content",
    "thinking_choice",
    "tool_list",
    "without_image_sources",
]

REASONING_EFFORTS = ("off", "minimal", "low", "medium", "high", "xhigh", "max")
# The reasoning token budget of each effort level (README, "Thinking"): when it runs out the server
# closes the reasoning block and the model writes its answer. "max" and no level at all: no budget.
REASONING_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ThinkingChoice:
    """`enabled` None leaves the template's default; `effort` is the requested level, if any;
    `budget_tokens` an explicit reasoning budget (Anthropic's `thinking.budget_tokens`)."""

    enabled: bool | None = None
    effort: str | None = None
    budget_tokens: int | None = None

    @property
    def budget(self) -> int | None:
        """Reasoning tokens allowed before the server closes the block; None for no limit."""
        if self.budget_tokens is not None:
            return self.budget_tokens
        return REASONING_BUDGETS.get(self.effort or "")


@dataclass(frozen=True)
class ToolChoice:
    """How the answer may use the tools: "auto" (the model decides), "required" (at least one call),
    "none" (no calls; the tools are not shown), or `name` (exactly that function). `parallel` allows
    several calls in one answer."""

    mode: Literal["auto", "required", "none"] = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode == "required" or self.name is not None


@dataclass
class ChatRequest:
    """A conversation ready for the template."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    thinking: ThinkingChoice = field(default_factory=ThinkingChoice)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    tool_choice: ToolChoice = field(default_factory=ToolChoice)

    @property
    def images(self) -> list[ImagePart]:
        return chat_images(self.messages)


# Template variables that come from the request itself (ChatTemplate.render's own arguments).
TEMPLATE_INPUTS = frozenset({"messages", "tools", "documents"})


def thinking_choice(body: Body) -> tuple[ThinkingChoice, dict[str, Any]]:
    """Read `reasoning_effort`, `thinking` (its `budget_tokens`, a positive integer, is the reasoning
    budget) and `chat_template_kwargs`; 400 when they disagree.

    Returns the choice and the remaining template kwargs (enable_thinking / reasoning_effort are
    re-derived from the choice, so the template always sees one consistent answer).
    """
    effort = body.string("reasoning_effort", choices=REASONING_EFFORTS)
    enabled: bool | None = None if effort is None else effort != "off"

    thinking = body.object("thinking")
    budget = None
    if thinking is not None:
        budget = Body({"thinking.budget_tokens": thinking.get("budget_tokens")}).count(
            "thinking.budget_tokens"
        )
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_field("thinking", f'type must be "enabled" or "disabled", got {kind!r}')
        wanted = kind != "disabled"
        if enabled is not None and wanted != enabled:
            raise _conflict("thinking", f"thinking.type {kind!r} contradicts reasoning_effort {effort!r}")
        enabled = wanted

    kwargs = dict(body.object("chat_template_kwargs") or {})
    for name in TEMPLATE_INPUTS.intersection(kwargs):
        # The template takes these from the request itself; a second value would clash with it.
        raise bad_field(f"chat_template_kwargs.{name}", f"the request's own {name} is what the template gets")
    if "enable_thinking" in kwargs:
        flag = kwargs.pop("enable_thinking")
        if not isinstance(flag, bool):
            raise bad_field("chat_template_kwargs.enable_thinking", "must be true or false")
        if enabled is not None and flag != enabled:
            raise _conflict(
                "chat_template_kwargs", f"enable_thinking={flag} contradicts the request's thinking setting"
            )
        enabled = flag
    if "reasoning_effort" in kwargs:
        level = kwargs.pop("reasoning_effort")
        if level not in REASONING_EFFORTS:
            raise bad_field(
                "chat_template_kwargs.reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}"
            )
        if effort is not None and level != effort:
            raise _conflict("chat_template_kwargs", f"reasoning_effort {level!r} contradicts {effort!r}")
        if enabled is not None and (level != "off") != enabled:
            raise _conflict(
                "chat_template_kwargs", f"reasoning_effort {level!r} contradicts the thinking setting"
            )
        effort, enabled = level, level != "off"
    return ThinkingChoice(enabled, effort, budget), kwargs


def generation_prompt(kwargs: dict[str, Any], body: Body | None = None) -> bool:
    """Whether the prompt ends by opening the assistant's turn: `add_generation_prompt` (default true)
    in `kwargs`, the chat_template_kwargs (taken out of them: the template gets it from here), or at
    the top of a chat-completions `body`, where llama-server and vLLM take it; 400 when the two
    disagree. A chat that ends with an assistant message is continued either way (ServerState.render)."""
    flag = True if body is None else body.boolean("add_generation_prompt", True)
    if "add_generation_prompt" in kwargs:
        given = kwargs.pop("add_generation_prompt")
        if not isinstance(given, bool):
            raise bad_field("chat_template_kwargs.add_generation_prompt", "must be true or false")
        if body is not None and "add_generation_prompt" in body and given != flag:
            raise _conflict(
                "chat_template_kwargs", f"add_generation_prompt={given} contradicts the top-level {flag}"
            )
        flag = given
    return flag


def _conflict(field_name: str, message: str) -> ApiError:
    return ApiError(400, "conflicting_fields", f"{field_name}: {message}", param=field_name)


_TEXT_PARTS = ("text", "input_text", "output_text")
_MEDIA_PARTS = ("image", "input_audio", "input_file", "video", "file")
# The neutral image part the dialects put in a message's content: {"type": "image", "image": ImagePart}.
IMAGE_PART = "image"


def text_content(content: Any, where: str) -> str:
    """A message's content as one string: a string as is, an array of text parts (a refusal counts as
    text) joined by newlines. Media parts are refused here (tool results, assistant turns)."""
    parts = message_content(content, where, images=False)
    assert isinstance(parts, str)
    return parts


def message_content(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message's content for the template: a string as is; an array of text parts joined into one
    string; with image parts (where `images` allows them: user messages), a list of text parts and
    neutral image parts in the order sent, for the template to put its vision tokens between."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or an array of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(part, Mapping):
            raise bad_field(at, "a content part must be an object")
        kind = part.get("type")
        image = _image_part(part, at, where)
        if image is not None:
            if not images:
                raise ApiError(
                    400, "unsupported_content", f"{at}: images are taken in user messages only", param=where
                )
            parts.append({"type": IMAGE_PART, "image": image})
        elif kind in _TEXT_PARTS or kind == "refusal":
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise bad_field(f"{at}.{key}", "must be a string")
            parts.append({"type": "text", "text": text})
        elif kind in _MEDIA_PARTS:
            raise ApiError(400, "unsupported_content", f"{at}: {kind!r} parts are not supported", param=where)
        else:
            raise bad_field(f"{at}.type", f"unknown content part type {kind!r}")
    if any(p["type"] == IMAGE_PART for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image_part(part: Mapping[str, Any], at: str, param: str) -> ImagePart | None:
    """The image of an OpenAI chat `image_url` part, a Responses `input_image` part, or a neutral image
    part a dialect made already; None for other parts."""
    kind = part.get("type")
    if kind == IMAGE_PART and isinstance(part.get("image"), ImagePart):
        return part["image"]
    if kind == "image_url":
        holder = part.get("image_url")
        url = holder.get("url") if isinstance(holder, Mapping) else holder
        where = f"{at}.image_url.url" if isinstance(holder, Mapping) else f"{at}.image_url"
    elif kind == "input_image":
        if part.get("file_id") is not None and part.get("image_url") is None:
            raise ApiError(
                400,
                "unsupported_content",
                f"{at}.file_id: Bubo keeps no uploaded files; send the image as image_url",
                param=param,
            )
        url, where = part.get("image_url"), f"{at}.image_url"
    else:
        return None
    if not isinstance(url, str) or not url:
        raise bad_field(where, "must be a URL string (data:image/...;base64,... or https://...)")
    return ImagePart(where, param, kind, url=url)


def chat_images(messages: list[dict[str, Any]]) -> list[ImagePart]:
    """The image parts of template messages, in the order the template renders them."""
    return [
        part["image"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == IMAGE_PART
    ]


def without_image_sources(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: each image part only {"type": "image"}."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            stripped = [{"type": IMAGE_PART} if p.get("type") == IMAGE_PART else p for p in content]
            message = {**message, "content": stripped}
        out.append(message)
    return out


def chat_messages(raw: Any, field_name: str = "messages") -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten text-part content; 400 missing_messages when absent."""
    if raw is None or raw == []:
        raise ApiError(
            400,
            "missing_messages",
            f"{field_name} is required and must be a non-empty array",
            param=field_name,
        )
    if not isinstance(raw, list):
        raise bad_field(field_name, "must be a non-empty array of messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"{field_name}[{i}]"
        if not isinstance(message, Mapping):
            raise bad_field(where, "a message must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise bad_field(f"{where}.role", f"must be one of {', '.join(_ROLES)}; got {role!r}")
        out = dict(message)
        if role == "developer":
            out["role"] = "system"
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise bad_field(f"{where}.content", "is required")
            # OpenAI's tool-call answers carry `content: null`, and clients send them back as they got
            # them. Templates that read `message.content` unguarded (Qwen3, QwQ, SmolLM2) fail on a
            # missing one; every template that takes a missing one renders "" the same (vLLM and
            # llama.cpp substitute "" too).
            out["content"] = ""
        else:
            out["content"] = message_content(content, f"{where}.content", images=role == "user")
        calls = message.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        messages.append(out)
    return messages


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Assistant tool calls as the templates expect them: arguments as an object when they parse."""

    if not isinstance(calls, list):
        raise bad_field(where, "must be an array")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_field(f"{where}[{i}].function", "must be an object with a name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json_text(arguments, f"{where}[{i}].function.arguments") if arguments.strip() else {}
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def tool_list(tools: Any, field_name: str = "tools") -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise bad_field(field_name, "must be an array of tool objects")
    return [dict(t) for t in tools] or None


def require_function_tool(tool: Mapping[str, Any], where: str) -> None:
    """400 unsupported_tool unless `tool` (at `where`) is a function tool, the one kind served."""
    if tool.get("type") != "function":
        raise ApiError(
            400,
            "unsupported_tool",
            f"{where}.type: only function tools are supported, got {tool.get('type')!r}",
            param=f"{where}.type",
        )


def chat_tools(raw: Any) -> list[dict[str, Any]] | None:
    """OpenAI chat `tools`: {"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}, a strict function's schema made strict (`strict_schema`). Checked here because the templates, the tool-call parser and the forcing grammar all index into
    them: a tool without a name or with a non-object schema would otherwise fail deep inside (a 500)."""
    tools = tool_list(raw)
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.get("type") is None:
            raise bad_field(f"{where}.type", 'is required: "function"')
        require_function_tool(tool, where)
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise bad_field(f"{where}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{where}.function.name", "must be a non-empty string")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_field(f"{where}.function.description", "must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise bad_field(f"{where}.function.parameters", "must be a JSON schema object")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_field(f"{where}.function.strict", "must be true, false or null")
        if strict:
            # OpenAI's strict function calling: the schema the template shows and the forcing grammar
            # holds the arguments to requires every property (as Responses' strict tools do).
            strict_parameters = strict_schema(
                parameters or {"type": "object"}, f"{where}.function.parameters"
            )
            tools[i] = {**tool, "function": {**function, "parameters": strict_parameters}}
    return tools


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [str(t.get("function", t).get("name")) for t in tools or []]


def named_tool_choice(name: Any, tools: list[dict[str, Any]] | None, field_name: str) -> ToolChoice:
    """A choice of one function, which must be among the tools."""
    if not isinstance(name, str) or not name:
        raise bad_field(field_name, "must name a function")
    if name not in tool_names(tools):
        raise bad_field(
            field_name, f"{name!r} is not one of the tools ({', '.join(tool_names(tools)) or 'none given'})"
        )
    return ToolChoice(name=name)


def openai_tool_choice(body: Body, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """OpenAI chat's `tool_choice` ("none" / "auto" / "required" / {"type": "function", "function":
    {"name"}}) and `parallel_tool_calls`."""
    raw = body.raw("tool_choice", "auto")
    parallel = body.boolean("parallel_tool_calls", True)
    if isinstance(raw, Mapping):
        function = raw.get("function")
        name = function.get("name") if isinstance(function, Mapping) else raw.get("name")
        return replace(named_tool_choice(name, tools, "tool_choice.function.name"), parallel=False)
    if raw not in ("none", "auto", "required"):
        raise bad_field("tool_choice", 'must be "none", "auto", "required" or {"type": "function", ...}')
    if raw == "required" and not tools:
        raise bad_field("tool_choice", '"required" needs tools')
    return ToolChoice(mode=raw, parallel=parallel)


def chat_request(body: Body) -> ChatRequest:
    """The conversation of an OpenAI chat-completions body (also /apply-template's and /debug/prompt's)."""
    messages = chat_messages(body.raw("messages"))
    thinking, kwargs = thinking_choice(body)
    explicit_turn = "add_generation_prompt" in body or "add_generation_prompt" in kwargs
    opens_turn = generation_prompt(kwargs, body)
    _check_final_messages(messages, body, opens_turn and explicit_turn)
    tools = chat_tools(body.raw("tools"))
    choice = openai_tool_choice(body, tools)
    return ChatRequest(
        messages, tools, thinking, kwargs, add_generation_prompt=opens_turn, tool_choice=choice
    )


def _check_final_messages(messages: list[dict[str, Any]], body: Body, opens_turn: bool) -> None:
    """llama-server's (and vLLM's) checks on how a chat ends: `continue_final_message` (a final
    assistant message is continued either way) contradicts an explicit `add_generation_prompt: true`,
    and needs a final assistant message; two assistant messages at the end are ambiguous (which one is
    the answer to continue?)."""
    if body.boolean("continue_final_message"):
        if opens_turn:
            raise _conflict(
                "continue_final_message",
                "continuing the final message and opening a new assistant turn (add_generation_prompt) "
                "cannot both be asked for",
            )
        if messages[-1].get("role") != "assistant":
            raise bad_field("continue_final_message", "needs a final assistant message to continue")
    if len(messages) >= 2 and all(m.get("role") == "assistant" for m in messages[-2:]):
        raise bad_field(
            f"messages[{len(messages) - 1}]",
            "the chat ends with two assistant messages; at most one, the answer to continue, may end it",
        )


def output_schema(fmt: Any, field_name: str) -> dict[str, Any] | None:
    """The JSON schema an output format asks for: None for plain text; for json_object, its `schema`
    when it has one (llama-server's form) and else any object; for json_schema, the given schema (its
    `schema` member, or the object itself when the dialect puts the schema there directly), made
    strict (`strict_schema`) with `strict: true` beside it, as OpenAI's structured outputs are."""
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise bad_field(f"{field_name}.type", f"must be text, json_object or json_schema; got {kind!r}")
    assert isinstance(fmt, Mapping)
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is None:
            return {"type": "object"}
        if not isinstance(schema, Mapping):
            raise bad_field(f"{field_name}.schema", "must be a JSON schema object")
        return dict(schema)
    where = f"{field_name}.json_schema" if "json_schema" in fmt else field_name
    holder = fmt.get("json_schema", fmt)
    schema = holder.get("schema") if isinstance(holder, Mapping) else None
    if not isinstance(schema, Mapping):
        raise bad_field(f"{field_name}.schema", "json_schema needs a `schema` object")
    strict = holder.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_field(f"{where}.strict", "must be true, false or null")
    return strict_schema(schema, f"{where}.schema") if strict else dict(schema)


# Where strict_schema looks for nested schemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")


def strict_schema(schema: Any, where: str) -> Any:
    """`schema` (at `where` in the body) as OpenAI's strict mode reads it: every object requires all of
    its properties and allows no others unless it sets `additionalProperties` itself; nested objects
    (properties, items, anyOf, $defs) too. A property that may be left out is spelled as a nullable
    type in strict mode. 400 invalid_schema when `properties` is not an object of schemas."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    if "properties" in out and not isinstance(out["properties"], Mapping):
        raise bad_field(f"{where}.properties", "must be an object of schemas", code="invalid_schema")
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: strict_schema(sub, f"{where}.{key}.{name}") for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub, f"{where}.{key}[{i}]") for i, sub in enumerate(out[key])]
    if "items" in out:
        out["items"] = strict_schema(out["items"], f"{where}.items")
    types = out.get("type")
    if types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out:
        if "properties" in out:
            out["required"] = list(out["properties"])
        out.setdefault("additionalProperties", False)
    return out
