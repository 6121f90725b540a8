"""`ember serve --ray`: start a local Ray instance (or join the cluster at `--ray-address`),
deploy the application, serve until a signal, then drain.

Drain: the first SIGTERM, SIGINT or SIGHUP puts a stand-in in the ingress's place
(`ember.cluster.draining`: new requests get 503 with Retry-After, where deleting the
application would leave Ray's proxy answering 404), waits for the ingress replicas to
finish, then deletes the engine's application (`ember.cluster.app`). Ray stops each
replica only once it holds no ongoing request (within `GRACEFUL_SHUTDOWN_S`): the ingress
replicas answer every request they took, on engine replicas still running; then the
engine replicas drain their workers. Everything accepted is answered. A second signal
exits at once (a second SIGHUP is none: a closing terminal sends two).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace
from types import FrameType

import ray
from ray import serve

from ember.adapters.base import usable_cores
from ember.cluster.app import (
    APP,
    ENGINE_APP,
    GRACEFUL_SHUTDOWN_S,
    INGRESS,
    SHUTDOWN_POLL_S,
    build_draining,
    build_engine,
    build_ingress,
)
from ember.config import RaySettings, ServerSettings
from ember.ipc.lifeline import drain_on_stop_signals, repeated_hangup
from ember.supervisor import listening_socket

log = logging.getLogger("ember.cluster")
EXTRA_SLOTS = 2  # logical CPUs of a local instance beyond one per engine replica
REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"  # Serve's replica actors: <prefix><app>#<name>#<id>


def local_cpus(ray_settings: RaySettings) -> int:
    """Logical CPU slots for a local instance: each engine replica asks for one, and Ray
    schedules by slots, not by load, so there must be one per replica it may start."""
    if ray_settings.num_cpus is not None:
        return ray_settings.num_cpus
    most = max(ray_settings.replicas, ray_settings.max_replicas or 0,
               ray_settings.min_replicas or 0)
    return max(os.cpu_count() or 1, most + EXTRA_SLOTS)


def with_cores_shared(settings: ServerSettings, cores: int) -> ServerSettings:
    """On a local instance, CPU engine replicas share the machine's cores: each takes an
    equal share of them for torch's and ONNX Runtime's threads, for as many replicas as
    may run, unless a flag sets the threads (each defaulted to every core, so N replicas
    ran N times as many busy threads as there are cores). On a cluster Ray places the
    replicas, so each keeps its node's default."""
    ray_settings = settings.ray or RaySettings()
    most = max(ray_settings.replicas, ray_settings.max_replicas or 0,
               ray_settings.min_replicas or 0)
    if ray_settings.address is not None or settings.device != "cpu" or most <= 1:
        return settings
    share = max(1, cores // most)
    return replace(settings, torch_threads=settings.torch_threads or share,
                   onnx_threads=settings.onnx_threads or share)


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
    settings = with_cores_shared(settings, usable_cores())
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
        drain(settings, joined=ray_settings.address is not None)
        log.info("drained in %.2f s; exiting", time.monotonic() - started)
        return 0
    finally:
        if ray_settings.address is None:  # the instance is ours: take it down
            serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def drain(settings: ServerSettings, joined: bool) -> None:
    """The ingress first, behind the stand-in, then the engine (the module's docstring);
    on a cluster we `joined`, which goes on, the stand-in goes too."""
    try:
        if not ingress_replicas():  # named otherwise by this Ray: no way to wait for them
            raise LookupError("no ingress replica found by name")
        serve.run(build_draining(settings), name=APP, route_prefix="/")
        deadline = time.monotonic() + GRACEFUL_SHUTDOWN_S + SHUTDOWN_POLL_S
        while ingress_replicas() and time.monotonic() < deadline:
            time.sleep(SHUTDOWN_POLL_S)
    except Exception as exc:  # the way without the stand-in: the same drain, with 404s
        log.warning("draining without the stand-in (%s: %s): requests that arrive now get "
                    "Ray's 404", type(exc).__name__, exc)
        serve.delete(APP)  # returns once every ingress replica answered what it took
    serve.delete(ENGINE_APP)  # then every engine replica drains its workers
    if joined:
        serve.delete(APP)  # a local instance goes down with the stand-in in it


def ingress_replicas() -> int:
    """The ingress replicas still alive (the old ones, while they finish behind the
    stand-in), by the actor names Serve gives them."""
    prefix = f"{REPLICA_ACTOR_PREFIX}{APP}#{INGRESS}#"
    return sum(actor["name"].startswith(prefix)
               for actor in ray.util.list_named_actors(all_namespaces=True))


def describe(ray_settings: RaySettings) -> str:
    if ray_settings.autoscaling:
        return (f"engine replicas autoscaled from {ray_settings.min_replicas or 1} to "
                f"{ray_settings.max_replicas or ray_settings.min_replicas}")
    return f"{ray_settings.replicas} engine replicas"
