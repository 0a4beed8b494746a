"""The Ray Serve application of N replicas (`replicas_app`, also what a config file's builder returns)
and `serve_replicas`, which `bubo serve --replicas N` runs: Ray up, the application deployed on
--host:--port, then serving until SIGINT or SIGTERM."""

import signal
import threading

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from bubo.options import RuntimeOptions
from bubo.server.app import exposure_warning
from bubo.server.replicas.ingress import REPLICA_DEPLOYMENT, BuboIngress
from bubo.server.replicas.replica import BuboReplica
from bubo.server.replicas.router import PrefixAffinityRouter
from bubo.server.request_log import announce
from bubo.server.settings import ServerSettings

__all__ = ["APP_NAME", "replicas_app", "serve_replicas"]

APP_NAME = "bubo"
# Requests the ingress passes on at once: streams are long, and waiting is the replicas' to do.
INGRESS_ONGOING = 1000
# Requests a replica is sent per slot: beyond its slots they wait in its server's queue, where the
# prompt cache is (counted in llamacpp:requests_deferred).
ONGOING_PER_SLOT = 4


def replicas_app(settings: ServerSettings, options: RuntimeOptions, replicas: int) -> Application:
    """The ingress bound to `replicas` replicas of the server `settings` describe. Each replica asks Ray
    for as many CPUs as it runs threads (one without --threads), so Ray places them where the cores are."""
    replica = serve.deployment(
        BuboReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=replicas,
        max_ongoing_requests=ONGOING_PER_SLOT * settings.parallel,
        ray_actor_options={"num_cpus": settings.threads or 1},
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
    )
    ingress = serve.deployment(
        BuboIngress,
        name="BuboIngress",
        max_ongoing_requests=INGRESS_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replica.bind(settings, options))


def serve_replicas(settings: ServerSettings, options: RuntimeOptions, replicas: int) -> int:
    """Join the Ray cluster that is running (RAY_ADDRESS, or one `ray start` began on this machine) or
    start a local one, deploy, and serve until interrupted. Returns the exit code."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    context = ray.init()
    announce(f"ray cluster at {context.address_info['gcs_address']}")
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        announce(f"starting {replicas} replicas of {settings.model_path.name}")
        serve.run(replicas_app(settings, options, replicas), name=APP_NAME, route_prefix="/")
        announce(f"ready: listening on http://{settings.host}:{settings.port} with {replicas} replicas")
        warning = exposure_warning(settings)
        if warning:
            announce(warning.replace("bubo: WARNING: ", "").replace("\n", " "), "warning", text=warning)
        stop.wait()
        announce("stopping: the replicas finish what they serve, then Ray Serve lets them go")
        serve.delete(APP_NAME)
        return 0
    finally:
        ray.shutdown()
