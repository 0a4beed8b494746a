"""Every error the server answers, written in one place, in the OpenAI shape or the Anthropic one.

OpenAI shape (every route but two): {"error": {"message", "type", "code", "param"}}.
Anthropic shape (/v1/messages and /v1/messages/count_tokens): {"type": "error", "error": {"type",
"message", "code"}, "request_id"}, where `error.type` is Anthropic's category for the status
(invalid_request_error, authentication_error, not_found_error, …) and `code` is the stable code the
OpenAI shape carries too.
"""

from collections.abc import Mapping

from aiohttp import web

from bubo.engine.request_error import RequestError

__all__ = ["ANTHROPIC_PATHS", "ApiError", "bad_field", "error_body", "error_response", "request_refused"]

# The routes whose errors take the Anthropic shape.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

# The status codes Anthropic's API documents, with the `error.type` it sends for each.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    501: "api_error",
    503: "overloaded_error",
    507: "api_error",
}


class ApiError(Exception):
    """An answer that is an error: status, OpenAI `type`, stable `code`, and a message for people."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        top_level: Mapping[str, object] | None = None,
        details: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.headers = dict(headers or {})
        # Fields beside "error" in the body, such as {"status": "device_lost"}.
        self.top_level = dict(top_level or {})
        # Fields inside the error object after the documented ones, such as llama-server's n_ctx.
        self.details = dict(details or {})


def bad_field(field: str, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for one request field; the message names the field."""
    return ApiError(400, code, f"{field}: {message}", param=field)


def request_refused(error: RequestError) -> ApiError:
    """The 400 for a request the library refused (a chat it cannot prepare, a field's value)."""
    return ApiError(400, error.code, error.message, param=error.param, details=error.details)


def error_body(error: ApiError, *, anthropic: bool, request_id: str) -> dict[str, object]:
    """The JSON body of an error, in the Anthropic or the OpenAI shape (also sent as a stream's last event)."""
    if anthropic:
        body: dict[str, object] = {
            "type": "error",
            "error": {
                "type": _ANTHROPIC_TYPES.get(error.status, error.type),
                "message": error.message,
                "code": error.code,
                **error.details,
            },
            "request_id": request_id,
            **error.top_level,
        }
    else:
        body = {
            "error": {
                "message": error.message,
                "type": error.type,
                "code": error.code,
                "param": error.param,
                **error.details,
            },
            **error.top_level,
        }
    return body


def error_response(error: ApiError, *, anthropic: bool, request_id: str) -> web.Response:
    headers = {"x-request-id": request_id, **error.headers}
    return web.json_response(
        error_body(error, anthropic=anthropic, request_id=request_id), status=error.status, headers=headers
    )
