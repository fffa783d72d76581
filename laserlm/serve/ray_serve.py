"""Scale-out on Ray Serve: N replicas of the laserlm server behind Ray Serve's HTTP proxy.

Each replica is a Ray actor that loads the model and runs its own engine thread, KV pool and metrics (the app of
:func:`laserlm.serve.app.build_app`, built inside the replica through ``serve.ingress``'s deferred builder
``__serve_build_asgi_app__``). Ray Serve's proxy spreads requests over the replicas; nothing of laserlm's own
balances load. ``GET /metrics`` answers from the replica that takes the request, so scrape each replica (Ray's
own metrics export) for totals.

Usage::

    from laserlm.serve.ray_serve import deploy
    handle = deploy(ServerSettings(model="smollm2-135m"), replicas=2, port=8000)   # ray.init() first, or RAY_ADDRESS

or ``laserlm serve --replicas 2``.
"""

from __future__ import annotations

import sys
import time


def deployment(settings, replicas: int = 2, num_cpus: float = 1.0):
    """The Ray Serve application (``Deployment.bind()``) of ``replicas`` laserlm servers.

    Args:
        settings: :class:`~laserlm.serve.app.ServerSettings` every replica builds.
        replicas: number of replicas (Ray actors).
        num_cpus: CPUs Ray reserves per replica.
    """
    from ray import serve  # noqa: PLC0415

    @serve.deployment(name="laserlm", num_replicas=replicas, ray_actor_options={"num_cpus": num_cpus},
                      max_ongoing_requests=max(8, settings.max_batch + settings.max_queue))
    @serve.ingress()
    class LaserLMReplica:
        def __init__(self, settings):
            self.settings = settings

        def __serve_build_asgi_app__(self):
            from laserlm.serve.app import build_app  # noqa: PLC0415

            return build_app(self.settings)

    return LaserLMReplica.bind(settings)


def deploy(settings, replicas: int = 2, host: str = "127.0.0.1", port: int = 8000, num_cpus: float = 1.0):
    """Start Ray Serve's HTTP proxy on ``host:port`` and run ``replicas`` replicas on the connected Ray cluster
    (``ray.init()`` first, or one is started locally); returns the ingress handle once every replica is up."""
    from ray import serve  # noqa: PLC0415

    serve.start(http_options={"host": host, "port": port})
    return serve.run(deployment(settings, replicas, num_cpus), name="laserlm", route_prefix="/")


def run_replicas(settings, replicas: int, host: str, port: int, num_cpus: float = 1.0) -> int:
    """``laserlm serve --replicas N``: start (or join, with ``RAY_ADDRESS``) a Ray cluster, deploy, serve until
    interrupted, then shut Serve and Ray down."""
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    ray.init(include_dashboard=False, log_to_driver=True)
    try:
        deploy(settings, replicas, host, port, num_cpus)
        print(f"laserlm: {replicas} replicas of {settings.name} behind Ray Serve on http://{host}:{port}/v1",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
