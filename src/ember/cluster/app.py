"""The Ember applications for Ray Serve: the engine replicas, and the ingress over them.

They are two applications, not one, for the drain: stopping the ingress first lets every
accepted HTTP request finish on engine replicas that are still running (Ray deletes the
deployments of one application together, and a request still queued for an engine
replica that is stopping would have nowhere to go); the engine goes second, each replica
draining its workers. `ember serve --workers N` stops its processes in the same order.

`build_engine`/`build_ingress` are what `ember serve --ray` runs (and `build_draining` the
stand-in that takes the ingress's route in a drain: `ember.cluster.run`); `engine(args)` and
`ingress(args)` are the same applications for a Serve config file (`serve run
deploy/ray/ember.yaml`), `args` being `ember serve`'s settings by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from ember.cluster.draining import DRAINING, EmberDraining
from ember.cluster.engine import ENGINE, EmberEngine
from ember.cluster.ingress import EmberIngress
from ember.config import RaySettings, ServerSettings, load_catalog, with_hub_models
from ember.engine import WorkerConfig

APP = "ember"  # the HTTP application (the ingress)
ENGINE_APP = "ember-engine"
INGRESS = "EmberIngress"
INGRESS_MAX_ONGOING = 4096  # HTTP requests one ingress replica takes at once (Ray's default: 5)
GRACEFUL_SHUTDOWN_S = 120.0  # a replica being stopped finishes what it holds first ...
DRAIN_MARGIN_S = 10.0  # ... or, with --request-timeout-s, that and this (no request is cut)
SHUTDOWN_POLL_S = 0.5  # how often a stopping replica checks that it has finished


def autoscaling_config(ray: RaySettings, max_batch_items: int) -> dict[str, Any]:
    low = ray.min_replicas if ray.min_replicas is not None else 1
    # Ray averages the ongoing requests over `look_back_period_s` (30 s by default),
    # sampled every `metrics_interval_s` (10 s): with shorter delays the window shrinks
    # with them, or scaling would trail the delays by the window.
    window = max(1.0, min(30.0, ray.upscale_delay_s))
    return {"min_replicas": low, "max_replicas": max(low, ray.max_replicas or low),
            "target_ongoing_requests": ray.target(max_batch_items),
            "upscale_delay_s": ray.upscale_delay_s,
            "downscale_delay_s": ray.downscale_delay_s,
            "look_back_period_s": window, "metrics_interval_s": min(10.0, window / 2)}


def graceful_shutdown_s(settings: ServerSettings) -> float:
    """How long Ray lets a stopping replica finish what it holds before it kills it: past
    the longest a request may last where `--request-timeout-s` bounds it."""
    if settings.request_timeout_s is None:
        return GRACEFUL_SHUTDOWN_S
    return max(GRACEFUL_SHUTDOWN_S, settings.request_timeout_s + DRAIN_MARGIN_S)


def logging_config(settings: ServerSettings) -> dict[str, Any]:
    """Serve's own log lines at Ember's level; its access line per call only where Ember
    writes its own (info and below): writing and shipping it costs ~1 ms of CPU a call."""
    return {"log_level": settings.log_level.upper(),
            "enable_access_log": settings.log_level in ("debug", "info")}


def engine_options(settings: ServerSettings) -> dict[str, Any]:
    """The engine deployment's options: replicas (fixed or autoscaled), the requests each
    takes at once, its device, and a drain long enough for its queue."""
    ray = settings.ray or RaySettings()
    options: dict[str, Any] = {
        "name": ENGINE,
        "logging_config": logging_config(settings),
        "max_ongoing_requests": ray.ongoing(settings.worker.max_queue_items),
        "max_queued_requests": ray.queued(settings.worker.max_batch_items),
        "graceful_shutdown_timeout_s": graceful_shutdown_s(settings),
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
        # One replica per device: a GPU replica asks Ray for a whole GPU.
        "ray_actor_options": ({"num_gpus": 1, "num_cpus": 1}
                              if settings.device.startswith("cuda") else {"num_cpus": 1}),
    }
    if ray.autoscaling:
        options["autoscaling_config"] = autoscaling_config(ray, settings.worker.max_batch_items)
    else:
        options["num_replicas"] = ray.replicas
    return options


def ingress_options(settings: ServerSettings) -> dict[str, Any]:
    """`--workers N` keeps its meaning: N replicas doing the HTTP and tokenizing work."""
    return {"name": INGRESS, "num_replicas": max(1, settings.workers),
            "logging_config": logging_config(settings),
            "max_ongoing_requests": INGRESS_MAX_ONGOING,
            "graceful_shutdown_timeout_s": graceful_shutdown_s(settings),
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
            "ray_actor_options": {"num_cpus": 0}}  # light next to the engines it feeds


def build_draining(settings: ServerSettings) -> Application:
    """The stand-in that holds the ingress's route while it drains (`draining.py`)."""
    deployment = serve.deployment(name=DRAINING, num_replicas=1,
                                  logging_config=logging_config(settings),
                                  ray_actor_options={"num_cpus": 0})(EmberDraining)
    application: Application = deployment.bind()
    return application


