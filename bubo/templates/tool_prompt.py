"""Tools for chat templates that do not know about tools (SmolLM2's, plain ChatML, most base
instruct templates ignore the `tools` variable).

Such a template would drop the tool list, the assistant's earlier calls and the tool results, and
the model would never hear of them. This rewrites the conversation so any template carries them:
the tool list and the call format go into the system message (in the Hermes/Qwen2.5 style that
`ToolCallParser`'s "json" format reads), earlier calls become `<tool_call>` blocks in the assistant's
text, and tool results become user turns holding `<tool_response>` blocks.
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["with_tools_in_messages"]

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    payload = {"name": function.get("name"), "arguments": arguments}
    return "<tool_call>\n" + json.dumps(payload, ensure_ascii=False) + "\n</tool_call>"


def with_tools_in_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results written as text any template renders."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
        instructions = _INSTRUCTIONS.format(tools=listing)
        first = messages[0] if messages else None
        if first is not None and first.get("role") == "system" and isinstance(first.get("content"), str):
            out.append({**first, "content": first["content"] + "\n\n" + instructions})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": instructions})
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            text = message.get("content") or ""
            calls = "\n".join(_call_text(c) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif role == "tool":
            response = f"<tool_response>\n{message.get('content', '')}\n</tool_response>"
            previous = out[-1] if out else {}
            # A user turn with images holds a list of parts, never a tool response to join.
            if (
                previous.get("role") == "user"
                and isinstance(previous.get("content"), str)
                and previous["content"].endswith("</tool_response>")
            ):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
        else:
            out.append(dict(message))
    return out
