"""The tokens the request being served has run through the model, counted for the request log
(bubo/server/request_log.py): `ServerState.stream` records each finished generation's usage, and the
log's middleware reads the counts of the request whose task it serves."""

from contextvars import ContextVar
from dataclasses import dataclass

from bubo.engine.request import Usage

__all__ = ["RequestTokens", "count_tokens", "record_usage"]


@dataclass
class RequestTokens:
    prompt: int | None = None
    completion: int | None = None


_CURRENT: ContextVar[RequestTokens | None] = ContextVar("bubo_request_tokens", default=None)


def count_tokens() -> RequestTokens:
    """Start counting for the request of the running task; its counts fill the object returned."""
    tokens = RequestTokens()
    _CURRENT.set(tokens)
    return tokens


def record_usage(usage: Usage) -> None:
    """Count a finished generation's tokens for the request being served (added up, should a request
    run several); nothing outside a request."""
    tokens = _CURRENT.get()
    if tokens is None:
        return
    tokens.prompt = (tokens.prompt or 0) + usage.prompt_tokens
    tokens.completion = (tokens.completion or 0) + usage.completion_tokens
