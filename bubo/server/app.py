"""The aiohttp application: middlewares (CORS preflight, request id, errors, API key, body limit), the
route table, the runner (with explicit request-header limits), and `serve`, which opens the port at
once, loads the model behind it and shuts down gracefully on SIGTERM or SIGINT."""

import asyncio
import hmac
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from bubo.engine.request_error import RequestError
from bubo.server import anthropic, debug, health, llama, metrics, openai, responses, tokenize
from bubo.server.connections import ConnectionLimits, ServerRunner, connection_cap, raise_open_files_limit
from bubo.server.errors import ANTHROPIC_PATHS, ApiError, error_response, request_refused
from bubo.server.hosts import is_loopback
from bubo.server.keys import REQUEST_ID, STATE
from bubo.server.request_context import CURRENT_API_KEY, CURRENT_REQUEST_ID, new_id
from bubo.server.request_log import announce, request_log_middleware
from bubo.server.settings import ServerSettings
from bubo.server.state import ServerState
from bubo.templates.chat_template import TemplateSandboxError

__all__ = ["create_app", "create_runner", "exposure_warning", "serve"]

log = logging.getLogger("bubo.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Routes of llama-server / OpenAI that a text model does not serve: they exist, and say so.
# llama-server serves the OpenAI paths without /v1 too.
NOT_IMPLEMENTED = (
    "/v1/embeddings",
    "/embeddings",
    "/v1/rerank",
    "/v1/reranking",
    "/reranking",
    "/rerank",
    "/infill",
)

# Request-head limits, stated rather than left to aiohttp's defaults. A request over them is refused
# before any handler runs: 400 parse_error (431 for too many headers), bubo/server/connections.py.
MAX_HEADERS = 100
MAX_FIELD_SIZE = 8190  # bytes of one header line, name and value
MAX_LINE_SIZE = 8190  # bytes of the request line (method, path, version)
# After the grace period, streams still running are cut with an error event; this is how long they get
# to send it before aiohttp cancels what is left.
CUTOFF_SECONDS = 3.0

CORS_ALLOWED_HEADERS = (
    "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, x-request-id"
)
CORS_EXPOSED_HEADERS = "x-request-id, Retry-After, WWW-Authenticate"


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give every request an id and turn every failure into the documented error shape."""
    request_id = request.headers.get("x-request-id") or new_id("req_")
    request[REQUEST_ID] = request_id
    CURRENT_REQUEST_ID.set(request_id)
    anthropic_shape = request.path in ANTHROPIC_PATHS
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error, anthropic=anthropic_shape, request_id=request_id)
    except RequestError as error:
        return error_response(request_refused(error), anthropic=anthropic_shape, request_id=request_id)
    except TemplateSandboxError as error:
        # The model file's template is at fault, not the request.
        log.error("the chat template was stopped: %s", error)
        stopped = ApiError(500, "template_error", f"the model's chat template was stopped: {error}")
        return error_response(stopped, anthropic=anthropic_shape, request_id=request_id)
    except web.HTTPException as http:
        return error_response(_from_http(http, request), anthropic=anthropic_shape, request_id=request_id)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("request %s (%s %s) failed", request_id, request.method, request.path)
        error = ApiError(500, "internal_error", f"internal server error (request id {request_id})")
        return error_response(error, anthropic=anthropic_shape, request_id=request_id)


def _from_http(http: web.HTTPException, request: web.Request) -> ApiError:
    if http.status == 404:
        return ApiError(404, "not_found", f"no such endpoint: {request.method} {request.path}")
    if http.status == 405:
        allowed = ", ".join(sorted(getattr(http, "allowed_methods", ()) or ()))
        return ApiError(
            405,
            "method_not_allowed",
            f"{request.method} is not allowed on {request.path}" + (f"; use {allowed}" if allowed else ""),
            headers={"Allow": allowed} if allowed else None,
        )
    if http.status == 413:
        limit = request.app[STATE].settings.max_body_mb
        return ApiError(
            413,
            "request_too_large",
            f"the request body is larger than the limit of {limit:g} MB (--max-body-mb)",
        )
    return ApiError(http.status, "http_error", http.reason or "HTTP error")


@web.middleware
async def body_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A body whose Content-Length is over the limit is refused at once (aiohttp would read up to the
    limit first, waiting as long as its sender takes)."""
    declared = request.content_length
    if declared is not None and declared > body_limit(request.app[STATE].settings):
        raise web.HTTPRequestEntityTooLarge(body_limit(request.app[STATE].settings), declared)
    return await handler(request)


def body_limit(settings: ServerSettings) -> int:
    """The largest request body taken, in bytes (--max-body-mb)."""
    return int(settings.max_body_mb * (1 << 20))


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With --api-key, every route needs `Authorization: Bearer KEY` or `x-api-key: KEY`."""
    keys = request.app[STATE].api_keys
    if keys:
        given = request.headers.get("x-api-key")
        authorization = request.headers.get("Authorization", "")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip()
        # compare_digest takes time independent of where the strings differ, and every key is compared,
        # so the time does not tell which key came close. Header bytes that are not UTF-8 reach us as
        # surrogate escapes, which plain encode() would refuse (a 500, not a 401).
        presented = (given or "").encode("utf-8", "surrogateescape")
        matches = [hmac.compare_digest(presented, key.encode()) for key in keys]
        if given is None or not any(matches):
            raise ApiError(
                401,
                "invalid_api_key",
                # Both headers are read on every route; Anthropic's clients send x-api-key.
                "a valid API key is required: send Authorization: Bearer KEY or x-api-key: KEY",
                type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        CURRENT_API_KEY.set(matches.index(True))
    return await handler(request)


def _allowed_origin(request: web.Request) -> str | None:
    """The value for Access-Control-Allow-Origin, when the request's Origin is one --cors-origin names."""
    origin = request.headers.get("Origin")
    allowed = request.app[STATE].settings.cors_origins
    if origin is None:
        return None
    if origin in allowed:
        return origin
    return "*" if "*" in allowed else None


@web.middleware
async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer a browser's preflight for an allowed origin (before the API key check: browsers send
    preflights without credentials). Other origins get no CORS headers, so browsers block them."""
    origin = _allowed_origin(request)
    if request.method == "OPTIONS" and origin and "Access-Control-Request-Method" in request.headers:
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": CORS_ALLOWED_HEADERS,
                "Access-Control-Max-Age": "600",
                "Vary": "Origin",
            },
        )
    return await handler(request)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    # On prepare, so streamed answers (whose headers go out before the body) get them too.
    origin = _allowed_origin(request)
    if origin:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED_HEADERS
        response.headers["Vary"] = "Origin"


@web.middleware
async def device_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """After a device loss, every POST answers 503 device_lost."""
    if request.method == "POST" and request.app[STATE].device_lost:
        request.app[STATE].require_ready()
    return await handler(request)


async def not_implemented(request: web.Request) -> web.Response:
    raise ApiError(501, "not_implemented", f"{request.path} is not implemented for a text model")


def create_app(state: ServerState) -> web.Application:
    settings = state.settings
    if settings.debug_hooks and not is_loopback(settings.host):
        raise ValueError(f"debug hooks are only served on a loopback host, not {settings.host}")
    middlewares = [errors_middleware, body_limit_middleware, auth_middleware, device_middleware]
    if settings.cors_origins:
        middlewares.insert(0, cors_middleware)
    # Outermost: it logs the status that went out, whatever answered.
    middlewares.insert(0, request_log_middleware)
    app = web.Application(middlewares=middlewares, client_max_size=body_limit(settings))
    if settings.cors_origins:
        app.on_response_prepare.append(_cors_headers)
    app[STATE] = state
    routes: list[web.RouteDef] = []
    for module in (health, openai, responses, anthropic, llama, tokenize, metrics):
        routes += module.routes()
    routes += [web.post(path, not_implemented) for path in NOT_IMPLEMENTED]
    routes.append(web.route("*", "/sdapi/v1/{tail:.*}", not_implemented))
    if state.settings.debug_hooks:
        routes += debug.routes()
    app.add_routes(routes)
    return app


class _ProtocolLog(logging.LoggerAdapter):
    """aiohttp's server log. A request aiohttp cannot parse (a bad Content-Length or chunk size, a
    Content-Encoding it cannot decode or a body that fails to decode) is the client's mistake, which aiohttp answers 400 itself before
    any middleware runs: one warning line, not an ERROR with a traceback."""

    def exception(self, msg: object, *args: object, exc_info: object = True, **kwargs: object) -> None:
        # A body it could not decode (a corrupt gzip) is raised again when aiohttp drains the rest of it
        # after the app's 400, as a RequestPayloadError.
        if isinstance(exc_info, HttpProcessingError | web.RequestPayloadError):
            self.warning(f"{msg}: %s", *args, exc_info)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


def create_runner(state: ServerState) -> web.AppRunner:
    """The runner `serve` uses: the app, its header limits, its connection limits and timeouts
    (bubo/server/connections.py), and the shutdown bound."""
    settings = state.settings
    limits = ConnectionLimits(
        settings.header_timeout, settings.idle_timeout, connection_cap(settings.max_connections)
    )
    return ServerRunner(
        create_app(state),
        limits=limits,
        handler_cancellation=True,
        access_log=None,
        logger=_ProtocolLog(logging.getLogger("aiohttp.server")),
        max_headers=MAX_HEADERS,
        max_field_size=MAX_FIELD_SIZE,
        max_line_size=MAX_LINE_SIZE,
        shutdown_timeout=state.settings.shutdown_grace + CUTOFF_SECONDS,
    )


def exposure_warning(settings: ServerSettings) -> str | None:
    """What to tell the operator when anyone on the network can use the server without a key."""
    if is_loopback(settings.host) or settings.api_key is not None:
        return None
    return (
        f"bubo: WARNING: listening on {settings.host}, beyond this machine, WITHOUT an API key: anyone who can\n"
        "bubo: WARNING: reach this port can run the model. Pass --api-key KEY, or keep --host 127.0.0.1."
    )


def serve(state: ServerState) -> int:
    """Open the port, load the model behind it, serve until interrupted; `state` has passed its
    preflight (so /v1/models reports the context size from the first moment). Returns the exit code."""
    code = asyncio.run(_serve(state))
    if any(thread.name == _LOAD_THREAD and thread.is_alive() for thread in threading.enumerate()):
        # Stopped while the model was still loading: the loading thread may be inside native code (the
        # kernel compiler, a read of the map), where the interpreter's teardown can abort the process.
        # Nothing is left to save, so leave at once with the code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


async def _serve(state: ServerState) -> int:
    settings = state.settings
    # Each connection is a descriptor: the soft limit (often 1024) is raised to the hard one.
    raise_open_files_limit()
    runner = create_runner(state)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
    except OSError as error:
        await runner.cleanup()
        announce(
            f"error: cannot listen on {settings.host}:{settings.port}: {error.strerror or error}", "error"
        )
        return 1
    # Before anything is printed: a supervisor that reads "listening" may signal at once.
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    announce(f"listening on http://{settings.host}:{settings.port} (loading {settings.model_path.name})")
    warning = exposure_warning(settings)
    if warning:
        announce(warning.replace("bubo: WARNING: ", "").replace("\n", " "), "warning", text=warning)
    loading = _load_in_background(state)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            if loading.exception() is not None:
                announce(f"error: cannot load {settings.model_path}: {loading.exception()}", "error")
                return 1
            announce(f"ready: serving '{state.model_id}' (also as 'bubo')")
            await stopping
        announce(
            f"stopping: no new connections; requests in flight get {settings.shutdown_grace:g} s to finish"
        )
        loop.call_later(settings.shutdown_grace, state.cutoff.end_streams)
        return 0
    finally:
        stopping.cancel()
        # Closes the port, waits for requests in flight (the cutoff ends streams at the grace period),
        # then cancels whatever is left.
        await runner.cleanup()


_LOAD_THREAD = "bubo-load"


def _load_in_background(state: ServerState) -> asyncio.Future[None]:
    """state.load on a daemon thread: a stop during a long load must not wait for it to finish, as
    the event loop's default executor would at exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def work() -> None:
        try:
            state.load()
        except BaseException as error:  # reported by _serve
            loop.call_soon_threadsafe(settle, error)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=work, name=_LOAD_THREAD, daemon=True).start()
    return done
