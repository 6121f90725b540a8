"""`ember serve --ray`: start a local Ray instance (or join the cluster at `--ray-address`),
deploy the application, serve until a signal, then drain.

Drain: the first SIGTERM, SIGINT or SIGHUP deletes the ingress application, then the engine's
(`ember.cluster.app`). Ray stops each replica only once it holds no ongoing request
(within `GRACEFUL_SHUTDOWN_S`): the ingress replicas answer every request they took, on
engine replicas still running; then the engine replicas drain their workers. Everything
accepted is answered. A second signal exits at once (a second SIGHUP is none: a closing
terminal sends two).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

import ray
from ray import serve

from ember.cluster.app import APP, ENGINE_APP, build_engine, build_ingress
from ember.config import RaySettings, ServerSettings
from ember.ipc.lifeline import drain_on_stop_signals, repeated_hangup
from ember.supervisor import listening_socket

log = logging.getLogger("ember.cluster")
EXTRA_SLOTS = 2  # logical CPUs of a local instance beyond one per engine replica


def local_cpus(ray_settings: RaySettings) -> int:
    """Logical CPU slots for a local instance: each engine replica asks for one, and Ray
    schedules by slots, not by load, so there must be one per replica it may start."""
    if ray_settings.num_cpus is not None:
        return ray_settings.num_cpus
    most = max(ray_settings.replicas, ray_settings.max_replicas or 0,
               ray_settings.min_replicas or 0)
    return max(os.cpu_count() or 1, most + EXTRA_SLOTS)


def start_ray(ray_settings: RaySettings) -> None:
    if ray_settings.address is None:
        # Local: no dashboard; the replicas inherit this environment. (Ray's own ports
        # use the node's address; Ember's HTTP port is the proxy's, on --host.)
        ray.init(num_cpus=local_cpus(ray_settings), include_dashboard=False)
    else:
        ray.init(address=ray_settings.address)
    log.info("Ray cluster at %s", ray.get_runtime_context().gcs_address)


def serve_on_ray(settings: ServerSettings) -> int:
    ray_settings = settings.ray or RaySettings()
    # Ray's proxy binds the port later; a taken one is one line and exit code 1 now.
    if (sock := listening_socket(settings)) is None:
        return 1
    sock.close()
    stop = threading.Event()
    signals = 0

    def on_signal(sig: int, frame: FrameType | None) -> None:
        nonlocal signals
        if repeated_hangup(sig, stopping=signals > 0):
            return
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info("%s: draining the application", signal.Signals(sig).name)
        stop.set()

    start_ray(ray_settings)
    drain_on_stop_signals(on_signal)  # after ray.init, which sets its own
    try:
        # The cluster's HTTP options are set by whoever starts Serve on it first.
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_engine(settings), name=ENGINE_APP, route_prefix=None)
        serve.run(build_ingress(settings, ENGINE_APP), name=APP, route_prefix="/")
        log.info("Ember listening on http://%s:%d (Ray Serve: %s; default model %s; "
                 "/docs for the API)", settings.host, settings.port,
                 describe(ray_settings), settings.default_model)
        while not stop.wait(1.0):
            pass
        started = time.monotonic()
        serve.delete(APP)  # returns once every ingress replica answered what it took
        serve.delete(ENGINE_APP)  # then every engine replica drains its workers
        log.info("drained in %.2f s; exiting", time.monotonic() - started)
        return 0
    finally:
        if ray_settings.address is None:  # the instance is ours: take it down
            serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def describe(ray_settings: RaySettings) -> str:
    if ray_settings.autoscaling:
        return (f"engine replicas autoscaled from {ray_settings.min_replicas or 1} to "
                f"{ray_settings.max_replicas or ray_settings.min_replicas}")
    return f"{ray_settings.replicas} engine replicas"
