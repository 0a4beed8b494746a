"""Liveness, readiness and the model list."""

from aiohttp import web

from bubo.server.errors import ApiError
from bubo.server.keys import STATE

__all__ = ["routes"]


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.device_lost:
        state.require_ready()
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        state.require_ready()
    except ApiError as error:
        error.top_level.setdefault("status", error.code)
        raise
    return web.json_response({"status": "ready", "model": state.model_id})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    n_ctx = state.context_length
    entry = {
        "object": "model",
        "created": state.created,
        "owned_by": "bubo",
        "context_length": n_ctx,
        "max_model_len": n_ctx,
        "meta": {"n_ctx": n_ctx},
        # Images only with a vision tower (--mmproj), which loads with the model.
        "architecture": {"input_modalities": ["text", "image"] if state.tower is not None else ["text"]},
    }
    return web.json_response({"object": "list", "data": [{"id": i, **entry} for i in state.served_ids]})


def routes() -> list[web.RouteDef]:
    return [
        *(web.get(path, health) for path in ("/health", "/v1/health", "/healthz")),
        *(web.get(path, ready) for path in ("/ready", "/v1/ready", "/readyz")),
        *(web.get(path, models) for path in ("/v1/models", "/models")),
    ]
