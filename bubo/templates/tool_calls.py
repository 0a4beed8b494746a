"""Finding tool calls in a model's answer text, as it streams.

Two call formats are in use by the templates bubo ships with:

- JSON (Hermes style: Qwen2.5, Qwen3, QwQ, Qwen3-Next), one object per block::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  `arguments` may also be a JSON string that holds the object.
- XML parameters (Qwen3-Coder, Qwen3.5, Qwen3.6)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

  The values are bare text, so their JSON type comes from the tool's schema. Qwen3-Coder sometimes
  leaves out the `<tool_call>` wrapper and starts with `<function=` directly.

Several blocks in a row are parallel calls. Text that could still be the start of an opening tag is held
back until the next piece decides it, and a call is buffered whole until its closing tag: only a
complete, valid call becomes tool-call events, anything malformed goes back out as the exact text the
model wrote, and a call the output ends inside (cut by the token limit) is dropped. Whitespace around
calls is the templates' layout, not answer text, so it is dropped.
"""

import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "TextPiece",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallEnd",
    "ToolCallFormat",
    "ToolCallParser",
    "ToolCallStart",
    "ToolEvent",
    "tool_call_format",
]

ToolCallFormat = Literal["json", "xml"]


@dataclass(frozen=True)
class TextPiece:
    """Answer text that is not part of a tool call."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call began; `index` counts the calls of this answer from 0, `id` is fresh."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """The next fragment of the call's arguments as JSON text."""

    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    """The call is complete; `arguments` is the whole JSON object text (the fragments joined)."""

    index: int
    arguments: str


ToolEvent = TextPiece | ToolCallStart | ToolCallArguments | ToolCallEnd


@dataclass(frozen=True)
class ToolCall:
    """A completed call, as the OpenAI API lists it: `arguments` is JSON object text."""

    id: str
    name: str
    arguments: str


_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_FUNCTION = "<function="
_FUNCTION_CLOSE = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_CLOSE = "</parameter>"
# A complete JSON string literal; the JSON scanner skips these so a tag inside an argument doesn't count.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_ID_ALPHABET = string.ascii_lowercase + string.digits


def tool_call_format(template_source: str) -> ToolCallFormat:
    """The call format a template teaches: XML when it writes `<function=…>`/`<parameter=…>`, else JSON.

    JSON is also the fallback for templates without tool support, since it is the most common style.
    """
    return "xml" if _FUNCTION in template_source or _PARAMETER in template_source else "json"


