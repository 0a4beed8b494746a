"""Property-based fuzzing of every route that openapi.yaml documents, against a live server on loopback
whose model is scripted (each answer is a few instant tokens).

Each operation gets valid bodies drawn from its documented schema, the same bodies with one value
anywhere in them replaced by a hostile one (negative, huge, NaN, Infinity, wrong type, deep nesting,
10 000-item arrays, 1 MB strings), bodies with a required field dropped, bodies that are not JSON
objects at all (junk bytes, non-UTF-8, other JSON values, deep nesting), odd content types, query
strings and headers, and methods the route does not serve. Every answer must be documented for the
operation, no 5xx but the documented 501 (and the memory guard's 503/507), every error in its
dialect's documented shape, no stream that carries an internal error, and no hang (a client timeout
fails the case). Draws are derandomized, so CI runs the same cases every time.
"""

import json
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from tests.server.live_server import LiveServer, scripted, serve_loaded
from tests.server.openapi_doc import (
    METHODS,
    from_schema,
    json_values,
    operations,
    pointer,
    resolve,
    response_schema,
    validator,
)

# Cases per operation: bodies are where the mistakes are, so body-taking routes get most of them.
BODY_EXAMPLES = 180
OTHER_EXAMPLES = 40
MEMORY_GUARD_CODES = {"insufficient_memory", "memory_pressure", "insufficient_memory_permanent"}
ANTHROPIC_PATHS = {"/v1/messages", "/v1/messages/count_tokens"}
_HOSTILE = "__hostile__"

