"""Liveness, readiness and the model list."""

from typing import Any

from aiohttp import web

from bubo.server.errors import ApiError
from bubo.server.keys import STATE
from bubo.server.state import ServerState

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


def _model_entry(state: ServerState, model_id: str) -> dict[str, Any]:
    """One model in OpenAI's shape, with the context size under the names other servers use."""
    n_ctx = state.context_length
    return {
        "id": model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "bubo",
        "context_length": n_ctx,
        "max_model_len": n_ctx,
        "meta": {"n_ctx": n_ctx},
        # Images only with a vision tower (--mmproj), which loads with the model.
        "architecture": {"input_modalities": ["text", "image"] if state.tower is not None else ["text"]},
    }


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_entry(state, i) for i in state.served_ids]})


async def model(request: web.Request) -> web.Response:
    """One served model by id (the SDKs' models.retrieve); 404 model_not_found for any other id."""
    state = request.app[STATE]
    return web.json_response(_model_entry(state, state.resolve_model(request.match_info["model_id"])))


def routes() -> list[web.RouteDef]:
    return [
        *(web.get(path, health) for path in ("/health", "/v1/health", "/healthz")),
        *(web.get(path, ready) for path in ("/ready", "/v1/ready", "/readyz")),
        *(web.get(path, models) for path in ("/v1/models", "/models")),
        *(web.get(path, model) for path in ("/v1/models/{model_id:.+}", "/models/{model_id:.+}")),
    ]
