"""A chat request, whatever its dialect, as the template and the engine take it, and the thinking and
tool choices that shape it.

Each dialect turns its own message format into OpenAI-style template messages (bubo/engine/
chat_messages.py); this module decides whether thinking is on from `reasoning_effort` / `thinking` /
`chat_template_kwargs` (which must agree), reads the tools and how the answer may use them, and reads a
whole OpenAI chat-completions body (`chat_request`, which `Model.chat` builds from its arguments too).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from bubo.engine.chat_messages import ImagePart, chat_images, chat_messages
from bubo.engine.output_format import strict_schema
from bubo.engine.request_error import RequestError, invalid_field
from bubo.engine.request_fields import Body

__all__ = [
    "REASONING_BUDGETS",
    "REASONING_EFFORTS",
    "ChatRequest",
    "ThinkingChoice",
    "ToolChoice",
    "chat_request",
    "chat_tools",
    "generation_prompt",
    "named_tool_choice",
    "openai_tool_choice",
    "require_function_tool",
    "thinking_choice",
    "tool_list",
]

REASONING_EFFORTS = ("off", "minimal", "low", "medium", "high", "xhigh", "max")
# The reasoning token budget of each effort level (README, "Thinking"): when it runs out the server
# closes the reasoning block and the model writes its answer. "max" and no level at all: no budget.
REASONING_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}


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
            raise invalid_field("thinking", f'type must be "enabled" or "disabled", got {kind!r}')
        wanted = kind != "disabled"
        if enabled is not None and wanted != enabled:
            raise _conflict("thinking", f"thinking.type {kind!r} contradicts reasoning_effort {effort!r}")
        enabled = wanted

    kwargs = dict(body.object("chat_template_kwargs") or {})
    for name in TEMPLATE_INPUTS.intersection(kwargs):
        # The template takes these from the request itself; a second value would clash with it.
        raise invalid_field(
            f"chat_template_kwargs.{name}", f"the request's own {name} is what the template gets"
        )
    if "enable_thinking" in kwargs:
        flag = kwargs.pop("enable_thinking")
        if not isinstance(flag, bool):
            raise invalid_field("chat_template_kwargs.enable_thinking", "must be true or false")
        if enabled is not None and flag != enabled:
            raise _conflict(
                "chat_template_kwargs", f"enable_thinking={flag} contradicts the request's thinking setting"
            )
        enabled = flag
    if "reasoning_effort" in kwargs:
        level = kwargs.pop("reasoning_effort")
        if level not in REASONING_EFFORTS:
            raise invalid_field(
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
            raise invalid_field("chat_template_kwargs.add_generation_prompt", "must be true or false")
        if body is not None and "add_generation_prompt" in body and given != flag:
            raise _conflict(
                "chat_template_kwargs", f"add_generation_prompt={given} contradicts the top-level {flag}"
            )
        flag = given
    return flag


def _conflict(field_name: str, message: str) -> RequestError:
    return RequestError(f"{field_name}: {message}", param=field_name, code="conflicting_fields")


def tool_list(tools: Any, field_name: str = "tools") -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise invalid_field(field_name, "must be an array of tool objects")
    return [dict(t) for t in tools] or None


def require_function_tool(tool: Mapping[str, Any], where: str) -> None:
    """400 unsupported_tool unless `tool` (at `where`) is a function tool, the one kind served."""
    if tool.get("type") != "function":
        raise RequestError(
            f"{where}.type: only function tools are supported, got {tool.get('type')!r}",
            param=f"{where}.type",
            code="unsupported_tool",
        )


def chat_tools(raw: Any) -> list[dict[str, Any]] | None:
    """OpenAI chat `tools`: {"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}, a strict function's schema made strict (`strict_schema`). Checked here because the templates, the tool-call parser and the forcing grammar all index into
    them: a tool without a name or with a non-object schema would otherwise fail deep inside (a 500)."""
    tools = tool_list(raw)
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if tool.get("type") is None:
            raise invalid_field(f"{where}.type", 'is required: "function"')
        require_function_tool(tool, where)
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise invalid_field(f"{where}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_field(f"{where}.function.name", "must be a non-empty string")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_field(f"{where}.function.description", "must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise invalid_field(f"{where}.function.parameters", "must be a JSON schema object")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_field(f"{where}.function.strict", "must be true, false or null")
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
        raise invalid_field(field_name, "must name a function")
    if name not in tool_names(tools):
        raise invalid_field(
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
        raise invalid_field("tool_choice", 'must be "none", "auto", "required" or {"type": "function", ...}')
    if raw == "required" and not tools:
        raise invalid_field("tool_choice", '"required" needs tools')
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
            raise invalid_field("continue_final_message", "needs a final assistant message to continue")
    if len(messages) >= 2 and all(m.get("role") == "assistant" for m in messages[-2:]):
        raise invalid_field(
            f"messages[{len(messages) - 1}]",
            "the chat ends with two assistant messages; at most one, the answer to continue, may end it",
        )
