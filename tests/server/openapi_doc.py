"""The repository's OpenAPI description (openapi.yaml) for tests: its operations, validators for the
schemas it documents, and hypothesis strategies that draw values from those schemas."""

from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

OPENAPI_PATH = Path(__file__).resolve().parents[2] / "openapi.yaml"
METHODS = ("get", "post", "put", "delete", "patch")
_BASE = "urn:bubo:openapi"
# Drawn strings and arrays stay short so that every drawn prompt fits a small test context.
_MAX_TEXT = 12
_MAX_ITEMS = 3


@cache
def document() -> dict[str, Any]:
    return yaml.safe_load(OPENAPI_PATH.read_text())


def operations() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(path, METHOD, operation) for every documented operation."""
    for path, item in document()["paths"].items():
        for method in METHODS:
            if method in item:
                yield path, method.upper(), item[method]


def pointer(*parts: object) -> str:
    """A JSON pointer into the document ("/" in a part is written "~1")."""
    return "#/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in parts)


@cache
def _registry() -> Registry:
    return Registry().with_resource(_BASE, Resource.from_contents(document(), DRAFT202012))


def validator(ref: str) -> Draft202012Validator:
    """A validator for the schema at `ref` (a pointer from `pointer`), its $refs resolved in the document."""
    return Draft202012Validator({"$ref": _BASE + ref}, registry=_registry())


def resolve(node: Any) -> Any:
    """`node`, or the node its $ref names."""
    while isinstance(node, Mapping) and "$ref" in node:
        target: Any = document()
        for part in str(node["$ref"]).removeprefix("#/").split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        node = target
    return node


def json_values() -> st.SearchStrategy[Any]:
    """Any small JSON value."""
    scalars = (
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=_MAX_TEXT)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=_MAX_ITEMS)
            | st.dictionaries(st.text(max_size=_MAX_TEXT), inner, max_size=_MAX_ITEMS)
        ),
        max_leaves=8,
    )


def from_schema(schema: Any) -> st.SearchStrategy[Any]:
    """Values valid against `schema`, for the subset of JSON Schema that openapi.yaml uses."""
    schema = resolve(schema)
    if "allOf" in schema:
        return _object(_merged(schema["allOf"]))
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return st.one_of([from_schema(s) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    drawn = _typed(schema, kind)
    if "examples" in schema:
        drawn = st.sampled_from(schema["examples"]) | drawn
    return drawn


def _typed(schema: Mapping[str, Any], kind: str | None) -> st.SearchStrategy[Any]:
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", _MAX_TEXT), _MAX_TEXT)))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low, high = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
        floats = st.floats(low, high, allow_nan=False, allow_infinity=False)
        if "exclusiveMinimum" in schema:
            floats = floats.filter(lambda x: x > schema["exclusiveMinimum"])
        return floats
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        if "prefixItems" in schema:
            return st.tuples(*(from_schema(s) for s in schema["prefixItems"])).map(list)
        low = schema.get("minItems", 0)
        high = max(low, min(schema.get("maxItems", _MAX_ITEMS), _MAX_ITEMS))
        return st.lists(from_schema(schema.get("items", {})), min_size=low, max_size=high)
    if kind == "object":
        return _object(schema)
    return json_values()


def _merged(parts: list[Any]) -> dict[str, Any]:
    """The object schemas of an allOf as one: their properties and required fields together."""
    merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    for part in map(resolve, parts):
        if "allOf" in part:
            part = _merged(part["allOf"])
        merged["properties"].update(part.get("properties", {}))
        merged["required"] += part.get("required", [])
    return merged


def _object(schema: Mapping[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    if not properties:
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            pattern = schema.get("propertyNames", {}).get("pattern", "^[a-z]{1,8}$")
            keys = st.from_regex(pattern, fullmatch=True)
            return st.dictionaries(keys, from_schema(extra), max_size=_MAX_ITEMS)
        return st.dictionaries(st.text(max_size=_MAX_TEXT), json_values(), max_size=_MAX_ITEMS)
    return st.fixed_dictionaries(
        {name: from_schema(s) for name, s in properties.items() if name in required},
        optional={name: from_schema(s) for name, s in properties.items() if name not in required},
    )


def response_schema(path: str, method: str, status: int | str, media: str = "application/json") -> str:
    """The pointer to the documented schema of one answer of one operation."""
    response = document()["paths"][path][method.lower()]["responses"][str(status)]
    base = (
        response["$ref"]
        if "$ref" in response
        else pointer("paths", path, method.lower(), "responses", status)
    )
    return (
        base + "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in ("content", media, "schema"))
    )
