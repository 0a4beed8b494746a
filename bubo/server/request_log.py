"""The server's log: one line per request (method, path, status, prompt and completion tokens,
milliseconds, request id) on the `bubo.requests` logger, and how every log line is written: as text,
or as one JSON object a line for a log collector (`--log-format`). The token counts are those of the
generation the request ran (bubo/server/request_tokens.py)."""

import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from bubo.server.keys import REQUEST_ID
from bubo.server.request_tokens import count_tokens

__all__ = ["JsonFormatter", "announce", "configure_logging", "request_log_middleware"]

log = logging.getLogger("bubo.requests")

# The status nginx logs for a client that closed the connection before the answer was complete.
CLIENT_CLOSED = 499
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# Whether lines are JSON (--log-format json): the lifecycle lines `announce` writes follow it.
_json_lines = False


@web.middleware
async def request_log_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Log the request once it is answered (a stream once it has ended). Outermost, so the status is
    the one sent, errors included."""
    tokens = count_tokens()
    started = time.perf_counter()
    status = CLIENT_CLOSED
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        milliseconds = (time.perf_counter() - started) * 1000
        request_id = request.get(REQUEST_ID, "-")
        log.info(
            "%s %s %d prompt_tokens=%s completion_tokens=%s ms=%.0f id=%s",
            request.method,
            request.path,
            status,
            "-" if tokens.prompt is None else tokens.prompt,
            "-" if tokens.completion is None else tokens.completion,
            milliseconds,
            request_id,
            extra={
                "http": {
                    "method": request.method,
                    "path": request.path,
                    "status": status,
                    "prompt_tokens": tokens.prompt,
                    "completion_tokens": tokens.completion,
                    "ms": round(milliseconds, 1),
                    "request_id": request_id,
                }
            },
        )


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, a request line's fields, and a
    traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, "http", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """The root logger's level and line format (`--log-level`, `--log-format`), on stderr."""
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be text or json, got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = time.gmtime
    else:
        formatter = logging.Formatter("bubo: %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    global _json_lines
    _json_lines = fmt == "json"


def announce(message: str, level: str = "info", text: str | None = None) -> None:
    """A line of the server's life (listening, ready, stopping, a fatal error) on stderr whatever the
    log level, since supervisors wait for them: `text` (default "bubo: MESSAGE") as text, or with
    --log-format json a JSON line like the log's."""
    if _json_lines:
        record = logging.LogRecord(
            "bubo.server", getattr(logging, level.upper()), __file__, 0, message, None, None
        )
        formatter = JsonFormatter()
        formatter.converter = time.gmtime
        line = formatter.format(record)
    else:
        line = text if text is not None else f"bubo: {message}"
    print(line, file=sys.stderr, flush=True)
