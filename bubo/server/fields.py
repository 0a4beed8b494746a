"""Reading request bodies: JSON parsing, typed field access, and the fields every dialect shares
(sampling, stop strings, token limits, the model name). Every failure is a 400 that names the field."""

import asyncio
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

from aiohttp import web

from bubo.engine.sampler import SamplingParams
from bubo.model.tokenizer import Tokenizer
from bubo.server.errors import ApiError, bad_field

__all__ = [
    "BODY_STALL_SECONDS",
    "MAX_COUNT",
    "MAX_JSON_DEPTH",
    "MAX_JSON_VALUES",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_BYTES",
    "MAX_STOP_STRINGS",
    "Body",
    "bias_text_tokens",
    "json_text",
    "read_json",
    "reject_n",
    "sampling_params",
    "stop_strings",
]

# Deeper bodies are refused before any handler walks them: schemas, templates and grammars recurse.
MAX_JSON_DEPTH = 64
# Token counts, top_k and window sizes are int32 in llama-server; larger ones are client mistakes.
MAX_COUNT = 2**31 - 1
# Every stop string is searched for after every token, so their number and size are bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_BYTES = 1024
MAX_LOGIT_BIAS = 100.0
# How long a request body may stop arriving before the request is given up on.
BODY_STALL_SECONDS = 60.0
# A parsed body takes far more memory than its text ({} is 2 bytes of JSON, a 64-byte dict): objects,
# arrays and separators past this many are refused before parsing, so a request waiting for a slot
# holds a bounded amount (a 32 MB body of empty objects would be 11 M dicts, ~750 MB).
MAX_JSON_VALUES = 1_000_000
# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones on the
# JSON thread, so a big body does not stall every other connection while it is checked.
INLINE_JSON_BYTES = 64 << 10
_JSON_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bubo-json")


async def read_json(request: web.Request) -> "Body":
    """The body as a JSON object; malformed JSON, JSON that is not an object, a body that cannot be
    decoded (a corrupt Content-Encoding) or nesting deeper than MAX_JSON_DEPTH is 400 parse_error. NaN,
    Infinity, numbers past float range, integers past Python's digit limit and unpaired surrogate
    escapes are 400 invalid_value naming where they are. A body that stops arriving is 408; one of
    more than MAX_JSON_VALUES values 413."""
    raw = await _read_body(request)
    if len(raw) <= INLINE_JSON_BYTES:
        return _decode(raw)
    return await asyncio.get_running_loop().run_in_executor(_JSON_THREAD, _decode, raw)


