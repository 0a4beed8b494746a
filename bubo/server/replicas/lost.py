"""The answer for a request whose replica stopped before or while answering it: 503 replica_lost in the
route's error shape, or, for a stream already under way, the event its dialect ends a failed stream
with."""

import json

from bubo.server.errors import ANTHROPIC_PATHS, ApiError, error_body

__all__ = ["RESPONSES_PATHS", "replica_lost", "stream_error_event"]

RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})


def replica_lost(cause: str) -> ApiError:
    return ApiError(
        503,
        "replica_lost",
        f"the replica serving this request stopped ({cause}); Ray Serve is replacing it: send the "
        "request again",
        headers={"Retry-After": "1"},
    )


def stream_error_event(path: str, error: ApiError, request_id: str, events_sent: int) -> bytes:
    """The event that ends a stream cut short after `events_sent` events: Anthropic's `error` event,
    the Responses `error` event (numbered on from the stream's), or an OpenAI-shaped error object as
    the data of the chat, completions and llama-server streams."""
    if path in ANTHROPIC_PATHS:
        body = error_body(error, anthropic=True, request_id=request_id)
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    if path in RESPONSES_PATHS:
        body = {
            "type": "error",
            "sequence_number": events_sent,
            "code": error.code,
            "message": error.message,
            "param": None,
        }
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    return f"data: {json.dumps(error_body(error, anthropic=False, request_id=request_id))}\n\n".encode()
