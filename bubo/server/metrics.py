from aiohttp import web


def routes() -> list[web.RouteDef]:
    return []
