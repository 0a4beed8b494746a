"""Reading request bodies: the HTTP body as JSON (`read_json`), and the fields every dialect shares
(sampling, logit bias, the choice count). The typed getters and the JSON limits are the library's
(bubo/engine/request_fields.py); every failure is a 400 that names the field."""

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

from aiohttp import web

from bubo.engine.request_fields import (
    MAX_COUNT,
    MAX_JSON_DEPTH,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    Body,
    check_values,
    json_text,
    parse_json,
    shown_number,
    stop_strings,
)
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


async def read_json(request: web.Request) -> Body:
    """The body as a JSON object; malformed JSON, JSON that is not an object, a body that cannot be
    decoded (a corrupt Content-Encoding) or nesting deeper than MAX_JSON_DEPTH is 400 parse_error. NaN,
    Infinity, numbers past float range, integers past Python's digit limit and unpaired surrogate
    escapes are 400 invalid_value naming where they are. A body that stops arriving is 408; one of
    more than MAX_JSON_VALUES values 413."""
    raw = await _read_body(request)
    if len(raw) <= INLINE_JSON_BYTES:
        return _decode(raw)
    return await asyncio.get_running_loop().run_in_executor(_JSON_THREAD, _decode, raw)


def _decode(raw: bytes) -> Body:
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
        data = parse_json(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, "parse_error", f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        kind = "null" if data is None else f"a JSON {type(data).__name__}"
        raise ApiError(400, "parse_error", f"the request body must be a JSON object, got {kind}")
    check_values(data, _too_deep())
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


def _too_deep() -> ApiError:
    return ApiError(400, "parse_error", f"the request body nests deeper than {MAX_JSON_DEPTH} levels")


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
        raise bad_field("logit_bias", f"token id {shown_number(int(key[:40]))}... is outside the vocabulary")
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
