"""The error a request gets when the library refuses it: a field with a wrong value, fields that
contradict each other, a prompt that does not fit, a schema or grammar that does not compile.

It says what is wrong in words, which field (`param`, as the request or the keyword argument names it)
and a stable `code`; the server maps it to its documented 400 answer (bubo/server/errors.py), and a
library caller catches it as the ValueError it is.
"""

from collections.abc import Mapping

__all__ = ["RequestError", "invalid_field"]


class RequestError(ValueError):
    """A request refused for what it asks: `message` for people, `code` for programs (invalid_value,
    conflicting_fields, invalid_schema, context_length_exceeded, ...), `param` the field at fault, and
    `details`, numbers that help a client fix it (the prompt's length and the context's)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str = "invalid_value",
        details: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.details = dict(details or {})


def invalid_field(field: str, message: str, code: str = "invalid_value") -> RequestError:
    """The refusal of one field's value; the message starts with the field's name."""
    return RequestError(f"{field}: {message}", param=field, code=code)
