"""openapi.yaml stays true: its routes are the app's routes, its schemas are valid JSON Schema, its
examples match its schemas, its limits are the server's, and a live server answers the documented
examples (and the documented errors) in the documented shapes."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

from bubo.engine.loaded_model import LoadedModel
from bubo.engine.sampler import SamplingParams
from bubo.server import fields, probe_fields
from bubo.server.app import create_app
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState
from tests.server.live_server import LiveServer, scripted, serve_loaded
from tests.server.openapi_doc import METHODS, document, operations, pointer, response_schema, validator

OPERATIONS = list(operations())


def _app_routes(debug_hooks: bool) -> set[tuple[str, str]]:
    """(METHOD, path) for every route the app serves; aiohttp's automatic HEAD for GET is left out, and
    a route for any method ("*") counts as every method."""
    state = ServerState(ServerSettings(model_path=Path("absent.gguf"), debug_hooks=debug_hooks))
    routes = set()
    for route in create_app(state).router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        methods = [m.upper() for m in METHODS] if route.method == "*" else [route.method]
        routes |= {(method, path) for method in methods if method != "HEAD"}
    return routes


def _documented_routes(*, debug: bool) -> set[tuple[str, str]]:
    paths = document()["paths"]
    return {(method, path) for path, method, _ in OPERATIONS if debug or not paths[path].get("x-debug-hooks")}


@pytest.mark.parametrize("debug_hooks", [False, True])
def test_the_documented_routes_are_exactly_the_apps_routes(debug_hooks: bool) -> None:
    served = _app_routes(debug_hooks)
    documented = _documented_routes(debug=debug_hooks)
    assert served - documented == set(), "served but not in openapi.yaml"
    assert documented - served == set(), "in openapi.yaml but not served"


def test_routes_for_any_method_are_marked_and_document_every_method() -> None:
    for path, item in document()["paths"].items():
        if item.get("x-any-method"):
            assert all(method in item for method in METHODS), path


Where = tuple[str | int, ...]


def _schemas(node: Any, where: Where = ()) -> Iterator[Where]:
    """Where every schema object in the document is: component schemas, and the schemas of
    parameters, bodies and answers."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "schema" or (where == ("components", "schemas") and isinstance(value, dict)):
                yield (*where, key)
            yield from _schemas(value, (*where, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _schemas(value, (*where, i))


def _at(where: Where) -> Any:
    node: Any = document()
    for part in where:
        node = node[part]
    return node


def test_every_schema_is_valid_json_schema_and_every_reference_resolves() -> None:
    found = list(_schemas(document()))
    assert len(found) > 50
    for where in found:
        Draft202012Validator.check_schema(_at(where))
        # Validating walks every $ref it meets; one that points nowhere raises.
        validator(pointer(*where)).is_valid(None)


def _examples(node: Any, where: Where = ()) -> Iterator[tuple[Where, Any]]:
    """(where the schema is, example) for every example beside a schema (a media type) or in one."""
    if isinstance(node, dict):
        if "example" in node and "schema" in node:
            yield (*where, "schema"), node["example"]
        elif "example" in node and "type" in node:
            yield where, node["example"]
        for key, value in node.items():
            yield from _examples(value, (*where, key))


def test_every_documented_example_matches_its_schema() -> None:
    examples = list(_examples(document()))
    assert len(examples) >= 15
    for where, example in examples:
        errors = list(validator(pointer(*where)).iter_errors(example))
        assert not errors, f"{where}: {errors[0].message}"


def test_the_documented_limits_are_the_servers() -> None:
    limits = document()["info"]["x-limits"]
    assert limits == {
        "max_json_depth": fields.MAX_JSON_DEPTH,
        "max_json_values": fields.MAX_JSON_VALUES,
        "max_count": fields.MAX_COUNT,
        "max_stop_strings": fields.MAX_STOP_STRINGS,
        "max_stop_bytes": fields.MAX_STOP_BYTES,
        "logit_bias_range": [-fields.MAX_LOGIT_BIAS, fields.MAX_LOGIT_BIAS],
        "max_probe_values": probe_fields.MAX_PROBE_VALUES,
    }
    schemas = document()["components"]["schemas"]
    assert schemas["Count"]["maximum"] == fields.MAX_COUNT
    assert schemas["StopList"]["maxItems"] == fields.MAX_STOP_STRINGS
    assert schemas["StopString"]["x-max-bytes"] == fields.MAX_STOP_BYTES


@pytest.fixture(scope="module")
def server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(
        scripted(tiny_llama, "Hi there."),
        defaults=SamplingParams(temperature=0.0, max_tokens=4),
        debug_hooks=True,
    )
    yield live
    live.stop()


def _concrete(path: str) -> str:
    return path.replace("{tail}", "txt2img").replace("{model_id}", "bubo")


@pytest.mark.parametrize(
    ("path", "method", "operation"), OPERATIONS, ids=[f"{m} {p}" for p, m, _ in OPERATIONS]
)
def test_the_documented_example_gets_the_documented_answer(
    server: LiveServer, path: str, method: str, operation: dict[str, Any]
) -> None:
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("example")
    response = httpx.request(method, server.url + _concrete(path), json=body, timeout=30)
    expected = 501 if "501" in operation["responses"] else 200
    assert response.status_code == expected, response.text
    media = response.headers["content-type"].split(";")[0]
    if media == "application/json":
        errors = list(validator(response_schema(path, method, expected)).iter_errors(response.json()))
        assert not errors, errors[0].message
    else:
        assert media in operation["responses"][str(expected)]["content"]


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: LoadedModel) -> Iterator[LiveServer]:
    live = serve_loaded(scripted(tiny_llama, "Hi there."), api_key="sesame", debug_hooks=True)
    yield live
    live.stop()


@pytest.mark.parametrize(
    ("path", "method", "operation"), OPERATIONS, ids=[f"{m} {p}" for p, m, _ in OPERATIONS]
)
def test_a_missing_key_gets_the_documented_401(
    keyed_server: LiveServer, path: str, method: str, operation: dict[str, Any]
) -> None:
    response = httpx.request(method, keyed_server.url + _concrete(path), json={}, timeout=30)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    errors = list(validator(response_schema(path, method, 401)).iter_errors(response.json()))
    assert not errors, errors[0].message


ERRORS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "missing_model"),
    (
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model_not_found",
    ),
    ("/v1/completions", {"model": "bubo", "prompt": "hi", "n": 2}, 400, "unsupported_n"),
    ("/v1/responses", {"model": "bubo"}, 400, "missing_input"),
    (
        "/v1/messages",
        {"model": "bubo", "messages": [{"role": "user", "content": "hi"}]},
        400,
        "missing_max_tokens",
    ),
    (
        "/v1/messages",
        {"model": "nope", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
        404,
        "model_not_found",
    ),
    ("/v1/messages/count_tokens", {"model": "bubo"}, 400, "missing_messages"),
    ("/completion", {"prompt": "hi", "top_k": 10**12}, 400, "invalid_value"),
    ("/apply-template", {"messages": []}, 400, "missing_messages"),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), ERRORS)
def test_documented_errors_have_the_documented_shape(
    server: LiveServer, path: str, body: dict[str, Any], status: int, code: str
) -> None:
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    payload = response.json()
    errors = list(validator(response_schema(path, "POST", status)).iter_errors(payload))
    assert not errors, errors[0].message
    assert payload["error"]["code"] == code


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/completion"])
def test_a_body_over_the_limit_gets_the_documented_413(tiny_llama: LoadedModel, path: str) -> None:
    live = serve_loaded(scripted(tiny_llama, "Hi there."), max_body_mb=0.01)
    try:
        response = httpx.post(live.url + path, content=b'{"prompt": "' + b"x" * 20_000 + b'"}', timeout=30)
    finally:
        live.stop()
    assert response.status_code == 413
    errors = list(validator(response_schema(path, "POST", 413)).iter_errors(response.json()))
    assert not errors, errors[0].message
