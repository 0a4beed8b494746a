"""A request's JSON, whoever sends it (an HTTP body, a library call's arguments): parsed under limits
(nesting depth, finite numbers, usable integers, encodable strings), and read field by field with type
checks (`Body`). Every refusal is a RequestError that names the field."""

import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bubo.engine.request_error import RequestError, invalid_field

__all__ = [
    "MAX_COUNT",
    "MAX_JSON_DEPTH",
    "MAX_STOP_BYTES",
    "MAX_STOP_STRINGS",
    "Body",
    "check_values",
    "json_text",
    "parse_json",
    "shown_number",
    "stop_strings",
]

# Deeper values are refused before anything walks them: schemas, templates and grammars recurse.
MAX_JSON_DEPTH = 64
# Token counts, top_k and window sizes are int32 in llama-server; larger ones are client mistakes.
MAX_COUNT = 2**31 - 1
# Every stop string is searched for after every token, so their number and size are bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_BYTES = 1024


def json_text(text: str, field: str) -> Any:
    """JSON that a request carries in a string (a tool call's arguments), held to the rules of the
    request itself: invalid_value naming `field` (or the place inside it) when it is not JSON, nests
    deeper than MAX_JSON_DEPTH, or holds a number or string that `check_values` refuses."""
    try:
        value = parse_json(text)
    except json.JSONDecodeError:
        raise invalid_field(field, "is not valid JSON") from None
    except RecursionError:
        raise _nested_too_deep(field) from None
    check_values({field: value}, _nested_too_deep(field))
    return value


def _nested_too_deep(field: str) -> RequestError:
    return invalid_field(field, f"nests deeper than {MAX_JSON_DEPTH} levels")


class _LongInteger:
    """An integer literal longer than Python converts (4300 digits by default), kept so that the walk
    over the body can name its field."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


class _Underflow(float):
    """A number literal with a non-zero digit that reads as 0.0 (1e-400): no integer field takes it."""


def parse_json(raw: bytes | str) -> Any:
    """JSON text as Python values, numbers that need a second look (1e-400, 5000-digit integers) kept
    apart for `check_values` and `Body` to refuse by name. json.JSONDecodeError, UnicodeDecodeError or
    RecursionError when it is not usable JSON."""
    # JSON on the wire is UTF-8 (RFC 8259): json.loads would take UTF-16 too, and decode encoded
    # surrogates (ED A0 80, invalid UTF-8) into unpaired ones.
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    try:
        return json.loads(text, parse_float=_float)
    except ValueError as error:
        if isinstance(error, json.JSONDecodeError):
            raise
    # Python refuses to convert integers of more than 4300 digits: read again, keeping them as
    # _LongInteger (a slower parse, only for such bodies).
    return json.loads(text, parse_float=_float, parse_int=_integer)


def _float(text: str) -> float:
    value = float(text)
    if value == 0.0 and text.lstrip("-0.").partition("e")[0].partition("E")[0].strip("0."):
        return _Underflow(value)
    return value


def _integer(text: str) -> int | _LongInteger:
    if len(text) > sys.get_int_max_str_digits() > 0:
        return _LongInteger(len(text))
    return int(text)


def check_values(data: dict[str, Any], too_deep: Exception) -> None:
    """Raise for the first value of `data` that parse_json's callers refuse: nesting past
    MAX_JSON_DEPTH (`too_deep`), a non-finite or over-long number, a string with an unpaired surrogate."""
    if not _plain(data):
        _refuse_values(data, too_deep)


def _plain(data: dict[str, Any]) -> bool:
    """Whether the parsed body nests at most MAX_JSON_DEPTH deep and holds only finite numbers and
    encodable strings. This walk (no recursion, no paths) is the one every request pays for; a body
    that fails it is walked again by `_refuse_values`, which names the place."""
    pending: list[tuple[dict[str, Any] | list[Any], int]] = [(data, 1)]
    while pending:
        container, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            return False
        if isinstance(container, dict):
            for key in container:
                if not key.isascii() and not _encodable(key):
                    return False
            items: Any = container.values()
        else:
            items = container
        for item in items:
            kind = type(item)
            if kind is str:
                if not item.isascii() and not _encodable(item):
                    return False
            elif kind is float:
                if not math.isfinite(item):
                    return False
            elif kind is dict or kind is list:
                pending.append((item, depth + 1))
            elif kind is _LongInteger:
                return False
    return True


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_values(data: dict[str, Any], too_deep: Exception) -> None:
    """Walk the parsed body without recursion and raise for the first of: nesting past the limit
    (`too_deep`), a non-finite number (JSON has no NaN or Infinity, and 1e999 reads as infinity), an
    over-long integer, a string with an unpaired UTF-16 surrogate."""
    pending: list[tuple[str, Any, int]] = [("", data, 1)]
    while pending:
        path, value, depth = pending.pop()
        if isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise too_deep
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    if not _encodable(key):
                        raise _surrogate(path or "body")
                    where = f"{path}.{key}" if path else key
                else:
                    where = f"{path}[{key}]"
                pending.append((where, item, depth + 1))
        elif isinstance(value, float) and not math.isfinite(value):
            raise invalid_field(path, f"must be a finite number, got {value}")
        elif isinstance(value, _LongInteger):
            raise invalid_field(path, f"must be a number of usable size, got one of {value.digits} digits")
        elif isinstance(value, str) and not _encodable(value):
            raise _surrogate(path)


def _surrogate(path: str) -> RequestError:
    return invalid_field(path, "contains an unpaired UTF-16 surrogate escape")


def shown_number(number: int) -> str:
    """A number for an error message: a client's 4000-digit integer is not echoed back whole."""
    text = str(number)
    return text if len(text) <= 24 else f"a number of {len(text)} digits"


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


