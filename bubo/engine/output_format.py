"""What a chat's answer must look like: the JSON schema an output format asks for (OpenAI's
`response_format`, and the same objects under other dialects' names), OpenAI's strict mode for schemas,
and llama-server's top-level `json_schema` and `grammar` beside them, at most one per request."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bubo.engine.request_error import RequestError, invalid_field
from bubo.engine.request_fields import Body

__all__ = ["OutputConstraint", "output_constraint", "output_schema", "strict_schema"]


def output_schema(fmt: Any, field_name: str) -> dict[str, Any] | None:
    """The JSON schema an output format asks for: None for plain text; for json_object, its `schema`
    when it has one (llama-server's form) and else any object; for json_schema, the given schema (its
    `schema` member, or the object itself when the dialect puts the schema there directly), made
    strict (`strict_schema`) with `strict: true` beside it, as OpenAI's structured outputs are."""
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise invalid_field(f"{field_name}.type", f"must be text, json_object or json_schema; got {kind!r}")
    assert isinstance(fmt, Mapping)
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is None:
            return {"type": "object"}
        if not isinstance(schema, Mapping):
            raise invalid_field(f"{field_name}.schema", "must be a JSON schema object")
        return dict(schema)
    where = f"{field_name}.json_schema" if "json_schema" in fmt else field_name
    holder = fmt.get("json_schema", fmt)
    schema = holder.get("schema") if isinstance(holder, Mapping) else None
    if not isinstance(schema, Mapping):
        raise invalid_field(f"{field_name}.schema", "json_schema needs a `schema` object")
    strict = holder.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_field(f"{where}.strict", "must be true, false or null")
    return strict_schema(schema, f"{where}.schema") if strict else dict(schema)


# Where strict_schema looks for nested schemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")


def strict_schema(schema: Any, where: str) -> Any:
    """`schema` (at `where` in the body) as OpenAI's strict mode reads it: every object requires all of
    its properties and allows no others unless it sets `additionalProperties` itself; nested objects
    (properties, items, anyOf, $defs) too. A property that may be left out is spelled as a nullable
    type in strict mode. 400 invalid_schema when `properties` is not an object of schemas."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    if "properties" in out and not isinstance(out["properties"], Mapping):
        raise invalid_field(f"{where}.properties", "must be an object of schemas", code="invalid_schema")
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: strict_schema(sub, f"{where}.{key}.{name}") for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub, f"{where}.{key}[{i}]") for i, sub in enumerate(out[key])]
    if "items" in out:
        out["items"] = strict_schema(out["items"], f"{where}.items")
    types = out.get("type")
    if types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out:
        if "properties" in out:
            out["required"] = list(out["properties"])
        out.setdefault("additionalProperties", False)
    return out


@dataclass(frozen=True)
class OutputConstraint:
    """What the answer must match: a JSON `schema` or a GBNF grammar (`gbnf`), asked for in `field`."""

    field: str
    schema: Mapping[str, Any] | None = None
    gbnf: str | None = None


def output_constraint(
    body: Body, format_schema: Mapping[str, Any] | None = None, format_field: str = "response_format"
) -> OutputConstraint | None:
    """The one constraint of a request: its `json_schema`, its `grammar`, or the schema its dialect's
    own format field (`format_field`) asked for (`format_schema`, None for plain text). 400
    conflicting_fields naming the second when there are two. An empty grammar is none, as in
    llama-server."""
    given: list[OutputConstraint] = []
    if "json_schema" in body:
        given.append(OutputConstraint("json_schema", schema=body.object("json_schema")))
    gbnf = body.string("grammar")
    if gbnf:
        given.append(OutputConstraint("grammar", gbnf=gbnf))
    if format_schema is not None:
        given.append(OutputConstraint(format_field, schema=format_schema))
    if len(given) > 1:
        names = " and ".join(c.field for c in given)
        raise RequestError(f"{names}: give one constraint", param=given[1].field, code="conflicting_fields")
    return given[0] if given else None
