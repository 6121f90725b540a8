"""The Serve config file (deploy/ray/ember.yaml) and the KubeRay manifest
(deploy/kuberay/rayservice.yaml) hold valid Serve configs whose applications build:
Ray's own schema validates them, and each `import_path` builds with its `args` into the
two deployments Ember runs. (Building needs no cluster; `ember serve --ray` runs them in
the other tests of this folder.)"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("ray.serve", reason="the ray extra is not installed")

from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from ember.cluster.app import ENGINE, ENGINE_APP, INGRESS

REPO = Path(__file__).resolve().parents[2]


def build(app: dict[str, Any]) -> Application:
    module, _, name = app["import_path"].partition(":")
    application = getattr(importlib.import_module(module), name)(app["args"])
    assert isinstance(application, Application)
    return application


def deployments(config: dict[str, Any]) -> dict[str, Any]:
    """Application name -> its ingress deployment, built from the config."""
    ServeDeploySchema.model_validate(config)  # Ray's own validation of the file
    return {app["name"]: build(app)._bound_deployment for app in config["applications"]}


def test_the_serve_config_file_builds_the_engine_and_the_ingress() -> None:
    config = yaml.safe_load((REPO / "deploy/ray/ember.yaml").read_text(encoding="utf-8"))
    built = deployments(config)
    assert set(built) == {ENGINE_APP, "ember"}
    engine, ingress = built[ENGINE_APP], built["ember"]
    assert engine.name == ENGINE and ingress.name == INGRESS
    assert engine.num_replicas == 1
    ray = config["applications"][0]["args"]["ray"]
    assert engine.max_ongoing_requests == ray["max_ongoing_requests"]
    assert engine.max_queued_requests == ray["max_queued_requests"]
    assert "num_gpus" not in engine.ray_actor_options  # device: cpu
    ingress_app = config["applications"][1]
    assert ingress_app["args"]["engine_app"] == ENGINE_APP
    assert ingress_app["route_prefix"] == "/" and config["applications"][0]["route_prefix"] is None


def test_the_kuberay_manifest_asks_a_gpu_for_each_engine_replica() -> None:
    manifest = yaml.safe_load((REPO / "deploy/kuberay/rayservice.yaml").read_text(
        encoding="utf-8"))
    assert manifest["kind"] == "RayService"
    built = deployments(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    engine = built[ENGINE_APP]
    assert engine.ray_actor_options["num_gpus"] == 1  # device: cuda
    autoscaling = engine._deployment_config.autoscaling_config
    assert autoscaling is not None and autoscaling.max_replicas >= 2
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"][
        "workerGroupSpecs"]}
    [container] = groups["gpu"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert groups["gpu"]["maxReplicas"] >= autoscaling.max_replicas


def test_unknown_settings_in_a_config_file_are_refused() -> None:
    with pytest.raises(ValueError, match="max_replica"):
        build({"import_path": "ember.cluster.app:engine", "args": {"max_replica": 2}})


@pytest.mark.parametrize("args, message", [
    ({"ray": {"min_replicas": 3, "max_replicas": 2}}, "--min-replicas 3 is over"),
    ({"device": "cuda:1"}, "use --device cuda"),
])
def test_a_config_file_is_checked_as_the_flags_are(args: dict[str, Any], message: str) -> None:
    """Found by a review of the Ray path: `ember serve --ray` refused these, a Serve config
    file deployed them (a GPU index past 0 then failed every load)."""
    with pytest.raises(ValueError, match=message):
        build({"import_path": "ember.cluster.app:engine", "args": args})


def test_a_hub_id_or_a_folder_in_a_config_file_is_served_as_the_flags_serve_it(
        tmp_path: Path) -> None:
    """`ember serve --default-model org/name` serves a Hub id no YAML describes, and a
    folder as `local/<folder>`; a Serve config file's `default_model` and `preload` left
    both out of every replica's catalog."""
    from ember.cluster.app import settings_from_args

    folder = tmp_path / "my-encoder"
    folder.mkdir()
    settings = settings_from_args({"default_model": "org/new-encoder",
                                   "preload": [str(folder)]})
    assert settings.default_model == "org/new-encoder"
    assert settings.preload == ("local/my-encoder",)
    assert {str(path) for path in settings.model_paths} == {"org/new-encoder", str(folder)}


def test_a_config_file_answers_any_host_unless_its_args_name_them() -> None:
    """Its proxy's address is the file's http_options, which the settings never see: the
    loopback-only default of `ember serve` would refuse every request a KubeRay Service
    sends (Host: ember-serve-svc)."""
    from ember.cluster.app import settings_from_args

    assert settings_from_args({}).answered_hosts is None
    for given in (["ember.example.com"], "ember.example.com"):  # a list, or one name
        named = settings_from_args({"allowed_hosts": given}).answered_hosts
        assert named is not None and "ember.example.com" in named and "e" not in named
