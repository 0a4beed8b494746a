"""Grammars that force a tool call in the model's own format (tool_choice "required" or a named tool).

The Lark grammars are for llguidance (bubo/engine/grammar.py), whose `%json {schema}` rule embeds a
JSON schema. The JSON style (Qwen2.5 / Qwen3 / QwQ, and the fallback) is a `<tool_call>` block around
{"name": NAME, "arguments": {...}} with the function's parameter schema; the XML-parameter style
(Qwen3-Coder, Qwen3.5, Qwen3.6) writes one `<parameter=P>` block per argument, typed by its schema:
strings as raw text, everything else as JSON, required parameters always and optional ones maybe, in
the schema's order (the order the templates render them in).
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

from bubo.engine.grammar import JSON_LAYOUT, closed_objects
from bubo.templates.tool_calls import ToolCallFormat

__all__ = ["tool_call_grammar"]


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for tool in tools:
        function = tool.get("function", tool)
        # Arguments are held to the schema the way a JSON answer is: no keys it does not list.
        parameters = closed_objects(function.get("parameters") or {"type": "object"})
        out.append((function["name"], dict(parameters)))
    return out


def _literal(text: str) -> str:
    return json.dumps(text)


def _json_call(name: str, parameters: dict[str, Any]) -> str:
    schema = {
        "x-guidance": JSON_LAYOUT,
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return f'"<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'


def _xml_parameter(param: str, schema: Mapping[str, Any]) -> str:
    """One `<parameter=P>` block. A free string is raw text, and llguidance's lexer takes the longest
    match, so the text and the closing tag are one regex (else the text would swallow the newline the
    closing tag needs); such a value cannot contain "<"."""
    opening = _literal(f"<parameter={param}>\n")
    closing = _literal("\n</parameter>\n")
    if schema.get("type") == "string" and "enum" not in schema:
        most = schema.get("maxLength")
        length = "*" if not isinstance(most, int) else f"{{0,{most}}}"
        return f"{opening} /[^<]{length}\\n<\\/parameter>\\n/"
    if schema.get("type") == "string":
        value = "(" + " | ".join(_literal(str(v)) for v in schema["enum"]) + ")"
    else:
        value = f"%json {json.dumps({'x-guidance': JSON_LAYOUT, **schema})}"
    return f"{opening} {value} {closing}"


def _xml_call(name: str, parameters: dict[str, Any], rule: str) -> tuple[str, list[str]]:
    properties: Mapping[str, Any] = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    parts, rules = [], []
    for i, (param, schema) in enumerate(properties.items()):
        sub = f"{rule}_p{i}"
        rules.append(f"{sub}: {_xml_parameter(param, schema)}")
        parts.append(sub if param in required else f"{sub}?")
    head = _literal(f"<tool_call>\n<function={name}>\n")
    tail = _literal("</function>\n</tool_call>")
    return f"{head} {' '.join(parts)} {tail}", rules


def tool_call_grammar(
    fmt: ToolCallFormat, tools: Sequence[Mapping[str, Any]], *, name: str | None = None, parallel: bool = True
) -> str:
    """Lark source for one call (several when `parallel`) to any of `tools`, or only to `name`."""
    functions = [(n, p) for n, p in _functions(tools) if name is None or n == name]
    if not functions:
        raise ValueError(f"no tool named {name!r}" if name else "no tools to call")
    lines = []
    alternatives = []
    for i, (function, parameters) in enumerate(functions):
        rule = f"fn{i}"
        if fmt == "json":
            lines.append(f"{rule}: {_json_call(function, parameters)}")
        else:
            body, extra = _xml_call(function, parameters, rule)
            lines.append(f"{rule}: {body}")
            lines += extra
        alternatives.append(rule)
    # Calls follow each other on new lines, as the templates render them.
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, f"call: {' | '.join(alternatives)}", *lines]) + "\n"
