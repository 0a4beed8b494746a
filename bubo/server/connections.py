"""The server's connections: how long one may sit silent or take over its request head, how many are
held at once, the open-files limit behind them, and the answer to a request aiohttp cannot parse.

aiohttp answers a malformed request itself (too many headers, an over-long header line, a control
character where none may be), before any middleware runs, with a text/plain body; here that answer is
the documented JSON error shape, and it never repeats the request's bytes back."""

import asyncio
import contextlib
import json
import logging
import resource
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.web_protocol import RequestHandler

__all__ = ["ConnectionLimits", "ServerRunner", "connection_cap", "raise_open_files_limit"]

log = logging.getLogger("bubo.server")

# Descriptors kept for what is not a client connection: the model file, the prompt and slot threads'
# pipes, the event loop's own, an image fetch; the rest of the open-files limit is for connections.
RESERVED_FILES = 64


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as far as the system lets it);
    the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        # (An infinite hard limit may be more than the kernel allows: then the soft limit stays.)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(max_connections: int | None) -> int:
    """The most connections held at once: `max_connections`, or what the open-files limit leaves."""
    if max_connections is not None:
        return max_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(soft - RESERVED_FILES, 16)


class ConnectionLimits:
    """What the runner enforces: the head and idle timeouts (seconds) and the connection cap."""

    def __init__(self, header_timeout: float, idle_timeout: float, max_connections: int) -> None:
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections


class _Connection(RequestHandler):
    """One client connection, with a bound on the time its request head takes once it has begun
    (aiohttp's keep-alive timeout bounds the silence before), and protocol errors answered in JSON."""

    def __init__(self, manager: Any, *, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self.last_received = self._loop.time()

    @property
    def is_idle(self) -> bool:
        """Waiting for a request (or the rest of its head): none is being handled."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def data_received(self, data: bytes) -> None:
        self.last_received = self._loop.time()
        super().data_received(data)
        waiter = self._waiter
        waiting = waiter is not None and not waiter.done()
        if waiting and self._head_timer is None:
            # A request head has begun and is not complete yet.
            self._head_timer = self._loop.call_later(self._header_timeout, self._head_expired)
        elif not waiting:
            self._stop_head_timer()

    def _head_expired(self) -> None:
        self._head_timer = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            log.info(
                "a request head took over %g s (--header-timeout); connection closed", self._header_timeout
            )
            self.force_close()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's own answer logs the error and checks nothing was sent yet; its body is replaced.
        super().handle_error(request, status, exc, message)
        return protocol_error_response(status, exc)


def protocol_error_response(status: int, error: BaseException | None) -> web.Response:
    """The JSON error for a request aiohttp refused before any handler ran. aiohttp's own message can
    quote the request's bytes (a header line's first 100), so the message only names what was wrong.
    The connection is closed after it."""
    body = {
        "error": {
            "message": _protocol_message(error) if status < 500 else "internal server error",
            "type": "invalid_request_error" if status < 500 else "server_error",
            "code": "parse_error" if status < 500 else "internal_error",
            "param": None,
        }
    }
    response = web.Response(status=status, text=json.dumps(body), content_type="application/json")
    response.force_close()
    return response


def _protocol_message(error: BaseException | None) -> str:
    if isinstance(error, LineTooLong):
        return "the request line or a header line is longer than the server takes"
    if isinstance(error, BadStatusLine):
        return "the request line is not valid HTTP"
    if isinstance(error, InvalidHeader):
        return "a header is not valid HTTP"
    if isinstance(error, InvalidURLError):
        return "the request path is not valid"
    if isinstance(error, ContentEncodingError):
        return "the request body's Content-Encoding cannot be decoded"
    if isinstance(error, PayloadEncodingError):
        return "the request body's framing (Content-Length, Transfer-Encoding) is not valid"
    if isinstance(error, HttpProcessingError) and error.message.startswith("Too many headers"):
        return "the request has more headers than the server takes"
    return "the request is not valid HTTP (its request line, headers or framing)"


class _Server(web.Server):
    """aiohttp's server, making `_Connection`s and holding at most `max_connections`: past it, of the
    connections waiting for a request the one silent longest is closed for the new one (a client that
    opened many silent sockets must not lock every other client out); when every one has a request in
    hand, the new connection is answered 503 and closed."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, header_timeout=self.limits.header_timeout, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if len(self._connections) <= self.limits.max_connections:
            return
        idle = [c for c in self._connections if isinstance(c, _Connection) and c.is_idle and c is not handler]
        log.warning(
            "%d connections, over the limit of %d (--max-connections): closing %s",
            len(self._connections),
            self.limits.max_connections,
            "the one silent longest" if idle else "the new one",
        )
        if idle:
            min(idle, key=lambda c: c.last_received).force_close()
            return
        transport.write(_BUSY)
        handler.force_close()


def _busy_answer() -> bytes:
    """A whole 503 response, written straight to a connection that will not be served."""
    body = json.dumps(
        {
            "error": {
                "message": "the server holds as many connections as it can (--max-connections); try again",
                "type": "server_error",
                "code": "too_many_connections",
                "param": None,
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 5\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_BUSY = _busy_answer()


class ServerRunner(web.AppRunner):
    """The app's runner with `_Server` in place of aiohttp's."""

    def __init__(self, app: web.Application, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=limits.idle_timeout, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return _Server(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=asyncio.get_running_loop(),
            limits=self.limits,
            **server._kwargs,
        )