class Body:
    """A JSON object with getters that check types; `None` (JSON null) counts as absent. `size` is the
    length in bytes of the request body it was read from (0 for one made in code): a measure of how
    much work rendering and tokenizing its prompt is."""

    def __init__(self, data: Mapping[str, Any], size: int = 0) -> None:
        self.data = data
        self.size = size

    def __contains__(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name)
        return default if value is None else value

    def string(self, name: str, default: str | None = None, *, choices: Sequence[str] = ()) -> str | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise invalid_field(name, f"must be a string, got {_type_name(value)}")
        if choices and value not in choices:
            raise invalid_field(name, f"must be one of {', '.join(choices)}; got {value!r}")
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid_field(name, f"must be true or false, got {_type_name(value)}")
        return value

    def integer(
        self, name: str, default: int | None = None, *, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, _Underflow):
            raise invalid_field(
                name, "must be an integer, got a fraction too small for a float (such as 1e-400)"
            )
        # JSON has one number type: 5.0 is an integer, 5.5 is not.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_field(
                name,
                f"must be an integer, got {_type_name(value) if not isinstance(value, float) else value}",
            )
        if minimum is not None and value < minimum:
            raise invalid_field(name, f"must be >= {minimum}, got {shown_number(value)}")
        if maximum is not None and value > maximum:
            raise invalid_field(name, f"must be <= {maximum}, got {shown_number(value)}")
        return value

    def number(
        self,
        name: str,
        default: float | None = None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> float | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid_field(name, f"must be a finite number, got {_type_name(value)}")
        # An integer past float range (10**400) would overflow float(); NaN cannot get past read_json.
        if not -sys.float_info.max <= value <= sys.float_info.max:
            raise invalid_field(name, f"must be a finite number within float range, got {_type_name(value)}")
        if minimum is not None and value < minimum:
            raise invalid_field(name, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise invalid_field(name, f"must be <= {maximum}, got {value}")
        return float(value)

    def array(self, name: str, default: list[Any] | None = None) -> list[Any] | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, list):
            raise invalid_field(name, f"must be an array, got {_type_name(value)}")
        return value

    def object(self, name: str, default: dict[str, Any] | None = None) -> dict[str, Any] | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, dict):
            raise invalid_field(name, f"must be an object, got {_type_name(value)}")
        return value

    def count(self, name: str, default: int | None = None, *, minimum: int = 1) -> int | None:
        """A count of tokens or items: an integer in [minimum, MAX_COUNT]."""
        return self.integer(name, default, minimum=minimum, maximum=MAX_COUNT)

    def token_limit(self, *names: str, minimum: int = 1) -> int | None:
        """The first of `names` that is set: -1 or null keep the server default (None); anything else
        must be at least `minimum` (1, or 0 where a limit of 0 means evaluating the prompt alone)."""
        for name in names:
            value = self.integer(name, maximum=MAX_COUNT)
            if value is None or value == -1:
                continue
            if value < minimum:
                wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
                raise invalid_field(name, f"must be {wanted}, or -1 for the server default; got {value}")
            return value
        return None

    def stop(self, name: str = "stop") -> list[str]:
        """A string or an array of non-empty strings."""
        value = self.data.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return stop_strings([value], name)
        if not isinstance(value, list):
            raise invalid_field(name, "must be a string or an array of strings")
        return stop_strings(value, name)


def stop_strings(values: list[Any], name: str) -> list[str]:
    """Stop strings: at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_BYTES bytes each."""
    if len(values) > MAX_STOP_STRINGS:
        raise invalid_field(name, f"at most {MAX_STOP_STRINGS} stop strings, got {len(values)}")
    for i, s in enumerate(values):
        if not isinstance(s, str):
            raise invalid_field(name, f"must be a string or an array of strings; item {i} is {_type_name(s)}")
        if s == "":
            raise invalid_field(name, "stop strings must not be empty")
        if len(s) > MAX_STOP_BYTES or len(s.encode()) > MAX_STOP_BYTES:
            raise invalid_field(name, f"a stop string may have at most {MAX_STOP_BYTES} bytes (item {i})")
    return list(values)
