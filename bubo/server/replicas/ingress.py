"""The ingress deployment: Ray Serve's HTTP proxy hands it each request, and it has one replica answer
through the replica deployment's handle (routed by bubo/server/replicas/router.py). Answers pass through
as the replica wrote them, streams event by event. A replica lost before or during its answer gives 503
replica_lost in the route's error shape; a stream already under way ends with that error as its
dialect's last event."""

import asyncio
from collections.abc import AsyncIterator

import ray
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from bubo.server.errors import ANTHROPIC_PATHS, ApiError, error_body
from bubo.server.replicas.forwarding import Forwarded, Head, routing_text
from bubo.server.replicas.lost import CutStream, replica_lost
from bubo.server.replicas.merged_metrics import merge_metrics
from bubo.server.replicas.replica import REPLICA_HEADER, end_to_end
from bubo.server.request_context import new_id

__all__ = ["METRICS_PATHS", "REPLICA_DEPLOYMENT", "BuboIngress", "replica_ids"]

REPLICA_DEPLOYMENT = "BuboReplica"
METRICS_PATHS = frozenset({"/metrics", "/v1/metrics"})
PROXY_HEADERS = frozenset({"x-request-id", "date", "server"})
# How long /metrics waits for one replica's answer before leaving it out.
SCRAPE_SECONDS = 10.0


def replica_ids(app_name: str) -> list[str]:
    """The replicas of the app's replica deployment that Ray has running or starting. Serve names each
    replica's actor SERVE_REPLICA::APP#DEPLOYMENT#ID in its namespace."""
    prefix = f"SERVE_REPLICA::{app_name}#{REPLICA_DEPLOYMENT}#"
    return sorted(
        actor["name"][len(prefix) :]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(prefix)
    )


def _headers(head: Head) -> dict[str, str]:
    """The replica's answer headers for the client, less those Ray Serve's proxy sets on every answer
    (x-request-id: the client's, or the one the proxy made and passed on to the replica)."""
    own = {name: value for name, value in head.headers if name.lower() not in PROXY_HEADERS}
    return {**own, REPLICA_HEADER: head.replica}


class BuboIngress:
    """The ingress deployment's class (the app builder makes it a deployment)."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self.replicas = replicas
        self.app_name = serve.get_replica_context().app_name

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        request_id = request.headers.get("x-request-id") or new_id("req_")
        headers = (
            *((name, value) for name, value in end_to_end(request.headers) if name.lower() != "x-request-id"),
            ("x-request-id", request_id),
        )
        if request.method == "GET" and path in METRICS_PATHS:
            return await self._metrics(headers)
        body = await request.body()
        path_qs = path + (f"?{request.url.query}" if request.url.query else "")
        prompt = routing_text(body) if request.method == "POST" else ""
        forwarded = Forwarded(request.method, path_qs, headers, body, prompt=prompt)
        answer: DeploymentResponseGenerator = self.replicas.options(stream=True).forward.remote(forwarded)
        try:
            head = await anext(answer)
            if head.is_stream:
                return StreamingResponse(
                    self._events(answer, path, request_id),
                    status_code=head.status,
                    headers=_headers(head),
                )
            content = b"".join([chunk async for chunk in answer])
        except RayError as error:
            answer.cancel()
            return self._error(replica_lost(type(error).__name__), path, request_id)
        except asyncio.CancelledError:
            # The client left before the answer began: the replica's server stops generating.
            answer.cancel()
            raise
        return Response(content, status_code=head.status, headers=_headers(head))

    async def _events(
        self, answer: DeploymentResponseGenerator, path: str, request_id: str
    ) -> AsyncIterator[bytes]:
        stream = CutStream(path, request_id)
        try:
            async for event in answer:
                yield event
                stream.saw(event)
        except RayError as error:
            yield stream.end(replica_lost(type(error).__name__))
        finally:
            # The client left (or the stream ended): the replica's call ends with it, and the replica's
            # server sees its client go and stops generating.
            answer.cancel()

    async def _metrics(self, headers: tuple[tuple[str, str], ...]) -> Response:
        ids = replica_ids(self.app_name)
        texts = {}
        for replica in ids:
            # One at a time: Ray's router matches a routed call to its request by the request id, which
            # calls made at once for one HTTP request share, so a second one would wait for ever.
            answer = await self._scrape(replica, headers)
            if answer is None:
                continue
            head, content = answer
            if head.status != 200:
                # The replicas' own refusal (a wrong API key, a model not loaded) is the answer.
                return Response(content, status_code=head.status, headers=_headers(head))
            texts[head.replica] = content.decode()
        return Response(
            merge_metrics(texts),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def _scrape(self, replica: str, headers: tuple[tuple[str, str], ...]) -> tuple[Head, bytes] | None:
        """One replica's /metrics; None when it does not answer in time or another replica did (the
        router sends a request naming a replica it does not know yet, one still loading, elsewhere)."""
        forwarded = Forwarded("GET", "/metrics", headers, b"", replica=replica)
        answer: DeploymentResponseGenerator = self.replicas.options(stream=True).forward.remote(forwarded)

        async def read() -> tuple[Head, bytes]:
            head = await anext(answer)
            return head, b"".join([chunk async for chunk in answer])

        try:
            head, content = await asyncio.wait_for(read(), SCRAPE_SECONDS)
        except (RayError, TimeoutError):
            answer.cancel()
            return None
        return (head, content) if head.replica == replica else None

    def _error(self, error: ApiError, path: str, request_id: str) -> Response:
        body = error_body(error, anthropic=path in ANTHROPIC_PATHS, request_id=request_id)
        return JSONResponse(body, status_code=error.status, headers=error.headers)
