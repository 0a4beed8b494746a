"""llama-server's top-level output constraints, `json_schema` (a JSON schema) and `grammar` (GBNF), which
it takes on its own /completion and on the OpenAI routes alike, beside a dialect's own JSON format
(`response_format`, Responses' `text.format`): at most one of them per request, and never one
silently ignored."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bubo.engine.grammar import GrammarMatcher
from bubo.server.errors import ApiError
from bubo.server.fields import Body
from bubo.server.state import ServerState

__all__ = ["OutputConstraint", "chat_constraint", "constraint_grammar", "output_constraint"]


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
        raise ApiError(400, "conflicting_fields", f"{names}: give one constraint", param=given[1].field)
    return given[0] if given else None


async def constraint_grammar(
    state: ServerState, constraint: OutputConstraint | None
) -> GrammarMatcher | None:
    """The compiled matcher of a constraint (None for none); 400 invalid_schema or invalid_grammar."""
    if constraint is None:
        return None
    if constraint.gbnf is not None:
        return await state.compile_gbnf(constraint.gbnf, constraint.field)
    assert constraint.schema is not None
    return await state.compile_schema(constraint.schema, constraint.field)


def chat_constraint(constraint: OutputConstraint | None) -> dict[str, Any]:
    """The constraint as ServerState.chat_generation's keyword arguments."""
    if constraint is None:
        return {}
    return {"schema": constraint.schema, "gbnf": constraint.gbnf, "schema_field": constraint.field}
