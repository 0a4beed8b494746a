"""The aiohttp application: middlewares (request id, errors, API key, body limit), the route table,
and `serve`, which opens the port at once and loads the model behind it."""

import asyncio
import hmac
import ipaddress
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web

from bubo.server import anthropic, debug, health, llama, metrics, openai, responses
from bubo.server.errors import ApiError, error_response
from bubo.server.keys import REQUEST_ID, STATE
from bubo.server.state import ServerSettings, ServerState, new_id

__all__ = ["create_app", "is_loopback", "serve"]

log = logging.getLogger("bubo.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
# Routes of llama-server / OpenAI that a text model does not serve: they exist, and say so.
NOT_IMPLEMENTED = ("/v1/embeddings", "/v1/rerank", "/v1/reranking", "/rerank", "/infill")


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give every request an id and turn every failure into the documented error shape."""
    request_id = request.headers.get("x-request-id") or new_id("req_")
    request[REQUEST_ID] = request_id
    anthropic_shape = request.path in ANTHROPIC_PATHS
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error, anthropic=anthropic_shape, request_id=request_id)
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
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With --api-key, every route needs `Authorization: Bearer KEY` or `x-api-key: KEY`."""
    key = request.app[STATE].settings.api_key
    if key is not None:
        given = request.headers.get("x-api-key")
        authorization = request.headers.get("Authorization", "")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer":
            given = token.strip()
        # compare_digest takes time independent of where the strings differ.
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(
                401,
                "invalid_api_key",
                "a valid API key is required: send Authorization: Bearer KEY",
                type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)


@web.middleware
async def device_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """After a device loss, every POST answers 503 device_lost."""
    if request.method == "POST" and request.app[STATE].device_lost:
        request.app[STATE].require_ready()
    return await handler(request)


async def not_implemented(request: web.Request) -> web.Response:
    raise ApiError(501, "not_implemented", f"{request.path} is not implemented for a text model")


def create_app(state: ServerState) -> web.Application:
    client_max_size = int(state.settings.max_body_mb * (1 << 20))
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware, device_middleware], client_max_size=client_max_size
    )
    app[STATE] = state
    routes: list[web.RouteDef] = []
    for module in (health, openai, responses, anthropic, llama, metrics):
        routes += module.routes()
    routes += [web.post(path, not_implemented) for path in NOT_IMPLEMENTED]
    routes.append(web.route("*", "/sdapi/v1/{tail:.*}", not_implemented))
    if state.settings.debug_hooks:
        routes += debug.routes()
    app.add_routes(routes)
    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(settings: ServerSettings) -> int:
    """Open the port, load the model behind it, serve until interrupted. Returns the exit code."""
    return asyncio.run(_serve(settings))


async def _serve(settings: ServerSettings) -> int:
    state = ServerState(settings)
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
    except OSError as error:
        await runner.cleanup()
        print(
            f"bubo: error: cannot listen on {settings.host}:{settings.port}: {error.strerror or error}",
            file=sys.stderr,
        )
        return 1
    print(
        f"bubo: listening on http://{settings.host}:{settings.port} (loading {settings.model_path.name})",
        file=sys.stderr,
        flush=True,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    loading = loop.run_in_executor(None, state.load)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            if loading.exception() is not None:
                print(
                    f"bubo: error: cannot load {settings.model_path}: {loading.exception()}", file=sys.stderr
                )
                return 1
            print(f"bubo: ready: serving '{state.model_id}' (also as 'bubo')", file=sys.stderr, flush=True)
            await stopping
        return 0
    finally:
        stopping.cancel()
        await runner.cleanup()