class ToolCallParser:
    """Feeds answer text in, gets text pieces and tool-call events out; `flush()` at the end of the output.

    `tools` (OpenAI chat shape) restricts calls to those names and types XML parameter values by their
    schema. With `parallel=False` only the first call counts; later blocks are text.
    """

    def __init__(
        self, fmt: ToolCallFormat, tools: Sequence[Mapping[str, Any]] | None = None, *, parallel: bool = True
    ) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self._schemas: dict[str, Mapping[str, Any]] | None = None
        if tools is not None:
            functions = [tool.get("function", tool) for tool in tools]
            self._schemas = {f["name"]: f.get("parameters") or {} for f in functions}
        self._calls: list[ToolCall] = []
        self._held = ""  # text that may be the start of an opening tag
        # Whitespace seen last: dropped if a call follows (or if it trails a call at the end), else text.
        self._space = ""
        self._after_call = False
        self._call: str | None = None  # raw text of the call being buffered, from its opening tag
        self._bare = False  # an XML call opened with `<function=`, so `</function>` closes it
        self._scan = 0  # how far the buffered call was scanned without finding its end

    @property
    def calls(self) -> list[ToolCall]:
        """The calls completed so far, in order."""
        return list(self._calls)

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._call is not None:
            self._call += text
        else:
            self._held += text
        while True:
            if self._call is not None:
                if not self._advance_call(out):
                    break
                continue
            text, self._held = self._held, ""
            openers = self._openers()
            found = [(at, tag) for tag in openers if (at := text.find(tag)) >= 0]
            if not found:
                keep = max((_partial_suffix(text, tag) for tag in openers), default=0)
                self._text(out, text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            at, tag = min(found)
            self._text(out, text[:at])
            self._call, self._bare, self._scan = text[at:], tag == _FUNCTION, len(tag)
        return out

    def flush(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        call, self._call = self._call, None
        if call is not None and self._closing_tag() in call:
            # Its closing tag is there, inside a value the scan skipped (a `</parameter>` left out): a
            # malformed call, which goes out as the text the model wrote.
            self._text(out, call)
            call = None
        # A call still open at the end (the token limit cut it, or the model stopped inside it) is
        # dropped, with a partial opening tag and the whitespace laid out before it: it is no call, and
        # its markup is not answer text.
        unfinished = call is not None or bool(self._held)
        self._held = ""
        if not unfinished and not self._after_call:
            self._text(out, self._space, final=True)
        self._space = ""
        return out

    def _openers(self) -> tuple[str, ...]:
        if self._calls and not self.parallel:
            return ()
        return (_OPEN, _FUNCTION) if self.fmt == "xml" else (_OPEN,)

    def _advance_call(self, out: list[ToolEvent]) -> bool:
        """Progress on the buffered call; False when it needs more text to decide."""
        raw = self._call
        assert raw is not None
        if not self._viable(raw):
            # Not a call after all: its opening tag is text, and what follows is scanned afresh.
            tag_len = len(_FUNCTION if self._bare else _OPEN)
            self._call, self._held = None, raw[tag_len:]
            self._text(out, raw[:tag_len])
            return True
        end = self._find_end(raw)
        if end is None:
            return False
        self._call, self._held = None, raw[end:]
        call = self._parse(raw[:end])
        if call is None:
            self._text(out, raw[:end])
        else:
            self._space = ""
            self._after_call = True
            self._emit_call(out, *call)
        return True

    def _viable(self, raw: str) -> bool:
        """Whether the text right after the opening tag can still begin a call (undecided counts as yes)."""
        body = raw if self._bare else raw[len(_OPEN) :].lstrip()
        if self.fmt == "json":
            return not body or body.startswith("{")
        if not body.startswith(_FUNCTION):
            return _FUNCTION.startswith(body)
        # A function name is one line of plain text; prose like "<function=x means…" is not a call.
        name, closed, rest = body[len(_FUNCTION) :].partition(">")
        if "<" in name or "\n" in name:
            return False
        # Only parameters or the closing tag follow the name ("<function=f> tag" is prose).
        rest = rest.lstrip()
        return not closed or any(tag.startswith(rest[: len(tag)]) for tag in (_PARAMETER, _FUNCTION_CLOSE))

    def _closing_tag(self) -> str:
        return _FUNCTION_CLOSE if self._bare else _CLOSE

    def _find_end(self, raw: str) -> int | None:
        """End of the call's closing tag in `raw`, skipping JSON strings and XML parameter values."""
        close = self._closing_tag()
        skip_open = '"' if self.fmt == "json" else _PARAMETER
        while True:
            at_close = raw.find(close, self._scan)
            at_skip = raw.find(skip_open, self._scan)
            if at_close >= 0 and (at_skip < 0 or at_close < at_skip):
                return at_close + len(close)
            if at_skip < 0:
                return None
            if self.fmt == "json":
                match = _JSON_STRING.match(raw, at_skip)
                skip_end = match.end() if match else -1
            else:
                skip_end = raw.find(_PARAMETER_CLOSE, at_skip)
                skip_end = skip_end + len(_PARAMETER_CLOSE) if skip_end >= 0 else -1
            if skip_end < 0:
                return None
            self._scan = skip_end

    def _parse(self, raw: str) -> tuple[str, dict[str, Any]] | None:
        """(name, arguments) of a complete call, or None when it is malformed or names an unknown tool."""
        if self.fmt == "json":
            parsed = _parse_json(raw[len(_OPEN) : -len(_CLOSE)])
        elif self._bare:
            parsed = self._parse_xml(raw)
        else:
            parsed = self._parse_xml(raw[len(_OPEN) : -len(_CLOSE)].strip())
        if parsed is None or (self._schemas is not None and parsed[0] not in self._schemas):
            return None
        return parsed

    def _parse_xml(self, body: str) -> tuple[str, dict[str, Any]] | None:
        match = re.fullmatch(r"<function=([^<>\n]+)>(.*)</function>", body, re.DOTALL)
        if match is None or not (name := match[1].strip()):
            return None
        properties = (self._schemas or {}).get(name, {}).get("properties")
        if not isinstance(properties, Mapping):
            # A schema is the client's JSON, checked only when a forced call compiles it.
            properties = {}
        arguments: dict[str, Any] = {}
        rest = match[2]
        while rest := rest.lstrip():
            param = re.match(r"<parameter=([^<>\n]+)>(.*?)</parameter>", rest, re.DOTALL)
            # A value holding another `<parameter=` means a `</parameter>` was left out.
            if param is None or _PARAMETER in param[2]:
                return None
            key = param[1].strip()
            arguments[key] = _typed(param[2], properties.get(key))
            rest = rest[param.end() :]
        return name, arguments

    def _emit_call(self, out: list[ToolEvent], name: str, arguments: dict[str, Any]) -> None:
        index = len(self._calls)
        call_id = "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))
        # One fragment per top-level key, so a streaming client sees the arguments arrive in pieces.
        pairs = [f"{_dumps(key)}: {_dumps(value)}" for key, value in arguments.items()]
        fragments = ["{" + pairs[0], *(", " + pair for pair in pairs[1:])] if pairs else ["{"]
        fragments[-1] += "}"
        text = "".join(fragments)
        out.append(ToolCallStart(index, call_id, name))
        out.extend(ToolCallArguments(index, fragment) for fragment in fragments)
        out.append(ToolCallEnd(index, text))
        self._calls.append(ToolCall(call_id, name, text))

    def _text(self, out: list[ToolEvent], text: str, *, final: bool = False) -> None:
        """Emit answer text, holding back trailing whitespace until it is known not to precede a call."""
        if not final:
            body = text.rstrip()
            if not body:
                self._space += text
                return
            text, self._space = self._space + body, text[len(body) :]
            self._after_call = False
        if not text:
            return
        if out and isinstance(out[-1], TextPiece):
            out[-1] = TextPiece(out[-1].text + text)
        else:
            out.append(TextPiece(text))


def _parse_json(body: str) -> tuple[str, dict[str, Any]] | None:
    try:
        call = _loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(name := call.get("name"), str) or not name:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    return (name, arguments) if isinstance(arguments, dict) else None


def _typed(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """An XML parameter value as the JSON type its schema names; unknown types parse as JSON or stay text."""
    # The templates write "\n" + value + "\n" around the value; only that layout is not part of it.
    text = raw.removeprefix("\n").removesuffix("\n")
    named = schema.get("type") if isinstance(schema, Mapping) else None
    # Only type names count: a malformed schema (the client's JSON, unchecked) types nothing.
    types = [named] if isinstance(named, str) else named if isinstance(named, list) else []
    types = [kind for kind in types if isinstance(kind, str)]
    for kind in types:
        if kind != "string" and (value := _as_type(text.strip(), kind)) is not _NO_VALUE:
            return value
    if "string" in types:
        return text
    try:
        return _loads(text)
    except ValueError:
        return text


_NO_VALUE = object()


def _as_type(text: str, kind: str) -> Any:
    """`text` as JSON type `kind`, or _NO_VALUE; Python spellings count because Qwen3.5 writes `|string`."""
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO_VALUE)
    if kind == "null":
        return None if text in ("null", "None") else _NO_VALUE
    try:
        value = _loads(text)
    except ValueError:
        return _NO_VALUE
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    wanted = {"integer": int, "number": (int, float), "object": dict, "array": list}.get(kind)
    if wanted is None or isinstance(value, bool) or not isinstance(value, wanted):
        return _NO_VALUE
    return value


def _loads(text: str) -> Any:
    """json.loads without NaN/Infinity, which Python accepts but the arguments JSON must not contain."""
    return json.loads(text, parse_constant=_reject_constant)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