HOSTILE_VALUES = (
    -1,
    0,
    -(2**63),
    2**64,
    10**12,
    10**400,
    1e308,
    -1e308,
    True,
    False,
    None,
    "7",
    "",
    "x" * 1_000_000,
    [],
    {},
    ["a"] * 10_000,
    [[]] * 100,
    {"0": {"1": {"2": [None]}}},
)
# JSON texts that Python's json.dumps cannot write from a value: non-standard constants, numbers past
# float range or Python's 4300-digit integer limit, nesting past any recursion limit.
HOSTILE_TEXTS = (
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "1" * 5000,
    "1e-400",
    "-0",
    "[" * 70 + "]" * 70,
    "[" * 10_000 + "]" * 10_000,
    '{"a":' * 3000 + "1" + "}" * 3000,
)
CONTENT_TYPES = (
    "application/json",
    "application/json; charset=utf-8",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/octet-stream",
)


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    server = serve_loaded(
        scripted(tiny_llama, "Hi there."),
        defaults=SamplingParams(temperature=0.0, max_tokens=4),
        debug_hooks=True,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(fuzz_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as session:
        yield session


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path to every value inside a JSON document (the document itself excluded)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield (*prefix, key)
        yield from _paths(item, (*prefix, key))


def _replaced(document: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(document, dict):
        return {**document, head: _replaced(document[head], rest, new)}
    return [_replaced(item, rest, new) if i == head else item for i, item in enumerate(document)]


@st.composite
def hostile_bodies(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]], names: list[str]) -> bytes:
    """A valid body with one value, or one new top-level field, replaced by a hostile value or text."""
    body = draw(valid)
    paths = [*_paths(body), *((name,) for name in names if name not in body)]
    path = draw(st.sampled_from(paths))
    if path[-1] not in body and len(path) == 1:
        body = {**body, path[0]: None}
    if draw(st.booleans()):
        return json.dumps(_replaced(body, path, draw(st.sampled_from(HOSTILE_VALUES)))).encode()
    text = json.dumps(_replaced(body, path, _HOSTILE))
    return text.replace(f'"{_HOSTILE}"', draw(st.sampled_from(HOSTILE_TEXTS)), 1).encode()


@st.composite
def dropped_field(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> bytes:
    body = draw(valid)
    if body:
        del body[draw(st.sampled_from(sorted(body)))]
    return json.dumps(body).encode()


@st.composite
def non_utf8(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> bytes:
    raw = json.dumps(draw(valid), ensure_ascii=False).encode()
    at = draw(st.integers(0, len(raw)))
    return raw[:at] + draw(st.sampled_from((b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"))) + raw[at:]


def bodies(operation: dict[str, Any]) -> st.SearchStrategy[bytes | None]:
    malformed = st.one_of(
        st.just(b""),
        st.binary(max_size=64),
        json_values().map(lambda v: json.dumps(v).encode()),
        st.integers(1, 20_000).map(lambda n: ("[" * n + "]" * n).encode()),
        st.just(b'{"model": "bubo", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    )
    content = operation.get("requestBody", {}).get("content", {}).get("application/json")
    if content is None:
        return st.none() | malformed
    schema = content["schema"]
    valid = from_schema(schema)
    names = sorted(_property_names(schema))
    return st.one_of(
        valid.map(lambda body: json.dumps(body).encode()),
        sparse(valid, _required_names(schema)).map(lambda body: json.dumps(body).encode()),
        sparse(valid, _required_names(schema)).map(lambda body: json.dumps(body).encode()),
        hostile_bodies(valid, names),
        hostile_bodies(valid, names),
        dropped_field(valid),
        non_utf8(valid),
        malformed,
    )


@st.composite
def sparse(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]], required: set[str]) -> dict[str, Any]:
    """A valid body with its required fields and at most two optional ones: each optional field has
    its own ways to be refused (a bias for a token past the vocabulary, a tool choice naming no tool),
    so bodies with all of them seldom reach the route's answer."""
    body = draw(valid)
    optional = sorted(set(body) - required)
    kept = draw(st.lists(st.sampled_from(optional), max_size=2, unique=True)) if optional else []
    return {name: value for name, value in body.items() if name in required or name in kept}


def _required_names(schema: dict[str, Any]) -> set[str]:
    return _names(schema, "required")


def _property_names(schema: dict[str, Any]) -> set[str]:
    return _names(schema, "properties")


def _names(schema: dict[str, Any], key: str) -> set[str]:
    """The field names an object schema lists under `key`, through its allOf parts."""
    schema = resolve(schema)
    names = set(schema.get(key, ()))
    for part in schema.get("allOf", ()):
        names |= _names(part, key)
    return names


def headers() -> st.SearchStrategy[dict[str, str]]:
    # Header values as HTTP allows them: visible ASCII (h11 refuses leading or trailing spaces).
    ascii_text = st.from_regex(r"[!-~]{0,40}", fullmatch=True)
    return st.fixed_dictionaries(
        {},
        optional={
            "Content-Type": st.sampled_from(CONTENT_TYPES),
            "x-request-id": ascii_text,
            "Accept": st.sampled_from(["*/*", "text/event-stream", "application/json", "text/html"]),
            "Authorization": ascii_text,
            "x-api-key": ascii_text,
        },
    )


def queries(operation: dict[str, Any]) -> st.SearchStrategy[dict[str, str]]:
    documented = [p["name"] for p in operation.get("parameters", ()) if p["in"] == "query"]
    keys = (
        st.sampled_from([*documented, "model", "stream"]) if documented else st.sampled_from(["model", "x"])
    )
    values = st.sampled_from(["bubo", "", "nope", "1e999", "NaN", "-1", "x" * 4000]) | st.text(max_size=20)
    return st.dictionaries(keys, values, max_size=3)


def _concrete(path: str, tail: str) -> str:
    return re.sub(r"\{[^}]+\}", lambda _: tail or "x", path)


def _expected_schema(
    path: str, method: str, operation: dict[str, Any], status: int, wrong_method: bool
) -> str:
    """The pointer to the documented schema of this answer; fails when the status is not documented."""
    if wrong_method:
        assert status in (405, 401), f"{method} {path} (not served) answered {status}"
        if status == 405:
            name = "AnthropicError" if path in ANTHROPIC_PATHS else "InvalidRequestError"
            return pointer("components", "schemas", name)
    documented = operation["responses"]
    assert str(status) in documented, f"{method} {path} answered {status}; documented: {sorted(documented)}"
    return response_schema(path, method, status)


def _check(
    response: httpx.Response, path: str, method: str, operation: dict[str, Any], wrong_method: bool
) -> None:
    status = response.status_code
    where = f"{method} {path} -> {status}: {response.text[:300]}"
    assert "x-request-id" in response.headers or status < 400, where
    kind = response.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        assert status == 200, where
        assert "internal_error" not in response.text, where
        return
    ref = _expected_schema(path, method, operation, status, wrong_method)
    if status >= 500:
        body = response.json()
        code = (body["error"] or {}).get("code")
        assert status == 501 or code in MEMORY_GUARD_CODES, where
    if kind.startswith("application/json"):
        errors = sorted(validator(ref).iter_errors(response.json()), key=str)
        assert not errors, f"{where}\n{errors[0].message}"
    else:
        assert status == 200 and "text/plain" in operation["responses"]["200"]["content"], where


OPERATIONS = list(operations())


@pytest.mark.parametrize(
    ("path", "method", "operation"), OPERATIONS, ids=[f"{m} {p}" for p, m, _ in OPERATIONS]
)
def test_every_operation_answers_fuzzed_requests_in_its_documented_shape(
    client: httpx.Client, path: str, method: str, operation: dict[str, Any]
) -> None:
    served = {m for p, m, _ in OPERATIONS if p == path}
    other_methods = [m.upper() for m in METHODS if m.upper() not in served]
    examples = BODY_EXAMPLES if "requestBody" in operation else OTHER_EXAMPLES

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        body=bodies(operation),
        query=queries(operation),
        extra_headers=headers(),
        # A path parameter: a served model id now and then (/v1/models/{model_id}), else anything.
        tail=st.just("bubo") | st.from_regex(r"[a-z0-9./-]{0,12}", fullmatch=True),
        other=st.sampled_from(other_methods) if other_methods else st.none(),
        wrong_method=st.integers(0, 19).map(lambda i: i == 7),
    )
    def case(
        body: bytes | None,
        query: dict[str, str],
        extra_headers: dict[str, str],
        tail: str,
        other: str | None,
        wrong_method: bool,
    ) -> None:
        verb = other if wrong_method and other is not None else method
        response = client.request(
            verb, _concrete(path, tail), params=query, content=body, headers=extra_headers
        )
        statuses[response.status_code] += 1
        _check(response, path, verb, operation, verb != method)

    statuses: Counter[int] = Counter()
    case()
    print(f"{method} {path}: {dict(sorted(statuses.items()))}")
    # The draws reach the route's answer too, not only its errors.
    assert 200 in statuses or "200" not in operation["responses"], statuses


def test_the_server_is_healthy_after_the_fuzzing(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    chat = {"model": "bubo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    answer = client.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "Hi th"
    assert client.get("/slots").json()[0]["is_processing"] is False