def build_engine(settings: ServerSettings) -> Application:
    deployment = serve.deployment(**engine_options(settings))(EmberEngine)
    application: Application = deployment.bind(settings)
    return application


def build_ingress(settings: ServerSettings, engine_app: str = ENGINE_APP) -> Application:
    deployment = serve.deployment(**ingress_options(settings))(EmberIngress)
    application: Application = deployment.bind(settings, engine_app)
    return application


def settings_from_args(args: dict[str, Any]) -> ServerSettings:
    """ServerSettings from a config file's `args`: `ember serve`'s settings by name
    (`default_model`, `preload`, `model_dirs`, `max_loaded_models`, ...); `worker` takes
    WorkerConfig's fields and `ray` RaySettings' (replicas, autoscaling bounds)."""
    values = {k: v for k, v in args.items() if k != "engine_app"}
    unknown = set(values) - {f.name for f in dataclasses.fields(ServerSettings)}
    if unknown:
        raise ValueError(f"unknown Ember settings in the Serve config: {sorted(unknown)}")
    for name in ("model_dirs", "model_paths"):
        if name in values:
            values[name] = tuple(Path(p) for p in values[name])
    if "preload" in values:
        values["preload"] = tuple(values["preload"])
    # The proxy's address is the file's http_options, which these settings never see: any
    # Host is answered unless `allowed_hosts` says which (docs/scaling.md).
    hosts = values.get("allowed_hosts") or ["*"]
    values["allowed_hosts"] = (hosts,) if isinstance(hosts, str) else tuple(hosts)
    if values.get("cache_dir") is not None:
        values["cache_dir"] = Path(values["cache_dir"])
    values["worker"] = WorkerConfig(**values.get("worker", {}))
    ray = values["ray"] = RaySettings(**values.get("ray", {}))
    settings = ServerSettings(**values)
    if (problem := ray.problem(settings.device)) is not None:  # as `ember serve` refuses
        raise ValueError(f"Ember settings in the Serve config: {problem}")
    # A Hub id or a folder as `default_model` or in `preload`, as `ember serve` takes it.
    return with_hub_models(settings, load_catalog(settings.model_dirs))


def engine(args: dict[str, Any]) -> Application:
    """The engine application of a Serve config file (`import_path:
    ember.cluster.app:engine`)."""
    return build_engine(settings_from_args(args))


def ingress(args: dict[str, Any]) -> Application:
    """The ingress application of a Serve config file (`import_path:
    ember.cluster.app:ingress`); `engine_app` names the engine's application."""
    return build_ingress(settings_from_args(args), str(args.get("engine_app", ENGINE_APP)))
