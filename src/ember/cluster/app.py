"""The Ember application for Ray Serve: an ingress deployment over an engine deployment.

`build_app(settings)` is what `ember serve --ray` runs; `build(args)` is the same
application for a Serve config file (`serve run deploy/ray/ember.yaml`), its `args`
being `ember serve`'s flags by their settings names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from ember.cluster.engine import EmberEngine
from ember.cluster.ingress import EmberIngress
from ember.config import RaySettings, ServerSettings
from ember.engine import WorkerConfig

INGRESS_MAX_ONGOING = 4096  # HTTP requests one ingress replica takes at once (Ray's default: 5)
GRACEFUL_SHUTDOWN_S = 120.0  # a replica being stopped finishes what it holds first
SHUTDOWN_POLL_S = 0.5  # how often a stopping replica checks that it has finished


def engine_options(settings: ServerSettings) -> dict[str, Any]:
    """The engine deployment's options: replicas (fixed or autoscaled), the requests each
    takes at once, its device, and a drain long enough for its queue."""
    ray = settings.ray or RaySettings()
    options: dict[str, Any] = {
        "max_ongoing_requests": ray.max_ongoing_requests,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
        # One replica per device: a GPU replica asks Ray for a whole GPU.
        "ray_actor_options": ({"num_gpus": 1, "num_cpus": 1}
                              if settings.device.startswith("cuda") else {"num_cpus": 1}),
    }
    if ray.autoscaling:
        low = ray.min_replicas if ray.min_replicas is not None else 1
        options["autoscaling_config"] = {
            "min_replicas": low,
            "max_replicas": max(low, ray.max_replicas or low),
            "target_ongoing_requests": ray.target_ongoing_requests,
            "upscale_delay_s": ray.upscale_delay_s,
            "downscale_delay_s": ray.downscale_delay_s,
        }
    else:
        options["num_replicas"] = ray.replicas
    return options


def ingress_options(settings: ServerSettings) -> dict[str, Any]:
    """`--workers N` keeps its meaning: N replicas doing the HTTP and tokenizing work."""
    return {"num_replicas": max(1, settings.workers),
            "max_ongoing_requests": INGRESS_MAX_ONGOING,
            "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
            "ray_actor_options": {"num_cpus": 0}}  # light next to the engines it feeds


def build_app(settings: ServerSettings, engine: dict[str, Any] | None = None) -> Application:
    """The application for these settings; `engine` overrides engine deployment options
    (tests shorten the autoscaling delays)."""
    engine_deployment = serve.deployment(**{**engine_options(settings),
                                            **(engine or {})})(EmberEngine)
    ingress = serve.deployment(**ingress_options(settings))(EmberIngress)
    application: Application = ingress.bind(settings, engine_deployment.bind(settings))
    return application


def settings_from_args(args: dict[str, Any]) -> ServerSettings:
    """ServerSettings from a config file's `args`: `ember serve`'s flags by their settings
    names (`default_model`, `preload`, `model_dirs`, `max_loaded_models`, ...); `worker`
    takes WorkerConfig's fields and `ray` RaySettings' (replicas, autoscaling bounds)."""
    values = dict(args)
    unknown = set(values) - {f.name for f in dataclasses.fields(ServerSettings)}
    if unknown:
        raise ValueError(f"unknown Ember settings in the Serve config: {sorted(unknown)}")
    for name in ("model_dirs", "model_paths"):
        if name in values:
            values[name] = tuple(Path(p) for p in values[name])
    if "preload" in values:
        values["preload"] = tuple(values["preload"])
    if "cache_dir" in values and values["cache_dir"] is not None:
        values["cache_dir"] = Path(values["cache_dir"])
    values["worker"] = WorkerConfig(**values.get("worker", {}))
    values["ray"] = RaySettings(**values.get("ray", {}))
    return ServerSettings(**values)


def build(args: dict[str, Any]) -> Application:
    """The application builder a Serve config file names (`import_path:
    ember.cluster.app:build`)."""
    return build_app(settings_from_args(args))
