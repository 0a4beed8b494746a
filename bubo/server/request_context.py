"""What a request carries through the server's tasks without being passed along: its id (x-request-id)
and the API key it came with, and the ids the server makes."""

import secrets
from contextvars import ContextVar

__all__ = ["CURRENT_API_KEY", "CURRENT_REQUEST_ID", "new_id"]

# The HTTP request's id (x-request-id), set by the app's error middleware for the request's task, so a
# failure deep in generation is reported under the id the client sees.
CURRENT_REQUEST_ID: ContextVar[str | None] = ContextVar("bubo_request_id", default=None)
# Which of the API keys the request came with (its index), set by the app's key check.
CURRENT_API_KEY: ContextVar[int | None] = ContextVar("bubo_api_key", default=None)


def new_id(prefix: str) -> str:
    """An id like OpenAI's: prefix plus 24 random lowercase letters and digits."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return prefix + "".join(secrets.choice(alphabet) for _ in range(24))
