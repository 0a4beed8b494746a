"""Typed keys for what the app and each request carry."""

from aiohttp import web

from bubo.server.state import ServerState

STATE = web.AppKey("state", ServerState)
REQUEST_ID = web.RequestKey("request_id", str)
