"""The answer for a request whose replica stopped before or while answering it: 503 replica_lost in the
route's error shape, or, for a stream already under way, the events its dialect ends a failed stream
with."""

import json
from typing import Any

from bubo.server.errors import ANTHROPIC_PATHS, ApiError, error_body

__all__ = ["RESPONSES_PATHS", "CutStream", "replica_lost"]

RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})


def replica_lost(cause: str) -> ApiError:
    return ApiError(
        503,
        "replica_lost",
        f"the replica serving this request stopped ({cause}); Ray Serve is replacing it: send the "
        "request again",
        headers={"Retry-After": "1"},
    )


def _event(data: dict[str, Any], name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class CutStream:
    """A stream passed on event by event, and how it ends if its replica is lost: Anthropic's `error`
    event; for Responses, `error` then `response.failed` (numbered on from the stream's, the response
    as created with the output items completed so far), as Bubo's own failed streams end; for the chat,
    completions and llama-server streams, an OpenAI-shaped error object as the last data."""

    def __init__(self, path: str, request_id: str) -> None:
        self.path = path
        self.request_id = request_id
        self.events = 0
        self.response: dict[str, Any] | None = None
        self.output: list[dict[str, Any]] = []

    def saw(self, event: bytes) -> None:
        self.events += 1
        if self.path not in RESPONSES_PATHS:
            return
        data = event.decode(errors="replace").rpartition("data: ")[2]
        try:
            fields = json.loads(data)
        except ValueError:
            return
        kind = fields.get("type")
        if kind in ("response.created", "response.in_progress"):
            self.response = fields["response"]
        elif kind == "response.output_item.done":
            self.output.append(fields["item"])

    def end(self, error: ApiError) -> bytes:
        if self.path in ANTHROPIC_PATHS:
            return _event(error_body(error, anthropic=True, request_id=self.request_id), "error")
        if self.path not in RESPONSES_PATHS:
            return _event(error_body(error, anthropic=False, request_id=self.request_id))
        fields = {"code": error.code, "message": error.message, "param": error.param}
        ending = _event({"type": "error", "sequence_number": self.events, **fields}, "error")
        if self.response is not None:
            failed = {
                **self.response,
                "status": "failed",
                "error": {"code": error.code, "message": error.message},
                "output": self.output,
            }
            ending += _event(
                {"type": "response.failed", "sequence_number": self.events + 1, "response": failed},
                "response.failed",
            )
        return ending