def _decode(raw: bytes) -> "Body":
    if not raw:
        raise ApiError(400, "parse_error", "the request body must be a JSON object, got empty")
    # An upper bound on the values the body holds (braces and commas inside strings count too).
    values = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if values > MAX_JSON_VALUES:
        raise ApiError(
            413,
            "request_too_large",
            f"the request body holds more than {MAX_JSON_VALUES} JSON objects, arrays and items",
        )
    try:
        data = _parse(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, "parse_error", f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        kind = "null" if data is None else f"a JSON {type(data).__name__}"
        raise ApiError(400, "parse_error", f"the request body must be a JSON object, got {kind}")
    if not _plain(data):
        _refuse_values(data, _too_deep())
    return Body(data, size=len(raw))


async def _read_body(request: web.Request) -> bytes:
    """request.read(), given up on with 408 once no byte of the body has arrived for BODY_STALL_SECONDS
    (a client that declares a body and never sends it would otherwise hold the request forever)."""
    reading = asyncio.ensure_future(request.read())
    received = request.content.total_bytes
    try:
        while not (await asyncio.wait({reading}, timeout=BODY_STALL_SECONDS))[0]:
            if request.content.total_bytes == received:
                raise ApiError(
                    408,
                    "request_timeout",
                    f"the request body stopped arriving: nothing of it came for {BODY_STALL_SECONDS:g} s",
                )
            received = request.content.total_bytes
    finally:
        reading.cancel()
    try:
        return reading.result()
    except web.RequestPayloadError as error:
        # aiohttp could not decode what arrived: a corrupt gzip or deflate body, a broken chunk.
        raise ApiError(400, "parse_error", f"the request body cannot be read: {error}") from None


def json_text(text: str, field: str) -> Any:
    """JSON that the body carries in a string (a tool call's arguments), held to read_json's rules: 400
    invalid_value naming `field` (or the place inside it) when it is not JSON, nests deeper than
    MAX_JSON_DEPTH, or holds a number or string that read_json refuses in the body itself."""
    try:
        value = _parse(text)
    except json.JSONDecodeError:
        raise bad_field(field, "is not valid JSON") from None
    except RecursionError:
        raise _nested_too_deep(field) from None
    holder = {field: value}
    if not _plain(holder):
        _refuse_values(holder, _nested_too_deep(field))
    return value


def _nested_too_deep(field: str) -> ApiError:
    return bad_field(field, f"nests deeper than {MAX_JSON_DEPTH} levels")


class _LongInteger:
    """An integer literal longer than Python converts (4300 digits by default), kept so that the walk
    over the body can name its field."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


class _Underflow(float):
    """A number literal with a non-zero digit that reads as 0.0 (1e-400): no integer field takes it."""


def _parse(raw: bytes | str) -> Any:
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


def _too_deep() -> ApiError:
    return ApiError(400, "parse_error", f"the request body nests deeper than {MAX_JSON_DEPTH} levels")


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


def _refuse_values(data: dict[str, Any], too_deep: ApiError) -> None:
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
            raise bad_field(path, f"must be a finite number, got {value}")
        elif isinstance(value, _LongInteger):
            raise bad_field(path, f"must be a number of usable size, got one of {value.digits} digits")
        elif isinstance(value, str) and not _encodable(value):
            raise _surrogate(path)


def _surrogate(path: str) -> ApiError:
    return bad_field(path, "contains an unpaired UTF-16 surrogate escape")


def _shown(number: int) -> str:
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
            raise bad_field(name, f"must be a string, got {_type_name(value)}")
        if choices and value not in choices:
            raise bad_field(name, f"must be one of {', '.join(choices)}; got {value!r}")
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_field(name, f"must be true or false, got {_type_name(value)}")
        return value

    def integer(
        self, name: str, default: int | None = None, *, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, _Underflow):
            raise bad_field(name, "must be an integer, got a fraction too small for a float (such as 1e-400)")
        # JSON has one number type: 5.0 is an integer, 5.5 is not.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_field(
                name,
                f"must be an integer, got {_type_name(value) if not isinstance(value, float) else value}",
            )
        if minimum is not None and value < minimum:
            raise bad_field(name, f"must be >= {minimum}, got {_shown(value)}")
        if maximum is not None and value > maximum:
            raise bad_field(name, f"must be <= {maximum}, got {_shown(value)}")
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
            raise bad_field(name, f"must be a finite number, got {_type_name(value)}")
        # An integer past float range (10**400) would overflow float(); NaN cannot get past read_json.
        if not -sys.float_info.max <= value <= sys.float_info.max:
            raise bad_field(name, f"must be a finite number within float range, got {_type_name(value)}")
        if minimum is not None and value < minimum:
            raise bad_field(name, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise bad_field(name, f"must be <= {maximum}, got {value}")
        return float(value)

    def array(self, name: str, default: list[Any] | None = None) -> list[Any] | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, list):
            raise bad_field(name, f"must be an array, got {_type_name(value)}")
        return value

    def object(self, name: str, default: dict[str, Any] | None = None) -> dict[str, Any] | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, dict):
            raise bad_field(name, f"must be an object, got {_type_name(value)}")
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
                raise bad_field(name, f"must be {wanted}, or -1 for the server default; got {value}")
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
            raise bad_field(name, "must be a string or an array of strings")
        return stop_strings(value, name)


def stop_strings(values: list[Any], name: str) -> list[str]:
    """Stop strings: at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_BYTES bytes each."""
    if len(values) > MAX_STOP_STRINGS:
        raise bad_field(name, f"at most {MAX_STOP_STRINGS} stop strings, got {len(values)}")
    for i, s in enumerate(values):
        if not isinstance(s, str):
            raise bad_field(name, f"must be a string or an array of strings; item {i} is {_type_name(s)}")
        if s == "":
            raise bad_field(name, "stop strings must not be empty")
        if len(s) > MAX_STOP_BYTES or len(s.encode()) > MAX_STOP_BYTES:
            raise bad_field(name, f"a stop string may have at most {MAX_STOP_BYTES} bytes (item {i})")
    return list(values)


def _logit_bias(body: Body, vocab_size: int, tokenize: Callable[[str], list[int]] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} map, or llama-server's [[id, bias], …] list; a bias of false bans.
    As in llama-server, a key that is text rather than a token id (any string in the list form, a
    string of other than digits in the map) is tokenized and each of its tokens gets the bias."""
    value = body.data.get("logit_bias")
    if value is None:
        return {}
    pairs: list[tuple[Any, Any]]
    if isinstance(value, dict):
        pairs = [(_object_key(key), amount) for key, amount in value.items()]
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise bad_field("logit_bias", "must be an object mapping token ids to biases, or [[id, bias], …]")
    bias: dict[int, float] = {}
    for key, amount in pairs:
        tokens = _bias_tokens(key, vocab_size, tokenize)
        if amount is False:
            bias.update(dict.fromkeys(tokens, -math.inf))
        elif (
            isinstance(amount, bool)
            or not isinstance(amount, int | float)
            or not -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS
        ):
            raise bad_field(
                "logit_bias",
                f"the bias for {str(key)[:40]!r} must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] or false",
            )
        else:
            bias.update(dict.fromkeys(tokens, float(amount)))
    if sum(amount == -math.inf for amount in bias.values()) == vocab_size:
        raise bad_field(
            "logit_bias", f"bans every token of the vocabulary ({vocab_size}): none is left to sample"
        )
    return bias


def _object_key(key: str) -> int | str:
    """A key of the map form: a token id when it is an integer (a negative one is refused later, as
    outside the vocabulary), else text."""
    digits = key.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        return key
    if len(digits) > 12:
        raise bad_field("logit_bias", f"token id {_shown(int(key[:40]))}... is outside the vocabulary")
    return int(key)


def _bias_tokens(key: Any, vocab_size: int, tokenize: Callable[[str], list[int]] | None) -> list[int]:
    """The tokens one logit_bias key stands for: a token id, or the tokens of a text."""
    if isinstance(key, str) and tokenize is not None:
        return tokenize(key)
    if not isinstance(key, int) or isinstance(key, bool):
        raise bad_field("logit_bias", f"keys must be token ids or text, got {str(key)[:40]!r}")
    if not 0 <= key < vocab_size:
        raise bad_field("logit_bias", f"token id {key} is outside the vocabulary (size {vocab_size})")
    return [key]


def bias_text_tokens(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    """How a logit_bias key that is text becomes tokens: as plain text, without BOS or EOS (llama-server
    tokenizes it so too)."""
    return partial(tokenizer.encode, add_bos=False, add_eos=False, parse_special=False)


def sampling_params(
    body: Body,
    defaults: SamplingParams,
    vocab_size: int,
    *,
    limit_fields: Sequence[str] = ("max_tokens",),
    limit_minimum: int = 1,
    tokenize: Callable[[str], list[int]] | None = None,
) -> SamplingParams:
    """The sampling fields every dialect shares, over the server's defaults (llama-server's names);
    the token limit is the first of `limit_fields` set, at least `limit_minimum` (Body.token_limit).
    `tokenize` turns logit_bias keys that are text into their tokens (without it, only ids are taken)."""
    d = defaults
    # -1 and 0 both turn top_k off (vLLM's and llama-server's spellings).
    top_k = body.integer("top_k", d.top_k, minimum=-1, maximum=MAX_COUNT)
    seed = body.integer("seed", d.seed, minimum=-1, maximum=2**64 - 1)
    limit = body.token_limit(*limit_fields, minimum=limit_minimum)
    params = replace(
        d,
        temperature=body.number("temperature", d.temperature, minimum=0.0),
        top_k=max(top_k, 0) if top_k is not None else d.top_k,
        top_p=body.number("top_p", d.top_p, minimum=0.0, maximum=1.0),
        min_p=body.number("min_p", d.min_p, minimum=0.0, maximum=1.0),
        seed=None if seed == -1 else seed,
        repeat_penalty=body.number("repeat_penalty", d.repeat_penalty, minimum=0.0),
        repeat_last_n=body.integer("repeat_last_n", d.repeat_last_n, minimum=-1, maximum=MAX_COUNT),
        presence_penalty=body.number("presence_penalty", d.presence_penalty, minimum=-2.0, maximum=2.0),
        frequency_penalty=body.number("frequency_penalty", d.frequency_penalty, minimum=-2.0, maximum=2.0),
        logit_bias=_logit_bias(body, vocab_size, tokenize) or dict(d.logit_bias),
        max_tokens=limit if limit is not None else d.max_tokens,
        stop=body.stop() or list(d.stop),
        ignore_eos=body.boolean("ignore_eos", d.ignore_eos),
    )
    if params.top_p == 0.0:
        # OpenAI allows top_p 0 and means "only the most likely token".
        params = replace(params, top_p=1.0, top_k=1)
    if params.repeat_penalty == 0.0:
        raise bad_field("repeat_penalty", "must be > 0 (1 disables it)")
    try:
        params.validate()
    except ValueError as error:
        raise ApiError(400, "invalid_value", str(error)) from None
    return params


def reject_n(body: Body) -> None:
    """Only one choice per request is generated."""
    n = body.integer("n")
    if n is not None and n != 1:
        raise ApiError(400, "unsupported_n", f"n: only 1 is supported, got {n}", param="n")
